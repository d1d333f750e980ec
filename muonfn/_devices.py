"""What each device needs, apart from the math: the default Newton–Schulz dtype, whether a computation
may write into its own temporaries (:func:`may_write_into`: eager and unrecorded), and a GPU's forms.

The math (:mod:`muonfn.linalg`, :mod:`muonfn.steps`) is written once, in the form a CPU runs
fastest. A GPU (and the meta device, which stands for one in the traffic counter) moves fewer
bytes with two forms of its own, chosen here, by the tensors' device, in one function each:

- :func:`gpu_orthogonalized`: a Newton–Schulz batch of fp32 matrices iterated in a narrower dtype
  is normalised as it is built (each matrix's norm accumulated in fp64 from its own memory, the
  product by the reciprocal rounded to the narrow dtype as it is stored: no fp32 stack), and its
  results are stored into the matrices' own memory when they are the step's temporaries;
- :func:`adamw_kernel_takes`: torch's fused AdamW kernel (``torch._fused_adamw_``) for one
  model's plain fp32 leaves.

Their results equal the CPU form's to rounding (a norm summed in another order, a product
rounded once instead of twice), not bit for bit.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from operator import attrgetter
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ._tree import build, named_leaves, replaced

#: ``auto`` (measured), ``bfloat16`` or ``float32``: the CPU's Newton–Schulz dtype for a whole process
CPU_NS_DTYPE_VARIABLE = "MUONFN_CPU_NS_DTYPE"
CPU_NS_DTYPE_CHOICES = ("auto", "bfloat16", "float32")

#: On a CPU whose bf16 matmuls are faster, the least work (``m²n``, ``m <= n``) of one matrix whose
#: Newton–Schulz runs in bf16: below it the fixed cost of the bf16 kernels outweighs their speed.
CPU_BF16_MIN_WORK = 2**18


#: The least speedup of bf16 over fp32 matmuls, as :func:`cpu_bf16_probe` measures it, at which
#: the CPU rule iterates in bf16. CPUs fall far on either side of it: one bf16 product ran 2.0–2.2×
#: faster than fp32 on an AMD EPYC with AVX512-BF16 (a batch of them 4.4×), 0.4–0.6× as fast on an
#: Intel Xeon with AVX512-BF16 but no AMX, about 0.03× where bf16 is emulated. A gain below 1.3×
#: would not pay for bf16's rounding and the casts around the iteration, and the margin keeps a busy
#: machine's timing noise from deciding alone.
CPU_BF16_MIN_SPEEDUP = 1.3

# The probe times X Xᵀ, the product each Newton–Schulz step starts with, for one 256×512 matrix:
# m²n = 2²⁵, well inside the sizes the rule would run in bf16, and under a millisecond in fp32 on
# one core. It runs on one thread: the ratio is the core's (its bf16 units against its fp32 ones;
# 2.0× on one thread and on two on the AMD EPYC), and on a busy machine the OpenMP barriers of
# several threads waiting for cores made products of either dtype 10–60× slower at random. A first
# round warms up (oneDNN builds its bf16 kernels on first use); of the rounds after it, the fastest
# product of each dtype counts, since a busy machine only ever adds time. Where bf16 is emulated
# (each product then takes tens of milliseconds) the probe stops after two rounds: a bf16 product
# still _PROBE_HOPELESS times slower than fp32's leaves the answer settled.
_PROBE_SHAPE = (256, 512)
_PROBE_ROUNDS = 5
_PROBE_HOPELESS = 4.0


@dataclass(frozen=True)
class CpuBf16Probe:
    """What :func:`cpu_bf16_probe` measured: the fastest of a few products ``X Xᵀ`` of one 256×512
    matrix in fp32 and in bf16 on one thread, in seconds."""

    fp32_seconds: float
    bf16_seconds: float

    @property
    def speedup(self) -> float:
        """How many times faster the bf16 product ran (below 1: slower)."""
        return self.fp32_seconds / self.bf16_seconds if self.bf16_seconds > 0 else math.inf

    @property
    def bf16_faster(self) -> bool:
        """The CPU rule's answer: bf16 ran at least :data:`CPU_BF16_MIN_SPEEDUP` times faster."""
        return self.speedup >= CPU_BF16_MIN_SPEEDUP

    def as_dict(self) -> dict[str, float | bool]:
        """The timings, the speedup, the margin and the decision, for a record (JSON)."""
        return {
            **asdict(self),
            "speedup": self.speedup,
            "min_speedup": CPU_BF16_MIN_SPEEDUP,
            "bf16_faster": self.bf16_faster,
        }


