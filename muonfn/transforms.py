r"""The Transform contract, its entry check, the combinators, and the check of updates against parameters.

A :class:`Transform` is a pair of pure functions over TensorDicts, as in optax:
``init(params) -> state`` and ``update(grads, state, params=None) -> (updates, state)``.
``grads`` may omit leaves (parameters without a gradient): no update is emitted for them and
their state is carried over unchanged, as ``torch.optim`` does for ``p.grad is None``.

Every transform of muonfn is made by :func:`transform` from an ``init`` and an ``update`` over
*flat* TensorDicts, keyed by dotted names (``"h.0.attn.weight"``); its state keeps per-leaf
entries under the same names (``state["momentum"]["h.0.attn.weight"]``). The outermost update
of a composition is its entry: it flattens nested input once, checks it once, before any member
runs, and rebuilds its updates in the input's nesting. The check compares

- every gradient with its parameter (a key of the parameters, their shape, dtype and device);
- the state with what ``init`` makes of the parameters: its entries, their shapes and dtypes,
  each on its parameter's device (``init`` runs once on meta tensors per structure, a DTensor's
  with its mesh and placements, and what it refuses, a view that cannot read a leaf or a sharded
  leaf where whole matrices are needed, is refused here);

so that bad input is refused, naming the leaf, before any member writes a state it was given.
Members of a composition are handed flat TensorDicts and run unchecked: a combinator calls its
members' flat updates (:func:`unchecked`), not their entries.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, Protocol, TypeAlias

import torch
from tensordict import MemoryMappedTensor, TensorDict, TensorDictBase, is_leaf_nontensor

from ._tree import build, dotted, flat, named_leaves, named_table, nested_like
from ._validation import check_params

__all__ = [
    "CautiousMode",
    "LabelsLike",
    "MaskLike",
    "Transform",
    "apply_if_finite",
    "cautious",
    "chain",
    "masked",
    "named",
    "partition",
    "transform",
]


InitFn = Callable[[TensorDictBase], TensorDictBase]


class UpdateFn(Protocol):
    def __call__(
        self, grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]: ...


class Transform(NamedTuple):
    """A gradient transformation: ``init(params) -> state`` and
    ``update(grads, state, params=None) -> (updates, state)``; both pure."""

    init: InitFn
    update: UpdateFn


_EMPTY = TensorDict({}, batch_size=[])


#: An update over flat TensorDicts, as :func:`transform` takes it: ``(grads, state, params) -> (updates, state)``.
FlatUpdate = Callable[[TensorDictBase, TensorDictBase, TensorDictBase | None], Any]


def transform(init: InitFn, update: FlatUpdate, *, donates_state: bool = False) -> Transform:
    """A :class:`Transform` from ``init`` and ``update`` over flat TensorDicts (see the module).

    ``donates_state``: ``update`` writes the state it is given in place (``donate_state=True``
    of the building blocks); :func:`apply_if_finite` then keeps a copy to fall back on.
    """

    def entry_init(params: TensorDictBase) -> TensorDictBase:
        params = flat(params)
        check_params("init", params)
        return init(params)

    def entry_update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None) -> Any:
        flat_grads, flat_params = flat(grads), None if params is None else flat(params)
        if not isinstance(state, TensorDictBase):
            if not isinstance(state, Mapping) or state:
                raise TypeError(f"update: state must be a TensorDict made by init, got {type(state).__name__}")
            state = build({}, grads.batch_size)  # a stateless transform may be given {}
        if not torch.compiler.is_compiling():  # (traced, the eager update's check stands: it reads no value)
            check_input(entry_init, flat_grads, state, flat_params, donated=donates_state)
        updates, new_state = update(flat_grads, state, flat_params)
        return (updates if flat_grads is grads else nested_like(updates, grads)), new_state

    entry_update.donates_state = donates_state  # type: ignore[attr-defined]
    entry_update.unchecked = update  # type: ignore[attr-defined]
    return Transform(entry_init, entry_update)


def unchecked(tx: Transform) -> FlatUpdate:
    """``tx``'s update of flat input without its entry's check, for a caller that checked that input
    (a composition's members, the shim's parts): the update :func:`transform` wraps; ``tx.update``
    for a transform made otherwise."""
    if not (isinstance(tx, tuple) and len(tx) == 2 and callable(tx[0]) and callable(tx[1])):
        raise TypeError(f"expected a muonfn.Transform (init, update), got {type(tx).__name__}")
    return getattr(tx.update, "unchecked", tx.update)


def donates_state(tx: Transform) -> bool:
    return getattr(tx.update, "donates_state", False) is True


# ---------------------------------------------------------------------------------------------- the check

#: the inputs' structures (names, shapes, dtypes, devices, layouts, placements) that passed a check, the
#: latest 64 (compared with the structure at hand, which is not hashed)
_PASSED: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=64)
#: per ``init`` and structure of the leaves, the state ``init`` makes of them (``None``: it cannot run on meta)
_EXPECTED: dict[tuple[Any, ...], dict[tuple[str, ...], Any] | None] = {}


def _structure(td: TensorDictBase) -> Any:
    """What the check reads of ``td``: its batch size and each leaf's name, type, shape, dtype, device,
    layout and placements (of a leaf that is no tensor, which the check refuses, its type alone)."""
    return td.batch_size, tuple(
        (k, type(t), t.shape, t.dtype, t.device, t.layout, getattr(t, "placements", 0))
        if isinstance(t, torch.Tensor)
        else (k, type(t))
        for k, t in td.items(True, True)
    )


def check_input(
    init: InitFn, grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None, *, donated: bool = False
) -> None:
    """Raises naming the first gradient, parameter or state entry that does not fit (see the module).
    The check reads metadata alone: an input of a structure that passed it once passes again. A state
    ``donated`` to an update that writes it in place must hold no entry memory-mapped from a file."""
    structure = (init, _structure(grads), _structure(state), None if params is None else _structure(params))
    if donated:
        _refuse_memory_mapped(state, structure[2][1])
    if structure in _PASSED:
        return
    if grads.batch_size != state.batch_size:
        raise ValueError(
            f"update: gradients have batch size {tuple(grads.batch_size)}, the state {tuple(state.batch_size)}; "
            "pass gradients shaped like the params given to init"
        )
    leaves = grads if params is None else params  # (without params, each gradient stands for its parameter)
    for name, g in grads.items():
        if g.layout is not torch.strided or g.is_complex():
            raise TypeError(
                f"update: gradient {name!r} is {g.layout} {g.dtype}; only dense real gradients are supported"
            )
        placements = tuple(getattr(g, "placements", ()))
        if any(placement.is_partial() for placement in placements):
            raise ValueError(
                f"update: gradient {name!r} is a DTensor placed as {placements}, a pending reduction; "
                "reduce gradients before the optimizer step"
            )
        p = leaves.get(name)
        if p is None:
            raise ValueError(f"update: gradient {name!r} has no matching parameter")
        if (g.shape, g.dtype, g.device) != (p.shape, p.dtype, p.device):
            raise ValueError(
                f"update: gradient {name!r} is a {g.dtype} tensor of shape {tuple(g.shape)} on {g.device}, its "
                f"parameter a {p.dtype} tensor of shape {tuple(p.shape)} on {p.device}"
            )
    expected = _expected_state(init, leaves)
    given = {} if expected is None else _entries(state)  # (None: an init that cannot run on meta, nothing to compare)
    for path, (shape, dtype) in (expected or {}).items():
        t = given.pop(path, None)
        entry, leaf = ".".join(path), path[-1] if path[-1] in leaves.keys() else None
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"update: state has no entry {entry!r}; was it made by this transform's init?")
        owner = leaves[leaf] if leaf is not None else next(iter(leaves.values()), None)
        if (t.shape, t.dtype) != (shape, dtype):
            raise ValueError(
                f"update: state entry {entry!r} is a {t.dtype} tensor of shape {tuple(t.shape)}, expected "
                f"{dtype} of shape {tuple(shape)}" + (f" for parameter {leaf!r}" if leaf else "")
            )
        if owner is not None and t.device != owner.device:
            kind = "parameter" if params is not None else "gradient"
            raise ValueError(
                f"update: state entry {entry!r} is on {t.device}, its {kind} {leaf or '(first)'!r} on "
                f"{owner.device}; move the state (state.to(device)), or make it with init after moving the parameters"
            )
    if params is not None and given:
        raise ValueError(f"update: state entry {'.'.join(next(iter(given)))!r} belongs to no parameter of this update")
    _PASSED.append(structure)


def _refuse_memory_mapped(state: TensorDictBase, entries: tuple[tuple[Any, ...], ...]) -> None:
    """A donated state is written in place: an entry memory-mapped from a file (``TensorDict.load_memmap``,
    whose TensorDict need not say so: its leaves do) would have its checkpoint rewritten. ``entries``: the
    state's as :func:`_structure` lists them, ``(key, type, ...)``; type checks only: traceable."""
    for key, kind, *_ in entries:
        # (_filename: the public property raises for a memory-mapped tensor in anonymous shared memory)
        filename = state.get(key)._filename if issubclass(kind, MemoryMappedTensor) else None
        if filename is not None:
            raise ValueError(
                f"update: state '{dotted(key)}' is memory-mapped from {filename!r}; donate_state=True would write "
                "the step into that checkpoint. Load the state into memory first: state = state.to_tensordict()"
            )


