"""The shim takes the presets' options, each with the preset's meaning, state and checkpoints.

Every keyword of ``muonfn.muon``, ``normuon`` and ``adamuon`` has its place in the shim, kept by
the groups it acts on (under the name the group keeps it by) or by the optimizer, or a replacement
the shim's page documents (torch.optim.Muon's spelling of it); the shim takes exactly those and its
own. The first tests fail the day the presets and the shim's signature differ. The others run the
options through the shim, bit for bit against the presets.
"""

from __future__ import annotations

import inspect
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict
from test_optim import (
    assert_unchanged,
    batches,
    functional_steps,
    in_state_dtype,
    mlp,
    params_of,
    reloaded,
    shim_steps,
    snapshot,
)

import muonfn
from muonfn import NewtonSchulz
from muonfn.optim import Muon
from muonfn.presets import VARIANT_DEFAULTS, VARIANT_OPTIONS

PRESETS: dict[str, Callable[..., muonfn.Transform]] = {
    "muon": muonfn.muon,
    "normuon": muonfn.normuon,
    "adamuon": muonfn.adamuon,
}
HP = {"lr": 0.02, "weight_decay": 0.05, "adamw_lr": 0.004, "adamw_betas": (0.85, 0.97)}
SHIM_PAGE = (pathlib.Path(__file__).parents[1] / "docs" / "shim.md").read_text()

#: The presets' keywords the shim spells as torch.optim.Muon does (docs/shim.md says so).
REPLACED = {"scale": "adjust_lr_fn"}
#: The shim's own keywords: torch.optim.Muon's Newton–Schulz spellings (``ns=`` holds the rest), the
#: Muon groups' rule, and how it steps.
SHIM_OWN = {"adjust_lr_fn", "extra_scale", "ns_coefficients", "ns_steps", "eps", "variant", "chunk_numel", "compile"}
#: Where a group keeps each keyword that acts per group, with a value other than the default: a Muon
#: group under the keyword's name (``ns=`` as the ns_* entries), an AdamW group under these entries.
MUON_GROUP_KEYWORDS: dict[str, Any] = {
    "lr": 0.05, "momentum": 0.8, "nesterov": False, "weight_decay": 0.2, "momentum_bias_correction": True,
    "cautious_weight_decay": True, "cautious_mode": "heavyball", "extra_scale": 0.5, "adjust_lr_fn": "spectral",
    "ns_coefficients": "cesista", "ns_steps": 3, "eps": 1e-5, "state_dtype": torch.bfloat16,
}  # fmt: skip
VARIANT_KEYWORDS: dict[str, dict[str, Any]] = {
    "normuon": {"beta2": 0.9, "adaptive_eps": 1e-8, "rescale": "none"},
    "adamuon": {"sign_momentum": False, "second_moment_bias_correction": True},
}
ADAMW_GROUP_KEYWORDS: dict[str, tuple[Any, dict[str, Any]]] = {
    "adamw_lr": (3e-3, {"lr": 3e-3}),
    "adamw_betas": ((0.8, 0.9), {"momentum": 0.8, "beta2": 0.9}),
    "adamw_eps": (1e-6, {"eps": 1e-6}),
    "adamw_weight_decay": (0.01, {"weight_decay": 0.01}),
    "adamw_nesterov": ("timm", {"nesterov": "timm"}),
}
#: The optimizer's, given once
PER_OPTIMIZER = {"labels", "views", "weight_decay_mask", "orthogonalizer", "donate_state", "chunk_numel", "compile"}

#: The shim's defaults that deliberately differ from the presets', and why.
DIFFERENT_DEFAULTS = {
    # None: the group's variant's default (the presets differ: 0.95/True for Muon and NorMuon, 0.9/False for AdaMuon)
    "momentum": "the variant's",
    "nesterov": "the variant's",
    **dict.fromkeys(VARIANT_OPTIONS, "the variant's"),
    # the state is updated in place, as torch.optim's is
    "donate_state": "True",
}


