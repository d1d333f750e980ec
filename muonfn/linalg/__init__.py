"""Linear algebra: Newton–Schulz, the polar factor, matrix views and batching.

Plain tensors only: no TensorDicts, no ranks. Everything above (transforms, presets,
the shim, the distributed strategies) builds on this layer.
"""

from ._coefficients import COEFFICIENTS, Coefficients, CoefficientsLike, Triple, ns_schedule
from ._newton_schulz import (
    CPU_BF16_MIN_WORK,
    EPS_MODES,
    NS_METHODS,
    EpsMode,
    NewtonSchulz,
    NSMethod,
    Reduction,
    cpu_has_bf16_units,
    default_ns_dtype,
    default_restarts,
    gram_newton_schulz,
    gram_newton_schulz_flops,
    newton_schulz,
    newton_schulz_columns,
    newton_schulz_flops,
    polar,
    qr_orthogonal,
)
from ._orthogonalizer import (
    DEFAULT_BUCKET_NUMEL,
    LocalOrthogonalizer,
    MatrixFn,
    Orthogonalizer,
    check_bucket_numel,
    orthogonalize_blocks,
)
from ._views import DEFAULT_VIEW, SCALE_MODES, MatrixView, ScaleFn, ScaleMode, block_scales, shape_scale

__all__ = [
    "COEFFICIENTS",
    "CPU_BF16_MIN_WORK",
    "DEFAULT_BUCKET_NUMEL",
    "DEFAULT_VIEW",
    "EPS_MODES",
    "NS_METHODS",
    "SCALE_MODES",
    "Coefficients",
    "CoefficientsLike",
    "EpsMode",
    "LocalOrthogonalizer",
    "MatrixFn",
    "MatrixView",
    "NSMethod",
    "NewtonSchulz",
    "Orthogonalizer",
    "Reduction",
    "ScaleFn",
    "ScaleMode",
    "Triple",
    "block_scales",
    "check_bucket_numel",
    "cpu_has_bf16_units",
    "default_ns_dtype",
    "default_restarts",
    "gram_newton_schulz",
    "gram_newton_schulz_flops",
    "newton_schulz",
    "newton_schulz_columns",
    "newton_schulz_flops",
    "ns_schedule",
    "orthogonalize_blocks",
    "polar",
    "qr_orthogonal",
    "shape_scale",
]
