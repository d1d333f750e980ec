"""Bad input: one test per case, each error naming the culprit."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from _bitwise import assert_bitwise
from _strategies import TiedLM, assert_td_equal
from tensordict import TensorDict

import muonfn
from muonfn import MatrixView
from muonfn.distributed import ShardSpec, sharded_orthogonalizer
from muonfn.testing import simulate


def params() -> TensorDict:
    return TensorDict(
        {"0": {"weight": torch.ones(4, 3), "bias": torch.ones(4)}, "1": {"weight": torch.ones(2, 4)}}, batch_size=[]
    )


# --- hyperparameters, rejected when the transform is built ----------------------------------------------

BAD_HYPERPARAMETERS: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
    "lr < 0": (lambda: muonfn.muon(lr=-1e-3), ValueError, r"learning rate must be finite and >= 0, got -0.001"),
    "lr tensor < 0": (lambda: muonfn.adamw(lr=torch.tensor(-0.1)), ValueError, r"learning rate must be"),
    "lr nan": (lambda: muonfn.adamw(lr=float("nan")), ValueError, r"learning rate must be finite"),
    "lr inf": (lambda: muonfn.scale_by_learning_rate(float("inf")), ValueError, r"learning rate must be finite"),
    "adamw_lr < 0": (lambda: muonfn.muon(adamw_lr=-1.0), ValueError, r"learning rate must be"),
    "lr not a number": (lambda: muonfn.adamw(lr="0.1"), TypeError, r"learning rate must be a float or a 0-d tensor"),
    "lr tensor not 0-d": (
        lambda: muonfn.adamw(lr=torch.ones(2)),
        ValueError,
        r"must be a float or a 0-d tensor, got a tensor of shape \(2,\)",
    ),
    "lr 1-element tensor": (
        lambda: muonfn.muon(lr=torch.tensor([0.01])),
        ValueError,
        r"learning rate must be a float or a 0-d tensor, got a tensor of shape \(1,\)",
    ),
    "adamw lr 1-element tensor": (
        lambda: muonfn.adamw(lr=torch.tensor([[0.01]])),
        ValueError,
        r"learning rate must be a float or a 0-d tensor, got a tensor of shape \(1, 1\)",
    ),
    "lr on the meta device": (
        lambda: muonfn.muon(lr=torch.tensor(0.01, device="meta")),
        ValueError,
        r"learning rate is a tensor on the meta device, which holds no value",
    ),
    "weight_decay schedule": (
        lambda: muonfn.muon(weight_decay=lambda count: 0.1),  # type: ignore[arg-type]
        TypeError,
        r"weight_decay must be a float or a 0-d tensor, got function",
    ),
    "momentum 1-element tensor": (
        lambda: muonfn.muon(momentum=torch.tensor([0.9])),
        ValueError,
        r"momentum must be a float or a 0-d tensor, got a tensor of shape \(1,\)",
    ),
    "weight_decay 1-element tensor": (
        lambda: muonfn.muon(weight_decay=torch.tensor([0.1])),
        ValueError,
        r"weight_decay must be a float or a 0-d tensor, got a tensor of shape \(1,\)",
    ),
    "adamw weight_decay 1-element tensor": (
        lambda: muonfn.adamw(weight_decay=torch.tensor([0.1])),
        ValueError,
        r"weight_decay must be a float or a 0-d tensor, got a tensor of shape \(1,\)",
    ),
    "beta1 1-element tensor": (
        lambda: muonfn.adamw(betas=(torch.tensor([0.9]), 0.999)),
        ValueError,
        r"b1 must be a float or a 0-d tensor, got a tensor of shape \(1,\)",
    ),
    "beta2 1-element tensor": (
        lambda: muonfn.muon(adamw_betas=(0.9, torch.tensor([0.95]))),
        ValueError,
        r"b2 must be a float or a 0-d tensor, got a tensor of shape \(1,\)",
    ),
    "momentum = 1": (lambda: muonfn.muon(momentum=1.0), ValueError, r"momentum must be in \[0, 1\), got 1.0"),
    "momentum < 0": (lambda: muonfn.ema_momentum(-0.1), ValueError, r"momentum must be in \[0, 1\)"),
    "momentum tensor": (lambda: muonfn.muon(momentum=torch.tensor(1.5)), ValueError, r"momentum must be in"),
    "beta1 = 1": (lambda: muonfn.adamw(betas=(1.0, 0.999)), ValueError, r"b1 must be in \[0, 1\), got 1.0"),
    "beta2 < 0": (lambda: muonfn.adamw(betas=(0.9, -0.5)), ValueError, r"b2 must be in \[0, 1\)"),
    "adamw_betas": (lambda: muonfn.muon(adamw_betas=(0.9, 1.0)), ValueError, r"b2 must be in \[0, 1\)"),
    "adam eps = 0": (lambda: muonfn.adamw(eps=0.0), ValueError, r"eps must be finite and > 0, got 0.0"),
    "betas not a pair": (
        lambda: muonfn.adamw(betas=(0.9,)),  # type: ignore[arg-type]
        ValueError,
        r"betas must be a pair \(beta1, beta2\), got \(0\.9,\)",
    ),
    "scale_by_adam nesterov": (
        lambda: muonfn.scale_by_adam(nesterov="optax"),  # type: ignore[arg-type]
        ValueError,
        r"scale_by_adam: nesterov must be True, False or 'timm', got 'optax'",
    ),
    "adamw_eps < 0": (lambda: muonfn.muon(adamw_eps=-1e-8), ValueError, r"eps must be finite and > 0"),
    "ns eps = 0": (
        lambda: muonfn.NewtonSchulz(eps=0.0),
        ValueError,
        r"Newton–Schulz eps must be finite and > 0, got 0.0",
    ),
    "ns eps < 0": (lambda: muonfn.NewtonSchulz(eps=-1.0), ValueError, r"Newton–Schulz eps must be"),
    "weight_decay < 0": (lambda: muonfn.muon(weight_decay=-0.1), ValueError, r"weight_decay must be finite and >= 0"),
    "adamw_weight_decay < 0": (lambda: muonfn.muon(adamw_weight_decay=-1.0), ValueError, r"weight_decay must be"),
    "ns steps = 0": (lambda: muonfn.NewtonSchulz(steps=0), ValueError, r"steps must be an integer >= 1, got 0"),
    "ns steps not an int": (
        lambda: muonfn.NewtonSchulz(steps=2.5),  # type: ignore[arg-type]
        ValueError,
        r"steps must be an integer >= 1, got 2.5",
    ),
    "unknown coefficient set": (
        lambda: muonfn.NewtonSchulz("kellr"),
        ValueError,
        r"unknown Newton–Schulz coefficient set 'kellr'; choose one of \['cesista', 'keller', 'polar_express'\]",
    ),
    "coefficients not triples": (
        lambda: muonfn.NewtonSchulz([(3.0, -4.0)]),
        ValueError,
        r"must be finite \(a, b, c\) triples",
    ),
    "coefficients one flat triple": (
        lambda: muonfn.NewtonSchulz((3.4445, -4.7750, 2.0315)),
        ValueError,
        r"are one \(a, b, c\), not a schedule: pass \[\(a, b, c\)\] with steps=5",
    ),
    "coefficients not finite": (
        lambda: muonfn.NewtonSchulz([(3.0, float("nan"), 1.0)]),
        ValueError,
        r"must be finite \(a, b, c\) triples",
    ),
    "no coefficients": (lambda: muonfn.NewtonSchulz([]), ValueError, r"at least one \(a, b, c\) triple"),
    "bad norm_factor": (
        lambda: muonfn.NewtonSchulz(muonfn.Coefficients(((3.0, -3.0, 1.0),), norm_factor=0.0)),
        ValueError,
        r"norm_factor must be finite and > 0",
    ),
    "unknown scale mode": (
        lambda: muonfn.muon(scale="rms"),
        ValueError,
        r"unknown scale mode 'rms'; choose one of \['match_rms_adamw', 'none', 'original', 'spectral', "
        r"'unit_rms_norm'\]",
    ),
    "unknown scale mode in scale_by_shape": (lambda: muonfn.scale_by_shape("max"), ValueError, r"unknown scale mode"),
    "scale factor < 0": (
        lambda: muonfn.muon(scale=("spectral", -1.0)),
        ValueError,
        r"scale's factor must be a finite float >= 0",
    ),
    "scale factor tensor": (
        lambda: muonfn.muon(scale=("spectral", torch.tensor(2.0))),  # type: ignore[arg-type]
        ValueError,
        r"scale's factor must be a finite float >= 0",
    ),
    "scale not a pair": (
        lambda: muonfn.scale_by_shape(("spectral", 0.2, 1.0)),  # type: ignore[arg-type]
        ValueError,
        r"unknown scale mode .*or a pair \(mode, factor\)",
    ),
    "shim extra_scale < 0": (
        lambda: muonfn.optim.Muon([torch.zeros(2, 2, requires_grad=True)], extra_scale=-1.0),
        ValueError,
        r"extra_scale must be a finite float >= 0",
    ),
    "ns dtype not floating": (
        lambda: muonfn.NewtonSchulz(dtype=torch.int32),
        TypeError,
        r"Newton–Schulz dtype must be a real float",
    ),
    "bucket_numel = 0": (
        lambda: muonfn.LocalOrthogonalizer(bucket_numel=0),
        ValueError,
        r"bucket_numel must be an integer >= 1",
    ),
    "ns a name of no map": (
        lambda: muonfn.muon(ns="polar"),
        TypeError,
        r"ns must be a muonfn.NewtonSchulz, 'svd', 'qr', 'gram' or a map of \(count, m, n\) batches, got 'polar'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_HYPERPARAMETERS))
def test_bad_hyperparameter(case: str) -> None:
    build, error, match = BAD_HYPERPARAMETERS[case]
    with pytest.raises(error, match=match):
        build()


def test_0d_tensor_betas_beta1_is_read_at_every_update_beta2_once() -> None:
    """beta1 may be scheduled (the shim's AdamW groups schedule it as their momentum); beta2 is
    read when the transform is built."""
    p = params()
    grads = p.apply(torch.ones_like)
    betas = (torch.tensor(0.8), torch.tensor(0.9))
    as_tensors = muonfn.adamw(betas=betas)
    betas[0].fill_(0.5)
    betas[1].fill_(0.1)
    as_floats = muonfn.adamw(betas=(0.5, float(torch.tensor(0.9))))  # (the fp32 value, as a Python float)
    expected = as_floats.update(grads, as_floats.init(p), p)
    got = as_tensors.update(grads, as_tensors.init(p), p)
    assert_td_equal(got[0], expected[0])
    assert_td_equal(got[1], expected[1])


# --- distributed settings, rejected when the orthogonalizer is built -------------------------------------


def test_unknown_strategy_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown distributed strategy 'bogus'; choose one of \['owner', 'gather'"):
        simulate(1, lambda col: sharded_orthogonalizer(col, strategy="bogus"))  # type: ignore[arg-type]


def test_shard_specs_name_parameters() -> None:
    def build(col: object) -> None:
        orthogonalizer = sharded_orthogonalizer(col, shard_specs={"0.wieght": ShardSpec(0)})  # type: ignore[arg-type]
        muonfn.muon(orthogonalizer=orthogonalizer).init(params())

    with pytest.raises(ValueError, match=r"shard_specs names '0.wieght', which is not a parameter"):
        simulate(1, build)


def test_torch_collectives_checks_the_type_first() -> None:
    from muonfn.distributed import torch_collectives

    with pytest.raises(TypeError, match=r"torch_collectives expects a DeviceMesh or a ProcessGroup, got object"):
        torch_collectives(object())  # type: ignore[arg-type]


NS_CASES: dict[str, tuple[dict, type[Exception], str]] = {
    "eps = 0": ({"eps": 0.0}, ValueError, r"eps must be finite and > 0, got 0.0"),
    "steps = 0": ({"steps": 0}, ValueError, r"steps must be an integer >= 1, got 0"),
    "unknown coefficient set": ({"coefficients": "fast"}, ValueError, r"unknown Newton–Schulz coefficient set 'fast'"),
    "integer dtype": ({"dtype": torch.int64}, TypeError, r"dtype must be a real floating-point torch.dtype"),
}


@pytest.mark.parametrize("case", sorted(NS_CASES))
def test_bad_newton_schulz_argument(case: str) -> None:
    kwargs, error, match = NS_CASES[case]
    with pytest.raises(error, match=match):
        muonfn.newton_schulz(torch.ones(3, 4), **kwargs)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.ones(4), r"needs a \(\.\.\., m, n\) tensor, got shape \(4,\)"),
        (torch.ones(3, 4, dtype=torch.complex64), r"needs a real floating-point tensor, got torch.complex64"),
        (torch.ones(3, 4, dtype=torch.int32), r"needs a real floating-point tensor, got torch.int32"),
    ],
    ids=["vector", "complex", "integer"],
)
def test_bad_newton_schulz_input(x: torch.Tensor, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        muonfn.newton_schulz(x)


# --- gradients that do not match the parameters, rejected by update ---------------------------------------


def bad_grads(case: str) -> TensorDict:
    grads = params().apply(torch.ones_like)
    if case == "unknown key":
        grads["0", "wieght"] = torch.ones(4, 3)
    elif case == "wrong shape":
        grads["0", "weight"] = torch.ones(3, 4)
    elif case == "wrong dtype":
        grads["0", "weight"] = torch.ones(4, 3, dtype=torch.float64)
    elif case == "complex":
        grads["0", "weight"] = torch.ones(4, 3, dtype=torch.complex64)
    elif case == "sparse":
        grads["0", "weight"] = torch.ones(4, 3).to_sparse()
    return grads


GRAD_CASES = {
    "unknown key": (ValueError, r"'0.wieght' has no matching parameter"),
    "wrong shape": (
        ValueError,
        r"gradient '0.weight' is a torch.float32 tensor of shape \(3, 4\) on cpu, its parameter a "
        r"torch.float32 tensor of shape \(4, 3\)",
    ),
    "wrong dtype": (
        ValueError,
        r"gradient '0.weight' is a torch.float64 tensor .*, its parameter a torch.float32 tensor",
    ),
    "complex": (TypeError, r"gradient '0.weight' is torch.strided torch.complex64; only dense real gradients"),
    "sparse": (TypeError, r"gradient '0.weight' is torch.sparse_coo torch.float32; only dense real gradients"),
}


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_bad_gradients_name_the_key(case: str, optimizer: str) -> None:
    tx = muonfn.muon() if optimizer == "muon" else muonfn.adamw()
    p = params()
    state = tx.init(p)
    before = state.clone()
    error, match = GRAD_CASES[case]
    with pytest.raises(error, match=match):
        tx.update(bad_grads(case), state, p)
    assert (state == before).all()


# transforms keeping state shaped like each leaf: momenta, moments, row statistics, a guard's copies
STATEFUL: dict[str, Callable[..., muonfn.Transform]] = {
    "muon": muonfn.muon,
    "adamw": muonfn.adamw,
    "normuon": muonfn.normuon,
    "adamuon": muonfn.adamuon,
    "apply_if_finite(muon)": lambda **options: muonfn.apply_if_finite(muonfn.muon(**options)),
}


@pytest.mark.parametrize("donate_state", [False, True])
@pytest.mark.parametrize("name", sorted(STATEFUL))
@pytest.mark.parametrize("moved", ["state", "params and grads", "one gradient", "one gradient, no params"])
def test_a_state_or_gradient_on_another_device_is_refused_naming_the_leaf_and_both_devices(
    moved: str, name: str, donate_state: bool
) -> None:
    """A state made by init from params on the meta device (deferred init), params materialized on the
    CPU afterwards, would be stepped on meta and its updates add nothing in place; the other way round
    torch's own error named no leaf. Refused before the state changes."""
    p = params()
    options: dict[str, object] = {"donate_state": donate_state}
    if moved == "one gradient, no params":
        options["weight_decay"] = 0.0  # no decay: the update takes no params
    tx = STATEFUL[name](**options)
    state = tx.init(p.to("meta") if moved == "state" else p)
    grads = p.apply(torch.ones_like)
    if moved == "params and grads":
        p, grads = p.to("meta"), grads.to("meta")
    elif moved != "state":
        grads["0", "weight"] = torch.ones(4, 3, device="meta")
    given = None if moved == "one gradient, no params" else p
    before = state.clone()
    if moved == "state":
        match = r"state entry '[\w.]*0\.weight' is on meta, its parameter '0\.weight' on cpu; move the state"
    elif moved == "one gradient":
        match = r"gradient '0\.weight' is a torch.float32 tensor of shape \(4, 3\) on meta, its parameter .* on cpu"
    elif moved == "params and grads":
        match = r"state entry '[\w.]*0\.weight' is on cpu, its parameter '0\.weight' on meta"
    else:
        match = r"state entry '[\w.]*0\.weight' is on cpu, its gradient '0\.weight' on meta"
    with pytest.raises(ValueError, match=match):
        tx.update(grads, state, given)
    if moved != "state":  # (a meta state holds no values to compare)
        assert_td_equal(state, before)


def test_apply_updates_in_place_refuses_an_update_on_another_device_before_writing() -> None:
    """A meta update added in place to CPU parameters changed nothing, without an error."""
    p = params()
    kept = p.clone()
    updates = p.apply(torch.ones_like).set(("1", "weight"), torch.ones(2, 4, device="meta"))
    for apply in (muonfn.apply_updates_, muonfn.apply_updates):
        with pytest.raises(ValueError, match=rf"{apply.__name__}: update '1\.weight' is on meta, the parameter on cpu"):
            apply(p, updates)
    assert_td_equal(p, kept)


def ensemble() -> TensorDict:
    """Two members stacked, as TensorDict.from_modules makes them: batch size [2]."""
    return torch.stack([params(), params().apply(lambda t: t * 2)])


def schedule(count: torch.Tensor) -> float:
    return 0.1


GRAD_TAKERS: dict[str, Callable[[], muonfn.Transform]] = {
    "muon": lambda: muonfn.muon(),
    "adamw": lambda: muonfn.adamw(),
    "apply_if_finite": lambda: muonfn.apply_if_finite(muonfn.adamw()),
    "ema_momentum": lambda: muonfn.ema_momentum(),
    "scale_by_adam": lambda: muonfn.scale_by_adam(),
    "add_decayed_weights": lambda: muonfn.add_decayed_weights(0.1),
    "scale_by_learning_rate": lambda: muonfn.scale_by_learning_rate(0.1),
    "scale_by_learning_rate(schedule)": lambda: muonfn.scale_by_learning_rate(schedule),
    "orthogonalize": lambda: muonfn.orthogonalize(),
    "scale_by_shape": lambda: muonfn.scale_by_shape(),
    "partition": lambda: muonfn.partition(
        {"a": muonfn.scale_by_shape(), "b": muonfn.scale_by_learning_rate(0.1)},
        {"0.weight": "a", "1.weight": "a", "0.bias": "b"},
    ),
    "masked": lambda: muonfn.masked(muonfn.scale_by_learning_rate(0.1), {"0.bias": True}),
}
MATRICES_ONLY = {"orthogonalize", "scale_by_shape"}


@pytest.mark.parametrize("stacked", ["state", "grads"])
@pytest.mark.parametrize("name", sorted(GRAD_TAKERS))
def test_gradients_of_another_batch_size_are_rejected(name: str, stacked: str) -> None:
    """One member's gradients given to an ensemble's state, or an ensemble's to one model's: named, nothing changed."""
    one, many = params(), ensemble()
    if name in MATRICES_ONLY:
        one, many = one.exclude(("0", "bias")), many.exclude(("0", "bias"))
    p, g = (many, one) if stacked == "state" else (one, many)
    tx = GRAD_TAKERS[name]()
    state = tx.init(p)
    before = state.clone()
    expected = (tuple(g.batch_size), tuple(p.batch_size))
    with pytest.raises(ValueError, match=rf"gradients have batch size {re.escape(str(expected[0]))}, the state "):
        tx.update(g.apply(torch.ones_like), state, p)
    assert_td_equal(state, before)


def test_a_stateless_transform_takes_a_plain_empty_state() -> None:
    grads = params().exclude(("0", "bias"))
    for tx in (muonfn.orthogonalize(), muonfn.scale_by_shape(), muonfn.scale_by_learning_rate(0.1)):
        updates, state = tx.update(grads, {})  # type: ignore[arg-type]
        assert len(state.keys()) == 0 and updates.batch_size == grads.batch_size


# --- a state that is not the transform's own --------------------------------------------------------------


def test_another_transforms_state_names_the_missing_entry() -> None:
    p, grads = params(), params().apply(torch.ones_like)
    adamw_state, muon_state = muonfn.adamw().init(p), muonfn.muon().init(p)
    with pytest.raises(
        ValueError,
        match=r"update: state has no entry 'muon\.momentum\.0\.weight'; was it made by this transform's init\?",
    ):
        muonfn.muon().update(grads, adamw_state, p)
    with pytest.raises(ValueError, match=r"update: state has no entry 'step\.0\.weight'"):
        muonfn.adamw().update(grads, muon_state, p)


def test_a_state_entry_of_a_parameter_the_update_is_not_given_is_named() -> None:
    """The state of every parameter, given to an update of some of them with their parameters, is
    refused naming an entry that belongs to none of them; given the state of those alone, it steps."""
    p, tx = params(), muonfn.adamw()
    some = p.flatten_keys(".").select("0.weight", "1.weight")
    grads = some.apply(torch.ones_like)
    with pytest.raises(ValueError, match=r"update: state entry 'step\.0\.bias' belongs to no parameter of this update"):
        tx.update(grads, tx.init(p), some)
    updates, _ = tx.update(grads, tx.init(some), some)
    assert list(updates.keys()) == ["0.weight", "1.weight"]


MISSING_ENTRY: dict[str, tuple[Callable[[], muonfn.Transform], str, str]] = {
    "ema_momentum": (lambda: muonfn.ema_momentum(), "momentum", r"update: state has no entry 'momentum\.0\.weight'"),
    "scale_by_adam": (
        lambda: muonfn.scale_by_adam(),
        "exp_avg_sq",
        r"update: state has no entry 'exp_avg_sq\.0\.weight'",
    ),
    "schedule": (lambda: muonfn.scale_by_learning_rate(schedule), "count", r"update: state has no entry 'count'"),
    "named": (lambda: muonfn.named("inner", muonfn.adamw()), "inner", r"update: state has no entry 'inner\.step\."),
    "apply_if_finite": (
        lambda: muonfn.apply_if_finite(muonfn.adamw()),
        "notfinite_count",
        r"update: state has no entry 'notfinite_count'",
    ),
    "chain": (
        lambda: muonfn.chain(muonfn.ema_momentum(), muonfn.scale_by_learning_rate(schedule)),
        "count",
        r"update: state has no entry 'count'",
    ),
}


@pytest.mark.parametrize("name", sorted(MISSING_ENTRY))
def test_a_state_missing_an_entry_names_it(name: str) -> None:
    build, entry, match = MISSING_ENTRY[name]
    tx, p = build(), params()
    state = tx.init(p).exclude(entry)
    before = state.clone()
    with pytest.raises(ValueError, match=match):
        tx.update(p.apply(torch.ones_like), state, p)
    assert_td_equal(state, before)


# --- what init accepts: floating-point parameters, each a tensor of its own ---------------------------------


def test_init_rejects_an_integer_buffer_pointing_to_split_buffers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    everything = TensorDict.from_module(model).detach()
    for tx in (muonfn.muon(), muonfn.adamw()):
        with pytest.raises(
            TypeError,
            match=r"'1.num_batches_tracked' is a torch.int64 tensor; only floating-point parameters can be "
            r"optimized.*muonfn.split_buffers\(model\)",
        ):
            tx.init(everything)


def test_init_rejects_tied_weights_naming_both_keys() -> None:
    tied = TensorDict.from_module(TiedLM()).detach()
    for tx in (muonfn.muon(), muonfn.adamw(), muonfn.ema_momentum(), muonfn.scale_by_adam()):
        with pytest.raises(
            ValueError,
            match=r"'embed.weight' and 'head.weight' are one tensor \(tied weights\).*"
            r"params.exclude\(\('head', 'weight'\)\).*torch.func.functional_call",
        ):
            tx.init(tied)
    untied = tied.clone()  # same values, own storage: accepted
    muonfn.muon().init(untied)


# --- apply_updates: shapes and keys of the parameters -------------------------------------------------------


def test_apply_updates_rejects_other_shapes_and_unknown_keys() -> None:
    p = params()
    kept = p.clone()
    column = p.apply(torch.zeros_like).set(("0", "weight"), torch.ones(4, 1))
    with pytest.raises(
        ValueError, match=r"apply_updates: update '0.weight' has shape \(4, 1\), the parameter \(4, 3\)"
    ):
        muonfn.apply_updates(p, column)
    unknown = TensorDict({"0": {"wieght": torch.ones(4, 3)}}, [])
    with pytest.raises(ValueError, match=r"apply_updates: update '0.wieght' has no matching parameter"):
        muonfn.apply_updates(p, unknown)
    assert_td_equal(p, kept)


@pytest.mark.parametrize("bad", ["shape", "name"])
def test_apply_updates_in_place_checks_every_update_before_writing_any(bad: str) -> None:
    p = params()
    kept = p.clone()
    updates = p.apply(torch.ones_like)  # every other leaf would be stepped first
    if bad == "shape":
        updates.set(("1", "weight"), torch.ones(2, 1))  # the last leaf
        match = r"apply_updates_: update '1.weight' has shape \(2, 1\), the parameter \(2, 4\)"
    else:
        updates.set(("1", "wieght"), torch.ones(2, 4))  # after the others
        match = r"apply_updates_: update '1.wieght' has no matching parameter"
    with pytest.raises(ValueError, match=match):
        muonfn.apply_updates_(p, updates)
    assert_td_equal(p, kept)


# --- schedules, checked when called -------------------------------------------------------------------------


# each schedule as its error names it: (preset, the option scheduled) -> the name
SCHEDULED = {
    "adamw lr": (muonfn.adamw, "lr", "the learning rate schedule"),
    "muon lr": (muonfn.muon, "lr", "the learning rate schedule of branch 'muon'"),
    "muon adamw_lr": (muonfn.muon, "adamw_lr", "the learning rate schedule of branch 'adamw'"),
    "adamuon lr": (muonfn.adamuon, "lr", "the learning rate schedule of branch 'muon'"),
}


@pytest.mark.parametrize("scheduled", sorted(SCHEDULED))
@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (float("nan"), ValueError, r"{schedule} returned nan; it must be finite and >= 0"),
        (-0.1, ValueError, r"{schedule} returned -0.1; it must be finite and >= 0"),
        (float("inf"), ValueError, r"{schedule} returned inf"),
        ("0.1", TypeError, r"{schedule} must return a float or a 0-d tensor, got str"),
        (torch.tensor([0.1]), ValueError, r"{schedule} returned a tensor of shape \(1,\); it must be 0-d"),
        (
            torch.tensor(True),
            TypeError,
            r"{schedule} must return a float or a 0-d real tensor, got a torch.bool tensor",
        ),
        (
            torch.tensor(0.1 + 0j),
            TypeError,
            r"{schedule} must return a float or a 0-d real tensor, got a torch.complex64 tensor",
        ),
        (
            torch.tensor(0.1, device="meta"),  # once used as it was: no learning rate, and uphill
            ValueError,
            r"{schedule} returned a tensor on meta, the parameters are on cpu; it must be on their device, "
            r"or a 0-d tensor on the CPU",
        ),
    ],
    ids=["nan", "negative", "inf", "str", "1-element tensor", "bool tensor", "complex tensor", "meta tensor"],
)
@pytest.mark.parametrize("donate_state", [False, True])
def test_a_bad_schedule_value_is_rejected_when_called(
    value: object, error: type[Exception], match: str, scheduled: str, donate_state: bool
) -> None:
    """Refused before any member of the preset writes its state: a donated state, which the
    members update in place (the momentum before the Muon branch's rate), is left as it was."""
    preset, option, name = SCHEDULED[scheduled]
    p = params()
    tx = preset(**{option: lambda count: value}, donate_state=donate_state)  # type: ignore[operator]
    state = tx.init(p)
    before = state.clone()
    with pytest.raises(error, match=match.format(schedule=re.escape(name))):
        tx.update(p.apply(torch.ones_like), state, p)
    assert_td_equal(state, before)