def keywords(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The keywords ``fn`` takes (``lr`` included), its operands and ``**options`` left out."""
    parameters = inspect.signature(fn).parameters
    return {
        name: p
        for name, p in parameters.items()
        if name not in ("self", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def preset_keywords() -> set[str]:
    return set().union(*(keywords(preset) for preset in PRESETS.values()))


def assert_same(name: str, these: set[str], those: set[str]) -> None:
    assert these == those, (
        f"{name}: only on the left {sorted(these - those)}, only on the right {sorted(those - these)}"
    )


# ---------------------------------------------------------------------------- the keywords, by construction


def test_the_shim_takes_the_presets_keywords_but_the_replaced_and_its_own():
    """The day a preset gains an option the shim lacks (or the shim one no preset takes, beyond its
    own), this fails naming it; each replacement is on the shim's page, beside the keyword it replaces."""
    assert_same("shim vs presets + own", set(keywords(Muon)), (preset_keywords() - set(REPLACED)) | SHIM_OWN)
    for replaced, spelling in REPLACED.items():
        assert re.search(rf"`{spelling}`[^|]*\|[^|]*`{replaced}`", SHIM_PAGE), (replaced, spelling)
    # the adapted variants add their options
    variants = (set(keywords(muonfn.normuon)) | set(keywords(muonfn.adamuon))) - set(keywords(muonfn.muon))
    assert variants == set(VARIANT_OPTIONS)


def test_each_keyword_has_its_place_in_the_groups_or_the_optimizer():
    """Each keyword given a value other than its default shows in the groups it acts on, under the
    name they keep it by (``lr``, ``momentum`` and ``weight_decay`` scheduled there), or is the
    optimizer's; the table names every keyword."""
    per_group = {*MUON_GROUP_KEYWORDS, *ADAMW_GROUP_KEYWORDS, "variant", "ns"} | set(VARIANT_OPTIONS)
    assert_same("keywords vs places", set(keywords(Muon)), per_group | PER_OPTIMIZER)
    for name, value in MUON_GROUP_KEYWORDS.items():
        muon_group, adamw_group = Muon(mlp().named_parameters(), **{name: value}).param_groups
        assert muon_group[name] == value, name
        if name in ("lr", "weight_decay", "cautious_weight_decay", "state_dtype"):  # (AdamW's too, unless adamw_*)
            assert adamw_group[name] == value, name
    for variant, options in VARIANT_KEYWORDS.items():
        muon_group = Muon(mlp().named_parameters(), variant=variant, **options).param_groups[0]
        assert {k: muon_group[k] for k in ("variant", *options)} == {"variant": variant, **options}
    for name, (value, entries) in ADAMW_GROUP_KEYWORDS.items():
        adamw_group = Muon(mlp().named_parameters(), **{name: value}).param_groups[1]
        assert {k: adamw_group[k] for k in entries} == entries, name


def test_the_presets_spell_their_shared_keywords_alike():
    """A keyword two presets share has one annotation and one default in both, so that the copies of
    the public signatures cannot drift; only the momentum defaults differ, by design (AdaMuon's are
    its paper's)."""
    deliberate = {"momentum", "nesterov"}
    for name in sorted(preset_keywords()):
        spellings = {
            preset_name: keywords(preset)[name] for preset_name, preset in PRESETS.items() if name in keywords(preset)
        }
        annotations = {preset_name: str(p.annotation) for preset_name, p in spellings.items()}
        assert len(set(annotations.values())) == 1, f"{name}: {annotations}"
        defaults = {preset_name: p.default for preset_name, p in spellings.items()}
        if name not in deliberate:
            assert len(set(map(repr, defaults.values()))) == 1, f"{name}: {defaults}"
    assert keywords(muonfn.adamuon)["momentum"].default != keywords(muonfn.muon)["momentum"].default


def test_the_shims_defaults_are_the_presets_but_those_named():
    """Every default the shim shares with a preset is that preset's, but ``DIFFERENT_DEFAULTS``; a
    replacement's default is that of the keyword it replaces. (Also deliberate, in kind rather than
    default: ``lr`` and ``adamw_lr`` take numbers, for ``torch.optim.lr_scheduler``, not the presets'
    schedule functions; ``ns_coefficients`` also takes torch.optim.Muon's one triple.)"""
    shim = keywords(Muon)
    for name in sorted(preset_keywords()):
        for preset_name, preset in PRESETS.items():
            theirs = keywords(preset).get(name)
            if theirs is None or name in DIFFERENT_DEFAULTS:
                continue
            mine = shim[REPLACED.get(name, name)]
            assert mine.default == theirs.default, f"{name}: shim {mine.default!r}, {preset_name} {theirs.default!r}"
    for name in DIFFERENT_DEFAULTS:
        assert shim[name].default is (True if name == "donate_state" else None), name
    # the None defaults resolve to the presets', torch's Newton–Schulz spellings to NewtonSchulz()'s
    for variant, preset in PRESETS.items():
        group = Muon(mlp().named_parameters(), variant=variant).param_groups[0]
        for name in ("momentum", "nesterov", *VARIANT_DEFAULTS[variant]):
            assert group[name] == keywords(preset)[name].default, (variant, name)
        ns = NewtonSchulz()
        assert (group["ns_coefficients"], group["ns_steps"], group["eps"]) == (ns.coefficients, ns.steps, ns.eps)


#: The shim's annotations that differ from the presets' (but ``X | None`` for the ``None`` defaults above), and why.
DIFFERENT_TYPES = {
    "lr": "a number, for torch.optim.lr_scheduler: no schedule function",
    "adamw_lr": "a number, for torch.optim.lr_scheduler: no schedule function",
}


def test_the_shims_types_are_the_presets_but_those_named():
    shim = keywords(Muon)
    for name, theirs in {**keywords(muonfn.adamuon), **keywords(muonfn.muon)}.items():
        if name in DIFFERENT_TYPES or name in REPLACED:
            continue
        optional = name in DIFFERENT_DEFAULTS and shim[name].default is None
        expected = f"{theirs.annotation} | None" if optional else theirs.annotation
        assert shim[name].annotation == expected, f"{name}: shim {shim[name].annotation}, preset {theirs.annotation}"


def test_the_shim_page_lists_every_keyword():
    rows = SHIM_PAGE.split("| argument | meaning |")[1].split("\n\n")[0].splitlines()[2:]
    listed = {name for row in rows for name in re.findall(r"`(\w+)", row.split("|")[1])}
    assert_same("shim keywords vs docs/shim.md", set(keywords(Muon)), listed)


# ---------------------------------------------------------------------------- the options, bit for bit


def own_map(x: torch.Tensor) -> torch.Tensor:
    return muonfn.polar(x)


#: (variant, options) the shim and the preset both take (the shim's own spellings as the preset's, by
#: :func:`preset_options`); each differs from the defaults somewhere.
CASES = {
    "momentum_bias_correction": ("muon", {"momentum_bias_correction": True}),
    "cautious_weight_decay": ("muon", {"cautious_weight_decay": True}),
    "cautious_mode heavyball": ("muon", {"cautious_mode": "heavyball"}),
    "cautious_mode pytorch_optimizer": ("muon", {"cautious_mode": "pytorch_optimizer", "cautious_weight_decay": True}),
    "ns eps_mode": ("muon", {"ns": NewtonSchulz(eps_mode="add", eps=1e-3)}),
    "ns restarts": ("muon", {"ns": NewtonSchulz(method="gram", restarts=(2,))}),
    "adjust_lr_fn": ("muon", {"adjust_lr_fn": "spectral"}),
    "adjust_lr_fn None": ("muon", {"adjust_lr_fn": None}),
    "torch's Newton-Schulz spellings": (
        "muon",
        {"ns_coefficients": (3.4445, -4.7750, 2.0315), "ns_steps": 4, "eps": 1e-6},
    ),
    "named coefficients": ("muon", {"ns_coefficients": "polar_express", "ns_steps": 6}),
    "adamw_nesterov": ("muon", {"adamw_nesterov": True}),
    "adamw_nesterov timm": ("muon", {"adamw_nesterov": "timm"}),
    "ns NewtonSchulz": ("muon", {"ns": NewtonSchulz("cesista", eps=1e-4, eps_mode="add")}),
    "ns polar": ("muon", {"ns": muonfn.polar}),
    "normuon counted and cautious": ("normuon", {"momentum_bias_correction": True, "cautious_mode": "heavyball"}),
    "adamuon momentum counted": ("adamuon", {"momentum_bias_correction": True}),
    "adamuon both counted": ("adamuon", {"momentum_bias_correction": True, "second_moment_bias_correction": True}),
    "state_dtype bf16": ("muon", {"state_dtype": torch.bfloat16}),
    "state_dtype fp32": ("muon", {"state_dtype": torch.float32}),
    "state_dtype bf16 counted": ("muon", {"state_dtype": torch.bfloat16, "momentum_bias_correction": True}),
    "normuon state_dtype bf16": ("normuon", {"state_dtype": torch.bfloat16}),
    "adamuon state_dtype bf16": ("adamuon", {"state_dtype": torch.bfloat16, "momentum_bias_correction": True}),
}


def preset_options(options: dict[str, Any]) -> dict[str, Any]:
    """The shim's options as the presets spell them: ``adjust_lr_fn`` as ``scale``, torch's
    Newton–Schulz spellings as ``ns=``."""
    out = {k: v for k, v in options.items() if k not in ("adjust_lr_fn", "ns_coefficients", "ns_steps", "eps")}
    if "adjust_lr_fn" in options:
        out["scale"] = options["adjust_lr_fn"] or "original"
    if {"ns_coefficients", "ns_steps", "eps"} & set(options):
        coefficients = options.get("ns_coefficients", "keller")
        coefficients = [coefficients] if isinstance(coefficients, tuple) else coefficients
        steps = options.get("ns_steps", 5 if isinstance(coefficients, list) else None)
        out["ns"] = NewtonSchulz(coefficients, steps, options.get("eps", 1e-7))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_option_steps_saves_and_hands_off_as_the_preset(case):
    """Each option steps the preset's bits; the state_dict (read with ``weights_only=True``) and
    the functional state handed over continue them."""
    variant, options = CASES[case]
    preset = PRESETS[variant](**HP, **preset_options(options))
    data = batches(7)
    model, ref = mlp(), mlp()
    opt = Muon(model.named_parameters(), variant=variant, **HP, **options)
    params = params_of(ref)
    state = preset.init(params)
    # the preset's layout, each parameter's entries made at its first step
    assert list(opt.functional_state.keys()) == list(state.keys()) and not list(opt.functional_state.keys(True, True))
    params, state = functional_steps(ref, preset, params, state, data[:4])
    shim_steps(model, opt, data[:4])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)

    checkpoint = reloaded({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed = mlp(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = Muon(resumed.named_parameters(), variant=variant, **options)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    handed_model = mlp(seed=8)
    handed_model.load_state_dict(checkpoint["model"])
    handed = Muon(handed_model.named_parameters(), variant=variant, **HP, **options)
    handed.functional_state = state.clone()

    params, state = functional_steps(ref, preset, params, state, data[4:])
    for m, o in ((model, opt), (resumed, resumed_opt), (handed_model, handed)):
        shim_steps(m, o, data[4:])
        assert_bitwise(TensorDict.from_module(m), params)
        assert_bitwise(o.functional_state, state)


@pytest.mark.parametrize(
    ("variant", "options", "names"),
    [
        ("muon", {"momentum_bias_correction": True}, ["momentum_buffer", "step"]),
        ("normuon", {"momentum_bias_correction": True}, ["momentum_buffer", "step", "row_second_moment"]),
        ("adamuon", {"momentum_bias_correction": True}, ["momentum_buffer", "step", "exp_avg_sq"]),
        (
            "adamuon",
            {"momentum_bias_correction": True, "second_moment_bias_correction": True},
            ["momentum_buffer", "step", "exp_avg_sq", "second_moment_step"],
        ),
    ],
)
def test_the_counts_show_in_opt_state_and_the_state_dict(variant, options, names):
    model = mlp()
    opt = Muon(model.named_parameters(), variant=variant, **HP, **options)
    shim_steps(model, opt, batches(3))
    weight = model[0].weight
    assert list(opt.state[weight]) == names
    fields = {"step": ("step",), "second_moment_step": ("second_moment", "step")}
    if "second_moment_step" in names:
        fields["exp_avg_sq"] = ("second_moment", "exp_avg_sq")
    for name, field in fields.items():
        if name in names:  # the functional state holds the same tensors
            assert opt.state[weight][name] is opt.functional_state["muon", *field, "0.weight"]
    for name in ("step", "second_moment_step"):
        if name in names:
            assert opt.state[weight][name].dtype == torch.int64 and int(opt.state[weight][name]) == 3
    saved = opt.state_dict()["state"][0]
    assert sorted(saved) == sorted(names)
    count = [name for name in names if name.endswith("step")][-1]
    saved = {**saved, count: torch.tensor(2.5)}
    with pytest.raises(ValueError, match=rf"parameter '0.weight' \(index 0\) has {count} tensor\(2.5000\); expected"):
        opt.load_state_dict({**opt.state_dict(), "state": {**opt.state_dict()["state"], 0: saved}})


def test_a_state_dict_saved_without_the_momentums_count_does_not_load():
    source_model = mlp()
    source = Muon(source_model.named_parameters(), **HP)
    shim_steps(source_model, source, batches(1))
    model = mlp()
    opt = Muon(model.named_parameters(), momentum_bias_correction=True, **HP)
    before = snapshot(model, opt)
    with pytest.raises(
        ValueError,
        match=r"parameter group 0 keeps state \['momentum_buffer', 'step'\] here and \['momentum_buffer'\] in the "
        r"state_dict \(saved with momentum_bias_correction=False, this optimizer's group has "
        r"momentum_bias_correction=True\)",
    ):
        opt.load_state_dict(source.state_dict())
    assert_unchanged(model, opt, before)


# ---------------------------------------------------------------------------- changed in param_groups


def hand_off(tx: muonfn.Transform, params, state, carried: dict[tuple[str, ...], tuple[str, ...]]):
    """``tx``'s init for ``params`` with the AdamW state and the ``carried`` fields (new -> old) of ``state``."""
    handed = tx.init(params)
    handed["adamw"] = state["adamw"]
    for new, old in carried.items():
        handed["muon", *new] = state["muon", *old]
    return handed


def test_toggling_momentum_bias_correction_hands_off_a_consistent_state():
    """Turned on mid-run, the momentum starts from zero with its count (a trained momentum
    divided by 1 - momentum would outweigh the gradient twentyfold); turned off, the momentum is
    kept and the count dropped: each is the functional hand-off to the new setting, bit for bit."""
    data = batches(9)

    def muon(on):
        return muonfn.muon(**HP, momentum_bias_correction=on)

    model, ref = mlp(), mlp()
    opt = Muon(model.named_parameters(), **HP)
    params = params_of(ref)
    params, state = functional_steps(ref, muon(False), params, muon(False).init(params), data[:3])
    shim_steps(model, opt, data[:3])

    opt.param_groups[0]["momentum_bias_correction"] = True
    params, state = functional_steps(ref, muon(True), params, hand_off(muon(True), params, state, {}), data[3:6])
    shim_steps(model, opt, data[3:6])
    assert list(opt.state[model[0].weight]) == ["momentum_buffer", "step"]
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)
    assert int(opt.state[model[0].weight]["step"]) == 3

    opt.param_groups[0]["momentum_bias_correction"] = False
    handed = hand_off(muon(False), params, state, {("momentum",): ("momentum",)})
    params, state = functional_steps(ref, muon(False), params, handed, data[6:])
    shim_steps(model, opt, data[6:])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)


def test_counting_the_momentum_too_nests_adamuons_counted_second_moment():
    """With ``second_moment_bias_correction``, turning on ``momentum_bias_correction`` moves the
    second moment and its count under ``"second_moment"`` (as ``muonfn.adamuon`` keeps them) and
    starts the momentum's count and the momentum from zero; turning on
    ``second_moment_bias_correction`` instead, with the momentum's count already on, starts the
    second moment from zero with its count and keeps the momentum with its count."""
    data = batches(9)
    options = {**HP, "rescale": "none", "sign_momentum": False}

    def adamuon(momentum, moment):
        return muonfn.adamuon(**options, momentum_bias_correction=momentum, second_moment_bias_correction=moment)

    model, ref = mlp(), mlp()
    opt = Muon(model.named_parameters(), variant="adamuon", second_moment_bias_correction=True, **options)
    params = params_of(ref)
    params, state = functional_steps(ref, adamuon(False, True), params, adamuon(False, True).init(params), data[:3])
    shim_steps(model, opt, data[:3])

    opt.param_groups[0]["momentum_bias_correction"] = True
    moment = {("second_moment", "exp_avg_sq"): ("exp_avg_sq",), ("second_moment", "step"): ("step",)}
    handed = hand_off(adamuon(True, True), params, state, moment)
    params, state = functional_steps(ref, adamuon(True, True), params, handed, data[3:6])
    shim_steps(model, opt, data[3:6])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)
    counts = opt.state[model[0].weight]
    assert (int(counts["step"]), int(counts["second_moment_step"])) == (3, 6)

    opt.param_groups[0]["momentum_bias_correction"] = False
    handed = hand_off(
        adamuon(False, True), params, state, {("momentum",): ("momentum",), **{v: k for k, v in moment.items()}}
    )
    params, state = functional_steps(ref, adamuon(False, True), params, handed, data[6:])
    shim_steps(model, opt, data[6:])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)


