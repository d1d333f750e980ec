"""muonfn.optim.Muon(variant=...): NorMuon and AdaMuon groups, bit for bit the functional presets."""

from __future__ import annotations

import inspect
import io

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict
from test_optim import assert_unchanged, batches, functional_steps, loss_of, mlp, params_of, shim_steps, snapshot

import muonfn
from muonfn.optim import Muon
from muonfn.presets import VARIANT_DEFAULTS, VARIANT_OPTIONS

HP = {"lr": 0.02, "weight_decay": 0.05, "adamw_lr": 0.004, "adamw_betas": (0.85, 0.97)}
PRESETS = {"muon": muonfn.muon, "normuon": muonfn.normuon, "adamuon": muonfn.adamuon}
#: non-default options of each variant, as the shim and the preset both take them
OPTIONS = {
    "normuon": {"beta2": 0.9, "adaptive_eps": 1e-8, "rescale": "preserve_norm", "momentum": 0.9},
    "adamuon": {"beta2": 0.9, "sign_momentum": False, "second_moment_bias_correction": True, "nesterov": True},
}


def assert_laid_out_as(state, init) -> None:
    """The layout of the preset's ``init`` before any step: its groups, without the entries each
    parameter's first step makes."""
    assert list(state.keys()) == list(init.keys()) and not list(state.keys(True, True))


def all_muon(params):
    return dict.fromkeys(params.keys(True, True), "muon")


def run_both(variant, options, dtype, steps, scheduler=None):
    """The shim and the preset with the same settings, ``steps`` steps each; the preset is rebuilt
    with the lrs the shim's groups hold at every step (a scheduler may change them)."""
    data = batches(steps, dtype=dtype)
    model, ref = mlp(dtype=dtype), mlp(dtype=dtype)
    opt = Muon(model.named_parameters(), variant=variant, **HP, **options)
    schedule = None if scheduler is None else scheduler(opt)
    params = params_of(ref)
    state = PRESETS[variant](**HP, **options).init(params)
    assert_laid_out_as(opt.functional_state, state)
    lrs = []
    for x, y in data:
        lrs.append((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
        tx = PRESETS[variant](**{**HP, **options, "lr": lrs[-1][0], "adamw_lr": lrs[-1][1]})
        params, state = functional_steps(ref, tx, params, state, [(x, y)])
        shim_steps(model, opt, [(x, y)], schedule)
    return model, opt, params, state, lrs


# ---------------------------------------------------------------------------- the presets, bit for bit


@pytest.mark.parametrize("variant", ["muon", "normuon", "adamuon"])
def test_defaults_are_the_presets(variant):
    opt = Muon(mlp().named_parameters(), variant=variant)
    group = opt.param_groups[0]
    preset = inspect.signature(PRESETS[variant]).parameters
    for name in ("momentum", "nesterov", *VARIANT_OPTIONS):
        expected = preset[name].default if name in preset else None  # None: an option it does not take
        assert group[name] == expected, name
        assert VARIANT_DEFAULTS[variant].get(name) == expected, name
    assert opt.defaults["variant"] == variant and opt.defaults["beta2"] is None  # None: each group's variant's


@pytest.mark.parametrize(
    ("variant", "options", "dtype", "steps"),
    [
        ("normuon", {}, torch.float32, 8),
        ("adamuon", {}, torch.float32, 8),
        ("normuon", OPTIONS["normuon"], torch.float32, 6),
        ("adamuon", OPTIONS["adamuon"], torch.float32, 6),
        ("normuon", {}, torch.bfloat16, 4),
        ("adamuon", OPTIONS["adamuon"], torch.bfloat16, 4),
        ("normuon", {}, torch.float16, 4),  # second moments in fp32
        ("adamuon", OPTIONS["adamuon"], torch.float16, 4),
    ],
)
def test_matches_the_preset_bit_for_bit_under_an_lr_schedule(variant, options, dtype, steps):
    cosine = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)  # noqa: E731
    model, opt, params, state, lrs = run_both(variant, options, dtype, steps, cosine)
    assert len({lr for lr, _ in lrs}) == steps  # the lr changed at every step
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)


