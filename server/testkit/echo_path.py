"""A caller's phone that sends the agent's voice back: a speakerphone, or a line with a hybrid.

What the phone played returns in its microphone ``delay_ms`` later and ``return_loss_db``
weaker, mixed with whatever the caller says. Test callers (:class:`~.caller.WebRTCCaller`,
:class:`~.sip_phone.SipPhone`) take one to test echo cancellation with real calls: the echo
rides the same RTP stream as the caller's voice, as it does on a real line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from media import Resampler, Speaker
from media.audio import pcm_rms_dbfs

__all__ = ["EchoPath", "EchoingMicrophone", "ReturnedEcho"]


@dataclass(frozen=True)
class ReturnedEcho:
    delay_ms: int = 120
    return_loss_db: float = 6.0

    def __post_init__(self) -> None:
        if not 0 <= self.delay_ms <= 1000:
            raise ValueError(f"an echo delay of {self.delay_ms} ms is out of range (0 to 1000)")
        if not 0 <= self.return_loss_db <= 60:
            raise ValueError(f"a return loss of {self.return_loss_db} dB is out of range (0 to 60)")


class EchoPath:
    """The way back from the phone's loudspeaker to its microphone, at ``rate``."""

    def __init__(self, echo: ReturnedEcho, rate: int) -> None:
        self.echo = echo
        self.rate = rate
        self._gain = 10 ** (-echo.return_loss_db / 20)
        self._line = bytearray(echo.delay_ms * rate // 1000 * 2)
        self._resamplers: dict[int, Resampler] = {}

    def played(self, pcm: bytes, rate: int) -> None:
        """The phone played ``pcm`` (PCM16 at ``rate``): it is on its way back."""
        if rate != self.rate:
            resampler = self._resamplers.get(rate)
            if resampler is None:
                resampler = self._resamplers[rate] = Resampler(rate, self.rate)
            pcm = resampler.resample(pcm)
        self._line += pcm

    def mixed(self, frame: bytes) -> bytes:
        """``frame`` (what the microphone picked up of the caller) with the echo due now."""
        back = bytes(self._line[: len(frame)])
        del self._line[: len(back)]
        if not any(back):
            return frame
        voice = np.frombuffer(frame, dtype="<i2").astype(np.float64)
        echo = np.zeros_like(voice)
        echo[: len(back) // 2] = np.frombuffer(back, dtype="<i2") * self._gain
        return np.clip(voice + echo, -32768, 32767).astype("<i2").tobytes()


class EchoingMicrophone(Speaker):
    """A test caller's microphone (a :class:`~media.Speaker` its track pulls) that also picks
    up what :attr:`path` says the phone played."""

    def __init__(self, sample_rate: int, echo: ReturnedEcho) -> None:
        super().__init__(sample_rate)
        self.path = EchoPath(echo, sample_rate)

    def pull(self) -> bytes:
        """The next frame with the echo in it; its level is the mixed frame's (a track sends a
        frame whose level is silence as the encoder's cached silence packet)."""
        frame = self.path.mixed(super().pull())
        self.levels[-1] = pcm_rms_dbfs(frame)
        return frame
