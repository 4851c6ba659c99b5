"""``python -m benchmarks`` (from a source checkout): the voice-to-voice latency harness.

It starts a paced scripted LLM and ``vocable serve`` in a child process (or targets ``--url`` and
``--llm-base-url``), drives real aiortc callers through the corpus, and writes ``run.json``,
``report.md`` and PNG plots under ``benchmarks/results/NAME/``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, get_args

from tqdm import tqdm

from server.testkit.caller import Listener
from server.testkit.impairments import NOISE_KINDS
from server.testkit.scripted_llm import ScriptedLLM

from .browser_calls import browser_level, browser_markdown, percentiles, summarize_browser
from .corpus import Utterance, load_corpus
from .echo_calls import ECHO_PATHS, echo_call, echo_markdown, summarize_echo
from .hesitant_calls import hesitant_line, hesitation_markdown, summarize_hesitation
from .hesitation import load_hesitation
from .llm import SHORT_ANSWER, LLMPacing, paced_llm
from .models import model_path
from .noisy_calls import (
    SNRS_DB,
    noise_alone,
    noisy_markdown,
    noisy_question,
    speech_level,
    summarize_noisy,
    talked_over,
)
from .provenance import git_commit, machine
from .report import plot, summarize, to_markdown
from .scenarios import ARRIVAL_S, BenchTarget, backchannel, barge_in, concurrency_level, new_caller
from .server_process import ServerProcess, free_port

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
QUICK_ANSWER = "It left. It arrives Friday."
"""``--quick``'s scripted answer: two sentences, as the default's, in 2 s of speech, not 4 (every
turn waits for the whole answer)."""
QUICK_ARRIVAL_S = 1.0
"""``--quick``: the callers of a level arrive spread over this (2 calls: 0.5 s apart; their turns
still overlap in part)."""
GAP_S = 1.0
"""A caller's pause after an answer before its next question."""
QUICK_GAP_S = 0.25
"""``--quick``'s pause after an answer."""


def main(argv: Sequence[str] | None = None) -> int:
    return run_harness("python -m benchmarks", _run, _parser().parse_args(argv), argv)


