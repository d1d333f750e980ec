r"""The building blocks, in the order a step meets them: momentum, Newton–Schulz, then the shape
scale, the decay and the learning rate (:func:`descent`, a matrix branch's last stage), with Adam
and AdamW beside them, then NorMuon's and AdaMuon's adaptations.

Each is a :class:`~muonfn.Transform` over flat TensorDicts (see :mod:`muonfn.transforms`) computing
with torch's multi-tensor ops, one call for a whole list of leaves. Hyperparameters are numbers,
0-d tensors (read as the number they hold in an eager step, so a scheduler's refill does not
recompile a traced one), or, for the learning rate, a schedule ``count -> lr``. ``donate_state=True``
writes the state in place (peak memory holds one copy of it, as with ``torch.optim``): the state
given to ``update`` is then consumed, and the results are the same bits.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Literal, TypeAlias, TypeGuard, get_args

import torch
from tensordict import TensorDictBase

from . import _devices
from ._tree import build, cast_like, named_leaves, named_table, nested_like, replaced
from ._validation import Scalar, ScalarOrSchedule, Schedule, flag, non_negative, positive, schedule_value, unit_interval
from .linalg import (
    DEFAULT_VIEW,
    LocalOrthogonalizer,
    MatrixFn,
    MatrixView,
    NewtonSchulz,
    Orthogonalizer,
    ScaleLike,
    check_matrix_fn,
    may_write_into,
    polar,
    qr_orthogonal,
    scaled_mode,
    shape_scale,
)
from .transforms import MaskLike, Transform, chain, check_mask, matched, selected, transform

ViewsLike: TypeAlias = Mapping[Any, MatrixView] | Callable[[str, torch.Tensor], MatrixView | None] | None
NesterovLike: TypeAlias = bool | Literal["add"]
AdamNesterov: TypeAlias = bool | Literal["timm"]
Rescale: TypeAlias = Literal["preserve_norm", "orthogonal", "none"]
RESCALE_MODES: tuple[str, ...] = get_args(Rescale)

# ---------------------------------------------------------------------------------------------- arithmetic


def _number(value: Any) -> Any:
    """``value``, but a plain 0-d tensor on the host read as the number it holds in an eager step
    (free: no device waits), so that a number and a tensor holding it round alike; under ``vmap``
    too, where no member maps it (an ensemble rounds as its members do alone)."""
    if (
        type(value) is torch.Tensor
        and value.ndim == 0
        and value.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_batchedtensor(value)
        and not torch._C._functorch.is_gradtrackingtensor(value)
        and not (value.requires_grad and torch.is_grad_enabled())
    ):
        return value.item()
    return value


def _foreach(op: str, tensors: Sequence[torch.Tensor], *operands: Any, inplace: bool = False, **kw: Any) -> list[Any]:
    """``t.<op>(*operands)`` (``op_`` with ``inplace``) for every tensor, a list operand one value
    per tensor: one multi-tensor call, or one op a tensor where torch has none (under ``torch.func``
    transforms; DTensors meeting plain tensors; bf16/fp16 written in place with a number, whose
    fused kernels round otherwise than the out-of-place ones)."""
    if not tensors:
        return []
    mapped = torch._C._are_functorch_transforms_active()
    narrow = inplace and min(map(torch.Tensor.element_size, tensors)) < 4
    with_number = narrow and any(isinstance(v, int | float) for v in (*operands, *kw.values()))
    if mapped or with_number or (hasattr(tensors[0], "placements") and _meet_plain(operands)):
        lists = [v if isinstance(v, list | tuple) else [v] * len(tensors) for v in operands]
        return [_one_op(op, t, args, kw, inplace, mapped) for t, *args in zip(tensors, *lists)]
    result = getattr(torch, f"_foreach_{op}_" if inplace else f"_foreach_{op}")(list(tensors), *operands, **kw)
    return list(tensors) if inplace else list(result)


def _meet_plain(operands: Sequence[Any]) -> bool:
    """Whether DTensors meet a tensor, or a list of plain ones: a fused op would put the plain tensors on
    the first leaf's mesh, and leaves may live on several meshes (TP beside FSDP2)."""
    firsts = [v[0] if isinstance(v, list | tuple) and v else v for v in operands]
    return any(isinstance(f, torch.Tensor) and not hasattr(f, "placements") for f in firsts)


def _one_op(op: str, t: torch.Tensor, operands: Sequence[Any], kw: dict[str, Any], inplace: bool, mapped: bool) -> Any:
    """``t.<op>(*operands)`` (``op_`` with ``inplace``); under ``torch.func`` transforms (``mapped``), a
    bf16/fp16 ``t`` meeting a wider factor (a per-leaf correction) computed in the factor's dtype and
    rounded once, as the eager kernels compute it: ``vmap`` would round a 0-d factor to ``t``'s dtype
    first, and a vmapped ensemble would part from the stacked one."""
    if mapped and t.dtype.itemsize < 4 and any(isinstance(v, torch.Tensor) and v.dtype.itemsize >= 4 for v in operands):
        result = getattr(t.to(torch.promote_types(t.dtype, torch.float32)), op)(*operands, **kw).to(t.dtype)
        return t.copy_(result) if inplace else result
    return getattr(t, f"{op}_" if inplace else op)(*operands, **kw)


def _lerp(starts: Sequence[torch.Tensor], ends: Sequence[torch.Tensor], weight: Any, inplace: bool) -> list[Any]:
    """``start + weight·(end - start)`` per pair, as ``torch.lerp`` computes it (a tensor ``weight``
    taken in each leaf's dtype, at least fp32)."""
    if not isinstance(weight, torch.Tensor):
        return _foreach("lerp", starts, ends, weight, inplace=inplace)
    out = []
    for s, e in zip(starts, ends):
        wide = torch.promote_types(s.dtype, torch.float32)
        result = s.to(wide).lerp(e.to(wide), weight.to(wide)).to(s.dtype)
        out.append(s.copy_(result) if inplace else result)
    return out


def second_moment_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype squares of a leaf are kept in: its own, but fp32 for fp16 (whose range stops at 6e-8,
    so the square of an entry below 2.4e-4, and an epsilon such as 1e-8, round to zero)."""
    return torch.float32 if dtype == torch.float16 else dtype


def _per_leaf(factors: torch.Tensor, like: Sequence[torch.Tensor], members: int) -> list[torch.Tensor]:
    """Row ``i`` of ``factors`` (fp64, one value per leaf or per leaf and ensemble member) as a tensor
    of leaf ``i``'s dtype (at least fp32) shaped to broadcast against it: rounded once, one cast per
    dtype for all leaves (not a kernel per leaf)."""
    rows: dict[torch.dtype, Sequence[torch.Tensor]] = {}
    out = []
    for i, t in enumerate(like):
        wide = torch.promote_types(t.dtype, torch.float32)
        if wide not in rows:
            rows[wide] = factors.to(wide).unbind(0)
        f = rows[wide][i]
        out.append(f.reshape(*f.shape, *[1] * (t.ndim - members)) if members else f)
    return out


def _counted(counts: Sequence[torch.Tensor], inplace: bool) -> tuple[list[Any], torch.Tensor]:
    """Each leaf's update count plus one, for the state, and the same counts stacked in fp64."""
    new = _foreach("add", counts, 1, inplace=inplace)
    plain = set(map(type, new)) <= {torch.Tensor}  # (else replicated DTensor counts: their local values)
    local = new if plain else [c.to_local() if hasattr(c, "placements") else c for c in new]
    return new, torch.stack(local).to(torch.float64) if local else torch.zeros(0, dtype=torch.float64)


