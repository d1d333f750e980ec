r"""Newton–Schulz on sharded matrices: whole matrices are assembled, orthogonalized, and cut again.

A leaf is cut into *units*: one per index of its view's batch dimensions (an expert of an
MoE weight), the whole leaf otherwise. A unit every holder keeps whole (experts sharded
over ranks, a replicated weight) is orthogonalized where it lies; the others move:

- ``"owner"``: every unit gets one owner per replica, chosen to balance Newton–Schulz
  flops (:math:`4m^2n + 2m^3` per step for :math:`m \le n`, heaviest first, each to the
  least loaded rank). Shards travel to their owner in one ``all_to_all_single``, the
  owners orthogonalize (same shapes batched), and the results travel back the same way.
  Each rank computes about :math:`1/W` of the work and moves
  :math:`\approx 2\,(W-1)/W^2` of the matrix bytes each way.
- ``"gather"``: every rank all-gathers every unit, orthogonalizes all of them and keeps
  its own part: :math:`W\times` the compute, :math:`(W-1)/W` of the bytes received.

Units move in rounds of at most ``bucket_numel`` elements of whole matrices per rank, so
no rank holds more than that (plus its send and receive buffers) at once. Orientation
and scale always come from the unit's global shape, and the math runs on the assembled
tensor, so the result is bitwise the single-process result whenever Newton–Schulz is
batch invariant (as fp32 ``bmm`` on CPU is).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _tree
from .._transforms import DEFAULT_BUCKET_NUMEL, orthogonalize_batches
from .._views import MatrixView, block_scales
from ._collectives import Collectives
from ._layout import Box, Layout, ShardSpec, copy_into, copy_out, length, placement_global_shape, placement_layout
from ._layout import sizes_layout as _sizes_layout

STRATEGIES = ("owner", "gather")

ShardSpecs = Mapping[Any, ShardSpec]
NS = Callable[[torch.Tensor], torch.Tensor]


def _dtensor_type() -> Any:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


@dataclass
class _Leaf:
    """One gradient leaf as this rank sees it."""

    index: int
    key: _tree.Key
    local: torch.Tensor
    view: MatrixView
    group: Any = None  # Collectives; None for a leaf that is not sharded
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple[Any, ...] | None = None
    coords: tuple[int, ...] | None = None  # group rank of each mesh coordinate
    shape: tuple[int, ...] | None = None  # global shape, known up front for DTensors
    spec: ShardSpec | None = None
    wrap: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda t: t)

    def signature(self) -> tuple[Any, ...]:
        local_shape = tuple(self.local.shape) if self.spec is not None else None
        return (
            self.key,
            self.shape,
            local_shape,
            self.mesh_shape,
            self.placements,
            self.coords,
            None if self.spec is None else (self.spec.dim, self.spec.placements, self.spec.mesh_shape),
            self.local.dtype,
            self.local.device,
            self.view,
        )


@dataclass
class _Unit:
    leaf: int  # index into the plan's leaves
    shape: tuple[int, ...]  # of the whole unit (the leaf's shape after its batch dimensions)
    layout: Layout
    holders: dict[int, tuple[int, Box]]  # group rank -> (its local batch position, its box of the unit)
    cost: int
    owner: int = 0  # position of the owner in every replica


@dataclass
class _Batch:
    """The units of one round that share a dtype and device, and this rank's traffic for them."""

    dtype: torch.dtype
    device: torch.device
    units: list[int]
    # owner: pieces this rank sends (leaf, local position, peer) and receives (unit, peer, box),
    # each sorted by peer and then unit, with the split sizes per peer
    sends: list[tuple[int, int, int]] = field(default_factory=list)
    recvs: list[tuple[int, int, Box]] = field(default_factory=list)
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    # gather: every rank's padded contribution length and the offset of each unit in it
    padded: int = 0
    offsets: dict[tuple[int, int], int] = field(default_factory=dict)


@dataclass
class _Plan:
    leaves: list[_Leaf]
    layouts: list[Layout]
    local: list[bool]  # every holder keeps whole matrices: no exchange
    units: list[_Unit]
    batches: list[list[_Batch]]  # per round


