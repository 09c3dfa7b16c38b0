"""bench serve's decode floors: each pure decode step against the bytes it must read (the weights,
plus every position its rows attend to), over the copy bandwidth; prefill and mixed steps apart, the
steps with prefill chunks as prompt tokens over their own time."""

import gc

import pytest
from checkpoint_helpers import text_model_folder

from fp8route import LLM
from fp8route.bench.e2e import weight_bytes
from fp8route.bench.serve import _Collections, _percentiles, _prefill_steps, _step_floors, load_bound
from fp8route.bench.workload import LoadRequest
from fp8route.engine.llm_engine import StepStats


def test_decode_steps_are_set_against_weights_plus_the_kv_they_read(tmp_path):
    llm = LLM(text_model_folder(tmp_path / "tiny"), max_num_seqs=4, max_num_batched_tokens=32, device="cpu")
    weights, per_token = weight_bytes(llm.engine.model), llm.engine.runner.pool.bytes_per_token
    copy_gbs = 1.0  # 1e9 bytes a second: a floor in seconds is its bytes / 1e9
    stats = [
        StepStats(0, 32, 0, 3, 0.001, 0.5),  # a prefill: not a decode step
        StepStats(2, 0, 100, 3, 0.001, 2 * (weights + 100 * per_token) / 1e9),  # 2x its floor
        StepStats(4, 0, 300, 5, 0.003, 1 * (weights + 300 * per_token) / 1e9),  # at its floor
        StepStats(2, 8, 50, 5, 0.002, 0.25),  # mixed: decodes and a chunk, not a decode graph's step
    ]
    floors = _step_floors(llm, stats, copy_gbs)
    assert floors["decode_steps"] == 2 and floors["mixed_steps"] == 1 and floors["steps"] == 4
    assert floors["decode_over_floor"] == pytest.approx(1.5)
    assert floors["decode_gbs"] == pytest.approx(0.75)  # (0.5 + 1.0) / 2 of the copy rate
    assert floors["decode_batch_mean"] == 3 and floors["decode_host_ms_mean"] == pytest.approx(2.0)
    assert floors["decode_host_ms_p50"] == pytest.approx(2.0) and floors["decode_host_ms_max"] == pytest.approx(3.0)
    assert _step_floors(llm, stats[:1], copy_gbs) == {}


def test_steps_with_prefill_chunks_count_their_prompt_tokens_over_their_own_time():
    stats = [
        StepStats(0, 300, 0, 3, 0.010, 0.030),
        StepStats(5, 0, 100, 3, 0.001, 0.500),  # a decode step: not counted
        StepStats(2, 100, 50, 5, 0.020, 0.010),
    ]
    steps = _prefill_steps(stats)
    assert steps["prefill_steps"] == 2 and steps["prefill_step_ms"] == pytest.approx(20.0)
    assert steps["prefill_tok_s_in_steps"] == pytest.approx(400 / 0.040)
    assert steps["prefill_host_ms_mean"] == pytest.approx(15.0)
    assert _prefill_steps(stats[1:2]) == {}


def test_percentiles_show_the_few_slow_steps_a_mean_hides():
    cuts = _percentiles("step_ms", [0.001] * 95 + [0.050] * 5)
    assert cuts["step_ms_p50"] == pytest.approx(1.0) and cuts["step_ms_p90"] == pytest.approx(1.0)
    assert cuts["step_ms_max"] == pytest.approx(50.0)
    assert _percentiles("one", [0.002]) == {"one_p50": 2.0, "one_p90": 2.0, "one_max": 2.0}


def test_collections_count_the_full_ones_apart():
    with _Collections() as collected:
        gc.collect(0)
        gc.collect()
    assert collected.full == 1 and 0 < collected.full_s <= collected.all_s
    assert collected._note not in gc.callbacks


def test_a_loads_bound_takes_the_longer_of_its_decodes_bytes_and_their_tokens_at_the_lone_rate(tmp_path):
    llm = LLM(text_model_folder(tmp_path / "tiny"), max_num_seqs=4, max_num_batched_tokens=32, device="cpu")
    weights, per_token = weight_bytes(llm.engine.model), llm.engine.runner.pool.bytes_per_token
    load = [LoadRequest([1] * 10, 8, 0.0) for _ in range(4)]  # 40 prompt tokens, 32 out in 8 steps of 4 rows
    kv = 4 * per_token * (8 * 10 + 8 * 7 / 2)
    lone = 100.0  # tokens a second: prompts take 0.4 s
    slow_copy = (8 * weights + kv) / 1.0  # GB/s at which the decodes' bytes take 1 s, longer than 0.32 s of GEMMs
    assert load_bound(llm, load, lone, slow_copy / 1e9) == pytest.approx(32 / (0.4 + 1.0))
    fast_copy = 1e3 * slow_copy  # bytes in 1 ms: the 32 tokens at the lone rate bound the decodes
    assert load_bound(llm, load, lone, fast_copy / 1e9) == pytest.approx(32 / (0.4 + 0.32))
