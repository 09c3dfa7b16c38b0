"""What a routing table was measured on: the GPU and every library whose kernels it timed.

A table is only as good as the match between where it was measured and where it is used: a
different GPU, cuBLAS or Triton build can change which kernel wins, so the fingerprint names
them all and a table whose fingerprint differs from this process's is not trusted.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path

import torch

from fp8route.version import __version__

UNKNOWN = "unknown"
ABSENT = "absent"

DeviceLike = torch.device | str | int | None

# Fields that say which GPU: shipped defaults are matched on these only (see store.py).
DEVICE_FIELDS = ("gpu", "capability", "sm_count", "l2_bytes")


@dataclass(frozen=True)
class Fingerprint:
    gpu: str
    capability: str  # "9.0"; "" off CUDA
    sm_count: int
    l2_bytes: int
    driver: str
    cuda: str
    cublas: str
    torch: str
    triton: str
    flashinfer: str
    fp8route: str

    @classmethod
    def of(cls, device: DeviceLike = None) -> Fingerprint:
        """This process's fingerprint for a CUDA device (the current one by default)."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device)
        libraries = dict(
            torch=torch.__version__,
            triton=_version("triton"),
            flashinfer=_version("flashinfer-python", "flashinfer"),
            fp8route=__version__,
        )
        if device.type != "cuda":
            return cls(device.type, "", 0, 0, ABSENT, ABSENT, ABSENT, **libraries)
        props = torch.cuda.get_device_properties(device)
        with torch.cuda.device(device):
            torch.cuda.current_blas_handle()  # cuBLAS loaded and initialised, so its version can be asked
        return cls(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=int(props.multi_processor_count),
            l2_bytes=int(props.L2_cache_size),
            driver=_driver_version(),
            cuda=str(torch.version.cuda or torch.version.hip or UNKNOWN),
            cublas=_cublas_version(),
            **libraries,
        )

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: object) -> Fingerprint:
        if not isinstance(obj, dict):
            raise ValueError(f"fingerprint must be an object, got {type(obj).__name__}")
        missing = [f.name for f in fields(cls) if f.name not in obj]
        if missing:
            raise ValueError(f"fingerprint lacks {', '.join(missing)}")
        values = {f.name: obj[f.name] for f in fields(cls)}
        for name in ("sm_count", "l2_bytes"):
            if not isinstance(values[name], int):
                raise ValueError(f"fingerprint.{name} must be an integer, got {values[name]!r}")
        for f in fields(cls):
            if f.name not in ("sm_count", "l2_bytes") and not isinstance(values[f.name], str):
                raise ValueError(f"fingerprint.{f.name} must be a string, got {values[f.name]!r}")
        return cls(**values)

    def differences(self, other: Fingerprint, only: tuple[str, ...] | None = None) -> list[str]:
        """'field: this vs other' for every field (or every field in `only`) that differs."""
        names = only or tuple(f.name for f in fields(self))
        return [
            f"{n} {getattr(self, n)!r} vs {getattr(other, n)!r}" for n in names if getattr(self, n) != getattr(other, n)
        ]

    @property
    def slug(self) -> str:
        """A file-name-safe device name: 'NVIDIA H200' -> 'h200'."""
        name = re.sub(r"^nvidia\s+", "", self.gpu.strip(), flags=re.IGNORECASE).lower()
        return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "device"

    def summary(self) -> str:
        return (
            f"{self.gpu} (sm {self.capability}, {self.sm_count} SMs, L2 {self.l2_bytes >> 20} MiB), "
            f"driver {self.driver}, CUDA {self.cuda}, cuBLAS {self.cublas}, torch {self.torch}, triton {self.triton}, "
            f"flashinfer {self.flashinfer}, fp8route {self.fp8route}"
        )


def _version(*distributions: str) -> str:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ABSENT


def _driver_version() -> str:
    # The kernel module's version is what changes with a driver upgrade; the CUDA driver API
    # number torch exposes only changes with the CUDA major.minor the driver supports.
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+(?:\.\d+)+)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        return f"cuda-driver-api {torch._C._cuda_getDriverVersion()}"  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return UNKNOWN


def _cublas_version() -> str:
    """The cuBLASLt torch has loaded (asked of the library itself), else the pip wheel's version."""
    major = (torch.version.cuda or "").split(".")[0]
    # RTLD_NOLOAD: only a library already in the process, so never a different system copy.
    for soname in (f"libcublasLt.so.{major}", "libcublasLt.so"):
        try:
            lib = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            return str(lib.cublasLtGetVersion())
        except (OSError, AttributeError):
            continue
    return _version(f"nvidia-cublas-cu{major}", "nvidia-cublas") if major else UNKNOWN
