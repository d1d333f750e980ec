"""The matrix branch every Muon preset is made of, and the preset around it.

:func:`~muonfn.muon`, :func:`~muonfn.normuon` and :func:`~muonfn.adamuon` differ only in
the step between Newton–Schulz and the shape scale: none, NorMuon's row second moment, or
AdaMuon's element-wise one (fed the sign of the momentum). :func:`matrix_branch` builds each;
:func:`assemble` puts it beside :func:`~muonfn.adamw` in a partition. The ``torch.optim`` shim
builds its groups from the same builders, so the two front ends cannot drift apart.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from tensordict import TensorDictBase

from .. import _tree
from .._validation import Scalar, ScalarOrSchedule, flag, known_names, positive, unit_interval
from ..linalg import MatrixFn, Orthogonalizer, ScaleMode
from ..transforms import (
    CAUTIOUS_MODES,
    SECOND_MOMENT,
    AdamNesterov,
    CautiousMode,
    LabelsLike,
    MaskLike,
    Rescale,
    Transform,
    ViewsLike,
    add_decayed_weights,
    cautious,
    chain,
    check_labels,
    check_mask,
    check_views,
    descent,
    ema_momentum,
    fresh_updates,
    mask_table,
    named,
    newton_schulz_setting,
    orthogonalize,
    partition,
    scale_by_element_rms,
    scale_by_learning_rate,
    scale_by_neuron_norm,
    scale_by_shape,
    scale_by_sign,
)
from ._adamw import adamw
from ._labels import ADAMW, MUON, label_params, warn_if_every_matrix_excluded

if TYPE_CHECKING:
    from ..distributed import ShardSpecs

NesterovLike: TypeAlias = bool | Literal["add"]
Variant: TypeAlias = Literal["muon", "normuon", "adamuon"]
VARIANTS: tuple[str, ...] = ("muon", "normuon", "adamuon")

#: A preset's keywords that spell its Newton–Schulz setting (see :func:`newton_schulz_setting`).
NEWTON_SCHULZ_SPELLINGS = (
    "ns_coefficients",
    "ns_steps",
    "ns_dtype",
    "ns_eps",
    "ns_method",
    "ns_eps_mode",
    "ns_restarts",
)
#: A preset's keywords that :func:`matrix_branch` takes as they are (those a preset has).
BRANCH_OPTIONS = (
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "scale",
    "extra_scale",
    "views",
    "weight_decay_mask",
    "bucket_numel",
    "donate_state",
    "momentum_bias_correction",
    "cautious_weight_decay",
    "cautious_mode",
    "beta2",
    "adaptive_eps",
    "rescale",
    "sign_momentum",
    "second_moment_bias_correction",
)
#: A preset's keywords that :func:`with_adamw` takes.
ADAMW_OPTIONS = (
    "lr",
    "weight_decay",
    "adamw_lr",
    "adamw_betas",
    "adamw_eps",
    "adamw_weight_decay",
    "adamw_nesterov",
    "cautious_weight_decay",
    "labels",
    "views",
    "weight_decay_mask",
    "donate_state",
)


def matrix_branch(
    variant: str,
    *,
    lr: ScalarOrSchedule,
    momentum: Scalar,
    nesterov: NesterovLike,
    weight_decay: Scalar,
    ns: MatrixFn,
    scale: ScaleMode,
    extra_scale: float,
    views: ViewsLike,
    weight_decay_mask: MaskLike,
    bucket_numel: int | None,
    donate_state: bool,
    orthogonalizer: Orthogonalizer | None = None,
    momentum_bias_correction: bool = False,
    cautious_weight_decay: bool = False,
    cautious_mode: CautiousMode | None = None,
    beta2: Scalar = 0.95,
    adaptive_eps: float = 1e-10,
    rescale: Rescale = "orthogonal",
    sign_momentum: bool = False,
    second_moment_bias_correction: bool = False,
) -> Transform:
    r"""The matrix branch of a Muon preset:

    .. math::  u_t = \mathrm{momentum}(g_t), \quad
               O_t = \mathrm{NS}(u_t)\ \text{or}\ \mathrm{NS}(\operatorname{sign} u_t), \quad
               d_t = s(A, B)\,\mathrm{adapt}(O_t), \quad p \leftarrow p - \eta\,(d_t + \lambda p)

    ``variant`` picks :math:`\mathrm{adapt}`: ``"muon"`` none (the shape scale then goes into
    the batched Newton–Schulz call: one pass less), ``"normuon"`` :func:`scale_by_neuron_norm`,
    ``"adamuon"`` :func:`scale_by_element_rms`, with ``beta2``, ``adaptive_eps``, ``rescale``
    (and AdaMuon's ``second_moment_bias_correction``). ``sign_momentum`` orthogonalizes the
    sign of the momentum. ``cautious_mode`` wraps :math:`d_t` in :func:`cautious`, counting
    over whole leaves when ``orthogonalizer`` holds shards. Without caution the shape scale, the
    decay and the learning rate are one rule (:func:`~muonfn.transforms.descent` of the
    orthogonalization or of the shape scale), which rounds
    :math:`(-\eta s)\,x + (-\eta\lambda)\,p`. ``ns`` is the Newton–Schulz setting, resolved
    (see :func:`newton_schulz_setting`); the other keywords are the presets' (see
    :func:`muonfn.muon`).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    flag(f"{variant}: momentum_bias_correction", momentum_bias_correction)
    flag(f"{variant}: cautious_weight_decay", cautious_weight_decay)
    flag(f"{variant}: donate_state", donate_state)
    if cautious_mode is not None and cautious_mode not in CAUTIOUS_MODES:
        raise ValueError(
            f"{variant}: unknown cautious mode {cautious_mode!r}; choose None or one of {list(CAUTIOUS_MODES)}"
        )
    check_mask(f"{variant}: weight_decay_mask", weight_decay_mask)
    check_views(f"{variant}: views", views)
    momentum_step = ema_momentum(
        momentum, nesterov=nesterov, bias_correction=momentum_bias_correction, donate_state=donate_state
    )
    # without caution, the shape scale, the decay and the learning rate are one rule (the learning
    # rate takes no pass of its own); caution reads the direction before the decay, so keeps the chain
    fused_tail = cautious_mode is None and not cautious_weight_decay
    if variant == MUON:
        if sign_momentum or second_moment_bias_correction:
            raise ValueError("muon: sign_momentum and second_moment_bias_correction are AdaMuon's options")
        batched: dict[str, Any] = {
            "ns": ns,
            "views": views,
            "scale": scale,
            "extra_scale": extra_scale,
            "bucket_numel": None if orthogonalizer is not None else bucket_numel,
            "orthogonalizer": orthogonalizer,
            # the momentum's look-ahead is this step's own: Newton–Schulz may store its results there
            "overwrite_input": fresh_updates(nesterov, momentum_bias_correction),
        }
        if fused_tail:
            return chain(momentum_step, descent(orthogonalize(**batched), lr, weight_decay, mask=weight_decay_mask))
        direction = chain(momentum_step, orthogonalize(**batched))
    else:
        adapt = _adaptation(
            variant,
            beta2=beta2,
            adaptive_eps=adaptive_eps,
            rescale=rescale,
            sign_momentum=sign_momentum,
            second_moment_bias_correction=second_moment_bias_correction,
            momentum_bias_correction=momentum_bias_correction,
            views=views,
            donate_state=donate_state,
        )
        signs = [scale_by_sign()] if sign_momentum else []
        # (the sign, like the look-ahead, is this step's own)
        fresh = sign_momentum or fresh_updates(nesterov, momentum_bias_correction)
        ortho = orthogonalize(ns=ns, views=views, bucket_numel=bucket_numel, overwrite_input=fresh)
        shape = scale_by_shape(scale, extra_scale=extra_scale, views=views)
        if fused_tail:
            return chain(momentum_step, *signs, ortho, adapt, descent(shape, lr, weight_decay, mask=weight_decay_mask))
        direction = chain(momentum_step, *signs, ortho, adapt, shape)
    if cautious_mode is not None:
        # a sharded orthogonalizer's leaves are shards: caution counts over the whole leaf
        direction = cautious(direction, mode=cautious_mode, sum_shards=getattr(orthogonalizer, "sum_shards", None))
    # the decay and the learning rate write into the direction's tensors, this step's own: an
    # orthogonalizer returns fresh tensors (its contract), the scale and caution compute out of place
    return chain(
        direction,
        add_decayed_weights(weight_decay, mask=weight_decay_mask, cautious=cautious_weight_decay, inplace=True),
        scale_by_learning_rate(lr, inplace=True),
    )


