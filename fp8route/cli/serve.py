"""`fp8route serve PATH|smollm2`: an OpenAI-compatible server (the `serve` extra: FastAPI + uvicorn)."""

from __future__ import annotations

import argparse

from fp8route.backends import BACKENDS
from fp8route.errors import Fp8InputError
from fp8route.quant import FLOAT_DTYPE_NAMES

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


class _WithDefaults(argparse.HelpFormatter):
    """--help gives each option's default, where its own help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="an OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, /metrics",
        formatter_class=_WithDefaults,
    )
    parser.add_argument("model", help="a checkpoint folder, or smollm2")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    parser.add_argument("--served-model-name", help="the name clients send as `model` (default: MODEL as given)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $FP8ROUTE_API_KEY)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per engine step")
    parser.add_argument("--max-queue", type=int, default=1024, help="waiting requests beyond which a new one gets 503")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="the share of GPU memory the model and KV pool may use",
    )
    parser.add_argument(
        "--policy", default="routed", help=f"routed, or one backend for every layer: {', '.join(BACKENDS)}"
    )
    parser.add_argument(
        "--async-scheduling", default="auto", choices=("auto", "on", "off"),
        help="launch a decode step before the last one is read back (auto: on a GPU, unless FlashInfer attends)",
    )  # fmt: skip
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    parser.add_argument("--device", help="cuda (default when there is one) or cpu")
    parser.add_argument(
        "--dtype", choices=sorted(FLOAT_DTYPE_NAMES), default="bfloat16",
        help="activations, logits and (with --kv-cache-dtype auto) the KV cache; bfloat16's rounding can flip a "
        "greedy near-tie between one batching and another, float32's far more rarely",
    )  # fmt: skip
    parser.add_argument("--num-kv-blocks", type=int, help="KV pool blocks, instead of sizing it from memory")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto: the model's dtype; fp8: float8_e4m3fn with the checkpoint's k/v scales, twice the tokens",
    )
    parser.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    parser.set_defaults(run=run)
