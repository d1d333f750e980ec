"""Ready-made optimizers assembled from the building blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tensordict import TensorDictBase

from . import _tree
from ._base import Transform
from ._combinators import LabelsLike, chain, partition
from ._labels import ADAMW, MUON, label_params
from ._newton_schulz import CoefficientsLike
from ._transforms import (
    DEFAULT_BUCKET_NUMEL,
    MaskLike,
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_muon,
)
from ._validation import Scalar, ScalarOrSchedule, known_names
from ._views import ViewsLike

if TYPE_CHECKING:
    from .distributed import Collectives, ShardSpecs


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: Scalar = 0.01,
    weight_decay_mask: MaskLike = None,
) -> Transform:
    r"""AdamW exactly as ``torch.optim.AdamW``:

    .. math::  p \leftarrow p - \eta\lambda p - \eta\,\frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}

    ``weight_decay_mask`` exempts the leaves it maps to ``False`` (see
    :func:`add_decayed_weights`). Names it holds that are not among the parameters are
    ignored, as ``adamw`` is often one branch of a :func:`partition`; :func:`muon` checks
    them against all parameters. State: ``{"step", "exp_avg", "exp_avg_sq"}``.
    """
    return chain(
        scale_by_adam(betas[0], betas[1], eps),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(lr),
    )


def _checks_names(tx: Transform, weight_decay_mask: MaskLike, views: ViewsLike) -> Transform:
    """``tx`` whose ``init`` first checks that every leaf named by the mask or views exists.

    The building blocks inside a partition see only their own leaves and so cannot tell a
    typo from another group's leaf; the preset sees them all.
    """

    def init(params: TensorDictBase) -> TensorDictBase:
        keys = _tree.leaf_keys(params)
        if weight_decay_mask is not None:
            mask = weight_decay_mask(params) if callable(weight_decay_mask) else weight_decay_mask
            known_names("weight_decay_mask", mask, keys)
        if views is not None and not callable(views):
            known_names("views", views, keys)
        return tx.init(params)

    return Transform(init, tx.update)


def muon(
    lr: ScalarOrSchedule = 1e-3,
    momentum: Scalar = 0.95,
    nesterov: bool = True,
    weight_decay: Scalar = 0.1,
    ns_coefficients: CoefficientsLike = "keller",
    ns_steps: int | None = None,
    ns_dtype: torch.dtype | None = None,
    scale: str = "match_rms_adamw",
    extra_scale: float = 1.0,
    adamw_lr: ScalarOrSchedule | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: Scalar | None = None,
    labels: LabelsLike | None = None,
    views: ViewsLike = None,
    weight_decay_mask: MaskLike = None,
    ns_eps: float = 1e-7,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    collectives: Collectives | None = None,
    strategy: str = "owner",
    shard_specs: ShardSpecs | None = None,
) -> Transform:
    r"""Muon for matrices, AdamW for everything else.

    Matrix leaves (label ``"muon"``) get

    .. math::  p \leftarrow p - \eta\, s(A, B)\,\mathrm{NS}(u_t) - \eta\lambda p

    with :math:`u_t` the Nesterov EMA momentum (see :func:`ema_momentum`) and :math:`s`
    the ``scale`` mode times ``extra_scale``; the default ``"match_rms_adamw"``
    (0.2·√max(A, B)) gives the update AdamW's RMS, so one ``lr`` and ``weight_decay`` serve
    both groups. Other leaves (label ``"adamw"``) get :func:`adamw` with the ``adamw_*``
    settings, each ``None`` meaning "the Muon value".

    ``labels`` defaults to :func:`label_params` (≥2-D leaves except embeddings, output
    heads and LoRA adapters); :func:`labels_from_module` labels by module type instead.
    ``views`` declares conv, expert, fused and transposed matrices (:class:`MatrixView`).
    ``weight_decay_mask`` exempts the leaves it maps to ``False`` (default: decay all).
    ``init`` checks every name in ``labels``, ``views`` and ``weight_decay_mask`` against
    the parameters (a typo is an error) and every Muon leaf against its view.
    State: ``{"muon": {"momentum"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}``.
    """
    muon_branch = chain(
        scale_by_muon(
            momentum,
            nesterov,
            ns_coefficients,
            ns_steps,
            ns_dtype,
            ns_eps,
            scale,
            extra_scale,
            views,
            bucket_numel,
            collectives,
            strategy,
            shard_specs,
        ),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(lr),
    )
    adamw_branch = adamw(
        lr if adamw_lr is None else adamw_lr,
        adamw_betas,
        adamw_eps,
        weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        weight_decay_mask,
    )
    tx = partition({MUON: muon_branch, ADAMW: adamw_branch}, label_params if labels is None else labels)
    return _checks_names(tx, weight_decay_mask, views)
