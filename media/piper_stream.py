"""An answer's first words heard before their whole sentence is synthesized.

A Piper (VITS) voice spends most of a synthesis in its decoder, the convolutions that turn
latent frames (one per ``hop`` samples) into audio. What comes before it (text encoder,
durations, flow) needs the whole sentence; the decoder does not: a frame's audio depends only on
the frames within its reach. :class:`SplitVoiceSession` runs a voice's graph as those two
parts, so the decoder can run on the sentence's first ``FIRST_FRAMES`` frames (with the frames
after them that they reach), then on windows twice as long each time: the same audio, to ~1e-6
of full scale. On
two AVX-512 cores an answer's first words ("It should arrive", 0.9 s) were heard after 41 ms
instead of 67, longer first clauses after ~57 instead of ~105.

Piper scales each sentence to a peak of full scale, which takes the whole sentence. A sentence
decoded in windows plays at one gain per voice instead (Piper's for a calibration sentence),
lowered only where that would clip (the first window at once, later ones over ``RAMP_MS``): the
same audio as Piper's at a steady level, within a few dB of the level Piper would have chosen.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .piper_graph import split_at_decoder

__all__ = [
    "FIRST_FRAMES",
    "RAMP_MS",
    "SplitVoiceSession",
    "full_scale_gain",
    "normalized",
    "split_graph_files",
    "stream_sentence",
    "window_ends",
]

log = logging.getLogger(__name__)

FIRST_FRAMES = 16
"""Latent frames of a sentence's first window (~186 ms at 22.05 kHz, of which Piper's ~40 ms
of leading silence is trimmed): long enough to play while the next window (twice as long, see
:func:`window_ends`) is decoded, short enough to come ~25-50 ms sooner. Sentences shorter
than two windows are decoded whole."""

RAMP_MS = 20.0
"""How long the gain takes to come down when the rest of a sentence would clip at the first
window's."""

CONTEXT_CHOICES = (8, 16, 32, 64)
"""Context frames tried, fewest first, when a voice is calibrated (:meth:`calibrate`)."""


def full_scale_gain(audio: np.ndarray, silent: float = 1.0) -> float:
    """The gain that brings ``audio``'s peak to full scale, as Piper normalizes a sentence;
    ``silent`` for audio with no peak to speak of (below 1e-8, where Piper outputs zeros)."""
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    return silent if peak < 1e-8 else 1.0 / peak


def normalized(audio: np.ndarray) -> np.ndarray:
    """``audio`` scaled to a peak of full scale, as Piper does (silence stays silence)."""
    gain = full_scale_gain(audio, silent=0.0)
    return audio * gain if gain else np.zeros_like(audio)


