"""The ops are opaque to torch.compile and pass torch.library.opcheck."""

import pytest
import torch
from helpers import random_fp8_operands
from torch import nn

from fp8route import Fp8Linear
from fp8route.backends import custom_ops as ops


class Mlp(nn.Module):
    def __init__(self, dynamic_scale: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        scale = None if dynamic_scale else 0.02
        self.up = Fp8Linear.from_float(nn.Linear(64, 128), input_scale=scale, name="up")
        self.down = Fp8Linear.from_float(nn.Linear(128, 64, bias=False), input_scale=scale, name="down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture
def emulate_precision_casts():
    """Inductor keeps fused bf16 intermediates in fp32; eager rounds them, and the rounded gelu
    output then quantizes to other fp8 values. Emulating eager's casts makes the two agree.
    config.patch restores what it found; pytest 9's monkeypatch.undo deletes the attribute of this
    config module instead, which broke every later compile in the session."""
    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield


@pytest.mark.parametrize("dynamic_scale", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_mlp_equals_eager_without_graph_breaks(dynamic_scale, dtype, emulate_precision_casts):
    torch._dynamo.reset()
    model = Mlp(dynamic_scale).to(dtype)
    x = torch.randn(2, 17, 64, dtype=dtype)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    # Traced, each layer is one opaque op (eager calls skip the dispatcher, compiled ones must not).
    assert str(explanation.graphs[0].code).count("torch.ops.fp8route.reference_mm") == 2


def test_quantization_fused_upstream_compiles_without_graph_breaks(emulate_precision_casts):
    # What a model that quantizes inside its activation does: gelu and the e4m3 cast in one
    # inductor kernel, then the routed GEMM on the fp8 tensor.
    torch._dynamo.reset()
    model = Mlp(dynamic_scale=False).to(torch.bfloat16)
    down = model.down

    def mlp_tail(h: torch.Tensor) -> torch.Tensor:
        assert down.input_scale is not None
        h_q = (torch.nn.functional.gelu(h).float() / down.input_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return down.forward_quantized(h_q, torch.bfloat16)

    h = torch.randn(2, 17, 128, dtype=torch.bfloat16)
    eager = mlp_tail(h)
    torch.testing.assert_close(eager, down(torch.nn.functional.gelu(h)), rtol=0, atol=0)
    compiled = torch.compile(mlp_tail, fullgraph=True)(h)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


# opcheck's test_schema compares inputs with torch.allclose, which has no fp8 kernel; the
# schema's "mutates nothing" promise is checked byte for byte in `opcheck` below instead.
_OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args) -> None:
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(op, args, test_utils=_OPCHECK_TESTS)
    op(*args)
    for old, new in zip(before, args):
        if isinstance(old, torch.Tensor):
            assert torch.equal(old.reshape(-1).view(torch.uint8), new.reshape(-1).view(torch.uint8)), (
                "an op mutated an input"
            )


def _operands(m: int = 17, n: int = 32, k: int = 64):
    o = random_fp8_operands(m, n, k)
    x_q = (o["x"] / o["input_scale"]).to(torch.float8_e4m3fn)
    return o, x_q


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_opcheck_scaled_mm_and_reference(bias, out_dtype):
    o, x_q = _operands()
    b = o["bias"].to(out_dtype) if bias else None
    opcheck(ops.scaled_mm_op, (x_q, o["weight"], o["input_scale"], o["weight_scale"], b, out_dtype, False))
    rowwise_scales = (o["input_scale"].reshape(1, 1).repeat(17, 1), o["weight_scale"].reshape(1, 1).repeat(1, 32))
    opcheck(ops.scaled_mm_op, (x_q, o["weight"], *rowwise_scales, b, out_dtype, False))
    opcheck(ops.reference_mm_op, (x_q, o["weight"], o["input_scale"], o["weight_scale"], b, out_dtype))


def test_opcheck_weight_only():
    o, _ = _operands()
    opcheck(ops.weight_only_mm_op, (o["x"].bfloat16(), o["weight"], o["weight_scale"], o["bias"].bfloat16()))
    opcheck(ops.weight_only_mm_op, (o["x"], o["weight"], o["weight_scale"], None))


def test_gpu_only_ops_have_fakes_for_tracing():
    # flashinfer and the Triton kernel need a GPU to run (tests/gpu covers that); their fakes
    # must give the right shape and dtype.
    o, x_q = _operands()
    x_half = o["x"].half()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x_q), mode.from_tensor(o["weight"])
        fs, gs = mode.from_tensor(o["input_scale"]), mode.from_tensor(o["weight_scale"])
        out = ops.flashinfer_bmm_op(fx, fw, fs, gs, torch.bfloat16)
        fused = ops.decode_gemm_op(mode.from_tensor(x_half), fw, gs, fs, None, torch.float16)
        prequantized = ops.decode_gemm_op(fx, fw, gs, fs, None, torch.bfloat16)
    assert out.shape == (17, 32) and out.dtype == torch.bfloat16
    assert fused.shape == (17, 32) and fused.dtype == torch.float16
    assert prequantized.shape == (17, 32) and prequantized.dtype == torch.bfloat16