def _expected_state(init: InitFn, leaves: TensorDictBase) -> dict[tuple[str, ...], Any] | None:
    """The state ``init`` makes of ``leaves``, each entry's path -> (shape, dtype), from meta copies of them:
    once per structure of the leaves (the parameters'), however many structures of gradients come."""
    key = (init, _structure(leaves))
    if key not in _EXPECTED:
        meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in leaves.items()}
        # (a DTensor's copy keeps its mesh and placements, which init may refuse)
        meta.update({k: torch.empty_like(v, device="meta") for k, v in leaves.items() if hasattr(v, "placements")})
        try:
            made: dict[tuple[str, ...], Any] | None = _entries(init(build(meta, leaves.batch_size)))
        except (ValueError, TypeError):  # a refusal, which reads the leaves' metadata alone
            raise
        except Exception:  # an init of one's own that cannot run on meta tensors
            made = None
        if len(_EXPECTED) >= 64:
            _EXPECTED.clear()
        _EXPECTED[key] = None if made is None else {path: (t.shape, t.dtype) for path, t in made.items()}
    return _EXPECTED[key]


def _entries(td: TensorDictBase) -> dict[tuple[str, ...], Any]:
    """``td``'s leaves by their paths of keys."""
    return {k if isinstance(k, tuple) else (k,): v for k, v in td.items(True, True)}


