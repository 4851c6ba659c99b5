"""The ``vocable`` command: its parser, and each subcommand handed to its module in
``server/commands/``: ``chat`` (text conversation with a playbook), ``playbook check|graph``,
``serve``, ``call`` (an outbound call through a running server) and ``test`` (spoken scenario
tests of playbooks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from playbooks import PlaybookError
from server.commands.call import add_call_arguments, run_call
from server.commands.chat import add_chat_arguments, chat_command
from server.commands.playbook import EXIT_USAGE, playbook_command
from server.config.command_flags import add_tools_module_argument
from server.config.llm import ConfigError
from server.config.server import add_serve_arguments
from server.runtime.logs import configure_logging

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    # warnings to stderr; with -v Vocable's own debug lines too (libraries stay at warnings)
    configure_logging(getattr(args, "log_format", "text"), verbose=args.verbose)
    try:
        if args.command == "chat":
            return chat_command(args)
        if args.command == "playbook":
            return playbook_command(args)
        if args.command == "call":
            return run_call(args)
        if args.command == "test":
            from server.commands.test import run_tests  # the test kit loads only for this command

            return run_tests(args)
        from server.commands.serve import serve_command  # the server loads only for this one

        return serve_command(args)
    except PlaybookError as exc:
        for line in exc.lines():  # one per problem of the file
            print(f"vocable: {line}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(f"vocable: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vocable", description="Real-time voice agent server.")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="Vocable's debug logging to stderr"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    chat = commands.add_parser("chat", help="talk to a playbook in text over stdin/stdout")
    add_chat_arguments(chat)

    playbook = commands.add_parser("playbook", help="check a playbook file or draw its graph")
    actions = playbook.add_subparsers(dest="action", required=True)
    check = actions.add_parser(
        "check",
        help="validate; list the compiled stages and transitions",
        description="Validate a playbook without running anything of it; --connect also imports"
        " its tools module and starts its MCP servers, checking every tool name as serving does.",
    )
    check.add_argument("file", type=Path, help="playbook file (.yaml, .yml, .json or .md)")
    check.add_argument(
        "--connect",
        action="store_true",
        help="load it as `chat` and `serve` do: import the tools module, start the MCP servers",
    )
    add_tools_module_argument(check)
    graph = actions.add_parser(
        "graph",
        help="print the stage graph as Mermaid text",
        description="Validate the playbook's structure (without importing its tools module or"
        " starting its MCP servers) and print its stage graph as Mermaid text.",
    )
    graph.add_argument("file", type=Path, help="playbook file (.yaml, .yml, .json or .md)")

    serve = commands.add_parser("serve", help="run the voice server (WebRTC and the web client)")
    add_serve_arguments(serve)

    call = commands.add_parser(
        "call",
        help="place an outbound SIP call through a running server (needs its --sip)",
        description="POST /calls to a running `vocable serve --sip ...`, print the session id"
        " and the call's events until it ends; exit 0 if answered, 1 if not, 2 if refused.",
    )
    add_call_arguments(call)

    from server.commands.test import add_test_arguments

    test = commands.add_parser(
        "test",
        help="run spoken scenario tests of playbooks through real calls",
        description="Run scenario files (*.scenario.yaml) through real calls to a server started"
        " for each run (or --url), check each turn's expectations, and report; exit 0 when all"
        " passed, 1 when one failed, 2 for invalid scenario files.",
    )
    add_test_arguments(test)
    return parser
