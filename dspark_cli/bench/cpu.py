"""Where a cell's CPU time went: the bench client's own process, and the server's processes on this host.

A served benchmark measures its slowest stage, and that need not be the engine. One Python process streams
every request of a cell (the client), and a server answers them from one front process (vLLM's API server,
with ``--api-server-count 1``). On the H200 (docs/PERFORMANCE.md section 29), servers that emitted one token
per request and step ran 256-request cells at 6,000-9,500 tokens/s. Their decode steps took ~10 ms, about 25,000
tokens/s, so something else set the pace. A front process or a client near a whole core of CPU is the first
suspect, and each cell records what both used.

Linux only: the server's share is read from ``/proc/<pid>/stat``. The client's share is ``time.process_time``
over the cell's wall time, so it counts every thread of the bench process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_cli.errors import DsparkError

PROC = Path("/proc")
# A process busy for this share of one core over a cell is close to its own ceiling (one Python thread does the
# work of the client's event loop and of vLLM's API server).
BUSY_SHARE = 0.9


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces and parentheses)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process; None where it cannot be read (gone, or not Linux)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # After the name: state (field 3) is fields[0], so utime (14) and stime (15) are fields[11] and [12].
    return (int(fields[11]) + int(fields[12])) / _ticks()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), from each process's parent id."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))  # fields[1]: ppid (field 4)
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds of ``pid`` and its live descendants (vLLM's engine core runs in a child of its API server)."""
    own = process_cpu_s(pid)
    if own is None:
        return None
    return own + sum(process_cpu_s(child) or 0.0 for child in descendants(pid))


def check_server_pid(pid: int) -> None:
    """Validate ``--server-pid`` at the edge: the process must be readable on this host."""
    if pid <= 0 or process_cpu_s(pid) is None:
        raise DsparkError(f"--server-pid {pid}: no such process readable on this host (/proc/{pid}/stat); pass the "
                          "pid of the server's front process (vLLM: the `vllm serve` process), on this host")


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far of the client, and of the server's front process and its tree (None: not read)."""

    wall: float
    client_s: float
    server_s: float | None = None
    server_tree_s: float | None = None

    @classmethod
    def take(cls, server_pid: int | None) -> CpuSnapshot:
        if server_pid is None:
            return cls(time.perf_counter(), time.process_time())
        return cls(time.perf_counter(), time.process_time(), process_cpu_s(server_pid), tree_cpu_s(server_pid))


@dataclass
class CpuUse:
    """CPU seconds a cell used, summed over its rounds, and the wall time they were spent in."""

    server_pid: int | None = None
    wall_s: float = 0.0
    client_s: float = 0.0
    server_s: float | None = None
    server_tree_s: float | None = None

    def add(self, before: CpuSnapshot, after: CpuSnapshot) -> None:
        self.wall_s += after.wall - before.wall
        self.client_s += after.client_s - before.client_s
        if before.server_s is not None and after.server_s is not None:
            self.server_s = (self.server_s or 0.0) + after.server_s - before.server_s
        if before.server_tree_s is not None and after.server_tree_s is not None:
            self.server_tree_s = (self.server_tree_s or 0.0) + after.server_tree_s - before.server_tree_s

    def to_dict(self) -> dict[str, Any]:
        """The cell's ``cpu`` record: seconds and shares of one core over the cell's wall time."""

        def share(seconds: float | None) -> float | None:
            return None if seconds is None or self.wall_s <= 0 else round(seconds / self.wall_s, 3)

        out: dict[str, Any] = {"wall_s": round(self.wall_s, 3), "client_s": round(self.client_s, 3),
                               "client_share": share(self.client_s)}
        if self.server_pid is not None:
            out.update(server_pid=self.server_pid,
                       server_s=None if self.server_s is None else round(self.server_s, 3),
                       server_share=share(self.server_s),
                       server_tree_s=None if self.server_tree_s is None else round(self.server_tree_s, 3),
                       server_tree_share=share(self.server_tree_s))
        return out
