"""AdamW as one rule: Adam's moments, the decay and the learning rate in the fewest passes."""

from __future__ import annotations

import math

import torch

from .. import _multi_tensor
from .._keys import Key
from .._tree import Leaves
from .._validation import Scalar, ScalarOrSchedule
from ._adam import adam_moments, scale_by_adam
from ._arithmetic import neg
from ._bias_correction import cast_like, leaf_factors, per_member
from ._caches import StructureCache
from ._combine import chain
from ._contract import Transform
from ._decay import add_decayed_weights, decay_factors
from ._learning_rate import current_rate, scale_by_learning_rate
from ._masks import MaskLike, resolve_mask_flat
from ._rules import Rule, Scope, as_rule, from_rule


def fused_adamw(
    learning_rate: ScalarOrSchedule,
    b1: Scalar,
    b2: Scalar,
    *,
    eps: float,
    weight_decay: Scalar,
    mask: MaskLike,
    donate_state: bool,
) -> Transform:
    r"""``chain(scale_by_adam(b1, b2, eps=eps), add_decayed_weights(weight_decay, mask=mask),
    scale_by_learning_rate(learning_rate))`` as one rule, with the same state (``"step"``,
    ``"exp_avg"``, ``"exp_avg_sq"``, and a schedule's ``"count"``) and the same checks.

    The moments are torch.optim.AdamW's ops, and so its bits (see :func:`adam_moments`). The
    update is torch's :math:`-\eta\lambda p - \frac{\eta}{c_1}\,\frac{m_t}{\sqrt{v_t}/\sqrt{c_2}
    + \epsilon}` (:math:`c_k = 1-\beta_k^t`) with the step size folded into the denominator,
    which takes two passes after the root, as torch's own takes:

    .. math::  D = \bigl(\sqrt{v_t} + \epsilon\sqrt{c_2}\bigr)\cdot\frac{-c_1}{\eta\sqrt{c_2}},
               \qquad u = -\eta\lambda\,p + m_t / D

    (``u = m / D``, written over :math:`D`, then ``u.addcmul_(p, ηλ, value=-1)`` on a decayed leaf). The
    factors are computed per leaf in fp64 from its step count and rounded once to the
    precision of the leaf's arithmetic; :math:`\epsilon\sqrt{c_2} > 0` is added before the
    scale, so that a learning rate of 0 makes :math:`D = -\infty` and the update
    :math:`-\eta\lambda p` exactly, never ``nan``. An fp16 leaf's update is computed in fp32 (its
    second moment's dtype) and rounded once.
    """
    reference = chain(
        scale_by_adam(b1, b2, eps=eps, donate_state=donate_state),
        add_decayed_weights(weight_decay, mask=mask, inplace=True),
        scale_by_learning_rate(learning_rate, inplace=True),
    )  # (checks every option, and is the state layout and the input checks)
    b1, b2, eps = float(b1), float(b2), float(eps)
    log_b1, log_b2 = math.log(b1) if b1 > 0 else -math.inf, math.log(b2) if b2 > 0 else -math.inf
    decays = not (isinstance(weight_decay, float | int) and weight_decay == 0)
    masks = StructureCache()

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        keys, g = list(grads), list(grads.values())
        lr = current_rate(learning_rate, scope, g)
        counts, exp_avg, exp_avg_sq = adam_moments(keys, g, scope, b1, b2, donate_state=donate_state)
        members = scope.members
        root_c2 = counts.corrections(log_b2).sqrt()
        # -c₁/(η√c₂): -inf at η = 0, which meets a denominator of at least ε√c₂ > 0
        step_scale = counts.corrections(log_b1).div(root_c2.mul(neg(lr)))
        # in place on this update's own root where nothing differentiates through it
        rewrite = (
            _multi_tensor.apply_ if donate_state or _multi_tensor.may_overwrite(exp_avg_sq) else _multi_tensor.apply
        )
        denom = rewrite(
            "add", _multi_tensor.apply("sqrt", exp_avg_sq), leaf_factors(root_c2.mul(eps), exp_avg_sq, members)
        )
        denom = rewrite("mul", denom, leaf_factors(step_scale, exp_avg_sq, members))
        overwrite = _multi_tensor.may_overwrite(exp_avg) and _multi_tensor.may_overwrite(denom)
        updates = _multi_tensor.quotients(exp_avg, denom, overwrite=overwrite)  # (over the denominators: one buffer)
        if decays:
            assert params is not None  # (checked by needs)
            decayed = _decayed_keys(grads, scope, params)
            index = {k: i for i, k in enumerate(keys)}
            where = [index[k] for k in decayed]
            terms = [updates[i] for i in where]
            p = [params[k] for k in decayed]
            factors = _decay_factors(lr * weight_decay, terms, members)
            add = (
                _multi_tensor.apply_
                if _multi_tensor.may_overwrite([*terms, *p], lr, weight_decay)
                else _multi_tensor.apply
            )
            for i, u in zip(where, add("addcmul", terms, p, factors, value=-1)):
                updates[i] = u
        return dict(zip(keys, cast_like(updates, g)))

    def _decayed_keys(grads: Leaves, scope: Scope, params: Leaves | None) -> list[Key]:
        assert params is not None  # (checked by needs)
        where = "add_decayed_weights: mask"
        return masks.get(
            grads, scope.batch_size, lambda: resolve_mask_flat(mask, grads, params, scope.batch_size, where=where)
        )

    return from_rule(reference.init, Rule("adamw", update, as_rule(reference).needs))


def _decay_factors(factor: Scalar, like: list[torch.Tensor], members: int) -> list[torch.Tensor]:
    """``factor`` (a number, a 0-d tensor or one value per ensemble member) as one tensor per
    leaf of ``like``, in its dtype (see :func:`add_decayed_weights`'s rounding)."""
    if isinstance(factor, torch.Tensor) and factor.ndim:
        return per_member([factor] * len(like), like, members)
    return decay_factors(factor, like)
