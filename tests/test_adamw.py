"""AdamW: its own passes (the CPU's, an ensemble's, a traced step's) and torch's fused kernel (a
GPU's, asked for here on the CPU with ``fused=True``), the decay one multiply-add in both."""

from __future__ import annotations

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict

import muonfn

LR, WD = 3e-3, 0.1


def params_and_grads(steps: int, seed: int = 0) -> tuple[TensorDict, list[TensorDict]]:
    """Small leaves (0-d, vectors, a small matrix, a cube) and two large ones."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed": (300, 256),
        "head": (65536,),
        "scalar": (),
        "bias": (7,),
        "norm": (64,),
        "small": (5, 3),
        "cube": (2, 3, 4),
    }
    params = TensorDict({k: torch.randn(s, generator=g) for k, s in shapes.items()}, batch_size=[])
    grads = [params.apply(lambda p: torch.randn(p.shape, generator=g)) for _ in range(steps)]
    return params, grads


def run(tx: muonfn.Transform, params: TensorDict, grads: list[TensorDict], *, skew: bool = False) -> tuple:
    state = tx.init(params)
    if skew:  # leaves whose step counts differ, as a shim's leaves without gradients get
        state["step", "bias"] += 3
        state["step", "embed"] += 7
    updates = []
    for g in grads:
        u, state = tx.update(g, state, params)
        params = muonfn.apply_updates(params, u)
        updates.append(u)
    return params, state, updates


def kernel_calls(step) -> int:  # type: ignore[no-untyped-def]
    """How many times ``step()`` calls ``torch._fused_adamw_`` (seen below the dispatcher)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket is torch.ops.aten._fused_adamw_:
                Calls.count += 1
            return func(*args, **(kwargs or {}))

    with Calls():
        step()
    return Calls.count


# ---------------------------------------------------------------------------- the rule's own passes


@pytest.mark.parametrize("nesterov", [False, True, "timm"])
def test_the_rule_computes_adamw_per_leaf_with_step_counts_that_differ(nesterov) -> None:
    """``-η m̂/(√v̂ + ε) - ηλp`` with each leaf's own step count (optax's and timm's Nesterov forms:
    the moment corrected as each writes it), to fp32 rounding of the formula in fp64."""
    params, grads = params_and_grads(3)
    b1, b2, eps = 0.9, 0.999, 1e-8
    _, state, updates = run(muonfn.adamw(LR, weight_decay=WD, nesterov=nesterov), params, grads, skew=True)
    p = params.apply(lambda t: t.double())
    for key in ("embed", "bias", "scalar"):
        m = v = torch.zeros_like(p[key])
        t0 = {"bias": 3, "embed": 7}.get(key, 0)
        for i, g in enumerate(grads):
            t, gk = t0 + i + 1, g[key].double()
            m, v = b1 * m + (1 - b1) * gk, b2 * v + (1 - b2) * gk * gk
            c1, c2 = 1 - b1**t, 1 - b2**t
            if nesterov is True:
                numerator = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * gk / c1
            elif nesterov == "timm":
                numerator = (b1 * m + (1 - b1) * gk) / c1
            else:
                numerator = m / c1
            expected = -LR * numerator / ((v / c2).sqrt() + eps) - LR * WD * p[key]
            torch.testing.assert_close(updates[i][key].double(), expected, rtol=2e-5, atol=1e-9, msg=key)
            p[key] = p[key] + updates[i][key].double()
        assert int(state["step", key]) == t0 + len(grads)


