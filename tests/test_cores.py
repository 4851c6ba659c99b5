"""How busy the process's cores are, whoever keeps them busy (``server/admission/cores.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from server.admission.cores import busy_cores_time, busy_time_reader

pytestmark = pytest.mark.timeout(30)

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
STAT = """\
cpu  500 0 300 9000 100 0 10 5 0 0
cpu0 100 0 100 4000 50 0 5 2 0 0
cpu1 400 0 200 5000 50 0 5 3 7 0
intr 123 4 5
ctxt 99
"""


def test_busy_time_counts_everything_but_idle_and_io_wait_on_the_given_cores(
    tmp_path: Path,
) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert busy_cores_time({0}, stat) == pytest.approx(207 * TICK_S)
    assert busy_cores_time({1}, stat) == pytest.approx(608 * TICK_S)  # guest is in user
    assert busy_cores_time({0, 1}, stat) == pytest.approx(815 * TICK_S)
    assert busy_cores_time({5}, stat) is None
    assert busy_cores_time({0}, tmp_path / "missing") is None


def test_a_spinning_thread_shows_as_busy_time_on_the_process_cores() -> None:
    read = busy_time_reader()
    before = read()
    if before is None:
        pytest.fail("/proc/stat should be readable on the Linux machines the tests run on")
    spun = time.process_time() + 0.3
    while time.process_time() < spun:
        pass
    after = read()
    assert after is not None
    assert after - before >= 0.25  # this process's 0.3 s at least, others' on top
