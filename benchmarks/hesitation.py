"""The hesitation corpus: callers who stop mid-sentence, and questions that open with a comma.

Each line is synthesized whole by the product's Piper voice, so the prosody runs on through the
cut, then cut at a word boundary (where Piper's own phoneme alignments put the break after the
word) where a pause of 0.5-1.5 s is inserted. Kinds:

- ``clause``: an unfinished clause ("...a table for | four people");
- ``digits``: numbers or letters read in groups ("five five five, | zero one three four");
- ``um``: a filled pause ("I'd like, um, | the vegetarian option");
- ``finished``: the words before the pause look finished ("A table, please. | For four."), so
  that no rule on the text alone passes the corpus;
- ``comma``: a question opened by a short phrase and Piper's own comma pause ("Right, and
  what time is it tonight?"), no pause inserted: one turn each, one LLM request each.

Regenerate with ``python -m benchmarks.hesitation`` (the WAVs and ``hesitation.json`` are
committed, so every machine measures the same audio); ``--missing`` writes only absent ones.
"""

from __future__ import annotations

import json
import sys
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from media import Resampler
from media.audio import FRAME_BYTES, SAMPLE_RATE
from server.testkit.scenarios.speech import aligned_speech, aligned_voice

__all__ = ["HESITATION_DIR", "HesitantLine", "load_hesitation"]

HESITATION_DIR = Path(__file__).resolve().parent / "corpus" / "hesitation"
Kind = Literal["clause", "digits", "um", "finished", "comma"]


@dataclass(frozen=True)
class HesitantLine:
    id: str
    kind: Kind
    text: str
    cut_after: int | None
    """The pause follows this word (0-based, words as spaces split ``text``); None: none."""
    pause_ms: int = 0
    pause_at_ms: float | None = field(default=None, compare=False)
    """Where the inserted pause starts in the WAV (written by :func:`generate`)."""

    @property
    def path(self) -> Path:
        return HESITATION_DIR / f"{self.id}.wav"

    def pcm(self) -> bytes:
        with wave.open(str(self.path), "rb") as wav:
            if (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) != (1, 2, SAMPLE_RATE):
                raise ValueError(f"{self.path} is not 16 kHz mono PCM16")
            return wav.readframes(wav.getnframes())


_L = HesitantLine
SPEC: tuple[HesitantLine, ...] = (
    _L("table_for", "clause", "I'd like to book a table for four people on Friday.", 6, 900),
    _L("check_whether", "clause", "Could you check whether my order has shipped?", 3, 1000),
    _L("booking_to", "clause", "I want to move my booking to next Friday evening.", 6, 1200),
    _L("because", "clause", "I'm calling because my parcel never arrived.", 2, 700),
    _L("long_pause", "clause", "I would like to order a pizza with extra cheese.", 5, 1500),
    _L("number_groups", "digits", "My number is five five five, zero one three four.", 5, 800),
    _L("number_more", "digits",
       "My number is five five five, zero one three four, two two.", 9, 1000),
    _L("order_groups", "digits", "My order number is four seven nine, two one eight.", 6, 1200),
    _L("spelled", "digits", "The name is Rossi, R, O, S, S, I.", 6, 800),
    _L("um_option", "um", "I'd like, um, the vegetarian option please.", 2, 1000),
    _L("uh_close", "um", "Can you tell me, uh, when you close tonight?", 4, 600),
    _L("table_please", "finished", "A table, please. For four.", 2, 1000),
    _L("comma_right", "comma", "Right, and what time is it tonight?", None),
    _L("comma_fine", "comma", "Fine, thanks, and how late are you open?", None),
    _L("comma_well", "comma", "Well, I mean, can I bring my dog?", None),
    _L("comma_okay", "comma", "Okay, so where is my order?", None),
    _L("comma_hi", "comma", "Hi, yes, do you deliver on Sundays?", None),
    _L("comma_so", "comma", "So, um, can I pay by card?", None),
)  # fmt: skip


def load_hesitation() -> list[HesitantLine]:
    """The corpus as committed; raises FileNotFoundError if a WAV is missing."""
    manifest = json.loads((HESITATION_DIR / "hesitation.json").read_text())
    lines = [HesitantLine(**entry) for entry in manifest]
    for line in lines:
        if not line.path.is_file():
            raise FileNotFoundError(f"{line.path} (regenerate: python -m benchmarks.hesitation)")
    return lines


def generate(missing_only: bool = False) -> list[HesitantLine]:
    """Synthesize, cut and write every line (or only those missing), and the manifest."""
    HESITATION_DIR.mkdir(parents=True, exist_ok=True)
    old = {}
    if missing_only and (HESITATION_DIR / "hesitation.json").is_file():
        old = {e["id"]: e for e in json.loads((HESITATION_DIR / "hesitation.json").read_text())}
    voice, config = aligned_voice(noiseless=False)  # a natural take, sampling noise kept
    written = []
    for line in SPEC:
        if line.id in old and line.path.is_file():
            written.append(HesitantLine(**old[line.id]))
            continue
        pcm, rate, word_ends = aligned_speech(voice, config, line.text)
        pause_at = None
        if line.cut_after is not None:
            cut = word_ends[line.cut_after]
            heard = " ".join(line.text.split()[: line.cut_after + 1])
            print(f"  {line.id}: pause after {heard!r} at {cut / rate:.2f} s", file=sys.stderr)
            pcm = pcm[: cut * 2] + bytes(line.pause_ms * rate // 1000 * 2) + pcm[cut * 2 :]
            pause_at = cut / rate * 1000
        resampler = Resampler(rate, SAMPLE_RATE)
        pcm = resampler.resample(pcm) + resampler.flush()
        pcm += bytes(FRAME_BYTES - len(pcm) % FRAME_BYTES)
        with wave.open(str(line.path), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(SAMPLE_RATE)
            wav.writeframes(pcm)
        written.append(HesitantLine(**{**asdict(line), "pause_at_ms": pause_at}))
    manifest = [asdict(line) for line in written]
    (HESITATION_DIR / "hesitation.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return written


if __name__ == "__main__":
    lines = generate(missing_only="--missing" in sys.argv[1:])
    print(f"wrote {len(lines)} lines to {HESITATION_DIR}")
