"""llama.cpp in this process: a GGUF model served on a private loopback port.

The embedded model is reached exactly as a remote one is, through the ``openai`` client and
llama.cpp's OpenAI-compatible HTTP API, so streaming, tool calls, retries and cancellation (a
closed stream stops the generation) are one code path. The port listens on 127.0.0.1 only and
answers only requests carrying a key made at start.

It shares the cores with Whisper and Piper, and the calls' speech goes first:

- its threads (llama.cpp's HTTP and inference threads, OpenMP's pool) are started from a thread
  made ``LLM_NICENESS`` nicer than the process, and inherit that niceness;
- OpenMP waits passively (``OMP_WAIT_POLICY=PASSIVE``): with the default spinning wait, idle
  workers burn the cores Whisper and Piper need, and generation itself falls to a few tokens per
  second whenever they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from media.priority import BACKGROUND_NICENESS, in_background_thread
from server.admission.cgroup import usable_cores

from .gguf import GgufInfo

__all__ = [
    "LLM_NICENESS",
    "EmbeddedLLM",
    "EmbeddedSettings",
    "ModelLoadError",
    "ModelThreads",
    "embedded_counts",
    "model_cpu_time",
]

log = logging.getLogger(__name__)

LLM_NICENESS = BACKGROUND_NICENESS + 5
"""How much nicer than the process the model's threads run: below speech recognition and
synthesis (``BACKGROUND_NICENESS``), which a caller waits on sooner."""
MAX_NICENESS = 19
"""Linux's highest niceness: a thread made nicer than that stays at it."""

_TOOL_TEMPLATE = "chatml-tools.jinja"


class ModelLoadError(RuntimeError):
    """llama.cpp could not load the model; the message says which file and the likely cause."""


@dataclass(frozen=True)
class EmbeddedSettings:
    threads: int | None = None
    """Inference threads; None: the whole cores this process may use (its CPU quota rounded
    down, else its affinity mask: ``cgroup.usable_cores``)."""
    slots: int | None = None
    """Requests generated at once (continuous batching; more wait for a free slot); None: one
    per usable core, at least 2 (each slot's context costs memory: 2 x 2048 tokens ~25 MB with
    SmolLM2)."""
    context_per_slot: int = 2048
    """Tokens of prompt and answer each slot holds."""
    prompt_cache_mib: int = 64
    """RAM for prompt prefixes kept between requests (system prompts and tools of stages)."""
    niceness: int = LLM_NICENESS
    passive_wait: bool = True
    """OpenMP's workers sleep when idle (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning."""


def embedded_counts(settings: EmbeddedSettings, cores: int) -> tuple[int, int]:
    """(threads, slots) of a model started with ``settings`` in a process that may use
    ``cores`` whole cores: the settings' own where given, else ``cores`` threads and as many
    slots, at least 2."""
    return settings.threads or cores, settings.slots or max(2, cores)


class EmbeddedLLM:
    """A loaded model and its private OpenAI-compatible endpoint. ``start`` blocks while the
    model loads (run it in a worker thread); ``close`` stops generation and frees the model."""

    def __init__(
        self, server: Any, info: GgufInfo, api_key: str, settings: EmbeddedSettings, slots: int
    ) -> None:
        self._server: Any = server
        self.slots = slots
        """Requests it generates at once."""
        self.info = info
        self.api_key = api_key
        self.settings = settings
        self.base_url = f"{server.listening_address}/v1"
        """The endpoint's base URL, for the ``openai`` client."""
        self.origin: str = server.listening_address
        self._lock = threading.Lock()
        self._http: tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession] | None = None
        """The session of this model's own reads (metrics, slots), and the loop it is in."""

    @property
    def model(self) -> str:
        """The model name requests carry (llama.cpp serves one model and ignores it)."""
        return self.info.label

    @classmethod
    def start(cls, info: GgufInfo, settings: EmbeddedSettings | None = None) -> EmbeddedLLM:
        """Load ``info``'s model and start its endpoint; raises :class:`ModelLoadError`."""
        settings = settings or EmbeddedSettings()
        api_key = secrets.token_urlsafe(24)
        threads, slots = embedded_counts(settings, usable_cores())

        def load() -> Any:
            with _passive_openmp() if settings.passive_wait else contextlib.nullcontext():
                import xllamacpp

            params = xllamacpp.CommonParams()
            params.model.path = str(info.path)
            params.n_parallel = slots
            params.n_ctx = slots * settings.context_per_slot
            # the context cache at 8 bits: half the memory of 16, no difference heard
            params.cache_type_k = params.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_Q8_0
            params.use_jinja = True
            params.cpuparams.n_threads = threads
            params.cpuparams_batch.n_threads = threads
            params.n_threads_http = max(2, slots)
            params.cache_ram_mib = settings.prompt_cache_mib
            params.hostnames = ["127.0.0.1"]
            params.port = 0  # a free one: listening_address tells which
            params.api_keys = [api_key]
            params.endpoint_metrics = True
            params.endpoint_slots = True
            params.verbosity = 0 if log.isEnabledFor(logging.DEBUG) else -1
            template = tool_template(info)
            if template is not None:
                params.chat_template = template
            try:
                return xllamacpp.Server(params)
            except RuntimeError as exc:
                raise ModelLoadError(
                    f"{info.path}: llama.cpp cannot load it (architecture "
                    f"'{info.architecture}': unknown to this llama.cpp, or the file is damaged)"
                ) from exc

        server = in_background_thread(load, settings.niceness)
        llm = cls(server, info, api_key, settings, slots)
        log.info(
            "LLM: %s embedded (llama.cpp, %d threads, %d slots of %d tokens) at %s",
            info.label,
            threads,
            slots,
            settings.context_per_slot,
            llm.origin,
        )
        return llm

    async def metrics_text(self) -> str:
        """llama.cpp's own Prometheus metrics (``llamacpp:*``: tokens read and generated, the
        seconds they took, requests queued); empty when it does not answer within 1 s."""
        return await self._get("/metrics") or ""

    async def generating(self) -> int:
        """How many requests llama.cpp is working on now (-1 when it does not answer)."""
        text = await self._get("/slots")
        try:
            slots = json.loads(text) if text is not None else None
        except ValueError:
            slots = None
        if not isinstance(slots, list):
            return -1
        return sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))

    async def _get(self, path: str) -> str | None:
        """The body of llama.cpp's answer to ``GET path``; None unless 200 within 1 s."""
        try:
            async with self._session().get(f"{self.origin}{path}") as response:
                return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    def _session(self) -> aiohttp.ClientSession:
        """One session for this model's reads, made in the running loop (a model loaded by a
        supervisor outlives the loop that loaded it) and closed by :meth:`aclose`."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop:
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=1.0),
                headers={"Authorization": f"Bearer {self.api_key}"},
            )
            self._http = (loop, session)
        return self._http[1]

    async def aclose(self, settle_s: float = 5.0) -> None:
        """Free the model once no request is in flight (waiting up to ``settle_s``).

        Close every client of the endpoint first: llama.cpp's destructor waits for the requests
        it is answering and holds Python's lock meanwhile, so a request whose client is this
        very process would never end."""
        deadline = time.monotonic() + settle_s
        while await self.generating() > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # (llama.cpp tells no one when a slot is done)
        if self._http is not None:
            loop, session = self._http
            self._http = None
            if loop is asyncio.get_running_loop():
                await session.close()
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop serving and free the model (blocks until llama.cpp's threads end: see
        :meth:`aclose`)."""
        with self._lock:
            server, self._server = self._server, None
        del server  # llama.cpp's destructor joins its threads


