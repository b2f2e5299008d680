"""The comparison table in the seed PR's shape, as Markdown, rich and a summary JSON.

One row per concurrency, one column per config; each cell reads

    output tok/s / mean ITL ms / acceptance length (Δ% output tok/s vs the no-capacity column)

The no-capacity column is config ``none`` (verify every draft; ``all`` in vLLM runs) when the matrix has it,
else the first config; it carries no Δ. Mean ITL is per stream chunk (one verify step), as ``vllm bench serve``
reports it, so the numbers compare with the seed's. Configs without drafts (``nospec``) show "-" for acceptance
length.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from dspark_cli import __version__
from dspark_cli.bench.matrix import SERVING_SUFFIXES, SETTING_SUFFIX, SETTING_SUFFIXES, measurement_notes
from dspark_cli.fileio import atomic_write_json, atomic_write_text

BASELINE = "none"
BASELINES = (BASELINE, "all")  # ours (embedded) and vLLM's verify-all run: both verify every draft
SUMMARY_FORMAT = 1
PRETTY = {
    "nospec": "No spec",
    "none": "No capacity",
    "mask": "Mask + SPS",
    "varlen": "Varlen + SPS",
    "none+sts": "No capacity + STS",
    "mask+sts": "Mask + SPS + STS",
    "varlen+sts": "Varlen + SPS + STS",
    "all": "Verify all",
    "upstream": "vLLM adaptive",
}
MISSING = "—"
SERVING_COMPILES = "kernel_compiles{phase=serving}"
SERVING_COMPILE_S = "kernel_compile_seconds{phase=serving}"
FULL_GC_S = "gc_full_collection_seconds"


@dataclass(frozen=True)
class CellNumbers:
    output_tok_s: float
    mean_itl_ms: float | None
    acceptance_length: float | None
    per_user_tok_s: float | None
    failed: int
    delta_pct: float | None  # vs the baseline column; None for the baseline itself or without one
    # From the server's own counters over the cell (None where it has none, e.g. vLLM): time the cell's steps
    # waited on kernel compiles while serving and on full garbage collections (see engines/embedded/stalls.py).
    serving_compiles: float | None = None
    serving_compile_s: float | None = None
    full_gc_s: float | None = None
    # The server's steps over the cell by kind (prefill, spec, probe, paused, nospec): count and mean ms.
    steps: dict[str, tuple[int, float]] = field(default_factory=dict)
    # With the server's phase timing on (dspark serve --phase-timing): kind -> phase -> mean ms per step.
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    # A cell measured in rounds (dspark bench --rounds): each round's output tok/s, and the group whose cells'
    # rounds ran interleaved (only those pair up).
    rounds: tuple[float, ...] = ()
    round_group: str | None = None
    # What skews the cell as measured (prefix-cache hits, merged stream chunks): bench.matrix.measurement_notes.
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def baseline_of(configs: Sequence[str]) -> str | None:
    for name in BASELINES:
        if name in configs:
            return name
    return configs[0] if configs else None


def header(config: str) -> str:
    base, hash_, replica = config.rpartition("#")
    if hash_ and base and replica.isdigit():
        return f"{header(base)} #{replica}"
    if (setting := SETTING_SUFFIX.search(config)) is not None and config not in PRETTY:
        words = SETTING_SUFFIXES[setting.group(1)][2]
        return f"{header(config[: setting.start()])} + {words} {setting.group(2)}%"
    for suffix, (_, words) in SERVING_SUFFIXES.items():
        if config.endswith(suffix) and config not in PRETTY:
            return f"{header(config[: -len(suffix)])} + {words}"
    return PRETTY.get(config, config)


def numbers(cell: dict[str, Any], base: dict[str, Any] | None) -> CellNumbers:
    m = cell["metrics"]
    sd = cell.get("spec_decode") or {}
    tok_s = float(m.get("output_tok_s") or 0.0)
    delta = None
    if base is not None and base is not cell:
        base_tok = float(base["metrics"].get("output_tok_s") or 0.0)
        if base_tok > 0:
            delta = (tok_s / base_tok - 1.0) * 100.0
    counters = cell.get("server_counters") or {}
    return CellNumbers(
        output_tok_s=tok_s,
        mean_itl_ms=(m.get("itl_ms") or {}).get("mean"),
        acceptance_length=sd.get("acceptance_length"),
        per_user_tok_s=m.get("per_user_tok_s"),
        failed=int(m.get("failed") or 0),
        delta_pct=delta,
        serving_compiles=counters.get(SERVING_COMPILES),
        serving_compile_s=counters.get(SERVING_COMPILE_S),
        full_gc_s=counters.get(FULL_GC_S),
        steps=step_kinds(counters),
        phases=step_phases(counters),
        rounds=tuple(float(r["output_tok_s"]) for r in sorted(cell.get("rounds") or [], key=lambda r: r["round"])),
        round_group=cell.get("round_group"),
        notes=tuple(measurement_notes(cell)),
    )


_STEPS_KEY = re.compile(r"^steps\{kind=(\w+)\}$")


def step_kinds(counters: dict[str, Any]) -> dict[str, tuple[int, float]]:
    """``{kind: (steps, mean ms)}`` from a cell's ``steps{kind=K}`` and ``step_seconds{kind=K}`` counters,
    kinds that ran only."""
    out = {}
    for key, n in counters.items():
        m = _STEPS_KEY.match(key)
        if m and n:
            seconds = float(counters.get(f"step_seconds{{kind={m.group(1)}}}", 0.0))
            out[m.group(1)] = (int(n), seconds * 1e3 / float(n))
    return out


_PHASE_KEY = re.compile(r"^step_phase_seconds\{kind=(\w+),phase=(\w+)\}$")
DECODE_KINDS = ("nospec", "paused", "spec")  # the kinds whose phases the summary compares
# The phases of the engine's steps (engines/embedded/engine.py marks them) in the order a step runs them.
PHASE_ORDER = ("prepare", "draft", "plan", "layout", "forward", "verify", "reject", "lookahead", "sync",
               "emit")


def step_phases(counters: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{kind: {phase: mean ms per step}}`` from a cell's ``step_phase_seconds{kind=K,phase=P}`` counters
    over its ``steps{kind=K}``, phases in the order the step runs them; empty without phase timing."""
    out: dict[str, dict[str, float]] = {}
    for key, seconds in counters.items():
        m = _PHASE_KEY.match(key)
        n = float(counters.get(f"steps{{kind={m.group(1)}}}", 0.0)) if m else 0.0
        if m and n > 0:
            out.setdefault(m.group(1), {})[m.group(2)] = float(seconds) * 1e3 / n
    rank = {ph: i for i, ph in enumerate(PHASE_ORDER)}
    return {kind: dict(sorted(ph.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))
            for kind, ph in out.items()}


