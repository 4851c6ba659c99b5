"""Operating ``vocable serve``: admission rate limits, SIGTERM drain, ``--workers``, JSON logs.

The process tests run the real command in a child process against the scripted LLM, with real
aiortc callers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from ipaddress import ip_network
from pathlib import Path

import aiohttp
import pytest

from server.admission.ratelimit import RateLimited, RateLimiter, client_address
from server.http.siblings import control_socket, merge_metrics, worker_of
from server.runtime.logs import JsonFormatter, bind_session, configure_logging
from server.testkit.caller import WebRTCCaller
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from tests.conftest import REPO
from tests.support.calls import quick_playbook
from tests.support.models import smollm2_gguf
from tests.support.processes import spawn, stop_group

# -- rate limits -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_admitted_then_one_call_per_refill() -> None:
    clock = Clock()
    limiter = RateLimiter(per_minute=6, burst=2, clock=clock)
    limiter.check("10.0.0.1")
    limiter.check("10.0.0.1")
    with pytest.raises(RateLimited) as refused:
        limiter.check("10.0.0.1")
    assert refused.value.retry_after_s == pytest.approx(10)
    limiter.check("10.0.0.2")  # another address has its own bucket
    clock.now = 10.0
    limiter.check("10.0.0.1")
    with pytest.raises(RateLimited):
        limiter.check("10.0.0.1")


def test_the_limiter_forgets_the_least_recent_addresses_first() -> None:
    limiter = RateLimiter(per_minute=1, burst=1, max_keys=100, clock=Clock())
    for n in range(1000):
        limiter.check(f"10.0.{n // 256}.{n % 256}")
    assert len(limiter._buckets) == 100
    with pytest.raises(RateLimited):
        limiter.check("10.0.3.231")  # among the last 100: remembered


def test_no_limit_when_the_rate_is_zero() -> None:
    limiter = RateLimiter(per_minute=0)
    for _ in range(1000):
        limiter.check("10.0.0.1")


def test_the_client_behind_a_trusted_proxy_is_the_last_untrusted_hop() -> None:
    proxies = (ip_network("10.0.0.0/8"),)
    assert client_address("203.0.113.5", "1.2.3.4", proxies) == "203.0.113.5"  # not a proxy
    assert client_address("10.0.0.2", "198.51.100.7", proxies) == "198.51.100.7"
    # a client cannot pick its address by sending its own X-Forwarded-For
    assert client_address("10.0.0.2", "1.1.1.1, 198.51.100.7, 10.0.0.3", proxies) == (
        "198.51.100.7"
    )
    assert client_address("10.0.0.2", "", proxies) == "10.0.0.2"
    assert client_address("10.0.0.2", "garbage", proxies) == "10.0.0.2"
    assert client_address("10.0.0.2", "198.51.100.7", ()) == "10.0.0.2"  # none trusted


# -- workers: routing and metrics ----------------------------------------------------------------


def test_call_ids_name_their_worker() -> None:
    assert worker_of("w3.abcdef") == 3
    assert worker_of("abcdef") is None
    assert worker_of("w.abc") is None


def test_metrics_of_several_workers_merge_under_a_worker_label() -> None:
    text = (
        "# HELP vocable_turns_total Turns.\n# TYPE vocable_turns_total counter\n"
        "vocable_turns_total {value}\n"
    )
    merged = merge_metrics({0: text.format(value=3), 1: text.format(value=4)}).decode()
    assert merged.count("# TYPE vocable_turns_total counter") == 1
    assert 'vocable_turns_total{worker="0"} 3.0' in merged
    assert 'vocable_turns_total{worker="1"} 4.0' in merged


# -- logs --------------------------------------------------------------------------------------


def test_json_log_lines_carry_the_session_of_the_task_that_logged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("json")
    try:

        async def call(session_id: str) -> None:
            bind_session(session_id)
            await asyncio.create_task(asyncio.sleep(0))  # a task started by the call
            await asyncio.create_task(_warn(f"in {session_id}"))

        async def both() -> None:
            await asyncio.gather(call("w0.first"), call("w0.second"))
            logging.getLogger("server.test").warning("outside any call")

        asyncio.run(both())
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        configure_logging("text")
    by_message = {line["message"]: line for line in lines}
    assert by_message["in w0.first"]["session_id"] == "w0.first"
    assert by_message["in w0.second"]["session_id"] == "w0.second"
    assert "session_id" not in by_message["outside any call"]
    assert by_message["in w0.first"]["level"] == "warning"
    assert by_message["in w0.first"]["logger"] == "server.test"


async def _warn(message: str) -> None:
    logging.getLogger("server.test").warning(message)


def test_json_lines_keep_tracebacks_in_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "server.x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


# -- the real process ----------------------------------------------------------------------------


@dataclass
class Served:
    process: asyncio.subprocess.Process
    base: str
    lines: list[str] = field(default_factory=list)

    async def wait_line(self, text: str, timeout_s: float = 120) -> str:
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout_s):
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                raw = await self.process.stdout.readline()
                assert raw, f"the server exited before printing {text!r}: {self.lines}"
                self.lines.append(raw.decode())

    async def get(self, path: str) -> tuple[int, dict[str, object]]:
        async with aiohttp.ClientSession() as http, http.get(self.base + path) as response:
            return response.status, await response.json()


async def start_serve(
    port: int, llm: ScriptedLLM | Path, *flags: str, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    """``vocable serve`` in a child process on ``port`` with the scripted LLM (or a GGUF model
    in process), stdout and stderr piped; ``env`` None: the test's environment without
    Vocable's and OpenAI's settings."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VOCABLE_", "OPENAI_"))}
    if isinstance(llm, Path):
        llm_flags = ["--llm-gguf", str(llm)]
    else:
        llm_flags = ["--llm-base-url", llm.base_url, "--llm-model", "scripted"]
    return await spawn(
        sys.executable,
        "-m",
        "server",
        "serve",
        "--port",
        str(port),
        *llm_flags,
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env=env,
    )