# ---------------------------------------------------------------------------------------------- combinators


def chain(*transforms: Transform) -> Transform:
    r"""Applies ``transforms`` in order: the updates of one are the gradients of the next.

    The state is the union of the members' states (``{"momentum": ..., "exp_avg": ...}``); two
    members keeping the same entry is an error (wrap one in :func:`named`).
    """
    members = [unchecked(t) for t in transforms]
    owned = [list(t.init(_EMPTY).keys()) for t in transforms]  # (each member's entries: its state for no leaves)
    for i, keys in enumerate(owned):
        for key in keys:
            first = next(j for j, held in enumerate(owned) if key in held)
            if first < i:
                raise ValueError(f"chain: members {first} and {i} both keep state {key!r}; wrap one in muonfn.named")

    def init(params: TensorDictBase) -> TensorDictBase:
        return build({k: v for t in transforms for k, v in t.init(params).items()}, params.batch_size)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        new: dict[str, Any] = {}
        for member, keys in zip(members, owned):
            grads, member_state = member(grads, state.select(*keys), params)
            new.update(member_state.items())
        return grads, build(new, state.batch_size)

    return transform(init, update, donates_state=any(map(donates_state, transforms)))


def named(name: str, tx: Transform) -> Transform:
    """Keeps ``tx``'s state under ``state[name]``."""
    if not (isinstance(name, str) and name):
        raise TypeError(f"named: name must be a non-empty string, got {name!r}")

    def init(params: TensorDictBase) -> TensorDictBase:
        return build({name: tx.init(params)}, params.batch_size)

    member = unchecked(tx)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        updates, inner = member(grads, state[name], params)
        return updates, build({name: inner}, state.batch_size)

    return transform(init, update, donates_state=donates_state(tx))


