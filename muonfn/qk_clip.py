"""QK-clip (MuonClip, Kimi K2): after the step, shrink the query and key weights of every head
whose largest attention logit went past a threshold."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Literal, overload

import torch
from tensordict import TensorDictBase

from ._tree import dotted, flat, nested_like
from .linalg import DEFAULT_VIEW, MatrixView

Key = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class QKHeads:
    """Where one attention's query and key weights are, and how their rows form heads.

    Either ``fused`` names one tensor holding the query, key and value projections, read
    through ``view`` (``MatrixView(split=(q_rows, k_rows, v_rows))``, ``transposed=True``
    for a Hugging Face ``Conv1D``): its first block is the query, its second the key. Or
    ``query`` and ``key`` name separate tensors, each read through ``view``; either may be
    left out (MLA's rotary query alone, with ``alpha=1.0``). The logical rows (the output
    features) of the query are ``heads`` contiguous blocks, those of the key ``kv_heads``.

    Args:
        heads: query heads; the max logits of this attention have one entry per query head.
        query, key, fused: leaf names (dotted strings or key tuples).
        view: how the tensors are read as matrices (no batch dimensions).
        kv_heads: key heads (grouped-query attention); default ``heads``. A key head shared
            by several query heads takes the smallest factor among them, so that every
            head's logit is brought down to the threshold or below.
        alpha: the query's share of the factor (see :func:`qk_clip`); ``None``: the call's.
    """

    heads: int
    query: str | Key | None = None
    key: str | Key | None = None
    fused: str | Key | None = None
    view: MatrixView = DEFAULT_VIEW
    kv_heads: int | None = None
    alpha: float | None = None

    def leaves(self) -> list[tuple[str, str]]:
        """``(dotted name, "query" | "key" | "fused")`` for every tensor this attention names."""
        named = [(self.fused, "fused"), (self.query, "query"), (self.key, "key")]
        return [(dotted(name), role) for name, role in named if name]


def _checked(name: str, layout: QKHeads, params: TensorDictBase, logits: object) -> tuple[int, MatrixView]:
    """The key heads of a valid ``layout`` and its view of ``params``'s leaves (a stacked ensemble's
    batch dimensions are the members'); refuses a layout or max logits that do not fit the leaves."""
    where = f"qk_clip: attention {name!r}"
    if not isinstance(layout, QKHeads):
        raise TypeError(f"{where}: expected a muonfn.QKHeads, got {type(layout).__name__}")
    kv = layout.heads if layout.kv_heads is None else layout.kv_heads
    if isinstance(layout.heads, bool) or not isinstance(layout.heads, int) or layout.heads < 1:
        raise ValueError(f"{where}: heads must be an integer >= 1, got {layout.heads!r}")
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or layout.heads % kv:
        raise ValueError(f"{where}: kv_heads must be an integer >= 1 dividing heads={layout.heads}, got {kv!r}")
    if layout.alpha is not None:
        _check_alpha(where, layout.alpha)
    if layout.fused and (layout.query or layout.key):
        raise ValueError(f"{where}: name the fused tensor or the query and key tensors, not both")
    if not layout.leaves():
        raise ValueError(f"{where}: names no tensor; set fused=, or query= and/or key=")
    split = layout.view.split
    if layout.view.batch_dims:
        raise ValueError(f"{where}: the view has batch_dims={layout.view.batch_dims}; attention weights have none")
    if layout.fused and (split is None or len(split) < 2 or layout.view.split_dim != 0):
        raise ValueError(f"{where}: a fused tensor needs view=MatrixView(split=(q, k, ...)) of rows (split_dim=0)")
    if not layout.fused and split is not None:
        raise ValueError(f"{where}: a split view describes a fused tensor; pass it as fused=")
    view = dataclasses.replace(layout.view, batch_dims=params.batch_dims) if params.batch_dims else layout.view
    for key, role in layout.leaves():
        if key not in params.keys():
            raise ValueError(f"{where}: no parameter named {key!r}")
        view.check(key, params[key].shape)
        counts = {"query": [layout.heads], "key": [kv], "fused": [layout.heads, kv]}[role]
        for (rows, _), heads in zip(view.blocks(params[key].shape), counts):
            if rows % heads:
                raise ValueError(f"{where}: {key!r} has {rows} {role} rows, which {heads} heads do not divide")
    expected = (*params.batch_size, layout.heads)
    shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
    if shape != expected:
        raise ValueError(f"qk_clip: max_logits[{name!r}] must have shape {expected}, got {shape}")
    return kv, view


