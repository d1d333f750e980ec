"""torch.optim.Muon (with torch.optim.AdamW) and the shim: torch's spellings, and state_dicts both ways.

A run moves over mid-training through the optimizers' state_dicts: torch's Muon groups
become the shim's Muon groups in order and torch's AdamW groups its AdamW groups, parameter
by parameter as ``torch.optim.Optimizer.load_state_dict`` pairs them (by position, checked
by shape, and by name where both sides have names). State tensors move unchanged; only
torch's float ``step`` becomes the shim's exact int64 count and back.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._keys import dotted
from ..linalg import DEFAULT_VIEW, CoefficientsLike, MatrixView, ScaleMode, ns_schedule
from ..transforms import MaskLike, ViewsLike, resolve_mask, resolve_views
from . import _groups
from ._layout import Layout

Groups = Sequence[Mapping[str, Any]]

#: torch.optim.Muon's ``ns_steps`` when not given.
TORCH_NS_STEPS = 5
#: torch.optim.Muon's ``adjust_lr_fn`` -> muonfn's ``scale`` (``None`` is torch's default, Keller's scale).
SCALE_OF_ADJUST_LR_FN: dict[str | None, ScaleMode] = {
    None: "original",
    "original": "original",
    "match_rms_adamw": "match_rms_adamw",
}
ROUTE_NAMES = {True: "torch.optim.Muon", False: "torch.optim.AdamW"}
#: The settings of a torch.optim.Muon (True) and a torch.optim.AdamW (False) group, translated
#: (or refused) both ways. Any other entry of a group (a scheduler's ``initial_lr``, a key of
#: one's own) is carried as it is, both ways, as torch's ``load_state_dict`` carries it.
TORCH_SETTINGS = {
    True: ("lr", "momentum", "weight_decay", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"),
    False: (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "maximize",
        "foreach",
        "capturable",
        "differentiable",
        "fused",
        "decoupled_weight_decay",
    ),
}
#: What every group holds besides its settings: its parameters, their names, and in the shim its route.
GROUP_OWN = ("params", "param_names", "use_muon")


class NotGiven(enum.Enum):
    """A keyword left out, where ``None`` is one of the values it may be given."""

    NOT_GIVEN = "not given"


NOT_GIVEN = NotGiven.NOT_GIVEN


# ---------------------------------------------------------------------------- constructor spellings


def scale_of(adjust_lr_fn: Any, where: str) -> ScaleMode:
    if isinstance(adjust_lr_fn, str | None) and adjust_lr_fn in SCALE_OF_ADJUST_LR_FN:
        return SCALE_OF_ADJUST_LR_FN[adjust_lr_fn]
    raise ValueError(f"{where}adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")


def resolve_spellings(
    *, scale: ScaleMode | None, adjust_lr_fn: str | NotGiven | None, ns_eps: float | None, eps: float | None
) -> tuple[ScaleMode, float]:
    """``scale`` and ``ns_eps`` from muonfn's keywords or torch.optim.Muon's; both given must agree."""
    if adjust_lr_fn is not NOT_GIVEN:
        torch_scale = scale_of(adjust_lr_fn, "Muon(...): ")
        if scale is not None and scale != torch_scale:
            raise ValueError(
                f"Muon(scale={scale!r}, adjust_lr_fn={adjust_lr_fn!r}): adjust_lr_fn is torch's spelling of "
                f"scale={torch_scale!r}; pass one of them"
            )
        scale = torch_scale
    if eps is not None:
        if ns_eps is not None and ns_eps != eps:
            raise ValueError(
                f"Muon(ns_eps={ns_eps!r}, eps={eps!r}): eps is torch.optim.Muon's spelling of ns_eps; pass one of them"
            )
        ns_eps = eps
    return ("match_rms_adamw" if scale is None else scale), (1e-7 if ns_eps is None else ns_eps)


def is_torch_triple(coefficients: Any) -> bool:
    """torch.optim.Muon's ``ns_coefficients``: one ``(a, b, c)`` of numbers, for every step."""
    return (
        isinstance(coefficients, Sequence)
        and not isinstance(coefficients, str)
        and len(coefficients) == 3
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in coefficients)
    )


def schedule_of(coefficients: Any, steps: int | None) -> CoefficientsLike:
    """muonfn's schedule for torch's one triple (repeated ``steps`` times, torch's 5 by default); others as given."""
    if not is_torch_triple(coefficients):
        return coefficients
    count = TORCH_NS_STEPS if steps is None else steps
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"Newton–Schulz steps must be an integer >= 1, got {steps!r}")
    return (tuple(float(v) for v in coefficients),) * count


