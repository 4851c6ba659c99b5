"""Speech segmentation of 20 ms frames with webrtcvad: ``SpeechStarted`` and ``SpeechEnded``.

Speech starts after ``start_ms`` of consecutive voiced frames and ends after ``end_silence_ms`` of
unvoiced ones (or is cut when its audio reaches ``max_utterance_ms``, or ended early by
:meth:`VadSegmenter.end_now`). After ``pause_ms`` of silence inside an utterance a
``SpeechPaused`` carries the audio so far (a caller may speculatively transcribe it); a voiced
frame after that pause gives ``SpeechResumed``. A ring buffer keeps
``pre_roll_ms`` of audio from before the first voiced frame so the onset reaches Whisper. Frames
quieter than ``min_dbfs`` count as unvoiced, which keeps line noise and faint echo from starting an
utterance.

Voices behind the caller (babble, a television) are speech to webrtcvad. Once the caller has
said something (``caller_dbfs``, the power mean of their voiced frames, from utterances of
at least ``LEVEL_MIN_VOICED_MS``), a frame more than ``background_margin_db`` below it cannot
start an utterance (a sound over the agent then neither pauses nor cuts it off). Inside an
utterance the floor does not hold: the caller's own soft syllables stay voiced, so that their
pauses do not seem longer than they are, nor a barge-in slower to count.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import webrtcvad

from .audio import FRAME_BYTES, FRAME_MS, SAMPLE_RATE, pcm_rms_dbfs

__all__ = [
    "SpeechEnded",
    "SpeechPaused",
    "SpeechResumed",
    "SpeechStarted",
    "VadEvent",
    "VadSegmenter",
    "VadSettings",
]


@dataclass(frozen=True)
class VadSettings:
    aggressiveness: int = 2
    """webrtcvad mode, 0 (least) to 3 (most aggressive at calling audio non-speech)."""
    start_ms: int = 60
    end_silence_ms: int = 400
    pre_roll_ms: int = 300
    max_utterance_ms: int = 20_000
    min_dbfs: float = -50.0
    pause_ms: int = 160
    """Silence inside an utterance that emits ``SpeechPaused`` (0: never)."""
    background_margin_db: float = 6.0
    """Frames this far below the caller's own level count as unvoiced (voices behind the
    caller); 0: off. Babble 10 dB below the caller stays under it but for its peaks."""

    def __post_init__(self) -> None:
        if not 0 <= self.aggressiveness <= 3:
            raise ValueError("VAD aggressiveness must be 0..3")
        if self.pre_roll_ms < 0:
            raise ValueError("pre_roll_ms must not be negative")
        for name in ("start_ms", "end_silence_ms", "max_utterance_ms"):
            if getattr(self, name) < FRAME_MS:
                raise ValueError(f"{name} must be at least {FRAME_MS}")
        if self.pause_ms < 0:
            raise ValueError("pause_ms must not be negative")
        if self.background_margin_db < 0:
            raise ValueError("background_margin_db must not be negative")
        if self.max_utterance_ms <= self.pre_roll_ms + self.start_ms:
            raise ValueError("max_utterance_ms must exceed pre_roll_ms + start_ms")


@dataclass(frozen=True)
class SpeechStarted:
    """Caller speech began. ``at``: monotonic time the first voiced frame arrived."""

    at: float
    detected_at: float


@dataclass(frozen=True)
class SpeechEnded:
    """An utterance ended; ``audio`` is 16 kHz PCM16 from ``pre_roll_ms`` before ``started_at``
    (as far as audio had arrived) through the frame that decided the end.

    ``last_voiced_at``: arrival of the last voiced frame (the caller stopped talking);
    ``detected_at``: when the end was decided (``end_silence_ms`` later, or at a forced cut).
    """

    audio: bytes = field(repr=False)
    started_at: float
    last_voiced_at: float
    detected_at: float
    forced: bool = False

    @property
    def duration_ms(self) -> float:
        return len(self.audio) / 2 / SAMPLE_RATE * 1000


@dataclass(frozen=True)
class SpeechPaused:
    """``pause_ms`` of silence inside an utterance; ``audio`` is the utterance so far (pre-roll
    through the frame that made the pause), ``last_voiced_at`` the caller's last voiced frame."""

    audio: bytes = field(repr=False)
    started_at: float
    last_voiced_at: float
    at: float


@dataclass(frozen=True)
class SpeechResumed:
    """Voice again after a ``SpeechPaused``: the utterance goes on."""

    at: float


VadEvent = SpeechStarted | SpeechPaused | SpeechResumed | SpeechEnded

