"""adamw and muon against torch.optim.AdamW and torch.optim.Muon, labels, views, state layout."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _strategies import assert_close_to_iteration, gaussian, iteration_dtype, mlp, random_like, rel_err
from tensordict import TensorDict
from torch.optim import _muon as torch_muon

import muonfn
from muonfn import MatrixView, newton_schulz

X, Y = gaussian(32, 6, seed=100), gaussian(32, 3, seed=101)


def make_loss(model: torch.nn.Module):
    device = next(model.parameters()).device

    def loss(params: TensorDict) -> torch.Tensor:
        with params.to_module(model):
            return torch.nn.functional.mse_loss(model(X.to(device, params.dtype)), Y.to(device, params.dtype))

    return loss


def torch_grads(model: torch.nn.Module) -> None:
    model.zero_grad()
    p = next(model.parameters())
    torch.nn.functional.mse_loss(model(X.to(p.device, p.dtype)), Y.to(p.device, p.dtype)).backward()


def max_param_diff(model: torch.nn.Module, params: TensorDict) -> float:
    theirs = TensorDict.from_module(model).detach()
    return max(float((params[k] - theirs[k]).abs().max()) for k in params.keys(True, True))


def run_both(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tx: muonfn.Transform, steps: int) -> float:
    """Trains ``model`` with ``optimizer`` and a copy of its parameters with ``tx``; the worst parameter gap."""
    params = TensorDict.from_module(model).detach().clone()
    functional_model = copy.deepcopy(model)
    loss = make_loss(functional_model)
    state = tx.init(params)
    worst = 0.0
    for _ in range(steps):
        torch_grads(model)
        optimizer.step()
        updates, state = tx.update(torch.func.grad(loss)(params), state, params)
        params = muonfn.apply_updates(params, updates)
        worst = max(worst, max_param_diff(model, params))
    return worst


# --- AdamW ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch(weight_decay: float, device: torch.device) -> None:
    model = mlp(0, (6, 12, 8, 3)).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, amsgrad=False
    )
    tx = muonfn.adamw(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    assert run_both(model, optimizer, tx, steps=20) <= 5e-6


def test_adamw_defaults_are_torchs() -> None:
    """adamw() with no arguments is torch.optim.AdamW() with no arguments (lr 1e-3, wd 0.01, ...)."""
    model = mlp(1, (6, 12, 3))
    assert run_both(model, torch.optim.AdamW(model.parameters()), muonfn.adamw(), steps=5) <= 5e-7


# --- Muon ----------------------------------------------------------------------------------------------


def muon_pair(model: torch.nn.Module, adjust_lr_fn: str | None, ns_dtype: torch.dtype, **kw):
    lr, wd = 0.02, 0.1
    optimizer = torch.optim.Muon(
        model.parameters(), lr=lr, weight_decay=wd, momentum=0.9, nesterov=True, adjust_lr_fn=adjust_lr_fn
    )
    tx = muonfn.muon(
        lr=lr,
        weight_decay=wd,
        momentum=0.9,
        nesterov=True,
        ns=muonfn.NewtonSchulz("keller", dtype=ns_dtype),
        scale=adjust_lr_fn or "original",
        **kw,
    )
    return optimizer, tx


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_muon_matches_torch_with_the_same_newton_schulz(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, adjust_lr_fn: str | None, device: torch.device
) -> None:
    """torch's own Muon step with its bf16 Newton–Schulz swapped for ours in ``dtype``: the
    trajectories agree to rounding, so NS precision is the only difference (next test)."""

    def our_ns(grad: torch.Tensor, coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
        return newton_schulz(grad, [coefficients], steps=steps, eps=eps, dtype=dtype)

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", our_ns)
    model = mlp(2, (6, 16, 24, 3), bias=False).to(device, dtype)
    optimizer, tx = muon_pair(model, adjust_lr_fn, dtype)
    tol = 1e-12 if dtype == torch.float64 else 3e-6
    assert run_both(model, optimizer, tx, steps=20) <= tol


def test_muon_matches_torch_bf16_newton_schulz(device: torch.device) -> None:
    """torch casts to bf16 before normalising, we normalise in fp32 and then cast: on the same
    gradients the trajectories agree to bf16 accuracy (a few % of the distance travelled)."""
    model = mlp(3, (6, 16, 24, 3), bias=False).to(device)
    optimizer, tx = muon_pair(model, None, torch.bfloat16)
    params = TensorDict.from_module(model).detach().clone()
    start = params.clone()
    state = tx.init(params)
    for t in range(20):
        grads = random_like(params, seed=t).to(device)
        for (name, p), g in zip(model.named_parameters(), grads.values(True, True)):
            assert tuple(name.split(".")) in grads.keys(True, True)
            p.grad = g.clone()
        optimizer.step()
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
    theirs = TensorDict.from_module(model).detach()
    for key in params.keys(True, True):
        travelled = (theirs[key] - start[key]).norm()
        assert (params[key] - theirs[key]).norm() / travelled < 0.05


@pytest.mark.parametrize("shape", [(16, 8), (24, 64), (64, 256)])
def test_bf16_newton_schulz_against_torchs(shape: tuple[int, int], device: torch.device) -> None:
    g = gaussian(*shape, seed=7).to(device)
    theirs = torch_muon._zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    ours = newton_schulz(g, "keller", dtype=torch.bfloat16)
    exact = newton_schulz(g.double(), "keller")
    assert rel_err(ours, theirs) < 0.05
    assert rel_err(ours, exact) < 0.03 and rel_err(theirs, exact) < 0.03


@pytest.mark.parametrize("rule", ["float32", "bfloat16"])
def test_muon_matrix_update_formula(monkeypatch, rule: str) -> None:
    """−lr·s(A, B)·NS(u) − lr·wd·p with u the Nesterov EMA, for a matrix; AdamW for the rest. With
    the bf16 rule forced, to the bf16 iteration's rounding."""
    monkeypatch.setenv("MUONFN_CPU_NS_DTYPE", rule)
    params = TensorDict({"w": gaussian(12, 20, seed=1), "b": gaussian(12, seed=2)}, batch_size=[])
    lr, wd, mu = 0.03, 0.2, 0.9
    tx = muonfn.muon(lr=lr, weight_decay=wd, momentum=mu, scale=("match_rms_adamw", 1.5))
    g1, g2 = random_like(params, 3), random_like(params, 4)
    state = tx.init(params)
    _, state = tx.update(g1, state, params)
    updates, state = tx.update(g2, state, params)
    buf = (1 - mu) * (mu * g1["w"] + g2["w"])
    u = (1 - mu) * g2["w"] + mu * buf
    orthogonalized = -lr * 1.5 * 0.2 * math.sqrt(20) * newton_schulz(u)
    expected = orthogonalized - lr * wd * params["w"]
    # the preset's momentum rounds apart from this formula's, and the iteration's dtype carries that on
    iteration = iteration_dtype((12, 20))
    assert iteration == getattr(torch, rule)
    assert_close_to_iteration(updates["w"], expected, iteration, rtol=1e-5, atol=1e-7, produced=orthogonalized)
    assert state["adamw", "step", "b"] == 2


