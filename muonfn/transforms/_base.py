"""The Transform contract: a pair of pure functions over TensorDicts."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from tensordict import TensorDict, TensorDictBase

from .. import _tree


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
    """``params + updates`` leaf by leaf; leaves without an update are returned as they are."""
    keys = _tree.leaf_keys(updates)
    return _tree.carry(params, _tree.subset(params, keys).add(updates))
