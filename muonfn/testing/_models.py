"""TensorDicts of parameters shaped like real models: MLPs, GPT-style transformers, small CNNs."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Literal, TypeAlias, get_args

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

from ._spectra import float_dtypes, selection

#: A module: its dotted name, its weight's shape and whether it has a bias.
Layer = tuple[str, tuple[int, ...], bool]

ModelKind: TypeAlias = Literal["mlp", "gpt", "cnn"]
MODEL_KINDS: tuple[ModelKind, ...] = get_args(ModelKind)


def _mlp(draw: st.DrawFn, width: int, depth: int) -> Iterator[Layer]:
    """``nn.Sequential(Linear, Tanh, Linear, …)``: layers at indices 0, 2, 4, …"""
    sizes = [draw(st.integers(1, width)) for _ in range(depth + 1)]
    bias = draw(st.booleans())
    for i in range(depth):
        yield str(2 * i), (sizes[i + 1], sizes[i]), bias


def _gpt(draw: st.DrawFn, width: int, depth: int) -> Iterator[Layer]:
    """GPT-2 names: token and position embeddings, fused QKV, 4× MLP, layer norms, an untied head."""
    d = draw(st.integers(2, max(2, width)))
    vocab = draw(st.integers(d, 2 * d + 3))
    context = draw(st.integers(1, 2 * d))
    yield "wte", (vocab, d), False
    yield "wpe", (context, d), False
    block = {"ln_1": (d,), "attn.c_attn": (3 * d, d), "attn.c_proj": (d, d)}
    block |= {"ln_2": (d,), "mlp.c_fc": (4 * d, d), "mlp.c_proj": (d, 4 * d)}
    for i in range(depth):
        for name, weight in block.items():
            yield f"h.{i}.{name}", weight, True
    yield "ln_f", (d,), True
    yield "lm_head", (vocab, d), False


def _cnn(draw: st.DrawFn, width: int, depth: int) -> Iterator[Layer]:
    """Conv kernels ``(out, in, *kernel)`` (1-D or 2-D), batch norms and a linear classifier."""
    spatial = draw(st.integers(1, 2))
    channels = [draw(st.integers(1, 3))] + [draw(st.integers(1, width)) for _ in range(depth)]
    for i in range(depth):
        kernel = draw(st.sampled_from([1, 3, 5]))
        yield f"conv{i + 1}", (channels[i + 1], channels[i], *(kernel,) * spatial), True
        yield f"bn{i + 1}", (channels[i + 1],), True
    yield "fc", (draw(st.integers(2, 10)), channels[-1]), True


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
    chosen = selection("kinds", kinds, MODEL_KINDS)
    if max_width < 2 or max_depth < 1:
        raise ValueError(f"need max_width >= 2 and max_depth >= 1, got {max_width}, {max_depth}")
    dtype_list = float_dtypes(dtypes)

    @st.composite
    def draw_params(draw: st.DrawFn) -> TensorDict:
        kind = draw(st.sampled_from(chosen))
        shapes: dict[tuple[str, ...], tuple[int, ...]] = {}
        for name, weight, bias in _BUILDERS[kind](draw, max_width, draw(st.integers(1, max_depth))):
            shapes[(*name.split("."), "weight")] = weight
            if bias:  # one entry per output: linear, conv and norm layers alike
                shapes[(*name.split("."), "bias")] = weight[:1]
        dtype = draw(st.sampled_from(dtype_list))
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        gaussians = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes.values())
        values = [(x / math.prod(x.shape[1:]) ** 0.5).to(dtype) for x in gaussians]  # std 1/sqrt(fan_in)
        return TensorDict(dict(zip(shapes, values)), batch_size=[])

    return draw_params()
