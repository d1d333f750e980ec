"""Transforms: small gradient transformations and the combinators that compose them.

Each building block is a function returning a :class:`Transform` (``init``, ``update``);
the combinators build transforms from transforms. Nothing here knows about ranks: the
distributed strategies reach :func:`orthogonalize` as an injected ``orthogonalizer``.
"""

from ._adam import AdamNesterov, scale_by_adam
from ._adamuon import scale_by_element_rms
from ._adamw import fused_adamw
from ._apply import apply_updates, apply_updates_
from ._cautious import CAUTIOUS_MODES, CautiousMode, cautious
from ._combine import LabelsLike, apply_if_finite, chain, check_labels, masked, named, partition, resolve_labels
from ._contract import InitFn, Transform, UpdateFn, empty_state
from ._decay import add_decayed_weights
from ._descent import descent
from ._learning_rate import scale_by_learning_rate
from ._masks import MaskLike, check_mask, mask_table, resolve_mask
from ._momentum import ema_momentum, fresh_updates
from ._normuon import row_moment_shape, scale_by_neuron_norm
from ._orthogonalize import (
    MethodLike,
    ViewsLike,
    check_views,
    matrix_map,
    newton_schulz_setting,
    orthogonalize,
    resolve_views,
    scale_by_muon,
    scale_by_shape,
)
from ._rescale import RESCALE_MODES, Rescale
from ._rules import Needs, Rule, Scope, as_rule, check_rule, from_rule, no_needs, per_leaf_needs, run_checked
from ._shards import SumShards
from ._sign import scale_by_sign
from ._state import COUNT, EXP_AVG, EXP_AVG_SQ, MOMENTUM, NOTFINITE_COUNT, ROW_SECOND_MOMENT, SECOND_MOMENT, STEP

__all__ = [
    "CAUTIOUS_MODES",
    "COUNT",
    "EXP_AVG",
    "EXP_AVG_SQ",
    "MOMENTUM",
    "NOTFINITE_COUNT",
    "RESCALE_MODES",
    "ROW_SECOND_MOMENT",
    "SECOND_MOMENT",
    "STEP",
    "AdamNesterov",
    "CautiousMode",
    "InitFn",
    "LabelsLike",
    "MaskLike",
    "MethodLike",
    "Needs",
    "Rescale",
    "Rule",
    "Scope",
    "SumShards",
    "Transform",
    "UpdateFn",
    "ViewsLike",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "apply_updates_",
    "as_rule",
    "cautious",
    "chain",
    "check_labels",
    "check_mask",
    "check_rule",
    "check_views",
    "descent",
    "ema_momentum",
    "empty_state",
    "fresh_updates",
    "from_rule",
    "fused_adamw",
    "mask_table",
    "masked",
    "matrix_map",
    "named",
    "newton_schulz_setting",
    "no_needs",
    "orthogonalize",
    "partition",
    "per_leaf_needs",
    "resolve_labels",
    "resolve_mask",
    "resolve_views",
    "row_moment_shape",
    "run_checked",
    "scale_by_adam",
    "scale_by_element_rms",
    "scale_by_learning_rate",
    "scale_by_muon",
    "scale_by_neuron_norm",
    "scale_by_shape",
    "scale_by_sign",
]
