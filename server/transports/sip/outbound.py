"""An outbound agent call: :func:`~.dialer.dial` the callee, then run the playbook's session
on the leg (``POST /calls``).

The call is admitted (a session slot, the rate limit) before the INVITE goes out, and holds its
slot while it rings. What it is doing is :attr:`OutboundCall.state`: ``ringing`` -> ``answered``
-> ``ended``, with :attr:`~OutboundCall.result` (the :data:`DialOutcome`) and a reason; a client
follows it with ``GET /calls/{id}`` and ``GET /calls/{id}/events`` (its voice events, as any
call's, and a ``call`` item at each state). After the answer,
:class:`~server.call.pickup.Pickup` decides when the agent greets (never over the callee's
"Hello?") and whether a voicemail greeting answered, which the playbook's ``voicemail``
setting handles (hang up, or leave its message once the greeting is over).

The INVITE offers G.722 first where its codec is installed (the call's speaker then runs at 16
kHz), then G.711: the callee's answer picks, and a G.711 answer hears and speaks through an 8
kHz step.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from media import Resampler
from playbooks.models import Voicemail
from server.call.pickup import Pickup, PickupSettings
from server.call.session import Session
from server.config.server import SipSettings
from server.config.sip_trunks import Trunk
from server.runtime.registry import CallRegistry
from server.transports.phone.line import PhoneCall

from .dialer import PHONE_RATE, DialFailed, DialOutcome, DialStack, OutboundLeg, dial

__all__ = ["SESSION_HEADER", "CallState", "OutboundCall"]

CallState = Literal["ringing", "answered", "ended"]
AnsweredBy = Literal["person", "voicemail"]
SESSION_HEADER = "X-Vocable-Session"
"""The header naming a call's session id (``/calls/{id}``, ``DELETE /sessions/{id}``) on SIP:
in an outbound call's INVITE, and in the 200 OK answering an inbound one (``sip.py``)."""


