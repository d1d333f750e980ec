"""Leaves by dotted name: the flat form every update computes on.

A parameter tree (``TensorDict.from_module(model)``, nested) is read as one flat TensorDict whose
keys are the dotted names of ``named_parameters()`` (``"h.0.attn.weight"``). Each update flattens
its input once, at its entry, and rebuilds its updates in the input's nesting; states keep their
per-leaf entries flat, under the same names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection

V = TypeVar("V")


def build(items: Mapping[str, Any], batch_size: torch.Size) -> TensorDict:
    """A TensorDict of ``items`` (tensors or TensorDicts of ``batch_size``), without re-checking them."""
    return TensorDict._new_unsafe(dict(items), batch_size=torch.Size(batch_size))


def flat(td: TensorDictBase) -> TensorDictBase:
    """``td`` keyed by dotted names (``td`` itself when it holds no nested TensorDict); a key of a
    nested ``td`` that holds a dot, which would make two leaves one dotted name, is refused."""
    if not any(map(is_tensor_collection, td.values())):
        return td
    return build(_walk(td, "", {}), td.batch_size)


def _walk(td: TensorDictBase, prefix: str, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``out`` with the leaves of ``td`` added under their dotted names, each after ``prefix``."""
    for name, value in td.items():
        if "." in name:
            raise ValueError(f"key {prefix + name!r} holds a dot, which separates the levels of a dotted name")
        if isinstance(value, TensorDictBase):
            _walk(value, f"{prefix}{name}.", out)
        else:
            out[prefix + name] = value
    return out


def cast_like(values: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``values`` in the dtype of its partner in ``like``."""
    return [v if v.dtype == t.dtype else v.to(t.dtype) for v, t in zip(values, like)]


def named_leaves(td: TensorDictBase, names: list[str]) -> list[Any]:
    """``td``'s leaves named ``names``, in that order: its values as they are where its keys are
    ``names`` (the state ``init`` made for these leaves), else looked up one by one."""
    return list(td.values()) if list(td.keys()) == names else [td[n] for n in names]


def replaced(held: TensorDictBase, names: Sequence[str], values: Sequence[Any]) -> TensorDictBase:
    """``held`` (a flat state entry) with the leaves ``names`` replaced by ``values``."""
    return build({**held, **dict(zip(names, values))}, held.batch_size)


def nested_like(updates: TensorDictBase, like: TensorDictBase) -> TensorDictBase:
    """The flat ``updates`` in the nesting of ``like``, a nested TensorDict, in their order."""
    root: dict[str, Any] = {}
    for name, value in updates.items():
        node, (*path, leaf) = root, name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return build(root, like.batch_size)  # (which makes each inner dict a TensorDict of that batch size)


def dotted(name: str | Sequence[str]) -> str:
    """A name as written (``"a.w"`` or ``("a", "w")``) in its dotted spelling."""
    return name if isinstance(name, str) else ".".join(name)


def named_table(table: Mapping[Any, V], names: Iterable[str], where: str | None = None) -> dict[str, V]:
    """A table the user wrote (tuple or dotted names to values) keyed by the dotted ``names``.

    ``where`` set: a name that is no leaf is an error naming ``where`` (a typo). ``None``: such
    names are skipped (a transform sees only its leaves of a table written for the whole model).
    """
    known = set(names)
    out: dict[str, V] = {}
    for name, value in table.items():
        key = dotted(name)
        if key in known:
            out[key] = value
        elif where is not None:
            raise ValueError(f"{where} names {key!r}, which is not a parameter; parameters are {sorted(known)}")
    return out