class RecordingOrthogonalizer:
    """A GPU's form of the local orthogonalizer (asked for on the CPU), recording for each call whether it
    was told its input is the step's own temporary and whether a result took an input's memory;
    ``overwrite_input=False`` to every call with ``forbid``."""

    def __init__(self, *, forbid: bool = False) -> None:
        self.inner = muonfn.LocalOrthogonalizer(gpu_form=True)
        self.forbid = forbid
        self.calls: list[tuple[bool, bool]] = []

    def __call__(self, names, tensors, views, ns, scale, *, overwrite_input=False):
        overwrite_input = overwrite_input and not self.forbid
        addresses = {t.untyped_storage().data_ptr() for t in tensors}
        out = self.inner(names, tensors, views, ns, scale, overwrite_input=overwrite_input)
        self.calls.append((overwrite_input, any(o.untyped_storage().data_ptr() in addresses for o in out)))
        return out


@pytest.mark.parametrize("preset", [muonfn.muon, muonfn.normuon])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize(("nesterov", "corrected"), [(True, False), (False, False), ("add", False), (False, True)])
def test_newton_schulz_writes_its_results_only_over_the_momentums_own_look_ahead(
    nesterov: object, corrected: bool, donate: bool, preset
) -> None:
    """A GPU's form (asked for on the CPU) lets Newton–Schulz store a wide matrix's result in the
    memory of the update the momentum hands it when that update is the step's own (the look-ahead,
    its sum, the corrected momentum), never in the momentum itself (``nesterov=False``): the state
    and the gradients hold what they held, and the update is the same bits with the stores forbidden."""
    params = TensorDict({"w": gaussian(12, 20, seed=71), "t": gaussian(20, 12, seed=72)}, batch_size=[])
    grads = random_like(params, 73)
    options = {"nesterov": nesterov, "momentum_bias_correction": corrected}
    options["ns"] = muonfn.NewtonSchulz(dtype=torch.bfloat16)
    fresh = nesterov is not False or corrected
    results = {}
    for forbid in (False, True):
        orthogonalizer = RecordingOrthogonalizer(forbid=forbid)
        tx = preset(lr=0.02, weight_decay=0.1, donate_state=donate, orthogonalizer=orthogonalizer, **options)
        state = tx.init(params)
        _, state = tx.update(grads, state, params)  # (a momentum to keep)
        before, given = state.clone(), grads.clone()
        updates, state = tx.update(given, state, params)
        for key in ("w", "t"):
            expected = before["muon", "momentum", key].lerp(grads[key], 1 - 0.95)
            assert torch.equal(state["muon", "momentum", key], expected)
        assert torch.equal(given["w"], grads["w"]) and torch.equal(given["t"], grads["t"])
        # told so only for the momentum's own tensors, and then the wide result took the input's memory
        assert orthogonalizer.calls == [(fresh and not forbid, fresh and not forbid)] * 2
        results[forbid] = updates
    for key in ("w", "t"):
        assert torch.equal(results[True][key], results[False][key])


