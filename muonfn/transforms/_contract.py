"""The Transform contract: a pair of pure functions over TensorDicts.

``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``. Every
transform of this package is a :class:`Transform`; it is written as a :class:`~muonfn.Rule`
over flat ``{key: tensor}`` dicts (:mod:`._rules`), which is also how a user writes one that
runs on the fast path.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from tensordict import TensorDict, TensorDictBase


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
