"""The native SIP endpoint (``--sip HOST:PORT``): a user agent server any gateway, PBX or trunk
can route calls to.

Signalling is aiosipua's (RFC 3261 parsing with size caps, 100 Trying, 2xx retransmitted until the
ACK, CANCEL, BYE, OPTIONS, in-dialog checks), over UDP and TCP on the same port; media is aiortp's
(jitter buffer that reorders, loss concealment, RFC 4733 telephone-events, symmetric RTP).
Vocable decides which calls to take and runs each as a :class:`SipCall`:

- Any request: from a source outside ``--sip-allow`` nothing is answered at all, unless
  ``--sip-auth`` is set: then a new INVITE from such a source is challenged (401, digest) and
  taken only with the account's credentials; a source whose answers keep failing is refused
  (403) for a minute. A malformed request (bad CSeq or Content-Length, unparseable SDP) 400,
  with the problem in a ``Warning`` header.
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
import socket
from collections.abc import Mapping

from aiosipua import DialogState, IncomingCall, SdpMessage, SdpNegotiationError, SipRequest, SipUAS
from aiosipua.transport import SipTransport, TcpSipTransport

from server.admission.ratelimit import RateLimited
from server.call.recordings import OPT_OUT_HEADER, wants_recording
from server.call.session import Session
from server.config.server import SipSettings
from server.config.sip_trunks import hostport, pick_trunk
from server.runtime.registry import CallRegistry, OverCapacity

from .call import PHONE_RATE, SipCall
from .compat import (
    TlsTransport,
    UdpTransport,
    check_sip_stack,
    headers_in_answer,
    intercept_messages,
    record_route_in_answers,
    respond_and_end,
)
from .dialer import DialStack, parse_target
from .digest import DigestRealm, FailureThrottle
from .media_session import call_media
from .opus import opus_available, use_opus_at
from .outbound import SESSION_HEADER, OutboundCall
from .registration import Registrar
from .resolve import SipResolver
from .rfc3261 import USER_AGENT, guard, warning
from .rtp_ports import NoFreePort, RtpPorts
from .sdp import (
    G722,
    choose_codec,
    codec_rate,
    host_ip,
    media_problem,
    offered_dtmf_type,
    opus_answer,
    sendable,
    wideband_available,
)
from .srtp import choose_crypto, secure_answer, secured, srtp_problem
from .transfer import SipTransfers

__all__ = ["SipServer"]

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
"""Seconds a caller refused for want of an RTP port is asked to wait."""
MAX_KEPT_CALLS = 1000
"""Outbound calls ``GET /calls/{id}`` can still describe (the oldest ended ones go first)."""


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
        self.registrar: Registrar | None = None
        """The registration at a PBX (``--sip-register``), once started."""
        auth = settings.auth
        self.realm = (
            None
            if auth is None
            else DigestRealm(auth.realm, auth.username, auth.password, algorithm=auth.algorithm)
        )
        """What INVITEs from outside the allowlist must prove (``--sip-auth``); None: no
        answer for them."""
        self.throttle = FailureThrottle()

    async def start(self) -> None:
        """Listen; raises SipStackMismatch when the installed aiosipua is not a tested one,
        OSError when the port is taken."""
        check_sip_stack()
        host = self.settings.host
        if self.port == 0:
            self.port = _free_port(host)
        udp = UdpTransport((host, self.port), sendable)
        self.dialer = DialStack(
            udp,
            self.rtp_ports,
            host_ip(host),
            advertise=self.settings.advertise,
            signalling_addr=self._advertised(),
            user_agent=USER_AGENT,
            resolver=SipResolver(self.settings.dns_server),
        )
        transports: list[tuple[SipTransport, tuple[str, int] | None]] = [
            (udp, self._advertised()),
            (TcpSipTransport(local_addr=(host, self.port)), self._advertised()),
        ]
        tls = self.settings.tls
        if tls is not None:
            secure = TlsTransport(local_addr=(tls.host, tls.port), ssl_context=tls.context())
            transports.append((secure, self._advertised(tls.port)))
        for transport, advertised in transports:
            uac = None
            if transport is udp:
                uac = self.dialer.uac
            elif isinstance(transport, TlsTransport):  # trunks on TLS dial over it too
                uac = self.dialer.use_tls(transport, advertised)
            agent = SipUAS(transport, user_agent=USER_AGENT, advertised_addr=advertised, uac=uac)
            if isinstance(transport, TlsTransport):
                agent.on_invite = functools.partial(self._on_invite, over_tls=True)
            else:
                agent.on_invite = self._on_invite
            agent.on_reinvite = self._on_reinvite
            agent.on_bye = self._on_bye
            agent.on_cancel = self._on_cancel
            agent.on_ack_timeout = self._on_ack_timeout
            agent.on_transfer_progress = self.transfers.progress
            await agent.start()
            intercept_messages(transport, self.transfers.intercept)  # behind the guard below
            intercept_messages(transport, functools.partial(guard, transport, self._allowed))
            self._agents.append(agent)
        loopback = ipaddress.ip_address(host_ip(host)).is_loopback
        if not self.settings.allow and self.realm is None and not loopback:
            log.warning("SIP on %s:%d answers any source; set --sip-allow", host, self.port)
        if self.settings.register is not None:
            register, tls = self.settings.register, self.settings.tls
            port = tls.port if register.transport == "tls" and tls is not None else self.port
            self.registrar = Registrar(self.dialer, udp, register, port)
            self.registrar.start()

    async def unregister(self) -> None:
        """Remove the registration (on drain: the PBX stops sending calls here)."""
        if self.registrar is not None:
            await self.registrar.close()

    async def close(self) -> None:
        await self.unregister()
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
        if self.realm is not None or self._listed(addr):
            return True  # with --sip-auth, new INVITEs from outside are challenged instead
        return self._refuse_once(addr)

    def _listed(self, addr: tuple[str, int]) -> bool:
        """Whether ``addr`` is trusted: a peer we dial or call, our registrar, or in
        ``--sip-allow`` (no allowlist: any source, unless ``--sip-auth`` is set)."""
        if self.dialer is not None and addr[0] in self.dialer.peers:
            return True
        if self.registrar is not None and addr[0] == self.registrar.address[0]:
            return True  # its answers, and the calls it routes to the extension
        if not self.settings.allow:
            return self.realm is None
        try:
            source = ipaddress.ip_address(addr[0])
        except ValueError:
            return False
        return any(source in network for network in self.settings.allow)

    def _refuse_once(self, addr: tuple[str, int]) -> bool:
        if addr[0] not in self._refused:  # log each refused source once
            self._refused.add(addr[0])
            log.warning("SIP from %s ignored: not in --sip-allow", addr[0])
        return False

    def _advertised(self, port: int | None = None) -> tuple[str, int] | None:
        ip = self.settings.advertise or host_ip(self.settings.host)
        if ipaddress.ip_address(ip).is_unspecified:
            return None
        return (ip, port or self.port)

    def _on_invite(self, invite: IncomingCall, *, over_tls: bool = False) -> None:
        task = asyncio.create_task(
            self._answer_or_fail(invite, over_tls), name=f"sip-invite:{invite.call_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer_or_fail(self, invite: IncomingCall, over_tls: bool = False) -> None:
        try:
            await self._answer(invite, over_tls)
        except Exception:  # a bug: say so, and do not leave the caller ringing
            log.exception("SIP INVITE %s could not be answered", invite.call_id)
            if invite.dialog.state is DialogState.EARLY:
                with contextlib.suppress(Exception):
                    invite.reject(500, "Server Internal Error")

    def _authenticated(self, invite: IncomingCall) -> bool:
        """Whether ``invite`` may go on: from a trusted source, or with credentials that
        answer ``--sip-auth``'s challenge. Otherwise it is answered here (401 with a challenge;
        403 while its source is throttled) and False."""
        source = invite.source_addr
        if self.realm is None or self._listed(source):
            return True
        if self.throttle.refused(source[0]):
            invite.reject(403, "Forbidden")
            return False
        check = self.realm.check(invite.invite.headers.get_first("authorization"), "INVITE")
        if check == "ok":
            self.throttle.succeeded(source[0])
            return True
        if check == "bad":
            self.throttle.failed(source[0])
            log.warning("SIP INVITE from %s: digest credentials refused", source[0])
        challenge = self.realm.challenge(stale=check == "stale")
        respond_and_end(invite, 401, "Unauthorized", {"WWW-Authenticate": challenge})
        return False

    async def _answer(self, invite: IncomingCall, over_tls: bool = False) -> None:
        if not self._authenticated(invite):
            return
        offer = invite.sdp_offer
        if offer is None:
            invite.reject(488, "Not Acceptable Here")  # late offer (SDP in the ACK): unsupported
            return
        problem = media_problem(offer, self.settings.host)
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
        answer_headers = {SESSION_HEADER: call.id}
        if over_tls and self.settings.tls is not None and self.dialer is not None:
            here = hostport(self.dialer.media_ip(invite.source_addr[0]), self.settings.tls.port)
            answer_headers["Contact"] = f"<sip:{here};transport=tls>"  # the dialog stays on TLS
        headers_in_answer(invite, answer_headers)
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
        chosen = choose_codec(offer)
        problem = srtp_problem(offer, self.settings.srtp)
        if chosen is None:
            problem = "no Opus, G.722 or G.711 audio offered"
        if problem is not None:
            log.warning("SIP call from %s refused: %s", invite.caller, problem)
            respond_and_end(invite, 488, "Not Acceptable Here", {"Warning": warning(problem)})
            return None
        assert chosen is not None
        theirs = choose_crypto(offer) if secured(offer) else None
        with contextlib.ExitStack() as unless_admitted:

            def build(call_id: str, session: Session) -> SipCall:
                rtp_port = self.rtp_ports.lease()
                unless_admitted.callback(rtp_port.release)  # the call gives it back once admitted
                if chosen.name == "opus":
                    use_opus_at(chosen.payload_type)
                media = call_media(
                    self.settings.host,
                    rtp_port.port,
                    offer,
                    advertised_ip=self._media_ip(invite.source_addr),
                    supported_codecs=[chosen.payload_type],
                    dtmf_payload_type=offered_dtmf_type(offer),
                )
                if chosen.name == "opus":
                    opus_answer(media.sdp_answer, chosen.payload_type)
                call = SipCall(
                    registry,
                    invite,
                    media,
                    chosen,
                    call_id,
                    session,
                    self.settings,
                    rtp_port,
                    self._forget,
                )
                call.transfers = self.transfers
                call.playbook_id = playbook_id
                if theirs is not None:
                    call.srtp = (theirs, secure_answer(media.sdp_answer, theirs))
                return call

            try:
                call = registry.open(
                    build,
                    rate=chosen.rate,
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
        trunk: str | None = None,
        address: str | None = None,
    ) -> OutboundCall:
        """Admit and start an outbound call to ``to_uri`` (a SIP URI, or a number the trunk
        calls at its host) running ``playbook`` (default: the server's), through the trunk
        named ``trunk`` (default: :func:`~server.config.sip_trunks.pick_trunk`'s); ``address``
        is the requesting client's, for the rate limit. Raises ValueError (a bad URI, an
        unknown trunk), UnknownPlaybook, OverCapacity, RateLimited, RuntimeError (not
        started)."""
        if self.dialer is None:
            raise RuntimeError("the SIP endpoint is not started")
        way_out = pick_trunk(self.settings.trunks, trunk)
        if way_out is not None:
            to_uri = way_out.target(to_uri)
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
                way_out,
            )

        wide = wideband_available() or opus_available()  # offered first: 16 kHz
        rate = codec_rate(G722) if wide else PHONE_RATE
        call = registry.open(build, rate=rate, playbook=playbook_id, address=address)
        call_id = call.id
        self.outbound[call_id] = call
        while len(self.outbound) > MAX_KEPT_CALLS:  # forget the oldest ended calls
            oldest = next((k for k, c in self.outbound.items() if c.state == "ended"), None)
            if oldest is None:
                break
            del self.outbound[oldest]
        call.start()
        via = "" if way_out is None else f", trunk {way_out.name}"
        log.info("SIP outbound call %s to %s (playbook %s%s)", call_id, to_uri, playbook_id, via)
        return call

    def _forget(self, call: SipCall) -> None:
        self.calls.pop(call.sip_call_id, None)

    def _media_ip(self, peer: tuple[str, int]) -> str | None:
        """The address to put in SDP: the advertised one, else the bind address, else the local
        address that routes to ``peer``."""
        if self.settings.advertise:
            return self.settings.advertise
        host = host_ip(self.settings.host)
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


def _refuse(invite: IncomingCall, retry_after_s: float) -> None:
    """503 with Retry-After (RFC 3261 21.5.4): over capacity, shutting down, or rate limited."""
    respond_and_end(invite, 503, "Service Unavailable", {"Retry-After": f"{retry_after_s:.0f}"})


def _requested_playbook(invite: IncomingCall, playbooks: Mapping[str, object]) -> str | None:
    user = invite.invite.uri.partition(":")[2].partition("@")[0].partition(";")[0]
    return user if user in playbooks else None


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
