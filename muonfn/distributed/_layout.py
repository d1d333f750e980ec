r"""Where each rank of a group keeps its part of a sharded tensor.

A :class:`Layout` gives, for every rank and every tensor dimension, the *runs* of global
indices the rank holds, in its local order; the local tensor is the Cartesian product
:math:`T[R_0 \times R_1 \times \dots]`. ``Shard(d)`` keeps one run of dimension ``d``
(``torch.chunk`` sizes: 10 rows on 4 ranks are 3, 3, 3, 1; 3 rows are 1, 1, 1, 0),
``_StridedShard(d)`` (TP + FSDP) several, ``Replicate`` all of it. Ranks that differ only
in their coordinates on replicated mesh dimensions hold the same data: they share a
*position* and belong to different *replicas*.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Run = tuple[int, int]
Runs = tuple[Run, ...]
Box = tuple[Runs, ...]


@dataclass(frozen=True)
class ShardSpec:
    """Declares that a plain (non-DTensor) leaf is one rank's shard of a larger tensor.

    Two forms:

    - ``ShardSpec(dim)``: the tensor is cut along ``dim`` into contiguous blocks, one per
      rank of ``group`` in rank order, of any sizes (empty ones included); the other
      dimensions are whole. Hand-rolled tensor parallelism: ``ShardSpec(0)`` for a
      column-parallel (output-sharded) weight, ``ShardSpec(1)`` for a row-parallel one.
    - ``ShardSpec(placements=(Replicate(), Shard(0)), mesh_shape=(2, 2))``: the ranks of
      ``group`` form a row-major mesh and the tensor is laid out as a DTensor with these
      ``torch.distributed.tensor`` placements would be (``torch.chunk`` sizes).

    ``group`` is the :class:`Collectives` of the ranks sharing the tensor; ``None`` means
    the collectives given to :func:`sharded_orthogonalizer`. The global shape is worked out from every
    rank's local shape (exchanged once, when a set of leaves is first seen).
    """

    dim: int | None = None
    group: Any = None
    placements: tuple[Any, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.dim is None) == (self.placements is None):
            raise ValueError("ShardSpec takes either dim or placements (with mesh_shape)")
        if self.placements is not None:
            if self.mesh_shape is None or len(self.mesh_shape) != len(self.placements):
                raise ValueError("ShardSpec(placements=...) needs a mesh_shape with one size per placement")
            for p in self.placements:
                placement_kind(p)
        elif self.mesh_shape is not None:
            raise ValueError("ShardSpec(dim) takes no mesh_shape")


def checked_shard_specs(shard_specs: Mapping[Any, ShardSpec] | None) -> dict[Any, ShardSpec]:
    """``shard_specs`` as a dict, each value checked to be a :class:`ShardSpec`."""
    if shard_specs is None:
        return {}
    if not isinstance(shard_specs, Mapping):
        raise TypeError(f"shard_specs must be a mapping of names to ShardSpec, got {type(shard_specs).__name__}")
    for name, spec in shard_specs.items():
        if not isinstance(spec, ShardSpec):
            raise TypeError(f"shard_specs[{name!r}] must be a muonfn.distributed.ShardSpec, got {spec!r}")
    return dict(shard_specs)


def placement_kind(p: Any) -> tuple[str, int, int]:
    """``("shard", dim, 1)``, ``("strided", dim, split_factor)`` or ``("replicate", -1, 1)``."""
    name = type(p).__name__
    if name == "_StridedShard":
        return "strided", int(p.dim), int(p.split_factor)
    if callable(getattr(p, "is_shard", None)) and p.is_shard():
        return "shard", int(p.dim), 1
    if callable(getattr(p, "is_replicate", None)) and p.is_replicate():
        return "replicate", -1, 1
    if callable(getattr(p, "is_partial", None)) and p.is_partial():
        raise ValueError(f"placement {p} is a pending reduction; reduce gradients before the optimizer step")
    raise ValueError(f"unsupported placement {p!r}")


def _kinds(placements: Sequence[Any], ndim: int) -> list[tuple[str, int, int]]:
    """Each placement's :func:`placement_kind` for an ``ndim``-D tensor, the dimension it shards made non-negative."""
    kinds = []
    for p in placements:
        kind, dim, factor = placement_kind(p)
        if kind != "replicate":
            if not -ndim <= dim < ndim:
                raise ValueError(f"placement {p} shards dimension {dim} of a {ndim}-D tensor")
            dim %= ndim
        kinds.append((kind, dim, factor))
    return kinds


