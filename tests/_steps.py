"""A donated, compiled training step run beside the eager one (shared by the CPU and CUDA tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

import muonfn


def stepper(tx: muonfn.Transform) -> Callable[..., Any]:
    """``(grads, state, params) -> (new params, new state)``: one step of ``tx``."""

    def step(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase) -> Any:
        updates, state = tx.update(grads, state, params)
        return muonfn.apply_updates(params, updates), state

    return step


def compiled_donated_beside_eager(
    eager_tx: muonfn.Transform,
    donating_tx: muonfn.Transform,
    grads: TensorDictBase,
    params: TensorDictBase,
    lr: torch.Tensor,
    steps: int = 3,
) -> tuple[TensorDictBase, TensorDictBase, TensorDictBase, TensorDictBase]:
    """``steps`` steps of ``eager_tx`` eagerly and of ``donating_tx`` compiled (``fullgraph``, no
    recompile while ``lr`` changes in place); checks the donated state kept its tensors.

    Returns ``(params_eager, state_eager, params_compiled, state_compiled)``.
    """
    eager, compiled = stepper(eager_tx), torch.compile(stepper(donating_tx), fullgraph=True)
    state_e, state_c = eager_tx.init(params), donating_tx.init(params)
    donated = list(state_c.values(True, True))
    params_e = params_c = params
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(steps):
            lr.fill_(0.02 / (i + 1))
            params_e, state_e = eager(grads, state_e, params_e)
            params_c, state_c = compiled(grads, state_c, params_c)
    assert all(a is b for a, b in zip(state_c.values(True, True), donated))
    return params_e, state_e, params_c, state_c
