"""Overload is refused, not spread over everyone (``server/admission/load.py``).

The gauge is judged on samples fed with a test clock; then for real: a server whose event loop
is kept late refuses new WebRTC offers, media streams and SIP INVITEs with 503 and a
Retry-After, and takes calls again once the loop is on time.
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import aiohttp
import pytest
from aiortc import RTCPeerConnection
from aiortc.mediastreams import AudioStreamTrack

from media.audio import silence
from media.priority import BACKGROUND_NICENESS
from media.tts import LATER_NICENESS
from server.admission.load import LoadGauge
from server.admission.overload import OverloadSettings
from server.config.server import ServerConfig, SipSettings
from server.http.app import CALLS, SIP
from server.llm.llamacpp import LLM_NICENESS, ModelThreads
from server.runtime.memory import return_free_memory
from server.testkit.sip_phone import SipPhone
from tests.support.calls import synthesizer, transcriber, voice_server

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0

    def __call__(self) -> float:
        return self.now


def _gauge(settings: OverloadSettings, backlog: list[int]) -> tuple[LoadGauge, Clock]:
    clock = Clock()
    gauge = LoadGauge(
        settings, lambda: backlog[0], clock=clock, cpu_time=lambda: clock.cpu, cores=2
    )
    return gauge, clock


def _feed(
    gauge: LoadGauge, clock: Clock, seconds: float, lag_s: float, cpu_share: float = 0.0
) -> None:
    for _ in range(round(seconds / 0.1)):
        clock.now += 0.1
        clock.cpu += 0.1 * cpu_share * 2
        gauge.record(lag_s)


def test_nothing_is_refused_before_a_whole_window_is_measured() -> None:
    gauge, clock = _gauge(OverloadSettings(window_s=2.0), [0])
    _feed(gauge, clock, 1.0, lag_s=1.0)
    assert gauge.measured() == {}
    assert gauge.overload() is None


def test_a_loop_late_most_of_the_window_is_refused_and_a_spike_is_not() -> None:
    gauge, clock = _gauge(OverloadSettings(max_loop_lag_ms=150), [0])
    _feed(gauge, clock, 2.5, lag_s=0.01)
    for _ in range(5):  # five late ticks out of twenty: a spike
        _feed(gauge, clock, 0.1, lag_s=0.5)
    assert gauge.overload() is None
    _feed(gauge, clock, 2.0, lag_s=0.3)
    overload = gauge.overload()
    assert overload is not None
    assert overload.reason == "event loop 300 ms late (limit 150 ms)"
    assert overload.retry_after_s == 2


def test_retry_after_grows_with_how_long_the_overload_lasts_and_it_clears() -> None:
    gauge, clock = _gauge(OverloadSettings(max_loop_lag_ms=150), [0])
    _feed(gauge, clock, 2.0, lag_s=0.3)
    assert gauge.overload() is not None
    _feed(gauge, clock, 10.0, lag_s=0.3)
    overload = gauge.overload()
    assert overload is not None
    assert overload.retry_after_s == 12  # the window (2 s) and the 10 s it has lasted
    _feed(gauge, clock, 60.0, lag_s=0.3)
    assert gauge.overload().retry_after_s == 30  # type: ignore[union-attr]
    _feed(gauge, clock, 2.0, lag_s=0.0)
    assert gauge.overload() is None


def test_a_decode_backlog_counts_only_when_it_lasts() -> None:
    backlog = [5]
    gauge, clock = _gauge(OverloadSettings(max_decode_backlog=3), backlog)
    _feed(gauge, clock, 1.9, lag_s=0.0)
    backlog[0] = 0  # one moment with nothing waiting
    _feed(gauge, clock, 0.1, lag_s=0.0)
    backlog[0] = 5
    _feed(gauge, clock, 0.5, lag_s=0.0)
    assert gauge.overload() is None
    _feed(gauge, clock, 2.0, lag_s=0.0)
    overload = gauge.overload()
    assert overload is not None
    assert overload.reason == "5 decodes waiting (limit 3)"


def test_answers_waiting_for_speech_refuse_calls_when_it_lasts() -> None:
    """Piper's first-words pool behind: callers wait in silence with their answer's text
    ready; a moment of it refuses nothing, a window of it does."""
    waiting = [0]
    clock = Clock()
    gauge = LoadGauge(
        OverloadSettings(max_synthesis_backlog=3),
        lambda: 0,
        clock=clock,
        cpu_time=lambda: clock.cpu,
        cores=2,
        synthesis_backlog=lambda: waiting[0],
    )
    _feed(gauge, clock, 2.5, lag_s=0.0)
    waiting[0] = 6
    _feed(gauge, clock, 1.0, lag_s=0.0)
    assert gauge.overload() is None  # half a window
    _feed(gauge, clock, 1.5, lag_s=0.0)
    assert gauge.measured()["synthesis_backlog"] == 6
    overload = gauge.overload()
    assert overload is not None
    assert overload.reason == "6 answers waiting for speech (limit 3)"
    unchecked = LoadGauge(
        OverloadSettings(max_synthesis_backlog=0), lambda: 0, synthesis_backlog=lambda: 99
    )
    assert (
        unchecked._reason(
            {"loop_lag_ms": 0, "decode_backlog": 0, "cpu_percent": 0, "synthesis_backlog": 99}
        )
        is None
    )


def test_cpu_is_a_limit_only_when_set() -> None:
    gauge, clock = _gauge(OverloadSettings(), [0])
    _feed(gauge, clock, 2.5, lag_s=0.0, cpu_share=0.97)
    assert gauge.measured()["cpu_percent"] == pytest.approx(97, abs=1)
    assert gauge.overload() is None
    gauge, clock = _gauge(OverloadSettings(max_cpu_percent=90), [0])
    _feed(gauge, clock, 2.5, lag_s=0.0, cpu_share=0.97)
    assert gauge.overload().reason == "CPU at 97 % (limit 90 %)"  # type: ignore[union-attr]


async def test_the_whisper_pool_reports_decodes_waiting_for_a_worker() -> None:
    stt = transcriber().variant(workers=1)
    try:
        decodes = [asyncio.ensure_future(stt.transcribe(silence(1000))) for _ in range(3)]
        await asyncio.sleep(0)
        assert stt.backlog == 2  # one decoding, two waiting
        await asyncio.gather(*decodes)
        assert stt.backlog == 0
    finally:
        stt.close()


async def test_the_synthesizer_reports_first_words_waiting_for_a_worker() -> None:
    tts = synthesizer()
    assert tts.settings.workers == 1

    async def speak() -> int:
        return sum([len(pcm) async for pcm in tts.synthesize("Hello there.", urgent=True)])

    answers = [asyncio.ensure_future(speak()) for _ in range(3)]
    await asyncio.sleep(0)
    assert tts.backlog >= 2  # one worker: two at least wait (three, until it takes one)
    assert tts.backlog >= 1  # (the worker may take one meanwhile)
    assert all(await asyncio.gather(*answers))
    assert tts.backlog == 0


async def test_the_whisper_pool_tells_whether_anybody_else_keeps_it_busy() -> None:
    stt = transcriber().variant(workers=1)
    try:
        mine = [asyncio.ensure_future(stt.transcribe(silence(1000), owner="a")) for _ in range(2)]
        await asyncio.sleep(0)
        assert stt.has_idle_worker(besides="a")  # only a's own decodes, one of them waiting
        assert not stt.has_idle_worker(besides="b")
        assert not stt.has_idle_worker()
        await asyncio.gather(*mine)
        assert stt.has_idle_worker(besides="b")
        assert stt.has_idle_worker()
    finally:
        stt.close()


@contextmanager
def _late_loop() -> Iterator[None]:
    """Keep this event loop about 200 ms late: block it 200 ms at a time, as a process too
    busy for its calls does, until the block ends."""
    stop = False

    async def block() -> None:
        while not stop:
            time.sleep(0.2)  # noqa: ASYNC251 - blocking the loop is the point
            await asyncio.sleep(0.01)

    task = asyncio.ensure_future(block())
    try:
        yield
    finally:
        stop = True
        task.cancel()


async def _offer() -> str:
    pc = RTCPeerConnection()
    pc.addTrack(AudioStreamTrack())
    await pc.setLocalDescription(await pc.createOffer())
    sdp = str(pc.localDescription.sdp)
    await pc.close()
    return sdp


@asynccontextmanager
async def _server() -> AsyncIterator[tuple[str, int, aiohttp.ClientSession]]:
    settings = OverloadSettings(max_loop_lag_ms=100, window_s=1.0)
    config = ServerConfig(
        overload=settings, sip=SipSettings(host="127.0.0.1", port=0), rate_limit_per_min=0
    )
    async with voice_server(None, config) as server, aiohttp.ClientSession() as http:
        server.app[CALLS].load = LoadGauge(settings, lambda: 0, period_s=0.05)
        async with server.app[CALLS].load.running():
            yield str(server.make_url("")).rstrip("/"), server.app[SIP].port, http


async def test_an_overloaded_server_refuses_new_calls_on_every_transport() -> None:
    sdp = await _offer()
    async with _server() as (base, sip_port, http):
        with _late_loop():
            await asyncio.sleep(1.5)  # a whole window of it
            async with http.post(f"{base}/offer", json={"type": "offer", "sdp": sdp}) as refused:
                assert refused.status == 503
                assert "overloaded: event loop" in (await refused.json())["error"]
                assert 2 <= int(refused.headers["Retry-After"]) <= 30
            async with http.get(f"{base}/twilio/media") as stream:
                assert stream.status == 503
                assert "Retry-After" in stream.headers
            phone = await SipPhone.open(sip_port)
            try:
                answer = await phone.invite()
                assert answer.status_code == 503
                assert 2 <= int(answer.headers.get_first("retry-after") or "0") <= 30
            finally:
                await phone.close()
            async with http.get(f"{base}/healthz") as health:
                assert (await health.json())["refused_overloaded"] == 3
        await asyncio.sleep(1.5)  # on time again for a whole window
        async with http.post(f"{base}/offer", json={"type": "offer", "sdp": sdp}) as admitted:
            assert admitted.status == 200
            session_id = (await admitted.json())["session_id"]
        async with http.delete(f"{base}/sessions/{session_id}") as ended:
            assert ended.status == 200


def _costed(
    settings: OverloadSettings,
    calls: list[int],
    others: list[float] | None = None,
    *,
    quota: bool = False,
    in_turn: list[int] | None = None,
    model: list[float] | None = None,
) -> tuple[LoadGauge, Clock]:
    """A gauge of 2 cores on a test clock; ``others``: CPU seconds other processes took so far
    (None: not measured here), in the same control group under its quota when ``quota``."""
    clock = Clock()
    gauge = LoadGauge(
        settings,
        lambda: 0,
        clock=clock,
        cpu_time=lambda: clock.cpu,
        cores=2,
        calls=lambda: calls[0],
        calls_in_turn=None if in_turn is None else (lambda: in_turn[0]),
        model_cpu_time=(lambda: None) if model is None else (lambda: model[0]),
        cores_busy_time=(lambda: None) if others is None else (lambda: clock.cpu + others[0]),
        others_share_the_limit=quota,
    )
    return gauge, clock


def test_a_burst_is_refused_by_the_calls_measured_cost_before_its_load_shows() -> None:
    settings = OverloadSettings(capacity_cpu_percent=75, assumed_call_cpu_percent=15)
    calls = [0]
    gauge, clock = _costed(settings, calls)
    assert gauge.capacity() == 10  # 2 cores x 75 % / 15 % a call, until measured
    calls[0] = 2  # two calls talking, using 20 % of a core each (40 % of one core in all)
    _feed(gauge, clock, 60.0, lag_s=0.0, cpu_share=0.2)  # the estimate converges on it
    assert gauge.call_cost == pytest.approx(0.20, abs=0.001)
    assert gauge.capacity() == 7
    assert gauge.full(6) is None
    full = gauge.full(7)
    assert full is not None
    assert full.reason == "7 calls fill it (about 7 fit, at 20 % of a core each)"
    assert full.retry_after_s == 2
    # a burst arrives: its calls are idle so far, and the cost learned moves a little
    calls[0] = 7
    _feed(gauge, clock, 2.0, lag_s=0.0, cpu_share=0.2)
    assert gauge.call_cost >= 0.75 * 0.20
    assert gauge.full(9) is not None


def test_the_llm_in_the_process_is_counted_apart_from_the_calls() -> None:
    settings = OverloadSettings(capacity_cpu_percent=100, assumed_call_cpu_percent=15)
    model = [0.0]
    gauge, clock = _costed(settings, [2], model=model)
    for _ in range(600):  # two calls at 15 % of a core each, the model generating at 80 %
        clock.now += 0.1
        clock.cpu += 0.1 * (0.3 + 0.8)
        model[0] += 0.1 * 0.8
        gauge.record(0.0)
    assert gauge.call_cost == pytest.approx(0.15, abs=0.001)  # not 55 %
    assert gauge.model_load() == pytest.approx(0.8)
    assert gauge.capacity() == 8  # (2 cores - 0.8 of one) / 15 % a call
    full = gauge.full(8)
    assert full is not None
    assert (
        full.reason
        == "8 calls fill it (about 8 fit, at 15 % of a core each, the LLM taking 80 % of one)"
    )


def test_the_models_threads_are_those_at_its_niceness_not_the_later_sentences(
    tmp_path: Path,
) -> None:
    """llama.cpp's threads run LLM_NICENESS nicer than the process; Piper's later-sentence
    worker nicer still, and its CPU is the calls' (it was counted as the model's)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    ticks = os.sysconf("SC_CLK_TCK")
    threads = [
        (1, 0, 500),  # the event loop
        (2, LLM_NICENESS, 100),  # llama.cpp
        (3, LLM_NICENESS, 50),
        (4, BACKGROUND_NICENESS + LATER_NICENESS, 300),  # a later sentence
        (5, BACKGROUND_NICENESS, 200),  # Whisper
    ]
    for tid, nice, used in threads:
        fields = ["S", *["0"] * 10, str(used), "0", "0", "0", "20", str(base + nice)]
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "stat").write_text(f"{tid} (python3) {' '.join(fields)} 1 0\n")
    assert ModelThreads(tmp_path)() == pytest.approx(150 / ticks)


