"""A real aiortc caller: plays 16 kHz speech on its microphone track, records the agent's audio
with its times, and reads the server's events from the ``events`` data channel.

A caller frame "leaves" when aiortc pulls it from the microphone track to encode and send it. An
agent frame is timed by the caller's *listener* (:data:`Listener`): ``"arrival"`` (the default)
when it has been received and decoded, ``"stock"`` when a stock client would play it (aiortc's
receiver as shipped, then a sound card's 20 ms playout clock: :class:`PlayoutClock`). All times
use the system-wide monotonic clock, which the server's event timestamps share.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import aiohttp
import av
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription
from aiortc.rtp import RtpPacket

from media import FRAME_BYTES, FRAME_MS, Speaker, VadSegmenter
from media.audio import SAMPLE_RATE, pcm_rms_dbfs
from media.speaker import Playback
from server.transports.webrtc.inbound import decode_on_loop
from server.transports.webrtc.tracks import (
    OPUS_APPLICATION,
    OPUS_BITRATE,
    OUTPUT_RATE,
    SILENCE_TAIL_FRAMES,
    OpusPackets,
    SpeakerTrack,
    caller_frames,
    negotiated_opus,
)

from .echo_path import EchoingMicrophone, ReturnedEcho
from .network import LossyLine, NetworkPath, impair_dtls

__all__ = [
    "SILENCE_DBFS",
    "HeardAt",
    "Listener",
    "PlayoutClock",
    "ReceivedFrame",
    "ReplayedOpusPackets",
    "SpokenUtterance",
    "WebRTCCaller",
    "longest_gap_ms",
    "silent_from",
    "voiced_span_ms",
]

BROWSER_OPUS_APPLICATION = "voip"
"""The callers' Opus mode: a browser's (libwebrtc encodes speech in libopus's VoIP mode)."""

SILENCE_DBFS = -50.0
"""Agent frames quieter than this count as silence."""

Listener = Literal["arrival", "stock"]
"""How a :class:`WebRTCCaller` times the agent's audio. ``"arrival"``: each 20 ms frame when it
comes out of the receiver, decoded (on the event loop, :func:`decode_on_loop`). ``"stock"``: when
a stock client plays it: aiortc's receiver as shipped, then a :class:`PlayoutClock`."""


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
    """One 20 ms frame of the agent's audio as the caller's listener heard it."""

    at: float
    """Monotonic clock seconds when the frame was heard: when it was available, decoded (the
    ``"arrival"`` listener), or when it was played (the ``"stock"`` listener)."""
    dbfs: float
    arrived_at: float | None = None
    """The stock listener: when the frame came out of aiortc's receiver, decoded; None for the
    silence its playout put in on an underrun, and with the arrival listener (``at`` is that)."""
    packet_at: float | None = None
    """The stock listener: when the frame's RTP packet reached aiortc's receiver, before its
    jitter buffer; None when not known."""


class PlayoutClock:
    """A sound card's output: one 20 ms frame played every ``period_s`` of a steady clock.

    Frames are queued as they arrive (:meth:`push`). The clock starts at the first frame's
    arrival and ticks every period from then on, whatever arrives. Each tick plays the oldest
    queued frame that had arrived by then or, when none had (an underrun), a frame of silence, as
    a device does; each played frame goes to ``frames`` (its ``at`` the tick's time, the time
    it was played) and its PCM to ``heard``. A tick is timed by the clock, not by when its task
    woke: a late wake-up plays every tick it missed, each at its own time and with what had
    arrived by then. Nothing is dropped or time-stretched: like a plain device buffer (not a
    browser's NetEq, which adapts), each underrun delays every later frame by one period for
    good. After :meth:`end`, :meth:`run` plays what is queued and returns.
    """

    def __init__(
        self,
        frames: list[ReceivedFrame],
        heard: bytearray,
        *,
        period_s: float = FRAME_MS / 1000,
        frame_bytes: int = FRAME_BYTES,
    ) -> None:
        self.frames = frames
        self.heard = heard
        self.period_s = period_s
        self.underruns = 0
        """Ticks that found no frame and played silence."""
        self._silence = bytes(frame_bytes)
        self._silence_dbfs = pcm_rms_dbfs(self._silence)
        self._queue: deque[tuple[bytes, float, float, float | None]] = deque()
        self._started: float | None = None
        self._ended = False
        self._wake = asyncio.Event()

    @property
    def queued(self) -> int:
        """Frames arrived and not yet played."""
        return len(self._queue)

    def push(self, pcm: bytes, arrived_at: float, packet_at: float | None = None) -> None:
        """Queue one 20 ms frame that arrived at ``arrived_at`` (monotonic seconds, never
        earlier than a frame pushed before it); ``packet_at``: when its packet came in."""
        self._queue.append((pcm, pcm_rms_dbfs(pcm), arrived_at, packet_at))
        if self._started is None:
            self._started = arrived_at
            self._wake.set()

    def end(self) -> None:
        """No more frames will come: :meth:`run` returns once those queued are played."""
        self._ended = True
        self._wake.set()

    async def run(self) -> None:
        """Play until :meth:`end` and an empty queue (or cancellation)."""
        while self._started is None and not self._ended:
            await self._wake.wait()
        if self._started is None:
            return
        tick = 0
        while True:
            now = time.monotonic()
            while (played_at := self._started + tick * self.period_s) <= now:
                if self._ended and not self._queue:
                    return
                self._play(played_at)
                tick += 1
            await asyncio.sleep(played_at - time.monotonic())

    def _play(self, played_at: float) -> None:
        if self._queue and self._queue[0][2] <= played_at:
            pcm, dbfs, arrived_at, packet_at = self._queue.popleft()
            self.frames.append(ReceivedFrame(played_at, dbfs, arrived_at, packet_at))
        else:
            self.underruns += 1
            pcm = self._silence
            self.frames.append(ReceivedFrame(played_at, self._silence_dbfs))
        self.heard += pcm


class _PacketArrivals:
    """When each RTP packet reached an aiortc receiver, before its jitter buffer, found again by
    the ``pts`` aiortc's decoder gives the packet's frame (the RTP timestamp less the first
    one's, which is what aiortc's ``TimestampMapper`` makes of it on an in-order stream).

    It wraps the receiver's ``_handle_rtp_packet`` (aiortc 1.16; looked up per packet by the
    DTLS transport): a clock reading, then aiortc's own handling, unchanged."""

    KEPT = 512
    """Packets remembered (~10 s): more than a jitter buffer of 16 ever holds."""

    def __init__(self, receiver: RTCRtpReceiver) -> None:
        self._origin: int | None = None
        self._times: dict[int, float] = {}
        handle: Callable[[RtpPacket, int], Awaitable[None]] = receiver._handle_rtp_packet

        async def observed(packet: RtpPacket, arrival_time_ms: int) -> None:
            self._observe(packet)
            await handle(packet, arrival_time_ms)

        setattr(receiver, "_handle_rtp_packet", observed)  # noqa: B010 - an instance's method

    def _observe(self, packet: RtpPacket) -> None:
        if self._origin is None:
            self._origin = packet.timestamp
        key = (packet.timestamp - self._origin) % 2**32
        if key not in self._times:
            self._times[key] = time.monotonic()
            if len(self._times) > self.KEPT:
                del self._times[next(iter(self._times))]

    def pop(self, pts: int | None) -> float | None:
        """When the packet of the decoded frame with ``pts`` came in; None if not seen."""
        return None if pts is None else self._times.pop(pts % 2**32, None)


class _StampedTrack(MediaStreamTrack):
    """Another track's frames, each noted (its ``pts`` and when ``recv()`` gave it) on the way."""

    kind = "audio"

    def __init__(self, track: MediaStreamTrack) -> None:
        super().__init__()
        self._track = track
        self.pts: int | None = None
        self.at = 0.0

    async def recv(self) -> Any:
        frame = await self._track.recv()
        self.pts, self.at = getattr(frame, "pts", None), time.monotonic()
        return frame


class HeardAt(Protocol):
    """A frame of the agent's audio with when it was heard and how loud it was."""

    @property
    def at(self) -> float: ...

    @property
    def dbfs(self) -> float: ...


def silent_from(frames: Sequence[HeardAt], t: float, hold_ms: float = 300.0) -> float | None:
    """The first time after ``t`` from which ``frames`` (in order) are silent for ``hold_ms``."""
    candidate: float | None = None
    for frame in frames:
        if frame.at <= t:
            continue
        if frame.dbfs > SILENCE_DBFS:
            candidate = None
        elif candidate is None:
            candidate = frame.at
        elif frame.at - candidate >= hold_ms / 1000:
            return candidate
    return None


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
    """One browser-like caller. ``connect()``, then ``say()`` and read ``events`` / ``frames``.

    ``listener`` says when an agent frame counts as heard (``frames``' ``at``, which
    :meth:`first_sound_after` and :meth:`silent_from` read):

    - ``"arrival"`` (the default): when it comes out of the receiver, decoded. The receiver keeps
      aiortc's jitter buffer and decodes on the event loop (:func:`decode_on_loop`), as a
      browser's native decoder costs no thread per caller.
    - ``"stock"``: when a stock client plays it. The receiver is aiortc's as shipped, and a
      :class:`PlayoutClock` takes one frame from its track every 20 ms, as a sound card would.
      A stock client's delay after a packet reaches it is then: aiortc's jitter buffer, which
      releases a frame only once 4 later ones have arrived (``JitterBuffer(capacity=16,
      prefetch=4)``: ~80 ms at the sender's steady 20 ms; less for a packet followed by a
      burst; a lost packet holds every later one until 16 have queued); the decoder thread
      (Opus to 48 kHz stereo, each frame posted back to the event loop); then the playout's
      wait for its next tick (0-20 ms), plus one period for each underrun so far, since a plain
      device buffer never catches up. Not modelled: a device's own output buffer, and a
      browser's NetEq, which adapts its delay to the jitter it sees and time-stretches to it.
      Each frame also keeps when it came out of the receiver (``arrived_at``) and when its
      packet came in (``packet_at``), so one call splits its delay into jitter buffer and
      playout; ``heard`` is what was played, underrun silence included.
    """

    pc: RTCPeerConnection = field(default_factory=RTCPeerConnection)
    microphone: Speaker = field(default_factory=lambda: Speaker(OUTPUT_RATE))
    events: list[dict[str, Any]] = field(default_factory=list)
    heard: bytearray = field(default_factory=bytearray)
    """The agent's audio as heard (see ``listener``), 16 kHz PCM16."""
    frames: list[ReceivedFrame] = field(default_factory=list)
    session_id: str = ""
    offer_headers: dict[str, str] = field(default_factory=dict)
    """Extra headers of the offer request (e.g. ``X-Vocable-Record: off``)."""
    listener: Listener = "arrival"
    """When an agent frame counts as heard: on arrival, or when a stock client plays it."""
    echo: ReturnedEcho | None = None
    """The agent's voice returned into the microphone as heard (a speakerphone; None: no
    echo): the microphone becomes an :class:`~.echo_path.EchoingMicrophone`."""
    network: NetworkPath | None = None
    """What the network does to the caller's packets (None: a perfect one)."""
    lossy: LossyLine | None = field(default=None, init=False)
    """The caller's packets through :attr:`network`, once connected (its counts)."""
    playout: PlayoutClock | None = field(default=None, init=False)
    """The stock listener's playout (its ``underruns``, ``queued``), once the agent's track
    started; None with the arrival listener."""
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _packets: _PacketArrivals | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.listener not in ("arrival", "stock"):
            raise ValueError(f"unknown listener {self.listener!r}")
        if self.echo is not None:
            self.microphone = EchoingMicrophone(self.microphone.sample_rate, self.echo)

    async def connect(self, base_url: str, *, token: str | None = None, **offer_extra: Any) -> None:
        """Offer, get the answer, and start media; raises RuntimeError if the server refuses."""
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)
        microphone = SpeakerTrack(self.microphone)
        self.pc.addTrack(microphone)
        self.pc.on("track", self.listen)
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
        for transceiver in self.pc.getTransceivers():
            if transceiver.kind != "audio":
                continue
            if self.network is not None:
                self.lossy = impair_dtls(transceiver.sender.transport, self.network)
            if self.listener == "stock":  # aiortc's receiver as shipped, its packets timed
                self._packets = _PacketArrivals(transceiver.receiver)
            else:  # a browser decodes natively: no thread per caller (aiortc's buffer stays)
                decode_on_loop(transceiver.receiver, opus_rate=SAMPLE_RATE)
        if negotiated_opus(answer["sdp"]):  # a browser's encoder is native code: keep ours cheap
            microphone.opus = ReplayedOpusPackets(application=BROWSER_OPUS_APPLICATION)

    def listen(self, track: MediaStreamTrack) -> None:
        """Record the agent's ``track`` into ``frames`` and ``heard`` with this caller's
        listener, until it ends or :meth:`close` (``connect()`` does this for the call's)."""
        if self.listener == "stock":
            self.playout = PlayoutClock(self.frames, self.heard)
            self._tasks.append(asyncio.create_task(self._receive(track, self.playout)))
            self._tasks.append(asyncio.create_task(self.playout.run()))
        else:
            self._tasks.append(asyncio.create_task(self._record(track)))

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
        """When the first non-silent agent frame after ``t`` was heard (see ``listener``)."""
        frame = self.first_sound_frame_after(t)
        return None if frame is None else frame.at

    def first_sound_frame_after(self, t: float) -> ReceivedFrame | None:
        """The first non-silent agent frame heard after ``t``; None if none yet."""
        for frame in self.frames:
            if frame.at > t and frame.dbfs > SILENCE_DBFS:
                return frame
        return None

    def silent_from(self, t: float, hold_ms: float = 300.0) -> float | None:
        """The first time after ``t`` from which the agent is heard silent for ``hold_ms``."""
        return silent_from(self.frames, t, hold_ms)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.pc.close()

    def _on_message(self, message: str) -> None:
        self.events.append(json.loads(message))
        self._arrived.set()

    async def _record(self, track: MediaStreamTrack) -> None:
        async for frame in caller_frames(track):  # the same conversion the server uses
            self.heard += frame
            self.frames.append(ReceivedFrame(time.monotonic(), pcm_rms_dbfs(frame)))
            if isinstance(self.microphone, EchoingMicrophone):
                self.microphone.path.played(frame, SAMPLE_RATE)

    async def _receive(self, track: MediaStreamTrack, playout: PlayoutClock) -> None:
        """The stock listener's side of the track: each frame, as it comes out of aiortc's
        receiver, into the playout (which ``end()``s with the track)."""
        stamped = _StampedTrack(track)
        try:
            async for frame in caller_frames(stamped):  # the same conversion the server uses
                packets = self._packets
                packet_at = packets.pop(stamped.pts) if packets is not None else None
                playout.push(frame, stamped.at, packet_at)
        finally:
            playout.end()