def model_cpu_time(task_dir: Path = Path("/proc/self/task")) -> float | None:
    """CPU seconds this process's model threads (those ``LLM_NICENESS`` nicer than the process:
    llama.cpp's and OpenMP's, started by :meth:`EmbeddedLLM.start`; not Piper's later-sentence
    worker, which runs nicer still and whose CPU is the calls') have used, while
    they live; None where Linux's per-thread accounting cannot be read. Reads every thread:
    :class:`ModelThreads` is the cheap way to ask often."""
    return ModelThreads(task_dir)()


class ModelThreads:
    """:func:`model_cpu_time`, cheap enough for every sample of the load gauge (ten a second,
    on the event loop): the whole thread list is scanned for the model's threads once every
    ``rescan_s`` (or when one of them ended), and in between only their own ``stat`` files are
    read (a handful, against every thread of the process: 0.7 ms a read with 42 threads)."""

    def __init__(
        self,
        task_dir: Path = Path("/proc/self/task"),
        *,
        rescan_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.task_dir = task_dir
        self.rescan_s = rescan_s
        self._clock = clock
        self._threads: list[Path] = []
        self._scanned_at: float | None = None

    def __call__(self) -> float | None:
        now = self._clock()
        if self._scanned_at is None or now - self._scanned_at >= self.rescan_s:
            if not self._scan():
                return None
            self._scanned_at = now
        ticks = 0
        for task in self._threads:
            stat = _thread_stat(task)
            if stat is None:  # a model thread ended: look again next time
                self._scanned_at = None
                continue
            ticks += stat[1]
        return ticks / _TICKS_PER_S

    def _scan(self) -> bool:
        """Find the model's threads; False where the thread list cannot be read."""
        try:
            base = os.getpriority(os.PRIO_PROCESS, 0)
            tasks = list(self.task_dir.iterdir())
        except OSError:
            return False
        # exactly: Piper's later-sentence worker runs nicer still, and its CPU is the calls'
        model = min(base + LLM_NICENESS, MAX_NICENESS)
        self._threads = [
            task for task in tasks if (stat := _thread_stat(task)) is not None and stat[0] == model
        ]
        return True


def _thread_stat(task: Path) -> tuple[int, int] | None:
    """A thread's niceness and CPU ticks (user and system) from its ``stat``; None once it
    ended."""
    try:
        fields = (task / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # after the name: state(3) ... utime(14) stime(15) ... nice(19), counted from pid(1)
    return int(fields[16]), int(fields[11]) + int(fields[12])


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def tool_template(info: GgufInfo) -> str | None:
    """A chat template that shows the tools to a ChatML model whose own template has none
    (SmolLM2's, for one), in the Hermes form llama.cpp parses back into tool calls; None when
    the model's own template is kept."""
    template = info.chat_template
    if template is None or "<|im_start|>" not in template or "tools" in template:
        return None
    return (importlib.resources.files(__package__) / "templates" / _TOOL_TEMPLATE).read_text()


@contextlib.contextmanager
def _passive_openmp() -> Iterator[None]:
    """``OMP_WAIT_POLICY=PASSIVE`` while llama.cpp's OpenMP runtime loads (it reads the variable
    once, then); the process's environment is left as it was."""
    name = "OMP_WAIT_POLICY"
    before = os.environ.get(name)
    if _loaded("libgomp.so.1"):
        log.warning("OpenMP was loaded before the LLM: its wait policy stays as it was")
    os.environ[name] = "PASSIVE"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _loaded(library: str) -> bool:
    """Whether a shared library of that file name is mapped in this process (Linux)."""
    with contextlib.suppress(OSError), Path("/proc/self/maps").open() as maps:
        return any(line.rstrip().endswith("/" + library) for line in maps)
    return False