def test_zero_gradient_gives_only_the_decay(device: torch.device) -> None:
    params = TensorDict({"w": gaussian(6, 9, seed=1), "e": gaussian(2, 6, 9, seed=2)}, batch_size=[]).to(device)
    tx = muonfn.muon(lr=0.1, weight_decay=0.5, views={"e": MatrixView(batch_dims=1)})
    for dtype in (torch.float32, torch.bfloat16):
        p = params.to(dtype)
        updates, state = tx.update(p.apply(torch.zeros_like), tx.init(p), p)
        for key in ("w", "e"):
            # Newton–Schulz of zero is zero; the decay is one multiply-add of -ηλ·p
            assert torch.equal(updates[key], torch.add(torch.zeros_like(p[key]), p[key], alpha=-0.1 * 0.5))
            assert torch.equal(state["muon", "momentum", key], torch.zeros_like(p[key]))


def test_adamw_settings_default_to_the_muon_ones(device: torch.device) -> None:
    params = TensorDict({"w": gaussian(4, 4, seed=1), "b": gaussian(4, seed=2)}, batch_size=[]).to(device)
    grads = random_like(params, 5).to(device)

    def adamw_part(tx: muonfn.Transform) -> torch.Tensor:
        return tx.update(grads, tx.init(params), params)[0]["b"]

    b_only = params.select("b")
    same = muonfn.adamw(lr=0.3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.4)
    assert torch.equal(
        adamw_part(muonfn.muon(lr=0.3, weight_decay=0.4)),
        same.update(grads.select("b"), same.init(b_only), b_only)[0]["b"],
    )
    other = muonfn.adamw(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0)
    got = adamw_part(
        muonfn.muon(
            lr=0.3, weight_decay=0.4, adamw_lr=0.01, adamw_betas=(0.8, 0.9), adamw_eps=1e-6, adamw_weight_decay=0.0
        )
    )
    assert torch.equal(got, other.update(grads.select("b"), other.init(b_only), b_only)[0]["b"])


# --- labels, views and state layout -----------------------------------------------------------------------


