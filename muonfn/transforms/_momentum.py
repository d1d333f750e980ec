"""Momentum: the exponential moving average of the gradients."""

from __future__ import annotations

from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _kernels, _multi_tensor
from .._tree import Leaves
from .._validation import Scalar, check_params, flag, unit_interval
from ._arithmetic import one_minus
from ._bias_correction import StepCounts, as64, bias_corrections, cast_like, count_steps
from ._contract import Transform
from ._rules import Rule, Scope, from_rule, per_leaf_needs
from ._state import MOMENTUM, STEP

NesterovLike = bool | Literal["add"]


def ema_momentum(
    momentum: Scalar = 0.95,
    *,
    nesterov: NesterovLike = True,
    bias_correction: bool = False,
    donate_state: bool = False,
) -> Transform:
    r"""Exponential moving average of the gradients (torch.optim.Muon's form by default).

    .. math::  b_t = \mu\, b_{t-1} + (1-\mu)\, g_t, \qquad
               u_t = \begin{cases} (1-\mu)\, g_t + \mu\, b_t & \text{Nesterov (torch, Keller)} \\
                                   g_t + b_t & \texttt{nesterov="add"} \text{ (heavyball's nesterov\_ema)} \\
                                   b_t & \text{otherwise} \end{cases}

    With ``bias_correction=True`` (optax's ``contrib.muon``) the moment and the gradient are
    bias-corrected each on its own, :math:`t` counting this leaf's updates from 1:

    .. math::  u_t = \frac{\mu\, b_t}{1-\mu^{t+1}} + \frac{(1-\mu)\, g_t}{1-\mu^t}
               \ \text{(Nesterov)}, \qquad u_t = \frac{b_t}{1-\mu^t} \ \text{(otherwise)}.

    Args:
        momentum: :math:`\mu`, a float or a 0-d tensor in [0, 1).
        nesterov: ``True`` for the Nesterov look-ahead, ``"add"`` for heavyball's
            :math:`g_t + b_t` (the EMA updated first, with weight :math:`1-\mu` on the
            gradient), ``False`` for :math:`b_t`.
        bias_correction: divide by :math:`1-\mu^t` as above (not with ``nesterov="add"``);
            the state then also counts steps.
        donate_state: update the state's tensors in place and return them in the new state
            instead of allocating new ones, so that peak memory holds one copy of the state,
            as with ``torch.optim``. The state passed to ``update`` is consumed: do not read
            it afterwards (it holds the new values, or after an exception some of them), and
            do not wrap the transform in :func:`apply_if_finite`, which falls back on the old
            state. Results are bitwise those of ``donate_state=False``, under
            ``torch.compile`` too. Where every leaf of the state was updated in place, the
            update returns the very TensorDict it was given (nothing to rebuild).

    Returns:
        A :class:`Transform` with state ``{"momentum": b}`` shaped like the params, in their
        dtype; with ``bias_correction`` also ``{"step": int64 per leaf}`` (per member of a
        stacked ensemble).
    """
    unit_interval("momentum", momentum)
    flag("ema_momentum: bias_correction", bias_correction)
    flag("ema_momentum: donate_state", donate_state)
    if nesterov not in (True, False, "add"):
        raise ValueError(f"ema_momentum: nesterov must be True, False or 'add', got {nesterov!r}")
    if bias_correction and nesterov == "add":
        raise ValueError("ema_momentum: bias_correction applies to nesterov=True or False, not 'add'")

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("ema_momentum", params)
        state = {MOMENTUM: params.apply(torch.zeros_like)}
        if bias_correction:
            members = params.batch_size
            state[STEP] = params.apply(lambda p: p.new_zeros(members, dtype=torch.int64))
        return TensorDict(state, batch_size=params.batch_size)

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        keys, values = list(grads), list(grads.values())
        mu = _multi_tensor.host_number(momentum, values)  # (off the CPU: no host ops)
        state = scope.read(MOMENTUM, keys)
        if nesterov is True and not bias_correction and _kernels.takes_ema_nesterov(state, values, mu):
            # both passes in one (a GPU's, opt-in): the same bits
            if donate_state:
                buf, updates = state, _kernels.ema_nesterov_(state, values, mu)
            else:
                both = _kernels.ema_nesterov(state, values, mu)
                buf, updates = both[: len(keys)], both[len(keys) :]
            scope.write(MOMENTUM, keys, buf)
            return dict(zip(keys, updates))
        weight = one_minus(mu)
        buf = _multi_tensor.lerp(state, values, weight, inplace=donate_state)
        scope.write(MOMENTUM, keys, buf)
        if bias_correction:
            counts = count_steps(scope.read(STEP, keys), inplace=donate_state)
            scope.write(STEP, keys, counts.leaves)
            updates = _corrected(values, buf, counts, momentum, nesterov=bool(nesterov), members=scope.members)
        elif nesterov == "add":
            updates = _multi_tensor.apply("add", values, buf)
        elif nesterov:
            updates = _multi_tensor.lerp(values, buf, momentum)
        else:
            updates = buf
        return dict(zip(keys, updates))

    needs = per_leaf_needs("ema_momentum", (MOMENTUM,), (STEP,) if bias_correction else ())
    return from_rule(init, Rule("ema_momentum", update, needs, donate_state))


def fresh_updates(nesterov: object, bias_correction: bool) -> bool:
    """Whether :func:`ema_momentum`'s updates are tensors of the step's own, which nothing reads
    after the transform that takes them (the look-ahead, its sum or the corrected momentum), not
    its state's momentum (``nesterov=False`` uncorrected): the next may write into them."""
    return nesterov is True or nesterov == "add" or bias_correction


def _corrected(
    grads: list[torch.Tensor],
    buf: list[torch.Tensor],
    step: StepCounts,
    momentum: Scalar,
    *,
    nesterov: bool,
    members: int,
) -> list[torch.Tensor]:
    """optax's bias-corrected momentum (see :func:`ema_momentum`), in the leaves' dtypes."""
    mu = as64(momentum)
    if nesterov:
        moment_weight = bias_corrections(step, mu, buf, members, shift=1.0, then=lambda c: c.reciprocal().mul(mu))
        grad_weight = bias_corrections(step, mu, grads, members, then=lambda c: c.reciprocal().mul(mu.neg().add(1.0)))
        weighted = _multi_tensor.apply("mul", buf, moment_weight)
        updates = _multi_tensor.apply_("add", weighted, _multi_tensor.apply("mul", grads, grad_weight))
    else:
        updates = _multi_tensor.apply("div", buf, bias_corrections(step, mu, buf, members))
    return cast_like(updates, grads)
