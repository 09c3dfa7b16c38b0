"""All-reduce cost on this machine's GPUs, per message size: NCCL eager, NCCL inside a CUDA graph,
and fp8route's one-shot peer-memory all-reduce (PyTorch symmetric memory, no multicast) eager and
inside a graph; each result checked against the exact sum. One process per GPU.

Then what a decoder layer does after a row-parallel layer, per row count of Llama-3.1-8B's width,
inside a CUDA graph: the all-reduce and then add+RMSNorm (NCCL; one-shot), against the "fused"
method's one kernel (fp8route.kernels.peer_reduce), with the add+RMSNorm alone for reference; the
fused outputs checked equal to NCCL's and equal on every rank.

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

from fp8route.kernels.fused import add_rms_norm
from fp8route.models.collectives import AllReduce
from fp8route.models.parallel import init_from_env
from fp8route.models.spawn import run_ranks

SIZES = [4096, 16 * 4096, 64 * 4096, 128 * 4096, 256 * 4096, 1024 * 4096, 4096 * 4096]  # bf16 values
CALLS = 32  # all-reduces per timed graph (a decode step of an 8B model has 64)
WIDTH = 4096  # Llama-3.1-8B's hidden size
ADD_NORM_ROWS = [1, 16, 64]


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


def measure_add_norm() -> list[dict[str, object]]:
    """µs per (sum over ranks, residual add, RMSNorm) of [rows, WIDTH] bf16, in a graph of CALLS."""
    device = init_from_env("cuda")
    assert device is not None, "run through run_ranks"
    rank = dist.get_rank()
    methods = {m: AllReduce(device, torch.bfloat16, 512 * 1024, m, width=WIDTH) for m in ("nccl", "symm_mem", "fused")}
    weight = torch.randn(WIDTH, dtype=torch.bfloat16, device=device, generator=_seeded(device, 0))
    out = []
    for rows in ADD_NORM_ROWS:
        partial = torch.randn(rows, WIDTH, dtype=torch.bfloat16, device=device, generator=_seeded(device, 1 + rank))
        residual = torch.randn(rows, WIDTH, dtype=torch.bfloat16, device=device, generator=_seeded(device, 99))
        nccl_normed, nccl_total = methods["nccl"].add_rms_norm(partial.clone(), residual, weight, 1e-5)
        fused_normed, fused_total = methods["fused"].add_rms_norm(partial, residual, weight, 1e-5)
        row: dict[str, object] = {"rows": rows}
        for name, reduce in [("add_norm_alone", None), *methods.items()]:
            # NCCL sums in place: its own copy (the values grow call after call; the time does not).
            mine = partial.clone() if name == "nccl" else partial
            graph = _graph(_add_norm_calls(reduce, mine, residual, weight))
            row[f"{name}_graph_us"] = round(statistics.median(_time_us(graph.replay)), 2)
        gathered = [torch.empty_like(fused_total) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, fused_total)
        row["fused_equals_nccl"] = bool(torch.equal(fused_total, nccl_total) and torch.equal(fused_normed, nccl_normed))
        row["fused_ranks_agree"] = all(torch.equal(g, gathered[0]) for g in gathered)
        out.append(row)
    return out


def _add_norm_calls(
    reduce: AllReduce | None, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> Callable[[], None]:
    def body() -> None:
        for call in range(CALLS):  # the fused method's phases alternate, as a decoder layer's do
            if reduce is None:
                add_rms_norm(partial, residual, weight, 1e-5)
            else:
                reduce.add_rms_norm(partial, residual, weight, 1e-5, call % 2)

    return body


def _seeded(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


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
    add_norm = run_ranks(args.ranks, measure_add_norm)
    print("\nsum over ranks + residual add + RMSNorm, us per call in a graph")
    print(f"{'rows':>5}{'add+norm':>10}{'nccl+':>9}{'1shot+':>9}{'fused':>9}  fused = nccl's bits, ranks agree")
    for r in add_norm:
        print(
            f"{r['rows']:>5}{r['add_norm_alone_graph_us']:>10}{r['nccl_graph_us']:>9}{r['symm_mem_graph_us']:>9}"
            f"{r['fused_graph_us']:>9}  {r['fused_equals_nccl']}, {r['fused_ranks_agree']}"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        doc = {"torch": torch.__version__, "gpus": [torch.cuda.get_device_name(i) for i in range(args.ranks)]}
        body = {**doc, "rows": rows, "add_norm": add_norm}
        (Path(args.out) / "allreduce.json").write_text(json.dumps(body, indent=1) + "\n")


if __name__ == "__main__":
    main()
