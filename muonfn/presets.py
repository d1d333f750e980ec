r"""The presets: Muon (NorMuon, AdaMuon) for hidden-layer matrices beside AdamW for the rest, and how
leaves are routed between them.

Each preset is optax's shape, a :func:`~muonfn.partition` of two branches:

.. math::  \text{matrices:}\quad b \leftarrow \mu b + (1-\mu) g,\quad u = \mu b + (1-\mu) g,\quad
           p \leftarrow p - \eta\,\bigl(s(A, B)\,\mathrm{adapt}(\mathrm{NS}(u)) + \lambda p\bigr)
           \qquad \text{the rest:}\quad \text{AdamW}

``chain(ema_momentum, descent)`` for Muon (the shape scale, decay and learning rate taken by
Newton–Schulz's own passes), ``chain(ema_momentum, orthogonalize, adapt, descent)`` for the adapted
variants, :func:`~muonfn.adamw` beside them.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ._tree import dotted, flat, named_table
from ._validation import Scalar, ScalarOrSchedule, flag, positive, schedule_value, unit_interval
from .linalg import MatrixView, Orthogonalizer, ScaleLike
from .steps import (
    AdamNesterov,
    NesterovLike,
    Rescale,
    ViewsLike,
    adamw,
    add_decayed_weights,
    check_state_dtype,
    check_views,
    checked_rate,
    descent,
    ema_momentum,
    fresh_updates,
    is_schedule,
    orthogonalize,
    scale_by_element_rms,
    scale_by_learning_rate,
    scale_by_neuron_norm,
    scale_by_shape,
    scale_by_sign,
)
from .transforms import (
    CAUTIOUS_MODES,
    CautiousMode,
    LabelsLike,
    MaskLike,
    Transform,
    cautious,
    chain,
    check_mask,
    named,
    partition,
    table_of,
)

MUON = "muon"
ADAMW = "adamw"
VARIANTS: tuple[str, ...] = ("muon", "normuon", "adamuon")


# ---------------------------------------------------------------------------------------------- routing

#: Name fragments (matched case-insensitively anywhere in the dotted name, read with a dot in front:
#: ``".x."`` is a whole component, the first one too) of leaves that are not hidden-layer matrices:
#: token and position embeddings, output heads and classifiers, LoRA adapters, class/mask/distillation
#: tokens and relative-position tables. ``"head."`` keeps its dot so that ``multihead_attn`` stays a
#: hidden layer; ``".shared.weight"`` is the token embedding (and tied head) of Hugging Face's
#: encoder–decoders (T5, BART, mBART, Pegasus, Marian), a whole component so that MoE
#: ``shared_experts`` stay on Muon.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "embed",
    ".shared.weight",
    "wte",
    "wpe",
    "lm_head",
    "lora_",
    "head.",
    "classifier",
    "cls_token",
    "mask_token",
    "dist_token",
    "relative_position",
    "relative_attention_bias",
)


def matching_fragments(names: Iterable[str], exclude: Sequence[str] = DEFAULT_EXCLUDE) -> list[str]:
    """The fragments of ``exclude`` that some of ``names`` hold, as :func:`label_params` matches them."""
    lowered = ["." + name.lower() for name in names]  # a fragment ".x." then matches a whole first component too
    return [fragment for fragment in exclude if any(fragment.lower() in name for name in lowered)]


def label_params(
    params: TensorDictBase, exclude: Sequence[str] = DEFAULT_EXCLUDE, *, shards: Iterable[Any] = ()
) -> dict[str, str]:
    """Labels by shape and name: ``"muon"`` for matrices, ``"adamw"`` for everything else.

    A leaf is a matrix when its shape (a member's, for a stacked ensemble) has at least two
    dimensions of size other than 1 (a ``(1, 1, D)`` ``cls_token`` is not) and its dotted name holds
    none of the ``exclude`` fragments (:data:`DEFAULT_EXCLUDE`). Names cannot tell every output head
    (a ResNet's ``fc``): :func:`labels_from_module` also sends the model's last ``nn.Linear`` to
    AdamW, or add a whole component, ``functools.partial(label_params, exclude=(*DEFAULT_EXCLUDE, ".fc."))``.
    ``shards``: names of leaves that are one rank's block of a larger tensor (a block of one row says
    nothing of the whole): matrices when they have two dimensions or more.
    """
    sharded = set(named_table(dict.fromkeys(shards), params.keys()))
    labels = {}
    for key, value in params.items(True, True):
        name = dotted(key)
        shape = value.shape[params.batch_dims :]  # (a member's, for a stacked ensemble)
        matrix = len(shape) >= 2 if name in sharded else sum(1 for s in shape if s != 1) >= 2
        labels[name] = MUON if matrix and not matching_fragments([name], exclude) else ADAMW
    return labels


def default_labels(shards: Iterable[Any] = ()) -> Callable[[TensorDictBase], dict[str, str]]:
    """The labels used where none are given: :func:`label_params`, told the leaves that are one rank's
    block of a larger tensor (a sharded orthogonalizer's ``shard_specs``)."""
    return functools.partial(label_params, shards=tuple(shards)) if shards else label_params


def labels_from_module(
    model: nn.Module, exclude: Sequence[str] = DEFAULT_EXCLUDE, *, last_linear_is_head: bool = True
) -> dict[str, str]:
    """Labels by module type: weights of Linear and Conv layers (and Hugging Face ``Conv1D``) and the
    query, key and value projections of ``nn.MultiheadAttention`` go to Muon; embeddings, norms, biases
    and token parameters to AdamW, and so does the model's output head, its last ``nn.Linear`` in
    registration order (``last_linear_is_head=False`` for a trunk), and anything whose dotted name holds
    a fragment of ``exclude``. A tied weight is listed once, under its first name."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = linears[-1] if linears and last_linear_is_head else None
    labels = {}
    for name, param in model.named_parameters():  # (a tied weight once, under its first name)
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, nn.MultiheadAttention):  # (its out_proj is an nn.Linear of its own)
            matrix = param_name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
        else:
            linear = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)
            matrix = param_name == "weight" and (isinstance(module, linear) or type(module).__name__ == "Conv1D")
        wants = matrix and module is not head and param.ndim >= 2 and not matching_fragments([name], exclude)
        labels[name] = MUON if wants else ADAMW
    return labels


def views_from_module(model: nn.Module) -> dict[str, MatrixView]:
    """Views a module tree declares by its types: Hugging Face ``Conv1D`` stores ``(in, out)``;
    ``nn.MultiheadAttention``'s fused ``in_proj_weight`` stacks the query, key and value projections."""
    views: dict[str, MatrixView] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if type(module).__name__ == "Conv1D":
            views[f"{prefix}weight"] = MatrixView(transposed=True)
        elif isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
            views[f"{prefix}in_proj_weight"] = MatrixView(split=(module.embed_dim,) * 3)
    return views


def split_buffers(model: nn.Module) -> tuple[TensorDict, TensorDict]:
    """``(params, buffers)``: the model's parameters and its buffers, as two detached TensorDicts
    sharing its storage. Buffers (BatchNorm's statistics, its int64 ``num_batches_tracked``) are no
    parameters: give ``init``, ``torch.func.grad`` and ``update`` the parameters only::

        params, buffers = muonfn.split_buffers(model)
        def loss_fn(params, buffers, x, y):
            with params.to_module(model), buffers.to_module(model):
                return F.cross_entropy(model(x), y)
    """
    everything = TensorDict.from_module(model).detach()
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    keys = [key for key in everything.keys(True, True) if dotted(key) in names]
    return everything.select(*keys), everything.exclude(*keys)


class RoutingWarning(UserWarning):
    """Muon would train nothing, or parameters were routed without names to go by: warned once where
    the optimizer is built or initialised, naming the cause and the fix."""


#: muonfn's and torch's own files: a routing warning points past their frames, at the user's line
_INTERNAL_FILES = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (sys.modules[__package__], torch)
)


def warn_routing(message: str) -> None:
    """Warns ``message`` as a :class:`RoutingWarning` at the first caller outside muonfn and torch."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL_FILES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RoutingWarning, stacklevel=level)


def shown(names: Sequence[str], limit: int = 3) -> str:
    """Up to ``limit`` names, quoted, and how many more."""
    return ", ".join(repr(n) for n in names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def warn_if_every_matrix_excluded(where: str, params: TensorDictBase, shards: Iterable[Any] = ()) -> None:
    """A :class:`RoutingWarning` when the default labels send no leaf to Muon although some are matrices,
    each excluded by its name (LoRA adapters given alone): the optimizer is then plain AdamW."""
    matrices = [name for name, label in label_params(params, exclude=(), shards=shards).items() if label == MUON]
    if matrices and MUON not in label_params(params, shards=shards).values():
        fragments = matching_fragments(matrices)
        warn_routing(
            f"{where}: no parameter is labelled 'muon', so this optimizer is plain AdamW: every matrix "
            f"({len(matrices)}: {shown(matrices)}) goes to AdamW by its name (muonfn.DEFAULT_EXCLUDE's "
            f"{shown(fragments, len(fragments))}). To run Muon on them, pass labels= (e.g. "
            f"functools.partial(muonfn.label_params, exclude=[f for f in muonfn.DEFAULT_EXCLUDE if f != "
            f"{fragments[0]!r}])); for plain AdamW, use muonfn.adamw"
        )


# ---------------------------------------------------------------------------------------------- the presets


def muon(
    lr: ScalarOrSchedule = 1e-3,
    *,
    momentum: Scalar = 0.95,
    nesterov: NesterovLike = True,
    momentum_bias_correction: bool = False,
    weight_decay: Scalar = 0.1,
    cautious_weight_decay: bool = False,
    cautious_mode: CautiousMode | None = None,
    ns: Any = None,
    scale: ScaleLike = "match_rms_adamw",
    adamw_lr: ScalarOrSchedule | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: Scalar | None = None,
    adamw_nesterov: AdamNesterov = False,
    labels: LabelsLike | None = None,
    views: ViewsLike = None,
    weight_decay_mask: MaskLike = None,
    orthogonalizer: Orthogonalizer | None = None,
    state_dtype: torch.dtype | None = None,
    donate_state: bool = False,
) -> Transform:
    r"""Muon for matrices, AdamW for everything else.

    Matrix leaves (label ``"muon"``) get :math:`p \leftarrow p - \eta\,(s(A, B)\,\mathrm{NS}(u_t) + \lambda p)`
    with :math:`u_t` the Nesterov EMA momentum (:func:`ema_momentum`) and :math:`s` the ``scale`` mode
    (times its factor, given as ``(mode, factor)``); the default ``"match_rms_adamw"`` (0.2·√max(A, B))
    gives the update AdamW's RMS, so start from the learning rate and weight decay you would give AdamW.
    Other leaves (label ``"adamw"``) get :func:`adamw` with the ``adamw_*`` settings, each ``None``
    meaning "the Muon value".

    Args:
        lr: :math:`\eta`: a float, a 0-d tensor or a schedule ``count -> lr``.
        momentum: :math:`\mu` of the EMA momentum, in [0, 1).
        nesterov: the Nesterov look-ahead; ``"add"`` for heavyball's :math:`g_t + b_t`.
        momentum_bias_correction: optax's bias-corrected momentum (see :func:`ema_momentum`).
        weight_decay: decoupled :math:`\lambda`, applied with the unadjusted ``lr``.
        cautious_weight_decay: decay only where the update and the parameter agree in sign, in both
            branches.
        cautious_mode: ``"heavyball"`` or ``"pytorch_optimizer"`` wraps the Muon direction in
            :func:`cautious` (``None``: not cautious).
        ns: the orthogonalization: a :class:`NewtonSchulz` (``None``: the default, Keller Jordan's
            five steps), ``"gram"``, ``"svd"``, ``"qr"`` or a map of ``(count, m, n)`` batches.
        scale: the shape scale :math:`s`: a mode, or ``(mode, factor)`` (see :func:`scale_by_shape`).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, adamw_nesterov: the AdamW branch.
        labels: routes leaves to ``"muon"`` or ``"adamw"``; default :func:`label_params`;
            :func:`labels_from_module` labels by module type instead.
        views: conv, expert, fused and transposed matrices (:class:`MatrixView` by name).
        weight_decay_mask: exempts the leaves it maps to ``False``; ``"matrices"`` decays only the
            leaves of two or more dimensions (biases and norm gains undecayed).
        orthogonalizer: who runs Newton–Schulz: ``LocalOrthogonalizer(bucket_numel=...)``, or for
            sharded and replicated parameters :func:`muonfn.distributed.sharded_orthogonalizer`.
        state_dtype: the dtype of the momentum, of AdamW's moments (and of AdaMuon's second moment):
            ``None`` (the parameters'), ``torch.float32``, or ``torch.bfloat16`` (half the bytes;
            computed in fp32 and stored rounded stochastically, the same bits on every layout: see
            :func:`ema_momentum`).
        donate_state: update the state in place (the state given to ``update`` is consumed).

    ``init`` checks every name in ``labels``, ``views`` and ``weight_decay_mask`` against the
    parameters (a typo is an error) and every Muon leaf against its view.

    Returns:
        A :class:`Transform` with state ``{"muon": {"momentum"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}``.

    Example:
        >>> params = TensorDict({"w": torch.randn(4, 8), "b": torch.zeros(4)}, [])
        >>> state = muonfn.muon(lr=3e-4).init(params)
        >>> sorted(state.keys(True, True))
        [('adamw', 'exp_avg', 'b'), ('adamw', 'exp_avg_sq', 'b'), ('adamw', 'step', 'b'), ('muon', 'momentum', 'w')]
    """
    return _preset(MUON, locals())


def _keywords(function: Callable[..., Any], but: Container[str]) -> dict[str, Any]:
    """A function's keyword-only options (a preset's), but those named in ``but``, with their defaults."""
    parameters = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.name not in but}


#: The options every preset takes beside ``lr``, ``momentum`` and ``nesterov``: :func:`muon`'s, with its defaults.
PRESET_OPTIONS: dict[str, Any] = _keywords(muon, ("momentum", "nesterov"))


def normuon(
    lr: ScalarOrSchedule = 1e-3,
    *,
    momentum: Scalar = 0.95,
    nesterov: NesterovLike = True,
    beta2: Scalar = 0.95,
    adaptive_eps: float = 1e-10,
    rescale: Rescale = "orthogonal",
    **options: Any,
) -> Transform:
    r"""NorMuon (Li et al., 2025) for matrices, AdamW for everything else: Muon's orthogonalized
    momentum normalised row by row by an EMA of each row's mean square (:func:`scale_by_neuron_norm`
    with ``beta2``, ``adaptive_eps``, ``rescale``). The defaults are the paper's Algorithm 1: with
    ``rescale="orthogonal"`` and the ``"match_rms_adamw"`` scale the update has an RMS of 0.2, as
    AdamW's. The other keywords are :func:`muon`'s; sharded orthogonalizers are refused (the row
    statistics need whole matrices).

    Example:
        >>> params = TensorDict({"w": torch.randn(4, 8), "b": torch.zeros(4)}, [])
        >>> state = muonfn.normuon(lr=3e-4).init(params)
        >>> state["muon", "row_second_moment", "w"].shape  # one entry per row
        torch.Size([4, 1])
    """
    return _preset("normuon", locals())


def adamuon(
    lr: ScalarOrSchedule = 1e-3,
    *,
    momentum: Scalar = 0.9,
    nesterov: NesterovLike = False,
    beta2: Scalar = 0.95,
    adaptive_eps: float = 1e-10,
    sign_momentum: bool = True,
    second_moment_bias_correction: bool = False,
    rescale: Rescale = "orthogonal",
    **options: Any,
) -> Transform:
    r"""AdaMuon (Si et al., 2025) for matrices, AdamW for everything else: the sign of the EMA momentum
    (``sign_momentum``) orthogonalized, adapted element-wise by an EMA of its square
    (:func:`scale_by_element_rms` with ``beta2``, ``adaptive_eps``, ``second_moment_bias_correction``,
    ``rescale``) and rescaled to AdamW's RMS. The other keywords are :func:`muon`'s; sharded
    orthogonalizers are refused.

    Example:
        >>> params = TensorDict({"w": torch.randn(4, 8), "b": torch.zeros(4)}, [])
        >>> state = muonfn.adamuon(lr=3e-4).init(params)
        >>> sorted(state["muon"].keys())
        ['exp_avg_sq', 'momentum']
    """
    return _preset("adamuon", locals())


#: Each variant's defaults for the settings whose defaults differ between variants (the keywords its preset
#: takes beyond :data:`PRESET_OPTIONS`); an option the variant does not list does not apply to it.
VARIANT_DEFAULTS: dict[str, dict[str, Any]] = {
    variant: _keywords(preset, PRESET_OPTIONS) for variant, preset in zip(VARIANTS, (muon, normuon, adamuon))
}


def adaptation(
    variant: str,
    views: ViewsLike,
    donate_state: bool,
    state_dtype: torch.dtype | None,
    momentum_bias_correction: bool,
    *,
    beta2: Scalar = 0.95,
    adaptive_eps: float = 1e-10,
    rescale: Rescale = "orthogonal",
    sign_momentum: bool = False,
    second_moment_bias_correction: bool = False,
) -> tuple[list[Transform], list[Transform]]:
    """What ``variant`` does around Newton–Schulz, made for a preset's views and donation and checked here:
    the steps before it (the momentum's sign) and those that adapt its result, NorMuon's row normalisation
    or AdaMuon's element-wise one (none for Muon)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {list(VARIANTS)}")
    if variant == MUON:
        return [], []
    unit_interval(f"{variant}: beta2", beta2)
    positive(f"{variant}: adaptive_eps", adaptive_eps)
    flag(f"{variant}: sign_momentum", sign_momentum)
    flag(f"{variant}: second_moment_bias_correction", second_moment_bias_correction)
    if variant == "normuon" and (sign_momentum or second_moment_bias_correction):
        raise ValueError("normuon: sign_momentum and second_moment_bias_correction are AdaMuon's options")
    shared: dict[str, Any] = {"eps": adaptive_eps, "rescale": rescale, "views": views, "donate_state": donate_state}
    if variant == "normuon":
        return [], [scale_by_neuron_norm(beta2, **shared)]
    rms = scale_by_element_rms(beta2, bias_correction=second_moment_bias_correction, state_dtype=state_dtype, **shared)
    # where both count their updates (a bf16 state, or a correction each), the momentum's count is
    # "step" and this one's nested
    both = state_dtype == torch.bfloat16 or (momentum_bias_correction and second_moment_bias_correction)
    return [scale_by_sign()] if sign_momentum else [], [named("second_moment", rms) if both else rms]


#: The options only the adapted variants take: their adaptation's.
VARIANT_OPTIONS: tuple[str, ...] = tuple(_keywords(adaptation, PRESET_OPTIONS))


def _preset(variant: str, arguments: dict[str, Any]) -> Transform:
    """The preset of ``variant`` made of the ``arguments`` its function was given (its ``locals()``, its
    ``**options`` among them): its matrix branch (its variant's :func:`adaptation` made of its settings)
    beside :func:`adamw`, the options of :data:`PRESET_OPTIONS` at their defaults where not given; names in
    ``views``, ``weight_decay_mask`` and an orthogonalizer's ``shard_specs`` checked against the parameters
    at ``init`` (a typo is an error)."""
    given = {**arguments.pop("options", {}), **arguments}
    unknown = sorted(given.keys() - {"lr", *VARIANT_DEFAULTS[variant], *PRESET_OPTIONS})
    if unknown:
        raise TypeError(f"muonfn.{variant}() got an unexpected keyword argument {unknown[0]!r}")
    options = SimpleNamespace(**{**PRESET_OPTIONS, **given})
    settings = {name: value for name, value in given.items() if name in VARIANT_OPTIONS}
    check_state_dtype(f"muonfn.{variant}", options.state_dtype)  # (named as the user called it)
    rates = {MUON: options.lr, ADAMW: options.lr if options.adamw_lr is None else options.adamw_lr}
    schedules = {name: BranchSchedule(rate, name) for name, rate in rates.items() if is_schedule(rate)}
    rates.update(schedules)
    branch = matrix_branch(variant, rates[MUON], **{n: getattr(options, n) for n in BRANCH_OPTIONS}, **settings)
    decays = (
        options.weight_decay,
        options.weight_decay if options.adamw_weight_decay is None else options.adamw_weight_decay,
    )
    other = adamw(
        rates[ADAMW],
        betas=options.adamw_betas,
        eps=options.adamw_eps,
        weight_decay=decays[1],
        weight_decay_mask=options.weight_decay_mask,
        nesterov=options.adamw_nesterov,
        cautious_weight_decay=options.cautious_weight_decay,
        state_dtype=options.state_dtype,
        donate_state=options.donate_state,
    )
    shards = getattr(options.orthogonalizer, "shard_specs", None) or {}
    tx = partition({MUON: branch, ADAMW: other}, default_labels(shards) if options.labels is None else options.labels)

    def init(params: TensorDictBase) -> TensorDictBase:
        leaves = flat(params)
        check_names("", leaves, views=options.views, weight_decay_mask=options.weight_decay_mask, shard_specs=shards)
        state = tx.init(params)
        if options.labels is None:  # (labels of one's own send what they send)
            warn_if_every_matrix_excluded(f"muonfn.{variant}(...).init", leaves, shards)
        return state

    if not options.donate_state:
        return Transform(init, tx.update)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        # what only the update tells, refused before either branch writes its donated state: the decay's params
        if params is None and any(isinstance(d, torch.Tensor) or d != 0 for d in decays):
            raise ValueError(f"muonfn.{variant}: the weight decay needs params: call update(grads, state, params)")
        # each schedule's value made before either branch writes its donated state: a bad one leaves it as it was
        for name, schedule in schedules.items():
            count = state.get((name, "count"), None) if isinstance(state, TensorDictBase) else None
            if isinstance(count, torch.Tensor):
                schedule.first = schedule.value(count)
        return tx.update(grads, state, params)

    update.donates_state = True  # type: ignore[attr-defined]
    return Transform(init, update)


def check_names(where: str, leaves: TensorDictBase, **tables: Any) -> None:
    """The names of each table in ``tables`` (by its keyword: ``views``, ...) checked against the ``leaves``'
    (a typo is an error); a callable ``weight_decay_mask``'s table checked as one given, refused after ``where``."""
    mask = tables.get("weight_decay_mask")
    if callable(mask) and not isinstance(mask, Mapping):
        tables["weight_decay_mask"] = table_of(mask, leaves, "weight_decay_mask")
        check_mask(f"{where}weight_decay_mask", tables["weight_decay_mask"])
    for name, table in tables.items():
        if isinstance(table, Mapping):  # (a callable table names no leaf of its own)
            named_table(table, leaves.keys(), name)


class BranchSchedule:
    """A preset's learning-rate schedule for one of its branches: its values checked naming the branch
    (a preset holds two), and, with a donated state, the value made before either branch runs
    (``first``) handed to the branch, so that the schedule is still called once an update."""

    def __init__(self, schedule: Callable[[torch.Tensor], Any], branch: str) -> None:
        self.schedule = schedule
        self.where = f"the learning rate schedule of branch {branch!r}"
        self.first: Any = None

    def value(self, count: torch.Tensor) -> Any:
        """The schedule's value at ``count``, checked (a count lives on the leaves' device, per ensemble member)."""
        lr = schedule_value(self.where, self.schedule(count))
        return checked_rate(self.where, lr, count.shape, count.device, returned=True)

    def __call__(self, count: torch.Tensor) -> Any:
        lr, self.first = self.first, None
        return self.value(count) if lr is None else lr


def matrix_branch(
    variant: str,
    lr: ScalarOrSchedule,
    momentum: Scalar,
    nesterov: NesterovLike,
    momentum_bias_correction: bool,
    weight_decay: Scalar,
    cautious_weight_decay: bool,
    cautious_mode: CautiousMode | None,
    ns: Any,
    scale: ScaleLike,
    views: ViewsLike,
    weight_decay_mask: MaskLike,
    orthogonalizer: Orthogonalizer | None,
    donate_state: bool,
    state_dtype: torch.dtype | None = None,
    **settings: Any,
) -> Transform:
    r"""The matrix branch of a preset: the momentum, Newton–Schulz (and the :func:`adaptation` of ``variant``
    made of its ``settings``, after it), then :func:`descent`. With caution, the chain of building blocks:
    caution reads the direction before the decay and the learning rate."""
    flag("cautious_weight_decay", cautious_weight_decay)
    if cautious_mode is not None and cautious_mode not in CAUTIOUS_MODES:
        raise ValueError(f"unknown cautious mode {cautious_mode!r}; choose None or one of {list(CAUTIOUS_MODES)}")
    check_mask("weight_decay_mask", weight_decay_mask)
    check_views("views", views)
    steps = [
        ema_momentum(
            momentum,
            nesterov=nesterov,
            bias_correction=momentum_bias_correction,
            state_dtype=state_dtype,
            donate_state=donate_state,
        )
    ]
    signs, adapted = adaptation(variant, views, donate_state, state_dtype, momentum_bias_correction, **settings)
    # (a sharded orthogonalizer's results are shards)
    if variant != MUON and getattr(orthogonalizer, "sum_shards", None) is not None:
        raise ValueError(
            "the adapted variants need each whole orthogonalized matrix on the rank that holds its state, "
            "and sharded orthogonalizers return shards: use muonfn.muon for sharded parameters"
        )
    steps += signs
    # the look-ahead, or the sign: this step's own tensors, which Newton–Schulz may overwrite
    fresh = fresh_updates(nesterov, momentum_bias_correction) or bool(signs)
    plain = cautious_mode is None and not cautious_weight_decay
    # how Newton–Schulz runs, in orthogonalize or in descent's passes
    newton_schulz: dict[str, Any] = {"views": views, "orthogonalizer": orthogonalizer, "overwrite_input": fresh}
    if adapted or not plain:  # Newton–Schulz on its own: the adaptation, or caution, comes between it and the rest
        steps += [orthogonalize(ns, scale="none" if adapted else scale, **newton_schulz), *adapted]
        ns = "none"  # (it has run: descent takes the shape scale, the decay and the rate)
    if plain:  # the shape scale (in Newton–Schulz's last step, if it is still to run), the decay and the rate
        return chain(*steps, descent(lr, weight_decay, ns=ns, scale=scale, mask=weight_decay_mask, **newton_schulz))
    direction = chain(*steps, *([scale_by_shape(scale, views=views)] if adapted else []))
    if cautious_mode is not None:  # a sharded orthogonalizer's leaves are shards: caution counts whole leaves
        direction = cautious(direction, mode=cautious_mode, sum_shards=getattr(orthogonalizer, "sum_shards", None))
    decay = add_decayed_weights(weight_decay, mask=weight_decay_mask, cautious=cautious_weight_decay)
    return chain(direction, decay, scale_by_learning_rate(lr))


#: The options of a preset that :func:`matrix_branch` takes after the variant and the learning rate, by name.
BRANCH_OPTIONS: tuple[str, ...] = tuple(inspect.signature(matrix_branch).parameters)[2:-1]
