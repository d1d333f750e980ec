"""muonfn.optim.Muon: the torch.optim contract, checked bit for bit against the functional core."""

from __future__ import annotations

import ast
import collections
import copy
import io
import pickle
import re
from typing import Any

import pytest
import torch
from _bitwise import assert_bitwise
from _strategies import assert_td_close_to_iteration, iteration_dtype
from tensordict import TensorDict, TensorDictBase
from torch import nn

import muonfn
from muonfn.optim import Muon

HP = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.05, "adamw_lr": 0.004, "adamw_betas": (0.85, 0.97)}


# ---------------------------------------------------------------------------- helpers


def mlp(seed: int = 0, hidden: int = 12, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, hidden),
        nn.LayerNorm(hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 3),
    )
    return model.to(dtype)


def batches(n: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=g).to(dtype), torch.randn(16, 3, generator=g).to(dtype)) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def shim_steps(model: nn.Module, opt: torch.optim.Optimizer, data, scheduler=None) -> None:
    for x, y in data:
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def reloaded(checkpoint: Any) -> Any:
    """``checkpoint`` through ``torch.save`` into memory and back with ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def functional_steps(model: nn.Module, tx: muonfn.Transform, params, state, data):
    def loss_fn(p, x, y):
        with p.to_module(model):
            return loss_of(model, x, y)

    for x, y in data:
        grads = torch.func.grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
    return params, state


def params_of(model: nn.Module) -> TensorDictBase:
    return TensorDict.from_module(model).detach().clone()


def snapshot(model: nn.Module, opt: Muon) -> tuple[TensorDictBase, TensorDictBase, list[dict]]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params_of(model), opt.functional_state.clone(), copy.deepcopy(groups)


def assert_unchanged(model: nn.Module, opt: Muon, before) -> None:
    params, state, groups = before
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


class Zoo(nn.Module):
    """Embedding, conv, LayerNorm, biases and an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 11, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.lm_head(self.proj(torch.tanh(self.norm(h))))


# ---------------------------------------------------------------------------- the contract


def test_is_a_torch_optimizer_with_two_routed_groups():
    model = Zoo()
    opt = Muon(model.named_parameters(), **HP)
    assert isinstance(opt, torch.optim.Optimizer)
    assert "betas" not in opt.defaults and opt.defaults["momentum"] == 0.9
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[0]["param_names"] == ["conv.weight", "proj.weight"]
    assert opt.param_groups[1]["param_names"] == ["embed.weight", "conv.bias", "norm.weight", "norm.bias", "proj.bias"]
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.004]
    # as torch's, a parameter's state is made at its first step
    assert len(opt.state) == 0 and dict(opt.state[model.conv.weight]) == {}
    # opt.state shows the functional state's own tensors, after each step
    for _ in range(2):
        opt.zero_grad()
        model(torch.randint(0, 11, (2, 5))).square().mean().backward()
        opt.step()
        assert opt.state[model.conv.weight].keys() == {"momentum_buffer"}
        assert opt.state[model.embed.weight].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert (
            opt.state[model.conv.weight]["momentum_buffer"] is opt.functional_state["muon", "momentum", "conv.weight"]
        )
        assert opt.state[model.norm.bias]["step"] is opt.functional_state["adamw", "step", "norm.bias"]
    assert opt.state[model.norm.bias]["step"].dtype == torch.int64
    assert int(opt.state[model.norm.bias]["step"]) == 2
    assert len(opt.state) == 7 and list(opt.state) == [p for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize(
    ("dtype", "steps", "state_dtype"),
    [
        (torch.float32, 20, None),
        (torch.bfloat16, 5, None),
        (torch.float32, 8, torch.bfloat16),
        (torch.float32, 5, torch.float32),
    ],
)
def test_matches_the_functional_loop_bit_for_bit(dtype, steps, state_dtype):
    # the shim feeds lr, momentum and weight_decay as float64 0-d tensors, the loop as Python floats
    data = batches(steps, dtype=dtype)
    model = mlp(dtype=dtype)
    opt = Muon(model.named_parameters(), **HP, state_dtype=state_dtype)
    ref = mlp(dtype=dtype)
    tx = muonfn.muon(**HP, state_dtype=state_dtype)
    params = params_of(ref)
    state = tx.init(params)
    # the layout of muonfn.muon(...).init, its entries made at each parameter's first step
    assert list(opt.functional_state.keys()) == list(state.keys()) and not list(opt.functional_state.keys(True, True))
    shim_steps(model, opt, data)
    params, state = functional_steps(ref, tx, params, state, data)
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)
    # torch's names, in the state's dtype; a bf16 momentum counts its updates (the key of its rounding)
    held = opt.state[model[0].weight]
    assert list(held) == (["momentum_buffer", "step"] if state_dtype == torch.bfloat16 else ["momentum_buffer"])
    assert held["momentum_buffer"].dtype == opt.state[model[0].bias]["exp_avg"].dtype == (state_dtype or dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_functional_loop_bit_for_bit_in_the_gpus_form(dtype):
    """A GPU's Newton–Schulz form (fp64 norms, a narrow product, results in the inputs' memory), asked
    for on the CPU by ``LocalOrthogonalizer(gpu_form=True)``: both front ends take it, still the same bits."""
    data = batches(5, dtype=dtype)
    model, ref = mlp(dtype=dtype), mlp(dtype=dtype)
    gpu_form = muonfn.LocalOrthogonalizer(gpu_form=True)
    opt = Muon(model.named_parameters(), **HP, orthogonalizer=gpu_form)
    tx = muonfn.muon(**HP, orthogonalizer=gpu_form)
    params = params_of(ref)
    shim_steps(model, opt, data)
    params, state = functional_steps(ref, tx, params, tx.init(params), data)
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)


def test_functional_state_handed_off_mid_run_and_back():
    data = batches(20)
    model_u = mlp()
    opt_u = Muon(model_u.named_parameters(), **HP)
    shim_steps(model_u, opt_u, data)

    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, data[:7])
    params, state = functional_steps(mlp(), muonfn.muon(**HP), params_of(model), opt.functional_state, data[7:13])
    with torch.no_grad():
        TensorDict.from_module(model).update_(params)
    fresh = Muon(model.named_parameters(), **HP)
    assert_bitwise(fresh.transform.init(params), muonfn.muon(**HP).init(params))
    fresh.functional_state = state
    shim_steps(model, fresh, data[13:])
    assert_bitwise(TensorDict.from_module(model), TensorDict.from_module(model_u))
    assert_bitwise(fresh.functional_state, opt_u.functional_state)


def test_every_parameter_updated_exactly_once_per_step_tied_head_included():
    model = Zoo()
    opt = Muon(model.named_parameters(), lr=0.01)
    tx = muonfn.muon(lr=0.01)
    named = dict(model.named_parameters())
    params = TensorDict({tuple(n.split(".")): p.detach().clone() for n, p in named.items()}, batch_size=[])
    state = tx.init(params)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(
            model(torch.randint(0, 11, (4, 6), generator=g)).flatten(0, 1), torch.arange(24) % 11
        ).backward()
        grads = TensorDict({tuple(n.split(".")): p.grad.clone() for n, p in named.items()}, batch_size=[])
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
        opt.step()
        current = TensorDict({tuple(n.split(".")): p.detach() for n, p in model.named_parameters()}, batch_size=[])
        assert_bitwise(current, params)
    assert model.lm_head.weight is model.embed.weight
    assert ("muon", "momentum", "conv.weight") in opt.functional_state.keys(True, True)
    assert_bitwise(opt.functional_state, state)


def test_plain_tensors_are_keyed_by_position():
    model = mlp()
    opt = Muon(model.parameters(), lr=0.02)
    assert "param_names" not in opt.param_groups[0]
    shim_steps(model, opt, batches(2))
    # weights of the three Linear layers are the tensors given 0th, 4th and 6th
    assert opt.functional_state["muon", "momentum"].keys() == {"0", "4", "6"}
    ref = mlp()
    tx = muonfn.muon(lr=0.02)
    params = params_of(ref)
    params, _ = functional_steps(ref, tx, params, tx.init(params), batches(2))
    assert_bitwise(TensorDict.from_module(model), params)
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert sd["state"][0].keys() == {"momentum_buffer"} and sd["state"][3].keys() == {"step", "exp_avg", "exp_avg_sq"}


def test_per_group_hyperparameters_are_honoured():
    model = mlp()
    layers = [model[0], model[3], model[5]]
    vectors = [p for m in (model[0], model[1], model[3], model[5]) for p in (m.weight, m.bias) if p.ndim == 1]
    groups = [
        {"lr": 0.05, "momentum": 0.8, "weight_decay": 0.0, "use_muon": True},
        {"lr": 0.01, "momentum": 0.6, "weight_decay": 0.2, "nesterov": False, "use_muon": True},
        {"lr": 0.003, "weight_decay": 0.0, "adamw_betas": (0.8, 0.9), "use_muon": False},
    ]
    members = [[layers[0].weight, layers[1].weight], [layers[2].weight], vectors]
    opt = Muon([{**g, "params": m} for g, m in zip(groups, members)], lr=0.02)
    assert list(opt.functional_state.keys()) == ["muon", "muon_1", "adamw"]
    txs = [
        muonfn.muon(lr=0.05, momentum=0.8, weight_decay=0.0, labels=lambda p: dict.fromkeys(p.keys(), "muon")),
        muonfn.muon(
            lr=0.01, momentum=0.6, weight_decay=0.2, nesterov=False, labels=lambda p: dict.fromkeys(p.keys(), "muon")
        ),
        muonfn.adamw(lr=0.003, betas=(0.8, 0.9), weight_decay=0.0),
    ]
    tds = [TensorDict({str(i): p.detach().clone() for i, p in enumerate(m)}, batch_size=[]) for m in members]
    states = [tx.init(td) for tx, td in zip(txs, tds)]
    for x, y in batches(3):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        for i, (tx, m) in enumerate(zip(txs, members)):
            grads = TensorDict({str(j): p.grad.clone() for j, p in enumerate(m)}, batch_size=[])
            updates, states[i] = tx.update(grads, states[i], tds[i])
            tds[i] = muonfn.apply_updates(tds[i], updates)
        opt.step()
    for td, m in zip(tds, members):
        assert_bitwise(TensorDict({str(j): p.detach() for j, p in enumerate(m)}, batch_size=[]), td)
    assert_bitwise(
        opt.functional_state["muon_1", "momentum"], TensorDict({"2": states[1]["muon", "momentum", "0"]}, [])
    )


def test_groups_without_use_muon_are_split_and_set_their_adamw_half():
    named = list(mlp().named_parameters())
    opt = Muon(
        [{"params": named[:4], "weight_decay": 0.0, "adamw_lr": 1e-3}, {"params": named[4:], "lr": 0.05}],
        lr=0.02,
        adamw_lr=3e-3,
    )
    assert [(g["use_muon"], g["lr"], g["weight_decay"]) for g in opt.param_groups] == [
        (True, 0.02, 0.0),
        (False, 1e-3, 0.0),
        (True, 0.05, 0.1),
        (False, 3e-3, 0.1),
    ]
    assert opt.param_groups[2]["param_names"] == ["3.weight", "5.weight"]
    assert list(opt.functional_state.keys()) == ["muon", "adamw", "muon_1", "adamw_1"]
    # without adamw_lr anywhere, the AdamW half follows its group's lr
    opt = Muon([{"params": named, "lr": 0.05}], lr=0.02)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.05]


def test_params_without_grad_are_skipped_with_their_state():
    torch.manual_seed(0)
    model = nn.ModuleDict({"trunk": nn.Linear(4, 8), "a": nn.Linear(8, 2), "b": nn.Linear(8, 2)})
    opt = Muon(model.named_parameters(), **HP)
    tx = muonfn.muon(**HP)
    params = params_of(model)
    state = tx.init(params)
    g = torch.Generator().manual_seed(0)
    for head in "aabab":
        x = torch.randn(5, 4, generator=g)
        opt.zero_grad()
        model[head](torch.tanh(model["trunk"](x))).square().mean().backward()
        other = "b" if head == "a" else "a"
        stepped = model[other].weight in opt.state  # its state is made at its first step
        before = (params_of(model[other]), opt.functional_state.clone())
        opt.step()
        assert model[other].weight.grad is None
        assert_bitwise(params_of(model[other]), before[0])
        others = [(k, v) for k, v in opt.functional_state.items(True, True) if k[-1].startswith(f"{other}.")]
        if stepped:  # its state as it was
            assert len(others) == 4 and all(v is before[1][k] or torch.equal(v, before[1][k]) for k, v in others)
        else:
            assert others == []
        grads = TensorDict(
            {(name, leaf): p.grad for name in ("trunk", head) for leaf, p in model[name].named_parameters()}, []
        )
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)
    steps = opt.functional_state["adamw", "step"]
    assert (int(steps["trunk.bias"]), int(steps["a.bias"]), int(steps["b.bias"])) == (5, 3, 2)


def test_adamw_groups_match_torch_adamw_with_skipped_steps():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opt = Muon([{"params": a.parameters(), "use_muon": False}], lr=0.01, weight_decay=0.1, adamw_betas=(0.9, 0.99))
    ref = torch.optim.AdamW(b.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.99), foreach=False)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        x = torch.randn(5, 4, generator=g)
        for model, o in ((a, opt), (b, ref)):
            o.zero_grad()
            model(x).square().mean().backward()
            if i % 3 == 1:
                model.bias.grad = None  # the bias skips this step, and its bias correction with it
            o.step()
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.bias, b.bias, rtol=1e-6, atol=1e-7)
    assert int(opt.state[a.bias]["step"]) == int(ref.state[b.bias]["step"]) == 4