LabelsLike: TypeAlias = Mapping[Any, str] | TensorDictBase | Callable[[TensorDictBase], Mapping[Any, str]]
MaskLike: TypeAlias = Mapping[Any, bool] | Callable[[TensorDictBase], Mapping[Any, bool]] | Literal["matrices"] | None


def check_table(where: str, table: object) -> None:
    """A per-name table as written: a mapping, or a callable ``params -> mapping`` (read where it is called)."""
    if not (isinstance(table, Mapping) or callable(table)):
        raise TypeError(
            f"{where} must be a mapping of names or a callable params -> mapping, got {type(table).__name__}"
        )


def table_of(table: Any, params: TensorDictBase, where: str) -> Mapping[Any, Any]:
    """The names-to-values table ``table`` gives for ``params`` (a callable is called on them; a
    TensorDict, of labels say, is read by its leaves)."""
    if isinstance(table, TensorDictBase):
        return {key: getattr(value, "data", value) for key, value in table.items(True, True, is_leaf_nontensor)}
    if isinstance(table, Mapping):
        return table
    made = table(params)
    if not isinstance(made, Mapping):
        raise TypeError(f"{where} returned {type(made).__name__}; it must return a mapping of names")
    return made


def route(labels: LabelsLike, params: TensorDictBase, known: Any, *, strict: bool = False) -> dict[str, str]:
    """Each leaf's label; an error names a leaf without one, or (``strict``) a name that is no leaf."""
    where = "partition: labels" if strict else None
    assigned = named_table(table_of(labels, params, "partition: labels"), params.keys(), where)
    for name in params.keys():
        label = assigned.get(name)
        if label is None:
            raise ValueError(f"partition: parameter {name!r} has no label")
        if label not in known:
            raise ValueError(f"partition: {name!r} has label {label!r}; known labels: {sorted(known)}")
    return assigned


def partition(transforms: Mapping[str, Transform], labels: LabelsLike) -> Transform:
    """Routes each leaf to the transform of its label; the state is ``{label: state}``.

    ``labels``: a mapping from name (dotted or tuple) to label, a TensorDict of labels in the
    parameters' nesting, or a callable ``params -> mapping`` given the parameters as a flat
    TensorDict (see :func:`muonfn.label_params`). Every parameter needs a label, and ``init``
    refuses labels for names that are not parameters.
    """
    if not isinstance(transforms, Mapping):
        raise TypeError(f"partition: transforms must map labels to transforms, got {type(transforms).__name__}")
    transforms = dict(transforms)
    members = {label: unchecked(t) for label, t in transforms.items()}
    check_table("partition: labels", labels)
    routes: dict[tuple[str, ...], dict[str, list[str]]] = {}

    def init(params: TensorDictBase) -> TensorDictBase:
        assigned = route(labels, params, transforms, strict=True)
        mine = {label: params.select(*[n for n, a in assigned.items() if a == label]) for label in transforms}
        return build({label: t.init(mine[label]) for label, t in transforms.items()}, params.batch_size)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        leaves = tuple(grads.keys())
        # traced, the routes are made anew: guards on the cache would fail once an eager update filled it
        cache = {} if torch.compiler.is_compiling() else routes
        if leaves not in cache:
            assigned = route(labels, grads if params is None else params, transforms)
            if len(cache) > 16:
                cache.clear()
            branches = {label: [n for n in leaves if assigned[n] == label] for label in transforms}
            cache[leaves] = {label: names for label, names in branches.items() if names}  # (labels of no leaf: not run)
        out, new = dict.fromkeys(leaves), dict(state.items())  # (the updates in the gradients' order)
        for label, names in cache[leaves].items():
            sub_params = None if params is None else params.select(*names)
            updates, new[label] = members[label](grads.select(*names), state[label], sub_params)
            out.update(updates.items())
        return build(out, grads.batch_size), build(new, state.batch_size)

    return transform(init, update, donates_state=any(map(donates_state, transforms.values())))


