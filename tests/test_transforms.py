"""The building blocks, each against its formula written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from _bitwise import assert_bitwise
from _strategies import (
    assert_batched_as_alone,
    assert_td_equal,
    bmm_batch_consistent,
    gaussian,
    iteration_dtype,
    random_like,
)
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

import muonfn
from muonfn import MatrixView, newton_schulz

F64 = torch.float64


def td(**leaves: torch.Tensor) -> TensorDict:
    return TensorDict(leaves, batch_size=[])


def step(tx: muonfn.Transform, grads: TensorDict, state: TensorDict, params: TensorDict | None = None):
    return tx.update(grads, state, params)


# --- ema_momentum -----------------------------------------------------------------------------------


@pytest.mark.parametrize("nesterov", [True, False])
def test_ema_momentum_matches_closed_form(nesterov: bool, device: torch.device) -> None:
    mu = 0.9
    params = td(w=torch.zeros(3, 4, dtype=F64), b=torch.zeros(5, dtype=F64)).to(device)
    tx = muonfn.ema_momentum(mu, nesterov=nesterov)
    state = tx.init(params)
    grads = [random_like(params, seed=t).to(device) for t in range(4)]
    for g in grads:
        updates, state = step(tx, g, state)
    for key in ("w", "b"):
        buf = sum((1 - mu) * mu ** (3 - t) * grads[t][key] for t in range(4))
        torch.testing.assert_close(state["momentum", key], buf, rtol=1e-14, atol=1e-15)
        expected = (1 - mu) * grads[-1][key] + mu * buf if nesterov else buf
        torch.testing.assert_close(updates[key], expected, rtol=1e-14, atol=1e-15)


def test_ema_momentum_keeps_the_param_dtype_and_reads_a_tensor_momentum_each_step(device: torch.device) -> None:
    params = td(w=torch.zeros(2, 3, dtype=torch.bfloat16)).to(device)
    mu = torch.tensor(0.5)
    tx = muonfn.ema_momentum(mu, nesterov=False)
    state = tx.init(params)
    assert state["momentum", "w"].dtype == torch.bfloat16
    ones = params.apply(torch.ones_like)
    _, state = step(tx, ones, state)
    assert torch.equal(state["momentum", "w"], torch.full((2, 3), 0.5, dtype=torch.bfloat16, device=device))
    mu.fill_(0.0)  # changed in place: the next step uses it
    updates, state = step(tx, ones.mul(3), state)
    assert torch.equal(updates["w"], torch.full((2, 3), 3.0, dtype=torch.bfloat16, device=device))


# --- elementwise arithmetic: the bits of one op per leaf -----------------------------------------------

NUMBERS = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_subnormal=False).filter(lambda v: v != 0)
SHAPES = [(), (1,), (7,), (3, 5), (17, 9), (2, 3, 4)]


def leaves(dtype: torch.dtype, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return td(**{f"l{i}": torch.randn(s, generator=g, dtype=F64).mul(10).to(dtype) for i, s in enumerate(SHAPES)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@given(value=NUMBERS)
def test_a_number_gives_the_bits_of_one_op_per_leaf(dtype: torch.dtype, value: float) -> None:
    """The learning rate's product and the decay's multiply-add run for all leaves in one
    multi-tensor call: each leaf gets the bits of its own op with the number."""
    grads, params = leaves(dtype), leaves(dtype, seed=1)
    scaled, _ = step(muonfn.scale_by_learning_rate(abs(value)), grads, TensorDict())
    assert_bitwise(scaled, grads.apply(lambda g: g.mul(-abs(value))))
    decayed, _ = step(muonfn.add_decayed_weights(abs(value)), grads, TensorDict(), params)
    assert_bitwise(decayed, grads.apply(lambda g, p: g.add(p, alpha=abs(value)), params))


@given(value=NUMBERS)
def test_a_double_zero_dim_tensor_meets_fp32_leaves_as_the_number_it_holds(value: float) -> None:
    """fp32 leaves and an fp64 0-d tensor (the shim's hyperparameters): the bits of the Python
    number, a 0-d leaf included (which the tensor alone would promote to fp64)."""
    grads, params = leaves(torch.float32, seed=1), leaves(torch.float32, seed=2)
    rate = torch.tensor(abs(value), dtype=F64)
    scaled, _ = step(muonfn.scale_by_learning_rate(rate), grads, TensorDict())
    assert_bitwise(scaled, grads.apply(lambda g: g.mul(-abs(value))))
    decayed, _ = step(muonfn.add_decayed_weights(rate), grads, TensorDict(), params)
    assert_bitwise(decayed, grads.apply(lambda g, p: g.add(p, alpha=abs(value)), params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@given(momentum=st.floats(min_value=0.0, max_value=0.999))
def test_momentum_is_one_lerp_per_leaf_for_a_number_or_a_host_tensor(dtype: torch.dtype, momentum: float) -> None:
    """``b.lerp(g, 1 - μ)`` and the look-ahead ``g.lerp(b, μ)`` in one multi-tensor call each: the
    bits of one lerp per leaf; a float64 0-d tensor on the host holding μ gives the same bits."""
    params = leaves(dtype)
    first, second = leaves(dtype, seed=2), leaves(dtype, seed=3)
    for mu in (momentum, torch.tensor(momentum, dtype=F64)):
        tx = muonfn.ema_momentum(mu)
        _, state = step(tx, first, tx.init(params))
        updates, new = step(tx, second, state)
        buffer = state["momentum"].apply(lambda b, g: b.lerp(g, 1 - momentum), second)
        assert_bitwise(new["momentum"], buffer)
        assert_bitwise(updates, second.apply(lambda g, b: g.lerp(b, momentum), buffer))


def test_leaves_of_several_dtypes_keep_their_own_arithmetic() -> None:
    grads = td(a=torch.ones(3), b=torch.ones(3, dtype=F64), c=torch.ones(3, dtype=torch.bfloat16))
    out, _ = step(muonfn.scale_by_learning_rate(0.1), grads, TensorDict())
    assert_bitwise(out, grads.apply(lambda g: g.mul(-0.1)))


# --- orthogonalize -----------------------------------------------------------------------------------


def test_orthogonalize_is_newton_schulz_per_leaf() -> None:
    bitwise = bmm_batch_consistent(16, 24, 3)
    grads = td(a=gaussian(16, 24, seed=1), b=gaussian(16, 24, seed=2), c=gaussian(24, 16, seed=3))
    for name in ("keller", "polar_express"):
        tx = muonfn.orthogonalize(muonfn.NewtonSchulz(name, steps=4))
        out, _ = step(tx, grads, tx.init(grads))
        for key in ("a", "b", "c"):  # a and b share a batched call; c's orientation differs
            assert_batched_as_alone(out[key], newton_schulz(grads[key], name, steps=4), bitwise=bitwise)


def test_orthogonalize_buckets_do_not_change_the_result() -> None:
    grads = td(**{f"w{i}": gaussian(16, 24, seed=i) for i in range(5)})
    bitwise = all(bmm_batch_consistent(16, 24, batch) for batch in (5, 2))  # buckets of 1 and 2 against 5
    whole, _ = step(muonfn.orthogonalize(), grads, TensorDict())
    for cap in (1, 16 * 24 * 2):
        tx = muonfn.orthogonalize(orthogonalizer=muonfn.LocalOrthogonalizer(bucket_numel=cap))
        chunked, _ = step(tx, grads, TensorDict())
        for key, value in whole.items():
            assert_batched_as_alone(chunked[key], value, bitwise=bitwise)


def test_orthogonalize_may_store_its_results_in_the_updates_it_is_given() -> None:
    """``overwrite_input=True``: in a GPU's form (asked for here on the CPU) a wide matrix's result
    is written into the update it came from and returned as it, with the bits of a new tensor; not
    under ``vmap``, not where autograd records the updates, and not without the option. Any other
    value than a bool is refused."""
    gpu = muonfn.LocalOrthogonalizer(gpu_form=True)
    ns = muonfn.NewtonSchulz(dtype=torch.bfloat16)
    grads = td(w=gaussian(12, 20, seed=61), t=gaussian(20, 12, seed=62), conv=gaussian(8, 4, 3, 3, seed=63))
    expected, _ = step(muonfn.orthogonalize(ns, orthogonalizer=gpu), grads, TensorDict())
    given = grads.clone()
    tx = muonfn.orthogonalize(ns, orthogonalizer=gpu, overwrite_input=True)
    out, _ = step(tx, given, TensorDict())
    assert_td_equal(out, expected)
    assert out["w"].data_ptr() == given["w"].data_ptr()  # (the tall one's copy back would take a kernel per matrix)
    given = grads.clone()
    out, _ = step(muonfn.orthogonalize(ns, orthogonalizer=gpu), given, TensorDict())
    assert out["w"].data_ptr() != given["w"].data_ptr() and torch.equal(given["w"], grads["w"])
    given = grads.clone().requires_grad_()
    with torch.enable_grad():
        out, _ = step(tx, given, TensorDict())
    assert out["w"].data_ptr() != given["w"].data_ptr() and torch.equal(given["w"], grads["w"])
    assert out["w"].requires_grad
    assert_td_equal(out.detach(), expected)  # (recorded, the product is rounded as it is when stored)
    members = torch.stack([grads, grads.apply(lambda x: -x)])
    mapped = members.clone()
    out = torch.vmap(lambda g: tx.update(g, TensorDict(), None)[0])(mapped)
    assert_td_equal(mapped, members)
    with pytest.raises(TypeError, match="orthogonalize: overwrite_input must be True or False"):
        muonfn.orthogonalize(overwrite_input=1)  # type: ignore[arg-type]


def test_conv_weights_are_flattened_and_scaled_by_the_flattened_shape() -> None:
    g = gaussian(8, 4, 3, 3, seed=4)
    tx = muonfn.orthogonalize(scale="original")
    out, _ = step(tx, td(conv=g), TensorDict())
    flat = g.reshape(8, 36)
    ns = muonfn.NewtonSchulz()
    expected = ns.orthogonalize(flat, scale=math.sqrt(max(1.0, 8 / 36)))
    assert torch.equal(out["conv"], expected.reshape(8, 4, 3, 3))
    out, _ = step(muonfn.orthogonalize(scale="match_rms_adamw"), td(conv=g), TensorDict())
    assert torch.equal(out["conv"], ns.orthogonalize(flat, scale=0.2 * 6.0).reshape(8, 4, 3, 3))


def test_experts_are_separate_matrices() -> None:
    experts = gaussian(3, 12, 20, seed=5)
    view = {"moe": MatrixView(batch_dims=1)}
    tx = muonfn.orthogonalize(views=view, scale="spectral")
    out, _ = step(tx, td(moe=experts), tx.init(td(moe=experts)))
    separate = td(**{f"e{i}": experts[i] for i in range(3)})
    singles, _ = step(muonfn.orthogonalize(scale="spectral"), separate, TensorDict())
    expected = torch.stack([singles[f"e{i}"] for i in range(3)])
    torch.testing.assert_close(out["moe"], expected, atol=1e-6, rtol=0)
    # the scale is the expert's (12, 20), not the stacked (36, 20); the scale joins the iteration's
    # last step, so the two norms are its rounding apart: fp32's, or a 16-bit dtype's unit
    rel = max(1e-5, torch.finfo(iteration_dtype((12, 20))).eps)
    assert out["moe"].norm() / newton_schulz(experts).norm() == pytest.approx(math.sqrt(20), rel=rel)


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_map_that_hands_its_input_back_leaves_the_state_and_gradients_alone(nesterov: bool) -> None:
    # a stack of experts is its own Newton–Schulz call, so the map is given the leaf itself
    # (without Nesterov, the new momentum), which the shape scale, decay and lr must not write into
    experts, grads = gaussian(3, 12, 20, seed=5), td(moe=gaussian(3, 12, 20, seed=6))
    kept = grads.clone()
    tx = muonfn.muon(
        lr=0.1, weight_decay=0.1, nesterov=nesterov, ns=lambda x: x, views={"moe": MatrixView(batch_dims=1)}
    )
    state = tx.init(td(moe=experts))
    updates, state = tx.update(grads, state, td(moe=experts))
    assert_td_equal(grads, kept)
    momentum = 0.05 * kept["moe"]  # lerp from zero
    torch.testing.assert_close(state["muon", "momentum", "moe"], momentum, atol=0, rtol=0)
    direction = momentum.lerp(kept["moe"], 0.05) if nesterov else momentum
    expected = -0.1 * (0.2 * math.sqrt(20) * direction + 0.1 * experts)
    torch.testing.assert_close(updates["moe"], expected)


@pytest.mark.parametrize("scale", ["original", "unit_rms_norm", "match_rms_adamw"])
def test_fused_qkv_equals_separate_q_k_v(scale: str) -> None:
    """GQA: q has 4 heads, k and v one each (head dim 8), all from 16 inputs."""
    q, k, v = gaussian(32, 16, seed=6), gaussian(8, 16, seed=7), gaussian(8, 16, seed=8)
    tx = muonfn.orthogonalize(views={"qkv": MatrixView(split=(32, 8, 8))}, scale=scale)
    fused, _ = step(tx, td(qkv=torch.cat([q, k, v])), TensorDict())
    separate, _ = step(muonfn.orthogonalize(scale=scale), td(q=q, k=k, v=v), TensorDict())
    assert torch.equal(fused["qkv"], torch.cat([separate["q"], separate["k"], separate["v"]]))
    whole, _ = step(muonfn.orthogonalize(scale=scale), td(qkv=torch.cat([q, k, v])), TensorDict())
    assert not torch.allclose(fused["qkv"], whole["qkv"], atol=1e-3)  # splitting matters


@pytest.mark.parametrize("scale", ["original", "unit_rms_norm"])
def test_transposed_storage_gives_the_transpose(scale: str) -> None:
    """A (in, out)-stored weight is the transpose of the (out, in) one, asymmetric scale included."""
    w = gaussian(24, 10, seed=9)  # logical (out, in) = (24, 10)
    logical, _ = step(muonfn.orthogonalize(scale=scale), td(w=w), TensorDict())
    tx = muonfn.orthogonalize(views={"w": MatrixView(transposed=True)}, scale=scale)
    stored, _ = step(tx, td(w=w.mT.contiguous()), TensorDict())
    torch.testing.assert_close(stored["w"], logical["w"].mT, atol=1e-5, rtol=0)  # other memory layout
    plain, _ = step(muonfn.orthogonalize(scale=scale), td(w=w.mT.contiguous()), TensorDict())
    assert not torch.allclose(plain["w"], logical["w"].mT, atol=1e-3)  # the declaration matters


# --- scale_by_shape and scale_by_muon ---------------------------------------------------------------


def test_scale_by_shape_factors() -> None:
    grads = td(tall=torch.ones(64, 16), wide=torch.ones(16, 64), conv=torch.ones(8, 4, 3, 3))
    out, _ = step(muonfn.scale_by_shape(("original", 3.0)), grads, TensorDict())
    assert out["tall"].unique().tolist() == [6.0]
    assert out["wide"].unique().tolist() == [3.0]
    assert out["conv"].unique().tolist() == [3.0]
    out, _ = step(muonfn.scale_by_shape("unit_rms_norm"), grads, TensorDict())
    assert out["wide"].unique().tolist() == [0.5]
    views = {"tall": MatrixView(split=(48, 16))}
    out, _ = step(muonfn.scale_by_shape("original", views=views), grads, TensorDict())
    assert out["tall"][:48].unique().tolist() == [pytest.approx(math.sqrt(3))]
    assert out["tall"][48:].unique().tolist() == [1.0]


VIEWS = {
    "qkv": MatrixView(split=(16, 4, 4)),
    "conv1d": MatrixView(transposed=True),
    "experts": MatrixView(batch_dims=1),
}


def model_like() -> TensorDict:
    return td(
        qkv=gaussian(24, 16, seed=10),
        conv1d=gaussian(16, 40, seed=11),
        experts=gaussian(2, 8, 16, seed=12),
        conv=gaussian(6, 3, 2, 2, seed=13),
        plain=gaussian(16, 24, seed=14),
    )


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", ["match_rms_adamw", "original", "unit_rms_norm"])
def test_scale_by_muon_is_momentum_then_newton_schulz_then_shape_scale(
    scale: str, ns_dtype: torch.dtype, device: torch.device
) -> None:
    params = model_like().to(device)
    ns = muonfn.NewtonSchulz("cesista", dtype=ns_dtype)
    fused = muonfn.scale_by_muon(0.9, nesterov=True, ns=ns, scale=(scale, 0.7), views=VIEWS)
    parts = muonfn.chain(
        muonfn.ema_momentum(0.9, nesterov=True),
        muonfn.orthogonalize(ns, views=VIEWS),
        muonfn.scale_by_shape((scale, 0.7), views=VIEWS),
    )
    s1, s2 = fused.init(params), parts.init(params)
    assert_td_equal(s1, s2)
    for t in range(3):
        grads = random_like(params, seed=100 + t).to(device)
        u1, s1 = step(fused, grads, s1)
        u2, s2 = step(parts, grads, s2)
        assert_td_equal(s1, s2)
        for key, expected in u2.items(True, True):
            # the scale taken by the last Newton–Schulz step (its coefficients times the scale,
            # rounded, and the step's sums over them, in the Newton–Schulz dtype): within a few
            # roundings of that dtype of the product after it (seen: 8.5 fp32 eps without ATen's
            # AVX kernels, 0.9 bf16 eps)
            bound = 16 * torch.finfo(ns_dtype).eps * expected.abs().max().item()
            torch.testing.assert_close(u1[key], expected, atol=bound, rtol=0, msg=str(key))


# --- scale_by_adam ------------------------------------------------------------------------------------


def test_scale_by_adam_matches_the_formula_with_per_leaf_steps(device: torch.device) -> None:
    b1, b2, eps = 0.8, 0.95, 1e-6
    params = td(w=torch.zeros(3, 4, dtype=F64), b=torch.zeros(4, dtype=F64)).to(device)
    tx = muonfn.scale_by_adam(b1, b2, eps=eps)
    state = tx.init(params)
    seen: dict[str, list[torch.Tensor]] = {"w": [], "b": []}
    for t in range(5):
        grads = random_like(params, seed=t).to(device)
        if t in (1, 2):  # "b" has no gradient on two steps
            grads = grads.exclude("b")
        updates, state = step(tx, grads, state)
        for key in grads.keys():  # (iterating a TensorDict walks its batch dimension)
            seen[key].append(grads[key])
            n = len(seen[key])
            m = sum((1 - b1) * b1 ** (n - 1 - i) * g for i, g in enumerate(seen[key]))
            v = sum((1 - b2) * b2 ** (n - 1 - i) * g * g for i, g in enumerate(seen[key]))
            expected = (m / (1 - b1**n)) / ((v / (1 - b2**n)).sqrt() + eps)
            torch.testing.assert_close(updates[key], expected, rtol=1e-12, atol=1e-14)
        assert set(updates.keys()) == set(grads.keys())
    assert int(state["step", "w"]) == 5 and int(state["step", "b"]) == 3
    assert state["step", "w"].dtype == torch.int64


def test_step_counts_are_new_tensors_or_counted_up_in_place() -> None:
    """A functional update returns new counts and leaves the given ones as they were; a donated
    update counts each leaf's own tensor up, also when the counts it is given came from a
    functional update (views of one stack)."""
    params = td(w=torch.zeros(3, 4, dtype=F64), b=torch.zeros(4, dtype=F64))
    grads = random_like(params, seed=1)
    functional, donated = muonfn.scale_by_adam(), muonfn.scale_by_adam(donate_state=True)
    given = functional.init(params)
    _, state = functional.update(grads, given, None)
    assert [int(given["step", k]) for k in ("w", "b")] == [0, 0]
    assert [int(state["step", k]) for k in ("w", "b")] == [1, 1]
    counts = [state["step", k] for k in ("w", "b")]
    _, state = donated.update(grads.exclude("b"), state, None)
    assert state["step", "w"] is counts[0] and [int(c) for c in counts] == [2, 1]
    _, state = donated.update(grads, state, None)
    assert [int(state["step", k]) for k in ("w", "b")] == [3, 2]


# --- add_decayed_weights --------------------------------------------------------------------------------


def test_decayed_weights_and_masks(device: torch.device) -> None:
    params = td(w=torch.full((2, 2), 2.0), norm=torch.full((2,), 3.0), bias=torch.full((2,), 5.0)).to(device)
    grads = params.apply(torch.ones_like)
    everything, _ = step(muonfn.add_decayed_weights(0.1), grads, TensorDict(), params)
    assert_td_equal(everything, grads + params * 0.1)
    # a partial mapping exempts what it maps to False; everything else still decays
    exempt, _ = step(muonfn.add_decayed_weights(0.1, mask={"norm": False, "bias": False}), grads, TensorDict(), params)
    assert torch.equal(exempt["w"], everything["w"])
    assert torch.equal(exempt["norm"], grads["norm"]) and torch.equal(exempt["bias"], grads["bias"])
    by_rank = muonfn.add_decayed_weights(0.1, mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()})
    out, _ = step(by_rank, grads, TensorDict(), params)
    assert_td_equal(out, exempt)
    wd = torch.tensor(0.1)
    out, _ = step(muonfn.add_decayed_weights(wd), grads, TensorDict(), params)
    assert_td_equal(out, everything)
    wd.fill_(0.0)
    out, _ = step(muonfn.add_decayed_weights(wd), grads, TensorDict(), params)
    assert_td_equal(out, grads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_decay_is_one_multiply_add(dtype: torch.dtype) -> None:
    """u + λp is one ``add(alpha=λ)``, rounded once: λ a number, or a float64 0-d tensor on the
    host holding it (the shim's, refilled each step, read as the number), give the same bits, so
    the shim gives the functional update's bits."""
    g = torch.Generator().manual_seed(5)
    params = td(w=torch.randn(64, 32, generator=g), b=torch.randn(32, generator=g)).to(dtype)
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g).to(dtype))
    expected = grads.apply(lambda u, p: torch.add(u, p, alpha=0.1), params)
    for wd in (0.1, torch.tensor(0.1, dtype=torch.float64)):
        out, _ = step(muonfn.add_decayed_weights(wd), grads.clone(), TensorDict(), params)
        assert_td_equal(out, expected)
    if dtype == torch.float64:  # and λ itself is not rounded to fp32 on the way
        torch.testing.assert_close(expected, grads + params * 0.1, rtol=1e-15, atol=1e-15)


