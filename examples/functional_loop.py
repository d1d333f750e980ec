"""The functional API end to end: ``torch.func.grad`` over a TensorDict of parameters.

The model is only a function; the parameters, the gradients and the optimizer state are
TensorDicts, and one training step is a pure function of them::

    grads = torch.func.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    params = muonfn.apply_updates(params, updates)

Two ways to run a module with parameters it does not own are shown: ``params.to_module(model)``
(a context manager that swaps them in) and ``torch.func.functional_call``. The optimizer is
assembled from building blocks to show composition; ``muonfn.muon(...)`` is the ready-made one.

    python examples/functional_loop.py [--steps 200]
"""

from __future__ import annotations

import argparse

import torch
from tensordict import TensorDict
from torch import nn

import muonfn


def make_optimizer(model: nn.Module, lr: float, steps: int) -> muonfn.Transform:
    """Muon on the hidden matrices, AdamW on the rest, with a cosine learning-rate schedule."""

    def cosine(count: torch.Tensor) -> torch.Tensor:  # count: 0-d int64 tensor of previous updates
        return lr * 0.5 * (1 + torch.cos(torch.pi * count.clamp(max=steps) / steps))

    matrices = muonfn.chain(
        muonfn.scale_by_muon(momentum=0.95, nesterov=True, scale="match_rms_adamw"),
        muonfn.add_decayed_weights(0.01),
        muonfn.scale_by_learning_rate(cosine),
    )
    others = muonfn.adamw(lr=cosine, betas=(0.9, 0.95), weight_decay=0.0)
    return muonfn.partition({"muon": matrices, "adamw": others}, muonfn.labels_from_module(model))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    # one rate for both branches, sized as AdamW's would be: match_rms_adamw gives Muon's update AdamW's RMS
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    # Regression of a smooth function of 16 inputs.
    x = torch.randn(512, 16)
    y = torch.sin(x @ torch.randn(16, 4) / 2)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    params = TensorDict.from_module(model).detach()  # {"0": {"weight", "bias"}, "2": {...}, "4": {...}}

    def loss_fn(params: TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with params.to_module(model):
            return nn.functional.mse_loss(model(x), y)

    def loss_fn_functional_call(params: TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The same loss through torch.func.functional_call, which wants {"0.weight": tensor, ...}.
        return nn.functional.mse_loss(torch.func.functional_call(model, params.flatten_keys(".").to_dict(), (x,)), y)

    tx = make_optimizer(model, args.lr, args.steps)
    state = tx.init(params)
    print("optimizer state layout:", sorted(state.keys(include_nested=True, leaves_only=True))[:4], "...")

    @torch.no_grad()
    def full_loss(params: TensorDict) -> float:
        return loss_fn(params, x, y).item()

    grad_fn = torch.func.grad(loss_fn)
    first = full_loss(params)
    for step in range(args.steps):
        batch = torch.randint(0, len(x), (64,))
        grads = grad_fn(params, x[batch], y[batch])
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {full_loss(params):.4f}")

    # Both ways of calling the model agree, and so do their gradients.
    via_call = torch.func.grad(loss_fn_functional_call)(params, x, y)
    via_to_module = torch.func.grad(loss_fn)(params, x, y)
    for key, g in via_to_module.items(include_nested=True, leaves_only=True):
        torch.testing.assert_close(via_call[key], g)
    last = full_loss(params)
    print(f"loss {first:.4f} -> {last:.4f}")
    if not last < 0.7 * first:
        raise SystemExit("training did not reduce the loss")
    return last


if __name__ == "__main__":
    main()
