"""The RTP session of a SIP call, inbound or outbound, as Vocable receives the caller's audio.

aiortp's receive defaults suit a media player, not a voice agent: a jitter buffer that waits
for a lost packet until 16 later ones have arrived, then drops its slot without concealment,
and from then on delivers each frame 15 packets (300 ms) after it arrived, for the rest of the
call (no frame leaves but on an arrival). On a line that loses packets the agent then heard the
caller 300 ms late, and took a pause that was over for one that went on: it cut in. Here a gap
is taken as lost as soon as a later packet is in (loss concealment fills it), and a frame waits
for :data:`JITTER_PREFETCH` later ones: a packet overtaken by up to that many still finds its
place, and on a clean line the caller is heard 40 ms after the fact, not 80.
"""

from __future__ import annotations

from aiosipua import SdpMessage
from aiosipua.rtp_bridge import CallSession

__all__ = ["JITTER_PREFETCH", "call_media"]

JITTER_PREFETCH = 2
"""Frames a received frame waits behind: the reordering tolerated (20 ms each)."""


def call_media(
    local_ip: str,
    rtp_port: int,
    offer: SdpMessage,
    *,
    advertised_ip: str | None,
    supported_codecs: list[int],
    dtmf_payload_type: int,
) -> CallSession:
    """A call's RTP session answering (or, for a call we placed, following) ``offer``:
    symmetric RTP (media goes where the peer's packets come from), losses concealed at once."""
    return CallSession(
        local_ip=local_ip,
        rtp_port=rtp_port,
        offer=offer,
        advertised_ip=advertised_ip,
        supported_codecs=supported_codecs,
        dtmf_payload_type=dtmf_payload_type,
        jitter_prefetch=JITTER_PREFETCH,
        skip_audio_gaps=True,
        symmetric_rtp=True,
    )
