"""Mean acceptance length of SmolLM2-135M-Instruct's packaged draft, measured through the real embedded engine.

The distillation script reports acceptance from *simulated* rejection sampling on teacher-forced held-out
text; this script measures what the serving engine actually achieves: ``LLMEngine`` (paged KV, the drafter
with its confidence head, ``core.rejection``) generating from chat-templated GSM8K questions the draft never
saw in training (the last 100 test questions, 1219..1318), with capacity mode ``none`` so every draft is
verified and the recorded traces replay exactly in ``dspark bench --simulate``.

Mean acceptance length is vLLM's definition: ``1 + accepted drafts / request-steps that drafted``, i.e. the
tokens one verify step emits per request on average. Every request generates exactly ``--max-tokens``
tokens (``ignore_eos``), so every cell sees the same token positions.

Besides the table it reports, per draft position, the conditional acceptance rate (P(draft i accepted |
drafts < i accepted), what the confidence head estimates) beside the head's mean raw confidence on the
same rows -- the gap is the miscalibration STS has to remove -- and two checks of the engine: greedy
speculative output equals greedy output without speculation (losslessness, float32 on CPU), and the greedy
acceptance recomputed outside the engine from that greedy text (teacher-forced, Hugging Face transformers)
equals the engine's (see ``teacher_forced_greedy``).

    python benchmarks/acceptance_smollm2.py --out benchmarks/results/acceptance_smollm2 \\
        --traces-dir benchmarks/results/traces          # about 20-30 minutes on 2 CPU cores

Traces of the K = ``--trace-k`` runs are written to ``--traces-dir`` as ``smollm2_k7_greedy.jsonl`` and
``smollm2_k7_t1.jsonl`` (request ids carry the temperature so both files can be replayed together).
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.core.traces import read_traces
from dspark_cli.data.gsm8k import chat_messages, load_gsm8k
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.fileio import atomic_write_json, read_json

HELD_OUT_FIRST = 1219  # the draft was distilled on GSM8K test questions 0..1218
DISTILL_METRICS = Path(__file__).parent / "results" / "h200" / "distill_smollm2_draft" / "metrics.json"


@dataclass
class RunResult:
    k: int
    temperature: float
    num_prompts: int
    max_tokens: int
    mean_acceptance_length: float  # 1 + accepted / drafts (vLLM)
    acceptance_rate: float  # accepted / draft tokens
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    per_position_rate: list[float]  # vLLM: accepted at position i / drafts
    conditional_rate: list[float]  # P(i accepted | all before accepted)
    mean_confidence: list[float]  # raw head confidence, over rows that reached position i
    decode_steps: int
    generation_tokens: int
    wall_s: float
    trace_file: str | None = None
    trace_records: int = 0
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("outputs")
        return d


def chat_prompts(tokenizer: Any, first: int, n: int, style: str = "bench") -> tuple[list[int], list[list[int]]]:
    """GSM8K questions ``first..first+n-1`` through the model's chat template with the generation prompt,
    tokenised without extra special tokens (what the server's chat endpoint does).

    ``bench``: the question alone as one user turn (what ``dspark bench --dataset gsm8k`` sends).
    ``0shot``: ``chat_messages(q, 0)`` -- the question plus the instruction to reason step by step and end
    with "So the answer is N." -- the format the draft was distilled and evaluated on.
    """
    rows = load_gsm8k()[first : first + n]
    if len(rows) < n:
        raise SystemExit(f"only {len(rows)} GSM8K questions from {first}; lower --num-prompts")
    prompts = []
    for row in rows:
        messages = ([{"role": "user", "content": row.question}] if style == "bench"
                    else chat_messages(row.question, 0))
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return [first + i for i in range(n)], prompts


def position_stats(conf: np.ndarray, accepted: np.ndarray) -> tuple[list[float], list[float]]:
    """Conditional acceptance per position and the mean raw confidence over the same rows (those whose
    drafts before position i were all accepted: the event the confidence is a probability for)."""
    k = conf.shape[1]
    cond, mean_conf = [], []
    for i in range(k):
        reached = accepted >= i
        n = int(reached.sum())
        cond.append(float((accepted[reached] > i).mean()) if n else float("nan"))
        mean_conf.append(float(conf[reached, i].mean()) if n else float("nan"))
    return cond, mean_conf


def run_config(args: argparse.Namespace, k: int, temperature: float, ids: list[int], prompts: list[list[int]],
               trace_path: Path | None, max_tokens: int | None = None) -> RunResult:
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        trace_path.unlink(missing_ok=True)  # the writer appends; a rerun must not double the records
    cfg = EngineConfig(
        model=args.model, draft="auto" if k > 0 else None, num_speculative_tokens=k,
        capacity=CapacityConfig(mode="none"), record_traces=str(trace_path) if trace_path else None,
        max_num_seqs=max(len(prompts), 1), device=args.device, seed=args.seed,
    )
    engine = LLMEngine(cfg)
    tag = "greedy" if temperature <= 0 else f"t{temperature:g}"
    max_tokens = max_tokens or args.max_tokens
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    rids = [f"{tag}-q{q}" for q in ids]
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(rid, p, params)
    outs: dict[str, list[int]] = {rid: [] for rid in rids}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        s = engine.stats
        if s.num_decode_steps and s.num_decode_steps % 10 == 0 and s.num_drafts:
            print(f"  k={k} {tag}: {s.num_decode_steps} steps, {s.generation_tokens} tokens, "
                  f"running MAL {1 + s.num_accepted_tokens / s.num_drafts:.3f}, {time.perf_counter() - t0:.0f} s",
                  flush=True)
    wall = time.perf_counter() - t0
    engine.close()
    s = engine.stats
    drafts = max(s.num_drafts, 1)
    cond: list[float] = []
    mean_conf: list[float] = []
    records = 0
    if trace_path is not None:
        ts = read_traces([trace_path])
        conf, _, accepted = ts.arrays()
        records = len(ts.records)
        cond, mean_conf = position_stats(conf, accepted)
    elif k > 0:
        at_least = [s.num_drafts, *s.accepted_per_pos]
        cond = [at_least[i + 1] / at_least[i] if at_least[i] else float("nan") for i in range(k)]
    return RunResult(
        k=k, temperature=temperature, num_prompts=len(prompts), max_tokens=max_tokens,
        mean_acceptance_length=1 + s.num_accepted_tokens / drafts if k > 0 else 1.0,
        acceptance_rate=s.num_accepted_tokens / max(s.num_draft_tokens, 1),
        num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
        per_position_rate=[a / drafts for a in s.accepted_per_pos], conditional_rate=cond,
        mean_confidence=mean_conf, decode_steps=s.num_decode_steps, generation_tokens=s.generation_tokens,
        wall_s=wall, trace_file=str(trace_path) if trace_path else None, trace_records=records,
        outputs=[outs[r] for r in rids],
    )


def teacher_forced_greedy(args: argparse.Namespace, prompts: list[list[int]], greedy_text: list[list[int]],
                          ks: list[int]) -> dict[str, Any]:
    """Greedy acceptance recomputed outside the engine, from the target's greedy text alone.

    Under greedy decoding an accepted draft equals the target's token, so draft ``j`` of a step is proposed
    from exactly the target's greedy prefix: one teacher-forced pass of the draft over prompt + greedy text
    (Hugging Face transformers, not our model code) says which positions the draft gets right, and walking
    that text in steps of ``accepted + 1`` gives the mean acceptance length the engine must report. A
    mismatch would point at the engine's draft KV handling (catch-up, rewritten positions), not at the draft.
    ``greedy_text`` must run ``max(ks)`` tokens past ``--max-tokens``: the last step verifies drafts beyond it.
    """
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from dspark_cli.engines.embedded.engine import resolve_checkpoints

    hf_logging.set_verbosity_error()  # the draft's confidence_head.* tensors are unknown to LlamaForCausalLM
    ckpt = resolve_checkpoints(EngineConfig(model=args.model, draft="auto", num_speculative_tokens=max(ks)))
    target = LlamaForCausalLM.from_pretrained(str(ckpt.target), dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(str(ckpt.draft), dtype=torch.float32).eval()
    matches: list[list[bool]] = []
    target_agrees = total = 0
    with torch.inference_mode():
        for prompt, text in zip(prompts, greedy_text, strict=True):
            x = torch.tensor([prompt + text])
            start = len(prompt) - 1  # logits row predicting text[0]
            rows = slice(start, start + len(text))
            want = torch.tensor(text)
            d = draft(x).logits[0, rows].argmax(-1)
            t = target(x).logits[0, rows].argmax(-1)
            matches.append((d == want).tolist())
            target_agrees += int((t == want).sum())
            total += len(text)
    out: dict[str, Any] = {
        "draft_agreement": sum(map(sum, matches)) / total,
        "hf_target_reproduces_engine_greedy": target_agrees / total,
    }
    for k in ks:
        drafts = accepted = 0
        for m in matches:
            pos = 1  # text[0] came from the prefill
            while pos < args.max_tokens:
                a = 0
                while a < k and m[pos + a]:
                    a += 1
                drafts += 1
                accepted += a
                pos += a + 1
        out[f"k{k}"] = 1 + accepted / drafts
    return out


def distill_reference() -> dict[tuple[int, float], float]:
    """(k, T) -> the distillation run's simulated mean acceptance length, when its metrics are in the tree."""
    if not DISTILL_METRICS.is_file():
        return {}
    return {(int(r["k"]), float(r["temperature"])): float(r["mean_acceptance_length"])
            for r in read_json(DISTILL_METRICS).get("speculative", [])}


def print_table(results: list[RunResult], ref: dict[tuple[int, float], float]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="SmolLM2-135M-Instruct + packaged draft, embedded engine (CPU), held-out GSM8K, capacity none")
    for col in ("K", "T", "mean acc. length", "distill (sim.)", "accept rate", "conditional rate by position",
                "mean raw conf. by position", "steps", "wall s"):
        t.add_column(col, justify="left" if "position" in col else "right")
    for r in results:
        fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs) or "-"  # noqa: E731
        d = ref.get((r.k, r.temperature))
        t.add_row(str(r.k), f"{r.temperature:g}", f"{r.mean_acceptance_length:.3f}",
                  f"{d:.3f}" if d is not None else "-", f"{r.acceptance_rate:.3f}", fmt(r.conditional_rate),
                  fmt(r.mean_confidence), str(r.decode_steps), f"{r.wall_s:.0f}")
    Console(width=220).print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/acceptance_smollm2"))
    ap.add_argument("--traces-dir", type=Path, default=Path("benchmarks/results/traces"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--first-question", type=int, default=HELD_OUT_FIRST)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ks", default="4,7")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompt-style", choices=("bench", "0shot"), default="bench",
                    help="bench: the question alone (as dspark bench); 0shot: the distillation's prompt format")
    ap.add_argument("--trace-k", type=int, default=7, help="record traces for this K (0 = none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-lossless-check", action="store_true",
                    help="skip the no-speculation greedy run and the teacher-forced check built on it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    temps = [float(x) for x in args.temperatures.split(",") if x.strip()]
    if args.first_question < HELD_OUT_FIRST:
        print(f"warning: questions before {HELD_OUT_FIRST} were in the draft's training set")

    tok_engine = LLMEngine(EngineConfig(model=args.model, num_speculative_tokens=0, device=args.device, max_num_seqs=1))
    ids, prompts = chat_prompts(tok_engine.tokenizer, args.first_question, args.num_prompts, args.prompt_style)
    model_name = tok_engine.model_name
    del tok_engine
    print(f"{len(prompts)} prompts (questions {ids[0]}..{ids[-1]}), prompt lengths {min(map(len, prompts))}.."
          f"{max(map(len, prompts))} tokens, {args.max_tokens} new tokens each", flush=True)

    ref = distill_reference()
    meta = {
        "model": model_name, "draft": "auto (packaged smollm2_draft)", "device": args.device,
        "threads": args.threads, "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "questions": [ids[0], ids[-1]], "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "prompt_style": args.prompt_style,
        "prompt_format": ("chat template, one user turn with the question, add_generation_prompt (as dspark bench)"
                          if args.prompt_style == "bench" else
                          "chat template, chat_messages(question, 0): the question + 'Solve it step by step and end "
                          "with \"So the answer is N.\"' (the distillation's held-out format)"),
        "capacity_mode": "none", "ignore_eos": True, "seed": args.seed,
        "definition": "mean_acceptance_length = 1 + accepted / drafts (vLLM)",
    }
    results: list[RunResult] = []
    suffix = "" if args.prompt_style == "bench" else f"_{args.prompt_style}"
    out_file = args.out / f"acceptance{suffix}.json"

    def save(extra: dict[str, Any] | None = None) -> None:
        payload = {**meta, "runs": [r.to_json() for r in results],
                   "distill_simulated": [{"k": k, "temperature": t, "mean_acceptance_length": v}
                                         for (k, t), v in sorted(ref.items())]}
        if extra:
            payload.update(extra)
        atomic_write_json(out_file, payload)

    for k in ks:
        for temp in temps:
            tag = "greedy" if temp <= 0 else f"t{temp:g}"
            trace = args.traces_dir / f"smollm2_k{k}_{tag}{suffix}.jsonl" if k == args.trace_k else None
            print(f"k={k} T={temp:g} ...", flush=True)
            results.append(run_config(args, k, temp, ids, prompts, trace))
            r = results[-1]
            print(f"  -> mean acceptance length {r.mean_acceptance_length:.3f} ({r.decode_steps} steps, "
                  f"{r.wall_s:.0f} s)", flush=True)
            save()

    extra: dict[str, Any] = {}
    greedy = [r for r in results if r.temperature <= 0]
    if greedy and not args.no_lossless_check:
        print("no speculation, greedy (lossless check) ...", flush=True)
        base = run_config(args, 0, 0.0, ids, prompts, None, max_tokens=args.max_tokens + max(ks))
        ref_text = [b[: args.max_tokens] for b in base.outputs]
        extra["lossless"] = {
            f"k{r.k}": {"identical": sum(a == b for a, b in zip(r.outputs, ref_text, strict=True)),
                        "of": len(ref_text),
                        "first_divergence": [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y),
                                                  None) for a, b in zip(r.outputs, ref_text, strict=True)]}
            for r in greedy
        }
        extra["nospec_wall_s"] = base.wall_s
        save(extra)
        if max(ks) > 0:
            print("teacher-forced greedy acceptance (transformers, outside the engine) ...", flush=True)
            extra["teacher_forced_greedy"] = teacher_forced_greedy(args, prompts, base.outputs, [k for k in ks if k > 0])
            save(extra)
    print_table(results, ref)
    if "lossless" in extra:
        for name, v in extra["lossless"].items():
            print(f"greedy {name} vs no speculation: {v['identical']}/{v['of']} outputs identical")
    if "teacher_forced_greedy" in extra:
        tf = extra["teacher_forced_greedy"]
        engine_mal = {f"k{r.k}": r.mean_acceptance_length for r in greedy}
        print(f"teacher-forced greedy (draft agreement {tf['draft_agreement']:.3f}): " + ", ".join(
            f"{name} {tf[name]:.3f} (engine {engine_mal[name]:.3f})" for name in engine_mal))
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()
