"""Browser callers for the latency harness (``--client chromium``): headless Chromium pages run the
web client against the server, each with a fake microphone playing the questions, and report
the voice to voice the page itself hears (``web-client/voice-timer.js``: the microphone's last
voiced 5 ms to the first audible 5 ms of the answer, on the audio clock, after WebRTC's jitter
buffer and decoder), beside the server's own figure of the same turn and Chromium's receiver
statistics (``getStats``).

Each page's microphone file: silence while the greeting plays, then every question followed by
silence long enough for its answer. Chromium loops the file; a call ends once its page has
timed ``turns`` answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from media.audio import SAMPLE_RATE, silence
from server.testkit.browser import Browser, microphone_file
from server.testkit.firefox import Firefox

from .corpus import Utterance
from .jitter import SELECTED_PAIR, RelayBroker, rewrite_answer_script
from .report import percentile

__all__ = ["browser_level", "browser_markdown", "percentiles", "summarize_browser"]

GREETING_S = 7.0
"""Silence at the head of each microphone file: the greeting plays."""
ANSWER_S = 7.0
"""Silence after each question: its answer plays, then a pause."""
CONNECT_S = 90.0
"""How long a page may take to connect its call: four Firefox pages starting at once on two
cores took more than 30 s."""

STATS = """(async () => {
    const found = {};
    (await call.pc.getStats()).forEach((report) => {
        if (report.type === "inbound-rtp" && report.kind === "audio") found.inbound = report;
        if (report.type === "media-playout") found.playout = report;
    });
    return found;
})()"""
"""The agent's stream as Chromium's receiver saw it: the inbound-rtp audio report (jitter
buffer, concealment, jitter) and the media-playout report (playout delay), whole."""


def _microphone(questions: Sequence[Utterance], path: Path) -> Path:
    pcm = silence(int(GREETING_S * 1000))
    for question in questions:
        pcm += question.pcm() + silence(int(ANSWER_S * 1000))
    return microphone_file(path, pcm)


def _cpu_s(pid: int) -> float:
    """CPU seconds of the process group ``pid`` leads (Chromium and its helpers), so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pid:  # the process group
                total += (int(fields[11]) + int(fields[12])) / ticks
    return total


