r"""Newton–Schulz orthogonalization, standard and Gram, and the exact polar factor.

For :math:`G = U \Sigma V^\top` the polar factor is :math:`U V^\top`. Newton–Schulz
approximates it without an SVD: normalise :math:`X_0 = G / \max(c\,\|G\|_F, \varepsilon)`
(so every singular value lies in [0, 1]), then iterate the odd quintic

.. math::  X_{k+1} = a_k X_k + (b_k A + c_k A^2) X_k, \qquad A = X_k X_k^\top,

which maps each singular value through :math:`p_k(\sigma) = a_k\sigma + b_k\sigma^3 + c_k\sigma^5`
while leaving the singular vectors alone.

*Gram Newton–Schulz* runs the same map on the small Gram matrix. Every iterate is a
polynomial in :math:`R_0 = X_0 X_0^\top` applied to :math:`X_0`, :math:`X_k = Q_k X_0`, so
for a wide :math:`m\times n` matrix the iteration can be carried by two :math:`m\times m`
matrices:

.. math::  P_k = a_k I + b_k R_k + c_k R_k^2, \qquad Q_{k+1} = P_k Q_k, \qquad R_{k+1} = P_k R_k P_k,

and :math:`X_K = Q_K X_0` is formed once at the end. Cost for 5 steps with one restart:
:math:`8m^2n + 28m^3` flops against :math:`20m^2n + 10m^3`, fewer once :math:`n > 1.5\,m`.
Rounding in :math:`R_k` is not corrected by the iteration (it can even give :math:`R_k`
slightly negative eigenvalues, which the map amplifies by about :math:`a^2` a step), so a
*restart* re-forms :math:`X_k = Q_k X_0`, recomputes :math:`R_k = X_kX_k^\top` and resets
:math:`Q_k = I`.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, TypeAlias, get_args

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import _kernels
from ._coefficients import Coefficients, CoefficientsLike, ns_schedule

NSMethod: TypeAlias = Literal["standard", "gram"]
NS_METHODS: tuple[str, ...] = get_args(NSMethod)
EpsMode: TypeAlias = Literal["clamp", "add"]
EPS_MODES: tuple[str, ...] = get_args(EpsMode)


class Decay(NamedTuple):
    """The decay an orthogonalizer adds to its results as it stores them: ``alpha·p`` for every
    result whose ``p`` is given (``params`` align with the results; ``None``: not decayed)."""

    params: Sequence[torch.Tensor | None]
    alpha: float


class Reduction(Protocol):
    """Combines the per-block values of matrices whose columns are split into blocks held elsewhere.

    Newton–Schulz on such blocks needs the whole matrix's max-abs entry, squared norm and
    Gram matrix :math:`XX^\top = \\sum_r X_rX_r^\top`; a reduction returns those totals
    (it may work in place).
    """

    def sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def max(self, t: torch.Tensor) -> torch.Tensor: ...


#: ``auto`` (the rule of :func:`default_ns_dtype`), ``bfloat16`` or ``float32`` (at least fp32)
CPU_NS_DTYPE_VARIABLE = "MUONFN_CPU_NS_DTYPE"
CPU_NS_DTYPE_CHOICES = ("auto", "bfloat16", "float32")

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
            "fp32_seconds": self.fp32_seconds,
            "bf16_seconds": self.bf16_seconds,
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
                    seconds = time.perf_counter() - start
                    if round_:
                        fastest[dtype] = min(fastest[dtype], seconds)
                if round_ >= 2 and fastest[torch.bfloat16] > _PROBE_HOPELESS * fastest[torch.float32]:
                    break
    finally:
        torch.set_num_threads(threads)
    return CpuBf16Probe(fp32_seconds=fastest[torch.float32], bf16_seconds=fastest[torch.bfloat16])


@torch.compiler.assume_constant_result  # a traced update reads the answer, not the probe
def _cpu_bf16_is_faster() -> bool:
    return cpu_bf16_probe().bf16_faster


def _cpu_choice() -> str:
    choice = os.environ.get(CPU_NS_DTYPE_VARIABLE, "auto")
    if choice not in CPU_NS_DTYPE_CHOICES:
        raise ValueError(f"{CPU_NS_DTYPE_VARIABLE}={choice!r}; choose one of {list(CPU_NS_DTYPE_CHOICES)}")
    return choice


#: Where the CPU rule picks bf16 (:func:`cpu_bf16_probe` measured it faster), the least work
#: (``m²n``, ``m <= n``) of one matrix whose Newton–Schulz runs in bf16: below it, the fixed cost of
#: the bf16 kernels outweighs their speed (a batch of 24 matrices of 32×96, ``m²n`` = 98,304, takes
#: as long in bf16 as in fp32; 48×144, 331,776, half as long; 8×24 matrices 4.7× longer in bf16).
CPU_BF16_MIN_WORK = 2**18


def default_ns_dtype(device: torch.device, dtype: torch.dtype, shape: Sequence[int] | None = None) -> torch.dtype:
    """The Newton–Schulz dtype when none is given: bf16 where the device multiplies it fastest.

    - CUDA: bf16 (tensor cores).
    - A CPU whose bf16 matmuls ran at least :data:`CPU_BF16_MIN_SPEEDUP` times faster than fp32
      (measured once per process by :func:`cpu_bf16_probe`): bf16 for fp32 and narrower inputs whose
      matrices (``shape``: one matrix's, or ``None`` for any) hold at least :data:`CPU_BF16_MIN_WORK`
      of work ``m²n`` (``m <= n``); the input's dtype, at least fp32, for smaller ones; fp64 input
      keeps fp64. Smaller matrices never take the probe.
    - Any other CPU, or other device: the input's dtype, at least fp32.

    The environment variable ``MUONFN_CPU_NS_DTYPE`` pins the CPU rule for a whole process
    (and its workers), without a probe: ``bfloat16`` (every size), ``float32`` (the input's dtype,
    at least fp32) or ``auto``. ``ns_dtype=`` pins it for one optimizer.
    """
    if device.type == "cuda":
        return torch.bfloat16
    wide = torch.promote_types(dtype, torch.float32)
    if device.type != "cpu" or dtype == torch.float64:
        return wide
    choice = _cpu_choice()
    if choice == "bfloat16" or (choice == "auto" and _enough_work(shape) and _cpu_bf16_is_faster()):
        return torch.bfloat16
    return wide


def _enough_work(shape: Sequence[int] | None) -> bool:
    if shape is None:
        return True
    m, n = sorted(shape[-2:])
    return m * m * n >= CPU_BF16_MIN_WORK


def _check(name: str, x: torch.Tensor, eps: float, dtype: torch.dtype | None, eps_mode: str = "clamp") -> None:
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not (0 < eps < math.inf):
        raise ValueError(f"Newton–Schulz eps must be finite and > 0, got {eps!r}")
    if eps_mode not in EPS_MODES:
        raise ValueError(f"Newton–Schulz eps_mode must be one of {list(EPS_MODES)}, got {eps_mode!r}")
    if x.ndim < 2:
        raise ValueError(f"{name} needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} needs a real floating-point tensor, got {x.dtype}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"Newton–Schulz dtype must be a real floating-point torch.dtype, got {dtype!r}")


def _wide_batch(x: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
    """``x`` as a contiguous ``(count, m, n)`` batch with ``m <= n``, in at least fp32; whether
    it was transposed, and whether it was copied.

    The orientation is decided by shape alone, so results depend on values, never on memory layout.
    """
    tall = x.size(-2) > x.size(-1)
    g = x.mT if tall else x
    m, n = g.shape[-2:]
    wide_dtype = torch.promote_types(x.dtype, torch.float32)
    batch = g.reshape(g.shape[:-2].numel(), m, n)
    copied = batch.dtype != wide_dtype or not batch.is_contiguous()
    return batch.to(wide_dtype).contiguous(), tall, copied


def _normalized(
    g: torch.Tensor,
    schedule: Coefficients,
    eps: float,
    dtype: torch.dtype,
    reduction: Reduction | None,
    eps_mode: str = "clamp",
    *,
    owned: bool = False,
) -> torch.Tensor:
    r""":math:`G / \max(c\|G\|_F, \varepsilon)` per matrix (``eps_mode="add"``:
    :math:`G / (c\|G\|_F + \varepsilon)`) in ``dtype``, without overflow.

    On a CPU, each matrix is first multiplied by the power of two that brings its largest entry
    into [1, 2): exact, so ``f(2ᵏG) = f(G)`` bit for bit, and a norm of entries near the dtype's
    maximum cannot overflow; the norm and the quotient are then taken in ``g``'s precision and
    the quotient rounded to ``dtype`` once. Off the CPU, an fp32 ``g`` into a narrower ``dtype``
    takes two passes instead (see :func:`_narrowed`). ``owned``: ``g`` is this call's own copy,
    which it may overwrite.
    """
    if dtype != g.dtype and g.dtype == torch.float32 and not cpu_passes(g):
        return _narrowed(g, schedule, eps, dtype, reduction, eps_mode)
    largest = _largest_magnitude(g)
    if reduction is not None:
        largest = reduction.max(largest)
    unit = _power_of_two_unit(largest, g.dtype)
    writable = may_write_into(g)
    g = g.mul_(unit) if owned and writable else g * unit
    denominator = _denominator(g, unit, schedule, eps, reduction, eps_mode)
    if not writable:
        return (g / denominator).to(dtype)
    # g·2⁻ᵉ is this call's own. Dividing in place and then casting is about 3x faster on a CPU
    # than one division into a narrower ``out=`` (which casts element by element), same bits
    return g.div_(denominator).to(dtype)


def _narrowed(
    g: torch.Tensor, schedule: Coefficients, eps: float, dtype: torch.dtype, reduction: Reduction | None, eps_mode: str
) -> torch.Tensor:
    """:func:`_normalized` of an fp32 ``g`` off the CPU, in two passes over it: its norm
    accumulated in fp64, where no sum of fp32 squares overflows or underflows (see
    :func:`_fp64_norms`), and the product by the fp64 reciprocal of the denominator, rounded
    into ``dtype`` as it is stored (6 bytes an entry moved, where the power of two's passes and
    a division move 16). Scaling ``g`` by 2ᵏ scales the norm exactly, so ``f(2ᵏG) = f(G)`` bit
    for bit here too. (A CPU reduces fp32 into fp64 through a widened copy, and multiplies into
    a narrower ``out=`` element by element: its own form is faster there.)"""
    norm = _fp64_norms(g)
    if reduction is not None:
        norm = reduction.sum(norm.square()).sqrt()
    reciprocal = _reciprocal_denominator(norm, schedule, eps, eps_mode)
    if may_write_into(g):  # one pass: the fp64 product rounded to ``dtype`` as it is stored
        return torch.mul(g, reciprocal, out=torch.empty(g.shape, dtype=dtype, device=g.device))
    return (g * reciprocal).to(dtype)


def _reciprocal_denominator(norm: torch.Tensor, schedule: Coefficients, eps: float, eps_mode: str) -> torch.Tensor:
    """``1 / max(c·norm, ε)`` (``"add"``: ``1 / (c·norm + ε)``) of fp64 norms."""
    if schedule.norm_factor != 1.0:
        norm = norm * schedule.norm_factor
    return (norm + eps if eps_mode == "add" else norm.clamp_min(eps)).reciprocal()


def _narrowed_matrices(
    matrices: Sequence[torch.Tensor], schedule: Coefficients, eps: float, dtype: torch.dtype, eps_mode: str
) -> torch.Tensor:
    """:func:`_narrowed` of the batch of ``matrices`` (fp32, of one shape), built here: each
    matrix's norm read from its own memory (:func:`_fp64_norms_of`), then the batch of their
    products by the reciprocals, rounded into ``dtype``. With muonfn's Triton kernels on
    (:mod:`muonfn._kernels`) and ``dtype`` bf16 or fp16, the reciprocals and the products are
    taken from the norms and the matrices in one pass (no fp32 stack, 8 bytes an entry less, two
    ops fewer), the same bits; else the matrices are stacked first."""
    norms = _fp64_norms_of(matrices)
    if _kernels.takes_scaled_stack(matrices, dtype):
        return _kernels.scaled_stack(
            list(matrices), norms.view(-1), dtype, eps, schedule.norm_factor, eps_mode == "add"
        )
    reciprocal = _reciprocal_denominator(norms, schedule, eps, eps_mode)
    stack = torch.stack(list(matrices))
    if may_write_into(stack):
        return torch.mul(stack, reciprocal, out=torch.empty(stack.shape, dtype=dtype, device=stack.device))
    return (stack * reciprocal).to(dtype)


def _fp64_norms(g: torch.Tensor) -> torch.Tensor:
    """The Frobenius norm of every matrix of a ``(count, m, n)`` batch, accumulated in fp64,
    shaped ``(count, 1, 1)``.

    Eager, one multi-tensor norm over the matrices: a GPU reads fp32 and adds its squares in
    fp64 as they are loaded (4 bytes an entry), where ``linalg.vector_norm(dtype=float64)``
    first copies the batch into fp64 (20 bytes an entry). Each matrix's norm is summed from its
    own entries in an order set by its own size, however many matrices share the call. Under
    ``vmap`` (the multi-tensor norm has no batching rule) the batch underneath is normed the
    same way, so a vmapped ensemble keeps a stacked one's bits; compiled, the compiler widens
    the entries inside its own reduction.
    """
    if type(g) is torch.Tensor and g.numel() and not torch.compiler.is_compiling():
        return _fp64_norms_of(_matrices(g)).view(*g.shape[:-2], 1, 1)
    return torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True, dtype=torch.float64)


def _fp64_norms_of(matrices: Sequence[torch.Tensor]) -> torch.Tensor:
    """The Frobenius norm of each of ``matrices`` as :func:`_fp64_norms` takes it, read from the
    matrix's own memory, shaped ``(count, 1, 1)``: a contiguous matrix's the same bits as in the stack, a
    transposed view's (a tall matrix read as its wide transpose) summed in the order of its own
    rows. Under ``vmap`` the members' matrices underneath are normed the same way, so that a
    vmapped ensemble keeps the bits of its members stepped alone; compiled, or where ``vmap``
    maps some of the matrices and not others (one the members share), the stack's norm."""
    functorch = torch._C._functorch
    if not torch.compiler.is_compiling() and all(type(m) is torch.Tensor and m.numel() for m in matrices):
        batched = [functorch.is_batchedtensor(m) for m in matrices]
        if not any(batched):
            return torch.stack(torch._foreach_norm(list(matrices), 2, dtype=torch.float64)).view(-1, 1, 1)
        # (an unmapped matrix has no members to unwrap: the stack broadcasts it over them)
        inner = [functorch.get_unwrapped(m) for m in matrices] if all(batched) else []
        levels = {functorch.maybe_get_level(m) for m in matrices}
        if (
            inner
            and len(levels) == 1
            and all(type(t) is torch.Tensor and not functorch.is_batchedtensor(t) for t in inner)
        ):
            members = [t.movedim(functorch.maybe_get_bdim(m), 0) for t, m in zip(inner, matrices)]
            if len({t.shape[0] for t in members}) == 1:  # (one batch size: no matrix broadcast over the members)
                norms = torch._foreach_norm([x for t in members for x in t.unbind(0)], 2, dtype=torch.float64)
                per_member = torch.stack(norms).view(len(matrices), -1).mT.reshape(-1, len(matrices), 1, 1)
                return functorch._add_batch_dim(per_member, 0, levels.pop())
    return torch.linalg.vector_norm(torch.stack(list(matrices)), dim=(-2, -1), keepdim=True, dtype=torch.float64)


def _matrices(x: torch.Tensor) -> list[torch.Tensor]:
    """The ``(m, n)`` matrices of a ``(..., m, n)`` tensor, as views, in order."""
    return list(x.unbind(0)) if x.ndim == 3 else [m for part in x.unbind(0) for m in _matrices(part)]


def _denominator(
    x: torch.Tensor, unit: torch.Tensor, schedule: Coefficients, eps: float, reduction: Reduction | None, eps_mode: str
) -> torch.Tensor:
    """``max(c‖x‖, unit·ε)`` per matrix (``"add"``: ``c‖x‖ + unit·ε``), in ``x``'s precision, at
    least fp32: ``x`` is ``G·unit``, every term scaled by the same power of two, so the same bits."""
    wide = torch.promote_types(x.dtype, torch.float32)
    if reduction is None:
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=wide)
    else:
        norm = reduction.sum(x.to(wide).square().sum(dim=(-2, -1), keepdim=True)).sqrt()
    if schedule.norm_factor != 1.0:
        norm = norm * schedule.norm_factor
    eps_term = (unit * eps).to(wide)
    return norm.add(eps_term) if eps_mode == "add" else torch.maximum(norm, eps_term)


