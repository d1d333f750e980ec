"""The traffic counter of ``benchmarks/traffic.py``: right on cases counted by hand, and the targets on
GPT-2 small's parameter shapes (the meta device: shapes only, no memory): issue 26's, and issue 39's
"no worse than before the redesign" (the figures of the design it replaced, 0.1.0).

Each target not met yet is marked ``xfail(strict=True)``, so that the day it is met
the test turns red and its mark is removed. The issue's "aten ops" (141 for the donated step in
the GPU run's count) are the ops that run a kernel, :attr:`Summary.kernel_ops` here; its peak
memory target is in the counter's CPU accounting (storages the step creates, above the
parameters, gradients and state).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import muonfn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _sets
import traffic

F32 = 4  # bytes


def counted(step) -> traffic.Summary:
    return traffic.count_step(step)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_an_add_reads_both_operands_and_writes_its_result(device: str) -> None:
    a, b = torch.ones(3, 4, device=device), torch.ones(3, 4, device=device)
    s = counted(lambda: a + b)
    assert (s.aten_ops, s.kernel_ops) == (1, 1)
    assert (s.read_bytes, s.written_bytes) == (2 * 12 * F32, 12 * F32)
    assert s.temporaries_peak_bytes == 12 * F32 and s.matmul_flops == 0


def test_a_matmul_counts_flops_not_traffic() -> None:
    a, b = torch.ones(2, 3), torch.ones(3, 5)
    s = counted(lambda: a @ b)
    assert s.matmul_flops == 2 * 2 * 3 * 5
    assert s.nonmatmul_bytes == 0 and s.matmul_bytes == (6 + 15 + 10) * F32
    x, y = torch.ones(4, 2, 3), torch.ones(4, 3, 5)
    assert counted(lambda: torch.baddbmm(torch.ones(4, 2, 5), x, y)).matmul_flops == 4 * 2 * 2 * 3 * 5


def test_in_place_out_and_copy_ops_count_what_they_write() -> None:
    a, b = torch.ones(8), torch.ones(8)
    s = counted(lambda: a.add_(b))  # reads a and b, writes a
    assert (s.read_bytes, s.written_bytes, s.temporaries_peak_bytes) == (16 * F32, 8 * F32, 0)
    s = counted(lambda: a.copy_(b))  # the destination is not read
    assert (s.read_bytes, s.written_bytes) == (8 * F32, 8 * F32)
    out = torch.empty(8)
    s = counted(lambda: torch.mul(a, b, out=out))  # an out= argument is not read
    assert (s.read_bytes, s.written_bytes, s.temporaries_peak_bytes) == (16 * F32, 8 * F32, 0)
    s = counted(lambda: torch.mul(a, out, out=out))  # an out= argument read as an operand is read
    assert (s.read_bytes, s.written_bytes) == (16 * F32, 8 * F32)
    s = counted(lambda: torch._foreach_mul_([a, out], 2.0))  # one op for the list
    assert (s.aten_ops, s.read_bytes, s.written_bytes) == (1, 16 * F32, 16 * F32)


def test_an_op_that_writes_an_argument_and_returns_a_tensor_counts_both() -> None:
    """Batch norm in training updates its running statistics in place and returns its output with the
    batch's mean and inverse deviation: it reads the input and both statistics and writes the
    statistics and its three results; an in-place aten op's returned self is not counted again."""
    x, m = torch.empty(6, 5, device="meta"), torch.empty(6, 5, device="meta")
    mean, var = torch.zeros(5, device="meta"), torch.ones(5, device="meta")
    s = counted(lambda: torch.ops.aten._native_batch_norm_legit(x, None, None, mean, var, True, 0.1, 1e-5))
    assert (s.kernel_ops, s.read_bytes, s.written_bytes) == (1, (30 + 2 * 5) * F32, (2 * 5 + 30 + 2 * 5) * F32)
    s = counted(lambda: m.mul_(2.0))
    assert (s.read_bytes, s.written_bytes) == (30 * F32, 30 * F32)


def test_views_and_allocations_move_nothing_and_launch_nothing() -> None:
    a = torch.ones(6, 4)
    views = lambda: (a.t(), a.view(4, 6), a[1:3], a.detach())  # noqa: E731
    s = counted(lambda: (*views(), torch.empty_like(a), torch.promote_types(a.dtype, torch.float16)))
    assert s.aten_ops >= 6 and s.kernel_ops == 0 and s.nonmatmul_bytes == 0
    s = counted(lambda: a.t() * 2)  # a transposed read counts the view's elements
    assert (s.kernel_ops, s.read_bytes, s.written_bytes) == (1, 24 * F32, 24 * F32)


