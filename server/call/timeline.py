"""Per-turn latency marks and the ``turn_metrics`` they produce."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["TurnTimeline"]


@dataclass
class TurnTimeline:
    """Monotonic clock seconds of each hop of one spoken turn (None: did not happen)."""

    last_voiced_at: float | None = None
    """The caller's last voiced frame arrived."""
    end_detected_at: float | None = None
    """The VAD decided the utterance had ended."""
    stt_done_at: float | None = None
    first_token_at: float | None = None
    """The first answer text arrived from the LLM."""
    first_sentence_at: float | None = None
    first_audio_at: float | None = None
    """Piper produced the first PCM of the answer."""
    first_frame_at: float | None = None
    """The first frame carrying the answer left the speaker."""

    def confirm_at(self, end_detected_at: float) -> None:
        """A preemptive turn confirmed at ``end_detected_at``: hops that happened before it
        count from it (they cost the caller nothing)."""
        self.end_detected_at = end_detected_at
        for name in ("stt_done_at", "first_token_at", "first_sentence_at", "first_audio_at"):
            value = getattr(self, name)
            if value is not None and value < end_detected_at:
                setattr(self, name, end_detected_at)

    def metrics_ms(self) -> dict[str, float | None]:
        """Stage durations in ms, each from the previous hop, plus voice-to-voice."""
        marks = [getattr(self, f.name) for f in fields(self)]
        names = [
            "end_of_speech_ms",
            "stt_ms",
            "llm_first_token_ms",
            "first_sentence_ms",
            "tts_first_audio_ms",
            "first_frame_out_ms",
        ]
        out: dict[str, float | None] = {}
        for name, start, end in zip(names, marks[:-1], marks[1:], strict=True):
            out[name] = _ms(start, end)
        out["voice_to_voice_ms"] = _ms(self.last_voiced_at, self.first_frame_at)
        return out


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) * 1000, 1)
