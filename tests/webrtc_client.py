"""A real aiortc caller for end-to-end tests: speaks PCM, records the agent, reads events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription

from media import Resampler, Speaker
from media.audio import SAMPLE_RATE, pcm_rms_dbfs
from server.webrtc import OUTPUT_RATE, SpeakerTrack, caller_frames


@dataclass
class ReceivedFrame:
    at: float
    dbfs: float


@dataclass
class WebRTCCaller:
    """One browser-like caller. ``say()`` queues 16 kHz speech on its microphone track."""

    pc: RTCPeerConnection = field(default_factory=RTCPeerConnection)
    microphone: Speaker = field(default_factory=lambda: Speaker(OUTPUT_RATE))
    events: list[dict[str, Any]] = field(default_factory=list)
    heard: bytearray = field(default_factory=bytearray)
    """The agent's audio as received, 16 kHz PCM16."""
    frames: list[ReceivedFrame] = field(default_factory=list)
    session_id: str = ""
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def connect(self, base_url: str, **offer_extra: Any) -> None:
        channel = self.pc.createDataChannel("events")
        channel.on("message", self._on_message)
        self.channel = channel
        self.pc.addTrack(SpeakerTrack(self.microphone))
        self.pc.on("track", self._on_track)
        await self.pc.setLocalDescription(await self.pc.createOffer())
        body = {"sdp": self.pc.localDescription.sdp, "type": "offer", **offer_extra}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{base_url}/offer", json=body) as response,
        ):
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"offer refused: {response.status} {answer}")
        self.session_id = answer["session_id"]
        await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))

    def say(self, pcm16k: bytes) -> None:
        self.microphone.push(pcm16k, SAMPLE_RATE)

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(json.dumps(message))

    def of_type(self, type: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["type"] == type]

    async def wait_for(self, type: str, count: int = 1, timeout_s: float = 30.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            while len(self.of_type(type)) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return self.of_type(type)[count - 1]

    def _on_message(self, message: str) -> None:
        self.events.append(json.loads(message))
        self._arrived.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.pc.close()

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._tasks.append(asyncio.create_task(self._record(track)))

    async def _record(self, track: MediaStreamTrack) -> None:
        async for frame in caller_frames(track):  # the same conversion the server uses
            self.heard += frame
            self.frames.append(ReceivedFrame(time.monotonic(), pcm_rms_dbfs(frame)))


def resample_to_16k(pcm: bytes, rate: int) -> bytes:
    resampler = Resampler(rate, SAMPLE_RATE)
    return resampler.resample(pcm) + resampler.flush()
