"""Log lines for people (``text``) or for log pipelines (``json``: one object per line), each
carrying the session id of the call it concerns.

The session id travels in a context variable: :func:`bind_session` sets it where a call is
created, and every task started from there (the call's media, turns and tools) inherits it.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime

__all__ = ["JsonFormatter", "bind_session", "configure_logging", "current_session"]

_session: ContextVar[str | None] = ContextVar("vocable_session", default=None)

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(session_tag)s: %(message)s"
_OWN_PACKAGES = ("server", "media", "playbooks")


def bind_session(session_id: str) -> None:
    """Tag this task's log lines, and those of every task it starts from now on, with
    ``session_id``."""
    _session.set(session_id)


def current_session() -> str | None:
    return _session.get()


class _SessionFilter(logging.Filter):
    def __init__(self, worker: int | None) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        session = _session.get()
        record.session_id = session
        record.session_tag = f" [{session}]" if session else ""
        record.worker = self.worker
        return True


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", "session_id", "worker", "exc"}``, one per line;
    keys whose value is unknown are left out."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "session_id": getattr(record, "session_id", None),
            "worker": getattr(record, "worker", None),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps({k: v for k, v in entry.items() if v is not None}, ensure_ascii=False)


def configure_logging(
    log_format: str = "text", *, verbose: bool = False, worker: int | None = None
) -> None:
    """Warnings and up (Vocable's own debug lines too with ``verbose``) to stderr, as text or
    JSON lines. Replaces any handler set before."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_SessionFilter(worker))
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    level = logging.DEBUG if verbose else logging.NOTSET
    for package in _OWN_PACKAGES:
        logging.getLogger(package).setLevel(level)
