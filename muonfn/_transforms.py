r"""The building blocks: each a small function returning a :class:`Transform`.

Elementwise math runs as TensorDict arithmetic (fused multi-tensor kernels); nothing
calls ``.item()`` or branches on data, so every update can be vmapped and compiled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from tensordict import TensorDict, TensorDictBase

from . import _tree
from ._base import InitFn, Transform, empty_state
from ._newton_schulz import CoefficientsLike, newton_schulz, ns_schedule
from ._validation import Scalar, ScalarOrSchedule, check_grads, non_negative, positive, unit_interval
from ._views import ViewsLike, block_scales, check_scale, resolve_views

if TYPE_CHECKING:
    from .distributed import Collectives, ShardSpecs

MaskLike: TypeAlias = Mapping[Any, bool] | Callable[[TensorDictBase], Mapping[Any, bool]] | None

DEFAULT_BUCKET_NUMEL = 1 << 26


def _neg(v: Scalar) -> Scalar:
    return v.neg() if isinstance(v, torch.Tensor) else -v


def _one_minus(v: Scalar) -> Scalar:
    return v.neg().add(1) if isinstance(v, torch.Tensor) else 1.0 - v


def _mul(td: TensorDictBase, v: Scalar) -> TensorDictBase:
    """``td * v``. A tensor ``v`` meets DTensor leaves one at a time: a fused op would put it on
    the first leaf's mesh, and leaves may live on several meshes (tensor parallel + FSDP)."""
    if isinstance(v, torch.Tensor) and any(hasattr(x, "placements") for x in td.values(True, True)):
        return td.apply(lambda x: x.mul(v))
    return td.mul(v)


def ema_momentum(momentum: Scalar = 0.95, nesterov: bool = True) -> Transform:
    r"""Exponential moving average of the gradients (torch.optim.Muon's form).

    .. math::  b_t = \mu\, b_{t-1} + (1-\mu)\, g_t, \qquad
               u_t = \begin{cases} (1-\mu)\, g_t + \mu\, b_t & \text{Nesterov} \\ b_t \end{cases}

    State: ``{"momentum": b}`` shaped like the params, in their dtype.
    """
    unit_interval("momentum", momentum)

    def init(params: TensorDictBase) -> TensorDictBase:
        return TensorDict({"momentum": params.apply(torch.zeros_like)}, batch_size=params.batch_size)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        buf = state["momentum"]
        check_grads("ema_momentum", grads, buf)
        new_buf = _tree.subset(buf, _tree.leaf_keys(grads)).lerp(grads, _one_minus(momentum))
        updates = grads.lerp(new_buf, momentum) if nesterov else new_buf
        return updates, TensorDict({"momentum": _tree.carry(buf, new_buf)}, batch_size=state.batch_size)

    return Transform(init, update)


def _chunks(members: list[int], sizes: list[int], cap: int) -> list[list[int]]:
    """Splits ``members`` into runs whose sizes add up to at most ``cap`` (at least one each)."""
    chunks: list[list[int]] = [[]]
    total = 0
    for i in members:
        if chunks[-1] and total + sizes[i] > cap:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += sizes[i]
    return chunks


def orthogonalize_batches(
    matrices: list[torch.Tensor], scales: list[float], ns: Callable[[torch.Tensor], torch.Tensor], bucket_numel: int
) -> list[torch.Tensor]:
    """``scale * ns(m)`` for every ``(count, rows, cols)`` batch, equal shapes stacked into one call."""
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(matrices):
        buckets.setdefault((m.shape[1:], m.dtype, m.device, scales[i]), []).append(i)
    sizes = [m.numel() for m in matrices]
    out: list[torch.Tensor] = list(matrices)
    for (_, _, _, scale), members in buckets.items():
        for chunk in _chunks(members, sizes, bucket_numel):
            stacked = matrices[chunk[0]] if len(chunk) == 1 else torch.cat([matrices[j] for j in chunk])
            result = ns(stacked)
            if scale != 1.0:
                result = result.mul_(scale)
            for j, piece in zip(chunk, result.split([matrices[j].shape[0] for j in chunk])):
                out[j] = piece
    return out


