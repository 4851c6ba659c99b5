"""Does an embedded LLM that is generating slow down the calls' speech work?

``python -m benchmarks.llm_contention [--gguf FILE] [--repeats N]`` loads Whisper, Piper and
the model in a fresh process per configuration (OpenMP reads its wait policy once per process)
and times, with the model idle and then with it generating on every slot:

- a Whisper decode of a 3 s utterance (``Transcriber.transcribe``, its worker thread and
  priority as in the server), and
- Piper's first audio of a sentence (``Synthesizer.synthesize``, as the speaker gets it),

plus the model's generation speed meanwhile. Configurations: ``vocable`` (what the server does:
the model's threads 10 steps nicer than the process, OpenMP waiting passively) and ``plain``
(same priority as the process, OpenMP's default spinning wait). Results go to
``benchmarks/results/llm-contention/`` as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .models import model_path

RESULTS = Path(__file__).resolve().parent / "results" / "llm-contention"
CONFIGS = {
    "vocable": {"niceness": None, "passive_wait": True},
    "plain": {"niceness": 0, "passive_wait": False},
}
UTTERANCE = "Could you book a table for four people at seven tomorrow evening, please?"
SENTENCE = "Your table for four is booked at seven tomorrow evening, by the window."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.llm_contention", description=__doc__
    )
    parser.add_argument(
        "--gguf", help="the model file or a name of benchmarks.models (default: smollm2-135m)"
    )
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gguf = model_path(args.gguf or "smollm2-135m")
    if args.child:
        print(json.dumps(asyncio.run(_measure(args.child, gguf, args.repeats))), flush=True)
        # no destructors at exit: with OpenMP spinning ("plain"), one aborts the process at
        # exit after everything was closed
        os._exit(0)
    results = {}
    for name in CONFIGS:
        print(f"measuring {name}...", file=sys.stderr)
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.llm_contention", "--child", name,
             "--gguf", str(gguf), "--repeats", str(args.repeats)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
    command = "python -m benchmarks.llm_contention " + " ".join(argv or sys.argv[1:])
    args.output.mkdir(parents=True, exist_ok=True)
    run = {"command": command.strip(), "model": gguf.name, **_provenance(), "results": results}
    (args.output / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    (args.output / "report.md").write_text(_report(run))
    print((args.output / "report.md").read_text())
    return 0


async def _measure(config: str, gguf: Path, repeats: int) -> dict[str, Any]:
    from media.audio import SAMPLE_RATE, Resampler, silence
    from media.stt import Transcriber
    from media.tts import Synthesizer
    from server.llm.gguf import read_gguf
    from server.llm.llamacpp import EmbeddedLLM, EmbeddedSettings

    transcriber = await asyncio.to_thread(Transcriber.load)
    synthesizer = await asyncio.to_thread(Synthesizer.load)
    speech = Resampler(synthesizer.sample_rate, SAMPLE_RATE).resample(
        synthesizer.synthesize_all(UTTERANCE)
    )
    utterance = silence(200) + speech + silence(200)
    settings = EmbeddedSettings()
    if config == "plain":
        settings = EmbeddedSettings(niceness=0, passive_wait=False)
    model = await asyncio.to_thread(EmbeddedLLM.start, read_gguf(gguf), settings)
    try:
        idle = await _speech_times(transcriber, synthesizer, utterance, repeats)
        tokens = [0]
        load = [asyncio.create_task(_generate(model, tokens)) for _ in range(model.slots)]
        await asyncio.sleep(1.0)  # generation under way on every slot
        before, started = tokens[0], time.monotonic()
        busy = await _speech_times(transcriber, synthesizer, utterance, repeats)
        elapsed, generated = time.monotonic() - started, tokens[0] - before
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    finally:
        await model.aclose()
        await transcriber.aclose()
        await synthesizer.aclose()
    return {
        "idle": idle,
        "generating": busy,
        "llm_tokens_per_s": round(generated / elapsed, 1),
    }


async def _speech_times(
    transcriber: Any, synthesizer: Any, pcm: bytes, repeats: int
) -> dict[str, float]:
    await transcriber.transcribe(pcm)  # warm-up
    stt: list[float] = []
    tts: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        await transcriber.transcribe(pcm)
        stt.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        async for _chunk in synthesizer.synthesize(SENTENCE):
            tts.append((time.perf_counter() - started) * 1000)
            break
    return {
        "stt_ms_p50": round(statistics.median(stt), 1),
        "stt_ms_max": round(max(stt), 1),
        "tts_first_audio_ms_p50": round(statistics.median(tts), 1),
        "tts_first_audio_ms_max": round(max(tts), 1),
    }


async def _generate(model: Any, tokens: list[int]) -> None:
    """Keep one slot generating; ``tokens[0]`` counts the streamed chunks (a token each)."""
    import aiohttp

    body = {
        "messages": [{"role": "user", "content": "Count from one to ten thousand."}],
        "max_tokens": 100_000, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    headers = {"Authorization": f"Bearer {model.api_key}"}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http,
        http.post(f"{model.base_url}/chat/completions", json=body, headers=headers) as response,
    ):
        async for line in response.content:
            if line.startswith(b"data: {"):
                tokens[0] += 1


def _provenance() -> dict[str, Any]:
    from .provenance import git_commit, machine

    return {"git_commit": git_commit(), "machine": machine()}


def _report(run: dict[str, Any]) -> str:
    lines = [
        "# Speech work while the embedded LLM generates",
        "",
        f"`{run['command']}` at {run['git_commit']} on {run['machine']['cpu']}; model "
        f"{run['model']}. Whisper decode of a 3 s utterance and Piper's first audio of a "
        "sentence, ms, with the model idle and with it generating on every slot.",
        "",
        "| configuration | STT idle p50 | STT generating p50 (max) | TTS first audio idle p50 | "
        "TTS generating p50 (max) | LLM tokens/s meanwhile |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in run["results"].items():
        idle, busy = result["idle"], result["generating"]
        lines.append(
            f"| {name} | {idle['stt_ms_p50']:g} | {busy['stt_ms_p50']:g} ({busy['stt_ms_max']:g})"
            f" | {idle['tts_first_audio_ms_p50']:g} | {busy['tts_first_audio_ms_p50']:g} "
            f"({busy['tts_first_audio_ms_max']:g}) | {result['llm_tokens_per_s']:g} |"
        )
    lines += [
        "",
        "`vocable`: the model's threads 10 steps nicer than the process, OpenMP waiting "
        "passively (the server's settings); `plain`: the same priority as the process and "
        "OpenMP's default (spinning) wait.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
