"""`fp8route serve PATH|smollm2`: an OpenAI-compatible server (the `serve` extra: FastAPI + uvicorn)."""

from __future__ import annotations

import argparse

from fp8route.backends import BACKENDS
from fp8route.engine.config import add_engine_args
from fp8route.errors import Fp8InputError

SERVE_ENGINE_ARGS = (
    "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
    "num_kv_blocks", "block_size", "enable_prefix_caching", "kv_cache_dtype", "attention", "use_cuda_graphs",
    "prefill_graphs", "async_scheduling", "cpu_threads", "itl_target_ms", "admission", "deterministic",
)  # fmt: skip

# What the serve extra brings; a missing one of these is the user's to install, anything else is ours.
_EXTRA = {"fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "jinja2", "h11", "anyio"}


def run(args: argparse.Namespace) -> int:
    from fp8route.serve import INSTALL_HINT

    try:
        from fp8route.serve.server import serve
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in _EXTRA:
            raise
        raise Fp8InputError(f"the server needs the serve extra ({exc.name} is missing): {INSTALL_HINT}") from None
    return serve(args)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="an OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, /metrics",
    )
    add_engine_args(parser, ["model"])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    parser.add_argument("--served-model-name", help="the name clients send as `model` (default: MODEL as given)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $FP8ROUTE_API_KEY)")
    parser.add_argument("--max-queue", type=int, default=1024, help="waiting requests beyond which a new one gets 503")
    parser.add_argument(
        "--policy", default="routed", help=f"routed, or one backend for every layer: {', '.join(BACKENDS)}"
    )
    add_engine_args(parser, SERVE_ENGINE_ARGS)
    parser.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's logging",
    )
    parser.set_defaults(run=run)