class Conv1D(torch.nn.Module):
    """Hugging Face's Conv1D: a linear layer whose weight is stored (in, out)."""

    def __init__(self, n_out: int, n_in: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out))
        self.bias = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 8)
        self.wpe = torch.nn.Parameter(torch.randn(5, 8))
        self.conv = torch.nn.Conv1d(8, 8, 3, padding=1)
        self.attn = Conv1D(24, 8)
        self.mlp = torch.nn.Linear(24, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lora_A = torch.nn.Parameter(torch.randn(2, 8))
        self.lm_head = torch.nn.Linear(8, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens) + self.wpe[: tokens.shape[-1]]
        h = h + self.conv(h.mT).mT
        h = self.norm(h + self.mlp(self.attn(h)) + (h @ self.lora_A.T).sum(-1, keepdim=True))
        return self.lm_head(h)


EXPECTED_LABELS = {
    "embed_tokens.weight": "adamw",
    "wpe": "adamw",
    "conv.weight": "muon",
    "conv.bias": "adamw",
    "attn.weight": "muon",
    "attn.bias": "adamw",
    "mlp.weight": "muon",
    "mlp.bias": "adamw",
    "norm.weight": "adamw",
    "norm.bias": "adamw",
    "lora_A": "adamw",
    "lm_head.weight": "adamw",
}


def test_default_labels_by_shape_and_name() -> None:
    params = TensorDict.from_module(TinyLM()).detach()
    assert muonfn.label_params(params) == EXPECTED_LABELS
    assert muonfn.label_params(params, exclude=())["lm_head.weight"] == "muon"


def test_labels_from_module_by_type() -> None:
    model = TinyLM()
    labels = muonfn.labels_from_module(model)
    assert labels == {**EXPECTED_LABELS, "wpe": "adamw", "lora_A": "adamw"}
    model.lm_head.weight = model.embed_tokens.weight  # tied: one name, as named_parameters() lists it
    tied = muonfn.labels_from_module(model)
    assert list(tied) == [name for name, _ in model.named_parameters()]
    assert tied["embed_tokens.weight"] == "adamw" and "lm_head.weight" not in tied
    state = muonfn.muon(labels=tied).init(TensorDict.from_module(model).detach().exclude(("lm_head", "weight")))
    assert ("adamw", "exp_avg", "embed_tokens.weight") in state.keys(True, True)
    assert muonfn.views_from_module(model) == {"attn.weight": MatrixView(transposed=True)}


def test_multihead_attention_projections_are_muon_matrices_split_into_q_k_v() -> None:
    """``nn.MultiheadAttention``'s fused ``in_proj_weight`` is three ``(E, E)`` projections: labelled
    Muon by type, and declared split by rows, so that it is orthogonalized as q, k and v apart;
    separate projections (``kdim``/``vdim``) are Muon matrices each."""
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32), 2, enable_nested_tensor=False)
    labels = muonfn.labels_from_module(model, last_linear_is_head=False)
    assert {name for name, label in labels.items() if label == "muon"} == {
        f"layers.{i}.{name}"
        for i in range(2)
        for name in ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight")
    }
    views = muonfn.views_from_module(model)
    assert views == {f"layers.{i}.self_attn.in_proj_weight": MatrixView(split=(16, 16, 16)) for i in range(2)}
    w = model.layers[0].self_attn.in_proj_weight.detach()
    tx = muonfn.orthogonalize(views={"w": views["layers.0.self_attn.in_proj_weight"]}, scale="match_rms_adamw")
    fused = tx.update(TensorDict({"w": w}, []), TensorDict())[0]["w"]
    parts = muonfn.orthogonalize(scale="match_rms_adamw")
    q, k, v = (parts.update(TensorDict({"m": block}, []), TensorDict())[0]["m"] for block in w.split(16))
    assert torch.equal(fused, torch.cat([q, k, v]))
    apart = torch.nn.MultiheadAttention(16, 4, kdim=8, vdim=12)
    assert muonfn.labels_from_module(apart, last_linear_is_head=False) == {
        "q_proj_weight": "muon",
        "k_proj_weight": "muon",
        "v_proj_weight": "muon",
        "in_proj_bias": "adamw",
        "out_proj.weight": "muon",
        "out_proj.bias": "adamw",
    }
    assert muonfn.views_from_module(apart) == {}


def test_muon_state_layout_and_a_step_on_a_language_model() -> None:
    model = TinyLM()
    params = TensorDict.from_module(model).detach()
    tx = muonfn.muon(lr=0.02, labels=muonfn.labels_from_module(model), views=muonfn.views_from_module(model))
    state = tx.init(params)
    muon_keys = {k for k, v in EXPECTED_LABELS.items() if v == "muon"}
    assert {k[2] for k in state.keys(True, True) if k[0] == "muon"} == muon_keys
    assert {k[:2] for k in state.keys(True, True)} == {
        ("muon", "momentum"),
        ("adamw", "step"),
        ("adamw", "exp_avg"),
        ("adamw", "exp_avg_sq"),
    }
    assert state["muon", "momentum", "attn.weight"].shape == (8, 24)
    tokens = torch.randint(0, 11, (4, 5))

    def loss(p: TensorDict) -> torch.Tensor:
        with p.to_module(model):
            return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    updates, state = tx.update(torch.func.grad(loss)(params), state, params)
    # the transposed Conv1D weight gets the (out, in) = (24, 8) update: scale 0.2·√24, singular values ≈ s·p(σ)
    sv = torch.linalg.svdvals(updates["attn", "weight"] + 0.02 * 0.1 * params["attn", "weight"])
    assert sv.max() <= 0.02 * 0.2 * math.sqrt(24) * 1.14


# --- default labels on small stand-ins of common models: heads and token parameters go to AdamW -------------


