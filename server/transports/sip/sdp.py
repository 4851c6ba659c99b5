"""SDP as the SIP endpoint reads and writes it: the codecs it takes (Opus, preferred, then
G.722, then G.711), whether an offer's media can be reached, the answer to a re-INVITE, the
direction of a stream."""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from dataclasses import dataclass

from aiosipua import SdpMessage, negotiate_sdp

from server.transports.phone.audio import Encoding

from .opus import OPUS_RATE, opus_available

__all__ = [
    "CODECS",
    "G722",
    "OPUS_FMTP",
    "SENDING_DIRECTIONS",
    "LineCodec",
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


@dataclass(frozen=True)
class LineCodec:
    """The codec a call's audio is on: its payload type, name, the rate of the PCM the call
    hears and sends, and its RTP clock."""

    payload_type: int
    name: str
    """``opus``, ``G722``, ``PCMU`` or ``PCMA``."""
    rate: int
    clock_rate: int = 8000

    @property
    def g711(self) -> Encoding | None:
        """G.711's encoding, which Vocable encodes itself; None for the codecs aiortp
        encodes (their state runs across frames)."""
        return CODECS.get(self.payload_type) if self.name in ("PCMU", "PCMA") else None

    @property
    def ticks_per_frame(self) -> int:
        """RTP timestamp units in a 20 ms frame."""
        return self.clock_rate * 20 // 1000

    @classmethod
    def static(cls, payload_type: int) -> LineCodec:
        """G.722 or G.711 by its static payload type."""
        return cls(payload_type, codec_name(payload_type), codec_rate(payload_type))

    @classmethod
    def opus(cls, payload_type: int) -> LineCodec:
        """Opus on a dynamic payload type: 16 kHz PCM, RTP's 48 kHz clock."""
        return cls(payload_type, "opus", OPUS_RATE, 48000)


def choose_codec(offer: SdpMessage) -> LineCodec | None:
    """The codec to answer ``offer`` with: Opus when it offers it (``opus/48000/2`` on a
    dynamic payload type, and libopus loads), else G.722 (when its codec is installed), else
    the first G.711 it offers; None when it offers none of them."""
    audio = offer.audio
    codecs = audio.codecs if audio is not None else []
    for codec in codecs:
        if (
            codec.encoding_name.lower() == "opus"
            and codec.clock_rate == 48000
            and 96 <= codec.payload_type <= 127
            and opus_available()
        ):
            return LineCodec.opus(codec.payload_type)
    offered = [
        codec.payload_type
        for codec in codecs
        if _NAMES.get(codec.payload_type) == codec.encoding_name.upper()
    ]
    if G722 in offered and wideband_available():
        return LineCodec.static(G722)
    return next((LineCodec.static(pt) for pt in offered if pt in CODECS), None)


OPUS_FMTP = f"maxplaybackrate={OPUS_RATE};stereo=0;sprop-stereo=0;useinbandfec=1"
"""What Vocable says of its Opus (RFC 7587 7): mono, and nothing above 16 kHz wanted."""


def opus_answer(answer: SdpMessage, payload_type: int) -> None:
    """Make an answer on Opus say it as RFC 7587 asks (``opus/48000/2``; aiosipua writes
    ``opus/48000``), mono, and that audio above 16 kHz is not wanted."""
    audio = answer.audio
    assert audio is not None
    audio.attributes["rtpmap"] = [
        line if not line.startswith(f"{payload_type} ") else f"{payload_type} opus/48000/2"
        for line in audio.attributes.get("rtpmap", [])
    ]
    fmtp = [
        line for line in audio.attributes.get("fmtp", []) if not line.startswith(f"{payload_type} ")
    ]
    audio.attributes["fmtp"] = [f"{payload_type} {OPUS_FMTP}", *fmtp]


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


def reanswer(offer: SdpMessage, current: SdpMessage, codec: LineCodec) -> SdpMessage:
    """An answer to a re-INVITE's ``offer`` keeping the call's address, port and codec; raises
    SdpNegotiationError when the offer drops that codec."""
    address = current.connection.address if current.connection else "0.0.0.0"
    answer, _ = negotiate_sdp(
        offer,
        local_ip=address,
        rtp_port=current.audio.port if current.audio else 0,
        supported_codecs=[codec.payload_type],
        dtmf_payload_type=offered_dtmf_type(offer),
    )
    if codec.name == "opus":
        opus_answer(answer, codec.payload_type)
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
