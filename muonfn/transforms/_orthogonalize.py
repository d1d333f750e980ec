"""Orthogonalization of matrix leaves, and the shape scale that goes with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import torch
from tensordict import TensorDictBase

from .. import _multi_tensor, _tree
from .._keys import Key, dotted, resolve_table
from .._tree import Leaves
from .._validation import Scalar, check_table, flag
from ..linalg import (
    DEFAULT_VIEW,
    CoefficientsLike,
    Decay,
    EpsMode,
    LocalOrthogonalizer,
    MatrixFn,
    MatrixView,
    NewtonSchulz,
    NSMethod,
    Orthogonalizer,
    ScaleFn,
    ScaleMode,
    block_scales,
    check_matrix_fn,
    polar,
    qr_orthogonal,
    shape_scale,
)
from ._caches import StructureCache
from ._combine import chain
from ._contract import InitFn, Transform, empty_state
from ._descent import Scaled
from ._momentum import ema_momentum, fresh_updates
from ._rules import Needs, Rule, Scope, from_rule, no_needs

MethodLike: TypeAlias = NSMethod | Literal["svd", "qr"] | MatrixFn


def matrix_map(
    method: MethodLike,
    coefficients: CoefficientsLike = "keller",
    *,
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    eps_mode: EpsMode = "clamp",
    restarts: Sequence[int] | None = None,
) -> MatrixFn:
    """The map of ``(count, m, n)`` batches that ``method`` names (see :func:`orthogonalize`).

    ``"standard"`` and ``"gram"`` give a :class:`muonfn.NewtonSchulz` with the other settings;
    ``"svd"`` :func:`muonfn.polar`; ``"qr"`` :func:`muonfn.linalg.qr_orthogonal`; a callable
    is returned as it is. The Newton–Schulz settings must be left at their defaults with
    ``"svd"``, ``"qr"`` or a callable, which do not read them: a ``ValueError`` names those given.
    """
    if method in ("standard", "gram"):
        return NewtonSchulz(coefficients, steps, eps, dtype, method, eps_mode, restarts)  # type: ignore[arg-type]
    if method not in ("svd", "qr") and (isinstance(method, str) or not callable(method)):
        raise ValueError(f"unknown ns_method {method!r}; choose 'standard', 'gram', 'svd', 'qr' or a callable")
    if restarts is not None:
        raise ValueError(f"ns_restarts apply to ns_method='gram', not {method!r}")
    _refuse_newton_schulz_settings(
        method, coefficients=coefficients, steps=steps, eps=eps, dtype=dtype, eps_mode=eps_mode
    )
    if method == "svd":
        return polar
    if method == "qr":
        return qr_orthogonal
    return method


def newton_schulz_setting(
    where: str,
    ns: MatrixFn | None = None,
    *,
    ns_coefficients: CoefficientsLike = "keller",
    ns_steps: int | None = None,
    ns_eps: float = 1e-7,
    ns_dtype: torch.dtype | None = None,
    ns_method: MethodLike = "standard",
    ns_eps_mode: EpsMode = "clamp",
    ns_restarts: Sequence[int] | None = None,
) -> MatrixFn:
    """The one Newton–Schulz setting of a preset, resolved once where the user wrote it.

    ``ns`` is that setting whole (a :class:`muonfn.NewtonSchulz`, or any map of
    ``(count, m, n)`` batches such as :func:`muonfn.polar`); the flat ``ns_*`` keywords are
    its familiar spellings, turned into one by :func:`matrix_map`. Giving both is an error
    naming the flat ones, which would be ignored.
    """
    if ns is None:
        return matrix_map(
            ns_method,
            ns_coefficients,
            steps=ns_steps,
            eps=ns_eps,
            dtype=ns_dtype,
            eps_mode=ns_eps_mode,
            restarts=ns_restarts,
        )
    flat = {
        "ns_coefficients": ns_coefficients,
        "ns_steps": ns_steps,
        "ns_eps": ns_eps,
        "ns_dtype": ns_dtype,
        "ns_method": ns_method,
        "ns_eps_mode": ns_eps_mode,
        "ns_restarts": ns_restarts,
    }
    given = [
        f"{name}={value!r}"
        for name, value in flat.items()
        if not _is_default(value, _NEWTON_SCHULZ_DEFAULTS[name.removeprefix("ns_")])
    ]
    if given:
        raise ValueError(
            f"{where}: ns={ns!r} is the whole Newton–Schulz setting, so {', '.join(given)} would be ignored; "
            "put them in the NewtonSchulz(...) you pass, or drop ns="
        )
    if not callable(ns):
        raise TypeError(
            f"{where}: ns must be a muonfn.NewtonSchulz or a map of (count, m, n) batches such as "
            f"muonfn.polar, got {type(ns).__name__}"
        )
    return ns


#: The Newton–Schulz settings and their defaults (the presets spell each with ``ns_`` in front).
_NEWTON_SCHULZ_DEFAULTS: dict[str, object] = {
    "coefficients": "keller",
    "steps": None,
    "eps": 1e-7,
    "dtype": None,
    "eps_mode": "clamp",
    "method": "standard",
    "restarts": None,
}


def _refuse_newton_schulz_settings(method: MethodLike, **settings: object) -> None:
    """A Newton–Schulz setting given with a method that does not run Newton–Schulz would be
    ignored: an error naming each (as the presets spell them, ``ns_steps``, ...)."""
    given = [
        f"ns_{name}={value!r}"
        for name, value in settings.items()
        if not _is_default(value, _NEWTON_SCHULZ_DEFAULTS[name])
    ]
    if given:
        shown = repr(method) if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        raise ValueError(
            f"ns_method={shown} does not run Newton–Schulz, so {', '.join(given)} would be ignored; "
            "leave the Newton–Schulz settings at their defaults with it"
        )


def _is_default(value: object, default: object) -> bool:
    # (same type too: ns_eps=True is no 1e-7, and a schedule given as a list is no "keller")
    return type(value) is type(default) and value == default


ViewsLike: TypeAlias = (
    Mapping[str, MatrixView] | Mapping[Key, MatrixView] | Callable[[Key, torch.Tensor], MatrixView | None] | None
)


def check_views(where: str, views: object) -> None:
    """Views as written: ``None``, a mapping of names to :class:`MatrixView` (checked now), or a
    callable ``(key, tensor) -> view`` (its results are checked where they are read)."""

    def check(table: Mapping[Any, Any]) -> None:
        for name, view in table.items():
            if not isinstance(view, MatrixView):
                raise TypeError(f"{where}: {name!r} maps to {view!r}; a view must be a muonfn.MatrixView")

    check_table(where, views, holds="MatrixView", called="(key, tensor) -> MatrixView or None", check=check)


def _called_view(views: Callable[[Key, torch.Tensor], MatrixView | None], key: Key, t: torch.Tensor) -> MatrixView:
    view = views(key, t)
    if view is None:
        return DEFAULT_VIEW
    if not isinstance(view, MatrixView):
        raise TypeError(f"views returned {view!r} for {dotted(key)!r}; it must return a muonfn.MatrixView or None")
    return view


def resolve_views(
    views: ViewsLike, keys: Sequence[Key], tensors: Sequence[torch.Tensor], *, members: int = 0
) -> list[MatrixView]:
    """One view per leaf: the declared one, else the default (2-D as is, ≥3-D as conv).

    Names that are not among ``keys`` are skipped (a view for a leaf routed elsewhere).
    ``members``: the batch dimensions of a stacked ensemble (``TensorDict.from_modules``),
    added to every view's ``batch_dims``, since views describe one member's leaf (a
    callable view is given the stacked tensor).
    """
    if views is None:
        resolved = [DEFAULT_VIEW] * len(keys)
    elif not isinstance(views, Mapping):  # `callable` of a dict does not trace under torch.compile
        resolved = [_called_view(views, k, t) for k, t in zip(keys, tensors)]
    else:
        declared = resolve_table(views, keys)
        resolved = [declared.get(k, DEFAULT_VIEW) for k in keys]
    if members:
        return [dataclasses.replace(v, batch_dims=v.batch_dims + members) for v in resolved]
    return resolved


def _view_checker(views: ViewsLike, ns: MatrixFn | None = None) -> InitFn:
    """An ``init`` that rejects leaves their view cannot read (a vector labelled as a matrix), and
    with ``ns`` a map that returns another shape or dtype for their matrices (run on meta tensors)."""

    def init(params: TensorDictBase) -> TensorDictBase:
        keys, values = _tree.leaf_keys(params), _tree.leaves(params)
        probed: set[tuple[int, int, torch.dtype]] = set()
        for key, p, view in zip(keys, values, resolve_views(views, keys, values, members=params.batch_dims)):
            view.check(key, p.shape)
            if ns is None:
                continue
            for rows, cols in view.blocks(p.shape):
                if rows and cols and (rows, cols, p.dtype) not in probed:
                    probed.add((rows, cols, p.dtype))
                    check_matrix_fn(ns, (1, rows, cols), p.dtype)
        return empty_state(params)

    return init


def orthogonalize(
    coefficients: CoefficientsLike = "keller",
    *,
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    ns_method: MethodLike = "standard",
    eps_mode: EpsMode = "clamp",
    restarts: Sequence[int] | None = None,
    ns: MatrixFn | None = None,
    views: ViewsLike = None,
    scale: ScaleMode = "none",
    extra_scale: float = 1.0,
    bucket_numel: int | None = None,
    orthogonalizer: Orthogonalizer | None = None,
    overwrite_input: bool = False,
) -> Transform:
    r"""Replaces every matrix :math:`G` by :math:`s(A, B)\cdot\mathrm{NS}(G)`.

    :math:`\mathrm{NS}` is Newton–Schulz by default; ``ns_method`` swaps in the exact polar
    factor (``"svd"``), QR's orthonormal factor (``"qr"``) or any map of ``(count, m, n)``
    batches.

    Args:
        coefficients: the Newton–Schulz schedule (see :func:`muonfn.newton_schulz`).
        steps: Newton–Schulz steps (default: the schedule's length).
        eps: lower bound of the normalising norm (``eps_mode="add"``: added to it).
        dtype: dtype of the Newton–Schulz matmuls (``None``: bf16 on CUDA, else fp32/fp64).
        ns_method: ``"standard"``; ``"gram"`` for :func:`muonfn.gram_newton_schulz` on the
            shapes where it needs fewer flops; ``"svd"`` for the exact polar factor
            :math:`U_rV_r^\top` (:func:`muonfn.polar`, in fp64); ``"qr"`` for the :math:`Q`
            factor of the tall orientation (:func:`muonfn.linalg.qr_orthogonal`, heavyball's
            ``"qr"`` mode); or a callable mapping a ``(count, m, n)`` tensor to one of the same
            shape, dtype and device (checked at every call; with the local orthogonalizer
            ``init`` also runs it once per matrix shape on a meta tensor, so that a wrong
            result fails before a step). ``"svd"``, ``"qr"`` and a callable do not run
            Newton–Schulz: ``coefficients``, ``steps``, ``eps``, ``dtype``, ``eps_mode`` and
            ``restarts`` must be left at their defaults with them (an error otherwise). The
            strategy ``"tp_gram"`` of :mod:`muonfn.distributed` needs Newton–Schulz
            (``"standard"``/``"gram"``) and raises a ``TypeError`` otherwise.
        eps_mode: ``"clamp"``, :math:`G/\max(\|G\|_F, \varepsilon)`, or ``"add"``,
            :math:`G/(\|G\|_F + \varepsilon)` (Keller's, optax's, dtensor-muon's);
            see :func:`muonfn.newton_schulz`.
        restarts: the Gram iteration's restart steps (``ns_method="gram"`` only; see
            :func:`muonfn.gram_newton_schulz`).
        ns: the whole setting in one value instead of the keywords above: a
            :class:`muonfn.NewtonSchulz`, or any map of ``(count, m, n)`` batches (such as
            :func:`muonfn.polar`); the keywords above must then keep their defaults.
        views: how leaves are read as matrices (:class:`MatrixView` by name, or a callable
            ``(key, tensor) -> view``); conv kernels are flattened by default. For a stacked
            ensemble (gradients of batch size ``[N]``) they describe one member's leaf: the
            batch dimensions are added to each view's ``batch_dims``.
        scale: the shape scale :math:`s` (``"none"`` by default, see :func:`scale_by_shape`).
        extra_scale: a factor on :math:`s`.
        bucket_numel: at most this many elements per batched Newton–Schulz call of the local
            orthogonalizer (default :math:`2^{26}`).
        orthogonalizer: who runs the batched calls; default
            :class:`muonfn.linalg.LocalOrthogonalizer`. Sharded parameters take
            :func:`muonfn.distributed.sharded_orthogonalizer`.
        overwrite_input: the updates it is given are temporaries of this step that nothing
            reads after it, such as :func:`ema_momentum`'s Nesterov look-ahead (the presets
            say so for it): their memory may then hold the results, where a new batch would
            (off the CPU, for Newton–Schulz in a narrower dtype than the updates'). The same
            values; what it returns may be the tensors it was given. Ignored under
            ``torch.func`` transforms, where autograd records, and by an orthogonalizer whose
            ``overwrites_input`` is not ``True``.

    Returns:
        A stateless :class:`Transform`. With the local orthogonalizer ``init`` checks that
        every leaf's view can read it (a vector is no matrix); a sharded one checks views
        against global shapes at the first update.
    """
    ns = newton_schulz_setting(
        "orthogonalize",
        ns,
        ns_coefficients=coefficients,
        ns_steps=steps,
        ns_eps=eps,
        ns_dtype=dtype,
        ns_method=ns_method,
        ns_eps_mode=eps_mode,
        ns_restarts=restarts,
    )
    scale_fn = shape_scale(scale, extra_scale)
    check_views("orthogonalize: views", views)
    flag("orthogonalize: overwrite_input", overwrite_input)
    if orthogonalizer is not None and not callable(orthogonalizer):
        raise TypeError(
            "orthogonalize: orthogonalizer must be a muonfn.linalg.Orthogonalizer (such as "
            f"muonfn.distributed.sharded_orthogonalizer(...)) or None, got {type(orthogonalizer).__name__}"
        )
    if orthogonalizer is None:
        orthogonalizer = (
            LocalOrthogonalizer() if bucket_numel is None else LocalOrthogonalizer(bucket_numel=bucket_numel)
        )
    elif bucket_numel is not None:
        raise ValueError("orthogonalize: bucket_numel configures the local orthogonalizer; set it on the one you pass")
    run = orthogonalizer
    resolved = StructureCache()

    def scaled(grads: Leaves, scope: Scope, factor: float, decay: Decay | None) -> Leaves:  # (descent: -η, -ηλ)
        keys, values = list(grads), list(grads.values())
        leaf_views = resolved.get(
            grads, scope.batch_size, lambda: resolve_views(views, keys, values, members=scope.members)
        )
        options: dict[str, Any] = {} if decay is None else {"decay": decay}
        if overwrites and _multi_tensor.may_overwrite(values):
            options["overwrite_input"] = True
        return dict(zip(keys, run(keys, values, leaf_views, ns, _times(factor, scale_fn), **options)))

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        # an orthogonalizer's refusals (a leaf off its view, a sharded DTensor without collectives,
        # a pending reduction) come before any member of a composition runs: a donated momentum
        # must not have moved
        check = getattr(run, "check", None)
        if callable(check):
            keys, values = list(grads), list(grads.values())
            members = len(out.batch_size)
            leaf_views = resolved.get(
                grads, out.batch_size, lambda: resolve_views(views, keys, values, members=members)
            )
            check(keys, values, leaf_views)

    # sharded leaves may be local blocks: their views are checked against global shapes at update
    # (a map of one's own is tried at init on meta tensors, so that a wrong shape fails before a step)
    probe = None if isinstance(ns, NewtonSchulz) else ns
    init = _view_checker(views, probe) if isinstance(run, LocalOrthogonalizer) else empty_state
    adds_decay = getattr(run, "adds_decay", False) is True
    overwrites = overwrite_input and getattr(run, "overwrites_input", False) is True
    return from_rule(init, Rule("orthogonalize", Scaled(scaled, adds_decay=adds_decay), needs))


def _times(factor: float, scale_fn: ScaleFn) -> ScaleFn:
    """``scale_fn`` times ``factor`` (the product taken in Python floats, then used once)."""
    return scale_fn if factor == 1.0 else lambda rows, cols: factor * scale_fn(rows, cols)


def scale_by_shape(
    scale: ScaleMode = "match_rms_adamw", *, extra_scale: float = 1.0, views: ViewsLike = None
) -> Transform:
    r"""Multiplies every matrix block by :math:`s(A, B)\cdot` ``extra_scale``.

    ``A``/``B`` are the rows (fan-out) and columns (fan-in) of the logical matrix
    (after the view: conv kernels flattened, ``(in, out)`` storage transposed, fused
    blocks each on their own; a stacked ensemble's batch dimensions excluded). Modes:
    ``"original"`` √max(1, A/B), ``"match_rms_adamw"`` 0.2·√max(A, B), ``"spectral"``
    √max(A, B), ``"unit_rms_norm"`` √(A/B), ``"none"`` 1.

    Returns:
        A stateless :class:`Transform`; ``init`` checks that every leaf's view can read it.
    """
    scale_fn = shape_scale(scale, extra_scale)
    check_views("scale_by_shape: views", views)
    plans = StructureCache()

    def plan(keys: list[Key], values: list[torch.Tensor], members: int) -> list[tuple[MatrixView, list[float]]]:
        """Each leaf's view (checked) and block scales."""
        out = []
        for key, g, view in zip(keys, values, resolve_views(views, keys, values, members=members)):
            view.check(key, g.shape)
            out.append((view, block_scales(view, g.shape, scale_fn)))
        return out

    def scaled(grads: Leaves, scope: Scope, factor: float, decay: Decay | None) -> Leaves:  # (descent: -η; no decay)
        keys, values = list(grads), list(grads.values())
        out = []
        for g, (view, scales) in zip(
            values, plans.get(grads, scope.batch_size, lambda: plan(keys, values, scope.members))
        ):
            if len(scales) == 1:
                out.append(g.mul(factor * scales[0]))
            else:
                blocks = [b.mul(factor * f) for b, f in zip(view.to_matrices(g), scales)]
                out.append(view.from_matrices(blocks, g.shape))
        return dict(zip(keys, out))

    return from_rule(_view_checker(views), Rule("scale_by_shape", Scaled(scaled), no_needs))


def scale_by_muon(
    momentum: Scalar = 0.95,
    *,
    nesterov: bool | Literal["add"] = True,
    ns_coefficients: CoefficientsLike = "keller",
    ns_steps: int | None = None,
    ns_dtype: torch.dtype | None = None,
    ns_eps: float = 1e-7,
    ns_method: MethodLike = "standard",
    ns_eps_mode: EpsMode = "clamp",
    ns_restarts: Sequence[int] | None = None,
    ns: MatrixFn | None = None,
    momentum_bias_correction: bool = False,
    scale: ScaleMode = "match_rms_adamw",
    extra_scale: float = 1.0,
    views: ViewsLike = None,
    bucket_numel: int | None = None,
    orthogonalizer: Orthogonalizer | None = None,
    donate_state: bool = False,
) -> Transform:
    r"""Muon's direction: :math:`s(A, B)\cdot\mathrm{NS}(u)` with :math:`u` the (Nesterov) EMA momentum.

    ``chain(ema_momentum(...), orthogonalize(...), scale_by_shape(...))`` within a few
    roundings: the scale is taken by the last Newton–Schulz step's matmuls, which saves a pass
    over memory.
    ``ns`` is the whole Newton–Schulz setting (a :class:`muonfn.NewtonSchulz` or a map of
    batches), and the ``ns_*`` arguments its flat spellings, :func:`orthogonalize`'s
    ``coefficients``, ``steps``, ``dtype``, ``eps``, ``ns_method``, ``eps_mode`` and
    ``restarts`` (see :func:`newton_schulz_setting`); ``nesterov``,
    ``momentum_bias_correction`` (its ``bias_correction``) and ``donate_state`` are
    :func:`ema_momentum`'s.

    Returns:
        A :class:`Transform` with state ``{"momentum": ...}``.
    """
    return chain(
        ema_momentum(momentum, nesterov=nesterov, bias_correction=momentum_bias_correction, donate_state=donate_state),
        orthogonalize(
            ns=newton_schulz_setting(
                "scale_by_muon",
                ns,
                ns_coefficients=ns_coefficients,
                ns_steps=ns_steps,
                ns_eps=ns_eps,
                ns_dtype=ns_dtype,
                ns_method=ns_method,
                ns_eps_mode=ns_eps_mode,
                ns_restarts=ns_restarts,
            ),
            views=views,
            scale=scale,
            extra_scale=extra_scale,
            bucket_numel=bucket_numel,
            orthogonalizer=orthogonalizer,
            overwrite_input=fresh_updates(nesterov, momentum_bias_correction),
        ),
    )
