"""Kamailio in front of two Vocable SIP endpoints, with ``deploy/kamailio/kamailio.cfg`` as
shipped: new calls are spread over both, a full endpoint's 503 sends the call to the other, an
endpoint that does not answer is skipped, and in-dialog requests (ACK, BYE, a transfer's REFER
and NOTIFY) go between the caller and the endpoint that answered through the proxy's recorded
route.

Debian's ``kamailio`` runs on a free loopback port with a generated dispatcher list; the
callers are SIP phones (``server/testkit/sip_phone.py``) that speak only to Kamailio.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from playbooks.transfer import TransferRequest
from server.config.server import ServerConfig, SipSettings
from server.http.app import CALLS, SIP
from server.testkit.sip_phone import SipPhone
from tests.conftest import REPO
from tests.support.calls import voice_server
from tests.support.kamailio import kamailio_binary
from tests.support.processes import free_port, kill_group, popen, udp_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CONFIG = REPO / "deploy" / "kamailio" / "kamailio.cfg"
INVITE_TIMEOUT_MS = 1000


@contextmanager
def _kamailio_in_front(workdir: Path, endpoints: list[int]) -> Iterator[int]:
    """Kamailio on a free UDP port of 127.0.0.1, dispatching to ``endpoints`` (SIP ports on
    127.0.0.1); yields its port."""
    workdir.mkdir(parents=True, exist_ok=True)
    listing = workdir / "dispatcher.list"
    listing.write_text("".join(f"1 sip:127.0.0.1:{port}\n" for port in endpoints))
    port = free_port()
    process = popen(
        [
            kamailio_binary(),
            *("-DD", "-E", "-f", str(CONFIG), "-Y", str(workdir)),
            *("-A", f"LISTEN=udp:127.0.0.1:{port}", "-A", f'DISPATCHER_LIST="{listing}"'),
            *("-A", f"INVITE_TIMEOUT_MS={INVITE_TIMEOUT_MS}"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "kamailio.log").open("wb"),
    )
    try:
        deadline = time.monotonic() + 10
        while udp_free(port):
            assert process.poll() is None, (workdir / "kamailio.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "kamailio did not start listening"
            time.sleep(0.05)
        yield port
    finally:
        kill_group(process.pid)
        process.wait(10)


@asynccontextmanager
async def _endpoints(*max_sessions: int) -> AsyncIterator[list[TestServer]]:
    """Vocable servers with SIP on 127.0.0.1, each taking at most its ``max_sessions``."""
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(
                voice_server(
                    None,
                    ServerConfig(
                        sip=SipSettings(host="127.0.0.1", port=0),
                        max_sessions=limit,
                        rate_limit_per_min=0,
                    ),
                )
            )
            for limit in max_sessions
        ]
        yield servers


async def _call(kamailio: int) -> SipPhone:
    phone = await SipPhone.open(kamailio)
    answer = await phone.invite()
    assert answer.status_code == 200, answer.status_code
    assert phone.route_set, "the answer came without the proxy's Record-Route"
    return phone


def _calls(servers: list[TestServer]) -> list[int]:
    return [len(server.app[CALLS]) for server in servers]


async def _until_free(servers: list[TestServer]) -> None:
    async with asyncio.timeout(10):
        while any(_calls(servers)):  # noqa: ASYNC110 - the registries have no event for it
            await asyncio.sleep(0.05)


async def test_calls_are_spread_over_the_endpoints_and_hung_up_through_the_proxy(
    tmp_path: Path,
) -> None:
    async with _endpoints(2, 2) as servers:
        ports = [server.app[SIP].port for server in servers]
        with _kamailio_in_front(tmp_path / "kamailio", ports) as kamailio:
            phones = [await _call(kamailio) for _ in range(2)]
            try:
                assert _calls(servers) == [1, 1]  # round robin
                for phone in phones:
                    assert (await phone.bye()).status_code == 200  # via the recorded route
                await _until_free(servers)
            finally:
                for phone in phones:
                    await phone.close()


async def test_a_full_endpoint_sends_the_call_to_the_next_one(tmp_path: Path) -> None:
    async with _endpoints(1, 2) as servers:
        ports = [server.app[SIP].port for server in servers]
        direct = await SipPhone.open(ports[0])  # the first endpoint's one slot, taken
        with _kamailio_in_front(tmp_path / "kamailio", ports) as kamailio:
            phones: list[SipPhone] = []
            try:
                assert (await direct.invite()).status_code == 200
                for _ in range(2):  # round robin offers the full one a call: it answers 503
                    phones.append(await _call(kamailio))
                assert _calls(servers) == [1, 2]
                refused = await SipPhone.open(kamailio)
                phones.append(refused)
                assert (await refused.invite()).status_code in (500, 503)  # every one is full
                for phone in phones[:2]:
                    assert (await phone.bye()).status_code == 200
                assert (await direct.bye()).status_code == 200
                await _until_free(servers)
            finally:
                for phone in [direct, *phones]:
                    await phone.close()


async def test_an_endpoint_that_does_not_answer_is_skipped(tmp_path: Path) -> None:
    silent = free_port()  # nothing listens there
    async with _endpoints(2) as servers:
        ports = [silent, servers[0].app[SIP].port]
        with _kamailio_in_front(tmp_path / "kamailio", ports) as kamailio:
            phones: list[SipPhone] = []
            try:
                durations = []
                for _ in range(2):  # one of the two is offered to the silent endpoint first
                    started = time.monotonic()
                    phones.append(await _call(kamailio))
                    durations.append(time.monotonic() - started)
                assert _calls(servers) == [2]
                # one waited for the silent endpoint (Kamailio's timer ticks in 100 ms steps)
                assert max(durations) >= INVITE_TIMEOUT_MS / 1000 - 0.2
                assert max(durations) < INVITE_TIMEOUT_MS / 1000 + 3
                assert min(durations) < INVITE_TIMEOUT_MS / 1000 / 2  # the other did not
                for phone in phones:
                    assert (await phone.bye()).status_code == 200
                await _until_free(servers)
            finally:
                for phone in phones:
                    await phone.close()


async def test_a_transfer_and_the_hang_up_after_it_pass_through_the_proxy(tmp_path: Path) -> None:
    """The endpoint's REFER reaches the caller from Kamailio; the caller's 202 and its NOTIFY
    (the new call answered) reach the endpoint the same way; the endpoint then hangs up, its BYE
    also through Kamailio."""
    async with _endpoints(1) as servers:
        sip = servers[0].app[SIP]
        with _kamailio_in_front(tmp_path / "kamailio", [sip.port]) as kamailio:
            phone = await _call(kamailio)
            try:
                call = sip.calls[phone.call_id]
                asked = TransferRequest("sip:desk@192.0.2.9", "blind", None, None, None, 5.0)
                transfer = asyncio.create_task(call.transfer(asked))
                refer = await phone.incoming("REFER")
                assert refer.headers.get_first("refer-to") == "<sip:desk@192.0.2.9>"
                phone.reply(refer, 202, "Accepted")
                phone.request(
                    "NOTIFY",
                    body="SIP/2.0 200 OK\r\n",
                    content_type="message/sipfrag;version=2.0",
                    extra="Event: refer\r\nSubscription-State: terminated;reason=noresource\r\n",
                )
                outcome = await asyncio.wait_for(transfer, 10)
                assert (outcome.status, outcome.how) == ("answered", "refer")
                bye = await phone.incoming("BYE")  # the agent's leg ends
                phone.reply(bye, 200, "OK")
                await _until_free(servers)
                through = ("127.0.0.1", kamailio)
                assert ("REFER", through) in phone.endpoint.requests_from
                assert ("BYE", through) in phone.endpoint.requests_from
            finally:
                await phone.close()
