"""Is a serving step's prefill forward bound by the GPU or by the host that issues it? For packed
prefills of a few shapes, as the engine runs them (ModelRunner.prefill): the GPU time with the host kept
ahead (a sleep kernel first), the host time to issue the forward (measured while the GPU is still
busy with the sleep), and the wall time of a plain call, with the prefill graphs
(fp8route.engine.prefill_graphs) off and on. --profile: where the host time goes, cProfile of one shape.
--find-block: for one shape, the innermost modules whose call kept the host waiting for the GPU (a
sync, or a copy from pageable memory), issued behind a long sleep so a wait stands out, and the
syncs torch's sync debug mode reports (run 9: a 4 x 2048 forward's host time was the sleep's).

    python3 benchmarks/prefill_host.py CHECKPOINT [--cases 512 1024x2 2048@2048 1024+44 ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from fp8route.engine.generate import Rows
from fp8route.engine.llm import LLM
from fp8route.engine.runner import DecodeRows

TAIL_CONTEXT = 512  # positions each riding decode row attends to


def parse_case(text: str) -> tuple[list[int], list[int], int]:
    """'1024x2' -> two fresh chunks of 1024; '2048@2048' -> 2048 tokens continuing a sequence at
    position 2048 (its head as if cached); '1024+44' -> a chunk of 1024 with 44 decoding rows riding
    at its end, as a mixed step has them: (lengths, starts, decode rows)."""
    chunks, _, tail = text.partition("+")
    chunk, _, count = chunks.partition("x")
    length, _, start = chunk.partition("@")
    n = int(count or 1)
    return [int(length)] * n, [int(start or 0)] * n, int(tail or 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["512", "1024", "2048", "4096", "1024x2", "512x4", "2048x4", "2048@2048", "1024@1024x2", "1024+44"],
    )
    parser.add_argument("--profile", default="", help="a case to profile (with the arm --graphs lists last)")
    parser.add_argument("--graphs", default="off,on", help="prefill graphs off, on, or off,on (both, per case)")
    parser.add_argument("--find-block", default="", help="a case whose host waits to find (the last --graphs arm)")
    args = parser.parse_args()
    llm = LLM(args.folder, max_model_len=8192, skip_tokenizer_init=True)
    model = llm.model
    arms = [mode == "on" for mode in args.graphs.split(",")]
    rows = []
    for case in args.cases:
        lengths, starts, tail = parse_case(case)
        ids = [torch.randint(0, model.cfg.vocab_size, (n,)).tolist() for n in lengths]
        held = [s + n for s, n in zip(starts, lengths, strict=True)] + [TAIL_CONTEXT] * tail
        with Rows(model, held) as blocks:
            n = len(lengths)
            riding = DecodeRows([1] * tail, [TAIL_CONTEXT - 1] * tail, list(range(n, n + tail)), blocks[n:])

            def call(ids=ids, blocks=blocks, n=n, starts=starts, riding=riding) -> torch.Tensor:
                decodes = riding if riding.tokens else None
                return model.runner.prefill(ids, starts, list(range(n)), blocks[:n], list(range(n)), decodes)

            walls = {}
            for graphs in arms:
                model.runner.use_prefill_graphs = graphs
                g, h, w, retries = measure(call)
                walls[graphs] = w
                row = (
                    f"{case:<12} {sum(lengths):>6} tok  graphs {'on ' if graphs else 'off'}  GPU {g:7.2f} ms  "
                    f"host {h:7.2f} ms  wall {w:7.2f} ms  host/GPU {h / g:4.2f}  tok/s {sum(lengths) / w * 1e3:9,.0f}"
                    + (f"  allocator retries {retries}" if retries else "")
                )
                if graphs and False in walls:
                    row += f"  on/off wall {walls[False] / w:4.2f}x faster"
                rows.append(row)
                print(row, flush=True)
            if case == args.find_block:
                print(find_block(model, call), flush=True)
            if case == args.profile:
                profile = cProfile.Profile()
                for _ in range(5):  # each behind a sleep, so no launch waits for room in the queue
                    torch.cuda._sleep(1_000_000_000)
                    profile.enable()
                    call()
                    profile.disable()
                    torch.cuda.synchronize()
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
                print(f"cProfile, 5 calls of {case} (each issued while the GPU sleeps):\n{out.getvalue()}")
    print("\n".join(["", "packed prefill forward: GPU time with the host ahead, host time to issue it, wall", *rows]))


def find_block(model: torch.nn.Module, call: Callable[[], torch.Tensor], sleep_ms: float = 500.0) -> str:
    """Issue call behind a GPU sleep with a host clock around every module: the innermost modules
    whose call took more than half the sleep waited for the GPU. Also the syncs that torch's sync
    debug mode warns about during the call, with the fp8route line that made each."""
    spans: list[tuple[str, int, float]] = []  # (module, depth, host seconds)
    stack: list[float] = []
    names = {id(m): name or "model" for name, m in model.named_modules()}

    def before(module: torch.nn.Module, args: object) -> None:
        stack.append(time.perf_counter())

    def after(module: torch.nn.Module, args: object, out: object) -> None:
        spans.append((names.get(id(module), type(module).__name__), len(stack), time.perf_counter() - stack.pop()))

    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    call()
    torch.cuda.synchronize()
    try:
        torch.cuda._sleep(int(sleep_ms * 2e6))  # ~2e6 cycles a ms at the H200's clocks
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        total = time.perf_counter() - start
        torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
    slow = [(name, depth, s) for name, depth, s in spans if s > sleep_ms / 2e3]
    deepest = max((depth for _, depth, _ in slow), default=0)
    lines = [f"find-block: the call's host time {total * 1e3:.1f} ms behind a {sleep_ms:.0f} ms sleep"]
    lines += [f"  waited in {name}: {s * 1e3:.1f} ms" for name, depth, s in slow if depth == deepest]
    if not slow:
        lines.append("  no module's call waited for the GPU")
    for w in caught:
        lines.append(f"  sync debug: {w.message} ({w.filename}:{w.lineno})")
    return "\n".join(lines)


def measure(call: Callable[[], torch.Tensor]) -> tuple[float, float, float, int]:
    """(GPU ms with the host ahead, host ms to issue, wall ms, allocator retries), medians of 5."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    gpu, host, wall = [], [], []
    retries = torch.cuda.memory_stats()["num_alloc_retries"]
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the host issues the whole forward before the GPU starts it
        begin.record()
        start = time.perf_counter()
        call()
        host.append(time.perf_counter() - start)
        end.record()
        torch.cuda.synchronize()
        gpu.append(begin.elapsed_time(end) / 1e3)
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    g, h, w = (1e3 * statistics.median(x) for x in (gpu, host, wall))
    return g, h, w, torch.cuda.memory_stats()["num_alloc_retries"] - retries


if __name__ == "__main__":
    main()