SUPPRESSED_ONSET_DB = 20.0
"""How far below the floor an echo canceller's output may start while the sound that arrived is
at the caller's level: the canceller's suppressor holds the first 20-60 ms of a caller talking
over the agent 7-20 dB down (WebRTC's AEC3), and an onset judged on its output alone came
40 ms late."""

LEVEL_MIN_VOICED_MS = 600
"""An utterance with less voiced audio (a cough, a word of babble) does not set the caller's
level."""
_LEVEL_WEIGHT = 0.3
"""Weight of a new utterance's level in the caller's running level."""


class VadSegmenter:
    """Feed 20 ms frames of 16 kHz PCM16 in order; get speech events back. Not thread-safe."""

    def __init__(
        self, settings: VadSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or VadSettings()
        self.clock = clock
        self._vad = webrtcvad.Vad(self.settings.aggressiveness)
        self._start_frames = self.settings.start_ms // FRAME_MS
        # the pre-roll plus the voiced run that starts the utterance
        self._pre_roll: deque[bytes] = deque(
            maxlen=self.settings.pre_roll_ms // FRAME_MS + self._start_frames
        )
        self._end_frames = self.settings.end_silence_ms // FRAME_MS
        self._pause_frames = self.settings.pause_ms // FRAME_MS
        self._paused = False
        self._max_frames = self.settings.max_utterance_ms // FRAME_MS
        self._voiced_run = 0
        self._onset_run = 0
        self._run_started_at = 0.0
        self._utterance: list[bytes] | None = None
        self._silent_run = 0
        self._voiced_frames = 0
        self._started_at = 0.0
        self._last_voiced_at = 0.0
        self._voiced_levels: list[float] = []
        self.caller_dbfs: float | None = None
        """The caller's own speech level (the power mean of their voiced frames, in dBFS,
        running over their utterances); None until they have said enough."""

    @property
    def speaking(self) -> bool:
        return self._utterance is not None

    @property
    def voiced_ms(self) -> int:
        """Voiced audio so far in the current utterance (0 when not speaking): how much the
        caller has actually said, unlike the utterance's length, which includes pauses."""
        return self._voiced_frames * FRAME_MS if self._utterance is not None else 0

    @property
    def pause_ms(self) -> int:
        """The silence inside an utterance that emits ``SpeechPaused`` (``settings.pause_ms``
        until set; 0: never). May change between frames, e.g. shorter while decodes are cheap."""
        return self._pause_frames * FRAME_MS

    @pause_ms.setter
    def pause_ms(self, ms: int) -> None:
        if ms < 0:
            raise ValueError("pause_ms must not be negative")
        self._pause_frames = ms // FRAME_MS

    @property
    def onset_ms(self) -> int:
        """Consecutive voiced audio not yet an utterance (shorter than ``start_ms``; 0 while
        speaking or after an unvoiced frame): a sound that may be the start of speech. Where
        :meth:`push` is given the frame as it ``arrived`` before echo cancellation, a frame
        the canceller held down counts if it arrived at the caller's level
        (``SUPPRESSED_ONSET_DB``)."""
        return self._onset_run * FRAME_MS if self._utterance is None else 0

    @property
    def silent_ms(self) -> int:
        """Silence since the last voiced frame of the current utterance (0 when not speaking)."""
        return self._silent_run * FRAME_MS if self._utterance is not None else 0

    @property
    def floor_dbfs(self) -> float:
        """The level below which a frame is unvoiced: ``min_dbfs``, raised to the caller's own
        level less ``background_margin_db`` once that is known."""
        margin = self.settings.background_margin_db
        if self.caller_dbfs is None or not margin:
            return self.settings.min_dbfs
        return max(self.settings.min_dbfs, self.caller_dbfs - margin)

    def is_voiced(self, frame: bytes, *, floored: bool = True) -> bool:
        """Whether ``frame`` is the caller's speech: webrtcvad's word, ``min_dbfs``, and (when
        ``floored``) :attr:`floor_dbfs`."""
        level = pcm_rms_dbfs(frame)
        speech = level >= self.settings.min_dbfs and self._vad.is_speech(frame, SAMPLE_RATE)
        if speech and self._utterance is not None:  # the caller's level, floor or not
            self._voiced_levels.append(level)
        return speech and (not floored or level >= self.floor_dbfs)

    def push(
        self, frame: bytes, at: float | None = None, *, arrived: bytes | None = None
    ) -> list[VadEvent]:
        """Process one frame that arrived at ``at`` (default: now). ``arrived``: the same frame
        before an echo canceller cleaned it (``frame``), where one did; it only moves
        :attr:`onset_ms`."""
        if len(frame) != FRAME_BYTES:
            raise ValueError(f"expected {FRAME_BYTES}-byte frames (20 ms, 16 kHz PCM16)")
        at = self.clock() if at is None else at
        voiced = self.is_voiced(frame, floored=self._utterance is None)
        if self._utterance is None:
            onset = voiced or (arrived is not None and self._suppressed_onset(frame, arrived))
            self._onset_run = self._onset_run + 1 if onset else 0
            return self._idle(frame, voiced, at)
        return self._in_speech(frame, voiced, at)

    def _suppressed_onset(self, frame: bytes, arrived: bytes) -> bool:
        """Whether ``frame``, unvoiced after cancellation, is the caller's speech held down by
        the canceller: it arrived above the floor, and what is left of it is speech no more
        than ``SUPPRESSED_ONSET_DB`` under the floor (the echo alone, cancelled, leaves next to
        nothing)."""
        floor = self.floor_dbfs
        if pcm_rms_dbfs(arrived) < floor:
            return False
        # webrtcvad is asked about the frame a second time here (is_voiced asked first), and
        # its state steps on every call: passing is_voiced's answer in made barge-ins over a
        # cancelled echo a frame slower (p50 162 -> 181 ms in the echo corpus, back to back)
        level = pcm_rms_dbfs(frame)
        return level >= max(self.settings.min_dbfs, floor - SUPPRESSED_ONSET_DB) and bool(
            self._vad.is_speech(frame, SAMPLE_RATE)
        )

    def utterance_audio(self) -> bytes:
        """The current utterance's audio so far, pre-roll included (empty when not speaking)."""
        return b"".join(self._utterance) if self._utterance is not None else b""

    def _learn_level(self) -> None:
        """Fold the utterance's voiced level into the caller's, if it was long enough."""
        levels = self._voiced_levels
        if len(levels) * FRAME_MS >= LEVEL_MIN_VOICED_MS:
            level = 10 * math.log10(statistics.fmean(10 ** (x / 10) for x in levels))
            known = self.caller_dbfs
            self.caller_dbfs = level if known is None else known + _LEVEL_WEIGHT * (level - known)
        self._voiced_levels = []

    def reset(self) -> None:
        """Forget any utterance in progress."""
        self._pre_roll.clear()
        self._utterance = None
        self._voiced_run = 0
        self._onset_run = 0
        self._silent_run = 0
        self._paused = False

    def end_now(self, at: float | None = None) -> SpeechEnded | None:
        """End the current utterance here (its trailing silence included); None if there is
        none."""
        if self._utterance is None:
            return None
        return self._end(self.clock() if at is None else at, forced=False)

    def _idle(self, frame: bytes, voiced: bool, at: float) -> list[VadEvent]:
        self._pre_roll.append(frame)
        if not voiced:
            self._voiced_run = 0
            return []
        if self._voiced_run == 0:
            self._run_started_at = at
        self._voiced_run += 1
        if self._voiced_run < self._start_frames:
            return []
        self._utterance = list(self._pre_roll)
        self._pre_roll.clear()
        self._voiced_levels = [pcm_rms_dbfs(f) for f in self._utterance[-self._voiced_run :]]
        self._silent_run = 0
        self._paused = False
        self._voiced_frames = self._voiced_run
        self._started_at = self._run_started_at
        self._last_voiced_at = at
        return [SpeechStarted(at=self._started_at, detected_at=at)]

    def _in_speech(self, frame: bytes, voiced: bool, at: float) -> list[VadEvent]:
        assert self._utterance is not None
        self._utterance.append(frame)
        events: list[VadEvent] = []
        if voiced:
            self._silent_run = 0
            self._voiced_frames += 1
            self._last_voiced_at = at
            if self._paused:
                self._paused = False
                events.append(SpeechResumed(at))
        else:
            self._silent_run += 1
        forced = len(self._utterance) >= self._max_frames
        if self._silent_run < self._end_frames and not forced:
            if self._pause_frames and self._silent_run >= self._pause_frames and not self._paused:
                self._paused = True
                events.append(
                    SpeechPaused(
                        audio=b"".join(self._utterance),
                        started_at=self._started_at,
                        last_voiced_at=self._last_voiced_at,
                        at=at,
                    )
                )
            return events
        return [*events, self._end(at, forced=forced and self._silent_run < self._end_frames)]

    def _end(self, at: float, forced: bool) -> SpeechEnded:
        assert self._utterance is not None
        self._learn_level()
        ended = SpeechEnded(
            audio=b"".join(self._utterance),
            started_at=self._started_at,
            last_voiced_at=self._last_voiced_at,
            detected_at=at,
            forced=forced,
        )
        self._utterance = None
        self._voiced_run = 0
        self._onset_run = 0
        self._silent_run = 0
        self._paused = False
        return ended
