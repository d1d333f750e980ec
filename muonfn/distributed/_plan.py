r"""Planning a distributed Newton–Schulz step: which piece of which matrix goes where.

A leaf is cut into *units*: one per index of its view's batch dimensions (an expert of
an MoE weight), the whole leaf otherwise. A unit its only holder keeps whole (experts
sharded over ranks) is orthogonalized where it lies. A unit several ranks keep whole (a
replicated weight: a plain tensor under data parallelism, a ``Replicate()`` DTensor,
experts under HSDP) is orthogonalized by one of them, which sends the result to the
others (``replicated="split"``), or by each of them (``replicated="local"``). The other
units are assembled on an owner (``"owner"``), on every rank (``"gather"``), or, for
``"tp_gram"``, left in place when the Gram matrix can be summed instead.

Owners are chosen per unit by longest-processing-time first: heaviest unit first (flops
:math:`4m^2n + 2m^3` per Newton–Schulz step, :math:`m \le n`), each to the least loaded
candidate, ties to the rank already holding most of it. With ``replicated="split"`` a
sharded unit with replicas (HSDP) has one owner in the whole group: the holders of the
owner's replica send it their shards, and it sends every holder of every replica its
shard of the result. With ``replicated="local"`` each replica gets an owner at the same
position and exchanges stay inside a replica. Units then move in rounds of at most
``bucket_numel`` elements of whole matrices per rank; when the rounds are to be
pipelined, each round also holds a single shape (one Newton–Schulz batch), so that one
round's exchange can run during another's Newton–Schulz.

A plan depends only on names, shapes, layouts, views and dtypes: it is made once, after one
small exchange that checks the ranks agree, and reused every step.
"""

from __future__ import annotations

import functools
import itertools
import math
import zlib
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias, TypeVar

import torch

from ..linalg import MatrixView, newton_schulz_flops
from ._layout import (
    Box,
    Layout,
    ShardSpec,
    length,
    placement_global_shape,
    placement_kind,
    placement_layout,
    sizes_layout,
)

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def grouped(items: Iterable[T], key: Callable[[T], K]) -> dict[K, list[T]]:
    """``items`` by ``key``, keys in order of first appearance."""
    groups: dict[K, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


@dataclass
class Leaf:
    """One gradient leaf as this rank sees it."""

    index: int  # position among the leaves of the step
    name: str
    local: torch.Tensor
    view: MatrixView
    group: Any = None  # Collectives the leaf is sharded over; None: not sharded
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple[Any, ...] | None = None
    coords: tuple[int, ...] | None = None  # group rank of each mesh coordinate, row-major
    # global shape, known up front for DTensors and replicated plain tensors; else (ShardSpec leaves)
    # worked out from every rank's local shape
    shape: tuple[int, ...] | None = None
    dim: int | None = None  # a ShardSpec(dim)'s: blocks of any sizes along it
    wrap: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda t: t)

    def described(self) -> tuple[Any, ...]:
        """What every rank of the group must agree on."""
        layout = (self.shape, self.local.ndim, self.mesh_shape, self.placements, self.coords, self.dim)
        return (self.name, *layout, self.local.dtype, self.view)


def check_dtensor_leaf(name: str, value: Any, spec: ShardSpec | None, collectives: Any) -> None:
    """A DTensor leaf's refusals, from its metadata alone (no collective): a ShardSpec of its own,
    collectives that cannot map its mesh, a placement that is no sharding (a pending reduction)."""
    if spec is not None:
        raise ValueError(f"{name!r} is a DTensor, which describes its own sharding; drop its ShardSpec")
    if getattr(collectives, "for_mesh", None) is None:
        raise TypeError(f"{name!r} is a DTensor; its collectives must come from torch_collectives(mesh)")
    for p in value.placements:
        try:
            placement_kind(p)
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None