def test_a_decay_that_autograd_records_is_written_out_and_added() -> None:
    """A λ that stays a tensor (here one that autograd records) has λp written out, rounded, and
    added, and the update records it."""
    g = torch.Generator().manual_seed(5)
    params = td(w=torch.randn(64, 32, generator=g), b=torch.randn(32, generator=g))
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
    wd = torch.tensor(0.1, requires_grad=True)
    with torch.enable_grad():
        out, _ = step(muonfn.add_decayed_weights(wd), grads.clone(), TensorDict(), params)
    assert all(u.requires_grad for u in out.values())
    assert_td_equal(out.detach(), grads.apply(lambda u, p: u + p * wd.detach(), params))


def test_decay_only_touches_leaves_with_gradients() -> None:
    params = td(w=torch.full((2, 2), 2.0), b=torch.full((2,), 3.0))
    out, _ = step(muonfn.add_decayed_weights(0.5), td(w=torch.zeros(2, 2)), TensorDict(), params)
    assert set(out.keys()) == {"w"} and out["w"].unique().tolist() == [1.0]


@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize("weight_decay", [0.1, torch.tensor(0.1), torch.tensor(0.1, dtype=torch.float64)])
def test_a_scalar_leaf_keeps_its_dtype_whatever_the_weight_decay(weight_decay, cautious: bool) -> None:
    half = torch.bfloat16
    grads = td(gain=torch.tensor(0.3, dtype=half), w=torch.full((3,), 0.3, dtype=half))
    params = td(gain=torch.tensor(0.7, dtype=half), w=torch.full((3,), 0.7, dtype=half))
    tx = muonfn.add_decayed_weights(weight_decay, cautious=cautious)
    out, _ = tx.update(grads.clone(), tx.init(params), params)
    assert out["gain"].dtype == half and out["w"].dtype == half
    assert torch.equal(out["gain"], out["w"][0])


