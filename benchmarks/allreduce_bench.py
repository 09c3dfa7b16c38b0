"""All-reduce cost on this machine's GPUs, per message size: NCCL eager, NCCL inside a CUDA graph,
and fp8route's one-shot peer-memory all-reduce (PyTorch symmetric memory, no multicast) eager and
inside a graph; each result checked against the exact sum. One process per GPU.

    python3 benchmarks/allreduce_bench.py [--ranks 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from fp8route.models.collectives import AllReduce
from fp8route.models.parallel import init_from_env
from fp8route.models.spawn import run_ranks

SIZES = [4096, 16 * 4096, 64 * 4096, 128 * 4096, 256 * 4096, 1024 * 4096, 4096 * 4096]  # bf16 values
CALLS = 32  # all-reduces per timed graph (a decode step of an 8B model has 64)


def _time_us(fn: Callable[[], None], repeats: int = 15) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / CALLS)
    return out


def _graph(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def measure() -> list[dict[str, object]]:
    device = init_from_env("cuda")
    assert device is not None, "run through run_ranks"
    rank, world = dist.get_rank(), dist.get_world_size()
    one_shot = AllReduce(device, torch.bfloat16, SIZES[-1] * 2, "symm_mem")
    nccl = AllReduce(device, torch.bfloat16, 0, "nccl")
    rows = []
    for numel in SIZES:
        x = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device=device)
        expected = float(world * (world + 1) // 2)
        row: dict[str, object] = {"numel": numel, "bytes": numel * 2}
        for name, reduce in (("nccl", nccl), ("one_shot", one_shot)):
            y = reduce(x.clone())
            torch.cuda.synchronize()
            row[f"{name}_correct"] = bool((y == expected).all())
            work = [x.clone() for _ in range(CALLS)]

            def body(reduce: AllReduce = reduce, work: list[torch.Tensor] = work) -> None:
                for t in work:
                    reduce(t)

            eager = _time_us(body)
            graph = _graph(body)
            graphed = _time_us(graph.replay)
            row[f"{name}_eager_us"] = round(statistics.median(eager), 2)
            row[f"{name}_graph_us"] = round(statistics.median(graphed), 2)
            row[f"{name}_graph_spread_us"] = round(max(graphed) - min(graphed), 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", help="folder for allreduce.json")
    args = parser.parse_args()
    rows = run_ranks(args.ranks, measure)
    print(f"{'bytes':>10}{'nccl eager':>12}{'nccl graph':>12}{'1shot eager':>13}{'1shot graph':>13}  correct")
    for r in rows:
        print(
            f"{r['bytes']:>10}{r['nccl_eager_us']:>12}{r['nccl_graph_us']:>12}{r['one_shot_eager_us']:>13}"
            f"{r['one_shot_graph_us']:>13}  {r['nccl_correct'] and r['one_shot_correct']}"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        doc = {"torch": torch.__version__, "gpus": [torch.cuda.get_device_name(i) for i in range(args.ranks)]}
        (Path(args.out) / "allreduce.json").write_text(json.dumps({**doc, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
