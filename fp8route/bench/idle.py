"""How busy the engine keeps the GPU: host time per step, and the GPU's idle time between steps.

For a batch of B requests that all decode (short prompts, long outputs, EOS ignored), the engine runs
to steady state, then torch's profiler (CUPTI) records every kernel and copy of a number of steps: the
GPU's idle share is 1 - (the union of their intervals) / (first start to last end). The same for a
stretch of mixed steps (new prompts arriving while B decode). Host time per step is the engine's own
accounting (StepStats.host_s: scheduling, inputs and launches, and the bookkeeping of the step read
back in the same call).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from fp8route.bench.serve import sampling_params
from fp8route.bench.workload import LoadRequest
from fp8route.engine.llm import LLM
from fp8route.engine.sampling import SamplingParams

MIXED_ARRIVALS = 8  # prompts of 512 tokens that arrive at the start of a mixed stretch


def idle_share(spans: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(idle share, span) of device intervals (start, end): 1 - their union over first start to last end."""
    ordered = sorted((s, e) for s, e in spans if e > s)
    if not ordered:
        return float("nan"), 0.0
    first, last = ordered[0][0], max(e for _, e in ordered)
    busy, (start, end) = 0.0, ordered[0]
    for s, e in ordered[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return 1 - busy / (last - first), last - first


def _steady(llm: LLM, batch: int, steps: int, arrivals: int, sampling: str) -> None:
    """`batch` requests decoding past their first tokens (each with `sampling`'s params, as bench
    serve's arm of that name has them), then `arrivals` new prompts waiting."""
    engine, vocab = llm.engine, llm.engine.model.cfg.vocab_size
    load = LoadRequest([], steps * 4 + 64, 0.0)
    for index in range(batch):
        params = sampling_params(sampling, load, index)
        engine.add_request(torch.randint(0, vocab, (128,)).tolist(), params)
    while any(r.num_output_tokens < 8 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(arrivals):
        engine.add_request(torch.randint(0, vocab, (512,)).tolist(), SamplingParams(max_tokens=8, ignore_eos=True))


# Host calls that wait for the GPU, or allocate what a step should have had already: any of them in a
# step the host prepares while the GPU runs the step before stalls it (issue 47's mixed steps).
BLOCKING = ("Synchronize", "aten::item", "aten::_local_scalar_dense", "cudaMemcpy", "cudaHostAlloc", "cudaFreeHost",
            "cudaMalloc", "cudaFree", "aten::nonzero")  # fmt: skip


def measure(
    llm: LLM, batch: int, steps: int, arrivals: int, sampling: str = "greedy", host: Path | None = None
) -> dict[str, Any]:
    """Profile `steps` steps from steady state; the requests are aborted after. host: also record the
    host's side (torch ops and CUDA runtime calls, with shapes), write its Chrome trace there and name
    what holds the host (host_holders)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    _steady(llm, batch, steps, arrivals, sampling)
    engine.stats.clear()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host is not None else [])
    with profile(activities=activities, record_shapes=host is not None) as trace:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    stats = list(engine.stats)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.drain()
    cuda = torch.autograd.DeviceType.CUDA
    idle, span_us = idle_share((e.time_range.start, e.time_range.end) for e in trace.events() if e.device_type == cuda)
    row: dict[str, Any] = {
        "batch": batch, "steps": len(stats), "mixed_steps": sum(1 for s in stats if s.prefill_tokens), "idle": idle,
        "step_ms": span_us / 1e3 / len(stats), "host_us": 1e6 * statistics.median(s.host_s for s in stats),
        "wall_us": 1e6 * statistics.median(s.wall_s for s in stats),
    }  # fmt: skip
    if host is not None:
        host.mkdir(parents=True, exist_ok=True)
        trace.export_chrome_trace(str(host / f"idle-b{batch}-{arrivals}-{sampling}.json"))
        row["holders"] = host_holders(trace.key_averages(), len(stats))
    return row


def host_holders(averages: Iterable[Any], steps: int, most: int = 12) -> list[tuple[str, float, float, bool]]:
    """What the host spent a step on: (name, calls a step, self ms a step, whether it can wait for the
    GPU) of the host-side ops and runtime calls with the most self time, every BLOCKING one included."""
    rows = []
    for event in averages:
        if event.device_type != torch.autograd.DeviceType.CPU or event.self_cpu_time_total <= 0:
            continue
        blocking = any(b in event.key for b in BLOCKING)
        rows.append((event.key, event.count / steps, event.self_cpu_time_total / 1e3 / steps, blocking))
    rows.sort(key=lambda r: -r[2])
    return [r for i, r in enumerate(rows) if i < most or r[3]]


def holders_text(row: dict[str, Any]) -> str:
    """host_holders of one measurement as lines, the ones that can wait for the GPU marked."""
    lines = [f"host per step, {row['kind']} {row['sampling']} batch {row['batch']} (self ms; * can wait for the GPU):"]
    for name, calls, ms, blocking in row["holders"]:
        lines.append(f"  {'*' if blocking else ' '} {ms:8.3f} ms  {calls:7.1f} calls  {name}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """One markdown row per (kind, sampling, batch)."""
    lines = [
        "| steps | sampling | batch | n | mixed | GPU idle | step ms | host us (median) | wall us (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['sampling']} | {r['batch']} | {r['steps']} | {r['mixed_steps']} | "
            f"{100 * r['idle']:.1f}% | {r['step_ms']:.2f} | {r['host_us']:.0f} | {r['wall_us']:.0f} |"
        )
    return "\n".join(lines)
