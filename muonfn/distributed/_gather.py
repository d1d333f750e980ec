r"""The ``"gather"`` strategy: every rank assembles every matrix and orthogonalizes all of them.

``all_gather_into_tensor`` of padded buffers; :math:`W\times` the compute, :math:`(W-1)S/W`
elements received per rank. Simple, and the reference the others are checked against.
"""

from __future__ import annotations

import torch

from ..linalg import MatrixFn, ScaleFn
from ._collectives import FINISHED, Collectives, Handle, start_all_gather_into_tensor
from ._layout import copy_into, copy_out
from ._plan import Batch, Plan, box_numel, box_shape, local_units, orthogonalize_units


class GatherRound:
    """One round of the gather exchange (see :mod:`._pipeline` for the phases; nothing goes back)."""

    def __init__(
        self,
        group: Collectives,
        plan: Plan,
        batch: Batch,
        results: list[torch.Tensor],
        ns: MatrixFn,
        scale: ScaleFn,
        cap: int,
        *,
        overlap: bool,
    ) -> None:
        self.group, self.plan, self.batch, self.results = group, plan, batch, results
        self.ns, self.scale, self.cap, self.overlap = ns, scale, cap, overlap
        self.handle: Handle = FINISHED
        self.everyone: torch.Tensor | None = None
        self.send: torch.Tensor | None = None
        self.mine = [u for u in batch.units if group.rank in plan.units[u].holders]

    def start(self) -> None:
        group, plan, batch, units = self.group, self.plan, self.batch, self.plan.units
        me = group.rank
        send = torch.zeros(batch.padded, dtype=batch.dtype, device=batch.device)
        for u in self.mine:
            pos, box = units[u].holders[me]
            start = batch.offsets[u, me]
            local = local_units(plan, units[u].leaf, plan.leaves[units[u].leaf].local)[pos]
            send[start : start + box_numel(box)].view(box_shape(box)).copy_(local)
        everyone = torch.empty(group.world_size * batch.padded, dtype=batch.dtype, device=batch.device)
        self.send, self.everyone = send, everyone
        self.handle = start_all_gather_into_tensor(group, everyone, send, overlap=self.overlap)

    def compute(self) -> None:
        plan, batch, units, me = self.plan, self.batch, self.plan.units, self.group.rank
        self.handle.wait()
        everyone = self.everyone
        assert everyone is not None
        fulls = {}
        for u in self.mine:  # only the units this rank keeps part of; replicas' copies are skipped
            unit = units[u]
            full = torch.empty(unit.shape, dtype=batch.dtype, device=batch.device)
            for r, (_, box) in unit.holders.items():
                if unit.layout.replica[r] == unit.layout.replica[me]:
                    start = r * batch.padded + batch.offsets[u, r]
                    copy_into(full, everyone[start : start + box_numel(box)].view(box_shape(box)), box)
            fulls[u] = full
        self.send = self.everyone = None
        done = orthogonalize_units(plan, self.mine, fulls, self.ns, self.scale, self.cap)
        for u in self.mine:
            pos, box = units[u].holders[me]
            copy_out(done[u], box, local_units(plan, units[u].leaf, self.results[units[u].leaf])[pos])

    def finish(self) -> None:
        return None
