"""NorMuon's neuron-wise normalisation: a second moment per row of the orthogonalized update."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _multi_tensor, _tree
from .._keys import Key, dotted
from .._tree import Leaves
from .._validation import Scalar, check_params, flag, positive, unit_interval
from ..linalg import MatrixView
from ._arithmetic import one_minus
from ._bias_correction import cast_like
from ._caches import StructureCache
from ._contract import Transform
from ._orthogonalize import ViewsLike, check_views, resolve_views
from ._rescale import Rescale, check_rescale, rescaled
from ._rules import Needs, Rule, Scope, from_rule
from ._state import ROW_SECOND_MOMENT


def row_moment_shape(view: MatrixView, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of a leaf's row statistics: its batch dimensions, the logical rows, one column per
    column block (a view split along the columns has several blocks side by side in each row)."""
    rows = view.matrix_shape(shape)[0]
    blocks = len(view.split) if view.split is not None and view.split_dim == 1 else 1
    return (*shape[: view.batch_dims], rows, blocks)


def _row_means(view: MatrixView, blocks: list[torch.Tensor]) -> torch.Tensor:
    """The mean square of every row of every block, as ``(count, rows, column blocks)``."""
    # (a row of no columns has no mean: its statistic stays zero, the update it scales is empty)
    means = [b.square().mean(dim=-1, keepdim=True) if b.size(-1) else b.new_zeros((*b.shape[:-1], 1)) for b in blocks]
    if len(means) == 1:
        return means[0]
    return torch.cat(means, dim=1 if view.split_dim == 0 else 2)