def _corrections(t: torch.Tensor, beta: Any) -> torch.Tensor:
    r""":math:`1 - \beta^t` in fp64 (``t`` stays a tensor: nothing is read back)."""
    beta = beta.detach().to(torch.float64) if isinstance(beta, torch.Tensor) else float(beta)
    return torch.rsub(torch.pow(beta, t), 1.0)


def _nesterov_corrected(m: list[Any], g: list[Any], t: torch.Tensor, beta: Any, members: int) -> list[Any]:
    r"""optax's bias-corrected Nesterov look-ahead, the moment and the gradient corrected each on its own:
    :math:`\frac{\beta m}{1-\beta^{t+1}} + \frac{(1-\beta) g}{1-\beta^t}` (``t`` the stacked counts)."""
    moment = _per_leaf(_corrections(t + 1.0, beta).reciprocal().mul(beta), g, members)
    gradient = _per_leaf(_corrections(t, beta).reciprocal().mul(1 - beta), g, members)
    return _foreach("add", _foreach("mul", m, moment), _foreach("mul", g, gradient), inplace=True)


def _zeros(params: TensorDictBase, dtype: Callable[[torch.dtype], torch.dtype] = lambda d: d) -> TensorDictBase:
    return build({n: torch.zeros_like(p, dtype=dtype(p.dtype)) for n, p in params.items()}, params.batch_size)


def _counts(params: TensorDictBase) -> TensorDictBase:
    """A step count of zero per leaf (per ensemble member), a DTensor param's replicated on its mesh."""
    return build({n: p.new_zeros(params.batch_size, dtype=torch.int64) for n, p in params.items()}, params.batch_size)


def _stateless(
    check: Callable[[TensorDictBase], object], leaves: Callable[[TensorDictBase, TensorDictBase | None], list[Any]]
) -> Transform:
    """A :class:`Transform` without state: ``init`` runs ``check`` on the params, ``update`` gives the
    leaves ``leaves(grads, params)``."""

    def init(params: TensorDictBase) -> TensorDictBase:
        check(params)
        return build({}, params.batch_size)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        return build(dict(zip(grads.keys(), leaves(grads, params))), grads.batch_size), state

    return transform(init, update)


# ---------------------------------------------------------------------------------------------- narrowed state

#: The dtypes a state may be kept in (``state_dtype``); ``None`` keeps each leaf's own.
STATE_DTYPES: tuple[torch.dtype | None, ...] = (None, torch.float32, torch.bfloat16)


def check_state_dtype(where: str, state_dtype: object) -> None:
    if not any(state_dtype is d for d in STATE_DTYPES):
        raise ValueError(f"{where}: state_dtype must be None, torch.float32 or torch.bfloat16, got {state_dtype!r}")


