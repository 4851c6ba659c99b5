"""Outgoing SIP legs: Vocable as the caller (UAC). Independent of sessions and playbooks, so a leg
can carry an agent's call (``outbound.py``) or one side of a bridge.

Contract::

    leg = await dial(stack, "sip:alice@192.0.2.7:5060", ring_timeout_s=30)
    leg.on_audio = lambda pcm: ...     # the callee's audio: PCM16 at leg.rate, as RTP delivers it
    leg.send_pcm(frame)                # ours: PCM16 at leg.rate, one call per 20 ms frame
    leg.on_hangup = lambda reason: ... # the callee hung up (BYE); called once
    await leg.hangup()                 # BYE (unless the callee hung up), RTP closed, port freed

:func:`dial` sends the INVITE (PCMU and PCMA offered, Opus and G.722 first when ``wideband``;
RFC 4733 digits), retransmits it until the callee answers anything (RFC 3261 Timer A, over UDP),
and returns an :class:`OutboundLeg` once a 200 OK is ACKed and its RTP socket is bound. Every
other ending raises :class:`DialFailed`, whose :class:`DialResult` says which: ``busy`` (486,
600), ``no_answer`` (no final answer within ``ring_timeout_s``: CANCEL sent; or 408/480),
``rejected`` (any other 3xx-6xx; a 401/407 challenge is answered once with the trunk's
credentials, ``authentication failed`` when they are refused), ``failed`` (no route, an unusable
SDP answer). Cancelling ``dial()`` sends CANCEL (or BYE if the answer won the race) and frees
the port. Nothing of the leg is left behind whichever way ``dial()`` ends without returning it.

The leg does not pace itself (the caller of ``send_pcm`` does, every 20 ms) nor watch for silent
media; the :class:`DialStack` comes from the running SIP endpoint (``SipServer.dialer``), which
routes the callee's in-dialog requests (BYE, re-INVITE) to the leg. Signalling is UDP, sent to
the trunk's outbound proxy (with a ``Route`` naming it) or else straight to the URI's host and
port (no DNS SRV). The answer's ``Contact`` and ``Record-Route`` set where the ACK and the
dialog's later requests go (RFC 3261 12.1.2): through every proxy that asked to stay on the path.
A :class:`~server.config.sip_trunks.Trunk` also gives the From (caller ID, display name) and
``P-Asserted-Identity``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from aiosipua import (
    Dialog,
    DialogState,
    IncomingCall,
    OutgoingCall,
    SdpMessage,
    SdpNegotiationError,
    SipRequest,
    SipResponse,
    SipUAC,
    parse_sdp,
)
from aiosipua.header_codec import stringify_uri
from aiosipua.headers import parse_address
from aiosipua.rtp_bridge import CallSession
from aiosipua.transport import SipTransport

from server.config.sip_trunks import Trunk, hostport, parse_hostport, parse_target
from server.transports.phone.audio import encode

from .compat import TlsTransport
from .digest import DigestClient
from .media_session import call_media
from .opus import opus_available, use_opus_at
from .resolve import SipResolver
from .rtp_ports import NoFreePort, RtpPortLease, RtpPorts
from .sdp import CODECS, G722, OPUS_FMTP, LineCodec, codec_name, wideband_available
from .srtp import SUITES, Crypto, choose_crypto, protect_session, secured

__all__ = [
    "PHONE_RATE",
    "DialFailed",
    "DialOutcome",
    "DialResult",
    "DialStack",
    "OutboundLeg",
    "dial",
    "parse_target",
]

log = logging.getLogger(__name__)

PHONE_RATE = 8000
DTMF_PAYLOAD_TYPE = 101
OPUS_PAYLOAD_TYPE = 111
"""The dynamic payload type our offers put Opus on."""
T1_S = 0.5
"""RFC 3261 Timer A's first interval: an unanswered INVITE is sent again after it, doubling."""
FAILOVER_S = 2.0
"""How long a target that answers nothing at all (not even 100 Trying) is waited for before
the next DNS SRV target is tried (and the silent one is tried last for ``SILENT_FOR_S``)."""
SILENT_FOR_S = 60.0
BUSY = frozenset({486, 600})
NO_ANSWER = frozenset({408, 480})

