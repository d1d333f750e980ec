"""Distributed Muon in one process: virtual ranks (threads) exchanging real data.

Every strategy and layout must reproduce the single-process optimizer bitwise (fp32
Newton–Schulz on CPU), params and state (an fp32 and a bf16 one), with uneven and empty
shards, fused, expert, conv and transposed views, and a step where some parameters have no
gradient.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _dist_models import NS, STATE_DTYPES, Reference, check_state, make_tx, one_thread, reference_run, take
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

import muonfn
from muonfn.distributed import CountingCollectives, ShardSpec, shard_sums, sharded_orthogonalizer, torch_collectives
from muonfn.distributed import sharded_orthogonalizer as sharded
from muonfn.distributed._layout import Box, placement_global_shape, placement_layout
from muonfn.testing import Link, SimulatedCollectives, simulate

pytestmark = pytest.mark.timeout(300)

EXACT = ("owner", "gather")  # "tp_gram" sums Gram matrices over ranks: equal to rounding only
# tp_gram sums the Gram matrix in another order than the whole matrix's product, a last-bit change
# that Newton–Schulz amplifies up to its slope at zero (keller: 485, so 3e-5 relative), however the
# BLAS rounds; one step reached 0.2 of rtol=1e-5, atol=1e-6 here and 0.4 with every matmul summed in sequence
TP_GRAM_ROUNDING = {"rtol": 1e-4, "atol": 2e-6}

# (name, global shape, rank) -> (the rank's box, the ShardSpec to declare or None), given the rank's collectives
Sharding = Callable[[SimulatedCollectives, str, torch.Size], tuple[Box, ShardSpec | None]]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@functools.cache
def reference_kept_in(state: str) -> Reference:
    """The single-process run with its state in ``STATE_DTYPES[state]``."""
    return reference_run(state_dtype=STATE_DTYPES[state])


@pytest.fixture(scope="module")
def reference() -> Reference:
    return reference_kept_in("fp32")


def by_placements(mesh_shape: tuple[int, ...], placements_of: Callable[[str, torch.Size], tuple[Any, ...]]) -> Sharding:
    def shard(col: SimulatedCollectives, name: str, shape: torch.Size) -> tuple[Box, ShardSpec | None]:
        placements = placements_of(name, shape)
        layout = placement_layout(shape, mesh_shape, placements, range(col.world_size))
        return layout.boxes[col.rank], ShardSpec(placements=placements, mesh_shape=mesh_shape)

    return shard


def fsdp(world: int) -> Sharding:
    return by_placements((world,), lambda name, shape: (Shard(0),))


def hsdp() -> Sharding:
    return by_placements((2, 2), lambda name, shape: (Replicate(), Shard(0)))


COLWISE = {"fc1.weight", "qkv.weight"}


def tp_fsdp() -> Sharding:
    """dp × tp = 2 × 2: colwise weights as FSDP2 leaves them, the other matrices row- and column-sharded."""

    def placements(name: str, shape: torch.Size) -> tuple[Any, ...]:
        if name in COLWISE:
            return (_StridedShard(0, split_factor=2), Shard(0))
        if len(shape) >= 2:
            return (Shard(0), Shard(1))
        return (Shard(0), Replicate())

    return by_placements((2, 2), placements)


def hand_rolled_tp() -> Sharding:
    """2 data-parallel replicas of 2-way tensor parallelism over plain tensors: ShardSpec(dim, tp group)."""

    def shard(col: SimulatedCollectives, name: str, shape: torch.Size) -> tuple[Box, ShardSpec | None]:
        dp, tp = divmod(col.rank, 2)
        full: list[tuple[tuple[int, int], ...]] = [((0, n),) for n in shape]
        if len(shape) < 2:
            return tuple(full), None
        dim = 0 if name in COLWISE else 1
        n = shape[dim]
        size = -(-n // 2)
        lo, hi = min(tp * size, n), min((tp + 1) * size, n)
        full[dim] = ((lo, hi),) if lo < hi else ()
        return tuple(full), ShardSpec(dim, col.subgroup([2 * dp, 2 * dp + 1]))

    return shard


def odd_sizes() -> Sharding:
    """ShardSpec(0) with blocks that are not torch.chunk's: 4 ranks holding 1/4, 0, rest, 1 rows."""

    def shard(col: SimulatedCollectives, name: str, shape: torch.Size) -> tuple[Box, ShardSpec | None]:
        n = shape[0]
        cuts = [0, 1 if n > 1 else n, 1 if n > 1 else n, n - 1 if n > 2 else n, n]
        box = [((0, s),) for s in shape]
        lo, hi = cuts[col.rank], cuts[col.rank + 1]
        box[0] = ((lo, hi),) if lo < hi else ()
        return tuple(box), ShardSpec(0)

    return shard


def shards(
    col: SimulatedCollectives, reference: Reference, sharding: Sharding
) -> tuple[dict[str, Box], dict[str, ShardSpec]]:
    """This rank's box of every leaf, and the ShardSpecs to declare."""
    boxes, specs = {}, {}
    for name, value in reference.params[0].items():
        boxes[name], spec = sharding(col, name, value.shape)
        if spec is not None:
            specs[name] = spec
    return boxes, specs


