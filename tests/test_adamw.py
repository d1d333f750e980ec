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