DialOutcome = Literal["answered", "busy", "no_answer", "rejected", "failed"]


@dataclass(frozen=True)
class DialResult:
    """How a dial ended. ``status``: the final SIP status (None when none came)."""

    outcome: DialOutcome
    status: int | None
    reason: str


class DialFailed(Exception):
    """The callee did not answer; :attr:`result` says why."""

    def __init__(self, result: DialResult) -> None:
        super().__init__(result.reason)
        self.result = result


class _Uac(SipUAC):
    """aiosipua's UAC plus what it leaves out: an ACK for a non-2xx final answer (RFC 3261
    17.1.1.3; without it the callee repeats its 486 for 32 s), a record of which calls have
    heard anything back (which stops the INVITE's retransmission), a digest challenge answered
    with every header of the INVITE kept, a From with a display name, and the answer's Contact
    and Record-Route taken as the dialog's remote target and route set."""

    def __init__(self, transport: SipTransport, advertised_addr: tuple[str, int] | None) -> None:
        super().__init__(transport, advertised_addr=advertised_addr)
        self.invites: OrderedDict[str, tuple[SipRequest, tuple[str, int]]] = OrderedDict()
        """Recent INVITEs by Call-ID (bounded), to ACK their final answers, retransmitted too."""
        self.heard: set[str] = set()
        self.credentials: dict[str, DigestClient] = {}
        """The credentials a call's challenge is answered with, by Call-ID, until it is."""
        self.challenged: set[str] = set()
        """Calls whose challenge was answered (a second one means the credentials are wrong)."""
        self.display_name: str | None = None
        """The From display name of the next INVITE built (kept in its dialog's metadata)."""

    def track(self, call: OutgoingCall) -> None:
        self.invites[call.call_id] = (call.invite, call.remote_addr)
        while len(self.invites) > 256:
            self.invites.popitem(last=False)

    def forget(self, call_id: str) -> None:
        self.heard.discard(call_id)
        self.credentials.pop(call_id, None)
        self.challenged.discard(call_id)

    def _build_invite(
        self, dialog: Dialog, *, sdp_offer: SdpMessage | None, user_agent: str | None
    ) -> SipRequest:
        invite = super()._build_invite(dialog, sdp_offer=sdp_offer, user_agent=user_agent)
        if self.display_name is not None and "display_name" not in dialog.metadata:
            dialog.metadata["display_name"] = self.display_name
        name = dialog.metadata.get("display_name")
        if name:
            quoted = name.replace("\\", "\\\\").replace('"', '\\"')
            invite.headers.set_single(
                "From", f'"{quoted}" <{dialog.local_uri}>;tag={dialog.local_tag}'
            )
        return invite

    def handle_response(self, response: SipResponse, addr: tuple[str, int]) -> None:
        call_id = response.call_id or ""
        cseq = response.cseq
        ours = self.invites.get(call_id)
        if ours is not None and cseq is not None and cseq.method.upper() == "INVITE":
            status = response.status_code
            if status >= 300:
                self._ack_failure(ours[0], response, ours[1])
                if status in (401, 407) and self._answer_challenge(call_id, response):
                    return
            self.heard.add(call_id)
            if 200 <= status < 300:
                self._follow_answer(call_id, response)
        super().handle_response(response, addr)

    def _answer_challenge(self, call_id: str, response: SipResponse) -> bool:
        """Send the INVITE again with credentials answering ``response``'s challenge; False
        when there are none, or they were already refused once (the call is then rejected)."""
        credentials = self.credentials.get(call_id)
        call = self.get_call(call_id)
        if credentials is None or call is None or call_id in self.challenged:
            if credentials is not None:
                credentials.forget()
            return False
        status = response.status_code
        header = "Proxy-Authenticate" if status == 407 else "WWW-Authenticate"
        answer = credentials.answer(
            status, response.headers.get_first(header), "INVITE", call.invite.uri
        )
        if answer is None:
            return False
        self.challenged.add(call_id)
        old = call.invite
        invite = self._build_invite(call.dialog, sdp_offer=call.sdp_offer, user_agent=None)
        for name, values in old.headers.items():
            if name.lower() in ("authorization", "proxy-authorization") or name in invite.headers:
                continue
            for value in values:
                invite.headers.append(name, value)
        invite.headers.set_single(*answer)
        self.transactions.create_client(invite)
        self.transport.send(invite, call.remote_addr)
        call.invite = invite
        self.track(call)
        return True

    def _follow_answer(self, call_id: str, response: SipResponse) -> None:
        """Take the 2xx's Contact as the remote target and its Record-Route, reversed, as the
        route set (RFC 3261 12.1.2); the ACK and later requests go to the first route (loose
        routing), else where the INVITE went."""
        call = self.get_call(call_id)
        if call is None or call.dialog.state is not DialogState.EARLY:
            return
        contact = response.headers.get_first("contact")
        if contact:
            with contextlib.suppress(ValueError):
                call.dialog.remote_target = stringify_uri(parse_address(contact).uri)
        routes = [r.strip() for v in response.headers.get("record-route") for r in v.split(",")]
        if not routes:
            return
        call.dialog.route_set = list(reversed(routes))
        with contextlib.suppress(ValueError):
            first = parse_address(call.dialog.route_set[0]).uri
            call.remote_addr = (first.host.strip("[]"), first.port or 5060)

    def _ack_failure(
        self, invite: SipRequest, response: SipResponse, addr: tuple[str, int]
    ) -> None:
        ack = SipRequest(method="ACK", uri=invite.uri)
        via = invite.headers.get_first("via")
        if via:
            ack.headers.append("Via", via)  # the INVITE's branch: same transaction
        for name in ("From", "Call-ID"):
            value = invite.headers.get_first(name)
            if value:
                ack.headers.set_single(name, value)
        for route in invite.headers.get("route"):
            ack.headers.append("Route", route)
        to = response.headers.get_first("to")
        if to:
            ack.headers.set_single("To", to)
        seq = invite.cseq.seq if invite.cseq else 1
        ack.headers.set_single("CSeq", f"{seq} ACK")
        ack.headers.set_single("Max-Forwards", "70")
        self.transport.send(ack, addr)


