"""Trace-driven comparison of verification policies against an oracle (``dspark bench --simulate``).

Live benchmarks are slow and noisy; a policy study should be exact and cheap. The simulator replays
recorded verification traces (JSONL, from either engine) through each policy and prices every step
with a profiled SPS curve, so each policy's tokens per second on the recorded outcomes (accepted drafts plus
the bonus token) come out exactly, beside an oracle that knows every request's true accepted length.

Replay model (one concurrency ``R``):

* **One fixed schedule for every policy.** ``R`` slots; each request keeps its own consecutive steps;
  when a request's steps run out the next request (cycling through the trace set) takes its slot, as in
  continuous batching. The schedule (slot -> record per step) is built once, so every policy does the
  same work. By default it runs as many steps as the trace set has records over ``R`` (at least
  ``MIN_STEPS``): every record once where requests are of similar length. Where ``R`` exceeds the number of
  requests, slots repeat them in lockstep (the same record at the same step), which correlates the batch;
  the run says so.
* **Outcome.** A policy verifying ``v`` drafts of a record with ``accepted = a`` accepts ``min(a, v)``
  plus the bonus token. Censoring: when the recording engine verified ``v_rec`` drafts and all were
  accepted (``a == v_rec``), the true run beyond ``v_rec`` is unknown and is taken as ``a``
  (conservative: a policy verifying deeper than the recording engine is never credited with tokens
  nobody saw). Traces recorded with capacity mode ``none`` verify every draft, so they replay exactly
  (the embedded engine's; vLLM records traces only under mask or varlen, censored by the manager that ran).
* **Step time.** ``curve.step_cost_ms(R, R + sum v, drafting)``; ``drafting`` is False for no
  speculation and on steps where the saturation policy paused the draft pass. The ``mask`` policies keep
  the uniform batch, so a drafting step costs ``step_cost_ms(R, R + R * K)`` whatever they admit (a dense
  model computes the padding rows).

Policies call the same core functions the engines call (no reimplementation), but for the "Threshold t" rows,
which admit each request's drafts whose fresh raw survival is at least ``t`` (a yardstick, not the engines'
``--capacity-policy threshold``, which counts slots on stale survival and allocates on fresh): the paper's
Algorithm 1
(``schedule_paper``) and the global argmax (``choose_budget`` + ``allocate``) on fresh confidences; the
production path (``CapacityManager``: record -> plan on stale -> allocate on fresh, with the saturation
policy and ``min_predicted_gain``) with and without STS (``OnlineSTS`` fed by the censored outcomes of
what the policy verified, temperatures applied with ``apply_temperatures`` before the manager, exactly
as the embedded engine does), and optionally offline STS from ``sts.json``.

The oracle verifies, per step, exactly ``n`` of the tokens that are going to be accepted (or skips
drafting) and chooses ``n`` per step to maximise the *aggregate* ratio sum(tokens) / sum(time) by a
Dinkelbach iteration. Every policy's step is dominated by one oracle option (at most ``R + min(n,
sum a)`` tokens for the cost of ``n`` verified drafts, and the curve is monotone), so the oracle bounds
every policy.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.table import Table

from dspark_cli import __version__
from dspark_cli.core.capacity import (
    CapacityConfig,
    CapacityManager,
    allocate,
    choose_budget,
    prefix_survival,
    schedule_paper,
)
from dspark_cli.core.saturation import PROBE_TAX
from dspark_cli.core.sps import SpsCurve
from dspark_cli.core.sts import OnlineSTS, apply_temperatures, load_sts
from dspark_cli.core.traces import read_traces
from dspark_cli.errors import DsparkError
from dspark_cli.fileio import atomic_write_figure, atomic_write_json, atomic_write_text

SIMULATE_FORMAT = 1
# Long enough for the stateful parts to act at any concurrency: online STS refits (every 64 steps) and
# the saturation policy pauses and probes.
MIN_STEPS = 128
DEFAULT_THRESHOLDS = (0.3, 0.5, 0.7)
# Policy families selectable with --policies; the oracle is always computed (it is the yardstick).
FAMILIES = ("nospec", "fixed", "threshold", "paper", "argmax", "manager", "manager+sts", "mask", "mask+sts",
            "manager+offline-sts")
DEFAULT_FAMILIES = ("nospec", "fixed", "threshold", "paper", "argmax", "manager", "manager+sts")
ORACLE = "oracle"
PRETTY = {
    "nospec": "No spec",
    "paper": "Paper Alg. 1 (fresh)",
    "argmax": "Global argmax (fresh)",
    "manager": "Manager (stale budget)",
    "manager+sts": "Manager + online STS",
    "manager+offline-sts": "Manager + offline STS",
    "mask": "Manager, mask layout",
    "mask+sts": "Manager, mask + online STS",
    ORACLE: "Oracle",
}


# ---------------------------------------------------------------------------------------------- inputs


@dataclass
class TraceData:
    """Replayable traces: arrays over records and each request's records in step order."""

    conf: np.ndarray  # [N, K] raw head probabilities
    verified: np.ndarray  # [N]
    accepted: np.ndarray  # [N]
    requests: list[np.ndarray]  # record indices per request, in step order
    skipped: int = 0

    @property
    def num_records(self) -> int:
        return int(self.conf.shape[0])

    @property
    def num_positions(self) -> int:
        return int(self.conf.shape[1])


