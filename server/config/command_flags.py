"""Flags the commands share, and argument types for numeric flags of ``vocable chat``
(``serve``'s are checked by its model): each parses its text or raises ``ArgumentTypeError``
with a message saying what is wanted (argparse prints it as ``argument --flag: MESSAGE``)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_tools_module_argument", "non_negative_int", "positive_int"]


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


def add_tools_module_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tools-module",
        type=Path,
        metavar="PATH",
        help="Python tools module for a playbook file that names none (like llmrtc's JSON "
        "playbooks): its tools and hook functions, by name",
    )