@asynccontextmanager
async def served(port: int, llm: ScriptedLLM | Path, *flags: str) -> AsyncIterator[Served]:
    process = await start_serve(port, llm, *flags)
    server = Served(process, f"http://127.0.0.1:{port}")
    try:
        yield server
    finally:
        await stop_group(process)


async def _hang_up(caller: WebRTCCaller) -> None:
    """End the call from the caller's side, as the web client's Hang up button does."""
    caller.send({"type": "hangup"})
    await caller.wait_for("hangup", timeout_s=10)
    await caller.close()


async def _stop(server: Served, timeout_s: float = 30) -> str:
    """SIGTERM; the server's stderr once it has exited."""
    server.process.send_signal(signal.SIGTERM)
    out, err = await asyncio.wait_for(server.process.communicate(), timeout_s)
    server.lines += out.decode().splitlines(keepends=True)
    return err.decode()


@pytest.mark.slow
async def test_sigterm_drains_live_calls_then_exits(
    unused_tcp_port: int, llm: ScriptedLLM, tmp_path: Path
) -> None:
    llm.script(answers_by_words({"still": "Yes, I am still here."}, "Hello."))
    flags = ("--drain-timeout-s", "20", "--playbook", str(quick_playbook(tmp_path)))
    async with served(unused_tcp_port, llm, *flags) as server:
        await server.wait_line("ready")
        caller = WebRTCCaller()
        try:
            await caller.connect(server.base, playbook="quick")
            await caller.wait_for("tts_end", timeout_s=30)  # the greeting
            server.process.send_signal(signal.SIGTERM)
            await server.wait_line("draining: 1 call(s)")
            status, health = await server.get("/healthz")
            assert (status, health["status"]) == (503, "draining")
            latecomer = WebRTCCaller()
            try:
                with pytest.raises(RuntimeError, match="503"):
                    await latecomer.connect(server.base, playbook="quick")
            finally:
                await latecomer.close()
            # the live call goes on: it is still answered
            caller.send({"type": "text", "text": "Are you still there?"})
            await caller.wait_for("tts_end", count=2, timeout_s=30)
            assert caller.of_type("agent_sentence")[-1]["text"] == "Yes, I am still here."
            await _hang_up(caller)  # the last call ends: the server exits without waiting more
        finally:
            await caller.close()
        async with asyncio.timeout(15):
            _, err = await server.process.communicate()
    assert server.process.returncode == 0, err.decode()
    assert b"Traceback" not in err


