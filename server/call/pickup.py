"""Who picked up an outbound call, judged from the first seconds of the callee's audio.

The policy (docs/telephony.md, "Outbound calls"): after the answer the agent waits for the
callee's first words before it greets, so it never talks over a "Hello?".

- Nothing voiced within ``greet_wait_ms`` (1 s) of the answer: ``silent`` (greet now).
- Speech that stops for ``end_silence_ms`` (500 ms) before it has lasted ``machine_after_ms``
  (the playbook's ``voicemail.detect_after_ms``, 4 s): ``person`` (greet now, right after their
  words; those words are not answered as a turn of their own, the greeting answers them).
- Speech going on past ``machine_after_ms`` without such a pause: ``machine`` (a voicemail
  greeting). Then :attr:`Pickup.greeting_over` turns true as the greeting's beep ends
  (:mod:`media.beep`: :attr:`Pickup.over_by` ``beep``), or, with no beep, once
  ``message_silence_ms`` (the playbook's ``voicemail.beep_timeout_ms``, 2.5 s) of silence
  follows the greeting (``silence``), or at the latest ``machine_wait_ms`` (30 s) after the
  answer (``timeout``).

A person who talks for more than 4 s without a half-second pause is taken for a machine, and a
machine greeting with a half-second pause in its first 4 s for a person: this is the trade of
every detector that listens to timing alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from media import FRAME_MS, SpeechEnded, SpeechStarted, VadSegmenter, VadSettings
from media.beep import Beep, BeepDetector

__all__ = ["GreetingEnd", "Pickup", "PickupSettings", "PickupVerdict"]

PickupVerdict = Literal["silent", "person", "machine"]
GreetingEnd = Literal["beep", "silence", "timeout"]
"""What ended a voicemail greeting: its beep, silence without one, or the longest wait."""


@dataclass(frozen=True)
class PickupSettings:
    greet_wait_ms: int = 1000
    end_silence_ms: int = 500
    machine_after_ms: int = 4000
    message_silence_ms: int = 2500
    machine_wait_ms: int = 30_000
    vad: VadSettings = field(default_factory=VadSettings)


class Pickup:
    """Feed the callee's 20 ms frames of 16 kHz PCM16 from the answer on; :attr:`verdict` is
    None until decided, then fixed."""

    def __init__(
        self, settings: PickupSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings = settings or PickupSettings()
        self.clock = clock
        self.vad = VadSegmenter(replace(settings.vad, end_silence_ms=settings.end_silence_ms))
        self.answered_at = clock()
        self.verdict: PickupVerdict | None = None
        self.greeting_over = False
        """After a ``machine`` verdict: the voicemail greeting has ended (leave the message)."""
        self.over_by: GreetingEnd | None = None
        self.beep: Beep | None = None
        """The greeting's beep, once heard."""
        self._beeps = BeepDetector()
        self.heard_ms = 0
        """How long the callee spoke before the verdict (0: silent)."""
        self._started_at: float | None = None
        self._silent_ms = 0

    def push(self, frame: bytes, at: float | None = None) -> PickupVerdict | None:
        """Judge one frame; returns the verdict when this frame decides it, else None."""
        at = self.clock() if at is None else at
        if self.verdict == "machine":
            if not self.greeting_over:
                self._greeting(frame, at)
            return None
        if self.verdict is not None:
            return None
        for event in self.vad.push(frame, at):
            if isinstance(event, SpeechStarted):
                self._started_at = event.at
            elif isinstance(event, SpeechEnded):
                return self._decide("person", event.last_voiced_at)
        if self._started_at is not None:
            if (at - self._started_at) * 1000 >= self.settings.machine_after_ms:
                return self._decide("machine", at)
        elif (at - self.answered_at) * 1000 >= self.settings.greet_wait_ms:
            return self._decide("silent", at)
        return None

    def _greeting(self, frame: bytes, at: float) -> None:
        """After a ``machine`` verdict: whether this frame ends the greeting."""
        beep = self._beeps.push(frame, at)
        self._silent_ms = 0 if self.vad.is_voiced(frame) else self._silent_ms + FRAME_MS
        if beep is not None:
            self.beep, self.over_by = beep, "beep"
        elif self._silent_ms >= self.settings.message_silence_ms:
            self.over_by = "silence"
        elif (at - self.answered_at) * 1000 >= self.settings.machine_wait_ms:
            self.over_by = "timeout"
        self.greeting_over = self.over_by is not None

    def _decide(self, verdict: PickupVerdict, at: float) -> PickupVerdict:
        self.verdict = verdict
        if self._started_at is not None:
            self.heard_ms = round((at - self._started_at) * 1000)
        return verdict
