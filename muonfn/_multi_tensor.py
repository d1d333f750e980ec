"""Arithmetic on lists of leaves: one fused multi-tensor call per op where torch can take it.

``torch._foreach_*`` ops have no batching rule under ``torch.func`` transforms (``vmap``,
``grad``), and a DTensor list does not mix with a plain 0-d tensor operand; those cases run
one op per tensor, with the same results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Tensors = Sequence[torch.Tensor]
_WIDE = (torch.float32, torch.float64)
_NARROW = (torch.bfloat16, torch.float16)


def second_moment_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype squares of a leaf of ``dtype`` are computed and kept in (second moments): the
    leaf's own, but fp32 for fp16. fp16's range stops at 6e-8: the square of an entry below
    2.4e-4 is zero there, of one below 7.8e-3 subnormal, and an epsilon such as 1e-8 rounds to
    zero, so a second moment kept in fp16 divides by zero. bf16 has fp32's range."""
    return torch.float32 if dtype == torch.float16 else dtype


def widened(tensors: Tensors) -> list[torch.Tensor]:
    """``tensors`` with the fp16 ones in fp32 (see :func:`second_moment_dtype`); the others as they are."""
    return [t.float() if t.dtype == torch.float16 else t for t in tensors]


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "placements")


def _plain(v: Any) -> bool:
    """A plain tensor operand (a list's first element stands for the list)."""
    if isinstance(v, list | tuple):
        v = v[0] if v else None
    return isinstance(v, torch.Tensor) and not _is_dtensor(v)


def _fused(tensors: Tensors, operands: tuple[Any, ...]) -> bool:
    if torch._C._are_functorch_transforms_active():
        return False
    # a plain 0-d tensor operand meets DTensor leaves one at a time (a fused op would put it
    # on the first leaf's mesh, and leaves may live on several meshes)
    return not (_is_dtensor(tensors[0]) and any(_plain(v) for v in operands))


def _as_tensor_operands(op: str, tensors: Tensors, operands: tuple[Any, ...]) -> tuple[Any, ...]:
    """On CPU, number operands (and 0-d tensors of another float dtype) of a list of one wide
    dtype become 0-d tensors of that dtype: torch's CPU multi-tensor kernels convert a number
    operand once per tensor (an allocation and a copy each), a tensor of the list's dtype not
    at all. The kernels round the number to that dtype either way: the same bits."""
    if not any(_scalar_operand(v) for v in operands):
        return operands  # lists only: nothing to convert (and no need to scan the leaves' dtypes)
    first = tensors[0]
    dtype = first.dtype
    # (a DTensor list keeps its numbers: a plain tensor operand would meet leaves on several meshes)
    if dtype not in _WIDE or first.device.type != "cpu" or _is_dtensor(first):
        return operands
    if any(t.dtype is not dtype for t in tensors):
        return operands
    out = []
    for v in operands:
        if isinstance(v, float | int) and not isinstance(v, bool):
            v = torch.tensor(v, dtype=dtype)
        elif not (isinstance(v, torch.Tensor) and v.ndim == 0 and v.dtype in _WIDE and v.device.type == "cpu"):
            out.append(v)
            continue
        elif v.dtype is not dtype:
            v = v.to(dtype)
        # mul and div take one tensor operand fastest; the others have no such fast overload
        out.append(v if op in _ONE_TENSOR_OPS else [v] * len(tensors))
    return tuple(out)


_ONE_TENSOR_OPS = frozenset({"mul", "div"})


def _scalar_operand(v: Any) -> bool:
    """A number, or a 0-d tensor (the operands :func:`_as_tensor_operands` may convert)."""
    return isinstance(v, float | int) or (isinstance(v, torch.Tensor) and v.ndim == 0)


def apply(op: str, tensors: Tensors, *operands: Any, **kwargs: Any) -> list[torch.Tensor]:
    """``[t.<op>(*operands) for t in tensors]``; a list operand gives one value per tensor."""
    if not tensors:
        return []
    if _fused(tensors, operands):
        operands = _as_tensor_operands(op, tensors, operands)
        return list(getattr(torch, f"_foreach_{op}")(tensors, *operands, **kwargs))
    method = getattr(torch.Tensor, op)
    per_tensor = [v if isinstance(v, list | tuple) else [v] * len(tensors) for v in operands]
    return [method(t, *args, **kwargs) for t, *args in zip(tensors, *per_tensor)]


def apply_(op: str, tensors: Tensors, *operands: Any, **kwargs: Any) -> list[torch.Tensor]:
    """``op`` in place on every tensor (``t.<op>_(...)``); returns ``tensors`` as a list.

    With a number operand, bf16/fp16 tensors go one at a time: the fused in-place kernels
    round them differently from the out-of-place ones (``_foreach_mul_(x, 0.95)`` is not
    ``_foreach_mul(x, 0.95)`` in bf16), and donated updates must equal undonated ones bitwise.
    """
    numbers = [*operands, *kwargs.values()]
    narrow = any(isinstance(v, int | float) for v in numbers) and any(t.dtype in _NARROW for t in tensors)
    if tensors and not narrow and _fused(tensors, operands):
        getattr(torch, f"_foreach_{op}_")(tensors, *_as_tensor_operands(op, tensors, operands), **kwargs)
        return list(tensors)
    per_tensor = [v if isinstance(v, list | tuple) else [v] * len(tensors) for v in operands]
    for t, *args in zip(tensors, *per_tensor):
        getattr(t, f"{op}_")(*args, **kwargs)
    return list(tensors)