def test_groups_of_different_variants_are_a_functional_partition():
    model, ref = mlp(), mlp()
    names = [n for n, _ in model.named_parameters()]
    weights = [n for n in names if n.endswith("weight") and n != "1.weight"]
    vectors = [n for n in names if n not in weights]
    named = dict(model.named_parameters())
    opt = Muon(
        [
            {"params": [(n, named[n]) for n in weights[:1]], "use_muon": True, "variant": "normuon", "beta2": 0.9},
            {"params": [(n, named[n]) for n in weights[1:]], "use_muon": True},
            {"params": [(n, named[n]) for n in vectors], "use_muon": False},
        ],
        **HP,
    )
    assert [g["variant"] for g in opt.param_groups[:2]] == ["normuon", "muon"]
    assert opt.param_groups[1]["beta2"] is None  # the option of another variant does not reach it
    labels = {**dict.fromkeys(weights[:1], "muon"), **dict.fromkeys(weights[1:], "muon_1")}
    tx = muonfn.partition(
        {
            "muon": muonfn.normuon(**HP, beta2=0.9, labels=all_muon),
            "muon_1": muonfn.muon(**HP, labels=all_muon),
            "adamw": muonfn.adamw(HP["adamw_lr"], betas=HP["adamw_betas"], weight_decay=HP["weight_decay"]),
        },
        {**labels, **dict.fromkeys(vectors, "adamw")},
    )
    params = params_of(ref)
    data = batches(5)
    params, state = functional_steps(ref, tx, params, tx.init(params), data)
    shim_steps(model, opt, data)
    assert_bitwise(TensorDict.from_module(model), params)
    ours = opt.functional_state
    assert_bitwise(ours["muon"], state["muon", "muon"])
    assert_bitwise(ours["muon_1"], state["muon_1", "muon"])
    assert_bitwise(ours["adamw"], state["adamw"])


# ---------------------------------------------------------------------------- state


