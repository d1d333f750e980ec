"""Masks: which leaves a transform applies to, written by name for the whole model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from tensordict import TensorDictBase

from .. import _tree
from .._keys import Key, resolve_table

MaskLike: TypeAlias = Mapping[Any, bool] | Callable[[TensorDictBase], Mapping[Any, bool]] | None


def mask_table(mask: MaskLike, params: TensorDictBase) -> Mapping[Any, bool]:
    """The names-to-flags table of ``mask`` for these ``params`` (empty for ``None``)."""
    if mask is None:
        return {}
    return mask if isinstance(mask, Mapping) else mask(params)


def resolve_mask(mask: MaskLike, params: TensorDictBase, default: bool) -> list[Key]:
    """The leaf keys a mask selects: all of them for ``None``; leaves it does not name get ``default``.

    Names that are not leaves of ``params`` are ignored: a transform inside
    :func:`partition` sees only its own leaves of a mask written for the whole model.
    """
    keys = _tree.leaf_keys(params)
    if mask is None:
        return keys
    flags = {k: bool(flag) for k, flag in resolve_table(mask_table(mask, params), keys).items()}
    return [k for k in keys if flags.get(k, default)]


def resolve_mask_flat(mask: MaskLike, grads: _tree.Leaves, params: _tree.Leaves, batch_size: Any) -> list[Key]:
    """:func:`resolve_mask` over the leaves of ``grads``, a callable mask given the matching params."""
    if mask is None:
        return list(grads)
    return resolve_mask(mask, _tree.unflatten({k: params[k] for k in grads}, batch_size), default=True)
