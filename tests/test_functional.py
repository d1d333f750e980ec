"""Functional properties: purity, vmap ensembles, torch.compile, torch.func loops, apply_if_finite."""

from __future__ import annotations

import pytest
import torch
from _bitwise import assert_bitwise
from _strategies import TiedLM, assert_td_close, assert_td_close_to_iteration, assert_td_equal, mlp, random_like
from tensordict import TensorDict
from torch._dynamo.testing import CompileCounterWithBackend

import muonfn
from muonfn import MatrixView

X = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
Y = mlp(99)(X).detach()  # a teacher: the loss can go to zero


def conv_and_experts() -> TensorDict:
    """Leaves of every kind a view handles, plus vectors and a scalar."""
    gen = torch.Generator().manual_seed(1)
    return TensorDict(
        {
            "conv": torch.randn(6, 3, 2, 2, generator=gen),
            "experts": torch.randn(2, 8, 4, generator=gen),
            "qkv": torch.randn(12, 4, generator=gen),
            "bias": torch.randn(6, generator=gen),
            "scalar": torch.randn((), generator=gen),
        },
        batch_size=[],
    )


VIEWS = {"experts": MatrixView(batch_dims=1), "qkv": MatrixView(split=(8, 2, 2))}


def optimizers() -> dict[str, muonfn.Transform]:
    return {
        "muon": muonfn.muon(lr=0.1, views=VIEWS),
        "adamw": muonfn.adamw(lr=0.1),
        "guarded": muonfn.apply_if_finite(muonfn.muon(lr=0.1, ns=muonfn.NewtonSchulz("polar_express"), views=VIEWS)),
    }