def copies(tensors: Tensors) -> list[torch.Tensor]:
    """A copy of every tensor: one multi-tensor copy, or one copy each for DTensors and under
    ``torch.func`` transforms (neither has a multi-tensor copy)."""
    if torch._C._are_functorch_transforms_active() or any(_is_dtensor(t) for t in tensors):
        return [t.clone() for t in tensors]
    out = [torch.empty_like(t) for t in tensors]
    if out:
        torch._foreach_copy_(out, list(tensors))
    return out


def may_overwrite(tensors: Tensors, *operands: Any) -> bool:
    """Whether an update may write into the temporaries it computed from ``tensors`` (and
    ``operands``, numbers or 0-d tensors such as a learning rate): not under a ``torch.func``
    transform (in-place ops lack batching rules there) nor while autograd records any of them
    (a gradient may read a value the write would replace)."""
    if torch._C._are_functorch_transforms_active():
        return False
    recorded = [*tensors, *(v for v in operands if isinstance(v, torch.Tensor))]
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in recorded))


def off_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` lives off the CPU, where torch's multi-tensor ops run fused kernels: one
    launch for a whole list, if its operands allow it (one factor for all, not one per leaf)."""
    return t.device.type != "cpu"


def host_number(weight: Any, leaves: Tensors) -> Any:
    """``weight``, but a 0-d tensor on the host as a number when the leaves are not on the CPU, in
    an eager step, unless something differentiates it. Off the CPU torch's fused kernels take
    one number for all leaves (a tensor factor per leaf runs the op tensor by tensor, a kernel
    each), and reading a host tensor waits for no device; traced, the tensor is kept so that a
    new value does not recompile."""
    if isinstance(weight, torch.Tensor) and len(leaves) > 0 and off_cpu(leaves[0]) and readable_on_host(weight):
        return weight.item()
    return weight


def readable_on_host(value: torch.Tensor) -> bool:
    """Whether reading the 0-d ``value`` as a number is free and loses nothing: a plain tensor on
    the host, in an eager step, that no transform maps over (``vmap``) and nothing differentiates."""
    if torch.compiler.is_compiling():  # (and the functorch queries below do not trace)
        return False
    functorch = torch._C._functorch
    return (
        value.ndim == 0
        and value.device.type == "cpu"
        and type(value) is torch.Tensor
        and not (value.requires_grad and torch.is_grad_enabled())
        and not functorch.is_batchedtensor(value)
        and not functorch.is_gradtrackingtensor(value)
    )


def lerp(starts: Tensors, ends: Tensors, weight: float | torch.Tensor, *, inplace: bool = False) -> list[torch.Tensor]:
    """``start + weight·(end - start)`` per pair, as ``torch.lerp`` computes it with a Python
    number ``weight``: in at least fp32.

    A 0-d tensor ``weight`` is never read back to the host (the scalar overload would read
    it with ``.item()``, a device sync). The tensor-weight kernels round the weight to a
    bf16/fp16 leaf's dtype, so those leaves are computed in fp32 and rounded once, as the
    scalar kernel does.
    """
    weight = host_number(weight, starts)  # (the same rounding to the kernels' fp32 as the tensor's)
    if not isinstance(weight, torch.Tensor):
        return apply_("lerp", starts, ends, weight) if inplace else apply("lerp", starts, ends, weight)
    # in the dtype the scalar kernel reads a number in (fp32 but for fp64 leaves): a 0-d leaf
    # would otherwise be computed in a wider weight's dtype
    weights = {dtype: weight.to(dtype) for dtype in {t.dtype if t.dtype in _WIDE else torch.float32 for t in starts}}
    if all(t.dtype in _WIDE for t in starts):
        per_leaf = [weights[t.dtype] for t in starts]
        return apply_("lerp", starts, ends, per_leaf) if inplace else apply("lerp", starts, ends, per_leaf)
    out = []
    for start, end in zip(starts, ends):
        if start.dtype in _WIDE:
            w = weights[start.dtype]
            out.append(start.lerp_(end, w) if inplace else start.lerp(end, w))
        else:
            wide = start.float().lerp(end.float(), weights[torch.float32]).to(start.dtype)
            out.append(start.copy_(wide) if inplace else wide)
    return out


def scale(tensors: Tensors, factor: float | torch.Tensor, *, inplace: bool = False) -> list[torch.Tensor]:
    """``t·factor`` for every tensor (``factor`` a number or a 0-d tensor), in each tensor's dtype."""
    if inplace:
        return apply_("mul", tensors, factor)
    out = apply("mul", tensors, factor)
    if isinstance(factor, torch.Tensor):  # a 0-d tensor meets a 0-d factor as an equal and is promoted
        return [o if o.dtype == t.dtype else o.to(t.dtype) for o, t in zip(out, tensors)]
    return out


#: Quotients of at least this many elements are written over their denominators, one op per
#: tensor; smaller ones take a fused op and fresh tensors (their buffers cost little, a per-tensor
#: op's dispatch more).
_OVER_DENOMINATOR_NUMEL = 1 << 16


def quotients(numerators: Tensors, denominators: Tensors, *, overwrite: bool) -> list[torch.Tensor]:
    """``n / d`` per pair. With ``overwrite`` (the caller gives the denominators up) each large
    quotient goes into its denominator's buffer: no second buffer of that size is alive at
    once, which on a large embedding is the step's peak. Division rounds once either way:
    the same bits."""
    large = [overwrite and type(d) is torch.Tensor and d.numel() >= _OVER_DENOMINATOR_NUMEL for d in denominators]
    small = [i for i, big in enumerate(large) if not big]
    out = list(denominators)
    for i, q in zip(small, apply("div", [numerators[i] for i in small], [denominators[i] for i in small])):
        out[i] = q
    for n, d, big in zip(numerators, denominators, large):
        if big:
            torch.div(n, d, out=d)
    return out
