"""One rank of the CUDA check of the collectives (NCCL, one GPU per rank), launched by torchrun.

Exercises every method of ``TorchCollectives`` (blocking and ``*_async``) on CUDA tensors,
then the sharded orthogonalizer (row shards declared with ``ShardSpec``, and replicated
plain tensors) with both strategies, both pipelining orders and both ``replicated`` modes,
against the one-process result on the same GPU. Exit status 1 on any mismatch.
"""

import os

import torch
import torch.distributed as dist
from tensordict import TensorDict

import muonfn
from muonfn.distributed import CountingCollectives, ShardSpec, sharded_orthogonalizer, torch_collectives

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
world = dist.get_world_size()
group = torch_collectives(dist.group.WORLD)
cuda = torch.device("cuda", torch.cuda.current_device())

gathered = torch.empty(2 * world, device=cuda)
group.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device=cuda))
assert gathered.tolist() == [float(r) for r in range(world) for _ in range(2)], gathered
total = torch.full((3,), float(rank + 1), device=cuda)
group.all_reduce(total)
assert total.tolist() == [world * (world + 1) / 2] * 3, total
sends = [r + 1 for r in range(world)]  # rank r sends r + 1 elements to every rank d ... of value rank
recvs = [rank + 1] * world
out = torch.empty(sum(recvs), device=cuda)
group.all_to_all_single_async(
    out, torch.cat([torch.full((n,), float(rank), device=cuda) for n in sends]), recvs, sends
).wait()
assert out.tolist() == [float(src) for src in range(world) for _ in range(rank + 1)], out
gathered_async = torch.empty(2 * world, device=cuda)
group.all_gather_into_tensor_async(gathered_async, torch.full((2,), float(rank), device=cuda)).wait()
assert torch.equal(gathered_async, gathered)

torch.manual_seed(0)
full = {"w": torch.randn(10, 6, device=cuda), "v": torch.randn(6, 16, device=cuda), "u": torch.randn(7, 5, device=cuda)}
NS = muonfn.NewtonSchulz(dtype=torch.float32)
expected = muonfn.orthogonalize(NS).update(TensorDict(full, []), TensorDict())[0]
shards = {"w": full["w"].tensor_split(world)[rank], "v": full["v"].tensor_split(world)[rank], "u": full["u"]}
specs = {"w": ShardSpec(0), "v": ShardSpec(0)}  # "u" is replicated: whole on every rank
for strategy in ("owner", "gather"):
    for overlap in (True, False):
        for replicated in ("split", "local"):
            counted = CountingCollectives(group)
            run = sharded_orthogonalizer(
                counted, strategy=strategy, shard_specs=specs, overlap=overlap, replicated=replicated
            )
            got = muonfn.orthogonalize(NS, orthogonalizer=run).update(TensorDict(shards, []), {})[0]
            for k in full:
                want = expected[k].tensor_split(world)[rank] if k in specs else expected[k]
                assert got[k].device == cuda, (k, got[k].device)
                torch.testing.assert_close(got[k], want, rtol=1e-4, atol=1e-5)
dist.barrier()
dist.destroy_process_group()