class DialStack:
    """What dialing needs of a running SIP endpoint: its UDP transport (through a UAC the
    endpoint's user agent hands responses to), RTP ports and addresses. The endpoint calls
    :meth:`peer_hung_up` and :meth:`reoffered` for in-dialog requests it does not know."""

    def __init__(
        self,
        transport: SipTransport,
        rtp_ports: RtpPorts,
        host: str,
        *,
        advertise: str | None = None,
        signalling_addr: tuple[str, int] | None = None,
        user_agent: str = "Vocable",
        resolver: SipResolver | None = None,
    ) -> None:
        self.uac = _Uac(transport, signalling_addr)
        self.rtp_ports = rtp_ports
        self.host = host
        """The address RTP sockets bind to."""
        self.advertise = advertise
        self.user_agent = user_agent
        self.legs: dict[str, OutboundLeg] = {}
        """Answered legs by SIP Call-ID."""
        self.peers: set[str] = set()
        """Addresses being dialed or in a call (their answers pass an allowlist)."""
        self.tls: _Uac | None = None
        """The UAC on the endpoint's TLS transport (``--sip-tls``), for trunks on TLS."""
        self.resolver = resolver or SipResolver()
        """Where a URI's host sends to (DNS NAPTR and SRV, then A/AAAA)."""
        self._silent: dict[tuple[str, int], float] = {}
        self._tls_contexts: dict[str, ssl.SSLContext] = {}
        """Targets that answered nothing, and until when they are tried last."""
        self.digests: dict[str, DigestClient] = {}
        """Each trunk's credentials, with the nonce its proxy last gave (by trunk name)."""

    def silent(self, target: tuple[str, int]) -> None:
        """``target`` answered nothing: try it last for ``SILENT_FOR_S``."""
        self._silent[target] = time.monotonic() + SILENT_FOR_S

    def answering_first(self, targets: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """``targets`` in their order, those recently silent moved to the end."""
        now = time.monotonic()
        return sorted(targets, key=lambda target: self._silent.get(target, 0.0) > now)

    def tls_context(self, trunk: Trunk) -> ssl.SSLContext:
        """The client TLS context of a trunk on TLS (its CA file read once)."""
        context = self._tls_contexts.get(trunk.name)
        if context is None:
            context = ssl.create_default_context(cafile=trunk.ca_file)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            self._tls_contexts[trunk.name] = context
        return context

    def use_tls(self, transport: TlsTransport, advertised: tuple[str, int] | None) -> _Uac:
        """Let trunks on TLS dial over ``transport``; the UAC its user agent hands responses
        to."""
        self.tls = _Uac(transport, advertised)
        return self.tls

    def digest(self, trunk: Trunk) -> DigestClient | None:
        """The trunk's credentials (kept across calls, for their nonce); None without any."""
        if trunk.username is None or trunk.password is None:
            return None
        client = self.digests.get(trunk.name)
        if client is None or client.username != trunk.username:
            client = self.digests[trunk.name] = DigestClient(trunk.username, trunk.password)
        return client

    @property
    def family(self) -> int:
        """The address family of the bind address (what DNS answers are asked for)."""
        return _family(self.host)

    def signalling_addr(self) -> tuple[str, int]:
        return self.uac.advertised_addr or self.uac.transport.local_addr

    def media_ip(self, peer: str) -> str:
        """The address our SDP names: the advertised one, else the bind address, else the local
        address that routes to ``peer``."""
        if self.advertise:
            return self.advertise
        if not ipaddress.ip_address(self.host).is_unspecified:
            return self.host
        family = socket.AF_INET6 if ":" in peer else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, 9))  # picks the route, sends nothing
            return str(probe.getsockname()[0])

    def peer_hung_up(self, sip_call_id: str) -> bool:
        """The callee's BYE (already answered 200): True when it ended one of our legs."""
        leg = self.legs.get(sip_call_id)
        if leg is None:
            return False
        leg.peer_hung_up("the callee hung up")
        return True

    def reoffered(self, invite: IncomingCall) -> bool:
        """A re-INVITE on one of our legs: answered with our SDP as it stands (a new remote
        address is followed; hold is not). True when it was ours."""
        leg = self.legs.get(invite.call_id)
        if leg is None:
            return False
        offer = invite.sdp_offer
        remote = offer.rtp_address if offer is not None else None
        if remote is not None and remote[1] != 0:
            leg.media.update_remote(remote)
        invite.accept(leg.local_sdp)
        return True


