"""muonfn.reference as the oracle: every fast path computes what ``muonfn.reference.step`` computes.

Three kinds of comparison, each test named for its kind:

- ``..._bitwise_with_the_same_newton_schulz``: the fast path runs the reference's own
  Newton–Schulz on each matrix alone (``ns=``), so both sides do the same arithmetic
  in the same order: the Muon parameters and all moments are equal bit for bit. What
  is left to differ is how the fast paths stack, bucket, shard, transpose, scale, decay and
  apply, which must not change a bit.
- ``..._bitwise``: the same arithmetic by construction (AdamW against ``torch.optim.AdamW``;
  muonfn's Newton–Schulz one matrix per call, run inside the reference).
- ``..._within_...``: the fast path batches Newton–Schulz's matmuls over matrices of one shape
  (BLAS may round a batch differently from one matrix) or runs them as ``baddbmm`` (which may
  round ``b·A + c·A²`` differently from the reference's separate products). A difference of
  rounding in a direction of small singular value is amplified by the slope of the iteration
  at 0, the product of its ``a`` coefficients (Keller's: 3.4445⁵ ≈ 486), hence
  :data:`NS_ATOL`; a parameter takes ``lr·s`` of it per step, hence :func:`muon_atol`.

The AdamW parameters are within :func:`assert_adamw_close` everywhere but against
``torch.optim.AdamW``: muonfn's AdamW computes ``m / ((√v + ε√c₂)·(−c₁/(η√c₂)))`` and subtracts ``ηλp``,
the reference and torch compute ``m / (√v/√c₂ + ε)`` after multiplying ``p`` by ``1 − ηλ``;
their moments are the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import muonfn
from muonfn import reference
from muonfn.distributed import ShardSpec, sharded_orthogonalizer
from muonfn.optim import Muon
from muonfn.testing import SimulatedCollectives, simulate

Params = dict[str, torch.Tensor]

#: square pair (one Newton–Schulz batch), tall and wide transposes of each other (one batch
#: under muonfn's orientation by shape), a conv kernel read as (8, 12), and AdamW vectors
SHAPES: dict[str, tuple[int, ...]] = {
    "attn.q.weight": (16, 16),
    "attn.k.weight": (16, 16),
    "mlp.up.weight": (32, 16),
    "mlp.down.weight": (16, 32),
    "conv.weight": (8, 4, 3),
    "proj.weight": (6, 20),
    "mlp.up.bias": (32,),
    "norm.weight": (16,),
}
MATRICES = [k for k, s in SHAPES.items() if len(s) >= 2]
VECTORS = [k for k, s in SHAPES.items() if len(s) < 2]
STEPS, LR = 4, 0.02
MAIN_THREADS = torch.get_num_threads()
EPS32 = torch.finfo(torch.float32).eps
VARIANTS: dict[str, tuple[Callable[..., muonfn.Transform], dict[str, Any]]] = {
    "muon": (muonfn.muon, {}),
    "normuon": (muonfn.normuon, {"variant": "normuon"}),
    "adamuon": (muonfn.adamuon, {"variant": "adamuon", "momentum": 0.9, "nesterov": False}),
}


def model(members: int = 0) -> Params:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(*([members] if members else []), *s, generator=g) for k, s in SHAPES.items()}


def gradients(members: int = 0) -> list[Params]:
    g = torch.Generator().manual_seed(1)
    batch = [members] if members else []
    return [{k: torch.randn(*batch, *s, generator=g) for k, s in SHAPES.items()} for _ in range(STEPS)]


def reference_ns(M: torch.Tensor) -> torch.Tensor:
    """The reference's Newton–Schulz in fp32."""
    return reference.newton_schulz(M, dtype=torch.float32)


def per_matrix_ns(X: torch.Tensor) -> torch.Tensor:
    """:func:`reference_ns` on every matrix of a ``(count, m, n)`` batch alone: the fast paths' ``ns=``.

    Each matrix is copied out of the stack first, as the reference has it: in memory of its own
    (an sgemm may round a matrix at another alignment differently)."""
    return torch.stack([reference_ns(x.clone()) for x in X])


def reference_run(
    params: Params | None = None, grads: list[Params] | None = None, **options: Any
) -> tuple[Params, dict[str, Any]]:
    params = {k: v.clone() for k, v in (model() if params is None else params).items()}
    state = reference.init()
    options = {"lr": LR, **options}
    for g in gradients() if grads is None else grads:
        reference.step(params, g, state, **options)
    return params, state