@pytest.mark.parametrize(
    ("name", "value", "groups", "preset"),
    [
        ("cautious_mode", "heavyball", [0], {"cautious_mode": "heavyball"}),
        ("cautious_weight_decay", True, [0, 1], {"cautious_weight_decay": True}),  # both branches, as muonfn.muon's
        ("ns_eps_mode", "add", [0], {"ns": NewtonSchulz(eps_mode="add")}),
        ("adjust_lr_fn", "unit_rms_norm", [0], {"scale": "unit_rms_norm"}),
        ("nesterov", "timm", [1], {"adamw_nesterov": "timm"}),
    ],
)
def test_a_setting_changed_in_param_groups_takes_effect_at_the_next_step(name, value, groups, preset):
    """Set in the groups whose branch reads it, the state carried over: the preset with it from then on."""
    data = batches(5)
    model, ref = mlp(), mlp()
    opt = Muon(model.named_parameters(), **HP)
    params = params_of(ref)
    params, state = functional_steps(ref, muonfn.muon(**HP), params, muonfn.muon(**HP).init(params), data[:2])
    shim_steps(model, opt, data[:2])
    for i in groups:
        opt.param_groups[i][name] = value
    params, state = functional_steps(ref, muonfn.muon(**HP, **preset), params, state, data[2:])
    shim_steps(model, opt, data[2:])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)


