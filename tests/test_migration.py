"""Each claim of docs/migration.md: "these muonfn settings reproduce library Y's update".

torch.optim.Muon is run as it is. The other libraries' updates are written here from their
published formulas (momentum form, Newton–Schulz normalisation, scale, weight decay, the
AdamW part) and compared with muonfn's configured update step by step, in fp64 so that any
difference in the formula, not rounding, is what a failure shows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict
from torch.optim import _muon as torch_muon

import muonfn
import muonfn.optim

KELLER = (3.4445, -4.7750, 2.0315)
FP32_NS = muonfn.NewtonSchulz(dtype=torch.float32)
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
    """torch.optim.Muon(lr, wd, μ, nesterov, adjust_lr_fn) == muonfn.muon(same, scale=..., ns=NewtonSchulz(dtype=bf16)).

    torch runs Newton–Schulz in bf16 (normalisation included); muonfn normalises in fp32 and
    then casts, so the parameters agree to bf16 accuracy and the momentum buffers exactly.
    """
    shapes = {f"w_{name}": s for name, s in SHAPES.items()}
    params = {k: v.float() for k, v in initial(shapes).items()}
    grads = [{k: v.float() for k, v in g.items()} for g in gradients(shapes)]
    lr, wd = 0.02, 0.1
    torch_params = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    theirs = torch.optim.Muon(list(torch_params.values()), lr=lr, weight_decay=wd, adjust_lr_fn=adjust_lr_fn)
    ns = muonfn.NewtonSchulz(dtype=torch.bfloat16)
    tx = muonfn.muon(lr=lr, weight_decay=wd, scale=scale, ns=ns, labels=all_muon(shapes))
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

    tx = muonfn.muon(lr=lr, momentum=mu, nesterov=False, weight_decay=wd, scale=(mode, extra), labels=all_muon(shapes))
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


# --- moving a run between torch.optim.Muon + torch.optim.AdamW and muonfn.optim.Muon --------


def small_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 3)
    )


def by_ndim(model: torch.nn.Module) -> dict[str, str]:
    """torch's split: Muon takes the 2-D parameters, AdamW the rest."""
    return {name: "muon" if p.ndim == 2 else "adamw" for name, p in model.named_parameters()}


def fixed_grads(model: torch.nn.Module, steps: int) -> list[dict[str, torch.Tensor]]:
    """The same gradients for both optimizers, so that any difference in state is the optimizers'."""
    gen = torch.Generator().manual_seed(5)
    return [{n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()} for _ in range(steps)]


def step_with(model: torch.nn.Module, grads: dict[str, torch.Tensor], *optimizers: torch.optim.Optimizer) -> None:
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    for opt in optimizers:
        opt.step()


