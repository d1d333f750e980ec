"""Trains a small character-level model on the Python standard library's source with muonfn."""

from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import torch
from tensordict import TensorDict
from torch import nn

import muonfn


def load_corpus(limit: int) -> str:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    text = []
    for path in sorted(root.glob("*.py")):
        text.append(path.read_text(encoding="utf-8", errors="replace"))
        if sum(map(len, text)) > limit:
            break
    return "".join(text)[:limit]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--chars", type=int, default=1_000_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    text = load_corpus(args.chars)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text[:200_000]], dtype=torch.long)
    ctx, width = 64, 128
    model = nn.Sequential(
        nn.Embedding(len(vocab), width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, len(vocab))
    )
    params = TensorDict.from_module(model).detach()
    tx = muonfn.muon(lr=0.02, labels=muonfn.labels_from_module(model))
    state = tx.init(params)

    def loss_fn(p: TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with p.to_module(model):
            return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    start = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(0, len(data) - ctx - 1, (32,))
        x = torch.stack([data[i : i + ctx] for i in idx])
        y = torch.stack([data[i + 1 : i + ctx + 1] for i in idx])
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
