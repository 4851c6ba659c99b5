"""A thread pool that runs the most urgent waiting work first.

Speech synthesis and recognition are shared by every call of the process. When calls pile up, a
caller waiting in silence for an answer's first words should not wait behind another call's third
sentence, which nobody will hear before its first two have played, nor a finished turn's decode
behind another call's speculative one: work is taken by ``priority`` (lower first), then in the
order it came.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["URGENT", "PriorityPool"]

T = TypeVar("T")

URGENT = 0
"""The priority of work somebody is waiting for now (an answer's first words)."""
_NORMAL = 1


class PriorityPool:
    """``workers`` threads (started on first use, each running ``initializer`` first) running
    submitted calls, most urgent first, and ``urgent_workers`` more that run only urgent work
    (priority ``URGENT`` or lower), so that it never waits for a long job already running.

    Same contract as ``concurrent.futures.ThreadPoolExecutor.submit`` and ``shutdown``, with a
    keyword-only ``priority`` (lower runs sooner; equal ones in submission order).
    """

    def __init__(
        self,
        workers: int,
        thread_name_prefix: str = "pool",
        initializer: Callable[[], object] | None = None,
        *,
        urgent_workers: int = 0,
    ) -> None:
        if workers < 1 or urgent_workers < 0:
            raise ValueError("a pool needs at least one worker")
        self._initializer = initializer
        self._size = {False: workers, True: urgent_workers}
        self._name = thread_name_prefix
        self._queue: list[tuple[int, int, Future[Any], Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._threads: dict[bool, list[threading.Thread]] = {False: [], True: []}
        self._running = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, priority: int = _NORMAL) -> Future[T]:
        future: Future[T] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot submit to a pool that was shut down")
            heapq.heappush(self._queue, (priority, next(self._order), future, fn, args))
            self._start_worker(urgent_only=False)
            if priority <= URGENT:
                self._start_worker(urgent_only=True)
            self._ready.notify_all()  # an urgent-only worker may not take what a notify gives
        return future

    @property
    def waiting(self) -> int:
        """Work submitted and not started yet."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Work started and not finished."""
        return self._running

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work; waiting work is cancelled if ``cancel_futures``, else still run."""
        with self._ready:
            self._closed = True
            if cancel_futures:
                for _priority, _order, future, _fn, _args in self._queue:
                    future.cancel()
                self._queue.clear()
            self._ready.notify_all()
        if wait:
            for thread in self._threads[False] + self._threads[True]:
                if thread is not threading.current_thread():
                    thread.join()

    def _start_worker(self, *, urgent_only: bool) -> None:
        threads = self._threads[urgent_only]
        if len(threads) >= self._size[urgent_only]:
            return
        name = f"{self._name}_{'urgent_' if urgent_only else ''}{len(threads)}"
        thread = threading.Thread(target=self._work, args=(urgent_only,), name=name, daemon=True)
        threads.append(thread)
        thread.start()

    def _has_work_for(self, urgent_only: bool) -> bool:
        return bool(self._queue) and (not urgent_only or self._queue[0][0] <= URGENT)

    def _work(self, urgent_only: bool) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            with self._ready:
                while not self._has_work_for(urgent_only) and not self._closed:
                    self._ready.wait()
                if not self._has_work_for(urgent_only):
                    return
                _priority, _order, future, fn, args = heapq.heappop(self._queue)
                self._running += 1
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args)
                    except BaseException as exc:  # handed to whoever waits on the future
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._ready:
                    self._running -= 1
