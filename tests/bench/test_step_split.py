"""The decode step's split by kernel (fp8route.bench.step_split): the names it sorts, the arithmetic of
one call less another, and bench e2e's table of it. The profiling itself needs a GPU (tests/gpu)."""

import statistics

import pytest

from fp8route.bench import step_split
from fp8route.bench.e2e import E2ERow, as_json, split_table


@pytest.mark.parametrize(
    "kernel,kind",
    [
        ("nvjet_sm90_qqtst_64x8_128x16_4x1_v_bz_algo2_TNT", "gemm"),  # cuBLASLt, the names recorded on the H200
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>", "gemm"),
        ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>", "gemm"),
        ("decode_cuda_core_kernel", "gemm"),
        ("decode_mma_kernel", "gemm"),
        ("fixed_gemm_kernel", "gemm"),
        ("block_gemm_kernel", "gemm"),
        ("_attention_kernel", "attention"),
        ("_split_kernel", "attention"),
        ("_combine_kernel", "attention"),
        ("_merge_kernel", "attention"),
        ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("_rms_norm_kernel", "rest"),
        ("_quantize_kernel", "rest"),
        ("_silu_mul_kernel", "rest"),
        ("_draw_kernel", "rest"),
        ("Memcpy DtoD (Device -> Device)", "rest"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "rest"),
    ],
)
def test_each_kernel_is_sorted_by_what_it_does(kernel, kind):
    assert step_split.kind_of(kernel) == kind


def kernels(named: list[tuple[str, float]], steps: int, gap_ms: float = 0.0) -> list[step_split.Kernel]:
    """The kernels of `steps` steps run back to back, each gap_ms after the one before it."""
    out, start = [], 0.0
    for name, ms in named * steps:
        out.append(step_split.Kernel(name, start, ms))
        start += ms + gap_ms
    return out


def test_a_steps_split_is_its_kernels_summed_by_name_and_kind_per_step():
    step = [("_rms_norm_kernel", 0.05), ("decode_cuda_core_kernel", 1.0), ("_split_kernel", 0.2), ("nvjet_a", 0.5)]
    split = step_split.split_of(kernels(step, 8), 8)
    assert split.kernels == len(step)
    assert split.launches == pytest.approx({"gemm": 2, "attention": 1, "rest": 1})
    assert split.ms == pytest.approx({"gemm": 1.5, "attention": 0.2, "rest": 0.05})
    assert [name for name, _ in split.top][:2] == ["decode_cuda_core_kernel", "nvjet_a"]
    assert step_split.split_of([], 8).total_ms == 0
    assert split.bubble_ms == split.stall_ms == 0


def test_the_idle_between_kernels_is_bubbles_at_boundaries_and_stalls_past_them():
    """0.5 us between kernels is a boundary's bubble; a 1 ms wait once a step is a stall; a kernel that
    starts while a longer one before it still runs (PDL, two streams) leaves no idle."""
    step = [("decode_cuda_core_kernel", 1.0), ("_split_kernel", 0.2)]
    split = step_split.split_of(kernels(step, 4, gap_ms=0.0005), 4)
    assert split.bubble_ms == pytest.approx(2 * 0.0005 * 7 / 8) and split.stall_ms == 0
    spaced = [step_split.Kernel("a", 0.0, 1.0), step_split.Kernel("b", 0.5, 0.1), step_split.Kernel("c", 2.0, 0.1)]
    split = step_split.split_of(spaced, 1)
    assert split.bubble_ms == 0 and split.stall_ms == pytest.approx(1.0)


def tiny_engine(**settings):  # type: ignore[no-untyped-def]
    from checkpoint_helpers import TINY, llama_tensors
    from helpers import build_lm

    from fp8route.engine import EngineConfig
    from fp8route.models import LlamaConfig

    tensors = {k: v.float() for k, v in llama_tensors().items()}
    config = EngineConfig(**{"dtype": "float32", "max_model_len": 64, **settings})
    return build_lm(LlamaConfig.from_hf(TINY), {}, tensors, config).engine


def test_a_kernel_started_early_by_pdl_counts_from_the_end_of_the_one_before_it():
    """With programmatic dependent launch a kernel starts while the one before it runs and waits for it:
    the overlap is the earlier kernel's time, so the kinds sum to the GPU's busy time, not past it."""
    overlapped = [
        step_split.Kernel("fixed_gemm_kernel", 0.0, 1.0),
        step_split.Kernel("_norm_quant_kernel", 0.4, 0.7),  # started early, ran 0.1 ms past the GEMM
        step_split.Kernel("_split_kernel", 0.5, 0.3),  # wholly inside the ones before it
        step_split.Kernel("fixed_gemm_kernel", 1.1, 0.5),
    ]
    split = step_split.split_of(overlapped, 1)
    assert dict(split.top) == pytest.approx({"fixed_gemm_kernel": 1.5, "_norm_quant_kernel": 0.1, "_split_kernel": 0.0})
    assert split.total_ms == pytest.approx(1.6)  # the span, 1.6 ms, with no idle in it
    assert split.kernels == 4 and split.bubble_ms == 0 and split.stall_ms == 0


