"""How busy the engine keeps the GPU: host time per step, and the GPU's idle time between steps.

For a batch of B requests that all decode (short prompts, long outputs, EOS ignored), the engine runs
to steady state, then torch's profiler (CUPTI) records every kernel and copy of STEPS steps: the
GPU's idle share is 1 - (the union of their intervals) / (first start to last end). The same for a
stretch of mixed steps (new prompts arriving while B decode). Host time per step is the engine's own
accounting (StepStats.host_s: scheduling, inputs and launches, and the bookkeeping of the step read
back in the same call).

    python3 benchmarks/engine_idle.py CHECKPOINT [--batches 64,256] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from fp8route import LLM, SamplingParams
from fp8route.routing.fingerprint import Fingerprint


def gpu_idle(trace: profile) -> tuple[float, float]:
    """(idle share, span in ms) of the device activity the profiler recorded."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in trace.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return float("nan"), 0.0
    busy, (start, end) = 0, spans[0]
    first, last = spans[0][0], max(e for _, e in spans)
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return 1 - busy / (last - first), (last - first) / 1e3


def measure(llm: LLM, batch: int, steps: int, arrivals: int) -> dict[str, float]:
    """Run `batch` decoding requests to steady state, then profile `steps` steps (with `arrivals` new
    prompts of 512 tokens added at the start of the profiled stretch: mixed steps)."""
    engine = llm.engine
    vocab = llm.model.cfg.vocab_size
    params = SamplingParams(max_tokens=steps * 4 + 64, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (128,)).tolist(), params)
    while any(r.num_output_tokens < 8 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(arrivals):
        engine.add_request(torch.randint(0, vocab, (512,)).tolist(), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.stats.clear()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    stats = list(engine.stats)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.drain()
    idle, span_ms = gpu_idle(trace)
    mixed = sum(1 for s in stats if s.prefill_tokens)
    return {
        "batch": batch, "steps": len(stats), "mixed_steps": mixed, "idle": idle, "step_ms": span_ms / len(stats),
        "host_us": 1e6 * statistics.median(s.host_s for s in stats),
        "wall_us": 1e6 * statistics.median(s.wall_s for s in stats),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--batches", default="64,256", help="decoding requests (default 64,256)")
    parser.add_argument("--steps", type=int, default=40, help="steps profiled (default 40)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(Fingerprint.of().to_json())
    llm = LLM(
        args.checkpoint, max_num_seqs=max(batches), max_model_len=8192, skip_tokenizer_init=True, record_stats=True
    )
    rows = []
    for batch in batches:
        rows.append(measure(llm, batch, args.steps, arrivals=0) | {"kind": "decode"})
        rows.append(measure(llm, batch, args.steps, arrivals=8) | {"kind": "mixed"})
    print("| steps | batch | n | mixed | GPU idle | step ms | host us (median) | wall us (median) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['batch']} | {r['steps']} | {r['mixed_steps']} | {100 * r['idle']:.1f}% | "
            f"{r['step_ms']:.2f} | {r['host_us']:.0f} | {r['wall_us']:.0f} |"
        )


if __name__ == "__main__":
    main()
