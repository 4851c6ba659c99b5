"""The browser harness's arithmetic (``benchmarks.browser_calls``): how a page's turn and the
server's figures of it become the way in, the way out and the gap (the Chromium runs themselves
are benchmarks, not tests; the page's measurement is tested in ``test_browser``), and the relay
that adds network jitter to them."""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.browser_calls import _turn, browser_markdown, summarize_browser
from benchmarks.jitter import JitterRelay

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


class _Echo(asyncio.DatagramProtocol):
    """A UDP peer that answers each datagram with itself: the server behind the relay."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(data, addr)  # type: ignore[attr-defined]


class _Page(asyncio.DatagramProtocol):
    def __init__(self, expected: int) -> None:
        self.heard: list[tuple[bytes, float]] = []
        self.all_heard = asyncio.Event()
        self.expected = expected

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.heard.append((data, asyncio.get_running_loop().time()))
        if len(self.heard) == self.expected:
            self.all_heard.set()


async def test_the_jitter_relay_delays_each_datagram_both_ways_in_order() -> None:
    loop = asyncio.get_running_loop()
    server, _ = await loop.create_datagram_endpoint(_Echo, local_addr=("127.0.0.1", 0))
    relay = JitterRelay(server.get_extra_info("sockname"), delay_ms=(20, 40))
    port = await relay.start()
    page = _Page(expected=10)
    sender, _ = await loop.create_datagram_endpoint(lambda: page, local_addr=("127.0.0.1", 0))
    try:
        sent = {}
        for n in range(10):  # a packet every 5 ms: delays of 20-40 ms would reorder them
            sent[bytes([n])] = loop.time()
            sender.sendto(bytes([n]), ("127.0.0.1", port))
            await asyncio.sleep(0.005)
        await asyncio.wait_for(page.all_heard.wait(), 5)
        assert [data for data, _ in page.heard] == [bytes([n]) for n in range(10)]
        round_trips_ms = [(at - sent[data]) * 1000 for data, at in page.heard]
        assert all(40 <= ms < 200 for ms in round_trips_ms), round_trips_ms  # 20-40 each way
        assert len({round(ms) for ms in round_trips_ms}) > 1  # not one fixed delay
    finally:
        sender.close()
        relay.close()
        server.close()