def test_a_broadcast_operand_is_read_once() -> None:
    a, row = torch.ones(5, 4), torch.ones(4)
    s = counted(lambda: a + row)
    assert s.read_bytes == (20 + 4) * F32
    assert counted(lambda: a + row.expand(5, 4)).read_bytes == (20 + 4) * F32


def test_a_reduction_into_a_wider_dtype_counts_the_copy_torch_makes_first() -> None:
    """TensorIterator reduces in one dtype: an fp32 input's fp64 norm copies it into fp64 first
    (read 4, write 8, read 8 bytes an entry), on a GPU too, but for bf16 into fp32 there; the
    multi-tensor norm widens as it loads."""
    x = torch.ones(10, 4, device="meta")
    s = counted(lambda: torch.linalg.vector_norm(x, dtype=torch.float64))
    assert s.read_bytes == 40 * (4 + 8) and s.written_bytes == 40 * 8 + 8
    narrow = torch.ones(10, 4, dtype=torch.bfloat16, device="meta")
    assert counted(lambda: torch.linalg.vector_norm(narrow, dtype=torch.float32)).read_bytes == 40 * 2
    on_cpu = torch.ones(10, 4, dtype=torch.bfloat16)
    assert counted(lambda: torch.linalg.vector_norm(on_cpu, dtype=torch.float32)).read_bytes == 40 * (2 + 4)
    assert counted(lambda: torch.sum(x, dtype=torch.float64)).read_bytes == 40 * (4 + 8)
    assert counted(lambda: torch.linalg.vector_norm(x)).read_bytes == 40 * 4
    assert counted(lambda: torch._foreach_norm([x, x], 2, dtype=torch.float64)).read_bytes == 2 * 40 * 4


def test_a_multi_tensor_op_off_its_fast_path_launches_a_kernel_per_tensor() -> None:
    """torch's fused multi-tensor kernels need one device and dtype (a copy: one dtype a list), and
    equal sizes and strides at each index; a factor per leaf (0-d tensors against full ones) runs
    the op tensor by tensor."""
    xs = [torch.ones(4, 3, device="meta"), torch.ones(5, device="meta"), torch.ones(2, 2, device="meta")]
    ys = [torch.ones_like(x) for x in xs]
    factors = [torch.tensor(2.0, device="meta") for _ in xs]
    mats = [torch.ones(4, 3, device="meta"), torch.ones(2, 5, device="meta")]
    turned = [torch.ones(3, 4, device="meta"), torch.ones(5, 2, device="meta")]
    for step, launches in [
        (lambda: torch._foreach_mul(xs, 2.0), 1),
        (lambda: torch._foreach_mul(xs, torch.tensor(2.0)), 1),  # one host factor for all
        (lambda: torch._foreach_add(xs, ys), 1),
        (lambda: torch._foreach_mul(xs, factors), 3),
        (lambda: torch._foreach_add(xs, [y.to(torch.bfloat16) for y in ys]), 3),
        (lambda: torch._foreach_add(mats, [y.mT for y in turned]), 2),  # a transposed view's strides
        (lambda: torch._foreach_copy_(xs, [y.to(torch.bfloat16) for y in ys]), 1),  # (a copy casts on its fast path)
        (lambda: torch._foreach_copy_(xs, [ys[0].to(torch.bfloat16), *ys[1:]]), 3),  # (but one dtype a list)
        (lambda: torch._foreach_copy_(mats, [y.mT for y in turned]), 2),
    ]:
        s = counted(step)
        assert s.launches - (s.kernel_ops - 1) == launches
    cpu = [torch.ones(3), torch.ones(4)]
    assert counted(lambda: torch._foreach_mul(cpu, [torch.tensor(2.0)] * 2)).launches == 1  # (counted per op there)


