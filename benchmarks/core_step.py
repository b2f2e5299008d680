"""Proof that the per-step core (allocation + varlen layout + rejection sampling) is one sync-free CUDA graph.

For every batch size R it allocates static device buffers, captures ONE graph that runs
``capacity.allocate`` (0-d budget tensor) -> ``build_varlen_layout`` -> ``rejection_sample``, and replays it
with fresh confidences / drafts / logits / uniforms and a new budget copied into the buffers between
replays, under ``torch.cuda.set_sync_debug_mode("error")``. Every checked replay is compared with an eager
run on the same inputs. It then times, with CUDA events (median over replays of separately captured
graphs): allocation alone (torch sort vs the single-launch Triton kernel), (a) allocation + layout, (b) the
rejection sampler alone -- greedy, probabilistic with one-hot q,
probabilistic with draft probabilities -- for the torch and (when available) Triton paths, against the
memory-bandwidth floor of the bytes the sampler must read (the logits [T, V], plus the R emit rows of
draft_probs when given), with the device copy bandwidth measured in the same run.

For the Triton probabilistic sampler (one-hot and real q) it also times every launch on its own (each in
its own graph, the launches before it replayed untimed first so its inputs and the L2 state are those of a
real step) for both finalize variants -- "split" (tile-mass kernel over requests x vocabulary chunks, then
a per-request final kernel; the default) and "single" (one program per request) -- and, at the largest R,
every launch under other kernel shapes: row-kernel tile / warps / paired loads (``--row-configs``) and
split-finalize tile / tiles per program / warps (``--tile-configs``), so defaults are chosen from data.

Timed sampler replays use the full budget (every row real): that is the captured size's worst case.

    python benchmarks/core_step.py --out results/core_step            # CUDA: the full proof
    python benchmarks/core_step.py --device cpu --quick --out /tmp/x  # CPU smoke run (eager, tiny sizes)
    TRITON_INTERPRET=1 python benchmarks/core_step.py --device cpu --quick --paths torch,triton --out /tmp/x
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark_cli.core import _triton_rejection
from dspark_cli.core.capacity import allocate, prefix_survival
from dspark_cli.core.layout import VerifyLayout, build_varlen_layout, pick_padded_tokens
from dspark_cli.core.rejection import RejectionOutput, rejection_sample
from dspark_cli.fileio import atomic_write_json

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CAPTURE_SIZES = [1, 2, 4, 8] + list(range(16, 8193, 16))
HOT_TOKENS = 8  # drafts are drawn from the first tokens and the logits favour them: real accept/reject mixes


def _triton_ok(device: torch.device) -> bool:
    return _triton_rejection.available(device)


class Timer:
    """Median wall time of one call: CUDA events on the device (inputs updated outside the timed span)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def median_us(self, fn: Callable[[], Any], update: Callable[[int], None], n: int) -> float:
        if self.cuda:
            pairs = []
            for i in range(n):
                update(i)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize()
            return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)
        times = []
        for i in range(n):
            update(i)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


def copy_bandwidth_gbps(device: torch.device, timer: Timer, quick: bool) -> float:
    """Device copy bandwidth, counting read + write bytes (what a streaming kernel can sustain)."""
    nbytes = (64 << 20) if quick or device.type != "cuda" else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    us = timer.median_us(lambda: dst.copy_(src), lambda i: None, 10 if quick else 30)
    return 2 * nbytes / (us * 1e-6) / 1e9