def test_closure_runs_with_grad_enabled_and_zero_grad():
    model = mlp()
    opt = Muon(model.named_parameters(), lr=0.02)
    (x, y), *_ = batches(1)
    before = params_of(model)

    def closure():
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert not torch.equal(model[0].weight, before["0", "weight"])
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    held = {p: dict(entries) for p, entries in opt.state.items()}
    values = [t.clone() for entries in held.values() for t in entries.values()]
    opt.step()  # nothing has a gradient: nothing changes
    assert {p: dict(entries) for p, entries in opt.state.items()} == held
    assert all(torch.equal(a, b) for a, b in zip([t for e in held.values() for t in e.values()], values))


def test_add_param_group_initialises_new_state_only():
    model = mlp()
    named = list(model.named_parameters())
    opt = Muon(named[:4], **HP)
    shim_steps(model, opt, batches(2))
    momentum = opt.functional_state["muon", "momentum", "0.weight"]
    opt.add_param_group({"params": named[4:], "lr": 0.01})
    assert list(opt.functional_state.keys()) == ["muon", "adamw", "muon_1", "adamw_1"]
    assert opt.functional_state["muon", "momentum", "0.weight"] is momentum
    assert named[4][0] == "3.weight" and named[4][1] not in opt.state  # made at its first step
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.004, 0.01, 0.004]
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"'3.weight' is already in parameter group 2"):
        opt.add_param_group({"params": [named[4]], "use_muon": True})
    with pytest.raises(ValueError, match="without names"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, 2))]})
    assert_unchanged(model, opt, before)
    shim_steps(model, opt, batches(1))
    assert int(opt.functional_state["adamw_1", "step", "5.bias"]) == 1


@pytest.mark.parametrize("named", [True, False])
def test_param_groups_emptied_then_added_again_continue_their_state_as_torch_does(named):
    """``opt.param_groups = []`` and ``add_param_group`` (torch accepts it; the shim raised "already
    in parameter group 0"): a parameter added again continues with its state, as torch's keeps
    it by tensor (its AdamW step count goes on, here in lockstep with torch.optim.AdamW's)."""
    data = batches(5)
    runs = []
    for rebuild in (False, True):
        model = mlp()
        opt = Muon(model.named_parameters() if named else model.parameters(), **HP)
        reference_model = mlp()
        reference = torch.optim.AdamW(reference_model.parameters())
        shim_steps(model, opt, data[:2])
        shim_steps(reference_model, reference, data[:2])
        if rebuild:
            groups, opt.param_groups = opt.param_groups, []
            reference.param_groups, torch_groups = [], reference.param_groups
            for group in groups:
                params = list(zip(group.pop("param_names"), group["params"])) if named else group["params"]
                opt.add_param_group({**group, "params": params})
            for group in torch_groups:
                reference.add_param_group(group)
        shim_steps(model, opt, data[2:])
        shim_steps(reference_model, reference, data[2:])
        assert int(opt.state[model[0].bias]["step"]) == int(reference.state[reference_model[0].bias]["step"]) == 5
        runs.append((TensorDict.from_module(model), opt.functional_state))
    assert_bitwise(runs[1][0], runs[0][0])
    assert_bitwise(runs[1][1], runs[0][1])


def test_groups_removed_then_regrouped_carry_the_state_their_new_groups_keep():
    """Groups rebuilt by several ``add_param_group`` calls: each parameter added again keeps its
    state where its new group keeps the same entries, starts anew in a group of another kind (no
    state until its next step, as a parameter never stepped); one left out is not saved by
    ``state_dict``, and, added again after a step, continues with its state as torch's would."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(2))
    held = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    opt.param_groups = []
    opt.add_param_group({"params": [("0.weight", model[0].weight)], "use_muon": True, "lr": 0.01})
    opt.add_param_group({"params": [("3.weight", model[3].weight), ("0.bias", model[0].bias)], "use_muon": False})
    assert [g["param_names"] for g in opt.param_groups] == [["0.weight"], ["3.weight", "0.bias"]]
    assert_bitwise(TensorDict(dict(opt.state[model[0].weight]), []), TensorDict(held[model[0].weight], []))
    assert_bitwise(TensorDict(dict(opt.state[model[0].bias]), []), TensorDict(held[model[0].bias], []))
    assert model[3].weight not in opt.state and dict(opt.state[model[3].weight]) == {}
    assert sorted(opt.state_dict()["state"]) == [0, 2]
    shim_steps(model, opt, batches(1))
    assert int(opt.state[model[0].bias]["step"]) == 3 and int(opt.state[model[3].weight]["step"]) == 1
    opt.add_param_group({"params": [("1.weight", model[1].weight)], "use_muon": False})
    assert_bitwise(TensorDict(dict(opt.state[model[1].weight]), []), TensorDict(held[model[1].weight], []))
    shim_steps(model, opt, batches(1))
    assert int(opt.state[model[1].weight]["step"]) == 3


def test_a_group_deleted_from_param_groups_leaves_the_optimizer_at_add_param_group():
    """The groups after it move up (their state with them, under their new labels); parameters
    given without names take positions no parameter holds."""
    model = mlp()
    opt = Muon(model.parameters(), **HP)
    shim_steps(model, opt, batches(2))
    adamw_state = opt.functional_state["adamw"].clone()
    del opt.param_groups[0]
    extra = nn.Parameter(torch.randn(3, 3))
    opt.add_param_group({"params": [extra], "use_muon": True})
    assert list(opt.functional_state.keys()) == ["adamw", "muon"]
    assert_bitwise(opt.functional_state["adamw"], adamw_state)
    shim_steps(model, opt, batches(1))
    assert int(opt.state[model[0].bias]["step"]) == 3
    opt.zero_grad()
    extra.grad = torch.ones_like(extra)
    opt.step()  # (its state, made at its first step, shows its key)
    (position,) = opt.functional_state["muon", "momentum"].keys()
    assert position not in opt.functional_state["adamw", "step"]


def test_a_parameter_never_stepped_in_a_removed_group_added_again_makes_its_state_at_its_first_step():
    """A parameter without state (frozen so far) in a group removed and added again has none, as
    before; the others of its group keep theirs, and it trains once it has a gradient."""
    model = mlp()
    model[0].weight.requires_grad_(False)
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(1))
    held = opt.state[model[3].weight]["momentum_buffer"].clone()
    groups, opt.param_groups = opt.param_groups, []
    for group in groups:
        opt.add_param_group({**group, "params": list(zip(group.pop("param_names"), group["params"]))})
    assert model[0].weight not in opt.state
    assert torch.equal(opt.state[model[3].weight]["momentum_buffer"], held)
    model[0].weight.requires_grad_(True)
    before = model[0].weight.detach().clone()
    shim_steps(model, opt, batches(1))
    assert model[0].weight in opt.state and not torch.equal(model[0].weight, before)


@pytest.mark.parametrize("removal", ["all", "first"])
@pytest.mark.parametrize("reset", ["assign", "clear"])
def test_a_reset_between_removing_groups_and_adding_them_again_forgets_every_state(reset, removal):
    """A reset written next to a rebuild of the groups, after ``opt.param_groups = []`` (or ``del
    opt.param_groups[0]``) and before ``add_param_group``: the groups rebuild, no parameter keeps
    a state (the removed groups' neither), and each makes its own at its next step, one never
    stepped before (frozen until then) too."""
    model = mlp()
    model[3].weight.requires_grad_(False)
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(2))
    assert model[3].weight not in opt.state
    if removal == "all":
        removed, opt.param_groups = opt.param_groups, []
    else:
        removed = [opt.param_groups.pop(0)]
    if reset == "assign":
        opt.state = collections.defaultdict(dict)
    else:
        opt.state.clear()
    for group in removed:
        opt.add_param_group({**group, "params": list(zip(group.pop("param_names"), group["params"]))})
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    model[3].weight.requires_grad_(True)
    before = model[3].weight.detach().clone()
    shim_steps(model, opt, batches(1))
    assert not torch.equal(model[3].weight, before)
    assert len(opt.state) == len(list(model.parameters()))
    assert int(opt.state[model[0].bias]["step"]) == 1


def test_load_state_dict_between_removing_groups_and_adding_them_again_replaces_their_state_too():
    """As torch's, ``load_state_dict`` replaces the whole state: a parameter of a removed group
    added again after it starts anew."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(2))
    muon_group, adamw_group = opt.param_groups
    opt.param_groups = []
    opt.add_param_group({**muon_group, "params": list(zip(muon_group.pop("param_names"), muon_group["params"]))})
    opt.load_state_dict(opt.state_dict())
    opt.add_param_group({**adamw_group, "params": list(zip(adamw_group.pop("param_names"), adamw_group["params"]))})
    assert model[0].weight in opt.state and model[0].bias not in opt.state


def test_bad_settings_raise_naming_the_culprit():
    model = mlp()
    with pytest.raises(TypeError, match="lr_scheduler"):
        Muon(model.parameters(), lr=lambda step: 0.1)
    with pytest.raises(ValueError, match="momentum"):
        Muon(model.parameters(), momentum=1.0)
    with pytest.raises(ValueError, match=r"'0.bias'.*holds no matrix"):
        Muon([{"params": [("0.bias", model[0].bias)], "use_muon": True}])
    with pytest.raises(ValueError, match=r"'5.weight' is the same tensor as '0.weight'"):
        Muon([("0.weight", model[0].weight), ("5.weight", model[0].weight)])
    with pytest.raises(ValueError, match="adamw_lr"):
        Muon([{"params": model.parameters(), "use_muon": False, "adamw_lr": 0.1}])
    with pytest.raises(ValueError, match=r"param group 0: adjust_lr_fn must be None or one of \['match_rms_adamw'"):
        Muon(model.parameters(), adjust_lr_fn="bogus")
    with pytest.raises(ValueError, match="non-leaf"):
        Muon([model[0].weight * 2])
    with pytest.raises(ValueError, match=r"'0' has no label \(parameters given without names are keyed by position\)"):
        Muon(model.parameters(), labels=muonfn.labels_from_module(model))


def test_param_group_changes_take_effect_at_the_next_step():
    data = batches(6)
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    ref = mlp()
    params = params_of(ref)
    state = muonfn.muon(**HP).init(params)
    shim_steps(model, opt, data[:2])
    params, state = functional_steps(ref, muonfn.muon(**HP), params, state, data[:2])

    for group in opt.param_groups:
        group["lr"] = 0.0
    before = params_of(model)
    shim_steps(model, opt, data[2:3])
    assert_bitwise(TensorDict.from_module(model), before)  # lr 0: no move, but momentum advanced
    changed = {**HP, "lr": 0.0, "adamw_lr": 0.0}
    params, state = functional_steps(ref, muonfn.muon(**changed), params, state, data[2:3])
    assert_bitwise(opt.functional_state, state)

    opt.param_groups[0].update(lr=0.03, momentum=0.5, weight_decay=0.0, ns_steps=3, nesterov=False)
    opt.param_groups[1].update(lr=0.001, momentum=0.5, beta2=0.6, eps=1e-6)  # AdamW's betas (0.5, 0.6)
    changed = {
        **HP,
        "lr": 0.03,
        "momentum": 0.5,
        "weight_decay": 0.0,
        "ns": muonfn.NewtonSchulz(steps=3),
        "nesterov": False,
    }
    changed |= {"adamw_lr": 0.001, "adamw_betas": (0.5, 0.6), "adamw_eps": 1e-6, "adamw_weight_decay": 0.05}
    shim_steps(model, opt, data[3:])
    params, state = functional_steps(ref, muonfn.muon(**changed), params, state, data[3:])
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)

    opt.param_groups[0]["lr"] = -1.0
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="param group 0: lr must be finite and >= 0"):
        shim_steps(model, opt, data[:1])
    opt.param_groups[0]["lr"] = 0.03
    before[2][0]["lr"] = 0.03
    assert_unchanged(model, opt, before)


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8),
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[0.02, 0.004], total_steps=8, cycle_momentum=True, base_momentum=0.7, max_momentum=0.95
    ),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_schedulers_drive_lr_and_momentum(name):
    data = batches(8)
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    scheduler = SCHEDULERS[name](opt)
    ref = mlp()
    params = params_of(ref)
    state = muonfn.muon(**HP).init(params)
    seen = []
    for x, y in data:
        muon_group, adamw_group = opt.param_groups
        seen.append((muon_group["lr"], adamw_group["lr"], muon_group["momentum"], adamw_group["momentum"]))
        lr, adamw_lr, momentum, beta1 = seen[-1]
        betas = (beta1, HP["adamw_betas"][1])
        tx = muonfn.muon(**{**HP, "lr": lr, "adamw_lr": adamw_lr, "momentum": momentum, "adamw_betas": betas})
        params, state = functional_steps(ref, tx, params, state, [(x, y)])
        shim_steps(model, opt, [(x, y)], scheduler)
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)
    lrs = [s[0] for s in seen]
    assert len(set(lrs)) == len(lrs)
    for muon_lr, adamw_lr, *_ in seen:  # both groups scaled alike
        assert adamw_lr / muon_lr == pytest.approx(HP["adamw_lr"] / HP["lr"], rel=1e-9)
    if name == "one_cycle":  # Muon's momentum and AdamW's beta1 cycled alike, as torch's AdamW's beta1 would be
        assert len({s[2] for s in seen}) > 4 and min(s[2] for s in seen) == pytest.approx(0.7, abs=0.05)
        assert [s[3] for s in seen] == [s[2] for s in seen] and opt.param_groups[1]["beta2"] == HP["adamw_betas"][1]
    else:
        assert {s[3] for s in seen} == {HP["adamw_betas"][0]}


