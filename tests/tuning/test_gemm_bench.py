"""bench gemm and the tuner's measurement, on CPU: operand checks, arms, the report's arithmetic."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from helpers import CPU_ROWWISE
from routing_helpers import FP, H200, only_core_backends

from fp8route.backends import BACKENDS
from fp8route.cli import main
from fp8route.cli.sweep_args import timer_from_args
from fp8route.errors import Fp8RouteError
from fp8route.models.shapes import LayerShape
from fp8route.tuning import cupti, timing
from fp8route.tuning.ceilings import Ceilings
from fp8route.tuning.gemm_bench import sweep, write_results
from fp8route.tuning.kernel_names import split_by_window
from fp8route.tuning.report import ROUTED, SUM, Cell, GemmReport, gemm_bytes
from fp8route.tuning.timing import ArmTiming
from fp8route.tuning.tuner import Tuner
from fp8route.tuning.workload import CudaMeasure, Workload, backend_run, routed_run


@pytest.fixture(autouse=True)
def core_backends(monkeypatch):
    only_core_backends(monkeypatch)


class FakeTimer:
    """Calls every bound call once (so the arms really run) and reports 1 µs per copy index."""

    def __init__(self, fail: str | None = None):
        self.seen: dict[str, int] = {}
        self.fail = fail

    def __call__(self, arms, repeats, reps):
        if self.fail in arms:
            raise RuntimeError("CUDA out of memory")
        out = {}
        for name, calls in arms.items():
            for call in calls:
                call()
            self.seen[name] = len(calls)
            out[name] = ArmTiming(name, (2.0, 2.0), 2.0, 0.0)
        return out


class QuantizationWatch:
    """A FakeTimer that knows when it is timing, and a spy on quantize_input recording, per call,
    whether an arm was being timed (none may be when x arrives quantized)."""

    def __init__(self, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        import fp8route.backends.base as base

        self.fake, self.timing, self.inside_timing = FakeTimer(), False, []
        real = base.quantize_input

        def spy(x, layer):  # type: ignore[no-untyped-def]
            self.inside_timing.append(self.timing)
            return real(x, layer)

        monkeypatch.setattr(base, "quantize_input", spy)

    def __call__(self, arms, repeats, reps):  # type: ignore[no-untyped-def]
        self.timing = True
        try:
            return self.fake(arms, repeats, reps)
        finally:
            self.timing = False


@CPU_ROWWISE
def test_workload_checks_each_arm_against_the_reference_before_timing():
    w = Workload(64, 32, device="cpu", copies=3)
    assert len(w.copies) == 3 and all(c.operands.weight_scale_channel is not None for c in w.copies)
    assert w.copies[1].operands.weight.data_ptr() != w.copies[0].operands.weight.data_ptr()
    timer = FakeTimer()
    runs = {
        "reference": backend_run("reference"),
        "rowwise": backend_run("rowwise"),
        "routed": routed_run,
        "zeros": lambda x, layer: torch.zeros(x.shape[0], 64, dtype=x.dtype),
        "raises": lambda x, layer: (_ for _ in ()).throw(RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore")),
        "nan": lambda x, layer: torch.full((x.shape[0], 64), float("nan"), dtype=x.dtype),
        "shape": lambda x, layer: torch.zeros(1, 1, dtype=x.dtype),
    }
    out = w.time(runs, 5, timer=timer)
    assert list(out) == list(runs)
    assert timer.seen == {"reference": 3, "rowwise": 3, "routed": 3}
    assert out["zeros"].startswith("output off the fp32 reference by 1.0e+00")
    assert out["raises"] == "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"
    assert out["nan"] == "output has NaN or inf"
    assert "expected torch.bfloat16 (5, 64)" in out["shape"]
    assert isinstance(out["rowwise"], ArmTiming)


def test_weight_only_is_checked_against_its_own_looser_tolerance():
    out = Workload(64, 256, device="cpu", copies=2).time(
        {"weight_only": backend_run("weight_only")}, 8, timer=FakeTimer()
    )
    assert isinstance(out["weight_only"], ArmTiming)


@CPU_ROWWISE
def test_an_arm_that_breaks_while_timed_fails_alone():
    timer = FakeTimer(fail="rowwise")
    out = Workload(64, 32, device="cpu", copies=2).time(
        {"rowwise": backend_run("rowwise"), "cublas": backend_run("cublas")}, 4, timer=timer
    )
    assert out["rowwise"] == "failed while timed: RuntimeError: CUDA out of memory"
    assert isinstance(out["cublas"], ArmTiming)


@CPU_ROWWISE
def test_tuner_with_the_real_measurement_path_on_cpu():
    # The kernels run on CPU tensors (torch._scaled_mm has a CPU path); only the clock is fake.
    measure = CudaMeasure("cpu", copies=2, timer=FakeTimer())
    table = Tuner(measure, H200, FP, m_values=(1, 8)).tune([(64, 32), (32, 64)])
    assert {s.routes for s in table.shapes.values()} == {("cublas", "cublas", "cublas")}  # all tie: priority
    assert not any(s.failures for s in table.shapes.values())


def test_sweep_on_cpu_marks_ineligible_policies():
    cells = sweep(
        [LayerShape("x", 64, 32)], [1, 4], [ROUTED, "cublas"], table=None, device="cpu", copies=2, timer=FakeTimer()
    )
    by = {(c.m, c.arm): c for c in cells}
    assert by[(1, ROUTED)].median_us == 2.0 and by[(1, ROUTED)].backend == "reference"
    assert by[(4, "cublas")].median_us is None and by[(4, "cublas")].error.startswith("not eligible: needs a CUDA GPU")


QKV, DOWN = LayerShape("qkv", 6144, 4096), LayerShape("down", 4096, 14336)
CEIL = Ceilings(copy_gbs=4000.0, fp8_tflops=1500.0)


def report(
    routed_down_2048: float = 100.0, down_2048_rowwise: float = 110.0, down_2048_backend: str = "cublas"
) -> GemmReport:
    times = {
        (QKV, 1): {ROUTED: 10.0, "cublas": 10.1, "rowwise": 20.0},
        (DOWN, 1): {ROUTED: 20.0, "cublas": 20.0, "rowwise": 30.0},
        (QKV, 2048): {ROUTED: 50.0, "cublas": 50.0, "rowwise": 55.0},
        (DOWN, 2048): {ROUTED: routed_down_2048, "cublas": 100.0, "rowwise": down_2048_rowwise},
    }
    cells = [
        Cell(s, m, arm, t, 0.01, (t, t), backend=None if arm != ROUTED else "cublas")
        for (s, m), arms in times.items()
        for arm, t in arms.items()
    ]
    cells = [
        Cell(c.shape, c.m, c.arm, c.median_us, c.spread, c.rep_medians_us, backend=down_2048_backend)
        if (c.shape, c.m, c.arm) == (DOWN, 2048, ROUTED)
        else c
        for c in cells
    ]
    return GemmReport(cells, [QKV, DOWN], [1, 2048], CEIL)


def test_report_speedups_sums_floor_and_rowwise_ratio():
    r = report()
    assert r.speedup(QKV, 1, "rowwise") == pytest.approx(2.0)
    assert r.timing(SUM, 1, ROUTED).median_us == pytest.approx(30.0)
    assert r.speedup(SUM, 1, "rowwise") == pytest.approx(50.0 / 30.0)
    floor = max(gemm_bytes(2048, 6144, 4096) / 4e12, 2 * 2048 * 6144 * 4096 / 1.5e15) * 1e6
    assert r.floor(QKV, 2048) == pytest.approx(floor)
    assert r.prefill_floor_ratios()[2048] == pytest.approx(150.0 / r.floor(SUM, 2048))
    assert r.rowwise_ratios()["qkv 6144x4096"][1] == pytest.approx(20.0 / 10.1)
    assert r.violations() == []
    rows = r.rows()
    assert len(rows) == 3 * 2 * 3
    row = next(x for x in rows if x["shape"] == "qkv 6144x4096" and x["m"] == 2048 and x["arm"] == ROUTED)
    assert row["tflops"] == pytest.approx(2 * 2048 * 6144 * 4096 / 50e-6 / 1e12, rel=1e-3)
    assert row["pct_of_floor"] == pytest.approx(100 * floor / 50.0, abs=0.1)
    assert "PASS" in r.text() and "rowwise CUTLASS time / per-tensor cuBLASLt time" in r.text()


def test_a_policy_never_timed_is_not_plotted():
    r = report()
    absent = [Cell(s, m, "flashinfer", None, error="not installed") for s in (QKV, DOWN) for m in (1, 2048)]
    with_absent = GemmReport([*r.cells.values(), *absent], [QKV, DOWN], [1, 2048], CEIL)
    assert "flashinfer" in with_absent.policies
    assert with_absent.timed_policies() == ["cublas", "rowwise"]


def test_kernels_split_by_the_window_of_the_arm_that_launched_them():
    windows = {"cublas": (10.0, 20.0), "fp8_gemv": (21.0, 30.0)}
    kernels = [(25.0, "_fp8_gemv_kernel"), (12.0, "quantize"), (15.0, "nvjet_sm90_gemm"), (40.0, "stray")]
    assert split_by_window(windows, kernels) == {
        "cublas": ("quantize", "nvjet_sm90_gemm"),
        "fp8_gemv": ("_fp8_gemv_kernel",),
    }


def test_rows_carry_the_kernels_an_arm_ran():
    r = report()
    cells = [
        Cell(c.shape, c.m, c.arm, c.median_us, c.spread, c.rep_medians_us, backend=c.backend, kernels=("k1", "k2"))
        if c.arm == "cublas"
        else c
        for c in r.cells.values()
    ]
    rows = GemmReport(cells, [QKV, DOWN], [1, 2048], CEIL).rows()
    cublas = next(x for x in rows if x["shape"] == "qkv 6144x4096" and x["m"] == 1 and x["arm"] == "cublas")
    rowwise = next(x for x in rows if x["shape"] == "qkv 6144x4096" and x["m"] == 1 and x["arm"] == "rowwise")
    assert cublas["kernels"] == ["k1", "k2"] and "kernels" not in rowwise


def test_report_flags_routed_slower_beyond_the_spread_only():
    assert report(routed_down_2048=100.5).violations() == []  # 0.5%: inside the 1% spread
    # Routed to rowwise, which is 10% slower than cublas: a wrong route.
    bad = report(routed_down_2048=110.0, down_2048_backend="rowwise").violations()
    assert any(v.startswith("down 4096x14336 M=2048: routed 110.0 us vs cublas 100.0 us") for v in bad)
    assert any(v.startswith(f"{SUM} M=2048") for v in bad)
    assert "FAIL" in report(routed_down_2048=110.0, down_2048_backend="rowwise").text()


def test_report_counts_the_twin_gap_as_noise():
    # Routed ran cublas, as the cublas arm did: 5% between two timings of one kernel is noise
    # this run measured, and a 3% edge of another arm is inside it.
    r = report(routed_down_2048=105.0, down_2048_rowwise=102.0)
    assert r.twin_gap(DOWN, 2048) == pytest.approx(5 / 105)
    assert r.violations() == []
    assert sorted(r.twin_gaps())[-1] == pytest.approx(0.05)
    assert "twin gap" in r.text()
    # Without a twin (its backend's arm not timed) only the spreads and min_tie count.
    lone = report(routed_down_2048=105.0, down_2048_rowwise=102.0, down_2048_backend="flashinfer")
    assert any(v.startswith("down 4096x14336 M=2048: routed 105.0 us vs rowwise 102.0 us") for v in lone.violations())


def test_write_results_json_and_optional_png(tmp_path):
    paths = write_results(
        report(),
        tmp_path,
        "gemm-test",
        fingerprint=FP,
        table=None,
        meta={"command": "fp8route bench gemm", "model": "x"},
    )
    doc = json.loads(paths[0].read_text())
    assert doc["command"] == "fp8route bench gemm" and doc["fingerprint"]["gpu"] == "NVIDIA H200"
    assert doc["ceilings"] == {"copy_gbs": 4000.0, "fp8_tflops": 1500.0} and doc["violations"] == []
    assert doc["rowwise_over_cublas"]["qkv 6144x4096"]["1"] == round(20.0 / 10.1, 4)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert len(paths) == 1
    else:
        assert [p.suffix for p in paths] == [".json", ".png", ".png"]


def test_cli_commands_say_they_need_a_gpu_or_what_is_wrong(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--model", "llama-3.1-8b"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "gemm", "--model", "llama-3.1-8b"]) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("fp8route.cli.bench.cuda_device", lambda args: torch.device("cuda", 0))
    monkeypatch.setattr("fp8route.cli.bench.DeviceInfo.of", lambda device: H200)
    assert main(["bench", "gemm", "--model", "llama-3.1-8b", "--policy", "cublas,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err
    assert main(["bench", "gemm", "--shapes", "12x"]) == 2


class _Stub:
    def __init__(self, value):
        self.value = value

    def of(self, device):
        return self.value


def test_cli_tune_end_to_end_with_a_fake_clock(tmp_path, monkeypatch, capsys):
    import fp8route.cli.tune as tune

    monkeypatch.setattr(tune, "cuda_device", lambda args: torch.device("cpu"))
    monkeypatch.setattr(tune, "DeviceInfo", _Stub(H200))
    monkeypatch.setattr(tune, "Fingerprint", _Stub(FP))

    def measure(device, repeats, timer):
        assert timer is None  # --clock events, the default: time_arms as it is
        return CudaMeasure("cpu", copies=2, timer=FakeTimer())

    monkeypatch.setattr(tune, "CudaMeasure", measure)
    argv = [
        "tune",
        "--shapes",
        "64x32,32x64",
        "--m",
        "8,1",
        "--table",
        str(tmp_path / "t.json"),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "tuning 2 shapes x 2 M values, per-tensor scales, x quantized by each layer, clock: events, on NVIDIA H200"
        in out
        and "M 1+ -> cublas" in out
    )
    table = json.loads((tmp_path / "out" / "routing-h200.json").read_text())
    assert table["m_bounds"] == [1, 8] and len(table["shapes"]) == 2 and table["command"].startswith("fp8route ")


def test_cli_tune_for_pre_quantized_input_keeps_both_kinds_of_routes(tmp_path, monkeypatch, capsys):
    import fp8route.cli.tune as tune

    watch = QuantizationWatch(monkeypatch)
    monkeypatch.setattr(tune, "cuda_device", lambda args: torch.device("cpu"))
    monkeypatch.setattr(tune, "DeviceInfo", _Stub(H200))
    monkeypatch.setattr(tune, "Fingerprint", _Stub(FP))
    monkeypatch.setattr(tune, "CudaMeasure", lambda device, repeats, timer: CudaMeasure("cpu", copies=2, timer=watch))
    argv = ["tune", "--shapes", "64x32", "--m", "1,8", "--table", str(tmp_path / "t.json")]
    assert main([*argv, "--x-quantized"]) == 0
    assert "x handed over quantized (GEMMs alone)" in capsys.readouterr().out
    # x was quantized for the reference check only
    assert watch.inside_timing and not any(watch.inside_timing)
    assert main(argv) == 0
    doc = json.loads((tmp_path / "t.json").read_text())
    assert sorted(s["x"] for s in doc["shapes"]) == ["float", "fp8"]  # the second run kept the first's routes


def test_cli_bench_end_to_end_with_a_fake_clock(tmp_path, monkeypatch, capsys):
    import fp8route.cli.bench as bench

    monkeypatch.setattr(bench, "cuda_device", lambda args: torch.device("cpu"))
    monkeypatch.setattr(bench, "measure_ceilings", lambda device, clock: CEIL)
    real_sweep = bench.sweep
    monkeypatch.setattr(bench, "sweep", lambda *a, **kw: real_sweep(*a, **{**kw, "copies": 2, "timer": FakeTimer()}))
    assert main(["bench", "gemm", "--shapes", "64x32", "--m", "1,4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "routing table: none" in out and "layer sum" in out
    doc = json.loads((tmp_path / "gemm-shapes.json").read_text())
    assert doc["fingerprint"]["gpu"] == "cpu"
    # On a CPU only the reference (and routed, which runs it) can be timed; the rest say why not.
    assert {r["arm"] for r in doc["rows"] if r["median_us"] is not None} == {ROUTED, "reference"}
    assert next(r for r in doc["rows"] if r["arm"] == "cublas")["error"].startswith("not eligible")


def test_bench_with_x_quantized_upstream_times_gemms_alone(tmp_path, monkeypatch, capsys):
    import fp8route.cli.bench as bench

    calls: list[str] = []
    real_run_quantized = BACKENDS["reference"].run_quantized
    monkeypatch.setattr(
        BACKENDS["reference"],
        "run_quantized",
        lambda *a: calls.append("gemm") or real_run_quantized(*a),
    )
    monkeypatch.setattr(bench, "cuda_device", lambda args: torch.device("cpu"))
    monkeypatch.setattr(bench, "measure_ceilings", lambda device, clock: CEIL)
    watch = QuantizationWatch(monkeypatch)
    real_sweep = bench.sweep
    monkeypatch.setattr(bench, "sweep", lambda *a, **kw: real_sweep(*a, **{**kw, "copies": 2, "timer": watch}))
    argv = ["bench", "gemm", "--shapes", "64x32", "--m", "1,4", "--x-quantized", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "every arm times its GEMM alone" in capsys.readouterr().out
    doc = json.loads((tmp_path / "gemm-shapes-xq.json").read_text())
    assert doc["x_quantized"] is True
    timed = [r for r in doc["rows"] if r["median_us"] is not None and r["n"] is not None]
    assert {r["arm"] for r in timed} == {ROUTED, "reference"} and all(r["error"] is None for r in timed)
    assert calls  # the arms ran the GEMM on the pre-quantized x, and passed the reference check
    assert not any(watch.inside_timing), "x was quantized inside a timed arm"


def test_a_host_too_busy_to_time_on_stops_tune_instead_of_failing_a_backend(tmp_path, monkeypatch, capsys):
    import fp8route.cli.tune as tune
    from fp8route.tuning.timing import HostBehindError

    def busy(arms, repeats, reps):  # type: ignore[no-untyped-def]
        raise HostBehindError("time_cold: the host could not queue 30 calls within a 64 ms sleep")

    with pytest.raises(HostBehindError):
        Workload(64, 32, device="cpu", copies=2).time({"reference": backend_run("reference")}, 1, timer=busy)
    monkeypatch.setattr(tune, "cuda_device", lambda args: torch.device("cpu"))
    monkeypatch.setattr(tune, "DeviceInfo", _Stub(H200))
    monkeypatch.setattr(tune, "Fingerprint", _Stub(FP))
    monkeypatch.setattr(tune, "CudaMeasure", lambda device, repeats, timer: CudaMeasure("cpu", copies=2, timer=busy))
    assert main(["tune", "--shapes", "64x32", "--m", "1", "--table", str(tmp_path / "t.json")]) == 2
    assert "could not queue 30 calls" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


@pytest.mark.parametrize(
    ("mb_per_copy", "gib", "expected"),
    [
        (117, 141, 8),  # 8B gate_up on an H200: the L2 rule alone gives 2, placement wants 8
        (25, 141, 8),  # 8B qkv: the L2 rule gives 8
        (4, 141, 46),  # TP4 o: the L2 rule dominates
        (1024, 16, 4),  # 8 would take more than a quarter of the memory: what fits
        (8192, 16, 2),  # never fewer than 2
    ],
)
def test_copies_cover_three_l2_and_at_least_eight_placements(monkeypatch, mb_per_copy, gib, expected):
    class Props:
        total_memory = gib << 30

    monkeypatch.setattr(timing, "l2_bytes", lambda device=None: 60 << 20)
    monkeypatch.setattr(timing, "_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    assert timing.copies_for(mb_per_copy << 20) == expected


@pytest.mark.parametrize(("copies", "repeats"), [([8, 8, 8], 30), ([46, 46], 30), ([2, 3], 7), ([4, 4], 10)])
def test_interleaved_arms_take_turns_of_a_whole_rotation(copies, repeats):
    schedule = timing.interleaved_schedule(copies, repeats)
    for arm, n in enumerate(copies):
        mine = [c for a, c in schedule if a == arm]
        assert mine == [i % n for i in range(repeats)]  # each arm: its own plain rotation, every copy met
    turns = [schedule[0][0]] + [a for (a, _), (b, _) in zip(schedule[1:], schedule) if a != b]
    assert len(turns) == sum(-(-repeats // n) for n in copies)  # arms switch after every pass, not before
    # The next arm starts its pass at copy 0 right after one ended on copy n-1: when arms share the
    # same copies, a copy still comes back only after all the others.
    for (a, c), (b, d) in zip(schedule, schedule[1:]):
        assert d == (c + 1) % copies[a] if a == b else d == 0


def test_long_schedules_are_timed_in_batches_the_launch_queue_can_hold(monkeypatch):
    batches: list[int] = []

    def behind_sleep(batch, lead_us, clock):
        batches.append(len(batch))
        return [float(call()) for call in batch]

    monkeypatch.setattr(timing, "_time_behind_sleep", behind_sleep)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = [lambda i=i: i for i in range(8)]
    times = timing.time_cold(calls, repeats=400, warmup=1)
    assert batches == [150, 150, 100]
    assert times == [float(i % 8) for i in range(400)]  # every call timed once, in order


class _Event:
    def __init__(self, name: str, device_time_total: float, device_type=torch.autograd.DeviceType.CPU):
        self.name, self.device_time_total, self.device_type = name, device_time_total, device_type


def test_cupti_clock_reads_each_calls_kernel_time_from_its_range():
    label = cupti._CALL_LABEL
    events = [
        _Event(f"{label}1", 7.5),
        _Event("aten::_scaled_mm", 6.0),  # a child op: already inside its range's total
        _Event(f"{label}0", 12.25),
        _Event(f"{label}0", 99.0, torch.autograd.DeviceType.CUDA),  # the range's GPU mirror: not a call
    ]
    assert timing.kernel_us_per_call(events, 2) == [12.25, 7.5]
    # A call whose kernels the profiler did not see is an error, never a zero time.
    with pytest.raises(Fp8RouteError, match="no kernel time for 1 of 3 calls"):
        timing.kernel_us_per_call(events, 3)
    with pytest.raises(Fp8RouteError, match="first: call 0"):
        timing.kernel_us_per_call([_Event(f"{label}0", 0.0), _Event(f"{label}1", 3.0)], 2)


def test_a_clock_beside_a_timer_of_ones_own_is_refused():
    with pytest.raises(ValueError, match="a timer given times by itself"):
        timing.time_arms({"a": [lambda: None]}, timer=timing.time_graph, clock="cupti")


def test_an_unknown_clock_is_refused_before_anything_runs():
    ran = []
    with pytest.raises(ValueError, match="clock must be one of events, cupti, got 'wall'"):
        timing.time_cold([lambda: ran.append(1)], repeats=2, clock="wall")
    assert ran == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUPTI cannot see a GPU")
def test_the_cupti_clock_without_a_gpu_is_refused_with_the_way_out():
    with pytest.raises(Fp8RouteError, match="use 'events'"):
        timing.time_cold([lambda: None], repeats=2, clock="cupti")
    with pytest.raises(Fp8RouteError, match="--clock cupti: torch.profiler cannot record CUDA kernels"):
        timer_from_args(argparse.Namespace(clock="cupti"))
    assert timer_from_args(argparse.Namespace(clock="events")) is None