@dataclass
class Buffers:
    """Static inputs the graphs read; replays see new values because they are overwritten in place."""

    conf: torch.Tensor
    num_drafts: torch.Tensor
    budget: torch.Tensor
    last: torch.Tensor
    drafts: torch.Tensor
    start: torch.Tensor
    logits: torch.Tensor
    temperature: torch.Tensor
    draft_probs: torch.Tensor
    uniforms: torch.Tensor

    @classmethod
    def make(cls, num_reqs: int, k: int, vocab: int, rows: int, dtype: torch.dtype, device: torch.device) -> Buffers:
        return cls(
            conf=torch.zeros(num_reqs, k, device=device),
            num_drafts=torch.full((num_reqs,), k, dtype=torch.int32, device=device),
            budget=torch.zeros((), dtype=torch.int64, device=device),
            last=torch.zeros(num_reqs, dtype=torch.int64, device=device),
            drafts=torch.zeros(num_reqs, k, dtype=torch.int64, device=device),
            start=torch.zeros(num_reqs, dtype=torch.int64, device=device),
            logits=torch.zeros(rows, vocab, dtype=dtype, device=device),
            temperature=torch.ones(num_reqs, device=device),
            draft_probs=torch.zeros(num_reqs, k, vocab, device=device),
            uniforms=torch.zeros(rows, 2, device=device),
        )

    def refresh(self, gen: torch.Generator, budget: int, with_q: bool = True) -> None:
        """New values on the device (no host round trip): the budget is the only host-known number."""
        self.budget.fill_(budget)
        self.conf.uniform_(generator=gen).pow_(0.3)
        self.last.random_(0, self.logits.shape[1], generator=gen)
        self.drafts.random_(0, HOT_TOKENS, generator=gen)
        self.start.random_(0, 4096, generator=gen)
        self.logits.normal_(generator=gen).mul_(2.0)
        self.logits[:, :HOT_TOKENS] += 4.0
        self.temperature.uniform_(0.5, 1.5, generator=gen)
        if with_q:
            self.draft_probs.normal_(generator=gen)
            self.draft_probs[:, :, :HOT_TOKENS] += 3.0
            self.draft_probs.copy_(torch.softmax(self.draft_probs, dim=-1))
        self.uniforms.uniform_(generator=gen)


def alloc_layout(b: Buffers, rows: int, use_triton: bool) -> tuple[torch.Tensor, VerifyLayout]:
    admitted = allocate(prefix_survival(b.conf), b.num_drafts, b.budget, use_triton=use_triton)
    return admitted, build_varlen_layout(b.last, b.drafts, admitted, b.start, rows, use_triton=use_triton)


def full_step(b: Buffers, rows: int, use_triton: bool) -> tuple[torch.Tensor, VerifyLayout, RejectionOutput]:
    admitted, lay = alloc_layout(b, rows, use_triton)
    out = rejection_sample(b.logits, lay, b.drafts, admitted, temperature=b.temperature,
                           draft_probs=b.draft_probs, uniforms=b.uniforms, use_triton=use_triton)
    return admitted, lay, out


def capture(fn: Callable[[], Any], device: torch.device) -> tuple[Callable[[], None], Any]:
    """CUDA: warm up on a side stream, capture, return (replay, static outputs). CPU: the eager call."""
    if device.type != "cuda":
        return (lambda: fn()), None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def _flat(admitted: torch.Tensor, lay: VerifyLayout, out: RejectionOutput) -> list[torch.Tensor]:
    return [admitted, lay.input_ids, lay.positions, lay.req_index, lay.pos_in_req, lay.is_padding,
            lay.query_start_loc, lay.seq_lens, lay.num_tokens, out.tokens, out.num_accepted]


