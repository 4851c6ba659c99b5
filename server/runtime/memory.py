"""Giving freed memory back to the operating system once the server is idle.

A burst of calls allocates from many threads (decoders, resamplers, Whisper and Piper workers),
and glibc's allocator keeps what they freed in its per-thread arenas: the process's RSS stays at
the burst's high-water mark although nothing holds that memory. ``malloc_trim`` releases it;
elsewhere than glibc this is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging

__all__ = ["return_free_memory"]

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(name).malloc_trim
    return None


def return_free_memory() -> bool:
    """Ask the C allocator to return freed memory to the system (blocking: some ms with a large
    heap, so call it off the event loop). False where there is no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
