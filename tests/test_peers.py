"""Cross-checks of the variant rules against the peers' own code, in fp64.

Each test configures muonfn through its public API and runs the peer's optimizer (or the
peer's function for that one rule) on the same gradients. The peers are optional (the
``peers`` extra); a test whose peer is missing is skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import muonfn

F64 = torch.float64
NS_F64 = muonfn.NewtonSchulz(dtype=F64)
SHAPES = {"w": (6, 10), "v": (9, 5), "b": (7,)}


def grads_seq(steps: int, seed: int = 0, shapes: dict = SHAPES) -> list[TensorDict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        TensorDict({k: torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()}, batch_size=[])
        for _ in range(steps)
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def optax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return pytest.importorskip("optax")


@pytest.fixture(scope="module")
def heavyball_utils():
    pytest.importorskip("heavyball")
    from heavyball import utils

    utils.compile_mode = None  # the plain functions: no torch.compile in a test
    return utils


def run_optax(tx, grads: list[TensorDict]) -> list[dict[str, np.ndarray]]:
    import jax.numpy as jnp

    first = {k: jnp.asarray(v.numpy()) for k, v in grads[0].items()}
    state = tx.init(first)
    out = []
    for g in grads:
        u, state = tx.update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, state)
        out.append({k: np.asarray(v) for k, v in u.items()})
    return out


def run_muonfn(tx, grads: list[TensorDict]) -> list[TensorDict]:
    params = grads[0].apply(torch.zeros_like)
    state = tx.init(params)
    out = []
    for g in grads:
        u, state = tx.update(g, state, params)
        out.append(u)
    return out


def assert_matches_optax(ours: list[TensorDict], theirs: list[dict[str, np.ndarray]], tol: float) -> float:
    worst = 0.0
    for u, v in zip(ours, theirs):
        for k in v:
            worst = max(worst, rel(u[k], torch.from_numpy(np.array(v[k]))))
    assert worst <= tol, worst
    return worst


# 1. NAdamW
def test_nadamw_matches_optax(optax):
    grads = grads_seq(6)
    ours = run_muonfn(muonfn.scale_by_adam(0.9, 0.95, eps=1e-8, nesterov=True), grads)
    theirs = run_optax(optax.scale_by_adam(0.9, 0.95, eps=1e-8, nesterov=True), grads)
    assert_matches_optax(ours, theirs, 1e-12)
    # and it is a different rule from plain Adam
    plain = run_muonfn(muonfn.scale_by_adam(0.9, 0.95, eps=1e-8), grads)
    assert rel(plain[-1]["w"], ours[-1]["w"]) > 1e-3


def _matrices(optax, shapes: dict) -> dict:
    from optax.contrib._muon import MuonDimensionNumbers

    return {k: MuonDimensionNumbers(reduction_axis=0, output_axis=1) for k in shapes}


# 2. optax's bias-corrected Nesterov momentum, through optax's whole Muon direction
@pytest.mark.parametrize("nesterov", [True, False])
def test_bias_corrected_momentum_and_additive_eps_match_optax_muon(optax, nesterov):
    shapes = {"w": (6, 10), "v": (9, 5)}
    grads = grads_seq(5, shapes=shapes)
    tx = muonfn.chain(
        muonfn.ema_momentum(0.95, nesterov=nesterov, bias_correction=True),
        muonfn.orthogonalize(muonfn.NewtonSchulz("keller", eps=1e-8, dtype=F64, eps_mode="add")),
    )
    ours = run_muonfn(tx, grads)
    theirs = run_optax(
        optax.contrib.scale_by_muon(
            beta=0.95, eps=1e-8, nesterov=nesterov, weight_dimension_numbers=_matrices(optax, shapes)
        ),
        grads,
    )
    assert_matches_optax(ours, theirs, 1e-10)


def test_bias_corrected_momentum_matches_optax_before_newton_schulz(optax):
    """Momentum alone: optax's Muon with a zero-step map, divided back by the additive norm."""
    import optax.contrib._muon as om

    grads = grads_seq(5, shapes={"w": (6, 10)})
    ours = run_muonfn(muonfn.ema_momentum(0.9, bias_correction=True), grads)
    theirs = run_optax(
        om.scale_by_muon(
            beta=0.9,
            eps=1e-8,
            ns_coeffs=(1.0, 0.0, 0.0),
            ns_steps=1,
            weight_dimension_numbers=_matrices(optax, {"w": (6, 10)}),
        ),
        grads,
    )
    for u, v in zip(ours, theirs):
        expected = u["w"] / (torch.linalg.matrix_norm(u["w"]) + 1e-8)
        assert rel(torch.from_numpy(np.array(v["w"])), expected) <= 1e-14


