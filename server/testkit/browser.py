"""Headless Chromium driven over the DevTools protocol (no extra packages: aiohttp's WebSocket),
for the tests and the latency harness's browser callers.

Chromium comes from Debian (``apt-get install chromium``, done by ``make test``); it never downloads
anything itself. The fake microphone plays (and loops) a WAV file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import wave
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from media.audio import SAMPLE_RATE

__all__ = ["Browser", "Spawn", "chromium_path", "microphone_file", "polled"]

Spawn = Callable[..., Awaitable[asyncio.subprocess.Process]]
"""Starts a program (``asyncio.create_subprocess_exec``'s arguments) in a process group of its
own, which :class:`Browser` kills as a whole when it closes."""


async def _spawn(program: str, *args: str, **kwargs: Any) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(program, *args, start_new_session=True, **kwargs)


FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    "--remote-debugging-port=0",
)


STARTUP_TIMEOUT_S = 60.0
"""How long Chromium may take to open its DevTools port."""


def microphone_file(path: Path, pcm16k: bytes) -> Path:
    """Write ``pcm16k`` (16 kHz mono PCM16) to ``path`` as the WAV file a fake microphone plays
    (Chromium loops it); returns ``path``."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        wav.writeframes(pcm16k)
    return path


def polled(expression: str, timeout_s: float) -> str:
    """A JavaScript promise of the first truthy value of ``expression``, polled every 100 ms;
    rejected after ``timeout_s`` (any browser's ``wait_until``)."""
    return f"""new Promise((resolve, reject) => {{
        const deadline = Date.now() + {int(timeout_s * 1000)};
        const tick = () => {{
            let value;
            try {{ value = ({expression}); }} catch (error) {{ return reject(error); }}
            if (value) return resolve(value);
            if (Date.now() > deadline) return reject(new Error({json.dumps(expression)}));
            setTimeout(tick, 100);
        }};
        tick();
    }})"""


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise RuntimeError("Chromium is required (make test installs it: apt-get install chromium)")
    return found


class Browser:
    """One headless Chromium with one page; ``evaluate`` runs JavaScript in it."""

    def __init__(self, profile: Path, microphone_wav: Path, spawn: Spawn = _spawn) -> None:
        self.profile = profile
        self.microphone_wav = microphone_wav
        self._spawn = spawn
        self._process: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._drain: asyncio.Task[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """Chromium's process id, which leads its process group (None before it started)."""
        return self._process.pid if self._process is not None else None

    async def __aenter__(self) -> Browser:
        self._process = await self._spawn(
            chromium_path(),
            *FLAGS,
            f"--use-file-for-fake-audio-capture={self.microphone_wav}",
            f"--user-data-dir={self.profile}",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        port = await self._devtools_port()
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)  # Chromium and its helpers
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._process.wait(), 10)
        if self._drain is not None:
            self._drain.cancel()

    async def send(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        message_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        await self._ws.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, timeout=timeout_s)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_until("document.readyState === 'complete'", timeout_s=15)

    async def evaluate(self, expression: str, timeout_s: float = 30.0) -> Any:
        """The JSON value of ``expression`` (promises awaited); raises on a JavaScript error."""
        result = await self.send(
            "Runtime.evaluate",
            timeout_s=timeout_s,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_until(self, expression: str, timeout_s: float) -> Any:
        """The first truthy value of ``expression``, polled in the page every 100 ms."""
        return await self.evaluate(polled(expression, timeout_s), timeout_s=timeout_s + 5)

    async def screenshot(self, path: Path) -> None:
        data = await self.send("Page.captureScreenshot", format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(data["data"]))

    async def _devtools_port(self) -> int:
        """Chromium announces 'DevTools listening on ws://127.0.0.1:PORT/...' on stderr.

        A cold start (its ~250 MB of code read from disk again) took 11 s on an idle 2-core
        machine and over 20 s beside the other tests' Whisper and Piper: up to
        ``STARTUP_TIMEOUT_S``, and what it printed is in the error if it never opens the port."""
        assert self._process is not None
        assert self._process.stderr is not None
        printed: list[bytes] = []
        try:
            async with asyncio.timeout(STARTUP_TIMEOUT_S):
                async for line in self._process.stderr:
                    match = re.search(rb"DevTools listening on ws://[^:]+:(\d+)/", line)
                    if match:
                        self._drain = asyncio.create_task(self._process.stderr.read())
                        return int(match.group(1))
                    printed.append(line)
        except TimeoutError:
            raise RuntimeError(
                f"Chromium did not open its DevTools port in {STARTUP_TIMEOUT_S:.0f} s; "
                f"it printed: {_tail(printed)}"
            ) from None
        raise RuntimeError(f"Chromium exited before opening its DevTools port: {_tail(printed)}")

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            future = self._pending.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)


def _tail(lines: list[bytes], keep: int = 10) -> str:
    """The last ``keep`` lines Chromium printed, for an error message."""
    text = b"".join(lines[-keep:]).decode(errors="replace").strip()
    return text or "nothing"