def train(
    col: SimulatedCollectives,
    reference: Reference,
    sharding: Sharding,
    strategy: str,
    bucket_numel: int,
    **distributed: Any,
) -> tuple[TensorDict, TensorDict, dict[str, Box]]:
    """This rank's part of the reference run: shards of the reference's gradients in, shards of params out."""
    boxes, specs = shards(col, reference, sharding)
    params = TensorDict({k: take(reference.params[0][k], box) for k, box in boxes.items()}, batch_size=[])
    tx = make_tx(collectives=col, strategy=strategy, shard_specs=specs, bucket_numel=bucket_numel, **distributed)
    state = tx.init(params)
    for full in reference.grads:
        grads = TensorDict({k: take(v, boxes[k]) for k, v in full.items()}, batch_size=[])
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
    return params, state, boxes


def replicated() -> Sharding:
    """Data parallelism: every rank holds every tensor whole, as a plain tensor."""

    def shard(col: SimulatedCollectives, name: str, shape: torch.Size) -> tuple[Box, ShardSpec | None]:
        return tuple(((0, n),) for n in shape), None

    return shard


LAYOUTS = {
    "ddp2": (2, replicated),
    "ddp3": (3, replicated),
    "fsdp1": (1, lambda: fsdp(1)),
    "fsdp2": (2, lambda: fsdp(2)),
    "fsdp3": (3, lambda: fsdp(3)),
    "fsdp4": (4, lambda: fsdp(4)),
    "hsdp2x2": (4, hsdp),
    "tp2_fsdp2": (4, tp_fsdp),
    "hand_rolled_tp2_dp2": (4, hand_rolled_tp),
    "odd_sizes4": (4, odd_sizes),
}


@pytest.mark.parametrize("state_kept_in", list(STATE_DTYPES))
@pytest.mark.parametrize("strategy", EXACT)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_single_process_bitwise(layout: str, strategy: str, state_kept_in: str) -> None:
    """Params and state (a bf16 one rounded stochastically too): each rank's part of the single-process run's."""
    reference = reference_kept_in(state_kept_in)
    world, sharding = LAYOUTS[layout]
    state_dtype = STATE_DTYPES[state_kept_in]
    results = simulate(world, train, reference, sharding(), strategy, 1 << 26, state_dtype=state_dtype)
    final = reference.params[-1]
    assert reference.state is not None
    for rank, (params, state, boxes) in enumerate(results):
        for name, value in final.items():
            assert torch.equal(params[name], take(value, boxes[name])), f"rank {rank}: {name} differs"
        check_state(state, reference.state, boxes, f"rank {rank}")  # (shards: no rank keeps a full copy)


@pytest.mark.parametrize("state_kept_in", list(STATE_DTYPES))
@pytest.mark.parametrize("replicated_mode", ["split", "local"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("layout", ["ddp2", "hsdp2x2"])
def test_replicated_split_and_overlap_match_single_process_bitwise(
    layout: str, overlap: bool, replicated_mode: str, state_kept_in: str
) -> None:
    """Both opt-outs (``replicated="local"``, ``overlap=False``) and both defaults give the single-process result."""
    reference = reference_kept_in(state_kept_in)
    world, sharding = LAYOUTS[layout]
    options = {"replicated": replicated_mode, "overlap": overlap, "state_dtype": STATE_DTYPES[state_kept_in]}
    results = simulate(world, train, reference, sharding(), "owner", 1 << 26, **options)
    assert reference.state is not None
    for rank, (params, state, boxes) in enumerate(results):
        for name, value in reference.params[-1].items():
            assert torch.equal(params[name], take(value, boxes[name])), f"rank {rank}: {name}"
        check_state(state, reference.state, boxes, f"rank {rank}")


def test_small_buckets_move_in_rounds_and_stay_exact(reference: Reference) -> None:
    """With bucket_numel below one matrix, every unit travels in its own round; results do not change."""
    for strategy in EXACT:
        results = simulate(3, train, reference, fsdp(3), strategy, 50)
        for params, _, boxes in results:
            for name, value in params.items():
                assert torch.equal(value, take(reference.params[-1][name], boxes[name])), name


@functools.cache
def cautious_reference(mode: str) -> Reference:
    return reference_run(cautious_mode=mode)


@pytest.mark.parametrize("mode", muonfn.transforms.CAUTIOUS_MODES)
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("ddp3", "fsdp1", "fsdp3")])
def test_caution_counts_over_whole_leaves_as_one_process_does(layout: str, mode: str) -> None:
    """N/Σk of caution counts the whole leaf, not the shard (each replica once): bitwise the single-process run."""
    reference = cautious_reference(mode)
    world, sharding = LAYOUTS[layout]
    results = simulate(world, train, reference, sharding(), "owner", 1 << 26, cautious_mode=mode)
    for rank, (params, _, boxes) in enumerate(results):
        for name, value in reference.params[-1].items():
            assert torch.equal(params[name], take(value, boxes[name])), f"rank {rank}: {name} differs"


