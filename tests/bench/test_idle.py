"""bench idle's idle share: the union of device intervals over their whole span."""

import math

from fp8route.bench.idle import idle_share, table


def test_overlaps_count_once_and_gaps_are_idle():
    idle, span = idle_share([(0, 4), (2, 6), (8, 10)])  # busy 0-6 and 8-10 of 0-10
    assert span == 10 and math.isclose(idle, 0.2)
    assert idle_share([(5, 9), (0, 10)]) == (0.0, 10)  # one interval inside another
    idle, span = idle_share([(3, 3)])  # empty intervals are not activity
    assert math.isnan(idle) and span == 0.0


def test_table_has_a_row_per_measurement():
    row = {"kind": "decode", "sampling": "mixed", "batch": 64, "steps": 40, "mixed_steps": 0, "idle": 0.051,
           "step_ms": 6.5, "host_us": 1170.0, "wall_us": 6400.0}  # fmt: skip
    assert table([row]).splitlines()[-1] == "| decode | mixed | 64 | 40 | 0 | 5.1% | 6.50 | 1170 | 6400 |"
