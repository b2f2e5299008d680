"""Profile the embedded engine's step cost into an :class:`~dspark_cli.core.sps.SpsCurve`.

The capacity manager prices a step as ``draft(R) + verify(tokens) + overhead``, so we time exactly those
pieces on the engine that will serve, with synthetic requests (weights and token values do not change step
cost):

* **verify** at every padded token count the engine replays (its CUDA-graph capture sizes; on CPU, which
  never pads, powers of two up to ``(K + 1) * max_num_seqs``), each with as many requests as a full-K
  batch of that size has, **plus points beyond the capture limit** (eager forwards): the curve prices
  batches past the limit from measurements there, never from a line through the last graph point;
* **draft** at request counts 1, 2, 4, ... up to ``max_num_seqs`` (catch-up of one token + K - 1 steps),
  twice: greedy (the whole K-token loop is one CUDA graph) and sampling (temperature 1: every draft token is
  sampled and its distribution kept for the rejection sampler; a graph of its own), since a served batch runs
  one or the other and sampling costs more on a large vocabulary (a softmax and a CDF per draft token);
* **overhead** on *real* decode steps: ``LLMEngine.step()`` wall time of R running requests minus the
  verify and draft forwards of that same batch shape. What remains is what a step costs beyond the forward
  passes -- scheduling, block tables, layout, allocation, rejection sampling, the host copy, emission --
  measured at a few R and summarised by the median (the per-R values go in ``meta``).

Each timing is the median of several runs after warm-up, then made monotone by isotonic regression: a
larger batch never costs less, so a dip is timing noise (another process, a frequency change), and pooling
it with its neighbours keeps the curve honest where a running maximum would let one spike inflate every
later point. The curve is built with :meth:`SpsCurve.from_points`, which refuses a flat (uninformative)
curve. Synthetic requests borrow real KV blocks and the overhead steps run real requests, so profiling
needs an idle engine; the engine's counters, traces, online STS and capacity state are left untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dspark_cli.core.layout import build_varlen_layout
from dspark_cli.core.sps import SpsCurve, SpsCurveError, monotone_fit
from dspark_cli.engines.embedded.model_runner import capture_sizes_for
from dspark_cli.engines.embedded.sequence import SamplingParams, Sequence
from dspark_cli.errors import DsparkError

if TYPE_CHECKING:
    from dspark_cli.engines.embedded.config import EngineConfig
    from dspark_cli.engines.embedded.engine import LLMEngine

__all__ = ["SpsMeasurements", "beyond_limit_sizes", "curve_from_measurements", "measure_sps",
           "profile_config", "profile_sps"]

Progress = Callable[[str], None]
# Request counts whose decode steps the overhead is measured on (fractions of max_num_seqs).
OVERHEAD_FRACTIONS = (0.0, 0.5, 1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def beyond_limit_sizes(limit: int, max_batch: int) -> list[int]:
    """Eager verify sizes past the capture limit: 1.5x and 2x the limit, and the largest real batch if it is
    above the limit (a ``--max-capture-size`` below ``(K + 1) * max_num_seqs``)."""
    sizes = {math.ceil(1.5 * limit), 2 * limit}
    if max_batch > limit:
        sizes.add(max_batch)
    return sorted(s for s in sizes if s > limit)


@dataclass
class SpsMeasurements:
    """Raw medians of one profile, before smoothing and validation (kept for the report and the plot)."""

    verify_ms: list[tuple[int, float]]
    draft_ms: list[tuple[int, float]]
    overhead_ms: float  # median over overhead_by_reqs, clamped at 0
    overhead_by_reqs: list[tuple[int, float]]  # (R, step wall - forwards) per measured R, unclamped
    capture_sizes: tuple[int, ...]  # staircase sizes (empty when the engine does not pad: CPU, no graphs)
    meta: dict[str, Any] = field(default_factory=dict)
    draft_sampling_ms: list[tuple[int, float]] = field(default_factory=list)  # the sampling draft pass


def curve_from_measurements(m: SpsMeasurements, overhead_ms: float | None = None) -> SpsCurve:
    """Smooth (isotonic), validate and build the curve; ``overhead_ms`` overrides the measured overhead.

    Raises :class:`SpsCurveError` for a curve that would carry no load signal (flat, or a single size):
    writing it would silently pin the budget argmax to verify-all.
    """
    if len({x for x, _ in m.verify_ms}) < 2:
        raise SpsCurveError("profiled SPS curve: verify cost was measured at fewer than 2 batch sizes, so it says "
                            "nothing about load; profile more sizes (--capture-sizes with at least two)")
    if overhead_ms is not None and (not math.isfinite(overhead_ms) or overhead_ms < 0):
        raise DsparkError(f"--overhead-ms must be a finite number >= 0, got {overhead_ms!r}")
    meta = dict(m.meta)
    meta["overhead_source"] = "measured" if overhead_ms is None else "given"
    # None where nothing was timed (the overhead was given): 0.0 read as a measured zero
    meta["overhead_measured_ms"] = m.overhead_ms if m.overhead_by_reqs else None
    meta["overhead_by_reqs_ms"] = [[r, round(v, 6)] for r, v in m.overhead_by_reqs]
    meta["measured_verify_ms"] = [[x, round(y, 6)] for x, y in m.verify_ms]
    meta["measured_draft_ms"] = [[x, round(y, 6)] for x, y in m.draft_ms]
    if m.draft_sampling_ms:
        meta["measured_draft_sampling_ms"] = [[x, round(y, 6)] for x, y in m.draft_sampling_ms]
    return SpsCurve.from_points(
        monotone_fit(m.verify_ms), monotone_fit(m.draft_ms), m.overhead_ms if overhead_ms is None else overhead_ms,
        m.capture_sizes, meta, source="profiled SPS curve",
        draft_sampling_ms=monotone_fit(m.draft_sampling_ms) if m.draft_sampling_ms else (),
    )


def profile_sps(
    engine: LLMEngine,
    context_len: int = 128,
    token_sizes: Seq[int] | None = None,
    request_counts: Seq[int] | None = None,
    warmup: int = 3,
    iters: int = 7,
    progress: Progress | None = None,
    overhead_ms: float | None = None,
) -> SpsCurve:
    """Measure verify/draft/overhead costs on ``engine`` (idle) and return the curve (not saved).

    ``overhead_ms`` replaces the measured overhead (the overhead steps are then skipped).
    """
    m = measure_sps(engine, context_len, token_sizes, request_counts, warmup, iters, progress,
                    measure_overhead=overhead_ms is None)
    return curve_from_measurements(m, overhead_ms)


def measure_sps(
    engine: LLMEngine,
    context_len: int = 128,
    token_sizes: Seq[int] | None = None,
    request_counts: Seq[int] | None = None,
    warmup: int = 3,
    iters: int = 7,
    progress: Progress | None = None,
    measure_overhead: bool = True,
) -> SpsMeasurements:
    """Raw medians: verify per size (captured + beyond the limit), draft per request count, overhead."""
    if engine.has_unfinished_requests():
        raise DsparkError("profile the step cost on an idle engine (it borrows the KV pool)")
    runner = engine.runner
    k = runner.num_spec
    if k < 1 or runner.drafter is None:
        raise DsparkError("profiling the step cost needs a draft model and num_speculative_tokens >= 1 "
                          "(pass --draft and -k)")
    if warmup < 0 or iters < 1:
        raise DsparkError(f"need warmup >= 0 and at least one timed run, got warmup={warmup}, iters={iters}")
    cfg = engine.config
    device = runner.device
    max_reqs = cfg.max_num_seqs
    max_batch = (k + 1) * max_reqs
    graphs = bool(runner.capture_sizes)
    if token_sizes is not None and (not token_sizes or min(token_sizes) < 1):
        raise DsparkError(f"token sizes must be positive, got {list(token_sizes)}")
    # With graphs the staircase is what the engine replays; on CPU the engine never pads, so sizes are samples.
    base = sorted(set(runner.capture_sizes if graphs else (token_sizes or capture_sizes_for(max_batch))))
    beyond = beyond_limit_sizes(base[-1], max_batch)
    sizes = base + beyond
    counts = sorted(set(request_counts or capture_sizes_for(max_reqs)))
    if counts[0] < 1:
        raise DsparkError(f"request counts must be positive, got {counts}")

    seqs, ctx = _synthetic_seqs(engine, context_len, max(max(counts), max(-(-s // (k + 1)) for s in sizes)))
    overhead_reqs = sorted({max(1, min(max_reqs, round(f * max_reqs))) for f in OVERHEAD_FRACTIONS})
    try:
        jobs: dict[tuple[str, int], Callable[[], Any]] = {}
        for size in sizes:
            num_reqs = -(-size // (k + 1))
            if graphs and size <= base[-1]:
                num_reqs = min(num_reqs, max_reqs)  # a captured graph holds at most max_num_seqs requests
            jobs[("verify", size)] = _verify_job(engine, seqs[:num_reqs], size)
        for num_reqs in counts:
            jobs[("draft", num_reqs)] = _draft_job(engine, seqs[:num_reqs])
            jobs[("draft-sampling", num_reqs)] = _draft_job(engine, seqs[:num_reqs], sampling=True)
        if measure_overhead and device.type == "cuda":
            # Forward costs of the exact batches the overhead steps run (full K, every draft verified).
            for r in overhead_reqs:
                jobs[("fwd-verify", r)] = _verify_job(engine, seqs[:r], runner.padded_size(r * (k + 1)))
                jobs[("fwd-draft", r)] = _draft_job(engine, seqs[:r])
        medians = _round_robin_ms(jobs, device, warmup, iters, progress)
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)
    verify_ms = [(size, medians[("verify", size)]) for size in sizes]
    draft_ms = [(n, medians[("draft", n)]) for n in counts]
    draft_sampling_ms = [(n, medians[("draft-sampling", n)]) for n in counts]
    if progress:
        for size, ms in verify_ms:
            regime = "graph" if graphs and size <= base[-1] else "eager"
            progress(f"verify {size} tokens ({regime}): {ms:.3f} ms")
        for (n, ms), (_, sms) in zip(draft_ms, draft_sampling_ms, strict=True):
            progress(f"draft {n} requests: {ms:.3f} ms greedy, {sms:.3f} ms sampling")

    by_reqs: list[tuple[int, float]] = []
    if measure_overhead:
        for r in overhead_reqs:
            step_ms, rest_ms = _time_decode_steps(engine, r, ctx, warmup, iters)
            if rest_ms is None:
                fwd = medians[("fwd-verify", r)] + medians[("fwd-draft", r)]
                rest_ms = step_ms - fwd
            else:
                fwd = step_ms - rest_ms
            by_reqs.append((r, rest_ms))
            if progress:
                progress(f"overhead at {r} requests: step {step_ms:.3f} ms - forwards {fwd:.3f} ms")
    overhead = max(0.0, float(statistics.median(v for _, v in by_reqs))) if by_reqs else 0.0
    meta = {
        "engine": "embedded",
        "model": engine.model_name,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "k": k,
        "max_num_seqs": max_reqs,
        "context_len": ctx,
        "cuda_graphs": graphs,
        "capture_limit": base[-1] if graphs else 0,
        "attention_backend": getattr(runner.backend, "name", "?"),
        "warmup": warmup,
        "iters": iters,
        "torch": torch.__version__,
    }
    return SpsMeasurements(verify_ms, draft_ms, overhead, by_reqs, tuple(runner.capture_sizes), meta,
                           draft_sampling_ms)


def profile_config(
    config: EngineConfig,
    context_len: int = 128,
    token_sizes: Seq[int] | None = None,
    warmup: int = 3,
    iters: int = 7,
    progress: Progress | None = None,
    measure_overhead: bool = True,
) -> SpsMeasurements:
    """Build the engine ``config`` describes (capacity off: profiling must not need a curve) and measure it."""
    from dspark_cli.core.capacity import CapacityConfig
    from dspark_cli.engines.embedded.engine import LLMEngine

    cfg = dataclasses.replace(config, capacity=CapacityConfig(), sps_curve=None, sts=None, online_sts=False,
                              record_traces=None)
    if progress:
        progress(f"loading {cfg.model} (draft {cfg.draft}, K={cfg.num_speculative_tokens})")
    with LLMEngine(cfg) as engine:
        return measure_sps(engine, context_len, token_sizes, None, warmup, iters, progress, measure_overhead)


# ---------------------------------------------------------------------------------------------- pieces


def _synthetic_seqs(engine: LLMEngine, context_len: int, need_reqs: int) -> tuple[list[Sequence], int]:
    """``need_reqs`` sequences of ``ctx`` random tokens with KV blocks (contents irrelevant to cost)."""
    runner = engine.runner
    k = runner.num_spec
    cfg = engine.config
    ctx = max(2, min(context_len, cfg.max_model_len - 1))
    per_seq_blocks = engine.block_manager.blocks_for(ctx + k + 1)
    # Shrink the context until every synthetic request has blocks of its own.
    while need_reqs * per_seq_blocks > engine.block_manager.num_free_blocks and ctx > 2:
        ctx = max(2, ctx // 2)
        per_seq_blocks = engine.block_manager.blocks_for(ctx + k + 1)
    if need_reqs * per_seq_blocks > engine.block_manager.num_free_blocks:
        raise DsparkError(f"the KV pool ({engine.block_manager.num_free_blocks} free blocks) is too small to profile "
                          f"{need_reqs} requests (the sizes past the largest batch take up to twice --max-num-seqs); "
                          "raise --max-model-len, which sizes the pool with --max-num-seqs, or lower --capture-sizes")
    gen = torch.Generator().manual_seed(0)
    seqs: list[Sequence] = []
    for i in range(need_reqs):
        tokens = torch.randint(0, runner.vocab_size, (ctx,), generator=gen).tolist()
        seq = Sequence(f"profile-{i}", tokens, SamplingParams(temperature=0.0), i)
        engine.block_manager.ensure(seq, ctx + k + 1)
        seq.num_computed_tokens = ctx - 1
        seq.num_draft_computed = ctx - 1
        seqs.append(seq)
    return seqs, ctx


def _full_k_layout(engine: LLMEngine, seqs: list[Sequence], size: int) -> tuple[Any, torch.Tensor]:
    """A varlen layout of ``size`` rows: drafts spread over the requests, K at most each, padded like the
    engine pads (next captured size; exact past the limit or without graphs)."""
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
    return layout, start.to(device)


def _verify_job(engine: LLMEngine, seqs: list[Sequence], size: int) -> Callable[[], Any]:
    runner = engine.runner
    layout, start = _full_k_layout(engine, seqs, size)
    tables = runner.block_tables(seqs)
    max_pos = max(s.num_tokens for s in seqs) - 1 + runner.num_spec
    return lambda: runner.verify(layout, tables, start, max_pos)


def _draft_job(engine: LLMEngine, seqs: list[Sequence], sampling: bool = False) -> Callable[[], Any]:
    """One draft pass over ``seqs``: greedy, or (``sampling``) at temperature 1 with per-request uniforms as a
    served sampling batch runs it."""
    runner = engine.runner
    tables = runner.block_tables(seqs)
    if not sampling:
        return lambda: runner.propose(seqs, tables, None, None)
    device = runner.device
    temperature = torch.ones(len(seqs), dtype=torch.float32, device=device)
    uniforms = torch.rand(len(seqs), runner.num_spec, device=device)
    return lambda: runner.propose(seqs, tables, temperature, uniforms)


def _round_robin_ms(
    jobs: dict[Any, Callable[[], Any]], device: torch.device, warmup: int, iters: int, progress: Progress | None
) -> dict[Any, float]:
    """Median ms per job, timing every job once per round rather than each job ``iters`` times in a row.

    Interleaving spreads slow periods of a shared machine (other processes, clock changes) over every size
    instead of letting one burst inflate a few neighbouring sizes, which would bend the curve's shape.
    """
    for fn in jobs.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[Any, list[float]] = {key: [] for key in jobs}
    for i in range(iters):
        for key, fn in jobs.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            samples[key].append((time.perf_counter() - start) * 1000.0)
        if progress:
            progress(f"timing round {i + 1}/{iters}")
    return {key: float(statistics.median(v)) for key, v in samples.items()}


def _time_decode_steps(engine: LLMEngine, num_reqs: int, ctx: int, warmup: int, iters: int) -> tuple[float, float | None]:
    """``LLMEngine.step()`` decoding ``num_reqs`` real greedy requests (full K verified): the median step wall
    time and, on CPU, the median of (step - its own verify and draft forwards).

    On CPU everything is synchronous, so timing the forwards inside the step perturbs nothing and pairs each
    step with its own forwards (robust on a busy machine). On CUDA the step runs unperturbed -- a sync
    around the forwards would stop host work overlapping the GPU -- and the caller subtracts forwards timed
    separately on the same batch shape (GPU timings are stable, so that difference is reliable there).

    Whatever the engine records is switched off or restored: this leaves no trace in its counters, traces,
    online STS fit or capacity state.
    """
    k = engine.num_spec
    runner = engine.runner
    device = runner.device
    steps = warmup + iters
    max_tokens = (steps + 2) * (k + 1)
    prompt_len = min(ctx, engine.config.max_model_len - max_tokens - 1)
    if prompt_len < 1:
        raise DsparkError(f"max_model_len={engine.config.max_model_len} is too short to time {steps} decode steps; "
                          "raise --max-model-len")
    # A deep copy: every counter the timed steps touch (phase times among them) comes back as it was. Stalls
    # are the exception, they record what the process waited on, and it did wait during the profile.
    saved_stats = copy.deepcopy(engine.stats)
    saved = (engine.traces, engine.online_sts, engine.capacity, engine._arrivals)
    saved_prefill = (list(engine._prefill_ms), engine.scheduler.prefill_delay_ms)  # the prefill hold's memory
    engine.traces, engine.online_sts, engine.capacity = None, None, None
    in_step = device.type == "cpu"
    fwd_ms = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                fwd_ms[0] += (time.perf_counter() - t0) * 1000.0
        return wrapper

    if in_step:  # instance attributes shadow the methods for these steps only
        runner.verify = timed(runner.verify)  # type: ignore[method-assign]
        runner.propose = timed(runner.propose)  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"profile-overhead-{num_reqs}-{i}" for i in range(num_reqs)]
    walls: list[float] = []
    rests: list[float] = []
    try:
        for rid in ids:
            engine.add_request(rid, torch.randint(0, engine.vocab_size, (prompt_len,), generator=gen).tolist(), params)
        while engine.scheduler.waiting:  # prefills come first; they are not what we time
            engine.step()
        for i in range(steps):
            before = engine.stats.num_decode_steps
            fwd_ms[0] = 0.0
            _sync(device)
            t0 = time.perf_counter()
            engine.step()
            _sync(device)
            elapsed = (time.perf_counter() - t0) * 1000.0
            if engine.stats.num_decode_steps != before + 1 or len(engine.scheduler.running) != num_reqs:
                break  # a request finished or was preempted: the batch shape changed
            if i >= warmup:
                walls.append(elapsed)
                rests.append(elapsed - fwd_ms[0])
    finally:
        if in_step:
            del runner.verify, runner.propose
        for rid in ids:
            engine.abort_request(rid)
        engine.traces, engine.online_sts, engine.capacity, engine._arrivals = saved
        engine._prefill_ms.clear()
        engine._prefill_ms.extend(saved_prefill[0])
        engine.scheduler.prefill_delay_ms = saved_prefill[1]
        for f in dataclasses.fields(saved_stats):
            if f.name != "stalls":
                setattr(engine.stats, f.name, getattr(saved_stats, f.name))
        engine._refresh_counts()
    if not walls:
        raise DsparkError(f"could not time a decode step of {num_reqs} requests (KV pool too small?); "
                          "lower --max-num-seqs")
    return float(statistics.median(walls)), (float(statistics.median(rests)) if in_step else None)
