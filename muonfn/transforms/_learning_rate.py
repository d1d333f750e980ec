"""The learning rate: a number, a 0-d tensor or a schedule."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from .._validation import ScalarOrSchedule, check_batch, checked_schedule, non_negative
from ._arithmetic import neg, scaled
from ._base import Transform, empty_state
from ._state import COUNT, check_entries


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, inplace: bool = False) -> Transform:
    r""":math:`u \leftarrow -\eta\, u`, so that ``apply_updates`` descends.

    Args:
        learning_rate: a float, a 0-d tensor (change it in place between steps: no
            recompilation), or a schedule ``step -> lr`` called with the 0-d int64 count of
            previous updates (state ``{"count": ...}`` then). A schedule that returns a
            Python number is checked at each call (finite, ``>= 0``); a tensor it returns
            is used as it is, since reading it would wait for the device.
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
            check_batch("scale_by_learning_rate", grads, state)
            check_entries("scale_by_learning_rate", state, (COUNT,))
            count = state[COUNT]
            updates = scaled(grads, neg(schedule(count)), inplace=inplace)
            return updates, TensorDict({COUNT: count + 1}, batch_size=state.batch_size)

        return Transform(init, update)

    lr = learning_rate

    def scale(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_batch("scale_by_learning_rate", grads, state)
        return scaled(grads, neg(lr), inplace=inplace), state

    return Transform(empty_state, scale)
