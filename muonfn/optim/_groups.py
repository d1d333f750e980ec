"""What a param group holds: the settings of its kind, read from a group dict and the constructor's
keywords; its Newton–Schulz entries, as data a state_dict keeps; the branch it translates into; and
the entries of each parameter's state, under torch's names, laid out as the presets keep them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ..linalg import SCALE_MODES, Coefficients, NewtonSchulz, ns_schedule, polar, qr_orthogonal
from ..presets import VARIANT_DEFAULTS, VARIANT_OPTIONS, VARIANTS
from ..steps import second_moment_dtype

#: A Muon group's settings (``eps``: Newton–Schulz's, as torch.optim.Muon's; ``adjust_lr_fn``: the shape scale)
MUON_SETTINGS = (
    "lr",
    "momentum",
    "weight_decay",
    "variant",
    "nesterov",
    "momentum_bias_correction",
    "cautious_weight_decay",
    "cautious_mode",
    "ns_coefficients",
    "ns_steps",
    "eps",
    "ns_dtype",
    "ns_method",
    "ns_eps_mode",
    "ns_restarts",
    "adjust_lr_fn",
    "extra_scale",
    "state_dtype",
    *VARIANT_OPTIONS,
)
#: An AdamW group's settings: its β₁ is ``momentum``, so that torch's schedulers that cycle momentum
#: (OneCycleLR, CyclicLR: ``"momentum"`` into every group unless ``"betas"`` is a default) move it too.
ADAMW_SETTINGS = ("lr", "momentum", "beta2", "eps", "weight_decay", "nesterov", "cautious_weight_decay", "state_dtype")
#: The settings a scheduler changes: 0-d tensors of the branch, refilled before every step.
SCHEDULED = ("lr", "momentum", "weight_decay")
#: The settings that choose a group's state entries (``state_dtype``: their dtype, and a bf16 momentum's count)
SHAPING = ("variant", "momentum_bias_correction", "second_moment_bias_correction", "state_dtype")
#: What a split group's AdamW half takes from the group dict besides the adamw_* keywords
SHARED = ("lr", "weight_decay", "cautious_weight_decay", "state_dtype")
#: The constructor's spellings of an AdamW group's entries, which a ``use_muon=False`` group dict may use
ADAMW_SPELLINGS = {"adamw_betas": ("momentum", "beta2"), "adamw_eps": ("eps",), "adamw_nesterov": ("nesterov",)}
#: A split group's AdamW half: its ``lr`` and ``weight_decay``
SPLIT_HALVES = {"adamw_lr": "lr", "adamw_weight_decay": "weight_decay"}
#: A group's Newton–Schulz entries at their defaults (``ns_method`` besides: "standard", "gram", "svd", "qr", a map)
NS_DEFAULTS = {
    "ns_coefficients": "keller",
    "ns_steps": None,
    "eps": 1e-7,
    "ns_dtype": None,
    "ns_eps_mode": "clamp",
    "ns_restarts": None,
}
#: Every Newton–Schulz entry of a group at its default
NS_ENTRIES = {**NS_DEFAULTS, "ns_method": "standard"}
#: The entries of a state that are counts (exact int64) and second moments (fp32 for fp16 parameters)
COUNTS, SECOND_MOMENTS = ("step", "second_moment_step"), ("exp_avg_sq", "row_second_moment")


class Constructor(NamedTuple):
    """What a group dict does not set: the constructor's settings of each kind, and its ``adamw_lr`` and
    ``adamw_weight_decay`` for a split dict's AdamW half."""

    muon: dict[str, Any]
    adamw: dict[str, Any]
    split: dict[str, Any]


