"""Profile the embedded engine's step cost into an :class:`~dspark_cli.core.sps.SpsCurve`.

The capacity manager prices a step as ``draft(R) + verify(tokens) + overhead``, so we time exactly those
pieces on the running engine with synthetic requests (weights and token values do not change step cost):

* **verify** at every padded token count the engine replays (its CUDA-graph capture sizes; on CPU the same
  powers of two, run eagerly), each with as many requests as a full-K batch of that size has;
* **draft** at request counts 1, 2, 4, ... up to ``max_num_seqs`` (catch-up of one token + K - 1 steps);
* **overhead**: the rest of a decode step -- layout, allocation, rejection sampling and the host copy
  of the results -- measured on a half-full batch.

Medians after warm-up, then made monotone by isotonic regression: a larger batch never costs less, so
a dip is timing noise (another process, a frequency change), and pooling it with its neighbours keeps the
curve honest where a running maximum would let one spike inflate every later point. Synthetic requests
borrow real KV blocks, so profiling needs an idle engine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from dspark_cli.core.capacity import allocate, prefix_survival
from dspark_cli.core.layout import build_varlen_layout
from dspark_cli.core.rejection import rejection_sample
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.embedded.model_runner import capture_sizes_for
from dspark_cli.engines.embedded.sequence import SamplingParams, Sequence
from dspark_cli.errors import DsparkError

if TYPE_CHECKING:
    from dspark_cli.engines.embedded.engine import LLMEngine

__all__ = ["profile_sps"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1000.0)
    return float(statistics.median(samples))


def isotonic(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Least-squares non-decreasing fit of the costs (pool adjacent violators), x unchanged."""
    blocks: list[list[float]] = []  # [sum, count]
    for _, y in points:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted: list[float] = []
    for total, count in blocks:
        fitted.extend([total / count] * int(count))
    return [(x, y) for (x, _), y in zip(points, fitted, strict=True)]


