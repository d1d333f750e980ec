"""Which parameters go to Muon, what muonfn says when Muon is left nothing to train or routes
without names, and the learning-rate story the docs tell: one rate for both groups, loops that
set the rates themselves, decaying matrices only."""

from __future__ import annotations

import functools
import math
import pathlib
import re
import warnings

import pytest
import torch
from tensordict import TensorDict
from test_presets import GPT2, HIDDEN, T5, Bart, SharedExpertsMoE
from torch import nn

import muonfn
from muonfn.optim import Muon

ROOT = pathlib.Path(__file__).resolve().parents[1]


def names_of(opt: Muon, use_muon: bool) -> set[str]:
    return {name for group in opt.param_groups if group["use_muon"] is use_muon for name in group["param_names"]}


@pytest.fixture
def routing_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", muonfn.RoutingWarning)
        yield


# ------------------------------------------------------------- encoder–decoder token embeddings


@pytest.mark.parametrize("model_type", [T5, Bart, SharedExpertsMoE], ids=lambda t: t.__name__)
def test_the_shim_sends_encoder_decoder_token_embeddings_to_adamw(model_type, routing_warnings_are_errors):
    """T5's ``shared.weight`` and BART's ``model.shared.weight`` are token embeddings (and the tied
    head): AdamW; MoE ``shared_experts``/``shared_expert`` matrices stay on Muon."""
    model = model_type()
    opt = Muon(model.named_parameters())
    assert names_of(opt, True) == HIDDEN[model_type]
    shared = {name for name, _ in model.named_parameters() if name.endswith("shared.weight")}
    assert shared <= names_of(opt, False)
    assert muonfn.labels_from_module(model) == muonfn.label_params(
        TensorDict(dict(model.named_parameters()), []).unflatten_keys(".").detach()
    )


def hf_encoder_decoders():
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    sizes = {"vocab_size": 32, "d_model": 16, "max_position_embeddings": 16}
    bart_like = {
        **sizes,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "decoder_ffn_dim": 32,
    }
    t5_like = {"vocab_size": 32, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 1, "num_heads": 2}
    return {
        "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(**t5_like)),
        "longt5": lambda: transformers.LongT5ForConditionalGeneration(transformers.LongT5Config(**t5_like)),
        "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(**bart_like)),
        "mbart": lambda: transformers.MBartForConditionalGeneration(transformers.MBartConfig(**bart_like)),
        "pegasus": lambda: transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(**bart_like)),
        "marian": lambda: transformers.MarianMTModel(
            transformers.MarianConfig(**bart_like, decoder_start_token_id=0, pad_token_id=0)
        ),
    }


@pytest.mark.parametrize("arch", ["t5", "longt5", "bart", "mbart", "pegasus", "marian"])
def test_hugging_face_encoder_decoders_route_their_shared_embedding_to_adamw(arch, routing_warnings_are_errors):
    """Tiny randomly initialised models of transformers (no download): the shim's default labels send
    the shared token embedding to AdamW, and the Muon group is what labels_from_module makes it by type."""
    torch.manual_seed(0)
    model = hf_encoder_decoders()[arch]()
    shared = "shared.weight" if arch in ("t5", "longt5") else "model.shared.weight"
    assert shared in dict(model.named_parameters())
    opt = Muon(model.named_parameters())
    assert shared in names_of(opt, False)
    by_type = muonfn.labels_from_module(model)
    assert by_type[shared] == "adamw"
    assert names_of(opt, True) == {name for name, label in by_type.items() if label == "muon"}


# ------------------------------------------------------------------ routing without names


def test_named_parameters_do_not_warn(routing_warnings_are_errors):
    model = GPT2()
    Muon(model.named_parameters())
    Muon(model.named_parameters(), labels=muonfn.labels_from_module(model))
    params = TensorDict.from_module(model).detach().exclude(("lm_head", "weight"))  # tied to wte
    muonfn.muon().init(params)
    muonfn.normuon().init(params)
    # nothing that could be Muon's: no warning either
    muonfn.muon().init(TensorDict({"bias": torch.zeros(3), "scale": torch.ones(1, 4)}, []))
    Muon([("bias", nn.Parameter(torch.zeros(3)))])