@pytest.mark.slow
async def test_a_drain_timeout_hangs_up_what_is_left(
    unused_tcp_port: int, llm: ScriptedLLM
) -> None:
    async with served(unused_tcp_port, llm, "--drain-timeout-s", "0.5") as server:
        await server.wait_line("ready")
        caller = WebRTCCaller()
        try:
            await caller.connect(server.base, playbook="support")
            await caller.wait_for("agent_sentence", timeout_s=30)
            err = await _stop(server)
            hangup = await caller.wait_for("hangup", timeout_s=5)
        finally:
            await caller.close()
    assert hangup["reason"] == "server shutting down"
    assert server.process.returncode == 0, err
    assert any("hanging up 1 call(s)" in line for line in server.lines)


@pytest.mark.slow
async def test_the_offer_rate_limit_answers_429_with_retry_after(
    unused_tcp_port: int, llm: ScriptedLLM
) -> None:
    flags = ("--rate-limit", "1", "--rate-limit-burst", "1")
    async with served(unused_tcp_port, llm, *flags) as server:
        await server.wait_line("ready")
        first, second = WebRTCCaller(), WebRTCCaller()
        try:
            await first.connect(server.base, playbook="support")
            with pytest.raises(RuntimeError, match="429") as refused:
                await second.connect(server.base, playbook="support")
            await first.wait_for("agent_sentence", timeout_s=30)  # the data channel is open
            await _hang_up(first)
        finally:
            await first.close()
            await second.close()
        assert "too many new calls from 127.0.0.1" in str(refused.value)
        await _stop(server)


async def _worker_pids(server: Served) -> dict[int, int]:
    """The pid of each worker, asking ``/healthz`` until both answered (the kernel spreads new
    connections)."""
    pids: dict[int, int] = {}
    for _ in range(40):
        _, health = await server.get("/healthz")
        process = health["process"]
        assert isinstance(process, dict)
        assert isinstance(health["worker"], int)
        pids[health["worker"]] = process["pid"]
    return pids


HANGUPS = 20


@pytest.mark.slow
async def test_workers_share_the_port_and_route_hangups_and_metrics(
    unused_tcp_port: int, llm: ScriptedLLM
) -> None:
    async with served(unused_tcp_port, llm, "--workers", "2") as server:
        await server.wait_line("vocable[w0]: ready", timeout_s=180)
        await server.wait_line("vocable[w1]: ready", timeout_s=180)
        pids = await _worker_pids(server)
        assert set(pids) == {0, 1}
        assert len(set(pids.values())) == 2
        async with aiohttp.ClientSession() as http:
            workers: set[int | None] = set()
            metrics_checked = False
            for _ in range(HANGUPS):
                # hung up at once, while its peer connection (and events channel) may still be
                # connecting, by whichever worker takes the DELETE: the call ends, and the
                # caller is told
                caller = WebRTCCaller()
                try:
                    await caller.connect(server.base, playbook="support")
                    workers.add(worker_of(caller.session_id))
                    if not metrics_checked:
                        async with http.get(server.base + "/metrics") as response:
                            metrics = await response.text()
                        assert 'vocable_sessions_total{worker="0"}' in metrics
                        assert 'vocable_sessions_total{worker="1"}' in metrics
                        metrics_checked = True
                    events = await _events_from_the_other_worker(server, caller.session_id)
                    url = f"{server.base}/sessions/{caller.session_id}"
                    async with http.delete(url) as response:
                        assert response.status == 200, await response.text()
                    hangup = await caller.wait_for("hangup", timeout_s=10)
                    assert hangup["reason"] == "hung up by the client"
                    relayed = await asyncio.wait_for(events, timeout=10)
                    assert relayed[-1]["type"] == "hangup", relayed  # and the stream ended
                    assert relayed[-1]["reason"] == "hung up by the client"
                    async with http.delete(url) as response:
                        assert response.status == 404  # and it is gone
                finally:
                    await caller.close()
            assert workers == {0, 1}
        err = await _stop(server, timeout_s=60)
    assert server.process.returncode == 0, err
    assert "Traceback" not in err


async def _events_from_the_other_worker(
    server: Served, call_id: str
) -> asyncio.Task[list[dict[str, object]]]:
    """``GET /calls/{id}/events`` sent to the worker that does not hold the call (over its
    control socket), once its stream has started: a task giving the items until it ends."""
    port = int(server.base.rsplit(":", 1)[1])
    other = control_socket(port, 1 - (worker_of(call_id) or 0))
    http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(other)))
    response = await http.get(f"http://worker/calls/{call_id}/events")
    assert response.status == 200, await response.text()
    assert response.content_type == "text/event-stream"

    async def read() -> list[dict[str, object]]:
        items = []
        try:
            async for line in response.content:
                if line.startswith(b"data: "):
                    items.append(json.loads(line[6:]))
        finally:
            response.release()
            await http.close()
        return items

    return asyncio.create_task(read())