class OutboundCall(PhoneCall):
    """One call Vocable places. Create, set :attr:`session`, admit, then :meth:`start`."""

    transport = "SIP outbound"
    silence_reason = "media_timeout: no audio from the callee"

    def __init__(
        self,
        registry: CallRegistry,
        call_id: str,
        session: Session,
        stack: DialStack,
        to_uri: str,
        playbook_id: str,
        ring_timeout_s: float,
        settings: SipSettings,
        voicemail: Voicemail,
        trunk: Trunk | None = None,
    ) -> None:
        super().__init__(
            registry,
            call_id,
            session,
            "slin",
            session.voice.speaker.sample_rate,  # the line's, once the callee has answered
            media_timeout_s=settings.media_timeout_s,
        )
        self.stack = stack
        self.to_uri = to_uri
        self.playbook_id = playbook_id
        self.ring_timeout_s = ring_timeout_s
        self.settings = settings
        self.voicemail = voicemail
        self.trunk = trunk
        self.state: CallState = "ringing"
        self.result: DialOutcome | None = None
        self.status: int | None = None
        """The final SIP status of the INVITE (None: none came)."""
        self.reason: str | None = None
        self.answered_by: AnsweredBy | None = None
        self.started_at = time.time()
        self.answered_at: float | None = None
        self.ended_at: float | None = None
        self.leg: OutboundLeg | None = None
        self.pickup: Pickup | None = None
        self._dialing: asyncio.Task[Any] | None = None
        self._to_line: Resampler | None = None
        """The agent's audio to the answered codec's rate, when the speaker's differs."""

    # -- what clients see ----------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """``GET /calls/{id}``."""
        return {
            "session_id": self.id,
            "to": self.to_uri,
            "playbook": self.playbook_id,
            "trunk": None if self.trunk is None else self.trunk.name,
            "codec": None if self.leg is None else self.leg.codec,
            "srtp": None if self.leg is None else self.leg.srtp,
            "state": self.state,
            "result": self.result,
            "status": self.status,
            "reason": self.reason,
            "answered_by": self.answered_by,
            "started_at": self.started_at,
            "answered_at": self.answered_at,
            "ended_at": self.ended_at,
        }

    def _announce(self, state: CallState, **extra: Any) -> None:
        """Enter ``state`` and tell the call's followers (a ``call`` item in :attr:`events`)."""
        self.state = state
        self.events.publish(
            {
                "type": "call",
                "t_ms": round(time.monotonic() * 1000, 1),
                "state": state,
                "result": self.result,
                "status": self.status,
                "reason": self.reason,
                "answered_by": self.answered_by,
                **extra,
            }
        )

    # -- the call ------------------------------------------------------------------------------

    def start(self) -> None:
        """Send the INVITE (in the background); the call then follows its course."""
        self._announce("ringing")
        self._dialing = self.spawn(self._run(), "sip-dial")

    async def _run(self) -> None:
        try:
            leg = await dial(
                self.stack,
                self.to_uri,
                ring_timeout_s=self.ring_timeout_s,
                trunk=self.trunk,
                from_user=self.playbook_id,
                headers={SESSION_HEADER: self.id},
                wideband=self.session.voice.speaker.sample_rate > PHONE_RATE,
            )
        except DialFailed as exc:
            result = exc.result
            self.result, self.status, self.reason = result.outcome, result.status, result.reason
            await self.hangup(result.reason)
            return
        except Exception as exc:  # a bug, or a socket error: the call fails, the server goes on
            self.log.exception("outbound call %s could not be placed", self.id)
            self.result, self.reason = "failed", f"{type(exc).__name__}: {exc}"
            await self.hangup(self.reason)
            return
        self.leg = leg
        self.result, self.status = "answered", 200
        self.answered_at = time.time()
        self._answered(leg)

    def _answered(self, leg: OutboundLeg) -> None:
        """Media both ways; the session starts once the pickup says who answered."""
        if self.hung_up:
            return
        self.clock.touch()
        rate = self.session.voice.speaker.sample_rate
        self._to_line = None if leg.rate == rate else Resampler(rate, leg.rate, aligned=True)
        self.hear_at(leg.rate)
        leg.on_audio = self.hear
        leg.on_dtmf = self._on_dtmf
        leg.on_hangup = self._peer_hung_up
        self.pickup = Pickup(
            PickupSettings(
                machine_after_ms=self.voicemail.detect_after_ms,
                message_silence_ms=self.voicemail.beep_timeout_ms,
            )
        )
        self.start_media(self._send, when_idle="silence")
        self.log.info("outbound call %s answered by %s (%s)", self.id, self.to_uri, leg.codec)
        self._announce("answered")

    def take_frame(self, frame: bytes, at: float) -> None:
        """The callee's next 20 ms frame (16 kHz): to the pickup until it decides, then to the
        session."""
        pickup = self.pickup
        if pickup is None or self.hung_up:
            return
        if pickup.verdict is None:
            verdict = pickup.push(frame, at)
            if verdict == "machine":
                self.answered_by = "voicemail"
                self._announce("answered", pickup=verdict, heard_ms=pickup.heard_ms)
                self.spawn(self._voicemail(), "voicemail")
            elif verdict is not None:
                self.answered_by = "person"
                self._announce("answered", pickup=verdict, heard_ms=pickup.heard_ms)
                self.session.start()  # the greeting
            return
        if pickup.verdict == "machine":
            pickup.push(frame, at)
            return
        self.session.feed(frame, at)

    def _on_dtmf(self, digit: str) -> None:
        self.heard_signal()
        self.clock.touch()
        if self.pickup is not None and self.pickup.verdict in ("person", "silent"):
            self.session.dtmf(digit)

    async def _send(self, pcm: bytes) -> None:
        if self.leg is not None:
            self.leg.send_pcm(pcm if self._to_line is None else self._to_line.resample(pcm))

    def _peer_hung_up(self, reason: str) -> None:
        self.spawn(self.hangup(reason), "sip-bye")

    async def _voicemail(self) -> None:
        """Hang up, or wait for the end of the greeting and leave the message, then hang up.
        The message is synthesized while the greeting plays, so it starts as the beep ends
        however long synthesis takes on this CPU."""
        message = self.voicemail.message
        if self.voicemail.action == "hangup" or message is None:
            await self.hangup("voicemail answered: hung up")
            return
        pickup = self.pickup
        assert pickup is not None
        tts = self.session.voice.voice().tts
        synthesized = [pcm async for pcm in tts.synthesize(message)]
        while not pickup.greeting_over:  # noqa: ASYNC110 - set by the audio callback
            await asyncio.sleep(0.02)
        self.clock.touch()
        speaker = self.session.voice.speaker
        heard: dict[str, Any] = {"after": pickup.over_by}
        if pickup.beep is not None:
            heard["beep_hz"] = pickup.beep.frequency_hz
            heard["beep_ms"] = pickup.beep.duration_ms
        self.events.publish({"type": "voicemail", "t_ms": _now_ms(), "message": message, **heard})
        playbacks = [speaker.push(pcm, tts.sample_rate) for pcm in synthesized]
        for playback in playbacks:
            await playback.finished()
        await asyncio.sleep(0.3)  # the last packets reach the machine before the BYE
        await self.hangup("voicemail answered: message left")

    # -- ending --------------------------------------------------------------------------------

    async def hangup(self, reason: str) -> None:
        if not self.hung_up and self.result is None:
            # ended by us (DELETE, shutdown) before any answer: the INVITE is cancelled
            self.result, self.reason = "no_answer", reason
        if not self.hung_up and self.reason is None:
            self.reason = reason
        await super().hangup(reason)

    async def close_transport(self, reason: str) -> None:
        dialing = self._dialing
        if dialing is not None and dialing is not asyncio.current_task():
            await asyncio.wait([dialing])  # cancelled by the hang-up: CANCEL sent, port freed
        if self.leg is not None:
            await self.leg.hangup()

    def release_resources(self) -> None:
        """The last ``call`` item (``ended``); the feed then ends (``TransportCall``)."""
        self.ended_at = time.time()
        self._announce("ended")


def _now_ms() -> float:
    return round(time.monotonic() * 1000, 1)
