"""muonfn's Triton kernels (``muonfn/_kernels.py``, opt-in with ``MUONFN_TRITON=1``): each computes
the eager ops it replaces. ``--device cuda`` runs them compiled on the GPU, where each must give
those ops' bits. On a CPU they run under Triton's interpreter: the batch's kernel gives the bits,
and the two with a fused multiply-add give their formula's bits with the multiply-add rounded
twice, as the interpreter rounds it, within a rounding of torch's. The GPU's paths are forced on
the CPU where a test needs them (``cpu_passes``), as ``tests/test_newton_schulz.py`` does."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import muonfn
from muonfn import _kernels
from muonfn.linalg import MatrixView, _newton_schulz, orthogonalize_blocks

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import traffic


@pytest.fixture
def kernels(monkeypatch, device: torch.device) -> torch.device:
    """The kernels on, on ``device`` (the CPU under Triton's interpreter); the device."""
    monkeypatch.setenv(_kernels.TRITON_VARIABLE, "1")
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return device


def special_values(device: torch.device) -> torch.Tensor:
    """fp32 values at bf16's and fp16's edges: ties to even, subnormals, the largest finite
    numbers, infinities and NaN, in a 2×8 matrix."""
    tie = 1.0 + 2.0**-8  # halfway between two bf16 neighbours of 1
    return torch.tensor(
        [
            [tie, 1.0 + 3 * 2.0**-8, -tie, 1e-40, -1e-40, 6e-8, 1e-45, 0.0],
            [3.3961e38, -3.3961e38, 65520.0, 65504.0, float("inf"), float("-inf"), float("nan"), -0.0],
        ],
        device=device,
    )


def eager_product(
    matrices: list[torch.Tensor], norms: torch.Tensor, dtype: torch.dtype, eps: float, factor: float, add: bool
) -> torch.Tensor:
    """Newton–Schulz's eager normalisation into ``dtype`` of the stack, given its fp64 norms."""
    denominator = norms.view(-1, 1, 1) * factor
    reciprocal = (denominator + eps if add else denominator.clamp_min(eps)).reciprocal()
    stack = torch.stack(matrices)
    return torch.mul(stack, reciprocal, out=torch.empty(stack.shape, dtype=dtype, device=stack.device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (12, 20), (64, 64), (65, 130)])
def test_scaled_stack_is_torchs_product_into_a_narrow_dtype_bit_for_bit(kernels, dtype, shape) -> None:
    """``scaled_stack`` writes the eager normalisation's bits, ``torch.mul(torch.stack(m), r,
    out=<dtype>)`` with ``r`` the fp64 reciprocal of ``max(c·norm, ε)`` (or ``c·norm + ε``):
    matrices read from their own memory (contiguous, or a tall matrix's transpose), products in
    fp64 rounded to fp32 and then to ``dtype``, across tile edges, for ordinary and extreme values
    and norms below ε."""
    g = torch.Generator().manual_seed(sum(shape))
    rows, cols = shape
    matrices = [torch.randn(rows, cols, generator=g) * 10.0**k for k in (-30, 0, 3)]
    matrices.append(torch.randn(cols, rows, generator=g).mT)  # read across its rows
    matrices = [m.to(kernels) for m in matrices]
    norms = torch.tensor([1e-30, 3.0, 1.4e3, 1e-9], dtype=torch.float64, device=kernels)  # (the last below ε)
    for eps, factor, add in ((1e-7, 1.0, False), (1e-7, 1.01, False), (1e-3, 1.0, True)):
        got = _kernels.scaled_stack(matrices, norms, dtype, eps, factor, add)
        assert got.shape == (4, rows, cols) and got.dtype == dtype and got.is_contiguous()
        expected = eager_product(matrices, norms, dtype, eps, factor, add)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (eps, factor, add)
    edges = special_values(kernels)
    ones = torch.ones(2, dtype=torch.float64, device=kernels)
    got = _kernels.scaled_stack([edges, edges * 3], ones, dtype, 1e-7, 1.0, False)
    expected = eager_product([edges, edges * 3], ones, dtype, 1e-7, 1.0, False)
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got.view(torch.int16)[finite], expected.view(torch.int16)[finite])  # (-0.0 and subnormals too)


