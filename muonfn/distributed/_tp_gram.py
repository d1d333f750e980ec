r"""The ``"tp_gram"`` strategy: column-split matrices stay where they are.

Matrices cut along their long side into one block per rank (column-parallel tensor
parallelism) run Newton–Schulz on their blocks: the max-abs entry, the squared norm and
each step's :math:`m\times m` Gram matrix :math:`XX^\top = \sum_r X_rX_r^\top` are reduced
over ranks, and :math:`X_r \leftarrow aX_r + (bA + cA^2)X_r` is local. It receives about
:math:`2(W-1)/W\cdot(k+1)m^2` elements per matrix for :math:`k` steps, against the owner's
:math:`2(W-1)mn/W^2`: cheaper once :math:`n > (k+1)Wm`. Sums over ranks round differently
from one matrix product, so results match the single-process ones to rounding, not bitwise.
"""

from __future__ import annotations

import torch

from ..linalg import MatrixFn, NewtonSchulz, ScaleFn, newton_schulz_columns
from ._collectives import Collectives
from ._plan import GramBatch, Plan


class _OverRanks:
    """The :class:`~muonfn.linalg.Reduction` of blocks held one per rank of ``group``."""

    def __init__(self, group: Collectives) -> None:
        self.group = group

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self.group.all_reduce(t.view(-1))
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1).contiguous()
        everyone = torch.empty(self.group.world_size * flat.numel(), dtype=t.dtype, device=t.device)
        self.group.all_gather_into_tensor(everyone, flat)
        return everyone.view(self.group.world_size, -1).amax(dim=0).view_as(t)


def run_tp_gram(
    group: Collectives, plan: Plan, batch: GramBatch, results: list[torch.Tensor], ns: MatrixFn, scale: ScaleFn
) -> None:
    if not isinstance(ns, NewtonSchulz):
        raise TypeError(f"strategy 'tp_gram' runs Newton–Schulz on column blocks itself; it cannot run {ns!r}")
    blocks = [plan.leaves[i].local for i in batch.leaves]
    x = torch.stack([b.mT if flip else b for b, flip in zip(blocks, batch.flips)])
    # the iteration's dtype is the whole matrices' (a stand-in of their shape: nothing is allocated)
    whole = x.new_empty(()).expand(plan.layouts[batch.leaves[0]].shape)
    X = newton_schulz_columns(x, ns, _OverRanks(group), ns.iteration_dtype(whole))
    for j, (i, flip) in enumerate(zip(batch.leaves, batch.flips)):
        (s,) = plan.leaves[i].view.scales(plan.layouts[i].shape, scale)
        block = (X[j].mT if flip else X[j]).to(results[i].dtype)
        results[i].copy_(block.mul_(s) if s != 1.0 else block)