def length(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


def chunk(runs: Runs, parts: int, index: int) -> Runs:
    """Part ``index`` of ``runs`` cut into ``parts`` with ``torch.chunk`` sizes (empty at the end)."""
    n = length(runs)
    size = -(-n // parts)
    start, stop = index * size, min((index + 1) * size, n)
    out, pos = [], 0
    for a, b in runs:
        lo, hi = max(start - pos, 0), min(stop - pos, b - a)
        if lo < hi:
            out.append((a + lo, a + hi))
        pos += b - a
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """The global ``shape`` and, per group rank, its ``box`` (runs per dimension), its
    ``position`` (ranks of equal position hold equal data) and its ``replica``."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    position: tuple[int, ...]
    replica: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return max(self.replica) + 1

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(length(r) for r in self.boxes[rank])


def placement_layout(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any], ranks: Sequence[int]
) -> Layout:
    """The layout of a DTensor-style placement over a mesh whose row-major coordinates are group ranks ``ranks``.

    Placements apply left to right, except that ``_StridedShard(d, split_factor=k)``
    applies after the ``Shard(d)`` placements to its right (whose mesh sizes multiply to
    ``k``): FSDP2 shards the tensor-parallel shard.
    """
    kinds = _kinds(placements, len(shape))
    for i, (kind, dim, factor) in enumerate(kinds):
        if kind == "strided":
            inner = math.prod(mesh_shape[j] for j in range(i + 1, len(kinds)) if kinds[j][:2] == ("shard", dim))
            if factor != inner:
                raise NotImplementedError(
                    f"_StridedShard({dim}, split_factor={factor}) on mesh dimension {i} is only understood as "
                    f"FSDP over tensor parallelism (split_factor = {inner} here)"
                )
    order = [i for i, k in enumerate(kinds) if k[0] == "shard"] + [i for i, k in enumerate(kinds) if k[0] == "strided"]
    sharded = [i for i, k in enumerate(kinds) if k[0] != "replicate"]
    replicated = [i for i, k in enumerate(kinds) if k[0] == "replicate"]
    size = math.prod(mesh_shape)
    if sorted(ranks) != list(range(size)):
        raise ValueError(f"a mesh of shape {tuple(mesh_shape)} needs {size} distinct group ranks, got {list(ranks)}")
    boxes: list[Box] = [()] * size
    position, replica = [0] * size, [0] * size
    # positions and replicas numbered row-major over their mesh dimensions: in order of first appearance
    # in the row-major walk of the whole mesh
    positions: dict[tuple[int, ...], int] = {}
    replicas: dict[tuple[int, ...], int] = {}
    for flat, coord in enumerate(itertools.product(*(range(s) for s in mesh_shape))):
        box: list[Runs] = [((0, n),) for n in shape]
        for i in order:
            dim = kinds[i][1]
            box[dim] = chunk(box[dim], mesh_shape[i], coord[i])
        rank = ranks[flat]
        boxes[rank] = tuple(box)
        position[rank] = positions.setdefault(tuple(coord[i] for i in sharded), len(positions))
        replica[rank] = replicas.setdefault(tuple(coord[i] for i in replicated), len(replicas))
    return Layout(tuple(shape), tuple(boxes), tuple(position), tuple(replica))


def placement_global_shape(
    local_shapes: Sequence[Sequence[int]], mesh_shape: Sequence[int], placements: Sequence[Any], ranks: Sequence[int]
) -> tuple[int, ...]:
    """The global shape implied by every rank's local shape (indexed by group rank)."""
    ndim = len(local_shapes[0])
    kinds = _kinds(placements, ndim)
    shape = [0] * ndim
    for flat, coord in enumerate(itertools.product(*(range(s) for s in mesh_shape))):
        for d in range(ndim):  # the ranks at 0 on each mesh dimension not sharding d hold all of d once
            if all(c == 0 for c, (kind, dim, _) in zip(coord, kinds) if kind == "replicate" or dim != d):
                shape[d] += local_shapes[ranks[flat]][d]
    return tuple(shape)


def sizes_layout(local_shapes: Sequence[Sequence[int]], dim: int) -> Layout:
    """Contiguous blocks of any sizes along ``dim``, one per rank in rank order (``local_shapes`` of one
    number of dimensions, as the handshake has checked)."""
    others = {tuple(s[:dim]) + tuple(s[dim + 1 :]) for s in local_shapes}
    if len(others) != 1:
        raise ValueError(
            f"shards along dimension {dim} must agree on every other dimension; shapes by rank: "
            f"{[tuple(s) for s in local_shapes]}"
        )
    offsets = [0, *itertools.accumulate(s[dim] for s in local_shapes)]
    shape = (*local_shapes[0][:dim], offsets[-1], *local_shapes[0][dim + 1 :])
    whole: list[Runs] = [((0, n),) for n in shape]
    runs: list[Runs] = [((a, b),) if a < b else () for a, b in itertools.pairwise(offsets)]
    boxes = tuple((*whole[:dim], r, *whole[dim + 1 :]) for r in runs)
    return Layout(shape, boxes, tuple(range(len(runs))), (0,) * len(runs))


def _pieces(box: Box) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """(global slices, local slices) of every block of a box."""
    per_dim = []
    for runs in box:  # each run, and where it starts locally: after the runs before it
        starts = itertools.accumulate((b - a for a, b in runs), initial=0)
        per_dim.append([(slice(a, b), slice(start, start + b - a)) for (a, b), start in zip(runs, starts)])
    return [(tuple(g for g, _ in combo), tuple(loc for _, loc in combo)) for combo in itertools.product(*per_dim)]


def copy_into(full: torch.Tensor, piece: torch.Tensor, box: Box) -> None:
    """``full[box] = piece``."""
    for whole, part in _pieces(box):
        full[whole] = piece[part]


def copy_out(full: torch.Tensor, box: Box, out: torch.Tensor) -> None:
    """``out = full[box]`` (``out`` has the box's shape)."""
    for whole, part in _pieces(box):
        out[part] = full[whole]
