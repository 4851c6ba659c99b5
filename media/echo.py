"""Telling the caller's voice from the agent's own voice leaking back (phone echo).

Phones and gateways return part of what they play: the agent's speech comes back in the caller's
audio, delayed (tens to hundreds of ms) and attenuated (the echo return loss, typically 10-30 dB).
Without care that echo counts as caller speech and the agent interrupts itself.

:class:`EchoGate` is a reference-based suppressor: it knows the level of every frame the speaker
sent (``Speaker.levels``). A caller frame is echo when it is not louder than the loudest recent
output frame minus ``return_loss_db``: the strongest echo the output could have caused over any
delay up to ``max_delay_ms``. The caller talking over the agent at a normal level is well above
that and still counts; a quiet caller during loud agent speech may be missed (double talk), which
costs a late barge-in, never a false one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from .audio import FRAME_MS, pcm_rms_dbfs

__all__ = ["EchoGate", "EchoSettings"]


@dataclass(frozen=True)
class EchoSettings:
    enabled: bool = True
    return_loss_db: float = 12.0
    """The least attenuation assumed on the echo path; echo weaker than the output by less than
    this is heard as the caller."""
    max_delay_ms: int = 500
    """The longest echo delay covered (round trip through the network and the phone)."""


class EchoGate:
    """Judges caller frames against the recent output levels of the agent's speaker."""

    def __init__(self, settings: EchoSettings | None = None) -> None:
        self.settings = settings or EchoSettings()
        self._frames = max(1, self.settings.max_delay_ms // FRAME_MS + 1)
        self.suppressed = 0
        """Caller frames judged echo so far."""

    def echo_ceiling_dbfs(self, output_levels: Sequence[float]) -> float:
        """The loudest echo the recent output (newest last) could put in the caller's audio."""
        recent = list(islice(reversed(output_levels), self._frames))
        if not recent:
            return float("-inf")
        return max(recent) - self.settings.return_loss_db

    def is_echo(self, frame: bytes, output_levels: Sequence[float]) -> bool:
        """Whether ``frame`` (caller PCM16) is explained by the agent's own recent output."""
        if not self.settings.enabled:
            return False
        level = pcm_rms_dbfs(frame)
        echo = level != float("-inf") and level <= self.echo_ceiling_dbfs(output_levels)
        self.suppressed += echo
        return echo