class OutboundLeg:
    """One answered outgoing call: signalling dialog and RTP. Built by :func:`dial` only."""

    def __init__(
        self,
        stack: DialStack,
        call: OutgoingCall,
        media: CallSession,
        local_sdp: SdpMessage,
        remote_sdp: SdpMessage,
        port: RtpPortLease,
        peer: str,
        uac: _Uac,
        *,
        srtp: bool = False,
    ) -> None:
        self.stack = stack
        self.uac = uac
        """The UAC the leg's dialog runs on (the endpoint's UDP one, or its TLS one)."""
        self.call = call
        self.media = media
        """The RTP session (aiosipua's ``CallSession``: ``remote_addr``, ``stats``)."""
        self.local_sdp = local_sdp
        self.remote_sdp = remote_sdp
        payload_type = media.chosen_payload_type
        line = (
            LineCodec.opus(payload_type)
            if payload_type == OPUS_PAYLOAD_TYPE
            else LineCodec.static(payload_type)
        )
        self._line = line
        self.codec = line.name
        """The codec the callee answered with: opus, G722, PCMU or PCMA."""
        self.rate = line.rate
        """The rate of the PCM the leg sends and hears: 16 kHz on Opus and G.722, else 8 kHz."""
        self.result = DialResult("answered", 200, "answered")
        self.srtp = srtp
        """Whether the leg's audio is on SRTP (a trunk's ``srtp``)."""
        self.on_audio: Callable[[bytes], None] | None = None
        """The callee's audio as it arrives: PCM16 at :attr:`rate`, any length."""
        self.on_dtmf: Callable[[str], None] | None = None
        self.on_hangup: Callable[[str], None] | None = None
        """Called once if the callee ends the call (then call :meth:`hangup` to free it)."""
        self.ended = asyncio.Event()
        """Set once :meth:`hangup` has freed everything."""
        self.by_peer = False
        self._port = port
        self._peer = peer
        self._timestamp = secrets.randbelow(1 << 32)
        self._closing = False
        media.on_audio = self._audio
        media.on_dtmf = self._dtmf

    @property
    def sip_call_id(self) -> str:
        return self.call.call_id

    def send_pcm(self, pcm: bytes) -> None:
        """Send one 20 ms frame of PCM16 at :attr:`rate` as RTP in the answered codec; the
        caller paces."""
        g711 = self._line.g711
        if not self._closing and g711 is not None:
            self.media.send_audio(encode(pcm, g711), self._timestamp)
        elif not self._closing:
            self.media.send_audio_pcm(pcm, self._timestamp)
        ticks = len(pcm) // 2 * self._line.clock_rate // self.rate
        self._timestamp = (self._timestamp + ticks) & 0xFFFFFFFF

    def peer_hung_up(self, reason: str) -> None:
        if self.by_peer or self._closing:
            return
        self.by_peer = True
        if self.on_hangup is not None:
            self.on_hangup(reason)

    async def hangup(self) -> None:
        """BYE (unless the callee hung up), close RTP and give the port back. Idempotent."""
        if self._closing:
            await self.ended.wait()
            return
        self._closing = True
        try:
            if not self.by_peer:
                with contextlib.suppress(ValueError, RuntimeError, OSError):
                    self.call.hangup(self.uac)
            await self.media.close()
        finally:
            self._port.release()
            self.stack.legs.pop(self.sip_call_id, None)
            self.stack.peers.discard(self._peer)
            self.uac.forget(self.sip_call_id)
            self.ended.set()

    def _audio(self, pcm: bytes, _timestamp: int) -> None:
        if self.on_audio is not None:
            self.on_audio(pcm)

    def _dtmf(self, digit: str, _duration: int) -> None:
        if self.on_dtmf is not None:
            self.on_dtmf(digit)