@pytest.mark.parametrize(
    ("variant", "options", "names"),
    [
        ("normuon", {}, ["momentum_buffer", "row_second_moment"]),
        ("adamuon", {}, ["momentum_buffer", "exp_avg_sq"]),
        ("adamuon", {"second_moment_bias_correction": True}, ["momentum_buffer", "exp_avg_sq", "step"]),
    ],
)
def test_state_dict_round_trip_continues_bit_for_bit(variant, options, names):
    data = batches(8)
    model = mlp()
    opt = Muon(model.named_parameters(), variant=variant, **HP, **options)
    shim_steps(model, opt, data[:4])
    weight = model[0].weight
    assert list(opt.state[weight]) == names
    for name, field in (("row_second_moment", "row_second_moment"), ("exp_avg_sq", "exp_avg_sq"), ("step", "step")):
        if name in names:  # the view shows the functional state's own tensors
            assert opt.state[weight][name] is opt.functional_state["muon", field, "0.weight"]
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    shim_steps(model, opt, data[4:])

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    sd = checkpoint["optimizer"]
    assert sorted(sd["state"][0]) == sorted(names) and sd["param_groups"][0]["variant"] == variant
    resumed = mlp(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = Muon(resumed.named_parameters(), variant=variant, lr=1.0, beta2=0.5, **options)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["beta2"] == 0.95 and opt2.param_groups[0]["lr"] == HP["lr"]  # the saved ones
    shim_steps(resumed, opt2, data[4:])
    assert_bitwise(TensorDict.from_module(resumed), TensorDict.from_module(model))
    assert_bitwise(opt2.functional_state, opt.functional_state)


@pytest.mark.parametrize("variant", ["normuon", "adamuon"])
def test_the_fp32_second_moments_of_fp16_parameters_round_trip(variant, tmp_path):
    """Kept in fp32 (fp16 cannot hold the squares): state_dict and muonfn.save keep them fp32, and
    a resumed run continues bit for bit."""
    data = batches(6, dtype=torch.float16)
    model = mlp(dtype=torch.float16)
    opt = Muon(model.named_parameters(), variant=variant, **HP)
    shim_steps(model, opt, data[:3])
    moment = "row_second_moment" if variant == "normuon" else "exp_avg_sq"
    dtypes = {name: t.dtype for name, t in opt.state[model[0].weight].items()}
    assert dtypes == {"momentum_buffer": torch.float16, moment: torch.float32}
    assert {name: t.dtype for name, t in opt.state[model[0].bias].items()} == {
        "step": torch.int64,
        "exp_avg": torch.float16,
        "exp_avg_sq": torch.float32,
    }
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pt")
    muonfn.save(opt.functional_state, tmp_path / "state.pt")
    shim_steps(model, opt, data[3:])
    assert all(torch.isfinite(p).all() for p in model.parameters())

    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["optimizer"]["state"][0][moment].dtype == torch.float32
    resumed = mlp(seed=7, dtype=torch.float16)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = Muon(resumed.named_parameters(), variant=variant, **HP)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    loaded = muonfn.load(tmp_path / "state.pt", like=resumed_opt.functional_state)
    assert_bitwise(resumed_opt.functional_state, loaded)
    shim_steps(resumed, resumed_opt, data[3:])
    assert_bitwise(TensorDict.from_module(resumed), TensorDict.from_module(model))
    assert_bitwise(resumed_opt.functional_state, opt.functional_state)


def test_param_state_of_a_variant_is_read_and_checked_at_the_next_step():
    model = mlp()
    opt = Muon(model.named_parameters(), variant="normuon", **HP)
    shim_steps(model, opt, batches(2))
    weight = model[0].weight
    opt.state[weight]["row_second_moment"] = torch.full((12, 1), 3.0)
    assert torch.equal(opt.functional_state["muon", "row_second_moment", "0.weight"], torch.full((12, 1), 3.0))
    for bad, match in [
        (
            {"row_second_moment": torch.zeros(12, 6)},
            r"'muon.row_second_moment.0.weight' is a torch.float32 tensor of sh",
        ),
        (
            {"exp_avg_sq": torch.zeros(12, 6)},
            r"^the state of parameter '0.weight' has no entry 'exp_avg_sq'; its entries",
        ),
    ]:
        held = dict(opt.state[weight])
        opt.state[weight].update(bad)
        opt.zero_grad()
        loss_of(model, *batches(1, seed=4)[0]).backward()
        before = params_of(model)
        with pytest.raises(ValueError, match=match):
            opt.step()
        assert_bitwise(TensorDict.from_module(model), before)
        opt.state[weight] = held
    opt.state[weight].clear()  # forgotten: made anew at its next step
    assert dict(opt.state[weight]) == {} and 0 not in opt.state_dict()["state"]


@pytest.mark.parametrize(
    ("saved", "loading", "match"),
    [
        (
            {"variant": "normuon"},
            {},
            r"^load_state_dict: parameter group 0 keeps state \['momentum_buffer'\] here and \['momentum_buffer', "
            r"'row_second_moment'\] in the state_dict \(saved with variant='normuon', this optimizer's group has "
            r"variant='muon'\)",
        ),
        ({}, {"variant": "adamuon"}, r"parameter group 0 keeps state \['momentum_buffer', 'exp_avg_sq'\] here"),
        (
            {"variant": "adamuon", "second_moment_bias_correction": True},
            {"variant": "adamuon"},
            r"\['momentum_buffer', 'exp_avg_sq', 'step'\] in the state_dict \(saved with "
            r"second_moment_bias_correction=True",
        ),
        ({"variant": "normuon"}, {"variant": "adamuon"}, r"parameter group 0 .*'row_second_moment'"),
    ],
)
def test_a_state_dict_of_another_variant_does_not_load(saved, loading, match):
    """A group's variant and bias corrections are chosen where it is built (its state's entries follow
    them): a state dict saved with others is refused, naming the group and the setting, before anything
    changes (its other settings, lr to beta2, are the saved ones, as in torch)."""
    source_model = mlp()
    source = Muon(source_model.named_parameters(), **HP, **saved)
    shim_steps(source_model, source, batches(1))
    model = mlp()
    opt = Muon(model.named_parameters(), **HP, **loading)
    shim_steps(model, opt, batches(2))
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(source.state_dict())
    assert_unchanged(model, opt, before)


def test_a_group_without_parameters_loads_its_own_variant_only():
    model = mlp()
    source = Muon([{"params": [], "use_muon": True, "variant": "normuon"}, {"params": model.parameters()}])
    opt = Muon([{"params": [], "use_muon": True}, {"params": mlp().parameters()}])
    with pytest.raises(ValueError, match=r"parameter group 0 keeps state \['momentum_buffer'\] here and "):
        opt.load_state_dict(source.state_dict())
    assert opt.param_groups[0]["variant"] == "muon"


def test_changing_a_groups_variant_lays_out_its_state_anew():
    """The momentum is kept, the new second moment starts from zero, as a functional hand-off would do."""
    data = batches(9)
    model, ref = mlp(), mlp()
    opt = Muon(model.named_parameters(), **HP)
    params = params_of(ref)
    params, state = functional_steps(ref, muonfn.muon(**HP), params, muonfn.muon(**HP).init(params), data[:3])
    shim_steps(model, opt, data[:3])
    momentum = opt.functional_state["muon", "momentum", "0.weight"]

    opt.param_groups[0]["variant"] = "normuon"  # (laid out at the next step, or a read of the state)
    assert list(opt.state_dict()["state"][0]) == ["momentum_buffer"]
    handed = muonfn.normuon(**HP).init(params)
    handed["muon", "momentum"] = state["muon", "momentum"]
    handed["adamw"] = state["adamw"]
    params, state = functional_steps(ref, muonfn.normuon(**HP), params, handed, data[3:6])
    shim_steps(model, opt, data[3:6])
    assert list(opt.state[model[0].weight]) == ["momentum_buffer", "row_second_moment"]
    assert opt.state[model[0].weight]["momentum_buffer"] is momentum  # (donated: updated in place)
    assert_bitwise(opt.functional_state, state)

    # a setting of the variant changed in param_groups rebuilds the transform at the next step
    opt.param_groups[0]["beta2"] = 0.8
    params, state = functional_steps(ref, muonfn.normuon(**HP, beta2=0.8), params, state, data[6:7])
    shim_steps(model, opt, data[6:7])
    assert_bitwise(opt.functional_state, state)

    # and back: the row statistics are dropped (the options of the other variant are then ignored)
    opt.param_groups[0]["variant"] = "muon"
    handed = muonfn.muon(**HP).init(params)
    handed["muon", "momentum"] = state["muon", "momentum"]
    handed["adamw"] = state["adamw"]
    params, state = functional_steps(ref, muonfn.muon(**HP), params, handed, data[7:])
    shim_steps(model, opt, data[7:])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)
    assert opt.state_dict()["state"][0].keys() == {"momentum_buffer"}