def describe(
    index: int,
    name: str,
    value: torch.Tensor,
    view: MatrixView,
    spec: ShardSpec | None,
    collectives: Any,
    *,
    split_replicated: bool,
) -> Leaf:
    """A leaf with the group it is sharded over: a DTensor's mesh, a ShardSpec's group, the
    collectives for a plain tensor (replicated over them) when ``split_replicated``, or none."""
    if hasattr(value, "placements"):  # a DTensor
        check_dtensor_leaf(name, value, spec, collectives)
        dt: Any = value
        mesh, placements = dt.device_mesh, tuple(dt.placements)
        group, coords = collectives.for_mesh(mesh)
        shape, stride = tuple(dt.shape), dt.stride()
        wrap = functools.partial(
            type(dt).from_local, device_mesh=mesh, placements=placements, run_check=False, shape=shape, stride=stride
        )
        return Leaf(index, name, dt.to_local(), view, group, tuple(mesh.shape), placements, coords, shape, wrap=wrap)
    if spec is not None:
        group = collectives if spec.group is None else spec.group
        if spec.mesh_shape is not None and math.prod(spec.mesh_shape) != group.world_size:
            raise ValueError(
                f"{name!r}: ShardSpec mesh_shape {spec.mesh_shape} does not match a group of {group.world_size} ranks"
            )
        coords = tuple(range(group.world_size))
        return Leaf(index, name, value, view, group, spec.mesh_shape, spec.placements, coords, dim=spec.dim)
    if split_replicated and collectives.world_size > 1:  # laid out as a DTensor replicated over the collectives
        from torch.distributed.tensor import Replicate

        ranks = tuple(range(collectives.world_size))
        return Leaf(index, name, value, view, collectives, (len(ranks),), (Replicate(),), ranks, tuple(value.shape))
    return Leaf(index, name, value, view)


def by_group(leaves: list[Leaf]) -> list[tuple[Any, list[Leaf]]]:
    """The sharded leaves by the group they are sharded over, groups in order of first appearance."""
    sharded = grouped((leaf for leaf in leaves if leaf.group is not None), lambda leaf: id(leaf.group))
    return [(members[0].group, members) for members in sharded.values()]


def cached(cache: dict[Any, T], group: Any, leaves: list[Leaf], make: Callable[[], T]) -> T:
    """``make()`` once per group and leaves alike in all a plan depends on (what every rank shares, and
    this rank's local shapes and device); ``cache`` holds at most 16 of them."""
    key = (id(group), tuple((*leaf.described(), tuple(leaf.local.shape), leaf.local.device) for leaf in leaves))
    if key not in cache:
        if len(cache) >= 16:
            cache.clear()
        cache[key] = make()
    return cache[key]


def handshake(group: Any, leaves: Sequence[Leaf]) -> list[Layout]:
    """Checks that every rank of ``group`` passes the same leaves; returns their layouts, from every
    rank's local shape of each leaf whose global shape is not known up front (ShardSpec leaves)."""
    described = "|".join(str(leaf.described()) for leaf in leaves)
    payload = [n for leaf in leaves if leaf.shape is None for n in leaf.local.shape]
    device, w = leaves[0].local.device, group.world_size

    def gathered(values: list[int]) -> list[list[int]]:
        everyone = torch.empty(w * len(values), dtype=torch.int64, device=device)
        group.all_gather_into_tensor(everyone, torch.tensor(values, dtype=torch.int64, device=device))
        return everyone.view(w, len(values)).tolist()

    by_rank = gathered([zlib.crc32(described.encode()), len(payload)])
    if any(h != by_rank[0] for h in by_rank):
        differing = [r for r, h in enumerate(by_rank) if h != by_rank[group.rank]]
        raise RuntimeError(
            f"muonfn.distributed: ranks {differing} of this group orthogonalize different leaves than rank "
            f"{group.rank} ({[leaf.name for leaf in leaves]}); every rank must pass gradients for the same "
            "parameters, with the same views, dtypes and shard specs"
        )
    rows = [iter(row) for row in (gathered(payload) if payload else [])]  # every rank's payload, read leaf by leaf
    layouts = []
    for leaf in leaves:
        local_shapes = [tuple(itertools.islice(row, leaf.local.ndim)) for row in rows] if leaf.shape is None else []
        layouts.append(layout_of(leaf, local_shapes))
    return layouts


