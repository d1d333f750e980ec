"""Transforms built from transforms: sequence, routing by label, masking, guarding."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch
from tensordict import TensorDict, TensorDictBase, is_leaf_nontensor

from .. import _multi_tensor, _tree
from .._keys import Key, dotted, resolve_table
from .._tree import Leaves
from .._validation import check_params
from ._caches import StructureCache
from ._contract import Transform
from ._masks import MaskLike, check_mask, resolve_mask
from ._rules import Needs, Rule, Scope, as_rule, from_rule
from ._shards import SumShards, check_sum_shards, count_per_member
from ._state import NOTFINITE_COUNT

LabelsLike: TypeAlias = Mapping[Any, str] | TensorDictBase | Callable[[TensorDictBase], Mapping[Any, str]]

_EMPTY = TensorDict({}, batch_size=[])


def _state_keys(tx: Transform) -> list[str]:
    """The top-level state keys a transform owns, read from its state for no parameters."""
    return list(tx.init(_EMPTY).keys())


def chain(*transforms: Transform) -> Transform:
    r"""Applies ``transforms`` in order: the updates of one are the gradients of the next.

    The state is the union of the members' states (``{"momentum": ..., "exp_avg": ...}``),
    so keys stay readable; two members owning the same key is an error (wrap one in
    :func:`named`).
    """
    rules = [as_rule(t) for t in transforms]  # (each checked to be a transform)
    owned = [_state_keys(t) for t in transforms]
    seen: dict[str, int] = {}
    for i, keys in enumerate(owned):
        for key in keys:
            if key in seen:
                raise ValueError(
                    f"chain: members {seen[key]} and {i} both keep state {key!r}; wrap one in muonfn.named(...)"
                )
            seen[key] = i

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("init", params)
        state = TensorDict({}, batch_size=params.batch_size)
        for t in transforms:
            state.update(t.init(params))
        return state

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        for rule in rules:
            grads = rule.update(grads, scope, params)
        return grads

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        for i, (rule, keys) in enumerate(zip(rules, owned)):
            out.entries.append((f"chain (member {i}, {rule.name})", prefix, keys))
            rule.needs(grads, params, prefix, out)

    return from_rule(init, Rule("chain", update, needs, any(r.donated for r in rules)))


def named(name: str, tx: Transform) -> Transform:
    """Keeps ``tx``'s state under ``state[name]``."""
    if not (isinstance(name, str) and name):
        raise TypeError(f"named: name must be a non-empty string, got {name!r}")

    def init(params: TensorDictBase) -> TensorDictBase:
        return TensorDict({name: tx.init(params)}, batch_size=params.batch_size)

    rule = as_rule(tx)

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        return rule.update(grads, scope.child(name), params)

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        out.entries.append((f"named({name!r})", prefix, (name,)))
        rule.needs(grads, params, (*prefix, name), out)

    return from_rule(init, Rule(f"named({name!r})", update, needs, rule.donated))


def check_labels(where: str, labels: object) -> None:
    """Labels as written: a mapping of names to labels, a TensorDict of labels, or a callable
    ``params -> mapping`` (what it returns is checked where it is read)."""
    if isinstance(labels, Mapping | TensorDictBase) or callable(labels):
        return
    raise TypeError(
        f"{where} must be a mapping of names to labels, a TensorDict of labels or a callable params -> mapping; "
        f"got {type(labels).__name__}"
    )


def label_table(labels: LabelsLike, params: TensorDictBase) -> Mapping[Any, Any]:
    """The names-to-labels table ``labels`` gives for these ``params``."""
    if isinstance(labels, TensorDictBase):
        return {k: labels.get(k) for k in labels.keys(True, True, is_leaf=is_leaf_nontensor)}
    if isinstance(labels, Mapping):
        return labels
    table = labels(params)
    if not isinstance(table, Mapping):
        raise TypeError(f"labels returned {type(table).__name__}; it must return a mapping of names to labels")
    return table


def resolve_labels(
    labels: LabelsLike, params: TensorDictBase, names: Mapping[str, Any], strict: bool = False
) -> dict[Key, str]:
    """Maps every leaf of ``params`` to one of ``names``; errors name the leaf.

    ``strict``: a label for a name that is not a leaf of ``params`` is an error (a typo);
    otherwise it is ignored (``params`` may be the subset of leaves that have gradients).
    """
    keys = _tree.leaf_keys(params)
    table = resolve_table(label_table(labels, params), keys, where="partition: labels" if strict else None)
    assigned: dict[Key, str] = {}
    for key, label in table.items():
        label = getattr(label, "data", label)
        if label not in names:
            raise ValueError(f"partition: {dotted(key)!r} has label {label!r}; known labels: {sorted(names)}")
        assigned[key] = label
    for key in keys:
        if key not in assigned:
            raise ValueError(f"partition: parameter {dotted(key)!r} has no label")
    return assigned


