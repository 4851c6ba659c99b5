"""Running ``vocable serve``: one process, or a supervisor of ``--workers`` processes.

A serving process drains on SIGTERM or SIGINT: it admits no new call (offers and INVITEs get
503 with Retry-After, ``/healthz`` says ``draining`` with status 503 so load balancers look
elsewhere), lets live calls go on for up to ``drain_timeout_s``, then hangs up the rest and
exits. A second signal cuts the drain short.

With ``workers > 1`` the supervisor starts that many serving processes on the same port
(SO_REUSEPORT: the kernel spreads new connections), each with its own speech models; a model run
in process (llama.cpp) runs once, in the supervisor, and the workers reach it on loopback (one
copy of the weights, its slots shared by every worker's calls). A call lives in the
process that answered its offer; call ids carry the worker (``w1.``), and each worker also listens
on a private Unix socket so any of them can pass a hang-up or a metrics scrape to the others.
The SIP and AudioSocket endpoints run in worker 0 only. A worker that dies is restarted. A
worker whose supervisor is gone (killed, crashed) hangs up its calls and exits at once, so the
next start finds the port free.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from aiohttp import web

from playbooks import load_playbooks
from server.config.llm import ConfigError
from server.config.server import ServerConfig
from server.http.app import CALLS, SIP, create_app
from server.http.siblings import control_socket
from server.llm.provider import load_shared_model, shared_settings
from server.runtime.logs import configure_logging

__all__ = ["run_server", "serve", "serve_command"]

log = logging.getLogger(__name__)

EXIT_CONFIG = 2
"""A worker's exit status when its configuration cannot work (the supervisor stops too)."""

RESTART_LIMIT = 5
"""Restarts of one worker within a minute before the supervisor gives up on the server."""


def run_server(config: ServerConfig, announce: Callable[[str], None]) -> int:
    """Serve until a signal, then drain; with ``config.workers > 1`` supervise that many
    workers. Returns the exit status."""
    if config.workers <= 1:
        asyncio.run(serve(config, announce))
        return 0
    return _supervise(config, announce)


async def serve(config: ServerConfig, announce: Callable[[str], None] = print) -> None:
    """One serving process: up until SIGTERM/SIGINT, then drained and closed."""
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    sites: list[web.BaseSite] = [
        web.TCPSite(runner, config.host, config.port, reuse_port=config.workers > 1)
    ]
    if config.workers > 1:
        path = control_socket(config.port, config.worker_index)
        path.unlink(missing_ok=True)
        sites.append(web.UnixSite(runner, str(path)))
    for site in sites:
        await site.start()
    signals = _Signals(supervised=config.workers > 1)
    try:
        announce(f"ready, open http://{config.host}:{config.port}")
        await signals.first.wait()
        if signals.orphaned:
            announce("the supervisor is gone: hanging up and exiting")
        calls = app[CALLS]
        live = len(calls)
        if live:
            announce(f"draining: {live} call(s) may go on for {config.drain_timeout_s:.0f} s")
        drain = asyncio.ensure_future(calls.drain(config.drain_timeout_s))
        sip = app.get(SIP)
        if sip is not None:  # a PBX stops routing new calls to a draining extension
            await sip.unregister()
        second = asyncio.ensure_future(signals.second.wait())
        await asyncio.wait({drain, second}, return_when=asyncio.FIRST_COMPLETED)
        second.cancel()
        left = await drain if drain.done() else len(calls)
        drain.cancel()
        if left:
            announce(f"hanging up {left} call(s)")
    finally:
        signals.close()
        await runner.cleanup()  # hangs up what is left, closes the models
        if config.workers > 1:
            control_socket(config.port, config.worker_index).unlink(missing_ok=True)


class _Signals:
    """Stop signals, counted: the first starts the drain, the second ends it. A supervised
    worker heeds only SIGTERM (its supervisor passes a terminal's Ctrl-C on as SIGTERM, so the
    worker does not count the same keypress twice), and takes its supervisor's death as both
    signals at once: with nobody to restart it or to pass it a signal, it must not linger on
    the port."""

    def __init__(self, supervised: bool) -> None:
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        self.orphaned = False
        self._loop = asyncio.get_running_loop()
        self._numbers = [signal.SIGTERM] if supervised else [signal.SIGTERM, signal.SIGINT]
        if supervised:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for number in self._numbers:
            self._loop.add_signal_handler(number, self._received)
        self._parent_sentinel = _parent_sentinel() if supervised else None
        if self._parent_sentinel is not None:
            # the read end of a pipe only the supervisor writes: readable (EOF) once it is gone,
            # however it died, SIGKILL included
            self._loop.add_reader(self._parent_sentinel, self._parent_gone)

    def _received(self) -> None:
        (self.second if self.first.is_set() else self.first).set()

    def _parent_gone(self) -> None:
        assert self._parent_sentinel is not None
        self._loop.remove_reader(self._parent_sentinel)
        self._parent_sentinel = None
        self.orphaned = True
        self.first.set()
        self.second.set()

    def close(self) -> None:
        for number in self._numbers:
            self._loop.remove_signal_handler(number)
        if self._parent_sentinel is not None:
            self._loop.remove_reader(self._parent_sentinel)
            self._parent_sentinel = None


