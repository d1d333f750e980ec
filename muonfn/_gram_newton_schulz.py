r"""Gram Newton–Schulz: the same polynomial iteration, run on the small Gram matrix.

Every Newton–Schulz iterate is a polynomial in :math:`R_0 = X_0 X_0^\top` applied to
:math:`X_0`, :math:`X_k = Q_k X_0`. For a wide :math:`m\times n` matrix (:math:`m \le n`)
the iteration can therefore be carried by the two :math:`m\times m` matrices
:math:`Q_k` and :math:`R_k = X_k X_k^\top`:

.. math::  P_k = a_k I + b_k R_k + c_k R_k^2, \qquad
           Q_{k+1} = P_k Q_k, \qquad R_{k+1} = P_k R_k P_k,

and :math:`X_K = Q_K X_0` is formed once at the end. Only the first Gram matrix and the
last product touch the long side :math:`n`.

Cost for 5 steps with one restart (below): :math:`8m^2n + 28m^3` flops against
:math:`20m^2n + 10m^3` for the standard iteration, fewer once :math:`n > 1.5\,m`
(with the two restarts used in 16-bit dtypes :math:`12m^2n + 22m^3`, the same crossover).

Rounding errors in :math:`R_k` are not corrected by the iteration the way errors in
:math:`X_k` are (the standard iteration recomputes :math:`X_kX_k^\top` from the iterate it
holds), so the Gram matrix drifts away from the iterate it describes. Worse, rounding can
give :math:`R_k` slightly negative eigenvalues :math:`-\delta`, which the map
:math:`r \mapsto r\,(a + br + cr^2)^2` amplifies by about :math:`a^2` a step instead of
damping (in bf16 :math:`\delta \sim 10^{-3}`, and five Keller steps multiply it by
:math:`2\cdot 10^5`). A *restart* re-forms :math:`X_k = Q_k X_0`, recomputes the positive
semi-definite :math:`R_k = X_kX_k^\top` and resets :math:`Q_k = I` (:math:`4m^2n` flops).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._newton_schulz import (
    CoefficientsLike,
    default_ns_dtype,
    newton_schulz,
    normalized_wide,
    ns_schedule,
    restore_layout,
)


def default_restarts(steps: int, dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
    """A restart before every third step in fp32/fp64 (``(3,)`` for 5 steps, ``(3, 6)`` for 8),
    every second in 16-bit dtypes (``(2, 4)``, ``(2, 4, 6)``).

    Measured on 32×128 to 256×1024 matrices with Gaussian, geometric (1 … 1e-8),
    and low-rank spectra: in fp32 the error stays within 3× that of the standard iteration;
    in bf16/fp16 within 3× as well, where restarting every third step let the 8-step
    ``"polar_express"`` schedule (first slope 8.2) overflow to NaN in bf16.
    Both keep the crossover with the standard iteration's flops at ``n ≈ 1.5 m``.
    """
    every = 2 if dtype.itemsize <= 2 else 3
    return tuple(range(every, steps, every))


def _check_restarts(restarts: Sequence[int], steps: int) -> tuple[int, ...]:
    out = tuple(restarts)
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 < r < steps:
            raise ValueError(f"Gram Newton–Schulz restarts must be step indices in [1, {steps - 1}], got {restarts!r}")
    return tuple(sorted(set(out)))


def gram_newton_schulz(
    x: torch.Tensor,
    coefficients: CoefficientsLike = "keller",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    restarts: Sequence[int] | None = None,
) -> torch.Tensor:
    r"""Approximately orthogonalizes every matrix in ``x`` of shape ``(..., m, n)`` via its Gram matrix.

    The same map as :func:`muonfn.newton_schulz` (same arguments, normalisation, dtypes,
    orientation and exact properties: ``f(-G) = -f(G)``, ``f(0) = 0``,
    ``f(2**k G) = f(G)``, ``f(G.mT) = f(G).mT`` for non-square ``G``), computed through the
    ``m×m`` Gram matrix of the wide orientation; equal to it up to rounding. Cheaper than
    the standard iteration once the long side exceeds about 1.5× the short one.

    Args:
        restarts: step indices (0-based) before which the iterate is re-formed and the
            Gram matrix recomputed (default: every third step, every second in 16-bit
            dtypes; see :func:`default_restarts`); ``()`` for none.
    """
    schedule = ns_schedule(coefficients, steps)
    X, tall = normalized_wide("gram_newton_schulz", x, schedule, eps, dtype)
    num_steps = len(schedule.triples)
    restart_at = _check_restarts(default_restarts(num_steps, X.dtype) if restarts is None else restarts, num_steps)

    R = torch.bmm(X, X.mT)
    Q: torch.Tensor | None = None  # the identity
    for k, (a, b, c) in enumerate(schedule.triples):
        if k in restart_at:
            if Q is not None:
                X = torch.bmm(Q, X)
                Q = None
            R = torch.bmm(X, X.mT)
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else torch.bmm(P, Q)
        if k + 1 < num_steps and k + 1 not in restart_at:
            R = torch.bmm(P, torch.bmm(R, P))
    if Q is not None:
        X = torch.bmm(Q, X)
    return restore_layout(X, x, tall)


def newton_schulz_flops(m: int, n: int, steps: int) -> float:
    """Flops of ``steps`` standard quintic steps on an m×n matrix: ``steps·(4m²n + 2m³)``, m ≤ n."""
    m, n = min(m, n), max(m, n)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def gram_newton_schulz_flops(
    m: int, n: int, steps: int, restarts: Sequence[int] | None = None, dtype: torch.dtype = torch.float32
) -> float:
    """Flops of :func:`gram_newton_schulz` on an m×n matrix: ``8m²n + 28m³`` for 5 steps in
    fp32 (one restart), ``12m²n + 22m³`` in 16-bit dtypes (two)."""
    m, n = min(m, n), max(m, n)
    restart_at = _check_restarts(default_restarts(steps, dtype) if restarts is None else restarts, steps)
    wide, square = 2.0 * m * m * n, 2.0 * m**3
    total, q_is_identity = wide, True  # R = XXᵀ
    for k in range(steps):
        if k in restart_at:
            total += wide if q_is_identity else 2 * wide  # (X = QX,) R = XXᵀ
            q_is_identity = True
        total += square if q_is_identity else 2 * square  # R², (PQ)
        q_is_identity = False
        if k + 1 < steps and k + 1 not in restart_at:
            total += 2 * square  # PRP
    return total + wide  # X = QX


NS_METHODS = ("standard", "gram")


def _gram_where_cheaper(
    x: torch.Tensor,
    coefficients: CoefficientsLike = "keller",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    num_steps = len(ns_schedule(coefficients, steps).triples)
    m, n = x.shape[-2:]
    ns_dtype = default_ns_dtype(x.device, x.dtype) if dtype is None else dtype
    if gram_newton_schulz_flops(m, n, num_steps, dtype=ns_dtype) < newton_schulz_flops(m, n, num_steps):
        return gram_newton_schulz(x, coefficients, steps, eps, dtype)
    return newton_schulz(x, coefficients, steps, eps, dtype)


def select_newton_schulz(method: str) -> Callable[..., torch.Tensor]:
    """The orthogonalizer of an ``ns_method``: ``"standard"`` is :func:`muonfn.newton_schulz`;
    ``"gram"`` is :func:`gram_newton_schulz` for the shapes where it needs fewer flops (the
    long side over about 1.5× the short one for 5 steps), the standard iteration elsewhere."""
    if method == "standard":
        return newton_schulz
    if method == "gram":
        return _gram_where_cheaper
    raise ValueError(f"unknown ns_method {method!r}; choose one of {list(NS_METHODS)}")
