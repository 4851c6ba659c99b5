"""``python -m benchmarks.compare``: Vocable and pipecat side by side, in one run, on this machine.

Starts the harness's paced scripted LLM, then for each side in turn (Vocable's ``vocable serve``,
then the pipecat bot of ``benchmarks/pipecat/bot.py`` in its own virtualenv) one server given the
same Whisper model folder, Piper voice and LLM pacing; calls it over real WebRTC with the
harness's aiortc caller, asks the same corpus questions and makes the same barge-ins; stops it.
Both sides are measured from the caller's audio alone (pipecat sends no Vocable events), so the
figures compare like with like. Writes ``run.json`` and ``report.md`` (default folder
``benchmarks/results/pipecat-side-by-side/``).

Needs the pipecat virtualenv once::

    python3 -m venv .venv-pipecat
    .venv-pipecat/bin/pip install -r benchmarks/pipecat/requirements.txt
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import time
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from server.testkit.caller import SILENCE_DBFS, WebRTCCaller, longest_gap_ms

from .cli import run_harness
from .compare_impaired import (
    IMPAIRED_CORPORA,
    VOCABLE_CLEANING,
    impaired_side,
    impaired_summary,
    impaired_table,
)
from .compare_report import SIDES, summarize_side, to_markdown
from .compare_report import ratios as compute_ratios
from .corpus import Utterance, load_corpus
from .heard import (
    ANSWER_TIMEOUT_S,
    FRAME_S,
    heard_between,
    settle,
    streamed_requests,
    wait_first_sound,
    wait_quiet,
)
from .hesitation import load_hesitation
from .llm import LLMPacing, paced_llm
from .noisy_calls import speech_level
from .provenance import git_commit, machine
from .report import percentile
from .server_process import ProcessSample, ServerProcess, free_port

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
BOT = Path(__file__).resolve().parent / "pipecat" / "bot.py"
PIPECAT_PYTHON = ROOT / ".venv-pipecat" / "bin" / "python"

END_OF_ANSWER_S = 1.5
"""Silence that ends an answer (longer than any pause inside one: see ``longest_gap_ms``)."""
SILENCE_HOLD_MS = 300.0
"""Barge-in: the agent counts as silent once this much silence followed (the harness's rule)."""

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")

Record = dict[str, Any]
log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    return run_harness("python -m benchmarks.compare", _run, _parser().parse_args(argv), argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__)
    parser.add_argument(
        "--corpus",
        choices=["questions", "hesitation", *IMPAIRED_CORPORA],
        default="questions",
        help="'hesitation': each side hears the hesitation corpus's lines (pauses inside "
        "lines, comma-opened questions) instead of --questions questions, and no barge-ins; "
        "'noisy' and 'echo': noise alone over a long answer, or the caller's phone returning "
        "the agent's voice (benchmarks/compare_impaired.py)",
    )
    parser.add_argument("--questions", type=int, default=10, help="questions per call (10)")
    parser.add_argument("--barge-ins", type=int, default=3, help="barge-ins per call (3)")
    parser.add_argument(
        "--warmups",
        type=int,
        default=1,
        help="questions a call starts with, reported apart from the percentiles (1)",
    )
    parser.add_argument(
        "--save-audio", action="store_true", help="write what each caller heard as a WAV"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="calls per side, the sides alternating (1)"
    )
    parser.add_argument(
        "--order", default="vocable,pipecat", help="which side runs first in each round"
    )
    parser.add_argument("--ttft-ms", type=float, default=200.0, help="scripted LLM (200)")
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="scripted LLM (50)")
    parser.add_argument(
        "--pipecat-python", type=Path, default=PIPECAT_PYTHON, help="the pipecat venv's python"
    )
    parser.add_argument(
        "--pipecat-log-level", default="INFO", help="the bot's log level (DEBUG: its metrics)"
    )
    parser.add_argument("--playbook", default=str(Path(__file__).parent / "playbook.yaml"))
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--name", default="pipecat-side-by-side", help="results folder name")
    return parser


@dataclass(frozen=True)
class Models:
    whisper: str
    piper: str


def _models() -> Models:
    """The files Vocable uses by default; both sides get exactly these."""
    from media.stt import default_whisper_model
    from media.tts import default_piper_voice

    return Models(default_whisper_model(), str(default_piper_voice()[0]))


