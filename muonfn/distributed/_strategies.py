r"""Newton–Schulz on sharded matrices: the strategies that carry out a :class:`~._plan.Plan`.

- ``"owner"`` (default): shards travel to their unit's owner in one ``all_to_all_single``
  per round, the owners orthogonalize (same shapes batched), and the results travel back
  the same way. Each rank computes about :math:`1/W` of the work and receives about
  :math:`2(W-1)S/W^2` of the :math:`S` matrix elements.
- ``"gather"``: every rank all-gathers every unit (``all_gather_into_tensor`` of padded
  buffers), orthogonalizes all of them and keeps its part: :math:`W\times` the compute,
  :math:`(W-1)S/W` elements received per rank.
- ``"tp_gram"``: matrices cut along their long side into one block per rank (column-parallel
  tensor parallelism) stay where they are: each Newton–Schulz step all-reduces the
  :math:`m\times m` Gram matrix :math:`XX^\top = \sum_r X_rX_r^\top`, and
  :math:`X_r \leftarrow aX_r + (bA + cA^2)X_r` is local. It receives about
  :math:`2(W-1)/W\cdot(k+1)m^2` elements per matrix for :math:`k` steps, against the owner's
  :math:`2(W-1)mn/W^2`: cheaper once :math:`n > (k+1)Wm`. Other units go to their owner.
  Sums over ranks round differently from one matrix product, so results match the
  single-process ones to rounding, not bitwise.

Orientation and scale always come from a unit's global shape, and ``"owner"`` and
``"gather"`` run the math on the assembled tensor, so their results are bitwise the
single-process ones whenever Newton–Schulz is batch invariant (as fp32 ``bmm`` on CPU with
one intra-op thread is; multithreaded CPU BLAS may pick kernels by batch size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import _tree
from .._newton_schulz import Coefficients, CoefficientsLike, default_ns_dtype, ns_schedule
from .._transforms import DEFAULT_BUCKET_NUMEL, orthogonalize_batches
from .._views import MatrixView, block_scales
from ._collectives import Collectives
from ._layout import ShardSpec, copy_into, copy_out
from ._plan import Batch, GramBatch, Leaf, Plan, box_numel, box_shape, describe, make_plan, unit_view

STRATEGIES = ("owner", "gather", "tp_gram")

ShardSpecs = Mapping[Any, ShardSpec]
NS = Callable[[torch.Tensor], torch.Tensor]


def sharded_orthogonalizer(
    collectives: Collectives,
    strategy: str = "owner",
    shard_specs: ShardSpecs | None = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    *,
    coefficients: CoefficientsLike = "keller",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> Callable[..., list[torch.Tensor]]:
    """The distributed step of :func:`muonfn.orthogonalize`: ``fn(keys, values, views, ns, scale, extra_scale)``.

    ``values`` are DTensors (their placements say how they are sharded), plain tensors
    named in ``shard_specs`` (local shards, see :class:`ShardSpec`) or plain tensors
    (whole matrices, orthogonalized locally). Returns the orthogonalized and scaled leaves,
    each with its input's type, placements and local shape. ``coefficients``, ``steps``,
    ``eps`` and ``dtype`` describe ``ns`` for ``"tp_gram"``, which runs the iteration itself.
    """
    needed = ("rank", "world_size", "all_gather_into_tensor", "all_to_all_single", "all_reduce")
    if collectives is None or not all(hasattr(collectives, name) for name in needed):
        raise TypeError(f"collectives must implement muonfn.distributed.Collectives, got {collectives!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown distributed strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    specs = dict(shard_specs or {})
    for name, spec in specs.items():
        if not isinstance(spec, ShardSpec):
            raise TypeError(f"shard_specs[{name!r}] must be a muonfn.distributed.ShardSpec, got {spec!r}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    schedule = ns_schedule(coefficients, steps)
    plans: dict[tuple[Any, ...], Plan] = {}

    def plan_for(group: Any, members: list[Leaf]) -> Plan:
        key = (id(group), tuple(leaf.signature() for leaf in members))
        plan = plans.get(key)
        if plan is None:
            if len(plans) >= 16:
                plans.clear()
            plan = make_plan(group, members, strategy, bucket_numel)
            plans[key] = plan.with_leaves([])  # the cache keeps no tensors alive
        return plan.with_leaves(members)

    def orthogonalize_sharded(
        keys: Sequence[_tree.Key],
        values: Sequence[torch.Tensor],
        leaf_views: Sequence[MatrixView],
        ns: NS,
        scale: str,
        extra_scale: float,
    ) -> list[torch.Tensor]:
        declared: dict[_tree.Key, ShardSpec] = {}
        for name, spec in specs.items():
            try:
                declared[_tree.resolve_key(name, keys)] = spec
            except KeyError:
                continue  # a spec for a leaf without a gradient this step, or routed elsewhere
        leaves = [
            describe(i, key, value, view, declared.get(key), collectives)
            for i, (key, value, view) in enumerate(zip(keys, values, leaf_views))
        ]
        groups: dict[int, tuple[Any, list[Leaf]]] = {}
        for leaf in leaves:
            if leaf.group is not None:
                groups.setdefault(id(leaf.group), (leaf.group, []))[1].append(leaf)
        # plans first: making one exchanges shapes, and every rank must reach that in the same order
        plans_now = [(group, plan_for(group, members)) for group, members in groups.values()]

        out: list[torch.Tensor | None] = [None] * len(leaves)
        # whole matrices where they lie: unsharded leaves, and shards that hold whole matrices (experts)
        whole = [(leaf, tuple(leaf.local.shape)) for leaf in leaves if leaf.group is None]
        for leaf, shape in whole:
            leaf.view.check(leaf.key, shape)
        for _, plan in plans_now:
            whole += [
                (leaf, layout.shape) for leaf, layout, local in zip(plan.leaves, plan.layouts, plan.local) if local
            ]
        done = _orthogonalize_in_place(whole, ns, scale, extra_scale, bucket_numel)
        for (leaf, _), result in zip(whole, done):
            out[leaf.index] = leaf.wrap(result)

        for group, plan in plans_now:
            results = [torch.empty_like(leaf.local) for leaf in plan.leaves]
            for batch in plan.gram:
                _run_gram(group, plan, batch, results, schedule, eps, dtype, scale, extra_scale)
            for round_batches in plan.rounds:
                for unit_batch in round_batches:
                    run = _run_gather if strategy == "gather" else _run_owner
                    run(group, plan, unit_batch, results, ns, scale, extra_scale, bucket_numel)
            for leaf, local, result in zip(plan.leaves, plan.local, results):
                if not local:
                    out[leaf.index] = leaf.wrap(result)
        assert all(t is not None for t in out)
        return out  # type: ignore[return-value]

    return orthogonalize_sharded


def _orthogonalize_in_place(
    leaves: list[tuple[Leaf, tuple[int, ...]]], ns: NS, scale: str, extra_scale: float, cap: int
) -> list[torch.Tensor]:
    """Leaves whose local tensors hold whole matrices, each with its global shape (for the scale)."""
    matrices: list[torch.Tensor] = []
    scales: list[float] = []
    for leaf, shape in leaves:
        if leaf.local.numel():
            matrices += leaf.view.to_matrices(leaf.local)
            scales += block_scales(leaf.view, shape, scale, extra_scale)
    done = orthogonalize_batches(matrices, scales, ns, cap)
    results, pos = [], 0
    for leaf, shape in leaves:
        if leaf.local.numel():
            n = len(leaf.view.blocks(shape))
            results.append(leaf.view.from_matrices(done[pos : pos + n], leaf.local.shape))
            pos += n
        else:
            results.append(torch.empty_like(leaf.local))
    return results


def _orthogonalize_units(
    plan: Plan, units: list[int], fulls: dict[int, torch.Tensor], ns: NS, scale: str, extra_scale: float, cap: int
) -> dict[int, torch.Tensor]:
    """``scale * NS`` of whole units, through each leaf's view; same shapes batched."""
    matrices: list[torch.Tensor] = []
    scales: list[float] = []
    for u in units:
        unit = plan.units[u]
        view = unit_view(plan.leaves[unit.leaf].view)
        matrices += view.to_matrices(fulls[u])
        scales += block_scales(view, unit.shape, scale, extra_scale)
    done = orthogonalize_batches(matrices, scales, ns, cap)
    results, pos = {}, 0
    for u in units:
        unit = plan.units[u]
        view = unit_view(plan.leaves[unit.leaf].view)
        n = len(view.blocks(unit.shape))
        results[u] = view.from_matrices(done[pos : pos + n], unit.shape)
        pos += n
    return results


