"""Cautious updates: drop the update's components that disagree in sign with the gradient."""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch

from .._tree import Leaves
from ._base import Rule, Scope, Transform, as_rule, from_rule

CautiousMode: TypeAlias = Literal["heavyball", "pytorch_optimizer"]
CAUTIOUS_MODES: tuple[str, ...] = ("heavyball", "pytorch_optimizer")


def _masked(u: torch.Tensor, g: torch.Tensor, mode: str, members: int) -> torch.Tensor:
    keep = u.signbit() == g.signbit() if mode == "heavyball" else (u * g) > 0
    dims = tuple(range(members, u.ndim))
    numel = 1
    for d in dims:
        numel *= u.shape[d]
    # one count per member; with no dimension left to sum (a 0-d leaf per member) each entry is its own count,
    # where sum(dim=()) would sum over every dimension, the members' too
    kept = keep.sum(dim=dims, keepdim=True, dtype=torch.int64) if dims else keep.to(torch.int64)
    kept = kept.clamp_min(1) if mode == "heavyball" else kept.add(1)
    # the scale in the update's dtype (at least fp32), as the peers compute it in fp32/fp64
    scale = kept.to(torch.promote_types(u.dtype, torch.float32)).reciprocal().mul(numel)
    return u.mul(keep).mul(scale).to(u.dtype)


def cautious(tx: Transform, *, mode: CautiousMode = "heavyball") -> Transform:
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

    Returns:
        A :class:`Transform` with ``tx``'s state.
    """
    if mode not in CAUTIOUS_MODES:
        raise ValueError(f"cautious: unknown mode {mode!r}; choose one of {list(CAUTIOUS_MODES)}")

    rule = as_rule(tx)

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        updates = rule.update(grads, scope, params)
        return {k: _masked(u, grads[k], mode, scope.members) for k, u in updates.items()}

    return from_rule(tx.init, Rule("cautious", update, rule.needs))