def run_harness(
    prog: str,
    run: Callable[[argparse.Namespace, str], Coroutine[Any, Any, Path]],
    args: argparse.Namespace,
    argv: Sequence[str] | None,
) -> int:
    """Run a harness command (``run(args, command)`` returns its results folder), then print
    where the results are and the report; 130 on Ctrl-C."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = f"{prog} " + shlex.join(argv if argv is not None else sys.argv[1:])
    try:
        folder = asyncio.run(run(args, command.strip()))
    except KeyboardInterrupt:
        return 130
    print(f"results: {folder}")
    print((folder / "report.md").read_text())
    return 0


def _delay_range(text: str) -> tuple[float, float]:
    """``LOW,HIGH`` in ms, 0 <= LOW <= HIGH <= 1000 (``--jitter-ms``)."""
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW,HIGH in ms") from None
    if not 0 <= low <= high <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= LOW <= HIGH <= 1000")
    return low, high


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--url", help="a running Vocable server (default: start one)")
    parser.add_argument(
        "--corpus",
        choices=["questions", "hesitation", "noisy", "echo"],
        default="questions",
        help="'questions': the latency sweep, barge-ins and backchannels (default); "
        "'hesitation': one call says the hesitation corpus (pauses mid-sentence, "
        "comma-opened questions) --passes times: cut-ins, voice-to-voice, wasted LLM requests; "
        "'noisy': one call asks questions over babble, street and car noise at 20, 10 and 5 dB "
        "SNR, and makes noise alone over long answers: word error rate, lost turns, false "
        "barge-ins (give --server-arg=--noise-suppression --server-arg=all to clean a WebRTC "
        "line as a phone line is); 'echo': a call per echo path (40-250 ms, 6-20 dB) whose "
        "caller's microphone returns the agent's voice: self-interruptions, barge-in over the "
        "echo, the agent's words in the caller's transcript (--server-arg=--echo-cancellation "
        "--server-arg=all)",
    )
    parser.add_argument("--passes", type=int, default=2, help="hesitation: passes (2)")
    parser.add_argument("--token", help="bearer token for --url")
    parser.add_argument("--llm-base-url", help="a real LLM (default: a paced scripted one)")
    parser.add_argument(
        "--llm",
        choices=["scripted", "local"],
        default="scripted",
        help="'local': the server runs its model in process (llama.cpp; --llm-gguf, else the "
        "default model) instead of the paced scripted LLM",
    )
    parser.add_argument(
        "--llm-gguf",
        help="with --llm local: the GGUF model file to run, or a name of benchmarks.models "
        "(qwen2.5-coder-0.5b, smollm2-135m: fetched and checked by hash)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the server it starts, repeatable "
        "(e.g. --server-arg=--overload-capacity-cpu-percent --server-arg=0)",
    )
    parser.add_argument("--llm-model", default="bench")
    parser.add_argument("--llm-api-key")
    parser.add_argument("--ttft-ms", type=float, default=200.0, help="scripted LLM (default 200)")
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="scripted LLM (50)")
    parser.add_argument("--sweep", default="1,2,4,8,16", help="simultaneous calls per level")
    parser.add_argument("--turns", type=int, default=5, help="questions per call per level")
    parser.add_argument(
        "--arrival-s",
        type=float,
        default=ARRIVAL_S,
        help=f"a level's callers arrive evenly over this long ({ARRIVAL_S:.0f} s: a burst; "
        "longer: calls come and go while admission measures the load)",
    )
    parser.add_argument(
        "--arrival-every-s",
        type=float,
        help="instead of --arrival-s: a caller arrives this often, at every level (0.25: 24 "
        "callers over 6 s, then 40 over 10 s on the same server)",
    )
    parser.add_argument("--barge-ins", type=int, default=8, help="barge-in tries")
    parser.add_argument("--backchannels", type=int, default=4, help="tries per short sound")
    parser.add_argument("--end-silence-ms", type=int, default=400)
    parser.add_argument(
        "--listener",
        default="arrival",
        choices=[*get_args(Listener), "both"],
        help="when the callers count the agent's audio as heard: 'arrival' (decoded, the "
        "default), 'stock' (aiortc's receiver as shipped, played by a 20 ms playout clock as a "
        "stock client hears it) or 'both' (each level twice back to back, arrival first; "
        "barge-ins and backchannels with the first)",
    )
    parser.add_argument(
        "--client",
        default="aiortc",
        choices=["aiortc", "chromium", "firefox"],
        help="who calls: the harness's aiortc callers (default), or headless Chromium (or "
        "Firefox: apt-get install firefox-esr pulseaudio) pages running the web client, timed "
        "by the page itself (each level runs the aiortc callers first, back to back, for the "
        "on-arrival figure; no barge-ins, no micro)",
    )
    parser.add_argument(
        "--browser-processing",
        action="store_true",
        help="--client chromium: the pages keep Chromium's echo cancellation, noise "
        "suppression and gain control on, as real users have them (default: off, ?raw=1)",
    )
    parser.add_argument(
        "--jitter-ms",
        type=_delay_range,
        default=None,
        metavar="LOW,HIGH",
        help="--client chromium: the pages' media pass through relays that delay every "
        "datagram, both ways, by LOW to HIGH ms (drawn uniformly, kept in order), as "
        "'tc qdisc ... netem delay 30ms 10ms' would on a machine that has netem",
    )
    parser.add_argument(
        "--barge-in",
        default="pause_resume",
        choices=["immediate", "confirmed", "pause_resume", "disabled"],
        help="the server's barge-in policy (pause_resume)",
    )
    parser.add_argument(
        "--no-speculation", action="store_true", help="the server transcribes only after the turn"
    )
    parser.add_argument(
        "--speculation-pause-ms",
        type=int,
        help="the server's speculation pause (default: the server's own)",
    )
    parser.add_argument(
        "--preempt-lead-ms",
        type=int,
        help="the server's preemptive-answer lead (default: the server's own)",
    )
    parser.add_argument("--playbook", default=str(Path(__file__).parent / "playbook.yaml"))
    parser.add_argument("--no-micro", action="store_true", help="skip component benchmarks")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 1 and 2 calls, 2 turns, 1 of each, a shorter answer and pauses",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--name", help="results folder name (default: a timestamp)")
    return parser


async def _run(args: argparse.Namespace, command: str) -> Path:
    answer = SHORT_ANSWER
    if args.quick:
        args.sweep, args.turns, args.barge_ins, args.backchannels = "1,2", 2, 1, 1
        args.arrival_s, answer = QUICK_ARRIVAL_S, QUICK_ANSWER
    levels = [int(n) for n in args.sweep.split(",")]
    listeners = listeners_of(args.listener)
    corpus = load_corpus()
    questions = [u for u in corpus.values() if u.kind in ("question", "long_question")]
    questions = [u for u in questions if u.id != "piper_everything"]
    started_at = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    folder = args.output / (args.name or time.strftime("%Y%m%d-%H%M%S"))
    folder.mkdir(parents=True, exist_ok=True)

    if args.llm_gguf:
        args.llm = "local"
    scripted = not args.llm_base_url and args.llm == "scripted"
    pacing = LLMPacing(args.ttft_ms, args.tokens_per_s)
    llm = paced_llm(pacing, answer) if scripted else None
    server: ServerProcess | None = None
    try:
        llm_url = await llm.start() if llm is not None else args.llm_base_url
        if args.url:
            base_url = args.url.rstrip("/")
        else:
            if llm_url:
                llm_args = ["--llm-base-url", llm_url, "--llm-model", args.llm_model]
            else:
                gguf = ["--llm-gguf", str(model_path(args.llm_gguf))] if args.llm_gguf else []
                llm_args = ["--llm", "local", *gguf]
            server_args = [
                "--playbook", args.playbook, *llm_args, "--max-sessions", str(max(levels) + 2),
                "--end-silence-ms", str(args.end_silence_ms), "--idle-timeout-s", "900",
                "--barge-in", args.barge_in,
                "--rate-limit", "0",  # every caller is 127.0.0.1 here
            ]  # fmt: skip
            if args.no_speculation:
                server_args.append("--no-speculation")
            if args.speculation_pause_ms is not None:
                server_args += ["--speculation-pause-ms", str(args.speculation_pause_ms)]
            if args.preempt_lead_ms is not None:
                server_args += ["--preempt-lead-ms", str(args.preempt_lead_ms)]
            if args.llm_api_key:
                server_args += ["--llm-api-key", args.llm_api_key]
            server_args += args.server_arg
            server = ServerProcess(server_args, ROOT, folder / "server.log")
            print("starting vocable serve (loading models)...", file=sys.stderr)
            base_url = await server.start(free_port())
        target = BenchTarget(
            base_url=base_url,
            playbook="bench" if not args.url else None,
            end_silence_ms=args.end_silence_ms,
            llm_first_sentence_ms=pacing.first_sentence_ms(answer) if scripted else None,
            token=args.token,
        )
        if args.client in ("chromium", "firefox"):
            results: dict[str, Any] = await _browsers(args, target, levels, questions, server)
        elif args.corpus == "hesitation":
            results = {"lines": await _hesitation(args, target, llm)}
        elif args.corpus == "noisy":
            results = {"records": await _noisy(args, target, questions, corpus)}
        elif args.corpus == "echo":
            ask, interrupt = corpus["piper_everything"], corpus["piper_stop"]
            records = []
            for path in tqdm(ECHO_PATHS, unit="call", file=sys.stderr):
                records.append(await echo_call(target, path, ask, interrupt))
            results = {"records": records}
        else:
            total = sum(n * args.turns for n in levels) * len(listeners)
            total += args.barge_ins + 2 * args.backchannels
            with tqdm(total=total, unit="turn", desc="benchmark", file=sys.stderr) as bar:
                results = await _scenarios(
                    args, target, levels, listeners, questions, corpus, server, bar
                )
        results["server_counters"] = await _server_counters(base_url, args.token)
    finally:
        if server is not None:
            await server.stop()
        if llm is not None:
            await llm.close()

    if args.client in ("chromium", "firefox"):
        return _write_browsers(folder, command, started_at, args, scripted, levels, results)
    if args.corpus != "questions":
        return _write_corpus(folder, command, started_at, args, scripted, results)
    if not args.no_micro:
        results["micro"] = await asyncio.to_thread(_micro, args.quick)
    run = {
        **_provenance(command, started_at),
        "settings": {
            "llm": _llm_setting(args, scripted),
            "stt_model": "tiny.en int8 (default)",
            "tts_voice": "en_US-joe-medium (default)",
            "end_silence_ms": args.end_silence_ms,
            "barge_in": args.barge_in,
            "speculation": not args.no_speculation,
            "speculation_pause_ms": args.speculation_pause_ms,
            "preempt_lead_ms": args.preempt_lead_ms,
            "sweep": levels,
            "listeners": listeners,
            "turns_per_call": args.turns,
            "barge_in_repeats": args.barge_ins,
            "backchannel_repeats": args.backchannels,
            "server": args.url or "started by the harness",
        },
        **results,
    }
    summary = summarize(run)
    run["summary"] = summary
    (folder / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    (folder / "report.md").write_text(to_markdown(run, summary))
    plot(run, summary, folder)
    return Path(folder)


async def _scenarios(
    args: argparse.Namespace,
    target: BenchTarget,
    levels: list[int],
    listeners: list[Listener],
    questions: list[Any],
    corpus: dict[str, Any],
    server: ServerProcess | None,
    bar: Any,
) -> dict[str, Any]:
    """Each level with each listener in turn (back to back), the barge-ins and backchannels
    after the first level, with the first listener."""
    results: dict[str, Any] = {"levels": [], "barge_in": [], "backchannel": []}

    async def level(calls: int) -> None:
        for listener in listeners:
            await level_with(calls, dataclasses.replace(target, listener=listener))

    async def level_with(calls: int, target: BenchTarget) -> None:
        bar.set_postfix_str(f"{calls} call(s), {target.listener}")
        record = await concurrency_level(
            target,
            calls,
            args.turns,
            questions,
            server,
            on_turn=bar.update,
            gap_s=QUICK_GAP_S if args.quick else GAP_S,
            arrival_s=args.arrival_s
            if args.arrival_every_s is None
            else calls * args.arrival_every_s,
        )
        results["levels"].append(record)

    await level(levels[0])  # one call first: the quietest machine for the baseline
    caller = await new_caller(dataclasses.replace(target, listener=listeners[0]))
    try:
        await asyncio.sleep(0.5)
        bar.set_postfix_str("barge-in")
        for n in range(args.barge_ins):
            if n:
                await asyncio.sleep(1.0)  # the agent quiet a while before the next try
            results["barge_in"].append(
                await barge_in(caller, corpus["piper_everything"], corpus["piper_stop"], target)
            )
            bar.update()
    finally:
        await caller.close()
    bar.set_postfix_str("backchannels")
    first = dataclasses.replace(target, listener=listeners[0])
    for _ in range(args.backchannels):
        for noise in ("synthetic_cough", "piper_mhm"):
            results["backchannel"].append(
                await backchannel(first, corpus["piper_everything"], corpus[noise])
            )
            bar.update()
    for calls in levels[1:]:
        await level(calls)
    return results


async def _browsers(
    args: argparse.Namespace,
    target: BenchTarget,
    levels: list[int],
    questions: list[Utterance],
    server: ServerProcess | None,
) -> dict[str, Any]:
    """Each level twice, back to back: the aiortc callers (on arrival), then Chromium pages."""
    results: dict[str, Any] = {"levels": [], "arrival_levels": []}
    for calls in levels:
        print(f"{calls} call(s): aiortc callers, on arrival...", file=sys.stderr)
        arrival = dataclasses.replace(target, listener="arrival")
        results["arrival_levels"].append(
            await concurrency_level(arrival, calls, args.turns, questions, server)
        )
        print(f"{calls} call(s): {args.client} pages...", file=sys.stderr)
        results["levels"].append(
            await browser_level(
                target.base_url,
                target.playbook,
                calls,
                args.turns,
                questions,
                processing=args.browser_processing,
                jitter_ms=args.jitter_ms,
                client=args.client,
            )
        )
    return results


def _write_browsers(
    folder: Path,
    command: str,
    started_at: str,
    args: argparse.Namespace,
    scripted: bool,
    levels: list[int],
    results: dict[str, Any],
) -> Path:
    """run.json and report.md of a ``--client chromium`` run."""
    summary = []
    for level, arrival in zip(results["levels"], results["arrival_levels"], strict=True):
        on_arrival = [t["client_v2v_ms"] for t in arrival["turns"] if t.get("client_v2v_ms")]
        summary.append({**summarize_browser(level), "on_arrival_ms": percentiles(on_arrival)})
    run = {
        **_provenance(command, started_at),
        "settings": {
            "llm": _llm_setting(args, scripted),
            "client": "chromium (headless, fake microphone)"
            if args.client == "chromium"
            else "firefox (headless, PulseAudio null sinks, the microphone a looped file)",
            "browser_audio_processing": args.browser_processing,
            "jitter_ms": list(args.jitter_ms) if args.jitter_ms else None,
            "sweep": levels,
            "turns_per_call": args.turns,
            "server_args": args.server_arg,
            "server": args.url or "started by the harness",
        },
        **results,
        "summary": summary,
    }
    (folder / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    (folder / "report.md").write_text(browser_markdown(run))
    return folder


async def _hesitation(
    args: argparse.Namespace, target: BenchTarget, llm: ScriptedLLM | None
) -> list[dict[str, Any]]:
    """One call says the hesitation corpus ``--passes`` times, a line at a time."""
    lines = load_hesitation()
    records = []
    caller = await new_caller(target)
    try:
        await asyncio.sleep(0.5)
        with tqdm(total=len(lines) * args.passes, unit="line", file=sys.stderr) as bar:
            for number in range(args.passes):
                for line in lines:
                    record = await hesitant_line(caller, line, llm)
                    records.append({**record, "pass": number})
                    bar.update()
    finally:
        await caller.close()
    return records


async def _noisy(
    args: argparse.Namespace,
    target: BenchTarget,
    questions: list[Utterance],
    corpus: dict[str, Utterance],
) -> list[dict[str, Any]]:
    """One call: the questions clean, then over each noise at each level (``--passes``
    questions per level), each level with noise alone over a long answer."""
    records: list[dict[str, Any]] = []
    asked = questions[: max(1, args.passes)]
    speech_dbfs = speech_level(questions)
    caller = await new_caller(target)
    total = len(questions) + len(NOISE_KINDS) * len(SNRS_DB) * (len(asked) + 2)
    try:
        await asyncio.sleep(0.5)
        with tqdm(total=total, unit="test", file=sys.stderr) as bar:
            for question in questions:
                records.append(await noisy_question(caller, question, None, None))
                bar.update()
            for kind in NOISE_KINDS:
                for snr in SNRS_DB:
                    for question in asked:
                        records.append(await noisy_question(caller, question, kind, snr))
                        bar.update()
                    ask = corpus["piper_everything"]
                    records.append(await noise_alone(caller, ask, kind, snr, speech_dbfs))
                    bar.update()
                    interrupt = corpus["piper_stop"]
                    records.append(await talked_over(caller, ask, interrupt, kind, snr))
                    bar.update()
    finally:
        await caller.close()
    return records


def _write_corpus(
    folder: Path,
    command: str,
    started_at: str,
    args: argparse.Namespace,
    scripted: bool,
    results: dict[str, Any],
) -> Path:
    """run.json and report.md of a ``--corpus`` run other than the questions."""
    run = {
        **_provenance(command, started_at),
        "settings": {
            "llm": _llm_setting(args, scripted),
            "corpus": args.corpus,
            "passes": args.passes,
            "server_args": args.server_arg,
            "server": args.url or "started by the harness",
        },
        **results,
    }
    if args.corpus == "hesitation":
        run["summary"] = summarize_hesitation(run["lines"])
        report = hesitation_markdown(run)
    elif args.corpus == "echo":
        run["summary"] = summarize_echo(run["records"])
        report = echo_markdown(run)
    else:
        run["summary"] = summarize_noisy(run["records"])
        report = noisy_markdown(run)
    (folder / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    (folder / "report.md").write_text(report)
    return folder


def _provenance(command: str, started_at: str) -> dict[str, Any]:
    """What every run.json starts with: how it was made, when, at which commit, on what."""
    return {
        "command": command,
        "started_at": started_at,
        "git_commit": git_commit(),
        "machine": machine(),
    }


def listeners_of(choice: str) -> list[Listener]:
    """The listeners a ``--listener`` choice runs, in order: ``both`` is arrival, then stock;
    ValueError for anything else."""
    runs: dict[str, list[Listener]] = {
        "arrival": ["arrival"],
        "stock": ["stock"],
        "both": ["arrival", "stock"],
    }
    if choice not in runs:
        raise ValueError(f"unknown listener {choice!r}")
    return runs[choice]


def _llm_setting(args: argparse.Namespace, scripted: bool) -> str:
    if scripted:
        quick = f", answering {QUICK_ANSWER!r} (--quick)" if args.quick else ""
        return f"scripted, first token {args.ttft_ms:g} ms, {args.tokens_per_s:g} tokens/s{quick}"
    if args.llm_base_url:
        return f"{args.llm_base_url} ({args.llm_model})"
    return f"in process (llama.cpp): {args.llm_gguf or 'the default model'}"


async def _server_counters(base_url: str, token: str | None) -> dict[str, float]:
    """Vocable's own counters from its /metrics: speculative transcriptions used and wasted,
    resumes, barge-ins, turns; and an embedded model's tokens and the seconds they took."""
    import aiohttp

    wanted = ("vocable_speculative_transcriptions_total", "vocable_resumes_total",
              "vocable_barge_ins_total", "vocable_turns_total",
              "llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total",
              "llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_total",
              "llamacpp:tokens_predicted_seconds_total")  # fmt: skip
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{base_url}/metrics", headers=headers) as response,
        ):
            text = await response.text()
    except aiohttp.ClientError:
        return {}
    counters: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(wanted):
            counters[_counter_name(name)] = float(value)
    return counters


def _counter_name(sample: str) -> str:
    """``vocable_x_total{outcome="used"}`` -> ``x_used``."""
    name, _, labels = sample.removeprefix("vocable_").partition("{")
    name = name.removesuffix("_total")
    for label in labels.rstrip("}").split(","):
        if "=" in label:
            name += "_" + label.split("=", 1)[1].strip('"')
    return name


def _micro(quick: bool) -> dict[str, Any]:
    from media import Synthesizer, Transcriber

    from .micro import MicroSettings, run_micro

    settings = (
        MicroSettings(
            repeats=2,
            stt_lengths_s=(1.0, 3.0),
            tts_sentences=MicroSettings().tts_sentences[:2],  # the ~30-word one takes ~1.5 s
            vad_frames=500,
            chunker_repeats=20,
        )
        if quick
        else MicroSettings()
    )
    print("component benchmarks (loading models)...", file=sys.stderr)
    return run_micro(
        settings,
        Transcriber.load(),
        Synthesizer.load(),
        progress=lambda message: print(f"  {message}", file=sys.stderr),
    )
