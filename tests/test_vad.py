"""VAD segmentation with real webrtcvad on real (Piper) speech: start and end, pre-roll, timestamps,
configurable end silence, forced ends, pauses and early ends, noise rejection, frame and settings
validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from media import (
    FRAME_BYTES,
    FRAME_MS,
    SpeechEnded,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    VadEvent,
    VadSegmenter,
)
from media import VadSettings as Settings
from media.audio import pcm_rms_dbfs, silence
from server.testkit.impairments import at_level, noise, speech_level_dbfs
from tests.support.speech import piper_speech, tone, white_noise

PHRASE = "I would like to book a table for two people tonight."
T0 = 1000.0  # the arrival time of frame 0
FRAME_S = FRAME_MS / 1000


@pytest.fixture(scope="module")
def speech() -> bytes:
    """The phrase spoken by Piper, 16 kHz, whole frames."""
    return piper_speech(PHRASE)


def frames_of(pcm: bytes) -> list[bytes]:
    assert len(pcm) % FRAME_BYTES == 0
    return [pcm[i : i + FRAME_BYTES] for i in range(0, len(pcm), FRAME_BYTES)]


def run(segmenter: VadSegmenter, pcm: bytes, pauses: bool = False) -> list[VadEvent]:
    """Push every frame of ``pcm``; frame k arrives at T0 + k * 20 ms. Pause and resume events
    are left out unless ``pauses``."""
    events: list[VadEvent] = []
    for k, frame in enumerate(frames_of(pcm)):
        events += segmenter.push(frame, at=T0 + k * FRAME_S)
    if pauses:
        return events
    return [e for e in events if isinstance(e, SpeechStarted | SpeechEnded)]


def index_at(at: float) -> int:
    """The frame that arrived at ``at``."""
    k = round((at - T0) / FRAME_S)
    assert at == pytest.approx(T0 + k * FRAME_S)
    return k


def one_utterance(events: list[VadEvent]) -> tuple[SpeechStarted, SpeechEnded]:
    assert [type(event) for event in events] == [SpeechStarted, SpeechEnded]
    started, ended = events
    assert isinstance(started, SpeechStarted)
    assert isinstance(ended, SpeechEnded)
    return started, ended


def expected_audio(stream: bytes, started_at: float, detected_at: float, pre_roll_ms: int) -> bytes:
    """The stream from ``pre_roll_ms`` before the first voiced frame (or from the beginning)
    through the frame that decided the end."""
    first = max(0, index_at(started_at) - pre_roll_ms // FRAME_MS)
    return stream[first * FRAME_BYTES : (index_at(detected_at) + 1) * FRAME_BYTES]


def longest_inner_pause_ms(pcm: bytes, settings: Settings) -> int:
    """The longest unvoiced run between voiced frames, as the segmenter classifies frames."""
    classifier = VadSegmenter(settings)
    voiced = [classifier.is_voiced(frame) for frame in frames_of(pcm)]
    first, last = voiced.index(True), len(voiced) - voiced[::-1].index(True)
    runs = [len(list(group)) for flag, group in itertools.groupby(voiced[first:last]) if not flag]
    return max(runs, default=0) * FRAME_MS


@pytest.mark.slow
def test_speech_starts_then_ends_with_the_pre_roll_and_consistent_timestamps(
    speech: bytes,
) -> None:
    stream = silence(1000) + speech + silence(1500)
    settings = Settings()
    started, ended = one_utterance(run(VadSegmenter(settings), stream))

    speech_start, speech_end = T0 + 1.0, T0 + 1.0 + len(speech) / 32_000
    # the first voiced frame is at the phrase's onset (Piper leaves a few ms of lead-in)
    assert speech_start <= started.at <= speech_start + 0.2
    # three consecutive voiced frames (start_ms = 60) make the start
    assert started.detected_at - started.at == pytest.approx(2 * FRAME_S)

    assert ended.started_at == started.at
    assert started.at < ended.last_voiced_at < ended.detected_at
    assert speech_end - 0.5 <= ended.last_voiced_at <= speech_end
    assert ended.detected_at - ended.last_voiced_at == pytest.approx(settings.end_silence_ms / 1000)
    assert not ended.forced

    # the audio is exactly the stream from pre_roll_ms before the first voiced frame through the
    # frame that decided the end: speech + pre-roll + end silence
    assert ended.audio == expected_audio(
        stream, started.at, ended.detected_at, settings.pre_roll_ms
    )
    spoken_ms = (ended.last_voiced_at - ended.started_at) * 1000 + FRAME_MS
    assert ended.duration_ms == pytest.approx(
        spoken_ms + settings.pre_roll_ms + settings.end_silence_ms
    )


@pytest.mark.slow
@pytest.mark.parametrize("pre_roll_ms", [0, 100, 300, 600])
def test_the_pre_roll_is_the_audio_before_the_first_voiced_frame(
    speech: bytes, pre_roll_ms: int
) -> None:
    stream = silence(1000) + speech + silence(1000)
    started, ended = one_utterance(run(VadSegmenter(Settings(pre_roll_ms=pre_roll_ms)), stream))
    assert ended.audio == expected_audio(stream, started.at, ended.detected_at, pre_roll_ms)
    spoken_ms = (ended.detected_at - started.at) * 1000 + FRAME_MS
    assert ended.duration_ms == pytest.approx(spoken_ms + pre_roll_ms)


@pytest.mark.slow
def test_the_pre_roll_holds_only_what_has_arrived(speech: bytes) -> None:
    stream = silence(100) + speech + silence(1000)
    started, ended = one_utterance(run(VadSegmenter(Settings(pre_roll_ms=1000)), stream))
    assert index_at(started.at) < 1000 // FRAME_MS
    assert ended.audio == expected_audio(stream, started.at, ended.detected_at, 1000)
    assert ended.audio == stream[: len(ended.audio)]


@pytest.mark.slow
@pytest.mark.parametrize("end_silence_ms", [200, 400, 1000])
def test_the_end_comes_after_end_silence_ms_of_silence(speech: bytes, end_silence_ms: int) -> None:
    settings = Settings(end_silence_ms=end_silence_ms)
    # precondition on the fixture: the phrase itself has no pause that long
    assert longest_inner_pause_ms(speech, settings) < end_silence_ms
    stream = silence(500) + speech + silence(1500)
    started, ended = one_utterance(run(VadSegmenter(settings), stream))
    assert ended.detected_at - ended.last_voiced_at == pytest.approx(end_silence_ms / 1000)
    assert ended.audio == expected_audio(
        stream, started.at, ended.detected_at, settings.pre_roll_ms
    )


@pytest.mark.slow
def test_voices_well_below_the_caller_do_not_start_an_utterance(speech: bytes) -> None:
    """Babble 10 dB under the caller: speech to webrtcvad, background once the caller's own
    level is known; the caller's own speech still starts one."""
    babble = at_level(noise("babble", 4000), speech_level_dbfs(speech) - 10)
    vad = VadSegmenter(Settings())
    assert run(vad, babble) != []  # before the caller spoke: nothing to compare with
    vad = VadSegmenter(Settings())
    first = run(vad, silence(300) + speech + silence(600))
    assert [type(event) for event in first] == [SpeechStarted, SpeechEnded]
    assert vad.caller_dbfs is not None
    assert run(vad, babble + silence(600)) == []
    assert [type(e) for e in run(vad, speech + silence(600))] == [SpeechStarted, SpeechEnded]


