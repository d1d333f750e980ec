"""Presets: ready-made optimizers assembled from the transforms, and how leaves are routed to them."""

from ._labels import ADAMW, DEFAULT_EXCLUDE, MUON, label_params, labels_from_module, views_from_module
from ._muon import (
    adamw,
    check_names,
    checks_names,
    muon,
    muon_branch,
    muon_orthogonalizer,
    with_adamw,
)
from ._params import split_buffers
from ._qk_clip import QKHeads, qk_clip
from ._variants import (
    VARIANT_DEFAULTS,
    VARIANT_OPTIONS,
    VARIANTS,
    Variant,
    adamuon,
    adapted_branch,
    normuon,
    refuse_collectives,
)

__all__ = [
    "ADAMW",
    "DEFAULT_EXCLUDE",
    "MUON",
    "VARIANTS",
    "VARIANT_DEFAULTS",
    "VARIANT_OPTIONS",
    "QKHeads",
    "Variant",
    "adamuon",
    "adamw",
    "adapted_branch",
    "check_names",
    "checks_names",
    "label_params",
    "labels_from_module",
    "muon",
    "muon_branch",
    "muon_orthogonalizer",
    "normuon",
    "qk_clip",
    "refuse_collectives",
    "split_buffers",
    "views_from_module",
    "with_adamw",
]
