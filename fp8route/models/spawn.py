"""Start tensor-parallel ranks on this machine, one process per GPU, the way torchrun would: each
process gets RANK, WORLD_SIZE, LOCAL_RANK and a rendezvous address, so load_model joins the group
by itself (fp8route.models.parallel.init_from_env)."""

from __future__ import annotations

import gc
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8route.errors import Fp8InputError, Fp8RouteError
from fp8route.models.collectives import keep_multicast_off


def run_ranks(size: int, fn: Callable[..., Any], *args: Any, device: str = "cuda") -> Any:
    """fn(*args) in size processes (one per GPU, or gloo processes on CPU); returns rank 0's
    result. fn must be a module-level function (the processes are spawned)."""
    if size < 2:
        raise Fp8InputError(f"tensor parallel size must be at least 2 to start ranks, got {size}")
    if device == "cuda" and torch.cuda.device_count() < size:
        raise Fp8InputError(
            f"--tp {size} needs {size} GPUs; this machine has {torch.cuda.device_count()} visible "
            "(CUDA_VISIBLE_DEVICES limits them)"
        )
    keep_multicast_off()  # the spawned processes inherit this environment
    with tempfile.TemporaryDirectory(prefix="fp8route-ranks-") as tmp:
        result = Path(tmp) / "rank0.pt"
        try:
            mp.start_processes(
                _rank_main, args=(size, _free_port(), fn, args, str(result)), nprocs=size, start_method="spawn"
            )
        except mp.ProcessRaisedException:
            mistakes = sorted(Path(tmp).glob("mistake*.txt"))
            if mistakes:  # a user's mistake, seen by a rank: one message, not each rank's traceback
                raise Fp8InputError(mistakes[0].read_text()) from None
            raise
        return torch.load(result, weights_only=False)


def _rank_main(rank: int, size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], result: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        value = fn(*args)
        if rank == 0:
            torch.save(value, result)
    except Fp8RouteError as exc:
        Path(result).with_name(f"mistake{rank}.txt").write_text(str(exc))
        raise
    finally:
        # A model's decode graphs (which hold NCCL work) live in a reference cycle until collected;
        # destroying the process group under them hung `generate --tp 2` at exit on two H200s.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
