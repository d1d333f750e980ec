r"""Muon on sharded parameters (FSDP2, HSDP, tensor parallelism) with explicit collectives.

Newton–Schulz needs whole matrices; under FSDP2 or tensor parallelism each rank holds a
shard. Pass the collectives of your mesh and nothing else changes::

    from muonfn.distributed import torch_collectives

    tx = muonfn.muon(lr=0.02, collectives=torch_collectives(mesh))  # the mesh given to fully_shard

Leaves that are DTensors describe their own sharding (``Shard``, uneven and empty shards,
``Replicate`` for HSDP, ``_StridedShard`` for TP + FSDP). Plain local tensors are whole
matrices unless ``shard_specs`` declares them shards (:class:`ShardSpec`), as in
hand-rolled tensor parallelism::

    tx = muonfn.muon(collectives=torch_collectives(world), shard_specs={"attn.qkv.weight": ShardSpec(0, tp)})

Momentum and AdamW stay elementwise on the local shards (the state mirrors the params'
placements: DTensor in, DTensor state). Only the Newton–Schulz step communicates, through
the :class:`Collectives` given, never through a default group. Strategies:

- ``"owner"`` (default): whole matrices are assigned to owner ranks, balanced by
  Newton–Schulz flops; shards go to their owner in one all-to-all and come back in one.
  About :math:`1/W` of the compute per rank.
- ``"gather"``: every rank all-gathers every matrix and orthogonalizes all of them
  (simple; :math:`W\times` the compute).

Both give, in fp32 on CPU, bitwise the single-process result, on any number of ranks.

Checkpoints: the state is a TensorDict of DTensors, so ``torch.distributed.checkpoint``
saves it and loads it on any number of ranks (resharding on load)::

    dcp.save({"model": model.state_dict(), "optim": state.to_dict()}, checkpoint_id=path)
    state = tx.init(params); dcp.load({"model": model.state_dict(), "optim": state.to_dict()}, checkpoint_id=path)

(``dcp.load`` fills the tensors of a freshly initialised state in place.)

Testing without processes: :func:`simulate` runs a function on ``W`` virtual ranks, one
thread each, over :class:`SimulatedCollectives` that really exchange data.
"""

from ._collectives import Collectives, CountingCollectives, TorchCollectives, torch_collectives
from ._layout import ShardSpec
from ._simulate import SimulatedCollectives, simulate
from ._strategies import STRATEGIES, ShardSpecs, sharded_orthogonalizer

__all__ = [
    "STRATEGIES",
    "Collectives",
    "CountingCollectives",
    "ShardSpec",
    "ShardSpecs",
    "SimulatedCollectives",
    "TorchCollectives",
    "sharded_orthogonalizer",
    "simulate",
    "torch_collectives",
]
