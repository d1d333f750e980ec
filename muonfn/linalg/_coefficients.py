r"""Newton–Schulz coefficient schedules: one ``(a, b, c)`` triple per step.

Step :math:`k` maps every singular value through :math:`p_k(\sigma) = a_k\sigma + b_k\sigma^3 + c_k\sigma^5`;
the schedule is the composition. Measured bands (256×1024 Gaussian, fp32) are on the formulas page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeAlias

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
    elif isinstance(coefficients, bytes) or not isinstance(coefficients, Sequence):
        raise TypeError(
            f"Newton–Schulz coefficients must be a set name ({', '.join(map(repr, sorted(COEFFICIENTS)))}), "
            f"a Coefficients or a sequence of (a, b, c) triples, got {coefficients!r}"
        )
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