def profile_sps(
    engine: LLMEngine,
    context_len: int = 128,
    token_sizes: Seq[int] | None = None,
    request_counts: Seq[int] | None = None,
    warmup: int = 3,
    iters: int = 7,
    progress: Callable[[str], None] | None = None,
) -> SpsCurve:
    """Measure verify/draft/overhead costs on ``engine`` (idle) and return the curve (not saved)."""
    if engine.has_unfinished_requests():
        raise DsparkError("profile the step cost on an idle engine (it borrows the KV pool)")
    runner = engine.runner
    k = runner.num_spec
    if k < 1 or runner.drafter is None:
        raise DsparkError("profiling the step cost needs a draft model and num_speculative_tokens >= 1")
    cfg = engine.config
    device = runner.device
    max_reqs = cfg.max_num_seqs
    sizes = list(token_sizes or runner.capture_sizes or capture_sizes_for((k + 1) * max_reqs))
    counts = list(request_counts or capture_sizes_for(max_reqs))
    ctx = max(2, min(context_len, cfg.max_model_len - 1))
    need_reqs = max(max(counts), max(min(-(-s // (k + 1)), max_reqs) for s in sizes))
    per_seq_blocks = engine.block_manager.blocks_for(ctx + k + 1)
    # Shrink the context until every synthetic request has blocks of its own.
    while need_reqs * per_seq_blocks > engine.block_manager.num_free_blocks and ctx > 2:
        ctx = max(2, ctx // 2)
        per_seq_blocks = engine.block_manager.blocks_for(ctx + k + 1)
    if need_reqs * per_seq_blocks > engine.block_manager.num_free_blocks:
        raise DsparkError("the KV pool is too small to profile with max_num_seqs requests; raise --num-kv-blocks")

    gen = torch.Generator().manual_seed(0)
    seqs: list[Sequence] = []
    for i in range(need_reqs):
        tokens = torch.randint(0, runner.vocab_size, (ctx,), generator=gen).tolist()
        seq = Sequence(f"profile-{i}", tokens, SamplingParams(temperature=0.0), i)
        engine.block_manager.ensure(seq, ctx + k + 1)
        seq.num_computed_tokens = ctx - 1
        seq.num_draft_computed = ctx - 1
        seqs.append(seq)
    try:
        verify_ms = []
        for size in sizes:
            num_reqs = min(-(-size // (k + 1)), max_reqs, size)
            verify_ms.append((size, _time_verify(engine, seqs[:num_reqs], size, warmup, iters)))
            if progress:
                progress(f"verify {size} tokens: {verify_ms[-1][1]:.3f} ms")
        draft_ms = []
        for num_reqs in counts:
            batch = seqs[:num_reqs]
            tables = runner.block_tables(batch)
            draft_ms.append((num_reqs, _median_ms(lambda b=batch, t=tables: runner.propose(b, t, None, None),
                                                  device, warmup, iters)))
            if progress:
                progress(f"draft {num_reqs} requests: {draft_ms[-1][1]:.3f} ms")
        overhead = _time_overhead(engine, seqs[: max(1, max_reqs // 2)], warmup, iters)
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)
    meta = {
        "engine": "embedded",
        "model": engine.model_name,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "k": k,
        "max_num_seqs": max_reqs,
        "context_len": ctx,
        "cuda_graphs": bool(runner.capture_sizes),
        "attention_backend": getattr(runner.backend, "name", "?"),
    }
    return SpsCurve.from_points(isotonic(verify_ms), isotonic(draft_ms), overhead, tuple(runner.capture_sizes), meta,
                                source="profiled SPS curve")


def _full_k_layout(engine: LLMEngine, seqs: list[Sequence], size: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A varlen layout of exactly ``size`` rows: drafts spread over the requests, K at most each."""
    runner = engine.runner
    k = runner.num_spec
    device = runner.device
    num_reqs = len(seqs)
    extra = max(0, size - num_reqs)
    admitted = torch.tensor([min(k, extra // num_reqs + (1 if i < extra % num_reqs else 0)) for i in range(num_reqs)],
                            dtype=torch.int64)
    drafts = torch.randint(0, runner.vocab_size, (num_reqs, k))
    last = torch.tensor([s.last_token for s in seqs], dtype=torch.int64)
    start = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.int64)
    padded = runner.padded_size(max(size, num_reqs))
    layout = build_varlen_layout(last.to(device), drafts.to(device), admitted.to(device), start.to(device), padded)
    return layout, start.to(device), admitted.to(device)


def _time_verify(engine: LLMEngine, seqs: list[Sequence], size: int, warmup: int, iters: int) -> float:
    runner = engine.runner
    layout, start, _ = _full_k_layout(engine, seqs, size)
    tables = runner.block_tables(seqs)
    max_pos = max(s.num_tokens for s in seqs) - 1 + runner.num_spec
    return _median_ms(lambda: runner.verify(layout, tables, start, max_pos), runner.device, warmup, iters)


def _time_overhead(engine: LLMEngine, seqs: list[Sequence], warmup: int, iters: int) -> float:
    """Everything in a decode step besides the forwards: allocation, layout, rejection, host copy."""
    runner = engine.runner
    k = runner.num_spec
    device = runner.device
    num_reqs = len(seqs)
    conf = torch.rand(num_reqs, k, device=device)
    drafts = torch.randint(0, runner.vocab_size, (num_reqs, k), device=device)
    last = torch.tensor([s.last_token for s in seqs], dtype=torch.int64, device=device)
    start = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.int64, device=device)
    num_drafts = torch.full((num_reqs,), k, dtype=torch.int64, device=device)
    budget = num_reqs * k // 2
    padded = runner.padded_size(num_reqs + budget)
    logits = torch.randn(padded, runner.vocab_size, device=device)

    def body() -> None:
        admitted = allocate(prefix_survival(conf), num_drafts, budget)
        layout = build_varlen_layout(last, drafts, admitted, start, padded)
        out = rejection_sample(logits, layout, drafts, admitted)
        out.tokens.cpu().tolist()
        runner.block_tables(seqs)

    return _median_ms(body, device, warmup, iters)