def layout_of(leaf: Leaf, local_shapes: Sequence[Sequence[int]]) -> Layout:
    """The leaf's layout over its group, checked against every rank's ``local_shapes`` (those of a leaf
    whose global shape is not known up front), else against this rank's."""
    try:
        if leaf.dim is not None:
            ndim = leaf.local.ndim
            if not -ndim <= leaf.dim < ndim:
                raise ValueError(f"ShardSpec dim {leaf.dim} is out of range for a {ndim}-D leaf")
            return sizes_layout(local_shapes, leaf.dim % ndim)
        assert leaf.mesh_shape is not None and leaf.placements is not None and leaf.coords is not None
        shape = leaf.shape
        if shape is None:
            shape = placement_global_shape(local_shapes, leaf.mesh_shape, leaf.placements, leaf.coords)
        layout = placement_layout(shape, leaf.mesh_shape, leaf.placements, leaf.coords)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(f"{leaf.name!r}: {e}") from None
    known = dict(enumerate(local_shapes)) or {leaf.group.rank: leaf.local.shape}
    for r, actual in known.items():
        if layout.local_shape(r) != tuple(actual):
            raise ValueError(
                f"{leaf.name!r}: rank {r} holds a shard of shape {tuple(actual)}, but placements {leaf.placements} "
                f"on a mesh of shape {leaf.mesh_shape} give {layout.local_shape(r)} for a tensor of shape "
                f"{layout.shape}"
            )
    return layout


def unit_view(view: MatrixView) -> MatrixView:
    """The view of one unit: the leaf's view without its batch dimensions."""
    return MatrixView(0, view.transposed, view.split, view.split_dim)


def box_numel(box: Box) -> int:
    return math.prod(length(r) for r in box)


@dataclass
class Unit:
    leaf: int  # index into the plan's leaves
    shape: tuple[int, ...]  # of the whole unit: the leaf's global shape after its batch dimensions
    layout: Layout
    holders: dict[int, tuple[int, Box]]  # group rank -> (its local batch position, its box of the unit)
    cost: int
    gathered: bool = False  # "gather": every holder assembles it; else it goes to owners
    one_owner: bool = False  # one owner serves every replica (else one owner per replica)
    held_whole: bool = False  # every holder keeps all of it: the owner is one of them, nothing comes in
    owners: list[int] = field(default_factory=list)  # group ranks: one per replica unless one_owner; all if gathered

    def sources(self, owner: int) -> list[int]:
        """The holders that send ``owner`` their pieces: those of its replica."""
        replica = self.layout.replica
        return [r for r in sorted(self.holders) if replica[r] == replica[owner]]

    def served(self, owner: int) -> list[int]:
        """The holders ``owner`` sends their piece of the result."""
        return sorted(self.holders) if self.one_owner else self.sources(owner)


class Piece(NamedTuple):
    """A holder's piece of a unit, and where it lies in an exchange buffer."""

    unit: int
    leaf: int
    position: int  # the unit's index among the holder's local units
    box: Box  # the holder's box of the unit
    offset: int

    def slot(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + box_numel(self.box)].view(tuple(map(length, self.box)))


@dataclass
class Moves:
    """One direction of a round's exchange on this rank: the pieces it sends and receives, each run
    of the buffers in order of peer and then unit, and the elements per peer. ``exchange``: whether
    any rank of the group sends another anything (the same on every rank)."""

    sends: list[Piece] = field(default_factory=list)
    recvs: list[Piece] = field(default_factory=list)
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    exchange: bool = False


@dataclass
class Batch:
    """The units of one round that share a dtype and device, and this rank's traffic for them.

    Inward, pieces travel to the owners (``"gather"``: to every rank, in one all-gather of padded
    buffers); outward, the owners' results travel back to the holders. ``kept``: the pieces of the
    units this rank owns and holds itself, which do not travel."""

    dtype: torch.dtype
    device: torch.device
    gathered: bool
    owned: list[int]  # units this rank orthogonalizes
    kept: list[Piece]
    inward: Moves
    outward: Moves


#: Leaves whose Newton–Schulz runs on local column blocks (``"tp_gram"``), all of one ``m × n`` shape and
#: column split once in Newton–Schulz's wide orientation, each with whether its block is transposed to it.
GramBatch: TypeAlias = list[tuple[int, bool]]


@dataclass
class Plan:
    group: Any
    leaves: list[Leaf]
    layouts: list[Layout]
    local: list[bool]  # every holder keeps whole matrices: nothing moves
    units: list[Unit]
    rounds: list[Batch]
    gram: list[GramBatch]