def _ns_cost(rows: int, cols: int) -> int:
    m, n = min(rows, cols), max(rows, cols)
    return 4 * m * m * n + 2 * m * m * m


def _unit_view(view: MatrixView) -> MatrixView:
    return MatrixView(0, view.transposed, view.split, view.split_dim)


def _box_numel(box: Box) -> int:
    return math.prod(length(r) for r in box)


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(length(r) for r in box)


def sharded_orthogonalizer(
    collectives: Collectives,
    strategy: str = "owner",
    shard_specs: ShardSpecs | None = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> Callable[..., list[torch.Tensor]]:
    """The distributed step of :func:`muonfn.orthogonalize`: ``fn(keys, values, views, ns, scale, extra_scale)``.

    ``values`` are DTensors (their placements say how they are sharded), plain tensors
    named in ``shard_specs`` (local shards, see :class:`ShardSpec`) or plain tensors
    (whole matrices, orthogonalized locally). Returns the orthogonalized and scaled leaves,
    each with its input's type, placements and local shape.
    """
    if collectives is None or not all(hasattr(collectives, a) for a in ("rank", "world_size", "all_to_all_single")):
        raise TypeError(f"collectives must implement muonfn.distributed.Collectives, got {collectives!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown distributed strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    specs = dict(shard_specs or {})
    for name, spec in specs.items():
        if not isinstance(spec, ShardSpec):
            raise TypeError(f"shard_specs[{name!r}] must be a muonfn.distributed.ShardSpec, got {spec!r}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    plans: dict[tuple[Any, ...], _Plan] = {}

    def describe(index: int, key: _tree.Key, value: torch.Tensor, view: MatrixView, spec: ShardSpec | None) -> _Leaf:
        dtensor = _dtensor_type()
        name = _tree.dotted(key)
        if dtensor is not None and isinstance(value, dtensor):
            if spec is not None:
                raise ValueError(f"{name!r} is a DTensor, which describes its own sharding; drop its ShardSpec")
            for_mesh = getattr(collectives, "for_mesh", None)
            if for_mesh is None:
                raise TypeError(f"{name!r} is a DTensor; its collectives must come from torch_collectives(mesh)")
            dt: Any = value
            mesh, placements = dt.device_mesh, tuple(dt.placements)
            group, coords = for_mesh(mesh)
            shape, stride = tuple(dt.shape), dt.stride()
            from_local: Any = dtensor.from_local

            def wrap(t: torch.Tensor) -> torch.Tensor:
                return from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)

            return _Leaf(
                index, key, dt.to_local(), view, group, tuple(mesh.shape), placements, coords, shape, wrap=wrap
            )
        if spec is not None:
            group = collectives if spec.group is None else spec.group
            mesh_shape = spec.mesh_shape
            coords = tuple(range(group.world_size))
            if mesh_shape is not None and math.prod(mesh_shape) != group.world_size:
                raise ValueError(
                    f"{name!r}: ShardSpec mesh_shape {mesh_shape} does not match a group of {group.world_size} ranks"
                )
            return _Leaf(index, key, value, view, group, mesh_shape, spec.placements, coords, spec=spec)
        return _Leaf(index, key, value, view)

    def layout_of(leaf: _Leaf, local_shapes: Sequence[Sequence[int]] | None) -> Layout:
        name = _tree.dotted(leaf.key)
        if leaf.spec is not None and leaf.spec.dim is not None:
            assert local_shapes is not None
            dim = leaf.spec.dim
            if not -leaf.local.ndim <= dim < leaf.local.ndim:
                raise ValueError(f"{name!r}: ShardSpec dim {dim} is out of range for a {leaf.local.ndim}-D leaf")
            try:
                return _sizes_layout(local_shapes, dim % leaf.local.ndim)
            except ValueError as e:
                raise ValueError(f"{name!r}: {e}") from None
        assert leaf.mesh_shape is not None and leaf.placements is not None and leaf.coords is not None
        try:
            if leaf.shape is None:
                assert local_shapes is not None
                shape = placement_global_shape(local_shapes, leaf.mesh_shape, leaf.placements, leaf.coords)
            else:
                shape = leaf.shape
            layout = placement_layout(shape, leaf.mesh_shape, leaf.placements, leaf.coords)
        except (ValueError, NotImplementedError) as e:
            raise type(e)(f"{name!r}: {e}") from None
        ranks = range(len(layout.boxes)) if local_shapes is not None else [leaf.group.rank]
        for r in ranks:
            actual = tuple(local_shapes[r]) if local_shapes is not None else tuple(leaf.local.shape)
            if layout.local_shape(r) != actual:
                raise ValueError(
                    f"{name!r}: rank {r} holds a shard of shape {actual}, but placements {leaf.placements} on a "
                    f"mesh of shape {leaf.mesh_shape} give {layout.local_shape(r)} for a tensor of shape {layout.shape}"
                )
        return layout

    def exchange_shapes(group: Any, leaves: list[_Leaf]) -> list[list[tuple[int, ...]] | None]:
        """Every rank's local shape of every ShardSpec leaf; checks that the ranks agree on the leaves."""
        described = "|".join(
            f"{_tree.dotted(leaf.key)}:{leaf.shape}:{leaf.local.ndim}:{leaf.local.dtype}:{leaf.view}:{leaf.placements}:"
            f"{None if leaf.spec is None else leaf.spec.dim}"
            for leaf in leaves
        )
        payload = [n for leaf in leaves if leaf.spec is not None for n in leaf.local.shape]
        device = leaves[0].local.device
        w = group.world_size
        header = torch.tensor([zlib.crc32(described.encode()), len(payload)], dtype=torch.int64, device=device)
        headers = torch.empty(2 * w, dtype=torch.int64, device=device)
        group.all_gather_into_tensor(headers, header)
        by_rank = headers.view(w, 2).tolist()
        if any(h != by_rank[0] for h in by_rank):
            differing = [r for r, h in enumerate(by_rank) if h != by_rank[group.rank]]
            raise RuntimeError(
                f"muonfn.distributed: ranks {differing} of this group orthogonalize different leaves than rank "
                f"{group.rank} ({[_tree.dotted(leaf.key) for leaf in leaves]}); every rank must pass gradients "
                "for the same parameters, with the same views, dtypes and shard specs"
            )
        shapes: list[list[tuple[int, ...]] | None] = [None] * len(leaves)
        if payload:
            mine = torch.tensor(payload, dtype=torch.int64, device=device)
            everyone = torch.empty(w * len(payload), dtype=torch.int64, device=device)
            group.all_gather_into_tensor(everyone, mine)
            table = everyone.view(w, len(payload)).tolist()
            offset = 0
            for i, leaf in enumerate(leaves):
                if leaf.spec is not None:
                    n = leaf.local.ndim
                    shapes[i] = [tuple(row[offset : offset + n]) for row in table]
                    offset += n
        return shapes

    def build_plan(group: Any, leaves: list[_Leaf]) -> _Plan:
        shapes = exchange_shapes(group, leaves)
        layouts = [layout_of(leaf, s) for leaf, s in zip(leaves, shapes)]
        for leaf, layout in zip(leaves, layouts):
            leaf.view.check(leaf.key, layout.shape)
        w = group.world_size
        me = group.rank
        local_flags: list[bool] = []
        units: list[_Unit] = []
        load = [0] * w
        for i, (leaf, layout) in enumerate(zip(leaves, layouts)):
            k = leaf.view.batch_dims
            unit_shape = layout.shape[k:]
            unit_view = _unit_view(leaf.view)
            cost = sum(_ns_cost(r, c) for r, c in unit_view.blocks(unit_shape))
            whole = tuple(((0, n),) for n in unit_shape)
            holders: dict[tuple[int, ...], dict[int, tuple[int, Box]]] = {}
            for r, box in enumerate(layout.boxes):
                matrix_box = box[k:]
                if _box_numel(matrix_box) == 0:
                    continue
                per_dim = [[j for a, b in runs for j in range(a, b)] for runs in box[:k]]
                for pos, b in enumerate(_product(per_dim)):
                    holders.setdefault(b, {})[r] = (pos, matrix_box)
            is_local = all(box == whole for by_rank in holders.values() for _, box in by_rank.values())
            local_flags.append(is_local)
            if is_local:
                for by_rank in holders.values():
                    for r in by_rank:
                        load[r] += cost
                continue
            for b in sorted(holders):
                units.append(_Unit(i, unit_shape, layout, holders[b], cost))
        order = sorted(range(len(units)), key=lambda u: (-units[u].cost, u))
        for u in order:
            unit = units[u]
            layout = unit.layout
            replicas = max(layout.replica) + 1

            def score(p: int, unit: _Unit = unit, layout: Layout = layout, replicas: int = replicas) -> tuple[int, ...]:
                ranks = [layout.rank_at(rep, p) for rep in range(replicas)]
                held = _box_numel(unit.holders[ranks[0]][1]) if ranks[0] in unit.holders else 0
                return (max(load[r] for r in ranks), -held, p)

            unit.owner = min(range(layout.positions), key=score)
            for rep in range(replicas):
                load[layout.rank_at(rep, unit.owner)] += unit.cost
        rounds = _rounds(units, order, bucket_numel) if strategy == "owner" else _gather_rounds(units, bucket_numel)
        batches = []
        for round_units in rounds:
            groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
            for u in sorted(round_units):
                local = leaves[units[u].leaf].local
                groups.setdefault((local.dtype, local.device), []).append(u)
            batches.append([_Batch(dtype, device, members) for (dtype, device), members in groups.items()])
        for round_batches in batches:
            for batch in round_batches:
                if strategy == "owner":
                    _plan_owner_traffic(batch, units, me, w)
                else:
                    _plan_gather_traffic(batch, units, w)
        return _Plan(leaves, layouts, local_flags, units, batches)

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
            describe(i, k, v, view, declared.get(k)) for i, (k, v, view) in enumerate(zip(keys, values, leaf_views))
        ]
        out: list[torch.Tensor | None] = [None] * len(leaves)
        by_group: dict[int, tuple[Any, list[_Leaf]]] = {}
        for leaf in leaves:
            if leaf.group is not None:
                by_group.setdefault(id(leaf.group), (leaf.group, []))[1].append(leaf)
        group_plans = []
        for group, members in by_group.values():
            cache_key = (id(group), tuple(leaf.signature() for leaf in members))
            plan = plans.get(cache_key)
            if plan is None:
                if len(plans) >= 16:
                    plans.clear()
                plan = plans[cache_key] = build_plan(group, members)
            else:
                plan = _Plan(members, plan.layouts, plan.local, plan.units, plan.batches)
            group_plans.append((group, plan))

        # whole matrices where they lie: unsharded leaves and shards that hold whole matrices
        here: list[tuple[_Leaf, tuple[int, ...]]] = []
        for leaf in leaves:
            if leaf.group is None:
                leaf.view.check(leaf.key, leaf.local.shape)
                here.append((leaf, tuple(leaf.local.shape)))
        for _, plan in group_plans:
            for leaf, layout, is_local in zip(plan.leaves, plan.layouts, plan.local):
                if is_local:
                    here.append((leaf, layout.shape))
        matrices: list[torch.Tensor] = []
        scales: list[float] = []
        for leaf, shape in here:
            if leaf.local.numel():
                matrices += leaf.view.to_matrices(leaf.local)
                scales += block_scales(leaf.view, shape, scale, extra_scale)
        done = orthogonalize_batches(matrices, scales, ns, bucket_numel)
        pos = 0
        for leaf, shape in here:
            if leaf.local.numel():
                n = len(leaf.view.blocks(shape))
                out[leaf.index] = leaf.wrap(leaf.view.from_matrices(done[pos : pos + n], leaf.local.shape))
                pos += n
            else:
                out[leaf.index] = leaf.wrap(torch.empty_like(leaf.local))

        for group, plan in group_plans:
            results = [torch.empty_like(leaf.local) for leaf in plan.leaves]
            for round_batches in plan.batches:
                for batch in round_batches:
                    if strategy == "owner":
                        _run_owner(group, plan, batch, results, ns, scale, extra_scale, bucket_numel)
                    else:
                        _run_gather(group, plan, batch, results, ns, scale, extra_scale, bucket_numel)
            for leaf, is_local, result in zip(plan.leaves, plan.local, results):
                if not is_local:
                    out[leaf.index] = leaf.wrap(result)
        assert all(t is not None for t in out)
        return out  # type: ignore[return-value]

    return orthogonalize_sharded


def _product(per_dim: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    import itertools

    return list(itertools.product(*per_dim))


def _rounds(units: list[_Unit], order: list[int], cap: int) -> list[list[int]]:
    """Owner rounds: each owner takes its units in assignment order, at most ``cap`` elements a round."""
    current: dict[int, int] = {}
    filled: dict[tuple[int, int], int] = {}
    rounds: list[list[int]] = []
    for u in order:
        unit = units[u]
        layout = unit.layout
        owners = [layout.rank_at(rep, unit.owner) for rep in range(max(layout.replica) + 1)]
        numel = math.prod(unit.shape)
        k = max(current.get(o, 0) for o in owners)
        while any(filled.get((o, k), 0) > 0 and filled.get((o, k), 0) + numel > cap for o in owners):
            k += 1
        for o in owners:
            current[o] = k
            filled[o, k] = filled.get((o, k), 0) + numel
        while len(rounds) <= k:
            rounds.append([])
        rounds[k].append(u)
    return rounds


def _gather_rounds(units: list[_Unit], cap: int) -> list[list[int]]:
    """Gather rounds: consecutive units, at most ``cap`` elements of whole matrices a round."""
    rounds: list[list[int]] = []
    filled = 0
    for u, unit in enumerate(units):
        numel = math.prod(unit.shape)
        if not rounds or (filled and filled + numel > cap):
            rounds.append([])
            filled = 0
        rounds[-1].append(u)
        filled += numel
    return rounds


def _plan_owner_traffic(batch: _Batch, units: list[_Unit], me: int, w: int) -> None:
    sends: list[tuple[int, int, int, int]] = []  # (peer, unit, leaf, local position)
    recvs: list[tuple[int, int, Box]] = []
    batch.send_splits = [0] * w
    batch.recv_splits = [0] * w
    for u in batch.units:
        unit = units[u]
        layout = unit.layout
        if me in unit.holders:
            pos, box = unit.holders[me]
            owner = layout.rank_at(layout.replica[me], unit.owner)
            sends.append((owner, u, unit.leaf, pos))
            batch.send_splits[owner] += _box_numel(box)
        if layout.position[me] == unit.owner:
            for r, (_, box) in unit.holders.items():
                if layout.replica[r] == layout.replica[me]:
                    recvs.append((r, u, box))
                    batch.recv_splits[r] += _box_numel(box)
    sends.sort(key=lambda s: (s[0], s[1]))
    recvs.sort(key=lambda s: (s[0], s[1]))
    batch.sends = [(u, pos, peer) for peer, u, _, pos in sends]
    batch.recvs = [(u, peer, box) for peer, u, box in recvs]


def _plan_gather_traffic(batch: _Batch, units: list[_Unit], w: int) -> None:
    lengths = [0] * w
    for u in batch.units:
        for r, (_, box) in sorted(units[u].holders.items()):
            batch.offsets[u, r] = lengths[r]
            lengths[r] += _box_numel(box)
    batch.padded = max(lengths)


def _orthogonalize_units(
    plan: _Plan,
    units: list[int],
    fulls: dict[int, torch.Tensor],
    ns: NS,
    scale: str,
    extra_scale: float,
    bucket_numel: int,
) -> dict[int, torch.Tensor]:
    matrices: list[torch.Tensor] = []
    scales: list[float] = []
    counts = []
    for u in units:
        unit = plan.units[u]
        view = _unit_view(plan.leaves[unit.leaf].view)
        blocks = view.to_matrices(fulls[u])
        matrices += blocks
        scales += block_scales(view, unit.shape, scale, extra_scale)
        counts.append(len(blocks))
    done = orthogonalize_batches(matrices, scales, ns, bucket_numel)
    results = {}
    pos = 0
    for u, n in zip(units, counts):
        unit = plan.units[u]
        view = _unit_view(plan.leaves[unit.leaf].view)
        results[u] = view.from_matrices(done[pos : pos + n], unit.shape)
        pos += n
    return results


def _local_matrices(plan: _Plan, leaf: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a local shard) as ``(local units, *unit shard shape)``."""
    k = plan.leaves[leaf].view.batch_dims
    return tensor.reshape(-1, *tensor.shape[k:])


def _run_owner(
    group: Collectives,
    plan: _Plan,
    batch: _Batch,
    results: list[torch.Tensor],
    ns: NS,
    scale: str,
    extra_scale: float,
    bucket_numel: int,
) -> None:
    me = group.rank
    units = plan.units
    send = torch.empty(sum(batch.send_splits), dtype=batch.dtype, device=batch.device)
    offset = 0
    for u, pos, _ in batch.sends:
        unit = units[u]
        box = unit.holders[me][1]
        n = _box_numel(box)
        send[offset : offset + n].view(_box_shape(box)).copy_(
            _local_matrices(plan, unit.leaf, plan.leaves[unit.leaf].local)[pos]
        )
        offset += n
    recv = torch.empty(sum(batch.recv_splits), dtype=batch.dtype, device=batch.device)
    group.all_to_all_single(recv, send, batch.recv_splits, batch.send_splits)
    owned = sorted({u for u, _, _ in batch.recvs})
    fulls = {u: torch.empty(units[u].shape, dtype=batch.dtype, device=batch.device) for u in owned}
    offset = 0
    for u, _, box in batch.recvs:
        n = _box_numel(box)
        copy_into(fulls[u], recv[offset : offset + n].view(_box_shape(box)), box)
        offset += n
    done = _orthogonalize_units(plan, owned, fulls, ns, scale, extra_scale, bucket_numel)
    back = torch.empty_like(recv)
    offset = 0
    for u, _, box in batch.recvs:
        n = _box_numel(box)
        copy_out(done[u], box, back[offset : offset + n].view(_box_shape(box)))
        offset += n
    returned = torch.empty_like(send)
    group.all_to_all_single(returned, back, batch.send_splits, batch.recv_splits)
    offset = 0
    for u, pos, _ in batch.sends:
        unit = units[u]
        box = unit.holders[me][1]
        n = _box_numel(box)
        _local_matrices(plan, unit.leaf, results[unit.leaf])[pos].copy_(
            returned[offset : offset + n].view(_box_shape(box))
        )
        offset += n


def _run_gather(
    group: Collectives,
    plan: _Plan,
    batch: _Batch,
    results: list[torch.Tensor],
    ns: NS,
    scale: str,
    extra_scale: float,
    bucket_numel: int,
) -> None:
    me = group.rank
    units = plan.units
    send = torch.zeros(batch.padded, dtype=batch.dtype, device=batch.device)
    for u in batch.units:
        unit = units[u]
        if me in unit.holders:
            pos, box = unit.holders[me]
            offset = batch.offsets[u, me]
            n = _box_numel(box)
            send[offset : offset + n].view(_box_shape(box)).copy_(
                _local_matrices(plan, unit.leaf, plan.leaves[unit.leaf].local)[pos]
            )
    everyone = torch.empty(group.world_size * batch.padded, dtype=batch.dtype, device=batch.device)
    group.all_gather_into_tensor(everyone, send)
    mine = [u for u in batch.units if me in units[u].holders]
    fulls = {}
    for u in mine:
        unit = units[u]
        full = torch.empty(unit.shape, dtype=batch.dtype, device=batch.device)
        for r, (_, box) in unit.holders.items():
            if unit.layout.replica[r] == unit.layout.replica[me]:
                start = r * batch.padded + batch.offsets[u, r]
                copy_into(full, everyone[start : start + _box_numel(box)].view(_box_shape(box)), box)
        fulls[u] = full
    done = _orthogonalize_units(plan, mine, fulls, ns, scale, extra_scale, bucket_numel)
    for u in mine:
        unit = units[u]
        pos, box = unit.holders[me]
        copy_out(done[u], box, _local_matrices(plan, unit.leaf, results[unit.leaf])[pos])
