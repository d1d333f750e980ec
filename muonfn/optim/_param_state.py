"""``opt.state``: torch's per-parameter view of the functional state."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from .. import _tree
from .._keys import dotted
from . import _groups

if TYPE_CHECKING:
    from ._optimizer import Muon


class ParamState(MutableMapping[torch.Tensor, dict[str, Any]]):
    """``opt.state`` for torch code: per-parameter dicts holding the tensors of ``opt.functional_state``.

    Assigning ``opt.state[p] = {...}`` replaces ``p``'s entries (checked as for
    ``functional_state``); deleting resets them to their initial values. Tensors the
    optimizer does not own behave as in a ``defaultdict(dict)``.
    """

    def __init__(self, optimizer: Muon) -> None:
        self._optimizer = optimizer
        self._others: dict[Any, Any] = {}

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        slot = self._optimizer._slots.get(p)
        if slot is None:
            return self._others.setdefault(p, {})
        state = self._optimizer._functional_state
        return {
            name: state.get((slot.label, field, *slot.key))
            for name, field in _groups.state_names(slot.use_muon).items()
        }

    def __setitem__(self, p: torch.Tensor, value: dict[str, Any]) -> None:
        slot = self._optimizer._slots.get(p)
        if slot is None:
            self._others[p] = value
            return
        expected = _groups.state_names(slot.use_muon)
        if set(value) != set(expected):
            raise ValueError(f"state of {dotted(slot.key)!r} must have {sorted(expected)}, got {sorted(value)}")
        state = self._optimizer._functional_state
        entries = {}
        for name, field in expected.items():
            key = (slot.label, field, *slot.key)
            entries[key] = _tree.laid_out_like(
                TensorDict({key: value[name]}, batch_size=[]), state.select(key), f"state[{dotted(slot.key)!r}]"
            ).get(key)
        new_state = state.clone(recurse=False)
        for key, tensor in entries.items():
            new_state.set(key, tensor)
        self._optimizer._functional_state = new_state

    def __delitem__(self, p: torch.Tensor) -> None:
        slot = self._optimizer._slots.get(p)
        if slot is None:
            del self._others[p]
            return
        optimizer = self._optimizer
        group = optimizer.param_groups[slot.group]
        fresh = optimizer._branch(group, _groups.new_scalars(group)).init(
            TensorDict({slot.key: p.detach()}, batch_size=[])
        )
        self[p] = {name: fresh.get((field, *slot.key)) for name, field in _groups.state_names(slot.use_muon).items()}

    def __contains__(self, p: object) -> bool:
        return p in self._optimizer._slots or p in self._others

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from self._optimizer._slots
        yield from self._others

    def __len__(self) -> int:
        return len(self._optimizer._slots) + len(self._others)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"
