"""An ordinary PyTorch training script, with Muon from ``muonfn.optim``.

``muonfn.optim.Muon`` is a ``torch.optim.Optimizer``: ``zero_grad`` / ``backward`` /
``step``, learning-rate schedulers, gradient clipping, ``state_dict`` / ``load_state_dict``
all work as usual. Given ``model.named_parameters()`` it splits the parameters by module
type into two param groups, Muon for the hidden matrices and AdamW for the rest, so a
scheduler scales both learning rates alike.

    python examples/shim_script.py [--steps 150]
"""

from __future__ import annotations

import argparse
import io

import torch
from torch import nn

import muonfn
import muonfn.optim


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(32, 64),  # AdamW: embeddings are not hidden-layer matrices
        nn.Flatten(),
        nn.Linear(8 * 64, 128),  # Muon
        nn.GELU(),
        nn.LayerNorm(128),  # AdamW
        nn.Linear(128, 128),  # Muon
        nn.GELU(),
        nn.Linear(128, 32),  # the output layer: AdamW (excluded by name below)
    )


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    # one rate for both groups, sized as AdamW's would be: the default scale gives Muon's update AdamW's RMS
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    # Predict the largest of eight tokens.
    tokens = torch.randint(0, 32, (2048, 8))
    targets = tokens.amax(1)
    model = make_model()

    # Muon on Linear weights except the last one ("7.weight"), AdamW on everything else.
    labels = muonfn.labels_from_module(model, exclude=("7.",))
    optimizer = muonfn.optim.Muon(model.named_parameters(), lr=args.lr, weight_decay=0.01, labels=labels)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    print("param groups:", [(g.get("use_muon"), len(g["params"])) for g in optimizer.param_groups])

    first = None
    for step in range(args.steps):
        batch = torch.randint(0, len(tokens), (128,))
        loss = nn.functional.cross_entropy(model(tokens[batch]), targets[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        first = loss.item() if first is None else first
        if step % 50 == 0 or step == args.steps - 1:
            lrs = ", ".join(f"{g['lr']:.2e}" for g in optimizer.param_groups)
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {lrs}")

    # The optimizer state round-trips through state_dict like any torch optimizer's ...
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    restored_model = make_model()
    restored_model.load_state_dict(saved["model"])
    restored = muonfn.optim.Muon(restored_model.named_parameters(), lr=args.lr, weight_decay=0.01, labels=labels)
    restored.load_state_dict(saved["optimizer"])
    # ... and is also the functional state TensorDict, in muonfn.muon's layout.
    state = restored.functional_state
    print("functional state:", sorted({k[:2] for k in state.keys(include_nested=True, leaves_only=True)}))
    for key, value in optimizer.functional_state.items(include_nested=True, leaves_only=True):
        assert torch.equal(value, state[key]), key

    with torch.no_grad():
        last = nn.functional.cross_entropy(model(tokens), targets).item()
    print(f"loss {first:.4f} -> {last:.4f}")
    if not last < 0.7 * first:
        raise SystemExit("training did not reduce the loss")
    return last


if __name__ == "__main__":
    main()