def selected(mask: MaskLike, params: TensorDictBase, where: str, default: bool = True) -> list[str]:
    """The names ``mask`` selects (``None``: all; ``"matrices"``: leaves of two or more dimensions)."""
    if mask is None:
        return list(params.keys()) if default else []
    if mask == "matrices":
        return [n for n, p in params.items() if p.ndim - params.batch_dims >= 2]
    table = table_of(mask, params, where)
    for name, value in table.items():
        if not isinstance(value, bool) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise TypeError(f"{where}: {dotted(name)!r} maps to {value!r}; a mask's values must be True or False")
    table = named_table(table, params.keys())
    return [n for n in params.keys() if bool(table.get(n, default))]


def check_mask(where: str, mask: object) -> None:
    if mask is None or mask == "matrices":
        return
    if isinstance(mask, str):  # (a misspelt name, or one leaf's name where a table was meant)
        raise ValueError(
            f"{where}: unknown mask {mask!r}; choose one of ['matrices'], a mapping of names to True or False, "
            "or a callable params -> mapping"
        )
    check_table(where, mask)
    if isinstance(mask, Mapping):
        selected(mask, _EMPTY, where)  # (its values' type)


def masked(tx: Transform, mask: MaskLike) -> Transform:
    """Applies ``tx`` to the leaves ``mask`` selects (a mapping of names to ``True``/``False``, a
    callable ``params -> mapping``, or ``"matrices"``); the others pass through unchanged."""
    where = "masked: mask"
    check_mask(where, mask)
    member = unchecked(tx)

    def init(params: TensorDictBase) -> TensorDictBase:
        return tx.init(params.select(*selected(mask, params, where, default=False)))

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        mine = selected(mask, grads if params is None else params.select(*grads.keys()), where, default=False)
        if not mine:
            return grads, state
        updates, state = member(grads.select(*mine), state, None if params is None else params.select(*mine))
        return build({**grads, **updates}, grads.batch_size), state

    return transform(init, update, donates_state=donates_state(tx))


NOTFINITE_COUNT = "notfinite_count"


