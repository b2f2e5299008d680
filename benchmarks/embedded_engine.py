"""Check and time the embedded engine on one device (CUDA graphs, lossless modes, host syncs, step costs).

Random-weight checkpoints are built in a temporary folder (no hub, nothing to bring): weights do not change
step costs, and losslessness must hold for any weights.

1. **lossless** -- a tiny target and a noisy copy as draft, float32: greedy outputs of no speculation
   (eager) against capacity none / mask / varlen with CUDA graphs, and varlen eager. A curve with a steep
   riser makes varlen trim and a budget cap makes mask prune, so the check is not vacuous
   (``verified < drafted``).
2. **syncs** (CUDA) -- ``torch.cuda.set_sync_debug_mode("warn")`` over warm decode steps of a varlen engine;
   every synchronising call site is counted. The step's output copy (tokens, counts) is the expected one.
3. **steps** -- the served shape (SmolLM2-135M target, 4-layer draft, K=7, max_num_seqs 256, bf16 on CUDA)
   for nospec / capacity none / varlen (the profiled H200 curve of this shape) at 16 and 256 concurrent
   requests: where a decode step's time goes, phase by phase (``EngineStats.phase_ms``), once without
   added syncs (host cost; device time shows up in the one D2H wait), once with a sync per phase and, on
   CUDA, once with an event per phase (each phase's span of the device timeline, no added syncs). The
   draft is random, so acceptance is ~0: this measures the engine's costs and the capacity manager backing
   off (saturation), not speculative gains. About 2-3 minutes on an H200. ``--shape llama-3-8b`` times the
   scaled setup instead (Llama-3-8B shape, the synthetic drafter's V4-Flash-like acceptance, its H200
   curve): there "plan" + "layout" in gpu timing is the capacity manager's scheduling overhead under load.

    python benchmarks/embedded_engine.py --out benchmarks/results/embedded_engine   # CUDA: everything
    python benchmarks/embedded_engine.py --quick --out /tmp/embedded                  # CPU smoke run
    python benchmarks/embedded_engine.py --shape llama-3-8b --out OUT                # scheduling overhead, 8B
    python benchmarks/embedded_engine.py --steps-only --temperature 1 --configs nospec,mask,varlen \
        --concurrency 16,64,128,256 --out OUT       # paused steps beside plain ones, engine alone
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.sequence import SamplingParams


def _tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _save_llama(path: Path, tok: Any, noise_from: Any = None, **cfg: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    if noise_from is not None:
        model.load_state_dict({k: v + 0.01 * torch.randn_like(v) for k, v in noise_from.state_dict().items()})
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def build_tiny(root: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    tok = _tokenizer(128)
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.15, eos_token_id=2,
               tie_word_embeddings=False)
    target = _save_llama(root / "tiny_target", tok, **cfg)
    _save_llama(root / "tiny_draft", tok, noise_from=target, **cfg)
    return root / "tiny_target", root / "tiny_draft"


def _prompts(n: int, vocab: int, length: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def check_lossless(root: Path, device: str, quick: bool) -> dict[str, Any]:
    target, draft = build_tiny(root)
    curve = SpsCurve.from_points([(4, 1.0), (8, 1.0), (16, 1.2), (32, 3.0), (64, 6.0), (256, 20.0)],
                                 [(1, 0.2), (64, 0.4)], 0.1, (4, 8, 16, 32, 64, 256))
    curve_path = root / "tiny_curve.json"
    curve.save(curve_path)
    n = 6 if quick else 24
    prompts = _prompts(n, 128, 8)
    params = SamplingParams(temperature=0.0, max_tokens=24 if quick else 64, ignore_eos=True)
    common = dict(model=str(target), draft=str(draft), device=device, dtype="float32", max_num_seqs=8 if quick else 32,
                  max_model_len=256, block_size=16, sps_curve=str(curve_path))
    ref_engine = LLMEngine(EngineConfig(**common, num_speculative_tokens=0, cuda_graphs=False))
    reference = ref_engine.generate(prompts, params)
    rows = []
    cases = [("none", True), ("mask", True), ("varlen", True), ("varlen", False), ("none", False)]
    for mode, graphs in cases:
        # mask prunes a dense model's uniform batch only under a budget cap (core.capacity: pruning saves
        # nothing there), and pruned padding rows are what this check must see
        cap = 0.5 if mode == "mask" else 1.0
        cfg = EngineConfig(**common, num_speculative_tokens=4, cuda_graphs=graphs,
                           capacity=CapacityConfig(mode=mode, saturation_patience=0, budget_frac=cap))
        engine = LLMEngine(cfg)
        out = engine.generate(prompts, params)
        s = engine.stats
        rows.append(dict(mode=mode, cuda_graphs=graphs and device != "cpu", identical=out == reference,
                         drafted=s.num_draft_tokens, verified=s.num_verified_draft_tokens, accepted=s.num_accepted_tokens,
                         mismatched_requests=sum(a != b for a, b in zip(out, reference, strict=True))))
    return {"cases": rows, "ok": all(r["identical"] for r in rows)
            and all(r["verified"] < r["drafted"] for r in rows if r["mode"] != "none")}


def check_syncs(root: Path, device: str) -> dict[str, Any]:
    target, draft = root / "tiny_target", root / "tiny_draft"
    engine = LLMEngine(EngineConfig(model=str(target), draft=str(draft), device=device, num_speculative_tokens=4,
                                    max_num_seqs=16, max_model_len=512, sps_curve=str(root / "tiny_curve.json"),
                                    capacity=CapacityConfig(mode="varlen", saturation_patience=0)))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(_prompts(16, 128, 8)):
        engine.add_request(f"s{i}", p, params if i % 2 else SamplingParams(temperature=0.8, max_tokens=200,
                                                                           ignore_eos=True, seed=i))
    for _ in range(6):  # prefill + warm decode steps
        engine.step()
    sites: Counter[str] = Counter()
    steps = 10
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        sites[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return {"steps": steps, "sync_sites": dict(sites), "syncs_per_step": sum(sites.values()) / steps}


PHASES = ("prepare", "draft", "plan", "layout", "verify", "reject", "lookahead", "sync", "emit")
CURVES = Path(__file__).resolve().parent / "results" / "h200" / "profile_sps"
# --shape: the served SmolLM2 pair (random weights, acceptance ~0), or the scaled setup of the H200 matrix
# (a Llama-3-8B-shaped target with the synthetic drafter: realistic acceptance, so the capacity manager
# plans real budgets and its share of the step -- the scheduling overhead -- is measured under load).
SHAPES = {
    "smollm2": ("random:smollm2-135m", "random:small:layers=4", CURVES / "smollm2.json"),
    "llama-3-8b": ("random:llama-3-8b", "synthetic", CURVES / "llama3-8b.json"),
}


def _run_phases(engine: LLMEngine, conc: int, vocab: int, max_tokens: int, prompt_len: int,
                mode: str, temperature: float = 0.0) -> dict[str, Any]:
    """Generate ``conc`` requests at once and break the decode steps down by phase (``mode``: host/device/gpu)."""
    prompts = _prompts(conc, vocab, prompt_len, seed=conc)
    # At temperature > 0 every request is seeded, as `dspark bench` sends them (seed + index).
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                             seed=i if temperature > 0 else None) for i in range(conc)]
    s = engine.stats
    s.phase_ms.clear()
    s.phase_steps.clear()
    step_ms, step_count = dict(s.step_ms), dict(s.steps)  # the engine's own clock per step kind, cumulative
    before = (s.num_decode_steps, s.num_draft_tokens, s.num_verified_draft_tokens, s.num_paused_steps,
              s.num_accepted_tokens, s.num_drafts)
    stalls = s.stalls.copy()
    engine.phase_timing = mode
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        outs = engine.generate(prompts, params)
    finally:
        engine.phase_timing = None
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    kinds: dict[str, Any] = {}
    for kind, steps in s.phase_steps.items():
        per = {ph: s.phase_ms.get(f"{kind}.{ph}", 0.0) / steps for ph in PHASES + ("forward",)}
        per = {ph: v for ph, v in per.items() if f"{kind}.{ph}" in s.phase_ms}
        kinds[kind] = dict(steps=steps, ms_per_step=per, total_ms_per_step=sum(per.values()))
        n = s.steps.get(kind, 0) - step_count.get(kind, 0)
        if n > 0:
            # What the step costs around its phases: for a paused step the capacity manager's per-step
            # bookkeeping (saturation decision, step timing, calibration), which a no-speculation step lacks.
            step = (s.step_ms.get(kind, 0.0) - step_ms.get(kind, 0.0)) / n
            kinds[kind].update(step_ms=step, outside_ms=step - kinds[kind]["total_ms_per_step"])
    drafts = s.num_drafts - before[5]
    return dict(
        concurrency=conc, mode=mode, tok_s=sum(len(o) for o in outs) / elapsed, wall_s=elapsed,
        decode_steps=s.num_decode_steps - before[0], paused_steps=s.num_paused_steps - before[3],
        drafted=s.num_draft_tokens - before[1], verified=s.num_verified_draft_tokens - before[2],
        acceptance_length=(1 + (s.num_accepted_tokens - before[4]) / drafts) if drafts else None,
        schedule_ms_per_step=s.phase_ms.get("schedule", 0.0) / max(1, sum(s.phase_steps.values())),
        kinds=kinds,
        # what the run waited on beyond its steps' work: kernel compiles while serving, full GCs (stalls.py)
        serving_compiles=s.stalls.compiles["serving"] - stalls.compiles["serving"],
        serving_compile_ms=s.stalls.compile_ms["serving"] - stalls.compile_ms["serving"],
        compiles_by_step={k: v - stalls.compiles_by_step.get(k, 0) for k, v in s.stalls.compiles_by_step.items()
                          if v != stalls.compiles_by_step.get(k, 0)},
        full_gc_ms=s.stalls.full_gc_ms - stalls.full_gc_ms,
    )


STEP_CONFIGS = ("nospec", "none", "mask", "varlen")


def time_steps(root: Path, device: str, quick: bool, out: Path, shape: str = "smollm2",
               max_model_len: int = 1024, temperature: float = 0.0, configs: tuple[str, ...] | None = None,
               concurrencies: list[int] | None = None) -> dict[str, Any]:
    """Per-phase breakdown of decode steps: nospec / none / varlen (``configs``: any of ``STEP_CONFIGS``) at a
    low and a high concurrency (``concurrencies``).

    The shapes are the served configuration's (SmolLM2-135M target, a 4-layer draft of the same width,
    K = 7, max_num_seqs = 256); weights are random (acceptance ~0), which changes how many steps a request
    takes, not what one step costs. "host" timing adds no syncs (device time surfaces in "sync", the one
    device -> host copy); "device" timing syncs after every phase so each phase owns its device time;
    "gpu" timing (CUDA only) records an event per phase and adds no sync, so the phases' spans of the device
    timeline add up to a real step and "plan" + "layout" there is what scheduling adds to it.
    """
    if quick:
        model, draft, k, max_seqs, concs, max_tokens, prompt_len = (
            "random:smollm2-135m:layers=2", "random:small:layers=1", 3, 8, [2, 8], 8, 16)
    else:
        model, draft, _ = SHAPES[shape]
        k, max_seqs, concs, max_tokens, prompt_len = 7, 256, [16, 256], 128, 128
    dtype = "bfloat16" if device == "cuda" else "float32"
    common = dict(model=model, device=device, dtype=dtype, max_num_seqs=max_seqs, max_model_len=max_model_len)
    curve_path = out / "sps_curve.json"
    if device == "cuda" and SHAPES[shape][2].exists() and not quick:
        curve_path.write_text(SHAPES[shape][2].read_text())  # the profiled curve of exactly this shape (H200)
    else:
        SpsCurve.from_points([(1, 1.0), (8, 1.1), (64, 2.0), (512, 6.0)], [(1, 0.5), (256, 1.0)], 0.2).save(curve_path)
    if concurrencies:
        concs = concurrencies
    overrides_of = {
        "nospec": dict(num_speculative_tokens=0),
        "none": dict(num_speculative_tokens=k, draft=draft),
        **{mode: dict(num_speculative_tokens=k, draft=draft, sps_curve=str(curve_path),
                      capacity=CapacityConfig(mode=mode)) for mode in ("mask", "varlen")},
    }
    rows = []
    for name in configs or ("nospec", "none", "varlen"):
        overrides = overrides_of[name]
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(**common, **overrides))
        build_s = time.perf_counter() - t0
        # Warm-up: Triton JIT of eager prefill shapes and every kernel outside the graphs.
        engine.generate(_prompts(min(max(concs), 32), 128, prompt_len, seed=99),
                        SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True))
        for conc in concs:
            rows.append(dict(config=name, build_s=build_s,
                             **_run_phases(engine, conc, engine.vocab_size, max_tokens, prompt_len, "host",
                                           temperature)))
            rows.append(dict(config=name, build_s=build_s,
                             **_run_phases(engine, conc, engine.vocab_size, max(8, max_tokens // 4), prompt_len,
                                           "device", temperature)))
            if device == "cuda":  # each phase's span of the device timeline, no added syncs
                rows.append(dict(config=name, build_s=build_s,
                                 **_run_phases(engine, conc, engine.vocab_size, max(8, max_tokens // 2), prompt_len,
                                               "gpu", temperature)))
        del engine
        if device != "cpu":
            torch.cuda.empty_cache()
    return {"model": model, "draft": draft, "k": k, "max_num_seqs": max_seqs, "max_tokens": max_tokens,
            "temperature": temperature,
            "prompt_len": prompt_len, "phases": rows}


def _stall_cell(r: dict[str, Any]) -> str:
    """``compiles/ms gc ms``: kernel compiles while serving (none expected after start-up) and full GCs."""
    text = f"{r['serving_compiles']}/{r['serving_compile_ms']:.0f}"
    if r["compiles_by_step"]:
        text += " (" + ",".join(f"{k} {v}" for k, v in sorted(r["compiles_by_step"].items())) + ")"
    return text + f" gc {r['full_gc_ms']:.0f}"


def _print_phases(console: Any, steps: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"decode step breakdown, ms per step ({steps['model']} + {steps['draft']}, K={steps['k']}, "
                    f"{steps['max_tokens']} tokens, T={steps.get('temperature', 0.0):g}; host = no added syncs, "
                    "device = sync per phase, gpu = CUDA events: each phase's span of the device timeline)")
    for col in ("config", "c", "timing", "kind", "steps", *PHASES, "sum", "outside", "sched", "tok/s", "ms/step*",
                "paused", "acc len", "stalls"):
        t.add_column(col, justify="right")
    for r in steps["phases"]:
        first = True
        for kind in ("spec", "probe", "paused", "nospec", "prefill"):
            if kind not in r["kinds"]:
                continue
            kd = r["kinds"][kind]
            ph = kd["ms_per_step"]
            cells = [f"{ph[p]:.2f}" if p in ph else "" for p in PHASES]
            if kind == "prefill":
                cells = ["", f"{ph.get('forward', 0.0):.2f}", "", "", "", "", f"{ph.get('sync', 0.0):.2f}",
                         f"{ph.get('emit', 0.0):.2f}"]
            acc = r["acceptance_length"]
            t.add_row(r["config"] if first else "", str(r["concurrency"]) if first else "", r["mode"] if first else "",
                      kind, str(kd["steps"]), *cells, f"{kd['total_ms_per_step']:.2f}",
                      f"{kd['outside_ms']:.3f}" if "outside_ms" in kd else "",
                      f"{r['schedule_ms_per_step']:.2f}" if first else "",
                      f"{r['tok_s']:.0f}" if first else "",
                      f"{1000 * r['wall_s'] / max(1, r['decode_steps']):.2f}" if first else "",
                      f"{r['paused_steps']}/{r['decode_steps']}" if first else "",
                      f"{acc:.2f}" if first and acc else "",
                      _stall_cell(r) if first else "")
            first = False
    console.print(t)
    console.print("ms/step* = generate() wall / decode steps (prefill steps included in the wall). Phases: prepare "
                  "(block tables, H2D), draft (catch-up + K drafts; paused: the 1-token draft catch-up), plan "
                  "(capacity record/plan/allocate), layout, verify (target forward + logits), reject (rejection "
                  "sampler / sampling, STS), lookahead (the next step's plan, while the device verifies), sync (the one D2H copy: waits for the device in host timing), emit "
                  "(counters, traces, token emission); outside = the engine's own step time less the phases' sum (a paused "
                  "step's capacity bookkeeping); prefill rows: draft column = prefill forward. stalls = "
                  "kernel compiles while serving / their ms (by step kind), and ms of full garbage collections.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2",
                    help="served shape timed phase by phase (llama-3-8b: the scaled setup, synthetic drafter)")
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="engines' max_model_len (block-table width and KV pool size follow it)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the timed requests (> 0: seeded sampling, as dspark bench sends)")
    ap.add_argument("--configs", default="nospec,none,varlen",
                    help=f"comma list of the step breakdown's configs ({', '.join(STEP_CONFIGS)}); mask and varlen "
                         "pause where the random draft loses, so their paused steps sit beside nospec's")
    ap.add_argument("--concurrency", default=None,
                    help="comma list of concurrencies for the step breakdown (default 16,256; --quick 2,8)")
    ap.add_argument("--steps-only", action="store_true",
                    help="skip the lossless and host-sync checks: the step breakdown alone")
    args = ap.parse_args()
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    unknown = sorted(set(configs) - set(STEP_CONFIGS))
    if unknown or not configs:
        ap.error(f"--configs: unknown {', '.join(unknown) or 'empty list'}; use {', '.join(STEP_CONFIGS)}")
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")] if args.concurrency else None
    except ValueError:
        ap.error(f"--concurrency: expected a comma list of integers, got {args.concurrency!r}")
    if concurrencies is not None and min(concurrencies) < 1:
        ap.error("--concurrency: every value must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "quick": args.quick,
    }
    with tempfile.TemporaryDirectory(prefix="dspark-embedded-bench-") as tmp:
        root = Path(tmp)
        if not args.steps_only:
            report["lossless"] = check_lossless(root, device, args.quick)
            if device == "cuda":
                report["syncs"] = check_syncs(root, device)
        report["steps"] = time_steps(root, device, args.quick, args.out, args.shape, args.max_model_len,
                                     args.temperature, configs, concurrencies)
    (args.out / "embedded_engine.json").write_text(json.dumps(report, indent=2))

    from rich.console import Console
    from rich.table import Table


    console = Console(width=190)
    if "lossless" in report:
        t = Table(title=f"lossless greedy on {report['device']}: {'OK' if report['lossless']['ok'] else 'FAILED'}")
        for col in ("mode", "graphs", "identical", "drafted", "verified", "accepted"):
            t.add_column(col)
        for r in report["lossless"]["cases"]:
            t.add_row(r["mode"], str(r["cuda_graphs"]), str(r["identical"]), str(r["drafted"]), str(r["verified"]),
                      str(r["accepted"]))
        console.print(t)
    if "syncs" in report:
        s = report["syncs"]
        console.print(f"host syncs per decode step: {s['syncs_per_step']:.1f} at {s['sync_sites']}")
    _print_phases(console, report["steps"])
    console.print(f"written: {args.out / 'embedded_engine.json'}")


if __name__ == "__main__":
    main()
