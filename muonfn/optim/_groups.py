"""Param groups of the shim: how parameters are read, routed, keyed and scheduled."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple

import torch

from .._keys import Key, dotted
from .._validation import flag, non_negative, positive, unit_interval
from ..linalg import Coefficients, CoefficientsLike, MatrixFn, NewtonSchulz, ns_schedule, polar, qr_orthogonal
from ..presets import ADAMW, MUON, NEWTON_SCHULZ_SPELLINGS, VARIANT_DEFAULTS, VARIANT_OPTIONS, VARIANTS
from ..transforms import (
    CAUTIOUS_MODES,
    EXP_AVG,
    EXP_AVG_SQ,
    MOMENTUM,
    RESCALE_MODES,
    ROW_SECOND_MOMENT,
    SECOND_MOMENT,
    STEP,
    newton_schulz_setting,
)

# Where the shim keeps each keyword of the presets (muonfn.muon, normuon, adamuon): these tables
# (but SHIM_OWN) hold exactly the presets' keywords, and the shim takes exactly these and SHIM_OWN
# (tests/test_shim_options.py fails the day they differ).

#: Per param group, fed to the transform as 0-d tensors refreshed before every step. An AdamW
#: group's momentum is its beta1: torch's schedulers that cycle momentum (OneCycleLR, CyclicLR)
#: write ``"momentum"`` into every group of an optimizer whose ``defaults`` hold it, as the
#: shim's do (they would write ``"betas"`` into every group only where the defaults hold that).
SCHEDULED = ("lr", "momentum", "weight_decay")
#: The whole Newton–Schulz setting (taken by the constructor and group dicts), kept as NEWTON_SCHULZ.
WHOLE_NEWTON_SCHULZ = "ns"
#: The Newton–Schulz setting's flat spellings, per Muon group.
NEWTON_SCHULZ = NEWTON_SCHULZ_SPELLINGS
#: Per Muon group, read when the transform is built (a change rebuilds it).
MUON_SETTINGS = (
    "variant",
    "nesterov",
    "momentum_bias_correction",
    "cautious_weight_decay",
    "cautious_mode",
    *NEWTON_SCHULZ,
    "scale",
    "extra_scale",
    *VARIANT_OPTIONS,
)
#: Muon-group settings the branch builders take as the group holds them.
AS_GIVEN = ("momentum_bias_correction", "cautious_weight_decay", "cautious_mode", "scale", "extra_scale")
#: Per AdamW group, read when the transform is built: its beta2 and eps (torch.optim.AdamW's
#: ``betas[1]`` and ``eps``), its Nesterov-Adam and cautious decay.
ADAMW_SETTINGS = ("beta2", "eps", "nesterov", "cautious_weight_decay")
#: What a Muon group (True) and an AdamW group (False) hold, besides their params, param_names
#: and use_muon: each only the settings that act on it.
SETTINGS_OF = {True: (*SCHEDULED, *MUON_SETTINGS), False: (*SCHEDULED, *ADAMW_SETTINGS)}
#: The constructor's keywords for the AdamW groups, and the entries of an AdamW group each sets.
ADAMW_KEYWORDS = {
    "adamw_lr": ("lr",),
    "adamw_betas": ("momentum", "beta2"),
    "adamw_eps": ("eps",),
    "adamw_weight_decay": ("weight_decay",),
    "adamw_nesterov": ("nesterov",),
}
#: Of those, the ones whose ``None`` is the Muon value: read for a group given without ``use_muon``.
SPLIT_ONLY = ("adamw_lr", "adamw_weight_decay")
#: Given once, for every group: tables and functions by parameter name, the distributed setup, donation.
PER_OPTIMIZER = (
    "labels",
    "views",
    "weight_decay_mask",
    "bucket_numel",
    "collectives",
    "strategy",
    "shard_specs",
    "replicated",
    "overlap",
    "donate_state",
)
#: The shim's own keywords: no preset takes them.
SHIM_OWN = ("variant", "chunk_numel", "compile", "adjust_lr_fn", "eps")
#: The optimizer's ``defaults``: the constructor's keywords for every group (the AdamW groups'
#: under their keywords' names; ``adamw_lr`` and ``adamw_weight_decay``, whose ``None`` is the
#: Muon value, are kept apart).
GROUP_SETTINGS = (*SCHEDULED, *MUON_SETTINGS, *(k for k in ADAMW_KEYWORDS if k not in SPLIT_ONLY))
#: The settings only Muon groups hold, and those only AdamW groups hold.
MUON_ONLY = tuple(k for k in SETTINGS_OF[True] if k not in SETTINGS_OF[False])
ADAMW_ONLY = tuple(k for k in SETTINGS_OF[False] if k not in SETTINGS_OF[True])
#: Settings that may be functions: a state_dict leaves them out (``torch.load(weights_only=True)``
#: reads no functions), and a load keeps the loading optimizer's.
FUNCTION_SETTINGS = ("ns_method",)
ROUTES = ((True, MUON), (False, ADAMW))

#: A path in a group's functional state, below its label: ``("momentum",)``, ``("second_moment", "exp_avg_sq")``.
Field = tuple[str, ...]


class Entries(NamedTuple):
    """A group's state as ``opt.state[p]`` shows it, as the group's settings lay it out."""

    #: torch's name of each entry -> its field
    fields: dict[str, Field]
    #: torch's name of each entry whose bias correction a setting switches -> torch's name of its count
    counts: dict[str, str]


def entries(group: Mapping[str, Any]) -> Entries:
    """A group's entries: AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``; Muon's ``momentum_buffer``
    (with its ``step`` under ``momentum_bias_correction``), and the second moment its variant
    adds under its own field's name (``row_second_moment``; ``exp_avg_sq``, torch's name for an
    EMA of squares, with its count under AdaMuon's ``second_moment_bias_correction``: ``step``,
    or ``second_moment_step`` where the momentum's count is ``step``)."""
    if not group["use_muon"]:
        return Entries({"step": (STEP,), "exp_avg": (EXP_AVG,), "exp_avg_sq": (EXP_AVG_SQ,)}, {})
    fields: dict[str, Field] = {"momentum_buffer": (MOMENTUM,)}
    counts: dict[str, str] = {}
    momentum_counted = group.get("momentum_bias_correction") is True
    if momentum_counted:
        fields["step"], counts["momentum_buffer"] = (STEP,), "step"
    variant = group["variant"]
    if variant == "normuon":
        fields["row_second_moment"] = (ROW_SECOND_MOMENT,)
    elif variant == "adamuon":
        moment_counted = setting(group, "second_moment_bias_correction") is True
        nested: Field = (SECOND_MOMENT,) if momentum_counted and moment_counted else ()
        fields["exp_avg_sq"] = (*nested, EXP_AVG_SQ)
        if moment_counted:
            count = "second_moment_step" if nested else "step"
            fields[count], counts["exp_avg_sq"] = (*nested, STEP), count
    elif variant != MUON:
        raise ValueError(f"unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    return Entries(fields, counts)


# ---------------------------------------------------------------------------- a group's entries


#: The settings a group given without ``use_muon`` sets for both of its halves.
_BOTH_HALVES = ("lr", "weight_decay", "cautious_weight_decay")
_KNOWN = frozenset((*SETTINGS_OF[True], *SETTINGS_OF[False], *ADAMW_KEYWORDS, WHOLE_NEWTON_SCHULZ))


def group_entries(
    where: str,
    use_muon: bool,
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
    *,
    split: bool,
    adamw_lr: Any = None,
    adamw_weight_decay: Any = None,
) -> dict[str, Any]:
    """A new group's entries (its params aside): the settings of its kind, from the dict it was
    added with (``given``) else the optimizer's ``defaults``, and the dict's entries that are no
    setting (a key of one's own, carried as torch carries it).

    A dict given without ``use_muon`` (``split``) is read as the constructor's keywords: its
    ``adamw_*`` set the AdamW half's entries, its Muon settings (``momentum``, ``nesterov``,
    ``beta2`` among them) the Muon half's, ``lr``, ``weight_decay`` and ``cautious_weight_decay``
    both (the AdamW half's ``lr`` and ``weight_decay``: its ``adamw_*``, else the optimizer's
    ``adamw_lr`` and ``adamw_weight_decay``, else the Muon value). A dict with ``use_muon`` holds
    its group's entries: the other kind's settings are an error; an AdamW group's dict may also
    spell its settings as the constructor does (``adamw_betas``, ``adamw_eps``,
    ``adamw_nesterov``), as group dicts did before AdamW groups had entries of their own.
    """
    if split:
        own = [k for k in given if k in ADAMW_ONLY]
        if own:
            raise ValueError(f"{where}: {own[0]!r} in a group split by labels; set its AdamW half's as adamw_{own[0]}")
        takes = (lambda k: k not in ADAMW_KEYWORDS) if use_muon else (lambda k: k in _BOTH_HALVES or k not in _KNOWN)
        entries = {k: v for k, v in given.items() if takes(k)}
        if not use_muon:
            for name, fallback in (("lr", adamw_lr), ("weight_decay", adamw_weight_decay)):
                if fallback is not None:  # the optimizer's adamw_lr, adamw_weight_decay: over the Muon value
                    entries[name] = fallback
            entries.update(_adamw_spellings(where, given))
    elif use_muon:
        for keyword in ADAMW_KEYWORDS:
            if keyword in given:
                raise ValueError(f"{where}: {keyword!r} sets AdamW groups; this group has use_muon=True")
        entries = dict(given)
    else:
        for keyword in SPLIT_ONLY:
            if keyword in given:
                raise ValueError(
                    f"{where}: {keyword!r} sets the AdamW half of a group split by labels; this group has "
                    f"use_muon=False: set its {keyword.removeprefix('adamw_')!r} instead"
                )
        renamed = _adamw_spellings(where, given)
        for name in given:
            if name in MUON_ONLY or name == WHOLE_NEWTON_SCHULZ:
                raise ValueError(f"{where}: {name!r} is a Muon setting; this group has use_muon=False (AdamW)")
            if name in renamed:
                raise ValueError(f"{where}: {name!r} is given twice, also by the group's adamw_ keyword; pass one")
        entries = {k: v for k, v in given.items() if k not in ADAMW_KEYWORDS}
        for name, fallback in (("lr", adamw_lr), ("weight_decay", adamw_weight_decay)):
            if fallback is not None:
                entries.setdefault(name, fallback)
        entries.update(renamed)
    for name, default in settings_defaults(use_muon, defaults).items():
        entries.setdefault(name, default)
    return entries


def _adamw_spellings(where: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The AdamW group entries that the constructor's ``adamw_*`` keywords in ``given`` set."""
    entries: dict[str, Any] = {}
    for keyword, names in ADAMW_KEYWORDS.items():
        if keyword in given:
            if len(names) > 1:
                check_betas(f"{where}: {keyword}", given[keyword])
            entries.update(zip(names, given[keyword] if len(names) > 1 else (given[keyword],)))
    return entries


def settings_defaults(use_muon: bool, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a group of a kind, as the optimizer's ``defaults`` (the constructor's
    keywords) set them; an AdamW group's ``lr`` and ``weight_decay``: the Muon value."""
    if use_muon:
        return {name: defaults[name] for name in SETTINGS_OF[True]}
    settings = {name: defaults[name] for name in ("lr", "weight_decay", "cautious_weight_decay")}
    for keyword, names in ADAMW_KEYWORDS.items():
        if keyword in defaults:
            settings.update(zip(names, defaults[keyword] if len(names) > 1 else (defaults[keyword],)))
    return {name: settings[name] for name in SETTINGS_OF[False]}


def upgraded(group: Mapping[str, Any], use_muon: bool) -> dict[str, Any]:
    """A group saved (or pickled) before each kind held only its own settings, as it is held now.

    Every group held the settings of both kinds then, AdamW's as ``adamw_betas``, ``adamw_eps``
    and ``adamw_nesterov``: a Muon group drops those; an AdamW group takes them under its names
    and drops Muon's (its ``momentum`` and ``nesterov`` were Muon's, and acted on nothing).
    """
    if "adamw_betas" not in group:
        return dict(group)
    held = {k: v for k, v in group.items() if k not in ADAMW_KEYWORDS}
    if use_muon:
        return held
    adamw = {k: v for k, v in held.items() if k not in SETTINGS_OF[True] or k in _BOTH_HALVES}
    for keyword, names in ADAMW_KEYWORDS.items():
        if keyword in group and keyword not in SPLIT_ONLY:
            adamw.update(zip(names, group[keyword] if len(names) > 1 else (group[keyword],)))
    return adamw


def state_names(group: Mapping[str, Any]) -> dict[str, Field]:
    """torch's name of each state entry of a group, as its settings lay it out -> its field in the functional state."""
    return entries(group).fields


def carried_fields(held: Entries, wanted: Entries) -> dict[Field, Field]:
    """The fields of a group's state that a new layout (``wanted``, from ``held``) takes over
    (new field -> old field); the others start as its ``init`` makes them.

    An entry both layouts hold is carried, with its step count where both count it; a count is
    dropped where the new layout does not count the entry. Where the new layout counts it and
    the old one did not (a bias correction turned on), the count starts at zero and the entry
    it corrects must start with it: divided by ``1 - beta**t`` for a small ``t``, a trained
    moment would grow or shrink the update several times over.
    """
    carried: dict[Field, Field] = {}
    count_names = set(wanted.counts.values())
    for name, field in wanted.fields.items():
        if name in count_names or name not in held.fields:
            continue
        count, held_count = wanted.counts.get(name), held.counts.get(name)
        if count is not None and held_count is None:
            continue
        carried[field] = held.fields[name]
        if count is not None and held_count is not None:
            carried[wanted.fields[count]] = held.fields[held_count]
    return carried


def is_count(field: Field) -> bool:
    """Whether an entry is a step count (an exact int64 count of updates)."""
    return field[-1] == STEP


# ---------------------------------------------------------------------------- variants


#: the options only AdaMuon takes
_ADAMUON_ONLY = ("sign_momentum", "second_moment_bias_correction")


def check_variant(where: str, variant: Any) -> str:
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"{where}: unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    return variant


def _takers(option: str) -> list[str]:
    return [v for v in VARIANTS if option in VARIANT_DEFAULTS[v]]


def refuse_inapplicable(where: str, variant: str, options: Mapping[str, Any]) -> None:
    """Every option given (not ``None``) must be one ``variant`` takes."""
    for name in VARIANT_OPTIONS:
        if options.get(name) is not None and name not in VARIANT_DEFAULTS[variant]:
            raise ValueError(
                f"{where}: {name} does not apply to variant {variant!r}; it is an option of "
                f"{' and '.join(repr(v) for v in _takers(name))}"
            )


def resolve_variant(where: str, group: MutableMapping[str, Any], given: Collection[str]) -> None:
    """Fills a group's ``None`` settings with its variant's defaults, in place.

    An option its variant does not take is an error where the group's own dict (or the
    constructor, for its variant) gave it (``given``), and is dropped (``None``) where it was
    inherited from defaults meant for another variant.
    """
    variant = check_variant(where, group["variant"])
    refuse_inapplicable(where, variant, {k: v for k, v in group.items() if k in given})
    defaults = VARIANT_DEFAULTS[variant]
    for name in ("momentum", "nesterov", *VARIANT_OPTIONS):
        if name not in defaults:
            group[name] = None
        elif group.get(name) is None:
            group[name] = defaults[name]


def setting(group: Mapping[str, Any], name: str) -> Any:
    """A group's value of a setting whose default depends on its variant: ``None`` is the variant's
    default; ``None`` also where the variant does not take it (its value is then ignored)."""
    defaults = VARIANT_DEFAULTS[group["variant"]]
    if name not in defaults:
        return None
    value = group.get(name)
    return defaults[name] if value is None else value


def adapted_settings(group: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of ``matrix_branch`` a NorMuon or AdaMuon group sets."""
    options = {name: setting(group, name) for name in VARIANT_OPTIONS}
    for name in _ADAMUON_ONLY:  # off for NorMuon, as normuon() passes them
        if options[name] is None:
            options[name] = False
    # beta2 is a setting, read when the transform is built (like torch, a one-element tensor is a number)
    options["beta2"] = float(options["beta2"])
    return options


def check_variant_settings(group_index: int, group: Mapping[str, Any]) -> None:
    """The core's checks of a Muon group's variant options, naming the group (the core would name
    ``beta``, its own keyword)."""
    where = f"param group {group_index}"
    variant = check_variant(where, group["variant"])
    if variant == MUON:
        return
    unit_interval(f"{where}: beta2", group_value(group_index, "beta2", setting(group, "beta2")))
    positive(f"{where}: adaptive_eps", setting(group, "adaptive_eps"))
    rescale = setting(group, "rescale")
    if rescale not in RESCALE_MODES:
        raise ValueError(f"{where}: unknown rescale {rescale!r}; choose one of {list(RESCALE_MODES)}")
    for name in _ADAMUON_ONLY:
        if name in VARIANT_DEFAULTS[variant]:
            flag(f"{where}: {name}", setting(group, name))


def check_switches(group_index: int, group: Mapping[str, Any]) -> None:
    """The core's checks of a group's switches, naming the group (the core would name its preset)."""
    where = f"param group {group_index}"
    flag(f"{where}: cautious_weight_decay", group["cautious_weight_decay"])
    if group["use_muon"]:
        flag(f"{where}: momentum_bias_correction", group["momentum_bias_correction"])
        mode = group["cautious_mode"]
        if mode is not None and mode not in CAUTIOUS_MODES:
            raise ValueError(f"{where}: unknown cautious_mode {mode!r}; choose None or one of {list(CAUTIOUS_MODES)}")
        return
    nesterov = group["nesterov"]
    if not (isinstance(nesterov, bool) or (isinstance(nesterov, str) and nesterov == "timm")):
        raise ValueError(f"{where}: nesterov must be True, False or 'timm' (AdamW's), got {nesterov!r}")


def refuse_whole_setting(group_index: int, group: Mapping[str, Any]) -> None:
    """A group keeps its Newton–Schulz setting as its ``ns_*`` entries: an ``"ns"`` entry written
    into ``param_groups`` would be ignored."""
    if WHOLE_NEWTON_SCHULZ in group:
        raise ValueError(
            f"param group {group_index} holds {WHOLE_NEWTON_SCHULZ!r}; a group keeps its Newton–Schulz setting as its "
            f"entries {list(NEWTON_SCHULZ)}: set those (ns= is taken by the constructor and add_param_group)"
        )


def refuse_keywords(group_index: int, group: Mapping[str, Any]) -> None:
    """An AdamW keyword of the constructor (``adamw_betas``, ...) written into ``param_groups``
    would be ignored: an AdamW group holds its settings under its own names."""
    for keyword, names in ADAMW_KEYWORDS.items():
        if keyword in group:
            where = "" if not group["use_muon"] else " (this is a Muon group)"
            raise ValueError(
                f"param group {group_index} holds {keyword!r}, a keyword of the constructor; an AdamW group "
                f"holds it as {' and '.join(map(repr, names))}: set {'those' if len(names) > 1 else 'that'}{where}"
            )


class Slot(NamedTuple):
    """Where a parameter lives: its group, its key, and its group's state label."""

    group: int
    key: Key
    label: str
    use_muon: bool


def check_members(groups: Sequence[Mapping[str, Any]], slots: Mapping[torch.Tensor, Slot], added: int) -> None:
    """The groups are the ``added`` ones, each holding the parameters it was added with (in any
    order); else an error naming the group and the parameter.

    torch.optim would step a tensor appended to a group's ``params`` (and stop stepping one
    removed), but here a parameter's key, route, view and state are laid out when its group is
    added: ``add_param_group`` is the way to add parameters. A group or a parameter in
    ``param_groups`` twice would be stepped twice (torch steps it so).
    """
    first_group: dict[torch.Tensor, int] = {}
    for i, group in enumerate(groups):
        repeated = next((j for j in range(i) if groups[j] is group), None)
        if repeated is not None:
            raise ValueError(
                f"param group {i} is param group {repeated} again; a group is stepped once: remove the repeat "
                "from param_groups"
            )
        for p in group["params"]:
            j = first_group.setdefault(p, i) if isinstance(p, torch.Tensor) else i
            if j != i:
                slot = slots.get(p)
                shown = repr(dotted(slot.key)) if slot is not None else f"of shape {tuple(p.shape)}"
                raise ValueError(
                    f"param group {i}: parameter {shown} is also in param group {j}; a parameter is stepped once, "
                    "by one group"
                )
    if len(groups) != added:
        raise ValueError(
            f"param_groups holds {len(groups)} groups, but {added} were added (by the constructor and "
            "add_param_group): add a group with add_param_group, and remove none"
        )
    for i, group in enumerate(groups):
        for position, p in enumerate(group["params"]):
            slot = slots.get(p) if isinstance(p, torch.Tensor) else None
            if slot is None:
                shown = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
                raise ValueError(
                    f"param group {i}: params[{position}] ({shown}) was not in the group when it was added; "
                    "a parameter's state is laid out when its group is added: add it with add_param_group"
                )
            if slot.group != i:
                raise ValueError(
                    f"param group {i}: parameter {dotted(slot.key)!r} was added to param group {slot.group} "
                    "and cannot move; its state is laid out for that group"
                )
    counts = [0] * len(groups)
    for slot in slots.values():
        counts[slot.group] += 1
    for i, group in enumerate(groups):
        params = group["params"]
        held = set(params)
        if len(held) != len(params):
            repeated = next(p for k, p in enumerate(params) if any(p is q for q in params[:k]))
            raise ValueError(f"param group {i}: parameter {dotted(slots[repeated].key)!r} is in its params twice")
        if len(held) != counts[i]:
            missing = next(slot.key for p, slot in slots.items() if slot.group == i and p not in held)
            raise ValueError(
                f"param group {i}: parameter {dotted(missing)!r} is no longer in its params; a group keeps "
                "the parameters it was added with: put it back (a parameter without a gradient is not stepped)"
            )


def group_labels(routes: Sequence[bool]) -> list[str]:
    """``"muon"``, ``"adamw"``, ``"muon_1"``, ...: the k-th group of a kind gets suffix k (none for 0)."""
    seen = {True: 0, False: 0}
    labels = []
    for use_muon in routes:
        k = seen[use_muon]
        seen[use_muon] += 1
        base = MUON if use_muon else ADAMW
        labels.append(base if k == 0 else f"{base}_{k}")
    return labels


def index_slots(groups: Sequence[Mapping[str, Any]], keys: Mapping[torch.Tensor, Key]) -> dict[torch.Tensor, Slot]:
    """Every parameter's group, key and state label."""
    labels = group_labels([g["use_muon"] for g in groups])
    return {p: Slot(i, keys[p], labels[i], g["use_muon"]) for i, g in enumerate(groups) for p in g["params"]}


def group_value(group_index: int, name: str, value: Any) -> float:
    """A group's number as a float; like torch, any one-element real tensor is a number here."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"param group {group_index}: {name} must be a number, got a tensor of shape {tuple(value.shape)}"
            )
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"param group {group_index}: {name} must be a real number, got a {value.dtype} tensor")
        if value.is_meta:
            raise ValueError(f"param group {group_index}: {name} is a tensor on the meta device, which holds no value")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"param group {group_index}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def new_scalars(group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The 0-d tensors a group's transform reads its scheduled hyperparameters from.

    float64 on the host: the core then computes what it computes from a Python float
    (``1 - momentum`` in double, one rounding to the parameter's dtype), bit for bit, and
    reading them never waits for a device.
    """
    return {name: torch.tensor(float(group[name]), dtype=torch.float64) for name in SCHEDULED}


def check_scheduled(group_index: int, group: Mapping[str, Any]) -> None:
    """The core's checks, for values a scheduler or a user may have changed since construction."""
    for name in SCHEDULED:
        value = group_value(group_index, name, group[name])
        check = unit_interval if name == "momentum" else non_negative
        check(f"param group {group_index}: {name}", value)
    if not group["use_muon"]:
        unit_interval(f"param group {group_index}: beta2", group_value(group_index, "beta2", group["beta2"]))
        positive(f"param group {group_index}: eps", group["eps"])


def check_betas(where: str, betas: Any) -> None:
    """``adamw_betas`` must be two numbers in [0, 1): the core would read the first two of a
    longer sequence, and name them by its own spelling."""
    if isinstance(betas, str | bytes) or not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"{where} must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        unit_interval(f"{where}[{i}]", beta)


def plain_coefficients(value: CoefficientsLike) -> Any:
    """A schedule in a form ``torch.load(weights_only=True)`` reads back: a name, or a tuple of
    triples with, for a norm factor other than 1, ``("norm_factor", c)`` in front."""
    ns_schedule(value)  # a malformed schedule is named here, before it is taken apart
    if isinstance(value, str):
        return value
    triples = value.triples if isinstance(value, Coefficients) else value
    plain = tuple(tuple(float(v) for v in t) for t in triples)
    if isinstance(value, Coefficients) and value.norm_factor != 1.0:
        return (("norm_factor", float(value.norm_factor)), *plain)
    return plain


def newton_schulz_fields(ns: MatrixFn) -> dict[str, Any]:
    """The group entries that keep ``ns``, the whole Newton–Schulz setting: a
    :class:`~muonfn.NewtonSchulz` as its fields; :func:`muonfn.polar` and
    :func:`~muonfn.linalg.qr_orthogonal` by their names, ``"svd"`` and ``"qr"``, so that a
    state_dict holds them as data; another map as ``ns_method``, the other entries at their defaults."""
    if isinstance(ns, NewtonSchulz):
        return {
            "ns_coefficients": plain_coefficients(ns.coefficients),
            "ns_steps": ns.steps,
            "ns_dtype": ns.dtype,
            "ns_eps": ns.eps,
            "ns_method": ns.method,
            "ns_eps_mode": ns.eps_mode,
            "ns_restarts": ns.restarts,
        }
    method = "svd" if ns is polar else "qr" if ns is qr_orthogonal else ns
    return {**newton_schulz_fields(NewtonSchulz()), "ns_method": method}


def ns_entries(where: str, param_group: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ns_*`` entries that a group dict's ``"ns"`` (the whole Newton–Schulz setting) stands
    for (none without one); given with them, they must keep their defaults."""
    ns = param_group.get(WHOLE_NEWTON_SCHULZ)
    if ns is None:
        return {}
    flat = {name: param_group[name] for name in NEWTON_SCHULZ if name in param_group}
    newton_schulz_setting(where, ns, **flat)
    return newton_schulz_fields(ns)


def coefficients_of(value: Any) -> CoefficientsLike:
    """Inverse of :func:`plain_coefficients`."""
    if isinstance(value, tuple) and value and isinstance(value[0], tuple) and value[0][:1] == ("norm_factor",):
        return Coefficients(tuple(value[1:]), value[0][1])
    return value


def read_params(
    param_group: Mapping[str, Any], existing: Sequence[Mapping[str, Any]]
) -> tuple[list[torch.Tensor], list[str] | None]:
    """The tensors of a group and their names (``None`` without), as torch reads them."""
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need a deterministic order: pass a list, not a set")
    params = list(params)
    named = [isinstance(p, tuple) for p in params]
    if any(named) and not all(named):
        raise ValueError("all optimizer params should be with or without names; some names are missing")
    with_names = bool(params) and all(named)
    if existing and with_names != ("param_names" in existing[0]):
        raise ValueError(
            "all optimizer param groups should be with/without names; "
            f"cannot add a param group {'with' if with_names else 'without'} names"
        )
    if with_names:
        return [p for _, p in params], [name for name, _ in params]
    return params, None


def check_new_params(
    tensors: Sequence[Any], keys: Sequence[Key], slots: Mapping[torch.Tensor, Slot], *, named: bool
) -> None:
    """New parameters must be distinct leaf floating-point tensors, under names not yet taken.

    ``named``: ``keys`` are the names the tensors were given, not positions assigned to them here.
    """
    known_keys = {slot.key for slot in slots.values()}
    seen: dict[torch.Tensor, str] = {}
    for p, key in zip(tensors, keys):
        name = dotted(key)
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"optimizer can only optimize tensors, but {name!r} is a {type(p).__name__}")
        if not (p.is_leaf or p.retains_grad):
            raise ValueError(f"can't optimize a non-leaf tensor ({name!r})")
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only real floating-point tensors train")
        if p in seen:
            raise ValueError(f"parameter {name!r} is the same tensor as {seen[p]!r}; pass each tensor once")
        if p in slots:
            # by the key it has: a position assigned to the repeat would name a parameter that does not exist
            known = dotted(slots[p].key)
            again = f" (given again as {name!r})" if named and name != known else ""
            raise ValueError(f"parameter {known!r}{again} is already in parameter group {slots[p].group}")
        if key in known_keys:
            raise ValueError(f"a parameter named {name!r} is already being optimized")
        seen[p] = name
    _check_nesting([*known_keys, *keys])


def _check_nesting(keys: Sequence[Key]) -> None:
    """No key may be a node above another (``"0"`` and ``"0.weight"``): the state nests by key."""
    above = {key[:i]: key for key in keys for i in range(1, len(key))}
    for key in keys:
        below = above.get(key)
        if below is not None:
            raise ValueError(
                f"parameter names {dotted(key)!r} and {dotted(below)!r} nest (the state is a tree by name); rename one"
            )


#: ``chunk_numel="auto"``: about this many parts, each of at least ``AUTO_MIN_CHUNK`` elements
AUTO_PARTS, AUTO_MIN_CHUNK = 10, 2**18


def check_chunk_numel(chunk_numel: int | str | None) -> int | str | None:
    if chunk_numel is None or chunk_numel == "auto":
        return chunk_numel
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
        raise ValueError(f"chunk_numel must be a positive int, 'auto' or None, got {chunk_numel!r}")
    return chunk_numel


def part_kind(group: int, p: torch.Tensor) -> tuple[Hashable, Hashable]:
    """How :func:`chunks` keeps together the parameters the one-part step stacks into one
    Newton–Schulz call: by group, dtype and shape, an ``(m, n)`` matrix with the ``(n, m)``
    ones (Newton–Schulz orients a matrix by its shape, so an MLP's up and down projections
    share a call), then by the exact shape (a scale that tells those apart gives each its own).
    A parameter of more dimensions goes by its shape: the blocks its view reads may share a call
    with another shape's, which parts may then split (within the bound of the shim's page)."""
    shape = tuple(p.shape)
    return (group, p.dtype, tuple(sorted(shape)) if len(shape) == 2 else shape), shape


def chunks(
    sizes: Sequence[int], chunk_numel: int | str | None, kinds: Sequence[tuple[Hashable, ...]] = ()
) -> list[list[int]]:
    """Indices of ``sizes`` in parts of at most ``chunk_numel`` elements (a tensor larger than
    that is a part of its own); one part when ``chunk_numel`` is ``None``.

    ``kinds`` (one tuple of keys per size, outermost first, as :func:`part_kind` makes them):
    tensors of a kind are taken together, kinds in the order they first appear, and a kind
    that fits in a part is never split across two: it starts a part of its own where the
    current one has no room. A kind larger than a part is split by its next key, and the
    tensors of its innermost kinds one by one. So same-shape matrices keep their one
    Newton–Schulz call whenever they fit in a part (a batched matrix product may round each
    matrix differently by the batch's size).
    """
    if chunk_numel == "auto":
        chunk_numel = max(sum(sizes) // AUTO_PARTS, AUTO_MIN_CHUNK)
    if chunk_numel is None or isinstance(chunk_numel, str):
        return [list(range(len(sizes)))] if sizes else []
    cap = chunk_numel
    kinds = kinds or [(i,) for i in range(len(sizes))]
    out: list[list[int]] = [[]]
    held = 0

    def place(members: list[int]) -> None:
        nonlocal held
        numel = sum(sizes[i] for i in members)
        if out[-1] and held + numel > cap:
            out.append([])
            held = 0
        out[-1].extend(members)
        held += numel

    def pack(members: list[int], level: int) -> None:
        if sum(sizes[i] for i in members) <= cap or len(members) == 1:
            place(members)
        elif level == len(kinds[members[0]]):
            for i in members:
                place([i])
        else:
            for sub in _by_key(members, [kinds[i][level] for i in members]):
                pack(sub, level + 1)

    for members in _by_key(list(range(len(sizes))), [kind[0] for kind in kinds]):
        pack(members, 1)
    # each part in the step's order: a call the one-part step makes is made here with its matrices in its order
    return [sorted(part) for part in out] if out[0] else []


def _by_key(members: list[int], keys: Sequence[Hashable]) -> list[list[int]]:
    """``members`` grouped by their ``keys``, in the order the keys first appear."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in zip(members, keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())
