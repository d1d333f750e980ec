"""Simulated collectives, a test double of :mod:`muonfn.distributed`'s: one thread per virtual
rank, exchanging real data in one process.

Each operation is a rendezvous: every rank of the group posts its input, waits at a
barrier, reads what the others posted, and waits again before the buffers may be reused.
The strategies therefore run exactly the code paths they run over ``torch.distributed``.
Ranks that call different operations, or disagree on split sizes, get an error instead of
a hang; a rank that raises aborts the others.

The rendezvous runs on a communication thread of its own per rank and group, which
takes the operations in the order they were started, like a process group's queue: the
``*_async`` methods return a handle at once, so the rank's own thread computes while the
exchange proceeds. A :class:`Link` makes every operation take the time a real network
would (latency plus bytes over bandwidth), spent sleeping on the communication thread,
so overlap can be measured without processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial, reduce
from typing import Any, NamedTuple, TypeVar

import torch

from ..distributed import AsyncCollectives

T = TypeVar("T")


@dataclass(frozen=True)
class Link:
    """A modelled network: each operation takes ``latency_s + bytes received / bytes_per_s`` seconds."""

    latency_s: float = 0.0
    bytes_per_s: float = float("inf")

    def __post_init__(self) -> None:
        if not self.latency_s >= 0 or not self.bytes_per_s > 0:
            raise ValueError(f"Link needs latency_s >= 0 and bytes_per_s > 0, got {self}")

    def seconds(self, received: int) -> float:
        return self.latency_s + received / self.bytes_per_s


class _Work(NamedTuple):
    """The handle of one operation queued on a rank's communication thread: ``wait`` is its future's
    ``result``, which re-raises what the operation raised."""

    wait: Callable[[], None]


class _Simulation:
    """Bookkeeping shared by every group of one :func:`simulate` call."""

    def __init__(self, timeout: float, link: Link) -> None:
        self.timeout = timeout
        self.link = link
        self.lock = threading.Lock()
        self.groups: dict[tuple[int, ...], _Group] = {}
        self.aborted = False

    def group(self, members: tuple[int, ...]) -> _Group:
        with self.lock:
            if members not in self.groups:
                self.groups[members] = _Group(self, members)
                if self.aborted:
                    self.groups[members].barrier.abort()
            return self.groups[members]

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            for g in self.groups.values():
                g.barrier.abort()


class _Group:
    def __init__(self, sim: _Simulation, members: tuple[int, ...]) -> None:
        self.sim = sim
        self.members = members
        self.barrier = threading.Barrier(len(members), timeout=sim.timeout)
        self.slots: list[tuple[str, Any]] = [("", None)] * len(members)
        # a communication thread per rank (started by its first operation) runs the rank's operations in turn
        self.channels = [ThreadPoolExecutor(1, f"simulated-comm-{members}-{r}") for r in range(len(members))]


class SimulatedCollectives(AsyncCollectives):
    """:class:`muonfn.distributed.Collectives` (and their ``*_async`` forms) of one virtual rank
    inside :func:`simulate`."""

    def __init__(self, group: _Group, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._group.members)

    def subgroup(self, ranks: Sequence[int]) -> SimulatedCollectives:
        """The collectives of the ranks ``ranks`` (ranks of this group); call it on each of them.

        Ranks of the subgroup are numbered by their position in ``ranks``.
        """
        ranks = tuple(int(r) for r in ranks)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not a member of the subgroup {ranks}")
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"subgroup ranks {ranks} must be distinct ranks of a group of {self.world_size}")
        members = tuple(self._group.members[r] for r in ranks)
        return SimulatedCollectives(self._group.sim.group(members), ranks.index(self.rank))

    def _wait(self, op: str) -> None:
        try:
            self._group.barrier.wait()
        except threading.BrokenBarrierError:
            if self._group.sim.aborted:
                raise RuntimeError(f"simulated rank {self.rank}: {op} aborted because another rank failed") from None
            raise TimeoutError(
                f"simulated rank {self.rank}: {op} timed out after {self._group.sim.timeout}s; "
                "the ranks of the group did not all join it"
            ) from None

    def _start(
        self, op: str, payload: Any, combine: Callable[[list[Any]], torch.Tensor], output: torch.Tensor, received: int
    ) -> _Work:
        """Queues ``op`` on this rank's communication thread: post ``payload``, wait for every rank,
        ``combine`` what they all posted (checking they called the same operation), wait until every
        rank has read the posts, write the result into ``output``, then take the link's time."""
        group = self._group

        def run() -> None:
            group.slots[self.rank] = (op, payload)
            self._wait(op)
            try:
                ops = [name for name, _ in group.slots]
                if any(name != op for name in ops):
                    raise RuntimeError(f"simulated collectives: ranks called different operations, by rank: {ops}")
                result = combine([posted for _, posted in group.slots])
            finally:
                self._wait(op)
            output.copy_(result.view_as(output))
            time.sleep(group.sim.link.seconds(received))

        return _Work(group.channels[self.rank].submit(run).result)

    def all_gather_into_tensor_async(self, output: torch.Tensor, input: torch.Tensor) -> _Work:
        def gather(inputs: list[torch.Tensor]) -> torch.Tensor:
            sizes = [t.numel() for t in inputs]
            if len(set(sizes)) != 1 or output.numel() != sum(sizes):
                raise RuntimeError(
                    f"simulated all_gather_into_tensor: input sizes by rank {sizes}, output size {output.numel()}"
                )
            return torch.cat([t.reshape(-1) for t in inputs])

        return self._start("all_gather_into_tensor", input, gather, output, (self.world_size - 1) * input.nbytes)

    def all_to_all_single_async(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> _Work:
        output_split_sizes, input_split_sizes = list(output_split_sizes), list(input_split_sizes)
        # this rank's own arguments are refused before it posts, so every post can be split as it says
        if len(output_split_sizes) != self.world_size or len(input_split_sizes) != self.world_size:
            raise RuntimeError(f"simulated all_to_all_single: split lists must have {self.world_size} entries")
        if sum(input_split_sizes) != input.numel() or sum(output_split_sizes) != output.numel():
            raise RuntimeError("simulated all_to_all_single: split sizes do not add up to the tensor sizes")

        def exchange(posts: list[tuple[torch.Tensor, list[int]]]) -> torch.Tensor:
            sent = [splits[self.rank] for _, splits in posts]
            if sent != output_split_sizes:
                raise RuntimeError(
                    f"simulated all_to_all_single: ranks send {sent} elements to rank {self.rank}, "
                    f"which expects {output_split_sizes}"
                )
            return torch.cat([posted.reshape(-1).split(splits)[self.rank] for posted, splits in posts])

        received = sum(n for r, n in enumerate(output_split_sizes) if r != self.rank) * output.element_size()
        return self._start("all_to_all_single", (input, input_split_sizes), exchange, output, received)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        w = self.world_size
        # summed in rank order, the same on every rank
        self._start("all_reduce", tensor, partial(reduce, torch.add), tensor, 2 * (w - 1) * tensor.nbytes // w).wait()

    def __repr__(self) -> str:
        return f"SimulatedCollectives(rank={self.rank}, world_size={self.world_size})"


def simulate(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    timeout: float = 120.0,
    link: Link | None = None,
    **kwargs: Any,
) -> list[T]:
    """Runs ``fn(collectives, *args, **kwargs)`` on ``world_size`` virtual ranks, one thread each.

    Returns the ranks' results in rank order. If a rank raises, the others are aborted
    and the first error is re-raised (with the rank noted); a rank waiting longer than
    ``timeout`` seconds in a collective raises ``TimeoutError``. ``link``: a modelled
    network every operation waits for (none: exchanges take only the copying).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if link is not None and not isinstance(link, Link):
        raise TypeError(f"link must be a muonfn.testing.Link, got {link!r}")
    sim = _Simulation(timeout, Link() if link is None else link)  # Link(): no time spent
    root = sim.group(tuple(range(world_size)))

    def body(rank: int) -> T:
        try:
            return fn(SimulatedCollectives(root, rank), *args, **kwargs)
        except BaseException:
            sim.abort()
            raise

    with ThreadPoolExecutor(world_size, "simulated-rank") as ranks:  # a thread each: they wait for one another
        futures = [ranks.submit(body, r) for r in range(world_size)]
    for group in sim.groups.values():  # every rank is done: no group is made any more
        for channel in group.channels:
            channel.shutdown()
    failed = [(r, e) for r, future in enumerate(futures) if (e := future.exception()) is not None]
    if failed:
        # the rank that failed first, not one that was aborted because of it
        rank, error = min(failed, key=lambda failure: "aborted because another rank failed" in str(failure[1]))
        error.add_note(f"(raised on simulated rank {rank} of {world_size})")
        raise error
    return [future.result() for future in futures]
