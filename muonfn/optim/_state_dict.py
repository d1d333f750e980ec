"""torch's ``state_dict`` format, read back into param groups and functional-state entries."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .._keys import Key, dotted
from . import _groups
from ._layout import Layout


def loaded_value(name: str, torch_name: str, value: Any, like: torch.Tensor) -> torch.Tensor:
    """A state_dict entry cast as ``torch.optim`` casts it (to ``like``'s dtype and device: its
    parameter's, but fp32 for the second moment of an fp16 parameter, and an int64 step count,
    which must be a whole number)."""
    if not like.is_floating_point():  # a step count
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"load_state_dict: parameter {name} has a {torch_name} of shape {tuple(value.shape)}")
        count = float(value)
        if not (math.isfinite(count) and count >= 0 and count == int(count)):
            raise ValueError(f"load_state_dict: parameter {name} has {torch_name} {value!r}; expected a count >= 0")
        return torch.tensor(int(count), dtype=torch.int64, device=like.device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"load_state_dict: parameter {name}: {torch_name} is a {type(value).__name__}, not a tensor")
    if value.shape != like.shape:
        raise ValueError(
            f"load_state_dict: parameter {name}: {torch_name} has shape {tuple(value.shape)}, "
            f"expected {tuple(like.shape)}"
        )
    return value.to(dtype=like.dtype, device=like.device)


def packed_state_dict(groups: Sequence[Mapping[str, Any]], layout: Layout, others: Mapping[Any, Any]) -> dict[str, Any]:
    """The state of ``groups``' parameters in torch's format, as ``layout`` holds it now.

    ``groups`` are described as they are, as torch describes them, also where they were edited
    in a way the next step refuses: a parameter is numbered by its position counted across the
    groups in order, one in several groups by the first (so a group repeated in ``param_groups``
    is saved as the group it repeats), and one that has no state (not yet stepped, as in
    torch's, or not added with its group) has no entry. A parameter's state is a plain dict of
    its current tensors (so that ``torch.load(weights_only=True)`` reads it back); ``others``,
    the entries of ``opt.state`` under keys that are not parameters, are kept under their own
    keys, as torch keeps them. A state on the meta device of a parameter that is not (stepped
    there, then materialised) holds no values: it is an error naming the parameter.
    """
    index: dict[torch.Tensor, int] = {}
    param_groups = []
    start = 0
    for group in groups:
        packed = {k: v for k, v in group.items() if k != "params" and not _is_function_setting(k, v)}
        params = group["params"]
        # torch's numbering: a parameter new to this group takes its (last) position here
        index.update({p: position for position, p in enumerate(params, start) if p not in index})
        packed["params"] = [index[p] for p in params]
        start += len(params)
        param_groups.append(packed)
    state: dict[Any, Any] = {}
    for p, i in index.items():
        entries = layout.laid_out_entries(p) if p in layout.slots else {}
        if entries:
            if not p.is_meta and any(t.is_meta for t in entries.values()):
                raise ValueError(
                    f"state_dict: the state of parameter {dotted(layout.slots[p].key)!r} is on meta, which holds "
                    f"no values, and the parameter on {p.device} (stepped on meta, then materialised): drop it "
                    "with del opt.state[p] (opt.state.clear() for every parameter); the next step makes it anew"
                )
            state[i] = entries
    for key, value in others.items():
        if isinstance(key, torch.Tensor):
            if isinstance(value, Mapping) and not value:
                continue  # left by a lookup (a defaultdict's); it reads back as {} without being saved
            raise ValueError(
                f"state_dict: opt.state has an entry under a tensor of shape {tuple(key.shape)} that is not a "
                "parameter of this optimizer; a state_dict keys state by parameter index, so it cannot be "
                "saved (store it under a string key instead)"
            )
        if key in state:
            raise ValueError(
                f"state_dict: opt.state[{key!r}] is not a parameter's state, but {key!r} is the index of "
                "a parameter in the state_dict; store it under another key"
            )
        state[key] = value
    return {"state": state, "param_groups": param_groups}


def _is_function_setting(name: str, value: Any) -> bool:
    return name in _groups.FUNCTION_SETTINGS and callable(value)


def _layout_hint(group: Mapping[str, Any], saved: Mapping[str, Any]) -> str:
    """Why a saved Muon group's state has other entries: it was saved with other settings."""
    if not group["use_muon"]:
        return ""
    for name in ("variant", "momentum_bias_correction", "second_moment_bias_correction"):
        here, there = group.get(name), saved.get(name, group.get(name))
        if here != there:
            return f" (saved with {name}={there!r}, this optimizer's group has {name}={here!r})"
    return ""


class Loaded(NamedTuple):
    """What a state_dict holds for an optimizer, checked and translated."""

    groups: list[dict[str, Any]]
    #: the functional-state entries of its parameters
    entries: dict[Key, torch.Tensor]
    #: the entries under keys that are none of its parameters' indices, carried as torch carries them
    others: dict[Any, Any]


def translate_state_dict(
    state_dict: dict[str, Any],
    param_groups: Sequence[Mapping[str, Any]],
    layout: Layout,
    *,
    defaults: Mapping[str, Any],
    check: Callable[[int, Mapping[str, Any]], object],
) -> Loaded:
    """The param groups and the functional-state entries ``state_dict`` holds for the parameters of
    ``param_groups``, laid out by ``layout``, and its entries under other keys.

    Checks everything (group sizes and routes, every parameter's entries, the
    hyperparameters; ``check`` checks a group's settings naming it) and raises naming the
    first mismatch; changes nothing. A saved group's missing settings are ``defaults``' for its
    kind; one saved when every group held both kinds' settings loads as its kind holds them now.
    A parameter the state_dict holds no state for (or ``{}``, as torch saves a parameter looked
    up in its ``defaultdict``) has none once it is loaded, as in torch.
    """
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"load_state_dict: the state_dict has {len(saved_groups)} parameter groups, "
            f"this optimizer {len(param_groups)}"
        )
    groups: list[dict[str, Any]] = []
    entries: dict[Key, torch.Tensor] = {}
    labels = _groups.group_labels([g["use_muon"] for g in param_groups])
    # each entry's shape, dtype and device (a row statistic is no parameter's shape)
    structure = layout.structure(param_groups)
    claimed = set()
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"load_state_dict: parameter group {i} has {len(saved['params'])} parameters in the "
                f"state_dict and {len(group['params'])} here"
            )
        route = group["use_muon"]
        if saved.get("use_muon", route) != route:
            raise ValueError(
                f"load_state_dict: parameter group {i} is a {'Muon' if route else 'AdamW'} group here "
                f"and a {'Muon' if not route else 'AdamW'} group in the state_dict"
            )
        # the layout this optimizer's settings ask for: a state saved with another variant does not load
        expected = _groups.state_names(group)
        for index, p in zip(saved["params"], group["params"]):
            slot = layout.slots[p]
            name = f"{dotted(slot.key)!r} (index {index})"
            if index not in saved_state:
                continue  # no state: made at the parameter's next step
            claimed.add(index)
            entry = saved_state[index]
            if not entry:
                continue
            if set(entry) != set(expected):
                raise ValueError(
                    f"load_state_dict: parameter {name} has state {sorted(entry)}, expected {sorted(expected)}"
                    + _layout_hint(group, saved)
                )
            for torch_name, field in expected.items():
                entry_key = (labels[i], *field, *slot.key)
                entries[entry_key] = loaded_value(name, torch_name, entry[torch_name], structure.get(entry_key))
        # torch deep-copies the saved groups: a scheduler of the source must not reach this optimizer
        new_group = copy.deepcopy(_groups.upgraded({k: v for k, v in saved.items() if k != "params"}, route))
        new_group["params"] = group["params"]
        if "param_names" in group:
            new_group["param_names"] = group["param_names"]
        new_group["use_muon"] = route
        for name in _groups.FUNCTION_SETTINGS:  # a function is not saved: the loading group keeps its own
            if name not in saved and name in group:
                new_group[name] = group[name]
        for key, default in _groups.settings_defaults(route, defaults).items():
            new_group.setdefault(key, default)
        if route:
            _groups.resolve_variant(f"load_state_dict: parameter group {i}", new_group, given=())
        if route and _groups.state_names(new_group) != expected:  # a group without parameters says so here
            raise ValueError(
                f"load_state_dict: parameter group {i} keeps state {sorted(expected)} here and "
                f"{sorted(_groups.state_names(new_group))} in the state_dict" + _layout_hint(group, new_group)
            )
        check(i, new_group)
        groups.append(new_group)
    others = {k: v for k, v in saved_state.items() if k not in claimed}
    return Loaded(groups, entries, others)
