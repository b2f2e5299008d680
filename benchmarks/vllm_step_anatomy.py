"""Where a vLLM 0.33 decode step's time goes: no speculation, verify-all, and ours while paused (issue 6).

Section 14 of docs/PERFORMANCE.md found a paused ``draft_model`` step about 4 ms slower than a step of a server
without speculation (13.0 against 8.6 ms at 64 requests, Llama-3-8B shape), inferred from throughput. This
splits a step into its parts, inside the engine, so the next change cuts the right one:

* host time (``time.perf_counter``) of every runner phase: ``execute_model`` (``prepare_inputs`` in it),
  ``sample_tokens`` (the target's ``sample``, the speculator's ``propose``, its ``_prefill``,
  ``sample_draft`` and ``_multi_step_decode``) and our manager's hooks;
* device time (CUDA events) of ``execute_model`` (input staging and the target forward), the target forward
  alone, ``sample_tokens`` and the whole ``propose``, and the step interval (``execute_model`` to
  ``execute_model``, host clock): a step whose interval is well above its device spans leaves the GPU
  idle, waiting on the host;
* two ablations of a paused step, runtime switches in the worker: the draft kept current (the draft's
  prefill pass on every paused step, without its first-token sample: what ``draft_catchup_tokens: 0``
  serves, against the deferred catch-up served by default), and no draft work at all (benchmark-only: it
  leaves the draft's K/V stale; it is measured with drafting forced off, where nothing reads it).

One engine per config, in its own process, in vLLM's own ``LLM`` class with this module as the worker
extension (``collective_rpc`` by name). Each variant is one ``generate`` of ``-c`` prompts at once (steady
batch), weightless models (``--load-format dummy``), greedy, ``ignore_eos``. Usage on the GPU host (vLLM
installed, the plugin visible)::

    python3 benchmarks/vllm_step_anatomy.py --model TARGET --draft DRAFT --out OUT [-c 64] [--configs ...]

OUT gets ``<config>.json`` per config and ``anatomy.md`` (one table). The instrumentation
(:class:`StepAnatomy`) is CPU-tested on a stand-in runner (tests/test_vllm_step_anatomy.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = "benchmarks.vllm_step_anatomy.AnatomyExtension"

# Runner / speculator / manager methods timed on the host, by label (nested phases count in their parents).
RUNNER_PHASES = ("execute_model", "prepare_inputs", "sample_tokens", "sample")
SPECULATOR_PHASES = ("propose", "_prefill", "sample_draft", "_multi_step_decode")
MANAGER_PHASES = ("begin_drafting_step", "get_num_tokens", "reallocate_drafts", "record_confidences", "observe")
DEVICE_SPANS = ("execute", "sample_tokens", "forward", "propose")
LONG_STEP = 3.0  # a step interval over this many times its kind's median counts as long (the tail of the ITL)


@dataclass
class StepRecord:
    """One engine step, ``execute_model`` to the next ``execute_model``."""

    start: float
    interval_ms: float = 0.0
    num_reqs: int = 0
    num_tokens: int = 0
    max_query_len: int = 0
    drafting: bool | None = None  # the propose's num_speculative_tokens > 0 (None: no speculator)
    full_graph: bool = False
    host_ms: dict[str, float] = field(default_factory=dict)
    events: dict[str, list[Any]] = field(default_factory=dict)  # span -> [start event, end event]


class StepAnatomy:
    """Wrap a runner's bound methods (instance attributes shadow the class, the plugin's wrappers included).

    ``event_factory`` makes a CUDA-like event (``record()``, ``elapsed_time(other)``, ``synchronize()``);
    ``None`` times the host only (the CPU tests). Switches, read on every paused propose:
    ``skip_paused_sample`` (prefill without its sample) and ``skip_paused_draft`` (no draft work).
    """

    def __init__(self, runner: Any, clock: Callable[[], float] = time.perf_counter,
                 event_factory: Callable[[], Any] | None = None) -> None:
        self.runner = runner
        self.clock = clock
        self.event_factory = event_factory
        self.records: list[StepRecord] = []
        self.current: StepRecord | None = None
        self.skip_paused_sample = False
        self.skip_paused_draft = False
        self._paused_propose = False
        self.wrapped: list[str] = []

    # ------------------------------------------------------------------ installation
    def install(self) -> list[str]:
        r = self.runner
        for name in RUNNER_PHASES:
            self._wrap(r, name, f"runner.{name}")
        spec = getattr(r, "speculator", None)
        if spec is not None:
            for name in SPECULATOR_PHASES:
                self._wrap(spec, name, f"speculator.{name}")
        manager = getattr(r, "adaptive_verification", None)
        if manager is not None:
            for name in MANAGER_PHASES:
                self._wrap(manager, name, f"manager.{name}")
        graphs = getattr(r, "cudagraph_manager", None)
        if graphs is not None and hasattr(graphs, "run_fullgraph"):
            self._wrap(graphs, "run_fullgraph", "forward(full graph)")
        model = getattr(r, "model", None)
        if model is not None and hasattr(model, "register_forward_pre_hook"):
            model.register_forward_pre_hook(lambda *_: self._span_start("forward"))
            model.register_forward_hook(lambda *_: self._span_end("forward"))
            self.wrapped.append("model.forward hooks")
        return list(self.wrapped)

    def _wrap(self, obj: Any, name: str, label: str) -> None:
        original = getattr(obj, name, None)
        if original is None or not callable(original):
            return
        special = {"execute_model": self._execute_model, "sample_tokens": self._sample_tokens,
                   "propose": self._propose, "sample_draft": self._sample_draft,
                   "run_fullgraph": self._run_fullgraph}.get(name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = self.clock()
            try:
                if special is not None:
                    return special(original, *args, **kwargs)
                return original(*args, **kwargs)
            finally:
                rec = self.current
                if rec is not None:
                    rec.host_ms[label] = rec.host_ms.get(label, 0.0) + (self.clock() - t0) * 1e3

        setattr(obj, name, timed)
        self.wrapped.append(label)

    # ------------------------------------------------------------------ special phases
    def _execute_model(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        now = self.clock()
        if self.current is not None:
            self.current.interval_ms = (now - self.current.start) * 1e3
            self.records.append(self.current)
        self.current = StepRecord(start=now)
        with self._span("execute"):
            return original(*args, **kwargs)

    def _sample_tokens(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        rec = self.current
        state = getattr(self.runner, "execute_model_state", None)
        batch = getattr(state, "input_batch", None)
        if rec is not None and batch is not None:
            rec.num_reqs = int(batch.num_reqs)
            rec.num_tokens = int(batch.num_tokens)
            qsl = getattr(batch, "query_start_loc_np", None)
            if qsl is not None and rec.num_reqs > 0:
                rec.max_query_len = int(np.diff(np.asarray(qsl[: rec.num_reqs + 1])).max())
        with self._span("sample_tokens"):
            return original(*args, **kwargs)

    def _propose(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        k = kwargs.get("num_speculative_tokens")
        paused = k == 0 and not kwargs.get("dummy_run")
        if self.current is not None and not kwargs.get("dummy_run"):
            self.current.drafting = not paused
        with self._span("propose"):
            if paused and self.skip_paused_draft:
                batch = kwargs.get("input_batch", args[0] if args else None)
                return self.runner.speculator.draft_tokens[: int(batch.num_reqs)]
            self._paused_propose = paused
            try:
                return original(*args, **kwargs)
            finally:
                self._paused_propose = False

    def _sample_draft(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._paused_propose and self.skip_paused_sample:
            hidden = args[0] if args else kwargs["hidden_states"]
            return self.runner.speculator.draft_tokens[: int(hidden.shape[0]), 0]
        return original(*args, **kwargs)

    def _run_fullgraph(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.current is not None:
            self.current.full_graph = True
        with self._span("forward"):
            return original(*args, **kwargs)

    # ------------------------------------------------------------------ device spans
    @contextlib.contextmanager
    def _span(self, span: str) -> Iterator[None]:
        self._span_start(span)
        try:
            yield
        finally:
            self._span_end(span)

    def _span_start(self, span: str) -> None:
        if self.event_factory is None or self.current is None:
            return
        ev = self.event_factory()
        ev.record()
        self.current.events[span] = [ev]

    def _span_end(self, span: str) -> None:
        if self.event_factory is None or self.current is None:
            return
        pair = self.current.events.get(span)
        if pair is None or len(pair) != 1:
            return
        ev = self.event_factory()
        ev.record()
        pair.append(ev)

    # ------------------------------------------------------------------ windows
    def reset(self) -> None:
        self.records = []
        self.current = None

    def summary(self, steady_reqs: int, skip_first: int = 5, min_reqs: int | None = None) -> dict[str, Any]:
        """Medians by step kind over the steady decode steps -- ``min_reqs`` (default ``steady_reqs``) to
        ``steady_reqs`` requests, no prefill chunk, past the first few -- and over every step that ran a
        request (``all_steps``), with the share of those that carried a prefill chunk (a served closed loop
        refills as requests end; such a step is not a decode-only batch, so no FULL decode graph fits it)."""
        steps = self.records[skip_first:]
        k = int(getattr(getattr(self.runner, "speculator", None), "num_speculative_steps", 0) or 0)
        lo = steady_reqs if min_reqs is None else min_reqs
        steady = [s for s in steps if lo <= s.num_reqs <= steady_reqs and 0 < s.max_query_len <= 1 + k]
        busy = [s for s in steps if s.num_reqs > 0]
        prefill = sum(s.max_query_len > 1 + k for s in busy)
        return {"steps": len(steps), "steady_steps": len(steady), "by_kind": self._by_kind(steady),
                "all_steps": self._by_kind(busy),
                "prefill_share": round(prefill / len(busy), 3) if busy else None,
                "by_load": self._by_load(busy, k)}

    @staticmethod
    def _by_load(steps: list[StepRecord], k: int) -> list[dict[str, Any]]:
        """Steps and their time by how many requests they ran, in the policy's load buckets [2^(b-1), 2^b).

        A 256-request cell need not run 256 requests a step: if the server's API process lags the engine, the
        engine finishes requests before their clients see them, and it runs smaller batches (section 29's rise
        probes at 97 and 115 requests inside such cells). This says at what load a cell's time went."""
        buckets: dict[int, list[StepRecord]] = {}
        for s in steps:
            buckets.setdefault(int(s.num_reqs).bit_length(), []).append(s)
        rows = []
        for b in sorted(buckets):
            group = buckets[b]
            lo, hi = 1 << (b - 1), (1 << b) - 1
            rows.append({"load": str(lo) if lo == hi else f"{lo}-{hi}", "steps": len(group),
                         "time_s": round(sum(x.interval_ms for x in group) / 1e3, 3),
                         "drafting": sum(x.drafting is True for x in group),
                         "prefill": sum(x.max_query_len > 1 + k for x in group)})
        return rows

    def _by_kind(self, steps: list[StepRecord]) -> dict[str, Any]:
        def med(values: list[float]) -> float | None:
            return round(statistics.median(values), 3) if values else None

        by_kind: dict[str, Any] = {}
        for kind, sel in (("drafting", True), ("paused", False), ("nospec", None)):
            group = [s for s in steps if s.drafting is sel]
            if not group:
                continue
            labels = sorted({lb for s in group for lb in s.host_ms})
            device: dict[str, float | None] = {}
            for span in DEVICE_SPANS:
                vals = [s.events[span][0].elapsed_time(s.events[span][1]) for s in group
                        if len(s.events.get(span, ())) == 2]
                device[span] = med(vals)
            intervals = [s.interval_ms for s in group]
            typical = statistics.median(intervals)
            # Medians hide what a mean ITL pays for: a cell 18% slower than no speculation's at equal median
            # steps (section 29) had its loss in a few long intervals. Their count and time say how much.
            long = [v for v in intervals if v > LONG_STEP * typical]
            by_kind[kind] = {
                "steps": len(group),
                "interval_ms": med(intervals),
                "interval_p99_ms": round(float(np.percentile(intervals, 99)), 3),
                "interval_total_s": round(sum(intervals) / 1e3, 3),
                "long_steps": len(long),
                "long_total_s": round(sum(long) / 1e3, 3),
                "tokens": med([float(s.num_tokens) for s in group]),
                "full_graph_share": round(sum(s.full_graph for s in group) / len(group), 3),
                "host_ms": {lb: med([s.host_ms.get(lb, 0.0) for s in group]) for lb in labels},
                "device_ms": device,
            }
        return by_kind


