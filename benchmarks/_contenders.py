"""The optimizer steps the benchmarks compare, all over the same parameters and gradients.

Every ``make_*`` function returns a zero-argument step function. Hyperparameters are
the same for all (Muon lr 0.02, momentum 0.95 Nesterov, weight decay 0.1, update scale
0.2·√max(A, B); AdamW lr 3e-4, betas (0.9, 0.95)); they do not change the cost.

Other libraries' Muon (the ``bench`` extra: heavyball, timm, pytorch-optimizer) are
contenders when installed: :func:`installed_peers` lists them and says which are missing.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import math
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from _sets import ParamSet
from tensordict import TensorDict, TensorDictBase

import muonfn

LR, MOMENTUM, WD = 0.02, 0.95, 0.1
ADAM_LR, BETAS, ADAM_EPS = 3e-4, (0.9, 0.95), 1e-8
KELLER = (3.4445, -4.7750, 2.0315)

Step = Callable[[], Any]


def _key(name: str) -> tuple[str, ...]:
    return tuple(name.split("."))


def tensordicts(ps: ParamSet) -> tuple[TensorDictBase, TensorDictBase]:
    """Params and grads as TensorDicts sharing storage with the module's tensors."""
    named = ps.named()
    params = TensorDict({_key(n): p.detach() for n, p in named}, batch_size=[])
    grads = TensorDict({_key(n): p.grad for n, p in named}, batch_size=[])
    return params, grads


def _settings(ps: ParamSet) -> dict[str, Any]:
    """The hyperparameters every muonfn contender shares (functional and shim alike)."""
    return {
        "lr": LR,
        "momentum": MOMENTUM,
        "weight_decay": WD,
        "adamw_lr": ADAM_LR,
        "adamw_betas": BETAS,
        "adamw_eps": ADAM_EPS,
        "labels": ps.labels,
        "views": ps.views,
    }


def muonfn_tx(ps: ParamSet, **options: Any) -> muonfn.Transform:
    return muonfn.muon(**_settings(ps), **options)


def make_functional(ps: ParamSet, compile: bool = False, **options: Any) -> Step:
    """``tx.update`` + ``apply_updates``: new params and state every step."""
    return _functional_step(muonfn_tx(ps, **options), ps, compile)


def _functional_step(tx: muonfn.Transform, ps: ParamSet, compile: bool) -> Step:
    params, grads = tensordicts(ps)
    box = {"params": params, "state": tx.init(params)}

    def step_fn(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase) -> Any:
        updates, state = tx.update(grads, state, params)
        return muonfn.apply_updates(params, updates), state

    fn = torch.compile(step_fn, fullgraph=True) if compile else step_fn

    def step() -> None:
        box["params"], box["state"] = fn(grads, box["state"], box["params"])

    return step


def make_donated(ps: ParamSet, **options: Any) -> Step:
    """``tx.update`` with ``donate_state=True`` and ``apply_updates_``: the state and the
    parameters are updated in place, as a torch.optim shim steps."""
    return _donated_step(muonfn_tx(ps, donate_state=True, **options), ps)


def _donated_step(tx: muonfn.Transform, ps: ParamSet) -> Step:
    params, grads = tensordicts(ps)
    box = {"state": tx.init(params)}

    def step() -> None:
        updates, box["state"] = tx.update(grads, box["state"], params)
        muonfn.apply_updates_(params, updates)

    return step


def make_shim(ps: ParamSet, **options: Any) -> Step:
    """The torch.optim shim over the module's parameters (``options``: e.g. ``donate_state=True``)."""
    import muonfn.optim

    opt = muonfn.optim.Muon(ps.model.named_parameters(), **_settings(ps), **options)
    return opt.step


def _matrix_params_2d(ps: ParamSet, grads: list[torch.Tensor] | None = None) -> list[torch.nn.Parameter]:
    """torch.optim.Muon takes 2-D parameters only: conv kernels are given as their
    ``(out, in·k·k)`` reshapes, experts one matrix each (views sharing storage, so the
    step updates the module's tensors, as a user reshaping for torch would). The peers get
    the same matrices, so that every Muon sees the ones muonfn's views give. ``grads``
    replaces the gradients (one per matrix, in order), for a peer that writes to them."""
    out = []
    for name, p in ps.matrix_params():
        for m, g in zip(ps.matrices(name, p.detach()), ps.matrices(name, p.grad)):
            q = torch.nn.Parameter(m, requires_grad=False)
            q.grad = g
            out.append(q)
    if grads is not None:
        for q, g in zip(out, grads, strict=True):
            q.grad = g
    return out


