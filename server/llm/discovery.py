"""Finding an OpenAI-compatible server already running on this machine.

A server given no LLM endpoint asks the usual loopback ports of the local servers people run
(Ollama, LM Studio, llama.cpp's server, vLLM) for ``/v1/models``, all at once, and takes the
first of that list that answers with a model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

__all__ = ["LOCAL_SERVERS", "FoundServer", "LocalServer", "find_local_server"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalServer:
    name: str
    base_url: str
    """The OpenAI-compatible base, ending in ``/v1``."""


LOCAL_SERVERS = (
    LocalServer("Ollama", "http://127.0.0.1:11434/v1"),
    LocalServer("LM Studio", "http://127.0.0.1:1234/v1"),
    LocalServer("llama.cpp's server", "http://127.0.0.1:8080/v1"),
    LocalServer("vLLM", "http://127.0.0.1:8000/v1"),
)
"""In the order they are preferred when several answer."""


@dataclass(frozen=True)
class FoundServer:
    server: LocalServer
    models: tuple[str, ...]
    """The model ids it lists, first the one it would serve by default."""


async def find_local_server(
    candidates: Sequence[LocalServer] = LOCAL_SERVERS, timeout_s: float = 1.0
) -> FoundServer | None:
    """The first of ``candidates`` whose ``/models`` lists at least one model within
    ``timeout_s``; None when none does (nothing listens, or something else does)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        found = await asyncio.gather(*(_models(http, c) for c in candidates))
    for candidate, models in zip(candidates, found, strict=True):
        if models:
            return FoundServer(candidate, models)
    return None


async def _models(http: aiohttp.ClientSession, candidate: LocalServer) -> tuple[str, ...]:
    try:
        async with http.get(f"{candidate.base_url}/models") as response:
            if response.status != 200:
                return ()
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return ()
    entries = body.get("data") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        return ()
    ids = (entry.get("id") for entry in entries if isinstance(entry, dict))
    models = tuple(i for i in ids if isinstance(i, str) and i)
    if models:
        log.debug(
            "%s answers at %s with %d model(s)", candidate.name, candidate.base_url, len(models)
        )
    return models