def _busy_neighbour(gauge: LoadGauge, clock: Clock, others: list[float]) -> None:
    for _ in range(30):  # 60 % of a core beside the server, for 3 s
        clock.now += 0.1
        clock.cpu += 0.1 * 0.3  # the server's two calls, 15 % of a core each
        others[0] += 0.1 * 0.6
        gauge.record(0.0)


def test_a_neighbour_outside_the_group_refuses_calls_only_by_their_symptoms() -> None:
    """Callers or another container on the same host: measured and reported, but the calls'
    room is the process's own; they refuse calls only once lag or backlog show it."""
    others = [0.0]
    settings = OverloadSettings(capacity_cpu_percent=75, assumed_call_cpu_percent=15)
    gauge, clock = _costed(settings, [2], others)
    _busy_neighbour(gauge, clock, others)
    assert gauge.others_load() == pytest.approx(0.6)
    assert gauge.measured()["others_cpu_percent"] == pytest.approx(30.0)
    assert gauge.capacity() == 10  # 2 cores x 75 % / 15 % a call: the neighbour takes none
    assert gauge.full(9) is None
    full = gauge.full(10)
    assert full is not None
    assert "other processes" not in full.reason
    for _ in range(25):  # now it starves the calls: the loop runs late
        clock.now += 0.1
        clock.cpu += 0.1 * 0.3
        others[0] += 0.1 * 0.6
        gauge.record(0.3)
    overload = gauge.overload()
    assert overload is not None
    assert overload.reason.startswith("event loop 300 ms late")