def _adaptation(
    variant: str,
    *,
    beta2: Scalar,
    adaptive_eps: float,
    rescale: Rescale,
    sign_momentum: bool,
    second_moment_bias_correction: bool,
    momentum_bias_correction: bool,
    views: ViewsLike,
    donate_state: bool,
) -> Transform:
    """NorMuon's or AdaMuon's second-moment step, its options checked under the presets' names
    (the building blocks call them ``beta`` and ``eps``)."""
    unit_interval(f"{variant}: beta2", beta2)
    positive(f"{variant}: adaptive_eps", adaptive_eps)
    flag(f"{variant}: sign_momentum", sign_momentum)
    flag(f"{variant}: second_moment_bias_correction", second_moment_bias_correction)
    if variant == "normuon":
        if second_moment_bias_correction:
            raise ValueError("normuon: second_moment_bias_correction is AdaMuon's (NorMuon's row moment has none)")
        return scale_by_neuron_norm(beta2, eps=adaptive_eps, rescale=rescale, views=views, donate_state=donate_state)
    adapt = scale_by_element_rms(
        beta2,
        eps=adaptive_eps,
        bias_correction=second_moment_bias_correction,
        rescale=rescale,
        views=views,
        donate_state=donate_state,
    )
    # with both corrections each keeps its own count: the momentum's under "step", this one's nested
    return named(SECOND_MOMENT, adapt) if momentum_bias_correction and second_moment_bias_correction else adapt


