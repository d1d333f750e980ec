"""TensorDicts of parameters shaped like real models: MLPs, GPT-style transformers, small CNNs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypeAlias, get_args

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

Key = tuple[str, ...]

ModelKind: TypeAlias = Literal["mlp", "gpt", "cnn"]
MODEL_KINDS: tuple[ModelKind, ...] = get_args(ModelKind)


def _mlp(draw: st.DrawFn, width: int, depth: int) -> dict[Key, tuple[int, ...]]:
    """``nn.Sequential(Linear, Tanh, Linear, …)``: layers at indices 0, 2, 4, …"""
    sizes = [draw(st.integers(1, width)) for _ in range(depth + 1)]
    bias = draw(st.booleans())
    shapes: dict[Key, tuple[int, ...]] = {}
    for i in range(depth):
        shapes[(str(2 * i), "weight")] = (sizes[i + 1], sizes[i])
        if bias:
            shapes[(str(2 * i), "bias")] = (sizes[i + 1],)
    return shapes


def _gpt(draw: st.DrawFn, width: int, depth: int) -> dict[Key, tuple[int, ...]]:
    """GPT-2 names: token and position embeddings, fused QKV, 4× MLP, layer norms, an untied head."""
    d = draw(st.integers(2, max(2, width)))
    vocab = draw(st.integers(d, 2 * d + 3))
    context = draw(st.integers(1, 2 * d))
    shapes: dict[Key, tuple[int, ...]] = {("wte", "weight"): (vocab, d), ("wpe", "weight"): (context, d)}
    for i in range(depth):
        block = ("h", str(i))
        shapes[(*block, "ln_1", "weight")] = (d,)
        shapes[(*block, "ln_1", "bias")] = (d,)
        shapes[(*block, "attn", "c_attn", "weight")] = (3 * d, d)
        shapes[(*block, "attn", "c_attn", "bias")] = (3 * d,)
        shapes[(*block, "attn", "c_proj", "weight")] = (d, d)
        shapes[(*block, "attn", "c_proj", "bias")] = (d,)
        shapes[(*block, "ln_2", "weight")] = (d,)
        shapes[(*block, "ln_2", "bias")] = (d,)
        shapes[(*block, "mlp", "c_fc", "weight")] = (4 * d, d)
        shapes[(*block, "mlp", "c_fc", "bias")] = (4 * d,)
        shapes[(*block, "mlp", "c_proj", "weight")] = (d, 4 * d)
        shapes[(*block, "mlp", "c_proj", "bias")] = (d,)
    shapes[("ln_f", "weight")] = (d,)
    shapes[("ln_f", "bias")] = (d,)
    shapes[("lm_head", "weight")] = (vocab, d)
    return shapes


def _cnn(draw: st.DrawFn, width: int, depth: int) -> dict[Key, tuple[int, ...]]:
    """Conv kernels ``(out, in, *kernel)`` (1-D or 2-D), batch norms and a linear classifier."""
    spatial = draw(st.integers(1, 2))
    channels = [draw(st.integers(1, 3))] + [draw(st.integers(1, width)) for _ in range(depth)]
    shapes: dict[Key, tuple[int, ...]] = {}
    for i in range(depth):
        kernel = draw(st.sampled_from([1, 3, 5]))
        shapes[(f"conv{i + 1}", "weight")] = (channels[i + 1], channels[i], *(kernel,) * spatial)
        shapes[(f"conv{i + 1}", "bias")] = (channels[i + 1],)
        shapes[(f"bn{i + 1}", "weight")] = (channels[i + 1],)
        shapes[(f"bn{i + 1}", "bias")] = (channels[i + 1],)
    classes = draw(st.integers(2, 10))
    shapes[("fc", "weight")] = (classes, channels[-1])
    shapes[("fc", "bias")] = (classes,)
    return shapes


_BUILDERS = {"mlp": _mlp, "gpt": _gpt, "cnn": _cnn}


def model_params(
    *,
    kinds: Sequence[ModelKind] = MODEL_KINDS,
    max_width: int = 16,
    max_depth: int = 3,
    dtypes: torch.dtype | Sequence[torch.dtype] = torch.float32,
) -> st.SearchStrategy[TensorDict]:
    """A hypothesis strategy for parameter TensorDicts shaped like real models.

    Keys follow ``named_parameters()`` of the usual modules, nested by dots, so name-based
    rules (:func:`muonfn.label_params`: embeddings, heads) and view rules (conv kernels as
    ``(out, in·∏kernel)``) apply as they would to a real model:

    - ``"mlp"``: ``nn.Sequential`` of ``Linear`` layers (``0.weight``, ``0.bias``, ``2.weight``, …),
      with or without biases;
    - ``"gpt"``: GPT-2 names (``wte``, ``wpe``, ``h.<i>.attn.c_attn`` with a fused ``(3d, d)``
      QKV weight, ``h.<i>.mlp.c_fc`` ``(4d, d)``, layer norms, an untied ``lm_head``);
    - ``"cnn"``: 1-D or 2-D conv kernels ``conv<i>.weight`` ``(out, in, *kernel)``, batch norms
      ``bn<i>``, a classifier ``fc``.

    Values are Gaussian with standard deviation ``1/sqrt(fan_in)``, from a drawn seed.

    Args:
        kinds: the model families to draw from.
        max_width: the largest hidden width (GPT: the model width ``d``).
        max_depth: the largest number of layers (blocks).
        dtypes: a dtype or dtypes to draw from; all leaves of an example share it.

    Returns:
        A strategy of TensorDicts with ``batch_size=[]``.

    Example:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=10, derandomize=True)
        ... @given(muonfn.testing.model_params(kinds=["gpt"]))
        ... def test_every_block_has_a_fused_qkv(params):
        ...     assert ("h", "0", "attn", "c_attn", "weight") in params.keys(True, True)
        >>> test_every_block_has_a_fused_qkv()
    """
    chosen = [kinds] if isinstance(kinds, str) else list(kinds)
    if not chosen or any(kind not in MODEL_KINDS for kind in chosen):
        raise ValueError(f"kinds must be a non-empty selection of {list(MODEL_KINDS)}, got {kinds!r}")
    if max_width < 2 or max_depth < 1:
        raise ValueError(f"need max_width >= 2 and max_depth >= 1, got {max_width}, {max_depth}")
    dtype_list = [dtypes] if isinstance(dtypes, torch.dtype) else list(dtypes)
    if not dtype_list or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtype_list):
        raise ValueError(f"dtypes must be real floating-point torch dtypes, got {dtypes!r}")

    @st.composite
    def draw_params(draw: st.DrawFn) -> TensorDict:
        kind = draw(st.sampled_from(chosen))
        shapes = _BUILDERS[kind](draw, max_width, draw(st.integers(1, max_depth)))
        dtype = draw(st.sampled_from(dtype_list))
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        values = []
        for shape in shapes.values():
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            values.append((torch.randn(shape, generator=generator, dtype=torch.float64) / fan_in**0.5).to(dtype))
        return TensorDict(dict(zip(shapes, values)), batch_size=[])

    return draw_params()