def group_of(where: str, given: Mapping[str, Any], use_muon: bool, constructor: Constructor) -> dict[str, Any]:
    """The settings of a group of one kind (no ``params``) from a group dict: its kind's, given or the
    constructor's, and entries of one's own (``initial_lr``, a tag). A group dict without ``use_muon`` is
    split: its AdamW half takes the shared settings and the ``adamw_*`` keywords; the other kind's
    settings are refused where the dict has a kind."""
    own = {k: v for k, v in given.items() if k not in ("params", "param_names", "use_muon")}
    split = "use_muon" not in given
    if split and "eps" in own:
        raise ValueError(f"{where}: 'eps' in a group split by labels; set its AdamW half's as adamw_eps")
    if use_muon:
        stray = [k for k in own if k.startswith("adamw_")]
        if stray and not split:
            raise ValueError(f"{where}: {stray[0]!r} sets AdamW groups; this group has use_muon=True")
        own = {k: v for k, v in own.items() if k not in stray}
        if "ns" in own or "ns_coefficients" in own:  # (a whole ns, or torch's one triple for each of ns_steps)
            ns, entries = own.pop("ns", None), {k: own.pop(k) for k in NS_ENTRIES if k in own}
            # torch's spellings change the entries they name; the others are the constructor's, as a group's are
            own.update(ns_entries(where, ns, entries if ns is not None else {**constructor.muon, **entries}))
        group = {**constructor.muon, **own}
        variant = group["variant"]
        if variant not in VARIANTS:
            raise ValueError(f"{where}: unknown variant {variant!r}; choose one of {list(VARIANTS)}")
        defaults = VARIANT_DEFAULTS[variant]
        for name in ("momentum", "nesterov", *VARIANT_OPTIONS):  # (None: the variant's default)
            # an option another variant takes: refused where given, dropped where inherited from the
            # constructor by a group of its own variant (one without inherits them as given)
            if name not in defaults and group[name] is not None and (name in own or "variant" not in own):
                takers = " and ".join(repr(v) for v in VARIANTS if name in VARIANT_DEFAULTS[v])
                raise ValueError(f"{where}: {name} does not apply to variant {variant!r}; it is an option of {takers}")
            if name not in defaults:
                group[name] = None
            elif group[name] is None:
                group[name] = defaults[name]
        return group
    if split:
        own = {k: v for k, v in own.items() if k in SHARED or k not in (*MUON_SETTINGS, "ns")}
        halves = {key: own.pop(half, constructor.split[half]) for half, key in SPLIT_HALVES.items()}
        own.update({key: v for key, v in halves.items() if v is not None})
    for key in own:
        if key == "ns" or (key in MUON_SETTINGS and key not in ADAMW_SETTINGS):
            raise ValueError(f"{where}: {key!r} is a Muon setting; this group has use_muon=False")
    for spelling, keys in ADAMW_SPELLINGS.items():
        if spelling in own:
            value = own.pop(spelling)
            values = tuple(value) if len(keys) == 2 and isinstance(value, tuple | list) else (value,)
            if len(values) != len(keys):
                raise ValueError(f"{where}: {spelling} must be a pair (beta1, beta2), got {value!r}")
            for key, v in zip(keys, values):
                if key in own:
                    raise ValueError(f"{where}: {key!r} is given twice, as {key} and in {spelling}")
                own[key] = v
    return {**constructor.adamw, **own}


# ---------------------------------------------------------------------------------------------- Newton–Schulz