def format_tok_s(v: float) -> str:
    # The seed prints whole tokens/s in the thousands; CPU runs reach only tens, where decimals matter.
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def format_delta(pct: float) -> str:
    if abs(pct) < 0.05:
        pct = 0.0  # no "-0.0%"
    return f"{pct:+.1f}%"


def format_cell(n: CellNumbers) -> str:
    itl = f"{n.mean_itl_ms:.2f}" if n.mean_itl_ms is not None else MISSING
    acc = f"{n.acceptance_length:.3f}" if n.acceptance_length is not None else "-"
    text = f"{format_tok_s(n.output_tok_s)} / {itl} / {acc}"
    if n.delta_pct is not None:
        text += f" ({format_delta(n.delta_pct)})"
    if n.failed:
        text += f" [{n.failed} failed]"
    return text


@dataclass
class ComparisonTable:
    configs: list[str]
    concurrencies: list[int]
    baseline: str | None
    cells: dict[tuple[str, int], CellNumbers]

    def text(self, config: str, c: int) -> str:
        n = self.cells.get((config, c))
        return format_cell(n) if n is not None else MISSING

    def headers(self) -> list[str]:
        return ["c", *(header(k) for k in self.configs)]

    def rows(self) -> list[list[str]]:
        return [[str(c), *(self.text(k, c) for k in self.configs)] for c in self.concurrencies]


def build_table(cells: Sequence[dict[str, Any]], configs: Sequence[str] | None = None,
                concurrencies: Sequence[int] | None = None) -> ComparisonTable:
    """Table over ``configs`` x ``concurrencies`` (default: whatever the cells hold, in first-seen order)."""
    by_key = {(c["config"], int(c["concurrency"])): c for c in cells}
    cfgs = list(configs) if configs is not None else list(dict.fromkeys(c["config"] for c in cells))
    concs = list(concurrencies) if concurrencies is not None else sorted({k[1] for k in by_key})
    base = baseline_of(cfgs)
    out: dict[tuple[str, int], CellNumbers] = {}
    for k in cfgs:
        for c in concs:
            cell = by_key.get((k, c))
            if cell is not None:
                out[(k, c)] = numbers(cell, by_key.get((base, c)) if base is not None else None)
    return ComparisonTable(cfgs, concs, base, out)


