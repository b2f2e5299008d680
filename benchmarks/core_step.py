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

For the Triton sampler it then times, at every R and dtype, every kernel variant of
``_triton_rejection.SWEEP_VARIANTS`` (``--variants``): each launch on its own (each in its own graph, the
launches before it replayed untimed first so its inputs and the L2 state are those of a real step) and the
whole plan in one graph, for the greedy (row-kernel variants only), one-hot-q and real-q samplers. Row-kernel
variants keep the default emit kernels and vice versa, so the best of each side is also timed together.
Every variant's tokens are compared with the torch sampler on the same inputs (part of the triton_vs_torch
check), and a table names the fastest variant per (R, dtype, kind) next to the default. All variants are
compiled up front on a thread pool, so one run fits in a few minutes.

Timed sampler replays use the full budget (every row real): that is the captured size's worst case.

    python benchmarks/core_step.py --out results/core_step            # CUDA: the full proof
    python benchmarks/core_step.py --device cpu --quick --out /tmp/x  # CPU smoke run (eager, tiny sizes)
    TRITON_INTERPRET=1 python benchmarks/core_step.py --device cpu --quick --paths torch,triton --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark_cli.core import _triton_rejection
from dspark_cli.core._triton_rejection import SamplerPlan
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
    res["ok"] = (res["alloc_equal"] and res["layout_equal"] and res["greedy_count"] == 0
                 and res["prob_count"] <= 1 and res["prob_q_count"] <= 1)
    return res


def sampler_kinds(b: Buffers) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "greedy": {},
        "prob": {"temperature": b.temperature, "uniforms": b.uniforms},
        "prob_q": {"temperature": b.temperature, "uniforms": b.uniforms, "draft_probs": b.draft_probs},
    }


def sampler_plan(b: Buffers, lay: VerifyLayout, admitted: torch.Tensor, kw: dict[str, torch.Tensor],
                 **knobs: Any) -> SamplerPlan:
    return _triton_rejection.plan_rejection_sample(
        b.logits, lay.req_index, lay.pos_in_req, ~lay.is_padding, b.drafts, admitted, kw.get("temperature"),
        kw.get("draft_probs"), kw.get("uniforms"), **knobs)


def time_stages(plan: SamplerPlan, b: Buffers, device: torch.device, timer: Timer, replays: int,
                gen: torch.Generator) -> dict[str, float]:
    """Median µs of every launch of a Triton sampler plan on its own, and of the whole plan ("total").

    Each launch is its own graph; before each timed replay the logits get new values and the launches
    before it replay untimed, so it reads what a real step hands it (and the L2 holds what it would).
    """
    plan.run()  # every scratch buffer valid before any stage replays on its own
    graphs = [(name, capture(fn, device)[0]) for name, fn in plan.stages]
    out: dict[str, float] = {}
    for i, (name, replay) in enumerate(graphs):
        prefix = [g for _, g in graphs[:i]]

        def update(_: int, prefix: list[Callable[[], None]] = prefix) -> None:
            b.logits.normal_(generator=gen)
            for g in prefix:
                g()

        out[name] = timer.median_us(replay, update, replays)
    total, _ = capture(plan.run, device)
    out["total"] = timer.median_us(total, lambda i: b.logits.normal_(generator=gen), replays)
    return out


def variant_names(kind: str, names: list[str]) -> list[str]:
    """Greedy runs no emit kernels: there only the row-kernel variants differ from the default."""
    return [n for n in names if kind != "greedy" or n == "default" or n.startswith("row:")]


def precompile(plans: list[SamplerPlan], device: torch.device) -> float:
    """Compile every launch of ``plans`` up front, many at once; returns the seconds it took.

    Compiles (tens per batch size and dtype) would otherwise dominate the sweep's wall time. Triton's
    asynchronous compile mode runs them on a thread pool; without it they compile one by one here.
    """
    if device.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    try:
        from triton.runtime._async_compile import AsyncCompileMode

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool, AsyncCompileMode(pool):
            for plan in plans:
                plan.precompile()
    except (ImportError, AttributeError, TypeError) as exc:  # another triton: the launches compile lazily
        print(f"parallel precompile unavailable ({exc!r}); kernels compile on first use", file=sys.stderr)
    return time.perf_counter() - t0


ROW_SIDE = ("default", "row:")  # variants that change the row kernel (or nothing)
TILE_SIDE = ("default", "tile:", "emit:")  # variants that change the emit kernels


def _side_best(rows: list[dict[str, Any]], prefixes: tuple[str, ...]) -> dict[str, Any]:
    return min((r for r in rows if r["variant"].startswith(prefixes)), key=lambda r: r["stages_us"]["total"])


