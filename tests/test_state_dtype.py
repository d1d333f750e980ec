"""The state kept in bf16 (``state_dtype=torch.bfloat16``): what stochastic rounding promises, and
the guarantees of the fp32 state (donation, vmap, compile, checkpoints, layouts) kept.
``tests/test_reference.py`` holds the fast path to ``muonfn.reference.kept``, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

import muonfn
from muonfn import stochastic_round

BF16 = torch.bfloat16


def params_and_grads(steps: int, members: int = 0) -> tuple[TensorDict, list[TensorDict]]:
    g = torch.Generator().manual_seed(0)
    shapes = {"h.0.w": (12, 8), "h.1.w": (8, 8), "h.0.b": (12,), "norm": (8,)}
    batch = [members] if members else []
    params = TensorDict({k: torch.randn(*batch, *s, generator=g) for k, s in shapes.items()}, batch)
    grads = [
        TensorDict({k: torch.randn(*batch, *s, generator=g) for k, s in shapes.items()}, batch) for _ in range(steps)
    ]
    return params, grads


def run(tx: muonfn.Transform, params: TensorDict, grads: list[TensorDict]) -> tuple[TensorDict, TensorDict]:
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = muonfn.apply_updates(params, updates)
    return params, state


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values on either side of each fp32 entry: truncated toward zero, and one bf16 step away."""
    toward = (x.view(torch.int32) & -0x10000).view(torch.float32)
    away = ((x.view(torch.int32) & -0x10000) + 0x10000).view(torch.float32)
    return toward, away


@given(st.floats(min_value=-(2.0**100), max_value=2.0**100, width=32).filter(lambda v: abs(v) > 2.0**-100))
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased_over_keys(value: float) -> None:
    """Over 4096 keys each result is one of the two bf16 neighbours, and their mean is the value
    within 5 standard deviations of a fair draw (one bf16 step times ½/√4096)."""
    x = torch.full((4096,), value)
    got = stochastic_round(x, torch.arange(4096, dtype=torch.int32)).float()
    toward, away = neighbours(x)
    assert ((got == toward) | (got == away)).all()
    step = (away - toward).abs()[0].double()
    assert abs(got.double().mean() - x[0].double()) <= 5 * step * 0.5 / 64


def test_a_bf16_value_passes_through_unchanged() -> None:
    x = torch.randn(1000).bfloat16().float()
    assert torch.equal(stochastic_round(x, 7).float(), x)


def test_the_bf16_second_moment_keeps_growing_where_round_to_nearest_stalls() -> None:
    """Adam's v with β₂ = 0.999 and a constant gradient of 1 is 1 − 0.999ᵗ. Rounded to nearest in bf16
    it stops near 0.25, where 0.001·(1 − v) falls below half a bf16 step; rounded stochastically it
    follows the fp32 value within 2 %."""
    params = TensorDict({"b": torch.zeros(64)}, [])
    grads = TensorDict({"b": torch.ones(64)}, [])
    tx = muonfn.scale_by_adam(0.9, 0.999, state_dtype=BF16)
    state = tx.init(params)
    nearest = torch.zeros(64, dtype=BF16)
    for _ in range(3000):
        _, state = tx.update(grads, state, params)
        nearest = (nearest.float() * 0.999 + 0.001).to(BF16)
    exact = 1 - 0.999**3000
    assert state["exp_avg_sq", "b"].dtype == BF16
    assert abs(state["exp_avg_sq", "b"].float().mean().item() - exact) < 0.02 * exact
    assert nearest.float().mean().item() < 0.5 * exact


def test_the_state_takes_half_the_bytes() -> None:
    """2 bytes per Muon parameter (the momentum), 4 per AdamW parameter (two moments), and one int64
    count per leaf."""
    params, _ = params_and_grads(0)
    wide, narrow = (muonfn.muon(lr=0.01, state_dtype=d).init(params) for d in (None, BF16))

    def nbytes(state: TensorDict, branch: str, entries: tuple[str, ...]) -> int:
        return sum(t.nbytes for e in entries for t in state[branch, e].values())

    assert nbytes(narrow, "muon", ("momentum",)) * 2 == nbytes(wide, "muon", ("momentum",))
    moments = ("exp_avg", "exp_avg_sq")
    assert nbytes(narrow, "adamw", moments) * 2 == nbytes(wide, "adamw", moments)
    assert nbytes(narrow, "muon", ("step",)) == 8 * len(narrow["muon", "momentum"].keys())


