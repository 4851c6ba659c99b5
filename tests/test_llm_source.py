"""Where the LLM comes from: the flags and variables that choose it; a model file that cannot
work stopping ``vocable serve`` in one line; a local server already running, found; the default
model downloaded once and run in process; and what is said when there is no LLM at all."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from playbooks.llm import ChatClient, ChatRequest
from server.config.llm import (
    DEFAULT_MODEL,
    ConfigError,
    LLMChoice,
    LLMSettings,
    add_llm_arguments,
)
from server.config.server import LocalLLMSettings, ServerConfig, add_serve_arguments
from server.llm.discovery import FoundServer, LocalServer, find_local_server
from server.llm.download import DownloadableModel
from server.llm.provider import LLMProvider, LLMStatus
from server.testkit.loopback import start_on_loopback
from server.testkit.scripted_llm import Reply, ScriptedLLM
from tests.conftest import EXAMPLES, REPO
from tests.support.hub_standin import HubStandin
from tests.support.models import SMOLLM2_FILENAME, smollm2_copy, smollm2_gguf, with_architecture
from tests.support.processes import run_vocable, spawn, stop_group, until_ready

pytestmark = pytest.mark.timeout(30)

URL = "http://127.0.0.1:11434/v1"
SMOLLM2_LABEL = SMOLLM2_FILENAME.removesuffix(".gguf")
"""How the server names the embedded model: its file's name."""
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREETING = "Hello, this is Acme support. How can I help you today?"


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def nowhere() -> LocalServer:
    return LocalServer("nothing", f"http://127.0.0.1:{closed_port()}/v1")


async def stream_text(client: ChatClient, question: str, max_tokens: int | None = None) -> str:
    """One streamed round's answer text."""
    request = ChatRequest(
        messages=[{"role": "user", "content": question}],
        model=client.model,
        max_tokens=max_tokens,
    )
    stream = await client.stream(request)
    try:
        return "".join([delta.text async for delta in stream])
    finally:
        await stream.aclose()


