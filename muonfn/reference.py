r"""One step of ``muonfn.muon(...)`` in plain PyTorch: read this first.

The rest of muonfn computes what :func:`step` computes, only faster: batched, fused, donated,
compiled, vmapped or sharded. ``tests/test_reference.py`` holds those paths to this file, bit
for bit where they do the same arithmetic in the same order.

Parameters with two or more dimensions take Muon (a conv kernel ``(out, in, k…)`` as the
``(out, in·k)`` matrix); the others take AdamW as ``torch.optim.AdamW`` computes it (muonfn's
AdamW orders its arithmetic otherwise, a few ulps apart). For an :math:`A \times B` matrix,
with momentum :math:`\mu`, learning rate :math:`\eta` and decay :math:`\lambda`:

.. math::  b \leftarrow \mu b + (1-\mu) g, \qquad u = \mu b + (1-\mu) g \ \text{(Nesterov)}, \qquad
           p \leftarrow p - \eta\,\bigl(s(A, B)\,\mathrm{NS}(u) + \lambda p\bigr).

:math:`\mathrm{NS}(u) \approx UV^\top` for :math:`u = U\Sigma V^\top`. The scale :math:`s = 0.2\sqrt{\max(A, B)}`
gives the update AdamW's RMS, so one ``lr`` and one ``weight_decay`` serve both groups.
Not here (their docstrings give their math): other matrix views, labels by name, schedules,
caution, bias corrections, Gram Newton–Schulz, and how muonfn's normalisation avoids overflow
(on a CPU a power-of-two prescaling, the same bits wherever this one does not overflow; on a GPU
norms accumulated in fp64), and the shape scale muonfn's Newton–Schulz takes in its last step.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

__all__ = ["KELLER", "SCALES", "adamw_step", "init", "kept", "newton_schulz", "step", "stochastic_round"]

Tensor = torch.Tensor

#: Keller Jordan's quintic, five times (``muonfn.COEFFICIENTS`` holds the other schedules).
KELLER = ((3.4445, -4.7750, 2.0315),) * 5

#: The shape scale :math:`s(A, B)` of an ``A × B`` (fan-out × fan-in) matrix, by ``scale=`` mode.
SCALES: dict[str, Callable[[int, int], float]] = {
    "match_rms_adamw": lambda a, b: 0.2 * math.sqrt(max(a, b)),
    "original": lambda a, b: math.sqrt(max(1.0, a / b)),
    "spectral": lambda a, b: math.sqrt(max(a, b)),
    "unit_rms_norm": lambda a, b: math.sqrt(a / b),
    "none": lambda a, b: 1.0,
}


def newton_schulz(
    G: Tensor,
    triples: Sequence[tuple[float, float, float]] = KELLER,
    *,
    eps: float = 1e-7,
    norm_factor: float = 1.0,
    dtype: torch.dtype | None = None,
) -> Tensor:
    r"""Approximately :math:`UV^\top` for :math:`G = U\Sigma V^\top`: each step maps every singular
    value through :math:`a\sigma + b\sigma^3 + c\sigma^5` and leaves the singular vectors alone."""
    tall = G.size(-2) > G.size(-1)  # iterate on the wide side, where X Xᵀ is the small Gram matrix
    X = (G.mT if tall else G).to(torch.promote_types(G.dtype, torch.float32))
    X = X / torch.clamp_min(norm_factor * torch.linalg.matrix_norm(X, keepdim=True), eps)  # every σ ≤ 1
    X = X.to(dtype or X.dtype)  # muonfn's default: bf16 where the hardware multiplies it fastest
    for a, b, c in triples:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    X = X.to(G.dtype)
    return X.mT if tall else X


def init() -> dict[str, Any]:
    """The state: the step count, and per parameter name the moments :func:`step` creates when first used."""
    return {"step": 0, "momentum": {}, "exp_avg": {}, "exp_avg_sq": {}, "row_second_moment": {}}


@torch.no_grad()
def step(
    params: dict[str, Tensor],
    grads: dict[str, Tensor],
    state: dict[str, Any],
    *,
    lr: float = 1e-3,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.1,
    scale: str = "match_rms_adamw",
    ns: Callable[[Tensor], Tensor] = newton_schulz,
    variant: str = "muon",
    beta2: float = 0.95,
    adaptive_eps: float = 1e-10,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_names: Collection[str] = (),
    state_dtype: torch.dtype | None = None,
) -> None:
    """One step, in place on ``params`` and ``state``. ``adamw_names``: matrices for AdamW
    (``muonfn.muon`` sends embeddings and output heads there by name). ``variant``: ``"normuon"``
    or ``"adamuon"`` adapt the orthogonalized update (AdaMuon's defaults: ``momentum=0.9, nesterov=False``).
    ``state_dtype``: the momentum and AdamW's moments kept in that dtype, computed in fp32 (see :func:`kept`).

    Example:
        >>> params, state = {"w": torch.ones(2, 3), "b": torch.zeros(2)}, muonfn.reference.init()
        >>> muonfn.reference.step(params, {"w": torch.ones(2, 3), "b": torch.ones(2)}, state, lr=0.1)
        >>> list(state["momentum"]), list(state["exp_avg"]), params["b"]  # AdamW's first step: -lr·sign(g)
        (['w'], ['b'], tensor([-0.1000, -0.1000]))
    """
    state["step"] += 1
    for name, p in params.items():
        g = grads[name]
        if p.ndim < 2 or name in adamw_names:
            adamw_step(p, g, state, name, lr=lr, betas=adamw_betas, eps=adamw_eps, weight_decay=weight_decay,
                       state_dtype=state_dtype)  # fmt: skip
            continue
        b = state["momentum"].setdefault(name, torch.zeros_like(p, dtype=state_dtype))
        wide = b.float() if state_dtype else b  # a state of its own dtype is computed in fp32
        b = kept(b, wide.lerp_(g.to(wide.dtype), 1 - momentum), "momentum", name, state["step"])  # b ← μ b + (1 − μ) g
        u = g.to(b.dtype).lerp(b, momentum) if nesterov else b  # Nesterov: μ b + (1 − μ) g
        M = (u.sign() if variant == "adamuon" else u).reshape(len(u), -1)  # (out, in, k…) → (out, in·k)
        ortho = ns(M)
        if variant == "normuon":  # NorMuon: each row over the root of an EMA of its mean square
            v = state["row_second_moment"].setdefault(name, M.new_zeros(len(M), 1))
            ortho = adapted(ortho, v.lerp_(ortho.square().mean(-1, keepdim=True), 1 - beta2), adaptive_eps)
        elif variant == "adamuon":  # AdaMuon: each entry over the root of an EMA of its square
            v = state["exp_avg_sq"].setdefault(name, torch.zeros_like(M, dtype=state_dtype))
            v = kept(
                v, (v.float() if state_dtype else v).lerp_(ortho * ortho, 1 - beta2), "exp_avg_sq", name, state["step"]
            )
            ortho = adapted(ortho, v, adaptive_eps)
        # -η(s·O + λp), as muonfn rounds it: (-ηs)·O, then one multiply-add of (-ηλ)·p, then added to p
        update = ortho.mul(-lr * SCALES[scale](*M.shape)).add_(p.reshape(M.shape), alpha=-lr * weight_decay)
        p.add_(update.reshape(p.shape))


def adapted(ortho: Tensor, v: Tensor, eps: float) -> Tensor:
    """``ortho / (√v + ε)`` given the Frobenius norm of a semi-orthogonal matrix, √min(m, n): the
    presets' ``rescale="orthogonal"``, which the ``"match_rms_adamw"`` scale turns into an RMS of 0.2."""
    X = ortho / (v.sqrt() + eps)
    return X * ((torch.linalg.matrix_norm(X) + eps).reciprocal() * math.sqrt(min(X.shape)))


def adamw_step(
    p: Tensor,
    g: Tensor,
    state: dict[str, Any],
    name: str,
    *,
    lr: float,
    betas: Any,
    eps: float,
    weight_decay: float,
    state_dtype: torch.dtype | None = None,
) -> None:
    """``torch.optim.AdamW``'s step of one tensor, operation for operation (with ``state_dtype``, the
    moments computed in fp32)."""
    (b1, b2), t = betas, state["step"]
    m = state["exp_avg"].setdefault(name, torch.zeros_like(p, dtype=state_dtype))
    v = state["exp_avg_sq"].setdefault(name, torch.zeros_like(p, dtype=state_dtype))
    p.mul_(1 - lr * weight_decay)
    m_wide, v_wide, g = (m.float(), v.float(), g.float()) if state_dtype else (m, v, g)
    m = kept(m, m_wide.lerp_(g, 1 - b1), "exp_avg", name, t)
    v = kept(v, v_wide.mul_(b2).addcmul_(g, g, value=1 - b2), "exp_avg_sq", name, t)
    denom = (v.sqrt() / (1 - b2**t) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1**t))