def test_a_schedule_is_called_once_an_update_though_checked_before_it() -> None:
    """The checks call the schedule and keep its value for the update: one call per branch and
    update, each with the count before it."""
    calls: list[int] = []

    def schedule(count: torch.Tensor) -> float:
        calls.append(int(count))
        return 0.01

    tx = muonfn.muon(lr=schedule, adamw_lr=0.001, donate_state=True)
    p = params()
    state = tx.init(p)
    for _ in range(3):
        _, state = tx.update(p.apply(torch.ones_like), state, p)
    assert calls == [0, 1, 2]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("donate", [False, True])
def test_decay_without_params(donate: bool, fused: bool) -> None:
    """Refused before the moments are written: a donated state is left as it was."""
    tx = muonfn.adamw(weight_decay=0.1, donate_state=donate, fused=fused)
    p = params()
    state = tx.init(p)
    _, state = tx.update(p.apply(torch.ones_like), state, p)
    before = state.clone()
    with pytest.raises(ValueError, match=r"adamw needs params: call update\(grads, state, params\)"):
        tx.update(p.apply(torch.ones_like), state)
    assert all(torch.equal(state[k], before[k]) for k in before.keys(True, True))


# --- names and views, rejected by init -------------------------------------------------------------------


def test_vector_labelled_muon() -> None:
    labels = {"0.weight": "muon", "0.bias": "muon", "1.weight": "muon"}
    with pytest.raises(ValueError, match=r"'0.bias': shape \(4,\) with batch_dims=0 holds no matrix"):
        muonfn.muon(labels=labels).init(params())