def test_temporaries_peak_at_the_most_bytes_alive_at_once() -> None:
    x = torch.ones(1000)  # 4000 bytes, there before the step: not counted

    def step() -> torch.Tensor:
        t = x * 2  # 4000 alive
        u = t + 1  # 8000
        del t  # 4000
        v = u.view(10, 100) * 3  # 8000 (the view shares u's storage)
        return v  # u freed on return: 4000 left

    s = counted(step)
    assert s.temporaries_peak_bytes == 8000
    assert s.temporaries_left_bytes == 4000


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_results_in_their_own_dtype_take_a_pass_only_where_tall(dtype) -> None:
    """Off the CPU (meta), a call whose iteration runs in its matrices' own dtype (a bf16 model's,
    or fp32 with an fp32 iteration) hands its wide results back where the iteration left them:
    the one pass that restores results is the tall ones' transposing copy, reading and writing
    each of their entries once."""
    wide = torch.empty(16, 48, dtype=dtype, device="meta")
    tall = torch.empty(48, 16, dtype=dtype, device="meta")
    ns, orthogonalizer = muonfn.NewtonSchulz(dtype=dtype), muonfn.LocalOrthogonalizer()

    def copies(tensors: list[torch.Tensor]) -> tuple[int, int]:
        """The calls and bytes of the copies (``copy_``, ``clone``) of one call over ``tensors``."""
        views = [muonfn.MatrixView()] * len(tensors)
        s = counted(lambda: orthogonalizer([str(i) for i in range(len(tensors))], tensors, views, ns, lambda a, b: 1.0))
        rows = [s.by_op[op] for op in ("copy_", "clone") if op in s.by_op]
        return sum(r["calls"] for r in rows), sum(r["bytes"] for r in rows)

    assert copies([wide, wide.clone(), tall]) == (1, 2 * dtype.itemsize * tall.numel())
    assert copies([wide, wide.clone()]) == (0, 0)


# --- GPT-2 small on the meta device ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_small() -> dict[str, traffic.Summary]:
    ps = _sets.gpt2("gpt2-small", device="meta")
    ns = muonfn.NewtonSchulz(dtype=torch.bfloat16)  # CUDA's default Newton–Schulz dtype
    builders = traffic.contenders(ps, {"ns": ns})
    names = ("muonfn donated", "muonfn shim", "torch Muon + AdamW foreach")
    summaries = {name: traffic.count_contender(builders[name]) for name in names}
    return {**summaries, "ns_flops": ps.ns_flops(), "floor": traffic.floor_bytes(ps)}  # type: ignore[dict-item]


def test_the_counter_sees_every_newton_schulz_flop_and_more_than_the_floor(gpt2_small) -> None:
    """Each step's matmuls are its Newton–Schulz iterations, counted by an independent formula, and
    no step moves less than what the update must touch."""
    for name in ("muonfn donated", "muonfn shim", "torch Muon + AdamW foreach"):
        s = gpt2_small[name]
        assert s.matmul_flops == pytest.approx(gpt2_small["ns_flops"], rel=1e-9), name
        assert s.nonmatmul_bytes > gpt2_small["floor"], name
        assert s.kernel_ops < s.aten_ops, name


def test_muonfn_steps_keep_torchs_fused_multi_tensor_kernels(gpt2_small) -> None:
    """Off the CPU no muonfn op runs tensor by tensor over many leaves: a factor per leaf (AdamW's
    bias corrections, its decay, a refilled momentum) would launch a kernel per leaf. The few
    launches above one per op are the per-leaf factors of the two leaves of at least 2**16
    elements (the embeddings), which take one kernel each either way."""
    for name in ("muonfn donated", "muonfn shim"):
        s = gpt2_small[name]
        assert s.launches <= s.kernel_ops + 4, name


def test_a_bf16_models_step_restores_only_its_tall_matrices_results() -> None:
    """A bf16 GPT-2 small stepped with bf16 Newton–Schulz (CUDA's default; meta): the iterations'
    results are its updates' dtype, so only the tall matrices' (the attention's and the MLP's up
    projections) take a pass, their transposing copy (``copy_`` or ``clone``), 4 bytes an entry; the
    wide and square ones' results stay where their iteration left them."""
    import _contenders as C

    ps = _sets.gpt2("gpt2-small", device="meta", dtype=torch.bfloat16)
    tall = sum(p.numel() for _, p in ps.matrix_params() if p.shape[0] > p.shape[1])
    assert 0 < tall < sum(p.numel() for _, p in ps.matrix_params())
    s = traffic.count_contender(lambda: C.make_donated(ps, ns=muonfn.NewtonSchulz(dtype=torch.bfloat16)))
    assert sum(s.by_op[op]["bytes"] for op in ("copy_", "clone") if op in s.by_op) == 4 * tall