def _flag(value: bool | str) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")


class AnatomyExtension:
    """vLLM worker extension: ``collective_rpc("anatomy_*")`` by name (see profile.SpsProfileExtension)."""

    def anatomy_install(self) -> list[str]:
        import torch

        events = (lambda: torch.cuda.Event(enable_timing=True)) if torch.cuda.is_available() else None
        anatomy = StepAnatomy(self.model_runner, event_factory=events)
        self._dspark_anatomy = anatomy
        return anatomy.install()

    # vLLM's dev endpoint (POST /collective_rpc, VLLM_SERVER_DEV_MODE=1) passes every argument as a string.
    def anatomy_begin(self, skip_paused_sample: bool | str = False, skip_paused_draft: bool | str = False,
                      keep_draft_current: bool | str = False) -> None:
        """Start a measured run. ``keep_draft_current``: our manager's deferred draft K/V upkeep is off for it
        (a paused step runs the draft's prefill pass, as ``draft_catchup_tokens: 0`` serves)."""
        a = self._dspark_anatomy
        a.reset()
        a.skip_paused_sample = _flag(skip_paused_sample)
        a.skip_paused_draft = _flag(skip_paused_draft)
        manager = getattr(self.model_runner, "adaptive_verification", None)
        if _flag(keep_draft_current) and getattr(manager, "_upkeep", None) is not None:
            self._dspark_stashed_upkeep = manager._upkeep
            manager._upkeep = None

    def anatomy_end(self, steady_reqs: int | str, min_reqs: int | str | None = None) -> dict[str, Any]:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # every span's events are complete before they are read
        a = self._dspark_anatomy
        out = a.summary(int(steady_reqs), min_reqs=None if min_reqs is None else int(min_reqs))
        a.skip_paused_sample = a.skip_paused_draft = False
        stashed = getattr(self, "_dspark_stashed_upkeep", None)
        if stashed is not None:
            self.model_runner.adaptive_verification._upkeep = stashed
            self._dspark_stashed_upkeep = None
        a.reset()
        return out


