"""The default LLM: fetched once, on first use, from its publisher's repository on the hub.

When the user names no LLM endpoint and no GGUF file, the embedded llama.cpp runs a small instruct
model that does tool calls. It is not shipped: :func:`fetch_model` downloads it from the Hugging
Face hub into the user's cache (huggingface_hub's cache, shared with every other tool that uses
it) the first time it is needed, and finds it there every time after, with no network request.

Each model is pinned to a commit of its repository, so what is downloaded cannot change under a
release. The file's bytes are checked against the sha256 the hub announces for that file at that
commit (its Git LFS object id, from the hub's API), and, where the entry pins one, against the
sha256 written here: a file that does not match is deleted, never loaded. A file stays in the
cache only once it has passed that check, so a file found there is trusted as it is; the one gap
is a process killed between the download's end and the check's (well under a second per 500 MB).

Every failure (offline, DNS, refused connection, HTTP error, missing file, checksum mismatch, full
disk) is one :class:`ModelUnavailable` whose message is one line that says what failed. An
unreachable hub fails in milliseconds (DNS, refused connection), or after ``timeout_s`` when
packets are silently dropped: the checksum lookup comes first and is never retried, whereas
``hf_hub_download`` alone retries an unreachable hub with backoff for ~23 s.

huggingface_hub honours ``HF_ENDPOINT`` (a mirror), ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` /
``HF_HOME``, ``HF_TOKEN`` and ``HF_HUB_DISABLE_PROGRESS_BARS`` as it always does; it is imported
only when a download is asked for (~140 ms of imports that a configured server never pays).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.admission.cgroup import usable_cores

__all__ = [
    "DEFAULT_MODELS",
    "METADATA_TIMEOUT_S",
    "QWEN2_5_0_5B_INSTRUCT",
    "QWEN2_5_1_5B_INSTRUCT",
    "DownloadableModel",
    "ModelUnavailable",
    "ProgressCallback",
    "default_model",
    "fetch_model",
]

ProgressCallback = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called from the downloading thread."""

METADATA_TIMEOUT_S = 10.0
"""How long the hub may take to answer the checksum lookup and the file's metadata request."""


@dataclass(frozen=True)
class DownloadableModel:
    """One GGUF file in a hub repository, pinned to a commit."""

    label: str
    """For people: what the model is (``"Qwen2.5 0.5B Instruct, Q4_K_M"``)."""
    repo_id: str
    filename: str
    revision: str
    """A commit SHA (40 hex digits): what is downloaded cannot change and, once cached, is found
    with no network request. A branch name works too, but then the hub is asked each time."""
    size_bytes: int
    """As published; for display and a disk-space estimate, the hub's own figure is what counts."""
    sha256: str | None = None
    """The file's sha256 as published; when set, the hub must announce the same one."""


QWEN2_5_0_5B_INSTRUCT = DownloadableModel(
    label="Qwen2.5 0.5B Instruct, Q4_K_M",
    repo_id="Qwen/Qwen2.5-0.5B-Instruct-GGUF",
    filename="qwen2.5-0.5b-instruct-q4_k_m.gguf",
    revision="9217f5db79a29953eb74d5343926648285ec7e67",
    size_bytes=491_400_032,
    sha256="74a4da8c9fdbcd15bd1f6d01d621410d31c6fc00986f5eb687824e7b93d7a9db",
)
QWEN2_5_1_5B_INSTRUCT = DownloadableModel(
    label="Qwen2.5 1.5B Instruct, Q4_K_M",
    repo_id="Qwen/Qwen2.5-1.5B-Instruct-GGUF",
    filename="qwen2.5-1.5b-instruct-q4_k_m.gguf",
    revision="91cad51170dc346986eccefdc2dd33a9da36ead9",
    size_bytes=1_117_320_736,
    sha256="6a1a2eb6d15622bf3c96857206351ba97e1af16c30d7a74ee38970e434e9407e",
)