#: What each kind of group holds besides its parameters: only the settings that act on it.
MUON_GROUP = {
    "lr", "momentum", "weight_decay", "variant", "nesterov", "momentum_bias_correction", "cautious_weight_decay",
    "cautious_mode", "ns_coefficients", "ns_steps", "ns_dtype", "eps", "ns_method", "ns_eps_mode", "ns_restarts",
    "adjust_lr_fn", "extra_scale", "beta2", "adaptive_eps", "rescale", "sign_momentum", "second_moment_bias_correction",
    "state_dtype",
}  # fmt: skip
ADAMW_GROUP = {"lr", "momentum", "beta2", "eps", "weight_decay", "nesterov", "cautious_weight_decay", "state_dtype"}


def test_each_group_holds_only_the_settings_that_act_on_it():
    """The AdamW group listed Muon's momentum, nesterov, ns_* and scale (acting on nothing); it
    holds AdamW's settings now, its betas as momentum (beta1) and beta2, as the constructor's
    adamw_* keywords set them."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP, adamw_eps=1e-7, adamw_nesterov="timm")
    muon_group, adamw_group = opt.param_groups
    own = {"params", "param_names", "use_muon"}
    assert set(muon_group) == MUON_GROUP | own
    assert set(adamw_group) == ADAMW_GROUP | own
    assert [adamw_group[k] for k in ("lr", "momentum", "beta2", "eps", "weight_decay", "nesterov")] == [
        HP["adamw_lr"], *HP["adamw_betas"], 1e-7, HP["weight_decay"], "timm"
    ]  # fmt: skip
    adamw_part = repr(opt).split("Parameter Group 1")[1]
    assert "ns_" not in adamw_part and "scale" not in adamw_part and "variant" not in adamw_part
    # a group dict holds its kind's entries, and keys of one's own; the other kind's settings are refused
    opt = Muon(
        [
            {"params": [model[0].weight], "use_muon": True, "ns_steps": 3, "tag": "a"},
            {"params": [model[0].bias], "use_muon": False, "momentum": 0.8, "eps": 1e-6, "tag": "b"},
            {"params": [model[3].bias], "use_muon": False, "adamw_betas": (0.7, 0.9), "lr": 1e-3},  # (old spelling)
            {"params": [model[3].weight, model[5].bias], "momentum": 0.5, "adamw_eps": 1e-5, "tag": "c"},
        ],
        lr=0.02,
        adamw_lr=3e-3,
    )
    groups = opt.param_groups
    tagged = [MUON_GROUP | {"tag"}, ADAMW_GROUP | {"tag"}]
    assert [set(g) - own for g in groups] == [*tagged, ADAMW_GROUP, *tagged]
    assert (groups[0]["ns_steps"], groups[1]["momentum"], groups[1]["eps"], groups[1]["lr"]) == (3, 0.8, 1e-6, 3e-3)
    assert (groups[2]["momentum"], groups[2]["beta2"], groups[2]["lr"]) == (0.7, 0.9, 1e-3)  # its lr: over adamw_lr
    assert (groups[3]["momentum"], groups[4]["momentum"], groups[4]["eps"]) == (0.5, 0.9, 1e-5)  # split: Muon's
    for group, match in [
        ({"use_muon": False, "ns_steps": 3}, r"param group 0: 'ns_steps' is a Muon setting; this group has use_muon"),
        ({"use_muon": False, "momentum": 0.8, "adamw_betas": (0.7, 0.9)}, r"'momentum' is given twice"),
        ({"use_muon": True, "adamw_eps": 1e-6}, r"param group 0: 'adamw_eps' sets AdamW groups; this group has use"),
        ({"eps": 1e-6}, r"param group 0: 'eps' in a group split by labels; set its AdamW half's as adamw_eps"),
    ]:
        with pytest.raises(ValueError, match=match):
            Muon([{"params": [model[1].weight], **group}])


def test_a_constructor_keyword_written_into_param_groups_is_refused_at_the_step():
    """``adamw_betas`` set an AdamW group's betas in its group; written there now it would be
    ignored: the step refuses it naming the entries that hold it, and changes nothing."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(1))
    before = snapshot(model, opt)
    opt.param_groups[1]["adamw_betas"] = (0.5, 0.6)
    loss_of(model, *batches(1)[0]).backward()
    with pytest.raises(ValueError, match=r"^param group 1 holds 'adamw_betas', a keyword of the constructor; an Ad"):
        opt.step()
    del opt.param_groups[1]["adamw_betas"]
    assert_unchanged(model, opt, before)


@pytest.mark.parametrize(
    "make",
    [
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=8),
        lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=0.01, step_size_up=3),
    ],
    ids=["OneCycleLR", "CyclicLR"],
)
def test_schedulers_that_cycle_momentum_cycle_adamws_beta1_as_torchs(make):
    """torch's OneCycleLR and CyclicLR (cycle_momentum=True, their default) write "momentum" into
    every group of an optimizer whose defaults hold it, "betas" where they do not (torch.optim.AdamW):
    an AdamW group's beta1 is its momentum, so they cycle it as they cycle torch.optim.AdamW's
    betas[0] (they moved Muon's momentum only). The moments stay torch's, bit for bit."""
    torch.manual_seed(0)
    shim_model, torch_model = nn.Linear(4, 3), nn.Linear(4, 3)
    torch_model.load_state_dict(shim_model.state_dict())
    opt = Muon([{"params": shim_model.parameters(), "use_muon": False}], adamw_betas=(0.9, 0.99))
    reference = torch.optim.AdamW(torch_model.parameters(), betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    schedulers = [make(opt), make(reference)]
    g = torch.Generator().manual_seed(0)
    beta1s = []
    for _ in range(7):
        grads = [torch.randn(p.shape, generator=g) for p in shim_model.parameters()]  # the same for both
        for model, optimizer, scheduler in zip((shim_model, torch_model), (opt, reference), schedulers):
            for p, grad in zip(model.parameters(), grads):
                p.grad = grad.clone()
            optimizer.step()
            scheduler.step()
        beta1s.append(opt.param_groups[0]["momentum"])
        assert beta1s[-1] == reference.param_groups[0]["betas"][0]
        assert opt.param_groups[0]["lr"] == reference.param_groups[0]["lr"]
        for p, q in zip(shim_model.parameters(), torch_model.parameters()):
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][name], reference.state[q][name]), name
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert len(set(beta1s)) > 3


def test_cycling_momentum_recompiles_no_compiled_step():
    """AdamW's beta1 is a scheduled tensor, as Muon's momentum is: a scheduler that cycles both
    every step leaves one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    runs = []
    for compile in (False, {"backend": counter}):
        model = mlp()
        opt = Muon(model.named_parameters(), **HP, compile=compile)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.004], total_steps=6)
        shim_steps(model, opt, batches(5), scheduler)
        runs.append((model, opt))
    assert compiled_graphs(counter) == 1
    assert opt.param_groups[1]["momentum"] != HP["adamw_betas"][0]
    (eager, eager_opt), (model, opt) = runs
    assert_eager_to_rounding(TensorDict.from_module(model), TensorDict.from_module(eager))
    assert_eager_to_rounding(opt.functional_state, eager_opt.functional_state)


def old_layout(groups: list[dict]) -> list[dict]:
    """Groups as the shim held them when every group held both kinds' settings (AdamW's as
    adamw_betas, adamw_eps, adamw_nesterov), an AdamW group's momentum was Muon's, and the shape scale
    and Newton–Schulz's eps were spelled ``scale`` and ``ns_eps`` (muonfn 0.1.0)."""
    spelled = {"adjust_lr_fn": "scale", "eps": "ns_eps"}
    muon_group = {spelled.get(k, k): v for k, v in groups[0].items()}
    adamw_group = groups[1]
    adamw = {
        "adamw_betas": (adamw_group["momentum"], adamw_group["beta2"]),
        "adamw_eps": adamw_group["eps"],
        "adamw_nesterov": adamw_group["nesterov"],
    }
    both = {k: v for k, v in muon_group.items() if k not in ("params", "param_names", "use_muon")}
    kept = {k: adamw_group[k] for k in ("params", "param_names", "use_muon", "lr", "weight_decay")}
    return [{**muon_group, **adamw}, {**both, **adamw, **kept, "beta2": None}]


def test_a_state_dict_saved_with_both_kinds_settings_in_every_group_loads():
    """A checkpoint of the earlier layout loads: each group keeps its own kind's settings (the
    AdamW group's betas from its adamw_betas, not Muon's momentum), and the run continues bit for bit."""
    data = batches(6)
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, data[:3])
    saved = copy.deepcopy(opt.state_dict())  # (its tensors are the state's own)
    saved["param_groups"] = old_layout(saved["param_groups"])
    assert saved["param_groups"][1]["momentum"] == HP["momentum"] and "eps" not in saved["param_groups"][1]
    resumed_model = mlp(seed=3)
    resumed_model.load_state_dict(model.state_dict())
    resumed = Muon(resumed_model.named_parameters(), lr=1.0)
    resumed.load_state_dict(saved)
    assert resumed.param_groups == [
        {**g, "params": h["params"]} for g, h in zip(opt.param_groups, resumed.param_groups)
    ]
    shim_steps(model, opt, data[3:])
    shim_steps(resumed_model, resumed, data[3:])
    assert_bitwise(TensorDict.from_module(resumed_model), TensorDict.from_module(model))
    assert_bitwise(resumed.functional_state, opt.functional_state)


def test_a_parameter_without_state_in_a_state_dict_of_the_earlier_groups_makes_it_with_its_groups_betas():
    """A parameter not yet stepped when a checkpoint of the earlier layout was saved has no state
    after loading it; its first step makes it with its AdamW group's betas (from adamw_betas)."""
    model = mlp()
    model[0].bias.requires_grad_(False)
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(2))
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"] = old_layout(saved["param_groups"])
    resumed = Muon(model.named_parameters(), lr=1.0)
    resumed.load_state_dict(saved)
    assert model[0].bias not in resumed.state
    beta1, beta2 = HP["adamw_betas"]
    assert (resumed.param_groups[1]["momentum"], resumed.param_groups[1]["beta2"]) == (beta1, beta2)
    resumed.zero_grad()
    model[0].bias.grad = torch.ones_like(model[0].bias)
    resumed.step()
    state = resumed.state[model[0].bias]
    assert int(state["step"]) == 1
    torch.testing.assert_close(state["exp_avg"], torch.full_like(model[0].bias, 1 - beta1))
    torch.testing.assert_close(state["exp_avg_sq"], torch.full_like(model[0].bias, 1 - beta2))


# ---------------------------------------------------------------------------- state


def test_state_dict_round_trip_continues_bit_for_bit():
    data = batches(10)
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, data[:5])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    shim_steps(model, opt, data[5:])

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    sd = checkpoint["optimizer"]
    assert sorted(sd["state"]) == list(range(8)) and sd["param_groups"][0]["params"] == [0, 1, 2]
    assert sd["state"][3]["step"].dtype == torch.int64
    resumed = mlp(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = Muon(resumed.named_parameters(), lr=1.0, momentum=0.5)
    opt2.load_state_dict(sd)
    assert [g["lr"] for g in opt2.param_groups] == [0.02, 0.004] and opt2.param_groups[0]["momentum"] == 0.9
    shim_steps(resumed, opt2, data[5:])
    assert_bitwise(TensorDict.from_module(resumed), TensorDict.from_module(model))
    assert_bitwise(opt2.functional_state, opt.functional_state)


def test_load_state_dict_keeps_bf16_step_counts_exact():
    model = mlp(dtype=torch.bfloat16)
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(1, dtype=torch.bfloat16))
    bias = model[0].bias
    opt.state[bias] = {**opt.state[bias], "step": torch.tensor(257)}  # 257 has no bf16 representation
    sd = reloaded(opt.state_dict())
    other = mlp(seed=3, dtype=torch.bfloat16)
    opt2 = Muon(other.named_parameters(), **HP)
    opt2.load_state_dict(sd)
    assert_bitwise(opt2.functional_state, opt.functional_state)
    assert opt2.state[other[0].bias]["step"].dtype == torch.int64
    assert int(opt2.state[other[0].bias]["step"]) == 257
    # torch.optim's float "step" loads as an exact integer count; other state is cast to the parameter's dtype
    sd["state"][3] = {**sd["state"][3], "step": torch.tensor(300.0), "exp_avg": sd["state"][3]["exp_avg"].double()}
    opt2.load_state_dict(sd)
    assert opt2.state[other[0].bias]["step"].dtype == torch.int64 and int(opt2.state[other[0].bias]["step"]) == 300
    assert opt2.state[other[0].bias]["exp_avg"].dtype == torch.bfloat16


def in_state_dtype(state: TensorDictBase, state_dtype: torch.dtype | None, dtype: torch.dtype) -> TensorDictBase:
    """A functional state of ``muonfn.muon`` handed to ``muonfn.muon(state_dtype=state_dtype)`` (parameters of
    ``dtype``): the momentum and AdamW's moments cast (to bf16 rounded to nearest), a bf16 momentum's count
    from 0, dropped where the momentum is not bf16."""
    out = state.clone()
    for field in (("muon", "momentum"), ("adamw", "exp_avg"), ("adamw", "exp_avg_sq")):
        out[field] = out[field].to(state_dtype or dtype)
    counts = out["muon"].get("step", out["muon", "momentum"].apply(lambda m: torch.zeros((), dtype=torch.int64)))
    return out.set(("muon", "step"), counts) if state_dtype == torch.bfloat16 else out.exclude(("muon", "step"))


