"""What the shim says when its routing leaves Muon nothing to train, or routed without names."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..presets import DEFAULT_EXCLUDE, label_params, matching_fragments, shown, warn_routing


def warn_if_routed_without_names(labels: Any, names: Any, muon: Sequence[torch.Tensor]) -> bool:
    """Warns where parameters given without names (``names`` is ``None``) were sent to Muon (``muon``) by
    the default labels (:func:`muonfn.label_params`, which read names), by shape alone; whether it warned."""
    default = labels is label_params or (isinstance(labels, functools.partial) and labels.func is label_params)
    if names is not None or not muon or not default:
        return False
    listed = ", ".join(str(tuple(p.shape)) for p in muon[:3]) + (" ..." if len(muon) > 3 else "")
    warn_routing(
        f"muonfn.optim.Muon: parameters given without names are routed by shape alone: {len(muon)} of a "
        f"matrix's shape went to Muon (shapes {listed}), token embeddings, position embeddings and output "
        "heads among them if the model has any, which belong on AdamW. To route by name, pass "
        "model.named_parameters(), whose names send embeddings and heads to AdamW "
        "(with labels=muonfn.labels_from_module(model) to route by module type); or give group dicts with "
        "'use_muon', or labels= keyed by position ('0', '1', ...). With Hugging Face's Trainer, build the "
        "optimizer from named_parameters() and pass optimizers=(optimizer, scheduler)."
    )
    return True


def warn_if_muon_idle(param_groups: Sequence[Mapping[str, Any]], names: Sequence[Sequence[str]]) -> None:
    """Warns where no parameter routed to Muon trains while AdamW ones do (not when Muon has something
    to train, or nothing trains, or nothing could go to Muon): the run is plain AdamW. PEFT's LoRA
    freezes the base weights, and ``"lora_"`` sends the adapters to AdamW. ``names``: each group's."""
    routed = [(group["use_muon"], n, p) for group, ns in zip(param_groups, names) for n, p in zip(ns, group["params"])]
    muon = [p for use_muon, _, p in routed if use_muon]
    training = [(n, p) for use_muon, n, p in routed if not use_muon and p.requires_grad]
    if any(p.requires_grad for p in muon) or not training:
        return
    matrices = [name for name, p in training if sum(size != 1 for size in p.shape) >= 2]
    if not muon and not matrices:
        return  # nothing here was ever Muon's: a model of vectors
    frozen = f"{len(muon)} routed to Muon, all frozen (requires_grad=False)" if muon else "none was routed to Muon"
    message = (
        f"muonfn.optim.Muon: no parameter that trains goes to Muon, so this run is plain AdamW: {frozen}, "
        f"while {len(training)} routed to AdamW train ({shown([name for name, _ in training])})."
    )
    fragments = matching_fragments(matrices, DEFAULT_EXCLUDE)
    if fragments:
        message += (
            f" Their names sent them there (muonfn.DEFAULT_EXCLUDE's {shown(fragments, len(fragments))}: LoRA "
            "adapters go to AdamW by default). To run Muon on them, pass labels= (e.g. "
            "functools.partial(muonfn.label_params, exclude=[f for f in muonfn.DEFAULT_EXCLUDE if f != "
            f"{fragments[0]!r}]))."
        )
    elif matrices:
        message += " To run Muon on the trainable matrices, route them with labels= or muonfn.labels_from_module."
    warn_routing(message)