def stochastic_round(x: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
    r"""``x`` (fp32) in bf16, rounded away from zero with a probability equal to the fraction of a bf16
    step that truncation would drop, so that on average the stored value is ``x`` and updates smaller
    than a bf16 step still move it.

    The 16 random bits are a hash of the entry's own fp32 bits and ``key`` (an int32, or a tensor of
    them broadcasting against ``x``): no generator is drawn, so a traced step stays pure, and since
    the bits depend on the value alone, a shard rounds each entry as the whole parameter does.
    """
    bits = x.view(torch.int32)
    h = bits ^ key
    # lowbias32, its logical shifts from arithmetic ones; bitwise_right_shift, not ``>>``: a DTensor's
    # ``>>`` returns its input unshifted (torch 2.13), so a shard would round otherwise than its whole tensor
    h = (h ^ (h.bitwise_right_shift(16) & 0xFFFF)) * 0x7FEB352D
    h = (h ^ (h.bitwise_right_shift(15) & 0x1FFFF)) * -0x7B935975
    h = h ^ (h.bitwise_right_shift(16) & 0xFFFF)
    return ((bits + (h & 0xFFFF)) & -0x10000).view(torch.float32).to(torch.bfloat16)


def rounding_key(field: str, name: str, count: Any, trailing: int) -> torch.Tensor:
    """The key of ``stochastic_round`` for state entry ``field`` of leaf ``name`` at update ``count``:
    an int32 mixing the update count with a hash of the two names, shaped to broadcast over the leaf."""
    count = count.to_local() if hasattr(count, "placements") else count  # (replicated DTensor counts)
    key = count.mul(0x9E3779B9).add(_name_hash(f"{field}:{name}")).bitwise_and(0xFFFFFFFF).to(torch.int32)
    # a single count stays 0-dim: a DTensor takes it as a scalar, where a (1, 1) tensor would be made a
    # replicated DTensor (with a warning) at every operation of the hash
    return key.reshape(*key.shape, *[1] * trailing) if key.ndim else key


@torch.compiler.assume_constant_result  # (a traced step takes the number: dynamo cannot trace zlib)
def _name_hash(name: str) -> int:
    return zlib.crc32(name.encode())


def _kept(
    field: str, held: TensorDictBase, names: list[str], wide: list[torch.Tensor], counts: list[Any], donate: bool
) -> list[torch.Tensor]:
    """The new values ``wide`` (fp32) of the bf16 state entry ``field``, rounded stochastically (see
    :func:`stochastic_round`); donated, written into ``held``."""
    kept = [stochastic_round(x, rounding_key(field, n, c, x.ndim - c.ndim)) for n, x, c in zip(names, wide, counts)]
    return [held[n].copy_(k) for n, k in zip(names, kept)] if donate else kept


# ---------------------------------------------------------------------------------------------- momentum


def ema_momentum(
    momentum: Scalar = 0.95,
    *,
    nesterov: NesterovLike = True,
    bias_correction: bool = False,
    state_dtype: torch.dtype | None = None,
    donate_state: bool = False,
) -> Transform:
    r"""Exponential moving average of the gradients (torch.optim.Muon's form by default).

    .. math::  b_t = \mu\, b_{t-1} + (1-\mu)\, g_t, \qquad
               u_t = \begin{cases} (1-\mu)\, g_t + \mu\, b_t & \text{Nesterov (torch, Keller)} \\
                                   g_t + b_t & \texttt{nesterov="add"} \text{ (heavyball's)} \\
                                   b_t & \text{otherwise} \end{cases}

    With ``bias_correction=True`` (optax's ``contrib.muon``) the moment and the gradient are each
    corrected, :math:`t` counting this leaf's updates from 1:
    :math:`u_t = \frac{\mu b_t}{1-\mu^{t+1}} + \frac{(1-\mu) g_t}{1-\mu^t}` (Nesterov),
    :math:`u_t = b_t / (1-\mu^t)` (otherwise).

    With ``state_dtype`` (``torch.float32`` or ``torch.bfloat16``) :math:`b` is kept in that dtype
    and computed in fp32; a bf16 :math:`b_t` is stored rounded stochastically (:func:`stochastic_round`,
    keyed by the leaf's name and update count) and :math:`u_t` takes its fp32 value.

    Returns:
        A :class:`Transform` with state ``{"momentum": b}`` (the params' shapes, their dtypes or
        ``state_dtype``); with ``bias_correction`` or a bf16 ``state_dtype`` also ``{"step": int64 per leaf}``.
    """
    unit_interval("momentum", momentum)
    flag("ema_momentum: bias_correction", bias_correction)
    flag("ema_momentum: donate_state", donate_state)
    check_state_dtype("ema_momentum", state_dtype)
    counted = bias_correction or state_dtype == torch.bfloat16
    if nesterov not in (True, False, "add"):
        raise ValueError(f"ema_momentum: nesterov must be True, False or 'add', got {nesterov!r}")
    if bias_correction and nesterov == "add":
        raise ValueError("ema_momentum: bias_correction applies to nesterov=True or False, not 'add'")

    def init(params: TensorDictBase) -> TensorDictBase:
        state = {"momentum": _zeros(params, lambda d: state_dtype or d)}
        return build({**state, "step": _counts(params)} if counted else state, params.batch_size)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        names, g, held = list(grads.keys()), list(grads.values()), state["momentum"]
        if counted:
            counts, t = _counted(named_leaves(state["step"], names), donate_state)
        mu = _number(momentum)
        if state_dtype is None:
            buf = kept = _lerp(named_leaves(held, names), g, 1 - mu, inplace=donate_state)  # b ← μ b + (1 − μ) g
        else:  # computed in fp32, kept in state_dtype
            g, writable = [x.float() for x in g], donate_state or state_dtype != torch.float32
            buf = _lerp([x.float() for x in named_leaves(held, names)], g, 1 - mu, inplace=writable)
            kept = _kept("momentum", held, names, buf, counts, donate_state) if state_dtype == torch.bfloat16 else buf
        new = {"momentum": replaced(held, names, kept)}
        if counted:
            new["step"] = replaced(state["step"], names, counts)
        if bias_correction:
            if nesterov:
                u = _nesterov_corrected(buf, g, t, mu, grads.batch_dims)
            else:
                u = _foreach("div", buf, _per_leaf(_corrections(t, mu), buf, grads.batch_dims))
        elif nesterov == "add":
            u = _foreach("add", g, buf)
        elif nesterov:
            u = _lerp(g, buf, mu, inplace=False)  # μ b + (1 − μ) g
        else:
            u = buf
        updates = build(dict(zip(names, cast_like(u, list(grads.values())))), grads.batch_size)
        return updates, build(new, state.batch_size)

    return transform(init, update, donates_state=donate_state)


def fresh_updates(nesterov: object, bias_correction: bool) -> bool:
    """Whether :func:`ema_momentum`'s updates are the step's own tensors (the look-ahead, the sum,
    the corrected momentum), not its state (``nesterov=False`` uncorrected), which nothing reads later."""
    return nesterov is True or nesterov == "add" or bias_correction


# ---------------------------------------------------------------------------------------------- Newton–Schulz


def matrix_map(ns: Any) -> MatrixFn:
    """The map of ``(count, m, n)`` batches ``ns`` names: a :class:`~muonfn.NewtonSchulz` (``None``:
    the default one), ``"svd"`` (:func:`muonfn.polar`), ``"qr"`` (:func:`muonfn.linalg.qr_orthogonal`),
    ``"gram"`` (``NewtonSchulz(method="gram")``) or any callable map of one's own."""
    maps: dict[str, MatrixFn] = {"standard": NewtonSchulz(), "svd": polar, "qr": qr_orthogonal}
    maps["gram"] = NewtonSchulz(method="gram")
    if ns is None or (isinstance(ns, str) and ns in maps):
        return maps[ns or "standard"]
    if isinstance(ns, str) or not callable(ns):
        raise TypeError(
            f"ns must be a muonfn.NewtonSchulz, 'svd', 'qr', 'gram' or a map of (count, m, n) batches, got {ns!r}"
        )
    return ns


def resolve_views(views: ViewsLike, td: TensorDictBase) -> list[MatrixView]:
    """One view per leaf of ``td``: the declared one, else the default (2-D as is, ≥3-D as conv); for a stacked
    ensemble every view takes the batch dimensions too (views describe one member's leaf)."""
    if views is None:
        found = [DEFAULT_VIEW] * len(td.keys())
    elif isinstance(views, Mapping):
        table = named_table(views, td.keys())
        found = [table.get(n, DEFAULT_VIEW) for n in td.keys()]
    else:
        found = []
        for n, t in td.items():
            view = views(n, t)
            if view is not None and not isinstance(view, MatrixView):
                raise TypeError(f"views returned {view!r} for {n!r}; it must return a muonfn.MatrixView or None")
            found.append(view or DEFAULT_VIEW)
    return [dataclasses.replace(v, batch_dims=v.batch_dims + td.batch_dims) for v in found] if td.batch_dims else found


def _checked_views(views: ViewsLike, tree: TensorDictBase) -> list[MatrixView]:
    """Every leaf's view (see :func:`resolve_views`), checked against the leaf's shape."""
    found = resolve_views(views, tree)
    for (name, t), view in zip(tree.items(), found):
        view.check(name, t.shape)
    return found


def check_views(where: str, views: object) -> None:
    if isinstance(views, Mapping):
        for name, view in views.items():
            if not isinstance(view, MatrixView):
                raise TypeError(f"{where}: {name!r} maps to {view!r}; a view must be a muonfn.MatrixView")
    elif views is not None and not callable(views):
        raise TypeError(f"{where} must be a mapping of names to MatrixView, a callable (name, tensor) -> view, or None")


def _orthogonalizing(
    ns: Any, views: ViewsLike, orthogonalizer: Orthogonalizer | None, fresh: bool, where: str
) -> tuple[Callable[[TensorDictBase], None], Callable[[TensorDictBase, Any], list[torch.Tensor]]]:
    """An ``init`` check of the leaves (the orthogonalizer's own, on the parameters, whose layout the
    updates share; a map of one's own is tried on meta tensors, so that a wrong result fails before a
    step), and the updates' orthogonalized leaves given a shape scale (``fresh``: the updates are this
    step's own tensors, whose memory may hold the results)."""
    ns = matrix_map(ns)
    check_views(f"{where}: views", views)
    chosen = LocalOrthogonalizer() if orthogonalizer is None else orthogonalizer
    if not callable(chosen):
        raise TypeError(f"{where}: orthogonalizer must be a muonfn.linalg.Orthogonalizer, got {orthogonalizer!r}")
    local = isinstance(chosen, LocalOrthogonalizer)

    def check(params: TensorDictBase) -> None:
        names, values = list(params.keys()), list(params.values())
        leaf_views = resolve_views(views, params)
        refuse = getattr(chosen, "check", None)
        if callable(refuse):
            refuse(names, values, leaf_views)
        for p, view in zip(values, leaf_views):
            if local and not isinstance(ns, NewtonSchulz):
                for rows, cols in view.blocks(p.shape):
                    if rows and cols:
                        check_matrix_fn(ns, (1, rows, cols), p.dtype)

    def orthogonalized(grads: TensorDictBase, scale: Any) -> list[torch.Tensor]:
        names, values = list(grads.keys()), list(grads.values())
        options = {"overwrite_input": True} if fresh and may_write_into(*values) else {}
        return chosen(names, values, resolve_views(views, grads), ns, scale, **options)

    return check, orthogonalized


def orthogonalize(
    ns: Any = None,
    *,
    views: ViewsLike = None,
    scale: ScaleLike = "none",
    orthogonalizer: Orthogonalizer | None = None,
    overwrite_input: bool = False,
) -> Transform:
    r"""Replaces every matrix block :math:`G` by :math:`s(A, B)\cdot\mathrm{NS}(G)`.

    Args:
        ns: the map: a :class:`~muonfn.NewtonSchulz` (``None``: the default one), ``"gram"``,
            ``"svd"`` (the exact polar factor, :func:`muonfn.polar`), ``"qr"`` (QR's :math:`Q`,
            heavyball's ``"qr"`` mode) or a callable mapping a ``(count, m, n)`` tensor to one of the
            same shape, dtype and device (tried once per shape at ``init`` on meta tensors, and
            checked at every call).
        views: how leaves are read as matrices (:class:`~muonfn.MatrixView` by name, or a callable
            ``(name, tensor) -> view``); conv kernels are flattened by default.
        scale: the shape scale :math:`s` (see :func:`scale_by_shape`).
        orthogonalizer: who runs the batched calls; default
            :class:`~muonfn.linalg.LocalOrthogonalizer`; sharded parameters take
            :func:`muonfn.distributed.sharded_orthogonalizer`.
        overwrite_input: the updates given are temporaries of this step that nothing reads later
            (:func:`ema_momentum`'s look-ahead): their memory may hold the results.

    Returns:
        A stateless :class:`Transform`; ``init`` checks that every leaf's view can read it.
    """
    check, orthogonalized = _orthogonalizing(ns, views, orthogonalizer, overwrite_input, "orthogonalize")
    scale_fn = shape_scale(scale)
    flag("orthogonalize: overwrite_input", overwrite_input)
    return _stateless(check, lambda grads, params: orthogonalized(grads, scale_fn))


def scale_by_shape(scale: ScaleLike = "match_rms_adamw", *, views: ViewsLike = None) -> Transform:
    r"""Multiplies every matrix block by :math:`s(A, B)`, ``A``/``B`` the rows and columns of the
    logical block (after the view; an ensemble's batch dimensions excluded): ``"original"``
    √max(1, A/B), ``"match_rms_adamw"`` 0.2·√max(A, B), ``"spectral"`` √max(A, B), ``"unit_rms_norm"``
    √(A/B), ``"none"`` 1; a pair ``(mode, factor)`` is the mode times ``factor``."""
    scale_fn = shape_scale(scale)
    check_views("scale_by_shape: views", views)
    return _stateless(partial(_checked_views, views), lambda grads, params: _shape_scaled(grads, views, scale_fn, 1.0))


def _shape_scaled(
    grads: TensorDictBase, views: ViewsLike, scale_fn: Callable[[int, int], float], factor: Any
) -> list[Any]:
    """``factor·s·x`` of every leaf ``x``, block by block (``factor`` a number or a tensor)."""
    out = []
    for g, view in zip(grads.values(), _checked_views(views, grads)):
        scales = view.scales(g.shape, scale_fn)
        if len(scales) == 1:
            out.append(g.mul(factor * scales[0]))
        else:
            out.append(view.from_matrices([b.mul(factor * s) for b, s in zip(view.to_matrices(g), scales)], g.shape))
    return out


# ---------------------------------------------------------------------------------------------- decay and rate


def _decayed(
    updates: list[Any],
    names: list[str],
    params: TensorDictBase | None,
    factor: Any,
    mask: MaskLike,
    where: str,
    *,
    inplace: bool,
) -> list[Any]:
    r"""``u + factor·p`` on the leaves ``names`` that ``mask`` selects (``factor`` a number, a 0-d tensor
    or one value per ensemble member): one multiply-add per entry for a number; ``inplace``: into the
    updates, the step's own tensors, where nothing records them."""
    if isinstance(factor, int | float) and factor == 0:
        return updates
    if params is None:
        raise ValueError(f"{where} needs params: call update(grads, state, params)")
    u, p = updates, named_leaves(params, names)
    if mask is not None:
        chosen = set(selected(mask, params.select(*names), f"{where}: mask"))
        at = [i for i, n in enumerate(names) if n in chosen]
        u, p = [u[i] for i in at], [p[i] for i in at]
    inplace = inplace and may_write_into(*u, *p)
    if isinstance(factor, torch.Tensor):  # (alpha takes numbers: λp written out, then added)
        added = _foreach("add", u, _foreach("mul", p, _times(factor, p, params.batch_dims)), inplace=inplace)
    else:
        added = _foreach("add", u, p, alpha=factor, inplace=inplace)
    if mask is None:
        return added
    decayed = dict(zip(at, added))
    return [decayed.get(i, x) for i, x in enumerate(updates)]


def add_decayed_weights(weight_decay: Scalar = 0.0, *, mask: MaskLike = None, cautious: bool = False) -> Transform:
    r"""Decoupled weight decay: :math:`u \leftarrow u + \lambda\,p` on the leaves ``mask`` selects.

    With ``cautious=True`` (cautious weight decay, heavyball's) only entries where the update and the
    parameter agree in sign are decayed: :math:`u + \lambda p \odot [\operatorname{signbit}(u) =
    \operatorname{signbit}(p)]`. Followed by :func:`scale_by_learning_rate` this is
    :math:`p \leftarrow p - \eta\lambda p` with the unadjusted learning rate (torch's semantics).

    Args:
        weight_decay: :math:`\lambda \ge 0`, a float or a 0-d tensor.
        mask: names to ``True``/``False`` (leaves it does not name are decayed), a callable
            ``params -> mapping``, or ``"matrices"`` (the leaves of two or more dimensions: the
            usual convention, biases and norm gains undecayed); ``None`` decays every leaf.
        cautious: decay only where the incoming update and the parameter agree in sign.

    Returns:
        A stateless :class:`Transform`; its ``update`` needs ``params``.
    """
    non_negative("weight_decay", weight_decay)
    check_mask("add_decayed_weights: mask", mask)
    flag("add_decayed_weights: cautious", cautious)

    def decayed(grads: TensorDictBase, params: TensorDictBase | None) -> list[Any]:
        names, values = list(grads.keys()), list(grads.values())
        if cautious and params is not None:  # the parameter where it agrees in sign with the update
            agreeing = {n: params[n].mul(u.signbit() == params[n].signbit()) for n, u in zip(names, values)}
            params = build(agreeing, grads.batch_size)
        return _decayed(values, names, params, _number(weight_decay), mask, "add_decayed_weights", inplace=False)

    # (a callable mask's values checked before a step)
    return _stateless(lambda params: selected(mask, params, "add_decayed_weights: mask"), decayed)


def _schedule_state(learning_rate: ScalarOrSchedule, params: TensorDictBase) -> dict[str, torch.Tensor]:
    """A schedule's state: ``{"count": 0}`` (per ensemble member), on the first leaf's device; none for a rate."""
    if not is_schedule(learning_rate):
        return {}
    device = next(iter(params.values()), torch.empty(0)).device
    return {"count": torch.zeros(params.batch_size, dtype=torch.int64, device=device)}


def is_schedule(learning_rate: object) -> TypeGuard[Schedule]:
    """Whether a learning rate is a schedule ``count -> lr`` (a callable, not a tensor)."""
    return callable(learning_rate) and not isinstance(learning_rate, torch.Tensor)


def _check_rate(learning_rate: ScalarOrSchedule) -> None:
    if not is_schedule(learning_rate):
        non_negative("learning rate", learning_rate)  # type: ignore[arg-type]


def _rate(learning_rate: ScalarOrSchedule, state: TensorDictBase, grads: TensorDictBase) -> tuple[Any, dict[str, Any]]:
    """This update's learning rate (a tensor checked by :func:`checked_rate`), and a schedule's advanced
    count for the new state."""
    if isinstance(learning_rate, int | float):
        return learning_rate, {}
    lr: Any = learning_rate
    new, where = {}, "the learning rate"
    if is_schedule(learning_rate):
        count, where = state["count"], "the learning rate schedule"
        lr, new = schedule_value(where, learning_rate(count)), {"count": count + 1}
    device = getattr(next(iter(grads.values()), None), "device", None)
    return _number(checked_rate(where, lr, grads.batch_size, device, returned=bool(new))), new


def checked_rate(where: str, lr: Any, size: torch.Size, device: torch.device | None, *, returned: bool) -> Any:
    """``lr``, a learning rate for leaves of batch size ``size`` on ``device``: a tensor must be 0-d (or one
    value per ensemble member), on their device or a 0-d tensor on the CPU. ``where`` names it in an
    error (``returned``: the value a schedule returned)."""
    if isinstance(lr, torch.Tensor):
        verb = "returned" if returned else "is"
        if lr.ndim and lr.shape != size:
            raise ValueError(f"{where} {verb} a tensor of shape {tuple(lr.shape)}; it must be 0-d")
        if device is not None and not (lr.ndim == 0 and lr.device.type == "cpu") and lr.device != device:
            raise ValueError(
                f"{where} {verb} a tensor on {lr.device}, the parameters are on {device}; it must be on "
                "their device, or a 0-d tensor on the CPU"
            )
    return lr


def _times(factor: Any, like: Sequence[torch.Tensor], members: int) -> Any:
    """A factor for the leaves: a number, a 0-d tensor, or one value per ensemble member as one tensor
    per leaf, shaped to broadcast."""
    if isinstance(factor, torch.Tensor) and factor.ndim:
        return [factor.reshape(*factor.shape, *[1] * (t.ndim - members)).to(t.dtype) for t in like]
    return factor


def scale_by_learning_rate(learning_rate: ScalarOrSchedule) -> Transform:
    r""":math:`u \leftarrow -\eta\, u`, so that ``apply_updates`` descends.

    ``learning_rate``: a float, a 0-d tensor (changed in place between steps: no recompilation), or
    a schedule ``count -> lr`` called with the 0-d int64 count of previous updates (state
    ``{"count": ...}`` then); a number it returns is checked (finite, ``>= 0``), a tensor by its
    metadata only (no read-back).
    """
    _check_rate(learning_rate)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        lr, new = _rate(learning_rate, state, grads)
        values = list(grads.values())
        out = _foreach("mul", values, _times(-lr, values, grads.batch_dims))
        return build(dict(zip(grads.keys(), cast_like(out, values))), grads.batch_size), build(new, state.batch_size)

    return transform(lambda params: build(_schedule_state(learning_rate, params), params.batch_size), update)


def descent(
    learning_rate: ScalarOrSchedule,
    weight_decay: Scalar = 0.0,
    *,
    ns: Any = "none",
    scale: ScaleLike = "match_rms_adamw",
    views: ViewsLike = None,
    mask: MaskLike = None,
    orthogonalizer: Orthogonalizer | None = None,
    overwrite_input: bool = False,
) -> Transform:
    r"""The last stage of a matrix branch: :math:`u \leftarrow -\eta\,\bigl(s\,O + \lambda p\bigr)` with
    :math:`O = \mathrm{NS}(u)` (``ns``, see :func:`orthogonalize`; ``"none"``: :math:`O = u`), computed
    as :math:`(-\eta s)\,O + (-\eta\lambda)\,p`: :math:`-\eta s` taken by the last Newton–Schulz step's
    matmuls (no pass of its own), the decay one multiply-add, as :mod:`muonfn.reference` rounds it.
    ``mask`` selects the decayed leaves (see :func:`add_decayed_weights`); ``learning_rate`` may be a
    schedule (state ``{"count"}``). The other arguments are :func:`orthogonalize`'s.
    """
    _check_rate(learning_rate)
    non_negative("weight_decay", weight_decay)
    check_mask("descent: mask", mask)
    scaled, extra = scaled_mode(scale)
    orthogonalizes = not (isinstance(ns, str) and ns == "none")
    check: Callable[[TensorDictBase], object] = partial(_checked_views, views)
    if orthogonalizes:
        check, orthogonalized = _orthogonalizing(ns, views, orthogonalizer, overwrite_input, "descent")

    def init(params: TensorDictBase) -> TensorDictBase:
        check(params)
        return build(_schedule_state(learning_rate, params), params.batch_size)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        lr, new = _rate(learning_rate, state, grads)
        lam, values = _number(weight_decay), list(grads.values())
        # -ηs into the matrices' own pass; a tensor rate (traced, or one per member) takes a pass of its own
        factor = 1.0 if isinstance(lr, torch.Tensor) else -lr
        if orthogonalizes:
            out = orthogonalized(grads, partial(scaled, extra * factor))  # (-ηs, a number: a tensor rate's factor is 1)
        else:
            out = _shape_scaled(grads, views, partial(scaled, extra), factor)
        if isinstance(lr, torch.Tensor):
            out = _foreach("mul", out, _times(lr.neg(), out, grads.batch_dims), inplace=may_write_into(*out, lr))
        out = _decayed(out, list(grads.keys()), params, -lr * lam, mask, "descent", inplace=True)
        return build(dict(zip(grads.keys(), cast_like(out, values))), grads.batch_size), build(new, state.batch_size)

    return transform(init, update)


# ---------------------------------------------------------------------------------------------- Adam and AdamW


def _adam(
    grads: TensorDictBase,
    state: TensorDictBase,
    b1: Scalar,
    b2: float,
    eps: float,
    factor: Any,
    nesterov: AdamNesterov,
    donate: bool,
    state_dtype: torch.dtype | None,
) -> tuple[list[torch.Tensor], dict[str, TensorDictBase]]:
    r"""``factor`` times Adam's bias-corrected direction, and the new state entries.

    The moments are updated with torch.optim.AdamW's ops (so its bits): ``m.lerp_(g, 1-β₁)``,
    ``v.mul_(β₂).addcmul_(g, g, value=1-β₂)`` (with ``state_dtype`` in fp32, kept as
    :func:`ema_momentum` keeps its momentum). Without Nesterov the direction is one division of ``m`` by
    :math:`D = (\sqrt{v} + \epsilon\sqrt{c_2})\cdot c_1/(\text{factor}\sqrt{c_2})` (:math:`c_k = 1-\beta_k^t`,
    per leaf in fp64): a factor of 0 makes :math:`D = \pm\infty` and the direction 0, never ``nan``."""
    names, g, b1, members = list(grads.keys()), list(grads.values()), _number(b1), grads.batch_dims
    held_m, held_v = state["exp_avg"], state["exp_avg_sq"]
    counts, t = _counted(named_leaves(state["step"], names), donate)
    starts_m, starts_v = named_leaves(held_m, names), named_leaves(held_v, names)
    writable = donate or state_dtype == torch.bfloat16  # (a bf16 state's widened copies are this step's)
    if state_dtype is not None:  # computed in fp32
        starts_m, starts_v, g = [x.float() for x in starts_m], [x.float() for x in starts_v], [x.float() for x in g]
    m = _lerp(starts_m, g, 1.0 - b1, inplace=writable)
    v = _foreach("mul", starts_v, b2, inplace=writable)
    v = _foreach("addcmul", v, g, g, value=1.0 - b2, inplace=writable or may_write_into(*g))
    new = {"step": replaced(state["step"], names, counts)}
    for field, held, wide in (("exp_avg", held_m, m), ("exp_avg_sq", held_v, v)):
        kept = _kept(field, held, names, wide, counts, donate) if state_dtype == torch.bfloat16 else wide
        new[field] = replaced(held, names, kept)
    c1, root_c2 = _corrections(t, b1), _corrections(t, b2).sqrt()
    roots = _foreach("sqrt", v)
    if not nesterov:
        scale, own = c1.div(root_c2.mul(factor)), may_write_into(*roots)  # (own: the roots are this step's)
        denominators = _foreach("add", roots, _per_leaf(root_c2.mul(eps), v, members), inplace=own)
        denominators = _foreach("mul", denominators, _per_leaf(scale, v, members), inplace=own)
        return _foreach("div", m, denominators), new
    denominators = _foreach("add", _foreach("div", roots, _per_leaf(root_c2, v, members)), eps)
    if nesterov == "timm":  # timm's NAdamW: one correction of the look-ahead
        numerators = _foreach("div", _lerp(m, g, 1.0 - b1, inplace=False), _per_leaf(c1, g, members))
    else:  # optax's
        numerators = _nesterov_corrected(m, g, t, b1, members)
    direction = _foreach("div", numerators, denominators)
    if isinstance(factor, float) and factor == 1.0:
        return direction, new
    return _foreach("mul", direction, _times(factor, g, members)), new


def _betas(where: str, b1: Scalar, b2: Scalar, eps: float, nesterov: object) -> tuple[Scalar, float, float]:
    """β₁ as given (a 0-d tensor is read at every update: a scheduler may cycle it), β₂ and ε as numbers;
    ``nesterov`` checked."""
    positive("eps", eps)
    unit_interval("b1", b1)
    if not (isinstance(nesterov, bool) or nesterov == "timm"):
        raise ValueError(f"{where}: nesterov must be True, False or 'timm', got {nesterov!r}")
    return b1, unit_interval("b2", b2), float(eps)


def _adam_init(params: TensorDictBase, state_dtype: torch.dtype | None, lr: ScalarOrSchedule = 0.0) -> TensorDictBase:
    """Adam's state, and a learning rate schedule's (see :func:`_schedule_state`)."""
    first = _zeros(params, lambda d: state_dtype or d)
    second = _zeros(params, lambda d: state_dtype or second_moment_dtype(d))
    state = {"step": _counts(params), "exp_avg": first, "exp_avg_sq": second, **_schedule_state(lr, params)}
    return build(state, params.batch_size)


def scale_by_adam(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    *,
    eps: float = 1e-8,
    nesterov: AdamNesterov = False,
    state_dtype: torch.dtype | None = None,
    donate_state: bool = False,
) -> Transform:
    r"""Adam's direction with bias correction, torch.optim.AdamW's (``eps`` added to the corrected root):

    .. math::  m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad
               u_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon};

    ``nesterov=True`` is optax's Nesterov-Adam (the moment and the gradient corrected each on its own),
    ``"timm"`` timm's NAdamW. ``t`` counts per leaf (per ensemble member). The second moment of an fp16
    leaf is kept in fp32 (see :func:`second_moment_dtype`); ``state_dtype`` keeps both moments as
    :func:`ema_momentum` keeps its momentum.

    Returns:
        A :class:`Transform` with state ``{"step": int64 per leaf, "exp_avg": m, "exp_avg_sq": v}``.
    """
    b1, b2, eps = _betas("scale_by_adam", b1, b2, eps, nesterov)
    flag("scale_by_adam: donate_state", donate_state)
    check_state_dtype("scale_by_adam", state_dtype)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        u, new = _adam(grads, state, b1, b2, eps, 1.0, nesterov, donate_state, state_dtype)
        updates = build(dict(zip(grads.keys(), cast_like(u, list(grads.values())))), grads.batch_size)
        return updates, build(new, state.batch_size)

    return transform(partial(_adam_init, state_dtype=state_dtype), update, donates_state=donate_state)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    *,
    betas: tuple[Scalar, Scalar] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: Scalar = 0.01,
    weight_decay_mask: MaskLike = None,
    nesterov: AdamNesterov = False,
    cautious_weight_decay: bool = False,
    state_dtype: torch.dtype | None = None,
    donate_state: bool = False,
    fused: bool | None = None,
) -> Transform:
    r"""AdamW as ``torch.optim.AdamW`` computes it:

    .. math::  u = -\eta\lambda p - \eta\,\frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}

    the moments with torch's ops (its bits), the update within a few ulps of torch's parameter change
    (the step size folded into the denominator, see :func:`scale_by_adam`). On a CUDA GPU one model's
    fp32 leaves go through torch's fused kernel (``torch.optim.AdamW(fused=True)``'s), one pass.

    Args:
        lr: :math:`\eta`: a float, a 0-d tensor or a schedule (see :func:`scale_by_learning_rate`).
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`.
        weight_decay: :math:`\lambda`.
        weight_decay_mask: see :func:`add_decayed_weights` (``"matrices"``: decay only the leaves of
            two or more dimensions).
        nesterov: Nesterov-Adam as optax's (``True``) or timm's (``"timm"``) NAdamW.
        cautious_weight_decay: decay only where the update and the parameter agree in sign.
        state_dtype: the moments' dtype (``None``: the parameters'; see :func:`scale_by_adam`).
        donate_state: update the state in place (see :mod:`muonfn.steps`).
        fused: torch's fused kernel: ``None`` where it runs (one model's fp32 leaves on CUDA), ``True``
            on any device it has a kernel for (the CPU too), ``False`` never.

    Returns:
        A :class:`Transform` with state ``{"step", "exp_avg", "exp_avg_sq"}`` (and a schedule's ``"count"``).

    Example:
        >>> params = TensorDict({"w": torch.ones(3)}, [])
        >>> tx = muonfn.adamw(lr=0.1)
        >>> updates, state = tx.update(TensorDict({"w": torch.ones(3)}, []), tx.init(params), params)
        >>> updates["w"]  # -lr·sign(g) at step 1, minus lr·wd·p
        tensor([-0.1010, -0.1010, -0.1010])
    """
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    b1, b2, eps = _betas("adamw", betas[0], betas[1], eps, nesterov)
    _check_rate(lr)
    non_negative("weight_decay", weight_decay)
    check_mask("adamw: weight_decay_mask", weight_decay_mask)
    flag("adamw: donate_state", donate_state)
    flag("adamw: cautious_weight_decay", cautious_weight_decay)
    check_state_dtype("adamw", state_dtype)
    if fused is not None:
        flag("adamw: fused", fused)
    if cautious_weight_decay:  # (caution reads the direction before the decay: the chain of blocks)
        return chain(
            scale_by_adam(b1, b2, eps=eps, nesterov=nesterov, state_dtype=state_dtype, donate_state=donate_state),
            add_decayed_weights(weight_decay, mask=weight_decay_mask, cautious=True),
            scale_by_learning_rate(lr),
        )
    # the fused kernel takes β₁ as a number, and keeps the moments in the parameters' dtype
    kernel_may_take = not nesterov and state_dtype is None

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        if donate_state and params is None and not (isinstance(weight_decay, int | float) and weight_decay == 0):
            # (refused before the moments are written in place)
            raise ValueError("adamw needs params: call update(grads, state, params)")
        rate, new = _rate(lr, state, grads)
        names, g, members = list(grads.keys()), list(grads.values()), grads.batch_dims
        lam, beta1 = _number(weight_decay), _number(b1)
        if kernel_may_take and params is not None and not isinstance(beta1, torch.Tensor):
            tensors = [*g, *named_leaves(params, names)]
            if _devices.adamw_kernel_takes(tensors, members, (rate, lam), fused):
                mask = weight_decay_mask
                decayed = None if mask is None else set(selected(mask, params.select(*names), "adamw: mask"))
                updates, moments = _devices.adamw_kernel(
                    grads, state, params, decayed, rate, lam, beta1, b2, eps, donate_state
                )
                return updates, build({**moments, **new}, state.batch_size)
        u, moments = _adam(grads, state, b1, b2, eps, -rate, nesterov, donate_state, state_dtype)
        u = _decayed(u, names, params, -rate * lam, weight_decay_mask, "adamw", inplace=True)
        return build(dict(zip(names, cast_like(u, g))), grads.batch_size), build({**moments, **new}, state.batch_size)

    return transform(partial(_adam_init, state_dtype=state_dtype, lr=lr), update, donates_state=donate_state)


