"""Background CPU work (Whisper decodes, Piper synthesis) below the event loop's priority.

A call's media path (packets in, the VAD, frames out, ICE and DTLS) runs on the event loop and
must keep its 20 ms pace; speech recognition and synthesis are heavy but can wait a little. When
the cores are busy, the kernel should run the loop first: the engines' threads, and the threads
their libraries start (onnxruntime's and CTranslate2's pools inherit the niceness of the thread
that creates them), run ``BACKGROUND_NICENESS`` steps nicer than the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["BACKGROUND_NICENESS", "in_background_thread", "lower_this_thread"]

T = TypeVar("T")

BACKGROUND_NICENESS = 5
"""How much nicer than the process engine threads run (CFS weight about 3x lower)."""


def lower_this_thread(niceness: int = BACKGROUND_NICENESS) -> None:
    """Make the calling thread (and the threads it starts from now on) ``niceness`` nicer.
    Where the platform has no per-thread niceness, nothing happens."""
    if niceness <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):  # a sandbox may refuse: the work runs all the same
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)


def in_background_thread(work: Callable[[], T], niceness: int = BACKGROUND_NICENESS) -> T:
    """Run ``work`` in a new thread made ``niceness`` nicer, wait for it and return its result
    (or raise its exception): for loading a model whose library starts its worker threads at
    load time, so they inherit the lower priority. Niceness cannot be raised back without
    privileges, hence a thread of its own."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        lower_this_thread(niceness)
        try:
            result.append(work())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="engine-loader", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