def test_the_kernels_are_off_unless_asked_for(monkeypatch) -> None:
    """Off by default; ``MUONFN_TRITON`` must be 0 or 1; on, they take plain tensors of an eager
    step on meta (counted), on CUDA, or on a CPU under the interpreter, and nothing that autograd
    records or a ``torch.func`` transform maps."""
    cpu, meta = torch.ones(2, 3), torch.ones(2, 3, device="meta")
    monkeypatch.delenv(_kernels.TRITON_VARIABLE, raising=False)
    assert not _kernels.takes_kernels([meta])
    monkeypatch.setenv(_kernels.TRITON_VARIABLE, "yes")
    with pytest.raises(ValueError, match="MUONFN_TRITON='yes'"):
        _kernels.takes_kernels([meta])
    monkeypatch.setenv(_kernels.TRITON_VARIABLE, "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _kernels.takes_kernels([meta]) and not _kernels.takes_kernels([cpu]) and not _kernels.takes_kernels([])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _kernels.takes_kernels([cpu])
    assert not _kernels.takes_kernels([cpu.requires_grad_()])
    seen = []
    torch.vmap(lambda x: seen.append(_kernels.takes_kernels([x])) or x)(torch.ones(2, 3))
    assert seen == [False]


def mixed_matrices(device: torch.device) -> list[torch.Tensor]:
    """An MLP's wide and tall matrices, a square one, and huge and zero ones, on ``device``."""
    g = torch.Generator().manual_seed(11)
    return [
        t.to(device)
        for t in (
            torch.randn(16, 48, generator=g),
            torch.randn(48, 16, generator=g),
            torch.randn(16, 48, generator=g) * 3e37,
            torch.randn(48, 16, generator=g),
            torch.randn(24, 24, generator=g),
            torch.zeros(24, 24),
        )
    ]


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float16])
def test_newton_schulz_batches_are_the_same_bits_with_the_kernel(monkeypatch, kernels, method, ns_dtype) -> None:
    """With the GPU's paths, every batch of an orthogonalizer call is normalised into ``ns_dtype``
    by the kernel (counted here), and each result is the eager path's bits."""
    if kernels.type == "cpu":
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    matrices = mixed_matrices(kernels)
    views = [MatrixView()] * len(matrices)
    ns = muonfn.NewtonSchulz("polar_express", dtype=ns_dtype, method=method)
    scale = muonfn.linalg.shape_scale("match_rms_adamw")
    counter = traffic.TrafficCounter()
    with counter:
        fused = orthogonalize_blocks(matrices, views, ns, scale)
    assert sum(op.name == "scaled_stack" for op in counter.ops) == 2  # the 16×48 call and the 24×24 one
    monkeypatch.setenv(_kernels.TRITON_VARIABLE, "0")
    eager = orthogonalize_blocks(matrices, views, ns, scale)
    for a, b, m in zip(fused, eager, matrices):
        assert torch.equal(a, b) and a.shape == m.shape and a.is_contiguous()


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_an_fp64_iteration_of_fp32_matrices_keeps_the_eager_bits(monkeypatch, kernels, method) -> None:
    """The batch's kernel is written for 16-bit batches: it rounds each product to fp32 on the
    way. An fp64 iteration of fp32 matrices (the GPU's paths) does not take it, and each result
    is the eager ops' bits, which keep the fp64 product."""
    if kernels.type == "cpu":
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    matrices = mixed_matrices(kernels)
    views = [MatrixView()] * len(matrices)
    ns = muonfn.NewtonSchulz("polar_express", dtype=torch.float64, method=method)
    scale = muonfn.linalg.shape_scale("match_rms_adamw")
    counter = traffic.TrafficCounter()
    with counter:
        fused = orthogonalize_blocks(matrices, views, ns, scale)
    assert not any(op.name == "scaled_stack" for op in counter.ops)
    monkeypatch.setenv(_kernels.TRITON_VARIABLE, "0")
    eager = orthogonalize_blocks(matrices, views, ns, scale)
    for a, b, m in zip(fused, eager, matrices):
        assert torch.equal(a, b) and a.dtype == m.dtype == torch.float32


