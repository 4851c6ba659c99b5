"""The other worker processes of a ``--workers N`` server, reached over their control sockets:
requests about a call passed to the worker that holds it (:mod:`server.http.relay`), metrics
gathered from all of them."""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from server.config.server import ServerConfig

__all__ = ["Siblings", "control_socket", "merge_metrics", "worker_of"]

_WORKER_PREFIX = re.compile(r"^w(\d{1,3})\.")
_METRICS_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


def control_socket(port: int, worker: int) -> Path:
    """Where worker ``worker`` of the server on ``port`` takes requests from its siblings."""
    return Path(tempfile.gettempdir()) / f"vocable-{port}-w{worker}.sock"


def worker_of(call_id: str) -> int | None:
    """The worker index a call id names (``w2.…`` -> 2), None for a single-process id."""
    match = _WORKER_PREFIX.match(call_id)
    return int(match.group(1)) if match else None


class Siblings:
    """This worker's view of the others (none when the server runs one process): one client
    session per sibling, open between :meth:`start` and :meth:`aclose`."""

    def __init__(self, config: ServerConfig) -> None:
        self.me = config.worker_index
        self.sockets: dict[int, Path] = {
            index: control_socket(config.port, index)
            for index in range(config.workers)
            if config.workers > 1 and index != config.worker_index
        }
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    async def start(self) -> None:
        """Open a session per sibling (inside the running loop, as aiohttp requires)."""
        self._sessions = {
            index: aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path)))
            for index, path in self.sockets.items()
        }

    async def aclose(self) -> None:
        sessions, self._sessions = self._sessions, {}
        await asyncio.gather(*(session.close() for session in sessions.values()))

    def session(self, worker: int) -> aiohttp.ClientSession | None:
        """The session reaching sibling ``worker`` (base URL ``http://worker``); None for this
        worker itself or one the server does not have."""
        return self._sessions.get(worker)

    async def metrics(self) -> dict[int, str]:
        """Every reachable sibling's own metrics text, by worker index."""

        async def one(worker: int, http: aiohttp.ClientSession) -> tuple[int, str] | None:
            with contextlib.suppress(OSError, aiohttp.ClientError, TimeoutError):
                async with http.get(
                    "http://worker/metrics?local=1", timeout=_METRICS_TIMEOUT
                ) as response:
                    if response.status == 200:
                        return worker, await response.text()
            return None

        found = await asyncio.gather(*(one(w, http) for w, http in self._sessions.items()))
        return dict(item for item in found if item is not None)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(texts: Mapping[int, str]) -> bytes:
    """Prometheus exposition texts of several workers as one, each sample labelled with its
    ``worker``; families of the same name are joined."""
    merged: dict[str, Metric] = {}
    for worker, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            target = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            target.samples.extend(
                Sample(s.name, {**s.labels, "worker": str(worker)}, s.value, s.timestamp)
                for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
