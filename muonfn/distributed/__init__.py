r"""Muon on sharded parameters (FSDP2, HSDP, tensor parallelism) with explicit collectives.

Newton–Schulz needs whole matrices; under FSDP2 or tensor parallelism each rank holds a
shard. Pass the collectives of your mesh and nothing else changes::

    from muonfn.distributed import torch_collectives

    tx = muonfn.muon(lr=3e-3, collectives=torch_collectives(mesh))  # the mesh given to fully_shard
    opt = muonfn.optim.Muon(model.named_parameters(), collectives=torch_collectives(mesh))  # or the shim

**Layouts.** Leaves that are DTensors describe their own sharding: ``Shard(d)`` with
uneven and empty shards (``torch.chunk`` sizes: 10 rows on 4 ranks are 3, 3, 3, 1),
``(Replicate, Shard)`` for HSDP, ``(_StridedShard, Shard)`` and ``(Shard(0), Shard(1))``
for tensor parallelism under FSDP2, on one mesh or several (TP weights on the 2-D mesh,
the others on its ``"dp"`` sub-mesh). Plain local tensors are whole matrices unless
``shard_specs`` declares them shards (:class:`ShardSpec`), as in hand-rolled tensor
parallelism::

    tx = muonfn.muon(collectives=torch_collectives(world), shard_specs={"attn.qkv.weight": ShardSpec(0, tp)})

Views work on every layout: the expert dimension of ``MatrixView(batch_dims=1)`` stays out
of the norm, and experts sharded by ``Shard(0)`` are whole matrices, orthogonalized where
they lie without moving; fused-QKV splits, conv kernels and transposed storage are applied
to the assembled tensor. Orientation and scale come from the global shape.

**Only Newton–Schulz communicates,** through the :class:`Collectives` given (never a
default group), and the counts over ``shard_specs`` shards that caution and
:func:`muonfn.apply_if_finite` take over whole leaves (one ``all_reduce``, :func:`shard_sums`);
momentum and AdamW stay elementwise on the local shards, and the state mirrors the params'
placements (DTensor in, DTensor state; momentum stays a shard). Every rank of a group joins
the same collectives in the same order, whatever shards are empty; ranks that pass different
parameters get an error the first time, not a hang.

**Strategies** (``strategy=``):

- ``"owner"`` (default): whole matrices are assigned to owner ranks, balanced by
  Newton–Schulz flops; shards go to their owner in one all-to-all and come back in one.
  About :math:`1/W` of the compute per rank, :math:`2(W-1)S/W^2` elements received per
  rank for :math:`S` matrix elements, at most ``bucket_numel`` elements of whole matrices
  held per rank at once.
- ``"gather"``: every rank all-gathers every matrix and orthogonalizes all of them
  (simple; :math:`W\times` the compute, :math:`(W-1)S/W` elements received per rank).
- ``"tp_gram"``: matrices cut along their long side (column-parallel weights) stay in
  place and all-reduce their :math:`m\times m` Gram matrix at each step; cheaper in
  traffic than ``"owner"`` once :math:`n > (k+1)Wm` for :math:`k` steps. Other matrices go
  to owners.

``"owner"`` and ``"gather"`` give bitwise the single-process result whenever Newton–Schulz
is batch invariant, as fp32 on CPU with one intra-op thread is; ``"tp_gram"`` sums over
ranks and matches to rounding.

**Replicated matrices** (``replicated=``): plain tensors not named in ``shard_specs`` and
``Replicate()`` DTensors are whole and equal on every rank (DDP, ZeRO-1). With ``"split"``
(default) each is orthogonalized by one owner, balanced by flops, which sends the result to
the others: :math:`1/W` of the compute for :math:`(W-1)S/W` elements received per rank,
bitwise the single-process result. HSDP's replica groups share their work the same way.
``"local"`` lets every rank compute every replicated matrix and moves nothing.

**Overlap** (``overlap=``, default ``True``): with :class:`AsyncCollectives` the rounds
(one shape each) are pipelined, the next round's exchange in flight during this round's
Newton–Schulz; ``False`` runs exchange and Newton–Schulz strictly in turn. Results are
bitwise the same either way.

**Checkpoints.** The state is a TensorDict of DTensors, so ``torch.distributed.checkpoint``
saves it and loads it on any number of ranks (resharding on load). The two lines::

    dcp.save({"model": model.state_dict(), "optim": state.to_dict()}, checkpoint_id=path)
    state = tx.init(params); dcp.load({"model": model.state_dict(), "optim": state.to_dict()}, checkpoint_id=path)

(``dcp.load`` fills the tensors of the freshly initialised state in place.)

**Testing without processes.** :func:`simulate` runs a function on ``W`` virtual ranks, one
thread each, over :class:`SimulatedCollectives` that really exchange data (asynchronously,
and over a modelled :class:`Link` if given); :class:`CountingCollectives` counts the bytes
any collectives move.
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
from ._simulate import Link, SimulatedCollectives, simulate
from ._sums import ShardSums, shard_sums

__all__ = [
    "FINISHED",
    "REPLICATED",
    "STRATEGIES",
    "AsyncCollectives",
    "Collectives",
    "CountingCollectives",
    "Handle",
    "Link",
    "Replicated",
    "ShardSpec",
    "ShardSpecs",
    "ShardSums",
    "ShardedOrthogonalizer",
    "SimulatedCollectives",
    "Strategy",
    "TorchCollectives",
    "shard_sums",
    "sharded_orthogonalizer",
    "simulate",
    "start_all_gather_into_tensor",
    "start_all_to_all_single",
    "torch_collectives",
]
