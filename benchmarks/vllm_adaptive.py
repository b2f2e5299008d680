"""GPU proof for the vLLM plugin: upstream's adaptive verification vs dspark varlen vs dspark mask.

On the H200 with vLLM 0.33.0 installed (docs: GPU.md), serve a target with a draft model (method
"draft_model") several ways, bench each server at every concurrency, print one table and write
``results.json`` (this invocation's; ``results-<start time>.json`` keeps a copy per invocation) plus each server
log and bench result into OUT::

    python3 benchmarks/vllm_adaptive.py --model SMOLLM_DIR --draft DRAFT_DIR --out OUT [--load-format dummy]

The toolkit is run from the tree (no pip install), so the script registers the plugin's entry point for
the servers it starts through a throw-away ``.dist-info`` on their PYTHONPATH. Each server's log is checked
for the plugin's own start-up line, so a silently inactive plugin fails the run instead of measuring
upstream twice. Budget: ~1.5 min per config (start-up with FULL_DECODE_ONLY and no torch.compile), < 8 min.
``--overlap-starts N`` starts N configs' servers on the one GPU in a staggered row (each once the previous
one has sized its KV cache) and measures them one at a time once all of them are up, each with its
``--gpu-memory-utilization`` share; the group is stopped together. ``--kv-cache-gib G`` gives every server a KV
cache of G GiB (vLLM's ``--kv-cache-memory-bytes``: no memory profile sizes it from the device's free memory), so
the group's servers start all at once instead of in a row: every config gets the same KV cache, and a group of
four 8B-shaped servers is up in about the time of one start instead of four (~76 s each in a row,
docs/PERFORMANCE.md section 18).

The client is ``dspark bench --base-url`` (default): every server's cells land in ``OUT/bench``, whose
summary is one table over all configs (random prompts of --input-len tokens, equal work per cell); its
cells resume, so a config cut off by a time limit is simply run again. ``--client vllm`` uses
``vllm bench serve`` instead (its JSON per cell in OUT).

Configs: nospec, all (verify every draft), upstream (vLLM's adaptive verification), varlen and mask (ours,
with --dspark; mask's paused steps run compacted, on varlen graphs, as mask-compact names explicitly),
mask-uniform (mask whose paused steps stay the uniform 1 + k batch), and ablations of ours: varlen-nosat (no
saturation policy), varlen-nosts (no STS), varlen-startup (vLLM's start-up profile instead of the --dspark
sps_curve), varlen-current (the draft's K/V kept current on every paused step instead of caught up:
engines/vllm/upkeep.py).

``--rounds N`` measures each group in N paired rounds: every server of the group gets 1/N of the prompts per
round (fresh random prompts each round), the group's configs in a rotated order each round, so that what drifts
over a group's minutes lands on every config alike; ``paired.md`` then gives, per concurrency, each config's
median and range over the rounds of its tok/s against the reference config (``--pair-with``, default nospec) of
the same group and round. One cell per config was not enough on a GPU shared by four resident servers: two
servers running the same paused steps read 10 points apart at 16 requests (docs/PERFORMANCE.md section 25). A
config may be named twice as ``name#tag`` (``nospec#2``: the same server config, a second server), so that every
group carries its own reference, and an A/A pair shows the floor. ``name@N`` serves that config with N API server
processes (vLLM's ``--api-server-count``) whatever ``--api-servers`` says (``nospec@2#b``: both), so that one
group can pair a config served by one API process with the same config served by several.

``--anatomy`` loads the step anatomy of ``benchmarks/vllm_step_anatomy.py`` into every server (its worker
extension, called over vLLM's development endpoint ``/collective_rpc``) and benches one concurrency at a
time, recording each: where a served step's time goes, by kind, with the share of steps that carried a
prefill chunk (``OUT/anatomy/``). It adds a few microseconds of host time per step to every config alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_step_anatomy import EXTENSION as ANATOMY_EXTENSION  # noqa: E402
from benchmarks.vllm_step_anatomy import load_table  # noqa: E402
from benchmarks.vllm_step_anatomy import table as anatomy_table  # noqa: E402
from dspark_cli.bench.matrix import cell_path, load_cell  # noqa: E402
from dspark_cli.bench.metrics import SpecDecodeCounters, counter_delta  # noqa: E402
from dspark_cli.bench.report import numbers, paired_delta_of  # noqa: E402
from dspark_cli.engines.vllm.contract import (  # noqa: E402
    PLUGIN_GROUP,
    PLUGIN_NAME,
    PLUGIN_TARGET,
    profile_overflow,
    warmup_overflow,
)
from dspark_cli.engines.vllm.launcher import plan_vllm_serve  # noqa: E402
from dspark_cli.engines.vllm.manager import REPORT_EVERY_S  # noqa: E402

ACTIVE_LINE = "dspark: adaptive verification by dspark"
# --compilation: every server of a run gets the same. piecewise is `vllm serve`'s own default and the one issue 6
# is judged on. Under decode-graphs a step that carries a prompt chunk runs the target eagerly: at 16 requests that
# cost our paused servers 1-2% against no speculation's, none under piecewise (docs/PERFORMANCE.md section 29).
COMPILATIONS = {
    "decode-graphs": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
    "piecewise": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},
}


def config_parts(name: str) -> tuple[str, int | None]:
    """``varlen@2#b`` -> ``("varlen", 2)``: the spec a config name serves, and the API server count it asks for
    (None: ``--api-servers``). Raises ValueError for a count that is not a positive integer."""
    spec, _, api = name.split("#", 1)[0].partition("@")
    if not api:
        return spec, None
    if not api.isdigit() or int(api) < 1:
        raise ValueError(f"config {name!r}: the API server count after '@' must be a positive integer")
    return spec, int(api)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry_point_dir(tmp: Path) -> Path:
    dist = tmp / "dspark_vllm_plugin-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dspark-vllm-plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n")
    return tmp


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


# Questions in the domain the packaged SmolLM2 draft was distilled on (GSM8K answers): with real weights the
# check must verify drafts that are accepted. On token-id prompts the real pair continued in repetitions the
# draft never predicted, and no config of ours accepted one draft (docs/PERFORMANCE.md section 26).
TEXT_PROMPTS = (
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "Question: A train travels 60 miles per hour for 3 hours. How far does it go?\nAnswer:",
    "Question: Sara reads 12 pages a day. How many pages does she read in a week?\nAnswer:",
    "Question: A shirt costs $20 and is on sale for 25% off. What is the sale price?\nAnswer:",
    "Question: There are 24 students and each table seats 4. How many tables are needed?\nAnswer:",
    "Question: John saves $15 a week. How much has he saved after 8 weeks?\nAnswer:",
    "Question: A box holds 6 eggs. How many boxes are needed for 50 eggs?\nAnswer:",
    "Question: Mia had 40 stickers and gave away 15. How many are left?\nAnswer:",
)


MAX_MODEL_LEN = 2048  # every server's --max-model-len
TAIL_TOKENS = 48  # the tail request decodes this many tokens, up to one short of MAX_MODEL_LEN


def _complete(port: int, model: str, prompt: str | list[int], max_tokens: int) -> list[int]:
    """One greedy completion's token ids (or the text's code points where the server returns no ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choice = json.loads(r.read())["choices"][0]
    return list(choice.get("token_ids") or []) or [ord(ch) for ch in choice["text"]]