@pytest.mark.parametrize("order", [(torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_a_state_dtype_changed_in_param_groups_casts_the_state_at_the_next_step(order):
    """The held state is cast to the new ``state_dtype`` as a load casts it (to bf16 rounded to nearest;
    a bf16 momentum's count from 0, dropped when the momentum is no longer bf16): the preset with the new
    setting from that state, bit for bit; a state_dict taken between the change and the step holds it cast."""
    data = batches(6)
    model, ref = mlp(), mlp()
    opt = Muon(model.named_parameters(), **HP)
    params = params_of(ref)
    params, state = functional_steps(ref, muonfn.muon(**HP), params, muonfn.muon(**HP).init(params), data[:2])
    shim_steps(model, opt, data[:2])
    for i, state_dtype in enumerate(order):
        for group in opt.param_groups:
            group["state_dtype"] = state_dtype
        state = in_state_dtype(state, state_dtype, torch.float32)
        saved = opt.state_dict()["state"]
        assert saved[0]["momentum_buffer"].dtype == saved[3]["exp_avg"].dtype == (state_dtype or torch.float32)
        preset = muonfn.muon(**HP, state_dtype=state_dtype)
        params, state = functional_steps(ref, preset, params, state, data[2 + 2 * i : 4 + 2 * i])
        shim_steps(model, opt, data[2 + 2 * i : 4 + 2 * i])
        assert_bitwise(TensorDict.from_module(model), params)
        assert_bitwise(opt.functional_state, state)


def test_state_dtype_is_a_group_setting():
    """The constructor's fills every group; a group dict sets its own (a split one for both halves), and
    ``add_param_group`` fills it in; each group's state is kept in its own."""
    model = mlp()
    named = list(model.named_parameters())
    opt = Muon(
        [
            {"params": named[:1], "use_muon": True, "state_dtype": torch.float32},
            {"params": named[1:6], "state_dtype": None},
        ],
        state_dtype=torch.bfloat16,
        **HP,
    )
    opt.add_param_group({"params": named[6:]})
    assert [g["state_dtype"] for g in opt.param_groups] == [torch.float32, None, None, torch.bfloat16, torch.bfloat16]
    data = batches(2)
    shim_steps(model, opt, data)
    kept = {n: {k: v.dtype for k, v in opt.state[p].items() if k != "step"} for n, p in named}
    assert kept["0.weight"] == {"momentum_buffer": torch.float32} and list(opt.state[model[0].weight]) == [
        "momentum_buffer"
    ]
    assert kept["5.weight"] == {"momentum_buffer": torch.bfloat16} and "step" in opt.state[model[5].weight]
    assert kept["5.bias"] == {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"^param group 5: state_dtype must be None, torch.float32 or torch.bfloat16"):
        opt.add_param_group({"params": [("extra", torch.zeros(3, requires_grad=True))], "state_dtype": "bf16"})
    assert_unchanged(model, opt, before)


# ---------------------------------------------------------------------------- ns=
# ---------------------------------------------------------------------------- ns=


def test_ns_is_kept_in_the_groups_as_plain_entries():
    setting = NewtonSchulz("cesista", 4, 1e-5, torch.float64, "gram", "add", (2,))
    opt = Muon(mlp().named_parameters(), ns=setting)
    names = ("ns_coefficients", "ns_steps", "ns_dtype", "eps", "ns_method", "ns_eps_mode", "ns_restarts")
    entries = {name: opt.param_groups[0][name] for name in names}
    assert entries == {
        "ns_coefficients": "cesista",
        "ns_steps": 4,
        "ns_dtype": torch.float64,
        "eps": 1e-5,
        "ns_method": "gram",
        "ns_eps_mode": "add",
        "ns_restarts": (2,),
    }
    assert "ns" not in opt.param_groups[0] and "ns" not in opt.defaults
    for ns, method in ((muonfn.polar, "svd"), (muonfn.linalg.qr_orthogonal, "qr"), (own_map, own_map)):
        group = Muon(mlp().named_parameters(), ns=ns).param_groups[0]
        assert group["ns_method"] is method or group["ns_method"] == method
        assert (group["ns_steps"], group["ns_coefficients"], group["ns_eps_mode"]) == (None, "keller", "clamp")
    # a group dict's ns replaces the constructor's Newton–Schulz settings for that group
    named = list(mlp().named_parameters())
    opt = Muon(
        [{"params": named[:1], "use_muon": True, "ns": NewtonSchulz(steps=3)}, {"params": named[1:]}],
        ns_steps=2,
        eps=1e-5,
    )
    assert (opt.param_groups[0]["ns_steps"], opt.param_groups[0]["eps"]) == (3, 1e-7)
    assert (opt.param_groups[1]["ns_steps"], opt.param_groups[1]["eps"]) == (2, 1e-5)


def test_a_group_dicts_torch_spellings_change_only_the_entries_they_name():
    """torch's ``ns_coefficients`` in a group dict sets the coefficients; the group's other Newton–Schulz
    entries stay as it gives them, or the constructor's; beside a whole ``ns`` an ``ns_method`` is refused."""
    named = [(n, p) for n, p in mlp().named_parameters() if p.ndim == 2]  # the matrices
    triple = (3.4445, -4.7750, 2.0315)
    opt = Muon(
        [
            {"params": named[:1], "use_muon": True, "ns_coefficients": triple, "ns_method": "gram"},
            {
                "params": named[1:2],
                "use_muon": True,
                "ns_coefficients": "polar_express",
                "ns_dtype": torch.float64,
            },
        ],
        ns=NewtonSchulz(steps=3, eps=1e-5, dtype=torch.float32, eps_mode="add"),
    )
    first, second = opt.param_groups
    assert (first["ns_coefficients"], first["ns_steps"], first["ns_method"]) == ((triple,) * 3, None, "gram")
    assert (first["ns_dtype"], first["eps"], first["ns_eps_mode"]) == (torch.float32, 1e-5, "add")
    assert (second["ns_coefficients"], second["ns_steps"], second["ns_dtype"]) == ("polar_express", 3, torch.float64)
    assert (second["ns_method"], second["eps"], second["ns_eps_mode"]) == ("standard", 1e-5, "add")
    with pytest.raises(ValueError, match=r"^param group 0: ns= is the whole Newton–Schulz setting.*ns_method='gram'"):
        Muon([{"params": named[:1], "use_muon": True, "ns": NewtonSchulz(steps=3), "ns_method": "gram"}])
    # a constructor's map of one's own runs no Newton–Schulz: a group's coefficients beside it are refused
    with pytest.raises(ValueError, match=r"does not run Newton–Schulz, so ns_coefficients="):
        Muon([{"params": named[:1], "use_muon": True, "ns_coefficients": triple}], ns=own_map).step()


def test_a_map_of_ones_own_is_left_out_of_the_state_dict_and_kept_by_the_loading_optimizer():
    """A function cannot be read with ``weights_only=True``: the saved groups leave it out, and the
    optimizer that loads them keeps its own (as it keeps its views and labels)."""
    data = batches(6)
    model = mlp()
    opt = Muon(model.named_parameters(), ns=own_map, **HP)
    shim_steps(model, opt, data[:3])
    sd = opt.state_dict()
    assert all("ns_method" not in group for group in sd["param_groups"])
    checkpoint = reloaded({"model": model.state_dict(), "optimizer": sd})
    shim_steps(model, opt, data[3:])

    resumed = mlp(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = Muon(resumed.named_parameters(), ns=own_map)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert resumed_opt.param_groups[0]["ns_method"] is own_map and resumed_opt.param_groups[0]["lr"] == HP["lr"]
    shim_steps(resumed, resumed_opt, data[3:])
    assert_bitwise(TensorDict.from_module(resumed), TensorDict.from_module(model))
    assert_bitwise(resumed_opt.functional_state, opt.functional_state)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda params: Muon(params, ns=NewtonSchulz(), ns_steps=3),
            ValueError,
            r"^Muon\(\.\.\.\): ns= is the whole Newton–Schulz setting: .*; beside ns=NewtonSchulz\(.*\), ns_steps=3 wo",
        ),
        (
            lambda params: Muon(params, ns=muonfn.polar, eps=1e-3),
            ValueError,
            r"^Muon\(\.\.\.\): ns= is the whole Newton–Schulz setting: .*; beside ns=<function polar .*>, eps=0.001 w",
        ),
        (
            lambda params: Muon(params, ns="keller"),
            TypeError,
            r"^Muon\(\.\.\.\): ns must be a muonfn.NewtonSchulz, 'svd', 'qr', 'gram' or a map .*, got 'keller'",
        ),
        (
            lambda params: Muon([{"params": params, "ns": NewtonSchulz(), "ns_eps_mode": "add"}]),
            ValueError,
            r"^param group 0: ns= is the whole Newton–Schulz setting: .*; beside ns=NewtonSchulz.*, ns_eps_mode='add'",
        ),
    ],
)
def test_ns_with_flat_settings_or_of_the_wrong_type_is_refused(make, error, match):
    with pytest.raises(error, match=match):
        make(list(mlp().named_parameters()))


def test_ns_written_into_param_groups_is_refused_at_the_step_changing_nothing():
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(1))
    opt.param_groups[0]["ns"] = NewtonSchulz(steps=3)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"^param group 0 holds 'ns'; a group keeps its Newton–Schulz setting as"):
        shim_steps(model, opt, batches(1))
    assert_unchanged(model, opt, before)


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"momentum_bias_correction": 1}, TypeError, r"^param group 0: momentum_bias_correction must be True or False"),
        ({"cautious_weight_decay": None}, TypeError, r"^param group 0: cautious_weight_decay must be True or False"),
        ({"cautious_mode": "always"}, ValueError, r"^param group 0: unknown cautious mode 'always'; choose None or"),
        ({"adamw_nesterov": "yes"}, ValueError, r"^param group 1: nesterov must be True, False or 'timm' \(AdamW's\)"),
        ({"adjust_lr_fn": "rms"}, ValueError, r"^param group 0: adjust_lr_fn must be None or one of \["),
        ({"ns_coefficients": 3.4}, TypeError, r"Newton–Schulz coefficients must be a set name"),
        (
            {"state_dtype": torch.float16},
            ValueError,
            r"^param group 0: state_dtype must be None, torch.float32 or torch.bfloat16, got torch.float16",
        ),
    ],
)
def test_bad_options_raise_naming_the_culprit(options, error, match):
    with pytest.raises(error, match=match):
        Muon(mlp().named_parameters(), **options)


