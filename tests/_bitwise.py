"""Bit-for-bit comparison of TensorDicts (so -0.0 differs from 0.0)."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(a: TensorDictBase, b: TensorDictBase) -> None:
    """Same leaves with the same shapes, dtypes and bits (meta tensors, which hold none, on meta both)."""
    keys_a = sorted(a.keys(include_nested=True, leaves_only=True), key=str)
    keys_b = sorted(b.keys(include_nested=True, leaves_only=True), key=str)
    assert keys_a == keys_b
    for key in keys_a:
        x, y = a.get(key), b.get(key)
        assert (x.dtype, x.shape, x.is_meta) == (y.dtype, y.shape, y.is_meta), key
        assert x.is_meta or torch.equal(bits(x), bits(y)), key
