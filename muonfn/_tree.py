"""Structure helpers for TensorDicts of parameters, states and updates."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_non_tensor

from ._keys import Key, as_key, dotted


def leaf_keys(td: TensorDictBase) -> list[Key]:
    """Every leaf key of ``td`` as a tuple, in insertion order."""
    return [as_key(k) for k in td.keys(include_nested=True, leaves_only=True)]


def leaves(td: TensorDictBase) -> list[torch.Tensor]:
    return list(td.values(include_nested=True, leaves_only=True))


def build(keys: Sequence[Key], values: Sequence[torch.Tensor], like: TensorDictBase) -> TensorDict:
    """A TensorDict with ``like``'s batch size holding ``values`` under ``keys``, in order."""
    return TensorDict(dict(zip(keys, values)), batch_size=like.batch_size)


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


# The fast path: a TensorDict's leaves as one flat ``{key: tensor}`` dict, and back.
# Transforms compute on these dicts with multi-tensor ops; TensorDicts are built only at
# the API boundary, once per update.

Leaves = dict[Key, torch.Tensor]
#: a flattened state: tensors, and the empty TensorDicts that stand for a stateless member
FlatState = dict[Key, Any]


def flatten(td: TensorDictBase, *, keep_empty: bool = False) -> FlatState:
    """``td``'s leaves by tuple key, in insertion order. ``keep_empty``: empty nested
    TensorDicts are kept as leaves, so that :func:`unflatten` gives the same structure back
    (a state's stateless members).

    A structure seen before is read through its :class:`_Plan`: the same key tuples, no
    per-leaf Python work beyond a type check (an update flattens the same structures every step).
    """
    if type(td) is not TensorDict or torch.compiler.is_compiling():
        return _walked(td, keep_empty)
    root = (keep_empty, *td._tensordict)
    candidates = _by_root.get(root, [])
    for plan in candidates:
        values = plan.collect(td)
        if values is not None:
            if plan is not candidates[0]:  # the most recent first
                candidates[:] = [plan, *(c for c in candidates if c is not plan)]
            return dict(zip(plan.keys, values))
    out = _walked(td, keep_empty)
    new_plan = _Plan.of(td, out)
    if new_plan is not None:
        _remember(new_plan, root)
    return out


def _walked(td: TensorDictBase, keep_empty: bool) -> FlatState:
    out: FlatState = {}
    _walk(td, (), out, keep_empty)
    return out


def _walk(td: TensorDictBase, prefix: Key, out: FlatState, keep_empty: bool) -> int:
    """Adds ``td``'s leaves to ``out``; returns how many tensors it added."""
    # a plain TensorDict's own dict is read directly: 5-10x faster than items(True, True)
    items = td._tensordict.items() if type(td) is TensorDict else td.items()
    tensors = 0
    for name, value in items:
        key = (*prefix, name)
        if _is_node(value):
            before = len(out)
            found = _walk(value, key, out, keep_empty)
            if not found and keep_empty:  # no tensor beneath: the node stands as one leaf
                for _ in range(len(out) - before):
                    out.popitem()
                out[key] = value
            tensors += found
        else:
            out[key] = value
            tensors += 1
    return tensors


def _is_node(value: Any) -> bool:
    return type(value) is TensorDict or (isinstance(value, TensorDictBase) and not is_non_tensor(value))


def unflatten(flat: Mapping[Key, Any], batch_size: torch.Size) -> TensorDict:
    """The TensorDict of batch size ``batch_size`` holding ``flat``'s values under its keys."""
    size = torch.Size(batch_size)
    compiling = torch.compiler.is_compiling()
    if flat and not compiling and _new_node is not None:
        keys = list(flat)
        for plan in _by_keys.get((len(keys), keys[0]), ()):
            if plan.keys == keys:
                return _build(plan.root, list(flat.values()), size, _new_node)
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        for name in key[:-1]:
            child = node.get(name)
            if child is None:
                child = node[name] = {}
            node = child
        node[key[-1]] = value
    if _new_node is None or compiling:
        return TensorDict._new_unsafe(root, batch_size=size)
    return _built(root, size, _new_node)


def _built(node: dict[str, Any], batch_size: torch.Size, new_node: Callable[..., TensorDict]) -> TensorDict:
    for name, value in node.items():
        if type(value) is dict:
            node[name] = _built(value, batch_size, new_node)
        # an empty TensorDict kept by flatten(keep_empty=True) comes back as it was
    return new_node(node, batch_size)


# Plans: the layout of a structure seen before, kept so that flattening it again and
# rebuilding it cost no new key tuples and little Python per leaf. A plan holds names only,
# never tensors. Every use checks the structure in full (names at every node, the type of
# every leaf), so a structure changed in place is never read through a stale plan. It reads
# a structure in one loop over its nodes (depth first) and builds one by recursion.


class _Node:
    """One nested TensorDict of a plan: its names in order, and per name a leaf's index in
    the flat order (``int``), a kept empty node's index (:class:`_Kept`) or a :class:`_Node`.
    ``get``: for a node holding only tensors, reads them all at once (indices ``first:last``)."""

    __slots__ = ("children", "first", "get", "last", "names")

    def __init__(self, names: tuple[str, ...], children: list[Any]) -> None:
        self.names, self.children = names, tuple(children)
        tensors_only = all(type(c) is int for c in children)
        self.get = _getter(names) if tensors_only and names else None
        self.first: int = children[0] if self.get is not None else 0
        self.last: int = children[-1] + 1 if self.get is not None else 0


