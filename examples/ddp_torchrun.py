"""Muon under data parallelism (DDP): every rank holds the whole model, muonfn splits Newton–Schulz.

Run on CPU with two processes (gloo):

    python -m torch.distributed.run --nproc_per_node 2 examples/ddp_torchrun.py --steps 20

``DistributedDataParallel`` all-reduces the gradients, so every rank holds the same whole
matrices and the same gradients. A sharded orthogonalizer over their collectives treats these
plain tensors as replicated: each matrix is orthogonalized by one owner rank (owners balanced by
Newton–Schulz flops, same shapes batched), and the owner sends the result to the others,
so each rank does about 1/W of the Newton–Schulz work instead of all of it. Momentum and
AdamW stay on every rank (they are elementwise and cheap). ``replicated="local"`` opts out
(every rank orthogonalizes everything, nothing moves): for a link slower than the
Newton–Schulz it saves.

The example checks that every rank ends with bit-identical parameters, and that they equal
those of a run where every rank orthogonalizes everything itself.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import muonfn
from muonfn.distributed import CountingCollectives, sharded_orthogonalizer, torch_collectives

VOCAB, WIDTH, CONTEXT = 64, 48, 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH * CONTEXT, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, 2 * WIDTH)
        self.fc3 = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(1)
        x = self.fc3(nn.functional.gelu(self.fc2(nn.functional.gelu(self.fc1(x)))))
        return self.lm_head(self.norm(x))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step``: the next token after 16 of a fixed sequence."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, 4 * VOCAB, (32,), generator=gen)
    tokens = (start[:, None] + torch.arange(CONTEXT + 1)) * 7 % VOCAB
    mine = slice(rank * 32 // world, (rank + 1) * 32 // world)
    return tokens[mine, :CONTEXT], tokens[mine, CONTEXT]


def train(steps: int, replicated: str, collectives: CountingCollectives) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(0)  # the same initialisation on every rank
    model = Model()
    labels = muonfn.labels_from_module(model)  # fc1, fc2, fc3 -> Muon; embed, norm, head, biases -> AdamW
    ddp = DistributedDataParallel(model)
    orthogonalizer = sharded_orthogonalizer(collectives, replicated=replicated)
    tx = muonfn.muon(lr=0.01, weight_decay=0.01, labels=labels, orthogonalizer=orthogonalizer)
    params = TensorDict.from_module(model).detach()
    state = tx.init(params)
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        tokens, targets = batch(step, rank, world)
        loss = nn.functional.cross_entropy(ddp(tokens), targets)
        loss.backward()  # DDP all-reduces: every rank now holds the same whole gradients
        grads = TensorDict({n: p.grad for n, p in model.named_parameters()}, [])
        params = TensorDict.from_module(model).detach()  # sharing storage with the model
        updates, state = tx.update(grads, state, params)
        muonfn.apply_updates_(params, updates)  # the model stepped in place
        model.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return model, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(1)  # bitwise agreement of the two runs needs batch-invariant matmuls
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives = CountingCollectives(torch_collectives(dist.group.WORLD))

    model, losses = train(args.steps, "split", collectives)
    received = collectives.bytes_received / args.steps
    collectives.reset()
    alone, _ = train(args.steps, "local", collectives)

    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = torch.empty(world * mine.numel())
    dist.all_gather_into_tensor(everyone, mine)
    if not all(torch.equal(part, mine) for part in everyone.view(world, -1)):
        raise SystemExit(f"rank {rank}: the ranks' parameters differ")
    differing = [n for (n, p), q in zip(model.named_parameters(), alone.parameters()) if not torch.equal(p, q)]
    if differing:
        raise SystemExit(f"rank {rank}: the split run differs from the local one at {differing[:3]}")
    if rank == 0:
        for step in range(0, args.steps, 5):
            print(f"step {step:3d}  loss {losses[step]:.4f}")
        print(f"{world} ranks, each orthogonalizing about 1/{world} of the matrices")
        print(f"{received / 1e3:.1f} kB of results received per rank and step")
        print("parameters identical on every rank, and to every rank orthogonalizing everything itself")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()
    if not losses[-1] < losses[0]:
        raise SystemExit("training did not reduce the loss")


if __name__ == "__main__":
    main()
