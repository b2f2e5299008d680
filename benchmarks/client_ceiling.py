"""How many stream chunks a second `dspark bench`'s client takes in, against a server that paces like an engine.

On the H200 (docs/PERFORMANCE.md section 29), vLLM servers that emit one token per request and step streamed
6,000-9,500 tokens/s at 256 requests, although their decode steps (~10 ms) could emit ~25,000. Either the server's
API process or the bench client may be what sets that pace. This measures the client alone, on this host: a
stand-in server (its own process, aiohttp) sends every open stream one OpenAI-style completion chunk per
"step" of ``--step-ms``, all streams in the same step, as an engine's output would. At 256 streams and 10 ms a
step, that asks the client for 25,600 chunks/s. The client is the bench's own (``bench.client.run_load``: the
same request, parsing and timing code as a cell). Each row gives what the client achieved against what the
steps offered, its median ITL against the step, and the CPU share of a core that the client and the stand-in
server used (``bench.cpu``).

    python3 benchmarks/client_ceiling.py [--concurrency 16,64,256] [--step-ms 10,5] [--tokens 128] [--waves 2]

Prints a table and writes ``--out`` (JSON) when given. A client share near 1 with achieved below offered
means the client is the limit on this host. So does a stand-in server near 1: the stand-in then is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_cli.bench.client import LoadConfig, aggregate, run_load  # noqa: E402
from dspark_cli.bench.cpu import CpuSnapshot, CpuUse  # noqa: E402
from dspark_cli.bench.datasets import Prompt  # noqa: E402
from dspark_cli.bench.matrix import _free_port  # noqa: E402


def _serve(port: int, step_ms: float, ready: mp.Event) -> None:  # type: ignore[valid-type]
    """The stand-in server: a step clock, and one chunk per open stream per step."""
    from aiohttp import web

    async def main() -> None:
        tick = asyncio.Condition()
        step = 0

        async def clock() -> None:
            nonlocal step
            while True:
                await asyncio.sleep(step_ms / 1e3)
                async with tick:
                    step += 1
                    tick.notify_all()

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "stand-in"}]})

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            n = int(body["max_tokens"])
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(1, n + 1):
                if step_ms > 0:
                    async with tick:
                        await tick.wait()
                chunk = {"id": "cmpl", "object": "text_completion", "model": "stand-in",
                         "choices": [{"index": 0, "text": " x", "finish_reason": None if i < n else "length"}],
                         "usage": {"prompt_tokens": 16, "completion_tokens": i, "total_tokens": 16 + i}}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        if step_ms > 0:
            asyncio.get_running_loop().create_task(clock())
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def measure(concurrency: int, step_ms: float, tokens: int, waves: int) -> dict:
    """One cell against a fresh stand-in server: achieved tok/s, ITL and CPU shares."""
    port = _free_port("127.0.0.1")
    ready = mp.Event()
    server = mp.Process(target=_serve, args=(port, step_ms, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the stand-in server did not start")
        load = LoadConfig(base_url=f"http://127.0.0.1:{port}", endpoint="completions", model="stand-in",
                          max_tokens=tokens, concurrency=concurrency)
        prompts = [Prompt(text=f"prompt {i}") for i in range(waves * concurrency)]
        use = CpuUse(server.pid)
        before = CpuSnapshot.take(server.pid)
        results, wall, _ = asyncio.run(run_load(prompts, load))
        use.add(before, CpuSnapshot.take(server.pid))
    finally:
        server.kill()
        server.join()
    m = aggregate(results, wall)
    offered = concurrency * 1e3 / step_ms if step_ms > 0 else None
    return {"concurrency": concurrency, "step_ms": step_ms, "tokens": tokens, "waves": waves,
            "completed": m["completed"], "output_tok_s": round(m["output_tok_s"], 1),
            "offered_tok_s": offered, "median_itl_ms": round(m["itl_ms"]["median"], 3),
            "mean_itl_ms": round(m["itl_ms"]["mean"], 3), "tokens_per_chunk": m["tokens_per_chunk"],
            "cpu": use.to_dict()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="16,64,256")
    ap.add_argument("--step-ms", default="10,5", help="comma list; 0 sends every chunk as fast as it can")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="cells per row; the row gives the median")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}")
    print("| c | step ms | offered tok/s | achieved tok/s | median ITL ms | client CPU | server CPU |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for step in (float(x) for x in args.step_ms.split(",")):
        for c in (int(x) for x in args.concurrency.split(",")):
            cells = [measure(c, step, args.tokens, args.waves) for _ in range(args.repeat)]
            mid = sorted(cells, key=lambda r: r["output_tok_s"])[len(cells) // 2]
            row = {**mid, "runs": [r["output_tok_s"] for r in cells],
                   "client_share_median": statistics.median(r["cpu"]["client_share"] for r in cells),
                   "server_share_median": statistics.median(r["cpu"]["server_share"] for r in cells)}
            rows.append(row)
            offered = f"{row['offered_tok_s']:,.0f}" if row["offered_tok_s"] else "-"
            print(f"| {c} | {step:g} | {offered} | {row['output_tok_s']:,.0f} | {row['median_itl_ms']:.2f} | "
                  f"{row['client_share_median']:.2f} | {row['server_share_median']:.2f} |", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"host": {"processor": platform.processor(), "cpus": os.cpu_count(),
                                                 "python": platform.python_version()},
                                        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
