"""Bias corrections: per-leaf step counts and the factors :math:`1-\\beta^t` computed from them.

Shared by every transform that keeps a moving average started at zero (:func:`ema_momentum`,
:func:`scale_by_adam`, :func:`scale_by_element_rms`). The counts are tensors, so a traced or
vmapped update never reads one back, and the factors are computed in fp64 in one batch for all
leaves, then rounded once to the precision each leaf's arithmetic takes a number in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import _multi_tensor
from .._validation import Scalar


def as64(v: Scalar) -> torch.Tensor:
    """``v`` as a 0-d fp64 tensor, without reading a tensor back."""
    return v.detach().to(torch.float64) if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)


class StepCounts(NamedTuple):
    """Each leaf's update count after this update: ``leaves``, the tensors for the state, and
    ``stacked``, the same counts in fp64 in one tensor padded to whole SIMD vectors
    (so that every value takes the vectorized ``exp``, alone, in a ``vmap`` batch or compiled,
    and the corrections are the same bits in each)."""

    leaves: list[torch.Tensor]
    stacked: torch.Tensor

    def corrections(self, beta: torch.Tensor | float, shift: float = 0.0) -> torch.Tensor:
        r""":math:`1-\beta^{t+\text{shift}}`, stacked as :attr:`stacked` (``t`` stays a tensor:
        nothing is read back)."""
        t = self.stacked.add(shift) if shift else self.stacked
        return torch.rsub(torch.pow(beta, t), 1.0)


def count_steps(steps: list[torch.Tensor], *, inplace: bool) -> StepCounts:
    """``steps`` plus one. Not ``inplace``, the counts are added up on their stack and handed
    out as views of it: one add for all leaves, where a multi-tensor add would cost per leaf
    what the unbind does; in place, each leaf's own tensor counts up."""
    if not steps:
        return StepCounts([], torch.zeros(0, dtype=torch.float64))
    if inplace or any(hasattr(s, "placements") for s in steps):
        steps = _multi_tensor.apply_("add", steps, 1) if inplace else _multi_tensor.apply("add", steps, 1)
        # replicated DTensor counts, possibly on several meshes: their values are local
        local = [s.to_local() if hasattr(s, "placements") else s for s in steps]  # type: ignore[attr-defined]
        return StepCounts(steps, _padded_stack(local).to(torch.float64))
    stacked = _padded_stack(steps).add(1)
    return StepCounts(list(stacked.unbind(0))[: len(steps)], stacked.to(torch.float64))


def _padded_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` stacked; on a CPU padded to whole SIMD vectors (a GPU computes every element alike)."""
    if _multi_tensor.off_cpu(tensors[0]):
        return torch.stack(tensors)
    return torch.stack([*tensors, *[tensors[0].new_zeros(tensors[0].shape)] * (-len(tensors) % _LANES)])


def bias_corrections(
    counts: StepCounts,
    beta: torch.Tensor | float,
    like: list[torch.Tensor],
    members: int,
    *,
    shift: float = 0.0,
    then: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    r""":math:`1-\beta^{t+\text{shift}}` for each leaf's step count :math:`t` (0-d, or one per
    ensemble member), mapped by ``then``, as factors for the leaves ``like`` (see :func:`leaf_factors`)."""
    corrections = counts.corrections(beta, shift)
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
