"""bench serve's arms: one per policy and per value of each on/off or dtype option, named by the
options that vary, and the token comparisons between arms that differ in one option only."""

import argparse
from pathlib import Path

from fp8route.bench.workload import ServeReport, table_header, table_row
from fp8route.cli.bench_serve import _arms, _checks, _ratios, _run_arms


def args(**over: str) -> argparse.Namespace:
    base = {
        "policy": "routed", "enable_prefix_caching": "on", "kv_cache_dtype": "auto", "async_scheduling": "off",
        "prefill_graphs": "on", "admission": "on_demand", "sampling": "greedy",
    }  # fmt: skip
    base.update(over)
    return argparse.Namespace(
        **base, max_num_seqs=8, max_num_batched_tokens=64, gpu_memory_utilization=0.9, max_model_len=None,
        num_kv_blocks=None, block_size=16, attention="builtin", use_cuda_graphs=True, dtype="bfloat16",
        lone_prefill=0, static_batch=0,
    )  # fmt: skip


def test_arms_cross_the_options_and_name_what_varies():
    folders = {"fp8": Path("f")}
    assert [a.name for a in _arms(args(), folders)] == ["routed"]
    arms = _arms(args(prefill_graphs="off,on", enable_prefix_caching="on,off"), folders)
    names = [f"routed prefix-{p} graphs-{g}" for p in ("on", "off") for g in ("off", "on")]
    assert [a.name for a in arms] == names
    assert [(a.config.enable_prefix_caching, a.config.prefill_graphs) for a in arms] == [
        (True, False),
        (True, True),
        (False, False),
        (False, True),
    ]
    arms = _arms(args(async_scheduling="off,on", kv_cache_dtype="auto,fp8"), folders)
    assert [a.name for a in arms] == [f"routed kv-{k} async-{a}" for k in ("auto", "fp8") for a in ("off", "on")]
    assert [(a.config.kv_cache_dtype, a.config.async_scheduling) for a in arms] == [
        ("auto", False), ("auto", True), ("fp8", False), ("fp8", True)
    ]  # fmt: skip
    assert all(a.config.max_num_seqs == 8 and a.config.max_num_batched_tokens == 64 for a in arms)
    arms = _arms(args(admission="on_demand,reserve"), folders)
    assert [(a.name, a.config.admission) for a in arms] == [
        ("routed admission-on_demand", "on_demand"), ("routed admission-reserve", "reserve")
    ]  # fmt: skip


def test_tokens_are_compared_between_arms_that_differ_in_one_option():
    arms = _arms(args(prefill_graphs="off,on", enable_prefix_caching="on,off"), {"fp8": Path("f")})
    digests = {a.name: ["x", "y"] for a in arms}
    digests["routed prefix-off graphs-on"] = ["x", "z"]
    reports = [ServeReport(a.name, 2, 0, 1.0, 1.0, 1.0, 1.0, {}, {}, {}, {}, 0) for a in arms]
    lines = _checks(reports, digests, arms)
    assert (
        "routed prefix-on graphs-off / routed prefix-off graphs-off: tokens with and without the prefix cache equal"
        in lines
    )
    assert any(
        "prefix-off graphs-off / routed prefix-off graphs-on" in line and "DIFFER for 1 of 2" in line for line in lines
    )
    arms = _arms(args(async_scheduling="off,on"), {"fp8": Path("f")})
    reports = [ServeReport(a.name, 2, 0, 1.0, 1.0, 1.0, 1.0, {}, {}, {}, {}, 0) for a in arms]
    lines = _checks(reports, {a.name: ["x", "y"] for a in arms}, arms)
    assert "routed async-off / routed async-on: tokens with and without async scheduling equal" in lines
    arms = _arms(args(sampling="greedy,mixed"), {"fp8": Path("f")})  # their tokens differ by design
    reports = [ServeReport(a.name, 2, 0, 1.0, 1.0, 1.0, 1.0, {}, {}, {}, {}, 0) for a in arms]
    assert not any("tokens with and without" in line for line in _checks(reports, {a.name: ["x"] for a in arms}, arms))


def test_steps_that_waited_for_a_compile_or_the_allocator_are_named():
    arms = _arms(args(), {"fp8": Path("f")})
    waits = {"kernel_first_launches": 3, "alloc_retries": 0}
    reports = [ServeReport(arms[0].name, 2, 0, 1.0, 1.0, 1.0, 1.0, {}, {}, {}, {}, 0, waits)]
    lines = _checks(reports, {arms[0].name: ["x"]}, arms)
    assert "routed: steps under the load waited for 3 kernels' first launches (compiles)" in lines
    reports[0].extra["kernels_first_launched"] = ["_kth_kernel ((1,), 0)", "_gather_kernel (2,)", "_kth_kernel (3,)"]
    lines = _checks(reports, {arms[0].name: ["x"]}, arms)
    assert (
        "routed: steps under the load waited for 3 kernels' first launches (compiles) (_gather_kernel, _kth_kernel)"
        in lines
    )
    reports[0].extra["kernel_first_launches"] = 0
    assert not any("waited" in line for line in _checks(reports, {arms[0].name: ["x"]}, arms))


