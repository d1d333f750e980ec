"""The fused AdamW rule's GPU form, run here on the CPU: small leaves gathered into one flat
tensor for their per-leaf factors (the bits of one op per leaf), and decayed by one factor for
all of them (``u - round(ηλ·p)``), large leaves as on the CPU."""

from __future__ import annotations

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict

import muonfn
from muonfn import _multi_tensor
from muonfn.transforms import _adamw

LR, WD = 3e-3, 0.1


def params_and_grads(steps: int, seed: int = 0) -> tuple[TensorDict, list[TensorDict]]:
    """Many small leaves (0-d, vectors, a small matrix) and two of at least ``FLAT_NUMEL`` elements."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed": (300, 256),
        "head": (_adamw.FLAT_NUMEL,),
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


@pytest.fixture
def off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_multi_tensor, "off_cpu", lambda t: True)


@pytest.mark.parametrize("donate_state", [False, True])
def test_gathered_small_leaves_keep_the_bits_of_one_op_per_leaf(monkeypatch, donate_state: bool) -> None:
    """Without decay the GPU form's arithmetic is the CPU form's, element by element, with step
    counts that differ from leaf to leaf."""
    params, grads = params_and_grads(4)
    tx = muonfn.adamw(LR, weight_decay=0.0, donate_state=donate_state)
    expected = run(tx, params, grads, skew=True)
    monkeypatch.setattr(_multi_tensor, "off_cpu", lambda t: True)
    assert _adamw.gathers_small_leaves(list(params.values()), 0)
    got = run(tx, params, grads, skew=True)
    assert_bitwise(got[0], expected[0])
    assert_bitwise(got[1], expected[1])


@pytest.mark.parametrize("as_tensors", [False, True])
def test_off_the_cpu_a_number_decay_is_one_multiply_add_on_every_leaf(off_the_cpu, as_tensors: bool) -> None:
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


def test_off_the_cpu_small_leaves_subtract_a_device_decay_term_large_ones_fuse_it(monkeypatch, off_the_cpu) -> None:
    """ηλ a tensor on the device (forced here: no host tensor is read as a number): a factor per
    leaf would run tensor by tensor, so the small leaves subtract ηλp written out."""
    monkeypatch.setattr(_multi_tensor, "host_number", lambda weight, leaves: weight)
    params, grads = params_and_grads(1)
    g = grads[0]
    plain = muonfn.adamw(LR, weight_decay=0.0)
    undecayed, _ = plain.update(g, plain.init(params), params)
    decaying = muonfn.adamw(torch.tensor(LR), weight_decay=WD)
    decayed, _ = decaying.update(g, decaying.init(params), params)
    factor = (torch.tensor(LR) * WD).to(torch.float32)
    for key, p in params.items():
        if p.numel() < _adamw.FLAT_NUMEL:
            expected = undecayed[key] - p * factor  # ηλp rounded, then subtracted
        else:
            expected = torch.addcmul(undecayed[key], p, factor, value=-1)
        assert torch.equal(decayed[key], expected), key


def test_the_gpu_form_is_the_same_under_vmap_and_for_a_tensor_learning_rate(off_the_cpu) -> None:
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
def test_a_stacked_ensemble_takes_the_gpu_form_of_the_vmapped_one(off_the_cpu, dtype) -> None:
    """A leaf is small for the decay by its size for one member: a stacked ensemble (the members
    a leading dimension) and a vmapped one decay each leaf by the same formula, the same bits."""
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


# ---------------------------------------------------------------------------- torch's fused kernel


@pytest.fixture
def torch_kernel_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA route through ``torch._fused_adamw_``, taken here by the CPU's kernel of the same op."""
    monkeypatch.setattr(_adamw, "TORCH_KERNEL_DEVICES", frozenset({"cpu"}))


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
def test_the_torch_kernel_route_is_torch_fused_adamw_bit_for_bit_without_decay(
    torch_kernel_on_the_cpu, donate_state: bool
) -> None:
    """Without decay the update is torch.optim.AdamW(fused=True)'s parameter change: the same
    parameters after four steps, bit for bit, for leaves whose step counts differ."""
    params, grads = params_and_grads(4)
    ours, state, _ = run(muonfn.adamw(LR, weight_decay=0.0, donate_state=donate_state), params, grads, skew=True)
    assert_bitwise(ours, torch_adamw(params, grads, weight_decay=0.0, skew=True))
    assert state["step", "embed"].dtype == torch.int64 and int(state["step", "embed"]) == 11