def cpu_passes(g: torch.Tensor) -> bool:
    """Whether ``g`` takes the CPU's form of a pass (fastest there) rather than the fewest
    passes over memory (a GPU's, and the meta device's); the two give the same bits, but for the
    normalisation into a narrower dtype (see :func:`_normalized`)."""
    return g.device.type == "cpu"


def _largest_magnitude(g: torch.Tensor) -> torch.Tensor:
    """max |G| of every matrix, shaped ``(..., 1, 1)`` (0 for a matrix without entries)."""
    if not g.numel():  # (a rank's block of a split matrix may be empty, and so may a zero-size parameter)
        return g.new_zeros((*g.shape[:-2], 1, 1))
    dims = (-2, -1)
    if not cpu_passes(g):
        return torch.linalg.vector_norm(g, ord=math.inf, dim=dims, keepdim=True)  # one reduction
    # on a CPU max(max G, -min G): two vectorized reductions, no |G| written out, about 10x faster
    # than the infinity norm's scalar reduction (and torch.aminmax ~20x slower)
    return torch.maximum(g.amax(dim=dims, keepdim=True), g.amin(dim=dims, keepdim=True).neg())


#: Of each wide float dtype: the integers its bits are read as, its mantissa's bits, its exponent's bias.
_FLOAT_BITS = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}