def test_a_muon_step_is_the_same_bits_with_the_kernels(monkeypatch, kernels) -> None:
    """``muon``'s update and state, functional and through the shim, are the same bits with the
    kernels on and off (the GPU's paths, bf16 Newton–Schulz). On a CPU the kernels with a fused
    multiply-add (the momentum's, the decay's) are left out: the interpreter rounds those twice,
    and a CPU's torch fuses them or not by its instruction set (their own tests below)."""
    if kernels.type == "cpu":
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
        monkeypatch.setattr(_kernels, "takes_ema_nesterov", lambda *args: False)
        monkeypatch.setattr(_kernels, "takes_widened_decayed", lambda *args: False)
    matrices = mixed_matrices(kernels)
    params = TensorDict({f"w{i}": m.clone() / 1e37 for i, m in enumerate(matrices)} | {"b": torch.ones(5)}, [])
    params = params.to(kernels)
    grads = params.apply(lambda p: torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p))

    def steps(on: str) -> tuple[TensorDict, TensorDict]:
        monkeypatch.setenv(_kernels.TRITON_VARIABLE, on)
        tx = muonfn.muon(lr=0.02, ns_dtype=torch.bfloat16)
        state, p = tx.init(params), params.clone()
        for _ in range(2):
            updates, state = tx.update(grads, state, p)
            p = muonfn.apply_updates(p, updates)
        return p, state

    (p_on, s_on), (p_off, s_off) = steps("1"), steps("0")
    assert (p_on == p_off).all() and (s_on == s_off).all()
    shims = []
    for on in ("1", "0"):
        monkeypatch.setenv(_kernels.TRITON_VARIABLE, on)
        model = torch.nn.ParameterDict({k: torch.nn.Parameter(v.clone()) for k, v in params.items()})
        opt = muonfn.optim.Muon(model.named_parameters(), lr=0.02, ns_dtype=torch.bfloat16)
        for _ in range(2):
            for k, p in model.items():
                p.grad = grads[k].clone()
            opt.step()
        shims.append({k: p.detach().clone() for k, p in model.items()})
    assert all(torch.equal(shims[0][k], shims[1][k]) for k in shims[0])


def test_the_counter_sees_the_kernel_move_8_bytes_an_entry_less(monkeypatch) -> None:
    """On meta (a GPU's paths, counted), the kernel replaces the fp32 stack, the ops over the norms
    and the product into bf16: it reads each matrix once and writes the bf16 batch, 8 bytes a
    matrix entry less, and three ops fewer."""
    wide, tall = torch.empty(16, 48, device="meta"), torch.empty(48, 16, device="meta")
    matrices = [wide, wide.clone(), tall.mT]
    ns = muonfn.NewtonSchulz(dtype=torch.bfloat16)
    counts = {}
    for on in ("0", "1"):
        monkeypatch.setenv(_kernels.TRITON_VARIABLE, on)
        counts[on] = traffic.count_step(lambda: ns.orthogonalize_matrices(matrices, 1))
    entries = 3 * 16 * 48
    # the stack (8 bytes an entry), and the clamp and the reciprocal of the fp64 norms (32 a matrix)
    assert counts["0"].nonmatmul_bytes - counts["1"].nonmatmul_bytes == 8 * entries + 32 * 3
    assert (
        counts["1"].kernel_ops == counts["0"].kernel_ops - 3
    )  # (the stack, and the clamp and reciprocal of the norms)


@pytest.mark.parametrize("contender", ["donated", "shim"])
def test_the_counter_sees_a_step_move_24_bytes_a_muon_entry_less(monkeypatch, contender: str) -> None:
    """On GPT-2 small's shapes (meta), the kernels take the fp32 stack (8 bytes a Muon entry), the
    momentum's second pass (8) and the decay's own pass over the results (8): exactly 24 bytes a
    Muon entry less, donated and through the shim, and the ops over each matrix's norm."""
    import _contenders as C
    import _sets

    ps = _sets.gpt2("gpt2-small", device="meta")
    muon_entries = sum(p.numel() for _, p in ps.matrix_params())
    monkeypatch.delenv(_kernels.TRITON_VARIABLE, raising=False)
    make = C.make_donated if contender == "donated" else C.make_shim
    eager = traffic.count_contender(lambda: make(ps, ns_dtype=torch.bfloat16))
    fused = traffic.count_contender(C.with_triton_kernels(lambda: make(ps, ns_dtype=torch.bfloat16)))
    matrices = len(ps.matrix_shapes())  # (each one's norm is clamped and inverted in the kernel: 32 bytes)
    assert eager.nonmatmul_bytes - fused.nonmatmul_bytes == 24 * muon_entries + 32 * matrices


