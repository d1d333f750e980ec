"""Adam's direction: bias-corrected first and second moments."""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _multi_tensor
from .._keys import Key
from .._tree import Leaves
from .._validation import Scalar, check_params, flag, positive, unit_interval
from ._bias_correction import StepCounts, bias_corrections, cast_like, count_steps, leaf_factors
from ._contract import Transform
from ._rules import Rule, Scope, from_rule, per_leaf_needs
from ._state import EXP_AVG, EXP_AVG_SQ, STEP

AdamNesterov: TypeAlias = bool | Literal["timm"]


def scale_by_adam(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    *,
    eps: float = 1e-8,
    nesterov: AdamNesterov = False,
    donate_state: bool = False,
) -> Transform:
    r"""Adam's direction with bias correction: torch.optim.AdamW's (its ``eps`` added to the
    bias-corrected root).

    .. math::  m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
               v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad
               u_t = \frac{\hat m_t}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}

    with :math:`\hat m_t = m_t / (1-\beta_1^t)`, or with ``nesterov=True`` Nesterov-Adam
    (NAdamW) as ``optax.scale_by_adam(nesterov=True)`` computes it, first moment and
    gradient each bias-corrected on its own:

    .. math::  \hat m_t = \frac{\beta_1 m_t}{1-\beta_1^{t+1}} + \frac{(1-\beta_1)\, g_t}{1-\beta_1^t}.

    With ``nesterov="timm"``, timm's ``NAdamW``, one correction for both:
    :math:`\hat m_t = (\beta_1 m_t + (1-\beta_1) g_t)/(1-\beta_1^t)`.

    ``t`` counts per leaf, so a leaf that had no gradient keeps its own bias correction;
    for a stacked ensemble (params of batch size ``[N]``) it counts per leaf and member.
    Without Nesterov the update is computed as :math:`m_t / (a\sqrt{v_t} + b)`, with
    :math:`a = (1-\beta_1^t)/\sqrt{1-\beta_2^t}` and :math:`b = \epsilon(1-\beta_1^t)` per
    leaf in fp64: the same value, one pass over the leaves less than dividing in turn.

    Moments are kept in the leaf's dtype, but :math:`v` of an fp16 leaf in fp32: fp16 cannot
    hold the square of an entry below 2.4e-4, nor an :math:`\epsilon` of 1e-8 (both round to
    zero, and the quotient to inf or nan). Such a leaf's denominator and quotient are computed
    in fp32 and the update rounded once to fp16.

    Args:
        b1: :math:`\beta_1` in [0, 1), a float or a 0-d tensor; a tensor is read at every
            update (the bias corrections use its current value, as torch.optim.AdamW's use its
            group's current ``betas``), so that a scheduler may change it without a new
            transform (``torch.compile`` then keeps it as an input).
        b2: :math:`\beta_2` in [0, 1), a float or a 0-d tensor read once, when the transform is built.
        eps: :math:`\epsilon > 0`, added to the bias-corrected root.
        nesterov: ``True`` for optax's Nesterov first moment :math:`\hat m_t` above (NAdamW),
            ``"timm"`` for timm's, ``False`` for Adam's.
        donate_state: update the state in place (see :func:`ema_momentum`).

    Returns:
        A :class:`Transform` with state ``{"step": int64 per leaf, "exp_avg": m, "exp_avg_sq": v}``
        (``v`` in fp32 for fp16 leaves).
    """
    b1_value, b2 = unit_interval("b1", b1), unit_interval("b2", b2)
    if not isinstance(b1, torch.Tensor):  # (a tensor is read at every update)
        b1 = b1_value
    if not (isinstance(nesterov, bool) or nesterov == "timm"):
        raise ValueError(f"scale_by_adam: nesterov must be True, False or 'timm', got {nesterov!r}")
    positive("eps", eps)
    flag("scale_by_adam: donate_state", donate_state)
    eps = float(eps)

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("scale_by_adam", params)
        members = params.batch_size  # () for one model; one step per member of a stacked ensemble
        return TensorDict(
            {
                # new_zeros: a DTensor param gets a replicated DTensor step on its own mesh, so the
                # bias corrections combine with its moments even when params live on several meshes
                STEP: params.apply(lambda p: p.new_zeros(members, dtype=torch.int64)),
                EXP_AVG: params.apply(torch.zeros_like),
                EXP_AVG_SQ: params.apply(
                    lambda p: torch.zeros_like(p, dtype=_multi_tensor.second_moment_dtype(p.dtype))
                ),
            },
            batch_size=params.batch_size,
        )

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        keys, g = list(grads), list(grads.values())
        beta1 = _multi_tensor.host_number(b1, g)
        counts, exp_avg, exp_avg_sq = adam_moments(keys, g, scope, beta1, b2, donate_state=donate_state)
        members = scope.members
        # in place on this update's own root where nothing differentiates through it (sqrt's
        # gradient reads its output): one fresh tensor less, which on a CPU is a page-fault pass
        divide = (
            _multi_tensor.apply_ if donate_state or _multi_tensor.may_overwrite(exp_avg_sq) else _multi_tensor.apply
        )
        root = _multi_tensor.apply("sqrt", exp_avg_sq)
        if not nesterov:
            # m / ((√v/√(1−β₂ᵗ) + ε)(1−β₁ᵗ)) = m / (a√v + b), a = (1−β₁ᵗ)/√(1−β₂ᵗ), b = ε(1−β₁ᵗ):
            # one pass over the leaves less; the quotient is written over its denominator
            # where nothing records it. The factors take the dtype of the root they meet (fp32
            # for an fp16 leaf's).
            first = counts.corrections(beta1)
            scale = leaf_factors(first.div(counts.corrections(b2).sqrt()), exp_avg_sq, members)
            denom = _multi_tensor.apply_(
                "add", divide("mul", root, scale), leaf_factors(first.mul(eps), exp_avg_sq, members)
            )
            overwrite = _multi_tensor.may_overwrite(exp_avg) and _multi_tensor.may_overwrite(denom)
            return dict(zip(keys, cast_like(_multi_tensor.quotients(exp_avg, denom, overwrite=overwrite), g)))
        root_correction = bias_corrections(counts, b2, exp_avg_sq, members, then=torch.sqrt)
        denom = _multi_tensor.apply_("add", divide("div", root, root_correction), eps)
        if nesterov == "timm":
            look_ahead = _multi_tensor.lerp(exp_avg, g, 1.0 - beta1)
            updates = _multi_tensor.apply("div", look_ahead, bias_corrections(counts, beta1, g, members))
        else:
            # beta1 / (1 - beta1**(t+1)) on the moment, (1 - beta1) / (1 - beta1**t) on the gradient
            moment_weight = leaf_factors(counts.corrections(beta1, shift=1.0).reciprocal().mul(beta1), g, members)
            grad_weight = leaf_factors(counts.corrections(beta1).reciprocal().mul(1.0 - beta1), g, members)
            updates = _multi_tensor.apply("mul", exp_avg, moment_weight)
            updates = _multi_tensor.apply_("add", updates, _multi_tensor.apply("mul", g, grad_weight))
        # (into the numerators, unless an fp16 leaf's quotient is to be taken in its fp32 denominator's dtype)
        same = all(u.dtype == d.dtype for u, d in zip(updates, denom))
        return dict(
            zip(keys, cast_like((_multi_tensor.apply_ if same else _multi_tensor.apply)("div", updates, denom), g))
        )

    needs = per_leaf_needs("scale_by_adam", (EXP_AVG, EXP_AVG_SQ), (STEP,), squares=(EXP_AVG_SQ,))
    return from_rule(init, Rule("scale_by_adam", update, needs, donate_state))


