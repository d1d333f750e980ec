r"""Newton–Schulz orthogonalization, standard and Gram, its coefficient sets, and the exact polar factor.

For :math:`G = U \Sigma V^\top` the polar factor is :math:`U V^\top`. Newton–Schulz approximates it
without an SVD: normalise :math:`X_0 = G / \max(c\,\|G\|_F, \varepsilon)` (so every singular value
lies in [0, 1]), then iterate the odd quintic

.. math::  X_{k+1} = a_k X_k + (b_k A + c_k A^2) X_k, \qquad A = X_k X_k^\top,

which maps each singular value through :math:`p_k(\sigma) = a_k\sigma + b_k\sigma^3 + c_k\sigma^5`
while leaving the singular vectors alone. The iteration runs on the wide orientation (:math:`m \le n`),
where :math:`A` is the small Gram matrix; the orientation is decided by shape alone, so
``f(Gᵀ) = f(G)ᵀ`` bit for bit.

*Gram Newton–Schulz* runs the same map on the small Gram matrix. Every iterate is a polynomial in
:math:`R_0 = X_0 X_0^\top` applied to :math:`X_0`, :math:`X_k = Q_k X_0`, so for a wide :math:`m\times n`
matrix the iteration can be carried by two :math:`m\times m` matrices:

.. math::  P_k = a_k I + b_k R_k + c_k R_k^2, \qquad Q_{k+1} = P_k Q_k, \qquad R_{k+1} = P_k R_k P_k,

and :math:`X_K = Q_K X_0` is formed once at the end: :math:`8m^2n + 28m^3` flops for 5 steps with one
restart against :math:`20m^2n + 10m^3`, fewer once :math:`n > 1.5\,m`. Rounding in :math:`R_k` is not
corrected by the iteration, so a *restart* re-forms :math:`X_k = Q_k X_0` and :math:`R_k = X_kX_k^\top`.

The normalisation first multiplies each matrix by the power of two that brings its largest entry
into [1, 2): exact, so ``f(2ᵏG) = f(G)`` bit for bit, and no norm of finite entries overflows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, TypeAlias, TypeGuard, get_args

import torch

from .._devices import cpu_rule, default_ns_dtype, may_write_into

Triple = tuple[float, float, float]
NSMethod: TypeAlias = Literal["standard", "gram"]
NS_METHODS: tuple[str, ...] = get_args(NSMethod)
EpsMode: TypeAlias = Literal["clamp", "add"]
EPS_MODES: tuple[str, ...] = get_args(EpsMode)


class Coefficients(NamedTuple):
    """A Newton–Schulz schedule: one ``(a, b, c)`` triple per step; ``norm_factor`` multiplies the
    normalising norm (a margin so that rounding cannot push a singular value above 1)."""

    triples: tuple[Triple, ...]
    norm_factor: float = 1.0


CoefficientsLike: TypeAlias = str | Coefficients | Sequence[Sequence[float]]

#: The schedules by name; their measured singular-value bands are on the formulas page.
COEFFICIENTS: dict[str, Coefficients] = {
    # Jordan et al. (2024); torch.optim.Muon's default. Fast but loose: σ lands in [0.68, 1.13].
    "keller": Coefficients(((3.4445, -4.7750, 2.0315),) * 5),
    # Cesista et al.: five tuned steps, σ within a few percent of 1.
    "cesista": Coefficients(
        (
            (4.0848, -6.8946, 2.9270),
            (3.9505, -6.3029, 2.6377),
            (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046),
            (2.8366, -3.0525, 1.2012),
        )
    ),
    # Amsel et al. (2025), "Polar Express"; the triples already carry the 1/1.01 safety factor.
    "polar_express": Coefficients(
        (
            (8.2051, -22.9019, 16.4607),
            (4.0664, -2.8612, 0.5184),
            (3.9096, -2.8234, 0.5250),
            (3.2856, -2.4153, 0.4853),
            (2.2779, -1.6198, 0.3985),
            (1.8726, -1.2307, 0.3585),
            (1.8564, -1.2132, 0.3568),
            (1.8750, -1.2500, 0.3750),
        ),
        norm_factor=1.01,
    ),
}


def ns_schedule(coefficients: CoefficientsLike = "keller", steps: int | None = None) -> Coefficients:
    """A named or custom schedule stretched to ``steps``: fewer steps truncate it, more repeat its
    last triple, so ``[(a, b, c)]`` with ``steps=5`` is torch.optim.Muon's iteration."""
    if steps is not None and not (is_integer(steps) and steps >= 1):
        raise ValueError(f"Newton–Schulz steps must be an integer >= 1, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENTS:
            raise ValueError(
                f"unknown Newton–Schulz coefficient set {coefficients!r}; "
                f"choose one of {sorted(COEFFICIENTS)} or pass (a, b, c) triples"
            )
        coefficients = COEFFICIENTS[coefficients]  # (finite triples: the checks below pass them)
    elif isinstance(coefficients, bytes) or not isinstance(coefficients, Sequence):
        raise TypeError(
            f"Newton–Schulz coefficients must be a set name ({', '.join(map(repr, sorted(COEFFICIENTS)))}), "
            f"a Coefficients or a sequence of (a, b, c) triples, got {coefficients!r}"
        )
    elif _is_triple(coefficients):
        raise ValueError(
            f"Newton–Schulz coefficients {coefficients!r} are one (a, b, c), not a schedule: pass "
            "[(a, b, c)] with steps=5 (torch.optim.Muon's ns_coefficients and ns_steps)"
        )
    given, factor = coefficients if isinstance(coefficients, Coefficients) else (coefficients, 1.0)
    if not all(_is_triple(t) and all(map(math.isfinite, t)) for t in given):
        raise ValueError(f"Newton–Schulz coefficients must be finite (a, b, c) triples, got {coefficients!r}")
    schedule = Coefficients(tuple((float(t[0]), float(t[1]), float(t[2])) for t in given), factor)
    if not schedule.triples:
        raise ValueError("Newton–Schulz coefficients need at least one (a, b, c) triple")
    if not (isinstance(schedule.norm_factor, int | float) and 0 < schedule.norm_factor < math.inf):
        raise ValueError(f"Newton–Schulz norm_factor must be finite and > 0, got {schedule.norm_factor!r}")
    steps = len(schedule.triples) if steps is None else steps
    return schedule._replace(triples=(schedule.triples + schedule.triples[-1:] * steps)[:steps])


def _is_triple(t: object) -> TypeGuard[Sequence[float]]:
    return isinstance(t, Sequence) and len(t) == 3 and all(isinstance(v, int | float) for v in t)


def is_integer(v: object) -> TypeGuard[int]:
    """``v`` is an ``int`` and not a ``bool``."""
    return isinstance(v, int) and not isinstance(v, bool)


class Reduction(Protocol):
    r"""Combines the per-block values of matrices whose columns are split into blocks held
    elsewhere: Newton–Schulz on such blocks needs the whole matrix's largest entry, squared norm
    and Gram matrix :math:`XX^\top = \sum_r X_rX_r^\top`."""

    def sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def max(self, t: torch.Tensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------- normalisation

#: Of each wide float dtype: the integers its bits are read as, its mantissa's bits, its exponent's bias.
_FLOAT_BITS = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}


def normalized(
    g: torch.Tensor, ns: NewtonSchulz, dtype: torch.dtype, reduction: Reduction | None = None, *, owned: bool = False
) -> torch.Tensor:
    r""":math:`G / \max(c\|G\|_F, \varepsilon)` (``"add"``: :math:`G / (c\|G\|_F + \varepsilon)`, ``ns``'s) of every
    matrix of a wide ``(count, m, n)`` batch ``g`` in at least fp32 (a contiguous copy of ``g`` where
    it is narrower or not contiguous), rounded once to ``dtype``.

    Each matrix is first multiplied by its power of two (see the module), every term of the
    denominator too, so the quotient has the same bits. ``owned``: ``g`` may be overwritten.
    """
    wide = g.to(torch.promote_types(g.dtype, torch.float32)).contiguous()
    owned, g = owned or wide is not g, wide  # (a copy is its own)
    if g.numel():  # max(max G, -min G): two vectorized reductions, no |G| written out
        largest = torch.maximum(g.amax(dim=(-2, -1), keepdim=True), g.amin(dim=(-2, -1), keepdim=True).neg())
    else:  # (a rank's block of a split matrix may be empty)
        largest = g.new_zeros((*g.shape[:-2], 1, 1))
    if reduction is not None:
        largest = reduction.max(largest)
    # the unit 2⁻ᵉ that brings the largest entry into [1, 2), e clamped so that both 2^±e stay normal,
    # read from the bits (0, subnormals and inf clamp to the ends)
    ints, mantissa, bias = _FLOAT_BITS[largest.dtype]
    exponent = largest.view(ints).bitwise_and(-(1 << mantissa)).clamp(1 << mantissa, (2 * bias - 1) << mantissa)
    unit = torch.rsub(exponent, 2 * bias << mantissa).view(largest.dtype)
    writable = owned and may_write_into(g)
    g = g.mul_(unit) if writable else g * unit
    if reduction is None:
        norm = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)
    else:
        norm = reduction.sum(g.square().sum(dim=(-2, -1), keepdim=True)).sqrt()
    if ns.schedule.norm_factor != 1.0:
        norm = norm * ns.schedule.norm_factor
    denominator = norm.add(unit * ns.eps) if ns.eps_mode == "add" else torch.maximum(norm, unit * ns.eps)
    # (dividing in place, then casting, is ~3x faster on a CPU than one division into a narrower out=)
    return (g.div_(denominator) if writable else g / denominator).to(dtype)


