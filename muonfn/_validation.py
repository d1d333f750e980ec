"""Checks that turn bad input into a clear error before anything is computed."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
from tensordict import TensorDictBase

Scalar: TypeAlias = float | torch.Tensor
Schedule: TypeAlias = Callable[[torch.Tensor], Scalar]
ScalarOrSchedule: TypeAlias = float | torch.Tensor | Schedule


def _value(name: str, v: Scalar) -> float:
    if isinstance(v, torch.Tensor):
        if v.ndim != 0:
            raise ValueError(
                f"{name} must be a float or a 0-d tensor, got a tensor of shape {tuple(v.shape)} "
                "(a 1-element tensor would broadcast the parameters to its shape; pass tensor.reshape(()))"
            )
        if v.is_complex() or v.dtype == torch.bool:
            raise TypeError(f"{name} must be a real float or a 0-d real tensor, got a {v.dtype} tensor")
        if v.is_meta:
            raise ValueError(f"{name} is a tensor on the meta device, which holds no value")
        return float(v.detach().cpu())
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"{name} must be a float or a 0-d tensor, got {type(v).__name__}")
    return float(v)


def non_negative(name: str, v: Scalar) -> None:
    """Learning rates and weight decays given as values: ``v >= 0`` (a schedule's results are
    checked by :func:`schedule_value`)."""
    if not 0 <= _value(name, v) < math.inf:  # (NaN is refused too)
        raise ValueError(f"{name} must be finite and >= 0, got {v!r}")


def schedule_value(where: str, value: object) -> Scalar:
    """The result of a schedule, checked at every call; ``where`` names the schedule.

    A Python number must be finite and ``>= 0``. Of a tensor only what needs no read-back is
    checked, its dtype here (real: no bool, no complex, as for a tensor given as the value
    itself) and its shape and device where the leaves are known: reading its value would wait
    for the device and stall the step (and break ``torch.compile(fullgraph=True)``).
    """
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{where} must return a float or a 0-d real tensor, got a {value.dtype} tensor")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where} must return a float or a 0-d tensor, got {type(value).__name__}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{where} returned {value!r}; it must be finite and >= 0")
    return value


def unit_interval(name: str, v: Scalar) -> float:
    """Momenta and betas: ``0 <= v < 1``; returns the value as a float."""
    x = _value(name, v)
    if not 0.0 <= x < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {v!r}")
    return x


def positive(name: str, v: Scalar) -> None:
    """Epsilons: ``v > 0``."""
    if not 0 < _value(name, v) < math.inf:  # (NaN is refused too)
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")


def flag(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {v!r}")


def _storage_identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one: storage, offset, shape, strides and dtype; ``None`` if it cannot be told.

    Tensors inside ``torch.vmap`` have no storage to ask, fake and meta tensors all report
    address 0, and a DTensor's storage is its local shard's: none of them is compared.
    """
    if t.numel() == 0 or hasattr(t, "placements"):
        return None
    try:
        address = t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None
    return None if address == 0 else (t.device, address, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def check_params(where: str, params: TensorDictBase) -> None:
    """Every leaf (of a flat TensorDict) must be a floating-point tensor of its own: no buffer of
    integers, no tied alias. ``TensorDict.from_module(model)`` holds buffers too (BatchNorm's int64
    ``num_batches_tracked``), and both names of a tied weight; an optimizer stepping either would
    corrupt the model. Structural only: storage addresses, never values."""
    seen: dict[tuple[Any, ...], str] = {}
    for name, p in params.items():
        if not p.is_floating_point():
            raise TypeError(
                f"{where}: {name!r} is a {p.dtype} tensor; only floating-point parameters can be optimized. "
                "Buffers (such as BatchNorm's num_batches_tracked) are no parameters: "
                "params, buffers = muonfn.split_buffers(model) keeps them apart"
            )
        identity = _storage_identity(p)
        first = name if identity is None else seen.setdefault(identity, name)
        if first != name:
            raise ValueError(
                f"{where}: {first!r} and {name!r} are one tensor (tied weights); updated apart, they would untie. "
                f"Keep one name, params = params.exclude({tuple(name.split('.'))!r}), and run the model with "
                "torch.func.functional_call(model, params.flatten_keys('.').to_dict(), args), which ties "
                f"{name!r} back to it; or untie them in the model"
            )
