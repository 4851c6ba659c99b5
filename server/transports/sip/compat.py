"""Everything the SIP endpoint does with aiosipua beyond its public API, in one place, and the
start-up check that it still holds.

aiosipua 0.7 has no public way to send a final response with extra headers (a 503 needs
``Retry-After``, a 200 names the session), to see a message before the user agent does
(``--sip-allow``, the 400s for malformed requests, replies on the TCP connection a request came in
on), or to use its UDP transport on Python 3.11's selector datagram transport; and its answers to
an INVITE leave out the INVITE's ``Record-Route``, which a proxy in front (Kamailio) needs to stay
in the dialog (RFC 3261 12.1.1). Those needs use private members, listed in
:data:`PRIVATE_MEMBERS`; :func:`check_sip_stack` runs when the SIP endpoint starts and refuses, in
one line, an aiosipua outside the tested versions or without those members, rather than letting
calls fail one by one. pyproject.toml pins the same range.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import re
import ssl
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

from aiortp.base_session import BaseRTPSession
from aiortp.transport import RtpTransport
from aiosipua import IncomingCall, Registration, SipRequest, SipResponse, SipUAC
from aiosipua.dialog import Dialog
from aiosipua.transport import SipTransport, TcpSipTransport, UdpSipTransport

from server.config.llm import ConfigError

from .stun_keepalive import StunPinger, is_stun

__all__ = [
    "TESTED_VERSIONS",
    "MessageHandler",
    "SipStackMismatch",
    "UdpTransport",
    "check_sip_stack",
    "headers_in_answer",
    "intercept_messages",
    "record_route_in_answers",
    "respond_and_end",
]

log = logging.getLogger(__name__)

TESTED_VERSIONS = ((0, 7, 1), (0, 8, 0))
"""aiosipua versions the endpoint is tested with: from the first, up to (not including) the
second."""

_RELEASE = re.compile(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?")

MessageHandler = Callable[[SipRequest | SipResponse, tuple[str, int]], None]


class SipStackMismatch(ConfigError):
    """The installed aiosipua is not one the SIP endpoint was tested with."""


def _private_members() -> dict[str, bool]:
    """Each private member relied on, and whether this aiosipua has it."""
    send_response = getattr(IncomingCall, "_send_response", None)
    return {
        "SipTransport._dispatch": callable(getattr(SipTransport, "_dispatch", None)),
        "UdpSipTransport._udp_transport": "_udp_transport"
        in {field.name for field in dataclasses.fields(UdpSipTransport)},
        "IncomingCall._send_response(extra_headers=)": callable(send_response)
        and "extra_headers" in inspect.signature(send_response).parameters,
        "Dialog.create_response(request, status_code, reason_phrase, contact=)": callable(
            create_response := getattr(Dialog, "create_response", None)
        )
        and list(inspect.signature(create_response).parameters)[:5]
        == ["self", "request", "status_code", "reason_phrase", "contact"],
        "Registration._send_register(expires, auth_header=)": callable(
            send_register := getattr(Registration, "_send_register", None)
        )
        and list(inspect.signature(send_register).parameters)[:3]
        == ["self", "expires", "auth_header"],
        "Registration._cancel_timers": callable(getattr(Registration, "_cancel_timers", None)),
        "Registration._on_success(response)": callable(
            on_success := getattr(Registration, "_on_success", None)
        )
        and list(inspect.signature(on_success).parameters)[:2] == ["self", "response"],
        "SipUAC._registrations": "self._registrations" in inspect.getsource(SipUAC.__init__),
        "RTPSession._rtp_transport, _rtcp_transport (SRTP)": {
            "self._rtp_transport",
            "self._rtcp_transport",
        }
        <= _assigned(BaseRTPSession.__init__),
        "RtpTransport._transport (SRTP)": "self._transport" in _assigned(RtpTransport.__init__),
        "TcpSipTransport._server, _handle_connection (TLS)": "self._server = await"
        in inspect.getsource(TcpSipTransport.start)
        and callable(getattr(TcpSipTransport, "_handle_connection", None)),
        "SipUAC._build_invite(dialog, sdp_offer=, user_agent=)": callable(
            build_invite := getattr(SipUAC, "_build_invite", None)
        )
        and list(inspect.signature(build_invite).parameters)[:4]
        == ["self", "dialog", "sdp_offer", "user_agent"],
    }


def _assigned(function: Callable[..., Any]) -> set[str]:
    """The ``self.NAME`` a function's source assigns."""
    source = inspect.getsource(function)
    return set(re.findall(r"(self\.\w+)(?:: [^=]+)? =", source))


