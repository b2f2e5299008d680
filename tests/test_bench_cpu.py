"""The CPU a cell's client and server used (bench.cpu), read from real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_cli.bench import cpu
from dspark_cli.errors import DsparkError

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux /proc")

# A child that burns ~0.4 s of CPU, then idles until killed: its CPU must show in its parent's tree.
_BURNER = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(60)\n"


def _burn(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_a_process_cpu_time_grows_with_the_work_it_does() -> None:
    before = cpu.process_cpu_s(os.getpid())
    _burn(0.3)
    after = cpu.process_cpu_s(os.getpid())
    assert before is not None and after is not None
    assert after - before == pytest.approx(0.3, abs=0.1)  # clock ticks: 10 ms resolution


def test_a_tree_counts_its_children_and_a_gone_process_reads_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", _BURNER])
    try:
        assert child.pid in cpu.descendants(os.getpid())
        deadline = time.time() + 30
        while (cpu.process_cpu_s(child.pid) or 0.0) < 0.35 and time.time() < deadline:
            time.sleep(0.05)
        own, tree = cpu.process_cpu_s(os.getpid()), cpu.tree_cpu_s(os.getpid())
        # /proc counts in 10 ms clock ticks, and the sums are floats (65.14 - 64.79 < 0.35): one tick of slack
        assert own is not None and tree is not None and tree - own >= 0.35 - 0.01
    finally:
        child.kill()
        child.wait()
    assert cpu.process_cpu_s(child.pid) is None  # reaped: nothing to read
    with pytest.raises(DsparkError, match=f"--server-pid {child.pid}: no such process"):
        cpu.check_server_pid(child.pid)
    cpu.check_server_pid(os.getpid())


def test_the_main_thread_is_read_apart_from_the_process_that_computes_on_other_threads() -> None:
    """An embedded server's process computes on several threads while its event loop (the main thread) idles:
    only the main thread's time says whether the loop was busy."""
    import threading

    done = threading.Event()
    worker = threading.Thread(target=lambda: (_burn(0.4), done.set()))
    main_before, proc_before = cpu.main_thread_cpu_s(os.getpid()), cpu.process_cpu_s(os.getpid())
    worker.start()
    done.wait(30)
    worker.join()
    main_after, proc_after = cpu.main_thread_cpu_s(os.getpid()), cpu.process_cpu_s(os.getpid())
    assert proc_after - proc_before >= 0.3
    assert main_after - main_before < 0.15  # this thread waited


def test_a_cells_use_sums_its_rounds_and_gives_shares_of_a_core() -> None:
    use = cpu.CpuUse(server_pid=42)
    use.add(cpu.CpuSnapshot(0.0, 1.0, 0.5, 10.0, 5.0, 20.0), cpu.CpuSnapshot(2.0, 2.0, 1.0, 11.9, 6.5, 23.0))
    use.add(cpu.CpuSnapshot(5.0, 3.0, 2.0, 20.0, 9.0, 30.0), cpu.CpuSnapshot(7.0, 3.5, 2.3, 21.9, 10.6, 33.0))
    assert use.to_dict() == {"wall_s": 4.0, "client_s": 1.5, "client_share": 0.375, "client_loop_share": 0.2,
                             "server_pid": 42, "server_s": 3.8, "server_share": 0.95, "server_main_share": 0.775,
                             "server_tree_s": 6.0, "server_tree_share": 1.5}
    # no server pid (a remote server): the client's shares only
    client_only = cpu.CpuUse()
    client_only.add(cpu.CpuSnapshot(0.0, 0.0, 0.0), cpu.CpuSnapshot(1.0, 0.95, 0.9))
    assert client_only.to_dict() == {"wall_s": 1.0, "client_s": 0.95, "client_share": 0.95, "client_loop_share": 0.9}


def test_the_cli_refuses_a_server_pid_it_cannot_read() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "bench", "--base-url", "http://127.0.0.1:9",
                          "--server-pid", str(gone.pid)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert f"--server-pid {gone.pid}: no such process readable on this host" in run.stderr
    run = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "bench", "--serve", "--server-pid", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "with --serve each server's pid is recorded already" in run.stderr
