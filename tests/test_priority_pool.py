"""The priority pool behind speech synthesis: urgent work first, then in order; futures behave
like a thread pool's."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from media.priority_pool import URGENT, PriorityPool


def test_waiting_work_runs_most_urgent_first_then_in_submission_order() -> None:
    pool = PriorityPool(1, thread_name_prefix="test")
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold() -> bool:
        started.set()
        return gate.wait(5)

    blocker = pool.submit(hold)  # the one worker is busy until the gate opens
    assert started.wait(5)
    futures = [
        pool.submit(ran.append, "later sentence 1"),
        pool.submit(ran.append, "later sentence 2"),
        pool.submit(ran.append, "first words A", priority=URGENT),
        pool.submit(ran.append, "first words B", priority=URGENT),
    ]
    gate.set()
    assert blocker.result(timeout=5) is True
    for future in futures:
        future.result(timeout=5)
    assert ran == ["first words A", "first words B", "later sentence 1", "later sentence 2"]
    pool.shutdown()


def test_an_exception_reaches_the_future_and_the_worker_goes_on() -> None:
    pool = PriorityPool(2)
    failed = pool.submit(int, "not a number")
    with pytest.raises(ValueError, match="invalid literal"):
        failed.result(timeout=5)
    assert pool.submit(sum, [1, 2, 3]).result(timeout=5) == 6
    pool.shutdown()


def test_shutdown_cancels_waiting_work_when_asked_and_refuses_more() -> None:
    pool = PriorityPool(1)
    started, gate = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(5)

    running = pool.submit(hold)
    waiting = pool.submit(str, "never")
    assert started.wait(5)  # the worker is busy with the first: the second waits
    pool.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled()
    gate.set()
    assert running.result(timeout=5) is True
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(str, "too late")
    pool.shutdown(wait=True)


def test_a_pool_tells_its_own_workers_from_other_threads() -> None:
    pool = PriorityPool(1)
    other = PriorityPool(1)
    try:
        assert pool.submit(pool.runs_here).result(timeout=5) is True
        assert pool.submit(other.runs_here).result(timeout=5) is False
        assert pool.runs_here() is False  # the test's own thread
    finally:
        pool.shutdown()
        other.shutdown()


_EXIT_MID_DECODE = """
import time
import numpy as np
from faster_whisper import WhisperModel
from media.priority_pool import PriorityPool
from media.stt import default_whisper_model

model = WhisperModel(default_whisper_model(), device="cpu", compute_type="int8",
                     local_files_only=True)
noise = (np.random.default_rng(0).standard_normal(16000 * 25) * 0.1).astype(np.float32)
pool = PriorityPool(1)

def decode_for(seconds):
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        list(model.transcribe(noise, beam_size=5)[0])

pool.submit(decode_for, 1.5)
pool.submit(decode_for, 60.0)  # waiting work: cancelled at exit
while pool.idle_workers:
    time.sleep(0.01)
time.sleep(0.8)  # past the features, inside the native decode
"""


def test_the_process_exits_cleanly_while_a_worker_is_inside_native_code() -> None:
    """A daemon worker inside CTranslate2 at interpreter finalization aborted the process
    (status 134, "terminate called without an active exception"): the pools still open are
    shut down at exit, their running work finished and their waiting work cancelled."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_MID_DECODE],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
