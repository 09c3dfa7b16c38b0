"""`fp8route bench figures`: README's table of current figures, rendered from the committed results."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8route.bench.figures import render, replace_table, table_in
from fp8route.errors import Fp8InputError


def run(args: argparse.Namespace) -> int:
    table = render(Path(args.results))
    if not args.write and not args.check:
        print(table)
        return 0
    readme = Path(args.readme)
    if not readme.is_file():
        raise Fp8InputError(f"--readme: no file {readme}; run from the repository root or give its path")
    text = readme.read_text()
    if args.check:
        if table_in(text) != table:
            print(f"{readme}: the figures table differs from the results; run `fp8route bench figures --write`")
            return 1
        print(f"{readme}: the figures table matches the results")
        return 0
    readme.write_text(replace_table(text, table))
    print(f"wrote the figures table into {readme}")
    return 0


def register(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "figures",
        help="render README's table of current figures from benchmarks/results (print, --check or --write)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--results", default="benchmarks/results", help="the committed results folder")
    parser.add_argument("--readme", default="README.md", help="the file holding the table between its markers")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the table in --readme")
    mode.add_argument("--check", action="store_true", help="exit 1 when --readme's table differs from the results")
    parser.set_defaults(run=run)
