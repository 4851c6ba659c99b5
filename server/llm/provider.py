"""Which LLM a server's calls talk to, and where it stands: ready, downloading, unavailable.

In order: the configured endpoint; else (``--llm auto``) a local OpenAI-compatible server that
is already running; else a GGUF model run in process (``--llm-gguf``, or the default model,
downloaded once into the user's cache while the server already takes calls). What fails leaves
the server in its no-LLM mode, with one line saying what failed and the ways out.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TextIO

from playbooks import ChatClient, LoadedPlaybook, PlaybookOrchestrator, RetryPolicy
from server.config.llm import ConfigError, LLMSettings
from server.config.server import LocalLLMSettings, ServerConfig, SharedLLM

from .discovery import LOCAL_SERVERS, LocalServer, find_local_server
from .download import DownloadableModel, ModelUnavailable, default_model, fetch_model
from .gguf import GgufError, read_gguf
from .llamacpp import EmbeddedLLM, EmbeddedSettings, ModelLoadError

__all__ = [
    "WAYS_OUT",
    "WAYS_TO_AN_LLM",
    "LLMProvider",
    "LLMStatus",
    "load_shared_model",
    "shared_settings",
]

log = logging.getLogger(__name__)

LLMState = Literal["ready", "searching", "downloading", "loading", "unavailable", "off"]
LLMSource = Literal["endpoint", "local server", "embedded"]

WAYS_TO_AN_LLM = (
    "give --llm-gguf FILE (a GGUF model file), --llm-base-url URL (any OpenAI-compatible "
    "server, e.g. http://127.0.0.1:11434/v1 for Ollama) or OPENAI_API_KEY (OpenAI)"
)
WAYS_OUT = f"{WAYS_TO_AN_LLM}; or --llm none to run without one"


@dataclass(frozen=True)
class LLMStatus:
    """What ``/config`` and ``/healthz`` say of the LLM (and the page shows)."""

    state: LLMState
    source: LLMSource | None = None
    model: str | None = None
    detail: str = ""
    progress: float | None = None
    """Of a download, 0 to 1."""

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "source": self.source,
            "model": self.model,
            "detail": self.detail,
            "progress": None if self.progress is None else round(self.progress, 3),
        }


class LLMProvider:
    """The calls' LLM client (``client``, None until one is ready) and its status."""

    def __init__(
        self,
        endpoint: LLMSettings | None = None,
        local: LocalLLMSettings | None = None,
        retries: int = RetryPolicy().retries,
        model: str | None = None,
        *,
        search_in: Sequence[LocalServer] = LOCAL_SERVERS,
        default_model: DownloadableModel | None = None,
        hub: str | None = None,
        cache_dir: Path | None = None,
        announce: bool = True,
    ) -> None:
        """``search_in``, ``default_model`` (None: chosen by the cores), ``hub`` (None:
        ``HF_ENDPOINT``, else huggingface.co) and ``cache_dir`` (None: the user's hub cache)
        say where a local LLM is looked for and fetched from; ``announce``: print a line for
        the person who started the server when the LLM is found, loaded, or fails."""
        self._announce = announce
        self._search_in = search_in
        self._default_model = default_model
        self._hub = hub
        self._cache_dir = cache_dir
        self._endpoint = endpoint
        self._local = local
        self._model = model
        self._retries = retries
        self.client: ChatClient | None = None
        self.embedded: EmbeddedLLM | None = None
        self.status = LLMStatus("off", detail="no LLM: started with --llm none")
        self._background: asyncio.Task[None] | None = None
        self._prime: tuple[LoadedPlaybook, ...] = ()
        self._priming: asyncio.Task[None] | None = None

    @classmethod
    def of_server(cls, config: ServerConfig) -> LLMProvider:
        model = config.local_llm.model if config.local_llm is not None else None
        return cls(config.llm, config.local_llm, config.llm_retries, model)

    @classmethod
    def serving(cls, client: ChatClient | None) -> LLMProvider:
        """A provider of a client already connected (None: no LLM), e.g. built by a test."""
        provider = cls()
        provider.client = client
        if client is not None:
            provider.status = LLMStatus("ready", "endpoint", client.model)
        return provider

    async def start(self, prime: Sequence[LoadedPlaybook] = ()) -> None:
        """Connect what is ready now; a default model not yet on disk is downloaded and loaded
        in the background. Raises :class:`ConfigError` for a model file llama.cpp cannot load
        (a bad ``--llm-gguf``): the server does not start. The first prompt of each of
        ``prime`` is prefilled in the background once an LLM that keeps prompts is ready."""
        self._prime = tuple(prime)
        if self._endpoint is not None:
            endpoint = self._endpoint
            self._connect(endpoint.base_url, endpoint.api_key, endpoint.model, "endpoint")
            return
        local = self._local
        if local is None:
            log.warning("no LLM (--llm none): calls connect, but the agent cannot answer")
            return
        if local.shared is not None:
            self._use_shared(local.shared)
            return
        if local.gguf is not None:
            try:
                await self._run_embedded(local.gguf)
            except (GgufError, ModelLoadError) as exc:
                raise ConfigError(str(exc)) from None
            return
        if local.search and await self._use_running_server():
            return
        model = self._default_model or default_model()
        self.status = LLMStatus("downloading", "embedded", model.label, detail=model.filename)
        self._background = asyncio.create_task(self._fetch_default_model(model), name="llm:default")

    async def metrics_text(self) -> str:
        """The embedded model's Prometheus metrics (see :meth:`EmbeddedLLM.metrics_text`);
        empty for other LLMs."""
        return await self.embedded.metrics_text() if self.embedded is not None else ""

    async def ready(self) -> ChatClient | None:
        """The client once the background download and load (if any) are over; None if they
        failed."""
        if self._background is not None:
            await asyncio.shield(self._background)
        return self.client

    async def close(self) -> None:
        for task in (self._background, self._priming):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.embedded is not None:
            embedded, self.embedded = self.embedded, None
            await embedded.aclose()

    # -- the sources -----------------------------------------------------------------------------

    def _connect(
        self, base_url: str | None, key: str | None, model: str, source: LLMSource
    ) -> None:
        self.client = ChatClient.connect(
            base_url,
            key,
            model,
            retry=RetryPolicy(retries=self._retries),
            constrain_forced_calls=source == "embedded",  # llama.cpp lets tool_choice pass
            prefills=source == "embedded",
        )
        self.status = LLMStatus("ready", source, model, detail=base_url or "OpenAI")

    async def _use_running_server(self) -> bool:
        self.status = LLMStatus("searching", detail="looking for a local LLM server")
        found = await find_local_server(self._search_in)
        if found is None:
            return False
        model = self._model or found.models[0]
        self._connect(found.server.base_url, None, model, "local server")
        self.status = replace(self.status, detail=f"{found.server.name} at {found.server.base_url}")
        self._say(
            f"LLM: {found.server.name} at {found.server.base_url}, model {model} (another "
            "with --llm-model; in process instead with --llm local)"
        )
        return True

    def _use_shared(self, shared: SharedLLM) -> None:
        self._connect(shared.base_url, shared.api_key, shared.model, "embedded")
        self.status = replace(self.status, detail="llama.cpp in the supervisor, for all workers")
        self._prefill()

    async def _run_embedded(self, gguf: Path) -> None:
        info = await asyncio.to_thread(read_gguf, gguf)
        self.status = LLMStatus("loading", "embedded", info.label, detail=str(gguf))
        embedded = await asyncio.to_thread(EmbeddedLLM.start, info, EmbeddedSettings())
        self.embedded = embedded
        self._connect(embedded.base_url, embedded.api_key, embedded.model, "embedded")
        self.status = replace(self.status, detail=f"llama.cpp in process, {gguf}")
        self._prefill()
        self._say(f"LLM: {info.label} in process (llama.cpp), from {gguf}")

    def _prefill(self) -> None:
        """Have the model read the first prompt of each playbook to prime, in the background."""
        if self._prime and self.client is not None:
            self._priming = asyncio.create_task(
                _prefill_first_prompts(self.client, self._prime), name="llm:prefill"
            )

    async def _fetch_default_model(self, model: DownloadableModel) -> None:
        """Download ``model`` (unless cached) and run it; on failure, one line."""
        loop = asyncio.get_running_loop()
        last_shown = 0.0

        def progress(done: int, total: int) -> None:
            nonlocal last_shown
            now = time.monotonic()
            if now - last_shown < 0.25 and done < total:
                return
            last_shown = now
            fraction = done / total if total else None
            status = LLMStatus(
                "downloading", "embedded", model.label, detail=model.filename, progress=fraction
            )
            loop.call_soon_threadsafe(setattr, self, "status", status)

        try:
            path = await asyncio.to_thread(
                fetch_model, model, progress=progress, endpoint=self._hub, cache_dir=self._cache_dir
            )
            await self._run_embedded(path)
        except (ModelUnavailable, GgufError, ModelLoadError) as exc:
            self.status = LLMStatus("unavailable", "embedded", model.label, detail=str(exc))
            self._say(f"no LLM: {exc}; {WAYS_OUT}", sys.stderr)

    def _say(self, line: str, stream: TextIO | None = None) -> None:
        """A line for the person who started the server (on stdout unless ``stream``), as
        ``vocable serve`` prints its own."""
        if self._announce:
            print(f"vocable: {line}", file=stream or sys.stdout, flush=True)


