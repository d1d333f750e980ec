"""An update pauses Python's cyclic collector while it builds its result, and leaves it as it found it."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator

import pytest
import torch
from tensordict import TensorDict

import muonfn


def _tree(layers: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict(
        {str(i): {"w": torch.randn(4, 6, generator=g), "b": torch.randn(4, generator=g)} for i in range(layers)},
        batch_size=[],
    )


_PACKAGE = os.path.dirname(muonfn.__file__)


def _inside_muonfn() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE):
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def collections_counted() -> Iterator[list[int]]:
    """Counts the collections started inside muonfn's code while the test runs, with a tiny
    threshold (one would start every few allocations) and the collector enabled."""
    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and _inside_muonfn():
            started.append(info["generation"])

    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(5)
    gc.enable()
    gc.callbacks.append(count)
    try:
        yield started
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


@pytest.mark.parametrize("make", [lambda: muonfn.muon(lr=0.02), lambda: muonfn.adamw(lr=1e-3)])
def test_an_update_and_its_application_start_no_collection(collections_counted, make) -> None:
    params = _tree(8)
    tx = make()
    state = tx.init(params)
    grads = params * 0.5
    collections_counted.clear()
    updates, _ = tx.update(grads, state, params)
    muonfn.apply_updates(params, updates)
    assert collections_counted == []
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    params = _tree(2)
    tx = muonfn.adamw(lr=1e-3)
    enabled = gc.isenabled()
    gc.disable()
    try:
        tx.update(params, tx.init(params), params)
        muonfn.apply_updates(params, params)
        assert not gc.isenabled()
    finally:
        (gc.enable if enabled else gc.disable)()


def test_a_failed_update_resumes_the_collector() -> None:
    params = _tree(2)
    tx = muonfn.adamw(lr=1e-3)
    state = tx.init(params)
    assert gc.isenabled()
    with pytest.raises(ValueError, match="shape"):
        tx.update(params.apply(lambda t: t[:1]), state, params)
    assert gc.isenabled()
    with pytest.raises(ValueError, match="shape"):
        muonfn.apply_updates(params, params.apply(lambda t: t[:1]))
    assert gc.isenabled()


def test_a_shim_step_starts_no_collection(collections_counted) -> None:
    import muonfn.optim

    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(6)])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = muonfn.optim.Muon(model.named_parameters(), lr=0.02)
    opt.step()
    collections_counted.clear()
    opt.step()
    assert collections_counted == []
    assert gc.isenabled()
