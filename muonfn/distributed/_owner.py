r"""The ``"owner"`` strategy: each whole matrix is orthogonalized by one owner rank.

Shards travel to their unit's owner in one ``all_to_all_single`` per round, the owners
orthogonalize (same shapes batched), and the results travel back the same way. Each rank
computes about :math:`1/W` of the work and receives about :math:`2(W-1)S/W^2` of the
:math:`S` matrix elements.

The same round moves replicated units (every holder keeps the whole matrix, as under
data parallelism): nothing comes in, the owner orthogonalizes its own copy and sends the
result to the other holders, :math:`(W-1)S/W` elements received per rank, as an
all-gather would, for :math:`1/W` of the compute. Pieces an owner holds itself never
enter a buffer, and an exchange no rank has anything to send in is skipped.
"""

from __future__ import annotations

import functools

import torch

from ._collectives import FINISHED, start_all_to_all_single
from ._layout import copy_into, copy_out
from ._plan import ExchangeRound, box_numel, box_shape, local_units, orthogonalize_units


class OwnerRound(ExchangeRound):
    """One round of the owner exchange (see :mod:`._pipeline` for the phases)."""

    buffers: tuple[torch.Tensor, ...] = ()

    @functools.cached_property
    def sources(self) -> list[torch.Tensor]:
        """Every leaf's local tensor, by leaf index."""
        return [leaf.local for leaf in self.plan.leaves]

    def _empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=self.batch.dtype, device=self.batch.device)

    def _piece(self, tensors: list[torch.Tensor], u: int, pos: int) -> torch.Tensor:
        leaf = self.plan.units[u].leaf
        return local_units(self.plan, leaf, tensors[leaf])[pos]

    def start(self) -> None:
        batch = self.batch
        if not batch.exchange_in:
            return
        send, recv = self._empty(sum(batch.send_splits)), self._empty(sum(batch.recv_splits))
        offset = 0
        for u, pos, _ in batch.sends:
            piece = self._piece(self.sources, u, pos)
            send[offset : offset + piece.numel()].view(piece.shape).copy_(piece)
            offset += piece.numel()
        self.buffers = (send, recv)
        self.handle = start_all_to_all_single(
            self.group, recv, send, batch.recv_splits, batch.send_splits, overlap=self.overlap
        )

    def compute(self) -> None:
        batch, units = self.batch, self.plan.units
        self.handle.wait()
        recv = self.buffers[1] if self.buffers else None
        fulls = {u: torch.empty(units[u].shape, dtype=batch.dtype, device=batch.device) for u in batch.owned}
        for u, pos, box in batch.kept_in:
            copy_into(fulls[u], self._piece(self.sources, u, pos), box)
        offset = 0
        for u, _, box in batch.recvs:
            assert recv is not None
            n = box_numel(box)
            copy_into(fulls[u], recv[offset : offset + n].view(box_shape(box)), box)
            offset += n
        self.buffers = ()
        done = orthogonalize_units(self.plan, batch.owned, fulls, self.ns, self.scale, self.cap)
        del fulls
        for u, pos, box in batch.kept_out:
            copy_out(done[u], box, self._piece(self.results, u, pos))
        if not batch.exchange_out:
            self.handle = FINISHED
            return
        send, recv = self._empty(sum(batch.return_splits)), self._empty(sum(batch.get_splits))
        offset = 0
        for u, _, box in batch.returns:
            n = box_numel(box)
            copy_out(done[u], box, send[offset : offset + n].view(box_shape(box)))
            offset += n
        self.buffers = (send, recv)
        self.handle = start_all_to_all_single(
            self.group, recv, send, batch.get_splits, batch.return_splits, overlap=self.overlap
        )

    def finish(self) -> None:
        self.handle.wait()
        if not self.buffers:
            return
        recv = self.buffers[1]
        offset = 0
        for u, pos, _ in self.batch.gets:
            piece = self._piece(self.results, u, pos)
            piece.copy_(recv[offset : offset + piece.numel()].view(piece.shape))
            offset += piece.numel()
        self.buffers = ()