@pytest.mark.parametrize(("saved", "loaded"), [(None, torch.bfloat16), (torch.bfloat16, None)])
def test_a_state_loads_into_an_optimizer_of_another_state_dtype_cast_to_it(saved, loaded):
    """The loading optimizer keeps its ``state_dtype`` and casts the state to it: fp32 narrowed to bf16
    rounded to nearest, the bf16 momentum counting from 0 (an fp32 state keeps no count), or widened
    exactly, the count dropped; it continues as the preset from that state, bit for bit."""
    data = batches(6)
    model = mlp()
    opt = Muon(model.named_parameters(), **HP, state_dtype=saved)
    shim_steps(model, opt, data[:3])
    checkpoint = reloaded({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed = mlp(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = Muon(resumed.named_parameters(), lr=1.0, state_dtype=loaded)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert [g["state_dtype"] for g in resumed_opt.param_groups] == [loaded, loaded]
    assert resumed_opt.param_groups[0]["lr"] == HP["lr"]  # (the other settings are the saved ones)
    state = in_state_dtype(opt.functional_state, loaded, torch.float32)
    assert_bitwise(resumed_opt.functional_state, state)
    momentum = resumed_opt.state[resumed[0].weight]["momentum_buffer"]
    assert torch.equal(momentum, opt.state[model[0].weight]["momentum_buffer"].to(loaded or torch.float32))

    params = params_of(model)
    params, state = functional_steps(mlp(), muonfn.muon(**HP, state_dtype=loaded), params, state, data[3:])
    shim_steps(resumed, resumed_opt, data[3:])
    assert_bitwise(TensorDict.from_module(resumed), params)
    assert_bitwise(resumed_opt.functional_state, state)


def test_an_fp32_adamuon_state_loads_into_a_bf16_one_its_rounding_counts_from_0():
    """AdaMuon's bf16 state keeps a rounding count beside each moment; an fp32 state has none: the
    counts start at 0 on load (1 after the next step) and the moments are narrowed."""
    data = batches(4)
    model = mlp()
    opt = Muon(model.named_parameters(), **HP, variant="adamuon")
    shim_steps(model, opt, data[:2])
    resumed_opt = Muon(model.named_parameters(), **HP, variant="adamuon", state_dtype=torch.bfloat16)
    resumed_opt.load_state_dict(opt.state_dict())
    shim_steps(model, resumed_opt, data[2:3])
    held = resumed_opt.state[model[0].weight]
    assert held["momentum_buffer"].dtype == held["exp_avg_sq"].dtype == torch.bfloat16
    assert int(held["step"]) == int(held["second_moment_step"]) == 1


def test_load_state_dict_mismatch_names_the_parameter_and_changes_nothing():
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(2))
    before = snapshot(model, opt)

    wider = mlp(hidden=10)
    other = Muon(wider.named_parameters(), **HP)
    shim_steps(wider, other, batches(1))
    with pytest.raises(ValueError, match=r"'muon.momentum.0.weight' is a torch.float32 tensor of shape \(10, 6\)"):
        opt.load_state_dict(other.state_dict())

    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 123.0
    sd["state"][0] = {"exp_avg": sd["state"][0]["momentum_buffer"]}
    with pytest.raises(ValueError, match=r"'0.weight' \(index 0\) has state \['exp_avg'\]"):
        opt.load_state_dict(sd)

    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][1]["momentum"] = 2.0  # harmless for AdamW; a bad momentum for Muon is caught
    sd["param_groups"][0]["momentum"] = 2.0
    with pytest.raises(ValueError, match="param group 0: momentum"):
        opt.load_state_dict(sd)

    split = Muon([{"params": [p], "use_muon": p.ndim == 2} for p in mlp().parameters()])
    with pytest.raises(ValueError, match="8 parameter groups"):
        opt.load_state_dict(split.state_dict())
    assert_unchanged(model, opt, before)


@pytest.mark.parametrize("turned_on", [True, False])
def test_a_refused_load_state_dict_keeps_a_pending_bias_correction_edit_and_the_defaults(turned_on: bool):
    """A bias correction turned on (off) in param_groups lays out the state anew at the next step: the momentum
    restarted (its count dropped). A load_state_dict refused in between, after torch's loader ran, keeps that
    hand-off pending, and the optimizer's defaults as they were."""
    runs = []
    for refused in (False, True):
        model = mlp()
        opt = Muon(model.named_parameters(), **HP, momentum_bias_correction=not turned_on)
        shim_steps(model, opt, batches(2))
        saved = copy.deepcopy(opt.state_dict())
        defaults = copy.deepcopy(opt.defaults)
        opt.param_groups[0]["momentum_bias_correction"] = turned_on
        if refused:
            saved["param_groups"][0]["momentum_bias_correction"] = turned_on
            for k in saved["param_groups"][0]["params"]:
                if turned_on:
                    saved["state"][k]["step"] = torch.tensor(2.0)
                else:
                    del saved["state"][k]["step"]
            saved["state"][0]["momentum_buffer"] = torch.zeros(3, 3)
            with pytest.raises(ValueError, match=r"'muon.momentum.0.weight' is a .* of shape \(3, 3\)"):
                opt.load_state_dict(saved)
            assert opt.defaults == defaults
        shim_steps(model, opt, batches(1, seed=3))
        runs.append((params_of(model), opt.functional_state))
    assert_bitwise(runs[1][0], runs[0][0])
    assert_bitwise(runs[1][1], runs[0][1])


def test_functional_state_assignment_is_checked():
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(1))
    before = snapshot(model, opt)
    wider = params_of(mlp(hidden=10))
    with pytest.raises(ValueError, match=r"'muon.momentum.0.weight' is a torch.float32 tensor of shape \(10, 6\), exp"):
        opt.functional_state = muonfn.muon(**HP).init(wider)
    with pytest.raises(ValueError, match=r"'muon.momentum.0.weight' is a torch.float64 tensor"):
        opt.functional_state = opt.functional_state.double()
    with pytest.raises(ValueError, match=r"missing 'adamw.step.0.bias'"):
        opt.functional_state = opt.functional_state.exclude(("adamw", "step", "0.bias"))
    extra = opt.functional_state.clone(recurse=False)
    extra["adamw", "step", "9.bias"] = torch.tensor(1)
    with pytest.raises(ValueError, match=r"unexpected 'adamw.step.9.bias'"):
        opt.functional_state = extra
    assert_unchanged(model, opt, before)

    opt.state[model[0].weight] = {"momentum_buffer": torch.ones(12, 6)}
    assert torch.equal(opt.functional_state["muon", "momentum", "0.weight"], torch.ones(12, 6))
    del opt.state[model[1].bias]  # forgotten: made anew at its next step
    assert model[1].bias not in opt.state and dict(opt.state[model[1].bias]) == {}
    assert int(opt.state[model[0].bias]["step"]) == 1


def test_an_optimizer_pickled_with_its_model_continues_bit_for_bit():
    """Pickled (or deep-copied) with its model, an optimizer continues the run bit for bit: its groups,
    its state and the names of its parameters come along; a bias correction turned on in param_groups
    before pickling lays out the state as the next step would (the momentum starts anew with its count)."""
    data = batches(5)
    model = mlp()
    opt = Muon(model.parameters(), **HP)  # (unnamed: its parameters are named by position)
    shim_steps(model, opt, data[:2])
    opt.param_groups[0]["momentum_bias_correction"] = True
    copied = pickle.loads(pickle.dumps({"model": model, "opt": opt}))
    shim_steps(model, opt, data[2:])
    shim_steps(copied["model"], copied["opt"], data[2:])
    assert_bitwise(TensorDict.from_module(copied["model"]), TensorDict.from_module(model))
    assert_bitwise(copied["opt"].functional_state, opt.functional_state)
    assert list(copied["opt"].functional_state["muon", "step"].keys()) == ["0", "4", "6"]
    assert int(copied["opt"].state[copied["model"][0].weight]["step"]) == 3


def test_deepcopy_is_independent():
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(1))
    twin = copy.deepcopy({"model": model, "opt": opt})
    before = snapshot(model, opt)
    for group in twin["opt"].param_groups:
        group["lr"] = 0.0
    twin_params = params_of(twin["model"])
    shim_steps(twin["model"], twin["opt"], batches(1))
    assert_bitwise(TensorDict.from_module(twin["model"]), twin_params)  # the copy's own lr tensors
    assert_unchanged(model, opt, before)


# ---------------------------------------------------------------------------- state made at a parameter's first step


@pytest.fixture
def swapping_conversions():
    """``Module.to`` and ``to_empty`` keep each parameter's tensor object (``torch.utils.swap_tensors``),
    as they do for DTensor parameters and under torch's future flag: an optimizer built before
    holds the moved parameters. (Without it, a move off the meta device makes new parameters.)"""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(swapping)


def test_a_model_built_on_meta_trains_once_materialised(swapping_conversions):
    """Deferred initialisation: the model built under ``torch.device("meta")`` and given to the
    optimizer there, then materialised and loaded. Each parameter's state is made at its first
    step, from the parameter as it is then: the run is bit for bit that of an optimizer built on
    the materialised model, and state_dict saves no meta tensor. (The state used to be made on
    meta with the optimizer: every step computed on meta and trained nothing.)"""
    data = batches(4)
    with torch.device("meta"):
        model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    model.to_empty(device="cpu")
    model.load_state_dict(mlp().state_dict())
    reference = mlp()
    reference_opt = Muon(reference.named_parameters(), **HP)
    shim_steps(model, opt, data)
    shim_steps(reference, reference_opt, data)
    assert not torch.equal(model[0].weight, mlp()[0].weight)  # it trained
    assert_bitwise(TensorDict.from_module(model), TensorDict.from_module(reference))
    assert_bitwise(opt.functional_state, reference_opt.functional_state)
    saved = opt.state_dict()["state"]
    assert sorted(saved) == list(range(8))
    assert {t.device.type for entries in saved.values() for t in entries.values()} == {"cpu"}


def test_a_state_on_another_device_than_its_parameter_is_refused_naming_both(swapping_conversions):
    """A parameter moved after its state was made (stepped on meta, then materialised; trained,
    then moved): the step refuses before anything changes, naming the parameter, both devices and
    the remedy, and state_dict refuses to save a meta state for a parameter that is not on meta.
    Dropped, the state is made anew on the parameter's device."""
    with torch.device("meta"):
        model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    loss_of(model, *(t.to("meta") for t in batches(1)[0])).backward()
    opt.step()
    opt.zero_grad()
    model.to_empty(device="cpu")
    model.load_state_dict(mlp().state_dict())
    loss_of(model, *batches(1)[0]).backward()
    before = params_of(model)
    with pytest.raises(
        ValueError,
        match=r"^the state of parameter '0\.weight' \(momentum_buffer\) is on meta, the parameter on cpu \(moved "
        r"after its state was made\); a state on meta holds no values: drop it with del opt\.state\[p\] "
        r"\(opt\.state\.clear\(\) for every parameter\)",
    ):
        opt.step()
    assert_bitwise(TensorDict.from_module(model), before)
    assert opt.state[model[0].weight]["momentum_buffer"].is_meta
    with pytest.raises(ValueError, match=r"^state_dict: the state of parameter '0\.weight' is on meta, which holds"):
        opt.state_dict()
    opt.state.clear()
    opt.step()
    assert opt.state[model[0].weight]["momentum_buffer"].device.type == "cpu"
    assert not torch.equal(model[0].weight, before["0", "weight"])

    model.to("meta")  # a state on a device with values can be moved along
    loss_of(model, *(t.to("meta") for t in batches(1)[0])).backward()
    with pytest.raises(
        ValueError,
        match=r"^the state of parameter '0\.weight' \(momentum_buffer\) is on cpu, the parameter on meta \(moved "
        r"after its state was made\); move it with opt\.load_state_dict\(opt\.state_dict\(\)\)",
    ):
        opt.step()
    assert opt.state[model[0].weight]["momentum_buffer"].device.type == "cpu"
    opt.load_state_dict(opt.state_dict())
    opt.step()
    assert {t.device.type for t in opt.functional_state.values(True, True)} == {"meta"}