def test_the_torch_kernel_route_starts_the_update_from_the_decay(torch_kernel_on_the_cpu) -> None:
    """With decay the update starts as -ηλp (0 where the mask exempts a leaf) and the kernel
    subtracts torch's step from it: against the rule's own passes, the same to fp32 rounding; on
    an exempt leaf, torch's undecayed step bit for bit."""
    params, grads = params_and_grads(3)
    mask = dict.fromkeys(params.keys(), True) | {"bias": False}
    tx = muonfn.adamw(LR, weight_decay=WD, weight_decay_mask=mask)
    got = run(tx, params, grads)
    undecayed = torch_adamw(params, grads, weight_decay=0.0)
    assert torch.equal(got[0]["bias"], undecayed["bias"])
    taken: list[str] = []
    real = torch._fused_adamw_
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_adamw, "TORCH_KERNEL_DEVICES", frozenset())
        patch.setattr(torch, "_fused_adamw_", lambda *a, **k: taken.append("kernel") or real(*a, **k))
        own = run(tx, params, grads)
    assert not taken
    torch.testing.assert_close(got[0], own[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], own[1])  # (the kernel's moments round as its own arithmetic does)
    decayed_first = got[2][0]["embed"] - undecayed_first_update(params, grads[0])["embed"]
    torch.testing.assert_close(decayed_first, -LR * WD * params["embed"], rtol=1e-5, atol=1e-9)


def undecayed_first_update(params: TensorDict, g: TensorDict) -> TensorDict:
    tx = muonfn.adamw(LR, weight_decay=0.0)
    return tx.update(g, tx.init(params), params)[0]


def test_the_torch_kernel_route_keeps_an_undonated_state(torch_kernel_on_the_cpu) -> None:
    """The kernel writes the moments in place: an undonated update writes them into copies, so the
    state it was given is unchanged, and it returns what the donated update returns."""
    params, grads = params_and_grads(2)
    plain, donating = muonfn.adamw(LR, weight_decay=WD), muonfn.adamw(LR, weight_decay=WD, donate_state=True)
    state = plain.init(params)
    state = plain.update(grads[0], state, params)[1]
    before = state.clone()
    updates, new = plain.update(grads[1], state, params)
    assert_bitwise(state, before)
    donated_updates, donated = donating.update(grads[1], before.clone(), params)
    assert_bitwise(updates, donated_updates)
    assert_bitwise(new, donated)


@pytest.mark.parametrize("as_tensor", ["host", "device"])
def test_the_torch_kernel_route_takes_a_tensor_learning_rate(torch_kernel_on_the_cpu, as_tensor: str) -> None:
    """A 0-d learning rate on the leaves' device goes to the kernel as a tensor (the CPU's own
    tensors stand for a GPU's here), with the bits of the same rate as a number."""
    params, grads = params_and_grads(2)
    expected = run(muonfn.adamw(LR, weight_decay=WD), params, grads)
    lr = torch.tensor(LR, dtype=torch.float64)
    got = run(muonfn.adamw(lr, weight_decay=torch.tensor(WD, dtype=torch.float64)), params, grads)
    assert_bitwise(got[0], expected[0])


def test_the_torch_kernel_route_with_a_zero_learning_rate_leaves_the_parameters(torch_kernel_on_the_cpu) -> None:
    params, grads = params_and_grads(1)
    got = run(muonfn.adamw(0.0, weight_decay=WD), params, grads)
    assert torch.equal(got[0]["embed"], params["embed"]) and bool(got[1]["exp_avg", "embed"].abs().sum() > 0)
    assert all(bool(torch.isfinite(u).all()) for u in got[2][0].values())


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


@pytest.mark.parametrize("case", ["cpu", "ensemble", "vmap", "bf16", "fp16", "recorded", "transposed"])
def test_elsewhere_the_rule_runs_its_own_passes(case: str) -> None:
    """The CPU, a stacked or vmapped ensemble (whose members keep one formula), a leaf that is not
    fp32, a step that autograd records, and a leaf that is not contiguous (CUDA's kernel refuses
    tensors of one leaf whose strides differ) take the rule's own passes."""
    params, _ = params_and_grads(1)
    device = "cpu" if case == "cpu" else "meta"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case, torch.float32)
    params = params.apply(lambda t: torch.zeros(t.shape, device=device, dtype=dtype))
    tx = muonfn.adamw(LR, weight_decay=WD)
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


def test_a_tensor_beta1_on_the_host_takes_the_torch_kernel_as_a_number(torch_kernel_on_the_cpu, off_the_cpu) -> None:
    """Off the CPU, in an eager step, a host beta1 is read as a number and the update takes torch's
    kernel, with the bits of that number."""
    params, grads = params_and_grads(len(BETA1S))

    def make(beta1):  # type: ignore[no-untyped-def]
        return muonfn.adamw(LR, betas=(beta1, 0.99), weight_decay=0.0)

    expected = with_beta1_each_step(make, params, grads)
    tx = make(torch.tensor(BETA1S[0], dtype=torch.float64))
    assert kernel_calls(lambda: tx.update(grads[0], tx.init(params), params)) == 1
    got = with_a_tensor_beta1(make, params, grads)
    assert_bitwise(got[0], expected[0])
    assert_bitwise(got[1], expected[1])
