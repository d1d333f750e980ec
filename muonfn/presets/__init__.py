"""Presets: ready-made optimizers assembled from the transforms, and how leaves are routed to them."""

from ._labels import ADAMW, DEFAULT_EXCLUDE, MUON, label_params, labels_from_module, views_from_module
from ._muon import (
    TORCH_STATE_NAMES,
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
from ._variants import VARIANTS, Variant, adamuon, adapted_branch, normuon

__all__ = [
    "ADAMW",
    "DEFAULT_EXCLUDE",
    "MUON",
    "TORCH_STATE_NAMES",
    "VARIANTS",
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
    "split_buffers",
    "views_from_module",
    "with_adamw",
]
