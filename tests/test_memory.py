"""The C allocator's settings for a serving process (``server/runtime/memory.py``), observed in a
fresh interpreter through glibc's own counters."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from server.runtime.memory import return_free_memory

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator is glibc's"),
]

_PROBE = """
import ctypes, sys
from server.runtime.memory import map_large_allocations

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
print(map_large_allocations() if sys.argv[1] == "mapped" else None)
libc.free(libc.malloc(8 << 20))  # glibc's own threshold rises to 8 MiB on this free
before = libc.mallinfo2().hblks
block = libc.malloc(2 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def _probe(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.split()


def test_large_blocks_get_mappings_of_their_own_after_a_larger_one_was_freed() -> None:
    assert _probe("mapped") == ["True", "1"]
    assert _probe("default") == ["None", "0"]  # glibc alone: from the heap, where it fragments


def test_an_operators_threshold_is_left_as_it_is() -> None:
    assert _probe("mapped", MALLOC_MMAP_THRESHOLD_=str(16 << 20)) == ["False", "0"]


def test_freed_memory_can_be_handed_back_to_the_system() -> None:
    assert return_free_memory() is True