# ---------------------------------------------------------------------------------------------- applying


def apply_updates(params: TensorDictBase, updates: TensorDictBase) -> TensorDictBase:
    """``params + updates`` leaf by leaf; leaves without an update are returned as they are.

    Every update must name a parameter and have its shape and device (else a ``ValueError`` names it,
    before anything is computed). Each result keeps its parameter's dtype: a sum of another dtype is taken
    in the promoted dtype and cast back, as optax does.
    """
    flat_params, flat_updates, targets = matched(params, updates, inplace=False)
    sums = _foreach("add", targets, list(flat_updates.values()))
    summed = build({**flat_params, **dict(zip(flat_updates.keys(), cast_like(sums, targets)))}, params.batch_size)
    return summed if flat_params is params else nested_like(summed, params)


def apply_updates_(params: TensorDictBase, updates: TensorDictBase) -> TensorDictBase:
    """``params += updates`` in place, in one multi-tensor add; returns ``params``.

    The step of a loop that owns its parameters, as a ``torch.optim`` step is (with
    ``donate_state=True`` for the state). The same checks as :func:`apply_updates`, all before any
    parameter is written, and the same bits. Runs without recording gradients.
    """
    _, flat_updates, targets = matched(params, updates, inplace=True)
    with torch.no_grad():
        _foreach("add", targets, list(flat_updates.values()), inplace=True)
    return params


