"""A matrix branch's last stage: ``u = -η(s·NS(u) + λp)``, computed as ``(-ηs)·NS(u) + (-ηλ)·p``."""

from __future__ import annotations

import math

import pytest
import torch
from _strategies import assert_td_equal, gaussian
from tensordict import TensorDict

import muonfn

LR, WD = 0.02, 0.1
SHAPES = {"wide": (12, 20), "tall": (20, 12), "square": (8, 8)}


def params_and_grads() -> tuple[TensorDict, TensorDict]:
    params = TensorDict({k: gaussian(*s, seed=i) for i, (k, s) in enumerate(SHAPES.items())}, batch_size=[])
    grads = TensorDict({k: gaussian(*s, seed=10 + i) for i, (k, s) in enumerate(SHAPES.items())}, batch_size=[])
    return params, grads


def match_rms(rows: int, cols: int) -> float:
    return 0.2 * math.sqrt(max(rows, cols))


def chained(last: muonfn.Transform, lr, wd, mask=None) -> muonfn.Transform:
    return muonfn.chain(last, muonfn.add_decayed_weights(wd, mask=mask), muonfn.scale_by_learning_rate(lr))


def step(tx: muonfn.Transform, params: TensorDict, grads: TensorDict) -> tuple[TensorDict, TensorDict]:
    return tx.update(grads.clone(), tx.init(params), params)


@pytest.mark.parametrize("as_tensors", [False, True])
def test_numbers_give_minus_lr_times_the_scale_to_newton_schulz_and_decay_in_one_multiply_add(as_tensors) -> None:
    """η and λ numbers, or 0-d tensors on the host read as numbers: ``(-ηs)`` goes into each
    Newton–Schulz call (its last step) and the decay is one ``add(alpha=-ηλ)``, the same bits
    either way; the masked leaf is not decayed."""
    params, grads = params_and_grads()
    ns = muonfn.NewtonSchulz(dtype=torch.float32)
    lr, wd = (torch.tensor(LR, dtype=torch.float64), torch.tensor(WD, dtype=torch.float64)) if as_tensors else (LR, WD)
    tx = muonfn.descent(lr, wd, ns=ns, scale="match_rms_adamw", mask={"square": False})
    updates, _ = step(tx, params, grads)
    for key, g in grads.items():
        expected = ns.orthogonalize(g, scale=-LR * match_rms(*g.shape))
        if key != "square":
            expected = torch.add(expected, params[key], alpha=-LR * WD)
        assert torch.equal(updates[key], expected), key


def test_a_map_of_ones_own_is_scaled_after_it() -> None:
    """A map that is not Newton–Schulz is multiplied by ``-ηs`` once, after it."""
    params, grads = params_and_grads()
    tx = muonfn.descent(LR, WD, ns=muonfn.polar, scale="spectral")
    updates, _ = step(tx, params, grads)
    for key, g in grads.items():
        expected = muonfn.polar(g[None])[0].mul(-LR * math.sqrt(max(g.shape)))
        assert torch.equal(updates[key], torch.add(expected, params[key], alpha=-LR * WD)), key


@pytest.mark.parametrize("ns", ["newton_schulz", "none"])
def test_a_rate_that_stays_a_tensor_takes_a_pass_of_its_own(ns: str) -> None:
    """A rate that stays a tensor (here one autograd records; on a device, one per ensemble
    member, or traced alike): ``(s·O)·(-η) + p·(-ηλ)``, the rate's product and the decay's each a
    pass of its own; recorded, so the update is differentiated with respect to it."""
    params, grads = params_and_grads()
    newton_schulz = muonfn.NewtonSchulz(dtype=torch.float32)
    lr = torch.tensor(LR, requires_grad=True)
    tx = muonfn.descent(lr, WD, ns=newton_schulz if ns == "newton_schulz" else "none", scale="original")
    with torch.enable_grad():
        updates, _ = step(tx, params, grads)
    assert all(u.requires_grad for u in updates.values())
    rate = lr.detach()
    for key, g in grads.items():
        scale = math.sqrt(max(1.0, g.shape[0] / g.shape[1]))
        scaled = newton_schulz.orthogonalize(g, scale=scale) if ns == "newton_schulz" else g.mul(scale)
        expected = scaled * rate.neg() + params[key] * (rate.neg() * WD)
        assert torch.equal(updates[key].detach(), expected), key
    # to rounding, the number's update
    number, _ = step(
        muonfn.descent(LR, WD, ns=newton_schulz if ns == "newton_schulz" else "none", scale="original"), params, grads
    )
    for key in grads.keys():
        torch.testing.assert_close(updates[key].detach(), number[key], rtol=1e-6, atol=1e-8)


def test_without_newton_schulz_the_shape_scales_pass_takes_minus_lr_too() -> None:
    params, grads = params_and_grads()
    tx = muonfn.descent(LR, WD, ns="none", scale=("match_rms_adamw", 0.5))
    updates, _ = step(tx, params, grads)
    for key, g in grads.items():
        expected = g.mul(-LR * (match_rms(*g.shape) * 0.5))
        assert torch.equal(updates[key], torch.add(expected, params[key], alpha=-LR * WD)), key