# ---------------------------------------------------------------------------------------------- configs

# Acceptance of vLLM's synthetic rejection sampler (conditional per position, V4-Flash-like), as
# benchmarks/vllm_h200.sh scaled: only the drafting config verifies anything.
RATES = (0.8, 0.7, 0.6, 0.5, 0.35, 0.2, 0.08)
# Drafting forced off for the whole run: every budget is refused (no predicted gain is that large), the
# pause starts after one step, and the probe timer never fires within a generate.
PAUSED = {"dspark_capacity_verification_mode": "varlen", "dspark_min_predicted_gain": 1e9,
          "dspark_saturation_patience": 1, "dspark_resume_every": 1_000_000}
# Variants per config: (name, anatomy_begin switches). "as served" pauses with the deferred draft K/V upkeep
# (engines.vllm.upkeep); "draft kept current" is the served path of draft_catchup_tokens 0 (the draft's prefill
# pass every paused step, without its sample: section 15's second row); "no draft work" skips the draft
# and never catches up (section 15's floor; benchmark-only).
VARIANTS: dict[str, list[tuple[str, dict[str, bool]]]] = {
    "nospec": [("as served", {})],
    "all": [("as served", {})],
    "paused": [("as served", {}), ("draft kept current", {"keep_draft_current": True}),
               ("no draft work", {"skip_paused_draft": True})],
    "mask-paused": [("as served", {})],
}


