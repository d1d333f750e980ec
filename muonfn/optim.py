r"""A ``torch.optim.Optimizer`` that steps with the functional core.

:class:`Muon` translates between the ``torch.optim`` contract (``param_groups``,
``state``, ``step``, ``state_dict``) and ``muonfn``'s pure functions; every number it
writes comes from ``Transform.update``.

**Param groups.** Every group is routed wholly to Muon or to AdamW; its ``"use_muon"``
entry says which. A group given without ``"use_muon"`` (plain ``params``, or a dict
without the key) is split by ``labels`` into a Muon group followed by an AdamW group,
both kept even when empty, so ``Muon(model.named_parameters())`` has exactly two groups
and a scheduler scales both learning rates alike. Scheduled hyperparameters (``lr``,
``momentum``, ``weight_decay``) are read from ``param_groups`` at every step; the others
(``nesterov``, ``ns_*``, ``scale``, ``extra_scale``, ``adamw_betas``, ``adamw_eps``) may be
changed too and rebuild the transform. ``momentum`` drives Muon only: AdamW's
``adamw_betas`` are not touched by schedulers that cycle momentum.

**State.** ``opt.functional_state`` is the TensorDict ``Transform.update`` takes and
returns. Parameters are keyed by their ``named_parameters()`` names split at dots
(``("0", "weight")``, as in ``TensorDict.from_module``), or by their position
(``("0",)``, ``("1",)``, ...) when given without names. The k-th Muon group keeps its state
under ``"muon"`` (k = 0) or ``f"muon_{k}"``, the k-th AdamW group under ``"adamw"`` or
``f"adamw_{k}"``, so for the default two groups the layout is that of
``muonfn.muon(...).init(params)``: ``state["muon", "momentum", *key]`` and
``state["adamw", "step" | "exp_avg" | "exp_avg_sq", *key]``. ``opt.state[p]`` shows the
same tensors under torch's names: ``{"momentum_buffer"}`` for Muon,
``{"step", "exp_avg", "exp_avg_sq"}`` for AdamW (``"step"`` an exact int64 count).

**Checkpoints.** ``opt.state_dict()`` follows torch's format (state keyed by parameter
index, hyperparameters in ``param_groups``) and loads with ``torch.load(weights_only=True)``;
``muonfn.save(opt.functional_state, path)`` stores the TensorDict itself.

Example::

    opt = muonfn.optim.Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        scheduler.step()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from . import _tree
from ._base import Transform
from ._checkpoint import conform
from ._combinators import LabelsLike, chain, partition, resolve_labels
from ._labels import ADAMW, MUON, label_params
from ._newton_schulz import Coefficients, CoefficientsLike
from ._presets import adamw
from ._transforms import DEFAULT_BUCKET_NUMEL, MaskLike, add_decayed_weights, scale_by_learning_rate, scale_by_muon
from ._validation import Scalar
from ._views import ViewsLike, resolve_views

if TYPE_CHECKING:
    from .distributed import Collectives, ShardSpecs

__all__ = ["Muon"]

#: Hyperparameters fed to the transform as 0-d tensors, refreshed before every step.
SCHEDULED = ("lr", "momentum", "weight_decay")
_MUON_SETTINGS = ("nesterov", "ns_coefficients", "ns_steps", "ns_dtype", "ns_eps", "scale", "extra_scale")
_ADAMW_SETTINGS = ("adamw_betas", "adamw_eps")
#: Group keys that only say how a group given without ``use_muon`` sets its AdamW half.
_SPLIT_ONLY = ("adamw_lr", "adamw_weight_decay")

#: torch's name of each state entry -> the functional state's name, per route.
_STATE_NAMES: dict[bool, dict[str, str]] = {
    True: {"momentum_buffer": "momentum"},
    False: {"step": "step", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}


class _Slot(NamedTuple):
    """Where a parameter lives: its group, its key, and its group's state label."""

    group: int
    key: _tree.Key
    label: str
    use_muon: bool


def _group_labels(routes: Sequence[bool]) -> list[str]:
    """``"muon"``, ``"adamw"``, ``"muon_1"``, ...: the k-th group of a kind gets suffix k (none for 0)."""
    seen = {True: 0, False: 0}
    labels = []
    for use_muon in routes:
        k = seen[use_muon]
        seen[use_muon] += 1
        base = MUON if use_muon else ADAMW
        labels.append(base if k == 0 else f"{base}_{k}")
    return labels


