"""Parameters that are not one plain ``(out, in)`` matrix: conv kernels, MoE experts, fused QKV.

Newton–Schulz orthogonalizes matrices, so every Muon leaf is read as one or more of them
through a :class:`muonfn.MatrixView`:

- conv ``(out, in, kh, kw)``: one ``(out, in·kh·kw)`` matrix; the default for ≥3-D leaves.
- experts ``(E, out, in)``: ``MatrixView(batch_dims=1)``, E independent matrices.
- fused QKV ``(q + k + v, in)``: ``MatrixView(split=(q, k, v))``, each block on its own.
- ``(in, out)`` storage (Hugging Face ``Conv1D``): ``MatrixView(transposed=True)``;
  ``muonfn.views_from_module(model)`` finds those.

The scale mode uses each block's own shape, and the views are checked against the shapes
before the first step (a wrong split is an error naming the parameter).

    python examples/custom_views.py [--steps 60]
"""

from __future__ import annotations

import argparse
import functools

import torch
from tensordict import TensorDict
from torch import nn

import muonfn

WIDTH, HEADS, KV_WIDTH, EXPERTS = 32, 4, 16, 4  # grouped-query attention: k and v narrower than q


class TinyNet(nn.Module):
    """Conv stem -> attention with a fused, grouped QKV projection -> a dense mixture of experts."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, WIDTH, kernel_size=3, padding=1)
        self.qkv = nn.Linear(WIDTH, WIDTH + 2 * KV_WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, 2 * WIDTH, WIDTH) / WIDTH**0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, WIDTH, 2 * WIDTH) / (2 * WIDTH) ** 0.5)
        self.classifier = nn.Linear(WIDTH, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.stem(images)).flatten(2).transpose(1, 2)  # (batch, pixels, WIDTH)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([WIDTH, KV_WIDTH, KV_WIDTH], dim=-1)
        q = q.view(b, t, HEADS, -1).transpose(1, 2)
        k, v = (z.view(b, t, HEADS // 2, -1).transpose(1, 2).repeat_interleave(2, dim=1) for z in (k, v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, WIDTH))
        gates = self.router(x).softmax(-1)  # (b, t, E)
        hidden = nn.functional.gelu(torch.einsum("btd,ehd->bteh", x, self.w_in))
        x = x + torch.einsum("bte,bteh,edh->btd", gates, hidden, self.w_out)
        return self.classifier(x.mean(1))


VIEWS = {
    # "stem.weight" (32, 1, 3, 3) needs no declaration: ≥3-D leaves flatten to (32, 9).
    "qkv.weight": muonfn.MatrixView(split=(WIDTH, KV_WIDTH, KV_WIDTH)),
    "w_in": muonfn.MatrixView(batch_dims=1),
    "w_out": muonfn.MatrixView(batch_dims=1),
}
# Shape-based labels: every ≥2-D leaf is a Muon matrix, except the classifier and the router.
LABELS = functools.partial(muonfn.label_params, exclude=(*muonfn.DEFAULT_EXCLUDE, "classifier", "router"))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyNet()
    params = TensorDict.from_module(model).detach()
    print("labels:", {k: v for k, v in LABELS(params).items()})

    images, targets = torch.randn(128, 1, 8, 8), torch.randint(0, 10, (128,))

    def loss_fn(params: TensorDict, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with params.to_module(model):
            return nn.functional.cross_entropy(model(images), targets)

    # What the views do: orthogonalize a Gaussian stand-in for the gradient with an accurate
    # coefficient set and compare every block with its exact polar factor U Vᵀ.
    matrices = params.select(("stem", "weight"), "qkv", "w_in", "w_out").apply(torch.randn_like)
    accurate = muonfn.NewtonSchulz("polar_express")
    ortho, _ = muonfn.orthogonalize(accurate, views=VIEWS).update(matrices, TensorDict())
    plain, _ = muonfn.orthogonalize(accurate).update(matrices, TensorDict())

    def error(block: torch.Tensor, reference: torch.Tensor) -> float:
        exact = muonfn.polar(reference)
        return ((block - exact).norm() / exact.norm()).item()

    stem_in, stem_out = matrices["stem", "weight"].flatten(1), ortho["stem", "weight"].flatten(1)
    print(f"conv (32, 1, 3, 3) read as (32, 9): error vs polar factor {error(stem_out, stem_in):.1e}")
    split = [WIDTH, KV_WIDTH, KV_WIDTH]
    for name, block, raw in zip("qkv", ortho["qkv", "weight"].split(split), matrices["qkv", "weight"].split(split)):
        print(f"fused qkv, block {name} {tuple(block.shape)}: error vs its own polar factor {error(block, raw):.1e}")
        assert error(block, raw) < 0.01
    worst = max(error(ortho["w_in"][e], matrices["w_in"][e]) for e in range(EXPERTS))
    print(f"experts: worst error of the {EXPERTS} (64, 32) matrices vs their own polar factors {worst:.1e}")
    assert worst < 0.01
    unviewed = error(plain["w_in"][0], matrices["w_in"][0])
    print(f"without a view, w_in is one (4, 2048) matrix: expert 0 is off its polar factor by {unviewed:.2f}")

    # Training with the views.
    tx = muonfn.muon(lr=0.01, weight_decay=0.0, labels=LABELS, views=VIEWS)
    state = tx.init(params)
    first = loss_fn(params, images, targets).item()
    for step in range(args.steps):
        grads = torch.func.grad(loss_fn)(params, images, targets)
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss_fn(params, images, targets).item():.4f}")
    last = loss_fn(params, images, targets).item()
    print(f"loss {first:.4f} -> {last:.4f}")

    # A view that does not fit the parameter is caught before any step.
    try:
        muonfn.muon(labels=LABELS, views={"qkv.weight": muonfn.MatrixView(split=(32, 32, 32))}).update(
            grads, state, params
        )
    except ValueError as error:
        print(f"wrong split rejected: {error}")
    else:
        raise SystemExit("a wrong split was accepted")
    if not last < first:
        raise SystemExit("training did not reduce the loss")
    return last


if __name__ == "__main__":
    main()