def to_markdown(table: ComparisonTable, title: str | None = None) -> str:
    lines = []
    if title:
        lines += [title, ""]
    # With rounds, a cell's tok/s is its rounds' tokens over their time together: not the paired medians below.
    totals = ", cell totals" if any(n.rounds for n in table.cells.values()) else ""
    lines.append("Cells: output tok/s / mean ITL ms / acceptance length "
                 f"(Δ% output tok/s vs {header(table.baseline) if table.baseline else 'n/a'}{totals})")
    lines.append("")
    hdr = table.headers()
    lines += _markdown_table(hdr, table.rows())
    steps = step_rows(table)
    if steps:
        lines += ["", "Server steps over each cell: kind mean ms x steps (the engine's own clock; a client's "
                  "inter-token latency adds streaming and queueing)", ""]
        lines += _markdown_table(hdr, steps)
    for reference in paired_references(table):
        deltas = paired_table(table, reference)
        lines += ["", _paired_title(deltas, reference), ""]
        lines += _markdown_table(hdr, _paired_rows(table, deltas))
    phases = phase_rows(table)
    if phases:
        lines += ["", "Decode-step phases (the server's --phase-timing): each cell's most frequent decode kind, "
                  "mean ms per step by phase in the order the step runs them", ""]
        lines += _markdown_table(hdr, phases)
    stalls = stall_notes(table)
    if stalls:
        lines += ["", "Kernel compiles while serving (a start-up warm-up missed them; the cell waited):", ""]
        lines += [f"- {note}" for note in stalls]
    skewed = [f"{header(k)} at c={c}: {note}" for c in table.concurrencies for k in table.configs
              for note in (table.cells[k, c].notes if (k, c) in table.cells else ())]
    if skewed:
        lines += ["", "Cells not measured as they seem:", ""]
        lines += [f"- {note}" for note in skewed]
    return "\n".join(lines) + "\n"