@pytest.mark.parametrize(
    "make", [muonfn.orthogonalize, lambda: muonfn.descent(0.1, ns=None)], ids=["orthogonalize", "descent"]
)
def test_a_stateless_update_without_init_refuses_what_init_refuses(make: Callable[[], muonfn.Transform]) -> None:
    """Stepped without ``init``, a stateless Newton–Schulz transform still refuses a leaf its view cannot
    read: at the entry of its update, before anything is computed, whatever structure it saw before."""
    tx = make()
    good = TensorDict({"w": torch.ones(4, 3)}, [])
    tx.update(good, TensorDict())  # a structure that passes
    bad = TensorDict({"w": torch.ones(4, 3), "b": torch.ones(3)}, [])
    with pytest.raises(ValueError, match=r"^'b': shape \(3,\) with batch_dims=0 holds no matrix"):
        tx.update(bad, TensorDict())


def test_bad_view_split() -> None:
    tx = muonfn.muon(views={"0.weight": MatrixView(split=(2, 1))})
    with pytest.raises(ValueError, match=r"'0.weight': split \(2, 1\) does not partition the 4 rows of shape \(4, 3\)"):
        tx.init(params())


def test_views_name_an_unknown_key() -> None:
    tx = muonfn.muon(views={"1.wieght": MatrixView(transposed=True)})
    with pytest.raises(ValueError, match=r"views names '1.wieght', which is not a parameter"):
        tx.init(params())


