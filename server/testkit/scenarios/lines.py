"""A scenario's telephone line: one real call, over WebRTC or SIP, seen from the caller's side.

Both lines give the same view: the call's events as clients get them (the WebRTC data channel;
SIP: the server's ``GET /calls/{id}/events`` stream), what the caller heard (16 kHz PCM16 with
each 20 ms frame's time and level), and the caller's speech and keypad. Times are the system's
monotonic clock, which the server's event times (``t_ms``) share on the same machine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from media import Resampler
from media.audio import FRAME_BYTES, SAMPLE_RATE

from ..caller import SILENCE_DBFS, HeardAt, ReceivedFrame, WebRTCCaller, voiced_span_ms
from ..caller import silent_from as silent_in
from ..echo_path import ReturnedEcho
from ..network import LossyLine, NetworkPath
from .checks import ends_call
from .speech import to_rate

if TYPE_CHECKING:
    from ..sip_phone import SipPhone

__all__ = ["CallLine", "SentSpeech", "SipLine", "Transport", "WebRTCLine", "open_line"]

Transport = Literal["webrtc", "sip"]
PHONE_RATE = 8000


@dataclass(frozen=True)
class SentSpeech:
    """When a caller utterance's speech left: its first and last voiced frames."""

    first_voiced_at: float
    last_voiced_at: float


class CallLine(Protocol):
    """What a scenario needs of a call (see the module docstring)."""

    events: list[dict[str, Any]]

    @property
    def frames(self) -> Sequence[HeardAt]:
        """Every 20 ms frame of the agent's audio heard so far, in order: frame ``n`` is
        ``heard[n * FRAME_BYTES : (n + 1) * FRAME_BYTES]``."""
        ...

    @property
    def heard(self) -> bytearray:
        """The agent's audio as heard, 16 kHz PCM16, frame ``n`` at bytes ``n * FRAME_BYTES``."""
        ...

    async def say(self, pcm: bytes) -> SentSpeech:
        """Speak 16 kHz PCM16 at real-time pace; returns once the voiced part has left."""
        ...

    async def press(self, digits: str) -> None:
        """Press keypad digits, one after another."""
        ...

    def ended(self) -> bool:
        """Whether the call has ended (the server hung up, or the connection closed)."""
        ...

    @property
    def network(self) -> LossyLine | None:
        """The caller's packets through the scenario's ``network`` (its counts), if any."""
        ...

    async def close(self) -> None: ...


def first_sound_after(line: CallLine, t: float) -> float | None:
    """When the caller first heard the agent after ``t``; None if not (yet)."""
    return next((f.at for f in line.frames if f.at > t and f.dbfs > SILENCE_DBFS), None)


def silent_from(line: CallLine, t: float, hold_ms: float = 300.0) -> float | None:
    """The first time after ``t`` from which the agent is heard silent for ``hold_ms``."""
    return silent_in(line.frames, t, hold_ms)


def last_sound(line: CallLine) -> float | None:
    """When the caller last heard the agent; None if never."""
    return next((f.at for f in reversed(line.frames) if f.dbfs > SILENCE_DBFS), None)


def heard_between(line: CallLine, start: float, end: float) -> bytes:
    """The agent's audio the caller heard between two times."""
    inside = [n for n, f in enumerate(line.frames) if start <= f.at <= end]
    if not inside:
        return b""
    return bytes(line.heard[inside[0] * FRAME_BYTES : (inside[-1] + 1) * FRAME_BYTES])


def heard_spans(
    line: CallLine, start: float, end: float, gap_s: float = 0.3
) -> list[tuple[float, float]]:
    """The spans between two times in which the caller heard the agent: (first, last) sound
    frame times, a span ending at a silence of ``gap_s`` or more."""
    spans: list[tuple[float, float]] = []
    for frame in line.frames:
        if not start <= frame.at <= end or frame.dbfs <= SILENCE_DBFS:
            continue
        if spans and frame.at - spans[-1][1] < gap_s:
            spans[-1] = (spans[-1][0], frame.at)
        else:
            spans.append((frame.at, frame.at))
    return spans


