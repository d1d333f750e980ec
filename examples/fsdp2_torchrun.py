"""Muon under FSDP2: sharded parameters, whole-matrix Newton–Schulz, a DCP checkpoint.

Run on CPU with two processes (gloo):

    python -m torch.distributed.run --nproc_per_node 2 examples/fsdp2_torchrun.py --steps 20

Every rank holds a shard of every matrix (row shards, uneven where the rows do not divide).
Momentum and AdamW work on the local shards; for Newton–Schulz the ``"owner"`` strategy sends
each matrix's shards to one owner rank (owners balanced by flops), which orthogonalizes the
whole matrix and sends the shards back. Only the collectives passed in are used, never the
default group. The optimizer state is a TensorDict of DTensors sharded like the parameters,
so ``torch.distributed.checkpoint`` saves it with the model, each rank writing its shards,
and loads it into a fresh model and state: training resumes bit for bit.

The loop is the functional one, over ``sharded_orthogonalizer(torch_collectives(mesh))``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import muonfn
from muonfn.distributed import sharded_orthogonalizer, torch_collectives

VOCAB, WIDTH, CONTEXT = 64, 48, 16


class Model(nn.Module):
    """Embedding -> two MLP blocks -> head; 3·48 + 1 = 145 rows in fc1 do not split evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH * CONTEXT, 3 * WIDTH + 1)
        self.fc2 = nn.Linear(3 * WIDTH + 1, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(1)
        x = self.fc2(nn.functional.gelu(self.fc1(x)))
        return self.lm_head(self.norm(x))


def build(mesh: DeviceMesh) -> tuple[nn.Module, muonfn.Transform, TensorDict]:
    torch.manual_seed(0)  # the same full initialisation on every rank before sharding
    model = Model()
    labels = muonfn.labels_from_module(model)  # fc1, fc2 -> Muon; embed, norm, lm_head, biases -> AdamW
    for module in (model.embed, model.fc1, model.fc2, model.lm_head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    orthogonalizer = sharded_orthogonalizer(torch_collectives(mesh), strategy="owner")
    tx = muonfn.muon(lr=0.01, weight_decay=0.01, labels=labels, orthogonalizer=orthogonalizer)
    state = tx.init(TensorDict.from_module(model).detach())
    return model, tx, state


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step``: the next token after 16 of a fixed sequence."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, 4 * VOCAB, (32,), generator=gen)
    tokens = (start[:, None] + torch.arange(CONTEXT + 1)) * 7 % VOCAB  # a learnable pattern
    mine = slice(rank * 32 // world, (rank + 1) * 32 // world)
    return tokens[mine, :CONTEXT], tokens[mine, CONTEXT]


def train_step(model: nn.Module, tx: muonfn.Transform, state: TensorDict, step: int) -> tuple[TensorDict, float]:
    tokens, targets = batch(step, dist.get_rank(), dist.get_world_size())
    loss = nn.functional.cross_entropy(model(tokens), targets)
    loss.backward()  # FSDP2 reduce-scatters: every p.grad is this rank's shard (a DTensor)
    grads = TensorDict({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, [])
    params = TensorDict.from_module(model).detach()  # this rank's DTensor shards, sharing storage with the model
    updates, state = tx.update(grads, state, params)
    muonfn.apply_updates_(params, updates)  # the model's shards stepped in place
    model.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return state, total.item() / dist.get_world_size()


def local_shards(model: nn.Module, state: TensorDict) -> dict[str, torch.Tensor]:
    out = {f"param {n}": p.to_local().clone() for n, p in model.named_parameters()}
    for key, value in state.items(include_nested=True, leaves_only=True):
        out[f"state {'.'.join(key)}"] = value.to_local().clone() if hasattr(value, "to_local") else value.clone()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint", help="DCP checkpoint folder (default: a temporary one)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, tx, state = build(mesh)
    if rank == 0:
        shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if p.ndim == 2}
        print(f"{world} ranks; rank 0's shards: {shards}")

    first = None
    for step in range(args.steps):
        state, loss = train_step(model, tx, state, step)
        first = loss if first is None else first
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}")

    # Every rank writes its shards into the same folder; rank 0 picks it.
    folder = [os.path.abspath(args.checkpoint) if args.checkpoint else (tempfile.mkdtemp() if rank == 0 else None)]
    dist.broadcast_object_list(folder, src=0)
    path = folder[0]
    dcp.save({"model": model.state_dict(), "optim": state.to_dict()}, checkpoint_id=path)

    # A fresh model and optimizer state, filled in place by dcp.load.
    restored_model, restored_tx, restored_state = build(mesh)
    target = {"model": restored_model.state_dict(), "optim": restored_state.to_dict()}
    dcp.load(target, checkpoint_id=path)
    restored_model.load_state_dict(target["model"])
    restored_state = TensorDict(target["optim"], batch_size=[])

    # One more step on both: the resumed run must equal the uninterrupted one exactly.
    state, _ = train_step(model, tx, state, args.steps)
    restored_state, _ = train_step(restored_model, restored_tx, restored_state, args.steps)
    a, b = local_shards(model, state), local_shards(restored_model, restored_state)
    mismatched = [k for k in a if not torch.equal(a[k], b[k])]
    if mismatched:
        raise SystemExit(f"rank {rank}: resumed run differs at {mismatched[:3]}")
    dist.barrier()
    if rank == 0 and not args.checkpoint:
        shutil.rmtree(path)
    if rank == 0:
        print(f"resumed from the DCP checkpoint: step {args.steps + 1} identical on every rank")
        print(f"loss {first:.4f} -> {loss:.4f}")
    dist.destroy_process_group()
    if not loss < first:
        raise SystemExit("training did not reduce the loss")


if __name__ == "__main__":
    main()