@pytest.mark.parametrize("mode", muonfn.transforms.CAUTIOUS_MODES)
@pytest.mark.parametrize("dim", [0, 1])
def test_caution_of_a_stacked_ensemble_counts_per_member_over_its_shards(dim: int, mode: str) -> None:
    """Three members of batch size [3], each member's matrix sharded by rows (dim 1), or the members
    split between the ranks (dim 0, batch sizes [1] and [2]): bitwise each member's single-process step."""
    gen = torch.Generator().manual_seed(0)
    full = TensorDict({"w": torch.randn(3, 8, 6, generator=gen), "t": torch.randn(3, generator=gen)}, [3])
    grads = [full.apply(lambda t: torch.randn(t.shape, generator=gen)) for _ in range(3)]
    options = {"lr": 0.1, "ns": NS, "cautious_mode": mode, "labels": {"w": "muon", "t": "adamw"}}

    def run(tx: muonfn.Transform, params: TensorDict, take_part: Callable[[TensorDict], TensorDict]) -> TensorDict:
        state = tx.init(params)
        for g in grads:
            updates, state = tx.update(take_part(g), state, params)
            params = muonfn.apply_updates(params, updates)
        return params

    expected = run(muonfn.muon(**options), full, lambda g: g)

    def body(col: SimulatedCollectives) -> tuple[TensorDict, slice, slice]:
        cut = [0, 1, 3] if dim == 0 else [0, 4, 8]
        rows, members = slice(cut[col.rank], cut[col.rank + 1]), slice(None)
        if dim == 0:
            rows, members = slice(None), rows

        def part(td: TensorDict) -> TensorDict:
            return TensorDict({"w": td["w"][members, rows], "t": td["t"][members]}, [len(td["t"][members])])

        tx = muonfn.muon(**options, orthogonalizer=sharded(col, shard_specs={"w": ShardSpec(dim)}))
        return run(tx, part(full), part), members, rows

    for params, members, rows in simulate(2, body):
        assert torch.equal(params["w"], expected["w"][members, rows])
        assert torch.equal(params["t"], expected["t"][members])


def test_caution_sums_its_counts_in_one_all_reduce_per_step() -> None:
    """Two numbers per sharded leaf, all leaves at once: caution adds one all_reduce a step and nothing else."""
    full = TensorDict({"w": torch.randn(8, 6), "v": torch.randn(6, 8)}, [])

    def run(col: SimulatedCollectives, mode: str | None) -> dict[str, int]:
        counting = CountingCollectives(col)
        shards = {k: fsdp(2)(col, k, full[k].shape) for k in ("w", "v")}
        specs = {k: spec for k, (_, spec) in shards.items()}
        tx = muonfn.muon(lr=0.1, orthogonalizer=sharded(counting, shard_specs=specs), cautious_mode=mode, ns=NS)
        params = TensorDict({k: take(full[k], box) for k, (box, _) in shards.items()}, [])
        state = tx.init(params)
        tx.update(params, state, params)  # the first step exchanges shapes
        counting.reset()
        tx.update(params, state, params)
        return counting.calls

    for plain, careful in zip(simulate(2, run, None), simulate(2, run, "heavyball")):
        assert careful == {**plain, "all_reduce": plain.get("all_reduce", 0) + 1}


NAN_STEP, NAN_LEAF = 1, "fc1.weight"


@functools.cache
def reference_without_nan_step() -> Reference:
    """The single-process run under apply_if_finite, with a NaN in one gradient at NAN_STEP: that step skipped."""
    with one_thread():
        reference = reference_run()
        tx = muonfn.apply_if_finite(make_tx())
        params = reference.params[0]
        state = tx.init(params)
        history = [params]
        for step, grads in enumerate(reference.grads):
            if step == NAN_STEP:
                grads = grads.clone()
                grads[NAN_LEAF][-1, -1] = float("nan")
            updates, state = tx.update(grads, state, params)
            params = muonfn.apply_updates(params, updates)
            history.append(params)
        assert int(state["notfinite_count"]) == 1
        return Reference(history, reference.grads)


@pytest.mark.parametrize("layout", ["fsdp2", "hsdp2x2", "hand_rolled_tp2_dp2", "odd_sizes4"])
def test_apply_if_finite_skips_on_every_rank_a_nan_one_shard_holds(layout: str) -> None:
    """The NaN lies in the shard of the last rows alone; counted over whole leaves, every rank skips the step."""
    reference = reference_without_nan_step()
    world, make_sharding = LAYOUTS[layout]
    sharding = make_sharding()

    def body(col: SimulatedCollectives) -> tuple[TensorDict, TensorDict, dict[str, Box]]:
        boxes, specs = shards(col, reference, sharding)
        params = TensorDict({k: take(reference.params[0][k], box) for k, box in boxes.items()}, [])
        tx = muonfn.apply_if_finite(
            make_tx(collectives=col, shard_specs=specs), sum_shards=shard_sums(col, shard_specs=specs)
        )
        state = tx.init(params)
        for step, full in enumerate(reference.grads):
            if step == NAN_STEP:  # in the last rows' shards only (and their replicas)
                full = full.clone()
                full[NAN_LEAF][-1, -1] = float("nan")
            grads = TensorDict({k: take(v, boxes[k]) for k, v in full.items()}, [])
            updates, state = tx.update(grads, state, params)
            params = muonfn.apply_updates(params, updates)
        return params, state, boxes

    for rank, (params, state, boxes) in enumerate(simulate(world, body)):
        assert int(state["notfinite_count"]) == 1, f"rank {rank}"
        for name, value in params.items():
            assert torch.equal(value, take(reference.params[-1][name], boxes[name])), f"rank {rank}: {name} differs"


# --------------------------------------------------------------------------- layouts


