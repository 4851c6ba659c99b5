"""Engine threads below the event loop's priority: what runs niced, what does not."""

from __future__ import annotations

import os
import threading

import pytest

from media.priority import BACKGROUND_NICENESS, in_background_thread, lower_this_thread


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_background_work_runs_nicer_and_the_caller_keeps_its_priority() -> None:
    before = _niceness()
    seen = in_background_thread(_niceness)
    assert seen == min(before + BACKGROUND_NICENESS, 19)
    assert _niceness() == before


def test_threads_started_by_background_work_inherit_its_priority() -> None:
    def start_a_thread() -> int:
        found: list[int] = []
        thread = threading.Thread(target=lambda: found.append(_niceness()))
        thread.start()
        thread.join()
        return found[0]

    assert in_background_thread(start_a_thread) == min(_niceness() + BACKGROUND_NICENESS, 19)


def test_a_failure_in_background_work_reaches_the_caller() -> None:
    def fail() -> None:
        raise LookupError("no such voice")

    with pytest.raises(LookupError, match="no such voice"):
        in_background_thread(fail)


def test_no_niceness_leaves_the_thread_as_it_was() -> None:
    def unchanged() -> int:
        before = _niceness()
        lower_this_thread(0)
        return _niceness() - before

    assert in_background_thread(unchanged, niceness=0) == 0
