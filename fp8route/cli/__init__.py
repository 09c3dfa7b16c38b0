"""The `fp8route` command: one module per subcommand, each registering itself.

A user's mistake (a bad argument, a missing file, an environment variable naming no backend) ends
in one line on stderr naming what was wrong and what to do, and exit code 2, never a traceback.
SIGTERM unwinds like Ctrl-C, so what a command was writing is removed either way.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

from fp8route.cli import bench, demo, evaluate, generate, inspect, quantize, serve, tune
from fp8route.cli.parser import Parser
from fp8route.errors import Fp8RouteError
from fp8route.version import __version__

COMMANDS = (generate, demo, inspect, quantize, tune, bench, evaluate, serve)
# Names the logger ("fp8route"), so a message must not begin with the name itself.
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so every cleanup that Ctrl-C runs runs for it too."""


# Set by the handler: an extension the signal lands in may turn Terminated into an error of its own
# (safetensors' get_tensor raised a ValueError), which is still the SIGTERM's.
_sigterm = threading.Event()


def _terminate(signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM must not cut the cleanup of the first short; SIGKILL still ends us.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _sigterm.set()
    raise Terminated


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.run(args))
    except Exception:
        if _sigterm.is_set():
            raise Terminated from None
        raise


def build_parser() -> argparse.ArgumentParser:
    """The `fp8route` parser with every subcommand registered."""
    parser = Parser(prog="fp8route", description="Static per-tensor FP8 linears, routed by measurement.")
    parser.add_argument("--version", action="version", version=f"fp8route {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    args = build_parser().parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()
    _sigterm.clear()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return _run(args)
    except Fp8RouteError as exc:
        # Every error fp8route raises on purpose names the problem and the fix: one line is enough.
        print(f"fp8route {args.command}: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"fp8route {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"fp8route {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
