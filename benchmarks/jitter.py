"""Network jitter between a browser page and the server, on loopback, without ``tc netem``
(``--jitter-ms`` of ``--client chromium``).

A :class:`JitterRelay` is a UDP relay: the page sends to its port, it sends on to the server's
ICE candidate from a port of its own, and each datagram, both ways, leaves after a delay drawn
uniformly from ``delay_ms`` (in order: a datagram never overtakes the one before it, as on a
path that queues rather than one that reorders). :class:`RelayBroker` opens one relay per
server candidate when the page asks (``GET /relay?host=H&port=P`` answers the relay's port).
The page script (:func:`rewrite_answer_script`) asks for them as the server's answer arrives,
puts them in the answer in place of the server's candidates, and sends the offer with
candidates that lead nowhere, so that neither side finds a direct way to the other: the media
and the ICE checks all pass through the relays (:data:`SELECTED_PAIR` shows which pair the page
uses).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

from aiohttp import web

__all__ = ["SELECTED_PAIR", "JitterRelay", "RelayBroker", "rewrite_answer_script"]

_Address = tuple[Any, ...]
"""A socket address: (host, port), or IPv6's (host, port, flowinfo, scope_id)."""


class _Leg(asyncio.DatagramProtocol):
    """One socket of the relay: what it receives goes to ``forward``."""

    def __init__(self, forward: Callable[[bytes, _Address], None]) -> None:
        self.forward = forward

    def datagram_received(self, data: bytes, addr: _Address) -> None:
        self.forward(data, addr)


class JitterRelay:
    """A UDP relay on 127.0.0.1 to ``target`` that delays every datagram by ``delay_ms`` (a
    (low, high) range, drawn uniformly), in order. Open with :meth:`start`; :attr:`port` is where
    the page sends."""

    def __init__(self, target: _Address, delay_ms: tuple[float, float], seed: int = 0) -> None:
        low, high = delay_ms
        if not 0 <= low <= high:
            raise ValueError("need 0 <= low <= high delay")
        self.target = target
        self.delay_ms = delay_ms
        self._random = random.Random(seed)
        self._page: _Address | None = None
        self._outer: asyncio.DatagramTransport | None = None
        """The socket the page sends to."""
        self._inner: asyncio.DatagramTransport | None = None
        """The socket that sends to the server."""
        self._last_release = {"up": 0.0, "down": 0.0}

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._outer, _ = await loop.create_datagram_endpoint(
            lambda: _Leg(self._from_page), local_addr=("127.0.0.1", 0)
        )
        inner_address = ("::", 0) if ":" in self.target[0] else ("127.0.0.1", 0)
        self._inner, _ = await loop.create_datagram_endpoint(
            lambda: _Leg(self._from_server), local_addr=inner_address
        )
        return self.port

    @property
    def port(self) -> int:
        assert self._outer is not None
        port: int = self._outer.get_extra_info("sockname")[1]
        return port

    def _from_page(self, data: bytes, addr: _Address) -> None:
        self._page = addr
        assert self._inner is not None
        self._later("up", self._inner, data, self.target)

    def _from_server(self, data: bytes, addr: _Address) -> None:
        if self._page is not None:
            assert self._outer is not None
            self._later("down", self._outer, data, self._page)

    def _later(
        self, way: str, socket: asyncio.DatagramTransport, data: bytes, to: _Address
    ) -> None:
        loop = asyncio.get_running_loop()
        low, high = self.delay_ms
        drawn = loop.time() + self._random.uniform(low, high) / 1000
        release = max(drawn, self._last_release[way] + 1e-6)  # the loop runs ties in any order
        self._last_release[way] = release
        loop.call_at(release, _send, socket, data, to)

    def close(self) -> None:
        for socket in (self._outer, self._inner):
            if socket is not None:
                socket.close()


def _send(socket: asyncio.DatagramTransport, data: bytes, to: _Address) -> None:
    if not socket.is_closing():
        socket.sendto(data, to)


class RelayBroker:
    """An HTTP endpoint on 127.0.0.1 that opens a :class:`JitterRelay` per server candidate a
    page names (``GET /relay?host=H&port=P`` -> ``{"port": relay_port}``). Use as an async
    context manager; :attr:`url` is its base."""

    def __init__(self, delay_ms: tuple[float, float]) -> None:
        self.delay_ms = delay_ms
        self.relays: list[JitterRelay] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> RelayBroker:
        app = web.Application()
        app.router.add_get("/relay", self._open)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        for relay in self.relays:
            relay.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _open(self, request: web.Request) -> web.Response:
        try:
            target = (request.query["host"], int(request.query["port"]))
        except (KeyError, ValueError):
            raise web.HTTPBadRequest(text="need host and port") from None
        relay = JitterRelay(target, self.delay_ms, seed=len(self.relays))
        port = await relay.start()
        self.relays.append(relay)
        return web.json_response({"port": port}, headers={"Access-Control-Allow-Origin": "*"})


def rewrite_answer_script(broker_url: str) -> str:
    """The page script (run before the page's own) that sends the page's media through the
    broker's relays: each UDP candidate of a remote answer is replaced by its relay's, and the
    offer's own candidates point at the discard port (127.0.0.1:9), so that the server's
    checks find no direct way to the page and the page learns no direct way to the server."""
    return _REWRITE_ANSWER.replace("BROKER", json.dumps(broker_url))


_REWRITE_ANSWER = """(() => {
    const post = window.fetch;
    window.fetch = (url, options) => {
        if (url === "/offer" && options && options.body) {
            const offer = JSON.parse(options.body);
            offer.sdp = offer.sdp.split("\\r\\n").map((line) => {
                const parts = line.split(" ");
                if (!line.startsWith("a=candidate:") || parts.length < 6) return line;
                parts[4] = "127.0.0.1";
                parts[5] = "9";
                return parts.join(" ");
            }).join("\\r\\n");
            options = { ...options, body: JSON.stringify(offer) };
        }
        return post(url, options);
    };
    const original = RTCPeerConnection.prototype.setRemoteDescription;
    RTCPeerConnection.prototype.setRemoteDescription = async function (description) {
        if (description && description.type === "answer") {
            const lines = [];
            for (const line of description.sdp.split("\\r\\n")) {
                const parts = line.split(" ");
                if (line.startsWith("a=candidate:") && parts[2].toLowerCase() === "udp") {
                    const query = `host=${parts[4]}&port=${parts[5]}`;
                    const relay = await (await fetch(`${BROKER}/relay?${query}`)).json();
                    parts[4] = "127.0.0.1";
                    parts[5] = String(relay.port);
                    lines.push(parts.join(" "));
                } else {
                    lines.push(line);
                }
            }
            description = { type: "answer", sdp: lines.join("\\r\\n") };
        }
        return original.call(this, description);
    };
})();"""
"""Wraps ``setRemoteDescription``; ``BROKER`` is replaced by the broker's URL (a JSON string)."""

SELECTED_PAIR = """(async () => {
    let pair = null;
    const reports = {};
    (await call.pc.getStats()).forEach((report) => { reports[report.id] = report; });
    for (const report of Object.values(reports)) {
        if (report.type === "transport" && report.selectedCandidatePairId) {
            pair = reports[report.selectedCandidatePairId];
        }
    }
    if (!pair) return null;
    const remote = reports[pair.remoteCandidateId];
    return { remote_port: remote.port, remote_type: remote.candidateType };
})()"""
"""The page's selected ICE pair's remote end: a relay's port when the jitter path is in use."""