async def dial(
    stack: DialStack,
    to_uri: str,
    *,
    ring_timeout_s: float,
    trunk: Trunk | None = None,
    from_user: str = "vocable",
    headers: Mapping[str, str] | None = None,
    on_ringing: Callable[[], None] | None = None,
    wideband: bool = False,
) -> OutboundLeg:
    """Call ``to_uri`` (see the module docstring) through ``trunk`` (None: straight to the
    URI's host, as ``from_user``); ``headers`` are added to the INVITE, ``on_ringing`` runs on
    each 180/183. With ``wideband`` Opus and G.722 are offered first (where libopus and G.722's
    codec are installed): the leg's :attr:`~OutboundLeg.rate` then says what the callee
    answered. Raises DialFailed, or ValueError for a bad URI."""
    wide = [OPUS_PAYLOAD_TYPE] if wideband and opus_available() else []
    wide += [G722] if wideband and wideband_available() else []
    codecs = (*wide, *CODECS)
    offered = _Offered(codecs, _our_keys() if trunk is not None and trunk.srtp else ())
    host, port = parse_hostport(to_uri)
    if trunk is not None and trunk.proxy is not None:
        host, port = trunk.proxy
    try:
        transport = "udp" if trunk is None else trunk.transport
        candidates = await stack.resolver.candidates(host, port, stack.family, transport)
    except OSError as exc:  # Unresolvable among them
        raise DialFailed(DialResult("failed", None, str(exc))) from None
    candidates = stack.answering_first(candidates)
    for remote in candidates[:-1]:  # RFC 3263 4.3: the next target when one stays silent
        try:
            return await _dial_at(
                stack, remote, host, to_uri, ring_timeout_s, trunk, from_user, headers,
                on_ringing, offered, unheard_s=FAILOVER_S,
            )  # fmt: skip
        except _Silent:
            stack.silent(remote)
            log.warning("SIP %s:%d did not answer an INVITE: trying the next", *remote)
    return await _dial_at(
        stack, candidates[-1], host, to_uri, ring_timeout_s, trunk, from_user, headers,
        on_ringing, offered, unheard_s=None,
    )  # fmt: skip