class VisionTransformer(torch.nn.Module):
    """timm's ViT names: cls_token, pos_embed, patch_embed.proj (an input embedding, by name), blocks.*.attn.qkv/proj,
    mlp.fc1/fc2, head."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, 5, dim))
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = torch.nn.Conv2d(3, dim, 2, stride=2)
        block = torch.nn.Module()
        block.norm1 = torch.nn.LayerNorm(dim)
        block.attn = torch.nn.Module()
        block.attn.qkv = torch.nn.Linear(dim, 3 * dim)
        block.attn.proj = torch.nn.Linear(dim, dim)
        block.mlp = torch.nn.Module()
        block.mlp.fc1 = torch.nn.Linear(dim, 4 * dim)
        block.mlp.fc2 = torch.nn.Linear(4 * dim, dim)
        self.blocks = torch.nn.Sequential(block)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, 10)


class MaskedAutoencoder(torch.nn.Module):
    """MAE/BEiT/Swin names: mask_token, a 2-D relative_position_bias_table, decoder_pred."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.mask_token = torch.nn.Parameter(torch.zeros(1, 1, dim))
        self.attn = torch.nn.Module()
        self.attn.relative_position_bias_table = torch.nn.Parameter(torch.zeros(9, 2))
        self.attn.qkv = torch.nn.Linear(dim, 3 * dim)
        self.decoder_pred = torch.nn.Linear(dim, 12)


class SequenceClassifier(torch.nn.Module):
    """Hugging Face BERT names: embeddings.*, encoder.layer.*.attention.self.query, pooler.dense, classifier."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.bert = torch.nn.Module()
        self.bert.embeddings = torch.nn.Module()
        self.bert.embeddings.word_embeddings = torch.nn.Embedding(20, dim)
        layer = torch.nn.Module()
        layer.query = torch.nn.Linear(dim, dim)
        layer.intermediate = torch.nn.Linear(dim, 2 * dim)
        self.bert.encoder = torch.nn.ModuleList([layer])
        self.bert.pooler = torch.nn.Linear(dim, dim)
        self.classifier = torch.nn.Linear(dim, 3)


class ResNet(torch.nn.Module):
    """torchvision's ResNet names: conv1, bn1, layer1.0.conv1, fc (a name no rule can tell from a hidden layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.layer1 = torch.nn.Sequential(torch.nn.Sequential())
        self.layer1[0].add_module("conv1", torch.nn.Conv2d(4, 4, 3))
        self.fc = torch.nn.Linear(4, 10)


class GPT2(torch.nn.Module):
    """Hugging Face GPT-2: Conv1D blocks (c_attn, c_proj, c_fc) and an lm_head tied to wte."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.transformer = torch.nn.Module()
        self.transformer.wte = torch.nn.Embedding(20, dim)
        self.transformer.wpe = torch.nn.Embedding(6, dim)
        block = torch.nn.Module()
        block.attn = torch.nn.Module()
        block.attn.c_attn = Conv1D(3 * dim, dim)
        block.attn.c_proj = Conv1D(dim, dim)
        block.mlp = torch.nn.Module()
        block.mlp.c_fc = Conv1D(4 * dim, dim)
        block.mlp.c_proj = Conv1D(dim, 4 * dim)
        self.transformer.h = torch.nn.ModuleList([block])
        self.lm_head = torch.nn.Linear(dim, 20, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


class T5(torch.nn.Module):
    """Hugging Face T5/LongT5: the token embedding is ``shared`` (an ``nn.Embedding``) at the top, the
    encoder's ``embed_tokens`` and the ``lm_head`` tied to it; attention ``q``/``k``/``v``/``o``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.shared = torch.nn.Embedding(20, dim)
        self.encoder = torch.nn.Module()
        self.encoder.embed_tokens = self.shared
        attention = torch.nn.Module()
        for name in ("q", "k", "v", "o"):
            attention.add_module(name, torch.nn.Linear(dim, dim, bias=False))
        attention.relative_attention_bias = torch.nn.Embedding(4, 2)
        self.encoder.block = torch.nn.ModuleList([torch.nn.Module()])
        self.encoder.block[0].SelfAttention = attention
        self.encoder.final_layer_norm = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, 20, bias=False)
        self.lm_head.weight = self.shared.weight


