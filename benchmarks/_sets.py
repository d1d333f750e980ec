"""Parameter sets the benchmarks step: GPT-2 blocks (and GPT-2 small and medium), a conv net,
a mixture-of-experts layer.

Only parameters and gradients matter to an optimizer step, so each set is a module tree
with random weights and a fixed random gradient per parameter (no forward pass). Every
set also says which parameters are matrices for Muon, how they read as matrices, and
how many Newton–Schulz flops one step costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from tensordict import TensorDict
from torch import nn

import muonfn
from muonfn.linalg import newton_schulz_flops


@dataclass
class ParamSet:
    """A model's parameters with gradients, labelled for Muon/AdamW."""

    name: str
    description: str
    model: nn.Module
    labels: dict[str, str]  # dotted name -> "muon" | "adamw"
    views: dict[str, muonfn.MatrixView] = field(default_factory=dict)

    def named(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def matrix_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named() if self.labels[n] == "muon"]

    def other_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named() if self.labels[n] != "muon"]

    def view(self, name: str) -> muonfn.MatrixView:
        return self.views.get(name, muonfn.MatrixView())

    def matrices(self, name: str, p: torch.Tensor) -> list[torch.Tensor]:
        """The 2-D matrices Muon sees in parameter ``name`` (views of ``p``)."""
        return [b for batch in self.view(name).to_matrices(p) for b in batch.unbind(0)]

    def matrix_shapes(self) -> list[tuple[int, int]]:
        return [tuple(m.shape) for n, p in self.matrix_params() for m in self.matrices(n, p)]  # type: ignore[misc]

    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named())

    def ns_flops(self, steps: int = 5) -> float:
        """Flops of the standard iteration on every matrix: ``steps·(4m²n + 2m³)``, m ≤ n."""
        return sum(newton_schulz_flops(r, c, steps) for r, c in self.matrix_shapes())


def _fill_grads(model: nn.Module, generator: torch.Generator) -> None:
    """Random weights and gradients; on the meta device (shapes only, no memory) just a
    gradient per parameter, which the traffic counter needs and no value."""
    for p in model.parameters():
        p.requires_grad_(False)
        if p.device.type == "meta":
            p.grad = torch.empty_like(p)
            continue
        p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype, device="cpu").to(p.device) * 0.02)
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype, device="cpu").to(p.device)


class GPTBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(d, 3 * d), "c_proj": nn.Linear(d, d)})
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(d, 4 * d), "c_proj": nn.Linear(4 * d, d)})


