"""Child processes of the tests (servers, SIP peers, browsers): each in its own process group,
killed as a group, so nothing a test starts outlives it.

A child that spawns children of its own (``vocable serve --workers 2``) hands them its output
pipes; on Python 3.11 ``Process.wait()`` and ``communicate()`` return only once every holder of
those pipes is gone, so a grandchild left behind would hang the test. Killing the whole group
leaves no holder.

Every process started under the test session carries ``RUN_MARKER`` in its environment (unless
a test hands it an environment of its own), which lets the session prove at its end that
nothing it started is still running or listening (``leftovers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

__all__ = [
    "RUN_MARKER",
    "free_port",
    "kill_group",
    "kill_started",
    "leftovers",
    "listening",
    "popen",
    "run_vocable",
    "spawn",
    "started",
    "stop_group",
    "udp_free",
    "until_ready",
]

RUN_MARKER = "VOCABLE_TESTS_RUN"
"""Set (to this test process's own id) in the environment the tests' children inherit: with
``pytest -n``, each worker checks only what it started itself."""
os.environ[RUN_MARKER] = uuid.uuid4().hex

_started: list[int] = []
"""Process group ids of every child started with :func:`spawn`."""


async def spawn(program: str, *args: str, **kwargs: Any) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec`` in a new session (its own process group); the group
    is killed by :func:`kill_group`, or at the latest when the test ends."""
    env = kwargs.get("env")
    if env is not None:
        kwargs["env"] = {**env, RUN_MARKER: os.environ[RUN_MARKER]}
    process = await asyncio.create_subprocess_exec(program, *args, start_new_session=True, **kwargs)
    _started.append(process.pid)
    return process


REPO = Path(__file__).resolve().parents[2]


async def run_vocable(
    *args: str, stdin: str = "", env: dict[str, str] | None = None, timeout_s: float = 60.0
) -> tuple[int, str, str]:
    """``python -m server ARGS`` run from the repository with ``stdin``, in the test run's
    environment without its ``VOCABLE_*`` and ``OPENAI_*`` variables, plus ``env``: its exit
    code, stdout and stderr. Fails the test after ``timeout_s``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VOCABLE_", "OPENAI_"))}
    process = await spawn(
        sys.executable,
        "-m",
        "server",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env={**clean, **(env or {})},
    )
    out, err = await asyncio.wait_for(process.communicate(stdin.encode()), timeout_s)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def until_ready(
    process: asyncio.subprocess.Process, timeout_s: float = 90.0, seen: list[str] | None = None
) -> bytes:
    """The line in which ``vocable serve`` (``process``, its stdout piped) says it is ready;
    the lines before it are added to ``seen``. Fails the test if the server exits first, and
    raises TimeoutError if it says nothing of the kind within ``timeout_s``."""
    assert process.stdout is not None
    async with asyncio.timeout(timeout_s):
        while b"ready" not in (line := await process.stdout.readline()):
            assert line, "the server exited before it was ready"
            if seen is not None:
                seen.append(line.decode().rstrip("\n"))
    return line


def free_port(span: int = 1) -> int:
    """A port that, with the ``span - 1`` above it, is free for both UDP and TCP on 127.0.0.1
    when this returns (for a peer that listens on both, like baresip, whose SIP/TLS listener
    takes the next port up: ``span=2``). Raises ``OSError`` if 50 tries find none."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port + span - 1 <= 65535 and all(_free_both(p) for p in range(port, port + span)):
            return port
    raise OSError("no port free for both UDP and TCP on 127.0.0.1")


def udp_free(port: int) -> bool:
    """Whether nothing holds UDP ``port`` on 127.0.0.1 (a peer listening there would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_both(port: int) -> bool:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp,
    ):
        try:
            udp.bind(("127.0.0.1", port))
            tcp.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def popen(command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen`` in its own process group (see :func:`spawn`)."""
    process = subprocess.Popen(command, start_new_session=True, **kwargs)
    _started.append(process.pid)
    return process


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (the child and all it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def stop_group(process: asyncio.subprocess.Process, timeout_s: float = 10.0) -> None:
    """Kill ``process`` and its group, and reap it."""
    kill_group(process.pid)
    with contextlib.suppress(TimeoutError, ProcessLookupError):
        await asyncio.wait_for(process.wait(), timeout_s)


def started() -> int:
    """How many groups :func:`spawn` and :func:`popen` have started so far."""
    return len(_started)


def kill_started(since: int = 0) -> None:
    """Kill every group started after the first ``since`` (those already gone are skipped)."""
    while len(_started) > since:
        kill_group(_started.pop())


def leftovers() -> dict[int, str]:
    """Processes other than this one that carry this session's marker: pid -> command line."""
    marker = f"{RUN_MARKER}={os.environ[RUN_MARKER]}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            if marker not in environ.split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":  # a zombie holds nothing; its parent reaps it
            found[int(entry.name)] = command.strip()
    return found


def listening(pids: set[int]) -> list[str]:
    """``ss -ltnup`` lines of sockets that ``pids`` listen on."""
    try:
        result = subprocess.run(
            ["ss", "-ltnup"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"ss failed: {exc}"]
    return [
        line for line in result.stdout.splitlines() if any(f"pid={pid}," in line for pid in pids)
    ]
