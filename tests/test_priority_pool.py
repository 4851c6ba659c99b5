"""The priority pool behind speech synthesis: urgent work first, then in order; futures behave
like a thread pool's."""

from __future__ import annotations

import threading

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


def test_running_work_can_run_more_urgent_waiting_work_in_its_own_thread() -> None:
    pool = PriorityPool(1)
    submitted: list[int] = []
    pool.on_submit = submitted.append
    started, gate = threading.Event(), threading.Event()
    ran: list[tuple[str, str, int | None]] = []

    def note(label: str) -> None:
        ran.append((label, threading.current_thread().name, pool.running_priority()))

    def later_sentence() -> int:
        started.set()
        assert pool.idle_workers == 0
        gate.wait(5)  # more urgent work arrives meanwhile
        return pool.run_urgent(than=5)

    outer = pool.submit(later_sentence, priority=5)
    assert started.wait(5)
    urgent = pool.submit(note, "first words", priority=URGENT)
    equal = pool.submit(note, "another later sentence", priority=5)
    gate.set()
    assert outer.result(timeout=5) == 1  # only the more urgent one, not the equal one
    urgent.result(timeout=5)
    equal.result(timeout=5)
    worker = ran[0][1]
    assert ran == [("first words", worker, URGENT), ("another later sentence", worker, 5)]
    assert submitted == [5, URGENT, 5]
    assert pool.running_priority() is None  # outside of the pool's work
    assert pool.idle_workers == 1
    pool.shutdown()