def _greedy_outputs(port: int, model: str, n: int, text: bool = False) -> list[list[int]]:
    """Token ids of N fixed prompts, greedy, one request at a time (the same requests for every config):
    token-id sequences (any tokenizer, dummy weights), or with ``text`` the questions of ``TEXT_PROMPTS``."""
    return [_complete(port, model, TEXT_PROMPTS[i % len(TEXT_PROMPTS)] if text
                      else [1 + (37 * i + 11 * j) % 900 for j in range(16 + i)], 32) for i in range(n)]


def _tail_output(port: int, model: str) -> list[int]:
    """The tail request, greedy: a token-id prompt that leaves ``TAIL_TOKENS`` to generate before the model's
    length limit. Near ``max_model_len`` vLLM's scheduler gives a request fewer than K drafts, so its last
    steps replay a varlen decode graph with shorter queries than it was captured for
    (``plugin.bound_query_len``). Reported beside the check, not part of its verdict: over a context of ~2,000
    tokens attention may split its sum differently in two configs' graphs, and a greedy near-tie would then
    read as a failure where the short prompts' contexts fit one attention block."""
    return _complete(port, model, [1 + (29 * j) % 900 for j in range(MAX_MODEL_LEN - 1 - TAIL_TOKENS)], TAIL_TOKENS)


def _acceptance(port: int) -> dict | None:
    """The server's speculative-decoding counters since it started (None without speculation)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        after = SpecDecodeCounters.from_text(r.read().decode())
    stats = counter_delta(SpecDecodeCounters(), after)
    return None if stats is None else stats.to_dict()


SMOKE_STAGGER_S = 0.03  # request i of the concurrent smoke is sent i x this after the first
SMOKE_LONG_PROMPT = 1024  # the smoke's first request: a prompt whose chunks can crowd decoding requests out of a step


def _concurrent_smoke(port: int, model: str, n: int) -> dict:
    """N requests of staggered lengths, request i sent ``i x SMOKE_STAGGER_S`` after the first, so that prompts
    arrive while the others decode (and, where the policy pauses, while it is paused) and requests end mid-batch
    (steps that mix prompt chunks with decoding rows): every one must come back complete. The first request's
    prompt is ``SMOKE_LONG_PROMPT`` tokens: under a small ``--max-num-batched-tokens`` its chunks leave decoding
    requests out of some steps, among them the step that resumes drafting (a request then comes back holding a
    paused step's draft ids). Outputs are not compared -- batch composition changes a real model's numerics --
    only served."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        time.sleep(i * SMOKE_STAGGER_S)
        length = SMOKE_LONG_PROMPT if i == 0 else 8 + 5 * i
        body = {"model": model, "prompt": [1 + (53 * i + 7 * j) % 900 for j in range(length)],
                "max_tokens": 16 + 9 * i, "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return int(json.loads(r.read())["usage"]["completion_tokens"]) - body["max_tokens"]

    with ThreadPoolExecutor(n) as pool:
        short = list(pool.map(one, range(n)))
    return {"requests": n, "complete": sum(d == 0 for d in short)}


UPKEEP_LINE = "draft K/V while paused:"  # the manager's periodic saturation log line (engines/vllm/manager.py)
DEFERRED_RE = re.compile(r"\((\d+) of prompts deferred\)")  # the same line's draft_defer_prompts count
# The draft_defer_prompts A/B of the lossless check: the same pausing config without and with deferred prompts.
DEFER_AB = ("varlen-cycle-plain", "varlen-cycle-defer")
DEFER_AB_MIN_DRAFTS = 30  # drafted request-steps each config needs before the A/B says anything
DEFER_AB_Z = 3.0  # one-sided: first-position acceptance this many standard errors lower fails the A/B


def defer_ab(served: dict[str, dict]) -> dict | None:
    """Whether a draft whose prompts were deferred to the catch-ups drafts as well as one that wrote them as they
    came (``DEFER_AB``; None where the check served neither). Compared: the first draft position's acceptance over
    every drafted request-step of the greedy requests and the concurrent smoke, a binomial share per config. A
    catch-up that missed a deferred prompt leaves the draft without its context, which lowers exactly that.

    Verdicts: ``same`` (not lower by ``DEFER_AB_Z`` standard errors), ``lower``, ``too few drafts`` (under
    ``DEFER_AB_MIN_DRAFTS`` drafted request-steps in a config: probes are rationed by the probe tax), ``not
    exercised`` (the deferring server deferred no prompt token: prefix caching was on, or no prompt came while
    paused)."""
    if not all(name in served for name in DEFER_AB):
        return None
    side = {}
    for name in DEFER_AB:
        acc = served[name].get("acceptance_all") or served[name].get("acceptance") or {}
        per_pos = acc.get("per_position_acceptance") or []
        side[name] = {"drafts": int(acc.get("num_drafts") or 0), "first": per_pos[0] if per_pos else None}
    (a, b), deferred = (side[n] for n in DEFER_AB), served[DEFER_AB[1]].get("deferred_prompt_tokens")
    out = {"configs": list(DEFER_AB), "drafts": [a["drafts"], b["drafts"]], "first_position": [a["first"], b["first"]],
           "deferred_prompt_tokens": deferred, "z": None}
    if not deferred:
        return {**out, "verdict": "not exercised"}
    if min(a["drafts"], b["drafts"]) < DEFER_AB_MIN_DRAFTS or a["first"] is None or b["first"] is None:
        return {**out, "verdict": "too few drafts"}
    pooled = (a["first"] * a["drafts"] + b["first"] * b["drafts"]) / (a["drafts"] + b["drafts"])
    se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / a["drafts"] + 1 / b["drafts"]))
    z = (b["first"] - a["first"]) / se
    return {**out, "z": round(z, 2), "verdict": "lower" if z < -DEFER_AB_Z else "same"}


def _tail_agreement(tail: list[int] | str, ref: list[int] | str) -> str:
    """How a config's tail request compares with no speculation's: identical, or where it first differs (a str
    is a tail request that was not served, and says why)."""
    if isinstance(tail, str):
        return tail
    if isinstance(ref, str):
        return f"no reference: no speculation's was {ref}"
    if tail == ref:
        return f"identical ({len(tail)} tokens)"
    first = next((i for i, (a, b) in enumerate(zip(tail, ref, strict=False)) if a != b), min(len(tail), len(ref)))
    return f"differs from token {first} of {len(ref)}"


