"""Prefill steps through the ragged CUDA-graph families against eager prefills (embedded engine, one GPU).

For each case (prompt lengths of one prefill batch) the same batch is prefilled ``--reps`` times through the
runner's ragged families and ``--reps`` times with the target's family bypassed (its eager forward, as every
prefill ran before the families existed), with the draft's prefill (a drafting server) and without it (a
paused one, whose draft catches up later). Times are host wall clock around a synchronized prefill call,
medians in ms; each case checks that both ways give the same last-token logits (within bf16 tolerance).

    python3 benchmarks/prefill_graphs.py --out DIR [--shape smollm2-135m --shape llama-3-8b]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.fileio import atomic_write_json

# Prompt lengths per case. Each sequence is timed with its first sampled token too (prompt + 1 tokens), and a
# batch must fit the 2048-token prefill limit, as the scheduler admits it, to replay a graph.
CASES: dict[str, list[int]] = {
    "1 x 128": [128],
    "16 x 120": [120] * 16,
    "16 ragged 40-180": [40 + (i * 53) % 141 for i in range(16)],
    "64 x 24": [24] * 64,
    "4 x 500": [500] * 4,
}
DRAFTS = {"smollm2-135m": "random:small:layers=4", "llama-3-8b": "random:small:layers=1"}


def _time_prefill(engine: LLMEngine, lengths: list[int], reps: int, draft: bool, sync: Callable[[], None],
                  ) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    runner = engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, n in enumerate(lengths):
        engine.add_request(f"p{i}", [3 + (7 * i + j) % 1000 for j in range(n)], params)
    engine.step()  # admits and prefills the whole batch once
    seqs = list(engine.scheduler.running)
    assert len(seqs) == len(lengths), "the batch did not prefill in one step"
    graphed_fn = runner._prefill_fn
    out: dict[str, tuple[float, torch.Tensor]] = {}
    for name, fn in (("graphs", graphed_fn), ("eager", runner.target_fwd.run)):
        runner._prefill_fn = fn
        times, logits = [], None
        for _ in range(reps):
            for seq in seqs:
                seq.num_computed_tokens = 0  # the same K/V rewritten
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                logits = runner.prefill(seqs, draft=draft)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        assert logits is not None
        out[name] = (statistics.median(times), logits.float().clone())
    runner._prefill_fn = graphed_fn
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens
        engine.abort_request(seq.request_id)
    return out["graphs"][0], out["eager"][0], out["graphs"][1], out["eager"][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", action="append", help="random target shape (repeatable); default smollm2-135m")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: the shape's)")
    args = ap.parse_args()
    sync = torch.cuda.synchronize
    rows = []
    for shape in args.shape or ["smollm2-135m"]:
        model = f"random:{shape}" + (f":layers={args.layers}" if args.layers else "")
        engine = LLMEngine(EngineConfig(model=model, draft=DRAFTS.get(shape, "random:small"), num_speculative_tokens=7,
                                        device="cuda", dtype="bfloat16",
                                        max_num_seqs=256, max_model_len=2048, attention_backend=args.backend))
        runner = engine.runner
        assert runner._prefill_graphs is not None, "no ragged graphs: a kernel attention backend is needed"
        for case, lengths in CASES.items():
            for draft in (True, False):
                g, e, lg, le = _time_prefill(engine, lengths, args.reps, draft, sync)
                ok = bool(torch.allclose(lg, le, atol=5e-2, rtol=5e-2))
                rows.append({"shape": shape, "backend": runner.backend.name, "case": case, "tokens": sum(lengths),
                             "draft_prefill": draft, "graphs_ms": g, "eager_ms": e, "speedup": e / g, "logits_agree": ok})
                print(f"{shape:13s} {case:17s} draft={'yes' if draft else 'no ':3s} graphs {g:7.2f} ms  eager {e:7.2f} ms"
                      f"  x{e / g:5.2f}  {'ok' if ok else 'LOGITS DIFFER'}", flush=True)
        engine.close()
        del engine
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "prefill_graphs.json", {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                         "reps": args.reps, "rows": rows})
    if not all(r["logits_agree"] for r in rows):
        raise SystemExit("prefill_graphs: graphed and eager prefill logits differ")


if __name__ == "__main__":
    main()
