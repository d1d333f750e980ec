"""``opt.state``: torch's per-parameter view of the functional state."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from .. import _tree
from .._keys import Key, dotted
from . import _groups
from ._layout import Layout


class ParamState(MutableMapping[Any, Any]):
    """``opt.state`` for torch code: per-parameter mappings holding the tensors of ``opt.functional_state``.

    As torch's, it holds a parameter once it has state: after the parameter's first step (or a
    state given for it), so ``len(opt.state)`` is 0 after construction. ``opt.state[p]`` of a
    parameter is a :class:`ParamEntries`, live: it reads the current tensors and writes through to
    the functional state, and is empty while ``p`` has no state. Assigning ``opt.state[p] = {...}``
    replaces all of ``p``'s entries (checked as for ``functional_state``; ``{}`` forgets them);
    ``del opt.state[p]`` forgets them, and the next step of ``p`` makes them anew. Other keys
    (tensors the optimizer does not own, strings a hook stores) behave as in torch's
    ``defaultdict(dict)`` and travel through ``state_dict()`` as torch's do.
    """

    def __init__(self, layout: Layout, optimizer: torch.optim.Optimizer) -> None:
        self._layout = layout
        self._optimizer = optimizer  # its param_groups, whose settings lay the state out
        #: entries under keys that are not parameters, as torch's ``defaultdict(dict)`` holds them
        self.others: dict[Any, Any] = {}

    def __getitem__(self, key: Any) -> Any:
        slot = self._slot(key)
        if slot is None:
            return self.others.setdefault(key, {})
        return ParamEntries(self._layout, self._optimizer, key, slot)

    def __setitem__(self, key: Any, value: Any) -> None:
        slot = self._slot(key)
        if slot is None:
            self.others[key] = value
            return
        if isinstance(value, Mapping) and not value:
            self._layout.drop(self._optimizer.param_groups, [key])
            return
        check_all_entries(self._layout, self._optimizer.param_groups, slot, value)
        write_entries(self._layout, self._optimizer.param_groups, key, slot, value)

    def __delitem__(self, key: Any) -> None:
        slot = self._slot(key)
        if slot is None:
            del self.others[key]
            return
        if not self._layout.holds(key):
            raise KeyError(key)
        self._layout.drop(self._optimizer.param_groups, [key])

    def replace(self, mapping: Mapping[Any, Any]) -> None:
        """Takes ``mapping`` as the whole state (``opt.state = mapping``): each parameter's entries as
        ``opt.state[p] = entries`` takes them, no state for the parameters it does not hold, its
        other keys as they are. All is checked before anything changes."""
        groups = self._optimizer.param_groups
        if not mapping:  # torch's reset, opt.state = defaultdict(dict): as clear(), whatever param_groups holds
            self._layout.forget()
            self.others = {}
            return
        self._layout.check_groups(groups)
        state: dict[Key, Any] = {}
        others: dict[Any, Any] = {}
        for key, value in mapping.items():
            slot = self._slot(key)
            if slot is None:
                others[key] = value
            elif not (isinstance(value, Mapping) and not value):
                check_all_entries(self._layout, groups, slot, value)
                state.update(checked_entries(self._layout, groups, slot, value, None))
        checked = self._layout.checked_state(groups, state, "opt.state = ...")
        self._layout.load(groups, checked)
        self.others = others

    # as a defaultdict's: only a lookup by ``[]`` makes an entry for a key that has none

    def get(self, key: Any, default: Any = None) -> Any:
        if self._slot(key) is None:
            return self.others.get(key, default)
        return self[key] if self._layout.holds(key) else default

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if self._slot(key) is None:
            return self.others.setdefault(key, default)
        if not self._layout.holds(key) and default:
            self[key] = default
        return self[key]

    def pop(self, key: Any, *default: Any) -> Any:
        """A parameter's entries as they were (then forgotten, as by ``del``); another key's value, as ``dict.pop``."""
        if self._slot(key) is None:
            return self.others.pop(key, *default)
        if not self._layout.holds(key):
            if default:
                return default[0]
            raise KeyError(key)
        entries = dict(self[key])
        del self[key]
        return entries

    def clear(self) -> None:
        """Forgets every parameter's state (made anew at its next step) and drops the other keys."""
        self._layout.forget()
        self.others.clear()

    def popitem(self) -> tuple[Any, Any]:
        """The last other key and its value, else the last parameter with state and its entries, removed."""
        if self.others:
            return self.others.popitem()
        held = self._layout.held()
        if not held:
            raise KeyError("popitem(): opt.state is empty")
        return held[-1], self.pop(held[-1])

    def _slot(self, key: Any) -> _groups.Slot | None:
        # only tensors are parameters; a dict lookup of another key could compare it to tensors
        return self._layout.slots.get(key) if isinstance(key, torch.Tensor) else None

    def __contains__(self, key: object) -> bool:
        if self._slot(key) is not None:
            return self._layout.holds(key)  # type: ignore[arg-type]
        return key in self.others

    def __iter__(self) -> Iterator[Any]:
        yield from self._layout.held()
        yield from self.others

    def __len__(self) -> int:
        return len(self._layout.held()) + len(self.others)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