def load_trace_data(
    paths: Sequence[str | os.PathLike[str]], num_spec_tokens: int | None = None, skip_invalid: bool = False
) -> TraceData:
    """Read traces and group them by request, per file (records without a request id are one-step requests).

    ``num_spec_tokens`` below the traces' K replays the first K positions only (counts are clipped); above
    it is refused, since nothing was drafted there.
    """
    if not paths:
        raise DsparkError("--simulate needs recorded traces: pass --traces FILE.jsonl (or a folder)")
    sources: list[int] = []
    ts = read_traces(list(paths), skip_invalid=skip_invalid, sources=sources)
    if not ts.records:
        raise DsparkError(f"no trace records in {', '.join(str(p) for p in paths)}; record some with "
                          "`dspark serve --record-traces FILE`")
    conf, verified, accepted = ts.arrays()
    k = conf.shape[1]
    if num_spec_tokens is not None:
        if not 1 <= num_spec_tokens <= k:
            raise DsparkError(f"-k must be in 1..{k} (the traces draft {k} tokens), got {num_spec_tokens}")
        conf = conf[:, :num_spec_tokens].copy()
        verified = np.minimum(verified, num_spec_tokens)
        accepted = np.minimum(accepted, num_spec_tokens)
    groups: dict[Any, list[int]] = {}
    for i, rec in enumerate(ts.records):
        key = ("req", sources[i], rec.request) if rec.request is not None else ("row", i)
        groups.setdefault(key, []).append(i)
    steps = [rec.step for rec in ts.records]
    requests = []
    for idx in groups.values():
        if all(steps[i] is not None for i in idx):
            idx = sorted(idx, key=lambda i: steps[i])  # stable: file order breaks step ties
        requests.append(np.asarray(idx, dtype=np.int64))
    return TraceData(conf, verified, accepted, requests, ts.skipped)