def _power_of_two_unit(largest: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r""":math:`2^{-e}` that brings ``largest`` (``>= 0``, of ``dtype``) into [1, 2), ``e``
    clamped so that both :math:`2^{\pm e}` stay normal numbers of ``dtype``.

    Read from the bits, three integer ops: the exponent field of ``largest`` (its sign bit is
    clear), clamped to the normal range less its top, and subtracted from twice the bias. (0, a
    subnormal and inf clamp to the ends: ``2^{126}`` and ``2^{-126}`` in fp32.)
    """
    ints, mantissa, bias = _FLOAT_BITS[dtype]
    field = largest.view(ints).bitwise_and(-(1 << mantissa)).clamp(1 << mantissa, (2 * bias - 1) << mantissa)
    return torch.rsub(field, 2 * bias << mantissa).view(dtype)


def _standard_steps(
    X: torch.Tensor, schedule: Coefficients, reduction: Reduction | None, scale: float = 1.0
) -> torch.Tensor:
    r"""The quintic steps :math:`X \leftarrow aX + (bA + cA^2)X`, :math:`A = XX^\top`, the last
    one multiplied by ``scale`` (inside the step's matmuls, where it costs no pass)."""
    if reduction is None and may_write_into(X):
        return _standard_steps_in_place(X, schedule, scale)
    triples = schedule.triples
    for k, (a, b, c) in enumerate(triples):
        A = torch.bmm(X, X.mT)
        if reduction is not None:
            A = reduction.sum(A)
        X = _step(X, A, a, b, c, scale if k == len(triples) - 1 else 1.0)
    return X if triples or scale == 1.0 else X * scale


def _step(
    X: torch.Tensor,
    A: torch.Tensor,
    a: float,
    b: float,
    c: float,
    s: float = 1.0,
    factor: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`s\,(aX + (bA + cA^2)X)` (the small ``m×m`` factor into ``factor``, the result into
    ``out``, where given).

    In fp32 and wider, as :math:`(saI + sbA + scA^2)X`: the factor formed on the small side and
    one plain matmul, more accurate there and no pass over ``X`` beside the matmuls
    (``baddbmm``'s :math:`aX + BX` copies ``X`` into its output and reads it again). In a 16-bit
    dtype, as :math:`saX + sBX` in the matmul's fp32 epilogue: the factor's diagonal
    :math:`a + B_{ii}`, rounded to 8 bits, would scale whole rows of the result by its error."""
    if X.dtype.itemsize >= 4:
        P = torch.baddbmm(A, A, A, beta=b * s, alpha=c * s, out=factor)
        P.diagonal(dim1=-2, dim2=-1).add_(a * s)
        return torch.bmm(P, X, out=out)
    # a product weighted 0 is left out: torch's CPU baddbmm in bf16 returns wrong values with alpha=0
    # (matrices of 12×12 and up, torch 2.13), where the term is 0 anyway
    B = torch.mul(A, b, out=factor) if c == 0 else torch.baddbmm(A, A, A, beta=b, alpha=c, out=factor)
    return torch.mul(X, a * s, out=out) if s == 0 else torch.baddbmm(X, B, X, beta=a * s, alpha=s, out=out)


def may_write_into(X: torch.Tensor) -> bool:
    """Whether a computation on ``X`` may write into buffers of its own (``out=``, ``copy_``):
    not when traced by ``torch.func`` or ``torch.compile`` (which plan their own memory) or
    recorded by autograd."""
    return not (
        torch._C._are_functorch_transforms_active()
        or torch.compiler.is_compiling()
        or (X.requires_grad and torch.is_grad_enabled())
    )


def _standard_steps_in_place(X: torch.Tensor, schedule: Coefficients, scale: float = 1.0) -> torch.Tensor:
    """:func:`_standard_steps` in three buffers reused by every step (``X``, the normalised
    input, is this call's own and is one of them): a step allocates nothing, which on a CPU
    that returns freed blocks to the system saves the page faults of fresh memory."""
    count, m, _ = X.shape
    A = X.new_empty((count, m, m))
    factor = torch.empty_like(A)
    Y = torch.empty_like(X)
    triples = schedule.triples
    for k, (a, b, c) in enumerate(triples):
        torch.bmm(X, X.mT, out=A)
        _step(X, A, a, b, c, scale if k == len(triples) - 1 else 1.0, factor=factor, out=Y)
        X, Y = Y, X
    return X if triples or scale == 1.0 else X * scale


def _gram_steps(X: torch.Tensor, schedule: Coefficients, restarts: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    steps = len(schedule.triples)
    R = torch.bmm(X, X.mT)
    Q: torch.Tensor | None = None  # the identity
    for k, (a, b, c) in enumerate(schedule.triples):
        if k in restarts:
            if Q is not None:
                X = torch.bmm(Q, X)
                Q = None
            R = torch.bmm(X, X.mT)
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else torch.bmm(P, Q)
        if k + 1 < steps and k + 1 not in restarts:
            R = torch.bmm(P, torch.bmm(R, P))
    if Q is None:
        return X if scale == 1.0 else X * scale
    return torch.bmm(Q, X) if scale == 1.0 else torch.baddbmm(X, Q, X, beta=0, alpha=scale)


#: Slices at least this large are transposed by 2-D copies, which torch's CPU copy does in
#: cache-sized tiles; below it a single strided copy of the batch is cheaper.
_TILED_TRANSPOSE_NUMEL = 1 << 17


def in_memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` in contiguous memory, its values unchanged.

    A tall matrix comes out of Newton–Schulz as the transposed view of a wide result.
    Every pass that follows (decay, learning rate, the parameter update) would then read
    it across rows: with row strides of a power of two bytes that is ~30× slower than
    reading it in memory order on a CPU, so one transposing copy here saves two or more.

    Compiled, a transposed ``x`` is copied by a kernel of its own (:func:`apart`).
    """
    if x.is_contiguous():
        return x
    if compiled_apart(x) and transposed(x):
        return _copy_apart(x)
    rows, cols = x.shape[-2:]
    tiled = x.mT.is_contiguous() and rows * cols >= _TILED_TRANSPOSE_NUMEL
    if not (tiled and type(x) is torch.Tensor and x.device.type == "cpu" and may_write_into(x)):
        return x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for dst, src in zip(out.view(-1, rows, cols), x.mT.reshape(-1, cols, rows)):
        dst.copy_(src.mT)
    return out


def transposed(x: torch.Tensor) -> bool:
    """Whether ``x`` walks its memory out of order (a transposed view): its strides, over the
    dimensions longer than 1, do not decrease."""
    strides = [stride for size, stride in zip(x.shape, x.stride()) if size > 1]
    return any(a < b for a, b in itertools.pairwise(strides))


def compiled_apart(x: torch.Tensor) -> bool:
    """Whether :func:`apart` copies ``x``: a plain tensor, traced by ``torch.compile`` and by no
    ``torch.func`` transform."""
    return torch.compiler.is_compiling() and type(x) is torch.Tensor and not torch._C._are_functorch_transforms_active()


def apart(x: torch.Tensor) -> torch.Tensor:
    """``x``; compiled, a transposed ``x`` is copied into contiguous memory by a kernel of its own.

    A compiler fuses a transposing copy into its neighbours, so that the kernel writing a
    buffer and the one reading it transposed meet in one fusion decision, and torch 2.11's
    inductor (CUDA) fails on it when one of them is a fused multi-tensor (``_foreach_*``)
    kernel (``reorder_loops_by_dep_pair`` asserts, on two memory deps of one buffer that are
    transposes of each other). Newton–Schulz's stacks read the momentum's multi-tensor
    results transposed (tall matrices join the calls of their wide shape), and the update's
    multi-tensor ops read its results: a copy the compiler keeps apart (an opaque op) stands
    between the two. Eager, nothing is copied: the reader reads ``x`` as it is.
    """
    return _copy_apart(x) if compiled_apart(x) and transposed(x) else x


@torch.library.custom_op("muonfn::copy_apart", mutates_args=())
def _copy_apart(x: torch.Tensor) -> torch.Tensor:
    """``x`` in new contiguous memory: an op of muonfn's own, which a compiler runs as it is."""
    return x.clone(memory_format=torch.contiguous_format)


@_copy_apart.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_copy_apart.register_autograd(lambda ctx, grad: grad)  # the values are unchanged: so is the gradient


def _restored(X: torch.Tensor, x: torch.Tensor, tall: bool, into: torch.Tensor | None = None) -> torch.Tensor:
    """``X`` in ``x``'s dtype, shape and orientation; written into ``into`` when given."""
    restored = X.to(x.dtype) if into is None else into.copy_(X)
    out = restored.reshape(*x.shape[:-2], *X.shape[-2:])
    if not tall:
        return out
    return in_memory_order(out.mT) if x.is_contiguous() else out.mT


def add_decay(results: Sequence[torch.Tensor], decay: Decay) -> None:
    """``decay`` added in place to the results whose parameter it gives, as one multi-tensor add
    (the decay's eager pass)."""
    pairs = [(r, p) for r, p in zip(results, decay.params) if p is not None]
    if pairs:
        torch._foreach_add_([r for r, _ in pairs], [p for _, p in pairs], alpha=decay.alpha)


def _decayed(results: list[torch.Tensor], turned: int, decay: Decay | None) -> list[torch.Tensor]:
    """``results`` (those of :meth:`NewtonSchulz.orthogonalize_matrices`, the last ``turned`` in
    the orientation of their tall matrices) with ``decay`` (its tall parameters given as their
    transposes) added in place."""
    if decay is not None:
        kept = len(results) - turned
        params = [p if p is None or k < kept else p.mT for k, p in enumerate(decay.params)]
        add_decay(results, Decay(params, decay.alpha))
    return results


def _stored(
    result: torch.Tensor, matrices: Sequence[torch.Tensor], turned: int, decay: Decay | None, overwrite: bool
) -> list[torch.Tensor]:
    """The fp32 results of ``matrices`` from ``result``, their Newton–Schulz batch in a narrower
    dtype (its last ``turned`` matrices the transposes of tall ones, whose results come back in
    their own orientation), with ``decay`` added. ``overwrite``: written into the memory of the
    matrices (the caller's temporaries), where a new fp32 batch would hold them: with muonfn's
    Triton kernels all of them, eager the wide ones, each contiguous (one multi-tensor copy on
    torch's fused path; a tall one's transposed copy would take a kernel per matrix there)."""
    kept = len(matrices) - turned
    if decay is not None and _kernels.takes_widened_decayed(
        matrices if overwrite else None, result, turned, decay.params
    ):
        if overwrite:
            outputs = list(matrices)
        else:
            rows, cols = result.shape[-2:]
            batch = torch.empty(result.shape, dtype=torch.float32, device=result.device)
            outputs = [*batch[:kept].unbind(0), *(t.mT for t in batch[kept:].view(turned, cols, rows).unbind(0))]
        _kernels.widened_decayed_(outputs, result, turned, list(decay.params), decay.alpha)
        return [*outputs[:kept], *(o.mT for o in outputs[kept:])]
    if overwrite and kept and all(type(m) is torch.Tensor and m.is_contiguous() for m in matrices[:kept]):
        wide = list(matrices[:kept])
        torch._foreach_copy_(wide, list(result[:kept].unbind(0)))
        tall = list(_restored_turning(result[kept:], torch.float32, turned, None)[1].unbind(0)) if turned else []
    else:
        wide_batch, tall_batch = _restored_turning(result, torch.float32, turned, None)
        wide, tall = list(wide_batch.unbind(0)), list(tall_batch.unbind(0))
    return _decayed([*wide, *tall], turned, decay)


def _restored_turning(
    X: torch.Tensor, dtype: torch.dtype, turned: int, into: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_restored` of a wide ``(count, m, n)`` batch whose last ``turned`` matrices stand for
    tall ones: the others as they are, and those transposed back, ``(turned, n, m)`` and
    contiguous. Off the CPU the pass that restores them writes them so, into the memory of their
    own orientation (no transposing copy after it); on a CPU they are copied in tiles after it.
    ``X`` already in ``dtype`` (and no ``into``) keeps the others where they are: only the tall
    ones take a pass."""
    kept = X.size(0) - turned
    if cpu_passes(X) or type(X) is not torch.Tensor or not may_write_into(X):
        out = X.to(dtype) if into is None else into.copy_(X)
        return out[:kept], in_memory_order(out[kept:].mT)
    m, n = X.shape[-2:]
    if into is None and X.dtype == dtype:
        tall = torch.empty((turned, n, m), dtype=dtype, device=X.device)
        if tall.numel():
            tall.mT.copy_(X[kept:])
        return X[:kept], tall
    buffer = torch.empty(X.shape, dtype=dtype, device=X.device) if into is None else into
    parts = (buffer[:kept], buffer[kept:].view(turned, n, m))
    for source, target in zip((X[:kept], X[kept:]), (parts[0], parts[1].mT)):
        if source.numel():
            target.copy_(source)
    return parts


def newton_schulz(
    x: torch.Tensor,
    coefficients: CoefficientsLike = "keller",
    *,
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    eps_mode: EpsMode = "clamp",
) -> torch.Tensor:
    r"""Approximately orthogonalizes every matrix in ``x`` of shape ``(..., m, n)``.

    Leading dimensions are a batch. The input is normalised by its Frobenius norm over
    the last two dimensions, :math:`X_0 = G / \max(c\|G\|_F, \varepsilon)`, in at least
    fp32 and without overflow for any finite input, and only then cast to ``dtype``
    (``None``: bf16 on CUDA; elsewhere fp32, or fp64 for fp64 inputs). The iteration runs
    on the wide orientation (``m <= n``; tall inputs are transposed and transposed back),
    so :math:`A = XX^\top` is the small Gram matrix.

    Exact properties: ``f(-G) = -f(G)``, ``f(0) = 0``, ``f(2**k G) = f(G)`` while
    ``||G||`` and ``||2**k G||`` are ``>= eps`` (any finite scale), ``f(G.mT) = f(G).mT``
    for non-square ``G``; on CPU a batch equals its matrices one by one wherever the BLAS
    itself is batch-invariant. Returns ``x.dtype``, contiguous where ``x`` is; never modifies ``x``.

    Args:
        x: a tensor with at least two dimensions.
        coefficients: ``"keller"``, ``"cesista"``, ``"polar_express"``, a
            :class:`Coefficients`, or a sequence of ``(a, b, c)`` triples.
        steps: number of iterations (default: the schedule's length).
        eps: lower bound of the normalising norm; must be positive.
        dtype: dtype of the iteration's matmuls.
        eps_mode: ``"clamp"`` normalises by :math:`\max(c\|G\|_F, \varepsilon)`; ``"add"``
            by :math:`c\|G\|_F + \varepsilon` (Keller's, optax's and dtensor-muon's form),
            equal to the direct formula bit for bit wherever that is finite and no
            intermediate is subnormal. ``"add"`` gives up exact scale invariance.

    Returns:
        The orthogonalized tensor, of ``x``'s shape and dtype.

    Example:
        >>> g = torch.randn(4, 8, dtype=torch.float64)
        >>> o = muonfn.newton_schulz(g, "polar_express")
        >>> torch.allclose(o @ o.mT, torch.eye(4, dtype=torch.float64), atol=1e-5)
        True
    """
    schedule = ns_schedule(coefficients, steps)
    _check("newton_schulz", x, eps, dtype, eps_mode)
    X, tall, spare = _iterated(x, schedule, eps, dtype, eps_mode, _standard_iteration(schedule), owned=False)
    return _restored(X, x, tall, into=spare)


def newton_schulz_columns(
    blocks: torch.Tensor,
    schedule: Coefficients,
    reduction: Reduction,
    *,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    eps_mode: EpsMode = "clamp",
    matrix_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """:func:`newton_schulz` of matrices whose columns are split into blocks, given one block of
    each as a ``(count, m, n_r)`` batch of a wide (``m <= n``) orientation; ``reduction``
    combines the blocks' values. Returns the blocks of the result, in the iteration dtype.
    ``matrix_shape``: the whole matrices' shape, from which the default dtype is chosen as
    for whole matrices (see :func:`default_ns_dtype`)."""
    _check("newton_schulz_columns", blocks, eps, dtype, eps_mode)
    g = blocks.to(torch.promote_types(blocks.dtype, torch.float32)).contiguous()
    ns_dtype = default_ns_dtype(blocks.device, blocks.dtype, matrix_shape) if dtype is None else dtype
    return _standard_steps(_normalized(g, schedule, eps, ns_dtype, reduction, eps_mode), schedule, reduction)


def default_restarts(steps: int, dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
    """A restart before every third step in fp32/fp64 (``(3,)`` for 5 steps, ``(3, 6)`` for 8),
    every second in 16-bit dtypes (``(2, 4)``, ``(2, 4, 6)``).

    Measured on 32×128 to 256×1024 matrices with Gaussian, geometric (1 … 1e-8) and
    low-rank spectra: the error stays within 3× that of the standard iteration in every
    dtype, where restarting every third step let the 8-step ``"polar_express"`` schedule
    (first slope 8.2) overflow to NaN in bf16. Both keep the crossover with the standard
    iteration's flops at ``n ≈ 1.5 m``.
    """
    every = 2 if dtype.itemsize <= 2 else 3
    return tuple(range(every, steps, every))


def _check_restarts(restarts: Sequence[int], steps: int) -> tuple[int, ...]:
    if isinstance(restarts, str | bytes) or not isinstance(restarts, Sequence):
        raise TypeError(
            f"Gram Newton–Schulz restarts must be a sequence of step indices in [1, {steps - 1}], got {restarts!r}"
        )
    out = tuple(restarts)
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 < r < steps:
            raise ValueError(f"Gram Newton–Schulz restarts must be step indices in [1, {steps - 1}], got {restarts!r}")
    return tuple(sorted(set(out)))


def gram_newton_schulz(
    x: torch.Tensor,
    coefficients: CoefficientsLike = "keller",
    *,
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    restarts: Sequence[int] | None = None,
    eps_mode: EpsMode = "clamp",
) -> torch.Tensor:
    r"""Approximately orthogonalizes every matrix in ``x`` of shape ``(..., m, n)`` via its Gram matrix.

    The same map as :func:`newton_schulz` (same arguments, normalisation, dtypes,
    orientation and exact properties), computed through the ``m×m`` Gram matrix of the
    wide orientation; equal to it up to rounding. Cheaper than the standard iteration once
    the long side exceeds about 1.5× the short one.

    Args:
        x: a tensor with at least two dimensions.
        coefficients: as for :func:`newton_schulz`.
        steps: number of iterations (default: the schedule's length).
        eps: lower bound of the normalising norm; must be positive.
        dtype: dtype of the iteration's matmuls.
        restarts: step indices (0-based) before which the iterate is re-formed and the
            Gram matrix recomputed (default: every third step, every second in 16-bit
            dtypes; see :func:`default_restarts`); ``()`` for none.
        eps_mode: as for :func:`newton_schulz`.

    Returns:
        The orthogonalized tensor, of ``x``'s shape and dtype.
    """
    schedule = ns_schedule(coefficients, steps)
    _check("gram_newton_schulz", x, eps, dtype, eps_mode)
    X, tall, spare = _iterated(x, schedule, eps, dtype, eps_mode, _gram_iteration(schedule, restarts), owned=False)
    return _restored(X, x, tall, into=spare)


def _standard_iteration(schedule: Coefficients, scale: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor]:
    return functools.partial(_standard_steps, schedule=schedule, reduction=None, scale=scale)


def _gram_iteration(
    schedule: Coefficients, restarts: Sequence[int] | None, scale: float = 1.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    steps = len(schedule.triples)

    def iterate(X: torch.Tensor) -> torch.Tensor:
        restart_at = _check_restarts(default_restarts(steps, X.dtype) if restarts is None else restarts, steps)
        return _gram_steps(X, schedule, restart_at, scale)

    return iterate


def _iterated(
    x: torch.Tensor,
    schedule: Coefficients,
    eps: float,
    dtype: torch.dtype | None,
    eps_mode: str,
    iterate: Callable[[torch.Tensor], torch.Tensor],
    owned: bool,
) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """``iterate`` on ``x`` made wide and normalised (``owned``: ``x`` is the caller's to
    overwrite); whether ``x`` was tall, and a buffer of ``x``'s dtype and the wide shape that the
    result may be restored into (or ``None``)."""
    g, tall, copied = _wide_batch(x)
    ns_dtype = default_ns_dtype(x.device, x.dtype, x.shape) if dtype is None else dtype
    X = _normalized(g, schedule, eps, ns_dtype, None, eps_mode, owned=owned or copied)
    # a normalised stack of our own, cast into X, is free to take the result: one fresh
    # buffer less, whose first touch on a CPU costs about as much as the pass itself
    spare = (owned or copied) and X.dtype != g.dtype == x.dtype and may_write_into(g)
    return iterate(X), tall, g if spare else None


def newton_schulz_flops(m: int, n: int, steps: int) -> float:
    """Flops of ``steps`` standard quintic steps on an m×n matrix: ``steps·(4m²n + 2m³)``, m ≤ n."""
    m, n = min(m, n), max(m, n)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def gram_newton_schulz_flops(
    m: int, n: int, steps: int, restarts: Sequence[int] | None = None, dtype: torch.dtype = torch.float32
) -> float:
    """Flops of :func:`gram_newton_schulz` on an m×n matrix: ``8m²n + 28m³`` for 5 steps in
    fp32 (one restart), ``12m²n + 22m³`` in 16-bit dtypes (two)."""
    m, n = min(m, n), max(m, n)
    restart_at = _check_restarts(default_restarts(steps, dtype) if restarts is None else restarts, steps)
    wide, square = 2.0 * m * m * n, 2.0 * m**3
    total, q_is_identity = wide, True  # R = XXᵀ
    for k in range(steps):
        if k in restart_at:
            total += wide if q_is_identity else 2 * wide  # (X = QX,) R = XXᵀ
            q_is_identity = True
        total += square if q_is_identity else 2 * square  # R², (PQ)
        q_is_identity = False
        if k + 1 < steps and k + 1 not in restart_at:
            total += 2 * square  # PRP
    return total + wide  # X = QX


@dataclass(frozen=True)
class NewtonSchulz:
    """A configured Newton–Schulz map: ``ns(x)`` orthogonalizes every matrix of a ``(..., m, n)`` tensor.

    ``method="standard"`` is :func:`newton_schulz`; ``"gram"`` is :func:`gram_newton_schulz`
    on the shapes where it needs fewer flops, the standard iteration elsewhere. Checked when
    made, so a bad setting fails where it is written. ``eps_mode`` is :func:`newton_schulz`'s;
    ``restarts`` (``method="gram"`` only) is :func:`gram_newton_schulz`'s (``None``: its default).
    """

    coefficients: CoefficientsLike = "keller"
    steps: int | None = None
    eps: float = 1e-7
    dtype: torch.dtype | None = None
    method: NSMethod = "standard"
    eps_mode: EpsMode = "clamp"
    restarts: tuple[int, ...] | None = None

    #: the ``(a, b, c)`` triples, resolved once from ``coefficients`` and ``steps``
    schedule: Coefficients = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        schedule = ns_schedule(self.coefficients, self.steps)
        object.__setattr__(self, "schedule", schedule)
        _check("Newton–Schulz", torch.empty(1, 1), self.eps, self.dtype, self.eps_mode)
        if self.method not in NS_METHODS:
            raise ValueError(f"unknown ns_method {self.method!r}; choose one of {list(NS_METHODS)}")
        if self.restarts is not None:
            if self.method != "gram":
                raise ValueError("Newton–Schulz restarts apply to method='gram' only")
            object.__setattr__(self, "restarts", _check_restarts(self.restarts, len(schedule.triples)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.orthogonalize(x)

    def orthogonalize(self, x: torch.Tensor, *, overwrite_input: bool = False, scale: float = 1.0) -> torch.Tensor:
        """``scale·self(x)``, the scale taken by the last step's matmuls (no pass of its
        own), so within a few roundings of the product after it, and exactly that product
        for a power of two; with ``overwrite_input=True`` it may normalise ``x`` in
        place (a stack built for this call: one fresh buffer less, the same result)."""
        X, tall, spare = self._iterated(x, overwrite_input, scale)
        return _restored(X, x, tall, into=spare)

    def orthogonalize_turning(
        self, x: torch.Tensor, turned: int, *, overwrite_input: bool = False, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`orthogonalize` of a wide ``(count, m, n)`` batch whose last ``turned`` matrices
        are the transposes of tall ones: the first ``count - turned`` results, and the last
        ``turned`` transposed back, ``(turned, n, m)`` and contiguous (on a GPU written so by the
        pass that restores them). The same values as :meth:`orthogonalize`."""
        X, _, spare = self._iterated(x, overwrite_input, scale)
        return _restored_turning(X, x.dtype, turned, spare)

    def orthogonalize_matrices(
        self,
        matrices: Sequence[torch.Tensor],
        turned: int,
        *,
        scale: float = 1.0,
        decay: Decay | None = None,
        overwrite_input: bool = False,
    ) -> list[torch.Tensor]:
        """:meth:`orthogonalize_turning` of ``torch.stack(matrices)`` (wide matrices of one shape
        and dtype, the last ``turned`` of them the transposes of tall ones), the batch built here:
        the results in the order of ``matrices``, the last ``turned`` transposed back (each in the
        orientation of its tall matrix). With ``decay`` (parameters aligned with ``matrices``, in
        their orientation), ``alpha·p`` added to each result that has one (in place: a step of
        plain tensors, no autograd).

        Off the CPU an fp32 batch going into a narrower dtype is normalised as it is built
        (:func:`_narrowed_matrices`): each matrix's norm is read from its own memory, so a tall
        matrix's in the order of its own rows (its bits may differ from the stack's norm by a
        rounding), and no fp32 stack outlives the product into ``dtype``. There
        ``overwrite_input=True`` (``matrices`` are temporaries of the caller's that nothing reads
        after) writes the results into the matrices' own memory instead of a new fp32 batch (see
        :func:`_stored`), and with muonfn's Triton kernels the results are widened with the decay
        added in one pass. Elsewhere the stack is built and given to :meth:`orthogonalize_turning`.
        The same values either way.
        """
        first = matrices[0]
        dtype = default_ns_dtype(first.device, first.dtype, first.shape) if self.dtype is None else self.dtype
        if first.dtype != torch.float32 or dtype == first.dtype or cpu_passes(first):
            stack = torch.stack(list(matrices))
            wide, tall = self.orthogonalize_turning(stack, turned, overwrite_input=True, scale=scale)
            return _decayed([*wide.unbind(0), *tall.unbind(0)], turned, decay)
        iterate = self._iteration(first, scale)
        result = iterate(_narrowed_matrices(matrices, self.schedule, self.eps, dtype, self.eps_mode))
        return _stored(result, matrices, turned, decay, overwrite_input)

    def _iterated(
        self, x: torch.Tensor, owned: bool, scale: float = 1.0
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        iterate = self._iteration(x, scale)
        return _iterated(x, self.schedule, self.eps, self.dtype, self.eps_mode, iterate, owned)

    def _iteration(self, x: torch.Tensor, scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """The steps ``x`` takes (Gram's where they are cheaper), ``x`` checked."""
        if self.method == "gram" and self._gram_is_cheaper(x):
            _check("gram_newton_schulz", x, self.eps, self.dtype, self.eps_mode)
            return _gram_iteration(self.schedule, self.restarts, scale)
        _check("newton_schulz", x, self.eps, self.dtype, self.eps_mode)
        return _standard_iteration(self.schedule, scale)

    def _gram_is_cheaper(self, x: torch.Tensor) -> bool:
        m, n = x.shape[-2:]
        steps = len(self.schedule.triples)
        dtype = default_ns_dtype(x.device, x.dtype, x.shape) if self.dtype is None else self.dtype
        return gram_newton_schulz_flops(m, n, steps, self.restarts, dtype=dtype) < newton_schulz_flops(m, n, steps)

    def columns(
        self, blocks: torch.Tensor, reduction: Reduction, matrix_shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """:func:`newton_schulz_columns` with these settings (the standard iteration, whatever ``method``)."""
        return newton_schulz_columns(
            blocks,
            self.schedule,
            reduction,
            eps=self.eps,
            dtype=self.dtype,
            eps_mode=self.eps_mode,
            matrix_shape=matrix_shape,
        )


def polar(x: torch.Tensor) -> torch.Tensor:
    r"""The exact polar factor :math:`U_r V_r^\top` of every matrix in ``x`` (via SVD, in fp64).

    Singular directions with :math:`\sigma \le \max(m, n)\,\epsilon_{64}\,\sigma_{max}` count
    as the null space and map to zero, so rank-deficient inputs give a partial isometry. A
    matrix holding NaN or Inf maps to NaN, as Newton–Schulz's does (the SVD would raise, and
    :func:`~muonfn.apply_if_finite` could not skip the step). The reference for tests and
    diagnostics; returns ``x.dtype``.
    """
    if x.ndim < 2:
        raise ValueError(f"polar needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    if not x.numel():
        return torch.zeros_like(x)
    wide = x.to(torch.float64)
    finite = wide.isfinite().flatten(-2).all(-1)[..., None, None]
    u, s, vh = torch.linalg.svd(torch.where(finite, wide, 0.0), full_matrices=False)
    tol = max(x.shape[-2:]) * torch.finfo(torch.float64).eps * s.amax(dim=-1, keepdim=True)
    keep = (s > tol).to(torch.float64)
    return torch.where(finite, (u * keep.unsqueeze(-2)) @ vh, torch.nan).to(x.dtype)


def qr_orthogonal(x: torch.Tensor) -> torch.Tensor:
    r"""The orthonormal factor :math:`Q` of the reduced QR decomposition of every matrix in ``x``.

    Taken on the tall orientation (``m >= n``; wide inputs are transposed and transposed
    back), in at least fp32, so :math:`Q` has ``x``'s shape; returns ``x.dtype``. For a
    square matrix this is heavyball's ``zeroth_power_mode="qr"`` (``torch.linalg.qr(x).Q``).
    Not the polar factor: :math:`Q` depends on the column order (Gram–Schmidt) and its
    columns span those of :math:`G` without aligning with :math:`U V^\top`.
    """
    if x.ndim < 2:
        raise ValueError(f"qr_orthogonal needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    wide = x.size(-2) < x.size(-1)
    g = (x.mT if wide else x).to(torch.promote_types(x.dtype, torch.float32))
    q = torch.linalg.qr(g).Q
    return (q.mT if wide else q).to(x.dtype)
