"""The frozen facts a backend's predicate looks at: the device and the GEMM a layer asks for."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fp8route.errors import Fp8InputError


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None
    name: str = ""
    rocm: bool = False
    sm_count: int = 0
    l2_bytes: int = 0

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
            sm_count=int(props.multi_processor_count),
            l2_bytes=int(props.L2_cache_size),
        )

    @property
    def identity(self) -> tuple[str, tuple[int, int] | None, int, int]:
        """Which GPU this is, as the routing fingerprint's device fields say it."""
        return (self.name, self.capability, self.sm_count, self.l2_bytes)

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
    m_max: int | None = None  # the largest M of the bucket being planned; None means unbounded
    # x arrives already quantized (Fp8Linear.forward_quantized): the GEMM alone, no quantization
    # pass to pay or to fuse, so the fastest backend can differ.
    x_quantized: bool = False

    def with_bucket(self, out_dtype: torch.dtype, m_max: int | None) -> GemmProblem:
        return replace(self, out_dtype=out_dtype, m_max=m_max)

    def with_input(self, x_quantized: bool) -> GemmProblem:
        return replace(self, x_quantized=x_quantized)
