"""Word error rate over G.711, G.722 and Opus: what a wideband phone line gives Whisper.

Twenty lines (:data:`LINES`: names, numbers, addresses, spelled words, the things callers read
out), each said by one of five voices (Piper's, and four espeak-ng voices), mixed with street
noise at 15 dB SNR (``server.testkit.impairments``), then carried as each codec carries it in
the SIP endpoint:

- **G.711**: 16 kHz -> 8 kHz (swresample), mu-law and back, -> 16 kHz: what ``SipCall`` feeds
  the session on a PCMU call;
- **G.722**: encoded and decoded at 16 kHz by aiortp's codec (the ``G722`` package), in 20 ms
  frames, as on a G.722 call;
- **Opus**: encoded and decoded at 16 kHz by the SIP endpoint's own codec
  (``server.transports.sip.opus.SipOpus``, libopus at its default bitrate), in 20 ms frames.

Each is transcribed by the server's Whisper (its default model, greedy), and scored against the
line: word errors (substitutions, insertions, deletions) over the reference's words, with the
counts. Run: ``python -m benchmarks.wideband [--name NAME]`` (results in
``benchmarks/results/NAME/``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from media import Transcriber
from media.audio import SAMPLE_RATE
from media.g711 import pcm_to_ulaw, ulaw_to_pcm
from server.testkit.impairments import mix_at_snr, noise
from server.testkit.scenarios.speech import _espeak, aligned_speech, aligned_voice, to_rate

from .noisy_calls import word_errors, words_of

__all__ = ["LINES", "VOICES", "main"]

LINES = (
    "My postcode is SW1A 2AA, and the house number is forty-six.",
    "The order number is F as in Frank, seven, three, nine, two.",
    "Please send it to Fitzroy Street, flat six, third floor.",
    "My surname is Thistlethwaite, spelled T H I S T L E.",
    "I need to change the delivery to Thursday the fifth of September.",
    "Can you check whether the invoice for fifteen pounds fifty was paid?",
    "The serial number starts with S, then five, five, zero, F.",
    "I'd like a refund for the cracked vase and the faded scarf.",
    "My phone number is oh seven seven, four six, three five, eight one.",
    "Is the shop on Church Street still open on Sunday afternoons?",
    "We have six guests, and one of them needs a vegetarian dish.",
    "The parcel was left with the neighbour at number sixty.",
    "Could you spell the name of the street for me, please?",
    "The account is in the name of Stephanie Vasquez.",
    "I paid with a Visa card ending in four, three, three, six.",
    "The fridge makes a hissing sound after the first few seconds.",
    "My flight lands at half past six, so I will be late.",
    "Cancel the subscription, but keep the free sample please.",
    "The reference is five S seventy-three F, all capitals.",
    "Thank you, that solves it, I have no further questions.",
)
VOICES = ("piper", "en-us", "en-gb", "en-us+f3", "en-gb+m3")
SNR_DB = 15.0
NOISE_SEED = 7
FRAME = SAMPLE_RATE * 20 // 1000 * 2
"""20 ms of 16 kHz PCM16."""


def spoken(index: int) -> bytes:
    """Line ``index`` said by its voice (cycling through :data:`VOICES`), 16 kHz PCM16."""
    text, voice = LINES[index], VOICES[index % len(VOICES)]
    if voice == "piper":
        model, config = aligned_voice()
        pcm, rate, _ = aligned_speech(model, config, text)
        return to_rate(pcm, rate, SAMPLE_RATE)
    return _espeak(text, voice, 1.0)


def noisy(pcm: bytes, index: int) -> bytes:
    background = noise("street", len(pcm) // 32 + 1000, seed=NOISE_SEED + index)
    return mix_at_snr(pcm, background, SNR_DB)


def over_g711(pcm: bytes) -> bytes:
    narrow = to_rate(pcm, SAMPLE_RATE, 8000)
    return to_rate(ulaw_to_pcm(pcm_to_ulaw(narrow)), 8000, SAMPLE_RATE)


def over_g722(pcm: bytes) -> bytes:
    from aiortp.codecs import get_codec

    encoder, decoder = get_codec(9), get_codec(9)
    pcm += bytes(-len(pcm) % FRAME)
    frames = (pcm[i : i + FRAME] for i in range(0, len(pcm), FRAME))
    return b"".join(decoder.decode(encoder.encode(frame)) for frame in frames)


def over_opus(pcm: bytes) -> bytes:
    from server.transports.sip.opus import SipOpus

    encoder, decoder = SipOpus(), SipOpus()
    pcm += bytes(-len(pcm) % FRAME)
    frames = (pcm[i : i + FRAME] for i in range(0, len(pcm), FRAME))
    return b"".join(decoder.decode(encoder.encode(frame)) for frame in frames)


async def measure() -> dict[str, Any]:
    transcriber = Transcriber.load()
    codecs = {"G.711": over_g711, "G.722": over_g722, "Opus": over_opus}
    lines: list[dict[str, Any]] = []
    totals = {name: 0 for name in codecs}
    for index, text in enumerate(LINES):
        line = noisy(spoken(index), index)
        record: dict[str, Any] = {"line": text, "voice": VOICES[index % len(VOICES)]}
        for name, carry in codecs.items():
            heard = (await transcriber.transcribe(carry(line))).text
            count = word_errors(text, heard)
            totals[name] += count
            record[name] = {"heard": heard, "errors": count}
        lines.append(record)
        counts = " ".join(f"{record[name]['errors']:2d}" for name in codecs)
        print(f"{index + 1:2d} {counts}  {text}")
    words = sum(len(words_of(text)) for text in LINES)
    summary: dict[str, Any] = {
        name: {"errors": count, "words": words, "wer": round(count / words, 4)}
        for name, count in totals.items()
    }
    g711 = totals["G.711"]
    summary["relative_reduction"] = round(1 - totals["G.722"] / g711, 3) if g711 else None
    summary["opus_relative_reduction"] = round(1 - totals["Opus"] / g711, 3) if g711 else None
    return {
        "model": transcriber.settings.model or "bundled tiny.en",
        "snr_db": SNR_DB,
        "noise": "street",
        "summary": summary,
        "lines": lines,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="wideband")
    args = parser.parse_args(argv)
    result = asyncio.run(measure())
    out = Path(__file__).resolve().parent / "results" / args.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
