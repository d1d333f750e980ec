"""muonfn: Muon as pure functions over TensorDicts.

``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``
implement momentum, Newton–Schulz and AdamW as composable transforms; a
``torch.optim`` shim lives in :mod:`muonfn.optim`, distributed layouts in
:mod:`muonfn.distributed`.
"""

from ._base import Transform, apply_updates
from ._checkpoint import load, save
from ._combinators import apply_if_finite, chain, masked, named, partition
from ._labels import DEFAULT_EXCLUDE, label_params, labels_from_module, views_from_module
from ._newton_schulz import COEFFICIENTS, Coefficients, newton_schulz, polar
from ._presets import adamw, muon
from ._transforms import (
    add_decayed_weights,
    ema_momentum,
    orthogonalize,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_muon,
    scale_by_shape,
)
from ._views import SCALE_MODES, MatrixView

__version__ = "0.1.0"

__all__ = [
    "COEFFICIENTS",
    "DEFAULT_EXCLUDE",
    "SCALE_MODES",
    "Coefficients",
    "MatrixView",
    "Transform",
    "adamw",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "ema_momentum",
    "label_params",
    "labels_from_module",
    "load",
    "masked",
    "muon",
    "named",
    "newton_schulz",
    "orthogonalize",
    "partition",
    "polar",
    "save",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_muon",
    "scale_by_shape",
    "views_from_module",
]