def check_graph(b: Buffers, rows: int, k: int, use_triton: bool, device: torch.device, n: int,
                gen: torch.Generator, rng: random.Random) -> dict[str, Any]:
    """Replay the one full-step graph with new inputs; compare with eager; count host syncs (must be 0)."""
    num_reqs = b.conf.shape[0]
    b.refresh(gen, num_reqs * k)
    replay, static = capture(lambda: full_step(b, rows, use_triton), device)
    mismatches, budget_errors, sync_error = 0, 0, ""
    for _ in range(n):
        budget = rng.randint(0, num_reqs * k)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            b.refresh(gen, budget)
            replay()
            if device.type == "cuda":
                eager = full_step(b, rows, use_triton)  # eager must be sync-free too
        except RuntimeError as exc:  # the sync debugger raises RuntimeError on any host sync
            sync_error = str(exc).splitlines()[0]
            break
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        if device.type != "cuda":
            static = full_step(b, rows, use_triton)
            eager = full_step(b, rows, use_triton)
        got, ref = _flat(*static), _flat(*eager)
        mismatches += sum(not torch.equal(g, r) for g, r in zip(got, ref, strict=True))
        admitted, _, out = static
        budget_errors += int(int(admitted.sum()) != min(budget, num_reqs * k))
        budget_errors += int(not torch.equal(out.num_emitted, out.num_accepted + 1))
        budget_errors += int(bool((out.num_accepted > admitted).any()))
    return {"replays": n, "mismatches": mismatches, "invariant_errors": budget_errors,
            "sync_error": sync_error, "ok": mismatches == 0 and budget_errors == 0 and not sync_error}


def compare_paths(b: Buffers, rows: int, k: int, gen: torch.Generator, rng: random.Random) -> dict[str, Any]:
    """Triton vs torch on identical inputs.

    Allocation, layout and greedy sampling must agree exactly. Sampled tokens: both paths accumulate the
    inverse CDF in float64 and compute the emit weights with the same operations, so only the accept test
    ``u * q < p`` can differ (p's exp/reduction order, about one row in a million); more than one
    differing request per kind is a defect. Counts are reported next to the fractions.
    """
    num_reqs = b.conf.shape[0]
    alloc_equal = True
    for budget in (0, 1, rng.randint(0, num_reqs * k), num_reqs * k):
        b.refresh(gen, budget)
        b.conf[: num_reqs // 2].copy_((b.conf[: num_reqs // 2] * 4).round() / 4)  # heavy value ties
        surv = prefix_survival(b.conf)
        alloc_equal &= torch.equal(allocate(surv, b.num_drafts, b.budget, use_triton=False),
                                   allocate(surv, b.num_drafts, b.budget, use_triton=True))
    b.refresh(gen, num_reqs * k)
    admitted, lay = alloc_layout(b, rows, False)
    lay_t = alloc_layout(b, rows, True)[1]
    res: dict[str, Any] = {"alloc_equal": alloc_equal, "layout_equal": all(
        torch.equal(getattr(lay, f), getattr(lay_t, f)) for f in
        ("input_ids", "positions", "req_index", "pos_in_req", "is_padding", "query_start_loc", "seq_lens",
         "num_tokens", "num_logits_per_req"))}
    for name, kw in sampler_kinds(b).items():
        a = rejection_sample(b.logits, lay, b.drafts, admitted, use_triton=False, **kw)
        t = rejection_sample(b.logits, lay, b.drafts, admitted, use_triton=True, **kw)
        diff = int((a.tokens != t.tokens).any(dim=1).sum())
        res[name] = diff / num_reqs
        res[f"{name}_count"] = diff
        # The single-program finalize (kept for comparison) must agree with the default split one: both
        # sum float64 masses, only grouped differently.
        single, _ = _triton_rejection.rejection_sample_fused(
            b.logits, lay.req_index, lay.pos_in_req, ~lay.is_padding, b.drafts, admitted, kw.get("temperature"),
            kw.get("draft_probs"), kw.get("uniforms"), finalize="single")
        res[f"{name}_single_vs_split_count"] = int((single != t.tokens).any(dim=1).sum())
    res["ok"] = (res["alloc_equal"] and res["layout_equal"] and res["greedy_count"] == 0
                 and res["prob_count"] <= 1 and res["prob_q_count"] <= 1
                 and res["greedy_single_vs_split_count"] == 0 and res["prob_single_vs_split_count"] <= 1
                 and res["prob_q_single_vs_split_count"] <= 1)
    return res


def sampler_kinds(b: Buffers) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "greedy": {},
        "prob": {"temperature": b.temperature, "uniforms": b.uniforms},
        "prob_q": {"temperature": b.temperature, "uniforms": b.uniforms, "draft_probs": b.draft_probs},
    }


