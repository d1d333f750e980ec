"""AdamW as one rule: Adam's moments, the decay and the learning rate in the fewest passes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _multi_tensor
from .._keys import Key
from .._tree import Leaves
from .._validation import Scalar, ScalarOrSchedule
from ._adam import adam_moments, scale_by_adam
from ._arithmetic import neg
from ._bias_correction import cast_like, count_steps, leaf_factors, per_member
from ._caches import StructureCache
from ._combine import chain
from ._contract import Transform
from ._decay import add_decayed_weights, decay_factors
from ._learning_rate import current_rate, scale_by_learning_rate
from ._masks import MaskLike, resolve_mask_flat
from ._rules import Rule, Scope, as_rule, from_rule
from ._state import EXP_AVG, EXP_AVG_SQ, STEP


def fused_adamw(
    learning_rate: ScalarOrSchedule,
    b1: Scalar,
    b2: Scalar,
    *,
    eps: float,
    weight_decay: Scalar,
    mask: MaskLike,
    donate_state: bool,
) -> Transform:
    r"""``chain(scale_by_adam(b1, b2, eps=eps), add_decayed_weights(weight_decay, mask=mask),
    scale_by_learning_rate(learning_rate))`` as one rule, with the same state (``"step"``,
    ``"exp_avg"``, ``"exp_avg_sq"``, and a schedule's ``"count"``) and the same checks.

    The moments are torch.optim.AdamW's ops, and so its bits (see :func:`adam_moments`). The
    update is torch's :math:`-\eta\lambda p - \frac{\eta}{c_1}\,\frac{m_t}{\sqrt{v_t}/\sqrt{c_2}
    + \epsilon}` (:math:`c_k = 1-\beta_k^t`) with the step size folded into the denominator,
    which takes two passes after the root, as torch's own takes:

    .. math::  D = \bigl(\sqrt{v_t} + \epsilon\sqrt{c_2}\bigr)\cdot\frac{-c_1}{\eta\sqrt{c_2}},
               \qquad u = -\eta\lambda\,p + m_t / D

    (``u = m / D``, written over :math:`D`, then ``u.addcmul_(p, ηλ, value=-1)`` on a decayed leaf). The
    factors are computed per leaf in fp64 from its step count and rounded once to the
    precision of the leaf's arithmetic; :math:`\epsilon\sqrt{c_2} > 0` is added before the
    scale, so that a learning rate of 0 makes :math:`D = -\infty` and the update
    :math:`-\eta\lambda p` exactly, never ``nan``. An fp16 leaf's update is computed in fp32 (its
    second moment's dtype) and rounded once.

    On a CUDA GPU, one model's fp32 leaves go through torch's fused AdamW kernel instead, in one
    pass (see :func:`takes_torch_kernel`): the same formula, torch's rounding.

    ``b1`` may be a 0-d tensor, read at every update (see :func:`scale_by_adam`).
    """
    reference = chain(
        scale_by_adam(b1, b2, eps=eps, donate_state=donate_state),
        add_decayed_weights(weight_decay, mask=mask, inplace=True),
        scale_by_learning_rate(learning_rate, inplace=True),
    )  # (checks every option, and is the state layout and the input checks)
    b1 = b1 if isinstance(b1, torch.Tensor) else float(b1)  # (a tensor is read at every update, see scale_by_adam)
    b2, eps = float(b2), float(eps)
    decays = not (isinstance(weight_decay, float | int) and weight_decay == 0)
    masks = StructureCache()
    flat_segments = StructureCache()

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        keys, g = list(grads), list(grads.values())
        lr = _multi_tensor.host_number(current_rate(learning_rate, scope, g), g)  # (off the CPU: no host ops)
        wd = _multi_tensor.host_number(weight_decay, g)
        decayed = _decayed_keys(grads, scope, params) if decays else []
        beta1 = _multi_tensor.host_number(b1, g)
        if g and g[0].device.type in TORCH_KERNEL_DEVICES and not isinstance(beta1, torch.Tensor):
            operands = [*g, *scope.read(EXP_AVG, keys), *scope.read(EXP_AVG_SQ, keys)]
            if params is not None:
                operands += [params[k] for k in decayed]
            if takes_torch_kernel(operands, scope, lr, wd):
                return _through_torch_kernel(keys, g, scope, params, decayed, lr, wd, beta1, b2, eps, donate_state)
        counts, exp_avg, exp_avg_sq = adam_moments(keys, g, scope, beta1, b2, donate_state=donate_state)
        members = scope.members
        root_c2 = counts.corrections(b2).sqrt()
        # -c₁/(η√c₂): -inf at η = 0, which meets a denominator of at least ε√c₂ > 0
        step_scale = counts.corrections(beta1).div(root_c2.mul(neg(lr)))
        # in place on this update's own root where nothing differentiates through it
        rewrite = (
            _multi_tensor.apply_ if donate_state or _multi_tensor.may_overwrite(exp_avg_sq) else _multi_tensor.apply
        )
        denom = _denominators(exp_avg_sq, root_c2.mul(eps), step_scale, members, rewrite, segments_of(grads, scope))
        overwrite = _multi_tensor.may_overwrite(exp_avg) and _multi_tensor.may_overwrite(denom)
        updates = _multi_tensor.quotients(exp_avg, denom, overwrite=overwrite)  # (over the denominators: one buffer)
        if decays:
            assert params is not None  # (checked by needs)
            index = {k: i for i, k in enumerate(keys)}
            where = [index[k] for k in decayed]
            terms = [updates[i] for i in where]
            p = [params[k] for k in decayed]
            for i, u in zip(where, _decayed(terms, p, lr * wd, members)):
                updates[i] = u
        return dict(zip(keys, cast_like(updates, g)))

    def segments_of(grads: Leaves, scope: Scope) -> Callable[[list[int]], torch.Tensor]:
        def segments(small: list[int]) -> torch.Tensor:
            like = list(grads.values())
            device = like[small[0]].device
            cached = flat_segments.get(grads, scope.batch_size, lambda: {})
            if device not in cached:  # (one structure may live on several devices in turn)
                cached[device] = _segments(small, like)
            return cached[device]

        return segments

    def _decayed_keys(grads: Leaves, scope: Scope, params: Leaves | None) -> list[Key]:
        assert params is not None  # (checked by needs)
        where = "add_decayed_weights: mask"
        return masks.get(
            grads, scope.batch_size, lambda: resolve_mask_flat(mask, grads, params, scope.batch_size, where=where)
        )

    return from_rule(reference.init, Rule("adamw", update, as_rule(reference).needs, donate_state))


#: The devices whose AdamW leaves take torch's fused kernel (see :func:`takes_torch_kernel`);
#: ``meta`` takes CUDA's paths, for shape checks and for counting what a step moves
TORCH_KERNEL_DEVICES = frozenset({"cuda", "meta"})


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def takes_torch_kernel(operands: list[torch.Tensor], scope: Scope, lr: Scalar, weight_decay: Scalar) -> bool:
    """Whether an AdamW update goes through ``torch._fused_adamw_``, the kernel behind
    ``torch.optim.AdamW(fused=True)``: for one model (no ensemble) whose ``operands`` (gradients,
    moments, decayed parameters) are contiguous fp32 tensors on one CUDA device, eager, outside ``torch.func``
    transforms, with nothing that autograd records (the kernel writes in place and has no
    derivative). The operands are plain tensors, with the learning rate and decay numbers or 0-d
    tensors on that device; or all DTensors (the kernel steps a shard as it steps a whole tensor),
    with both rates numbers. Elsewhere, and on the CPU, the rule's own passes run: the same
    arithmetic but for rounding (see :func:`fused_adamw`)."""
    if scope.members or not operands or torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return False
    device = operands[0].device
    if device.type not in TORCH_KERNEL_DEVICES:
        return False
    # (CUDA's kernel takes each leaf's tensors with one layout, dense: contiguous ones have it)
    if not all(t.dtype == torch.float32 and t.device == device and t.is_contiguous() for t in operands):
        return False
    factors = [v for v in (lr, weight_decay) if isinstance(v, torch.Tensor)]
    if all(type(t) in _PLAIN for t in operands):
        if not all(f.device == device and f.ndim == 0 for f in factors):
            return False
    elif factors or not all(_mesh(t) is not None for t in operands):
        return False
    return _multi_tensor.may_overwrite(operands, *factors)


def _mesh(t: torch.Tensor) -> Any:
    """A DTensor's device mesh (``None`` for a plain tensor)."""
    return getattr(t, "device_mesh", None) if hasattr(t, "placements") else None


def _through_torch_kernel(
    keys: list[Key],
    g: list[torch.Tensor],
    scope: Scope,
    params: Leaves | None,
    decayed: list[Key],
    lr: Scalar,
    weight_decay: Scalar,
    b1: float,
    b2: float,
    eps: float,
    donate_state: bool,
) -> Leaves:
    r"""The update by ``torch._fused_adamw_``, one pass over each leaf's gradient, moments and
    update: the update starts as :math:`-\eta\lambda p` (0 on a leaf the mask exempts), and
    the kernel, given it as its parameter with no decay of its own, subtracts torch's step
    :math:`\frac{\eta}{c_1}\,\frac{m_t}{\sqrt{v_t}/\sqrt{c_2} + \epsilon}`. Without decay
    that is ``torch.optim.AdamW(fused=True)``'s parameter change, bit for bit."""
    exp_avg, exp_avg_sq = scope.read(EXP_AVG, keys), scope.read(EXP_AVG_SQ, keys)
    counts = count_steps(scope.read(STEP, keys), inplace=donate_state)
    if not donate_state:  # the kernel writes the moments in place: a new state has its own
        exp_avg, exp_avg_sq = _multi_tensor.copies(exp_avg), _multi_tensor.copies(exp_avg_sq)
    updates: list[torch.Tensor] = [None] * len(keys)  # type: ignore[list-item]
    index = {k: i for i, k in enumerate(keys)}
    if decayed:
        assert params is not None  # (checked by needs)
        for k, u in zip(decayed, _multi_tensor.apply("mul", [params[k] for k in decayed], neg(lr * weight_decay))):
            updates[index[k]] = u
    exempt = [i for i, u in enumerate(updates) if u is None]
    if exempt:
        zeros = [torch.empty_like(g[i]) for i in exempt]
        torch._foreach_zero_(zeros)
        for i, u in zip(exempt, zeros):
            updates[i] = u
    steps = list(counts.stacked.to(torch.float32).unbind(0))[: len(keys)]  # (the kernel reads fp32 counts)
    # meta, which takes CUDA's paths to count them, has no kernel for a tensor rate (``tensor_lr``)
    # and holds no values: a number stands for the rate there, the same kernel over the same tensors
    kernel_lr = 0.0 if isinstance(lr, torch.Tensor) and lr.device.type == "meta" else lr
    meshes: dict[int, list[int]] = {}  # (one call per device mesh: a DTensor op takes one)
    for i, t in enumerate(g):
        meshes.setdefault(id(_mesh(t)), []).append(i)
    for at in meshes.values():
        operands = ([x[i] for i in at] for x in (updates, g, exp_avg, exp_avg_sq))
        torch._fused_adamw_(  # type: ignore[call-overload]  # (lr a number or a 0-d tensor: an overload each)
            *operands, [], [steps[i] for i in at],
            lr=kernel_lr, beta1=b1, beta2=b2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
    for entry, values in ((STEP, counts.leaves), (EXP_AVG, exp_avg), (EXP_AVG_SQ, exp_avg_sq)):
        scope.write(entry, keys, values)
    return dict(zip(keys, updates))


#: Off the CPU, fp32 leaves below this many elements take their per-leaf factors in one flat
#: tensor (see :func:`_denominators`).
FLAT_NUMEL = 1 << 16


def gathers_small_leaves(like: list[torch.Tensor], members: int) -> bool:
    """Whether per-leaf factors go to the small leaves through one flat tensor: off the CPU, for
    plain fp32 leaves, outside ``torch.func`` transforms (where every op runs leaf by leaf)."""
    return (
        not members
        and len(like) > 0
        and not torch._C._are_functorch_transforms_active()
        and all(type(t) is torch.Tensor and t.dtype == torch.float32 and _multi_tensor.off_cpu(t) for t in like)
    )


def _denominators(
    v: list[torch.Tensor],
    shift: torch.Tensor,
    scale: torch.Tensor,
    members: int,
    rewrite: Callable[..., Any],
    segments: Callable[[list[int]], torch.Tensor],
) -> list[torch.Tensor]:
    r""":math:`(\sqrt{v} + a)\cdot b` per leaf, ``a`` and ``b`` one fp64 value per leaf, stacked.

    A multi-tensor op with a factor per leaf runs tensor by tensor on a GPU (torch's fused
    kernels take one factor for all), a kernel per leaf. So off the CPU the small leaves (a
    model's norms and biases: most leaves, few elements) are gathered into one flat tensor and
    meet their factors repeated over their elements (``segments(small)``: each element's leaf),
    a kernel per op for all of them. Each entry's arithmetic is the same, and so are the bits.
    """
    small = [i for i, t in enumerate(v) if t.numel() < FLAT_NUMEL] if gathers_small_leaves(v, members) else []
    if len(small) < 2:
        d = rewrite("add", _multi_tensor.apply("sqrt", v), leaf_factors(shift, v, members))
        return rewrite("mul", d, leaf_factors(scale, v, members))
    # each leaf's factors rounded to fp32 once, as :func:`leaf_factors` rounds them for fp32 leaves
    factors = torch.stack([shift, scale]).to(torch.float32)
    gathered = set(small)
    rest = [i for i in range(len(v)) if i not in gathered]
    out: list[torch.Tensor] = [None] * len(v)  # type: ignore[list-item]
    if rest:
        shifts, scales = (row.unbind(0) for row in factors)
        d = rewrite("add", _multi_tensor.apply("sqrt", [v[i] for i in rest]), [shifts[i] for i in rest])
        for i, x in zip(rest, rewrite("mul", d, [scales[i] for i in rest])):
            out[i] = x
    flat = torch.cat([_flat(v[i]) for i in small]).sqrt_()  # (a fresh tensor of this call's own)
    shift_flat, scale_flat = factors[:, segments(small)].unbind(0)
    if rewrite is _multi_tensor.apply_:
        flat = flat.add_(shift_flat).mul_(scale_flat)
    else:
        flat = flat.add(shift_flat).mul(scale_flat)
    for i, x in zip(small, flat.split([v[i].numel() for i in small])):
        out[i] = x if v[i].ndim == 1 else x.view(v[i].shape)
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.ndim == 1 else t.reshape(-1)


def _segments(small: list[int], like: list[torch.Tensor]) -> torch.Tensor:
    """The leaf index of every element of the small leaves ``small`` of ``like``, flat, on their device."""
    device = like[small[0]].device
    return torch.cat([torch.full((like[i].numel(),), i, dtype=torch.int64, device=device) for i in small])


def _decayed(terms: list[torch.Tensor], p: list[torch.Tensor], factor: Scalar, members: int) -> list[torch.Tensor]:
    """``u - ηλ·p`` for every update ``u`` of ``terms`` and its parameter (``factor``: ηλ).

    One multiply-add per entry: off the CPU with ``ηλ`` a number (or, eager, a 0-d tensor on the
    host), one fused kernel for all leaves; else ``ηλ`` a 0-d factor per leaf, but off the CPU,
    for the small leaves, ``ηλ·p`` is written out and subtracted: one factor for all of them
    keeps torch's fused multi-tensor kernels, where a factor per leaf would launch a kernel per
    leaf. A leaf is small by its size for one member (so a stacked ensemble, a vmapped one and
    one model agree), a DTensor by its whole size.
    """
    add = _multi_tensor.apply_ if _multi_tensor.may_overwrite([*terms, *p], factor) else _multi_tensor.apply
    number = _multi_tensor.host_number(factor, terms)
    if terms and not isinstance(number, torch.Tensor) and _multi_tensor.off_cpu(terms[0]):
        return add("add", terms, p, alpha=-number)
    small = [i for i, u in enumerate(terms) if _multi_tensor.off_cpu(u) and u.shape[members:].numel() < FLAT_NUMEL]
    if not small:
        return add("addcmul", terms, p, _decay_factors(factor, terms, members), value=-1)
    out = list(terms)
    gathered = set(small)
    large = [i for i in range(len(terms)) if i not in gathered]
    if large:
        at = [terms[i] for i in large]
        decayed = add("addcmul", at, [p[i] for i in large], _decay_factors(factor, at, members), value=-1)
        for i, u in zip(large, decayed):
            out[i] = u
    at, weights = [terms[i] for i in small], [p[i] for i in small]
    if members:
        decay = _multi_tensor.apply("mul", weights, _decay_factors(factor, at, members))
    else:
        decay = _multi_tensor.scale(weights, factor)
    subtract = _multi_tensor.apply if add is _multi_tensor.apply else _multi_tensor.apply_
    for i, u in zip(small, subtract("sub", at, decay)):
        out[i] = u
    return out


def _decay_factors(factor: Scalar, like: list[torch.Tensor], members: int) -> list[torch.Tensor]:
    """``factor`` (a number, a 0-d tensor or one value per ensemble member) as one tensor per
    leaf of ``like``, in its dtype (see :func:`add_decayed_weights`'s rounding)."""
    if isinstance(factor, torch.Tensor) and factor.ndim:
        return per_member([factor] * len(like), like, members)
    return decay_factors(factor, like)
