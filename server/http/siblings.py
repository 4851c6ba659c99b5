"""The other worker processes of a ``--workers N`` server, reached over their control sockets:
hang-ups routed to the worker that holds the call, metrics gathered from all of them."""

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
_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


def control_socket(port: int, worker: int) -> Path:
    """Where worker ``worker`` of the server on ``port`` takes requests from its siblings."""
    return Path(tempfile.gettempdir()) / f"vocable-{port}-w{worker}.sock"


def worker_of(call_id: str) -> int | None:
    """The worker index a call id names (``w2.…`` -> 2), None for a single-process id."""
    match = _WORKER_PREFIX.match(call_id)
    return int(match.group(1)) if match else None


class Siblings:
    """This worker's view of the others (none when the server runs one process)."""

    def __init__(self, config: ServerConfig) -> None:
        self.me = config.worker_index
        self.sockets: dict[int, Path] = {
            index: control_socket(config.port, index)
            for index in range(config.workers)
            if config.workers > 1 and index != config.worker_index
        }

    async def request(
        self, worker: int, method: str, path: str, headers: Mapping[str, str]
    ) -> tuple[int, bytes, str]:
        """Pass a request to ``worker``; (status, body, content type). Raises OSError or
        aiohttp.ClientError when it cannot be reached."""
        socket = self.sockets[worker]
        connector = aiohttp.UnixConnector(path=str(socket))
        async with (
            aiohttp.ClientSession(connector=connector, timeout=_TIMEOUT) as session,
            session.request(method, f"http://worker{path}", headers=dict(headers)) as response,
        ):
            return response.status, await response.read(), response.content_type

    async def metrics(self) -> dict[int, str]:
        """Every reachable sibling's own metrics text, by worker index."""

        async def one(worker: int) -> tuple[int, str] | None:
            with contextlib.suppress(OSError, aiohttp.ClientError, TimeoutError):
                status, body, _ = await self.request(worker, "GET", "/metrics?local=1", {})
                if status == 200:
                    return worker, body.decode()
            return None

        found = await asyncio.gather(*(one(worker) for worker in self.sockets))
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
