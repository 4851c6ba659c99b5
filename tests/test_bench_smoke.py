"""A short run of the latency harness end to end: real server process, real aiortc callers."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.report import finite_numbers
from tests.conftest import REPO
from tests.support.processes import spawn

pytestmark = pytest.mark.slow


def _server_hops(turn: dict[str, Any]) -> list[float]:
    return [v for v in turn["server"].values() if v is not None]


@pytest.mark.timeout(600)  # ~55 s here: a whole harness run (its own guard: 540 s)
async def test_a_quick_benchmark_run_writes_a_complete_report(tmp_path: Path) -> None:
    process = await spawn(
        sys.executable,
        "-m",
        "benchmarks",
        "--quick",
        "--output",
        str(tmp_path),
        "--name",
        "smoke",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=540)
    assert process.returncode == 0, err.decode()[-3000:]

    folder = tmp_path / "smoke"
    for name in ("run.json", "report.md", "stages.png", "concurrency.png"):
        assert (folder / name).is_file(), name
    for name in ("stages.png", "concurrency.png"):
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = json.loads((folder / "run.json").read_text())

    assert all(math.isfinite(value) for value in finite_numbers(run))
    assert [level["calls"] for level in run["levels"]] == [1, 2]
    turns = [turn for level in run["levels"] for turn in level["turns"]]
    assert len(turns) == 2 + 4
    assert all(turn["ok"] for turn in turns), [t.get("error") for t in turns]
    assert all(turn["client_v2v_ms"] > 0 and turn["floor_ms"] > 0 for turn in turns)
    assert all(turn["server"]["voice_to_voice_ms"] > 0 for turn in turns)
    # a hop a preemptive answer made before the turn ended counts as 0: it cost the caller nothing
    assert all(value >= 0 for turn in turns for value in _server_hops(turn))
    for level in run["levels"]:
        assert level["server_cpu_percent"] > 0
        assert level["server_rss_mb_peak"] > 0
    (barge,) = run["barge_in"]
    assert barge["ok"], barge
    assert barge["silence_ms"] > 0
    assert {r["utterance"] for r in run["backchannel"]} == {"synthetic_cough", "piper_mhm"}
    micro = run["micro"]
    assert all(row["median_ms"] > 0 for row in micro["stt"])
    assert micro["vad"]["us_per_frame_median"] > 0
    summary = run["summary"]
    assert summary["levels"][0]["client_v2v_ms"]["p50"] > 0
    counters = run["server_counters"]
    assert counters["turns"] >= len(turns)
    wasted = counters.get("speculative_transcriptions_preempted_wasted", 0) / counters["turns"]
    assert summary["goals"]["wasted_preemptions_per_turn"]["measured"] == wasted
    report = (folder / "report.md").read_text()
    assert "Voice-to-voice at the client" in report
    assert "Against the goals" in report
    assert "preemptive LLM requests thrown away, per turn" in report
    assert b"results:" in out
