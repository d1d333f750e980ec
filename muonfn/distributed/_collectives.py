"""The collectives interface, its torch.distributed implementation and a byte counter.

A strategy never calls ``torch.distributed`` itself: it calls the methods of a
:class:`Collectives` the caller passed in. That keeps the math testable in one process
(:func:`muonfn.testing.simulate`) and makes every process group explicit.

Collectives that also implement the ``*_async`` methods of :class:`AsyncCollectives`
let the strategies overlap one bucket's exchange with another bucket's Newton–Schulz;
for those that do not, :func:`start_all_to_all_single` and :func:`start_all_gather_into_tensor`
run the blocking call and hand back a finished :class:`Handle`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ._gloo_exit import settle_gloo_workers_at_exit

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@runtime_checkable
class Collectives(Protocol):
    """Collective operations over one group of ``world_size`` ranks, numbered from 0.

    Every rank of the group calls the same operations in the same order; inputs are
    1-D contiguous tensors of one dtype and device.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (``world_size * input.numel()`` elements) receives every rank's ``input``, in rank order."""

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> None:
        """Rank ``r`` sends ``input``'s ``r``-th split to every rank and receives their splits into ``output``.

        Splits are consecutive runs of the given sizes (zero allowed), in rank order.
        """

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Replaces ``tensor`` by the sum over ranks, in place."""


def check_collectives(collectives: object, required: Sequence[str]) -> None:
    """Raises unless ``collectives`` has every method and property of ``required``."""
    if not all(hasattr(collectives, name) for name in required):
        raise TypeError(f"collectives must implement muonfn.distributed.Collectives, got {collectives!r}")


@runtime_checkable
class Handle(Protocol):
    """An operation in flight: ``wait()`` returns once its output may be read and its input reused."""

    def wait(self) -> None: ...


class _Finished:
    """The handle of an operation that completed before it was returned."""

    def wait(self) -> None:
        """Returns at once."""

    def __repr__(self) -> str:
        return "FINISHED"


#: A :class:`Handle` with nothing left to wait for.
FINISHED: Handle = _Finished()


@runtime_checkable
class AsyncCollectives(Collectives, Protocol):
    """:class:`Collectives` that can also start an exchange and return before it completes.

    Operations of one group complete in the order they were started, on every rank; the
    caller leaves the buffers of an operation alone until its handle's ``wait()`` returns.
    A class that subclasses it inherits the blocking forms: each starts its ``*_async`` form and waits.
    """

    def all_gather_into_tensor_async(self, output: torch.Tensor, input: torch.Tensor) -> Handle: ...

    def all_to_all_single_async(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Handle: ...

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.all_gather_into_tensor_async(output, input).wait()

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> None:
        self.all_to_all_single_async(output, input, output_split_sizes, input_split_sizes).wait()


def start_all_to_all_single(
    group: Collectives,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    *,
    overlap: bool,
) -> Handle:
    """``group.all_to_all_single``, started without waiting when ``overlap`` and the group can."""
    return _start(group, "all_to_all_single", overlap, output, input, output_split_sizes, input_split_sizes)


def start_all_gather_into_tensor(
    group: Collectives, output: torch.Tensor, input: torch.Tensor, *, overlap: bool
) -> Handle:
    """``group.all_gather_into_tensor``, started without waiting when ``overlap`` and the group can."""
    return _start(group, "all_gather_into_tensor", overlap, output, input)


def _start(group: Collectives, operation: str, overlap: bool, *args: Any) -> Handle:
    """``operation``'s ``*_async`` form when ``overlap`` and the group has one; else the blocking form, finished."""
    start = getattr(group, f"{operation}_async", None) if overlap else None
    if start is not None:
        return start(*args)
    getattr(group, operation)(*args)
    return FINISHED


