"""Running a plan's rounds one after another, or pipelined so communication overlaps Newton–Schulz.

Each round is a :class:`Round` in three phases: ``start`` packs this rank's pieces and
starts the inward exchange, ``compute`` waits for it, orthogonalizes what this rank owns
and starts the outward exchange, ``finish`` waits for that and writes the results.

Without overlap the phases run in order, round after round. With overlap the next round's
inward exchange is started before this round's Newton–Schulz, and this round's outward
exchange is waited for only after the next round's Newton–Schulz:

.. code-block:: text

    start(0)  [local work]  start(1)  compute(0)  start(2)  compute(1)  finish(0)  start(3)  compute(2)  finish(1) ...

Every rank starts the same exchanges in the same order (the rounds come from a plan every
rank made alike), which is all a process group asks; only the waits move. At most the
buffers of three rounds are alive at once, against one without overlap. The arithmetic
is the same in both orders, so the results are bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol


class Round(Protocol):
    def start(self) -> None: ...

    def compute(self) -> None: ...

    def finish(self) -> None: ...


def run_rounds(rounds: Sequence[Round], *, overlap: bool, meanwhile: Callable[[], None] | None = None) -> None:
    """Runs every round; ``meanwhile`` (work needing no communication) runs while the first exchange is in flight."""
    if not overlap:
        if meanwhile is not None:
            meanwhile()
        for r in rounds:
            r.start()
            r.compute()
            r.finish()
        return
    if rounds:
        rounds[0].start()
    if meanwhile is not None:
        meanwhile()
    for k, r in enumerate(rounds):
        if k + 1 < len(rounds):
            rounds[k + 1].start()
        r.compute()
        if k > 0:
            rounds[k - 1].finish()
    if rounds:
        rounds[-1].finish()