def capture_sizes(concurrency: int, k: int) -> list[int]:
    """Graphs for the batches measured only (a paused or plain step: one token per request; verify-all and
    a uniform mask step: 1 + k), so each engine starts in about a minute; a replay costs the same whatever
    else was captured. 64 requests, k=7: 64, 128, 256, 512."""
    return sorted({concurrency, 2 * concurrency, 4 * concurrency, (1 + k) * concurrency})


def unconditional(rates: tuple[float, ...]) -> list[float]:
    out, p = [], 1.0
    for r in rates:
        p *= r
        out.append(round(p, 6))
    return out


def spec_for(config: str, draft: str, k: int, curve: str | None) -> dict[str, Any] | None:
    base: dict[str, Any] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if config == "nospec":
        return None
    if config == "all":
        return {**base, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": unconditional(RATES)}
    paused = {**base, **PAUSED}
    if curve:
        paused["dspark_sps_curve"] = curve
    if config == "mask-paused":
        paused["dspark_capacity_verification_mode"] = "mask"
    return paused


def engine_argv(args: argparse.Namespace, config: str) -> list[str]:
    from dspark_cli.engines.vllm.launcher import plan_vllm_serve

    argv = [args.model, "--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--dtype", "bfloat16",
            "--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                                "cudagraph_capture_sizes": capture_sizes(args.concurrency,
                                                                                         args.k)}),
            "--no-enable-flashinfer-autotune", "--load-format", "dummy"]
    spec = spec_for(config, args.draft, args.k, args.sps_curve)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    return plan_vllm_serve(argv).argv


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """In the child process: build the engine, time each variant of the config, return the summaries."""
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.add_argument("model_tag", nargs="?")
    ns = parser.parse_args(engine_argv(args, args.run))
    ns.model = ns.model_tag or ns.model
    eargs = EngineArgs.from_cli_args(ns)
    eargs.worker_extension_cls = EXTENSION
    t0 = time.perf_counter()
    llm = LLM(**{k: v for k, v in vars(eargs).items() if not k.startswith("_")})
    startup = time.perf_counter() - t0
    wrapped = llm.collective_rpc("anatomy_install")[0]
    c = args.concurrency
    vocab = 32000
    prompts = [{"prompt_token_ids": [(1000 + 7919 * (i * args.input_len + j)) % vocab
                                     for j in range(args.input_len)]} for i in range(c)]
    sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0), use_tqdm=False)
    variants = []
    for name, switches in VARIANTS[args.run]:
        llm.collective_rpc("anatomy_begin", kwargs=switches)
        t = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        summary = llm.collective_rpc("anatomy_end", kwargs={"steady_reqs": c})[0]
        variants.append({"variant": name, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1), **summary})
        print(f"{args.run} / {name}: {tokens / wall:.0f} tok/s, {summary['steady_steps']} steady steps", flush=True)
    return {"config": args.run, "startup_s": round(startup, 1), "wrapped": wrapped, "concurrency": c,
            "argv": engine_argv(args, args.run), "variants": variants}