@pytest.mark.parametrize("as_tensors", [False, True])
def test_a_number_decay_is_one_multiply_add_on_every_leaf(as_tensors: bool) -> None:
    """ηλ a number (or, eager, 0-d tensors on the host, as the shim holds them): one fused
    ``add(alpha=-ηλ)`` for all leaves, small and large."""
    params, grads = params_and_grads(1)
    g = grads[0]
    plain = muonfn.adamw(LR, weight_decay=0.0)
    undecayed, _ = plain.update(g, plain.init(params), params)
    lr, wd = (torch.tensor(LR, dtype=torch.float64), torch.tensor(WD, dtype=torch.float64)) if as_tensors else (LR, WD)
    decaying = muonfn.adamw(lr, weight_decay=wd)
    decayed, _ = decaying.update(g, decaying.init(params), params)
    for key, p in params.items():
        assert torch.equal(decayed[key], torch.add(undecayed[key], p, alpha=-(LR * WD))), key


def test_vmap_and_host_tensor_rates_give_the_bits_of_the_plain_update() -> None:
    """vmap runs every op leaf by leaf and the shim holds its rates in 0-d tensors: both give the
    bits of the plain functional update."""
    params, grads = params_and_grads(2)
    expected = run(muonfn.adamw(LR, weight_decay=WD), params, grads)
    lr = torch.tensor(LR, dtype=torch.float64)
    wd = torch.tensor(WD, dtype=torch.float64)
    got = run(muonfn.adamw(lr, weight_decay=wd), params, grads)
    assert_bitwise(got[0], expected[0])

    tx = muonfn.adamw(LR, weight_decay=WD)
    stacked = torch.stack([params, params.apply(lambda p: p * 0.5)])
    stacked_grads = [torch.stack([g, g.apply(lambda x: -x)]) for g in grads]

    def one(p: TensorDict, gs: list[TensorDict]) -> TensorDict:
        return run(tx, p, gs)[0]

    vmapped = torch.vmap(one)(stacked, stacked_grads)
    assert_bitwise(vmapped[0], expected[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stacked_ensemble_gives_the_bits_of_the_vmapped_one(dtype) -> None:
    """A stacked ensemble (the members a leading dimension) and a vmapped one decay and step each
    leaf by the same formula, the same bits."""
    params, grads = params_and_grads(2)
    params = params.apply(lambda t: t.to(dtype))
    grads = [g.apply(lambda t: t.to(dtype)) for g in grads]
    stacked = torch.stack([params, params.apply(lambda p: p * 0.5)])
    stacked_grads = [torch.stack([g, g.apply(lambda x: -x)]) for g in grads]
    tx = muonfn.adamw(LR, weight_decay=WD)
    ensemble = run(tx, stacked, stacked_grads)[0]
    vmapped = torch.vmap(lambda p, gs: run(tx, p, gs)[0])(stacked, stacked_grads)
    assert_bitwise(ensemble, vmapped)
    if dtype == torch.float32:  # (one model alone against a member: fp32, as the contract's tests hold it)
        assert_bitwise(ensemble[0], run(tx, params, grads)[0])


@pytest.mark.parametrize("fused", [False, True])
def test_weight_decay_mask_matrices_decays_the_leaves_of_two_dimensions_or_more(fused: bool) -> None:
    params, grads = params_and_grads(1)
    matrices = muonfn.adamw(LR, weight_decay=WD, weight_decay_mask="matrices", fused=fused)
    by_name = {k: p.ndim >= 2 for k, p in params.items()}
    written = muonfn.adamw(LR, weight_decay=WD, weight_decay_mask=by_name, fused=fused)
    undecayed = muonfn.adamw(LR, weight_decay=0.0, fused=fused)
    got = run(matrices, params, grads)[2][0]
    assert_bitwise(got, run(written, params, grads)[2][0])
    plain = run(undecayed, params, grads)[2][0]
    for key, p in params.items():
        assert torch.equal(got[key], plain[key]) == (p.ndim < 2), key


# ---------------------------------------------------------------------------- torch's fused kernel


def torch_adamw(params: TensorDict, grads: list[TensorDict], weight_decay: float, skew: bool = False) -> TensorDict:
    """``torch.optim.AdamW(fused=True)`` over ``params`` for ``grads`` (``skew``: from the step
    counts :func:`run` starts from)."""
    leaves = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = torch.optim.AdamW(leaves.values(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, fused=True)
    for k, p in leaves.items():
        start = {"bias": 3.0, "embed": 7.0}.get(k, 0.0) if skew else 0.0
        opt.state[p] = {"step": torch.tensor(start), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    for g in grads:
        for k, p in leaves.items():
            p.grad = g[k].clone()
        opt.step()
    return TensorDict({k: p.detach() for k, p in leaves.items()}, batch_size=[])


@pytest.mark.parametrize("donate_state", [False, True])
def test_the_kernel_is_torch_fused_adamw_bit_for_bit_without_decay(donate_state: bool) -> None:
    """Without decay the update is torch.optim.AdamW(fused=True)'s parameter change: the same
    parameters after four steps, bit for bit, for leaves whose step counts differ; the kernel
    runs once a step, and the rule without ``fused`` on the CPU not at all."""
    params, grads = params_and_grads(4)
    tx = muonfn.adamw(LR, weight_decay=0.0, donate_state=donate_state, fused=True)
    ours, state, _ = run(tx, params, grads, skew=True)
    assert_bitwise(ours, torch_adamw(params, grads, weight_decay=0.0, skew=True))
    assert state["step", "embed"].dtype == torch.int64 and int(state["step", "embed"]) == 11
    assert kernel_calls(lambda: run(tx, params, grads[:1])) == 1
    assert kernel_calls(lambda: run(muonfn.adamw(LR, weight_decay=0.0), params, grads[:1])) == 0


def test_the_kernel_starts_the_update_from_the_decay() -> None:
    """With decay the update starts as -ηλp (0 where the mask exempts a leaf) and the kernel
    subtracts torch's step from it: against the rule's own passes (``fused=False``), the same to
    fp32 rounding; on an exempt leaf, torch's undecayed step bit for bit."""
    params, grads = params_and_grads(3)
    mask = dict.fromkeys(params.keys(), True) | {"bias": False}
    got = run(muonfn.adamw(LR, weight_decay=WD, weight_decay_mask=mask, fused=True), params, grads)
    undecayed = torch_adamw(params, grads, weight_decay=0.0)
    assert torch.equal(got[0]["bias"], undecayed["bias"])
    own = run(muonfn.adamw(LR, weight_decay=WD, weight_decay_mask=mask, fused=False), params, grads)
    torch.testing.assert_close(got[0], own[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], own[1])  # (the kernel's moments round as its own arithmetic does)
    decayed_first = got[2][0]["embed"] - undecayed_first_update(params, grads[0])["embed"]
    torch.testing.assert_close(decayed_first, -LR * WD * params["embed"], rtol=1e-5, atol=1e-9)


def undecayed_first_update(params: TensorDict, g: TensorDict) -> TensorDict:
    tx = muonfn.adamw(LR, weight_decay=0.0, fused=True)
    return tx.update(g, tx.init(params), params)[0]


def test_the_kernel_keeps_an_undonated_state() -> None:
    """The kernel writes the moments in place: an undonated update writes them into copies, so the
    state it was given is unchanged, and it returns what the donated update returns."""
    params, grads = params_and_grads(2)
    plain = muonfn.adamw(LR, weight_decay=WD, fused=True)
    donating = muonfn.adamw(LR, weight_decay=WD, donate_state=True, fused=True)
    state = plain.init(params)
    state = plain.update(grads[0], state, params)[1]
    before = state.clone()
    updates, new = plain.update(grads[1], state, params)
    assert_bitwise(state, before)
    donated_updates, donated = donating.update(grads[1], before.clone(), params)
    assert_bitwise(updates, donated_updates)
    assert_bitwise(new, donated)


def test_the_kernel_takes_host_tensor_rates_as_the_numbers_they_hold() -> None:
    """0-d learning rate and decay tensors on the host (the shim's) go to the kernel as the numbers
    they hold: the bits of the same rates given as numbers."""
    params, grads = params_and_grads(2)
    expected = run(muonfn.adamw(LR, weight_decay=WD, fused=True), params, grads)
    lr = torch.tensor(LR, dtype=torch.float64)
    got = run(muonfn.adamw(lr, weight_decay=torch.tensor(WD, dtype=torch.float64), fused=True), params, grads)
    assert_bitwise(got[0], expected[0])


def test_the_kernel_with_a_zero_learning_rate_leaves_the_parameters() -> None:
    params, grads = params_and_grads(1)
    got = run(muonfn.adamw(0.0, weight_decay=WD, fused=True), params, grads)
    assert torch.equal(got[0]["embed"], params["embed"]) and bool(got[1]["exp_avg", "embed"].abs().sum() > 0)
    assert all(bool(torch.isfinite(u).all()) for u in got[2][0].values())


def meta_step(tx: muonfn.Transform, params: TensorDict, grad: TensorDict):  # type: ignore[no-untyped-def]
    state = tx.init(params)
    return lambda: tx.update(grad, state, params)


@pytest.mark.parametrize("preset", [muonfn.adamw, muonfn.muon])
def test_on_a_gpus_path_one_model_of_fp32_leaves_takes_the_kernel_once(preset) -> None:
    """On the meta device (CUDA's paths, no data) one step of one model calls the kernel once for
    all its AdamW leaves, the shim's too."""
    params, _ = params_and_grads(1)
    params = params.apply(lambda t: torch.empty_like(t, device="meta"))
    assert kernel_calls(meta_step(preset(lr=LR, weight_decay=WD), params, params.clone())) == 1
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to("meta")
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    opt = muonfn.optim.Muon(model.named_parameters(), lr=LR)
    assert kernel_calls(opt.step) == 1


@pytest.mark.parametrize("preset", [muonfn.adamw, muonfn.muon])
def test_on_a_gpus_path_a_scheduled_learning_rate_steps_through_the_kernel(preset) -> None:
    """A schedule's rate is a 0-d tensor on the leaves' device, which CUDA's kernel takes as it is
    (``tensor_lr``). On the meta device (CUDA's paths, as the traffic counter counts them) the
    step runs too, through the kernel once, and gives updates of the parameters' shapes there."""
    params, _ = params_and_grads(1)
    params = params.apply(lambda t: torch.empty_like(t, device="meta"))
    tx = preset(lr=lambda count: LR * 0.5**count, weight_decay=WD)
    state = tx.init(params)
    assert kernel_calls(lambda: tx.update(params.clone(), state, params)) == 1
    updates, state = tx.update(params.clone(), state, params)
    for key, p in params.items():
        assert updates[key].shape == p.shape and updates[key].dtype == p.dtype and updates[key].is_meta, key


def test_a_schedule_steps_through_the_kernel_with_the_bits_of_its_rates() -> None:
    """Forced on the CPU, a schedule's rate, a 0-d tensor, reaches the kernel as a number in an eager
    step: the bits of the same rates given as numbers, step by step."""
    params, grads = params_and_grads(3)
    rates = [LR * 0.5**t for t in range(3)]
    scheduled = run(muonfn.adamw(lambda count: LR * 0.5**count, weight_decay=WD, fused=True), params, grads)
    state, p = None, params
    for t, g in enumerate(grads):
        tx = muonfn.adamw(torch.tensor(rates[t]).item(), weight_decay=WD, fused=True)
        state = tx.init(params) if state is None else state
        u, state = tx.update(g, state, p)
        p = muonfn.apply_updates(p, u)
    assert_bitwise(scheduled[0], p)


@pytest.mark.parametrize("case", ["cpu", "ensemble", "vmap", "bf16", "fp16", "recorded", "transposed", "unfused"])
def test_elsewhere_the_rule_runs_its_own_passes(case: str) -> None:
    """The CPU, a stacked or vmapped ensemble (whose members keep one formula), a leaf that is not
    fp32, a step that autograd records, a leaf that is not contiguous (CUDA's kernel refuses
    tensors of one leaf whose strides differ), and ``fused=False`` take the rule's own passes."""
    params, _ = params_and_grads(1)
    device = "cpu" if case == "cpu" else "meta"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case, torch.float32)
    params = params.apply(lambda t: torch.zeros(t.shape, device=device, dtype=dtype))
    tx = muonfn.adamw(LR, weight_decay=WD, fused=False if case == "unfused" else None)
    if case == "ensemble":
        params = torch.stack([params, params])
    if case == "vmap":
        stacked = torch.stack([params, params])
        state = torch.vmap(tx.init)(stacked)
        assert kernel_calls(lambda: torch.vmap(tx.update)(stacked, state, stacked)) == 0
        return
    if case == "recorded":
        params = params.apply(lambda t: t.requires_grad_())
    if case == "transposed":
        params["embed"] = torch.zeros(256, 300, device=device).mT
    assert kernel_calls(meta_step(tx, params, params.detach().clone())) == 0


def test_fused_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="adamw: fused must be True or False"):
        muonfn.adamw(fused="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- a scheduled beta1

BETA1S = (0.9, 0.8, 0.85, 0.7)


def with_beta1_each_step(make, params: TensorDict, grads: list[TensorDict]) -> tuple:
    """The run of a transform built with a new float beta1 (``make(beta1)``) for each step, on one state."""
    state = make(BETA1S[0]).init(params)
    for beta1, g in zip(BETA1S, grads):
        u, state = make(beta1).update(g, state, params)
        params = muonfn.apply_updates(params, u)
    return params, state


def with_a_tensor_beta1(make, params: TensorDict, grads: list[TensorDict]) -> tuple:
    """The run of one transform built with a 0-d tensor beta1, refilled before each step."""
    beta1 = torch.tensor(0.0, dtype=torch.float64)
    tx = make(beta1)
    state = tx.init(params)
    for value, g in zip(BETA1S, grads):
        beta1.fill_(value)
        u, state = tx.update(g, state, params)
        params = muonfn.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("nesterov", [False, True, "timm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tensor_beta1_is_read_at_every_update(nesterov, dtype) -> None:
    """A 0-d tensor beta1 (as the shim schedules an AdamW group's) is read at every update, bias
    corrections included: bit for bit the transforms built with each value as a number."""
    params, grads = params_and_grads(len(BETA1S))
    params, grads = params.to(dtype), [g.to(dtype) for g in grads]

    def make(beta1):  # type: ignore[no-untyped-def]
        return muonfn.adamw(LR, betas=(beta1, 0.99), weight_decay=WD, nesterov=nesterov, donate_state=True)

    expected = with_beta1_each_step(make, params, grads)
    got = with_a_tensor_beta1(make, params, grads)
    assert_bitwise(got[0], expected[0])
    assert_bitwise(got[1], expected[1])


def test_a_tensor_beta1_on_the_host_takes_the_torch_kernel_as_a_number() -> None:
    """In an eager step a host beta1 is read as a number and the update takes torch's kernel (asked
    for here on the CPU), with the bits of that number."""
    params, grads = params_and_grads(len(BETA1S))

    def make(beta1):  # type: ignore[no-untyped-def]
        return muonfn.adamw(LR, betas=(beta1, 0.99), weight_decay=0.0, fused=True)

    expected = with_beta1_each_step(make, params, grads)
    tx = make(torch.tensor(BETA1S[0], dtype=torch.float64))
    assert kernel_calls(lambda: tx.update(grads[0], tx.init(params), params)) == 1
    got = with_a_tensor_beta1(make, params, grads)
    assert_bitwise(got[0], expected[0])
    assert_bitwise(got[1], expected[1])