def partition(transforms: Mapping[str, Transform], labels: LabelsLike) -> Transform:
    """Routes each leaf to the transform of its label; state is ``{label: state}``.

    ``labels``: a mapping from key (tuple, plain or dotted name) to label, a TensorDict of
    labels, or a callable ``params -> mapping`` (see :func:`muonfn.label_params`). Every
    parameter needs a label, and ``init`` rejects labels for names that are not parameters.
    """
    if not isinstance(transforms, Mapping):
        raise TypeError(
            f"partition: transforms must be a mapping of labels to transforms, got {type(transforms).__name__}"
        )
    transforms = dict(transforms)
    where = f"partition({sorted(transforms)})"
    check_labels("partition: labels", labels)

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("init", params)
        assigned = resolve_labels(labels, params, transforms, strict=True)
        state = {}
        for name, t in transforms.items():
            state[name] = t.init(params.select(*[k for k, v in assigned.items() if v == name]))
        return TensorDict(state, batch_size=params.batch_size)

    rules = {name: as_rule(t) for name, t in transforms.items()}
    routes = StructureCache()

    def route(grads: Leaves, params: Leaves | None, batch_size: torch.Size) -> dict[str, list[Key]]:
        """Each branch's keys of ``grads``, in their order."""
        tree = params if params is not None else grads
        assigned = resolve_labels(labels, _tree.unflatten(tree, batch_size), transforms)
        for key in grads:
            if key not in assigned:
                raise ValueError(f"partition: gradient {dotted(key)!r} has no matching parameter")
        return {name: [k for k in grads if assigned[k] == name] for name in transforms}

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        branches = routes.get(grads, scope.batch_size, lambda: route(grads, params, scope.batch_size))
        out: Leaves = {}
        for name, keys in branches.items():
            if keys:
                sub_params = None if params is None else {k: params[k] for k in keys}
                out.update(rules[name].update({k: grads[k] for k in keys}, scope.child(name), sub_params))
        return {k: out[k] for k in grads}

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        # every branch's input is checked before any branch runs (a branch may update its state in place)
        out.entries.append((where, prefix, tuple(transforms)))
        branches = routes.get(grads, out.batch_size, lambda: route(grads, params, out.batch_size))
        for name, keys in branches.items():
            if keys:
                sub_params = None if params is None else {k: params[k] for k in keys}
                rules[name].needs({k: grads[k] for k in keys}, sub_params, (*prefix, name), out)

    return from_rule(init, Rule(where, update, needs, any(r.donated for r in rules.values())))


def masked(tx: Transform, mask: MaskLike) -> Transform:
    """Applies ``tx`` to the leaves ``mask`` selects; the others pass through unchanged.

    ``mask``: a mapping from key to ``True``/``False`` (or one-element bool tensors), a
    callable ``params -> mapping``, or ``"matrices"`` (the leaves of two dimensions or more);
    leaves it does not name are not selected. Names that are
    not leaves are ignored, so that one mask can serve a whole model inside :func:`partition`.
    """
    where = "masked: mask"
    check_mask(where, mask)

    def init(params: TensorDictBase) -> TensorDictBase:
        return tx.init(params.select(*resolve_mask(mask, params, default=False, where=where)))

    rule = as_rule(tx)
    selections = StructureCache()

    def select(grads: Leaves, params: Leaves | None, batch_size: torch.Size) -> list[Key]:
        tree = params if params is not None else grads
        selected = resolve_mask(mask, _tree.unflatten(tree, batch_size), default=False, where=where)
        return [k for k in selected if k in grads]

    def chosen(grads: Leaves, params: Leaves | None, batch_size: torch.Size) -> list[Key]:
        return selections.get(grads, batch_size, lambda: select(grads, params, batch_size))

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        mine = chosen(grads, params, scope.batch_size)
        if not mine:
            return grads
        sub_params = None if params is None else {k: params[k] for k in mine}
        out = dict(grads)
        out.update(rule.update({k: grads[k] for k in mine}, scope, sub_params))
        return out

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        mine = chosen(grads, params, out.batch_size)
        sub_params = None if params is None else {k: params[k] for k in mine}
        rule.needs({k: grads[k] for k in mine}, sub_params, prefix, out)

    return from_rule(init, Rule("masked", update, needs, rule.donated))


