"""Tabulate the ``saturation:`` lines of server logs: every probe verdict and what followed it.

Each embedded-engine server log of a served matrix (``dspark bench``'s ``logs/*.log``) carries one line per
pause, resume and probe verdict (``LLMEngine._log_saturation``); a vLLM server's log with the dspark plugin
carries one line per probe verdict (and its periodic summary, which this skips). This prints, per probe: its
trigger, load, realized gain (after the probe margin), the cost scale it was judged at and the verdict; for a
probe that paid in an embedded-engine log, the drafting steps until the next pause (decode steps between the
resume line and the pause line) and that pause's realized gain.

    python3 benchmarks/saturation_log.py benchmarks/results/h200/embedded_matrix/2026-12-03-floor/real/bench/logs/*.log
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

PROBE = re.compile(r"saturation: (\w+) probe at (\d+) requests (?:\((\d+) drafting\) )?(paid|failed): realized "
                   r"([\d.]+)x plain decoding at cost scale ([\d.]+), predicted (to pay|no gain)")
STATE = re.compile(r"saturation: drafting (paused|resumed) at (\d+) requests, (\d+) decode steps in; "
                   r"realized gain ([\d.]+|n/a)x")


@dataclass
class Probe:
    log: str
    trigger: str
    load: int
    verdict: str
    realized: float
    cost_scale: float
    predicted: bool
    drafted: int | None = None  # a sampled probe's drafting requests (None: all of them)
    resumed_at_step: int | None = None
    drafted_steps: int | None = None  # decode steps from the resume to the next pause
    pause_load: int | None = None
    pause_gain: float | None = None


def parse(path: Path) -> list[Probe]:
    """The probes of one log, each with what followed it."""
    probes: list[Probe] = []
    for line in path.read_text(errors="replace").splitlines():
        if m := PROBE.search(line):
            probes.append(Probe(path.stem, m[1], int(m[2]), m[4], float(m[5]), float(m[6]), m[7] == "to pay",
                                None if m[3] is None else int(m[3])))
        elif (m := STATE.search(line)) and probes:
            last, step = probes[-1], int(m[3])
            gain = None if m[4] == "n/a" else float(m[4])
            if m[1] == "resumed" and last.verdict == "paid":
                last.resumed_at_step = step
            elif m[1] == "paused" and last.resumed_at_step is not None and last.drafted_steps is None:
                last.drafted_steps, last.pause_load, last.pause_gain = step - last.resumed_at_step, int(m[2]), gain
    return probes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    args = ap.parse_args()
    print("| log | probe | load | verdict | realized | cost scale | predicted | drafted | then paused at | its gain |")
    print("|---|---|---:|---|---:|---:|---|---:|---:|---:|")
    probes = [p for path in args.logs for p in parse(path)]
    for p in probes:
        follow = ("-", "-", "-") if p.drafted_steps is None else (p.drafted_steps, p.pause_load, p.pause_gain)
        load = p.load if p.drafted is None else f"{p.load} ({p.drafted} drafting)"
        print(f"| {p.log} | {p.trigger} | {load} | {p.verdict} | {p.realized:.2f} | {p.cost_scale:.2f} | "
              f"{'yes' if p.predicted else 'no'} | {follow[0]} | {follow[1]} | {follow[2]} |")
    for verdict in ("paid", "failed"):
        scales = sorted(p.cost_scale for p in probes if p.verdict == verdict)
        if scales:
            print(f"\n{verdict}: {len(scales)} probes, cost scale {scales[0]:.2f}..{scales[-1]:.2f} "
                  f"(median {scales[len(scales) // 2]:.2f})")


if __name__ == "__main__":
    main()