def adam_moments(
    keys: list[Key], g: list[torch.Tensor], scope: Scope, b1: Scalar, b2: float, *, donate_state: bool
) -> tuple[StepCounts, list[torch.Tensor], list[torch.Tensor]]:
    r"""Adam's step counts and moments after this update, written to ``scope`` (state ``"step"``,
    ``"exp_avg"``, ``"exp_avg_sq"``), with torch.optim.AdamW's ops and so its bits:
    ``m.lerp_(g, 1-β₁)``, ``v.mul_(β₂).addcmul_(g, g, value=1-β₂)``."""
    exp_avg, exp_avg_sq = scope.read(EXP_AVG, keys), scope.read(EXP_AVG_SQ, keys)
    counts = count_steps(scope.read(STEP, keys), inplace=donate_state)
    if donate_state:
        exp_avg = _multi_tensor.lerp(exp_avg, g, 1.0 - b1, inplace=True)
        exp_avg_sq = _multi_tensor.apply_("addcmul", _multi_tensor.apply_("mul", exp_avg_sq, b2), g, g, value=1.0 - b2)
    else:
        exp_avg = _multi_tensor.lerp(exp_avg, g, 1.0 - b1)
        accumulate = _multi_tensor.apply_ if _multi_tensor.may_overwrite(g) else _multi_tensor.apply
        exp_avg_sq = accumulate("addcmul", _multi_tensor.apply("mul", exp_avg_sq, b2), g, g, value=1.0 - b2)
    for entry, values in ((STEP, counts.leaves), (EXP_AVG, exp_avg), (EXP_AVG_SQ, exp_avg_sq)):
        scope.write(entry, keys, values)
    return counts, exp_avg, exp_avg_sq