def orthogonalize(
    coefficients: CoefficientsLike = "keller",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    views: ViewsLike = None,
    scale: str = "none",
    extra_scale: float = 1.0,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    collectives: Collectives | None = None,
    strategy: str = "owner",
    shard_specs: ShardSpecs | None = None,
) -> Transform:
    r"""Replaces every matrix :math:`G` by :math:`s(A, B)\cdot\mathrm{NS}(G)`.

    Leaves are read as matrices through their :class:`MatrixView`; same-shape matrices
    are stacked into one batched Newton–Schulz call (at most ``bucket_numel`` elements a
    batch). ``scale`` picks :math:`s` (``"none"`` by default, see :func:`scale_by_shape`).
    With ``collectives``, sharded leaves (DTensors, or local shards described by
    ``shard_specs``) are orthogonalized as whole matrices by ``strategy``
    (see :mod:`muonfn.distributed`). Stateless; ``init`` checks that every leaf's view
    can read it (a vector is no matrix), or, with ``collectives``, the first update does.
    """
    ns_schedule(coefficients, steps)
    positive("ns eps", eps)
    check_scale(scale, extra_scale)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"ns dtype must be a real floating-point torch.dtype, got {dtype!r}")
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be an integer >= 1, got {bucket_numel!r}")

    def ns(x: torch.Tensor) -> torch.Tensor:
        return newton_schulz(x, coefficients, steps, eps, dtype)

    distributed = None
    if collectives is not None:
        from .distributed import sharded_orthogonalizer

        distributed = sharded_orthogonalizer(
            collectives,
            strategy,
            shard_specs,
            bucket_numel,
            coefficients=coefficients,
            steps=steps,
            eps=eps,
            dtype=dtype,
        )

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        keys = _tree.leaf_keys(grads)
        values = _tree.leaves(grads)
        leaf_views = resolve_views(views, keys, values)
        if distributed is not None:  # checks the views against the global shapes
            out = distributed(keys, values, leaf_views, ns, scale, extra_scale)
            return _tree.build(keys, out, grads), state
        for key, g, view in zip(keys, values, leaf_views):
            view.check(key, g.shape)
            placements = tuple(getattr(g, "placements", ()))
            if any(not p.is_replicate() for p in placements):
                raise ValueError(
                    f"{_tree.dotted(key)!r} is a DTensor sharded as {placements}: Newton–Schulz needs whole "
                    "matrices; pass collectives=muonfn.distributed.torch_collectives(mesh)"
                )
        matrices: list[torch.Tensor] = []
        scales: list[float] = []
        for g, view in zip(values, leaf_views):
            matrices += view.to_matrices(g)
            scales += block_scales(view, g.shape, scale, extra_scale)
        done = orthogonalize_batches(matrices, scales, ns, bucket_numel)
        out, pos = [], 0
        for g, view in zip(values, leaf_views):
            n = len(view.blocks(g.shape))
            out.append(view.from_matrices(done[pos : pos + n], g.shape))
            pos += n
        return _tree.build(keys, out, grads), state

    # sharded leaves may be local blocks: their views are checked against global shapes at update
    return Transform(_view_checker(views) if distributed is None else empty_state, update)


def _view_checker(views: ViewsLike) -> InitFn:
    """An ``init`` that rejects leaves their view cannot read (a vector labelled as a matrix)."""

    def init(params: TensorDictBase) -> TensorDictBase:
        keys, values = _tree.leaf_keys(params), _tree.leaves(params)
        for key, p, view in zip(keys, values, resolve_views(views, keys, values)):
            view.check(key, p.shape)
        return empty_state(params)

    return init