def nested_chunks(
    index: torch.Tensor, mesh_shape: tuple[int, ...], placements: tuple[Any, ...], coord: tuple[int, ...]
) -> torch.Tensor:
    """The shard of ``index`` at ``coord``, by cutting with torch.chunk in the order FSDP2 and DTensor do."""
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    order = [i for i in range(len(placements)) if i not in strided] + strided
    for i in order:
        p = placements[i]
        if isinstance(p, Replicate):
            continue
        pieces = torch.chunk(index, mesh_shape[i], dim=p.dim)
        index = pieces[coord[i]] if coord[i] < len(pieces) else index.narrow(p.dim, 0, 0)
    return index


def test_uneven_and_empty_shards_follow_torch_chunk() -> None:
    rows = [placement_layout((10, 4), (4,), (Shard(0),), range(4)).local_shape(r)[0] for r in range(4)]
    assert rows == [3, 3, 3, 1]
    rows = [placement_layout((3, 4), (4,), (Shard(0),), range(4)).local_shape(r)[0] for r in range(4)]
    assert rows == [1, 1, 1, 0]


MESH_PLACEMENTS = [
    ((4,), (Shard(0),)),
    ((4,), (Shard(1),)),
    ((2, 2), (Replicate(), Shard(0))),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Shard(0), Shard(0))),
    ((2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((2, 3), (_StridedShard(1, split_factor=3), Shard(1))),
    ((3, 2), (Shard(1), Replicate())),
]


@given(
    rows=st.integers(1, 13),
    cols=st.integers(1, 13),
    case=st.sampled_from(range(len(MESH_PLACEMENTS))),
    ranks_seed=st.integers(0, 100),
)
def test_layout_matches_nested_chunking(rows: int, cols: int, case: int, ranks_seed: int) -> None:
    mesh_shape, placements = MESH_PLACEMENTS[case]
    size = math.prod(mesh_shape)
    ranks = torch.randperm(size, generator=torch.Generator().manual_seed(ranks_seed)).tolist()
    layout = placement_layout((rows, cols), mesh_shape, placements, ranks)
    index = torch.arange(rows * cols).view(rows, cols)
    local_shapes = [None] * size
    for flat, coord in enumerate(itertools.product(*(range(s) for s in mesh_shape))):
        rank = ranks[flat]
        expected = nested_chunks(index, mesh_shape, placements, coord)
        assert torch.equal(take(index, layout.boxes[rank]), expected)
        local_shapes[rank] = tuple(expected.shape)
    assert placement_global_shape(local_shapes, mesh_shape, placements, ranks) == (rows, cols)
    # equal positions hold equal data; one rank per (replica, position)
    assert len({(layout.replica[r], layout.position[r]) for r in range(size)}) == size


# --------------------------------------------------------------------------- orthogonalize alone


def full_and_shards(col: SimulatedCollectives, full: dict[str, torch.Tensor], sharding: Sharding):
    boxes, specs = {}, {}
    for name, tensor in full.items():
        boxes[name], spec = sharding(col, name, tensor.shape)
        if spec is not None:
            specs[name] = spec
    return boxes, specs


def orthogonalize_sharded(
    col: SimulatedCollectives, full: dict[str, torch.Tensor], sharding: Sharding, ns: Any = NS, **kw: Any
):
    boxes, specs = full_and_shards(col, full, sharding)
    distributed = {k: kw.pop(k) for k in ("strategy", "bucket_numel") if k in kw}
    tx = muonfn.orthogonalize(ns, orthogonalizer=sharded(col, shard_specs=specs, **distributed), **kw)
    grads = TensorDict({k: take(v, boxes[k]) for k, v in full.items()}, batch_size=[])
    return tx.update(grads, tx.init(grads))[0], boxes


def per_matrix_ns(batch: torch.Tensor) -> torch.Tensor:
    """fp32 Newton–Schulz of every matrix of a batch alone, each in memory of its own: batch invariant
    for every shape (a CPU sgemm may round a matrix at another alignment in a stack differently)."""
    return torch.stack([muonfn.newton_schulz(m.clone(), dtype=torch.float32) for m in batch])


VIEW_CASES = {
    "plain": None,
    "transposed": muonfn.MatrixView(transposed=True),
    "split_rows": "split0",
    "split_cols": "split1",
}


@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 12),
    world=st.integers(1, 4),
    dim=st.integers(0, 1),
    view_case=st.sampled_from(list(VIEW_CASES)),
    strategy=st.sampled_from(EXACT),
    scale=st.sampled_from(["match_rms_adamw", "original", "unit_rms_norm"]),
)
def test_orthogonalize_sharded_equals_whole(
    rows: int, cols: int, world: int, dim: int, view_case: str, strategy: str, scale: str
) -> None:
    torch.manual_seed(rows * 100 + cols)
    full = {"w": torch.randn(rows, cols), "v": torch.randn(cols, rows), "u": torch.randn(rows, cols)}
    view = VIEW_CASES[view_case]
    if view == "split0" or view == "split1":
        split_dim = 0 if view == "split0" else 1
        n = (rows, cols)[split_dim]
        split = (n,) if n < 2 else (n // 2, n - n // 2)
        view = muonfn.MatrixView(split=split, split_dim=split_dim)
    views = {"w": view} if view is not None else None
    reference = muonfn.orthogonalize(per_matrix_ns, views=views, scale=scale)
    expected = reference.update(TensorDict(full, batch_size=[]), TensorDict())[0]
    sharding = by_placements((world,), lambda name, shape: (Shard(dim),))
    results = simulate(
        world, orthogonalize_sharded, full, sharding, per_matrix_ns, views=views, scale=scale, strategy=strategy
    )
    for out, boxes in results:
        for name in full:
            assert torch.equal(out[name], take(expected[name], boxes[name])), name


def test_experts_sharded_by_expert_move_no_data() -> None:
    """Shard(0) of an (E, out, in) expert weight gives whole matrices: Newton–Schulz runs where they lie."""
    torch.manual_seed(0)
    full = {"experts": torch.randn(5, 6, 4)}
    views = {"experts": muonfn.MatrixView(batch_dims=1)}
    expected = muonfn.orthogonalize(NS, views=views).update(TensorDict(full, []), TensorDict())[0]

    def body(col: SimulatedCollectives):
        counted = CountingCollectives(col)
        out, boxes = orthogonalize_sharded(counted, full, fsdp(4), views=views)
        return out, boxes, counted.calls

    for out, boxes, calls in simulate(4, body):
        assert torch.equal(out["experts"], take(expected["experts"], boxes["experts"]))
        assert "all_to_all_single" not in calls


# --------------------------------------------------------------------------- balance and traffic


def gpt_matrices(layers: int = 4, width: int = 16) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    shapes = {"qkv": (3 * width, width), "proj": (width, width), "fc": (4 * width, width), "fc2": (width, 4 * width)}
    return {f"{i}_{name}": torch.randn(*shape) for i in range(layers) for name, shape in shapes.items()}


def ns_flops(x: torch.Tensor) -> int:
    m, n = sorted(x.shape[-2:])
    return x.shape[0] * (4 * m * m * n + 2 * m**3)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("strategy", EXACT)
def test_owner_balances_flops_and_moves_the_expected_bytes(strategy: str, overlap: bool) -> None:
    """One exchange there and back per step; pipelined, one per shape (4 here), the same bytes."""
    full = gpt_matrices()
    rounds = 4 if overlap else 1
    world = 4
    total_numel = sum(t.numel() for t in full.values())
    total_flops = sum(ns_flops(t.unsqueeze(0)) for t in full.values())

    def body(col: SimulatedCollectives):
        counted = CountingCollectives(col)
        boxes, specs = full_and_shards(col, full, fsdp(world))
        work = []

        def ns(x: torch.Tensor) -> torch.Tensor:
            work.append(ns_flops(x))
            return muonfn.newton_schulz(x, dtype=torch.float32)

        run = sharded_orthogonalizer(counted, strategy=strategy, shard_specs=specs, overlap=overlap)
        names = list(full)
        values = [take(v, boxes[k]) for k, v in full.items()]
        run(names, values, [muonfn.MatrixView()] * len(names), ns, muonfn.linalg.shape_scale("none"))
        counted.reset()  # the first call also checked that the ranks agree; count a steady step
        work.clear()
        run(names, values, [muonfn.MatrixView()] * len(names), ns, muonfn.linalg.shape_scale("none"))
        return sum(work), counted.bytes_received, counted.bytes_sent, counted.calls

    results = simulate(world, body)
    flops = [r[0] for r in results]
    received = [r[1] for r in results]
    if strategy == "owner":
        assert sum(flops) == total_flops
        assert max(flops) <= 1.1 * total_flops / world
        # each matrix: W-1 shards to its owner, W-1 shards back (even shards here)
        assert sum(received) == 2 * (world - 1) * total_numel * 4 // world
        assert max(received) <= 1.25 * sum(received) / world
        assert all(r[3] == {"all_to_all_single": 2 * rounds} for r in results)
    else:
        assert flops == [total_flops] * world
        assert received == [(world - 1) * total_numel * 4 // world] * world
        assert all(r[3] == {"all_gather_into_tensor": rounds} for r in results)


def steady_step(col: Any, full: dict[str, torch.Tensor], sharding: Sharding, **options: Any):
    """One rank's Newton–Schulz flops, bytes received and calls in a step after the first, and its results."""
    counted = CountingCollectives(col)
    boxes, specs = full_and_shards(col, full, sharding)
    work: list[int] = []

    def ns(x: torch.Tensor) -> torch.Tensor:
        work.append(ns_flops(x))
        return muonfn.newton_schulz(x, dtype=torch.float32)

    run = sharded_orthogonalizer(counted, shard_specs=specs, **options)
    names = list(full)
    values = [take(v, boxes[k]) for k, v in full.items()]
    args = ([muonfn.MatrixView()] * len(names), ns, muonfn.linalg.shape_scale("none"))
    run(names, values, *args)
    counted.reset()  # the first call also checked that the ranks agree; count a steady step
    work.clear()
    out = run(names, values, *args)
    return sum(work), counted.bytes_received, counted.calls, dict(zip(full, out)), boxes


@pytest.mark.parametrize("overlap", [False, True])
def test_replicated_matrices_are_orthogonalized_once_and_sent_to_every_rank(overlap: bool) -> None:
    """Data parallelism on 4 ranks: each rank computes about 1/4 of the flops and receives the other
    ranks' results, (W-1)/W of the matrices in all; nothing travels to the owners."""
    full = gpt_matrices()
    world = 4
    total_numel = sum(t.numel() for t in full.values())
    total_flops = sum(ns_flops(t.unsqueeze(0)) for t in full.values())
    expected = {
        k: muonfn.newton_schulz(v.unsqueeze(0), dtype=torch.float32)[0] for k, v in full.items()
    }  # shape_scale("none"): the bare polar factor
    results = simulate(world, steady_step, full, replicated(), overlap=overlap)
    flops = [r[0] for r in results]
    assert sum(flops) == total_flops and max(flops) <= 1.1 * total_flops / world
    assert sum(r[1] for r in results) == (world - 1) * total_numel * 4
    for _, _, calls, out, _ in results:
        assert calls == {"all_to_all_single": 4 if overlap else 1}  # one outward exchange per round
        for name in full:
            assert torch.equal(out[name], expected[name]), name

    local = simulate(world, steady_step, full, replicated(), replicated="local")
    assert all(r[0] == total_flops and r[2] == {} for r in local)  # every rank computes everything, no traffic


def test_hsdp_replicas_share_the_work() -> None:
    """HSDP 2 x 2: with the replicate dimension split, each unit is orthogonalized once in the group;
    with replicated="local", once per replica group."""
    full = gpt_matrices(layers=2)
    total_flops = sum(ns_flops(t.unsqueeze(0)) for t in full.values())
    expected = {k: muonfn.newton_schulz(v.unsqueeze(0), dtype=torch.float32)[0] for k, v in full.items()}
    for mode, copies in (("split", 1), ("local", 2)):
        results = simulate(4, steady_step, full, hsdp(), replicated=mode)
        flops = [r[0] for r in results]
        assert sum(flops) == copies * total_flops, mode
        assert max(flops) <= 1.25 * copies * total_flops / 4, mode
        for _, _, _, out, boxes in results:
            for name in full:
                assert torch.equal(out[name], take(expected[name], boxes[name])), (mode, name)


class _OrderRecorder(CountingCollectives):
    """Records the order of exchanges and Newton–Schulz calls (a blocking exchange starts its
    ``*_async`` form and waits)."""

    def __init__(self, inner: Any, events: list[str]) -> None:
        super().__init__(inner)
        self.events = events

    def all_to_all_single_async(self, *args: Any) -> Any:
        self.events.append("exchange")
        return super().all_to_all_single_async(*args)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_starts_the_next_exchange_before_this_rounds_newton_schulz(overlap: bool) -> None:
    full = gpt_matrices(layers=2)

    def body(col: SimulatedCollectives):
        events: list[str] = []
        recorder = _OrderRecorder(col, events)
        boxes, specs = full_and_shards(col, full, fsdp(2))

        def ns(x: torch.Tensor) -> torch.Tensor:
            events.append("ns")
            return muonfn.newton_schulz(x, dtype=torch.float32)

        run = sharded_orthogonalizer(recorder, shard_specs=specs, overlap=overlap)
        names = list(full)
        values = [take(v, boxes[k]) for k, v in full.items()]
        run(names, values, [muonfn.MatrixView()] * len(names), ns, muonfn.linalg.shape_scale("none"))
        return events

    for events in simulate(2, body):
        runs = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1] or e == "exchange"]
        if overlap:  # in(0), in(1), NS(0), out(0), in(2), NS(1), out(1), ...: four shapes, four rounds
            assert events.index("ns") >= 2, events  # (a rank owning nothing of round 0 computes later)
            assert events.count("exchange") == 8
        else:  # in(0), NS(0) of every shape, out(0): one round
            assert runs == ["exchange", "ns", "exchange"], events