DEFAULT_MODELS: tuple[tuple[int, DownloadableModel], ...] = (
    (1, QWEN2_5_0_5B_INSTRUCT),
    (8, QWEN2_5_1_5B_INSTRUCT),
)
"""(fewest usable cores, model), ascending: a process gets the last model whose floor it reaches.
The 0.5B model generates ~12-15 tokens/s on 2 threads, about what a spoken answer needs; the
1.5B one is ~3x slower per thread and pays off only with the cores to spare."""


def default_model(cpus: int | None = None) -> DownloadableModel:
    """The model to fetch for a process that may use ``cpus`` whole cores (default: this
    process's, its CPU quota rounded down: :func:`.cgroup.usable_cores`)."""
    count = usable_cores() if cpus is None else cpus
    chosen = DEFAULT_MODELS[0][1]
    for floor, model in DEFAULT_MODELS:
        if count >= floor:
            chosen = model
    return chosen


class ModelUnavailable(Exception):
    """The model could not be fetched or verified; the message is one line saying why."""

    def __init__(self, model: DownloadableModel, endpoint: str, reason: str) -> None:
        super().__init__(f"cannot download {model.filename} from {endpoint}: {reason}")
        self.model = model
        self.endpoint = endpoint
        self.reason = reason


def fetch_model(
    model: DownloadableModel,
    *,
    cache_dir: Path | None = None,
    progress: ProgressCallback | None = None,
    endpoint: str | None = None,
    timeout_s: float = METADATA_TIMEOUT_S,
) -> Path:
    """The local path of ``model``'s file, downloaded and verified first unless already cached.

    Blocking: run it in a worker thread. ``cache_dir`` defaults to huggingface_hub's cache
    (``HF_HUB_CACHE``), ``endpoint`` to its hub (``HF_ENDPOINT``, else https://huggingface.co).
    A cached file is returned at once, without touching the network (also in offline mode).
    Otherwise the hub's API is asked for the file's sha256, the file is downloaded by
    ``hf_hub_download`` (its terminal progress bar as usual; a connection lost midway is resumed
    with an HTTP Range request from the last whole 10 MB chunk, up to 5 times, within this call:
    huggingface_hub 2.4 deletes a partial file when the call fails, so a later call starts over),
    and its bytes are hashed.

    ``progress(done_bytes, total_bytes)`` is called from this thread as bytes arrive (every
    10 MB, huggingface_hub's chunk size), never for a cached file. Raises
    :class:`ModelUnavailable` for every failure, a mismatched file deleted first.
    """
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    hub = (endpoint or constants.ENDPOINT).rstrip("/")
    cache = str(Path(cache_dir).expanduser()) if cache_dir is not None else constants.HF_HUB_CACHE
    try:
        cached = try_to_load_from_cache(
            model.repo_id, model.filename, cache_dir=cache, revision=model.revision
        )
        if isinstance(cached, str):
            return Path(cached)
        announced = _announced_sha256(model, hub, timeout_s)
        path = Path(
            hf_hub_download(
                model.repo_id,
                model.filename,
                revision=model.revision,
                cache_dir=cache,
                endpoint=hub,
                etag_timeout=timeout_s,
                tqdm_class=None if progress is None else _reporting_bar(progress, model.size_bytes),
            )
        )
        actual = _sha256_of(path)
    except ModelUnavailable:
        raise
    except Exception as err:
        raise ModelUnavailable(model, hub, _reason(err)) from err
    if actual != announced:
        _discard(path)
        raise ModelUnavailable(
            model, hub, f"checksum mismatch: sha256 {actual}, the hub announces {announced}"
        )
    return path


