"""Check and time the paged ragged attention kernel (``triton_attention.paged_attention_varlen``).

On CUDA it (1) compares the kernel with ``torch_reference`` on ragged bf16 batches (zero-row requests,
padding rows, scattered pages, split and unsplit), (2) captures the kernel in one CUDA graph and replays it
with new per-request lengths, block tables and contents copied into the static buffers, checking every replay
(padding rows must come back zero), and (3) times decode/verify-shaped batches for SmolLM2-135M
(H=9, KVH=3, D=64) and Llama-3-8B (H=32, KVH=8, D=128): median of CUDA-event timings of graph replays, each
replay running the kernel once per copy of the KV pages (disjoint pages, so the working set exceeds L2
and the bytes really come from HBM). The floor is the bytes the kernel must move (every visible K/V byte once, q and out)
divided by the device-to-device copy bandwidth measured in the same run.

    python benchmarks/attention_check.py --out benchmarks/results/attention      # CUDA: full check + timing
    python benchmarks/attention_check.py --quick --out /tmp/attn                 # CPU: interpreter smoke run
    python benchmarks/attention_check.py --sweep --out ...     # also time split counts and tile variants
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Model shapes: (H, KVH, D).
MODELS = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
# (model, requests, query rows per request, context tokens before the rows); rows 1 = decode, > 1 = verify,
# rows -n = ragged verify: each request draws 1..n rows and a context in [ctx / 2, ctx].
FULL_CASES = [
    ("smollm2-135m", 1, 1, 4096),
    ("smollm2-135m", 8, 1, 2048),
    ("smollm2-135m", 8, 8, 4096),
    ("smollm2-135m", 64, 1, 2048),
    ("smollm2-135m", 64, 4, 2048),
    ("smollm2-135m", 256, 1, 1024),
    ("llama3-8b", 1, 1, 4096),
    ("llama3-8b", 8, 1, 4096),
    ("llama3-8b", 8, 8, 4096),
    ("llama3-8b", 64, 1, 2048),
    ("llama3-8b", 64, 4, 2048),
    ("llama3-8b", 128, 2, 4096),
    ("smollm2-135m", 64, -8, 4096),
    ("llama3-8b", 64, -8, 4096),
]
QUICK_CASES = [("smollm2-135m", 2, 1, 40), ("smollm2-135m", 3, -4, 24)]
SPLIT_SWEEP = (2, 4, 8, 16)
SWEEP = [dict(block_n=bn, num_warps=w, num_stages=s) for bn in (32, 64) for w in (4, 8) for s in (2, 3)]


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                self.scale)


def make_batch(model: str, q_lens: list[int], ctx_lens: list[int], pad_rows: int, page: int,
               dtype: torch.dtype, device: torch.device, gen: torch.Generator, copies: int = 1,
               max_blocks: int | None = None) -> tuple[Batch, list[torch.Tensor]]:
    """One ragged batch; ``copies`` block tables over disjoint pages of one shared cache.

    Values are drawn on the device (GBs of cache for the large cases); ``gen`` (CPU) orders the pages.
    """
    num_heads, kv_heads, head_dim = MODELS[model]
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    pages = [-(-s // page) for s in seq_lens]
    width = max_blocks or max(max(pages, default=1), 1)
    per_copy = sum(pages)
    num_blocks = per_copy * copies + 1
    shape = (num_blocks, page, kv_heads, head_dim)
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    k_cache = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    tables = []
    for c in range(copies):
        order = torch.randperm(per_copy, generator=gen) + 1 + c * per_copy
        table = torch.zeros((len(q_lens), width), dtype=torch.int32)
        cursor = 0
        for r, count in enumerate(pages):
            table[r, :count] = order[cursor:cursor + count].int()
            cursor += count
        tables.append(table.to(device))
    rows = sum(q_lens) + pad_rows
    q = torch.randn((rows, num_heads, head_dim), generator=dev_gen, device=device, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    batch = Batch(q, k_cache, v_cache, tables[0], torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl,
                  head_dim ** -0.5)
    return batch, tables


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) if got.numel() else 0.0


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return bool(torch.allclose(got.float(), want.float(), atol=tol, rtol=tol))


def check_correctness(ta: Any, device: torch.device, dtype: torch.dtype, tol: float,
                      gen: torch.Generator, quick: bool) -> list[dict[str, Any]]:
    """Kernel vs reference on ragged batches: zero-row requests, padding rows, split and unsplit."""
    cases = [([3, 0, 1, 8, 2], [10, 4, 70, 0, 17], 3)]
    if not quick:
        cases += [([1, 8, 0, 3, 5, 1], [900, 20, 7, 3000, 0, 4095], 5), ([0, 0, 4], [100, 0, 2000], 0)]
    results = []
    for model in MODELS:
        for q_lens, ctx_lens, pad in cases:
            batch, _ = make_batch(model, q_lens, ctx_lens, pad, 16, dtype, device, gen)
            want = ta.torch_reference(*batch.args())
            for splits in (None, 1, 3):
                out = torch.full_like(batch.q, float("nan"))
                ta._launch(*batch.args(), out, num_splits=splits)
                ok = close(out, want, tol) and bool(torch.all(out[sum(q_lens):] == 0))
                results.append(dict(model=model, q_lens=q_lens, ctx_lens=ctx_lens, pad_rows=pad,
                                    num_splits=splits, max_abs_err=max_err(out, want), ok=ok))
    return results


def check_graph(ta: Any, device: torch.device, dtype: torch.dtype, tol: float,
                gen: torch.Generator) -> list[dict[str, Any]]:
    """Capture once, replay with new lengths/tables/contents copied into the static buffers."""
    steps = [([2, 2, 2, 2], [10, 100, 1000, 3]), ([5, 0, 1, 0], [300, 4, 17, 0]), ([1, 1, 1, 1], [0, 0, 5, 2040]),
             ([0, 8, 0, 0], [0, 1900, 0, 0])]
    rows, width, page = 10, 2048 // 16 + 1, 16
    results = []
    for model in MODELS:
        batches = [make_batch(model, q, c, rows - sum(q), page, dtype, device, gen, max_blocks=width)[0]
                   for q, c in steps]
        blocks = max(b.k_cache.shape[0] for b in batches)
        static = Batch(torch.empty_like(batches[0].q),
                       torch.zeros((blocks, *batches[0].k_cache.shape[1:]), dtype=dtype, device=device),
                       torch.zeros((blocks, *batches[0].k_cache.shape[1:]), dtype=dtype, device=device),
                       torch.zeros_like(batches[0].block_tables), torch.zeros_like(batches[0].seq_lens),
                       torch.zeros_like(batches[0].query_start_loc), batches[0].scale)

        def load(src: Batch, static: Batch = static) -> None:
            static.q.copy_(src.q)
            static.k_cache[: src.k_cache.shape[0]].copy_(src.k_cache)
            static.v_cache[: src.v_cache.shape[0]].copy_(src.v_cache)
            static.block_tables.copy_(src.block_tables)
            static.seq_lens.copy_(src.seq_lens)
            static.query_start_loc.copy_(src.query_start_loc)

        for splits in (None, 1):  # the shape-chosen split count (split-K here: few programs) and none
            out = torch.empty_like(static.q)

            def attend(static: Batch = static, splits: int | None = splits, out: torch.Tensor = out) -> None:
                if splits is None:
                    ta.paged_attention_varlen(*static.args(), out=out)
                else:
                    ta._launch(*static.args(), out, num_splits=splits)

            load(batches[0])
            attend()  # compile outside the capture
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # a hidden host sync would raise here
            try:
                attend()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                attend()
            for i, (src, (q_lens, ctx_lens)) in enumerate(zip(batches[1:] + batches[:1], steps[1:] + steps[:1],
                                                             strict=True)):
                load(src)
                out.fill_(float("nan"))  # stale values a replay must overwrite (padding rows included)
                graph.replay()
                want = ta.torch_reference(*static.args())
                ok = close(out, want, tol) and bool(torch.all(out[sum(q_lens):] == 0))
                results.append(dict(model=model, num_splits="auto" if splits is None else splits, replay=i,
                                    q_lens=q_lens, ctx_lens=ctx_lens, max_abs_err=max_err(out, want), ok=ok))
    return results


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Device copy bandwidth (read + write bytes per second), the practical HBM ceiling, median of 20."""
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB, far beyond L2
    dst = torch.empty_like(src)
    times = []
    for _ in range(22):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:]) / 1e9


