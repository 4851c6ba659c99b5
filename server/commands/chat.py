"""``vocable chat``: a playbook conversation over stdin/stdout, one user message per line."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from playbooks import (
    OrchestratorEvent,
    OrchestratorOptions,
    PlaybookOrchestrator,
    Retraction,
    load_playbook,
)
from server.config.command_flags import add_tools_module_argument, non_negative_int, positive_int
from server.config.llm import ConfigError, LLMChoice, add_llm_arguments
from server.config.serve_options import ServeOptions
from server.config.server import LocalLLMSettings
from server.llm.provider import WAYS_TO_AN_LLM, LLMProvider

__all__ = ["CHAT_TURN_FLAGS", "add_chat_arguments", "chat_command", "run_chat"]


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
    add_tools_module_argument(parser)
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


async def run_chat(
    orchestrator: PlaybookOrchestrator,
    *,
    json_lines: bool,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> None:
    """Answer each line of ``stdin`` until EOF.

    Plain mode prints each answer on its own line. JSON mode prints one object per line, flushed,
    for every orchestrator event and ``{"type": "answer", "text": ...}`` at the end of each turn.
    """

    def emit(obj: dict[str, Any]) -> None:
        stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
        stdout.flush()

    def on_event(event: OrchestratorEvent) -> None:
        if json_lines:
            emit(event.to_dict())
        elif event.type == "error":
            print(
                f"[{event.data.get('source', 'error')}] {event.data.get('message')}",
                file=sys.stderr,
                flush=True,
            )

    orchestrator.on(on_event)
    greeting = orchestrator.greet()
    if greeting:
        if json_lines:
            emit({"type": "greeting", "text": greeting})
        else:
            stdout.write(greeting + "\n")
            stdout.flush()

    while True:
        line = await asyncio.to_thread(stdin.readline)
        if not line:
            return
        text = line.strip()
        if not text:
            continue
        async with orchestrator.turn(text) as turn:
            async for delta in turn:
                if isinstance(delta, Retraction):
                    continue  # the answer text is read from turn.answer at the end
        if json_lines:
            emit({"type": "answer", "text": turn.answer, "stage": orchestrator.engine.stage.id})
        else:
            # one line per answer, as one line per turn in (a model may write several)
            stdout.write(" ".join(turn.answer.split()) + "\n")
            stdout.flush()


def chat_command(args: argparse.Namespace) -> int:
    """``vocable chat``: the playbook of ``args`` with the LLM they choose; raises ConfigError
    without one."""
    playbook = load_playbook(args.playbook, args.tools_module)
    choice = LLMChoice.resolve(args, default_model=playbook.spec.default_llm_config.model)
    if not choice.embedded and choice.endpoint is None:
        raise ConfigError(f"chat needs an LLM (--llm none was given): {WAYS_TO_AN_LLM}")
    options = OrchestratorOptions(
        **{name: getattr(args, name) for name in CHAT_TURN_FLAGS},
        tool_calling=choice.tool_calling,
    )
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
