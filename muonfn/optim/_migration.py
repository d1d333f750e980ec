"""Migration between the shim and ``torch.optim.Muon`` + ``torch.optim.AdamW``, both ways.

torch's Muon groups become the shim's Muon groups in order, torch's AdamW groups its AdamW groups,
parameter by parameter as ``torch.optim.Optimizer.load_state_dict`` pairs them (by position, checked
by shape, and by name where both sides have names). Every group key travels (a scheduler's
``initial_lr`` too); state tensors move unchanged, but torch's float ``step``, which becomes the
shim's exact int64 count, and back, and a ``state_dtype``'s state: widened to the parameters' dtype
for torch (its bf16 momentum's count left out), narrowed to it on the way in.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._tree import build
from ..presets import VARIANT_OPTIONS
from ..transforms import MaskLike, selected
from . import _groups
from ._groups import ADAMW_SETTINGS, COUNTS, MUON_SETTINGS

KINDS = {True: "torch.optim.Muon", False: "torch.optim.AdamW"}
#: The settings torch's optimizers run at these values only (the shim's key -> values torch runs).
TORCH_RUNS: dict[bool, dict[str, tuple[Any, ...]]] = {
    True: {
        "variant": ("muon",),
        "momentum_bias_correction": (False,),
        "cautious_weight_decay": (False,),
        "cautious_mode": (None,),
        "ns_method": ("standard", "gram"),
        "ns_eps_mode": ("clamp",),
        "adjust_lr_fn": ("original", "match_rms_adamw", None),
        "extra_scale": (1.0,),
        "nesterov": (True, False),
    },
    False: {"cautious_weight_decay": (False,), "nesterov": (False,)},
}
#: torch.optim.AdamW's group settings that muonfn's AdamW runs at these values only (the others: its defaults)
ADAMW_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None)
#: The shim's group keys with no counterpart in torch's (left out of its groups).
SHIM_ONLY = {
    "use_muon",
    "variant",
    "momentum_bias_correction",
    "cautious_weight_decay",
    "cautious_mode",
    "ns_dtype",
    "ns_method",
    "ns_eps_mode",
    "ns_restarts",
    "extra_scale",
    "state_dtype",
}


#: 0.1.0's spellings of a Muon group's entries
LEGACY_SPELLINGS = {"scale": "adjust_lr_fn", "ns_eps": "eps"}


def current_group(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved group as the shim keeps one (a copy): 0.1.0's ``scale`` and ``ns_eps`` as ``adjust_lr_fn``
    and ``eps``; a group saved when every group held both kinds' settings keeps its own kind's (an
    AdamW group's betas, eps and nesterov from its ``adamw_betas``, ``adamw_eps``, ``adamw_nesterov``)."""
    if saved.get("use_muon"):
        return {LEGACY_SPELLINGS.get(k, k): v for k, v in saved.items() if not k.startswith("adamw_")}
    if "variant" not in saved:
        return dict(saved)
    beta1, beta2 = saved.get("adamw_betas", (saved.get("momentum"), saved.get("beta2")))
    eps, nesterov = saved.get("adamw_eps", saved.get("eps")), saved.get("adamw_nesterov", saved.get("nesterov"))
    muon_only = {*MUON_SETTINGS, *LEGACY_SPELLINGS} - set(ADAMW_SETTINGS)
    kept = {k: v for k, v in saved.items() if k not in muon_only and not k.startswith("adamw_")}
    return {**kept, "momentum": beta1, "beta2": beta2, "eps": eps, "nesterov": nesterov}


