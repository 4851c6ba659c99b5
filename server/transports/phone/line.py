"""What the telephone transports share (media streams, AudioSocket, SIP in and out): caller audio
in as the line carries it, agent audio out on a steady 20 ms clock, and a watch on the line.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ClassVar, Literal

from server.call.session import Session
from server.runtime.registry import CallRegistry
from server.transports.base import TransportCall

from .audio import CallerAudio, CallerGap, Encoding, FramePacer

__all__ = ["PhoneCall"]


class PhoneCall(TransportCall):
    """A call over a telephone line. A subclass passes each payload of caller audio to
    :meth:`hear`, and calls :meth:`start_media` once its line is up with the function that
    sends one 20 ms frame of agent audio.

    The session hears time pass only through frames: while the line carries no caller audio
    (silence suppression, a stream that stalled), :class:`CallerGap` feeds silence so that the
    end of a turn is still seen. With ``media_timeout_s``, a line silent that long while
    :attr:`receiving` ends the call with :attr:`silence_reason`.
    """

    silence_reason: ClassVar[str] = "media_timeout: no audio from the peer"
    """The hang-up reason when the media timeout strikes."""

    def __init__(
        self,
        registry: CallRegistry,
        call_id: str,
        session: Session,
        encoding: Encoding,
        rate: int,
        *,
        media_timeout_s: float | None = None,
    ) -> None:
        super().__init__(registry, call_id, session)
        self.media_timeout_s = media_timeout_s
        self.gap = CallerGap(self.take_frame)
        """When the caller was last heard (audio, or a digit: :meth:`heard_signal`)."""
        self._audio = CallerAudio(encoding, rate)

    def start_media(
        self,
        send: Callable[[bytes], Awaitable[None]],
        *,
        when_idle: Literal["skip", "silence"] = "skip",
    ) -> None:
        """Start the paced sender (``send`` gets the speaker's next frame every 20 ms; while
        the agent is quiet, nothing or silence as ``when_idle`` says), the caller-gap filler
        and the call's watchdog. The gap and the media timeout count from now."""
        self.gap.heard()
        pacer = FramePacer(self.session.voice.speaker, send, when_idle, on_tick=self.gap.tick)
        self.spawn(pacer.run(), "pacer")
        self.watch(self._media_silent)

    def hear(self, payload: bytes) -> None:
        """Caller audio as the line carries it (any length): its 20 ms frames of 16 kHz PCM16
        go to :meth:`take_frame`, stamped with its arrival."""
        self.gap.heard()
        at = self.gap.last_heard_at
        for frame in self._audio.frames(payload):
            self.take_frame(frame, at)

    def hear_at(self, rate: int) -> None:
        """The caller's audio comes at ``rate`` from now on (an outbound call learns its codec
        from the callee's answer)."""
        self._audio = CallerAudio(self._audio.encoding, rate)

    def heard_signal(self) -> None:
        """The caller sent something other than audio (a digit): the line is alive."""
        self.gap.heard()

    def take_frame(self, frame: bytes, at: float) -> None:
        """One 20 ms frame of the caller (heard or filled in) arrived at ``at``: to the
        session (a subclass may route it elsewhere first)."""
        self.session.feed(frame, at)

    @property
    def receiving(self) -> bool:
        """Whether the peer should be sending audio now (False on hold)."""
        return True

    def _media_silent(self, now: float) -> str | None:
        timeout = self.media_timeout_s
        if timeout is not None and self.receiving and now - self.gap.last_heard_at >= timeout:
            return self.silence_reason
        return None
