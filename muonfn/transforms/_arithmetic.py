"""Hyperparameter arithmetic shared by the transforms: a Python number or a 0-d tensor, never a host sync."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from .._validation import Scalar


def neg(v: Scalar) -> Scalar:
    return v.neg() if isinstance(v, torch.Tensor) else -v


def one_minus(v: Scalar) -> Scalar:
    return v.neg().add(1) if isinstance(v, torch.Tensor) else 1.0 - v


def _has_dtensor(td: TensorDictBase) -> bool:
    return any(hasattr(x, "placements") for x in td.values(True, True))


def scaled(td: TensorDictBase, v: Scalar, *, inplace: bool = False) -> TensorDictBase:
    """``td * v`` (``td *= v`` with ``inplace``).

    A tensor ``v`` meets DTensor leaves one at a time: a fused op would put it on the first
    leaf's mesh, and leaves may live on several meshes (tensor parallel + FSDP).
    """
    if isinstance(v, torch.Tensor) and _has_dtensor(td):
        return td.apply_(lambda x: x.mul_(v)) if inplace else td.apply(lambda x: x.mul(v))
    return td.mul_(v) if inplace else td.mul(v)