def apply_if_finite(tx: Transform, *, sum_shards: SumShards | None = None) -> Transform:
    """Skips a step whose gradients hold NaN or Inf: zero updates, state unchanged.

    Skipped steps are counted in ``state["notfinite_count"]``. A ``tx`` that updates its state
    in place (``donate_state=True``, :attr:`Rule.donated`) gets a copy of it kept each step,
    which a skipped step writes back into the same tensors. The test is a tensor
    (no ``.item()``), so the guarded update stays traceable. For a stacked ensemble
    (params of batch size ``[N]``) each member is tested, skipped and counted on its own.

    Args:
        tx: the transform guarded.
        sum_shards: for leaves that are one rank's shard of a larger tensor (plain tensors
            under ``shard_specs``), the sums over every rank's shard
            (:func:`muonfn.distributed.shard_sums`), so that every rank tests the whole
            gradient and all skip the same steps, as one process would: one ``all_reduce`` a
            step. DTensor leaves need none (their test is global).
    """
    check_sum_shards("apply_if_finite", sum_shards)

    def init(params: TensorDictBase) -> TensorDictBase:
        state = tx.init(params)
        if NOTFINITE_COUNT in state:
            raise ValueError(f"apply_if_finite: the wrapped transform already keeps {NOTFINITE_COUNT!r}")
        device = next(iter(params.values(True, True)), torch.empty(0)).device
        state[NOTFINITE_COUNT] = torch.zeros(params.batch_size, dtype=torch.int64, device=device)
        return state

    rule = as_rule(tx)

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        values = list(grads.values())
        if not values:
            return grads
        members = scope.members  # 0 for one model: the whole leaf is tested
        if sum_shards is None:
            flags = [_all_finite(g, members) for g in values]
        else:  # the count of entries that are not finite, over every rank's shard of the leaf
            bad = [count_per_member(g.isfinite().logical_not(), members) for g in values]
            bad = sum_shards(list(grads), values, bad, batch_dims=members)
            flags = [b.eq(0).reshape(scope.batch_size) for b in bad]
        finite = torch.stack([f.full_tensor() if hasattr(f, "full_tensor") else f for f in flags]).all(0)
        count_key = (*scope.prefix, NOTFINITE_COUNT)
        # the wrapped transform sees its own state only, and writes a trial state
        inner_given = {k: v for k, v in scope.given.items() if k != count_key}
        trial = Scope(inner_given, {}, scope.prefix, scope.batch_size, scope.checked)
        # a donated update writes its state in place: a skipped step restores it from copies
        kept: dict[Key, torch.Tensor] = {}
        if rule.donated:
            tensors = {k: v for k, v in inner_given.items() if isinstance(v, torch.Tensor)}
            kept = dict(zip(tensors, _multi_tensor.copies(list(tensors.values()))))
        updates = rule.update(grads, trial, params)
        for key, new in trial.returned.items():
            old = scope.given.get(key)
            if key in kept:  # (written back into a tensor updated in place: it keeps its address)
                chosen = _where(finite, new, kept[key], members)
                in_place = new is old
                scope.returned[key] = new.copy_(chosen) if in_place else chosen
            else:
                scope.returned[key] = new if old is None or old is new else _where(finite, new, old, members)
        scope.set(NOTFINITE_COUNT, scope.get(NOTFINITE_COUNT) + (~finite).to(torch.int64))
        return {k: _where(finite, u, torch.zeros_like(u), members) for k, u in updates.items()}

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        out.entries.append(("apply_if_finite", prefix, (NOTFINITE_COUNT,)))
        rule.needs(grads, params, prefix, out)

    return from_rule(init, Rule("apply_if_finite", update, needs, rule.donated))


def _all_finite(g: torch.Tensor, members: int) -> torch.Tensor:
    """Whether every entry of ``g`` is finite: one flag, or one per ensemble member."""
    if not members:  # all() of the whole leaf: a DTensor sharded unevenly cannot be flattened
        return g.isfinite().all()
    finite = g.isfinite()
    return finite.flatten(members).all(-1) if g.ndim > members else finite  # a 0-d leaf per member: its own flag


def _where(condition: torch.Tensor, a: torch.Tensor, b: torch.Tensor, members: int) -> torch.Tensor:
    """``a`` where ``condition`` (one flag, or one per ensemble member), else ``b``."""
    if members:
        condition = condition.reshape(*condition.shape, *[1] * (a.ndim - members))
    if hasattr(a, "device_mesh"):  # a DTensor leaf takes the flag replicated on its own mesh
        from torch.distributed.tensor import DTensor, Replicate

        condition = DTensor.from_local(condition, a.device_mesh, [Replicate()] * a.device_mesh.ndim, run_check=False)
    return torch.where(condition, a, b)