# ---------------------------------------------------------------------------------------------- the iteration


def _step(
    X: torch.Tensor, A: torch.Tensor, a: float, b: float, c: float, s: float, factor: Any = None, result: Any = None
) -> torch.Tensor:
    r""":math:`s\,(aX + (bA + cA^2)X)`. In fp32 and wider as :math:`(saI + sbA + scA^2)X`: the factor
    formed on the small side and one plain matmul. In a 16-bit dtype as :math:`saX + sBX` in the
    matmul's fp32 epilogue: the factor's diagonal :math:`a + B_{ii}`, rounded to 8 bits, would scale
    whole rows of the result by its error. ``factor``, ``result``: ``out=`` buffers (``None``: new ones)."""
    if X.dtype.itemsize >= 4:
        P = torch.baddbmm(A, A, A, beta=b * s, alpha=c * s, out=factor)
        P.diagonal(dim1=-2, dim2=-1).add_(a * s)
        return torch.bmm(P, X, out=result)
    # a product weighted 0 is left out: torch's CPU baddbmm in bf16 and fp16 returns wrong values with
    # alpha=0 (matrices of 12×12 and up, torch 2.13), where the term is 0 anyway
    B = torch.mul(A, b, out=factor) if c == 0 else torch.baddbmm(A, A, A, beta=b, alpha=c, out=factor)
    return torch.mul(X, a * s, out=result) if s == 0 else torch.baddbmm(X, B, X, beta=a * s, alpha=s, out=result)


