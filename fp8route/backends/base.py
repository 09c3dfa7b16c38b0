"""What every backend is: a name, the operand layouts it reads, one predicate and one call; and the
frozen bundle of tensors a call reads."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8route.backends.problem import GemmProblem
from fp8route.quant import dynamic_scale, quantize

# Operand layouts a layer can hold; the plan prepares exactly those its backends read.
TENSOR = "tensor"  # the e4m3 weight and one fp32 scalar scale: what the checkpoint gives
CHANNEL = "channel"  # the scalar broadcast to (1, N): what rowwise kernels read
# The e4m3 weight upcast to fp32 [N, K], unscaled: what cpu_dequant reads. Not bf16, half the size:
# torch's CPU bf16 matmul writes bf16 (no fp32-output form), one more rounding that took outputs up
# to 1 bf16 ulp off the reference, enough to change a model's greedy tokens. The price is a slower
# CPU decode than a bf16 copy would give.
DEQUANTIZED = "dequantized"
LAYOUTS = frozenset({TENSOR, CHANNEL, DEQUANTIZED})
# What each layout is, as explain names the copy it costs.
LAYOUT_TEXT = {TENSOR: "e4m3 weight", CHANNEL: "(1, N) fp32 weight scale", DEQUANTIZED: "fp32 copy of the weight"}


def layout_bytes(layout: str, n: int, k: int) -> int:
    """The memory a layout adds to a layer [N, K] beyond the checkpoint's tensors."""
    return {TENSOR: 0, CHANNEL: 4 * n, DEQUANTIZED: 4 * n * k}[layout]


@dataclass(frozen=True)
class LinearOperands:
    """The tensors a backend reads for one layer, prepared at load time for the layer's plan."""

    weight: torch.Tensor  # e4m3 [N, K]
    weight_scale: torch.Tensor  # fp32 scalar
    input_scale: torch.Tensor | None  # fp32 scalar; None: dynamic per-tensor from each x
    bias: torch.Tensor | None  # [N]
    weight_scale_channel: torch.Tensor | None = None  # (1, N) fp32, where the plan's layouts name CHANNEL
    weight_dequantized: torch.Tensor | None = None  # fp32 [N, K], where the plan's layouts name DEQUANTIZED

    @classmethod
    def prepare(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        layouts: frozenset[str],
    ) -> LinearOperands:
        channel = weight_scale.reshape(1, 1).repeat(1, weight.shape[0]) if CHANNEL in layouts else None
        dequantized = weight.float() if DEQUANTIZED in layouts else None
        return cls(weight, weight_scale, input_scale, bias, channel, dequantized)


class Backend(ABC):
    name: str
    summary: str
    layouts: frozenset[str] = frozenset({TENSOR})
    fuses_silu_mul: bool = False  # run_silu_mul takes a down projection's gate_up input

    @abstractmethod
    def why_not(self, problem: GemmProblem) -> str | None:
        """None when this backend can run the problem, else a reason a user can act on."""

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        """x is 2-D [M, K] in bf16/fp16/fp32; the result is [M, N] in x's dtype."""
        x_q, x_scale = quantize_input(x, operands.input_scale)
        return self.run_quantized(x_q, x_scale, operands, x.dtype)

    @abstractmethod
    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """x_q is 2-D [M, K] e4m3, quantized with the fp32 scalar x_scale (by run, or upstream of the
        layer); the result is [M, N] in out_dtype."""

    def run_silu_mul(self, gate_up: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        """The layer on SiLU(gate) * up for gate_up [M, 2K] (gate, then up, in x's dtype), the product
        computed inside the GEMM; only where fuses_silu_mul (else the caller computes it first)."""
        raise NotImplementedError(f"{self.name} does not compute SiLU(gate) * up itself")

    def prepare(self, device: torch.device) -> None:
        """Allocate, at load time, what this backend keeps per device (nothing by default), so that
        no call allocates it later inside a CUDA graph being recorded."""
        return None

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def quantize_input(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's static input scale when it has one, else amax/448 computed on the device."""
    scale = input_scale if input_scale is not None else dynamic_scale(x)
    # Eager torch runs the quantizer as four kernels over fp32 temporaries; one Triton pass reads x
    # once. Under torch.compile the torch ops stay, so inductor
    # can fuse them into the op that made x.
    if x.is_cuda and x.dtype != torch.float32 and x.is_contiguous() and not torch.compiler.is_compiling():
        fused = _triton_quantizer()
        if fused is not None:
            return fused(x, scale), scale
    return quantize(x, scale), scale


@functools.cache
def _triton_quantizer() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    from fp8route.kernels.quantize import quantize_fp8
    from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

    return quantize_fp8 if TRITON_IMPORT_ERROR is None else None


def bias_as(operands: LinearOperands, dtype: torch.dtype) -> torch.Tensor | None:
    """The bias in the output dtype, as the fused epilogues want it (no copy when it already is)."""
    return None if operands.bias is None else operands.bias.to(dtype)


def needs_fp8_gpu(problem: GemmProblem) -> str | None:
    device = problem.device
    if device.type != "cuda":
        return f"needs a CUDA GPU, layer is on {device.type}"
    if device.rocm:
        return "ROCm GPUs use float8_e4m3fnuz, which fp8route does not support"
    assert device.capability is not None
    if device.capability < (8, 9):
        major, minor = device.capability
        return f"needs compute capability >= 8.9 (FP8 tensor cores), device has {major}.{minor}"
    return None


def needs_aligned(problem: GemmProblem, multiple: int = 16) -> str | None:
    # torch._scaled_mm checks K % 16 and N % 16 itself; cuBLAS FP8 has no fallback for less.
    if problem.k % multiple:
        return f"K={problem.k} is not a multiple of {multiple}"
    if problem.n % multiple:
        return f"N={problem.n} is not a multiple of {multiple}"
    return None


def first_reason(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r is not None), None)
