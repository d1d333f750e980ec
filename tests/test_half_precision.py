"""fp16 and bf16 leaves: every variant's update finite and close to the fp32 update of the same input.

fp16's range stops at 6e-8: the squares of ordinary entries (an orthogonalized update's near-zero
entries, gradients below 2.4e-4) are zero there and an epsilon of 1e-8 or 1e-10 rounds to zero, so
a second moment kept and divided in fp16 gave inf and nan. bf16 has fp32's range but 8 bits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _strategies import iteration_dtype
from tensordict import TensorDict

import muonfn

#: unit roundoff: a quantity rounded once to the dtype is off by at most this, relatively
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}

#: how many roundings to the leaf's dtype an update may take (momentum, the orthogonalized
#: matrix, the adaptation, the shape scale, the decay, the learning rate), each at most one unit
#: roundoff relatively
ROUNDINGS = 8

#: preset, options, and whether its first step takes the sign of each entry of the
#: orthogonalized matrix (AdaMuon: V_1 = (1-β)O², so Ô = O/√V_1 is ±1/√(1-β) whatever the
#: entry's size; an entry within rounding of zero may come out with either sign)
VARIANTS: dict[str, tuple[Any, dict[str, Any], bool]] = {
    "muon": (muonfn.muon, {}, False),
    "muon heavyball caution": (muonfn.muon, {"cautious_mode": "heavyball"}, False),
    "muon momentum bias correction": (muonfn.muon, {"momentum_bias_correction": True}, False),
    "normuon": (muonfn.normuon, {}, False),
    "normuon preserve_norm": (muonfn.normuon, {"rescale": "preserve_norm", "scale": "original"}, False),
    "adamuon": (muonfn.adamuon, {}, True),
    "adamuon of the momentum": (muonfn.adamuon, {"sign_momentum": False}, True),
    "adamuon bias corrections": (
        muonfn.adamuon,
        {"sign_momentum": False, "second_moment_bias_correction": True, "momentum_bias_correction": True},
        True,
    ),
    "adamuon pytorch_optimizer caution": (muonfn.adamuon, {"cautious_mode": "pytorch_optimizer"}, True),
    "adamuon cautious weight decay": (muonfn.adamuon, {"sign_momentum": False, "cautious_weight_decay": True}, True),
    "adamw": (muonfn.adamw, {}, False),
    "adamw nesterov": (muonfn.adamw, {"nesterov": True}, False),
    "adamw timm nesterov": (muonfn.adamw, {"nesterov": "timm"}, False),
}


def inputs(dtype: torch.dtype, steps: int) -> tuple[TensorDict, list[TensorDict]]:
    """Parameters and gradients representable in ``dtype``: entries of magnitudes 1e-3 to 1 (whose
    squares fp16 flushes to zero or to subnormals), a matrix with a zero row (a neuron without
    gradient) and a vector with zero entries."""
    g = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        magnitudes = 10.0 ** torch.empty(shape).uniform_(-3.0, 0.0, generator=g)
        signs = torch.randint(0, 2, shape, generator=g) * 2 - 1
        return (signs * magnitudes).to(dtype)

    def leaves() -> TensorDict:
        return TensorDict({"w": draw(48, 80), "v": draw(32, 24), "b": draw(48)}, [])

    grads = [leaves() for _ in range(steps)]
    for step in grads:
        step["w"][3] = 0.0
        step["b"][::5] = 0.0
    return leaves(), grads


def run(tx: muonfn.Transform, params: TensorDict, grads: list[TensorDict]) -> list[TensorDict]:
    """Each step's updates, applied as they come."""
    state, out = tx.init(params), []
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = muonfn.apply_updates(params, updates)
        out.append(updates)
    return out


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