class GPT(nn.Module):
    """GPT-2's parameters: token and position embeddings, ``depth`` blocks, a final norm
    (the output head is tied to the token embedding)."""

    def __init__(self, width: int, depth: int, vocab: int, context: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(GPTBlock(width) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)


def gpt(
    width: int = 256,
    depth: int = 4,
    vocab: int = 4096,
    context: int = 512,
    device: str = "cpu",
    name: str = "",
    dtype: torch.dtype = torch.float32,
) -> ParamSet:
    """Block matrices (fused QKV as one matrix, as torch.optim.Muon sees it) go to Muon;
    embeddings, norms and biases to AdamW. ``dtype``: the parameters' and gradients' (a bf16 model)."""
    with torch.device(device):  # built where it lives (a 124 M set on the meta device in no time)
        model = GPT(width, depth, vocab, context).to(dtype)
    _fill_grads(model, torch.Generator().manual_seed(0))
    labels = muonfn.label_params(TensorDict.from_module(model))
    return ParamSet(
        name or f"gpt-w{width}-d{depth}", f"GPT-2 blocks, width {width}, depth {depth}, vocab {vocab}", model, labels
    )


#: GPT-2's published shapes, the output head tied to the token embedding: 124,439,808 and
#: 354,823,168 parameters.
GPT2_SIZES: dict[str, dict[str, int]] = {
    "gpt2-small": {"width": 768, "depth": 12, "vocab": 50257, "context": 1024},
    "gpt2-medium": {"width": 1024, "depth": 24, "vocab": 50257, "context": 1024},
}


def gpt2(size: str, device: str = "cpu", dtype: torch.dtype = torch.float32, **sizes: int) -> ParamSet:
    """GPT-2 small or medium (``size``: a key of :data:`GPT2_SIZES`), named so in the results
    whatever its sizes; ``sizes`` shrink it (the smoke profile), and the description says so, as
    it says a ``dtype`` other than fp32 (the parameters')."""
    dims = {**GPT2_SIZES[size], **sizes}
    ps = gpt(**dims, device=device, name=size, dtype=dtype)
    shrunk = "" if dims == GPT2_SIZES[size] else " (shrunk)"
    title = size.replace("gpt2-", "GPT-2 ")
    ps.description = f"{title}{shrunk}, width {dims['width']}, depth {dims['depth']}, vocab {dims['vocab']}"
    if dtype != torch.float32:
        ps.description += f", {str(dtype).removeprefix('torch.')} parameters"
    return ps


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None


class ResNet(nn.Module):
    """ResNet-18's parameters with base width ``width`` (64 in the original)."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        blocks, cin = [], width
        for stage in range(4):
            cout = width * 2**stage
            blocks += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)


def convnet(width: int = 16, classes: int = 100, device: str = "cpu") -> ParamSet:
    """Conv kernels go to Muon as ``(out, in·kh·kw)`` matrices (the default view); the
    stem (3 input channels), the head, norms and biases go to AdamW."""
    model = ResNet(width, classes).to(device)
    _fill_grads(model, torch.Generator().manual_seed(1))
    labels = {n: "muon" if p.ndim == 4 and not n.startswith("stem") else "adamw" for n, p in model.named_parameters()}
    return ParamSet(f"resnet18-w{width}", f"ResNet-18 convs, base width {width}", model, labels)


class Experts(nn.Module):
    def __init__(self, experts: int, d: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(experts, hidden, d))
        self.w_out = nn.Parameter(torch.empty(experts, d, hidden))


class MoEBlock(nn.Module):
    def __init__(self, d: int, experts: int, hidden: int) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(d)
        self.attn = nn.ModuleDict({name: nn.Linear(d, d, bias=False) for name in ("q", "k", "v", "o")})
        self.norm_2 = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = Experts(experts, d, hidden)


class MoE(nn.Module):
    def __init__(self, d: int, depth: int, experts: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock(d, experts, hidden) for _ in range(depth))


def moe(width: int = 128, depth: int = 1, experts: int = 8, hidden: int = 256, device: str = "cpu") -> ParamSet:
    """Expert weights ``(E, out, in)`` go to Muon as ``E`` matrices each
    (``MatrixView(batch_dims=1)``), attention projections as matrices; the router,
    norms to AdamW."""
    model = MoE(width, depth, experts, hidden).to(device)
    _fill_grads(model, torch.Generator().manual_seed(2))
    labels = {n: "muon" if p.ndim >= 2 and "router" not in n else "adamw" for n, p in model.named_parameters()}
    views = {n: muonfn.MatrixView(batch_dims=1) for n, p in model.named_parameters() if p.ndim == 3}
    return ParamSet(
        f"moe-w{width}-e{experts}",
        f"MoE layers, width {width}, {experts} experts of hidden {hidden}, depth {depth}",
        model,
        labels,
        views,
    )


BUILDERS: dict[str, Callable[..., ParamSet]] = {
    "gpt": gpt,
    "conv": convnet,
    "moe": moe,
    **{size: partial(gpt2, size) for size in GPT2_SIZES},
}
SETS = tuple(BUILDERS)


def build(name: str, device: str, **sizes: int) -> ParamSet:
    return BUILDERS[name](device=device, **sizes)


def size_summary(ps: ParamSet) -> dict[str, object]:
    shapes = ps.matrix_shapes()
    return {
        "params": ps.numel(),
        "matrix_params": sum(r * c for r, c in shapes),
        "matrices": len(shapes),
        "distinct_matrix_shapes": len(set(shapes)),
        "ns_gflop": ps.ns_flops() / 1e9,
        "largest_matrix": max(shapes, key=lambda s: s[0] * s[1]) if shapes else None,
    }