def gram_flip(leaf: Leaf, layout: Layout) -> bool | None:
    """Whether Gram Newton–Schulz applies: a 2-D matrix without split, no replicas, each rank
    holding one block of the long side (Newton–Schulz's columns) and all of the short side.
    Returns whether the local block must be transposed, or ``None`` if it does not apply."""
    view = leaf.view
    if view.batch_dims or view.split is not None or len(layout.shape) != 2 or layout.replicas != 1:
        return None
    rows, cols = view.matrix_shape(layout.shape)
    flip = (rows > cols) != view.transposed  # Newton–Schulz iterates on a tall matrix's transpose
    long_dim, short_dim = (0, 1) if flip else (1, 0)
    if any(len(box[long_dim]) > 1 or box[short_dim] != ((0, layout.shape[short_dim]),) for box in layout.boxes):
        return None
    return flip


def _holders(layout: Layout, batch_dims: int) -> dict[tuple[int, ...], dict[int, tuple[int, Box]]]:
    """Per unit (index over the batch dimensions): the ranks holding part of it, their local position and box."""
    holders: dict[tuple[int, ...], dict[int, tuple[int, Box]]] = {}
    for r, box in enumerate(layout.boxes):
        matrix_box = box[batch_dims:]
        if box_numel(matrix_box) == 0:
            continue
        per_dim = [[j for a, b in runs for j in range(a, b)] for runs in box[:batch_dims]]
        for pos, b in enumerate(itertools.product(*per_dim)):
            holders.setdefault(b, {})[r] = (pos, matrix_box)
    return holders


def _assign_owners(units: list[Unit], candidates: list[int], load: list[int]) -> list[int]:
    """Longest processing time first over the ``candidates`` units; returns them in assignment order.

    A unit's owners are one rank (``one_owner``: one of its holders if they all hold it whole) or one
    rank per replica, at one position; the least loaded choice wins, then the one holding most of it,
    then the first."""
    order = sorted(candidates, key=lambda u: (-units[u].cost, u))
    for u in order:
        unit, layout = units[u], units[u].layout
        if unit.one_owner:
            choices = [[r] for r in (sorted(unit.holders) if unit.held_whole else range(len(layout.boxes)))]
        else:
            at = {(rep, pos): r for r, (rep, pos) in enumerate(zip(layout.replica, layout.position))}
            choices = [[at[rep, p] for rep in range(layout.replicas)] for p in range(max(layout.position) + 1)]

        def score(owners: list[int], unit: Unit = unit) -> tuple[int, int]:
            held = box_numel(unit.holders[owners[0]][1]) if owners[0] in unit.holders else 0
            return max(load[r] for r in owners), -held

        unit.owners = min(choices, key=score)
        for r in unit.owners:
            load[r] += unit.cost
    return order


def _rounds(units: list[Unit], order: list[int], cap: int) -> list[list[int]]:
    """Each owner takes its units in order, at most ``cap`` elements of them a round."""
    current: Counter[int] = Counter()  # each owner's round
    filled: Counter[tuple[int, int]] = Counter()  # elements by owner and round
    rounds: dict[int, list[int]] = {}  # (a round is opened after those before it)
    for u in order:
        owners = units[u].owners
        numel = math.prod(units[u].shape)
        k = max(current[o] for o in owners)
        while any(filled[o, k] > 0 and filled[o, k] + numel > cap for o in owners):
            k += 1
        for o in owners:
            current[o] = k
            filled[o, k] += numel
        rounds.setdefault(k, []).append(u)
    return list(rounds.values())


def _laid_out(moves: list[tuple[int, int, int]], units: list[Unit], w: int) -> tuple[list[Piece], list[int]]:
    """``(peer, unit, holder)`` moves as the holder's pieces one after another in a buffer, in order of
    peer and then unit, and the elements per peer."""
    pieces, splits = [], [0] * w
    for peer, u, r in sorted(moves):
        pos, box = units[u].holders[r]
        pieces.append(Piece(u, units[u].leaf, pos, box, sum(splits)))  # after the pieces before it
        splits[peer] += box_numel(box)
    return pieces, splits


