"""The beep at the end of a voicemail greeting, found by signal processing (no model).

A voicemail beep is one steady tone: a single frequency between 400 and 3000 Hz (1 kHz is the
common one; 440, 850 and 1400 Hz occur) for 0.1 to 2 s. Each 20 ms frame is windowed and
transformed (1024 points: 15.6 Hz bins); the frame is *tonal* when its level is above
``min_dbfs`` and the strongest bin in that range, with its neighbours, holds at least
``purity`` of the frame's energy between 100 and 4000 Hz. A beep is a run of tonal frames at
one frequency (within ``drift_hz``) lasting ``min_ms`` to ``max_ms``, reported when it ends.

What must not pass for one: two tones at once (DTMF digits, the US ringback of 440 + 480 Hz:
each holds half the energy), speech and a held vowel (energy in many harmonics), music (chords
and harmonics), and a continuous tone (a dial tone: longer than ``max_ms``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .audio import FRAME_MS, SAMPLE_RATE

__all__ = ["Beep", "BeepDetector", "BeepSettings"]

_FFT = 1024
_HZ_PER_BIN = SAMPLE_RATE / _FFT


@dataclass(frozen=True)
class BeepSettings:
    low_hz: float = 400.0
    high_hz: float = 3000.0
    purity: float = 0.8
    """The share of a frame's energy (100-4000 Hz) its strongest tone must hold."""
    min_dbfs: float = -45.0
    min_ms: int = 100
    max_ms: int = 2000
    drift_hz: float = 30.0


@dataclass(frozen=True)
class Beep:
    """A beep heard: its frequency, how long it lasted, and when its last frame arrived."""

    frequency_hz: float
    duration_ms: int
    ended_at: float


class BeepDetector:
    """Feed 20 ms frames of 16 kHz PCM16; :meth:`push` returns a :class:`Beep` on the frame
    after one ends."""

    def __init__(self, settings: BeepSettings | None = None) -> None:
        self.settings = settings = settings or BeepSettings()
        frame = SAMPLE_RATE * FRAME_MS // 1000
        self._window = np.hanning(frame)
        freqs = np.fft.rfftfreq(_FFT, 1 / SAMPLE_RATE)
        self._band = (freqs >= 100) & (freqs <= 4000)
        self._tone_bins = np.flatnonzero((freqs >= settings.low_hz) & (freqs <= settings.high_hz))
        self._floor = (10 ** (settings.min_dbfs / 20) * 32768) ** 2
        self._run_hz: float | None = None
        self._run_frames = 0
        self._last_at = 0.0

    def tone_of(self, frame: bytes) -> float | None:
        """The frequency of the steady tone ``frame`` is, or None when it is not tonal."""
        samples = np.frombuffer(frame, dtype="<i2").astype(np.float64)
        if samples.size == 0 or float(np.mean(samples**2)) < self._floor:
            return None
        spectrum = np.abs(np.fft.rfft(samples * self._window[: samples.size], _FFT)) ** 2
        total = float(spectrum[self._band].sum())
        peak = int(self._tone_bins[np.argmax(spectrum[self._tone_bins])])
        near = float(spectrum[peak - 3 : peak + 4].sum())
        if total <= 0 or near / total < self.settings.purity:
            return None
        left, centre, right = spectrum[peak - 1], spectrum[peak], spectrum[peak + 1]
        shift = 0.5 * (left - right) / (left - 2 * centre + right) if centre > 0 else 0.0
        return float((peak + shift) * _HZ_PER_BIN)

    def push(self, frame: bytes, at: float) -> Beep | None:
        """Judge one frame that arrived at ``at``; the beep that ended before it, if any."""
        hz = self.tone_of(frame)
        s = self.settings
        if hz is not None and self._run_hz is not None and abs(hz - self._run_hz) <= s.drift_hz:
            self._run_frames += 1
            self._last_at = at
            return None
        ended = self._ended()
        self._run_hz, self._run_frames, self._last_at = hz, (1 if hz is not None else 0), at
        return ended

    def _ended(self) -> Beep | None:
        """The run that just stopped, if it was a beep."""
        if self._run_hz is None:
            return None
        duration = self._run_frames * FRAME_MS
        if not self.settings.min_ms <= duration <= self.settings.max_ms:
            return None
        return Beep(round(self._run_hz, 1), duration, self._last_at)
