"""Giving freed memory back to the operating system once the server is idle.

A call ends with objects that only reference cycles keep (its peer connection, tasks, buffers):
Python frees them when it next collects its oldest generation, which a quiet server may not do
for long (:func:`collect_cycles`). And a burst of calls allocates from many threads (decoders,
resamplers, Whisper and Piper workers), whose freed memory glibc's allocator keeps in its
per-thread arenas: the process's RSS stays at the burst's high-water mark although nothing holds
that memory. ``malloc_trim`` releases it (:func:`return_free_memory`); elsewhere than glibc
this is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import time

__all__ = ["collect_cycles", "return_free_memory"]

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(name).malloc_trim
    return None


def collect_cycles() -> int:
    """Free every unreachable object now (all generations); how many there were. Blocks for
    tens of ms with the server's heap, and runs finalizers that may touch the event loop: call
    it on the loop's thread, while no call is live."""
    started = time.perf_counter()
    found = gc.collect()
    log.debug(
        "collected %d unreachable objects in %.0f ms", found, (time.perf_counter() - started) * 1000
    )
    return found


def return_free_memory() -> bool:
    """Ask the C allocator to return freed memory to the system (blocking: some ms with a large
    heap, so call it off the event loop). False where there is no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
