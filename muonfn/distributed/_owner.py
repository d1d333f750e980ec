r"""The ``"owner"`` strategy: each whole matrix is orthogonalized by one owner rank.

Shards travel to their unit's owner in one ``all_to_all_single`` per round, the owners
orthogonalize (same shapes batched), and the results travel back the same way. Each rank
computes about :math:`1/W` of the work and receives about :math:`2(W-1)S/W^2` of the
:math:`S` matrix elements.
"""

from __future__ import annotations

import torch

from ..linalg import MatrixFn, ScaleFn
from ._collectives import Collectives
from ._layout import copy_into, copy_out
from ._plan import Batch, Plan, box_numel, box_shape, local_units, orthogonalize_units


def run_owner(
    group: Collectives,
    plan: Plan,
    batch: Batch,
    results: list[torch.Tensor],
    ns: MatrixFn,
    scale: ScaleFn,
    cap: int,
) -> None:
    me, units = group.rank, plan.units

    def my_piece(u: int) -> tuple[int, tuple[int, ...]]:
        box = units[u].holders[me][1]
        return box_numel(box), box_shape(box)

    send = torch.empty(sum(batch.send_splits), dtype=batch.dtype, device=batch.device)
    offset = 0
    for u, pos, _ in batch.sends:
        n, shape = my_piece(u)
        send[offset : offset + n].view(shape).copy_(
            local_units(plan, units[u].leaf, plan.leaves[units[u].leaf].local)[pos]
        )
        offset += n
    recv = torch.empty(sum(batch.recv_splits), dtype=batch.dtype, device=batch.device)
    group.all_to_all_single(recv, send, batch.recv_splits, batch.send_splits)

    owned = sorted({u for u, _, _ in batch.recvs})
    fulls = {u: torch.empty(units[u].shape, dtype=batch.dtype, device=batch.device) for u in owned}
    offset = 0
    for u, _, box in batch.recvs:
        n = box_numel(box)
        copy_into(fulls[u], recv[offset : offset + n].view(box_shape(box)), box)
        offset += n
    done = orthogonalize_units(plan, owned, fulls, ns, scale, cap)
    del fulls
    offset = 0
    for u, _, box in batch.recvs:  # the buffer goes back the way it came
        n = box_numel(box)
        copy_out(done[u], box, recv[offset : offset + n].view(box_shape(box)))
        offset += n
    group.all_to_all_single(send, recv, batch.send_splits, batch.recv_splits)

    offset = 0
    for u, pos, _ in batch.sends:
        n, shape = my_piece(u)
        local_units(plan, units[u].leaf, results[units[u].leaf])[pos].copy_(send[offset : offset + n].view(shape))
        offset += n
