"""SRTP for SIP calls, keyed in the SDP (SDES, RFC 4568; the protection is RFC 3711's).

An offer on ``RTP/SAVP`` carries ``a=crypto`` lines, each a suite and a master key (and salt)
in base64. Vocable takes the first line with a suite it has (``AES_CM_128_HMAC_SHA1_80``, then
``_32``), answers with the same tag and suite and a key of its own, and from then on protects
every RTP and RTCP packet it sends with its key and authenticates and decrypts every one it gets
with the caller's (libsrtp, through ``pylibsrtp``). A packet that fails authentication is
dropped, never played.

``--sip-srtp`` says what is accepted: ``required`` (an offer without a usable ``a=crypto`` line
gets 488), ``optional`` (SRTP when offered, plain RTP otherwise; the default) or ``off`` (plain
RTP only: an ``RTP/SAVP`` offer gets 488). SDES keys travel in the SDP: over UDP or TCP anyone
on the path can read them, so use it with SIP over TLS (``--sip-tls``).

The protection wraps aiortp's sockets from outside (:func:`protect_session`): aiortp has no SRTP
of its own; ``compat.py`` checks the two private members it relies on.
"""

from __future__ import annotations

import base64
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from aiosipua import SdpMessage
from pylibsrtp import Error as SrtpError
from pylibsrtp import Policy, Session

from server.config.server import SrtpMode

__all__ = [
    "SUITES",
    "Crypto",
    "SrtpMode",
    "choose_crypto",
    "protect_session",
    "secure_answer",
    "secured",
    "srtp_problem",
]

log = logging.getLogger(__name__)

SUITES = {
    "AES_CM_128_HMAC_SHA1_80": Policy.SRTP_PROFILE_AES128_CM_SHA1_80,
    "AES_CM_128_HMAC_SHA1_32": Policy.SRTP_PROFILE_AES128_CM_SHA1_32,
}
"""The suites Vocable takes, in the order it prefers them."""
KEY_BYTES = 30
"""A master key (16 bytes) and salt (14 bytes) of the AES-128 suites."""


@dataclass(frozen=True)
class Crypto:
    """One ``a=crypto`` line: its tag, suite and master key with salt."""

    tag: int
    suite: str
    key: bytes

    @classmethod
    def parse(cls, value: str) -> Crypto | None:
        """The line's value (after ``a=crypto:``), or None when Vocable cannot use it (an
        unknown suite, a key of the wrong length, a key lifetime or MKI are ignored)."""
        parts = value.split()
        if len(parts) < 3 or parts[1] not in SUITES or not parts[2].startswith("inline:"):
            return None
        try:
            tag = int(parts[0])
            key = base64.b64decode(parts[2][len("inline:") :].split("|")[0], validate=True)
        except ValueError:
            return None
        return cls(tag, parts[1], key) if len(key) == KEY_BYTES else None

    @classmethod
    def fresh(cls, tag: int, suite: str) -> Crypto:
        return cls(tag, suite, secrets.token_bytes(KEY_BYTES))

    def line(self) -> str:
        return f"{self.tag} {self.suite} inline:{base64.b64encode(self.key).decode()}"


def secured(sdp: SdpMessage) -> bool:
    """Whether the SDP's audio is on a secure profile (``RTP/SAVP``, ``RTP/SAVPF``)."""
    audio = sdp.audio
    return audio is not None and "SAVP" in audio.proto.upper()


def choose_crypto(offer: SdpMessage) -> Crypto | None:
    """The offer's first ``a=crypto`` line on a suite Vocable has (by its preference)."""
    audio = offer.audio
    lines = [Crypto.parse(v) for v in (audio.attributes.get("crypto", []) if audio else [])]
    usable = [line for line in lines if line is not None]
    for suite in SUITES:
        for line in usable:
            if line.suite == suite:
                return line
    return None


def srtp_problem(offer: SdpMessage, mode: SrtpMode) -> str | None:
    """Why ``offer`` is refused (488) under ``mode``, or None."""
    if secured(offer):
        if mode == "off":
            return "SRTP offered, and --sip-srtp is off"
        if choose_crypto(offer) is None:
            return f"no a=crypto line on a suite Vocable has ({', '.join(SUITES)})"
    elif mode == "required":
        return "plain RTP offered, and --sip-srtp requires SRTP"
    return None


def secure_answer(answer: SdpMessage, theirs: Crypto) -> Crypto:
    """Make ``answer`` an ``RTP/SAVP`` answer to ``theirs`` with a key of our own (returned)."""
    ours = Crypto.fresh(theirs.tag, theirs.suite)
    audio = answer.audio
    assert audio is not None
    audio.proto = "RTP/SAVP"
    audio.attributes["crypto"] = [ours.line()]
    return ours


class _Protected:
    """A datagram transport that protects what it sends (an aiortp socket, wrapped)."""

    def __init__(self, inner: Any, protect: Any) -> None:
        self._inner = inner
        self._protect = protect

    def sendto(self, data: bytes, addr: Any = None) -> None:
        try:
            self._inner.sendto(self._protect(data), addr)
        except SrtpError as exc:  # a packet libsrtp will not take: dropped, logged once a call
            log.debug("SRTP protect failed: %s", exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def protect_session(rtp_session: Any, theirs: Crypto, ours: Crypto) -> None:
    """Protect a started ``aiortp.RTPSession``: RTP and RTCP out with ``ours``, in with
    ``theirs`` (packets that fail authentication are dropped)."""
    outbound = Session(
        Policy(key=ours.key, ssrc_type=Policy.SSRC_ANY_OUTBOUND, srtp_profile=SUITES[ours.suite])
    )
    inbound = Session(
        Policy(key=theirs.key, ssrc_type=Policy.SSRC_ANY_INBOUND, srtp_profile=SUITES[theirs.suite])
    )
    sockets = ((rtp_session._rtp_transport, False), (rtp_session._rtcp_transport, True))
    for transport, rtcp in sockets:
        if transport is None or transport._transport is None:
            continue
        protect = outbound.protect_rtcp if rtcp else outbound.protect
        transport._transport = _Protected(transport._transport, protect)
        received = transport.datagram_received
        transport.datagram_received = _unprotecting(received, inbound, rtcp)


def _unprotecting(received: Any, inbound: Session, rtcp: bool) -> Any:
    def datagram_received(data: bytes, addr: tuple[str, int]) -> None:
        if not data or data[0] & 0xC0 != 0x80:  # not RTP version 2: a STUN probe, as it is
            received(data, addr)
            return
        is_rtcp = rtcp or (len(data) > 1 and 192 <= data[1] <= 223)  # RTCP muxed on the RTP port
        try:
            clear = inbound.unprotect_rtcp(data) if is_rtcp else inbound.unprotect(data)
        except SrtpError:
            return  # not authentic (or a STUN probe): never played
        received(clear, addr)

    return datagram_received