def build_schedule(requests: Sequence[np.ndarray], num_slots: int, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(record[S, R], new[S, R])``: which record each slot replays per step, and where a request starts.

    Continuous batching over a cyclic queue of requests: a slot keeps its request's consecutive steps and
    takes the next request when they run out. With more slots than requests a request may run in two
    slots at once (a copy); that keeps the batch full, which is what the concurrency means.
    """
    if not requests or num_slots < 1 or num_steps < 1:
        raise DsparkError("a simulation needs at least one request, one slot and one step")
    record = np.empty((num_steps, num_slots), dtype=np.int64)
    new = np.zeros((num_steps, num_slots), dtype=bool)
    cur = [-1] * num_slots
    pos = [0] * num_slots
    nxt = 0
    for s in range(num_steps):
        for r in range(num_slots):
            if cur[r] < 0 or pos[r] >= len(requests[cur[r]]):
                cur[r] = nxt % len(requests)
                nxt += 1
                pos[r] = 0
                new[s, r] = True
            record[s, r] = requests[cur[r]][pos[r]]
            pos[r] += 1
    return record, new


def default_num_steps(num_records: int, num_slots: int) -> int:
    """Enough steps to replay every record once (cycling when R is large), at least ``MIN_STEPS``."""
    return max(MIN_STEPS, math.ceil(num_records / num_slots))


# ---------------------------------------------------------------------------------------------- results


@dataclass
class PolicyResult:
    """Totals of one policy over one simulated run (one concurrency)."""

    policy: str
    tokens: float  # emitted tokens (accepted drafts + one bonus per request-step)
    time_ms: float
    verified: float  # drafts verified
    request_steps: int
    steps: int
    drafting_steps: int

    @property
    def tok_s(self) -> float:
        return 1000.0 * self.tokens / self.time_ms if self.time_ms > 0 else 0.0

    @property
    def mean_verify(self) -> float:
        return self.verified / self.request_steps if self.request_steps else 0.0

    @property
    def acceptance_length(self) -> float:
        return self.tokens / self.request_steps if self.request_steps else 0.0

    def to_dict(self, oracle_tok_s: float | None = None) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "tok_s": self.tok_s,
            "pct_of_oracle": (100.0 * self.tok_s / oracle_tok_s) if oracle_tok_s else None,
            "mean_verify_length": self.mean_verify,
            "acceptance_length": self.acceptance_length,
            "tokens": self.tokens,
            "time_ms": self.time_ms,
            "verified_drafts": self.verified,
            "request_steps": self.request_steps,
            "steps": self.steps,
            "drafting_steps": self.drafting_steps,
        }


class _Acc:
    """Accumulates one policy's per-step outcomes."""

    def __init__(self, name: str, num_slots: int) -> None:
        self.name = name
        self.r = num_slots
        self.tokens = 0.0
        self.time_ms = 0.0
        self.verified = 0.0
        self.steps = 0
        self.drafting_steps = 0

    def add(self, verify: np.ndarray, accepted: np.ndarray, cost_ms: float, drafting: bool) -> None:
        self.tokens += float(np.minimum(accepted, verify).sum()) + self.r
        self.verified += float(verify.sum())
        self.time_ms += cost_ms
        self.steps += 1
        self.drafting_steps += int(drafting)

    def result(self) -> PolicyResult:
        return PolicyResult(self.name, self.tokens, self.time_ms, self.verified, self.steps * self.r,
                            self.steps, self.drafting_steps)


@dataclass
class SimCell:
    """Every policy at one concurrency."""

    concurrency: int
    steps: int
    results: dict[str, PolicyResult]
    oracle_iterations: int = 0

    @property
    def oracle_tok_s(self) -> float:
        return self.results[ORACLE].tok_s

    def to_dict(self) -> dict[str, Any]:
        o = self.oracle_tok_s
        return {
            "concurrency": self.concurrency,
            "steps": self.steps,
            "oracle_iterations": self.oracle_iterations,
            "policies": {k: r.to_dict(o) for k, r in self.results.items()},
        }


@dataclass(frozen=True)
class SimOptions:
    """What to simulate besides traces, curve and concurrencies (the simulate-only CLI flags)."""

    families: tuple[str, ...] = DEFAULT_FAMILIES
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    min_predicted_gain: float | None = None  # None: the served default (CapacityConfig.trim_margin)
    saturation_patience: int = 8
    resume_every: int = 16
    probe_tax: float = PROBE_TAX
    probe_scout: bool = False  # the served dspark_probe_scout: a probe's first step verifies nothing
    sts_temperatures: tuple[float, ...] | None = None  # offline STS (manager+offline-sts, online prior)
    num_steps: int | None = None  # None: default_num_steps
    # The curve the manager policies price with when it is not the one that times the steps (a mispriced
    # model: what step-time calibration recovers); None = the timing curve.
    manager_curve: SpsCurve | None = None

    def capacity_config(self) -> CapacityConfig:
        return CapacityConfig(mode="varlen", policy="argmax", min_predicted_gain=self.min_predicted_gain,
                              saturation_patience=self.saturation_patience, resume_every=self.resume_every,
                              probe_tax=self.probe_tax, probe_scout=self.probe_scout)


def parse_families(spec: str | None, have_sts: bool) -> tuple[str, ...]:
    if spec is None or not spec.strip():
        fams = list(DEFAULT_FAMILIES) + (["manager+offline-sts"] if have_sts else [])
        return tuple(fams)
    out = []
    for name in (p.strip() for p in spec.split(",")):
        if not name or name == ORACLE:
            continue
        if name not in FAMILIES:
            raise DsparkError(f"--policies: unknown policy {name!r}; choose from {', '.join(FAMILIES)} "
                              "(the oracle is always included)")
        if name == "manager+offline-sts" and not have_sts:
            raise DsparkError("--policies manager+offline-sts needs --sts sts.json (from `dspark calibrate`)")
        if name not in out:
            out.append(name)
    return tuple(out)


def parse_thresholds(spec: str | None) -> tuple[float, ...]:
    if spec is None or not spec.strip():
        return DEFAULT_THRESHOLDS
    try:
        values = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise DsparkError(f"--threshold must be a comma list of numbers in (0, 1], got {spec!r}") from None
    if not values or any(not (0.0 < v <= 1.0) for v in values):
        raise DsparkError(f"--threshold values must be in (0, 1], got {spec!r}")
    return tuple(sorted(set(values)))


# ---------------------------------------------------------------------------------------------- policies


def _stateless(
    name: str, verify: np.ndarray, accepted: np.ndarray, curve: SpsCurve, drafting: bool
) -> PolicyResult:
    """Policies whose verify lengths ``verify[S, R]`` are known up front (vectorised over steps)."""
    s, r = verify.shape
    acc = _Acc(name, r)
    cost = np.asarray(curve.step_cost_ms(r, r + verify.sum(axis=1), drafting=drafting), dtype=np.float64)
    acc.tokens = float(np.minimum(accepted, verify).sum()) + s * r
    acc.verified = float(verify.sum())
    acc.time_ms = float(cost.sum())
    acc.steps = s
    acc.drafting_steps = s if drafting else 0
    return acc.result()


def _run_paper(conf: np.ndarray, accepted: np.ndarray, curve: SpsCurve) -> PolicyResult:
    s, r, _ = conf.shape
    acc = _Acc("paper", r)
    for t in range(s):
        v = schedule_paper(conf[t], curve)
        acc.add(v, accepted[t], float(curve.step_cost_ms(r, r + int(v.sum()))), True)
    return acc.result()


def _run_argmax(conf: np.ndarray, accepted: np.ndarray, curve: SpsCurve, cfg: CapacityConfig) -> PolicyResult:
    s, r, k = conf.shape
    acc = _Acc("argmax", r)
    nd_np = np.full(r, k, dtype=np.int64)
    nd = torch.from_numpy(nd_np)
    for t in range(s):
        surv = prefix_survival(torch.from_numpy(conf[t]))
        decision = choose_budget(surv.numpy(), nd_np, r, r, curve, cfg)
        v = allocate(surv, nd, decision.budget).numpy().astype(np.int64)
        acc.add(v, accepted[t], float(curve.step_cost_ms(r, r + int(v.sum()))), True)
    return acc.result()


def _run_manager(
    name: str,
    conf: np.ndarray,
    verified: np.ndarray,
    accepted: np.ndarray,
    new: np.ndarray,
    curve: SpsCurve,
    cfg: CapacityConfig,
    online_sts: bool,
    offline_temps: Sequence[float] | None,
    model: SpsCurve | None = None,
) -> PolicyResult:
    """The production path, called exactly as the embedded engine calls it each decode step.

    ``cfg.mode`` "mask" prices every drafting step at the uniform batch (every draft row computed, pruned
    ones as padding), as a dense model pays it; otherwise the verified tokens are priced (varlen). Steps
    take the time ``curve`` says; the manager prices with ``model`` (default ``curve``) and is told each
    step's time as the embedded engine tells it (``record_step_time``), plain measuring steps included.
    """
    s, r, k = conf.shape
    acc = _Acc(name, r)
    mgr = CapacityManager(cfg, curve if model is None else model, k, r, "cpu")
    sts = OnlineSTS(k, "cpu", initial_temperatures=offline_temps) if online_sts else None
    temps: torch.Tensor | None
    if sts is not None:
        temps = sts.temperatures
    elif offline_temps is not None:
        temps = torch.tensor(offline_temps, dtype=torch.float32)
    else:
        temps = None
    slots_np = np.arange(r, dtype=np.int64)
    slots = torch.from_numpy(slots_np)
    nd_np = np.full(r, k, dtype=np.int64)
    nd = torch.from_numpy(nd_np)
    uniform = cfg.mode == "mask" and not cfg.mask_pruning_saves  # priced as the manager prices it
    no_draft_ms = float(curve.step_cost_ms(r, r, drafting=False))
    zeros = np.zeros(r, dtype=np.int64)
    for t in range(s):
        for slot in np.flatnonzero(new[t]):
            mgr.add_request(int(slot))
        if not mgr.begin_step(r):
            acc.add(zeros, accepted[t], no_draft_ms, False)
            mgr.record_step_time(False, r, no_draft_ms)
            continue
        conf_raw = torch.from_numpy(conf[t]).float()
        c = conf_raw if temps is None else apply_temperatures(conf_raw, temps, None if sts is None else sts.offsets)
        mgr.record_confidences(slots, c)
        decision = mgr.plan(slots_np, nd_np, r, r, defer_saturation=True)
        v = mgr.allocate(slots, nd, decision.budget).numpy().astype(np.int64)
        batch = r + (int(nd_np.sum()) if uniform else int(v.sum()))
        step_ms = float(curve.step_cost_ms(r, batch))
        acc.add(v, accepted[t], step_ms, True)
        mgr.record_outcome(r + int(np.minimum(accepted[t], v).sum()))  # as the engine does after its sync
        mgr.record_step_time(True, r, step_ms)
        if sts is not None:
            # Only what both the policy and the recording engine verified was observed.
            seen = torch.from_numpy(np.minimum(v, verified[t]))
            sts.record(conf_raw, seen, torch.from_numpy(np.minimum(accepted[t], v)))
            sts.step()
    return acc.result()


def oracle(accepted: np.ndarray, curve: SpsCurve, max_iter: int = 100) -> tuple[PolicyResult, int]:
    """The best any policy could do on these outcomes; returns the result and the Dinkelbach iterations.

    Per step the oracle verifies ``n <= sum_r a_r`` drafts that will all be accepted (``R + n`` tokens
    for ``step_cost(R, R + n)``) or skips drafting (``R`` tokens for the no-draft cost). Maximising the
    aggregate ratio sum(tokens) / sum(cost) over the per-step choices is a fractional program: for a
    ratio λ, each step independently maximises ``tokens - λ cost``; updating λ to the ratio of that
    choice increases λ strictly until it is optimal (Dinkelbach), in finitely many iterations.
    """
    s, r = accepted.shape
    a_sum = accepted.sum(axis=1).astype(np.int64)
    n = np.arange(int(a_sum.max()) + 1)
    cost_n = np.asarray(curve.step_cost_ms(r, r + n, drafting=True), dtype=np.float64)
    tau_n = (r + n).astype(np.float64)
    nd_cost = float(curve.step_cost_ms(r, r, drafting=False))
    lam = r / nd_cost  # no speculation is feasible, so the optimum is at least this
    iterations = 0
    choice = np.full(s, -1, dtype=np.int64)
    while iterations < max_iter:
        iterations += 1
        g = tau_n - lam * cost_n
        # Best n <= A per step: running argmax of g over n (ties keep the smaller n).
        run_best = np.zeros(len(n), dtype=np.int64)
        best = 0
        for i in range(1, len(n)):
            if g[i] > g[best]:
                best = i
            run_best[i] = best
        pick = run_best[a_sum]
        draft_better = g[pick] > (r - lam * nd_cost)
        choice = np.where(draft_better, pick, -1)
        tokens = float(np.where(draft_better, tau_n[pick], r).sum())
        time_ms = float(np.where(draft_better, cost_n[pick], nd_cost).sum())
        new_lam = tokens / time_ms
        if new_lam <= lam * (1 + 1e-12):
            lam = max(lam, new_lam)
            break
        lam = new_lam
    drafted = choice >= 0
    verified = np.where(drafted, choice, 0)
    res = PolicyResult(
        ORACLE,
        tokens=float((r + verified).sum()),
        time_ms=float(np.where(drafted, cost_n[np.maximum(choice, 0)], nd_cost).sum()),
        verified=float(verified.sum()),
        request_steps=s * r,
        steps=s,
        drafting_steps=int(drafted.sum()),
    )
    return res, iterations


def policy_names(families: Sequence[str], k: int, thresholds: Sequence[float]) -> list[str]:
    """Row names in table order for the chosen families (oracle last)."""
    names: list[str] = []
    for fam in families:
        if fam == "fixed":
            names += [f"fixed-{j}" for j in range(1, k + 1)]
        elif fam == "threshold":
            names += [f"threshold-{t:g}" for t in thresholds]
        else:
            names.append(fam)
    return [*names, ORACLE]


def simulate_concurrency(
    data: TraceData,
    curve: SpsCurve,
    num_slots: int,
    opts: SimOptions,
    on_policy: Callable[[str], None] | None = None,
) -> SimCell:
    """Replay the traces at concurrency ``num_slots`` through every chosen policy and the oracle."""
    num_steps = opts.num_steps or default_num_steps(data.num_records, num_slots)
    record, new = build_schedule(data.requests, num_slots, num_steps)
    conf = data.conf[record]  # [S, R, K]
    verified = data.verified[record]
    accepted = data.accepted[record]
    s, r, k = conf.shape
    cfg = opts.capacity_config()
    mc = opts.manager_curve
    results: dict[str, PolicyResult] = {}

    def done(res: PolicyResult) -> None:
        results[res.policy] = res
        if on_policy is not None:
            on_policy(res.policy)

    for fam in opts.families:
        if fam == "nospec":
            done(_stateless("nospec", np.zeros((s, r), dtype=np.int64), accepted, curve, drafting=False))
        elif fam == "fixed":
            for j in range(1, k + 1):
                done(_stateless(f"fixed-{j}", np.full((s, r), j, dtype=np.int64), accepted, curve, True))
        elif fam == "threshold":
            surv = prefix_survival(torch.from_numpy(conf)).numpy()
            for th in opts.thresholds:
                v = (surv >= th).sum(axis=-1).astype(np.int64)  # survival is non-increasing: a prefix
                done(_stateless(f"threshold-{th:g}", v, accepted, curve, True))
        elif fam == "paper":
            done(_run_paper(conf, accepted, curve))
        elif fam == "argmax":
            done(_run_argmax(conf, accepted, curve, cfg))
        elif fam == "manager":
            done(_run_manager("manager", conf, verified, accepted, new, curve, cfg, False, None, mc))
        elif fam == "manager+sts":
            done(_run_manager("manager+sts", conf, verified, accepted, new, curve, cfg, True,
                              opts.sts_temperatures, mc))
        elif fam in ("mask", "mask+sts"):
            mask_cfg = dataclasses.replace(cfg, mode="mask", probe_scout=False)  # scouts are varlen's (--probe-scout)
            done(_run_manager(fam, conf, verified, accepted, new, curve, mask_cfg, fam == "mask+sts",
                              opts.sts_temperatures, mc))
        elif fam == "manager+offline-sts":
            if opts.sts_temperatures is None:
                raise DsparkError("manager+offline-sts needs --sts sts.json (from `dspark calibrate`)")
            done(_run_manager("manager+offline-sts", conf, verified, accepted, new, curve, cfg, False,
                              opts.sts_temperatures, mc))
        else:
            raise DsparkError(f"unknown policy family {fam!r}")
    orc, iters = oracle(accepted, curve)
    done(orc)
    return SimCell(num_slots, num_steps, results, iters)


# ---------------------------------------------------------------------------------------------- report


def pretty(policy: str) -> str:
    if policy.startswith("fixed-"):
        return f"Fixed k={policy[6:]}"
    if policy.startswith("threshold-"):
        return f"Threshold {policy[10:]}"
    return PRETTY.get(policy, policy)


def cell_text(res: PolicyResult, oracle_tok_s: float) -> str:
    tok = f"{res.tok_s:,.0f}" if res.tok_s >= 100 else f"{res.tok_s:,.1f}"
    pct = 100.0 * res.tok_s / oracle_tok_s if oracle_tok_s > 0 else float("nan")
    return f"{tok} ({pct:.1f}%) / {res.mean_verify:.2f} / {res.acceptance_length:.2f}"


CAPTION = "tok/s (% of oracle) / mean verify length / acceptance length (tokens per request-step)"


def table_rows(cells: Sequence[SimCell], names: Sequence[str]) -> list[list[str]]:
    rows = []
    for name in names:
        row = [pretty(name)]
        for c in cells:
            res = c.results.get(name)
            row.append(cell_text(res, c.oracle_tok_s) if res is not None else "—")
        rows.append(row)
    return rows


def to_rich(cells: Sequence[SimCell], names: Sequence[str], title: str) -> Table:
    t = Table(title=title, caption=CAPTION)
    t.add_column("policy", justify="left")
    for c in cells:
        t.add_column(f"c={c.concurrency}", justify="right")
    best = {c.concurrency: max((r.tok_s for k, r in c.results.items() if k != ORACLE), default=0.0)
            for c in cells}
    for name, row in zip(names, table_rows(cells, names), strict=True):
        styled = [row[0]]
        for c, text in zip(cells, row[1:], strict=True):
            res = c.results.get(name)
            is_best = res is not None and name != ORACLE and res.tok_s == best[c.concurrency]
            styled.append(f"[bold green]{text}[/]" if is_best else text)
        t.add_row(*styled, style="dim" if name == ORACLE else None)
    return t


def to_markdown(cells: Sequence[SimCell], names: Sequence[str], title: str) -> str:
    lines = [title, "", f"Cells: {CAPTION}", ""]
    hdr = ["policy", *(f"c={c.concurrency}" for c in cells)]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(hdr))) + "|")
    for row in table_rows(cells, names):
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_throughput(cells: Sequence[SimCell], names: Sequence[str], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [c.concurrency for c in cells]
    # Families are told apart by style: fixed-k in shades of blue, thresholds dotted greens, the
    # schedulers in distinct strong colours, the oracle dashed black.
    fixed = [n for n in names if n.startswith("fixed-")]
    thresh = [n for n in names if n.startswith("threshold-")]
    strong = iter(["tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    for name in names:
        ys = [c.results[name].tok_s if name in c.results else float("nan") for c in cells]
        style: dict[str, Any] = {"marker": "o", "markersize": 4, "label": pretty(name)}
        if name == ORACLE:
            style.update(color="black", linestyle="--", linewidth=2.0)
        elif name == "nospec":
            style.update(color="grey", linewidth=1.5)
        elif name in fixed:
            style.update(color=plt.cm.Blues(0.35 + 0.6 * fixed.index(name) / max(1, len(fixed) - 1)), linewidth=1.0)
        elif name in thresh:
            style.update(color=plt.cm.Greens(0.45 + 0.5 * thresh.index(name) / max(1, len(thresh) - 1)),
                         linestyle=":", linewidth=1.2)
        else:
            style.update(color=next(strong, None), linewidth=2.0)
        ax.plot(xs, ys, **style)
    if len(set(xs)) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in the batch)")
    ax.set_ylabel("tok/s on the recorded outcomes")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    atomic_write_figure(fig, path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- entry


@dataclass
class SimulationRun:
    cells: list[SimCell]
    names: list[str]
    title: str
    num_records: int
    num_requests: int
    num_positions: int
    written: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def summary_files(self) -> list[Path]:
        """What a person opens: the summary JSON, the Markdown table and the plot (not the per-cell JSONs)."""
        return [p for p in self.written if p.parent.name != "simulate_cells"]


def _split_paths(traces: Iterable[str | os.PathLike[str]]) -> list[str]:
    out: list[str] = []
    for item in traces:
        out += [p for p in str(item).split(",") if p.strip()]
    return out


def run_simulation(
    traces: Sequence[str | os.PathLike[str]],
    sps_curve: str | os.PathLike[str] | None,
    concurrencies: Sequence[int],
    results_dir: str | os.PathLike[str],
    num_spec_tokens: int | None = None,
    policies: str | None = None,
    thresholds: str | None = None,
    min_predicted_gain: float | None = None,
    saturation_patience: int = 8,
    sts: str | os.PathLike[str] | None = None,
    num_steps: int | None = None,
    plots: bool = True,
    on_progress: Callable[[int, str], None] | None = None,
    sampling: bool = False,
    manager_sps_curve: str | os.PathLike[str] | None = None,
    resume_every: int = 16,
    probe_tax: float = PROBE_TAX,
    probe_scout: bool = False,
) -> SimulationRun:
    """``dspark bench --simulate``: replay, write one JSON per concurrency as it finishes, then the summary
    (``simulate.json``, ``simulate.md``) and ``simulate_throughput.png``; all writes are atomic.

    ``sampling``: the replayed workload samples (temperature > 0), so every drafting step is priced with the
    curve's sampling draft pass (``draft_sampling_curve_ms``), as the engines price such batches.
    ``manager_sps_curve``: the curve the manager policies price with, when it differs from the one that
    times every step (``sps_curve``); with ``sampling`` it is read the same way (a curve without sampling
    points prices sampling steps like greedy ones, as an engine given that file would). ``resume_every``,
    ``probe_tax`` and ``probe_scout``: the saturation policy's, as ``dspark serve`` takes them
    (``dspark_resume_every``, ``dspark_probe_tax``, ``dspark_probe_scout``), so a served configuration replays as
    it ran."""
    if sps_curve is None or str(sps_curve) == "auto":
        raise DsparkError("--simulate needs a profiled curve: pass --sps-curve sps_curve.json "
                          "(from `dspark profile-sps`)")
    if num_steps is not None and num_steps < 1:
        raise DsparkError(f"--steps must be >= 1, got {num_steps}")
    if not concurrencies or any(c < 1 for c in concurrencies):
        raise DsparkError("--concurrency values must be >= 1")
    paths = _split_paths(traces)
    curve = SpsCurve.load(sps_curve)
    if sampling:
        if not curve.draft_sampling_ms:
            raise DsparkError(f"{sps_curve} has no draft_sampling_curve_ms; re-profile it with `dspark profile-sps` "
                              "or drop --sampling-draft")
        curve = curve.for_sampling()
    manager_curve = None
    if manager_sps_curve is not None:
        manager_curve = SpsCurve.load(manager_sps_curve)
        if sampling:
            manager_curve = manager_curve.for_sampling()
    data = load_trace_data(paths, num_spec_tokens)
    k = data.num_positions
    temps = load_sts(sts, k) if sts is not None else None
    opts = SimOptions(
        families=parse_families(policies, temps is not None),
        thresholds=parse_thresholds(thresholds),
        min_predicted_gain=min_predicted_gain,
        saturation_patience=saturation_patience,
        resume_every=resume_every,
        probe_tax=probe_tax,
        probe_scout=probe_scout,
        sts_temperatures=temps,
        num_steps=num_steps,
        manager_curve=manager_curve,
    )
    opts.capacity_config()  # validate the capacity flags before any work
    out_dir = Path(results_dir)
    names = policy_names(opts.families, k, opts.thresholds)
    title = (f"dspark bench --simulate ({data.num_records} records, {len(data.requests)} requests, K={k}, "
             f"curve {Path(sps_curve).name}{', sampling draft' if sampling else ''})")
    cells: list[SimCell] = []
    written: list[Path] = []
    meta = {
        "traces": [str(p) for p in paths],
        "sps_curve": str(sps_curve),
        "draft_pricing": "sampling" if sampling else "greedy",
        "manager_sps_curve": str(manager_sps_curve) if manager_sps_curve is not None else None,
        "sts": str(sts) if sts is not None else None,
        "num_spec_tokens": k,
        "num_records": data.num_records,
        "num_requests": len(data.requests),
        "thresholds": list(opts.thresholds),
        "min_predicted_gain": opts.capacity_config().trim_margin,
        "saturation_patience": saturation_patience,
        "resume_every": resume_every,
        "probe_tax": probe_tax,
        "probe_scout": probe_scout,
        "censoring": "a policy verifying beyond the recorded verified count is credited the recorded accepted "
                     "count (exact for traces recorded with capacity mode none)",
    }
    for c in sorted(set(int(x) for x in concurrencies)):
        cell = simulate_concurrency(data, curve, c, opts,
                                    on_policy=(lambda name, c=c: on_progress(c, name)) if on_progress else None)
        cells.append(cell)
        written.append(atomic_write_json(out_dir / "simulate_cells" / f"c{c}.json",
                                         {"dspark_simulate": SIMULATE_FORMAT, "dspark_version": __version__,
                                          **meta, **cell.to_dict()}))
    md = to_markdown(cells, names, title)
    summary = {
        "dspark_simulate": SIMULATE_FORMAT,
        "dspark_version": __version__,
        **meta,
        "policies": names,
        "concurrencies": [c.concurrency for c in cells],
        "cells": [c.to_dict() for c in cells],
        "markdown": md,
    }
    written.append(atomic_write_json(out_dir / "simulate.json", summary))
    written.append(atomic_write_text(out_dir / "simulate.md", md))
    plot = out_dir / "simulate_throughput.png"
    if plots:
        written.append(plot_throughput(cells, names, plot, "Simulated tok/s vs concurrency"))
    warnings = simulation_warnings(curve, k, len(data.requests), [c.concurrency for c in cells], temps is not None)
    if not plots and plot.is_file():
        plot.unlink()  # drawn from an earlier run than the table beside it
        warnings.append(f"removed {plot.name}: drawn from an earlier run into {out_dir} (--no-plots)")
    return SimulationRun(cells, names, title, data.num_records, len(data.requests), k, written, warnings)


def simulation_warnings(curve: SpsCurve, k: int, num_requests: int, concurrencies: Sequence[int],
                        offline_sts: bool) -> list[str]:
    """What a reader of the table should know that the table does not say."""
    from dspark_cli.serve_config import curve_k_warning

    out = []
    mismatch = curve_k_warning(curve.meta.get("k"), k)
    if mismatch is not None:  # every drafting step is priced at the curve's draft pass, whatever K replays
        out.append(mismatch.replace("this server drafts", "the replay drafts"))
    crowded = [c for c in concurrencies if c > num_requests]
    if crowded:
        out.append(f"c={','.join(map(str, crowded))} exceeds the traces' {num_requests} requests: the extra slots "
                   "repeat them in lockstep, so those batches are correlated, not independent requests")
    if offline_sts:
        out.append("with --sts the online STS rows start from the offline temperatures (dspark serve refuses "
                   "--online-sts with --sts; there they start from 1)")
    return out