def share_off(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> float:
    """The share of the entries further than ``tolerance`` times the largest entry from their value."""
    off = (got.double() - expected.double()).abs() > tolerance * expected.double().abs().max()
    return float(off.double().mean())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_half_precision_updates_are_finite_and_close_to_fp32(variant, dtype):
    preset, options, signs = VARIANTS[variant]
    params, grads = inputs(dtype, steps=3)
    narrow = run(preset(lr=0.02, **options), params, grads)
    wide = run(preset(lr=0.02, **options), params.float(), [g.float() for g in grads])
    for t, updates in enumerate(narrow):
        for key, u in updates.items():
            assert u.dtype == dtype, key
            assert torch.isfinite(u).all(), f"step {t + 1}, {key!r}: {int((~torch.isfinite(u)).sum())} non-finite"
    # each rounding to the leaf's dtype, or to the Newton–Schulz iteration's where that is coarser
    # (bf16 where the run's CPU rule forces it: the two runs' inputs to it then round apart)
    matrices = [t.shape for t in params.values() if t.ndim == 2] if preset is not muonfn.adamw else []
    iteration = iteration_dtype(*matrices)
    tolerance = ROUNDINGS * max(UNIT_ROUNDOFF[dtype], torch.finfo(iteration).eps / 2)
    if not signs:
        for t, (got, expected) in enumerate(zip(narrow, wide)):
            for key, u in got.items():
                assert relative_error(u, expected[key]) <= tolerance, f"step {t + 1}, {key!r}"
        return
    # Only the first step sees the same input in both dtypes: later ones take signs of
    # rounded moments (the sign momentum flips where it is near zero, and a flip moves
    # every entry), so they are checked finite. In the first, an entry within rounding of
    # zero flips: a share of the order of the unit roundoff.
    for key, u in narrow[0].items():
        assert share_off(u, wide[0][key], tolerance) <= tolerance, key


# --- the second moments themselves -----------------------------------------------------------


def orthogonalized_like(steps: int) -> tuple[TensorDict, list[TensorDict]]:
    """fp16 params and incoming updates with entries whose squares fp16 cannot hold (down to 1e-5)
    and a zero row, as an orthogonalized update has near-zero entries."""
    params, grads = inputs(torch.float16, steps)
    for g in grads:
        g["w"][5] *= 1e-2  # entries of 1e-5 to 1e-2: squares of 1e-10 to 1e-4
    return params.select("w", "v"), [g.select("w", "v") for g in grads]


@pytest.mark.parametrize(
    "make",
    [
        lambda: muonfn.scale_by_element_rms(0.95, rescale="none"),
        lambda: muonfn.scale_by_element_rms(0.95, bias_correction=True, rescale="orthogonal"),
        lambda: muonfn.scale_by_neuron_norm(0.95, rescale="preserve_norm"),
    ],
    ids=["element_rms", "element_rms bias-corrected", "neuron_norm"],
)
def test_an_fp16_leaf_is_adapted_in_fp32_and_rounded_once(make):
    """The second moment kept in fp32, so the fp16 update is the fp32 update of the same input, rounded."""
    params, grads = orthogonalized_like(steps=3)
    tx = make()
    narrow_state, wide_state = tx.init(params), tx.init(params.float())
    for g in grads:
        narrow, narrow_state = tx.update(g, narrow_state, params)
        wide, wide_state = tx.update(g.float(), wide_state, params.float())
        for key, u in narrow.items():
            assert u.dtype == torch.float16
            assert torch.equal(u, wide[key].half()), key
        for key, moment in narrow_state.items(True, True):
            assert moment.dtype == wide_state[key].dtype and torch.equal(moment, wide_state[key]), key


@pytest.mark.parametrize("nesterov", [False, True, "timm"], ids=["adam", "nesterov", "timm"])
def test_adam_keeps_the_second_moment_of_an_fp16_leaf_in_fp32(nesterov):
    """Every entry within a few roundings (of the largest) of fp32 Adam on the same input. The
    first moment is kept in fp16, as the momentum is: gradients of 1e-3 and more keep it a
    normal number (where it cancels to near zero, fp16's absolute error remains), while their
    squares times 1 - β₂ = 1e-3 are below fp16's range."""
    params, grads = inputs(torch.float16, steps=3)
    tx = muonfn.scale_by_adam(0.9, 0.999, eps=1e-8, nesterov=nesterov)
    narrow_state, wide_state = tx.init(params), tx.init(params.float())
    assert narrow_state["exp_avg_sq", "w"].dtype == torch.float32
    assert narrow_state["exp_avg", "w"].dtype == torch.float16
    for g in grads:
        narrow, narrow_state = tx.update(g, narrow_state, params)
        wide, wide_state = tx.update(g.float(), wide_state, params.float())
        for key, u in narrow.items():
            assert u.dtype == torch.float16
            error = (u.float() - wide[key]).abs().max()
            assert error <= 4 * UNIT_ROUNDOFF[torch.float16] * wide[key].abs().max(), key


@pytest.mark.parametrize(
    ("make", "entry", "match"),
    [
        (
            lambda: muonfn.scale_by_adam(),
            ("exp_avg_sq", "w"),
            r"scale_by_adam: gradient 'w' of dtype torch.float16 does not fit its state 'exp_avg_sq.w' of dtype "
            r"torch.float16: the second moment of a torch.float16 leaf is kept in torch.float32",
        ),
        (
            lambda: muonfn.scale_by_neuron_norm(),
            ("row_second_moment", "w"),
            r"scale_by_neuron_norm: gradient 'w' of shape \(48, 80\) and dtype torch.float16 does not fit its "
            r"state 'row_second_moment.w' of shape \(48, 1\) and dtype torch.float16 "
            r"\(expected \(48, 1\) and torch.float32\)",
        ),
    ],
    ids=["adam", "neuron_norm"],
)
def test_an_fp16_second_moment_is_refused_naming_the_dtype_it_is_kept_in(make, entry, match):
    params, grads = orthogonalized_like(steps=1)
    tx = make()
    state = tx.init(params)
    state[entry] = state[entry].half()
    before = state.clone()
    with pytest.raises(ValueError, match=match):
        tx.update(grads[0], state, params)
    assert (state == before).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_qk_clip_of_half_precision_weights_is_the_fp32_clip_to_two_roundings(dtype):
    """The factors are computed in fp32, rounded to the weights' dtype, and multiplied in: two
    roundings of at most one unit each (and the fp32 reference's, far smaller)."""
    g = torch.Generator().manual_seed(0)
    params = TensorDict({"q": torch.randn(8, 6, generator=g), "k": torch.randn(8, 6, generator=g)}, []).to(dtype)
    logits = torch.tensor([50.0, 400.0, 1e4, 6e4]).to(dtype)  # 6e4: near fp16's largest number
    heads = {"attn": muonfn.QKHeads(heads=4, query="q", key="k")}
    narrow = muonfn.qk_clip(params, {"attn": logits}, heads)
    wide = muonfn.qk_clip(params.float(), {"attn": logits.float()}, heads)
    for key in ("q", "k"):
        assert narrow[key].dtype == dtype
        error = (narrow[key].double() - wide[key].double()).abs()
        assert (error <= 2.5 * UNIT_ROUNDOFF[dtype] * wide[key].double().abs()).all(), key