# ---------------------------------------------------------------------------------------------- adaptations


def _rescaled(adapted: list[torch.Tensor], before: list[torch.Tensor], rescale: str, eps: float) -> list[torch.Tensor]:
    r"""``(count, m, n)`` batches with each matrix's Frobenius norm set: ``"preserve_norm"`` that of its
    partner in ``before``, ``"orthogonal"`` :math:`\sqrt{\min(m, n)}` (a semi-orthogonal matrix's),
    ``"none"`` unchanged; ``eps`` added to the adapted norm keeps a zero update zero."""
    if rescale == "none":
        return adapted
    norms = [torch.linalg.matrix_norm(a, keepdim=True).add(eps) for a in adapted]
    if rescale == "preserve_norm":
        return [a.mul(torch.linalg.matrix_norm(b, keepdim=True).div(n)) for a, b, n in zip(adapted, before, norms)]
    return [a.mul(n.reciprocal().mul(math.sqrt(min(a.shape[-2:])))) for a, n in zip(adapted, norms)]


def _check_adaptation(
    where: str, beta: Scalar, eps: float, rescale: str, views: ViewsLike, donate_state: bool
) -> float:
    unit_interval("beta", beta)
    positive("eps", eps)
    if rescale not in RESCALE_MODES:
        raise ValueError(f"{where}: unknown rescale {rescale!r}; choose one of {list(RESCALE_MODES)}")
    check_views(f"{where}: views", views)
    flag(f"{where}: donate_state", donate_state)
    return float(eps)


