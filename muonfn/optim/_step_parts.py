"""The shim's step after its checks: every part's update added to its parameters, eagerly or compiled."""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._keys import Key
from .._tree import FlatState, Leaves
from ..transforms import Rule, run_checked

if TYPE_CHECKING:
    from ..distributed import Collectives

#: structures (which parameters have gradients, and the parts) one optimizer compiles; a step of
#: another structure after that many runs eagerly
MAX_COMPILED_STRUCTURES = 8


class StepInputs(NamedTuple):
    """A step's inputs, checked: the gradients under ``keys`` go to the parameters ``targets``
    (``params``: every parameter by key), in ``parts`` (lists of indices into ``keys``)."""

    rule: Rule
    parts: list[list[int]]
    keys: list[Key]
    targets: list[torch.Tensor]
    grads: list[torch.Tensor]
    params: Leaves


PartsApplier = Callable[[StepInputs, FlatState], FlatState]


def apply_parts(step: StepInputs, state: FlatState) -> FlatState:
    """Each part's update, added to its parameters before the next part is computed; the state after the last."""
    rule, keys, targets, grads = step.rule, step.keys, step.targets, step.grads
    for part in step.parts:
        # (a part's updates are freed when its call returns, before the next part computes its own)
        state = _apply_part(
            rule, [keys[i] for i in part], [targets[i] for i in part], [grads[i] for i in part], state, step.params
        )
    return state


def _apply_part(
    rule: Rule,
    keys: list[Key],
    targets: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: FlatState,
    params: Leaves,
) -> FlatState:
    updates, state = run_checked(rule, dict(zip(keys, grads)), state, params, torch.Size([]))
    torch._foreach_add_(targets, [updates[k] for k in keys])
    return state


def parts_applier(compile: bool | Mapping[str, Any], collectives: Collectives | None) -> PartsApplier:
    """:func:`apply_parts`, or a :class:`CompiledParts` as ``compile`` asks (checked here)."""
    if not isinstance(compile, bool | Mapping):
        raise TypeError(f"Muon(compile=...) takes a bool or a mapping of torch.compile's keywords, got {compile!r}")
    if isinstance(compile, Mapping):
        known = set(inspect.signature(torch.compile).parameters) - {"model"}
        unknown = sorted(set(compile) - known)
        if unknown:
            raise TypeError(
                f"Muon(compile=...): torch.compile has no keyword {', '.join(map(repr, unknown))}; "
                f"its keywords are {sorted(known)}"
            )
    if compile is False:
        return apply_parts
    if collectives is not None:
        raise ValueError(
            "Muon(compile=...): the sharded step exchanges data between ranks in Python and cannot be "
            "compiled; leave compile off with collectives"
        )
    return CompiledParts({"fullgraph": True, **(compile if isinstance(compile, Mapping) else {})})


class CompiledParts:
    """:func:`apply_parts` compiled once per structure: the rule, which parameters have
    gradients and the parts.

    Each structure gets a function of its own (a copy of :func:`apply_parts` with its own code
    object, which is what ``torch.compile`` keys its graphs and its recompilation limit on), so
    that structures, and optimizers in one process, do not use up each other's recompilations.
    A rebuilt rule drops the graphs of the old one. Past :data:`MAX_COMPILED_STRUCTURES`, a step
    of a new structure runs eagerly (the same arithmetic), with one warning.
    """

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.rule: Rule | None = None
        self.compiled: dict[tuple[Any, ...], PartsApplier] = {}
        self.warned = False

    def __call__(self, step: StepInputs, state: FlatState) -> FlatState:
        if step.rule is not self.rule:
            self.rule, self.compiled = step.rule, {}
        structure = (tuple(step.keys), tuple(map(tuple, step.parts)))
        applier = self.compiled.get(structure)
        if applier is None and len(self.compiled) < MAX_COMPILED_STRUCTURES:
            applier = self.compiled[structure] = torch.compile(_copy_of_apply_parts(), **self.options)
        if applier is None:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"Muon(compile=...): {MAX_COMPILED_STRUCTURES} structures (sets of parameters with "
                    "gradients) are compiled; steps of other structures run eagerly",
                    stacklevel=4,
                )
            applier = apply_parts
        return applier(step, state)


def _copy_of_apply_parts() -> PartsApplier:
    return types.FunctionType(apply_parts.__code__.replace(), apply_parts.__globals__, apply_parts.__name__)
