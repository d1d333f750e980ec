"""Adam's direction: bias-corrected first and second moments."""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _tree
from .._validation import Scalar, check_grads, check_params, positive, unit_interval
from ._base import Transform
from ._state import EXP_AVG, EXP_AVG_SQ, STEP, check_entries


def _cast_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.dtype)


def scale_by_adam(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    *,
    eps: float = 1e-8,
    nesterov: bool = False,
    donate_state: bool = False,
) -> Transform:
    r"""Adam's direction with bias correction, exactly as torch.optim.AdamW computes it.

    .. math::  m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
               v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad
               u_t = \frac{\hat m_t}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}

    with :math:`\hat m_t = m_t / (1-\beta_1^t)`, or with ``nesterov=True`` Nesterov-Adam
    (NAdamW) as ``optax.scale_by_adam(nesterov=True)`` computes it, first moment and
    gradient each bias-corrected on its own:

    .. math::  \hat m_t = \frac{\beta_1 m_t}{1-\beta_1^{t+1}} + \frac{(1-\beta_1)\, g_t}{1-\beta_1^t}.

    (timm's ``NAdamW`` differs: :math:`(\beta_1 m_t + (1-\beta_1) g_t)/(1-\beta_1^t)`.)

    ``t`` counts per leaf, so a leaf that had no gradient keeps its own bias correction;
    for a stacked ensemble (params of batch size ``[N]``) it counts per leaf and member.

    Args:
        b1: :math:`\beta_1` in [0, 1), a float or a 0-d tensor read once, when the transform
            is built (the bias corrections are precomputed from it).
        b2: :math:`\beta_2` in [0, 1), likewise.
        eps: :math:`\epsilon > 0`, added to the bias-corrected root.
        nesterov: use optax's Nesterov first moment :math:`\hat m_t` above (NAdamW).
        donate_state: update the state in place (see :func:`ema_momentum`).

    Returns:
        A :class:`Transform` with state ``{"step": int64 per leaf, "exp_avg": m, "exp_avg_sq": v}``.
    """
    b1, b2 = unit_interval("b1", b1), unit_interval("b2", b2)
    positive("eps", eps)
    eps = float(eps)
    log_b1, log_b2 = math.log(b1) if b1 > 0 else -math.inf, math.log(b2) if b2 > 0 else -math.inf

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("scale_by_adam", params)
        members = params.batch_size  # () for one model; one step per member of a stacked ensemble
        return TensorDict(
            {
                # new_zeros: a DTensor param gets a replicated DTensor step on its own mesh, so the
                # bias corrections combine with its moments even when params live on several meshes
                STEP: params.apply(lambda p: p.new_zeros(members, dtype=torch.int64)),
                EXP_AVG: params.apply(torch.zeros_like),
                EXP_AVG_SQ: params.apply(torch.zeros_like),
            },
            batch_size=params.batch_size,
        )

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_entries("scale_by_adam", state, (STEP, EXP_AVG, EXP_AVG_SQ))
        check_grads("scale_by_adam", grads, state[EXP_AVG])
        keys = _tree.leaf_keys(grads)
        step, exp_avg, exp_avg_sq = (_tree.subset(state[name], keys) for name in (STEP, EXP_AVG, EXP_AVG_SQ))
        if donate_state:
            step, exp_avg = step.add_(1), exp_avg.lerp_(grads, 1.0 - b1)
            exp_avg_sq = exp_avg_sq.mul_(b2).addcmul_(grads, grads, value=1.0 - b2)
        else:  # (addcmul_ has no vmap batching rule)
            step, exp_avg = step.add(1), exp_avg.lerp(grads, 1.0 - b1)
            exp_avg_sq = exp_avg_sq.mul(b2).addcmul(grads, grads, value=1.0 - b2)
        t = step.to(torch.float64)
        # 1 - beta**t, written with exp so that t may be a tensor
        bias_correction1 = t.mul(log_b1).exp().neg().add(1.0)
        bias_correction2_sqrt = t.mul(log_b2).exp().neg().add(1.0).sqrt()
        if nesterov:
            # beta1 / (1 - beta1**(t+1)) on the moment, (1 - beta1) / (1 - beta1**t) on the gradient
            moment_weight = t.add(1.0).mul(log_b1).exp().neg().add(1.0).reciprocal().mul(b1)
            grad_weight = bias_correction1.reciprocal().mul(1.0 - b1)
        if grads.batch_dims:  # one correction per member: shaped to broadcast over each member's leaf
            bias_correction1 = _tree.per_member(bias_correction1, grads)
            bias_correction2_sqrt = _tree.per_member(bias_correction2_sqrt, grads)
            if nesterov:
                moment_weight = _tree.per_member(moment_weight, grads)
                grad_weight = _tree.per_member(grad_weight, grads)
        # in place on fresh temporaries only (fp64 0-d corrections would promote a 0-d leaf in place)
        denom = exp_avg_sq.sqrt().div(bias_correction2_sqrt).add_(eps)
        if nesterov:
            updates = exp_avg.mul(moment_weight).add(grads.mul(grad_weight)).div_(denom)
        else:
            updates = exp_avg.div(bias_correction1).div_(denom)
        if any(g.ndim == 0 for g in grads.values(True, True)):
            # a 0-d leaf meets the 0-d fp64 corrections as an equal and is promoted: cast it back
            updates = updates.apply(_cast_like, grads)
        new_state = TensorDict(
            {
                STEP: _tree.carry(state[STEP], step),
                EXP_AVG: _tree.carry(state[EXP_AVG], exp_avg),
                EXP_AVG_SQ: _tree.carry(state[EXP_AVG_SQ], exp_avg_sq),
            },
            batch_size=state.batch_size,
        )
        return updates, new_state

    return Transform(init, update)
