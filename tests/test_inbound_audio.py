"""The caller's audio into the server: each packet released as it arrives (no playout buffer)
and decoded on the event loop to mono (no decoder thread per call), with real aiortc receivers
and real libopus."""

from __future__ import annotations

import asyncio
import ctypes.util
import queue
import threading
from pathlib import Path

import av
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.codecs import PCMU_CODEC
from aiortc.codecs.g711 import PcmuEncoder
from aiortc.jitterbuffer import JitterFrame
from aiortc.mediastreams import AudioStreamTrack
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtp import RtpPacket

from media import opus
from media.audio import pcm_rms_dbfs
from server.transports.webrtc import libopus
from server.transports.webrtc.inbound import LoopDecoder, PromptAudioBuffer, hear_promptly
from tests.support.speech import peak_frequency, tone

pytestmark = pytest.mark.timeout(30)

OPUS = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2, payloadType=111)


def _opus_packet(sequence_number: int) -> RtpPacket:
    packet = RtpPacket(payload_type=111, sequence_number=sequence_number % 65536)
    packet.timestamp = 960 * sequence_number % 2**32
    packet._data = b"opus"  # type: ignore[attr-defined]  # the depacketized payload
    return packet


def _opus_frames(pcm48k_mono: bytes, channels: int) -> list[bytes]:
    """``pcm48k_mono`` as 20 ms Opus packets of a ``channels``-channel stream."""
    encoder = av.CodecContext.create("libopus", "w")
    assert isinstance(encoder, av.audio.codeccontext.AudioCodecContext)
    encoder.sample_rate, encoder.format = 48000, "s16"
    encoder.layout = "mono" if channels == 1 else "stereo"
    packets: list[bytes] = []
    for n, start in enumerate(range(0, len(pcm48k_mono) - 1919, 1920)):
        chunk = pcm48k_mono[start : start + 1920]
        if channels == 2:  # the same voice on both channels
            chunk = b"".join(chunk[i : i + 2] * 2 for i in range(0, len(chunk), 2))
        frame = av.AudioFrame(format="s16", layout=encoder.layout, samples=960)
        frame.planes[0].update(chunk)
        frame.sample_rate, frame.pts = 48000, n * 960
        packets += [bytes(p) for p in encoder.encode(frame)]
    return packets


async def _offered_receiver(answerer: RTCPeerConnection, offerer: RTCPeerConnection) -> object:
    offerer.addTrack(AudioStreamTrack())
    await offerer.setLocalDescription(await offerer.createOffer())
    offer = offerer.localDescription
    await answerer.setRemoteDescription(RTCSessionDescription(offer.sdp, offer.type))
    return answerer.getTransceivers()[0].receiver


async def test_a_call_receiver_gets_the_prompt_buffer_and_the_loop_decoder() -> None:
    answerer, offerer = RTCPeerConnection(), RTCPeerConnection()
    try:
        receiver = await _offered_receiver(answerer, offerer)
        assert hear_promptly(receiver)  # type: ignore[arg-type]
        members = vars(receiver)
        buffer = members["_RTCRtpReceiver__jitter_buffer"]
        assert isinstance(members["_RTCRtpReceiver__decoder_queue"], LoopDecoder)
        # aiortc's default holds each 20 ms packet until four more have arrived (80 ms)
        released = [buffer.add(_opus_packet(n))[1] for n in range(3)]
        assert [frame.timestamp for frame in released] == [0, 960, 1920]
    finally:
        await asyncio.gather(answerer.close(), offerer.close())


async def test_a_receiver_without_its_track_yet_keeps_aiortcs_decoder() -> None:
    pc = RTCPeerConnection()
    try:
        receiver = pc.addTransceiver("audio").receiver  # no remote description: no track
        assert not hear_promptly(receiver)
        assert not isinstance(vars(receiver)["_RTCRtpReceiver__decoder_queue"], LoopDecoder)
    finally:
        await pc.close()


@pytest.mark.parametrize("rate", [None, 16000], ids=["aiortc-48k", "libopus-16k"])
@pytest.mark.parametrize("channels", [1, 2])
async def test_opus_is_decoded_there_and_then_to_mono(channels: int, rate: int | None) -> None:
    frames: asyncio.Queue[av.AudioFrame | None] = asyncio.Queue()
    decoder = LoopDecoder(frames, opus_rate=rate)
    voice = tone(48000, 200, frequency=440)
    for n, packet in enumerate(_opus_frames(voice, channels)):
        decoder.put((OPUS, JitterFrame(packet, n * 960)))
    decoded = [frames.get_nowait() for _ in range(frames.qsize())]  # no await: already there
    heard_rate = rate or 48000
    samples = heard_rate // 50
    assert len(decoded) == 10
    assert all(f is not None and f.layout.name == "mono" and f.samples == samples for f in decoded)
    assert all(f is not None and f.sample_rate == heard_rate for f in decoded)
    assert [f.pts for f in decoded if f is not None] == [n * samples for n in range(10)]
    pcm = b"".join(bytes(f.planes[0])[: samples * 2] for f in decoded[3:] if f is not None)
    assert pcm_rms_dbfs(pcm) == pytest.approx(pcm_rms_dbfs(voice), abs=3)
    assert peak_frequency(pcm, heard_rate) == pytest.approx(440, abs=10)


