"""benchmarks/host_sampler.py: CPU use per interval, not per lifetime (Linux /proc)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "host_sampler.py"
spec = importlib.util.spec_from_file_location("host_sampler", PATH)
sampler = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sampler)
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def test_an_interval_counts_the_ticks_used_in_it_and_new_processes_from_zero() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before = {1: (10 * hz, "idle-now"), 2: (0, "busy")}
    after = {1: (10 * hz, "idle-now"), 2: (2 * hz, "busy"), 3: (hz // 2, "new")}
    assert sampler.busiest(before, after, 2.0, top=5) == [(100.0, 2, "busy"), (25.0, 3, "new")]
    assert sampler.busiest(before, after, 2.0, top=1) == [(100.0, 2, "busy")]


def test_a_busy_child_shows_near_one_core_and_its_command_line() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        before, t0 = sampler.cpu_ticks(), time.monotonic()
        time.sleep(1.5)
        after, t1 = sampler.cpu_ticks(), time.monotonic()
    finally:
        child.kill()
        child.wait()
    rows = {pid: (pct, cmd) for pct, pid, cmd in sampler.busiest(before, after, t1 - t0, top=50)}
    pct, cmd = rows[child.pid]
    assert 30.0 < pct < 110.0  # about one core (a loaded machine may give it less)
    assert "while time.time() < end: pass" in cmd and "\n" not in cmd


def test_a_process_is_placed_on_a_cpu_it_may_run_on_and_an_ended_one_nowhere() -> None:
    cpu = sampler.last_cpu(os.getpid())
    assert cpu in os.sched_getaffinity(0)
    node = sampler.cpu_node(cpu)
    assert node is None or node >= 0
    # The process may move between the two reads: the listing names a CPU it may run on, not the same one.
    listed = re.fullmatch(r"cpu (\d+)/node (\d+|-)", sampler.where(os.getpid()))
    assert listed is not None and int(listed.group(1)) in os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert sampler.last_cpu(child.pid) is None and sampler.where(child.pid) == "cpu -/node -"
