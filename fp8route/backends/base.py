"""What every backend is: a name, the operand layouts it reads, one predicate and one call; and the
frozen bundle of tensors a call reads."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType

import torch

from fp8route.backends.problem import GemmProblem
from fp8route.kernels.fused_quantize import XQuant
from fp8route.quant import dynamic_scale, quantize
from fp8route.schemes import BLOCK, DESCRIPTION, Scheme, cdiv, dequantize_weight, quantize_activation

# Operand layouts a layer can hold; the plan prepares exactly those its backends read.
TENSOR = "tensor"  # the e4m3 weight and its fp32 scale(s): what the checkpoint gives
CHANNEL = "channel"  # the weight scale as a (1, N) fp32 row: what rowwise kernels read
# The e4m3 weight upcast to fp32 [N, K] (times its block scales in the block scheme, whose scales do
# not factor out of the K sum): what cpu_dequant reads. Not bf16, half the size: torch's CPU bf16
# matmul writes bf16 (no fp32-output form), one more rounding that took outputs up to 1 bf16 ulp off
# the reference, enough to change a model's greedy tokens. The price is a slower CPU decode than a
# bf16 copy would give.
DEQUANTIZED = "dequantized"
# Block scales [ceil(N/128), ceil(K/128)] stored K-contiguous with the K count padded to a multiple
# of 4, handed over as the transposed view: the layout cuBLASLt's 128x128 recipe reads.
BLOCK_KMAJOR = "block_kmajor"
LAYOUTS = frozenset({TENSOR, CHANNEL, DEQUANTIZED, BLOCK_KMAJOR})
# What each layout is, as explain names the copy it costs.
LAYOUT_TEXT = {
    TENSOR: "e4m3 weight",
    CHANNEL: "(1, N) fp32 weight scale",
    DEQUANTIZED: "fp32 copy of the weight",
    BLOCK_KMAJOR: "K-major padded block scales",
}


def layout_bytes(layout: str, n: int, k: int, scheme: Scheme = "tensor") -> int:
    """The memory a layout adds to a layer [N, K] of scheme beyond the checkpoint's tensors."""
    if layout == CHANNEL:
        return 0 if scheme == "channel" else 4 * n  # the channel scheme's own scales, viewed
    if layout == BLOCK_KMAJOR:
        return 4 * cdiv(n, BLOCK) * cdiv(cdiv(k, BLOCK), 4) * 4
    return {TENSOR: 0, DEQUANTIZED: 4 * n * k}[layout]


@dataclass(frozen=True)
class LinearOperands:
    """The tensors a backend reads for one layer, prepared at load time for the layer's plan."""

    weight: torch.Tensor  # e4m3 [N, K]
    weight_scale: torch.Tensor  # fp32: () tensor, [N] channel, [ceil(N/128), ceil(K/128)] block
    input_scale: torch.Tensor | None  # fp32 scalar; None: dynamic (per tensor, token or group by scheme)
    bias: torch.Tensor | None  # [N]
    scheme: Scheme = "tensor"
    weight_scale_channel: torch.Tensor | None = None  # (1, N) fp32, where the plan's layouts name CHANNEL
    weight_dequantized: torch.Tensor | None = None  # fp32 [N, K], where the plan's layouts name DEQUANTIZED
    weight_scale_kmajor: torch.Tensor | None = None  # (ceil(K/128), ceil(N/128)) view, for BLOCK_KMAJOR

    @classmethod
    def prepare(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        layouts: frozenset[str],
        scheme: Scheme = "tensor",
    ) -> LinearOperands:
        """The layouts named that apply to scheme (every layout: what a benchmark of every backend needs)."""
        n = weight.shape[0]
        channel = dequantized = kmajor = None
        if CHANNEL in layouts and scheme != "block":
            channel = weight_scale.reshape(1, n) if scheme == "channel" else weight_scale.reshape(1, 1).repeat(1, n)
        if DEQUANTIZED in layouts:
            dequantized = dequantize_weight(weight, weight_scale, "block") if scheme == "block" else weight.float()
        if BLOCK_KMAJOR in layouts and scheme == "block":
            blocks_n, blocks_k = weight_scale.shape
            padded = weight_scale.new_zeros(blocks_n, cdiv(blocks_k, 4) * 4)
            padded[:, :blocks_k] = weight_scale
            kmajor = padded[:, :blocks_k].t()
        return cls(weight, weight_scale, input_scale, bias, scheme, channel, dequantized, kmajor)


