r"""Newton–Schulz orthogonalization and the exact polar factor.

For :math:`G = U \Sigma V^\top` the polar factor is :math:`U V^\top`. Newton–Schulz
approximates it without an SVD: normalise :math:`X_0 = G / \max(c\,\|G\|_F, \varepsilon)`
(so every singular value lies in [0, 1]), then iterate the odd quintic

.. math::  X_{k+1} = a_k X_k + (b_k A + c_k A^2) X_k, \qquad A = X_k X_k^\top,

which maps each singular value through :math:`p_k(\sigma) = a_k\sigma + b_k\sigma^3 + c_k\sigma^5`
while leaving the singular vectors alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeAlias

import torch

Triple = tuple[float, float, float]


class Coefficients(NamedTuple):
    """A Newton–Schulz schedule: one ``(a, b, c)`` triple per step.

    ``norm_factor`` multiplies the Frobenius norm used to normalise the input
    (a safety margin so that rounding cannot push a singular value above 1).
    """

    triples: tuple[Triple, ...]
    norm_factor: float = 1.0


CoefficientsLike: TypeAlias = str | Coefficients | Sequence[Sequence[float]]

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
    """Resolves a named or custom schedule and stretches it to ``steps``.

    A schedule runs its triples in order: fewer steps truncate it, more repeat its last
    triple, so ``[(a, b, c)]`` with ``steps=5`` is torch.optim.Muon's iteration.
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"Newton–Schulz steps must be an integer >= 1, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENTS:
            raise ValueError(
                f"unknown Newton–Schulz coefficient set {coefficients!r}; "
                f"choose one of {sorted(COEFFICIENTS)} or pass (a, b, c) triples"
            )
        schedule = COEFFICIENTS[coefficients]
    elif isinstance(coefficients, Coefficients):
        schedule = Coefficients(tuple(_triple(t, coefficients) for t in coefficients.triples), coefficients.norm_factor)
    elif _is_number_triple(coefficients):
        raise ValueError(
            f"Newton–Schulz coefficients {coefficients!r} are one (a, b, c), not a schedule: pass "
            "[(a, b, c)] with steps=5 (torch.optim.Muon's ns_coefficients and ns_steps)"
        )
    else:
        schedule = Coefficients(tuple(_triple(t, coefficients) for t in coefficients))
    if not schedule.triples:
        raise ValueError("Newton–Schulz coefficients need at least one (a, b, c) triple")
    if not (isinstance(schedule.norm_factor, int | float) and 0 < schedule.norm_factor < math.inf):
        raise ValueError(f"Newton–Schulz norm_factor must be finite and > 0, got {schedule.norm_factor!r}")
    if steps is None:
        return schedule
    triples = schedule.triples[:steps] + (schedule.triples[-1],) * max(0, steps - len(schedule.triples))
    return schedule._replace(triples=triples)


def _is_number_triple(t: object) -> bool:
    return isinstance(t, Sequence) and len(t) == 3 and all(isinstance(v, int | float) for v in t)


def _triple(t: Any, given: object) -> Triple:
    if not (_is_number_triple(t) and all(math.isfinite(v) for v in t)):
        raise ValueError(f"Newton–Schulz coefficients must be finite (a, b, c) triples, got {given!r}")
    return float(t[0]), float(t[1]), float(t[2])


def default_ns_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """bf16 on CUDA (tensor cores); on other devices the input's dtype, at least fp32.

    CPUs without bf16 units run bf16 matmuls about 100× slower than fp32.
    """
    if device.type == "cuda":
        return torch.bfloat16
    return torch.promote_types(dtype, torch.float32)


