"""What the phone-call tests say and expect, shared by every telephone transport's tests."""

from __future__ import annotations

from media import Resampler
from media.audio import SAMPLE_RATE
from tests.support.speech import piper_speech

__all__ = [
    "ANSWER",
    "INTERRUPTION",
    "LONG_ANSWER",
    "PARCEL",
    "QUESTION",
    "phone_audio",
    "prepare_phone_speech",
]

QUESTION = "Where is my order?"
PARCEL = "Where is my parcel?"
INTERRUPTION = "Stop, stop, that is enough."
ANSWER = "Your order is on its way. It will arrive on Tuesday."
LONG_ANSWER = " ".join(
    [
        "Let me tell you everything about our delivery options.",
        "Standard delivery takes three to five working days.",
        "Express delivery arrives the next working day if you order before noon.",
        "Weekend delivery is available in most cities for a small fee.",
    ]
)


def prepare_phone_speech() -> None:
    """Synthesize what the phone tests say once, ahead of the first call (a module fixture's
    work: a call must not wait on Piper for its caller's words)."""
    for text in (QUESTION, PARCEL, INTERRUPTION):
        phone_audio(text)


def phone_audio(text: str) -> bytes:
    """``text`` spoken by Piper as 8 kHz PCM16 (cached by the speech helpers)."""
    resampler = Resampler(SAMPLE_RATE, 8000)
    return resampler.resample(piper_speech(text)) + resampler.flush()