def apply_if_finite(tx: Transform, *, sum_shards: Any = None) -> Transform:
    """Skips a step whose gradients hold NaN or Inf: zero updates, the state unchanged.

    Skipped steps are counted in ``state["notfinite_count"]``. A ``tx`` that writes its state in
    place (``donate_state=True``) gets a copy of it kept each step, restored on a skipped one and on a
    step that raises after a member wrote it. The test is a tensor (no ``.item()``), so the update stays
    traceable; for a stacked ensemble each member is tested, skipped and counted on its own.
    ``sum_shards``: for leaves that are one rank's shard of a larger tensor, the sums over every rank's
    shard (:func:`muonfn.distributed.shard_sums`), so that every rank skips the same steps (DTensor
    leaves need none).
    """
    member = unchecked(tx)
    check_sum_shards("apply_if_finite", sum_shards)

    def init(params: TensorDictBase) -> TensorDictBase:
        state = tx.init(params)
        if NOTFINITE_COUNT in state.keys():
            raise ValueError(f"apply_if_finite: the wrapped transform already keeps {NOTFINITE_COUNT!r}")
        device = next(iter(params.values()), torch.empty(0)).device
        count = torch.zeros(params.batch_size, dtype=torch.int64, device=device)
        return build({**state, NOTFINITE_COUNT: count}, params.batch_size)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        members, names, values = grads.batch_dims, list(grads.keys()), list(grads.values())
        if sum_shards is None or not values:
            flags = [g.isfinite().all() if not members else per_member(g.isfinite(), members).all(-1) for g in values]
        else:  # each leaf's count of entries that are not finite, summed over its shards
            bad = [count_per_member(g.isfinite().logical_not(), members) for g in values]
            flags = [b.eq(0).reshape(grads.batch_size) for b in sum_shards(names, values, bad, batch_dims=members)]
        flags = [f.full_tensor() if hasattr(f, "full_tensor") else f for f in flags]
        finite = torch.stack(flags).all(0) if flags else torch.ones(grads.batch_size, dtype=torch.bool)
        inner = build({k: v for k, v in state.items() if k != NOTFINITE_COUNT}, state.batch_size)  # (traceable)
        kept = inner.clone() if donates_state(tx) else inner
        try:
            updates, new = member(grads, inner, params)
        except BaseException:
            if donates_state(tx):  # a failed step: the donated tensors take back what they held
                inner.apply(lambda n, o: n.copy_(o), kept)
            raise
        chosen = new.apply(lambda n, o: _where(finite, n, o, members), kept)
        if donates_state(tx):  # written back into the donated tensors, which keep their addresses
            chosen = new.apply(lambda n, c: n.copy_(c), chosen)
        count = state[NOTFINITE_COUNT] + finite.logical_not().to(torch.int64)
        zeroed = updates.apply(lambda u: _where(finite, u, torch.zeros_like(u), members))
        return zeroed, build({**chosen, NOTFINITE_COUNT: count}, state.batch_size)

    return transform(init, update, donates_state=donates_state(tx))


def check_sum_shards(where: str, sum_shards: object) -> None:
    if sum_shards is not None and not callable(sum_shards):
        raise TypeError(f"{where}: sum_shards must be callable (muonfn.distributed.shard_sums), got {sum_shards!r}")


def count_per_member(mask: torch.Tensor, members: int) -> torch.Tensor:
    """The number of true entries of ``mask``: one count, or one per ensemble member."""
    return mask.sum(dtype=torch.int64) if not members else per_member(mask, members).sum(-1, dtype=torch.int64)


def per_member(t: torch.Tensor, members: int) -> torch.Tensor:
    """``t`` with each ensemble member's entries in one last dimension (a member's 0-d leaf too)."""
    return t.flatten(members) if t.ndim > members else t.unsqueeze(-1)


def _where(condition: torch.Tensor, a: torch.Tensor, b: torch.Tensor, members: int) -> torch.Tensor:
    """``a`` where ``condition`` (one flag, or one per ensemble member), else ``b``."""
    if a is b:
        return a
    if members:
        condition = condition.reshape(*condition.shape, *[1] * (a.ndim - members))
    if hasattr(a, "device_mesh"):  # a DTensor leaf takes the flag replicated on its own mesh
        from torch.distributed.tensor import DTensor, Replicate

        condition = DTensor.from_local(condition, a.device_mesh, [Replicate()] * a.device_mesh.ndim, run_check=False)
    return torch.where(condition, a, b)


CautiousMode: TypeAlias = Literal["heavyball", "pytorch_optimizer"]
CAUTIOUS_MODES: tuple[str, ...] = ("heavyball", "pytorch_optimizer")


