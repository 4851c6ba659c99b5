"""``python -m benchmarks.soak``: the leak and soak test.

It starts the paced scripted LLM and ``vocable serve`` in a child process (as ``python -m
benchmarks`` does) and drives real aiortc callers (see ``benchmarks.soak_calls``): warm-up calls
one after another and one round at once, then the server's footprint from ``/healthz`` (the
baseline), ``--sequential`` calls one after another, ``--rounds`` rounds of ``--concurrent`` calls
at once, and the footprint again. Each footprint follows a cool-down call and a settle (see
``LLM_KEEPALIVE_S`` and ``QUIET_S``). Writes ``soak.json``, ``soak.md`` and the server's log under
``--output`` and exits 1 when a goal is missed (see :func:`verdict`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from .corpus import Utterance, load_corpus
from .llm import LLMPacing, paced_llm
from .models import model_path
from .provenance import git_commit, machine
from .scenarios import BenchTarget
from .server_process import ServerProcess, free_port
from .soak_calls import soak_call
from .soak_report import leftovers, rss_growth_percent, rss_slope_mb_per_100, to_markdown

__all__ = ["SoakPlan", "main", "run_soak", "verdict"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "soak"
PLAYBOOK = Path(__file__).resolve().parent / "soak_playbook.yaml"
ANSWER = "It will arrive on Friday."
"""The scripted LLM's answer: one short sentence keeps each call to a few seconds."""

LEFTOVER_TOLERANCE = {"open_files": 0, "threads": 2, "asyncio_tasks": 0}
"""How far above the baseline each count may end. The baseline is taken after warm-up calls
(including a round at once), after the same cool-down and settle as the final count, each over
a fresh HTTP connection (the health request's own socket and task are in both), so a call that
frees everything leaves nothing over. Threads alone get a margin: asyncio's default executor,
where aiortc encodes Opus, starts threads on demand up to min(32, cores + 4) and keeps them, so
a busier round than the warm-up's may add one or two for good. A leak of one thing per call
shows as one per call: hundreds in the soak, dozens in the short test."""
LLM_KEEPALIVE_S = 5.0
"""The server's LLM client (httpx) keeps idle connections this long, and closes expired ones
only when it next sends a request: the cool-down call after a round makes it do so, so the
connections the round opened are not counted as leftovers. (Kept, not designed away with a
``Connection: close`` LLM: a client a call leaves unclosed shows as its idle socket.)"""
LLM_IDLE_S = 1.0
"""The paced scripted LLM closes a connection idle this long (its keep-alive timeout): the
server's LLM client then finds it closed by the LLM, and drops it, at its next request, without
waiting ``LLM_KEEPALIVE_S`` for it to expire. (A client a call leaves unclosed still shows: its
socket stays open, half closed.)"""
QUIET_S = 3.0
"""The server has settled when no call is live and its counts held still this long."""
SETTLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SoakPlan:
    sequential: int = 200
    concurrent: int = 8
    rounds: int = 3
    warmup: int = 6
    """Warm-up calls one after another (then one round of ``concurrent`` at once)."""
    rss_limit_percent: float = 10.0
    """RSS may grow less than this, baseline to final."""
    llm_gguf: str | None = None
    """The server runs this model in process (llama.cpp) instead of the paced scripted LLM."""
    answer: str = ANSWER
    """What the paced scripted LLM answers to every question."""
    lanes: int = 1
    """The calls "one after another" (warm-up and measured) run in this many lanes, each placing
    its next call when its last hung up (the short test's 2 halve its time; the soak's 1 is a
    steady trickle)."""


def verdict(
    baseline: dict[str, Any], final: dict[str, Any], failed: int, plan: SoakPlan
) -> list[str]:
    """Every goal missed, in words (empty: all met). ``baseline`` and ``final`` are the
    ``process`` footprints of ``/healthz``: RSS must grow less than ``plan.rss_limit_percent``,
    open files, OS threads and asyncio tasks must end within ``LEFTOVER_TOLERANCE`` of the
    baseline, and no call may fail."""
    misses = []
    growth = rss_growth_percent(baseline, final)
    if growth >= plan.rss_limit_percent:
        misses.append(f"RSS grew {growth:.1f} % (goal: under {plan.rss_limit_percent:g} %)")
    for name, extra in leftovers(baseline, final).items():
        if extra > LEFTOVER_TOLERANCE[name]:
            misses.append(f"{name}: {final[name]}, {extra} more than the baseline {baseline[name]}")
    if failed:
        misses.append(f"{failed} call(s) failed")
    return misses


