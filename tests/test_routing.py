"""Which parameters go to Muon and how they are decayed."""

from __future__ import annotations

import pathlib

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import muonfn
from muonfn.optim import Muon

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -------------------------------------------------------------------- decaying matrices only


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.hidden = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10)


DECAYED = {"embed.weight", "hidden.weight", "head.weight"}  # two dimensions or more


def decayed_by_one_step(step, params: TensorDict) -> set[str]:
    """The leaves a step on zero gradients moved, each checked to have moved by exactly its decay."""
    after = step(params)
    moved = set()
    for key, before in params.items(True, True):
        name = ".".join(key)
        if not torch.equal(after[key], before):
            torch.testing.assert_close(after[key], before * (1 - 0.1 * 0.5), rtol=1e-6, atol=0)
            moved.add(name)
    return moved


def functional_step(tx: muonfn.Transform):
    def step(params: TensorDict) -> TensorDict:
        updates, _ = tx.update(params.apply(torch.zeros_like), tx.init(params), params)
        return muonfn.apply_updates(params, updates)

    return step


def shim_step(params: TensorDict) -> TensorDict:
    model = Small()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[tuple(name.split("."))])
            p.grad = torch.zeros_like(p)
    Muon(model.named_parameters(), lr=0.1, weight_decay=0.5, weight_decay_mask="matrices").step()
    return TensorDict.from_module(model).detach()


def test_weight_decay_mask_matrices_decays_only_parameters_of_two_dimensions_or_more():
    params = TensorDict.from_module(Small()).detach().clone()
    for step in (
        functional_step(muonfn.muon(lr=0.1, weight_decay=0.5, weight_decay_mask="matrices")),
        functional_step(muonfn.adamw(lr=0.1, weight_decay=0.5, weight_decay_mask="matrices")),
        functional_step(muonfn.normuon(lr=0.1, weight_decay=0.5, weight_decay_mask="matrices")),
        shim_step,
    ):
        assert decayed_by_one_step(step, params) == DECAYED
    # stacked members (batch size [2]): a member's bias is a vector though (2, 6) stacked
    members = TensorDict.from_modules(Small(), Small()).detach().clone()
    tx = muonfn.adamw(lr=0.1, weight_decay=0.5, weight_decay_mask="matrices")
    assert decayed_by_one_step(functional_step(tx), members) == DECAYED


@pytest.mark.parametrize(
    "build",
    [
        lambda mask: muonfn.muon(weight_decay_mask=mask),
        lambda mask: muonfn.adamw(weight_decay_mask=mask),
        lambda mask: muonfn.add_decayed_weights(0.1, mask=mask),
        lambda mask: Muon(Small().named_parameters(), weight_decay_mask=mask),
    ],
    ids=["muon", "adamw", "add_decayed_weights", "shim"],
)
def test_an_unknown_mask_name_is_refused_naming_the_choices(build):
    for name in ("matrix", "0.bias"):
        with pytest.raises(ValueError, match=rf"mask: unknown mask '{name}'; choose one of \['matrices'\]"):
            build(name)
