"""The flat form of TensorDicts the transforms compute on, and the rebuild at the API boundary."""

from __future__ import annotations

import pickle

import pytest
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


def _mutations() -> list[tuple[str, object]]:
    def add_leaf(td: TensorDict) -> None:
        td["muon", "momentum", "h", "2", "w"] = torch.ones(2, 3)

    def leaf_to_node(td: TensorDict) -> None:
        td["adamw", "exp_avg", "b"] = TensorDict({"c": torch.ones(3)}, batch_size=[])

    def node_to_leaf(td: TensorDict) -> None:
        td["muon", "momentum", "h", "1"] = torch.ones(2)

    def drop_leaf(td: TensorDict) -> None:
        del td["adamw", "exp_avg", "b"]

    def fill_empty(td: TensorDict) -> None:
        td["scale_by_shape", "count"] = torch.zeros((), dtype=torch.int64)

    def reorder(td: TensorDict) -> None:
        momentum = td["muon", "momentum", "h"]
        reordered = TensorDict({"1": momentum["1"], "0": momentum["0"]}, batch_size=[])
        td["muon", "momentum", "h"] = reordered

    def replace_leaf(td: TensorDict) -> None:
        td["adamw", "exp_avg", "b"] = torch.full((3,), 7.0)

    def rename(td: TensorDict) -> None:
        td["adamw", "step", "c"] = td["adamw", "step"].pop("b")

    mutations = (add_leaf, leaf_to_node, node_to_leaf, drop_leaf, fill_empty, reorder, replace_leaf, rename)
    return [(f.__name__, f) for f in mutations]


@pytest.mark.parametrize(("name", "mutate"), _mutations())
@pytest.mark.parametrize("keep_empty", [True, False])
def test_a_structure_changed_since_it_was_flattened_is_read_anew(name, mutate, keep_empty: bool) -> None:
    """A structure seen before is read through its plan, which checks every name and leaf
    type: whatever changed in between, the result is the walk's."""
    td = _nested()
    first = _tree.flatten(td, keep_empty=keep_empty)
    again = _tree.flatten(td, keep_empty=keep_empty)
    assert list(again) == list(first) and all(a is b for a, b in zip(again.values(), first.values()))
    assert all(a is b for a, b in zip(again, first))  # the plan's key tuples, not new ones
    mutate(td)
    flat = _tree.flatten(td, keep_empty=keep_empty)
    walked = _tree._walked(td, keep_empty)
    assert list(flat) == list(walked) and all(a is b for a, b in zip(flat.values(), walked.values()))


@pytest.mark.parametrize("keep_empty", [True, False])
def test_unflatten_through_a_plan_builds_what_the_walk_builds(keep_empty: bool) -> None:
    td = _nested()
    flat = _tree.flatten(td, keep_empty=keep_empty)
    _tree.flatten(td, keep_empty=keep_empty)  # a plan exists now
    rebuilt = _tree.unflatten(flat, td.batch_size)
    assert list(rebuilt.keys(True, True)) == [k for k in td.keys(True, True) if keep_empty or k != "scale_by_shape"]
    assert all(rebuilt.get(k) is v for k, v in flat.items())
    # the same keys in another order: the tree follows the order given, as without a plan
    reordered = dict(reversed(list(flat.items())))
    assert list(_tree.unflatten(reordered, td.batch_size).keys()) == list(dict.fromkeys(k[0] for k in reordered))