def _refuse_sharded(names: Sequence[str], values: Sequence[torch.Tensor]) -> None:
    for name, t in zip(names, values):
        placements = tuple(getattr(t, "placements", ()))
        if any(not p.is_replicate() for p in placements):
            raise ValueError(
                f"{name!r} is a DTensor sharded as {placements}: the adaptation's statistics and norms need "
                "whole matrices; gather it, or use muonfn.muon for sharded parameters"
            )


def scale_by_neuron_norm(
    beta: Scalar = 0.95,
    *,
    eps: float = 1e-10,
    rescale: Rescale = "preserve_norm",
    views: ViewsLike = None,
    donate_state: bool = False,
) -> Transform:
    r"""NorMuon's neuron-wise normalisation of an orthogonalized update :math:`O` (Li et al., 2025):
    each row :math:`i` of the logical matrix keeps an EMA of its mean square and is divided by its root,

    .. math::  v_t = \beta v_{t-1} + (1-\beta)\, \tfrac1n \textstyle\sum_j O_{ij}^2, \qquad
               \hat O_{ij} = \frac{O_{ij}}{\sqrt{v_{t,i}} + \epsilon}, \qquad
               u = \hat O\, \rho / (\|\hat O\|_F + \epsilon)

    with :math:`\rho = \|O\|_F` (``"preserve_norm"``), :math:`\sqrt{\min(m, n)}` (``"orthogonal"``: with
    the ``"match_rms_adamw"`` scale, the paper's RMS of 0.2) or no rescaling (``"none"``). Every block
    of a fused view and matrix of a batched one on its own; fp16 leaves in fp32. Place it after
    :func:`orthogonalize` (``scale="none"``) and before the shape scale; sharded leaves are refused.

    Returns:
        A :class:`Transform` with state ``{"row_second_moment": v}``, a leaf's ``v`` shaped as its batch
        dimensions, the logical matrix's rows, and one column per column block.

    Example:
        >>> params = TensorDict({"w": torch.zeros(2, 3)}, [])
        >>> tx = muonfn.scale_by_neuron_norm(0.5, rescale="none")
        >>> g = TensorDict({"w": torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])}, [])
        >>> tx.update(g, tx.init(params))[0]["w"]  # each row over the root of its EMA
        tensor([[1.4142, 1.4142, 1.4142],
                [1.4142, 1.4142, 1.4142]])
    """
    eps = _check_adaptation("scale_by_neuron_norm", beta, eps, rescale, views, donate_state)

    def init(params: TensorDictBase) -> TensorDictBase:
        moments = {}
        for (name, p), view in zip(params.items(), _checked_views(views, params)):
            blocks = len(view.split) if view.split is not None and view.split_dim == 1 else 1
            shape = (*p.shape[: view.batch_dims], view.matrix_shape(p.shape)[0], blocks)
            moments[name] = p.new_zeros(shape, dtype=second_moment_dtype(p.dtype))
        return build({"row_second_moment": build(moments, params.batch_size)}, params.batch_size)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        names, given = list(grads.keys()), list(grads.values())
        _refuse_sharded(names, given)
        held = state["row_second_moment"]
        leaf_views = resolve_views(views, grads)
        blocks = [v.to_matrices(o.float() if o.dtype == torch.float16 else o) for o, v in zip(given, leaf_views)]
        means = [_row_means(v, b) for v, b in zip(leaf_views, blocks)]
        current = [held[n].reshape(m.shape) for n, m in zip(names, means)]
        new = _lerp(current, means, 1 - _number(beta), inplace=donate_state)
        denominators = _foreach("add", _foreach("sqrt", new), eps)
        out = []
        for o, view, matrices, d in zip(given, leaf_views, blocks, denominators):
            parts = [d]
            if view.split is not None:  # a column-split view's blocks side by side in d, a row-split one's stacked
                parts = d.split(1, dim=2) if view.split_dim == 1 else d.split(list(view.split), dim=1)
            adapted = _rescaled([b / p for b, p in zip(matrices, parts)], matrices, rescale, eps)
            out.append(view.from_matrices(adapted, o.shape))
        # donated, the views were written in place: the state keeps its own tensors
        kept = [held[k] if donate_state else n.reshape(held[k].shape) for k, n in zip(names, new)]
        entry = build({"row_second_moment": replaced(held, names, kept)}, state.batch_size)
        return build(dict(zip(names, cast_like(out, given))), grads.batch_size), entry

    return transform(init, update, donates_state=donate_state)


