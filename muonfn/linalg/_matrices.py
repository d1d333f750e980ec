r"""From parameter tensors to batched Newton–Schulz calls and back.

A :class:`MatrixView` declares which matrices a tensor holds:

- 2-D ``(out, in)``: one matrix; conv ``(out, in, *k)``: one ``(out, in·∏k)`` matrix (the default
  for ≥3-D leaves);
- experts ``(E, out, in)``: ``batch_dims=1``, a batch of ``E`` matrices;
- fused QKV ``(q + k + v, in)``: ``split=(q, k, v)``, each block its own matrix;
- stored as ``(in, out)`` (Hugging Face ``Conv1D``): ``transposed=True``.

Each block is orthogonalized and scaled by :math:`s(A, B)` for its ``A`` rows (fan-out) and ``B``
columns (fan-in):

=================== ====================== ==========================================
mode                :math:`s(A, B)`        used by
=================== ====================== ==========================================
``original``        √max(1, A/B)           Keller Jordan; torch.optim.Muon's default
``match_rms_adamw`` 0.2·√max(A, B)         Moonlight; torch's ``match_rms_adamw``
``spectral``        √max(A, B)             Megatron ``spectral``
``unit_rms_norm``   √(A/B)                 Megatron ``unit_rms_norm``
``none``            1
=================== ====================== ==========================================

An :class:`Orthogonalizer` maps tensors to ``s·NS`` of their blocks: the local one stacks
same-shape blocks into one batched call (a tall block joins the calls of its transpose's shape);
the sharded ones of :mod:`muonfn.distributed` first assemble whole matrices across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any, Literal, Protocol, TypeAlias

import torch

from .._devices import apart, gpu_orthogonalized, may_write_into, takes_gpu_orthogonalized
from ._newton_schulz import NewtonSchulz, is_integer

ScaleMode: TypeAlias = Literal["original", "match_rms_adamw", "spectral", "unit_rms_norm", "none"]
#: a mode's name, or ``(mode, factor)``: the mode times a constant factor (Megatron's ``extra_scale_factor``)
ScaleLike: TypeAlias = ScaleMode | tuple[ScaleMode, float]
ScaleFn: TypeAlias = Callable[[int, int], float]
MatrixFn = Callable[[torch.Tensor], torch.Tensor]

#: Each mode's scale times a factor, :math:`f\cdot s(A, B)`
SCALED_MODES: dict[str, Callable[[float, int, int], float]] = {
    "original": lambda f, a, b: f * math.sqrt(max(1.0, a / b)),
    "match_rms_adamw": lambda f, a, b: f * (0.2 * math.sqrt(max(a, b))),
    "spectral": lambda f, a, b: f * math.sqrt(max(a, b)),
    "unit_rms_norm": lambda f, a, b: f * math.sqrt(a / b),
    "none": lambda f, a, b: f,
}
SCALE_MODES: dict[str, ScaleFn] = {name: partial(scaled, 1.0) for name, scaled in SCALED_MODES.items()}


def scaled_mode(scale: ScaleLike) -> tuple[Callable[[float, int, int], float], float]:
    r"""``scale``'s mode as :math:`f\cdot s(A, B)` (:data:`SCALED_MODES`), and its factor; checked."""
    name, factor = scale if isinstance(scale, tuple) and len(scale) == 2 else (scale, 1.0)
    if not isinstance(name, str) or name not in SCALE_MODES:
        raise ValueError(f"unknown scale mode {scale!r}; choose one of {sorted(SCALE_MODES)} or a pair (mode, factor)")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"scale's factor must be a finite float >= 0, got {factor!r}")
    return SCALED_MODES[name], float(factor)


def shape_scale(scale: ScaleLike) -> ScaleFn:
    """The scale of an ``A × B`` block: ``SCALE_MODES[mode](A, B)``, times ``factor`` for a pair
    ``(mode, factor)``; checked."""
    scaled, factor = scaled_mode(scale)
    return partial(scaled, factor)