class _Kept:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    if len(names) == 1:
        (name,) = names
        return lambda d: (d[name],)
    return operator.itemgetter(*names)


class _Plan:
    """A structure's layout: ``keys``, its flat keys in order, and ``root``, its nodes. For
    :meth:`collect`, the nodes in depth-first order (the root first): ``names``, each node's
    names in order; ``parents``, each node but the root as ``(parent, name)``; ``leaves``,
    each flat entry as ``(node, name)``; ``kept``, the flat indices of kept empty nodes."""

    __slots__ = ("kept", "keys", "leaves", "names", "parents", "root")

    def __init__(self, keys: list[Key], root: _Node) -> None:
        self.keys, self.root = keys, root
        self.names: list[tuple[str, ...]] = []
        self.parents: list[tuple[int, str]] = []
        self.leaves: list[tuple[int, str]] = []
        self.kept: list[int] = []
        self._number(root)

    def _number(self, node: _Node) -> None:
        index = len(self.names)
        self.names.append(node.names)
        for name, child in zip(node.names, node.children):
            if type(child) is _Node:
                self.parents.append((index, name))
                self._number(child)
            else:
                self.leaves.append((index, name))
                if type(child) is _Kept:
                    self.kept.append(child.index)

    @staticmethod
    def of(td: TensorDict, flat: FlatState) -> _Plan | None:
        """The plan of ``td``, flattened as ``flat``; ``None`` for a structure with no leaf or
        with a node of another kind than a plain TensorDict (those are walked every time)."""
        if not flat:
            return None
        root = _plan_node(td, (), {key: i for i, key in enumerate(flat)})
        if root is None:
            return None
        _LEAF_TYPES.update(type(v) for v in flat.values() if not _is_node(v))
        return _Plan(list(flat), root)

    def collect(self, td: Any) -> list[Any] | None:
        """``td``'s leaves in flat order if ``td`` has this structure; else ``None``."""
        if type(td) is not TensorDict:
            return None
        nodes = [td._tensordict]
        for parent, name in self.parents:
            child = nodes[parent].get(name)
            if type(child) is not TensorDict:
                return None
            nodes.append(child._tensordict)
        if list(map(tuple, nodes)) != self.names:
            return None  # other names, or the same in another order
        values = [nodes[node][name] for node, name in self.leaves]
        if not self.kept:
            return values if _LEAF_TYPES.issuperset(map(type, values)) else None
        kept = set(self.kept)
        if not _LEAF_TYPES.issuperset(type(v) for i, v in enumerate(values) if i not in kept):
            return None
        # a kept node must still hold no tensor
        if not all(_is_node(values[i]) and not _walk(values[i], (), {}, True) for i in self.kept):
            return None
        return values


def _plan_node(td: TensorDictBase, prefix: Key, index: dict[Key, int]) -> _Node | None:
    if type(td) is not TensorDict:
        return None
    children: list[Any] = []
    for name, value in td._tensordict.items():
        key = (*prefix, name)
        if key in index:
            children.append(index[key] if not _is_node(value) else _Kept(index[key]))
        else:
            child = _plan_node(value, key, index)
            if child is None:
                return None
            children.append(child)
    return _Node(tuple(td._tensordict), children)


#: types seen as leaves (tensors and their subclasses, non-tensor data): a plan checks a leaf's
#: type against these instead of walking tensordict's type tests for every leaf
_LEAF_TYPES: set[type] = {torch.Tensor, torch.nn.Parameter}
_by_root: dict[tuple[Any, ...], list[_Plan]] = {}
_by_keys: dict[tuple[int, Key], list[_Plan]] = {}
_PLANS_PER_ENTRY = 4
_ENTRIES = 64


def _remember(plan: _Plan, root: tuple[Any, ...]) -> None:
    for table, entry in ((_by_root, root), (_by_keys, (len(plan.keys), plan.keys[0]))):
        if entry not in table and len(table) >= _ENTRIES:
            del table[next(iter(table))]
        plans = table.setdefault(entry, [])
        plans.insert(0, plan)
        del plans[_PLANS_PER_ENTRY:]


def _build(node: _Node, values: list[Any], size: torch.Size, new_node: Callable[..., TensorDict]) -> TensorDict:
    if node.get is not None:
        return new_node(dict(zip(node.names, values[node.first : node.last])), size)
    items: dict[str, Any] = {}
    for name, child in zip(node.names, node.children):
        if type(child) is _Node:
            items[name] = _build(child, values, size, new_node)
        else:
            items[name] = values[child if type(child) is int else child.index]
    return new_node(items, size)


def _direct_node() -> Callable[[dict[str, Any], torch.Size], TensorDict] | None:
    """A TensorDict node built from a dict it takes over, without tensordict's per-node checks
    and keyword handling (the rebuild runs once per update over every state node); ``None``
    where this tensordict keeps other per-instance fields than the constructor's fast path."""
    reference = TensorDict._new_unsafe({}, batch_size=torch.Size([]), nested=False)
    if set(vars(reference)) != {"_device", "_tensordict", "_batch_size", "_td_dim_names"}:
        return None
    if reference._device is not None or reference._td_dim_names is not None:
        return None
    blank = object.__new__

    def new_node(items: dict[str, Any], batch_size: torch.Size) -> TensorDict:
        td = blank(TensorDict)
        td._device, td._tensordict, td._batch_size, td._td_dim_names = None, items, batch_size, None
        return td

    return new_node


_new_node = _direct_node()