def _announced_sha256(model: DownloadableModel, hub: str, timeout_s: float) -> str:
    """The sha256 the hub's API announces for the file at the pinned revision: the Git LFS
    object id (``siblings[].lfs.sha256`` of ``GET /api/models/{repo}/revision/{rev}?blobs=True``).
    One request, no retries, ``timeout_s`` at most: this is also the fast connectivity check."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=hub).model_info(
        model.repo_id, revision=model.revision, files_metadata=True, timeout=timeout_s
    )
    for sibling in info.siblings or ():
        if sibling.rfilename != model.filename:
            continue
        if sibling.lfs is None:
            raise ModelUnavailable(model, hub, "the hub announces no sha256 for it (not in LFS)")
        announced = sibling.lfs.sha256.lower()
        if model.sha256 is not None and announced != model.sha256:
            raise ModelUnavailable(
                model, hub, f"the hub announces sha256 {announced}, not the pinned {model.sha256}"
            )
        return announced
    raise ModelUnavailable(model, hub, f"no such file in {model.repo_id} at {model.revision}")


def _reporting_bar(progress: ProgressCallback, fallback_total: int) -> type[Any]:
    """huggingface_hub's own progress bar class (drawn as it decides: on a terminal, unless
    disabled), also reporting bytes on disk to ``progress``. Xet downloads open a second bar for
    network bytes (named ``*.transfer``); it is drawn, not reported."""
    from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

    class ReportingBar(hub_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._reports = not str(kwargs.get("name") or "").endswith(".transfer")
            self._done_bytes = int(kwargs.get("initial") or 0)
            self._total_bytes = int(kwargs.get("total") or fallback_total)
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

        def update(self, n: float | None = 1) -> bool | None:
            if self._reports and n:
                self._done_bytes = max(0, self._done_bytes + int(n))
                progress(self._done_bytes, self._total_bytes)
            result: bool | None = super().update(n)
            return result

    return ReportingBar


def _sha256_of(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _discard(path: Path) -> None:
    """Delete a cached file: the snapshot's entry and the blob it points to."""
    blob = path.resolve()
    for doomed in (path, blob):
        with contextlib.suppress(OSError):
            doomed.unlink(missing_ok=True)


_ERRNO_PREFIX = re.compile(r"^\[Errno -?\d+\]\s*")


def _detail(err: BaseException) -> str:
    """The first line of an error's message, without its ``[Errno N]`` prefix."""
    lines = str(err).strip().splitlines()
    return _ERRNO_PREFIX.sub("", lines[0]).strip() if lines else ""


def _with_detail(summary: str, err: BaseException) -> str:
    detail = _detail(err)
    return f"{summary} ({detail[:1].lower()}{detail[1:]})" if detail else summary


def _reason(err: BaseException) -> str:
    """One line for a failure raised by huggingface_hub, httpx2 or the file system."""
    import httpx2
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, LocalEntryNotFoundError) and err.__cause__ is not None:
        err = err.__cause__  # "not in the cache either": what failed is the request before
    if isinstance(err, OfflineModeIsEnabled):
        return "offline mode is on (HF_HUB_OFFLINE) and the file is not in the cache"
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code
        if isinstance(err, RepositoryNotFoundError | RevisionNotFoundError):
            return f"repository or revision not found (HTTP {status})"
        if isinstance(err, RemoteEntryNotFoundError) or status == 404:
            return f"not found (HTTP {status})"
        if status in (401, 403):
            return f"access refused (HTTP {status})"
        return f"the hub answered HTTP {status}"
    if isinstance(err, httpx2.ConnectError):
        return _with_detail("network unreachable", err)
    if isinstance(err, httpx2.TimeoutException):
        return "the hub did not answer in time"
    if isinstance(err, httpx2.TransportError):
        return _with_detail("connection failed", err)
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return _with_detail("disk full", err)
    if isinstance(err, OSError) and err.errno is not None:
        return _with_detail("file system error", err)
    if isinstance(err, OSError):  # huggingface_hub's own, e.g. "Consistency check failed: ..."
        return _with_detail("download failed", err)
    return _with_detail(type(err).__name__, err)
