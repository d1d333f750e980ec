"""Muon for matrices with AdamW for the rest: the preset, and the orthogonalizer ``collectives=`` asks for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._validation import Scalar, ScalarOrSchedule
from ..linalg import CoefficientsLike, EpsMode, MatrixFn, Orthogonalizer, ScaleMode
from ..transforms import AdamNesterov, CautiousMode, LabelsLike, MaskLike, MethodLike, Transform, ViewsLike
from ._branch import NesterovLike, assemble
from ._labels import MUON

if TYPE_CHECKING:
    from ..distributed import Collectives, Replicated, ShardSpecs, Strategy


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
        weight_decay_mask: exempts the leaves it maps to ``False`` (default: decay all, as
            torch does); its values must be ``True`` or ``False`` (``"False"`` would read as
            true: an error). ``"matrices"`` decays only the leaves of two dimensions or more
            (matrices and embeddings; not biases and norm gains), in both branches.
        bucket_numel: at most this many elements per batched Newton–Schulz call.
        collectives, strategy, shard_specs, replicated, overlap: sharded and replicated
            parameters (see :func:`muonfn.distributed.sharded_orthogonalizer`): under data
            parallelism (whole matrices on every rank) each matrix is orthogonalized by one
            rank unless ``replicated="local"``; ``overlap=False`` stops pipelining.
        donate_state: update the state in place instead of allocating a new one each step
            (the state passed to ``update`` is then consumed; see :func:`ema_momentum`).

    With the default ``labels``, ``init`` warns (:class:`muonfn.RoutingWarning`) when every
    matrix is excluded by its name (LoRA adapters given alone): the optimizer is then plain
    AdamW. ``init`` checks every name in ``labels``, ``views``, ``weight_decay_mask`` and
    ``shard_specs`` against the parameters (a typo is an error) and every Muon leaf against
    its view, and rejects integer leaves (buffers: see :func:`split_buffers`) and two names
    of one tensor (tied weights). Options of the wrong type (a view that is no
    :class:`MatrixView`, labels or a mask that are neither a mapping nor a callable, a mask
    value other than ``True``/``False``) are refused when the transform is built.

    Returns:
        A :class:`Transform` with state ``{"muon": {"momentum"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}``.

    Example:
        >>> params = TensorDict({"w": torch.randn(4, 8), "b": torch.zeros(4)}, [])
        >>> tx = muonfn.muon(lr=3e-3)
        >>> state = tx.init(params)
        >>> sorted(state.keys(True, True))
        [('adamw', 'exp_avg', 'b'), ('adamw', 'exp_avg_sq', 'b'), ('adamw', 'step', 'b'), ('muon', 'momentum', 'w')]
    """
    orthogonalizer = muon_orthogonalizer(
        collectives, strategy, shard_specs, bucket_numel, replicated=replicated, overlap=overlap
    )
    return assemble(MUON, locals(), orthogonalizer=orthogonalizer, shard_specs=shard_specs)
