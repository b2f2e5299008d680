"""FlashInfer against the Triton kernel as the embedded engine runs them: one captured forward of L layers.

For each case (model shape, requests, query rows per request, context) both backends attend the same ragged
batch from L layers' own KV caches (one AttentionInputs shared by the layers, as in the model; each layer's
cache is separate, so the working set is L times a layer's KV and comes from HBM), captured in one CUDA
graph at the engine's padded size. Per-layer time is the median replay time over L. Every case is checked
against the torch reference first (layer 0, bf16 tolerance); a replay after new lengths are copied in is
checked too, and a forward of the captured shape runs under ``set_sync_debug_mode("error")`` (no host sync).

    python benchmarks/attention_backends.py --out benchmarks/results/h200/attention_backends     # CUDA
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from dspark_cli.engines.embedded.attention import TorchPagedAttention, build_attention_inputs, get_backend

MODELS = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
# (model, requests, rows per request (negative: ragged 1..n), context tokens)
CASES = [
    ("smollm2-135m", 1, 1, 4096),
    ("smollm2-135m", 1, 8, 4096),
    ("smollm2-135m", 16, -8, 2048),
    ("smollm2-135m", 64, -8, 2048),
    ("smollm2-135m", 256, 1, 1024),
    ("smollm2-135m", 256, -8, 1024),
    ("llama3-8b", 1, 1, 4096),
    ("llama3-8b", 16, -8, 4096),
    ("llama3-8b", 64, 1, 2048),
    ("llama3-8b", 64, -8, 2048),
    ("llama3-8b", 256, -8, 1024),
]
PAGE = 16


def build(model: str, reqs: int, rows: int, ctx: int, layers: int, gen: torch.Generator) -> dict[str, Any]:
    heads, kv_heads, dim = MODELS[model]
    q_lens = (torch.randint(1, -rows + 1, (reqs,), generator=gen).tolist() if rows < 0 else [rows] * reqs)
    ctx_lens = torch.randint(ctx // 2, ctx + 1, (reqs,), generator=gen).tolist() if rows < 0 else [ctx] * reqs
    tokens = 1 << (sum(q_lens) - 1).bit_length()  # the engine's padded (power-of-two) captured size
    width = -(-(ctx + 8) // PAGE)
    pages = [-(-(c + n) // PAGE) for c, n in zip(ctx_lens, q_lens, strict=True)]
    num_blocks = sum(pages) + 1
    dev = torch.device("cuda")
    caches = [(torch.randn(num_blocks, PAGE, kv_heads, dim, device=dev, dtype=torch.bfloat16),
               torch.randn(num_blocks, PAGE, kv_heads, dim, device=dev, dtype=torch.bfloat16)) for _ in range(layers)]
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(reqs, width, dtype=torch.int64)
    positions = torch.zeros(tokens, dtype=torch.int64)
    req = torch.full((tokens,), reqs, dtype=torch.int64)
    pad = torch.ones(tokens, dtype=torch.bool)
    t = cursor = 0
    for r, (n, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        tables[r, :pages[r]] = order[cursor:cursor + pages[r]]
        cursor += pages[r]
        positions[t:t + n] = torch.arange(c, c + n)
        req[t:t + n] = r
        pad[t:t + n] = False
        t += n
    return dict(
        q=torch.randn(tokens, heads, dim, device=dev, dtype=torch.bfloat16),
        k=torch.randn(tokens, kv_heads, dim, device=dev, dtype=torch.bfloat16),
        v=torch.randn(tokens, kv_heads, dim, device=dev, dtype=torch.bfloat16),
        positions=positions.to(dev), req=req.to(dev), pad=pad.to(dev),
        start=torch.tensor(ctx_lens, device=dev), tables=tables.to(dev), caches=caches, width=width,
        max_query_len=-rows if rows < 0 else rows, tokens=tokens, rows=sum(q_lens),
    )


def inputs_of(b: dict[str, Any], captured: bool):  # type: ignore[no-untyped-def]
    return build_attention_inputs(b["positions"], b["req"], b["pad"], b["start"], b["tables"], PAGE,
                                  b["max_query_len"], b["width"] * PAGE, captured)


def forward(backend: Any, b: dict[str, Any], out: torch.Tensor, captured: bool) -> None:
    inputs = inputs_of(b, captured)
    scale = b["q"].shape[-1] ** -0.5
    for i, (kc, vc) in enumerate(b["caches"]):
        res = backend.forward(b["q"], b["k"], b["v"], kc, vc, inputs, scale)
        if i == 0:
            out.copy_(res)


def time_case(name: str, b: dict[str, Any], replays: int) -> dict[str, Any]:
    backend = get_backend(name, torch.device("cuda"), torch.bfloat16)
    out = torch.empty_like(b["q"])
    live = ~b["pad"]
    ref = TorchPagedAttention().forward(b["q"], b["k"], b["v"], *b["caches"][0], inputs_of(b, False),
                                        b["q"].shape[-1] ** -0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        forward(backend, b, out, True)  # plans / compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync in a captured-shape forward would raise here
    try:
        with torch.inference_mode():
            forward(backend, b, out, True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    err_eager = float((out[live].float() - ref[live].float()).abs().max())
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        forward(backend, b, out, True)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    err_graph = float((out[live].float() - ref[live].float()).abs().max())
    times = []
    for i in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1000 / len(b["caches"]))
    return dict(backend=name, us_per_layer=statistics.median(times), max_abs_err_eager=err_eager,
                max_abs_err_graph=err_graph, ok=err_eager < 3e-2 and err_graph < 3e-2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'case':<34} {'T':>5} {'triton us':>10} {'flashinfer us':>14} {'fi/triton':>9}  ok")
    for model, reqs, per, ctx in CASES:
        b = build(model, reqs, per, ctx, args.layers, gen)
        res = {name: time_case(name, b, args.replays) for name in ("triton", "flashinfer")}
        ratio = res["flashinfer"]["us_per_layer"] / res["triton"]["us_per_layer"]
        ok = res["triton"]["ok"] and res["flashinfer"]["ok"]
        label = f"{model} R={reqs} rows={per} ctx={ctx}"
        print(f"{label:<34} {b['tokens']:>5} {res['triton']['us_per_layer']:>10.1f} "
              f"{res['flashinfer']['us_per_layer']:>14.1f} {ratio:>9.2f}  {'OK' if ok else 'FAIL'}", flush=True)
        rows.append(dict(model=model, requests=reqs, rows_per_request=per, context=ctx, tokens=b["tokens"],
                         live_rows=b["rows"], results=res, flashinfer_over_triton=ratio, ok=ok))
        del b
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                layers=args.layers, replays=args.replays)
    (args.out / "attention_backends.json").write_text(json.dumps(dict(meta=meta, cases=rows), indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} cases OK")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
