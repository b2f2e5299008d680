"""Where a decode step's "prepare" phase goes: the embedded engine's real input packing
(``ModelRunner.decode_inputs``) for R requests, split into the host packing and the host-to-device copy.

    python3 benchmarks/prepare_step.py --out OUT          # CUDA: R = 16, 64, 256 at max_model_len 4096

Each variant runs ``--iters`` times with a device sync after each (a decode step ends in one), and the
table gives the median and p90 in microseconds. On a CPU only the host packing is timed. (The H200 results of
2026-12-01 also timed a pinned buffer kept for the runner's life in place of ``pin_memory()`` per copy: no
faster, and it was not kept.)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import torch

from dspark_cli.engines.embedded.model_runner import ModelRunner
from dspark_cli.engines.embedded.sequence import SamplingParams, Sequence


def _seqs(num_reqs: int, context: int, block_size: int) -> list[Sequence]:
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(num_reqs):
        seq = Sequence(f"r{i}", rng.integers(0, 32000, size=context).tolist(), SamplingParams(), i)
        seq.block_table = (i * 64 + np.arange(-(-context // block_size))).tolist()
        seqs.append(seq)
    return seqs


def _runner(device: torch.device, max_model_len: int, block_size: int) -> ModelRunner:
    """The real ``decode_inputs`` on a runner with only the fields it reads (no model is loaded)."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = device
    runner.block_size = block_size
    runner.max_blocks_per_seq = -(-(max_model_len + 8) // block_size)
    return runner


def _time(fn: Callable[[], object], iters: int, sync: bool) -> tuple[float, float]:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="16,64,256")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--context", type=int, default=256, help="tokens per request (prompt + generated)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    for num_reqs in [int(x) for x in args.requests.split(",")]:
        seqs = _seqs(num_reqs, args.context, args.block_size)
        slots = np.arange(num_reqs, dtype=np.int64)
        host_only = _runner(torch.device("cpu"), args.max_model_len, args.block_size)
        variants = {"host packing only": host_only}
        if cuda:
            variants["packing + copy"] = _runner(device, args.max_model_len, args.block_size)
        for name, runner in variants.items():
            fn = functools.partial(runner.decode_inputs, seqs, [slots])
            for _ in range(20):  # warm the allocators
                fn()
            med, p90 = _time(fn, args.iters, sync=runner is not host_only)
            batch_bytes = num_reqs * (host_only.max_blocks_per_seq + 3) * 8
            rows.append({"requests": num_reqs, "variant": name, "median_us": round(med, 1), "p90_us": round(p90, 1),
                         "batch_bytes": batch_bytes})
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"decode_inputs on {name} (max_model_len {args.max_model_len}, {args.context}-token requests)")
    print(f"{'R':>5} {'variant':<24} {'median us':>10} {'p90 us':>9} {'bytes':>9}")
    for r in rows:
        print(f"{r['requests']:>5} {r['variant']:<24} {r['median_us']:>10} {r['p90_us']:>9} {r['batch_bytes']:>9}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": name, "torch": torch.__version__, "args": vars(args) | {"out": str(args.out)}}
        (args.out / "prepare_step.json").write_bytes(orjson.dumps({"meta": meta, "rows": rows},
                                                                  option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