def test_modelled_link_lets_compute_run_during_an_exchange() -> None:
    """An asynchronous exchange returns at once and takes the link's time on the communication thread."""
    link = Link(latency_s=0.2)

    def body(col: SimulatedCollectives):
        out = torch.empty(2 * col.world_size)
        begin = time.perf_counter()
        handle = col.all_gather_into_tensor_async(out, torch.full((2,), float(col.rank)))
        started = time.perf_counter() - begin
        handle.wait()
        return started, time.perf_counter() - begin, out.tolist()

    for started, finished, out in simulate(2, body, link=link):
        assert started < 0.1 <= 0.2 <= finished
        assert out == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="bytes_per_s"):
        Link(bytes_per_s=0)


# --------------------------------------------------------------------------- errors


def test_ranks_passing_different_leaves_get_an_error_not_a_hang() -> None:
    def body(col: SimulatedCollectives):
        names = ["a", "b"] if col.rank == 0 else ["a"]
        grads = TensorDict({n: torch.randn(2, 3) for n in names}, [])
        tx = muonfn.orthogonalize(orthogonalizer=sharded(col, shard_specs={n: ShardSpec(0) for n in names}))
        tx.update(grads, TensorDict())

    with pytest.raises(RuntimeError, match="different leaves"):
        simulate(2, body, timeout=30)