def sampler_plan(b: Buffers, lay: VerifyLayout, admitted: torch.Tensor, kw: dict[str, torch.Tensor],
                 **knobs: Any) -> Any:
    return _triton_rejection.plan_rejection_sample(
        b.logits, lay.req_index, lay.pos_in_req, ~lay.is_padding, b.drafts, admitted, kw.get("temperature"),
        kw.get("draft_probs"), kw.get("uniforms"), **knobs)


def time_stages(plan: Any, b: Buffers, device: torch.device, timer: Timer, replays: int,
                gen: torch.Generator, only: str | None = None) -> dict[str, float]:
    """Median µs of every launch of a Triton sampler plan on its own, and of the whole plan ("total").

    Each launch is its own graph; before each timed replay the logits get new values and the launches
    before it replay untimed, so it reads what a real step hands it (and the L2 holds what it would).
    ``only`` times just that stage (and no total).
    """
    plan.run()  # every scratch buffer valid before any stage replays on its own
    graphs = [(name, capture(fn, device)[0]) for name, fn in plan.stages]
    out: dict[str, float] = {}
    for i, (name, replay) in enumerate(graphs):
        if only is not None and name != only:
            continue
        prefix = [g for _, g in graphs[:i]]

        def update(_: int, prefix: list[Callable[[], None]] = prefix) -> None:
            b.logits.normal_(generator=gen)
            for g in prefix:
                g()

        out[name] = timer.median_us(replay, update, replays)
    if only is None:
        total, _ = capture(plan.run, device)
        out["total"] = timer.median_us(total, lambda i: b.logits.normal_(generator=gen), replays)
    return out


def stage_breakdown(b: Buffers, lay: VerifyLayout, admitted: torch.Tensor, row: dict[str, Any],
                    device: torch.device, timer: Timer, replays: int, gen: torch.Generator) -> None:
    """Per-launch times of the probabilistic Triton sampler, both finalize variants, into ``row``."""
    for kind, kw in sampler_kinds(b).items():
        if kind == "greedy":
            continue
        floor = row[f"{kind}_floor_us"]
        stages = {}
        for finalize in _triton_rejection.FINALIZE_MODES:
            stages[finalize] = time_stages(sampler_plan(b, lay, admitted, kw, finalize=finalize), b, device,
                                           timer, replays, gen)
            row[f"{kind}_{finalize}_us"] = stages[finalize]["total"]
            row[f"{kind}_{finalize}_x_floor"] = stages[finalize]["total"] / floor
        row[f"{kind}_stages_us"] = stages
        if device.type == "cuda":
            torch.cuda.empty_cache()


ROW_KNOBS = ("row_block", "row_warps", "row_unroll")
TILE_KNOBS = ("tile_block", "tile_subs", "tile_warps")


def knob_sweep(b: Buffers, lay: VerifyLayout, admitted: torch.Tensor, dname: str, sweep: str,
               configs: list[dict[str, int]], kinds: tuple[str, ...], floor_us: dict[str, float],
               device: torch.device, timer: Timer, replays: int, gen: torch.Generator) -> list[dict[str, Any]]:
    """Every launch of the split Triton sampler under other kernel shapes (``configs``: plan knobs).

    ``x_floor`` is the whole plan against the kind's floor. ``diff_vs_default`` counts requests whose
    tokens differ from the default shapes on the same inputs: greedy must be 0; sampled may differ where a
    regrouped sum rounds differently (p(x) at the accept test, about one row in a million)."""
    out = []
    kinds_kw = sampler_kinds(b)
    for kind in kinds:
        for knobs in configs:
            plan = sampler_plan(b, lay, admitted, kinds_kw[kind], **knobs)
            times = time_stages(plan, b, device, timer, replays, gen)
            ref = sampler_plan(b, lay, admitted, kinds_kw[kind]).run()[0]
            got = plan.run()[0]
            out.append({"sweep": sweep, "R": admitted.shape[0], "dtype": dname, "kind": kind, **knobs,
                        "stages_us": times, "x_floor": times["total"] / floor_us[kind],
                        "diff_vs_default": int((got != ref).any(dim=1).sum())})
    return out

