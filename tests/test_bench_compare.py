"""The side-by-side comparison's pure logic (no pipecat, no servers): the per-side summary, the
ratios, the report, and the audio-only rules over received frames."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.compare_impaired import impaired_summary, impaired_table, judge_trial
from benchmarks.compare_report import SIDES, ratio, ratios, summarize_side, to_markdown
from benchmarks.heard import heard_between, last_sound_after
from server.testkit.caller import SILENCE_DBFS, ReceivedFrame, longest_gap_ms


def session(
    v2v: list[float | None], silences: list[float | None], cpu_s: float = 30.0
) -> dict[str, Any]:
    """One side's call: a question turn per ``v2v`` (None: failed), a barge-in per ``silences``."""
    turns = [
        {"kind": "question", "utterance": f"q{n}", "ok": True, "v2v_ms": ms, "llm_requests": 1}
        if ms is not None
        else {"kind": "question", "utterance": f"q{n}", "ok": False, "error": "no answer"}
        for n, ms in enumerate(v2v)
    ]
    barges = [
        {"kind": "barge_in", "utterance": "stop", "ok": True, "silence_ms": ms}
        if ms is not None
        else {"kind": "barge_in", "utterance": "stop", "ok": False, "error": "did not stop"}
        for ms in silences
    ]
    return {
        "warmups": [{"kind": "warmup", "utterance": "w", "ok": True, "v2v_ms": 3000.0}],
        "turns": turns,
        "barge_ins": barges,
        "usage": {"cpu_s": cpu_s, "wall_s": 100.0, "rss_mb_ready": 400.0, "rss_mb_peak": 500.0},
    }


def test_a_side_summary_counts_failures_apart_from_the_percentiles() -> None:
    summary = summarize_side([session([800, 900, None, 1000], [200, None])])
    assert summary["turns"] == 4
    assert summary["failed_turns"] == 1
    assert summary["v2v_ms"]["n"] == 3
    assert summary["v2v_ms"]["p50"] == 900
    assert summary["v2v_ms"]["p95"] == 1000
    assert (summary["barge_ins"], summary["failed_barge_ins"]) == (2, 1)
    assert summary["barge_in_silence_ms"]["p50"] == 200
    assert summary["cpu_percent"] == 30.0
    assert summary["llm_requests_per_turn"] == 1.0
    assert summary["warmup_v2v_ms"] == [3000.0]  # reported, not in the percentiles


def test_rounds_pool_their_turns_and_cpu_time() -> None:
    summary = summarize_side([session([800], [200], cpu_s=20.0), session([1200], [300], 40.0)])
    assert summary["turns"] == 2
    assert summary["v2v_ms"]["p95"] == 1200
    assert summary["cpu_percent"] == 30.0  # 60 CPU seconds over 200 s


def test_the_ratio_is_pipecat_over_vocable() -> None:
    assert ratio(1500.0, 1000.0) == 1.5
    assert ratio(500.0, 1000.0) == 0.5
    assert ratio(None, 1000.0) is None
    assert ratio(1000.0, 0.0) is None


def test_a_side_with_every_turn_failed_has_no_ratio() -> None:
    summary = {
        "vocable": summarize_side([session([800, 900], [200])]),
        "pipecat": summarize_side([session([None, None], [None])]),
    }
    assert ratios(summary)["v2v_p50"] is None
    assert ratios(summary)["barge_in_p50"] is None


def test_the_report_shows_both_sides_and_the_ratio() -> None:
    sides = {"vocable": [session([1000], [200])], "pipecat": [session([2000], [800])]}
    run = {
        "command": "python -m benchmarks.compare",
        "started_at": "today",
        "git_commit": "abc123",
        "machine": {"cpu": "a CPU", "cores": 2, "python": "3.11"},
        "versions": {"pipecat-ai": "1.14.0"},
        "settings": {
            "rounds": 1,
            "questions": 1,
            "barge_ins": 1,
            "order": list(SIDES),
            "llm": "scripted",
            "whisper_model": "tiny.en",
            "piper_voice": "joe",
        },
        "configuration": {"vocable": "defaults", "pipecat": "scaffold"},
        "sides": sides,
        "summary": {side: summarize_side(sides[side]) for side in SIDES},
    }
    report = to_markdown(run)
    assert "| voice-to-voice p50 | 1000 ms | 2000 ms | 2.00x |" in report
    assert "| barge-in to silence p50 | 200 ms | 800 ms | 4.00x |" in report
    assert "- pipecat: scaffold" in report


def frames(levels: str, start: float = 10.0) -> list[ReceivedFrame]:
    """20 ms frames from a string: ``#`` audible, ``.`` silent."""
    return [
        ReceivedFrame(start + n * 0.02, -20.0 if c == "#" else SILENCE_DBFS - 20)
        for n, c in enumerate(levels)
    ]


def test_sound_inside_a_window_is_found() -> None:
    heard = frames("...##...")
    assert heard_between(heard, 10.0, 10.2) == pytest.approx(10.06)
    assert heard_between(heard, 10.1, 10.2) is None
    assert last_sound_after(heard, 10.0) == pytest.approx(10.08)
    assert last_sound_after(heard, 10.08) is None


def test_the_longest_pause_inside_an_answer() -> None:
    heard = frames("##...#.....##")
    assert longest_gap_ms(heard, heard[0].at, heard[-1].at) == pytest.approx(100.0)
    assert longest_gap_ms(heard, heard[0].at, heard[5].at) == pytest.approx(60.0)


def test_an_impaired_answer_is_cut_below_four_fifths_of_the_clean_one() -> None:
    clean = {"ok": True, "voiced_ms": 10000, "llm_requests": 1}
    trials = [
        {"noise": "babble", "snr_db": 20, "ok": True, "voiced_ms": 7900, "llm_requests": 2},
        {"noise": "car", "snr_db": 10, "ok": True, "voiced_ms": 8100, "llm_requests": 1},
        {"noise": "street", "snr_db": 10, "ok": False, "error": "no answer heard"},
    ]
    session = {"clean": clean, "trials": [judge_trial(t, clean) for t in trials]}
    summary = impaired_summary("noisy", [session])
    assert (summary["cut"], summary["taken_as_turn"], summary["failed"]) == (1, 1, 1)
    assert (summary["cut_at_20_db"], summary["cut_at_10_db"]) == ("1 of 1", "0 of 1")
    assert "| pipecat | babble 20 dB | 7900 | yes | 2 |" in impaired_table(
        "noisy", {"vocable": summary, "pipecat": summary}, {"vocable": [], "pipecat": [session]}
    )
