"""Decoupled weight decay."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from .. import _tree
from .._validation import Scalar, check_grads, non_negative
from ._arithmetic import scaled
from ._base import Transform, empty_state
from ._masks import MaskLike, resolve_mask


def _agreeing(decay: torch.Tensor, u: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``decay`` where ``u`` and ``p`` have the same sign bit, else zero."""
    return decay.mul(u.signbit() == p.signbit())


def add_decayed_weights(
    weight_decay: Scalar = 0.0, *, mask: MaskLike = None, cautious: bool = False, inplace: bool = False
) -> Transform:
    r"""Decoupled weight decay: :math:`u \leftarrow u + \lambda\,p` on the leaves ``mask`` selects.

    With ``cautious=True`` (cautious weight decay, heavyball's ``cautious_weight_decay`` and
    dtensor-muon's default) only the entries where the update and the parameter agree in sign
    are decayed, the sign read from the sign bit as heavyball does:

    .. math::  u \leftarrow u + \lambda\, p \odot \mathbb{1}[\operatorname{signbit}(u) = \operatorname{signbit}(p)]

    Followed by :func:`scale_by_learning_rate` this is :math:`p \leftarrow p - \eta\lambda p`
    with the unadjusted learning rate (torch semantics).

    Args:
        weight_decay: :math:`\lambda \ge 0`, a float or a 0-d tensor.
        mask: a mapping from key to bool, or a callable ``params -> mapping``; leaves it does
            not name are decayed, so ``{"norm.weight": False}`` exempts just that leaf.
            ``None`` decays every leaf.
        cautious: decay only where the incoming update and the parameter agree in sign.
        inplace: add into the incoming updates (same bits, no new tensors): only after a
            transform that returns fresh tensors, as in :func:`muonfn.muon` with ``donate_state``.

    Returns:
        A stateless :class:`Transform`; its ``update`` needs ``params``.
    """
    non_negative("weight_decay", weight_decay)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        if isinstance(weight_decay, float | int) and weight_decay == 0:
            return grads, state
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(grads, state, params)")
        check_grads("add_decayed_weights", grads, params)
        keys = resolve_mask(mask, _tree.subset(params, _tree.leaf_keys(grads)), default=True)
        if not keys:
            return grads, state
        current, decay = _tree.subset(grads, keys), scaled(_tree.subset(params, keys), weight_decay)
        if cautious:  # the mask is read before an in-place add changes the update
            decay = decay.apply(_agreeing, current, _tree.subset(params, keys))
        decayed = current.add_(decay) if inplace else current.add(decay)
        return _tree.carry(grads, decayed), state

    return Transform(empty_state, update)
