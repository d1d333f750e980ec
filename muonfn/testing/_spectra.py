"""Matrices with a known singular value decomposition, and the hypothesis strategy that draws them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, TypeAlias, TypeVar, get_args

import torch
from hypothesis import strategies as st

ShapeKind: TypeAlias = Literal["wide", "tall", "square", "batched", "conv"]
SpectrumKind: TypeAlias = Literal["random", "geometric", "clustered", "equal", "gap"]
Layout: TypeAlias = Literal["contiguous", "transposed", "strided"]
SHAPE_KINDS: tuple[ShapeKind, ...] = get_args(ShapeKind)
SPECTRUM_KINDS: tuple[SpectrumKind, ...] = get_args(SpectrumKind)
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
T = TypeVar("T", bound=str)

#: Overall scales (the largest singular value) :func:`matrices` draws from, kept to those a dtype can hold.
DEFAULT_SCALES: tuple[float, ...] = (1e-30, 1e-12, 1e-3, 1.0, 37.0, 1e4, 1e12, 1e30)


class Spectral(NamedTuple):
    r"""A matrix (or a batch of them) together with its singular value decomposition.

    ``g.reshape(*batch, m, n)`` is :math:`U\,\mathrm{diag}(s)\,V^\top` (computed in fp64) rounded
    to ``g``'s dtype; ``batch = u.shape[:-2]``, ``m = u.shape[-1]``, ``n = v.shape[-1]``. For a
    conv-like ``g`` of shape ``(out, in, *kernel)`` the matrix is ``g.reshape(out, -1)``, as
    :class:`muonfn.linalg.MatrixView` sees it.

    Attributes:
        g: the matrix, in its drawn dtype and memory layout.
        u: ``(*batch, m, m)`` orthogonal, fp64; the columns past the rank span the left null space.
        s: ``(*batch, min(m, n))`` singular values, fp64, sorted in decreasing order, zeros last.
        v: ``(*batch, n, n)`` orthogonal, fp64; the columns past the rank span the right null space.
    """

    g: torch.Tensor
    u: torch.Tensor
    s: torch.Tensor
    v: torch.Tensor

    @property
    def rank(self) -> int:
        """The number of nonzero singular values (the largest over a batch)."""
        return int((self.s > 0).sum(-1).max()) if self.s.numel() else 0

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """The shape of the matrices ``g`` holds, ``(*batch, m, n)``."""
        return (*self.u.shape[:-2], self.u.shape[-1], self.v.shape[-1])

    def exact(self) -> torch.Tensor:
        """:math:`U\\,\\mathrm{diag}(s)\\,V^\\top` in fp64, of shape :attr:`matrix_shape` (``g`` before rounding)."""
        k = self.s.shape[-1]
        return (self.u[..., :k] * self.s.unsqueeze(-2)) @ self.v[..., :k].mT

    def __repr__(self) -> str:
        return (
            f"Spectral(g={str(self.g.dtype).removeprefix('torch.')}{list(self.g.shape)} {describe_layout(self.g)}, "
            f"matrices {list(self.matrix_shape)}, s={_rounded(self.s.tolist())})"
        )


def _rounded(values: float | list[Any]) -> str:
    """A number, or nested lists of numbers, each to 4 significant digits."""
    return f"{values:.4g}" if isinstance(values, float) else "[" + ", ".join(map(_rounded, values)) + "]"


def describe_layout(t: torch.Tensor) -> str:
    """``"contiguous"``, ``"transposed"`` (column-major) or ``"strided"`` with the strides."""
    if t.is_contiguous():
        return "contiguous"
    if t.permute(*reversed(range(t.ndim))).is_contiguous():
        return "transposed"
    return f"strided{tuple(t.stride())}"


def orthonormal_columns(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """A ``rows × cols`` fp64 matrix with orthonormal columns (``cols <= rows``), Haar-distributed.

    The QR factor of a Gaussian matrix with the signs of ``R``'s diagonal moved into ``Q``.

    Args:
        rows: number of rows.
        cols: number of columns, at most ``rows``.
        generator: the source of randomness.

    Returns:
        The fp64 matrix :math:`Q` with :math:`Q^\\top Q = I`.

    Example:
        >>> q = muonfn.testing.orthonormal_columns(5, 3, torch.Generator().manual_seed(0))
        >>> torch.allclose(q.mT @ q, torch.eye(3, dtype=torch.float64))
        True
    """
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=generator, dtype=torch.float64))
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)


def orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random ``n × n`` orthogonal matrix in fp64: :func:`orthonormal_columns` ``(n, n)``.

    Args:
        n: the size.
        generator: the source of randomness.

    Returns:
        The fp64 orthogonal matrix.

    Example:
        >>> u = muonfn.testing.orthogonal(4, torch.Generator().manual_seed(0))
        >>> torch.allclose(u @ u.mT, torch.eye(4, dtype=torch.float64))
        True
    """
    return orthonormal_columns(n, n, generator)