# --- scale_by_learning_rate --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lr", [0.1, torch.tensor(0.1), torch.tensor(0.1, dtype=torch.float64), lambda count: 0.1 / (1 + count)]
)
def test_a_scalar_leaf_keeps_its_dtype_whatever_the_learning_rate(lr) -> None:
    """A 0-d bf16 update meets a 0-d fp32/fp64 learning rate as an equal, and torch would promote
    it; the update keeps the leaf's dtype, with the bits of the in-place product."""
    grads = td(gain=torch.tensor(0.3, dtype=torch.bfloat16), w=torch.full((3,), 0.3, dtype=torch.bfloat16))
    tx = muonfn.scale_by_learning_rate(lr)
    out, _ = step(tx, grads.clone(), tx.init(grads))
    assert out["gain"].dtype == torch.bfloat16 and out["w"].dtype == torch.bfloat16
    assert torch.equal(out["gain"], out["w"][0])


def test_learning_rate_float_tensor_and_schedule(device: torch.device) -> None:
    grads = td(w=torch.ones(3)).to(device)
    out, _ = step(muonfn.scale_by_learning_rate(0.25), grads, TensorDict())
    assert out["w"].tolist() == [-0.25] * 3
    lr = torch.tensor(0.5)
    tx = muonfn.scale_by_learning_rate(lr)
    assert step(tx, grads, TensorDict())[0]["w"].tolist() == [-0.5] * 3
    lr.fill_(0.125)
    assert step(tx, grads, TensorDict())[0]["w"].tolist() == [-0.125] * 3

    seen = []

    def schedule(count: torch.Tensor) -> torch.Tensor:
        seen.append(int(count))
        return 0.5**count

    tx = muonfn.scale_by_learning_rate(schedule)
    state = tx.init(grads)
    for t in range(4):
        out, state = step(tx, grads, state)
        assert out["w"].tolist() == [-(0.5**t)] * 3
    assert seen == [0, 1, 2, 3] and int(state["count"]) == 4


def test_a_momentum_that_requires_grad_is_differentiated_through() -> None:
    """A 0-d momentum that requires grad stays a tensor in the step (hypergradients): with
    nesterov=False, b₂ = μ(1−μ)g₁ + (1−μ)g₂, so ∂b₂/∂μ = (1−2μ)g₁ − g₂."""
    mu = torch.tensor(0.9, requires_grad=True)
    tx = muonfn.ema_momentum(mu, nesterov=False)
    params = TensorDict({"w": torch.zeros(3)}, [])
    state = tx.init(params)
    _, state = tx.update(TensorDict({"w": torch.ones(3)}, []), state, params)
    updates, _ = tx.update(TensorDict({"w": torch.full((3,), 2.0)}, []), state, params)
    assert torch.allclose(updates["w"], torch.full((3,), 0.9 * 0.1 + 0.1 * 2.0))
    updates["w"].sum().backward()
    assert torch.allclose(mu.grad, torch.tensor(3 * ((1 - 2 * 0.9) * 1.0 - 2.0)))
