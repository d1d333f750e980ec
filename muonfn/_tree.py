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


def per_member(values: TensorDictBase | torch.Tensor, like: TensorDictBase) -> TensorDict:
    """One value per member of an ensemble, laid out to broadcast against ``like``'s leaves.

    ``values``: a tensor, or a TensorDict with ``like``'s keys, of shape ``like.batch_size``
    (one value per member). Each leaf of the result is that value reshaped to
    ``batch_size + (1,) * member_ndim`` and cast to the dtype of ``like``'s leaf, as a 0-d
    value would meet it (a dimensioned fp64 factor would promote an fp32 leaf).
    """
    keys = leaf_keys(like)
    out = []
    for key, ref in zip(keys, leaves(like)):
        v = values if isinstance(values, torch.Tensor) else values.get(key)
        out.append(v.reshape(*v.shape, *[1] * (ref.ndim - like.batch_dims)).to(ref.dtype))
    return build(keys, out, like)


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
