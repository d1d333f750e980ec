"""From parameter tensors to batched Newton–Schulz calls and back.

An :class:`Orthogonalizer` replaces each tensor by ``s(A, B)·NS(M)`` for every matrix
block ``M`` its :class:`MatrixView` declares. The local one stacks same-shape blocks into
one batched call; the sharded ones of :mod:`muonfn.distributed` first assemble whole
matrices across ranks. :func:`muonfn.orthogonalize` takes either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .._keys import Key, dotted
from ._newton_schulz import Decay, NewtonSchulz, add_decay, apart, in_memory_order, may_write_into
from ._views import MatrixView, ScaleFn, block_scales

MatrixFn = Callable[[torch.Tensor], torch.Tensor]

DEFAULT_BUCKET_NUMEL = 1 << 26


class Orthogonalizer(Protocol):
    """Leaves in, leaves out: ``scale(A, B)·ns(M)`` for every matrix block ``M`` of every tensor.

    ``keys`` name the tensors (for errors, and for settings given by name), ``views`` say
    how each is read as matrices, ``ns`` maps a ``(count, m, n)`` batch of matrices.
    Returns one tensor per input, of its type, shape and dtype, each a tensor of this call's
    own (never an input, nor a view of one): the steps after it may write into it. An
    orthogonalizer may also have ``check(keys, tensors, views)``, which raises for leaves it
    would refuse, from their metadata alone: :func:`~muonfn.orthogonalize` calls it with the
    other checks of a step, before any transform of a composition writes its state. One whose
    ``adds_decay`` is ``True`` also takes ``decay=`` (a :class:`Decay` aligned with
    ``tensors``) and adds it to its results; :func:`~muonfn.transforms.descent` then hands it
    the decay of a plain fp32 step with muonfn's Triton kernels on. One whose
    ``overwrites_input`` is ``True`` also takes ``overwrite_input=``: ``True`` says the tensors
    are temporaries of the step that nothing reads after (:func:`~muonfn.orthogonalize` with
    ``overwrite_input=True`` says so), and it may then return results written into their
    memory, a result being its input itself.
    """

    def __call__(
        self,
        keys: Sequence[Key],
        tensors: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        ns: MatrixFn,
        scale: ScaleFn,
    ) -> list[torch.Tensor]: ...


def check_bucket_numel(bucket_numel: int) -> int:
    """``bucket_numel`` if it is an integer >= 1; else a ValueError naming it."""
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be an integer >= 1, got {bucket_numel!r}")
    return bucket_numel


def _chunks(members: list[int], sizes: list[int], cap: int) -> list[list[int]]:
    """Splits ``members`` into runs whose sizes add up to at most ``cap`` (at least one each)."""
    chunks: list[list[int]] = [[]]
    total = 0
    for i in members:
        if chunks[-1] and total + sizes[i] > cap:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += sizes[i]
    return chunks


def _batched(
    matrices: list[torch.Tensor],
    scales: list[float],
    ns: MatrixFn,
    cap: int,
    decay: Decay | None = None,
    overwrite_input: bool = False,
) -> list[torch.Tensor]:
    """``scale * ns(m)`` for every matrix, equal shapes stacked into calls of at most ``cap`` elements.

    A matrix is a ``(count, rows, cols)`` batch, or a contiguous 2-D matrix, which is stacked
    as it is and comes back 2-D and contiguous (no reshaping per matrix). Newton–Schulz
    orients every matrix by its shape alone, so that ``ns(Xᵀ) = ns(X)ᵀ`` bit for bit: under
    it a tall matrix joins the calls of its transposed shape (an MLP's up and down
    projections make one call, not two).
    """
    turns = isinstance(ns, NewtonSchulz)
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(matrices):
        rows, cols = m.shape[-2:]
        shape = (cols, rows) if turns and rows > cols else (rows, cols)
        buckets.setdefault((shape, m.dtype, m.device, scales[i]), []).append(i)
    sizes = [m.numel() for m in matrices]
    out: list[torch.Tensor] = list(matrices)
    for (_, _, _, scale), members in buckets.items():
        for chunk in _chunks(members, sizes, cap):
            given = None if decay is None else Decay([decay.params[j] for j in chunk], decay.alpha)
            for j, result in zip(chunk, _call([matrices[j] for j in chunk], ns, scale, given, overwrite_input)):
                out[j] = result
    return out


def _call(
    matrices: list[torch.Tensor],
    ns: MatrixFn,
    scale: float,
    decay: Decay | None = None,
    overwrite_input: bool = False,
) -> list[torch.Tensor]:
    """``scale * ns`` of matrices of one (wide) shape in one call: the 2-D ones stacked as they
    are, wide then tall, and handed back as contiguous slices; the batches after them. ``decay``
    (2-D matrices only) is added to the results whose parameter it gives. ``overwrite_input``:
    the matrices are temporaries of the caller's, into whose memory Newton–Schulz may write the
    results of a call of 2-D matrices (see :meth:`NewtonSchulz.orthogonalize_matrices`)."""
    turns = isinstance(ns, NewtonSchulz)
    flips = [turns and m.size(-2) > m.size(-1) for m in matrices]
    flat = [m.ndim == 2 for m in matrices]
    plain_wide = [k for k in range(len(matrices)) if flat[k] and not flips[k]]
    plain_tall = [k for k in range(len(matrices)) if flat[k] and flips[k]]
    batches = [k for k in range(len(matrices)) if not flat[k]]
    pieces = [apart(matrices[k].mT if flips[k] else matrices[k]) for k in (*plain_wide, *plain_tall, *batches)]
    if isinstance(ns, NewtonSchulz) and not batches:
        # the batch built by Newton–Schulz; the tall ones come back in their own orientation and memory order
        order = (*plain_wide, *plain_tall)
        given = None
        if decay is not None:
            params = [decay.params[k] for k in order]
            given = Decay([None if p is None else p.mT if flips[k] else p for k, p in zip(order, params)], decay.alpha)
        results = ns.orthogonalize_matrices(
            pieces, len(plain_tall), scale=scale, decay=given, overwrite_input=overwrite_input
        )
        out: list[torch.Tensor] = [None] * len(matrices)  # type: ignore[list-item]
        for k, result in zip(order, results):
            out[k] = result
        return out
    own = len(pieces) > 1 or not batches  # a stack built here: the call may normalise it in place
    if not batches:
        stack = torch.stack(pieces)
    elif len(pieces) == 1:
        stack = pieces[0]
    else:
        stack = torch.cat([p.unsqueeze(0) if p.ndim == 2 else p for p in pieces])
    if isinstance(ns, NewtonSchulz):
        result = ns.orthogonalize(stack, overwrite_input=own, scale=scale)
    else:
        result = checked_map_result(ns, stack, ns(stack))
        if not own and _may_share_memory(result, stack):  # a map of one's own may hand its input back
            result = result.clone()
        if scale != 1.0:
            result = result.mul_(scale)
    if plain_wide or plain_tall:
        result = result.contiguous()  # a function of one's own may return another layout
    counts = [len(plain_wide), len(plain_tall), *(matrices[k].shape[0] for k in batches)]
    wide, tall, *rest = result.split(counts)
    out = [None] * len(matrices)  # type: ignore[list-item]
    for k, piece in zip(plain_wide, wide.unbind(0)):
        out[k] = piece
    for k, piece in zip(plain_tall, in_memory_order(tall.mT).unbind(0) if plain_tall else ()):
        out[k] = piece
    for k, piece in zip(batches, rest):
        out[k] = piece.mT if flips[k] else piece
    if decay is not None:
        add_decay(out, decay)
    return out


def _map_name(ns: MatrixFn) -> str:
    name = getattr(ns, "__qualname__", None)
    return name if isinstance(name, str) else repr(ns)


def _result_problem(batch: torch.Tensor, result: object, *, device: bool) -> str | None:
    """What is wrong with ``result`` as the image of ``batch`` (``None``: nothing); metadata only."""
    if not isinstance(result, torch.Tensor):
        return f"returned {type(result).__name__}"
    if result.shape != batch.shape or result.dtype != batch.dtype or (device and result.device != batch.device):
        where = f" on {result.device}" if device else ""
        return f"returned a {result.dtype} tensor of shape {tuple(result.shape)}{where}"
    return None


def checked_map_result(ns: MatrixFn, batch: torch.Tensor, result: object) -> torch.Tensor:
    """``result``, what ``ns(batch)`` returned, if it is a tensor of ``batch``'s shape, dtype and
    device; else an error naming ``ns`` and what it returned. Metadata only: nothing is read
    from the device, so the check costs no sync and traces."""
    problem = _result_problem(batch, result, device=True)
    if problem is None and isinstance(result, torch.Tensor):
        return result
    raise TypeError(
        f"ns_method={_map_name(ns)} {problem} for a {batch.dtype} batch of shape {tuple(batch.shape)} "
        f"on {batch.device}; it must return a tensor of its input's shape, dtype and device"
    )


def check_matrix_fn(ns: MatrixFn, shape: Sequence[int], dtype: torch.dtype) -> None:
    """Runs ``ns`` on a meta tensor of ``shape`` and ``dtype`` (no data, no arithmetic): a map that
    returns no tensor, or one of another shape or dtype, fails here, naming itself, before a
    step changes any state. A map that cannot run on meta tensors is checked at its calls."""
    batch = torch.empty(shape, dtype=dtype, device="meta")
    try:
        result = ns(batch)
    except Exception:  # (numpy, .item(), tensors of its own on a device: checked when called)
        return
    problem = _result_problem(batch, result, device=False)
    if problem is not None:
        raise TypeError(
            f"ns_method={_map_name(ns)} {problem} for a {dtype} batch of shape {tuple(shape)}; "
            "it must return a tensor of its input's shape and dtype"
        )


def _may_share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if type(a) is type(b) is torch.Tensor and may_write_into(a):
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return True  # traced, or a tensor subclass: no storage to compare


def orthogonalize_blocks(
    tensors: Sequence[torch.Tensor],
    views: Sequence[MatrixView],
    ns: MatrixFn,
    scale: ScaleFn,
    *,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    shapes: Sequence[Sequence[int]] | None = None,
    decay: Decay | None = None,
    overwrite_input: bool = False,
) -> list[torch.Tensor]:
    """``scale(A, B)·ns(M)`` for every block ``M`` of every tensor as its view reads it.

    Same-shape blocks are stacked into one ``ns`` call of at most ``bucket_numel``
    elements. ``shapes``: the shapes the scale is read from, when they differ from the
    tensors' (an expert shard of a larger tensor). A tensor without elements maps to an
    empty tensor; a contiguous tensor to a contiguous one. ``decay`` (parameters aligned with
    ``tensors``): ``alpha·p`` added to the results that have one, for a plain matrix as its
    result is stored (a step of plain tensors, no autograd: the results are written in place).
    ``overwrite_input``: the tensors are temporaries of the caller's that nothing reads after
    (a step of plain tensors, no autograd), and Newton–Schulz may write the results into their
    memory rather than a new batch: a result may then be its own tensor.
    """
    plain = _plain_matrices(tensors, views, shapes)
    shapes = [t.shape for t in tensors] if shapes is None else shapes
    params = [None] * len(tensors) if decay is None else list(decay.params)
    matrices: list[torch.Tensor] = []
    scales: list[float] = []
    matrix_params: list[torch.Tensor | None] = []
    for t, view, shape, whole, p in zip(tensors, views, shapes, plain, params):
        if whole:
            matrices.append(t)
            scales.append(scale(*t.shape))
            matrix_params.append(p)
        elif t.numel():
            blocks = view.to_matrices(t)
            matrices += blocks
            scales += block_scales(view, shape, scale)
            matrix_params += [None] * len(blocks)
    given = None if decay is None else Decay(matrix_params, decay.alpha)
    done = _batched(matrices, scales, ns, bucket_numel, given, overwrite_input)
    out, pos = [], 0
    for t, view, whole in zip(tensors, views, plain):
        if whole:
            out.append(done[pos])
            pos += 1
        elif t.numel():
            n = len(view.blocks(t.shape))
            result = view.from_matrices(done[pos : pos + n], t.shape)
            out.append(in_memory_order(result) if t.is_contiguous() else result)
            pos += n
        else:
            out.append(torch.empty_like(t))
    if decay is not None:  # the tensors of views, reassembled
        add_decay(out, Decay([None if whole else p for whole, p in zip(plain, params)], decay.alpha))
    return out


def _plain_matrices(
    tensors: Sequence[torch.Tensor], views: Sequence[MatrixView], shapes: Sequence[Sequence[int]] | None
) -> list[bool]:
    """Which tensors are one contiguous 2-D matrix as they are (their view reads them whole and
    their scale is read from their own shape): those go into their calls as they are."""
    plain = [
        t.ndim == 2
        and t.numel() > 0
        and t.is_contiguous()
        and not hasattr(t, "placements")
        and v.batch_dims == 0
        and v.split is None
        and not v.transposed
        for t, v in zip(tensors, views)
    ]
    if shapes is None:
        return plain
    return [whole and tuple(shape) == tuple(t.shape) for whole, t, shape in zip(plain, tensors, shapes)]


class LocalOrthogonalizer:
    """The :class:`Orthogonalizer` of whole matrices in one process: :func:`orthogonalize_blocks`.

    Rejects a tensor its view cannot read, and a DTensor sharded across ranks (whose local
    shard is no whole matrix).
    """

    #: takes ``decay=`` (see :func:`orthogonalize_blocks`), which :func:`muonfn.transforms.descent` gives it
    adds_decay = True
    #: takes ``overwrite_input=`` (see :func:`orthogonalize_blocks`), which :func:`muonfn.orthogonalize` gives it
    overwrites_input = True

    def __init__(self, *, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> None:
        self.bucket_numel = check_bucket_numel(bucket_numel)

    def __call__(
        self,
        keys: Sequence[Key],
        tensors: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        ns: MatrixFn,
        scale: ScaleFn,
        *,
        decay: Decay | None = None,
        overwrite_input: bool = False,
    ) -> list[torch.Tensor]:
        self.check(keys, tensors, views)
        return orthogonalize_blocks(
            tensors, views, ns, scale, bucket_numel=self.bucket_numel, decay=decay, overwrite_input=overwrite_input
        )

    @staticmethod
    def check(keys: Sequence[Key], tensors: Sequence[torch.Tensor], views: Sequence[MatrixView]) -> None:
        """Each tensor fits its view and is whole (not a sharded DTensor), or a ``ValueError`` names it."""
        for key, t, view in zip(keys, tensors, views):
            view.check(key, t.shape)
            placements = tuple(getattr(t, "placements", ()))
            if any(not p.is_replicate() for p in placements):
                raise ValueError(
                    f"{dotted(key)!r} is a DTensor sharded as {placements}: Newton–Schulz needs whole "
                    "matrices; pass collectives=muonfn.distributed.torch_collectives(mesh)"
                )

    def __repr__(self) -> str:
        return f"LocalOrthogonalizer(bucket_numel={self.bucket_numel})"
