"""Where a prefill-heavy step's time goes, host and GPU: prompts of 1024-4096 tokens (2 output tokens each)
through `LLM`'s engine on a checkpoint, then torch.profiler (CPU and CUDA) over the steps of a few more; prints
the ops by host time and the GPU kernels by total time, and each prefill step's host and wall ms. With
--sync-debug, torch's sync debug mode warns on every host sync under a load first, with where it came from.

    PYTHONPATH=$PWD python3 benchmarks/scripts/fresh_route_profile.py /tmp/ckpt-8b --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fp8route.engine.config import EngineConfig
from fp8route.engine.llm import LLM
from fp8route.engine.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sync-debug", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, config=EngineConfig(max_model_len=8192, skip_tokenizer_init=True, record_stats=True))
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def load(n: int) -> None:
        for _ in range(n):
            length = int(torch.randint(1024, 4097, (1,), generator=g))
            engine.add_request(torch.randint(0, engine.model.cfg.vocab_size, (length,), generator=g).tolist(), params)
        while engine.has_unfinished:
            engine.step()

    load(16)  # first calls
    if args.sync_debug:
        places: collections.Counter[str] = collections.Counter()
        warnings.showwarning = lambda *_: places.update(["".join(traceback.format_stack(limit=14)[:-1])])
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        load(24)
        torch.cuda.set_sync_debug_mode(0)
        print(f"host syncs: {sum(places.values())} from {len(places)} places")
        for stack, count in places.most_common(6):
            print(f"--- {count}x\n{stack}")
    engine.stats.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        load(12)
    trace = args.out / "trace.json"
    prof.export_chrome_trace(str(trace))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    kernels: collections.Counter[str] = collections.Counter()
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[event["name"][:90]] += event["dur"]
    trace.unlink()
    print(f"GPU total {sum(kernels.values()) / 1e3:.1f} ms")
    for name, us in kernels.most_common(20):
        print(f"{us / 1e3:9.2f} ms  {name}")
    steps = [s for s in engine.stats if s.prefill_tokens]
    host, wall = ([round(1e3 * getattr(s, f)) for s in steps] for f in ("host_s", "wall_s"))
    print(f"prefill steps: host ms {host}, wall ms {wall}")


if __name__ == "__main__":
    main()
