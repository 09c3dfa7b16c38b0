"""bench decode's CPU side: which configurations a sweep times, what a spec refuses, and the summary."""

import pytest

from fp8route.bench.decode import DecodeBenchSpec, check_spec, parse_blocks, sweep_configs
from fp8route.bench.decode_report import summarize, timings_tie
from fp8route.errors import Fp8InputError
from fp8route.kernels.decode_gemm import configs


def test_cuda_core_configs_only_at_small_m_and_split_k_evenly():
    spec = DecodeBenchSpec(sweep_kinds="cuda_core", cuda_core_blocks=((16, 512, 4, 3),))
    found = sweep_configs(1, 6144, 4096, 132, spec)
    assert found and all(c.block_n == 16 and c.block_k == 512 for c in found)
    assert all((4096 // 512) % c.split_k == 0 for c in found)
    assert sweep_configs(16, 6144, 4096, 132, spec) == []  # the CUDA-core kernel stops at M=8


def test_wgmma_configs_use_m_own_token_tile_and_the_smaller_ones_asked_for():
    own = sweep_configs(64, 4096, 4096, 132, DecodeBenchSpec())
    assert {c.block_m for c in own} == {configs.block_m_for(64)}
    more = sweep_configs(64, 4096, 4096, 132, DecodeBenchSpec(sweep_block_ms=(16, 32)))
    assert {c.block_m for c in more} == {16, 32, 64}
    assert all(c.split_k <= 4096 // c.block_k for c in more)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (DecodeBenchSpec(shapes=("tp3_qkv",)), "--shapes: unknown tp3_qkv"),
        (DecodeBenchSpec(ms=(1, 256)), "--ms: every M must be in 1..128"),
        (DecodeBenchSpec(sweep_kinds="wgmma,simt"), "--sweep-kinds"),
        (DecodeBenchSpec(sweep_block_ms=(8,)), "--sweep-block-ms"),
    ],
)
def test_a_spec_the_run_could_not_do_is_refused_by_option(spec, message):
    with pytest.raises(Fp8InputError, match=message):
        check_spec(spec)


def test_blocks_parse_with_an_optional_register_cap():
    assert parse_blocks("16x512x4x1, 16x2048x8x1x64") == ((16, 512, 4, 1), (16, 2048, 8, 1, 64))
    with pytest.raises(Fp8InputError, match="'16x512x4' is not"):
        parse_blocks("16x512x4")


def _row(shape, m, arm, us, spread=0.01):
    return {"shape": shape, "m": m, "arm": arm, "timing": "events", "median_us": us, "spread": spread,
            "floor_us": 5.0, "pct_copy_bw": 50.0}  # fmt: skip


def test_summary_sums_tp1_and_marks_ties_inside_the_spread():
    tp1 = ("tp1_qkv", "tp1_o", "tp1_gate_up", "tp1_down")
    rows = [_row(s, 1, "ours", 10.0) for s in tp1] + [_row(s, 1, "cublas+quant", 12.0) for s in tp1]
    rows.append(_row("tp4_o", 2, "ours", 10.0, spread=0.05))
    rows.append(_row("tp4_o", 2, "cublas+quant", 10.4))
    result = {"copy_gbs": 4000.0, "empty_kernel_us": 3.4, "empty_kernel_graph_us": 0.7, "rows": rows}
    text = summarize(result)
    assert "Llama-3.1-8B TP1 sum M=1: ours 40.0, cublas+quant 48.0, floor 20.0 µs; ours is 1.20x" in text
    tp4 = next(line for line in text.splitlines() if line.startswith("tp4_o"))
    assert tp4.endswith("1.04x tie")
    assert not timings_tie(_row("a", 1, "x", 10.0), _row("a", 1, "y", 12.0))
