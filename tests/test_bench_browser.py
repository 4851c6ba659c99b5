"""The browser harness's arithmetic (``benchmarks.browser_calls``): how a page's turn and the
server's figures of it become the way in, the way out and the gap (the Chromium runs themselves
are benchmarks, not tests; the page's measurement is tested in ``test_browser``)."""

from __future__ import annotations

from typing import Any

from benchmarks.browser_calls import _turn, browser_markdown, summarize_browser

OFFSET_MS = 1_700_000_000_000.0
"""Wall clock less monotonic clock, as the harness would find it."""


def _page_turn(server_voiced: float, first_out: float, voiced: float, onset: float) -> Any:
    """A page's turn: the server's times on the monotonic clock, the page's on the wall clock."""
    return {
        "heard_ms": onset - voiced + 30,
        "graph_ms": onset - voiced,
        "output_latency_ms": 30,
        "server": {"t_ms": first_out, "voice_to_voice_ms": first_out - server_voiced},
        "speech_end": {"last_voiced_ms": server_voiced},
        "onset_unix_ms": onset + OFFSET_MS,
        "last_voiced_unix_ms": voiced + OFFSET_MS,
    }


def test_a_turn_is_split_into_the_way_in_and_the_way_out() -> None:
    # the caller stops at 1000 (page), the server hears it at 1030, answers at 1500, and the
    # page hears the answer at 1540
    turn = _turn(0, 0, _page_turn(1030, 1500, 1000, 1540), OFFSET_MS)
    assert (turn["uplink_ms"], turn["downlink_ms"]) == (30, 40)
    assert turn["graph_ms"] - turn["server_v2v_ms"] == turn["uplink_ms"] + turn["downlink_ms"]
    assert turn["heard_ms"] == 570  # with the output device's 30 ms


def test_a_level_summary_takes_percentiles_and_the_receivers_delays() -> None:
    turns = [_turn(0, n, _page_turn(1030, 1500, 1000, 1540 + n), OFFSET_MS) for n in range(5)]
    inbound = {
        "jitterBufferDelay": 30.0,
        "jitterBufferTargetDelay": 20.0,
        "jitterBufferEmittedCount": 1000,
        "totalSamplesReceived": 1000,
        "concealedSamples": 10,
        "jitter": 0.002,
    }
    level = {
        "calls": 1,
        "pages": [{"turns": turns, "stats": {"inbound": inbound}, "client_cpu_percent": 20.0}],
    }
    summary = summarize_browser(level)
    assert summary["heard_ms"] == {"p50": 572.0, "p95": 574.0, "n": 5}
    assert summary["gap_ms"]["p50"] == 72.0
    assert (summary["jitter_buffer_ms"], summary["jitter_buffer_target_ms"]) == (30.0, 20.0)
    assert (summary["concealed_percent"], summary["arrival_jitter_ms"]) == (1.0, 2.0)
    run = {
        "command": "python -m benchmarks --client chromium",
        "git_commit": "abc",
        "machine": {"cpu": "CPU"},
        "started_at": "now",
        "settings": {"browser_audio_processing": False},
        "summary": [{**summary, "on_arrival_ms": {"p50": 500.0, "p95": 520.0}}],
    }
    assert "| 1 | 572 / 574 ms (5) |" in browser_markdown(run)