def ns_entries(where: str, ns: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """A group's Newton–Schulz entries, data a state_dict holds: torch's spellings (``given``'s
    ``ns_coefficients``, one ``(a, b, c)`` for each of ``ns_steps``, 5 when not given; its other entries kept), or a
    whole ``ns`` (a :class:`~muonfn.NewtonSchulz` as its fields, ``"svd"``/:func:`~muonfn.polar`, ``"qr"``,
    ``"gram"``, a map of one's own as ``ns_method``), beside which ``given`` must keep the defaults."""
    if ns is None:
        coefficients, steps = given.get("ns_coefficients", "keller"), given.get("ns_steps")
        triple = isinstance(coefficients, tuple | list) and len(coefficients) == 3  # (torch.optim.Muon's one)
        if triple and all(isinstance(v, int | float) and not isinstance(v, bool) for v in coefficients):
            coefficients, steps = (tuple(float(v) for v in coefficients),) * (5 if steps is None else steps), None
        ns_schedule(coefficients, steps)
        named = {k: given.get(k, default) for k, default in NS_ENTRIES.items()}
        return {**named, "ns_coefficients": _plain(coefficients), "ns_steps": steps}
    ignored = [f"{k}={given[k]!r}" for k, v in NS_ENTRIES.items() if given.get(k) is not None and given[k] != v]
    if ignored:
        raise ValueError(
            f"{where}: ns= is the whole Newton–Schulz setting: leave ns_coefficients, ns_steps and eps (and a "
            f"group's other ns_* entries) out with it; beside ns={ns!r}, {', '.join(ignored)} would be ignored"
        )
    if isinstance(ns, NewtonSchulz):
        return {
            "ns_coefficients": _plain(ns.coefficients),
            "ns_steps": ns.steps,
            "eps": ns.eps,
            "ns_dtype": ns.dtype,
            "ns_method": ns.method,
            "ns_eps_mode": ns.eps_mode,
            "ns_restarts": ns.restarts,
        }
    if ns not in ("svd", "qr", "gram") and (isinstance(ns, str) or not callable(ns)):
        raise TypeError(
            f"{where}: ns must be a muonfn.NewtonSchulz, 'svd', 'qr', 'gram' or a map of (count, m, n) batches, "
            f"got {ns!r}"
        )
    return {**NS_DEFAULTS, "ns_method": "svd" if ns is polar else "qr" if ns is qr_orthogonal else ns}


def _plain(coefficients: Any) -> Any:
    """A schedule as data ``torch.load(weights_only=True)`` reads: a name, or triples (a norm factor
    other than 1 in front as ``("norm_factor", c)``)."""
    if isinstance(coefficients, str):
        return coefficients
    schedule = ns_schedule(coefficients)
    plain = tuple(tuple(t) for t in schedule.triples)
    return (("norm_factor", schedule.norm_factor), *plain) if schedule.norm_factor != 1.0 else plain


def ns_of(group: Mapping[str, Any]) -> Any:
    """The group's map of ``(count, m, n)`` batches; settings that a map without Newton–Schulz would
    ignore are refused."""
    method = group["ns_method"]
    if method in ("standard", "gram"):
        coefficients = group["ns_coefficients"]
        if isinstance(coefficients, tuple) and coefficients and coefficients[0][:1] == ("norm_factor",):
            coefficients = Coefficients(tuple(coefficients[1:]), coefficients[0][1])
        return NewtonSchulz(
            coefficients,
            group["ns_steps"],
            group["eps"],
            group["ns_dtype"],
            method,
            group["ns_eps_mode"],
            group["ns_restarts"],
        )
    if isinstance(method, str) and method not in ("svd", "qr"):
        raise ValueError(f"unknown ns_method {method!r}; choose 'standard', 'gram', 'svd', 'qr' or a map of one's own")
    ignored = [f"{k}={group[k]!r}" for k, default in NS_DEFAULTS.items() if group[k] != default]
    if ignored:
        shown = repr(method) if isinstance(method, str) else getattr(method, "__name__", repr(method))
        raise ValueError(f"ns_method={shown} does not run Newton–Schulz, so {', '.join(ignored)} would be ignored")
    return {"svd": polar, "qr": qr_orthogonal}.get(method, method)


def scale_of(adjust_lr_fn: Any, extra_scale: Any) -> Any:
    """torch's ``adjust_lr_fn`` (``None``: ``"original"``) times ``extra_scale`` as muonfn's scale."""
    if adjust_lr_fn is not None and (not isinstance(adjust_lr_fn, str) or adjust_lr_fn not in SCALE_MODES):
        raise ValueError(f"adjust_lr_fn must be None or one of {sorted(SCALE_MODES)}, got {adjust_lr_fn!r}")
    if isinstance(extra_scale, bool) or not isinstance(extra_scale, int | float) or not 0 <= extra_scale < math.inf:
        raise ValueError(f"extra_scale must be a finite float >= 0, got {extra_scale!r}")
    return (adjust_lr_fn or "original", extra_scale)


# ---------------------------------------------------------------------------------------------- state


def layout(group: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """A parameter's state entries under torch's names -> their place in its group's functional state
    (as ``muonfn.muon``, ``normuon``, ``adamuon`` and ``adamw`` keep it), from the group's settings."""
    if not group.get("use_muon"):
        return {"step": ("step",), "exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",)}
    counted, narrow = counts(group), group.get("state_dtype") is torch.bfloat16
    moment = {"normuon": "row_second_moment", "adamuon": "exp_avg_sq"}.get(group.get("variant", ""))
    # a bf16 momentum and AdaMuon's bf16 second moment count their updates too (the rounding's key);
    # where both count, the second moment and its count are kept under "second_moment"
    moment_counts = moment in counted or (narrow and moment == "exp_avg_sq")
    nested = moment_counts and ("momentum_buffer" in counted or narrow)
    entries: dict[str, tuple[str, ...]] = {"momentum_buffer": ("momentum",)}
    if "momentum_buffer" in counted or narrow:
        entries["step"] = ("step",)
    if moment is not None:
        entries[moment] = ("second_moment", moment) if nested else (moment,)
        if moment_counts:
            entries["second_moment_step" if nested else "step"] = ("second_moment", "step") if nested else ("step",)
    return entries


def counts(group: Mapping[str, Any]) -> dict[str, str]:
    """The bias-corrected entries of a Muon group's state (torch's names) -> the count that corrects each."""
    counted = {"momentum_buffer": "step"} if group.get("momentum_bias_correction") else {}
    if group.get("variant") == "adamuon" and group.get("second_moment_bias_correction"):
        nested = counted or group.get("state_dtype") is torch.bfloat16
        counted["exp_avg_sq"] = "second_moment_step" if nested else "step"
    return counted


def relaid(held: dict[str, Any], before: dict[str, Any], after: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """A parameter's state ``held`` for a group whose settings changed from ``before`` to ``after`` (its
    variant, a bias correction, its ``state_dtype``), as a functional hand-off to them lays it out: the
    entries both keep are kept, with their counts where both count them, in the dtypes ``after`` keeps
    (narrowed to bf16 rounded to nearest, as a load narrows); an entry whose bias correction starts now
    starts anew with its count (a trained moment divided by ``1 - β`` would grow the update several times
    over). What is not kept is made at the parameter's next step (a bf16 momentum's count from 0)."""
    old, new = counts(before), counts(after)
    wanted = set(layout(after)) - set(new.values())
    kept = {}
    for name in [n for n in held if n in wanted and (n not in new or n in old)]:
        cast = name not in COUNTS and isinstance(held[name], torch.Tensor)
        kept[name] = held[name].to(kept_dtype(after, name, p)) if cast else held[name]
        if name in new and old[name] in held:
            kept[new[name]] = held[old[name]]
    return kept


def kept_dtype(group: Mapping[str, Any], entry: str, p: torch.Tensor) -> torch.dtype:
    """The dtype ``group`` keeps parameter ``p``'s state ``entry`` (not a count) in: its ``state_dtype``
    for the momentum, AdamW's and AdaMuon's moments, else the parameter's (fp32 for an fp16 one's second moments)."""
    own = second_moment_dtype(p.dtype) if entry in SECOND_MOMENTS else p.dtype
    follows = entry in ("momentum_buffer", "exp_avg_sq") or not group.get("use_muon")  # (NorMuon's rows: own)
    return group.get("state_dtype") or own if follows else own


def stale(stepped: Any, state: Mapping[Any, Any], group: Mapping[str, Any]) -> Exception | None:
    """What is wrong with the state of the ``(name, parameter)`` pairs ``stepped`` (in ``group``) that the step
    cannot take, an entry on another device or of another dtype named with the remedies; ``None`` if nothing is."""
    drop = "drop it with del opt.state[p] (opt.state.clear() for every parameter); the next step makes it anew"
    cast = "opt.load_state_dict(opt.state_dict()), which casts every state tensor to its parameter's device and dtype"
    for name, p in stepped:
        for entry, t in (state.get(p) or {}).items():
            where = f"the state of parameter {name!r} ({entry})"
            if not isinstance(t, torch.Tensor):
                return TypeError(f"{where} must be a tensor, got {type(t).__name__}")
            if t.device != p.device:
                remedy = f"a state on meta holds no values: {drop}" if t.is_meta else f"move it with {cast}, or {drop}"
                return ValueError(
                    f"{where} is on {t.device}, the parameter on {p.device} (moved after its state was made); {remedy}"
                )
            if entry not in COUNTS and t.dtype != (dtype := kept_dtype(group, entry, p)):
                kept = f"its group's state_dtype {dtype}" if group.get("state_dtype") else f"the parameter {p.dtype}"
                return ValueError(
                    f"{where} is {t.dtype}, {kept} (cast after its state was made); cast it with {cast}, or {drop}"
                )
    return None
