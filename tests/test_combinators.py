"""chain, named, partition, masked: state layout, routing, and leaves without gradients."""

from __future__ import annotations

import pytest
import torch
from _strategies import assert_td_equal, mlp, random_like
from tensordict import TensorDict

import muonfn


def td(d: dict) -> TensorDict:
    return TensorDict(d, batch_size=[])


def nested_params() -> TensorDict:
    return td(
        {
            "0": {"weight": torch.ones(4, 3), "bias": torch.ones(4)},
            "1": {"weight": torch.ones(2, 4), "bias": torch.ones(2)},
        }
    )


def scale(factor: float) -> muonfn.Transform:
    """Stateless and easy to recognise: ``u = -factor · g``."""
    return muonfn.scale_by_learning_rate(factor)


# --- chain and named -------------------------------------------------------------------------------


def test_chain_state_is_the_union_of_readable_keys() -> None:
    params = nested_params()
    tx = muonfn.chain(muonfn.ema_momentum(), muonfn.scale_by_adam(), muonfn.scale_by_learning_rate(lambda t: 0.1))
    state = tx.init(params)
    assert set(state.keys()) == {"momentum", "step", "exp_avg", "exp_avg_sq", "count"}
    assert torch.equal(state["momentum", "0.weight"], torch.zeros(4, 3))
    _, new_state = tx.update(random_like(params, 0), state, params)
    assert set(new_state.keys(True, True)) == set(state.keys(True, True))


def test_chain_feeds_each_update_to_the_next() -> None:
    grads = td({"w": torch.ones(2)})
    out, _ = muonfn.chain(scale(2.0), scale(3.0)).update(grads, TensorDict())
    assert out["w"].tolist() == [6.0, 6.0]


def test_chain_rejects_two_members_with_the_same_state_key() -> None:
    with pytest.raises(ValueError, match=r"members 0 and 1 both keep state 'momentum'.*named"):
        muonfn.chain(muonfn.ema_momentum(), muonfn.ema_momentum(0.5))


def test_named_keeps_state_apart() -> None:
    params = td({"w": torch.zeros(3)})
    tx = muonfn.chain(
        muonfn.named("fast", muonfn.ema_momentum(0.5, nesterov=False)),
        muonfn.named("slow", muonfn.ema_momentum(0.9, nesterov=False)),
    )
    state = tx.init(params)
    _, state = tx.update(td({"w": torch.ones(3)}), state)
    assert state["fast", "momentum", "w"].tolist() == [0.5] * 3
    assert state["slow", "momentum", "w"].tolist() == [pytest.approx(0.1 * 0.5)] * 3  # fed the first's output


# --- partition -------------------------------------------------------------------------------------


LABEL_FORMS = {
    "tuple": {("0", "weight"): "x", ("0", "bias"): "y", ("1", "weight"): "x", ("1", "bias"): "y"},
    "dotted": {"0.weight": "x", "0.bias": "y", "1.weight": "x", "1.bias": "y"},
    "callable": lambda p: {k: "x" if v.ndim == 2 else "y" for k, v in p.items()},
    "tensordict": td({"0": {"weight": "x", "bias": "y"}, "1": {"weight": "x", "bias": "y"}}),
}


@pytest.mark.parametrize("form", sorted(LABEL_FORMS))
def test_partition_routes_by_label(form: str) -> None:
    params = nested_params()
    tx = muonfn.partition(
        {"x": muonfn.chain(muonfn.ema_momentum(0.5, nesterov=False), scale(1.0)), "y": scale(2.0)}, LABEL_FORMS[form]
    )
    state = tx.init(params)
    assert set(state.keys(True, True)) == {("x", "momentum", "0.weight"), ("x", "momentum", "1.weight")}
    grads = params.apply(torch.ones_like)
    updates, state = tx.update(grads, state, params)
    assert updates["0", "weight"].unique().tolist() == [-0.5]
    assert updates["1", "bias"].unique().tolist() == [-2.0]
    assert list(updates.keys(True, True)) == list(grads.keys(True, True))


def test_partition_without_params_labels_the_gradients() -> None:
    params = nested_params()
    tx = muonfn.partition({"x": scale(1.0), "y": scale(2.0)}, LABEL_FORMS["callable"])
    updates, _ = tx.update(params, tx.init(params))
    assert updates["0", "bias"].unique().tolist() == [-2.0]


