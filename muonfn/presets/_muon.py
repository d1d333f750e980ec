"""Ready-made optimizers: Muon for matrices with AdamW for the rest, and AdamW alone.

Each is a :func:`~muonfn.partition` of named branches; :func:`muon_branch` and
:func:`adamw` are also what the ``torch.optim`` shim builds its groups from, so the two
front ends cannot drift apart.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch
from tensordict import TensorDictBase

from .. import _tree
from .._validation import Scalar, ScalarOrSchedule, flag, known_names
from ..linalg import CoefficientsLike, EpsMode, MatrixFn, Orthogonalizer, ScaleMode
from ..transforms import (
    CAUTIOUS_MODES,
    CautiousMode,
    LabelsLike,
    MaskLike,
    MethodLike,
    SumShards,
    Transform,
    ViewsLike,
    add_decayed_weights,
    cautious,
    chain,
    check_labels,
    check_mask,
    check_views,
    mask_table,
    newton_schulz_setting,
    partition,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_muon,
)
from ..transforms._adam import AdamNesterov
from ._labels import ADAMW, MUON, label_params

if TYPE_CHECKING:
    from ..distributed import Collectives, Replicated, ShardSpecs, Strategy

NesterovLike: TypeAlias = bool | Literal["add"]


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
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
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`.
        weight_decay: :math:`\lambda`.
        weight_decay_mask: exempts the leaves it maps to ``False`` (see
            :func:`add_decayed_weights`). Names it holds that are not among the parameters
            are ignored, as ``adamw`` is often one branch of a :func:`partition`;
            :func:`muon` checks them against all parameters.
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
    # Adam's direction is a fresh tensor: the decay and the learning rate may write into it
    return chain(
        scale_by_adam(betas[0], betas[1], eps=eps, nesterov=nesterov, donate_state=donate_state),
        add_decayed_weights(weight_decay, mask=weight_decay_mask, cautious=cautious_weight_decay, inplace=True),
        scale_by_learning_rate(lr, inplace=True),
    )


def _pair(name: str, betas: Any) -> tuple[float, float]:
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(f"{name} must be a pair (beta1, beta2), got {betas!r}")
    return betas[0], betas[1]


def muon_branch(
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
    orthogonalizer: Orthogonalizer | None,
    bucket_numel: int | None,
    donate_state: bool,
    momentum_bias_correction: bool = False,
    cautious_weight_decay: bool = False,
    cautious_mode: CautiousMode | None = None,
) -> Transform:
    """The Muon branch of :func:`muon`: momentum, Newton–Schulz and shape scale, decay, learning rate."""
    check_branch_flags("muon", momentum_bias_correction, cautious_weight_decay, cautious_mode, donate_state)
    check_mask("muon: weight_decay_mask", weight_decay_mask)
    check_views("muon: views", views)
    direction = scale_by_muon(
        momentum,
        nesterov=nesterov,
        momentum_bias_correction=momentum_bias_correction,
        ns=ns,
        scale=scale,
        extra_scale=extra_scale,
        views=views,
        bucket_numel=None if orthogonalizer is not None else bucket_numel,
        orthogonalizer=orthogonalizer,
        donate_state=donate_state,
    )
    return finish_branch(
        direction,
        lr=lr,
        weight_decay=weight_decay,
        weight_decay_mask=weight_decay_mask,
        cautious_weight_decay=cautious_weight_decay,
        cautious_mode=cautious_mode,
        # a sharded orthogonalizer's leaves are shards: caution counts over the whole leaf
        sum_shards=getattr(orthogonalizer, "sum_shards", None),
    )


def check_branch_flags(
    where: str,
    momentum_bias_correction: bool,
    cautious_weight_decay: bool,
    cautious_mode: str | None,
    donate_state: bool,
) -> None:
    """The switches every Muon-type branch takes: booleans, and a known cautious mode."""
    flag(f"{where}: momentum_bias_correction", momentum_bias_correction)
    flag(f"{where}: cautious_weight_decay", cautious_weight_decay)
    flag(f"{where}: donate_state", donate_state)
    if cautious_mode is not None and cautious_mode not in CAUTIOUS_MODES:
        raise ValueError(
            f"{where}: unknown cautious mode {cautious_mode!r}; choose None or one of {list(CAUTIOUS_MODES)}"
        )


def finish_branch(
    direction: Transform,
    *,
    lr: ScalarOrSchedule,
    weight_decay: Scalar,
    weight_decay_mask: MaskLike,
    cautious_weight_decay: bool,
    cautious_mode: CautiousMode | None,
    sum_shards: SumShards | None = None,
) -> Transform:
    """``direction`` (made cautious with ``cautious_mode``, counting over whole leaves through
    ``sum_shards``), then the weight decay and the learning rate.

    Both write into the direction's tensors, which are this step's own: an orthogonalizer
    returns fresh tensors (its contract), and the shape scale and caution compute out of place.
    """
    if cautious_mode is not None:
        direction = cautious(direction, mode=cautious_mode, sum_shards=sum_shards)
    return chain(
        direction,
        add_decayed_weights(weight_decay, mask=weight_decay_mask, cautious=cautious_weight_decay, inplace=True),
        scale_by_learning_rate(lr, inplace=True),
    )


def muon_orthogonalizer(
    collectives: Collectives | None,
    strategy: Strategy,
    shard_specs: ShardSpecs | None,
    bucket_numel: int | None,
    *,
    replicated: Replicated = "split",
    overlap: bool = True,
) -> Orthogonalizer | None:
    """The orthogonalizer ``collectives=`` asks for (``None``: the local one).

    Distributed settings without collectives would be ignored, so they are an error.
    """
    if shard_specs is not None and not isinstance(shard_specs, Mapping):
        raise TypeError(f"shard_specs must be a mapping of names to ShardSpec, got {type(shard_specs).__name__}")
    if strategy != "owner":
        from ..distributed import STRATEGIES

        if strategy not in STRATEGIES:
            raise ValueError(f"unknown distributed strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    if collectives is None:
        if shard_specs:
            raise ValueError("shard_specs describe shards for collectives=...; pass the collectives of their group")
        for name, value, default in (("strategy", strategy, "owner"), ("replicated", replicated, "split")):
            if value != default:
                raise ValueError(f"{name}={value!r} takes effect with collectives=...; pass them, or drop {name}")
        if overlap is not True:
            raise ValueError(f"overlap={overlap!r} takes effect with collectives=...; pass them, or drop overlap")
        return None
    from ..distributed import sharded_orthogonalizer

    kwargs: dict[str, Any] = {} if bucket_numel is None else {"bucket_numel": bucket_numel}
    return sharded_orthogonalizer(
        collectives, strategy=strategy, shard_specs=shard_specs, replicated=replicated, overlap=overlap, **kwargs
    )


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


def checks_names(tx: Transform, **tables: Any) -> Transform:
    """``tx`` whose ``init`` first runs :func:`check_names` on its params.

    The building blocks inside a partition see only their own leaves and so cannot tell a
    typo from another group's leaf; the preset sees them all.
    """

    def init(params: TensorDictBase) -> TensorDictBase:
        check_names(params, **tables)
        return tx.init(params)

    return Transform(init, tx.update)


def muon(
    lr: ScalarOrSchedule = 1e-3,
    *,
    momentum: Scalar = 0.95,
    nesterov: NesterovLike = True,
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
    strategy: Strategy = "owner",
    shard_specs: ShardSpecs | None = None,
    replicated: Replicated = "split",
    overlap: bool = True,
    donate_state: bool = False,
) -> Transform:
    r"""Muon for matrices, AdamW for everything else.

    Matrix leaves (label ``"muon"``) get

    .. math::  p \leftarrow p - \eta\, s(A, B)\,\mathrm{NS}(u_t) - \eta\lambda p

    with :math:`u_t` the Nesterov EMA momentum (see :func:`ema_momentum`) and :math:`s`
    the ``scale`` mode times ``extra_scale``; the default ``"match_rms_adamw"``
    (0.2·√max(A, B)) gives the update AdamW's RMS, so one ``lr`` and ``weight_decay`` serve
    both groups. Other leaves (label ``"adamw"``) get :func:`adamw` with the ``adamw_*``
    settings, each ``None`` meaning "the Muon value".

    Args:
        lr: :math:`\eta`: a float, a 0-d tensor or a schedule ``step -> lr``.
        momentum: :math:`\mu` of the EMA momentum, in [0, 1).
        nesterov: use the Nesterov look-ahead; ``"add"`` for heavyball's :math:`g_t + b_t`
            (see :func:`ema_momentum`).
        momentum_bias_correction: optax's bias-corrected momentum (see :func:`ema_momentum`).
        weight_decay: decoupled :math:`\lambda`, applied with the unadjusted ``lr``.
        cautious_weight_decay: decay only where the update and the parameter agree in sign
            (see :func:`add_decayed_weights`), in both branches.
        cautious_mode: ``"heavyball"`` or ``"pytorch_optimizer"`` wraps the Muon direction in
            :func:`cautious` (``None``: not cautious).
        ns_coefficients, ns_steps, ns_dtype, ns_eps, ns_method, ns_eps_mode, ns_restarts: the
            Newton–Schulz iteration (see :func:`orthogonalize`); ``ns_method="gram"`` runs Gram
            Newton–Schulz where it is cheaper, ``"svd"``/``"qr"``/a callable replace it;
            ``ns_eps_mode="add"`` normalises by :math:`\|G\|_F + \varepsilon`.
        ns: the whole Newton–Schulz setting in one value instead of the ``ns_*`` keywords
            (which must then keep their defaults): a :class:`NewtonSchulz`, or any map of
            ``(count, m, n)`` batches such as :func:`muonfn.polar`.
        scale, extra_scale: the shape scale :math:`s` (see :func:`scale_by_shape`).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW branch.
        adamw_nesterov: NAdamW for the AdamW branch (see :func:`adamw`).
        labels: routes leaves to ``"muon"`` or ``"adamw"``; default :func:`label_params`
            (matrices except embeddings, output heads and token parameters; the leaves of
            ``shard_specs`` by their number of dimensions); :func:`labels_from_module`
            labels by module type instead.
        views: conv, expert, fused and transposed matrices (:class:`MatrixView` by name).
        weight_decay_mask: exempts the leaves it maps to ``False`` (default: decay all); its
            values must be ``True`` or ``False`` (``"False"`` would read as true: an error).
        bucket_numel: at most this many elements per batched Newton–Schulz call.
        collectives, strategy, shard_specs, replicated, overlap: sharded and replicated
            parameters (see :func:`muonfn.distributed.sharded_orthogonalizer`): under data
            parallelism (whole matrices on every rank) each matrix is orthogonalized by one
            rank unless ``replicated="local"``; ``overlap=False`` stops pipelining.
        donate_state: update the state in place instead of allocating a new one each step
            (the state passed to ``update`` is then consumed; see :func:`ema_momentum`).

    ``init`` checks every name in ``labels``, ``views``, ``weight_decay_mask`` and
    ``shard_specs`` against the parameters (a typo is an error) and every Muon leaf against
    its view, and rejects integer leaves (buffers: see :func:`split_buffers`) and two names
    of one tensor (tied weights). Options of the wrong type (a view that is no
    :class:`MatrixView`, labels or a mask that are neither a mapping nor a callable, a mask
    value other than ``True``/``False``) are refused when the transform is built.

    Returns:
        A :class:`Transform` with state ``{"muon": {"momentum"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}``.

    Example:
        >>> params = TensorDict({"w": torch.randn(4, 8), "b": torch.zeros(4)}, [])
        >>> tx = muonfn.muon(lr=0.02)
        >>> state = tx.init(params)
        >>> sorted(state.keys(True, True))
        [('adamw', 'exp_avg', 'b'), ('adamw', 'exp_avg_sq', 'b'), ('adamw', 'step', 'b'), ('muon', 'momentum', 'w')]
    """
    branch = muon_branch(
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        ns=newton_schulz_setting(
            "muon",
            ns,
            ns_coefficients=ns_coefficients,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            ns_eps=ns_eps,
            ns_method=ns_method,
            ns_eps_mode=ns_eps_mode,
            ns_restarts=ns_restarts,
        ),
        scale=scale,
        extra_scale=extra_scale,
        views=views,
        weight_decay_mask=weight_decay_mask,
        orthogonalizer=muon_orthogonalizer(
            collectives, strategy, shard_specs, bucket_numel, replicated=replicated, overlap=overlap
        ),
        bucket_numel=bucket_numel,
        donate_state=donate_state,
        momentum_bias_correction=momentum_bias_correction,
        cautious_weight_decay=cautious_weight_decay,
        cautious_mode=cautious_mode,
    )
    return with_adamw(
        "muon",
        branch,
        lr=lr,
        weight_decay=weight_decay,
        adamw_lr=adamw_lr,
        adamw_betas=adamw_betas,
        adamw_eps=adamw_eps,
        adamw_weight_decay=adamw_weight_decay,
        adamw_nesterov=adamw_nesterov,
        cautious_weight_decay=cautious_weight_decay,
        labels=labels,
        views=views,
        weight_decay_mask=weight_decay_mask,
        shard_specs=shard_specs,
        donate_state=donate_state,
    )


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
    if labels is None:
        labels = functools.partial(label_params, shards=tuple(shard_specs)) if shard_specs else label_params
    tx = partition(branches, labels)
    return checks_names(tx, weight_decay_mask=weight_decay_mask, views=views, shard_specs=shard_specs)