def newton_schulz(
    x: torch.Tensor,
    coefficients: CoefficientsLike = "keller",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""Approximately orthogonalizes every matrix in ``x`` of shape ``(..., m, n)``.

    Leading dimensions are a batch. The input is normalised by its Frobenius norm over
    the last two dimensions, :math:`X_0 = G / \max(c\|G\|_F, \varepsilon)`, in at least
    fp32, and only then cast to ``dtype`` (``None``: bf16 on CUDA; elsewhere fp32, or
    fp64 for fp64 inputs). The iteration runs on the wide orientation (``m <= n``; tall inputs are
    transposed and transposed back), so :math:`A = XX^\top` is the small Gram matrix.

    Exact properties: ``f(-G) = -f(G)``, ``f(0) = 0``, ``f(2**k G) = f(G)`` for
    ``||G|| >= eps``, ``f(G.mT) = f(G).mT`` for non-square ``G``; on CPU a batch equals its matrices one by one
    wherever the BLAS itself is batch-invariant. Returns ``x.dtype``; never modifies ``x``.

    Args:
        x: a tensor with at least two dimensions.
        coefficients: ``"keller"``, ``"cesista"``, ``"polar_express"``, a
            :class:`Coefficients`, or a sequence of ``(a, b, c)`` triples.
        steps: number of iterations (default: the schedule's length).
        eps: lower bound of the normalising norm; must be positive.
        dtype: dtype of the iteration's matmuls.
    """
    schedule = ns_schedule(coefficients, steps)
    X, tall = normalized_wide("newton_schulz", x, schedule, eps, dtype)
    for a, b, c in schedule.triples:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return restore_layout(X, x, tall)


def normalized_wide(
    name: str, x: torch.Tensor, schedule: Coefficients, eps: float, dtype: torch.dtype | None
) -> tuple[torch.Tensor, bool]:
    """The preamble of every Newton–Schulz variant: checks, then ``x`` as a contiguous
    ``(count, m, n)`` batch in the wide orientation (``m <= n``; ``tall`` says whether it was
    transposed), divided by ``max(c‖x‖_F, eps)`` in at least fp32 and cast to the iteration dtype.
    """
    if not (isinstance(eps, int | float) and eps > 0):
        raise ValueError(f"Newton–Schulz eps must be > 0, got {eps!r}")
    if x.ndim < 2:
        raise ValueError(f"{name} needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} needs a real floating-point tensor, got {x.dtype}")
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"Newton–Schulz dtype must be a real floating-point dtype, got {dtype}")
    wide_dtype = torch.promote_types(x.dtype, torch.float32)
    ns_dtype = default_ns_dtype(x.device, x.dtype) if dtype is None else dtype
    # iterate on the wide orientation, where A = XXᵀ is the small Gram matrix; decided by
    # shape alone, so the result depends on values only, never on memory layout
    tall = x.size(-2) > x.size(-1)
    g = x.mT if tall else x
    m, n = g.shape[-2:]
    # one memory layout for every input: the matmuls and the norm round the same way whatever the strides
    g = g.reshape(g.shape[:-2].numel(), m, n).to(wide_dtype).contiguous()
    norm = torch.linalg.matrix_norm(g, keepdim=True)
    if schedule.norm_factor != 1.0:
        norm = norm * schedule.norm_factor
    return (g / norm.clamp_min(eps)).to(ns_dtype), tall


def restore_layout(X: torch.Tensor, x: torch.Tensor, tall: bool) -> torch.Tensor:
    """Inverse of :func:`normalized_wide`'s reshaping: ``x``'s dtype, batch shape and orientation."""
    out = X.to(x.dtype).reshape(*x.shape[:-2], *X.shape[-2:])
    return out.mT if tall else out


def polar(x: torch.Tensor) -> torch.Tensor:
    r"""The exact polar factor :math:`U_r V_r^\top` of every matrix in ``x`` (via SVD, in fp64).

    Singular directions with :math:`\sigma \le \max(m, n)\,\epsilon_{64}\,\sigma_{max}` count
    as the null space and map to zero, so rank-deficient inputs give a partial isometry.
    The reference for tests and diagnostics; returns ``x.dtype``.
    """
    if x.ndim < 2:
        raise ValueError(f"polar needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    u, s, vh = torch.linalg.svd(x.to(torch.float64), full_matrices=False)
    tol = max(x.shape[-2:]) * torch.finfo(torch.float64).eps * s.amax(dim=-1, keepdim=True)
    keep = (s > tol).to(torch.float64)
    return ((u * keep.unsqueeze(-2)) @ vh).to(x.dtype)