class Bart(torch.nn.Module):
    """Hugging Face BART/mBART/Pegasus/Marian: ``model.shared``, tied to ``model.encoder.embed_tokens``
    and the ``lm_head``; ``embed_positions``; ``self_attn.q_proj`` ... ``fc1``/``fc2``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.shared = torch.nn.Embedding(20, dim)
        self.model.encoder = torch.nn.Module()
        self.model.encoder.embed_tokens = self.model.shared
        self.model.encoder.embed_positions = torch.nn.Embedding(10, dim)
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            layer.self_attn.add_module(name, torch.nn.Linear(dim, dim))
        layer.fc1, layer.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.model.encoder.layers = torch.nn.ModuleList([layer])
        self.lm_head = torch.nn.Linear(dim, 20, bias=False)
        self.lm_head.weight = self.model.shared.weight


class SharedExpertsMoE(torch.nn.Module):
    """DeepSeek's ``mlp.shared_experts`` and Qwen-MoE's ``mlp.shared_expert``: hidden matrices whose
    names hold ``shared`` but not as a whole component."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(20, dim)
        mlp = torch.nn.Module()
        for shared in ("shared_experts", "shared_expert"):
            expert = torch.nn.Module()
            expert.gate_proj, expert.up_proj = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(dim, 2 * dim)
            expert.down_proj = torch.nn.Linear(2 * dim, dim)
            mlp.add_module(shared, expert)
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = mlp
        self.lm_head = torch.nn.Linear(dim, 20, bias=False)


def muon_names(labels: dict[str, str]) -> set[str]:
    return {name for name, label in labels.items() if label == "muon"}


HIDDEN = {
    VisionTransformer: {
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc1.weight",
        "blocks.0.mlp.fc2.weight",
    },
    MaskedAutoencoder: {"attn.qkv.weight"},
    SequenceClassifier: {"bert.encoder.0.query.weight", "bert.encoder.0.intermediate.weight", "bert.pooler.weight"},
    ResNet: {"conv1.weight", "layer1.0.conv1.weight"},
    GPT2: {
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
    },
    T5: {f"encoder.block.0.SelfAttention.{name}.weight" for name in ("q", "k", "v", "o")},
    Bart: {
        f"model.encoder.layers.0.{name}.weight"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2")
    },
    SharedExpertsMoE: {
        f"model.layers.0.mlp.{shared}.{name}.weight"
        for shared in ("shared_experts", "shared_expert")
        for name in ("gate_proj", "up_proj", "down_proj")
    },
}


@pytest.mark.parametrize("model_type", list(HIDDEN), ids=lambda t: t.__name__)
def test_labels_from_module_send_heads_and_tokens_to_adamw(model_type: type[torch.nn.Module]) -> None:
    model = model_type()
    labels = muonfn.labels_from_module(model)
    assert list(labels) == [name for name, _ in model.named_parameters()]
    assert muon_names(labels) == HIDDEN[model_type]


@pytest.mark.parametrize("model_type", list(HIDDEN), ids=lambda t: t.__name__)
def test_label_params_send_heads_and_tokens_to_adamw(model_type: type[torch.nn.Module]) -> None:
    model = model_type()
    params = TensorDict(dict(model.named_parameters()), []).unflatten_keys(".").detach()
    expected = HIDDEN[model_type]
    if model_type is MaskedAutoencoder:
        expected = expected | {"decoder_pred.weight"}  # a head by name only to labels_from_module (the last Linear)
    if model_type is ResNet:
        expected = expected | {"fc.weight"}  # `fc` is also a hidden-layer name: labels_from_module tells
    assert muon_names(muonfn.label_params(params)) == expected


def test_label_rules_keep_hidden_layers_on_muon() -> None:
    decoder = torch.nn.TransformerDecoderLayer(8, 2, dim_feedforward=16)
    params = TensorDict(dict(decoder.named_parameters()), []).unflatten_keys(".").detach()
    matrices = {
        "self_attn.in_proj_weight",
        "self_attn.out_proj.weight",
        "multihead_attn.in_proj_weight",  # "head" but not "head.": cross-attention is a hidden layer
        "multihead_attn.out_proj.weight",
        "linear1.weight",
        "linear2.weight",
    }
    assert muon_names(muonfn.label_params(params)) == matrices
    trunk = muonfn.labels_from_module(decoder, last_linear_is_head=False)  # a trunk: its last Linear is hidden
    assert muon_names(trunk) == matrices  # the attention projections are matrices by type too
    assert muonfn.labels_from_module(decoder)["linear2.weight"] == "adamw"