def within_a_rounding(
    x: torch.Tensor, y: torch.Tensor, start: torch.Tensor, end: torch.Tensor, roundings: int = 1
) -> bool:
    """``|x - y|`` at most ``roundings`` fp32 roundings of the larger operand of a lerp, entry by entry."""
    bound = roundings * torch.finfo(torch.float32).eps * torch.maximum(start.abs(), end.abs())
    return bool(((x - y).abs() <= bound).all())


def lerp_rounded_twice(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """torch.lerp's formula in fp32 with its multiply-adds rounded twice, as Triton's interpreter
    computes ``tl.fma``."""
    w = torch.tensor(weight, dtype=torch.float32)
    diff = end - start
    return start + w * diff if w.abs() < 0.5 else end - diff * (1 - w)


@pytest.mark.parametrize("mu", [0.95, 0.3])
@pytest.mark.parametrize("donated", [True, False])
def test_ema_nesterov_is_the_two_lerps(kernels, mu: float, donated: bool) -> None:
    """``ema_nesterov_``/``ema_nesterov`` give the new momentum ``lerp(b, g, 1 - mu)`` and the
    look-ahead ``lerp(g, b_t, mu)`` for leaves of many sizes (block edges, one entry, none):
    torch's bits on a GPU; on a CPU, the interpreter's (two roundings per fused multiply-add),
    within a rounding of torch's lerp."""
    g = torch.Generator().manual_seed(2)
    shapes = [(3, 5), (4096,), (4097,), (1,), (0, 3), (64, 130)]
    grads = [torch.randn(s, generator=g).to(kernels) for s in shapes]
    momentum = [torch.randn(s, generator=g).to(kernels) * 3 for s in shapes]
    given = [b.clone() for b in momentum]
    if donated:
        new, look = momentum, _kernels.ema_nesterov_(momentum, grads, mu)
    else:
        both = _kernels.ema_nesterov(momentum, grads, mu)
        new, look = both[: len(shapes)], both[len(shapes) :]
        assert all(torch.equal(a, b) for a, b in zip(momentum, given))  # not written
    torch_new = torch._foreach_lerp(given, grads, 1.0 - mu)
    torch_look = torch._foreach_lerp(grads, torch_new, mu)
    for b, u, tb, tu, b0, g0 in zip(new, look, torch_new, torch_look, given, grads):
        assert b.shape == u.shape == g0.shape
        if kernels.type == "cuda":
            assert torch.equal(b, tb) and torch.equal(u, tu)
            continue
        assert torch.equal(b, lerp_rounded_twice(b0, g0, 1.0 - mu))
        assert torch.equal(u, lerp_rounded_twice(g0, b, mu))
        # (torch's look-ahead blends torch's momentum, itself a rounding apart)
        assert within_a_rounding(b, tb, b0, g0) and within_a_rounding(u, tu, g0, b, roundings=2)


def test_the_momentum_takes_its_kernel_in_a_step(monkeypatch, kernels) -> None:
    """``ema_momentum``'s Nesterov form runs as one kernel call per update (counted), donated or
    not, and gives the eager update within the kernel's rounding (its bits on a GPU)."""
    g = torch.Generator().manual_seed(5)
    params = TensorDict({"a": torch.randn(6, 9, generator=g), "b": torch.randn(9, 6, generator=g)}, []).to(kernels)
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g).to(p))
    results = {}
    for on in ("1", "0"):
        monkeypatch.setenv(_kernels.TRITON_VARIABLE, on)
        for donate in (True, False):
            tx = muonfn.ema_momentum(0.9, donate_state=donate)
            state = tx.init(params)
            counter = traffic.TrafficCounter()
            with counter:
                updates, state = tx.update(grads, state, params)
            names = [op.name for op in counter.ops if op.kind == "kernel"]
            assert names.count("ema_nesterov_" if donate else "ema_nesterov") == (on == "1")
            results[on, donate] = (updates, state)
    for donate in (True, False):
        (u1, s1), (u0, s0) = results["1", donate], results["0", donate]
        for k in ("a", "b"):
            pairs = [(u1[k], u0[k]), (s1["momentum", k], s0["momentum", k])]
            scale = torch.maximum(grads[k].abs(), s0["momentum", k].abs() / 0.1)  # (a bound on both operands)
            for x, y in pairs:
                assert torch.equal(x, y) if kernels.type == "cuda" else within_a_rounding(x, y, scale, scale, 2)