@pytest.mark.parametrize("value", ["int8", torch.float16, torch.int8, torch.float64, "bfloat16"], ids=lambda v: str(v))
@pytest.mark.parametrize(
    "make", [muonfn.muon, muonfn.adamuon, muonfn.adamw, muonfn.ema_momentum], ids=lambda f: f.__name__
)
def test_another_state_dtype_is_refused_when_the_transform_is_built(make, value) -> None:
    with pytest.raises(ValueError, match=r"state_dtype must be None, torch.float32 or torch.bfloat16, got"):
        make(state_dtype=value)


def test_donated_equals_not_donated_bitwise() -> None:
    params, grads = params_and_grads(5)
    expected = run(muonfn.muon(lr=0.02, state_dtype=BF16), params, grads)
    got = run(muonfn.muon(lr=0.02, state_dtype=BF16, donate_state=True), params, grads)
    for a, b in zip(got, expected):
        assert (a == b).all()


def test_a_vmapped_ensemble_rounds_each_member_as_its_own_run() -> None:
    """Members of a vmapped ensemble keep the state an unbatched run of each member keeps."""
    params, grads = params_and_grads(4, members=2)
    tx = muonfn.adamw(lr=0.01, state_dtype=BF16)
    state, update = torch.vmap(tx.init)(params), torch.vmap(tx.update)
    for g in grads:
        _, state = update(g, state, params)
    for i in range(2):
        _, alone = run(tx, params[i], [g[i] for g in grads])
        for key in ("exp_avg", "exp_avg_sq"):
            assert (state[key][i] == alone[key]).all(), (i, key)


def test_a_row_block_of_a_leaf_keeps_the_rows_of_the_whole() -> None:
    """The elementwise state of a shard (rows of a leaf, under the leaf's name) is the whole's rows,
    bit for bit: the rounding depends on the entry's value, never on its place."""
    params, grads = params_and_grads(4)
    tx = muonfn.adamw(lr=0.01, state_dtype=BF16)
    _, whole = run(tx, params, grads)
    rows = slice(3, 9)
    _, part = run(tx, params.apply(lambda t: t[rows]), [g.apply(lambda t: t[rows]) for g in grads])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(part[key, "h.0.w"], whole[key, "h.0.w"][rows])


def test_compiled_update_keeps_the_eager_state() -> None:
    """fullgraph: the rounding traces (its hashing is exact integer arithmetic under inductor). The fp32
    arithmetic before it may round an ulp apart once fused, and an ulp apart the hash draws anew: the
    compiled state stays within one bf16 step of the largest entry per update of the eager state."""
    params, grads = params_and_grads(3)
    tx = muonfn.muon(lr=0.02, state_dtype=BF16, ns=muonfn.NewtonSchulz("cesista"))
    compiled = torch.compile(tx.update, fullgraph=True)
    eager_state = compiled_state = tx.init(params)
    for g in grads:
        _, eager_state = tx.update(g, eager_state, params)
        _, compiled_state = compiled(g, compiled_state, params)
        for key, eager in eager_state.items(True, True):
            got = compiled_state[key]
            assert got.dtype == eager.dtype
            if eager.is_floating_point():
                bound = len(grads) * 2**-7 * eager.float().abs().max()
                assert (got.float() - eager.float()).abs().max() <= bound, key
            else:
                assert torch.equal(got, eager), key


def test_save_and_load_round_trip_the_bf16_state_bit_for_bit(tmp_path) -> None:
    params, grads = params_and_grads(3)
    tx = muonfn.muon(lr=0.02, state_dtype=BF16)
    _, state = run(tx, params, grads)
    muonfn.save(state, tmp_path / "state.pt")
    loaded = muonfn.load(tmp_path / "state.pt", like=tx.init(params))
    assert loaded["muon", "momentum", "h.0.w"].dtype == BF16
    assert (loaded == state).all()
    # and the run continues from it as from the state in memory
    assert (tx.update(grads[0], loaded, params)[1] == tx.update(grads[0], state, params)[1]).all()


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("make", [muonfn.muon, muonfn.adamuon], ids=lambda f: f.__name__)
def test_bf16_parameters_keep_the_state_in_state_dtype_and_their_updates_in_their_own(make, state_dtype) -> None:
    """A bf16 model with an fp32 state (a master state) or a bf16 one: the state in ``state_dtype``,
    computed in fp32; the updates in the parameters' dtype."""
    params, grads = params_and_grads(3)
    params, grads = params.to(BF16), [g.to(BF16) for g in grads]
    options = {"second_moment_bias_correction": True} if make is muonfn.adamuon else {}
    tx = make(lr=0.02, state_dtype=state_dtype, **options)
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        assert all(u.dtype == BF16 and u.isfinite().all() for u in updates.values(True, True))
    assert state["muon", "momentum", "h.0.w"].dtype == state["adamw", "exp_avg_sq", "norm"].dtype == state_dtype
