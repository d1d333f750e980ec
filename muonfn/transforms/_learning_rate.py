"""The learning rate: a number, a 0-d tensor or a schedule."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _tree
from .._validation import Scalar, ScalarOrSchedule, check_inputs, checked_schedule, non_negative
from ._arithmetic import neg, scaled
from ._base import Transform, empty_state
from ._state import COUNT, check_entries


def _scaled_by_schedule(grads: TensorDictBase, lr: Scalar, *, inplace: bool) -> TensorDictBase:
    """``grads * -lr`` for a schedule's ``lr``: a number, a 0-d tensor, or one value per ensemble member."""
    if isinstance(lr, torch.Tensor) and lr.ndim:
        if not grads.batch_dims or lr.shape != grads.batch_size:
            raise ValueError(
                f"the learning rate schedule returned a tensor of shape {tuple(lr.shape)}; it must be 0-d"
                + (f" or of the ensemble's batch size {tuple(grads.batch_size)}" if grads.batch_dims else "")
            )
        factor = _tree.per_member(lr.neg(), grads)
        return grads.mul_(factor) if inplace else grads.mul(factor)
    return scaled(grads, neg(lr), inplace=inplace)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, inplace: bool = False) -> Transform:
    r""":math:`u \leftarrow -\eta\, u`, so that ``apply_updates`` descends.

    Args:
        learning_rate: a float, a 0-d tensor (change it in place between steps: no
            recompilation), or a schedule ``step -> lr`` called with the 0-d int64 count of
            previous updates (state ``{"count": ...}`` then). A schedule that returns a
            Python number is checked at each call (finite, ``>= 0``); a tensor it returns
            is used as it is, since reading it would wait for the device (only its shape is
            checked: 0-d, or for a stacked ensemble one value per member, as its count is).
        inplace: scale the incoming updates in place, as :func:`add_decayed_weights` does.

    Returns:
        A :class:`Transform`, stateless unless ``learning_rate`` is a schedule.
    """
    non_negative("learning rate", learning_rate)

    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        schedule = checked_schedule("learning rate", learning_rate)

        def init(params: TensorDictBase) -> TensorDictBase:
            device = next(iter(params.values(True, True)), torch.empty(0)).device
            return TensorDict(
                {COUNT: torch.zeros(params.batch_size, dtype=torch.int64, device=device)},
                batch_size=params.batch_size,
            )

        def update(
            grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
        ) -> tuple[TensorDictBase, TensorDictBase]:
            check_inputs("scale_by_learning_rate", grads, state, params)
            check_entries("scale_by_learning_rate", state, (COUNT,))
            count = state[COUNT]
            updates = _scaled_by_schedule(grads, schedule(count), inplace=inplace)
            return updates, TensorDict({COUNT: count + 1}, batch_size=state.batch_size)

        return Transform(init, update)

    lr = learning_rate

    def scale(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_inputs("scale_by_learning_rate", grads, state, params)
        return scaled(grads, neg(lr), inplace=inplace), state

    return Transform(empty_state, scale)
