"""AdaMuon's element-wise second moment of the orthogonalized update."""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _tree
from .._validation import Scalar, check_grads, check_params, positive, unit_interval
from ._arithmetic import one_minus
from ._base import Transform
from ._normuon import _refuse_sharded
from ._orthogonalize import ViewsLike, resolve_views
from ._rescale import Rescale, check_rescale, rescaled
from ._state import EXP_AVG_SQ, STEP, check_entries


def _cast_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.dtype)


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
    are refused.

    Args:
        beta: :math:`\beta`, a float or a 0-d tensor in [0, 1).
        eps: :math:`\epsilon > 0`.
        bias_correction: divide :math:`V_t` by :math:`1-\beta^t`, :math:`t` counting the
            leaf's updates; the state then also counts steps.
        rescale: ``"orthogonal"``, ``"preserve_norm"`` or ``"none"``.
        views: how leaves are read as matrices (see :func:`orthogonalize`).
        donate_state: update the state in place (see :func:`ema_momentum`).

    Returns:
        A :class:`Transform` with state ``{"exp_avg_sq": V}`` shaped like the params (and
        ``{"step": int64 per leaf}`` with ``bias_correction``).

    Example:
        >>> params = TensorDict({"w": torch.zeros(2, 2)}, [])
        >>> tx = muonfn.scale_by_element_rms(0.0, rescale="none")
        >>> g = TensorDict({"w": torch.tensor([[0.5, -2.0], [4.0, 1.0]])}, [])
        >>> tx.update(g, tx.init(params))[0]["w"]  # with beta = 0: the signs
        tensor([[ 1., -1.],
                [ 1.,  1.]])
    """
    beta_value = unit_interval("beta", beta)
    positive("eps", eps)
    eps = float(eps)
    check_rescale("scale_by_element_rms", rescale)
    log_beta = math.log(beta_value) if beta_value > 0 else -math.inf
    entries = (EXP_AVG_SQ, STEP) if bias_correction else (EXP_AVG_SQ,)

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("scale_by_element_rms", params)
        keys, values = _tree.leaf_keys(params), _tree.leaves(params)
        for key, p, view in zip(keys, values, resolve_views(views, keys, values, members=params.batch_dims)):
            view.check(key, p.shape)
        state = {EXP_AVG_SQ: params.apply(torch.zeros_like)}
        if bias_correction:
            members = params.batch_size
            state[STEP] = params.apply(lambda p: p.new_zeros(members, dtype=torch.int64))
        return TensorDict(state, batch_size=params.batch_size)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_entries("scale_by_element_rms", state, entries)
        check_grads("scale_by_element_rms", grads, state[EXP_AVG_SQ])
        if params is not None:
            check_grads("scale_by_element_rms", grads, params)
        keys, values = _tree.leaf_keys(grads), _tree.leaves(grads)
        resolved = resolve_views(views, keys, values, members=grads.batch_dims)
        for key, g, view in zip(keys, values, resolved):
            view.check(key, g.shape)
        _refuse_sharded(keys, values)
        current = _tree.subset(state[EXP_AVG_SQ], keys)
        squares = grads.mul(grads)
        lerp = current.lerp_ if donate_state else current.lerp
        exp_avg_sq = lerp(squares, one_minus(beta))
        new_state = {EXP_AVG_SQ: _tree.carry(state[EXP_AVG_SQ], exp_avg_sq)}
        root = exp_avg_sq
        if bias_correction:
            step = _tree.subset(state[STEP], keys)
            step = step.add_(1) if donate_state else step.add(1)
            new_state[STEP] = _tree.carry(state[STEP], step)
            correction = step.to(torch.float64).mul(log_beta).exp().neg().add(1.0)  # 1 - beta**t
            # in the leaves' dtypes: a 0-d fp64 factor would promote a 0-d leaf
            correction = (
                _tree.per_member(correction, grads) if grads.batch_dims else correction.apply(_cast_like, grads)
            )
            root = exp_avg_sq.div(correction)
        denom = root.sqrt().add(eps)
        out = []
        for key, o, view in zip(keys, values, resolved):
            blocks = view.to_matrices(o.div(denom.get(key)))
            befores = view.to_matrices(o) if rescale == "preserve_norm" else blocks
            out.append(view.from_matrices([rescaled(b, a, rescale, eps) for b, a in zip(blocks, befores)], o.shape))
        return _tree.build(keys, out, grads), TensorDict(new_state, batch_size=state.batch_size)

    return Transform(init, update)
