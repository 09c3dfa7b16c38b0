"""Fakes for routing tests: a fingerprint, an H200 that is not there, tables built by hand."""

from __future__ import annotations

from dataclasses import replace

import torch

from fp8route.device import DeviceInfo
from fp8route.routing import Fingerprint, RoutingTable, ShapeRoutes, Timing

H200 = DeviceInfo.fake_cuda(9, 0, "NVIDIA H200")
H100 = DeviceInfo.fake_cuda(9, 0, "NVIDIA H100 80GB HBM3")
FP = Fingerprint(
    gpu="NVIDIA H200",
    capability="9.0",
    sm_count=132,
    l2_bytes=60 * 2**20,
    driver="570.86.15",
    cuda="13.0",
    cublas="130100",
    torch="2.11.0+cu130",
    triton="3.5.0",
    flashinfer="absent",
    fp8route="0.1.0",
)
BOUNDS = (1, 16, 256)


def shape(
    n: int, k: int, routes: list[str | None], dtype: torch.dtype = torch.bfloat16, times: dict | None = None
) -> ShapeRoutes:
    """routes: one per bound plus the open bucket; times: backend -> one median per bound."""
    times = times or {name: [10.0] * len(BOUNDS) for name in {r for r in routes if r}}
    timings = {name: tuple(Timing(t, 0.0) if t is not None else None for t in per_m) for name, per_m in times.items()}
    return ShapeRoutes(n, k, dtype, tuple(routes), timings)


def table(*shapes: ShapeRoutes, fingerprint: Fingerprint = FP, origin: str = "") -> RoutingTable:
    return RoutingTable(fingerprint, BOUNDS, shapes, created="2026-01-01T00:00:00+00:00", command="test", origin=origin)


def other(**changes: object) -> Fingerprint:
    return replace(FP, **changes)  # type: ignore[arg-type]


# The backends these tests were written against; any backend added later (or flashinfer where it
# is installed) is made unable to run here, so the expected routes do not depend on the registry.
CORE_BACKENDS = ("cublas", "cublas_fast", "rowwise", "weight_only", "reference")


def only_core_backends(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from fp8route.backends import BACKENDS

    for name, backend in BACKENDS.items():
        if name not in CORE_BACKENDS:
            monkeypatch.setattr(backend, "why_not", lambda problem, name=name: f"{name} is left out of this test")