def add_rounded_twice(u: torch.Tensor, p: torch.Tensor, alpha: float) -> torch.Tensor:
    """``u + alpha·p`` in fp32 with the product rounded first, as the interpreter takes ``tl.fma``."""
    return u + torch.tensor(alpha, dtype=torch.float32) * p


@pytest.mark.parametrize("into", ["a batch", "matrices of their own"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_decayed_is_the_copy_and_the_decay(kernels, dtype, into: str) -> None:
    """``widened_decayed_`` widens each result exactly into its output, the tall ones (the last
    ``turned``) into the memory of their own rows, whether the outputs are slices of one batch or
    matrices of their own, and adds ``alpha·p`` where a parameter is given (a tall one read across
    its rows): the copy and ``_foreach_add_(alpha=)``'s bits on a GPU; on a CPU the interpreter's
    (its multiply-add rounded twice), within a rounding of torch's."""
    g = torch.Generator().manual_seed(8)
    rows, cols, alpha = 20, 70, -0.02 * 0.1
    results = torch.randn(4, rows, cols, generator=g).to(kernels, dtype)
    wide_p = torch.randn(rows, cols, generator=g).to(kernels)
    tall_p = torch.randn(cols, rows, generator=g).to(kernels)
    params = [wide_p, None, tall_p.mT, None]  # results 2 and 3 stand for tall matrices
    if into == "a batch":
        batch = torch.full((4, rows, cols), float("nan"), device=kernels)
        wide, tall = list(batch[:2].unbind(0)), list(batch[2:].view(2, cols, rows).unbind(0))
    else:
        wide = [torch.full((rows, cols), float("nan"), device=kernels) for _ in range(2)]
        tall = [torch.full((cols, rows), float("nan"), device=kernels) for _ in range(2)]
    _kernels.widened_decayed_([*wide, *(t.mT for t in tall)], results, 2, params, alpha)
    widened = results.float()
    assert torch.equal(wide[1], widened[1]) and torch.equal(tall[1], widened[3].mT)  # no decay: a copy
    expected = [(wide[0], widened[0], wide_p), (tall[0], widened[2].mT, tall_p)]
    for got, u, p in expected:
        if kernels.type == "cuda":
            reference = [u.clone()]
            torch._foreach_add_(reference, [p], alpha=alpha)
            assert torch.equal(got, reference[0])
        else:
            assert torch.equal(got, add_rounded_twice(u, p, alpha))
            bound = torch.finfo(torch.float32).eps * (u.abs() + abs(alpha) * p.abs())
            assert ((got - u.add(p, alpha=alpha)).abs() <= bound).all()
    outputs = [torch.empty(rows, cols, device=kernels) for _ in range(4)]
    _kernels.widened_decayed_(outputs, results, 0, [None] * 4, alpha)
    assert torch.equal(torch.stack(outputs), widened)


def test_with_the_kernels_every_matrix_given_to_overwrite_holds_its_result(monkeypatch, kernels) -> None:
    """With a decay, the kernel that widens Newton–Schulz's results stores each, the tall ones
    too, into the memory of the matrix it came from when the matrices may be overwritten: the
    bits it stores into a new batch otherwise."""
    if kernels.type == "cpu":
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    g = torch.Generator().manual_seed(12)
    shapes = [(12, 20), (12, 20), (20, 12), (20, 12)]
    originals = [torch.randn(*shape, generator=g).to(kernels) for shape in shapes]
    params = [torch.randn(*shape, generator=g).to(kernels) for shape in shapes]
    decay = _newton_schulz.Decay([params[0], None, params[2].mT, params[3].mT], -0.002)
    f = muonfn.NewtonSchulz("keller", dtype=torch.bfloat16)
    expected = f.orthogonalize_matrices([*originals[:2], *(m.mT for m in originals[2:])], 2, decay=decay)
    inputs = [m.clone() for m in originals]
    counter = traffic.TrafficCounter()
    with counter:
        got = f.orthogonalize_matrices([*inputs[:2], *(m.mT for m in inputs[2:])], 2, decay=decay, overwrite_input=True)
    assert [op.name for op in counter.ops].count("widened_decayed_") == 1
    for result, wanted, m in zip(got, expected, inputs):
        assert torch.equal(result, wanted) and result.data_ptr() == m.data_ptr() and result.is_contiguous()


def test_the_decay_is_added_as_newton_schulzs_results_are_stored(monkeypatch, kernels) -> None:
    """With the kernels, ``muon``'s matrix branch hands its decay to the orthogonalizer, which adds
    it in the kernel that widens the results (counted): no decay pass of its own, the exempt
    leaves (``weight_decay_mask``) undecayed, and the update within a rounding of the eager one
    (its bits on a GPU)."""
    if kernels.type == "cpu":
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    matrices = mixed_matrices(kernels)[:4]
    params = TensorDict({f"w{i}": m.clone() / 1e37 for i, m in enumerate(matrices)}, []).to(kernels)
    grads = params.apply(lambda p: torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p))
    mask = {"w1": False}
    results = {}
    for on in ("1", "0"):
        monkeypatch.setenv(_kernels.TRITON_VARIABLE, on)
        tx = muonfn.muon(lr=0.02, weight_decay=0.5, ns_dtype=torch.bfloat16, weight_decay_mask=mask)
        state = tx.init(params)
        counter = traffic.TrafficCounter()
        with counter:
            updates, _ = tx.update(grads, state, params)
        names = [op.name for op in counter.ops]
        assert names.count("widened_decayed_") == (1 if on == "1" else 0)
        results[on] = updates
    for key in sorted(params.keys()):
        on, off = results["1"][key], results["0"][key]
        if kernels.type == "cuda":
            assert torch.equal(on, off), key
        else:
            bound = 2 * torch.finfo(torch.float32).eps * (off.abs() + 0.01 * params[key].abs())
            assert ((on - off).abs() <= bound).all(), key


def test_a_launch_table_is_copied_once_for_the_same_tensors(kernels) -> None:
    """The addresses and strides a launch reads are kept on the device by their values: stepping
    the same tensors again reads the table already there; other tensors get a table of their own."""
    matrices = [torch.randn(5, 7).to(kernels) for _ in range(2)]
    norms = torch.ones(2, dtype=torch.float64, device=kernels)
    _kernels.scaled_stack(matrices, norms, torch.bfloat16, 1e-7, 1.0, False)
    key = (matrices[0].device, torch.int64, tuple(m.data_ptr() for m in matrices))
    table = _kernels._TABLES[key]
    _kernels.scaled_stack(matrices, norms, torch.bfloat16, 1e-7, 1.0, False)
    assert _kernels._TABLES[key] is table and table.tolist() == list(key[2])
    others = [m.clone() for m in matrices]
    _kernels.scaled_stack(others, norms, torch.bfloat16, 1e-7, 1.0, False)
    assert _kernels._TABLES[others[0].device, torch.int64, tuple(m.data_ptr() for m in others)].tolist() == [
        m.data_ptr() for m in others
    ]


@pytest.mark.parametrize("experts", [(2, 24, 40), (2, 16, 48)])
def test_the_decay_reaches_every_kind_of_leaf_with_the_kernels(monkeypatch, kernels, experts) -> None:
    """With the kernels on, the decay handed to the orthogonalizer reaches every leaf it should and
    no other: plain matrices (in the widening kernel; with experts of their shape in their call,
    after it, as one multi-tensor add), a conv kernel, experts and a fused QKV (their views'
    results, one multi-tensor add: the eager bits), and not a masked one. Each update matches the
    eager one: bit for bit where no kernel's multiply-add is involved, else within a rounding (the
    interpreter's) or bit for bit on a GPU."""
    if kernels.type == "cpu":
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    g = torch.Generator().manual_seed(31)
    leaves = {
        "w": torch.randn(16, 48, generator=g),
        "up": torch.randn(48, 16, generator=g),
        "conv": torch.randn(8, 4, 3, 3, generator=g),
        "experts": torch.randn(*experts, generator=g),
        "qkv": torch.randn(48, 16, generator=g),
        "frozen": torch.randn(16, 48, generator=g),
    }
    params = TensorDict({k: v.to(kernels) for k, v in leaves.items()}, [])
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g).to(p))
    views = {"experts": MatrixView(batch_dims=1), "qkv": MatrixView(split=(16, 16, 16))}
    results = {}
    for on in ("1", "0"):
        monkeypatch.setenv(_kernels.TRITON_VARIABLE, on)
        tx = muonfn.muon(
            lr=0.02, weight_decay=0.5, ns_dtype=torch.bfloat16, views=views, weight_decay_mask={"frozen": False}
        )
        state = tx.init(params)
        counter = traffic.TrafficCounter()
        with counter:
            results[on], _ = tx.update(grads, state, params)
        widened = on == "1" and experts != (2, 16, 48)  # (a call with batches in it restores them eagerly)
        assert sum(op.name == "widened_decayed_" for op in counter.ops) == widened
    fused_decay = {"w", "up"} if experts != (2, 16, 48) else set()  # (decayed by the kernel's multiply-add)
    for key in leaves:
        on, off = results["1"][key], results["0"][key]
        if kernels.type == "cuda" or key not in fused_decay:
            assert torch.equal(on, off), key
        else:
            bound = 2 * torch.finfo(torch.float32).eps * (off.abs() + 0.01 * params[key].abs())
            assert ((on - off).abs() <= bound).all(), key
    undecayed = muonfn.muon(lr=0.02, weight_decay=0.0, ns_dtype=torch.bfloat16, views=views)
    plain, _ = undecayed.update(grads, undecayed.init(params), params)
    assert torch.equal(results["1"]["frozen"], plain["frozen"])  # (exempt: no decay at all)
    for key in ("conv", "experts", "qkv"):
        assert not torch.equal(results["1"][key], plain[key]), key  # (decayed)


