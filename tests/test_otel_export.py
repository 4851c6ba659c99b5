"""``--otel``: per-turn traces exported over OTLP/HTTP, end to end, to a small OTLP/HTTP
collector in the test (``tests.support.otlp_collector``) that decodes what it receives.

- ``vocable serve --otel`` runs in a child process, its exporter pointed at the collector by
  ``OTEL_EXPORTER_OTLP_ENDPOINT``; a real aiortc caller speaks a question that Whisper
  transcribes, the scripted LLM answers and Piper speaks; SIGTERM stops it. The exported trace is
  checked against the ``turn_metrics`` event the caller saw.
- In process, ``ServerConfig(otel=True)``: the app's own cleanup flushes the batched spans.
- Without the ``otel`` extra importable, ``serve --otel`` stops with a line saying what to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from server.config.server import ServerConfig
from server.runtime.tracing import STAGES
from server.testkit.caller import WebRTCCaller
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from tests.conftest import REPO
from tests.support.calls import piper_speech, quick_playbook, synthesize_ahead, voice_server
from tests.support.otlp_collector import OtlpCollector, collector_in_thread
from tests.support.processes import spawn
from tests.test_operations import start_serve

QUESTION = "Hello, where is my parcel?"
ANSWER = "It left today."  # the trace is of the turn, whatever it says: a short one
OTEL_EXTRA_MISSING = "--otel needs the otel extra: pip install 'vocable[otel]'"


def _otel_and_proxy_variables() -> list[str]:
    """Environment variables that could redirect or disable the exporter."""
    return [k for k in os.environ if k.startswith("OTEL_") or k.lower().endswith("_proxy")]


def _clean_env() -> dict[str, str]:
    """The test's environment without anything that could redirect the server or its exporter
    (Vocable's and OpenAI's settings, OpenTelemetry's, proxies)."""
    dropped = set(_otel_and_proxy_variables())
    return {
        k: v
        for k, v in os.environ.items()
        if k not in dropped and not k.startswith(("VOCABLE_", "OPENAI_"))
    }


@dataclass
class OtelServer:
    """``vocable serve --otel`` in a child process; its output is read as it comes."""

    process: asyncio.subprocess.Process
    base: str
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    readers: list[asyncio.Task[None]] = field(default_factory=list)

    async def wait_ready(self, timeout_s: float = 120) -> None:
        async with asyncio.timeout(timeout_s):
            while not any("ready" in line for line in self.out):
                assert self.process.returncode is None, f"the server exited: {self.err}"
                await asyncio.sleep(0.1)

    async def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, as an orchestrator stops it; the exit code once it has exited and its
        output has been read to the end."""
        self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(timeout_s):
            code = await self.process.wait()
            await asyncio.gather(*self.readers)
        return code


async def _read(stream: asyncio.StreamReader | None, lines: list[str]) -> None:
    assert stream is not None
    while line := await stream.readline():
        lines.append(line.decode(errors="replace"))


@asynccontextmanager
async def otel_server(
    port: int, llm: ScriptedLLM, collector: OtlpCollector, playbook: Path
) -> AsyncIterator[OtelServer]:
    env = {
        **_clean_env(),
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        # a batch is due only after 10 minutes: whatever arrives was flushed at shutdown
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
        "NO_PROXY": "127.0.0.1",
    }
    process = await start_serve(port, llm, "--otel", "--playbook", str(playbook), env=env)
    server = OtelServer(process, f"http://127.0.0.1:{port}")
    # read both pipes all along: a full pipe would stall the server
    server.readers = [
        asyncio.create_task(_read(process.stdout, server.out)),
        asyncio.create_task(_read(process.stderr, server.err)),
    ]
    try:
        yield server
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        for reader in server.readers:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


@pytest.mark.slow
async def test_serve_with_otel_exports_a_spoken_turn_as_a_trace_over_otlp_http(
    unused_tcp_port: int, llm: ScriptedLLM, tmp_path: Path
) -> None:
    synthesize_ahead(QUESTION)
    llm.script(answers_by_words({"parcel": ANSWER}, "Go on."))
    async with (
        OtlpCollector() as collector,
        otel_server(unused_tcp_port, llm, collector, quick_playbook(tmp_path)) as server,
    ):
        await server.wait_ready()
        started_ns = time.time_ns()
        caller = WebRTCCaller()
        try:
            await caller.connect(server.base, playbook="quick")
            await caller.wait_for("tts_end", timeout_s=30)  # the greeting
            caller.say(piper_speech(QUESTION))
            metrics = await caller.wait_for("turn_metrics", timeout_s=40)
            await caller.wait_for("tts_end", count=2, timeout_s=40)
            caller.send({"type": "hangup"})
            await caller.wait_for("hangup", timeout_s=10)
        finally:
            await caller.close()
        (transcript,) = caller.of_type("transcript")
        assert "parcel" in transcript["text"].lower()
        assert collector.requests == [], "a batch left before it was due"
        code = await server.stop()
        stopped_ns = time.time_ns()
        stderr = "".join(server.err)
        assert code == 0, stderr
        assert "Traceback" not in stderr
        assert collector.refused == []

    spans = collector.spans()
    assert spans, f"the collector received no span; the server said: {stderr}"
    assert {s.resource.get("service.name") for s in spans} == {"vocable"}
    assert {s.scope for s in spans} == {"vocable"}

    # one spoken turn (the greeting answers no turn): one trace, the turn and its six stages
    (turn,) = [s for s in spans if s.name == "turn"]
    assert len(caller.of_type("turn_metrics")) == 1
    assert turn.span.parent_span_id == b""  # a root span
    assert turn.attributes["vocable.session_id"] == caller.session_id
    assert turn.attributes["vocable.voice_to_voice_ms"] == metrics["voice_to_voice_ms"]
    stages = [s for s in spans if s.name != "turn"]
    assert all(s.span.trace_id == turn.span.trace_id for s in stages)
    assert all(s.span.parent_span_id == turn.span.span_id for s in stages)
    stages.sort(key=lambda s: s.span.start_time_unix_nano)
    assert [s.name for s in stages] == [name for _, name in STAGES]
    for (key, name), stage in zip(STAGES, stages, strict=True):
        assert stage.duration_ms == pytest.approx(metrics[key], abs=0.01), name

    # the hops are laid end to end, and the turn spans them, at the wall-clock time of the call
    for earlier, later in itertools.pairwise(stages):
        assert earlier.span.end_time_unix_nano == later.span.start_time_unix_nano
    assert turn.span.start_time_unix_nano == stages[0].span.start_time_unix_nano
    assert turn.span.end_time_unix_nano == stages[-1].span.end_time_unix_nano
    assert turn.duration_ms == pytest.approx(sum(s.duration_ms for s in stages), abs=0.01)
    assert started_ns < turn.span.start_time_unix_nano < turn.span.end_time_unix_nano < stopped_ns


@pytest.mark.slow
async def test_the_app_flushes_the_batched_spans_when_it_closes(
    llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In process, ``ServerConfig(otel=True)``: the spans are at the collector as soon as the
    app's cleanup has run, not at interpreter exit. The provider flushes synchronously on the
    app's loop, so the collector runs on a loop of its own."""
    for name in _otel_and_proxy_variables():
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    llm.script(answers_by_words({"parcel": ANSWER}, "Go on."))
    with collector_in_thread() as collector:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
        config = ServerConfig(otel=True)
        async with voice_server(llm.base_url, config, quick_playbook(tmp_path)) as server:
            caller = WebRTCCaller()
            try:
                await caller.connect(str(server.make_url("")).rstrip("/"), playbook="quick")
                await caller.wait_for("tts_end", timeout_s=30)  # the greeting
                caller.send({"type": "text", "text": QUESTION})
                metrics = await caller.wait_for("turn_metrics", timeout_s=30)
                await caller.wait_for("tts_end", count=2, timeout_s=30)
            finally:
                await caller.close()
            assert collector.requests == [], "a batch left before it was due"
        spans = collector.spans()
        assert spans, "no span had reached the collector when the app had closed"
        assert collector.refused == []

    (turn,) = [s for s in spans if s.name == "turn"]
    assert turn.resource["service.name"] == "vocable"
    assert turn.attributes["vocable.session_id"] == caller.session_id
    stages = sorted(
        (s for s in spans if s.name != "turn"), key=lambda s: s.span.start_time_unix_nano
    )
    assert all(s.span.parent_span_id == turn.span.span_id for s in stages)
    # a typed turn: no end of speech, no STT; the hops it did have, each as long as measured
    typed = [(key, name) for key, name in STAGES if metrics[key] is not None]
    assert [name for _, name in typed] == [s.name for s in stages]
    assert {"end_of_speech", "stt"}.isdisjoint(s.name for s in stages)
    assert "first_frame_out" in {s.name for s in stages}
    for (key, name), stage in zip(typed, stages, strict=True):
        assert stage.duration_ms == pytest.approx(metrics[key], abs=0.01), name


async def _serve_otel(blocked: str, playbook: Path) -> tuple[int | None, str]:
    """``vocable serve --otel --playbook PLAYBOOK`` with the module ``blocked`` (if any) made
    unimportable in the child only: a ``None`` entry in ``sys.modules`` makes ``import`` raise
    ImportError. The exit code and stderr."""
    runner = (
        "import sys\n"
        "if sys.argv[1]:\n"
        "    sys.modules[sys.argv[1]] = None\n"
        "from server.cli import main\n"
        "sys.exit(main(sys.argv[2:]))\n"
    )
    process = await spawn(
        sys.executable,
        "-c",
        runner,
        blocked,
        "serve",
        "--otel",
        "--playbook",
        str(playbook),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env=_clean_env(),
    )
    _, err = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode, err.decode()


@pytest.mark.parametrize("missing", ["opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk"])
async def test_serve_with_otel_without_the_extra_says_how_to_install_it(
    missing: str, tmp_path: Path
) -> None:
    code, err = await _serve_otel(missing, tmp_path / "absent.yaml")
    assert (code, err.strip()) == (2, f"vocable: {OTEL_EXTRA_MISSING}")


async def test_serve_with_otel_and_the_extra_gets_past_that_check(tmp_path: Path) -> None:
    """The same command, nothing blocked: it stops at the next check, the missing playbook (so
    no server is started), not at the extra."""
    absent = tmp_path / "absent.yaml"
    code, err = await _serve_otel("", absent)
    assert code == 2
    assert OTEL_EXTRA_MISSING not in err
    assert str(absent) in err