def bench_size(num_reqs: int, args: argparse.Namespace, device: torch.device, timer: Timer, bw: float,
               paths: list[str], sweep: bool) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    k, vocab = args.k, args.vocab
    rows = pick_padded_tokens(num_reqs + num_reqs * k, CAPTURE_SIZES)
    gen = torch.Generator(device=device).manual_seed(1234 + num_reqs)
    rng = random.Random(num_reqs)
    results: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    sweeps: list[dict[str, Any]] = []
    full_budget = num_reqs * k
    for dname in args.dtypes:
        b = Buffers.make(num_reqs, k, vocab, rows, DTYPES[dname], device)
        b.refresh(gen, full_budget)

        def new_plan(i: int, b: Buffers = b) -> None:
            b.budget.fill_(rng.randint(0, full_budget))
            b.conf.uniform_(generator=gen)

        # allocation alone per path, then (a) allocation + layout: graphs replayed with new confidences and
        # budget. prefix_survival (clamp + cumprod) is included: it is part of the allocation step.
        alloc_only: dict[str, float] = {}
        for path in dict.fromkeys(["torch", *paths]):
            replay_alloc, _ = capture(lambda b=b, t=path == "triton": allocate(
                prefix_survival(b.conf), b.num_drafts, b.budget, use_triton=t), device)
            alloc_only[path] = timer.median_us(replay_alloc, new_plan, args.replays)
        for path in paths:
            use_triton = path == "triton"
            replay_a, _ = capture(lambda b=b, use_triton=use_triton: alloc_layout(b, rows, use_triton), device)
            alloc_us = timer.median_us(replay_a, new_plan, args.replays)
            checks[f"R{num_reqs}/{dname}/{path}/graph"] = check_graph(
                b, rows, k, use_triton, device, args.check_replays, gen, rng)
            # (b) the sampler alone on a fixed full-budget layout, logits refreshed every replay.
            b.refresh(gen, full_budget)
            admitted, lay = alloc_layout(b, rows, use_triton)
            kinds = sampler_kinds(b)
            row: dict[str, Any] = {"R": num_reqs, "K": k, "V": vocab, "T": rows, "dtype": dname, "path": path,
                                   "alloc_us": alloc_only[path], "alloc_torch_us": alloc_only["torch"],
                                   "alloc_layout_us": alloc_us}
            elem = b.logits.element_size()
            logits_bytes = rows * vocab * elem
            q_bytes = num_reqs * vocab * b.draft_probs.element_size()
            for kind, kw in kinds.items():
                replay, _ = capture(
                    lambda kw=kw, admitted=admitted, lay=lay, b=b, use_triton=use_triton: rejection_sample(
                        b.logits, lay, b.drafts, admitted, use_triton=use_triton, **kw), device)
                us = timer.median_us(replay, lambda i, b=b: b.logits.normal_(generator=gen), args.replays)
                floor = (logits_bytes + (q_bytes if kind == "prob_q" else 0)) / (bw * 1e9) * 1e6
                row[f"{kind}_us"] = us
                row[f"{kind}_floor_us"] = floor
                row[f"{kind}_x_floor"] = us / floor
            replay_full, _ = capture(lambda b=b, use_triton=use_triton: full_step(b, rows, use_triton), device)
            row["full_step_us"] = timer.median_us(
                replay_full, lambda i, b=b: (b.budget.fill_(rng.randint(0, full_budget)),
                                             b.logits.normal_(generator=gen)), args.replays)
            if use_triton:
                stage_breakdown(b, lay, admitted, row, device, timer, args.replays, gen)
                if sweep:
                    floors = {kind: row[f"{kind}_floor_us"] for kind in kinds}
                    sweeps += knob_sweep(b, lay, admitted, dname, "row", args.row_configs, ("greedy", "prob"),
                                         floors, device, timer, args.replays, gen)
                    sweeps += knob_sweep(b, lay, admitted, dname, "tile", args.tile_configs, ("prob", "prob_q"),
                                         floors, device, timer, args.replays, gen)
            results.append(row)
        if "triton" in paths:
            checks[f"R{num_reqs}/{dname}/triton_vs_torch"] = compare_paths(b, rows, k, gen, rng)
        del b
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results, checks, sweeps


