"""The flat form updates compute on: nested input read by dotted names once, at the entry, and the
updates rebuilt in the input's nesting."""

from __future__ import annotations

import pickle

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict

import muonfn


def _nested() -> TensorDict:
    return TensorDict(
        {
            "h": {"0": {"w": torch.ones(2, 3)}, "1": {"w": torch.zeros(2, 3)}},
            "b": torch.ones(3),
            "empty": {},
        },
        batch_size=[],
    )


def _flattened(td: TensorDict) -> TensorDict:
    """``td`` keyed by dotted names, as a user would write it (empty nodes hold no leaf)."""
    return TensorDict(dict(td.flatten_keys(".").items()), batch_size=td.batch_size)


def test_the_state_keeps_each_leaf_under_its_dotted_name_in_the_order_given() -> None:
    params = _nested()
    tx = muonfn.ema_momentum(0.5, nesterov=False)
    state = tx.init(params)
    assert list(state["momentum"].keys()) == ["h.0.w", "h.1.w", "b"]
    assert state["momentum"]["h.0.w"] is not params["h", "0", "w"]
    grads = params.apply(lambda p: p + 1)
    updates, state = tx.update(grads, state, params)
    assert list(updates.keys(True, True)) == [("h", "0", "w"), ("h", "1", "w"), "b"]
    assert torch.equal(updates["h", "1", "w"], torch.full((2, 3), 0.5))
    assert torch.equal(state["momentum"]["h.1.w"], torch.full((2, 3), 0.5))


def test_nested_and_flat_input_give_the_same_state_and_updates() -> None:
    """A tree and the same leaves keyed by their dotted names are one input: the same state, and
    the same updates, each in its own nesting."""
    params = _nested()
    flat = _flattened(params)
    tx = muonfn.muon(lr=0.1, weight_decay=0.1)
    state_nested, state_flat = tx.init(params), tx.init(flat)
    assert_bitwise(state_nested, state_flat)
    grads = params.apply(lambda p: p * 0.5 + 0.25)
    updates_nested, state_nested = tx.update(grads, state_nested, params)
    updates_flat, state_flat = tx.update(_flattened(grads), state_flat, flat)
    assert_bitwise(_flattened(updates_nested), updates_flat)
    assert_bitwise(state_nested, state_flat)
    assert not any(isinstance(v, TensorDict) for v in updates_flat.values())


def test_empty_nodes_get_no_update_and_no_state() -> None:
    td = TensorDict({"a": {"b": {}, "c": {}}, "d": torch.ones(1)}, batch_size=[])
    tx = muonfn.scale_by_adam()
    state = tx.init(td)
    assert list(state["exp_avg"].keys()) == ["d"]
    updates, _ = tx.update(td, state, td)
    assert list(updates.keys(True, True)) == ["d"]


def test_rebuilt_updates_are_ordinary_tensordicts() -> None:
    """Every node of the updates behaves as one made by the constructor: cloned, pickled, locked,
    extended, with the input's batch size at every node."""
    params = _nested()
    tx = muonfn.scale_by_learning_rate(0.5)
    rebuilt, _ = tx.update(params, tx.init(params))
    expected = params.exclude("empty").apply(lambda p: p * -0.5)
    for node in (rebuilt, rebuilt["h"], rebuilt["h", "0"]):
        assert type(node) is TensorDict and node.batch_size == torch.Size([]) and node.device is None
    assert (rebuilt == expected).all()
    assert (rebuilt.clone() == expected).all()
    assert (pickle.loads(pickle.dumps(rebuilt)) == expected).all()
    rebuilt["h", "2", "w"] = torch.full((2, 3), 2.0)
    assert rebuilt["h"].keys() == {"0", "1", "2"}
    rebuilt.lock_()
    assert rebuilt["h"].is_locked


def test_a_batched_tree_keeps_its_batch_size_at_every_node() -> None:
    params = TensorDict({"a": {"b": torch.zeros(4, 2)}, "c": torch.zeros(4)}, batch_size=[4])
    tx = muonfn.scale_by_learning_rate(0.5)
    updates, _ = tx.update(params.apply(torch.ones_like), tx.init(params))
    assert updates.batch_size == torch.Size([4]) and updates["a"].batch_size == torch.Size([4])
    assert updates[1]["a", "b"].shape == (2,)


def test_a_key_holding_a_dot_in_a_tree_is_refused_naming_it() -> None:
    """In a nested tree a dot would make two leaves one dotted name."""
    bad = TensorDict({"a.b": torch.ones(1), "c": {"d": torch.ones(1)}}, batch_size=[])
    tx = muonfn.scale_by_learning_rate(0.5)
    with pytest.raises(ValueError, match=r"key 'a\.b' holds a dot"):
        tx.init(bad)
    with pytest.raises(ValueError, match=r"key 'a\.b' holds a dot"):
        tx.update(bad, TensorDict())


def _structures() -> list[tuple[str, object]]:
    """Changes of a tree's structure between two updates of one transform."""

    def add_leaf(td: TensorDict) -> None:
        td["h", "2", "w"] = torch.full((2, 3), 3.0)

    def drop_leaf(td: TensorDict) -> None:
        del td["b"]

    def reorder(td: TensorDict) -> None:
        td["h"] = TensorDict({"1": td["h", "1"], "0": td["h", "0"]}, batch_size=[])

    def rename(td: TensorDict) -> None:
        td["c"] = td.pop("b")

    def leaf_to_node(td: TensorDict) -> None:
        td["b"] = TensorDict({"c": torch.ones(3)}, batch_size=[])

    def node_to_leaf(td: TensorDict) -> None:
        td["h", "1"] = torch.ones(2)

    return [(f.__name__, f) for f in (add_leaf, drop_leaf, reorder, rename, leaf_to_node, node_to_leaf)]


@pytest.mark.parametrize(("name", "mutate"), _structures())
def test_one_transform_serves_trees_of_several_structures(name, mutate) -> None:
    """What a transform learns of a structure (its routes, its expected state) is kept per
    structure: after one tree, a changed one gets what a fresh transform gives it, in its order."""

    def make() -> muonfn.Transform:
        labels = lambda p: {k: "m" if v.ndim == 2 else "a" for k, v in p.items()}  # noqa: E731
        return muonfn.partition(
            {"m": muonfn.ema_momentum(0.5), "a": muonfn.chain(muonfn.scale_by_adam(), muonfn.scale_by_sign())},
            labels,
        )

    tx = make()
    params = _nested()
    tx.update(params, tx.init(params), params)
    mutate(params)
    fresh = make()
    got, got_state = tx.update(params, tx.init(params), params)
    expected, expected_state = fresh.update(params, fresh.init(params), params)
    assert list(got.keys(True, True)) == list(expected.keys(True, True)) == list(params.keys(True, True))
    assert_bitwise(got, expected)
    assert_bitwise(got_state, expected_state)


def test_apply_updates_keeps_the_params_nesting_and_their_leaves_without_an_update() -> None:
    params = _nested().exclude("empty")
    updates = TensorDict({"h": {"1": {"w": torch.ones(2, 3)}}}, batch_size=[])
    new = muonfn.apply_updates(params, updates)
    assert list(new.keys(True, True)) == list(params.keys(True, True))
    assert new["h", "0", "w"] is params["h", "0", "w"] and new["b"] is params["b"]
    assert torch.equal(new["h", "1", "w"], torch.ones(2, 3))
