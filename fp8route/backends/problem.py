"""The frozen facts a backend's predicate looks at: the GEMM a layer asks for, on which device."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fp8route.device import CPU, DeviceInfo
from fp8route.schemes import Scheme


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
