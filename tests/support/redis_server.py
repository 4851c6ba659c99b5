"""A real redis-server (Debian's ``redis-server`` package) on a free loopback port, for the
tests of the call directory; it keeps nothing on disk and is killed with its process group."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import redis

from tests.support.processes import free_port, kill_group, popen

__all__ = ["RedisServer", "running_redis", "start_redis"]


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def stop(self) -> None:
        kill_group(self.process.pid)
        self.process.wait(10)


def _binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail(
            "redis-server is missing: apt-get install -y redis-server (make test does this)",
            pytrace=False,
        )
    return path


def start_redis(port: int | None = None) -> RedisServer:
    """A redis-server on 127.0.0.1 (at ``port``, else a free one), answering PING."""
    port = port or free_port()
    process = popen(
        [
            _binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = RedisServer(port, process)
    deadline = time.monotonic() + 10
    while True:
        try:
            if server.client().ping():
                return server
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                server.stop()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


@contextmanager
def running_redis() -> Iterator[RedisServer]:
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()