def test_partition_label_errors() -> None:
    params = nested_params()
    labels = dict(LABEL_FORMS["dotted"])
    with pytest.raises(ValueError, match=r"'0.bias' has label 'z'; known labels: \['x', 'y'\]"):
        muonfn.partition({"x": scale(1.0), "y": scale(2.0)}, {**labels, "0.bias": "z"}).init(params)
    missing = {k: v for k, v in labels.items() if k != "1.bias"}
    with pytest.raises(ValueError, match=r"parameter '1.bias' has no label"):
        muonfn.partition({"x": scale(1.0), "y": scale(2.0)}, missing).init(params)
    with pytest.raises(ValueError, match=r"labels names '1.wieght', which is not a parameter"):
        muonfn.partition({"x": scale(1.0), "y": scale(2.0)}, {**labels, "1.wieght": "y"}).init(params)
    tx = muonfn.partition({"x": scale(1.0), "y": scale(2.0)}, labels)
    with pytest.raises(ValueError, match=r"gradient '2.weight' has no matching parameter"):
        tx.update(td({"2": {"weight": torch.ones(1)}}), tx.init(params), params)


def test_a_group_without_leaves_keeps_an_empty_state() -> None:
    params = td({"w": torch.ones(2, 2)})
    tx = muonfn.muon(labels={"w": "muon"})
    state = tx.init(params)
    assert set(state.keys(True, True)) == {("muon", "momentum", "w")}
    assert set(state["adamw"].keys()) == {"step", "exp_avg", "exp_avg_sq"}
    updates, new_state = tx.update(params, state, params)
    assert set(new_state.keys(True, True)) == {("muon", "momentum", "w")}
    assert set(updates.keys()) == {"w"}


# --- masked --------------------------------------------------------------------------------------------


def test_masked_applies_to_selected_leaves_only() -> None:
    params = nested_params()
    grads = params.apply(torch.ones_like)
    for mask in ({"0.weight": True, "1.weight": True}, lambda p: {k: v.ndim == 2 for k, v in p.items()}):
        tx = muonfn.masked(muonfn.chain(muonfn.ema_momentum(0.5, nesterov=False), scale(1.0)), mask)
        state = tx.init(params)
        assert set(state.keys(True, True)) == {("momentum", "0.weight"), ("momentum", "1.weight")}
        updates, state = tx.update(grads, state, params)
        assert updates["1", "weight"].unique().tolist() == [-0.5]
        assert torch.equal(updates["0", "bias"], grads["0", "bias"])  # passed through
    untouched, same = tx.update(td({"0": {"bias": torch.ones(4)}}), state, params)
    assert (same == state).all() and torch.equal(untouched["0", "bias"], torch.ones(4))


# --- leaves without gradients, masks and learning rates in the presets ------------------------------------


def test_leaves_without_gradients_are_skipped() -> None:
    """torch.optim skips p.grad is None: no update, state (Adam step included) unchanged, others advance."""
    model = mlp()
    params = TensorDict.from_module(model).detach()
    tx = muonfn.muon(lr=0.1)
    state = tx.init(params)
    for t in range(2):
        _, state = tx.update(random_like(params, t), state, params)
    partial = random_like(params, 7).exclude(("0", "weight"), ("0", "bias"))
    updates, new_state = tx.update(partial, state, params)
    assert set(updates.keys(True, True)) == set(partial.keys(True, True))
    for skipped in (("muon", "momentum", "0.weight"), ("adamw", "step", "0.bias"), ("adamw", "exp_avg", "0.bias")):
        assert torch.equal(new_state[skipped], state[skipped])
    assert int(new_state["adamw", "step", "2.bias"]) == 3
    assert int(new_state["adamw", "step", "0.bias"]) == 2
    assert not torch.equal(new_state["muon", "momentum", "2.weight"], state["muon", "momentum", "2.weight"])
    stepped = muonfn.apply_updates(params, updates)
    assert torch.equal(stepped["0", "weight"], params["0", "weight"])
    assert not torch.equal(stepped["2", "weight"], params["2", "weight"])