def fp32_newton_schulz(grad: torch.Tensor, coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
    """muonfn's Newton–Schulz in fp32 in place of torch's bf16 one, so that only the state can differ."""
    return muonfn.newton_schulz(grad, [coefficients], steps=steps, eps=eps, dtype=torch.float32)


def torch_pair(model: torch.nn.Module, **muon_kwargs) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    named = list(model.named_parameters())
    muon = torch.optim.Muon([(n, p) for n, p in named if p.ndim == 2], **muon_kwargs)
    adamw = torch.optim.AdamW(
        [(n, p) for n, p in named if p.ndim != 2], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, foreach=False
    )
    return muon, adamw


def assert_same_state(shim: muonfn.optim.Muon, model: torch.nn.Module, muon, adamw, torch_model) -> None:
    """Every state tensor bit for bit; ``step`` as the same count."""
    ours = dict(model.named_parameters())
    for name, p in torch_model.named_parameters():
        mine, theirs = shim.state[ours[name]], (muon if p.ndim == 2 else adamw).state[p]
        assert mine.keys() == theirs.keys(), name
        for key in theirs:
            if key == "step":
                assert theirs[key].dtype == torch.float32 and int(mine[key]) == float(theirs[key]), name
            else:
                assert torch.equal(mine[key], theirs[key]), (name, key)


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_torch_muon_and_adamw_run_continues_in_the_shim(monkeypatch: pytest.MonkeyPatch, adjust_lr_fn):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz)
    theirs_model = small_net()
    muon, adamw = torch_pair(theirs_model, lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn=adjust_lr_fn)
    grads = fixed_grads(theirs_model, 8)
    for g in grads[:4]:
        step_with(theirs_model, g, muon, adamw)

    model = small_net()
    model.load_state_dict(theirs_model.state_dict())
    # hyperparameters and state both come from the state_dicts
    shim = muonfn.optim.Muon(model.named_parameters(), lr=1.0, labels=by_ndim(model), ns=FP32_NS)
    shim.load_torch_state_dicts(muon.state_dict(), adamw.state_dict())
    muon_group, adamw_group = shim.param_groups
    assert (muon_group["lr"], muon_group["momentum"], muon_group["weight_decay"]) == (0.02, 0.9, 0.1)
    assert muon_group["adjust_lr_fn"] == (adjust_lr_fn or "original") and muon_group["eps"] == 1e-7
    assert muon_group["ns_coefficients"] == muonfn.COEFFICIENTS["keller"].triples
    assert (adamw_group["lr"], adamw_group["momentum"], adamw_group["beta2"], adamw_group["eps"]) == (
        3e-3,
        0.9,
        0.95,
        1e-8,
    )
    assert adamw_group["weight_decay"] == 0.01
    assert_same_state(shim, model, muon, adamw, theirs_model)

    for g in grads[4:]:  # same gradients: the state stays bitwise torch's, the parameters agree to rounding
        step_with(theirs_model, g, muon, adamw)
        step_with(model, g, shim)
        assert_same_state(shim, model, muon, adamw, theirs_model)
    for (name, p), q in zip(model.named_parameters(), theirs_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_shim_run_continues_in_torch_muon_and_adamw(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz)
    model = small_net()
    shim = muonfn.optim.Muon(
        model.named_parameters(),
        lr=0.02,
        momentum=0.9,
        weight_decay=0.1,
        adjust_lr_fn="original",
        ns=FP32_NS,
        adamw_lr=3e-3,
        adamw_weight_decay=0.01,
        labels=by_ndim(model),
    )
    grads = fixed_grads(model, 8)
    for g in grads[:4]:
        step_with(model, g, shim)

    muon_sd, adamw_sd = shim.torch_state_dicts()
    theirs_model = small_net()
    theirs_model.load_state_dict(model.state_dict())
    muon, adamw = torch_pair(theirs_model, lr=1.0)  # hyperparameters come from the state_dicts
    muon.load_state_dict(muon_sd)
    adamw.load_state_dict(adamw_sd)
    assert muon.param_groups[0]["adjust_lr_fn"] == "original" and muon.param_groups[0]["ns_steps"] == 5
    assert muon.param_groups[0]["ns_coefficients"] == (3.4445, -4.7750, 2.0315) and adamw.param_groups[0]["lr"] == 3e-3
    assert_same_state(shim, model, muon, adamw, theirs_model)
    assert muon.state[theirs_model[0].weight]["momentum_buffer"] is not shim.state[model[0].weight]["momentum_buffer"]

    for g in grads[4:]:
        step_with(theirs_model, g, muon, adamw)
        step_with(model, g, shim)
        assert_same_state(shim, model, muon, adamw, theirs_model)
    for (name, p), q in zip(model.named_parameters(), theirs_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_torch_state_dicts_hold_the_group_entries_of_torchs_own():
    """Each group of ``torch_state_dicts`` has the keys torch's optimizer writes in its own state_dict
    (``param_names`` with them): none of the shim's (a variant's options, AdamW's ``nesterov``)."""
    model = small_net()
    shim = muonfn.optim.Muon(model.named_parameters(), lr=0.02, adjust_lr_fn=None, labels=by_ndim(model))
    for g in fixed_grads(model, 2):
        step_with(model, g, shim)
    muon, adamw = torch_pair(small_net())
    for ours, torchs in zip(shim.torch_state_dicts(), (muon.state_dict(), adamw.state_dict())):
        assert set(ours["param_groups"][0]) == set(torchs["param_groups"][0])
    assert shim.torch_state_dicts()[1]["param_groups"][0]["decoupled_weight_decay"] is True


def test_torch_state_dicts_round_trip_resumes_bitwise(tmp_path):
    """shim → torch's state_dicts, saved and loaded weights-only → shim: the uninterrupted run, bit for bit."""
    settings = {
        "lr": 0.02,
        "momentum": 0.9,
        "adjust_lr_fn": None,
        "adamw_lr": 3e-3,
        "ns_coefficients": (3.4, -4.7, 2.0),
    }

    def shim_for(model: torch.nn.Module, **overrides) -> muonfn.optim.Muon:
        return muonfn.optim.Muon(model.named_parameters(), **{**settings, **overrides}, labels=by_ndim(model))

    uninterrupted = small_net()
    grads = fixed_grads(uninterrupted, 7)
    opt = shim_for(uninterrupted)
    for g in grads:
        step_with(uninterrupted, g, opt)

    first = small_net()
    first_opt = shim_for(first)
    for g in grads[:3]:
        step_with(first, g, first_opt)
    torch.save(first_opt.torch_state_dicts(), tmp_path / "torch_optimizers.pt")
    muon_sd, adamw_sd = torch.load(tmp_path / "torch_optimizers.pt", weights_only=True)
    resumed = small_net()
    resumed.load_state_dict(first.state_dict())
    resumed_opt = shim_for(resumed, lr=1.0, momentum=0.5, adamw_lr=1.0)
    resumed_opt.load_torch_state_dicts(muon_sd, adamw_sd)
    for g in grads[3:]:
        step_with(resumed, g, resumed_opt)
    assert_bitwise(TensorDict.from_module(resumed), TensorDict.from_module(uninterrupted))
    assert_bitwise(resumed_opt.functional_state, opt.functional_state)


def _cosine(optimizer: torch.optim.Optimizer, last_epoch: int = -1) -> torch.optim.lr_scheduler.CosineAnnealingLR:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, last_epoch=last_epoch)


def _rates(*optimizers: torch.optim.Optimizer) -> list[float]:
    return [g["lr"] for opt in optimizers for g in opt.param_groups]


def test_group_entries_of_schedulers_and_users_go_along_to_torch():
    """torch's load_state_dict carries every entry of a group; ``torch_state_dicts`` dropped those
    it does not translate, so that a scheduler resumed on torch's side (``last_epoch=N``) raised
    ``KeyError: param 'initial_lr' is not specified``. Resumed alike on both sides, schedulers
    now set the same rates."""
    model = small_net()
    shim = muonfn.optim.Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-3, adjust_lr_fn=None, labels=by_ndim(model))
    scheduler = _cosine(shim)
    for g in fixed_grads(model, 4):
        step_with(model, g, shim)
        scheduler.step()
    shim.param_groups[1]["tag"] = "no decay"  # an entry of one's own
    muon, adamw = torch_pair(small_net(), lr=1.0)
    muon_sd, adamw_sd = shim.torch_state_dicts()
    muon.load_state_dict(muon_sd)
    adamw.load_state_dict(adamw_sd)
    assert [muon.param_groups[0]["initial_lr"], adamw.param_groups[0]["initial_lr"]] == [0.02, 3e-3]
    assert adamw.param_groups[0]["tag"] == "no decay"
    shim.param_groups[1]["initial_lr"] += 1.0  # not shared with torch's optimizer
    assert adamw.param_groups[0]["initial_lr"] == 3e-3
    shim.param_groups[1]["initial_lr"] -= 1.0
    for optimizer in (shim, muon, adamw):
        _cosine(optimizer, scheduler.last_epoch)
    assert _rates(muon, adamw) == _rates(shim)


