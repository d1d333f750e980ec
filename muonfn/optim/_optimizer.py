"""The ``torch.optim.Optimizer`` shim: param groups translated into the presets' branches, the state
kept as torch keeps it (``opt.state[p]``, under torch's names) and handed to ``Transform.update``
as a TensorDict."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from tensordict import TensorDictBase

from .. import transforms
from .._tree import build, named_table
from .._validation import flag, non_negative, positive, unit_interval
from ..linalg import SCALE_MODES, NewtonSchulz, Orthogonalizer, ns_schedule, polar, qr_orthogonal
from ..presets import (
    MUON,
    VARIANT_DEFAULTS,
    VARIANT_OPTIONS,
    VARIANTS,
    adaptation,
    label_params,
    matrix_branch,
    warn_routing,
)
from ..steps import adamw
from ..transforms import LabelsLike, MaskLike, Transform, check_input
from . import _migration, _routing

#: A Muon group's settings besides the scheduled ones, and what a change of them rebuilds.
MUON_SETTINGS = (
    "nesterov", "variant", "momentum_bias_correction", "cautious_weight_decay", "cautious_mode", "ns_coefficients",
    "ns_steps", "eps", "ns_dtype", "ns_method", "ns_eps_mode", "ns_restarts", "adjust_lr_fn", "extra_scale",
)  # fmt: skip
#: An AdamW group's settings besides the scheduled ones. Its β₁ is ``momentum``: torch's schedulers that
#: cycle momentum (OneCycleLR, CyclicLR) write ``"momentum"`` into every group unless ``"betas"`` is a
#: default, so they move Muon's momentum and AdamW's β₁ alike.
ADAMW_SETTINGS = ("beta2", "eps", "nesterov", "cautious_weight_decay")
#: The settings a scheduler may change every step: refilled into the transform's 0-d tensors.
SCHEDULED = {True: ("lr", "momentum", "weight_decay"), False: ("lr", "momentum", "weight_decay")}
#: The state entries under torch's names, by their place in a group's functional state.
TORCH_NAMES = {
    ("momentum",): "momentum_buffer",
    ("second_moment", "exp_avg_sq"): "exp_avg_sq",
    ("second_moment", "step"): "second_moment_step",
}
#: ``chunk_numel="auto"``: about this many parts, each of at least ``AUTO_MIN_CHUNK`` elements
AUTO_PARTS, AUTO_MIN_CHUNK = 10, 2**18


class Muon(torch.optim.Optimizer):
    r"""Muon (or NorMuon, AdaMuon) for matrices and AdamW for the rest, as a ``torch.optim.Optimizer``.

    It takes torch.optim.Muon's keywords with their meaning (``ns_coefficients`` one ``(a, b, c)`` for
    each of ``ns_steps``, or a schedule's name; ``eps``; ``adjust_lr_fn``: ``None`` or ``"original"``,
    ``"match_rms_adamw"``, and muonfn's other scale modes), and :func:`muonfn.muon`'s others. See
    :mod:`muonfn.optim` for how groups and state are laid out.

    Args:
        params: ``model.named_parameters()`` (names drive ``labels``), tensors, or param-group dicts.
            A dict may set any group setting, ``"use_muon": True/False`` to route the whole group, or,
            leaving routing to ``labels``, ``adamw_lr`` and ``adamw_weight_decay`` for its AdamW half.
        lr, weight_decay, momentum, nesterov: as torch.optim.Muon's (``None``: the variant's default:
            0.95 and ``True`` for Muon and NorMuon, 0.9 and ``False`` for AdaMuon).
        variant: the Muon groups' rule: ``"muon"``, ``"normuon"`` or ``"adamuon"`` (:func:`muonfn.normuon`,
            :func:`muonfn.adamuon`); ``beta2``, ``adaptive_eps``, ``rescale``, ``sign_momentum`` and
            ``second_moment_bias_correction`` are their options (``None``: the variant's default).
        ns: Newton–Schulz settings beyond torch's spellings, a :class:`~muonfn.NewtonSchulz` (its
            ``dtype``, ``method``, ``eps_mode``, ``restarts``), or ``"svd"``, ``"qr"``, a map of one's own.
        adjust_lr_fn: the shape scale (``"match_rms_adamw"`` by default: start from AdamW's learning rate).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, adamw_nesterov: the AdamW groups'
            ``lr``, ``(momentum, beta2)``, ``eps``, ``weight_decay``, ``nesterov`` (``None``: the Muon value).
            An AdamW group's β₁ is its ``momentum``, so that schedulers cycling momentum move it too.
        labels, views, weight_decay_mask, orthogonalizer: as :func:`muonfn.muon`'s, given once.
        donate_state: the state is updated in place (``True``), as torch.optim's is.
        chunk_numel: step the parameters in parts of at most this many elements, each part's update
            added before the next is computed (the step's temporaries hold one part: peak memory near
            torch.optim's); ``"auto"``: a tenth of the parameters, at least 2**18; ``None``: one part.
        compile: run the step's arithmetic as one ``torch.compile(fullgraph=True)`` graph (a mapping:
            ``torch.compile``'s keywords), recompiled only when its structure changes; the checks run
            eagerly before it.

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
        weight_decay: float = 0.1,
        momentum: float | None = None,
        nesterov: bool | Literal["add"] | None = None,
        ns_coefficients: Any = "keller",
        eps: float = 1e-7,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = "match_rms_adamw",
        variant: str = "muon",
        beta2: float | None = None,
        adaptive_eps: float | None = None,
        rescale: str | None = None,
        sign_momentum: bool | None = None,
        second_moment_bias_correction: bool | None = None,
        momentum_bias_correction: bool = False,
        cautious_weight_decay: bool = False,
        cautious_mode: str | None = None,
        ns: Any = None,
        extra_scale: float = 1.0,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        adamw_nesterov: bool | str = False,
        labels: LabelsLike | None = None,
        views: Any = None,
        weight_decay_mask: MaskLike = None,
        orthogonalizer: Orthogonalizer | None = None,
        donate_state: bool = True,
        chunk_numel: int | Literal["auto"] | None = "auto",
        compile: bool | Mapping[str, Any] = False,
    ) -> None:
        for name, value in (("lr", lr), ("adamw_lr", adamw_lr)):
            if callable(value) and not isinstance(value, torch.Tensor):
                raise TypeError(f"Muon({name}=...) takes a number; schedule it with torch.optim.lr_scheduler")
        flag("Muon(...): donate_state", donate_state)
        if labels is not None:
            transforms.check_table("Muon(...): labels", labels)
        transforms.check_mask("Muon(...): weight_decay_mask", weight_decay_mask)
        if chunk_numel not in (None, "auto") and (
            isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1
        ):
            raise ValueError(f"chunk_numel must be a positive int, 'auto' or None, got {chunk_numel!r}")
        if not isinstance(compile, bool | Mapping):
            raise TypeError(f"compile must be True, False or a mapping of torch.compile's keywords, got {compile!r}")
        self._labels, self._views, self._mask = labels, views, weight_decay_mask
        self._orthogonalizer, self._donate = orthogonalizer, donate_state
        self._chunk_numel, self._compile = chunk_numel, compile
        self._muon_defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov, "variant": variant,
            "momentum_bias_correction": momentum_bias_correction, "cautious_weight_decay": cautious_weight_decay,
            "cautious_mode": cautious_mode, **_ns_entries(ns, ns_coefficients, ns_steps, eps),
            "adjust_lr_fn": adjust_lr_fn, "extra_scale": extra_scale, "beta2": beta2, "adaptive_eps": adaptive_eps,
            "rescale": rescale, "sign_momentum": sign_momentum,
            "second_moment_bias_correction": second_moment_bias_correction,
        }  # fmt: skip
        self._adamw_defaults = {
            "lr": lr if adamw_lr is None else adamw_lr,
            "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            "momentum": adamw_betas[0], "beta2": adamw_betas[1], "eps": adamw_eps, "nesterov": adamw_nesterov,
            "cautious_weight_decay": cautious_weight_decay,
        }  # fmt: skip
        self._split_halves = {"adamw_lr": adamw_lr, "adamw_weight_decay": adamw_weight_decay}
        self._given_variant_options = {
            k: v for k, v in self._muon_defaults.items() if k in VARIANT_OPTIONS and v is not None
        }
        self._transforms: dict[int, tuple[Any, Transform, dict[str, torch.Tensor]]] = {}
        self._layouts: dict[Transform, dict[tuple[str, ...], str]] = {}
        self._compiled: dict[Any, Callable[..., Any]] = {}
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        for i, group in enumerate(self.param_groups):
            self._transform(i, group)  # every group's settings checked now
        idle = _routing.idle_muon(self.param_groups)
        if idle is not None:
            warn_routing(idle)

    # ------------------------------------------------------------------------------------------ groups

    @torch._disable_dynamo
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds parameters; a group without ``"use_muon"`` is split by ``labels`` into a Muon group and an
        AdamW group (both kept, even when empty). Checked before anything changes."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else params
        if isinstance(params, set):
            raise TypeError("optimizer parameters need a deterministic order: pass a list, not a set")
        params = list(params)
        named = [isinstance(p, tuple) for p in params]
        if any(named) and not all(named):
            raise ValueError("all optimizer params should be with or without names; some names are missing")
        names = [n for n, _ in params] if params and all(named) else None
        tensors = [p for _, p in params] if names is not None else params
        for p in tensors:
            if isinstance(p, torch.Tensor) and not p.is_floating_point():
                raise TypeError(f"parameter of dtype {p.dtype}: only floating-point tensors train")
        use_muon = param_group.get("use_muon")
        if use_muon is None:
            positions = len([p for g in self.param_groups for p in g["params"]])
            keys = names or [str(positions + i) for i in range(len(tensors))]
            detached = build({k: p.detach() for k, p in zip(keys, tensors)}, torch.Size([]))
            routes = transforms.route(self._labels or label_params, detached, (MUON, "adamw"))
            parts = [(True, [i for i, k in enumerate(keys) if routes[k] == MUON])]
            parts.append((False, [i for i, k in enumerate(keys) if routes[k] != MUON]))
            _routing.warn_if_routed_blind(self, self._labels or label_params, names, [tensors[i] for i in parts[0][1]])
        elif isinstance(use_muon, bool):
            for half in self._split_halves:
                if half in param_group:
                    raise ValueError(
                        f"{half!r} sets the AdamW half of a group split by labels; this group has use_muon={use_muon}"
                    )
            parts = [(use_muon, list(range(len(tensors))))]
        else:
            raise TypeError(f"use_muon must be True or False, got {use_muon!r}")
        new = [self._group(param_group, route, [tensors[i] for i in members], names and [names[i] for i in members])
               for route, members in parts]  # fmt: skip
        count = len(self.param_groups)
        try:
            for group in new:
                super().add_param_group(group)
                self._transform(len(self.param_groups) - 1, group)
        except Exception:
            del self.param_groups[count:]
            raise

    def _group(
        self, given: Mapping[str, Any], use_muon: bool, tensors: list[Any], names: list[str] | None
    ) -> dict[str, Any]:
        """A group of one kind from a group dict: the settings that act on it, the others refused."""
        defaults = self._muon_defaults if use_muon else self._adamw_defaults
        own = {k: v for k, v in given.items() if k not in ("params", "param_names", "use_muon", *self._split_halves)}
        if not use_muon and "use_muon" not in given:  # the AdamW half of a split group
            own = {k: v for k, v in own.items() if k in ("lr", "weight_decay", "cautious_weight_decay")}
            for half, key in (("adamw_lr", "lr"), ("adamw_weight_decay", "weight_decay")):
                value = given.get(half, self._split_halves[half])
                if value is not None:
                    own[key] = value
        if use_muon and "ns" in own:
            own.update(
                _ns_entries(
                    own.pop("ns"), own.pop("ns_coefficients", "keller"), own.pop("ns_steps", None), own.pop("eps", 1e-7)
                )
            )
        unknown = set(own) - set(defaults) - {"initial_lr"}
        if unknown and (use_muon or "use_muon" in given):
            raise ValueError(f"param group: {sorted(unknown)} set nothing in a {'Muon' if use_muon else 'AdamW'} group")
        group: dict[str, Any] = {**defaults, **own, "params": tensors, "use_muon": use_muon}
        if names is not None:
            group["param_names"] = names
        if use_muon:
            _resolve_variant(group, set(own) | set(self._given_variant_options))
        return group

    def _transform(self, index: int, group: dict[str, Any]) -> Transform:
        """The group's branch, rebuilt when a setting that shapes it changed; its scheduled values refilled."""
        where = f"param group {index}"
        kind = bool(group.get("use_muon"))
        if kind != ("variant" in group):
            raise ValueError(f"{where}: use_muon={group.get('use_muon')!r} does not match its settings")
        settings = MUON_SETTINGS if kind else ADAMW_SETTINGS
        signature = (
            kind,
            *(_comparable(group.get(k)) for k in settings),
            *(_comparable(group.get(k)) for k in VARIANT_OPTIONS),
        )
        cached = self._transforms.get(index)
        for name in SCHEDULED[kind]:
            value = _number(where, name, group[name])
            (unit_interval if name == "momentum" else non_negative)(f"{where}: {name}", value)
        if cached is None or cached[0] != signature:
            scalars = {
                name: torch.tensor(_number(where, name, group[name]), dtype=torch.float64) for name in SCHEDULED[kind]
            }
            try:
                tx = self._branch(group, scalars)
            except (ValueError, TypeError) as error:
                raise type(error)(f"{where}: {error}") from error
            cached = self._transforms[index] = (signature, tx, scalars)
        for name, tensor in cached[2].items():
            tensor.fill_(_number(where, name, group[name]))
        return cached[1]

    def _branch(self, group: Mapping[str, Any], scalars: Mapping[str, torch.Tensor]) -> Transform:
        lr, wd = scalars["lr"], scalars["weight_decay"]
        if not group["use_muon"]:
            positive("eps", group["eps"])
            betas = (scalars["momentum"], group["beta2"])
            return adamw(lr, betas=betas, eps=group["eps"], weight_decay=wd, weight_decay_mask=self._mask,
                         nesterov=group["nesterov"], cautious_weight_decay=group["cautious_weight_decay"],
                         donate_state=self._donate)  # fmt: skip
        variant = group["variant"]
        options = {k: group[k] for k in VARIANT_OPTIONS if k in group}
        adapt = adaptation(variant, momentum_bias_correction=group["momentum_bias_correction"], **options)
        return matrix_branch(
            adapt, lr, scalars["momentum"], group["nesterov"], group["momentum_bias_correction"], wd,
            group["cautious_weight_decay"], group["cautious_mode"], _ns_of(group), _scale_of(group["adjust_lr_fn"]),
            group["extra_scale"], self._views, self._mask, self._orthogonalizer, self._donate,
        )  # fmt: skip

    @property
    def transform(self) -> Transform:
        """The one-group optimizer's branch (:func:`muonfn.transforms.partition` of the groups' otherwise)."""
        branches = {
            label: self._transform(i, g) for i, (label, g) in enumerate(zip(self._labels_of(), self.param_groups))
        }
        names = {n: label for label, g, ns in zip(self._labels_of(), self.param_groups, self._names()) for n in ns}
        return transforms.partition(branches, names)

    # ------------------------------------------------------------------------------------------ state

    def _labels_of(self) -> list[str]:
        """``"muon"``, ``"adamw"``, ``"muon_1"``, ...: the k-th group of a kind is labelled with suffix k."""
        seen = {True: 0, False: 0}
        out = []
        for group in self.param_groups:
            kind = group["use_muon"]
            out.append(("muon" if kind else "adamw") + (f"_{seen[kind]}" if seen[kind] else ""))
            seen[kind] += 1
        return out

    def _names(self) -> list[list[str]]:
        """Every group's parameter names: ``param_names``, or positions across groups."""
        out, position = [], 0
        for group in self.param_groups:
            names = group.get("param_names") or [str(position + i) for i in range(len(group["params"]))]
            out.append(list(names))
            position += len(group["params"])
        return out

    def _layout(self, tx: Transform, p: torch.Tensor) -> dict[tuple[str, ...], str]:
        """Where a parameter's entries sit in its group's functional state -> their torch names (by the
        transform's ``init`` of a meta matrix, once per transform)."""
        layout = self._layouts.get(tx)
        if layout is None:
            probe = build({"p": torch.empty((2, 2), device="meta")}, torch.Size([]))
            paths = [path[:-1] for path, _ in transforms._state_leaves(tx.init(probe), ()) if path[-1] == "p"]
            layout = self._layouts[tx] = {path: TORCH_NAMES.get(path, "_".join(path)) for path in paths}
        return layout

    def _group_state(self, tx: Transform, names: list[str], params: list[torch.Tensor], fresh: bool) -> TensorDictBase:
        """The functional state of ``params`` (named ``names``) from ``opt.state``; a parameter without
        state (or with another layout's) gets what ``init`` makes (``fresh``: all of them do)."""
        layout = self._layout(tx, params[0]) if params else {}
        missing = [i for i, p in enumerate(params) if fresh or not set(layout.values()) <= set(self.state[p])]
        made = tx.init(build({names[i]: params[i].detach() for i in missing}, torch.Size([]))) if missing else None
        made_at = set(missing)
        entries: dict[str, Any] = {}
        for path, torch_name in layout.items():
            leaves = {}
            for i, (name, p) in enumerate(zip(names, params)):
                leaves[name] = made.get((*path, name)) if i in made_at else self.state[p][torch_name]  # type: ignore[union-attr]
            node = entries
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = build(leaves, torch.Size([]))
        return _nested(entries)

    def _write_state(self, tx: Transform, names: list[str], params: list[torch.Tensor], state: TensorDictBase) -> None:
        for path, torch_name in (self._layout(tx, params[0]) if params else {}).items():
            held = state.get(path)
            for name, p in zip(names, params):
                self.state[p][torch_name] = held[name]

    @property
    def functional_state(self) -> TensorDictBase:
        """The state as ``Transform.update`` takes it: ``{label: group state}``, per-leaf entries keyed by
        parameter name (parameters that have not stepped yet at their initial values). Assigning one
        (from this optimizer, or ``muonfn.muon(...).init``/``update`` for the same parameters) replaces
        the state after checking its entries, shapes, dtypes and devices; on a mismatch nothing changes."""
        out = {}
        for i, (label, group, names) in enumerate(zip(self._labels_of(), self.param_groups, self._names())):
            out[label] = self._group_state(self._transform(i, group), names, group["params"], fresh=False)
        return build(out, torch.Size([]))

    @functional_state.setter
    def functional_state(self, state: TensorDictBase) -> None:
        pending = []
        for i, (label, group, names) in enumerate(zip(self._labels_of(), self.param_groups, self._names())):
            tx, params = self._transform(i, group), group["params"]
            held = state.get(label) if isinstance(state, TensorDictBase) else None
            if held is None:
                raise ValueError(f"functional_state: missing {label!r}")
            check_input(tx.init, build({n: p.detach() for n, p in zip(names, params)}, torch.Size([])), held,
                        build({n: p.detach() for n, p in zip(names, params)}, torch.Size([])))  # fmt: skip
            pending.append((tx, names, params, held))
        for tx, names, params, held in pending:
            self._write_state(tx, names, params, held)

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
            work = self._checked_work()
            if work:
                run = self._compiled_run(work) if self._compile else _run
                for tx, names, params, new_state in run(work):
                    self._write_state(tx, names, params, new_state)
        return loss

    def _checked_work(self) -> list[tuple[Transform, list[str], list[torch.Tensor], TensorDictBase, TensorDictBase]]:
        """Every part's transform, names, parameters, gradients and state, all checked."""
        seen: dict[torch.Tensor, int] = {}
        work = []
        for i, (group, names) in enumerate(zip(self.param_groups, self._names())):
            for p in group["params"]:
                if seen.setdefault(p, i) != i:
                    raise ValueError(
                        f"param group {i} holds a parameter of param group {seen[p]}; a parameter steps in one group"
                    )
            tx = self._transform(i, group)
            stepped = [(n, p) for n, p in zip(names, group["params"]) if p.grad is not None]
            parts = [self._inputs(tx, part) for part in self._parts(stepped)]
            if len(parts) > 1:  # (checked as one, then stepped in parts)
                checked = self._inputs(tx, stepped)
            elif parts:
                checked = parts[0]
            else:
                continue
            try:
                check_input(tx.init, checked[3], checked[4], checked[5])
            except ValueError as error:
                raise ValueError(f"param group {i}: {error}") from None
            work += parts
        return work

    def _inputs(self, tx: Transform, part: list[tuple[str, torch.Tensor]]) -> tuple[Any, ...]:
        """A part's transform, names, parameters, gradients, state and parameters as leaves."""
        names, params = [n for n, _ in part], [p for _, p in part]
        grads = build({n: p.grad for n, p in part}, torch.Size([]))
        leaves = build({n: p.detach() for n, p in part}, torch.Size([]))
        return tx, names, params, grads, self._group_state(tx, names, params, fresh=False), leaves

    def _parts(self, stepped: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        """``stepped`` in parts of at most ``chunk_numel`` elements, same shapes kept together (a
        Newton–Schulz call that fits a part keeps its bits)."""
        if not stepped or self._chunk_numel is None:
            return [stepped] if stepped else []
        total = sum(p.numel() for _, p in stepped)
        cap = max(AUTO_MIN_CHUNK, math.ceil(total / AUTO_PARTS)) if self._chunk_numel == "auto" else self._chunk_numel
        kinds: dict[Any, list[tuple[str, torch.Tensor]]] = {}
        for n, p in stepped:
            kinds.setdefault((p.dtype, tuple(sorted(p.shape)) if p.ndim == 2 else tuple(p.shape)), []).append((n, p))
        parts: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for members in kinds.values():
            for n, p in members:
                if parts[-1] and size + p.numel() > cap:
                    parts.append([])
                    size = 0
                parts[-1].append((n, p))
                size += p.numel()
        return parts

    def _compiled_run(self, work: list[Any]) -> Callable[..., Any]:
        signature = tuple((id(w[0]), tuple(w[1]), tuple((p.shape, p.dtype) for p in w[2])) for w in work)
        if signature not in self._compiled:
            if len(self._compiled) >= 8:
                return _run
            options = {"fullgraph": True, **(self._compile if isinstance(self._compile, Mapping) else {})}
            self._compiled[signature] = torch.compile(_run, **options)
        return self._compiled[signature]

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's format, ``{"state": {index: {name: tensor}}, "param_groups": [...]}``; loads with
        ``torch.load(weights_only=True)`` (a map of one's own as ``ns_method`` is left out)."""
        packed = super().state_dict()
        for group in packed["param_groups"]:
            if callable(group.get("ns_method")):
                group["ns_method"] = "standard"
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict`: the saved settings and state replace these; a mismatch raises
        naming the parameter and changes nothing. State tensors go to their parameter's device (the
        step counts stay exact int64, the second moments of fp16 parameters fp32)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"load_state_dict: {len(saved)} param groups saved, {len(self.param_groups)} here")
        for i, (ours, theirs) in enumerate(zip(self.param_groups, saved)):
            if len(ours["params"]) != len(theirs["params"]) or bool(ours["use_muon"]) != bool(theirs.get("use_muon")):
                raise ValueError(
                    f"load_state_dict: param group {i} does not match the saved one (its size or use_muon)"
                )
        callables = [g.get("ns_method") for g in self.param_groups]
        before = [dict(g) for g in self.param_groups], {p: dict(s) for p, s in self.state.items()}
        try:
            super().load_state_dict(state_dict)
            for group, method in zip(self.param_groups, callables):
                if callable(method) and group.get("ns_method") == "standard":
                    group["ns_method"] = method
            self._check_loaded()
        except Exception:
            for group, kept in zip(self.param_groups, before[0]):
                group.clear()
                group.update(kept)
            self.state.clear()
            self.state.update(before[1])
            raise

    def _check_loaded(self) -> None:
        """The loaded state of every parameter, cast back where torch's load cast it, checked."""
        for i, (group, names) in enumerate(zip(self.param_groups, self._names())):
            tx = self._transform(i, group)
            params = [p for p in group["params"] if self.state.get(p)]
            if not params:
                continue
            expected = tx.init(
                build({n: p.detach() for n, p in zip(names, group["params"]) if p in params}, torch.Size([]))
            )
            for path, torch_name in self._layout(tx, params[0]).items():
                for name, p in zip(names, group["params"]):
                    if p in params and torch_name in self.state[p]:
                        like = expected.get((*path, name))
                        value = self.state[p][torch_name]
                        if value.shape != like.shape:
                            raise ValueError(
                                f"load_state_dict: state {torch_name!r} of parameter {name!r} has shape "
                                f"{tuple(value.shape)}, expected {tuple(like.shape)}"
                            )
                        self.state[p][torch_name] = value.to(dtype=like.dtype, device=like.device)

    def load_torch_state_dicts(
        self, muon_state_dict: dict[str, Any], adamw_state_dict: dict[str, Any] | None = None
    ) -> None:
        """Continues a run of ``torch.optim.Muon`` (with ``torch.optim.AdamW`` for the other parameters):
        this optimizer's Muon groups take the Muon state_dict's groups in order, its AdamW groups the AdamW
        state_dict's, parameter by parameter (checked by shape, and by name where both have names), every
        group key carried. A mismatch raises naming the group or parameter and changes nothing."""
        self.load_state_dict(_migration.shim_state_dict(self, muon_state_dict, adamw_state_dict))

    def torch_state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(muon_state_dict, adamw_state_dict)`` for ``torch.optim.Muon`` and ``torch.optim.AdamW``
        built with this optimizer's Muon and AdamW groups, in order; raises naming a group whose settings
        torch's optimizers cannot run."""
        return _migration.torch_state_dicts(self)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_transforms", "_compiled", "_layouts")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._transforms, self._compiled, self._layouts = {}, {}, {}


def _run(work: list[Any]) -> list[tuple[Transform, list[str], list[torch.Tensor], TensorDictBase]]:
    """Each part's update, added to its parameters before the next part is computed."""
    out = []
    with transforms.entered():
        for tx, names, params, grads, state, leaves in work:
            updates, new_state = tx.update(grads, state, leaves)
            torch._foreach_add_(params, list(updates.values()))
            out.append((tx, names, params, new_state))
    return out


def _nested(entries: dict[str, Any]) -> TensorDictBase:
    return build({k: _nested(v) if isinstance(v, dict) else v for k, v in entries.items()}, torch.Size([]))


def _number(where: str, name: str, value: Any) -> float:
    """A group's number; like torch, a one-element real tensor is one."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex() or value.is_meta:
            raise ValueError(f"{where}: {name} must be a real number, got a tensor {value!r}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def _comparable(value: Any) -> Any:
    return float(value) if isinstance(value, torch.Tensor) else (type(value), repr(value))


def _resolve_variant(group: dict[str, Any], given: set[str]) -> None:
    """A Muon group's ``None`` settings take its variant's defaults; an option its variant does not take
    is an error where given, and dropped where inherited from defaults meant for another variant."""
    variant = group["variant"]
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    defaults = VARIANT_DEFAULTS[variant]
    for name in ("momentum", "nesterov", *VARIANT_OPTIONS):
        if name not in defaults:
            if group.get(name) is not None and name in given:
                takers = [v for v in VARIANTS if name in VARIANT_DEFAULTS[v]]
                raise ValueError(
                    f"{name} does not apply to variant {variant!r}; it is an option of "
                    f"{' and '.join(map(repr, takers))}"
                )
            group.pop(name, None)
        elif group.get(name) is None:
            group[name] = defaults[name]


def _ns_entries(ns: Any, coefficients: Any, steps: int | None, eps: float) -> dict[str, Any]:
    """A group's Newton–Schulz entries, data a state_dict holds: torch's spellings (one triple for each
    of ``steps``, 5 when not given), or a whole ``ns`` (a :class:`~muonfn.NewtonSchulz`, ``"svd"``,
    ``"qr"``, a map of one's own as ``ns_method``) with torch's spellings at their defaults."""
    if ns is not None:
        if coefficients != "keller" or steps is not None or eps != 1e-7:
            raise ValueError(
                "ns= is the whole Newton–Schulz setting: leave ns_coefficients, ns_steps and eps out with it"
            )
        if isinstance(ns, NewtonSchulz):
            return {
                "ns_coefficients": _plain(ns.coefficients), "ns_steps": ns.steps, "eps": ns.eps, "ns_dtype": ns.dtype,
                "ns_method": ns.method, "ns_eps_mode": ns.eps_mode, "ns_restarts": ns.restarts,
            }  # fmt: skip
        method = "svd" if ns is polar else "qr" if ns is qr_orthogonal else ns
        return {**_ns_entries(None, "keller", None, 1e-7), "ns_method": method}
    if _migration.is_torch_triple(coefficients):
        coefficients, steps = ((tuple(float(v) for v in coefficients),) * (5 if steps is None else steps)), None
    ns_schedule(coefficients, steps)
    return {"ns_coefficients": _plain(coefficients), "ns_steps": steps, "eps": eps, "ns_dtype": None,
            "ns_method": "standard", "ns_eps_mode": "clamp", "ns_restarts": None}  # fmt: skip


def _plain(coefficients: Any) -> Any:
    """A schedule as data ``torch.load(weights_only=True)`` reads: a name, or triples (a norm factor
    other than 1 in front as ``("norm_factor", c)``)."""
    if isinstance(coefficients, str):
        return coefficients
    schedule = ns_schedule(coefficients)
    plain = tuple(tuple(t) for t in schedule.triples)
    return (("norm_factor", schedule.norm_factor), *plain) if schedule.norm_factor != 1.0 else plain


def _ns_of(group: Mapping[str, Any]) -> Any:
    method = group["ns_method"]
    if method in ("svd", "qr") or callable(method):
        return {"svd": polar, "qr": qr_orthogonal}.get(method, method) if isinstance(method, str) else method
    coefficients = group["ns_coefficients"]
    if isinstance(coefficients, tuple) and coefficients and coefficients[0][:1] == ("norm_factor",):
        from ..linalg import Coefficients

        coefficients = Coefficients(tuple(coefficients[1:]), coefficients[0][1])
    restarts = group["ns_restarts"]
    return NewtonSchulz(coefficients, group["ns_steps"], group["eps"], group["ns_dtype"], method,
                        group["ns_eps_mode"], None if restarts is None else tuple(restarts))  # fmt: skip


def _scale_of(adjust_lr_fn: Any) -> Any:
    """torch's ``adjust_lr_fn`` (``None``: ``"original"``) or one of muonfn's scale modes."""
    if adjust_lr_fn is None:
        return "original"
    if not isinstance(adjust_lr_fn, str) or adjust_lr_fn not in SCALE_MODES:
        raise ValueError(f"adjust_lr_fn must be None or one of {sorted(SCALE_MODES)}, got {adjust_lr_fn!r}")
    return adjust_lr_fn


_ = named_table
