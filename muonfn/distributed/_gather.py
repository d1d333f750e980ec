r"""The ``"gather"`` strategy: every rank assembles every matrix and orthogonalizes all of them.

``all_gather_into_tensor`` of padded buffers; :math:`W\times` the compute, :math:`(W-1)S/W`
elements received per rank. Simple, and the reference the others are checked against.
"""

from __future__ import annotations

import torch

from ..linalg import MatrixFn, ScaleFn
from ._collectives import Collectives
from ._layout import copy_into, copy_out
from ._plan import Batch, Plan, box_numel, box_shape, local_units, orthogonalize_units


def run_gather(
    group: Collectives,
    plan: Plan,
    batch: Batch,
    results: list[torch.Tensor],
    ns: MatrixFn,
    scale: ScaleFn,
    cap: int,
) -> None:
    me, units = group.rank, plan.units
    send = torch.zeros(batch.padded, dtype=batch.dtype, device=batch.device)
    mine = [u for u in batch.units if me in units[u].holders]
    for u in mine:
        pos, box = units[u].holders[me]
        start = batch.offsets[u, me]
        local = local_units(plan, units[u].leaf, plan.leaves[units[u].leaf].local)[pos]
        send[start : start + box_numel(box)].view(box_shape(box)).copy_(local)
    everyone = torch.empty(group.world_size * batch.padded, dtype=batch.dtype, device=batch.device)
    group.all_gather_into_tensor(everyone, send)

    fulls = {}
    for u in mine:  # only the units this rank keeps part of; replicas' copies are skipped
        unit = units[u]
        full = torch.empty(unit.shape, dtype=batch.dtype, device=batch.device)
        for r, (_, box) in unit.holders.items():
            if unit.layout.replica[r] == unit.layout.replica[me]:
                start = r * batch.padded + batch.offsets[u, r]
                copy_into(full, everyone[start : start + box_numel(box)].view(box_shape(box)), box)
        fulls[u] = full
    del everyone
    done = orthogonalize_units(plan, mine, fulls, ns, scale, cap)
    for u in mine:
        pos, box = units[u].holders[me]
        copy_out(done[u], box, local_units(plan, units[u].leaf, results[units[u].leaf])[pos])