def torch_muon_optimizers(ps: ParamSet, fused: bool = False) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    """torch.optim.Muon on the matrices and torch.optim.AdamW on the rest (``foreach=True``, or ``fused=True``)."""
    muon = torch.optim.Muon(
        _matrix_params_2d(ps), lr=LR, momentum=MOMENTUM, weight_decay=WD, adjust_lr_fn="match_rms_adamw"
    )
    others = [p for _, p in ps.other_params()]
    kernel = {"fused": True} if fused else {"foreach": True}
    adamw = torch.optim.AdamW(others, lr=ADAM_LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WD, **kernel)
    return muon, adamw


def make_torch_muon(ps: ParamSet, fused: bool = False) -> Step:
    """torch.optim.Muon on the matrices + torch.optim.AdamW on the rest (``foreach=True``, or
    ``fused=True``)."""
    muon, adamw = torch_muon_optimizers(ps, fused)

    def step() -> None:
        muon.step()
        adamw.step()

    return step


def plain_newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Newton–Schulz as a user writes it for the CPU: fp32, one (batch of) matrix at a time."""
    a, b, c = KELLER
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * A @ A
        x = a * x + B @ x
    return (x.mT if tall else x).to(g.dtype)


def make_plain_loop(ps: ParamSet) -> Step:
    """A hand-written per-parameter loop (momentum, fp32 Newton–Schulz, decay, apply) +
    torch.optim.AdamW(foreach=True) on the rest."""
    mats = []
    for name, p in ps.matrix_params():
        view = ps.view(name)
        scales = [0.2 * math.sqrt(max(r, c)) for r, c in view.blocks(p.shape)]
        mats.append((p, torch.zeros_like(p), view, scales))
    others = [p for _, p in ps.other_params()]
    adamw = torch.optim.AdamW(others, lr=ADAM_LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WD, foreach=True)

    @torch.no_grad()
    def step() -> None:
        for p, buf, view, scales in mats:
            buf.lerp_(p.grad, 1 - MOMENTUM)
            u = p.grad.lerp(buf, MOMENTUM)
            blocks = [plain_newton_schulz(m) * s for m, s in zip(view.to_matrices(u), scales)]
            p.mul_(1 - LR * WD).add_(view.from_matrices(blocks, p.shape), alpha=-LR)
        adamw.step()

    return step


# The elementwise part alone: AdamW on every parameter.


def make_functional_adamw(ps: ParamSet, compile: bool = False) -> Step:
    """``muonfn.adamw``'s update + ``apply_updates``: new params and state every step."""
    return _functional_step(muonfn.adamw(lr=ADAM_LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WD), ps, compile)


def make_donated_adamw(ps: ParamSet) -> Step:
    """``muonfn.adamw(donate_state=True)`` with ``apply_updates_``: state and parameters in place."""
    return _donated_step(muonfn.adamw(lr=ADAM_LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WD, donate_state=True), ps)


def make_torch_adamw(ps: ParamSet, foreach: bool = True) -> Step:
    params = [p for _, p in ps.named()]
    opt = torch.optim.AdamW(params, lr=ADAM_LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WD, foreach=foreach)
    return opt.step


def make_hand_adamw(ps: ParamSet, use_apply: bool) -> Step:
    """AdamW written by hand over TensorDicts, functional like muonfn's: the same ops
    either as TensorDict arithmetic (one multi-tensor kernel per op) or as
    ``TensorDict.apply`` with per-leaf lambdas (a Python loop per op)."""
    params, grads = tensordicts(ps)
    b1, b2 = BETAS
    box: dict[str, Any] = {
        "params": params,
        "m": params.apply(torch.zeros_like),
        "v": params.apply(torch.zeros_like),
        "t": 0,
    }

    def step() -> None:
        box["t"] += 1
        bc1, bc2 = 1 - b1 ** box["t"], 1 - b2 ** box["t"]
        p, m, v = box["params"], box["m"], box["v"]
        if use_apply:
            m = m.apply(lambda m, g: m.lerp(g, 1 - b1), grads)
            v = v.apply(lambda v, g: v.mul(b2).addcmul(g, g, value=1 - b2), grads)
            denom = v.apply(lambda v: v.sqrt().div(math.sqrt(bc2)).add(ADAM_EPS))
            p = p.apply(lambda p, m, d: p.mul(1 - ADAM_LR * WD).addcdiv(m, d, value=-ADAM_LR / bc1), m, denom)
        else:
            m = m.lerp(grads, 1 - b1)
            v = v.mul(b2).addcmul(grads, grads, value=1 - b2)
            denom = v.sqrt().div(math.sqrt(bc2)).add(ADAM_EPS)
            p = p.mul(1 - ADAM_LR * WD).addcdiv(m, denom, value=-ADAM_LR / bc1)
        box["params"], box["m"], box["v"] = p, m, v

    return step


