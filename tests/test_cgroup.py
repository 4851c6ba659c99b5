"""The CPU a process may use, read from control-group file trees of each kind, built as the kernel
lays them out: cgroup v2 with and without a quota (and a tighter one above the group), cgroup v1
with and without one, a hybrid host, and nothing readable at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server.runtime.cgroup import cpu_limit


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def _membership(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "self-cgroup"
    path.write_text(text)
    return path


def test_a_v2_quota_is_the_limit_and_the_groups_accounting_its_use(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "fs",
        {
            "cgroup.controllers": "cpuset cpu io memory pids",
            "kubepods/pod1/ctr/cpu.max": "200000 100000",  # docker --cpus 2, a k8s limit of 2
            "kubepods/pod1/ctr/cpu.stat": "usage_usec 7500000\nuser_usec 5000000",
        },
    )
    limit = cpu_limit(root, _membership(tmp_path, "0::/kubepods/pod1/ctr\n"), affinity=32)
    assert limit.quota
    assert limit.cores == 2.0
    assert limit.source == "cgroup v2 cpu.max: 200000 100000"
    assert limit.usage() == 7.5


def test_the_tightest_v2_quota_on_the_way_up_applies(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "fs",
        {
            "cgroup.controllers": "cpu",
            "pod/cpu.max": "50000 100000",  # the pod: half a core
            "pod/ctr/cpu.max": "max 100000",  # the container: no limit of its own
        },
    )
    limit = cpu_limit(root, _membership(tmp_path, "0::/pod/ctr\n"), affinity=8)
    assert (limit.quota, limit.cores) == (True, 0.5)


def test_without_a_v2_quota_the_limit_is_the_affinity_mask(tmp_path: Path) -> None:
    root = _tree(tmp_path / "fs", {"cgroup.controllers": "cpu", "cpu.max": "max 100000"})
    limit = cpu_limit(root, _membership(tmp_path, "0::/\n"), affinity=4)
    assert (limit.quota, limit.cores) == (False, 4.0)
    assert limit.source.startswith("affinity mask (4 cores")


def test_a_quota_above_the_cores_the_process_may_run_on_is_no_limit(tmp_path: Path) -> None:
    root = _tree(tmp_path / "fs", {"cgroup.controllers": "cpu", "cpu.max": "800000 100000"})
    limit = cpu_limit(root, _membership(tmp_path, "0::/\n"), affinity=2)
    assert (limit.quota, limit.cores) == (False, 2.0)


@pytest.mark.parametrize("unified", [False, True], ids=["v1", "hybrid"])
def test_a_v1_quota_and_usage(tmp_path: Path, unified: bool) -> None:
    """A hybrid host lists its v2 hierarchy too (``0::/``), mounted apart without controllers:
    the v1 ``cpu`` controller is the one that limits."""
    files = {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/docker/abc/cpuacct.usage": "2500000000",
    }
    if unified:
        files["unified/cgroup.controllers"] = ""
    root = _tree(tmp_path / "fs", files)
    membership = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n"
    membership += "0::/docker/abc\n" if unified else ""
    limit = cpu_limit(root, _membership(tmp_path, membership), affinity=16)
    assert (limit.quota, limit.cores) == (True, 1.5)
    assert limit.source == "cgroup v1 cpu.cfs_quota_us: 150000/100000"
    assert limit.usage() == 2.5


def test_no_v1_quota_and_separate_controller_mounts(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "fs",
        {
            "cpu/cpu.cfs_quota_us": "-1",
            "cpu/cpu.cfs_period_us": "100000",
            "cpuacct/cpuacct.usage": "1000000000",
        },
    )
    limit = cpu_limit(root, _membership(tmp_path, "2:cpuacct:/\n1:cpu:/\n"), affinity=2)
    assert (limit.quota, limit.cores) == (False, 2.0)
    assert limit.usage() == 1.0


def test_nothing_readable_leaves_the_affinity_mask(tmp_path: Path) -> None:
    limit = cpu_limit(tmp_path / "nowhere", tmp_path / "no-such-file", affinity=3)
    assert (limit.quota, limit.cores) == (False, 3.0)
    assert limit.usage() is None


def test_this_machine_gives_a_limit_no_larger_than_its_cores() -> None:
    limit = cpu_limit()
    assert 0 < limit.cores <= len(os.sched_getaffinity(0))
    assert limit.source
