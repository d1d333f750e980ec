"""The invariant suite of an orthogonalizer ``G -> O``, run by hypothesis."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ._spectra import DEFAULT_SCALES, Spectral, fits, matrices, orthogonal

Invariant: TypeAlias = Literal[
    "no error",
    "dtype and shape",
    "input not mutated",
    "finite output",
    "singular value band",
    "rank preservation",
    "transpose symmetry",
    "orthogonal equivariance",
    "scale invariance",
    "batch consistency",
]
INVARIANTS: tuple[Invariant, ...] = get_args(Invariant)


class InvariantViolation(AssertionError):
    """Raised by :func:`check_orthogonalizer`; ``invariant`` names the invariant that broke."""

    def __init__(self, invariant: Invariant, message: str) -> None:
        super().__init__(message)
        self.invariant = invariant


@dataclass(frozen=True)
class Tolerances:
    """How far :func:`check_orthogonalizer` lets an orthogonalizer be from each invariant.

    Relative errors compare two outputs on the *well-conditioned block*: both are written in
    the singular vector basis of the input, :math:`U^\\top O V`, and only the entries
    ``(i, j)`` where :math:`\\sigma_i` and :math:`\\sigma_j` are at least ``sigma_min`` times
    :math:`\\|G\\|_F` count; the error is the Frobenius norm of the difference over that of
    the expected block. (Rounding in directions with tiny singular values is amplified by
    the slope of the polynomial near zero, up to ~6300 for ``polar_express``; those
    directions are checked by the band's upper end and the rank only.)

    Attributes:
        band: absolute slack on both ends of ``band``.
        equivariance: relative error of :math:`f(Q_1 G Q_2^\\top)` against :math:`Q_1 f(G) Q_2^\\top`.
        symmetry: relative error of :math:`f(G^\\top)^\\top`, :math:`f(\\alpha G)` and a batch
            member against :math:`f(G)`.
        null_space: singular values of the output below this count as zero (rank).
    """

    band: float
    equivariance: float
    symmetry: float
    null_space: float


#: Default tolerances per input dtype: the worst errors of muonfn's Newton–Schulz with the
#: built-in schedules, iterating in the input's dtype, over 1000–2000 drawn inputs each, times a
#: margin of 4× (bf16) to 40× (fp64); the table on :doc:`/testing` lists both.
TOLERANCES: dict[torch.dtype, Tolerances] = {
    torch.float64: Tolerances(band=1e-12, equivariance=1e-12, symmetry=1e-12, null_space=1e-9),
    torch.float32: Tolerances(band=1e-4, equivariance=2e-4, symmetry=2e-4, null_space=1e-2),
    torch.bfloat16: Tolerances(band=0.05, equivariance=0.3, symmetry=0.3, null_space=0.5),
    torch.float16: Tolerances(band=0.01, equivariance=0.05, symmetry=0.05, null_space=0.2),
}

#: Default ``sigma_min`` per input dtype: 16-bit inputs cannot resolve singular values much
#: below 1 % of the norm (their rounding alone moves them by ~0.4 %).
SIGMA_MIN: dict[torch.dtype, float] = {d: 0.05 if torch.finfo(d).bits == 16 else 1e-3 for d in TOLERANCES}

# the scale drawn for each example (shrinks towards 2), and the overflow-range scales one of
# which every example also tries
_SCALE_FACTORS = (2.0, 0.5, 3.0, 0.1, 2.0**10, 2.0**-10)
_EXTREME_FACTORS = (2.0**100, 2.0**-100)


def _feasible(factors: Collection[float], sp: Spectral, min_norm: float) -> list[float]:
    """The factors α that keep ‖αG‖_F >= min_norm and αG's largest singular value well inside the dtype."""
    top = float(sp.s.max())
    smallest_norm = float(torch.linalg.vector_norm(sp.s, dim=-1).min())
    return [a for a in factors if a * smallest_norm >= min_norm and fits(sp.g.dtype, a * top)]


@dataclass(frozen=True)
class _Case:
    """One drawn example: a matrix, a rotation seed and scale factors (printed in failure reports)."""

    spectral: Spectral
    rotation_seed: int
    alphas: tuple[float, ...]

    def __repr__(self) -> str:
        alphas = ", ".join(f"{a:g}" for a in self.alphas)
        return f"_Case({self.spectral!r}, rotation_seed={self.rotation_seed}, alphas=({alphas}))"


@st.composite
def _cases(draw: st.DrawFn, matrix_strategy: st.SearchStrategy[Spectral], min_norm: float) -> _Case:
    sp = draw(matrix_strategy)
    seed = draw(st.integers(0, 2**32 - 1))
    alpha = draw(st.sampled_from(_feasible(_SCALE_FACTORS, sp, min_norm) or [1.0]))
    return _Case(sp, seed, (alpha, *_feasible(_EXTREME_FACTORS, sp, min_norm)[:1]))


@dataclass
class _Run:
    """Checks one example; every message says which invariant broke and on which input."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    case: _Case
    band: tuple[float, float]
    sigma_min: float
    tol: Tolerances

    def __post_init__(self) -> None:
        sp = self.sp = self.case.spectral
        self.g, self.batch = sp.g, sp.u.shape[:-2]
        self.relative = sp.s / torch.linalg.vector_norm(sp.s, dim=-1, keepdim=True)  # σ / ‖G‖_F per matrix
        self.well = self.relative >= self.sigma_min  # (*batch, k)
        self.block = (self.well.unsqueeze(-1) & self.well.unsqueeze(-2)).to(torch.float64)  # (*batch, k, k)
        # the matrices whose nonzero σ are all well-conditioned, so all must land in the band
        self.covered = (self.well == (sp.s > 0)).all(-1)

    def violation(self, invariant: Invariant, detail: str, x: torch.Tensor | None = None) -> InvariantViolation:
        x = self.g if x is None else x
        values = repr(x) if x.numel() <= 64 else f"({x.numel()} elements, not shown)"
        return InvariantViolation(
            invariant,
            f"orthogonalizer broke {invariant!r}: {detail}\n"
            f"  input: {self.case!r}\n"
            f"  G = {values}\n"
            f"  (dtype={str(self.g.dtype).removeprefix('torch.')}, band=({self.band[0]:.6g}, {self.band[1]:.6g}), "
            f"sigma_min={self.sigma_min:g}, {self.tol})",
        )

    def call(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """``fn(x)``, with the checks that hold for every call."""
        before = x.clone()
        try:
            out = self.fn(x)
        except Exception as e:
            raise self.violation("no error", f"{what} raised {type(e).__name__}: {e}", x) from e
        if not isinstance(out, torch.Tensor) or out.dtype != x.dtype or out.shape != x.shape:
            got = f"{out.dtype} of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            detail = f"{what} is {got} for an input {x.dtype} of shape {tuple(x.shape)}"
            raise self.violation("dtype and shape", detail, x)
        if not torch.equal(x, before):
            changed = int((x != before).sum())
            raise self.violation("input not mutated", f"{what} changed {changed} entries of its input", before)
        if not torch.isfinite(out).all():
            bad = int((~torch.isfinite(out)).sum())
            raise self.violation("finite output", f"{what} has {bad} non-finite entries for a finite input", x)
        return out

    def in_basis(self, o: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``uᵀ O v`` restricted to the leading ``k × k``, in fp64 (the drawn shapes are all matrix-shaped)."""
        k = self.sp.s.shape[-1]
        return (u.mT @ o.to(torch.float64) @ v)[..., :k, :k]

    def compare(
        self,
        invariant: Invariant,
        actual: torch.Tensor,
        expected: torch.Tensor,
        claim: str,
        tolerance: float,
        shown: torch.Tensor | None = None,
        block: torch.Tensor | None = None,
        note: str = "",
    ) -> None:
        """Raises unless ``actual`` is ``expected`` to ``tolerance`` (both in a singular vector basis): the
        largest relative Frobenius error over a batch, on the well-conditioned block."""
        mask = self.block if block is None else block
        diff = torch.linalg.matrix_norm((actual - expected) * mask)
        err = float((diff / torch.linalg.matrix_norm(expected * mask).clamp_min(1e-300)).max())
        if err > tolerance:
            detail = f"{claim} by {err:.3g} relative (tolerance {tolerance:g}){note}"
            raise self.violation(invariant, detail, shown)

    def run(self, skip: Collection[str]) -> None:
        sp, g, symmetry = self.sp, self.g, self.tol.symmetry
        o = self.call(g, "f(G)")
        o_basis = self.in_basis(o, sp.u, sp.v)
        if "singular value band" not in skip:
            self.check_band(o, o_basis)
        if "rank preservation" not in skip and g.dtype in (torch.float32, torch.float64):
            self.check_rank(o)
        if "transpose symmetry" not in skip:
            out = self.in_basis(self.call(g.mT, "f(Gᵀ)").mT, sp.u, sp.v)
            self.compare("transpose symmetry", out, o_basis, "f(Gᵀ)ᵀ differs from f(G)", symmetry)
        # (name, input, its output in the input's singular vectors, those vectors U, V) of every call on a G
        calls = [("G", g, o_basis, sp.u, sp.v)]
        if "orthogonal equivariance" not in skip:
            generator = torch.Generator().manual_seed(self.case.rotation_seed)
            # one Haar-random pair rotates every matrix of a batch
            q1, q2 = (orthogonal(size, generator) for size in sp.matrix_shape[-2:])
            rotated = (q1 @ sp.exact() @ q2.mT).to(g.dtype)
            # Q₁GQ₂ᵀ has singular vectors Q₁U, Q₂V: in them, f(Q₁GQ₂ᵀ) must look as f(G) does in U, V
            u, v = q1 @ sp.u, q2 @ sp.v
            out_basis = self.in_basis(self.call(rotated, "f(Q₁GQ₂ᵀ)"), u, v)
            claim = "f(Q₁GQ₂ᵀ) differs from Q₁f(G)Q₂ᵀ for Haar-random orthogonal Q₁, Q₂"
            self.compare("orthogonal equivariance", out_basis, o_basis, claim, self.tol.equivariance, rotated)
            calls.append(("Q₁GQ₂ᵀ", rotated, out_basis, u, v))
        for alpha in () if "scale invariance" in skip else self.case.alphas:
            scaled = g * alpha
            out = self.call(scaled, f"f({alpha:g}·G)")
            out_basis = self.in_basis(out, sp.u, sp.v)
            claim = f"f({alpha:g}·G) differs from f(G)"
            norms = f"; ‖f({alpha:g}·G)‖ = {float(out.double().norm()):.4g}, ‖f(G)‖ = {float(o.double().norm()):.4g}"
            self.compare("scale invariance", out_basis, o_basis, claim, symmetry, note=norms)
            calls.append((f"{alpha:g}·G", scaled, out_basis, sp.u, sp.v))
        if "batch consistency" in skip:
            return
        if self.batch:  # each matrix alone maps as it does in the batch
            for index in itertools.product(*map(range, self.batch)):
                where = ", ".join(map(str, index))
                out = self.in_basis(self.call(g[index], f"f(G[{where}])"), sp.u[index], sp.v[index])
                claim = f"f(G)[{where}] differs from f(G[{where}])"
                self.compare("batch consistency", out, o_basis[index], claim, symmetry, block=self.block[index])
        else:  # a single G: the inputs checked so far, stacked into a batch, map as they did alone
            names = ", ".join(name for name, *_ in calls)
            stacked = torch.stack([x for _, x, *_ in calls])
            out = self.call(stacked, f"f(stack([{names}]))")
            for j, (name, _, alone, u, v) in enumerate(calls):
                claim = f"f(stack([{names}]))[{j}] differs from f({name})"
                self.compare("batch consistency", self.in_basis(out[j], u, v), alone, claim, symmetry, stacked)

    def check_band(self, o: torch.Tensor, o_basis: torch.Tensor) -> None:
        lo, hi = self.band
        slack = self.tol.band
        response = torch.diagonal(o_basis, dim1=-2, dim2=-1)  # u_iᵀ f(G) v_i
        outside = self.well & ((response < lo - slack) | (response > hi + slack))
        if outside.any():
            index = tuple(int(i) for i in outside.nonzero()[0])
            raise self.violation(
                "singular value band",
                f"the direction with σ/‖G‖_F = {float(self.relative[index]):.6g} maps to u_iᵀ f(G) v_i = "
                f"{float(response[index]):.6g}, outside the band [{lo:.6g}, {hi:.6g}] (±{slack:g}); "
                f"every direction with σ/‖G‖_F >= {self.sigma_min:g} must land in it",
            )
        # where every nonzero σ is well-conditioned, no singular value of f(G) may exceed the band
        top = torch.linalg.svdvals(o.double())[self.covered].amax(-1)
        if (top > hi + slack).any():
            raise self.violation(
                "singular value band",
                f"f(G) has a singular value {float(top.max()):.6g} > {hi:.6g} (+{slack:g}) for a G whose "
                f"nonzero singular values all have σ/‖G‖_F >= {self.sigma_min:g}",
            )

    def check_rank(self, o: torch.Tensor) -> None:
        """``rank(G) <= rank(f(G)) <= rank(G as passed)``: every nonzero direction of the drawn G is
        kept, and no direction is made where the input ``fn`` was given has none.

        The input as passed is G rounded to its dtype: the rounding gives G's null space singular
        values of about ``eps·σ_max`` (fp32: ~1e-8 relative), which an exact polar factor sends to 1.
        Its rank is the numerical rank in fp64, as :func:`torch.linalg.matrix_rank` and
        :func:`muonfn.polar` count it: singular values above ``max(m, n)·eps₆₄·σ_max``. The lower
        bound holds only where every nonzero σ is well-conditioned, and so lands in the band, above
        the null space threshold.
        """
        threshold = self.tol.null_space
        rank_o = torch.linalg.matrix_rank(o.double(), atol=threshold)
        rank_passed = torch.linalg.matrix_rank(self.g.double())
        rank_g = (self.sp.s > 0).sum(-1)
        too_many = rank_o > rank_passed
        too_few = (rank_o < rank_g) & (bool(self.covered.all()) and self.band[0] - self.tol.band > threshold)
        if (too_many | too_few).any():
            index = tuple(int(i) for i in (too_many | too_few).nonzero()[0])
            where = f"G has rank {int(rank_g[index])}"
            if too_many[index]:
                values = [float(f"{x:.6g}") for x in torch.linalg.svdvals(self.g[index].double()).tolist()]
                where = (
                    f"G as passed, in {self.g.dtype}, has rank {int(rank_passed[index])} (singular values: {values})"
                )
            raise self.violation(
                "rank preservation",
                f"f(G) has rank {int(rank_o[index])} (singular values > {threshold:g}: "
                f"{[round(x, 6) for x in torch.linalg.svdvals(o[index].double()).tolist()]}) where {where}",
            )


def check_orthogonalizer(
    fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    band: tuple[float, float],
    dtype: torch.dtype = torch.float32,
    max_examples: int = 50,
    tolerances: Tolerances | None = None,
    sigma_min: float | None = None,
    max_side: int = 8,
    min_norm: float = 1e-5,
    skip: Collection[Invariant] = (),
) -> None:
    r"""Runs the invariant suite of an orthogonalizer ``fn: G -> O`` on matrices hypothesis draws.

    ``fn`` takes a tensor of shape ``(..., m, n)`` (leading dimensions a batch) and returns
    its approximate polar factor. The inputs are :func:`matrices` in ``dtype``: wide, tall,
    square and batched, up to ``max_side`` on a side, any of the spectrum kinds with
    condition numbers up to 1e6, sometimes rank-deficient, at the overall scales of
    :data:`DEFAULT_SCALES` from ``min_norm`` up (1e-3 … 1e30 as far as ``dtype`` holds them),
    contiguous, column-major or strided. For each, with :math:`G = U\Sigma V^\top` known exactly:

    - **no error**, **dtype and shape** (``O`` has ``G``'s), **input not mutated**,
      **finite output**: on every call below;
    - **singular value band**: every singular value of ``O`` is at most ``band[1]``, and every
      direction with :math:`\sigma_i \ge` ``sigma_min`` :math:`\cdot\|G\|_F` maps into ``band``:
      :math:`u_i^\top O v_i \in` ``band``;
    - **rank preservation** (fp32 and fp64 inputs only; 16-bit rounding noise in the null space
      is amplified to order 1): ``O`` has at most as many singular values above
      ``tolerances.null_space`` as ``G`` *as passed* has nonzero ones (in fp64, above
      :math:`\max(m, n)\,\epsilon_{64}\sigma_{max}`: rounding to fp32 gives a rank-deficient
      ``G`` singular values of about :math:`10^{-8}\sigma_{max}`, which an exact polar factor
      maps to 1), and at least as many as the drawn ``G`` has nonzero ones, where every nonzero
      :math:`\sigma_i` is above ``sigma_min`` :math:`\cdot\|G\|_F`;
    - **transpose symmetry**: :math:`f(G^\top) = f(G)^\top`;
    - **orthogonal equivariance**: :math:`f(Q_1 G Q_2^\top) = Q_1 f(G) Q_2^\top` for Haar-random
      orthogonal :math:`Q_1, Q_2`;
    - **scale invariance**: :math:`f(\alpha G) = f(G)` for one :math:`\alpha` drawn from 2, 1/2,
      3, 0.1, :math:`2^{\pm 10}` and, on every input, one of :math:`2^{\pm 100}` (the overflow
      range of fp32), among those that keep :math:`\|\alpha G\|_F \ge` ``min_norm`` and the
      entries representable;
    - **batch consistency**: each matrix of a batch maps as it does alone; a single ``G`` is
      stacked with its rotated and scaled copies.

    The equalities hold to ``tolerances`` on the well-conditioned block (see
    :class:`Tolerances`). Hypothesis runs derandomized, without deadline or database, so a
    check passes or fails the same way every time, and shrinks a failure to a small example.

    Args:
        fn: the orthogonalizer under test.
        band: ``(low, high)`` for the singular values of the output; for a Newton–Schulz
            schedule :func:`spectral_band` ``(coefficients, sigma_min=sigma_min)``, which
            holds exactly in exact arithmetic.
        dtype: the input dtype.
        max_examples: how many matrices to draw.
        tolerances: defaults :data:`TOLERANCES` ``[dtype]``.
        sigma_min: relative singular values :math:`\sigma/\|G\|_F` from here to 1 are the
            well-conditioned part (default :data:`SIGMA_MIN` ``[dtype]``: 1e-3, or 0.05 for
            16-bit inputs). Since :math:`\sigma_{max} \le \|G\|_F`, these directions also
            have :math:`\sigma/\sigma_{max} \ge` ``sigma_min``.
        max_side: the largest matrix side drawn.
        min_norm: the smallest :math:`\|G\|_F` drawn; below it orthogonalizers usually
            regularise (muonfn's ``eps=1e-7`` makes the map linear there).
        skip: invariants (names in :data:`INVARIANTS`) not to check.

    Returns:
        None; raises :class:`InvariantViolation` (an ``AssertionError``) naming the broken
        invariant, the shrunk input and the measured error.

    Example:
        >>> from functools import partial
        >>> ns = partial(muonfn.newton_schulz, coefficients="cesista", dtype=torch.float32)
        >>> muonfn.testing.check_orthogonalizer(
        ...     ns, band=muonfn.testing.spectral_band("cesista"), max_examples=10)
    """
    if dtype not in TOLERANCES and tolerances is None:
        raise ValueError(f"no default tolerances for {dtype}; pass tolerances=")
    tol = TOLERANCES[dtype] if tolerances is None else tolerances
    low_sigma = SIGMA_MIN.get(dtype, 0.05) if sigma_min is None else sigma_min
    lo, hi = (float(band[0]), float(band[1]))
    if not lo <= hi:
        raise ValueError(f"band must be (low, high) with low <= high, got {band!r}")
    if not 0 < low_sigma <= 1:
        raise ValueError(f"sigma_min must be in (0, 1], got {sigma_min!r}")
    if unknown := set(skip) - set(INVARIANTS):
        raise ValueError(f"unknown invariants in skip: {sorted(unknown)}; choose from {list(INVARIANTS)}")
    if not (isinstance(max_examples, int) and max_examples >= 1):
        raise ValueError(f"max_examples must be a positive integer, got {max_examples!r}")
    scales = [x for x in DEFAULT_SCALES if x >= min_norm]
    spectra = matrices(max_side=max_side, dtypes=dtype, condition_number=1e6, scales=scales)

    @settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),  # the drawn examples are slow and large by design
    )
    @given(_cases(spectra, min_norm))
    def check(case: _Case) -> None:
        _Run(fn, case, (lo, hi), low_sigma, tol).run(skip)

    check()