class LoRALinear(nn.Module):
    """A frozen linear layer and its trainable low-rank update, as PEFT's LoRA makes it."""

    def __init__(self, n_in: int, n_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out).requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, n_in) / n_in**0.5)
        self.lora_B = nn.Parameter(torch.randn(n_out, rank) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T


def test_frozen_parameters_hold_no_state():
    """Parameters without gradients (PEFT's frozen base weights, here the embedding too) hold no
    state, as torch.optim keeps none for them: the state's size is that of the trainable
    parameters' state alone, in the functional state and in the state_dict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 16), LoRALinear(16, 16, 2), nn.Tanh(), LoRALinear(16, 10, 2))
    model[0].requires_grad_(False)
    torch_model = copy.deepcopy(model)
    opt = Muon(model.named_parameters(), **HP)
    adamw = torch.optim.AdamW(torch_model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 10, (4, 5))
    for m, o in ((model, opt), (torch_model, adamw)):
        for _ in range(3):
            o.zero_grad()
            nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
            o.step()
    ordered = [p for g in opt.param_groups for p in g["params"]]
    trainable = [p for p in ordered if p.requires_grad]
    assert len(trainable) == 4 and set(adamw.state) == {p for p in torch_model.parameters() if p.requires_grad}
    assert list(opt.state) == trainable
    # Muon keeps a momentum per parameter, AdamW two moments and a count
    per_parameter = {
        p: p.numel() if g["use_muon"] else 2 * p.numel() + 1 for g in opt.param_groups for p in g["params"]
    }
    expected = sum(per_parameter[p] for p in trainable)
    assert sum(t.numel() for t in opt.functional_state.values(True, True)) == expected
    saved = opt.state_dict()["state"]
    assert sorted(saved) == [i for i, p in enumerate(ordered) if p.requires_grad]
    assert sum(t.numel() for entries in saved.values() for t in entries.values()) == expected
    assert expected < sum(p.numel() for p in ordered if not p.requires_grad)  # (what was held for nothing)


def test_a_model_cast_before_its_first_step_steps_as_one_built_after_the_cast():
    """``model.to(torch.bfloat16)`` after the optimizer was built: the state is made at the first
    step, in bf16, and the run is bit for bit that of an optimizer built after the cast (the step
    used to raise, blaming the bf16 gradient for the optimizer's fp32 state)."""
    data = batches(4, dtype=torch.bfloat16)
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    model.to(torch.bfloat16)
    reference = mlp(dtype=torch.bfloat16)
    reference_opt = Muon(reference.named_parameters(), **HP)
    shim_steps(model, opt, data)
    shim_steps(reference, reference_opt, data)
    assert_bitwise(TensorDict.from_module(model), TensorDict.from_module(reference))
    assert_bitwise(opt.functional_state, reference_opt.functional_state)
    assert opt.state[model[0].weight]["momentum_buffer"].dtype == torch.bfloat16


def test_a_state_of_another_dtype_than_its_parameter_is_refused_naming_the_stale_state():
    """Cast after its state was made: what is stale is the state, not the gradient. The step
    refuses before anything changes, naming the state, the parameter, both dtypes and the
    remedies; cast along (``load_state_dict`` casts as torch's) or dropped, the state steps."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(2))
    model.to(torch.bfloat16)
    opt.zero_grad()
    loss_of(model, *batches(1, seed=3, dtype=torch.bfloat16)[0]).backward()
    before = snapshot(model, opt)
    with pytest.raises(
        ValueError,
        match=r"^the state of parameter '0\.weight' \(momentum_buffer\) is torch\.float32, the parameter "
        r"torch\.bfloat16 \(cast after its state was made\); cast it with opt\.load_state_dict\(opt\.state_dict\(\)\), "
        r"which casts every state tensor to its parameter's device and dtype, or drop it with del opt\.state\[p\]",
    ):
        opt.step()
    assert_unchanged(model, opt, before)

    cast = copy.deepcopy({"model": model, "opt": opt})
    cast["opt"].load_state_dict(cast["opt"].state_dict())
    momentum = opt.state[model[0].weight]["momentum_buffer"]
    assert torch.equal(cast["opt"].state[cast["model"][0].weight]["momentum_buffer"], momentum.bfloat16())
    for p, q in zip(cast["model"].parameters(), model.parameters()):
        p.grad = q.grad.clone()
    cast["opt"].step()
    assert not torch.equal(cast["model"][0].weight, model[0].weight)

    fresh_model = copy.deepcopy(model)
    for p, q in zip(fresh_model.parameters(), model.parameters()):
        p.grad = q.grad.clone()
    fresh_opt = Muon(fresh_model.named_parameters(), **HP)
    opt.state.clear()
    opt.step()
    fresh_opt.step()
    assert_bitwise(TensorDict.from_module(model), TensorDict.from_module(fresh_model))
    assert_bitwise(opt.functional_state, fresh_opt.functional_state)


def test_assigning_an_empty_mapping_to_opt_state_resets_it_as_in_torch():
    """``opt.state = collections.defaultdict(dict)``, a common way to reset a torch optimizer:
    every parameter's state is forgotten and made anew at its next step (AdamW counts from 1
    again), as torch.optim.AdamW does; the run is then that of an optimizer built at that point.
    (The assignment used to be ignored, and state_dict() then raised an AttributeError.)"""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    opt.state["note"] = 1
    shim_steps(model, opt, batches(3))
    opt.state = collections.defaultdict(dict)
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    fresh_model = copy.deepcopy(model)
    fresh_opt = Muon(fresh_model.named_parameters(), **HP)
    data = batches(2, seed=4)
    shim_steps(model, opt, data)
    shim_steps(fresh_model, fresh_opt, data)
    assert int(opt.state[model[0].bias]["step"]) == 2
    assert_bitwise(TensorDict.from_module(model), TensorDict.from_module(fresh_model))
    assert_bitwise(opt.functional_state, fresh_opt.functional_state)

    torch_model = mlp()
    adamw = torch.optim.AdamW(torch_model.parameters())
    shim_steps(torch_model, adamw, batches(3))
    adamw.state = collections.defaultdict(dict)
    shim_steps(torch_model, adamw, batches(1))
    assert int(adamw.state[torch_model[0].bias]["step"]) == 1


def test_assigning_a_mapping_to_opt_state_takes_its_entries():
    """A mapping assigned to ``opt.state`` is the whole state, as torch's attribute is: each parameter's
    entries as given, none for the parameters it leaves out, its other keys kept (``opt.state`` stays a
    ``defaultdict(dict)``). What the step cannot take is refused by it, naming the parameter and the
    entry, before anything changes; what is no mapping is refused at once."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    opt.state["old"] = 2
    shim_steps(model, opt, batches(2))
    weight, bias = model[0].weight, model[0].bias
    momentum = opt.state[weight]["momentum_buffer"].clone()
    opt.state = {weight: {"momentum_buffer": momentum}, bias: {**opt.state[bias], "step": torch.tensor(7)}, "note": 1}
    assert list(opt.state) == [weight, bias, "note"] and isinstance(opt.state, collections.defaultdict)
    assert torch.equal(opt.functional_state["muon", "momentum", "0.weight"], momentum)
    assert int(opt.state[bias]["step"]) == 7 and model[3].weight not in opt.state
    with pytest.raises(TypeError, match=r"opt\.state must be a mapping of parameters to their state, got list"):
        opt.state = [weight]  # type: ignore[assignment]
    good = opt.state
    for bad, match in [
        ({weight: {"exp_avg": torch.zeros(12, 6)}}, r"the state of parameter '0\.weight' has no entry 'exp_avg'"),
        (
            {bias: dict(opt.state[bias]), weight: {"momentum_buffer": torch.zeros(6, 12)}},
            r"'muon\.momentum\.0\.weight' is a torch\.float32 tensor of shape \(6, 12\), expected .* \(12, 6\)",
        ),
    ]:
        opt.state = bad
        opt.zero_grad()
        loss_of(model, *batches(1, seed=3)[0]).backward()
        before = snapshot(model, opt)
        with pytest.raises(ValueError, match=match):
            opt.step()
        assert_unchanged(model, opt, before)
    opt.state = good
    assert opt.state["note"] == 1 and "old" not in opt.state
    shim_steps(model, opt, batches(1, seed=3))  # the others' state is made at this step
    assert int(opt.state[bias]["step"]) == 8 and int(opt.state[model[3].bias]["step"]) == 1


def test_a_parameters_state_appears_at_its_first_step_as_in_torch():
    """``opt.state`` holds a parameter once it has stepped, as torch.optim's: empty before; the
    state_dict of a partly stepped optimizer holds the stepped parameters only, and loading it
    leaves the others without state; an entry written for a parameter makes its state."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"trunk": nn.Linear(4, 8), "a": nn.Linear(8, 2), "b": nn.Linear(8, 2)})
    other_model = copy.deepcopy(model)
    opt = Muon(model.named_parameters(), **HP)
    a_weight, b_weight, b_bias = model["a"].weight, model["b"].weight, model["b"].bias
    assert len(opt.state) == 0 and a_weight not in opt.state and opt.state.get(a_weight) is None
    assert dict(opt.state[a_weight]) == {}  # a lookup leaves an empty entry, as torch's defaultdict: no state
    assert opt.state_dict()["state"] == {}
    model["a"](torch.tanh(model["trunk"](torch.randn(5, 4)))).square().mean().backward()
    opt.step()
    stepped = [model["trunk"].weight, a_weight, model["trunk"].bias, model["a"].bias]
    assert {id(p) for p, entries in opt.state.items() if entries} == set(map(id, stepped))
    assert dict(opt.state[b_weight]) == {} and "momentum_buffer" not in opt.state[b_weight]
    saved = opt.state_dict()
    assert sorted(saved["state"]) == [0, 1, 3, 4]  # (b.weight is 2, b.bias 5)

    other = Muon(other_model.named_parameters(), **HP)
    for p in other_model.parameters():
        p.grad = torch.ones_like(p)
    other.step()
    assert len(other.state) == 6
    other.load_state_dict(saved)  # as torch's: the whole state is replaced
    assert other_model["b"].weight not in other.state and len(other.state) == 4
    assert_bitwise(other.functional_state, opt.functional_state)

    opt.state[b_bias]["exp_avg"] = torch.ones(2)  # the other entries as its first step makes them
    assert opt.state_dict()["state"].keys() == {0, 1, 3, 4, 5}
    opt.zero_grad()
    b_bias.grad = torch.ones(2)
    opt.step()
    assert int(opt.state[b_bias]["step"]) == 1
    torch.testing.assert_close(opt.state[b_bias]["exp_avg"], torch.full((2,), 1.0))  # lerp of 1 toward 1
    torch.testing.assert_close(opt.state[b_bias]["exp_avg_sq"], torch.full((2,), 1 - HP["adamw_betas"][1]))
    del opt.state[b_bias]
    assert b_bias not in opt.state
    with pytest.raises(KeyError):
        del opt.state[b_bias]
    opt.state[b_weight] = {"momentum_buffer": torch.ones(2, 8)}
    opt.state[b_weight] = {}  # torch's way to forget one parameter's state
    assert not opt.state[b_weight]
    assert 5 not in opt.state_dict()["state"]


def test_a_functional_state_of_some_parameters_gives_the_others_none():
    """A functional state holds all of a parameter's entries or none: taken, the parameters it
    leaves out have no state (made at their next step); one with some of its entries is refused."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(2))
    state = opt.functional_state
    state = state.exclude(*[key for key in state.keys(True, True) if key[-1].startswith("3.")])
    fresh = Muon(model.named_parameters(), **HP)
    fresh.functional_state = state
    assert model[3].weight not in fresh.state and model[3].bias not in fresh.state and len(fresh.state) == 6
    assert_bitwise(fresh.functional_state, state)
    # as muonfn.muon(...).init makes it for some of the parameters
    fresh.functional_state = muonfn.muon(**HP).init(params_of(model).select("5"))
    assert list(fresh.state) == [model[5].weight, model[5].bias]
    fresh.functional_state = fresh.transform.init(params_of(model))  # every parameter's (docs/distributed.md)
    assert len(fresh.state) == 8 and not fresh.state[model[0].weight]["momentum_buffer"].any()

    before = snapshot(model, fresh)
    with pytest.raises(
        ValueError,
        match=r"^functional_state: missing 'adamw\.step\.0\.bias' of parameter '0\.bias', which has "
        r"\['adamw\.exp_avg\.0\.bias', 'adamw\.exp_avg_sq\.0\.bias'\]",
    ):
        fresh.functional_state = state.exclude(("adamw", "step", "0.bias"))
    assert_unchanged(model, fresh, before)


# ---------------------------------------------------------------------------- amp and compile


def test_grad_scaler_skips_inf_steps_and_is_exact_otherwise():
    data = batches(6)
    model, plain = mlp(), mlp()
    opt, plain_opt = Muon(model.named_parameters(), **HP), Muon(plain.named_parameters(), **HP)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        if i == 3:
            model[3].weight.grad[0, 0] = float("inf")
            before = snapshot(model, opt)
            scaler.step(opt)
            assert_unchanged(model, opt, before)
        else:
            scaler.step(opt)
            shim_steps(plain, plain_opt, [(x, y)])
        scaler.update()
    assert scaler.get_scale() < 2.0**10
    # power-of-two scaling is exact: the scaled run equals the plain one bit for bit
    assert_bitwise(TensorDict.from_module(model), TensorDict.from_module(plain))
    assert_bitwise(opt.functional_state, plain_opt.functional_state)


def test_compiled_training_step_matches_eager():
    # The step itself runs eagerly (a graph break); aot_eager compiles forward and backward
    # without changing their rounding, so the results must agree bit for bit.
    data = batches(3)
    eager = mlp()
    eager_opt = Muon(eager.named_parameters(), **HP)
    shim_steps(eager, eager_opt, data, torch.optim.lr_scheduler.LambdaLR(eager_opt, lambda s: 0.5**s))

    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)

    @torch.compile(backend="aot_eager")
    def train_step(x, y):
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        return loss

    torch._dynamo.reset()
    for x, y in data:
        train_step(x, y)
        scheduler.step()
    assert_bitwise(TensorDict.from_module(model), TensorDict.from_module(eager))
    assert_bitwise(opt.functional_state, eager_opt.functional_state)
    assert int(opt.functional_state["adamw", "step", "0.bias"]) == 3


def initial_params() -> TensorDictBase:
    """The parameters every ``mlp()`` starts from."""
    return params_of(mlp())


def compiled_graphs(counter) -> int:
    """Graphs with work in them (Dynamo may also hand the backend an empty one for a wrapper frame)."""
    return sum(1 for g in counter.graphs if any(n.op == "call_function" for n in g.graph.nodes))


def assert_eager_to_rounding(got: TensorDictBase, eager: TensorDictBase, initial: TensorDictBase | None = None) -> None:
    """The same leaves, shapes and dtypes, values within a few roundings: the eager step reads
    the shim's host hyperparameters as numbers (``-η`` joins the shape scale in the Newton–Schulz
    call, the decay is one multiply-add), the graph keeps them as tensors (a new value does not
    recompile) and takes the chain's passes. Where Newton–Schulz iterates in bf16
    (``MUONFN_CPU_NS_DTYPE=bfloat16``) the two roundings of the iteration feed back into every leaf:
    then within that iteration's rounding of how far each leaf moved from ``initial`` (parameters;
    states start from zero)."""
    assert sorted(got.keys(True, True), key=str) == sorted(eager.keys(True, True), key=str)
    for key, want in eager.items(True, True):
        have = got.get(key)
        assert (have.dtype, have.shape) == (want.dtype, want.shape), key
    iteration = iteration_dtype(*(t.shape for t in eager.values(True, True) if t.ndim >= 2))
    assert_td_close_to_iteration(got, eager, atol=1e-6, iteration=iteration, initial=initial)


