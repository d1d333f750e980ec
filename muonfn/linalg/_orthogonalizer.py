"""From parameter tensors to batched Newton–Schulz calls and back.

An :class:`Orthogonalizer` replaces each tensor by ``s(A, B)·NS(M)`` for every matrix
block ``M`` its :class:`MatrixView` declares. The local one stacks same-shape blocks into
one batched call; the sharded ones of :mod:`muonfn.distributed` first assemble whole
matrices across ranks. :func:`muonfn.orthogonalize` takes either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .._keys import Key, dotted
from ._newton_schulz import NewtonSchulz, dense
from ._views import MatrixView, ScaleFn, block_scales

MatrixFn = Callable[[torch.Tensor], torch.Tensor]

DEFAULT_BUCKET_NUMEL = 1 << 26


class Orthogonalizer(Protocol):
    """Leaves in, leaves out: ``scale(A, B)·ns(M)`` for every matrix block ``M`` of every tensor.

    ``keys`` name the tensors (for errors, and for settings given by name), ``views`` say
    how each is read as matrices, ``ns`` maps a ``(count, m, n)`` batch of matrices.
    Returns one tensor per input, of its type, shape and dtype.
    """

    def __call__(
        self,
        keys: Sequence[Key],
        tensors: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        ns: MatrixFn,
        scale: ScaleFn,
    ) -> list[torch.Tensor]: ...


def check_bucket_numel(bucket_numel: int) -> int:
    """``bucket_numel`` if it is an integer >= 1; else a ValueError naming it."""
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be an integer >= 1, got {bucket_numel!r}")
    return bucket_numel


def _chunks(members: list[int], sizes: list[int], cap: int) -> list[list[int]]:
    """Splits ``members`` into runs whose sizes add up to at most ``cap`` (at least one each)."""
    chunks: list[list[int]] = [[]]
    total = 0
    for i in members:
        if chunks[-1] and total + sizes[i] > cap:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += sizes[i]
    return chunks


def _batched(matrices: list[torch.Tensor], scales: list[float], ns: MatrixFn, cap: int) -> list[torch.Tensor]:
    """``scale * ns(m)`` for every ``(count, rows, cols)`` batch, equal shapes stacked into calls of at most ``cap``.

    Newton–Schulz orients every matrix by its shape alone, so that ``ns(Xᵀ) = ns(X)ᵀ`` bit for
    bit: under it a tall batch joins the wide batches of its transposed shape (an MLP's
    up and down projections make one call, not two).
    """
    turns = isinstance(ns, NewtonSchulz)
    tall = [turns and m.shape[1] > m.shape[2] for m in matrices]
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(matrices):
        shape = m.shape[:0:-1] if tall[i] else m.shape[1:]
        buckets.setdefault((shape, m.dtype, m.device, scales[i]), []).append(i)
    sizes = [m.numel() for m in matrices]
    wide = [m.mT if t else m for m, t in zip(matrices, tall)]
    out: list[torch.Tensor] = list(matrices)
    for (_, _, _, scale), members in buckets.items():
        for chunk in _chunks(members, sizes, cap):
            if len(chunk) == 1:
                result = ns(wide[chunk[0]])
            elif isinstance(ns, NewtonSchulz):  # the stack is this call's own: normalised in place
                result = ns.orthogonalize(torch.cat([wide[j] for j in chunk]), overwrite_input=True)
            else:
                result = ns(torch.cat([wide[j] for j in chunk]))
            if scale != 1.0:
                result = result.mul_(scale)
            for j, piece in zip(chunk, result.split([matrices[j].shape[0] for j in chunk])):
                out[j] = piece.mT if tall[j] else piece
    return out


def orthogonalize_blocks(
    tensors: Sequence[torch.Tensor],
    views: Sequence[MatrixView],
    ns: MatrixFn,
    scale: ScaleFn,
    *,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    shapes: Sequence[Sequence[int]] | None = None,
) -> list[torch.Tensor]:
    """``scale(A, B)·ns(M)`` for every block ``M`` of every tensor as its view reads it.

    Same-shape blocks are stacked into one ``ns`` call of at most ``bucket_numel``
    elements. ``shapes``: the shapes the scale is read from, when they differ from the
    tensors' (an expert shard of a larger tensor). A tensor without elements maps to an
    empty tensor; a contiguous tensor to a contiguous one.
    """
    shapes = [t.shape for t in tensors] if shapes is None else shapes
    matrices: list[torch.Tensor] = []
    scales: list[float] = []
    for t, view, shape in zip(tensors, views, shapes):
        if t.numel():
            matrices += view.to_matrices(t)
            scales += block_scales(view, shape, scale)
    done = _batched(matrices, scales, ns, bucket_numel)
    out, pos = [], 0
    for t, view in zip(tensors, views):
        if t.numel():
            n = len(view.blocks(t.shape))
            result = view.from_matrices(done[pos : pos + n], t.shape)
            out.append(dense(result) if t.is_contiguous() else result)
            pos += n
        else:
            out.append(torch.empty_like(t))
    return out


class LocalOrthogonalizer:
    """The :class:`Orthogonalizer` of whole matrices in one process: :func:`orthogonalize_blocks`.

    Rejects a tensor its view cannot read, and a DTensor sharded across ranks (whose local
    shard is no whole matrix).
    """

    def __init__(self, *, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> None:
        self.bucket_numel = check_bucket_numel(bucket_numel)

    def __call__(
        self,
        keys: Sequence[Key],
        tensors: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        ns: MatrixFn,
        scale: ScaleFn,
    ) -> list[torch.Tensor]:
        for key, t, view in zip(keys, tensors, views):
            view.check(key, t.shape)
            placements = tuple(getattr(t, "placements", ()))
            if any(not p.is_replicate() for p in placements):
                raise ValueError(
                    f"{dotted(key)!r} is a DTensor sharded as {placements}: Newton–Schulz needs whole "
                    "matrices; pass collectives=muonfn.distributed.torch_collectives(mesh)"
                )
        return orthogonalize_blocks(tensors, views, ns, scale, bucket_numel=self.bucket_numel)

    def __repr__(self) -> str:
        return f"LocalOrthogonalizer(bucket_numel={self.bucket_numel})"
