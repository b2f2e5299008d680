"""The config x concurrency matrix: start a server per config (or use one that runs), measure each cell,
write one JSON per cell atomically, skip cells already on disk.

A cell is the unit of resumption: it is written only once fully measured (temporary file + rename), so a
Ctrl-C, a crashed server or a killed job loses at most the cell in progress; rerunning the same command
finishes the rest. Cells remember their workload (dataset, prompts, output length, sampling), and a results
folder refuses cells of a different workload, because mixing them would make the table compare unequal work.

Configs are named after the seed PR's columns and differ from each other only in the flags below; every
other engine flag comes from ``--serve-args`` and is identical across columns:

    nospec       -k 0                         (no speculation at all)
    none         --capacity-mode none         (verify every draft: the "no capacity" column, Δ's baseline)
    mask         --capacity-mode mask   --sps-curve C
    varlen       --capacity-mode varlen --sps-curve C
    <mode>+sts   ... --online-sts             (online STS; gets a warm-up pass first so it has calibrated)
    <any>+mixed  ... --mixed-prefill          (embedded engine: prefills ride in plain decode steps; the default)
    <any>+unmixed ... --no-mixed-prefill      (embedded engine: every prefill a step of its own)
    <any>+proc   ... --engine-process         (embedded engine: the engine in a process of its own)
    <any>+thread ... --no-engine-process      (embedded engine: the engine on a thread of the server)
    <any>#N      the same flags, a server of its own (an A/A column: e.g. nospec,nospec#2 measures how much
                 two servers of one config differ, the floor under any comparison between columns)
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import errno
import hashlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from dspark_cli import __version__
from dspark_cli.bench.client import (
    LoadConfig,
    RequestResult,
    ServerCounters,
    aggregate,
    fetch_counters,
    fetch_model_name,
    make_session,
    run_load,
)
from dspark_cli.bench.cpu import BUSY_SHARE, CpuSnapshot, CpuUse
from dspark_cli.bench.datasets import Prompt
from dspark_cli.bench.metrics import (
    counter_delta,
    counters_went_down,
    dspark_counter_delta,
    prefix_cache_delta,
)
from dspark_cli.errors import DsparkError
from dspark_cli.fileio import atomic_write_json, check_output_dir, read_json
from dspark_cli.signals import sigterm_as_interrupt

CELL_FORMAT = 1
# A cell whose prompt tokens were at least this often prefix-cache hits is logged as unequal work.
PREFIX_HIT_WARN = 0.05
# A cell whose stream chunks carried this many times more tokens than its steps emitted per request is logged
# as one whose server merged outputs: its frontend fell behind the engine.
MERGED_CHUNKS_WARN = 1.05
# measurement_notes: a cell whose server held newcomers back for want of KV blocks on at least this share of its steps.
KV_WAIT_WARN = 0.01
CAPACITY_MODES = ("none", "mask", "varlen")
# Serving suffixes, after the config (any order, each once): a flag of the embedded engine's server, and what
# a table's column header says of it.
SERVING_SUFFIXES: dict[str, tuple[str, str]] = {
    "+mixed": ("--mixed-prefill", "mixed prefill"),
    "+unmixed": ("--no-mixed-prefill", "prefill steps"),
    "+proc": ("--engine-process", "engine process"),
    "+thread": ("--no-engine-process", "engine thread"),
}
# "+taxP" / "+sustainP" (a drafting config, last before any "#N", each once): the server's probe tax or sustain
# margin at P percent (`dspark_probe_tax` / `dspark_sustain_margin` in `--speculative-config`), so one matrix can
# read a setting against the default in paired rounds.
# suffix word: (speculative-config key, whether 0 is allowed, what a table's column header calls it)
SETTING_SUFFIXES: dict[str, tuple[str, bool, str]] = {
    "tax": ("dspark_probe_tax", False, "probe tax"),
    "sustain": ("dspark_sustain_margin", True, "sustain margin"),
}
SETTING_SUFFIX = re.compile(rf"\+({'|'.join(SETTING_SUFFIXES)})(\d+(?:\.\d+)?)$")
SERVE_COMMAND: tuple[str, ...] = (sys.executable, "-m", "dspark_cli.cli", "serve")


class ServerStartError(DsparkError):
    """The server died or never became healthy; ``log_tail`` holds its last log lines for the user."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class BenchInterrupted(DsparkError):
    """Ctrl-C (or SIGTERM) during a matrix: finished cells are on disk, the message says how to resume."""


@dataclass(frozen=True)
class BenchConfig:
    name: str
    serve_args: tuple[str, ...] = ()  # after the common flags (so they win over repeats), before any --
    sts: bool = False


def parse_configs(spec: str, sps_curve: str | None = None, common_args: Sequence[str] = ()) -> list[BenchConfig]:
    """``"none,mask,varlen+sts"`` -> configs; mask/varlen need an SPS curve (flag or inside --serve-args)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise DsparkError("--configs is empty; e.g. --configs none,mask,varlen,mask+sts,varlen+sts")
    if len(set(names)) != len(names):
        raise DsparkError(f"--configs names a config twice: {spec}")
    curve_in_common = "--sps-curve" in common_args
    out: list[BenchConfig] = []
    for name in names:
        # "#N" (any config, very last): a replica, the same flags on a server of its own.
        flags_of, hash_, replica = name.rpartition("#")
        if hash_ and not (replica.isdigit() and int(replica) >= 2 and flags_of and "#" not in flags_of):
            raise DsparkError(f"config {name!r}: a replica is named CONFIG#N with N >= 2 (e.g. nospec#2)")
        if hash_:
            (base_cfg,) = parse_configs(flags_of, sps_curve, common_args)
            out.append(replace(base_cfg, name=name))
            continue
        # Serving suffixes (any config, last, each once): "+mixed" / "+unmixed" mix prefills into decode steps (the
        # default) / give each a step of its own,
        # "+proc" / "+thread" put the engine in a process of its own / on a thread of the server.
        base, extra = name, ()
        settings: dict[str, float] = {}
        while (match := SETTING_SUFFIX.search(base)) is not None:
            word, percent = match.group(1), float(match.group(2))
            key, zero_ok, _ = SETTING_SUFFIXES[word]
            if key in settings:
                raise DsparkError(f"config {name!r} names +{word} twice")
            if not (0 <= percent < 100 if zero_ok else 0 < percent < 100):
                raise DsparkError(f"config {name!r}: +{word}P takes its setting in percent, "
                                  f"{'from 0' if zero_ok else 'above 0'} and below 100")
            settings[key] = percent / 100
            base = base[: match.start()]
        if settings:
            flags = ", ".join(f"+{word}P" for word, (key, _, _) in SETTING_SUFFIXES.items() if key in settings)
            if base.split("+")[0] in ("nospec", "none"):
                raise DsparkError(f"config {name!r}: {flags} is for configs that pause drafting (mask, varlen)")
            if "--speculative-config" in common_args:
                raise DsparkError(f"config {name!r}: {flags} sets the server's --speculative-config, which --serve-args "
                                  f"already sets; put {', '.join(settings)} in that JSON instead")
            extra = ("--speculative-config", orjson.dumps(settings).decode())
        while (suffix := next((sfx for sfx in SERVING_SUFFIXES if base.endswith(sfx)), None)) is not None:
            flag = SERVING_SUFFIXES[suffix][0]
            if flag in extra:
                raise DsparkError(f"config {name!r} names {suffix} twice")
            base, extra = base[: -len(suffix)], (flag, *extra)
        if {"--engine-process", "--no-engine-process"} <= set(extra):
            raise DsparkError(f"config {name!r}: +proc and +thread contradict each other; keep one")
        if {"--mixed-prefill", "--no-mixed-prefill"} <= set(extra):
            raise DsparkError(f"config {name!r}: +mixed and +unmixed contradict each other; keep one")
        if base == "nospec":
            out.append(BenchConfig(name, ("-k", "0", *extra)))
            continue
        mode, plus, suffix = base.partition("+")
        if mode not in CAPACITY_MODES or (plus and suffix != "sts"):
            raise DsparkError(f"unknown config {name!r}: use nospec, none, mask, varlen, optionally +sts "
                              "(e.g. varlen+sts), then optionally +mixed or +unmixed and +proc or +thread (e.g. nospec+unmixed, "
                              "varlen+sts+thread), "
                              "then optionally +taxP for a probe tax of P percent and +sustainP for a sustain "
                              "margin of P percent, "
                              "then optionally #N for a replica (e.g. nospec#2)")
        args: list[str] = ["--capacity-mode", mode]
        if mode != "none":
            if sps_curve is None and not curve_in_common:
                raise DsparkError(f"config {name!r} needs an SPS curve: pass --sps-curve FILE (or auto)")
            if sps_curve is not None:
                args += ["--sps-curve", sps_curve]
        if plus:
            args.append("--online-sts")
        out.append(BenchConfig(name, (*args, *extra), sts=bool(plus)))
    return out


def parse_concurrencies(spec: str) -> list[int]:
    try:
        values = [int(v) for v in spec.replace(" ", "").split(",") if v]
    except ValueError as exc:
        raise DsparkError(f"--concurrency must be a comma list of integers, got {spec!r}") from exc
    if not values or any(v < 1 for v in values):
        raise DsparkError(f"--concurrency values must be >= 1, got {spec!r}")
    return sorted(set(values))


def safe_name(config: str) -> str:
    """A config name as a file name: characters outside ``[A-Za-z0-9_.+@-]`` become "_" (``nospec#2`` ->
    ``nospec_2``). Lossy: :func:`pending_cells` refuses a cell file that holds another config's cell."""
    return re.sub(r"[^A-Za-z0-9_.+@-]", "_", config)


