"""What each device needs, apart from the math: the default Newton–Schulz dtype, and a GPU's forms.

The math (:mod:`muonfn.linalg`, :mod:`muonfn.steps`) is written once, in the form a CPU runs
fastest. A GPU (and the meta device, which stands for one in the traffic counter) moves fewer
bytes with three forms of its own, chosen here, by the tensors' device, in one function each:

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
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

#: ``auto`` (measured), ``bfloat16`` or ``float32``: the CPU's Newton–Schulz dtype for a whole process
CPU_NS_DTYPE_VARIABLE = "MUONFN_CPU_NS_DTYPE"
CPU_NS_DTYPE_CHOICES = ("auto", "bfloat16", "float32")

#: On a CPU whose bf16 matmuls are faster, the least work (``m²n``, ``m <= n``) of one matrix whose
#: Newton–Schulz runs in bf16: below it the fixed cost of the bf16 kernels outweighs their speed.
CPU_BF16_MIN_WORK = 2**18


@torch.compiler.assume_constant_result  # a traced update reads the answer, not the probe
def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 matrices measurably faster than fp32 ones (once per process)."""
    return _bf16_is_faster()


@functools.cache
def _bf16_is_faster() -> bool:
    """A few milliseconds: the best of three 256×256 products in each dtype; bf16 must win by 1.3×
    (an emulated bf16 matmul runs tens of times slower, AVX512-BF16 and AMX units about 4× faster)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        a = torch.randn(256, 256)
        timings = []
        for dtype in (torch.float32, torch.bfloat16):
            x = a.to(dtype)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                x @ x
                best = min(best, time.perf_counter() - start)
            timings.append(best)
        return timings[1] * 1.3 < timings[0]
    except RuntimeError:
        return False


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

    CUDA (and meta): bf16. A CPU: bf16 for fp32 and narrower inputs whose matrices (``shape``, or
    ``None`` for any) hold at least :data:`CPU_BF16_MIN_WORK` of work, where bf16 is measured faster
    (:func:`cpu_has_bf16_units`); else the input's dtype, at least fp32. fp64 keeps fp64.
    ``rule`` (``bfloat16``, ``float32`` or ``auto``; ``None``: :func:`cpu_rule`) pins the CPU's rule.
    """
    wide = torch.promote_types(dtype, torch.float32)
    if dtype == torch.float64:
        return wide
    if device.type in ("cuda", "meta"):
        return torch.bfloat16
    if device.type != "cpu":
        return wide
    choice = cpu_rule() if rule is None else rule
    large = shape is None or (lambda m, n: m * m * n)(*sorted(shape[-2:])) >= CPU_BF16_MIN_WORK
    if choice == "bfloat16" or (choice == "auto" and large and cpu_has_bf16_units()):
        return torch.bfloat16
    return wide


# ---------------------------------------------------------------------------------------------- a GPU's forms


def _plain_eager(tensors: Sequence[torch.Tensor]) -> bool:
    return (
        all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
    )


def takes_gpu_orthogonalized(first: torch.Tensor, dtype: torch.dtype, forced: bool | None = None) -> bool:
    """Whether a call's matrices (like ``first``) take :func:`gpu_orthogonalized`: fp32 iterated in a
    narrower dtype, off the CPU (``forced``: ``True``/``False`` on any device)."""
    gpu = first.device.type != "cpu" if forced is None else forced
    return gpu and first.dtype == torch.float32 and dtype.itemsize < 4


def gpu_orthogonalized(
    ns: Any, matrices: Sequence[torch.Tensor], turned: int, scale: float, dtype: torch.dtype, overwrite: bool
) -> list[torch.Tensor]:
    """``scale·NS`` of wide fp32 ``matrices`` of one shape (the last ``turned`` the transposes of tall
    ones), iterated in ``dtype``: the results in order, the tall ones in their own orientation.
    ``overwrite``: the matrices are the step's temporaries, which may hold the results."""
    norms = _fp64_norms(matrices)
    if ns.schedule.norm_factor != 1.0:
        norms = norms * ns.schedule.norm_factor
    reciprocal = (norms + ns.eps if ns.eps_mode == "add" else norms.clamp_min(ns.eps)).reciprocal()
    stack = torch.stack(list(matrices))
    if _plain_eager(matrices):  # one pass: the fp64 product rounded to ``dtype`` as it is stored
        X = torch.mul(stack, reciprocal, out=torch.empty(stack.shape, dtype=dtype, device=stack.device))
    else:
        X = (stack * reciprocal).to(dtype)
    result = ns.iterate(X, scale)
    kept = len(matrices) - turned
    tall = [t.mT.contiguous() for t in result[kept:].to(torch.float32).unbind(0)] if turned else []
    if overwrite and kept and _plain_eager(matrices) and all(m.is_contiguous() for m in matrices[:kept]):
        wide = list(matrices[:kept])
        torch._foreach_copy_(wide, list(result[:kept].unbind(0)))  # (casts on torch's fused path)
        return [*wide, *tall]
    return [*result[:kept].to(torch.float32).unbind(0), *tall]