class _Silent(Exception):
    """The target answered nothing at all (not even 100 Trying) within ``FAILOVER_S``."""


async def _dial_at(
    stack: DialStack,
    remote: tuple[str, int],
    host: str,
    to_uri: str,
    ring_timeout_s: float,
    trunk: Trunk | None,
    from_user: str,
    headers: Mapping[str, str] | None,
    on_ringing: Callable[[], None] | None,
    offered: _Offered,
    *,
    unheard_s: float | None,
) -> OutboundLeg:
    """One attempt at ``remote``, offering ``offered``; raises DialFailed, or _Silent (after
    ``unheard_s``)."""
    try:
        lease = stack.rtp_ports.lease()
    except NoFreePort as exc:
        raise DialFailed(DialResult("failed", None, str(exc))) from None
    stack.peers.add(remote[0])
    with contextlib.ExitStack() as unless_answered:
        unless_answered.callback(lease.release)
        unless_answered.callback(stack.peers.discard, remote[0])
        uac = await _signalling(stack, trunk, remote, host)
        identity = _Identity.of(stack, trunk, from_user, dict(headers or {}), remote)
        leg = await _invite(
            stack, uac, to_uri, remote, lease, ring_timeout_s, identity, on_ringing, offered,
            unheard_s,
        )  # fmt: skip
        unless_answered.pop_all()
    return leg