def test_without_a_gpu_the_steps_are_timed_the_profiler_records_nothing_and_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU here: tests/gpu profiles a real step")
    steps = step_split.measure(tiny_engine(), [[1, 2, 3]])
    assert steps is not None and steps.split is None and steps.wall_ms > 0 and steps.spread >= 0
    row = E2ERow("routed", 1, 1024, 26.0, 39384.0, 3.078, 324.9, 8.03, 2609.0, 0.612)
    assert split_table([row]).startswith("decode step by kernel: not recorded")


def test_a_prompt_the_context_leaves_too_few_steps_is_not_measured():
    engine = tiny_engine()
    context = engine.config.max_model_len
    assert step_split.measure(engine, [list(range(1, context - step_split.TIMED))]) is None
    assert not engine.has_unfinished


def test_a_row_the_profiler_could_see_but_did_not_record_is_named_with_why(monkeypatch):
    import fp8route.bench.e2e as e2e

    monkeypatch.setattr(e2e, "cupti_available", lambda: True)
    row = E2ERow("routed", 64, 4096, 26.0, 39384.0, 9.6, 324.9, 8.03, 2609.0, 0.58)
    lines = split_table([row]).splitlines()
    assert lines[0].startswith("decode step by kernel (") and "largest kernels" not in lines[-1]
    assert lines[-1] == "not recorded for routed 64x4096: the profiler saw none of their kernels"


@pytest.mark.parametrize("lengths", [(30, 20, 10, 25), (30,) * 8], ids=["four", "eight-long"])
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_the_timed_and_profiled_steps_are_decode_steps_of_every_prompt_after_every_prefill(monkeypatch, ahead, lengths):
    # Prompts chunked by a 16-token budget: the first decode while the others still prefill (eight of 30
    # tokens: the first has decoded 16 tokens, a request's default max_tokens, before the last prefilled). The
    # profiler is stood in for by the engine's own record of each step it launched.
    engine = tiny_engine(max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False, record_stats=True,
                         async_scheduling=ahead, max_model_len=96)  # fmt: skip
    profiled = []

    def kernel_times(fn):  # type: ignore[no-untyped-def]
        before = len(engine.stats)
        fn()
        profiled.extend(engine.stats[before:])
        return [step_split.Kernel("decode_cuda_core_kernel", float(i), 1.0) for i in range(len(profiled))]

    monkeypatch.setattr(step_split, "cupti_available", lambda: True)
    monkeypatch.setattr(step_split.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(step_split, "kernel_times", kernel_times)
    prompts = [list(range(1, 1 + n)) for n in lengths]
    steps = step_split.measure(engine, prompts)
    assert len(profiled) == step_split.STEPS
    measured = engine.stats[-step_split.TIMED - step_split.STEPS :]  # timed, then profiled: the last launched
    assert measured[step_split.TIMED :] == profiled
    assert all(s.prefill_tokens == 0 and s.decodes == len(prompts) for s in measured), measured
    assert steps is not None and steps.split is not None and steps.split.kernels == 1 and steps.wall_ms > 0
    # The positions the timed steps' rows attend to, on average: what the engine counted, within a row each.
    counted = statistics.fmean(s.decode_context for s in measured[: step_split.TIMED])
    assert abs(steps.positions - counted) <= len(prompts)
    assert not engine.has_unfinished  # the requests it added are gone


def test_the_table_gives_each_kind_its_share_of_the_measured_step_and_the_gpus_busy_time():
    row = E2ERow(
        "routed", 16, 1024, 287.0, 57093.0, 5.0, 3200.0, 8.03, 2040.0, 0.68,
        gemm_ms=3.5, attention_ms=0.5, rest_ms=0.5, kernels_per_step=420.0,
        top_kernels=(("nvjet_sm90_qqtst_64x8_128x16_4x1_v_bz_algo2_TNT", 1.2), ("_split_kernel", 0.5)), bubble_ms=0.2,
    )  # fmt: skip
    lines = split_table([row]).splitlines()
    assert " ".join(lines[1].split()) == "arm batch input step ms GEMM attention rest bubbles stalls kernels GPU busy"
    row_line = "routed 16 1024 5.000 3.500 70% 0.500 10% 0.500 10% 0.200 4% 0.000 0% 420 90%"
    assert " ".join(lines[2].split()) == row_line
    assert "nvjet_sm90_qqtst_64x8_128x16_4x1_v_bz_algo2_TNT 1.200, _split_kernel 0.500" in lines[-1]
    assert as_json([row])[0]["gemm_ms"] == 3.5


def test_the_table_names_the_rows_it_could_not_profile():
    profiled = E2ERow(
        "routed", 1, 1024, 26.0, 39384.0, 3.0, 324.9, 8.03, 2609.0, 0.612,
        gemm_ms=2.4, attention_ms=0.4, rest_ms=0.2, kernels_per_step=308.0, top_kernels=(("nvjet_a", 1.0),),
    )  # fmt: skip
    missed = E2ERow("routed", 64, 4096, 900.0, 291000.0, 9.0, 7100.0, 8.03, 2000.0, 0.5)
    line = next(line for line in split_table([profiled, missed]).splitlines() if line.startswith("not recorded"))
    assert line.startswith("not recorded for routed 64x4096:") and "1x1024" not in line