class SplitVoiceSession:
    """A voice's graph as two onnxruntime sessions, ``front`` (phoneme ids to latent frames)
    and ``decoder`` (frames to audio). :meth:`run` is Piper's ``session.run`` (the whole
    sentence); :meth:`latent` and :meth:`decode` run a sentence window by window once
    :meth:`calibrate` found how many frames of context a window needs."""

    def __init__(self, front: Any, decoder: Any, latent: str, lean_decoder: Any = None) -> None:
        self.front = front
        self.decoder = decoder
        self.latent_name = latent
        self.lean_decoder = lean_decoder
        """The decoder on one thread, for a window decoded while other work competes (None:
        ``decoder`` always)."""
        self.context_frames: int | None = None
        """Frames of context each side of a window (None: not calibrated, no windows)."""
        self.voice_gain = 1.0
        """The gain Piper gives the calibration sentence: the level windows play at."""

    def run(self, output_names: Any, feed: dict[str, np.ndarray], *args: Any) -> list[Any]:
        frames = self.front.run(None, feed)[0]
        return list(self.decoder.run(output_names, {self.latent_name: frames}, *args))

    def latent(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        """The latent frames of a sentence, shape (1, channels, frames)."""
        return np.asarray(self.front.run(None, feed)[0])

    def decode(
        self,
        latent: np.ndarray,
        start: int,
        end: int,
        context: int | None = None,
        *,
        lean: bool = False,
    ) -> np.ndarray:
        """The audio of frames ``start``..``end`` of ``latent`` (float, 1-D), decoded with
        ``context`` frames each side (the calibrated ones by default), on one thread if
        ``lean`` and the session has a :attr:`lean_decoder`."""
        reach = self.context_frames if context is None else context
        assert reach is not None, "calibrate the session before decoding windows"
        first = max(0, start - reach)
        window = latent[:, :, first : min(latent.shape[2], end + reach)]
        decoder = self.lean_decoder if lean and self.lean_decoder is not None else self.decoder
        audio = np.asarray(decoder.run(None, {self.latent_name: window})[0]).reshape(-1)
        hop = audio.size // window.shape[2]
        return audio[(start - first) * hop : (end - first) * hop]

    def calibrate(self, feed: dict[str, np.ndarray]) -> bool:
        """Find the fewest :data:`CONTEXT_CHOICES` frames of context for which the windows of
        the sentence ``feed`` (two or more windows long) sound as the whole decode, to 1e-4 of
        its peak; learn the sentence's gain. False: none does (no windows)."""
        latent = self.latent(feed)
        whole = np.asarray(self.decoder.run(None, {self.latent_name: latent})[0]).reshape(-1)
        frames = latent.shape[2]
        if frames < 2 * FIRST_FRAMES or whole.size % frames:
            return False
        self.voice_gain = full_scale_gain(whole)
        tolerance = 1e-4 * float(np.max(np.abs(whole)))
        for context in CONTEXT_CHOICES:
            windows = np.concatenate(
                [
                    self.decode(latent, 0, FIRST_FRAMES, context),
                    self.decode(latent, FIRST_FRAMES, frames, context),
                ]
            )
            if float(np.max(np.abs(windows - whole))) <= tolerance:
                self.context_frames = context
                return True
        return False


def window_ends(frames: int) -> list[int]:
    """Where the windows of a streamed sentence of ``frames`` latent frames end: the first
    after :data:`FIRST_FRAMES`, each next one twice as long as the one before, the last taking
    the rest once less than two of the next would be left. Each window is decoded while the
    ones before it play, and plays longer than the next takes to decode even when the CPU is
    shared: decoding all the rest at once (a 2 s first sentence: 190 ms beside another call)
    outlasted the first window's ~146 ms, and the caller heard "Tra... ttoria"."""
    ends: list[int] = []
    start, size = 0, FIRST_FRAMES
    while frames - start >= 2 * size:
        start += size
        ends.append(start)
        size *= 2
    return [*ends, frames]


def stream_sentence(
    session: SplitVoiceSession,
    feed: dict[str, np.ndarray],
    sample_rate: int,
    lean_now: Callable[[], bool] = lambda: False,
) -> Iterator[tuple[np.ndarray, bool]]:
    """One sentence's audio, each piece with whether it is the last: windows (see
    :func:`window_ends`) at the session's ``voice_gain``, lowered where that would clip (the
    first window at once, later ones over :data:`RAMP_MS`), when it is at least two
    :data:`FIRST_FRAMES` long; else whole, normalized as Piper does. A window after the first
    is decoded on one thread if ``lean_now()`` says other work competes by then."""
    latent = session.latent(feed)
    frames = latent.shape[2]
    if session.context_frames is None or frames < 2 * FIRST_FRAMES:
        yield normalized(session.decode(latent, 0, frames, 0)), True
        return
    ramp_samples = round(sample_rate * RAMP_MS / 1000)
    gain = session.voice_gain
    start = 0
    for end in window_ends(frames):
        audio = session.decode(latent, start, end, lean=start > 0 and lean_now())
        window_gain = min(gain, full_scale_gain(audio, silent=gain))
        if start == 0 or window_gain == gain:
            audio = audio * window_gain
        else:
            ramp = min(audio.size, ramp_samples)
            scale = np.full(audio.size, window_gain, dtype=np.float32)
            scale[:ramp] = np.linspace(gain, window_gain, ramp, endpoint=False, dtype=np.float32)
            audio = audio * scale
        gain, start = window_gain, end
        yield audio, end == frames


@contextmanager
def split_graph_files(graph: Path) -> Iterator[tuple[Path, Path, str] | None]:
    """The voice graph file ``graph`` split at its decoder, while inside: temporary files of
    its front and its decoder, and the latent tensor's name; None when it does not split
    (:func:`.piper_graph.split_at_decoder`). Files, since onnxruntime keeps the bytes of a
    session made from bytes."""
    import onnx

    try:
        parts = split_at_decoder(onnx.load(str(graph)))
    except Exception:
        log.warning("Piper voice %s: not split at its decoder", graph.name, exc_info=True)
        parts = None
    if parts is None:
        yield None
        return
    front, decoder, latent = parts
    del parts
    with tempfile.TemporaryDirectory(prefix="vocable-voice-") as directory:
        paths = Path(directory) / "front.onnx", Path(directory) / "decoder.onnx"
        onnx.save(front, str(paths[0]))
        onnx.save(decoder, str(paths[1]))
        del front, decoder
        yield paths[0], paths[1], latent