def test_under_a_quota_the_groups_other_processes_leave_room_for_fewer_calls() -> None:
    others = [0.0]
    settings = OverloadSettings(capacity_cpu_percent=75, assumed_call_cpu_percent=15)
    gauge, clock = _costed(settings, [2], others, quota=True)
    for _ in range(30):  # a sibling worker in the container: 60 % of a core of its quota
        clock.now += 0.1
        clock.cpu += 0.1 * 0.3  # the server's two calls, 15 % of a core each
        others[0] += 0.1 * 0.6
        gauge.record(0.0)
    assert gauge.others_load() == pytest.approx(0.6)
    assert gauge.measured()["others_cpu_percent"] == pytest.approx(30.0)
    assert gauge.capacity() == 6  # (2 cores x 75 % - 0.6 of a core) / 15 % a call, not 10
    full = gauge.full(6)
    assert full is not None
    assert full.reason == (
        "6 calls fill it (about 6 fit, at 15 % of a core each, other processes taking 60 % of one)"
    )
    for _ in range(30):  # the others stop: the room comes back
        clock.now += 0.1
        clock.cpu += 0.1 * 0.3
        gauge.record(0.0)
    assert gauge.capacity() == 10


def test_the_cost_is_learned_only_while_the_same_calls_are_live_and_in_turns() -> None:
    calls = [1]
    gauge, clock = _costed(OverloadSettings(assumed_call_cpu_percent=15), calls)
    for count in (1, 2, 3, 4):  # a call joins every 0.5 s: never a steady window
        calls[0] = count
        _feed(gauge, clock, 0.5, lag_s=0.0, cpu_share=0.5)
    assert gauge.call_cost == pytest.approx(0.15)
    calls, in_turn = [10], [10]
    gauge, clock = _costed(OverloadSettings(), calls, in_turn=in_turn)
    _feed(gauge, clock, 60.0, lag_s=0.0, cpu_share=1.0)  # ten calls talking: 20 % of a core each
    assert gauge.call_cost == pytest.approx(0.20, abs=0.001)
    in_turn[0] = 2  # then they sit in silence between turns, at 6 % each: that is not the cost
    _feed(gauge, clock, 60.0, lag_s=0.0, cpu_share=0.3)
    assert gauge.call_cost > 0.18  # (only the window astride the change taught it)
    assert gauge.capacity() == 10  # not 33 (2 cores / 6 %): all ten may talk at once again
    unchecked, _ = _costed(OverloadSettings(capacity_cpu_percent=0), calls)
    assert unchecked.full(100) is None


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_memory_can_be_handed_back_to_the_system() -> None:
    assert return_free_memory() is True