def variant_plans(b: Buffers, lay: VerifyLayout, admitted: torch.Tensor,
                  names: list[str]) -> dict[tuple[str, str], SamplerPlan]:
    kinds = sampler_kinds(b)
    return {(kind, name): sampler_plan(b, lay, admitted, kinds[kind], **_triton_rejection.SWEEP_VARIANTS[name])
            for kind in kinds for name in variant_names(kind, names)}


def sweep_variants(b: Buffers, lay: VerifyLayout, admitted: torch.Tensor, dname: str, names: list[str],
                   floors: dict[str, float], device: torch.device, timer: Timer, replays: int,
                   gen: torch.Generator) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every kernel variant x sampler kind: medians per launch and in total, and tokens vs the torch sampler.

    The row-kernel variants keep the default emit kernels and vice versa, so the stages are separable: the
    best row-side and the best emit-side variant are then also timed together ("combo:"). ``diff_vs_torch``
    counts requests whose tokens differ from the torch path on the same inputs: greedy must be 0; sampled
    may differ at the accept test (p(x) round-off, about one row in a million): more than 1 is a defect.
    """
    kinds = sampler_kinds(b)
    plans = variant_plans(b, lay, admitted, names)
    compile_s = precompile(list(plans.values()), device)  # normally all cached by bench_size already
    refs = {kind: rejection_sample(b.logits, lay, b.drafts, admitted, use_triton=False, **kw).tokens
            for kind, kw in kinds.items()}
    diffs = {key: int((plan.run()[0] != refs[key[0]]).any(dim=1).sum()) for key, plan in plans.items()}
    out: list[dict[str, Any]] = []

    def record(kind: str, name: str, plan: SamplerPlan, knobs: dict[str, Any], diff: int) -> None:
        times = time_stages(plan, b, device, timer, replays, gen)
        out.append({"R": admitted.shape[0], "dtype": dname, "kind": kind, "variant": name, "knobs": knobs,
                    "config": plan.config, "stages_us": times, "x_floor": times["total"] / floors[kind],
                    "diff_vs_torch": diff})

    t0 = time.perf_counter()
    for (kind, name), plan in plans.items():
        record(kind, name, plan, _triton_rejection.SWEEP_VARIANTS[name], diffs[(kind, name)])
    for kind in ("prob", "prob_q"):
        rows = [r for r in out if r["kind"] == kind]
        if not rows:
            continue
        best_row, best_tile = _side_best(rows, ROW_SIDE), _side_best(rows, TILE_SIDE)
        if best_row["variant"] == "default" or best_tile["variant"] == "default":
            continue  # the combination is one of the timed variants already
        knobs = {**best_row["knobs"], **best_tile["knobs"]}
        plan = sampler_plan(b, lay, admitted, kinds[kind], **knobs)
        ref = rejection_sample(b.logits, lay, b.drafts, admitted, use_triton=False, **kinds[kind]).tokens
        diff = int((plan.run()[0] != ref).any(dim=1).sum())
        diffs[(kind, "combo")] = diff
        record(kind, f"combo:{best_row['variant']}+{best_tile['variant']}", plan, knobs, diff)
    bad = {f"{kind}/{name}": d for (kind, name), d in diffs.items() if d > (0 if kind == "greedy" else 1)}
    check = {"variants": len(diffs), "variants_differing": {f"{k}/{n}": d for (k, n), d in diffs.items() if d},
             "variants_failed": bad, "compile_s": compile_s, "sweep_s": time.perf_counter() - t0}
    return out, check


def bench_size(num_reqs: int, args: argparse.Namespace, device: torch.device, timer: Timer, bw: float,
               paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
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
        sweep_check: dict[str, Any] | None = None

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
        compile_s = 0.0
        if "triton" in paths:
            # Every kernel this (R, dtype) will launch -- the default sampler in the graphs below and every
            # sweep variant -- compiled up front and in parallel (the shapes match the full-budget layout).
            admitted, lay = alloc_layout(b, rows, True)
            compile_s = precompile(list(variant_plans(b, lay, admitted, args.variants).values()), device)
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
                floors = {kind: row[f"{kind}_floor_us"] for kind in kinds}
                sw, sweep_check = sweep_variants(b, lay, admitted, dname, args.variants, floors, device, timer,
                                                 args.sweep_replays, gen)
                sweep_check["compile_s"] += compile_s
                for r in sw:
                    r["T"] = rows
                sweeps += sw
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results.append(row)
        if "triton" in paths:
            cmp = compare_paths(b, rows, k, gen, rng)
            if sweep_check is not None:  # every timed kernel variant must keep the contract too
                cmp.update(sweep_check)
                cmp["ok"] = cmp["ok"] and not sweep_check["variants_failed"]
            checks[f"R{num_reqs}/{dname}/triton_vs_torch"] = cmp
        del b
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results, checks, sweeps


STAGE_COLUMNS = ("row", "combine", "tile_e", "tile_res", "final")


def _stage_cells(st: dict[str, float]) -> list[str]:
    return [f"{st[c]:.1f}" if c in st else "-" for c in STAGE_COLUMNS]


def winners(sweeps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (R, dtype, kind): the default variant and the fastest one (whole plan), with their stage times."""
    out = []
    keys = dict.fromkeys((r["R"], r["dtype"], r["kind"]) for r in sweeps)
    for key in keys:
        rows = [r for r in sweeps if (r["R"], r["dtype"], r["kind"]) == key]
        default = next(r for r in rows if r["variant"] == "default")
        best = min(rows, key=lambda r: r["stages_us"]["total"])
        out.append({"R": key[0], "T": default.get("T"), "dtype": key[1], "kind": key[2],
                    "floor_us": default["stages_us"]["total"] / default["x_floor"],
                    "default": default, "winner": best, "variants_timed": len(rows)})
    return out


