"""How onnxruntime's thread pool waits, measured on Piper on every core: spinning (its default),
spinning only within a run (``session.force_spinning_stop``, ``media.tts.PIPER_SESSION_CONFIG``),
or not at all (``session.intra_op.allow_spinning`` 0).

Answers' first sentences, the three sessions taking turns, each run followed by 100 ms of idle
time as between a call's syntheses; the CPU of a run counts that idle time (threads spinning
after it).

    python -m benchmarks.onnx_spinning --rounds 15 --output DIR

Writes ``onnx-spinning.md`` to DIR (and prints it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from media.piper_graph import noiseless_inputs
from media.tts import PIPER_SESSION_CONFIG, default_piper_voice, onnx_session, piper_voice

__all__ = ["MODES", "main", "measure"]

MODES: dict[str, Mapping[str, str]] = {
    "spinning (default)": {},
    "spinning stopped after each run": PIPER_SESSION_CONFIG,
    "no spinning": {"session.intra_op.allow_spinning": "0"},
}
TEXTS = ["Sure, I can help.", "Your order shipped on Monday.", "We open at nine tomorrow morning."]
IDLE_S = 0.1


def measure(rounds: int) -> dict[str, dict[str, Any]]:
    """Per mode: the median wall ms of each text's run and the mean CPU ms per run (with the
    idle time after it)."""
    model, config = default_piper_voice()
    voice = piper_voice(config)  # for its phonemes
    sessions = {mode: onnx_session(model, 0, settings) for mode, settings in MODES.items()}
    feeds = [noiseless_inputs(voice, text) for text in TEXTS]
    wall: dict[str, list[list[float]]] = {mode: [[] for _ in TEXTS] for mode in sessions}
    cpu: dict[str, float] = dict.fromkeys(sessions, 0.0)
    for round_ in range(rounds + 1):  # round 0 warms up, untimed
        for mode, session in sessions.items():
            for n, feed in enumerate(feeds):
                time.sleep(2 * IDLE_S)  # the other sessions' threads settle
                started_cpu, started = time.process_time(), time.perf_counter()
                session.run(None, feed)
                ran = time.perf_counter() - started
                time.sleep(IDLE_S)
                if round_:
                    wall[mode][n].append(ran * 1000)
                    cpu[mode] += time.process_time() - started_cpu
    runs = rounds * len(TEXTS)
    return {
        mode: {
            "wall_ms": [statistics.median(values) for values in wall[mode]],
            "cpu_ms_per_run": 1000 * cpu[mode] / runs,
        }
        for mode in sessions
    }


def report(result: dict[str, dict[str, Any]], rounds: int) -> str:
    header = " | ".join(f"{text!r} wall ms" for text in TEXTS)
    rows = [
        f"| {mode} | {values['cpu_ms_per_run']:.1f} | "
        + " | ".join(f"{ms:.1f}" for ms in values["wall_ms"])
        + " |"
        for mode, values in result.items()
    ]
    return "\n".join(
        [
            f"Piper on every core, medians of {rounds} rounds; CPU per run includes the "
            f"{IDLE_S * 1000:.0f} ms after it:",
            "",
            f"| pool threads | CPU ms per run | {header} |",
            "|---" * (2 + len(TEXTS)) + "|",
            *rows,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output", type=Path, help="folder for onnx-spinning.md")
    args = parser.parse_args()
    text = report(measure(args.rounds), args.rounds)
    print(text)
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "onnx-spinning.md").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
