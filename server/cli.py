"""The ``vocable`` command: ``chat`` (text conversation with a playbook), ``playbook check|graph``,
``serve``, ``call`` (an outbound call through a running server) and ``test`` (spoken scenario
tests of playbooks)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from playbooks import (
    OrchestratorOptions,
    PlaybookError,
    PlaybookOrchestrator,
    check_playbook,
    load_playbook,
    load_playbooks,
)
from playbooks.outline import mermaid, outline
from server.chat import run_chat
from server.config.arguments import non_negative_int, positive_int
from server.config.llm import ConfigError, LLMChoice, add_llm_arguments
from server.config.options import ServeOptions
from server.config.server import LocalLLMSettings, add_serve_arguments
from server.dial import add_call_arguments, run_call
from server.runtime.llm_provider import WAYS_TO_AN_LLM, LLMProvider
from server.runtime.logs import configure_logging

__all__ = ["CHAT_TURN_FLAGS", "add_chat_arguments", "main"]

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    # warnings to stderr; with -v Vocable's own debug lines too (libraries stay at warnings)
    configure_logging(getattr(args, "log_format", "text"), verbose=args.verbose)
    try:
        if args.command == "chat":
            return _chat(args)
        if args.command == "playbook":
            return _playbook(args)
        if args.command == "call":
            return run_call(args)
        if args.command == "test":
            from server.testing import run_tests  # the test kit loads only for this command

            return run_tests(args)
        return _serve(args)
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
    _add_tools_module(check)
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

    from server.testing import add_test_arguments

    test = commands.add_parser(
        "test",
        help="run spoken scenario tests of playbooks through real calls",
        description="Run scenario files (*.scenario.yaml) through real calls to a server started"
        " for each run (or --url), check each turn's expectations, and report; exit 0 when all"
        " passed, 1 when one failed, 2 for invalid scenario files.",
    )
    add_test_arguments(test)
    return parser


CHAT_TURN_FLAGS: Mapping[str, tuple[str, str]] = {
    "history_limit": ("--history-limit", "conversation messages the LLM is given"),
    "max_tool_calls_per_turn": (
        "--max-tool-calls",
        "tool calls per turn before the answer is forced",
    ),
    "phase1_timeout_ms": (
        "--phase1-timeout-ms",
        "longest tool phase of a turn, in ms, before the answer is forced",
    ),
}
"""``vocable chat``'s flags of :class:`OrchestratorOptions`, by field: (flag, help). Each flag's
destination is its field, and its default the field's default."""


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vocable chat``. Each default shared with the library or with ``vocable serve``
    is read where it is declared (:class:`OrchestratorOptions`, :class:`ServeOptions`), and the
    help says it."""
    parser.add_argument("playbook", type=Path, help="playbook file (.yaml, .yml, .json or .md)")
    _add_tools_module(parser)
    llm = add_llm_arguments(parser)
    retries = ServeOptions.model_fields["llm_retries"]
    llm.add_argument(
        "--llm-retries",
        type=non_negative_int,
        default=retries.default,
        metavar="N",
        help=_with_default(retries.description or ""),
    )
    defaults = OrchestratorOptions()
    for name, (flag, text) in CHAT_TURN_FLAGS.items():
        parser.add_argument(
            flag,
            dest=name,
            type=positive_int,
            default=getattr(defaults, name),
            metavar="N",
            help=_with_default(text),
        )
    parser.add_argument("--json", action="store_true", help="one JSON object per event and answer")


def _with_default(text: str) -> str:
    # argparse fills in %(default)s, so the help cannot name another default than the flag's
    return text.replace("%", "%%") + " (default %(default)s)"


def _add_tools_module(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tools-module",
        type=Path,
        metavar="PATH",
        help="Python tools module for a playbook file that names none (like llmrtc's JSON "
        "playbooks): its tools and hook functions, by name",
    )


def _chat(args: argparse.Namespace) -> int:
    playbook = load_playbook(args.playbook, args.tools_module)
    choice = LLMChoice.resolve(args, default_model=playbook.spec.default_llm_config.model)
    if not choice.embedded and choice.endpoint is None:
        raise ConfigError(f"chat needs an LLM (--llm none was given): {WAYS_TO_AN_LLM}")
    options = OrchestratorOptions(**{name: getattr(args, name) for name in CHAT_TURN_FLAGS})
    local = LocalLLMSettings.of(choice)

    async def run() -> None:
        provider = LLMProvider(
            choice.endpoint, local, args.llm_retries, choice.model, announce=False
        )
        try:
            await provider.start()
            client = await provider.ready()
            if client is None:
                raise ConfigError(f"no LLM: {provider.status.detail}; {WAYS_TO_AN_LLM}")
            orchestrator = PlaybookOrchestrator(playbook, client, options)
            try:
                await run_chat(orchestrator, json_lines=args.json)
            finally:
                await orchestrator.aclose()
        finally:
            await provider.close()

    asyncio.run(run())
    return 0


def _playbook(args: argparse.Namespace) -> int:
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


def _serve(args: argparse.Namespace) -> int:
    from server.config.server import ServerConfig
    from server.serve import run_server

    config = ServerConfig.from_args(args)
    if config.otel:
        try:
            import opentelemetry.exporter.otlp.proto.http
            import opentelemetry.sdk  # noqa: F401
        except ImportError:
            raise ConfigError("--otel needs the otel extra: pip install 'vocable[otel]'") from None
    if config.sip is not None:
        from server.transports.sip_compat import check_sip_stack

        check_sip_stack()  # an untested aiosipua stops here, before the models load
    # an invalid playbook stops here, with its one line
    load_playbooks(config.playbook, config.tools_module)
    if config.redis_url is not None:
        from server.runtime.call_directory import DirectoryUnavailable, check_reachable

        try:  # an unreachable call directory stops here, before the models load
            check_reachable(config.redis_url)
        except DirectoryUnavailable as exc:
            raise ConfigError(str(exc)) from None
    if config.local_llm is not None and config.local_llm.gguf is not None:
        from server.runtime.gguf import GgufError, read_gguf

        try:  # a missing, truncated or foreign file stops here, before the models load
            read_gguf(config.local_llm.gguf)
        except GgufError as exc:
            raise ConfigError(str(exc)) from None
    if config.turn_model is not None:
        from media.turn_model import TurnModelError, check_turn_model

        try:  # a missing or damaged file stops here, before the other models load
            check_turn_model(config.turn_model.path)
        except TurnModelError as exc:
            raise ConfigError(str(exc)) from None
    if config.llm is None and config.local_llm is None:
        print(
            "vocable: no LLM (--llm none): calls will connect, but the agent can only say so",
            file=sys.stderr,
        )
    if config.sip is not None:
        print(f"vocable: SIP on {config.sip.host}:{config.sip.port} (UDP and TCP)", flush=True)
    print(f"vocable: loading models and playbooks from {config.playbook} ...", flush=True)
    return run_server(config, lambda message: print(f"vocable: {message}", flush=True))
