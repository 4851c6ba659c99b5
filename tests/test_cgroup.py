"""The CPU a process may use, read from control-group file trees of each kind, built as the kernel
lays them out: cgroup v2 with and without a quota (and a tighter one above the group), cgroup v1
with and without one, a hybrid host, and nothing readable at all; and every count taken from it
(llama.cpp's threads and slots, the default model, Piper's threads, admission's capacity)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from media.tts import SynthesizerSettings, synthesis_threads
from server.admission.cgroup import cpu_limit, usable_cores
from server.admission.load import LoadGauge
from server.admission.overload import OverloadSettings
from server.llm.download import QWEN2_5_0_5B_INSTRUCT, default_model
from server.llm.llamacpp import EmbeddedSettings, embedded_counts


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


def test_every_count_of_cores_follows_the_quota(tmp_path: Path) -> None:
    """A pod limited to 2 CPUs on a 32-core node runs as a 2-core machine does."""
    root = _tree(tmp_path / "fs", {"cgroup.controllers": "cpu", "cpu.max": "200000 100000"})
    limit = cpu_limit(root, _membership(tmp_path, "0::/\n"), affinity=32)
    assert limit.whole_cores == 2
    assert embedded_counts(EmbeddedSettings(), limit.whole_cores) == (2, 2)  # threads, slots
    assert embedded_counts(EmbeddedSettings(threads=3, slots=1), limit.whole_cores) == (3, 1)
    assert default_model(limit.whole_cores) is QWEN2_5_0_5B_INSTRUCT
    assert synthesis_threads(SynthesizerSettings(cores=limit.whole_cores)) == 2
    assert synthesis_threads(SynthesizerSettings(threads=1, cores=limit.whole_cores)) == 1
    gauge = LoadGauge(OverloadSettings(), lambda: 0, cores=limit.cores)  # as the registry does
    assert gauge.cores == 2.0


def test_a_fractional_quota_rounds_down_to_at_least_one_core(tmp_path: Path) -> None:
    root = _tree(tmp_path / "fs", {"cgroup.controllers": "cpu", "cpu.max": "150000 100000"})
    limit = cpu_limit(root, _membership(tmp_path, "0::/\n"), affinity=32)
    assert (limit.cores, limit.whole_cores) == (1.5, 1)
    assert embedded_counts(EmbeddedSettings(), limit.whole_cores) == (1, 2)
    assert synthesis_threads(SynthesizerSettings(cores=limit.whole_cores)) == 1  # one thread
    root = _tree(tmp_path / "half", {"cgroup.controllers": "cpu", "cpu.max": "50000 100000"})
    assert cpu_limit(root, _membership(tmp_path, "0::/\n"), affinity=32).whole_cores == 1


def test_this_process_counts_its_cores_once() -> None:
    assert usable_cores() == cpu_limit().whole_cores
    assert usable_cores() == usable_cores()
    assert usable_cores.cache_info().misses == 1  # read once per process
    assert LoadGauge(OverloadSettings(), lambda: 0).cores == cpu_limit().cores