class Health:
    """The server's ``/healthz``, each request on a connection of its own."""

    def __init__(self, base_url: str) -> None:
        self.url = f"{base_url}/healthz"
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    async def get(self) -> dict[str, Any]:
        async with self._http.get(self.url) as response:
            health: dict[str, Any] = await response.json()
            return health

    async def settle(self) -> tuple[dict[str, Any], float]:
        """Poll until no call is live and open files, threads and tasks have held still for
        ``QUIET_S``; the last health and the seconds waited. Gives up after ``SETTLE_TIMEOUT_S``
        and returns the last health all the same (the verdict judges it)."""
        started = quiet_since = time.monotonic()
        last: tuple[int, ...] = ()
        while True:
            health = await self.get()
            now = time.monotonic()
            counts = tuple(health["process"][name] for name in LEFTOVER_TOLERANCE)
            if health["active_sessions"] or counts != last:
                quiet_since = now
            last = counts
            if now - quiet_since >= QUIET_S or now - started >= SETTLE_TIMEOUT_S:
                return health, round(now - started, 1)
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        await self._http.close()


class _Calls:
    """Numbers calls and gives each a corpus question: every question is asked both spoken and
    typed (calls alternate between the two)."""

    def __init__(
        self, target: BenchTarget, questions: Sequence[Utterance], on_call: Callable[[], None]
    ) -> None:
        self.target = target
        self.index = itertools.count()
        self.questions = questions
        self.on_call = on_call
        self.records: list[dict[str, Any]] = []

    async def one(self, phase: str) -> None:
        index = next(self.index)
        question = self.questions[index // 2 % len(self.questions)]
        record = await soak_call(self.target, index, question)
        self.records.append({"phase": phase, **record})
        self.on_call()

    async def in_lanes(
        self,
        count: int,
        phase: str,
        lanes: int,
        after: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """``count`` calls one after another in each of ``lanes`` lanes (call n, from 1, goes
        to the first lane free); ``after(n)`` once call n has hung up."""
        numbers = iter(range(1, count + 1))

        async def lane() -> None:
            for n in numbers:
                await self.one(phase)
                if after is not None:
                    await after(n)

        await asyncio.gather(*(lane() for _ in range(lanes)))

    async def at_once(self, count: int, phase: str) -> None:
        await asyncio.gather(*(self.one(phase) for _ in range(count)))


def run_soak(
    plan: SoakPlan, folder: Path, command: str = "", on_call: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """Run the soak against a server of its own; write ``soak.json``, ``soak.md`` and the
    server's ``server.log`` into ``folder`` and return what ``soak.json`` holds (``misses``
    empty when every goal is met)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "server.log").unlink(missing_ok=True)
    started_at = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    result = asyncio.run(_soak(plan, folder / "server.log", on_call))
    failed = [r for r in result["calls"] if not r["ok"]]
    result = {
        "command": command,
        "started_at": started_at,
        "git_commit": git_commit(),
        "machine": machine(),
        "plan": asdict(plan),
        "leftover_tolerance": LEFTOVER_TOLERANCE,
        **result,
        "failed_calls": failed,
        "misses": verdict(result["baseline"], result["final"], len(failed), plan),
    }
    (folder / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / "soak.md").write_text(to_markdown(result))
    return result


async def _soak(plan: SoakPlan, log: Path, on_call: Callable[[], None]) -> dict[str, Any]:
    llm = paced_llm(LLMPacing(), answer=plan.answer) if plan.llm_gguf is None else None
    if llm is not None:
        llm.idle_timeout_s = LLM_IDLE_S
    server: ServerProcess | None = None
    try:
        if plan.llm_gguf is not None:
            llm_args = ["--llm-gguf", str(model_path(plan.llm_gguf))]
        else:
            assert llm is not None
            llm_args = ["--llm-base-url", await llm.start(), "--llm-model", "bench"]
        server_args = [
            "--playbook", str(PLAYBOOK), *llm_args,
            "--max-sessions", str(plan.concurrent + 2),
            "--rate-limit", "0",  # every caller is 127.0.0.1 here
            # what is measured is what calls leave behind, not admission: the callers (and, in
            # the test suite, the other tests) take CPU on the same cores
            "--overload-capacity-cpu-percent", "0",
        ]  # fmt: skip
        server = ServerProcess(server_args, ROOT, log)
        base_url = await server.start(free_port())
        target = BenchTarget(base_url, "soak", 0.0, None)
        idle_s = LLM_KEEPALIVE_S if llm is None else LLM_IDLE_S
        return await _phases(plan, target, on_call, idle_s)
    finally:
        if server is not None:
            await server.stop()
        if llm is not None:
            await llm.close()


async def _phases(
    plan: SoakPlan, target: BenchTarget, on_call: Callable[[], None], llm_idle_s: float
) -> dict[str, Any]:
    """Warm up, baseline, the measured calls, final; footprints, samples and call records.
    ``llm_idle_s``: how long the server's idle LLM connections last (see :func:`_settled`)."""
    questions = [u for u in load_corpus().values() if u.kind == "question"]
    calls = _Calls(target, questions, on_call)
    health = Health(target.base_url)
    try:
        await calls.in_lanes(plan.warmup, "warm-up", plan.lanes)
        await calls.at_once(plan.concurrent, "warm-up")
        baseline = await _settled(calls, health, llm_idle_s)
        started = time.monotonic()
        samples = await _measured_calls(plan, calls, health)
        final = await _settled(calls, health, llm_idle_s)
        wall_s = time.monotonic() - started
    finally:
        await health.close()
    before, after = baseline["health"]["process"], final["health"]["process"]
    return {
        "baseline": before,
        "final": after,
        "final_active_sessions": final["health"]["active_sessions"],
        "open_files_by_kind": {"baseline": baseline["files"], "final": final["files"]},
        "baseline_settle_s": baseline["settle_s"],
        "settle_s": final["settle_s"],
        "wall_s": round(wall_s, 1),
        "rss_growth_percent": round(rss_growth_percent(before, after), 2),
        "rss_slope_mb_per_100_calls": rss_slope_mb_per_100(samples),
        "samples": samples,
        "calls": calls.records,
    }


async def _measured_calls(plan: SoakPlan, calls: _Calls, health: Health) -> list[dict[str, Any]]:
    """The calls one after another (in ``plan.lanes``), then the rounds at once; the server's
    counts about every twentieth of the calls one after another and after each round."""
    samples: list[dict[str, Any]] = []

    async def sample(phase: str) -> None:
        now = await health.get()
        done = sum(r["phase"] in ("sequential", "concurrent") for r in calls.records)
        samples.append({"phase": phase, "calls": done, **_counts(now)})

    await sample("baseline")
    every = max(1, plan.sequential // 20)

    async def sampled(n: int) -> None:
        if n % every == 0:
            await sample("sequential")

    await calls.in_lanes(plan.sequential, "sequential", plan.lanes, sampled)
    for _ in range(plan.rounds):
        await calls.at_once(plan.concurrent, "concurrent")
        await sample("concurrent")
    return samples


async def _settled(calls: _Calls, health: Health, llm_idle_s: float) -> dict[str, Any]:
    """A cool-down call once the LLM client's idle connections have ended (``llm_idle_s``:
    ``LLM_IDLE_S``, or ``LLM_KEEPALIVE_S`` for a model the LLM does not pace), then a settle:
    the health then, the seconds the settle took and the open files by kind."""
    await asyncio.sleep(llm_idle_s + 1.0)
    await calls.one("cool-down")
    now, settle_s = await health.settle()
    return {"health": now, "settle_s": settle_s, "files": _open_files(now)}


def _open_files(health: dict[str, Any]) -> dict[str, int]:
    """The server's open files by kind (socket, pipe, anon_inode, file), read from ``/proc``
    (the server runs on this machine) just after ``health``: where to look when the count does
    not come back."""
    kinds: Counter[str] = Counter()
    for fd in Path(f"/proc/{health['process']['pid']}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed since it was listed
            target = os.readlink(fd)
            kinds[target.split(":")[0] if ":" in target else "file"] += 1
    return dict(sorted(kinds.items()))


def _counts(health: dict[str, Any]) -> dict[str, Any]:
    process = health["process"]
    return {
        "active_sessions": health["active_sessions"],
        **{k: process[k] for k in ("rss_mb", "open_files", "threads", "asyncio_tasks")},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(argv if argv is not None else sys.argv[1:])
    command = ("python -m benchmarks.soak " + shlex.join(argv)).strip()
    plan = SoakPlan(
        args.sequential,
        args.concurrent,
        args.rounds,
        args.warmup,
        args.rss_limit,
        args.llm_gguf,
        lanes=args.lanes,
    )
    total = plan.warmup + plan.concurrent * (1 + plan.rounds) + plan.sequential + 2
    print("starting vocable serve (loading models)...", file=sys.stderr)
    try:
        with tqdm(total=total, unit="call", desc="soak", file=sys.stderr) as bar:
            result = run_soak(plan, args.output, command, lambda: bar.update())
    except KeyboardInterrupt:
        return 130
    print(f"results: {args.output}")
    print((args.output / "soak.md").read_text())
    return 1 if result["misses"] else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument("--sequential", type=int, default=200, help="calls one after another")
    parser.add_argument("--concurrent", type=int, default=8, help="calls at once per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --concurrent calls")
    parser.add_argument("--warmup", type=int, default=6, help="warm-up calls one after another")
    parser.add_argument(
        "--lanes", type=int, default=1, help="lanes the calls one after another run in"
    )
    parser.add_argument("--rss-limit", type=float, default=10.0, help="RSS growth goal, %%")
    parser.add_argument("--output", type=Path, default=RESULTS, help="folder for the results")
    parser.add_argument(
        "--llm-gguf", help="the server runs this model in process instead of the scripted LLM"
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
