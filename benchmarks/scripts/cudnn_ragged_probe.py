"""Whether cuDNN's ragged attention, as torch exposes it (aten::_cudnn_attention_forward with cum_seq_q /
cum_seq_k, what nested tensors use), could serve a step's fresh chunks in one call a layer: its agreement with
SDPA a chunk at a time, its GPU and host time per call against that loop, and a CUDA graph capture with the
offsets changed between replays.

    PYTHONPATH=$PWD python3 benchmarks/scripts/cudnn_ragged_probe.py
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

H, HKV, D = 32, 8, 128
DEV, DT = torch.device("cuda"), torch.bfloat16
RAGGED = torch.ops.aten._cudnn_attention_forward


def per_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        q_i, k_i, v_i = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    return out


def ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int) -> torch.Tensor:
    return RAGGED(q, k, v, None, cu, cu, longest, longest, False, 0.0, True, False)[0]


def gpu_us(fn: Callable[[], object], n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def host_us(fn: Callable[[], object], n: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    spent = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return spent


def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(tokens, H, D, device=DEV, dtype=DT)
    k, v = torch.randn(2, tokens, HKV, D, device=DEV, dtype=DT)
    return q, k, v


CHUNKINGS = ([0, 2048], [0, 4096], [0, 8192], [0, 1000, 2730, 5461, 8192], [0, 700, 1400, 2048], [0, 90, 180, 256])


def compare(bounds: list[int]) -> str:
    """One step's fresh chunks: the ragged call against SDPA a chunk at a time."""
    q, k, v = inputs(bounds[-1])
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEV)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    one = functools.partial(ragged, q, k, v, cu, longest)
    loop = functools.partial(per_chunk, q, k, v, bounds)
    err = (one().float() - loop().float()).abs().max().item()
    return (
        f"chunks {bounds}: max err {err:.4f}; GPU us ragged {gpu_us(one):.0f} vs per chunk {gpu_us(loop):.0f}; "
        f"host us a call ragged {host_us(one):.0f} vs per chunk {host_us(loop):.0f}"
    )


def main() -> None:
    print(torch.__version__, RAGGED.default._schema, flush=True)
    for bounds in CHUNKINGS:
        print(compare(bounds), flush=True)
    tokens = 4096
    q, k, v = inputs(tokens)
    cu = torch.tensor([0, 1000, 3000, tokens, tokens], dtype=torch.int32, device=DEV)  # a zero-length chunk last
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ragged(q, k, v, cu, tokens)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ragged(q, k, v, cu, tokens)
        for bounds in ([0, 1000, 3000, tokens, tokens], [0, 512, tokens, tokens, tokens]):
            cu.copy_(torch.tensor(bounds, dtype=torch.int32, device=DEV))
            graph.replay()
            want = per_chunk(q, k, v, sorted(set(bounds)))
            print(f"graph replay {bounds}: err {(out.float() - want.float()).abs().max().item():.4f}", flush=True)
    except Exception as exc:  # noqa: BLE001 (the probe reports what the capture did)
        print(f"capture failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