def test_group_entries_of_schedulers_and_users_come_along_from_torch():
    """The other way (``load_torch_state_dicts`` dropped them too), and through the shim's own
    ``state_dict``."""
    theirs = small_net()
    muon, adamw = torch_pair(theirs, lr=0.02)
    schedulers = [_cosine(muon), _cosine(adamw)]
    for g in fixed_grads(theirs, 4):
        step_with(theirs, g, muon, adamw)
        for scheduler in schedulers:
            scheduler.step()
    adamw.param_groups[0]["tag"] = "no decay"
    model = small_net()
    shim = muonfn.optim.Muon(model.named_parameters(), lr=1.0, adjust_lr_fn=None, labels=by_ndim(model))
    shim.load_torch_state_dicts(muon.state_dict(), adamw.state_dict())
    assert [g["initial_lr"] for g in shim.param_groups] == [0.02, 3e-3] and shim.param_groups[1]["tag"] == "no decay"
    again = torch_pair(small_net(), lr=1.0)
    for torch_optimizer, state_dict in zip(again, (muon.state_dict(), adamw.state_dict())):
        torch_optimizer.load_state_dict(state_dict)
    for optimizer in (shim, *again):
        _cosine(optimizer, schedulers[0].last_epoch)
    assert _rates(*again) == _rates(shim)

    reloaded = muonfn.optim.Muon(model.named_parameters(), lr=1.0, labels=by_ndim(model))
    reloaded.load_state_dict(shim.state_dict())
    assert [g["initial_lr"] for g in reloaded.param_groups] == [0.02, 3e-3]
    assert reloaded.param_groups[1]["tag"] == "no decay"


