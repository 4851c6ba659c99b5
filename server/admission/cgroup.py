"""The CPU this process may use, as its control group limits it: what admission measures against.

In a container limited by a CPU quota (Docker ``--cpus``, a Kubernetes limit), the affinity mask
still lists every core of the host: a pod with two guaranteed CPUs on a 32-core node sees 32.
The quota is what it may use, and its control group's accounting is what it (and anything else
in the container) used. Linux gives both:

- cgroup v2 (the one hierarchy, with ``cgroup.controllers`` at its root): ``/proc/self/cgroup``
  says ``0::/PATH``; ``cpu.max`` in that group
  and each group above it reads ``QUOTA PERIOD`` or ``max PERIOD`` (the tightest applies), and
  ``cpu.stat``'s ``usage_usec`` counts the group's CPU time.
- cgroup v1 (also a hybrid host, whose v2 hierarchy holds no controllers): the ``cpu``
  controller's ``cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us``, the ``cpuacct``
  controller's ``cpuacct.usage`` (nanoseconds).

Without a quota (or where nothing can be read: another OS, a restricted /sys) the limit is the
affinity mask's cores, and the host's ``/proc/stat`` tells how busy they are
(``server/admission/cores.py``).

Every count of the CPUs the process may use comes from here: admission's capacity
(:attr:`CpuLimit.cores`), and the threads and slots of the engines (:attr:`CpuLimit.whole_cores`,
:func:`usable_cores`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuLimit", "cpu_limit", "usable_cores"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CpuLimit:
    """The CPU a process may use, in cores, and where that figure comes from."""

    cores: float
    """Cores' worth of CPU time per second: the quota where one applies (never more than the
    affinity mask's cores), else the mask's cores."""
    quota: bool
    """Whether a control group's quota sets :attr:`cores`."""
    source: str
    """Where the figure comes from, for people: ``cgroup v2 cpu.max: 200000 100000``..."""
    usage: Callable[[], float | None]
    """CPU seconds the control group has used so far (every process in it), or None where
    they cannot be read."""

    @property
    def whole_cores(self) -> int:
        """The threads worth running at once: :attr:`cores` rounded down, at least 1 (threads
        beyond a quota only get throttled; a quota of 1.5 cores gives 1, of 0.5 gives 1)."""
        return max(1, math.floor(self.cores))


@functools.cache
def usable_cores() -> int:
    """This process's :attr:`CpuLimit.whole_cores`, read once per process: the count of
    threads (and llama.cpp slots) for code that has no :class:`CpuLimit` at hand."""
    return cpu_limit().whole_cores


def cpu_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP, affinity: int | None = None
) -> CpuLimit:
    """The CPU this process may use (``root`` and ``proc_cgroup`` are parameters for tests)."""
    mask = affinity if affinity is not None else _mask_cores()
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    groups = dict(_membership(line) for line in lines if line.count(":") >= 2)
    if "" in groups and (root / "cgroup.controllers").is_file():  # v2 mounted alone: "0::/path"
        found = _v2(root, groups[""], mask)
    else:  # v1, or hybrid (v2 mounted apart, without the cpu controller)
        found = _v1(root, groups, mask)
    if found is not None:
        return found
    return CpuLimit(float(mask), False, f"affinity mask ({mask} cores)", lambda: None)


def _mask_cores() -> int:
    """The cores of this process's affinity mask (without masks, as on macOS: the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _membership(line: str) -> tuple[str, str]:
    """``ID:CONTROLLERS:PATH`` -> (controllers, path)."""
    _, controllers, path = line.split(":", 2)
    return controllers, path


def _v2(root: Path, path: str, mask: int) -> CpuLimit | None:
    group = _inside(root, path)
    if group is None:
        return None
    tightest: tuple[float, str] | None = None
    for level in [group, *group.parents]:
        text = _read(level / "cpu.max")
        if text is not None:
            parts = text.split()
            if len(parts) == 2 and parts[0] != "max" and _positive(parts[0], parts[1]):
                cores = int(parts[0]) / int(parts[1])
                if tightest is None or cores < tightest[0]:
                    tightest = (cores, f"cgroup v2 cpu.max: {text}")
        if level == root:
            break

    def usage() -> float | None:
        for line in (_read(group / "cpu.stat") or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec" and value.isdigit():
                return int(value) / 1e6
        return None

    return _limit(tightest, mask, usage, "cgroup v2")


def _v1(root: Path, groups: dict[str, str], mask: int) -> CpuLimit | None:
    cpu = _controller(root, groups, "cpu")
    account = _controller(root, groups, "cpuacct")
    if cpu is None and account is None:
        return None
    tightest: tuple[float, str] | None = None
    if cpu is not None:
        quota, period = _read(cpu / "cpu.cfs_quota_us"), _read(cpu / "cpu.cfs_period_us")
        if quota is not None and period is not None and _positive(quota, period):
            tightest = (int(quota) / int(period), f"cgroup v1 cpu.cfs_quota_us: {quota}/{period}")

    def usage() -> float | None:
        text = _read(account / "cpuacct.usage") if account is not None else None
        return int(text) / 1e9 if text is not None and text.isdigit() else None

    return _limit(tightest, mask, usage, "cgroup v1")


def _limit(
    tightest: tuple[float, str] | None,
    mask: int,
    usage: Callable[[], float | None],
    version: str,
) -> CpuLimit:
    if tightest is None or tightest[0] >= mask:
        source = f"affinity mask ({mask} cores; {version}, no quota)"
        return CpuLimit(float(mask), False, source, usage)
    return CpuLimit(tightest[0], True, tightest[1], usage)


def _controller(root: Path, groups: dict[str, str], name: str) -> Path | None:
    """The directory of controller ``name`` for this process, under its usual mount points."""
    for controllers, path in groups.items():
        if name in controllers.split(","):
            for mount in (controllers, name, "cpu,cpuacct", "cpuacct,cpu"):
                directory = _inside(root / mount, path)
                if directory is not None:
                    return directory
    return None


def _inside(base: Path, path: str) -> Path | None:
    """``path`` (as /proc/self/cgroup gives it) under ``base``, if that directory exists; a
    container that sees its own group as ``/`` finds it at ``base`` itself."""
    directory = base / path.lstrip("/")
    return directory if directory.is_dir() else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _positive(*numbers: str) -> bool:
    return all(number.isdigit() and int(number) > 0 for number in numbers)
