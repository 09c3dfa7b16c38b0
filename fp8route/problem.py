"""The frozen facts a backend's predicate looks at: the device and the GEMM a layer asks for."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None
    name: str = ""
    rocm: bool = False

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceInfo:
        device = torch.device(device)
        if device.type != "cuda":
            return cls(type=device.type, name=device.type)
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return cls(
            type="cuda",
            capability=(props.major, props.minor),
            name=props.name,
            rocm=torch.version.hip is not None,
        )

    @classmethod
    def fake_cuda(cls, major: int, minor: int, name: str = "fake GPU") -> DeviceInfo:
        """A device for tests and planning on machines that lack it."""
        return cls(type="cuda", capability=(major, minor), name=name)

    @property
    def label(self) -> str:
        if self.capability is None:
            return self.type
        return f"sm{self.capability[0]}{self.capability[1]}"


CPU = DeviceInfo(type="cpu", name="cpu")


@dataclass(frozen=True)
class GemmProblem:
    """y[M, N] = x[M, K] @ w[N, K].T for one layer, one output dtype and one range of M."""

    n: int
    k: int
    device: DeviceInfo = CPU
    out_dtype: torch.dtype = torch.bfloat16
    has_bias: bool = False
    static_input_scale: bool = True
    m_max: int | None = None  # the largest M of the bucket being planned; None means unbounded
    # x arrives already quantized (Fp8Linear.forward_quantized): the GEMM alone, no quantization
    # pass to pay or to fuse, so the fastest backend can differ.
    x_quantized: bool = False

    def with_bucket(self, out_dtype: torch.dtype, m_max: int | None) -> GemmProblem:
        return replace(self, out_dtype=out_dtype, m_max=m_max)

    def with_input(self, x_quantized: bool) -> GemmProblem:
        return replace(self, x_quantized=x_quantized)