def _row_means(view: MatrixView, blocks: list[torch.Tensor]) -> torch.Tensor:
    """The mean square of every row of every block, ``(count, rows, column blocks)`` (0 for no columns)."""
    means = [b.square().mean(dim=-1, keepdim=True) if b.size(-1) else b.new_zeros((*b.shape[:-1], 1)) for b in blocks]
    return means[0] if len(means) == 1 else torch.cat(means, dim=1 if view.split_dim == 0 else 2)


def scale_by_element_rms(
    beta: Scalar = 0.95,
    *,
    eps: float = 1e-10,
    bias_correction: bool = False,
    rescale: Rescale = "orthogonal",
    views: ViewsLike = None,
    state_dtype: torch.dtype | None = None,
    donate_state: bool = False,
) -> Transform:
    r"""AdaMuon's element-wise adaptation of an orthogonalized update :math:`O` (Si et al., 2025):

    .. math::  V_t = \beta V_{t-1} + (1-\beta)\, O \odot O, \qquad
               \hat O = \frac{O}{\sqrt{V_t / c_t} + \epsilon}, \qquad u = \hat O\, \rho / (\|\hat O\|_F + \epsilon)

    with :math:`c_t = 1 - \beta^t` under ``bias_correction`` (pytorch-optimizer's; else 1) and
    :math:`\rho` as in :func:`scale_by_neuron_norm` (default ``"orthogonal"``). fp16 leaves in fp32;
    sharded leaves are refused. ``state_dtype`` keeps :math:`V` as :func:`ema_momentum` keeps its momentum.

    Returns:
        A :class:`Transform` with state ``{"exp_avg_sq": V}`` (and ``"step"`` with ``bias_correction``
        or a bf16 ``state_dtype``).

    Example:
        >>> params = TensorDict({"w": torch.zeros(2, 2)}, [])
        >>> tx = muonfn.scale_by_element_rms(0.0, rescale="none")
        >>> g = TensorDict({"w": torch.tensor([[0.5, -2.0], [4.0, 1.0]])}, [])
        >>> tx.update(g, tx.init(params))[0]["w"]  # with beta = 0: the signs
        tensor([[ 1., -1.],
                [ 1.,  1.]])
    """
    eps = _check_adaptation("scale_by_element_rms", beta, eps, rescale, views, donate_state)
    flag("scale_by_element_rms: bias_correction", bias_correction)
    check_state_dtype("scale_by_element_rms", state_dtype)
    counted = bias_correction or state_dtype == torch.bfloat16

    def init(params: TensorDictBase) -> TensorDictBase:
        _checked_views(views, params)
        state = {"exp_avg_sq": _zeros(params, lambda d: state_dtype or second_moment_dtype(d))}
        return build({**state, "step": _counts(params)} if counted else state, params.batch_size)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        names, given = list(grads.keys()), list(grads.values())
        _refuse_sharded(names, given)
        values = [o.float() if o.dtype == torch.float16 or state_dtype is not None else o for o in given]
        held = state["exp_avg_sq"]
        if counted:
            counts, t = _counted(named_leaves(state["step"], names), donate_state)
        starts = [x if state_dtype is None else x.float() for x in named_leaves(held, names)]
        writable = donate_state or state_dtype == torch.bfloat16
        v = _lerp(starts, _foreach("mul", values, values), 1 - _number(beta), inplace=writable)
        kept = _kept("exp_avg_sq", held, names, v, counts, donate_state) if state_dtype == torch.bfloat16 else v
        new = {"exp_avg_sq": replaced(held, names, kept)}
        if counted:
            new["step"] = replaced(state["step"], names, counts)
        root = v
        if bias_correction:
            root = _foreach("div", v, _per_leaf(_corrections(t, _number(beta)), v, grads.batch_dims))
        adapted = _foreach("div", values, _foreach("add", _foreach("sqrt", root), eps))
        if rescale != "none":
            for i, (o, view) in enumerate(zip(values, resolve_views(views, grads))):
                blocks = _rescaled(view.to_matrices(adapted[i]), view.to_matrices(o), rescale, eps)
                adapted[i] = view.from_matrices(blocks, o.shape)
        return build(dict(zip(names, cast_like(adapted, given))), grads.batch_size), build(new, state.batch_size)

    return transform(init, update, donates_state=donate_state)