@pytest.mark.parametrize(("variant", "rule"), [("muon", None), ("muon", "bfloat16")])
def test_compiled_step_matches_eager_and_compiles_once(monkeypatch, variant, rule):
    """compile=: the whole step (here in parts) is one graph, reused while a scheduler changes
    lr; aot_eager keeps eager's arithmetic but for the order of the matrices' tail, so the
    results agree to rounding: fp32's, or with the bf16 rule forced the bf16 iteration's. A step
    where a parameter has no gradient is another structure: compiled anew. (NorMuon's and AdaMuon's
    branches compile as the presets' do: ``tests/test_contract.py``, ``tests/test_functional.py``.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    if rule is not None:
        monkeypatch.setenv("MUONFN_CPU_NS_DTYPE", rule)
    data = batches(5)
    settings = {**HP, "variant": variant, "chunk_numel": 100}
    runs = []
    counter = CompileCounterWithBackend("aot_eager")
    for compile in (False, {"backend": counter}):
        model = mlp()
        opt = Muon(model.named_parameters(), **settings, compile=compile)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        shim_steps(model, opt, data[:4], scheduler)
        assert compiled_graphs(counter) == (1 if compile else 0)
        opt.zero_grad()
        loss_of(model, *data[4]).backward()
        model[5].bias.grad = None
        opt.step()
        runs.append((model, opt))
    assert compiled_graphs(counter) == 2
    (eager, eager_opt), (model, opt) = runs
    assert sum(p.numel() for p in model.parameters()) > 2 * settings["chunk_numel"]  # (the premise: parts)
    assert_eager_to_rounding(TensorDict.from_module(model), TensorDict.from_module(eager), initial_params())
    assert_eager_to_rounding(opt.functional_state, eager_opt.functional_state)


def test_compiled_step_with_inductor_is_eager_to_rounding():
    """compile=True: inductor's default kernels (fused elementwise work rounds its own way)."""
    from torch._dynamo.utils import counters

    data = batches(3)
    eager, model = mlp(), mlp()
    eager_opt = Muon(eager.named_parameters(), **HP)
    opt = Muon(model.named_parameters(), **HP, compile=True)
    shim_steps(eager, eager_opt, data)
    graphs = counters["stats"]["unique_graphs"]
    shim_steps(model, opt, data)
    assert counters["stats"]["unique_graphs"] == graphs + 1
    assert_eager_to_rounding(TensorDict.from_module(model), TensorDict.from_module(eager), initial_params())
    assert int(opt.functional_state["adamw", "step", "0.bias"]) == 3


def test_compiled_step_checks_input_eagerly_and_copies():
    """Bad input raises before the graph runs, changing nothing; a deep copy compiles its own step."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP, compile={"backend": "aot_eager"})
    shim_steps(model, opt, batches(1))
    copied_model = copy.deepcopy(model)
    copied = Muon(copied_model.named_parameters(), **HP, compile={"backend": "aot_eager"})
    copied.load_state_dict(copy.deepcopy(opt.state_dict()))
    model[0].weight.grad = torch.zeros(12, 6).to_sparse()
    before = snapshot(model, opt)
    with pytest.raises(TypeError, match=r"'0.weight' is torch.sparse_coo"):
        opt.step()
    assert_unchanged(model, opt, before)
    shim_steps(model, opt, batches(2, seed=3))
    shim_steps(copied_model, copied, batches(2, seed=3))
    assert_bitwise(TensorDict.from_module(model), TensorDict.from_module(copied_model))


@torch._dynamo.config.patch(recompile_limit=1)
def test_compiled_structures_do_not_share_recompilations(monkeypatch):
    """Each optimizer, and each structure of one, compiles a graph of its own: with a
    recompilation limit of 1 two optimizers of different settings and a step without a
    bias gradient all compile (fullgraph=True would raise at the limit). Past
    MAX_COMPILED_STRUCTURES a new structure steps eagerly, with one warning, to eager's results
    (to the rounding of :func:`assert_eager_to_rounding`)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import muonfn.optim._optimizer as shim

    monkeypatch.setattr(shim, "MAX_COMPILED_STRUCTURES", 2)
    data = batches(4)
    runs = []
    for compiled in (False, True):
        for variant in ("muon", "normuon"):
            model = mlp()
            counter = CompileCounterWithBackend("aot_eager")
            compile = {"backend": counter} if compiled else False
            opt = Muon(model.named_parameters(), **HP, variant=variant, compile=compile)
            shim_steps(model, opt, data[:1])
            for step, unused in enumerate(["5.bias", "3.bias"]):
                opt.zero_grad()
                loss_of(model, *data[1 + step]).backward()
                model.get_parameter(unused).grad = None
                if compile and step == 1:
                    with pytest.warns(
                        UserWarning, match="2 structures .* are compiled; steps of other structures run eagerly"
                    ):
                        opt.step()
                else:
                    opt.step()
            if compile:
                assert compiled_graphs(counter) == 2
            runs.append((model, opt))
    for (eager, eager_opt), (model, opt) in zip(runs[:2], runs[2:]):
        assert_eager_to_rounding(TensorDict.from_module(model), TensorDict.from_module(eager), initial_params())
        assert_eager_to_rounding(opt.functional_state, eager_opt.functional_state)


def test_compile_option_is_checked():
    model = mlp()
    with pytest.raises(TypeError, match=r"compile=\.\.\.\) takes a bool or a mapping"):
        Muon(model.named_parameters(), compile="yes")

    def build(collectives) -> str:
        sharded = muonfn.distributed.sharded_orthogonalizer(collectives)
        with pytest.raises(ValueError, match="which cannot be compiled; leave compile off with it") as error:
            Muon(model.named_parameters(), compile=True, orthogonalizer=sharded)
        return str(error.value)

    from muonfn.testing import simulate

    assert simulate(1, build)[0].startswith("Muon(compile=...)")


def test_bad_gradients_raise_before_anything_changes():
    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": nn.Embedding(5, 4, sparse=True), "proj": nn.Linear(4, 4)})
    opt = Muon(model.named_parameters(), **HP)
    model["proj"](model["embed"](torch.tensor([1, 2]))).sum().backward()
    before = snapshot(model, opt)
    with pytest.raises(TypeError, match=r"'embed.weight' is torch.sparse_coo"):
        opt.step()
    assert_unchanged(model, opt, before)


# ---------------------------------------------------------------------------- opt.state and state_dict as torch's


def test_param_state_is_torchs_plain_dict_read_and_checked_at_the_next_step():
    """``opt.state[p]`` is a plain dict of the state's own tensors under torch's names, as torch's is:
    the step continues from what is written there (in the same dict, its tensors updated in place), and
    refuses what it cannot take before anything changes, naming the parameter and the entry."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(2))
    weight, bias = model[0].weight, model[0].bias
    entries = opt.state[weight]
    entries["momentum_buffer"] = torch.ones(12, 6)
    assert torch.equal(opt.functional_state["muon", "momentum", "0.weight"], torch.ones(12, 6))
    opt.state[bias].update({"exp_avg": torch.full((12,), 2.0)}, step=torch.tensor(7))
    assert torch.equal(opt.functional_state["adamw", "exp_avg", "0.bias"], torch.full((12,), 2.0))
    assert int(opt.functional_state["adamw", "step", "0.bias"]) == 7
    ref = copy.deepcopy({"model": model, "opt": opt})
    shim_steps(model, opt, batches(1, seed=5))
    assert (
        opt.state[weight] is entries
        and entries["momentum_buffer"] is opt.functional_state["muon", "momentum", "0.weight"]
    )
    assert int(opt.state[bias]["step"]) == 8
    assert list(opt.state[bias]) == ["step", "exp_avg", "exp_avg_sq"] and len(entries) == 1
    # the step continued from the written entries: as a functional update of the same state
    tx = muonfn.muon(**HP)
    params = params_of(ref["model"])
    ref["opt"].zero_grad()
    loss_of(ref["model"], *batches(1, seed=5)[0]).backward()
    grads = TensorDict({n: p.grad for n, p in ref["model"].named_parameters()}, []).unflatten_keys(".")
    _, state = tx.update(grads, ref["opt"].functional_state, params)
    assert_bitwise(opt.functional_state, state)

    cases = [
        (
            "exp_avg",
            torch.zeros(12, 6),
            weight,
            ValueError,
            r"^the state of parameter '0\.weight' has no entry 'exp_avg'; its en",
        ),
        (
            "exp_avg_sq",
            torch.zeros(6),
            bias,
            ValueError,
            r"'adamw\.exp_avg_sq\.0\.bias' is a torch\.float32 tensor of shape \(6,\)",
        ),
        (
            "step",
            torch.tensor(3.0),
            bias,
            ValueError,
            r"'adamw\.step\.0\.bias' is a torch\.float32 tensor of shape \(\), expected torch\.int64",
        ),
        (
            "exp_avg",
            "zeros",
            bias,
            TypeError,
            r"^the state of parameter '0\.bias' \(exp_avg\) must be a tensor, got str",
        ),
    ]
    for entry, value, p, error, match in cases:
        held = dict(opt.state[p])
        opt.state[p][entry] = value
        opt.zero_grad()
        loss_of(model, *batches(1, seed=6)[0]).backward()
        before = params_of(model)
        with pytest.raises(error, match=match):
            opt.step()
        assert_bitwise(TensorDict.from_module(model), before)
        opt.state[p] = held

    opt.state[bias].clear()  # torch's way to forget a parameter's state: made anew at its next step
    popped = opt.state.pop(model[3].bias)  # the entries as they were; the state is forgotten
    assert int(popped["step"]) == 3 and model[3].bias not in opt.state
    shim_steps(model, opt, batches(1, seed=6))
    assert int(opt.state[bias]["step"]) == 1 and int(opt.state[model[3].bias]["step"]) == 1


def test_load_state_dict_does_not_share_group_tensors_with_the_source():
    source = Muon(mlp().named_parameters(), lr=torch.tensor(0.02, dtype=torch.float64), adamw_lr=torch.tensor(0.004))
    target = Muon(mlp().named_parameters(), lr=0.1)
    target.load_state_dict(source.state_dict())
    assert all(t["lr"] is not s["lr"] for t, s in zip(target.param_groups, source.param_groups))
    scheduler = torch.optim.lr_scheduler.StepLR(source, step_size=1, gamma=0.1)
    source.step()
    scheduler.step()
    assert float(source.param_groups[0]["lr"]) == pytest.approx(0.002)
    assert [float(g["lr"]) for g in target.param_groups] == [0.02, float(torch.tensor(0.004))]


def test_non_parameter_state_entries_travel_through_state_dict_as_in_torch():
    def mark(optimizer: torch.optim.Optimizer) -> None:  # torch's own state_dict hook tests do this
        optimizer.state["test"] = 1

    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    sgd = torch.optim.SGD(mlp().parameters(), lr=0.1)
    for o in (opt, sgd):
        o.register_state_dict_pre_hook(mark)
    shim_steps(model, opt, batches(2))
    sd = reloaded(opt.state_dict())
    assert sd["state"]["test"] == 1 and sorted(k for k in sd["state"] if k != "test") == list(range(8))

    other = Muon(mlp(seed=3).named_parameters(), **HP)
    other.state["stale"] = 2  # a load replaces the whole state, as torch's does
    other.load_state_dict(sd)
    sgd_other = torch.optim.SGD(mlp().parameters(), lr=0.1)
    sgd_other.state["stale"] = 2
    sgd_other.load_state_dict(sgd.state_dict())
    for o in (other, sgd_other):
        assert o.state["test"] == 1 and "stale" not in o.state
    assert_bitwise(other.functional_state, opt.functional_state)
    third = Muon(mlp().named_parameters(), **HP)
    third.load_state_dict(other.state_dict())
    assert third.state["test"] == 1

    # lookups other than [] leave no entry behind, as a defaultdict's
    stray = torch.zeros(2)
    assert opt.state.get(stray) is None and opt.state.get("missing", 5) == 5 and stray not in opt.state
    assert opt.state.setdefault("k", 3) == 3 and opt.state.pop("k") == 3 and "k" not in opt.state
    assert opt.state.get(model[0].weight).keys() == {"momentum_buffer"}

    # a lookup under a tensor that is no parameter leaves an empty entry (a defaultdict's): nothing to save
    frozen = torch.zeros(3)
    assert opt.state[frozen] == {} and frozen in opt.state
    assert len(opt.state_dict()["state"]) == 9
    opt.state[frozen]["ema"] = torch.ones(3)  # torch's state_dict cannot number it either
    with pytest.raises(ValueError, match=r"tensor of shape \(3,\) that is not a parameter of this optimizer"):
        opt.state_dict()


def test_load_state_dict_keeps_saved_param_names_in_an_unnamed_optimizer():
    named = Muon(mlp().named_parameters(), **HP)
    plain = Muon(mlp().parameters(), **HP)
    plain.load_state_dict(named.state_dict())
    names = [g["param_names"] for g in named.param_groups]
    assert names == [["0.weight", "3.weight", "5.weight"], ["0.bias", "1.weight", "1.bias", "3.bias", "5.bias"]]
    assert [g.get("param_names") for g in plain.param_groups] == names
    # as torch keeps them
    sgd = torch.optim.SGD(mlp().parameters(), lr=0.1)
    sgd.load_state_dict(torch.optim.SGD(mlp().named_parameters(), lr=0.1).state_dict())
    assert sgd.param_groups[0]["param_names"] == [n for n, _ in mlp().named_parameters()]
    assert [g["param_names"] for g in plain.state_dict()["param_groups"]] == names


def test_adamw_betas_must_be_a_pair():
    model = mlp()
    for betas in [(0.9, 0.95, 0.99), (0.9,), 0.9]:
        with pytest.raises(
            ValueError, match=rf"^adamw_betas must be a pair \(beta1, beta2\), got {re.escape(repr(betas))}$"
        ):
            Muon(model.named_parameters(), adamw_betas=betas)
    with pytest.raises(ValueError, match=r"param group 0: adamw_betas must be a pair"):
        Muon([{"params": model.parameters(), "use_muon": False, "adamw_betas": (0.9,)}])
    opt = Muon(model.named_parameters(), **HP)
    opt.param_groups[1]["beta2"] = 1.0
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"param group 1: beta2 must be in \[0, 1\), got 1\.0"):
        shim_steps(model, opt, batches(1))
    assert_unchanged(model, opt, before)


def test_a_repeated_tensor_is_named_by_the_key_it_has():
    model = mlp()
    tensors = list(model.parameters())
    with pytest.raises(ValueError, match=r"^parameter '0' is already in parameter group 0$"):
        Muon([{"params": tensors[:2]}, {"params": [tensors[2], tensors[0]]}])
    opt = Muon(model.named_parameters(), **HP)
    with pytest.raises(
        ValueError, match=r"^parameter '0.bias' \(given again as 'b'\) is already in parameter group 1$"
    ):
        opt.add_param_group({"params": [("b", model[0].bias)], "use_muon": False})


def test_a_tensor_put_in_params_by_hand_keeps_its_position_when_tensors_are_added_without_names():
    first, by_hand, added = (nn.Parameter(torch.randn(3, 3)) for _ in range(3))
    opt = Muon([first], **HP)
    opt.param_groups[0]["params"].append(by_hand)
    opt.add_param_group({"params": [added]})
    assert [g["params"] for g in opt.param_groups if g["params"]] == [[first, by_hand], [added]]
    for p in (first, by_hand, added):
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.functional_state
    assert sorted(state["muon"].keys(True, True)) == [("momentum", "0"), ("momentum", "1")]
    assert sorted(state["muon_1"].keys(True, True)) == [("momentum", "2")]


NAME_TYPOS = {
    "labels": {**{n: "muon" if p.ndim == 2 else "adamw" for n, p in mlp().named_parameters()}, "5.wieght": "muon"},
    "views": {"3.wieght": muonfn.MatrixView(transposed=True)},
    "weight_decay_mask": {"1.bais": False},
}


@pytest.mark.parametrize("table", [*NAME_TYPOS, "weight_decay_mask as a function"])
def test_name_typos_are_rejected_as_by_muonfn_muon(table):
    kwargs = {table: NAME_TYPOS[table]} if table in NAME_TYPOS else {"weight_decay_mask": lambda p: {"1.bais": False}}
    model = mlp()
    with pytest.raises(ValueError) as functional:
        muonfn.muon(**kwargs).init(params_of(model))
    with pytest.raises(ValueError, match=r"names '\d.\w+', which is not a parameter; parameters are") as shim:
        Muon(model.named_parameters(), **kwargs)
    assert same_name_error(str(shim.value), str(functional.value))


def same_name_error(shim: str, functional: str) -> bool:
    """The same message (the functional one may say it comes from ``partition``); the shim may list
    the parameters in its groups' order."""
    head, names = shim.split("; parameters are ")
    functional_head, functional_names = functional.split("; parameters are ")
    same_names = sorted(ast.literal_eval(names)) == sorted(ast.literal_eval(functional_names))
    return head == functional_head.removeprefix("partition: ") and same_names


