"""Checks that turn bad input into a clear error before anything is computed."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import torch
from tensordict import MemoryMappedTensor, TensorDictBase

from ._keys import Key, dotted, resolve_table

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
    x = _value(name, v)
    if not (math.isfinite(x) and x >= 0):
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
    x = _value(name, v)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")


def flag(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {v!r}")
    return v


def check_table(
    where: str, table: object, *, holds: str, called: str, check: Callable[[Mapping[Any, Any]], object]
) -> None:
    """A per-name table as written: ``None``, a mapping (``check`` runs on it now) or a callable
    ``called`` (checked where it is called); anything else is a ``TypeError`` naming ``where``.
    ``holds`` says what a mapping maps names to."""
    if table is None or (callable(table) and not isinstance(table, Mapping)):
        return
    if not isinstance(table, Mapping):
        raise TypeError(
            f"{where} must be a mapping of names to {holds}, a callable {called}, or None; got {type(table).__name__}"
        )
    check(table)


def known_names(where: str, names: Iterable[Any], keys: Sequence[Key]) -> None:
    """Every user-written name must be a leaf of ``keys``: a typo is an error, never ignored."""
    resolve_table(dict.fromkeys(names), keys, where=where)


def check_batch(where: str, grads: TensorDictBase, state: TensorDictBase | Mapping[str, Any]) -> None:
    """``grads`` must have the batch size of the params ``state`` was made from.

    A stacked ensemble (batch size ``[N]``) and one member's gradients would otherwise
    broadcast against each other, or be read as other shapes. A stateless transform may
    be given a plain ``{}`` for its state: there is no batch size to compare then.
    """
    if isinstance(state, TensorDictBase) and grads.batch_size != state.batch_size:
        raise ValueError(
            f"{where}: gradients have batch size {tuple(grads.batch_size)}, the state "
            f"{tuple(state.batch_size)}; pass gradients shaped like the params given to init"
        )


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
    if address == 0:
        return None
    return (t.device, address, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def check_params(where: str, params: TensorDictBase) -> None:
    """Every leaf must be a floating-point tensor of its own: no buffer of integers, no tied alias.

    ``TensorDict.from_module(model)`` holds buffers too (BatchNorm's int64
    ``num_batches_tracked``), and both names of a tied weight; an optimizer stepping either
    would corrupt the model. Structural only: storage addresses, never values.
    """
    seen: dict[tuple[Any, ...], Key] = {}
    for key, p in zip(params.keys(True, True), params.values(True, True)):
        key = (key,) if isinstance(key, str) else tuple(key)
        name = dotted(key)
        if not p.is_floating_point():
            raise TypeError(
                f"{where}: {name!r} is a {p.dtype} tensor; only floating-point parameters can be optimized. "
                "Buffers (such as BatchNorm's num_batches_tracked) are no parameters: "
                "params, buffers = muonfn.split_buffers(model) keeps them apart"
            )
        identity = _storage_identity(p)
        if identity is None:
            continue
        first = seen.setdefault(identity, key)
        if first != key:
            raise ValueError(
                f"{where}: {dotted(first)!r} and {name!r} are one tensor (tied weights); updated apart, they "
                f"would untie. Keep one name, params = params.exclude({key!r}), and run the model with "
                "torch.func.functional_call(model, params.flatten_keys('.').to_dict(), args), "
                f"which ties {name!r} back to it; or untie them in the model"
            )


def check_leaves(
    where: str, grads: Mapping[Key, torch.Tensor], params: Mapping[Key, torch.Tensor] | None, batch_size: Any
) -> None:
    """Every gradient leaf must be a dense real tensor with its parameter's shape, dtype and device, over
    flat ``{key: tensor}`` dicts (``params`` may be ``None``: then only the gradients' own kind is checked).

    ``grads`` may hold fewer leaves than ``params`` (a leaf without a gradient is skipped), never
    other ones."""
    strided = torch.strided
    for key, g in grads.items():
        if g.layout is not strided:
            raise TypeError(f"{where}: gradient {dotted(key)!r} is {g.layout}; only dense gradients are supported")
        if g.is_complex():
            raise TypeError(
                f"{where}: gradient {dotted(key)!r} is complex ({g.dtype}); only real gradients are supported"
            )
        if params is None:
            continue
        p = params.get(key)
        if p is None:
            raise ValueError(f"{where}: gradient {dotted(key)!r} has no matching parameter or state")
        if g.shape != p.shape:
            raise ValueError(f"{where}: gradient {dotted(key)!r} has shape {tuple(g.shape)}, expected {tuple(p.shape)}")
        if g.dtype != p.dtype:
            raise ValueError(f"{where}: gradient {dotted(key)!r} has dtype {g.dtype}, expected {p.dtype}")
        if g.device != p.device:
            raise ValueError(f"{where}: gradient {dotted(key)!r} is on {g.device}, its parameter on {p.device}")


def check_donatable(where: str, state: Mapping[Key, Any]) -> None:
    """A state donated to an update (written in place) must not be mapped from a file
    (``TensorDict.load_memmap``): the update would write the step into that checkpoint, which
    must stay as it was saved. Over the flat ``{key: leaf}`` state; traceable (type and
    attribute checks only)."""
    for key, leaf in state.items():
        # _filename: the public property raises for a memory-mapped tensor in anonymous shared memory
        filename = leaf._filename if isinstance(leaf, MemoryMappedTensor) else None
        if filename is not None:
            raise ValueError(
                f"{where}: state {dotted(key)!r} is memory-mapped from {filename!r}; a donated update "
                "(donate_state=True) would write the step into that checkpoint. Load the state into memory "
                "first: state = state.to_tensordict()"
            )
