"""Our adaptive-verification manager inside vLLM 0.33's Model Runner V2.

It subclasses upstream's ``AdaptiveVerificationManager`` (so the runner's type checks, the double-buffered
stale confidences and the varlen CPU placeholder layout keep working) and replaces the decisions:

* **budget** (``get_num_tokens``, host): ``core.capacity.choose_budget`` on the *stale* host confidences,
  priced by a ``core.sps.SpsCurve`` (``--sps-curve`` file, an inline curve, or vLLM's own start-up profile
  turned into a curve), with ``budget_frac``, ``min_predicted_gain``, the threshold / paper policies and
  the rejection sampler's one-chunk cap;
* **allocation** (``reallocate_drafts``, device): ``core.capacity.allocate`` on the *fresh* confidences;
  value-independent tie-breaks keep TP ranks identical;
* **layout**: ``varlen`` rebuilds the device ``query_start_loc``/``cu_num_logits`` like upstream (FULL varlen
  decode graphs replay it); ``mask`` keeps the uniform layout and uniform graphs (with ``mask_paused_compact``
  its paused steps compact as varlen's do, on varlen graphs), zeroes the pruned rows' input ids, marks them
  in ``is_padding`` (MoE skips them when ``VLLM_MOE_SKIP_PADDING`` is on -- read, never set) and hands the
  rejection sampler an ``invalid_drafts`` mask so pruned drafts reject;
* **saturation**: when verifying stops paying, the draft pass is skipped (DFlash-family speculators take
  ``num_speculative_tokens=0`` and keep their context K/V) and the budget of the placeholder drafts is 0;
* **STS**: temperatures live in one persistent device buffer that the draft graph reads through a wrapped
  ``compute_confidence`` (written in place by online STS, never rebound); outcomes come back through
  ``DraftModelSpeculator.observe_verification``, censored by the admitted counts;
* **traces**: raw confidences and outcomes are copied to pinned buffers on a side stream and written as
  JSONL one step later, so the hot path never waits for the host.

Nothing here runs on CPU except the pure helpers at the top (tested in ``tests/test_vllm_manager.py``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from dspark_cli.core.saturation import StepCharge
from dspark_cli.engines.vllm.config import DsparkVllmSettings
from dspark_cli.engines.vllm.contract import (
    INVALID_DRAFTS_ATTR,
    VLLM_COMPILE,
    VLLM_VERSION,
    compiled_padding,
    dummy_draft_overflow,
    warmup_kv_cap,
    warmup_overflow,
)
from dspark_cli.engines.vllm.step_clock import StepIntervals, clock_for
from dspark_cli.engines.vllm.upkeep import CatchupBuffers, DraftUpkeep, catchup_batch, catchup_budget

logger = logging.getLogger("vllm.dspark")
# Admissible survival for every scheduled draft slot (reallocate_drafts: the budget must be met exactly).
SURVIVAL_FLOOR = 1e-30
REPORT_EVERY_S = 10.0  # the saturation policy's log line (vLLM's own stats line comes as often)
# A step whose prompt-chunk tokens exceed this many per request in its batch is a prefill step, not a decode
# step, to the step-time windows (StepTimer): see prompt_heavy.
PROMPT_TOKENS_PER_REQUEST = 1.0



# ---------------------------------------------------------------------------------------------- pure helpers


class _Begun(NamedTuple):
    """A drafting decision as it was taken: where its interval starts and what its step will be charged as."""

    mark: Any  # the step clock's mark (step_clock)
    drafted: bool
    num_reqs: int
    catchups: int  # draft catch-ups paid before it (engines.vllm.upkeep)
    heavy: bool  # its step's batch carried a prompt chunk (prompt_heavy)
    charge: StepCharge  # what it is to the probe tax (SaturationPolicy.step_charge)


class _StepRecord(NamedTuple):
    """What the manager knew of a step when its interval closed; its time comes later (step_clock)."""

    drafted: bool
    num_reqs: int
    priced_ms: float
    decode: bool  # neither its batch nor the one before carried a prompt chunk (prompt_heavy)
    calibrate: bool  # no paused draft caught up in it
    charge: StepCharge  # what it was to the probe tax as it began


def pruned_token_mask(
    query_start_loc: torch.Tensor, scheduled_drafts: torch.Tensor, admitted: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Bool ``[num_tokens]``: rows holding a scheduled but not admitted draft (mask mode pads them).

    A request's drafts are the last ``scheduled_drafts[r]`` rows of its query, so the pruned ones are the
    last ``scheduled - admitted`` rows. Fixed shapes, no host reads.
    """
    num_reqs = scheduled_drafts.shape[0]
    ends = query_start_loc[1 : num_reqs + 1].long()
    tok = torch.arange(num_tokens, device=ends.device)
    req = torch.searchsorted(ends, tok, right=True).clamp_max(max(num_reqs - 1, 0))
    first_pruned = ends[req] - (scheduled_drafts.long() - admitted.long())[req]
    return tok >= first_pruned


def invalid_draft_rows(expanded_local_pos: torch.Tensor, cu_num_logits: torch.Tensor, admitted: torch.Tensor) -> torch.Tensor:
    """Bool over logit rows: the draft checked at local position ``p`` (draft ``p-1``) was not admitted.

    The same row convention as vLLM's ``grammar_invalid_drafts``: ``invalid_drafts`` marks the logit row
    whose draft must be rejected; the correction token is then sampled from that row's target logits.
    """
    num_reqs = admitted.shape[0]
    counts = (cu_num_logits[1 : num_reqs + 1] - cu_num_logits[:num_reqs]).long()
    row_admitted = torch.repeat_interleave(admitted.long(), counts, output_size=expanded_local_pos.shape[0])
    return expanded_local_pos.long() > row_admitted


def step_sample_points(samples: list[Any]) -> tuple[list[tuple[int, float]], list[tuple[int, float]], bool]:
    """vLLM ``StepTimingSample`` records -> verify points (target tokens, forward ms), draft points (requests,
    drafter ms), and whether the draft points come from FULL-graph steps.

    Like upstream, the draft is priced from steps whose target ran as a FULL graph when there are any: an
    eager target step leaves the CPU launching kernels while the drafter's events run, which inflates the
    drafter's time. Without any, the eager steps' timings (an upper bound) rather than none: pricing the draft
    at 0 would let drafting look free to the saturation policy, which is worse.
    """
    verify = [(int(s.num_target_tokens), float(s.forward_ms)) for s in samples]
    timed = [s for s in samples if s.drafter_ms > 0]
    full = [s for s in timed if getattr(s, "full_cudagraph", False)]
    return verify, [(int(s.num_reqs), float(s.drafter_ms)) for s in (full or timed)], bool(full)