@pytest.mark.slow
def test_a_pause_of_end_silence_ms_splits_the_utterance_and_a_shorter_one_does_not(
    speech: bytes,
) -> None:
    stream = silence(500) + speech + silence(400) + speech + silence(1500)
    pause_ms = longest_inner_pause_ms(stream, Settings())
    assert pause_ms >= 400

    # (no level floor: the second utterance's quiet first frame would start it 20 ms later)
    split = run(VadSegmenter(Settings(end_silence_ms=pause_ms, background_margin_db=0)), stream)
    assert [type(event) for event in split] == [SpeechStarted, SpeechEnded] * 2
    first_end, second = split[1], split[2]
    assert isinstance(first_end, SpeechEnded)
    assert isinstance(second, SpeechStarted)
    assert second.at - first_end.last_voiced_at == pytest.approx((pause_ms + FRAME_MS) / 1000)

    _, ended = one_utterance(
        run(VadSegmenter(Settings(end_silence_ms=pause_ms + FRAME_MS)), stream)
    )
    assert ended.duration_ms > 2 * len(speech) / 32 + 400


@pytest.mark.slow
def test_a_long_utterance_is_cut_at_max_utterance_ms(speech: bytes) -> None:
    settings = Settings(max_utterance_ms=1000)
    stream = silence(1000) + speech + silence(1000)
    events = run(VadSegmenter(settings), stream)
    kinds = [type(event) for event in events]
    assert kinds[:2] == [SpeechStarted, SpeechEnded]
    started, first = events[:2]
    assert isinstance(started, SpeechStarted)
    assert isinstance(first, SpeechEnded)
    assert first.forced
    assert first.duration_ms == settings.max_utterance_ms
    start = index_at(started.at) - settings.pre_roll_ms // FRAME_MS
    assert first.audio == stream[start * FRAME_BYTES : (start + 50) * FRAME_BYTES]
    assert first.detected_at == pytest.approx(T0 + (start + 49) * FRAME_S)

    # the speech goes on: new utterances follow the cut, none longer than the maximum, none
    # repeating audio of another, and the last one reaches the end of the phrase
    assert len(kinds) >= 4
    assert kinds == [SpeechStarted, SpeechEnded] * (len(kinds) // 2)
    utterances = [event for event in events if isinstance(event, SpeechEnded)]
    assert all(utterance.duration_ms <= 1000 for utterance in utterances)
    position = 0
    for utterance in utterances:
        begins = stream.index(utterance.audio)
        assert begins >= position
        position = begins + len(utterance.audio)
    speech_end = T0 + 1.0 + len(speech) / 32_000
    assert speech_end - 0.5 <= utterances[-1].last_voiced_at <= speech_end


@pytest.mark.slow
@pytest.mark.parametrize("aggressiveness", [0, 1, 2, 3])
def test_every_aggressiveness_finds_the_phrase(speech: bytes, aggressiveness: int) -> None:
    stream = silence(500) + speech + silence(1000)
    started, _ = one_utterance(run(VadSegmenter(Settings(aggressiveness)), stream))
    assert T0 + 0.5 <= started.at <= T0 + 0.7


def quiet(pcm: bytes, peak_frame_dbfs: float) -> bytes:
    """``pcm`` scaled so that its loudest 20 ms frame has an RMS of ``peak_frame_dbfs``."""
    loudest = max(pcm_rms_dbfs(frame) for frame in frames_of(pcm))
    gain = 10 ** ((peak_frame_dbfs - loudest) / 20)
    scaled = np.frombuffer(pcm, dtype=np.int16).astype(np.float64) * gain
    return np.round(scaled).astype(np.int16).tobytes()


@pytest.mark.slow
def test_silence_and_low_level_noise_never_start_speech(speech: bytes) -> None:
    segmenter = VadSegmenter()
    assert run(segmenter, silence(3000)) == []
    assert run(segmenter, white_noise(3000, -60)) == []
    assert run(segmenter, tone(16_000, 3000, frequency=150, amplitude=10 ** (-57 / 20))) == []
    # even real speech does not count when it is as faint as line noise or far echo
    faint = quiet(speech, -55)
    assert run(segmenter, silence(300) + faint + silence(600)) == []
    assert not segmenter.speaking
    # ... while the same speech at a normal level does
    assert len(run(segmenter, silence(300) + quiet(speech, -20) + silence(600))) == 2


@pytest.mark.slow
def test_reset_forgets_an_utterance_in_progress(speech: bytes) -> None:
    segmenter = VadSegmenter()
    events = run(segmenter, silence(300) + speech[: len(speech) // 2 // FRAME_BYTES * FRAME_BYTES])
    assert [type(event) for event in events] == [SpeechStarted]
    assert segmenter.speaking
    segmenter.reset()
    assert not segmenter.speaking
    assert run(segmenter, silence(2000)) == []


@pytest.mark.slow
def test_frames_are_stamped_with_the_segmenters_clock(speech: bytes) -> None:
    ticks = itertools.count()
    segmenter = VadSegmenter(clock=lambda: next(ticks) * FRAME_S)
    events: list[VadEvent] = []
    for frame in frames_of(silence(400) + speech + silence(600)):
        events += segmenter.push(frame)
    started, ended = one_utterance(
        [e for e in events if isinstance(e, SpeechStarted | SpeechEnded)]
    )
    assert 0.4 <= started.at < started.detected_at < ended.last_voiced_at < ended.detected_at
    assert ended.detected_at - ended.last_voiced_at == pytest.approx(0.4)


@pytest.mark.parametrize("size", [0, 320, 480, 639, 641, 960, 1280])
def test_frames_of_the_wrong_size_are_rejected(size: int) -> None:
    segmenter = VadSegmenter()
    with pytest.raises(ValueError, match="640-byte frames"):
        segmenter.push(bytes(size), at=0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aggressiveness": -1}, "aggressiveness"),
        ({"aggressiveness": 4}, "aggressiveness"),
        ({"start_ms": 0}, "start_ms"),
        ({"start_ms": 10}, "start_ms"),
        ({"end_silence_ms": 10}, "end_silence_ms"),
        ({"max_utterance_ms": 0}, "max_utterance_ms"),
        ({"pre_roll_ms": -20}, "pre_roll_ms"),
        ({"max_utterance_ms": 360}, "max_utterance_ms"),  # not even pre-roll + start fit
    ],
)
def test_invalid_settings_are_rejected(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(**kwargs)


def test_extreme_valid_settings_are_accepted() -> None:
    Settings(aggressiveness=0, start_ms=20, end_silence_ms=20, pre_roll_ms=0, max_utterance_ms=60)
    Settings(aggressiveness=3, max_utterance_ms=381)


def test_a_pause_carries_the_audio_so_far_and_voice_resumes_it(speech: bytes) -> None:
    segmenter = VadSegmenter(Settings(pause_ms=160, end_silence_ms=600))
    stream = silence(400) + speech + silence(300) + speech + silence(800)
    events = run(segmenter, stream, pauses=True)
    kinds = [type(e) for e in events]
    assert kinds[0] is SpeechStarted
    assert kinds[-1] is SpeechEnded
    paused = [e for e in events if isinstance(e, SpeechPaused)]
    resumed = [e for e in events if isinstance(e, SpeechResumed)]
    assert len(resumed) == len(paused) - 1  # every pause but the last was resumed
    assert kinds.index(SpeechResumed) > kinds.index(SpeechPaused)
    first, last = paused[0], paused[-1]
    ended = events[-1]
    assert isinstance(ended, SpeechEnded)
    # the last pause's audio is the ended utterance without its final silence
    assert ended.audio.startswith(last.audio)
    assert len(ended.audio) - len(last.audio) == (600 - 160) * 32
    assert last.last_voiced_at == ended.last_voiced_at
    assert index_at(last.at) - index_at(last.last_voiced_at) == 160 // FRAME_MS
    assert len(first.audio) < len(last.audio)


def test_end_now_closes_the_utterance_at_once(speech: bytes) -> None:
    segmenter = VadSegmenter(Settings(pause_ms=0, end_silence_ms=2000))
    assert segmenter.end_now(T0) is None
    events = run(segmenter, silence(400) + speech + silence(300), pauses=True)
    assert [type(e) for e in events] == [SpeechStarted]
    assert segmenter.silent_ms >= 200
    ended = segmenter.end_now(T0 + 99)
    assert ended is not None
    assert ended.detected_at == T0 + 99
    assert not ended.forced
    assert not segmenter.speaking
    assert segmenter.silent_ms == 0


@pytest.mark.parametrize("pause_ms", [120, 160])
def test_the_pause_may_change_between_frames_and_is_emitted_once(
    speech: bytes, pause_ms: int
) -> None:
    segmenter = VadSegmenter(Settings(pause_ms=160))
    segmenter.pause_ms = pause_ms
    events = run(segmenter, speech + silence(300), pauses=True)
    paused = [e for e in events if isinstance(e, SpeechPaused)]
    assert paused  # the silence after the phrase, at least
    ended = events[-1]
    assert isinstance(ended, SpeechEnded)
    last = paused[-1]
    assert last.last_voiced_at == ended.last_voiced_at
    assert index_at(last.at) - index_at(last.last_voiced_at) == pause_ms // FRAME_MS
    # lowered below the silence already heard: emitted at once, and only once
    segmenter = VadSegmenter(Settings(pause_ms=0))
    events = run(segmenter, speech + silence(140), pauses=True)
    segmenter.pause_ms = 120
    late = segmenter.push(silence(FRAME_MS), at=T0 + len(speech + silence(140)) / 32000)
    again = segmenter.push(silence(FRAME_MS), at=T0 + len(speech + silence(160)) / 32000)
    assert [type(e) for e in late] == [SpeechPaused]
    assert again == []


def scaled(pcm: bytes, db: float) -> bytes:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64) * 10 ** (db / 20)
    return samples.astype("<i2").tobytes()


@pytest.mark.parametrize(
    ("held_down_db", "onset"),
    [(15.0, True), (45.0, False)],  # the canceller's first frames; the echo alone, cancelled
)
def test_a_caller_held_down_by_the_echo_canceller_still_makes_an_onset(
    speech: bytes, held_down_db: float, onset: bool
) -> None:
    """Frames that arrived at the caller's level and left the canceller as speech at most 20 dB
    under the floor count toward the onset (not toward an utterance); near-silence after it
    does not, and without the arrived frame the floor alone decides."""
    vad = VadSegmenter(Settings())
    run(vad, silence(300) + speech + silence(600))
    assert vad.caller_dbfs is not None
    loud = [f for f in frames_of(speech) if pcm_rms_dbfs(f) >= vad.caller_dbfs][:2]
    assert len(loud) == 2
    for frame in loud:
        assert vad.push(scaled(frame, -held_down_db), arrived=frame) == []
    assert (vad.onset_ms == 40) is onset
    blind = VadSegmenter(Settings())
    run(blind, silence(300) + speech + silence(600))
    for frame in loud:
        blind.push(scaled(frame, -held_down_db))
    assert blind.onset_ms == 0
