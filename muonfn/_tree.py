"""Structure helpers for TensorDicts of parameters, states and updates."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from ._keys import Key, as_key, dotted


def leaf_keys(td: TensorDictBase) -> list[Key]:
    """Every leaf key of ``td`` as a tuple, in insertion order."""
    return [as_key(k) for k in td.keys(include_nested=True, leaves_only=True)]


def leaves(td: TensorDictBase) -> list[torch.Tensor]:
    return list(td.values(include_nested=True, leaves_only=True))


def build(keys: Sequence[Key], values: Sequence[torch.Tensor], like: TensorDictBase) -> TensorDict:
    """A TensorDict with ``like``'s batch size holding ``values`` under ``keys``, in order."""
    return TensorDict(dict(zip(keys, values)), batch_size=like.batch_size)


def subset(td: TensorDictBase, keys: Sequence[Key]) -> TensorDictBase:
    """``td`` restricted to ``keys``; ``td`` itself when that is all of it."""
    if len(keys) == len(leaf_keys(td)):
        return td
    return td.select(*keys)


def carry(old: TensorDictBase, new: TensorDictBase) -> TensorDictBase:
    """``old`` with the leaves of ``new`` replaced; ``new`` when it covers every leaf.

    This is how a transform that saw only some leaves (the others had no gradient)
    carries the state of the rest over unchanged.
    """
    new_keys = leaf_keys(new)
    old_keys = leaf_keys(old)
    if len(new_keys) == len(old_keys):
        return new
    wanted = set(new_keys)
    values = [new.get(k) if k in wanted else old.get(k) for k in old_keys]
    return build(old_keys, values, old)


def laid_out_like(td: TensorDictBase, like: TensorDictBase, where: str) -> TensorDict:
    """``td``'s leaves laid out as ``like``'s (key order, batch size, devices), after checking they match.

    Raises a ``ValueError`` naming ``where`` and the first key that is missing, unexpected,
    or of another shape or dtype.
    """
    given = dict(zip(leaf_keys(td), leaves(td)))
    out = like.empty(recurse=True)
    for key, ref in zip(leaf_keys(like), leaves(like)):
        name = dotted(key)
        value = given.pop(key, None)
        if value is None:
            raise ValueError(f"{where}: missing {name!r}")
        if value.shape != ref.shape:
            raise ValueError(f"{where}: {name!r} has shape {tuple(value.shape)}, expected {tuple(ref.shape)}")
        if value.dtype != ref.dtype:
            raise ValueError(f"{where}: {name!r} has dtype {value.dtype}, expected {ref.dtype}")
        out.set(key, value.to(ref.device))
    if given:
        raise ValueError(f"{where}: unexpected {dotted(next(iter(given)))!r}")
    return out
