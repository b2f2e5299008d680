"""Check and time the embedded engine on one device (CUDA graphs, lossless modes, host syncs, step costs).

Random-weight checkpoints are built in a temporary folder (no hub, nothing to bring): weights do not change
step costs, and losslessness must hold for any weights.

1. **lossless** -- a tiny target and a noisy copy as draft, float32: greedy outputs of no speculation
   (eager) against capacity none / mask / varlen with CUDA graphs, and varlen eager. A curve with a steep
   riser makes mask/varlen trim, so the check is not vacuous (``verified < drafted``).
2. **syncs** (CUDA) -- ``torch.cuda.set_sync_debug_mode("warn")`` over warm decode steps of a varlen engine;
   every synchronising call site is counted. The step's output copy (tokens, counts) is the expected one.
3. **steps** -- a SmolLM2-135M-shaped target with a 4-layer draft (bf16 on CUDA): ``profile_sps`` (the
   ``--sps-curve auto`` profile, saved as ``sps_curve.json``), then generation throughput at several
   concurrencies for K=0, K=4 capacity none (graphs and eager) and K=4 varlen with the profiled curve. The
   draft is random, so acceptance is ~0: this measures the engine's costs and the capacity manager backing
   off (saturation), not speculative gains.

    python benchmarks/embedded_engine.py --out benchmarks/results/embedded_engine   # CUDA: everything
    python benchmarks/embedded_engine.py --quick --out /tmp/embedded                  # CPU smoke run
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
from dspark_cli.engines.embedded.profile import profile_sps
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


def build_smol_shaped(root: Path, vocab: int) -> tuple[Path, Path]:
    torch.manual_seed(0)
    tok = _tokenizer(vocab)
    base = dict(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0)
    _save_llama(root / "smol_target", tok, num_hidden_layers=30, **base)
    _save_llama(root / "smol_draft", tok, num_hidden_layers=4, **base)
    return root / "smol_target", root / "smol_draft"


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
        cfg = EngineConfig(**common, num_speculative_tokens=4, cuda_graphs=graphs,
                           capacity=CapacityConfig(mode=mode, saturation_patience=0))
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


def _throughput(engine: LLMEngine, conc: int, vocab: int, max_tokens: int) -> dict[str, Any]:
    prompts = _prompts(conc, vocab, 64, seed=conc)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    s0 = engine.stats
    steps0, drafts0, verified0, paused0 = (s0.num_decode_steps, s0.num_draft_tokens, s0.num_verified_draft_tokens,
                                           s0.num_paused_steps)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    steps = engine.stats.num_decode_steps - steps0
    return dict(concurrency=conc, tok_s=tokens / elapsed, ms_per_decode_step=1000 * elapsed / max(steps, 1),
                drafted=engine.stats.num_draft_tokens - drafts0,
                verified=engine.stats.num_verified_draft_tokens - verified0,
                paused_steps=engine.stats.num_paused_steps - paused0)


def time_steps(root: Path, device: str, quick: bool, out: Path) -> dict[str, Any]:
    vocab = 2048 if quick else 49152
    target, draft = build_smol_shaped(root, vocab)
    concs = [1, 4] if quick else [1, 8, 32, 64]
    max_tokens = 16 if quick else 128
    common = dict(model=str(target), draft=str(draft), device=device, max_num_seqs=max(concs), max_model_len=1024)
    result: dict[str, Any] = {}
    probe = LLMEngine(EngineConfig(**common, num_speculative_tokens=4))
    t0 = time.perf_counter()
    curve = profile_sps(probe, context_len=256)
    result["profile_s"] = time.perf_counter() - t0
    curve.save(out / "sps_curve.json")
    result["sps_curve"] = curve.to_dict()
    configs = [
        ("k0", dict(num_speculative_tokens=0)),
        ("k4-none", dict(num_speculative_tokens=4)),
        ("k4-none-eager", dict(num_speculative_tokens=4, cuda_graphs=False)),
        ("k4-varlen", dict(num_speculative_tokens=4, sps_curve=str(out / "sps_curve.json"),
                           capacity=CapacityConfig(mode="varlen"))),
    ]
    rows = []
    for name, overrides in configs:
        engine = LLMEngine(EngineConfig(**common, **overrides))
        for conc in concs:
            rows.append(dict(config=name, **_throughput(engine, conc, vocab, max_tokens)))
        del engine
        if device != "cpu":
            torch.cuda.empty_cache()
    result["throughput"] = rows
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "quick": args.quick,
    }
    with tempfile.TemporaryDirectory(prefix="dspark-embedded-bench-") as tmp:
        root = Path(tmp)
        report["lossless"] = check_lossless(root, device, args.quick)
        if device == "cuda":
            report["syncs"] = check_syncs(root, device)
        report["steps"] = time_steps(root, device, args.quick, args.out)
    (args.out / "embedded_engine.json").write_text(json.dumps(report, indent=2))

    from rich.console import Console
    from rich.table import Table

    console = Console()
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
    curve = report["steps"]["sps_curve"]
    console.print(f"profiled in {report['steps']['profile_s']:.1f}s: verify_ms {curve['verify_curve_ms']}, "
                  f"draft_ms {curve['draft_curve_ms']}, overhead {curve['overhead_ms']:.3f} ms")
    t = Table(title="SmolLM2-shaped random pair, greedy, ignore_eos (acceptance ~0 by construction)")
    for col in ("config", "conc", "tok/s", "ms/decode step", "verified/drafted", "paused steps"):
        t.add_column(col)
    for r in report["steps"]["throughput"]:
        t.add_row(r["config"], str(r["concurrency"]), f"{r['tok_s']:.1f}", f"{r['ms_per_decode_step']:.2f}",
                  f"{r['verified']}/{r['drafted']}", str(r["paused_steps"]))
    console.print(t)
    console.print(f"written: {args.out / 'embedded_engine.json'}")


if __name__ == "__main__":
    main()