@pytest.mark.slow
async def test_workers_share_the_supervisors_model_and_die_with_it(unused_tcp_port: int) -> None:
    gguf = smollm2_gguf()
    async with served(unused_tcp_port, gguf, "--workers", "2") as server:
        await server.wait_line("vocable[w0]: ready", timeout_s=180)
        await server.wait_line("vocable[w1]: ready", timeout_s=180)
        pids = set((await _worker_pids(server)).values())
        assert len(pids) == 2
        # one copy of the weights: llama.cpp maps the file in the supervisor, in no worker
        assert _maps(server.process.pid, gguf)
        assert not any(_maps(pid, gguf) for pid in pids)
        _, health = await server.get("/healthz")
        llm = health["llm"]
        assert isinstance(llm, dict)
        assert (llm["state"], llm["source"]) == ("ready", "embedded")
        assert "supervisor" in llm["detail"]
        caller = WebRTCCaller()
        try:  # a live call does not keep its worker up
            await caller.connect(server.base, playbook="support")
            await caller.wait_for("state", timeout_s=30)
            os.kill(server.process.pid, signal.SIGKILL)  # not its group: only the supervisor
            await asyncio.wait_for(server.process.wait(), 30)
            async with asyncio.timeout(10):
                await asyncio.gather(*(_exited(pid) for pid in pids))
            with socket.create_server(("127.0.0.1", unused_tcp_port)):
                pass  # the port is free again
            await caller.wait_for("hangup", timeout_s=10)
        finally:
            await caller.close()


def _maps(pid: int, file: Path) -> bool:
    """Whether process ``pid`` has ``file`` mapped into its memory."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any(line.rstrip().endswith(str(file.resolve())) for line in maps.splitlines())


async def _exited(pid: int) -> None:
    """Until process ``pid`` (not necessarily a child of this one) has exited."""
    try:
        descriptor = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    exited = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(descriptor, exited.set)  # a pidfd turns readable when its process exits
    try:
        await exited.wait()
    finally:
        loop.remove_reader(descriptor)
        os.close(descriptor)


@pytest.mark.slow
async def test_secrets_never_reach_the_logs(
    unused_tcp_port: int, llm: ScriptedLLM, tmp_path: Path
) -> None:
    secrets = {"token": "tok-7f3a9c", "key": "sk-live-5b2e8d", "turn": "turn-pass-4c1d"}
    llm.script(answers_by_words({}, "Hello."))
    # the TURN server over TCP: its closed port refuses at once, and the server's ICE gathering
    # goes on without it (over UDP it waits 5 s for an answer that never comes)
    flags = (
        "--log-format", "json", "--auth-token", secrets["token"], "--llm-api-key", secrets["key"],
        "--ice-server", "turn:127.0.0.1:3478?transport=tcp", "--turn-username", "vocable",
        "--turn-credential", secrets["turn"], "--playbook", str(quick_playbook(tmp_path)),
    )  # fmt: skip
    async with served(unused_tcp_port, llm, *flags) as server:
        await server.wait_line("ready")
        async with aiohttp.ClientSession() as http:
            wrong = {"Authorization": "Bearer tok-wrong"}
            async with http.post(f"{server.base}/offer", json={}, headers=wrong) as response:
                assert response.status == 401
                assert secrets["token"] not in await response.text()
            right = {"Authorization": f"Bearer {secrets['token']}"}
            bad_sdp = {"type": "offer", "sdp": "v=0\r\nm=audio 9 x\r\n"}
            async with http.post(f"{server.base}/offer", json=bad_sdp, headers=right) as response:
                assert response.status == 400
        caller = WebRTCCaller()
        try:  # a whole call, with its LLM request, under the token
            await caller.connect(server.base, token=secrets["token"], playbook="quick")
            await caller.wait_for("tts_end", timeout_s=30)
            caller.send({"type": "text", "text": "Hi there."})
            await caller.wait_for("tts_end", count=2, timeout_s=30)
            await _hang_up(caller)
        finally:
            await caller.close()
        err = await _stop(server)
    assert llm.requests  # the key was used...
    output = err + "".join(server.lines)
    for secret in secrets.values():  # ...and never written out
        assert secret not in output
    for line in err.splitlines():
        json.loads(line)  # every log line is JSON