def launch_signatures(dtype: torch.dtype) -> dict[str, tuple[dict[str, str], dict[str, object]]]:
    """Each kernel's arguments, typed as its launch passes them for a Newton–Schulz batch of
    ``dtype`` (a bf16 batch is stored as its int16 bits), and its compile-time constants."""
    narrow = "bf16" if dtype == torch.bfloat16 else "fp16"
    return {
        "scaled_stack": (
            {"addresses": "*i64", "strides": "*i64", "norms": "*fp64", "settings": "*fp64",
             "out": "*i16" if narrow == "bf16" else "*fp16", "rows": "i32", "cols": "i32",
             "ADD_EPS": "constexpr", "TILE": "constexpr", "BF16": "constexpr"},
            {"ADD_EPS": False, "TILE": _kernels._TILE, "BF16": narrow == "bf16"},
        ),
        "ema_nesterov": (
            {"momentum": "*i64", "grads": "*i64", "new_momentum": "*i64", "nesterov": "*i64", "numels": "*i64",
             "grad_weight": "fp32", "momentum_weight": "fp32", "BLOCK": "constexpr"},
            {"BLOCK": _kernels._BLOCK},
        ),
        "widened_decayed": (
            {"results": f"*{narrow}", "outputs": "*i64", "params": "*i64", "strides": "*i64", "alpha": "fp32",
             "rows": "i32", "cols": "i32", "kept": "i32", "TILE": "constexpr"},
            {"TILE": _kernels._TILE},
        ),
    }  # fmt: skip


