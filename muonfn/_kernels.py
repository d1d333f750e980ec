"""Triton kernels for a GPU: passes over memory that eager ops take in two, in one (opt-in).

``MUONFN_TRITON=1`` in the environment turns them on for CUDA tensors where Triton is installed;
they are off by default. Each kernel computes what the eager ops it replaces compute, element by
element and rounding for rounding (a multiply-add fused, as a GPU's compiler fuses those of
torch's kernels), so that turning them on changes how many bytes a step moves, not its results.
Each is a custom op (``torch.library``): the meta device runs its shape function (so that
``benchmarks/traffic.py`` counts what the kernel reads and writes: meta stands for a GPU), and
under Triton's interpreter (``TRITON_INTERPRET=1``) it runs on CPU tensors, which is how the
tests check it (the interpreter rounds a fused multiply-add twice). They are not taken under
``torch.compile`` (the compiler fuses the eager ops itself), under ``torch.func`` transforms,
where autograd records, or while a CUDA graph is captured.

- :func:`scaled_stack`: ``torch.stack(matrices)`` divided by their norms (clamped below by ε, or
  plus ε), rounded to a 16-bit dtype as it is stored: the Newton–Schulz batch written straight
  from the momentum's matrices (tall ones read transposed), without the fp32 stack that the eager
  ops write and read again, nor their passes over the norms.
- :func:`ema_nesterov_` and :func:`ema_nesterov`: the momentum's EMA and the Nesterov look-ahead,
  two ``torch.lerp`` passes, in one pass over the gradients and the momentum.
- :func:`widened_decayed_`: Newton–Schulz's bf16 results widened into their fp32 matrices (the
  tall ones in their own orientation, wherever they are: a new batch or the inputs' own memory)
  with the decay ``α·p`` added as they are stored, where the eager ops copy them and then add the
  decay in a second pass.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

#: ``1`` turns the kernels on, ``0`` (the default) leaves the eager ops
TRITON_VARIABLE = "MUONFN_TRITON"

#: rows and columns of the tile one program of :func:`scaled_stack` writes
_TILE = 64
#: entries one program of an element-wise kernel takes; the tensors of a call are at most 65535 blocks
_BLOCK = 4096
_MAX_BLOCKS = 65535


def enabled() -> bool:
    """Whether ``MUONFN_TRITON`` asks for the kernels (read at every call; ``0`` or ``1``)."""
    value = os.environ.get(TRITON_VARIABLE, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{TRITON_VARIABLE}={value!r}; set it to 1 (the Triton kernels) or 0 (the eager ops)")
    return value == "1"


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: the oldest Triton whose compiler reads a kernel's enclosing scope (the kernels are defined on first use)
_OLDEST_TRITON = (3, 6)


@functools.cache
def triton_installed() -> bool:
    """Whether a Triton the kernels compile with (3.6 or newer) is installed."""
    try:
        import triton
    except ImportError:
        return False
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    return version >= _OLDEST_TRITON


#: tensor types whose data a kernel may address directly (a parameter is a plain tensor underneath)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def takes_kernels(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` go through the kernels: turned on, plain tensors of one eager step
    (not compiled, not under a ``torch.func`` transform, not recorded by autograd), on CUDA
    with Triton installed, on the CPU under Triton's interpreter, or on meta (counted, not run)."""
    if not tensors or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if not enabled():
        return False
    if any(type(t) not in _PLAIN for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    device = tensors[0].device.type
    if device == "meta":
        return True
    if device == "cuda":  # (not while a CUDA graph is captured: the launch tables come from the host)
        return triton_installed() and not interpreting() and not torch.cuda.is_current_stream_capturing()
    return device == "cpu" and interpreting() and triton_installed()


#: the launch tables (addresses, strides, sizes) already on a device, by device and contents: a step
#: whose tensors sit where they sat the step before (state, parameters, and what the caching allocator
#: hands back) copies no table
_TABLES: dict[tuple[torch.device, torch.dtype, tuple[float, ...]], torch.Tensor] = {}
_TABLES_KEPT = 256


def _table(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` on ``device`` (never written: one may serve many
    launches), copied without making the host wait."""
    key = (device, dtype, tuple(values))
    table = _TABLES.get(key)
    if table is not None:
        return table
    table = torch.tensor(values, dtype=dtype)
    table = table.to(device) if device.type != "cuda" else table.pin_memory().to(device, non_blocking=True)
    if len(_TABLES) >= _TABLES_KEPT:
        del _TABLES[next(iter(_TABLES))]
    _TABLES[key] = table
    return table


@functools.cache
def _compiled(interpret: bool) -> Any:
    """The kernels, built on first use (``interpret``: Triton's interpreter, which is chosen when
    a kernel is defined)."""
    assert interpret == interpreting()
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_stack_kernel(  # type: ignore[no-untyped-def]
        addresses,
        strides,
        norms,
        settings,
        out,
        rows,
        cols,
        ADD_EPS: tl.constexpr,
        TILE: tl.constexpr,
        BF16: tl.constexpr,
    ):
        # one TILE×TILE tile of matrix i: read from its own memory (strides), times the fp64
        # reciprocal of its denominator (as the eager ops compute it: c·norm, clamped below by eps
        # or plus eps, one division), rounded to fp32 and then to the 16-bit dtype, as torch's
        # fp32·fp64 product into an ``out=`` of that dtype is rounded
        i = tl.program_id(0)
        source = tl.load(addresses + i).to(tl.pointer_type(tl.float32))
        row_stride = tl.load(strides + 2 * i)
        col_stride = tl.load(strides + 2 * i + 1)
        eps = tl.load(settings)  # (fp64 numbers come in a tensor: a scalar argument would be fp32)
        denominator = tl.load(norms + i) * tl.load(settings + 1)
        denominator = denominator + eps if ADD_EPS else tl.where(denominator < eps, eps, denominator)
        factor = 1.0 / denominator
        r = (tl.program_id(1) * TILE + tl.arange(0, TILE))[:, None].to(tl.int64)
        c = (tl.program_id(2) * TILE + tl.arange(0, TILE))[None, :].to(tl.int64)
        inside = (r < rows) & (c < cols)
        x = tl.load(source + r * row_stride + c * col_stride, mask=inside, other=0.0)
        y = (x.to(tl.float64) * factor).to(tl.float32)
        at = out + i.to(tl.int64) * rows * cols + r * cols + c
        if BF16:
            # rounded to nearest even on the bits, as torch rounds to bf16 (NaN to its quiet NaN),
            # and stored as bits (``out`` is the batch viewed as int16): the interpreter's casts to
            # bf16 truncate, and flush subnormals
            bits = y.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(at, tl.where(y != y, 0x7FC0, rounded).to(tl.int16), mask=inside)
        else:
            tl.store(at, y.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def ema_nesterov_kernel(  # type: ignore[no-untyped-def]
        momentum, grads, new_momentum, nesterov, numels, grad_weight, momentum_weight, BLOCK: tl.constexpr
    ):
        # block b of tensor j: b_t = lerp(b, g, 1 - mu), u_t = lerp(g, b_t, mu), element by element
        j = tl.program_id(1)
        numel = tl.load(numels + j)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if tl.program_id(0).to(tl.int64) * BLOCK < numel:
            inside = offsets < numel
            b = tl.load(tl.load(momentum + j).to(tl.pointer_type(tl.float32)) + offsets, mask=inside)
            g = tl.load(tl.load(grads + j).to(tl.pointer_type(tl.float32)) + offsets, mask=inside)
            # torch.lerp's formula (ATen's Lerp.h) in fp32, its multiply-adds fused as a GPU's
            # compiler fuses them (Triton's interpreter rounds them twice); the weights as fp32
            # numbers (the interpreter would keep a Python float's double)
            w = tl.full([BLOCK], grad_weight, tl.float32)
            diff = g - b
            b = tl.where(tl.abs(w) < 0.5, tl.fma(w, diff, b), tl.fma(-diff, 1.0 - w, g))
            tl.store(tl.load(new_momentum + j).to(tl.pointer_type(tl.float32)) + offsets, b, mask=inside)
            w = tl.full([BLOCK], momentum_weight, tl.float32)
            diff = b - g
            u = tl.where(tl.abs(w) < 0.5, tl.fma(w, diff, g), tl.fma(-diff, 1.0 - w, b))
            tl.store(tl.load(nesterov + j).to(tl.pointer_type(tl.float32)) + offsets, u, mask=inside)

    @triton.jit
    def widened_decayed_kernel(  # type: ignore[no-untyped-def]
        results, outputs, params, strides, alpha, rows, cols, kept, TILE: tl.constexpr
    ):
        # one TILE×TILE tile of result i: widened exactly, plus alpha·p where matrix i has a p
        # (one multiply-add, fused as a GPU's compiler fuses torch's add(alpha=)), stored through
        # matrix i's own address and strides: along its rows for i < kept, down its columns for a
        # tall matrix's transpose (each store's unit stride known to the compiler)
        i = tl.program_id(0)
        r = (tl.program_id(1) * TILE + tl.arange(0, TILE))[:, None].to(tl.int64)
        c = (tl.program_id(2) * TILE + tl.arange(0, TILE))[None, :].to(tl.int64)
        inside = (r < rows) & (c < cols)
        u = tl.load(results + i.to(tl.int64) * rows * cols + r * cols + c, mask=inside).to(tl.float32)
        address = tl.load(params + i)
        if address != 0:
            p = tl.load(
                address.to(tl.pointer_type(tl.float32))
                + r * tl.load(strides + 3 * i + 1)
                + c * tl.load(strides + 3 * i + 2),
                mask=inside,
            )
            u = tl.fma(tl.full([TILE, TILE], alpha, tl.float32), p, u)
        target = tl.load(outputs + i).to(tl.pointer_type(tl.float32))
        stride = tl.load(strides + 3 * i)
        if i < kept:
            tl.store(target + r * stride + c, u, mask=inside)
        else:
            tl.store(target + r + c * stride, u, mask=inside)

    return {
        "scaled_stack": scaled_stack_kernel,
        "ema_nesterov": ema_nesterov_kernel,
        "widened_decayed": widened_decayed_kernel,
    }


@torch.library.custom_op("muonfn::scaled_stack", mutates_args=())
def scaled_stack(
    matrices: list[torch.Tensor], norms: torch.Tensor, dtype: torch.dtype, eps: float, norm_factor: float, add_eps: bool
) -> torch.Tensor:
    """``torch.mul(torch.stack(matrices), r, out=<dtype>)`` with ``r = (c·norms).clamp_min(eps)
    .reciprocal()`` (``add_eps``: ``(c·norms + eps).reciprocal()``; ``c``: ``norm_factor``), bit for
    bit, in one pass: each fp32 matrix read once from its own memory (any strides: a tall matrix's
    transpose reads it across rows), its reciprocal taken in fp64 from its norm (``norms``: one
    fp64 number per matrix), the product taken in fp64 and rounded to fp32 and then to ``dtype``
    (bf16 or fp16), written into a new ``(count, m, n)`` batch. 6 bytes an entry, where the stack
    and the product move 14, and no ops over the norms."""
    first = matrices[0]
    count, (rows, cols) = len(matrices), first.shape
    out = torch.empty((count, rows, cols), dtype=dtype, device=first.device)
    if not out.numel():
        return out
    addresses = _table([m.data_ptr() for m in matrices], first.device)
    strides = _table([s for m in matrices for s in m.stride()], first.device)
    grid = (count, -(-rows // _TILE), -(-cols // _TILE))
    kernel = _compiled(interpreting())["scaled_stack"]
    bf16 = dtype == torch.bfloat16
    target = out.view(torch.int16) if bf16 else out
    settings = _table([eps, norm_factor], first.device, torch.float64)
    kernel[grid](addresses, strides, norms, settings, target, rows, cols, ADD_EPS=add_eps, TILE=_TILE, BF16=bf16)
    return out


@scaled_stack.register_fake
def _(
    matrices: list[torch.Tensor], norms: torch.Tensor, dtype: torch.dtype, eps: float, norm_factor: float, add_eps: bool
) -> torch.Tensor:
    first = matrices[0]
    return torch.empty((len(matrices), *first.shape), dtype=dtype, device=first.device)


def takes_scaled_stack(matrices: Sequence[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether :func:`scaled_stack` takes a batch of ``matrices`` into ``dtype``: :func:`takes_kernels`,
    into the 16-bit dtypes it is written for (it rounds the product to fp32 on the way: a wider
    dtype would lose the bits the eager product keeps)."""
    return dtype in (torch.bfloat16, torch.float16) and takes_kernels(matrices)


def takes_ema_nesterov(momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], *weights: object) -> bool:
    """Whether :func:`ema_nesterov_` takes these leaves: :func:`takes_kernels`, fp32 and contiguous
    leaves of at most 65535 blocks each, at most 65535 of them, of the same shapes, and the weights
    numbers."""
    tensors = [*momentum, *grads]
    return (
        all(isinstance(w, float) for w in weights)
        and takes_kernels(tensors)
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
        and all(b.shape == g.shape for b, g in zip(momentum, grads))
        and max(t.numel() for t in tensors) <= _MAX_BLOCKS * _BLOCK
        and len(grads) <= _MAX_BLOCKS  # (a grid's second axis)
    )


def _ema_nesterov_launch(
    momentum: list[torch.Tensor],
    grads: list[torch.Tensor],
    new_momentum: list[torch.Tensor],
    nesterov: list[torch.Tensor],
    mu: float,
) -> None:
    device = grads[0].device
    blocks = max(-(-g.numel() // _BLOCK) for g in grads)
    if blocks == 0:
        return
    table = _table(
        [t.data_ptr() for t in (*momentum, *grads, *new_momentum, *nesterov)] + [g.numel() for g in grads], device
    )
    count = len(grads)
    parts = [table[i * count : (i + 1) * count] for i in range(5)]
    kernel = _compiled(interpreting())["ema_nesterov"]
    kernel[(blocks, count)](*parts, 1.0 - mu, mu, BLOCK=_BLOCK)


@torch.library.custom_op("muonfn::ema_nesterov_", mutates_args=("momentum",))
def ema_nesterov_(momentum: list[torch.Tensor], grads: list[torch.Tensor], mu: float) -> list[torch.Tensor]:
    """``torch._foreach_lerp_(momentum, grads, 1 - mu)`` and then ``torch._foreach_lerp(grads,
    momentum, mu)`` (the Nesterov look-ahead, returned), in one pass: each momentum and gradient
    entry read once, the new momentum and the look-ahead written. 16 bytes an fp32 entry, where
    the two passes move 24. The same bits as torch's lerp on a GPU, which fuses its multiply-adds
    (``1 - mu`` is taken in fp64 and both weights rounded to fp32, as torch rounds a number)."""
    nesterov = [torch.empty_like(g) for g in grads]
    _ema_nesterov_launch(momentum, grads, momentum, nesterov, mu)
    return nesterov


@ema_nesterov_.register_fake
def _(momentum: list[torch.Tensor], grads: list[torch.Tensor], mu: float) -> list[torch.Tensor]:
    return [torch.empty_like(g) for g in grads]


@torch.library.custom_op("muonfn::ema_nesterov", mutates_args=())
def ema_nesterov(momentum: list[torch.Tensor], grads: list[torch.Tensor], mu: float) -> list[torch.Tensor]:
    """:func:`ema_nesterov_` into new tensors: the new momentum, then the look-ahead, in one list."""
    new_momentum = [torch.empty_like(b) for b in momentum]
    nesterov = [torch.empty_like(g) for g in grads]
    _ema_nesterov_launch(momentum, grads, new_momentum, nesterov, mu)
    return [*new_momentum, *nesterov]


@ema_nesterov.register_fake
def _(momentum: list[torch.Tensor], grads: list[torch.Tensor], mu: float) -> list[torch.Tensor]:
    return [*(torch.empty_like(b) for b in momentum), *(torch.empty_like(g) for g in grads)]


@torch.library.custom_op("muonfn::widened_decayed_", mutates_args=("outputs",))
def widened_decayed_(
    outputs: list[torch.Tensor], results: torch.Tensor, turned: int, params: list[torch.Tensor | None], alpha: float
) -> None:
    """A ``(count, m, n)`` bf16/fp16 batch of results widened into ``outputs`` (fp32 ``(m, n)``
    matrices, one per result: the first ``count - turned`` with unit column stride, the last
    ``turned``, tall matrices' transposes, with unit row stride), with ``alpha·p`` added to each
    result whose ``p`` is given (fp32, of the result's shape, any strides), in one pass. The bits
    of ``torch._foreach_copy_(outputs, results.unbind(0))`` and then ``torch._foreach_add_(outputs,
    params, alpha=alpha)`` on a GPU (its multiply-add fused); 10 bytes an entry of a decayed
    result, where the copy and the add move 18."""
    count, rows, cols = results.shape
    if not results.numel():
        return
    device, kept = results.device, count - turned
    addresses = _table([o.data_ptr() for o in outputs], device)
    param_addresses = _table([0 if p is None else p.data_ptr() for p in params], device)
    strides = _table(
        [
            s
            for k, (o, p) in enumerate(zip(outputs, params))
            for s in (o.stride(0) if k < kept else o.stride(1), *((0, 0) if p is None else p.stride()))
        ],
        device,
    )
    grid = (count, -(-rows // _TILE), -(-cols // _TILE))
    kernel = _compiled(interpreting())["widened_decayed"]
    kernel[grid](results.contiguous(), addresses, param_addresses, strides, alpha, rows, cols, kept, TILE=_TILE)


@widened_decayed_.register_fake
def _(
    outputs: list[torch.Tensor], results: torch.Tensor, turned: int, params: list[torch.Tensor | None], alpha: float
) -> None:
    return None


def takes_widened_decayed(
    outputs: Sequence[torch.Tensor] | None,
    results: torch.Tensor,
    turned: int,
    params: Sequence[torch.Tensor | None],
) -> bool:
    """Whether :func:`widened_decayed_` takes these: :func:`takes_kernels` of the results, the
    outputs and the parameters, a 16-bit batch, fp32 outputs and parameters, and each output laid
    out as the kernel stores it (unit column stride, a tall matrix's transpose unit row stride).
    ``outputs=None`` stands for a new fp32 batch, which is laid out so."""
    given = [p for p in params if p is not None]
    kept = results.size(0) - turned
    outs = [] if outputs is None else list(outputs)
    return (
        results.dtype in (torch.bfloat16, torch.float16)
        and all(t.dtype == torch.float32 for t in (*outs, *given))
        and all(o.stride(1) == 1 if k < kept else o.stride(0) == 1 for k, o in enumerate(outs))
        and takes_kernels([results, *outs, *given])
    )