class ParamEntries(MutableMapping[str, Any]):
    """``opt.state[p]`` of a parameter: its entries under torch's names, read from and written to the functional state.

    The entries are fixed by the group (``momentum_buffer`` for a Muon group, and ``step`` with
    ``momentum_bias_correction``, with ``row_second_moment`` for a NorMuon group and
    ``exp_avg_sq`` (and its count) for an AdaMuon group; ``step``, ``exp_avg``, ``exp_avg_sq``
    for an AdamW group; see ``_groups.entries``). It is empty while the parameter has no state
    (torch's ``{}``), and holds all of them once it has. Assigning one replaces its tensor after
    the checks of ``functional_state`` (shape and dtype); assigned where the parameter has no
    state, it makes the state, the other entries as the parameter's first step would make them.
    Another name is an error, and ``clear()`` forgets them all as ``del opt.state[p]`` does.
    """

    def __init__(
        self, layout: Layout, optimizer: torch.optim.Optimizer, param: torch.Tensor, slot: _groups.Slot
    ) -> None:
        self._layout = layout
        self._optimizer = optimizer
        self._param = param
        self._slot = slot
        self._fields = layout.fields(optimizer.param_groups, slot.group)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._fields or not self._layout.holds(self._param):
            raise KeyError(name)
        return self._layout.state.get((self._slot.label, *self._fields[name], *self._slot.key))

    def __setitem__(self, name: str, value: Any) -> None:
        self.update({name: value})

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Replaces the named entries together: all are checked before any is written."""
        values = dict(other, **kwargs)
        write_entries(self._layout, self._optimizer.param_groups, self._param, self._slot, values)

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        raise TypeError(
            f"the state of {dotted(self._slot.key)!r} holds all of {sorted(self._fields)} or none; assign {name!r} "
            "a new tensor, or forget them all with opt.state[p].clear()"
        )

    def clear(self) -> None:
        """Forgets every entry (as ``del opt.state[p]``): the parameter's next step makes them anew."""
        if self._layout.holds(self._param):
            self._layout.drop(self._optimizer.param_groups, [self._param])

    def __contains__(self, name: object) -> bool:
        return name in self._fields and self._layout.holds(self._param)

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields if self._layout.holds(self._param) else ())

    def __len__(self) -> int:
        return len(self._fields) if self._layout.holds(self._param) else 0

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def check_all_entries(layout: Layout, groups: Sequence[Mapping[str, Any]], slot: _groups.Slot, value: Any) -> None:
    """``value`` must be a parameter's whole state: a mapping of all of its group's entries."""
    expected = layout.fields(groups, slot.group)
    if not isinstance(value, Mapping) or set(value) != set(expected):
        given = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise ValueError(f"state of {dotted(slot.key)!r} must have {sorted(expected)}, got {given}")


def checked_entries(
    layout: Layout,
    groups: Sequence[Mapping[str, Any]],
    slot: _groups.Slot,
    values: Mapping[str, Any],
    like: Mapping[str, torch.Tensor] | None,
) -> dict[Key, Any]:
    """A parameter's entries (torch names -> tensors) by their keys in the functional state, each
    checked as a tensor (or a count) under one of its names; against the tensors of ``like`` (torch
    names -> tensors: its current or initial entries), or left to ``Layout.checked_state`` (``None``)."""
    fields = layout.fields(groups, slot.group)
    name = dotted(slot.key)
    checked: dict[Key, Any] = {}
    for torch_name, value in values.items():
        if torch_name not in fields:
            raise ValueError(f"state of {name!r} has no entry {torch_name!r}; its entries are {sorted(fields)}")
        if isinstance(value, bool) or not isinstance(value, torch.Tensor | int | float):
            raise TypeError(f"state[{name!r}][{torch_name!r}] must be a tensor, got {type(value).__name__}")
        if _groups.is_count(fields[torch_name]) and bool((torch.as_tensor(value) < 0).any()):
            raise ValueError(f"state[{name!r}][{torch_name!r}] must be a count >= 0, got {value!r}")
        key = (slot.label, *fields[torch_name], *slot.key)
        if like is None:
            checked[key] = torch.as_tensor(value)
            continue
        reference = TensorDict({key: like[torch_name]}, batch_size=[])
        checked[key] = _tree.laid_out_like(TensorDict({key: value}, batch_size=[]), reference, f"state[{name!r}]").get(
            key
        )
    return checked


def write_entries(
    layout: Layout,
    groups: Sequence[Mapping[str, Any]],
    param: torch.Tensor,
    slot: _groups.Slot,
    values: Mapping[str, Any] | Iterable[Any],
) -> None:
    """Replaces some of a parameter's entries (torch names -> tensors) after checking all of them;
    where it has no state, makes it, its other entries as its branch's ``init`` makes them now."""
    held = layout.holds(param)
    current = layout.entries(groups, param) if held else layout.initial_entries(groups, param)
    values = dict(values)
    checked = checked_entries(layout, groups, slot, values, current)
    if not held:
        fields = layout.fields(groups, slot.group)
        initial = {(slot.label, *fields[n], *slot.key): t for n, t in current.items() if n not in values}
        checked = {**initial, **checked}
    new_state = layout.state.clone(recurse=False)
    for key, tensor in checked.items():
        new_state.set(key, tensor)
    layout.state = new_state
