r"""The ``"gather"`` strategy: every rank assembles every matrix and orthogonalizes all of them.

``all_gather_into_tensor`` of padded buffers; :math:`W\times` the compute, :math:`(W-1)S/W`
elements received per rank. Simple, and the reference the others are checked against.
"""

from __future__ import annotations

import functools

import torch

from ._collectives import start_all_gather_into_tensor
from ._layout import copy_into, copy_out
from ._plan import ExchangeRound, box_numel, box_shape, local_units, orthogonalize_units


class GatherRound(ExchangeRound):
    """One round of the gather exchange (see :mod:`._pipeline` for the phases; nothing goes back)."""

    everyone: torch.Tensor | None = None
    send: torch.Tensor | None = None

    @functools.cached_property
    def mine(self) -> list[int]:
        """The units of this round this rank holds part of."""
        return [u for u in self.batch.units if self.group.rank in self.plan.units[u].holders]

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
