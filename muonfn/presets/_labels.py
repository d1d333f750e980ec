"""Which leaves are matrices for Muon and which go to AdamW."""

from __future__ import annotations

from collections.abc import Sequence

from tensordict import TensorDictBase
from torch import nn

from .. import _tree
from ..linalg import MatrixView

MUON = "muon"
ADAMW = "adamw"

#: Name fragments of leaves that are ≥2-D but are not hidden-layer matrices:
#: token/position embeddings, output heads and LoRA adapters.
DEFAULT_EXCLUDE: tuple[str, ...] = ("embed", "wte", "wpe", "lm_head", "lora_")


def _excluded(name: str, exclude: Sequence[str]) -> bool:
    lowered = name.lower()
    return any(fragment.lower() in lowered for fragment in exclude)


def label_params(params: TensorDictBase, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> dict[str, str]:
    """Labels by shape and name: ``"muon"`` for ≥2-D leaves whose dotted name contains
    none of ``exclude``, ``"adamw"`` for everything else.

    Usable as ``labels=`` directly, or through ``functools.partial`` with other exclusions.
    """
    labels = {}
    for key, value in zip(_tree.leaf_keys(params), params.values(True, True)):
        name = _tree.dotted(key)
        labels[name] = MUON if value.ndim >= 2 and not _excluded(name, exclude) else ADAMW
    return labels


_MATRIX_MODULES = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)


def labels_from_module(model: nn.Module, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> dict[str, str]:
    """Labels by module type: weights of Linear and Conv layers (and Hugging Face ``Conv1D``)
    go to Muon; embeddings, norms, biases and anything whose name matches ``exclude``
    (output heads) go to AdamW. Keys are ``model.named_parameters()`` names.

    A shared parameter (a tied output head) appears once, under the name ``named_parameters()``
    gives it (its first owner), with that owner's label.
    """
    labels: dict[str, str] = {}
    for module_name, module in model.named_modules():
        is_matrix_module = isinstance(module, _MATRIX_MODULES) or type(module).__name__ == "Conv1D"
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            wants_muon = (
                is_matrix_module and param_name == "weight" and param.ndim >= 2 and not _excluded(name, exclude)
            )
            labels[name] = MUON if wants_muon else ADAMW
    return {name: labels[name] for name, _ in model.named_parameters()}


def views_from_module(model: nn.Module) -> dict[str, MatrixView]:
    """Views a module tree declares by its types: Hugging Face ``Conv1D`` stores ``(in, out)``."""
    return {
        f"{module_name}.weight" if module_name else "weight": MatrixView(transposed=True)
        for module_name, module in model.named_modules()
        if type(module).__name__ == "Conv1D"
    }
