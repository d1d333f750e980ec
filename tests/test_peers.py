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
        muonfn.orthogonalize("keller", eps=1e-8, eps_mode="add", dtype=F64),
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
    tx = muonfn.orthogonalize(ns_method=mode, views={"w": muonfn.MatrixView(batch_dims=1)})
    ours, _ = tx.update(TensorDict({"w": g}, []), tx.init(params), params)
    for i in range(3):
        theirs = heavyball_utils.inplace_orthogonal_(g[i].clone(), mode=mode, scale_mode="none")
        assert rel(ours["w"][i], theirs) <= 1e-13