def scale_by_shape(scale: str = "match_rms_adamw", extra_scale: float = 1.0, views: ViewsLike = None) -> Transform:
    r"""Multiplies every matrix block by :math:`s(A, B)\cdot` ``extra_scale``.

    ``A``/``B`` are the rows (fan-out) and columns (fan-in) of the logical matrix
    (after the view: conv kernels flattened, ``(in, out)`` storage transposed, fused
    blocks each on their own). Modes: ``"original"`` √max(1, A/B), ``"match_rms_adamw"``
    0.2·√max(A, B), ``"spectral"`` √max(A, B), ``"unit_rms_norm"`` √(A/B), ``"none"`` 1.
    Stateless; ``init`` checks that every leaf's view can read it.
    """
    check_scale(scale, extra_scale)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        keys = _tree.leaf_keys(grads)
        values = _tree.leaves(grads)
        out = []
        for key, g, view in zip(keys, values, resolve_views(views, keys, values)):
            view.check(key, g.shape)
            scales = block_scales(view, g.shape, scale, extra_scale)
            if len(scales) == 1:
                out.append(g.mul(scales[0]))
            else:
                blocks = [b.mul(s) for b, s in zip(view.to_matrices(g), scales)]
                out.append(view.from_matrices(blocks, g.shape))
        return _tree.build(keys, out, grads), state

    return Transform(_view_checker(views), update)


def scale_by_muon(
    momentum: Scalar = 0.95,
    nesterov: bool = True,
    ns_coefficients: CoefficientsLike = "keller",
    ns_steps: int | None = None,
    ns_dtype: torch.dtype | None = None,
    ns_eps: float = 1e-7,
    scale: str = "match_rms_adamw",
    extra_scale: float = 1.0,
    views: ViewsLike = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    collectives: Collectives | None = None,
    strategy: str = "owner",
    shard_specs: ShardSpecs | None = None,
) -> Transform:
    r"""Muon's direction: :math:`s(A, B)\cdot\mathrm{NS}(u)` with :math:`u` the (Nesterov) EMA momentum.

    Equal to ``chain(ema_momentum(...), orthogonalize(...), scale_by_shape(...))``; the
    scale is applied inside the batched Newton–Schulz call to save a pass over memory.
    State: ``{"momentum": ...}``.
    """
    from ._combinators import chain

    return chain(
        ema_momentum(momentum, nesterov),
        orthogonalize(
            ns_coefficients,
            ns_steps,
            ns_eps,
            ns_dtype,
            views,
            scale,
            extra_scale,
            bucket_numel,
            collectives,
            strategy,
            shard_specs,
        ),
    )


def _cast_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.dtype)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Transform:
    r"""Adam's direction with bias correction, exactly as torch.optim.AdamW computes it.

    .. math::  m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
               v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad
               u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}

    ``t`` counts per leaf, so a leaf that had no gradient keeps its own bias correction.
    State: ``{"step": int64 per leaf, "exp_avg": m, "exp_avg_sq": v}``.
    """
    unit_interval("b1", b1)
    unit_interval("b2", b2)
    positive("eps", eps)
    log_b1, log_b2 = math.log(b1) if b1 > 0 else -math.inf, math.log(b2) if b2 > 0 else -math.inf

    def init(params: TensorDictBase) -> TensorDictBase:
        return TensorDict(
            {
                # new_zeros: a DTensor param gets a replicated DTensor step on its own mesh, so the
                # bias corrections combine with its moments even when params live on several meshes
                "step": params.apply(lambda p: p.new_zeros((), dtype=torch.int64)),
                "exp_avg": params.apply(torch.zeros_like),
                "exp_avg_sq": params.apply(torch.zeros_like),
            },
            batch_size=params.batch_size,
        )

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_grads("scale_by_adam", grads, state["exp_avg"])
        keys = _tree.leaf_keys(grads)
        step = _tree.subset(state["step"], keys).add(1)
        exp_avg = _tree.subset(state["exp_avg"], keys).lerp(grads, 1.0 - b1)
        exp_avg_sq = _tree.subset(state["exp_avg_sq"], keys).mul(b2).addcmul(grads, grads, value=1.0 - b2)
        t = step.to(torch.float64)
        # 1 - beta**t, written with exp so that t may be a tensor
        bias_correction1 = t.mul(log_b1).exp().neg().add(1.0)
        bias_correction2 = t.mul(log_b2).exp().neg().add(1.0)
        denom = exp_avg_sq.sqrt().div(bias_correction2.sqrt()).add(eps)
        # a 0-d leaf meets the 0-d fp64 corrections as an equal and is promoted: cast it back
        updates = exp_avg.div(bias_correction1).div(denom).apply(_cast_like, grads)
        new_state = TensorDict(
            {
                "step": _tree.carry(state["step"], step),
                "exp_avg": _tree.carry(state["exp_avg"], exp_avg),
                "exp_avg_sq": _tree.carry(state["exp_avg_sq"], exp_avg_sq),
            },
            batch_size=state.batch_size,
        )
        return updates, new_state

    return Transform(init, update)