@dataclass(frozen=True)
class MatrixView:
    """How one parameter tensor is read as matrices (see the module).

    Args:
        batch_dims: leading dimensions indexing independent matrices (experts); dimensions after
            the first non-batch one are flattened into the columns (conv kernels).
        transposed: the tensor stores the matrix as ``(in, out)``.
        split: sizes of the blocks a fused matrix is cut into along ``split_dim``.
        split_dim: 0 to split the logical rows (fan-out), 1 the columns (fan-in).
    """

    batch_dims: int = 0
    transposed: bool = False
    split: tuple[int, ...] | None = None
    split_dim: int = 0

    def __post_init__(self) -> None:
        for name, value in (("batch_dims", self.batch_dims), ("split_dim", self.split_dim)):
            if not is_integer(value):
                raise TypeError(f"MatrixView: {name} must be an integer, got {value!r}")
        if not isinstance(self.transposed, bool):
            raise TypeError(f"MatrixView: transposed must be True or False, got {self.transposed!r}")
        if self.split is not None:
            split = self.split
            if isinstance(split, str | bytes) or not isinstance(split, Sequence) or not all(map(is_integer, split)):
                raise TypeError(f"MatrixView: split must be a tuple of block sizes (integers), got {split!r}")
            object.__setattr__(self, "split", tuple(split))

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """The logical ``(out, in)`` shape of the (unsplit) matrix inside ``shape``."""
        rest = shape[self.batch_dims :]
        return (rest[-1], rest[-2]) if self.transposed else (rest[0], math.prod(rest[1:]))

    def blocks(self, shape: Sequence[int]) -> list[tuple[int, int]]:
        """The ``(rows, cols)`` of every matrix block, in order."""
        rows, cols = self.matrix_shape(shape)
        if self.split is None:
            return [(rows, cols)]
        return [(s, cols) for s in self.split] if self.split_dim == 0 else [(rows, s) for s in self.split]

    def check(self, name: str, shape: Sequence[int]) -> None:
        """Raises a ValueError naming ``name`` when this view cannot read ``shape``."""
        if self.batch_dims < 0 or len(shape) - self.batch_dims < 2:
            raise ValueError(
                f"{name!r}: shape {tuple(shape)} with batch_dims={self.batch_dims} holds no matrix "
                "(Newton–Schulz needs at least 2 dimensions after the batch dimensions; label it for AdamW)"
            )
        if self.transposed and len(shape) - self.batch_dims != 2:
            raise ValueError(
                f"{name!r}: transposed=True needs a 2-D matrix after the batch dimensions, got {tuple(shape)}"
            )
        if self.split_dim not in (0, 1):
            raise ValueError(f"{name!r}: split_dim must be 0 (rows) or 1 (columns), got {self.split_dim}")
        if self.split is not None:
            length = self.matrix_shape(shape)[self.split_dim]
            if sum(self.split) != length or any(s < 1 for s in self.split):
                raise ValueError(
                    f"{name!r}: split {self.split} does not partition the {length} "
                    f"{'rows' if self.split_dim == 0 else 'columns'} of shape {tuple(shape)}"
                )

    def to_matrices(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The blocks of ``t``, each as a ``(count, rows, cols)`` batch."""
        rows, cols = self.matrix_shape(t.shape)
        # (the count of matrices, not -1: a tensor may hold no element)
        m = (t.mT if self.transposed else t).reshape(math.prod(t.shape[: self.batch_dims]), rows, cols)
        return [m] if self.split is None else list(m.split(list(self.split), dim=1 + self.split_dim))

    def from_matrices(self, blocks: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
        """Inverse of :meth:`to_matrices` for a tensor of ``shape``."""
        m = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks), dim=1 + self.split_dim)
        return m.reshape(*shape[:-2], shape[-1], shape[-2]).mT if self.transposed else m.reshape(shape)

    def scales(self, shape: Sequence[int], scale: ScaleFn) -> list[float]:
        """The scale of every block (1 for a block without elements, whose scale may divide by zero)."""
        return [scale(rows, cols) if rows and cols else 1.0 for rows, cols in self.blocks(shape)]


DEFAULT_VIEW = MatrixView()


class Orthogonalizer(Protocol):
    """Tensors in, tensors out: ``scale(A, B)·ns(M)`` for every matrix block ``M`` of every tensor.

    ``names`` name the tensors (for errors and settings given by name), ``views`` say how each is
    read as matrices, ``ns`` maps a ``(count, m, n)`` batch. Returns one tensor per input, of its
    type, shape and dtype, each of this call's own (the steps after it may write into it).
    ``overwrite_input=True`` says the tensors are temporaries of the step that nothing reads after:
    their memory may hold the results. ``check(names, tensors, views)``, where an orthogonalizer
    has one, raises for leaves it would refuse, from their metadata alone, before a step changes
    anything.
    """

    def __call__(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        ns: MatrixFn,
        scale: ScaleFn,
        *,
        overwrite_input: bool = False,
    ) -> list[torch.Tensor]: ...


DEFAULT_BUCKET_NUMEL = 1 << 26


def check_bucket_numel(bucket_numel: int) -> int:
    if not (is_integer(bucket_numel) and bucket_numel >= 1):
        raise ValueError(f"bucket_numel must be an integer >= 1, got {bucket_numel!r}")
    return bucket_numel


class LocalOrthogonalizer:
    """The :class:`Orthogonalizer` of whole matrices in one process.

    Blocks of one shape, dtype, device and scale are stacked into ``ns`` calls of at most
    ``bucket_numel`` elements; under :class:`~muonfn.NewtonSchulz` a tall block joins the calls of its
    transpose's shape (an MLP's up and down projections make one call). Each block's scale is read
    from its own shape: a shard of whole matrices (experts) scales as the whole tensor does. A
    contiguous tensor maps to a contiguous one, an empty tensor to an empty one.

    Refuses a tensor its view cannot read, and a DTensor sharded across ranks (no whole matrix).
    ``gpu_form``: take a GPU's form of a call (see :mod:`muonfn._devices`): ``None`` off the CPU,
    ``True``/``False`` always or never (the same values to rounding; a test asks for either on any device).
    """

    def __init__(self, *, bucket_numel: int = DEFAULT_BUCKET_NUMEL, gpu_form: bool | None = None) -> None:
        self.bucket_numel = check_bucket_numel(bucket_numel)
        if gpu_form is not None and not isinstance(gpu_form, bool):
            raise TypeError(f"gpu_form must be True, False or None, got {gpu_form!r}")
        self.gpu_form = gpu_form

    def __call__(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        ns: MatrixFn,
        scale: ScaleFn,
        *,
        overwrite_input: bool = False,
    ) -> list[torch.Tensor]:
        turns = isinstance(ns, NewtonSchulz)
        blocks: list[list[torch.Tensor]] = []  # each tensor's (count, rows, cols) batches
        # (wide shape, dtype, device, scale) -> its calls, each of blocks (tall, i, j): the i-th tensor's j-th
        calls: dict[tuple[Any, ...], list[list[tuple[bool, int, int]]]] = {}
        filled: dict[tuple[Any, ...], int] = {}  # the elements of each key's last call
        for i, (t, view) in enumerate(zip(tensors, views)):
            blocks.append(view.to_matrices(t) if t.numel() else [])
            for j, m in enumerate(blocks[i]):
                rows, cols = m.shape[-2:]
                tall = turns and rows > cols
                key = ((cols, rows) if tall else (rows, cols), m.dtype, m.device, scale(rows, cols))
                chunks = calls.setdefault(key, [[]])
                if chunks[-1] and filled[key] + m.numel() > self.bucket_numel:  # the last call is full: another
                    chunks.append([])
                filled[key] = m.numel() + (filled[key] if chunks[-1] else 0)
                chunks[-1].append((tall, i, j))
        # each call: the blocks its chunk names replaced by s·ns of them, in one call on their wide shape
        for (_, _, _, s), chunks in calls.items():
            for chunk in chunks:
                chunk.sort()  # the wide blocks first, each kind in order
                pieces = [apart(blocks[i][j].mT) if tall else blocks[i][j] for tall, i, j in chunk]
                sizes = list(map(len, pieces))  # (the batches' counts)
                # single matrices: a GPU may take its own form, which returns the tall ones in their own orientation
                gpu = turns and max(sizes) == 1 and takes_gpu_orthogonalized(ns, pieces[0], self.gpu_form)
                if gpu:
                    results = gpu_orthogonalized(ns, pieces, sum(map(itemgetter(0), chunk)), s, overwrite_input)
                else:
                    stack = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
                    own = overwrite_input or len(pieces) > 1  # (a stack built here)
                    if isinstance(ns, NewtonSchulz):
                        result = ns.orthogonalize_wide(stack, scale=s, overwrite_input=own)
                    else:
                        result = checked_map_result(ns, stack, ns(stack))
                        if not own and _shares_memory(result, stack):  # a map of one's own may hand its input back
                            result = result.clone()
                        result = result if s == 1.0 else result.mul(s)
                    results = result.split(sizes)
                for (tall, i, j), r in zip(chunk, results):
                    blocks[i][j] = apart(r.mT) if tall and not gpu else r
        out = []
        for t, view, done in zip(tensors, views, blocks):
            result = view.from_matrices(done, t.shape) if done else torch.empty_like(t)
            out.append(result if result.is_contiguous() or not t.is_contiguous() else result.contiguous())
        return out

    @staticmethod
    def check(names: Sequence[str], tensors: Sequence[torch.Tensor], views: Sequence[MatrixView]) -> None:
        for name, t, view in zip(names, tensors, views):
            view.check(name, t.shape)
            if hasattr(t, "placements") and not all(p.is_replicate() for p in t.placements):
                raise ValueError(
                    f"{name!r} is a DTensor sharded as {t.placements}: Newton–Schulz needs whole matrices; "
                    "pass orthogonalizer=muonfn.distributed.sharded_orthogonalizer(collectives)"
                )

    def __repr__(self) -> str:
        return f"LocalOrthogonalizer(bucket_numel={self.bucket_numel}, gpu_form={self.gpu_form})"


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    comparable = type(a) is type(b) is torch.Tensor and may_write_into(a)  # (traced, or a subclass: no storage)
    return not comparable or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def checked_map_result(ns: MatrixFn, batch: torch.Tensor, result: object, *, device: bool = True) -> torch.Tensor:
    """``result`` of ``ns(batch)`` if it is a tensor of ``batch``'s shape, dtype and (``device``) device;
    else a TypeError naming ``ns`` (metadata only: no sync, and it traces)."""
    if not isinstance(result, torch.Tensor):
        problem = f"returned {type(result).__name__}"
    elif result.shape != batch.shape or result.dtype != batch.dtype or (device and result.device != batch.device):
        on = f" on {result.device}" if device else ""
        problem = f"returned a {result.dtype} tensor of shape {tuple(result.shape)}{on}"
    else:
        return result
    name = getattr(ns, "__qualname__", None)
    where, what = (f" on {batch.device}", "shape, dtype and device") if device else ("", "shape and dtype")
    raise TypeError(
        f"ns={name if isinstance(name, str) else repr(ns)} {problem} for a {batch.dtype} batch of shape "
        f"{tuple(batch.shape)}{where}; it must return a tensor of its input's {what}"
    )


def check_matrix_fn(ns: MatrixFn, shape: Sequence[int], dtype: torch.dtype) -> None:
    """Runs ``ns`` on a meta tensor of ``shape``: a map that returns no tensor, or one of another shape
    or dtype, fails here, naming itself, before a step. One that cannot run on meta is checked at its calls."""
    batch = torch.empty(shape, dtype=dtype, device="meta")
    try:
        result = ns(batch)
    except Exception:
        return
    checked_map_result(ns, batch, result, device=False)
