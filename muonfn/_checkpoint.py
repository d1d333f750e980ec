"""Checkpoints: a TensorDict on disk, written atomically, read without running code.

A checkpoint file is what ``torch.save(td.to_dict(), f)`` writes, so ``torch.load(f,
weights_only=True)`` reads it too; ``td.memmap(path)`` / ``TensorDict.load_memmap(path)``
is the other way to store one.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ._tree import dotted

PathLike = str | os.PathLike[str]


def save(tree: TensorDictBase | Mapping[str, Any], path: PathLike) -> None:
    """Writes ``tree`` (a TensorDict, or a mapping of tensors and TensorDicts) to ``path``.

    The file is ``torch.save(tree.to_dict())``'s. It is written to a temporary file in
    the same directory, flushed to disk and renamed over ``path`` in one step, so a
    crash mid-save leaves the previous checkpoint at ``path`` intact. The directory must
    exist (``FileNotFoundError`` naming it otherwise; nothing is written). A tensor on the meta device holds no
    values: it is refused (``ValueError`` naming it; nothing is written).
    """
    td = tree if isinstance(tree, TensorDictBase) else TensorDict(dict(tree), batch_size=[])
    for key, value in td.items(True, True, is_leaf=lambda cls: not issubclass(cls, TensorDictBase)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"save: {dotted(key)!r} is a {type(value).__name__}; a checkpoint holds tensors only")
        if value.is_meta:  # (written, it would replace the last checkpoint with one that holds no values)
            raise ValueError(f"save: {dotted(key)!r} is on the meta device, which holds no values")
    # nested dicts of plain tensors (no subclasses such as memory-mapped tensors or parameters)
    data = td.apply(lambda t: t.detach().as_subclass(torch.Tensor)).to_dict()
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):  # else the error would name the temporary file
        raise FileNotFoundError(f"save: cannot write {path!r}: the directory {directory!r} does not exist")
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    # "x": a new file (a name that is taken is an error, and not removed below); not mkstemp's, so that the
    # checkpoint gets the permissions the umask gives any new file
    f = open(tmp, "xb")  # noqa: SIM115 (closed by the with below)
    try:
        with f:
            torch.save(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if os.name == "posix":  # the rename made durable (elsewhere it is as durable as the platform makes it)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _nested(data: Any, name: str, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """``data`` if it is nested dicts of tensors under string keys, as :func:`save` writes; the file ``name``
    named in the error otherwise."""
    if not isinstance(data, dict):
        where = f" at {dotted(prefix)!r}" if prefix else ""
        raise TypeError(f"load: {name!r} holds a {type(data).__name__}{where}, not a TensorDict checkpoint")
    for key, value in data.items():
        if not isinstance(key, str):
            raise TypeError(f"load: {name!r} has a non-string key {key!r}")
        if not isinstance(value, torch.Tensor):
            _nested(value, name, (*prefix, key))
    return data


def load(
    path: PathLike, like: TensorDictBase | None = None, map_location: str | torch.device | None = None
) -> TensorDict:
    """Reads a checkpoint written by :func:`save` (or ``torch.save(td.to_dict(), f)``).

    Unpickling runs with ``weights_only=True``: a checkpoint can hold tensors and plain
    containers, never code (``pickle.UnpicklingError`` otherwise). A file that is no
    checkpoint (empty, text, truncated) raises a ``ValueError`` naming it. With ``like``,
    the result must have exactly ``like``'s keys, shapes and dtypes (else a ``ValueError``
    names the first key that differs); it comes in ``like``'s key order, on ``like``'s
    devices. ``like`` itself is never modified.
    """
    name = os.fspath(path)
    try:
        raw = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # code or unknown types: refused by weights_only, or no pickle at all
        raise pickle.UnpicklingError(f"load: {name!r} is not a muonfn checkpoint: {e}") from e
    except Exception as e:  # empty, text, truncated or corrupted: the unpickler fails in many ways
        if isinstance(e, OSError) and e.filename is not None:  # missing, unreadable: the error names the path
            raise
        # (torch's archive reader reports some truncated files as a bare OSError, EINVAL)
        empty = isinstance(e, EOFError) and os.path.getsize(path) == 0
        reason = "the file is empty" if empty else f"torch.load cannot read it: {type(e).__name__}: {e}"
        raise ValueError(f"load: {name!r} is not a muonfn checkpoint ({reason})") from e
    loaded = TensorDict(_nested(raw, name), batch_size=[])
    if like is None:
        return loaded
    # the leaves in like's key order, batch size and devices, after checking that they match
    where = f"load({name!r})"
    given = {dotted(k): v for k, v in loaded.items(True, True)}
    out = like.empty(recurse=True)
    for key, ref in like.items(True, True):
        leaf = dotted(key)
        value = given.pop(leaf, None)
        if value is None:
            raise ValueError(f"{where}: missing {leaf!r}")
        if value.shape != ref.shape:
            raise ValueError(f"{where}: {leaf!r} has shape {tuple(value.shape)}, expected {tuple(ref.shape)}")
        if value.dtype != ref.dtype:
            raise ValueError(f"{where}: {leaf!r} has dtype {value.dtype}, expected {ref.dtype}")
        out.set(key, value.to(ref.device))
    if given:
        raise ValueError(f"{where}: unexpected {next(iter(given))!r}")
    return out