PRIVATE_MEMBERS = tuple(_private_members())


def check_sip_stack(version: str | None = None) -> None:
    """Raise SipStackMismatch, naming the installed version and what is wrong, unless aiosipua
    (``version``, default: the installed one) is a tested version with every private member
    the endpoint uses."""
    version = version or metadata.version("aiosipua")
    low, high = TESTED_VERSIONS
    tested = f"{_dotted(low)} up to (not including) {_dotted(high)}"
    if not low <= _release(version) < high:
        raise SipStackMismatch(
            f"the SIP endpoint is tested with aiosipua {tested}, not {version}: "
            f"pip install 'aiosipua>={_dotted(low)},<{_dotted(high)}'"
        )
    missing = [name for name, present in _private_members().items() if not present]
    if missing:
        raise SipStackMismatch(
            f"aiosipua {version} lacks what the SIP endpoint uses ({', '.join(missing)}): "
            f"pip install 'aiosipua>={_dotted(low)},<{_dotted(high)}'"
        )


def record_route_in_answers(invite: IncomingCall) -> None:
    """Make the responses to ``invite`` that set up its dialog (18x, 2xx) carry the INVITE's
    ``Record-Route`` headers, as RFC 3261 12.1.1 asks of a UAS, so that the caller's ACK, BYE
    and re-INVITEs pass through the proxies that recorded a route (aiosipua already sends its
    own in-dialog requests along that route). Nothing changes for a direct INVITE."""
    routes = list(invite.invite.headers.get("record-route") or [])
    if not routes:
        return

    def add_routes(response: SipResponse) -> None:
        if 100 < response.status_code < 300:
            for route in routes:
                response.headers.append("Record-Route", route)

    _amend_responses(invite, add_routes)


def headers_in_answer(invite: IncomingCall, headers: Mapping[str, str]) -> None:
    """Make the 2xx that accepts ``invite`` (and its retransmissions) carry ``headers`` too:
    ``accept()`` takes none. Other responses are left alone."""
    extra = dict(headers)

    def add_headers(response: SipResponse) -> None:
        if 200 <= response.status_code < 300:
            for name, value in extra.items():
                response.headers.set_single(name, value)

    _amend_responses(invite, add_headers)


def _amend_responses(invite: IncomingCall, amend: Callable[[SipResponse], None]) -> None:
    """Pass every response the dialog makes to ``invite`` itself through ``amend`` (after the
    amendments given before), by wrapping the dialog's ``create_response``."""
    create = invite.dialog.create_response

    def amended(
        request: SipRequest,
        status_code: int,
        reason_phrase: str = "",
        *,
        contact: str | None = None,
    ) -> SipResponse:
        response = create(request, status_code, reason_phrase, contact=contact)
        if request is invite.invite:
            amend(response)
        return response

    setattr(invite.dialog, "create_response", amended)  # noqa: B010 - on this dialog alone


def respond_and_end(
    invite: IncomingCall, status: int, reason: str, headers: dict[str, str]
) -> None:
    """Answer an INVITE with a final response carrying ``headers`` (``reject()`` takes none),
    and end its dialog."""
    invite._send_response(status, reason, extra_headers=headers)
    invite.dialog.terminate()


def intercept_messages(
    transport: SipTransport, wrap: Callable[[MessageHandler], MessageHandler]
) -> None:
    """Put ``wrap(handler)`` in front of the handler the started user agent installed on
    ``transport``, so every message passes through it first."""
    handler = transport.on_message
    if handler is None:
        raise SipStackMismatch("aiosipua's user agent installed no message handler")
    transport.on_message = wrap(handler)


