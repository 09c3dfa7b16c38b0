"""--help as a newcomer reads it: every option of every subcommand has help and shows its default,
and one setting has one name across commands."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from fp8route.cli import build_parser


def parsers(parser: argparse.ArgumentParser, name: str = "fp8route") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser under this one, by its command line: fp8route, fp8route bench, fp8route bench gemm, ..."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from parsers(child, f"{name} {sub}")


COMMANDS = dict(parsers(build_parser()))


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        yield action


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as --help prints it (the formatter's additions and %-expansion included)."""
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_that_shows_its_default(command):
    parser = COMMANDS[command]
    missing: list[str] = []
    for action in options(parser):
        name = "/".join(action.option_strings) or action.dest
        text = shown_help(parser, action)
        if not text.strip() or (action.option_strings and not action.required and "default" not in text):
            missing.append(f"{name}: {text!r}")
    assert not missing, f"`{command}` options without help, or whose help shows no default:\n" + "\n".join(missing)
    parser.format_help()  # and the whole page formats


def test_a_setting_has_one_name_across_commands():
    seen: dict[str, set[str]] = {}
    for parser in COMMANDS.values():
        for action in options(parser):
            seen.setdefault(action.dest, set()).update(action.option_strings or [action.dest])
    assert "max_new_tokens" not in seen, "generate's length is --max-tokens, as SamplingParams and the API name it"
    # The model a command runs is the positional MODEL wherever fp8route owns the command.
    commands = ("generate", "serve", "inspect", "eval", "bench e2e", "bench serve")
    for command in (f"fp8route {c}" for c in commands):
        positionals = [a.dest for a in options(COMMANDS[command]) if not a.option_strings]
        assert positionals == ["model"], (command, positionals)
