"""Shared fixtures. The only stand-in is the LLM: ``server.testkit.scripted_llm.ScriptedLLM``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from server.testkit.scripted_llm import ScriptedLLM
from tests.support import processes
from tests.support.calls import PAYLOAD_PROBLEMS

if TYPE_CHECKING:
    from server.testkit.caller import WebRTCCaller
    from tests.support.calls import VoiceCall

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "playbooks" / "examples"

# Servers the tests start get the LLM each test gives them, nothing found or fetched on their
# own: no LLM unless a test says so, and no model hub but a closed local port (a test that
# fetches a model names its own stand-in hub).
os.environ["VOCABLE_LLM"] = "none"
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with ``slow`` tests (real models, real peers, real calls) first, each file's
    tests in their order. Under ``make test`` xdist then hands out whole files with the most
    tests first (its ``--loadscope-reorder``); its own order was kept after a longest-first one
    was tried (CONTRIBUTING.md, "Keeping the suite fast")."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


class _IllegalMoves(logging.Handler):
    """Collects the errors a call's state machines log for a move they lack."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.moves: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "illegal" in message and "move" in message:
            self.moves.append(message)


STATE_MACHINES = ("server.call.session", "server.call.answer")
"""The loggers of a call's two state machines: its phase, and each answer's state."""


@pytest.fixture(autouse=True)
def _no_illegal_state_moves(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test fails on an illegal move of a call's phase or of an answer's state made in
    this process, whatever it tests (``@pytest.mark.illegal_move``: a test that makes one on
    purpose)."""
    handler = _IllegalMoves()
    loggers = [logging.getLogger(name) for name in STATE_MACHINES]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    if handler.moves and request.node.get_closest_marker("illegal_move") is None:
        pytest.fail(f"illegal state moves: {handler.moves}")


@pytest.fixture(autouse=True)
def _voice_events_fit_their_payloads() -> Iterator[None]:
    """Every test fails if a call it runs on the loopback line (``tests.support.calls``) emits
    an event whose data is not its kind's payload type (``server.call.events.EVENT_DATA``)."""
    PAYLOAD_PROBLEMS.clear()
    yield
    problems, PAYLOAD_PROBLEMS[:] = list(PAYLOAD_PROBLEMS), []
    if problems:
        pytest.fail(f"voice events that do not fit their payload type: {problems[:5]}")


@pytest.fixture(scope="session", autouse=True)
def _nothing_outlives_the_suite() -> Iterator[None]:
    """At the end of the session no process the tests started is alive, and none listens on a
    port: whatever is left is killed and reported as an error."""
    yield
    processes.kill_started()
    left = processes.leftovers()
    if left:
        sockets = processes.listening(set(left))
        for pid in left:
            processes.kill_group(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"processes left running after the tests: {left}; listening: {sockets}")


@pytest.fixture(autouse=True)
def _children_die_with_the_test() -> Iterator[None]:
    """Every process group a test started is killed when the test ends, passed or not (those of
    wider-scoped fixtures, started before, live on until the session ends)."""
    before = processes.started()
    yield
    processes.kill_started(before)


@pytest.fixture
async def llm() -> AsyncIterator[ScriptedLLM]:
    """A running scripted LLM with an empty script; call ``llm.script([...])``."""
    async with ScriptedLLM() as server:
        yield server


@pytest.fixture
async def caller() -> AsyncIterator[WebRTCCaller]:
    """A WebRTC caller (aiortc, as a browser calls); ``await caller.connect(base_url(server))``
    starts its call. Closed after the test."""
    from server.testkit.caller import WebRTCCaller

    caller = WebRTCCaller()
    yield caller
    await caller.close()


class FakeSleep:
    """Records the delays a retry policy asks for, without waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@pytest.fixture
def sleeps() -> FakeSleep:
    return FakeSleep()


@pytest.fixture
def write_playbook(tmp_path: Path) -> Callable[..., Path]:
    """Write a playbook (YAML text, dedented) and optionally its tools module; returns its path."""

    def write(yaml_text: str, tools_py: str | None = None, name: str = "playbook.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(yaml_text))
        if tools_py is not None:
            (tmp_path / "tools.py").write_text(textwrap.dedent(tools_py))
        return path

    return write


@pytest.fixture
async def calls() -> AsyncIterator[list[VoiceCall]]:
    """Voice calls a test starts (append them); stopped, with their LLM clients, afterwards."""
    started: list[VoiceCall] = []
    yield started
    for call in started:
        await call.line.stop()
        if call.orchestrator.llm is not None:
            await call.orchestrator.llm.aclose()
