"""Closed-loop replay of the saturation policy in the embedded engine, on any device.

A pool of ``--concurrency`` clients sends GSM8K chat prompts at temperature 1 (seeded, ignore-eos); each
finished request is replaced at once, for ``--waves`` x concurrency requests, as ``dspark bench`` loads a
server. The engine prices steps with ``--sps-curve`` (an H200 curve makes a CPU replay decide as the H200
would, up to the step-time calibration) and the script logs, per decode step, the running requests and
whether the step drafted, probed or paused, with the policy's floor, ceiling and probe wait: what a cell's
few drafting steps were.

    python3 benchmarks/saturation_replay.py --sps-curve benchmarks/results/h200/embedded_matrix/2026-12-01/real/sps_curve.json \
        --out benchmarks/results/saturation_replay/real_c16
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

    for _ in range(args.concurrency):
        send()
    steps = []
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
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out / "replay.json", orjson.dumps({"summary": summary, "steps": steps}))
    print(orjson.dumps(summary).decode())
    for i, s in enumerate(steps):
        if s["kind"] in ("draft", "probe"):
            print(i, s)


if __name__ == "__main__":
    main()
