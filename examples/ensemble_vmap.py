"""N models trained at once: ``torch.vmap`` over the loss, the gradient and the optimizer update.

The parameters of N independently initialised models are stacked into one TensorDict with
batch size ``[N]``. Because ``tx.init`` and ``tx.update`` are pure functions of TensorDicts,
``torch.vmap`` turns them into an optimizer for the whole ensemble: one call, batched
Newton–Schulz over all N × (matrices of one shape). Here each member also gets its own
learning rate, so the ensemble is a learning-rate sweep run in a single training loop.

    python examples/ensemble_vmap.py [--steps 150] [--members 4]
"""

from __future__ import annotations

import argparse
import copy

import torch
from tensordict import TensorDict
from torch import nn

import muonfn


def main(argv: list[str] | None = None) -> torch.Tensor:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--members", type=int, default=4)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = torch.sin(x @ torch.randn(16, 4) / 2)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    members = [make() for _ in range(args.members)]
    params = TensorDict.from_modules(*members).detach()  # every leaf gets a leading dimension of size N
    skeleton = copy.deepcopy(members[0]).to("meta")  # structure only; the parameters come from `params`

    def loss_fn(params: TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with params.to_module(skeleton):
            return nn.functional.mse_loss(skeleton(x), y)

    # lr=1 inside the transform, the member's own rate applied to its updates: since Muon's
    # update is -lr·(direction + wd·p), scaling the whole update by lr_i is exactly lr=lr_i.
    lrs = torch.logspace(-3, -1, args.members)
    # Newton–Schulz in fp32 on every CPU, so that the check at the end holds to fp32 rounding (bf16, the default
    # for these 64×64 matrices on a CPU whose bf16 matmuls are faster, rounds a batch apart from a matrix alone)
    ns = muonfn.NewtonSchulz(dtype=torch.float32)
    tx = muonfn.muon(lr=1.0, weight_decay=0.01, labels=muonfn.labels_from_module(skeleton), ns=ns)

    def step(params: TensorDict, state: TensorDict, lr: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return muonfn.apply_updates(params, updates.mul(lr)), state, loss

    state = torch.vmap(tx.init)(params)  # momentum / Adam moments for every member, batch size [N]
    ensemble_step = torch.vmap(step, in_dims=(0, 0, 0, None, None))
    first = torch.vmap(loss_fn, in_dims=(0, None, None))(params, x, y)
    for i in range(args.steps):
        batch = torch.randint(0, len(x), (64,))
        params, state, loss = ensemble_step(params, state, lrs, x[batch], y[batch])
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  batch loss per member " + " ".join(f"{v:.4f}" for v in loss.tolist()))

    final = torch.vmap(loss_fn, in_dims=(0, None, None))(params, x, y)
    for lr, a, b in zip(lrs.tolist(), first.tolist(), final.tolist()):
        print(f"lr {lr:.0e}: loss {a:.4f} -> {b:.4f}")
    print(f"best learning rate: {lrs[final.argmin()].item():.0e}")

    # The vmapped update equals training one member alone.
    alone = members[1]
    solo = TensorDict.from_module(alone).detach()
    solo_tx = muonfn.muon(lr=lrs[1].item(), weight_decay=0.01, labels=muonfn.labels_from_module(alone), ns=ns)
    solo_state = solo_tx.init(solo)
    grads = torch.func.grad(loss_fn)(solo, x, y)
    updates, _ = solo_tx.update(grads, solo_state, solo)
    one_step = torch.vmap(step, in_dims=(0, 0, 0, None, None))(
        TensorDict.from_modules(*members).detach(), torch.vmap(tx.init)(params), lrs, x, y
    )[0]
    for key, u in updates.items(include_nested=True, leaves_only=True):
        torch.testing.assert_close(one_step[key][1], solo[key] + u, rtol=1e-4, atol=1e-6)
    print("one vmapped step == one step of each member alone")

    if not (final < first).all():
        raise SystemExit("some member did not improve")
    return final


if __name__ == "__main__":
    main()
