"""Which processes keep the host's CPUs busy, interval by interval (a served benchmark's background witness).

`ps`'s %CPU is a process's share over its whole life, so it cannot tell a server that is idle now from one that
was busy a minute ago. This reads ``/proc/PID/stat`` every ``--every`` seconds and prints, per interval, the
load average and the processes that used the most CPU *in that interval* (percent of one core), with the CPU each
last ran on, that CPU's NUMA node and their command lines -- e.g. whether idle servers of an interleaved matrix
(``dspark bench --interleave``) take host time from the one being measured, or whether the server whose every host
phase ran 15-18% slower than its twin's ran on the other node from the GPU, or on a core another busy process
shared (docs/PERFORMANCE.md section 46; the queue's ``machine.txt`` maps CPUs to cores and nodes). Linux only;
runs until killed.

    python3 benchmarks/host_sampler.py --every 10 --top 6 > host_sampler.log &
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def cpu_ticks() -> dict[int, tuple[int, str]]:
    """``{pid: (user + system ticks, command line)}`` of every process readable now."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = " ".join((entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
        except OSError:
            continue  # the process ended between the listing and the read
        out[int(entry.name)] = (int(fields[11]) + int(fields[12]), cmd or f"[{entry.name}]")
    return out


def last_cpu(pid: int) -> int | None:
    """The CPU ``pid`` last ran on (``/proc/PID/stat``'s ``processor``), or None once it has ended."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def cpu_node(cpu: int) -> int | None:
    """The NUMA node of ``cpu`` (sysfs), or None where the kernel does not say."""
    for entry in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*"):
        if entry.name[4:].isdigit():
            return int(entry.name[4:])
    return None


def where(pid: int) -> str:
    """``cpu N/node M`` for a listing: where a process ran last (``-`` for what is not known)."""
    cpu = last_cpu(pid)
    if cpu is None:
        return "cpu -/node -"
    node = cpu_node(cpu)
    return f"cpu {cpu}/node {'-' if node is None else node}"


def busiest(before: dict[int, tuple[int, str]], after: dict[int, tuple[int, str]], seconds: float,
            top: int) -> list[tuple[float, int, str]]:
    """``(percent of one core, pid, command)`` of the ``top`` processes that used the most CPU between two
    readings (processes that started in between count from zero)."""
    hz = os.sysconf("SC_CLK_TCK")
    used = [(100.0 * (ticks - before.get(pid, (0, ""))[0]) / hz / seconds, pid, cmd)
            for pid, (ticks, cmd) in after.items()]
    return sorted((u for u in used if u[0] > 0), reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=10.0, help="seconds per interval")
    ap.add_argument("--top", type=int, default=6, help="processes listed per interval")
    ap.add_argument("--width", type=int, default=150, help="characters of each command line")
    args = ap.parse_args()
    before, t0 = cpu_ticks(), time.monotonic()
    while True:
        time.sleep(args.every)
        after, t1 = cpu_ticks(), time.monotonic()
        load = Path("/proc/loadavg").read_text().split()[0]
        print(f"{time.strftime('%H:%M:%S')} load {load}", flush=True)
        for pct, pid, cmd in busiest(before, after, t1 - t0, args.top):
            print(f"  {pct:6.1f}% {pid:>7} {where(pid):>14} {cmd[: args.width]}", flush=True)
        before, t0 = after, t1


if __name__ == "__main__":
    main()
