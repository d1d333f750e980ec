"""Presets: ready-made optimizers assembled from the transforms, and how leaves are routed to them."""

from ._labels import ADAMW, DEFAULT_EXCLUDE, MUON, label_params, labels_from_module, views_from_module
from ._muon import TORCH_STATE_NAMES, adamw, check_names, checks_names, muon, muon_branch, muon_orthogonalizer
from ._params import split_buffers

__all__ = [
    "ADAMW",
    "DEFAULT_EXCLUDE",
    "MUON",
    "TORCH_STATE_NAMES",
    "adamw",
    "check_names",
    "checks_names",
    "label_params",
    "labels_from_module",
    "muon",
    "muon_branch",
    "muon_orthogonalizer",
    "split_buffers",
    "views_from_module",
]
