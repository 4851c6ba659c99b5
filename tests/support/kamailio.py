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
    tls_port: int | None = None
    """Its SIP over TLS port, when it has one."""

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def run_kamailio(
    workdir: Path,
    config: Path,
    defines: Mapping[str, str | int],
    port: int | None = None,
    tls: tuple[Path, Path] | None = None,
) -> Iterator[Kamailio]:
    """Kamailio with ``config`` on a UDP port of 127.0.0.1 (``port``, default a free one),
    each of ``defines`` given as ``-A NAME=VALUE`` (strings quoted); with ``tls`` (a
    certificate and its key), also SIP over TLS on a free port (``TLS_LISTEN`` and
    ``TLS_CONFIG`` defined for the configuration). Yields it once it listens."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = workdir / f"kamailio-{port}.log"
    tls_port = None
    arguments = [f"LISTEN=udp:127.0.0.1:{port}"]
    if tls is not None:
        tls_port = free_port()
        tls_config = workdir / "tls.cfg"
        tls_config.write_text(
            "[server:default]\nmethod = TLSv1.2+\nverify_certificate = no\n"
            f"require_certificate = no\ncertificate = {tls[0]}\nprivate_key = {tls[1]}\n\n"
            "[client:default]\nmethod = TLSv1.2+\nverify_certificate = no\n"
            "require_certificate = no\n"
        )
        arguments += [f"TLS_LISTEN=tls:127.0.0.1:{tls_port}", f'TLS_CONFIG="{tls_config}"']
    arguments += [
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
        yield Kamailio(port, log, tls_port)
    finally:
        kill_group(process.pid)
        process.wait(10)