def test_a_variant_changed_before_a_parameters_first_step_gives_it_the_new_variants_state():
    """The parameters with state are laid out anew (momentum kept, the new second moment from
    zero); one that has not stepped yet gets the new variant's state at its first step: the
    functional hand-off, whose init made every parameter's state, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"trunk": torch.nn.Linear(4, 8), "a": torch.nn.Linear(8, 2), "b": torch.nn.Linear(8, 2)}
    )
    opt = Muon(model.named_parameters(), **HP)
    params = params_of(model)
    state = muonfn.muon(**HP).init(params)
    gen = torch.Generator().manual_seed(1)

    def step(tx: muonfn.Transform, head: str) -> None:
        nonlocal params, state
        opt.zero_grad()
        model[head](torch.tanh(model["trunk"](torch.randn(5, 4, generator=gen)))).square().mean().backward()
        opt.step()
        grads = TensorDict({(m, leaf): p.grad for m in ("trunk", head) for leaf, p in model[m].named_parameters()}, [])
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)

    for _ in range(2):
        step(muonfn.muon(**HP), "a")
    assert model["b"].weight not in opt.state
    opt.param_groups[0]["variant"] = "normuon"
    handed = muonfn.normuon(**HP).init(params)
    handed["muon", "momentum"] = state["muon", "momentum"]
    handed["adamw"] = state["adamw"]
    state = handed
    for head in "bab":
        step(muonfn.normuon(**HP), head)
    assert list(opt.state[model["a"].weight]) == ["momentum_buffer", "row_second_moment"]
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)


def test_toggling_second_moment_bias_correction_hands_off_a_consistent_state():
    """Turned on mid-run, the step count starts at zero and so does the second moment it
    corrects (a trained moment divided by 1 - beta2 would shrink the next update several
    times); turned off, the moment is kept and the count dropped: each is the functional
    hand-off to the new setting, bit for bit."""
    data = batches(9)
    options = {**HP, "rescale": "none", "sign_momentum": False}  # no rescale to hide the moment's size

    def adamuon(on):
        return muonfn.adamuon(**options, second_moment_bias_correction=on)

    model, ref = mlp(), mlp()
    opt = Muon(model.named_parameters(), variant="adamuon", **options)
    params = params_of(ref)
    params, state = functional_steps(ref, adamuon(False), params, adamuon(False).init(params), data[:3])
    shim_steps(model, opt, data[:3])

    opt.param_groups[0]["second_moment_bias_correction"] = True
    handed = adamuon(True).init(params)
    handed["muon", "momentum"] = state["muon", "momentum"]
    handed["adamw"] = state["adamw"]
    params, state = functional_steps(ref, adamuon(True), params, handed, data[3:6])
    shim_steps(model, opt, data[3:6])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)
    assert int(opt.state[model[0].weight]["step"]) == 3

    opt.param_groups[0]["second_moment_bias_correction"] = False
    handed = adamuon(False).init(params)
    handed["muon", "momentum"] = state["muon", "momentum"]
    handed["muon", "exp_avg_sq"] = state["muon", "exp_avg_sq"]
    handed["adamw"] = state["adamw"]
    params, state = functional_steps(ref, adamuon(False), params, handed, data[6:])
    shim_steps(model, opt, data[6:])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta2": 0.9}, r"^param group 0: beta2 does not apply to variant 'muon'; it is an option of "),
        (
            {"variant": "normuon", "sign_momentum": False},
            r"^param group 0: sign_momentum does not apply to variant 'normuon'; it is an option of 'adamuon'$",
        ),
        ({"variant": "normuon", "second_moment_bias_correction": True}, r"second_moment_bias_correction does not"),
        ({"variant": "adamw"}, r"^param group 0: unknown variant 'adamw'; choose one of \['muon', 'normuon'"),
        ({"variant": "normuon", "beta2": 1.0}, r"^param group 0: normuon: beta2 must be in \[0, 1\), got 1.0$"),
        ({"variant": "adamuon", "adaptive_eps": 0.0}, r"^param group 0: adamuon: adaptive_eps must be finite and > 0"),
        ({"variant": "normuon", "rescale": "rms"}, r"^param group 0: .*unknown rescale 'rms'; choose one of"),
        ({"variant": "adamuon", "sign_momentum": 1}, r"^param group 0: adamuon: sign_momentum must be True or False"),
    ],
)
def test_bad_variant_options_raise_naming_the_culprit(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Muon(mlp().named_parameters(), **kwargs)


def test_group_options_are_checked_against_the_groups_variant():
    model = mlp()
    named = list(model.named_parameters())
    opt = Muon(named[:4], variant="adamuon", sign_momentum=False)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"^param group 2: sign_momentum does not apply to variant 'normuon'"):
        opt.add_param_group({"params": named[4:], "variant": "normuon", "sign_momentum": True})
    with pytest.raises(ValueError, match=r"^param group 2: unknown variant 'nor'"):
        opt.add_param_group({"params": named[4:], "variant": "nor"})
    assert_unchanged(model, opt, before)
    # inherited options meant for another variant are dropped; its own are the group's variant's defaults
    opt.add_param_group({"params": named[4:], "variant": "normuon"})
    muon_group = opt.param_groups[2]
    assert (muon_group["variant"], muon_group["sign_momentum"], muon_group["momentum"]) == ("normuon", None, 0.95)
    assert (opt.param_groups[0]["sign_momentum"], opt.param_groups[0]["momentum"]) == (False, 0.9)


def test_a_sharded_orthogonalizer_is_refused_with_a_variant():
    from muonfn.distributed import sharded_orthogonalizer
    from muonfn.testing import simulate

    def build(collectives) -> list[str]:
        sharded = sharded_orthogonalizer(collectives)
        messages = []
        for make in (
            lambda: Muon(mlp().named_parameters(), variant="normuon", orthogonalizer=sharded),
            lambda: Muon([{"params": mlp().parameters(), "variant": "adamuon"}], orthogonalizer=sharded),
        ):
            with pytest.raises(ValueError, match="sharded orthogonalizers return shards") as error:
                make()
            messages.append(str(error.value))
        opt = Muon(mlp().named_parameters(), orthogonalizer=sharded)  # Muon itself runs sharded
        opt.param_groups[0]["variant"] = "normuon"
        with pytest.raises(ValueError, match=r"^param group 0: the adapted variants need each whole orthogonalized"):
            opt.transform  # noqa: B018
        return messages

    (messages, *_) = simulate(1, build)
    assert all(message.startswith("param group 0: the adapted variants") for message in messages)


def test_torch_state_dicts_refuse_a_variant_group():
    model = mlp()
    opt = Muon(model.named_parameters(), variant="normuon", **HP)
    with pytest.raises(
        ValueError,
        match=r"^torch_state_dicts: param group 0: torch.optim.Muon does not run variant='normuon' \(it runs 'muon'\)$",
    ):
        opt.torch_state_dicts()
    torch_model = mlp()
    torch_opt = torch.optim.Muon([torch_model[0].weight, torch_model[3].weight, torch_model[5].weight], lr=0.02)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"^load_torch_state_dicts: param group 0 has variant='normuon'"):
        opt.load_torch_state_dicts(torch_opt.state_dict(), torch.optim.AdamW(model.parameters()).state_dict())
    assert_unchanged(model, opt, before)
    plain_model = mlp()
    plain = Muon(plain_model.named_parameters(), **HP)
    shim_steps(plain_model, plain, batches(1))
    muon_sd, _ = plain.torch_state_dicts()  # variant="muon" converts
    assert muon_sd["state"][0].keys() == {"momentum_buffer"}
