"""The benchmark's spoken corpus: committed WAVs (16 kHz mono PCM16) described by ``corpus.json``.

Two voices (the product's Piper voice and espeak-ng), short and long questions (one opening with
"Hello," and a comma pause, as callers do), a barge-in line and non-turns (a backchannel "mhm", a
synthetic cough). Regenerate with ``python -m benchmarks.corpus`` (``--missing``: only the WAVs
not there yet); the WAVs are committed so every machine measures the same audio.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import wave
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from media import Resampler, Synthesizer
from media.audio import FRAME_BYTES, SAMPLE_RATE

__all__ = ["CORPUS_DIR", "Utterance", "load_corpus"]

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"

Kind = Literal["question", "long_question", "barge_in", "backchannel"]


@dataclass(frozen=True)
class Utterance:
    id: str
    kind: Kind
    voice: Literal["piper", "espeak", "synthetic"]
    text: str

    @property
    def path(self) -> Path:
        return CORPUS_DIR / f"{self.id}.wav"

    def pcm(self) -> bytes:
        with wave.open(str(self.path), "rb") as wav:
            if (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) != (1, 2, SAMPLE_RATE):
                raise ValueError(f"{self.path} is not 16 kHz mono PCM16")
            return wav.readframes(wav.getnframes())


SPEC: tuple[Utterance, ...] = (
    Utterance("piper_where_order", "question", "piper", "Where is my order?"),
    Utterance("piper_opening", "question", "piper", "What time do you open tomorrow?"),
    Utterance("piper_cancel", "question", "piper", "Can I still cancel it?"),
    Utterance(
        "piper_kettle",
        "long_question",
        "piper",
        "Hi, I ordered a blue kettle last week and I would like to know when it will arrive.",
    ),
    Utterance("espeak_delivery", "question", "espeak", "When will my parcel be delivered?"),
    Utterance(
        "piper_hello_parcel", "question", "piper", "Hello, I am calling about my parcel."
    ),  # a greeting, a comma pause, then the turn: callers open like this
    Utterance(
        "espeak_table",
        "long_question",
        "espeak",
        "I would like to book a table for four people on Friday evening, please.",
    ),
    Utterance("piper_everything", "long_question", "piper", "Tell me everything about delivery."),
    Utterance("piper_stop", "barge_in", "piper", "Wait, stop, I have another question."),
    Utterance("piper_mhm", "backchannel", "piper", "Mhm."),
    Utterance("synthetic_cough", "backchannel", "synthetic", "(a short cough)"),
)


def load_corpus() -> dict[str, Utterance]:
    """The corpus by id; raises FileNotFoundError if a WAV is missing."""
    manifest = json.loads((CORPUS_DIR / "corpus.json").read_text())
    corpus = {entry["id"]: Utterance(**entry) for entry in manifest}
    for utterance in corpus.values():
        if not utterance.path.is_file():
            raise FileNotFoundError(f"{utterance.path} (regenerate: python -m benchmarks.corpus)")
    return corpus


def generate(missing_only: bool = False) -> None:
    """(Re)write every WAV (or only those not there yet: Piper's takes vary, so rewriting the
    others would change what earlier results measured) and the manifest."""
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    piper = Synthesizer.load()
    for utterance in SPEC:
        if missing_only and utterance.path.is_file():
            continue
        if utterance.voice == "piper":
            pcm = _resample(piper.synthesize_all(utterance.text), piper.sample_rate)
        elif utterance.voice == "espeak":
            pcm = _espeak(utterance.text)
        else:
            pcm = _cough()
        _write(utterance.path, pcm[: len(pcm) // FRAME_BYTES * FRAME_BYTES])
    manifest = [asdict(utterance) for utterance in SPEC]
    (CORPUS_DIR / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _resample(pcm: bytes, rate: int) -> bytes:
    resampler = Resampler(rate, SAMPLE_RATE)
    return resampler.resample(pcm) + resampler.flush()


def _espeak(text: str) -> bytes:
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise RuntimeError("espeak-ng is needed to generate the corpus: apt-get install espeak-ng")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.wav"
        subprocess.run(
            [espeak, "-v", "en-us", "-s", "150", "-w", str(path), text], check=True, timeout=60
        )
        with wave.open(str(path), "rb") as wav:
            return _resample(wav.readframes(wav.getnframes()), wav.getframerate())


def _cough() -> bytes:
    """A 160 ms burst of band-limited noise with a fast attack: a cough's rough shape."""
    rng = np.random.default_rng(2026)
    samples = SAMPLE_RATE * 160 // 1000
    noise = rng.normal(0.0, 1.0, samples)
    noise = np.convolve(noise, np.ones(6) / 6, mode="same")  # soften the top end
    envelope = np.minimum(1.0, np.arange(samples) / 80) * np.exp(-np.arange(samples) / 900)
    burst = noise * envelope / np.max(np.abs(noise * envelope)) * 0.5 * 32767
    silence = np.zeros(SAMPLE_RATE // 10)
    return np.concatenate([silence, burst, silence]).astype("<i2").tobytes()


def _write(path: Path, pcm: bytes) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        wav.writeframes(pcm)


if __name__ == "__main__":
    generate(missing_only="--missing" in sys.argv[1:])
    print(f"wrote {len(SPEC)} utterances to {CORPUS_DIR}")
