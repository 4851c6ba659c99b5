"""The speaker queue: handles that resolve when their audio has left, exact frames, silence when
idle, resampling on push, clear() with played amounts, start callbacks and clear hooks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from media import Playback, PlaybackResult, Speaker
from media.audio import frame_bytes, pcm_rms_dbfs
from tests.support.speech import peak_frequency, tone

FRAME = 640  # 20 ms at 16 kHz


def ramp(frames: float, start: int = 1, frame: int = FRAME) -> bytes:
    """Distinct non-zero PCM16 samples, ``frames`` frames long."""
    count = int(frames * frame) // 2
    return np.arange(start, start + count, dtype=np.int16).tobytes()


def is_silence(pcm: bytes) -> bool:
    return pcm == bytes(len(pcm))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_handle_resolves_when_its_last_frame_has_been_pulled() -> None:
    speaker = Speaker(16_000)
    pcm = ramp(5)
    playback = speaker.push(pcm, 16_000)
    waiter = asyncio.create_task(playback.finished())
    pulled = []
    for _ in range(4):
        pulled.append(speaker.pull())
        await asyncio.sleep(0)
        assert not playback.done
        assert not waiter.done()
    assert playback.played_ms == pytest.approx(80)
    pulled.append(speaker.pull())
    assert playback.done
    assert await waiter == PlaybackResult(completed=True, played_ms=100.0, total_ms=100.0)
    assert b"".join(pulled) == pcm
    assert not speaker.busy
    assert speaker.frames_out == 5


async def test_cancelling_a_waiter_does_not_cancel_the_playback() -> None:
    speaker = Speaker(16_000)
    playback = speaker.push(ramp(2), 16_000)
    waiter = asyncio.create_task(playback.finished())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    speaker.pull()
    speaker.pull()
    assert (await playback.finished()).completed


@pytest.mark.parametrize(("rate", "frame_ms"), [(16_000, 20), (48_000, 20), (8_000, 10)])
async def test_pull_always_returns_exact_frames_and_silence_when_idle(
    rate: int, frame_ms: int
) -> None:
    speaker = Speaker(rate, frame_ms=frame_ms)
    size = frame_bytes(rate, frame_ms)
    assert speaker.frame_bytes == size
    assert speaker.pull() == bytes(size)
    pushed = [ramp(1, frame=size)[:1234], ramp(3, frame=size)[:2], ramp(2.5, frame=size)]
    for pcm in pushed:
        speaker.push(pcm, rate)
    total = sum(len(pcm) for pcm in pushed)
    frames = [speaker.pull() for _ in range(total // size + 3)]
    assert all(len(frame) == size for frame in frames)
    # the queued audio back to back, then zero padding, then silence
    assert b"".join(frames)[:total] == b"".join(pushed)
    assert is_silence(b"".join(frames)[total:])
    assert speaker.frames_out == -(-total // size)  # idle pulls are not counted


async def test_the_tail_is_padded_with_silence() -> None:
    speaker = Speaker(16_000)
    pcm = ramp(1.5)
    playback = speaker.push(pcm, 16_000)
    first, second = speaker.pull(), speaker.pull()
    assert first == pcm[:FRAME]
    assert second == pcm[FRAME:] + bytes(FRAME // 2)
    assert playback.done
    assert (await playback.finished()).total_ms == pytest.approx(30)


async def test_consecutive_pushes_play_back_to_back() -> None:
    clock = Clock()
    speaker = Speaker(16_000, clock=clock)
    a, b = ramp(1.5, start=1), ramp(1, start=5000)
    first, second = speaker.push(a, 16_000), speaker.push(b, 16_000)
    assert speaker.pull() == a[:FRAME]
    clock.now = 100.02
    assert speaker.pull() == a[FRAME:] + b[: FRAME // 2]
    assert first.done
    assert not second.done
    assert second.started_at == 100.02
    clock.now = 100.04
    assert speaker.pull() == b[FRAME // 2 :] + bytes(FRAME // 2)
    assert second.done
    assert is_silence(speaker.pull())


async def test_audio_at_another_rate_is_resampled_on_push() -> None:
    speaker = Speaker(16_000)
    pcm = tone(22_050, 1000, frequency=440)
    piece = 22_050 * 200 // 1000 * 2  # 200 ms pieces, as the synthesizer hands them out
    playbacks = [speaker.push(pcm[i : i + piece], 22_050) for i in range(0, len(pcm), piece)]
    total_ms = sum(playback.total_ms for playback in playbacks)
    assert abs(total_ms - 1000) <= 20  # duration preserved within one frame
    frames = []
    while speaker.busy:
        frames.append(speaker.pull())
    assert abs(len(frames) - 50) <= 1
    assert peak_frequency(b"".join(frames), 16_000) == pytest.approx(440, abs=2)
    assert pcm_rms_dbfs(b"".join(frames)[3200:-3200]) == pytest.approx(pcm_rms_dbfs(pcm), abs=0.3)
    assert all(playback.done for playback in playbacks)


async def test_clear_drops_everything_and_reports_what_was_played() -> None:
    speaker = Speaker(16_000)
    hooks: list[str] = []
    speaker.on_clear.append(lambda: hooks.append("first"))
    speaker.on_clear.append(lambda: hooks.append("second"))
    done, cut, waiting = (speaker.push(ramp(5, start=k * 4000 + 1), 16_000) for k in range(3))
    for _ in range(7):
        speaker.pull()
    assert done.done
    assert speaker.busy

    results = speaker.clear()

    assert results == [
        PlaybackResult(completed=False, played_ms=40.0, total_ms=100.0),
        PlaybackResult(completed=False, played_ms=0.0, total_ms=100.0),
    ]
    assert await done.finished() == PlaybackResult(True, 100.0, 100.0)
    assert await cut.finished() == results[0]
    assert await waiting.finished() == results[1]
    assert await waiting.started() is None
    assert waiting.started_at is None
    assert hooks == ["first", "second"]
    assert not speaker.busy
    assert is_silence(speaker.pull())  # not a single sample of the dropped audio
    assert speaker.frames_out == 7


async def test_flush_hooks_run_only_when_audio_went_out_since_the_last_flush() -> None:
    """A phone gateway gets a ``clear`` only when it may hold our audio: pausing for an answer
    that has not started, or clearing twice, says nothing downstream."""
    speaker = Speaker(16_000)
    hooks: list[str] = []
    speaker.on_clear.append(lambda: hooks.append("flush"))
    speaker.pause()  # nothing ever sent
    speaker.push(ramp(5), 16_000)
    speaker.resume()
    speaker.clear()
    assert hooks == []
    speaker.push(ramp(5), 16_000)
    speaker.pull()
    speaker.pause()
    assert hooks == ["flush"]
    speaker.clear()  # nothing went out while paused
    assert hooks == ["flush"]
    speaker.push(ramp(5), 16_000)
    speaker.pull()
    speaker.clear()
    assert hooks == ["flush", "flush"]
    speaker.push(ramp(5), 16_000)
    speaker.pull()
    speaker.hold()  # an answer prepared ahead: the last turn's audio is not ours to drop
    speaker.push(ramp(5), 16_000)
    speaker.clear()  # the prepared answer is abandoned before it played
    assert hooks == ["flush", "flush"]
    assert not speaker.paused


async def test_clear_also_drops_the_resamplers_tail() -> None:
    speaker = Speaker(16_000)
    speaker.push(tone(22_050, 300, amplitude=0.9), 22_050)
    speaker.pull()
    speaker.clear()
    # the resampler held back a few ms of the loud tone; none of it may follow the clear
    speaker.push(bytes(22_050 * 2 // 5), 22_050)
    frames = []
    while speaker.busy:
        frames.append(speaker.pull())
    assert frames
    assert all(is_silence(frame) for frame in frames)


async def test_clear_when_idle_returns_nothing() -> None:
    speaker = Speaker(16_000)
    assert speaker.clear() == []
    assert is_silence(speaker.pull())


async def test_start_callbacks_and_started_at() -> None:
    clock = Clock()
    speaker = Speaker(16_000, clock=clock)
    seen: list[tuple[str, float | None]] = []
    done: list[PlaybackResult] = []
    first, second = speaker.push(ramp(1), 16_000), speaker.push(ramp(1), 16_000)
    never = speaker.push(ramp(1), 16_000)

    def record(name: str) -> Callable[[float | None], None]:
        return lambda at: seen.append((name, at))

    for name, playback in (("first", first), ("second", second), ("never", never)):
        playback.add_start_callback(record(name))
    second.add_done_callback(done.append)
    assert first.started_at is None

    clock.now = 101.0
    speaker.pull()
    await asyncio.sleep(0)
    assert first.started_at == 101.0
    assert await first.started() == 101.0
    assert seen == [("first", 101.0)]

    clock.now = 101.02
    speaker.pull()
    await asyncio.sleep(0)
    assert second.started_at == 101.02
    assert seen == [("first", 101.0), ("second", 101.02)]
    assert done == [PlaybackResult(True, 20.0, 20.0)]

    speaker.clear()
    await asyncio.sleep(0)
    assert seen[-1] == ("never", None)
    assert await never.started() is None


async def test_empty_audio_resolves_at_once_without_queueing() -> None:
    speaker = Speaker(16_000)
    playback = speaker.push(b"", 16_000)
    assert isinstance(playback, Playback)
    assert playback.done
    assert await playback.finished() == PlaybackResult(True, 0.0, 0.0)
    assert not speaker.busy
    assert is_silence(speaker.pull())
    assert speaker.frames_out == 0


async def test_a_hold_and_a_pause_are_kept_apart() -> None:
    """An answer prepared ahead is held; an answer the caller talked over is paused. Each is
    lifted by its own call, and audio plays only when neither stands."""
    speaker = Speaker(16_000)
    hooks: list[str] = []
    speaker.on_clear.append(lambda: hooks.append("flush"))
    speaker.push(ramp(1), 16_000)
    assert not is_silence(speaker.pull())  # an earlier answer's audio went out
    speaker.hold()
    assert speaker.held
    assert not speaker.paused
    speaker.push(ramp(3), 16_000)
    assert is_silence(speaker.pull())
    speaker.resume()  # no pause to lift: the hold stays
    assert is_silence(speaker.pull())
    speaker.release()
    assert not is_silence(speaker.pull())
    speaker.pause()
    assert speaker.paused
    assert not speaker.held
    assert hooks == ["flush"]  # a pause drops what went downstream; the hold did not
    speaker.release()  # no hold to lift: the pause stays
    assert is_silence(speaker.pull())
    speaker.resume()
    assert not is_silence(speaker.pull())


@pytest.mark.parametrize("silenced", ["hold", "pause"])
async def test_drop_keeps_a_hold_or_pause_and_clear_lifts_it(silenced: str) -> None:
    speaker = Speaker(16_000)
    getattr(speaker, silenced)()
    first = speaker.push(ramp(3), 16_000)
    (result,) = speaker.drop()  # text retracted mid-answer: its audio goes, the answer stays
    assert result == PlaybackResult(False, 0.0, 60.0)
    assert (await first.finished()).completed is False
    assert speaker.held is (silenced == "hold")
    assert speaker.paused is (silenced == "pause")
    speaker.push(ramp(2), 16_000)
    assert is_silence(speaker.pull())  # what it says next waits as well
    speaker.clear()
    assert not speaker.held
    assert not speaker.paused
    speaker.push(ramp(1), 16_000)
    assert not is_silence(speaker.pull())