STAGE_COLUMNS = ("row", "tile_e", "tile_mass", "final")


def render(results: list[dict[str, Any]], checks: dict[str, Any], sweeps: list[dict[str, Any]], bw: float,
           device_name: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain fallback keeps the script usable in a bare environment
        for r in results:
            print(r)
        for r in sweeps:
            print(r)
        for k, v in checks.items():
            print(k, v)
        return
    con = Console(width=150)
    table = Table(title=f"core step on {device_name} (copy bandwidth {bw:.0f} GB/s, median µs)")
    for col in ("R", "T", "dtype", "path", "alloc", "alloc+layout", "greedy (x floor)", "prob (x floor)",
                "prob+q (x floor)", "full step"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r["R"]), str(r["T"]), r["dtype"], r["path"], f"{r['alloc_us']:.1f}", f"{r['alloc_layout_us']:.1f}",
            *(f"{r[f'{k}_us']:.1f} ({r[f'{k}_x_floor']:.2f}x)" for k in ("greedy", "prob", "prob_q")),
            f"{r['full_step_us']:.1f}",
        )
    con.print(table)
    staged = [r for r in results if "prob_stages_us" in r]
    if staged:
        table = Table(title="Triton probabilistic sampler per launch (median µs, each launch in its own graph; "
                            "memset omitted)")
        for col in ("R", "T", "dtype", "kind", *STAGE_COLUMNS, "split total (x floor)", "single: finalize",
                    "single total (x floor)"):
            table.add_column(col, justify="right")
        for r in staged:
            for kind in ("prob", "prob_q"):
                split, single = r[f"{kind}_stages_us"]["split"], r[f"{kind}_stages_us"]["single"]
                table.add_row(
                    str(r["R"]), str(r["T"]), r["dtype"], kind,
                    *(f"{split[c]:.1f}" if c in split else "-" for c in STAGE_COLUMNS),
                    f"{split['total']:.1f} ({r[f'{kind}_split_x_floor']:.2f}x)", f"{single['finalize']:.1f}",
                    f"{single['total']:.1f} ({r[f'{kind}_single_x_floor']:.2f}x)",
                )
        con.print(table)
    for sweep, knobs, shown in (("row", ROW_KNOBS, ("row",)), ("tile", TILE_KNOBS, ("tile_e", "tile_mass", "final"))):
        rows = [r for r in sweeps if r["sweep"] == sweep]
        if not rows:
            continue
        table = Table(title=f"{sweep} kernel shapes at R={rows[0]['R']} (median µs per launch; total = whole "
                            "split plan, x its floor)")
        for col in ("dtype", "kind", *knobs, *shown, "total (x floor)", "requests differing from default"):
            table.add_column(col, justify="right")
        for r in rows:
            st = r["stages_us"]
            table.add_row(r["dtype"], r["kind"], *(str(r[k]) for k in knobs),
                          *(f"{st[c]:.1f}" if c in st else "-" for c in shown),
                          f"{st['total']:.1f} ({r['x_floor']:.2f}x)", str(r["diff_vs_default"]))
        con.print(table)
    bad = {k: v for k, v in checks.items() if not v["ok"]}
    con.print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok" + ("" if not bad else f"  FAILED: {bad}"))


