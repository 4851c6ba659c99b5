"""sipp (the Debian ``sip-tester`` package) as a test's SIP peer: it runs an XML scenario
(``tests/sip``) as a caller or a callee and exits 0 only if every call followed it. Each sipp
runs in its own process group (``tests.support.processes``), so nothing outlives the test."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.support.processes import free_port, spawn, stop_group

__all__ = [
    "SIP_FILES",
    "awaits_bye",
    "hangs_up_after",
    "run_sipp",
    "sipp_callee",
    "sipp_result",
    "start_sipp",
]

SIP_FILES = Path(__file__).resolve().parent.parent / "sip"
"""The scenarios."""


def hangs_up_after(hold_ms: int, cseq: int) -> str:
    """A caller scenario's ending: it stays on the line ``hold_ms`` more, then sends its BYE
    (CSeq ``cseq``) and wants the 200."""
    return f"""
  <pause milliseconds="{hold_ms}"/>
  <send retrans="500">
    <![CDATA[
BYE sip:[service]@[remote_ip]:[remote_port] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: sipp <sip:caller@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:[service]@[remote_ip]:[remote_port]>[peer_tag_param]
Call-ID: [call_id]
CSeq: {cseq} BYE
Contact: <sip:caller@[local_ip]:[local_port]>
Max-Forwards: 70
Content-Length: 0

    ]]>
  </send>
  <recv response="200" crlf="true"/>
"""


def awaits_bye(timeout_ms: int) -> str:
    """A caller scenario's ending: it waits up to ``timeout_ms`` for Vocable's BYE and answers
    it 200 (sipp fails the call if none comes)."""
    return f"""
  <recv request="BYE" timeout="{timeout_ms}"/>
  <send>
    <![CDATA[
SIP/2.0 200 OK
[last_Via:]
[last_From:]
[last_To:]
[last_Call-ID:]
[last_CSeq:]
Content-Length: 0

    ]]>
  </send>
"""


def _error_log(workdir: Path) -> Path:
    """Where sipp in ``workdir`` (created if missing) traces its errors."""
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir / "errors.log"


def _sipp() -> str:
    path = shutil.which("sipp")
    if path is None:
        pytest.fail(
            "sipp is missing: apt-get install -y sip-tester (make test does this)", pytrace=False
        )
    return path


async def start_sipp(workdir: Path, *args: str) -> asyncio.subprocess.Process:
    """Start ``sipp ARGS -nostdin`` in ``workdir`` (created if missing) with its output piped
    and its errors traced to ``workdir/errors.log``; read its result with :func:`sipp_result`.
    Fails the test if sipp is not installed."""
    return await spawn(
        _sipp(),
        *args,
        *("-nostdin", "-trace_err", "-error_file", str(_error_log(workdir))),
        cwd=workdir,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def sipp_result(
    process: asyncio.subprocess.Process, workdir: Path, timeout_s: float
) -> tuple[int, str]:
    """Wait up to ``timeout_s`` (``TimeoutError`` beyond) for a sipp from :func:`start_sipp` to
    end: its exit status (0 iff every call followed the scenario) and the tails of its output
    and its error log, for an assertion's message."""
    output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    errors = _error_log(workdir)
    detail = errors.read_text(errors="replace")[-3000:] if errors.exists() else ""
    return int(process.returncode or 0), output.decode(errors="replace")[-3000:] + detail


async def run_sipp(workdir: Path, *args: str, timeout_s: float = 120.0) -> tuple[int, str]:
    """Run sipp as :func:`start_sipp` does to its end; its result as :func:`sipp_result` gives
    it. sipp is killed (with its group) if it is still running when this returns or fails."""
    process = await start_sipp(workdir, *args)
    try:
        return await sipp_result(process, workdir, timeout_s)
    finally:
        await stop_group(process)


@asynccontextmanager
async def sipp_callee(
    workdir: Path, scenario: str
) -> AsyncIterator[tuple[str, Callable[[], Awaitable[tuple[int, str]]]]]:
    """sipp as a callee (UAS) running ``tests/sip/SCENARIO.xml`` once on 127.0.0.1; yields the
    URI to dial and a coroutine function returning its exit status (0 iff the scenario
    completed) and output."""
    port = free_port()
    process = await start_sipp(
        workdir,
        *("-sf", str(SIP_FILES / f"{scenario}.xml"), "-i", "127.0.0.1", "-p", str(port)),
        *("-m", "1", "-mi", "127.0.0.1", "-mp", str(random.randrange(40000, 50000, 2))),
        *("-timeout", "60", "-timeout_error"),
    )

    async def finished() -> tuple[int, str]:
        return await sipp_result(process, workdir, 30)

    try:
        await asyncio.sleep(0.3)  # listening
        yield f"sip:callee@127.0.0.1:{port}", finished
    finally:
        await stop_group(process)