# Peers: other libraries' Muon, each with AdamW (the library's own where it has one) on the
# non-matrices, configured as close to the shared hyperparameters as its API allows (the
# deviations are listed in RESULTS.md). All of them run Newton–Schulz in bf16, as
# torch.optim.Muon does.


@dataclass(frozen=True)
class Peer:
    """A peer contender: its name in the tables, the package that provides it, and a builder
    ``make(ps, matrix_grads)`` (``matrix_grads``: private gradients for a peer that writes to
    its gradients, allocated before the peak-memory window, else ``None``)."""

    name: str
    package: str
    make: Callable[[ParamSet, list[torch.Tensor] | None], Step]
    writes_grads: bool = False
    compiled: bool = False

    def entry_make(self, ps: ParamSet) -> Callable[[], Step]:
        grads = None
        if self.writes_grads:
            grads = [g.clone() for n, p in ps.matrix_params() for g in ps.matrices(n, p.grad)]
        return lambda: self.make(ps, grads)


#: the private package timm's optimizer modules are loaded under, so that ``timm`` itself is never
#: put in ``sys.modules`` by us (``importlib.util.find_spec("timm")``, which transformers calls,
#: raises on a stand-in without a ``__spec__``, and a later ``import timm`` would get the stand-in)
TIMM_OPTIM_ALIAS = "_muonfn_bench_timm_optim"


def load_timm_muon() -> types.ModuleType:
    """``timm.optim.muon`` without running ``timm/__init__`` and ``timm/optim/__init__``: they
    import torchvision, whose PyPI wheel expects a CUDA build of torch; the module itself
    needs only torch and its siblings in ``timm/optim``. It is loaded from its file under
    :data:`TIMM_OPTIM_ALIAS`, a package of our own with a real spec, so that ``timm`` is
    left to be imported (or looked up) as usual. Raises ``ImportError`` when timm is not
    installed."""
    name = f"{TIMM_OPTIM_ALIAS}.muon"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("timm")  # the package's location; its __init__ is not run
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("timm is not installed")
    optim = os.path.join(next(iter(spec.submodule_search_locations)), "optim")
    if not os.path.isfile(os.path.join(optim, "muon.py")):
        raise ImportError(f"this timm ({optim}) has no optim/muon.py")
    if TIMM_OPTIM_ALIAS not in sys.modules:  # the package the module's relative imports resolve in
        package_spec = importlib.machinery.ModuleSpec(TIMM_OPTIM_ALIAS, None, is_package=True)
        package_spec.submodule_search_locations = [optim]
        sys.modules[TIMM_OPTIM_ALIAS] = importlib.util.module_from_spec(package_spec)
    return importlib.import_module(name)


@contextlib.contextmanager
def _heavyball_compile_mode(mode: str | None) -> Iterator[None]:
    """heavyball compiles its fused functions on first call unless its module-level
    ``compile_mode`` is ``None``; it is read at every call, so each step sets its own."""
    from heavyball import utils

    saved = utils.compile_mode
    utils.compile_mode = mode
    try:
        yield
    finally:
        utils.compile_mode = saved