def test_weight_decay_mask_names_an_unknown_key() -> None:
    tx = muonfn.muon(weight_decay_mask={"0.bais": False})
    with pytest.raises(ValueError, match=r"weight_decay_mask names '0.bais', which is not a parameter"):
        tx.init(params())
    by_rank = muonfn.muon(weight_decay_mask=lambda p: {"0.bais": False})
    with pytest.raises(ValueError, match=r"weight_decay_mask names '0.bais'"):
        by_rank.init(params())


def test_labels_name_an_unknown_key() -> None:
    labels = {"0.weight": "muon", "0.bias": "adamw", "1.weight": "muon", "2.weight": "adamw"}
    with pytest.raises(ValueError, match=r"labels names '2.weight', which is not a parameter"):
        muonfn.muon(labels=labels).init(params())


def test_unknown_label() -> None:
    labels = {"0.weight": "muon", "0.bias": "adam", "1.weight": "muon"}
    with pytest.raises(ValueError, match=r"'0.bias' has label 'adam'; known labels: \['adamw', 'muon'\]"):
        muonfn.muon(labels=labels).init(params())


def test_a_malformed_step_count_is_refused_before_a_donated_state_changes():
    params = TensorDict({"w": torch.randn(16, 8), "b": torch.zeros(16), "c": torch.zeros(4)}, [])
    tx = muonfn.muon(lr=0.02, donate_state=True)
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros((), dtype=torch.float32)):
        state = tx.init(params)
        state["adamw", "step", "c"] = bad
        before = state.clone()
        with pytest.raises(
            ValueError,
            match=r"state entry 'adamw\.step\.c' is a torch\.\w+ tensor of shape .*, expected "
            r"torch\.int64 of shape \(\) for parameter 'c'",
        ):
            tx.update(params.apply(torch.randn_like), state, params)
        assert_td_equal(state, before)