def test_parameters_without_names_warn_once_at_the_users_line():
    """``Muon(model.parameters())``: GPT-2's wte, wpe and tied head go to Muon by shape; one warning,
    pointed at the line that built the optimizer, naming the remedies."""
    model = GPT2()
    with pytest.warns(muonfn.RoutingWarning) as record:
        opt = Muon(model.parameters())
    assert len(record) == 1 and record[0].filename == __file__
    message = str(record[0].message)
    for remedy in ("named_parameters()", "labels_from_module", "'use_muon'", "labels= keyed by position"):
        assert remedy in message
    assert model.transformer.wte.weight in opt.param_groups[0]["params"]  # what the warning is about

    # Hugging Face Trainer's optimizer_cls_and_kwargs: two unnamed groups split by labels, one warning
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    with pytest.warns(muonfn.RoutingWarning) as record:
        Muon([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    assert len(record) == 1 and record[0].filename == __file__


def test_parameters_without_names_routed_by_hand_do_not_warn(routing_warnings_are_errors):
    model = GPT2()
    hidden = [p for name, p in model.named_parameters() if name in HIDDEN[GPT2]]
    rest = [p for name, p in model.named_parameters() if name not in HIDDEN[GPT2]]
    Muon([{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}])
    positions = {
        str(i): "muon" if p.ndim == 2 and p is not model.transformer.wte.weight else "adamw"
        for i, p in enumerate(model.parameters())
    }
    Muon(model.parameters(), labels=positions)
    Muon([p for p in model.parameters() if p.ndim == 1])  # vectors: nothing goes to Muon by shape


# ----------------------------------------------------------------------- LoRA: Muon left idle


class LoraLinear(nn.Module):
    """PEFT's ``lora.Linear`` names: ``base_layer``, ``lora_A.default``, ``lora_B.default`` (zero at first)."""

    def __init__(self, n_in: int, n_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base_layer = nn.Linear(n_in, n_out)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(n_in, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, n_out, bias=False)})
        nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class PeftModel(nn.Module):
    """``get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"]))``: every base weight frozen."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = inner = nn.Module()
        inner.embed_tokens = nn.Embedding(16, dim)
        inner.q_proj, inner.v_proj = LoraLinear(dim, dim), LoraLinear(dim, dim)
        inner.mlp = nn.Linear(dim, dim)
        inner.norm = nn.LayerNorm(dim)
        inner.lm_head = nn.Linear(dim, 16, bias=False)
        for name, p in self.named_parameters():
            p.requires_grad_("lora_" in name)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        m = self.base_model.model
        h = m.embed_tokens(tokens)
        h = h + torch.tanh(m.q_proj(h) * m.v_proj(h)) + m.mlp(h)
        return m.lm_head(m.norm(h))


ADAPTERS = {f"base_model.model.{p}_proj.lora_{m}.default.weight" for p in "qv" for m in "AB"}


def test_lora_with_frozen_base_weights_warns_that_the_run_is_plain_adamw():
    model = PeftModel()
    with pytest.warns(muonfn.RoutingWarning) as record:
        opt = Muon(model.named_parameters())
    assert len(record) == 1 and record[0].filename == __file__
    message = str(record[0].message)
    assert "plain AdamW" in message and "requires_grad=False" in message and "'lora_'" in message
    assert "labels=" in message
    assert not any(p.requires_grad for g in opt.param_groups if g["use_muon"] for p in g["params"])
    assert names_of(opt, False) >= ADAPTERS
    # only what trains, as PEFT scripts often pass: Muon is left empty, the same warning
    with pytest.warns(muonfn.RoutingWarning, match="none was routed to Muon") as record:
        Muon([(name, p) for name, p in model.named_parameters() if p.requires_grad])
    assert len(record) == 1 and record[0].filename == __file__


def test_the_functional_presets_warn_when_every_matrix_is_excluded_by_name():
    model = PeftModel()
    adapters = TensorDict({name: p.detach() for name, p in model.named_parameters() if p.requires_grad}, [])
    adapters = adapters.unflatten_keys(".")
    for preset in (muonfn.muon, muonfn.normuon, muonfn.adamuon):
        with pytest.warns(muonfn.RoutingWarning, match=r"no parameter is labelled 'muon'.*'lora_'") as record:
            preset().init(adapters)
        assert len(record) == 1 and record[0].filename == __file__


LORA_LABELS = 'functools.partial(muonfn.label_params, exclude=[f for f in muonfn.DEFAULT_EXCLUDE if f != "lora_"])'


def test_the_lora_recipe_runs_muon_on_the_adapters(routing_warnings_are_errors):
    """docs/shim.md's recipe: the adapters go to Muon, nothing warns, the adapters train and the
    frozen weights stay; lora_A's first gradient is zero (lora_B starts at zero), so its first
    update is its weight decay alone."""
    assert LORA_LABELS in (ROOT / "docs" / "shim.md").read_text()
    labels = eval(LORA_LABELS, {"functools": functools, "muonfn": muonfn})
    torch.manual_seed(0)
    model = PeftModel()
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    lr, weight_decay = 0.1, 0.1
    opt = Muon(trainable, lr=lr, weight_decay=weight_decay, labels=labels)
    assert names_of(opt, True) == ADAPTERS and names_of(opt, False) == set()
    lora_a = model.base_model.model.q_proj.lora_A["default"].weight
    a_before = lora_a.detach().clone()
    tokens = torch.randint(0, 16, (64,), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(30):
        loss = nn.functional.cross_entropy(model(tokens), tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            assert torch.equal(lora_a.detach(), a_before - lr * weight_decay * a_before)
    assert losses[-1] < 0.9 * losses[0]
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach(), frozen[name]), name
    params = TensorDict({name: p.detach() for name, p in trainable}, []).unflatten_keys(".")
    muonfn.muon(labels=labels).init(params)  # the functional API takes the same labels, without a warning


# ---------------------------------------------------------------------- the learning-rate story


def test_the_default_update_is_0_2_sqrt_128_times_torch_muons_default_on_a_square_matrix():
    """getting-started: at the same lr, the shim's default ``adjust_lr_fn="match_rms_adamw"`` (0.2·√max(A, B)
    = 2.26 at 128×128) against torch.optim.Muon's default ``adjust_lr_fn`` ("original": √max(1, A/B) = 1
    when square); the two Newton–Schulz iterations round apart (torch's runs in bf16), so to 1 %."""
    torch.manual_seed(0)
    weight, grad = torch.randn(128, 128), torch.randn(128, 128)

    def displacement(make) -> torch.Tensor:
        p = nn.Parameter(weight.clone())
        p.grad = grad.clone()
        make([p]).step()
        return p.detach() - weight

    theirs = displacement(lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.0))
    ours = displacement(lambda ps: Muon(ps, lr=0.02, weight_decay=0.0, labels={"0": "muon"}))
    original = displacement(
        lambda ps: Muon(ps, lr=0.02, weight_decay=0.0, labels={"0": "muon"}, adjust_lr_fn="original")
    )
    assert float(ours.norm() / theirs.norm()) == pytest.approx(0.2 * math.sqrt(128), rel=0.01)
    assert 0.2 * math.sqrt(128) == pytest.approx(2.26, abs=0.005)
    assert float(original.norm() / theirs.norm()) == pytest.approx(1.0, rel=0.01)