def with_spectrum(m: int, n: int, singular_values: Sequence[float], generator: torch.Generator) -> Spectral:
    """The ``m × n`` matrix :math:`U\\,\\mathrm{diag}(s)\\,V^\\top` with Haar-random ``U``, ``V``, in fp64.

    Args:
        m: rows.
        n: columns.
        singular_values: at most ``min(m, n)`` nonnegative values, in any order; the rest are zero.
        generator: the source of randomness for ``U`` and ``V``.

    Returns:
        A :class:`Spectral` whose ``s`` holds the values sorted in decreasing order, padded
        with zeros to ``min(m, n)``.

    Example:
        >>> sp = muonfn.testing.with_spectrum(3, 5, [2.0, 0.5], torch.Generator().manual_seed(0))
        >>> torch.linalg.svdvals(sp.g)[:2]
        tensor([2.0000, 0.5000], dtype=torch.float64)
        >>> sp.rank
        2
    """
    values = [float(x) for x in singular_values]
    k = min(m, n)
    if len(values) > k:
        raise ValueError(f"{len(values)} singular values do not fit a {m}×{n} matrix")
    if any(not (math.isfinite(x) and x >= 0) for x in values):
        raise ValueError(f"singular values must be finite and >= 0, got {values}")
    s = torch.tensor(sorted(values, reverse=True) + [0.0] * (k - len(values)), dtype=torch.float64)
    u, v = orthogonal(m, generator), orthogonal(n, generator)
    return Spectral((u[:, :k] * s) @ v[:, :k].T, u, s, v)


def fits(dtype: torch.dtype, largest: float) -> bool:
    """Whether ``dtype`` holds a matrix whose largest singular value is ``largest`` with full precision
    and room to spare."""
    info = torch.finfo(dtype)
    return info.tiny / info.eps <= largest <= info.max / 64


def _spectrum(draw: st.DrawFn, kind: SpectrumKind, rank: int, condition_number: float) -> list[float]:
    """``rank`` (at least 1) relative singular values in ``[1/condition_number, 1]``, the largest exactly 1."""
    decades = st.floats(0.0, math.log10(condition_number))
    if kind == "equal":
        values = [1.0] * rank
    elif kind == "geometric":
        values = [condition_number ** (-i / max(rank - 1, 1)) for i in range(rank)]
    elif kind == "gap":  # a well-conditioned block and a block at the smallest allowed value
        top = draw(st.integers(1, max(1, rank - 1)))
        values = [1.0] * top + [1 / condition_number] * (rank - top)
    elif kind == "clustered":  # around one or two levels, within a relative spread
        spread = draw(st.sampled_from([1e-8, 1e-4, 1e-2]))
        low = 10 ** -draw(decades)
        values = [(1.0 if draw(st.booleans()) else low) * (1 - spread * draw(st.floats(0.0, 1.0))) for _ in range(rank)]
    else:  # random: log-uniform
        values = [10.0 ** -draw(decades) for _ in range(rank)]
    top_value = max(values)
    return [max(x / top_value, 1 / condition_number) for x in values]


