"""Momentum: the exponential moving average of the gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _lists
from .._tree import Leaves
from .._validation import Scalar, check_params, flag, unit_interval
from ._arithmetic import one_minus
from ._base import Rule, Scope, Transform, from_rule, per_leaf_needs
from ._state import MOMENTUM, STEP

NesterovLike = bool | Literal["add"]


def as64(v: Scalar) -> torch.Tensor:
    """``v`` as a 0-d fp64 tensor, without reading a tensor back."""
    return v.detach().to(torch.float64) if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)


def ema_momentum(
    momentum: Scalar = 0.95,
    *,
    nesterov: NesterovLike = True,
    bias_correction: bool = False,
    donate_state: bool = False,
) -> Transform:
    r"""Exponential moving average of the gradients (torch.optim.Muon's form by default).

    .. math::  b_t = \mu\, b_{t-1} + (1-\mu)\, g_t, \qquad
               u_t = \begin{cases} (1-\mu)\, g_t + \mu\, b_t & \text{Nesterov (torch, Keller)} \\
                                   g_t + b_t & \texttt{nesterov="add"} \text{ (heavyball's nesterov\_ema)} \\
                                   b_t & \text{otherwise} \end{cases}

    With ``bias_correction=True`` (optax's ``contrib.muon``) the moment and the gradient are
    bias-corrected each on its own, :math:`t` counting this leaf's updates from 1:

    .. math::  u_t = \frac{\mu\, b_t}{1-\mu^{t+1}} + \frac{(1-\mu)\, g_t}{1-\mu^t}
               \ \text{(Nesterov)}, \qquad u_t = \frac{b_t}{1-\mu^t} \ \text{(otherwise)}.

    Args:
        momentum: :math:`\mu`, a float or a 0-d tensor in [0, 1).
        nesterov: ``True`` for the Nesterov look-ahead, ``"add"`` for heavyball's
            :math:`g_t + b_t` (the EMA updated first, with weight :math:`1-\mu` on the
            gradient), ``False`` for :math:`b_t`.
        bias_correction: divide by :math:`1-\mu^t` as above (not with ``nesterov="add"``);
            the state then also counts steps.
        donate_state: update the state's tensors in place and return them in the new state
            instead of allocating new ones, so that peak memory holds one copy of the state,
            as with ``torch.optim``. The state passed to ``update`` is consumed: do not read
            it afterwards (it holds the new values, or after an exception some of them), and
            do not wrap the transform in :func:`apply_if_finite`, which falls back on the old
            state. Results are bitwise those of ``donate_state=False``, under
            ``torch.compile`` too. Where every leaf of the state was updated in place, the
            update returns the very TensorDict it was given (nothing to rebuild).

    Returns:
        A :class:`Transform` with state ``{"momentum": b}`` shaped like the params, in their
        dtype; with ``bias_correction`` also ``{"step": int64 per leaf}`` (per member of a
        stacked ensemble).
    """
    unit_interval("momentum", momentum)
    flag("ema_momentum: bias_correction", bias_correction)
    flag("ema_momentum: donate_state", donate_state)
    if nesterov not in (True, False, "add"):
        raise ValueError(f"ema_momentum: nesterov must be True, False or 'add', got {nesterov!r}")
    if bias_correction and nesterov == "add":
        raise ValueError("ema_momentum: bias_correction applies to nesterov=True or False, not 'add'")

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("ema_momentum", params)
        state = {MOMENTUM: params.apply(torch.zeros_like)}
        if bias_correction:
            members = params.batch_size
            state[STEP] = params.apply(lambda p: p.new_zeros(members, dtype=torch.int64))
        return TensorDict(state, batch_size=params.batch_size)

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        keys, values = list(grads), list(grads.values())
        buf = _lists.lerp(scope.read(MOMENTUM, keys), values, one_minus(momentum), inplace=donate_state)
        scope.write(MOMENTUM, keys, buf)
        if bias_correction:
            counts = count_steps(scope.read(STEP, keys), inplace=donate_state)
            scope.write(STEP, keys, counts.leaves)
            updates = _corrected(values, buf, counts, momentum, nesterov=bool(nesterov), members=scope.members)
        elif nesterov == "add":
            updates = _lists.apply("add", values, buf)
        elif nesterov:
            updates = _lists.lerp(values, buf, momentum)
        else:
            updates = buf
        return dict(zip(keys, updates))

    needs = per_leaf_needs("ema_momentum", (MOMENTUM,), (STEP,) if bias_correction else ())
    return from_rule(init, Rule("ema_momentum", update, needs))


class StepCounts(NamedTuple):
    """Each leaf's update count after this update: ``leaves``, the tensors for the state, and
    ``stacked``, the same counts in fp64 in one tensor padded to whole SIMD vectors
    (so that every value takes the vectorized ``exp``, alone, in a ``vmap`` batch or compiled,
    and the corrections are the same bits in each)."""

    leaves: list[torch.Tensor]
    stacked: torch.Tensor

    def corrections(self, log_beta: torch.Tensor | float, shift: float = 0.0) -> torch.Tensor:
        r""":math:`1-\beta^{t+\text{shift}}`, stacked as :attr:`stacked` (``beta**t`` as
        ``exp(t·log beta)``, so that ``t`` stays a tensor)."""
        t = self.stacked.add(shift) if shift else self.stacked
        return t.mul(log_beta).exp().neg().add(1.0)


def count_steps(steps: list[torch.Tensor], *, inplace: bool) -> StepCounts:
    """``steps`` plus one. Not ``inplace``, the counts are added up on their stack and handed
    out as views of it: one add for all leaves, where a multi-tensor add would cost per leaf
    what the unbind does; in place, each leaf's own tensor counts up."""
    if not steps:
        return StepCounts([], torch.zeros(0, dtype=torch.float64))
    if inplace or any(hasattr(s, "placements") for s in steps):
        steps = _lists.apply_("add", steps, 1) if inplace else _lists.apply("add", steps, 1)
        # replicated DTensor counts, possibly on several meshes: their values are local
        local = [s.to_local() if hasattr(s, "placements") else s for s in steps]  # type: ignore[attr-defined]
        return StepCounts(steps, _padded_stack(local).to(torch.float64))
    stacked = _padded_stack(steps).add(1)
    return StepCounts(list(stacked.unbind(0))[: len(steps)], stacked.to(torch.float64))


def _padded_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([*tensors, *[tensors[0].new_zeros(tensors[0].shape)] * (-len(tensors) % _LANES)])


def bias_corrections(
    counts: StepCounts,
    log_beta: torch.Tensor | float,
    like: list[torch.Tensor],
    members: int,
    *,
    shift: float = 0.0,
    then: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    r""":math:`1-\beta^{t+\text{shift}}` for each leaf's step count :math:`t` (0-d, or one per
    ensemble member), mapped by ``then``, as factors for the leaves ``like`` (see :func:`leaf_factors`)."""
    corrections = counts.corrections(log_beta, shift)
    return leaf_factors(corrections if then is None else then(corrections), like, members)


def leaf_factors(stacked: torch.Tensor, like: list[torch.Tensor], members: int) -> list[torch.Tensor]:
    """One factor per leaf of ``like`` from ``stacked`` (fp64, as :attr:`StepCounts.stacked`).

    Computed in fp64 in one batch for all leaves, they are rounded once to the precision the
    leaf's arithmetic takes a number in: fp32 for fp32 leaves (so a 0-d leaf is not promoted,
    and no fused op converts each factor again), fp64 otherwise; for an ensemble, the leaf's
    dtype, shaped to broadcast against it.
    """
    n = len(like)
    if not n:
        return []
    if members:
        return per_member(list(stacked.unbind(0)), like, members)
    single = [x.dtype == torch.float32 for x in like]
    if all(single):
        return list(stacked.to(torch.float32).unbind(0))[:n]
    double = list(stacked.unbind(0))
    if not any(single):
        return double[:n]
    narrowed = stacked.to(torch.float32).unbind(0)
    return [narrowed[i] if f32 else double[i] for i, f32 in enumerate(single)]


#: a multiple of every CPU's doubles per unrolled vector loop step (AVX-512: 2 × 8)
_LANES = 16


def per_member(factors: list[torch.Tensor], like: list[torch.Tensor], members: int) -> list[torch.Tensor]:
    """One factor per leaf (0-d, or one per ensemble member) shaped to broadcast against the
    leaf, in its dtype, as a 0-d value would meet it (a dimensioned fp64 factor would
    promote an fp32 leaf)."""
    if not members:
        return factors
    return [f.reshape(*f.shape, *[1] * (x.ndim - members)).to(x.dtype) for f, x in zip(factors, like)]


def cast_like(updates: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each update in its leaf's dtype: a 0-d leaf meets 0-d fp64 factors as an equal and is
    promoted, and an fp16 leaf's quotient is computed in fp32 (see ``second_moment_dtype``)."""
    if any(x.dtype != u.dtype for u, x in zip(updates, like)):
        return [u if u.dtype == x.dtype else u.to(x.dtype) for u, x in zip(updates, like)]
    return updates


def _corrected(
    grads: list[torch.Tensor],
    buf: list[torch.Tensor],
    step: StepCounts,
    momentum: Scalar,
    *,
    nesterov: bool,
    members: int,
) -> list[torch.Tensor]:
    """optax's bias-corrected momentum (see :func:`ema_momentum`), in the leaves' dtypes."""
    mu = as64(momentum)
    log_mu = mu.log()  # -inf for mu = 0: then mu**t = 0
    if nesterov:
        moment_weight = bias_corrections(step, log_mu, buf, members, shift=1.0, then=lambda c: c.reciprocal().mul(mu))
        grad_weight = bias_corrections(
            step, log_mu, grads, members, then=lambda c: c.reciprocal().mul(mu.neg().add(1.0))
        )
        weighted = _lists.apply("mul", buf, moment_weight)
        updates = _lists.apply_("add", weighted, _lists.apply("mul", grads, grad_weight))
    else:
        updates = _lists.apply("div", buf, bias_corrections(step, log_mu, buf, members))
    return cast_like(updates, grads)