def _report_lossless(outputs: dict[str, list[list[int]]], results: list[dict], out: Path,
                     served: dict[str, dict] | None = None, tails: dict[str, list[int] | str] | None = None) -> int:
    """Print and write the check; exit code 0 (every config's N outputs match nospec's and it served), 1 (a config
    failed while it served, or a concurrent request came back short), 3 (some output differs, whether or not every
    config started) or 5 (the configs that started match; others did not start). The tail requests are reported
    per config and kept out of the verdict (``_tail_output``)."""
    ref = outputs.get("nospec")
    table = {}
    served = served or {}
    tails = tails or {}
    for name, outs in outputs.items():
        same = None if ref is None else sum(a == b for a, b in zip(outs, ref, strict=True))
        table[name] = {"identical_to_nospec": same, "prompts": len(outs), **served.get(name, {})}
        if name in tails and "nospec" in tails:
            table[name]["tail"] = _tail_agreement(tails[name], tails["nospec"])
        acc = (served.get(name, {}).get("acceptance") or {}).get("acceptance_length")
        smoke = served.get(name, {}).get("smoke")
        print((f"{name:14} identical to nospec: {same}/{len(outs)}" if ref is not None else f"{name:14} (no nospec)")
              + (f"; acceptance length {acc:.3f}" if acc else "")
              + (f"; concurrent {smoke['complete']}/{smoke['requests']} complete" if smoke else ""))
        upkeep = served.get(name, {}).get("upkeep")
        if upkeep:
            print(f"{'':14} {upkeep}")
        if "tail" in table[name]:
            print(f"{'':14} tail request (up to max_model_len, not in the verdict): {table[name]['tail']}")
    ab = defer_ab(served)
    if ab is not None:
        rates = "/".join("-" if r is None else f"{r:.3f}" for r in ab["first_position"])
        print(f"draft_defer_prompts A/B ({' vs '.join(ab['configs'])}): first-position acceptance {rates} over "
              f"{ab['drafts'][0]}/{ab['drafts'][1]} drafted request-steps, {ab['deferred_prompt_tokens'] or 0} "
              f"prompt tokens deferred" + (f", z {ab['z']:+.2f}" if ab["z"] is not None else "")
              + f": {ab['verdict']}")
    (out / "lossless.json").write_text(json.dumps({"outputs": outputs, "tails": tails, "summary": table,
                                                    "defer_ab": ab,
                                                    "errors": [r for r in results if "error" in r]}, indent=1))
    if any(v.get("smoke") and v["smoke"]["complete"] != v["smoke"]["requests"] for v in table.values()):
        print("lossless greedy: FAILED (a concurrent request came back short)")
        return 1
    failed = [r for r in results if "error" in r]
    errors = [r["error"] for r in failed]
    if any(not e.startswith(NOT_STARTED) for e in errors):
        print("lossless greedy: FAILED (a config did not serve)")
        return 1
    if ref is not None and any(v["identical_to_nospec"] != v["prompts"] for v in table.values()):
        print("lossless greedy: FAILED (outputs differ)")
        return 3  # 3: some config's output differs from nospec's (whether or not every config started)
    if errors:
        # 5 or 6: every failure came before a server was up: nothing says a served path fails (section 37's servers
        # stopped in vLLM's warm-up), so the queue keeps serving the default path. 5: starting them again one at
        # a time may help (a timeout, memory, no cause in the log); 6: each said a cause a lone start repeats.
        retry = any(r.get("retry_alone", True) for r in failed)
        print(f"lossless greedy: FAILED (a config did not start{'' if retry else '; not for want of memory'})")
        return 5 if retry else 6
    if ref is None:
        print("lossless greedy: FAILED (no nospec output to compare with)")
        return 3
    print("lossless greedy: OK")
    return 4 if ab is not None and ab["verdict"] == "lower" else 0  # 4: a deferred prompt's draft drafts worse


NOT_STARTED = "not started: "  # a config's error that came before its server was up (the lossless check's exit 5/6)
# What a server that stopped at start-up said last: the exception vLLM's engine core raised. Its own wrapper
# ("Engine core initialization failed") names no cause, so it is passed over.
CAUSE_RE = re.compile(r"\b((?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (.+)$")
WRAPPER_CAUSES = ("Engine core initialization failed",)
# Causes a lone start repeats: a compile range the configuration overflows (sections 37-38), and the plugin's own
# start-up refusals. Anything else (memory the other servers held, a timeout, a crash) may pass alone.
REPEATING_SIGNS = ("out of considered ranges", "dspark:")


class NotStarted(RuntimeError):
    """A server that was never up. ``retry_alone``: whether starting it again alone could help -- false only for
    a cause a lone start repeats (section 38: every drafting server of the lossless check stopped on vLLM's
    start-up profile, then again in a row, 4 minutes); a wrong false would lose a config for the sitting."""

    def __init__(self, message: str, retry_alone: bool) -> None:
        super().__init__(message)
        self.retry_alone = retry_alone


def start_cause(log_text: str) -> str | None:
    """The exception a stopped server's log names (``AssertionError: Shape: 257 out of ...``), or None: one a lone
    start repeats wherever the log has it (errors that follow it, a connection reset say, are its echoes), else
    the last."""
    causes = [m.group(1) + ": " + m.group(2).strip() for line in log_text.splitlines()
              if (m := CAUSE_RE.search(line)) and not m.group(2).startswith(WRAPPER_CAUSES)]
    repeating = [c for c in causes if any(sign in c for sign in REPEATING_SIGNS)]
    return (repeating or causes or [None])[-1]


def not_started(exc: Exception, log_text: str | None) -> NotStarted:
    """``exc`` from waiting for a server, as a :class:`NotStarted` that names the log's cause where there is one."""
    cause = start_cause(log_text) if log_text is not None else None
    repeats = cause is not None and any(sign in cause for sign in REPEATING_SIGNS)
    return NotStarted(f"{NOT_STARTED}{exc}" + (f" [{cause}]" if cause else ""), retry_alone=not repeats)


def error_row(name: str, exc: Exception, **fields: object) -> dict:
    """A result row for a config that failed; a server never up says whether a lone start could help."""
    row: dict = {"config": name, **fields, "error": str(exc)}
    if isinstance(exc, NotStarted):
        row["retry_alone"] = exc.retry_alone
    return row


KV_LINE = "KV cache size:"  # vLLM's log line once a server has sized its KV cache (allocation follows)


@dataclass
class _Server:
    """One started ``vllm serve`` of one config."""

    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        """Its whole process group; one that already exited with every child is gone, which is no error: a server
        that failed at start-up raised ProcessLookupError here once, which stopped the lossless check before its
        other configs served and before results.json was written (section 37)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            self.proc.wait()
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _wait_for_line(srv: _Server, needle: str, timeout: float) -> None:
    """Until ``needle`` is in the server's log (RuntimeError if it exits or the timeout passes first)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if needle in srv.log_path.read_text(errors="replace"):
            return
        if srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name}: server exited with {srv.proc.returncode} before {needle!r}")
        time.sleep(1)
    raise RuntimeError(f"{srv.name}: no {needle!r} in its log after {timeout:.0f} s")