def _markdown_table(hdr: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: the concurrency column right-aligned, the config columns left."""
    return ["| " + " | ".join(hdr) + " |", "|" + "|".join("---:" if i == 0 else "---" for i in range(len(hdr))) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def _per_cell_rows(table: ComparisonTable, text: Callable[[CellNumbers], str | None]) -> list[list[str]]:
    """One row per concurrency, one column per config: ``text`` of each cell (None or no cell: MISSING)."""
    rows = []
    for c in table.concurrencies:
        row = [str(c)]
        for k in table.configs:
            n = table.cells.get((k, c))
            t = text(n) if n is not None else None
            row.append(t if t is not None else MISSING)
        rows.append(row)
    return rows


def step_rows(table: ComparisonTable) -> list[list[str]]:
    """Rows of "kind ms x n" per cell, where any cell's server counted its steps by kind; else none."""
    if not any(n.steps for n in table.cells.values()):
        return []
    return _per_cell_rows(table, lambda n: ", ".join(f"{kind} {ms:.2f} x {count}"
                                                     for kind, (count, ms) in n.steps.items()) or None)


def phase_rows(table: ComparisonTable) -> list[list[str]]:
    """Rows of "kind: phase ms / phase ms ..." for each cell's most frequent decode kind, where any cell's
    server timed phases; else none."""
    if not any(n.phases for n in table.cells.values()):
        return []

    def text(n: CellNumbers) -> str | None:
        kinds = [kind for kind in DECODE_KINDS if kind in n.phases and kind in n.steps]
        if not kinds:
            return None
        kind = max(kinds, key=lambda kd: n.steps[kd][0])
        return f"{kind}: " + " / ".join(f"{ph} {ms:.2f}" for ph, ms in n.phases[kind].items())

    return _per_cell_rows(table, text)


@dataclass(frozen=True)
class PairedDelta:
    """A config against a reference over rounds run interleaved: Δ% of each round's tok/s against the
    reference's same round, summarised by the median (what a drifting host moves least) and the range."""

    median_pct: float
    min_pct: float
    max_pct: float
    rounds: int

    def text(self) -> str:
        return f"{format_delta(self.median_pct)} ({self.min_pct:+.1f}..{self.max_pct:+.1f})"


def paired_delta(n: CellNumbers, ref: CellNumbers) -> PairedDelta | None:
    """None unless both cells ran the same number of rounds in one interleaved group."""
    if not n.rounds or n.round_group is None or n.round_group != ref.round_group or len(n.rounds) != len(ref.rounds):
        return None
    return paired_delta_of(n.rounds, ref.rounds)


def paired_delta_of(tok_s: Sequence[float], ref_tok_s: Sequence[float]) -> PairedDelta | None:
    """Round-by-round Δ% of ``tok_s`` against ``ref_tok_s`` (paired by position); None without a reference."""
    pct = sorted((a / b - 1.0) * 100.0 for a, b in zip(tok_s, ref_tok_s, strict=True) if b > 0)
    if not pct:
        return None
    mid = len(pct) // 2
    median = pct[mid] if len(pct) % 2 else (pct[mid - 1] + pct[mid]) / 2.0
    return PairedDelta(median, pct[0], pct[-1], len(pct))


def paired_references(table: ComparisonTable) -> list[str]:
    """The columns paired deltas are taken against: no speculation and the table's baseline, where their
    cells ran in rounds."""
    refs = [r for r in dict.fromkeys(("nospec", table.baseline)) if r is not None and r in table.configs]
    # A reference whose rounds pair with no other column's (an earlier run's cells, the table's first column when
    # it has no no-capacity one) would print a table of dashes "over 0 rounds".
    return [r for r in refs if paired_table(table, r)]


def paired_table(table: ComparisonTable, reference: str) -> dict[tuple[str, int], PairedDelta]:
    out = {}
    for (k, c), n in table.cells.items():
        ref = table.cells.get((reference, c))
        if k != reference and ref is not None:
            d = paired_delta(n, ref)
            if d is not None:
                out[(k, c)] = d
    return out


def _paired_title(deltas: dict[tuple[str, int], PairedDelta], reference: str) -> str:
    n = max((d.rounds for d in deltas.values()), default=0)
    return (f"Paired rounds against {header(reference)}: median Δ% of each round's output tok/s against its same "
            f"round (min..max over {n} rounds)")


def _paired_rows(table: ComparisonTable, deltas: dict[tuple[str, int], PairedDelta]) -> list[list[str]]:
    return [[str(c), *(deltas[(k, c)].text() if (k, c) in deltas else MISSING for k in table.configs)]
            for c in table.concurrencies]


def paired_rows(table: ComparisonTable, reference: str) -> list[list[str]]:
    return _paired_rows(table, paired_table(table, reference))


def paired_rich(table: ComparisonTable, reference: str) -> Table:
    deltas = paired_table(table, reference)
    t = Table(title=_paired_title(deltas, reference))
    for i, h in enumerate(table.headers()):
        t.add_column(h, justify="right" if i == 0 else "left", overflow="fold")
    for row in _paired_rows(table, deltas):
        t.add_row(*row)
    return t


def stall_notes(table: ComparisonTable) -> list[str]:
    """One line per cell whose server compiled a kernel during the cell, with the time it cost."""
    notes = []
    for c in table.concurrencies:
        for k in table.configs:
            n = table.cells.get((k, c))
            if n is not None and n.serving_compiles:
                gc = f", full GCs {n.full_gc_s:.2f} s" if n.full_gc_s else ""
                notes.append(f"{header(k)} at c={c}: {n.serving_compiles:.0f} compiles, "
                             f"{n.serving_compile_s or 0.0:.2f} s{gc}")
    return notes


def to_rich(table: ComparisonTable, title: str | None = None) -> Table:
    t = Table(title=title, caption="output tok/s / mean ITL ms / acceptance length (Δ% tok/s vs "
                                   f"{header(table.baseline) if table.baseline else 'n/a'})")
    for i, h in enumerate(table.headers()):
        t.add_column(h, justify="right" if i == 0 else "left", overflow="fold")
    for row in table.rows():
        t.add_row(*row)
    return t


def write_summary(results_dir: Path, cells: Sequence[dict[str, Any]], configs: Sequence[str],
                  concurrencies: Sequence[int], title: str | None = None) -> tuple[Path, Path]:
    """summary.json (all numbers, per-cell paths) and summary.md (the table), both atomic."""
    table = build_table(cells, configs, concurrencies)
    md = to_markdown(table, title)
    workloads = [c.get("workload") for c in cells]
    summary = {
        "dspark_bench_summary": SUMMARY_FORMAT,
        "dspark_version": __version__,
        "baseline": table.baseline,
        "configs": table.configs,
        "concurrencies": table.concurrencies,
        "workload": workloads[0] if workloads else None,
        "rows": [
            {"concurrency": c,
             "cells": {k: (table.cells[(k, c)].to_dict() if (k, c) in table.cells else None)
                       for k in table.configs}}
            for c in table.concurrencies
        ],
        "paired": {
            ref: [{"concurrency": c, "cells": {k: d.__dict__ for (k, cc), d in deltas.items() if cc == c}}
                  for c in table.concurrencies]
            for ref, deltas in ((r, paired_table(table, r)) for r in paired_references(table))
        },
        "markdown": md,
    }
    return (atomic_write_json(results_dir / "summary.json", summary),
            atomic_write_text(results_dir / "summary.md", md))