# 3. heavyball's g + EMA(g)
def test_nesterov_add_matches_heavyball_nesterov_ema(heavyball_utils):
    grads = grads_seq(5)
    ours = run_muonfn(muonfn.ema_momentum(0.9, nesterov="add"), grads)
    state = [torch.zeros(s, dtype=F64) for s in SHAPES.values()]
    for u, g in zip(ours, grads):
        theirs = heavyball_utils.nesterov_ema(state, [g[k].clone() for k in SHAPES], 0.9)
        for k, t in zip(SHAPES, theirs):
            assert rel(u[k], t) <= 1e-15


# 4. cautious weight decay
def test_cautious_weight_decay_matches_heavyball(heavyball_utils):
    (p, u) = grads_seq(2)
    lr, wd = 0.1, 0.3
    tx = muonfn.chain(muonfn.add_decayed_weights(wd, cautious=True), muonfn.scale_by_learning_rate(lr))
    step, _ = tx.update(u, tx.init(p), p)
    ours = muonfn.apply_updates(p, step)
    theirs = [p[k].clone() for k in SHAPES]
    heavyball_utils._compilable_update_(theirs, [u[k] for k in SHAPES], wd, lr, False, True, [None] * len(theirs))
    for k, t in zip(SHAPES, theirs):
        assert rel(ours[k], t) <= 1e-15
    plain = muonfn.chain(muonfn.add_decayed_weights(wd), muonfn.scale_by_learning_rate(lr))
    assert not torch.equal(muonfn.apply_updates(p, plain.update(u, plain.init(p), p)[0])["w"], ours["w"])


# 5. cautious updates
def _adam_updates(grads, mode="heavyball"):
    inner = run_muonfn(muonfn.scale_by_adam(0.9, 0.99), grads)
    outer = run_muonfn(muonfn.cautious(muonfn.scale_by_adam(0.9, 0.99), mode=mode), grads)
    return inner, outer


def test_cautious_matches_heavyball(heavyball_utils):
    grads = grads_seq(4)
    inner, outer = _adam_updates(grads)
    worst = 0.0
    for g, u, c in zip(grads, inner, outer):
        for k in SHAPES:
            worst = max(worst, rel(c[k], heavyball_utils.caution(g[k], u[k].clone())))
    # heavyball divides numel by an int64 count, which torch does in fp32: 1e-7, not rounding
    assert worst <= 1e-7
    assert any(not torch.equal(u["w"], c["w"]) for u, c in zip(inner, outer))


def test_cautious_matches_pytorch_optimizer():
    pytest.importorskip("pytorch_optimizer")
    from pytorch_optimizer.base.optimizer import BaseOptimizer

    grads = grads_seq(4)
    inner, outer = _adam_updates(grads, mode="pytorch_optimizer")
    for g, u, c in zip(grads, inner, outer):
        for k in SHAPES:
            theirs = u[k].clone()
            BaseOptimizer.apply_cautious(theirs, g[k])
            assert torch.equal(c[k], theirs)


# 6. additive eps: also against the direct formula, bit for bit
@pytest.mark.parametrize("scale", [1.0, 3e-8, 1e-9, 1e30, 2.0**-1000])
def test_additive_eps_is_the_direct_formula(scale):
    g = grads_seq(1, seed=3, shapes={"w": (5, 9)})[0]["w"] * scale
    identity = [(1.0, 0.0, 0.0)]  # one step that returns its input: X = 1·X + 0
    ours = muonfn.newton_schulz(g, identity, eps=1e-7, eps_mode="add", dtype=F64)
    direct = g / (torch.linalg.matrix_norm(g) + 1e-7)
    if scale == 2.0**-1000:  # the direct formula's intermediates are subnormal here: to rounding
        assert torch.allclose(ours, direct, rtol=1e-14, atol=0.0)
    else:
        assert torch.equal(ours, direct)


# 7. other matrix maps
@pytest.mark.parametrize("mode", ["svd", "qr"])
def test_matrix_maps_match_heavyball(heavyball_utils, mode):
    g = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    params = TensorDict({"w": torch.zeros(3, 8, 8, dtype=F64)}, [])
    tx = muonfn.orthogonalize(mode, views={"w": muonfn.MatrixView(batch_dims=1)})
    ours, _ = tx.update(TensorDict({"w": g}, []), tx.init(params), params)
    for i in range(3):
        theirs = heavyball_utils.inplace_orthogonal_(g[i].clone(), mode=mode, scale_mode="none")
        assert rel(ours["w"][i], theirs) <= 1e-13


