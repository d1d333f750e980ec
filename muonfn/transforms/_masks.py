"""Masks: which leaves a transform applies to, written by name for the whole model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import torch
from tensordict import TensorDictBase

from .. import _tree
from .._keys import Key, resolve_table
from .._validation import check_table

MaskName: TypeAlias = Literal["matrices"]
MaskLike: TypeAlias = Mapping[Any, bool] | Callable[[TensorDictBase], Mapping[Any, bool]] | MaskName | None
#: Masks by name: ``"matrices"`` selects the leaves of two dimensions or more (an ensemble
#: member's, without the batch dimensions): weight matrices, embeddings and conv kernels, not
#: biases and norm gains (the usual "decay matrices only"; ``p.ndim >= 2`` in nanoGPT).
MASK_NAMES: tuple[str, ...] = ("matrices",)


def _named_mask(where: str, name: str) -> str:
    if name not in MASK_NAMES:
        raise ValueError(
            f"{where}: unknown mask {name!r}; choose one of {list(MASK_NAMES)}, a mapping of names to True "
            "or False, or a callable params -> mapping"
        )
    return name


def _matrices(params: TensorDictBase) -> dict[Key, bool]:
    members = params.batch_dims
    return {key: value.ndim - members >= 2 for key, value in zip(_tree.leaf_keys(params), params.values(True, True))}


def _is_flag(value: object) -> bool:
    """``True``, ``False`` or a one-element bool tensor: anything else would be read by its truth
    value (the string ``"False"`` and the list ``[False]`` are true)."""
    if isinstance(value, bool):
        return True
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1


def checked_flags(where: str, table: object) -> Mapping[Any, Any]:
    """``table`` if it maps names to flags; else a ``TypeError`` naming ``where`` and the culprit."""
    if not isinstance(table, Mapping):
        raise TypeError(f"{where} must map names to True or False, got {type(table).__name__}")
    for name, value in table.items():
        if not _is_flag(value):
            raise TypeError(f"{where}: {name!r} maps to {value!r}; a mask's values must be True or False")
    return table


def check_mask(where: str, mask: object) -> None:
    """A mask as written: ``None``, a name of :data:`MASK_NAMES`, a mapping of names to flags
    (checked now), or a callable ``params -> mapping`` (checked when it is called)."""
    if isinstance(mask, str):
        _named_mask(where, mask)
        return
    check_table(where, mask, holds="True or False", called="params -> mapping", check=lambda t: checked_flags(where, t))


def mask_table(mask: MaskLike, params: TensorDictBase, *, where: str = "mask") -> Mapping[Any, bool]:
    """The names-to-flags table of ``mask`` for these ``params`` (empty for ``None``), its values checked."""
    if mask is None:
        return {}
    if isinstance(mask, str):
        _named_mask(where, mask)
        return _matrices(params)
    return checked_flags(where, mask if isinstance(mask, Mapping) else mask(params))


def resolve_mask(mask: MaskLike, params: TensorDictBase, default: bool, *, where: str = "mask") -> list[Key]:
    """The leaf keys a mask selects: all of them for ``None``; leaves it does not name get ``default``.

    Names that are not leaves of ``params`` are ignored: a transform inside
    :func:`partition` sees only its own leaves of a mask written for the whole model.
    ``where`` names the mask in errors (a value that is not ``True``, ``False`` or a
    one-element bool tensor).
    """
    keys = _tree.leaf_keys(params)
    if mask is None:
        return keys
    table = mask_table(mask, params, where=where)
    flags = {k: bool(flag) for k, flag in resolve_table(table, keys).items()}
    return [k for k in keys if flags.get(k, default)]


def resolve_mask_flat(
    mask: MaskLike, grads: _tree.Leaves, params: _tree.Leaves, batch_size: Any, *, where: str = "mask"
) -> list[Key]:
    """:func:`resolve_mask` over the leaves of ``grads``, a callable mask given the matching params."""
    if mask is None:
        return list(grads)
    return resolve_mask(mask, _tree.unflatten({k: params[k] for k in grads}, batch_size), default=True, where=where)