def test_unit_dimensions_do_not_make_a_matrix() -> None:
    params = TensorDict(
        {
            "token": torch.zeros(1, 1, 8),
            "column": torch.zeros(8, 1),
            "row": torch.zeros(1, 8),
            "kernel": torch.zeros(4, 1, 3),  # a depthwise conv: (4, 3) once flattened
            "empty": torch.zeros(0, 5),
        },
        [],
    )
    labels = muonfn.label_params(params)
    assert labels == {"token": "adamw", "column": "adamw", "row": "adamw", "kernel": "muon", "empty": "muon"}
    # a rank's one-row block of a sharded matrix: its size says nothing of the whole
    assert muonfn.label_params(params, shards=["row"])["row"] == "muon"


# ---------------------------------------------------------------------------- the Newton–Schulz setting


def by_hand(preset, ns) -> muonfn.Transform:
    """A preset's matrix branch at its defaults (lr=0.02, weight_decay=0.1), chained from the building blocks."""
    if preset is muonfn.muon:
        return muonfn.chain(muonfn.ema_momentum(0.95), muonfn.descent(0.02, 0.1, ns=ns, overwrite_input=True))
    if preset is muonfn.normuon:
        head = [muonfn.ema_momentum(0.95), muonfn.orthogonalize(ns, overwrite_input=True)]
        adapt = muonfn.scale_by_neuron_norm(0.95, eps=1e-10, rescale="orthogonal")
    else:
        head = [
            muonfn.ema_momentum(0.9, nesterov=False),
            muonfn.scale_by_sign(),
            muonfn.orthogonalize(ns, overwrite_input=True),
        ]
        adapt = muonfn.scale_by_element_rms(0.95, eps=1e-10, rescale="orthogonal")
    return muonfn.chain(*head, adapt, muonfn.descent(0.02, 0.1))


@pytest.mark.parametrize("preset", [muonfn.muon, muonfn.normuon, muonfn.adamuon])
def test_the_newton_schulz_setting_reaches_each_preset_as_its_building_blocks_take_it(preset) -> None:
    """``ns=NewtonSchulz(...)``, every field set apart from its default, is the map of the preset's
    matrix branch: the same bits as the building blocks given it, and not the default map's."""
    gen = torch.Generator().manual_seed(0)
    params = TensorDict({"w": torch.randn(6, 10, generator=gen), "v": torch.randn(10, 6, generator=gen)}, [])
    grads = TensorDict({k: torch.randn(p.shape, generator=gen) for k, p in params.items()}, [])
    ns = muonfn.NewtonSchulz("cesista", steps=4, eps=1e-6, dtype=torch.float64, eps_mode="add")
    whole, default, parts = preset(lr=0.02, ns=ns), preset(lr=0.02), by_hand(preset, ns)
    got, _ = whole.update(grads, whole.init(params), params)
    expected, _ = parts.update(grads, parts.init(params), params)
    otherwise, _ = default.update(grads, default.init(params), params)
    for key in ("w", "v"):
        assert torch.equal(got[key], expected[key]), key
        assert not torch.equal(got[key], otherwise[key]), key


def test_a_map_given_as_ns_is_the_method_it_replaces() -> None:
    params = TensorDict({"w": torch.randn(6, 10, dtype=torch.float64)}, [])
    grads = TensorDict({"w": torch.randn(6, 10, dtype=torch.float64)}, [])
    by_name = muonfn.muon(lr=0.02, ns="svd")
    by_value = muonfn.muon(lr=0.02, ns=muonfn.polar)
    expected, _ = by_name.update(grads, by_name.init(params), params)
    got, _ = by_value.update(grads, by_value.init(params), params)
    assert torch.equal(got["w"], expected["w"])


