"""The paged attention kernel on one fresh chunk, against cuDNN's SDPA, in one process: the kernel as
it is, the kernel of an earlier tree (--before: a copy of its paged_attention.py), and tilings.

    PYTHONPATH=$PWD python3 benchmarks/scripts/fresh_chunk_sweep.py --before OLD.py --launches 256x128x8x2

Rounds alternate the arms; each cell is the median µs of its rounds (Triton's do_bench median in each),
with the spread (max / min - 1) across rounds. Every arm is checked against SDPA first.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from fp8route.bench import attention as bench
from fp8route.kernels import paged_attention as pa


def _module_at(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("paged_attention_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _repaged(cache: pa.PagedKV, tokens: int, page: int) -> pa.PagedKV:
    """Row 0's first `tokens` positions of `cache` in blocks of `page` positions, in order."""
    blocks = -(-tokens // page)
    k, v = (x[cache.tables[0].long()].flatten(0, 1)[: blocks * page] for x in (cache.k, cache.v))
    k, v = (x.reshape(blocks, page, *x.shape[1:]).contiguous() for x in (k, v))
    table = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
    return pa.PagedKV(k, v, table, cache.k_scale, cache.v_scale)


def _arms(
    tokens: int, dtype: torch.dtype, before: ModuleType | None, launches: list[pa.Launch], pages: list[int]
) -> dict:
    (cache,) = bench._pools(1, tokens, 1, dtype)
    q = torch.randn(tokens, bench.H, bench.D, device="cuda", dtype=bench.BF16)
    seqs = bench._sequences([tokens], [tokens], 0)
    expected = pa.paged_attention_reference(q, cache, seqs)
    arms: dict[str, Callable[[], torch.Tensor]] = {"now": lambda: pa.paged_attention(q, cache, seqs)}
    if before is not None:
        old = before.PagedKV(*cache)
        arms["before"] = lambda: before.paged_attention(q, old, seqs)
    for launch in launches:
        arms["x".join(map(str, launch))] = lambda launch=launch: pa.paged_attention(q, cache, seqs, launch=launch)
    for page in pages:  # the same positions in larger blocks: what paging itself costs
        big = _repaged(cache, tokens, page)
        arms[f"page{page}"] = lambda big=big: pa.paged_attention(q, big, seqs)
    if dtype == bench.BF16:
        k, v = bench._own_kv(cache, 0, tokens)
        arms["cuDNN"] = bench._cudnn_prefill(q.transpose(0, 1)[None], k, v)
    checked = {}
    for name, call in arms.items():
        try:
            bench._check(call(), expected, f"{name} at {tokens}")
            checked[name] = call
        except Exception as exc:  # noqa: BLE001 (an arm that fails is a line, not the end of the run)
            print(f"{name} at {tokens} ({dtype}): {type(exc).__name__}: {str(exc)[:160]}")
    return checked


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", help="an earlier tree's fp8route/kernels/paged_attention.py")
    parser.add_argument("--launches", default="256x128x8x2,256x128x8x3,128x128x8x2")
    parser.add_argument("--pages", default="128", help="block sizes to repage the chunk into")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", default="2048,4096,8192")
    args = parser.parse_args()
    before = _module_at(args.before) if args.before else None
    launches = bench.parse_launches(args.launches)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; µs median of {args.rounds} rounds (spread)")
    for dtype in (bench.BF16, torch.float8_e4m3fn):
        for tokens in (int(t) for t in args.tokens.split(",")):
            arms = _arms(tokens, dtype, before, launches, [int(p) for p in args.pages.split(",") if p])
            times: dict[str, list[float]] = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, call in arms.items():
                    times[name].append(bench._median_us(call))
            med = {name: statistics.median(ts) for name, ts in times.items()}
            cells = [f"{n} {med[n]:.0f} ({max(ts) / min(ts) - 1:.1%})" for n, ts in times.items()]
            print(f"{str(dtype)[6:]:14} T={tokens:5}  " + "  ".join(cells))
            base = med.get("cuDNN") or med.get("before")
            if base:
                ratios = "  ".join(f"{n} {base / med[n]:.3f}" for n in med)
                print(f"{'':14} vs {'cuDNN' if 'cuDNN' in med else 'before'} (its µs / the arm's): {ratios}")


if __name__ == "__main__":
    main()