def render(results: list[dict[str, Any]], checks: dict[str, Any], sweeps: list[dict[str, Any]], bw: float,
           device_name: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain fallback keeps the script usable in a bare environment
        for r in results:
            print(r)
        for r in winners(sweeps):
            print(r["R"], r["dtype"], r["kind"], r["winner"]["variant"], r["winner"]["stages_us"])
        for k, v in checks.items():
            print(k, v)
        return
    con = Console(width=170)
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
    won = winners(sweeps)
    if won:
        table = Table(title="Triton sampler: default vs fastest variant per (R, dtype, kind) -- median µs of the "
                            "whole plan in one graph (x floor), and the winner's launches, each in its own graph")
        for col in ("R", "dtype", "kind", "floor", "default", "winner", "winner total", "winner launches"):
            table.add_column(col, justify="right")
        for w in won:
            d, b = w["default"], w["winner"]
            launches = ", ".join(f"{c} {v:.1f}" for c, v in b["stages_us"].items() if c != "total")
            table.add_row(str(w["R"]), w["dtype"], w["kind"], f"{w['floor_us']:.1f}",
                          f"{d['stages_us']['total']:.1f} ({d['x_floor']:.2f}x)", b["variant"],
                          f"{b['stages_us']['total']:.1f} ({b['x_floor']:.2f}x)", launches)
        con.print(table)
        top = max(r["R"] for r in sweeps)
        table = Table(title=f"every variant at R={top} (median µs per launch; total = whole plan, x its floor; "
                            "diff = requests whose tokens differ from torch)")
        for col in ("dtype", "kind", "variant", *STAGE_COLUMNS, "total (x floor)", "diff"):
            table.add_column(col, justify="right")
        for r in sweeps:
            if r["R"] == top:
                table.add_row(r["dtype"], r["kind"], r["variant"], *_stage_cells(r["stages_us"]),
                              f"{r['stages_us']['total']:.1f} ({r['x_floor']:.2f}x)", str(r["diff_vs_torch"]))
        con.print(table)
        spent = [(v.get("compile_s", 0.0), v.get("sweep_s", 0.0)) for v in checks.values() if "compile_s" in v]
        con.print(f"variant sweep: compiles {sum(c for c, _ in spent):.0f} s, timing {sum(t for _, t in spent):.0f} s")
    bad = {k: v for k, v in checks.items() if not v["ok"]}
    con.print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok" + ("" if not bad else f"  FAILED: {bad}"))


def division_check(device: torch.device) -> dict[str, Any]:
    """The emit kernels' fast division against torch's IEEE division, bitwise, on 4M floats x 11 divisors."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = 1 << 22
    a = ((torch.rand(n, device=device, generator=gen) + 1.0)
         * torch.exp2(torch.randint(-96, 64, (n,), device=device, generator=gen).float()))
    a = torch.where(torch.rand(n, device=device, generator=gen) < 0.5, -a, a)
    a[:4096] = torch.randn(4096, device=device, generator=gen) * 8  # logit-like
    a[4096:4101] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], device=device)
    edges = torch.exp2(torch.arange(-40, 40, device=device).float())
    a[8192:8192 + edges.numel()] = torch.nextafter(edges, torch.zeros_like(edges))
    out = torch.empty_like(a)
    bad = 0
    for b in (0.05, 0.3, 0.7, 0.9999999, 1.0, 1.3, 2.0, 1.9999999, 37.5, 12345.678, 49152.0):
        _triton_rejection.probe_division(a, b, out)
        ref = a / torch.tensor(b, dtype=torch.float32, device=device)
        bad += int((~((out == ref) | (out.isnan() & ref.isnan()))).sum())
    return {"values": 11 * n, "mismatches": bad, "ok": bad == 0}


QUICK_VARIANTS = "default,row:split2,tile:1024x4"  # the CPU interpreter is slow: one of each kind of change


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
    ap.add_argument("--sweep-replays", type=int, default=100, help="replays per launch of every sweep variant")
    ap.add_argument("--check-replays", type=int, default=20)
    ap.add_argument("--paths", default="auto", help="torch, triton or auto (both when triton runs here)")
    ap.add_argument("--variants", default=None,
                    help="Triton sampler variants timed at every R: 'all' (the default; --quick: "
                         f"{QUICK_VARIANTS}) or names from {sorted(_triton_rejection.SWEEP_VARIANTS)}; "
                         "'default' is always timed")
    args = ap.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no CUDA device is visible", file=sys.stderr)
        return 1
    reqs = [int(x) for x in args.reqs.split(",")]
    variants = args.variants if args.variants is not None else (QUICK_VARIANTS if args.quick else "all")
    names = list(_triton_rejection.SWEEP_VARIANTS) if variants == "all" else [
        v.strip() for v in variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in _triton_rejection.SWEEP_VARIANTS]
    if unknown:
        print(f"--variants: unknown {unknown}; known: {sorted(_triton_rejection.SWEEP_VARIANTS)}", file=sys.stderr)
        return 1
    args.variants = list(dict.fromkeys(["default", *names]))
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    if any(d not in DTYPES for d in args.dtypes):
        print(f"--dtypes must be among {sorted(DTYPES)}", file=sys.stderr)
        return 1
    if args.quick:
        reqs = [r for r in reqs if r <= 8] or [1, 8]
        args.vocab = min(args.vocab, 1000)
        args.replays = min(args.replays, 10)
        args.sweep_replays = min(args.sweep_replays, 1)
        args.check_replays = min(args.check_replays, 3)
    paths = ["torch", "triton"] if args.paths == "auto" and _triton_ok(device) else (
        ["torch"] if args.paths == "auto" else [p.strip() for p in args.paths.split(",")])
    torch.manual_seed(0)
    timer = Timer(device)
    started = time.perf_counter()
    bw = copy_bandwidth_gbps(device, timer, args.quick)
    results: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    sweeps: list[dict[str, Any]] = []
    for num_reqs in reqs:
        rs, cs, sw = bench_size(num_reqs, args, device, timer, bw, paths)
        results += rs
        checks.update(cs)
        sweeps += sw
    division = division_check(device) if device.type == "cuda" and "triton" in paths else None
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    ok = all(v["ok"] for v in checks.values()) and (division is None or division["ok"])
    payload = {
        "device": device_name, "torch": torch.__version__, "paths": paths, "copy_bandwidth_gbps": bw,
        "k": args.k, "vocab": args.vocab, "dtypes": args.dtypes, "replays": args.replays,
        "sweep_replays": args.sweep_replays, "wall_s": time.perf_counter() - started,
        "floor_definition": "bytes the sampler must read (logits [T, V]; + R emit rows of draft_probs for "
                            "prob_q) / measured copy bandwidth (read + write bytes per second)",
        "stage_timing": "variant_sweep[i].stages_us[launch] = median µs of that launch alone (own graph, earlier "
                        "launches replayed untimed before it), 'total' = the whole plan in one graph (plan built "
                        "once: its zeroed slot scratch is not re-zeroed by a memset); results[i].<kind>_us = the "
                        "default through rejection_sample, captured with its allocations",
        "variant_sweep": sweeps, "winners": [
            {**{k: v for k, v in w.items() if k not in ("default", "winner")}, "default_total_us":
             w["default"]["stages_us"]["total"], "default_x_floor": w["default"]["x_floor"],
             "winner": w["winner"]["variant"], "winner_knobs": w["winner"]["knobs"],
             "winner_stages_us": w["winner"]["stages_us"], "winner_x_floor": w["winner"]["x_floor"]}
            for w in winners(sweeps)],
        "fast_division": division, "graph_captured": device.type == "cuda", "results": results, "checks": checks,
        "ok": ok,
    }
    atomic_write_json(args.out / "core_step.json", payload)  # before rendering: a table bug loses nothing
    render(results, checks, sweeps, bw, device_name)
    if division is not None:
        print(f"fast emit division vs torch: {division['mismatches']} of {division['values']} values differ")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