def test_apply_updates_in_place_refuses_a_sum_its_parameter_cannot_hold_before_writing():
    for dtype, update in ((torch.float32, torch.ones(3, dtype=torch.complex64)), (torch.int64, torch.ones(3))):
        params = TensorDict({"a": torch.zeros(3), "c": torch.zeros(3, dtype=dtype)}, [])
        before = params.clone()
        updates = TensorDict({"a": torch.ones(3), "c": update}, [])
        with pytest.raises(ValueError, match=r"update 'c' of dtype .* cannot be added in place to its parameter"):
            muonfn.apply_updates_(params, updates)
        assert_td_equal(params, before)


# --- ns: the maps that are no Newton–Schulz, and maps of one's own -----------------------------------


def shim(**options: object) -> muonfn.optim.Muon:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return muonfn.optim.Muon(model.named_parameters(), **options)


def own_map(x: torch.Tensor) -> torch.Tensor:
    return muonfn.polar(x)


@pytest.mark.parametrize("method", ["svd", "qr", "own"])
@pytest.mark.parametrize(
    ("setting", "value"),
    [("ns_steps", 3), ("ns_coefficients", "cesista"), ("ns_coefficients", [(3.0, -3.0, 1.0)]), ("eps", 1e-6)],
)
def test_the_shims_newton_schulz_spellings_are_refused_beside_a_whole_ns(
    method: str, setting: str, value: object
) -> None:
    """torch.optim.Muon's spellings configure Newton–Schulz; ``ns=`` is the whole setting, and a map that runs
    no Newton–Schulz would ignore them. (The presets take ``ns=`` alone: there is no second spelling to clash.)"""
    ns = own_map if method == "own" else method
    with pytest.raises(ValueError, match=r"ns= is the whole Newton–Schulz setting: leave ns_coefficients, ns_steps"):
        shim(ns=ns, **{setting: value})
    shim(ns=ns)  # the defaults are no conflict


