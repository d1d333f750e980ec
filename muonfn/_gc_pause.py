"""Python's cyclic garbage collector, paused while an update builds its result.

A functional update builds a new state (a tensor per leaf and a TensorDict per node: about
3,000 tracked objects for a 24-layer GPT) while the caller still holds the old one. A
collection triggered halfway finds them all alive and promotes them; the promotions add up
to a collection of the oldest generation, which walks every object in the process (about
140 ms once torch is imported) every 30 steps or so. The update creates no reference
cycles, and once the caller drops the old state the allocation count is back where it
started: paused, the update triggers no collection of its own.
"""

from __future__ import annotations

import gc

import torch


def pause_collections() -> bool:
    """Pauses automatic collections if they are enabled (a caller that disabled them keeps
    them so) and says whether it did; the caller resumes them with :func:`resume_collections`
    in a ``finally``. Nothing is paused while ``torch.compile`` traces. Allocates nothing:
    an allocation here could itself trigger the collection it means to avoid."""
    if torch.compiler.is_compiling() or not gc.isenabled():
        return False
    gc.disable()
    return True


def resume_collections(paused: bool) -> None:
    if paused:
        gc.enable()
