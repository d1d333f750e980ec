"""NorMuon's and AdaMuon's second moments: the EMA weight of a tensor beta is a float beta's."""

from __future__ import annotations

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict

import muonfn

# 1 - BETA = 2**-1 + 2**-10: exact in fp32 and fp64, not in bf16 (7 mantissa bits), so a kernel
# that rounded the weight to the leaf's dtype would show
BETA = 0.4990234375


def steps(tx: muonfn.Transform, params: TensorDict, *, vmap: bool) -> list[TensorDict]:
    update = torch.vmap(tx.update) if vmap else tx.update
    state = torch.vmap(tx.init)(params) if vmap else tx.init(params)
    out = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        grads = params.apply(lambda p: torch.randn(p.shape, generator=g).to(p.dtype))
        updates, state = update(grads, state, params)
        out += [updates, state]
    return out


@pytest.mark.parametrize("vmap", [False, True], ids=["alone", "vmap"])
@pytest.mark.parametrize(
    "make",
    [
        lambda beta: muonfn.scale_by_neuron_norm(beta, rescale="none"),
        lambda beta: muonfn.scale_by_element_rms(beta, bias_correction=True, rescale="none"),
    ],
    ids=["scale_by_neuron_norm", "scale_by_element_rms"],
)
def test_a_tensor_beta_weighs_as_a_float_in_bf16(make, vmap):
    g = torch.Generator().manual_seed(0)
    shape = (2, 12, 8) if vmap else (12, 8)
    params = TensorDict({"w": torch.randn(shape, generator=g).bfloat16()}, batch_size=shape[:1] if vmap else [])
    as_float = steps(make(BETA), params, vmap=vmap)
    as_tensor = steps(make(torch.tensor(BETA)), params, vmap=vmap)
    for a, b in zip(as_tensor, as_float):
        assert_bitwise(a, b)


def test_a_tensor_beta_changed_in_place_is_read_by_the_average_and_its_bias_correction():
    """V_t = β V_{t-1} + (1-β) O², divided by 1 - β^t, with β read at each step for both."""
    beta = torch.tensor(0.5, dtype=torch.float64)
    tx = muonfn.scale_by_element_rms(beta, bias_correction=True, rescale="none", eps=1e-30)
    params = TensorDict({"w": torch.zeros(3, 4, dtype=torch.float64)}, [])
    g = torch.Generator().manual_seed(0)
    first, second = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    state = tx.init(params)
    _, state = tx.update(TensorDict({"w": first}, []), state)
    beta.fill_(0.9)
    updates, state = tx.update(TensorDict({"w": second}, []), state)
    moment = 0.9 * (0.5 * first.square()) + 0.1 * second.square()
    assert torch.allclose(state["exp_avg_sq", "w"], moment, rtol=1e-12, atol=0)
    expected = second / (moment / (1 - 0.9**2)).sqrt()
    assert torch.allclose(updates["w"], expected, rtol=1e-12, atol=0)
