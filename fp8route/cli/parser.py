"""The command line's parser: every subcommand's --help gives each option's default."""

from __future__ import annotations

import argparse
from typing import Any


class WithDefaults(argparse.HelpFormatter):
    """Each option's help ends with its default, where the help does not say it already; an option
    without a default (None) says in its own help what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        if action.nargs == 0 and isinstance(action.default, bool):  # a flag: on when given
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; its subcommands' parsers are Parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", WithDefaults)
        super().__init__(*args, **kwargs)
