"""Headless Firefox driven over WebDriver BiDi (no extra packages: aiohttp's WebSocket), for the
latency harness's browser callers (``--client firefox``).

Firefox has no fake-capture file as Chromium does, and headless it has no audio clock without a
sound server (its ``AudioContext`` stays suspended). So each :class:`Firefox` runs a private
PulseAudio (``apt-get install firefox-esr pulseaudio``) with two null sinks: ``speaker``, where
the page plays the agent, and ``microphone``, whose monitor is the page's microphone and into
which :meth:`Firefox.play_microphone` loops a WAV file with ``paplay``. The interface is
:class:`~server.testkit.browser.Browser`'s: ``goto``, ``evaluate``, ``wait_until``, ``pid``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp

from .browser import polled

__all__ = ["Firefox", "firefox_path"]

PREFERENCES = {
    "media.navigator.permission.disabled": True,  # getUserMedia without a prompt
    "media.autoplay.default": 0,
    "media.autoplay.block-webaudio": False,
    "remote.active-protocols": 1,  # WebDriver BiDi
    "app.update.enabled": False,
    "datareporting.policy.dataSubmissionEnabled": False,
    "toolkit.telemetry.enabled": False,
    "browser.shell.checkDefaultBrowser": False,
}
STARTUP_TIMEOUT_S = 60.0


def firefox_path() -> str:
    found = shutil.which("firefox-esr") or shutil.which("firefox")
    if found is None or shutil.which("pulseaudio") is None or shutil.which("paplay") is None:
        raise RuntimeError(
            "--client firefox needs Firefox and PulseAudio: apt-get install firefox-esr pulseaudio"
        )
    return found


class Firefox:
    """One headless Firefox with one page and its own PulseAudio, in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._env = {**os.environ, "XDG_RUNTIME_DIR": str(folder / "runtime")}
        self._processes: list[asyncio.subprocess.Process] = []
        """PulseAudio, then Firefox."""
        self._firefox: asyncio.subprocess.Process | None = None
        self._microphone: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._context = ""

    @property
    def pid(self) -> int | None:
        """Firefox's process id, which leads its process group (None before it started)."""
        return self._firefox.pid if self._firefox is not None else None

    async def __aenter__(self) -> Firefox:
        program = firefox_path()
        runtime, profile = self.folder / "runtime", self.folder / "profile"
        runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "user.js").write_text(
            "".join(
                f"user_pref({json.dumps(k)}, {json.dumps(v)});\n" for k, v in PREFERENCES.items()
            )
        )
        try:
            await self._start_pulse()
            port = _free_port()
            self._firefox = await self._spawn(
                program, "--headless", "--no-remote", "--profile", str(profile),
                "--remote-debugging-port", str(port), "about:blank",
            )  # fmt: skip
            self._processes.append(self._firefox)
            self._http = aiohttp.ClientSession()
            self._ws = await self._connect(port)
            await self._call("session.new", capabilities={})
            tree = await self._call("browsingContext.getTree")
            self._context = tree["contexts"][0]["context"]
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._microphone is not None:
            self._microphone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._microphone
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        for process in reversed(self._processes):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 10)

    def play_microphone(self, wav: Path) -> None:
        """From now on the page's microphone plays ``wav``, over and over."""

        async def loop() -> None:
            while True:
                player = await self._spawn("paplay", "--device=microphone", str(wav))
                try:
                    await player.wait()
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(player.pid, signal.SIGKILL)

        self._microphone = asyncio.create_task(loop())

    async def goto(self, url: str) -> None:
        await self._call(
            "browsingContext.navigate", context=self._context, url=url, wait="complete"
        )

    async def evaluate(self, expression: str, timeout_s: float = 30.0) -> Any:
        """The JSON value of ``expression`` (promises awaited); raises on a JavaScript error."""
        reply = await self._call(
            "script.evaluate",
            timeout_s=timeout_s,
            expression=f"(async () => JSON.stringify(await ({expression})))()",
            target={"context": self._context},
            awaitPromise=True,
        )
        if reply.get("type") == "exception":
            raise RuntimeError(f"JavaScript error: {reply['exceptionDetails']['text']}")
        value = reply["result"].get("value")
        return None if value is None else json.loads(value)

    async def wait_until(self, expression: str, timeout_s: float) -> Any:
        """The first truthy value of ``expression``, polled in the page every 100 ms."""
        return await self.evaluate(polled(expression, timeout_s), timeout_s=timeout_s + 5)

    async def _start_pulse(self) -> None:
        pulse = await self._spawn(
            "pulseaudio", "-n", "--daemonize=no", "--exit-idle-time=-1", "--system=false",
            "--load=module-native-protocol-unix",
            "--load=module-null-sink sink_name=speaker",
            "--load=module-null-sink sink_name=microphone",
        )  # fmt: skip
        self._processes.append(pulse)
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while True:
                info = await self._spawn("pactl", "set-default-source", "microphone.monitor")
                if await info.wait() == 0:
                    break
                await asyncio.sleep(0.1)
        await (await self._spawn("pactl", "set-default-sink", "speaker")).wait()

    async def _spawn(self, program: str, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            program, *args, env=self._env, start_new_session=True,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip

    async def _connect(self, port: int) -> aiohttp.ClientWebSocketResponse:
        assert self._http is not None
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while True:
                try:
                    return await self._http.ws_connect(f"ws://127.0.0.1:{port}/session")
                except (aiohttp.ClientError, OSError):
                    await asyncio.sleep(0.2)

    async def _call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        message_id = next(self._ids)
        await self._ws.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        async with asyncio.timeout(timeout_s):
            while True:
                message = await self._ws.receive()
                if message.type != aiohttp.WSMsgType.TEXT:
                    raise RuntimeError(f"{method}: Firefox closed the session")
                data = json.loads(message.data)
                if data.get("id") != message_id:
                    continue  # an event, or a reply to a call abandoned at its timeout
                if data.get("type") == "error":
                    raise RuntimeError(f"{method}: {data.get('error')}: {data.get('message')}")
                result: dict[str, Any] = data.get("result", {})
                return result


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
