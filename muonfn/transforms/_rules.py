"""Rules: a transform's update over flat ``{key: tensor}`` dicts, and the path that runs them.

Every transform of this package is written once, as a :class:`Rule`: the combinators compose
rules, and a TensorDict is flattened and rebuilt only at the API boundary, once per update
(:class:`RuleUpdate`). What a rule reads is declared in its ``needs`` and checked for every
member of a composition before any of them runs. A transform written over TensorDicts joins a
composition through :func:`as_rule` (correct, not fast): write a rule to run on the fast path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _multi_tensor, _tree
from .._gc_pause import pause_collections, resume_collections
from .._keys import Key, dotted
from .._tree import FlatState, Leaves
from .._validation import check_batch, check_donatable, check_leaves
from ._contract import InitFn, Transform


class Scope:
    """The flattened state of one update, as one transform sees it.

    Reads come from the state given; writes go to the state returned, which starts as a
    copy of it, so that the leaves a transform does not touch (no gradient this step, or
    another branch's) are carried over without a copy of their own.
    """

    __slots__ = ("batch_size", "checked", "given", "prefix", "returned")

    def __init__(
        self,
        given: FlatState,
        returned: FlatState,
        prefix: Key,
        batch_size: torch.Size,
        checked: dict[Key, Any] | None = None,
    ) -> None:
        self.given, self.returned, self.prefix, self.batch_size = given, returned, prefix, batch_size
        #: values the checks computed before the update (a schedule's learning rate, by its count's key)
        self.checked: dict[Key, Any] = {} if checked is None else checked

    @property
    def members(self) -> int:
        """The batch dimensions of a stacked ensemble (0 for one model)."""
        return len(self.batch_size)

    def child(self, name: str) -> Scope:
        """The scope of the state kept under ``name`` (:func:`named`, a partition's branch)."""
        return Scope(self.given, self.returned, (*self.prefix, name), self.batch_size, self.checked)

    def read(self, entry: str, keys: Iterable[Key]) -> list[torch.Tensor]:
        """The state ``entry`` of every leaf of ``keys`` (checked present by :class:`Needs`)."""
        given = self.given
        return [given[k] for k in _entry_keys((*self.prefix, entry), keys)]

    def write(self, entry: str, keys: Iterable[Key], values: Iterable[torch.Tensor]) -> None:
        self.returned.update(zip(_entry_keys((*self.prefix, entry), keys), values))

    def get(self, entry: str) -> torch.Tensor:
        """A state entry kept once for all leaves (a step count)."""
        return self.given[(*self.prefix, entry)]

    def set(self, entry: str, value: torch.Tensor) -> None:
        self.returned[(*self.prefix, entry)] = value

    def subtree(self, entries: Sequence[str]) -> FlatState:
        """The state given under ``entries`` of this scope, keyed relative to the scope."""
        n, prefix = len(self.prefix), self.prefix
        return {k[n:]: v for k, v in self.given.items() if len(k) > n and k[:n] == prefix and k[n] in entries}

    def replace_subtree(self, entries: Sequence[str], flat: FlatState) -> None:
        """Replaces the state returned under ``entries`` by ``flat`` (keys relative to this scope)."""
        n, prefix = len(self.prefix), self.prefix
        for k in [k for k in self.returned if len(k) > n and k[:n] == prefix and k[n] in entries]:
            del self.returned[k]
        self.returned.update({(*prefix, *k): v for k, v in flat.items()})


#: state keys of the leaves under an entry, by (entry, leaves): the same every update
_ENTRY_KEYS: dict[tuple[Key, tuple[Key, ...]], list[Key]] = {}
_ENTRY_KEYS_KEPT = 256


def _entry_keys(base: Key, keys: Iterable[Key]) -> list[Key]:
    """``(*base, *key)`` for every key, the tuples of an earlier update when there was one
    (no new tuples, and dicts keyed by them compare by identity)."""
    leaves = tuple(keys)
    if torch.compiler.is_compiling():
        return [(*base, *k) for k in leaves]  # a cache changed while tracing would fail the guards
    found = _ENTRY_KEYS.get((base, leaves))
    if found is None:
        if len(_ENTRY_KEYS) >= _ENTRY_KEYS_KEPT:
            del _ENTRY_KEYS[next(iter(_ENTRY_KEYS))]
        found = _ENTRY_KEYS[base, leaves] = [(*base, *k) for k in leaves]
    return found


class Needs:
    """What an update reads, checked before any transform of a composition runs (a member
    that updates its state in place must not have run when a later one finds bad input).

    ``entries``: top-level entries a scope must hold (``(where, scope prefix, names)``);
    ``like``: state leaves that must exist with their gradients' shapes, dtypes and devices
    (``(where, state keys, gradient keys, squares)``, ``squares``: second moments, whose dtype is
    :func:`~muonfn._multi_tensor.second_moment_dtype` of the gradient's); ``counts``: step counts that
    must exist as int64 tensors of the batch size, one count per ensemble member (``(where,
    state keys)``; their device is not checked: a 0-d count may be kept apart from its leaf, as
    ``torch.optim`` keeps its steps); ``shaped``: state leaves that must exist with a given shape,
    on their gradient's device (second-moment statistics of a leaf, such as one per row, in the
    gradient's second-moment dtype);
    ``params``: whether ``params`` are required; ``values``: checks of what the update will
    compute from the state before it writes anything (a schedule's learning rate), each
    ``check(state, grads, checked)``, which may keep its result in ``checked`` for the update
    (:attr:`Scope.checked`). State keys are full (prefixed) keys; ``where`` names the
    transform that reads them.
    """

    __slots__ = ("batch_size", "checked", "counts", "entries", "like", "params", "shaped", "values")

    def __init__(self, batch_size: torch.Size) -> None:
        self.batch_size = batch_size
        self.entries: list[tuple[str, Key, Sequence[str]]] = []
        self.like: list[tuple[str, Sequence[Key], Sequence[Key], bool]] = []
        self.counts: list[tuple[str, Sequence[Key]]] = []
        self.shaped: list[tuple[str, Key, Key, tuple[int, ...]]] = []
        self.params: list[str] = []
        self.values: list[Callable[[FlatState, Leaves, dict[Key, Any]], None]] = []
        self.checked: dict[Key, Any] = {}

    def check(
        self, tree: TensorDictBase | Mapping[str, Any] | None, state: FlatState, grads: Leaves, params: Leaves | None
    ) -> None:
        """Raises a ``ValueError`` naming the first thing missing or mismatched (``tree``: the
        state as given, whose entries are checked unless ``None``; ``state`` flattened)."""
        for where, prefix, names in self.entries if tree is not None else ():
            node: Any = tree.get(prefix) if prefix and isinstance(tree, TensorDictBase) else tree
            present = set(node.keys())
            for name in names:
                if name not in present:
                    raise ValueError(
                        f"{where}: state has no entry {name!r} (it has {sorted(present)}); "
                        "was it made by this transform's init?"
                    )
        if params is None and self.params:
            raise ValueError(f"{self.params[0]} needs params: call update(grads, state, params)")
        for where, keys in self.counts:
            for key in keys:
                count = state.get(key)
                if count is None:
                    raise ValueError(
                        f"{where}: state has no entry {dotted(key)!r}; was it made by this transform's init?"
                    )
                if count.dtype != torch.int64 or tuple(count.shape) != tuple(self.batch_size):
                    raise ValueError(
                        f"{where}: state entry {dotted(key)!r} must be an int64 step count of shape "
                        f"{tuple(self.batch_size)}, got dtype {count.dtype} and shape {tuple(count.shape)}"
                    )
        for where, keys, grad_keys, squares in self.like:
            _check_like(where, keys, grad_keys, state, grads, squares=squares)
        for where, key, grad_key, shape in self.shaped:
            s = state.get(key)
            if s is None:
                raise ValueError(f"{where}: state has no entry {dotted(key)!r}; was it made by this transform's init?")
            g = grads[grad_key]
            dtype = _multi_tensor.second_moment_dtype(g.dtype)
            if tuple(s.shape) != shape or s.dtype != dtype:
                raise ValueError(
                    f"{where}: gradient {dotted(grad_key)!r} of shape {tuple(g.shape)} and dtype {g.dtype} does not "
                    f"fit its state {dotted(key)!r} of shape {tuple(s.shape)} and dtype {s.dtype} "
                    f"(expected {shape} and {dtype})"
                )
            _check_device(where, key, grad_key, s, g)
        for check in self.values:
            check(state, grads, self.checked)


def _check_like(
    where: str, keys: Sequence[Key], grad_keys: Sequence[Key], state: FlatState, grads: Leaves, *, squares: bool
) -> None:
    """Each state leaf of ``keys`` must exist with its gradient's shape, device and dtype (for
    ``squares``, second moments, the dtype squares of the gradient are kept in)."""
    for key, grad_key in zip(keys, grad_keys):
        s = state.get(key)
        if s is None:
            raise ValueError(
                f"{where}: gradient {dotted(grad_key)!r} has no matching parameter or state "
                f"(no {dotted(key)!r} in the state)"
            )
        g = grads[grad_key]
        if s.shape != g.shape:
            raise ValueError(
                f"{where}: gradient {dotted(grad_key)!r} has shape {tuple(g.shape)}, expected {tuple(s.shape)}"
            )
        _check_device(where, key, grad_key, s, g)
        expected = _multi_tensor.second_moment_dtype(g.dtype) if squares else g.dtype
        if s.dtype == expected:
            continue
        if not squares or (expected == g.dtype and _multi_tensor.second_moment_dtype(s.dtype) == s.dtype):
            raise ValueError(f"{where}: gradient {dotted(grad_key)!r} has dtype {g.dtype}, expected {s.dtype}")
        raise ValueError(
            f"{where}: gradient {dotted(grad_key)!r} of dtype {g.dtype} does not fit its state {dotted(key)!r} "
            f"of dtype {s.dtype}: the second moment of a {g.dtype} leaf is kept in {expected}"
        )


def _check_device(where: str, key: Key, grad_key: Key, s: torch.Tensor, g: torch.Tensor) -> None:
    """A state leaf must be on its gradient's device: a state made by ``init`` from params on
    another device (``meta`` before a deferred init materialises them) would otherwise be
    updated there, and its updates be added to nothing."""
    if s.device != g.device:
        raise ValueError(
            f"{where}: gradient {dotted(grad_key)!r} is on {g.device}, its state {dotted(key)!r} on {s.device}; "
            "make the state from the params where they are (tx.init(params)) or move it (state.to(device))"
        )


class Rule(NamedTuple):
    """A transform's update over flat dicts (see :func:`from_rule`).

    ``update(grads, scope, params) -> updates``: new leaves for the keys of ``grads``, in
    their order; state read and written through ``scope``. ``needs(grads, params, prefix,
    needs)`` adds what it will read to ``needs`` (``prefix``: its scope's), so that bad input
    is refused before any member of a composition runs: :func:`per_leaf_needs` for state
    entries shaped like each leaf, :func:`no_needs` for none. The update must not change its
    inputs unless told the state is donated, and must stay traceable (no ``.item()``).
    ``donated``: the update may write the state it is given in place (``donate_state=True``),
    which a wrapper that may keep the old state (:func:`apply_if_finite`) must know.
    """

    name: str
    update: Callable[[Leaves, Scope, Leaves | None], Leaves]
    needs: Callable[[Leaves, Leaves | None, Key, Needs], None]
    donated: bool = False


def no_needs(grads: Leaves, params: Leaves | None, prefix: Key, needs: Needs) -> None:
    """The :attr:`Rule.needs` of a rule that reads no state and no params."""


def per_leaf_needs(
    name: str, entries: Sequence[str], counts: Sequence[str] = (), *, squares: Sequence[str] = ()
) -> Callable[..., None]:
    """The :attr:`Rule.needs` of a rule keeping ``entries`` shaped like each leaf (those of
    ``squares`` second moments, see :func:`~muonfn._multi_tensor.second_moment_dtype`) and ``counts``
    (one int64 per leaf) in its state."""

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        out.entries.append((name, prefix, (*entries, *counts)))
        for entry in entries:
            out.like.append((name, _entry_keys((*prefix, entry), grads), list(grads), entry in squares))
        for entry in counts:
            out.counts.append((name, _entry_keys((*prefix, entry), grads)))

    return needs


class RuleUpdate:
    """The TensorDict ``update`` of a :class:`Rule`: flatten, check, run, rebuild."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.__qualname__ = rule.name

    def __call__(
        self, grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        paused = pause_collections()
        try:
            return self._run(grads, state, params)
        finally:
            resume_collections(paused)

    def _run(
        self, grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_batch(self.rule.name, grads, state)
        flat_state = _tree.flatten(state, keep_empty=True) if isinstance(state, TensorDictBase) else {}
        flat_grads, flat_params = _tree.flatten(grads), None if params is None else _tree.flatten(params)
        checked = check_rule(self.rule, flat_grads, flat_state, flat_params, grads.batch_size, state)
        if self.rule.donated:
            check_donatable(self.rule.name, flat_state)
        updates, returned = run_checked(self.rule, flat_grads, flat_state, flat_params, grads.batch_size, checked)
        if not isinstance(state, TensorDictBase) and not returned:
            return _tree.unflatten(updates, grads.batch_size), state  # a stateless transform given a plain {}
        if _same_entries(returned, flat_state):
            return _tree.unflatten(updates, grads.batch_size), state  # updated in place (donated) or unchanged
        return _tree.unflatten(updates, grads.batch_size), _tree.unflatten(returned, state.batch_size)


def _same_entries(a: FlatState, b: FlatState) -> bool:
    """Whether ``a`` holds the very keys and values of ``b``, in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b)) and all(map(operator.is_, a.values(), b.values()))