def make_heavyball_muon(ps: ParamSet, compiled: bool = False) -> Step:
    """heavyball's ``Muon`` on the matrices and its ``AdamW`` on the rest (``SplitOpt``).

    Eager: ``heavyball.utils.compile_mode = None`` (heavyball is compile-first: by default each
    of its fused functions is ``torch.compile``'d on first call). Compiled: the library's
    default mode for those functions and ``compile_step=True`` (the whole step compiled,
    ``fullgraph=True``; the first step runs eagerly to build the state). ``consume_grad=False``:
    by default heavyball sets each ``.grad`` to ``None`` as it reads it (its ``zero_grad``), and
    the contenders step the same gradients again."""
    import heavyball

    mode = heavyball.utils.compile_mode if compiled else None
    with _heavyball_compile_mode(mode):
        opt = heavyball.SplitOpt(
            [
                {
                    "params": _matrix_params_2d(ps),
                    "optimizer": heavyball.Muon,
                    "lr": LR,
                    "betas": (MOMENTUM, 0.99),  # beta1 is the momentum; beta2 is unused by Muon
                    "nesterov": True,
                    "weight_decay": WD,
                    "compile_step": compiled,
                    "consume_grad": False,
                },
                {
                    "params": [p for _, p in ps.other_params()],
                    "optimizer": heavyball.AdamW,
                    "lr": ADAM_LR,
                    "betas": BETAS,
                    "eps": ADAM_EPS,
                    "weight_decay": WD,
                    "compile_step": compiled,
                    "consume_grad": False,
                },
            ]
        )

    def step() -> None:
        with _heavyball_compile_mode(mode):
            opt.step()

    return step


def make_timm_muon(ps: ParamSet) -> Step:
    """timm's ``Muon`` (``timm.optim.muon``) with its AdamW fallback on the non-matrices."""
    timm_muon = load_timm_muon()
    opt = timm_muon.Muon(
        [
            {"params": _matrix_params_2d(ps)},
            # timm's fallback takes Nesterov from the group (NAdamW when on) and eps from the
            # group (Newton–Schulz's 1e-7 by default): plain AdamW with AdamW's eps
            {"params": [p for _, p in ps.other_params()], "use_fallback": True, "nesterov": False, "eps": ADAM_EPS},
        ],
        lr=LR,
        momentum=MOMENTUM,
        nesterov=True,
        weight_decay=WD,
        adjust_lr_fn="match_rms_adamw",
        fallback_lr_scale=ADAM_LR / LR,  # the fallback's lr is the group's lr times this
        betas=BETAS,
    )
    return opt.step


def make_pytorch_optimizer_muon(ps: ParamSet, matrix_grads: list[torch.Tensor] | None) -> Step:
    """pytorch-optimizer's ``Muon``: a ``use_muon`` group of matrices and its AdamW group.

    Its Nesterov blend is written into the gradients (``_foreach_lerp_(grads, buffers)``), so
    it gets its own copy of the matrices' gradients: the others keep stepping the same ones."""
    from pytorch_optimizer import Muon

    opt = Muon(
        [
            {"params": _matrix_params_2d(ps, matrix_grads), "use_muon": True},
            {"params": [p for _, p in ps.other_params()], "use_muon": False},
        ],
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=WD,
        nesterov=True,
        use_adjusted_lr=True,  # 0.2·√max(A, B), as match_rms_adamw
        adamw_lr=ADAM_LR,
        adamw_betas=BETAS,
        adamw_wd=WD,
        adamw_eps=ADAM_EPS,
    )
    return opt.step


PEERS: tuple[Peer, ...] = (
    Peer("heavyball Muon", "heavyball", lambda ps, _: make_heavyball_muon(ps)),
    Peer("heavyball Muon compiled", "heavyball", lambda ps, _: make_heavyball_muon(ps, compiled=True), compiled=True),
    Peer("timm Muon", "timm", lambda ps, _: make_timm_muon(ps)),
    Peer("pytorch-optimizer Muon", "pytorch_optimizer", make_pytorch_optimizer_muon, writes_grads=True),
)


def _importable(package: str) -> bool:
    if package == "timm":
        try:
            load_timm_muon()
        except ImportError:
            return False
        return True
    return importlib.util.find_spec(package) is not None


def installed_peers(compiled: bool, log: Callable[[str], None]) -> list[Peer]:
    """The peers whose package is installed (with the compiled variants if ``compiled``); a
    note for each missing package."""
    found, missing = [], set()
    for peer in PEERS:
        if not _importable(peer.package):
            missing.add(peer.package)
        elif compiled or not peer.compiled:
            found.append(peer)
    for package in sorted(missing):
        log(f"  skipped: {package} is not installed (pip install -e '.[bench]')")
    return found
