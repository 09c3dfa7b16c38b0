"""Predicates and plans on fake devices: what runs where, and why the rest does not."""

import logging
import re

import pytest
import torch

from fp8route import (
    BACKENDS,
    M_BOUNDS,
    BackendUnavailableError,
    DeviceInfo,
    Fp8Linear,
    GemmProblem,
    Policy,
    StrictModeError,
    make_plan,
)
from fp8route.backends import CHANNEL, default_priority
from fp8route.quant import FLOAT_DTYPES, quantize_per_tensor

CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def problem(n=4096, k=4096, cap=(9, 0), **kw) -> GemmProblem:
    return GemmProblem(n, k, DeviceInfo.fake_cuda(*cap), **kw)


@pytest.mark.parametrize(
    ("name", "cap", "reason"),
    [
        ("cublas", (8, 6), "needs compute capability >= 8.9 (FP8 tensor cores), device has 8.6"),
        ("cublas", (8, 0), "needs compute capability >= 8.9 (FP8 tensor cores), device has 8.0"),
        ("rowwise", (12, 0), "torch's rowwise kernel is built for SM 8.9, 9.0 and 10.0, device has 12.0"),
        ("rowwise", (8, 6), "needs compute capability >= 8.9 (FP8 tensor cores), device has 8.6"),
    ],
)
def test_capability_reasons(name, cap, reason):
    assert BACKENDS[name].why_not(problem(cap=cap)) == reason


