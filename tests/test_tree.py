"""The flat form of TensorDicts the transforms compute on, and the rebuild at the API boundary."""

from __future__ import annotations

import pickle

import torch
from tensordict import TensorDict

from muonfn import _tree


def _nested() -> TensorDict:
    return TensorDict(
        {
            "muon": {"momentum": {"h": {"0": {"w": torch.ones(2, 3)}, "1": {"w": torch.zeros(2, 3)}}}},
            "adamw": {"step": {"b": torch.zeros((), dtype=torch.int64)}, "exp_avg": {"b": torch.ones(3)}},
            "scale_by_shape": {},
        },
        batch_size=[],
    )


def test_flatten_keeps_insertion_order_and_empty_nodes_on_request() -> None:
    td = _nested()
    flat = _tree.flatten(td, keep_empty=True)
    assert list(flat) == [
        ("muon", "momentum", "h", "0", "w"),
        ("muon", "momentum", "h", "1", "w"),
        ("adamw", "step", "b"),
        ("adamw", "exp_avg", "b"),
        ("scale_by_shape",),
    ]
    assert isinstance(flat[("scale_by_shape",)], TensorDict) and flat[("scale_by_shape",)].is_empty()
    assert ("scale_by_shape",) not in _tree.flatten(td)
    assert flat[("muon", "momentum", "h", "0", "w")] is td["muon", "momentum", "h", "0", "w"]


def test_a_node_with_only_empty_children_is_kept_whole() -> None:
    td = TensorDict({"a": {"b": {}, "c": {}}, "d": torch.ones(1)}, batch_size=[])
    flat = _tree.flatten(td, keep_empty=True)
    assert list(flat) == [("a",), ("d",)]
    assert list(_tree.flatten(td)) == [("d",)]


def test_unflatten_round_trips_and_builds_ordinary_tensordicts() -> None:
    td = _nested()
    rebuilt = _tree.unflatten(_tree.flatten(td, keep_empty=True), td.batch_size)
    assert list(rebuilt.keys(True, True)) == list(td.keys(True, True))
    assert (rebuilt == td).all()
    # every node behaves as one made by the constructor: cloned, pickled, locked, extended
    for node in (rebuilt, rebuilt["muon"], rebuilt["muon", "momentum", "h"]):
        assert type(node) is TensorDict and node.batch_size == torch.Size([]) and node.device is None
    assert (rebuilt.clone() == td).all()
    assert (pickle.loads(pickle.dumps(rebuilt)) == td).all()
    rebuilt["muon", "momentum", "h", "2", "w"] = torch.full((2, 3), 2.0)
    assert rebuilt["muon", "momentum", "h"].keys() == {"0", "1", "2"}
    rebuilt.lock_()
    assert rebuilt["muon"].is_locked


def test_unflatten_gives_a_batched_tree_its_batch_size_at_every_node() -> None:
    flat = {("a", "b"): torch.zeros(4, 2), ("c",): torch.zeros(4)}
    td = _tree.unflatten(flat, torch.Size([4]))
    assert td.batch_size == torch.Size([4]) and td["a"].batch_size == torch.Size([4])
    assert td[1]["a", "b"].shape == (2,)
