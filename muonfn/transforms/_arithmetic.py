"""Hyperparameter arithmetic shared by the transforms: a Python number or a 0-d tensor, never a host sync."""

from __future__ import annotations

import torch

from .._validation import Scalar


def neg(v: Scalar) -> Scalar:
    return v.neg() if isinstance(v, torch.Tensor) else -v


def one_minus(v: Scalar) -> Scalar:
    return v.neg().add(1) if isinstance(v, torch.Tensor) else 1.0 - v
