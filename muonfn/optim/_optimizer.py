"""The ``torch.optim.Optimizer`` shim: each param group translated into a preset's branch, the state kept
as torch keeps it (``opt.state[p]``: plain dicts under torch's names, made at a parameter's first
gradient) and handed to ``Transform.update`` as a TensorDict."""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import math
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter
from typing import Any, Literal, NamedTuple

import torch
from tensordict import TensorDictBase

from .. import transforms
from .._tree import build
from .._validation import Scalar, flag, positive, unit_interval
from ..linalg import Orthogonalizer
from ..presets import MUON, VARIANT_OPTIONS, check_names, default_labels, matrix_branch
from ..steps import AdamNesterov, NesterovLike, Rescale, ViewsLike, adamw, check_state_dtype, is_schedule
from ..transforms import CautiousMode, LabelsLike, MaskLike, Transform, check_input
from . import _groups, _migration, _routing
from ._groups import ADAMW_SETTINGS, MUON_SETTINGS, NS_ENTRIES, SCHEDULED, SHAPING

#: ``chunk_numel="auto"``: about this many parts, each of at least ``AUTO_MIN_CHUNK`` elements
AUTO_PARTS, AUTO_MIN_CHUNK = 10, 2**18
#: The structures of a step one optimizer compiles; a step of another runs eagerly
MAX_COMPILED_STRUCTURES = 8
SIZE = torch.Size([])


class Branch(NamedTuple):
    """A group's branch, built from its settings (``signature``): its 0-d scheduled tensors, refilled
    before a step where their value (``filled``, the one they hold) changed, and the entries of its
    parameters' state (``layout``, by ``shaping`` settings)."""

    group: dict[str, Any]
    signature: tuple[Any, ...]
    tx: Transform
    scalars: dict[str, torch.Tensor]
    filled: dict[str, float]
    shaping: dict[str, Any]
    layout: dict[str, tuple[str, ...]]