def test_newton_schulz_settings_set_in_param_groups_are_refused_at_the_step_changing_nothing() -> None:
    opt = shim(ns="svd")
    model_params = [p for group in opt.param_groups for p in group["params"]]
    for p in model_params:
        p.grad = torch.ones_like(p)
    opt.param_groups[0]["ns_steps"] = 2
    before, state = [p.detach().clone() for p in model_params], opt.functional_state.clone()
    with pytest.raises(ValueError, match=r"ns_method='svd' does not run Newton–Schulz, so ns_steps=2"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model_params, before))
    assert_td_equal(opt.functional_state, state)


WRONG_MAPS: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "None": (lambda x: None, r"returned NoneType"),
    "a list": (lambda x: list(x), r"returned list"),
    "another shape": (lambda x: x[..., :1], r"returned a torch.float32 tensor of shape \(1, 4, 1\)"),
    "another dtype": (lambda x: x.double(), r"returned a torch.float64 tensor of shape \(1, 4, 3\)"),
}


@pytest.mark.parametrize("front", ["muon", "shim"])
@pytest.mark.parametrize("case", sorted(WRONG_MAPS))
def test_a_map_returning_the_wrong_thing_is_named_at_init(case: str, front: str) -> None:
    wrong, returned = WRONG_MAPS[case]
    expected = rf"ns=<lambda> {returned} for a torch.float32 batch of shape \(1, 4, 3\); it must return"
    with pytest.raises(TypeError, match=expected):
        muonfn.muon(ns=wrong).init(params()) if front == "muon" else shim(ns=wrong)