class Backend(ABC):
    name: str
    summary: str
    layouts: frozenset[str] = frozenset({TENSOR})
    schemes: frozenset[str] = frozenset({"tensor"})  # the FP8 schemes (fp8route.schemes) it computes
    # Backends of one family give a row the same bits as each other at every M (each batch-invariant):
    # a batch-invariant route may change among them with M. None: a family of its own.
    bits_family: str | None = None

    @abstractmethod
    def why_not(self, problem: GemmProblem) -> str | None:
        """None when this backend can run the problem, else a reason a user can act on."""

    def batch_variance(self, problem: GemmProblem) -> str | None:
        """None when each output row is computed from its own input row the same way whatever M is
        (the deterministic mode's condition), else why a row's bits can change with the batch."""
        return "its kernel, tiling or split is chosen per M"

    def run(self, x: torch.Tensor, operands: LinearOperands) -> torch.Tensor:
        """x is 2-D [M, K] in bf16/fp16/fp32; the result is [M, N] in x's dtype."""
        x_q, x_scale = quantize_input(x, operands)
        return self.run_quantized(x_q, x_scale, operands, x.dtype)

    @abstractmethod
    def run_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, operands: LinearOperands, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """x_q is 2-D [M, K] e4m3, quantized with the fp32 x_scale (by run, or upstream of the layer):
        a scalar, [M] per token (channel) or [M, ceil(K/128)] per group (block); the result is [M, N]
        in out_dtype."""

    def x_quant(self, scheme: Scheme) -> XQuant | None:
        """How run_quantized reads an x of scheme quantized by the kernel that made x
        (fp8route.kernels.fused_quantize) to the bits run's own quantizer would give (per tensor: with a
        static input scale, which the layer adds); None where the backend quantizes x inside."""
        return None

    def prepare(self, device: torch.device) -> None:
        """Allocate, at load time, what this backend keeps per device (nothing by default), so that
        no call allocates it later inside a CUDA graph being recorded."""
        return None

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def quantize_input(
    x: torch.Tensor, operands: LinearOperands, m_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized as the layer's scheme says: with its static input scale, else dynamically per
    tensor, token or 1x128 group (fp8route.schemes); m_major: group scales stored M-contiguous.

    Eager torch runs a quantizer as several kernels over fp32 temporaries; one Triton pass reads x
    once. Under torch.compile the torch ops stay, so inductor can fuse them into the op that made x."""
    triton_ok = x.is_cuda and x.dtype != torch.float32 and x.is_contiguous() and not torch.compiler.is_compiling()
    kernels = _triton_quantizers() if triton_ok else None
    if operands.scheme == "channel":
        return kernels.quantize_per_token(x) if kernels else quantize_activation(x, "channel")
    if operands.scheme == "block":
        if kernels:
            return kernels.quantize_per_group(x, m_major)
        return _m_major(*quantize_activation(x, "block")) if m_major else quantize_activation(x, "block")
    scale = operands.input_scale if operands.input_scale is not None else dynamic_scale(x)
    return (kernels.quantize_fp8(x, scale) if kernels else quantize(x, scale)), scale


def _m_major(x_q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, groups = scale.shape
    stored = scale.new_zeros(groups, cdiv(m, 4) * 4)
    stored[:, :m] = scale.t()
    return x_q, stored[:, :m].t()


@functools.cache
def _triton_quantizers() -> ModuleType | None:
    from fp8route.kernels import quantize as kernels
    from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

    return kernels if TRITON_IMPORT_ERROR is None else None


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


def needs_scheme(problem: GemmProblem, schemes: frozenset[str]) -> str | None:
    if problem.scheme in schemes:
        return None
    served = " or ".join(DESCRIPTION[s] for s in ("tensor", "channel", "block") if s in schemes)
    return f"computes {served} only, layer has {DESCRIPTION[problem.scheme]}"


def first_reason(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r is not None), None)