def cell_path(results_dir: Path, config: str, concurrency: int) -> Path:
    return results_dir / "cells" / f"{safe_name(config)}__c{concurrency}.json"


def failed_cell_path(results_dir: Path, config: str, concurrency: int) -> Path:
    """Where a cell some of whose requests failed is kept: beside the cells, never read as one."""
    return results_dir / "cells" / "failed" / f"{safe_name(config)}__c{concurrency}.json"


def superseded_cell_path(results_dir: Path, config: str, concurrency: int) -> Path:
    """Where a finished interleaved cell goes when a resumed run measures its concurrency again (pending_cells):
    beside the cells, never read as one."""
    return results_dir / "cells" / "superseded" / f"{safe_name(config)}__c{concurrency}.json"


def load_cell(path: Path) -> dict[str, Any] | None:
    """A finished cell, or None if absent/unreadable (an unreadable cell is simply measured again)."""
    if not path.is_file():
        return None
    try:
        cell = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(cell, dict) or cell.get("dspark_bench_cell") != CELL_FORMAT or "metrics" not in cell:
        return None
    return cell


def load_cells(results_dir: Path) -> list[dict[str, Any]]:
    cells = []
    for p in sorted((results_dir / "cells").glob("*.json")):
        cell = load_cell(p)
        if cell is not None:
            cells.append(cell)
    return cells


