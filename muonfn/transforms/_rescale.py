"""Giving each matrix block of an adapted update a chosen Frobenius norm (NorMuon, AdaMuon)."""

from __future__ import annotations

import math
from typing import Literal, TypeAlias

import torch

Rescale: TypeAlias = Literal["preserve_norm", "orthogonal", "none"]
RESCALE_MODES: tuple[str, ...] = ("preserve_norm", "orthogonal", "none")


def check_rescale(where: str, rescale: str) -> None:
    if rescale not in RESCALE_MODES:
        raise ValueError(f"{where}: unknown rescale {rescale!r}; choose one of {list(RESCALE_MODES)}")


def rescaled(adapted: torch.Tensor, before: torch.Tensor, rescale: str, eps: float) -> torch.Tensor:
    r"""``adapted`` (a ``(count, m, n)`` batch) with each matrix's Frobenius norm set by ``rescale``.

    ``"preserve_norm"``: :math:`\|B\|_F`, the norm of the same matrix ``before`` adaptation;
    ``"orthogonal"``: :math:`\sqrt{\min(m, n)}`, the norm of a semi-orthogonal matrix;
    ``"none"``: unchanged. The norm of ``adapted`` gets ``eps`` added, so a zero update stays zero.
    """
    if rescale == "none":
        return adapted
    norm = torch.linalg.matrix_norm(adapted, keepdim=True).add(eps)
    if rescale == "preserve_norm":
        return adapted.mul(torch.linalg.matrix_norm(before, keepdim=True).div(norm))
    return adapted.mul(norm.reciprocal().mul(math.sqrt(min(adapted.shape[-2], adapted.shape[-1]))))