@functools.cache
def cpu_bf16_probe() -> CpuBf16Probe:
    """Times bf16 against fp32 matmuls on this CPU, once per process: a few milliseconds (where
    bf16 is emulated, up to a few tenths of a second). The instruction set does not tell: with
    AVX512-BF16 one CPU multiplies bf16 4× faster than fp32 and another half as fast.

    :func:`default_ns_dtype` takes it the first time a matrix large enough for bf16 meets the
    ``auto`` rule on a CPU, never at import and never when ``MUONFN_CPU_NS_DTYPE`` pins the rule.
    It times real CPU matmuls on one thread whatever is active (autocast, a device context, a
    tracing or fake tensor mode), leaves nothing in a trace, draws from its own generator, not
    torch's, and sets the process's thread count back as it was.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
            x = torch.randn(_PROBE_SHAPE, generator=torch.Generator().manual_seed(0), device="cpu")
            operands = {torch.float32: x, torch.bfloat16: x.to(torch.bfloat16)}
            fastest = dict.fromkeys(operands, math.inf)
            for round_ in range(1 + _PROBE_ROUNDS):
                for dtype, matrix in operands.items():
                    start = time.perf_counter()
                    torch.mm(matrix, matrix.mT)
                    if round_:  # (the first warms up)
                        fastest[dtype] = min(fastest[dtype], time.perf_counter() - start)
                if round_ >= 2 and fastest[torch.bfloat16] > _PROBE_HOPELESS * fastest[torch.float32]:
                    break
    finally:
        torch.set_num_threads(threads)
    return CpuBf16Probe(fp32_seconds=fastest[torch.float32], bf16_seconds=fastest[torch.bfloat16])


@torch.compiler.assume_constant_result  # a traced update reads the answer, not the probe
def _cpu_bf16_is_faster() -> bool:
    return cpu_bf16_probe().bf16_faster


def cpu_rule() -> str:
    """The CPU's rule as ``MUONFN_CPU_NS_DTYPE`` sets it (read when a Newton–Schulz map is made)."""
    choice = os.environ.get(CPU_NS_DTYPE_VARIABLE, "auto")
    if choice not in CPU_NS_DTYPE_CHOICES:
        raise ValueError(f"{CPU_NS_DTYPE_VARIABLE}={choice!r}; choose one of {list(CPU_NS_DTYPE_CHOICES)}")
    return choice


def default_ns_dtype(
    device: torch.device, dtype: torch.dtype, shape: Sequence[int] | None = None, rule: str | None = None
) -> torch.dtype:
    """The Newton–Schulz dtype when none is given: bf16 where the device multiplies it fastest.

    CUDA (and meta): bf16, whatever the input. A CPU: bf16 for fp32 and narrower inputs whose matrices
    (``shape``, or ``None`` for any) hold at least :data:`CPU_BF16_MIN_WORK` of work, where bf16 is
    measured faster (:func:`cpu_bf16_probe`); else the input's dtype, at least fp32 (fp64 keeps fp64).
    ``rule`` (``bfloat16``, ``float32`` or ``auto``; ``None``: :func:`cpu_rule`) pins the CPU's rule.
    """
    if device.type in ("cuda", "meta"):
        return torch.bfloat16
    rule = cpu_rule() if rule is None else rule
    if device.type == "cpu" and dtype != torch.float64 and rule != "float32":
        large = shape is None or min(shape[-2:]) ** 2 * max(shape[-2:]) >= CPU_BF16_MIN_WORK  # m²n, m <= n
        if rule == "bfloat16" or (large and _cpu_bf16_is_faster()):
            return torch.bfloat16
    return torch.promote_types(dtype, torch.float32)