def assemble(
    variant: str,
    options: Mapping[str, Any],
    *,
    orthogonalizer: Orthogonalizer | None = None,
    shard_specs: ShardSpecs | None = None,
) -> Transform:
    """A preset from its own keywords ``options``: its :func:`matrix_branch` for the matrices,
    :func:`adamw` for the rest, names checked at ``init``. The Newton–Schulz setting is
    resolved here, once."""
    ns = newton_schulz_setting(variant, options["ns"], **{k: options[k] for k in NEWTON_SCHULZ_SPELLINGS})
    given = {k: options[k] for k in BRANCH_OPTIONS if k in options}
    branch = matrix_branch(variant, ns=ns, orthogonalizer=orthogonalizer, **given)
    return with_adamw(variant, branch, shard_specs=shard_specs, **{k: options[k] for k in ADAMW_OPTIONS})


def with_adamw(
    where: str,
    branch: Transform,
    *,
    lr: ScalarOrSchedule,
    weight_decay: Scalar,
    adamw_lr: ScalarOrSchedule | None,
    adamw_betas: tuple[float, float],
    adamw_eps: float,
    adamw_weight_decay: Scalar | None,
    adamw_nesterov: AdamNesterov,
    cautious_weight_decay: bool,
    labels: LabelsLike | None,
    views: ViewsLike,
    weight_decay_mask: MaskLike,
    shard_specs: ShardSpecs | None,
    donate_state: bool,
) -> Transform:
    """A preset: ``branch`` for the matrices, :func:`adamw` for the rest, names checked at ``init``."""
    if labels is not None:
        check_labels(f"{where}: labels", labels)
    branches = {
        MUON: branch,
        ADAMW: adamw(
            lr if adamw_lr is None else adamw_lr,
            betas=adamw_betas,
            eps=adamw_eps,
            weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            weight_decay_mask=weight_decay_mask,
            nesterov=adamw_nesterov,
            cautious_weight_decay=cautious_weight_decay,
            donate_state=donate_state,
        ),
    }
    by_default = labels is None
    if labels is None:
        labels = functools.partial(label_params, shards=tuple(shard_specs)) if shard_specs else label_params
    tx = partition(branches, labels)
    checked = with_name_checks(tx, weight_decay_mask=weight_decay_mask, views=views, shard_specs=shard_specs)
    if not by_default:  # labels of one's own send what they send
        return checked

    def init(params: TensorDictBase) -> TensorDictBase:
        state = checked.init(params)
        warn_if_every_matrix_excluded(f"muonfn.{where}(...).init", params, shards=tuple(shard_specs or ()))
        return state

    return Transform(init, checked.update)


def check_names(params: TensorDictBase, **tables: Any) -> None:
    """Every leaf named by the given tables must be a leaf of ``params``: a typo is an error.

    A table is a mapping of names, or for ``weight_decay_mask`` and ``labels`` a callable
    ``params -> mapping``; callable views are not checked, nor labels given as a TensorDict.
    """
    keys = _tree.leaf_keys(params)
    for where, table in tables.items():
        if where == "weight_decay_mask":
            table = mask_table(table, params, where=where)
        elif where == "labels" and callable(table) and not isinstance(table, TensorDictBase):
            table = table(params)
        if table is not None and not callable(table) and not isinstance(table, TensorDictBase):
            known_names(where, table, keys)


def with_name_checks(tx: Transform, **tables: Any) -> Transform:
    """``tx`` whose ``init`` first runs :func:`check_names` on its params.

    The building blocks inside a partition see only their own leaves and so cannot tell a
    typo from another group's leaf; the preset sees them all.
    """

    def init(params: TensorDictBase) -> TensorDictBase:
        check_names(params, **tables)
        return tx.init(params)

    return Transform(init, tx.update)
