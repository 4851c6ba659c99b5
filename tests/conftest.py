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


LONGEST_FILES = (
    "test_transfers.py", "test_sip.py", "test_barge_in.py", "test_voice_pipeline.py",
    "test_soak.py", "test_bench_smoke.py", "test_faults.py", "test_vocable_test.py",
    "test_vocable_test_callers.py", "test_outbound_calls.py", "test_endpointing.py",
    "test_operations.py", "test_telephony.py", "test_real_llm.py", "test_webrtc_call.py",
    "test_recording.py", "test_fuzz.py", "test_remote_inference.py", "test_sip_baresip.py",
)  # fmt: skip
"""The files that take longest, longest first (each 28-120 s of a worker's time in a run of
the suite with two workers on the 2-core AMD EPYC, 2026-11-29). A stale list costs balance,
never a test."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (``LONGEST_FILES``), then the other files with ``slow`` tests
    (real models, real peers, real calls), then the rest, each file's tests in their order.
    ``make test`` runs ``--dist loadfile --no-loadscope-reorder``: a worker takes a whole file
    at a time, in this order (xdist's own puts the files with the most tests first, which left
    a 65 s file of one test for the end, one worker busy while the other had nothing to take)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    rank = {name: n for n, name in enumerate(LONGEST_FILES)}

    def order(item: pytest.Item) -> tuple[int, int]:
        if item.path.name in rank:
            return (0, rank[item.path.name])
        return (1 if item.path in slow_files else 2, 0)

    items.sort(key=order)


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
