"""The names of the state entries the transforms keep: one schema for the transforms, presets and shim."""

from __future__ import annotations

MOMENTUM = "momentum"
STEP = "step"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
ROW_SECOND_MOMENT = "row_second_moment"
#: Where AdaMuon keeps its second moment and its count when the momentum's own count is ``step``.
SECOND_MOMENT = "second_moment"
COUNT = "count"
NOTFINITE_COUNT = "notfinite_count"
