"""What `dspark serve` itself costs per streamed token: the HTTP server, the detokenizer, SSE, the client.

On the H200 a no-speculation decode step at 256 requests takes 5.1 ms in the engine alone and ~18.5 ms inside
a served benchmark cell (docs/PERFORMANCE.md section 13): per-token work outside the model sets the ceiling
of every configuration there. This script measures that work without a model. The real server (aiohttp
app, AsyncEngine thread, incremental detokenizer with the real tokenizer, stop-string handling, SSE
chunks) runs in a child process in front of a **null engine**: each step sleeps ``--step-ms`` (releasing the
interpreter lock as a device-bound step does) and then gives every running request its next token of a
fixed real text. `dspark bench`'s own client drives it from this process, as in a matrix cell.

    python3 benchmarks/server_overhead.py -c 16,64,256 --step-ms 5 --out benchmarks/results/server_overhead

Per concurrency it prints output tok/s, what a step really took (wall / steps) against the engine's
``--step-ms``, and the server + client time per token, ``(wall - steps x step_ms) / tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dspark_cli.bench.client import LoadConfig, aggregate, run_load
from dspark_cli.bench.datasets import Prompt
from dspark_cli.engines.embedded.engine import RequestOutput
from dspark_cli.fileio import atomic_write_json

TEXT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May? She sold 48 / 2 = 24 clips in May, so "
        "she sold 48 + 24 = 72 clips altogether. The answer is 72. ")


class NullEngine:
    """The engine interface the server uses, without a model: ``step`` sleeps ``step_ms`` and then emits the
    next token of a fixed text for every running request (up to ``max_num_seqs``; the rest wait)."""

    def __init__(self, tokenizer_path: str, step_ms: float, max_num_seqs: int, host_ms: float = 0.0) -> None:
        from transformers import AutoTokenizer

        from dspark_cli.engines.embedded.engine import EngineStats

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.text_ids = self.tokenizer(TEXT * 8, add_special_tokens=False)["input_ids"]
        self.step_s = step_ms / 1e3
        self.host_s = host_ms / 1e3
        self.max_num_seqs = max_num_seqs
        self.num_spec = 0
        self.vocab_size = len(self.tokenizer)
        self.stats = EngineStats()
        self._reqs: dict[str, list[int]] = {}  # request -> [tokens emitted, max_tokens]

        class _Cfg:
            max_model_len = 4096

        self.config = _Cfg()

    def add_request(self, request_id: str, prompt_ids: list[int], params: Any) -> None:
        self._reqs[request_id] = [0, params.max_tokens]
        self.stats.prompt_tokens += len(prompt_ids)

    def abort_request(self, request_id: str) -> None:
        if self._reqs.pop(request_id, None) is not None:
            self.stats.requests_finished["abort"] = self.stats.requests_finished.get("abort", 0) + 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[RequestOutput]:
        # A real step holds the interpreter lock for its host work (inputs before the device runs, sampling
        # and emission after) and releases it while it waits on the device; half the host work on each side.
        _hold(self.host_s / 2)
        time.sleep(self.step_s)
        _hold(self.host_s / 2)
        self.stats.num_steps += 1
        outs = []
        for rid in list(self._reqs)[: self.max_num_seqs]:
            state = self._reqs[rid]
            tok = self.text_ids[state[0] % len(self.text_ids)]
            state[0] += 1
            done = state[0] >= state[1]
            if done:
                del self._reqs[rid]
                self.stats.requests_finished["length"] = self.stats.requests_finished.get("length", 0) + 1
            self.stats.generation_tokens += 1
            outs.append(RequestOutput(rid, [tok], done, "length" if done else None))
        self.stats.num_running = min(len(self._reqs), self.max_num_seqs)
        return outs

    def close(self) -> None:
        pass


def _hold(seconds: float) -> None:
    """Busy Python for ``seconds`` (holding the interpreter lock but at its switch checks, like host work)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _serve(port: int, tokenizer_path: str, step_ms: float, max_num_seqs: int, host_ms: float,
           switch_interval_ms: float | None, engine_process: bool = False) -> None:
    import functools
    import sys

    from dspark_cli.engines.embedded.server import ServerOptions, run_server

    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1e3)
    run_server(functools.partial(NullEngine, tokenizer_path, step_ms, max_num_seqs, host_ms),
               ServerOptions("127.0.0.1", port, "null", (), 0, engine_process=engine_process))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(port: int, timeout_s: float = 120.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"the null-engine server on port {port} did not become healthy in {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--concurrency", default="16,64,256", help="comma list of requests in flight")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the null engine's step time (an H200 decode step)")
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="host work per step the null engine does holding the interpreter lock (an H200 step: ~2)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="the server's interpreter switch interval (sys.setswitchinterval; default Python's 5 ms)")
    ap.add_argument("--engine-process", action="store_true",
                    help="run the null engine in a process of its own (dspark serve --engine-process); "
                         "server CPU then leaves the engine process out")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2, help="requests per cell = waves x concurrency")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the cached SmolLM2-135M)")
    ap.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.tokenizer is None:
        from dspark_cli.engines.embedded import assets

        args.tokenizer = str(assets.resolve_model("smollm2-135m", draft=None).target)
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    port = _free_port()
    ctx = mp.get_context("spawn")
    server = ctx.Process(target=_serve, args=(port, args.tokenizer, args.step_ms, max(concs), args.host_ms,
                                                    args.switch_interval_ms, args.engine_process))
    server.start()
    rows = []
    try:
        _wait_healthy(port)
        for c in concs:
            prompts = [Prompt(text=f"Question {i}: how many clips did Natalia sell?") for i in range(args.waves * c)]
            cfg = LoadConfig(base_url=f"http://127.0.0.1:{port}", endpoint=args.endpoint, model="null",
                             max_tokens=args.max_tokens, concurrency=c)
            server_cpu, client_cpu = _cpu_s(server.pid), time.process_time()
            results, wall, _ = asyncio.run(run_load(prompts, cfg))
            server_cpu, client_cpu = _cpu_s(server.pid) - server_cpu, time.process_time() - client_cpu
            m = aggregate(results, wall)
            tokens = int(m["total_output_tokens"])
            steps = args.waves * args.max_tokens  # each wave takes max_tokens steps at best
            rows.append({
                "concurrency": c, "output_tok_s": m["output_tok_s"], "tokens": tokens, "wall_s": wall,
                "failed": m["failed"], "ideal_tok_s": c * 1e3 / args.step_ms,
                "ms_per_step": wall * 1e3 / steps,
                "us_per_token": max(0.0, (wall - steps * args.step_ms / 1e3) * 1e6 / max(tokens, 1)),
                "itl_median_ms": (m.get("itl_ms") or {}).get("median"),
                # Share of one core each process kept busy: near 1, that process is the bottleneck.
                "server_cpu": server_cpu / wall, "client_cpu": client_cpu / wall,
            })
    finally:
        server.terminate()
        server.join(10)
    front = "engine process" if args.engine_process else "engine thread"
    table = Table(title=f"dspark serve in front of a null engine ({args.step_ms:g} ms steps, {args.endpoint}, {front})")
    for col in ("c", "tok/s", "ideal tok/s", "ms / step", "server+client µs / token", "server CPU",
                "client CPU", "failed"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["concurrency"]), f"{r['output_tok_s']:,.0f}", f"{r['ideal_tok_s']:,.0f}",
                      f"{r['ms_per_step']:.2f}", f"{r['us_per_token']:.1f}", f"{r['server_cpu']:.0%}",
                      f"{r['client_cpu']:.0%}", str(r["failed"]))
    Console().print(table)
    if args.out is not None:
        out = atomic_write_json(args.out / "server_overhead.json", {
            "args": {k: str(v) for k, v in vars(args).items()}, "machine": platform.processor() or platform.machine(),
            "rows": rows})
        print(f"written: {out}")


if __name__ == "__main__":
    main()
