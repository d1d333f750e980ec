"""The variant options: settings reach the map they configure, and bad ones fail when built."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import muonfn


def test_ns_restarts_reach_gram_newton_schulz():
    g = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    params = TensorDict({"w": torch.zeros(8, 64)}, [])
    tx = muonfn.orthogonalize(ns_method="gram", restarts=(1, 2))
    out, _ = tx.update(TensorDict({"w": g}, []), tx.init(params), params)
    assert torch.equal(out["w"], muonfn.gram_newton_schulz(g, restarts=(1, 2)))
    assert not torch.equal(out["w"], muonfn.gram_newton_schulz(g))


def test_qr_orthogonal_is_orthonormal_in_both_orientations():
    for shape in [(5, 9), (9, 5)]:
        q = muonfn.qr_orthogonal(torch.randn(shape, dtype=torch.float64))
        small = q @ q.mT if shape[0] < shape[1] else q.mT @ q
        assert torch.allclose(small, torch.eye(5, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize(
    "make",
    [
        lambda: muonfn.ema_momentum(nesterov="add", bias_correction=True),
        lambda: muonfn.ema_momentum(nesterov="yes"),
        lambda: muonfn.orthogonalize(restarts=(1,)),
        lambda: muonfn.orthogonalize(ns_method="svd", restarts=(1,)),
        lambda: muonfn.orthogonalize(ns_method="polar"),
        lambda: muonfn.orthogonalize(eps_mode="sum"),
        lambda: muonfn.cautious(muonfn.ema_momentum(), mode="timm"),
    ],
)
def test_bad_settings_fail_when_built(make):
    with pytest.raises(ValueError):
        make()
