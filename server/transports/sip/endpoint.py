"""The native SIP endpoint (``--sip HOST:PORT``): a user agent server any gateway, PBX or trunk
can route calls to.

Signalling is aiosipua's (RFC 3261 parsing with size caps, 100 Trying, 2xx retransmitted until the
ACK, CANCEL, BYE, OPTIONS, in-dialog checks), over UDP and TCP on the same port; media is aiortp's
(jitter buffer that reorders, loss concealment, RFC 4733 telephone-events, symmetric RTP).
Vocable decides which calls to take and runs each as a :class:`SipCall`:

- Any request: from a source outside ``--sip-allow`` nothing is answered at all; a malformed one
  (bad CSeq or Content-Length, unparseable SDP) 400, with the problem in a ``Warning`` header.
- INVITE: at capacity 503; an offer without PCMU/PCMA audio, or whose media address is not an IP
  address and port we can send to, 488; otherwise 180 then 200 with the SDP answer and an
  ``X-Vocable-Session`` header with the call's session id (``GET /calls/{id}/events``,
  ``DELETE /sessions/{id}``). The request URI's user part picks the playbook when one has that
  id (``sip:support@host``), else the default.
- re-INVITE: answered from the same port with the new direction (hold stops our audio).
- Audio: the agent's speaker is pulled on a steady 20 ms clock and sent as G.711, silence when
  the agent is quiet; barge-in clears the speaker, so the next packet is already silence.
  Caller audio is decoded, resampled to 16 kHz with swresample and fed to the session.
- Ends: BYE from the caller, our BYE when the session ends it (idle, maximum duration, no RTP
  for ``media_timeout_s``, server shutdown), or a missing ACK.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import re
import secrets
import socket
from collections.abc import Callable, Mapping

from aiosipua import (
    DialogState,
    IncomingCall,
    SdpMessage,
    SdpNegotiationError,
    SipRequest,
    SipResponse,
    SipUAS,
    negotiate_sdp,
    parse_sdp,
)
from aiosipua.headers import parse_via, stringify_via
from aiosipua.rtp_bridge import CallSession
from aiosipua.transport import SipTransport, TcpSipTransport

from playbooks.transfer import TransferOutcome, TransferRequest
from server.admission.ratelimit import RateLimited
from server.call.recordings import OPT_OUT_HEADER, wants_recording
from server.call.session import Session
from server.config.server import SipSettings
from server.runtime.registry import CallRegistry, OverCapacity
from server.transports.phone.audio import Encoding, encode
from server.transports.phone.line import PhoneCall

from .compat import (
    MessageHandler,
    UdpTransport,
    check_sip_stack,
    headers_in_answer,
    intercept_messages,
    record_route_in_answers,
    respond_and_end,
)
from .dialer import DialStack, parse_target
from .outbound import SESSION_HEADER, OutboundCall
from .rtp_ports import NoFreePort, RtpPortLease, RtpPorts
from .transfer import SipTransfers

__all__ = ["SipCall", "SipServer"]

log = logging.getLogger(__name__)

PHONE_RATE = 8000
RETRY_AFTER_S = 5
"""Seconds a caller refused for want of an RTP port is asked to wait."""
SAMPLES_PER_FRAME = 160
USER_AGENT = "Vocable"
_CODECS: dict[int, Encoding] = {0: "ulaw", 8: "alaw"}
_SENDING_DIRECTIONS = ("sendrecv", "sendonly")
MAX_CSEQ = 2**31 - 1
MAX_KEPT_CALLS = 1000
"""Outbound calls ``GET /calls/{id}`` can still describe (the oldest ended ones go first)."""
"""RFC 3261 8.1.1.5: a CSeq sequence number is below 2**31."""
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
"""One label of a host name (RFC 1123)."""


class SipCall(PhoneCall):
    """One answered SIP call: RTP both ways between the peer and a :class:`Session`."""

    transport = "SIP"

    def __init__(
        self,
        registry: CallRegistry,
        invite: IncomingCall,
        media: CallSession,
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
            "slin",
            PHONE_RATE,
            media_timeout_s=settings.media_timeout_s,
        )
        self.invite = invite
        self.media = media
        self.settings = settings
        self.rtp_port = rtp_port
        """The call's RTP port pair, given back once its socket is closed."""
        self.encoding = _CODECS[media.chosen_payload_type]
        self.answer = media.sdp_answer
        """The SDP answer in force (a re-INVITE replaces it)."""
        self.sending = _direction(self.answer) in _SENDING_DIRECTIONS
        self._timestamp = secrets.randbelow(1 << 32)
        self._on_end = on_end
        self.playbook_id = ""
        self._by_peer = False
        self._heard_caller = False
        self.transfers: SipTransfers | None = None
        self.relay: Callable[[bytes], None] | None = None
        """While bridged to a person (a transfer): where the caller's audio goes instead."""

    @property
    def sip_call_id(self) -> str:
        return self.invite.call_id

    async def start(self) -> None:
        """Bind RTP, answer with 200 OK and start the agent (greeting first)."""
        await self.media.start()
        if self.hung_up:  # cancelled while binding
            return
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
            self.relay(pcm)
            return
        self.hear(pcm)

    def _on_dtmf(self, digit: str, _duration: int) -> None:
        self.heard_signal()  # a digit replaces the caller's audio while it lasts
        self.clock.touch()
        self.session.dtmf(digit)

    async def _send(self, pcm: bytes) -> None:
        """Every 20 ms: our next frame out (the ``CallerGap`` ticks after it: silence in for
        the session while the caller sends nothing)."""
        if self.sending:
            self.media.send_audio(encode(pcm, self.encoding), self._timestamp)
        self._timestamp = (self._timestamp + SAMPLES_PER_FRAME) & 0xFFFFFFFF

    @property
    def receiving(self) -> bool:
        """Whether the peer should be sending us audio (not on hold)."""
        return _direction(self.answer) in ("sendrecv", "recvonly")

    def reoffer(self, invite: IncomingCall) -> None:
        """Answer a re-INVITE on the same port; a changed address or direction applies at once."""
        offer = invite.sdp_offer
        if offer is None:  # no offer: repeat our answer (RFC 3264 allows that)
            invite.accept(self.answer)
            return
        try:
            answer = _reanswer(offer, self.answer, self.media.chosen_payload_type)
            problem = _media_problem(offer, self.settings.host, on_hold_ok=True)
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
        self.sending = _direction(answer) in _SENDING_DIRECTIONS
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