_ROUTES = ((True, MUON), (False, ADAMW))


def _index_slots(
    groups: Sequence[Mapping[str, Any]], keys: Mapping[torch.Tensor, _tree.Key]
) -> dict[torch.Tensor, _Slot]:
    """Every parameter's group, key and state label."""
    labels = _group_labels([g["use_muon"] for g in groups])
    return {p: _Slot(i, keys[p], labels[i], g["use_muon"]) for i, g in enumerate(groups) for p in g["params"]}


def _new_scalars(group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The 0-d tensors a group's transform reads its scheduled hyperparameters from.

    float64 on the host: the core then computes what it computes from a Python float
    (``1 - momentum`` in double, one rounding to the parameter's dtype), bit for bit, and
    reading them never waits for a device.
    """
    names = SCHEDULED if group["use_muon"] else ("lr", "weight_decay")
    return {name: torch.tensor(float(group[name]), dtype=torch.float64) for name in names}


def _scalar_value(group_index: int, name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"param group {group_index}: {name} must be a number, got a tensor of shape {value.shape}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"param group {group_index}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def _is_zero(value: Any) -> bool:
    return float(value) == 0.0


def _check_scheduled(group_index: int, group: Mapping[str, Any]) -> None:
    """The checks the core applies at construction, for values a scheduler or a user may have changed."""
    lr = _scalar_value(group_index, "lr", group["lr"])
    if not lr >= 0:
        raise ValueError(f"param group {group_index}: lr must be >= 0, got {group['lr']!r}")
    weight_decay = _scalar_value(group_index, "weight_decay", group["weight_decay"])
    if not weight_decay >= 0:
        raise ValueError(f"param group {group_index}: weight_decay must be >= 0, got {group['weight_decay']!r}")
    if group["use_muon"]:
        momentum = _scalar_value(group_index, "momentum", group["momentum"])
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"param group {group_index}: momentum must be in [0, 1), got {group['momentum']!r}")


def _plain_coefficients(value: CoefficientsLike) -> Any:
    """A schedule in a form ``torch.load(weights_only=True)`` reads back: a name or a tuple of triples."""
    if isinstance(value, str):
        return value
    if isinstance(value, Coefficients) and value.norm_factor != 1.0:
        return value  # only a Coefficients carries a norm factor
    triples = value.triples if isinstance(value, Coefficients) else value
    return tuple(tuple(float(v) for v in t) for t in triples)


class Muon(torch.optim.Optimizer):
    r"""Muon for matrices and AdamW for the rest, as a ``torch.optim.Optimizer``.

    Takes the hyperparameters of :func:`muonfn.muon` (see there for the math) and steps
    with its ``update``; see :mod:`muonfn.optim` for how groups and state are laid out.

    Args:
        params: ``model.named_parameters()`` (names drive ``labels``), an iterable of
            tensors, or param-group dicts. A dict may set ``lr``, ``momentum``,
            ``weight_decay`` and the other defaults, ``"use_muon": True/False`` to route
            the whole group, or, when it leaves routing to ``labels``, ``adamw_lr`` and
            ``adamw_weight_decay`` for its AdamW half.

    The other arguments (``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_*``,
    ``scale``, ``extra_scale``, ``adamw_*``, ``labels``, ``views``, ``weight_decay_mask``,
    ``bucket_numel``, ``collectives``, ``strategy``, ``shard_specs``) are those of
    :func:`muonfn.muon`. ``adamw_lr`` and ``adamw_weight_decay`` (``None``: the Muon value)
    set the AdamW groups' ``lr`` and ``weight_decay``. ``lr`` is a number; schedule it with
    ``torch.optim.lr_scheduler``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        lr: Scalar = 1e-3,
        momentum: Scalar = 0.95,
        nesterov: bool = True,
        weight_decay: Scalar = 0.1,
        ns_coefficients: CoefficientsLike = "keller",
        ns_steps: int | None = None,
        ns_dtype: torch.dtype | None = None,
        scale: str = "match_rms_adamw",
        extra_scale: float = 1.0,
        adamw_lr: Scalar | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: Scalar | None = None,
        labels: LabelsLike | None = None,
        views: ViewsLike = None,
        weight_decay_mask: MaskLike = None,
        ns_eps: float = 1e-7,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        collectives: Collectives | None = None,
        strategy: str = "owner",
        shard_specs: ShardSpecs | None = None,
    ) -> None:
        for name, value in (("lr", lr), ("adamw_lr", adamw_lr)):
            if callable(value) and not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"Muon({name}=...) takes a number; schedule it with torch.optim.lr_scheduler "
                    "(schedule functions are for muonfn.muon)"
                )
        defaults: dict[str, Any] = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "ns_coefficients": _plain_coefficients(ns_coefficients),
            "ns_steps": ns_steps,
            "ns_dtype": ns_dtype,
            "ns_eps": ns_eps,
            "scale": scale,
            "extra_scale": extra_scale,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
        }
        self._adamw_lr = adamw_lr
        self._adamw_weight_decay = adamw_weight_decay
        self._labels: LabelsLike = label_params if labels is None else labels
        self._views = views
        self._weight_decay_mask = weight_decay_mask
        self._bucket_numel = bucket_numel
        self._collectives = collectives
        self._strategy = strategy
        self._shard_specs = shard_specs
        self._functional_state: TensorDictBase = TensorDict({}, batch_size=[])
        self._scalars: list[dict[str, torch.Tensor]] = []
        self._slots: dict[torch.Tensor, _Slot] = {}
        self._cache: tuple[list[Any], Transform] | None = None
        super().__init__(params, defaults)  # routes every group through add_param_group
        self.state = _ParamState(self)  # type: ignore[assignment]

    # ------------------------------------------------------------------ layout

    def _branch(self, group: Mapping[str, Any], scalars: Mapping[str, torch.Tensor]) -> Transform:
        """The transform of one group: the two branches of :func:`muonfn.muon`."""
        weight_decay: Scalar = scalars["weight_decay"]
        if _is_zero(group["weight_decay"]):
            weight_decay = 0.0  # the core skips a zero decay given as a number (and so does muon(weight_decay=0.0))
        if group["use_muon"]:
            return chain(
                scale_by_muon(
                    scalars["momentum"],
                    group["nesterov"],
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["ns_dtype"],
                    group["ns_eps"],
                    group["scale"],
                    group["extra_scale"],
                    self._views,
                    self._bucket_numel,
                    self._collectives,
                    self._strategy,
                    self._shard_specs,
                ),
                add_decayed_weights(weight_decay, self._weight_decay_mask),
                scale_by_learning_rate(scalars["lr"]),
            )
        return adamw(scalars["lr"], group["adamw_betas"], group["adamw_eps"], weight_decay, self._weight_decay_mask)

    def _signature(self) -> list[Any]:
        """What the transform is built from besides the scheduled scalars (and the layout, which resets the cache)."""
        signature: list[Any] = []
        for group in self.param_groups:
            settings = _MUON_SETTINGS if group["use_muon"] else _ADAMW_SETTINGS
            signature.append((group["use_muon"], [group[k] for k in settings], _is_zero(group["weight_decay"])))
        return signature

    def _build(self, scalars: Sequence[Mapping[str, torch.Tensor]]) -> Transform:
        """``partition`` over the groups' branches, each parameter labelled by its group."""
        labels = _group_labels([g["use_muon"] for g in self.param_groups])
        branches = {label: self._branch(g, s) for label, g, s in zip(labels, self.param_groups, scalars)}
        return partition(branches, {slot.key: slot.label for slot in self._slots.values()})

    @torch.compiler.disable
    def _synced_transform(self) -> Transform:
        """Copies the scheduled hyperparameters into their tensors; rebuilds the transform if settings changed."""
        for i, group in enumerate(self.param_groups):
            _check_scheduled(i, group)
        for group, scalars in zip(self.param_groups, self._scalars):
            for name, tensor in scalars.items():
                tensor.fill_(group[name])
        signature = self._signature()
        if self._cache is None or self._cache[0] != signature:
            self._cache = (signature, self._build(self._scalars))
        return self._cache[1]

    @property
    def transform(self) -> Transform:
        """The :class:`~muonfn.Transform` this optimizer steps with.

        Its ``lr``, ``momentum`` and ``weight_decay`` are 0-d tensors this optimizer refills
        from ``param_groups`` before each of its steps.
        """
        return self._synced_transform()

    def _param_tensordict(self, device: str | torch.device | None = None) -> TensorDict:
        keys, values = [], []
        for p, slot in self._slots.items():
            keys.append(slot.key)
            values.append(p.detach() if device is None else torch.empty_like(p, device=device))
        return TensorDict(dict(zip(keys, values)), batch_size=[])

    def _layout(self) -> TensorDictBase:
        """The functional state's structure: expanded one-element tensors of each leaf's shape, dtype and device."""
        scalars = [_new_scalars(g) for g in self.param_groups]
        meta = self._build(scalars).init(self._param_tensordict("meta"))
        devices = {slot.key: p.device for p, slot in self._slots.items()}
        layout = meta.empty(recurse=True)
        for key, t in zip(_tree.leaf_keys(meta), _tree.leaves(meta)):
            # state leaves are keyed (label, field, *parameter key)
            layout.set(key, torch.empty((), dtype=t.dtype, device=devices[key[2:]]).expand(t.shape))
        return layout

    # ------------------------------------------------------------------ groups

    @torch.compiler.disable
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds parameters; a group without ``"use_muon"`` is split by ``labels`` into a Muon and an AdamW group.

        Everything is checked before anything changes: on an error the optimizer is as it was.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        tensors, names = self._new_params(param_group)
        if names is not None:
            keys = [tuple(name.split(".")) for name in names]
        else:  # by position in the order the optimizer was given them
            keys = [(str(i),) for i in range(len(self._slots), len(self._slots) + len(tensors))]
        self._check_new_params(tensors, keys)

        use_muon = param_group.get("use_muon")
        if use_muon is None:
            detached = TensorDict(dict(zip(keys, [p.detach() for p in tensors])), batch_size=[])
            try:
                table = resolve_labels(self._labels, detached, dict.fromkeys((MUON, ADAMW)))
            except ValueError as error:
                if names is None:
                    raise ValueError(f"{error} (parameters given without names are keyed by position)") from error
                raise
            parts = [(route, [i for i, k in enumerate(keys) if table[k] == label]) for route, label in _ROUTES]
        elif isinstance(use_muon, bool):
            for split_only in _SPLIT_ONLY:
                if split_only in param_group:
                    raise ValueError(
                        f"{split_only!r} sets the AdamW half of a group split by labels; this group has "
                        f"use_muon={use_muon}: set its {split_only.removeprefix('adamw_')!r} instead"
                    )
            parts = [(use_muon, list(range(len(tensors))))]
        else:
            raise TypeError(f"use_muon must be True or False, got {use_muon!r}")

        new_groups = []
        for route, members in parts:
            group = {k: v for k, v in param_group.items() if k not in ("params", "param_names", *_SPLIT_ONLY)}
            group["params"] = [tensors[i] for i in members]
            if names is not None:
                group["param_names"] = [names[i] for i in members]
            if not route:
                # the AdamW half: adamw_lr / adamw_weight_decay of the group, else of the optimizer, else
                # the group's lr / weight_decay ("None means the Muon value", as in muonfn.muon)
                for name, fallback in (("lr", self._adamw_lr), ("weight_decay", self._adamw_weight_decay)):
                    value = param_group.get(f"adamw_{name}", fallback)
                    if value is not None:
                        group[name] = value
            for name, default in self.defaults.items():
                group.setdefault(name, default)
            group["use_muon"] = route
            group["ns_coefficients"] = _plain_coefficients(group["ns_coefficients"])
            new_groups.append(group)

        groups = [*self.param_groups, *new_groups]
        slots = _index_slots(groups, {**{p: s.key for p, s in self._slots.items()}, **dict(zip(tensors, keys))})
        labels = _group_labels([g["use_muon"] for g in groups])
        state = self._functional_state.clone(recurse=False)
        scalars = list(self._scalars)
        for i in range(len(self.param_groups), len(groups)):
            group = groups[i]
            _check_scheduled(i, group)
            scalars.append(_new_scalars(group))
            branch = self._branch(group, scalars[i])  # the core checks the other settings
            group_keys = [slots[p].key for p in group["params"]]
            if group["use_muon"]:
                views = resolve_views(self._views, group_keys, group["params"])
                for leaf_key, p, view in zip(group_keys, group["params"], views):
                    view.check(leaf_key, p.shape)
            state[labels[i]] = branch.init(
                TensorDict(dict(zip(group_keys, [p.detach() for p in group["params"]])), batch_size=[])
            )

        self.param_groups.extend(new_groups)
        self._scalars = scalars
        self._slots = slots
        self._functional_state = state
        self._cache = None

    def _new_params(self, param_group: Mapping[str, Any]) -> tuple[list[torch.Tensor], list[str] | None]:
        """The tensors of a group and their names (``None`` without), as torch reads them."""
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need a deterministic order: pass a list, not a set")
        params = list(params)
        named = [isinstance(p, tuple) for p in params]
        if any(named) and not all(named):
            raise ValueError("all optimizer params should be with or without names; some names are missing")
        with_names = bool(params) and all(named)
        if self.param_groups and with_names != ("param_names" in self.param_groups[0]):
            raise ValueError(
                "all optimizer param groups should be with/without names; "
                f"cannot add a param group {'with' if with_names else 'without'} names"
            )
        if with_names:
            return [p for _, p in params], [name for name, _ in params]
        return params, None

    def _check_new_params(self, tensors: Sequence[Any], keys: Sequence[_tree.Key]) -> None:
        known_keys = {slot.key for slot in self._slots.values()}
        seen: dict[torch.Tensor, str] = {}
        for p, key in zip(tensors, keys):
            name = _tree.dotted(key)
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer can only optimize tensors, but {name!r} is a {type(p).__name__}")
            if not (p.is_leaf or p.retains_grad):
                raise ValueError(f"can't optimize a non-leaf tensor ({name!r})")
            if not p.is_floating_point():
                raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only real floating-point tensors train")
            if p in seen:
                raise ValueError(f"parameter {name!r} is the same tensor as {seen[p]!r}; pass each tensor once")
            if p in self._slots:
                raise ValueError(f"parameter {name!r} is already in parameter group {self._slots[p].group}")
            if key in known_keys:
                raise ValueError(f"a parameter named {name!r} is already being optimized")
            seen[p] = name

    # ------------------------------------------------------------------ step

    @torch.compiler.disable
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; the others and their state are left alone.

        ``closure`` (optional) re-evaluates the model and returns the loss; it runs with
        gradients enabled. Inside ``torch.compile`` the step runs eagerly (a graph break),
        so its results are those of an eager step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        transform = self._synced_transform()
        with torch.no_grad():
            keys, targets, grads = [], [], []
            for p, slot in self._slots.items():
                if p.grad is not None:
                    keys.append(slot.key)
                    targets.append(p)
                    grads.append(p.grad)
            if not grads:
                return loss
            updates, state = transform.update(
                TensorDict(dict(zip(keys, grads)), batch_size=[]),
                self._functional_state,
                self._param_tensordict(),
            )
            torch._foreach_add_(targets, [updates.get(k) for k in keys])
        self._functional_state = state
        return loss

    # ------------------------------------------------------------------ state

    @property
    def functional_state(self) -> TensorDictBase:
        """The state TensorDict ``Transform.update`` takes and returns (see :mod:`muonfn.optim`).

        Assigning one (taken from this optimizer, or from ``muonfn.muon(...)``'s ``init``
        and ``update`` for the same parameters) replaces the state after checking that its
        keys, shapes, dtypes and devices are those expected; on a mismatch nothing changes.
        """
        return self._functional_state

    @functional_state.setter
    def functional_state(self, state: TensorDictBase | Mapping[str, Any]) -> None:
        self._functional_state = self._checked_state(state, "functional_state")

    def _checked_state(self, state: TensorDictBase | Mapping[str, Any], where: str) -> TensorDict:
        """``state`` laid out as expected, on its parameters' devices; else an error naming the first difference."""
        if not isinstance(state, TensorDictBase):
            state = TensorDict(dict(state), batch_size=[])
        if state.batch_size != torch.Size([]):
            raise ValueError(f"{where}: batch size {tuple(state.batch_size)}, expected ()")
        return conform(state, self._layout(), where)

    @torch.compiler.disable
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict` (torch's format); on any mismatch raises naming the parameter and changes nothing.

        As in torch, state tensors are cast to their parameter's dtype and device, except
        the integer ``"step"`` counts, which come back exact. The saved hyperparameters
        replace the current ones; groups keep their parameters, names and routes.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the state_dict has {len(saved_groups)} parameter groups, "
                f"this optimizer {len(self.param_groups)}"
            )
        groups: list[dict[str, Any]] = []
        entries: dict[_tree.Key, torch.Tensor] = {}
        labels = _group_labels([g["use_muon"] for g in self.param_groups])
        claimed = set()
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"load_state_dict: parameter group {i} has {len(saved['params'])} parameters in the "
                    f"state_dict and {len(group['params'])} here"
                )
            route = group["use_muon"]
            if saved.get("use_muon", route) != route:
                raise ValueError(
                    f"load_state_dict: parameter group {i} is a {'Muon' if route else 'AdamW'} group here "
                    f"and a {'Muon' if not route else 'AdamW'} group in the state_dict"
                )
            for index, p in zip(saved["params"], group["params"]):
                slot = self._slots[p]
                name = f"{_tree.dotted(slot.key)!r} (index {index})"
                if index not in saved_state:
                    raise ValueError(f"load_state_dict: the state_dict has no state for parameter {name}")
                claimed.add(index)
                entry = saved_state[index]
                expected = _STATE_NAMES[route]
                if set(entry) != set(expected):
                    raise ValueError(
                        f"load_state_dict: parameter {name} has state {sorted(entry)}, expected {sorted(expected)}"
                    )
                for torch_name, field in expected.items():
                    entries[(labels[i], field, *slot.key)] = _loaded_value(name, torch_name, entry[torch_name], p)
            new_group = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            new_group["params"] = group["params"]
            if "param_names" in group:
                new_group["param_names"] = group["param_names"]
            new_group["use_muon"] = route
            for key, default in self.defaults.items():
                new_group.setdefault(key, default)
            _check_scheduled(i, new_group)
            self._branch(new_group, _new_scalars(new_group))  # the core checks the other settings
            groups.append(new_group)
        unclaimed = [k for k in saved_state if k not in claimed]
        if unclaimed:
            raise ValueError(f"load_state_dict: the state_dict has state for parameter ids {unclaimed} in no group")
        state = self._checked_state(TensorDict(entries, batch_size=[]), "load_state_dict")

        self.param_groups = groups
        self._functional_state = state
        self._cache = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        # the cached transform closes over this instance's scalar tensors; a copy builds its own
        return {k: v for k, v in self.__dict__.items() if k != "_cache"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._cache = None


def _loaded_value(name: str, torch_name: str, value: Any, param: torch.Tensor) -> torch.Tensor:
    """A state_dict entry cast as ``torch.optim`` casts it; a step count must be a whole number."""
    if torch_name == "step":
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"load_state_dict: parameter {name} has a step of shape {tuple(value.shape)}")
        count = float(value)
        if not (math.isfinite(count) and count >= 0 and count == int(count)):
            raise ValueError(f"load_state_dict: parameter {name} has step {value!r}; expected a count >= 0")
        return torch.tensor(int(count), dtype=torch.int64, device=param.device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"load_state_dict: parameter {name}: {torch_name} is a {type(value).__name__}, not a tensor")
    if value.shape != param.shape:
        raise ValueError(
            f"load_state_dict: parameter {name}: {torch_name} has shape {tuple(value.shape)}, "
            f"the parameter {tuple(param.shape)}"
        )
    return value.to(dtype=param.dtype, device=param.device)


class _ParamState(MutableMapping[torch.Tensor, dict[str, Any]]):
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
        return {name: state.get((slot.label, field, *slot.key)) for name, field in _STATE_NAMES[slot.use_muon].items()}

    def __setitem__(self, p: torch.Tensor, value: dict[str, Any]) -> None:
        slot = self._optimizer._slots.get(p)
        if slot is None:
            self._others[p] = value
            return
        expected = _STATE_NAMES[slot.use_muon]
        if set(value) != set(expected):
            raise ValueError(f"state of {_tree.dotted(slot.key)!r} must have {sorted(expected)}, got {sorted(value)}")
        state = self._optimizer._functional_state
        entries = {}
        for name, field in expected.items():
            key = (slot.label, field, *slot.key)
            entries[key] = conform(
                TensorDict({key: value[name]}, batch_size=[]), state.select(key), f"state[{_tree.dotted(slot.key)!r}]"
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
        fresh = optimizer._branch(group, _new_scalars(group)).init(TensorDict({slot.key: p.detach()}, batch_size=[]))
        self[p] = {name: fresh.get((field, *slot.key)) for name, field in _STATE_NAMES[slot.use_muon].items()}

    def __contains__(self, p: object) -> bool:
        return p in self._optimizer._slots or p in self._others

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from self._optimizer._slots
        yield from self._others

    def __len__(self) -> int:
        return len(self._optimizer._slots) + len(self._others)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"
