"""Write synthetic verification traces (JSONL) for ``dspark bench --simulate``.

Two kinds, every draft verified (``verified = K``) so the replay is exact:

* default -- confidences that carry **no** information: what a weightless draft reports against vLLM's
  synthetic rejection sampler (the 8B-shaped vLLM runs). Every raw confidence is about 1/vocabulary while
  acceptance follows fixed conditional rates whatever the draft proposed: a case temperature scaling
  alone cannot calibrate;
* ``--synthetic SPEC`` -- the embedded engine's synthetic drafter (``--draft synthetic:SPEC``, the scaled
  setup of the H200 matrix): per request and step the same latent acceptance draw
  (``engines.embedded.synthetic.draw_synthetic``), its informative but miscalibrated confidences, and
  its Bernoulli outcomes. Replayed under a profiled curve, this predicts the matrix before a GPU runs it.

    python3 benchmarks/synthetic_traces.py -o traces.jsonl [--synthetic first=0.8,decay=0.7]
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
    ap.add_argument("--synthetic", default=None, metavar="SPEC",
                    help="draw from the embedded synthetic drafter instead ('' for its defaults; K from -k)")
    ap.add_argument("-k", type=int, default=7, help="positions per step with --synthetic")
    args = ap.parse_args()
    if args.synthetic is not None:
        write_synthetic_drafter(args)
        return
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


def write_synthetic_drafter(args: argparse.Namespace) -> None:
    import torch

    from dspark_cli.engines.embedded.synthetic import SYNTHETIC_PREFIX, draw_synthetic, parse_synthetic

    spec = parse_synthetic(SYNTHETIC_PREFIX + (":" + args.synthetic if args.synthetic else ""))
    k = args.k
    probs = torch.tensor(spec.base_probs(k), dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    base_logit = (torch.log(probs) - torch.log1p(-probs)).float()
    gen = torch.Generator().manual_seed(args.seed)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with tmp.open("wb") as fh:
        for step in range(args.steps):
            draw = draw_synthetic(base_logit, args.requests, spec, gen)
            lead = torch.cat([draw.accept, torch.zeros(args.requests, 1, dtype=torch.bool)], 1).int().argmin(1)
            for r in range(args.requests):
                fh.write(orjson.dumps({"request": f"r{r}", "step": step,
                                       "conf": [round(float(c), 6) for c in draw.confidence[r]],
                                       "verified": k, "accepted": int(lead[r])}) + b"\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}: {args.requests * args.steps} request-steps from synthetic:{spec.describe(k)}")


if __name__ == "__main__":
    main()