def _fp64_norms(matrices: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each matrix's Frobenius norm accumulated in fp64, ``(count, 1, 1)``: eager, one multi-tensor
    norm reading fp32 and adding its squares in fp64 as they load; else the stack's."""
    if _plain_eager(matrices):
        return torch.stack(torch._foreach_norm(list(matrices), 2, dtype=torch.float64)).view(-1, 1, 1)
    return torch.linalg.vector_norm(torch.stack(list(matrices)), dim=(-2, -1), keepdim=True, dtype=torch.float64)


def adamw_kernel_takes(
    tensors: Sequence[torch.Tensor], members: int, factors: Sequence[Any], forced: bool | None = None
) -> bool:
    """Whether an AdamW update goes through ``torch._fused_adamw_`` (``torch.optim.AdamW(fused=True)``'s
    kernel): one model (no ensemble) whose gradients, moments and decayed parameters are contiguous
    fp32 tensors on one CUDA (or meta) device, eager, outside ``torch.func`` transforms, with nothing
    autograd records, plain tensors or all DTensors, the learning rate and decay numbers (``factors``:
    those given as tensors); ``forced``: on any device."""
    if members or not tensors or not _plain_eager([]) or torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    device = tensors[0].device
    if device.type not in ("cuda", "meta") and not forced:
        return False
    if not all(t.dtype == torch.float32 and t.device == device and t.is_contiguous() for t in tensors):
        return False
    dtensors = [hasattr(t, "placements") for t in tensors]
    return not factors and (all(dtensors) or not any(dtensors))


def adamw_kernel(
    grads: Any, state: Any, params: Any, decayed: list[str], lr: float, lam: float, b1: float, b2: float, eps: float,
    donate: bool,
) -> tuple[Any, dict[str, Any]]:
    r"""AdamW's update by ``torch._fused_adamw_``, one pass over each leaf: the update starts as
    :math:`-\eta\lambda p` (0 on a leaf not decayed), and the kernel, given it as its parameter with no
    decay of its own, subtracts torch's step :math:`\frac{\eta}{c_1}\,\frac{m_t}{\sqrt{v_t}/\sqrt{c_2} + \epsilon}`.
    Without decay that is ``torch.optim.AdamW(fused=True)``'s parameter change, bit for bit. Returns
    the updates and the new state entries."""
    from ._tree import build

    names, g = list(grads.keys()), list(grads.values())
    m = [state["exp_avg"][n] for n in names]
    v = [state["exp_avg_sq"][n] for n in names]
    if not donate:  # the kernel writes the moments in place: a new state has its own
        m, v = [t.clone() for t in m], [t.clone() for t in v]
    counts = [state["step"][n] for n in names]
    counts = torch._foreach_add_(counts, 1) or counts if donate else torch._foreach_add(counts, 1)
    chosen = set(decayed)
    updates = [p.mul(-lr * lam) if n in chosen else torch.zeros_like(p) for n, p in ((n, params[n]) for n in names)]
    meshes: dict[int, list[int]] = {}  # (one call per device mesh: a DTensor op takes one)
    for i, t in enumerate(g):
        meshes.setdefault(id(getattr(t, "device_mesh", None)), []).append(i)
    steps = [c.to(torch.float32) for c in counts]
    for at in meshes.values():
        torch._fused_adamw_(  # type: ignore[call-overload]
            *([x[i] for i in at] for x in (updates, g, m, v)), [], [steps[i] for i in at],
            lr=lr, beta1=b1, beta2=b2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
    size = grads.batch_size
    entries = {
        key: build({**state[key], **dict(zip(names, values))}, size)
        for key, values in (("step", counts), ("exp_avg", m), ("exp_avg_sq", v))
    }
    return build(dict(zip(names, updates)), size), entries