def test_replicated_tensors_that_differ_between_ranks_get_an_error() -> None:
    """Plain tensors are taken as replicated: a rank passing another shape is named, before anything moves."""

    def body(col: SimulatedCollectives):
        grads = TensorDict({"w": torch.randn(4, 3 + col.rank)}, [])
        muonfn.orthogonalize(orthogonalizer=sharded(col)).update(grads, TensorDict())

    with pytest.raises(RuntimeError, match="different leaves"):
        simulate(2, body, timeout=30)

    def local(col: SimulatedCollectives):  # replicated="local" leaves each rank its own matrices
        grads = TensorDict({"w": torch.randn(4, 3 + col.rank)}, [])
        return muonfn.orthogonalize(orthogonalizer=sharded(col, replicated="local")).update(grads, TensorDict())[0]

    assert [out["w"].shape for out in simulate(2, local)] == [(4, 3), (4, 4)]


def test_shards_that_disagree_off_the_sharded_dim_are_named() -> None:
    def body(col: SimulatedCollectives):
        grads = TensorDict({"w": torch.randn(2, 3 + col.rank)}, [])
        muonfn.orthogonalize(orthogonalizer=sharded(col, shard_specs={"w": ShardSpec(0)})).update(grads, TensorDict())

    with pytest.raises(ValueError, match=r"'w'.*agree on every other dimension"):
        simulate(2, body, timeout=30)


