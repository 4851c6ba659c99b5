"""A thread pool that runs the most urgent waiting work first.

Speech synthesis and recognition are shared by every call of the process. When calls pile up, a
finished turn's decode should not wait behind another call's speculative one, nor a later
sentence needed in half a second behind one needed in three: work is taken by ``priority``
(lower first), then in the order it came. Work already running is not overtaken; work that must
never wait behind another kind gets a pool of its own (``media.tts``: an answer's first words
and its later sentences).

The workers are daemon threads, so a pool nobody shut down never holds the process open. But a
daemon thread must not be inside a model's native code when the interpreter finalizes: when
that code returns and takes the GIL back, CPython ends the thread by unwinding it through C++
frames that forbid it, and the process aborts ("terminate called without an active exception",
exit status 134) after its work is done. So every pool still open at exit is shut down first
(waiting work cancelled, running work finished), by an :mod:`atexit` hook, which runs before
finalization.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["URGENT", "PriorityPool"]

T = TypeVar("T")

URGENT = 0
"""The priority of work somebody is waiting for now (an answer's first words)."""
_NORMAL = 1


_open_pools: weakref.WeakSet[PriorityPool] = weakref.WeakSet()


@atexit.register
def _shut_down_open_pools() -> None:
    for pool in list(_open_pools):
        pool.shutdown(wait=True, cancel_futures=True)


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
        _open_pools.add(self)

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
        return future

    def runs_here(self) -> bool:
        """Whether the calling thread is one of this pool's workers."""
        return threading.current_thread() in self._threads

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
                _priority, _order, future, fn, args = heapq.heappop(self._queue)
                self._busy += 1
            try:
                self._run(future, fn, args)
            finally:
                with self._ready:
                    self._busy -= 1

    @staticmethod
    def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)