def test_the_callers_opus_is_decoded_at_48_khz_when_no_libopus_loads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    opus.load_libopus.cache_clear()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(opus, "Path", lambda _: Path("/nonexistent/av/__init__.py"))
    try:
        assert libopus.narrow_opus_decoder(16000) is None
        assert "no libopus to load" in caplog.text
        frames: asyncio.Queue[av.AudioFrame | None] = asyncio.Queue()
        decoder = LoopDecoder(frames, opus_rate=16000)
        decoder.put((OPUS, JitterFrame(_opus_frames(tone(48000, 20), 1)[0], 0)))
        heard = frames.get_nowait()
        assert heard is not None
        assert heard.sample_rate == 48000
    finally:
        opus.load_libopus.cache_clear()


async def test_other_codecs_use_aiortcs_decoders() -> None:
    frames: asyncio.Queue[av.AudioFrame | None] = asyncio.Queue()
    decoder = LoopDecoder(frames)
    frame = av.AudioFrame(format="s16", layout="mono", samples=160)
    frame.planes[0].update(tone(8000, 20, frequency=440))
    frame.sample_rate, frame.pts = 8000, 0
    payloads, _ = PcmuEncoder().encode(frame)
    decoder.put((PCMU_CODEC, JitterFrame(payloads[0], 0)))
    heard = frames.get_nowait()
    assert heard is not None
    assert heard.sample_rate == 8000
    assert pcm_rms_dbfs(bytes(heard.planes[0])[: heard.samples * 2]) > -20


@pytest.mark.parametrize("rate", [None, 16000], ids=["aiortc-48k", "libopus-16k"])
def test_a_frame_that_does_not_decode_is_skipped_and_the_next_one_is_heard(
    caplog: pytest.LogCaptureFixture, rate: int | None
) -> None:
    frames: asyncio.Queue[av.AudioFrame | None] = asyncio.Queue()
    decoder = LoopDecoder(frames, opus_rate=rate)
    good = _opus_frames(tone(48000, 40, frequency=440), 1)
    decoder.put((OPUS, JitterFrame(b"\xff" * 3, 0)))  # a malformed Opus packet
    assert "did not decode" in caplog.text
    assert frames.empty()
    decoder.put((OPUS, JitterFrame(good[0], 960)))
    assert frames.qsize() == 1


def test_an_empty_opus_payload_is_no_audio() -> None:
    frames: asyncio.Queue[av.AudioFrame | None] = asyncio.Queue()
    decoder = LoopDecoder(frames, opus_rate=16000)
    decoder.put((OPUS, JitterFrame(b"", 0)))
    assert frames.empty()


def test_aiortcs_decoder_thread_waits_until_the_receiver_stops() -> None:
    decoder = LoopDecoder(asyncio.Queue())
    ended = threading.Event()

    def decoder_thread() -> None:  # what aiortc's decoder_worker does with its queue
        decoder.get()  # then None: aiortc's worker ends the track
        ended.set()

    thread = threading.Thread(target=decoder_thread)
    thread.start()
    assert not ended.wait(0.1)
    with pytest.raises(queue.Empty):  # queue.Queue's contract for a wait that times out
        decoder.get(timeout=0.01)
    decoder.put(None)
    thread.join(5)
    assert ended.is_set()


def test_a_late_or_lost_caller_packet_costs_its_audio_never_a_delay() -> None:
    buffer = PromptAudioBuffer()
    released = [buffer.add(_opus_packet(n))[1] for n in (65534, 65535, 65537, 65536, 65539)]
    # 65536 came after 65537: dropped; 65538 never came: not waited for
    assert [None if f is None else f.timestamp for f in released] == [
        960 * n % 2**32 if n != 65536 else None for n in (65534, 65535, 65537, 65536, 65539)
    ]
    assert buffer.add(_opus_packet(65539))[1] is None  # a duplicate
    # a jump past the buffer's capacity (a long gap in the stream) plays at once too
    after_gap = buffer.add(_opus_packet(65539 + 100))[1]
    assert after_gap is not None
    assert after_gap.timestamp == 960 * (65539 + 100) % 2**32
