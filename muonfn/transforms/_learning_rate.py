"""The learning rate: a number, a 0-d tensor or a schedule."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _lists
from .._keys import Key
from .._tree import Leaves
from .._validation import Scalar, ScalarOrSchedule, checked_schedule, flag, non_negative
from ._arithmetic import neg
from ._base import Needs, Rule, Scope, Transform, empty_state, from_rule, no_needs
from ._momentum import per_member
from ._state import COUNT


def _scaled(grads: Leaves, lr: Scalar, members: int, batch_size: torch.Size, *, inplace: bool) -> Leaves:
    """``grads * -lr`` for ``lr`` a number, a 0-d tensor, or one value per ensemble member."""
    keys, values = list(grads), list(grads.values())
    inplace = inplace and _lists.may_overwrite(values, lr)
    if isinstance(lr, torch.Tensor) and lr.ndim:
        if not members or lr.shape != batch_size:
            raise ValueError(
                f"the learning rate schedule returned a tensor of shape {tuple(lr.shape)}; it must be 0-d"
                + (f" or of the ensemble's batch size {tuple(batch_size)}" if members else "")
            )
        factors = per_member([lr.neg()] * len(values), values, members)
        out = _lists.apply_("mul", values, factors) if inplace else _lists.apply("mul", values, factors)
    else:
        out = _lists.scale(values, neg(lr), inplace=inplace)
    return dict(zip(keys, out))


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, inplace: bool = False) -> Transform:
    r""":math:`u \leftarrow -\eta\, u`, so that ``apply_updates`` descends.

    Args:
        learning_rate: a float, a 0-d tensor (change it in place between steps: no
            recompilation), or a schedule ``step -> lr`` called with the 0-d int64 count of
            previous updates (state ``{"count": ...}`` then). A schedule that returns a
            Python number is checked at each call (finite, ``>= 0``); a tensor it returns
            is used as it is, since reading it would wait for the device (only its shape is
            checked: 0-d, or for a stacked ensemble one value per member, as its count is).
        inplace: scale the incoming updates in place (same bits, no new tensors) unless
            autograd records them or a ``torch.func`` transform is active: only after a
            transform that returns fresh tensors, as every preset's direction does.

    Returns:
        A :class:`Transform`, stateless unless ``learning_rate`` is a schedule.
    """
    non_negative("learning rate", learning_rate)
    flag("scale_by_learning_rate: inplace", inplace)

    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        schedule = checked_schedule("learning rate", learning_rate)

        def init(params: TensorDictBase) -> TensorDictBase:
            device = next(iter(params.values(True, True)), torch.empty(0)).device
            return TensorDict(
                {COUNT: torch.zeros(params.batch_size, dtype=torch.int64, device=device)},
                batch_size=params.batch_size,
            )

        def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
            count = scope.get(COUNT)
            scope.set(COUNT, count + 1)
            return _scaled(grads, schedule(count), scope.members, scope.batch_size, inplace=inplace)

        def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
            out.entries.append(("scale_by_learning_rate", prefix, (COUNT,)))

        return from_rule(init, Rule("scale_by_learning_rate", update, needs))

    lr = learning_rate

    def scale(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        return _scaled(grads, lr, scope.members, scope.batch_size, inplace=inplace)

    return from_rule(empty_state, Rule("scale_by_learning_rate", scale, no_needs))
