r"""Carrying out a plan: the exchange rounds of ``"owner"`` and ``"gather"``, run in turn or
pipelined so communication overlaps Newton–Schulz, and ``"tp_gram"``'s column blocks.

**Owner.** Shards travel to their unit's owner in one ``all_to_all_single`` per round, the
owners orthogonalize (same shapes batched), and the results travel back the same way. Each
rank computes about :math:`1/W` of the work and receives about :math:`2(W-1)S/W^2` of the
:math:`S` matrix elements. The same round moves replicated units (every holder keeps the
whole matrix, as under data parallelism): nothing comes in, the owner orthogonalizes its own
copy and sends the result to the other holders, :math:`(W-1)S/W` elements received per rank,
as an all-gather would, for :math:`1/W` of the compute. Pieces an owner holds itself never
enter a buffer, and an exchange no rank has anything to send in is skipped.

**Gather.** ``all_gather_into_tensor`` of padded buffers: every rank assembles every matrix it
holds part of; :math:`W\times` the compute, :math:`(W-1)S/W` elements received per rank.
Simple, and the reference the others are checked against. Nothing goes back.

**Phases.** A round is a generator advanced three times: the first packs this rank's pieces
and starts the inward exchange, the second waits for it, orthogonalizes what this rank owns
and starts the outward exchange, the third waits for that and writes the results. Without
overlap the phases run in order, round after round. With overlap the next round's inward
exchange is started before this round's Newton–Schulz, and this round's outward exchange is
waited for only after the next round's Newton–Schulz:

.. code-block:: text

    start(0)  [local work]  start(1)  compute(0)  start(2)  compute(1)  finish(0)  start(3)  compute(2)  finish(1) ...

Every rank starts the same exchanges in the same order (the rounds come from a plan every
rank made alike), which is all a process group asks; only the waits move. At most the
buffers of three rounds are alive at once, against one without overlap. The arithmetic
is the same in both orders, so the results are bitwise equal.

**TP Gram.** Matrices cut along their long side into one block per rank (column-parallel
tensor parallelism) run Newton–Schulz on their blocks: the max-abs entry, the squared norm
and each step's :math:`m\times m` Gram matrix :math:`XX^\top = \sum_r X_rX_r^\top` are reduced
over ranks, and :math:`X_r \leftarrow aX_r + (bA + cA^2)X_r` is local. It receives about
:math:`2(W-1)/W\cdot(k+1)m^2` elements per matrix for :math:`k` steps, against the owner's
:math:`2(W-1)mn/W^2`: cheaper once :math:`n > (k+1)Wm`. Sums over ranks round differently
from one matrix product, so results match the single-process ones to rounding, not bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..linalg import LocalOrthogonalizer, MatrixFn, NewtonSchulz, ScaleFn, newton_schulz_columns
from ._collectives import FINISHED, Collectives, Handle, start_all_gather_into_tensor, start_all_to_all_single
from ._layout import copy_into, copy_out
from ._plan import Batch, GramBatch, Moves, Piece, Plan, unit_view

Round = Iterator[None]


def exchange_round(
    plan: Plan, batch: Batch, results: list[torch.Tensor], ns: MatrixFn, scale: ScaleFn, cap: int, overlap: bool
) -> Round:
    """One round of the owner or gather exchange, in its three phases; ``results``: every leaf's output."""
    group, sources = plan.group, [leaf.local for leaf in plan.leaves]

    def held(tensors: list[torch.Tensor], p: Piece) -> torch.Tensor:
        """The piece in a local shard seen as ``(local units, *shard of one unit)``."""
        t = tensors[p.leaf]
        return t.reshape(-1, *t.shape[plan.leaves[p.leaf].view.batch_dims :])[p.position]

    def start(moves: Moves, fill: Callable[[Piece, torch.Tensor], object]) -> tuple[Handle, tuple[torch.Tensor, ...]]:
        """Packs one direction, ``fill(piece, slot)`` writing each piece sent, and starts it."""
        if not moves.exchange:
            return FINISHED, ()
        empty = torch.zeros if batch.gathered else torch.empty  # (the padding of a gather is sent too)
        send = empty(sum(moves.send_splits), dtype=batch.dtype, device=batch.device)
        recv = torch.empty(sum(moves.recv_splits), dtype=batch.dtype, device=batch.device)
        for p in moves.sends:
            fill(p, p.slot(send))
        if batch.gathered:
            return start_all_gather_into_tensor(group, recv, send, overlap=overlap), (send, recv)
        splits = (moves.recv_splits, moves.send_splits)
        return start_all_to_all_single(group, recv, send, *splits, overlap=overlap), (send, recv)

    handle, buffers = start(batch.inward, lambda p, slot: slot.copy_(held(sources, p)))  # the holders' pieces
    yield
    handle.wait()
    fulls = {u: torch.empty(plan.units[u].shape, dtype=batch.dtype, device=batch.device) for u in batch.owned}
    for p in batch.kept:
        copy_into(fulls[p.unit], held(sources, p), p.box)
    for p in batch.inward.recvs:
        copy_into(fulls[p.unit], p.slot(buffers[1]), p.box)
    del buffers
    # scale * NS of the whole units, through each leaf's view; same shapes batched
    leaves = [plan.leaves[plan.units[u].leaf] for u in batch.owned]
    names, views = [leaf.name for leaf in leaves], [unit_view(leaf.view) for leaf in leaves]
    done = dict(zip(fulls, LocalOrthogonalizer(bucket_numel=cap)(names, list(fulls.values()), views, ns, scale)))
    del fulls
    for p in batch.kept:
        copy_out(done[p.unit], p.box, held(results, p))
    handle, buffers = start(batch.outward, lambda p, slot: copy_out(done[p.unit], p.box, slot))  # the results
    done.clear()  # its pieces are in the send buffer
    yield
    handle.wait()
    for p in batch.outward.recvs:
        held(results, p).copy_(p.slot(buffers[1]))


def run_rounds(rounds: list[Round], *, overlap: bool, meanwhile: Callable[[], None]) -> None:
    """Runs every round; ``meanwhile`` (work needing no communication) runs while the first exchange is in flight.

    At step ``s`` round ``s`` starts, round ``s - lag`` computes and round ``s - 2 lag`` finishes: a lag of
    one round with overlap, none without. (One step more than the phases take: ``meanwhile`` runs without
    rounds too.)"""
    lag = 1 if overlap else 0
    for step in range(len(rounds) + 2 * lag + 1):
        if step == lag:
            meanwhile()
        for phase in range(3):
            if 0 <= step - phase * lag < len(rounds):
                next(rounds[step - phase * lag], None)


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


def run_tp_gram(plan: Plan, batch: GramBatch, results: list[torch.Tensor], ns: MatrixFn, scale: ScaleFn) -> None:
    if not isinstance(ns, NewtonSchulz):
        raise TypeError(f"strategy 'tp_gram' runs Newton–Schulz on column blocks itself; it cannot run {ns!r}")
    x = torch.stack([plan.leaves[i].local.mT if flip else plan.leaves[i].local for i, flip in batch])
    # the iteration's dtype is the whole matrices' (a stand-in of their shape: nothing is allocated)
    whole = x.new_empty(()).expand(plan.layouts[batch[0][0]].shape)
    X = newton_schulz_columns(x, ns, _OverRanks(plan.group), ns.iteration_dtype(whole))
    for j, (i, flip) in enumerate(batch):
        (s,) = plan.leaves[i].view.scales(plan.layouts[i].shape, scale)
        block = (X[j].mT if flip else X[j]).to(results[i].dtype)
        results[i].copy_(block.mul_(s) if s != 1.0 else block)
