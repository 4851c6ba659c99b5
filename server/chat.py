"""``vocable chat``: a playbook conversation over stdin/stdout, one user message per line."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, TextIO

from playbooks import OrchestratorEvent, PlaybookOrchestrator, Retraction

__all__ = ["run_chat"]


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
            stdout.write(turn.answer + "\n")
            stdout.flush()