class TorchCollectives(AsyncCollectives):
    """:class:`Collectives` over a ``torch.distributed`` process group (gloo or NCCL).

    Made by :func:`torch_collectives`. Unequal exchanges use the single-tensor forms
    (``all_to_all_single`` with split sizes, ``all_gather_into_tensor`` of padded
    buffers), which gloo and NCCL both support; buffers live on the parameters' device,
    and the ``*_async`` forms are ``async_op=True`` calls (NCCL: the wait makes the
    current stream wait for the communication stream).
    """

    def __init__(self, group: ProcessGroup, mesh: DeviceMesh | None = None) -> None:
        self.group = group
        self.mesh = mesh
        self.ranks: list[int] = list(dist.get_process_group_ranks(group))
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._by_mesh: dict[DeviceMesh, tuple[TorchCollectives, tuple[int, ...]]] = {}
        settle_gloo_workers_at_exit()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_gather_into_tensor_async(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        return dist.all_gather_single(output, input, group=self.group, async_op=True)  # (a Handle itself)

    def all_to_all_single_async(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Handle:
        return dist.all_to_all_single(
            output, input, list(output_split_sizes), list(input_split_sizes), group=self.group, async_op=True
        )

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def for_mesh(self, mesh: DeviceMesh) -> tuple[TorchCollectives, tuple[int, ...]]:
        """The collectives spanning ``mesh`` and the group rank of each mesh coordinate (row-major).

        ``mesh`` is the mesh of a DTensor leaf: this group's own mesh, or a sub-mesh of it.
        """
        if mesh not in self._by_mesh:  # (a mesh caches its hash: no look at its ranks)
            mesh_ranks: list[int] = mesh.mesh.flatten().tolist()
            if not set(mesh_ranks) <= set(self.ranks):
                raise ValueError(
                    f"a DTensor lives on a mesh of ranks {mesh_ranks}, outside the collectives' group "
                    f"{self.ranks}; pass torch_collectives() of the mesh the model is sharded on"
                )
            collectives = self if sorted(mesh_ranks) == sorted(self.ranks) else torch_collectives(mesh)
            self._by_mesh[mesh] = (collectives, tuple(collectives.ranks.index(r) for r in mesh_ranks))
        return self._by_mesh[mesh]

    def __repr__(self) -> str:
        return f"TorchCollectives(rank={self.rank}, world_size={self.world_size}, ranks={self.ranks})"


def torch_collectives(mesh_or_group: DeviceMesh | ProcessGroup) -> TorchCollectives:
    """:class:`Collectives` over a ``DeviceMesh`` (all of its ranks) or a ``ProcessGroup``.

    The group is required: there is no fallback to the default (WORLD) group, so an
    optimizer can never talk to ranks the caller did not name. A multi-dimensional mesh
    needs ``mesh_dim_names`` (it is flattened into one group, collectively, on every rank).

    Call it on every rank, e.g.
    ``muonfn.muon(..., orthogonalizer=sharded_orthogonalizer(torch_collectives(mesh)))`` with the
    mesh given to ``fully_shard`` / ``parallelize_module``.
    """
    if mesh_or_group is None:
        raise ValueError(
            "torch_collectives needs an explicit DeviceMesh or ProcessGroup; "
            "the default (WORLD) group is never used implicitly"
        )
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh_or_group, DeviceMesh | dist.ProcessGroup):
        raise TypeError(f"torch_collectives expects a DeviceMesh or a ProcessGroup, got {type(mesh_or_group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch_collectives: torch.distributed is not initialized (call init_process_group first)")
    if not isinstance(mesh_or_group, DeviceMesh):
        return TorchCollectives(mesh_or_group)
    mesh = mesh_or_group
    if mesh.ndim > 1 and not mesh.mesh_dim_names:
        raise ValueError(
            f"torch_collectives: a {mesh.ndim}-D DeviceMesh needs mesh_dim_names to be flattened into one group"
        )
    return TorchCollectives((mesh if mesh.ndim == 1 else mesh._flatten()).get_group(), mesh)


class CountingCollectives(AsyncCollectives):
    """Wraps a :class:`Collectives` and counts what this rank moves over the wire.

    ``bytes_received`` / ``bytes_sent`` exclude a rank's exchange with itself;
    ``all_reduce`` counts the ring algorithm's ``2(W-1)/W`` of the tensor each way.
    ``calls`` counts operations by name (an ``*_async`` call under its blocking name).
    Sub-mesh collectives are wrapped too and add to the same counters. Its ``*_async``
    methods start the wrapped collectives' own, or block when those have none.
    """

    def __init__(self, inner: Collectives, _root: CountingCollectives | None = None) -> None:
        self.inner = inner
        self._root = self if _root is None else _root  # whose counters it adds to (its sub-mesh wrappers share them)
        self._wrapped: dict[int, CountingCollectives] = {id(inner): self}  # by the collectives they wrap
        self._sent = self._received = 0
        self._calls: dict[str, int] = {}

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def bytes_sent(self) -> int:
        return self._root._sent

    @property
    def bytes_received(self) -> int:
        return self._root._received

    @property
    def calls(self) -> dict[str, int]:
        return dict(self._root._calls)

    def reset(self) -> None:
        self._root._sent = self._root._received = 0
        self._root._calls = {}

    def _count(self, name: str, sent: int, received: int) -> None:
        root = self._root
        root._sent += sent
        root._received += received
        root._calls[name] = root._calls.get(name, 0) + 1

    def all_gather_into_tensor_async(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        moved = (self.world_size - 1) * input.nbytes
        self._count("all_gather_into_tensor", moved, moved)
        return start_all_gather_into_tensor(self.inner, output, input, overlap=True)

    def all_to_all_single_async(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Handle:
        me, size = self.rank, input.element_size()  # a rank's exchange with itself moves nothing
        sent, received = (sum(splits) - splits[me] for splits in (input_split_sizes, output_split_sizes))
        self._count("all_to_all_single", sent * size, received * size)
        return start_all_to_all_single(self.inner, output, input, output_split_sizes, input_split_sizes, overlap=True)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        moved = 2 * (self.world_size - 1) * tensor.nbytes // self.world_size
        self._count("all_reduce", moved, moved)
        self.inner.all_reduce(tensor)

    def for_mesh(self, mesh: Any) -> tuple[CountingCollectives, tuple[int, ...]]:
        for_mesh = getattr(self.inner, "for_mesh", None)
        if for_mesh is None:
            raise TypeError(f"{type(self.inner).__name__} cannot serve DTensor leaves (it has no for_mesh)")
        inner, coords = for_mesh(mesh)
        if id(inner) not in self._wrapped:
            self._wrapped[id(inner)] = CountingCollectives(inner, self._root)
        return self._wrapped[id(inner)], coords