def check_rule(
    rule: Rule,
    grads: Leaves,
    state: FlatState,
    params: Leaves | None,
    batch_size: torch.Size,
    tree: TensorDictBase | Mapping[str, Any] | None = None,
) -> dict[Key, Any]:
    """Checks one update's input, every member's needs at once, before anything is computed:
    a ``ValueError`` names the first thing missing or mismatched.

    ``tree``: the state as given, for the check of its top-level entries; ``None`` skips it
    (a caller whose state always has its transform's layout, as the ``torch.optim`` shim's).
    Returns what the checks computed for the update (see :attr:`Scope.checked`).
    """
    check_leaves(rule.name, grads, params, batch_size)
    needs = Needs(batch_size)
    rule.needs(grads, params, (), needs)
    needs.check(tree, state, grads, params)
    return needs.checked


def run_checked(
    rule: Rule,
    grads: Leaves,
    state: FlatState,
    params: Leaves | None,
    batch_size: torch.Size,
    checked: dict[Key, Any] | None = None,
) -> tuple[Leaves, FlatState]:
    """One update over flat dicts, ``(updates, new state)``, after :func:`check_rule` passed for
    these leaves, or for a superset of ``grads`` with the same state and params (a step taken
    in parts); ``checked``: what it returned."""
    scope = Scope(state, dict(state), (), batch_size, checked)
    return rule.update(grads, scope, params), scope.returned


