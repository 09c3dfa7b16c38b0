"""Every GEMM backend fp8route can route a layer to, by name."""

from __future__ import annotations

from fp8route.backends.base import BLOCK_KMAJOR, CHANNEL, DEQUANTIZED, LAYOUTS, TENSOR, Backend, LinearOperands
from fp8route.backends.block import CublasBlockBackend, FlashinferBlockBackend, TritonBlockBackend
from fp8route.backends.cpu_dequant import CpuDequantBackend, CpuTilesBackend
from fp8route.backends.cublas import CublasBackend
from fp8route.backends.fixed import FixedTilesBackend
from fp8route.backends.flashinfer import FlashinferBackend
from fp8route.backends.fp8_gemv import Fp8GemvBackend
from fp8route.backends.reference import ReferenceBackend
from fp8route.backends.rowwise import RowwiseBackend
from fp8route.backends.weight_only import WeightOnlyBackend
from fp8route.device import DeviceInfo
from fp8route.kernels.fixed_gemm import TILINGS

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        CublasBackend(),
        CublasBackend(fast_accum=True),
        RowwiseBackend(),
        FlashinferBackend(),
        Fp8GemvBackend(),
        CublasBlockBackend(),
        TritonBlockBackend(fused=False),
        TritonBlockBackend(fused=True),
        FlashinferBlockBackend(),
        WeightOnlyBackend(),
        *(FixedTilesBackend(name, tiles) for name, tiles in TILINGS.items()),
        CpuDequantBackend(),
        CpuTilesBackend(),
        ReferenceBackend(),
    )
}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}") from None


def last_resorts(device: DeviceInfo) -> frozenset[str]:
    """Backends that run where nothing better can: choosing one of these is a fallback."""
    if device.type != "cuda" or device.capability is None:
        return frozenset()
    if device.capability < (8, 9):
        return frozenset({"reference"})
    return frozenset({"weight_only", "reference"})


def default_priority(device: DeviceInfo) -> tuple[str, ...]:
    """The order to try backends in until a measured routing table says otherwise."""
    if device.type == "cpu":
        # cpu_dequant dequantizes each weight once; the reference does it on every call, several
        # times slower than bf16. cpu_tiles pads small batches: the deterministic mode's, which
        # excludes cpu_dequant.
        return ("cpu_dequant", "cpu_tiles", "reference")
    if device.type != "cuda" or device.capability is None:
        return ("reference",)
    if device.capability < (8, 9):
        return ("weight_only", "reference")
    if device.capability == (8, 9):
        # SGLang measured per-tensor cuBLASLt 5.4% slower end to end than rowwise CUTLASS on an L40.
        return ("rowwise", "cublas", "flashinfer", "weight_only", "reference")
    # SM90+: per-tensor cuBLASLt beat rowwise CUTLASS at every M on 8B shapes (DESIGN.md). The other
    # schemes' library kernels come before our Triton ones until a measured routing table says otherwise
    # (the channel scheme's rowwise is vLLM's pick too; vLLM's block picks, DeepGEMM and its own
    # CUTLASS build, do not run here: benchmarks/results/h200/schemes/).
    # The triton_fixed tilings are the deterministic mode's (the backends whose rows do not depend on M):
    # after weight_only, so that without the mode nothing changes until a routing table measures them.
    return (
        "cublas", "flashinfer", "rowwise", "cublas_block", "triton_block", "weight_only", "triton_fixed",
        "triton_fixed_wide", "triton_fixed_large", "triton_fixed_narrow", "triton_fixed_quantize",
        "triton_fixed_narrow_quantize", "reference",
    )  # fmt: skip


def deterministic_default(device: DeviceInfo, m: int | None) -> str | None:
    """The deterministic mode's backend for M up to m (None: any M) until a routing table measures the
    layer: on SM90 the fixed-tile tiling whose time summed over Llama-3.1-8B's projections was least in
    that range (benchmarks/results/h100/deterministic); elsewhere None, the default priority's first."""
    if device.type != "cuda" or device.capability is None or device.capability < (9, 0):
        return None
    if m is None or m > 512:
        return "triton_fixed_large"
    if m <= 16:
        return "triton_fixed"
    return "triton_fixed_narrow" if m <= 64 else "triton_fixed_wide"


__all__ = [
    "BACKENDS",
    "BLOCK_KMAJOR",
    "CHANNEL",
    "DEQUANTIZED",
    "LAYOUTS",
    "TENSOR",
    "Backend",
    "LinearOperands",
    "default_priority",
    "deterministic_default",
    "get_backend",
    "last_resorts",
]
