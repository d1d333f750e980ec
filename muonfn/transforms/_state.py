"""The names of the state entries the transforms keep: one schema for the transforms, presets and shim."""

from __future__ import annotations

from collections.abc import Iterable

from tensordict import TensorDictBase

MOMENTUM = "momentum"
STEP = "step"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
COUNT = "count"
NOTFINITE_COUNT = "notfinite_count"


def check_entries(where: str, state: TensorDictBase, entries: Iterable[str]) -> None:
    """``state`` must hold every top-level entry of ``entries``: else it is another transform's state.

    Structural only (key names), so an update stays traceable.
    """
    present = set(state.keys())
    for entry in entries:
        if entry not in present:
            raise ValueError(
                f"{where}: state has no entry {entry!r} (it has {sorted(present)}); "
                "was it made by this transform's init?"
            )


ROW_SECOND_MOMENT = "row_second_moment"
