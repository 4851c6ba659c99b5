"""A real aiortc caller: plays 16 kHz speech on its microphone track, records the agent's audio
with arrival times, and reads the server's events from the ``events`` data channel.

Timing is taken where a browser would see it: a caller frame "leaves" when aiortc pulls it from
the microphone track to encode and send it; an agent frame "arrives" when it has been received and
decoded. Both use the system-wide monotonic clock, which the server's event timestamps share.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import aiohttp
import av
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription

from media import FRAME_BYTES, FRAME_MS, Speaker, VadSegmenter
from media.audio import SAMPLE_RATE, pcm_rms_dbfs
from media.speaker import Playback
from server.transports.inbound import decode_on_loop
from server.transports.tracks import (
    OPUS_APPLICATION,
    OPUS_BITRATE,
    OUTPUT_RATE,
    SILENCE_TAIL_FRAMES,
    OpusPackets,
    SpeakerTrack,
    caller_frames,
    negotiated_opus,
)

__all__ = [
    "SILENCE_DBFS",
    "ReceivedFrame",
    "ReplayedOpusPackets",
    "SpokenUtterance",
    "WebRTCCaller",
    "longest_gap_ms",
    "voiced_span_ms",
]

BROWSER_OPUS_APPLICATION = "voip"
"""The callers' Opus mode: a browser's (libwebrtc encodes speech in libopus's VoIP mode)."""

SILENCE_DBFS = -50.0
"""Agent frames quieter than this count as silence."""


class ReplayedOpusPackets(OpusPackets):
    """A caller's microphone as Opus packets, each stretch of sound encoded once per process.

    The callers share the server's cores, and a browser's encoder, native code on the caller's
    own machine, costs the server nothing: encoding the same corpus utterances live for every
    caller took ~11 % of a core at 16 calls. Like a load generator replaying captured RTP, a
    frame is sent as the packet the VoIP encoder made of it before, but only after the same
    frames since the last silence: a packet depends on the encoder's state, so a frame is
    replayed only in the context it was encoded in (an all-zero frame inside one utterance is
    not the same packet as one inside another). A frame not heard in that context is encoded
    live, after the encoder is brought to that context by encoding the stretch again.
    """

    _encoded: ClassVar[dict[bytes, bytes]] = {}
    """Packets by a digest of their frame and every frame before it since the last silence,
    shared by every caller of the process."""

    def __init__(self, bitrate: int = OPUS_BITRATE, application: str = OPUS_APPLICATION) -> None:
        super().__init__(bitrate, application)
        self._stretch: list[tuple[bytes, bool]] = []
        """The frames since the last silence (sound, and the encoded silence that ends it)."""
        self._context = hashlib.blake2b(digest_size=16)
        self._quiet = SILENCE_TAIL_FRAMES + 1
        """Silent frames in a row: beyond ``SILENCE_TAIL_FRAMES``, the cached silence packet."""
        self._encoder_in_step = True
        """Whether the live encoder has encoded every frame of the stretch so far."""

    def packet(self, pcm: bytes, pts: int, *, silent: bool) -> av.Packet[Any]:
        self._quiet = self._quiet + 1 if silent else 0
        if self._quiet > SILENCE_TAIL_FRAMES:  # silence: a new stretch starts at the next sound
            if self._stretch:
                self._stretch.clear()
                self._context = hashlib.blake2b(digest_size=16)
                self._encoder_in_step = True
            return self._as_packet(self._silence, pts)
        self._stretch.append((pcm, silent))
        self._context.update(pcm)
        key = self._context.digest()
        data = self._encoded.get(key)
        if data is not None:
            self._encoder_in_step = False
            return self._as_packet(data, pts)
        if not self._encoder_in_step:  # it skipped replayed frames: give it the stretch
            samples = len(pcm) // 2
            first = pts - (len(self._stretch) - 1) * samples
            for n, (earlier, quiet) in enumerate(self._stretch[:-1]):
                super().packet(earlier, first + n * samples, silent=quiet)
            self._encoder_in_step = True
        data = self._encoded[key] = bytes(super().packet(pcm, pts, silent=silent))
        return self._as_packet(data, pts)


@dataclass(frozen=True)
class ReceivedFrame:
    at: float
    """Monotonic clock seconds when the decoded 20 ms frame was available."""
    dbfs: float


def longest_gap_ms(frames: Sequence[ReceivedFrame], start: float, end: float) -> float:
    """The longest run of inaudible frames between two audible ones in [start, end], in ms of
    audio (20 ms a frame): how long a pause inside one answer gets."""
    longest = run = 0
    for frame in frames:
        if frame.at < start or frame.at > end:
            continue
        if frame.dbfs > SILENCE_DBFS:
            longest, run = max(longest, run), 0
        else:
            run += 1
    return longest * FRAME_MS


@dataclass(frozen=True)
class SpokenUtterance:
    """A caller utterance on its way out; its voiced span in ms from the start of the PCM."""

    playback: Playback
    first_voiced_ms: float
    last_voiced_ms: float

    async def first_voiced_sent_at(self, timeout_s: float = 15.0) -> float:
        """When the first voiced frame left; raises TimeoutError if the microphone stalled."""
        return await self._started(timeout_s) + self.first_voiced_ms / 1000

    async def last_voiced_sent_at(self, timeout_s: float = 15.0) -> float:
        """When the last voiced frame left; raises TimeoutError if the microphone stalled."""
        return await self._started(timeout_s) + self.last_voiced_ms / 1000

    async def _started(self, timeout_s: float) -> float:
        started = await asyncio.wait_for(self.playback.started(), timeout_s)
        if started is None:
            raise RuntimeError("the utterance was dropped before it was sent")
        return started


def voiced_span_ms(pcm: bytes) -> tuple[float, float]:
    """(start of the first, end of the last) voiced 20 ms frame of 16 kHz PCM16, in ms."""
    vad = VadSegmenter()
    voiced = [
        i
        for i in range(len(pcm) // FRAME_BYTES)
        if vad.is_voiced(pcm[i * FRAME_BYTES : (i + 1) * FRAME_BYTES])
    ]
    if not voiced:
        raise ValueError("the utterance has no voiced frame")
    return voiced[0] * FRAME_MS, (voiced[-1] + 1) * FRAME_MS


@dataclass
class WebRTCCaller:
    """One browser-like caller. ``connect()``, then ``say()`` and read ``events`` / ``frames``."""

    pc: RTCPeerConnection = field(default_factory=RTCPeerConnection)
    microphone: Speaker = field(default_factory=lambda: Speaker(OUTPUT_RATE))
    events: list[dict[str, Any]] = field(default_factory=list)
    heard: bytearray = field(default_factory=bytearray)
    """The agent's audio as received, 16 kHz PCM16."""
    frames: list[ReceivedFrame] = field(default_factory=list)
    session_id: str = ""
    offer_headers: dict[str, str] = field(default_factory=dict)
    """Extra headers of the offer request (e.g. ``X-Vocable-Record: off``)."""
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def connect(self, base_url: str, *, token: str | None = None, **offer_extra: Any) -> None:
        """Offer, get the answer, and start media; raises RuntimeError if the server refuses."""
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)
        microphone = SpeakerTrack(self.microphone)
        self.pc.addTrack(microphone)
        self.pc.on("track", self._on_track)
        await self.pc.setLocalDescription(await self.pc.createOffer())
        body = {"sdp": self.pc.localDescription.sdp, "type": "offer", **offer_extra}
        headers = {**self.offer_headers, **({"Authorization": f"Bearer {token}"} if token else {})}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{base_url}/offer", json=body, headers=headers) as response,
        ):
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"offer refused: {response.status} {answer}")
        self.session_id = answer["session_id"]
        await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        for transceiver in self.pc.getTransceivers():  # a browser decodes natively: no thread
            if transceiver.kind == "audio":  # per caller (aiortc's 80 ms playout buffer stays)
                decode_on_loop(transceiver.receiver, opus_rate=SAMPLE_RATE)
        if negotiated_opus(answer["sdp"]):  # a browser's encoder is native code: keep ours cheap
            microphone.opus = ReplayedOpusPackets(application=BROWSER_OPUS_APPLICATION)

    def say(self, pcm16k: bytes) -> SpokenUtterance:
        """Queue speech on the microphone (after anything still playing)."""
        first, last = voiced_span_ms(pcm16k)
        return SpokenUtterance(self.microphone.push(pcm16k, SAMPLE_RATE), first, last)

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(json.dumps(message))

    def of_type(self, type: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["type"] == type]

    async def wait_for(self, type: str, count: int = 1, timeout_s: float = 30.0) -> dict[str, Any]:
        """The ``count``-th event of ``type``, waiting for it up to ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while len(self.of_type(type)) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return self.of_type(type)[count - 1]

    def first_sound_after(self, t: float) -> float | None:
        """Arrival time of the first non-silent agent frame after ``t``."""
        for frame in self.frames:
            if frame.at > t and frame.dbfs > SILENCE_DBFS:
                return frame.at
        return None

    def silent_from(self, t: float, hold_ms: float = 300.0) -> float | None:
        """The first arrival time after ``t`` from which the agent stays silent for ``hold_ms``."""
        candidate: float | None = None
        for frame in self.frames:
            if frame.at <= t:
                continue
            if frame.dbfs > SILENCE_DBFS:
                candidate = None
            elif candidate is None:
                candidate = frame.at
            elif frame.at - candidate >= hold_ms / 1000:
                return candidate
        return None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.pc.close()

    def _on_message(self, message: str) -> None:
        self.events.append(json.loads(message))
        self._arrived.set()

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._tasks.append(asyncio.create_task(self._record(track)))

    async def _record(self, track: MediaStreamTrack) -> None:
        async for frame in caller_frames(track):  # the same conversion the server uses
            self.heard += frame
            self.frames.append(ReceivedFrame(time.monotonic(), pcm_rms_dbfs(frame)))