def storages(td: TensorDict) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in td.values(True, True)}


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("preset", ["muon", "normuon", "adamuon", "adamw"])
@pytest.mark.parametrize("cautious", [False, True])
def test_parameters_that_autograd_records_give_the_same_update(preset: str, weight_decay: float, cautious: bool):
    """``TensorDict.from_module`` gives Parameters: with grad mode on, the update records them
    (out of place where it would write into a view of a Newton–Schulz batch) and equals the
    update taken under ``no_grad``."""
    make = getattr(muonfn, preset)
    options = {} if preset == "adamw" else {"views": VIEWS}
    tx = make(lr=0.1, weight_decay=weight_decay, cautious_weight_decay=cautious, **options)
    params = conv_and_experts().apply(lambda t: torch.nn.Parameter(t))
    grads = random_like(params, 3)
    state = tx.init(params)
    recorded, recorded_state = tx.update(grads, state, params)
    with torch.no_grad():
        plain, plain_state = tx.update(grads, state, params)
    assert_td_equal(recorded.detach(), plain)
    assert_td_equal(recorded_state.detach(), plain_state)
    assert all(u.requires_grad == (weight_decay > 0) for u in recorded.values(True, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["muon", "adamw", "guarded"])
def test_update_is_pure(name: str, dtype: torch.dtype) -> None:
    tx = optimizers()[name]
    params = conv_and_experts().to(dtype)
    state = tx.init(params)
    _, state = tx.update(random_like(params, 2), state, params)  # a non-trivial state
    grads = random_like(params, 3)
    before = (params.clone(), grads.clone(), state.clone())
    updates, new_state = tx.update(grads, state, params)
    for original, copy in zip((params, grads, state), before):
        assert_td_equal(original, copy)
    assert all(u.dtype == dtype for u in updates.values(True, True))
    # nothing returned aliases an input, so applying updates in place cannot corrupt them
    assert not storages(updates) & (storages(params) | storages(grads) | storages(state))
    assert not storages(new_state) & (storages(params) | storages(grads))


def test_vmap_ensemble_equals_separate_updates() -> None:
    models = [mlp(seed) for seed in range(3)]
    stacked = torch.stack([TensorDict.from_module(m).detach() for m in models])
    # fp32: the loop and vmap batch the matmuls differently, which bf16 would round apart by far more than 1e-6
    tx = muonfn.apply_if_finite(muonfn.muon(lr=0.05, ns=muonfn.NewtonSchulz(dtype=torch.float32)))
    state = torch.vmap(tx.init)(stacked)
    separate = [tx.init(stacked[i]) for i in range(3)]
    for t in range(2):
        grads = random_like(stacked, seed=10 + t)
        if t == 1:
            grads["0", "bias"][1, 0] = float("nan")  # only the second member skips this step
        updates, state = torch.vmap(tx.update)(grads, state, stacked)
        for i in range(3):
            expected, separate[i] = tx.update(grads[i], separate[i], stacked[i])
            assert_td_close(updates[i], expected, atol=1e-6)
            assert_td_close(state[i], separate[i], atol=1e-6)
    assert state["notfinite_count"].tolist() == [0, 1, 0]


def test_compiled_update_matches_eager_without_recompiling() -> None:
    """fullgraph=True: no graph breaks. A 0-d lr changed in place and a NaN step reuse the graph."""
    params = TensorDict.from_module(mlp(4)).detach()
    lr = torch.tensor(0.05)
    tx = muonfn.apply_if_finite(muonfn.muon(lr=lr, weight_decay=0.1, ns=muonfn.NewtonSchulz("cesista")))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(tx.update, fullgraph=True, backend=counter)
    eager_state = compiled_state = tx.init(params)
    # tensordict 0.10 guards compiled code on the size of a memo of types that the first walk over nested
    # keys grows (the assertions below walk them): walked before compiling, as a program's first use does
    list(eager_state.keys(True, True))
    for t in range(3):
        grads = random_like(params, seed=20 + t)
        if t == 1:
            lr.fill_(0.01)
            grads["2", "weight"][0, 0] = float("inf")
        eager, eager_state = tx.update(grads, eager_state, params)
        got, compiled_state = compiled(grads, compiled_state, params)
        assert_td_close_to_iteration(got, eager, atol=1e-6)
        assert_td_close(compiled_state, eager_state, atol=1e-6)
        params = muonfn.apply_updates(params, eager)
    assert int(compiled_state["notfinite_count"]) == 1
    assert counter.frame_count == 1


MAKERS = {
    "muon": lambda: muonfn.muon(lr=0.02, weight_decay=0.1, weight_decay_mask={"0.bias": False, "2.bias": False}),
    "normuon": lambda: muonfn.normuon(lr=0.02, weight_decay=0.1),
    "adamuon": lambda: muonfn.adamuon(lr=0.02, weight_decay=0.1),
}


@pytest.mark.parametrize(
    ("name", "order"),
    [
        ("muon", "compiled, eager, compiled"),
        ("normuon", "compiled, eager, compiled"),
        ("adamuon", "compiled, eager, compiled"),
        ("muon", "eager, compiled, eager, compiled"),
    ],
)
def test_compiled_update_compiles_once_beside_eager_updates(name: str, order: str) -> None:
    """Eager updates of the same transform, before or between compiled ones, cost no second
    compile: the per-structure caches (labels, masks, views) are not looked up while traced, so
    the graph's guards do not depend on what an eager update stored in them."""
    torch._dynamo.reset()
    params = TensorDict.from_module(mlp(8)).detach()
    tx = MAKERS[name]()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(tx.update, fullgraph=True, backend=counter)
    state = tx.init(params)
    for t, how in enumerate(order.split(", ")):
        step = compiled if how == "compiled" else tx.update
        _, state = step(random_like(params, seed=70 + t), state, params)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_torch_func_loops_with_to_module_and_functional_call() -> None:
    model = mlp(5)
    params = TensorDict.from_module(model).detach()

    def loss_to_module(p: TensorDict) -> torch.Tensor:
        with p.to_module(model):
            return torch.nn.functional.mse_loss(model(X), Y)

    def loss_functional_call(p: TensorDict) -> torch.Tensor:
        prediction = torch.func.functional_call(model, dict(p.flatten_keys(".").items()), (X,))
        return torch.nn.functional.mse_loss(prediction, Y)

    tx = muonfn.muon(lr=0.05)
    trained = []
    for loss in (loss_to_module, loss_functional_call):
        p, state = params, tx.init(params)
        losses = []
        for _ in range(15):
            grads, value = torch.func.grad_and_value(loss)(p)
            updates, state = tx.update(grads, state, p)
            p = muonfn.apply_updates(p, updates)
            losses.append(float(value))
        assert losses[-1] < 0.6 * losses[0]
        trained.append(p)
    assert_td_equal(trained[0], trained[1])
    assert_td_equal(TensorDict.from_module(model).detach(), params)  # the module itself is untouched


# --- apply_if_finite ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_apply_if_finite_skips_bad_steps_and_counts_them(bad: float) -> None:
    params = conv_and_experts()
    inner = muonfn.muon(lr=0.1, views=VIEWS)
    tx = muonfn.apply_if_finite(inner)
    state, plain = tx.init(params), inner.init(params)
    assert set(state.keys()) == {"muon", "adamw", "notfinite_count"}
    for t in range(3):
        grads = random_like(params, seed=30 + t)
        if t == 1:
            grads["conv"][0, 0, 0, 0] = bad
            updates, new_state = tx.update(grads, state, params)
            assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values(True, True))
            assert_td_equal(muonfn.apply_updates(params, updates), params)
            assert_td_equal(new_state.exclude("notfinite_count"), state.exclude("notfinite_count"))
            state = new_state
            continue
        updates, state = tx.update(grads, state, params)
        expected, plain = inner.update(grads, plain, params)
        assert_td_equal(updates, expected)
        assert_td_equal(state.exclude("notfinite_count"), plain)
    assert int(state["notfinite_count"]) == 1


