"""Counting over a leaf per ensemble member, and over every rank's shard of it (``sum_shards``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .._keys import Key


class SumShards(Protocol):
    """Sums per-leaf statistics of local shards over whole leaves (see
    :func:`muonfn.distributed.shard_sums`): ``sums[i]``, summed over the dimensions of
    ``tensors[i]`` after the first ``batch_dims``, comes back summed over every rank's shard of
    the leaf ``keys[i]``; a leaf held whole comes back as it was."""

    def __call__(
        self, keys: Sequence[Key], tensors: Sequence[torch.Tensor], sums: Sequence[torch.Tensor], *, batch_dims: int
    ) -> list[torch.Tensor]: ...


def check_sum_shards(where: str, sum_shards: SumShards | None) -> None:
    if sum_shards is not None and not callable(sum_shards):
        raise TypeError(f"{where}: sum_shards must be callable (muonfn.distributed.shard_sums), got {sum_shards!r}")


def count_per_member(mask: torch.Tensor, members: int) -> torch.Tensor:
    """How many entries of ``mask`` are set, per ensemble member (int64, the other dimensions kept as 1).

    With no dimension left to sum (a 0-d leaf per member) each entry is its own count, where
    ``sum(dim=())`` would sum over every dimension, the members' too.
    """
    dims = tuple(range(members, mask.ndim))
    return mask.sum(dim=dims, keepdim=True, dtype=torch.int64) if dims else mask.to(torch.int64)
