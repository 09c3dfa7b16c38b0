"""`fp8route serve`: load the model, start the engine thread, serve the app with uvicorn.

SIGTERM (or Ctrl+C) drains: uvicorn stops accepting connections and closes idle ones, anything that
still reaches the app gets a 503, requests in flight run to their end for up to --shutdown-timeout
seconds (then are cancelled, which aborts them), and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from fp8route.backends import BACKENDS
from fp8route.engine.config import EngineConfig
from fp8route.engine.engine_process import EngineProcess
from fp8route.engine.load import resolve_model
from fp8route.errors import Fp8InputError
from fp8route.linear.policy import Policy
from fp8route.serve.app import build_app
from fp8route.serve.serving import Serving

API_KEY_ENV = "FP8ROUTE_API_KEY"


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving: Serving, on_ready: Callable[[int], None]) -> None:
        super().__init__(config)
        self.serving, self.on_ready = serving, on_ready

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            self.on_ready(port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.serving.draining:
            timeout = self.config.timeout_graceful_shutdown
            print(
                f"fp8route serve: {signal.Signals(sig).name}: no new requests; draining {self.serving.in_flight} "
                f"in flight (up to {timeout} s)",
                file=sys.stderr,
                flush=True,
            )
        self.serving.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own re-raises the signal once it has shut down, which ends the process by that
        # signal (exit 143 for SIGTERM); a server that drained as asked exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _policy(name: str) -> Policy:
    if name == "routed":
        return Policy.from_env()
    if name not in BACKENDS:
        raise Fp8InputError(f"--policy: unknown {name!r}; known: routed, {', '.join(BACKENDS)}")
    return Policy.from_env(force=name)


def _tokenizer_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so that a port in use or a bad address is
    one line at once; uvicorn listens on it once the model is loaded (until then a connection is refused)."""
    if not 0 <= port <= 65535:
        raise Fp8InputError(f"--port must be 0-65535 (0 picks a free one), got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind does
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = "; give another --port, or --port 0 for a free one" if exc.errno == errno.EADDRINUSE else ""
        raise Fp8InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock


def serve(args: argparse.Namespace) -> int:
    for name, low in (("--max-queue", 0), ("--max-request-bytes", 1), ("--shutdown-timeout", 0)):
        value = getattr(args, name[2:].replace("-", "_"))
        if value < low:
            raise Fp8InputError(f"{name} must be at least {low}, got {value}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    policy = _policy(args.policy)
    config = EngineConfig.from_args(args)
    sock = _bind(args.host, args.port)
    try:
        return _serve(args, config, sock, api_key, policy)
    finally:
        sock.close()


def _serve(
    args: argparse.Namespace, config: EngineConfig, sock: socket.socket, api_key: str | None, policy: Policy
) -> int:
    folder = resolve_model(args.model)
    engine = EngineProcess(folder, config, policy)
    name = args.served_model_name or args.model
    serving = Serving(
        engine, name, folder, max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
        tokenizer_config=_tokenizer_config(folder),
    )  # fmt: skip
    app = build_app(serving, api_key=api_key, max_request_bytes=args.max_request_bytes)
    server_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, lifespan="off",
        timeout_graceful_shutdown=args.shutdown_timeout,  # type: ignore[arg-type]
    )  # fmt: skip

    def ready(port: int) -> None:
        print(
            f"fp8route serve: {name} at http://{args.host}:{port}/v1 (/health, /metrics); KV pool "
            f"{engine.capacity_tokens} tokens; up to {args.max_num_seqs} running and {args.max_queue} waiting; "
            f"{'API key required' if api_key else 'no API key'}",
            flush=True,
        )
        if not _loopback(args.host) and not api_key:
            print(
                f"fp8route serve: warning: {args.host} without an API key: anyone who reaches it can use it", flush=True
            )

    server = _Server(server_config, serving, ready)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if serving.in_flight:
        print(f"fp8route serve: stopped with {serving.in_flight} requests cut off by the timeout", file=sys.stderr)
    return 0