class WebRTCLine:
    """A call placed to ``POST /offer`` by a real aiortc caller (:class:`WebRTCCaller`)."""

    def __init__(self, caller: WebRTCCaller) -> None:
        self.caller = caller
        self.events = caller.events

    @classmethod
    async def open(
        cls,
        base_url: str,
        playbook: str,
        token: str | None,
        echo: ReturnedEcho | None = None,
        network: NetworkPath | None = None,
    ) -> WebRTCLine:
        caller = WebRTCCaller(offer_headers={"X-Vocable-Record": "off"}, echo=echo, network=network)
        try:
            await caller.connect(base_url, token=token, playbook=playbook)
        except BaseException:
            await caller.close()
            raise
        return cls(caller)

    @property
    def frames(self) -> Sequence[HeardAt]:
        return self.caller.frames

    @property
    def heard(self) -> bytearray:
        return self.caller.heard

    async def say(self, pcm: bytes) -> SentSpeech:
        spoken = self.caller.say(pcm)
        timeout = len(pcm) / (2 * SAMPLE_RATE) + 15
        first = await spoken.first_voiced_sent_at(timeout)
        last = await spoken.last_voiced_sent_at(timeout)
        await asyncio.wait_for(spoken.playback.finished(), timeout)
        return SentSpeech(first, last)

    async def press(self, digits: str) -> None:
        self.caller.send({"type": "dtmf", "digits": digits})

    def ended(self) -> bool:
        closed = any(ends_call(event) for event in self.events)
        return closed or self.caller.pc.connectionState in ("closed", "failed")

    @property
    def network(self) -> LossyLine | None:
        return self.caller.lossy

    async def close(self) -> None:
        await self.caller.close()


class SipLine:
    """A call to the server's SIP endpoint by a G.711 phone (:class:`SipPhone`); its events
    come from ``GET /calls/{id}/events``, the id from the answer's ``X-Vocable-Session``."""

    def __init__(self, phone: SipPhone) -> None:
        self.phone = phone
        self.events = phone.events
        self._heard = bytearray()
        self._frames: list[ReceivedFrame] = []
        self._widen = Resampler(PHONE_RATE, SAMPLE_RATE, aligned=True)
        """One stream for the call: 160 samples in, 320 out, the filter's state carried on."""

    @classmethod
    async def open(
        cls,
        base_url: str,
        sip_port: int,
        playbook: str,
        token: str | None,
        echo: ReturnedEcho | None = None,
        network: NetworkPath | None = None,
    ) -> SipLine:
        from ..sip_phone import SipPhone  # the SIP stack, only when a SIP line is asked for

        phone = await SipPhone.open(sip_port, echo, network)
        try:
            answer = await phone.invite(user=playbook)
            if answer.status_code != 200:
                raise RuntimeError(f"INVITE refused: {answer.status_code} {answer.reason_phrase}")
            if not phone.session_id:
                raise RuntimeError("the answer has no X-Vocable-Session header")
            await phone.follow_events(base_url, token)
            phone.start_microphone()  # a packet every 20 ms, silence between lines
        except BaseException:
            await phone.close()
            raise
        return cls(phone)

    def _catch_up(self) -> None:
        """Take the packets that arrived since last asked (8 kHz, 20 ms each) at 16 kHz."""
        packets, pcm = self.phone.heard.packets, self.phone.heard.pcm
        phone_frame = FRAME_BYTES * PHONE_RATE // SAMPLE_RATE
        for n in range(len(self._frames), len(packets)):
            at, dbfs = packets[n]
            self._frames.append(ReceivedFrame(at, dbfs))
            self._heard += self._widen.resample(bytes(pcm[n * phone_frame : (n + 1) * phone_frame]))

    @property
    def frames(self) -> Sequence[HeardAt]:
        self._catch_up()
        return self._frames

    @property
    def heard(self) -> bytearray:
        self._catch_up()
        return self._heard

    async def say(self, pcm: bytes) -> SentSpeech:
        first_ms, last_ms = voiced_span_ms(pcm)
        started = await self.phone.say(to_rate(pcm, SAMPLE_RATE, PHONE_RATE))
        return SentSpeech(started + first_ms / 1000, started + last_ms / 1000)

    async def press(self, digits: str) -> None:
        for digit in digits:
            await self.phone.press(digit)

    def ended(self) -> bool:
        closed = any(ends_call(event) for event in self.events)
        return closed or any(method == "BYE" for method, _ in self.phone.endpoint.requests_from)

    @property
    def network(self) -> LossyLine | None:
        return self.phone.lossy

    async def close(self) -> None:
        if not self.ended():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.phone.bye(), 2.0)
        await self.phone.close()


async def open_line(
    transport: Transport,
    base_url: str,
    playbook: str,
    *,
    sip_port: int | None = None,
    token: str | None = None,
    echo: ReturnedEcho | None = None,
    network: NetworkPath | None = None,
) -> CallLine:
    """Call ``playbook`` on the server at ``base_url`` (SIP: at ``sip_port`` of the same host),
    from a phone that returns the agent's voice as ``echo`` says (None: none), over a network
    that loses and delays its packets as ``network`` says (None: a perfect one)."""
    if transport == "sip":
        if sip_port is None:
            raise ValueError("a SIP line needs the server's SIP port")
        return await SipLine.open(base_url, sip_port, playbook, token, echo, network)
    return await WebRTCLine.open(base_url, playbook, token, echo, network)
