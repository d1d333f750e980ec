r"""Sums over the shards of a leaf: the whole leaf's statistic from each rank's part of it.

A transform that reduces a leaf (caution's count of kept entries, a finite check) sees,
on each rank, only that rank's shard of a plain tensor that ``shard_specs`` declares a
shard. :class:`ShardSums` turns each such local sum into the sum over the whole leaf: every
rank places its sums at its position along the leading (ensemble) dimensions, one
``all_reduce`` per group adds them up, and each rank takes back its own positions. Ranks
that hold a replica of another's shard (HSDP) add nothing, so that each element counts once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._tree import named_table
from ..linalg import DEFAULT_VIEW
from ._collectives import Collectives, check_collectives
from ._layout import Box, Layout, ShardSpec, checked_shard_specs, copy_into, copy_out
from ._plan import by_group, cached, describe, grouped, handshake


class ShardSums:
    """Sums per-leaf statistics of local shards over each whole leaf (see :func:`shard_sums`)."""

    def __init__(self, collectives: Collectives, shard_specs: Mapping[Any, ShardSpec]) -> None:
        self.collectives = collectives
        self.shard_specs = dict(shard_specs)
        self._layouts: dict[tuple[Any, ...], list[Layout]] = {}

    def __call__(
        self, names: Sequence[str], tensors: Sequence[torch.Tensor], sums: Sequence[torch.Tensor], *, batch_dims: int
    ) -> list[torch.Tensor]:
        """``sums[i]``, a statistic of the local tensor ``tensors[i]`` summed over its dimensions
        after the first ``batch_dims`` (shape ``(*tensors[i].shape[:batch_dims], *rest)``), summed
        over the leaf's shards on every rank as well; same shapes. Leaves ``shard_specs`` does not
        name are whole tensors, returned as given, or DTensors, whose sums are global already:
        those with a reduction pending come back reduced (replicated)."""
        declared = named_table(self.shard_specs, names)
        out = list(sums)
        sharded = [
            describe(i, name, value, DEFAULT_VIEW, declared[name], self.collectives, split_replicated=False)
            for i, (name, value) in enumerate(zip(names, tensors))
            if name in declared
        ]
        _reduce_pending(out)  # the sums of sharded DTensors
        for group, leaves in by_group(sharded):
            # the layouts: exchanged once per set of leaves (every rank in the same order)
            layouts = cached(self._layouts, group, leaves, lambda: handshake(group, leaves))
            # every rank's sums of the group's leaves, placed in the whole leaves and added up in one all_reduce
            parts: list[tuple[torch.Tensor, Box]] = []
            for layout, leaf in zip(layouts, leaves):
                rest = tuple(out[leaf.index].shape[batch_dims:])
                whole = out[leaf.index].new_zeros((*layout.shape[:batch_dims], *rest))
                box: Box = (*layout.boxes[group.rank][:batch_dims], *(((0, n),) for n in rest))  # this rank's sums
                if layout.replica[group.rank] == 0:  # the other replicas hold the same shards: each element counts once
                    copy_into(whole, out[leaf.index], box)
                parts.append((whole, box))
            flat = torch.cat([whole.reshape(-1) for whole, _ in parts])
            group.all_reduce(flat)
            for total, (whole, box), leaf in zip(flat.split([whole.numel() for whole, _ in parts]), parts, leaves):
                mine = out[leaf.index] = torch.empty_like(out[leaf.index])  # this rank's part of the total
                copy_out(total.view(whole.shape), box, mine)
        return out

    def __repr__(self) -> str:
        return f"ShardSums({self.collectives!r}, shard_specs={sorted(map(str, self.shard_specs))})"


def _reduce_pending(sums: list[Any]) -> None:
    """Replaces the DTensor sums with a reduction pending by their reduced values (``Partial`` made
    ``Replicate``), so that what is computed from them stays a plain placement: one ``redistribute``
    per mesh and placements."""
    from torch.distributed.tensor import Replicate

    pending = [i for i, s in enumerate(sums) if any(p.is_partial() for p in getattr(s, "placements", ()))]
    batches = grouped(pending, lambda i: (sums[i].device_mesh, tuple(sums[i].placements)))
    for (mesh, placements), members in batches.items():
        done = [Replicate() if p.is_partial() else p for p in placements]
        if any(p.is_shard() for p in placements):  # sharded along ensemble dimensions: unevenly, it cannot be flattened
            for i in members:
                sums[i] = sums[i].redistribute(mesh, done)
            continue
        flat: Any = torch.cat([sums[i].reshape(-1) for i in members])
        flat = flat.redistribute(mesh, done)
        for i, piece in zip(members, flat.split([sums[i].numel() for i in members])):
            sums[i] = piece.view(sums[i].shape)


def shard_sums(collectives: Collectives, *, shard_specs: Mapping[Any, ShardSpec] | None = None) -> ShardSums:
    r"""Sums of local shards over whole leaves, for the transforms that reduce a leaf.

    Under ``shard_specs`` a plain tensor is one rank's shard, and a transform that counts over
    the leaf (:func:`muonfn.cautious`'s :math:`N/\sum k`, :func:`muonfn.apply_if_finite`'s
    test) would count over the shard alone. Pass the result as their ``sum_shards``, with the
    collectives and ``shard_specs`` given to the orthogonalizer (a :class:`ShardedOrthogonalizer`
    carries one as its ``sum_shards``, which :func:`muonfn.muon` passes to caution). DTensor leaves
    need none of this (their reductions are global), nor whole tensors.

    Returns:
        A callable ``(names, tensors, sums, *, batch_dims) -> sums`` making one ``all_reduce`` per
        group, of two int64 numbers per leaf (and ensemble member) for caution.
    """
    check_collectives(collectives, ("rank", "world_size", "all_gather_into_tensor", "all_reduce"))
    return ShardSums(collectives, checked_shard_specs(shard_specs))
