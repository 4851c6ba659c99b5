"""Smart Turn's score of each corpus line against the silence after it (see README.md).

Run from the repository::

    PYTHONPATH=. .venv/bin/python benchmarks/results/turn-scores-by-silence/probe.py
"""

from __future__ import annotations

import numpy as np

from benchmarks.corpus import load_corpus
from benchmarks.hesitation import load_hesitation
from benchmarks.turn_context import _voiced_end
from media.turn_model import TurnModel

SILENCES_MS = (200, 250, 300, 350, 400, 500)


def scores(model: TurnModel, speech: np.ndarray) -> list[float]:
    """The score with each of ``SILENCES_MS`` of silence after ``speech`` (16 kHz PCM16)."""
    return [
        round(model._score(np.concatenate([speech, np.zeros(ms * 16, np.int16)]).tobytes()), 3)
        for ms in SILENCES_MS
    ]


def main() -> None:
    model = TurnModel.load()
    print("silence ms", SILENCES_MS)
    print("== done: benchmark corpus")
    for utterance in load_corpus().values():
        if utterance.kind in ("question", "long_question"):
            audio = np.frombuffer(utterance.pcm(), np.int16)
            print(f"{utterance.id:22s}", scores(model, audio[: _voiced_end(audio)]))
    print("== done: hesitation line ends")
    for line in load_hesitation():
        audio = np.frombuffer(line.pcm(), np.int16)
        print(f"{line.id:22s}", scores(model, audio[: _voiced_end(audio)]))
    print("== not done: at the inserted pause")
    for line in load_hesitation():
        if line.pause_at_ms is not None:
            audio = np.frombuffer(line.pcm(), np.int16)[: int(line.pause_at_ms * 16)]
            print(f"{line.id:22s}", scores(model, audio))


if __name__ == "__main__":
    main()
