"""Where a cell's CPU time went: the bench client's own process, and the server's processes on this host.

A served benchmark measures its slowest stage, and that need not be the engine. One Python event loop streams
every request of a cell (the client's), and a server answers them from one event loop too (vLLM's API server
with ``--api-server-count 1``, or ``dspark serve``'s HTTP loop), each on its process's main thread. On the H200
(docs/PERFORMANCE.md section 29), servers that emitted one token per request and step ran 256-request cells at
6,000-9,500 tokens/s. Their decode steps took ~10 ms, about 25,000 tokens/s, so something else set the pace. An
event loop busy for nearly all of a cell is the first suspect, and each cell records what both loops used.

A loop is one thread, so its share of a core is its ceiling; a process's total is not (torch computes on
several threads: an embedded server's process used two cores on a two-core host while its loop idled). So the
notes read the loops: the client's thread (``time.thread_time`` on the loop that runs the cell) and the server's
main thread (``/proc/<pid>/task/<pid>/stat``). The processes' totals (the client's ``time.process_time``, the
server's ``/proc/<pid>/stat`` and its tree's) are kept beside them. Linux only, for the server.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_cli.errors import DsparkError

PROC = Path("/proc")
# An event loop busy for this share of a cell is close to its ceiling: it is one thread, and it waits on its
# sockets between bursts, so it reads under 100% when it limits. vLLM's single API process read 84-86% in
# 256-request cells that a second API process served 1.8x faster (H200, docs/PERFORMANCE.md section 30).
BUSY_SHARE = 0.8


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int, path: str = "stat") -> list[str] | None:
    """The fields of ``/proc/<pid>/<path>`` after the command name (which may hold spaces and parentheses)."""
    try:
        text = (PROC / str(pid) / path).read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _cpu_s(fields: list[str] | None) -> float | None:
    # After the name: state (field 3) is fields[0], so utime (14) and stime (15) are fields[11] and [12].
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _ticks()


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process, all its threads; None where it cannot be read (gone, or
    not Linux)."""
    return _cpu_s(_stat_fields(pid))


def main_thread_cpu_s(pid: int) -> float | None:
    """CPU seconds of a live process's main thread (whose thread id is the pid): where its event loop runs."""
    return _cpu_s(_stat_fields(pid, f"task/{pid}/stat"))


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
    client_loop_s: float
    server_s: float | None = None
    server_main_s: float | None = None
    server_tree_s: float | None = None

    @classmethod
    def take(cls, server_pid: int | None) -> CpuSnapshot:
        """Now. Call it on the thread that runs the cell's event loop: ``client_loop_s`` is that thread's."""
        now = (time.perf_counter(), time.process_time(), time.thread_time())
        if server_pid is None:
            return cls(*now)
        return cls(*now, process_cpu_s(server_pid), main_thread_cpu_s(server_pid), tree_cpu_s(server_pid))


@dataclass
class CpuUse:
    """CPU seconds a cell used, summed over its rounds, and the wall time they were spent in."""

    server_pid: int | None = None
    wall_s: float = 0.0
    client_s: float = 0.0
    client_loop_s: float = 0.0
    server_s: float | None = None
    server_main_s: float | None = None
    server_tree_s: float | None = None

    def add(self, before: CpuSnapshot, after: CpuSnapshot) -> None:
        self.wall_s += after.wall - before.wall
        self.client_s += after.client_s - before.client_s
        self.client_loop_s += after.client_loop_s - before.client_loop_s
        for name in ("server_s", "server_main_s", "server_tree_s"):
            b, a = getattr(before, name), getattr(after, name)
            if b is not None and a is not None:
                setattr(self, name, (getattr(self, name) or 0.0) + a - b)

    def to_dict(self) -> dict[str, Any]:
        """The cell's ``cpu`` record: seconds and shares of one core over the cell's wall time (``*_loop`` and
        ``server_main``: the event loops' threads; the others: whole processes)."""

        def share(seconds: float | None) -> float | None:
            return None if seconds is None or self.wall_s <= 0 else round(seconds / self.wall_s, 3)

        def secs(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds, 3)

        out: dict[str, Any] = {"wall_s": round(self.wall_s, 3), "client_s": secs(self.client_s),
                               "client_share": share(self.client_s), "client_loop_share": share(self.client_loop_s)}
        if self.server_pid is not None:
            out.update(server_pid=self.server_pid, server_s=secs(self.server_s), server_share=share(self.server_s),
                       server_main_share=share(self.server_main_s), server_tree_s=secs(self.server_tree_s),
                       server_tree_share=share(self.server_tree_s))
        return out