class UdpTransport(UdpSipTransport):
    """aiosipua's UDP transport with a protocol that accepts Python 3.11's selector datagram
    transport (which is not registered as an ``asyncio.DatagramTransport`` there, so aiosipua's
    own ``connection_made`` assertion fails and logs an error for every start)."""

    def __init__(self, local_addr: tuple[str, int], sendable: Callable[[str, int], bool]) -> None:
        super().__init__(local_addr=local_addr)
        self._sendable = sendable
        self.stun = StunPinger(self._send_datagram)
        """STUN Binding requests from this socket (keep-alives toward a registrar)."""

    async def start(self) -> None:
        owner = self

        class Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
                owner._dispatch(data, (str(addr[0]), int(addr[1])))

            def error_received(self, exc: Exception) -> None:
                log.debug("SIP UDP error: %s", exc)

        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(Protocol, local_addr=self.local_addr)
        self._udp_transport = transport

    def send(self, message: SipRequest | SipResponse, addr: tuple[str, int]) -> None:
        """Send, unless ``addr`` (from a peer's Via or Contact) is no address at all: asyncio's
        datagram transport closes for good on a port like 99999 or a host with a NUL, and the
        endpoint would answer nothing any more."""
        host, port = addr
        if not self._sendable(host, port):
            log.warning("SIP message to %r port %r dropped: not an address", host, port)
            return
        super().send(message, addr)

    def send_keepalive(self, addr: tuple[str, int]) -> None:
        """A double CRLF to ``addr``: keeps a NAT binding toward a registrar open (a SIP
        stack reads it as nothing). Nothing when the socket is not open."""
        self._send_datagram(b"\r\n\r\n", addr)

    def _send_datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._udp_transport is not None:
            self._udp_transport.sendto(data, addr)

    def _dispatch(self, data: bytes, addr: tuple[str, int]) -> None:
        """A STUN datagram (a keep-alive's answer) to :attr:`stun`; anything else to SIP."""
        if is_stun(data):
            self.stun.received(data)
        else:
            super()._dispatch(data, addr)


@dataclasses.dataclass
class TlsTransport(TcpSipTransport):
    """aiosipua's TCP transport over TLS: a server socket wrapped in ``ssl_context`` (none when
    ``listen`` is False), and client connections opened with :meth:`connect_tls`. aiosipua
    writes ``SIP/2.0/UDP`` in the Via of the requests it builds and no transport in their
    Contact; on this transport they say TLS, so the peer answers and calls back over TLS."""

    ssl_context: ssl.SSLContext | None = None
    listen: bool = True

    async def start(self) -> None:
        if not self.listen:
            return
        self._server = await asyncio.start_server(
            self._handle_connection,
            host=self.local_addr[0],
            port=self.local_addr[1],
            ssl=self.ssl_context,
            ssl_handshake_timeout=10,
        )

    async def connect_tls(
        self, remote: tuple[str, int], context: ssl.SSLContext, server_name: str
    ) -> None:
        """A TLS connection to ``remote`` (unless one is open), its certificate checked
        against ``server_name`` (also sent as SNI when it is a name); raises OSError
        (ssl.SSLError for a certificate refused)."""
        if remote in self._connections:
            return
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(remote[0], remote[1], ssl=context, server_hostname=server_name),
            10,
        )
        self._connections[remote] = (reader, writer)
        self._spawn(self._handle_incoming(reader, writer, remote))

    def send(self, message: SipRequest | SipResponse, addr: tuple[str, int]) -> None:
        if isinstance(message, SipRequest):
            _say_tls(message)
        super().send(message, addr)


def _say_tls(request: SipRequest) -> None:
    """Make the top Via and the Contact of a request aiosipua built say TLS."""
    vias = request.headers.get("via")
    if vias and vias[0].upper().startswith("SIP/2.0/UDP "):
        request.headers.remove("Via")
        for value in ("SIP/2.0/TLS " + vias[0][len("SIP/2.0/UDP ") :], *vias[1:]):
            request.headers.append("Via", value)
    contact = request.headers.get_first("contact")
    if contact and "transport=" not in contact.lower() and contact.endswith(">"):
        request.headers.set_single("Contact", contact[:-1] + ";transport=tls>")


def _release(version: str) -> tuple[int, int, int]:
    """The release numbers of ``version`` (``0.7.1rc1`` -> (0, 7, 1), ``0.8`` -> (0, 8, 0))."""
    match = _RELEASE.match(version)
    if match is None:
        return (0, 0, 0)
    major, minor, patch = (int(n) if n else 0 for n in match.groups())
    return (major, minor, patch)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(n) for n in version)