def _local_units(plan: Plan, leaf: int, tensor: torch.Tensor) -> torch.Tensor:
    """A local shard as ``(local units, *shard of one unit)``."""
    return tensor.reshape(-1, *tensor.shape[plan.leaves[leaf].view.batch_dims :])


def _run_owner(
    group: Collectives,
    plan: Plan,
    batch: Batch,
    results: list[torch.Tensor],
    ns: NS,
    scale: str,
    extra_scale: float,
    cap: int,
) -> None:
    me, units = group.rank, plan.units

    def my_piece(u: int) -> tuple[int, tuple[int, ...]]:
        box = units[u].holders[me][1]
        return box_numel(box), box_shape(box)

    send = torch.empty(sum(batch.send_splits), dtype=batch.dtype, device=batch.device)
    offset = 0
    for u, pos, _ in batch.sends:
        n, shape = my_piece(u)
        send[offset : offset + n].view(shape).copy_(
            _local_units(plan, units[u].leaf, plan.leaves[units[u].leaf].local)[pos]
        )
        offset += n
    recv = torch.empty(sum(batch.recv_splits), dtype=batch.dtype, device=batch.device)
    group.all_to_all_single(recv, send, batch.recv_splits, batch.send_splits)

    owned = sorted({u for u, _, _ in batch.recvs})
    fulls = {u: torch.empty(units[u].shape, dtype=batch.dtype, device=batch.device) for u in owned}
    offset = 0
    for u, _, box in batch.recvs:
        n = box_numel(box)
        copy_into(fulls[u], recv[offset : offset + n].view(box_shape(box)), box)
        offset += n
    done = _orthogonalize_units(plan, owned, fulls, ns, scale, extra_scale, cap)
    del fulls
    offset = 0
    for u, _, box in batch.recvs:  # the buffer goes back the way it came
        n = box_numel(box)
        copy_out(done[u], box, recv[offset : offset + n].view(box_shape(box)))
        offset += n
    group.all_to_all_single(send, recv, batch.send_splits, batch.recv_splits)

    offset = 0
    for u, pos, _ in batch.sends:
        n, shape = my_piece(u)
        _local_units(plan, units[u].leaf, results[units[u].leaf])[pos].copy_(send[offset : offset + n].view(shape))
        offset += n


