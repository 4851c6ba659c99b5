"""Summaries, the Markdown report and the PNG plots of a benchmark run."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["GOALS", "LISTENERS", "listeners", "percentile", "plot", "summarize", "to_markdown"]

STAGES = (
    ("end_of_speech_ms", "end of speech"),
    ("stt_ms", "STT"),
    ("llm_first_token_ms", "LLM first token"),
    ("first_sentence_ms", "first sentence"),
    ("tts_first_audio_ms", "TTS first audio"),
    ("first_frame_out_ms", "first frame out"),
    ("voice_to_voice_ms", "server voice-to-voice"),
)

GOALS = {
    "v2v_p50_1_call_ms": 800.0,
    "v2v_p95_1_call_ms": 1300.0,
    "barge_in_p95_ms": 250.0,
    "false_cuts_cough": 0.0,
    "false_cuts_backchannel": 0.0,
    "v2v_p95_8_calls_ms": 1500.0,
    "wasted_preemptions_per_turn": 0.10,
}
"""The project's current targets (the turn-taking issue's, where it tightened the first ones)."""

LISTENERS = {
    "arrival": "on arrival (each frame when it came out of the caller's receiver, decoded)",
    "stock": "as a stock client hears it (aiortc's receiver as shipped, then a 20 ms playout "
    "clock: each frame when it was played)",
}
"""What each listener's voice-to-voice times (``--listener``; a run without one: arrival)."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "n": float(len(values)),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def listeners(run: dict[str, Any]) -> list[str]:
    """The run's listeners in the order it ran them (a run from before them: arrival)."""
    return list(run.get("settings", {}).get("listeners") or ["arrival"])


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Percentiles per concurrency level (and listener) and stage, barge-in and false-cut
    counts, goals (measured with the run's first listener)."""
    levels = []
    for level in run["levels"]:
        ok = [t for t in level["turns"] if t.get("ok")]
        refused = [t for t in level["turns"] if t.get("refused")]
        stages = {
            key: _stats([t["server"][key] for t in ok if t["server"].get(key) is not None])
            for key, _ in STAGES
        }
        levels.append(
            {
                "calls": level["calls"],
                "listener": level.get("listener", "arrival"),
                "turns": len(level["turns"]),
                "failed": len(level["turns"]) - len(ok) - len(refused),
                "refused_calls": len({t["call"] for t in refused}),
                "client_v2v_ms": _stats([t["client_v2v_ms"] for t in ok]),
                "floor_ms": _stats([t["floor_ms"] for t in ok]),
                "overhead_ms": _stats([t["overhead_ms"] for t in ok]),
                "longest_pause_ms": _stats(
                    [t["longest_pause_ms"] for t in ok if t.get("longest_pause_ms") is not None]
                ),
                "speaker_dry_ms": _stats(
                    [t["speaker_dry_ms"] for t in ok if t.get("speaker_dry_ms") is not None]
                ),
                "server": stages,
                "server_cpu_percent": level.get("server_cpu_percent"),
                "server_rss_mb_peak": level.get("server_rss_mb_peak"),
                **_playout_stats(ok),
            }
        )
    barge = [r["silence_ms"] for r in run["barge_in"] if r.get("ok")]
    cuts: dict[str, int] = {}
    resumes: dict[str, int] = {}
    for record in run["backchannel"]:
        cuts[record["utterance"]] = cuts.get(record["utterance"], 0) + bool(record.get("false_cut"))
        resumes[record["utterance"]] = resumes.get(record["utterance"], 0) + bool(
            record.get("resumed")
        )
    counters = run.get("server_counters", {})
    turns = counters.get("turns")
    wasted_per_turn = (
        counters.get("speculative_transcriptions_preempted_wasted", 0.0) / turns if turns else None
    )
    primary = listeners(run)[0]
    by_calls = {level["calls"]: level for level in levels if level["listener"] == primary}
    one, eight = by_calls.get(1), by_calls.get(8)
    measured = {
        "v2v_p50_1_call_ms": one["client_v2v_ms"]["p50"] if one else None,
        "v2v_p95_1_call_ms": one["client_v2v_ms"]["p95"] if one else None,
        "barge_in_p95_ms": percentile(barge, 95),
        "false_cuts_cough": float(cuts.get("synthetic_cough", 0)),
        "false_cuts_backchannel": float(cuts.get("piper_mhm", 0)),
        "v2v_p95_8_calls_ms": eight["client_v2v_ms"]["p95"] if eight else None,
        "wasted_preemptions_per_turn": wasted_per_turn,
    }
    return {
        "levels": levels,
        "barge_in_ms": _stats(barge),
        "barge_in_failed": sum(1 for r in run["barge_in"] if not r.get("ok")),
        "false_cuts": cuts,
        "resumes": resumes,
        "server_counters": run.get("server_counters", {}),
        "llm_throughput": llm_throughput(counters),
        "goals": {name: {"goal": goal, "measured": measured[name]} for name, goal in GOALS.items()},
        "goals_listener": primary,
    }


def _playout_stats(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The stock listener's split of its turns' voice-to-voice (``scenarios.playout_split``):
    percentiles of each part and the playout's underruns; empty for other listeners."""
    split = [t for t in turns if t.get("received_v2v_ms") is not None]
    if not split:
        return {}
    return {
        "received_v2v_ms": _stats([t["received_v2v_ms"] for t in split]),
        "jitter_buffer_ms": _stats(
            [t["jitter_buffer_ms"] for t in split if t.get("jitter_buffer_ms") is not None]
        ),
        "playout_wait_ms": _stats([t["playout_wait_ms"] for t in split]),
        "playout_underruns": sum(t.get("playout_underruns", 0) for t in split),
    }


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def to_markdown(run: dict[str, Any], summary: dict[str, Any]) -> str:
    settings = run["settings"]
    order = listeners(run)
    lines = [
        "# Vocable latency benchmark",
        "",
        f"Command: `{run['command']}`  ",
        f"Commit {run['git_commit']}, {run['started_at']}, {run['machine']['cpu']} "
        f"({run['machine']['cores']} cores), Python {run['machine']['python']}.  ",
        f"LLM: {settings['llm']}; STT {settings['stt_model']}; TTS {settings['tts_voice']}; "
        f"end-of-speech silence {settings['end_silence_ms']} ms.",
        "",
        "## Voice-to-voice at the client, by simultaneous calls (ms)",
        "",
        *(f"Listener `{name}`: {LISTENERS.get(name, name)}.  " for name in order),
        "",
        "| calls | listener | refused (503) | turns | failed | p50 | p90 | p95 | p99 | floor p50 "
        "| overhead p50 | server CPU % | server RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in summary["levels"]:
        v2v = level["client_v2v_ms"]
        lines.append(
            f"| {level['calls']} | {level.get('listener', 'arrival')} "
            f"| {level.get('refused_calls', 0)} | {level['turns']} "
            f"| {level['failed']} | {_ms(v2v['p50'])} "
            f"| {_ms(v2v['p90'])} | {_ms(v2v['p95'])} | {_ms(v2v['p99'])} "
            f"| {_ms(level['floor_ms']['p50'])} | {_ms(level['overhead_ms']['p50'])} "
            f"| {_ms(level['server_cpu_percent'])} | {_ms(level['server_rss_mb_peak'])} |"
        )
    lines += _stock_lines(summary["levels"])
    first = summary["levels"][0] if summary["levels"] else None
    if first is not None:
        lines += [
            "",
            f"## Server-side stages at {first['calls']} call(s), listener "
            f"{first.get('listener', 'arrival')} (ms, from `turn_metrics`)",
            "",
            "| stage | p50 | p90 | p99 |",
            "|---|---|---|---|",
        ]
        for key, label in STAGES:
            stats = first["server"][key]
            lines.append(
                f"| {label} | {_ms(stats['p50'])} | {_ms(stats['p90'])} | {_ms(stats['p99'])} |"
            )
        pause = first.get("longest_pause_ms") or {}
        if pause.get("p50") is not None:
            lines += [
                "",
                f"Longest pause inside an answer (between its sentences; longer when the next "
                f"one was late): p50 {_ms(pause['p50'])}, p95 {_ms(pause['p95'])}, "
                f"max {_ms(pause['max'])} ms.",
            ]
        dry = first.get("speaker_dry_ms") or {}
        if dry.get("p50") is not None:
            lines += [
                "",
                f"Longest time the server's speaker ran dry inside an answer (its audio not made "
                f"in time, a stutter): p50 {_ms(dry['p50'])}, p95 {_ms(dry['p95'])}, "
                f"max {_ms(dry['max'])} ms.",
            ]
    barge = summary["barge_in_ms"]
    lines += [
        "",
        "## Barge-in and false cuts",
        "",
        f"Barge-in (caller starts talking -> agent silent at the client, listener {order[0]}): "
        f"p50 {_ms(barge['p50'])} ms, p95 {_ms(barge['p95'])} ms over {int(barge['n'] or 0)} "
        f"tries ({summary['barge_in_failed']} failed).  ",
        "False cuts (a short sound over the agent cut it off): "
        + ", ".join(f"{name} {count}" for name, count in summary["false_cuts"].items())
        + f", out of {settings['backchannel_repeats']} each; resumed after a pause: "
        + ", ".join(f"{name} {count}" for name, count in summary.get("resumes", {}).items())
        + ".  ",
        "Server counters: "
        + (", ".join(f"{k} {v:g}" for k, v in summary.get("server_counters", {}).items()) or "none")
        + ".",
        *_llm_throughput_lines(summary.get("llm_throughput")),
        "",
        f"## Against the goals (listener {summary.get('goals_listener', order[0])})",
        "",
        "| goal | target | measured |",
        "|---|---|---|",
    ]
    names = {
        "v2v_p50_1_call_ms": "voice-to-voice p50, 1 call (ms)",
        "v2v_p95_1_call_ms": "voice-to-voice p95, 1 call (ms)",
        "barge_in_p95_ms": "barge-in silence p95 (ms)",
        "false_cuts_cough": "false cuts on the cough",
        "false_cuts_backchannel": 'false cuts on "mhm"',
        "v2v_p95_8_calls_ms": "voice-to-voice p95, 8 calls (ms)",
        "wasted_preemptions_per_turn": "preemptive LLM requests thrown away, per turn",
    }
    for key, goal in summary["goals"].items():
        if key.endswith("_per_turn"):
            measured = goal["measured"]
            shown = "–" if measured is None else f"{measured:.2f}"
            lines.append(f"| {names[key]} | <= {goal['goal']:.2f} | {shown} |")
            continue
        target = f"<= {goal['goal']:.0f}"
        lines.append(f"| {names[key]} | {target} | {_ms(goal['measured'])} |")
    micro = run.get("micro")
    if micro:
        lines += ["", "## Components", ""]
        lines += [
            "| STT audio (s) | median (ms) | p90 (ms) |",
            "|---|---|---|",
            *(
                f"| {row['audio_s']:g} | {_ms(row['median_ms'])} | {_ms(row['p90_ms'])} |"
                for row in micro["stt"]
            ),
            "",
            "| TTS text (chars) | first audio (ms) | real-time factor |",
            "|---|---|---|",
            *(
                f"| {row['chars']} | {_ms(row['first_audio_ms_median'])} "
                f"| {row['rtf_median']:.3f} |"
                for row in micro["tts"]
            ),
            "",
            f"VAD: {micro['vad']['us_per_frame_median']:.1f} µs per 20 ms frame. "
            f"Chunker: {micro['chunker']['chars_per_s'] / 1e6:.1f} M characters/s.",
        ]
    return "\n".join(lines) + "\n"


def _stock_lines(levels: Sequence[dict[str, Any]]) -> list[str]:
    """The stock listener's section: each level's voice-to-voice beside the same turns timed
    out of the receiver, its jitter buffer and playout wait, and the arrival listener's figure
    at the same level when the run has one."""
    stock = [level for level in levels if level.get("received_v2v_ms")]
    if not stock:
        return []
    arrival = {lv["calls"]: lv for lv in levels if lv.get("listener", "arrival") == "arrival"}
    lines = [
        "",
        "## As a stock client hears it (ms)",
        "",
        "The stock listener's turns, the answer's first audible frame: played (voice-to-voice "
        "above), out of aiortc's receiver (the same frame before the playout), its packet's "
        "wait in aiortc's jitter buffer and decoder thread, its wait for the playout's tick; and "
        "the arrival listener's voice-to-voice at the same level (other turns, run before).",
        "",
        "| calls | turns | played p50 / p95 | out of the receiver p50 / p95 | jitter buffer p50 / "
        "p95 | playout wait p50 / p95 | underruns in the turns | arrival listener p50 / p95 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in stock:
        other = arrival.get(level["calls"])
        lines.append(
            f"| {level['calls']} | {int(level['received_v2v_ms']['n'] or 0)} "
            f"| {_pair(level['client_v2v_ms'])} | {_pair(level['received_v2v_ms'])} "
            f"| {_pair(level['jitter_buffer_ms'])} | {_pair(level['playout_wait_ms'])} "
            f"| {level['playout_underruns']} "
            f"| {_pair(other['client_v2v_ms']) if other else '–'} |"
        )
    return lines


def _pair(stats: dict[str, float | None]) -> str:
    return f"{_ms(stats['p50'])} / {_ms(stats['p95'])}"


def plot(run: dict[str, Any], summary: dict[str, Any], folder: Path) -> list[Path]:
    """Two PNGs: latency distributions per stage (lowest concurrency) and the concurrency
    curve. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    level = run["levels"][0]
    ok = [t for t in level["turns"] if t.get("ok")]
    series = [
        (label, [t["server"][key] for t in ok if t["server"].get(key) is not None])
        for key, label in STAGES
    ]
    series.append(("client voice-to-voice", [t["client_v2v_ms"] for t in ok]))
    series.append(("overhead over floor", [t["overhead_ms"] for t in ok]))
    series = [(label, values) for label, values in series if values]
    figure, axes = plt.subplots(figsize=(9, 4.8))
    axes.boxplot([values for _, values in series], vert=False, showfliers=True)
    axes.set_yticks(range(1, len(series) + 1), [label for label, _ in series])
    axes.set_xlabel("ms")
    axes.set_title(f"Latency per stage, {level['calls']} call(s), {len(ok)} turns")
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    paths.append(_save(figure, folder / "stages.png"))
    plt.close(figure)

    names = listeners(run)
    calls = sorted({lv["calls"] for lv in summary["levels"]})
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for name in names:
        levels = [lv for lv in summary["levels"] if lv.get("listener", "arrival") == name]
        for key in ("p50", "p90", "p99"):
            label = key if len(names) == 1 else f"{key}, {name}"
            axes.plot(
                [lv["calls"] for lv in levels],
                [_nan(lv["client_v2v_ms"][key]) for lv in levels],
                marker="o",
                linestyle="-" if name == names[0] else "--",
                label=label,
            )
    axes.axhline(GOALS["v2v_p95_8_calls_ms"], color="grey", linestyle="--", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xticks(calls, [str(c) for c in calls])
    axes.set_xlabel("simultaneous calls")
    axes.set_ylabel("voice-to-voice at the client (ms)")
    axes.set_title("Concurrency")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    paths.append(_save(figure, folder / "concurrency.png"))
    plt.close(figure)
    return paths


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _save(figure: Any, path: Path) -> Path:
    figure.savefig(path, dpi=110)
    return path


def finite_numbers(data: Any) -> Iterable[float]:
    """Every int or float inside ``data`` (for the smoke test's sanity check)."""
    if isinstance(data, bool):
        return
    if isinstance(data, int | float):
        yield float(data)
    elif isinstance(data, dict):
        for value in data.values():
            yield from finite_numbers(value)
    elif isinstance(data, list):
        for value in data:
            yield from finite_numbers(value)


def llm_throughput(counters: dict[str, float]) -> dict[str, float] | None:
    """An embedded model's tokens per second (generated, and prompt read) and the share of
    prompt tokens its cache saved, from llama.cpp's counters; None without them."""
    generated = counters.get("llamacpp:tokens_predicted")
    generating_s = counters.get("llamacpp:tokens_predicted_seconds")
    if not generated or not generating_s:
        return None
    read = counters.get("llamacpp:prompt_tokens", 0.0)
    reading_s = counters.get("llamacpp:prompt_seconds", 0.0)
    cached = counters.get("llamacpp:prompt_tokens_cached", 0.0)
    return {
        "generated_tokens_per_s": round(generated / generating_s, 1),
        "prompt_tokens_per_s": round(read / reading_s, 1) if reading_s else 0.0,
        "prompt_tokens_cached_share": round(cached / (cached + read), 3) if cached + read else 0.0,
    }


def _llm_throughput_lines(throughput: dict[str, float] | None) -> list[str]:
    if throughput is None:
        return []
    return [
        "",
        f"LLM in process: {throughput['generated_tokens_per_s']:g} tokens/s generated, "
        f"prompts read at {throughput['prompt_tokens_per_s']:g} tokens/s, "
        f"{throughput['prompt_tokens_cached_share'] * 100:.0f} % of prompt tokens from its cache.",
    ]
