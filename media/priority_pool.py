"""A thread pool that runs the most urgent waiting work first.

Speech synthesis and recognition are shared by every call of the process. When calls pile up, a
caller waiting in silence for an answer's first words should not wait behind another call's third
sentence, which nobody will hear before its first two have played, nor a finished turn's decode
behind another call's speculative one: work is taken by ``priority`` (lower first), then in the
order it came.

Work already running cannot be overtaken by a queue. Work that can stop half-way and carry on
(a Piper synthesis: ``media.yielding.YieldingSession``) can instead hand its thread over: told by
``on_submit`` that more urgent work has arrived, it stops and calls :meth:`PriorityPool.run_urgent`,
which runs the more urgent work there and then, before it starts again.
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
    submitted calls, most urgent first.

    Same contract as ``concurrent.futures.ThreadPoolExecutor.submit`` and ``shutdown``, with a
    keyword-only ``priority`` (lower runs sooner; equal ones in submission order).
    """

    def __init__(
        self,
        workers: int,
        thread_name_prefix: str = "pool",
        initializer: Callable[[], object] | None = None,
    ) -> None:
        self.on_submit: Callable[[int], object] = lambda priority: None
        """Called with each submitted work's priority, after it is queued, in the submitting
        thread (a hook: running work that can give way checks whether it should)."""
        self._running = threading.local()
        self._busy = 0
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        self._initializer = initializer
        self._workers = workers
        self._name = thread_name_prefix
        self._queue: list[tuple[int, int, Future[Any], Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, priority: int = _NORMAL) -> Future[T]:
        future: Future[T] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot submit to a pool that was shut down")
            heapq.heappush(self._queue, (priority, next(self._order), future, fn, args))
            if len(self._threads) < self._workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._ready.notify()
        self.on_submit(priority)
        return future

    def running_priority(self) -> int | None:
        """The priority of the work the calling thread is running for this pool (the most
        recent, when :meth:`run_urgent` nests work); None outside of the pool's work."""
        stack = self._running_stack()
        return stack[-1] if stack else None

    def _running_stack(self) -> list[int]:
        """The priorities of the work the calling thread runs, innermost last."""
        stack: list[int] = self._running.__dict__.setdefault("stack", [])
        return stack

    def run_urgent(self, than: int) -> int:
        """Run, in the calling thread, the waiting work more urgent than ``than`` (lower),
        most urgent first, including any that arrives meanwhile; how many ran. Called by
        running work that gives way to it."""
        ran = 0
        while True:
            with self._ready:
                if not self._queue or self._queue[0][0] >= than:
                    return ran
                priority, _order, future, fn, args = heapq.heappop(self._queue)
            self._run(priority, future, fn, args)
            ran += 1

    @property
    def idle_workers(self) -> int:
        """Workers free to take work now (counting those not started yet)."""
        return self._workers - self._busy

    @property
    def waiting(self) -> int:
        """Work submitted and not started yet."""
        return len(self._queue)

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
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                priority, _order, future, fn, args = heapq.heappop(self._queue)
                self._busy += 1
            try:
                self._run(priority, future, fn, args)
            finally:
                with self._ready:
                    self._busy -= 1

    def _run(
        self, priority: int, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        if not future.set_running_or_notify_cancel():
            return
        stack = self._running_stack()
        stack.append(priority)
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            stack.pop()
