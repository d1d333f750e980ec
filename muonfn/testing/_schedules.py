r"""Coefficient schedules as scalar maps: the composed polynomial, its exact range, and a strategy.

Newton–Schulz maps every singular value of :math:`X_0 = G / (c\|G\|_F)` through the odd
quintics :math:`p_k(x) = a_k x + b_k x^3 + c_k x^5` in turn; everything here is about that
composition on the relative singular values :math:`\sigma / \|G\|_F \in (0, 1]`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce
from typing import TypeVar

import torch
from hypothesis import strategies as st

from ..linalg import COEFFICIENTS, Coefficients, CoefficientsLike, Triple, ns_schedule
from ._spectra import selection

T = TypeVar("T", float, torch.Tensor)


def _quintic(x: T, t: Triple) -> T:
    """:math:`p(x) = a x + b x^3 + c x^5`, of a float or elementwise; ``x`` first, so that
    :func:`functools.reduce` composes the steps."""
    a, b, c = t
    y = x * x
    return x * (a + y * (b + c * y))


def _critical_points(t: Triple) -> list[float]:
    """Real zeros of :math:`p'(x) = a + 3b x^2 + 5c x^4`, both signs."""
    a, b, c = t
    disc = 9 * b * b - 20 * a * c
    if disc < 0:
        return []
    # the roots y = x² of 5c·y² + 3b·y + a = 0 in their numerically stable form, which also holds for c = 0
    # (then only a/q is one) and gives none for b = c = 0 (q = 0)
    q = -0.5 * (3 * b + math.copysign(math.sqrt(disc), b))
    squares = ([q / (5 * c)] if c else []) + ([a / q] if q else [])
    return [sign * math.sqrt(y) for y in squares if y > 0 for sign in (1.0, -1.0)]


def spectral_band(
    coefficients: CoefficientsLike, steps: int | None = None, *, sigma_min: float = 1e-3
) -> tuple[float, float]:
    r"""The interval a Newton–Schulz schedule maps relative singular values in ``[sigma_min, 1]`` into.

    Exact, up to fp64 rounding of a few polynomial evaluations: the interval
    :math:`[\sigma_{min}/c, 1/c]` (``c`` the schedule's ``norm_factor``, as
    :func:`muonfn.newton_schulz` divides by :math:`c\|G\|_F`) is propagated through each step.
    The image of an interval under a continuous :math:`p_k` is the interval between the
    smallest and the largest of :math:`p_k` at its ends and at the critical points of
    :math:`p_k` inside it (the real roots of :math:`a + 3b x^2 + 5c x^4`, a quadratic in
    :math:`x^2`); the image of the image is then exactly the range of the composition.

    This is the worst case over every relative singular value in the interval; a particular
    matrix uses only part of it (a 256×1024 Gaussian has :math:`\sigma/\|G\|_F` in about
    [0.03, 0.09]), so its measured band is narrower. The table on :doc:`/formulas` lists
    the built-in sets.

    Args:
        coefficients: a schedule name, a :class:`muonfn.Coefficients` or ``(a, b, c)`` triples.
        steps: stretch or truncate the schedule, as :func:`muonfn.newton_schulz` does.
        sigma_min: the smallest relative singular value :math:`\sigma / \|G\|_F` covered, in (0, 1].

    Returns:
        ``(low, high)``: the smallest and largest value of the composed map on ``[sigma_min, 1]``.

    Example:
        >>> lo, hi = muonfn.testing.spectral_band("keller", sigma_min=0.01)
        >>> round(lo, 4), round(hi, 4)
        (0.6818, 1.1344)
    """
    schedule = ns_schedule(coefficients, steps)
    if isinstance(sigma_min, bool) or not isinstance(sigma_min, int | float) or not 0 < sigma_min <= 1:
        raise ValueError(f"sigma_min must be in (0, 1], got {sigma_min!r}")
    lo, hi = sigma_min / schedule.norm_factor, 1.0 / schedule.norm_factor
    for t in schedule.triples:  # the image of [lo, hi]: p at its ends and at the critical points inside
        values = [_quintic(x, t) for x in (lo, hi, *(x for x in _critical_points(t) if lo < x < hi))]
        lo, hi = min(values), max(values)
    return lo, hi


def scalar_map(
    coefficients: CoefficientsLike,
    steps: int | None = None,
    *,
    sigma: torch.Tensor | Sequence[float] | float | None = None,
) -> torch.Tensor:
    r"""Tabulates the composed scalar map :math:`p_K \circ \dots \circ p_1(\sigma / c)` in fp64.

    What a schedule does to a singular value :math:`\sigma` of :math:`G` with
    :math:`\|G\|_F = 1` (``c`` the schedule's ``norm_factor``): for any ``G``, the singular
    values of ``newton_schulz(G)`` are ``scalar_map(..., sigma=svdvals(G) / ||G||_F)`` up to
    rounding.

    Args:
        coefficients: a schedule name, a :class:`muonfn.Coefficients` or ``(a, b, c)`` triples.
        steps: stretch or truncate the schedule, as :func:`muonfn.newton_schulz` does.
        sigma: where to evaluate (default: 1001 points evenly spaced on [0, 1]).

    Returns:
        An fp64 tensor of ``sigma``'s shape.

    Example:
        >>> muonfn.testing.scalar_map("polar_express", sigma=[0.001, 0.1, 1.0])
        tensor([1.0000, 1.0000, 1.0000], dtype=torch.float64)
    """
    schedule = ns_schedule(coefficients, steps)
    x = torch.linspace(0.0, 1.0, 1001, dtype=torch.float64) if sigma is None else sigma
    return reduce(_quintic, schedule.triples, torch.as_tensor(x, dtype=torch.float64) / schedule.norm_factor)


def coefficient_schedules(
    *,
    bases: Sequence[str] | None = None,
    perturbation: float = 0.02,
    steps: tuple[int, int] | None = None,
    sigma_min: float = 1e-3,
    band: tuple[float, float] = (0.3, 1.5),
) -> st.SearchStrategy[Coefficients]:
    r"""A hypothesis strategy for Newton–Schulz schedules: perturbations of the built-in ones.

    Each example starts from one of ``bases``, multiplies every coefficient by its own factor
    in ``[1 - perturbation, 1 + perturbation]``, optionally changes the number of steps (as
    :func:`muonfn.linalg.ns_schedule` does: truncate, or repeat the last triple) and keeps
    the base's ``norm_factor``. Only *valid* schedules are drawn: every step's slope at zero
    :math:`a_k` is positive (as in every base, and the factors are positive), and the composition
    maps ``[sigma_min, 1]`` into ``band`` (by :func:`spectral_band`), so the iteration neither
    flips nor loses nor blows up a singular value. Shrinking moves towards the unperturbed base.

    Args:
        bases: names in :data:`muonfn.COEFFICIENTS` to start from (default: all).
        perturbation: the largest relative change of a coefficient.
        steps: ``(min, max)`` number of steps (default: the base's own).
        sigma_min: the smallest relative singular value the schedule must handle.
        band: ``(low, high)`` that the schedule's :func:`spectral_band` must lie inside.

    Returns:
        A strategy of :class:`muonfn.Coefficients`.

    Example:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=10, derandomize=True)
        ... @given(muonfn.testing.coefficient_schedules(bases=["cesista"]))
        ... def test_band(schedule):
        ...     lo, hi = muonfn.testing.spectral_band(schedule)
        ...     assert 0.3 <= lo <= hi <= 1.5
        >>> test_band()
    """
    names = sorted(COEFFICIENTS) if bases is None else selection("bases", bases, sorted(COEFFICIENTS))
    if not (isinstance(perturbation, int | float) and 0 <= perturbation < 1):
        raise ValueError(f"perturbation must be in [0, 1), got {perturbation!r}")
    if steps is not None and not (1 <= steps[0] <= steps[1]):
        raise ValueError(f"steps must be (min, max) with 1 <= min <= max, got {steps!r}")
    if not 0 < band[0] <= 1 <= band[1]:
        raise ValueError(f"band must contain 1 and be positive, got {band!r}")

    def valid(schedule: Coefficients) -> bool:
        lo, hi = spectral_band(schedule, sigma_min=sigma_min)
        return band[0] <= lo and hi <= band[1]

    factor = st.floats(-perturbation, perturbation).map(lambda x: 1.0 + x)

    @st.composite
    def draw_schedule(draw: st.DrawFn) -> Coefficients:
        base = ns_schedule(draw(st.sampled_from(names)), None if steps is None else draw(st.integers(*steps)))
        triples = tuple((a * draw(factor), b * draw(factor), c * draw(factor)) for a, b, c in base.triples)
        return base._replace(triples=triples)  # (and the base's norm_factor)

    return draw_schedule().filter(valid)
