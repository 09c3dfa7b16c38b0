"""The norm and SiLU-up kernels that quantize their output for the next GEMM, bit for bit against the
unfused pair they replace (the norm or SiLU-up kernel, then the backends' Triton quantizer): codes, scales,
the residual sum, padded rows and the M-major scale layout. On a CPU under Triton's interpreter with
the GPU's conversions (conftest's gpu_conversions).

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_fused_quantize.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from checkpoint_helpers import MODELOPT_HF_QUANT, TINY, fp8_llama, scheme_llama, write_checkpoint
from helpers import GPU_OR_INTERPRETER

from fp8route import Fp8Linear, Policy
from fp8route.checkpoint.formats import compressed_tensors
from fp8route.engine import load_model
from fp8route.kernels import fused, fused_quantize
from fp8route.kernels.fused_quantize import (
    XQuant,
    add_rms_norm_quantized,
    rms_norm_quantized,
    silu_mul_quantized,
)
from fp8route.kernels.launcher import DirectLauncher
from fp8route.kernels.quantize import quantize_fp8, quantize_per_group, quantize_per_token
from fp8route.models import llama

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = GPU_OR_INTERPRETER
SCALE = torch.tensor(0.02, device=DEVICE)  # a static per-tensor input scale
SPECS = [XQuant("tensor", input_scale=SCALE), XQuant("block"), XQuant("block", m_major=True, rows=4), XQuant("channel")]
SHAPES = [(1, 1, 256), (1, 5, 320), (2, 3, 4096)] + ([(1, 37, 14336)] if CUDA else [])


@pytest.fixture(autouse=True)
def kernels_on_cpu_tensors(monkeypatch: pytest.MonkeyPatch, gpu_conversions):
    """Under the interpreter the tensors are on the CPU, where every function takes its torch path:
    send them to the kernels (the unfused pair's too). On either device, fail a test whose fused call
    ran none."""
    if not CUDA:
        half = lambda x: x.dtype in (torch.bfloat16, torch.float16)  # noqa: E731
        monkeypatch.setattr(fused_quantize, "fusable", half)
        monkeypatch.setattr(llama, "fusable", half)
        monkeypatch.setattr(fused, "_use_kernel", half)
    ran = []
    launch = DirectLauncher.__call__
    monkeypatch.setattr(DirectLauncher, "__call__", lambda self, *a: ran.append(self.fn) or launch(self, *a))
    yield
    assert any(fn.__name__ in ("_norm_quant_kernel", "_silu_mul_quant_kernel") for fn in ran), "no fused kernel ran"


def unfused(x: torch.Tensor, spec: XQuant) -> fused_quantize.QuantizedX:
    """x quantized as a backend's own quantizer does it (fp8route.kernels.quantize: Triton, whose scales
    divide correctly rounded, where torch on a GPU multiplies by the reciprocal), rows padded."""
    rows = x.reshape(-1, x.shape[-1])
    rows = torch.nn.functional.pad(rows, (0, 0, 0, -(-rows.shape[0] // spec.rows) * spec.rows - rows.shape[0]))
    if spec.scheme == "tensor":
        return fused_quantize.QuantizedX(quantize_fp8(rows, spec.input_scale), spec.input_scale, x.shape, x.dtype)
    if spec.scheme == "channel":
        return fused_quantize.QuantizedX(*quantize_per_token(rows), x.shape, x.dtype)
    return fused_quantize.QuantizedX(*quantize_per_group(rows, m_major=spec.m_major), x.shape, x.dtype)


def same(got: fused_quantize.QuantizedX, want: fused_quantize.QuantizedX) -> None:
    assert got.shape == want.shape and got.q.shape == want.q.shape
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(got.scale, want.scale) and got.scale.stride() == want.scale.stride()


def make(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_norm_quantized_is_the_norm_then_the_quantizer(spec, shape):
    x, w = make(shape, 1), make(shape[-1:], 2)
    same(rms_norm_quantized(x, w, 1e-5, spec), unfused(fused.rms_norm(x, w, 1e-5), spec))


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_add_and_norm_quantized_is_the_add_the_norm_then_the_quantizer(spec, shape):
    x, r, w = make(shape, 1), make(shape, 3), make(shape[-1:], 2)
    got, total = add_rms_norm_quantized(x, r, w, 1e-5, spec)
    normed, want_total = fused.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, want_total)
    same(got, unfused(normed, spec))


@pytest.mark.parametrize("spec", SPECS[:3], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_silu_up_quantized_statically_or_per_group_is_silu_up_then_the_quantizer(spec, shape):
    width = shape[-1]
    gate_up = make((*shape[:-1], 2 * width), 4)
    same(silu_mul_quantized(gate_up, width, spec), unfused(fused.silu_mul(gate_up, width), spec))


def test_padded_rows_are_zero_codes_with_the_smallest_scale():
    x, w = make((1, 5, 256), 1), make((256,), 2)
    got = rms_norm_quantized(x, w, 1e-5, XQuant("block", m_major=True, rows=4))
    assert got.q.shape == (8, 256) and got.rows == 5
    assert not got.q[5:].view(torch.uint8).any()
    assert torch.all(got.scale[5:] == 1e-12)
    assert got.scale.stride() == (1, 8)  # M-contiguous


# Whole 128-column groups and a 128-wide head, as the block scheme's real checkpoints have; K a multiple
# of 512 everywhere, as cuBLASLt's block recipe takes it.
BLOCKY = {**TINY, "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 512}
# On a GPU each case's linears run a backend that reads x quantized as its spec says (at these ten
# rows the plan would route to fp8_gemv, which quantizes inside, and nothing would be fused).
READS = {"tensor": "cublas", "channel": "rowwise", "block": "triton_block", "block m_major": "cublas_block"}
PROMPT = torch.tensor([[5, 17, 3, 99, 42], [8, 1, 250, 30, 2]])


@pytest.mark.parametrize(
    ("scheme", "spec"),
    [
        ("tensor", XQuant("tensor")),
        ("block", XQuant("block", m_major=True, rows=4)),
        ("block", XQuant("block")),
        ("channel", XQuant("channel")),
    ],
    ids=str,
)
def test_a_model_whose_linears_read_x_quantized_upstream_gives_the_same_logits(tmp_path, monkeypatch, scheme, spec):
    """With the kernel option quantize_upstream on, the norms before qkv and gate_up, and SiLU-up before
    down (not per token), hand their linears x quantized where the linears' backends ask for it
    (Fp8Linear.x_quant): the logits are the bits of the model whose linears quantize x themselves. On a
    GPU the asks of a backend forced to read x as spec says; on a CPU, whose backends quantize x
    themselves, every layer asks for spec (cpu_dequant reads any quantized x)."""
    if scheme == "tensor":  # static input scales (ModelOpt's FP8)
        folder = write_checkpoint(
            tmp_path, fp8_llama(config=BLOCKY), BLOCKY, **{"hf_quant_config.json": MODELOPT_HF_QUANT}
        )
    else:
        qc = compressed_tensors.quantization_config(["lm_head"], scheme=scheme)
        folder = write_checkpoint(tmp_path, scheme_llama(scheme, BLOCKY), {**BLOCKY, "quantization_config": qc})

    force = READS[scheme + (" m_major" if spec.m_major else "")]

    def logits(upstream: bool) -> torch.Tensor:
        model = load_model(
            folder, device=DEVICE, dtype=torch.bfloat16, max_num_seqs=2, max_model_len=16, num_kv_blocks=8,
            quiet=True, quantize_upstream=upstream, policy=Policy(force=force) if CUDA else None,
        )  # fmt: skip
        return model(PROMPT.to(DEVICE))

    unfused = logits(False)
    asked = []
    if not CUDA:

        def ask(self: Fp8Linear, m: int, dtype: torch.dtype) -> XQuant:
            asked.append(self.name)
            return replace(spec, input_scale=self.input_scale) if scheme == "tensor" else spec

        monkeypatch.setattr(Fp8Linear, "x_quant", ask)
    fused_run = logits(True)
    if not CUDA:
        assert any("qkv_proj" in n for n in asked) and any("gate_up_proj" in n for n in asked)
        assert any("down_proj" in n for n in asked)
    assert torch.equal(fused_run, unfused)
