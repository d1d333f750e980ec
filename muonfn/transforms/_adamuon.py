"""AdaMuon's element-wise second moment of the orthogonalized update."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _multi_tensor, _tree
from .._keys import Key
from .._tree import Leaves
from .._validation import Scalar, check_params, flag, positive, unit_interval
from ..linalg import MatrixView
from ._arithmetic import one_minus
from ._bias_correction import as64, bias_corrections, cast_like, count_steps
from ._caches import StructureCache
from ._contract import Transform
from ._normuon import _refuse_sharded
from ._orthogonalize import ViewsLike, check_views, resolve_views
from ._rescale import Rescale, check_rescale, rescaled
from ._rules import Needs, Rule, Scope, from_rule, per_leaf_needs
from ._state import EXP_AVG_SQ, STEP


def scale_by_element_rms(
    beta: Scalar = 0.95,
    *,
    eps: float = 1e-10,
    bias_correction: bool = False,
    rescale: Rescale = "orthogonal",
    views: ViewsLike = None,
    donate_state: bool = False,
) -> Transform:
    r"""AdaMuon's element-wise adaptation of an orthogonalized update :math:`O` (Si et al., 2025).

    .. math::  V_t = \beta\, V_{t-1} + (1-\beta)\, O \odot O, \qquad
               \hat O = \frac{O}{\sqrt{V_t / c_t} + \epsilon}, \qquad
               u = \hat O \cdot \frac{\rho}{\|\hat O\|_F + \epsilon}

    with :math:`c_t = 1 - \beta^t` under ``bias_correction`` (pytorch-optimizer's ``AdaMuon``;
    the paper has none, :math:`c_t = 1`: the rescaling removes it up to :math:`\epsilon`) and
    :math:`\rho` as in :func:`scale_by_neuron_norm`: the default ``"orthogonal"``,
    :math:`\sqrt{\min(m, n)}`, followed by the ``"match_rms_adamw"`` shape scale is the
    paper's RMS-aligned :math:`0.2\sqrt{mn}/\|\hat O\|_F`. Each matrix block (after the view)
    is rescaled on its own.

    Place it after :func:`orthogonalize` (with ``scale="none"``) and before the shape scale.
    The adaptation is element-wise, but the rescaling needs whole matrices: sharded leaves
    are refused. An fp16 leaf is adapted in fp32 (:math:`V` kept in fp32: fp16 cannot hold
    the square of an entry below 2.4e-4, nor an :math:`\epsilon` of 1e-10) and its update
    rounded once to fp16.

    Args:
        beta: :math:`\beta`, a float or a 0-d tensor in [0, 1); a tensor is read at every
            update, by the moving average and its bias correction alike (change it in place
            between steps).
        eps: :math:`\epsilon > 0`.
        bias_correction: divide :math:`V_t` by :math:`1-\beta^t`, :math:`t` counting the
            leaf's updates; the state then also counts steps.
        rescale: ``"orthogonal"``, ``"preserve_norm"`` or ``"none"``.
        views: how leaves are read as matrices (see :func:`orthogonalize`).
        donate_state: update the state in place (see :func:`ema_momentum`).

    Returns:
        A :class:`Transform` with state ``{"exp_avg_sq": V}`` shaped like the params, in their
        dtype but fp32 for fp16 leaves (and ``{"step": int64 per leaf}`` with ``bias_correction``).

    Example:
        >>> params = TensorDict({"w": torch.zeros(2, 2)}, [])
        >>> tx = muonfn.scale_by_element_rms(0.0, rescale="none")
        >>> g = TensorDict({"w": torch.tensor([[0.5, -2.0], [4.0, 1.0]])}, [])
        >>> tx.update(g, tx.init(params))[0]["w"]  # with beta = 0: the signs
        tensor([[ 1., -1.],
                [ 1.,  1.]])
    """
    unit_interval("beta", beta)
    positive("eps", eps)
    eps = float(eps)
    check_rescale("scale_by_element_rms", rescale)
    check_views("scale_by_element_rms: views", views)
    flag("scale_by_element_rms: bias_correction", bias_correction)
    flag("scale_by_element_rms: donate_state", donate_state)
    # β in fp64, as ema_momentum's bias correction takes it, so that a float and a tensor holding it
    # give the same bits
    fixed_beta = None if isinstance(beta, torch.Tensor) else as64(beta)

    views_of = StructureCache()

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("scale_by_element_rms", params)
        keys, values = _tree.leaf_keys(params), _tree.leaves(params)
        for key, p, view in zip(keys, values, resolve_views(views, keys, values, members=params.batch_dims)):
            view.check(key, p.shape)
        state = {
            EXP_AVG_SQ: params.apply(lambda p: torch.zeros_like(p, dtype=_multi_tensor.second_moment_dtype(p.dtype)))
        }
        if bias_correction:
            members = params.batch_size
            state[STEP] = params.apply(lambda p: p.new_zeros(members, dtype=torch.int64))
        return TensorDict(state, batch_size=params.batch_size)

    def checked_views(keys: list[Key], values: list[torch.Tensor], members: int) -> list[MatrixView]:
        leaf_views = resolve_views(views, keys, values, members=members)
        for key, g, view in zip(keys, values, leaf_views):
            view.check(key, g.shape)
        return leaf_views

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        keys, given = list(grads), list(grads.values())
        leaf_views = views_of.get(grads, scope.batch_size, lambda: checked_views(keys, given, scope.members))
        values = _multi_tensor.widened(given)  # an fp16 leaf adapted in fp32
        squares = _multi_tensor.apply("mul", values, values)
        weight = one_minus(_multi_tensor.host_number(beta, values))
        exp_avg_sq = _multi_tensor.lerp(scope.read(EXP_AVG_SQ, keys), squares, weight, inplace=donate_state)
        scope.write(EXP_AVG_SQ, keys, exp_avg_sq)
        root = exp_avg_sq
        if bias_correction:
            counts = count_steps(scope.read(STEP, keys), inplace=donate_state)
            scope.write(STEP, keys, counts.leaves)
            fp64_beta = as64(beta) if fixed_beta is None else fixed_beta
            correction = bias_corrections(counts, fp64_beta, values, scope.members)
            root = _multi_tensor.apply("div", exp_avg_sq, correction)
        roots = _multi_tensor.apply("sqrt", root)
        # (in place only where nothing differentiates through it: sqrt's gradient reads its output)
        denom = (_multi_tensor.apply_ if _multi_tensor.may_overwrite(roots) else _multi_tensor.apply)("add", roots, eps)
        adapted = _multi_tensor.apply("div", values, denom)
        if rescale == "none":
            return dict(zip(keys, cast_like(adapted, given)))
        out = []
        for o, u, view in zip(values, adapted, leaf_views):
            blocks = view.to_matrices(u)
            befores = view.to_matrices(o) if rescale == "preserve_norm" else blocks
            out.append(view.from_matrices([rescaled(b, a, rescale, eps) for b, a in zip(blocks, befores)], o.shape))
        return dict(zip(keys, cast_like(out, given)))

    state_needs = per_leaf_needs(
        "scale_by_element_rms", (EXP_AVG_SQ,), (STEP,) if bias_correction else (), squares=(EXP_AVG_SQ,)
    )

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        # (refused before any member of a composition runs: a donated momentum must not have moved)
        keys, given = list(grads), list(grads.values())
        _refuse_sharded(keys, given)
        views_of.get(grads, out.batch_size, lambda: checked_views(keys, given, len(out.batch_size)))
        state_needs(grads, params, prefix, out)

    return from_rule(init, Rule("scale_by_element_rms", update, needs, donate_state))