async def _signalling(
    stack: DialStack, trunk: Trunk | None, remote: tuple[str, int], name: str
) -> _Uac:
    """The UAC to call ``remote`` on: the UDP one, or for a trunk on TLS the TLS one, its
    connection to the proxy open (its certificate checked for ``name``)."""
    if trunk is None or trunk.transport != "tls":
        return stack.uac
    if stack.tls is None:
        raise DialFailed(
            DialResult("failed", None, f"trunk {trunk.name!r} is on TLS: serve with --sip-tls")
        )
    context = stack.tls_context(trunk)
    transport = stack.tls.transport
    assert isinstance(transport, TlsTransport)
    try:
        await transport.connect_tls(remote, context, name)
    except ssl.SSLCertVerificationError as exc:
        raise DialFailed(
            DialResult(
                "failed",
                None,
                f"TLS to {hostport(*remote)}: certificate verify failed: {exc.verify_message}",
            )
        ) from None
    except (OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DialFailed(
            DialResult("failed", None, f"TLS to {hostport(*remote)}: {reason}")
        ) from None
    return stack.tls


@dataclass(frozen=True)
class _Identity:
    """Who the INVITE says is calling, and what it carries for the trunk."""

    from_uri: str
    display_name: str | None
    headers: dict[str, str]
    credentials: DigestClient | None

    @classmethod
    def of(
        cls,
        stack: DialStack,
        trunk: Trunk | None,
        from_user: str,
        headers: dict[str, str],
        remote: tuple[str, int],
    ) -> _Identity:
        sip_host, sip_port = stack.signalling_addr()
        here = hostport(sip_host, sip_port)
        if trunk is None:
            return cls(f"sip:{from_user}@{here}", None, headers, None)
        user = trunk.caller_id or from_user
        if trunk.proxy is not None:
            headers["Route"] = f"<sip:{hostport(*remote)};lr>"
        if trunk.asserted_identity is not None:
            headers["P-Asserted-Identity"] = f"<{trunk.asserted_identity}>"
        domain = trunk.host or here
        return cls(f"sip:{user}@{domain}", trunk.display_name, headers, stack.digest(trunk))


async def _invite(
    stack: DialStack,
    uac: _Uac,
    to_uri: str,
    remote: tuple[str, int],
    lease: RtpPortLease,
    ring_timeout_s: float,
    identity: _Identity,
    on_ringing: Callable[[], None] | None,
    offered: _Offered,
    unheard_s: float | None = None,
) -> OutboundLeg:
    media_ip = stack.media_ip(remote[0])
    offer = offered.sdp(media_ip, lease.port)
    answered: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()

    def settle(status: int, reason: str) -> None:
        if not answered.done():
            answered.set_result((status, reason))

    headers = dict(identity.headers)
    if identity.credentials is not None:  # the trunk's last nonce, if it is still good
        ahead = identity.credentials.ahead("INVITE", to_uri)
        if ahead is not None:
            headers[ahead[0]] = ahead[1]
    uac.display_name = identity.display_name
    try:
        call = uac.send_invite(
            identity.from_uri,
            to_uri,
            remote,
            offer,
            extra_headers=headers,
            user_agent=stack.user_agent,
        )
    finally:
        uac.display_name = None
    uac.track(call)
    if identity.credentials is not None:
        uac.credentials[call.call_id] = identity.credentials
    call.on_ringing = lambda _call: on_ringing() if on_ringing is not None else None
    call.on_answer = lambda _call: settle(200, "OK")
    call.on_rejected = lambda _call, status, reason: settle(status, reason)
    resend = asyncio.create_task(_retransmit(uac, call), name=f"sip-invite-timer:{call.call_id}")
    try:
        async with asyncio.timeout(ring_timeout_s):
            if unheard_s is not None:
                await asyncio.wait({answered}, timeout=unheard_s)
                if not answered.done() and call.call_id not in uac.heard:
                    raise _Silent
            status, reason = await answered
    except _Silent:
        _abandon(uac, call)
        raise
    except TimeoutError:
        _abandon(uac, call)
        raise DialFailed(
            DialResult("no_answer", None, f"no answer within {ring_timeout_s:g} s")
        ) from None
    except BaseException:  # cancelled: the caller gave up
        _abandon(uac, call)
        raise
    finally:
        resend.cancel()
    if status != 200:
        authenticated = call.call_id in uac.challenged
        uac.forget(call.call_id)
        raise DialFailed(_failure(status, reason, identity.credentials, authenticated))
    uac.credentials.pop(call.call_id, None)
    try:
        return await _connect(stack, uac, call, offer, offered, media_ip, lease, remote[0])
    except BaseException:
        with contextlib.suppress(ValueError, RuntimeError, OSError):
            call.hangup(uac)
        uac.forget(call.call_id)
        raise


async def _connect(
    stack: DialStack,
    uac: _Uac,
    call: OutgoingCall,
    offer: SdpMessage,
    offered: _Offered,
    media_ip: str,
    lease: RtpPortLease,
    peer: str,
) -> OutboundLeg:
    """The answered call's RTP, from the callee's SDP answer; DialFailed when it is unusable."""
    answer = call.sdp_answer
    if OPUS_PAYLOAD_TYPE in offered.codecs:
        use_opus_at(OPUS_PAYLOAD_TYPE)
    try:
        if answer is None:
            raise ValueError("the answer has no SDP")
        if answer.rtp_address is None or answer.rtp_address[1] == 0:
            raise ValueError("the answer declines audio")
        keys = offered.keys_of(answer)
        media = call_media(
            stack.host,
            lease.port,
            answer,  # the callee's answer: picks one of the codecs we offered
            advertised_ip=None if media_ip == stack.host else media_ip,
            supported_codecs=list(offered.codecs),
            dtmf_payload_type=_dtmf_type(answer),
        )
    except (SdpNegotiationError, ValueError) as exc:
        raise DialFailed(DialResult("failed", 200, f"unusable SDP answer: {exc}")) from None
    await media.start()
    if keys is not None:
        protect_session(media.rtp_session, *keys)
    leg = OutboundLeg(stack, call, media, offer, answer, lease, peer, uac, srtp=keys is not None)
    stack.legs[call.call_id] = leg
    return leg


async def _retransmit(uac: _Uac, call: OutgoingCall) -> None:
    """Send the INVITE again at T1, 2*T1, 4*T1... until the callee answers anything (over
    UDP: TLS delivers it once)."""
    if uac.transport.reliable:
        return
    interval = T1_S
    while True:
        await asyncio.sleep(interval)
        if call.call_id in uac.heard or call.dialog.state is not DialogState.EARLY:
            return
        uac.transport.send(call.invite, call.remote_addr)
        interval = min(interval * 2, 4.0)


def _abandon(uac: _Uac, call: OutgoingCall) -> None:
    """Give up on a call: CANCEL while it rings, BYE if the answer came first."""
    with contextlib.suppress(ValueError, RuntimeError, OSError):
        if call.dialog.state is DialogState.EARLY:
            call.cancel(uac)
        else:
            call.hangup(uac)
    uac.forget(call.call_id)


def _failure(
    status: int, reason: str, credentials: DigestClient | None, authenticated: bool
) -> DialResult:
    text = f"{status} {reason}".strip()
    if status in BUSY:
        return DialResult("busy", status, f"busy ({text})")
    if status in NO_ANSWER:
        return DialResult("no_answer", status, f"no answer ({text})")
    if status in (401, 407) and credentials is None:
        return DialResult(
            "rejected", status, f"rejected ({text}): the trunk asks for credentials, none are set"
        )
    if status in (401, 407) and authenticated:
        return DialResult("rejected", status, f"authentication failed ({text})")
    if status in (401, 407):
        return DialResult(
            "rejected", status, f"rejected ({text}): its challenge cannot be answered"
        )
    return DialResult("rejected", status, f"rejected ({text})")


@dataclass(frozen=True)
class _Offered:
    """What an INVITE offers: ``codecs`` (static payload types, preferred first) and RFC 4733
    digits, on SRTP with ``keys`` (our SDES keys, one per suite) when there are any."""

    codecs: tuple[int, ...]
    keys: tuple[Crypto, ...] = ()

    def sdp(self, ip: str, port: int) -> SdpMessage:
        """The offer's SDP, media on ``ip``:``port``."""
        kind = "IP6" if ":" in ip else "IP4"
        session = str(secrets.randbelow(1 << 31))
        profile = "RTP/SAVP" if self.keys else "RTP/AVP"
        types = " ".join(map(str, self.codecs))
        lines = [
            "v=0",
            f"o=vocable {session} {session} IN {kind} {ip}",
            "s=-",
            f"c=IN {kind} {ip}",
            "t=0 0",
            f"m=audio {port} {profile} {types} {DTMF_PAYLOAD_TYPE}",
            *(_rtpmap(pt) for pt in self.codecs),
            f"a=rtpmap:{DTMF_PAYLOAD_TYPE} telephone-event/8000",
            *(
                [f"a=fmtp:{OPUS_PAYLOAD_TYPE} {OPUS_FMTP}"]
                if OPUS_PAYLOAD_TYPE in self.codecs
                else []
            ),
            f"a=fmtp:{DTMF_PAYLOAD_TYPE} 0-16",
            *(f"a=crypto:{key.line()}" for key in self.keys),
            "a=ptime:20",
            "a=sendrecv",
        ]
        return parse_sdp("\r\n".join(lines) + "\r\n")

    def keys_of(self, answer: SdpMessage) -> tuple[Crypto, Crypto] | None:
        """(the callee's key, ours) for an SRTP offer, None for a plain one; raises ValueError
        when the answer does not take the offered SRTP (RFC 4568 7.1.2: its tag and suite)."""
        if not self.keys:
            return None
        theirs = choose_crypto(answer) if secured(answer) else None
        taken = None if theirs is None else (theirs.tag, theirs.suite)
        ours = next((key for key in self.keys if (key.tag, key.suite) == taken), None)
        if theirs is None or ours is None:
            raise ValueError("the answer is not on the SRTP offered (RTP/SAVP with a key)")
        return theirs, ours


def _rtpmap(payload_type: int) -> str:
    if payload_type == OPUS_PAYLOAD_TYPE:
        return f"a=rtpmap:{payload_type} opus/48000/2"
    return f"a=rtpmap:{payload_type} {codec_name(payload_type)}/8000"  # G.722's clock: 8 kHz


def _our_keys() -> tuple[Crypto, ...]:
    """A fresh SDES key for each suite Vocable has, tagged 1, 2 ... in its preference."""
    return tuple(Crypto.fresh(tag, suite) for tag, suite in enumerate(SUITES, start=1))


def _dtmf_type(sdp: SdpMessage) -> int:
    audio = sdp.audio
    for codec in audio.codecs if audio is not None else []:
        if codec.encoding_name.lower() == "telephone-event" and 0 <= codec.payload_type <= 127:
            return codec.payload_type
    return DTMF_PAYLOAD_TYPE


def _family(host: str) -> int:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET
