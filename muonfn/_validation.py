"""Checks that turn bad input into a clear error before anything is computed."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias

import torch
from tensordict import TensorDictBase

from ._tree import Key, dotted, leaf_keys, resolve_key

Scalar: TypeAlias = float | torch.Tensor
ScalarOrSchedule: TypeAlias = float | torch.Tensor | Callable[[torch.Tensor], Scalar]


def _value(name: str, v: Scalar) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(v.shape)}")
        return float(v.detach().cpu())
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float or a 0-d tensor, got {type(v).__name__}")
    return float(v)


def non_negative(name: str, v: ScalarOrSchedule) -> None:
    """Learning rates and weight decays: ``v >= 0`` (schedules are checked when called)."""
    if callable(v) and not isinstance(v, torch.Tensor):
        return
    x = _value(name, v)
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {v!r}")


def unit_interval(name: str, v: Scalar) -> None:
    """Momenta and betas: ``0 <= v < 1``."""
    x = _value(name, v)
    if not 0.0 <= x < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {v!r}")


def positive(name: str, v: Scalar) -> None:
    """Epsilons: ``v > 0``."""
    x = _value(name, v)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")


def known_names(where: str, names: Iterable[Any], keys: Sequence[Key]) -> None:
    """Every user-written name must be a leaf of ``keys``: a typo is an error, never ignored."""
    for name in names:
        try:
            resolve_key(name, keys)
        except KeyError:
            raise ValueError(
                f"{where} names {name!r}, which is not a parameter; parameters are {[dotted(k) for k in keys]}"
            ) from None


def check_grads(where: str, grads: TensorDictBase, reference: TensorDictBase) -> None:
    """Every gradient leaf must be a dense real tensor matching ``reference``'s leaf.

    ``grads`` may hold fewer leaves than ``reference`` (a leaf without a gradient is
    skipped), never other ones.
    """
    known = {k: v for k, v in zip(leaf_keys(reference), reference.values(True, True))}
    for key, g in zip(leaf_keys(grads), grads.values(True, True)):
        name = dotted(key)
        ref = known.get(key)
        if ref is None:
            raise ValueError(f"{where}: gradient {name!r} has no matching parameter or state")
        if g.layout is not torch.strided:
            raise TypeError(f"{where}: gradient {name!r} is {g.layout}; only dense gradients are supported")
        if g.is_complex():
            raise TypeError(f"{where}: gradient {name!r} is complex ({g.dtype}); only real gradients are supported")
        if g.shape != ref.shape:
            raise ValueError(f"{where}: gradient {name!r} has shape {tuple(g.shape)}, expected {tuple(ref.shape)}")
        if g.dtype != ref.dtype:
            raise ValueError(f"{where}: gradient {name!r} has dtype {g.dtype}, expected {ref.dtype}")