def test_weight_decay_mask_in_the_presets() -> None:
    params = TensorDict.from_module(mlp()).detach()
    grads = random_like(params, 1)
    exempt = {"0.bias": False, "2.weight": False}
    for make in (
        lambda **kw: muonfn.muon(lr=0.1, weight_decay=0.5, **kw),
        lambda **kw: muonfn.adamw(lr=0.1, weight_decay=0.5, **kw),
    ):
        masked, plain = make(weight_decay_mask=exempt), make()
        u_masked, _ = masked.update(grads, masked.init(params), params)
        u_plain, _ = plain.update(grads, plain.init(params), params)
        for key in (("0", "bias"), ("2", "weight")):
            # decay adds -lr·wd·p; without it the update differs by exactly that
            torch.testing.assert_close(u_plain[key] - u_masked[key], -0.05 * params[key], rtol=1e-6, atol=1e-7)
        for key in (("0", "weight"), ("2", "bias")):
            assert torch.equal(u_masked[key], u_plain[key])


def test_one_mask_serves_every_branch_of_a_partition() -> None:
    """Each branch sees only its leaves of a mask written for the whole model."""
    params = nested_params()
    mask = {"0.bias": False, "1.weight": False}
    tx = muonfn.partition(
        {"x": muonfn.adamw(lr=0.1, weight_decay=0.5, weight_decay_mask=mask), "y": muonfn.adamw(lr=0.1)},
        {"0.weight": "x", "0.bias": "x", "1.weight": "y", "1.bias": "y"},
    )
    grads = params.apply(torch.zeros_like)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["0", "weight"].unique().tolist() == [pytest.approx(-0.05)]
    assert updates["0", "bias"].unique().tolist() == [0.0]


def test_schedule_learning_rate_in_the_presets() -> None:
    params = TensorDict.from_module(mlp()).detach()
    grads = random_like(params, 2)
    schedule = lambda count: 0.1 * 0.5**count  # noqa: E731
    for make in (muonfn.muon, muonfn.adamw):
        scheduled, fixed = make(lr=schedule, weight_decay=0.0), make(lr=0.1, weight_decay=0.0)
        s1, s2 = scheduled.init(params), fixed.init(params)
        for t in range(3):
            u1, s1 = scheduled.update(grads, s1, params)
            u2, s2 = fixed.update(grads, s2, params)
            for key in u1.keys(True, True):
                # the scheduled rate, an fp32 tensor, scales the coefficients of Newton–Schulz's
                # last step: the two agree to a few roundings of the update's largest entry (seen:
                # up to 6.2 eps)
                expected = u2[key] * 0.5**t
                bound = 16 * torch.finfo(expected.dtype).eps * expected.abs().max().item()
                torch.testing.assert_close(u1[key], expected, rtol=0, atol=bound)