def _run_gather(
    group: Collectives,
    plan: Plan,
    batch: Batch,
    results: list[torch.Tensor],
    ns: NS,
    scale: str,
    extra_scale: float,
    cap: int,
) -> None:
    me, units = group.rank, plan.units
    send = torch.zeros(batch.padded, dtype=batch.dtype, device=batch.device)
    mine = [u for u in batch.units if me in units[u].holders]
    for u in mine:
        pos, box = units[u].holders[me]
        start = batch.offsets[u, me]
        local = _local_units(plan, units[u].leaf, plan.leaves[units[u].leaf].local)[pos]
        send[start : start + box_numel(box)].view(box_shape(box)).copy_(local)
    everyone = torch.empty(group.world_size * batch.padded, dtype=batch.dtype, device=batch.device)
    group.all_gather_into_tensor(everyone, send)

    fulls = {}
    for u in mine:  # only the units this rank keeps part of; replicas' copies are skipped
        unit = units[u]
        full = torch.empty(unit.shape, dtype=batch.dtype, device=batch.device)
        for r, (_, box) in unit.holders.items():
            if unit.layout.replica[r] == unit.layout.replica[me]:
                start = r * batch.padded + batch.offsets[u, r]
                copy_into(full, everyone[start : start + box_numel(box)].view(box_shape(box)), box)
        fulls[u] = full
    del everyone
    done = _orthogonalize_units(plan, mine, fulls, ns, scale, extra_scale, cap)
    for u in mine:
        pos, box = units[u].holders[me]
        copy_out(done[u], box, _local_units(plan, units[u].leaf, results[units[u].leaf])[pos])


def _run_gram(
    group: Collectives,
    plan: Plan,
    batch: GramBatch,
    results: list[torch.Tensor],
    schedule: Coefficients,
    eps: float,
    dtype: torch.dtype | None,
    scale: str,
    extra_scale: float,
) -> None:
    r"""Newton–Schulz on column blocks: :math:`\|X\|_F^2` and every :math:`XX^\top` are summed over ranks."""
    blocks = [plan.leaves[i].local for i in batch.leaves]
    x = torch.stack([b.mT if flip else b for b, flip in zip(blocks, batch.flips)])
    wide_dtype = torch.promote_types(x.dtype, torch.float32)
    ns_dtype = default_ns_dtype(x.device, x.dtype) if dtype is None else dtype
    g = x.to(wide_dtype).contiguous()
    squares = g.square().sum(dim=(-2, -1))
    group.all_reduce(squares)
    norm = squares.sqrt().view(-1, 1, 1)
    if schedule.norm_factor != 1.0:
        norm = norm * schedule.norm_factor
    X = (g / norm.clamp_min(eps)).to(ns_dtype)
    for a, b, c in schedule.triples:
        A = torch.bmm(X, X.mT)
        group.all_reduce(A)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    for j, (i, flip) in enumerate(zip(batch.leaves, batch.flips)):
        (s,) = block_scales(plan.leaves[i].view, plan.layouts[i].shape, scale, extra_scale)
        block = (X[j].mT if flip else X[j]).to(results[i].dtype)
        results[i].copy_(block.mul_(s) if s != 1.0 else block)