def from_rule(init: InitFn, rule: Rule) -> Transform:
    """The :class:`Transform` of ``init`` and ``rule``: how every transform of muonfn is made, and
    how to write one that joins a composition on the fast path (no TensorDict rebuilt for it).

    ``init(params) -> state`` is the TensorDict contract's; ``rule.update`` sees the gradients
    as a flat ``{key: tensor}`` dict and reads and writes its state through a :class:`Scope`.
    Per-tensor ops, as below, run everywhere; ``torch._foreach_*`` ops are faster eagerly but
    have no ``torch.vmap`` batching rule.

    Example:
        >>> def scale_by_rms(beta=0.99, eps=1e-8):
        ...     def init(params):
        ...         return TensorDict({"nu": params.apply(torch.zeros_like)}, batch_size=params.batch_size)
        ...
        ...     def update(grads, scope, params):
        ...         keys, g = list(grads), list(grads.values())
        ...         nu = [n.lerp(x * x, 1 - beta) for n, x in zip(scope.read("nu", keys), g)]
        ...         scope.write("nu", keys, nu)
        ...         return {k: x / (n.sqrt() + eps) for k, x, n in zip(keys, g, nu)}
        ...
        ...     needs = muonfn.per_leaf_needs("scale_by_rms", ("nu",))  # checked before any member runs
        ...     return muonfn.from_rule(init, muonfn.Rule("scale_by_rms", update, needs))
        >>> tx = muonfn.chain(scale_by_rms(beta=0.0), muonfn.scale_by_learning_rate(0.1))
        >>> params = TensorDict({"w": torch.zeros(2)}, [])
        >>> tx.update(TensorDict({"w": torch.tensor([3.0, -0.5])}, []), tx.init(params))[0]["w"]
        tensor([-0.1000,  0.1000])
    """
    return Transform(init, RuleUpdate(rule))


def as_rule(tx: Transform) -> Rule:
    """``tx``'s rule; a transform written over TensorDicts is wrapped: its state and
    gradients are rebuilt as TensorDicts for it (correct, not fast), and it checks its own input."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"expected a muonfn.Transform (init, update), got {type(tx).__name__}")
    update = tx.update
    if isinstance(update, RuleUpdate):
        return update.rule
    owned = tuple(tx.init(TensorDict({}, batch_size=[])).keys())  # its top-level state entries

    def run(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        size = scope.batch_size
        state = _tree.unflatten(scope.subtree(owned), size)
        td_params = None if params is None else _tree.unflatten(params, size)
        updates, new_state = update(_tree.unflatten(grads, size), state, td_params)
        scope.replace_subtree(owned, _tree.flatten(new_state, keep_empty=True))
        flat = _tree.flatten(updates)
        return {k: flat[k] for k in grads}

    return Rule(getattr(update, "__qualname__", "update").partition(".<locals>")[0], run, no_needs)