def may_write_into(*tensors: torch.Tensor) -> bool:
    """Whether a computation may write into ``tensors``, temporaries of its own: not when traced by
    ``torch.func`` or ``torch.compile`` (which plan their own memory) nor recorded by autograd."""
    traced = torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling()
    return not (traced or (torch.is_grad_enabled() and any(map(attrgetter("requires_grad"), tensors))))


# ---------------------------------------------------------------------------------------------- a GPU's forms


#: The types of plain tensors (a subclass, a DTensor say, takes its ops leaf by leaf)
_PLAIN = {torch.Tensor, torch.nn.Parameter}


def _plain_eager(tensors: Sequence[torch.Tensor]) -> bool:
    return may_write_into() and set(map(type, tensors)) <= _PLAIN  # (untraced, of plain tensors)


def takes_gpu_orthogonalized(ns: Any, first: torch.Tensor, forced: bool | None = None) -> bool:
    """Whether a call of ``ns`` on matrices like ``first`` takes :func:`gpu_orthogonalized`: fp32
    iterated in a narrower dtype, off the CPU (``forced``: ``True``/``False`` on any device)."""
    gpu = first.device.type != "cpu" if forced is None else forced
    return gpu and first.dtype == torch.float32 and ns.iteration_dtype(first).itemsize < 4


def gpu_orthogonalized(
    ns: Any, matrices: Sequence[torch.Tensor], turned: int, scale: float, overwrite: bool
) -> list[torch.Tensor]:
    """``scale·NS`` of wide fp32 ``matrices`` of one shape, each a batch of one ``(1, m, n)`` (the last
    ``turned`` the transposes of tall ones), iterated in ``ns``'s dtype: the results in order, the tall
    ones in their own orientation. ``overwrite``: the matrices are the step's temporaries, which may
    hold the results."""
    # (no name here holds the normalised batch: the iteration's buffers are its only copies)
    result = ns.iterate(_normalized(ns, matrices, ns.iteration_dtype(matrices[0])), scale)
    kept = len(matrices) - turned
    tall = _tall_results(result[kept:]) if turned else []
    if overwrite and kept and _plain_eager(matrices) and all(map(torch.Tensor.is_contiguous, matrices[:kept])):
        torch._foreach_copy_(list(matrices[:kept]), list(result[:kept].split(1)))  # (casts on torch's fused path)
        return [*matrices[:kept], *tall]
    return [*(result[:kept].to(torch.float32).split(1) if kept else ()), *tall]  # (split(1) of none: one empty)