def test_a_map_that_cannot_run_on_meta_tensors_is_checked_at_its_call() -> None:
    """The check at each call reads metadata only: shape, dtype and device."""

    def on_meta(x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")  # on meta, also for a CPU batch

    def numpy_only(x: torch.Tensor) -> object:
        return x.numpy()  # fails on meta tensors; returns no tensor

    for wrong, returned in (
        (on_meta, r"returned a torch.float32 tensor of shape \(1, 4, 3\) on meta"),
        (numpy_only, r"returned ndarray"),
    ):
        tx = muonfn.orthogonalize(wrong)
        p = params().select(("0", "weight"))
        state = tx.init(p)
        with pytest.raises(TypeError, match=rf"ns=.*{wrong.__name__} {returned} for a torch.float32 batch"):
            tx.update(p.apply(torch.ones_like), state, p)


# --- masks: flags only ------------------------------------------------------------------------------------

MASK_TAKERS: dict[str, Callable[[object], object]] = {
    "muon": lambda mask: muonfn.muon(weight_decay_mask=mask),
    "normuon": lambda mask: muonfn.normuon(weight_decay_mask=mask),
    "adamuon": lambda mask: muonfn.adamuon(weight_decay_mask=mask),
    "adamw": lambda mask: muonfn.adamw(weight_decay_mask=mask),
    "Muon(...)": lambda mask: shim(weight_decay_mask=mask),
}


@pytest.mark.parametrize("value", ["False", [False], 0, None, torch.tensor([False, True])], ids=repr)
@pytest.mark.parametrize("taker", sorted(MASK_TAKERS))
def test_a_mask_value_that_is_no_flag_is_refused_when_the_optimizer_is_built(taker: str, value: object) -> None:
    """``bool("False")`` and ``bool([False])`` are true: read as flags, they would decay the leaf."""
    where = "Muon\\(\\.\\.\\.\\): " if taker == "Muon(...)" else ""
    with pytest.raises(TypeError, match=rf"{where}weight_decay_mask: '0.bias' maps to .*; a mask's values"):
        MASK_TAKERS[taker]({"0.bias": value})


@pytest.mark.parametrize("taker", ["muon", "normuon", "adamuon", "Muon(...)"])
def test_a_callable_mask_returning_no_flags_is_refused_before_a_step(taker: str) -> None:
    with pytest.raises(TypeError, match=r"weight_decay_mask: '0.bias' maps to 'False'; a mask's values must be"):
        tx = MASK_TAKERS[taker](lambda p: {"0.bias": "False"})
        assert isinstance(tx, muonfn.Transform)
        tx.init(params())
    with pytest.raises(TypeError, match=r"weight_decay_mask returned list; it must return a mapping of names"):
        tx = MASK_TAKERS[taker](lambda p: ["0.bias"])
        assert isinstance(tx, muonfn.Transform)
        tx.init(params())


@pytest.mark.parametrize("value", [["0.bias"], 1.0])  # a string is a mask's name: tests/test_routing.py
def test_a_mask_that_is_no_mapping_or_callable_is_refused(value: object) -> None:
    for taker in ("muon", "adamw", "Muon(...)"):
        where = re.escape("Muon(...): ") if taker == "Muon(...)" else ""
        with pytest.raises(TypeError, match=rf"{where}weight_decay_mask must be a mapping of names or a callable"):
            MASK_TAKERS[taker](value)


def test_the_transforms_refuse_mask_values_that_are_no_flags() -> None:
    with pytest.raises(TypeError, match=r"add_decayed_weights: mask: '0.bias' maps to \[False\]"):
        muonfn.add_decayed_weights(0.1, mask={"0.bias": [False]})
    with pytest.raises(TypeError, match=r"masked: mask: '0.bias' maps to 'False'"):
        muonfn.masked(muonfn.scale_by_sign(), {"0.bias": "False"})
    decay = muonfn.add_decayed_weights(0.1, mask=lambda p: {"0.bias": "False"})
    with pytest.raises(TypeError, match=r"add_decayed_weights: mask: '0.bias' maps to 'False'"):
        decay.init(params())


def test_a_one_element_bool_tensor_is_a_flag() -> None:
    p = params()
    for mask in ({"0.bias": torch.tensor(False)}, {"0.bias": False}):
        tx = muonfn.adamw(lr=0.1, weight_decay=0.5, weight_decay_mask=mask)
        updates, _ = tx.update(p.apply(torch.zeros_like), tx.init(p), p)
        assert torch.equal(updates["0", "bias"], torch.zeros(4))  # not decayed
        assert (updates["0", "weight"] != 0).all()  # decayed


# --- options of the wrong type, refused where they are given, naming what is expected -----------------

MUON_WEIGHT = "0.weight"

WRONG_TYPES: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
    "views value": (
        lambda: muonfn.muon(views={MUON_WEIGHT: (3, 3)}),
        TypeError,
        r"views: '0.weight' maps to \(3, 3\); a view must be a muonfn.MatrixView",
    ),
    "views value, adamuon": (
        lambda: muonfn.adamuon(views={MUON_WEIGHT: (3, 3)}),
        TypeError,
        r"views: '0.weight' maps to \(3, 3\)",
    ),
    "views value, shim": (
        lambda: shim(views={MUON_WEIGHT: (3, 3)}),
        TypeError,
        r"param group 0: views: '0.weight' maps to \(3, 3\)",
    ),
    "views value, transform": (
        lambda: muonfn.scale_by_shape(views={MUON_WEIGHT: "conv"}),
        TypeError,
        r"scale_by_shape: views: '0.weight' maps to 'conv'",
    ),
    "views a tuple": (
        lambda: muonfn.normuon(views=(3, 3)),
        TypeError,
        r"views must be a mapping of names to MatrixView, a callable \(name, tensor\) -> view, or None",
    ),
    "views callable returning a tuple": (
        lambda: muonfn.muon(views=lambda key, t: (3, 3)).init(params()),
        TypeError,
        r"views returned \(3, 3\) for '0.weight'; it must return a muonfn.MatrixView or None",
    ),
    "labels a list": (
        lambda: muonfn.muon(labels=[MUON_WEIGHT]),
        TypeError,
        r"labels must be a mapping of names or a callable params -> mapping, got list",
    ),
    "labels a list, shim": (lambda: shim(labels=[MUON_WEIGHT]), TypeError, r"Muon\(\.\.\.\): labels must be a mapping"),
    "labels a list, partition": (
        lambda: muonfn.partition({"a": muonfn.scale_by_sign()}, ["a"]),
        TypeError,
        r"partition: labels must be a mapping",
    ),
    "labels callable returning a list": (
        lambda: muonfn.muon(labels=lambda p: [MUON_WEIGHT]).init(params()),
        TypeError,
        r"labels returned list; it must return a mapping of names",
    ),
    "ns restarts an int": (
        lambda: muonfn.NewtonSchulz(method="gram", restarts=2),  # type: ignore[arg-type]
        ValueError,
        r"Gram Newton–Schulz restarts must be step indices in \[1, 4\], got 2",
    ),
    "ns coefficients a number": (
        lambda: muonfn.NewtonSchulz(3.4445),  # type: ignore[arg-type]
        TypeError,
        r"Newton–Schulz coefficients must be a set name \('cesista', 'keller', 'polar_express'\), a Coefficients or",
    ),
    "ns_coefficients a number, shim": (lambda: shim(ns_coefficients=None), TypeError, r"Newton–Schulz coefficients"),
    "ns_coefficients a number, shim group": (
        lambda: muonfn.optim.Muon([{"params": [torch.zeros(2, 2, requires_grad=True)], "ns_coefficients": 5}]),
        TypeError,
        r"Newton–Schulz coefficients must be a set name",
    ),
    "scale a list": (lambda: muonfn.muon(scale=["original"]), ValueError, r"unknown scale mode \['original'\]"),
    "beta2 a string": (
        lambda: muonfn.normuon(beta2="0.9"),
        TypeError,
        r"normuon: beta2 must be a float or a 0-d tensor, got str",
    ),
    "adaptive_eps a string": (
        lambda: muonfn.adamuon(adaptive_eps="1e-8"),
        TypeError,
        r"adamuon: adaptive_eps must be a float or a 0-d tensor, got str",
    ),
    "donate_state a string": (
        lambda: muonfn.muon(donate_state="no"),
        TypeError,
        r"donate_state must be True or False, got 'no'",
    ),
    "donate_state None, adamw": (
        lambda: muonfn.adamw(donate_state=None),
        TypeError,
        r"adamw: donate_state must be True or False, got None",
    ),
    "donate_state, shim": (lambda: shim(donate_state=0), TypeError, r"Muon\(...\): donate_state must be True or False"),
    "donate_state, ema_momentum": (
        lambda: muonfn.ema_momentum(0.9, donate_state="yes"),
        TypeError,
        r"ema_momentum: donate_state must be True or False",
    ),
    "bias_correction, scale_by_element_rms": (
        lambda: muonfn.scale_by_element_rms(0.9, bias_correction=1),
        TypeError,
        r"scale_by_element_rms: bias_correction must be True or False, got 1",
    ),
    "cautious, add_decayed_weights": (
        lambda: muonfn.add_decayed_weights(0.1, cautious="heavyball"),
        TypeError,
        r"add_decayed_weights: cautious must be True or False, got 'heavyball'",
    ),
    "MatrixView batch_dims a string": (
        lambda: MatrixView(batch_dims="1"),  # type: ignore[arg-type]
        TypeError,
        r"MatrixView: batch_dims must be an integer, got '1'",
    ),
    "MatrixView transposed a number": (
        lambda: MatrixView(transposed=1),  # type: ignore[arg-type]
        TypeError,
        r"MatrixView: transposed must be True or False, got 1",
    ),
    "MatrixView split of floats": (
        lambda: MatrixView(split=(2.0, 2.0)),  # type: ignore[arg-type]
        TypeError,
        r"MatrixView: split must be a tuple of block sizes \(integers\), got \(2.0, 2.0\)",
    ),
    "orthogonalizer not callable": (
        lambda: muonfn.orthogonalize(orthogonalizer="owner"),  # type: ignore[arg-type]
        TypeError,
        r"orthogonalize: orthogonalizer must be a muonfn.linalg.Orthogonalizer, got 'owner'",
    ),
    "chain member not a transform": (
        lambda: muonfn.chain(muonfn.scale_by_sign(), (0.9,)),  # type: ignore[arg-type]
        TypeError,
        r"expected a muonfn.Transform \(init, update\), got tuple",
    ),
    "cautious of no transform": (
        lambda: muonfn.cautious("heavyball"),  # type: ignore[arg-type]
        TypeError,
        r"expected a muonfn.Transform \(init, update\), got str",
    ),
    "partition of a list": (
        lambda: muonfn.partition([muonfn.scale_by_sign()], {}),  # type: ignore[arg-type]
        TypeError,
        r"partition: transforms must map labels to transforms, got list",
    ),
    "named by a number": (
        lambda: muonfn.named(1, muonfn.scale_by_sign()),  # type: ignore[arg-type]
        TypeError,
        r"named: name must be a non-empty string, got 1",
    ),
    "shard_specs a list": (
        lambda: simulate(1, lambda col: sharded_orthogonalizer(col, shard_specs=[MUON_WEIGHT])),  # type: ignore[arg-type]
        TypeError,
        r"shard_specs must be a mapping of names to ShardSpec, got list",
    ),
    "orthogonalizer not callable, shim": (
        lambda: shim(orthogonalizer="owner"),
        TypeError,
        r"orthogonalizer must be a muonfn.linalg.Orthogonalizer, got 'owner'",
    ),
    "compile keyword unknown": (
        lambda: shim(compile={"modes": "max-autotune"}),
        TypeError,
        r"Muon\(compile=...\): torch.compile has no keyword 'modes'; its keywords are \[.*'mode'",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_an_option_of_the_wrong_type_is_named_with_what_it_takes(case: str) -> None:
    build, error, match = WRONG_TYPES[case]
    with pytest.raises(error, match=match):
        build()


def test_a_state_that_is_no_tensordict_is_refused_naming_its_type() -> None:
    params = TensorDict({"w": torch.randn(4, 6), "b": torch.zeros(4)}, [])
    grads = params.apply(torch.ones_like)
    with pytest.raises(TypeError, match="state must be a TensorDict made by init, got list"):
        muonfn.muon(lr=0.01).update(grads, [1, 2], params)


def test_a_structure_that_passed_the_check_does_not_let_another_through() -> None:
    """The entry's check runs once per structure of its input: after a good step, a state whose entry
    changed shape, dtype or device is still refused, naming the entry, and nothing is written; the good
    state passes again."""
    params = TensorDict({"w": torch.randn(4, 6), "b": torch.zeros(4)}, [])
    grads = params.apply(torch.ones_like)
    tx = muonfn.muon(lr=0.01, donate_state=True)
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    bad_shape = state.clone()
    bad_shape["muon", "momentum", "w"] = torch.zeros(6, 4)
    bad_dtype = state.clone()
    bad_dtype["adamw", "exp_avg", "b"] = torch.zeros(4, dtype=torch.float64)
    bad_device = state.clone()
    bad_device["muon", "momentum", "w"] = torch.zeros(4, 6, device="meta")
    for bad, entry in ((bad_shape, "muon.momentum.w"), (bad_dtype, "adamw.exp_avg.b"), (bad_device, "muon.momentum.w")):
        before = bad.clone()
        with pytest.raises(ValueError, match=re.escape(f"state entry '{entry}'")):
            tx.update(grads, bad, params)
        assert_bitwise(bad, before)
    _, state = tx.update(grads, state, params)
    assert int(state["adamw", "step", "b"]) == 2


def test_apply_updates_checks_once_per_structure_and_lets_no_other_through() -> None:
    """``apply_updates`` and ``apply_updates_`` check once per structure of their two trees: after a good
    update, one of another shape, device or dtype (in place) is still refused, naming it, and nothing is
    written; the good one adds again."""
    params = TensorDict({"w": torch.zeros(4, 6), "b": torch.zeros(4)}, [])
    good = params.apply(torch.ones_like)
    for apply in (muonfn.apply_updates, muonfn.apply_updates_):
        params = apply(params, good)
        bad_shape = good.clone().set("w", torch.ones(6, 4))
        bad_device = good.clone().set("b", torch.ones(4, device="meta"))
        cases = [(bad_shape, r"update 'w' has shape \(6, 4\)"), (bad_device, r"update 'b' is on meta")]
        if apply is muonfn.apply_updates_:
            bad_dtype = good.clone().set("b", torch.ones(4, dtype=torch.complex64))
            cases.append((bad_dtype, r"update 'b' of dtype torch.complex64 cannot be added in place"))
        for bad, match in cases:
            before = params.clone()
            with pytest.raises(ValueError, match=match):
                apply(params, bad)
            assert_bitwise(params, before)
        params = apply(params, good)
    assert_bitwise(params, TensorDict({"w": torch.full((4, 6), 4.0), "b": torch.full((4,), 4.0)}, []))


def test_local_orthogonalizer_refuses_a_gpu_form_that_is_no_flag() -> None:
    with pytest.raises(TypeError, match="gpu_form must be True, False or None, got 'yes'"):
        muonfn.LocalOrthogonalizer(gpu_form="yes")  # type: ignore[arg-type]
    assert (
        repr(muonfn.LocalOrthogonalizer(gpu_form=True)) == "LocalOrthogonalizer(bucket_numel=67108864, gpu_form=True)"
    )