@pytest.mark.parametrize("capability", [80, 90, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_compile_for_a_gpu_with_torchs_roundings(monkeypatch, capability: int, dtype) -> None:
    """Each kernel compiles, ahead of time and without a GPU, to a binary for NVIDIA's A100, H100
    and B200 (compute capability 8.0, 9.0, 10.0), with the roundings that give torch's bits there:
    the batch's reciprocal an IEEE fp64 division (``div.rn.f64``, as torch's fp64 reciprocal, not
    an approximation) and its product rounded to fp32 to nearest (``cvt.rn.f32.f64``); the lerps'
    and the decay's multiply-adds fused, rounded once (``fma.rn``), and no multiply rounded on its
    own."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = _kernels._compiled(False)
    for name, (signature, constants) in launch_signatures(dtype).items():
        compiled = triton.compile(ASTSource(kernels[name], signature, constants), GPUTarget("cuda", capability, 32))
        assert compiled.asm["cubin"], name
        ptx = compiled.asm["ptx"]
        assert not re.search(r"\b(rcp|div)\.(approx|full)", ptx), name
        assert not re.search(r"\bmul(\.rn)?\.f32", ptx), name
        if name == "scaled_stack":
            assert "div.rn.f64" in ptx and "cvt.rn.f32.f64" in ptx
            assert dtype == torch.bfloat16 or "cvt.rn.f16.f32" in ptx  # (bf16's rounding is on the bits)
        else:
            assert re.search(r"\bfma\.rn\.f32", ptx), name