def without_llm_variables(**extra: str) -> dict[str, str]:
    """This process's environment without ``VOCABLE_*`` and ``OPENAI_*``, plus ``extra``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VOCABLE_", "OPENAI_"))}
    return {**clean, **extra}


# -- the choice: flags first, then VOCABLE_*, then OPENAI_* ----------------------------------------


def choose(*argv: str, env: dict[str, str] | None = None) -> LLMChoice:
    parser = argparse.ArgumentParser()
    add_llm_arguments(parser)
    return LLMChoice.resolve(parser.parse_args(argv), env or {})


def serve_config(*argv: str, env: dict[str, str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return ServerConfig.from_args(parser.parse_args(argv), env or {})


def test_nothing_given_means_auto_a_local_server_searched_first() -> None:
    choice = choose()

    assert choice == LLMChoice(mode="auto", endpoint=None, gguf=None, model=None)
    assert choice.embedded
    config = serve_config()
    assert config.llm is None
    assert config.local_llm == LocalLLMSettings(gguf=None, search=True, model=None)


def test_vocable_llm_local_runs_the_model_in_process_without_searching() -> None:
    choice = choose(env={"VOCABLE_LLM": "local"})

    assert (choice.mode, choice.endpoint, choice.embedded) == ("local", None, True)
    config = serve_config(env={"VOCABLE_LLM": "local"})
    assert config.local_llm == LocalLLMSettings(gguf=None, search=False, model=None)


def test_llm_none_runs_without_an_llm() -> None:
    choice = choose("--llm", "none")

    assert (choice.mode, choice.endpoint, choice.embedded) == ("none", None, False)
    config = serve_config("--llm", "none")
    assert (config.llm, config.local_llm) == (None, None)


def test_flags_beat_the_variables_of_the_same_setting() -> None:
    env = {
        "VOCABLE_LLM": "none",
        "VOCABLE_LLM_GGUF": "env.gguf",
        "VOCABLE_LLM_MODEL": "env-model",
    }
    choice = choose("--llm", "local", "--llm-gguf", "flag.gguf", "--llm-model", "m", env=env)
    assert (choice.mode, choice.gguf, choice.model) == ("local", Path("flag.gguf"), "m")

    assert choose("--llm", "auto", env={"VOCABLE_LLM": "none"}).mode == "auto"
    assert choose("--llm", "none", env={"VOCABLE_LLM": "local"}).mode == "none"
    endpoint = choose(
        "--llm-base-url",
        "http://flag.test/v1",
        "--llm-api-key",
        "flag-key",
        env={
            "VOCABLE_LLM_BASE_URL": "http://env.test/v1",
            "VOCABLE_LLM_API_KEY": "env-key",
            "OPENAI_BASE_URL": "http://openai.test/v1",
        },
    ).endpoint
    assert endpoint is not None
    assert (endpoint.base_url, endpoint.api_key) == ("http://flag.test/v1", "flag-key")


def test_variables_count_where_no_flag_is_given() -> None:
    choice = choose(env={"VOCABLE_LLM_GGUF": "~/models/m.gguf", "VOCABLE_LLM_MODEL": "env-model"})

    assert choice.gguf == Path.home() / "models" / "m.gguf"  # ~ expanded
    assert choice.model == "env-model"
    assert choice.embedded
    endpoint = choose(env={"VOCABLE_LLM_BASE_URL": URL, "OPENAI_BASE_URL": "http://o.test/v1"})
    assert endpoint.endpoint == LLMSettings(base_url=URL, api_key=None, model=DEFAULT_MODEL)


def test_llm_gguf_runs_that_file_in_process_whatever_openai_variables_say() -> None:
    env = {"OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": "http://openai.test/v1"}

    choice = choose("--llm-gguf", "m.gguf", env=env)

    assert (choice.mode, choice.gguf, choice.endpoint) == ("auto", Path("m.gguf"), None)
    assert choice.embedded
    config = serve_config("--llm-gguf", "m.gguf", env=env)
    assert config.llm is None
    assert config.local_llm == LocalLLMSettings(gguf=Path("m.gguf"), search=False, model=None)


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (("--llm", "none", "--llm-gguf", "m.gguf"), {}, ("--llm none", "--llm-gguf")),
        (("--llm-gguf", "m.gguf", "--llm-base-url", URL), {}, ("--llm-gguf", "--llm-base-url")),
        (("--llm", "local", "--llm-base-url", URL), {}, ("--llm local", "--llm-base-url")),
        # the same, from the environment alone
        (
            (),
            {"VOCABLE_LLM": "none", "VOCABLE_LLM_GGUF": "m.gguf"},
            ("VOCABLE_LLM=none", "VOCABLE_LLM_GGUF"),
        ),
        (
            (),
            {"VOCABLE_LLM_GGUF": "m.gguf", "VOCABLE_LLM_BASE_URL": URL},
            ("VOCABLE_LLM_GGUF", "VOCABLE_LLM_BASE_URL"),
        ),
        (
            (),
            {"VOCABLE_LLM": "local", "VOCABLE_LLM_BASE_URL": URL},
            ("VOCABLE_LLM=local", "VOCABLE_LLM_BASE_URL"),
        ),
    ],
)
def test_contradictions_are_one_line_naming_both(
    argv: tuple[str, ...], env: dict[str, str], names: tuple[str, str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        choose(*argv, env=env)

    message = str(caught.value)
    assert "\n" not in message
    assert all(name in message for name in names), message
    assert message.endswith("contradict each other: drop one")


def test_an_unknown_mode_names_the_flag_and_the_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ConfigError) as caught:
        choose(env={"VOCABLE_LLM": "remote"})
    message = str(caught.value)
    assert "--llm remote" in message
    assert "VOCABLE_LLM" in message
    assert "auto, local or none" in message
    # a namespace built by a program, not parsed: the same line
    args = argparse.Namespace(llm="remote", llm_gguf=None, llm_base_url=None)
    args.llm_api_key = args.llm_model = None
    with pytest.raises(ConfigError, match="VOCABLE_LLM"):
        LLMChoice.resolve(args, {})
    # on the command line argparse refuses it first, with its usage exit status
    with pytest.raises(SystemExit) as exited:
        choose("--llm", "remote")
    assert exited.value.code == 2
    assert "--llm: invalid choice: 'remote'" in capsys.readouterr().err


def test_openai_api_key_alone_is_openai_unless_local_is_asked_for() -> None:
    env = {"OPENAI_API_KEY": "sk-test"}

    choice = choose(env=env)
    assert choice.endpoint == LLMSettings(base_url=None, api_key="sk-test", model=DEFAULT_MODEL)
    assert not choice.embedded
    config = serve_config(env=env)
    assert (config.llm, config.local_llm) == (choice.endpoint, None)

    for local in (choose("--llm", "local", env=env), choose(env={**env, "VOCABLE_LLM": "local"})):
        assert (local.mode, local.endpoint, local.embedded) == ("local", None, True)


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (("--llm-gguf", "m.gguf"), {"VOCABLE_LLM": "none"}),
        (("--llm", "none"), {"VOCABLE_LLM_GGUF": "m.gguf"}),
        (("--llm-base-url", URL), {"VOCABLE_LLM_GGUF": "m.gguf"}),
    ],
)
def test_a_flag_beats_a_variable_of_another_llm_setting(
    argv: tuple[str, ...], env: dict[str, str]
) -> None:
    choice = choose(*argv, env=env)  # raises "... contradict each other" today

    if "--llm-gguf" in argv:
        assert choice.gguf == Path("m.gguf")
    else:
        assert choice.gguf is None


# -- a model file that cannot work stops `vocable serve` before it listens ------------------------


def missing(tmp_path: Path) -> Path:
    return tmp_path / "absent.gguf"


def truncated(tmp_path: Path) -> Path:
    return smollm2_copy(tmp_path / "half.gguf", smollm2_gguf().stat().st_size // 2)


def foreign(tmp_path: Path) -> Path:
    path = tmp_path / "support.gguf"
    path.write_text("name: support\n")
    return path


def unknown_architecture(tmp_path: Path) -> Path:
    return with_architecture(smollm2_copy(tmp_path / "llamz.gguf"), "llamz")


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("make", "says"),
    [
        (missing, "no such file"),
        (truncated, "truncated ("),
        (foreign, "not a GGUF model file"),
        (unknown_architecture, "llama.cpp cannot load it (architecture 'llamz'"),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
async def test_serve_refuses_a_bad_model_file_in_one_line_without_listening(
    tmp_path: Path, unused_tcp_port: int, make: Callable[[Path], Path], says: str
) -> None:
    path = make(tmp_path)
    port = unused_tcp_port
    run = asyncio.create_task(
        run_vocable("serve", "--llm-gguf", str(path), "--port", str(port), timeout_s=50)
    )
    connected = 0
    while not run.done():  # whoever listens on the port while it runs is seen
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            connected += 1
            writer.close()
        await asyncio.wait({run}, timeout=0.05)
    code, out, err = run.result()

    assert code == 2, err
    (line,) = err.splitlines()  # that line alone: no traceback, no log lines
    assert line.startswith(f"vocable: {path}: "), err
    assert says in line
    assert "Traceback" not in err
    assert "ready" not in out
    assert connected == 0


# -- a local server already running ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[LocalServer]:
    runner, port = await start_on_loopback(app)
    try:
        yield LocalServer(f"app on {port}", f"http://127.0.0.1:{port}/v1")
    finally:
        await runner.cleanup()


def models_app(
    body: str, content_type: str = "application/json", delay_s: float = 0.0
) -> web.Application:
    """``GET /v1/models`` answered 200 with ``body``, after ``delay_s``."""

    async def models(request: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.Response(text=body, content_type=content_type)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[LocalServer, list[float]]]:
    """A server that accepts connections and never answers; yields it and when each connection
    was accepted (``time.monotonic()``)."""
    accepted: list[float] = []
    handlers: set[asyncio.Task[Any]] = set()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        accepted.append(time.monotonic())
        try:
            while await reader.read(4096):  # until the client gives up
                pass
        finally:
            writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield LocalServer("silent", f"http://127.0.0.1:{port}/v1"), accepted
    finally:
        server.close()
        await server.wait_closed()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


async def test_the_server_that_lists_a_model_is_found_among_those_that_do_not(
    llm: ScriptedLLM,
) -> None:
    scripted = LocalServer("Scripted", llm.base_url)
    async with (
        served(web.Application()) as not_found,
        served(models_app("<html>LLM dashboard</html>", "text/html")) as html,
        served(models_app('{"object": "list", "data": []}')) as no_models,
    ):
        candidates = [nowhere(), not_found, html, no_models, scripted]

        found = await find_local_server(candidates, timeout_s=2.0)

    assert found == FoundServer(scripted, ("scripted",))


async def test_the_earlier_candidate_wins_when_two_answer_even_if_slower(llm: ScriptedLLM) -> None:
    scripted = LocalServer("Scripted", llm.base_url)
    slow_body = '{"data": [{"id": "slow-model"}, {"id": "other"}]}'
    async with served(models_app(slow_body, delay_s=0.3)) as slow:
        assert await find_local_server([slow, scripted]) == FoundServer(
            slow, ("slow-model", "other")
        )
        assert await find_local_server([scripted, slow]) == FoundServer(scripted, ("scripted",))


async def test_none_found_is_none_within_the_timeout() -> None:
    async with served(web.Application()) as not_found, silent_server() as (silent, accepted):
        started = time.monotonic()

        found = await find_local_server([nowhere(), not_found, silent], timeout_s=0.5)

        took = time.monotonic() - started
    assert found is None
    assert accepted  # the silent one was asked: the timeout is what ended the search
    assert 0.4 <= took < 1.5


# -- the provider: a local server, a model downloaded once, or nothing ----------------------------


def provider_without_server(
    tmp_path: Path, model: DownloadableModel, hub: str, announce: bool = True
) -> LLMProvider:
    """A provider as ``vocable serve`` makes one with no LLM settings, where no local server
    runs and ``hub`` serves the default model, cached under ``tmp_path``."""
    return LLMProvider(
        None,
        LocalLLMSettings(),
        search_in=[nowhere()],
        default_model=model,
        hub=hub,
        cache_dir=tmp_path / "hub-cache",
        announce=announce,
    )


def smollm2_on_the_hub(content: bytes) -> DownloadableModel:
    return DownloadableModel(
        label="SmolLM2 135M Instruct, Q4_1",
        repo_id="vocable-tests/SmolLM2-135M-Instruct-GGUF",
        filename=SMOLLM2_FILENAME,
        revision=COMMIT,
        size_bytes=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
    )


async def test_a_running_local_server_is_used(llm: ScriptedLLM, tmp_path: Path) -> None:
    llm.script([Reply(content="Hello from the local server.")])
    scripted = LocalServer("Scripted", llm.base_url)
    provider = LLMProvider(
        None,
        LocalLLMSettings(),
        search_in=[nowhere(), scripted],
        hub=f"http://127.0.0.1:{closed_port()}",
        cache_dir=tmp_path,
    )
    try:
        await provider.start()

        assert provider.status == LLMStatus(
            "ready", "local server", "scripted", detail=f"Scripted at {llm.base_url}"
        )
        client = await provider.ready()
        assert client is not None
        assert client is provider.client
        assert await stream_text(client, "Hello?") == "Hello from the local server."
    finally:
        await provider.close()
    assert llm.last_request["model"] == "scripted"
    assert llm.last_request["stream"] is True


async def test_start_returns_with_the_download_announced(tmp_path: Path) -> None:
    provider = provider_without_server(
        tmp_path, smollm2_on_the_hub(b"x"), f"http://127.0.0.1:{closed_port()}", announce=False
    )
    try:
        await provider.start()

        assert provider.status.state == "downloading"
    finally:
        await provider.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_the_default_model_downloads_in_the_background_then_runs_in_process(
    tmp_path: Path,
) -> None:
    content = smollm2_gguf().read_bytes()
    model = smollm2_on_the_hub(content)
    async with HubStandin(model.repo_id, model.filename, content, COMMIT) as hub:
        provider = provider_without_server(tmp_path, model, hub.endpoint, announce=False)
        seen: list[LLMStatus] = []
        try:
            started = time.monotonic()
            await provider.start()
            assert time.monotonic() - started < 2.0
            assert provider.client is None
            assert provider.status.state == "downloading"
            ready = asyncio.ensure_future(provider.ready())
            while True:  # every status it shows, as a page polling /config every 20 ms would
                if not seen or provider.status != seen[-1]:
                    seen.append(provider.status)
                if ready.done():
                    break
                await asyncio.wait({ready}, timeout=0.02)
            client = ready.result()

            assert client is not None
            assert client is provider.client
            states = [s.state for i, s in enumerate(seen) if i == 0 or s.state != seen[i - 1].state]
            assert states == ["downloading", "loading", "ready"], seen
            progress = [s.progress or 0.0 for s in seen if s.state == "downloading"]
            assert progress == sorted(progress), seen
            assert progress[0] == 0.0, seen
            assert progress[-1] == 1.0, seen
            assert any(0.0 < p < 1.0 for p in progress), seen
            assert all(s.model == model.label for s in seen if s.state == "downloading")
            assert provider.status.state == "ready"
            assert provider.status.source == "embedded"
            assert provider.status.model == SMOLLM2_LABEL
            assert len(hub.downloads()) == 1
            answer = await stream_text(client, "What is the capital of France?", max_tokens=24)
            assert re.search(r"[A-Za-z]{2}", answer), answer
        finally:
            await provider.close()

        asked = len(hub.requests)
        again = provider_without_server(tmp_path, model, hub.endpoint, announce=False)
        try:
            await again.start()
            assert await again.ready() is not None
            assert again.status.state == "ready"
            assert again.status.source == "embedded"
        finally:
            await again.close()
        assert len(hub.requests) == asked  # found in the cache: the hub was not even asked


async def test_no_hub_and_no_local_server_leave_no_llm_and_say_the_ways_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = smollm2_on_the_hub(b"never served")
    hub = f"http://127.0.0.1:{closed_port()}"
    provider = provider_without_server(tmp_path, model, hub)
    try:
        await provider.start()
        assert provider.status.state == "downloading"

        assert await provider.ready() is None
    finally:
        await provider.close()

    status = provider.status
    assert (status.state, status.source, status.model) == ("unavailable", "embedded", model.label)
    assert "\n" not in status.detail
    assert status.detail.startswith(f"cannot download {model.filename} from {hub}: ")
    assert "network unreachable" in status.detail
    said = [line for line in capsys.readouterr().err.splitlines() if "no LLM" in line]
    assert len(said) == 1
    assert said[0].startswith(f"vocable: no LLM: {status.detail}; ")
    for way_out in ("--llm-gguf", "--llm-base-url", "OPENAI_API_KEY", "--llm none"):
        assert way_out in said[0]


# -- as users run it -------------------------------------------------------------------------------


@dataclass
class Served:
    said: list[str] = field(default_factory=list)
    """Its stdout lines up to the one saying it is ready."""
    stderr: str = ""
    """All of its stderr, once it has exited."""


@contextlib.asynccontextmanager
async def serving(port: int, *args: str, env: dict[str, str]) -> AsyncIterator[Served]:
    """``vocable serve --port PORT ARGS`` until it says ready; on leaving, SIGINT and its exit
    (status 0 asserted)."""
    process = await spawn(
        sys.executable,
        "-m",
        "server",
        "serve",
        "--port",
        str(port),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env=env,
    )
    assert process.stdout is not None
    served = Served()
    try:
        await until_ready(process, 120, served.said)
        yield served
    finally:
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), timeout=30)
        served.stderr = err.decode()
    assert process.returncode == 0, served.stderr


async def client_config(port: int, settled: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """``GET /config`` until ``settled`` says its answer is final (10 s at most)."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(10):
        while True:
            async with http.get(f"http://127.0.0.1:{port}/config") as response:
                assert response.status == 200
                config: dict[str, Any] = await response.json()
            if settled(config):
                return config
            await asyncio.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_serve_with_no_llm_settings_starts_without_one_and_says_so_once(
    tmp_path: Path, unused_tcp_port: int
) -> None:
    assert await find_local_server() is None, "a local LLM server runs here: this test needs none"
    env = without_llm_variables(
        HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HUB_CACHE=str(tmp_path)
    )
    async with serving(unused_tcp_port, env=env) as server:
        config = await client_config(
            unused_tcp_port, lambda c: c["llm"]["state"] not in ("searching", "downloading")
        )
        assert config["llm_configured"] is False
        assert config["llm"]["state"] == "unavailable"
        assert config["llm"]["detail"].startswith("cannot download ")
    said = [line for line in server.stderr.splitlines() if "no LLM:" in line]
    assert len(said) == 1, server.stderr
    assert said[0].startswith("vocable: no LLM: cannot download ")
    assert "Traceback" not in server.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_serve_with_a_model_file_runs_it_in_process(unused_tcp_port: int) -> None:
    env = without_llm_variables()
    model = smollm2_gguf()
    async with serving(unused_tcp_port, "--llm-gguf", str(model), env=env) as server:
        config = await client_config(unused_tcp_port, lambda c: True)
        assert config["llm_configured"] is True
        assert config["llm"]["state"] == "ready"
        assert config["llm"]["source"] == "embedded"
        assert config["llm"]["model"] == SMOLLM2_LABEL
    assert f"vocable: LLM: {SMOLLM2_LABEL} in process (llama.cpp), from {model}" in server.said
    assert "Traceback" not in server.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_chat_answers_with_a_model_file_and_exits_at_the_end_of_its_input() -> None:
    process = await spawn(
        sys.executable,
        "-m",
        "server",
        "chat",
        str(EXAMPLES / "support.yaml"),
        "--llm-gguf",
        str(smollm2_gguf()),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env=without_llm_variables(),
    )
    assert process.stdin is not None
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        process.stdin.write(b"Hi, I have a question about my order\n")
        process.stdin.close()
        async with asyncio.timeout(60):
            greeting = (await process.stdout.readline()).decode().rstrip("\n")
            answer = (await process.stdout.readline()).decode().rstrip("\n")
        assert greeting == GREETING
        assert re.search(r"[A-Za-z]{2}", answer), answer
        try:  # the answer is out: what is left is closing the model
            async with asyncio.timeout(30):
                rest, err = await asyncio.gather(process.stdout.read(), process.stderr.read())
                code = await process.wait()
        except TimeoutError:
            pytest.fail(f"vocable chat answered {answer!r}, then did not exit within 30 s")
    finally:
        await stop_group(process)

    assert code == 0, err.decode()
    assert rest == b""
    assert b"Traceback" not in err


async def test_chat_without_an_llm_exits_2_saying_how_to_give_one() -> None:
    code, out, err = await run_vocable("chat", str(EXAMPLES / "support.yaml"), "--llm", "none")

    assert code == 2
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith("vocable: chat needs an LLM (--llm none was given)")
    assert "--llm-base-url" in line
    assert "OPENAI_API_KEY" in line
