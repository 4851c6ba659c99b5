"""Piper's CPU and wall time per second of speech, the voice as exported against its decoder
rewritten for onnxruntime's 2-D kernels (``media/piper_graph.py``), on the benchmark's answers,
the two graphs taking turns sentence by sentence, so a machine's drift hits both alike.

    python -m benchmarks.piper_cost --rounds 5 --threads 1 --output DIR

Writes ``piper-cost.json`` and ``piper-cost.md`` to DIR (and prints the table). CPU time is this
process's (:func:`time.process_time`: onnxruntime's threads, not other processes).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.llm import LONG_ANSWER, SHORT_ANSWER
from media.piper_graph import noiseless_inputs, voice_graph
from media.tts import default_piper_voice, onnx_session, piper_voice

__all__ = ["main", "measure"]

SENTENCES = [
    "Sure.",
    *SHORT_ANSWER.replace(". ", ".\n").splitlines(),
    *LONG_ANSWER.replace(". ", ".\n").splitlines(),
]


def measure(rounds: int, threads: int) -> dict[str, Any]:
    """CPU and wall ms per second of audio for each graph on ``threads`` intra-op threads, per
    round (all sentences), and the largest difference between the two graphs' samples (full
    scale 1)."""
    model, config = default_piper_voice()
    voice = piper_voice(config)  # for its phonemes
    with voice_graph(model) as rewritten:
        sessions = {
            "exported": onnx_session(model, threads),
            "rewritten": onnx_session(rewritten, threads),
        }
    feeds = [noiseless_inputs(voice, text) for text in SENTENCES]
    cpu_s = {name: [0.0] * rounds for name in sessions}
    wall_s = {name: [0.0] * rounds for name in sessions}
    audio_s = [0.0] * rounds
    largest_difference = 0.0
    for round_ in range(rounds + 1):  # round 0 warms both up, untimed
        for feed in feeds:
            outputs = {}
            for name, session in sessions.items():
                cpu, wall = time.process_time(), time.perf_counter()
                outputs[name] = session.run(None, feed)[0].squeeze()
                if round_:
                    cpu_s[name][round_ - 1] += time.process_time() - cpu
                    wall_s[name][round_ - 1] += time.perf_counter() - wall
            if round_:
                audio_s[round_ - 1] += outputs["exported"].size / voice.config.sample_rate
            difference = np.abs(outputs["exported"] - outputs["rewritten"]).max()
            largest_difference = max(largest_difference, float(difference))
    cpu_ms = _per_audio_second(cpu_s, audio_s)
    wall_ms = _per_audio_second(wall_s, audio_s)
    return {
        "machine": platform.processor() or platform.machine(),
        "threads": threads,
        "sentences": len(SENTENCES),
        "audio_s_per_round": audio_s[0],
        "cpu_ms_per_audio_s": cpu_ms,
        "wall_ms_per_audio_s": wall_ms,
        "median": {name: statistics.median(values) for name, values in cpu_ms.items()},
        "median_wall": {name: statistics.median(values) for name, values in wall_ms.items()},
        "largest_sample_difference": largest_difference,
    }


def _per_audio_second(seconds: dict[str, list[float]], audio_s: list[float]) -> dict[str, Any]:
    return {
        name: [1000 * spent / audio for spent, audio in zip(runs, audio_s, strict=True)]
        for name, runs in seconds.items()
    }


def report(result: dict[str, Any]) -> str:
    rows = [
        f"| {name} | {result['median'][name]:.1f} | {result['median_wall'][name]:.1f} | "
        + ", ".join(f"{v:.1f}" for v in values)
        + " |"
        for name, values in result["cpu_ms_per_audio_s"].items()
    ]

    def change(key: str) -> str:
        return f"{100 * (result[key]['rewritten'] / result[key]['exported'] - 1):+.1f} %"

    return "\n".join(
        [
            f"Piper on {result['threads']} thread(s), {result['sentences']} sentences "
            f"({result['audio_s_per_round']:.1f} s of speech) a round:",
            "",
            "| graph | CPU ms per s of speech, median | wall ms per s, median | CPU, every round |",
            "|---|---|---|---|",
            *rows,
            "",
            f"Rewritten: {change('median')} CPU, {change('median_wall')} wall time; largest "
            f"difference between the two graphs' samples: "
            f"{result['largest_sample_difference']:.1e} of full scale.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: every core)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    result = measure(args.rounds, args.threads)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "piper-cost.json").write_text(json.dumps(result, indent=2) + "\n")
    table = report(result)
    (args.output / "piper-cost.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
