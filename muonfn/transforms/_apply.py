"""Applying updates to parameters: a new TensorDict, or in place."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from .. import _multi_tensor, _tree
from .._gc_pause import pause_collections, resume_collections
from .._keys import Key, dotted
from .._tree import FlatState, Leaves


def apply_updates(params: TensorDictBase, updates: TensorDictBase) -> TensorDictBase:
    """``params + updates`` leaf by leaf; leaves without an update are returned as they are.

    Every update must have its parameter's shape (a ``(4, 1)`` update would broadcast into a
    ``(4, 3)`` parameter) and device, and name a parameter: else a ``ValueError`` names the
    leaf, before anything is computed. Each result keeps its parameter's dtype: where an update's dtype
    differs, the sum is taken in the promoted dtype and cast back, as optax does (an fp32
    parameter stays fp32 under fp64 updates).
    """
    paused = pause_collections()
    try:
        return _applied(params, updates)
    finally:
        resume_collections(paused)


def apply_updates_(params: TensorDictBase, updates: TensorDictBase) -> TensorDictBase:
    """``params += updates`` in place, in one multi-tensor add; returns ``params``.

    The step of a loop that owns its parameters, as a ``torch.optim`` step does (with
    ``donate_state=True`` for the state): no new parameters, and no TensorDict rebuilt.
    The same checks as :func:`apply_updates`, all before any parameter is written, and the
    same bits: a sum of another dtype is taken in the promoted dtype and rounded to the
    parameter's. Runs without recording gradients, so parameters that require them (a
    module's, from ``TensorDict.from_module``) are stepped as ``torch.optim`` steps them;
    to differentiate through a step, use :func:`apply_updates`.
    """
    paused = pause_collections()
    try:
        flat_params = _tree.flatten(params, keep_empty=True)
        flat_updates = _tree.flatten(updates)
        targets, values, recast = _matched("apply_updates_", flat_params, flat_updates)
        for key in recast:  # a sum the parameter's dtype cannot hold would fail halfway through the add
            p, u = flat_params[key], flat_updates[key]
            if not torch.can_cast(torch.promote_types(p.dtype, u.dtype), p.dtype):
                raise ValueError(
                    f"apply_updates_: update {dotted(key)!r} of dtype {u.dtype} cannot be added in place to "
                    f"its parameter of dtype {p.dtype}"
                )
        with torch.no_grad():
            _multi_tensor.apply_("add", targets, values)
        return params
    finally:
        resume_collections(paused)


def _matched(
    where: str, params: FlatState, updates: Leaves
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Key]]:
    """The parameters the updates name, the updates in the same order, and the keys whose
    update has another dtype than its parameter; a ``ValueError`` names an update without
    a parameter, or of another shape or device (a ``meta`` update adds nothing in place)."""
    targets, recast = [], []
    for key, u in updates.items():
        p = params.get(key)
        if p is None:
            raise ValueError(f"{where}: update {dotted(key)!r} has no matching parameter")
        if u.shape != p.shape:
            raise ValueError(
                f"{where}: update {dotted(key)!r} has shape {tuple(u.shape)}, the parameter {tuple(p.shape)}"
            )
        if u.device != p.device:
            raise ValueError(f"{where}: update {dotted(key)!r} is on {u.device}, the parameter on {p.device}")
        if u.dtype != p.dtype:
            recast.append(key)
        targets.append(p)
    return targets, list(updates.values()), recast


def _applied(params: TensorDictBase, updates: TensorDictBase) -> TensorDictBase:
    flat_params, flat_updates = _tree.flatten(params, keep_empty=True), _tree.flatten(updates)
    targets, values, recast = _matched("apply_updates", flat_params, flat_updates)
    out = dict(flat_params)
    out.update(zip(flat_updates, _multi_tensor.apply("add", targets, values)))
    for key in recast:  # a cast for each leaf whose dtype was promoted, none for the others
        out[key] = out[key].to(flat_params[key].dtype)
    return _tree.unflatten(out, params.batch_size)
