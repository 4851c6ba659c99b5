"""Debian's ``kamailio`` as a test's peer on 127.0.0.1: a proxy in front of Vocable endpoints
(``deploy/kamailio/kamailio.cfg``), or a PBX that registers and challenges
(``tests/kamailio/pbx.cfg``). It runs in its own process group and is killed when the block
ends."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import free_port, kill_group, popen, udp_free

__all__ = ["PBX_CONFIG", "Kamailio", "kamailio_binary", "run_kamailio"]

PBX_CONFIG = Path(__file__).resolve().parent.parent / "kamailio" / "pbx.cfg"


def kamailio_binary() -> str:
    path = shutil.which("kamailio") or (
        "/usr/sbin/kamailio" if Path("/usr/sbin/kamailio").exists() else None
    )
    if path is None:
        pytest.fail(
            "kamailio is missing: apt-get install -y kamailio (make test does this)",
            pytrace=False,
        )
    return path


@dataclass
class Kamailio:
    port: int
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def run_kamailio(
    workdir: Path, config: Path, defines: Mapping[str, str | int], port: int | None = None
) -> Iterator[Kamailio]:
    """Kamailio with ``config`` on a UDP port of 127.0.0.1 (``port``, default a free one),
    each of ``defines`` given as ``-A NAME=VALUE`` (strings quoted); yields it once it
    listens."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = workdir / f"kamailio-{port}.log"
    arguments = [f"LISTEN=udp:127.0.0.1:{port}"] + [
        f'{name}="{value}"' if isinstance(value, str) else f"{name}={value}"
        for name, value in defines.items()
    ]
    process = popen(
        [
            kamailio_binary(),
            *("-DD", "-E", "-f", str(config), "-Y", str(workdir)),
            *(item for argument in arguments for item in ("-A", argument)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
    )
    try:
        deadline = time.monotonic() + 10
        while udp_free(port):
            assert process.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "kamailio did not start listening"
            time.sleep(0.02)
        yield Kamailio(port, log)
    finally:
        kill_group(process.pid)
        process.wait(10)
