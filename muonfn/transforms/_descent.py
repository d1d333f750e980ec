"""The tail of a matrix branch: shape scale, decoupled decay and learning rate in one rule."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _kernels, _multi_tensor
from .._tree import Leaves
from .._validation import Scalar, ScalarOrSchedule
from ..linalg import Decay
from ._caches import StructureCache
from ._combine import chain
from ._contract import Transform
from ._decay import add_decayed_weights
from ._learning_rate import current_rate, scale_by_learning_rate, scaled_by_rate
from ._masks import MaskLike, resolve_mask_flat
from ._rules import Rule, Scope, as_rule, from_rule

#: ``update(grads, scope, factor, decay)``: ``factor·s·x`` for every leaf ``x``, ``s`` its shape
#: scale, in fresh tensors of the leaves' dtypes (the factor is a Python number), plus ``decay``
#: where it is given (see :class:`Scaled`)
ScaledUpdate = Callable[[Leaves, Scope, float, Decay | None], Leaves]


class Scaled:
    """The update of a rule whose last act is a shape scale (:func:`orthogonalize`,
    :func:`scale_by_shape`), which can take a factor on that scale: :func:`descent` reads it.
    ``adds_decay``: it can also add a decay ``alpha·p`` (:class:`muonfn.linalg.Decay`, aligned
    with the leaves) as it stores its results."""

    __slots__ = ("adds_decay", "scaled")

    def __init__(self, scaled: ScaledUpdate, *, adds_decay: bool = False) -> None:
        self.scaled = scaled
        self.adds_decay = adds_decay

    def __call__(self, grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        return self.scaled(grads, scope, 1.0, None)


def descent(
    step: Transform, learning_rate: ScalarOrSchedule, weight_decay: Scalar = 0.0, *, mask: MaskLike = None
) -> Transform:
    r"""``chain(step, add_decayed_weights(weight_decay, mask=mask, inplace=True),
    scale_by_learning_rate(learning_rate, inplace=True))`` as one rule, with the chain's state and
    checks, for a ``step`` that ends in a shape scale (:func:`orthogonalize`, :func:`scale_by_shape`):

    .. math::  u = -\eta\,\bigl(s\,x + \lambda p\bigr) \quad\text{computed as}\quad
               u = (-\eta s)\,x + (-\eta\lambda)\,p

    Eager, with :math:`\eta` and :math:`\lambda` numbers (or 0-d tensors on the host, read as
    numbers: no device waits), :math:`-\eta` goes into the step's own pass with the shape scale
    (for Newton–Schulz, its last step's matmuls), and the decay is one multiply-add: the learning rate
    takes no pass over the leaves of its own, and no rounding. A tensor on a device, one per
    ensemble member, or any traced tensor takes the chain's passes.
    """
    rule = as_rule(step)
    if not isinstance(rule.update, Scaled):
        raise TypeError(f"descent: step must end in a shape scale (orthogonalize or scale_by_shape), got {rule.name!r}")
    scaled, adds_decay = rule.update.scaled, rule.update.adds_decay
    decay = add_decayed_weights(weight_decay, mask=mask, inplace=True)
    rate = scale_by_learning_rate(learning_rate, inplace=True)
    reference = chain(step, decay, rate)  # (the state, the checks and what is read)
    decay_rule = as_rule(decay)
    scheduled = callable(learning_rate) and not isinstance(learning_rate, torch.Tensor)
    masks = StructureCache()
    where = "add_decayed_weights: mask"

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        lr = current_rate(learning_rate, scope, list(grads.values()))
        eta, lam = eager_number(lr), eager_number(weight_decay)
        if eta is None or lam is None:
            out = decay_rule.update(scaled(grads, scope, 1.0, None), scope, params)
            return scaled_by_rate(out, lr, scope, inplace=True, scheduled=scheduled)
        if lam == 0:
            return scaled(grads, scope, -eta, None)
        assert params is not None  # (checked by needs)
        keys = masks.get(
            grads, scope.batch_size, lambda: resolve_mask_flat(mask, grads, params, scope.batch_size, where=where)
        )
        if adds_decay and _fused_decay(grads, [params[k] for k in keys]):
            decayed = set(keys)
            given = [params[k] if k in decayed else None for k in grads]
            return scaled(grads, scope, -eta, Decay(given, -eta * lam))  # added as the results are stored
        out = scaled(grads, scope, -eta, None)
        current, p = [out[k] for k in keys], [params[k] for k in keys]
        add = _multi_tensor.apply_ if _multi_tensor.may_overwrite([*current, *p]) else _multi_tensor.apply
        out.update(zip(keys, add("add", current, p, alpha=-eta * lam)))
        return out

    chained = as_rule(reference)
    return from_rule(reference.init, Rule(rule.name, update, chained.needs, chained.donated))


def _fused_decay(grads: Leaves, params: list[torch.Tensor]) -> bool:
    """Whether the step takes the decay into its own store (muonfn's Triton kernels, for fp32
    leaves: one pass, where the decay's own reads and writes the results once more)."""
    tensors = [*grads.values(), *params]
    return all(t.dtype == torch.float32 for t in tensors) and _kernels.takes_kernels(tensors)


def eager_number(value: Scalar) -> float | None:
    """``value`` as a number: a number, or a 0-d tensor on the host that
    :func:`~muonfn._multi_tensor.readable_on_host` allows (the value it holds, so an fp32 tensor
    of 0.1 reads as fp32's nearest number); ``None`` for any other tensor."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    return value.item() if _multi_tensor.readable_on_host(value) else None
