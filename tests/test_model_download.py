"""``server.llm.download``: the default LLM fetched from a stand-in of the hub."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from server.admission.cgroup import usable_cores
from server.llm.download import (
    DEFAULT_MODELS,
    QWEN2_5_0_5B_INSTRUCT,
    QWEN2_5_1_5B_INSTRUCT,
    DownloadableModel,
    ModelUnavailable,
    default_model,
    fetch_model,
)
from tests.support.hub_standin import HubStandin

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 10 * 1024 * 1024
"""huggingface_hub's download chunk (``constants.DOWNLOAD_CHUNK_SIZE``): a lost connection resumes
from the last whole chunk written, so the file is bigger than one."""
CONTENT = os.urandom(CHUNK + 2 * 1024 * 1024 + 123)
"""Random: a resumed download that stitched bytes wrongly cannot pass for the whole file."""
MODEL = DownloadableModel(
    label="a stand-in model",
    repo_id="vocable-tests/tiny-GGUF",
    filename="tiny-q4_k_m.gguf",
    revision=COMMIT,
    size_bytes=len(CONTENT),
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def hub() -> AsyncIterator[HubStandin]:
    async with HubStandin(MODEL.repo_id, MODEL.filename, CONTENT, COMMIT) as server:
        yield server


def cached_files(cache: Path) -> list[Path]:
    """Every file or link of the model under the cache: blobs, snapshot entries, partial files."""
    return sorted(
        path
        for path in cache.rglob("*")
        if not path.is_dir() and {"blobs", "snapshots"} & set(path.relative_to(cache).parts)
    )


async def fetch(
    model: DownloadableModel,
    hub: str,
    cache: Path,
    progress: list[tuple[int, int]] | None = None,
    timeout_s: float = 5.0,
) -> Path:
    """``fetch_model`` in a worker thread, as the server calls it."""
    report = None if progress is None else (lambda done, total: progress.append((done, total)))
    return await asyncio.to_thread(
        fetch_model, model, cache_dir=cache, progress=report, endpoint=hub, timeout_s=timeout_s
    )


def one_line(err: ModelUnavailable) -> str:
    message = str(err)
    assert "\n" not in message
    assert message.startswith(f"cannot download {err.model.filename} from {err.endpoint}: ")
    return message


async def test_download_lands_in_the_cache_with_progress(hub: HubStandin, tmp_path: Path) -> None:
    progress: list[tuple[int, int]] = []

    path = await fetch(MODEL, hub.endpoint, tmp_path, progress)

    assert path.read_bytes() == CONTENT
    assert path.name == MODEL.filename
    assert path.is_relative_to(tmp_path)
    assert progress, "the progress callback was never called"
    assert progress[-1] == (len(CONTENT), len(CONTENT))
    assert [done for done, _ in progress] == sorted(done for done, _ in progress)
    paths = [seen.path for seen in hub.requests]
    assert paths[0] == f"/api/models/{MODEL.repo_id}/revision/{COMMIT}"
    assert len(hub.downloads()) == 1


async def test_a_cached_model_returns_without_a_request(hub: HubStandin, tmp_path: Path) -> None:
    first = await fetch(MODEL, hub.endpoint, tmp_path)
    seen = len(hub.requests)
    progress: list[tuple[int, int]] = []

    started = time.perf_counter()
    second = await fetch(MODEL, hub.endpoint, tmp_path, progress)

    assert second == first
    assert len(hub.requests) == seen
    assert progress == []
    assert time.perf_counter() - started < 1.0


async def test_offline_mode_serves_the_cache_and_fails_fast_without_it(
    hub: HubStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    cached = await fetch(MODEL, hub.endpoint, tmp_path / "warm")
    seen = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, read at import

    assert await fetch(MODEL, hub.endpoint, tmp_path / "warm") == cached
    started = time.perf_counter()
    with pytest.raises(ModelUnavailable) as failure:
        await fetch(MODEL, hub.endpoint, tmp_path / "cold")

    assert time.perf_counter() - started < 2.0
    assert "offline mode is on" in one_line(failure.value)
    assert len(hub.requests) == seen


async def test_checksum_mismatch_raises_and_leaves_no_file(hub: HubStandin, tmp_path: Path) -> None:
    hub.announced_sha256 = "f" * 64

    with pytest.raises(ModelUnavailable) as failure:
        await fetch(MODEL, hub.endpoint, tmp_path)

    message = one_line(failure.value)
    assert f"checksum mismatch: sha256 {hub.sha256}, the hub announces {'f' * 64}" in message
    assert cached_files(tmp_path) == []
    # The next call does not find a file in the cache: it asks the hub again.
    hub.announced_sha256 = hub.sha256
    assert (await fetch(MODEL, hub.endpoint, tmp_path)).read_bytes() == CONTENT
    assert len(hub.downloads()) == 2
    assert cached_files(tmp_path) != []


async def test_a_pinned_checksum_must_be_the_announced_one(hub: HubStandin, tmp_path: Path) -> None:
    pinned = replace(MODEL, sha256="e" * 64)

    with pytest.raises(ModelUnavailable) as failure:
        await fetch(pinned, hub.endpoint, tmp_path)

    assert f"not the pinned {'e' * 64}" in one_line(failure.value)
    assert hub.downloads() == []
    assert (await fetch(replace(MODEL, sha256=hub.sha256), hub.endpoint, tmp_path)).exists()


async def test_a_dropped_connection_resumes_with_a_range_request(
    hub: HubStandin, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    assert constants.DOWNLOAD_CHUNK_SIZE == CHUNK
    hub.drop_after_bytes = CHUNK + 1024 * 1024 + 17
    progress: list[tuple[int, int]] = []

    path = await fetch(MODEL, hub.endpoint, tmp_path, progress)

    assert path.read_bytes() == CONTENT
    downloads = hub.downloads()
    assert [seen.range for seen in downloads] == [None, f"bytes={CHUNK}-"]
    assert progress[-1] == (len(CONTENT), len(CONTENT))


async def test_not_found_is_one_line(hub: HubStandin, tmp_path: Path) -> None:
    missing_repo = replace(MODEL, repo_id="vocable-tests/missing-GGUF")
    missing_file = replace(MODEL, filename="missing.gguf")

    with pytest.raises(ModelUnavailable) as no_repo:
        await fetch(missing_repo, hub.endpoint, tmp_path)
    with pytest.raises(ModelUnavailable) as no_file:
        await fetch(missing_file, hub.endpoint, tmp_path)
    hub.status = 404
    with pytest.raises(ModelUnavailable) as plain_404:
        await fetch(MODEL, hub.endpoint, tmp_path)

    assert one_line(no_repo.value).endswith("repository or revision not found (HTTP 404)")
    assert one_line(no_file.value).endswith(f"no such file in {MODEL.repo_id} at {COMMIT}")
    assert one_line(plain_404.value).endswith("not found (HTTP 404)")
    assert hub.downloads() == []


async def test_a_server_error_is_one_line_and_not_retried(hub: HubStandin, tmp_path: Path) -> None:
    hub.status = 500

    started = time.perf_counter()
    with pytest.raises(ModelUnavailable) as failure:
        await fetch(MODEL, hub.endpoint, tmp_path)

    assert time.perf_counter() - started < 2.0
    assert one_line(failure.value).endswith("the hub answered HTTP 500")
    assert len(hub.requests) == 1


async def test_an_unreachable_hub_fails_fast(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"

    started = time.perf_counter()
    with pytest.raises(ModelUnavailable) as failure:
        await fetch(MODEL, endpoint, tmp_path)

    assert time.perf_counter() - started < 3.0
    message = one_line(failure.value)
    assert message.startswith(f"cannot download {MODEL.filename} from {endpoint}: ")
    assert "network unreachable (connection refused)" in message
    assert cached_files(tmp_path) == []


async def test_a_silent_hub_fails_after_the_timeout(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"

        started = time.perf_counter()
        with pytest.raises(ModelUnavailable) as failure:
            await fetch(MODEL, endpoint, tmp_path, timeout_s=1.0)

        assert 0.9 < time.perf_counter() - started < 5.0
    assert one_line(failure.value).endswith("the hub did not answer in time")


def test_default_model_grows_with_the_cores() -> None:
    assert default_model(1) is QWEN2_5_0_5B_INSTRUCT
    assert default_model(2) is QWEN2_5_0_5B_INSTRUCT
    assert default_model(7) is QWEN2_5_0_5B_INSTRUCT
    assert default_model(8) is QWEN2_5_1_5B_INSTRUCT
    assert default_model(64) is QWEN2_5_1_5B_INSTRUCT
    assert default_model(0) is QWEN2_5_0_5B_INSTRUCT
    assert default_model() is default_model(usable_cores())
    floors = [floor for floor, _ in DEFAULT_MODELS]
    assert floors == sorted(floors)
    for _, model in DEFAULT_MODELS:
        assert len(model.revision) == 40
        assert int(model.revision, 16) >= 0
        assert model.sha256 is not None
        assert len(model.sha256) == 64
