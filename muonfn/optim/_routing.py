"""What the shim says when its routing leaves Muon nothing to train, or routed without names."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..presets import DEFAULT_EXCLUDE, label_params, matching_fragments, shown, warn_routing


def routed_without_names(labels: Any, names: Any, muon: Sequence[torch.Tensor]) -> str | None:
    """The warning for parameters given without names (``names`` is ``None``) that the default labels
    (:func:`muonfn.label_params`, which read names) sent to Muon (``muon``) by shape alone; ``None`` where
    there is none to give."""
    default = labels is label_params or (isinstance(labels, functools.partial) and labels.func is label_params)
    if names is not None or not muon or not default:
        return None
    listed = ", ".join(str(tuple(p.shape)) for p in muon[:3]) + (" ..." if len(muon) > 3 else "")
    return (
        f"muonfn.optim.Muon: parameters given without names are routed by shape alone: {len(muon)} of a "
        f"matrix's shape went to Muon (shapes {listed}), token embeddings, position embeddings and output "
        "heads among them if the model has any, which belong on AdamW. To route by name, pass "
        "model.named_parameters(), whose names send embeddings and heads to AdamW "
        "(with labels=muonfn.labels_from_module(model) to route by module type); or give group dicts with "
        "'use_muon', or labels= keyed by position ('0', '1', ...). With Hugging Face's Trainer, build the "
        "optimizer from named_parameters() and pass optimizers=(optimizer, scheduler)."
    )


def warn_if_muon_idle(param_groups: Sequence[Mapping[str, Any]]) -> None:
    """Warns where no parameter routed to Muon trains while AdamW ones do (not when Muon has something
    to train, or nothing trains, or nothing could go to Muon): the run is plain AdamW. PEFT's LoRA
    freezes the base weights, and ``"lora_"`` sends the adapters to AdamW."""

    def named(group: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        names = group.get("param_names") or [f"params[{i}]" for i in range(len(group["params"]))]
        return list(zip(names, group["params"]))

    muon = [pair for group in param_groups if group["use_muon"] for pair in named(group)]
    training = [(n, p) for group in param_groups if not group["use_muon"] for n, p in named(group) if p.requires_grad]
    if any(p.requires_grad for _, p in muon) or not training:
        return
    matrices = [name for name, p in training if sum(size != 1 for size in p.shape) >= 2]
    if not muon and not matrices:
        return  # nothing here was ever Muon's: a model of vectors
    frozen = f"{len(muon)} routed to Muon, all frozen (requires_grad=False)" if muon else "none was routed to Muon"
    trainable = [name for name, _ in training]
    message = (
        f"muonfn.optim.Muon: no parameter that trains goes to Muon, so this run is plain AdamW: {frozen}, "
        f"while {len(training)} routed to AdamW train ({shown(trainable)})."
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
