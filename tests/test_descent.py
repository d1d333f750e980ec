"""The matrix branch's tail as one rule: ``u = (-ηs)·x + (-ηλ)·p``, or the chain's passes."""

from __future__ import annotations

import math

import pytest
import torch
from _strategies import assert_td_equal, gaussian
from tensordict import TensorDict

import muonfn
from muonfn.transforms import _descent, descent

LR, WD = 0.02, 0.1
SHAPES = {"wide": (12, 20), "tall": (20, 12), "square": (8, 8)}


def params_and_grads() -> tuple[TensorDict, TensorDict]:
    params = TensorDict({k: gaussian(*s, seed=i) for i, (k, s) in enumerate(SHAPES.items())}, batch_size=[])
    grads = TensorDict({k: gaussian(*s, seed=10 + i) for i, (k, s) in enumerate(SHAPES.items())}, batch_size=[])
    return params, grads


def match_rms(rows: int, cols: int) -> float:
    return 0.2 * math.sqrt(max(rows, cols))


def chained(tail: muonfn.Transform, lr, wd, mask=None) -> muonfn.Transform:
    return muonfn.chain(
        tail,
        muonfn.add_decayed_weights(wd, mask=mask, inplace=True),
        muonfn.scale_by_learning_rate(lr, inplace=True),
    )


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
    tx = descent(muonfn.orthogonalize(ns=ns, scale="match_rms_adamw"), lr, wd, mask={"square": False})
    updates, _ = step(tx, params, grads)
    for key, g in grads.items():
        expected = ns.orthogonalize(g, scale=-LR * match_rms(*g.shape))
        if key != "square":
            expected = torch.add(expected, params[key], alpha=-LR * WD)
        assert torch.equal(updates[key], expected), key


def test_a_map_of_ones_own_is_scaled_after_it() -> None:
    """A map that is not Newton–Schulz is multiplied by ``-ηs`` once, after it."""
    params, grads = params_and_grads()
    tx = descent(muonfn.orthogonalize(ns=muonfn.polar, scale="spectral"), LR, WD)
    updates, _ = step(tx, params, grads)
    for key, g in grads.items():
        expected = muonfn.polar(g[None])[0].mul(-LR * math.sqrt(max(g.shape)))
        assert torch.equal(updates[key], torch.add(expected, params[key], alpha=-LR * WD)), key


def test_a_tensor_that_stays_a_tensor_takes_the_chains_passes(monkeypatch) -> None:
    """A tensor on a device (forced here: no tensor is read as a number) or a traced one: the
    bits of ``chain(orthogonalize, add_decayed_weights, scale_by_learning_rate)``."""
    monkeypatch.setattr(_descent, "eager_number", lambda value: None)
    params, grads = params_and_grads()
    lr = torch.tensor(LR)
    ns = muonfn.NewtonSchulz(dtype=torch.float32)
    got, _ = step(descent(muonfn.orthogonalize(ns=ns, scale="original"), lr, WD), params, grads)
    expected, _ = step(chained(muonfn.orthogonalize(ns=ns, scale="original"), lr, WD), params, grads)
    assert_td_equal(got, expected)
    got, _ = step(descent(muonfn.scale_by_shape("original"), lr, WD), params, grads)
    expected, _ = step(chained(muonfn.scale_by_shape("original"), lr, WD), params, grads)
    assert_td_equal(got, expected)


def test_the_shape_scales_pass_takes_minus_lr_too() -> None:
    params, grads = params_and_grads()
    updates, _ = step(descent(muonfn.scale_by_shape("match_rms_adamw", extra_scale=0.5), LR, WD), params, grads)
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

    tx = descent(muonfn.scale_by_shape("match_rms_adamw"), schedule, WD)
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
    tx = descent(muonfn.scale_by_shape("none"), LR, 0.0)
    updates, _ = tx.update(grads, tx.init(params))
    assert_td_equal(updates, grads.apply(lambda g: g.mul(-LR)))


def test_the_presets_take_the_fused_tail_without_caution_and_the_chain_with_it() -> None:
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


def test_a_step_without_a_shape_scale_is_refused() -> None:
    with pytest.raises(TypeError, match="must end in a shape scale"):
        descent(muonfn.ema_momentum(0.9), LR, WD)


def test_under_vmap_a_host_tensor_is_read_as_the_number_it_holds() -> None:
    """A vmapped ensemble reads an unmapped host tensor as a number, as a stacked one does: the
    same path, so a tensor and the number it holds give the same bits either way."""
    params, grads = params_and_grads()
    members = 3
    stacked_params = torch.stack([params.apply(lambda p, i=i: p * (i + 1)) for i in range(members)])
    stacked_grads = torch.stack([grads.apply(lambda g, i=i: g * (1 - i / 4)) for i in range(members)])
    ns = muonfn.NewtonSchulz(dtype=torch.float32)

    def run(lr, wd, vmapped: bool) -> TensorDict:
        tx = descent(muonfn.orthogonalize(ns=ns, scale="original"), lr, wd)
        if vmapped:
            return torch.vmap(lambda g, p: tx.update(g, tx.init(p), p)[0])(stacked_grads, stacked_params)
        return tx.update(stacked_grads, tx.init(stacked_params), stacked_params)[0]

    host = torch.tensor(LR, dtype=torch.float64), torch.tensor(WD, dtype=torch.float64)
    for vmapped in (False, True):
        assert_td_equal(run(*host, vmapped), run(LR, WD, vmapped))