def test_views_are_checked_against_the_global_shape() -> None:
    def run(split: tuple[int, ...]):
        def body(col: SimulatedCollectives):
            grads = TensorDict({"qkv": torch.randn(4, 3)}, [])  # 8 rows in all
            tx = muonfn.orthogonalize(
                orthogonalizer=sharded(col, shard_specs={"qkv": ShardSpec(0)}),
                views={"qkv": muonfn.MatrixView(split=split)},
            )
            return tx.update(grads, TensorDict())[0]

        return simulate(2, body, timeout=30)

    run((3, 5))  # splits the 8 global rows: fine although each shard has 4
    with pytest.raises(ValueError, match=r"'qkv'.*does not partition the 8"):
        run((2, 2))


def test_bad_configuration_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="explicit DeviceMesh or ProcessGroup"):
        torch_collectives(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="either dim or placements"):
        ShardSpec()
    with pytest.raises(ValueError, match="mesh_shape"):
        ShardSpec(placements=(Shard(0),))
    with pytest.raises(TypeError, match="Collectives"):
        sharded(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Collectives"):
        shard_sums(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cautious: sum_shards must be callable"):
        muonfn.cautious(muonfn.ema_momentum(), sum_shards=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="apply_if_finite: sum_shards must be callable"):
        muonfn.apply_if_finite(muonfn.ema_momentum(), sum_shards=3)  # type: ignore[arg-type]

    def body(col: SimulatedCollectives):
        with pytest.raises(ValueError, match=r"unknown distributed strategy 'scatter'; choose one of \['owner'"):
            sharded(col, strategy="scatter")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown replicated='owner'"):
            sharded(col, replicated="owner")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="overlap must be True or False"):
            sharded(col, overlap="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="bucket_numel must be an integer >= 1"):
            sharded(col, bucket_numel=0)
        with pytest.raises(TypeError, match=r"shard_specs\['w'\] must be a muonfn.distributed.ShardSpec"):
            sharded(col, shard_specs={"w": 0})  # type: ignore[dict-item]
        with pytest.raises(TypeError, match="shard_specs must be a mapping of names to ShardSpec, got list"):
            sharded(col, shard_specs=["w"])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"shard_specs\['w'\] must be a muonfn.distributed.ShardSpec"):
            shard_sums(col, shard_specs={"w": 0})  # type: ignore[dict-item]
        grads = TensorDict({"w": torch.randn(4, 3)}, [])
        spec = ShardSpec(placements=(Shard(0),), mesh_shape=(3,))
        tx = muonfn.orthogonalize(orthogonalizer=sharded(col, shard_specs={"w": spec}))
        with pytest.raises(ValueError, match=r"'w'.*mesh_shape"):
            tx.update(grads, TensorDict())

    simulate(2, body, timeout=30)


def test_simulation_reports_the_failing_rank_and_mismatched_calls() -> None:
    def fails_on_one(col: SimulatedCollectives):
        if col.rank == 1:
            raise KeyError("boom")
        col.all_reduce(torch.ones(1))  # would wait forever for rank 1

    with pytest.raises(KeyError, match="boom"):
        simulate(3, fails_on_one, timeout=30)

    def mismatched(col: SimulatedCollectives):
        if col.rank == 0:
            col.all_reduce(torch.ones(1))
        else:
            col.all_gather_into_tensor(torch.empty(2), torch.ones(1))

    with pytest.raises(RuntimeError, match="different operations"):
        simulate(2, mismatched, timeout=30)

    def wrong_splits(col: SimulatedCollectives):
        col.all_to_all_single(torch.empty(2), torch.ones(2), [1, 1], [2, 0] if col.rank == 0 else [1, 1])

    with pytest.raises(RuntimeError, match="expects"):
        simulate(2, wrong_splits, timeout=30)


def test_simulated_collectives_exchange_data() -> None:
    def body(col: SimulatedCollectives):
        r, w = col.rank, col.world_size
        gathered = torch.empty(2 * w)
        col.all_gather_into_tensor(gathered, torch.tensor([r, 10.0 * r]))
        total = torch.tensor([float(r + 1)])
        col.all_reduce(total)
        # rank r sends r+1 copies of its rank to rank 0 and nothing elsewhere
        sends = [r + 1 if d == 0 else 0 for d in range(w)]
        recvs = [s + 1 for s in range(w)] if r == 0 else [0] * w
        out = torch.empty(sum(recvs))
        col.all_to_all_single(out, torch.full((r + 1,), float(r)), recvs, sends)
        sub = col.subgroup([w - 1 - r for r in range(w)])
        total_sub = torch.tensor([float(sub.rank)])
        sub.all_reduce(total_sub)
        return gathered.tolist(), total.item(), out.tolist(), sub.rank, total_sub.item()

    results = simulate(3, body)
    for r, (gathered, total, out, sub_rank, sub_total) in enumerate(results):
        assert gathered == [0, 0, 1, 10, 2, 20]
        assert total == 6
        assert out == ([0, 1, 1, 2, 2, 2] if r == 0 else [])
        assert sub_rank == 2 - r and sub_total == 3


class _RecordingCollectives(CountingCollectives):
    """Also records the largest receive buffer of any exchange: the whole matrices a rank holds at once."""

    largest = 0

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes) -> None:
        self.largest = max(self.largest, output.numel())
        super().all_to_all_single(output, input, output_split_sizes, input_split_sizes)