def kept(held: Tensor, new: Tensor, field: str, name: str, t: int) -> Tensor:
    """``new`` (this step's value of state entry ``field`` of parameter ``name``) stored in ``held``:
    as it is into fp32, rounded stochastically into bf16 with a key mixing the step ``t`` and the
    names. Returns ``new``: the step itself uses the unrounded value."""
    if held.dtype == torch.bfloat16:
        key = (t * 0x9E3779B9 + zlib.crc32(f"{field}:{name}".encode())) & 0xFFFFFFFF
        new_bits = stochastic_round(new, key - (1 << 32) if key >= 1 << 31 else key)  # (the key as an int32)
        held.copy_(new_bits)
    elif held is not new:
        held.copy_(new)
    return new


def stochastic_round(x: Tensor, key: int) -> Tensor:
    """``x`` (fp32) to bf16: 16 bits hashed from each entry's fp32 bits and ``key`` (lowbias32) added
    below bf16's last bit, then the low 16 bits cut: rounded up with probability the cut fraction."""
    bits = x.view(torch.int32)
    h = bits ^ key
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B - (1 << 32))):
        h = (h ^ ((h >> shift) & ((1 << (32 - shift)) - 1))) * multiplier
    h = h ^ ((h >> 16) & 0xFFFF)
    return ((bits + (h & 0xFFFF)) & -0x10000).view(torch.float32).to(torch.bfloat16)
