"""The Transform contract: a pair of pure functions over TensorDicts."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from tensordict import TensorDict, TensorDictBase

from .. import _tree
from .._keys import dotted


class InitFn(Protocol):
    def __call__(self, params: TensorDictBase) -> TensorDictBase: ...


class UpdateFn(Protocol):
    def __call__(
        self, grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]: ...


class Transform(NamedTuple):
    """A gradient transformation: ``init(params) -> state`` and
    ``update(grads, state, params=None) -> (updates, state)``.

    Both are pure: they read their inputs and return new TensorDicts. ``grads`` may
    omit leaves (parameters without a gradient): no update is emitted for them and
    their state is carried over unchanged, as ``torch.optim`` does for ``p.grad is None``.
    """

    init: InitFn
    update: UpdateFn


def empty_state(params: TensorDictBase) -> TensorDict:
    """The state of a stateless transform."""
    return TensorDict({}, batch_size=params.batch_size)


def apply_updates(params: TensorDictBase, updates: TensorDictBase) -> TensorDictBase:
    """``params + updates`` leaf by leaf; leaves without an update are returned as they are.

    Every update must have its parameter's shape (a ``(4, 1)`` update would broadcast into a
    ``(4, 3)`` parameter) and name a parameter: else a ``ValueError`` names the leaf, before
    anything is computed. Each result keeps its parameter's dtype: where an update's dtype
    differs, the sum is taken in the promoted dtype and cast back, as optax does (an fp32
    parameter stays fp32 under fp64 updates).
    """
    keys = _tree.leaf_keys(updates)
    known = dict(zip(_tree.leaf_keys(params), _tree.leaves(params)))
    recast = []
    for key, u in zip(keys, _tree.leaves(updates)):
        p = known.get(key)
        if p is None:
            raise ValueError(f"apply_updates: update {dotted(key)!r} has no matching parameter")
        if u.shape != p.shape:
            raise ValueError(
                f"apply_updates: update {dotted(key)!r} has shape {tuple(u.shape)}, the parameter {tuple(p.shape)}"
            )
        if u.dtype != p.dtype:
            recast.append(key)
    summed = _tree.subset(params, keys).add(updates)
    if recast:  # a cast for each leaf whose dtype was promoted, none for the others
        cast, summed_keys = set(recast), _tree.leaf_keys(summed)
        values = [v.to(known[k].dtype) if k in cast else v for k, v in zip(summed_keys, _tree.leaves(summed))]
        summed = _tree.build(summed_keys, values, summed)
    return _tree.carry(params, summed)