@pytest.mark.parametrize("preset", ["muon", "normuon", "adamuon", "adamw"])
def test_apply_if_finite_keeps_a_donated_state_on_a_skipped_step(preset: str) -> None:
    """A donating transform writes its state in place: on a skipped step the guard writes the old
    values back into those tensors (same addresses), so the run goes on bitwise as the undonated
    guarded run, the step after the bad one included; a stacked ensemble skips per member."""
    params = conv_and_experts()
    options = {} if preset == "adamw" else {"views": VIEWS}
    make = getattr(muonfn, preset)
    plain = muonfn.apply_if_finite(make(lr=0.1, **options))
    donating = muonfn.apply_if_finite(make(lr=0.1, **options, donate_state=True))
    state, donated = plain.init(params), donating.init(params)
    addresses = [t.data_ptr() for t in donated.exclude("notfinite_count").values(True, True)]
    for t in range(3):
        grads = random_like(params, seed=40 + t)
        if t == 1:
            grads["conv"][0, 0, 0, 0] = float("nan")
        before = donated.clone()
        updates, state = plain.update(grads, state, params)
        donated_updates, donated = donating.update(grads, donated, params)
        assert_bitwise(donated_updates, updates)
        assert_bitwise(donated, state)
        if t == 1:
            assert_bitwise(donated.exclude("notfinite_count"), before.exclude("notfinite_count"))
        params = muonfn.apply_updates(params, updates)
    assert int(donated["notfinite_count"]) == 1
    assert [t.data_ptr() for t in donated.exclude("notfinite_count").values(True, True)] == addresses

    stacked = torch.stack([params, params.apply(lambda x: x * 0.5)])
    ensemble = donating.init(stacked)
    grads = torch.stack([random_like(params, seed=50), random_like(params, seed=51)])
    grads["conv"][1, 0, 0, 0, 0] = float("inf")
    before = ensemble.clone()
    _, ensemble = donating.update(grads, ensemble, stacked)
    assert ensemble["notfinite_count"].tolist() == [0, 1]
    kept = before.exclude("notfinite_count")[1]
    assert_bitwise(ensemble.exclude("notfinite_count")[1], kept)
    assert not all(torch.equal(a, b) for a, b in zip(ensemble[0].values(True, True), before[0].values(True, True)))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_apply_if_finite_keeps_a_donated_state_under_vmap() -> None:
    """Vmapped, the kept copy is taken leaf by leaf (no multi-tensor copy has a batching rule):
    a member's NaN step is skipped, and donated equals undonated bit for bit."""
    stacked = torch.stack([conv_and_experts(), conv_and_experts().apply(lambda x: x * 0.5)])
    results = []
    for donate in (False, True):
        tx = muonfn.apply_if_finite(muonfn.muon(lr=0.1, views=VIEWS, donate_state=donate))
        state = torch.vmap(tx.init)(stacked)
        for t in range(2):
            grads = torch.stack([random_like(stacked[0], seed=70 + t), random_like(stacked[1], seed=80 + t)])
            if t == 1:
                grads["conv"][1, 0, 0, 0, 0] = float("nan")
            _, state = torch.vmap(tx.update)(grads, state, stacked)
        assert state["notfinite_count"].tolist() == [0, 1]
        results.append(state)
    assert_bitwise(results[1], results[0])


