"""The ``torch.optim.Optimizer`` subclass: translates param groups into the presets' branches."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _tree
from .._gc_pause import pause_collections, resume_collections
from .._validation import Scalar, flag, positive
from ..linalg import CoefficientsLike, EpsMode, MatrixFn, Orthogonalizer, ScaleMode
from ..presets import (
    ADAMW,
    MUON,
    Variant,
    adamw,
    check_names,
    label_params,
    matrix_branch,
    muon_orthogonalizer,
    refuse_collectives,
    warn_routing,
)
from ..transforms import (
    CautiousMode,
    LabelsLike,
    MaskLike,
    MethodLike,
    Rescale,
    Transform,
    ViewsLike,
    as_rule,
    check_labels,
    check_mask,
    check_rule,
    check_views,
    mask_table,
    newton_schulz_setting,
    resolve_labels,
    resolve_views,
)
from . import _groups, _migration, _routing
from ._layout import Layout
from ._migration import NOT_GIVEN, NotGiven
from ._param_state import ParamState
from ._state_dict import packed_state_dict, translate_state_dict
from ._step_parts import StepInputs, parts_applier

if TYPE_CHECKING:
    from ..distributed import Collectives, Replicated, ShardSpecs, Strategy


class Muon(torch.optim.Optimizer):
    r"""Muon (or NorMuon, AdaMuon) for matrices and AdamW for the rest, as a ``torch.optim.Optimizer``.

    Takes exactly the keywords of :func:`muonfn.muon`, :func:`muonfn.normuon` and
    :func:`muonfn.adamuon` (see there for the math), with their defaults but those below, and
    its own (``variant``, ``chunk_numel``, ``compile``, torch's ``adjust_lr_fn`` and ``eps``);
    it steps with the ``update`` of the same branches. See :mod:`muonfn.optim` for how groups
    and state are laid out.

    Args:
        params: ``model.named_parameters()`` (names drive ``labels``), an iterable of
            tensors, or param-group dicts. A dict with ``"use_muon": True/False`` routes the
            whole group and may set its entries (below; an AdamW group's also by the
            ``adamw_betas``, ``adamw_eps`` and ``adamw_nesterov`` spellings); one that leaves
            routing to ``labels`` takes the constructor's keywords, its ``adamw_*`` for its
            AdamW half.
        lr: a number (or a one-element tensor); schedule it with ``torch.optim.lr_scheduler``.
        variant: the Muon groups' rule: ``"muon"``; ``"normuon"`` or ``"adamuon"``, the
            matrix branch of :func:`muonfn.normuon` or :func:`muonfn.adamuon`. A group dict
            may set its own.
        momentum, nesterov: ``None`` means the variant's default: 0.95 and ``True`` for Muon
            and NorMuon, 0.9 and ``False`` for AdaMuon.
        beta2, adaptive_eps, rescale: NorMuon's and AdaMuon's options (``None``: the preset's
            default); an error with ``variant="muon"``.
        sign_momentum, second_moment_bias_correction: AdaMuon's options (``None``: the
            preset's default); an error with another variant.

    The other keywords are those of :func:`muonfn.muon` (``scale=None`` and ``ns_eps=None``
    mean its defaults, ``"match_rms_adamw"`` and ``1e-7``). They are kept in every Muon group,
    which a group dict may set, but ``labels``, ``views``, ``weight_decay_mask``,
    ``bucket_numel``, the distributed ones and ``donate_state``, given once. An AdamW group
    holds AdamW's settings only: ``lr`` and ``weight_decay`` (``adamw_lr``,
    ``adamw_weight_decay``; ``None``: the Muon value), ``momentum`` and ``beta2``
    (``adamw_betas``: its beta1 is ``momentum``, so that schedulers that cycle momentum cycle it
    as they cycle torch.optim.AdamW's), ``eps`` (``adamw_eps``), ``nesterov``
    (``adamw_nesterov``) and ``cautious_weight_decay`` (which applies to both kinds of group).
    ``ns=`` (the whole Newton–Schulz setting, in the constructor or a group
    dict) is kept in a group as its plain ``ns_*`` entries (:func:`muonfn.polar` as
    ``ns_method="svd"``, :func:`muonfn.linalg.qr_orthogonal` as ``"qr"``); a map of one's own as
    ``ns_method``, which :meth:`state_dict` leaves out (``torch.load(weights_only=True)`` reads
    no functions) and :meth:`load_state_dict` keeps as the loading optimizer has it, as it keeps
    ``views`` and ``labels``. ``labels``, ``views``, ``weight_decay_mask`` and ``shard_specs`` are
    checked against the parameters' names at construction: a typo is an error.
    ``donate_state`` is ``True`` here: the state is updated in place, as torch.optim's is
    (``donate_state=False`` allocates a new state each step). ``chunk_numel`` steps the
    parameters in parts of at most that many elements (a larger parameter is a part of its
    own; the matrices of a group's Newton–Schulz call go together when they fit in a part),
    each part's update added before the next is computed: the step's temporaries then hold
    one part instead of all parameters (peak memory near torch.optim's), for a little more
    host work per part. Everything is checked before the first part runs, and the results
    are the same bits, but for the matrices of a call split across parts: a batched matrix
    product may round by the batch's size, so their updates may differ as two roundings of
    the iteration in ``ns_dtype`` do (see the shim's page). ``"auto"``: parts of a tenth of
    the parameters' elements, at least 2**18 (a model of up to 2**18 elements is one part);
    ``None``: one part, the functional update's bits.

    ``compile=True`` runs the step's arithmetic (every part's update and its addition to the
    parameters) as one ``torch.compile(fullgraph=True)`` graph. It is compiled at the first
    step and again only when its structure changes (other parameters have gradients, a
    setting that rebuilds the transform): up to 8 structures per optimizer, steps of further
    ones run eagerly (with a warning). ``lr``, ``momentum`` and ``weight_decay`` are
    tensors refilled before each step, so a scheduler does not recompile. A mapping gives
    ``torch.compile``'s keywords instead (``{"mode": "max-autotune-no-cudagraphs"}``,
    ``{"backend": "aot_eager"}``), ``fullgraph=True`` unless it says otherwise. The checks
    run eagerly before the compiled graph: bad input raises as without it, changing nothing.
    Refused with ``collectives``, whose exchanges run in Python.

    ``collectives`` is refused with a variant, as :func:`muonfn.normuon` and
    :func:`muonfn.adamuon` refuse it.

    A group's variant options are resolved when it is added: ``None`` becomes its variant's
    default, an option inherited from the defaults that its variant does not take becomes
    ``None``. A setting changed in ``param_groups`` takes effect at the next step. A changed
    variant keeps the momentum, starts the new variant's second moment from zero, and drops
    the old one. A bias correction (``momentum_bias_correction``, AdaMuon's
    ``second_moment_bias_correction``) turned on starts what it corrects from zero with its
    ``step`` count (a trained moment divided by :math:`1 - \beta^t` for a small :math:`t`
    would be several times too large); turned off, it keeps the moment and drops the count.

    As torch.optim's, a parameter's state is made at its first step (the first that has its
    gradient), from the parameter as it is then: a model built on the meta device and
    materialised, or cast, after the optimizer was built steps as if the optimizer had been built
    after, and a parameter that never has a gradient (a frozen one) holds no state. A parameter
    moved or cast after its state was made is refused by the step, naming the state, both devices
    or dtypes and the remedies (``opt.load_state_dict(opt.state_dict())`` casts the state to the
    parameters, ``del opt.state[p]`` or ``opt.state.clear()`` drops it).

    torch.optim.Muon's spellings are taken too: ``adjust_lr_fn`` (``None`` or
    ``"original"``: ``scale="original"``; ``"match_rms_adamw"``), ``eps`` (``ns_eps``) and
    one ``ns_coefficients=(a, b, c)`` for every one of ``ns_steps`` steps (5 when not
    given). Given with muonfn's own keyword, they must agree.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = muonfn.optim.Muon(model.named_parameters(), lr=3e-3)
        >>> [(g["use_muon"], g["param_names"]) for g in opt.param_groups]
        [(True, ['0.weight', '1.weight']), (False, ['0.bias', '1.bias'])]
        >>> opt = muonfn.optim.Muon(model.named_parameters(), lr=3e-3, variant="normuon")
        >>> len(opt.state)  # as torch's, a parameter's state is made at its first step
        0
        >>> model(torch.randn(3, 4)).square().mean().backward()
        >>> opt.step()
        >>> sorted(opt.state[model[0].weight])
        ['momentum_buffer', 'row_second_moment']
        >>> opt = muonfn.optim.Muon(model.named_parameters(), lr=3e-3, momentum_bias_correction=True)
        >>> opt.step()
        >>> sorted(opt.state[model[0].weight])
        ['momentum_buffer', 'step']
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        lr: Scalar = 1e-3,
        *,
        variant: Variant = "muon",
        momentum: Scalar | None = None,
        nesterov: bool | Literal["add"] | None = None,
        momentum_bias_correction: bool = False,
        beta2: Scalar | None = None,
        adaptive_eps: float | None = None,
        rescale: Rescale | None = None,
        sign_momentum: bool | None = None,
        second_moment_bias_correction: bool | None = None,
        weight_decay: Scalar = 0.1,
        cautious_weight_decay: bool = False,
        cautious_mode: CautiousMode | None = None,
        ns_coefficients: CoefficientsLike = "keller",
        ns_steps: int | None = None,
        ns_dtype: torch.dtype | None = None,
        ns_eps: float | None = None,
        ns_method: MethodLike = "standard",
        ns_eps_mode: EpsMode = "clamp",
        ns_restarts: Sequence[int] | None = None,
        ns: MatrixFn | None = None,
        scale: ScaleMode | None = None,
        extra_scale: float = 1.0,
        adamw_lr: Scalar | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: Scalar | None = None,
        adamw_nesterov: bool | Literal["timm"] = False,
        labels: LabelsLike | None = None,
        views: ViewsLike = None,
        weight_decay_mask: MaskLike = None,
        bucket_numel: int | None = None,
        collectives: Collectives | None = None,
        strategy: Strategy = "owner",
        shard_specs: ShardSpecs | None = None,
        replicated: Replicated = "split",
        overlap: bool = True,
        donate_state: bool = True,
        chunk_numel: int | Literal["auto"] | None = "auto",
        compile: bool | Mapping[str, Any] = False,
        adjust_lr_fn: str | NotGiven | None = NOT_GIVEN,
        eps: float | None = None,
    ) -> None:
        arguments = dict(locals())  # first: the keywords as given, read by the table of group settings
        for name, value in (("lr", lr), ("adamw_lr", adamw_lr)):
            if callable(value) and not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"Muon({name}=...) takes a number; schedule it with torch.optim.lr_scheduler "
                    "(schedule functions are for muonfn.muon)"
                )
        _groups.check_betas("adamw_betas", adamw_betas)
        positive("adamw_eps", adamw_eps)
        check_mask("Muon(...): weight_decay_mask", weight_decay_mask)
        check_views("Muon(...): views", views)
        if labels is not None:
            check_labels("Muon(...): labels", labels)
        flag("Muon(...): donate_state", donate_state)
        where = f"Muon(variant={variant!r})"
        _groups.check_variant("Muon(...)", variant)
        _groups.refuse_inapplicable(where, variant, arguments)
        if variant != MUON:
            refuse_collectives(where, collectives)
        self._compile = compile
        self._apply_parts = parts_applier(compile, collectives)
        scale, ns_eps = _migration.resolve_spellings(scale=scale, adjust_lr_fn=adjust_lr_fn, ns_eps=ns_eps, eps=eps)
        # every group setting the table lists, as given (None: each group's variant's default, filled
        # in as groups are added); a setting the table lists and this signature lacks fails here
        given = {**arguments, "scale": scale, "ns_eps": ns_eps}
        defaults: dict[str, Any] = {name: given[name] for name in _groups.GROUP_SETTINGS}
        if ns is not None:
            newton_schulz_setting("Muon(...)", ns, **{name: defaults[name] for name in _groups.NEWTON_SCHULZ})
            defaults.update(_groups.newton_schulz_fields(ns))
        schedule = _migration.schedule_of(defaults["ns_coefficients"], defaults["ns_steps"])
        defaults["ns_coefficients"] = _groups.plain_coefficients(schedule)
        defaults["adamw_betas"] = tuple(adamw_betas)
        self._adamw_lr = adamw_lr
        self._adamw_weight_decay = adamw_weight_decay
        self._orthogonalizer: Orthogonalizer | None = muon_orthogonalizer(
            collectives, strategy, shard_specs, bucket_numel, replicated=replicated, overlap=overlap
        )
        if labels is None:
            # a shard's own shape can look like a vector (one row per rank): shards go by their names
            labels = functools.partial(label_params, shards=tuple(shard_specs)) if shard_specs else label_params
        self._labels: LabelsLike = labels
        self._views = views
        self._weight_decay_mask = weight_decay_mask
        self._bucket_numel = bucket_numel
        self._donate_state = donate_state
        self._chunk_numel = _groups.check_chunk_numel(chunk_numel)
        self._collectives = collectives
        self._layout = Layout(self._branch)
        self._scalars: list[dict[str, torch.Tensor]] = []
        # the transform, and what it was built from: the layout's version and the group settings
        self._cache: tuple[int, list[Any], Transform] | None = None
        self._warned_unnamed = False
        super().__init__(params, defaults)  # routes every group through add_param_group
        check_names(
            self._layout.params(),
            labels=labels,
            views=views,
            weight_decay_mask=weight_decay_mask,
            shard_specs=shard_specs,
        )
        idle = _routing.idle_muon(self.param_groups)
        if idle is not None:
            warn_routing(idle)

    # ------------------------------------------------------------------ layout

    def _branch(self, group: Mapping[str, Any], scalars: Mapping[str, torch.Tensor]) -> Transform:
        """The transform of one group: a branch of :func:`muonfn.muon` (:func:`muonfn.normuon`,
        :func:`muonfn.adamuon` by its ``variant``), built by the presets' own builders."""
        # the core skips a zero decay given as a number (as muon(weight_decay=0.0) does)
        weight_decay: Scalar = 0.0 if _is_zero(group["weight_decay"]) else scalars["weight_decay"]
        if group["use_muon"]:
            coefficients = _groups.coefficients_of(group["ns_coefficients"])
            settings: dict[str, Any] = {
                "lr": scalars["lr"],
                "momentum": scalars["momentum"],
                "nesterov": _groups.setting(group, "nesterov"),
                "weight_decay": weight_decay,
                "ns": newton_schulz_setting(
                    "Muon", **{**{name: group[name] for name in _groups.NEWTON_SCHULZ}, "ns_coefficients": coefficients}
                ),
                **{name: group[name] for name in _groups.AS_GIVEN},
                "views": self._views,
                "weight_decay_mask": self._weight_decay_mask,
                "bucket_numel": self._bucket_numel,
                "donate_state": self._donate_state,
            }
            if group["variant"] == MUON:
                return matrix_branch(MUON, **settings, orthogonalizer=self._orthogonalizer)
            refuse_collectives(f"variant={group['variant']!r}", self._collectives)
            return matrix_branch(group["variant"], **settings, **_groups.adapted_settings(group))
        return adamw(
            scalars["lr"],
            betas=(scalars["momentum"], float(group["beta2"])),  # beta1 scheduled: read at every step
            eps=group["eps"],
            weight_decay=weight_decay,
            weight_decay_mask=self._weight_decay_mask,
            nesterov=group["nesterov"],
            cautious_weight_decay=group["cautious_weight_decay"],
            donate_state=self._donate_state,
        )

    def _signature(self) -> list[Any]:
        """What the transform is built from besides the scheduled scalars (and the layout, which resets the cache)."""
        signature: list[Any] = []
        for group in self.param_groups:
            settings = _groups.MUON_SETTINGS if group["use_muon"] else _groups.ADAMW_SETTINGS
            values = [_comparable(group[k]) for k in settings]
            signature.append((group["use_muon"], values, _is_zero(group["weight_decay"])))
        return signature

    @torch.compiler.disable
    def _synced_transform(self) -> Transform:
        """Copies the scheduled hyperparameters into their tensors; rebuilds the transform if settings changed."""
        self._layout.check_groups(self.param_groups)
        for i, group in enumerate(self.param_groups):
            _groups.check_scheduled(i, group)
            _groups.refuse_whole_setting(i, group)
            _groups.refuse_keywords(i, group)
        for group, scalars in zip(self.param_groups, self._scalars):
            for name, tensor in scalars.items():
                tensor.fill_(float(group[name]))
        signature = self._signature()
        if self._cache is None or self._cache[:2] != (self._layout.version, signature):
            for i, group in enumerate(self.param_groups):
                self._check_settings(i, group)
            self._layout.sync(self.param_groups)
            self._cache = (self._layout.version, signature, self._layout.transform(self.param_groups, self._scalars))
        return self._cache[2]

    def _check_settings(self, group_index: int, group: Mapping[str, Any]) -> None:
        """A group's switches, and a Muon group's variant and its options, checked naming the group
        (they may have been changed in ``param_groups``); the variants run on whole matrices only."""
        _groups.check_switches(group_index, group)
        if group["use_muon"]:
            _groups.check_variant_settings(group_index, group)
            if group["variant"] != MUON:
                refuse_collectives(f"param group {group_index}: variant={group['variant']!r}", self._collectives)

    def _checked_branch(self, group_index: int, group: Mapping[str, Any]) -> tuple[Transform, dict[str, torch.Tensor]]:
        """A group's branch and its scalars, its settings checked naming the group (the core checks the others)."""
        _groups.check_scheduled(group_index, group)
        self._check_settings(group_index, group)
        scalars = _groups.new_scalars(group)
        return self._branch(group, scalars), scalars

    @property
    def transform(self) -> Transform:
        """The :class:`~muonfn.Transform` this optimizer steps with.

        Its ``lr``, ``momentum`` and ``weight_decay`` are 0-d tensors this optimizer refills
        from ``param_groups`` before each of its steps.
        """
        return self._synced_transform()

    # ------------------------------------------------------------------ groups

    @torch.compiler.disable
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds parameters; a group without ``"use_muon"`` is split by ``labels`` into a Muon and an AdamW group.

        Groups removed from ``param_groups`` before (``opt.param_groups = []``, as torch allows)
        leave the optimizer with their parameters: one added again continues with its state (as
        torch's does) where its new group keeps the same entries (its route, variant and bias
        corrections), else starts anew. The state of a parameter in no group is freed at the next
        step (torch keeps it, but its ``state_dict`` cannot save it).

        Everything is checked before anything changes: on an error the optimizer is as it was
        (but for removed groups, which have left it).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        kept = self._layout.follow_removals(self.param_groups)
        if kept is not None:
            self._scalars = [self._scalars[j] for j in kept]
            self._cache = None
        self._layout.check_groups(self.param_groups)  # other edits are refused, naming them
        tensors, names = _groups.read_params(param_group, self.param_groups)
        if names is not None:
            keys = [tuple(name.split(".")) for name in names]
        else:  # by position in the order the optimizer was given them; one added again keeps its own
            removed = {p: held.key for p, held in self._layout.removed.items()}
            taken = {slot.key for slot in self._layout.slots.values()}
            reserved = taken | set(removed.values())
            free = (key for i in itertools.count(len(self._layout.slots)) if (key := (str(i),)) not in reserved)
            again = [removed.get(p) if isinstance(p, torch.Tensor) else None for p in tensors]
            keys = [key if key is not None and key not in taken else next(free) for key in again]
        _groups.check_new_params(tensors, keys, self._layout.slots, named=names is not None)

        detached = TensorDict(dict(zip(keys, [p.detach() for p in tensors])), batch_size=[])
        if callable(self._weight_decay_mask):  # named as given here, before the branches read it
            mask_table(self._weight_decay_mask, detached, where="Muon(...): weight_decay_mask")
        use_muon = param_group.get("use_muon")
        blind: list[torch.Size] = []  # given without names, sent to Muon by the default labels' shape rule
        if use_muon is None:
            try:
                table = resolve_labels(self._labels, detached, dict.fromkeys((MUON, ADAMW)))
            except ValueError as error:
                if names is None:
                    raise ValueError(f"{error} (parameters given without names are keyed by position)") from error
                raise
            parts = [(route, [i for i, k in enumerate(keys) if table[k] == label]) for route, label in _groups.ROUTES]
            blind = [tensors[i].shape for i in parts[0][1]] if names is None else []
        elif isinstance(use_muon, bool):
            parts = [(use_muon, list(range(len(tensors))))]
        else:
            raise TypeError(f"use_muon must be True or False, got {use_muon!r}")

        whole = _groups.ns_entries(f"param group {len(self.param_groups)}", param_group)
        given = {k: v for k, v in param_group.items() if k not in ("params", "param_names", "use_muon")}
        muon_given = {**{k: v for k, v in given.items() if k != _groups.WHOLE_NEWTON_SCHULZ}, **whole}
        new_groups: list[dict[str, Any]] = []
        for route, members in parts:
            where = f"param group {len(self.param_groups) + len(new_groups)}"
            group: dict[str, Any] = {"params": [tensors[i] for i in members]}
            if names is not None:
                group["param_names"] = [names[i] for i in members]
            # each group holds the settings of its kind only (an AdamW group: lr, momentum (its beta1), beta2, ...)
            group.update(
                _groups.group_entries(
                    where,
                    route,
                    muon_given if route else given,
                    self.defaults,
                    split=use_muon is None,
                    adamw_lr=self._adamw_lr,
                    adamw_weight_decay=self._adamw_weight_decay,
                )
            )
            group["use_muon"] = route
            if route:  # the options a Muon group was given must apply to its variant
                _groups.resolve_variant(where, group, set(param_group))
                schedule = _migration.schedule_of(_groups.coefficients_of(group["ns_coefficients"]), group["ns_steps"])
                group["ns_coefficients"] = _groups.plain_coefficients(schedule)
            if new_groups:
                # the halves of one dict are two groups to a scheduler: a tensor they shared would couple them
                first = new_groups[0]
                for name in [k for k, v in group.items() if isinstance(v, torch.Tensor) and v is first.get(k)]:
                    group[name] = group[name].clone()
            new_groups.append(group)

        scalars = list(self._scalars)

        def new_branch(i: int, group: Mapping[str, Any], group_keys: Sequence[tuple[str, ...]]) -> Transform:
            branch, group_scalars = self._checked_branch(i, group)
            scalars.append(group_scalars)
            if group["use_muon"]:  # against global shapes, also where the branch's init cannot (sharded)
                views = resolve_views(self._views, group_keys, group["params"])
                for leaf_key, p, view in zip(group_keys, group["params"], views):
                    view.check(leaf_key, p.shape)
            return branch

        self._layout.add(self.param_groups, new_groups, dict(zip(tensors, keys)), new_branch)
        self.param_groups.extend(new_groups)
        self._scalars = scalars
        self._cache = None
        # (an optimizer pickled before the warning existed has no flag: it warns again, once)
        if blind and not getattr(self, "_warned_unnamed", False) and _routing.by_shape_and_name(self._labels):
            self._warned_unnamed = True
            warn_routing(_routing.routed_blind(blind))

    # ------------------------------------------------------------------ step

    @torch.compiler.disable
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; the others and their state are left alone.

        A parameter's first step makes its state, from the parameter as it is then; a state
        made before the parameter was moved or cast is refused, naming it (see :class:`Muon`).

        ``closure`` (optional) re-evaluates the model and returns the loss; it runs with
        gradients enabled. Inside ``torch.compile`` the step runs eagerly (a graph break),
        so its results are those of an eager step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # settings changed in param_groups may lay the state out anew: undone if the step's checks fail
        snapshot, cache = self._layout.snapshot(), self._cache
        paused = pause_collections()  # the step's temporaries hold no cycles (see muonfn._gc_pause)
        try:
            with torch.no_grad():
                try:
                    checked = self._checked_step()
                except Exception:
                    self._layout.restore(snapshot)
                    self._cache = cache
                    raise
                if checked is not None:
                    self._layout.stepped(self._apply_parts(*checked))
                self._layout.forget_removed()
        finally:
            resume_collections(paused)
        return loss

    def _checked_step(self) -> tuple[StepInputs, _tree.FlatState] | None:
        """The step's inputs and the flat state, every input checked before any part runs;
        ``None`` when no parameter has a gradient."""
        rule = as_rule(self._synced_transform())
        slots = self._layout.slots
        state = self._layout.leaves()
        keys, targets, grads, fresh = [], [], [], []
        for (p, slot), state_key in zip(slots.items(), self._layout.state_keys()):
            if p.grad is not None:
                keys.append(slot.key)
                targets.append(p)
                grads.append(p.grad)
                held = state.get(state_key)
                if held is None:  # its first step: its state is made from it as it is now, as torch.optim's
                    fresh.append(p)
                elif held.device != p.device:  # moved since (the checks below compare no devices)
                    raise self._layout.stale_state_error(p, held)
        if not grads:
            return None
        if fresh:
            state = self._layout.with_state_of(self.param_groups, fresh, state)
        params = {slot.key: p for p, slot in slots.items()}
        try:
            check_rule(rule, dict(zip(keys, grads)), state, params, torch.Size([]))
        except ValueError:
            # a parameter cast since its state was made fails them by its gradient's dtype: name the state
            stale = self._layout.stale_dtype(targets, state)
            if stale is not None:
                raise stale from None
            raise
        kinds = [_groups.part_kind(slots[p].group, p) for p in targets]
        parts = _groups.chunks([g.numel() for g in grads], self._chunk_numel, kinds)
        return StepInputs(rule, parts, keys, targets, grads, params), state

    # ------------------------------------------------------------------ state

    @property
    def functional_state(self) -> TensorDictBase:
        """The state TensorDict ``Transform.update`` takes and returns (see :mod:`muonfn.optim`).

        It holds the state of the parameters that have one (made at a parameter's first step):
        ``muonfn.muon(...).init`` of those parameters, as the steps since have left it.
        Assigning one (taken from this optimizer, or from ``muonfn.muon(...)``'s ``init``
        and ``update`` for some or all of its parameters) replaces the state after checking
        its keys, shapes and dtypes (moved to the parameters' devices). Each parameter's
        entries must all be there, or none: then it has no state, made at its next step. On a
        mismatch nothing changes.
        """
        self._layout.sync(self.param_groups)
        return self._layout.state

    @functional_state.setter
    def functional_state(self, state: TensorDictBase | Mapping[str, Any]) -> None:
        self._layout.check_groups(self.param_groups)
        checked = self._layout.checked_state(self.param_groups, state, "functional_state")
        self._layout.load(self.param_groups, checked)  # laid out as it was checked

    @property  # type: ignore[override]
    def state(self) -> ParamState:
        """torch's per-parameter state (see :mod:`muonfn.optim`): a parameter's appears at its first step.

        Assigning a mapping takes it as the whole state: an empty one (``opt.state =
        collections.defaultdict(dict)``, torch's way to reset an optimizer) forgets every
        parameter's state, made anew at its next step (AdamW's count starts again at 1); each
        parameter's entries in another are taken as ``opt.state[p] = entries`` takes them (all of
        them, or ``{}``), the parameters it leaves out have none, and its other keys are kept as
        torch keeps them. All is checked before anything changes.
        """
        state: ParamState = self.__dict__["state"]
        return state

    @state.setter
    def state(self, state: Mapping[Any, Any]) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"opt.state must be a mapping (torch's defaultdict(dict)), got {type(state).__name__}")
        current = self.__dict__.get("state")
        if current is None:  # torch.optim.Optimizer.__init__'s own empty defaultdict, before any group
            self.__dict__["state"] = ParamState(self._layout, self)
        elif state is not current:
            current.replace(state)

    @torch.compiler.disable
    def state_dict(self) -> dict[str, Any]:
        """The state in torch's format, ``{"state": {index: {name: tensor}}, "param_groups": [...]}``.

        It loads with ``torch.load(weights_only=True)``. Parameters are numbered across
        groups in order, as torch numbers them; as in torch's, a parameter without state (not
        yet stepped) has no entry. Entries of :attr:`state` under other keys (a hook's, say) are
        kept under those keys, as torch keeps them. An entry under a tensor that is not a
        parameter cannot be numbered: it is an error, unless empty. So is a state left on the
        meta device for a parameter that is no longer there: it holds no values.
        ``param_groups`` edited in a way the next step refuses (a group repeated, a parameter
        appended) are described as they are, with each parameter's state as it was laid out.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        if self._layout.follows(self.param_groups):  # its groups and its state saved as one layout
            self._layout.sync(self.param_groups)
        state_dict = packed_state_dict(self.param_groups, self._layout, self._param_state.others)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @torch.compiler.disable
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict` (torch's format); on any mismatch raises naming the parameter and changes nothing.

        As in torch, state tensors are cast to their parameter's dtype and device (the second
        moments of an fp16 parameter to fp32, the dtype this optimizer keeps them in), except
        the integer ``"step"`` counts, which come back exact, and the saved groups are
        deep-copied. The saved state replaces the whole state: a parameter without an entry
        (or with ``{}``) has none after, made at its next step. The saved hyperparameters
        replace the current ones; groups keep their
        parameters and routes, and take the saved ``param_names`` when they have none.
        Entries under keys that are no parameter's index replace those of :attr:`state`
        under keys that are not parameters, as torch's ``load_state_dict`` carries them.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._layout.check_groups(self.param_groups)
        loaded = translate_state_dict(
            state_dict, self.param_groups, self._layout, defaults=self.defaults, check=self._checked_branch
        )
        state = self._layout.checked_state(self.param_groups, loaded.entries, "load_state_dict")

        self.param_groups = loaded.groups
        self._layout.load(loaded.groups, state)
        self._param_state.others = loaded.others
        self._cache = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def load_torch_state_dicts(
        self, muon_state_dict: dict[str, Any], adamw_state_dict: dict[str, Any] | None = None
    ) -> None:
        """Continues a run of ``torch.optim.Muon`` (with ``torch.optim.AdamW`` for the other parameters).

        This optimizer's Muon groups take the Muon state_dict's groups in order, its AdamW
        groups the AdamW state_dict's: parameter by parameter as torch pairs them (by
        position; checked by shape, and by name where both have names), momentum buffers and
        Adam moments unchanged, torch's float ``step`` as an exact count (a parameter torch
        keeps no state for, not yet stepped, has none here either). The hyperparameters
        come along under this optimizer's names (``eps`` -> ``ns_eps``, ``adjust_lr_fn`` ->
        ``scale``, AdamW's ``betas`` -> an AdamW group's ``momentum`` and ``beta2``, ...), and
        a group's other entries (a scheduler's ``initial_lr``) as they are.
        ``adamw_state_dict`` may be left out when this optimizer has no AdamW parameters. On a
        mismatch it raises naming the group or parameter and changes nothing. See
        :meth:`torch_state_dicts` for the way back.
        """
        self.load_state_dict(
            _migration.shim_state_dict(self.param_groups, self._layout, muon_state_dict, adamw_state_dict)
        )

    def torch_state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(muon_state_dict, adamw_state_dict)``: this run's state for ``torch.optim.Muon`` and ``torch.optim.AdamW``.

        Load them into ``torch.optim.Muon`` built with this optimizer's Muon groups and
        ``torch.optim.AdamW`` with its AdamW groups, in order (``use_muon`` says which).
        State tensors are copies, bit for bit (the second moments of fp16 parameters in fp32,
        which torch's ``load_state_dict`` rounds to fp16); ``step`` is torch's float count; a
        parameter without state (not yet stepped) has no entry, as in torch's. A group's entries
        other than its settings (a scheduler's ``initial_lr``) come along as they are (copies).
        Raises naming the group or parameter whose settings torch's optimizers cannot run (a
        schedule of several triples or a norm factor, a scale mode other than ``"original"``
        and ``"match_rms_adamw"``, ``extra_scale``, views, a weight-decay mask inside a decayed
        group, a Muon parameter that is not 2-D).
        """
        self._layout.check_groups(self.param_groups)
        return _migration.torch_state_dicts(
            self.param_groups, self._layout, views=self._views, weight_decay_mask=self._weight_decay_mask
        )

    @property
    def _param_state(self) -> ParamState:
        """:attr:`state`."""
        return self.state

    # where the state lives, for a debugger: the layout's own
    @property
    def _slots(self) -> dict[torch.Tensor, _groups.Slot]:
        return self._layout.slots

    @property
    def _entry_names(self) -> list[_groups.Entries]:
        return self._layout.entry_names

    @property
    def _functional_state(self) -> TensorDictBase:
        return self._layout.state

    def __getstate__(self) -> dict[str, Any]:
        # the cached transform closes over this instance's scalar tensors; a copy builds its own.
        # A compiled step is compiled anew.
        return {k: v for k, v in self.__dict__.items() if k not in ("_cache", "_apply_parts")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "_layout" not in state:  # (pickled before the layout was an object of its own)
            state["_layout"] = Layout.unpickled(self._branch, state)
            param_state = ParamState(state["_layout"], self)
            param_state.others = state["state"].others
            state["state"] = param_state
        if any("adamw_betas" in group for group in state["param_groups"]):  # (pickled with both kinds' settings)
            state["param_groups"] = [_groups.upgraded(g, g["use_muon"]) for g in state["param_groups"]]
            state["_scalars"] = [_groups.new_scalars(g) for g in state["param_groups"]]
        super().__setstate__(state)
        self._cache = None
        self._compile = state.get("_compile", False)  # (pickled before the option existed: eager)
        self._apply_parts = parts_applier(self._compile, self._collectives)


def _is_zero(value: Any) -> bool:
    return float(value) == 0.0


def _comparable(value: Any) -> Any:
    # a one-element tensor setting (beta2) compared by value: == of tensors is no bool; others with
    # their type, so that a switch set to 0 for False is checked (and refused) as any other change
    return float(value) if isinstance(value, torch.Tensor) else (type(value), value)
