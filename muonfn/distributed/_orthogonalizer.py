r"""The sharded orthogonalizer: Newton–Schulz on whole matrices assembled from shards.

It is an :class:`~muonfn.linalg.Orthogonalizer`, so :func:`muonfn.orthogonalize` takes it
like the local one. Leaves are DTensors (their placements say how they are sharded),
plain tensors named in ``shard_specs`` (local shards, see :class:`ShardSpec`) or plain
tensors (whole matrices, replicated over the collectives' ranks). A :class:`~._plan.Plan`
per set of leaves says which piece goes where; the strategy (``"owner"``, ``"gather"``,
``"tp_gram"``) carries it out, and ``replicated`` says whether matrices several ranks hold
whole are orthogonalized once (``"split"``) or by each of them (``"local"``).

Orientation and scale always come from a unit's global shape, and ``"owner"`` and
``"gather"`` run the math on the assembled tensor, so their results are bitwise the
single-process ones whenever Newton–Schulz is batch invariant (as fp32 ``bmm`` on CPU with
one intra-op thread is; multithreaded CPU BLAS may pick kernels by batch size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias, get_args

import torch

from .._tree import named_table
from ..linalg import DEFAULT_BUCKET_NUMEL, LocalOrthogonalizer, MatrixFn, MatrixView, ScaleFn, check_bucket_numel
from ._collectives import Collectives, check_collectives
from ._layout import ShardSpec, checked_shard_specs
from ._plan import Leaf, Plan, by_group, cached, check_dtensor_leaf, describe, make_plan
from ._rounds import Round, exchange_round, run_rounds, run_tp_gram
from ._sums import ShardSums

Strategy: TypeAlias = Literal["owner", "gather", "tp_gram"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)

Replicated: TypeAlias = Literal["split", "local"]
REPLICATED: tuple[str, ...] = get_args(Replicated)

ShardSpecs: TypeAlias = Mapping[Any, ShardSpec]


@dataclass(eq=False)
class ShardedOrthogonalizer:
    """Orthogonalizes sharded leaves as whole matrices through ``collectives``; made, its options
    checked, by :func:`sharded_orthogonalizer`.

    The presets read two of its attributes: ``shard_specs``, whose leaves are matrices by their
    number of dimensions and whose names must be parameters, and ``sum_shards`` (a
    :class:`ShardSums` over the same collectives and ``shard_specs``), what the transforms that
    count over a leaf take (``muonfn.cautious(..., sum_shards=...)``, ``muonfn.apply_if_finite``).
    """

    collectives: Collectives
    strategy: Strategy
    shard_specs: dict[Any, ShardSpec] = field(repr=False)
    bucket_numel: int
    replicated: Replicated
    overlap: bool

    def __post_init__(self) -> None:
        self.sum_shards = ShardSums(self.collectives, self.shard_specs)
        self._plans: dict[tuple[Any, ...], Plan] = {}

    def _plan(self, group: Any, members: list[Leaf]) -> Plan:
        def make() -> Plan:
            strategy, cap, split = self.strategy, self.bucket_numel, self.replicated == "split"
            plan = make_plan(group, members, strategy, cap, split_replicated=split, pipelined=self.overlap)
            return replace(plan, leaves=[])  # the cache keeps no tensors alive

        return replace(cached(self._plans, group, members, make), leaves=members)

    def check(self, names: Sequence[str], tensors: Sequence[torch.Tensor], views: Sequence[MatrixView]) -> None:
        """The refusals of DTensor leaves that need no collective (a ShardSpec of their own,
        collectives that cannot map their mesh, a pending reduction): :func:`~muonfn.orthogonalize`
        makes them on the parameters at ``init`` (and the entry of an update on their meta copies)."""
        declared = named_table(self.shard_specs, names)
        for name, value in zip(names, tensors):
            if hasattr(value, "placements"):
                check_dtensor_leaf(name, value, declared.get(name), self.collectives)

    def __call__(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        ns: MatrixFn,
        scale: ScaleFn,
        *,
        overwrite_input: bool = False,
    ) -> list[torch.Tensor]:
        # specs for leaves without a gradient this step, or routed elsewhere, are skipped
        declared = named_table(self.shard_specs, names)
        split = self.replicated == "split"
        leaves = [
            describe(i, name, value, view, declared.get(name), self.collectives, split_replicated=split)
            for i, (name, value, view) in enumerate(zip(names, tensors, views))
        ]
        # plans first: making one exchanges shapes, and every rank must reach that in the same order
        plans = [self._plan(group, members) for group, members in by_group(leaves)]

        out: dict[int, torch.Tensor] = {}  # each leaf's local result, by its index
        # whole matrices where they lie: unsharded leaves, and shards that hold whole matrices (experts)
        whole = [leaf for leaf in leaves if leaf.group is None]
        for leaf in whole:
            leaf.view.check(leaf.name, leaf.local.shape)
        whole += [leaf for plan in plans for leaf, local in zip(plan.leaves, plan.local) if local]

        def orthogonalize_whole() -> None:
            done = LocalOrthogonalizer(bucket_numel=self.bucket_numel)(
                [leaf.name for leaf in whole],
                [leaf.local for leaf in whole],
                [leaf.view for leaf in whole],
                ns,
                scale,
                overwrite_input=overwrite_input,  # (no exchange reads these tensors)
            )
            out.update(zip([leaf.index for leaf in whole], done))

        cap, overlap = self.bucket_numel, self.overlap
        rounds: list[Round] = []  # (generators: their exchanges start in run_rounds)
        for plan in plans:
            # every leaf's output, which the exchanges and tp_gram write into
            result = [torch.empty_like(leaf.local) for leaf in plan.leaves]
            out.update((leaf.index, r) for leaf, local, r in zip(plan.leaves, plan.local, result) if not local)
            for gram_batch in plan.gram:
                run_tp_gram(plan, gram_batch, result, ns, scale)
            rounds += (exchange_round(plan, batch, result, ns, scale, cap, overlap) for batch in plan.rounds)
        # the first exchange is in flight while the matrices that need none are orthogonalized
        run_rounds(rounds, overlap=overlap, meanwhile=orthogonalize_whole)
        return [leaf.wrap(out[leaf.index]) for leaf in leaves]


def sharded_orthogonalizer(
    collectives: Collectives,
    *,
    strategy: Strategy = "owner",
    shard_specs: ShardSpecs | None = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    replicated: Replicated = "split",
    overlap: bool = True,
) -> ShardedOrthogonalizer:
    """The :class:`~muonfn.linalg.Orthogonalizer` of sharded parameters, for ``orthogonalizer=`` of the
    presets and of :func:`muonfn.orthogonalize`: every distributed option in one value, each checked
    here (a wrong one raises, naming it).

    Args:
        collectives: the :class:`Collectives` of the ranks the parameters are sharded over
            (``torch_collectives(mesh)``); never a default group.
        strategy: ``"owner"`` (default), ``"gather"`` or ``"tp_gram"`` (see :mod:`muonfn.distributed`).
        shard_specs: plain local tensors that are shards, by parameter name (:class:`ShardSpec`).
        bucket_numel: at most this many elements of whole matrices per rank and round.
        replicated: matrices several ranks hold whole, and the replicas of sharded ones (HSDP):
            ``"split"`` (default) orthogonalizes each once, on an owner balanced by flops, which
            sends the result to the other holders (:math:`1/W` of the compute for
            :math:`(W-1)S/W` elements received per rank); ``"local"`` lets every holder (every
            replica group) compute it, moving nothing. Plain tensors not named in
            ``shard_specs`` are taken to be replicated, equal on every rank of ``collectives``
            (data parallelism); with ``"local"`` they need not be.
        overlap: pipeline the rounds: start one round's exchange before another's
            Newton–Schulz (rounds then hold one shape each, and up to three rounds' buffers
            are alive at once). ``False`` runs exchange and Newton–Schulz strictly in turn.

    Returns:
        An orthogonalizer returning each leaf with its input's type, placements and local shape.

    Example:
        >>> tx = muonfn.muon(orthogonalizer=sharded_orthogonalizer(torch_collectives(mesh)))  # doctest: +SKIP
    """
    check_collectives(collectives, ("rank", "world_size", "all_gather_into_tensor", "all_to_all_single", "all_reduce"))
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown distributed strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    if replicated not in REPLICATED:
        raise ValueError(f"unknown replicated={replicated!r}; choose one of {list(REPLICATED)}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    specs = checked_shard_specs(shard_specs)
    return ShardedOrthogonalizer(collectives, strategy, specs, check_bucket_numel(bucket_numel), replicated, overlap)