def _knob_configs(text: str, names: tuple[str, ...], min_parts: int) -> list[dict[str, int]]:
    """'4096x8,2048x4x2' -> [{names[0]: 4096, names[1]: 8, names[2]: 1}, {...: 2}]; powers of two only."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = [int(x) for x in item.split("x")]
        if not min_parts <= len(parts) <= len(names) or any(v < 1 or v & (v - 1) for v in parts):
            raise ValueError(item)
        out.append(dict(zip(names, parts + [1] * (len(names) - len(parts)), strict=True)))  # missing: 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for core_step.json")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (R in 1, 8; V=1000), few replays")
    ap.add_argument("--reqs", default="1,8,64,256", help="comma-separated batch sizes R")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtypes", default="fp32,bf16", help="logits dtypes to time (fp32, bf16)")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--check-replays", type=int, default=20)
    ap.add_argument("--paths", default="auto", help="torch, triton or auto (both when triton runs here)")
    ap.add_argument("--row-configs", default="4096x8,4096x8x2,2048x4x2,8192x16",
                    help="row-kernel BLOCKxWARPS[xUNROLL] shapes timed at the largest R ('' = none)")
    ap.add_argument("--tile-configs", default="1024x4x8,1024x2x4,2048x2x8,512x8x8",
                    help="split finalize TILExSUBSxWARPS shapes (tokens per inverse-CDF tile, tiles per "
                         "tile-mass program, its warps) timed at the largest R ('' = none)")
    args = ap.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no CUDA device is visible", file=sys.stderr)
        return 1
    reqs = [int(x) for x in args.reqs.split(",")]
    try:
        args.row_configs = _knob_configs(args.row_configs, ROW_KNOBS, 2)
        args.tile_configs = _knob_configs(args.tile_configs, TILE_KNOBS, 3)
    except ValueError as exc:
        print(f"--row-configs / --tile-configs: bad shape {exc} (powers of two, like 4096x8 or 1024x4x8)",
              file=sys.stderr)
        return 1
    if any(c["row_unroll"] > 2 for c in args.row_configs if "row_unroll" in c):
        print("--row-configs: UNROLL must be 1 or 2", file=sys.stderr)
        return 1
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    if any(d not in DTYPES for d in args.dtypes):
        print(f"--dtypes must be among {sorted(DTYPES)}", file=sys.stderr)
        return 1
    if args.quick:
        reqs = [r for r in reqs if r <= 8] or [1, 8]
        args.vocab = min(args.vocab, 1000)
        args.replays = min(args.replays, 10)
        args.check_replays = min(args.check_replays, 3)
    paths = ["torch", "triton"] if args.paths == "auto" and _triton_ok(device) else (
        ["torch"] if args.paths == "auto" else [p.strip() for p in args.paths.split(",")])
    torch.manual_seed(0)
    timer = Timer(device)
    bw = copy_bandwidth_gbps(device, timer, args.quick)
    results: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    sweeps: list[dict[str, Any]] = []
    for num_reqs in reqs:
        rs, cs, sw = bench_size(num_reqs, args, device, timer, bw, paths, sweep=num_reqs == max(reqs))
        results += rs
        checks.update(cs)
        sweeps += sw
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    ok = all(v["ok"] for v in checks.values())
    payload = {
        "device": device_name, "torch": torch.__version__, "paths": paths, "copy_bandwidth_gbps": bw,
        "k": args.k, "vocab": args.vocab, "dtypes": args.dtypes, "replays": args.replays,
        "floor_definition": "bytes the sampler must read (logits [T, V]; + R emit rows of draft_probs for "
                            "prob_q) / measured copy bandwidth (read + write bytes per second)",
        "stage_timing": "Triton prob / prob_q rows: <kind>_stages_us[finalize][launch] = median µs of that "
                        "launch alone (own graph, earlier launches replayed untimed before it), 'total' = the "
                        "whole plan in one graph; <kind>_us is the default (split) path through "
                        "rejection_sample",
        "shape_sweeps": sweeps,
        "graph_captured": device.type == "cuda", "results": results, "checks": checks, "ok": ok,
    }
    atomic_write_json(args.out / "core_step.json", payload)  # before rendering: a table bug loses nothing
    render(results, checks, sweeps, bw, device_name)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