@pytest.mark.parametrize("cap", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_fp8_backends_run_aligned_shapes_on_fp8_gpus(cap):
    assert BACKENDS["cublas"].why_not(problem(cap=cap)) is None
    assert BACKENDS["cublas_fast"].why_not(problem(cap=cap)) is None


@pytest.mark.parametrize(
    ("n", "k", "reason"),
    [(4096, 4100, "K=4100 is not a multiple of 16"), (4104, 4096, "N=4104 is not a multiple of 16")],
)
@pytest.mark.parametrize("name", ["cublas", "cublas_fast", "rowwise"])
def test_unaligned_shapes_are_refused_with_the_dimension(name, n, k, reason):
    assert BACKENDS[name].why_not(problem(n, k)) == reason


def test_rowwise_needs_bf16_output_and_cpu_runs_the_cpu_backends_only():
    assert BACKENDS["rowwise"].why_not(problem(out_dtype=torch.float16)) == "writes bfloat16 output only"
    assert re.search(
        r"rowwise +float16, float32: writes bfloat16 output only", make_plan("l", problem(), Policy()).explain()
    )
    cpu = GemmProblem(4096, 4096)
    assert [n for n, b in BACKENDS.items() if b.why_not(cpu) is None] == ["cpu_dequant", "cpu_tiles", "reference"]
    assert default_priority(cpu.device) == ("cpu_dequant", "cpu_tiles", "reference")
    assert BACKENDS["cublas"].why_not(cpu) == "needs a CUDA GPU, layer is on cpu"


def test_flashinfer_missing_is_a_reason_not_an_exception(monkeypatch):
    monkeypatch.setattr("fp8route.backends.flashinfer.flashinfer_installed", lambda: False)
    assert (
        BACKENDS["flashinfer"].why_not(problem()) == "flashinfer is not installed (pip install 'fp8route[flashinfer]')"
    )


@pytest.mark.parametrize(
    ("cap", "expected"),
    [
        ((8, 0), "weight_only"),
        ((8, 6), "weight_only"),
        ((8, 9), "rowwise"),
        ((9, 0), "cublas"),
        ((10, 0), "cublas"),
        ((12, 0), "cublas"),
    ],
)
def test_default_plans_per_capability(cap, expected):
    plan = make_plan("l", problem(cap=cap), Policy())
    assert {b.name for b in plan.routes[torch.bfloat16]} == {expected}
    assert not plan.fallbacks


@pytest.mark.parametrize("cap", CAPABILITIES)
@pytest.mark.parametrize(("n", "k"), [*LLAMA_8B, (4096, 4100), (1000, 4096), (40, 24)])
@pytest.mark.parametrize("static", [True, False])
def test_every_chosen_backend_can_run_its_bucket_and_finds_its_layout(cap, n, k, static):
    layer = Fp8Linear(torch.empty(n, k, dtype=torch.float8_e4m3fn), 0.01, 0.01 if static else None)
    plan = layer.replan(device=DeviceInfo.fake_cuda(*cap))
    for dtype in FLOAT_DTYPES:
        assert len(plan.routes[dtype]) == len(M_BOUNDS) + 1
        for m_max, backend in zip([*M_BOUNDS, None], plan.routes[dtype]):
            assert backend.why_not(plan.problem.with_bucket(dtype, m_max)) is None
            for layout in backend.layouts:
                assert layout != CHANNEL or layer.prepared.weight_scale_channel is not None
    if CHANNEL in plan.layouts:
        assert layer.prepared.weight_scale_channel.shape == (1, n)
        assert torch.all(layer.prepared.weight_scale_channel == layer.weight_scale)
    else:
        assert layer.prepared.weight_scale_channel is None


def test_unaligned_layer_falls_back_visibly_once(caplog):
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        plans = [make_plan(f"layers.{i}.down", problem(4096, 4108), Policy()) for i in range(3)]
    assert all(p.routes[torch.bfloat16][0].name == "weight_only" for p in plans)
    assert "cublas -> weight_only (K=4108 is not a multiple of 16)" in plans[0].explain()
    assert len([r for r in caplog.records if "N=4096 K=4108" in r.message]) == 1


def test_strict_mode_raises_instead_of_falling_back(monkeypatch):
    with pytest.raises(StrictModeError, match="K=4100 is not a multiple of 16"):
        make_plan("layers.0.down", problem(4096, 4100), Policy(strict=True))
    monkeypatch.setenv("FP8ROUTE_STRICT", "1")
    with pytest.raises(StrictModeError, match="layers.0.down"):
        make_plan("layers.0.down", problem(4096, 4100), Policy.from_env())
    make_plan("layers.0.down", problem(4096, 4096), Policy.from_env())  # nothing to fall back from


def test_force_and_disable_from_the_environment(monkeypatch):
    monkeypatch.setenv("FP8ROUTE_FORCE", "rowwise")
    plan = make_plan("l", problem(), Policy.from_env())
    assert plan.routes[torch.bfloat16][0].name == "rowwise"
    assert "forced by FP8ROUTE_FORCE=rowwise" in plan.explain()
    # rowwise cannot write float16: that dtype falls back, and says so.
    assert plan.routes[torch.float16][0].name == "cublas"
    assert any(f.dtype == torch.float16 and f.wanted == "rowwise" for f in plan.fallbacks)
    monkeypatch.delenv("FP8ROUTE_FORCE")
    monkeypatch.setenv("FP8ROUTE_DISABLE", "cublas, flashinfer")
    plan = make_plan("l", problem(), Policy.from_env())
    assert plan.routes[torch.bfloat16][0].name == "rowwise"
    assert any(e.backend == "cublas" and str(e) == "disabled by FP8ROUTE_DISABLE" for e in plan.excluded)
    # Without cublas, float16 has no FP8 kernel left on this device: a visible fallback.
    assert [(f.dtype, f.used) for f in plan.fallbacks] == [
        (torch.float16, "weight_only"),
        (torch.float32, "weight_only"),
    ]


def test_forcing_a_backend_that_cannot_run_the_layer_is_a_clear_error():
    with pytest.raises(
        BackendUnavailableError, match=r"FP8ROUTE_FORCE=cublas cannot run it: K=4100 is not a multiple of 16"
    ):
        make_plan("layers.3.mlp.down_proj", problem(4096, 4100), Policy(force="cublas"))
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        make_plan("l", GemmProblem(64, 64), Policy(force="cublas"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"force": "cutlass"}, "unknown backend 'cutlass'"),
        ({"disable": frozenset({"reference"})}, "cannot be disabled"),
        ({"force": "cublas", "disable": frozenset({"cublas"})}, "both forced and disabled"),
    ],
)
def test_bad_policies(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Policy(**kwargs)


def test_forward_reads_the_bucket_from_the_plan():
    plan = make_plan(
        "l", problem(), Policy(), preference=lambda p: "cublas_fast" if p.m_max is None or p.m_max > 512 else None
    )
    assert plan.backend_for(1, torch.bfloat16).name == "cublas"
    assert plan.backend_for(512, torch.bfloat16).name == "cublas"
    assert plan.backend_for(513, torch.bfloat16).name == "cublas_fast"
    assert plan.backend_for(10**6, torch.bfloat16).name == "cublas_fast"
    assert "M 1-512 -> cublas; M 513+ -> cublas_fast" in plan.explain()


def test_missing_input_scale_plans_dynamic_quantization():
    plan = make_plan("l", problem(static_input_scale=False), Policy())
    assert "dynamic input scale" in plan.explain()
    assert plan.routes[torch.bfloat16][0].name == "cublas"


def test_moving_a_layer_replans_it_and_keeps_fp8():
    weight, scale = quantize_per_tensor(torch.randn(32, 64))
    layer = Fp8Linear(weight, scale, 0.01, torch.zeros(32))
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.dtype == torch.float32 and layer.input_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16


def test_a_layer_asks_for_x_quantized_upstream_only_where_its_backend_reads_it_so(monkeypatch):
    """Fp8Linear.x_quant, with the kernel option quantize_upstream on: a static per-tensor scale handed
    over with the ask (cublas reads it), the dynamic per-tensor one never (the batch's amax); per group for
    the block GEMMs; none on a CPU, whose backends quantize x themselves. explain names the routes that
    take it. With the option off no layer asks."""
    from routing_helpers import H200

    from fp8route.kernels import options
    from fp8route.kernels.fused_quantize import XQuant
    from fp8route.linear.explain import upstream_line

    monkeypatch.setattr(options, "_current", [options.KernelOptions(quantize_upstream=True)])

    static = Fp8Linear.from_float(torch.randn(256, 256), input_scale=0.02, name="qkv")
    dynamic = Fp8Linear.from_float(torch.randn(256, 256), name="o")
    block = Fp8Linear.from_float(torch.randn(256, 256), scheme="block", name="gate_up")
    assert static.x_quant(16, torch.bfloat16) is None  # a CPU plan: cpu_dequant
    for layer in (static, dynamic, block):
        layer.replan(device=H200)
    spec = static.x_quant(16, torch.bfloat16)
    assert spec == XQuant("tensor") and spec.input_scale is static.input_scale
    assert static.x_quant(16, torch.float32) is None  # the fused kernels read 16-bit x
    assert dynamic.x_quant(16, torch.bfloat16) is None
    # cublas_block (scales M-major, rows padded to 4) where this torch runs its recipe, else triton_block.
    route = block.plan.backend_for(4096, torch.bfloat16).name
    want = XQuant("block", m_major=True, rows=4) if route == "cublas_block" else XQuant("block")
    assert route in ("cublas_block", "triton_block") and block.x_quant(4096, torch.bfloat16) == want
    assert f"cublas (1 layers), {route} (1 layers)" in upstream_line([static, dynamic, block])
    options._current[0] = options.KernelOptions(quantize_upstream=False)
    assert static.x_quant(16, torch.bfloat16) is None
    assert upstream_line([static]) == "x quantized upstream: nowhere (kernel option quantize_upstream off)"