async def _one_call(
    base_url: str,
    playbook: str | None,
    index: int,
    questions: Sequence[Utterance],
    turns: int,
    processing: bool,
    relays: RelayBroker | None,
    client: str = "chromium",
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vocable-browser-") as scratch:
        folder = Path(scratch)
        microphone = _microphone(questions, folder / "microphone.wav")
        query = ("autocall=1" if processing else "raw=1&autocall=1") + (
            f"&playbook={playbook}" if playbook else ""
        )
        opened = Firefox(folder) if client == "firefox" else Browser(folder / "profile", microphone)
        async with opened as browser:
            assert browser.pid is not None
            if relays is not None:
                assert isinstance(browser, Browser), "the jitter relays need Chromium"
                script = rewrite_answer_script(relays.url)
                await browser.send("Page.addScriptToEvaluateOnNewDocument", source=script)
            cpu_before, started = _cpu_s(browser.pid), time.monotonic()
            await browser.goto(f"{base_url}/?{query}")
            await browser.wait_until("call && call.pc.connectionState === 'connected'", CONNECT_S)
            if isinstance(browser, Firefox):
                browser.play_microphone(microphone)  # from the call's start, as Chromium's does
            pair = await browser.evaluate(SELECTED_PAIR) if relays is not None else None
            cycle_s = GREETING_S + sum(len(q.pcm()) / 2 / SAMPLE_RATE + ANSWER_S for q in questions)
            await browser.wait_until(
                f"window.vocable.turns.length >= {turns}",
                timeout_s=cycle_s * (turns / len(questions) + 1) + 30,
            )
            await asyncio.sleep(0.5)  # the last turn's server figures
            heard = await browser.evaluate("window.vocable.turns")
            offset_ms = (time.time() - time.monotonic()) * 1000
            stats = await browser.evaluate(STATS)
            elapsed = time.monotonic() - started
            cpu_percent = (_cpu_s(browser.pid) - cpu_before) / elapsed * 100
            await browser.evaluate("document.getElementById('call').click()")  # hang up
    return {
        "call": index,
        "turns": [_turn(index, n, turn, offset_ms) for n, turn in enumerate(heard[:turns])],
        "stats": stats,
        "client_cpu_percent": round(cpu_percent, 1),
        "jittered": None if relays is None else _through_relay(pair, relays),
    }


def _through_relay(pair: dict[str, Any] | None, relays: RelayBroker) -> bool:
    """Whether the page's selected ICE pair ends at one of the broker's relays."""
    return pair is not None and pair.get("remote_port") in {r.port for r in relays.relays}


def _turn(call: int, number: int, turn: dict[str, Any], offset_ms: float) -> dict[str, Any]:
    """One answer's record. ``offset_ms``: wall clock less the monotonic clock (the server's
    event times), both of this machine: the page's wall-clock times split the gap between the
    page and the server into the question's way in (``uplink_ms``: the caller's last voiced
    window in the page to the server's last voiced frame) and the answer's way out
    (``downlink_ms``: the server's first frame out to the first audible window in the page)."""
    server = turn.get("server") or {}
    speech_end = turn.get("speech_end") or {}
    onset, voiced = turn.get("onset_unix_ms"), turn.get("last_voiced_unix_ms")
    first_out = server.get("t_ms")  # turn_metrics is sent as the first frame leaves
    server_voiced = speech_end.get("last_voiced_ms")
    return {
        "uplink_ms": None
        if voiced is None or server_voiced is None
        else round(server_voiced + offset_ms - voiced, 1),
        "downlink_ms": None
        if onset is None or first_out is None
        else round(onset - (first_out + offset_ms), 1),
        "call": call,
        "turn": number,
        "heard_ms": round(turn["heard_ms"], 1),
        "graph_ms": round(turn["graph_ms"], 1),
        "output_latency_ms": round(turn["output_latency_ms"], 1),
        "server_v2v_ms": server.get("voice_to_voice_ms"),
        "server": {k: v for k, v in server.items() if k.endswith("_ms")},
    }


async def browser_level(
    base_url: str,
    playbook: str | None,
    calls: int,
    turns: int,
    questions: Sequence[Utterance],
    processing: bool = False,
    jitter_ms: tuple[float, float] | None = None,
    client: str = "chromium",
) -> dict[str, Any]:
    """``calls`` Chromium (``client`` "firefox": Firefox) pages at once (started 1 s apart),
    each until it timed ``turns`` answers; each page asks the questions from a different one
    on. ``processing``: the pages keep the browser's echo cancellation, noise suppression and
    gain control on (else ``?raw=1``).
    ``jitter_ms``: the pages' media pass through relays that delay each datagram by that range
    (:mod:`.jitter`)."""
    cycle = list(questions)

    async def call(index: int, relays: RelayBroker | None) -> dict[str, Any]:
        await asyncio.sleep(index * 1.0)
        start = index * len(cycle) // max(1, calls)
        script = list(itertools.islice(itertools.cycle(cycle), start, start + len(cycle)))
        return await _one_call(base_url, playbook, index, script, turns, processing, relays, client)

    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        relays = None
        if jitter_ms is not None:
            relays = await stack.enter_async_context(RelayBroker(jitter_ms))
        pages = await asyncio.gather(*(call(i, relays) for i in range(calls)))
    return {
        "calls": calls,
        "client": client,
        "audio_processing": processing,
        "jitter_ms": list(jitter_ms) if jitter_ms is not None else None,
        "pages": pages,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 and p95 by nearest rank (the harness's :func:`~.report.percentile`), and how many."""
    p50, p95 = percentile(values, 50), percentile(values, 95)
    return {
        "p50": None if p50 is None else round(p50, 1),
        "p95": None if p95 is None else round(p95, 1),
        "n": len(values),
    }


def summarize_browser(level: dict[str, Any]) -> dict[str, Any]:
    """Voice to voice as the pages heard it and as the server timed it, their gap per turn,
    and the receivers' jitter buffer and concealment, over the level's turns."""
    turns = [t for page in level["pages"] for t in page["turns"]]
    paired = [t for t in turns if t["server_v2v_ms"] is not None]
    inbound = [page["stats"].get("inbound", {}) for page in level["pages"]]

    def mean_ms(total: str, count: str) -> float | None:
        pairs = [(s[total], s[count]) for s in inbound if s.get(count) and total in s]
        if not pairs:
            return None
        return round(statistics.fmean(1000 * t / c for t, c in pairs), 1)

    playout = [page["stats"].get("playout", {}) for page in level["pages"]]
    playout_ms = [
        1000 * p["totalPlayoutDelay"] / p["totalSamplesCount"]
        for p in playout
        if p.get("totalSamplesCount")
    ]
    received = sum(s.get("totalSamplesReceived", 0) for s in inbound)
    concealed = sum(s.get("concealedSamples", 0) for s in inbound)
    return {
        "calls": level["calls"],
        "heard_ms": percentiles([t["heard_ms"] for t in turns]),
        "server_v2v_ms": percentiles([t["server_v2v_ms"] for t in paired]),
        "gap_ms": percentiles([t["graph_ms"] - t["server_v2v_ms"] for t in paired]),
        "output_latency_ms": percentiles([t["output_latency_ms"] for t in turns]),
        "uplink_ms": percentiles([t["uplink_ms"] for t in turns if t["uplink_ms"] is not None]),
        "downlink_ms": percentiles(
            [t["downlink_ms"] for t in turns if t["downlink_ms"] is not None]
        ),
        "jitter_buffer_ms": mean_ms("jitterBufferDelay", "jitterBufferEmittedCount"),
        "jitter_buffer_target_ms": mean_ms("jitterBufferTargetDelay", "jitterBufferEmittedCount"),
        "playout_delay_ms": _mean(playout_ms),
        "processing_delay_ms": mean_ms("totalProcessingDelay", "totalSamplesReceived"),
        "concealed_percent": round(100 * concealed / received, 2) if received else None,
        "arrival_jitter_ms": _mean([1000 * s["jitter"] for s in inbound if "jitter" in s]),
        "client_cpu_percent": _mean([page["client_cpu_percent"] for page in level["pages"]]),
        "pages_through_relays": sum(bool(page.get("jittered")) for page in level["pages"]),
    }


def _jitter_line(run: dict[str, Any]) -> str:
    jitter = run["settings"].get("jitter_ms")
    if not jitter:
        return "Network: loopback, no added delay."
    through = ", ".join(f"{s['pages_through_relays']} of {s['calls']}" for s in run["summary"])
    return (
        f"Network: every datagram both ways delayed {jitter[0]:g}-{jitter[1]:g} ms (uniformly, "
        f"in order) by relays between the pages and the server (`benchmarks/jitter.py`); pages "
        f"whose selected ICE pair went through them: {through}."
    )


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 1) if values else None


def browser_markdown(run: dict[str, Any]) -> str:
    """The report of a ``--client chromium`` (or ``firefox``) run."""
    client = run["settings"].get("client", "chromium")
    browser = "Firefox" if client.startswith("firefox") else "Chromium"
    lines = [
        f"# Voice to voice in {browser}",
        "",
        f"`{run['command']}` at {run['git_commit']} on {run['machine']['cpu']}, "
        f"{run['started_at']}.",
        "",
        "Heard: the page's own figure (microphone's last voiced 5 ms to the answer's first "
        "audible 5 ms, on the audio clock, plus the output device's latency). Server: the "
        "server's voice_to_voice_ms of the same turn (caller's last voiced frame in to the "
        "answer's first frame out). Gap: heard on the audio graph minus server. On arrival: "
        "the harness's aiortc caller, run just before on the same server. Way in: the "
        "caller's last voiced window in the page to the server's last voiced frame; way out: "
        "the server's first frame out to the first audible window in the page (wall clocks of "
        "this machine; their sum is the gap).",
        "",
        "The browser's echo cancellation, noise suppression and gain control: "
        + ("on." if run["settings"].get("browser_audio_processing") else "off (`?raw=1`)."),
        "",
        _jitter_line(run),
        "",
        "| calls | heard p50 / p95 (n) | server p50 | on arrival p50 | gap p50 / p95 | "
        "way in / out p50 | jitter buffer | concealed | arrival jitter | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for summary in run["summary"]:
        heard, server, gap = summary["heard_ms"], summary["server_v2v_ms"], summary["gap_ms"]
        arrival = summary.get("on_arrival_ms") or {}
        lines.append(
            f"| {summary['calls']} | {heard['p50']} / {heard['p95']} ms ({heard['n']}) "
            f"| {server['p50']} ms | {arrival.get('p50')} ms | {gap['p50']} / {gap['p95']} ms "
            f"| {summary['uplink_ms']['p50']} / {summary['downlink_ms']['p50']} ms "
            f"| {summary['jitter_buffer_ms']} ms (target {summary['jitter_buffer_target_ms']}; "
            f"playout {summary['playout_delay_ms']}) "
            f"| {summary['concealed_percent']} % | {summary['arrival_jitter_ms']} ms "
            f"| {summary['client_cpu_percent']} % |"
        )
    return "\n".join(lines) + "\n"