def resolve_mask(mask: MaskLike, params: TensorDictBase, default: bool) -> list[_tree.Key]:
    """The leaf keys a mask selects: all of them for ``None``; leaves it does not name get ``default``.

    Names that are not leaves of ``params`` are ignored: a transform inside
    :func:`partition` sees only its own leaves of a mask written for the whole model.
    """
    keys = _tree.leaf_keys(params)
    if mask is None:
        return keys
    table = mask(params) if callable(mask) else mask
    flags: dict[_tree.Key, bool] = {}
    for name, flag in table.items():
        try:
            flags[_tree.resolve_key(name, keys)] = bool(flag)
        except KeyError:
            continue
    return [k for k in keys if flags.get(k, default)]


def add_decayed_weights(weight_decay: Scalar = 0.0, mask: MaskLike = None) -> Transform:
    r"""Decoupled weight decay: :math:`u \leftarrow u + \lambda\,p` on the leaves ``mask`` selects.

    Followed by :func:`scale_by_learning_rate` this is :math:`p \leftarrow p - \eta\lambda p`
    with the unadjusted learning rate (torch semantics). ``mask``: a mapping from key to
    bool, or a callable ``params -> mapping``; leaves it does not name are decayed, so
    ``{"norm.weight": False}`` exempts just that leaf. ``None`` decays every leaf. Stateless.
    """
    non_negative("weight_decay", weight_decay)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        if isinstance(weight_decay, float | int) and weight_decay == 0:
            return grads, state
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(grads, state, params)")
        check_grads("add_decayed_weights", grads, params)
        keys = resolve_mask(mask, _tree.subset(params, _tree.leaf_keys(grads)), default=True)
        if not keys:
            return grads, state
        decayed = _tree.subset(grads, keys).add(_mul(_tree.subset(params, keys), weight_decay))
        return _tree.carry(grads, decayed), state

    return Transform(empty_state, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule) -> Transform:
    r""":math:`u \leftarrow -\eta\, u`, so that ``apply_updates`` descends.

    ``learning_rate`` is a float, a 0-d tensor (change it in place between steps: no
    recompilation), or a schedule ``step -> lr`` called with the 0-d int64 count of
    previous updates (state ``{"count": ...}`` then).
    """
    non_negative("learning rate", learning_rate)

    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        schedule = learning_rate

        def init(params: TensorDictBase) -> TensorDictBase:
            device = next(iter(params.values(True, True)), torch.empty(0)).device
            return TensorDict(
                {"count": torch.zeros(params.batch_size, dtype=torch.int64, device=device)},
                batch_size=params.batch_size,
            )

        def update(
            grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
        ) -> tuple[TensorDictBase, TensorDictBase]:
            count = state["count"]
            lr = schedule(count)
            updates = _mul(grads, _neg(lr))
            return updates, TensorDict({"count": count + 1}, batch_size=state.batch_size)

        return Transform(init, update)

    lr = learning_rate

    def scale(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        return _mul(grads, _neg(lr)), state

    return Transform(empty_state, scale)