def standard_steps(
    X: torch.Tensor, schedule: Coefficients, scale: float = 1.0, reduction: Reduction | None = None
) -> torch.Tensor:
    """The quintic steps on a normalised batch ``X`` (this call's own), the last one times ``scale``
    (inside its matmuls). Eager, in three buffers every step reuses: a step allocates nothing."""
    gram = factor = spare = None  # (traced, recorded or reduced: no buffers, each step allocates)
    if reduction is None and may_write_into(X):
        gram = X.new_empty((*X.shape[:-1], X.size(-2)))
        factor, spare = torch.empty_like(gram), torch.empty_like(X)
    for k, (a, b, c) in enumerate(schedule.triples):
        A = torch.bmm(X, X.mT, out=gram)
        s = scale if k == len(schedule.triples) - 1 else 1.0
        Y = _step(X, A if reduction is None else reduction.sum(A), a, b, c, s, factor, spare)
        spare, X = (X if gram is not None else None), Y  # (the next step's result goes where this one's input was)
    return X


def default_restarts(steps: int, dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
    """A Gram restart before every third step in fp32/fp64 (``(3,)`` for 5 steps), every second in
    16-bit dtypes (``(2, 4)``): measured on 32×128 to 256×1024 matrices of Gaussian, geometric and
    low-rank spectra, the error stays within 3× the standard iteration's in every dtype."""
    every = 2 if dtype.itemsize <= 2 else 3
    return tuple(range(every, steps, every))


def _check_restarts(restarts: Any, steps: int) -> tuple[int, ...]:
    ok = isinstance(restarts, Sequence) and not isinstance(restarts, str | bytes)
    if not ok or not all(is_integer(r) and 0 < r < steps for r in restarts):
        raise ValueError(f"Gram Newton–Schulz restarts must be step indices in [1, {steps - 1}], got {restarts!r}")
    return tuple(sorted(set(restarts)))


def gram_steps(
    X: torch.Tensor, schedule: Coefficients, restarts: Sequence[int] | None, scale: float = 1.0
) -> torch.Tensor:
    """The quintic steps carried by the Gram matrix (see the module), restarted before the steps
    ``restarts`` names (``None``: :func:`default_restarts`), the result times ``scale``."""
    steps = len(schedule.triples)
    restarts = default_restarts(steps, X.dtype) if restarts is None else restarts
    # Q: the product of the factors P since the last restart, which the first step sets
    Q = R = torch.bmm(X, X.mT)
    for k, (a, b, c) in enumerate(schedule.triples):
        if k in restarts:  # (never the first step)
            X = torch.bmm(Q, X)
            R = torch.bmm(X, X.mT)
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if k == 0 or k in restarts else torch.bmm(P, Q)
        if k + 1 < steps and k + 1 not in restarts:
            R = torch.bmm(P, torch.bmm(R, P))
    return torch.bmm(Q, X) if scale == 1.0 else torch.baddbmm(X, Q, X, beta=0, alpha=scale)


def newton_schulz_flops(m: int, n: int, steps: int) -> float:
    """Flops of ``steps`` standard quintic steps on an m×n matrix: ``steps·(4m²n + 2m³)``, m ≤ n."""
    m, n = min(m, n), max(m, n)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def gram_newton_schulz_flops(
    m: int, n: int, steps: int, restarts: Sequence[int] | None = None, dtype: torch.dtype = torch.float32
) -> float:
    """Flops of Gram Newton–Schulz on an m×n matrix: ``8m²n + 28m³`` for 5 steps in fp32.

    With ``r`` restarts it multiplies an ``m×n`` matrix (``2m²n`` flops) ``2r + 2`` times: ``R = XXᵀ`` at
    the start and at every restart, ``X = QX`` at every restart and at the end; and two ``m×m`` ones
    (``2m³``) ``steps + 3(steps - 1 - r)`` times: ``R²`` every step, and ``PQ`` and ``PRP`` (two) once
    for each step that neither comes first nor follows a restart."""
    m, n = min(m, n), max(m, n)
    r = len(_check_restarts(default_restarts(steps, dtype) if restarts is None else restarts, steps))
    return (2 * r + 2) * 2.0 * m * m * n + (steps + 3 * (steps - 1 - r)) * 2.0 * m**3


# ---------------------------------------------------------------------------------------------- the map


@dataclass(frozen=True)
class NewtonSchulz:
    r"""A configured Newton–Schulz map: ``ns(x)`` orthogonalizes every matrix of a ``(..., m, n)`` tensor.

    Args:
        coefficients: ``"keller"``, ``"cesista"``, ``"polar_express"``, a :class:`Coefficients`, or
            a sequence of ``(a, b, c)`` triples.
        steps: number of iterations (default: the schedule's length).
        eps: lower bound of the normalising norm (``eps_mode="add"``: added to it); > 0.
        dtype: dtype of the iteration's matmuls; ``None``: where the device multiplies it fastest
            (bf16 on CUDA and on a CPU that measures bf16 faster, for large enough matrices; else
            the input's dtype, at least fp32).
        method: ``"standard"``, or ``"gram"`` for Gram Newton–Schulz on the shapes where it needs
            fewer flops (the standard iteration elsewhere).
        eps_mode: ``"clamp"``, :math:`G/\max(c\|G\|_F, \varepsilon)`, or ``"add"``,
            :math:`G/(c\|G\|_F + \varepsilon)` (Keller's, optax's; gives up exact scale invariance).
        restarts: Gram restarts (``method="gram"`` only; default :func:`default_restarts`).

    Exact properties: ``f(-G) = -f(G)``, ``f(0) = 0``, ``f(2**k G) = f(G)`` while both norms are
    ``>= eps``, ``f(G.mT) = f(G).mT``. Returns ``x``'s dtype and shape; never modifies ``x``.
    Checked when made, so a bad setting fails where it is written.

    Example:
        >>> g = torch.randn(4, 8, dtype=torch.float64)
        >>> o = muonfn.NewtonSchulz("polar_express")(g)
        >>> torch.allclose(o @ o.mT, torch.eye(4, dtype=torch.float64), atol=1e-5)
        True
    """

    coefficients: CoefficientsLike = "keller"
    steps: int | None = None
    eps: float = 1e-7
    dtype: torch.dtype | None = None
    method: NSMethod = "standard"
    eps_mode: EpsMode = "clamp"
    restarts: Sequence[int] | None = None
    #: the ``(a, b, c)`` triples, resolved once from ``coefficients`` and ``steps``
    schedule: Coefficients = field(init=False, repr=False, compare=False)
    #: the CPU's default rule, read from ``MUONFN_CPU_NS_DTYPE`` when the map is made (never while stepping)
    cpu_rule: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", ns_schedule(self.coefficients, self.steps))
        object.__setattr__(self, "cpu_rule", cpu_rule())
        if isinstance(self.eps, bool) or not isinstance(self.eps, int | float) or not 0 < self.eps < math.inf:
            raise ValueError(f"Newton–Schulz eps must be finite and > 0, got {self.eps!r}")
        if self.eps_mode not in EPS_MODES:
            raise ValueError(f"Newton–Schulz eps_mode must be one of {list(EPS_MODES)}, got {self.eps_mode!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"Newton–Schulz dtype must be a real floating-point torch.dtype, got {self.dtype!r}")
        if self.method not in NS_METHODS:
            raise ValueError(f"unknown Newton–Schulz method {self.method!r}; choose one of {list(NS_METHODS)}")
        if self.restarts is not None:
            if self.method != "gram":
                raise ValueError("Newton–Schulz restarts apply to method='gram' only")
            object.__setattr__(self, "restarts", _check_restarts(self.restarts, len(self.schedule.triples)))

    def iteration_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the matrices of ``x`` are iterated in (see ``dtype``)."""
        return default_ns_dtype(x.device, x.dtype, x.shape, self.cpu_rule) if self.dtype is None else self.dtype

    def iterate(self, X: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The steps on a normalised wide batch ``X`` (Gram's where cheaper), the last times ``scale``."""
        if self.method == "gram":
            steps, (m, n) = len(self.schedule.triples), X.shape[-2:]
            if gram_newton_schulz_flops(m, n, steps, self.restarts, X.dtype) < newton_schulz_flops(m, n, steps):
                return gram_steps(X, self.schedule, self.restarts, scale)
        return standard_steps(X, self.schedule, scale)

    def orthogonalize(self, x: torch.Tensor, *, scale: float = 1.0, overwrite_input: bool = False) -> torch.Tensor:
        """``scale·self(x)``, the scale taken by the last step's matmuls (no pass of its own);
        ``overwrite_input``: ``x`` is the caller's temporary, which the normalisation may overwrite."""
        return _through_wide("newton_schulz", x, self.orthogonalize_wide, scale=scale, overwrite_input=overwrite_input)

    __call__ = orthogonalize

    def orthogonalize_wide(
        self, batch: torch.Tensor, *, scale: float = 1.0, overwrite_input: bool = False
    ) -> torch.Tensor:
        """:meth:`orthogonalize` of a wide ``(count, m, n)`` batch (``m <= n``): the batches a step
        stacks are wide already."""
        X = normalized(batch, self, self.iteration_dtype(batch), owned=overwrite_input)
        return self.iterate(X, scale).to(batch.dtype)


def _through_wide(name: str, x: torch.Tensor, f: Callable[..., torch.Tensor], **options: Any) -> torch.Tensor:
    """``f(batch, **options)`` of ``x`` as a wide ``(count, m, n)`` batch (a view where it can be one), its
    result in ``x``'s dtype, shape and orientation, contiguous where ``x`` is: the orientation is decided
    by shape alone, never by memory layout."""
    if x.ndim < 2:
        raise ValueError(f"{name} needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} needs a real floating-point tensor, got {x.dtype}")
    tall = x.size(-2) > x.size(-1)
    g = x.mT if tall else x
    batch = g.reshape(math.prod(g.shape[:-2]), *g.shape[-2:])  # (not -1: a tensor may hold no element)
    out = f(batch, **options).to(x.dtype).view(g.shape)
    out = out.mT if tall else out
    return out.contiguous() if x.is_contiguous() else out


def newton_schulz(
    x: torch.Tensor,
    coefficients: CoefficientsLike = "keller",
    *,
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    eps_mode: EpsMode = "clamp",
) -> torch.Tensor:
    """Approximately :math:`UV^\\top` of every matrix of ``x`` (``(..., m, n)``): :class:`NewtonSchulz`
    with these settings, applied once."""
    return NewtonSchulz(coefficients, steps, eps, dtype, eps_mode=eps_mode)(x)


def gram_newton_schulz(
    x: torch.Tensor,
    coefficients: CoefficientsLike = "keller",
    *,
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    restarts: Sequence[int] | None = None,
    eps_mode: EpsMode = "clamp",
) -> torch.Tensor:
    """:func:`newton_schulz` through the ``m×m`` Gram matrix of the wide orientation, on every
    shape (equal to it up to rounding; cheaper once the long side exceeds about 1.5× the short one).
    ``restarts``: step indices before which the iterate is re-formed (default :func:`default_restarts`;
    ``()`` for none)."""
    ns = NewtonSchulz(coefficients, steps, eps, dtype, "gram", eps_mode, restarts)

    def gram_wide(g: torch.Tensor) -> torch.Tensor:  # (Gram's steps on every shape, not only where cheaper)
        return gram_steps(normalized(g, ns, ns.iteration_dtype(g)), ns.schedule, ns.restarts)

    return _through_wide("gram_newton_schulz", x, gram_wide)


def newton_schulz_columns(
    blocks: torch.Tensor, ns: NewtonSchulz, reduction: Reduction, dtype: torch.dtype
) -> torch.Tensor:
    """Newton–Schulz of wide matrices whose columns are split into blocks held elsewhere, given one
    block of each as a ``(count, m, n_r)`` batch; ``reduction`` combines the blocks' values. The
    blocks of the result, in ``dtype``, the iteration's."""
    # (no name here holds the normalised blocks: the first step's result replaces them)
    return standard_steps(normalized(blocks, ns, dtype, reduction, owned=True), ns.schedule, reduction=reduction)


def polar(x: torch.Tensor) -> torch.Tensor:
    r"""The exact polar factor :math:`U_r V_r^\top` of every matrix in ``x`` (via SVD, in fp64).

    Singular directions with :math:`\sigma \le \max(m, n)\,\epsilon_{64}\,\sigma_{max}` count as the
    null space and map to zero, so rank-deficient inputs give a partial isometry. A matrix holding
    NaN or Inf maps to NaN, as Newton–Schulz's does. The reference for tests and diagnostics.
    """
    if x.ndim < 2:
        raise ValueError(f"polar needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    if not x.numel():
        return torch.zeros_like(x)
    wide = x.to(torch.float64)
    finite = wide.isfinite().flatten(-2).all(-1)[..., None, None]
    u, s, vh = torch.linalg.svd(torch.where(finite, wide, 0.0), full_matrices=False)
    tol = max(x.shape[-2:]) * torch.finfo(torch.float64).eps * s.amax(dim=-1, keepdim=True)
    return torch.where(finite, (u * (s > tol).unsqueeze(-2)) @ vh, torch.nan).to(x.dtype)


def qr_orthogonal(x: torch.Tensor) -> torch.Tensor:
    r"""The orthonormal factor :math:`Q` of the reduced QR decomposition of every matrix in ``x``,
    taken on the tall orientation in at least fp32 (heavyball's ``"qr"`` mode for a square matrix).
    Not the polar factor: :math:`Q` depends on the column order."""
    if x.ndim < 2:
        raise ValueError(f"qr_orthogonal needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    wide = x.size(-2) < x.size(-1)
    g = (x.mT if wide else x).to(torch.promote_types(x.dtype, torch.float32))
    q = torch.linalg.qr(g).Q
    return (q.mT if wide else q).to(x.dtype)