def scale_by_sign() -> Transform:
    r""":math:`u \leftarrow \operatorname{sign}(u)` element-wise; before :func:`orthogonalize`, AdaMuon's
    sign-stabilised momentum :math:`O = \mathrm{NS}(\operatorname{sign}(M_t))`.

    Example:
        >>> tx = muonfn.scale_by_sign()
        >>> g = TensorDict({"w": torch.tensor([-0.3, 0.0, 2.0])}, [])
        >>> tx.update(g, tx.init(g))[0]["w"]
        tensor([-1.,  0.,  1.])
    """
    return _stateless(lambda params: None, lambda grads, params: _foreach("sign", list(grads.values())))


def scale_by_muon(
    momentum: Scalar = 0.95,
    *,
    nesterov: NesterovLike = True,
    ns: Any = None,
    momentum_bias_correction: bool = False,
    scale: ScaleLike = "match_rms_adamw",
    views: ViewsLike = None,
    orthogonalizer: Orthogonalizer | None = None,
    donate_state: bool = False,
) -> Transform:
    r"""Muon's direction: :math:`s(A, B)\cdot\mathrm{NS}(u)` with :math:`u` the (Nesterov) EMA momentum:
    ``chain(ema_momentum(...), orthogonalize(...))``, the scale taken by the last Newton–Schulz step."""
    return chain(
        ema_momentum(momentum, nesterov=nesterov, bias_correction=momentum_bias_correction, donate_state=donate_state),
        orthogonalize(
            ns,
            views=views,
            scale=scale,
            orthogonalizer=orthogonalizer,
            overwrite_input=fresh_updates(nesterov, momentum_bias_correction),
        ),
    )