TARGET = "issue 26's target, not met yet (the hot path rewrite removes this mark)"
KERNELS_REMOVED = (
    "issue 26's target, not met: muonfn's Triton kernels met it (5.97 GB) and were removed in 0.2.0, never "
    "validated on a GPU; the eager GPU forms meet issue 39's targets below"
)
#: Issue 39's "no worse": the figures of 0.1.0, the design the redesign replaced, counted as here
#: (kernel ops, non-matmul bytes, bytes of temporaries at their peak).
FIGURES = ("kernel_ops", "nonmatmul_bytes", "temporaries_peak_bytes")
BEFORE_THE_REDESIGN = {
    "muonfn donated": (77, 8_011_552_000, 764_412_288),  # 77, 8.01 GB, 729 MB
    "muonfn shim": (249, 8_011_552_040, 154_389_516),  # 249, 8.01 GB, 147 MB
}
#: The shim's parts are 0.1.0's (a tenth of the model, same-shape matrices together: 9 Newton–Schulz
#: calls); in one part it runs the donated step's kernels (77), its scheduled scalars refilled only
#: when their value changes. In parts the core's Newton–Schulz copies a few results more than
#: 0.1.0's did; without the idle refills the step still fits 0.1.0's 249 kernel ops (248).


@pytest.mark.xfail(strict=True, reason=KERNELS_REMOVED)
@pytest.mark.parametrize("name", ["muonfn donated", "muonfn shim"])
def test_nonmatmul_bytes_at_most_6_gb(gpt2_small, name: str) -> None:
    assert gpt2_small[name].nonmatmul_bytes <= 6.0e9


def test_donated_step_runs_at_most_100_kernel_ops(gpt2_small) -> None:
    assert gpt2_small["muonfn donated"].kernel_ops <= 100


@pytest.mark.xfail(strict=True, reason=TARGET)
def test_shim_step_runs_at_most_120_kernel_ops(gpt2_small) -> None:
    assert gpt2_small["muonfn shim"].kernel_ops <= 120


def test_shim_temporaries_within_10_percent_of_torch_foreach(gpt2_small) -> None:
    ours = gpt2_small["muonfn shim"].temporaries_peak_bytes
    theirs = gpt2_small["torch Muon + AdamW foreach"].temporaries_peak_bytes
    assert ours <= 1.1 * theirs


@pytest.mark.parametrize("figure", FIGURES)
def test_the_donated_step_is_no_worse_than_before_the_redesign(gpt2_small, figure: str) -> None:
    before = dict(zip(FIGURES, BEFORE_THE_REDESIGN["muonfn donated"]))
    assert getattr(gpt2_small["muonfn donated"], figure) <= before[figure]


@pytest.mark.parametrize("figure", FIGURES)
def test_the_shims_step_is_no_worse_than_before_the_redesign(gpt2_small, figure: str) -> None:
    before = dict(zip(FIGURES, BEFORE_THE_REDESIGN["muonfn shim"]))
    assert getattr(gpt2_small["muonfn shim"], figure) <= before[figure]


def test_memory_counts_the_states_bytes_per_parameter_exactly() -> None:
    """``traffic.py --memory`` on a shrunk GPT-2 (meta): fp32 state 4 bytes a Muon parameter and 8 an AdamW
    one, bf16 state half, torch.optim.Muon + AdamW as fp32 muonfn; plus each one's step counts, to the byte."""
    ps = _sets.gpt2("gpt2-small", device="meta", width=64, depth=2, vocab=101, context=16)
    matrices, others = len(ps.matrix_params()), len(ps.other_params())
    numel = {
        "muon": sum(p.numel() for _, p in ps.matrix_params()),
        "adamw": sum(p.numel() for _, p in ps.other_params()),
    }
    ns = {"ns": muonfn.NewtonSchulz(dtype=torch.bfloat16)}
    rows = traffic.memory(ps, ns, bitsandbytes=False)
    int64, f32 = 8, 4
    expected = {
        "muonfn, state_dtype params' dtype": {"muon": 4 * numel["muon"], "adamw": 8 * numel["adamw"] + int64 * others},
        "muonfn, state_dtype bf16": {
            "muon": 2 * numel["muon"] + int64 * matrices,  # the rounding key's update count per matrix
            "adamw": 4 * numel["adamw"] + int64 * others,
        },
        "torch Muon + AdamW": {"muon": 4 * numel["muon"], "adamw": 8 * numel["adamw"] + f32 * others},
    }
    assert {name: row["state_bytes"] for name, row in rows.items()} == expected
    for row in rows.values():
        assert row["bytes_per_param"] == {g: row["state_bytes"][g] / numel[g] for g in numel}
        assert all(b > 0 for b in row["temporaries_peak_bytes"].values())
    table = traffic.memory_table(rows)
    assert "| muonfn, state_dtype bf16 | 2.0" in table
