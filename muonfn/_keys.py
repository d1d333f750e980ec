"""Parameter keys: how a leaf is named, and how user-written names find their leaf.

Leaves are addressed by tuple keys (``("block", "0", "weight")``); users may also write
the dotted names of ``named_parameters()`` (``"block.0.weight"``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

Key = tuple[str, ...]
V = TypeVar("V")


def as_key(key: str | Sequence[str]) -> Key:
    """Normalises a TensorDict key (``"w"`` or ``("a", "w")``) to a tuple."""
    return (key,) if isinstance(key, str) else tuple(key)


def dotted(key: Key) -> str:
    """The ``named_parameters()`` spelling of a key."""
    return ".".join(key)


def resolve_key(name: Any, known: Iterable[Key]) -> Key:
    """Maps a user-written key to a leaf key: tuple, plain or dotted string."""
    known_set = known if isinstance(known, set | frozenset) else set(known)
    key = as_key(name)
    if key in known_set:
        return key
    if isinstance(name, str) and tuple(name.split(".")) in known_set:
        return tuple(name.split("."))
    raise KeyError(f"{name!r} is not a parameter key")


def resolve_table(table: Mapping[Any, V], keys: Sequence[Key], *, where: str | None = None) -> dict[Key, V]:
    """A table written by the user (names to values) keyed by leaf keys.

    ``where`` set: a name that is no leaf of ``keys`` is an error naming ``where`` (a typo).
    ``None``: such names are skipped, for a transform that sees only some of the leaves
    (those with a gradient, or those routed to it) of a table written for the whole model.
    """
    known = set(keys)
    out: dict[Key, V] = {}
    for name, value in table.items():
        try:
            out[resolve_key(name, known)] = value
        except KeyError:
            if where is not None:
                raise ValueError(
                    f"{where} names {name!r}, which is not a parameter; parameters are {[dotted(k) for k in keys]}"
                ) from None
    return out