def test_torch_state_dict_conversion_refuses_what_does_not_carry_over(monkeypatch: pytest.MonkeyPatch):
    model = small_net()
    shim = muonfn.optim.Muon(model.named_parameters(), lr=0.02, labels=by_ndim(model))
    step_with(model, fixed_grads(model, 1)[0], shim)
    before = (shim.functional_state.clone(), copy.deepcopy([{**g, "params": None} for g in shim.param_groups]))
    theirs = small_net()
    muon, adamw = torch_pair(theirs, lr=0.02)
    named = list(theirs.named_parameters())
    two_groups = torch.optim.Muon([{"params": [named[0][1]]}, {"params": [named[4][1], named[6][1]]}])
    wrong_names = torch.optim.Muon([(f"x{n}", p) for n, p in named if p.ndim == 2])
    amsgrad = torch.optim.AdamW([(n, p) for n, p in named if p.ndim != 2], amsgrad=True)
    shorter = torch.optim.Muon([p for _, p in named if p.ndim == 2][:2])
    cases = [
        (
            (two_groups.state_dict(), adamw.state_dict()),
            r"the torch.optim.Muon state_dict has 2 groups, this optimizer 1$",
        ),
        (
            (shorter.state_dict(), adamw.state_dict()),
            r"param group 0: 3 parameters here, 2 in the torch.optim.Muon group",
        ),
        ((wrong_names.state_dict(), adamw.state_dict()), r"parameter '0.weight' here is 'x0.weight' there"),
        ((muon.state_dict(), amsgrad.state_dict()), r"param group 1 has amsgrad=True"),
        ((muon.state_dict(), None), r"this optimizer has torch.optim.AdamW parameters \['0.bias', '1.weight'"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            shim.load_torch_state_dicts(*args)
    assert_bitwise(shim.functional_state, before[0])
    assert [{**g, "params": None} for g in shim.param_groups] == before[1]

    # the way back refuses settings torch's optimizers cannot run
    def refused(match: str, **kwargs) -> None:
        net = small_net()
        opt = muonfn.optim.Muon(net.named_parameters(), **{"labels": by_ndim(net), **kwargs})
        with pytest.raises(ValueError, match=match):
            opt.torch_state_dicts()

    refused(
        r"param group 0: torch.optim.Muon runs one \(a, b, c\) for every step, not 'polar_express'",
        ns_coefficients="polar_express",
    )
    refused(r"param group 0: torch.optim.Muon does not run adjust_lr_fn='spectral'", adjust_lr_fn="spectral")
    refused(r"param group 0: torch.optim.Muon does not run extra_scale=0.5", extra_scale=0.5)
    refused(
        r"param group 0: views= read parameters as other matrices than torch.optim.Muon does",
        views={"3.weight": muonfn.MatrixView(transposed=True)},
    )
    refused(r"param group 1: weight_decay_mask exempts \['1.weight'\]", weight_decay_mask={"1.weight": False})
    conv = torch.nn.Conv1d(2, 4, 3)
    with pytest.raises(ValueError, match=r"param group 0: parameter 'weight' is 3-D; torch.optim.Muon takes 2-D param"):
        muonfn.optim.Muon(conv.named_parameters()).torch_state_dicts()


def test_shim_takes_torch_optim_muon_spellings():
    """adjust_lr_fn, eps and one (a, b, c) with ns_steps, as torch.optim.Muon takes them: the run of the
    NewtonSchulz they spell, kept in the groups under torch's names; ns_steps is torch's 5 when not given."""
    triple = (3.4445, -4.7750, 2.0315)
    spelled = {"adjust_lr_fn": None, "eps": 1e-6, "ns_coefficients": triple, "ns_steps": 4}
    ours = {"adjust_lr_fn": "original", "ns": muonfn.NewtonSchulz([triple], 4, 1e-6)}
    models = [small_net(), small_net()]
    opts = [muonfn.optim.Muon(m.named_parameters(), lr=0.02, **kw) for m, kw in zip(models, (spelled, ours))]
    group = opts[0].param_groups[0]
    assert (group["adjust_lr_fn"], group["eps"], group["ns_coefficients"], group["ns_steps"]) == (
        "original", 1e-6, (triple,) * 4, None
    )  # fmt: skip
    for g in fixed_grads(models[0], 3):
        for m, o in zip(models, opts):
            step_with(m, g, o)
    assert_bitwise(TensorDict.from_module(models[0]), TensorDict.from_module(models[1]))

    net = small_net()
    opt = muonfn.optim.Muon(net.named_parameters(), adjust_lr_fn="match_rms_adamw", ns_coefficients=triple)
    assert opt.defaults["adjust_lr_fn"] == "match_rms_adamw"  # and torch's 5 steps when ns_steps is not given:
    assert opt.defaults["ns_coefficients"] == muonfn.COEFFICIENTS["keller"].triples
    for kwargs, match in [
        (
            {"ns": muonfn.NewtonSchulz(), "eps": 1e-5},
            r"ns= is the whole Newton–Schulz setting: .*; beside ns=NewtonSchulz\(.*\), eps=1e-05 would be ignored",
        ),
        ({"adjust_lr_fn": "rms"}, r"adjust_lr_fn must be None or one of \[.*'match_rms_adamw'.*\], got 'rms'"),
    ]:
        with pytest.raises(ValueError, match=match):
            muonfn.optim.Muon(net.named_parameters(), **kwargs)


def test_a_partly_stepped_run_migrates_the_stepped_parameters_state_only(monkeypatch: pytest.MonkeyPatch):
    """torch's optimizers keep state for the parameters that stepped, and so does the shim: a
    parameter that never had a gradient has no entry in ``torch_state_dicts()``, as in torch's
    own state_dicts after the same steps, and none in the shim loaded from them."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz)
    settings = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "adjust_lr_fn": "original", "ns": FP32_NS}
    model, theirs_model = small_net(), small_net()
    shim = muonfn.optim.Muon(
        model.named_parameters(), **settings, adamw_lr=3e-3, adamw_weight_decay=0.01, labels=by_ndim(model)
    )
    muon, adamw = torch_pair(theirs_model, lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="original")
    unused = {"3.weight", "3.bias"}  # never a gradient
    for g in fixed_grads(model, 2):
        for net, opts in ((model, (shim,)), (theirs_model, (muon, adamw))):
            for name, p in net.named_parameters():
                p.grad = None if name in unused else g[name].clone()
            for opt in opts:
                opt.step()
    muon_sd, adamw_sd = shim.torch_state_dicts()
    assert muon_sd["state"].keys() == muon.state_dict()["state"].keys() == {0, 2}
    assert adamw_sd["state"].keys() == adamw.state_dict()["state"].keys() == {0, 1, 2, 4}
    resumed = muonfn.optim.Muon(model.named_parameters(), lr=1.0, labels=by_ndim(model))
    resumed.load_torch_state_dicts(muon.state_dict(), adamw.state_dict())
    assert {name for name, p in model.named_parameters() if p not in resumed.state} == unused
    assert_same_state(resumed, model, muon, adamw, theirs_model)


def test_a_bf16_state_goes_to_torch_widened_and_comes_back_narrowed(tmp_path):
    """``torch_state_dicts`` widens a ``state_dtype=torch.bfloat16`` state to the parameters' fp32, as
    torch's optimizers keep it, leaving out the momentum's count (muonfn's alone); loaded back into a
    bf16 shim it is narrowed (exactly: it was bf16), the count from 0, and continues as the shim whose
    count started again, bit for bit. torch's own fp32 state loads narrowed to nearest."""
    settings = {"lr": 0.02, "momentum": 0.9, "adjust_lr_fn": None, "adamw_lr": 3e-3, "state_dtype": torch.bfloat16}
    model = small_net()
    opt = muonfn.optim.Muon(model.named_parameters(), **settings, labels=by_ndim(model))
    grads = fixed_grads(model, 6)
    for g in grads[:3]:
        step_with(model, g, opt)
    torch.save(opt.torch_state_dicts(), tmp_path / "torch_optimizers.pt")
    muon_sd, adamw_sd = torch.load(tmp_path / "torch_optimizers.pt", weights_only=True)
    assert all("state_dtype" not in g for sd in (muon_sd, adamw_sd) for g in sd["param_groups"])
    muon_params = [p for p in model.parameters() if p.ndim == 2]
    adamw_params = [p for p in model.parameters() if p.ndim != 2]
    for sd, params in ((muon_sd, muon_params), (adamw_sd, adamw_params)):
        for index, p in enumerate(params):
            held = opt.state[p]
            assert sd["state"][index].keys() == held.keys() - ({"step"} if p.ndim == 2 else set())
            for key, value in sd["state"][index].items():
                assert value.dtype == torch.float32, key
                assert torch.equal(value, held[key].float()), key
    muon, adamw = torch_pair(small_net(), lr=1.0)
    muon.load_state_dict(muon_sd)
    adamw.load_state_dict(adamw_sd)  # (torch's optimizers take them)

    resumed = small_net()
    resumed.load_state_dict(model.state_dict())
    resumed_opt = muonfn.optim.Muon(resumed.named_parameters(), **settings, labels=by_ndim(resumed))
    resumed_opt.load_torch_state_dicts(muon_sd, adamw_sd)
    for p in muon_params:  # the uninterrupted run, its momentum's count started again
        opt.state[p]["step"] = torch.zeros((), dtype=torch.int64)
    assert_bitwise(resumed_opt.functional_state, opt.functional_state)
    for g in grads[3:]:
        step_with(model, g, opt)
        step_with(resumed, g, resumed_opt)
    assert_bitwise(TensorDict.from_module(resumed), TensorDict.from_module(model))
    assert_bitwise(resumed_opt.functional_state, opt.functional_state)

    theirs_model = small_net()
    muon, adamw = torch_pair(theirs_model, lr=0.02, momentum=0.9)
    for g in grads[:2]:
        step_with(theirs_model, g, muon, adamw)
    narrowed = muonfn.optim.Muon(theirs_model.named_parameters(), **settings, labels=by_ndim(theirs_model))
    narrowed.load_torch_state_dicts(muon.state_dict(), adamw.state_dict())
    for p in theirs_model.parameters():
        torch_state = (muon if p.ndim == 2 else adamw).state[p]
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in torch_state:
                assert torch.equal(narrowed.state[p][key], torch_state[key].to(torch.bfloat16)), key
        assert int(narrowed.state[p]["step"]) == (0 if p.ndim == 2 else 2)
