"""How busy the cores this process may run on are, whoever keeps them busy.

A server shares its cores with whatever else runs there: a sibling server, a media gateway, a
benchmark's callers. Admission (``server/admission/load.py``) counts that work too, since a call
admitted onto cores that others keep half busy gets half the room.

Read from Linux's ``/proc/stat``: the busy time (everything but idle and I/O wait; ``steal``,
time the hypervisor gave to other machines, counts as busy) of each core in the process's
affinity mask. Elsewhere there is nothing to read and :func:`busy_cores_time` returns None.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path

__all__ = ["busy_cores_time", "busy_time_reader"]

_PROC_STAT = Path("/proc/stat")
_IDLE_FIELDS = (3, 4)
"""``idle`` and ``iowait`` among a ``cpuN`` line's counters (user nice system idle iowait irq
softirq steal guest guest_nice; guest time is already counted in user)."""
_COUNTED_FIELDS = 8
"""user .. steal."""
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def busy_cores_time(cores: Collection[int] | None = None, stat: Path = _PROC_STAT) -> float | None:
    """Seconds the given cores (default: this process's affinity) have been busy since boot,
    summed; None where ``/proc/stat`` cannot be read or lists none of them."""
    wanted = set(os.sched_getaffinity(0) if cores is None else cores)
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    found = False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if not name[3:].isdigit() or int(name[3:]) not in wanted:
            continue
        counters = [int(value) for value in rest.split()[:_COUNTED_FIELDS]]
        ticks += sum(counters) - sum(counters[index] for index in _IDLE_FIELDS)
        found = True
    return ticks / _TICKS_PER_S if found else None


def busy_time_reader() -> Callable[[], float | None]:
    """:func:`busy_cores_time` of this process's cores, or a reader that always says None when
    there is nothing to read here (asked once)."""
    if busy_cores_time() is None:
        return lambda: None
    cores = frozenset(os.sched_getaffinity(0))
    return lambda: busy_cores_time(cores)