def _check_alpha(where: str, alpha: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{where}: alpha must be a number in [0, 1], got {alpha!r}")


def _scaled_rows(m: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``m`` (``(count, rows, cols)``) with each of the ``h`` contiguous row blocks of each matrix
    multiplied by its factor (``factors``: ``(count, h)``, one row per ensemble member)."""
    per_row = factors.repeat_interleave(m.shape[1] // factors.shape[-1], dim=-1).to(m.dtype)
    return m.mul(per_row.unsqueeze(-1))


@overload
def qk_clip(
    params: TensorDictBase,
    max_logits: Mapping[str, torch.Tensor],
    layouts: Mapping[str, QKHeads | Sequence[QKHeads]],
    *,
    threshold: float = ...,
    alpha: float = ...,
    return_skipped: Literal[False] = ...,
) -> TensorDictBase: ...


@overload
def qk_clip(
    params: TensorDictBase,
    max_logits: Mapping[str, torch.Tensor],
    layouts: Mapping[str, QKHeads | Sequence[QKHeads]],
    *,
    threshold: float = ...,
    alpha: float = ...,
    return_skipped: Literal[True],
) -> tuple[TensorDictBase, dict[str, torch.Tensor]]: ...


def qk_clip(
    params: TensorDictBase,
    max_logits: Mapping[str, torch.Tensor],
    layouts: Mapping[str, QKHeads | Sequence[QKHeads]],
    *,
    threshold: float = 100.0,
    alpha: float = 0.5,
    return_skipped: bool = False,
) -> TensorDictBase | tuple[TensorDictBase, dict[str, torch.Tensor]]:
    r"""QK-clip of MuonClip (Kimi K2, 2025): ``params`` with the query and key weights of each
    head whose largest attention logit :math:`S_h` exceeded :math:`\tau` scaled down.

    .. math::  \gamma_h = \min\!\left(1, \frac{\tau}{S_h}\right), \qquad
               W_q^h \leftarrow \gamma_h^{\alpha}\, W_q^h, \qquad W_k^h \leftarrow \gamma_h^{1-\alpha}\, W_k^h

    so that head :math:`h`'s logits :math:`q^\top k` shrink by :math:`\gamma_h` (a head at or
    below :math:`\tau` is left as it is). A function applied after the step, not a
    :class:`Transform`: it needs the logits the forward pass measured, which no gradient
    carries. The model reports :math:`S_h` (reduced over micro-batches and ranks before the
    call); the rows of head :math:`h` are the :math:`h`-th of ``heads`` contiguous blocks of
    the logical output rows (see :class:`QKHeads`). Biases are not scaled: a biased
    projection's logits do not shrink by exactly :math:`\gamma_h`. For MLA, clip the content
    query and key (``alpha=0.5``) and the rotary query alone (``QKHeads(query=..., alpha=1.0)``)
    and leave the shared rotary key out, as the report does.

    A head whose max logit is NaN or :math:`+\infty` (an overflow, or a NaN in the forward pass) is
    skipped: :math:`\gamma_h = 1`, so its query rows are left as they are and it does not shrink a
    key head it shares (the formula would turn them into NaN, or zero them). ``return_skipped=True``
    reports these heads. A max logit of :math:`-\infty` (a head that attended to nothing) is below
    :math:`\tau`: nothing to clip, nothing to report.

    Traceable: no value is read back from the logits (``torch.compile`` and CUDA graphs), so a
    skipped head is reported as a mask, not raised. Sharded (DTensor) parameters are not supported.

    Args:
        params: the parameters after the step.
        max_logits: attention name -> ``(heads,)`` tensor of the largest pre-softmax logit
            of each query head; for a stacked ensemble (params of batch size ``[N]``),
            ``(N, heads)``, each member's own. Attentions not given are left unchanged.
        layouts: attention name -> its :class:`QKHeads` (or several, e.g. MLA's content
            and rotary parts). Leaves are named by key tuples or dotted names
            (``"layers.0.q_proj.weight"`` on ``TensorDict.from_module(model)``).
        threshold: :math:`\tau > 0` (the K2 report's 100).
        alpha: :math:`\alpha \in [0, 1]`, the query's share.
        return_skipped: also return, for each attention of ``max_logits``, a bool tensor of the
            logits' shape: ``True`` for a head skipped for a NaN or :math:`+\infty` max logit.

    Returns:
        ``params`` with the clipped leaves replaced by new tensors (the others are the same
        tensors); nothing is modified in place. With ``return_skipped``, ``(params, skipped)``.

    Example:
        >>> params = TensorDict({"q": torch.ones(4, 3), "k": torch.ones(4, 3)}, [])
        >>> heads = {"attn0": muonfn.QKHeads(heads=2, query="q", key="k")}
        >>> clipped = muonfn.qk_clip(params, {"attn0": torch.tensor([50.0, 400.0])}, heads)
        >>> clipped["q"][:, 0]  # head 1 went 4x past the threshold: its rows shrink by 4**0.5
        tensor([1.0000, 1.0000, 0.5000, 0.5000])
        >>> clipped, skipped = muonfn.qk_clip(
        ...     params, {"attn0": torch.tensor([400.0, float("nan")])}, heads, return_skipped=True
        ... )
        >>> clipped["q"][:, 0], skipped  # head 1 left as it was, and reported
        (tensor([0.5000, 0.5000, 1.0000, 1.0000]), {'attn0': tensor([False,  True])})
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold < math.inf:
        raise ValueError(f"qk_clip: threshold must be a finite number > 0, got {threshold!r}")
    _check_alpha("qk_clip", alpha)
    given, params = params, flat(params)
    groups = {name: [v] if isinstance(v, QKHeads) else list(v) for name, v in layouts.items()}
    replaced: dict[str, torch.Tensor] = {}
    skipped: dict[str, torch.Tensor] = {}
    members = math.prod(params.batch_size)  # one matrix per member of a stacked ensemble
    for name, logits in max_logits.items():
        if name not in groups:
            raise ValueError(f"qk_clip: max_logits names {name!r}, which layouts do not describe: {sorted(groups)}")
        for layout in groups[name]:
            kv, view = _checked(name, layout, params, logits)
            a = alpha if layout.alpha is None else layout.alpha
            for key, role in layout.leaves():
                p = replaced.get(key, params[key])
                dtype = torch.promote_types(torch.promote_types(logits.dtype, p.dtype), torch.float32)
                s = logits.detach().to(device=p.device, dtype=dtype).reshape(members, layout.heads)
                # only a finite logit past the threshold clips: NaN and +inf would make NaN or zero weights
                clipped = s.gt(threshold) & s.isfinite()
                gamma = torch.where(clipped, s.clamp_min(threshold).reciprocal().mul(threshold), 1.0)
                q_factor = gamma.pow(a)
                k_factor = gamma.reshape(members, kv, -1).amin(dim=-1).pow(1.0 - a)
                factors = {"query": [q_factor], "key": [k_factor], "fused": [q_factor, k_factor]}[role]
                blocks = view.to_matrices(p)  # (a fused tensor's value rows, its third block on, are kept)
                blocks = [*map(_scaled_rows, blocks, factors), *blocks[len(factors) :]]
                replaced[key] = view.from_matrices(blocks, p.shape)
        skipped[name] = logits.isnan() | logits.isposinf()  # (bool: no gradient to detach)
    clipped = params.clone(recurse=False).update(replaced) if replaced else given
    out = nested_like(clipped, given) if replaced and params is not given else clipped
    return (out, skipped) if return_skipped else out
