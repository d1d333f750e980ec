"""Key and structure helpers for TensorDicts of parameters.

Leaves are addressed by tuple keys (``("block", "0", "weight")``); users may also
write the dotted names of ``named_parameters()`` (``"block.0.weight"``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

Key = tuple[str, ...]


def as_key(key: str | Sequence[str]) -> Key:
    """Normalises a TensorDict key (``"w"`` or ``("a", "w")``) to a tuple."""
    return (key,) if isinstance(key, str) else tuple(key)


def dotted(key: Key) -> str:
    """The ``named_parameters()`` spelling of a key."""
    return ".".join(key)


def leaf_keys(td: TensorDictBase) -> list[Key]:
    """Every leaf key of ``td`` as a tuple, in insertion order."""
    return [as_key(k) for k in td.keys(include_nested=True, leaves_only=True)]


def leaves(td: TensorDictBase) -> list[torch.Tensor]:
    return list(td.values(include_nested=True, leaves_only=True))


def resolve_key(name: str | Sequence[str], known: Iterable[Key]) -> Key:
    """Maps a user-written key to a leaf key: tuple, plain or dotted string."""
    known_set = set(known)
    key = as_key(name)
    if key in known_set:
        return key
    if isinstance(name, str) and tuple(name.split(".")) in known_set:
        return tuple(name.split("."))
    raise KeyError(f"{name!r} is not a parameter key")


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