class SipServer:
    """Listens for SIP over UDP and TCP on one port and runs each accepted INVITE as a call of
    ``registry``. Malformed or hostile messages are logged and dropped (or answered 4xx)."""

    def __init__(self, registry: CallRegistry, settings: SipSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.port = settings.port
        self.calls: dict[str, SipCall] = {}
        """Live calls by SIP Call-ID."""
        self.rtp_ports = RtpPorts(settings.rtp_ports)
        """The RTP port pairs calls lease."""
        self._agents: list[SipUAS] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._refused: set[str] = set()
        self.transfers = SipTransfers(lambda: self.dialer)
        self.dialer: DialStack | None = None
        """Outgoing legs (``dialer.dial``) over the UDP socket, once started."""
        self.outbound: dict[str, OutboundCall] = {}
        """Calls placed by ``POST /calls`` by session id: live ones and the latest ended."""

    async def start(self) -> None:
        """Listen; raises SipStackMismatch when the installed aiosipua is not a tested one,
        OSError when the port is taken."""
        check_sip_stack()
        host = self.settings.host
        if self.port == 0:
            self.port = _free_port(host)
        udp = UdpTransport((host, self.port), _sendable)
        self.dialer = DialStack(
            udp,
            self.rtp_ports,
            _host_ip(host),
            advertise=self.settings.advertise,
            signalling_addr=self._advertised(),
            user_agent=USER_AGENT,
        )
        for transport in (udp, TcpSipTransport(local_addr=(host, self.port))):
            agent = SipUAS(
                transport,
                user_agent=USER_AGENT,
                advertised_addr=self._advertised(),
                uac=self.dialer.uac if transport is udp else None,
            )
            agent.on_invite = self._on_invite
            agent.on_reinvite = self._on_reinvite
            agent.on_bye = self._on_bye
            agent.on_cancel = self._on_cancel
            agent.on_ack_timeout = self._on_ack_timeout
            agent.on_transfer_progress = self.transfers.progress
            await agent.start()
            intercept_messages(transport, self.transfers.intercept)  # behind the guard below
            intercept_messages(transport, functools.partial(_guard, transport, self._allowed))
            self._agents.append(agent)
        if not self.settings.allow and not ipaddress.ip_address(_host_ip(host)).is_loopback:
            log.warning("SIP on %s:%d answers any source; set --sip-allow", host, self.port)

    async def close(self) -> None:
        live = [*self.calls.values(), *self.outbound.values()]
        await asyncio.gather(
            *(call.hangup("server shutting down") for call in live), return_exceptions=True
        )
        for task in list(self._tasks):
            task.cancel()
        for agent in self._agents:
            with contextlib.suppress(Exception):
                await agent.stop()
        self._agents.clear()

    # -- admission -----------------------------------------------------------------------------

    def _allowed(self, addr: tuple[str, int]) -> bool:
        if not self.settings.allow or (self.dialer is not None and addr[0] in self.dialer.peers):
            return True
        try:
            source = ipaddress.ip_address(addr[0])
        except ValueError:
            return False
        if any(source in network for network in self.settings.allow):
            return True
        if addr[0] not in self._refused:  # log each refused source once
            self._refused.add(addr[0])
            log.warning("SIP from %s ignored: not in --sip-allow", addr[0])
        return False

    def _advertised(self) -> tuple[str, int] | None:
        ip = self.settings.advertise or _host_ip(self.settings.host)
        if ipaddress.ip_address(ip).is_unspecified:
            return None
        return (ip, self.port)

    def _on_invite(self, invite: IncomingCall) -> None:
        task = asyncio.create_task(
            self._answer_or_fail(invite), name=f"sip-invite:{invite.call_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer_or_fail(self, invite: IncomingCall) -> None:
        try:
            await self._answer(invite)
        except Exception:  # a bug: say so, and do not leave the caller ringing
            log.exception("SIP INVITE %s could not be answered", invite.call_id)
            if invite.dialog.state is DialogState.EARLY:
                with contextlib.suppress(Exception):
                    invite.reject(500, "Server Internal Error")

    async def _answer(self, invite: IncomingCall) -> None:
        offer = invite.sdp_offer
        if offer is None:
            invite.reject(488, "Not Acceptable Here")  # late offer (SDP in the ACK): unsupported
            return
        problem = _media_problem(offer, self.settings.host)
        if problem is not None:
            log.warning("SIP call from %s refused: %s", invite.caller, problem)
            invite.reject(488, "Not Acceptable Here")
            return
        if invite.dialog.state is DialogState.TERMINATED:  # cancelled before we got here
            return
        call = self._open(invite, offer)
        if call is None:
            return
        self.calls[invite.call_id] = call
        record_route_in_answers(invite)
        headers_in_answer(invite, {SESSION_HEADER: call.id})
        invite.ringing()
        try:
            await call.start()
        except Exception:
            log.exception("SIP call %s could not start", call.id)
            if invite.dialog.state is not DialogState.CONFIRMED:
                invite.reject(500, "Server Internal Error")
            await call.hangup("could not start")
            return
        log.info(
            "SIP call %s from %s (%s, playbook %s)",
            call.id,
            invite.caller,
            call.encoding,
            call.playbook_id,
        )

    def _open(self, invite: IncomingCall, offer: SdpMessage) -> SipCall | None:
        """The admitted call, on an RTP port of its own; None when the INVITE was refused: 503
        with Retry-After (full, draining, overloaded, rate-limited, no free port) or 488 (media
        we cannot use). A refused call holds no port."""
        registry = self.registry
        playbook_id = registry.playbook_id(_requested_playbook(invite, registry.engines.playbooks))
        opt_out = invite.invite.headers.get_first(OPT_OUT_HEADER)
        with contextlib.ExitStack() as unless_admitted:

            def build(call_id: str, session: Session) -> SipCall:
                rtp_port = self.rtp_ports.lease()
                unless_admitted.callback(rtp_port.release)  # the call gives it back once admitted
                media = CallSession(
                    local_ip=self.settings.host,
                    rtp_port=rtp_port.port,
                    offer=offer,
                    advertised_ip=self._media_ip(invite.source_addr),
                    supported_codecs=list(_CODECS),
                    dtmf_payload_type=_offered_dtmf_type(offer),
                    symmetric_rtp=True,
                )
                call = SipCall(
                    registry,
                    invite,
                    media,
                    call_id,
                    session,
                    self.settings,
                    rtp_port,
                    self._forget,
                )
                call.transfers = self.transfers
                call.playbook_id = playbook_id
                return call

            try:
                call = registry.open(
                    build,
                    rate=PHONE_RATE,
                    playbook=playbook_id,
                    address=invite.source_addr[0],
                    record=wants_recording(opt_out),
                )
            except (OverCapacity, RateLimited) as exc:
                log.warning("SIP call from %s refused: %s", invite.caller, exc)
                _refuse(invite, exc.retry_after_s)
                return None
            except NoFreePort as exc:
                log.error("SIP call refused: %s", exc)
                _refuse(invite, RETRY_AFTER_S)
                return None
            except (SdpNegotiationError, ValueError) as exc:
                log.warning("SIP call from %s refused: %s", invite.caller, exc)
                invite.reject(488, "Not Acceptable Here")
                return None
            unless_admitted.pop_all()
        return call

    # -- outbound ------------------------------------------------------------------------------

    def place_call(
        self,
        to_uri: str,
        playbook: str | None,
        *,
        ring_timeout_s: float | None = None,
        address: str | None = None,
    ) -> OutboundCall:
        """Admit and start an outbound call to ``to_uri`` running ``playbook`` (default: the
        server's); ``address`` is the requesting client's, for the rate limit. Raises
        ValueError (a bad URI), UnknownPlaybook, OverCapacity, RateLimited, RuntimeError (not
        started)."""
        if self.dialer is None:
            raise RuntimeError("the SIP endpoint is not started")
        parse_target(to_uri)
        registry = self.registry
        dialer = self.dialer
        playbook_id = registry.playbook_id(playbook)

        def build(call_id: str, session: Session) -> OutboundCall:
            return OutboundCall(
                registry,
                call_id,
                session,
                dialer,
                to_uri,
                playbook_id,
                ring_timeout_s or self.settings.ring_timeout_s,
                self.settings,
                registry.engines.playbooks[playbook_id].spec.voicemail,
            )

        call = registry.open(build, rate=PHONE_RATE, playbook=playbook_id, address=address)
        call_id = call.id
        self.outbound[call_id] = call
        while len(self.outbound) > MAX_KEPT_CALLS:  # forget the oldest ended calls
            oldest = next((k for k, c in self.outbound.items() if c.state == "ended"), None)
            if oldest is None:
                break
            del self.outbound[oldest]
        call.start()
        log.info("SIP outbound call %s to %s (playbook %s)", call_id, to_uri, playbook_id)
        return call

    def _forget(self, call: SipCall) -> None:
        self.calls.pop(call.sip_call_id, None)

    def _media_ip(self, peer: tuple[str, int]) -> str | None:
        """The address to put in SDP: the advertised one, else the bind address, else the local
        address that routes to ``peer``."""
        if self.settings.advertise:
            return self.settings.advertise
        host = _host_ip(self.settings.host)
        if not ipaddress.ip_address(host).is_unspecified:
            return None
        return _local_ip_towards(peer[0])

    # -- in-dialog -----------------------------------------------------------------------------

    def _on_reinvite(self, invite: IncomingCall) -> None:
        if self.dialer is not None and self.dialer.reoffered(invite):
            return
        call = self.calls.get(invite.call_id)
        if call is None:
            invite.reject(481, "Call/Transaction Does Not Exist")
            return
        call.reoffer(invite)

    def _on_bye(self, invite: IncomingCall, _request: SipRequest) -> None:
        if self.dialer is not None and self.dialer.peer_hung_up(invite.call_id):
            return
        self._end(invite.call_id, "caller hung up")

    def _on_cancel(self, request: SipRequest, _addr: tuple[str, int]) -> None:
        # A CANCEL racing our 200 OK cannot undo the answer: end that dialog with a BYE.
        call = self.calls.get(request.call_id or "")
        answered = call is not None and call.invite.dialog.state is DialogState.CONFIRMED
        self._end(request.call_id or "", "caller cancelled", by_peer=not answered)

    def _on_ack_timeout(self, invite: IncomingCall) -> None:
        self._end(invite.call_id, "no ACK for the answer", by_peer=True)

    def _end(self, sip_call_id: str, reason: str, *, by_peer: bool = True) -> None:
        call = self.calls.get(sip_call_id)
        if call is None:
            return
        task = asyncio.create_task(call.hangup(reason, by_peer=by_peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


# -- helpers -----------------------------------------------------------------------------------


def _sendable(host: str, port: int) -> bool:
    """Whether ``(host, port)`` is an address a datagram may be sent to."""
    return isinstance(port, int) and 0 < port < 65536 and _sendable_host(host)


def _stamp_source(request: SipRequest, addr: tuple[str, int]) -> None:
    """Set the top Via's ``received``/``rport`` to the true source, which reply routing follows."""
    vias = request.headers.get("via")
    if not vias:
        return
    top = parse_via(vias[0])
    top.params["received"] = addr[0]
    top.params["rport"] = str(addr[1])
    request.headers.remove("Via")
    for value in (stringify_via(top), *vias[1:]):
        request.headers.append("Via", value)


def _refuse(invite: IncomingCall, retry_after_s: float) -> None:
    """503 with Retry-After (RFC 3261 21.5.4): over capacity, shutting down, or rate limited."""
    respond_and_end(invite, 503, "Service Unavailable", {"Retry-After": f"{retry_after_s:.0f}"})


def _guard(
    transport: SipTransport, allowed: Callable[[tuple[str, int]], bool], handler: MessageHandler
) -> MessageHandler:
    """``handler`` behind a filter: drop every message from a source ``allowed`` refuses, and
    answer 400 to a malformed request. Over TCP, also make replies go back on the connection
    each request came in on (RFC 3261 §18.2.2): aiosipua routes replies by the top Via, whose
    sent-by port has no connection."""
    reliable = transport.reliable

    def filtered(message: SipRequest | SipResponse, addr: tuple[str, int]) -> None:
        if not allowed(addr):
            return
        if not isinstance(message, SipRequest):
            handler(message, addr)
            return
        if reliable:
            _stamp_source(message, addr)
        problem = _malformed(message)
        if problem is None:
            try:
                handler(message, addr)
                return
            except ValueError as exc:  # a header aiosipua could not read, half-way through
                problem = str(exc)
        _bad_request(transport, message, addr, problem)

    return filtered


def _malformed(request: SipRequest) -> str | None:
    """Why ``request`` gets 400 Bad Request (RFC 3261 8.1.1.5, 18.3), or None: what aiosipua
    does not check itself (it fails, or goes on, with these)."""
    cseq = request.headers.get_first("cseq")
    if cseq is not None:
        number, *method = cseq.split() or [""]
        value = _number(number)
        if value is None or value > MAX_CSEQ:
            return "bad CSeq number"
        if method != [request.method]:
            return "CSeq method does not match the request"
    length = request.headers.get_first("content-length")
    if length is not None:
        declared = _number(length)
        if declared is None:
            return "bad Content-Length"
        if declared > len(request.body):
            return "body shorter than its Content-Length"
    if request.body and request.content_type == "application/sdp":
        try:
            parse_sdp(request.text)
        except ValueError as exc:
            return f"malformed SDP: {exc}"
    return None


def _bad_request(
    transport: SipTransport, request: SipRequest, addr: tuple[str, int], problem: str
) -> None:
    """Log ``problem`` and answer 400 with it in a Warning header (RFC 3261 20.43), unless the
    request is an ACK (never answered) or has no Via to route the answer by."""
    method = request.method[:20]
    log.warning("SIP %r from %s:%d refused: %s", method, addr[0], addr[1], problem[:200])
    if request.method == "ACK" or not request.headers.get("via"):
        return
    response = SipResponse(status_code=400, reason_phrase="Bad Request")
    for name in ("Via", "From", "Call-ID", "CSeq"):
        for value in request.headers.get(name):
            response.headers.append(name, value)
    to = request.headers.get_first("to")
    if to is not None:
        response.headers.set_single(
            "To", to if ";tag=" in to else f"{to};tag={secrets.token_hex(4)}"
        )
    text = "".join(
        c if c.isascii() and c.isprintable() and c not in '"\\' else "?" for c in problem
    )
    response.headers.set_single("Warning", f'399 {USER_AGENT.lower()} "{text[:120]}"')
    response.headers.set_single("User-Agent", USER_AGENT)
    try:
        transport.send_reply(response)
    except (ValueError, RuntimeError) as exc:  # no route back (no usable Via, TCP gone)
        log.warning("SIP 400 to %s:%d not sent: %s", addr[0], addr[1], exc)


def _media_problem(offer: SdpMessage, local_host: str, *, on_hold_ok: bool = False) -> str | None:
    """Why the offer's audio cannot be sent to, or None: not an IP address of our RTP socket's
    family, or a port outside 1-65535 (0, a stream declined, only on hold when ``on_hold_ok``)."""
    remote = offer.rtp_address
    if remote is None:
        return None  # CallSession refuses that (no c= or m=audio)
    host, port = remote
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"media address {host[:60]!r} is not an IP address"
    family = _ip_version(local_host)
    if address.version != family:
        return f"media address {host} is not IPv{family} like ours"
    if not 0 < port < 65536 and not (on_hold_ok and port == 0):
        return f"media port {port} is out of range"
    return None


@functools.cache
def _ip_version(host: str) -> int:
    """4 or 6: the family of the address ``host`` (our bind address) names."""
    return ipaddress.ip_address(_host_ip(host)).version


def _sendable_host(host: str) -> bool:
    """An IP address, or a host name the socket module resolves without raising anything
    other than OSError."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        labels = host.removesuffix(".").split(".")
        return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)
    return True


def _number(text: str) -> int | None:
    """A header's decimal number (up to 10 digits; more is taken as 10**10), or None."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return int(digits) if len(digits) <= 10 else 10**10


def _reanswer(offer: SdpMessage, current: SdpMessage, payload_type: int) -> SdpMessage:
    """An answer to a re-INVITE's ``offer`` keeping the call's address, port and codec; raises
    SdpNegotiationError when the offer drops that codec."""
    address = current.connection.address if current.connection else "0.0.0.0"
    answer, _ = negotiate_sdp(
        offer,
        local_ip=address,
        rtp_port=current.audio.port if current.audio else 0,
        supported_codecs=[payload_type],
        dtmf_payload_type=_offered_dtmf_type(offer),
    )
    return answer


def _direction(sdp: SdpMessage) -> str:
    audio = sdp.audio
    return audio.direction if audio is not None else "inactive"


def _offered_dtmf_type(offer: SdpMessage) -> int:
    """The payload type the offer uses for telephone-event at 8 kHz (answers must reuse it);
    101 when it offers none (the answer then carries no telephone-event)."""
    audio = offer.audio
    for codec in audio.codecs if audio is not None else []:
        if (
            codec.encoding_name.lower() == "telephone-event"
            and codec.clock_rate in (0, 8000)
            and 0 <= codec.payload_type <= 127
        ):
            return codec.payload_type
    return 101


def _requested_playbook(invite: IncomingCall, playbooks: Mapping[str, object]) -> str | None:
    user = invite.invite.uri.partition(":")[2].partition("@")[0].partition(";")[0]
    return user if user in playbooks else None


def _host_ip(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


def _local_ip_towards(peer: str) -> str:
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))  # UDP connect sends nothing; it only picks the route
        return str(probe.getsockname()[0])


def _free_port(host: str) -> int:
    """A port free for both UDP and TCP on ``host`` (for ``--sip HOST:0`` in tests)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind((host, 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind((host, port))
                except OSError:
                    continue
                return port
    raise OSError("no free port for SIP")
