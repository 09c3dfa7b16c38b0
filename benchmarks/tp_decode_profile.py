"""Where a decode step's GPU time goes, with one rank and with tensor parallelism: the kernels of
CUDA-graph replays of CausalLM.step on a random checkpoint, summed per kind (FP8 GEMM, lm_head,
all-reduce, attention, the rest), per step, on rank 0.

    python3 benchmarks/tp_decode_profile.py [--model llama-3.1-8b] [--tp 1,2] [--batch 1] [--all-reduce nccl]
        [--local-tp N] [--out DIR]

--local-tp N adds, on one GPU, a model of one rank's local dimensions under N-way tensor parallelism
(heads, KV heads, intermediate size and vocabulary divided by N) run alone: the work a rank does
without its collectives, so what TP N could reach with free all-reduces, measured on one GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from fp8route.checkpoint.random import write_random
from fp8route.engine.load import load_model
from fp8route.linear.policy import Policy
from fp8route.models.parallel import init_from_env
from fp8route.models.shapes import MODELS
from fp8route.models.spawn import run_ranks

KINDS = [
    ("all-reduce", re.compile(r"all_reduce|nccl|AllReduce|push_add_rms_norm", re.I)),  # fused: with its add+norm
    ("fp8_gemv", re.compile(r"decode_mma|decode_cuda_core", re.I)),
    ("attention", re.compile(r"attention|attn|split_kv", re.I)),
    ("gemm (library)", re.compile(r"nvjet|sm90|cutlass|gemm|xmma|cublas", re.I)),
    ("quantize", re.compile(r"quantize", re.I)),
]
STEPS = 10


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def profile(folder: str, batch: int, context: int, all_reduce: str = "nccl") -> dict[str, object]:
    device = init_from_env("cuda") or torch.device("cuda")
    model = load_model(
        folder, device, max_batch_size=batch, max_seq_len=context + 64, policy=Policy.from_env(), all_reduce=all_reduce
    )
    ids = torch.randint(0, model.cfg.vocab_size, (batch, context), device=device)
    model.generate(ids, 4)  # prefill and the decode graph of this batch size
    tokens = ids[:, -1].contiguous()
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)
    for _ in range(3):
        model.step(tokens, positions)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        model.step(tokens, positions)
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / STEPS
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            model.step(tokens, positions)
        torch.cuda.synchronize()
    per_kind: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        us = event.device_time_total / STEPS  # device_time_total is in µs
        if us <= 0:
            continue
        per_kind[kind_of(event.key)] += us
        kernels.append({"name": event.key[:90], "us_per_step": round(us, 1), "calls": event.count // STEPS})
    kernels.sort(key=lambda k: -float(k["us_per_step"]))  # type: ignore[arg-type]
    return {
        "step_ms": round(step_ms, 4),
        "kernel_ms": round(sum(per_kind.values()) / 1e3, 4),
        "per_kind_ms": {k: round(v / 1e3, 4) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": kernels[:25],
        "parallel": model.parallel,
    }


def local_config(config: dict[str, object], tp: int) -> dict[str, object]:
    """A rank's local dimensions under tp-way tensor parallelism, as a model of its own."""
    local = dict(config)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        local[key] = int(str(config[key])) // tp
    local["head_dim"] = int(str(config.get("head_dim") or 0)) or int(str(config["hidden_size"])) // int(
        str(config["num_attention_heads"])
    )
    return local


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    parser.add_argument("--folder", help="an FP8 checkpoint (default: write a random one of --model)")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024, help="tokens already in the cache")
    parser.add_argument("--all-reduce", default="nccl", help="with --tp > 1: nccl, symm_mem or fused")
    parser.add_argument("--local-tp", type=int, default=0, help="also one rank's local model, alone (see above)")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="fp8route-prof-", dir="/tmp") as tmp:
        folder = args.folder or str(write_random(Path(tmp) / "fp8", MODELS[args.model], fp8=True))
        for tp in (int(v) for v in args.tp.split(",")):
            run = (folder, args.batch, args.context, args.all_reduce)
            results[tp] = profile(*run) if tp == 1 else run_ranks(tp, profile, *run)
            torch.cuda.empty_cache()
        if args.local_tp > 1:
            config = local_config(dict(MODELS[args.model]), args.local_tp)
            local = str(write_random(Path(tmp) / f"local{args.local_tp}", config, fp8=True))
            results[f"{args.local_tp}-local"] = profile(local, args.batch, args.context)
    for tp, r in results.items():
        head = f"tp={tp} batch={args.batch}: step {r['step_ms']:.3f} ms (graph replay)"
        print(f"\n{head}, kernels {r['kernel_ms']:.3f} ms")
        for kind, ms in r["per_kind_ms"].items():  # type: ignore[union-attr]
            print(f"  {kind:<16}{ms:>8.3f} ms")
        for k in r["top_kernels"][:12]:  # type: ignore[index]
            print(f"    {k['us_per_step']:>8.1f} us x{k['calls']:<4} {k['name']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"tp_decode_profile_b{args.batch}.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