def test_shard_spec_typos_are_rejected_as_by_muonfn_muon():
    from muonfn.distributed import ShardSpec, sharded_orthogonalizer
    from muonfn.testing import simulate

    def messages(collectives) -> list[str]:
        model = mlp()
        specs = {"3.wieght": ShardSpec(0)}
        found = []
        for build in (
            lambda: muonfn.muon(orthogonalizer=sharded_orthogonalizer(collectives, shard_specs=specs)).init(
                params_of(model)
            ),
            lambda: Muon(
                model.named_parameters(), orthogonalizer=sharded_orthogonalizer(collectives, shard_specs=specs)
            ),
        ):
            with pytest.raises(ValueError, match=r"shard_specs names '3.wieght', which is not a parameter") as error:
                build()
            found.append(str(error.value))
        return found

    (functional, shim), *_ = simulate(1, messages)
    assert same_name_error(shim, functional)


def test_a_shard_of_one_row_goes_to_muon_in_the_shim_as_in_muonfn_muon():
    """A rank's one-row block of a larger matrix (a leaf of the orthogonalizer's ``shard_specs``) is a
    matrix to the default labels, the shim's as the functional preset's."""
    from muonfn.distributed import ShardSpec, sharded_orthogonalizer
    from muonfn.testing import simulate

    def routes(collectives) -> tuple[list[str], list[str]]:
        model = nn.Sequential(nn.Linear(8, 1))  # "0.weight": (1, 8)
        sharded = sharded_orthogonalizer(collectives, shard_specs={"0.weight": ShardSpec(0)})
        state = muonfn.muon(orthogonalizer=sharded).init(params_of(model))
        shim = Muon(model.named_parameters(), orthogonalizer=sharded)
        return list(state["muon", "momentum"].keys()), shim.param_groups[0]["param_names"]

    (functional, shim), *_ = simulate(1, routes)
    assert functional == shim == ["0.weight"]


def test_one_element_tensors_are_numbers_in_groups_and_schedulers():
    def run(number) -> tuple[nn.Module, Muon]:
        model = mlp()
        opt = Muon(
            [{"params": model.named_parameters(), "lr": number(0.02), "weight_decay": number(0.05)}],
            momentum=number(0.9),
            adamw_betas=(0.85, 0.97),
        )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=[0.02, 0.004], total_steps=6, base_momentum=0.7, max_momentum=0.95
        )
        shim_steps(model, opt, batches(5), scheduler)
        return model, opt

    floats = run(float)
    for shape in [(), (1,), (1, 1)]:
        tensors = run(lambda v: torch.full(shape, v, dtype=torch.float64))
        # the two halves of the one dict are two groups to the scheduler: no tensor couples them
        assert tensors[1].param_groups[0]["lr"] is not tensors[1].param_groups[1]["lr"]
        assert [float(g["lr"]) for g in tensors[1].param_groups] == [g["lr"] for g in floats[1].param_groups]
        assert_bitwise(TensorDict.from_module(tensors[0]), TensorDict.from_module(floats[0]))
        assert_bitwise(tensors[1].functional_state, floats[1].functional_state)
    opt = tensors[1]
    opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2])
    with pytest.raises(ValueError, match=r"param group 0: lr must be a number, got a tensor of shape \(2,\)"):
        opt.step()


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (torch.tensor(True), TypeError, r"param group 0: lr must be a real number, got a torch.bool tensor"),
        (torch.tensor(0.1 + 0j), TypeError, r"param group 0: lr must be a real number, got a torch.complex64 tensor"),
        (
            torch.tensor(0.1, device="meta"),
            ValueError,
            r"param group 0: lr is a tensor on the meta device, which holds no value",
        ),
    ],
    ids=["bool", "complex", "meta"],
)
def test_a_group_lr_that_is_no_real_number_is_refused_before_the_step(value, error, match):
    """As the functional presets refuse the same tensors as lr=: not read as 1.0, 0.1 or a crash."""
    model = mlp()
    opt = Muon(model.named_parameters(), **HP)
    shim_steps(model, opt, batches(1))
    opt.param_groups[0]["lr"] = value
    loss_of(model, *batches(1, seed=5)[0]).backward()
    params, state = params_of(model), opt.functional_state.clone()
    with pytest.raises(error, match=match):
        opt.step()
    assert_bitwise(TensorDict.from_module(model), params)
    assert_bitwise(opt.functional_state, state)


# ---------------------------------------------------------------------------- stepping in parts


@pytest.mark.parametrize(
    ("dtype", "variant"), [(torch.float32, "muon"), (torch.bfloat16, "muon"), (torch.float32, "normuon")]
)
def test_stepping_in_parts_gives_the_same_bits(dtype, variant):
    """One part per parameter, a few parts, one part: the same params and state, skipped grads too
    (no two of the model's matrices share a Newton–Schulz call, so no part splits one)."""
    data = batches(4, dtype=dtype)
    runs = []
    for chunk_numel in (1, 100, "auto", None):
        model = mlp(dtype=dtype, hidden=16)
        opt = Muon(model.named_parameters(), **HP, variant=variant, chunk_numel=chunk_numel)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            if i == 2:
                model[3].weight.grad = None  # a part may lack a parameter
            opt.step()
        runs.append((TensorDict.from_module(model).clone(), opt.functional_state.clone()))
    for params, state in runs[1:]:
        assert_bitwise(params, runs[0][0])
        assert_bitwise(state, runs[0][1])