async def _run(args: argparse.Namespace, command: str) -> Path:
    order = [side.strip() for side in args.order.split(",")]
    if sorted(order) != sorted(SIDES):
        raise SystemExit(f"--order must name {' and '.join(SIDES)}")
    if not args.pipecat_python.exists():
        raise SystemExit(
            f"{args.pipecat_python} not found: python3 -m venv .venv-pipecat && "
            ".venv-pipecat/bin/pip install -r benchmarks/pipecat/requirements.txt"
        )
    corpus = load_corpus()
    questions = [
        u
        for u in corpus.values()
        if u.kind in ("question", "long_question") and u.id != "piper_everything"
    ]
    script: list[Any] = list(itertools.islice(itertools.cycle(questions), args.questions))
    if args.corpus == "hesitation":
        script, args.barge_ins = list(load_hesitation()), 0
    models = _models()
    pacing = LLMPacing(args.ttft_ms, args.tokens_per_s)
    folder = _results_folder(args.output / args.name)

    started_at = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    sides: dict[str, list[Record]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side in order:
            print(f"round {round_ + 1}: {side}...", file=sys.stderr)
            sides[side].append(
                await _side(side, args, models, pacing, script, corpus, folder, round_)
            )

    run: Record = {
        "command": command,
        "started_at": started_at,
        "git_commit": git_commit(),
        "machine": machine(),
        "versions": _versions(args.pipecat_python),
        "settings": {
            "llm": f"scripted, first token {args.ttft_ms:g} ms, {args.tokens_per_s:g} tokens/s",
            "whisper_model": models.whisper,
            "piper_voice": models.piper,
            "questions": args.questions,
            "warmups": args.warmups,
            "barge_ins": args.barge_ins,
            "rounds": args.rounds,
            "order": order,
            "end_of_answer_s": END_OF_ANSWER_S,
            "silence_hold_ms": SILENCE_HOLD_MS,
        },
        "configuration": CONFIGURATION,
        "sides": sides,
    }
    if args.corpus in IMPAIRED_CORPORA:
        run["settings"]["vocable_args"] = list(VOCABLE_CLEANING[args.corpus])
        run["summary"] = {side: impaired_summary(args.corpus, sides[side]) for side in SIDES}
        (folder / "run.json").write_text(json.dumps(run, indent=1) + "\n")
        report = _impaired_report(run, args.corpus) + impaired_table(
            args.corpus, run["summary"], sides
        )
        (folder / "report.md").write_text(report)
        return folder
    run["summary"] = {side: summarize_side(sides[side]) for side in SIDES}
    if args.corpus == "hesitation":
        run["hesitation"] = {side: hesitation_summary(script, sides[side]) for side in SIDES}
    run["ratios"] = compute_ratios(run["summary"])
    (folder / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    report = to_markdown(run)
    if args.corpus == "hesitation":
        report += hesitation_table(run["hesitation"])
    (folder / "report.md").write_text(report)
    return folder


def _impaired_report(run: Record, corpus: str) -> str:
    return "\n".join(
        [
            f"# Vocable and pipecat: the {corpus} corpus",
            "",
            f"`{run['command']}` at {run['git_commit']}, {run['started_at']}, "
            f"on {run['machine'].get('cpu', '?')}",
            "",
            f"Settings: `{run['settings']}`",
            "",
            *(f"- {side}: {text}" for side, text in run["configuration"].items()),
            "",
        ]
    )


def hesitation_summary(lines: list[Any], sessions: list[Record]) -> Record:
    """Cut-ins (an answer heard before the caller's last voiced sample) at pauses up to 1.2 s,
    voice-to-voice after whole lines, and LLM requests of the comma-opened questions."""
    kinds = {line.id: (line.kind, line.pause_ms) for line in lines}
    turns = [t for s in sessions for t in s["turns"]]
    paused = [t for t in turns if kinds[t["utterance"]][0] != "comma"]
    early = [t for t in paused if "before the caller finished" in str(t.get("error", ""))]
    in_goal = [t for t in early if kinds[t["utterance"]][1] <= 1200]
    v2v = [t["v2v_ms"] for t in paused if t.get("ok")]
    commas = [t for t in turns if kinds[t["utterance"]][0] == "comma"]
    return {
        "paused_lines": len(paused),
        "cut_ins": len(early),
        "cut_ins_within_1200_ms": len(in_goal),
        "cut_in_lines": sorted({t["utterance"] for t in early}),
        "v2v_p50_ms": percentile(v2v, 50),
        "v2v_p95_ms": percentile(v2v, 95),
        "comma_questions": len(commas),
        "comma_llm_requests": sum(t.get("llm_requests") or 0 for t in commas),
    }


def hesitation_table(summary: dict[str, Record]) -> str:
    rows = ["", "## The hesitation corpus", "", "| | " + " | ".join(SIDES) + " |", "|---|---|---|"]
    for key in summary[SIDES[0]]:
        rows.append(f"| {key} | " + " | ".join(str(summary[side][key]) for side in SIDES) + " |")
    return "\n".join(rows) + "\n"


def _results_folder(folder: Path) -> Path:
    """The results folder, the servers' logs of an earlier run in it removed."""
    folder.mkdir(parents=True, exist_ok=True)
    for side in SIDES:
        (folder / f"{side}.log").unlink(missing_ok=True)
    return folder


CONFIGURATION = {
    "vocable": (
        "`vocable serve` with its defaults (WebRTC VAD, 400 ms end-of-turn silence, speculative "
        "Whisper at pauses, preemptive answers, pause-and-resume barge-in, Whisper beam 1 on 1 "
        "thread, Piper on every core alone and on one thread under load) and the harness's "
        "`benchmarks/playbook.yaml` (no greeting, no tools); "
        "`--stt-model` and `--tts-voice` given the files above; `--rate-limit 0`."
    ),
    "pipecat": (
        "`benchmarks/pipecat/bot.py`: pipecat 1.14.0's scaffold pipeline (`transport.input() -> "
        "WhisperSTTService -> user aggregator -> OpenAILLMService -> PiperTTSService -> "
        "transport.output() -> assistant aggregator`) over `SmallWebRTCTransport`; "
        "`SileroVADAnalyzer()` with default `VADParams` (confidence 0.7, start 0.2 s, stop 0.2 "
        "s, min volume 0.6) in `LLMUserAggregatorParams`; default `UserTurnStrategies()` (start: "
        "VAD or transcript; stop: the bundled Smart Turn v3.2, `LocalSmartTurnAnalyzerV3`, "
        "default params, 3 s silence fallback), interruptions on; `WhisperSTTService` given the "
        "same model folder, `device=cpu`, `compute_type=int8`, English, otherwise the service's "
        "own decoding (faster-whisper's defaults: beam 5, whole segment after the VAD stop); "
        "`PiperTTSService` given the same voice file; default transport and pipeline params "
        "(16 kHz in, 24 kHz out)."
    ),
}


async def _side(
    side: str,
    args: argparse.Namespace,
    models: Models,
    pacing: LLMPacing,
    script: list[Utterance],
    corpus: dict[str, Utterance],
    folder: Path,
    round_: int,
) -> Record:
    log_path = folder / f"{side}.log"
    audio_path = folder / f"{side}-heard-{round_ + 1}.wav" if args.save_audio else None
    llm = paced_llm(pacing)
    llm_url = await llm.start()
    if side == "vocable":
        server = ServerProcess(
            [
                "--playbook", args.playbook, "--llm-base-url", llm_url, "--llm-model", "bench",
                "--stt-model", models.whisper, "--tts-voice", models.piper, "--rate-limit", "0",
                *VOCABLE_CLEANING.get(args.corpus, ()),
            ],
            ROOT,
            log_path,
        )  # fmt: skip
    else:
        server = ServerProcess(
            [
                "--llm-base-url", llm_url, "--llm-model", "bench",
                "--whisper-model", models.whisper, "--piper-voice", models.piper,
                "--log-level", args.pipecat_log_level,
            ],
            ROOT,
            log_path,
            command=[str(args.pipecat_python), str(BOT)],
        )  # fmt: skip
    try:
        url = await server.start(free_port())
        if args.corpus in IMPAIRED_CORPORA:
            questions = [u for u in corpus.values() if u.kind == "question"]
            ask = corpus["piper_everything"]
            return await impaired_side(args.corpus, url, llm, ask, speech_level(questions))
        return await _call(
            server, url, llm, script, corpus, args.warmups, args.barge_ins, audio_path
        )
    finally:
        await server.stop()
        await llm.close()


async def _call(
    server: ServerProcess,
    url: str,
    llm: Any,
    script: list[Utterance],
    corpus: dict[str, Utterance],
    warmups: int,
    barge_ins: int,
    audio_path: Path | None,
) -> Record:
    """One call: settle, the warm-up questions, the questions, the barge-ins; with the server's
    CPU and memory over the measured part."""
    assert server.process is not None
    group = server.process.pid  # its own session and process group (start_new_session)
    ready = group_sample(group)
    peak = ready.rss_bytes

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, group_sample(group).rss_bytes)
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    caller = WebRTCCaller()
    turns: list[Record] = []
    barges: list[Record] = []
    firsts: list[Record] = []
    try:
        await caller.connect(url)
        await settle(caller)
        for utterance in itertools.islice(itertools.cycle(script), warmups):
            firsts.append({**await question(caller, utterance, llm), "kind": "warmup"})
            print(f"  warm-up: {_line(firsts[-1])}", file=sys.stderr)
            await asyncio.sleep(1.0)
        before, started = group_sample(group), time.monotonic()
        for utterance in script:
            turns.append(await question(caller, utterance, llm))
            print(f"  {_line(turns[-1])}", file=sys.stderr)
            await asyncio.sleep(1.0)
        for _ in range(barge_ins):
            barges.append(
                await barge_in(caller, corpus["piper_everything"], corpus["piper_stop"], llm)
            )
            print(f"  {_line(barges[-1])}", file=sys.stderr)
            await asyncio.sleep(1.0)
        after, wall_s = group_sample(group), time.monotonic() - started
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await caller.close()
        if audio_path is not None:
            _write_wav(audio_path, bytes(caller.heard))
    return {
        "warmups": firsts,
        "turns": turns,
        "barge_ins": barges,
        "usage": {
            "cpu_s": round(after.cpu_s - before.cpu_s, 2),
            "wall_s": round(wall_s, 2),
            "rss_mb_ready": round(ready.rss_bytes / 2**20, 1),
            "rss_mb_peak": round(peak / 2**20, 1),
        },
    }


def _write_wav(path: Path, pcm16k: bytes) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(pcm16k)


def _line(record: Record) -> str:
    if not record.get("ok"):
        return f"{record['kind']} {record['utterance']}: failed ({record.get('error')})"
    if record["kind"] in ("question", "warmup"):
        return f"question {record['utterance']}: {record['v2v_ms']:.0f} ms"
    return f"barge-in: silent after {record['silence_ms']:.0f} ms"


# -- the scenarios, from audio alone ---------------------------------------------------------------


async def question(caller: WebRTCCaller, utterance: Utterance, llm: Any) -> Record:
    """Ask one question; voice-to-voice = the caller's last voiced sample leaving -> the agent's
    first audible sample arriving. Waits for the answer to end (``END_OF_ANSWER_S`` of silence)."""
    record: Record = {"kind": "question", "utterance": utterance.id}
    requests_before = len(streamed_requests(llm))
    spoken = caller.say(utterance.pcm())
    try:
        first_voiced = await spoken.first_voiced_sent_at()
        last_voiced = await spoken.last_voiced_sent_at()
    except TimeoutError:
        return {**record, "ok": False, "error": "the caller's microphone stalled"}
    await asyncio.sleep(max(0.0, last_voiced - time.monotonic()))
    early = heard_between(caller.frames, first_voiced, last_voiced)
    first = await wait_first_sound(caller, last_voiced, ANSWER_TIMEOUT_S)
    if first is None:
        state = caller.pc.connectionState
        return {**record, "ok": False, "error": f"no answer heard (connection {state})"}
    end = await wait_quiet(caller, first, END_OF_ANSWER_S, 60.0)
    record |= _llm_facts(llm, requests_before)
    if early is not None:
        # the agent spoke before the caller finished (it took a pause for the end of the
        # turn): no voice-to-voice figure for this turn
        audible = [f for f in caller.frames if early <= f.at <= last_voiced]
        return {
            **record,
            "ok": False,
            "error": f"answered {(last_voiced - early) * 1000:.0f} ms before the caller finished",
            "audible_while_caller_spoke_ms": FRAME_S
            * 1000
            * sum(f.dbfs > SILENCE_DBFS for f in audible),
        }
    if end is None:
        return {**record, "ok": False, "error": "the answer did not end"}
    return {
        **record,
        "ok": True,
        "v2v_ms": round((first - last_voiced) * 1000, 1),
        "answer_ms": round((end - first) * 1000 + FRAME_S * 1000, 1),
        "longest_gap_ms": longest_gap_ms(caller.frames, first, end),
    }


async def barge_in(caller: WebRTCCaller, ask: Utterance, interrupt: Utterance, llm: Any) -> Record:
    """Ask for a long answer, talk over it 1.2 s in, and time how fast the agent falls silent.

    It succeeds if the agent fell silent (``SILENCE_HOLD_MS`` held) and stayed silent until the
    caller finished the interruption; the interruption's own answer then ends the scenario.
    """
    record: Record = {"kind": "barge_in", "utterance": interrupt.id}
    spoken = caller.say(ask.pcm())
    try:
        last_voiced = await spoken.last_voiced_sent_at()
    except TimeoutError:
        return {**record, "ok": False, "error": "the caller's microphone stalled"}
    await asyncio.sleep(max(0.0, last_voiced - time.monotonic()))
    answering = await wait_first_sound(caller, last_voiced, ANSWER_TIMEOUT_S)
    if answering is None:
        return {**record, "ok": False, "error": "the agent never started its long answer"}
    await asyncio.sleep(max(0.0, answering + 1.2 - time.monotonic()))
    over = caller.say(interrupt.pcm())
    try:
        started = await over.first_voiced_sent_at()
        ended = await over.last_voiced_sent_at()
    except TimeoutError:
        return {**record, "ok": False, "error": "the caller's microphone stalled"}
    await asyncio.sleep(max(0.0, max(started + 2.0, ended) - time.monotonic()))
    silent_at = caller.silent_from(started, SILENCE_HOLD_MS)
    resumed = None if silent_at is None else heard_between(caller.frames, silent_at, ended)
    answer = await wait_first_sound(caller, ended, ANSWER_TIMEOUT_S)
    if answer is not None:
        await wait_quiet(caller, answer, END_OF_ANSWER_S, 60.0)
    if silent_at is None or resumed is not None:
        return {**record, "ok": False, "error": "the agent did not stop talking"}
    if answer is None:
        return {**record, "ok": False, "error": "the interrupting question was not answered"}
    return {**record, "ok": True, "silence_ms": round((silent_at - started) * 1000, 1)}


def _llm_facts(llm: Any, before: int) -> Record:
    """The streamed LLM requests of this turn and the transcript the last one answered."""
    requests = streamed_requests(llm)[before:]
    if not requests:
        return {"llm_requests": 0, "transcript": None}
    user = [m for m in requests[-1]["messages"] if m.get("role") == "user"]
    content = user[-1]["content"] if user else ""
    if isinstance(content, list):  # content parts
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return {"llm_requests": len(requests), "transcript": str(content).strip()}


# -- the servers' CPU and memory, every process of their group ----------------------------------


def group_sample(pgid: int) -> ProcessSample:
    """CPU seconds and RSS summed over every live process of the process group ``pgid`` (a
    server and any worker it started)."""
    cpu_s, rss = 0.0, 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            cpu_s += (int(fields[11]) + int(fields[12])) / _TICKS
            rss += int((entry / "statm").read_text().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
    return ProcessSample(cpu_s, rss)


def _versions(pipecat_python: Path) -> dict[str, str]:
    def ours(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "?"

    probe = (
        "import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
        "('pipecat-ai', 'faster-whisper', 'ctranslate2', 'piper-tts', 'onnxruntime', "
        "'aiortc')}))"
    )
    try:
        theirs = json.loads(
            subprocess.run(
                [str(pipecat_python), "-c", probe], capture_output=True, text=True, check=True
            ).stdout
        )
    except (OSError, subprocess.CalledProcessError, json.JSONDecodeError):
        theirs = {}
    return {
        "vocable": git_commit(),
        "pipecat-ai": theirs.get("pipecat-ai", "?"),
        "faster-whisper (Vocable / pipecat)": f"{ours('faster-whisper')} / "
        f"{theirs.get('faster-whisper', '?')}",
        "ctranslate2": f"{ours('ctranslate2')} / {theirs.get('ctranslate2', '?')}",
        "piper-tts": f"{ours('piper-tts')} / {theirs.get('piper-tts', '?')}",
        "onnxruntime": f"{ours('onnxruntime')} / {theirs.get('onnxruntime', '?')}",
        "aiortc": f"{ours('aiortc')} / {theirs.get('aiortc', '?')}",
    }


if __name__ == "__main__":
    sys.exit(main())
