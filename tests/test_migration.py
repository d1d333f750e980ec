"""Each claim of docs/migration.md: "these muonfn settings reproduce library Y's update".

torch.optim.Muon is run as it is. The other libraries' updates are written here from their
published formulas (momentum form, Newton–Schulz normalisation, scale, weight decay, the
AdamW part) and compared with muonfn's configured update step by step, in fp64 so that any
difference in the formula, not rounding, is what a failure shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict

import muonfn

KELLER = (3.4445, -4.7750, 2.0315)
SHAPES = {"wide": (8, 24), "tall": (24, 8), "square": (16, 16)}
STEPS = 4


def reference_ns(g: torch.Tensor, eps: float = 1e-7, coefficients=KELLER, steps: int = 5) -> torch.Tensor:
    """The peers' Newton–Schulz: X / (‖X‖_F + eps) on the wide orientation, five quintic steps."""
    a, b, c = coefficients
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def gradients(shapes: dict[str, tuple[int, ...]], steps: int = STEPS, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Gaussian gradients; those of 1-D leaves (AdamW's) are ~1e-7, so that AdamW's eps matters and a
    wrong one shows (Muon's matrices are scale-invariant)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64) * (1e-7 if len(shape) == 1 else 1.0)

    return [{k: draw(s) for k, s in shapes.items()} for _ in range(steps)]


def initial(shapes: dict[str, tuple[int, ...]], seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}


def run_muonfn(tx: muonfn.Transform, params: dict, grads: list[dict]) -> list[dict[str, torch.Tensor]]:
    p = TensorDict({k: v.clone() for k, v in params.items()})
    state = tx.init(p)
    out = []
    for g in grads:
        updates, state = tx.update(TensorDict(g), state, p)
        p = muonfn.apply_updates(p, updates)
        out.append({k: p[k].clone() for k in params})
    return out


def run_reference(step: Callable[[dict, dict, dict, int], None], params: dict, grads: list[dict]) -> list[dict]:
    p = {k: v.clone() for k, v in params.items()}
    state: dict = {}
    out = []
    for t, g in enumerate(grads, start=1):
        step(p, g, state, t)
        out.append({k: v.clone() for k, v in p.items()})
    return out


def assert_same_trajectory(ours: list[dict], theirs: list[dict], rtol: float = 1e-6) -> None:
    for t, (a, b) in enumerate(zip(ours, theirs), start=1):
        for k in a:
            err = ((a[k] - b[k]).norm() / b[k].norm()).item()
            assert err < rtol, f"step {t}, {k}: relative difference {err:.2e}"


def all_muon(shapes: dict) -> dict[str, str]:
    return {k: "muon" for k in shapes}


def adamw_reference(p, g, state, t, key, lr, betas, eps, wd):
    """AdamW as torch.optim.AdamW, Moonlight and Keller's auxiliary Adam write it."""
    m = state.setdefault(("m", key), torch.zeros_like(g))
    v = state.setdefault(("v", key), torch.zeros_like(g))
    m.lerp_(g, 1 - betas[0])
    v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    m_hat = m / (1 - betas[0] ** t)
    v_hat = v / (1 - betas[1] ** t)
    p.mul_(1 - lr * wd)
    p.add_(m_hat / (v_hat.sqrt() + eps), alpha=-lr)


# --- torch.optim.Muon -------------------------------------------------------------------


@pytest.mark.parametrize("adjust_lr_fn, scale", [(None, "original"), ("match_rms_adamw", "match_rms_adamw")])
def test_torch_optim_muon(adjust_lr_fn, scale):
    """torch.optim.Muon(lr, wd, μ, nesterov, adjust_lr_fn) == muonfn.muon(same, scale=..., ns_dtype=bf16).

    torch runs Newton–Schulz in bf16 (normalisation included); muonfn normalises in fp32 and
    then casts, so the parameters agree to bf16 accuracy and the momentum buffers exactly.
    """
    shapes = {f"w_{name}": s for name, s in SHAPES.items()}
    params = {k: v.float() for k, v in initial(shapes).items()}
    grads = [{k: v.float() for k, v in g.items()} for g in gradients(shapes)]
    lr, wd = 0.02, 0.1
    torch_params = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    theirs = torch.optim.Muon(list(torch_params.values()), lr=lr, weight_decay=wd, adjust_lr_fn=adjust_lr_fn)
    tx = muonfn.muon(lr=lr, weight_decay=wd, scale=scale, ns_dtype=torch.bfloat16, labels=all_muon(shapes))
    ours = TensorDict({k: v.clone() for k, v in params.items()})
    state = tx.init(ours)
    for t, g in enumerate(grads, start=1):
        before = {k: p.detach().clone() for k, p in torch_params.items()}
        for k, p in torch_params.items():
            p.grad = g[k].clone()
        theirs.step()
        updates, state = tx.update(TensorDict(g), state, ours)
        ours = muonfn.apply_updates(ours, updates)
        for k, p in torch_params.items():
            assert torch.equal(state["muon", "momentum", k], theirs.state[p]["momentum_buffer"]), (t, k)
            step_theirs = p.detach() - before[k]
            err = ((updates[k] - step_theirs).norm() / step_theirs.norm()).item()
            assert err < 0.03, f"step {t}, {k}: relative difference {err:.3f}"
            torch.testing.assert_close(ours[k], p.detach(), rtol=0, atol=0.03 * lr * 3)


# --- KellerJordan/Muon and MuonWithAuxAdam ------------------------------------------------


def test_keller_muon_with_aux_adam():
    """Keller's MuonWithAuxAdam (Muon lr 0.02, wd 0; Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10)."""
    shapes = {**{f"w_{name}": s for name, s in SHAPES.items()}, "bias": (16,)}
    lr, mu, adam_lr, betas, eps = 0.02, 0.95, 3e-4, (0.9, 0.95), 1e-10

    def step(p, g, state, t):
        for k in p:
            if p[k].ndim == 1:
                adamw_reference(p[k], g[k], state, t, k, adam_lr, betas, eps, 0.0)
                continue
            buf = state.setdefault(k, torch.zeros_like(g[k]))
            buf.lerp_(g[k], 1 - mu)
            update = reference_ns(g[k].lerp(buf, mu))
            rows, cols = p[k].shape
            p[k].add_(update, alpha=-lr * math.sqrt(max(1, rows / cols)))

    tx = muonfn.muon(
        lr=lr,
        momentum=mu,
        weight_decay=0.0,
        scale="original",
        adamw_lr=adam_lr,
        adamw_betas=betas,
        adamw_eps=eps,
        labels={k: "adamw" if k == "bias" else "muon" for k in shapes},
    )
    params, grads = initial(shapes), gradients(shapes)
    assert_same_trajectory(run_muonfn(tx, params, grads), run_reference(step, params, grads))


def test_keller_conv_scale_uses_the_flattened_shape():
    """Keller scales a conv update by √max(1, kh/kw) of the 4-D shape (their issue #63); muonfn
    uses the flattened (out, in·kh·kw) matrix. They agree unless out > in·kh·kw."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(64, 3, 3, 3, generator=gen, dtype=torch.float64)
    tx = muonfn.orthogonalize(scale="original")
    ours, _ = tx.update(TensorDict({"conv": g}), TensorDict())
    keller = reference_ns(g.flatten(1)).view_as(g) * math.sqrt(max(1, g.size(-2) / g.size(-1)))
    ratio = (ours["conv"].norm() / keller.norm()).item()
    assert ratio == pytest.approx(math.sqrt(64 / 27), rel=1e-6)
    g = torch.randn(16, 8, 3, 3, generator=gen, dtype=torch.float64)  # out <= in·kh·kw: both scale by 1
    ours, _ = tx.update(TensorDict({"conv": g}), TensorDict())
    keller = reference_ns(g.flatten(1)).view_as(g)
    assert ((ours["conv"] - keller).norm() / keller.norm()).item() < 1e-6


# --- Moonlight ----------------------------------------------------------------------------


def test_moonlight_is_muonfn_defaults():
    """Moonlight: classical momentum with Nesterov, 0.2·√max(A, B), wd 0.1 on both parts, AdamW
    betas (0.9, 0.95), eps 1e-8: ``muonfn.muon(lr, weight_decay=0.1)`` with its defaults.

    Classical momentum is (1 − μ)⁻¹ times the EMA, a factor Newton–Schulz normalises away.
    """
    shapes = {**{f"w_{name}": s for name, s in SHAPES.items()}, "norm": (16,)}
    lr, mu, wd = 1e-3, 0.95, 0.1

    def step(p, g, state, t):
        for k in p:
            if p[k].ndim == 1:
                adamw_reference(p[k], g[k], state, t, k, lr, (0.9, 0.95), 1e-8, wd)
                continue
            buf = state.setdefault(k, torch.zeros_like(g[k]))
            buf.mul_(mu).add_(g[k])
            update = reference_ns(g[k] + mu * buf)
            rows, cols = p[k].shape
            p[k].mul_(1 - lr * wd)
            p[k].add_(update, alpha=-lr * 0.2 * math.sqrt(max(rows, cols)))

    tx = muonfn.muon(lr=lr, weight_decay=wd)
    params, grads = initial(shapes), gradients(shapes)
    assert_same_trajectory(run_muonfn(tx, params, grads), run_reference(step, params, grads))


# --- Megatron / Emerging-Optimizers --------------------------------------------------------


@pytest.mark.parametrize(
    "mode, scale_fn",
    [
        ("original", lambda o, i: math.sqrt(max(1, o / i))),  # Megatron "shape_scaling"
        ("spectral", lambda o, i: math.sqrt(max(o, i))),
        ("unit_rms_norm", lambda o, i: math.sqrt(o / i)),
    ],
)
def test_megatron_emerging_optimizers(mode, scale_fn):
    """Megatron Muon: EMA momentum without Nesterov, scale mode × extra_scale_factor, decoupled wd."""
    shapes = {f"w_{name}": s for name, s in SHAPES.items()}
    lr, mu, wd, extra = 0.01, 0.9, 0.05, 0.2

    def step(p, g, state, t):
        for k in p:
            buf = state.setdefault(k, torch.zeros_like(g[k]))
            buf.lerp_(g[k], 1 - mu)
            o, i = p[k].shape
            p[k].mul_(1 - lr * wd)
            p[k].add_(reference_ns(buf), alpha=-lr * scale_fn(o, i) * extra)

    tx = muonfn.muon(
        lr=lr, momentum=mu, nesterov=False, weight_decay=wd, scale=mode, extra_scale=extra, labels=all_muon(shapes)
    )
    params, grads = initial(shapes), gradients(shapes)
    assert_same_trajectory(run_muonfn(tx, params, grads), run_reference(step, params, grads))


# --- optax.contrib.muon --------------------------------------------------------------------


def optax_step(lr: float, beta: float, wd: float, nesterov: bool):
    """optax.contrib.muon's matrix update on JAX kernels stored (in, out)."""

    def step(p, g, state, t):
        for k in p:
            m = state.setdefault(k, torch.zeros_like(g[k]))
            m.lerp_(g[k], 1 - beta)
            if nesterov:  # the momentum and the gradient are bias-corrected separately
                u = beta * m / (1 - beta ** (t + 1)) + (1 - beta) * g[k] / (1 - beta**t)
            else:
                u = m / (1 - beta**t)
            x = reference_ns(u, eps=1e-8)
            fan_in, fan_out = p[k].shape
            p[k].add_(x * math.sqrt(max(1, fan_out / fan_in)) + wd * p[k], alpha=-lr)

    return step


def test_optax_contrib_muon_without_nesterov():
    """optax.contrib.muon(nesterov=False) on (in, out) kernels: scale "original" with transposed views.

    optax's bias correction is a scalar per step, which Newton–Schulz normalises away.
    """
    shapes = {f"kernel_{name}": s for name, s in SHAPES.items()}
    lr, beta, wd = 0.01, 0.95, 0.1
    views = {k: muonfn.MatrixView(transposed=True) for k in shapes}
    tx = muonfn.muon(
        lr=lr, momentum=beta, nesterov=False, weight_decay=wd, scale="original", views=views, labels=all_muon(shapes)
    )
    params, grads = initial(shapes), gradients(shapes)
    theirs = run_reference(optax_step(lr, beta, wd, nesterov=False), params, grads)
    assert_same_trajectory(run_muonfn(tx, params, grads), theirs)


def test_optax_contrib_muon_nesterov_converges():
    """With nesterov=True optax weights momentum and gradient by separate bias corrections, so the
    first updates differ from muonfn's; the difference decays like β^t."""
    shapes = {"kernel": (8, 24)}
    lr, beta = 0.01, 0.9
    views = {"kernel": muonfn.MatrixView(transposed=True)}
    tx = muonfn.muon(lr=lr, momentum=beta, weight_decay=0.0, scale="original", views=views, labels=all_muon(shapes))
    grads = gradients(shapes, steps=120)
    params = initial(shapes)
    ours = run_muonfn(tx, params, grads)
    theirs = run_reference(optax_step(lr, beta, 0.0, nesterov=True), params, grads)

    def step_difference(t: int) -> float:
        before_ours = params if t == 0 else ours[t - 1]
        before_theirs = params if t == 0 else theirs[t - 1]
        a = ours[t]["kernel"] - before_ours["kernel"]
        b = theirs[t]["kernel"] - before_theirs["kernel"]
        return ((a - b).norm() / b.norm()).item()

    assert step_difference(1) > 1e-2
    assert step_difference(119) < 1e-4


# --- AdamW ---------------------------------------------------------------------------------


def test_adamw_matches_torch_adamw():
    """muonfn.adamw(lr, betas, eps, wd) steps exactly like torch.optim.AdamW (the demo's baseline)."""
    shapes = {"w": (8, 24), "b": (24,)}
    params, grads = initial(shapes), gradients(shapes, steps=5)
    lr, betas, eps, wd = 3e-3, (0.9, 0.95), 1e-8, 0.1
    ours = run_muonfn(muonfn.adamw(lr=lr, betas=betas, eps=eps, weight_decay=wd), params, grads)
    modules = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    theirs = torch.optim.AdamW(list(modules.values()), lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for t, g in enumerate(grads):
        for k, p in modules.items():
            p.grad = g[k].clone()
        theirs.step()
        for k, p in modules.items():
            torch.testing.assert_close(ours[t][k], p.detach(), rtol=1e-12, atol=1e-14)