def test_a_gpu_arm_reports_its_decode_steps_against_their_floor():
    arms = _arms(args(), {"fp8": Path("f")})
    floors = {
        "decode_steps": 40, "decode_step_ms": 12.5, "decode_batch_mean": 177.6, "decode_gbs": 3100.0,
        "decode_over_floor": 1.62, "copy_gbs": 4230.0, "decode_host_ms_mean": 1.6,
        "decode_step_ms_p50": 12.0, "decode_step_ms_p90": 14.0, "decode_step_ms_max": 30.0,
        "decode_host_ms_p50": 1.5, "decode_host_ms_p90": 2.0, "decode_host_ms_max": 9.0,
        "gc_s": 0.5, "gc_full_s": 0.25, "gc_full": 2,
    }  # fmt: skip
    reports = [ServeReport(arms[0].name, 2, 0, 1.0, 1.0, 1.0, 1.0, {}, {}, {}, {}, 0, floors)]
    lines = _checks(reports, {arms[0].name: ["x", "y"]}, arms)
    assert (
        "routed: 40 decode steps, 12.50 ms each at 178 rows: 3100 GB/s, 1.62x their floor (weights + KV over "
        "4230 GB/s); host 1.60 ms a step" in lines
    )
    assert "routed: decode step p50 12.00 / p90 14.00 / max 30.0 ms; host p50 1.50 / p90 2.00 / max 9.0 ms" in lines
    assert "routed: Python's garbage collector ran 0.50 s under the load, 0.25 s of it in 2 full collections" in lines
    cpu = [ServeReport(arms[0].name, 2, 0, 1.0, 1.0, 1.0, 1.0, {}, {}, {}, {}, 0)]
    assert not any("decode steps" in line for line in _checks(cpu, {arms[0].name: ["x", "y"]}, arms))


def test_the_must_show_ratios_are_printed_against_what_the_arm_measured_apart():
    extra = {
        "unloaded_ttft_ms": 20.0, "unloaded_itl_ms": 3.0, "lone_prefill_tok_s": 60000.0, "lone_prefill_tokens": 4096,
        "static_output_tok_s": 3000.0, "static_batch": 16, "load_bound_output_tok_s": 10000.0, "max_num_seqs": 256,
        "copy_gbs": 4250.0,
    }  # fmt: skip
    report = ServeReport(
        "routed", 4, 0, 1.0, 4.0, 54000.0, 7500.0, {"p50": 50.0}, {}, {"p50": 6.0, "p99": 45.0}, {}, 0, extra
    )
    assert _ratios(report) == [
        "routed: TTFT p50 2.50x a request alone (20.0 ms), ITL p99 15.0x its step (3.00 ms)",
        "routed: input 54,000 tok/s = 0.90x a lone 4096-token prefill (60,000 tok/s)",
        "routed: output 7,500 tok/s = 0.75 of the load's own bound (10,000 tok/s: prompts at the lone-prefill rate, "
        "then each output token's KV and the weights once per step of 256 rows at 4,250 GB/s, or the output tokens "
        "at the lone-prefill rate where that is longer)",
        "routed: output 7,500 tok/s = 2.50x the static generate at batch 16 (3,000 tok/s)",
    ]
    assert _ratios(ServeReport("cpu", 1, 0, 1.0, 1.0, 1.0, 1.0, {"p50": 1.0}, {}, {"p99": 1.0}, {}, 0)) == []


def test_sampling_arms_run_their_controls_through_the_engine(tmp_path):
    import pytest
    import torch
    from checkpoint_helpers import text_model_folder

    from fp8route import LLM
    from fp8route.bench.serve import drive
    from fp8route.bench.workload import LoadRequest

    arms = _arms(args(sampling="greedy,mixed,json"), {"fp8": Path("f")})
    assert [(a.name, a.sampling) for a in arms] == [(f"routed {s}", s) for s in ("greedy", "mixed", "json")]
    pytest.importorskip("xgrammar")
    llm = LLM(text_model_folder(tmp_path / "tiny"), max_num_seqs=4, max_num_batched_tokens=64, device="cpu",
              dtype=torch.float32)  # fmt: skip
    load = [LoadRequest(list(range(3, 3 + 10 + i)), 12, 0.0) for i in range(6)]
    for sampling in ("greedy", "mixed", "json"):
        results, _, _ = drive(llm, load, sampling)
        assert all(r.output_tokens == 12 and not r.error for r in results), sampling  # ignore_eos: full length
    assert llm.engine.leaked() is None


def test_each_arms_row_prints_once_under_the_header_printed_once(capsys):
    arms = _arms(args(policy="routed,cublas"), {"fp8": Path("f")})

    def run(arm, load, warmup):  # type: ignore[no-untyped-def]
        print(f"{arm.name} ran")  # what a child process may print while it runs
        stats = {"p50": 1.0, "p99": 2.0}
        return ServeReport(arm.name, 2, 0, 1.0, 1.0, 1.0, 1.0, stats, stats, stats, {}, 0), ["x"]

    reports, digests = _run_arms(arms, [], [], run)
    assert [r.arm for r in reports] == ["routed", "cublas"] and set(digests) == {"routed", "cublas"}
    assert capsys.readouterr().out.splitlines() == [
        "routed ran", "", table_header(), table_row(reports[0]), "cublas ran", table_row(reports[1])
    ]  # fmt: skip