# --- whole optimizers, stepped side by side with muonfn's presets -------------------------------------

SHIM_SHAPES = {"w": (6, 10), "v": (9, 5), "conv": (4, 2, 3, 3)}


def _start(shapes: dict = SHIM_SHAPES, seed: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()}


def step_peer(make, start: dict, grads: list[TensorDict], **step_kwargs) -> dict[str, torch.Tensor]:
    """The parameters after the peer optimizer ``make(params)`` stepped through ``grads``."""
    params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    opt = make(list(params.values()))
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step(**step_kwargs)
    return {k: p.detach() for k, p in params.items()}


def step_muonfn(tx, start: dict, grads: list[TensorDict], after=None) -> TensorDict:
    params = TensorDict({k: v.clone() for k, v in start.items()}, batch_size=[])
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = muonfn.apply_updates(params, updates)
        if after is not None:
            params = after(params)
    return params


def moved(ours: TensorDict, theirs: dict, start: dict) -> float:
    """The largest relative difference of the displacement from ``start``, over the leaves."""
    return max(rel(ours[k] - start[k], theirs[k] - start[k]) for k in theirs)


def all_muon(**kwargs):
    return muonfn.muon(labels=lambda p: {k: "muon" for k in p.keys(True, True)}, ns=NS_F64, **kwargs)


@pytest.fixture
def fp64_pytorch_optimizer(monkeypatch):
    """pytorch-optimizer with its Newton–Schulz in fp64 (it runs bf16, with no option to change it)."""
    pytest.importorskip("pytorch_optimizer")
    import functools

    import pytorch_optimizer.optimizer.muon.adamuon as adamuon
    import pytorch_optimizer.optimizer.muon.base as base
    import pytorch_optimizer.optimizer.muon.normuon as normuon
    from pytorch_optimizer.optimizer.utils import matrix

    fp64 = functools.partial(matrix.zero_power_via_newton_schulz_5, dtype=F64)
    for module in (base, normuon, adamuon):
        monkeypatch.setattr(module, "zero_power_via_newton_schulz_5", fp64)
    import pytorch_optimizer

    return pytorch_optimizer


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(
    ("update_scale", "rescale", "scale"),
    [("preserve_norm", "preserve_norm", "original"), ("match_rms", "orthogonal", "match_rms_adamw")],
)
def test_normuon_matches_pytorch_optimizer(fp64_pytorch_optimizer, foreach, update_scale, rescale, scale):
    start, grads = _start(), grads_seq(5, shapes=SHIM_SHAPES)
    theirs = step_peer(
        lambda ps: fp64_pytorch_optimizer.NorMuon(
            [dict(params=ps, use_muon=True)], lr=0.02, weight_decay=0.1, update_scale=update_scale, foreach=foreach
        ),
        start,
        grads,
    )
    tx = muonfn.normuon(
        0.02,
        weight_decay=0.1,
        rescale=rescale,
        scale=scale,
        ns=NS_F64,
        labels=lambda p: {k: "muon" for k in p.keys(True, True)},
    )
    assert moved(step_muonfn(tx, start, grads), theirs, start) <= 1e-10


@pytest.mark.parametrize("foreach", [False, True])
def test_adamuon_matches_pytorch_optimizer(fp64_pytorch_optimizer, foreach):
    start, grads = _start(), grads_seq(5, shapes=SHIM_SHAPES)
    theirs = step_peer(
        lambda ps: fp64_pytorch_optimizer.AdaMuon(
            [dict(params=ps, use_muon=True)], lr=0.02, weight_decay=0.1, foreach=foreach
        ),
        start,
        grads,
    )
    tx = muonfn.adamuon(
        0.02,
        weight_decay=0.1,
        sign_momentum=False,
        second_moment_bias_correction=True,
        ns=NS_F64,
        labels=lambda p: {k: "muon" for k in p.keys(True, True)},
    )
    assert moved(step_muonfn(tx, start, grads), theirs, start) <= 1e-10
    # the paper's sign-stabilised update is another rule
    paper = muonfn.adamuon(0.02, weight_decay=0.1, ns=NS_F64, labels=lambda p: {k: "muon" for k in p.keys(True, True)})
    assert moved(step_muonfn(paper, start, grads), theirs, start) > 1e-3