def _batch(
    units: list[Unit], members: list[int], gathered: bool, me: int, w: int, dtype: torch.dtype, device: torch.device
) -> Batch:
    if gathered:  # each rank's pieces, padded to one length; each rank assembles the units it holds part of
        owned = [u for u in members if me in units[u].holders]
        laid = [_laid_out([(0, u, r) for u in members if r in units[u].holders], units, 1) for r in range(w)]
        padded = max(splits[0] for _, splits in laid)
        recvs = [
            p._replace(offset=r * padded + p.offset)
            for r, (pieces, _) in enumerate(laid)
            for p in pieces
            if r != me and p.unit in owned and units[p.unit].layout.replica[r] == units[p.unit].layout.replica[me]
        ]
        inward = Moves(laid[me][0], recvs, [padded], [padded] * w, True)
        outward = Moves()
    else:
        owned = [u for u in members if me in units[u].owners]

        def moves(pairs: list[tuple[int, int, int, int]]) -> Moves:
            """This rank's part of an exchange of ``(sender, receiver, unit, holder)`` pairs, a holder's piece each."""
            sends, send_splits = _laid_out([(dst, u, r) for src, dst, u, r in pairs if src == me != dst], units, w)
            recvs, recv_splits = _laid_out([(src, u, r) for src, dst, u, r in pairs if dst == me != src], units, w)
            return Moves(sends, recvs, send_splits, recv_splits, any(src != dst for src, dst, _, _ in pairs))

        owners = [(u, o) for u in members for o in units[u].owners]
        inward = moves([(r, o, u, r) for u, o in owners for r in units[u].sources(o)])
        outward = moves([(o, r, u, r) for u, o in owners for r in units[u].served(o)])
    kept = [Piece(u, units[u].leaf, *units[u].holders[me], 0) for u in owned if me in units[u].holders]
    return Batch(dtype, device, gathered, owned, kept, inward, outward)


def make_plan(
    group: Any, leaves: list[Leaf], strategy: str, bucket_numel: int, *, split_replicated: bool, pipelined: bool
) -> Plan:
    """The plan of one group's leaves (every rank of the group makes the same one).

    ``split_replicated``: units several ranks hold get one owner in the group (see the
    module docstring); ``pipelined``: every round holds one shape.
    """
    layouts = handshake(group, leaves)
    w, me = group.world_size, group.rank
    types = [(leaf.local.dtype, leaf.local.device) for leaf in leaves]
    local: list[bool] = []
    units: list[Unit] = []
    gram: dict[tuple[Any, ...], GramBatch] = {}
    load = [0] * w
    for i, (leaf, layout) in enumerate(zip(leaves, layouts)):
        leaf.view.check(leaf.name, layout.shape)
        k = leaf.view.batch_dims
        shape = layout.shape[k:]
        cost = int(sum(newton_schulz_flops(r, c, 1) for r, c in unit_view(leaf.view).blocks(shape)))
        holders = _holders(layout, k)
        whole = tuple(((0, n),) for n in shape)
        held_whole = all(box == whole for by_rank in holders.values() for _, box in by_rank.values())
        shared = any(len(by_rank) > 1 for by_rank in holders.values())
        local.append(held_whole and not (split_replicated and shared))
        flip = gram_flip(leaf, layout) if strategy == "tp_gram" and not held_whole else None
        if local[-1]:
            for r in itertools.chain.from_iterable(holders.values()):  # (each unit's holders)
                load[r] += cost
        elif flip is not None:
            columns = tuple(box[0 if flip else 1] for box in layout.boxes)  # the long side's blocks
            key = (layout.shape[::-1] if flip else layout.shape, columns, *types[i])
            gram.setdefault(key, []).append((i, flip))
            load = [x + cost // w for x in load]
        else:
            gathered = strategy == "gather" and not held_whole
            one_owner = held_whole or (split_replicated and layout.replicas > 1)
            everyone = list(range(w)) if gathered else []  # "gather": every rank takes part in every round of them
            units += [
                Unit(i, shape, layout, holders[b], cost, gathered, one_owner and not gathered, held_whole, everyone)
                for b in sorted(holders)
            ]
    gathered_units = [u for u, unit in enumerate(units) if unit.gathered]
    order = _assign_owners(units, [u for u, unit in enumerate(units) if not unit.gathered], load)
    batches = []
    for gathered, members in ((True, gathered_units), (False, order)):
        for same in grouped(members, lambda u: units[u].shape).values() if pipelined else [members]:
            for round_units in _rounds(units, same, bucket_numel):
                by_type = grouped(sorted(round_units), lambda u: types[units[u].leaf])
                batches += [_batch(units, us, gathered, me, w, *key) for key, us in by_type.items()]
    return Plan(group, leaves, layouts, local, units, batches, list(gram.values()))
