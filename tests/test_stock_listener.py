"""The stock listener times the agent's audio by a playout clock, as a sound card plays it.

A track that delivers a burst of frames is played one frame per 20 ms tick, an underrun puts in
silence, and over a real WebRTC call (aiortc peers on loopback, no models) the stock listener
hears each frame no earlier than it arrived, after aiortc's jitter buffer held its packet.
"""

from __future__ import annotations

import asyncio
import fractions
import itertools
import statistics
import time
from collections.abc import AsyncIterator

import av
import pytest
from aiohttp import web
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaRelay
from aiortc.mediastreams import MediaStreamError

from media import FRAME_BYTES, Speaker
from media.audio import SAMPLE_RATE
from server.testkit.caller import SILENCE_DBFS, ReceivedFrame, WebRTCCaller
from server.testkit.loopback import start_on_loopback
from server.transports.webrtc.tracks import OUTPUT_RATE, SpeakerTrack
from tests.support.speech import tone

PERIOD_S = 0.02
SAMPLES = OUTPUT_RATE // 50


class QueuedTrack(MediaStreamTrack):
    """An agent track that gives whatever frames the test puts, when it puts them (None: ends)."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.queue: asyncio.Queue[av.AudioFrame | None] = asyncio.Queue()
        self._pts = 0

    def put_tone(self, frames: int) -> None:
        """``frames`` 20 ms frames of a 440 Hz tone at once (48 kHz mono, as aiortc gives)."""
        pcm = tone(OUTPUT_RATE, 20, amplitude=0.3)
        for _ in range(frames):
            frame = av.AudioFrame(format="s16", layout="mono", samples=SAMPLES)
            frame.planes[0].update(pcm)
            frame.sample_rate, frame.pts = OUTPUT_RATE, self._pts
            frame.time_base = fractions.Fraction(1, OUTPUT_RATE)
            self._pts += SAMPLES
            self.queue.put_nowait(frame)

    async def recv(self) -> av.AudioFrame:
        frame = await self.queue.get()
        if frame is None:
            self.stop()
            raise MediaStreamError
        return frame


def audible(frames: list[ReceivedFrame]) -> list[ReceivedFrame]:
    return [f for f in frames if f.dbfs > SILENCE_DBFS]


async def test_a_burst_is_played_one_frame_per_tick_and_an_underrun_plays_silence() -> None:
    stock, arrival = WebRTCCaller(listener="stock"), WebRTCCaller()
    tracks = QueuedTrack(), QueuedTrack()
    stock.listen(tracks[0])
    arrival.listen(tracks[1])
    try:
        for track in tracks:
            track.put_tone(10)  # 200 ms of audio at once
        await asyncio.sleep(0.3)  # played by 0.2 s: ~5 ticks find nothing
        for track in tracks:
            track.put_tone(5)
            track.queue.put_nowait(None)
        await asyncio.sleep(0.25)
    finally:
        await stock.close()
        await arrival.close()

    frames = stock.frames
    assert len(audible(frames)) == 15
    assert len(stock.heard) == len(frames) * FRAME_BYTES
    gaps = [b.at - a.at for a, b in itertools.pairwise(frames)]
    assert gaps == pytest.approx([PERIOD_S] * len(gaps), abs=1e-9)  # the clock, not arrivals
    first = frames[0]
    assert first.at == first.arrived_at  # the clock starts with the first frame
    burst = frames[:10]
    assert all(f.dbfs > SILENCE_DBFS for f in burst)
    assert max(f.arrived_at or 0 for f in burst) - first.at < 0.1  # arrived together...
    assert burst[-1].at - first.at == pytest.approx(9 * PERIOD_S)  # ...played over 180 ms
    underrun = frames[10:-5]
    assert len(underrun) >= 3  # ~100 ms with nothing to play
    assert all(f.dbfs <= SILENCE_DBFS and f.arrived_at is None for f in underrun)
    assert stock.playout is not None
    assert stock.playout.underruns == len(underrun)
    assert stock.heard[10 * FRAME_BYTES : (10 + len(underrun)) * FRAME_BYTES].count(0) == (
        len(underrun) * FRAME_BYTES
    )
    second = frames[-5:]
    assert all(f.dbfs > SILENCE_DBFS for f in second)
    assert 0 <= second[0].at - (second[0].arrived_at or 0) < PERIOD_S  # the next tick
    assert all(f.arrived_at is not None and f.at >= f.arrived_at for f in audible(frames))
    assert stock.first_sound_after(second[0].at - 0.001) == second[0].at
    assert stock.silent_from(burst[-1].at, hold_ms=40) == underrun[0].at

    # the arrival listener, fed the same: each burst heard at once, no silence in between
    heard = arrival.frames
    assert len(heard) == 15
    assert all(f.dbfs > SILENCE_DBFS for f in heard)
    assert heard[9].at - heard[0].at < 0.1  # (a loop stall aside, at once)
    assert arrival.playout is None


@pytest.fixture
async def agent() -> AsyncIterator[tuple[str, Speaker]]:
    """A minimal agent on loopback: ``POST /offer`` answers with Vocable's own outgoing track,
    one speaker for every caller, relayed so that all callers get each frame at the same time."""
    speaker = Speaker(OUTPUT_RATE)
    source = SpeakerTrack(speaker)
    relay = MediaRelay()
    peers: list[RTCPeerConnection] = []

    async def offer(request: web.Request) -> web.Response:
        body = await request.json()
        pc = RTCPeerConnection()
        peers.append(pc)
        pc.addTrack(relay.subscribe(source, buffered=False))
        await pc.setRemoteDescription(RTCSessionDescription(body["sdp"], body["type"]))
        await pc.setLocalDescription(await pc.createAnswer())
        answer = pc.localDescription
        return web.json_response({"sdp": answer.sdp, "type": answer.type, "session_id": "s"})

    app = web.Application()
    app.router.add_post("/offer", offer)
    runner, port = await start_on_loopback(app)
    try:
        yield f"http://127.0.0.1:{port}", speaker
    finally:
        for pc in peers:
            await pc.close()
        await runner.cleanup()


@pytest.mark.timeout(30)
async def test_in_one_call_the_stock_listener_hears_after_arrival_and_the_jitter_buffer(
    agent: tuple[str, Speaker],
) -> None:
    url, speaker = agent
    stock, arrival = WebRTCCaller(listener="stock"), WebRTCCaller()
    try:
        await stock.connect(url)
        await arrival.connect(url)
        async with asyncio.timeout(10):  # both hear the agent's (silent) audio flowing
            while len(stock.frames) < 10 or len(arrival.frames) < 10:  # noqa: ASYNC110 - no event
                await asyncio.sleep(0.05)
        spoken_at = time.monotonic()
        speaker.push(tone(SAMPLE_RATE, 400, amplitude=0.3), SAMPLE_RATE)
        await asyncio.sleep(1.0)
    finally:
        await stock.close()
        await arrival.close()

    first_played = stock.first_sound_frame_after(spoken_at)
    first_arrived = arrival.first_sound_frame_after(spoken_at)
    assert first_played is not None
    assert first_arrived is not None
    # the same frames, the same moment: played no earlier than they came out of the receiver
    assert first_played.arrived_at is not None
    assert first_played.at >= first_played.arrived_at
    assert all(f.at >= (f.arrived_at or f.at) for f in stock.frames)
    # (the other caller decodes on the loop, not in a thread: scheduling either way, and a busy
    # machine's stalls)
    assert first_played.at >= first_arrived.at - 0.05
    # aiortc's jitter buffer: a packet waits for 4 more (80 ms at 20 ms each; less when a busy
    # sender bunches them)
    held = [
        f.arrived_at - f.packet_at
        for f in audible(stock.frames)
        if f.arrived_at is not None and f.packet_at is not None
    ]
    assert len(held) >= 15
    assert statistics.median(held) >= 0.04
    assert stock.silent_from(first_played.at) is not None  # and the tone's end is heard
