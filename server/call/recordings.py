"""Where and whether calls are recorded (``vocable serve --record DIR``), and for how long the
recordings are kept.

Each recorded call leaves ``<UTC start>_<call id>.wav`` and ``.jsonl`` in the directory (see
:mod:`.recorder`); the directory is created 0700 and the files 0600. A call is not recorded when
its playbook says ``recording: {enabled: false}``, or its WebRTC offer, media-stream request or
SIP INVITE carries ``X-Vocable-Record: off``. Files older than ``retention_days`` are deleted at
start-up and every ``sweep_period_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from playbooks.models import Playbook

from .recorder import RECORDING_RATE, CallRecorder, FailureReason

__all__ = ["OPT_OUT_HEADER", "RecordingSettings", "Recordings", "wants_recording"]

log = logging.getLogger(__name__)

OPT_OUT_HEADER = "X-Vocable-Record"
"""The HTTP or SIP header a caller's side sets to ``off`` so the call is not recorded."""
_OFF = frozenset({"off", "no", "false", "0"})
_NAME = re.compile(r"^\d{8}T\d{6}Z_[A-Za-z0-9._-]+\.(wav|jsonl)$")
"""The files this module writes; the sweep touches no others."""


def wants_recording(header: str | None) -> bool:
    """False when an ``X-Vocable-Record`` header value says ``off`` (or no, false, 0)."""
    return header is None or header.strip().lower() not in _OFF


@dataclass(frozen=True)
class RecordingSettings:
    directory: Path
    notice: str | None = None
    """Said at the start of every recorded call, before the greeting (a playbook's
    ``recording.notice`` replaces it)."""
    retention_days: float = 0.0
    """Recordings older than this are deleted; 0: kept."""
    sweep_period_s: float = 3600.0


class Recordings:
    """The recorders of one server process (none when ``settings`` is None)."""

    def __init__(self, settings: RecordingSettings | None) -> None:
        self.settings = settings
        self._live: set[CallRecorder] = set()

    def notice(self, playbook: Playbook, *, wanted: bool = True) -> str | None:
        """What a call on ``playbook`` says first when it is recorded (``wanted``: the
        caller's side did not opt out), "" for nothing; None when it is not recorded."""
        settings = self.settings
        if settings is None or not wanted or not playbook.recording.enabled:
            return None
        return playbook.recording.notice or settings.notice or ""

    def open(
        self,
        call_id: str,
        playbook: Playbook,
        on_failure: Callable[[FailureReason, str], None],
        *,
        wanted: bool = True,
    ) -> tuple[CallRecorder, str | None] | None:
        """Start recording a call on ``playbook`` (``wanted``: the caller's side did not opt
        out); returns the recorder and the notice to say first, or None when the call is not
        recorded. ``on_failure(reason, message)``: as :class:`CallRecorder` says."""
        settings = self.settings
        if settings is None or not wanted or not playbook.recording.enabled:
            return None
        started = datetime.datetime.now(datetime.UTC)
        stem = f"{started:%Y%m%dT%H%M%SZ}_{re.sub(r'[^A-Za-z0-9._-]', '-', call_id)}"

        header = {
            "call_id": call_id,
            "playbook": playbook.id,
            "started_at": started.isoformat(timespec="milliseconds"),
            "wav": f"{stem}.wav",
            "sample_rate": RECORDING_RATE,
            "channels": ["caller", "agent"],
        }
        directory = settings.directory
        recorder = CallRecorder(
            directory / f"{stem}.wav", directory / f"{stem}.jsonl", header, on_failure
        )
        self._live = {live for live in self._live if not live.done}
        self._live.add(recorder)
        return recorder, playbook.recording.notice or settings.notice

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Stop every recording and wait (up to ``timeout_s``) for their files to be complete."""
        recorders = list(self._live)
        for recorder in recorders:
            recorder.close()
        if recorders:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.gather(*(r.wait() for r in recorders))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """While the server runs: the directory exists (0700) and old recordings are swept
        now and every ``sweep_period_s``; at the end, recordings still open are finished."""
        settings = self.settings
        if settings is None:
            yield
            return
        try:
            await asyncio.to_thread(_make_directory, settings.directory)
        except OSError as exc:
            log.error("recordings directory %s: %s", settings.directory, exc)
        sweeper = None
        if settings.retention_days > 0:
            await self._sweep()
            sweeper = asyncio.create_task(self._sweep_periodically(), name="recordings-sweep")
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
            await self.aclose()

    async def _sweep_periodically(self) -> None:
        assert self.settings is not None
        while True:
            await asyncio.sleep(self.settings.sweep_period_s)
            await self._sweep()

    async def _sweep(self) -> None:
        try:
            await asyncio.to_thread(self.sweep)
        except OSError as exc:
            log.error("sweeping old recordings failed: %s", exc)

    def sweep(self, now: float | None = None) -> int:
        """Delete recordings last written more than ``retention_days`` ago (blocking: run it
        in a thread); returns how many files were deleted."""
        settings = self.settings
        if settings is None or settings.retention_days <= 0:
            return 0
        cutoff = (time.time() if now is None else now) - settings.retention_days * 86400
        deleted = 0
        with os.scandir(settings.directory) as entries:
            for entry in entries:
                if not _NAME.match(entry.name) or not entry.is_file(follow_symlinks=False):
                    continue
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        deleted += 1
        if deleted:
            log.info(
                "deleted %d recording files older than %g days", deleted, settings.retention_days
            )
        return deleted


def _make_directory(directory: Path) -> None:
    """Create ``directory`` for the owner only; one that exists keeps its mode (logged when
    others may read it)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_mode & 0o077:
        log.warning("recordings directory %s is readable by others than its owner", directory)
