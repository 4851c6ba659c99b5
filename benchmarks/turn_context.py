"""What the end-of-turn model hears across a long pause: three ways to feed it one utterance.

A hesitant caller's utterance holds the pause they made ("I'm calling because | my parcel never
arrived."). Smart Turn v3.2 reads the utterance's last 8 s, so its score at the end also sees
that pause. This scores, with 200 ms and 500 ms of silence at the end:

- ``whole``: the utterance as the session keeps it (what Vocable feeds the model);
- ``spliced``: the same with every silence longer than 500 ms cut out (webrtcvad's frames);
- ``last``: only the speech after the last such silence (pipecat's default feeding).

at the end of every paused line of the hesitation corpus (the caller is done: a high score is
right), and at the second pause of five lines paused twice (the caller is not done: a high score
is a cut-in unless the words hold the turn). Also scored: "A table, please" followed by "for
four", in three takes of each of three writings (with a full stop, with a comma, with neither:
the prosody running on to "for"), at 200, 350, 500 and 800 ms of silence after "please" (as
fed today), into ``run-on.json``. Run: ``python -m benchmarks.turn_context``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import webrtcvad

from media import Resampler
from media.audio import FRAME_BYTES, SAMPLE_RATE
from media.turn_model import TurnModel
from server.testkit.scenarios.speech import aligned_speech, aligned_voice

from .hesitation import load_hesitation

FRAME = FRAME_BYTES // 2
LONG_MS = 500
"""A silence longer than this splits the utterance (Piper's comma pauses are ~420 ms)."""
TWICE = (  # text, then (the word the pause follows, its length in ms) for each pause
    ("I'd like a table, please. For four people, at eight.", ((4, 1000), (7, 900))),
    ("I'm calling about, um, my order, the blue kettle.", ((3, 800), (5, 900))),
    ("My number is five five five, zero one three four, two two.", ((5, 800), (9, 900))),
    ("I want to move, uh, my booking. To next Friday.", ((4, 700), (6, 1000))),
    ("The name is Rossi, R, O, S, S, I.", ((3, 700), (6, 800))),
)
Feeding = Callable[[np.ndarray], np.ndarray]


def _runs(audio: np.ndarray) -> list[tuple[int, int]]:
    """The silences longer than ``LONG_MS``, in frames: (first silent frame, first voiced
    after it); a trailing silence is not one."""
    vad = webrtcvad.Vad(2)
    runs, start = [], None
    for i in range(len(audio) // FRAME):
        voiced = vad.is_speech(audio[i * FRAME : (i + 1) * FRAME].tobytes(), SAMPLE_RATE)
        if not voiced and start is None:
            start = i
        elif voiced and start is not None:
            if (i - start) * 20 > LONG_MS:
                runs.append((start, i))
            start = None
    return runs


def _spliced(audio: np.ndarray) -> np.ndarray:
    kept, at = [], 0
    for start, end in _runs(audio):
        kept.append(audio[at : start * FRAME])
        at = end * FRAME
    return np.concatenate([*kept, audio[at:]])


def _last(audio: np.ndarray) -> np.ndarray:
    runs = _runs(audio)
    return audio[runs[-1][1] * FRAME :] if runs else audio


FEEDINGS: dict[str, Feeding] = {"whole": lambda a: a, "spliced": _spliced, "last": _last}


def _scores(model: TurnModel, speech: np.ndarray) -> dict[str, list[float]]:
    out = {}
    for name, feed in FEEDINGS.items():
        with_silence = (np.concatenate([speech, np.zeros(ms * 16, np.int16)]) for ms in (200, 500))
        out[name] = [round(model._score(feed(audio).tobytes()), 2) for audio in with_silence]
    return out


def _voiced_end(audio: np.ndarray) -> int:
    loud = np.nonzero(np.abs(audio.astype(np.int32)) > 500)[0]
    return (int(loud[-1]) // FRAME + 1) * FRAME


def _paused_twice() -> list[tuple[str, np.ndarray, int]]:
    """Each line of ``TWICE`` at 16 kHz, and where its second pause starts."""
    voice, config = aligned_voice(noiseless=False)
    lines = []
    for text, pauses in TWICE:
        pcm, rate, word_ends = aligned_speech(voice, config, text)
        speech = np.frombuffer(pcm, np.int16)
        pieces, at, second = [], 0, 0
        for word, ms in pauses:
            pieces.append(speech[at : word_ends[word]])
            second = sum(len(p) for p in pieces)
            pieces.append(np.zeros(ms * rate // 1000, np.int16))
            at = word_ends[word]
        resampler = Resampler(rate, SAMPLE_RATE)
        joined = np.concatenate([*pieces, speech[at:]]).tobytes()
        audio = np.frombuffer(resampler.resample(joined) + resampler.flush(), np.int16)
        lines.append((text, audio, second * SAMPLE_RATE // rate // FRAME * FRAME))
    return lines


RUN_ON = ("A table, please. For four.", "A table, please, for four.", "A table please for four.")
"""One request, three ways: the pause follows "please" (word 2)."""


def _run_on_scores(model: TurnModel) -> dict[str, dict[str, list[float]]]:
    """Each writing of ``RUN_ON``, three takes, cut after "please": the scores at 200, 350,
    500 and 800 ms of silence."""
    voice, config = aligned_voice(noiseless=False)
    out: dict[str, dict[str, list[float]]] = {}
    for text in RUN_ON:
        out[text] = {}
        for take in range(3):
            pcm, rate, word_ends = aligned_speech(voice, config, text)
            resampler = Resampler(rate, SAMPLE_RATE)
            cut = resampler.resample(pcm[: word_ends[2] * 2]) + resampler.flush()
            speech = np.frombuffer(cut, np.int16)
            speech = speech[: _voiced_end(speech)]
            out[text][f"take {take + 1}"] = [
                round(
                    model._score(np.concatenate([speech, np.zeros(ms * 16, np.int16)]).tobytes()), 2
                )
                for ms in (200, 350, 500, 800)
            ]
    return out


def main() -> dict[str, dict[str, dict[str, list[float]]]]:
    model = TurnModel.load()
    ends = {}
    for line in load_hesitation():
        if line.pause_at_ms is not None:
            audio = np.frombuffer(line.pcm(), np.int16)
            ends[line.id] = _scores(model, audio[: _voiced_end(audio)])
    seconds = {text: _scores(model, audio[:second]) for text, audio, second in _paused_twice()}
    return {"line ends (done)": ends, "second pauses (not done)": seconds}


if __name__ == "__main__":
    results = main()
    run_on = _run_on_scores(TurnModel.load())
    json.dump({**results, "run-on": run_on}, sys.stdout, indent=1)
    folder = Path(__file__).resolve().parent / "results" / "turn-context"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scores.json").write_text(json.dumps(results, indent=1) + "\n")
    (folder / "run-on.json").write_text(json.dumps(run_on, indent=1) + "\n")