def _vllm_bench(args: argparse.Namespace, vllm: list[str], srv: _Server, env: dict[str, str],
                t_start: float) -> list[dict]:
    """``vllm bench serve`` at every concurrency (its JSON per cell in OUT)."""
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        fname = f"bench-{srv.name}-c{c}.json"
        bench = [*vllm, "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{srv.port}",
                 "--model", args.model, "--dataset-name", "random", "--random-input-len",
                 str(args.input_len), "--random-output-len", str(args.output_len), "--num-prompts",
                 str(args.num_prompts), "--max-concurrency", str(c), "--ignore-eos", "--seed", "0",
                 "--save-result", "--result-dir", str(args.out), "--result-filename", fname]
        subprocess.run(bench, env=env, check=True, stdout=subprocess.DEVNULL, timeout=240)
        r = json.loads((args.out / fname).read_text())
        rows.append({"config": srv.name, "concurrency": c, "output_tok_s": r.get("output_throughput"),
                     "mean_itl_ms": r.get("mean_itl_ms"), "acceptance_length": r.get("spec_decode_acceptance_length"),
                     "completed": r.get("completed")})
        print(f"[{time.time() - t_start:5.0f}s]   c={c}: {rows[-1]}", flush=True)
    return rows


def _rpc(port: int, method: str, **kwargs: object) -> list:
    """A worker method by name over vLLM's development endpoint (every argument travels as a string)."""
    body = {"method": method, "kwargs": {k: str(v) for k, v in kwargs.items()}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/collective_rpc", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    return json.loads(raw).get("results", []) if raw else []


def _served_anatomy(args: argparse.Namespace, name: str, port: int, env: dict[str, str],
                    pid: int | None = None) -> list[dict]:
    """``dspark bench`` one concurrency at a time, the step anatomy recording each (OUT/anatomy)."""
    out = args.out / "anatomy"
    out.mkdir(parents=True, exist_ok=True)
    print(f"  {name}: anatomy wraps {len(_rpc(port, 'anatomy_install')[0])} methods", flush=True)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        _rpc(port, "anatomy_begin")
        one = argparse.Namespace(**{**vars(args), "concurrency": str(c)})
        rows.extend(_dspark_bench(one, name, port, env, log_suffix=f"-c{c}", pid=pid))
        # A closed loop runs between 3/4 of its clients (while finished ones refill) and all of them.
        summary = _rpc(port, "anatomy_end", steady_reqs=c, min_reqs=max(1, (3 * c) // 4))[0]
        cell = {"config": f"{name} c={c}", "concurrency": c,
                "variants": [{"variant": "served", "tok_s": rows[-1]["output_tok_s"], **summary}]}
        (out / f"{name}-c{c}.json").write_text(json.dumps(cell, indent=1))
    _write_anatomy_tables(out)
    return rows


def _write_anatomy_tables(out: Path) -> None:
    cells = [json.loads(f.read_text()) for f in sorted(out.glob("*-c*.json"))]
    cells.sort(key=lambda x: (x["config"].split(" ")[0], x["concurrency"]))
    every = [{**x, "variants": [{**v, "by_kind": v["all_steps"]} for v in x["variants"]]} for x in cells]
    shares = ", ".join(f"{x['config']} {x['variants'][0]['prefill_share']}" for x in cells)
    (out / "anatomy.md").write_text(
        "Steady decode steps (3/4 to all of the clients running, no prefill chunk):\n\n" + anatomy_table(cells)
        + "\nEvery step that ran a request:\n\n" + anatomy_table(every)
        + f"\nShare of steps that carried a prefill chunk: {shares}\n"
        + "\nEvery step that ran a request, by load (requests in the step):\n\n" + load_table(cells))


def bench_commands(args: argparse.Namespace, name: str, port: int, round_: int = 0,
                   pid: int | None = None) -> tuple[list[list[str]], Path]:
    """The ``dspark bench --base-url`` commands for one config's server, and the folder its cells land in:
    OUT/bench, or with ``--rounds`` OUT/bench/round<r> (1-based), 1/rounds of the prompts, seeded apart per round.

    With ``--rounds``, a concurrency whose share of the prompts would be fewer than ``--min-waves`` waves gets
    that many waves instead (its own command; every config alike, so the cells stay equal work). Halving 512
    prompts left a 256-request cell one wave of about 3 s, mostly its admission ramp and its drain: two servers
    of the same config read 8,341 and 10,993 tok/s there (docs/PERFORMANCE.md section 26). Two waves (7-10 s)
    still read one no-speculation server at 7,558 and 6,032 tok/s in two rounds, its median ITL 29 or 33 ms
    where another's was 17.5 (section 29): the default is four.

    The first round's commands warm each server up (``dspark bench``'s untimed waves at each concurrency, before
    its first cell, of requests as long as the cells': 16-token ones left the paused draft's catch-ups to the
    first timed cell at 64 requests, docs/PERFORMANCE.md section 27); later rounds find it warm and skip that."""
    out, num_prompts, seed = args.out / "bench", args.num_prompts, 0
    if args.rounds > 1:
        out, num_prompts, seed = out / f"round{round_ + 1}", args.num_prompts // args.rounds, 100_003 * round_
    by_n: dict[int, list[str]] = {}
    for c in args.concurrency.split(","):
        n = max(num_prompts, args.min_waves * int(c)) if args.rounds > 1 else num_prompts
        by_n.setdefault(n, []).append(c)
    cmds = [[sys.executable, "-m", "dspark_cli.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
             "--label", name, "-c", ",".join(cs), "-n", str(n), "--dataset", "random",
             "--input-len", str(args.input_len), "--tokenizer", args.model, "--max-tokens", str(args.output_len),
             "--ignore-eos", "--temperature", str(args.temperature), "--endpoint", "completions",
             "--model", args.model, "--results-dir", str(out), "--no-plots", "--seed", str(seed),
             *(["--warmup-max-tokens", str(args.output_len)] if round_ == 0 else ["--warmup-prompts", "0"]),
             # the server's API process: each cell records its CPU (and its engine core's, a child)
             *(["--server-pid", str(pid)] if pid is not None else [])]
            for n, cs in by_n.items()]
    return cmds, out


def paired_rounds(rows: list[dict], reference: str) -> list[dict]:
    """Per (group, config, concurrency): the config's tok/s against the reference's of the same group and round
    (``dspark_cli.bench.report.paired_delta_of``: median and range over the rounds it shares with the
    reference; ``median``, ``min`` and ``max`` as fractions). A group's reference is the config named
    ``reference``, else its first ``reference#tag`` (a group without one is left out, as are failed rows).
    Sorted by concurrency, then group, then config as measured."""
    ok = [r for r in rows if "error" not in r]
    names: dict[int, list[str]] = {}
    for r in ok:
        names.setdefault(r["group"], [])
        if r["config"] not in names[r["group"]]:
            names[r["group"]].append(r["config"])
    refs = {}
    for g, cfgs in names.items():
        tagged = [c for c in cfgs if config_parts(c)[0] == config_parts(reference)[0]]
        if tagged:
            refs[g] = reference if reference in cfgs else tagged[0]
    base = {(r["group"], r["round"], r["concurrency"]): r["output_tok_s"] for r in ok
            if refs.get(r["group"]) == r["config"]}
    pairs: dict[tuple[int, str, int], tuple[list[float], list[float]]] = {}
    for r in ok:
        ref = base.get((r["group"], r["round"], r["concurrency"]))
        if ref and r["config"] != refs[r["group"]]:
            mine, theirs = pairs.setdefault((r["group"], r["config"], r["concurrency"]), ([], []))
            mine.append(r["output_tok_s"])
            theirs.append(ref)
    out = []
    for (g, cfg, c), (mine, theirs) in pairs.items():
        d = paired_delta_of(mine, theirs)
        if d is not None:
            out.append({"group": g, "config": cfg, "reference": refs[g], "concurrency": c, "rounds": d.rounds,
                        "median": d.median_pct / 100, "min": d.min_pct / 100, "max": d.max_pct / 100,
                        "text": d.text()})
    return sorted(out, key=lambda x: (x["concurrency"], x["group"]))


def paired_table(paired: list[dict], reference: str) -> str:
    """``paired_rounds`` as a markdown table: median Δ (range) per config and concurrency. The heading names the
    servers the configs were paired with (``nospec#2`` in a group that has no ``nospec``), else ``reference``."""
    configs = list(dict.fromkeys(x["config"] for x in paired))
    by = {(x["config"], x["concurrency"]): x for x in paired}
    servers = ", ".join(dict.fromkeys(x["reference"] for x in paired)) or reference
    lines = [f"Median Δ of output tok/s against {servers}, same group and round (range over the rounds):", "",
             "| c | " + " | ".join(configs) + " |", "|---:|" + "---|" * len(configs)]
    for c in sorted({x["concurrency"] for x in paired}):
        lines.append(f"| {c} | " + " | ".join(by[cfg, c]["text"] if (cfg, c) in by else "-" for cfg in configs)
                     + " |")
    return "\n".join(lines) + "\n"


def _dspark_bench(args: argparse.Namespace, name: str, port: int, env: dict[str, str],
                  log_suffix: str = "", round_: int = 0, pid: int | None = None) -> list[dict]:
    """``dspark bench --base-url`` against this config's server; its cells (and the joint table) in OUT/bench
    (with ``--rounds``, OUT/bench/round<r>)."""
    cmds, out = bench_commands(args, name, port, round_, pid)
    if args.rounds > 1:
        log_suffix += f"-round{round_ + 1}"
    logs = []
    for cmd in cmds:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        logs.append(run.stdout + run.stderr)
        (args.out / f"bench-{name}{log_suffix}.log").write_text("\n".join(logs))
        if run.returncode != 0:
            raise RuntimeError(f"dspark bench exited with {run.returncode}: {run.stderr.strip()[-300:]}")
        print(run.stdout, flush=True)
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        cell = load_cell(cell_path(out, name, c))
        if cell is None:
            raise RuntimeError(f"dspark bench wrote no cell for {name} c={c}")
        n = numbers(cell, None)
        rows.append({"config": name, "concurrency": c, "output_tok_s": n.output_tok_s, "mean_itl_ms": n.mean_itl_ms,
                     "acceptance_length": n.acceptance_length, "completed": cell["metrics"].get("completed"),
                     "round": round_})
    return rows


def config_specs(base_spec: dict, ours: dict, lossless: bool = False,
                 alt_curve: str | None = None) -> dict[str, dict | None]:
    """Every config's speculative config (None: no speculation): ``base_spec`` is vLLM's ``draft_model`` spec,
    ``ours`` the ``--dspark`` settings every config of ours gets (as ``dspark_*`` keys), which a config's own
    keys override. ``lossless``: the greedy check's variants (mask configs prune to half the drafts)."""
    dspark_keys = {f"dspark_{k}": v for k, v in ours.items()}
    varlen = {**base_spec, **dspark_keys, "dspark_capacity_verification_mode": "varlen"}
    specs: dict[str, dict | None] = {
        "nospec": None,
        "all": dict(base_spec),
        "upstream": {**base_spec, "enable_adaptive_verification": True},
        "varlen": varlen,
        # mask's paused steps run varlen's compacted batch on varlen graphs (mask_paused_compact, the default);
        # mask-compact names that explicitly, mask-uniform keeps every paused step the uniform 1 + k batch
        "mask": {**base_spec, **dspark_keys, "dspark_capacity_verification_mode": "mask"},
        "mask-compact": {**base_spec, **dspark_keys, "dspark_capacity_verification_mode": "mask",
                         "dspark_mask_paused_compact": True},
        "mask-uniform": {**base_spec, **dspark_keys, "dspark_capacity_verification_mode": "mask",
                         "dspark_mask_paused_compact": False},
        # one mechanism off at a time (PERFORMANCE: what each contributed)
        "varlen-nosat": {**varlen, "dspark_saturation_patience": 0},
        "varlen-nosts": {**{k: v for k, v in varlen.items() if k not in ("dspark_online_sts", "dspark_sts")},
                         "dspark_online_sts": False},
        "varlen-startup": {k: v for k, v in varlen.items() if k != "dspark_sps_curve"},
        # a curve-source A/B: varlen priced by --alt-sps-curve (another profile of the same engine)
        **({"varlen-alt": {**varlen, "dspark_sps_curve": alt_curve}} if alt_curve else {}),
        "varlen-current": {**varlen, "dspark_draft_catchup_tokens": 0},  # the draft's K/V kept current while paused
        # a paused step's successor scheduled as plain decoding, no placeholder drafts (plain_paused_steps, the
        # default since its greedy outputs matched no speculation's on the H200, docs/PERFORMANCE.md section 34)
        "varlen-plain": {**varlen, "dspark_plain_paused_steps": True},
        "varlen-placeholders": {**varlen, "dspark_plain_paused_steps": False},  # the default path, whatever --dspark
        # while paused, prompt chunks' draft passes deferred to the catch-ups too (draft_defer_prompts; served
        # without prefix caching, as the matrices are): where section 34's 16-request loss is thought to sit
        "varlen-defer": {**varlen, "dspark_draft_defer_prompts": True},
        # For the lossless check with real weights: verification forced on (a survival threshold instead of the
        # curve, no saturation), and the same with the policy pausing and probing often (patience 1, a probe
        # every 2 paused steps, backing off): its probes draft right after a catch-up, so their acceptance
        # against varlen-verify's says whether the caught-up draft drafts as well (varlen-cycle-current: kept
        # current instead).
        "varlen-verify": {**varlen, "dspark_saturation_patience": 0, "dspark_confidence_threshold": 0.001},
        # probe tax 1: probes are not rationed (the default lets them spend 2% of paused time), so the check's
        # pausing configs draft often enough for the defer A/B to read (section 34's drafted 7 and 14 times)
        "varlen-cycle": {**varlen, "dspark_confidence_threshold": 0.001, "dspark_saturation_patience": 1,
                         "dspark_resume_every": 2, "dspark_probe_tax": 1.0},
    }
    specs["varlen-cycle-current"] = {**specs["varlen-cycle"], "dspark_draft_catchup_tokens": 0}
    # the lossless check of plain_paused_steps: pausing and probing often, every paused step's successor plain
    specs["varlen-cycle-plain"] = {**specs["varlen-cycle"], "dspark_plain_paused_steps": True}
    specs["mask-plain"] = {**specs["mask"], "dspark_plain_paused_steps": True}
    # ... and with draft_defer_prompts: the same, whose prompts arriving while paused wait for the catch-ups
    # (served without prefix caching, --prefix-caching off; the check's defer A/B compares it with the above)
    specs["varlen-cycle-defer"] = {**specs["varlen-cycle-plain"], "dspark_draft_defer_prompts": True}
    # ... and keeping vLLM's placeholders after a pause, as a worker in another process does: with a small
    # --max-num-batched-tokens a request left out of the step that resumes drafting comes back holding the paused
    # step's -1 draft ids, which must never be admitted (manager._slot_real)
    specs["varlen-cycle-placeholders"] = {**specs["varlen-cycle"], "dspark_plain_paused_steps": False}
    # ... the same for mask, whose uniform layout still holds such a request's rows: the manager must report them
    # all to the runner, which sizes its logit-row buffers by that count
    specs["mask-cycle-placeholders"] = {**specs["mask"], **{k: v for k, v in specs["varlen-cycle"].items()
                                                            if k.startswith("dspark_") and k not in specs["varlen"]},
                                        "dspark_plain_paused_steps": False}
    if lossless:
        # A dense target's mask batch is priced whole, so mask would verify everything and the check would say
        # nothing about its padding path: a budget cap makes every mask config prune.
        for name, spec in specs.items():
            if spec is not None and spec.get("dspark_capacity_verification_mode") == "mask":
                specs[name] = {**spec, "dspark_budget_frac": 0.5}
    return specs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", default="8,64")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--load-format", default=None, help="e.g. dummy (real step costs, no weights)")
    ap.add_argument("--configs", default="upstream,varlen,mask",
                    help="comma list of nospec, all, upstream, varlen, mask, varlen-nosat, varlen-nosts, "
                         "varlen-startup, varlen-current, varlen-plain, varlen-placeholders, varlen-defer; for "
                         "--lossless also varlen-verify, varlen-cycle, varlen-cycle-current, varlen-cycle-plain, "
                         "varlen-cycle-defer, varlen-cycle-placeholders, mask-plain, mask-cycle-placeholders")
    ap.add_argument("--client", choices=("dspark", "vllm"), default="dspark",
                    help="dspark bench --base-url (one summary table in OUT/bench) or vllm bench serve")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the bench requests")
    ap.add_argument("--synthetic-rates", default=None,
                    help="comma list of per-position *conditional* acceptance rates: vLLM's synthetic rejection "
                         "sampler then accepts draft i with that probability (dummy weights accept nothing)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--alt-sps-curve", default=None, metavar="FILE",
                    help="config varlen-alt: varlen priced by this curve instead of --dspark's (a curve-source A/B, "
                         "e.g. one profiled under another compilation)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                    help="vLLM's token budget per step (default: vLLM's); small, a long prompt's chunks leave "
                         "decoding requests out of steps (the lossless check's varlen-cycle-placeholders)")
    ap.add_argument("--dspark", default="{}", help="extra JSON for ours (e.g. {\"online_sts\": true})")
    ap.add_argument("--startup-timeout", type=float, default=None,
                    help="seconds a server may take to come up (default 420 with --compilation piecewise, whose "
                         "torch.compile runs in every server of a group at once: four 8B-shaped servers were up in "
                         "150 s on the H200; 240 with decode-graphs)")
    ap.add_argument("--overlap-starts", type=int, default=1, metavar="N",
                    help="start up to N configs' servers together on the one GPU (each after the previous one "
                         "sized its KV cache), then measure them one at a time: an 8B-shaped server takes ~2.5 "
                         "min to start, mostly graph capture, which overlaps; give each a --gpu-memory-utilization "
                         "share")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--compilation", choices=sorted(COMPILATIONS), default="piecewise",
                    help="piecewise (default): vLLM's own, torch.compile with FULL graphs for decode batches and "
                         "piecewise graphs for mixed ones (what a production server runs); decode-graphs: no "
                         "torch.compile, FULL graphs for decode batches only, so a step that carries a prompt "
                         "chunk runs eagerly (quicker starts)")
    ap.add_argument("--api-servers", type=int, default=1, metavar="N",
                    help="N API server processes per server (vLLM --api-server-count): at 256 requests one-token "
                         "steps stream ~10,000 chunks/s, which one API process may not keep up with "
                         "(docs/PERFORMANCE.md section 29). Cells record the main process's CPU: with N > 1 that "
                         "is vLLM's supervisor, so only their server_tree shares count the API processes. A "
                         "config named name@N gets N whatever this says")
    ap.add_argument("--kv-cache-gib", type=float, default=None, metavar="G",
                    help="a KV cache of G GiB per server (vLLM --kv-cache-memory-bytes; no memory profile), and the "
                         "--overlap-starts group's servers started together; --gpu-memory-utilization then only "
                         "sets what vLLM checks is free when each server starts")
    ap.add_argument("--rounds", type=int, default=1, metavar="N",
                    help="measure each group in N paired rounds of 1/N of the prompts (paired.md: Δ against "
                         "--pair-with per group and round)")
    ap.add_argument("--min-waves", type=int, default=4, metavar="W",
                    help="with --rounds: at least W waves (W x concurrency prompts) per cell and round")
    ap.add_argument("--pair-with", default="nospec", metavar="CONFIG",
                    help="with --rounds: the config each group's others are paired with")
    ap.add_argument("--anatomy", action="store_true",
                    help="record where each served step's time goes (benchmarks/vllm_step_anatomy.py), per "
                         "concurrency, into OUT/anatomy")
    ap.add_argument("--lossless", type=int, default=0, metavar="N",
                    help="instead of benchmarking, send N fixed prompts greedily (temperature 0, 32 tokens) to "
                         "each config and check every config's token ids against nospec's; one more request, "
                         "decoding up to the model's length limit, is reported beside the verdict (run it without "
                         "--synthetic-rates: synthetic acceptance is not lossless by design)")
    ap.add_argument("--lossless-text", action="store_true",
                    help="with --lossless: text questions (real weights: drafts the check verifies are accepted) "
                         "instead of token-id prompts")
    ap.add_argument("--prefix-caching", choices=("auto", "on", "off"), default="auto",
                    help="vLLM's prefix cache: auto (default) keeps it for --lossless and turns it off for "
                         "benchmarks (equal work per cell); off for the lossless check's draft_defer_prompts A/B "
                         "(varlen-cycle-plain against varlen-cycle-defer), which needs it off")
    ap.add_argument("--smoke", type=int, default=0, metavar="N",
                    help="with --lossless: then N concurrent requests of staggered lengths per config, each of "
                         "which must come back complete (served, not compared)")
    args = ap.parse_args()
    if args.startup_timeout is None:
        args.startup_timeout = 420.0 if args.compilation == "piecewise" else 240.0
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dspark-ep-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(_entry_point_dir(tmp)), env.get("PYTHONPATH", "")])
    vllm = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    base_spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    if args.synthetic_rates:
        conditional = [float(x) for x in args.synthetic_rates.split(",")]
        if len(conditional) != args.k:
            ap.error(f"--synthetic-rates needs {args.k} values")
        unconditional = [float(v) for v in np.cumprod(conditional)]  # vLLM wants P(first i+1 all accepted)
        base_spec.update(rejection_sample_method="synthetic", synthetic_acceptance_rates=unconditional)
    ours = json.loads(args.dspark)
    engine = [args.model, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(args.max_num_seqs),
              "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--dtype", "bfloat16",
              "--compilation-config", json.dumps(COMPILATIONS[args.compilation]),
              # FlashInfer's GEMM/MoE autotune (11 s of a 60 s start on the 135M shape) tunes kernels these dense
              # bf16 models on FLASH_ATTN do not run; every config skips it alike.
              "--no-enable-flashinfer-autotune"]
    if args.load_format:
        engine += ["--load-format", args.load_format]
    if args.max_num_batched_tokens is not None:
        engine += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.prefix_caching == "off" or (args.prefix_caching == "auto" and not args.lossless):
        # Equal work per cell: the cells of every concurrency (and the warm-up, before it marked its prompts) send
        # the same prompts, and vLLM's prefix cache kept more or less of them by server and round. On the H200
        # that swung 256-request cells of paused and no-speculation servers by 16-45% (docs/PERFORMANCE.md
        # section 28). The lossless check keeps the cache (auto): there it is one more path the outputs must
        # survive; draft_defer_prompts works only without it (its A/B: --prefix-caching off).
        engine += ["--no-enable-prefix-caching"]
    if args.api_servers < 1:
        ap.error("--api-servers must be >= 1")
    if args.kv_cache_gib is not None:
        if args.kv_cache_gib <= 0:
            ap.error("--kv-cache-gib must be > 0")
        engine += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    if args.compilation == "piecewise":
        # A group's servers start together, and those of one target and draft share vLLM's compile-cache key
        # (the dspark settings are not graph factors): their compiles would write one cache directory at once.
        # Each compiles for itself; the code each serves is the same as with the cache.
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if args.anatomy:
        if args.lossless or args.client != "dspark":
            ap.error("--anatomy records dspark bench cells: drop --lossless / --client vllm")
        engine += ["--worker-extension-cls", ANATOMY_EXTENSION]
        env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /collective_rpc, which the anatomy is driven through
    specs = config_specs(base_spec, ours, args.lossless > 0, args.alt_sps_curve)
    try:
        unknown = [n for n in args.configs.split(",") if config_parts(n)[0] not in specs]
    except ValueError as exc:
        ap.error(str(exc))
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {sorted(specs)}")
    # Every drafting server would load its weights and then stop in vLLM's warm-up (the plugin refuses ours there
    # too): said before any starts.
    drafting = any(specs[config_parts(n)[0]] is not None for n in args.configs.split(","))
    if drafting and args.compilation == "piecewise" and args.max_num_batched_tokens is not None:
        overflow = warmup_overflow(args.max_num_seqs, args.max_num_batched_tokens, args.k)
        if overflow is not None:
            ap.error(overflow)
        # vLLM's own manager then profiles every captured size, and a draft pass past the budget stops it (section
        # 38); ours leaves those sizes out of the profile
        overflow = profile_overflow(args.max_num_seqs, args.max_num_batched_tokens, args.k)
        if overflow is not None and any(config_parts(n)[0] == "upstream" for n in args.configs.split(",")):
            ap.error(f"config upstream: {overflow}")
    if args.overlap_starts < 1:
        ap.error("--overlap-starts must be >= 1")
    if args.overlap_starts * args.gpu_memory_utilization > 0.95:
        ap.error(f"--overlap-starts {args.overlap_starts} x --gpu-memory-utilization {args.gpu_memory_utilization} "
                 "exceeds the GPU: lower the utilization share")
    results: list[dict] = []
    outputs: dict[str, list[list[int]]] = {}
    served: dict[str, dict] = {}  # lossless: per config, acceptance, the concurrent smoke, the upkeep line
    tails: dict[str, list[int] | str] = {}  # lossless: per config, the tail request's output, or why not
    if args.lossless and args.synthetic_rates:
        ap.error("--lossless checks real verification: drop --synthetic-rates")
    if args.rounds < 1 or args.num_prompts % args.rounds:
        ap.error(f"--rounds must be >= 1 and divide --num-prompts ({args.num_prompts})")
    if args.min_waves < 1:
        ap.error("--min-waves must be >= 1")
    if args.rounds > 1 and (args.lossless or args.anatomy or args.client != "dspark"):
        ap.error("--rounds pairs dspark bench cells: drop --lossless / --anatomy / --client vllm")
    t_start = time.time()

    def start(name: str) -> _Server:
        port = _free_port()
        key, api = config_parts(name)
        spec = specs[key]
        spec_args = [] if spec is None else ["--speculative-config", json.dumps(spec)]
        api = api or args.api_servers
        if api > 1:
            spec_args += ["--api-server-count", str(api)]
        cmd = plan_vllm_serve([*engine, "--port", str(port), *spec_args]).command(vllm)
        log_path = args.out / f"serve-{name}.log"
        print(f"[{time.time() - t_start:5.0f}s] {name}: {shlex.join(cmd)}", flush=True)
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return _Server(name, port, proc, log_path)

    def check_ready(srv: _Server) -> None:
        try:
            _wait_ready(srv.port, srv.proc, args.startup_timeout)
        except RuntimeError as exc:
            exited = srv.proc.poll() is not None
            raise not_started(exc, srv.log_path.read_text(errors="replace") if exited else None) from exc
        log_text = srv.log_path.read_text(errors="replace")
        active = ACTIVE_LINE in log_text
        ours_expected = srv.name.startswith(("varlen", "mask"))
        if ours_expected != active:
            raise RuntimeError(f"plugin {'inactive' if ours_expected else 'active'} for {srv.name}")
        kv = [line.strip() for line in log_text.splitlines() if KV_LINE in line]
        print(f"[{time.time() - t_start:5.0f}s]   {srv.name} ready; {kv[-1] if kv else 'no KV line'}", flush=True)

    def measure(srv: _Server) -> None:
        check_ready(srv)
        if args.lossless:
            outputs[srv.name] = _greedy_outputs(srv.port, args.model, args.lossless, args.lossless_text)
            try:
                tails[srv.name] = _tail_output(srv.port, args.model)
            except (OSError, ValueError, KeyError) as exc:  # urllib's errors are OSErrors; never fails the check
                tails[srv.name] = f"not served ({exc})"
            info: dict = {"acceptance": _acceptance(srv.port)}  # of the sequential greedy requests
            if args.smoke:
                info["smoke"] = _concurrent_smoke(srv.port, args.model, args.smoke)
                info["acceptance_all"] = _acceptance(srv.port)  # the greedy requests and the smoke's
            if srv.name == DEFER_AB[1]:
                # The policy's log line comes on a step at most every REPORT_EVERY_S: one more request after
                # that long, so the line read below counts every prompt the check deferred.
                time.sleep(REPORT_EVERY_S + 0.5)
                _complete(srv.port, args.model, [1, 2, 3], 1)
            upkeep = [ln.split(UPKEEP_LINE, 1)[1].strip() for ln in srv.log_path.read_text(errors="replace")
                      .splitlines() if UPKEEP_LINE in ln]
            info["upkeep"] = upkeep[-1] if upkeep else None
            deferred = DEFERRED_RE.search(info["upkeep"] or "")
            info["deferred_prompt_tokens"] = int(deferred.group(1)) if deferred else None
            served[srv.name] = info
            print(f"[{time.time() - t_start:5.0f}s]   {args.lossless} greedy outputs", flush=True)
        elif args.client == "dspark" and args.anatomy:
            results.extend(_served_anatomy(args, srv.name, srv.port, env, srv.proc.pid))
        elif args.client == "dspark":
            results.extend(_dspark_bench(args, srv.name, srv.port, env, pid=srv.proc.pid))
        else:
            results.extend(_vllm_bench(args, vllm, srv, env, t_start))

    def measure_rounds(group: list[_Server], group_id: int) -> None:
        """Every ready server of the group, round by round, the order rotated each round; then paired.md."""
        ready = []
        for srv in group:
            try:
                check_ready(srv)
                ready.append(srv)
            except RuntimeError as exc:
                results.append(error_row(srv.name, exc))
                print(f"  {srv.name} FAILED: {exc} (log: {srv.log_path})", flush=True)
        rows: list[dict] = []
        for r in range(args.rounds):
            shift = r % max(1, len(ready))
            for srv in ready[shift:] + ready[:shift]:
                try:
                    rows.extend({**row, "group": group_id} for row in _dspark_bench(args, srv.name, srv.port, env,
                                                                                    round_=r, pid=srv.proc.pid))
                except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                    rows.append({"config": srv.name, "round": r, "group": group_id, "error": str(exc)})
                    print(f"  {srv.name} round {r + 1} FAILED: {exc} (log: {srv.log_path})", flush=True)
        results.extend(rows)
        paired = paired_rounds(rows, args.pair_with)
        if paired:
            table = paired_table(paired, args.pair_with)
            print(table, flush=True)
            # Appended: each group of a sitting is its own invocation of this script, into the same OUT.
            with (args.out / "paired.md").open("a") as f:
                f.write(f"\n{time.strftime('%Y-%m-%d %H:%M')}: {', '.join(s.name for s in group)}, "
                        f"{args.rounds} rounds\n\n{table}")

    names = args.configs.split(",")
    for first in range(0, len(names), args.overlap_starts):
        batch = names[first:first + args.overlap_starts]
        group: list[_Server] = []
        try:
            for i, name in enumerate(batch):
                if group and args.kv_cache_gib is None:
                    # The next server starts once the previous one has sized and allocated its KV cache: vLLM
                    # sizes it from whole-device free memory, so two memory profiles at once mis-size each
                    # other (vLLM issue 55827), and memory freed during a profile aborts it.
                    try:
                        _wait_for_line(group[-1], KV_LINE, args.startup_timeout)
                    except RuntimeError as exc:  # its own measurement reports it; the rest are not started
                        results.extend(error_row(n, NotStarted(f"{NOT_STARTED}{exc}", retry_alone=True))
                                       for n in batch[i:])
                        break
                group.append(start(name))
            for srv in group:  # every server of the group up first: graph captures would disturb the cells
                try:
                    _wait_ready(srv.port, srv.proc, args.startup_timeout)
                except RuntimeError:
                    pass  # its measurement below reports it
            if args.rounds > 1:
                measure_rounds(group, first)
            for srv in group if args.rounds == 1 else []:
                try:
                    measure(srv)
                except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                    results.append(error_row(srv.name, exc))
                    print(f"  {srv.name} FAILED: {exc} (log: {srv.log_path})", flush=True)
        finally:
            # Stopped together after the group: a server stopping frees memory under a later one's profile.
            for srv in group:
                srv.stop()
        # results.json is this invocation's (the queue's retry reads its failures); a queue's groups each invoke
        # this script into one OUT, so every invocation also keeps its own copy, named by its start
        text = json.dumps({"results": results, "args": vars(args)}, default=str, indent=2)
        (args.out / "results.json").write_text(text)
        (args.out / f"results-{time.strftime('%Y%m%d-%H%M%S', time.localtime(t_start))}.json").write_text(text)
    if args.lossless:
        return _report_lossless(outputs, results, args.out, served, tails)
    ref_name = "upstream" if any(r.get("config") == "upstream" for r in results) else results[0].get("config")
    base = {r["concurrency"]: r["output_tok_s"] for r in results if r.get("config") == ref_name and "error" not in r}
    print(f"\n{'config':10} {'c':>4} {'tok/s':>9} {'ITL ms':>8} {'accept':>7} {'vs ' + str(ref_name):>12}")
    for r in results:
        if "error" in r:
            print(f"{r['config']:10} FAILED: {r['error']}")
            continue
        ref = base.get(r["concurrency"])
        delta = f"{100 * (r['output_tok_s'] / ref - 1):+.1f}%" if ref else "-"
        acc = r["acceptance_length"]
        print(f"{r['config']:10} {r['concurrency']:>4} {r['output_tok_s']:>9.1f} {r['mean_itl_ms']:>8.2f} "
              f"{acc if acc is None else round(acc, 3)!s:>7} {delta:>12}")
    print(f"total {time.time() - t_start:.0f} s; results in {args.out / 'results.json'}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