@pytest.mark.parametrize("ns", ["svd", "qr"])
def test_apply_if_finite_skips_a_nan_step_of_an_exact_orthogonalizer(ns: str) -> None:
    """The SVD raises on a matrix that is not finite: the exact maps give it NaN instead, so the
    guard skips the step (the state kept, donated) where it used to stop the run."""
    params = conv_and_experts()
    tx = muonfn.apply_if_finite(muonfn.muon(lr=0.1, views=VIEWS, ns=ns, donate_state=True))
    state = tx.init(params)
    _, state = tx.update(random_like(params, seed=60), state, params)
    before = state.clone()
    grads = random_like(params, seed=61)
    grads["conv"][0, 0, 0, 0] = float("nan")
    updates, state = tx.update(grads, state, params)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values(True, True))
    assert_bitwise(state.exclude("notfinite_count"), before.exclude("notfinite_count"))
    assert int(state["notfinite_count"]) == 1


def test_every_dtype_is_kept_0d_leaves_included() -> None:
    params = TensorDict({"w": torch.ones(4, 4), "s": torch.ones((), dtype=torch.bfloat16), "t": torch.ones(())}, [])
    tx = muonfn.apply_if_finite(muonfn.muon())
    state = tx.init(params)
    for bad in (False, True):
        grads = params.apply(torch.ones_like)
        if bad:
            grads["w"][0, 0] = float("nan")
        updates, state = tx.update(grads, state, params)
        assert {k: u.dtype for k, u in updates.items()} == {k: p.dtype for k, p in params.items()}
        assert state["adamw", "exp_avg", "s"].dtype == torch.bfloat16


def test_apply_if_finite_refuses_a_clashing_state_key() -> None:
    inner = muonfn.apply_if_finite(muonfn.adamw())
    with pytest.raises(ValueError, match="already keeps 'notfinite_count'"):
        muonfn.apply_if_finite(inner).init(TensorDict({"w": torch.ones(2)}, []))


# --- ensembles without torch.vmap -------------------------------------------------------------------------