def time_graph_us(calls: list[Callable[[], Any]], device: torch.device, replays: int) -> float:
    """Median µs per call: one graph runs every call back to back; each replay is timed with CUDA events."""
    for call in calls:
        call()  # compile / warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def time_cpu_us(call: Callable[[], Any], replays: int) -> float:
    times = []
    for _ in range(replays):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def bench_case(ta: Any, case: tuple[str, int, int, int], device: torch.device, dtype: torch.dtype,
               gen: torch.Generator, args: argparse.Namespace, copy_gbps: float | None,
               tol: float) -> list[dict[str, Any]]:
    model, num_reqs, rows, ctx = case
    if rows > 0:
        q_lens, ctx_lens = [rows] * num_reqs, [ctx] * num_reqs
    else:
        q_lens = torch.randint(1, -rows + 1, (num_reqs,), generator=gen).tolist()
        ctx_lens = torch.randint(ctx // 2, ctx + 1, (num_reqs,), generator=gen).tolist()
    num_heads, kv_heads, head_dim = MODELS[model]
    elem = torch.tensor([], dtype=dtype).element_size()
    # The floor: every visible K and V byte once (partial pages are not charged), q read and out written.
    kv_bytes = (2 * sum(c + n for c, n in zip(ctx_lens, q_lens, strict=True)) * kv_heads * head_dim * elem
                + 2 * sum(q_lens) * num_heads * head_dim * elem)
    # Enough disjoint copies of the KV pages that one replay's working set is >= 4x a 60 MB L2.
    copies = 1 if device.type != "cuda" else int(min(64, max(2, math.ceil(256e6 / kv_bytes))))
    batch, tables = make_batch(model, q_lens, ctx_lens, 0, args.page, dtype, device, gen, copies=copies)
    want = ta.torch_reference(*batch.args())
    out = torch.empty_like(batch.q)
    variants: list[tuple[str, dict[str, Any]]] = [("auto", {}), ("no-split", {"num_splits": 1})]
    if args.sweep:
        variants += [(f"split{n}", {"num_splits": n}) for n in SPLIT_SWEEP]
        variants += [(f"bn{v['block_n']}-w{v['num_warps']}-s{v['num_stages']}", v) for v in SWEEP]
    results = []
    for name, kwargs in variants:
        def call(table: torch.Tensor, kwargs: dict[str, Any] = kwargs) -> Callable[[], Any]:
            return lambda: ta._launch(batch.q, batch.k_cache, batch.v_cache, table, batch.seq_lens,
                                      batch.query_start_loc, batch.scale, out, **kwargs)

        call(tables[0])()
        err, ok = max_err(out, want), close(out, want, tol)
        if device.type == "cuda":
            us = time_graph_us([call(t) for t in tables], device, args.replays)
        else:
            us = time_cpu_us(call(tables[0]), max(args.replays // 10, 1))
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
        plan = ta._plan(batch.q.shape[0], num_heads, head_dim, kv_heads, args.page, num_reqs,
                        batch.block_tables.shape[1], sms, dtype == torch.float32, **kwargs)
        floor_us = kv_bytes / (copy_gbps * 1e3) if copy_gbps else None
        results.append(dict(
            model=model, reqs=num_reqs, rows_per_req=rows if rows > 0 else f"1..{-rows}", rows=batch.q.shape[0],
            ctx=ctx, variant=name, num_splits=plan.num_splits, block_m=plan.block_m, block_n=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages,
            kv_copies=copies, bytes=kv_bytes, median_us=us, floor_us=floor_us,
            achieved_gbps=kv_bytes / (us * 1e3), pct_of_copy_bw=(100 * floor_us / us) if floor_us else None,
            max_abs_err=err, ok=ok,
        ))
    return results


def render(results: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("model", "R", "rows/req", "ctx", "variant", "splits", "MB", "median µs", "floor µs",
                "GB/s", "% copy BW", "max err", "ok"):
        table.add_column(col, justify="left" if col in ("model", "variant") else "right")
    for r in results:
        table.add_row(r["model"], str(r["reqs"]), str(r["rows_per_req"]), str(r["ctx"]), r["variant"],
                      str(r["num_splits"]), f"{r['bytes'] / 1e6:.1f}", f"{r['median_us']:.1f}",
                      "-" if r["floor_us"] is None else f"{r['floor_us']:.1f}", f"{r['achieved_gbps']:.0f}",
                      "-" if r["pct_of_copy_bw"] is None else f"{r['pct_of_copy_bw']:.0f}%",
                      f"{r['max_abs_err']:.1e}", "yes" if r["ok"] else "NO")
    Console(width=200).print(table)


def write_json(path: Path, obj: Any) -> None:
    try:
        from dspark_cli.fileio import atomic_write_json
    except ImportError:  # orjson is not on every GPU host; the stdlib writes the same JSON
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=2)
        os.replace(tmp, path)
        return
    atomic_write_json(path, obj)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for attention_check.json")
    ap.add_argument("--quick", action="store_true", help="tiny shapes; on CPU runs the Triton interpreter")
    ap.add_argument("--sweep", action="store_true", help="also time block_n x num_warps x num_stages variants")
    ap.add_argument("--page", type=int, default=16, help="KV block size (tokens per page) for the timed cases")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.quick:
            print("no CUDA device: run with --quick to exercise the script under the Triton interpreter")
            return 2
        # Must precede the first triton import: triton picks compiled vs interpreted when it is imported.
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from dspark_cli.engines.embedded import triton_attention as ta
    except ImportError as exc:
        print(f"cannot import the kernel module: {exc}")
        return 2
    if not ta.triton_available():
        print("triton is not installed here; pip install triton")
        return 2

    device = torch.device("cuda" if cuda else "cpu")
    # bf16 on CUDA (what the engine runs); fp16 under the interpreter, whose bf16 tl.dot is not faithful.
    dtype = torch.bfloat16 if cuda else torch.float16
    tol = 2e-2 if cuda else 3e-3
    gen = torch.Generator().manual_seed(args.seed)
    started = time.time()

    correctness = check_correctness(ta, device, dtype, tol, gen, args.quick)
    graph = check_graph(ta, device, dtype, tol, gen) if cuda else []
    copy_gbps = copy_bandwidth_gbps(device) if cuda else None
    cases = QUICK_CASES if args.quick else FULL_CASES
    timings = [row for case in cases for row in bench_case(ta, case, device, dtype, gen, args, copy_gbps, tol)]

    import triton

    device_name = torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or 'cpu'}), interpreter"
    all_ok = all(r["ok"] for r in correctness + graph + timings)
    report = dict(
        device=device_name, torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0],
        dtype=str(dtype).removeprefix("torch."), page=args.page, copy_bandwidth_gbps=copy_gbps,
        quick=args.quick, all_ok=all_ok, correctness=correctness, graph_replays=graph, timings=timings,
        seconds=time.time() - started,
    )
    path = args.out / "attention_check.json"
    write_json(path, report)
    bw = f", copy bandwidth {copy_gbps:.0f} GB/s" if copy_gbps else ""
    render(timings, f"paged attention on {device_name} ({report['dtype']}, page {args.page}{bw})")
    print(f"correctness: {sum(r['ok'] for r in correctness)}/{len(correctness)} ok; "
          f"graph replays: {sum(r['ok'] for r in graph)}/{len(graph)} ok"
          f"{'' if cuda else ' (no CUDA: graph check skipped)'}; wrote {path}")
    print("ALL OK" if all_ok else "FAILURES: see the JSON")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