def _shape(draw: st.DrawFn, kind: ShapeKind, lo: int, hi: int) -> tuple[int, ...]:
    """A tensor shape of a shape kind whose matrix sides are in ``[lo, hi]``."""
    if kind == "square":
        return (draw(st.integers(lo, hi)),) * 2
    if kind in ("wide", "tall"):
        short = draw(st.integers(lo, hi - 1))
        long = draw(st.integers(short + 1, hi))
        return (short, long) if kind == "wide" else (long, short)
    if kind == "batched":
        batch = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
        return (*batch, draw(st.integers(lo, hi)), draw(st.integers(lo, hi)))
    # conv: (out, in, *kernel), seen as (out, in·∏kernel)
    out = draw(st.integers(lo, hi))
    kernel = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    least = max(1, -(-lo // math.prod(kernel)))  # so that in·∏kernel >= lo
    return (out, draw(st.integers(least, max(least, hi // 2))), *kernel)


def _laid_out(g: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout == "transposed":  # column-major: the same values, all strides reversed
        order = tuple(reversed(range(g.ndim)))
        return g.permute(order).contiguous().permute(order)
    if layout == "strided":  # every other element of a wider buffer whose gaps hold NaN
        return torch.stack([g, torch.full_like(g, math.nan)], dim=-1).flatten(-2)[..., ::2]
    return g.contiguous()


def matrices(
    *,
    shapes: Sequence[ShapeKind] = ("wide", "tall", "square", "batched"),
    min_side: int = 1,
    max_side: int = 8,
    dtypes: torch.dtype | Sequence[torch.dtype] = torch.float64,
    singular_values: Sequence[float] | None = None,
    condition_number: float = 1e3,
    spectra: Sequence[SpectrumKind] = SPECTRUM_KINDS,
    rank_deficient: bool | None = None,
    scales: Sequence[float] | None = None,
    layouts: Sequence[Layout] = LAYOUTS,
) -> st.SearchStrategy[Spectral]:
    r"""A hypothesis strategy for matrices with a controlled spectrum, drawn with their SVD.

    Each example is a :class:`Spectral`: ``g`` in one of ``dtypes`` and ``layouts``, and the
    fp64 ``u``, ``s``, ``v`` it was built from (``U``, ``V`` Haar-random). The spectrum is the
    overall scale (the largest singular value) times relative singular values of one of the
    ``spectra`` kinds:

    - ``"random"``: log-uniform in ``[1/condition_number, 1]``;
    - ``"geometric"``: evenly spaced in log scale from 1 down to ``1/condition_number``;
    - ``"clustered"``: around one or two levels, within a relative spread of 1e-8, 1e-4 or 1e-2;
    - ``"equal"``: all 1 (the polar factor times a scalar; see the oracle in :doc:`/formulas`);
    - ``"gap"``: some at 1, the rest at ``1/condition_number`` (tiny singular values).

    Shrinking moves towards small, square-ish, well-conditioned, contiguous examples.

    Args:
        shapes: kinds of shapes: ``"wide"`` (m < n), ``"tall"`` (m > n), ``"square"``,
            ``"batched"`` (one or two leading batch dimensions of size 1–3, each matrix with
            its own spectrum and the same rank) and ``"conv"`` (``(out, in, *kernel)`` with
            1–2 kernel dimensions; the spectrum is that of ``g.reshape(out, -1)``).
        min_side: the smallest matrix side.
        max_side: the largest matrix side (conv kernels: the largest ``out``; the flattened
            fan-in is at most about ``4.5 * max_side``).
        dtypes: a dtype or dtypes to draw from; ``g`` is the fp64 matrix rounded to it.
        singular_values: the nonzero singular values, fixed (relative: multiplied by the
            drawn scale, which with ``scales=None`` is 1); shapes are drawn with
            ``min(m, n) >= len(singular_values)`` and the rest are zero. Overrides
            ``spectra``, ``condition_number`` and ``rank_deficient``.
        condition_number: the largest ratio between two nonzero singular values.
        spectra: kinds of spectra to draw from.
        rank_deficient: ``True``: at least one zero singular value (``min(m, n) >= 2``);
            ``False``: none; ``None``: either.
        scales: overall scales to draw from (default :data:`DEFAULT_SCALES`, ``(1.0,)`` with
            explicit ``singular_values``); per dtype, only the scales whose largest singular
            value it holds with full precision (from ``finfo.tiny / finfo.eps`` to
            ``finfo.max / 64``): fp32 and bf16 keep all of 1e-30 … 1e30, fp16 only 1 and 37.
        layouts: ``"contiguous"``, ``"transposed"`` (column-major: every stride reversed) or
            ``"strided"`` (every other element of a wider buffer whose gaps hold NaN, which
            an implementation that ignores strides turns into NaN output).

    Returns:
        A strategy of :class:`Spectral`.

    Example:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=20, derandomize=True, deadline=None)
        ... @given(muonfn.testing.matrices(dtypes=torch.float32, condition_number=100.0))
        ... def test_norm_is_the_largest_singular_value(sp):
        ...     top = torch.linalg.matrix_norm(sp.g.double(), ord=2)
        ...     assert torch.allclose(top, sp.s[..., 0], rtol=1e-5)
        >>> test_norm_is_the_largest_singular_value()
    """
    kinds = selection("shapes", shapes, SHAPE_KINDS)
    spectrum_kinds = selection("spectra", spectra, SPECTRUM_KINDS)
    layout_kinds = selection("layouts", layouts, LAYOUTS)
    dtype_list = float_dtypes(dtypes)
    if not (isinstance(condition_number, int | float) and 1 <= condition_number < math.inf):
        raise ValueError(f"condition_number must be finite and >= 1, got {condition_number!r}")
    fixed = None
    if singular_values is not None:
        if rank_deficient is not None:
            raise ValueError("pass singular_values or rank_deficient, not both")
        fixed = sorted((float(x) for x in singular_values), reverse=True)
        if any(not (math.isfinite(x) and x > 0) for x in fixed):
            raise ValueError(f"singular_values must be finite and > 0 (zeros are implied), got {singular_values!r}")
    lo = max(min_side, 2 if rank_deficient else 1, len(fixed) if fixed else 1)
    if fixed and "conv" in kinds:
        raise ValueError("explicit singular_values are for matrix shapes, not conv kernels")
    if max_side < lo or (max_side == lo and set(kinds) <= {"wide", "tall"}):
        raise ValueError(f"no {list(kinds)} shape has sides in [{lo}, {max_side}]")
    scale_list = list(scales) if scales is not None else ([1.0] if fixed else list(DEFAULT_SCALES))
    feasible = {d: [x for x in scale_list if fits(d, x)] for d in dtype_list}
    if unfit := [d for d, usable in feasible.items() if not usable]:
        raise ValueError(f"none of the scales {scale_list} fits {unfit[0]}")

    @st.composite
    def draw_matrix(draw: st.DrawFn) -> Spectral:
        kind = draw(st.sampled_from([k for k in kinds if k not in ("wide", "tall") or max_side > lo]))
        shape = _shape(draw, kind, lo, max_side)
        *batch, m, n = (shape[0], math.prod(shape[1:])) if kind == "conv" else shape
        k = min(m, n)
        # (explicit singular values fix the rank: nothing is drawn for it)
        deficient = fixed is None and (draw(st.booleans()) if rank_deficient is None and k > 1 else rank_deficient)
        rank = draw(st.integers(1, k - 1)) if deficient else k
        spectrum_kind = draw(st.sampled_from(spectrum_kinds))
        dtype = draw(st.sampled_from(dtype_list))
        scale = draw(st.sampled_from(feasible[dtype]))
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        members = []  # each matrix of a batch with its own spectrum
        for _ in range(math.prod(batch)):
            relative = fixed if fixed is not None else _spectrum(draw, spectrum_kind, rank, condition_number)
            members.append(with_spectrum(m, n, [scale * x for x in relative], generator))
        exact, u, s, v = (torch.stack(parts).reshape(*batch, *parts[0].shape) for parts in zip(*members, strict=True))
        return Spectral(_laid_out(exact.reshape(shape).to(dtype), draw(st.sampled_from(layout_kinds))), u, s, v)

    return draw_matrix()


def selection(name: str, given: Sequence[T], allowed: Sequence[T]) -> list[T]:
    """``given`` (one choice or several) as a list, refused unless a non-empty selection of ``allowed``."""
    chosen: list[T] = [given] if isinstance(given, str) else list(given)  # type: ignore[list-item]
    if not chosen or any(x not in allowed for x in chosen):
        raise ValueError(f"{name} must be a non-empty selection of {list(allowed)}, got {given!r}")
    return chosen


def float_dtypes(dtypes: torch.dtype | Sequence[torch.dtype]) -> list[torch.dtype]:
    """``dtypes`` (one or several) as a list, refused unless all are real floating-point dtypes."""
    dtype_list = [dtypes] if isinstance(dtypes, torch.dtype) else list(dtypes)
    if not dtype_list or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtype_list):
        raise ValueError(f"dtypes must be real floating-point torch dtypes, got {dtypes!r}")
    return dtype_list
