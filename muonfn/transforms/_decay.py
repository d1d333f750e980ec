"""Decoupled weight decay."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from .. import _multi_tensor, _tree
from .._keys import Key
from .._tree import Leaves
from .._validation import Scalar, flag, non_negative
from ._caches import StructureCache
from ._contract import Transform, empty_state
from ._masks import MaskLike, check_mask, resolve_mask, resolve_mask_flat
from ._rules import Needs, Rule, Scope, from_rule


def _agreeing(decay: torch.Tensor, u: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``decay`` where ``u`` and ``p`` have the same sign bit, else zero."""
    return decay.mul(u.signbit() == p.signbit())


def _on_cpu(weight_decay: Scalar, leaves: list[torch.Tensor]) -> bool:
    if isinstance(weight_decay, torch.Tensor) and _multi_tensor.off_cpu(weight_decay):
        return False
    return not any(_multi_tensor.off_cpu(u) for u in leaves)


def decay_factors(weight_decay: Scalar, like: list[torch.Tensor]) -> list[torch.Tensor]:
    r""":math:`\lambda` as a 0-d tensor of each (CPU) leaf's dtype, one conversion per dtype.

    A number and a tensor holding it give the same bits: both are rounded to the leaf's
    dtype before the multiply-add, as the kernels round a number operand of a bf16 leaf.
    """
    dtypes = {u.dtype for u in like}
    if isinstance(weight_decay, torch.Tensor):
        kinds = {dtype: weight_decay.to(dtype) for dtype in dtypes}
    else:  # rounded once from the number (a conversion less than from a float64 tensor, the same bits)
        kinds = {dtype: torch.tensor(weight_decay, dtype=dtype) for dtype in dtypes}
    return [kinds[u.dtype] for u in like]


def add_decayed_weights(
    weight_decay: Scalar = 0.0, *, mask: MaskLike = None, cautious: bool = False, inplace: bool = False
) -> Transform:
    r"""Decoupled weight decay: :math:`u \leftarrow u + \lambda\,p` on the leaves ``mask`` selects.

    With ``cautious=True`` (cautious weight decay, heavyball's ``cautious_weight_decay`` and
    dtensor-muon's default) only the entries where the update and the parameter agree in sign
    are decayed, the sign read from the sign bit as heavyball does:

    .. math::  u \leftarrow u + \lambda\, p \odot \mathbb{1}[\operatorname{signbit}(u) = \operatorname{signbit}(p)]

    Followed by :func:`scale_by_learning_rate` this is :math:`p \leftarrow p - \eta\lambda p`
    with the unadjusted learning rate (torch semantics). On a CPU the plain decay is one
    multiply-add per entry, with :math:`\lambda` rounded to the leaf's dtype; elsewhere so for a
    number (and, eager, a 0-d tensor on the host, read as one), while a tensor on the device, or
    any traced tensor, has :math:`\lambda p` rounded before it is added.

    Args:
        weight_decay: :math:`\lambda \ge 0`, a float or a 0-d tensor.
        mask: a mapping from key to ``True``/``False`` (or one-element bool tensors), or a
            callable ``params -> mapping``; leaves it does not name are decayed, so
            ``{"norm.weight": False}`` exempts just that leaf. ``"matrices"`` decays only
            the leaves of two dimensions or more (matrices, embeddings, conv kernels; not
            biases and norm gains). ``None`` decays every leaf. Other values (``"False"``,
            ``[False]``) are refused: their truth value is true.
        cautious: decay only where the incoming update and the parameter agree in sign.
        inplace: add into the incoming updates (the same bits) unless autograd
            records them or a ``torch.func`` transform is active: only after a transform that
            returns fresh tensors, as every preset's direction does.

    Returns:
        A stateless :class:`Transform`; its ``update`` needs ``params``.
    """
    non_negative("weight_decay", weight_decay)
    where = "add_decayed_weights: mask"
    check_mask(where, mask)
    flag("add_decayed_weights: cautious", cautious)
    flag("add_decayed_weights: inplace", inplace)

    masks = StructureCache()

    def init(params: TensorDictBase) -> TensorDictBase:
        # what a callable mask returns is checked before a step (not for the empty params a
        # chain builds to read the state's keys, which the callable may not expect)
        if callable(mask) and _tree.leaf_keys(params):
            resolve_mask(mask, params, True, where=where)
        return empty_state(params)

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        if isinstance(weight_decay, float | int) and weight_decay == 0:
            return grads
        assert params is not None  # (checked by needs)
        keys = masks.get(
            grads, scope.batch_size, lambda: resolve_mask_flat(mask, grads, params, scope.batch_size, where=where)
        )
        if not keys:
            return grads
        current, p = [grads[k] for k in keys], [params[k] for k in keys]
        # (a parameter that autograd records would make the update record it too, which the
        # Newton–Schulz results, views of one batch, do not allow in place)
        overwrite = inplace and _multi_tensor.may_overwrite([*current, *p], weight_decay)
        add = _multi_tensor.apply_ if overwrite else _multi_tensor.apply
        number = _multi_tensor.host_number(weight_decay, current)  # (the shim's host λ, eager)
        if not cautious and _on_cpu(weight_decay, current):
            # u + λp as one multiply-add per entry: no decay term written out. (On a CPU, whose
            # multi-tensor ops run tensor by tensor anyway, with λ a 0-d tensor of the leaf's
            # dtype: the CPU's kernels convert a number once per tensor.)
            decayed = add("addcmul", current, p, decay_factors(weight_decay, current))
        elif not cautious and not isinstance(number, torch.Tensor):
            # off the CPU one multiply-add per entry too, λ a number: one fused kernel for the list
            decayed = add("add", current, p, alpha=number)
        else:
            # λ a tensor on the device (or traced): λp written out and added, since a tensor as
            # alpha would be read back to the host and a 0-d factor per leaf would run the op
            # tensor by tensor
            decay = _multi_tensor.scale(p, weight_decay)
            if cautious:  # the mask is read before an in-place add changes the update
                decay = [_agreeing(d, u, x) for d, u, x in zip(decay, current, p)]
            if overwrite:
                decayed = _multi_tensor.apply_("add", current, decay)
            elif torch._C._are_functorch_transforms_active():  # (under vmap the decay term may be unbatched)
                decayed = _multi_tensor.apply("add", current, decay)
            else:  # the sum goes into the decay term, this update's own tensor: one fresh tensor less
                decayed = _multi_tensor.apply_("add", decay, current)
        out = dict(grads)
        out.update(zip(keys, decayed))
        return out

    def needs(grads: Leaves, params: Leaves | None, prefix: Key, out: Needs) -> None:
        if not (isinstance(weight_decay, float | int) and weight_decay == 0):
            out.params.append("add_decayed_weights")

    return from_rule(init, Rule("add_decayed_weights", update, needs))
