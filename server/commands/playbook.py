"""``vocable playbook check|graph``: a playbook file checked, outlined or drawn."""

from __future__ import annotations

import argparse
import sys

from playbooks import PlaybookError, check_playbook, load_playbook
from playbooks.outline import mermaid, outline

__all__ = ["EXIT_USAGE", "playbook_command"]

EXIT_USAGE = 2
"""The exit status of a command given bad input (an invalid playbook, a bad setting)."""


def playbook_command(args: argparse.Namespace) -> int:
    """``playbook check [--connect]|graph FILE``: the output on stdout; an invalid file exits 2
    with a ``file[:line]: [path: ]message`` line per problem on stderr. Only ``check --connect``
    runs the playbook's code (its tools module, its MCP servers)."""
    try:
        if args.action == "graph":
            print(mermaid(check_playbook(args.file)))
        elif args.connect:
            print(outline(load_playbook(args.file, args.tools_module)))
        else:
            print(outline(check_playbook(args.file, args.tools_module)))
    except PlaybookError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return EXIT_USAGE
    return 0
