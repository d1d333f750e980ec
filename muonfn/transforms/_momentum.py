"""Momentum: the exponential moving average of the gradients."""

from __future__ import annotations

from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _tree
from .._validation import Scalar, check_grads, check_params, unit_interval
from ._arithmetic import one_minus
from ._base import Transform
from ._state import MOMENTUM, STEP, check_entries

NesterovLike = bool | Literal["add"]


def _as64(v: Scalar) -> torch.Tensor:
    """``v`` as a 0-d fp64 tensor, without reading a tensor back."""
    return v.detach().to(torch.float64) if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)


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
            ``torch.compile`` too.

    Returns:
        A :class:`Transform` with state ``{"momentum": b}`` shaped like the params, in their
        dtype; with ``bias_correction`` also ``{"step": int64 per leaf}`` (per member of a
        stacked ensemble).
    """
    unit_interval("momentum", momentum)
    if nesterov not in (True, False, "add"):
        raise ValueError(f"ema_momentum: nesterov must be True, False or 'add', got {nesterov!r}")
    if bias_correction and nesterov == "add":
        raise ValueError("ema_momentum: bias_correction applies to nesterov=True or False, not 'add'")
    entries = (MOMENTUM, STEP) if bias_correction else (MOMENTUM,)

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("ema_momentum", params)
        state = {MOMENTUM: params.apply(torch.zeros_like)}
        if bias_correction:
            members = params.batch_size
            state[STEP] = params.apply(lambda p: p.new_zeros(members, dtype=torch.int64))
        return TensorDict(state, batch_size=params.batch_size)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_entries("ema_momentum", state, entries)
        buf = state[MOMENTUM]
        check_grads("ema_momentum", grads, buf)
        keys = _tree.leaf_keys(grads)
        current = _tree.subset(buf, keys)
        if donate_state:
            new_buf = current.lerp_(grads, one_minus(momentum))
        else:
            new_buf = current.lerp(grads, one_minus(momentum))
        new_state = {MOMENTUM: _tree.carry(buf, new_buf)}
        if bias_correction:
            step = _tree.subset(state[STEP], keys)
            step = step.add_(1) if donate_state else step.add(1)
            new_state[STEP] = _tree.carry(state[STEP], step)
            updates = _corrected(grads, new_buf, step, momentum, nesterov=bool(nesterov))
        elif nesterov == "add":
            updates = grads.add(new_buf)
        elif nesterov:
            updates = grads.lerp(new_buf, momentum)
        else:
            updates = new_buf
        return updates, TensorDict(new_state, batch_size=state.batch_size)

    return Transform(init, update)


def _corrected(
    grads: TensorDictBase, buf: TensorDictBase, step: TensorDictBase, momentum: Scalar, *, nesterov: bool
) -> TensorDictBase:
    """optax's bias-corrected momentum (see :func:`ema_momentum`), in the leaves' dtypes."""
    mu = _as64(momentum)
    log_mu = mu.log()  # -inf for mu = 0: then mu**t = 0
    t = step.to(torch.float64)
    correction = t.mul(log_mu).exp().neg().add(1.0)  # 1 - mu**t, with exp so that t may be a tensor
    if nesterov:
        moment_weight = t.add(1.0).mul(log_mu).exp().neg().add(1.0).reciprocal().mul(mu)
        grad_weight = correction.reciprocal().mul(mu.neg().add(1.0))
        if grads.batch_dims:
            moment_weight = _tree.per_member(moment_weight, grads)
            grad_weight = _tree.per_member(grad_weight, grads)
        updates = buf.mul(moment_weight).add(grads.mul(grad_weight))
    else:
        if grads.batch_dims:
            correction = _tree.per_member(correction, grads)
        updates = buf.div(correction)
    if any(g.ndim == 0 for g in grads.values(True, True)):
        # a 0-d leaf meets the 0-d fp64 weights as an equal and is promoted: cast it back
        updates = updates.apply(lambda u, g: u.to(g.dtype), grads)
    return updates
