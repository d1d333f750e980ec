"""MatrixView: which matrices a leaf holds, their logical (out, in) shapes, and the scale modes."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

import muonfn
from muonfn import SCALE_MODES, MatrixView
from muonfn.linalg import shape_scale

# (out, in) = (A, B) -> expected factor, written out by hand
KNOWN_FACTORS = {
    (64, 16): {"original": 2.0, "match_rms_adamw": 1.6, "spectral": 8.0, "unit_rms_norm": 2.0, "none": 1.0},
    (16, 64): {"original": 1.0, "match_rms_adamw": 1.6, "spectral": 8.0, "unit_rms_norm": 0.5, "none": 1.0},
    (25, 25): {"original": 1.0, "match_rms_adamw": 1.0, "spectral": 5.0, "unit_rms_norm": 1.0, "none": 1.0},
}


def test_the_scale_modes_are_those_the_scale_mode_type_names() -> None:
    assert tuple(SCALE_MODES) == tuple(muonfn.linalg.SCALED_MODES) == get_args(muonfn.linalg.ScaleMode)


@pytest.mark.parametrize("shape", sorted(KNOWN_FACTORS))
@pytest.mark.parametrize("mode", sorted(SCALE_MODES))
def test_scale_mode_factors(shape: tuple[int, int], mode: str) -> None:
    assert SCALE_MODES[mode](*shape) == pytest.approx(KNOWN_FACTORS[shape][mode], rel=1e-15)
    assert MatrixView().scales(shape, shape_scale((mode, 0.5))) == [pytest.approx(0.5 * KNOWN_FACTORS[shape][mode])]


@pytest.mark.parametrize(
    ("view", "shape", "logical", "blocks"),
    [
        (MatrixView(), (12, 5), (12, 5), [(12, 5)]),
        (MatrixView(), (8, 3, 3, 3), (8, 27), [(8, 27)]),  # conv: (out, in·∏k)
        (MatrixView(batch_dims=1), (4, 12, 5), (12, 5), [(12, 5)]),  # experts
        (MatrixView(transposed=True), (5, 12), (12, 5), [(12, 5)]),  # Conv1D stores (in, out)
        (MatrixView(split=(8, 2, 2)), (12, 5), (12, 5), [(8, 5), (2, 5), (2, 5)]),  # fused QKV, GQA sizes
        (MatrixView(split=(2, 3), split_dim=1), (12, 5), (12, 5), [(12, 2), (12, 3)]),
        (MatrixView(transposed=True, split=(8, 2, 2)), (5, 12), (12, 5), [(8, 5), (2, 5), (2, 5)]),
        (MatrixView(batch_dims=1, transposed=True), (3, 5, 12), (12, 5), [(12, 5)]),
    ],
)
def test_logical_shapes(view: MatrixView, shape: tuple[int, ...], logical: tuple[int, int], blocks: list) -> None:
    view.check("w", shape)
    assert view.matrix_shape(shape) == logical
    assert view.blocks(shape) == blocks
    pieces = view.to_matrices(torch.zeros(shape))
    count = math.prod(shape[: view.batch_dims])
    assert [tuple(p.shape) for p in pieces] == [(count, *b) for b in blocks]


def test_conv_scale_uses_the_flattened_shape() -> None:
    """(out, in, k, k) = (8, 4, 3, 3) is the 8×36 matrix: √max(1, 8/36) = 1, not √max(1, 8/4)."""
    assert MatrixView().scales((8, 4, 3, 3), shape_scale("original")) == [1.0]
    assert MatrixView().scales((8, 4, 3, 3), shape_scale("match_rms_adamw")) == [pytest.approx(0.2 * 6)]


def test_transposed_storage_scales_by_the_logical_shape() -> None:
    assert MatrixView(transposed=True).scales((16, 64), shape_scale("original")) == [2.0]
    assert MatrixView().scales((16, 64), shape_scale("original")) == [1.0]


def test_split_blocks_are_scaled_on_their_own() -> None:
    scales = MatrixView(split=(32, 8, 8)).scales((48, 16), shape_scale("original"))
    assert scales == [pytest.approx(math.sqrt(2)), 1.0, 1.0]


views_and_shapes = st.one_of(
    st.tuples(st.just(MatrixView()), st.lists(st.integers(1, 4), min_size=2, max_size=4)),
    st.tuples(st.just(MatrixView(batch_dims=1)), st.lists(st.integers(1, 4), min_size=3, max_size=4)),
    st.tuples(st.just(MatrixView(transposed=True)), st.lists(st.integers(1, 4), min_size=2, max_size=2)),
    st.tuples(st.just(MatrixView(batch_dims=1, transposed=True)), st.lists(st.integers(1, 4), min_size=3, max_size=3)),
)


@given(views_and_shapes, st.booleans(), st.integers(0, 1))
def test_to_and_from_matrices_round_trip(view_shape: tuple[MatrixView, list[int]], split: bool, dim: int) -> None:
    view, shape = view_shape
    if split:
        length = view.matrix_shape(shape)[dim]
        view = MatrixView(view.batch_dims, view.transposed, (1,) * length, dim)
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    view.check("w", shape)
    pieces = view.to_matrices(t)
    assert torch.equal(view.from_matrices(pieces, shape), t)
    # the pieces are the logical matrices: row r of a transposed view is column r of the storage
    whole = torch.cat(pieces, dim=1 + view.split_dim) if len(pieces) > 1 else pieces[0]
    stored = t.reshape(-1, *shape[view.batch_dims :])
    if view.transposed:
        assert torch.equal(whole, stored.mT)
    else:
        assert torch.equal(whole, stored.reshape(whole.shape))


@pytest.mark.parametrize(
    ("view", "shape", "match"),
    [
        (MatrixView(), (7,), "holds no matrix"),
        (MatrixView(), (), "holds no matrix"),
        (MatrixView(batch_dims=1), (4, 7), "holds no matrix"),
        (MatrixView(batch_dims=-1), (4, 7), "holds no matrix"),
        (MatrixView(transposed=True), (4, 7, 3), "transposed=True needs a 2-D"),
        (MatrixView(split=(3, 3)), (7, 4), "does not partition the 7 rows"),
        (MatrixView(split=(4, 0, 3)), (7, 4), "does not partition"),
        (MatrixView(split=(2, 2), split_dim=1), (7, 5), "does not partition the 5 columns"),
        (MatrixView(split=(7,), split_dim=2), (7, 4), "split_dim must be 0"),
    ],
)
def test_bad_views_name_the_leaf(view: MatrixView, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        view.check("block.qkv.weight", shape)
    assert "'block.qkv.weight'" in str(info.value)


def test_views_by_tuple_dotted_and_callable() -> None:
    """A transform reads each leaf through the view given by its tuple or dotted name, or by a
    callable of the name and the tensor; the default view elsewhere. Inside a partition a view may
    name another group's leaf: it is ignored there (the muon preset checks names against all
    parameters, tests/test_errors.py)."""
    leaves = {"a": {"weight": torch.zeros(2, 3)}, "b": {"weight": torch.zeros(3, 2)}, "c": torch.zeros(4, 2, 2)}
    params = TensorDict(leaves, [])
    experts, transposed = MatrixView(batch_dims=1), MatrixView(transposed=True)

    def seen(views: object) -> list[tuple[int, ...]]:
        """The shapes of the batches the map is given, in the leaves' order."""
        shapes: list[tuple[int, ...]] = []

        def record(batch: torch.Tensor) -> torch.Tensor:
            if batch.device.type != "meta":  # (init tries the map on meta tensors)
                shapes.append(tuple(batch.shape))
            return batch.clone()

        tx = muonfn.orthogonalize(record, views=views)
        tx.update(params, tx.init(params), params)
        return shapes

    by_name = {("b", "weight"): transposed, "c": experts, "a.weight": transposed}
    assert seen(by_name) == [(1, 3, 2), (1, 2, 3), (4, 2, 2)]
    assert seen(None) == [(1, 2, 3), (1, 3, 2), (1, 4, 4)]  # a 3-D leaf is a conv kernel by default
    assert seen(lambda name, t: experts if t.ndim == 3 else None) == [(1, 2, 3), (1, 3, 2), (4, 2, 2)]
    assert seen({"elsewhere": experts}) == seen(None)
