"""The frozen facts a backend's predicate looks at: the GEMM a layer asks for, on which device."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fp8route.device import CPU, DeviceInfo
from fp8route.errors import Fp8InputError
from fp8route.schemes import Scheme


def default_device(device: torch.device | str | None = None) -> torch.device:
    """The device given, else CUDA when torch sees a GPU, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise Fp8InputError(f"device {device!r}: not a device torch knows; use cuda, cuda:N or cpu") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise Fp8InputError(f"device {device!r}: torch sees no CUDA GPU on this machine; use cpu")
    return chosen


@dataclass(frozen=True)
class GemmProblem:
    """y[M, N] = x[M, K] @ w[N, K].T for one layer, one output dtype and one range of M."""

    n: int
    k: int
    device: DeviceInfo = CPU
    out_dtype: torch.dtype = torch.bfloat16
    has_bias: bool = False
    static_input_scale: bool = True
    scheme: Scheme = "tensor"  # how the weight and x are scaled (fp8route.schemes)
    m_max: int | None = None  # the largest M of the bucket being planned; None means unbounded
    # x arrives already quantized (Fp8Linear.forward_quantized): the GEMM alone, no quantization
    # pass to pay or to fuse, so the fastest backend can differ.
    x_quantized: bool = False

    def with_bucket(self, out_dtype: torch.dtype, m_max: int | None) -> GemmProblem:
        return replace(self, out_dtype=out_dtype, m_max=m_max)

    def with_input(self, x_quantized: bool) -> GemmProblem:
        return replace(self, x_quantized=x_quantized)