async def _prefill_first_prompts(client: ChatClient, playbooks: Sequence[LoadedPlaybook]) -> None:
    """The prompt each playbook's calls start with (system prompt, tools, greeting) read once,
    so that the first caller's first turn pays only for its own words."""
    started = time.monotonic()
    for playbook in playbooks:
        orchestrator = PlaybookOrchestrator(playbook, client)
        orchestrator.greet()
        await client.prefill(orchestrator.request(with_tools=True, first_round=True))
    log.info(
        "prefilled %d playbook prompt(s) in %.1f s", len(playbooks), time.monotonic() - started
    )


async def load_shared_model(config: ServerConfig) -> EmbeddedLLM | None:
    """The model of ``config`` run here, for the workers of a supervisor to share; None when
    the workers need no model of their own (an endpoint, a running local server, ``--llm
    none``) or none could be had (the workers then say why). Waits for a download. Raises
    :class:`ConfigError` for a model file llama.cpp cannot load."""
    if config.llm is not None or config.local_llm is None:
        return None
    provider = LLMProvider.of_server(config)
    try:
        await provider.start()
        await provider.ready()
    except BaseException:
        await provider.close()
        raise
    embedded, provider.embedded = provider.embedded, None  # outlives this provider and loop
    await provider.close()
    return embedded


def shared_settings(embedded: EmbeddedLLM) -> SharedLLM:
    """How a worker reaches the supervisor's model."""
    return SharedLLM(embedded.base_url, embedded.api_key, embedded.model)
