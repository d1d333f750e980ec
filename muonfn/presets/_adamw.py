"""AdamW as ``torch.optim.AdamW`` computes it: a preset of its own, and every Muon preset's second branch."""

from __future__ import annotations

from typing import Any

from .._validation import Scalar, ScalarOrSchedule, flag
from ..transforms import (
    AdamNesterov,
    MaskLike,
    Transform,
    add_decayed_weights,
    chain,
    check_mask,
    fused_adamw,
    scale_by_adam,
    scale_by_learning_rate,
)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    *,
    betas: tuple[Scalar, Scalar] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: Scalar = 0.01,
    weight_decay_mask: MaskLike = None,
    nesterov: AdamNesterov = False,
    cautious_weight_decay: bool = False,
    donate_state: bool = False,
) -> Transform:
    r"""AdamW exactly as ``torch.optim.AdamW``:

    .. math::  p \leftarrow p - \eta\lambda p - \eta\,\frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}

    Args:
        lr: :math:`\eta`: a float, a 0-d tensor or a schedule (see :func:`scale_by_learning_rate`).
        betas: :math:`(\beta_1, \beta_2)`, floats or 0-d tensors; a tensor :math:`\beta_1` is
            read at every update (see :func:`scale_by_adam`), so that a scheduler may change it.
        eps: :math:`\epsilon`.
        weight_decay: :math:`\lambda`.
        weight_decay_mask: exempts the leaves it maps to ``False``; ``"matrices"`` decays
            only the leaves of two dimensions or more (see :func:`add_decayed_weights`).
            Names it holds that are not among the parameters are ignored, as ``adamw`` is
            often one branch of a :func:`partition`; :func:`muon` checks them against all
            parameters.
        nesterov: Nesterov-Adam (NAdamW) as ``optax.adamw(nesterov=True)`` computes it, or
            ``"timm"`` as timm's ``NAdamW`` does (see
            :func:`scale_by_adam`).
        cautious_weight_decay: decay only where the update and the parameter agree in sign
            (see :func:`add_decayed_weights`).
        donate_state: update the state, and the step's own temporaries, in place (see
            :func:`ema_momentum`).

    Returns:
        A :class:`Transform` with state ``{"step", "exp_avg", "exp_avg_sq"}``.

    Example:
        >>> params = TensorDict({"w": torch.ones(3)}, [])
        >>> tx = muonfn.adamw(lr=0.1)
        >>> updates, state = tx.update(TensorDict({"w": torch.ones(3)}, []), tx.init(params), params)
        >>> updates["w"]  # -lr·sign(g) at step 1, minus lr·wd·p
        tensor([-0.1010, -0.1010, -0.1010])
    """
    betas = _pair("betas", betas)
    check_mask("adamw: weight_decay_mask", weight_decay_mask)
    flag("adamw: donate_state", donate_state)
    if not (isinstance(nesterov, bool) or nesterov == "timm"):
        raise ValueError(f"adamw: nesterov must be True, False or 'timm', got {nesterov!r}")
    flag("adamw: cautious_weight_decay", cautious_weight_decay)
    if not nesterov and not cautious_weight_decay:
        return fused_adamw(
            lr,
            betas[0],
            betas[1],
            eps=eps,
            weight_decay=weight_decay,
            mask=weight_decay_mask,
            donate_state=donate_state,
        )
    # Adam's direction is a fresh tensor: the decay and the learning rate may write into it
    return chain(
        scale_by_adam(betas[0], betas[1], eps=eps, nesterov=nesterov, donate_state=donate_state),
        add_decayed_weights(weight_decay, mask=weight_decay_mask, cautious=cautious_weight_decay, inplace=True),
        scale_by_learning_rate(lr, inplace=True),
    )


def _pair(name: str, betas: Any) -> tuple[Scalar, Scalar]:
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(f"{name} must be a pair (beta1, beta2), got {betas!r}")
    return betas[0], betas[1]