def loaded_entries(where: str, entries: Mapping[str, Any], group: Mapping[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """A saved parameter's state as its ``group`` keeps it: the entries of its layout, each copied to the
    parameter's device in the group's dtype (a count an exact int64; a ``state_dtype``'s momentum and
    moments in it, an fp32 state narrowed to bf16 rounded to nearest; otherwise the parameter's dtype, the
    second moment of an fp16 parameter fp32); a bf16 Muon state's rounding counts where the state has none
    (saved in fp32, or by torch.optim.Muon) from 0, where the group keeps none left out. Raises naming ``where``
    and what does not fit."""
    layout = _groups.layout(group)
    # a bf16 Muon state's rounding counts (no bias correction's): from 0 where missing, left out where not kept
    rounding = [c for c in COUNTS if group.get("use_muon") and c not in _groups.counts(group).values()]
    entries = {k: v for k, v in {**dict.fromkeys(rounding, 0), **entries}.items() if k not in rounding or k in layout}
    if set(entries) != set(layout):
        raise ValueError(f"{where} has state {sorted(entries)}, expected {sorted(layout)}")
    out = {}
    for name in layout:
        value = entries[name]
        if name in COUNTS:
            count = float(value) if not isinstance(value, torch.Tensor) or value.numel() == 1 else math.nan
            if not (math.isfinite(count) and count >= 0 and count == math.floor(count)):
                raise ValueError(f"{where} has {name} {value!r}; expected a count >= 0")
            out[name] = torch.tensor(int(count), dtype=torch.int64, device=p.device)
        elif not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: {name} is a {type(value).__name__}, not a tensor")
        else:
            out[name] = value.to(device=p.device, dtype=_groups.kept_dtype(group, name, p), copy=True)
    return out


def shim_state_dict(
    param_groups: Sequence[Mapping[str, Any]],
    names_of: Sequence[Sequence[str]],
    muon_state_dict: Mapping[str, Any],
    adamw_state_dict: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """torch's two state_dicts as one of the shim's for its ``param_groups`` (their parameters named
    ``names_of``); changes nothing."""
    sources = {True: muon_state_dict, False: adamw_state_dict}
    saved_groups = {kind: iter(sd["param_groups"]) for kind, sd in sources.items() if sd is not None}
    for kind, sd in sources.items():
        ours = sum(bool(g["use_muon"]) == kind for g in param_groups)
        if sd is not None and len(sd["param_groups"]) != ours:
            raise ValueError(
                f"load_torch_state_dicts: the {KINDS[kind]} state_dict has {len(sd['param_groups'])} groups, this "
                f"optimizer {ours}"
            )
    groups, state, position = [], {}, itertools.count()
    for i, (group, names) in enumerate(zip(param_groups, names_of)):
        kind = bool(group["use_muon"])
        where = f"load_torch_state_dicts: param group {i}"
        for key in ("variant", "momentum_bias_correction") if kind else ():
            if group.get(key) not in TORCH_RUNS[kind][key]:
                raise ValueError(
                    f"{where} has {key}={group.get(key)!r}; torch.optim.Muon's state continues Muon groups "
                    "without bias correction only"
                )
        indices = [next(position) for _ in group["params"]]
        mine = {k: v for k, v in group.items() if k != "params"} | {"params": indices}
        groups.append(mine)
        sd = sources[kind]
        if sd is None:
            if group["params"]:
                raise ValueError(f"{where}: this optimizer has {KINDS[kind]} parameters {names}; pass that state_dict")
            continue
        saved = next(saved_groups[kind])
        if len(saved["params"]) != len(indices):
            raise ValueError(
                f"{where}: {len(indices)} parameters here, {len(saved['params'])} in the {KINDS[kind]} group"
            )
        for name, theirs in zip(names, saved.get("param_names", names)):
            if group.get("param_names") and name != theirs:
                raise ValueError(f"{where}: parameter {name!r} here is {theirs!r} there")
        # torch's group settings under the shim's keys; every key carried (``initial_lr`` too)
        settings = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        if kind:
            settings.update(_groups.ns_entries(where, None, {**group, **settings}))  # (torch's over the group's)
            settings["adjust_lr_fn"] = settings.get("adjust_lr_fn") or "original"
        else:
            for key in ADAMW_FLAGS:  # (the others choose how torch computes the step, not what)
                if settings.pop(key, None) and key in ("amsgrad", "maximize"):
                    raise ValueError(f"{where} has {key}=True, which muonfn's AdamW does not run")
            if not settings.pop("decoupled_weight_decay", True) and float(settings["weight_decay"]) != 0:
                raise ValueError(f"{where} is Adam's (weight decay added to the gradient), not AdamW's")
            beta1, beta2 = settings.pop("betas")
            settings.update(momentum=float(beta1), beta2=float(beta2))  # (β₁ as momentum: see the shim's groups)
        mine.update(settings)
        for index, theirs, name in zip(indices, saved["params"], names):
            entry = sd["state"].get(theirs)
            if entry:
                if "max_exp_avg_sq" in entry:
                    raise ValueError(
                        f"{where}: parameter {name!r} has amsgrad's state, which muonfn's AdamW does not run"
                    )
                state[index] = dict(entry)  # (torch's float step: loaded as an exact int64 count)
    return {"state": state, "param_groups": groups}


def torch_state_dicts(
    param_groups: Sequence[Mapping[str, Any]],
    names_of: Sequence[Sequence[str]],
    state: Mapping[Any, Any],
    views: Any,
    mask: MaskLike,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shim's ``state`` as ``torch.optim.Muon``'s and ``torch.optim.AdamW``'s state_dicts, for its
    ``param_groups`` (their parameters named ``names_of``; its ``views`` and ``weight_decay_mask``
    ``mask``, which torch's optimizers cannot run but at their defaults)."""
    out: dict[bool, dict[str, Any]] = {kind: {"state": {}, "param_groups": []} for kind in (True, False)}
    count = {True: itertools.count(), False: itertools.count()}
    for i, (group, names) in enumerate(zip(param_groups, names_of)):
        kind = bool(group["use_muon"])
        where = f"torch_state_dicts: param group {i}"
        for key, values in TORCH_RUNS[kind].items():
            if key in group and group[key] not in values:
                runs, shown = " or ".join(map(repr, values)), getattr(group[key], "__name__", repr(group[key]))
                raise ValueError(f"{where}: {KINDS[kind]} does not run {key}={shown} (it runs {runs})")
        if views is not None:
            raise ValueError(f"{where}: views= read parameters as other matrices than torch.optim.Muon does")
        if mask is not None and float(group["weight_decay"]) != 0:
            leaves = build({n: p.detach() for n, p in zip(names, group["params"])}, torch.Size([]))
            decayed = set(selected(mask, leaves, "weight_decay_mask"))
            exempt = [n for n in names if n not in decayed]
            if exempt:
                raise ValueError(
                    f"{where}: weight_decay_mask exempts {exempt}, which torch decays with the whole group"
                )
        # the shim's own keys, and a Muon group's variant options or an AdamW group's nesterov: not torch's
        own = SHIM_ONLY | ({*VARIANT_OPTIONS, "params"} if kind else {"nesterov", "params"})
        theirs = {k: v for k, v in group.items() if k not in own}
        if kind:
            schedule = _groups.ns_of(group).schedule  # (its ns_method checked above: a NewtonSchulz)
            if len(set(schedule.triples)) != 1 or schedule.norm_factor != 1.0:
                raise ValueError(
                    f"{where}: torch.optim.Muon runs one (a, b, c) for every step, not {group['ns_coefficients']!r}"
                )
            for name, p in zip(names, group["params"]):
                if p.ndim != 2:
                    raise ValueError(
                        f"{where}: parameter {name!r} is {p.ndim}-D; torch.optim.Muon takes 2-D parameters only"
                    )
            theirs.update(ns_coefficients=schedule.triples[0], ns_steps=len(schedule.triples))
        else:
            theirs["betas"] = (float(theirs.pop("momentum")), float(theirs.pop("beta2")))
            theirs.update(ADAMW_FLAGS, decoupled_weight_decay=True)
        indices = [next(count[kind]) for _ in names]
        out[kind]["param_groups"].append({**theirs, "params": indices})
        plain = {**group, "state_dtype": None}  # (torch's optimizers keep the parameters' dtype)
        for index, p in zip(indices, group["params"]):
            if state.get(p):
                out[kind]["state"][index] = {
                    k: v.to(torch.float32) if k == "step" else v.to(_groups.kept_dtype(plain, k, p), copy=True)
                    for k, v in state[p].items()
                    if isinstance(v, torch.Tensor) and k in _groups.layout(plain)
                }
    return out[True], out[False]
