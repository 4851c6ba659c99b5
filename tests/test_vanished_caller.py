"""A WebRTC caller that vanishes mid-call (its process killed, as a browser closed by force or a
network gone would leave it) gives its slot back within 5 s, with reason ``media_timeout``, and
leaves no unretrieved-task traceback in the server's log.

The caller is a real aiortc peer in a process of its own, killed with SIGKILL: it says nothing
as it goes (no BYE, no DTLS close alert, no SCTP abort), and ICE alone would notice only after
about half a minute.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time

import pytest

from server.config.server import ServerConfig
from server.http.app import CALLS
from tests.conftest import REPO
from tests.support.calls import voice_server
from tests.support.processes import kill_group, spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

CALLER = """
import asyncio, sys
from server.testkit.caller import WebRTCCaller

async def main() -> None:
    caller = WebRTCCaller()
    await caller.connect(sys.argv[1])
    print(caller.session_id, flush=True)
    await caller.wait_for("agent_sentence", timeout_s=30)  # the greeting is being said
    print("greeted", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_killed_caller_is_hung_up_for_its_silence_within_five_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gc.collect()  # what earlier tests of this process left for the collector goes now...
    caplog.clear()  # ...and its complaints are not this test's
    caplog.set_level(logging.INFO)
    config = ServerConfig()
    assert config.webrtc_media_timeout_s <= 4.0  # the default leaves the watchdog a second
    async with voice_server(None, config) as server:
        registry = server.app[CALLS]
        url = str(server.make_url("")).rstrip("/")
        process = await spawn(
            sys.executable, "-c", CALLER, url, stdout=asyncio.subprocess.PIPE, cwd=REPO
        )
        assert process.stdout is not None
        try:
            async with asyncio.timeout(30):
                session_id = (await process.stdout.readline()).decode().strip()
                assert await process.stdout.readline() == b"greeted\n"
            assert session_id in registry.calls
            call = registry.calls[session_id]
        finally:
            kill_group(process.pid)
        killed_at = time.monotonic()
        async with asyncio.timeout(10):
            while session_id in registry.calls:  # noqa: ASYNC110 - the registry has no event
                await asyncio.sleep(0.05)
        freed_after = time.monotonic() - killed_at
        await asyncio.wait_for(call.ended.wait(), 15)
        await process.wait()
        assert len(registry) == 0
    gc.collect()
    await asyncio.sleep(0.1)
    assert freed_after <= 5.0
    assert f"WebRTC call {session_id} ended: media_timeout: no audio from the caller" in caplog.text
    unretrieved = [
        record.getMessage()
        for record in caplog.records
        if "never retrieved" in record.getMessage()
        and ("aiortc" in record.getMessage() or "Sctp" in record.getMessage())
    ]
    assert not unretrieved  # aiortc's SCTP sends to a peer that is gone: none