class Muon(torch.optim.Optimizer):
    r"""Muon (or NorMuon, AdaMuon) for matrices and AdamW for the rest, as a ``torch.optim.Optimizer``.

    It takes torch.optim.Muon's keywords with their meaning (``ns_coefficients`` one ``(a, b, c)`` for
    each of ``ns_steps``, or a schedule; ``eps``, Newton–Schulz's; ``adjust_lr_fn``: ``None`` or
    ``"original"``, ``"match_rms_adamw"``, and muonfn's other scale modes) and :func:`muonfn.muon`'s others.
    See :mod:`muonfn.optim` for how groups and state are laid out.

    Args:
        params: ``model.named_parameters()`` (names drive ``labels``), tensors, or param-group dicts.
            A dict may set any group setting, ``"use_muon": True/False`` to route the whole group, or,
            leaving routing to ``labels``, the ``adamw_*`` keywords for its AdamW half.
        lr, weight_decay, momentum, nesterov: as torch.optim.Muon's (``None``: the variant's default:
            0.95 and ``True`` for Muon and NorMuon, 0.9 and ``False`` for AdaMuon).
        variant: the Muon groups' rule: ``"muon"``, ``"normuon"`` or ``"adamuon"`` (:func:`muonfn.normuon`,
            :func:`muonfn.adamuon`); ``beta2``, ``adaptive_eps``, ``rescale``, ``sign_momentum`` and
            ``second_moment_bias_correction`` are their options (``None``: the variant's default).
        ns: Newton–Schulz beyond torch's spellings: a :class:`~muonfn.NewtonSchulz` (its ``dtype``,
            ``method``, ``eps_mode``, ``restarts``), ``"svd"``, ``"qr"``, or a map of one's own.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, adamw_nesterov: the AdamW groups'
            ``lr``, ``(momentum, beta2)``, ``eps``, ``weight_decay``, ``nesterov`` (``None``: the Muon value).
        state_dtype: the momentum's and AdamW's moments' dtype, as :func:`muonfn.muon`'s, per group
            (``None``: the parameters'); a state of another dtype (loaded, or held when a group's changes)
            is cast to it at the next step, to bf16 rounded to nearest.
        labels, views, weight_decay_mask, orthogonalizer: as :func:`muonfn.muon`'s, given once.
        donate_state: the state is updated in place (``True``), as torch.optim's is.
        chunk_numel: step the parameters in parts of at most this many elements, each part's update
            added before the next is computed (the step's temporaries hold one part); ``"auto"``: a
            tenth of the parameters, at least 2**18; ``None``: one part.
        compile: run the step's arithmetic as one ``torch.compile(fullgraph=True)`` graph (a mapping:
            ``torch.compile``'s keywords), compiled anew only when its structure changes.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = muonfn.optim.Muon(model.named_parameters(), lr=1e-3)
        >>> [(g["use_muon"], g["param_names"]) for g in opt.param_groups]
        [(True, ['0.weight', '1.weight']), (False, ['0.bias', '1.bias'])]
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        *,
        weight_decay: Scalar = 0.1,
        momentum: Scalar | None = None,
        nesterov: NesterovLike | None = None,
        ns_coefficients: Any = "keller",
        eps: float = 1e-7,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = "match_rms_adamw",
        variant: str = "muon",
        beta2: Scalar | None = None,
        adaptive_eps: float | None = None,
        rescale: Rescale | None = None,
        sign_momentum: bool | None = None,
        second_moment_bias_correction: bool | None = None,
        momentum_bias_correction: bool = False,
        cautious_weight_decay: bool = False,
        cautious_mode: CautiousMode | None = None,
        ns: Any = None,
        extra_scale: float = 1.0,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: Scalar | None = None,
        adamw_nesterov: AdamNesterov = False,
        state_dtype: torch.dtype | None = None,
        labels: LabelsLike | None = None,
        views: ViewsLike = None,
        weight_decay_mask: MaskLike = None,
        orthogonalizer: Orthogonalizer | None = None,
        donate_state: bool = True,
        chunk_numel: int | Literal["auto"] | None = "auto",
        compile: bool | Mapping[str, Any] = False,
    ) -> None:
        given = dict(locals())  # (the keywords as given: a Muon group's settings are named as they are)
        where = "Muon(...)"
        for name, value in (("lr", lr), ("adamw_lr", adamw_lr)):
            if is_schedule(value):
                raise TypeError(f"{where}: {name} takes a number; schedule it with torch.optim.lr_scheduler")
        flag(f"{where}: donate_state", donate_state)
        if labels is not None:
            transforms.check_table(f"{where}: labels", labels)
        transforms.check_mask(f"{where}: weight_decay_mask", weight_decay_mask)
        if chunk_numel not in (None, "auto") and (
            isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1
        ):
            raise ValueError(f"chunk_numel must be a positive int, 'auto' or None, got {chunk_numel!r}")
        if not isinstance(compile, bool | Mapping):
            raise TypeError(f"Muon(compile=...) takes a bool or a mapping of torch.compile's keywords, got {compile!r}")
        known = sorted(set(inspect.signature(torch.compile).parameters) - {"model"})
        unknown = [k for k in compile if k not in known] if isinstance(compile, Mapping) else []
        if unknown:
            raise TypeError(f"Muon(compile=...): torch.compile has no keyword {unknown[0]!r}; its keywords are {known}")
        if compile and getattr(orthogonalizer, "sum_shards", None) is not None:
            raise ValueError(
                "Muon(compile=...): a sharded orthogonalizer exchanges data between ranks in Python, which cannot "
                "be compiled; leave compile off with it"
            )
        if not (isinstance(adamw_betas, tuple | list) and len(adamw_betas) == 2):
            raise ValueError(f"adamw_betas must be a pair (beta1, beta2), got {adamw_betas!r}")
        unit_interval("adamw_betas[1]", adamw_betas[1])
        positive("adamw_eps", adamw_eps)
        self._labels, self._views, self._mask, self._orthogonalizer = labels, views, weight_decay_mask, orthogonalizer
        self._donate, self._chunk_numel, self._compile = donate_state, chunk_numel, compile
        settings = {k: v for k, v in given.items() if k in MUON_SETTINGS}  # (the keywords of the same name)
        ns_settings = _groups.ns_entries(where, ns, settings)
        muon_defaults = {**settings, **ns_settings, "adjust_lr_fn": adjust_lr_fn or "original"}
        adamw_defaults = {
            "lr": lr if adamw_lr is None else adamw_lr,
            "momentum": adamw_betas[0],
            "beta2": adamw_betas[1],
            "eps": adamw_eps,
            "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            "nesterov": adamw_nesterov,
            "cautious_weight_decay": cautious_weight_decay,
            "state_dtype": state_dtype,
        }
        split = {"adamw_lr": adamw_lr, "adamw_weight_decay": adamw_weight_decay}
        self._constructor = _groups.Constructor(muon_defaults, adamw_defaults, split)
        self._branches: dict[int, Branch] = {}  # (by the group's identity)
        self._compiled: dict[Any, Callable[..., Any]] = {}
        self._keys: dict[torch.Tensor, str] = {}  # (a parameter given without a name: its position among them)
        self._warned_compiled = self._warned_unnamed = False
        super().__init__(params, muon_defaults)
        # the tables' names checked against every parameter's, as muonfn.muon(...).init checks them
        leaves = {n: _meta(p) for g, ns in zip(self.param_groups, self._names()) for n, p in zip(ns, g["params"])}
        shards = getattr(orthogonalizer, "shard_specs", None)
        tables = {"labels": labels, "views": views, "weight_decay_mask": weight_decay_mask, "shard_specs": shards}
        check_names(f"{where}: ", build(leaves, SIZE), **tables)
        _routing.warn_if_muon_idle(self.param_groups, self._names())

    # ------------------------------------------------------------------------------------------ groups

    @torch._disable_dynamo
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds parameters; a group without ``"use_muon"`` is split by ``labels`` into a Muon group and an
        AdamW group (both kept, even when empty). A parameter added again (after ``opt.param_groups = []``)
        keeps its state where its new group keeps the same entries. Checked before anything changes."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        tensors, names = _read_params(param_group["params"], self.param_groups)
        # (the names read first: a tensor put in params by hand takes its position before new ones)
        held = {p: (i, n) for i, ns in enumerate(self._names()) for p, n in zip(self.param_groups[i]["params"], ns)}
        positions = (str(i) for i in itertools.count(len(self._keys)))
        keys = names or [self._keys[p] if p in self._keys else next(positions) for p in tensors]
        # each tensor once, in no group yet, under a name no other parameter has
        taken = {n: i for i, n in held.values()}
        first: dict[torch.Tensor, str] = {}
        for p, key in zip(tensors, keys):
            if p in held:
                again = f" (given again as {key!r})" if held[p][1] != key else ""
                raise ValueError(f"parameter {held[p][1]!r}{again} is already in parameter group {held[p][0]}")
            if p in first:
                raise ValueError(f"parameter {key!r} is the same tensor as {first[p]!r}")
            if key in taken:
                raise ValueError(f"another parameter is named {key!r} (in parameter group {taken[key]})")
            first[p], taken[key] = key, len(self.param_groups)
        use_muon = param_group.get("use_muon")
        if use_muon is None:
            labels = self._labels or default_labels(getattr(self._orthogonalizer, "shard_specs", None) or ())
            try:
                routes = transforms.route(labels, build(dict(zip(keys, map(_meta, tensors))), SIZE), (MUON, "adamw"))
            except ValueError as error:
                unnamed = "" if names else " (parameters given without names are keyed by position)"
                raise ValueError(f"{error}{unnamed}") from None
            parts = [(kind, [i for i, k in enumerate(keys) if (routes[k] == MUON) == kind]) for kind in (True, False)]
            if not self._warned_unnamed:  # (once per optimizer)
                muon = [tensors[i] for i in parts[0][1]]
                self._warned_unnamed = _routing.warn_if_routed_without_names(labels, names, muon)
        elif isinstance(use_muon, bool):
            parts = [(use_muon, list(range(len(tensors))))]
        else:
            raise TypeError(f"use_muon must be True or False, got {use_muon!r}")
        new: list[dict[str, Any]] = []
        for i, (kind, members) in enumerate(parts, len(self.param_groups)):
            group = _groups.group_of(f"param group {i}", param_group, kind, self._constructor)
            group.update(params=[tensors[k] for k in members], use_muon=kind)
            if names is not None:
                group["param_names"] = [names[k] for k in members]
            for key in SCHEDULED:  # the halves of one dict are two groups to a scheduler: no tensor couples them
                if new and isinstance(group[key], torch.Tensor) and group[key] is new[0][key]:
                    group[key] = group[key].clone()
            branch = self._branch(i, group)
            try:  # what init checks (each Muon parameter a matrix of its view), on the parameters' shapes
                branch.tx.init(build({keys[k]: _meta(tensors[k]) for k in members}, SIZE))
            except (ValueError, TypeError) as error:
                raise type(error)(f"param group {i}: {error}") from None
            new.append(group)
        self.param_groups.extend(new)  # (torch's add_param_group would fill an AdamW group with Muon's defaults)
        self._keys.update(zip(tensors, keys))
        for group in new:  # a parameter added again keeps its state where its new group keeps the same entries
            for p in group["params"]:
                if self.state.get(p) and set(self.state[p]) != set(_groups.layout(group)):
                    del self.state[p]

    def _branch(self, index: int, group: dict[str, Any]) -> Branch:
        """The group's branch, rebuilt when a setting of it changed (its state laid out anew where its
        entries change), its scheduled values refilled. Raises naming the group."""
        where = f"param group {index}"
        values = {name: _scheduled(where, name, group[name]) for name in SCHEDULED if name in group}
        signature = tuple((k, repr(v)) for k, v in group.items() if k not in ("params", "param_names", *SCHEDULED))
        branch = self._branches.get(id(group))
        if branch is None or branch.group is not group or branch.signature != signature:
            old, branch = branch, self._built(where, group, signature, values)
            if old is not None and old.group is group and old.shaping != branch.shaping:
                # its variant, bias corrections or state_dtype changed: its state laid out for the new ones
                for p in group["params"]:
                    kept = _groups.relaid(self.state.pop(p, {}), old.shaping, branch.shaping, p)
                    if kept:
                        self.state[p] = kept
            self._branches[id(group)] = branch
        for name, tensor in branch.scalars.items():
            if branch.filled[name] != values[name]:  # (a fill a step where the value is unchanged would be idle)
                tensor.fill_(values[name])
                branch.filled[name] = values[name]
        return branch

    def _built(self, where: str, group: dict[str, Any], signature: tuple[Any, ...], values: dict[str, float]) -> Branch:
        kind = group.get("use_muon")
        stray = next((k for k in group if k == "ns" or k.startswith("adamw_")), None)
        if stray == "ns":
            raise ValueError(f"{where} holds 'ns'; a group keeps its Newton–Schulz setting as {list(NS_ENTRIES)}")
        if stray is not None:
            held = list(ADAMW_SETTINGS)
            raise ValueError(f"{where} holds {stray!r}, a keyword of the constructor; an AdamW group holds {held}")
        if not isinstance(kind, bool) or kind != ("variant" in group):
            raise ValueError(
                f"{where}: use_muon={kind!r}, but its settings are {'a Muon' if 'variant' in group else 'an AdamW'} "
                "group's: a group's use_muon is fixed when it is added (add groups with add_param_group)"
            )
        missing = [k for k in (MUON_SETTINGS if kind else ADAMW_SETTINGS) if k not in group]
        if missing:
            raise ValueError(f"{where} lacks {missing}; add groups with add_param_group, which fills them in")
        # the preset's branch the group's settings make, its scheduled ones as 0-d tensors
        scalars = {name: torch.tensor(value, dtype=torch.float64) for name, value in values.items()}
        lr, momentum, wd = scalars["lr"], scalars["momentum"], scalars["weight_decay"]
        check_state_dtype(where, group["state_dtype"])
        try:
            flag("cautious_weight_decay", group["cautious_weight_decay"])
            if not kind:
                unit_interval("beta2", group["beta2"])
                if group["nesterov"] not in (True, False, "timm"):
                    raise ValueError(f"nesterov must be True, False or 'timm' (AdamW's), got {group['nesterov']!r}")
                tx = adamw(
                    lr,
                    betas=(momentum, group["beta2"]),
                    eps=group["eps"],
                    weight_decay=wd,
                    weight_decay_mask=self._mask,
                    nesterov=group["nesterov"],
                    state_dtype=group["state_dtype"],
                    cautious_weight_decay=group["cautious_weight_decay"],
                    donate_state=self._donate,
                )
            else:
                flag("momentum_bias_correction", group["momentum_bias_correction"])
                options = {k: group[k] for k in VARIANT_OPTIONS if group[k] is not None}
                tx = matrix_branch(
                    group["variant"],
                    lr,
                    momentum,
                    nesterov=group["nesterov"],
                    momentum_bias_correction=group["momentum_bias_correction"],
                    weight_decay=wd,
                    cautious_weight_decay=group["cautious_weight_decay"],
                    cautious_mode=group["cautious_mode"],
                    ns=_groups.ns_of(group),
                    scale=_groups.scale_of(group["adjust_lr_fn"], group["extra_scale"]),
                    views=self._views,
                    weight_decay_mask=self._mask,
                    orthogonalizer=self._orthogonalizer,
                    donate_state=self._donate,
                    state_dtype=group["state_dtype"],
                    **options,
                )
        except (ValueError, TypeError) as error:
            raise type(error)(f"{where}: {error}") from None
        shaping = {k: group.get(k) for k in ("use_muon", *SHAPING)}
        return Branch(group, signature, tx, scalars, dict(values), shaping, _groups.layout(group))

    @property
    def transform(self) -> Transform:
        """The groups' branches as one transform (:func:`muonfn.partition` by their labels): its ``init``
        makes the functional state of every parameter."""
        labels = self._labels_of()
        branches = {label: self._branch(i, g).tx for i, (label, g) in enumerate(zip(labels, self.param_groups))}
        return transforms.partition(branches, {n: label for label, ns in zip(labels, self._names()) for n in ns})

    def _labels_of(self) -> list[str]:
        """``"muon"``, ``"adamw"``, ``"muon_1"``, ...: the k-th group of a kind is labelled with suffix k."""
        kinds = ["muon" if group.get("use_muon") else "adamw" for group in self.param_groups]
        return [kind + (f"_{n}" if (n := kinds[:i].count(kind)) else "") for i, kind in enumerate(kinds)]

    def _names(self) -> list[list[str]]:
        """Every group's parameter names, as each was given (a tensor given without a name, or put in
        ``params`` by hand, named by its position): a group's order may change."""
        keys = self._keys
        return [[keys.setdefault(p, str(len(keys))) for p in group["params"]] for group in self.param_groups]

    # ------------------------------------------------------------------------------------------ state

    @property
    def state(self) -> collections.defaultdict[Any, dict[str, Any]]:
        """Each parameter's state, as torch keeps it (see :mod:`muonfn.optim`)."""
        return self.__dict__["state"]

    @state.setter
    def state(self, state: Mapping[Any, Any]) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"opt.state must be a mapping of parameters to their state, got {type(state).__name__}")
        self.__dict__["state"] = collections.defaultdict(dict, state)

    def _group_state(self, layout: Mapping[str, Any], tx: Transform | None, names: list[str], params: list[Any]) -> Any:
        """The functional state of ``params`` (named ``names``) from ``opt.state``, laid out by ``layout``;
        with ``tx``, the entries a parameter lacks (all of them where it has none) as ``tx.init`` makes them."""
        state = self.__dict__["state"]
        held = [state.get(p) or {} for p in params]
        if tx is not None:
            for name, h in zip(names, held):
                if not h.keys() <= layout.keys():
                    unknown = next(k for k in h if k not in layout)
                    raise ValueError(
                        f"the state of parameter {name!r} has no entry {unknown!r}; its entries are {list(layout)}"
                    )
            lacking = [i for i, h in enumerate(held) if len(h) < len(layout)]
            if lacking:  # (new dicts: opt.state[p] changes once the step has run)
                made = tx.init(build({names[i]: params[i].detach() for i in lacking}, SIZE))
                for i in lacking:
                    held[i] = {k: held[i][k] if k in held[i] else made[(*path, names[i])] for k, path in layout.items()}
        out = build({}, SIZE)
        for torch_name, path in layout.items():
            out.set(path, build({n: h[torch_name] for n, h in zip(names, held) if torch_name in h}, SIZE))
        return out

    @property
    def functional_state(self) -> TensorDictBase:
        """The state as ``Transform.update`` takes it: ``{label: group state}``, per-leaf entries keyed by
        parameter name, of the parameters that have state. Assigning one (from this optimizer, or
        ``muonfn.muon(...).init``/``update`` for some or all of the parameters) replaces the whole state
        after checking it: each parameter's entries, all of them or none, shapes, dtypes and devices."""
        self._sync()
        labelled = zip(self._labels_of(), self.param_groups, self._names())
        out = {label: self._group_state(_groups.layout(g), None, names, g["params"]) for label, g, names in labelled}
        return build(out, SIZE)

    @functional_state.setter
    def functional_state(self, state: TensorDictBase) -> None:
        where = "functional_state"
        if not isinstance(state, TensorDictBase):
            raise TypeError(f"{where} must be a TensorDict, got {type(state).__name__}")
        labels, pending = self._labels_of(), {}
        unexpected = [label for label in state.keys() if label not in labels]
        if unexpected:
            raise ValueError(f"{where}: unexpected {unexpected[0]!r}")
        for i, (label, group, names) in enumerate(zip(labels, self.param_groups, self._names())):
            branch, part = self._branch(i, group), state.get(label, build({}, SIZE))
            given = {".".join((label, *key)): v for key, v in part.items(True, True)}
            for name, p in zip(names, group["params"]):
                keys = {torch_name: ".".join((label, *path, name)) for torch_name, path in branch.layout.items()}
                present = [k for k in keys.values() if k in given]
                if present and len(present) < len(keys):
                    lost = next(k for k in keys.values() if k not in given)
                    raise ValueError(f"{where}: missing {lost!r} of parameter {name!r}, which has {present}")
                pending[p] = {t: given.pop(k) for t, k in keys.items()} if present else None
            if given:
                raise ValueError(f"{where}: unexpected {next(iter(given))!r}")
            held = build({n: p.detach() for n, p in zip(names, group["params"]) if pending[p]}, SIZE)
            self._check(where, i, branch.tx, held, part, held)
        for p in pending:
            self.state.pop(p, None)
        self.state.update({p: entries for p, entries in pending.items() if entries})

    # ------------------------------------------------------------------------------------------ step

    @torch._disable_dynamo
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; the others and their state are left alone.
        A parameter's state is made at its first gradient, on its device and in its dtype, as torch.optim
        makes it. Everything is checked before anything changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            state = self.__dict__["state"]
            branches, before = dict(self._branches), dict(state)
            try:
                layouts, work = self._checked_work()
            except BaseException:  # (a failed step leaves everything as it was: the branches, the state relaid)
                self._branches = branches
                state.clear()
                state.update(before)
                raise
            run = self._compiled_run(work) if self._compile and work else _run
            for layout, (names, params, new_state) in zip(layouts, run(work)):
                for torch_name, path in layout.items():
                    for name, p in zip(names, params):
                        state[p][torch_name] = new_state[(*path, name)]
        return loss

    def _checked_work(self) -> tuple[list[dict[str, tuple[str, ...]]], list[tuple[Any, ...]]]:
        """Every part's state layout, and its transform, names, parameters, gradients, state and parameters
        as leaves, all checked: the whole step's input before any part runs."""
        groups: dict[int, int] = {}
        seen: dict[torch.Tensor, int] = {}
        layouts: list[dict[str, tuple[str, ...]]] = []
        work: list[tuple[Any, ...]] = []
        total = sum(p.numel() for g in self.param_groups for p in g["params"] if p.grad is not None)
        cap = max(AUTO_MIN_CHUNK, math.ceil(total / AUTO_PARTS)) if self._chunk_numel == "auto" else self._chunk_numel
        for i, (group, names) in enumerate(zip(self.param_groups, self._names())):
            if groups.setdefault(id(group), i) != i:
                raise ValueError(f"param group {i} is param group {groups[id(group)]} again; a group is stepped once")
            stepped = []
            for name, p in zip(names, group["params"]):
                if p in seen:
                    again = "in its params twice" if seen[p] == i else f"also in param group {seen[p]}"
                    raise ValueError(f"param group {i}: parameter {name!r} is {again}")
                seen[p] = i
                if p.grad is not None:
                    stepped.append((name, p))
            branch = self._branch(i, group)
            for part in _parts(stepped, cap) if stepped else ():  # (each part checked: its transform runs unchecked)
                names, params = map(list, zip(*part))
                grads = build(dict(zip(names, map(attrgetter("grad"), params))), SIZE)
                leaves = build(dict(zip(names, map(torch.Tensor.detach, params))), SIZE)
                state = self._group_state(branch.layout, branch.tx, names, params)
                self._check(f"param group {i}", i, branch.tx, grads, state, leaves, part)
                layouts.append(branch.layout)
                work.append((branch.tx, names, params, grads, state, leaves))
        if len(self._branches) > len(self.param_groups):  # (groups removed from param_groups)
            self._branches = {k: b for k, b in self._branches.items() if any(b.group is g for g in self.param_groups)}
        return layouts, work

    def _check(self, where: str, i: int, tx: Transform, grads: Any, state: Any, leaves: Any, stepped: Any = ()) -> None:
        """Group ``i``'s gradients, state and parameters as leaves checked, an error naming ``where`` and
        the state entry by the group's label; with ``stepped`` (a step's names and parameters), a state that
        is stale (on another device or of another dtype than its parameter) named with its remedies."""
        try:
            check_input(tx.init, grads, state, leaves, donated=self._donate)
        except ValueError as error:
            problem = _groups.stale(stepped, self.state, self.param_groups[i])
            label = self._labels_of()[i]
            message = str(error).removeprefix("update: ").replace("state entry '", f"state entry '{label}.")
            raise problem or ValueError(f"{where}: {message}") from None

    def _compiled_run(self, work: list[Any]) -> Callable[..., Any]:
        signature = tuple((id(w[0]), tuple(w[1]), tuple((p.shape, p.dtype) for p in w[2])) for w in work)
        if signature not in self._compiled:
            if len(self._compiled) >= MAX_COMPILED_STRUCTURES:
                if not self._warned_compiled:
                    self._warned_compiled = True
                    warnings.warn(
                        f"muonfn.optim.Muon: {len(self._compiled)} structures of the step (which parameters have "
                        "gradients, the groups' settings) are compiled; steps of other structures run eagerly",
                        stacklevel=3,
                    )
                return _run
            options = {"fullgraph": True, **(self._compile if isinstance(self._compile, Mapping) else {})}
            # a code object of its own: dynamo limits each one's recompilations, and a structure is none
            own = types.FunctionType(_run.__code__.replace(), _run.__globals__, "_run")
            self._compiled[signature] = torch.compile(own, **options)
        return self._compiled[signature]

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's format, ``{"state": {index: {name: tensor}}, "param_groups": [...]}``, describing
        ``param_groups`` as they are; loads with ``torch.load(weights_only=True)`` (a map of one's own
        as ``ns_method`` is left out). The state of a tensor removed from the groups is left out."""
        self._sync()
        held = self.__dict__["state"]
        members = {p: n for g, ns in zip(self.param_groups, self._names()) for p, n in zip(g["params"], ns)}
        for p, name in members.items():
            if not p.is_meta and any(isinstance(t, torch.Tensor) and t.is_meta for t in (held.get(p) or {}).values()):
                raise ValueError(
                    f"state_dict: the state of parameter {name!r} is on meta, which holds no values, and the parameter "
                    f"on {p.device} (stepped on meta, then materialised): drop it with del opt.state[p] "
                    "(opt.state.clear() for every parameter); the next step makes it anew"
                )
        stray = next((k for k, v in held.items() if isinstance(k, torch.Tensor) and v and k not in self._keys), None)
        if stray is not None:
            raise ValueError(
                f"state_dict: opt.state has an entry under a tensor of shape {tuple(stray.shape)} that is not a "
                "parameter of this optimizer; a state_dict numbers parameters, so store it under a string key"
            )
        # as torch's: the parameters of param_groups, each with its state (none for one never stepped)
        kept = {k: v for k, v in held.items() if not isinstance(k, torch.Tensor) or (k in members and v)}
        self.__dict__["state"] = kept
        try:
            packed = super().state_dict()
        finally:
            self.__dict__["state"] = held
        for group in packed["param_groups"]:
            if callable(group.get("ns_method")):
                del group["ns_method"]
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict` as torch's optimizers do (the saved settings replace these but for a
        Muon group's variant and bias corrections, which must match, and each group's ``state_dtype``, which
        stays this optimizer's), checked first: a mismatch raises naming the group or parameter and changes
        nothing. State tensors are copied to their parameter's device, in its dtype or the group's
        ``state_dtype`` (narrowed to bf16 rounded to nearest; counts exact int64, the second moments of fp16
        parameters fp32; a bf16 momentum saved without its count counts from 0)."""
        saved = [_migration.current_group(g) for g in state_dict["param_groups"]]
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the state_dict has {len(saved)} parameter groups, this optimizer "
                f"{len(self.param_groups)}"
            )
        state: dict[Any, Any] = {}
        for i, (ours, theirs, names) in enumerate(zip(self.param_groups, saved, self._names())):
            where = f"load_state_dict: parameter group {i}"
            if len(ours["params"]) != len(theirs["params"]) or ours["use_muon"] != theirs.get("use_muon"):
                raise ValueError(
                    f"{where} has {len(theirs['params'])} parameters of use_muon={theirs.get('use_muon')!r} saved, "
                    f"{len(ours['params'])} of use_muon={ours['use_muon']} here"
                )
            theirs["state_dtype"] = ours.get("state_dtype")  # (the state is cast to this optimizer's)
            if _groups.layout(theirs) != _groups.layout(ours):  # (chosen when it is built: its state follows them)
                setting = next(k for k in _groups.SHAPING if ours.get(k) != theirs.get(k))
                raise ValueError(
                    f"{where} keeps state {list(_groups.layout(ours))} here and {list(_groups.layout(theirs))} in "
                    f"the state_dict (saved with {setting}={theirs.get(setting)!r}, this optimizer's group has "
                    f"{setting}={ours.get(setting)!r})"
                )
            if callable(ours.get("ns_method")) and "ns_method" not in theirs:
                theirs["ns_method"] = ours["ns_method"]  # (a map of one's own is not saved: the loading optimizer's)
            for k, n, p in zip(theirs["params"], names, ours["params"]):
                if state_dict["state"].get(k):
                    where = f"load_state_dict: parameter {n!r} (index {k})"
                    state[p] = _migration.loaded_entries(where, state_dict["state"][k], theirs, p)
        numbered = {k for group in saved for k in group["params"]}  # (the others kept as torch keeps them)
        state.update({k: entries for k, entries in state_dict["state"].items() if k not in numbered})
        # (torch's loader resets the branches, which carry an edit's pending relayout, and widens the defaults)
        before = self.param_groups, self.__dict__["state"], self._branches, self._compiled, dict(self.defaults)
        try:
            super().load_state_dict({"state": {}, "param_groups": saved})
            self.state = state
            for i, (group, names) in enumerate(zip(self.param_groups, self._names())):
                branch = self._branch(i, group)
                leaves = build({n: p.detach() for n, p in zip(names, group["params"]) if self.state.get(p)}, SIZE)
                loaded = self._group_state(branch.layout, None, names, group["params"])
                self._check(f"load_state_dict: param group {i}", i, branch.tx, leaves, loaded, leaves)
        except Exception:
            self.__dict__.update(zip(("param_groups", "state", "_branches", "_compiled", "defaults"), before))
            raise

    def load_torch_state_dicts(
        self, muon_state_dict: dict[str, Any], adamw_state_dict: dict[str, Any] | None = None
    ) -> None:
        """Continues a run of ``torch.optim.Muon`` (with ``torch.optim.AdamW`` for the other parameters):
        this optimizer's Muon groups take the Muon state_dict's groups in order, its AdamW groups the AdamW
        state_dict's, parameter by parameter (checked by shape, and by name where both have names), every
        group key carried. A mismatch raises naming the group or parameter and changes nothing."""
        self.load_state_dict(
            _migration.shim_state_dict(self.param_groups, self._names(), muon_state_dict, adamw_state_dict)
        )

    def torch_state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(muon_state_dict, adamw_state_dict)`` for ``torch.optim.Muon`` and ``torch.optim.AdamW``
        built with this optimizer's Muon and AdamW groups, in order; raises naming a group whose settings
        torch's optimizers cannot run."""
        for i, group in enumerate(self.param_groups):
            self._branch(i, group)
        return _migration.torch_state_dicts(self.param_groups, self._names(), self.state, self._views, self._mask)

    def _sync(self) -> None:
        """Lays out the state of groups whose settings changed it, now, as their next step would."""
        for i, group in enumerate(self.param_groups):
            with contextlib.suppress(ValueError, TypeError):  # (refused by the next step)
                self._branch(i, group)

    def __getstate__(self) -> dict[str, Any]:
        self._sync()
        return {k: v for k, v in self.__dict__.items() if k not in ("_branches", "_compiled")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._branches, self._compiled = {}, {}


def _run(work: list[Any]) -> list[tuple[list[str], list[torch.Tensor], TensorDictBase]]:
    """Each part's update, added to its parameters before the next part is computed."""
    out = []
    for tx, names, params, grads, state, leaves in work:  # (checked: each part's transform runs unchecked)
        updates, new_state = transforms.unchecked(tx)(grads, state, leaves)
        torch._foreach_add_(params, list(updates.values()))
        del updates  # (freed before the next part's are computed: the step's peak holds one part's)
        out.append((names, params, new_state))
    return out


def _parts(stepped: list[tuple[str, torch.Tensor]], cap: int | None) -> list[list[tuple[str, torch.Tensor]]]:
    """``stepped`` in parts of at most ``cap`` elements (``None``: one part), the parameters of one
    Newton–Schulz call (a shape; a 2-D one with its transpose) together where they fit in one, which
    keeps the call's bits."""
    if cap is None or sum(p.numel() for _, p in stepped) <= cap:
        return [stepped]
    calls: dict[Any, list[tuple[str, torch.Tensor]]] = {}
    for n, p in stepped:
        calls.setdefault((p.dtype, tuple(sorted(p.shape)) if p.ndim == 2 else tuple(p.shape)), []).append((n, p))
    parts: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for members in calls.values():
        whole = sum(p.numel() for _, p in members)
        for j, (n, p) in enumerate(members):
            # a part ends where it is full, and before a call that fits in a part but not in its rest
            if parts[-1] and (size + p.numel() > cap or (j == 0 and whole <= cap < size + whole)):
                parts.append([])
                size = 0
            parts[-1].append((n, p))
            size += p.numel()
    return parts


def _read_params(params: Any, groups: list[dict[str, Any]]) -> tuple[list[torch.Tensor], list[str] | None]:
    """A group dict's tensors and their names (``None`` for tensors given without), as torch reads them:
    floating-point leaves, all named or none, as the optimizer's are."""
    params = [params] if isinstance(params, torch.Tensor) else params
    if isinstance(params, set):
        raise TypeError("optimizer parameters need a deterministic order: pass a list, not a set")
    params = list(params)
    named = [isinstance(p, tuple) for p in params]
    if any(named) and not all(named):
        raise ValueError("all optimizer params should be with or without names; some names are missing")
    names = [n for n, _ in params] if params and all(named) else None
    tensors = [p for _, p in params] if names is not None else params
    if groups and params and (names is None) != ("param_names" not in groups[0]):
        given, theirs = ("without", "with") if names is None else ("with", "without")
        raise ValueError(f"parameters given {given} names to an optimizer of parameters {theirs}: name all or none")
    for p in tensors:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}")
        if not p.is_floating_point():
            raise TypeError(f"parameter of dtype {p.dtype}: only floating-point tensors train")
        if not (p.is_leaf or p.retains_grad):
            raise ValueError("can't optimize a non-leaf Tensor")
    return tensors, names


def _meta(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(p.shape, dtype=p.dtype, device="meta")


def _scheduled(where: str, name: str, value: Any) -> float:
    """A group's ``lr``, ``momentum`` or ``weight_decay``: a real number (as in torch, a one-element real
    tensor is one), finite and >= 0, a momentum below 1."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{where}: {name} must be a real number, got a {value.dtype} tensor")
        if value.is_meta:
            raise ValueError(f"{where}: {name} is a tensor on the meta device, which holds no value")
        if value.numel() != 1:
            raise ValueError(f"{where}: {name} must be a number, got a tensor of shape {tuple(value.shape)}")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not 0 <= number < (1 if name == "momentum" else math.inf):
        expected = "in [0, 1)" if name == "momentum" else "finite and >= 0"
        raise ValueError(f"{where}: {name} must be {expected}, got {number!r}")
    return number
