r"""How a parameter tensor is seen as one or more matrices, and the scale each gets.

Newton–Schulz orthogonalizes matrices; parameters come in other shapes. A
:class:`MatrixView` declares, per leaf, which matrices a tensor holds:

- 2-D ``(out, in)``: one matrix.
- conv ``(out, in, *k)``: one ``(out, in·∏k)`` matrix (the default for ≥3-D leaves).
- experts ``(E, out, in)``: ``batch_dims=1``, a batch of ``E`` matrices.
- fused QKV ``(q + k + v, in)``: ``split=(q, k, v)``, each block its own matrix.
- stored as ``(in, out)`` (Hugging Face ``Conv1D``): ``transposed=True``.

Scale modes :math:`s(A, B)` for a logical matrix with ``A`` rows (fan-out) and ``B``
columns (fan-in), each times ``extra_scale``:

================== ===================== ==========================================
mode               :math:`s(A, B)`        used by
================== ===================== ==========================================
``original``       √max(1, A/B)           Keller Jordan; torch.optim.Muon's default
``match_rms_adamw`` 0.2·√max(A, B)        Moonlight; torch's ``match_rms_adamw``
``spectral``       √max(A, B)             Megatron ``spectral``
``unit_rms_norm``  √(A/B)                 Megatron ``unit_rms_norm``
``none``           1
================== ===================== ==========================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

import torch

from .._keys import Key, dotted

ScaleMode: TypeAlias = Literal["original", "match_rms_adamw", "spectral", "unit_rms_norm", "none"]
ScaleFn: TypeAlias = Callable[[int, int], float]

SCALE_MODES: dict[str, ScaleFn] = {
    "original": lambda a, b: math.sqrt(max(1.0, a / b)),
    "match_rms_adamw": lambda a, b: 0.2 * math.sqrt(max(a, b)),
    "spectral": lambda a, b: math.sqrt(max(a, b)),
    "unit_rms_norm": lambda a, b: math.sqrt(a / b),
    "none": lambda a, b: 1.0,
}
assert tuple(SCALE_MODES) == get_args(ScaleMode)


def shape_scale(scale: ScaleMode, extra_scale: float = 1.0) -> ScaleFn:
    """The scale of an ``A × B`` matrix block: ``SCALE_MODES[scale](A, B) * extra_scale``, checked."""
    if not isinstance(scale, str) or scale not in SCALE_MODES:
        raise ValueError(f"unknown scale mode {scale!r}; choose one of {sorted(SCALE_MODES)}")
    # a Python number: scales are fixed per shape, so they stay out of the traced update
    if isinstance(extra_scale, bool) or not isinstance(extra_scale, int | float):
        raise TypeError(f"extra_scale must be a float, got {type(extra_scale).__name__}")
    if not (math.isfinite(extra_scale) and extra_scale >= 0):
        raise ValueError(f"extra_scale must be finite and >= 0, got {extra_scale!r}")
    mode = SCALE_MODES[scale]
    if extra_scale == 1.0:
        return mode
    return lambda a, b: mode(a, b) * extra_scale


@dataclass(frozen=True)
class MatrixView:
    """Declares how one parameter tensor is read as matrices.

    Args:
        batch_dims: leading dimensions that index independent matrices (MoE experts:
            ``(E, out, in)`` has ``batch_dims=1``). Dimensions after the first
            non-batch one are flattened into the columns (conv kernels).
        transposed: the tensor stores the matrix as ``(in, out)``.
        split: sizes of the blocks a fused matrix is cut into along ``split_dim``
            (e.g. ``(q, k, v)`` rows of a fused QKV projection).
        split_dim: 0 to split the logical rows (fan-out), 1 the columns (fan-in).
    """

    batch_dims: int = 0
    transposed: bool = False
    split: tuple[int, ...] | None = None
    split_dim: int = 0

    def __post_init__(self) -> None:
        # the types only: the values are checked against each leaf's shape (see check)
        for name in ("batch_dims", "split_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"MatrixView: {name} must be an integer, got {value!r}")
        if not isinstance(self.transposed, bool):
            raise TypeError(f"MatrixView: transposed must be True or False, got {self.transposed!r}")
        if self.split is not None:
            split = self.split
            if (
                isinstance(split, str | bytes)
                or not isinstance(split, Sequence)
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in split)
            ):
                raise TypeError(f"MatrixView: split must be a tuple of block sizes (integers), got {split!r}")
            object.__setattr__(self, "split", tuple(split))

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """The logical ``(out, in)`` shape of the (unsplit) matrix inside ``shape``."""
        rest = list(shape[self.batch_dims :])
        if self.transposed:
            rest[-2], rest[-1] = rest[-1], rest[-2]
        return rest[0], math.prod(rest[1:])

    def blocks(self, shape: Sequence[int]) -> list[tuple[int, int]]:
        """The ``(rows, cols)`` of every matrix block, in order."""
        rows, cols = self.matrix_shape(shape)
        if self.split is None:
            return [(rows, cols)]
        if self.split_dim == 0:
            return [(s, cols) for s in self.split]
        return [(rows, s) for s in self.split]

    def check(self, key: Key, shape: Sequence[int]) -> None:
        """Raises a ValueError naming ``key`` when this view cannot read ``shape``."""
        if self.batch_dims < 0 or len(shape) - self.batch_dims < 2:
            raise ValueError(
                f"{dotted(key)!r}: shape {tuple(shape)} with batch_dims={self.batch_dims} holds no matrix "
                "(Newton–Schulz needs at least 2 dimensions after the batch dimensions; label it for AdamW)"
            )
        if self.transposed and len(shape) - self.batch_dims != 2:
            raise ValueError(
                f"{dotted(key)!r}: transposed=True needs a 2-D matrix after the batch dimensions, got {tuple(shape)}"
            )
        if self.split_dim not in (0, 1):
            raise ValueError(f"{dotted(key)!r}: split_dim must be 0 (rows) or 1 (columns), got {self.split_dim}")
        if self.split is not None:
            length = self.matrix_shape(shape)[self.split_dim]
            if sum(self.split) != length or any(s < 1 for s in self.split):
                raise ValueError(
                    f"{dotted(key)!r}: split {self.split} does not partition the {length} "
                    f"{'rows' if self.split_dim == 0 else 'columns'} of shape {tuple(shape)}"
                )

    def to_matrices(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The blocks of ``t``, each as a ``(count, rows, cols)`` batch."""
        rows, cols = self.matrix_shape(t.shape)
        count = math.prod(t.shape[: self.batch_dims])  # not -1: a tensor may hold no element
        m = (t.mT if self.transposed else t).reshape(count, rows, cols)
        if self.split is None:
            return [m]
        return list(m.split(list(self.split), dim=1 + self.split_dim))

    def from_matrices(self, blocks: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
        """Inverse of :meth:`to_matrices` for a tensor of ``shape``."""
        m = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks), dim=1 + self.split_dim)
        if self.transposed:
            stored = list(shape)
            stored[-2], stored[-1] = stored[-1], stored[-2]
            return m.reshape(stored).mT
        return m.reshape(shape)


DEFAULT_VIEW = MatrixView()


def block_scales(view: MatrixView, shape: Sequence[int], scale: ScaleFn) -> list[float]:
    """The scale of every block of a leaf of ``shape`` (1 for a block without elements, which it
    does not scale, and whose scale may divide by its zero side)."""
    return [scale(rows, cols) if rows and cols else 1.0 for rows, cols in view.blocks(shape)]