def test_muon_clip_matches_pytorch_optimizer(fp64_pytorch_optimizer):
    shapes = {"q": (8, 6), "k": (8, 6), "o": (6, 8)}
    start, grads = _start(shapes), grads_seq(3, shapes=shapes)
    # factors exact in fp32 and fp64 alike (the peer computes them in fp32): 100/400 = 1/4, 100/1600 = 1/16
    logits = {"attn": torch.tensor([50.0, 400.0, 1600.0, 100.0], dtype=F64)}

    def make(ps):
        q, k, o = ps
        groups = [
            dict(params=[q], use_muon=True, qk_clip="query", attention_name="attn"),
            dict(params=[k], use_muon=True, qk_clip="key", attention_name="attn"),
            dict(params=[o], use_muon=True),
        ]
        return fp64_pytorch_optimizer.MuonClip(groups, lr=0.02, weight_decay=0.1, foreach=False)

    theirs = step_peer(make, start, grads, attention_max_logits=logits)
    heads = {"attn": muonfn.QKHeads(heads=4, query="q", key="k")}
    tx = all_muon(lr=0.02, weight_decay=0.1, nesterov=False)
    ours = step_muonfn(tx, start, grads, after=lambda p: muonfn.qk_clip(p, logits, heads))
    assert moved(ours, theirs, start) <= 1e-10
    assert not torch.equal(ours["q"], step_muonfn(tx, start, grads)["q"])


@pytest.fixture
def fp64_torch_muon(monkeypatch):
    """torch.optim.Muon with its own Newton–Schulz source run in fp64 instead of bf16 (its one cast)."""
    import inspect
    import textwrap

    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon arrived in torch 2.9")
    import torch.optim._muon as torch_muon

    source = textwrap.dedent(inspect.getsource(torch_muon._zeropower_via_newtonschulz))
    assert source.count("grad.bfloat16()") == 1
    namespace = dict(vars(torch_muon))
    exec(source.replace("grad.bfloat16()", "grad.double()"), namespace)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", namespace["_zeropower_via_newtonschulz"])
    return torch.optim.Muon


@pytest.mark.parametrize(("adjust_lr_fn", "scale"), [(None, "original"), ("match_rms_adamw", "match_rms_adamw")])
def test_muon_matches_torch_optim_muon(fp64_torch_muon, adjust_lr_fn, scale):
    shapes = {"w": (6, 10), "v": (9, 5)}
    start, grads = _start(shapes), grads_seq(5, shapes=shapes)
    theirs = step_peer(
        lambda ps: fp64_torch_muon(ps, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn), start, grads
    )
    ours = step_muonfn(all_muon(lr=0.02, weight_decay=0.1, scale=scale), start, grads)
    assert moved(ours, theirs, start) <= 1e-10


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_pytorch_optimizer_muon(fp64_pytorch_optimizer, nesterov):
    start, grads = _start(), grads_seq(5, shapes=SHIM_SHAPES)
    theirs = step_peer(
        lambda ps: fp64_pytorch_optimizer.Muon(
            [dict(params=ps, use_muon=True)], lr=0.02, weight_decay=0.1, nesterov=nesterov, foreach=False
        ),
        start,
        grads,
    )
    ours = step_muonfn(all_muon(lr=0.02, weight_decay=0.1, nesterov=nesterov, scale="original"), start, grads)
    assert moved(ours, theirs, start) <= 1e-10


@pytest.fixture(scope="module")
def timm_muon():
    """``timm.optim.muon`` without timm's package imports (they need torchvision, whose wheel expects
    CUDA torch), loaded as the benchmarks load it: under a private name, ``timm`` left alone."""
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import _contenders

    try:
        return _contenders.load_timm_muon()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_matches_timm(timm_muon, monkeypatch, nesterov):
    import functools

    monkeypatch.setattr(
        timm_muon, "zeropower_via_newtonschulz", functools.partial(timm_muon.zeropower_via_newtonschulz, dtype=F64)
    )
    shapes = {"w": (6, 10), "v": (9, 5), "b": (7,)}
    start, grads = _start(shapes), grads_seq(5, shapes=shapes)
    theirs = step_peer(lambda ps: timm_muon.Muon(ps, lr=0.02, weight_decay=0.1, nesterov=nesterov), start, grads)
    tx = muonfn.muon(
        0.02,
        momentum=0.95,
        nesterov=nesterov,
        weight_decay=0.1,
        ns=muonfn.NewtonSchulz("cesista", dtype=F64),
        adamw_eps=1e-7,  # timm's fallback AdamW takes the group's eps, Newton–Schulz's 1e-7
        adamw_nesterov="timm" if nesterov else False,  # timm's NAdamW: (b1 m + (1 - b1) g) / (1 - b1^t)
    )
    ours = step_muonfn(tx, start, grads)
    assert max(moved(ours, {k: theirs[k]}, start) for k in ("w", "v")) <= 1e-10
    assert moved(ours, {"b": theirs["b"]}, start) <= 1e-10