class Member(torch.nn.Module):
    """A conv kernel, experts, a (1, 1, D) token, a Linear output head: every shape rule of the labels."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.token = torch.nn.Parameter(torch.randn(1, 1, 6))
        self.conv = torch.nn.Conv1d(1, 4, 3, padding=1)
        self.experts = torch.nn.Parameter(torch.randn(2, 6, 6) / 6**0.5)
        self.hidden = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x[:, None]).mean(1) + self.token[0, 0]
        h = torch.tanh(torch.einsum("bi,eoi->bo", h, self.experts) + self.hidden(h))
        return self.head(h)


def test_stacked_ensemble_without_vmap_equals_the_vmapped_step() -> None:
    """Batch size [N] honoured: labels, views, Adam's steps, the schedule's count and apply_if_finite per member."""
    members = [Member(seed) for seed in range(3)]
    params = TensorDict.from_modules(*members).detach()
    assert muonfn.label_params(params) == {
        "token": "adamw",  # (1, 1, 6) per member: a vector, though (3, 1, 1, 6) stacked
        "conv.weight": "muon",
        "conv.bias": "adamw",  # (4,) per member, though (3, 4) stacked
        "experts": "muon",
        "hidden.weight": "muon",
        "hidden.bias": "adamw",
        "head.weight": "adamw",
        "head.bias": "adamw",
    }
    tx = muonfn.apply_if_finite(
        muonfn.muon(
            lr=lambda count: 0.05 * (count + 1).clamp(max=2) / 2,  # one lr per member: count has batch size [3]
            weight_decay=0.1,
            views={"experts": MatrixView(batch_dims=1)},
            ns=muonfn.NewtonSchulz(
                dtype=torch.float32
            ),  # the two batch the matmuls differently: bf16 would round them far apart
        )
    )
    vmapped_state, stacked_state = torch.vmap(tx.init)(params), tx.init(params)
    assert_td_equal(stacked_state, vmapped_state)  # one state layout for both
    vmapped_params = stacked_params = params
    for t in range(3):
        grads = random_like(params, seed=40 + t)
        if t == 1:
            grads["hidden", "bias"][2, 0] = float("nan")  # only the third member skips this step
        vmapped, vmapped_state = torch.vmap(tx.update)(grads, vmapped_state, vmapped_params)
        stacked, stacked_state = tx.update(grads, stacked_state, stacked_params)
        assert_td_close(stacked, vmapped, atol=1e-6)
        assert_td_close(stacked_state, vmapped_state, atol=1e-6)
        vmapped_params = muonfn.apply_updates(vmapped_params, vmapped)
        stacked_params = muonfn.apply_updates(stacked_params, stacked)
    assert stacked_state["notfinite_count"].tolist() == [0, 0, 1]
    assert stacked_state["adamw", "step", "head.bias"].tolist() == [3, 3, 2]


def test_a_nan_in_one_members_scalar_skips_that_member_alone() -> None:
    """apply_if_finite over 0-d leaves of a stacked ensemble (a temperature per member): one flag per member."""
    params = TensorDict({"temperature": torch.ones(3), "w": torch.ones(3, 2)}, batch_size=[3])
    tx = muonfn.apply_if_finite(muonfn.adamw(lr=0.1, weight_decay=0.0))
    grads = TensorDict({"temperature": torch.tensor([1.0, float("nan"), 1.0]), "w": torch.ones(3, 2)}, [3])
    updates, state = tx.update(grads, tx.init(params), params)
    assert state["notfinite_count"].tolist() == [0, 1, 0]
    assert updates["temperature"].tolist() == pytest.approx([-0.1, 0.0, -0.1])
    assert updates["w"][1].eq(0).all() and updates["w"][[0, 2]].ne(0).all()


# --- buffers and tied weights ---------------------------------------------------------------------------------


def test_a_model_with_batchnorm_trains_through_torch_func_grad() -> None:
    torch.manual_seed(6)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )
    params, buffers = muonfn.split_buffers(model)
    assert list(buffers.keys(True, True)) == [("1", "running_mean"), ("1", "running_var"), ("1", "num_batches_tracked")]
    assert_td_equal(params, TensorDict(dict(model.named_parameters()), []).unflatten_keys(".").detach())
    tx = muonfn.muon(lr=0.05, labels=muonfn.labels_from_module(model))
    state = tx.init(params)

    def loss_fn(params: TensorDict, buffers: TensorDict) -> torch.Tensor:
        with params.to_module(model), buffers.to_module(model):
            return torch.nn.functional.mse_loss(model(X), Y)

    losses = []
    for _ in range(20):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, buffers)
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert int(buffers["1", "num_batches_tracked"]) == 20  # BatchNorm kept its statistics, in place
    assert not torch.equal(buffers["1", "running_mean"], torch.zeros(16))


def test_a_tied_weight_trains_as_one_with_the_alias_excluded() -> None:
    """The remedy init's error gives: one name in params, functional_call ties the alias back."""
    model = TiedLM()
    tokens = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(0))
    params = TensorDict.from_module(model).detach().exclude(("head", "weight"))
    labels = muonfn.labels_from_module(model)
    assert labels == {"embed.weight": "adamw", "hidden.weight": "muon", "hidden.bias": "adamw"}
    tx = muonfn.muon(lr=0.05, labels=labels)
    state = tx.init(params)

    def loss_fn(params: TensorDict) -> torch.Tensor:
        logits = torch.func.functional_call(model, params.flatten_keys(".").to_dict(), (tokens,))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    grads = torch.func.grad(loss_fn)(params)
    reference = TiedLM()
    reference.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(reference(tokens).flatten(0, 1), tokens.flatten()).backward()
    torch.testing.assert_close(grads["embed", "weight"], reference.embed.weight.grad)  # both uses of the tie
    updates, state = tx.update(grads, state, params)
    params = muonfn.apply_updates(params, updates)
    logits = torch.func.functional_call(model, params.flatten_keys(".").to_dict(), (tokens,))
    embed = params["embed", "weight"]
    hidden = torch.tanh(embed[tokens] @ params["hidden", "weight"].T + params["hidden", "bias"])
    torch.testing.assert_close(logits, hidden @ embed.T)  # the head is the updated embedding: still tied


