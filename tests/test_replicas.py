"""A call reachable from any replica: two Vocable servers sharing a real redis-server.

The holder is a ``vocable serve`` process of its own (so it can be killed); the other replica
runs in the test's process. A call placed through the holder to sipp (a real SIP callee) is
followed, event by event, and hung up through the other; a killed holder's entries expire; with
Redis lost, the other replica says so (503) and recovers by itself once Redis is back.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from server.config.server import ServerConfig
from server.runtime.call_directory import KEY_PREFIX, TTL_S
from tests.conftest import REPO
from tests.support.calls import base_url, voice_server
from tests.support.processes import free_port, kill_group, run_vocable, spawn, until_ready
from tests.support.redis_server import RedisServer, running_redis, start_redis
from tests.support.sipp import sipp_callee

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@asynccontextmanager
async def _holder(redis_server: RedisServer) -> AsyncIterator[tuple[str, int]]:
    """``vocable serve --sip`` with the call directory, in a process of its own; yields its
    URL and process id."""
    port = free_port()
    process = await spawn(
        sys.executable,
        *("-m", "server", "serve", "--port", str(port), "--llm", "none", "--rate-limit", "0"),
        *("--sip", f"127.0.0.1:{free_port()}", "--redis-url", redis_server.url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=REPO,
    )
    assert process.stdout is not None
    try:
        await until_ready(process)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        kill_group(process.pid)
        await process.wait()


@asynccontextmanager
async def _replica(redis_url: str) -> AsyncIterator[TestServer]:
    async with voice_server(None, ServerConfig(redis_url=redis_url)) as server:
        yield server


async def _place(http: aiohttp.ClientSession, holder: str, uri: str) -> str:
    async with http.post(f"{holder}/calls", json={"to": uri, "playbook": "support"}) as placed:
        assert placed.status == 201, await placed.text()
        return str((await placed.json())["session_id"])


async def _follow(http: aiohttp.ClientSession, url: str, states: list[str]) -> None:
    """Read a call's event stream to its end, noting each ``call`` event's state."""
    async with http.get(url) as stream:
        assert stream.status == 200
        assert stream.content_type == "text/event-stream"
        async for line in stream.content:
            if line.startswith(b"data: "):
                event: dict[str, Any] = json.loads(line[6:])
                if event["type"] == "call":
                    states.append(event["state"])


async def test_a_call_placed_on_one_replica_is_followed_and_hung_up_on_another(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    async with (
        _holder(redis_server) as (holder, _),
        _replica(redis_server.url) as other,
        sipp_callee(tmp_path, "callee_answers") as (uri, finished),
        aiohttp.ClientSession() as http,
    ):
        session_id = await _place(http, holder, uri)
        entry = redis_server.client().get(KEY_PREFIX + session_id)
        assert entry == holder.encode()  # the holder's internal URL...
        async with http.get(f"{base_url(other)}/calls/{session_id}") as status:
            assert status.status == 200
            text = await status.text()
            assert json.loads(text)["session_id"] == session_id
            assert holder.removeprefix("http://") not in text  # ...never shown to a client
        states: list[str] = []
        following = asyncio.create_task(
            _follow(http, f"{base_url(other)}/calls/{session_id}/events", states)
        )
        async with asyncio.timeout(20):
            while "answered" not in states:  # noqa: ASYNC110 - the stream's task fills it
                await asyncio.sleep(0.05)
        started = time.monotonic()
        async with http.delete(f"{base_url(other)}/sessions/{session_id}") as hung_up:
            assert hung_up.status == 200, await hung_up.text()
        delete_ms = (time.monotonic() - started) * 1000
        await asyncio.wait_for(following, 20)  # the stream, relayed, ends with the call
        code, output = await finished()
        assert code == 0, output  # sipp got the holder's BYE
        async with http.get(f"{holder}/calls/{session_id}") as described:
            assert (await described.json())["reason"] == "hung up by the client"
    assert states[0] == "ringing"
    assert states[-1] == "ended"
    assert redis_server.client().get(KEY_PREFIX + session_id) is None
    assert delete_ms < 2000


async def test_a_killed_replicas_calls_leave_the_directory_within_its_expiry(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    async with (
        _replica(redis_server.url) as other,
        sipp_callee(tmp_path, "callee_rings") as (uri, _),
        aiohttp.ClientSession() as http,
    ):
        async with _holder(redis_server) as (holder, pid):
            session_id = await _place(http, holder, uri)
            async with asyncio.timeout(5):  # sipp rings at once
                while True:
                    async with http.get(f"{base_url(other)}/calls/{session_id}") as ringing:
                        if (await ringing.json())["state"] == "ringing":
                            break
                    await asyncio.sleep(0.05)
            kill_group(pid)
            killed_at = time.monotonic()
            async with http.get(f"{base_url(other)}/calls/{session_id}") as gone:
                assert gone.status == 503  # the entry is there, its replica is not
                assert "cannot be reached" in (await gone.json())["error"]
            async with asyncio.timeout(TTL_S + 5):
                while redis_server.client().exists(KEY_PREFIX + session_id):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
            expired_after = time.monotonic() - killed_at
        async with http.get(f"{base_url(other)}/calls/{session_id}") as unknown:
            assert unknown.status == 404
    assert expired_after <= TTL_S + 0.5


async def test_with_redis_lost_the_replica_says_so_and_recovers_by_itself() -> None:
    redis = start_redis()
    try:
        async with _replica(redis.url) as server, aiohttp.ClientSession() as http:
            url = f"{base_url(server)}/calls/no-such-call"
            async with http.get(url) as before:
                assert before.status == 404
            redis.stop()
            async with http.get(url) as lost:
                assert lost.status == 503
                assert "call directory is unreachable" in (await lost.json())["error"]
                assert lost.headers["Retry-After"]
            redis = start_redis(redis.port)
            async with asyncio.timeout(10):
                while True:
                    async with http.get(url) as back:
                        if back.status == 404:
                            break
                    await asyncio.sleep(0.2)
    finally:
        redis.stop()


async def test_serve_refuses_to_start_without_its_redis_in_one_line() -> None:
    port = free_port()
    code, _, err = await run_vocable(
        "serve", "--redis-url", f"redis://127.0.0.1:{port}/0", "--port", str(free_port())
    )
    assert code == 2
    assert err.strip().splitlines() == [
        f"vocable: cannot reach Redis at --redis-url: Error 111 connecting to 127.0.0.1:{port}."
        " Connection refused."
    ]
    code, _, err = await run_vocable("serve", "--redis-url", "redis://:secret@[bad")
    assert code == 2
    assert "--redis-url" in err
    assert "secret" not in err