def median_points(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``(size, ms)`` samples -> one ``(size, median ms)`` per size, sorted by size."""
    grouped: dict[int, list[float]] = {}
    for key, value in points:
        grouped.setdefault(int(key), []).append(float(value))
    return [(k, float(np.median(v))) for k, v in sorted(grouped.items())]


def curve_from_samples(samples: list[Any], capture_sizes: list[int], overhead_ms: float, meta: dict[str, Any]) -> Any:
    """vLLM's start-up ``StepTimingSample`` list -> ``core.sps.SpsCurve`` (medians per size), or None if flat.

    Points as :func:`step_sample_points` splits them. The start-up profile is 5 replays per size, some eager or piecewise, so a larger batch can time below a
    smaller one: the medians get a least-squares monotone fit (``core.sps.monotone_fit``), where upstream
    takes a running maximum that lets one slow outlier price every larger batch. A user's file is never
    repaired this way. A verify curve that is still flat means verification costs the same at every size
    on this engine: None, and the manager verifies every draft (saying so) instead of refusing to start.
    """
    from dspark_cli.core.sps import MIN_COST_RATIO, SpsCurve, monotone_fit

    def medians(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
        raw = median_points(points)
        fitted = monotone_fit(raw)
        if fitted != raw:
            logger.info("dspark: vLLM's start-up profile was not monotone; fitted a monotone curve (%d sizes "
                        "adjusted)", sum(a != b for a, b in zip(raw, fitted, strict=True)))
        return fitted

    verify_points, drafted, from_full_graphs = step_sample_points(samples)
    if drafted and not from_full_graphs:
        # mask mode's FULL_DECODE_ONLY graphs never see these dummy batches
        logger.info("dspark: no FULL-graph step timed the drafter at start-up; the draft pass is priced from "
                    "the eager steps (an upper bound)")
    verify = medians(verify_points)
    draft = medians(drafted)
    costs = [y for _, y in verify]
    if not costs or max(costs) < MIN_COST_RATIO * min(costs):
        return None
    return SpsCurve.from_points(verify, draft, overhead_ms, capture_sizes, meta, source="vLLM start-up profile")


def load_curve(settings: DsparkVllmSettings) -> Any | None:
    """The user's curve (file or inline) as an ``SpsCurve``; ``None`` means "profile at start-up"."""
    from dspark_cli.core.sps import SpsCurve

    if settings.sps_curve is None:
        return None
    if isinstance(settings.sps_curve, str):
        return SpsCurve.load(settings.sps_curve)
    return SpsCurve.from_dict(settings.sps_curve, source="dspark sps_curve (inline)")


def with_overhead(curve: Any, overhead_ms: float | None) -> Any:
    if overhead_ms is None or overhead_ms == curve.overhead_ms:
        return curve
    return curve.with_overhead(overhead_ms)


def initial_temperatures(settings: DsparkVllmSettings, k: int) -> list[float]:
    """Offline ``sts.json`` temperatures, or the seed's scalar ``confidence_temperature``, or ones."""
    if settings.sts is not None:
        from dspark_cli.core.sts import load_sts

        return list(load_sts(settings.sts, num_positions=k))
    if settings.confidence_temperature is not None:
        return [float(settings.confidence_temperature)] * k
    return [1.0] * k


def traces_path(path: str, dp_rank: int, dp_size: int) -> Path:
    """One file per data-parallel rank (TP ranks take identical decisions; only TP rank 0 writes)."""
    p = Path(path)
    return p if dp_size <= 1 else p.with_name(f"{p.stem}.dp{dp_rank}{p.suffix or '.jsonl'}")


# ---------------------------------------------------------------------------------------------- trace staging


class _TraceStager:
    """Async D2H of one step's trace rows into pinned buffers; the host writes them a step later."""

    def __init__(self, path: Path, max_reqs: int, k: int, device: torch.device) -> None:
        from dspark_cli.core.traces import TraceWriter

        self.writer = TraceWriter(path)
        self.stream = torch.cuda.Stream(device)
        self.bufs = [
            {
                "conf": torch.empty(max_reqs, k, dtype=torch.float32, pin_memory=True),
                "verified": torch.empty(max_reqs, dtype=torch.int32, pin_memory=True),
                "accepted": torch.empty(max_reqs, dtype=torch.int32, pin_memory=True),
                "valid": torch.empty(max_reqs, dtype=torch.bool, pin_memory=True),
            }
            for _ in range(2)
        ]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.meta: list[tuple[list[str], np.ndarray] | None] = [None, None]
        self.slot = 0
        # The newest step's rows wait in pinned memory for the next step; write them when the worker exits.
        atexit.register(self.close)

    def stage(self, conf: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
              req_ids: list[str], steps: np.ndarray) -> None:
        """Copy one step's rows to pinned memory on the side stream, and write the previous step's. The tensors
        must be this step's own (not views of buffers the compute stream rewrites later): nothing orders such a
        write after the side stream's copy."""
        self._flush(1 - self.slot)  # the previous step's copy was issued a whole step ago
        n = len(req_ids)
        buf = self.bufs[self.slot]
        current = torch.cuda.current_stream(conf.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            buf["conf"][:n].copy_(conf[:n], non_blocking=True)
            buf["verified"][:n].copy_(verified[:n], non_blocking=True)
            buf["accepted"][:n].copy_(accepted[:n], non_blocking=True)
            buf["valid"][:n].copy_(valid[:n], non_blocking=True)
            self.events[self.slot].record()
        for t in (conf, verified, accepted, valid):
            t.record_stream(self.stream)
        self.meta[self.slot] = (list(req_ids), steps.copy())
        self.slot = 1 - self.slot

    def close(self) -> None:
        """Write every staged step (oldest first) and close the file; safe to call more than once."""
        try:
            for slot in (self.slot, 1 - self.slot):  # stage() fills self.slot, then flips: this is oldest first
                self._flush(slot)
        except RuntimeError as exc:  # at interpreter exit the CUDA context may already be gone
            logger.warning("dspark: the last staged trace rows could not be written: %s", exc)
        finally:
            self.writer.close()

    def _flush(self, slot: int) -> None:
        meta = self.meta[slot]
        if meta is None:
            return
        self.meta[slot] = None
        self.events[slot].synchronize()
        req_ids, steps = meta
        n = len(req_ids)
        buf = self.bufs[slot]
        self.writer.write_batch(buf["conf"][:n].numpy(), buf["verified"][:n].numpy(), buf["accepted"][:n].numpy(),
                                requests=req_ids, step=steps, valid=buf["valid"][:n].numpy())


# ---------------------------------------------------------------------------------------------- factory


def prompt_heavy(batch: Any) -> bool:
    """Whether a vLLM input batch is a prefill step to the step-time windows: its requests still prefilling
    schedule more than ``PROMPT_TOKENS_PER_REQUEST`` tokens per request of the batch.

    Why not every batch that carries a chunk: under continuous refill at high load almost every step admits a
    request or two, and a due probe there then never found its load timed by a decode step. On the H200
    (docs/PERFORMANCE.md section 27) every probe at 256 requests waited out ``PROBE_MEASURE_WAIT`` and borrowed the
    quotient of 16-31 requests (1.5-1.9, where the draft pass is host-bound), so drafting never resumed at 256,
    where verifying everything led no speculation by 27%. A chunk or two among 256 decode rows is priced by the
    curve with its tokens and costs about that. Why not none: a wave's first step prefills every prompt at once
    (2,000 prompt tokens over 16 requests), runs eagerly under decode-only graphs and, paused, runs the draft's
    prefill over them; timed as a paused step it restarted a stale plain window, and a rise probe at 16 requests
    paid on a cost scale of 0.83 where drafting costs ~1.7x (section 26). Unknown batch layouts count as prefill
    steps when they say they carry one."""
    if not bool(getattr(batch, "has_prefill", False)):
        return False
    rows, scheduled = getattr(batch, "is_prefilling_np", None), getattr(batch, "num_scheduled_tokens", None)
    if rows is None or scheduled is None:
        return True
    n = int(batch.num_reqs)
    prefilling = np.asarray(rows[:n], dtype=bool)
    tokens = np.asarray(scheduled[:n], dtype=np.int64)[prefilling]
    drafts = getattr(batch, "num_draft_tokens_per_req", None)
    if drafts is not None:  # placeholder drafts a prefilling row may be padded with are no prompt tokens
        tokens = tokens - np.asarray(drafts[:n], dtype=np.int64)[prefilling]
    return int(tokens.sum()) > PROMPT_TOKENS_PER_REQUEST * max(1, n)


SPECULATOR_MANAGER_ATTR = "_dspark_manager"  # on a hooked speculator: the manager its hooks serve


def install_speculator_hooks(spec: Any, *, calibrate: bool, skip_decode: bool) -> None:
    """Wrap the speculator once; every wrapper calls whichever manager ``spec._dspark_manager`` is now.

    * ``model.compute_confidence`` (``calibrate``): STS inside the draft graph (DSpark confidence heads);
    * ``observe_verification``: outcomes for online STS and traces, and upstream's estimator censored;
    * ``propose`` / ``_multi_step_decode`` / ``sample_draft`` (``skip_decode``, StandaloneAR): a paused step
      skips the draft's K - 1 decode passes and the prefill's first-token sample, whose token the runner
      discards (every draft of a 0-draft step becomes -1): a vocabulary-wide head over every request, 0.40 of
      the 0.74 ms a paused step cost over plain decoding on the H200 (Llama-3-8B shape, 64 requests;
      docs/PERFORMANCE.md section 15). With the manager's ``_upkeep`` (varlen) a paused pure-decode step
      skips the prefill pass too and owes its K/V writes; a later propose writes them first, as a
      synthetic batch through the speculator's own ``_prefill`` (``engines.vllm.upkeep``: served on the
      H200, +29% and +23% at 16 and 64 requests over keeping the draft current, section 16). Without it the
      prefill pass runs, which keeps the draft's K/V complete.
    """
    def manager() -> Any:
        return getattr(spec, SPECULATOR_MANAGER_ATTR)

    model = getattr(spec, "model", None)
    if calibrate and model is not None and hasattr(model, "compute_confidence"):
        original_confidence = model.compute_confidence

        def compute_confidence(*args: Any, **kwargs: Any) -> torch.Tensor:
            return manager().calibrate_in_graph(original_confidence(*args, **kwargs))

        model.compute_confidence = compute_confidence
    if hasattr(spec, "observe_verification"):
        original_observe = spec.observe_verification

        def observe_verification(idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                                 num_rejected: torch.Tensor) -> None:
            m = manager()
            original_observe(idx_mapping, num_sampled, m.verified_rejections(num_sampled, num_rejected))
            m.observe(num_sampled)

        spec.observe_verification = observe_verification
    if skip_decode:
        original_decode = spec._multi_step_decode
        original_propose = spec.propose

        def _multi_step_decode(*args: Any, **kwargs: Any) -> None:
            if manager()._skip_decode:
                return None
            return original_decode(*args, **kwargs)

        if hasattr(spec, "sample_draft"):
            original_sample = spec.sample_draft

            def sample_draft(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                if manager()._skip_decode:
                    # The caller stores this into draft_tokens[:, 0]: hand back what is there, touch nothing
                    # (draft logits and confidences keep the last real step's values, as record_confidences
                    # expects of a paused step).
                    return spec.draft_tokens[: hidden_states.shape[0], 0]
                return original_sample(hidden_states, *args, **kwargs)

            spec.sample_draft = sample_draft

        def propose(*args: Any, **kwargs: Any) -> torch.Tensor:
            m = manager()
            dummy = bool(kwargs.get("dummy_run"))
            paused = m._pause_supported and kwargs.get("num_speculative_tokens") == 0 and not dummy
            upkeep = m._upkeep
            if upkeep is not None and not dummy:
                batch = args[0] if args else kwargs["input_batch"]
                r = int(batch.num_reqs)
                slots = np.asarray(batch.idx_mapping_np[:r])
                deferred = upkeep.deferrable(batch, slots) if paused else None
                if deferred is not None:
                    upkeep.skip(slots, deferred)  # no draft work: these tokens are written at the next catch-up
                    return spec.draft_tokens[:r]
                owed = upkeep.owed(slots)
                if owed.any():
                    owed = upkeep.fit(owed)
                    # A batch that verifies no drafts (every query token committed) whose rows, one slot per
                    # request included, fit the token budget: one pass, rows run on through each query. The
                    # expanded buffers hold a request count more, but torch.compile's range for the draft ends
                    # at the budget, and a pass past it stops vLLM (section 38's "Shape: 257"). Else a catch-up
                    # of its own (owed + 2 x requests tokens, within the budget by upkeep.catchup_budget), then
                    # the step's own pass (within it by vLLM's scheduler).
                    whole = (int(batch.num_draft_tokens or 0) == 0
                             and int(owed.sum()) + int(batch.num_tokens) + r <= int(spec.max_num_tokens))
                    rows = catchup_batch(batch, m.req_states.all_token_ids.gpu, owed, m._catchup_buffers,
                                         whole_query=whole)
                    upkeep.paid(slots, merged=whole)
                    if whole:  # the catch-up is this step's prefill pass
                        args, kwargs = _with_batch(args, kwargs, rows)
                    else:  # drafts verified, or too large: write the owed positions, then the step's own pass
                        m._skip_decode = True
                        try:
                            last_sampled = args[7] if len(args) > 7 else kwargs["last_sampled"]
                            spec._prefill(rows, m._no_rejections[:r], last_sampled, r, False, None)
                        finally:
                            m._skip_decode = False
            m._skip_decode = paused
            try:
                return original_propose(*args, **kwargs)
            finally:
                m._skip_decode = False

        spec._multi_step_decode = _multi_step_decode
        spec.propose = propose


class BatchBudget(NamedTuple):
    """The budget decision of the batch being prepared (``get_num_tokens`` -> ``reallocate_drafts``).

    Three fields, budget last: upstream's ``compact_batch`` unpacks ``_, _, budget``. ``counts`` holds each
    request's scheduled drafts and non-draft tokens in ``req_ids``' order; the runner may hand
    ``reallocate_drafts`` another order.
    """

    req_ids: list[str]
    counts: np.ndarray  # [3, R] int32: drafts, non-draft tokens, drafts that may be admitted (real ones)
    budget: int

    def in_order(self, req_ids: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Scheduled drafts, non-draft tokens and admissible drafts of each request, in ``req_ids``' order."""
        if req_ids == self.req_ids:
            return self.counts[0], self.counts[1], self.counts[2]
        where = {x: i for i, x in enumerate(self.req_ids)}
        idx = np.fromiter(map(where.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
        return self.counts[0][idx], self.counts[1][idx], self.counts[2][idx]


def _with_batch(args: tuple[Any, ...], kwargs: dict[str, Any], batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (batch, *args[1:]), kwargs
    return args, {**kwargs, "input_batch": batch}


def _varlen_unsupported(av_module: Any, kwargs: dict[str, Any]) -> str | None:
    """Why the target's attention backends cannot run varlen batches under FULL decode graphs (None: they can)."""
    req_states = kwargs["req_states"]
    attn_groups = kwargs["attn_groups"]
    layers = kwargs.get("target_layer_names")
    backend = av_module.get_query_lens_mismatch_unsupported_backend(attn_groups, checked_layer_names=layers)
    if backend is not None:
        return f"the {backend} attention backend needs exact CPU query lengths"
    max_query_len = req_states.num_speculative_steps + kwargs["num_bonus_tokens"]
    unsupported = av_module.get_varlen_cudagraph_unsupported_backend(
        attn_groups, kwargs["vllm_config"], max_query_len, checked_layer_names=layers
    )
    extra = kwargs.get("additional_attn_cg_support")
    if unsupported is None and extra is not None and extra[0] != av_module.AttentionCGSupport.ALWAYS:
        unsupported = (extra[1], None)
    if unsupported is not None:
        return (f"the {unsupported[0]} attention backend cannot replay varlen decode graphs of up to "
                f"{max_query_len} tokens per request")
    return None


def check_mask_rows(max_num_reqs: int, k: int, num_bonus_tokens: int, max_total_logits: int) -> None:
    """Mask mode verifies the uniform batch, ``1 + K`` logit rows per request whatever it admits; vLLM 0.33's
    rejection sampler verifies a batch with adaptive verification on in one chunk of at most
    ``max_total_logits`` rows (1 GiB of fp32 logits: 2,093 rows for a 128,256-token vocabulary, 1,766 for
    151,936) and asserts beyond it (``_verify_in_chunks``). Varlen's budget is capped to fit; mask cannot shrink
    its batch, so a full one must fit: refused at start-up rather than by an assertion under load."""
    rows = max_num_reqs * (k + num_bonus_tokens)
    if rows > max_total_logits:
        most = max_total_logits // (k + num_bonus_tokens)
        raise ValueError(f"dspark mask mode: a full batch of {max_num_reqs} requests verifies {rows} logit rows "
                         f"(1 + {k} each), more than vLLM {VLLM_VERSION} verifies at once for this vocabulary "
                         f"({max_total_logits}); use --max-num-seqs {most} or fewer, fewer draft tokens, or varlen")


def check_draft_warmup(vllm_config: Any, kv_groups: int) -> None:
    """Refuse at start-up what vLLM 0.33's warm-up would stop on after the weights load (``contract.
    warmup_overflow``): a ``draft_model`` server under torch.compile whose token budget, not ``max_num_seqs``,
    bounds the warm-up. Said only where that is certain: a KV cache already sized (the worker sets
    ``num_gpu_blocks`` before the runner builds this manager) that holds the warm-up's requests even if the draft
    keeps a KV cache group of its own beside the target's one (``contract.warmup_kv_cap``, a lower bound); a
    target of several groups (hybrid attention) is left to vLLM."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method != "draft_model" or kv_groups != 1:
        return
    mode = vllm_config.compilation_config.mode
    if getattr(mode, "value", mode) != VLLM_COMPILE or not vllm_config.kernel_config.enable_jit_warmup:
        return
    cache = vllm_config.cache_config
    if cache.num_gpu_blocks is None:
        return
    k = int(spec.num_speculative_tokens)
    cap = warmup_kv_cap(int(cache.num_gpu_blocks), int(cache.block_size), k, int(vllm_config.num_lookahead_tokens),
                        int(vllm_config.model_config.max_model_len), groups=kv_groups + 1)
    sched = vllm_config.scheduler_config
    problem = warmup_overflow(int(sched.max_num_seqs), int(sched.max_num_batched_tokens), k, max_warmup_reqs=cap)
    if problem is not None:
        raise ValueError(f"dspark: {problem}")


def create_manager(settings: DsparkVllmSettings, av_module: Any, kwargs: dict[str, Any]) -> Any:
    """Our replacement for ``maybe_create_adaptive_verification_manager`` (called by the plugin's gate).

    ``varlen`` needs every target attention backend to accept device/CPU query-length mismatch and to replay
    varlen FULL decode graphs; where one cannot, we fall back to ``mask`` with one log line instead of
    refusing to start (upstream raises). Mask mode with ``mask_paused_compact`` runs its paused steps compacted
    as varlen does, on varlen decode graphs, where the backends allow it (``compact_paused``).
    """
    mode = settings.mode
    vllm_config = kwargs["vllm_config"]
    check_draft_warmup(vllm_config, len(kwargs["attn_groups"]))
    compact_paused = mode == "varlen"
    if mode == "varlen" or settings.mask_paused_compact:
        reason = _varlen_unsupported(av_module, kwargs)
        if reason is not None and mode == "varlen":
            logger.warning("dspark: varlen verification falls back to mask: %s", reason)
            mode, compact_paused = "mask", False
        elif reason is not None:
            logger.warning("dspark: mask mode's paused steps stay uniform: %s", reason)
        else:
            compact_paused = True
    if mode == "mask":
        req_states = kwargs["req_states"]
        check_mask_rows(int(req_states.max_num_reqs), int(req_states.num_speculative_steps),
                        int(kwargs["num_bonus_tokens"]), int(kwargs["max_total_logits"]))
        if kwargs.get("copy_admitted_drafts_to_host"):
            raise ValueError("dspark mask mode cannot run with batch-sharded sampling (the sampler's batch copy "
                             "loses the invalid-draft mask): use varlen, or disable batch-sharded sampling")
        if getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) > 1:
            raise ValueError("dspark mask mode does not support prefill context parallelism: use varlen")
    cls = build_manager_class(av_module.AdaptiveVerificationManager)
    return cls(
        settings=settings,
        mode=mode,
        compact_paused=compact_paused,
        vllm_config=vllm_config,
        req_states=kwargs["req_states"],
        query_start_loc=kwargs["query_start_loc"],
        num_bonus_tokens=kwargs["num_bonus_tokens"],
        max_total_logits=kwargs["max_total_logits"],
        copy_admitted_drafts_to_host=kwargs.get("copy_admitted_drafts_to_host", False),
    )


@functools.lru_cache(maxsize=4)
def build_manager_class(base: type) -> type:
    """Subclass vLLM's manager (known only at run time, in a worker with vLLM imported)."""
    import vllm.envs as envs
    from vllm.distributed.parallel_state import get_tp_group
    from vllm.utils.torch_utils import async_tensor_h2d
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import AdmittedDraftCounts

    from dspark_cli.core.capacity import (
        BudgetDecision,
        allocate,
        choose_budget,
        prefix_survival,
        warm_up_allocate,
    )
    from dspark_cli.core.saturation import (
        PROBE_TAX_CLAMP,
        STEP_TIME_CLAMP,
        SaturationPolicy,
        StepTimeCalibration,
        StepTimer,
    )
    from dspark_cli.core.sts import OnlineSTS, apply_temperatures

    class DsparkVerificationManager(base):  # type: ignore[misc, valid-type]
        dspark_manager = True

        def __init__(self, *, settings: DsparkVllmSettings, mode: str, vllm_config: Any,
                     compact_paused: bool | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.settings = settings
            self.mode = mode
            # A paused step runs one token per request on varlen decode graphs: always in varlen, in mask
            # with mask_paused_compact where the backend replays varlen graphs (create_manager decides).
            self.compact_paused = mode == "varlen" if compact_paused is None else compact_paused
            self.cfg = settings.replace(mode=mode).capacity_config()
            self.saturation = SaturationPolicy.from_config(self.cfg)  # its probe tax reads the step timing
            # Step times (between drafting decisions, in the GPU's stream order on CUDA: step_clock says why):
            # the probe tax, and what a drafting step costs against a paused one, which in vLLM is not plain
            # decoding (core.saturation.StepTimer).
            self.timer = StepTimer(self.saturation, tax_clamp=PROBE_TAX_CLAMP)
            # Prefill steps (prompt_heavy, or the step after one) feed no window the policy reads; timed here
            # apart, for the log only, catch-ups included: a paused step that admits prompts also catches the
            # draft up, and that is what such a step costs. Under decode-only graphs they run the target eagerly,
            # and at 256 requests under refill they set the pace of a cell (docs/PERFORMANCE.md section 28).
            self._prefill_times = StepTimeCalibration()
            self._clock = time.perf_counter  # the server log's period
            # Steps are timed between marks of this clock, handed back once final (a step or two late on CUDA).
            self._intervals: StepIntervals[_StepRecord] = StepIntervals(clock_for(torch.device(self.req_states.device)))
            self._last_begin: _Begun | None = None  # the last drafting decision
            self._step_decision: BudgetDecision | None = None  # priced the batch now running (get_num_tokens)
            # What the policy did, in the server log every REPORT_EVERY_S (vLLM's /metrics are vLLM's own).
            self._decisions = {True: 0, False: 0}
            self._report_every = REPORT_EVERY_S
            self._next_report: float | None = None
            self.vllm_config = vllm_config
            pc = vllm_config.parallel_config
            self._dp_size = int(getattr(pc, "data_parallel_size", 1))
            self._dp_rank = int(getattr(pc, "data_parallel_rank", 0))
            self._user_curve = load_curve(settings)
            self.curve: Any = None
            self._verify_all = False  # the start-up profile was flat: no curve, verify every draft
            self._capture_sizes: list[int] = []
            # Query slots a speculator's prefill pass adds per request (a draft_model one: 1), which vLLM's dummy
            # runs do not budget for once padded (contract.dummy_draft_overflow); attach reads the speculator's own.
            spec_config = getattr(vllm_config, "speculative_config", None)
            self._draft_extra_slots = int(getattr(spec_config, "method", None) == "draft_model")
            k = self.num_speculative_steps
            device = self.req_states.device
            max_reqs = self.req_states.max_num_reqs
            self._sched_gpu = torch.zeros(max_reqs, dtype=torch.int32, device=device)
            self._admissible_gpu = torch.zeros(max_reqs, dtype=torch.int32, device=device)
            # A paused varlen step's logit rows (_paused_layout): one per request.
            self._paused_cu_num_logits = (torch.arange(max_reqs + 1, dtype=self._cu_num_logits.dtype, device=device)
                                          * self.num_bonus_tokens)
            self._raw_slots = torch.ones(max_reqs, k, dtype=torch.float32, device=device)
            self._raw_batch = torch.ones(max_reqs, k, dtype=torch.float32, device=device)
            self._calibrated = torch.ones(max_reqs, k, dtype=torch.float32, device=device)
            self._steps = np.zeros(max_reqs, dtype=np.int64)
            init_t = initial_temperatures(settings, k)
            # Given temperatures are per-position priors; without them each position starts from its
            # predecessor's online fit (core.sts: an untested position could otherwise never be tested).
            offline = settings.sts is not None or settings.confidence_temperature is not None
            self.online_sts = (
                OnlineSTS(k, device=device, refit_interval=settings.sts_refit_interval,
                          initial_temperatures=init_t if offline else None)
                if settings.online_sts else None
            )
            # The one buffer every consumer reads; online STS updates it in place (.copy_), never rebinds it.
            self.temperatures = (
                self.online_sts.temperatures if self.online_sts is not None
                else torch.tensor(init_t, dtype=torch.float32, device=device)
            )
            # Online STS's logit shifts (core.sts: why temperatures alone cannot calibrate some heads); the
            # same in-place contract as the temperatures. None without online STS.
            self.offsets = self.online_sts.offsets if self.online_sts is not None else None
            self._identity_t = self.online_sts is None and all(t == 1.0 for t in init_t)
            self._in_graph_sts = False  # set once the wrapped compute_confidence is seen
            self._mask_pending: int | None = None
            self._verify_pending: tuple[list[str], int, np.ndarray, bool] | None = None
            self._drafts_real = True  # whether the drafts verified next are real (not a paused step's stale ids)
            # Whether a paused step came since the last confidences were recorded, and whether the snapshot the
            # next budget reads (the one before the latest) predates a pause: a probe's verification would then
            # plan on the confidences that paused drafting, however long ago, and verify nothing where they
            # have since recovered. Such a snapshot reads as unknown (1), as a new request's does.
            self._paused_since_record = False
            self._stale_predates_pause = False
            # The same per request slot: a request the step that resumed drafting did not schedule (its token
            # budget ran out) still holds the paused step's -1 ids and vLLM's placeholders for them where the
            # placeholders are kept (plain_paused_steps off, or a worker in another process). Its next step must
            # admit none of them: a -1 id in the verify batch is an embedding lookup out of range.
            self._slot_real = np.ones(max_reqs, dtype=bool)
            self._pause_supported = False
            # Step timing only on a single rank: TP ranks must take the same saturation decisions, and
            # those are reproducible from shared outcomes but not from each rank's own clock (attach sets it).
            self._timed = False
            self._skip_decode = False  # StandaloneAR: this propose keeps its prefill pass only
            # plain_paused_steps: empties the placeholder drafts vLLM's scheduler handed this step's requests
            # (plugin.PatchState.drop_placeholders), so the step after a paused one is scheduled as plain decoding.
            self._drop_placeholders: Callable[[], bool] | None = None
            self._plain_after_pause = 0  # paused steps whose placeholders were dropped
            self._upkeep: DraftUpkeep | None = None  # StandaloneAR in varlen: deferred draft K/V (attach)
            self._catchup_buffers: CatchupBuffers | None = None
            self._no_rejections = torch.zeros(max_reqs, dtype=torch.int32, device=device)
            self._attached = False
            self._traces: _TraceStager | None = None
            # The saturation policy's outcome feedback: a drafting step's emitted-token count goes to the host
            # on a side copy and is judged while the next batch is prepared if it has landed, else at that
            # step's drafting decision, after its forward is launched (_judge_last_outcome): the host never
            # holds back a launch for it. Waits there are timed and logged (outcome waits).
            pin = device.type == "cuda"
            self._outcome_host = torch.zeros((), dtype=torch.int64, pin_memory=pin)
            self._outcome_event = torch.cuda.Event() if pin else None
            # The decision of the step being verified, and one whose outcome is being copied: with its request
            # count and the probe it was planned in (SaturationPolicy.probe_serial; see _judge_last_outcome).
            self._outcome_decision: tuple[Any, int, int] | None = None
            self._outcome_pending: tuple[Any, int, int] | None = None
            self._outcome_waits = 0  # outcomes the host had to wait for, and how long in all (_judge_last_outcome)
            self._outcome_wait_ms = 0.0
            self._moe_skip = bool(envs.VLLM_MOE_SKIP_PADDING)
            # Mask mode saves compute by pruning only where padding rows are skipped: MoE layers under
            # VLLM_MOE_SKIP_PADDING. Elsewhere the core prices the uniform batch whole (core.capacity).
            is_moe = getattr(getattr(vllm_config, "model_config", None), "is_moe", False)
            moe = bool(is_moe() if callable(is_moe) else is_moe)  # a property in vLLM 0.33
            self.cfg = dataclasses.replace(self.cfg, mask_pruning_saves=self._moe_skip and moe)
            logger.info("dspark: adaptive verification by dspark (mode=%s, policy=%s, curve=%s, sts=%s)",
                        mode, self.cfg.policy, "start-up profile" if self._user_curve is None else "user",
                        "online" if self.online_sts is not None else ("offline" if not self._identity_t else "off"))

        # ---------------------------------------------------------------- TP helpers
        def _tp(self) -> Any | None:
            group = get_tp_group()
            return group if group.world_size > 1 else None

        # ---------------------------------------------------------------- SPS curve
        def batches_to_profile(self, capture_sizes: list[int]) -> Any:
            self._capture_sizes = list(capture_sizes)
            if self._user_curve is not None:
                self._cudagraph_limit = capture_sizes[-1] if capture_sizes else 0
                return iter(())  # the user's curve replaces the start-up profile
            batches = list(super().batches_to_profile(capture_sizes))
            budget = int(self.req_states.max_num_batched_tokens)
            padded_to = compiled_padding(getattr(self.vllm_config, "compilation_config", None), self._capture_sizes)
            extra = 0 if padded_to is None else self._draft_extra_slots  # only torch.compile's ranges end there
            overflow = {b["num_tokens"]: dummy_draft_overflow(b["num_tokens"], padded_to or [],
                                                                int(self.req_states.max_num_reqs), budget, extra)
                        for b in batches}
            skipped = sorted(n for n, over in overflow.items() if over is not None)
            if skipped:
                # vLLM would stop its own start-up on these (upstream's manager does); the curve is fitted over
                # the sizes left and extends past them as it does past the largest one.
                logger.info("dspark: the start-up profile skips %d batch sizes (%s): their dummy runs would run the "
                            "draft over up to %d tokens, past the %d torch.compile covers", len(skipped),
                            ", ".join(map(str, skipped)), max(overflow[n] for n in skipped), budget)
            return iter([b for b in batches if overflow[b["num_tokens"]] is None])

        def set_initial_cost_curves(self, samples: list[Any]) -> None:
            from dspark_cli.core.sps import SpsCurve

            if self._user_curve is not None:
                curve = self._user_curve
            elif samples:
                curve = curve_from_samples(samples, self._capture_sizes, 0.0,
                                           {"engine": "vllm", "source": "start-up profile"})
            else:
                raise RuntimeError("dspark: vLLM's start-up profile produced no step timings; pass --sps-curve "
                                   "(measure one with `dspark profile-sps --engine vllm`)")
            if curve is not None:
                curve = with_overhead(curve, self.settings.overhead_ms)
            tp = self._tp()
            if tp is not None:  # every rank takes rank 0's curve (or rank 0's verdict that it was flat)
                shared = tp.broadcast_object(None if curve is None else curve.to_dict(), src=0)
                curve = None if shared is None else SpsCurve.from_dict(shared, source="TP rank 0")
            if curve is None:
                logger.warning("dspark: vLLM's start-up profile prices every verify batch the same, so capacity "
                               "scheduling cannot pay here: verifying every draft. Measure a curve with "
                               "`dspark profile-sps --engine vllm` and pass it as --sps-curve")
                self._verify_all = True
                return
            self.curve = curve
            logger.info("dspark: SPS curve with %d verify points (capture limit %d), %d draft points, overhead "
                        "%.3f ms", len(curve.verify_ms), curve.capture_limit, len(curve.draft_ms), curve.overhead_ms)

        def set_cost_curves(self, draft_curve: list[tuple[int, float]], verify_curve: list[tuple[int, float]]) -> None:
            from dspark_cli.core.sps import SpsCurve

            self._user_curve = SpsCurve.from_points(verify_curve, draft_curve, 0.0, self._capture_sizes)
            self.set_initial_cost_curves([])

        # ---------------------------------------------------------------- requests and confidences
        def add_request(self, req_idx: int) -> None:
            super().add_request(req_idx)
            self._raw_slots[req_idx].fill_(1.0)
            self._slot_real[req_idx] = True
            if self._upkeep is not None:
                self._upkeep.reset(req_idx)
            self._steps[req_idx] = 0

        def record_confidences(self, confidence_probs: torch.Tensor, input_batch: Any) -> None:
            if not self._drafts_real:
                return  # the draft pass was skipped: the buffers still hold older, real confidences
            n = input_batch.num_reqs
            if self._in_graph_sts:
                raw = self._raw_batch[:n]  # written by the wrapped compute_confidence inside the graph
                calibrated = confidence_probs
            else:
                raw = confidence_probs[:n]
                if self._identity_t:
                    calibrated = confidence_probs
                else:
                    calibrated = self._calibrated
                    calibrated[:n].copy_(apply_temperatures(raw, self.temperatures, self.offsets))
            self._raw_slots[input_batch.idx_mapping] = raw
            super().record_confidences(calibrated, input_batch)
            self._stale_predates_pause, self._paused_since_record = self._paused_since_record, False

        # ---------------------------------------------------------------- budget (host, stale)
        def get_num_tokens(self, num_tokens_per_req: dict[str, int], draft_tokens: dict[str, list[int]]) -> int:
            assert self.curve is not None or self._verify_all, "dspark: SPS curve not set (capture_model did not run)"
            req_ids = list(num_tokens_per_req)
            r = len(req_ids)
            scheduled = np.fromiter(num_tokens_per_req.values(), dtype=np.int64, count=r)
            drafts = np.fromiter((len(draft_tokens.get(x, ())) for x in req_ids), dtype=np.int64, count=r)
            nondraft = scheduled - drafts
            total = int(drafts.sum())
            cap = min(total, max(0, self._max_total_logits - r * self.num_bonus_tokens))
            admissible = drafts
            # Not waiting here: the target's forward of this batch is not launched yet, and the verdict is only
            # needed by this step's drafting decision (begin_drafting_step), which waits for it if need be.
            self._judge_last_outcome(wait=False)
            if self._drafts_real:
                slots = np.fromiter(map(self.req_states.req_id_to_index.__getitem__, req_ids), dtype=np.int64,
                                    count=r)
                real = self._slot_real[slots]
                if not real.all():
                    admissible = np.where(real, drafts, 0)
                    cap = min(int(admissible.sum()), cap)
            if self._verify_all:
                budget = cap if self._drafts_real else 0
            elif self._drafts_real:
                stale = self._stale_confidences[self._stale_idx].np[slots]
                if self._stale_predates_pause:
                    stale = np.ones_like(stale)
                survival = np.cumprod(np.clip(np.nan_to_num(stale.astype(np.float64), nan=0.0), 0.0, 1.0), axis=1)
                survival[~real] = 0.0
                num_sampling = int(np.count_nonzero(
                    self.req_states.num_computed_tokens_np[slots] + nondraft >= self.req_states.prefill_len.np[slots]
                ))
                # The cap (vLLM's one chunk of logit rows) bounds the search itself, so the decision the saturation
                # policy judges is priced at the budget that runs.
                # With probe_scout, the drafting decision begun last may have begun a probe, and this batch
                # verifies its drafts: a scout verifies none, and the probe's next batch plans on the confidences
                # it recorded, the stale snapshot by then.
                decision = choose_budget(survival, admissible, int(nondraft.sum()), num_sampling, self.curve, self.cfg,
                                         max_budget=cap, batch_drafts=total,
                                         scout=self.saturation.scouting and self.saturation.probing)
                budget = decision.budget
                self._step_decision = decision
                if self._pause_supported:
                    # Judged by its outcome once that is on the host (observe -> next get_num_tokens).
                    self._outcome_decision = (decision, r, self.saturation.probe_serial)
            else:
                budget = 0  # placeholders from a paused draft pass: verify none of them
            self._batch_budget = BatchBudget(req_ids, np.stack([drafts, nondraft, admissible]).astype(np.int32),
                                             budget)
            compact = self.mode == "varlen" or self._paused_compact_step()
            return int(nondraft.sum()) + (budget if compact else total)

        def _paused_compact_step(self) -> bool:
            """This step's placeholder drafts are verified by none and the batch compacts (``compact_paused``)."""
            b = self._batch_budget
            return self.compact_paused and b is not None and b.budget == 0 and not self._drafts_real

        def compact_batch(self, num_draft_tokens_per_req: np.ndarray, num_scheduled_tokens: np.ndarray,
                          cu_num_logits_np: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            if self.mode == "mask" and not self._paused_compact_step():
                return num_scheduled_tokens, cu_num_logits_np  # uniform layout: nothing moves
            return super().compact_batch(num_draft_tokens_per_req, num_scheduled_tokens, cu_num_logits_np)

        # ---------------------------------------------------------------- allocation (device, fresh)
        def reallocate_drafts(self, req_ids: list[str], idx_mapping: torch.Tensor) -> tuple[Any, Any, int, Any]:
            batch_budget, self._batch_budget = self._batch_budget, None
            assert batch_budget is not None
            r = idx_mapping.shape[0]
            budget = batch_budget.budget
            if budget == 0 and not self._drafts_real and self.compact_paused:
                return self._paused_layout(req_ids, r, idx_mapping)
            sched, nondraft, admissible = batch_budget.in_order(req_ids)
            # What the runner sizes the batch by: mask's uniform layout holds every scheduled draft's row, and a
            # split other than the scheduled one must reach the host (below). `total` is what may be admitted.
            scheduled_total = total = int(sched.sum())
            sched_gpu = self._sched_gpu[:r]
            async_tensor_h2d(sched, out=sched_gpu)
            limit_gpu = sched_gpu
            if total != int(admissible.sum()):  # stale ids in some rows (_slot_real): never admitted
                limit_gpu = self._admissible_gpu[:r]
                async_tensor_h2d(admissible, out=limit_gpu)
                total = int(admissible.sum())
            caps = self._batch_draft_capacity[:r]
            if budget == 0:
                caps.zero_()
            elif budget >= total:
                caps.copy_(limit_gpu)
            else:
                # The runner sizes the batch by the host's `budget` (no sync), so the allocation must admit
                # exactly that many drafts -- and it never admits a zero-survival slot. This step's
                # confidences can be 0 where the step-old copy that chose the budget was not (vLLM's
                # estimator passed through without STS): without the floor the batch came out short, the
                # likely cause of a gather past it on the H200 (docs/PERFORMANCE.md section 14). Floored
                # slots tie and rank by (position, request), so every request still gets a prefix.
                survival = torch.nan_to_num(prefix_survival(self._confidence_probs[idx_mapping]), nan=0.0)
                caps.copy_(allocate(survival.clamp_min_(SURVIVAL_FLOOR), limit_gpu, budget))
            self._verify_pending = (list(req_ids), r, idx_mapping, self._drafts_real)
            self._cu_num_logits[:1].zero_()
            if self.mode == "mask":
                torch.cumsum(sched_gpu + self.num_bonus_tokens, dim=0, out=self._cu_num_logits[1 : r + 1])
                self._mask_pending = r
                return self._cu_num_logits[: r + 1], self.query_start_loc, scheduled_total, None
            nondraft_gpu = self._num_non_draft_tokens[:r]
            async_tensor_h2d(nondraft, out=nondraft_gpu)
            torch.cumsum(caps + self.num_bonus_tokens, dim=0, out=self._cu_num_logits[1 : r + 1])
            self.query_start_loc[:1].zero_()
            torch.cumsum(caps + nondraft_gpu, dim=0, out=self.query_start_loc[1 : r + 1])
            self.query_start_loc[r + 1 :].fill_(int(nondraft.sum()) + budget)
            admitted = None
            # The host's split of the budget (upstream's compact_batch) is exact only for 0 or every scheduled
            # draft; any other split -- stale rows admitting none included -- is handed over.
            if self._copy_admitted_drafts_to_host and 0 < budget < scheduled_total:
                admitted_cpu = self._admitted_drafts_cpu[:r]
                current = torch.cuda.current_stream(self.req_states.device)
                self._copy_stream.wait_stream(current)
                with torch.cuda.stream(self._copy_stream):
                    admitted_cpu.copy_(caps, non_blocking=True)
                    self._admitted_drafts_event.record()
                admitted = AdmittedDraftCounts(admitted_cpu, self._admitted_drafts_event)
            return self._cu_num_logits[: r + 1], self.query_start_loc, budget, admitted

        def _paused_layout(self, req_ids: list[str], r: int, idx_mapping: torch.Tensor) -> tuple[Any, Any, int, Any]:
            """A paused varlen step's layout: its placeholder drafts are verified by none, so every request has
            one logit row, and its query starts are the ones the runner copied from the host just before this
            call (upstream's ``compact_batch`` gives a budget of 0 the exact non-draft counts). One device copy
            instead of the allocation's dozen launches and two copies (0.38 ms of host time per paused step on
            the H200, docs/PERFORMANCE.md section 16, where a paused step's host time is what low loads cannot
            hide)."""
            self._batch_draft_capacity[:r].zero_()  # read by nothing on a paused step; kept true regardless
            self._verify_pending = (list(req_ids), r, idx_mapping, False)
            self._cu_num_logits[: r + 1].copy_(self._paused_cu_num_logits[: r + 1])
            return self._cu_num_logits[: r + 1], self.query_start_loc, 0, None

        def apply_mask(self, input_batch: Any) -> None:
            """Mask mode, after the runner wrote the drafts: pad pruned rows and mark their drafts invalid."""
            r, self._mask_pending = self._mask_pending, None
            if r is None:
                return
            caps = self._batch_draft_capacity[:r]
            pruned = pruned_token_mask(input_batch.query_start_loc, self._sched_gpu[:r], caps, input_batch.num_tokens)
            n = input_batch.num_tokens
            input_batch.input_ids[:n].masked_fill_(pruned, 0)
            if self._moe_skip:
                input_batch.is_padding[:n].logical_or_(pruned)
            setattr(input_batch, INVALID_DRAFTS_ATTR,
                    invalid_draft_rows(input_batch.expanded_local_pos, input_batch.cu_num_logits, caps))

        # ---------------------------------------------------------------- speculator hooks
        def attach(self, runner: Any) -> None:
            """Point the speculator's hooks at this manager before graphs are captured (idempotent).

            vLLM builds a manager for its profiling pass (``initialize_kv_cache(..., is_profiling=True)``) and
            another for serving, on the same speculator; the hooks are installed once and always serve the
            latest manager, so nothing is wrapped twice (offline STS temperatures applied twice, say).
            """
            if self._attached:
                return
            self._attached = True
            spec = runner.speculator
            if spec is None:
                return
            from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
            from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

            # Pausing = the runner schedules 0 drafts for the step (begin_drafting_step), which vLLM 0.33
            # already supports per step: the speculator is told num_speculative_tokens=0 and writes no draft
            # (-1 ids). vLLM's asynchronous scheduler still reserves K placeholders for the next step unless
            # plain_paused_steps empties them (then that step decodes one token per request); where they stay,
            # the step verifies none of them (budget 0, _slot_real per request). The DFlash family then stores its
            # context K/V and skips the query pass; StandaloneAR ignores the count, so its K-1 decode passes
            # are skipped here, and in varlen its prefill pass too, the draft's K/V caught up later
            # (engines.vllm.upkeep: drafts after resuming are as good as before the pause); in mask mode
            # the prefill pass still runs. Other speculators only trim (budget 0).
            standalone = isinstance(spec, StandaloneARSpeculator)
            self._draft_extra_slots = int(getattr(spec, "num_extra_query_per_req", 0))
            self._pause_supported = (
                (isinstance(spec, DFlashSpeculator) or standalone)
                and self._dp_size == 1 and self.cfg.saturation_patience > 0
            )
            self._timed = self._pause_supported and self._tp() is None
            if not self._pause_supported and self.cfg.saturation_patience > 0:
                logger.info("dspark: saturation can only trim (budget 0); skipping the draft pass needs a "
                            "DFlash-family or draft_model speculator and data_parallel_size 1")
            # Compile the allocation kernel for every batch-size bucket now, not during serving.
            warm_up_allocate(self.num_speculative_steps, self.req_states.max_num_reqs, self.req_states.device,
                             drafts_dtype=self._sched_gpu.dtype)
            self._set_up_upkeep(spec, standalone)
            hooked = getattr(spec, SPECULATOR_MANAGER_ATTR, None) is not None
            setattr(spec, SPECULATOR_MANAGER_ATTR, self)
            if not hooked:
                install_speculator_hooks(spec, calibrate=not self._identity_t, skip_decode=standalone)
            if self.settings.record_traces is not None:
                tp = self._tp()
                if tp is None or tp.rank_in_group == 0:
                    path = traces_path(self.settings.record_traces, self._dp_rank, self._dp_size)
                    self._traces = _TraceStager(path, self.req_states.max_num_reqs, self.num_speculative_steps,
                                                self.req_states.device)
                    logger.info("dspark: recording verification traces to %s", path)

        def _set_up_upkeep(self, spec: Any, standalone: bool) -> None:
            """StandaloneAR with compacted paused steps (varlen, or mask with ``mask_paused_compact``): defer the
            draft's K/V writes while paused (``engines.vllm.upkeep``).

            Uniform mask mode keeps the draft current: where vLLM's async scheduler keeps its placeholder drafts,
            no paused step there is a pure decode step (with ``plain_paused_steps`` the steps after a pause are,
            but they then match none of uniform mask's 1 + K decode graphs and run piecewise or eagerly: the
            fallback a backend without varlen graph replay gets, not measured yet). The budget leaves room for
            each request's query token and the prefill kernel's correction slot within the token budget, where
            the draft's compile range ends (``upkeep.catchup_budget``). Not with a
            sliding-window draft: a catch-up writes through the block table below the window, whose blocks may
            already be another request's.
            """
            wanted = self.settings.draft_catchup_tokens
            if not (standalone and self._pause_supported and self.compact_paused and wanted > 0):
                return
            if int(getattr(spec, "dcp_size", 1)) > 1:
                logger.info("dspark: decode context parallelism: the draft's K/V is kept current while paused")
                return
            draft_config = getattr(getattr(self.vllm_config, "speculative_config", None), "draft_model_config", None)
            window = draft_config.get_sliding_window() if draft_config is not None else None
            if window:
                # A catch-up writes up to its budget of positions behind each query, through the block table;
                # below a sliding window those blocks may have been freed and handed to another request.
                logger.info("dspark: the draft attends over a sliding window of %d tokens: its K/V is kept current "
                            "while paused", window)
                return
            budget = catchup_budget(wanted, int(spec.max_num_tokens), int(spec.max_num_reqs))
            if budget < int(spec.max_num_reqs):
                logger.info("dspark: max_num_batched_tokens %d leaves no catch-up budget over %d requests: the "
                            "draft's K/V is kept current while paused", spec.max_num_tokens, spec.max_num_reqs)
                return
            defer = self.settings.draft_defer_prompts
            if defer and getattr(self.vllm_config.cache_config, "enable_prefix_caching", True):
                # a deferred prompt's blocks could serve another request's prefix before they are written
                logger.info("dspark: prefix caching is on, so prompt chunks keep their draft pass while paused "
                            "(draft_defer_prompts needs --no-enable-prefix-caching)")
                defer = False
            self._upkeep = DraftUpkeep(self.req_states.max_num_reqs, budget, defer_prompts=defer)
            self._catchup_buffers = CatchupBuffers.allocate(budget + int(spec.max_num_tokens),
                                                            self.req_states.max_num_reqs, self.req_states.device)
            logger.info("dspark: while paused, the draft skips its K/V pass%s and catches up every %d pending "
                        "tokens or on resume", " (prompt chunks too)" if defer else "", budget)

        def set_placeholder_dropper(self, drop: Callable[[], bool]) -> None:
            """``plain_paused_steps``: ``drop()`` empties the placeholder drafts of the step being sampled, in
            vLLM's scheduler (the plugin publishes them). Used only where the pause itself is."""
            self._drop_placeholders = drop

        def begin_drafting_step(self, runner: Any) -> None:
            """Before ``sample_tokens``: decide whether this step's propose drafts (saturation policy).

            Runs after this step's budget decision (``get_num_tokens`` in ``execute_model``), so a probe's
            outcome is observed before the next decision. A paused step rewrites the runner's pending
            ``num_spec_tokens_to_schedule`` to 0 -- the path vLLM takes for a step that needs no drafts -- and,
            with ``plain_paused_steps``, empties the placeholder drafts the scheduler reserved for the step after
            it, which vLLM then schedules and runs as plain decoding (no verification layout, no rejection
            sampling, nothing for our budget hooks to do). So a batch may come with no drafts at all and never
            reach ``get_num_tokens``: the outcome of the last verification is judged here too.
            """
            state = getattr(runner, "execute_model_state", None)
            if state is None:
                return
            self._judge_last_outcome()
            scheduled = int(state.num_spec_tokens_to_schedule)
            drafting = scheduled > 0
            mark = None
            if self._timed:
                heavy = prompt_heavy(state.input_batch)
                mark = self._intervals.clock.mark()
                self._time_last_step(state.input_batch, heavy, mark)
            if drafting and self._pause_supported:
                drafting = self.timer.begin_step(state.input_batch.num_reqs)
                if not drafting:
                    # A plain sample while drafting is on skips one draft pass: the confidences before it are a
                    # step older, not a pause's, and the next budget keeps them (as the embedded engine does).
                    if not self.saturation.drafting_enabled:
                        self._paused_since_record = True
                    runner.execute_model_state = state._replace(num_spec_tokens_to_schedule=0)
                    if self._drop_placeholders is not None and self._drop_placeholders():
                        self._plain_after_pause += 1
                self._decisions[drafting] += 1
                if self._timed:
                    self._last_begin = _Begun(mark, drafting, int(state.input_batch.num_reqs), self._catchups_paid(),
                                              heavy, self.saturation.step_charge)
                    self._maybe_report(self._clock())
            else:
                self._last_begin = None  # vLLM scheduled no drafts: the next interval is no step of ours
            self._drafts_real = drafting
            batch = state.input_batch
            self._slot_real[np.asarray(batch.idx_mapping_np[: int(batch.num_reqs)])] = drafting

        def _maybe_report(self, now: float) -> None:
            """Log what the saturation policy did and why, every ``REPORT_EVERY_S`` of serving."""
            if self._next_report is None:
                self._next_report = now + self._report_every
                return
            if now < self._next_report:
                return
            self._next_report = now + self._report_every
            c = self.saturation.counters
            probes = ", ".join(f"{t} {v} {n}" for (t, v), n in c.probes.items() if n)
            times = self.timer.step_times

            def by_load(values: dict[int, float]) -> str:
                return ", ".join(f"{StepTimeCalibration.bucket_label(b)}: {q:.2f}" for b, q in values.items())

            quotients = by_load(times.quotients())
            # A load with paused steps timed but no drafting is judged by those (its probes' cost scale); a load
            # with neither borrows: section 27 had to infer which one each probe at 256 requests was.
            plain = by_load(times.ratios(False))
            pre = self._prefill_times
            prefills = (f"drafting [{by_load(pre.ratios(True))}], paused [{by_load(pre.ratios(False))}]"
                        if pre.num_samples[True] or pre.num_samples[False] else "none timed")
            u = self._upkeep
            upkeep = ("kept current" if u is None else
                      f"skipped on {u.skipped_steps} steps, {u.catchups} catch-ups of {u.caught_up_tokens} tokens"
                      + (f" ({u.deferred_prompt_tokens} of prompts deferred)" if u.defer_prompts else "")
                      + (f", {u.truncated} truncated" if u.truncated else ""))
            last = "none" if c.last_probe is None else c.last_probe.describe()
            sustained = self.saturation.sustained_gain
            logger.info("dspark: saturation: drafting %d / paused %d decisions (%d left the next step plain); "
                        "pauses %d, resumes %d, probes [%s], %d scouts; sustained gain %s (%d steps short of the "
                        "sustain margin); "
                        "due probes held %d steps by the probe tax, %d to time their load, %d while the load "
                        "climbed; last probe: %s; drafting/paused step time over priced, by load [%s]; draft K/V "
                        "while paused: %s; paused step time over priced, by load [%s]; prefill steps, time over "
                        "priced, by load: %s; outcome waits %d, %.1f ms", self._decisions[True],
                        self._decisions[False], self._plain_after_pause, c.pauses, c.resumes, probes or "none", c.scout_steps,
                        "n/a" if sustained is None else f"{sustained:.2f}x", c.unsustained_steps, c.deferred_probe_steps,
                        c.unmeasured_probe_steps, c.rising_probe_steps, last, quotients or "not measured yet", upkeep,
                        plain or "not measured yet", prefills, self._outcome_waits, self._outcome_wait_ms)

        def _time_last_step(self, batch: Any, heavy: bool, mark: Any) -> None:
            """Close the interval since the last drafting decision (at ``mark``), charged to that decision, and
            record every closed interval whose time is known by now (on CUDA a step or two later: step_clock).

            Between two calls the runner samples, proposes by the last decision (the draft pass, or a
            paused step's prefill pass only) and runs the target over the batch that decision shaped (a
            paused decision's batch verifies none of its placeholder drafts), so the interval is that
            decision's step. It is priced by the budget decision of the batch now running when the last
            decision drafted, else as plain decoding of that batch's non-draft tokens. On CUDA the interval is read
            between two events in the GPU's stream order, which is what makes it that decision's work: the host's
            clock, under vLLM's asynchronous scheduling, read the decision before it. Skipped: a drafting
            interval whose batch got no budget decision (vLLM scheduled it no drafts). An interval past
            ``STEP_TIME_CLAMP`` times its price (a long catch-up, a stall, or the server idling between requests:
            the last step's interval stays open until the next) is no measure of a step and stays out of the
            calibration; the probe tax still counts it, at most ``PROBE_TAX_CLAMP`` times its price.

            An interval in which the paused draft caught up (the probe that resumes drafting, a paused step
            before a prompt chunk, or one past the pending budget) still counts for the probe tax, but not for
            what a drafting step costs against a paused one: its catch-up pass writes the K/V of every step
            of the pause, and charged to one step it made a lone probe at high load -- a probe there is one
            step -- look as dear as drafting plus a prefill of up to ``draft_catchup_tokens`` tokens
            (docs/PERFORMANCE.md section 16: both rise probes at 256 requests failed).

            So does an interval whose batches were prefill steps (``heavy``, the caller's ``prompt_heavy`` of
            the interval's own batch, or the one before, whose draft pass it ran); those are timed apart, for the
            log. Under full decode-only CUDA graphs such a step runs the target eagerly, and a paused one still
            runs the draft's prefill over the chunk. Timed as a paused step, a wave's first step can set the
            quotient a probe is judged by: a stale plain window restarts with it, and the probe due at the new
            load fires on it. Most likely that is how a rise probe at 16 requests paid on the H200 at a cost
            scale of 0.83, where drafting there costs ~1.7x (docs/PERFORMANCE.md section 26). A step that admits
            a request or two among many decode rows still counts: at high load nearly every step does (section
            27).
            """
            last, self._last_begin = self._last_begin, None
            decision, self._step_decision = self._step_decision, None
            if last is not None and self.curve is not None:
                if last.drafted:
                    priced = 0.0 if decision is None else decision.step_ms
                else:
                    tokens = int(batch.num_tokens) - int(batch.num_draft_tokens or 0)
                    priced = float(self.curve.step_cost_ms(batch.num_reqs, max(tokens, batch.num_reqs),
                                                           drafting=False))
                if priced > 0:
                    self._intervals.close(last.mark, mark, _StepRecord(
                        last.drafted, last.num_reqs, priced, decode=not (last.heavy or heavy),
                        calibrate=self._catchups_paid() == last.catchups, charge=last.charge))
            for measured, step in self._intervals.finished():
                # Over STEP_TIME_CLAMP x its price a time measures a stall or a long catch-up, not what drafting
                # costs against a paused step; but a catch-up was spent (a probe at 256 requests that catches the
                # draft up over a long pause runs ~4.4x its price: section 36), so the probe tax counts it, up to
                # PROBE_TAX_CLAMP x its price (StepTimer.record): an interval the server idled through (a minute
                # after a probe step, as a batch emptied) would have been a debt held for ~100k paused steps.
                timed = measured <= STEP_TIME_CLAMP * step.priced_ms
                self.timer.record(step.drafted, step.num_reqs, measured, step.priced_ms,
                                  calibrate=timed and step.decode and step.calibrate, charge=step.charge)
                if timed and not step.decode:
                    self._prefill_times.record(step.drafted, step.num_reqs, measured, step.priced_ms)

        def _catchups_paid(self) -> int:
            return 0 if self._upkeep is None else self._upkeep.catchups

        def calibrate_in_graph(self, conf: torch.Tensor) -> torch.Tensor:
            """The draft model's confidences -> STS-calibrated, inside the captured draft graph.

            The raw values are kept (for online STS and traces); the temperatures are read from the one
            persistent buffers (and shifts) that online STS updates in place, so replays see every refit.
            """
            k = self.num_speculative_steps
            flat = conf.reshape(-1, k)
            self._raw_batch[: flat.shape[0]].copy_(flat)
            self._in_graph_sts = True
            return apply_temperatures(flat, self.temperatures, self.offsets).to(conf.dtype).reshape(conf.shape)

        def verified_rejections(self, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> torch.Tensor:
            """``num_rejected`` as upstream's acceptance estimator must see it: censored by what was verified.

            The estimator labels positions below ``accepted + rejected``. In varlen the runner counts rejections
            over the compacted logits, so pruned drafts are already left out; in mask mode the logits stay
            uniform and a pruned draft reads as a rejection, which would teach the estimator that what we
            did not verify was wrong -- and lower the confidences that decide what gets verified next.
            """
            pending = self._verify_pending
            if self.mode != "mask" or pending is None:
                return num_rejected
            r = pending[1]
            caps = self._batch_draft_capacity[:r].to(num_rejected.dtype)
            accepted = (num_sampled[:r] - self.num_bonus_tokens).clamp_min(0).to(num_rejected.dtype)
            out = num_rejected.clone()
            out[:r] = torch.minimum(num_rejected[:r], (caps - accepted).clamp_min(0))
            return out

        def _judge_last_outcome(self, wait: bool = True) -> None:
            """Hand the saturation policy the outcome copied a step ago. Its event was recorded after that step's
            rejection sampling. Preparing the next batch (``wait=False``) the host may get there before the GPU
            and leaves the outcome for the drafting decision, which runs once that batch's forward is launched
            and waits if it must (timed into ``_outcome_wait_ms``)."""
            if self._outcome_pending is None:
                return
            if not wait and self._outcome_event is not None and not self._outcome_event.query():
                return
            pending, self._outcome_pending = self._outcome_pending, None
            decision, r, serial = pending
            if self.saturation.probing and serial != self.saturation.probe_serial:
                # Planned before the probe in progress began: the batch verified drafts of an earlier decision
                # (drafting still on, or the last probe's), so it is no evidence for this probe, whose own first
                # batch (a scout's, with probe_scout) is yet to come. Judged as its step, it gave a probe begun
                # right after a drafting batch its verdict, and the scout came after it.
                return
            if self._outcome_event is not None:
                if not self._outcome_event.query():
                    t0 = time.perf_counter()
                    self._outcome_event.synchronize()
                    self._outcome_waits += 1
                    self._outcome_wait_ms += (time.perf_counter() - t0) * 1e3
            seen = self.saturation.counters.last_probe
            self.saturation.observe_outcome(decision, int(self._outcome_host.item()), r,
                                            self.timer.cost_scale(r, decision))
            probe = self.saturation.counters.last_probe
            if probe is not seen and probe is not None:
                # Every verdict, as it is judged: a short cell at high load can end before the periodic line,
                # and its probes were what a sitting needed to see (docs/PERFORMANCE.md section 25).
                logger.info("dspark: saturation: %s; probe allowance %.0f ms", probe.describe(),
                            self.saturation.probe_allowance_ms)

        def observe(self, num_sampled: torch.Tensor) -> None:
            """Outcomes of this step's verification (device), before propose overwrites the drafts."""
            pending, self._verify_pending = self._verify_pending, None
            if pending is None:
                return
            req_ids, r, idx_mapping, real = pending
            if not real:
                return  # placeholders of a paused step: nothing was drafted, nothing to learn
            decision, self._outcome_decision = self._outcome_decision, None
            if decision is not None:
                self._judge_last_outcome()  # one buffer: an outcome not judged yet is judged before it is reused
                self._outcome_host.copy_(num_sampled[:r].sum(), non_blocking=True)
                if self._outcome_event is not None:
                    self._outcome_event.record()
                self._outcome_pending = decision
            caps = self._batch_draft_capacity[:r]
            accepted = torch.minimum((num_sampled[:r] - self.num_bonus_tokens).clamp_min(0), caps)
            valid = self._sched_gpu[:r] > 0
            raw = self._raw_slots[idx_mapping]
            if self.online_sts is not None:
                self.online_sts.record(raw, caps, accepted, valid)
                if self.online_sts.step():
                    tp = self._tp()
                    if tp is not None:
                        tp.broadcast(self.temperatures, src=0)  # in place: graphs keep reading this buffer
                        tp.broadcast(self.offsets, src=0)
            if self._traces is not None:
                slots = np.asarray([self.req_states.req_id_to_index[x] for x in req_ids], dtype=np.int64)
                steps = self._steps[slots].copy()
                self._steps[slots] += 1
                # caps is a view of the persistent capacity buffer, which the next step's reallocate_drafts
                # rewrites on the compute stream with nothing ordering it after the side stream's copy: staged
                # as is, a row could record the next step's verified count. A copy belongs to this step.
                self._traces.stage(raw, caps.to(torch.int32, copy=True), accepted.to(torch.int32), valid, req_ids,
                                   steps)

    return DsparkVerificationManager
