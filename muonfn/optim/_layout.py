"""Where each parameter's state lives: its group, key and label, its group's entries, the functional state.

A parameter's state is made when it is first stepped, as torch.optim makes it: from the parameter
as it is then (its device and dtype), so that a model materialised or cast after the optimizer was
built, and parameters that never have a gradient (frozen ones), hold no state made too early.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _tree
from .._keys import Key, dotted
from ..transforms import EXP_AVG, MOMENTUM, Transform, partition
from . import _groups

#: A group's transform, built from its settings and its scheduled scalar tensors.
BranchOf = Callable[[Mapping[str, Any], Mapping[str, torch.Tensor]], Transform]
#: A new group's transform (its settings checked), given its index and its parameters' keys.
NewBranch = Callable[[int, Mapping[str, Any], Sequence[Key]], Transform]
Groups = Sequence[Mapping[str, Any]]

#: per route (``use_muon``), the field of the entry every parameter's state has in its parameter's
#: dtype: whether it is there tells whether the parameter has state, its device and dtype those of all of it
_TELLING_FIELD: dict[bool, _groups.Field] = {True: (MOMENTUM,), False: (EXP_AVG,)}
#: torch's name of that entry, per route
_TELLING_NAME = {True: "momentum_buffer", False: "exp_avg"}


class Snapshot(NamedTuple):
    """What a relayout changes, to undo it."""

    tree: TensorDictBase | None
    leaves: _tree.FlatState
    entry_names: list[_groups.Entries]
    version: int


class Removed(NamedTuple):
    """The state a parameter held in a group removed from ``param_groups``, as its group laid it out."""

    key: Key
    use_muon: bool
    entries: _groups.Entries
    tensors: dict[_groups.Field, torch.Tensor]


class Layout:
    """The state of an optimizer's parameters, and where each parameter's part of it lives.

    Every parameter has a ``Slot`` (its group, key and its group's label), fixed when its group
    is added, as is each group's route. Each group's state holds the entries its settings asked
    for when it was last laid out (``entry_names``); a group whose settings now ask for others is
    laid out anew by ``sync``. The groups are not held here: the optimizer passes its
    ``param_groups``, checked against the slots.

    The functional state holds the state of the parameters that have one, each with every entry its
    group's settings ask for, as the group's ``init`` of those parameters lays it out (a group whose
    parameters have none is its ``init`` of no parameters). A parameter's state is made at the first
    step that has its gradient (:meth:`with_state_of`), and forgotten by :meth:`drop`.

    The functional state lives as flat leaves between steps; its TensorDict is built when
    asked for (and is then what the next step reads, in case it was changed).
    """

    def __init__(self, branch: BranchOf) -> None:
        self._branch = branch
        self._tree: TensorDictBase | None = None
        self._leaves: _tree.FlatState = {}
        self.slots: dict[torch.Tensor, _groups.Slot] = {}
        #: per group, the entries the state holds (a changed variant or bias correction is laid out
        #: anew before it is used)
        self.entry_names: list[_groups.Entries] = []
        self.routes: list[bool] = []  # per group, its use_muon when it was added
        self.members: list[tuple[torch.Tensor, ...]] = []  # per group, its params as last checked
        #: counts the relayouts: a transform built at another version may be built for other entries
        self.version = 0
        #: ``slots`` and the :meth:`state_key` of each of its slots, in order (built again for other slots)
        self._state_keys: tuple[dict[torch.Tensor, _groups.Slot], list[Key]] | None = None
        #: the state of the parameters of groups removed from param_groups, until the next step: a
        #: parameter added again continues with it, as torch's (kept by tensor in its state) does
        self.removed: dict[torch.Tensor, Removed] = {}

    # ------------------------------------------------------------------ the functional state

    @property
    def state(self) -> TensorDictBase:
        """The functional state, as laid out when last synced."""
        if self._tree is None:
            self._tree = _tree.unflatten(self._leaves, torch.Size([]))
        return self._tree

    @state.setter
    def state(self, state: TensorDictBase) -> None:
        self._tree, self._leaves = state, {}

    def leaves(self) -> _tree.FlatState:
        """The functional state's leaves, as a step reads them."""
        return self._leaves if self._tree is None else _tree.flatten(self._tree, keep_empty=True)

    def stepped(self, leaves: _tree.FlatState) -> None:
        """Takes a step's new leaves as the state."""
        self._leaves, self._tree = leaves, None

    def snapshot(self) -> Snapshot:
        return Snapshot(self._tree, self._leaves, self.entry_names, self.version)

    def restore(self, snapshot: Snapshot) -> None:
        self._tree, self._leaves, self.entry_names, self.version = snapshot

    def __getstate__(self) -> dict[str, Any]:
        # the state travels as its TensorDict only, so that a copy's two forms cannot differ
        return {**self.__dict__, "_tree": self.state, "_leaves": {}, "_state_keys": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (pickled before these were kept: none cached, no group removed)
        self.__dict__.update({"_state_keys": None, "removed": {}, **state})

    # ------------------------------------------------------------------ which parameters have state

    @staticmethod
    def state_key(slot: _groups.Slot) -> Key:
        """The key of the entry that tells whether a parameter has state (its momentum, AdamW's
        ``exp_avg``): every parameter's state has it, in its parameter's dtype."""
        return (slot.label, *_TELLING_FIELD[slot.use_muon], *slot.key)

    def state_keys(self) -> list[Key]:
        """:meth:`state_key` of every slot, in the order of ``slots``."""
        cached = self._state_keys
        if cached is None or cached[0] is not self.slots or len(cached[1]) != len(self.slots):
            cached = self._state_keys = (self.slots, [self.state_key(slot) for slot in self.slots.values()])
        return cached[1]

    def holds(self, p: torch.Tensor) -> bool:
        """Whether the parameter ``p`` has state (it has been stepped, or its state was given)."""
        key = self.state_key(self.slots[p])
        return key in self._leaves if self._tree is None else self._tree.get(key, None) is not None

    def held(self) -> list[torch.Tensor]:
        """The parameters that have state, in the order of ``slots``."""
        return [p for p in self.slots if self.holds(p)]

    def stale_state_error(self, p: torch.Tensor, held: torch.Tensor) -> ValueError:
        """The error for a parameter moved or cast after its state was made (``held``: its
        :meth:`state_key` entry), naming both devices or dtypes and the remedies."""
        slot = self.slots[p]
        name = f"the state of parameter {dotted(slot.key)!r} ({_TELLING_NAME[slot.use_muon]})"
        drop = "drop it with del opt.state[p] (opt.state.clear() for every parameter): the next step makes it anew"
        if held.device != p.device:
            found = f"{name} is on {held.device}, the parameter on {p.device} (moved after its state was made)"
            if held.is_meta:
                return ValueError(f"{found}; a state on meta holds no values: {drop} on the parameter's device")
            cast = "move it with opt.load_state_dict(opt.state_dict())"
        else:
            found = f"{name} is {held.dtype}, the parameter {p.dtype} (cast after its state was made)"
            cast = "cast it with opt.load_state_dict(opt.state_dict())"
        return ValueError(
            f"{found}; {cast}, which casts every state tensor to its parameter's device and dtype, or {drop}"
        )

    def stale_dtype(self, params: Sequence[torch.Tensor], leaves: _tree.FlatState) -> ValueError | None:
        """The error for the first of ``params`` whose state (in ``leaves``) is of another dtype than
        the parameter now (cast after its state was made); ``None`` if none is."""
        for p in params:
            held = leaves.get(self.state_key(self.slots[p]))
            if held is not None and held.dtype != p.dtype:
                return self.stale_state_error(p, held)
        return None

    def with_state_of(self, groups: Groups, params: Sequence[torch.Tensor], leaves: _tree.FlatState) -> _tree.FlatState:
        """``leaves`` with the state of ``params`` (which have none) added, in a new dict: as their
        groups' ``init`` makes it from them now, on their devices and in their dtypes."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_group.setdefault(self.slots[p].group, []).append(p)
        new: _tree.FlatState = {}
        for i, members in by_group.items():
            group, label = groups[i], self.slots[members[0]].label
            made = self._init(group, TensorDict({self.slots[p].key: p.detach() for p in members}, batch_size=[]))
            new.update({(label, *key): value for key, value in _tree.flatten(made).items()})
        return self._regrouped(groups, leaves, new=new)

    def drop(self, groups: Groups, params: Sequence[torch.Tensor]) -> None:
        """Forgets the state of ``params``: each is made anew at its parameter's next step."""
        self.sync(groups)  # (the entries to drop are those of the groups' settings)
        dropped: set[Key] = set()
        for p in params:
            slot = self.slots[p]
            dropped.update((slot.label, *field, *slot.key) for field in self.entry_names[slot.group].fields.values())
        self.stepped(self._regrouped(groups, self.leaves(), dropped=dropped))

    def forget(self) -> None:
        """Forgets every parameter's state, and that of :attr:`removed` (each made anew at its next
        step): each group's state holds its entries as it laid them out, for no parameter (its
        ``init`` of no parameters), whatever ``param_groups`` were edited to since (emptied, say,
        to be rebuilt by ``add_param_group``)."""
        labels = _groups.group_labels(self.routes)
        empty: dict[Key, TensorDictBase] = {
            (label, *field): TensorDict({}, batch_size=[])
            for label, names in zip(labels, self.entry_names)
            for field in names.fields.values()
        }
        self.state = TensorDict(empty, batch_size=[])
        self.removed = {}

    def _regrouped(
        self,
        groups: Groups,
        leaves: _tree.FlatState,
        *,
        new: _tree.FlatState | None = None,
        dropped: Collection[Key] = (),
    ) -> _tree.FlatState:
        """The flat state holding the tensors of ``leaves`` but ``dropped``, and ``new``, each group's
        after the previous group's; a group left with none is its ``init`` of no parameters."""
        by_label: dict[str, _tree.FlatState] = {}
        for key, value in leaves.items():
            if isinstance(value, torch.Tensor) and key not in dropped:
                by_label.setdefault(key[0], {})[key] = value
        for key, value in (new or {}).items():
            by_label.setdefault(key[0], {})[key] = value
        out: _tree.FlatState = {}
        for label, group in zip(_groups.group_labels([g["use_muon"] for g in groups]), groups):
            held = by_label.get(label)
            if held:
                out.update(held)
            else:
                out[(label,)] = self._init(group, TensorDict({}, batch_size=[]))
        return out

    def _init(self, group: Mapping[str, Any], params: TensorDictBase) -> TensorDictBase:
        """A group's state of ``params``, as its branch's ``init`` makes it."""
        return self._branch(group, _groups.new_scalars(group)).init(params)

    @classmethod
    def unpickled(cls, branch: BranchOf, attributes: dict[str, Any]) -> Layout:
        """The layout of an optimizer pickled when it held these as attributes of its own (popped)."""
        layout = cls(branch)
        layout.stepped(attributes.pop("_state_leaves", {}))
        tree = attributes.pop("_state_tree", None)
        if tree is not None:
            layout.state = tree
        layout.slots = attributes.pop("_slots")
        layout.entry_names = attributes.pop("_entry_names")
        if "_routes" in attributes:
            layout.routes = attributes.pop("_routes")
            layout.members = attributes.pop("_members")
        else:  # (pickled before routes were kept: a Muon group's scalars hold its momentum)
            layout.routes = ["momentum" in scalars for scalars in attributes["_scalars"]]
            layout.members = []  # checked in full at the next step
        return layout

    # ------------------------------------------------------------------ the groups

    def follows(self, groups: Groups) -> bool:
        """Whether ``groups`` are the groups as added, which :meth:`check_groups` accepts."""
        try:
            self.check_groups(groups)
        except ValueError:
            return False
        return True

    def check_groups(self, groups: Groups) -> None:
        """The groups, their parameters and their ``use_muon`` are fixed when a group is added (its
        parameters' keys, labels and state are laid out for them): an edit in ``param_groups`` is
        refused, naming the group (and the parameter)."""
        if len(groups) != len(self.members) or not all(map(_holds, groups, self.members)):
            _groups.check_members(groups, self.slots, len(self.routes))
            self.members = [tuple(g["params"]) for g in groups]  # (a tensor's hash runs Python: checked once)
        for i, (group, route) in enumerate(zip(groups, self.routes)):
            if bool(group.get("use_muon")) != route:
                raise ValueError(
                    f"param group {i}: use_muon was {route} when the group was added and cannot change; "
                    "set it back, or add the parameters to a new optimizer"
                )

    def follow_removals(self, groups: Groups) -> list[int] | None:
        """Lays the state out for ``groups`` where they are the added groups with some removed
        (``opt.param_groups = []``, ``del opt.param_groups[i]``), in their order; returns the
        index each kept group was added at. ``None`` (nothing changed) where no group was
        removed, or ``groups`` were edited otherwise (which :meth:`check_groups` names).

        The removed groups' parameters leave the optimizer; the state of those that have one is
        kept in :attr:`removed` until the next step, for :meth:`add` to carry over.
        """
        kept: list[int] = []
        for group in groups:
            params = group["params"]
            start = kept[-1] + 1 if kept else 0
            added = next(
                (
                    j
                    for j in range(start, len(self.members))
                    if self.routes[j] == group.get("use_muon")
                    and len(self.members[j]) == len(params)
                    and set(self.members[j]) == set(params)
                ),
                None,
            )
            if added is None:
                return None
            kept.append(added)
        if len(kept) == len(self.members):
            return None
        labels = _groups.group_labels(self.routes)
        state = self.state
        removed = dict(self.removed)
        for j in sorted(set(range(len(self.members))) - set(kept)):
            for p in filter(self.holds, self.members[j]):
                key = self.slots[p].key
                tensors = {field: state.get((labels[j], *field, *key)) for field in self.entry_names[j].fields.values()}
                removed[p] = Removed(key, self.routes[j], self.entry_names[j], tensors)
        routes = [self.routes[j] for j in kept]
        relabelled = state.empty()
        for j, label in zip(kept, _groups.group_labels(routes)):
            if labels[j] in state:
                relabelled[label] = state.get(labels[j])
        self.slots = _groups.index_slots(groups, {p: self.slots[p].key for j in kept for p in self.members[j]})
        self.entry_names = [self.entry_names[j] for j in kept]
        self.routes = routes
        self.members = [self.members[j] for j in kept]
        self.removed = removed
        self.state = relabelled
        self.version += 1
        return kept

    def add(self, groups: Groups, new_groups: Groups, new_keys: Mapping[torch.Tensor, Key], branch: NewBranch) -> None:
        """Lays out ``new_groups``, to follow ``groups``, their parameters keyed by ``new_keys``, each
        group built by its ``branch``. Their parameters have no state yet, but those of
        :attr:`removed` that their new group lays out alike (its route and entries, their shapes,
        dtypes and devices), which continue with theirs; the branch's ``init`` runs on stand-ins on
        the meta device for its checks, and to lay out theirs. Nothing changes unless all succeed."""
        everything = [*groups, *new_groups]
        slots = _groups.index_slots(everything, {**{p: s.key for p, s in self.slots.items()}, **new_keys})
        labels = _groups.group_labels([g["use_muon"] for g in everything])
        state = self.state.clone(recurse=False)
        for i in range(len(groups), len(everything)):
            group = everything[i]
            keys = [slots[p].key for p in group["params"]]
            init = branch(i, group, keys).init
            stand_ins = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in group["params"]]
            laid_out = init(TensorDict(dict(zip(keys, stand_ins)), batch_size=[]))
            state[labels[i]] = init(TensorDict({}, batch_size=[]))
            self._carry(state, labels[i], group, keys, laid_out)
        self.removed = {p: held for p, held in self.removed.items() if p not in slots}  # (started anew or carried)
        self.entry_names = [*self.entry_names, *(_groups.entries(g) for g in new_groups)]
        self.routes = [*self.routes, *(g["use_muon"] for g in new_groups)]
        self.members = [*self.members, *(tuple(g["params"]) for g in new_groups)]
        self.slots = slots
        self.state = state

    def _carry(
        self,
        state: TensorDictBase,
        label: str,
        group: Mapping[str, Any],
        keys: Sequence[Key],
        laid_out: TensorDictBase,
    ) -> None:
        """Writes the :attr:`removed` state of ``group``'s parameters into its new state under
        ``label`` where the group lays it out alike: the same route and entries, and each tensor
        of the shape and dtype of ``laid_out`` (its ``init`` of stand-ins) and on the parameter's
        device. The others have no state (made at their next step)."""
        entries = _groups.entries(group)
        for p, key in zip(group["params"], keys):
            held = self.removed.get(p)
            if held is None or held.use_muon != group["use_muon"] or held.entries != entries:
                continue
            if all(_alike(t, laid_out.get((*field, *key)), p.device) for field, t in held.tensors.items()):
                for field, t in held.tensors.items():
                    state[(label, *field, *key)] = t

    def forget_removed(self) -> None:
        """Frees the state of parameters no longer in any group (at a step)."""
        self.removed = {}

    def load(self, groups: Groups, state: TensorDictBase) -> None:
        """Takes ``state``, checked against :meth:`structure`, as laid out for ``groups``' settings:
        the whole state, as torch's ``load_state_dict`` takes it (:attr:`removed` is forgotten)."""
        self.state = state
        self.entry_names = [_groups.entries(g) for g in groups]
        self.removed = {}

    def sync(self, groups: Groups) -> None:
        """Lays out anew the state of every group whose settings now ask for other entries (its
        variant, ``momentum_bias_correction`` or AdaMuon's ``second_moment_bias_correction`` was
        changed in ``param_groups``).

        The entries both layouts keep are carried over (the momentum, the second moment, with
        their step counts), unless their bias correction starts now (``_groups.carried_fields``);
        the others start as the branch's ``init`` makes them (for the parameters that have state);
        the dropped ones go. Nothing changes unless all succeed.
        """
        self.check_groups(groups)
        for i, group in enumerate(groups):
            if group["use_muon"]:
                _groups.check_variant(f"param group {i}", group["variant"])
        wanted = [_groups.entries(g) for g in groups]
        if wanted == self.entry_names:
            return
        labels = _groups.group_labels([g["use_muon"] for g in groups])
        state = self.state.clone(recurse=False)
        for label, group, names, held in zip(labels, groups, wanted, self.entry_names):
            if names == held:
                continue
            members = [p for p in group["params"] if self.holds(p)]
            fresh = self._init(group, TensorDict({self.slots[p].key: p.detach() for p in members}, batch_size=[]))
            for field, held_field in _groups.carried_fields(held, names).items():
                fresh[field] = state[(label, *held_field)]
            state[label] = fresh
        self.state = state
        self.entry_names = wanted
        self.version += 1

    # ------------------------------------------------------------------ reading it

    def fields(self, groups: Groups, group_index: int) -> dict[str, _groups.Field]:
        """The state entries of a group (torch's name -> field), its state laid out for its settings first."""
        self.sync(groups)
        return self.entry_names[group_index].fields

    def entries(self, groups: Groups, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``p``'s current state under torch's names (none while it has no state), its group's state
        laid out for its settings first."""
        self.sync(groups)
        return self.laid_out_entries(p)

    def laid_out_entries(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``p``'s current state under torch's names, as its group's state is laid out now (none
        while it has no state)."""
        if not self.holds(p):
            return {}
        slot = self.slots[p]
        state = self.state
        return {
            name: state.get((slot.label, *field, *slot.key))
            for name, field in self.entry_names[slot.group].fields.items()
        }

    def initial_entries(self, groups: Groups, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``p``'s state as its branch's ``init`` makes it now, under torch's names."""
        slot = self.slots[p]
        names = self.fields(groups, slot.group)
        fresh = self._init(groups[slot.group], TensorDict({slot.key: p.detach()}, batch_size=[]))
        return {name: fresh.get((*field, *slot.key)) for name, field in names.items()}

    def params(self, device: str | torch.device | None = None) -> TensorDict:
        """The parameters by key (empty tensors on ``device`` if given)."""
        keys, values = [], []
        for p, slot in self.slots.items():
            keys.append(slot.key)
            values.append(p.detach() if device is None else torch.empty_like(p, device=device))
        return TensorDict(dict(zip(keys, values)), batch_size=[])

    def transform(self, groups: Groups, scalars: Sequence[Mapping[str, torch.Tensor]]) -> Transform:
        """``partition`` over the groups' branches, each parameter labelled by its group."""
        labels = _groups.group_labels([g["use_muon"] for g in groups])
        branches = {label: self._branch(g, s) for label, g, s in zip(labels, groups, scalars)}
        return partition(branches, {slot.key: slot.label for slot in self.slots.values()})

    def structure(self, groups: Groups, held: Collection[Key] | None = None) -> TensorDictBase:
        """The functional state's structure where the parameters keyed ``held`` (all: ``None``) have
        state: expanded one-element tensors of each leaf's shape, dtype and device."""
        labels = _groups.group_labels([g["use_muon"] for g in groups])
        members = [[p for p in g["params"] if held is None or self.slots[p].key in held] for g in groups]
        meta = TensorDict(
            {
                label: self._init(
                    group,
                    TensorDict({self.slots[p].key: torch.empty_like(p, device="meta") for p in ps}, batch_size=[]),
                )
                for label, group, ps in zip(labels, groups, members)
            },
            batch_size=[],
        )
        structure = meta.empty(recurse=True)
        for group, ps in zip(groups, members):
            for p in ps:
                # state leaves are keyed (label, *field, *parameter key)
                slot = self.slots[p]
                for field in _groups.state_names(group).values():
                    key = (slot.label, *field, *slot.key)
                    t = meta.get(key)
                    structure.set(key, torch.empty((), dtype=t.dtype, device=p.device).expand(t.shape))
        return structure

    def checked_state(self, groups: Groups, state: TensorDictBase | Mapping[str, Any], where: str) -> TensorDict:
        """``state`` laid out as expected, on its parameters' devices; else an error naming the first difference.

        A parameter has state where ``state`` holds any of its entries, and must then have all of
        them (those of its group's settings); one with none has no state, made at its next step.
        """
        if not isinstance(state, TensorDictBase):
            state = TensorDict(dict(state), batch_size=[])
        if state.batch_size != torch.Size([]):
            raise ValueError(f"{where}: batch size {tuple(state.batch_size)}, expected ()")
        given = set(_tree.leaf_keys(state))
        fields = [list(_groups.state_names(g).values()) for g in groups]
        held = set()
        for slot in self.slots.values():
            keys = [(slot.label, *field, *slot.key) for field in fields[slot.group]]
            missing = [key for key in keys if key not in given]
            if len(missing) == len(keys):
                continue
            if missing:
                raise ValueError(
                    f"{where}: missing {dotted(missing[0])!r} of parameter {dotted(slot.key)!r}, which has "
                    f"{[dotted(k) for k in keys if k in given]}: a parameter's state holds every entry of its "
                    "group, or none (then it is made at the parameter's next step)"
                )
            held.add(slot.key)
        return _tree.laid_out_like(state, self.structure(groups, held), where)


def _alike(t: torch.Tensor, like: torch.Tensor, device: torch.device) -> bool:
    return (t.shape, t.dtype, t.device) == (like.shape, like.dtype, device)


def _holds(group: Mapping[str, Any], members: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``group`` holds the tensors ``members``, in order (by identity: ``==`` of tensors compares values)."""
    params = group["params"]
    return len(params) == len(members) and all(map(operator.is_, params, members))
