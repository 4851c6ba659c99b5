"""One SIP call the endpoint answered: its RTP media, the agent's audio sent as Opus, G.722 or
G.711 on a steady 20 ms clock, the caller's decoded for the session, re-INVITEs (hold) and
transfers."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from aiosipua import IncomingCall, SdpNegotiationError
from aiosipua.rtp_bridge import CallSession

from media import Resampler
from playbooks.transfer import TransferOutcome, TransferRequest
from server.call.session import Session
from server.config.server import SipSettings
from server.runtime.registry import CallRegistry
from server.transports.phone.audio import encode
from server.transports.phone.line import PhoneCall

from .rtp_ports import RtpPortLease
from .sdp import (
    SENDING_DIRECTIONS,
    LineCodec,
    direction,
    media_problem,
    reanswer,
)
from .srtp import Crypto, protect_session
from .transfer import SipTransfers

__all__ = ["PHONE_RATE", "SipCall"]

log = logging.getLogger(__name__)

PHONE_RATE = 8000


class SipCall(PhoneCall):
    """One answered SIP call: RTP both ways between the peer and a :class:`Session`."""

    transport = "SIP"

    def __init__(
        self,
        registry: CallRegistry,
        invite: IncomingCall,
        media: CallSession,
        codec: LineCodec,
        call_id: str,
        session: Session,
        settings: SipSettings,
        rtp_port: RtpPortLease,
        on_end: Callable[[SipCall], None],
    ) -> None:
        super().__init__(
            registry,
            call_id,
            session,
            "slin",  # aiortp decodes
            codec.rate,
            media_timeout_s=settings.media_timeout_s,
        )
        self.invite = invite
        self.media = media
        self.settings = settings
        self.rtp_port = rtp_port
        """The call's RTP port pair, given back once its socket is closed."""
        self.codec = codec
        self.encoding = codec.name
        """The codec's name: opus, G722, PCMU or PCMA."""
        self.answer = media.sdp_answer
        """The SDP answer in force (a re-INVITE replaces it)."""
        self.sending = direction(self.answer) in SENDING_DIRECTIONS
        self._timestamp = secrets.randbelow(1 << 32)
        self._on_end = on_end
        self.playbook_id = ""
        self._by_peer = False
        self._heard_caller = False
        self.transfers: SipTransfers | None = None
        self.srtp: tuple[Crypto, Crypto] | None = None
        """The caller's SDES key and ours, when the call is on SRTP (set before :meth:`start`)."""
        self.relay: Callable[[bytes], None] | None = None
        """While bridged to a person (a transfer): where the caller's audio goes instead, at
        8 kHz (a bridge's leg is G.711)."""
        self._narrow = None if codec.rate == PHONE_RATE else Resampler(codec.rate, PHONE_RATE)

    @property
    def sip_call_id(self) -> str:
        return self.invite.call_id

    async def start(self) -> None:
        """Bind RTP, answer with 200 OK and start the agent (greeting first)."""
        await self.media.start()
        if self.hung_up:  # cancelled while binding
            return
        if self.srtp is not None:
            protect_session(self.media.rtp_session, *self.srtp)
        self.media.on_audio = self._on_audio
        self.media.on_dtmf = self._on_dtmf
        self.invite.accept(self.answer)
        self.start_media(self._send, when_idle="silence")
        self.session.start()

    def _on_audio(self, pcm: bytes, _timestamp: int) -> None:
        if not self._heard_caller:
            self._heard_caller = True
            log.debug("SIP call %s: first RTP audio from the caller", self.id)
        if self.relay is not None:
            self.heard_signal()
            self.relay(pcm if self._narrow is None else self._narrow.resample(pcm))
            return
        self.hear(pcm)

    def _on_dtmf(self, digit: str, _duration: int) -> None:
        self.heard_signal()  # a digit replaces the caller's audio while it lasts
        self.clock.touch()
        self.session.dtmf(digit)

    async def _send(self, pcm: bytes) -> None:
        """Every 20 ms: our next frame out (the ``CallerGap`` ticks after it: silence in for
        the session while the caller sends nothing)."""
        g711 = self.codec.g711
        if self.sending and g711 is not None:
            self.media.send_audio(encode(pcm, g711), self._timestamp)
        elif self.sending:
            self.media.send_audio_pcm(pcm, self._timestamp)
        self._timestamp = (self._timestamp + self.codec.ticks_per_frame) & 0xFFFFFFFF

    @property
    def receiving(self) -> bool:
        """Whether the peer should be sending us audio (not on hold)."""
        return direction(self.answer) in ("sendrecv", "recvonly")

    def reoffer(self, invite: IncomingCall) -> None:
        """Answer a re-INVITE on the same port; a changed address or direction applies at once."""
        offer = invite.sdp_offer
        if offer is None:  # no offer: repeat our answer (RFC 3264 allows that)
            invite.accept(self.answer)
            return
        try:
            answer = reanswer(offer, self.answer, self.codec)
            if self.srtp is not None:  # the keys stay those of the call
                audio = answer.audio
                assert audio is not None
                audio.proto = "RTP/SAVP"
                audio.attributes["crypto"] = [self.srtp[1].line()]
            problem = media_problem(offer, self.settings.host, on_hold_ok=True)
            if problem is not None:
                raise ValueError(problem)
        except (SdpNegotiationError, ValueError) as exc:
            log.warning("SIP call %s: re-INVITE refused: %s", self.id, exc)
            invite.reject(488, "Not Acceptable Here")
            return
        remote = offer.rtp_address
        if remote is not None and remote[1] != 0:
            self.media.update_remote(remote)
        self.answer = answer
        self.sending = direction(answer) in SENDING_DIRECTIONS
        self.heard_signal()  # the media timeout counts from the new offer
        invite.accept(answer)

    def transfer_problem(self, request: TransferRequest) -> str | None:
        return None if self.transfers is not None else "the SIP endpoint has no transfers"

    async def transfer(self, request: TransferRequest) -> TransferOutcome:
        """REFER, else a bridge (``transfer``)."""
        assert self.transfers is not None
        return await self.transfers.transfer(self, request)

    async def hangup(self, reason: str, *, by_peer: bool = False) -> None:
        """End the call (our BYE unless the peer ended it) and free everything. Idempotent."""
        if not self.hung_up:
            self._by_peer = by_peer
        await super().hangup(reason)

    def ending(self, reason: str) -> None:
        if not self._by_peer:
            self.invite.hangup()

    async def close_transport(self, reason: str) -> None:
        await self.media.close()

    def release_resources(self) -> None:
        try:
            self.rtp_port.release()
        finally:
            self._on_end(self)
