r"""Muon on sharded parameters (FSDP2, HSDP, tensor parallelism) with explicit collectives.

Newton–Schulz needs whole matrices; under FSDP2 or tensor parallelism each rank holds a
shard. Pass an orthogonalizer over the collectives of your mesh and nothing else changes::

    from muonfn.distributed import sharded_orthogonalizer, torch_collectives

    # the mesh given to fully_shard
    tx = muonfn.muon(lr=0.02, orthogonalizer=sharded_orthogonalizer(torch_collectives(mesh)))

Every distributed option is an argument of :func:`sharded_orthogonalizer` (``strategy``,
``shard_specs``, ``replicated``, ``overlap``, ``bucket_numel``); the guide (``docs/distributed.md``)
has the layouts, the replicated split, the overlap, checkpoints and teardown at length.

**Layouts.** DTensor leaves describe their own sharding: ``Shard(d)`` with uneven and empty
shards (``torch.chunk`` sizes: 10 rows on 4 ranks are 3, 3, 3, 1), ``(Replicate, Shard)``
for HSDP, ``(_StridedShard, Shard)`` and ``(Shard(0), Shard(1))`` for tensor parallelism
under FSDP2, on one mesh or several. Plain local tensors are whole matrices, replicated
over the collectives' ranks, unless ``shard_specs`` declares them shards (:class:`ShardSpec`).
Views apply to the assembled matrix; orientation and scale come from the global shape.

**Only Newton–Schulz communicates,** through the :class:`Collectives` given (never a
default group), and the counts over ``shard_specs`` shards that caution and
:func:`muonfn.apply_if_finite` take over whole leaves (one ``all_reduce``, :func:`shard_sums`).
Momentum and AdamW stay elementwise on the local shards, and the state mirrors the params'
placements. Ranks that pass different parameters get an error the first time, not a hang.

**Strategies**, for :math:`S` matrix elements on :math:`W` ranks:

- ``"owner"`` (default): whole matrices are assigned to owner ranks, balanced by
  Newton–Schulz flops; shards go to their owner in one all-to-all and come back in one:
  about :math:`1/W` of the compute and :math:`2(W-1)S/W^2` elements received per rank.
- ``"gather"``: every rank all-gathers every matrix and orthogonalizes all of them:
  :math:`W\times` the compute, :math:`(W-1)S/W` elements received per rank.
- ``"tp_gram"``: matrices cut along their long side stay in place and all-reduce their
  :math:`m\times m` Gram matrix at each of the :math:`k` steps, cheaper in traffic than
  ``"owner"`` once :math:`n > (k+1)Wm`; other matrices go to owners.

``"owner"`` and ``"gather"`` give bitwise the single-process result whenever Newton–Schulz
is batch invariant; ``"tp_gram"`` sums over ranks and matches to rounding.
:func:`muonfn.testing.simulate` runs distributed code on virtual ranks without processes;
:class:`CountingCollectives` counts the bytes any collectives move.
"""

from ._collectives import (
    FINISHED,
    AsyncCollectives,
    Collectives,
    CountingCollectives,
    Handle,
    TorchCollectives,
    start_all_gather_into_tensor,
    start_all_to_all_single,
    torch_collectives,
)
from ._layout import ShardSpec
from ._orthogonalizer import (
    REPLICATED,
    STRATEGIES,
    Replicated,
    ShardedOrthogonalizer,
    ShardSpecs,
    Strategy,
    sharded_orthogonalizer,
)
from ._sums import ShardSums, shard_sums

__all__ = [
    "FINISHED",
    "REPLICATED",
    "STRATEGIES",
    "AsyncCollectives",
    "Collectives",
    "CountingCollectives",
    "Handle",
    "Replicated",
    "ShardSpec",
    "ShardSpecs",
    "ShardSums",
    "ShardedOrthogonalizer",
    "Strategy",
    "TorchCollectives",
    "shard_sums",
    "sharded_orthogonalizer",
    "start_all_gather_into_tensor",
    "start_all_to_all_single",
    "torch_collectives",
]