def same_workload(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two cells' workloads send the same requests. With ``--waves`` a cell sends ``waves x
    concurrency`` prompts of a list that only grows at its end as the sweep's top concurrency rises, so the
    list's length (``num_prompts``) is no part of a cell's work there: a sweep may add a concurrency."""
    if a is None or b is None:
        return a == b
    return not _differing_keys(a, b)


def _differing_keys(was: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The workload keys whose values differ, ``num_prompts`` left out of a ``--waves`` sweep (same_workload)."""
    keys = [k for k in dict.fromkeys([*was, *now]) if was.get(k) != now.get(k)]
    if was.get("waves") is not None and was.get("waves") == now.get("waves"):
        keys = [k for k in keys if k != "num_prompts"]
    return keys


def same_setup(cell: dict[str, Any], common_args: Sequence[str]) -> bool:
    """Whether a started server's cell shares ``common_args`` (``--serve-args``), what every column of a table has
    in common; cells of running servers (``--base-url``) carry no such record and join on workload and model."""
    server = cell.get("server") or {}
    if server.get("mode") != "serve":
        return True
    if "common_args" in server:
        return list(server["common_args"]) == list(common_args)
    # cells written before common_args was recorded: the command line starts with them
    served = setup_args(list(server.get("serve_args") or []))
    return served[: len(common_args)] == list(common_args)


def same_workload_cells(
    results_dir: Path, workload: dict[str, Any], labels: Sequence[str], concurrencies: list[int],
    cells: list[dict[str, Any]], model: str | None = None, keep_label_order: bool = False,
    common_args: Sequence[str] | None = None, config_args: dict[str, list[str]] | None = None,
    prompts_sha256: Callable[[int], str | None] | None = None,
) -> tuple[list[dict[str, Any]], list[str], list[int], int]:
    """Every finished cell in ``results_dir`` measured with ``workload``, for one table across runs.

    ``cells`` are this run's (its configs are ``labels``); the folder's other cells join them, including this
    run's configs' cells at other concurrencies. Configs are ordered by when their first cell started (so
    earlier runs keep their columns; a cell measured again keeps the time of the one it replaced,
    ``column_since``); with ``keep_label_order`` this run's configs follow the others in the order given (a
    ``--serve`` matrix's ``--configs``). The concurrencies are the union. A cell with another workload (other
    prompts, lengths or sampling) is left out: its numbers do not compare; so is, given ``model``, a cell another model served, and, given ``common_args`` (a ``--serve`` run's ``--serve-args``),
    a started server's cell served with others (another K or batch limit). Given ``config_args`` (this run's
    configs' own server arguments, ``served_args``), a cell of one of them at another concurrency joins only if
    its server was started so, and read the same ``--sps-curve`` and ``--sts`` files (a column is one server
    setup: another curve, or the same file profiled again, is another column); given
    ``prompts_sha256`` (per concurrency), a cell that recorded its prompts joins only if it sent the same ones (a
    dataset edited between runs). The last value returned counts the folder's cells left out.
    """
    mine = {(str(c["config"]), int(c["concurrency"])) for c in cells}
    files: dict[str, dict[str, str]] = {}  # per config of config_args: served_files_sha256, read once

    def joins(c: dict[str, Any]) -> bool:
        if not same_workload(c.get("workload"), workload):
            return False
        if model is not None and (c.get("server") or {}).get("model") != model:
            return False
        sha = c.get("prompts_sha256")  # None: a cell saved before it was kept
        want = None if prompts_sha256 is None else prompts_sha256(int(c["concurrency"]))
        if sha is not None and want is not None and sha != want:
            return False
        server = c.get("server") or {}
        if config_args is not None and c.get("config") in config_args and server.get("mode") == "serve":
            args = list(config_args[str(c["config"])])
            if setup_args(list(server.get("serve_args") or [])) != args:
                return False
            name = str(c["config"])
            if name not in files:  # setdefault would hash the files again for every cell
                files[name] = served_files_sha256(args)
            if changed_files(c, files[name]):
                return False
        return common_args is None or same_setup(c, common_args)

    others = [c for c in load_cells(results_dir) if (c.get("config"), int(c["concurrency"])) not in mine]
    kept = [c for c in others if joins(c)]
    merged = kept + list(cells)
    first: dict[str, str] = {}
    for c in merged:
        name, at = c["config"], str(c.get("column_since") or c.get("started_at") or "")
        first[name] = min(first.get(name, at), at)
    names = sorted(first, key=first.__getitem__)
    if keep_label_order:
        names = [n for n in names if n not in labels] + [n for n in labels if n in first]
    concs = sorted(set(concurrencies) | {int(c["concurrency"]) for c in merged})
    return merged, names, concs, len(others) - len(kept)


@dataclass
class MatrixSpec:
    configs: list[BenchConfig]
    concurrencies: list[int]
    prompts: list[Prompt]
    load: LoadConfig  # base_url/concurrency are filled per cell
    results_dir: Path
    workload: dict[str, Any]  # what makes cells comparable (dataset, prompts, lengths, sampling)
    serve: bool = False
    serve_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int | None = None
    server_timeout_s: float = 600.0
    force: bool = False
    warmup_prompts: int = 4
    warmup_max_tokens: int = 16
    # One short wave at each concurrency a server is measured at, before its first cell: a JIT compiler
    # (Triton, FlashInfer) compiles per batch-shape bucket and caches on disk, so without it the first config
    # of a matrix pays every compile in its timed cells and the configs after it find them cached.
    warmup_shapes: bool = True
    sts_warmup_prompts: int | None = None  # None: --num-prompts
    sts_warmup_max_tokens: int | None = None  # None: max_tokens // 4
    serve_command: tuple[str, ...] = SERVE_COMMAND
    waves: int | None = None  # requests per cell = waves x concurrency (else every prompt)
    # With serve: every config's server runs from the start, and cells go concurrency by concurrency, each
    # concurrency's configs in an order rotated by one (run_matrix says why).
    interleave: bool = False
    # With interleave: each cell's requests go in this many rounds, every config's round r before any config's
    # round r + 1 (each round's configs rotated by one more), so configs are compared round by round.
    rounds: int = 1
    # With base_url: the server's front process on this host, whose CPU each cell records (a started server's
    # own pid is recorded without it).
    server_pid: int | None = None

    def known_prompts_sha256(self, concurrency: int) -> str | None:
        """:meth:`cell_prompts_sha256` where this run holds a cell's whole prompt list at ``concurrency``; None
        where a ``--waves`` cell there sends more prompts than this run's list (a higher load of an earlier sweep)."""
        if self.waves is not None and self.waves * concurrency > len(self.prompts):
            return None
        return self.cell_prompts_sha256(concurrency)

    def cell_prompts_sha256(self, concurrency: int) -> str:
        """A fingerprint of one cell's prompts, so a resumed cell is known to have sent the same requests: the
        workload names a dataset, not its contents (a JSONL file edited between runs, another ``--tokenizer``
        for random prompts, another ``--dataset-path``)."""
        h = hashlib.sha256()
        for prompt in self.cell_prompts(concurrency):
            h.update(orjson.dumps([prompt.text, prompt.messages]))
        return h.hexdigest()

    def cell_prompts(self, concurrency: int) -> list[Prompt]:
        """The prompts of one cell: identical for every config at a concurrency (equal work per cell).

        With ``waves`` a cell sends ``waves x concurrency`` requests, so low concurrencies are not timed on
        many more waves than high ones (and a sweep up to 256 in flight fits a short GPU sitting).
        """
        if self.waves is None:
            return list(self.prompts)
        return list(self.prompts[: self.waves * concurrency])


def round_slices(num_requests: int, rounds: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each round's requests: contiguous, as equal as whole requests allow."""
    bounds = [num_requests * r // rounds for r in range(rounds + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def check_rounds(spec: MatrixSpec) -> None:
    """Every round must keep ``concurrency`` requests in flight: a round of fewer requests than that measures
    a lower load than its cell's name says, and so does a round that ends with part of a wave (3 waves in 2
    rounds: each round's second half-wave runs at half the load, 25% fewer tok/s for one server at c=4)."""
    if spec.rounds < 1:
        raise DsparkError(f"--rounds must be >= 1, got {spec.rounds}")
    if spec.rounds > 1 and not spec.interleave:
        raise DsparkError("--rounds pairs the configs' servers round by round; it needs --serve --interleave")
    for c in spec.concurrencies:
        n = len(spec.cell_prompts(c))
        if spec.rounds > 1 and n < spec.rounds * c:
            raise DsparkError(f"--rounds {spec.rounds}: a cell at c={c} sends {n} requests, fewer than "
                              f"{spec.rounds} rounds of {c}; use --waves {spec.rounds} or more, or fewer rounds")
        if spec.rounds > 1 and n % (spec.rounds * c):
            fix = (f"--waves a multiple of {spec.rounds}" if spec.waves is not None
                   else f"--num-prompts a multiple of {spec.rounds * c}, or --waves")
            raise DsparkError(f"--rounds {spec.rounds}: a cell at c={c} sends {n} requests, not whole waves of {c} "
                              f"per round, so each round would end below {c} in flight; use {fix}")


def pending_cells(spec: MatrixSpec) -> list[tuple[BenchConfig, int]]:
    """Cells still to measure; raises if the folder holds cells of a different workload (unless --force)."""
    todo = []
    for cfg in spec.configs:
        files_now = served_files_sha256(served_args(spec, cfg)) if spec.serve else {}  # once per config
        for c in spec.concurrencies:
            cell = None if spec.force else load_cell(cell_path(spec.results_dir, cfg.name, c))
            if cell is not None and cell.get("config") != cfg.name:
                # Resuming it would report another server's numbers under this name.
                raise DsparkError(
                    f"{cell_path(spec.results_dir, cfg.name, c)} holds config {cell.get('config')!r}'s cell, not "
                    f"{cfg.name!r}: their names differ only where a file name cannot; rename one config or use "
                    "another --results-dir")
            if cell is not None and not same_workload(cell.get("workload"), spec.workload):
                raise DsparkError(
                    f"{cell_path(spec.results_dir, cfg.name, c)} was measured with a different workload "
                    f"({workload_difference(cell.get('workload') or {}, spec.workload)}); use another --results-dir "
                    "or --force to remeasure")
            sha = None if cell is None else cell.get("prompts_sha256")  # None: a cell saved before it was kept
            if sha is not None and sha != spec.cell_prompts_sha256(c):
                raise DsparkError(
                    f"{cell_path(spec.results_dir, cfg.name, c)} sent other prompts (the dataset's contents, "
                    "--tokenizer or --dataset-path changed since); use another --results-dir or --force to "
                    "remeasure")
            if cell is not None and not spec.serve and spec.load.base_url:
                was = (cell.get("server") or {}).get("base_url")
                if was is not None and was.rstrip("/") != spec.load.base_url.rstrip("/"):
                    # One label, two servers: resuming would table one server's cells beside the other's.
                    raise DsparkError(
                        f"{cell_path(spec.results_dir, cfg.name, c)} was measured against {was}, not "
                        f"{spec.load.base_url}; give this server its own --label, use another --results-dir, or "
                        "--force to remeasure")
            if cell is not None and spec.serve:
                served = setup_args(list((cell.get("server") or {}).get("serve_args") or []))
                if served != served_args(spec, cfg):
                    # Another model, K or batch limit under the same config name: resuming would table its numbers
                    # as this run's.
                    raise DsparkError(
                        f"{cell_path(spec.results_dir, cfg.name, c)} was served with other settings "
                        f"({shlex.join(served)!r}, now {shlex.join(served_args(spec, cfg))!r}); use another "
                        "--results-dir or --force to remeasure")
                changed = changed_files(cell, files_now)
                if changed:
                    raise DsparkError(
                        f"{cell_path(spec.results_dir, cfg.name, c)} was served with the file of "
                        f"{' and '.join(changed)} as it was then, and that file has changed since (or is gone); use "
                        "another --results-dir, or --force to remeasure")
            if cell is None or int(cell["metrics"].get("failed") or 0) > 0:
                # A cell some of whose requests failed measured less work than its name says: measure it again
                # (cells saved before failed cells were refused can hold failures).
                todo.append((cfg, c))
    if spec.serve and spec.interleave:
        # Interleaved cells of one concurrency are measured side by side (and paired round by round): a cell
        # measured alone on resume, on servers started anew, would be tabled against round-mates of another
        # time. A concurrency with any cell to measure is measured again whole (a done cell is set aside as its
        # replacement is written: set_aside_superseded).
        partial = {c for _, c in todo}
        todo = [(cfg, c) for cfg in spec.configs for c in spec.concurrencies if c in partial]
    elif spec.serve and not spec.force:
        _refuse_alone_beside_interleaved(spec, todo)
    return todo


def _refuse_alone_beside_interleaved(spec: MatrixSpec, todo: list[tuple[BenchConfig, int]]) -> None:
    """A concurrency whose finished cells were measured with ``--interleave`` (servers up together, rounds
    paired) cannot take a cell measured alone: one row would compare a server that had the device to itself with
    servers that shared it, and the paired-rounds table would pair nothing. Said before any server starts."""
    pending = {(cfg.name, c) for cfg, c in todo}
    for c in sorted({c for _, c in todo}):
        for cfg in spec.configs:
            if (cfg.name, c) in pending:
                continue
            cell = load_cell(cell_path(spec.results_dir, cfg.name, c))
            if cell is not None and (cell.get("server") or {}).get("interleaved"):
                raise DsparkError(
                    f"{cell_path(spec.results_dir, cfg.name, c)} was measured with --interleave, beside the cells "
                    f"of c={c} still to measure; resume with --interleave (its concurrency is measured again "
                    "whole), use another --results-dir, or --force to remeasure")


def check_resumed_model(spec: MatrixSpec, current: str) -> None:
    """A running server's label resumed while it serves another model than its finished cells did: one column
    would hold two models' numbers (the table's model filter sees two and keeps both). Said before measuring."""
    for cfg in spec.configs:
        for c in spec.concurrencies:
            cell = load_cell(cell_path(spec.results_dir, cfg.name, c))
            was = None if cell is None else (cell.get("server") or {}).get("model")
            if was is not None and was != current:
                raise DsparkError(
                    f"{cell_path(spec.results_dir, cfg.name, c)} was measured with model {was!r}, and the server "
                    f"now serves {current!r}; give this server its own --label, use another --results-dir, or "
                    "--force to remeasure")


def set_aside_superseded(spec: MatrixSpec, config: str, concurrency: int, hooks: Hooks) -> None:
    """A finished cell (``_write_cell`` found one) that an interleaved concurrency resumed whole is about to
    replace moves to ``cells/superseded/``: kept, not tabled. Only as its replacement is written: set aside before
    the servers started, the finished cells of a resume that failed or was interrupted were gone from the folder,
    and the same command measured them again. ``--force`` asked for every cell anew: overwritten as measured."""
    if not (spec.serve and spec.interleave) or spec.force:
        return
    path = cell_path(spec.results_dir, config, concurrency)
    aside = superseded_cell_path(spec.results_dir, config, concurrency)
    aside.parent.mkdir(parents=True, exist_ok=True)
    path.replace(aside)
    hooks.log(f"{config} c={concurrency}: measured again with the rest of its concurrency, so its cells stay side "
              f"by side; the earlier cell is kept as {aside}")


def workload_difference(was: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between two workloads, as ``key was -> now`` (for the refusal to mix them)."""
    return ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in _differing_keys(was, now)) or "its format"


# Files a started server reads its prices and temperatures from: a cell names them by path, so an edit in place
# (a curve profiled again into the same file) would leave the cells served with the old one looking current.
SERVED_FILE_FLAGS = ("--sps-curve", "--sts")


def served_files_sha256(args: Sequence[str]) -> dict[str, str]:
    """Per flag of ``SERVED_FILE_FLAGS`` that ``args`` name a file with (the last value, as the server reads
    it), a fingerprint of that file's bytes now (``--sps-curve auto`` and missing files: none)."""
    from dspark_cli.serve_config import flag_value

    out = {}
    for flag in SERVED_FILE_FLAGS:
        value = flag_value(list(args), flag)
        if value is not None and Path(value).is_file():
            out[flag] = hashlib.sha256(Path(value).read_bytes()).hexdigest()
    return out


def changed_files(cell: dict[str, Any], now: dict[str, str]) -> list[str]:
    """The flags whose file differs from the one ``cell``'s server read (cells saved before the fingerprints
    were kept: none)."""
    was = (cell.get("server") or {}).get("files_sha256")
    if was is None:
        return []
    return [flag for flag in dict.fromkeys([*was, *now]) if was.get(flag) != now.get(flag)]


def served_args(spec: MatrixSpec, cfg: BenchConfig) -> list[str]:
    """What a config's server is started with, but where it listens: what makes its cells its own. The config's
    own arguments go before a ``--`` in ``--serve-args`` (what follows it passes to vLLM unread): after it, the
    nospec column's ``-k 0`` reached ``vllm serve``, which has no ``-k``."""
    return before_passthrough(list(spec.serve_args), cfg.serve_args)


def before_passthrough(args: list[str], extra: Sequence[str]) -> list[str]:
    """``args`` with ``extra`` inserted before its ``--`` (appended where there is none)."""
    cut = args.index("--") if "--" in args else len(args)
    return [*args[:cut], *extra, *args[cut:]]


def check_served_configs(spec: MatrixSpec, todo: Sequence[tuple[BenchConfig, int]]) -> None:
    """Check every config still to measure as its server would read its command line (``dspark serve --check``),
    before any server starts: a config whose server refuses its settings was found only once the configs before
    it had been measured, a whole column each. Only the bench's own server command is checked so."""
    if not spec.serve or tuple(spec.serve_command) != SERVE_COMMAND:
        return
    seen: set[str] = set()
    for cfg, _ in todo:
        if cfg.name in seen:
            continue
        seen.add(cfg.name)
        command = [*spec.serve_command, *before_passthrough(served_args(spec, cfg), ["--check"])]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            said = [line for line in proc.stderr.splitlines() if line.strip()]
            raise DsparkError(f"config {cfg.name}: its server would refuse its settings "
                              f"({said[-1] if said else f'exit status {proc.returncode}'}); fix --configs or "
                              "--serve-args")


def setup_args(args: Sequence[str]) -> list[str]:
    """A started server's recorded command line without its --host and --port (a free port per start)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--host", "--port"):
            skip = True
        elif not arg.startswith(("--host=", "--port=")):
            out.append(arg)
    return out


def check_loads(spec: MatrixSpec) -> None:
    """A cell at concurrency c must send at least c requests: fewer never has c in flight, so its row would
    name a load it did not measure."""
    for c in spec.concurrencies:
        n = len(spec.cell_prompts(c))
        if n < c:
            raise DsparkError(f"a cell at c={c} sends {n} requests, so it never has {c} in flight; raise "
                              f"--num-prompts to {c} or more, or use --waves")


def prepare_results_dir(results_dir: Path) -> None:
    """Create the results folder up front, so an unusable path fails in one line before any work."""
    check_output_dir(results_dir, "--results-dir")
    for stale in (results_dir / "cells").glob(".*.tmp"):
        stale.unlink(missing_ok=True)  # a write a killed run left half-done; the cell itself is measured again


def _bind_probe(host: str, port: int) -> int:
    """Bind ``host:port`` as a server would (``SO_REUSEADDR``, as uvicorn sets it) and let go; the port bound.
    One line for a host this machine cannot listen on, or a fixed port another process listens on."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise DsparkError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if port and exc.errno == errno.EADDRINUSE:
                raise DsparkError(f"--port {port}: another process listens on {host}:{port} (a server a killed bench "
                                  f"left behind? `ss -ltnp 'sport = :{port}'` names it); stop it or use another "
                                  "--port") from None
            raise DsparkError(f"--host {host}: cannot listen there ({exc.strerror})") from None
        return int(s.getsockname()[1])


def _free_port(host: str) -> int:
    return _bind_probe(host, 0)


def url_host(host: str) -> str:
    """``host`` as a URL spells it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def exit_with_parent() -> Callable[[], None] | None:
    """Linux: a ``preexec_fn`` that has the kernel send the child SIGTERM when the bench dies, however it dies
    (a SIGKILL runs no handler, and an orphaned server would hold its port and device memory for good). The
    setting survives exec, so ``--engine vllm``'s ``vllm serve`` gets it too. libc is loaded here, in the
    parent: the child between fork and exec only makes the one call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def set_pdeathsig() -> None:
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)

    return set_pdeathsig


class ServerProcess:
    """One ``dspark serve`` child in its own process group, so stopping it also stops anything it started.

    Stop sends SIGINT (graceful: the server frees the device and flushes traces), waits, then SIGKILLs the
    group. The child has its own session, so a terminal Ctrl-C reaches only us, and we decide the order.
    """

    def __init__(self, command: Sequence[str], log_path: Path, base_url: str, timeout_s: float) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 -- the child keeps writing after we return
        try:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=exit_with_parent())
        except OSError as exc:
            raise DsparkError(f"cannot start server ({self.command[0]}): {exc.strerror}") from exc
        finally:
            log.close()

    def exit_status(self) -> int | None:
        """The server's exit status if it has ended (a crash mid-cell), else None."""
        return None if self.proc is None else self.proc.poll()

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"server exited with status {code} before it was healthy; full log: {self.log_path}",
                    _tail(self.log_path))
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                    healthy = resp.status == 200
            except (urllib.error.URLError, OSError, TimeoutError):
                healthy = False
            if healthy:
                # Another process may answer on the port while ours fails to bind it: a leftover server's numbers
                # would be tabled as this config's.
                time.sleep(0.5)
                code = self.proc.poll()
                if code is None:
                    return
                raise ServerStartError(
                    f"server exited with status {code}, and another process answers on {self.base_url}; stop it "
                    f"or use another --port; full log: {self.log_path}", _tail(self.log_path))
            time.sleep(0.25)
        raise ServerStartError(
            f"server not healthy after {self.timeout_s:.0f} s (raise --server-timeout?); full log: {self.log_path}",
            _tail(self.log_path))

    def stop(self, grace_s: float = 15.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The leader may be gone while children it forked linger in the group: make sure none survive.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def pid(self) -> int | None:
        """The server process's id once started (its CPU is read per cell, ``bench.cpu``)."""
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Hooks:
    """How the runner reports progress; the CLI wires these to rich, tests leave them empty."""

    log: Callable[[str], None] = lambda msg: None
    cell_started: Callable[[str, int, int], None] = lambda config, concurrency, num_requests: None
    request_done: Callable[[RequestResult], None] = lambda result: None
    cell_done: Callable[[dict[str, Any]], None] = lambda cell: None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


async def _measure(spec: MatrixSpec, cfg: BenchConfig, c: int, base_url: str, server: dict[str, Any],
                   hooks: Hooks) -> dict[str, Any]:
    load = replace(spec.load, base_url=base_url, concurrency=c)
    started = _now()
    cpu = CpuUse(server.get("pid"))
    async with make_session(load) as session:
        before = await fetch_counters(session, base_url)
        first = CpuSnapshot.take(cpu.server_pid)
        results, wall, model = await run_load(spec.cell_prompts(c), load, hooks.request_done, session)
        cpu.add(first, CpuSnapshot.take(cpu.server_pid))
        after = await fetch_counters(session, base_url)
    return _cell_record(spec, cfg, c, results, wall, before, after, {**server, "model": model}, started, cpu)


def _cell_record(spec: MatrixSpec, cfg: BenchConfig, c: int, results: Sequence[RequestResult], wall: float,
                 before: ServerCounters, after: ServerCounters, server: dict[str, Any],
                 started: str, cpu: CpuUse | None = None) -> dict[str, Any]:
    """A cell's JSON: client metrics over ``results`` in ``wall`` seconds, the server's counters between the
    two scrapes, and the CPU the client and the server's processes used meanwhile. Where the first scrape failed,
    the counters are unknown (None, {}): the second alone would count since the server started."""
    # a counter that went backwards: the server restarted within the cell, and nothing it counted compares
    known = before.scraped and not counters_went_down(before.spec, after.spec, before.dspark, after.dspark)
    stats = counter_delta(before.spec, after.spec) if known else None
    return {
        "dspark_bench_cell": CELL_FORMAT,
        "config": cfg.name,
        "concurrency": c,
        "metrics": aggregate(results, wall),
        "spec_decode": stats.to_dict() if stats is not None else None,
        # The server's own counters over the cell (embedded engine: paused steps, kernel compiles, full GCs).
        "server_counters": dspark_counter_delta(before.dspark, after.dspark) if known else {},
        # ... and its gauges at the end of the cell (the saturation policy's evidence: cost scales, gain).
        "server_gauges": after.gauges,
        # Prompt tokens vLLM found in its prefix cache over the cell (None: a server without one).
        "prefix_cache": prefix_cache_delta(before.prefix_cache, after.prefix_cache) if known else None,
        # Share of a core the bench client's and the server's event loops (and their processes) used: a loop near
        # 1 may be what limits the cell (bench.cpu; None: not measured).
        "cpu": cpu.to_dict() if cpu is not None else None,
        "workload": spec.workload,
        "prompts_sha256": spec.cell_prompts_sha256(c),
        "server": server,
        "started_at": started,
        "finished_at": _now(),
        "dspark_version": __version__,
    }


async def _warmup(spec: MatrixSpec, cfg: BenchConfig, base_url: str, hooks: Hooks,
                  concurrencies: Sequence[int] = ()) -> None:
    """Untimed passes before a server's first cell. STS configs first run a long pass (as the seed did) so
    the online temperatures have settled before anything is measured. Then short requests: one wave at each
    concurrency about to be measured (``warmup_shapes``), so every batch shape those cells run has been
    compiled before the clock starts -- else at least ``warmup_prompts`` requests for lazy initialisation."""
    top = max(spec.concurrencies)
    n = len(spec.prompts) if spec.sts_warmup_prompts is None else spec.sts_warmup_prompts
    if cfg.sts and n > 0:  # --sts-warmup-prompts 0 skips it (0 once read as "unset": the default was sent)
        max_tokens = spec.sts_warmup_max_tokens or max(1, spec.load.max_tokens // 4)
        hooks.log(f"{cfg.name}: STS warm-up, {n} requests x {max_tokens} tokens at c={min(32, top)}")
        load = replace(spec.load, base_url=base_url, concurrency=min(32, top), max_tokens=max_tokens)
        results, _, _ = await run_load(_warmup_prompts(spec, n), load)
        _check_warmup(cfg, results)
    if spec.warmup_prompts <= 0:
        return
    max_tokens = min(spec.warmup_max_tokens, spec.load.max_tokens)
    waves = sorted(set(concurrencies)) if spec.warmup_shapes and concurrencies else [min(spec.warmup_prompts, top)]
    if spec.warmup_shapes and concurrencies:
        hooks.log(f"{cfg.name}: shape warm-up, one wave of {max_tokens}-token requests at c={','.join(map(str, waves))}")
    for c in waves:
        n = max(c, spec.warmup_prompts if c == waves[0] else 0)
        load = replace(spec.load, base_url=base_url, concurrency=c, max_tokens=max_tokens)
        results, _, _ = await run_load(_warmup_prompts(spec, n), load)
        _check_warmup(cfg, results)


def _warmup_prompts(spec: MatrixSpec, n: int) -> list[Prompt]:
    """``n`` warm-up requests: the measured prompts in turn, each marked, so that a server with a prefix cache
    (vLLM's is on by default) has not prefilled any cell's prompts before that cell is timed."""
    return [spec.prompts[i % len(spec.prompts)].marked(f"Warm-up {i}. ") for i in range(n)]


def _check_warmup(cfg: BenchConfig, results: Sequence[RequestResult]) -> None:
    failed = [r for r in results if not r.success]
    if failed and len(failed) == len(results):
        raise DsparkError(f"{cfg.name}: every warm-up request failed ({failed[0].error}); check the server")


def _write_cell(spec: MatrixSpec, cell: dict[str, Any], hooks: Hooks) -> None:
    m = cell["metrics"]
    if m["completed"] == 0:
        # Nothing measured (server down, bad model name, ...): saving it would mark the cell "done" forever.
        first = m["errors"][0] if m["errors"] else "unknown error"
        raise DsparkError(f"every request of cell {cell['config']} c={cell['concurrency']} failed ({first}); "
                          "the cell was not saved")
    if m["failed"]:
        # Fewer requests finished than the cell's name promises (a server that died or refused some): its numbers
        # are not this load's. Kept for a look, out of the cells the table and a resumed run read.
        aside = failed_cell_path(spec.results_dir, cell["config"], cell["concurrency"])
        atomic_write_json(aside, cell)
        first = m["errors"][0] if m["errors"] else "unknown error"
        raise DsparkError(f"{m['failed']} of {m['failed'] + m['completed']} requests of cell {cell['config']} "
                          f"c={cell['concurrency']} failed ({first}); the cell was not counted (its record: "
                          f"{aside}); fix the cause and rerun the same command to resume")
    path = cell_path(spec.results_dir, cell["config"], cell["concurrency"])
    replaced = load_cell(path)
    if replaced is not None:
        # A cell measured again (--force, an interleaved resume) keeps its column where it was: columns go by when
        # their first cell was measured (same_workload_cells), and a re-measured first column moved last, taking
        # the table's Δ% reference with it.
        if replaced.get("config") == cell["config"]:
            cell["column_since"] = replaced.get("column_since") or replaced.get("started_at")
        set_aside_superseded(spec, cell["config"], cell["concurrency"], hooks)
    atomic_write_json(path, cell)
    for note in measurement_notes(cell):
        hooks.log(f"{cell['config']} c={cell['concurrency']}: {note}")
    hooks.cell_done(cell)


def measurement_notes(cell: dict[str, Any]) -> list[str]:
    """What makes a cell's numbers not what they seem: each a sentence for the bench log and the summary."""
    notes = []
    cache = cell.get("prefix_cache") or {}
    if cache.get("hit_rate", 0.0) >= PREFIX_HIT_WARN:
        # Its prompts were prefilled before (an earlier cell sends the same ones): less work than a cell whose were
        # not, by an amount that depends on what the server's cache kept (its KV size, the order of cells). On an
        # H200, paused and no-speculation vLLM servers whose logs showed 76% hits in a 256-request cell ran it
        # 16-45% faster than those showing 66-69% (docs/PERFORMANCE.md section 28).
        notes.append(f"{cache['hit_rate']:.0%} of its prompt tokens were prefix-cache hits, so cells are not equal "
                     "work: serve with prefix caching off (vLLM: --no-enable-prefix-caching) to compare configs")
    cpu = cell.get("cpu") or {}
    if (cpu.get("client_loop_share") or 0.0) >= BUSY_SHARE:
        notes.append(f"the bench client's event loop was busy {cpu['client_loop_share']:.0%} of the cell: one loop "
                     "streams every request, so it may be what limits this cell, and its ITLs include its own "
                     "delays")
    if (cpu.get("server_main_share") or 0.0) >= BUSY_SHARE:
        notes.append(f"the server's main thread (pid {cpu['server_pid']}, where its HTTP event loop runs) was busy "
                     f"{cpu['server_main_share']:.0%} of the cell: its frontend may be what limits this cell "
                     "(vLLM: more API servers, --api-server-count)")
    counted = cell["metrics"].get("chunk_counted_requests") or 0
    if counted:
        notes.append(f"{counted} of {cell['metrics']['completed']} requests streamed no usage, so their tokens were "
                     "counted as stream chunks: a server that sends several tokens per chunk (speculative decoding) "
                     "reads slow by its tokens per chunk")
    per_chunk = cell["metrics"].get("tokens_per_chunk")
    per_step = (cell.get("spec_decode") or {}).get("acceptance_length") or 1.0
    if per_chunk and per_chunk > MERGED_CHUNKS_WARN * per_step:
        # A server streams each step's tokens as one chunk per request unless its frontend falls behind and sends
        # several steps' at once (vLLM's API server at ~9,000 chunks/s on an H200, docs/PERFORMANCE.md section 28):
        # throughput may then be the frontend's, and ITL understates the engine's step.
        notes.append(f"{per_chunk:.2f} tokens per stream chunk against {per_step:.2f} per request-step: the server "
                     "merged steps' outputs (its frontend fell behind the engine), so this cell may measure the "
                     "frontend")
    counters = cell.get("server_counters") or {}
    waits, steps = counters.get("kv_wait_steps", 0.0), counters.get("engine_steps", 0.0)
    if steps and waits >= KV_WAIT_WARN * steps:
        # A server whose KV pool cannot hold the load admits a wave's successors only as blocks free, and its
        # steps run partly empty: two 8B-shaped servers sharing an 80 GB H100 gave the drafting one a pool of
        # 226 of 256 requests, and it read 11-14% below its twin at 256 for want of memory (docs/PERFORMANCE.md
        # section 43).
        notes.append(f"on {waits:.0f} of {steps:.0f} steps a waiting request had a free slot but not the KV blocks "
                     "to start: the server's KV pool is too small for this load, so this cell measures memory "
                     "(raise --gpu-memory-utilization, lower --max-model-len, or serve the config alone)")
    return notes


def run_matrix(spec: MatrixSpec, base_url: str | None = None, label: str = "server",
               hooks: Hooks | None = None) -> list[dict[str, Any]]:
    """Measure every pending cell; returns all finished cells of this matrix (old and new).

    With ``spec.serve`` a server is started per config that still has pending cells; otherwise ``base_url``
    is measured as the single config ``label``.

    ``spec.interleave``: the servers of all configs with pending cells start first (one after the other, each
    warmed up) and stay up; then every concurrency is measured for all configs before the next, the first
    config of each concurrency one further down the list than the last's. Why: on a host-bound server the
    host drifts over a matrix -- on an H200 host (SmolLM2-135M, docs/PERFORMANCE.md section 21) each of three
    configs served one after the other ran 0.8-13% below the one before it at every load, whichever config went
    first -- and one config per server in turn puts that drift between the columns. Interleaved, the cells of
    one concurrency run within a few minutes of each other, and the rotation moves every config through the
    slots. Idle servers take no host time (the engine thread blocks while it has no requests), but they hold
    their device memory: each server's KV pool comes out of what the ones started before it left (the
    embedded engine takes at most what ``--max-num-seqs`` full-length requests need), so the configs must fit
    the device together.

    ``spec.rounds`` > 1 goes finer: each cell's requests are cut into rounds, and every config's round r runs
    before any config's round r + 1. A cell of ~10 s on that host moved by up to 40% between minutes (section
    21), more than the 3% a comparison must resolve; rounds of a few seconds put each config's round within
    seconds of every other config's same round, so the ratio of two configs' rounds sees little drift, and
    the summary reports the median of those ratios beside the cells' totals.
    """
    hooks = hooks or Hooks()
    if not spec.serve:
        if base_url is None:
            raise DsparkError("pass --base-url URL of a running server, or --serve to start one per config")
        spec.configs = [BenchConfig(label)]
    check_rounds(spec)
    check_loads(spec)
    prepare_results_dir(spec.results_dir)
    for path in (cell_path(spec.results_dir, cfg.name, c) for cfg in spec.configs for c in spec.concurrencies):
        if path.is_file() and load_cell(path) is None:
            hooks.log(f"{path} is not a finished cell (unreadable or another format): measuring it again")
    todo = pending_cells(spec)
    total = len(spec.configs) * len(spec.concurrencies)
    if len(todo) < total:
        hooks.log(f"resuming: {total - len(todo)} of {total} cells already in {spec.results_dir}")
    check_served_configs(spec, todo)
    if not spec.serve and not spec.force and 0 < len(todo) < total:  # new cells beside old ones
        check_resumed_model(spec, spec.load.model or asyncio.run(_served_model(replace(spec.load, base_url=base_url))))
    try:
        # SIGTERM takes the Ctrl-C path, so a killed bench still stops its servers and says how to resume
        with sigterm_as_interrupt():
            _run_cells(spec, todo, hooks, base_url)
    except KeyboardInterrupt:
        done = total - len(pending_cells(spec))
        raise BenchInterrupted(f"interrupted: {done} of {total} cells finished and kept in {spec.results_dir}; "
                               "rerun the same command to resume") from None
    return finished_cells(spec)


def finished_cells(spec: MatrixSpec) -> list[dict[str, Any]]:
    """This matrix's cells on disk, config by config (what a run returns, or had kept when it stopped)."""
    return [c for c in (load_cell(cell_path(spec.results_dir, k.name, n))
                        for k in spec.configs for n in spec.concurrencies) if c is not None]


def _run_cells(spec: MatrixSpec, todo: list[tuple[BenchConfig, int]], hooks: Hooks,
               base_url: str | None) -> None:
    if spec.serve and spec.interleave:
        _run_interleaved(spec, todo, hooks)
        todo = []
    for cfg in spec.configs:
        cells = [c for k, c in todo if k.name == cfg.name]
        if not cells:
            continue
        if spec.serve:
            _run_served_config(spec, cfg, cells, hooks)
        else:
            # A running server gets the same untimed passes as one the bench starts: on the H200 every
            # speculative vLLM server JIT-compiled its draft-prefill and acceptance-refit kernels inside its
            # first timed cell, which no-speculation servers never run (docs/PERFORMANCE.md section 27).
            url = base_url.rstrip("/")
            asyncio.run(_warmup(spec, cfg, url, hooks, cells))
            for c in cells:
                hooks.cell_started(cfg.name, c, len(spec.cell_prompts(c)))
                external = {"mode": "external", "base_url": url}
                if spec.server_pid is not None:
                    external["pid"] = spec.server_pid
                cell = asyncio.run(_measure(spec, cfg, c, url, external, hooks))
                _write_cell(spec, cell, hooks)


def interleaved_order(configs: Sequence[str], concurrencies: Sequence[int]) -> list[tuple[str, int]]:
    """The cells of an interleaved matrix in the order they are measured: concurrency by concurrency, the
    i-th concurrency's configs rotated left by i (with as many concurrencies as configs, each config
    takes each slot once)."""
    return [(k, c) for k, c, _ in interleaved_rounds(configs, concurrencies, 1)]


def interleaved_rounds(configs: Sequence[str], concurrencies: Sequence[int],
                       rounds: int) -> list[tuple[str, int, int]]:
    """``(config, concurrency, round)`` in the order an interleaved matrix of ``rounds`` rounds per cell
    measures them: concurrency by concurrency, round by round, each round's configs rotated left by one more
    than the round before (over as many rounds as configs, each config takes each slot once)."""
    n = len(configs)
    return [(configs[(i * rounds + r + j) % n], c, r)
            for i, c in enumerate(concurrencies) for r in range(rounds) for j in range(n)] if n else []


# vLLM flags that size a server's share of the GPU; without one a vLLM server takes 90% of it.
VLLM_MEMORY_FLAGS = ("--gpu-memory-utilization", "--kv-cache-memory-bytes")


def check_shared_device(server_args: Sequence[Sequence[str]]) -> None:
    """Servers kept up together (``--interleave``) share the device: refuse vLLM servers none of which was given
    its share, before any starts. By default each takes 90% of the GPU, so the second one's start fails on memory
    after the first has spent minutes coming up (the embedded engine sizes its KV pool from what is left)."""
    from dspark_cli.serve_config import flag_value

    vllm = [args for args in server_args if flag_value(args, "--engine") == "vllm"]
    if len(vllm) > 1 and any(not any(flag_value(a, f) is not None for f in VLLM_MEMORY_FLAGS) for a in vllm):
        share = 0.9 / len(server_args)
        raise DsparkError(f"--interleave keeps {len(server_args)} servers up at once, and a vLLM server takes 90% of "
                          f"the GPU unless told otherwise: give each its share in --serve-args, e.g. "
                          f"--gpu-memory-utilization {share:.2f}")


async def _served_model(load: LoadConfig) -> str:
    async with make_session(load) as session:
        return await fetch_model_name(session, str(load.base_url))


def _run_interleaved(spec: MatrixSpec, todo: list[tuple[BenchConfig, int]], hooks: Hooks) -> None:
    if spec.port is not None:
        raise DsparkError("--interleave runs every config's server at once, each on a free port; drop --port")
    by_name = {cfg.name: cfg for cfg in spec.configs}
    pending = {(cfg.name, c) for cfg, c in todo}
    names = [cfg.name for cfg in spec.configs if any(k == cfg.name for k, _ in pending)]
    check_shared_device([served_args(spec, by_name[name]) for name in names])
    servers: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            cfg = by_name[name]
            concs = [c for c in spec.concurrencies if (name, c) in pending]
            base_url, server, process = _served_process(spec, cfg, hooks)
            stack.callback(hooks.log, f"{name}: server stopped")  # after the process exits (LIFO)
            stack.enter_context(process)
            asyncio.run(_warmup(spec, cfg, base_url, hooks, concs))
            servers[name] = {**server, "interleaved": names, "pid": process.pid}
        if spec.rounds > 1:
            hooks.log(f"interleaved: {len(names)} servers up; cells go by concurrency in {spec.rounds} rounds, "
                      "each round's configs rotated by one")
            _run_rounds(spec, [k for k in interleaved_rounds(names, spec.concurrencies, spec.rounds)
                               if k[:2] in pending], by_name, servers, hooks)
            return
        hooks.log(f"interleaved: {len(names)} servers up; cells go by concurrency, each one's configs rotated by one")
        for slot, (name, c) in enumerate(k for k in interleaved_order(names, spec.concurrencies) if k in pending):
            cfg, server = by_name[name], servers[name]
            hooks.cell_started(name, c, len(spec.cell_prompts(c)))
            cell = asyncio.run(_measure(spec, cfg, c, server["base_url"], {**server, "slot": slot}, hooks))
            _write_cell(spec, cell, hooks)


@dataclass
class _RoundsCell:
    """A cell measured in rounds, while its concurrency's rounds go on: what it has gathered so far."""

    before: ServerCounters
    started: str
    cpu: CpuUse
    results: list[RequestResult] = field(default_factory=list)
    wall: float = 0.0
    model: str = ""
    rounds: list[dict[str, Any]] = field(default_factory=list)


def _run_rounds(spec: MatrixSpec, order: list[tuple[str, int, int]], by_name: dict[str, BenchConfig],
                servers: dict[str, dict[str, Any]], hooks: Hooks) -> None:
    """Measure ``order`` (from interleaved_rounds); a cell is written after its last round.

    A cell's tok/s is its requests' tokens over the sum of its rounds' walls; its server counters span its
    first round's start to its last round's end, which is exact because a server between two of its rounds
    has no requests and takes no steps. Each round's own numbers stay in the cell (``rounds``), and the
    cells of one concurrency share a ``round_group``: the summary pairs their rounds by index. An interrupted
    cell loses its rounds so far (a resumed run measures it again, whole)."""
    open_cells: dict[tuple[str, int], _RoundsCell] = {}
    groups: dict[int, str] = {}
    for slot, (name, c, r) in enumerate(order):
        cfg, server = by_name[name], servers[name]
        prompts = spec.cell_prompts(c)
        lo, hi = round_slices(len(prompts), spec.rounds)[r]
        groups.setdefault(c, f"c{c}@{_now()}")
        hooks.cell_started(f"{name} round {r + 1}/{spec.rounds}", c, hi - lo)
        cell = asyncio.run(_measure_round(spec, cfg, c, r, slot, server, prompts[lo:hi], lo, open_cells, hooks))
        if cell is not None:
            cell["round_group"] = groups[c]
            _write_cell(spec, cell, hooks)
            del open_cells[(name, c)]


async def _measure_round(spec: MatrixSpec, cfg: BenchConfig, c: int, r: int, slot: int, server: dict[str, Any],
                         prompts: list[Prompt], first_index: int, open_cells: dict[tuple[str, int], _RoundsCell],
                         hooks: Hooks) -> dict[str, Any] | None:
    """One round of one cell into ``open_cells``; the finished cell after its last round, else None."""
    load = replace(spec.load, base_url=server["base_url"], concurrency=c)
    async with make_session(load) as session:
        key = (cfg.name, c)
        if key not in open_cells:
            open_cells[key] = _RoundsCell(await fetch_counters(session, load.base_url), _now(),
                                          CpuUse(server.get("pid")))
        acc = open_cells[key]
        started = _now()
        first = CpuSnapshot.take(acc.cpu.server_pid)
        results, wall, acc.model = await run_load(prompts, load, hooks.request_done, session, first_index=first_index)
        acc.cpu.add(first, CpuSnapshot.take(acc.cpu.server_pid))
        acc.results += results
        acc.wall += wall
        tokens = sum(res.output_tokens for res in results if res.success)
        acc.rounds.append({"round": r, "slot": slot, "requests": len(prompts), "duration_s": wall,
                           "output_tokens": tokens, "output_tok_s": tokens / wall if wall > 0 else 0.0,
                           "started_at": started})
        if r < spec.rounds - 1:
            return None
        after = await fetch_counters(session, load.base_url)
    cell = _cell_record(spec, cfg, c, acc.results, acc.wall, acc.before, after,
                        {**server, "model": acc.model, "slot": acc.rounds[0]["slot"]}, acc.started, acc.cpu)
    cell["rounds"] = acc.rounds
    return cell


def _served_process(spec: MatrixSpec, cfg: BenchConfig, hooks: Hooks) -> tuple[str, dict[str, Any], ServerProcess]:
    """A config's server (not started yet: enter it), its URL and what its cells record about it."""
    port = _bind_probe(spec.host, spec.port) if spec.port else _free_port(spec.host)
    base_url = f"http://{url_host(spec.host)}:{port}"
    args = before_passthrough(served_args(spec, cfg), ["--host", spec.host, "--port", str(port)])
    log_path = spec.results_dir / "logs" / f"{safe_name(cfg.name)}.log"
    hooks.log(f"{cfg.name}: starting server ({' '.join(args)})")
    # common_args: the --serve-args every column shares, so a later run into this folder tables only cells of
    # the same setup beside its own (same_workload_cells)
    server = {"mode": "serve", "base_url": base_url, "serve_args": args, "common_args": list(spec.serve_args),
              "files_sha256": served_files_sha256(args), "log": str(log_path)}
    return base_url, server, ServerProcess([*spec.serve_command, *args], log_path, base_url, spec.server_timeout_s)


def _run_served_config(spec: MatrixSpec, cfg: BenchConfig, concurrencies: list[int], hooks: Hooks) -> None:
    base_url, server, process = _served_process(spec, cfg, hooks)
    with process:
        server = {**server, "pid": process.pid}
        asyncio.run(_warmup(spec, cfg, base_url, hooks, concurrencies))
        for c in concurrencies:
            hooks.cell_started(cfg.name, c, len(spec.cell_prompts(c)))
            cell = asyncio.run(_measure(spec, cfg, c, base_url, server, hooks))
            try:
                _write_cell(spec, cell, hooks)
            except DsparkError as exc:
                code = process.exit_status()
                if code is None:
                    raise
                # Connection errors alone hid why: the server's own end and its log's last lines say it.
                raise ServerStartError(f"{exc}; the server had exited with status {code} (full log: "
                                       f"{process.log_path})", _tail(process.log_path)) from None
    hooks.log(f"{cfg.name}: server stopped")