@pytest.mark.parametrize(
    ("group", "name", "value", "match"),
    [
        (0, "momentum_bias_correction", "yes", r"^param group 0: momentum_bias_correction must be True or False"),
        (1, "cautious_weight_decay", 0, r"^param group 1: cautious_weight_decay must be True or False"),
        (0, "cautious_mode", "Heavyball", r"^param group 0: unknown cautious mode 'Heavyball'"),
        (1, "nesterov", None, r"^param group 1: nesterov must be True, False or 'timm' \(AdamW's\), got None"),
        (0, "ns_eps_mode", "max", r"^param group 0: Newton–Schulz eps_mode must be one of"),
        (0, "ns_restarts", (2,), r"^param group 0: Newton–Schulz restarts apply to method='gram' only"),
        (0, "ns_method", "cholesky", r"^param group 0: unknown ns_method 'cholesky'; choose 'standard', 'gram', 'svd'"),
        (
            1,
            "state_dtype",
            "bf16",
            r"^param group 1: state_dtype must be None, torch.float32 or torch.bfloat16, got 'b",
        ),
    ],
)
def test_bad_options_set_in_param_groups_are_refused_at_the_step_changing_nothing(group, name, value, match):
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(1))
    opt.param_groups[group][name] = value
    before = snapshot(model, opt)
    with pytest.raises((TypeError, ValueError), match=match):
        shim_steps(model, opt, batches(1))
    assert_unchanged(model, opt, before)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"momentum_bias_correction": True}, r"param group 0: torch.optim.Muon does not run momentum_bias_correction"),
        ({"cautious_mode": "heavyball"}, r"param group 0: torch.optim.Muon does not run cautious_mode='heavyball'"),
        ({"cautious_weight_decay": True}, r"param group 0: torch.optim.Muon does not run cautious_weight_decay=True"),
        (
            {"ns": NewtonSchulz(eps_mode="add")},
            r"param group 0: torch.optim.Muon does not run ns_eps_mode='add' \(it runs 'clamp'\)",
        ),
        ({"ns": muonfn.polar}, r"param group 0: torch.optim.Muon does not run ns_method='svd' \(it runs 'standard' or"),
        ({"ns": own_map}, r"param group 0: torch.optim.Muon does not run ns_method=own_map"),
        ({"adamw_nesterov": True}, r"param group 1: torch.optim.AdamW does not run nesterov=True"),
    ],
)
def test_torch_state_dicts_refuse_what_torchs_optimizers_do_not_run(options, match):
    with pytest.raises(ValueError, match=rf"^torch_state_dicts: {match}"):
        Muon(mlp().named_parameters(), **HP, **options).torch_state_dicts()


def test_torchs_state_does_not_continue_a_counted_momentum():
    model = mlp()
    opt = Muon(model.named_parameters(), momentum_bias_correction=True, **HP)
    torch_model = mlp()
    torch_opt = torch.optim.Muon([torch_model[0].weight, torch_model[3].weight, torch_model[5].weight], lr=0.02)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"^load_torch_state_dicts: param group 0 has momentum_bias_correction=True"):
        opt.load_torch_state_dicts(torch_opt.state_dict(), torch.optim.AdamW(model.parameters()).state_dict())
    assert_unchanged(model, opt, before)