def python_block(page: str, marker: str) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"{page}: {len(blocks)} python blocks hold {marker!r}"
    return blocks[0]


def test_the_recipe_for_loops_that_set_one_rate_keeps_each_groups_own_rate():
    """getting-started's nanoGPT-style loop: each group follows the schedule from its own initial
    rate (Muon 0.02, AdamW 3e-4), and a LambdaLR of the same factor sets the same rates."""
    namespace: dict = {}
    exec(compile(python_block("docs/getting-started.md", "initial_lr"), "getting-started recipe", "exec"), namespace)
    optimizer, lr_factor, last = namespace["optimizer"], namespace["lr_factor"], namespace["max_iters"] - 1
    muon_group, adamw_group = optimizer.param_groups
    assert (muon_group["initial_lr"], adamw_group["initial_lr"]) == (0.02, 3e-4)
    assert muon_group["lr"] == 0.02 * lr_factor(last) and adamw_group["lr"] == 3e-4 * lr_factor(last)
    assert lr_factor(namespace["max_iters"]) == pytest.approx(0.1)  # nanoGPT's min_lr = learning_rate / 10

    model = namespace["model"]
    again = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4, adjust_lr_fn="original", labels=namespace["labels"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(again, lr_factor)
    for it in range(namespace["max_iters"]):
        expected = [group["initial_lr"] * lr_factor(it) for group in again.param_groups]
        assert [group["lr"] for group in again.param_groups] == pytest.approx(expected, rel=1e-12)
        again.step()
        scheduler.step()


#: calls that build an optimizer: the presets and the shim
CALL = re.compile(r"\b(?:muon|normuon|adamuon|Muon)\(((?:[^()]|\([^()]*\))*)\)")


def test_no_example_pairs_kellers_rate_with_the_default_scale():
    """``lr=0.02`` is Keller Jordan's rate for ``scale="original"``; with the default scale it is an
    AdamW rate of 0.02 for both groups. No snippet, docstring or example pairs them."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]
    files += (ROOT / "muonfn").rglob("*.py")
    offending = []
    for path in files:
        for call in CALL.finditer(path.read_text()):
            arguments = call[1]
            if re.search(r"\blr=(?:0\.02|2e-2)\b", arguments) and "original" not in arguments:
                offending.append(f"{path.relative_to(ROOT)}: {call[0]}")
    assert not offending, offending


def test_the_api_page_lists_the_default_exclusions():
    page = (ROOT / "docs" / "api" / "muonfn.md").read_text()
    listed = re.search(r"py:data:: muonfn.DEFAULT_EXCLUDE\n.*?:value: (\(.*?\))\n", page, re.S)
    assert listed is not None and eval(listed[1]) == muonfn.DEFAULT_EXCLUDE


# -------------------------------------------------------------------- decaying matrices only


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.hidden = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10)


DECAYED = {"embed.weight", "hidden.weight", "head.weight"}  # two dimensions or more


def decayed_by_one_step(step, params: TensorDict) -> set[str]:
    """The leaves a step on zero gradients moved, each checked to have moved by exactly its decay."""
    after = step(params)
    moved = set()
    for key, before in params.items(True, True):
        name = ".".join(key)
        if not torch.equal(after[key], before):
            torch.testing.assert_close(after[key], before * (1 - 0.1 * 0.5), rtol=1e-6, atol=0)
            moved.add(name)
    return moved


def functional_step(tx: muonfn.Transform):
    def step(params: TensorDict) -> TensorDict:
        updates, _ = tx.update(params.apply(torch.zeros_like), tx.init(params), params)
        return muonfn.apply_updates(params, updates)

    return step


def shim_step(params: TensorDict) -> TensorDict:
    model = Small()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[tuple(name.split("."))])
            p.grad = torch.zeros_like(p)
    Muon(model.named_parameters(), lr=0.1, weight_decay=0.5, weight_decay_mask="matrices").step()
    return TensorDict.from_module(model).detach()


def test_weight_decay_mask_matrices_decays_only_parameters_of_two_dimensions_or_more():
    params = TensorDict.from_module(Small()).detach().clone()
    for step in (
        functional_step(muonfn.muon(lr=0.1, weight_decay=0.5, weight_decay_mask="matrices")),
        functional_step(muonfn.adamw(lr=0.1, weight_decay=0.5, weight_decay_mask="matrices")),
        functional_step(muonfn.normuon(lr=0.1, weight_decay=0.5, weight_decay_mask="matrices")),
        shim_step,
    ):
        assert decayed_by_one_step(step, params) == DECAYED
    # stacked members (batch size [2]): a member's bias is a vector though (2, 6) stacked
    members = TensorDict.from_modules(Small(), Small()).detach().clone()
    tx = muonfn.adamw(lr=0.1, weight_decay=0.5, weight_decay_mask="matrices")
    assert decayed_by_one_step(functional_step(tx), members) == DECAYED


@pytest.mark.parametrize(
    "build",
    [
        lambda mask: muonfn.muon(weight_decay_mask=mask),
        lambda mask: muonfn.adamw(weight_decay_mask=mask),
        lambda mask: muonfn.add_decayed_weights(0.1, mask=mask),
        lambda mask: Muon(Small().named_parameters(), weight_decay_mask=mask),
    ],
    ids=["muon", "adamw", "add_decayed_weights", "shim"],
)
def test_an_unknown_mask_name_is_refused_naming_the_choices(build):
    for name in ("matrix", "0.bias"):
        with pytest.raises(ValueError, match=rf"mask: unknown mask '{name}'; choose one of \['matrices'\]"):
            build(name)
