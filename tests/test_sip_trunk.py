"""SIP trunks and registration against a real PBX: Debian's Kamailio (``tests/kamailio/pbx.cfg``)
as an outbound proxy that challenges every INVITE with 407 digest authentication, as carriers
do (found, as a carrier's domain is, through DNS NAPTR and SRV records, served by a stub; a
first target that answers nothing gives way to the next), and
as a registrar (401 digest, usrloc in memory) that routes calls for ``agent`` to the contact
Vocable registered.

Vocable answers the challenge with the trunk's credentials (MD5 and SHA-256, ``qop=auth``),
carries them ahead on the proxy's nonce for the next call (no second challenge), shows the
trunk's caller ID, display name and P-Asserted-Identity, and names a refused password as such;
no password reaches a log line. As an extension, Vocable registers, takes a call routed to its
contact, registers again after the registrar restarts (its bindings lost), and unregisters on
drain; ``/healthz`` and ``/metrics`` show the registration. With ``--sip-auth``, an INVITE from
outside the allowlist must answer Vocable's own challenge (sipp does). The call that is
answered and talks through the proxy is in ``tests/test_outbound_calls.py`` (baresip as the
callee).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from server.config.server import ServerConfig, SipSettings
from server.config.sip_trunks import InboundAuth, RegisterSettings, Secret, Trunk
from server.http.app import SIP
from server.testkit.sip_phone import SipPhone
from server.transports.sip.digest import DigestClient
from tests.support.calls import voice_server
from tests.support.dns_stub import dns_stub
from tests.support.kamailio import PBX_CONFIG, Kamailio, run_kamailio
from tests.support.outbound import call_ended, post_call
from tests.support.processes import free_port
from tests.support.sipp import run_sipp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SIP_FILES = Path(__file__).resolve().parent / "sip"
PASSWORD = "correct horse battery"
WRONG = "wrong horse battery"


def trunks(kamailio: Kamailio, password: str | None) -> dict[str, Trunk]:
    return {
        "pbx": Trunk(
            "pbx",
            proxy=("127.0.0.1", kamailio.port),
            username=None if password is None else "vocable",
            password=None if password is None else Secret(password),
            caller_id="+15551230000",
            display_name="Acme Deliveries",
            asserted_identity="sip:+15551230000@pbx.example",
        )
    }


def extension(
    kamailio: Kamailio, password: str, expires_s: int = 300, keepalive_s: float = 25.0
) -> RegisterSettings:
    return RegisterSettings(
        f"sip:agent@127.0.0.1:{kamailio.port}",
        ("127.0.0.1", kamailio.port),
        "agent",
        Secret(password),
        expires_s=expires_s,
        keepalive_s=keepalive_s,
    )


@asynccontextmanager
async def _server(
    trunks: dict[str, Trunk],
    register: RegisterSettings | None = None,
    dns_server: tuple[str, int] | None = None,
) -> AsyncIterator[TestServer]:
    settings = SipSettings(
        host="127.0.0.1",
        port=0,
        ring_timeout_s=10,
        trunks=trunks,
        register=register,
        dns_server=dns_server,
    )
    async with voice_server(None, ServerConfig(sip=settings, rate_limit_per_min=0)) as server:
        yield server


@pytest.mark.parametrize("algorithm", ["MD5", "SHA-256"])
async def test_calls_through_a_challenging_proxy_authenticate_once_per_nonce(
    tmp_path: Path, algorithm: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    defines = {"PASSWORD": PASSWORD, "ALGORITHM": algorithm}
    dead = free_port()
    with run_kamailio(tmp_path, PBX_CONFIG, defines) as kamailio:
        records = {  # the trunk's domain, as a carrier publishes it (RFC 3263)
            ("pbx.test", "NAPTR"): ['10 50 "s" "SIP+D2U" "" _sip._udp.pbx.test.'],
            ("_sip._udp.pbx.test", "SRV"): [
                f"10 0 {dead} down.pbx.test.",  # nothing answers there: the next is tried
                f"20 0 {kamailio.port} edge.pbx.test.",
                f"30 0 {kamailio.port} backup.pbx.test.",  # no address: skipped
            ],
            ("down.pbx.test", "A"): ["127.0.0.1"],
            ("edge.pbx.test", "A"): ["127.0.0.1"],
        }
        async with dns_stub(records) as dns:
            named = {"pbx": replace(trunks(kamailio, PASSWORD)["pbx"], proxy=("pbx.test", None))}
            async with _server(named, dns_server=("127.0.0.1", dns.port)) as server:
                first = await call_ended(server, {"to": "busy", "trunk": "pbx"})
                second = await call_ended(server, {"to": "busy"})  # the only trunk: the default
                dialer = server.app[SIP].dialer
                assert dialer is not None
                edge, down = ("127.0.0.1", kamailio.port), ("127.0.0.1", dead)
                assert dialer.answering_first([down, edge]) == [edge, down]  # tried last now
        log = kamailio.log_text()

    assert ("_sip._udp.pbx.test", "SRV") in dns.asked
    for described in (first, second):  # through the proxy, past its challenge, to its 486
        assert (described["result"], described["status"]) == ("busy", 486), described
        assert described["to"] == "sip:busy@pbx.test", described
        assert described["trunk"] == "pbx"
    assert log.count("challenged") == 1, log  # the second INVITE carried credentials ahead
    authenticated = [line for line in log.splitlines() if "authenticated" in line]
    assert len(authenticated) == 2, log
    for line in authenticated:
        assert "from sip:+15551230000@pbx.test" in line, line
        assert "Acme Deliveries" in line, line
        assert "PAI sip:+15551230000@pbx.example" in line, line
    assert PASSWORD not in caplog.text


async def _health(server: TestServer) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(server.make_url("/healthz")) as got:
        health: dict[str, Any] = await got.json()
        return health


async def _registration(server: TestServer, state: str, **having: Any) -> dict[str, Any]:
    """``/healthz``'s registration once it is in ``state`` with the items ``having`` (within
    10 s)."""
    async with asyncio.timeout(10):
        while True:
            found: dict[str, Any] = (await _health(server))["sip_registration"]
            if found["state"] == state and having.items() <= found.items():
                return found
            await asyncio.sleep(0.05)


async def _metrics(server: TestServer) -> str:
    async with aiohttp.ClientSession() as http, http.get(server.make_url("/metrics")) as got:
        return await got.text()


async def _call_agent(kamailio: Kamailio) -> int:
    """Call ``sip:agent@`` at the PBX; the final status (a 200 is hung up at once)."""
    phone = await SipPhone.open(kamailio.port)
    try:
        answer = await phone.invite("agent")
        if answer.status_code == 200:
            assert phone.session_id, "the answer came without X-Vocable-Session"
            assert (await phone.bye()).status_code == 200
        return answer.status_code
    finally:
        await phone.close()


async def test_an_extension_registers_takes_calls_and_registers_again_after_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    defines = {"PASSWORD": PASSWORD}
    with contextlib.ExitStack() as first_run:
        kamailio = first_run.enter_context(run_kamailio(tmp_path / "first", PBX_CONFIG, defines))
        settings = extension(kamailio, PASSWORD, expires_s=2, keepalive_s=0.2)
        async with _server({}, settings) as server:
            sip = server.app[SIP]
            here = f"127.0.0.1:{sip.port}"
            # STUN keep-alives (RFC 5626) from the SIP socket: the registrar answers with it
            registered = await _registration(server, "registered", keepalive="stun")
            assert registered["reflexive"] == here
            assert registered["contact"] == f"sip:agent@{here}"
            assert registered["expires_s"] == 2
            assert "vocable_sip_registered 1.0" in await _metrics(server)
            assert await _call_agent(kamailio) == 200

            first_run.close()  # the registrar restarts, its bindings lost, without STUN now
            without_stun = {**defines, "NO_STUN": "1"}
            restart = run_kamailio(
                tmp_path / "second", PBX_CONFIG, without_stun, port=kamailio.port
            )
            with restart as restarted:
                restarted_at = time.monotonic()
                async with asyncio.timeout(3.0):  # the refresh interval (1.8 s), and a margin
                    while "REGISTER of sip:agent@" not in restarted.log_text():  # noqa: ASYNC110 - a file
                        await asyncio.sleep(0.05)
                await _registration(server, "registered")
                again_s = time.monotonic() - restarted_at
                assert await _call_agent(restarted) == 200
                # the lost flow was seen by its keep-alive; this registrar gets CRLFs
                await _registration(server, "registered", keepalive="crlf", reflexive=None)

                await sip.unregister()  # on drain
                assert (await _registration(server, "unregistered"))["expires_s"] is None
                assert await _call_agent(restarted) == 404
            assert "vocable_sip_registered 0.0" in await _metrics(server)
    assert again_s <= 2.5, again_s
    assert PASSWORD not in caplog.text


async def test_a_refused_password_and_a_missing_one_are_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with run_kamailio(tmp_path, PBX_CONFIG, {"PASSWORD": PASSWORD}) as kamailio:
        wrong = trunks(kamailio, WRONG)
        bare = {"open": trunks(kamailio, None)["pbx"]}
        ways = {**wrong, "open": Trunk("open", proxy=bare["open"].proxy)}
        async with _server(ways, extension(kamailio, WRONG)) as server:
            refused = await call_ended(server, {"to": "+1 555 765 4321", "trunk": "pbx"})
            unasked = await call_ended(server, {"to": "+15557654321", "trunk": "open"})
            status, unknown = await post_call(server, {"to": "+15557654321", "trunk": "nope"})
            status_unnamed, unnamed = await post_call(server, {"to": "+15557654321"})
            failed = await _registration(server, "failed")

    assert refused["to"] == f"sip:+15557654321@127.0.0.1:{kamailio.port}"
    assert (refused["result"], refused["status"]) == ("rejected", 407)
    assert refused["reason"] == "authentication failed (407 Proxy Authentication Required)"
    assert (unasked["result"], unasked["status"]) == ("rejected", 407)
    assert "the trunk asks for credentials, none are set" in unasked["reason"]
    assert status == 400
    assert unknown["error"] == "unknown trunk 'nope' (trunks: open, pbx)"
    assert status_unnamed == 400
    assert "name a trunk: one of open, pbx" in unnamed["error"]
    assert failed["last_error"] == "401 Unauthorized", failed
    assert WRONG not in caplog.text


async def test_an_invite_from_outside_the_allowlist_must_prove_the_account(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    auth = InboundAuth("pbx", Secret(PASSWORD))
    settings = SipSettings(host="127.0.0.1", port=0, allow=(ip_network("10.0.0.0/8"),), auth=auth)
    scenario = tmp_path / "caller_auth.xml"
    scenario.write_text((SIP_FILES / "caller_auth.xml").read_text().replace("{hold_ms}", "300"))
    async with voice_server(None, ServerConfig(sip=settings, rate_limit_per_min=0)) as server:
        port = server.app[SIP].port
        code, output = await run_sipp(  # sipp answers the challenge with its own digest code
            tmp_path,
            f"127.0.0.1:{port}",
            *("-sf", str(scenario), "-s", "support", "-au", "pbx", "-ap", PASSWORD),
            *("-m", "1", "-i", "127.0.0.1", "-p", "0", "-mi", "127.0.0.1"),
            *("-timeout", "30", "-timeout_error"),
            timeout_s=40,
        )
        phone = await SipPhone.open(port)
        try:
            challenged = await phone.invite("support")
            challenge = challenged.headers.get_first("www-authenticate") or ""
            guesses = []
            for _ in range(6):  # wrong answers: refused, then the source is throttled
                uri = f"sip:support@127.0.0.1:{port}"
                header = DigestClient("pbx", Secret(WRONG)).answer(401, challenge, "INVITE", uri)
                assert header is not None
                guesses.append(
                    (
                        await phone.invite("support", extra=f"{header[0]}: {header[1]}\r\n")
                    ).status_code
                )
        finally:
            await phone.close()

    assert code == 0, output
    assert challenged.status_code == 401
    assert 'realm="vocable"' in challenge
    assert 'qop="auth"' in challenge
    assert guesses == [401, 401, 401, 401, 401, 403]
    assert PASSWORD not in caplog.text
    assert WRONG not in caplog.text
