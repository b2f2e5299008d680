"""Where a saturation probe's time goes: the slowest decode steps of a closed loop, op by op, under torch.profiler.

A closed loop like ``dspark bench`` (``--concurrency`` clients, seeded requests at ``--temperature``, ignore-eos,
each finished request replaced at once) runs one untimed wave, as the matrix warms a server, then
``--waves`` waves under ``torch.profiler``, each ``engine.step()`` inside its own ``record_function``. The
script then prints:

* per step kind (spec, probe, paused, prefill): steps, median and max wall ms, and the kernel compiles the
  engine's stall watch saw while serving;
* for the ``--top`` slowest decode steps (probes first): the ops that took their time, by self CPU time
  and device time, and the CUDA runtime calls among them, such as module loads, mallocs and syncs.

On the real setup's H200 cells, probes of the configurations without STS lost 150-250 ms each
(docs/PERFORMANCE.md section 11); this names what they waited on.

    python3 benchmarks/probe_profile.py --out OUT                       # CUDA: SmolLM2 shape, c=16, T=1
    python3 benchmarks/probe_profile.py --model smollm2-135m --draft auto --out OUT   # the real pair
    python3 benchmarks/probe_profile.py --quick --out /tmp/probe        # CPU smoke run
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.fileio import atomic_write_bytes

CURVE = Path(__file__).resolve().parent / "results" / "h200" / "embedded_matrix" / "2026-12-01" / "real" / "sps_curve.json"
STEP = "dspark_step_"


def _closed_loop(engine: LLMEngine, prompts: list[list[int]], conc: int, total: int, max_tokens: int,
                 temperature: float, first_id: int, wrap: bool) -> list[dict[str, Any]]:
    """Run ``total`` requests with ``conc`` in flight; one record per engine step (kind, wall ms, requests)."""
    sent = 0
    steps: list[dict[str, Any]] = []

    def send() -> None:
        nonlocal sent
        rid = first_id + sent
        engine.add_request(f"r{rid}", prompts[rid % len(prompts)],
                           SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                          seed=rid if temperature > 0 else None))
        sent += 1

    for _ in range(min(conc, total)):
        send()
    while engine.has_unfinished_requests():
        i = len(steps)
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        t0 = time.perf_counter()
        if wrap:
            with record_function(f"{STEP}{i}"):
                outs = engine.step()
        else:
            outs = engine.step()
        steps.append({"step": i, "kind": engine.stalls.step_kind, "ms": (time.perf_counter() - t0) * 1e3,
                      "requests": running})
        for _ in range(sum(o.finished for o in outs)):
            if sent < total:
                send()
    return steps


def _device_us(ev: Any) -> float:
    us = getattr(ev, "self_device_time_total", None)  # torch >= 2.4; self_cuda_time_total before
    return float(us if us is not None else getattr(ev, "self_cuda_time_total", 0.0))


def _ops_in_windows(events: list[Any], windows: dict[int, tuple[float, float]]) -> dict[int, dict[str, list[float]]]:
    """Per step: op name -> [calls, self CPU us, self device us] of the events that started inside its window.

    Steps run one after another, so windows do not overlap: each event belongs to the last window that
    started before it, if it had not ended yet."""
    order = sorted((w[0], w[1], i) for i, w in windows.items())
    begins = [w[0] for w in order]
    out: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0.0]))
    for ev in events:
        if ev.name.startswith(STEP):
            continue
        t = ev.time_range.start
        at = bisect.bisect_right(begins, t) - 1
        if at < 0 or t > order[at][1]:
            continue
        rec = out[order[at][2]][ev.name]
        rec[0] += 1
        rec[1] += float(ev.self_cpu_time_total)
        rec[2] += _device_us(ev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--draft", default="random:small:layers=4")
    ap.add_argument("--sps-curve", type=Path, default=CURVE)
    ap.add_argument("--mode", default="varlen", choices=["mask", "varlen"])
    ap.add_argument("-k", type=int, default=7)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=6, help="slowest decode steps to break down")
    ap.add_argument("--trace", action="store_true", help="also write the Chrome trace (large)")
    ap.add_argument("--quick", action="store_true", help="small random shapes and a made-up curve (CPU smoke run)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    curve = args.sps_curve
    if args.quick:
        args.model, args.draft, args.k, args.concurrency, args.waves, args.max_tokens, args.prompt_len = (
            "random:smollm2-135m:layers=2", "random:small:layers=1", 3, 4, 2, 24, 16)
        curve = args.out / "quick_curve.json"
        SpsCurve.from_points([(1, 1.0), (8, 1.1), (64, 2.0)], [(1, 5.0), (8, 5.0)], 0.2).save(curve)
    engine = LLMEngine(EngineConfig(
        model=args.model, draft=args.draft, num_speculative_tokens=args.k, device=device,
        dtype="bfloat16" if device == "cuda" else "float32", max_num_seqs=256 if not args.quick else 8,
        sps_curve=str(curve), capacity=CapacityConfig(mode=args.mode), seed=0,
    ))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, engine.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(64)]
    total = args.waves * args.concurrency
    _closed_loop(engine, prompts, args.concurrency, args.concurrency, args.max_tokens, args.temperature, 10_000,
                 wrap=False)  # untimed wave
    compiles_before = dict(engine.stalls.counters.compiles_by_step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        steps = _closed_loop(engine, prompts, args.concurrency, total, args.max_tokens, args.temperature, 0, wrap=True)
        if device == "cuda":
            torch.cuda.synchronize()
    events = list(prof.events())
    windows = {int(ev.name[len(STEP):]): (ev.time_range.start, ev.time_range.end)
               for ev in events if ev.name.startswith(STEP)}
    decode = [s for s in steps if s["kind"] in ("spec", "probe", "paused")]
    slow = sorted(decode, key=lambda s: (s["kind"] != "probe", -s["ms"]))[: args.top]
    ops = _ops_in_windows(events, {s["step"]: windows[s["step"]] for s in slow if s["step"] in windows})
    kinds = {}
    for kind in sorted({s["kind"] for s in steps}):
        ms = [s["ms"] for s in steps if s["kind"] == kind]
        kinds[kind] = {"steps": len(ms), "median_ms": statistics.median(ms), "max_ms": max(ms)}
    compiles = {k: v - compiles_before.get(k, 0) for k, v in engine.stalls.counters.compiles_by_step.items()}
    breakdown = []
    for s in slow:
        per = ops.get(s["step"], {})
        top_cpu = sorted(per.items(), key=lambda kv: -kv[1][1])[:8]
        top_dev = sorted(per.items(), key=lambda kv: -kv[1][2])[:5]
        runtime = sorted(((n, v) for n, v in per.items() if n.startswith(("cuda", "cu"))), key=lambda kv: -kv[1][1])[:6]
        breakdown.append({**s, "top_cpu": [(n, v[0], v[1] / 1e3) for n, v in top_cpu],
                          "top_device": [(n, v[0], v[2] / 1e3) for n, v in top_dev],
                          "runtime_calls": [(n, v[0], v[1] / 1e3) for n, v in runtime]})
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device, "kinds": kinds,
              "serving_compiles_by_step": compiles, "slowest": breakdown, "steps": steps}
    atomic_write_bytes(args.out / "probe_profile.json", orjson.dumps(report))
    if args.trace:
        prof.export_chrome_trace(str(args.out / "trace.json"))

    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    t = Table(title=f"decode steps by kind ({args.model} + {args.draft}, k={args.k}, c={args.concurrency}, "
                    f"{args.waves} waves x {args.max_tokens} tokens, T={args.temperature:g}, {device})")
    for col in ("kind", "steps", "median ms", "max ms", "compiles while serving"):
        t.add_column(col, justify="right")
    for kind, v in kinds.items():
        t.add_row(kind, str(v["steps"]), f"{v['median_ms']:.2f}", f"{v['max_ms']:.2f}", str(compiles.get(kind, 0)))
    console.print(t)
    for b in breakdown:
        t = Table(title=f"step {b['step']} ({b['kind']}, {b['requests']} requests): {b['ms']:.1f} ms")
        for col in ("op (self CPU)", "calls", "ms", "op (device)", "calls ", "ms "):
            t.add_column(col)
        for i in range(max(len(b["top_cpu"]), len(b["top_device"]))):
            c = b["top_cpu"][i] if i < len(b["top_cpu"]) else ("", "", 0.0)
            d = b["top_device"][i] if i < len(b["top_device"]) else ("", "", 0.0)
            t.add_row(c[0][:60], str(c[1]), f"{c[2]:.2f}" if c[0] else "", d[0][:60], str(d[1]),
                      f"{d[2]:.2f}" if d[0] else "")
        console.print(t)
        if b["runtime_calls"]:
            console.print("  runtime calls: " + ", ".join(f"{n} x{c} {ms:.2f} ms" for n, c, ms in b["runtime_calls"]))
    console.print(f"written: {args.out / 'probe_profile.json'}")


if __name__ == "__main__":
    main()