# ---------------------------------------------------------------------------------------------- report

HOST_COLUMNS = (("execute", "runner.execute_model"), ("prepare", "runner.prepare_inputs"),
                ("sample_tokens", "runner.sample_tokens"), ("target sample", "runner.sample"),
                ("propose", "speculator.propose"), ("draft prefill", "speculator._prefill"),
                ("draft samples", "speculator.sample_draft"), ("draft decode", "speculator._multi_step_decode"))


def manager_ms(host: dict[str, float | None]) -> float:
    return round(sum(v or 0.0 for k, v in host.items() if k.startswith("manager.")), 3)


def table(results: list[dict[str, Any]]) -> str:
    head = ["config", "variant", "kind", "steps", "tok/s", "interval", "p99", "total s", "long (>3x)",
            "execute (dev)", "forward (dev)", "sample_tokens (dev)", "propose (dev)",
            *(c for c, _ in HOST_COLUMNS), "our hooks", "full graph"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for res in results:
        for var in res["variants"]:
            for kind, s in var["by_kind"].items():
                host, dev = s["host_ms"], s["device_ms"]
                row = [res["config"], var["variant"], kind, str(s["steps"]), f"{var['tok_s']:.0f}",
                       fmt(s["interval_ms"]), fmt(s.get("interval_p99_ms")), fmt(s.get("interval_total_s")),
                       # results recorded before the tail was kept read "-"
                       "-" if "long_steps" not in s else f"{s['long_steps']} / {s['long_total_s']:.2f} s",
                       fmt(dev.get("execute")), fmt(dev.get("forward")),
                       fmt(dev.get("sample_tokens")), fmt(dev.get("propose")),
                       *(fmt(host.get(label)) for _, label in HOST_COLUMNS), fmt(manager_ms(host)),
                       f"{s['full_graph_share']:.2f}"]
                lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def load_table(results: list[dict[str, Any]]) -> str:
    """Every step that ran a request, by load: how many, their time, how many drafted and carried a prompt chunk."""
    lines = ["| config | load | steps | time s | share of time | drafting | with a prompt chunk |", "|" + "---|" * 7]
    for res in results:
        for var in res["variants"]:
            rows = var.get("by_load") or []
            total = sum(r["time_s"] for r in rows) or 1.0
            for r in rows:
                lines.append(f"| {res['config']} | {r['load']} | {r['steps']} | {r['time_s']:.2f} | "
                             f"{r['time_s'] / total:.0%} | {r['drafting']} | {r['prefill']} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _log(path: Path) -> Iterator[Any]:
    with path.open("w") as fh:
        yield fh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--configs", default="nospec,paused,all")
    ap.add_argument("-c", "--concurrency", type=int, default=64)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=384)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--sps-curve", default=None, help="sps_curve.json for the paused configs (skips vLLM's start-up profile)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per config (start-up included)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # child: one config
    args = ap.parse_args(argv)
    if args.run is not None:
        res = run_config(args)
        (args.out / f"{args.run}.json").write_bytes(json.dumps(res, indent=1).encode())
        return 0
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in VARIANTS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {sorted(VARIANTS)}")
    if len(RATES) != args.k:
        ap.error(f"the synthetic rates are for k={len(RATES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from benchmarks.vllm_adaptive import _entry_point_dir

    env = dict(os.environ)  # the plugin's entry point and this module visible in the engine's processes
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(_entry_point_dir(args.out / "entry_points")),
                                         env.get("PYTHONPATH", "")])
    results = []
    for config in configs:
        child = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
                 "--run", config]
        t = time.perf_counter()
        with _log(args.out / f"{config}.log") as log:
            try:
                rc = subprocess.run(child, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                    cwd=ROOT, env=env).returncode
            except subprocess.TimeoutExpired:
                rc = -1
        print(f"{config}: rc={rc} in {time.perf_counter() - t:.0f} s", flush=True)
        path = args.out / f"{config}.json"
        if rc == 0 and path.exists():
            results.append(json.loads(path.read_text()))
            (args.out / "anatomy.md").write_text(table(results))
    if results:
        print(table(results))
    return 0 if len(results) == len(configs) else 1


if __name__ == "__main__":
    sys.exit(main())
