"""``vocable serve`` in a child process, with its CPU time and memory read from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcessSample", "ServerProcess", "free_port"]

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ProcessSample:
    cpu_s: float
    """User + system CPU seconds so far."""
    rss_bytes: int


class ServerProcess:
    """Start with :meth:`start`; always :meth:`stop` (SIGINT, then kill after a timeout)."""

    def __init__(
        self,
        args: list[str],
        cwd: Path,
        log_path: Path | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.args = args
        self.cwd = cwd
        self.command = command or [sys.executable, "-m", "server", "-v", "serve"]
        """The server's command line before ``--port N`` and ``args`` (default: vocable serve);
        it prints a line with ``ready`` once it listens."""
        self.log_path = log_path
        """Where the server's output goes (besides the in-memory tail)."""
        self.process: asyncio.subprocess.Process | None = None
        self.base_url = ""
        self._log = b""
        self._drains: list[asyncio.Task[None]] = []

    async def start(self, port: int, timeout_s: float = 120.0) -> str:
        self.process = await asyncio.create_subprocess_exec(
            *self.command,
            "--port",
            str(port),
            *self.args,
            cwd=self.cwd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: stop() kills workers too
        )
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout_s):
            while b"ready" not in (line := await self.process.stdout.readline()):
                if not line:
                    err = await self.process.stderr.read() if self.process.stderr else b""
                    raise RuntimeError(f"the server exited before it was ready:\n{err.decode()}")
        self.base_url = f"http://127.0.0.1:{port}"
        # keep reading its output, or a full pipe would stall the server
        self._drains = [
            asyncio.create_task(self._drain(stream))
            for stream in (self.process.stdout, self.process.stderr)
            if stream is not None
        ]
        return self.base_url

    @property
    def log_tail(self) -> str:
        """The last lines the server wrote (for failure reports)."""
        return self._log.decode(errors="replace")[-4000:]

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        log = self.log_path.open("ab") if self.log_path is not None else None
        try:
            while chunk := await stream.read(65536):
                self._log = (self._log + chunk)[-65536:]
                if log is not None:
                    log.write(chunk)
        finally:
            if log is not None:
                log.close()

    def sample(self) -> ProcessSample:
        assert self.process is not None
        pid = self.process.pid
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
        return ProcessSample(cpu_s, rss)

    async def stop(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self.process.send_signal(signal.SIGINT)  # graceful: closes every call
        try:
            await asyncio.wait_for(self.process.wait(), timeout=20)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        for task in self._drains:
            task.cancel()