def _normalized(ns: Any, matrices: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The batch of ``matrices`` over their Frobenius norms accumulated in fp64, in ``dtype``: eager, one
    multi-tensor norm reads fp32 and adds its squares in fp64 as they load, else the stack's norm. The
    fp32 stack the batch is made from is freed when this returns."""
    plain, stack = _plain_eager(matrices), torch.cat(list(matrices))
    if plain:
        norms = torch.stack(torch._foreach_norm(list(matrices), 2, dtype=torch.float64)).view(-1, 1, 1)
    else:
        norms = torch.linalg.vector_norm(stack, dim=(-2, -1), keepdim=True, dtype=torch.float64)
    if ns.schedule.norm_factor != 1.0:
        norms = norms * ns.schedule.norm_factor
    reciprocal = (norms + ns.eps if ns.eps_mode == "add" else norms.clamp_min(ns.eps)).reciprocal()
    # one pass, the fp64 product rounded to ``dtype`` as it is stored (by out=, which autograd would not record)
    if plain and may_write_into(*matrices):
        return torch.mul(stack, reciprocal, out=torch.empty(stack.shape, dtype=dtype, device=stack.device))
    return (stack * reciprocal).to(dtype)


def _tall_results(result: torch.Tensor) -> list[torch.Tensor]:
    """The fp32 results of tall matrices from the narrow results of their transposes: eager, one pass
    that widens them into a batch of their own orientation; else a widening, then a copy each."""
    if not _plain_eager([result]):
        return [apart(t.mT).contiguous() for t in result.to(torch.float32).split(1)]
    batch = torch.empty(result.mT.shape, dtype=torch.float32, device=result.device)
    batch.mT.copy_(result)
    return list(batch.split(1))


def adamw_kernel_takes(
    tensors: Sequence[torch.Tensor], members: int, factors: Sequence[Any], forced: bool | None
) -> bool:
    """Whether an AdamW update goes through ``torch._fused_adamw_`` (``torch.optim.AdamW(fused=True)``'s
    kernel): one model (no ensemble) whose gradients and parameters are contiguous fp32 tensors on one
    CUDA (or meta) device (``forced``: ``True`` on any device, ``False`` never), eager, outside
    ``torch.func`` transforms, with nothing autograd records; plain tensors with the learning rate and
    decay numbers or 0-d tensors on their device (``factors``: the hyperparameters, β₁ a number), or
    all DTensors with numbers."""
    if forced is False or members or not tensors or (not forced and tensors[0].device.type not in ("cuda", "meta")):
        return False
    device = tensors[0].device
    factors = list(filter(torch.is_tensor, factors))
    fp32_there = set(map(attrgetter("dtype", "device"), tensors)) == {(torch.float32, device)}
    if not (may_write_into(*tensors, *factors) and fp32_there and all(map(torch.Tensor.is_contiguous, tensors))):
        return False
    if set(map(type, tensors)) <= _PLAIN:  # tensor factors 0-d, on the tensors' device
        return set(map(attrgetter("ndim", "device"), factors)) <= {(0, device)}
    return not factors and all(hasattr(t, "placements") for t in tensors)  # all DTensors, with numbers


def adamw_kernel(
    grads: Any,
    state: Any,
    params: Any,
    decayed: set[str] | None,
    lr: Any,
    lam: Any,
    b1: float,
    b2: float,
    eps: float,
    donate: bool,
) -> tuple[Any, dict[str, Any]]:
    r"""AdamW's update by ``torch._fused_adamw_``, one pass over each leaf: the update starts as
    :math:`-\eta\lambda p` (0 on a leaf not in ``decayed``; ``None``: every leaf is decayed), and the
    kernel, given it as its parameter with no decay of its own, subtracts torch's step
    :math:`\frac{\eta}{c_1}\,\frac{m_t}{\sqrt{v_t}/\sqrt{c_2} + \epsilon}`. Without decay that is
    ``torch.optim.AdamW(fused=True)``'s parameter change, bit for bit. Returns the updates and the new
    state entries."""
    names, g = list(grads.keys()), list(grads.values())
    plain = _plain_eager(g)  # (else DTensors, which take these ops leaf by leaf)
    m, v = named_leaves(state["exp_avg"], names), named_leaves(state["exp_avg_sq"], names)
    counts = named_leaves(state["step"], names)
    if donate:
        torch._foreach_add_(counts, 1)
    else:  # the kernel writes the moments in place: a new state has its own (of plain tensors one multi-tensor copy)
        moments = [*m, *v]
        fresh = list(map(torch.empty_like, moments)) if plain else [t.clone() for t in moments]
        if plain:
            torch._foreach_copy_(fresh, moments)
        m, v, counts = fresh[: len(m)], fresh[len(m) :], list(torch._foreach_add(counts, 1))
    flags = None if decayed is None else [n in decayed for n in names]
    updates = _decay_terms(named_leaves(params, names), flags, -lr * lam, plain)
    # (the kernel reads fp32 counts: one cast for all the leaves' where they are plain tensors)
    steps = list(torch.stack(counts).to(torch.float32).unbind(0)) if plain else [c.to(torch.float32) for c in counts]
    # a tensor rate goes to the kernel as it is (CUDA's ``tensor_lr``); meta, which takes CUDA's paths to
    # count them, has no kernel for it and holds no value: a number stands for it there, the same traffic
    kernel_lr = 0.0 if isinstance(lr, torch.Tensor) and lr.device.type == "meta" else lr
    meshes: dict[int, list[int]] = {}  # (DTensors: one call per device mesh, as a DTensor op takes one)
    for i, t in enumerate(() if plain else g):
        meshes.setdefault(id(getattr(t, "device_mesh", None)), []).append(i)
    lists = (updates, g, m, v, steps)
    calls = [lists] if plain else [[[x[i] for i in at] for x in lists] for at in meshes.values()]
    # the kernel's options: the decay is in the updates already (see above)
    options: dict[str, Any] = dict(
        lr=kernel_lr, beta1=b1, beta2=b2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False
    )
    for u, grad, exp_avg, exp_avg_sq, step in calls:
        torch._fused_adamw_(u, grad, exp_avg, exp_avg_sq, [], step, **options)
    entries = {"step": replaced(state["step"], names, counts), "exp_avg": replaced(state["exp_avg"], names, m)}
    entries["exp_avg_sq"] = replaced(state["exp_avg_sq"], names, v)
    return build(dict(zip(names, updates)), grads.batch_size), entries


def _decay_terms(params: list[torch.Tensor], decayed: list[bool] | None, alpha: Any, plain: bool) -> list[torch.Tensor]:
    """``alpha·p`` for every decayed parameter (``None``: every one), zeros for the others: of plain
    tensors one multi-tensor op each (an op a leaf launches a kernel a leaf), else an op each."""
    if decayed is None:
        return list(torch._foreach_mul(params, alpha)) if plain else [p.mul(alpha) for p in params]
    if not plain:
        return [p.mul(alpha) if d else torch.zeros_like(p) for p, d in zip(params, decayed)]
    chosen = [p for p, d in zip(params, decayed) if d]
    scaled = iter(torch._foreach_mul(chosen, alpha) if chosen else ())
    zeros = [torch.empty_like(p) for p, d in zip(params, decayed) if not d]
    if zeros:  # (a multi-tensor op takes no empty list)
        torch._foreach_zero_(zeros)
    unscaled = iter(zeros)
    return [next(scaled if d else unscaled) for d in decayed]


# ---------------------------------------------------------------------------------------------- a compiled GPU step


def apart(x: torch.Tensor) -> torch.Tensor:
    """``x``; traced by ``torch.compile``, a transposed ``x`` copied into contiguous memory by an op of
    muonfn's own (``muonfn::copy_apart``), which inductor runs as it is.

    Works around torch 2.11's inductor on CUDA, which fails when a fused ``_foreach_*`` kernel and a
    kernel it is fused with walk one buffer in transposed orders (``reorder_loops_by_dep_pair``
    asserts on two memory dependencies that are transposes of each other). Newton–Schulz reads the
    momentum's multi-tensor results transposed (a tall matrix joins the calls of its wide shape), and
    the multi-tensor decay and update read its tall results: the opaque copy stands between the two.
    Eager, nothing is copied.
    """
    if torch.compiler.is_compiling() and type(x) is torch.Tensor and not torch._C._are_functorch_transforms_active():
        # transposed: walks its memory out of order, its strides over dimensions longer than 1 not decreasing
        strides = [stride for size, stride in zip(x.shape, x.stride()) if size > 1]
        return _copy_apart(x) if any(a < b for a, b in itertools.pairwise(strides)) else x
    return x


@torch.library.custom_op("muonfn::copy_apart", mutates_args=())
def _copy_apart(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


@_copy_apart.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_copy_apart.register_autograd(lambda ctx, grad: grad)  # the values are unchanged: so is the gradient