def _parent_sentinel() -> int | None:
    """The file descriptor that becomes readable when this process's multiprocessing parent
    exits, or None when it was not started by multiprocessing."""
    parent = multiprocessing.process.parent_process()
    return parent.sentinel if parent is not None else None


# -- the supervisor ------------------------------------------------------------------------------


def _worker_config(config: ServerConfig, index: int) -> ServerConfig:
    phone = index == 0
    return dataclasses.replace(
        config,
        worker_index=index,
        call_id_prefix=f"w{index}.",
        sip=config.sip if phone else None,
        audiosocket=config.audiosocket if phone else None,
    )


def _worker_main(config: ServerConfig) -> None:
    configure_logging(config.log_format, worker=config.worker_index)

    def announce(message: str) -> None:
        print(f"vocable[w{config.worker_index}]: {message}", flush=True)

    try:
        asyncio.run(serve(config, announce))
    except ConfigError as exc:  # e.g. a model llama.cpp cannot load: restarting cannot help
        print(f"vocable[w{config.worker_index}]: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)


def _supervise(config: ServerConfig, announce: Callable[[str], None]) -> int:
    """Start the workers, restart any that dies, and pass SIGTERM/SIGINT on to all of them."""
    try:
        shared = asyncio.run(load_shared_model(config))
    except ConfigError as exc:  # a model llama.cpp cannot load: no worker could run
        print(f"vocable: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    if shared is not None and config.local_llm is not None:
        local = dataclasses.replace(config.local_llm, shared=shared_settings(shared))
        config = dataclasses.replace(config, local_llm=local)
        announce(f"the workers share one model: {shared.model} (llama.cpp in the supervisor)")
    try:
        return _run_workers(config, announce)
    finally:
        if shared is not None:
            shared.close()


def _run_workers(config: ServerConfig, announce: Callable[[str], None]) -> int:
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads
    stopping = False

    def stop(_number: int, _frame: object) -> None:
        """First signal: the workers drain; second: they end the drain."""
        nonlocal stopping
        stopping = True
        for process in workers.values():
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    def start(index: int) -> BaseProcess:
        process = context.Process(
            target=_worker_main, args=(_worker_config(config, index),), name=f"vocable-w{index}"
        )
        process.start()
        return process

    workers = {index: start(index) for index in range(config.workers)}
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    announce(f"{config.workers} workers on port {config.port}")
    restarts: dict[int, list[float]] = {index: [] for index in workers}
    status = 0
    while any(process.is_alive() for process in workers.values()):
        time.sleep(0.5)
        if stopping:
            continue
        for index, process in list(workers.items()):
            if process.is_alive():
                continue
            if process.exitcode == EXIT_CONFIG:
                status = EXIT_CONFIG
                stop(signal.SIGTERM, None)
                break
            recent = [t for t in restarts[index] if time.monotonic() - t < 60] + [time.monotonic()]
            restarts[index] = recent
            if len(recent) > RESTART_LIMIT:
                print(f"vocable: worker {index} keeps dying; stopping", file=sys.stderr)
                status = 1
                stop(signal.SIGTERM, None)
                break
            log.error("worker %d exited (code %s); restarting", index, process.exitcode)
            workers[index] = start(index)
    for process in workers.values():
        process.join()
    return status


def serve_command(args: argparse.Namespace) -> int:
    """``vocable serve``: the settings of ``args`` checked (a bad one raises ConfigError before
    any model loads), then the server run until it is stopped."""

    config = ServerConfig.from_args(args)
    if config.otel:
        try:
            import opentelemetry.exporter.otlp.proto.http
            import opentelemetry.sdk  # noqa: F401
        except ImportError:
            raise ConfigError("--otel needs the otel extra: pip install 'vocable[otel]'") from None
    if config.sip is not None:
        from server.transports.sip.compat import check_sip_stack

        check_sip_stack()  # an untested aiosipua stops here, before the models load
    # an invalid playbook stops here, with its one line
    load_playbooks(config.playbook, config.tools_module)
    if config.redis_url is not None:
        from server.runtime.call_directory import DirectoryUnavailable, check_reachable

        try:  # an unreachable call directory stops here, before the models load
            check_reachable(config.redis_url)
        except DirectoryUnavailable as exc:
            raise ConfigError(str(exc)) from None
    if config.local_llm is not None and config.local_llm.gguf is not None:
        from server.llm.gguf import GgufError, read_gguf

        try:  # a missing, truncated or foreign file stops here, before the models load
            read_gguf(config.local_llm.gguf)
        except GgufError as exc:
            raise ConfigError(str(exc)) from None
    if config.turn_model is not None:
        from media.turn_model import TurnModelError, check_turn_model

        try:  # a missing or damaged file stops here, before the other models load
            check_turn_model(config.turn_model.path)
        except TurnModelError as exc:
            raise ConfigError(str(exc)) from None
    if config.llm is None and config.local_llm is None:
        print(
            "vocable: no LLM (--llm none): calls will connect, but the agent can only say so",
            file=sys.stderr,
        )
    if config.sip is not None:
        print(f"vocable: SIP on {config.sip.host}:{config.sip.port} (UDP and TCP)", flush=True)
    print(f"vocable: loading models and playbooks from {config.playbook} ...", flush=True)
    return run_server(config, lambda message: print(f"vocable: {message}", flush=True))