def _per_block(view: MatrixView, denom: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`_row_means`: each block's ``(count, rows, 1)`` slice of ``denom``."""
    if view.split is None:
        return [denom]
    if view.split_dim == 0:
        return list(denom.split(list(view.split), dim=1))
    return list(denom.split(1, dim=2))


def scale_by_neuron_norm(
    beta: Scalar = 0.95,
    *,
    eps: float = 1e-10,
    rescale: Rescale = "preserve_norm",
    views: ViewsLike = None,
    donate_state: bool = False,
) -> Transform:
    r"""NorMuon's neuron-wise normalisation of an orthogonalized update :math:`O` (Li et al., 2025).

    Each output neuron (a row :math:`i` of the logical :math:`m \times n` matrix, after the
    view) keeps an EMA of the mean square of its row, and the row is divided by its root:

    .. math::  v_t = \beta\, v_{t-1} + (1-\beta)\, \tfrac1n \textstyle\sum_j O_{ij}^2, \qquad
               \hat O_{ij} = \frac{O_{ij}}{\sqrt{v_{t,i}} + \epsilon}, \qquad
               u = \hat O \cdot \frac{\rho}{\|\hat O\|_F + \epsilon}

    with :math:`\rho = \|O\|_F` (``"preserve_norm"``, the official code's and
    pytorch-optimizer's default), :math:`\rho = \sqrt{\min(m, n)}` (``"orthogonal"``: followed
    by the ``"match_rms_adamw"`` shape scale :math:`0.2\sqrt{\max(m, n)}` this is the paper's
    :math:`0.2\sqrt{mn}/\|\hat O\|_F`, an RMS of 0.2) or no rescaling (``"none"``). The
    :math:`\epsilon` added to :math:`\|\hat O\|_F` keeps a zero update zero; the paper has none.
    Every block of a fused view and every matrix of a batched one is normalised on its own.

    Place it after :func:`orthogonalize` (with ``scale="none"``) and before the shape scale.
    The row statistics need whole rows, and the rescaling whole matrices: sharded leaves are
    refused (see :func:`muonfn.normuon`). An fp16 leaf is normalised in fp32 (:math:`v` kept
    in fp32: an :math:`\epsilon` of 1e-10 is zero in fp16, and a zero row would give nan)
    and its update rounded once to fp16.

    Args:
        beta: :math:`\beta`, a float or a 0-d tensor in [0, 1).
        eps: :math:`\epsilon > 0`.
        rescale: ``"preserve_norm"``, ``"orthogonal"`` or ``"none"``.
        views: how leaves are read as matrices (see :func:`orthogonalize`).
        donate_state: update the state in place (see :func:`ema_momentum`).

    Returns:
        A :class:`Transform` with state ``{"row_second_moment": v}``, one entry per row and
        column block (see :func:`row_moment_shape`: ``(m, 1)`` for a plain ``(m, n)`` matrix),
        in the leaves' dtypes, but fp32 for fp16 leaves.

    Example:
        >>> params = TensorDict({"w": torch.zeros(2, 3)}, [])
        >>> tx = muonfn.scale_by_neuron_norm(0.5, rescale="none")
        >>> g = TensorDict({"w": torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])}, [])
        >>> tx.update(g, tx.init(params))[0]["w"]  # each row over the root of its EMA
        tensor([[1.4142, 1.4142, 1.4142],
                [1.4142, 1.4142, 1.4142]])
    """
    unit_interval("beta", beta)
    positive("eps", eps)
    eps = float(eps)
    check_rescale("scale_by_neuron_norm", rescale)
    check_views("scale_by_neuron_norm: views", views)
    flag("scale_by_neuron_norm: donate_state", donate_state)

    plans = StructureCache()

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("scale_by_neuron_norm", params)
        keys, values = _tree.leaf_keys(params), _tree.leaves(params)
        moments = []
        for key, p, view in zip(keys, values, resolve_views(views, keys, values, members=params.batch_dims)):
            view.check(key, p.shape)
            moments.append(
                p.new_zeros(row_moment_shape(view, p.shape), dtype=_multi_tensor.second_moment_dtype(p.dtype))
            )
        return TensorDict({ROW_SECOND_MOMENT: _tree.build(keys, moments, params)}, batch_size=params.batch_size)

    def plan(
        keys: list[Key], values: list[torch.Tensor], members: int
    ) -> tuple[list[MatrixView], list[tuple[int, ...]]]:
        """Each leaf's view (checked against the gradient) and the shape of its row statistics."""
        leaf_views = resolve_views(views, keys, values, members=members)
        for key, g, view in zip(keys, values, leaf_views):
            view.check(key, g.shape)
        return leaf_views, [row_moment_shape(view, g.shape) for g, view in zip(values, leaf_views)]

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        keys, values = list(grads), list(grads.values())
        leaf_views, _ = plans.get(grads, scope.batch_size, lambda: plan(keys, values, scope.members))
        moments = scope.read(ROW_SECOND_MOMENT, keys)  # (checked by needs, with the gradients)
        # (an fp16 leaf normalised in fp32)
        blocks = [view.to_matrices(o) for o, view in zip(_multi_tensor.widened(values), leaf_views)]
        means = [_row_means(view, b) for view, b in zip(leaf_views, blocks)]
        # (count, rows, column blocks) views of the state's tensors: a donated update writes into them
        current = [v.reshape(m.shape) for v, m in zip(moments, means)]
        weight = one_minus(_multi_tensor.host_number(beta, values))
        new = _multi_tensor.lerp(current, means, weight, inplace=donate_state)
        scope.write(
            ROW_SECOND_MOMENT, keys, moments if donate_state else [n.reshape(v.shape) for n, v in zip(new, moments)]
        )
        roots = _multi_tensor.apply("sqrt", new)
        # (in place only where nothing differentiates through it: sqrt's gradient reads its output)
        denoms = (_multi_tensor.apply_ if _multi_tensor.may_overwrite(roots) else _multi_tensor.apply)(
            "add", roots, eps
        )
        out = []
        for o, view, matrices, denom in zip(values, leaf_views, blocks, denoms):
            adapted = [rescaled(b.div(d), b, rescale, eps) for b, d in zip(matrices, _per_block(view, denom))]
            out.append(view.from_matrices(adapted, o.shape))
        return dict(zip(keys, cast_like(out, values)))

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        keys, values = list(grads), list(grads.values())
        _refuse_sharded(keys, values)
        members = len(out.batch_size)
        _, shapes = plans.get(grads, out.batch_size, lambda: plan(keys, values, members))
        out.entries.append(("scale_by_neuron_norm", prefix, (ROW_SECOND_MOMENT,)))
        out.shaped += [
            ("scale_by_neuron_norm", (*prefix, ROW_SECOND_MOMENT, *k), k, shape) for k, shape in zip(keys, shapes)
        ]

    return from_rule(init, Rule("scale_by_neuron_norm", update, needs, donate_state))


def _refuse_sharded(keys: Sequence[Key], values: Sequence[torch.Tensor]) -> None:
    for key, t in zip(keys, values):
        placements = tuple(getattr(t, "placements", ()))
        if any(not p.is_replicate() for p in placements):
            raise ValueError(
                f"{dotted(key)!r} is a DTensor sharded as {placements}: NorMuon's row statistics and norms need "
                "whole matrices; gather it, or use muonfn.muon for sharded parameters"
            )


__all__ = ["row_moment_shape", "scale_by_neuron_norm"]