def test_owner_holds_at_most_a_bucket_of_whole_matrices_at_once() -> None:
    full = gpt_matrices(layers=2, width=16)  # matrices of 256 to 1024 elements, 4096 in a layer
    cap = 1500

    def body(col: SimulatedCollectives):
        recording = _RecordingCollectives(col)
        out, boxes = orthogonalize_sharded(recording, full, fsdp(4), bucket_numel=cap)
        return out, boxes, recording.largest, recording.calls["all_to_all_single"]

    expected = muonfn.orthogonalize(NS).update(TensorDict(full, []), TensorDict())[0]
    for out, boxes, largest, exchanges in simulate(4, body):
        assert largest <= cap
        assert exchanges > 2  # several rounds
        for name in full:
            assert torch.equal(out[name], take(expected[name], boxes[name]))


def test_mixed_dtypes_travel_separately() -> None:
    torch.manual_seed(0)
    full = {"a": torch.randn(6, 10).bfloat16(), "b": torch.randn(6, 10), "c": torch.randn(9, 4).double()}
    expected = muonfn.orthogonalize(NS).update(TensorDict(full, []), TensorDict())[0]
    for strategy in EXACT:
        for out, boxes in simulate(3, orthogonalize_sharded, full, fsdp(3), strategy=strategy):
            for name in full:
                assert out[name].dtype == full[name].dtype
                assert torch.equal(out[name], take(expected[name], boxes[name])), (strategy, name)


# --------------------------------------------------------------------------- tp_gram


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp4", "tp2_fsdp2", "hand_rolled_tp2_dp2"])
def test_tp_gram_training_matches_to_rounding(reference: Reference, layout: str) -> None:
    world, sharding = LAYOUTS[layout]
    for params, _, boxes in simulate(world, train, reference, sharding(), "tp_gram", 1 << 26):
        for name, value in params.items():
            expected = take(reference.params[-1][name], boxes[name])
            torch.testing.assert_close(value, expected, **TP_GRAM_ROUNDING, msg=name)


def test_tp_gram_sums_grams_for_long_side_shards_and_sends_the_rest_to_owners() -> None:
    torch.manual_seed(0)
    # wide (8, 40) cut along its 40 columns, tall (40, 8) along its 40 rows: Gram; (8, 40) cut along rows: owner
    full = {"wide": torch.randn(8, 40), "tall": torch.randn(40, 8), "rows_of_wide": torch.randn(8, 40)}
    dims = {"wide": 1, "tall": 0, "rows_of_wide": 0}
    sharding = by_placements((4,), lambda name, shape: (Shard(dims[name]),))
    expected = muonfn.orthogonalize(NS).update(TensorDict(full, []), TensorDict())[0]

    def body(col: SimulatedCollectives):
        counted = CountingCollectives(col)
        out, boxes = orthogonalize_sharded(counted, full, sharding, strategy="tp_gram")
        counted.reset()
        orthogonalize_sharded(counted, full, sharding, strategy="tp_gram")
        return out, boxes, counted.calls

    for out, boxes, calls in simulate(4, body):
        for name in full:
            torch.testing.assert_close(out[name], take(expected[name], boxes[name]), **TP_GRAM_ROUNDING)
        # one batch of two (8, 40) Gram problems: the norm, then one Gram per step (5); one owner round
        assert calls["all_reduce"] == 6 and calls["all_to_all_single"] == 2


def test_tp_gram_normalises_without_overflow() -> None:
    """Column blocks of 1e30-scale entries: the max-abs rescaling is reduced over ranks too, so the
    squared norm cannot overflow and the update is the unscaled one, not zero."""
    torch.manual_seed(1)
    full = {"wide": torch.randn(8, 40)}
    sharding = by_placements((4,), lambda name, shape: (Shard(1),))
    expected = muonfn.orthogonalize(NS).update(TensorDict(full, []), TensorDict())[0]
    huge = {"wide": full["wide"] * 1e30}

    for out, boxes in simulate(4, lambda col: orthogonalize_sharded(col, huge, sharding, strategy="tp_gram")):
        assert torch.isfinite(out["wide"]).all()
        torch.testing.assert_close(out["wide"], take(expected["wide"], boxes["wide"]), **TP_GRAM_ROUNDING)