def newton_schulz_calls(shapes: list[tuple[int, ...]], chunk_numel) -> list[tuple[int, ...]]:
    """The batches one step hands Newton–Schulz (recorded by an ``ns=`` map of one's own), in order."""
    calls = []

    def recorded(x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta:  # (init checks the map on meta batches)
            calls.append(tuple(x.shape))
        return muonfn.NewtonSchulz(steps=1)(x)

    gen = torch.Generator().manual_seed(0)
    named = [(f"p{i}", nn.Parameter(torch.randn(shape, generator=gen))) for i, shape in enumerate(shapes)]
    opt = Muon(
        named, ns=recorded, chunk_numel=chunk_numel, orthogonalizer=muonfn.LocalOrthogonalizer(bucket_numel=2**30)
    )
    for _, p in named:
        p.grad = torch.ones_like(p)
    opt.step()
    return calls


def test_parts_follow_the_sizes_and_keep_kinds_together():
    """Each part is stepped whole, so the Newton–Schulz batches show the parts: at most
    ``chunk_numel`` elements each (a larger parameter alone), the matrices of one call (one shape, a
    2-D one with its transpose) kept together where they fit; ``"auto"`` makes parts of a tenth of
    the parameters, of at least 2**18 elements; ``None`` one part."""
    shapes = [(2, 2), (2, 2), (2, 2), (3, 3), (2, 3)]
    assert newton_schulz_calls(shapes, None) == [(3, 2, 2), (1, 3, 3), (1, 2, 3)]
    assert newton_schulz_calls(shapes, 8) == [(2, 2, 2), (1, 2, 2), (1, 3, 3), (1, 2, 3)]
    assert newton_schulz_calls(shapes, 1) == [(1, 2, 2)] * 3 + [(1, 3, 3), (1, 2, 3)]
    # a call that fits in a part starts one where the current one has no room for it
    assert newton_schulz_calls([(2, 3), (2, 2), (2, 2)], 12) == [(1, 2, 3), (2, 2, 2)]
    big = [(512, 512)] * 30  # 30 matrices of 2**18 elements: "auto" makes 10 parts of 3
    assert newton_schulz_calls(big, "auto") == [(3, 512, 512)] * 10
    assert newton_schulz_calls([(3, 3)] * 4, "auto") == [(4, 3, 3)]  # small: one part


@pytest.fixture
def rounding_by_batch_size(monkeypatch):
    """Batched matrix products that round a batch of one matrix another way than a larger batch
    (summing the two halves of the inner dimension apart, as a BLAS that splits the work across
    threads may), as some CPUs' BLAS does in fp32: the parts' only way to change bits."""
    bmm, baddbmm = torch.bmm, torch.baddbmm

    def product(a, b):
        k = a.shape[-1] // 2
        return bmm(a[..., :k], b[..., :k, :]) + bmm(a[..., k:], b[..., k:, :])

    def split_bmm(a, b, *, out=None):
        if a.shape[0] != 1:
            return bmm(a, b, out=out)
        return product(a, b) if out is None else out.copy_(product(a, b))

    def split_baddbmm(c, a, b, *, beta=1.0, alpha=1.0, out=None):
        if a.shape[0] != 1:
            return baddbmm(c, a, b, beta=beta, alpha=alpha, out=out)
        result = c * beta + product(a, b) * alpha
        return result if out is None else out.copy_(result)

    monkeypatch.setattr(torch, "bmm", split_bmm)
    monkeypatch.setattr(torch, "baddbmm", split_baddbmm)


def _parts_run(chunk_numel, *, variant="muon", ns_dtype=torch.float32, steps=3):
    """Params and state after ``steps`` steps on fixed gradients, with the summed norms of each
    parameter's updates: a matrix a, and b, c, d of one Newton–Schulz call (c is b's shape
    transposed) that fits in a part of 1536 elements, but not with a; a bias goes to AdamW."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (8, 8), "b": (16, 32), "c": (32, 16), "d": (16, 32), "e": (16,)}
    named = [(name, nn.Parameter(torch.randn(shape, generator=gen))) for name, shape in shapes.items()]
    ns = muonfn.NewtonSchulz(dtype=ns_dtype)
    opt = Muon(named, lr=0.02, weight_decay=0.0, variant=variant, ns=ns, chunk_numel=chunk_numel)
    moved = dict.fromkeys(shapes, 0.0)
    for _ in range(steps):
        before = {name: p.detach().clone() for name, p in named}
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        for name, p in named:
            moved[name] += float((p.detach() - before[name]).norm())
    params = TensorDict({name: p.detach() for name, p in named}, batch_size=[])
    return params, opt.functional_state, moved


def test_parts_keep_a_newton_schulz_call_that_fits_and_its_bits(rounding_by_batch_size):
    """b, c and d fit in a part: they keep the one-part step's call, and its bits, where the
    rounding of a batched product depends on the batch's size. Parts used to fill up with a,
    b and d, leaving c a call of its own."""
    whole = _parts_run(None)
    params, state, _ = _parts_run(1536)
    assert_bitwise(params, whole[0])
    assert_bitwise(state, whole[1])
    split, _, _ = _parts_run(1)
    assert not torch.equal(split["c"], whole[0]["c"])  # (the premise: the rounding tells the batches apart)


@pytest.mark.parametrize(
    ("variant", "ns_dtype"),
    [("muon", torch.float32), ("muon", torch.bfloat16), ("normuon", torch.float32), ("adamuon", torch.float32)],
)
def test_parts_that_split_a_newton_schulz_call_stay_within_its_rounding(rounding_by_batch_size, variant, ns_dtype):
    """One part per parameter splits b, c, d's call into three: their updates may then differ
    as two roundings of the iteration do, within the equivariance tolerance of
    muonfn.testing (the bound docs/shim.md states); everything else keeps its bits."""
    from muonfn.testing import TOLERANCES

    params, state, moved = _parts_run(None, variant=variant, ns_dtype=ns_dtype)
    split_params, split_state, _ = _parts_run(1, variant=variant, ns_dtype=ns_dtype)
    for name in ("a", "e"):  # a call of one matrix either way; AdamW
        assert torch.equal(split_params[name], params[name]), name
    assert_bitwise(split_state["adamw"], state["adamw"])
    assert_bitwise(split_state["muon", "momentum"], state["muon", "momentum"])
    differences = {name: float((split_params[name] - params[name]).norm()) for name in ("b", "c", "d")}
    assert any(differences.values())  # (the premise: the rounding tells the calls apart)
    for name, difference in differences.items():
        assert difference <= TOLERANCES[ns_dtype].equivariance * moved[name], name


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "half"])
def test_a_bad_chunk_numel_is_refused(bad):
    with pytest.raises(ValueError, match=r"chunk_numel must be a positive int, 'auto' or None"):
        Muon(mlp().named_parameters(), chunk_numel=bad)


# ------------------------------------------------------------- edits the shim refuses or undoes


def _stepped() -> tuple[nn.Sequential, Muon]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt = Muon(net.named_parameters(), **HP)
    net(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    return net, opt


def test_an_edited_use_muon_is_refused_naming_the_group_and_changes_nothing():
    net, opt = _stepped()
    before = opt.functional_state.clone()
    opt.param_groups[0]["use_muon"] = not opt.param_groups[0]["use_muon"]
    with pytest.raises(ValueError, match=r"param group 0: use_muon=False, but its settings are a Muon group's: a gr"):
        opt.step()
    opt.param_groups[0]["use_muon"] = not opt.param_groups[0]["use_muon"]  # set back: as it was
    assert_bitwise(opt.functional_state, before)
    net(torch.randn(5, 4)).square().mean().backward()
    opt.step()


def _appended(opt: Muon, net: nn.Module) -> None:
    opt.param_groups[0]["params"].append(nn.Parameter(torch.randn(6, 6)))


def _removed(opt: Muon, net: nn.Module) -> None:
    del opt.param_groups[1]["params"][1]  # 1.bias


def _replaced(opt: Muon, net: nn.Module) -> None:
    opt.param_groups[0]["params"][1] = nn.Parameter(torch.randn(3, 8))


def _moved(opt: Muon, net: nn.Module) -> None:
    opt.param_groups[1]["params"].append(opt.param_groups[0]["params"].pop())


def _repeated(opt: Muon, net: nn.Module) -> None:
    opt.param_groups[0]["params"][1] = net[0].weight


def _group_appended(opt: Muon, net: nn.Module) -> None:
    opt.param_groups.append({**opt.param_groups[0], "params": [nn.Parameter(torch.randn(5, 5))]})


def _group_removed(opt: Muon, net: nn.Module) -> None:
    del opt.param_groups[1]


def _group_repeated(opt: Muon, net: nn.Module) -> None:
    opt.param_groups.extend(opt.param_groups)  # as torch's test_state_dict_deterministic does (pytorch#36831)


def _use_muon_edited(opt: Muon, net: nn.Module) -> None:
    opt.param_groups[0]["use_muon"] = False


def torch_numbering(groups: list[dict]) -> list[list[int]]:
    """The parameter indices torch's ``Optimizer.state_dict`` gives ``groups``."""
    reference = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    reference.param_groups = [{"params": list(g["params"])} for g in groups]
    return [g["params"] for g in reference.state_dict()["param_groups"]]


@pytest.mark.parametrize("edit", [_appended, _removed, _replaced, _group_appended, _group_removed])
def test_a_group_edited_in_param_groups_steps_as_torch_steps_it(edit):
    """torch.optim steps what ``param_groups`` hold at each step: a tensor appended to a group's params
    or put in place of another, a group appended or removed. So does the shim: each tensor of a group
    steps by its group's settings (one placed there by hand named by its position), its state made at
    its first step; a tensor no group holds any more keeps its state, as in torch, but is not stepped
    or saved."""
    net, opt = _stepped()
    before = {p: p.detach().clone() for p in net.parameters()}
    counts = {p: int(entries["step"]) for p, entries in opt.state.items() if "step" in entries}
    edit(opt, net)
    members = {id(p): p for g in opt.param_groups for p in g["params"]}
    for p in [*net.parameters(), *members.values()]:
        p.grad = torch.ones_like(p)
    opt.step()
    for p, was in before.items():
        assert torch.equal(p, was) != (id(p) in members)
    assert all(opt.state[p] for p in members.values())
    for p, count in counts.items():
        assert int(opt.state[p]["step"]) == count + (id(p) in members)
    assert sorted(opt.state_dict()["state"]) == sorted({i for g in torch_numbering(opt.param_groups) for i in g})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_moved, r"^the state of parameter '1\.weight' has no entry 'momentum_buffer'; its entries are \['step', "),
        (_repeated, r"^param group 0: parameter '0\.weight' is in its params twice"),
        (_group_repeated, r"^param group 2 is param group 0 again; a group is stepped once"),
        (_use_muon_edited, r"^param group 0: use_muon=False, but its settings are a Muon group's"),
    ],
)
def test_a_group_edit_the_shim_cannot_step_is_refused_naming_it_and_changes_nothing(edit, match):
    """A Muon parameter's state moved to an AdamW group, a tensor twice in a group, a group twice in
    ``param_groups`` (torch's own tests do that, pytorch#36831), a group's ``use_muon`` changed: the
    next step refuses, naming the group or the parameter, before anything changes."""
    net, opt = _stepped()
    params = params_of(net)
    held = {p: {k: v.clone() for k, v in entries.items()} for p, entries in opt.state.items()}
    edit(opt, net)
    net(torch.randn(5, 4)).square().mean().backward()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert_bitwise(TensorDict.from_module(net), params)
    assert len(opt.state) == len(held)
    for p, entries in held.items():
        assert_bitwise(TensorDict(dict(opt.state[p]), []), TensorDict(entries, []))


@pytest.mark.parametrize(
    "edit",
    [
        _appended,
        _removed,
        _replaced,
        _moved,
        _repeated,
        _group_appended,
        _group_removed,
        _group_repeated,
        _use_muon_edited,
    ],
)
def test_state_dict_describes_an_edited_param_groups_as_torch_does(edit):
    """``state_dict()`` describes what ``param_groups`` holds, as torch's does: parameters numbered
    as torch numbers them, each with the state it has (none for one that was not added), groups
    with their entries as they are. torch's own suite repeats the groups and saves (pytorch#36831);
    the shim raised "param_groups holds 4 groups, but 2 were added" there."""
    net, opt = _stepped()
    held = {p: {k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]}
    edit(opt, net)
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == torch_numbering(opt.param_groups)
    for group, packed in zip(opt.param_groups, sd["param_groups"]):
        assert packed == {**{k: v for k, v in group.items() if k != "params"}, "params": packed["params"]}
    numbered = {
        i: p for g, packed in zip(opt.param_groups, sd["param_groups"]) for p, i in zip(g["params"], packed["params"])
    }
    assert set(sd["state"]) == {i for i, p in numbered.items() if p in held}
    for i, entries in sd["state"].items():
        assert_bitwise(TensorDict(entries, []), TensorDict(held[numbered[i]], []))


def test_repeated_groups_save_as_the_groups_they_repeat_and_the_step_refuses_them():
    """torch's test_state_dict_deterministic: the last group of an optimizer whose groups were
    repeated saves as the last group of one whose groups were not. The step refuses to step a
    group twice, naming it, and changes nothing; without the repeat it steps on."""
    net, opt = _stepped()
    saved = opt.state_dict()
    before = snapshot(net, opt)
    opt.param_groups.extend(opt.param_groups)
    repeated = opt.state_dict()
    assert repeated["param_groups"][2:] == saved["param_groups"] == repeated["param_groups"][:2]
    assert repeated["param_groups"][-1] == saved["param_groups"][-1]
    net(torch.randn(5, 4)).square().mean().backward()
    with pytest.raises(ValueError, match=r"^param group 2 is param group 0 again; a group is stepped once"):
        opt.step()
    del opt.param_groups[2:]
    assert_unchanged(net, opt, before)
    opt.step()
    assert not torch.equal(net[0].weight, before[0]["0", "weight"])


def test_a_parameter_in_two_groups_is_refused_by_the_step_naming_both():
    net, opt = _stepped()
    opt.param_groups.append({**opt.param_groups[1], "params": [net[1].bias]})
    net(torch.randn(5, 4)).square().mean().backward()
    with pytest.raises(ValueError, match=r"^param group 2: parameter '1\.bias' is also in param group 1"):
        opt.step()


def test_a_group_reordered_in_param_groups_steps_as_before():
    """Only the parameters a group holds are fixed, not their order (torch's only numbers them
    in a state_dict)."""
    runs = []
    for reorder in (False, True):
        net, opt = _stepped()
        if reorder:
            opt.param_groups[1]["params"].reverse()
        net(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        runs.append((TensorDict.from_module(net).clone(), opt.functional_state.clone()))
        assert opt.state_dict()["state"][2].keys() == {"step", "exp_avg", "exp_avg_sq"}
    assert_bitwise(runs[0][0], runs[1][0])
    assert_bitwise(runs[0][1], runs[1][1])


def test_the_route_of_an_empty_group_is_fixed_too():
    """An empty group's label counts (the k-th Muon group keeps its state under muon_k): its
    use_muon edited would shift the other groups' state labels."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt = Muon([{"params": [], "use_muon": True}, {"params": net.parameters()}], **HP)
    net(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    before = snapshot(net, opt)
    opt.param_groups[0]["use_muon"] = False
    with pytest.raises(ValueError, match=r"param group 0: use_muon=False, but its settings are a Muon group's"):
        opt.step()
    opt.param_groups[0]["use_muon"] = True
    assert_unchanged(net, opt, before)


def test_a_failed_step_after_a_variant_edit_keeps_the_old_layout():
    torch.manual_seed(0)
    lin = nn.Linear(4, 8, bias=False)
    opt = Muon(lin.named_parameters(), lr=0.02, variant="normuon")
    lin(torch.randn(5, 4)).sum().backward()
    opt.step()
    moment = opt.state[lin.weight]["row_second_moment"].clone()
    opt.param_groups[0]["variant"] = "muon"
    lin.weight.grad_dtype = None
    lin.weight.grad = lin.weight.grad.double()
    with pytest.raises(ValueError, match=r"gradient 'weight' is a torch\.float64 tensor"):
        opt.step()
    opt.param_groups[0]["variant"] = "normuon"
    assert torch.equal(opt.state[lin.weight]["row_second_moment"], moment)


def test_clearing_opt_state_resets_every_parameter_and_ends():
    net, opt = _stepped()
    opt.state["note"] = {"x": 1}
    opt.state.clear()
    fresh = Muon(net.named_parameters(), **HP)
    assert_bitwise(opt.functional_state, fresh.functional_state)
    assert "note" not in opt.state
    assert len(opt.state) == 0
    with pytest.raises(KeyError, match=r"dictionary is empty"):
        opt.state.popitem()


def test_parameter_names_that_nest_step_as_any_other():
    """The state keeps each parameter under its dotted name, flat: names such as ``a`` and ``a.b``
    (which a nested tree could not hold both of) step, save and load as any other, bit for bit
    the functional update of a flat TensorDict."""
    torch.manual_seed(0)
    named = [("a", nn.Parameter(torch.randn(4, 3))), ("a.b", nn.Parameter(torch.randn(3, 4)))]
    opt = Muon(named, **HP)
    params = TensorDict({n: p.detach().clone() for n, p in named}, [])
    tx = muonfn.muon(**HP)
    state = tx.init(params)
    for _ in range(2):
        grads = TensorDict({n: torch.randn(p.shape) for n, p in named}, [])
        for n, p in named:
            p.grad = grads[n].clone()
        opt.step()
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
    assert_bitwise(TensorDict({n: p.detach() for n, p in named}, []), params)
    assert_bitwise(opt.functional_state, state)
    copied = Muon([(n, nn.Parameter(p.detach().clone())) for n, p in named], **HP)
    copied.load_state_dict(opt.state_dict())
    assert_bitwise(copied.functional_state, state)


def test_a_step_count_that_is_no_count_is_refused_by_load_state_dict():
    """A saved count (torch's float ``step``, or the shim's int64) is read as an exact int64: one that is
    negative or not whole is refused naming the parameter, before anything changes."""
    net, opt = _stepped()
    before = snapshot(net, opt)
    for bad in (torch.tensor(-1), torch.tensor(2.5), torch.tensor(float("nan"))):
        saved = copy.deepcopy(opt.state_dict())
        saved["state"][2]["step"] = bad
        with pytest.raises(ValueError, match=r"^load_state_dict: parameter '0\.bias' \(index 2\) has step tensor\("):
            opt.load_state_dict(saved)
        assert_unchanged(net, opt, before)


def test_adamw_settings_are_refused_under_the_shims_own_names():
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"^adamw_eps must be finite and > 0, got 0\.0"):
        Muon(net.named_parameters(), adamw_eps=0.0)
    with pytest.raises(ValueError, match=r"^adamw_betas\[1\] must be in \[0, 1\), got 1\.0"):
        Muon(net.named_parameters(), adamw_betas=(0.9, 1.0))
    _, opt = _stepped()
    adamw_group = next(i for i, g in enumerate(opt.param_groups) if not g["use_muon"])
    opt.param_groups[adamw_group]["eps"] = -1.0
    with pytest.raises(ValueError, match=rf"param group {adamw_group}: eps must be finite and > 0"):
        opt.step()
