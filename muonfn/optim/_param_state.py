"""``opt.state``: torch's per-parameter view of the functional state."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from .. import _tree
from .._keys import dotted
from . import _groups
from ._layout import Layout


class ParamState(MutableMapping[Any, Any]):
    """``opt.state`` for torch code: per-parameter mappings holding the tensors of ``opt.functional_state``.

    ``opt.state[p]`` of a parameter is a :class:`ParamEntries`, live: it reads the current
    tensors and writes through to the functional state. Assigning ``opt.state[p] = {...}``
    replaces all of ``p``'s entries (checked as for ``functional_state``); deleting resets
    them to their initial values. Other keys (tensors the optimizer does not own, strings a
    hook stores) behave as in torch's ``defaultdict(dict)`` and travel through
    ``state_dict()`` as torch's do.
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
        expected = self._layout.fields(self._optimizer.param_groups, slot.group)
        if not isinstance(value, Mapping) or set(value) != set(expected):
            given = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(f"state of {dotted(slot.key)!r} must have {sorted(expected)}, got {given}")
        write_entries(self._layout, self._optimizer.param_groups, slot, value)

    def __delitem__(self, key: Any) -> None:
        slot = self._slot(key)
        if slot is None:
            del self.others[key]
            return
        groups = self._optimizer.param_groups
        write_entries(self._layout, groups, slot, self._layout.initial_entries(groups, key))

    # as a defaultdict's: only a lookup by ``[]`` makes an entry for a key that has none

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if self._slot(key) is not None else self.others.get(key, default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self[key] if self._slot(key) is not None else self.others.setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        """A parameter's entries as they were (then reset, as by ``del``); another key's value, as ``dict.pop``."""
        if self._slot(key) is None:
            return self.others.pop(key, *default)
        entries = dict(self[key])
        del self[key]
        return entries

    def clear(self) -> None:
        """Resets every parameter's entries (as ``del``) and drops the other keys."""
        for param in list(self._layout.slots):
            del self[param]
        self.others.clear()

    def popitem(self) -> tuple[Any, Any]:
        """The last other key and its value, removed; a parameter's entries are reset by ``del``,
        never removed, so a ``KeyError`` once only parameters are left (as from an empty dict)."""
        if not self.others:
            raise KeyError("popitem(): no keys other than parameters (del opt.state[p] resets p's entries)")
        return self.others.popitem()

    def _slot(self, key: Any) -> _groups.Slot | None:
        # only tensors are parameters; a dict lookup of another key could compare it to tensors
        return self._layout.slots.get(key) if isinstance(key, torch.Tensor) else None

    def __contains__(self, key: object) -> bool:
        return self._slot(key) is not None or key in self.others

    def __iter__(self) -> Iterator[Any]:
        yield from self._layout.slots
        yield from self.others

    def __len__(self) -> int:
        return len(self._layout.slots) + len(self.others)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


class ParamEntries(MutableMapping[str, Any]):
    """``opt.state[p]`` of a parameter: its entries under torch's names, read from and written to the functional state.

    The entries are fixed by the group (``momentum_buffer`` for a Muon group, and ``step`` with
    ``momentum_bias_correction``, with ``row_second_moment`` for a NorMuon group and
    ``exp_avg_sq`` (and its count) for an AdaMuon group; ``step``, ``exp_avg``, ``exp_avg_sq``
    for an AdamW group; see ``_groups.entries``): assigning one replaces its tensor after the checks
    of ``functional_state`` (shape and dtype), another name is an error, and ``clear()``
    resets them all as ``del opt.state[p]`` does.
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
        if name not in self._fields:
            raise KeyError(name)
        return self._layout.state.get((self._slot.label, *self._fields[name], *self._slot.key))

    def __setitem__(self, name: str, value: Any) -> None:
        self.update({name: value})

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Replaces the named entries together: all are checked before any is written."""
        values = dict(other, **kwargs)
        write_entries(self._layout, self._optimizer.param_groups, self._slot, values)

    def __delitem__(self, name: str) -> None:
        raise TypeError(
            f"the state of {dotted(self._slot.key)!r} always holds {sorted(self._fields)}; assign {name!r} "
            "a new tensor, or reset them all with opt.state[p].clear()"
        )

    def clear(self) -> None:
        """Resets every entry to its initial value (as ``del opt.state[p]``)."""
        groups = self._optimizer.param_groups
        write_entries(self._layout, groups, self._slot, self._layout.initial_entries(groups, self._param))

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def write_entries(
    layout: Layout,
    groups: Sequence[Mapping[str, Any]],
    slot: _groups.Slot,
    values: Mapping[str, Any] | Iterable[Any],
) -> None:
    """Replaces some of a parameter's entries (torch names -> tensors) after checking all of them."""
    fields = layout.fields(groups, slot.group)
    name = dotted(slot.key)
    state = layout.state
    checked = {}
    for torch_name, value in dict(values).items():
        if torch_name not in fields:
            raise ValueError(f"state of {name!r} has no entry {torch_name!r}; its entries are {sorted(fields)}")
        if isinstance(value, bool) or not isinstance(value, torch.Tensor | int | float):
            raise TypeError(f"state[{name!r}][{torch_name!r}] must be a tensor, got {type(value).__name__}")
        if _groups.is_count(fields[torch_name]) and bool((torch.as_tensor(value) < 0).any()):
            raise ValueError(f"state[{name!r}][{torch_name!r}] must be a count >= 0, got {value!r}")
        key = (slot.label, *fields[torch_name], *slot.key)
        checked[key] = _tree.laid_out_like(
            TensorDict({key: value}, batch_size=[]), state.select(key), f"state[{name!r}]"
        ).get(key)
    new_state = state.clone(recurse=False)
    for key, tensor in checked.items():
        new_state.set(key, tensor)
    layout.state = new_state
