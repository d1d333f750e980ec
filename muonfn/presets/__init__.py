"""Presets: ready-made optimizers assembled from the transforms, and how leaves are routed to them.

Public: :func:`muon`, :func:`normuon`, :func:`adamuon`, :func:`adamw`, :func:`qk_clip` and the
labelling helpers. The ``torch.optim`` shim is built from the same pieces, so this package also
hands it :func:`matrix_branch` and the checks the presets run (not re-exported by ``muonfn``).
"""

from ._adamw import adamw
from ._branch import NEWTON_SCHULZ_SPELLINGS, VARIANTS, Variant, check_names, matrix_branch
from ._labels import (
    ADAMW,
    DEFAULT_EXCLUDE,
    MUON,
    RoutingWarning,
    label_params,
    labels_from_module,
    matching_fragments,
    shown,
    views_from_module,
    warn_routing,
)
from ._muon import muon, muon_orthogonalizer
from ._params import split_buffers
from ._qk_clip import QKHeads, qk_clip
from ._variants import VARIANT_DEFAULTS, VARIANT_OPTIONS, adamuon, normuon, refuse_collectives

__all__ = [
    "ADAMW",
    "DEFAULT_EXCLUDE",
    "MUON",
    "NEWTON_SCHULZ_SPELLINGS",
    "VARIANTS",
    "VARIANT_DEFAULTS",
    "VARIANT_OPTIONS",
    "QKHeads",
    "RoutingWarning",
    "Variant",
    "adamuon",
    "adamw",
    "check_names",
    "label_params",
    "labels_from_module",
    "matching_fragments",
    "matrix_branch",
    "muon",
    "muon_orthogonalizer",
    "normuon",
    "qk_clip",
    "refuse_collectives",
    "shown",
    "split_buffers",
    "views_from_module",
    "warn_routing",
]