def test_the_state_is_the_chains_and_a_schedule_counts_once_per_update() -> None:
    """The same state entries as the chain (a schedule's ``count``), advanced once per update,
    and the schedule's rate used as a number."""
    params, grads = params_and_grads()
    seen = []

    def schedule(count: torch.Tensor) -> torch.Tensor:
        seen.append(int(count))
        return LR * 0.5**count

    tx = muonfn.descent(schedule, WD, ns="none", scale="match_rms_adamw")
    reference = chained(muonfn.scale_by_shape("match_rms_adamw"), schedule, WD)
    state = tx.init(params)
    assert_td_equal(state, reference.init(params))
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
    assert seen == [0, 1, 2] and int(state["count"]) == 3
    seen.clear()
    g, lr = grads["wide"], schedule(torch.tensor(2)).item()  # (a tensor on the host: read as a number)
    expected = torch.add(g.mul(-lr * match_rms(12, 20)), params["wide"], alpha=-lr * WD)
    assert torch.equal(updates["wide"], expected)


def test_zero_decay_adds_nothing_and_needs_no_params() -> None:
    params, grads = params_and_grads()
    tx = muonfn.descent(LR, 0.0, ns="none", scale="none")
    updates, _ = tx.update(grads, tx.init(params))
    assert_td_equal(updates, grads.apply(lambda g: g.mul(-LR)))
    with pytest.raises(ValueError, match="descent needs params"):
        muonfn.descent(LR, WD, ns="none").update(grads, tx.init(params))


def test_the_presets_take_descent_without_caution_and_the_chain_with_it() -> None:
    """``muonfn.muon``'s matrices: ``(-ηs)`` in Newton–Schulz and one decay multiply-add; with
    cautious weight decay the chain, whose decay reads the direction first."""
    params, grads = params_and_grads()
    labels = {k: "muon" for k in SHAPES}
    ns = muonfn.NewtonSchulz(dtype=torch.float32)
    updates, _ = step(muonfn.muon(lr=LR, weight_decay=WD, ns=ns, labels=labels, nesterov=False), params, grads)
    for key, g in grads.items():
        m = g * (1 - 0.95)  # the first momentum
        expected = torch.add(ns.orthogonalize(m, scale=-LR * match_rms(*g.shape)), params[key], alpha=-LR * WD)
        assert torch.equal(updates[key], expected), key
    cautious = muonfn.muon(lr=LR, weight_decay=WD, ns=ns, labels=labels, nesterov=False, cautious_weight_decay=True)
    updates, _ = step(cautious, params, grads)
    for key, g in grads.items():
        direction = ns.orthogonalize(g * (1 - 0.95), scale=match_rms(*g.shape))
        agree = direction.signbit() == params[key].signbit()
        expected = (direction + params[key] * WD * agree) * -LR
        torch.testing.assert_close(updates[key], expected, atol=1e-7, rtol=0, msg=key)


def test_an_ns_that_names_no_map_is_refused() -> None:
    with pytest.raises(TypeError, match=r"ns must be a muonfn\.NewtonSchulz"):
        muonfn.descent(LR, WD, ns="cholesky")
    with pytest.raises(TypeError, match=r"ns must be a muonfn\.NewtonSchulz"):
        muonfn.descent(LR, WD, ns=3)


def test_under_vmap_a_host_tensor_is_read_as_the_number_it_holds() -> None:
    """A vmapped ensemble reads an unmapped host tensor as a number, as a stacked one does: the
    same path, so a tensor and the number it holds give the same bits either way."""
    params, grads = params_and_grads()
    members = 3
    stacked_params = torch.stack([params.apply(lambda p, i=i: p * (i + 1)) for i in range(members)])
    stacked_grads = torch.stack([grads.apply(lambda g, i=i: g * (1 - i / 4)) for i in range(members)])
    ns = muonfn.NewtonSchulz(dtype=torch.float32)

    def run(lr, wd, vmapped: bool) -> TensorDict:
        tx = muonfn.descent(lr, wd, ns=ns, scale="original")
        if vmapped:
            return torch.vmap(lambda g, p: tx.update(g, tx.init(p), p)[0])(stacked_grads, stacked_params)
        return tx.update(stacked_grads, tx.init(stacked_params), stacked_params)[0]

    host = torch.tensor(LR, dtype=torch.float64), torch.tensor(WD, dtype=torch.float64)
    for vmapped in (False, True):
        assert_td_equal(run(*host, vmapped), run(LR, WD, vmapped))


def test_overwrite_input_stores_the_results_in_the_updates_given() -> None:
    """``overwrite_input=True``: the updates given are the step's temporaries, and in a GPU's form
    (asked for here) a wide matrix's result goes into its memory, the bits of a new tensor."""
    params, grads = params_and_grads()
    options = {
        "ns": muonfn.NewtonSchulz(dtype=torch.bfloat16),
        "orthogonalizer": muonfn.LocalOrthogonalizer(gpu_form=True),
    }
    expected, _ = step(muonfn.descent(LR, WD, **options), params, grads)
    given = grads.clone()
    tx = muonfn.descent(LR, WD, overwrite_input=True, **options)
    updates, _ = tx.update(given, tx.init(params), params)
    assert_td_equal(updates, expected)
    assert updates["wide"].data_ptr() == given["wide"].data_ptr()
