"""Property-based testing of orthogonalizers and Newton–Schulz schedules.

For people who write their own: a fused or sharded Newton–Schulz kernel, a low-precision
variant, a tuned coefficient schedule. :func:`check_orthogonalizer` runs muonfn's invariant
suite against any callable ``G -> O``; :func:`matrices`, :func:`coefficient_schedules` and
:func:`model_params` are the hypothesis strategies muonfn's own tests use;
:func:`spectral_band` and :func:`scalar_map` compute what a schedule does to a singular value.
:func:`simulate` runs distributed code on virtual ranks (threads) over :class:`SimulatedCollectives`,
which exchange real data, optionally over a modelled :class:`Link`. See :doc:`/testing`.

Needs `hypothesis <https://hypothesis.readthedocs.io>`_: ``pip install muonfn[testing]``.
"""

try:
    import hypothesis  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess
    raise ImportError("muonfn.testing needs hypothesis, an optional dependency: pip install 'muonfn[testing]'") from e

from ._checks import (
    INVARIANTS,
    SIGMA_MIN,
    TOLERANCES,
    Invariant,
    InvariantViolation,
    Tolerances,
    check_orthogonalizer,
)
from ._models import MODEL_KINDS, ModelKind, model_params
from ._schedules import coefficient_schedules, scalar_map, spectral_band
from ._simulate import Link, SimulatedCollectives, simulate
from ._spectra import (
    DEFAULT_SCALES,
    LAYOUTS,
    SHAPE_KINDS,
    SPECTRUM_KINDS,
    Layout,
    ShapeKind,
    Spectral,
    SpectrumKind,
    matrices,
    orthogonal,
    orthonormal_columns,
    with_spectrum,
)

__all__ = [
    "DEFAULT_SCALES",
    "INVARIANTS",
    "LAYOUTS",
    "MODEL_KINDS",
    "SHAPE_KINDS",
    "SIGMA_MIN",
    "SPECTRUM_KINDS",
    "TOLERANCES",
    "Invariant",
    "InvariantViolation",
    "Layout",
    "Link",
    "ModelKind",
    "ShapeKind",
    "SimulatedCollectives",
    "Spectral",
    "SpectrumKind",
    "Tolerances",
    "check_orthogonalizer",
    "coefficient_schedules",
    "matrices",
    "model_params",
    "orthogonal",
    "orthonormal_columns",
    "scalar_map",
    "simulate",
    "spectral_band",
    "with_spectrum",
]