# --- apply_updates, schedules and zero-size matrices ----------------------------------------------------------


def test_apply_updates_keeps_each_parameters_dtype() -> None:
    params = TensorDict({"w": torch.ones(4, 3), "h": torch.ones(4, dtype=torch.bfloat16), "s": torch.ones(())}, [])
    updates = TensorDict(
        {"w": torch.full((4, 3), 1e-3, dtype=torch.float64), "h": torch.full((4,), 1e-3), "s": torch.ones(())}, []
    )
    new = muonfn.apply_updates(params, updates)
    assert {k: v.dtype for k, v in new.items()} == {k: v.dtype for k, v in params.items()}
    assert torch.equal(new["w"], (params["w"].double() + 1e-3).float())
    assert torch.equal(new["h"], (params["h"].float() + 1e-3).bfloat16())  # summed in fp32, rounded once
    compiled = torch.compile(muonfn.apply_updates, fullgraph=True, backend="eager")
    assert_td_equal(compiled(params, updates), new)


def test_apply_updates_in_place_gives_the_same_bits_and_returns_the_params() -> None:
    model = mlp(5)
    params = TensorDict.from_module(model)  # Parameters that require gradients, as a module holds them
    params.set("h", torch.ones(4, dtype=torch.bfloat16)).set("s", torch.ones(()))
    updates = random_like(params, seed=3).exclude(("0", "bias"))  # a leaf without an update
    updates.set(("0", "weight"), updates["0", "weight"].double()).set("h", torch.full((4,), 1e-3))
    expected = muonfn.apply_updates(params.detach(), updates)
    storages = {k: v.data_ptr() for k, v in params.items(True, True)}
    assert muonfn.apply_updates_(params, updates) is params
    assert_td_equal(params.detach(), expected)
    assert {k: v.data_ptr() for k, v in params.items(True, True)} == storages
    assert params["0", "weight"].dtype == torch.float32 and params["h"].dtype == torch.bfloat16
    assert torch.equal(model[0].weight.detach(), expected["0", "weight"])  # the module's own tensors stepped
    assert all(p.grad_fn is None for p in params.values(True, True))  # no step recorded by autograd


