"""The learning rate: a number, a 0-d tensor or a schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _multi_tensor
from .._keys import Key, dotted
from .._tree import FlatState, Leaves
from .._validation import Scalar, ScalarOrSchedule, flag, non_negative, schedule_value
from ._arithmetic import neg
from ._bias_correction import per_member
from ._contract import Transform, empty_state
from ._rules import Needs, Rule, Scope, from_rule, no_needs
from ._state import COUNT


def _named(prefix: Key, *, scheduled: bool) -> str:
    """The learning rate (or its schedule) of the state scope ``prefix``: a preset's branch."""
    name = "the learning rate schedule" if scheduled else "the learning rate"
    return f"{name} of branch {dotted(prefix)!r}" if prefix else name


def _check_tensor(
    lr: torch.Tensor, values: list[torch.Tensor], prefix: Key, batch_size: torch.Size, *, scheduled: bool
) -> None:
    """A tensor learning rate must be 0-d (or one value per ensemble member) and where the
    leaves are: on their device, or a 0-d tensor on the CPU, which meets any device's tensors
    as a number does. Only metadata is read: no wait for the device."""
    members = len(batch_size)
    if lr.ndim and (not members or lr.shape != batch_size):
        raise ValueError(
            f"{_named(prefix, scheduled=scheduled)} returned a tensor of shape {tuple(lr.shape)}; it must be 0-d"
            + (f" or of the ensemble's batch size {tuple(batch_size)}" if members else "")
        )
    if lr.ndim == 0 and lr.device.type == "cpu":
        return
    device = lr.device
    stray = next((v.device for v in values if v.device != device), None)
    if stray is not None:
        verb = "returned" if scheduled else "is"
        raise ValueError(
            f"{_named(prefix, scheduled=scheduled)} {verb} a tensor on {device}, the parameters are on "
            f"{stray}; it must be on their device, or a 0-d tensor on the CPU"
        )


def rate_check(learning_rate: ScalarOrSchedule, grads: Leaves, prefix: Key, out: Needs) -> None:
    """Adds to ``out`` the check of this update's learning rate, so that a bad one is refused
    before any member of a composition writes its state (in place, if donated): a schedule is
    called here, once, and its checked value kept for the update (:attr:`Scope.checked`)."""
    keys = list(grads)
    batch_size = out.batch_size
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        schedule, count_key = learning_rate, (*prefix, COUNT)

        def check(state: FlatState, all_grads: Leaves, checked: dict[Key, Any]) -> None:
            count = state.get(count_key)
            if not isinstance(count, torch.Tensor):
                return  # (a missing count is refused by the entries' check, or by the update)
            lr = schedule_value(_named(prefix, scheduled=True), schedule(count))
            if isinstance(lr, torch.Tensor):
                _check_tensor(lr, [all_grads[k] for k in keys], prefix, batch_size, scheduled=True)
            checked[count_key] = lr

        out.values.append(check)
    elif isinstance(learning_rate, torch.Tensor):
        lr = learning_rate

        def check_tensor(state: FlatState, all_grads: Leaves, checked: dict[Key, Any]) -> None:
            _check_tensor(lr, [all_grads[k] for k in keys], prefix, batch_size, scheduled=False)

        out.values.append(check_tensor)


def scaled_by_rate(grads: Leaves, lr: Scalar, scope: Scope, *, inplace: bool, scheduled: bool) -> Leaves:
    """``grads * -lr`` for ``lr`` a number, a 0-d tensor, or one value per ensemble member."""
    keys, values = list(grads), list(grads.values())
    if isinstance(lr, torch.Tensor):
        _check_tensor(lr, values, scope.prefix, scope.batch_size, scheduled=scheduled)
    inplace = inplace and _multi_tensor.may_overwrite(values, lr)
    if isinstance(lr, torch.Tensor) and lr.ndim:
        factors = per_member([lr.neg()] * len(values), values, scope.members)
        out = _multi_tensor.apply_("mul", values, factors) if inplace else _multi_tensor.apply("mul", values, factors)
    else:
        out = _multi_tensor.scale(values, neg(_multi_tensor.host_number(lr, values)), inplace=inplace)
    return dict(zip(keys, out))


def scheduled_rate(schedule: Callable[[torch.Tensor], Scalar], scope: Scope) -> Scalar:
    """The schedule's learning rate for this update, its count (state ``"count"``) advanced in
    ``scope``: the value :func:`rate_check` took before the update, or the schedule's now."""
    count = scope.get(COUNT)
    lr = scope.checked.get((*scope.prefix, COUNT))
    if lr is None:
        lr = schedule_value(_named(scope.prefix, scheduled=True), schedule(count))
    scope.set(COUNT, count + 1)
    return lr


def current_rate(learning_rate: ScalarOrSchedule, scope: Scope, values: list[torch.Tensor]) -> Scalar:
    """This update's learning rate, as :func:`scale_by_learning_rate` of ``learning_rate`` takes
    it (a schedule's count advanced in ``scope``; a tensor checked against the leaves ``values``)."""
    scheduled = callable(learning_rate) and not isinstance(learning_rate, torch.Tensor)
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        lr = scheduled_rate(learning_rate, scope)
    else:
        lr = learning_rate
    if isinstance(lr, torch.Tensor):
        _check_tensor(lr, values, scope.prefix, scope.batch_size, scheduled=scheduled)
    return lr


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, inplace: bool = False) -> Transform:
    r""":math:`u \leftarrow -\eta\, u`, so that ``apply_updates`` descends.

    Args:
        learning_rate: a float, a 0-d tensor (change it in place between steps: no
            recompilation), or a schedule ``step -> lr`` called with the 0-d int64 count of
            previous updates (state ``{"count": ...}`` then). A schedule that returns a
            Python number is checked at each call (finite, ``>= 0``). Of a tensor it returns
            only what needs no read-back from the device is checked: a real dtype (no bool,
            no complex), 0-d (for a stacked ensemble, or one value per member, as its count
            is), on the leaves' device or a 0-d tensor on the CPU. A tensor given as
            ``learning_rate`` is checked alike (its device at each update). The errors name
            the branch of a preset (``"muon"``, ``"adamw"``) the learning rate belongs to.
        inplace: scale the incoming updates in place (same bits, no new tensors) unless
            autograd records them or a ``torch.func`` transform is active: only after a
            transform that returns fresh tensors, as every preset's direction does.

    Returns:
        A :class:`Transform`, stateless unless ``learning_rate`` is a schedule.
    """
    flag("scale_by_learning_rate: inplace", inplace)
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        schedule = learning_rate

        def init(params: TensorDictBase) -> TensorDictBase:
            device = next(iter(params.values(True, True)), torch.empty(0)).device
            return TensorDict(
                {COUNT: torch.zeros(params.batch_size, dtype=torch.int64, device=device)},
                batch_size=params.batch_size,
            )

        def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
            return scaled_by_rate(grads, scheduled_rate(schedule, scope), scope, inplace=inplace, scheduled=True)

        def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
            out.entries.append(("scale_by_learning_rate", prefix, (COUNT,)))
            rate_check(schedule, grads, prefix, out)

        return from_rule(init, Rule("scale_by_learning_rate", update, needs))

    non_negative("learning rate", learning_rate)
    lr = learning_rate

    def scale(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        return scaled_by_rate(grads, lr, scope, inplace=inplace, scheduled=False)

    def tensor_needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        rate_check(lr, grads, prefix, out)

    checks = tensor_needs if isinstance(lr, torch.Tensor) else no_needs
    return from_rule(empty_state, Rule("scale_by_learning_rate", scale, checks))
