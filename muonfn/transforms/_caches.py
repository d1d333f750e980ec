"""Results computed once per structure of the leaves (labels, masks, views) and reused across steps."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from .._tree import Leaves


class StructureCache:
    """Per-structure results (labels, masks, views) computed once and reused across steps.

    Keyed by the leaves' keys and shapes; up to ``size`` structures are kept: a model whose
    parameters alternate between having a gradient and not has more than one, and the shim
    stepping in parts (``chunk_numel``) sees one per part, every step.
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.entries: dict[Hashable, Any] = {}

    def get(self, leaves: Leaves, batch_size: torch.Size, compute: Callable[[], Any]) -> Any:
        if torch.compiler.is_compiling():
            # neither read nor written while traced: a lookup would guard the graph on what the cache
            # holds, and an eager update that fills it afterwards would cost a second compile
            return compute()
        key = (tuple(leaves), tuple([t.shape for t in leaves.values()]), tuple(batch_size))
        hit = self.entries.get(key)
        if hit is None:
            hit = compute()
            if len(self.entries) >= self.size:
                del self.entries[next(iter(self.entries))]
            self.entries[key] = hit
        return hit
