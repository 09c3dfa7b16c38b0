"""`fp8route bench gemm`: every policy (routed and each single backend) per shape and M, timed
the same way, with the ceilings measured in the same run, written as JSON and PNG."""

from __future__ import annotations

import functools
import gc
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fp8route.backends import BACKENDS, last_resorts
from fp8route.device import DeviceInfo
from fp8route.models.shapes import LayerShape
from fp8route.progress import Progress
from fp8route.routing.fingerprint import Fingerprint
from fp8route.routing.table import RoutingTable
from fp8route.schemes import Scheme
from fp8route.tuning.ceilings import Ceilings
from fp8route.tuning.plot import plot_rowwise, plot_speedups
from fp8route.tuning.report import ROUTED, Cell, GemmReport
from fp8route.tuning.timing import steadiest
from fp8route.tuning.workload import Run, TimeArms, Workload, backend_run, prequantized, routed_run


def default_policies(device: DeviceInfo) -> list[str]:
    """routed, and every backend that is more than a last resort on this device."""
    return [ROUTED, *(name for name in BACKENDS if name not in last_resorts(device))]


def sweep(
    shapes: Sequence[LayerShape],
    m_values: Sequence[int],
    policies: Sequence[str],
    *,
    table: RoutingTable | None,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 30,
    reps: int = 2,
    progress: Progress | None = None,
    copies: int | None = None,
    timer: TimeArms | None = None,
    x_quantized: bool = False,
    scheme: Scheme = "tensor",
) -> list[Cell]:
    """One Cell per (shape, M, policy). Routed runs the layer's forward, planned with table.
    x_quantized: every arm gets x already quantized (the quantization fused upstream), so each
    times its GEMM alone. (copies and timer are for running it on CPU in tests.)"""
    cells: list[Cell] = []
    total, done = len(shapes) * len(m_values), 0
    for shape in shapes:
        workload = Workload(
            shape.n, shape.k, dtype=dtype, device=device, preference=table, copies=copies, scheme=scheme
        )
        for m in m_values:
            if progress:
                progress(done, total, f"{shape.label} M={m}")
            problem = workload.problem(m)
            runs: dict[str, Run] = {}
            x_q = workload.x_quantized(m) if x_quantized else None
            for policy in policies:
                if policy == ROUTED:
                    runs[policy] = routed_run if x_q is None else prequantized(ROUTED, x_q)
                    continue
                reason = BACKENDS[policy].why_not(problem)
                if reason is None:
                    runs[policy] = backend_run(policy) if x_q is None else prequantized(policy, x_q)
                else:
                    cells.append(Cell(shape, m, policy, None, error=f"not eligible: {reason}"))
            routed_backend = workload.copies[0].layer.plan.backend_for(m, dtype, x_quantized).name
            timed = steadiest(functools.partial(workload.time, runs, m, repeats=repeats, reps=reps, timer=timer))
            kernels = workload.kernels({a: runs[a] for a, r in timed.items() if not isinstance(r, str)}, m)
            for arm, result in timed.items():
                backend = routed_backend if arm == ROUTED else None
                if isinstance(result, str):
                    cells.append(Cell(shape, m, arm, None, error=result, backend=backend))
                else:
                    times = (result.median_us, result.spread, result.rep_medians_us)
                    cells.append(Cell(shape, m, arm, *times, backend=backend, kernels=kernels[arm]))
            done += 1
        del workload
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if progress:
        progress(done, total, "done")
    return cells


def write_results(
    report: GemmReport,
    out_dir: Path,
    stem: str,
    *,
    fingerprint: Fingerprint,
    table: RoutingTable | None,
    meta: dict[str, Any],
) -> list[Path]:
    """stem.json (every number and the command), stem-speedup.png and stem-rowwise.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        **meta,
        "fingerprint": fingerprint.to_json(),
        "routing_table": None
        if table is None
        else {"origin": table.origin, "fingerprint": table.fingerprint.to_json()},
        **report.to_json(),
    }
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    written = [json_path]
    title = f"{meta.get('model', stem)} on {fingerprint.gpu}"
    for path in (
        plot_speedups(report, out_dir / f"{stem}-speedup.png", f"speedup of routed over each single backend: {title}"),
        plot_rowwise(report, out_dir / f"{stem}-rowwise.png", f"per-tensor cuBLASLt vs rowwise CUTLASS: {title}"),
    ):
        if path is not None:
            written.append(path)
    return written


def make_report(
    cells: Sequence[Cell], shapes: Sequence[LayerShape], m_values: Sequence[int], ceilings: Ceilings, dtype: torch.dtype
) -> GemmReport:
    return GemmReport(cells, shapes, m_values, ceilings, act_bytes=torch.empty((), dtype=dtype).element_size())
