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


def test_the_host_holders_name_each_op_per_step_and_mark_what_can_wait_for_the_gpu():
    """A real profile of host ops: a float op and a read back to the host (aten::item, a sync on a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fp8route.bench.idle import holders_text, host_holders

    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        for _ in range(4):  # four "steps"
            (x @ x).sum().item()
    rows = host_holders(trace.key_averages(), steps=4)
    by_name = {name: (calls, ms, blocking) for name, calls, ms, blocking in rows}
    assert by_name["aten::item"][0] == 1.0 and by_name["aten::item"][2], "one read back a step, marked"
    assert not by_name["aten::mm"][2] and by_name["aten::mm"][1] > 0
    text = holders_text({"kind": "mixed", "sampling": "greedy", "batch": 8, "holders": rows})
    assert any(line.lstrip().startswith("*") and line.endswith("aten::item") for line in text.splitlines())