def cautious(tx: Transform, *, mode: CautiousMode = "heavyball", sum_shards: Any = None) -> Transform:
    r"""``tx`` whose update components that disagree in sign with the gradient are zeroed and the
    rest rescaled (Cautious Optimizers, Liang et al. 2024), leaf by leaf (per member of a stacked
    ensemble), :math:`N` the leaf's number of elements:

    - ``"heavyball"``: :math:`k = [\operatorname{signbit}(u) = \operatorname{signbit}(g)]`,
      :math:`u \leftarrow u \odot k \cdot N / \max(\sum k, 1)`;
    - ``"pytorch_optimizer"``: :math:`k = [u g > 0]`, :math:`u \leftarrow u \odot k \cdot N / (\sum k + 1)`.

    Place it around the direction (before the learning rate and weight decay) to match the peers.
    ``sum_shards``: the sums over every rank's shard of a leaf that is one rank's part of a larger
    tensor (:func:`muonfn.distributed.shard_sums`), so that :math:`\sum k` and :math:`N` are the
    whole leaf's (DTensor leaves need none).
    """
    member = unchecked(tx)
    if mode not in CAUTIOUS_MODES:
        raise ValueError(f"cautious: unknown mode {mode!r}; choose one of {list(CAUTIOUS_MODES)}")
    check_sum_shards("cautious", sum_shards)

    def update(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None) -> Any:
        updates, state = member(grads, state, params)
        members, names, values = grads.batch_dims, list(updates.keys()), list(updates.values())
        pairs = zip(values, grads.values())
        keeps = [u.signbit() == g.signbit() if mode == "heavyball" else (u * g) > 0 for u, g in pairs]
        kept = [count_per_member(k, members) for k in keeps]
        if sum_shards is None:
            totals: list[Any] = [math.prod(u.shape[members:]) for u in values]
        else:  # the whole leaf's counts of kept and dropped entries, summed over its shards at once
            dropped = [count_per_member(k.logical_not(), members) for k in keeps]
            sums = sum_shards([*names, *names], [*values, *values], [*kept, *dropped], batch_dims=members)
            kept, totals = sums[: len(names)], [s + d for s, d in zip(sums[: len(names)], sums[len(names) :])]
        out = {n: _rescaled(u, k, s, t, mode, members) for n, u, k, s, t in zip(names, values, keeps, kept, totals)}
        return build(out, grads.batch_size), state

    return transform(tx.init, update, donates_state=donates_state(tx))


def _rescaled(u: torch.Tensor, keep: torch.Tensor, kept: torch.Tensor, total: Any, mode: str, members: int) -> Any:
    kept = kept.clamp_min(1) if mode == "heavyball" else kept.add(1)
    scale = kept.to(torch.promote_types(u.dtype, torch.float32)).reciprocal().mul(total)
    if members:
        scale = scale.reshape(*scale.shape, *[1] * (u.ndim - members))
    return u.mul(keep).mul(scale).to(u.dtype)


# ---------------------------------------------------------------------------------------------- applying


def matched(
    params: TensorDictBase, updates: TensorDictBase, inplace: bool
) -> tuple[TensorDictBase, TensorDictBase, list[torch.Tensor]]:
    """Both trees flat and the parameters of the updates, in their order: checked once per structure of
    the two (``inplace``: for :func:`~muonfn.apply_updates_`)."""
    flat_params, flat_updates = flat(params), flat(updates)
    structure = ("apply_updates", inplace, _structure(flat_params), _structure(flat_updates))
    if structure not in _PASSED:
        where = "apply_updates_" if inplace else "apply_updates"
        for name, u in flat_updates.items():
            p = flat_params.get(name)
            if p is None:
                raise ValueError(f"{where}: update {name!r} has no matching parameter")
            if u.shape != p.shape:
                raise ValueError(f"{where}: update {name!r} has shape {tuple(u.shape)}, the parameter {tuple(p.shape)}")
            if u.device != p.device:  # (a meta update would add nothing, silently)
                raise ValueError(f"{where}: update {name!r} is on {u.device}, the parameter on {p.device}")
            if inplace and not torch.can_cast(torch.promote_types(p.dtype, u.dtype), p.dtype):
                raise ValueError(
                    f"{where}: update {name!r} of dtype {u.dtype} cannot be added in place to its parameter "
                    f"of dtype {p.dtype}"
                )
        _PASSED.append(structure)
    return flat_params, flat_updates, named_leaves(flat_params, list(flat_updates.keys()))
