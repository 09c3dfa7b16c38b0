"""Two ranks over gloo that measure differently still write the same routes."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket

import pytest

WORLD = 2


def _rank(rank: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        import torch
        import torch.distributed as dist
        from routing_helpers import FP, H200

        from fp8route.tuning.timing import ArmTiming
        from fp8route.tuning.tuner import Tuner

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=30),
        )

        def measure(problem, m, backends):
            # Rank 0 alone would pick cublas, rank 1 alone cublas_fast; rowwise fails on rank 1 only.
            fast = {
                0: {"cublas": 10.0, "cublas_fast": 12.0, "rowwise": 5.0},
                1: {"cublas": 14.0, "cublas_fast": 12.0, "rowwise": 5.0},
            }[rank]
            out = {name: ArmTiming(name, (fast[name],) * 2, fast[name], 0.0) for name in backends}
            if rank == 1:
                out["rowwise"] = "RuntimeError: only on rank 1"  # type: ignore[assignment]
            return out

        table = Tuner(measure, H200, FP, m_values=(1, 64), backends=["cublas", "cublas_fast", "rowwise"]).tune(
            [(4096, 4096), (6144, 4096)]
        )
        queue.put((rank, {f"{n}x{k}": s.routes for (n, k, *_), s in table.shapes.items()}))
        dist.destroy_process_group()
    except BaseException as exc:  # report instead of hanging the parent
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ranks_all_reduce_timings_and_route_alike():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, queue)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=90) for _ in range(WORLD))
    except Exception:
        pytest.fail("the two gloo ranks did not report within 90 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    assert not any(isinstance(r, str) for r in results.values()), results
    assert results[0] == results[1]
    # The slowest rank's times decide (cublas 14 vs cublas_fast 12), and rowwise failed somewhere.
    assert set(results[0]["4096x4096"]) == {"cublas_fast"}
