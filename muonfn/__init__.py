"""muonfn: Muon as pure functions over TensorDicts.

``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``
implement momentum, Newton–Schulz and AdamW as composable transforms. The layers, each a
subpackage: :mod:`muonfn.linalg` (Newton–Schulz, views, batching; plain tensors),
:mod:`muonfn.transforms` (building blocks and combinators), :mod:`muonfn.presets`
(:func:`muon`, :func:`adamw`), :mod:`muonfn.optim` (the ``torch.optim`` shim) and
:mod:`muonfn.distributed` (sharded parameters, injected as an orthogonalizer).
``muonfn.optim``, ``muonfn.distributed`` and ``muonfn.reference`` load on first use.

Read :mod:`muonfn.reference` first: one step of :func:`muon` in plain PyTorch, in one file,
which the test suite holds every fast path to.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._checkpoint import load, save
from .linalg import (
    COEFFICIENTS,
    SCALE_MODES,
    Coefficients,
    LocalOrthogonalizer,
    MatrixView,
    NewtonSchulz,
    gram_newton_schulz,
    newton_schulz,
    polar,
    qr_orthogonal,
)
from .presets import (
    DEFAULT_EXCLUDE,
    RoutingWarning,
    adamuon,
    label_params,
    labels_from_module,
    muon,
    normuon,
    split_buffers,
    views_from_module,
)
from .qk_clip import QKHeads, qk_clip
from .steps import (
    adamw,
    add_decayed_weights,
    apply_updates,
    apply_updates_,
    descent,
    ema_momentum,
    orthogonalize,
    scale_by_adam,
    scale_by_element_rms,
    scale_by_learning_rate,
    scale_by_muon,
    scale_by_neuron_norm,
    scale_by_shape,
    scale_by_sign,
    stochastic_round,
)
from .transforms import (
    Transform,
    apply_if_finite,
    cautious,
    chain,
    masked,
    named,
    partition,
    transform,
)

if TYPE_CHECKING:
    from . import distributed, optim, reference

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("optim", "distributed", "reference")


def __getattr__(name: str) -> Any:
    # `import muonfn` then `muonfn.optim.Muon(...)` works without paying for torch.distributed up front
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "COEFFICIENTS",
    "DEFAULT_EXCLUDE",
    "SCALE_MODES",
    "Coefficients",
    "LocalOrthogonalizer",
    "MatrixView",
    "NewtonSchulz",
    "QKHeads",
    "RoutingWarning",
    "Transform",
    "adamuon",
    "adamw",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "apply_updates_",
    "cautious",
    "chain",
    "descent",
    "distributed",
    "ema_momentum",
    "gram_newton_schulz",
    "label_params",
    "labels_from_module",
    "load",
    "masked",
    "muon",
    "named",
    "newton_schulz",
    "normuon",
    "optim",
    "orthogonalize",
    "partition",
    "polar",
    "qk_clip",
    "qr_orthogonal",
    "reference",
    "save",
    "scale_by_adam",
    "scale_by_element_rms",
    "scale_by_learning_rate",
    "scale_by_muon",
    "scale_by_neuron_norm",
    "scale_by_shape",
    "scale_by_sign",
    "split_buffers",
    "stochastic_round",
    "transform",
    "views_from_module",
]
