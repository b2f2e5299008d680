"""Closed-loop replay of the saturation policy in the embedded engine, on any device.

A pool of ``--concurrency`` clients sends GSM8K chat prompts at temperature 1 (seeded, ignore-eos); each
finished request is replaced at once, for ``--waves`` x concurrency requests, as ``dspark bench`` loads a
server. The engine prices steps with ``--sps-curve`` (an H200 curve makes a CPU replay decide as the H200
would, up to the step-time calibration) and the script logs, per decode step, the running requests and
whether the step drafted, probed or paused, with the policy's floor, ceiling and probe wait: what a cell's
few drafting steps were.

    python3 benchmarks/saturation_replay.py --sps-curve benchmarks/results/h200/embedded_matrix/2026-12-01/real/sps_curve.json \
        --out benchmarks/results/saturation_replay/real_c16

``--attention-sms N`` also records, for every eager attention call (prefills, and catch-ups too long for the
captured graphs), the Triton kernel variant the CUDA backend would pick on a device of N SMs (132: an H200),
and prints where each variant was first asked for: a variant first needed by a probe's catch-up, inside
serving, is a compile that probe waited on unless the start-up warm-up compiled it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson
import torch

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.data.gsm8k import chat_messages, load_gsm8k
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.fileio import atomic_write_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sps-curve", required=True, type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--mode", default="varlen", choices=["mask", "varlen"])
    ap.add_argument("--online-sts", action="store_true")
    ap.add_argument("-k", type=int, default=7)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--attention-sms", type=int, default=0,
                    help="record the attention kernel variant of every eager forward as a device of this many SMs "
                         "would pick it (0 = off)")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(
        model=args.model, draft=args.draft, num_speculative_tokens=args.k, device=args.device, max_num_seqs=256,
        sps_curve=str(args.sps_curve), online_sts=args.online_sts, capacity=CapacityConfig(mode=args.mode), seed=0,
    ))
    tok = engine.tokenizer
    total = args.waves * args.concurrency
    rows = load_gsm8k(limit=total)
    prompts = [tok(tok.apply_chat_template(chat_messages(r.question, 0), add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in rows]
    assert engine.capacity is not None
    policy = engine.capacity.saturation
    sent = 0

    def send() -> None:
        nonlocal sent
        engine.add_request(f"r{sent}", prompts[sent % len(prompts)],
                           SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=sent))
        sent += 1

    variants: dict[tuple[int, int, int], dict] = {}
    if args.attention_sms:
        _record_variants(engine, args.attention_sms, variants, lambda: len(steps))

    for _ in range(args.concurrency):
        send()
    steps: list[dict] = []
    while engine.has_unfinished_requests():
        drafts, paused = engine.stats.num_drafts, engine.stats.num_paused_steps
        outs = engine.step()
        kind = "draft" if engine.stats.num_drafts > drafts else "paused" if engine.stats.num_paused_steps > paused \
            else "other"
        if kind == "draft" and engine.capacity.probe_step:
            kind = "probe"
        steps.append({"running": len(engine.scheduler.running), "kind": kind, "floor": policy.floor,
                      "ceiling": policy.ceiling, "probe_wait": policy.probe_wait})
        for _ in range(sum(o.finished for o in outs)):
            if sent < total:
                send()
    counts = {k: sum(s["kind"] == k for s in steps) for k in ("draft", "probe", "paused", "other")}
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "steps": len(steps), "kinds": counts,
               "drafts": engine.stats.num_drafts, "accepted": engine.stats.num_accepted_tokens}
    if args.attention_sms:
        summary["attention_variants"] = [
            {"block_m": key[0], "num_splits": key[1], "num_warps": key[2], **v} for key, v in sorted(variants.items())]
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out / "replay.json", orjson.dumps({"summary": summary, "steps": steps}))
    print(orjson.dumps(summary).decode())
    for i, s in enumerate(steps):
        if s["kind"] in ("draft", "probe"):
            print(i, s)
    for v in summary.get("attention_variants", []):
        print("attention variant", v)


def _record_variants(engine: LLMEngine, sms: int, variants: dict, step_index) -> None:  # type: ignore[no-untyped-def]
    """Wrap the attention backend: log the (tile height, splits, warps) plan of every launch a CUDA device would
    run eagerly -- the calls no captured graph can hold (a query longer than the graphs' rows per request, or
    more tokens than the largest capture) -- with the step kind the engine's stall watch was told.

    ``captured`` marks the variants the graph captures compile at start-up anyway (on a CPU nothing is
    captured, so their shapes are computed: verify and catch-up graphs per capture size with up to
    max_num_seqs requests, draft-step graphs with one row per request)."""
    from dspark_cli.engines.embedded.model_runner import capture_sizes_for
    from dspark_cli.engines.embedded.triton_attention import _plan

    runner = engine.runner
    cfg = engine.config
    k = engine.num_spec
    max_capture = cfg.max_capture_size or (k + 1) * cfg.max_num_seqs
    sizes = capture_sizes_for(max_capture)
    backend = runner.backend
    forward = backend.forward

    def key(rows: int, heads: int, dim: int, kv_heads: int, reqs: int) -> tuple[int, int, int]:
        p = _plan(rows, heads, dim, kv_heads, runner.block_size, reqs, runner.max_blocks_per_seq, sms)
        return p.block_m, p.num_splits, p.num_warps

    captured: set[tuple[int, int, int]] = set()
    for fwd in (runner.target_fwd, runner.draft_fwd):
        if fwd is not None:
            a = fwd.model.args
            captured |= {key(n, a.num_heads, a.head_dim, a.num_kv_heads, min(n, cfg.max_num_seqs)) for n in sizes}
            if fwd is runner.draft_fwd:
                captured |= {key(n, a.num_heads, a.head_dim, a.num_kv_heads, n)
                             for n in capture_sizes_for(cfg.max_num_seqs)}

    def recorded(q, k_new, v_new, k_cache, v_cache, inputs, scale):  # type: ignore[no-untyped-def]
        rows, heads, dim = q.shape
        if inputs.max_query_len > k + 1 or rows > max_capture:  # eager on CUDA too
            reqs = inputs.query_start_loc.shape[0] - 1
            v = variants.setdefault(key(rows, heads, dim, k_cache.shape[2], reqs), {
                "first_step": step_index(), "first_kind": engine.stalls.step_kind, "first_rows": int(rows),
                "first_reqs": int(reqs), "first_query_len": int(inputs.max_query_len), "calls": 0})
            v["calls"] += 1
            v["captured"] = key(rows, heads, dim, k_cache.shape[2], reqs) in captured
        return forward(q, k_new, v_new, k_cache, v_cache, inputs, scale)

    backend.forward = recorded  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
