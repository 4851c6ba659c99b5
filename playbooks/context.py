"""What a tool or a stage hook may know of the conversation it runs in: the playbook (id,
version, metadata), the current stage (id, metadata) and the transitions' data.

Inside a tool call, :func:`current_context` gives it (a Python tool needs no extra parameter,
so its schema stays what the LLM sees); a stage's ``on_enter`` / ``on_exit`` function receives
it as its argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

__all__ = ["PlaybookContext", "current_context", "provide_context"]


@dataclass(frozen=True)
class PlaybookContext:
    playbook_id: str
    version: str | None
    metadata: Mapping[str, Any]
    """The playbook's ``metadata``."""
    stage_id: str
    stage_metadata: Mapping[str, Any]
    data: Mapping[str, Any]
    """What transitions' ``data`` put in the conversation so far."""


_PROVIDER: ContextVar[Callable[[], PlaybookContext] | None] = ContextVar(
    "playbook_context", default=None
)


def current_context() -> PlaybookContext | None:
    """The conversation a tool call runs in, as it is now; None outside a turn."""
    provider = _PROVIDER.get()
    return provider() if provider is not None else None


def provide_context(provider: Callable[[], PlaybookContext]) -> Token[Any]:
    """Make :func:`current_context` call ``provider`` in this task and the tasks and threads
    it starts from now on; reset with the returned token."""
    return _PROVIDER.set(provider)
