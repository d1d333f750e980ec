"""NorMuon and AdaMuon: Muon whose orthogonalized update is adapted by a second moment.

Each is :func:`~muonfn.muon`'s partition with another adaptation step in its
:func:`matrix_branch`, which the ``torch.optim`` shim builds its groups from too (``variant=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._validation import Scalar, ScalarOrSchedule
from ..linalg import CoefficientsLike, EpsMode, MatrixFn, ScaleMode
from ..transforms import AdamNesterov, CautiousMode, LabelsLike, MaskLike, MethodLike, Rescale, Transform, ViewsLike
from ._branch import NesterovLike, assemble

if TYPE_CHECKING:
    from ..distributed import Collectives


#: The options that only the adapted variants take (the second moment and what feeds it).
VARIANT_OPTIONS: tuple[str, ...] = (
    "beta2",
    "adaptive_eps",
    "rescale",
    "sign_momentum",
    "second_moment_bias_correction",
)

#: Each variant's defaults (those of :func:`~muonfn.muon`, :func:`normuon`, :func:`adamuon`) for
#: the settings whose defaults differ between variants; an option of :data:`VARIANT_OPTIONS` a
#: variant does not list does not apply to it.
VARIANT_DEFAULTS: dict[str, dict[str, Any]] = {
    "muon": {"momentum": 0.95, "nesterov": True},
    "normuon": {"momentum": 0.95, "nesterov": True, "beta2": 0.95, "adaptive_eps": 1e-10, "rescale": "orthogonal"},
    "adamuon": {
        "momentum": 0.9,
        "nesterov": False,
        "beta2": 0.95,
        "adaptive_eps": 1e-10,
        "rescale": "orthogonal",
        "sign_momentum": True,
        "second_moment_bias_correction": False,
    },
}


def refuse_collectives(where: str, collectives: Collectives | None) -> None:
    """NorMuon and AdaMuon run on whole matrices: ``collectives`` must be ``None``."""
    if collectives is not None:
        raise ValueError(
            f"{where}: collectives= is not supported: the second-moment rescaling needs each whole "
            "orthogonalized matrix on the rank that holds its state, and the sharded strategies return "
            "shards; use muonfn.muon for sharded parameters, or gather them"
        )


def normuon(
    lr: ScalarOrSchedule = 1e-3,
    *,
    momentum: Scalar = 0.95,
    nesterov: NesterovLike = True,
    beta2: Scalar = 0.95,
    adaptive_eps: float = 1e-10,
    rescale: Rescale = "orthogonal",
    momentum_bias_correction: bool = False,
    weight_decay: Scalar = 0.1,
    cautious_weight_decay: bool = False,
    cautious_mode: CautiousMode | None = None,
    ns_coefficients: CoefficientsLike = "keller",
    ns_steps: int | None = None,
    ns_dtype: torch.dtype | None = None,
    ns_eps: float = 1e-7,
    ns_method: MethodLike = "standard",
    ns_eps_mode: EpsMode = "clamp",
    ns_restarts: Sequence[int] | None = None,
    ns: MatrixFn | None = None,
    scale: ScaleMode = "match_rms_adamw",
    extra_scale: float = 1.0,
    adamw_lr: ScalarOrSchedule | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: Scalar | None = None,
    adamw_nesterov: AdamNesterov = False,
    labels: LabelsLike | None = None,
    views: ViewsLike = None,
    weight_decay_mask: MaskLike = None,
    bucket_numel: int | None = None,
    collectives: Collectives | None = None,
    donate_state: bool = False,
) -> Transform:
    r"""NorMuon (Li et al., 2025) for matrices, AdamW for everything else.

    Matrix leaves get Muon's orthogonalized momentum :math:`O_t`, normalised row by row
    (neuron by neuron) by an EMA of each row's mean square (:func:`scale_by_neuron_norm`):

    .. math::  v_t = \beta_2 v_{t-1} + (1-\beta_2)\,\operatorname{mean}_j O_{t,ij}^2, \quad
               \hat O_t = O_t / (\sqrt{v_t} + \epsilon), \quad
               p \leftarrow p - \eta\, s(A, B)\,\frac{\rho\,\hat O_t}{\|\hat O_t\|_F + \epsilon} - \eta\lambda p

    The defaults are the paper's Algorithm 1: :math:`\rho = \sqrt{\min(A, B)}`
    (``rescale="orthogonal"``) with :math:`s = 0.2\sqrt{\max(A, B)}` gives
    :math:`0.2\sqrt{AB}/\|\hat O_t\|_F`, an update RMS of 0.2 as AdamW's, so one ``lr``
    serves both groups. The official code and pytorch-optimizer's ``NorMuon`` default to
    ``rescale="preserve_norm"`` (:math:`\rho = \|O_t\|_F`) with ``scale="original"``;
    see :doc:`/recipes`.

    Args:
        beta2: :math:`\beta_2` of the row second moment.
        adaptive_eps: :math:`\epsilon` of the row normalisation and of the rescaling.
        rescale: :math:`\rho` (see :func:`scale_by_neuron_norm`).

    The other arguments are :func:`muonfn.muon`'s. ``collectives`` is refused: the row
    statistics need whole rows and the rescaling whole matrices on the rank that holds the
    state, which the sharded strategies do not provide (a ``ValueError`` says so).

    Returns:
        A :class:`Transform` with state ``{"muon": {"momentum", "row_second_moment"}, "adamw": {...}}``.

    Example:
        >>> params = TensorDict({"w": torch.randn(4, 8), "b": torch.zeros(4)}, [])
        >>> state = muonfn.normuon(lr=3e-3).init(params)
        >>> state["muon", "row_second_moment", "w"].shape  # one entry per row
        torch.Size([4, 1])
    """
    refuse_collectives("normuon", collectives)
    return assemble("normuon", locals())


def adamuon(
    lr: ScalarOrSchedule = 1e-3,
    *,
    momentum: Scalar = 0.9,
    nesterov: NesterovLike = False,
    beta2: Scalar = 0.95,
    adaptive_eps: float = 1e-10,
    sign_momentum: bool = True,
    second_moment_bias_correction: bool = False,
    rescale: Rescale = "orthogonal",
    momentum_bias_correction: bool = False,
    weight_decay: Scalar = 0.1,
    cautious_weight_decay: bool = False,
    cautious_mode: CautiousMode | None = None,
    ns_coefficients: CoefficientsLike = "keller",
    ns_steps: int | None = None,
    ns_dtype: torch.dtype | None = None,
    ns_eps: float = 1e-7,
    ns_method: MethodLike = "standard",
    ns_eps_mode: EpsMode = "clamp",
    ns_restarts: Sequence[int] | None = None,
    ns: MatrixFn | None = None,
    scale: ScaleMode = "match_rms_adamw",
    extra_scale: float = 1.0,
    adamw_lr: ScalarOrSchedule | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: Scalar | None = None,
    adamw_nesterov: AdamNesterov = False,
    labels: LabelsLike | None = None,
    views: ViewsLike = None,
    weight_decay_mask: MaskLike = None,
    bucket_numel: int | None = None,
    collectives: Collectives | None = None,
    donate_state: bool = False,
) -> Transform:
    r"""AdaMuon (Si et al., 2025) for matrices, AdamW for everything else.

    Matrix leaves get the sign of the EMA momentum orthogonalized, adapted element-wise by
    an EMA of its square (:func:`scale_by_element_rms`), and rescaled to AdamW's RMS:

    .. math::  O_t = \mathrm{NS}(\operatorname{sign}(M_t)), \quad
               V_t = \beta_2 V_{t-1} + (1-\beta_2)\, O_t \odot O_t, \quad
               \hat O_t = O_t \oslash (\sqrt{V_t} + \epsilon), \quad
               p \leftarrow p - \eta\,\frac{0.2\sqrt{AB}\,\hat O_t}{\|\hat O_t\|_F + \epsilon} - \eta\lambda p

    (``rescale="orthogonal"`` times the ``"match_rms_adamw"`` scale). These defaults are the
    paper's. pytorch-optimizer's and timm's ``AdaMuon`` orthogonalize :math:`M_t` itself
    (``sign_momentum=False``); pytorch-optimizer also bias-corrects :math:`V_t`
    (``second_moment_bias_correction=True``), which the rescaling cancels up to
    :math:`\epsilon`. See :doc:`/recipes`.

    Args:
        momentum: :math:`\beta_1` of the EMA momentum :math:`M_t`.
        beta2: :math:`\beta_2` of the element-wise second moment.
        adaptive_eps: :math:`\epsilon`.
        sign_momentum: orthogonalize :math:`\operatorname{sign}(M_t)` (the paper's
            sign-stabilised update) instead of :math:`M_t`.
        second_moment_bias_correction: divide :math:`V_t` by :math:`1-\beta_2^t`.
        rescale: :math:`\rho` (see :func:`scale_by_element_rms`).

    The other arguments are :func:`muonfn.muon`'s. ``collectives`` is refused: the element-wise
    moment would work on shards, but the rescaling needs each whole matrix's norm on the rank
    that holds its state (a ``ValueError`` says so).

    Returns:
        A :class:`Transform` with state ``{"muon": {"momentum", "exp_avg_sq"}, "adamw": {...}}``
        (and ``"step"`` in ``"muon"`` with ``second_moment_bias_correction`` or
        ``momentum_bias_correction``; with both, each keeps its own count, the second
        moment's as ``{"muon": {"momentum", "step", "second_moment": {"exp_avg_sq", "step"}}}``).

    Example:
        >>> params = TensorDict({"w": torch.randn(4, 8), "b": torch.zeros(4)}, [])
        >>> tx = muonfn.adamuon(lr=3e-3)
        >>> sorted(tx.init(params)["muon"].keys())
        ['exp_avg_sq', 'momentum']
    """
    refuse_collectives("adamuon", collectives)
    return assemble("adamuon", locals())
