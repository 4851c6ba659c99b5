"""SDP as the SIP endpoint reads and writes it: the codecs it takes (G.722, preferred, then
G.711), whether an offer's media can be reached, the answer to a re-INVITE, the direction of a
stream."""

from __future__ import annotations

import functools
import ipaddress
import re
import socket

from aiosipua import SdpMessage, negotiate_sdp

from server.transports.phone.audio import Encoding

__all__ = [
    "CODECS",
    "G722",
    "SENDING_DIRECTIONS",
    "choose_codec",
    "codec_name",
    "codec_rate",
    "direction",
    "host_ip",
    "media_problem",
    "offered_dtmf_type",
    "reanswer",
    "sendable",
    "wideband_available",
]

CODECS: dict[int, Encoding] = {0: "ulaw", 8: "alaw"}
"""G.711, encoded and decoded by Vocable at 8 kHz."""
G722 = 9
"""G.722's static payload type: 16 kHz audio (on an 8 kHz RTP clock, RFC 3551), which aiortp's
codec encodes and decodes; the pipeline hears it at 16 kHz, with no 8 kHz step."""
_NAMES = {0: "PCMU", 8: "PCMA", G722: "G722"}
SENDING_DIRECTIONS = ("sendrecv", "sendonly")
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
"""One label of a host name (RFC 1123)."""


@functools.cache
def wideband_available() -> bool:
    """Whether G.722's codec (the ``G722`` package, through aiortp) is installed."""
    try:
        from aiortp.codecs import get_codec

        get_codec(G722)
    except (ImportError, ValueError):
        return False
    return True


def choose_codec(offer: SdpMessage) -> int | None:
    """The payload type to answer ``offer`` with: G.722 when it offers it (and its codec is
    installed), else the first G.711 it offers; None when it offers neither."""
    audio = offer.audio
    offered = [
        codec.payload_type
        for codec in (audio.codecs if audio is not None else [])
        if _NAMES.get(codec.payload_type) == codec.encoding_name.upper()
    ]
    if G722 in offered and wideband_available():
        return G722
    return next((pt for pt in offered if pt in CODECS), None)


def codec_rate(payload_type: int) -> int:
    """The PCM rate of a codec's audio: 16 kHz for G.722, 8 kHz for G.711."""
    return 16000 if payload_type == G722 else 8000


def codec_name(payload_type: int) -> str:
    return _NAMES.get(payload_type, str(payload_type))


def media_problem(offer: SdpMessage, local_host: str, *, on_hold_ok: bool = False) -> str | None:
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
    return ipaddress.ip_address(host_ip(host)).version


def host_ip(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


def _sendable_host(host: str) -> bool:
    """An IP address, or a host name the socket module resolves without raising anything
    other than OSError."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        labels = host.removesuffix(".").split(".")
        return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)
    return True


def sendable(host: str, port: int) -> bool:
    """Whether ``(host, port)`` is an address a datagram may be sent to."""
    return isinstance(port, int) and 0 < port < 65536 and _sendable_host(host)


def reanswer(offer: SdpMessage, current: SdpMessage, payload_type: int) -> SdpMessage:
    """An answer to a re-INVITE's ``offer`` keeping the call's address, port and codec; raises
    SdpNegotiationError when the offer drops that codec."""
    address = current.connection.address if current.connection else "0.0.0.0"
    answer, _ = negotiate_sdp(
        offer,
        local_ip=address,
        rtp_port=current.audio.port if current.audio else 0,
        supported_codecs=[payload_type],
        dtmf_payload_type=offered_dtmf_type(offer),
    )
    return answer


def direction(sdp: SdpMessage) -> str:
    audio = sdp.audio
    return audio.direction if audio is not None else "inactive"


def offered_dtmf_type(offer: SdpMessage) -> int:
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
