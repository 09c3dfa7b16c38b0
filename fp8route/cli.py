"""The `fp8route` command: each subcommand lives in its own module and registers itself."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules that define `register(subparsers)`; each sets `run` to a function(args) -> exit code.
COMMAND_MODULES = (
    "fp8route.demo",
    "fp8route.commands.inspect",
    "fp8route.commands.quantize",
    "fp8route.commands.tune",
    "fp8route.commands.bench",
    "fp8route.commands.eval",
)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="fp8route", description="Static per-tensor FP8 linears, routed by measurement."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(commands)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
