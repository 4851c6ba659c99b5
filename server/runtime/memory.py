"""Keeping the server's memory to what its calls hold, and giving the rest back once idle.

A burst of calls allocates from many threads (decoders, resamplers, Whisper and Piper workers).
glibc's allocator keeps what they freed in its per-thread arenas, so the process's RSS stays
at the burst's high-water mark although nothing holds that memory: ``malloc_trim`` releases the
free pages (:func:`return_free_memory`). What it cannot release are pages still shared with a
live block, and large blocks make the most of those: glibc serves an allocation of 128 KiB or
more from a mapping of its own, but raises that threshold to the size of each such block freed
(up to 32 MiB), after which audio buffers and Whisper's and Piper's tensors come from the
arenas and leave them fragmented. :func:`map_large_allocations` fixes the threshold instead.
Elsewhere than glibc both are no-ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any

__all__ = ["LARGE_ALLOCATION_BYTES", "map_large_allocations", "return_free_memory"]

log = logging.getLogger(__name__)

LARGE_ALLOCATION_BYTES = 1 << 20
"""Allocations of this many bytes or more get a mapping of their own, unmapped when freed.
In a soak of 74 calls (16 at once) on two cores the server came back to +3.5-4.3 % of its RSS
before the calls with it, and to +4.4-9.8 % with glibc's moving threshold
(``benchmarks/results/allocator/``)."""

_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (``malloc.h``)."""


@functools.cache
def _libc(name: str) -> Any:
    """The C library's function ``name``, or None without a C library that has it."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    with contextlib.suppress(OSError, AttributeError):
        return getattr(ctypes.CDLL(library), name)
    return None


def map_large_allocations(threshold: int = LARGE_ALLOCATION_BYTES) -> bool:
    """Have the C allocator serve every allocation of ``threshold`` bytes or more from a
    mapping of its own, handed back to the system when it is freed, for the life of the
    process. Call it once, before the models load. Leaves the allocator as it is, and returns
    False, where ``MALLOC_MMAP_THRESHOLD_`` is set (the operator chose) or there is no glibc
    ``mallopt``."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def return_free_memory() -> bool:
    """Ask the C allocator to return freed memory to the system (blocking: some ms with a large
    heap, so call it off the event loop). False where there is no ``malloc_trim``."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