@pytest.mark.parametrize(
    ("build", "keyword"),
    [
        (lambda: muonfn.muon(ns_steps=3), "ns_steps"),
        (lambda: muonfn.normuon(ns_dtype=torch.float32), "ns_dtype"),
        (lambda: muonfn.adamuon(ns_method="gram"), "ns_method"),
        (lambda: muonfn.scale_by_muon(ns_coefficients="cesista"), "ns_coefficients"),
        (lambda: muonfn.orthogonalize(steps=2), "steps"),
    ],
    ids=["muon", "normuon", "adamuon", "scale_by_muon", "orthogonalize"],
)
def test_a_flat_newton_schulz_spelling_is_refused_naming_it(build, keyword) -> None:
    """One spelling: the Newton–Schulz settings travel as ``ns=NewtonSchulz(...)``; 0.1.0's flat
    keywords are no longer taken, and the error names the one given."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        build()


def test_ns_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"ns must be a muonfn\.NewtonSchulz"):
        muonfn.muon(ns="keller")


def test_a_newton_schulz_setting_resolves_its_schedule_once() -> None:
    ns = muonfn.NewtonSchulz("polar_express", steps=10)
    assert ns.schedule is ns.schedule
    assert len(ns.schedule.triples) == 10 and ns.schedule.norm_factor == 1.01
    assert ns == muonfn.NewtonSchulz("polar_express", steps=10)  # the resolved schedule is no part of its identity


class CountingOrthogonalizer(muonfn.LocalOrthogonalizer):
    calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)


#: for each keyword of the presets, a value other than its default (one that acts on the leaves below)
OTHER_VALUES = {
    "lr": 0.5,
    "momentum": 0.5,
    "nesterov": "add",
    "momentum_bias_correction": True,
    "weight_decay": 0.5,
    "cautious_weight_decay": True,
    "cautious_mode": "heavyball",
    "ns": "svd",
    "scale": ("original", 2.0),
    "adamw_lr": 0.5,
    "adamw_betas": (0.5, 0.6),
    "adamw_eps": 1e-2,
    "adamw_weight_decay": 0.5,
    "adamw_nesterov": True,
    "labels": {"w": "adamw", "e": "muon", "b": "adamw"},
    "views": {"e": MatrixView(batch_dims=1)},
    "weight_decay_mask": {"w": False},
    "orthogonalizer": CountingOrthogonalizer,
    "state_dtype": torch.bfloat16,
    "donate_state": True,
    "beta2": 0.5,
    "adaptive_eps": 1e-2,
    "rescale": "none",
    "sign_momentum": False,
    "second_moment_bias_correction": True,
}


def two_steps(tx: muonfn.Transform, params: TensorDict) -> tuple[list[TensorDict], TensorDict, TensorDict]:
    """Both steps' updates, the state given to the second and the state it returned."""
    state, out = tx.init(params), []
    for seed in (1, 2):
        given = state
        updates, state = tx.update(random_like(params, seed), given, params)
        out.append(updates)
    return out, given, state


@pytest.mark.parametrize("keyword", list(OTHER_VALUES))
@pytest.mark.parametrize("preset", [muonfn.muon, muonfn.normuon, muonfn.adamuon])
def test_every_keyword_of_a_preset_reaches_its_branches(preset, keyword) -> None:
    """A keyword the preset does not forward would be silently ignored: each one given another value
    changes the updates, the state, or (an orthogonalizer, donation) what runs; and every keyword of
    the presets is in the table."""
    import inspect

    keywords = {name for p in (muonfn.muon, muonfn.normuon, muonfn.adamuon) for name in inspect.signature(p).parameters}
    assert keywords - {"options"} == set(OTHER_VALUES)
    if keyword not in inspect.signature(preset).parameters and keyword in muonfn.presets.VARIANT_OPTIONS:
        pytest.skip(f"{preset.__name__} does not take {keyword}")
    params = TensorDict({"w": gaussian(6, 10, seed=1), "e": gaussian(2, 4, 6, seed=2), "b": gaussian(6, seed=3)}, [])
    value = OTHER_VALUES[keyword]
    value = value() if isinstance(value, type) else value
    default = {"lr": 0.1}
    given_value = {**default, keyword: value}
    updates, given, state = two_steps(preset(**default), params)
    other_updates, other_given, other_state = two_steps(preset(**given_value), params)
    if keyword == "orthogonalizer":
        assert value.calls == 2
    elif keyword == "donate_state":  # the state given to a step is the one it wrote, in place
        assert (other_given == other_state).all()
        assert not (given == state).all()
    else:
        changed = [not (a == b).all() for a, b in zip(updates, other_updates)]
        layouts = (set(preset(**default).init(params).keys(True, True)), set(other_state.keys(True, True)))
        assert any(changed) or layouts[0] != layouts[1]


@pytest.mark.parametrize("preset", [muonfn.muon, muonfn.normuon, muonfn.adamuon])
@pytest.mark.parametrize("cautious", [False, True])
def test_a_donated_preset_without_params_refuses_before_writing_its_state(preset, cautious: bool):
    """The weight decay needs the params: a donated preset updated without them raises before either branch
    writes its state in place (the matrix branch's momentum was stepped, then its decay raised)."""
    params = TensorDict({"w": torch.randn(4, 3), "b": torch.randn(3)}, [])
    tx = preset(lr=0.02, weight_decay=0.1, cautious_weight_decay=cautious, donate_state=True)
    state = tx.init(params)
    before = state.clone()
    with pytest.raises(ValueError, match=r"needs params: call update\(grads, state, params\)"):
        tx.update(params.apply(torch.ones_like), state)
    assert all(torch.equal(state[k], before[k]) for k in before.keys(True, True))
