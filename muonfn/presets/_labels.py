"""Which leaves are matrices for Muon and which go to AdamW.

Muon is for hidden-layer matrices. :func:`label_params` decides by shape and name,
:func:`labels_from_module` by module type and name; both keep on AdamW:

- a leaf whose dotted name contains a fragment of :data:`DEFAULT_EXCLUDE` (embeddings,
  output heads, classifiers, token parameters, relative-position tables, LoRA), the name
  read with a dot in front so that a fragment ``".x."`` is a whole component, the first too;
- by shape (:func:`label_params`): a leaf with fewer than two dimensions of size other
  than 1 (besides an ensemble's batch dimensions): a ``(1, 1, D)`` class token is a vector;
- by module (:func:`labels_from_module`): anything but Linear/Conv weights and attention
  projections, and the model's last ``nn.Linear``, its output head whatever its name (``fc``
  of a ResNet).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from .. import _tree
from .._keys import resolve_table
from ..linalg import MatrixView

MUON = "muon"
ADAMW = "adamw"

#: Name fragments (matched case-insensitively anywhere in the dotted name, read with a dot
#: in front: ``".x."`` is a whole component, the first one too) of leaves that are not
#: hidden-layer matrices: token and position embeddings, output heads and classifiers, LoRA
#: adapters, class/mask/distillation tokens and relative-position tables.
#: ``"head."`` ends with the dot so that ``multihead_attn`` (``nn.TransformerDecoderLayer``)
#: stays a hidden layer; names such as GPT-2's ``c_fc``/``c_attn``/``c_proj`` or a ViT's
#: ``fc1``/``fc2`` contain none of them. ``".shared.weight"`` is the token embedding (and tied
#: output head) of Hugging Face's encoder–decoders (T5, BART, mBART, Pegasus, Marian, LongT5:
#: ``shared.weight``, ``model.shared.weight``); a whole component, so that MoE
#: ``shared_experts``/``shared_expert`` (hidden matrices) stay on Muon.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "embed",
    ".shared.weight",
    "wte",
    "wpe",
    "lm_head",
    "lora_",
    "head.",
    "classifier",
    "cls_token",
    "mask_token",
    "dist_token",
    "relative_position",
    "relative_attention_bias",
)


def _excluded(name: str, exclude: Sequence[str]) -> bool:
    lowered = "." + name.lower()  # a fragment ".x." then matches a whole first component too
    return any(fragment.lower() in lowered for fragment in exclude)


def _is_matrix_shape(shape: Sequence[int]) -> bool:
    """At least two dimensions of size other than 1: unit dimensions do not make a vector a matrix."""
    return sum(1 for size in shape if size != 1) >= 2


def label_params(
    params: TensorDictBase, exclude: Sequence[str] = DEFAULT_EXCLUDE, *, shards: Iterable[Any] = ()
) -> dict[str, str]:
    """Labels by shape and name: ``"muon"`` for matrices, ``"adamw"`` for everything else.

    A leaf is a matrix when its shape has at least two dimensions of size other than 1
    (so a ``(1, 1, D)`` ``cls_token`` is not) and its dotted name contains none of the
    ``exclude`` fragments (default :data:`DEFAULT_EXCLUDE`: embeddings, T5's and BART's
    ``shared`` token embedding, ``lm_head``,
    ``head.``, ``classifier``, token parameters, relative-position tables, LoRA). For a
    stacked ensemble (``TensorDict.from_modules``, batch size ``[N]``) the shape is a
    member's, without the batch dimensions.

    Names cannot tell every output head: a ResNet's is ``fc``, a common hidden-layer name.
    :func:`labels_from_module` also sends the model's last ``nn.Linear`` to AdamW; or add
    a whole component, ``functools.partial(label_params, exclude=(*DEFAULT_EXCLUDE, ".fc."))``
    (``"fc."`` alone would also take GPT-2's hidden ``c_fc``).

    Args:
        params: the parameters.
        exclude: name fragments sent to AdamW, matched case-insensitively in the name read
            with a dot in front (``".fc."`` is the whole component ``fc``, the first one too).
        shards: names of leaves that are one rank's block of a larger tensor (the keys of
            ``shard_specs``): a block of one row says nothing of the whole, so such a leaf
            is a matrix when it has two dimensions or more; :func:`muonfn.muon` passes its
            ``shard_specs`` (a DTensor's shape is the global one already).

    Usable as ``labels=`` directly, or through ``functools.partial`` with other exclusions.
    """
    keys = _tree.leaf_keys(params)
    sharded = resolve_table(dict.fromkeys(shards), keys)
    members = params.batch_dims
    labels = {}
    for key, value in zip(keys, params.values(True, True)):
        name = _tree.dotted(key)
        shape = value.shape[members:]
        matrix_shaped = len(shape) >= 2 if key in sharded else _is_matrix_shape(shape)
        labels[name] = MUON if matrix_shaped and not _excluded(name, exclude) else ADAMW
    return labels


_MATRIX_MODULES = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)


def _output_head(model: nn.Module) -> nn.Module | None:
    """The last ``nn.Linear`` the model registers: its output head (``lm_head``, ``head``, ``fc``, ``classifier``)."""
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    return linears[-1] if linears else None


def labels_from_module(
    model: nn.Module, exclude: Sequence[str] = DEFAULT_EXCLUDE, *, last_linear_is_head: bool = True
) -> dict[str, str]:
    """Labels by module type: weights of Linear and Conv layers (and Hugging Face ``Conv1D``)
    and the query, key and value projections of ``nn.MultiheadAttention`` go to Muon;
    embeddings, norms, biases and token parameters go to AdamW.

    Also AdamW: the model's output head, which is its last ``nn.Linear`` in registration
    order (``lm_head``, timm's ``head``, Hugging Face's ``classifier``, a torchvision
    ResNet's ``fc``), and anything whose dotted name contains a fragment of ``exclude``
    (see :data:`DEFAULT_EXCLUDE`). Hugging Face ``Conv1D`` layers (GPT-2's ``c_attn``,
    ``c_fc``, ``c_proj``) are never taken for the head. The module type decides what is a
    matrix, so shapes are not looked at beyond ``ndim >= 2`` (a rank's one-row block of a
    hand-sharded layer stays a matrix).

    Args:
        model: the module tree.
        exclude: name fragments sent to AdamW, matched as by :func:`label_params`.
        last_linear_is_head: send the last ``nn.Linear`` to AdamW; pass ``False`` for a
            model without an output head (a trunk whose last layer is a hidden one).

    Returns:
        A label for each name of ``model.named_parameters()``: a tied weight (an output
        head sharing the embedding) is listed once, under its first name, with its first
        owner's label.
    """
    head = _output_head(model) if last_linear_is_head else None
    label_of: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        matrices = _matrix_names(module)
        for param_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            wants_muon = (
                param_name in matrices and module is not head and param.ndim >= 2 and not _excluded(name, exclude)
            )
            label_of.setdefault(id(param), MUON if wants_muon else ADAMW)
    return {name: label_of[id(param)] for name, param in model.named_parameters()}


def views_from_module(model: nn.Module) -> dict[str, MatrixView]:
    """Views a module tree declares by its types: Hugging Face ``Conv1D`` stores ``(in, out)``;
    ``nn.MultiheadAttention``'s fused ``in_proj_weight`` is the query, key and value
    projections stacked by rows, ``(E, E, E)``, each orthogonalized and scaled on its own."""
    views: dict[str, MatrixView] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if type(module).__name__ == "Conv1D":
            views[f"{prefix}weight"] = MatrixView(transposed=True)
        elif isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
            views[f"{prefix}in_proj_weight"] = MatrixView(split=(module.embed_dim,) * 3)
    return views


def _matrix_names(module: nn.Module) -> tuple[str, ...]:
    """The names of a module's own parameters that are hidden-layer matrices, by its type."""
    if isinstance(module, _MATRIX_MODULES) or type(module).__name__ == "Conv1D":
        return ("weight",)
    if isinstance(module, nn.MultiheadAttention):  # (its out_proj is an nn.Linear of its own)
        return ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
    return ()


class RoutingWarning(UserWarning):
    """Muon would train nothing, or parameters were routed without names to go by.

    Warned once where the optimizer is built or initialised, naming the cause and the fix;
    ``warnings.filterwarnings("ignore", category=muonfn.RoutingWarning)`` silences it.
    """


#: Where muonfn's and torch's own frames come from: a routing warning points past them, at the line
#: that built the optimizer (the shim is built inside torch.optim's constructor, a preset's init
#: several calls deep in muonfn).
_INTERNAL_FILES = tuple(
    os.path.dirname(os.path.abspath(module.__file__ or "")) + os.sep
    for module in (sys.modules[__name__.partition(".")[0]], torch)
)


def warn_routing(message: str) -> None:
    """Warns ``message`` as a :class:`RoutingWarning` at the first caller outside muonfn and torch."""
    frame = sys._getframe(1)
    level = 2  # the caller of this function
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL_FILES):
        frame = frame.f_back
        level += 1
    warnings.warn(message, RoutingWarning, stacklevel=level)


def matching_fragments(names: Iterable[str], exclude: Sequence[str] = DEFAULT_EXCLUDE) -> list[str]:
    """The fragments of ``exclude`` that some of ``names`` contain, as :func:`label_params` matches them."""
    return [fragment for fragment in exclude if any(_excluded(name, (fragment,)) for name in names)]


def shown(names: Sequence[str], limit: int = 3) -> str:
    """Up to ``limit`` names, quoted, and how many more."""
    listed = ", ".join(repr(name) for name in names[:limit])
    return listed + (f" and {len(names) - limit} more" if len(names) > limit else "")


def warn_if_every_matrix_excluded(where: str, params: TensorDictBase, *, shards: Iterable[Any] = ()) -> None:
    """A :class:`RoutingWarning` when the default labels send no leaf of ``params`` to Muon although
    some are matrices, each excluded by its name (LoRA adapters given alone): the optimizer is then
    plain AdamW. Nothing for parameters without a matrix: Muon has none to take."""
    shards = tuple(shards)
    if MUON in label_params(params, shards=shards).values():
        return
    matrices = [name for name, label in label_params(params, exclude=(), shards=shards).items() if label == MUON]
    if not matrices:
        return
    fragments = matching_fragments(matrices)
    warn_routing(
        f"{where}: no parameter is labelled 'muon', so this optimizer is plain AdamW: every matrix "
        f"({len(matrices)}: {shown(matrices)}) goes to AdamW by its name (muonfn.DEFAULT_EXCLUDE's "
        f"{shown(fragments, len(fragments))}). To run Muon on them, pass labels= (e.g. "
        f"functools.partial(muonfn.label_params, exclude=[f for f in muonfn.DEFAULT_EXCLUDE if f != "
        f"{fragments[0]!r}])); for plain AdamW, use muonfn.adamw"
    )
