"""Write verification traces (SPEC §3 JSONL) whose confidences carry no information about acceptance.

This is what a weightless draft reports against vLLM's synthetic rejection sampler (the setup of the 8B-shaped
vLLM runs): every raw confidence is about 1/vocabulary, while acceptance is drawn per position from fixed
conditional rates whatever the draft proposed. Replaying such traces with ``dspark bench --simulate`` shows
what the capacity manager and online STS do when the head is useless and far below 0.5 -- a case temperature
scaling alone cannot calibrate. Every draft is verified (``verified = K``), so the replay is exact.

    python3 benchmarks/synthetic_traces.py -o traces.jsonl
    dspark bench --simulate --traces traces.jsonl --sps-curve CURVE.json -c 16,64,256 --steps 1024
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import orjson

V4_FLASH_RATES = "0.8,0.7,0.6,0.5,0.35,0.2,0.08"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--rates", default=V4_FLASH_RATES, help="conditional acceptance per position (K = count)")
    ap.add_argument("--conf", type=float, default=2e-5, help="mean raw confidence (about 1/vocabulary)")
    ap.add_argument("--spread", type=float, default=0.2, help="relative standard deviation of the confidences")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40, help="verification steps per request")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rates = np.array([float(x) for x in args.rates.split(",")])
    if not len(rates) or np.any((rates < 0) | (rates > 1)) or not 0 < args.conf < 1:
        raise SystemExit("--rates must be probabilities and --conf in (0, 1)")
    k = len(rates)
    rng = np.random.default_rng(args.seed)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with tmp.open("wb") as fh:
        for req in range(args.requests):
            for step in range(args.steps):
                acc = 0
                while acc < k and rng.random() < rates[acc]:
                    acc += 1
                conf = (args.conf * (1 + args.spread * rng.standard_normal(k))).clip(1e-6).tolist()
                fh.write(orjson.dumps({"request": f"r{req}", "step": step, "conf": conf, "verified": k,
                                       "accepted": acc}) + b"\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}: {args.requests * args.steps} request-steps, K={k}")


if __name__ == "__main__":
    main()
