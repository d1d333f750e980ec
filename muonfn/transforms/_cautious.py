"""Cautious updates: drop the update's components that disagree in sign with the gradient."""

from __future__ import annotations

import math
from typing import Literal, TypeAlias

import torch

from .._tree import Leaves
from ._contract import Transform
from ._rules import Rule, Scope, as_rule, from_rule
from ._shards import SumShards, check_sum_shards, count_per_member

CautiousMode: TypeAlias = Literal["heavyball", "pytorch_optimizer"]
CAUTIOUS_MODES: tuple[str, ...] = ("heavyball", "pytorch_optimizer")


def _keep(u: torch.Tensor, g: torch.Tensor, mode: str) -> torch.Tensor:
    return u.signbit() == g.signbit() if mode == "heavyball" else (u * g) > 0


def _rescaled(
    u: torch.Tensor, keep: torch.Tensor, kept: torch.Tensor, numel: int | torch.Tensor, mode: str
) -> torch.Tensor:
    kept = kept.clamp_min(1) if mode == "heavyball" else kept.add(1)
    # the scale in the update's dtype (at least fp32), as the peers compute it in fp32/fp64
    scale = kept.to(torch.promote_types(u.dtype, torch.float32)).reciprocal().mul(numel)
    return u.mul(keep).mul(scale).to(u.dtype)


def cautious(tx: Transform, *, mode: CautiousMode = "heavyball", sum_shards: SumShards | None = None) -> Transform:
    r"""``tx`` whose update components that disagree in sign with the gradient are zeroed,
    and the rest rescaled (Cautious Optimizers, Liang et al. 2024), leaf by leaf
    (per member of a stacked ensemble), :math:`N` the leaf's number of elements:

    - ``"heavyball"`` (heavyball's ``caution``):
      :math:`k = \mathbb{1}[\operatorname{signbit}(u) = \operatorname{signbit}(g)]`,
      :math:`u \leftarrow u \odot k \cdot N / \max(\textstyle\sum k, 1)`;
    - ``"pytorch_optimizer"`` (its ``apply_cautious``): :math:`k = \mathbb{1}[u \odot g > 0]`,
      :math:`u \leftarrow u \odot k \cdot N / (\textstyle\sum k + 1)`.

    ``g`` is the gradient ``tx`` is given; place ``cautious`` around the direction (before the
    learning rate and weight decay) to match the peers.

    Args:
        tx: the transform whose update is made cautious.
        mode: ``"heavyball"`` or ``"pytorch_optimizer"``.
        sum_shards: for leaves that are one rank's shard of a larger tensor (plain tensors
            under ``shard_specs``), the sums over every rank's shard
            (:func:`muonfn.distributed.shard_sums`), so that :math:`\sum k` and :math:`N` are the
            whole leaf's, as in one process: one ``all_reduce`` of two numbers per leaf.
            :func:`muonfn.muon` passes it with ``collectives=``. DTensor leaves need none.

    Returns:
        A :class:`Transform` with ``tx``'s state.
    """
    if mode not in CAUTIOUS_MODES:
        raise ValueError(f"cautious: unknown mode {mode!r}; choose one of {list(CAUTIOUS_MODES)}")
    check_sum_shards("cautious", sum_shards)

    rule = as_rule(tx)

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        updates = rule.update(grads, scope, params)
        members = scope.members
        keeps = [_keep(u, grads[k], mode) for k, u in updates.items()]
        kept = [count_per_member(keep, members) for keep in keeps]
        if sum_shards is None:
            numels = [math.prod(u.shape[members:]) for u in updates.values()]
            return {
                k: _rescaled(u, keep, s, n, mode) for (k, u), keep, s, n in zip(updates.items(), keeps, kept, numels)
            }
        # the whole leaf's counts of kept and of dropped entries, summed over its shards at once
        dropped = [count_per_member(keep.logical_not(), members) for keep in keeps]
        keys, values = list(updates), list(updates.values())
        summed = sum_shards([*keys, *keys], [*values, *values], [*kept, *dropped], batch_dims=members)
        n = len(keys)
        return {
            k: _rescaled(u, keep, s, s + d, mode)
            for k, u, keep, s, d in zip(keys, values, keeps, summed[:n], summed[n:])
        }

    return from_rule(tx.init, Rule("cautious", update, rule.needs, rule.donated))