# ---------------------------------------------------------------------------- torch -> shim


def shim_state_dict(
    param_groups: Groups, layout: Layout, muon_state_dict: Mapping[str, Any], adamw_state_dict: Mapping[str, Any] | None
) -> dict:
    """The shim state_dict holding what the torch state_dicts hold, for the shim's ``param_groups``
    laid out by ``layout``; changes nothing.

    Raises naming the group or parameter that does not correspond.
    """
    for i, group in enumerate(param_groups):
        if group["use_muon"] and group["variant"] != "muon":
            raise ValueError(
                f"load_torch_state_dicts: param group {i} has variant={group['variant']!r}; torch.optim.Muon's "
                "state continues variant='muon' groups only (it keeps no second moment)"
            )
        if group["use_muon"] and group["momentum_bias_correction"] is True:
            raise ValueError(
                f"load_torch_state_dicts: param group {i} has momentum_bias_correction=True; torch.optim.Muon's "
                "momentum is not bias-corrected and has no step count to continue it with"
            )
    sources = {True: muon_state_dict, False: adamw_state_dict}
    torch_groups: dict[bool, list[Mapping[str, Any]]] = {}
    for route, sd in sources.items():
        ours = [g for g in param_groups if g["use_muon"] == route]
        if sd is None:
            given = [name for g in ours for name in _names(layout, g)]
            if given:
                raise ValueError(
                    f"load_torch_state_dicts: this optimizer has {'Muon' if route else 'AdamW'} parameters "
                    f"{given}; pass the {ROUTE_NAMES[route]} state_dict that trained them"
                )
            torch_groups[route] = [{} for _ in ours]
            continue
        saved = list(sd["param_groups"])
        if len(saved) != len(ours):
            raise ValueError(
                f"load_torch_state_dicts: the {ROUTE_NAMES[route]} state_dict has {len(saved)} parameter groups, "
                f"this optimizer {len(ours)} {'Muon' if route else 'AdamW'} group{'' if len(ours) == 1 else 's'}; "
                f"build it with one group (use_muon={route}) per torch group, in order"
            )
        torch_groups[route] = saved

    position = {p: i for i, p in enumerate(p for g in param_groups for p in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    taken = {True: 0, False: 0}
    claimed: dict[bool, set[Any]] = {True: set(), False: set()}
    for i, group in enumerate(param_groups):
        route = group["use_muon"]
        nth = taken[route]
        saved_group = torch_groups[route][nth]
        taken[route] += 1
        sd = sources[route]
        new_group = {k: v for k, v in group.items() if k != "params"}
        new_group["params"] = [position[p] for p in group["params"]]
        if sd is None:
            groups.append(new_group)
            continue
        # as torch's load_state_dict: the saved group's entries replace this one's, but for the
        # settings torch's optimizers do not have (ns_dtype, ...), which stay this optimizer's
        new_group = {k: v for k, v in new_group.items() if k in _groups.SETTINGS_OF[route] or k in GROUP_OWN}
        new_group.update(_extra_entries(saved_group, TORCH_SETTINGS[route]))
        where = f"load_torch_state_dicts: param group {i} (group {nth} of the {ROUTE_NAMES[route]} state_dict)"
        saved_params = list(saved_group["params"])
        if len(saved_params) != len(group["params"]):
            raise ValueError(f"{where}: {len(group['params'])} parameters here, {len(saved_params)} there")
        names = _names(layout, group)
        if "param_names" in group and "param_names" in saved_group:
            for name, saved_name in zip(group["param_names"], saved_group["param_names"]):
                if name != saved_name:
                    raise ValueError(f"{where}: parameter {name!r} here is {saved_name!r} there")
        new_group.update(_muon_settings(saved_group, where) if route else _adamw_settings(saved_group, where))
        expected = _groups.state_names(group)
        for index, p, name in zip(saved_params, group["params"], names):
            claimed[route].add(index)
            entry = sd["state"].get(index)
            if not entry:  # torch makes a parameter's state at its first gradient, and so does the shim
                continue
            if set(entry) != set(expected):
                amsgrad = " (amsgrad, which muonfn's AdamW does not run)" if "max_exp_avg_sq" in entry else ""
                raise ValueError(
                    f"{where}: parameter {name!r} has state {sorted(entry)}, expected {sorted(expected)}{amsgrad}"
                )
            # torch's step updates its tensors in place: the shim's must not be the same ones
            state[position[p]] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        groups.append(new_group)

    for route, sd in sources.items():
        stray = [] if sd is None else [k for k in sd["state"] if k not in claimed[route]]
        if stray:
            raise ValueError(
                f"load_torch_state_dicts: the {ROUTE_NAMES[route]} state_dict has state under {stray}, "
                "which are none of its groups' parameters"
            )
    return {"state": state, "param_groups": groups}


def _extra_entries(group: Mapping[str, Any], settings: Sequence[str]) -> dict[str, Any]:
    """The entries of ``group`` that are none of ``settings`` (nor its parameters, names and route)."""
    return {k: v for k, v in group.items() if k not in settings and k not in GROUP_OWN}


def _names(layout: Layout, group: Mapping[str, Any]) -> list[str]:
    return [dotted(layout.slots[p].key) for p in group["params"]]


def _setting(saved: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in saved:
        raise ValueError(f"{where} has no {name!r}")
    return saved[name]


def _muon_settings(saved: Mapping[str, Any], where: str) -> dict[str, Any]:
    """torch.optim.Muon's group hyperparameters under the shim's names."""
    steps = _setting(saved, "ns_steps", where)
    return {
        "lr": _setting(saved, "lr", where),
        "momentum": _setting(saved, "momentum", where),
        "weight_decay": _setting(saved, "weight_decay", where),
        "nesterov": _setting(saved, "nesterov", where),
        "ns_coefficients": _groups.plain_coefficients(schedule_of(_setting(saved, "ns_coefficients", where), steps)),
        "ns_steps": steps,
        "ns_eps": _setting(saved, "eps", where),
        "scale": scale_of(_setting(saved, "adjust_lr_fn", where), f"{where}: "),
        "extra_scale": 1.0,
    }


def _adamw_settings(saved: Mapping[str, Any], where: str) -> dict[str, Any]:
    """torch.optim.AdamW's group hyperparameters under the shim's names; what muonfn's AdamW does not run is refused."""
    for flag in ("amsgrad", "maximize"):
        if saved.get(flag, False):
            raise ValueError(f"{where} has {flag}=True, which muonfn's AdamW does not run")
    weight_decay = _setting(saved, "weight_decay", where)
    if not saved.get("decoupled_weight_decay", True) and float(weight_decay) != 0.0:
        raise ValueError(
            f"{where} is Adam's (weight decay added to the gradient), not AdamW's; muonfn decouples weight decay"
        )
    betas = _setting(saved, "betas", where)
    _groups.check_betas(f"{where}: betas", betas)
    return {
        "lr": _setting(saved, "lr", where),
        "weight_decay": weight_decay,
        "momentum": betas[0],  # an AdamW group's beta1 (scheduled as Muon's momentum is)
        "beta2": float(betas[1]),
        "eps": _setting(saved, "eps", where),
    }


# ---------------------------------------------------------------------------- shim -> torch


def torch_state_dicts(
    param_groups: Groups, layout: Layout, *, views: ViewsLike, weight_decay_mask: MaskLike
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state_dicts of a torch.optim.Muon and a torch.optim.AdamW built with the shim's Muon and AdamW
    groups, laid out by ``layout``, read with the shim's ``views`` and ``weight_decay_mask``.

    Raises naming the group or parameter whose settings torch's optimizers cannot run.
    """
    out: dict[bool, dict[str, Any]] = {route: {"state": {}, "param_groups": []} for route in (True, False)}
    count = {True: 0, False: 0}
    decayed = set(resolve_mask(weight_decay_mask, layout.params(), True))
    for i, group in enumerate(param_groups):
        route = group["use_muon"]
        where = f"torch_state_dicts: param group {i}"
        keys = [layout.slots[p].key for p in group["params"]]
        if float(group["weight_decay"]) != 0.0:
            exempt = [dotted(k) for k in keys if k not in decayed]
            if exempt:
                raise ValueError(
                    f"{where}: weight_decay_mask exempts {exempt} from its weight decay, which torch applies to "
                    "the whole group; put them in a group of their own with weight_decay=0"
                )
        _refuse_what_torch_does_not_run(where, group)
        if route:
            torch_group = _torch_muon_group(where, group, keys, resolve_views(views, keys, group["params"]))
        else:
            torch_group = _torch_adamw_group(group)
        # the torch optimizer must not share a tensor (a scheduler's initial_lr) with this one
        torch_group.update(copy.deepcopy(_extra_entries(group, _groups.SETTINGS_OF[route])))
        indices = list(range(count[route], count[route] + len(keys)))
        count[route] += len(keys)
        torch_group["params"] = indices
        if "param_names" in group:
            torch_group["param_names"] = list(group["param_names"])
        out[route]["param_groups"].append(torch_group)
        for index, p in zip(indices, group["params"]):
            entries = layout.entries(param_groups, p)
            if entries:  # (as torch's, a parameter without state has no entry)
                out[route]["state"][index] = {name: _torch_value(name, t) for name, t in entries.items()}
    return out[True], out[False]


#: The settings torch.optim.Muon (True) and torch.optim.AdamW (False) run, at the value they run
#: (``ns_method="gram"`` runs the same iteration as torch's, rounded another way).
TORCH_RUNS: dict[bool, dict[str, tuple[Any, ...]]] = {
    True: {
        "momentum_bias_correction": (False,),
        "cautious_weight_decay": (False,),
        "cautious_mode": (None,),
        "ns_method": ("standard", "gram"),
        "ns_eps_mode": ("clamp",),
    },
    False: {"cautious_weight_decay": (False,), "nesterov": (False,)},
}


def _refuse_what_torch_does_not_run(where: str, group: Mapping[str, Any]) -> None:
    runner = ROUTE_NAMES[group["use_muon"]]
    for name, values in TORCH_RUNS[group["use_muon"]].items():
        value = group[name]
        if not any(value is v or (isinstance(value, str) and value == v) for v in values):
            shown = getattr(value, "__qualname__", None) if callable(value) else None
            raise ValueError(
                f"{where}: {runner} does not run {name}={shown or repr(value)} "
                f"(it runs {' or '.join(repr(v) for v in values)})"
            )


def _torch_muon_group(
    where: str, group: Mapping[str, Any], keys: Sequence[tuple[str, ...]], views: Sequence[MatrixView]
) -> dict[str, Any]:
    if group["variant"] != "muon":
        raise ValueError(
            f"{where}: torch.optim.Muon runs variant='muon'; this group has variant={group['variant']!r} "
            f"(state {sorted(_groups.state_names(group))})"
        )
    schedule = ns_schedule(_groups.coefficients_of(group["ns_coefficients"]), group["ns_steps"])
    if schedule.norm_factor != 1.0 or len(set(schedule.triples)) != 1:
        raise ValueError(
            f"{where}: torch.optim.Muon runs one (a, b, c) for every Newton–Schulz step without a norm factor; "
            f"this group's schedule is {schedule}"
        )
    scale = group["scale"]
    torch_names = {v: k for k, v in SCALE_OF_ADJUST_LR_FN.items() if k is not None}
    if scale not in torch_names or group["extra_scale"] != 1.0:
        raise ValueError(
            f"{where}: torch.optim.Muon scales by adjust_lr_fn 'original' or 'match_rms_adamw'; this group has "
            f"scale={scale!r}, extra_scale={group['extra_scale']!r}"
        )
    for key, p, view in zip(keys, group["params"], views):
        if p.ndim != 2:
            raise ValueError(
                f"{where}: torch.optim.Muon takes 2-D parameters only; {dotted(key)!r} has shape {tuple(p.shape)}"
            )
        if view != DEFAULT_VIEW:
            raise ValueError(f"{where}: torch.optim.Muon reads {dotted(key)!r} as it is stored, not as {view}")
    return {
        "lr": _copied(group["lr"]),
        "weight_decay": _copied(group["weight_decay"]),
        "momentum": _copied(group["momentum"]),
        "nesterov": group["nesterov"],
        "ns_coefficients": schedule.triples[0],
        "eps": group["ns_eps"],
        "ns_steps": len(schedule.triples),
        "adjust_lr_fn": torch_names[scale],
    }


def _torch_adamw_group(group: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "lr": _copied(group["lr"]),
        "betas": (_copied(group["momentum"]), group["beta2"]),
        "eps": group["eps"],
        "weight_decay": _copied(group["weight_decay"]),
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": True,
    }


def _copied(value: Any) -> Any:
    # the torch optimizer must not share a scheduled tensor with this one
    return value.clone() if isinstance(value, torch.Tensor) else value


def _torch_value(name: str, t: torch.Tensor) -> torch.Tensor:
    if name == "step":  # torch.optim.AdamW counts in the default scalar dtype
        return t.to(torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)
    return t.clone()