def functional_run(tx: muonfn.Transform, *, donated: bool = False, members: int = 0) -> tuple[TensorDict, TensorDict]:
    params = TensorDict(model(members), batch_size=[members] if members else [])
    update = torch.vmap(tx.update) if members else tx.update
    state = torch.vmap(tx.init)(params) if members else tx.init(params)
    for g in gradients(members):
        updates, state = update(TensorDict(g, batch_size=params.batch_size), state, params)
        params = muonfn.apply_updates_(params, updates) if donated else muonfn.apply_updates(params, updates)
    return params, state


def shim_run(**options: Any) -> Params:
    params = {k: torch.nn.Parameter(v) for k, v in model().items()}
    opt = Muon(list(params.items()), lr=LR, **options)
    for g in gradients():
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def assert_bitwise(got: Any, expected: Params, keys: list[str]) -> None:
    for k in keys:
        assert torch.equal(got[k], expected[k]), f"{k}: max |difference| {(got[k] - expected[k]).abs().max():.3g}"


def assert_adamw_close(got: Any, expected: Params, keys: list[str] = VECTORS) -> None:
    """Each step's two formulas round apart by at most a few ulps of the parameter, or of an update of size lr."""
    for k in keys:
        bound = 4 * STEPS * EPS32 * (expected[k].abs() + LR)
        assert ((got[k] - expected[k]).abs() <= bound).all(), k


def newton_schulz_atol(coefficients: str, dtype: torch.dtype) -> float:
    """Rounding amplified by the slope of the iteration at 0, ∏ a_k, with a factor 8 of margin."""
    return 8 * math.prod(a for a, _, _ in muonfn.COEFFICIENTS[coefficients].triples) * torch.finfo(dtype).eps


NS_ATOL = newton_schulz_atol("keller", torch.float32)  # ≈ 4.6e-4


def muon_atol() -> float:
    """Newton–Schulz's tolerance as ``lr·s`` carries it into the parameters each step (the
    gradients are fixed, so a difference does not feed back), plus the rounding of ``p``."""
    largest_scale = max(reference.SCALES["match_rms_adamw"](s[0], math.prod(s[1:])) for s in SHAPES.values())
    return STEPS * (LR * largest_scale * NS_ATOL + 8 * EPS32)


def assert_muon_close(got: Any, expected: Params) -> None:
    for k in MATRICES:
        torch.testing.assert_close(got[k], expected[k], atol=muon_atol(), rtol=0, msg=k)


# ----------------------------------------------------------------- Newton–Schulz and AdamW alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("coefficients", ["keller", "cesista", "polar_express"])
def test_reference_newton_schulz_matches_muonfn_within_rounding(coefficients: str, dtype: torch.dtype) -> None:
    """The same map (normalisation, orientation, schedule); muonfn scales by a power of two
    first and fuses ``b·A + c·A²`` into one ``baddbmm``. Gaussian and ill-conditioned inputs."""
    schedule = muonfn.COEFFICIENTS[coefficients]
    atol = newton_schulz_atol(coefficients, dtype)
    g = torch.Generator().manual_seed(2)
    for m, n in [(1, 7), (16, 16), (32, 16), (13, 40), (40, 13), (64, 64)]:
        x = torch.randn(m, n, generator=g, dtype=torch.float64)
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        spread = (u * torch.logspace(0, -6, min(m, n), dtype=torch.float64)) @ vh
        for G in (x.to(dtype), spread.to(dtype)):
            ours = reference.newton_schulz(G, schedule.triples, norm_factor=schedule.norm_factor, dtype=dtype)
            torch.testing.assert_close(ours, muonfn.newton_schulz(G, coefficients, dtype=dtype), atol=atol, rtol=0)


