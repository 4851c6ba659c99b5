"""Every live call of this process, whatever its transport, and how a call's session is built.

Transports (WebRTC, the Twilio-style media WebSocket, AudioSocket, SIP in and out) open their calls
through :meth:`CallRegistry.open` alone: it checks the limits, builds the call and its
:class:`Session` on the shared engines, and admits it, or refuses and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, Generic, Protocol, TypeVar

import aiohttp

from media import Speaker, Synthesizer
from playbooks import OrchestratorOptions, PlaybookOrchestrator
from playbooks.transfer import TransferOutcome, TransferRequest
from server.admission.cgroup import cpu_limit
from server.admission.cores import busy_time_reader
from server.admission.load import LoadGauge
from server.admission.ratelimit import RateLimiter
from server.call.events import VoiceEvent
from server.call.recorder import CallRecorder
from server.call.recordings import Recordings
from server.call.session import Session
from server.call.transferrer import CallTransferrer
from server.call.voice import VoicePlaybookOrchestrator
from server.config.serve_options import Line
from server.config.server import ServerConfig
from server.llm.llamacpp import ModelThreads

from .call_directory import CallDirectory
from .engines import Engines
from .logs import bind_session
from .memory import return_free_memory

__all__ = ["NO_LLM_LINE", "Call", "CallRegistry", "OverCapacity", "UnknownPlaybook"]

log = logging.getLogger(__name__)

IDLE_TRIM_S = 2.0
"""Seconds after the last call ended (its transport's farewell included) before freed memory is
handed back to the system (``runtime/memory.py``), if no call came meanwhile."""

NO_LLM_LINE = (
    "No language model is configured on this server yet, so I can hear you but cannot answer."
)


RETRY_AFTER_S = 5
"""Seconds a caller refused at the session limit or while draining is asked to wait."""


class OverCapacity(RuntimeError):
    """No new call now: the session limit, a drain, or measured overload; come back after
    ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownPlaybook(LookupError):
    pass


class Call(Protocol):
    """What the registry needs of a call (``server.transports.base.TransportCall`` is one)."""

    id: str
    session: Session
    ended: asyncio.Event

    def emit(self, event: VoiceEvent) -> None:
        """The session's event sink."""

    def agent_cleared(self) -> None:
        """The agent's audio queued at the speaker was dropped (a barge-in)."""

    def transfer_problem(self, request: TransferRequest) -> str | None:
        """Why this call cannot be transferred as asked (None: it can be tried)."""

    async def transfer(self, request: TransferRequest) -> TransferOutcome:
        """Put the caller through (see ``server.call.transferrer.TransferLine``)."""
        ...

    async def hangup(self, reason: str) -> None: ...


CallT = TypeVar("CallT", bound=Call)


class _CallPort(Generic[CallT]):
    """How a session reaches what is made after it: the transport's call built around it (its
    events, its conversation's transfers, its speaker's clearing) and, for a recorded call, its
    recorder. The registry
    builds the session first, speaking at ``rate``, then the call, then points the port at
    them; the session never sees either before it exists."""

    def __init__(self, rate: int, *, recorded: bool) -> None:
        self.rate = rate
        self.recorded = recorded
        self.call: CallT | None = None
        self.recorder: CallRecorder | None = None

    def caller_said(self, pcm: bytes) -> None:
        if self.recorder is not None:
            self.recorder.caller(pcm)

    def agent_said(self, pcm: bytes) -> None:
        if self.recorder is not None:
            self.recorder.agent(pcm, self.rate)

    def emit(self, event: VoiceEvent) -> None:
        if self.call is not None:  # a session emits nothing while it is being built
            self.call.emit(event)

    def cleared(self) -> None:
        if self.call is not None:
            self.call.agent_cleared()

    async def transfer(self, request: TransferRequest) -> TransferOutcome:
        if self.call is None:
            return TransferOutcome.failed("not_supported", "the call is not built yet")
        return await CallTransferrer(self.call.session.voice, self.call)(request)


class CallRegistry:
    """Live calls by id, built from shared engines; ``on_event`` sees every call's events."""

    def __init__(
        self,
        config: ServerConfig,
        engines: Engines,
        on_event: Callable[[VoiceEvent], None],
        http: aiohttp.ClientSession | None = None,
    ) -> None:
        self.config = config
        self.engines = engines
        self.http = http
        """The application's HTTP client, for the calls' own requests (a provider's transfer
        API); None: they make none."""
        self.calls: dict[str, Call] = {}
        self.on_event = on_event
        self.draining = False
        """Set by :meth:`drain`: no new call is admitted."""
        self.admissions = RateLimiter(config.rate_limit_per_min, config.rate_limit_burst)
        self.cpu_limit = cpu_limit()
        """The CPU this process may use (a control group's quota, else its cores)."""
        limit = self.cpu_limit
        model_threads = ModelThreads()
        self.load = LoadGauge(
            config.overload,
            lambda: engines.transcriber.backlog or 0,
            synthesis_backlog=lambda: engines.synthesizer.backlog or 0,
            calls=lambda: len(self.calls),
            calls_in_turn=lambda: sum(call.session.in_turn for call in self.calls.values()),
            model_cpu_time=lambda: (
                model_threads() if engines.llm_provider.embedded is not None else None
            ),
            cores=limit.cores,
            cores_busy_time=limit.usage if limit.quota else busy_time_reader(),
            others_share_the_limit=limit.quota,
        )
        """Sampled while the server runs (``load.running()``); judged at each admission."""
        self.refused = 0
        """Calls refused for measured overload."""
        self._released = asyncio.Event()
        self.farewells: set[asyncio.Task[None]] = set()
        """Transport work of released calls still going on (telling the caller why the call
        ended); :meth:`close_all` waits for it."""
        self.directory: CallDirectory | None = None
        """Where the replicas find each other's calls (``--redis-url``; None: not shared)."""
        self.recordings = Recordings(config.recording)
        """Call recording (``--record``); run ``recordings.running()`` while serving."""
        self._recorders: dict[str, CallRecorder] = {}

    def __len__(self) -> int:
        return len(self.calls)

    def get(self, call_id: str) -> Call | None:
        """The live call with id ``call_id``, or None (never was, or has been released)."""
        return self.calls.get(call_id)

    def check_capacity(self) -> None:
        """Raise OverCapacity unless one more call may be admitted now: not draining, under
        the session limit, not overloaded, and the live calls at their measured cost leave room
        for it (see :class:`LoadGauge`)."""
        if self.draining:
            raise OverCapacity("this server is shutting down")
        if len(self.calls) >= self.config.max_sessions:
            raise OverCapacity(f"this server takes at most {self.config.max_sessions} calls")
        overload = self.load.overload() or self.load.full(len(self.calls))
        if overload is not None:
            self.refused += 1
            log.warning("new call refused: %s", overload.reason)
            raise OverCapacity(
                f"this server is overloaded: {overload.reason}", overload.retry_after_s
            )

    def playbook_id(self, requested: str | None) -> str:
        """The playbook to use; raises UnknownPlaybook."""
        playbook_id = requested or self.engines.default_playbook
        if playbook_id not in self.engines.playbooks:
            raise UnknownPlaybook(f"unknown playbook {playbook_id!r}")
        return playbook_id

    def open(
        self,
        build: Callable[[str, Session], CallT],
        *,
        rate: int,
        playbook: str | None = None,
        address: str | None = None,
        record: bool = True,
        line: Line = "phone",
    ) -> CallT:
        """Open one call, or none: the one way every transport's call comes in.

        In order: refuse while draining, at the session limit or under measured load
        (OverCapacity), or when ``address`` (the caller's, for the rate limit) opened too many
        calls lately (RateLimited); pick ``playbook`` (default: the server's; UnknownPlaybook);
        draw a new unguessable id; build the call's session on the shared models, speaking at
        ``rate`` (the transport's output rate) and cleaning the caller's audio as ``line``
        needs (``ServerConfig.hearing``); ``build(call_id, session)`` the transport's call
        around it; admit it, recorded with ``--record`` unless ``record`` is False or its
        playbook opts out.

        The call is built in that one direction: its session first, made whole (the
        conversation's transfers and the session's events go to the call through
        :class:`_CallPort`, which the registry points at the call once it is built), then the
        transport's call. Nothing here awaits, so no other call can take the slot between the
        check and the admission: keep it so. When a step raises, nothing of the call stays in
        the registry and no session is running (what ``build`` itself acquired, such as a
        port, is its caller's to give back). Once the id is drawn, the calling task and every
        task it starts log with it.
        """
        self.check_capacity()
        if address is not None:
            self.admissions.check(address)
        playbook_id = self.playbook_id(playbook)
        call_id = self.config.call_id_prefix + secrets.token_urlsafe(16)
        bind_session(call_id)
        playbook_spec = self.engines.playbooks[playbook_id].spec
        notice = self.recordings.notice(playbook_spec, wanted=record)
        port: _CallPort[CallT] = _CallPort(rate, recorded=notice is not None)
        session = self._new_session(call_id, playbook_id, port, line, notice or "")
        call = port.call = build(call_id, session)
        self._admit(call, port)
        return call

    async def announced(self, call_id: str) -> None:
        """Return once the other replicas can find a call just opened here (at once without a
        call directory); call it before telling a client the call's id."""
        if self.directory is not None:
            await self.directory.written(call_id)

    def _new_session(
        self,
        call_id: str,
        playbook_id: str,
        port: _CallPort[Any],
        line: Line,
        notice: str,
    ) -> Session:
        """A session on the shared models, speaking at the port's rate and saying ``notice``
        first; its events go to the call through ``port`` and to ``on_event``, and its
        ``error`` events, with their full text, to the log; its conversation's transfers go to
        the call through ``port``, and what the caller and the agent say to its recorder."""
        engines = self.engines
        options = OrchestratorOptions(
            llm_timeout_ms=round(self.config.llm_timeout_s * 1000),
            tool_calling=self.config.tool_calling,
        )
        if engines.llm is None:
            options = replace(options, fallback_answer=NO_LLM_LINE)
        orchestrator = PlaybookOrchestrator(
            engines.playbooks[playbook_id], engines.llm, options, transferrer=port.transfer
        )

        def both(event: VoiceEvent) -> None:
            if event.type == "error":
                data = event.data
                log.warning(
                    "call %s: %s error: %s", call_id, data.get("source"), data.get("message")
                )
            self.on_event(event)
            port.emit(event)
            if port.recorder is not None:
                port.recorder.event(event)

        speaker = Speaker(port.rate)
        speaker.on_clear.append(port.cleared)
        if port.recorded:
            speaker.taps.append(port.agent_said)
        voice = VoicePlaybookOrchestrator(
            orchestrator, engines.transcriber, engines.synthesizer, speaker, both, notice=notice
        )
        settings = replace(self.config.session, hearing=self.config.hearing(line))
        taps = [port.caller_said] if port.recorded else []
        return Session(call_id, voice, settings, turn_model=engines.turn_model, taps=taps)

    def _admit(self, call: Call, port: _CallPort[Any]) -> None:
        """Take ``call`` and, when its port says it is recorded, start its recorder."""
        self.calls[call.id] = call
        if port.recorded:
            try:
                self._record(call, port)
            except BaseException:
                self.calls.pop(call.id, None)
                raise
        if self.directory is not None:
            self.directory.added(call.id)

    def _record(self, call: Call, port: _CallPort[Any]) -> None:
        voice = call.session.voice

        def failed(reason: str, message: str) -> None:
            voice.emit("recording_failed", reason=reason, message=message)

        playbook = voice.orchestrator.engine.playbook.spec
        opened = self.recordings.open(call.id, playbook, failed)
        if opened is not None:
            port.recorder = self._recorders[call.id] = opened[0]

    def release(self, call: Call, reason: str) -> None:
        """Forget an ended call: its slot is free. A transport call's hang-up calls this once,
        even when closing its session failed (``server/transports/base.py``)."""
        self.calls.pop(call.id, None)
        if self.directory is not None:
            self.directory.removed(call.id)
        recorder = self._recorders.pop(call.id, None)
        if recorder is not None:
            recorder.close()
        self._released.set()
        if not self.calls:
            loop = asyncio.get_running_loop()
            loop.call_later(IDLE_TRIM_S, self._trim_if_idle)
        with contextlib.suppress(Exception):
            self.on_event(VoiceEvent("state", {"state": "closed", "reason": reason}))

    def _trim_if_idle(self) -> None:
        """Still no call: give what the last ones took back to the system (off the loop)."""
        if not self.calls and not self.draining:
            asyncio.get_running_loop().run_in_executor(None, self._give_back_memory)

    def _give_back_memory(self) -> None:
        """The synthesizer's arenas shrunk, then the C heap trimmed (blocking)."""
        synthesizer = self.engines.synthesizer
        if isinstance(synthesizer, Synthesizer):
            shrunk = synthesizer.return_arena_memory()
            log.debug("idle: %d onnxruntime arenas shrunk", shrunk)
        return_free_memory()

    def see_off(self, farewell: Coroutine[Any, Any, None], name: str) -> None:
        """Run a released call's last transport work in the background (bounded by the call);
        the server waits for it before it closes."""
        task = asyncio.create_task(farewell, name=name)
        self.farewells.add(task)
        task.add_done_callback(self.farewells.discard)

    async def hangup(self, call_id: str, reason: str = "hung up by the client") -> bool:
        call = self.calls.get(call_id)
        if call is None:
            return False
        await call.hangup(reason)
        return True

    async def drain(self, timeout_s: float) -> int:
        """Admit no new call, and wait up to ``timeout_s`` for the live ones to end by
        themselves. Returns how many are still live."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.calls and (left := deadline - loop.time()) > 0:
            self._released.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), left)
        return len(self.calls)

    async def close_all(self, reason: str = "server shutting down") -> None:
        calls = list(self.calls.values())
        await asyncio.gather(*(call.hangup(reason) for call in calls), return_exceptions=True)
        await asyncio.gather(*list(self.farewells), return_exceptions=True)
        await self.recordings.aclose()