def test_tensor_learning_rate_changed_in_place_takes_effect() -> None:
    """A 0-d tensor holding the number gives the number's bits (fp64: an fp32 tensor holds
    fp32's nearest value to 0.1, not 0.1), and a value filled in later is the one used."""
    params = TensorDict.from_module(mlp()).detach()
    grads = random_like(params, 3)
    lr = torch.tensor(0.1, dtype=torch.float64)
    tx, reference = muonfn.muon(lr=lr, weight_decay=0.1), muonfn.muon(lr=0.1, weight_decay=0.1)
    s1, s2 = tx.init(params), reference.init(params)
    u1, s1 = tx.update(grads, s1, params)
    u2, s2 = reference.update(grads, s2, params)
    assert_td_equal(u1, u2)
    lr.fill_(0.025)
    u1, s1 = tx.update(grads, s1, params)
    u2, s2 = reference.update(grads, s2, params)
    for key in u1.keys(True, True):
        torch.testing.assert_close(u1[key], u2[key] / 4, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------- a user's transform


def _scale_by_rms(beta: float = 0.9, eps: float = 1e-8, *, donate_state: bool = False) -> muonfn.Transform:
    """A transform written as the docs show: ``init`` and ``update`` over flat TensorDicts, the
    state keeping an entry per leaf under its dotted name."""

    def init(params: TensorDict) -> TensorDict:
        return TensorDict({"nu": params.apply(torch.zeros_like)}, batch_size=params.batch_size)

    def update(grads: TensorDict, state: TensorDict, params: TensorDict | None) -> tuple[TensorDict, TensorDict]:
        held = state["nu"]
        if donate_state:
            nu = {k: held[k].lerp_(g * g, 1 - beta) for k, g in grads.items()}
        else:
            nu = {k: held[k].lerp(g * g, 1 - beta) for k, g in grads.items()}
        updates = TensorDict({k: g / (nu[k].sqrt() + eps) for k, g in grads.items()}, batch_size=grads.batch_size)
        new = TensorDict({**dict(held.items()), **nu}, batch_size=held.batch_size)
        return updates, TensorDict({"nu": new}, batch_size=state.batch_size)

    return muonfn.transform(init, update, donates_state=donate_state)


def test_a_users_transform_joins_a_composition_and_computes_its_formula() -> None:
    mine = _scale_by_rms(beta=0.9)
    tx = muonfn.chain(mine, muonfn.scale_by_learning_rate(0.1))
    params = TensorDict({"w": torch.randn(3, 4), "b": torch.randn(4)}, [])
    state = tx.init(params)
    nu = {k: torch.zeros_like(p) for k, p in params.items()}
    for t in range(3):
        grads = TensorDict({k: torch.randn_like(p) for k, p in params.items()}, [])
        if t == 1:
            grads = grads.exclude("b")  # a leaf without a gradient keeps its entry
        updates, state = tx.update(grads, state, params)
        assert updates.keys() == grads.keys()
        for k, g in grads.items():
            nu[k] = 0.9 * nu[k] + 0.1 * g * g
            torch.testing.assert_close(updates[k], -0.1 * g / (nu[k].sqrt() + 1e-8))
        for k in params.keys():
            torch.testing.assert_close(state["nu", k], nu[k])


def test_a_users_transform_is_given_flat_input_and_its_updates_come_back_nested() -> None:
    seen = []

    def update(grads: TensorDict, state: TensorDict, params: TensorDict | None) -> tuple[TensorDict, TensorDict]:
        seen.append((list(grads.keys()), None if params is None else list(params.keys())))
        return grads.apply(lambda g: g * 2), state

    tx = muonfn.transform(lambda params: TensorDict({}, batch_size=params.batch_size), update)
    params = nested_params()
    updates, _ = muonfn.chain(tx, scale(1.0)).update(params, tx.init(params), params)
    assert seen == [(["0.weight", "0.bias", "1.weight", "1.bias"],) * 2]
    assert list(updates.keys(True, True)) == list(params.keys(True, True))
    assert updates["1", "bias"].unique().tolist() == [-2.0]


def test_a_users_transform_is_checked_before_any_member_of_its_composition_runs() -> None:
    params = TensorDict({"w": torch.randn(3, 4)}, [])
    tx = muonfn.chain(muonfn.ema_momentum(0.9, donate_state=True), _scale_by_rms())
    state = tx.init(params)
    del state["nu"]
    momentum = state["momentum", "w"].clone()
    with pytest.raises(ValueError, match=r"state has no entry 'nu\.w'"):
        tx.update(TensorDict({"w": torch.randn(3, 4)}, []), state, params)
    assert torch.equal(state["momentum", "w"], momentum)  # the donated momentum was not touched


def test_a_users_transform_runs_under_vmap_as_member_by_member() -> None:
    tx = muonfn.chain(_scale_by_rms(), muonfn.scale_by_learning_rate(0.1))
    params = TensorDict({"w": torch.randn(3, 2, 4)}, [3])
    grads = TensorDict({"w": torch.randn(3, 2, 4)}, [3])
    vmapped, _ = torch.vmap(tx.update)(grads, torch.vmap(tx.init)(params), params)
    for i in range(3):
        alone, _ = tx.update(grads[i], tx.init(params[i]), params[i])
        torch.testing.assert_close(vmapped["w"][i], alone["w"])


def _writers_in_place(donate: bool) -> list[muonfn.Transform]:
    return [
        muonfn.muon(donate_state=donate),
        muonfn.normuon(donate_state=donate),
        muonfn.adamuon(donate_state=donate),
        muonfn.adamw(donate_state=donate),
        muonfn.adamw(donate_state=donate, nesterov=True),
        muonfn.masked(muonfn.cautious(muonfn.scale_by_muon(donate_state=donate)), "matrices"),
        muonfn.apply_if_finite(muonfn.named("m", muonfn.ema_momentum(donate_state=donate))),
        muonfn.masked(muonfn.scale_by_adam(donate_state=donate), "matrices"),
        muonfn.partition({"a": muonfn.scale_by_adam(donate_state=donate), "b": scale(1.0)}, {"w": "a", "b": "b"}),
        muonfn.chain(muonfn.scale_by_sign(), muonfn.ema_momentum(donate_state=donate)),
        muonfn.chain(_scale_by_rms(donate_state=donate), muonfn.scale_by_learning_rate(0.1)),
    ]


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("index", range(len(_writers_in_place(False))))
def test_what_writes_its_state_in_place_says_so_through_every_combinator(index: int, donate: bool) -> None:
    """A transform that writes the state it is given (``donate_state=True``, or a user's declared
    with ``donates_state=True``) says so through every combinator, so that ``apply_if_finite``
    keeps a copy of the state to restore on a skipped step: the state after a NaN step is the
    state before it, bit for bit, in the same tensors."""
    tx = _writers_in_place(donate)[index]
    params = TensorDict({"w": torch.randn(4, 6), "b": torch.randn(4)}, [])
    guarded = tx if "notfinite_count" in tx.init(params).keys() else muonfn.apply_if_finite(tx)
    _, state = guarded.update(random_like(params, 1), guarded.init(params), params)
    before = state.clone()
    tensors = list(state.exclude("notfinite_count").values(True, True))
    grads = random_like(params, 2)
    grads["w"][0, 0] = float("nan")
    updates, state = guarded.update(grads, state, params)
    assert all(bool(u.eq(0).all()) for u in updates.values())
    assert_td_equal(state.exclude("notfinite_count"), before.exclude("notfinite_count"))
    if donate:
        assert all(a is b for a, b in zip(state.exclude("notfinite_count").values(True, True), tensors))


def _float64_map(x: torch.Tensor) -> torch.Tensor:
    """A map of one's own that cannot run on meta tensors (so init cannot try it) and returns fp64."""
    return torch.from_numpy(x.detach().numpy().copy())


@pytest.mark.parametrize(
    "tx",
    [
        muonfn.chain(muonfn.ema_momentum(donate_state=True), muonfn.scale_by_learning_rate(lambda count: -1.0)),
        muonfn.scale_by_muon(ns=lambda x: _float64_map(x).double(), donate_state=True),
    ],
    ids=["a schedule's bad value", "a map's result of another dtype"],
)
def test_apply_if_finite_keeps_a_donated_state_when_its_step_fails(tx: muonfn.Transform) -> None:
    """What only a member's update tells raises after an earlier member wrote its donated state: the copy
    apply_if_finite keeps for a skipped step is written back, so a failed step leaves the state as it was."""
    params = td({"w": torch.randn(4, 3)})
    guarded = muonfn.apply_if_finite(tx)
    state = guarded.init(params)
    before = state.clone()
    with pytest.raises((ValueError, TypeError), match=r"schedule returned -1\.0|ns=.* returned a torch\.float64"):
        guarded.update(random_like(params, 0), state, params)
    assert_td_equal(state, before)


def test_partition_routes_every_set_of_leaves_past_its_cache() -> None:
    """An update of some of the leaves (the others frozen) routes them by their labels, however many
    different sets of leaves come (the routes of the latest 16 sets are kept)."""
    names = [f"w{i}" for i in range(5)]
    params = td({n: torch.randn(3) for n in names})
    labels = {n: "scaled" if i % 2 else "signs" for i, n in enumerate(names)}
    transforms = {"scaled": muonfn.scale_by_learning_rate(0.5), "signs": muonfn.scale_by_sign()}
    tx = muonfn.partition(transforms, lambda leaves: {n: labels[n] for n in leaves.keys()})
    state = tx.init(params)
    subsets = [[n for j, n in enumerate(names) if k >> j & 1] for k in range(1, 32)]
    for subset in subsets + subsets[:3]:  # past the 16 kept, and back to the first sets
        grads = td({n: torch.randn(3) for n in subset})
        updates, _ = tx.update(grads, state)
        expected = {n: g.mul(-0.5) if labels[n] == "scaled" else g.sign() for n, g in grads.items()}
        assert_td_equal(updates, td(expected))