def test_a_tensor_schedule_stays_traceable() -> None:
    params = TensorDict.from_module(mlp(7)).detach()
    tx = muonfn.muon(lr=lambda count: 0.05 * torch.clamp((count + 1) / 4, max=1.0), weight_decay=0.1)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(tx.update, fullgraph=True, backend=counter)
    eager_state = compiled_state = tx.init(params)
    for t in range(3):
        grads = random_like(params, seed=50 + t)
        eager, eager_state = tx.update(grads, eager_state, params)
        got, compiled_state = compiled(grads, compiled_state, params)
        assert_td_close_to_iteration(got, eager, atol=1e-6)
        assert_td_close(compiled_state, eager_state, atol=0)
    assert counter.frame_count == 1


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_zero_size_matrices_get_empty_updates() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(5, 0), torch.nn.Linear(0, 4), torch.nn.Linear(4, 3))
    params = TensorDict.from_module(model).detach()
    labels = muonfn.labels_from_module(model)
    assert labels["0.weight"] == labels["1.weight"] == "muon"
    tx = muonfn.muon(lr=0.1, labels=labels)
    state = tx.init(params)
    before = state.clone()
    updates, new_state = tx.update(random_like(params, seed=60), state, params)
    assert updates["0", "weight"].shape == (0, 5) and updates["1", "weight"].shape == (4, 0)
    assert all(u.isfinite().all() for u in updates.values(True, True))
    assert_td_equal(state, before)
    assert new_state["muon", "momentum", "0.weight"].shape == (0, 5)
    assert set(new_state.keys(True, True)) == set(state.keys(True, True))


# --------------------------------------------------------------- differentiating through a step


@pytest.mark.parametrize("preset", [muonfn.muon, muonfn.normuon, muonfn.adamuon])
def test_a_step_is_differentiable_with_respect_to_the_gradients(preset):
    """The variants' denominators stay out of place under torch.func.grad: sqrt's gradient reads its output."""
    params = TensorDict({"w": torch.randn(8, 4, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}, [])
    grads = params.apply(torch.randn_like)
    tx = preset(lr=0.02)
    state = tx.init(params)

    def loss(w: torch.Tensor) -> torch.Tensor:
        return tx.update(TensorDict({"w": w, "b": grads["b"]}, []), state, params)[0]["w"].square().sum()

    grad = torch.func.grad(loss)(grads["w"])
    direction = torch.randn_like(grad)
    step = 1e-6
    numeric = (loss(grads["w"] + step * direction) - loss(grads["w"] - step * direction)) / (2 * step)
    assert torch.isfinite(grad).all()
    assert torch.allclose((grad * direction).sum(), numeric, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("setting", ["lr", "weight_decay"])
def test_a_recorded_learning_rate_or_decay_is_differentiated_not_written_into(setting):
    """A 0-d hyperparameter autograd records makes the step's product record it: out of place."""
    params = TensorDict({"w": torch.randn(8, 4, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}, [])
    grads = params.apply(torch.randn_like)
    value = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    options = {"lr": 0.02, "weight_decay": 0.1, setting: value}
    tx = muonfn.muon(**options)
    updates, _ = tx.update(grads, tx.init(params), params)
    (derivative,) = torch.autograd.grad(updates["w"].sum(), value)
    with torch.no_grad():
        plain = {**options, setting: float(value)}
        shifted = {**options, setting: float(value) + 1e-6}
        lower = muonfn.muon(**plain).update(grads, muonfn.muon(**plain).init(params), params)[0]["w"].sum()
        upper = muonfn.muon(**shifted).update(grads, muonfn.muon(**shifted).init(params), params)[0]["w"].sum()
    assert torch.allclose(derivative, (upper - lower) / 1e-6, rtol=1e-4)
