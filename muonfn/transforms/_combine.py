"""Transforms built from transforms: sequence, routing by label, masking, guarding."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch
from tensordict import TensorDict, TensorDictBase, is_leaf_nontensor

from .. import _tree
from .._keys import Key, dotted, resolve_table
from .._validation import check_inputs, check_params
from ._base import Transform
from ._masks import MaskLike, resolve_mask
from ._state import NOTFINITE_COUNT, check_entries

LabelsLike: TypeAlias = Mapping[Any, str] | TensorDictBase | Callable[[TensorDictBase], Mapping[Any, str]]

_EMPTY = TensorDict({}, batch_size=[])


def _state_keys(tx: Transform) -> list[str]:
    """The top-level state keys a transform owns, read from its state for no parameters."""
    return list(tx.init(_EMPTY).keys())


def _name(tx: Transform) -> str:
    """The function that built ``tx`` (``scale_by_adam``), for error messages."""
    return getattr(tx.update, "__qualname__", "?").partition(".<locals>")[0]


def chain(*transforms: Transform) -> Transform:
    r"""Applies ``transforms`` in order: the updates of one are the gradients of the next.

    The state is the union of the members' states (``{"momentum": ..., "exp_avg": ...}``),
    so keys stay readable; two members owning the same key is an error (wrap one in
    :func:`named`).
    """
    owned = [_state_keys(t) for t in transforms]
    seen: dict[str, int] = {}
    for i, keys in enumerate(owned):
        for key in keys:
            if key in seen:
                raise ValueError(
                    f"chain: members {seen[key]} and {i} both keep state {key!r}; wrap one in muonfn.named(...)"
                )
            seen[key] = i
    members = [f"chain (member {i}, {_name(t)})" for i, t in enumerate(transforms)]  # for errors, named once

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("init", params)
        state = TensorDict({}, batch_size=params.batch_size)
        for t in transforms:
            state.update(t.init(params))
        return state

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        for where, keys in zip(members, owned):
            check_entries(where, state, keys)
        new_state = TensorDict({}, batch_size=state.batch_size)
        for t, keys in zip(transforms, owned):
            grads, member_state = t.update(grads, state.select(*keys), params)
            new_state.update(member_state)
        return grads, new_state

    return Transform(init, update)


def named(name: str, tx: Transform) -> Transform:
    """Keeps ``tx``'s state under ``state[name]``."""

    def init(params: TensorDictBase) -> TensorDictBase:
        return TensorDict({name: tx.init(params)}, batch_size=params.batch_size)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_entries(f"named({name!r})", state, (name,))
        updates, inner = tx.update(grads, state[name], params)
        return updates, TensorDict({name: inner}, batch_size=state.batch_size)

    return Transform(init, update)


def label_table(labels: LabelsLike, params: TensorDictBase) -> Mapping[Any, Any]:
    """The names-to-labels table ``labels`` gives for these ``params``."""
    if isinstance(labels, TensorDictBase):
        return {k: labels.get(k) for k in labels.keys(True, True, is_leaf=is_leaf_nontensor)}
    return labels if isinstance(labels, Mapping) else labels(params)


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
    transforms = dict(transforms)
    where = f"partition({sorted(transforms)})"

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("init", params)
        assigned = resolve_labels(labels, params, transforms, strict=True)
        state = {}
        for name, t in transforms.items():
            state[name] = t.init(params.select(*[k for k, v in assigned.items() if v == name]))
        return TensorDict(state, batch_size=params.batch_size)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        # every branch's gradients before any branch runs (a branch may update its state in place)
        check_inputs(where, grads, state, params)
        check_entries(where, state, transforms)
        keys = _tree.leaf_keys(grads)
        assigned = resolve_labels(labels, params if params is not None else grads, transforms)
        for key in keys:
            if key not in assigned:
                raise ValueError(f"partition: gradient {dotted(key)!r} has no matching parameter")
        out: dict[Key, torch.Tensor] = {}
        new_state = {}
        for name, t in transforms.items():
            mine = [k for k in keys if assigned[k] == name]
            if not mine:
                new_state[name] = state[name]
                continue
            sub_params = params.select(*mine) if params is not None else None
            updates, new_state[name] = t.update(grads.select(*mine), state[name], sub_params)
            out.update(zip(mine, _tree.leaves(updates.select(*mine))))
        return _tree.build(keys, [out[k] for k in keys], grads), TensorDict(new_state, batch_size=state.batch_size)

    return Transform(init, update)


def masked(tx: Transform, mask: MaskLike) -> Transform:
    """Applies ``tx`` to the leaves ``mask`` selects; the others pass through unchanged.

    ``mask``: a mapping from key to bool or a callable ``params -> mapping``; leaves it
    does not name are not selected. Names that are not leaves are ignored, so that one
    mask can serve a whole model inside :func:`partition`.
    """

    def init(params: TensorDictBase) -> TensorDictBase:
        return tx.init(params.select(*resolve_mask(mask, params, default=False)))

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_inputs("masked", grads, state, params)
        chosen = resolve_mask(mask, params if params is not None else grads, default=False)
        wanted = set(_tree.leaf_keys(grads))
        mine = [k for k in chosen if k in wanted]
        if not mine:
            return grads, state
        sub_params = params.select(*mine) if params is not None else None
        updates, state = tx.update(grads.select(*mine), state, sub_params)
        return _tree.carry(grads, updates), state

    return Transform(init, update)


def apply_if_finite(tx: Transform) -> Transform:
    """Skips a step whose gradients hold NaN or Inf: zero updates, state unchanged.

    Skipped steps are counted in ``state["notfinite_count"]``. The test is a tensor
    (no ``.item()``), so the guarded update stays traceable. For a stacked ensemble
    (params of batch size ``[N]``) each member is tested, skipped and counted on its own.
    """

    def init(params: TensorDictBase) -> TensorDictBase:
        state = tx.init(params)
        if NOTFINITE_COUNT in state:
            raise ValueError(f"apply_if_finite: the wrapped transform already keeps {NOTFINITE_COUNT!r}")
        device = next(iter(params.values(True, True)), torch.empty(0)).device
        state[NOTFINITE_COUNT] = torch.zeros(params.batch_size, dtype=torch.int64, device=device)
        return state

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_inputs("apply_if_finite", grads, state, None)
        check_entries("apply_if_finite", state, (NOTFINITE_COUNT,))
        values = _tree.leaves(grads)
        if not values:
            return grads, state
        members = grads.batch_dims  # 0 for one model: the whole leaf is tested
        finite = torch.stack([g.isfinite().flatten(members).all(-1) for g in values]).all(0)
        inner = state.exclude(NOTFINITE_COUNT)
        updates, new_inner = tx.update(grads, inner, params)
        updates = updates.where(finite, 0.0)
        new_state = new_inner.where(finite, inner)
        new_state[NOTFINITE_COUNT] = state[NOTFINITE_COUNT] + (~finite).to(torch.int64)
        return updates, new_state

    return Transform(init, update)