def test_reference_adamw_equals_torch_optim_adamw_bitwise() -> None:
    """The reference's AdamW step is ``torch.optim.AdamW``'s single-tensor step, op for op (a
    matrix sent to AdamW by name included)."""
    torch_params = {k: torch.nn.Parameter(v) for k, v in model().items()}
    opt = torch.optim.AdamW(torch_params.values(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for g in gradients():
        for k, p in torch_params.items():
            p.grad = g[k].clone()
        opt.step()
    ours, state = reference_run(adamw_names=MATRICES)
    assert_bitwise({k: p.detach() for k, p in torch_params.items()}, ours, list(SHAPES))
    assert state["momentum"] == {}
    for k, p in torch_params.items():
        assert torch.equal(opt.state[p]["exp_avg"], state["exp_avg"][k])
        assert torch.equal(opt.state[p]["exp_avg_sq"], state["exp_avg_sq"][k])


def test_muonfn_adamw_matches_torch_optim_adamw_within_rounding() -> None:
    """``muonfn.adamw`` folds the step size into the denominator, ``m / ((√v + ε√c₂)·(−c₁/(η√c₂)))``,
    and adds ``−ηλp`` to the update; torch (and the reference) divide by ``√v/√c₂ + ε`` and multiply
    ``p`` by ``1 − ηλ`` first. The same moments, parameters a few ulps apart (see :func:`assert_adamw_close`)."""
    params = TensorDict(model(), batch_size=[])
    tx = muonfn.adamw(LR, betas=(0.9, 0.95), weight_decay=0.1)
    state = tx.init(params)
    for g in gradients():
        updates, state = tx.update(TensorDict(g, batch_size=[]), state, params)
        params = muonfn.apply_updates(params, updates)
    expected, expected_state = reference_run(adamw_names=MATRICES)
    for entry in ("exp_avg", "exp_avg_sq"):
        assert_bitwise(state[entry], expected_state[entry], list(SHAPES))
    assert_adamw_close(params, expected, list(SHAPES))


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("lr", ["number", "tensor", "schedule"])
def test_muonfn_adamw_moments_equal_torch_optim_adamw_bitwise(foreach: bool, lr: str) -> None:
    """The moments are torch's bits (its ``lerp_``, ``mul_`` and ``addcmul_``), single-tensor and
    foreach alike, with the learning rate a number, a tensor or a schedule; the parameters within
    :func:`assert_adamw_close`, decayed or not (``weight_decay_mask``), donated or not."""
    torch_params = {k: torch.nn.Parameter(v) for k, v in model().items()}
    decayed = [p for k, p in torch_params.items() if k != "norm.weight"]
    groups = [{"params": decayed}, {"params": [torch_params["norm.weight"]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=foreach)
    rate = {"number": LR, "tensor": torch.tensor(LR), "schedule": lambda count: LR}[lr]
    for donated in (False, True):
        tx = muonfn.adamw(
            rate, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask={"norm.weight": False}, donate_state=donated
        )
        params = TensorDict(model(), batch_size=[])
        state = tx.init(params)
        for g in gradients():
            updates, state = tx.update(TensorDict(g, batch_size=[]), state, params)
            params = muonfn.apply_updates_(params, updates) if donated else muonfn.apply_updates(params, updates)
        if not donated:
            for g in gradients():
                for k, p in torch_params.items():
                    p.grad = g[k].clone()
                opt.step()
        expected = {k: p.detach() for k, p in torch_params.items()}
        for entry in ("exp_avg", "exp_avg_sq"):
            assert_bitwise(state[entry], {k: opt.state[p][entry] for k, p in torch_params.items()}, list(SHAPES))
        assert_adamw_close(params, expected, list(SHAPES))


def test_muonfn_adamw_at_a_learning_rate_of_zero_leaves_the_parameters_as_they_are() -> None:
    """The step size is folded into the denominator: at ``lr = 0`` it is ``-inf`` there, and the
    update ``-0`` (no ``nan`` where a moment is 0)."""
    params = TensorDict(model(), batch_size=[])
    tx = muonfn.adamw(torch.tensor(0.0), weight_decay=0.1)
    grads = {
        k: torch.where(torch.arange(g.numel()).reshape(g.shape) % 2 == 0, 0.0, g) for k, g in gradients()[0].items()
    }
    updates, _ = tx.update(TensorDict(grads, batch_size=[]), tx.init(params), params)
    for k, u in updates.items(True, True):
        assert torch.equal(u, torch.zeros_like(u)), k


# ----------------------------------------------------------------- bitwise: the same Newton–Schulz


@pytest.mark.parametrize("scale", list(reference.SCALES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_functional_equals_reference_bitwise_with_the_same_newton_schulz(variant: str, scale: str) -> None:
    preset, options = VARIANTS[variant]
    tx = preset(lr=LR, scale=scale, ns=per_matrix_ns)
    params, state = functional_run(tx)
    expected, expected_state = reference_run(ns=reference_ns, scale=scale, **options)
    assert_bitwise(params, expected, MATRICES)
    assert_adamw_close(params, expected)
    assert_bitwise(state["muon", "momentum"], expected_state["momentum"], MATRICES)
    for entry in ("exp_avg", "exp_avg_sq"):
        assert_bitwise(state["adamw", entry], expected_state[entry], VECTORS)
    if variant == "normuon":
        assert_bitwise(state["muon", "row_second_moment"], expected_state["row_second_moment"], MATRICES)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_donated_equals_reference_bitwise_with_the_same_newton_schulz(variant: str) -> None:
    """``donate_state=True`` and ``apply_updates_``: the state and the parameters updated in place."""
    preset, options = VARIANTS[variant]
    params, state = functional_run(preset(lr=LR, ns=per_matrix_ns, donate_state=True), donated=True)
    expected, expected_state = reference_run(ns=reference_ns, **options)
    assert_bitwise(params, expected, MATRICES)
    assert_adamw_close(params, expected)
    assert_bitwise(state["muon", "momentum"], expected_state["momentum"], MATRICES)


@pytest.mark.parametrize("chunk_numel", [None, 300])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_shim_equals_reference_bitwise_with_the_same_newton_schulz(variant: str, chunk_numel: int | None) -> None:
    """``muonfn.optim.Muon``: hyperparameters as tensors, donated state, one part or parts of 300 elements."""
    _, options = VARIANTS[variant]
    params = shim_run(ns=per_matrix_ns, chunk_numel=chunk_numel, **options)
    expected, _ = reference_run(ns=reference_ns, **options)
    assert_bitwise(params, expected, MATRICES)
    assert_adamw_close(params, expected)


@pytest.mark.parametrize("variant", ["muon", "adamuon"])
@pytest.mark.parametrize("donated", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_dtype_equals_reference_bitwise_with_the_same_newton_schulz(
    state_dtype: torch.dtype, donated: bool, variant: str
) -> None:
    """``state_dtype``: the momentum, AdamW's moments and AdaMuon's second moment computed in fp32 and
    kept as ``reference.kept`` keeps them (bf16: rounded stochastically, keyed by the step and the
    names) are the reference's bits, and so are the Muon parameters, which take the unrounded values."""
    preset, options = VARIANTS[variant]
    tx = preset(lr=LR, ns=per_matrix_ns, state_dtype=state_dtype, donate_state=donated)
    params, state = functional_run(tx, donated=donated)
    expected, expected_state = reference_run(ns=reference_ns, state_dtype=state_dtype, **options)
    assert_bitwise(params, expected, MATRICES)
    assert_adamw_close(params, expected)
    assert state["muon", "momentum", MATRICES[0]].dtype == state_dtype
    assert_bitwise(state["muon", "momentum"], expected_state["momentum"], MATRICES)
    for entry in ("exp_avg", "exp_avg_sq"):
        assert_bitwise(state["adamw", entry], expected_state[entry], VECTORS)
    if variant == "adamuon":
        moment = (
            state["muon", "second_moment", "exp_avg_sq"]
            if state_dtype == torch.bfloat16
            else state["muon", "exp_avg_sq"]
        )
        assert moment[MATRICES[0]].dtype == state_dtype
        for name in MATRICES:
            assert torch.equal(
                moment[name].reshape(expected_state["exp_avg_sq"][name].shape), expected_state["exp_avg_sq"][name]
            )


def test_buckets_equal_reference_bitwise_with_the_same_newton_schulz() -> None:
    """``bucket_numel`` below one matrix: every Newton–Schulz call holds one matrix."""
    local = muonfn.LocalOrthogonalizer(bucket_numel=100)
    params, _ = functional_run(muonfn.muon(lr=LR, ns=per_matrix_ns, orthogonalizer=local))
    expected, _ = reference_run(ns=reference_ns)
    assert_bitwise(params, expected, MATRICES)


def sharded_run(col: SimulatedCollectives, strategy: str, sharded: bool, **options: Any) -> Params:
    """One rank's run: row blocks of every leaf (uneven on 3 ranks), or whole tensors on every rank."""
    # a new thread may start with OpenMP's default count of threads, and a multithreaded sgemm
    # rounds some small shapes differently: compute with the main thread's count
    torch.set_num_threads(MAIN_THREADS)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.tensor_split(col.world_size)[col.rank].clone() if sharded else t.clone()

    params = TensorDict({k: local(v) for k, v in model().items()}, batch_size=[])
    specs = {k: ShardSpec(0) for k in SHAPES} if sharded else None
    tx = muonfn.muon(lr=LR, orthogonalizer=sharded_orthogonalizer(col, strategy=strategy, shard_specs=specs), **options)
    state = tx.init(params)
    for g in gradients():
        updates, state = tx.update(TensorDict({k: local(v) for k, v in g.items()}, batch_size=[]), state, params)
        params = muonfn.apply_updates(params, updates)
    return {k: params[k] for k in SHAPES}


def gathered(ranks: list[Params], sharded: bool) -> Params:
    if not sharded:
        for other in ranks[1:]:
            assert_bitwise(other, ranks[0], list(SHAPES))  # every replica holds the same result
        return ranks[0]
    return {k: torch.cat([r[k] for r in ranks]) for k in SHAPES}


@pytest.mark.parametrize(("world", "sharded"), [(3, True), (2, False)], ids=["fsdp3", "ddp2"])
@pytest.mark.parametrize("strategy", ["owner", "gather"])
def test_distributed_simulation_equals_reference_bitwise_with_the_same_newton_schulz(
    strategy: str, world: int, sharded: bool
) -> None:
    ranks = simulate(world, sharded_run, strategy, sharded, ns=per_matrix_ns)
    params = gathered(ranks, sharded)
    expected, _ = reference_run(ns=reference_ns)
    assert_bitwise(params, expected, MATRICES)
    assert_adamw_close(params, expected)


def test_default_newton_schulz_one_matrix_per_call_equals_reference_bitwise() -> None:
    """muonfn's own Newton–Schulz inside the reference, against the fast path with one matrix
    per call (``LocalOrthogonalizer(bucket_numel=1)``): the same products on the same matrices, whatever the BLAS.
    The fast path hands ``-η·s`` to the last Newton–Schulz step, so the reference's map takes
    ``η·s`` there, and the reference runs at a learning rate of 1 (its update is then that
    result negated, exactly) and a decay of ``η·λ`` (the same ``-ηλ`` multiply-add)."""
    ns = muonfn.NewtonSchulz(dtype=torch.float32)
    scale = reference.SCALES["match_rms_adamw"]
    params, _ = functional_run(muonfn.muon(lr=LR, ns=ns, orthogonalizer=muonfn.LocalOrthogonalizer(bucket_numel=1)))
    expected, _ = reference_run(
        ns=lambda M: ns.orthogonalize(M, scale=LR * scale(*M.shape)), scale="none", lr=1.0, weight_decay=LR * 0.1
    )
    assert_bitwise(params, expected, MATRICES)


# ----------------------------------------------------------------- to tolerance: batched matmuls


def test_vmapped_ensemble_matches_reference_within_batched_matmul_rounding() -> None:
    """Three members under ``torch.vmap``, each against its own reference run. The reference's
    Newton–Schulz then runs every matmul as one ``bmm`` over the members: elementwise the same
    arithmetic, but a BLAS may round a batch differently from one matrix."""
    members = 3
    params, _ = functional_run(muonfn.muon(lr=LR, ns=per_matrix_ns), members=members)
    grads = gradients(members)
    for i in range(members):
        member = {k: v[i] for k, v in model(members).items()}
        expected, _ = reference_run(member, [{k: v[i] for k, v in g.items()} for g in grads], ns=reference_ns)
        assert_muon_close(params[i], expected)
        assert_adamw_close(params[i], expected)


FP32_NS = muonfn.NewtonSchulz(dtype=torch.float32)
DEFAULT_PATHS: dict[str, Callable[[], Any]] = {
    "functional": lambda: functional_run(muonfn.muon(lr=LR, ns=FP32_NS))[0],
    "donated": lambda: functional_run(muonfn.muon(lr=LR, ns=FP32_NS, donate_state=True), donated=True)[0],
    "bucketed": lambda: functional_run(
        muonfn.muon(lr=LR, ns=FP32_NS, orthogonalizer=muonfn.LocalOrthogonalizer(bucket_numel=600))
    )[0],
    "shim": lambda: shim_run(ns=FP32_NS),
    "fsdp3": lambda: gathered(simulate(3, sharded_run, "owner", True, ns=FP32_NS), True),
}


@pytest.mark.parametrize("path", list(DEFAULT_PATHS))
def test_default_fast_paths_match_reference_within_newton_schulz_rounding(path: str) -> None:
    """Defaults end to end (fp32 Newton–Schulz pinned): muonfn's batched ``baddbmm`` iteration
    against the reference's 2-D products, within :func:`muon_atol`."""
    params = DEFAULT_PATHS[path]()
    expected, _ = reference_run(ns=reference_ns)
    assert_muon_close(params, expected)
    assert_adamw_close(params, expected)
