"""LLMEngine: the continuous-batching speculative-decoding loop, every verification decision via the core.

One ``step()`` is either a prefill of newly admitted requests or one speculative decode step of every
running request::

    draft (skipped when K == 0 or the saturation policy paused drafting)
      -> STS temperatures applied to the raw confidences
      -> CapacityManager.record_confidences / plan (host, stale) / allocate (device, fresh; skipped where
         the plan verifies every draft, which are then admitted as in capacity none)
      -> verify layout (varlen: compacted, padded to a captured size; mask: uniform, pruned = padding;
         none: every draft admitted)
      -> target forward -> core.rejection.rejection_sample
      -> append accepted + bonus tokens (max_tokens, EOS, stop ids: emission truncated at the stop)
      -> OnlineSTS.record (verified = admitted) -> traces (raw confidences) -> stats

Losslessness does not depend on the capacity decision: pruned drafts are never accepted, every request
emits exactly one token from the target's own distribution after its accepted prefix, so greedy output
is the same token sequence in every mode and with no speculation at all. The one exception is the synthetic
drafter (``--draft synthetic:...``, synthetic.py), a speed-study mode whose acceptance is drawn, not verified.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dspark_cli.core.capacity import CapacityManager, warm_up_allocate
from dspark_cli.core.layout import (
    PlainLayouts,
    VerifyLayout,
    build_mask_layout,
    build_varlen_layout,
    warm_up_varlen_layout,
)
from dspark_cli.core.rejection import rejection_sample, sample, warm_up_rejection_sample
from dspark_cli.core.saturation import ProbeVerdict, SaturationCounters, StepCharge
from dspark_cli.core.sps import SpsCurve
from dspark_cli.core.sts import OnlineSTS, apply_temperatures, load_sts
from dspark_cli.core.traces import TraceWriter
from dspark_cli.engines.embedded.block_manager import BlockManager
from dspark_cli.engines.embedded.config import PHASE_TIMINGS, EngineConfig, resolve_device, resolve_dtype
from dspark_cli.engines.embedded.model import read_llama_args
from dspark_cli.engines.embedded.model_runner import ModelRunner
from dspark_cli.engines.embedded.scheduler import Scheduler
from dspark_cli.engines.embedded.seeded import counter_uniforms
from dspark_cli.engines.embedded.sequence import SamplingParams, Sequence
from dspark_cli.engines.embedded.stalls import StallCounters, StallWatch
from dspark_cli.engines.embedded.synthetic import expected_accepted, synthetic_rejection_sample
from dspark_cli.errors import DsparkError

__all__ = ["EngineStats", "LLMEngine", "RequestOutput", "resolve_checkpoints"]

log = logging.getLogger("dspark.embedded")


@dataclass(frozen=True)
class PendingStepTime:
    """A decode step's wall time on its way to the capacity manager (``CapacityManager.record_step_time``'s
    arguments), reported by the next step (``LLMEngine._report_step_time``)."""

    drafting: bool
    num_reqs: int
    measured_ms: float
    priced_ms: float | None  # a drafting step's: what its plan priced it at; None: the curve's plain price
    calibrate: bool  # False: the step did work that is not what drafting costs (a deferred catch-up)
    charge: StepCharge  # what the step was to the probe tax as it began


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"


# Step kinds: a prompt prefill; a prefill that also decodes one token for every running request (mixed); a
# drafting decode step; one probing a saturation pause; a decode step with drafting paused; a decode step of
# an engine without speculation.
STEP_KINDS: tuple[str, ...] = ("prefill", "mixed", "spec", "probe", "paused", "nospec")


@dataclass
class EngineStats:
    """Cumulative counters with vLLM's spec-decode metric semantics.

    A *draft* is one request-step that drafted and verified; ``num_draft_tokens`` counts the K drafts
    proposed per such request-step (scheduled, so capacity-pruned drafts count as rejected, exactly as
    vLLM's adaptive verification reports them); ``accepted_per_pos[i]`` counts acceptances at position i.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_preemptions: int = 0
    num_kv_wait_steps: int = 0  # Scheduler.kv_wait_steps: a free slot, but not the KV blocks to start a request
    num_verified_draft_tokens: int = 0  # drafts the capacity manager admitted to verification
    num_paused_steps: int = 0  # decode steps that skipped drafting (saturation policy)
    last_budget: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    # The steps' peak working memory on CUDA: what the allocator handed out beyond the weights and the KV pool
    # (graph pools included), against ModelRunner.step_reserve; read every PEAK_MEMORY_EVERY steps.
    step_memory_peak_bytes: int = 0
    # Per-phase wall time (ms, cumulative) keyed "<step kind>.<phase>", and steps per kind; filled only while
    # ``LLMEngine.phase_timing`` is set (see there). Kinds: prefill, spec (drafting decode), probe (a drafting
    # step probing a saturation pause), paused (K > 0 without drafting: saturation), nospec (K == 0).
    phase_ms: dict[str, float] = field(default_factory=dict)
    phase_steps: dict[str, int] = field(default_factory=dict)
    # Kernel compiles (start-up / serving) and full garbage collections, counted by the engine's StallWatch.
    stalls: StallCounters = field(default_factory=StallCounters)
    # The saturation policy's evidence (capacity modes): measured drafting over plain cost relative to the
    # curve per load bucket (StepTimeCalibration.quotients) and the windowed realized gain over plain decoding.
    drafting_cost_scale: dict[int, float] = field(default_factory=dict)
    realized_gain: float | None = None
    sustained_gain: float | None = None
    # What the saturation policy did (pauses, resumes, probes by trigger and verdict): the policy's own record.
    saturation: SaturationCounters | None = None
    # Every step's wall time (ms, cumulative) and count by kind (STEP_KINDS), always on: what a step of each
    # kind costs inside a server, where a client's inter-token latency also holds streaming and queueing.
    step_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))


class _PhaseClock:
    """Accumulates the time between ``mark`` calls into ``EngineStats.phase_ms``.

    Mode "host" (``sync_device`` None) measures host time only: device work overlaps and shows up where the
    host waits for it (the step's one device -> host copy, phase "sync"), which is what tells host-bound
    from device-bound steps. Mode "device" synchronises at every mark so each phase owns its device time
    too -- it serialises host and device, so the total is slower than a real step. Mode "gpu"
    (``events``) records a CUDA event at every mark and adds no sync: each phase gets its span of the
    device's timeline, which is its kernels' time where the device is behind the host and the host's time
    where the device waits for it -- what the phase adds to a real step. The spans are read at the step's
    last mark ("emit", after the step's one sync).
    """

    def __init__(self, stats: EngineStats, kind: str, sync_device: torch.device | None,
                 events: bool = False) -> None:
        self.stats = stats
        self.kind = kind
        self.sync_device = sync_device
        stats.phase_steps[kind] = stats.phase_steps.get(kind, 0) + 1
        self._t = time.perf_counter()
        self._events: list[tuple[str, torch.cuda.Event]] | None = None
        if events:
            first = torch.cuda.Event(enable_timing=True)
            first.record()
            self._events = [("", first)]

    def mark(self, phase: str) -> None:
        if self._events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append((phase, event))
            if phase == "emit":
                event.synchronize()
                for (_, prev), (name, ev) in zip(self._events, self._events[1:], strict=False):
                    key = f"{self.kind}.{name}"
                    self.stats.phase_ms[key] = self.stats.phase_ms.get(key, 0.0) + prev.elapsed_time(ev)
                self._events = [("", event)]
            return
        if self.sync_device is not None:
            torch.cuda.synchronize(self.sync_device)
        now = time.perf_counter()
        key = f"{self.kind}.{phase}"
        self.stats.phase_ms[key] = self.stats.phase_ms.get(key, 0.0) + (now - self._t) * 1000.0
        self._t = now


class _NoClock:
    def mark(self, phase: str) -> None:
        pass


_NO_CLOCK = _NoClock()
PEAK_MEMORY_EVERY = 64  # steps between reads of the allocator's peak (EngineStats.step_memory_peak_bytes)
# Paused steps between refreshes of the drafting cost-scale gauge (EngineStats.drafting_cost_scale; drafting steps
# refresh it each): computing it took ~15% of a paused step's bookkeeping, a cost no-speculation steps do not pay.
COST_SCALE_GAUGE_EVERY = 64


@dataclass
class _Checkpoints:
    target: Path
    draft: Path | None
    tokenizer: Path
    name: str


def resolve_checkpoints(config: EngineConfig) -> _Checkpoints:
    """Model/draft names -> checkpoint directories through ``assets.resolve_model`` (aliases, conversion of
    the default model, packaged drafts). Without speculation no draft is resolved at all; a synthetic draft
    resolves to the real draft model it runs for its cost."""
    from dspark_cli.engines.embedded.assets import resolve_model

    draft = None if config.num_speculative_tokens == 0 else config.draft
    synthetic = config.synthetic
    if draft is not None and synthetic is not None:
        draft = synthetic.draft
    paths = resolve_model(config.model, draft=draft)
    return _Checkpoints(target=Path(paths.target), draft=paths.draft and Path(paths.draft),
                        tokenizer=Path(paths.tokenizer), name=paths.name)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        # Installed before anything compiles or captures, so start-up compiles are told from serving ones;
        # the finalizer unhooks an engine that is dropped without close().
        self.stalls = StallWatch().install()
        weakref.finalize(self, self.stalls.close)
        # Curve problems are found before any weights are read: they are the likeliest user error.
        wants_capacity = config.num_speculative_tokens > 0 and config.draft is not None and config.capacity.mode != "none"
        file_curve = self._check_curve() if wants_capacity else None
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        ckpt = resolve_checkpoints(config)
        self.model_name = ckpt.name
        self.tokenizer = _load_tokenizer(ckpt.tokenizer)
        self.runner = ModelRunner(config, ckpt.target, ckpt.draft, self.device, self.dtype)
        self.num_spec = self.runner.num_spec
        synthetic = config.synthetic
        if synthetic is not None and self.num_spec > 0:
            log.warning(
                "synthetic drafter (%s): acceptance is drawn, not verified against the target, so outputs are "
                "NOT the target's distribution -- a speed-study mode, never for real outputs; expected accepted "
                "drafts per step with all %d verified: %.3f", synthetic.describe(self.num_spec), self.num_spec,
                float(expected_accepted(synthetic, self.num_spec)[-1]),
            )
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = _eos_ids(self.tokenizer, read_llama_args(ckpt.target).eos_token_ids)

        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.batched_token_limit, lookahead=self.num_spec
        )
        # Every block is free before the first request: /metrics read a full KV cache until one arrived.
        self.stats = EngineStats(accepted_per_pos=[0] * self.num_spec, kv_blocks_total=self.block_manager.num_usable_blocks,
                                 kv_blocks_free=self.block_manager.num_free_blocks, stalls=self.stalls.counters)
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = 0
        self._prefill_ms: deque[float] = deque(maxlen=8)  # recent prefill step times (the scheduler's delay)
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        # Breakdown of each step into phases (EngineStats.phase_ms; EngineConfig.phase_timing says the modes).
        # An attribute as well, so a benchmark can switch it off for its warm-up and on for what it times.
        self.phase_timing: str | None = config.phase_timing
        self._full_cache: dict[int, Tensor] = {}
        self._plain_layouts = PlainLayouts(self.device)
        # A decode step's time, reported by the next step while its forward runs (_report_step_time).
        self._pending_step_time: PendingStepTime | None = None
        # Pinned host buffers and an event for a drafting step's one device -> host copy (_start_host_copy).
        self._host_buffers: dict[int, Tensor] = {}
        self._host_copy_event = torch.cuda.Event() if self.device.type == "cuda" else None
        # Plan the next step while the device verifies this one (CapacityManager.plan_ahead): on the CPU nothing
        # runs while the host plans, so a lookahead the next batch cannot use would only add its time.
        self.plan_ahead = self.device.type == "cuda"

        # Offline temperatures seed the online fit; either way one persistent device tensor holds them.
        self.online_sts: OnlineSTS | None = None
        self.sts_temperatures: Tensor | None = None
        if self.num_spec > 0:
            temps = load_sts(config.sts, self.num_spec) if config.sts else None
            if config.online_sts:
                self.online_sts = OnlineSTS(self.num_spec, self.device, initial_temperatures=temps)
                self.sts_temperatures = self.online_sts.temperatures
            elif temps is not None:
                self.sts_temperatures = torch.tensor(temps, dtype=torch.float32, device=self.device)

        self.traces: TraceWriter | None = TraceWriter(config.record_traces) if config.record_traces else None
        self.capacity: CapacityManager | None = None
        self.sps_curve: SpsCurve | None = None
        # pauses, resumes, the last judged probe: _log_saturation logs each change
        self._saturation_seen: tuple[int, int, ProbeVerdict | None] = (0, 0, None)
        # The draft is behind where the last drafting step was a sampled probe (others' drafts wait on a resume)
        # or a mixed step admitted prompts while drafting was paused: the next full drafting step's catch-up is not
        # what drafting costs (a mixed step's while drafting runs is: _mixed_step).
        self._draft_behind = False
        if self.num_spec > 0 and config.capacity.mode != "none":
            self.sps_curve = file_curve or self._profile_curve()
            self.capacity = CapacityManager(
                config.capacity, self.sps_curve, self.num_spec, config.max_num_seqs, self.device
            )
            self.stats.saturation = self.capacity.saturation.counters
            warm_up_allocate(self.num_spec, config.max_num_seqs, self.device)  # no compiles while serving
        if self.num_spec > 0 and config.synthetic is None and self.runner.capture_sizes:
            # Verify batches are padded to the captured sizes; admitted counts are int32 in every mode.
            warm_up_rejection_sample(self.num_spec, self.vocab_size, self.runner.capture_sizes, config.max_num_seqs,
                                     self.device, torch.int32)
        if self.num_spec > 0:
            warm_up_varlen_layout({self.num_spec}, self.device)  # drafting steps (plain ones use PlainLayouts)
        self.stalls.start_serving()

    # ------------------------------------------------------------------------------------------ setup

    def _check_curve(self) -> SpsCurve | None:
        """The curve file for mask/varlen (None = "auto": profiled once the models are loaded)."""
        cfg = self.config
        if cfg.sps_curve is None:
            raise DsparkError(
                f"capacity mode {cfg.capacity.mode!r} needs a step-cost curve: pass --sps-curve FILE "
                "(from `dspark profile-sps`) or --sps-curve auto"
            )
        if cfg.sps_curve == "auto":
            return None
        return SpsCurve.load(cfg.sps_curve)

    def _profile_curve(self) -> SpsCurve:
        from dspark_cli.engines.embedded.profile import profile_sps

        # a given overhead skips the overhead steps, and the curve says where its overhead came from
        curve = profile_sps(self, overhead_ms=self.config.sps_overhead_ms)
        log.info("profiled step-cost curve: verify %s ms, draft %s ms, overhead %.3f ms",
                 curve.verify_ms, curve.draft_ms, curve.overhead_ms)
        return curve

    # ------------------------------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if request_id in self._seqs:
            raise DsparkError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise DsparkError("the prompt is empty; send at least one token")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise DsparkError(
                f"prompt of {len(prompt_token_ids)} tokens leaves no room under max_model_len="
                f"{self.config.max_model_len}; shorten it or raise --max-model-len"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise DsparkError(f"prompt token ids must be in [0, {self.vocab_size})")
        seq = Sequence(request_id, list(prompt_token_ids), params, self._arrivals)
        self._arrivals += 1
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self._refresh_counts()

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self._finish(seq, "abort")
        self._refresh_counts()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------------------------------ step

    def _clock(self, kind: str) -> _PhaseClock | _NoClock:
        if self.phase_timing is None:
            return _NO_CLOCK
        if self.phase_timing not in PHASE_TIMINGS:
            raise DsparkError(f"phase_timing must be None or one of {', '.join(PHASE_TIMINGS)}, got {self.phase_timing!r}")
        cuda = self.device.type == "cuda"
        sync = self.device if self.phase_timing == "device" and cuda else None
        return _PhaseClock(self.stats, kind, sync, events=self.phase_timing == "gpu" and cuda)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule(mixed=self.config.mixed_prefill)
        if self.phase_timing is not None:
            self.stats.phase_ms["schedule"] = self.stats.phase_ms.get("schedule", 0.0) + (time.perf_counter() - t0) * 1e3
        self.stats.num_steps += 1
        if batch is None:
            return []
        for seq in batch.preempted:
            self._release_slot(seq)
            self.stats.num_preemptions += 1
        if not batch.seqs:
            self._refresh_counts()
            return []
        start = time.perf_counter()
        if batch.is_prefill and batch.decode:
            outputs = self._mixed_step(batch.seqs, batch.decode)
        elif batch.is_prefill:
            outputs = self._prefill_step(batch.seqs)
        else:
            outputs = self._decode_step(batch.seqs)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        kind = self.stalls.step_kind  # each step path names its kind
        self.stats.step_ms[kind] = self.stats.step_ms.get(kind, 0.0) + elapsed_ms
        self.stats.steps[kind] = self.stats.steps.get(kind, 0) + 1
        if batch.is_prefill:
            # What the next arrivals may wait to share a prefill step (scheduler.py): about one prefill's
            # time, the median of the last few, so one prefill that waited on a compile does not hold them long.
            self._prefill_ms.append(elapsed_ms)
            self.scheduler.prefill_delay_ms = self.config.scheduler_delay_factor * statistics.median(self._prefill_ms)
        if self.device.type == "cuda" and self.stats.num_steps % PEAK_MEMORY_EVERY == 1:
            # Here, once a step: _refresh_counts also runs per arriving request.
            self.stats.step_memory_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.runner.memory_with_pool
        self._refresh_counts()
        return outputs

    def _admit(self, seqs: list[Sequence], draft: bool) -> None:
        """Bookkeeping of prefilled newcomers: prompt counts, KV frontiers, capacity slots."""
        for seq in seqs:
            start = seq.num_computed_tokens
            if seq.num_preemptions == 0:
                self.stats.prompt_tokens += seq.num_prompt_tokens
            seq.num_computed_tokens = seq.num_tokens
            seq.num_draft_computed = seq.num_tokens if draft else start
            slot = self._free_slots.pop()
            self._slot_of[seq.request_id] = slot
            if self.capacity is not None:
                self.capacity.add_request(slot)

    def _prefill_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        self.stats.num_prefill_steps += 1
        self.stalls.step_kind = "prefill"
        clock = self._clock("prefill")
        # While drafting is paused the draft skips the prompt too: the next probe's catch-up feeds it with
        # the tokens generated since, and a request that finishes first never pays for it. A prefill step
        # then costs what it costs without speculation (on an H200 the draft's prefill added ~6 ms to ~20).
        draft = self.capacity is None or self.capacity.drafting_enabled
        logits = self.runner.prefill(seqs, draft=draft)
        clock.mark("forward")
        self._admit(seqs, draft)
        return self._sample_and_emit(seqs, logits, clock)

    def _sample_and_emit(self, seqs: list[Sequence], logits: Tensor, clock: _PhaseClock | _NoClock) -> list[RequestOutput]:
        """One token per sequence from its last-row ``logits`` (its own seeded stream at T > 0), emitted."""
        temperature, top_p = self._sampling_tensors(seqs)
        u = self._uniforms(seqs, 1)[:, 0] if temperature is not None else None
        sampled = sample(logits, temperature, top_p, u)
        self._report_step_time()
        tokens = sampled.tolist()
        clock.mark("sync")
        outputs = [self._emit(seq, [tok]) for seq, tok in zip(seqs, tokens, strict=True)]
        clock.mark("emit")
        return outputs

    def _mixed_step(self, new: list[Sequence], decoding: list[Sequence]) -> list[RequestOutput]:
        """Prefill ``new`` and decode one token for each of ``decoding`` in one target forward (plain steps).

        Why: a prefill step stalls every decoding request, and where steps are host-bound it costs about a
        decode step whatever its size (on an H200, SmolLM2-135M served at 128 requests: 7.9 ms against 8.5 ms
        for a decode step, docs/PERFORMANCE.md section 21). Closed-loop load makes many of them wherever
        requests finish apart -- after any drafting, whose accepted lengths differ per request, the successors
        of one wave arrive over many steps, each with its own prefill (mask + SPS at 128 requests ran 370
        prefill steps of a 1,024-request cell, no speculation 106). Riding along, the running requests lose
        no step to a prefill. A decoding request is a one-token prefill (its last token has no KV yet), so the
        ragged prefill forward takes both. The step itself never drafts, drafting on or not: a drafting step's
        draft and verify passes are shaped for decode rows (and the draft would need the newcomers' prompts);
        the next drafting step's catch-up feeds the draft what it missed here. It mixes while drafting too
        because that is where split refills come from: what it replaces is a prefill step that stalls every
        running request, and a drafting step follows either way (varlen + SPS + STS ran 79 prompt steps against
        no speculation's 39 at 64 requests on an H100, docs/PERFORMANCE.md section 42)."""
        self.stats.num_prefill_steps += 1
        self.stalls.step_kind = "mixed"
        clock = self._clock("mixed")
        seqs = decoding + new
        logits = self.runner.prefill(seqs, draft=False)  # target only: the draft catches up when it next drafts
        clock.mark("forward")
        self._admit(new, draft=False)
        for seq in decoding:
            seq.num_computed_tokens = seq.num_tokens
        # The next full drafting step feeds the draft these prompts. While drafting runs that catch-up is what
        # drafting costs -- a paused server never runs the draft over them, and in a closed loop every refill
        # after uneven progress brings one -- so that step is calibrated as any other: kept out, the catch-ups
        # (144 of 845 drafting steps at 64 requests on an H100, docs/PERFORMANCE.md section 48) made drafting look
        # cheaper than it was. While paused the probe that resumes pays it, and a probe's steps are kept out.
        paused = self.capacity is not None and not self.capacity.drafting_enabled
        self._draft_behind = self._draft_behind or (self.num_spec > 0 and paused)
        return self._sample_and_emit(seqs, logits, clock)

    def _decode_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        # The step's wall time (its one sync included) calibrates the curve's price of drafting against
        # plain decoding (core.saturation.StepTimeCalibration).
        start = time.perf_counter()
        self.stats.num_decode_steps += 1
        num_reqs = len(seqs)
        k = self.num_spec
        drafting = k > 0 and (self.capacity.begin_step(num_reqs) if self.capacity is not None else True)
        if k > 0 and not drafting:
            self.stats.num_paused_steps += 1
        probe = drafting and self.capacity is not None and self.capacity.probe_step
        self.stalls.step_kind = ("probe" if probe else "spec") if drafting else ("paused" if k > 0 else "nospec")
        if not drafting:
            outputs = self._plain_decode_step(seqs)
            if self.capacity is not None:
                # _plain_decode_step reported the step before this one; this one's goes out with the next
                self._pending_step_time = PendingStepTime(False, num_reqs, (time.perf_counter() - start) * 1e3,
                                                          None, True, self.capacity.saturation.step_charge)
                if self.stats.num_paused_steps % COST_SCALE_GAUGE_EVERY == 1:
                    self.stats.drafting_cost_scale = self.capacity.step_times.quotients()
                self._log_saturation(num_reqs)  # a pause begin_step made (back at a ceiling's load)
            return outputs
        # Probes get their own kind in phase timing: their catch-up over the pause is not a drafting step's cost.
        clock = self._clock(self.stalls.step_kind)
        runner = self.runner
        dev = self.device
        slots_np = np.fromiter((self._slot_of[s.request_id] for s in seqs), dtype=np.int64, count=num_reqs)
        tables, (start_pos, last_tokens, slots) = runner.decode_inputs(seqs, [slots_np])
        max_len = max(seq.num_tokens for seq in seqs)
        temperature, top_p = self._sampling_tensors(seqs)
        clock.mark("prepare")

        u_draft = self._uniforms(seqs, k) if temperature is not None else None
        # A sampled probe drafts for the requests its draft is least behind (CapacityManager.probe_sample_size).
        sample = self._probe_sample(seqs) if probe else None
        # The first full drafting step after a sampled probe catches the others up over the pause: the probe's
        # deferred cost, not what drafting costs (kept out of the step-time calibration).
        catching_up = sample is None and self._draft_behind
        self._draft_behind = sample is not None
        if sample is None:
            drafted, draft = seqs, runner.propose(seqs, tables, temperature, u_draft)
        else:
            sample_np, rows = sample
            drafted = [seqs[i] for i in sample_np.tolist()]
            draft = runner.propose(drafted, tables.index_select(0, rows),
                                   None if temperature is None else temperature.index_select(0, rows),
                                   None if u_draft is None else u_draft.index_select(0, rows))
        conf_raw = draft.confidence
        offsets = None if self.online_sts is None else self.online_sts.offsets
        conf = conf_raw if self.sts_temperatures is None else apply_temperatures(conf_raw, self.sts_temperatures, offsets)
        clock.mark("draft")
        if self.capacity is not None:
            sampling = temperature is not None
            if sample is None:
                self.capacity.record_confidences(slots, conf)
                drafts_np = np.full(num_reqs, k, dtype=np.int64)
                decision = self.capacity.plan(slots_np, drafts_np, num_reqs, num_reqs,
                                              defer_saturation=True, sampling=sampling)
                # A budget of every draft leaves the allocation nothing to choose: its launches (the fresh
                # survival's gather and product, the allocation kernel) are host time between the draft pass and
                # the verify forward, which at light loads the device may not hide (docs/PERFORMANCE.md section 46).
                admitted = (self._full_drafts(num_reqs) if decision.verifies_every_draft else self.capacity.allocate(
                    slots, torch.full((num_reqs,), k, dtype=torch.int64, device=dev), decision.budget))
            else:
                drafts_np = np.zeros(num_reqs, dtype=np.int64)
                drafts_np[sample_np] = k
                num_drafts = torch.zeros(num_reqs, dtype=torch.int64, device=dev).index_fill_(0, rows, k)
                self.capacity.record_confidences(slots.index_select(0, rows), conf)
                decision = self.capacity.plan(slots_np, drafts_np, num_reqs, num_reqs, defer_saturation=True,
                                              sampling=sampling, stands_for=num_reqs / len(sample_np))
                draft = draft.spread(rows, num_reqs)
                admitted = self.capacity.allocate(slots, num_drafts, decision.budget)
            budget = decision.budget
        else:
            budget = num_reqs * k
            admitted = self._full_drafts(num_reqs)
        self.stats.last_budget = budget
        clock.mark("plan")

        if self.config.capacity.mode == "mask":
            layout = build_mask_layout(last_tokens, draft.tokens, admitted, start_pos)
            layout = _pad_layout(layout, runner.padded_size(layout.num_rows))
        else:
            layout = build_varlen_layout(
                last_tokens, draft.tokens, admitted, start_pos, runner.padded_size(num_reqs + budget)
            )
        clock.mark("layout")
        logits = runner.verify(layout, tables, start_pos, max_len - 1 + k)
        clock.mark("verify")
        uniforms = None
        if temperature is not None:
            # One [K + 1, 2] table per request (its own stream when seeded), read by row position.
            table = self._uniforms(seqs, (k + 1) * 2).view(num_reqs, k + 1, 2)
            req = layout.req_index.clamp(max=num_reqs - 1)
            uniforms = table[req, layout.pos_in_req.clamp(max=k)]
        if draft.accept is not None:  # synthetic drafter: acceptance was drawn with the drafts
            out = synthetic_rejection_sample(
                logits, layout, draft.tokens, admitted, draft.accept, temperature, top_p, uniforms
            )
        else:
            out = rejection_sample(
                logits, layout, draft.tokens, admitted, temperature, top_p, draft.draft_probs, uniforms
            )
        # The step's one device -> host transfer: emitted tokens, accepted and admitted counts together. Issued
        # before the online STS fold, whose kernels then run while the host emits and prepares the next step.
        packed = torch.cat(
            [out.tokens, out.num_accepted.view(-1, 1).to(torch.int64), admitted.view(-1, 1).to(torch.int64)], dim=1
        )
        copied = self._start_host_copy(packed)
        if self.online_sts is not None:
            if sample is None:
                self.online_sts.record(conf_raw, admitted, out.num_accepted)
            else:  # what the sample drafted: conf_raw's rows
                self.online_sts.record(conf_raw, admitted[rows], out.num_accepted[rows])
            self.online_sts.step()
        clock.mark("reject")
        self._report_step_time()
        if self.plan_ahead and self.capacity is not None and sample is None:
            # The next step's plan, for this batch, while the device verifies (CapacityManager.plan_ahead).
            self.capacity.plan_ahead(slots_np, drafts_np, num_reqs, num_reqs, sampling=sampling)
            clock.mark("lookahead")
        host = self._finish_host_copy(copied)
        clock.mark("sync")
        accepted_np = host[:, k + 1]
        admitted_np = host[:, k + 2]
        # What the draft proposed for: every request, or a sampled probe's sample (the rest accepted nothing).
        drafted_acc, drafted_adm = ((accepted_np, admitted_np) if sample is None
                                    else (accepted_np[sample_np], admitted_np[sample_np]))
        if self.capacity is not None:
            # The saturation policy judges the step by what it produced (robust to a miscalibrated head).
            self.capacity.record_outcome(num_reqs + int(accepted_np.sum()))
            self._log_saturation(num_reqs)
        if self.traces is not None:
            self.traces.write_batch(
                conf_raw.cpu(), drafted_adm, drafted_acc,
                requests=[s.request_id for s in drafted], step=[s.num_verify_steps for s in drafted],
            )
        stats = self.stats
        stats.num_drafts += len(drafted)
        stats.num_draft_tokens += len(drafted) * k
        stats.num_verified_draft_tokens += int(drafted_adm.sum())
        stats.num_accepted_tokens += int(drafted_acc.sum())
        per_pos = np.bincount(drafted_acc, minlength=k + 1)  # requests that accepted exactly a drafts
        at_least = np.cumsum(per_pos[::-1])[::-1]  # at_least[i] = requests that accepted >= i drafts
        for i in range(k):
            stats.accepted_per_pos[i] += int(at_least[i + 1])

        outputs = []
        # A request a sampled probe left out fed its draft nothing: its frontier stays where it was.
        left_out = [] if sample is None else [
            (seqs[i], seqs[i].num_draft_computed) for i in np.setdiff1d(np.arange(num_reqs), sample_np).tolist()]
        for seq, row, a in zip(seqs, host[:, : k + 1].tolist(), accepted_np.tolist(), strict=True):
            old_len = seq.num_tokens
            seq.num_verify_steps += 1
            # Target KV is valid through the accepted drafts; the draft never fed its own K-th draft.
            seq.num_computed_tokens = old_len + a
            seq.num_draft_computed = old_len + min(a, k - 1)
            outputs.append(self._emit(seq, row[: a + 1]))
        for seq, frontier in left_out:
            seq.num_draft_computed = frontier
        clock.mark("emit")
        if self.capacity is not None:
            # Reported by the next step, as a paused step's is, at the price this step's plan put on it.
            self._pending_step_time = PendingStepTime(True, num_reqs, (time.perf_counter() - start) * 1e3,
                                                      decision.step_ms, not catching_up,
                                                      self.capacity.saturation.step_charge)
        return outputs

    def _report_step_time(self) -> None:
        """Report the last decode step's wall time to the capacity manager (step-time calibration, probe tax).

        Called by the next step once its forward is launched and before it waits for the device: the manager's
        bookkeeping then runs while the device works instead of between two steps, where the device has nothing
        queued. On an H100 (SmolLM2-135M, 16 requests) a paused step spent 0.036 ms more than a no-speculation step
        outside its phases, most of it in this report (docs/PERFORMANCE.md section 47); reported by the next step,
        0.018-0.021 ms (section 48). Drafting steps report the same way since section 48, where the scaled setup's
        spent 0.157 ms outside their phases against no capacity's 0.077, and so do the gauges read from the
        calibration after a drafting step's report. The report carries the charge the step began with and the
        price its plan put on it, as vLLM's late step times do, so a probe begun in between does not take it; the
        policy's next decision sees it one step late.
        """
        pending = self._pending_step_time
        if pending is None:
            return
        self._pending_step_time = None
        capacity = self.capacity
        assert capacity is not None
        capacity.record_step_time(pending.drafting, pending.num_reqs, pending.measured_ms, pending.priced_ms,
                                  calibrate=pending.calibrate, charge=pending.charge)
        if pending.drafting:
            self.stats.drafting_cost_scale = capacity.step_times.quotients()
            self.stats.realized_gain = capacity.realized_gain
            self.stats.sustained_gain = capacity.saturation.sustained_gain

    def _start_host_copy(self, packed: Tensor) -> Tensor:
        """Start copying a drafting step's ``packed`` outputs to the host (CUDA: into a pinned buffer, with an event
        behind it; on the CPU the tensor is already there). :meth:`_finish_host_copy` waits for it.

        Why not ``packed.cpu()`` where the step waits: that waits for everything queued before it, and the online
        STS fold (some thirty small kernels, and its periodic refit) follows the rejection sampler. Issued first,
        the copy waits only for the outputs, and the fold runs while the host emits the tokens and prepares the
        next step -- a window in which the device otherwise idles.
        """
        if self._host_copy_event is None:
            return packed
        rows, cols = packed.shape
        buf = self._host_buffers.get(cols)
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty((max(rows, self.config.max_num_seqs), cols), dtype=packed.dtype, pin_memory=True)
            self._host_buffers[cols] = buf
        view = buf[:rows]
        view.copy_(packed, non_blocking=True)
        self._host_copy_event.record()
        return view

    def _finish_host_copy(self, copied: Tensor) -> np.ndarray:
        """The outputs :meth:`_start_host_copy` began copying, once on the host; a copy of their own, since the pinned
        buffer is the next step's."""
        if self._host_copy_event is None:
            return copied.numpy()
        self._host_copy_event.synchronize()
        return copied.numpy().copy()

    def _log_saturation(self, num_reqs: int) -> None:
        """One log line per change of the saturation policy's state (a pause, a resume, a probe's verdict): a
        handful per minute of serving, and what a served matrix needs to tell a lucky probe's resume from a
        right one (a load-rise probe that paid let mask + SPS draft 128 losing steps at 128 requests on an
        H200, docs/PERFORMANCE.md section 22, and the counters alone could not say why)."""
        assert self.capacity is not None
        sat = self.capacity.saturation
        c = sat.counters
        pauses, resumes, probe = self._saturation_seen
        # Every step asks, so the check is two ints and an identity: a judged probe leaves a new last_probe.
        if c.pauses == pauses and c.resumes == resumes and c.last_probe is probe:
            return
        self._saturation_seen = (c.pauses, c.resumes, c.last_probe)
        gain, sustained = sat.realized_gain, sat.sustained_gain
        state = (f"at {num_reqs} requests, {self.stats.num_decode_steps} decode steps in; realized gain "
                 f"{'n/a' if gain is None else f'{gain:.2f}'}x plain decoding "
                 f"({'n/a' if sustained is None else f'{sustained:.2f}'}x sustained, "
                 f"{c.unsustained_steps} steps short of the sustain margin)")
        if c.last_probe is not probe and c.last_probe is not None:
            log.info("saturation: %s", c.last_probe.describe())
        if c.pauses != pauses:
            log.info("saturation: drafting paused %s; next timer probe in %d paused steps", state, sat.probe_wait)
        if c.resumes != resumes:
            log.info("saturation: drafting resumed %s", state)

    def _plain_decode_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """One token per request (K == 0, or drafting paused by the saturation policy).

        While paused the draft does not run at all: its frontier (``num_draft_computed``) stays where
        drafting stopped, and the next drafting step's catch-up pass feeds the gap in one batched pass.
        Why not keep it in sync one token per paused step: measured on an H200 (SmolLM2-135M shape, 4-layer
        draft) that feed cost 0.9-1.2 ms per step, 25-30% of a plain step at c=16-256, on every paused step,
        while the catch-up of G tokens per request is one pass per probe, whose cost the G paused steps share
        (probes back off exponentially while they keep failing). A paused step is now a no-speculation step.
        """
        num_reqs = len(seqs)
        paused = self.num_spec > 0
        clock = self._clock("paused" if paused else "nospec")
        runner = self.runner
        tables, (start_pos, last_tokens) = runner.decode_inputs(seqs)
        max_len = max(seq.num_tokens for seq in seqs)
        temperature, top_p = self._sampling_tensors(seqs)
        clock.mark("prepare")
        layout = self._plain_layouts.build(last_tokens, start_pos)
        clock.mark("layout")
        logits = runner.verify(layout, tables, start_pos, max_len - 1)
        clock.mark("verify")
        u = self._uniforms(seqs, 1)[:, 0] if temperature is not None else None
        sampled = sample(logits[:num_reqs], temperature, top_p, u)
        self._report_step_time()
        clock.mark("reject")
        tokens = sampled.tolist()
        clock.mark("sync")
        outputs = []
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.num_computed_tokens = seq.num_tokens
            outputs.append(self._emit(seq, [tok]))
        clock.mark("emit")
        return outputs

    def _probe_sample(self, seqs: list[Sequence]) -> tuple[np.ndarray, Tensor] | None:
        """A sampled probe's requests (CapacityManager.probe_sample_size): the ones the draft is least behind, as
        sorted batch indices on the host and the device; None where the probe drafts for every request."""
        assert self.capacity is not None
        num_reqs = len(seqs)
        size = self.capacity.probe_sample_size(num_reqs)
        if size >= num_reqs:
            return None
        behind = np.fromiter((s.num_tokens - s.num_draft_computed for s in seqs), dtype=np.int64, count=num_reqs)
        picked = np.sort(np.argsort(behind, kind="stable")[:size])
        return picked, self.runner._to_device(torch.from_numpy(picked))

    def _full_drafts(self, num_reqs: int) -> Tensor:
        """``[R]`` int32 (the allocation's dtype) filled with K (capacity "none": every draft admitted), cached
        per R: no launch per step, and the kernels see one argument dtype in every mode."""
        cached = self._full_cache.get(num_reqs)
        if cached is None:
            cached = torch.full((num_reqs,), self.num_spec, dtype=torch.int32, device=self.device)
            self._full_cache[num_reqs] = cached
        return cached

    # ------------------------------------------------------------------------------------------ helpers

    def _sampling_tensors(self, seqs: list[Sequence]) -> tuple[Tensor | None, Tensor | None]:
        """Per-request temperature/top-p on the device; None when no request needs them (host-known)."""
        temps = [s.params.temperature for s in seqs]
        top_ps = [s.params.top_p for s in seqs]
        temperature = None
        if any(t > 0 for t in temps):
            temperature = self.runner._to_device(torch.tensor(temps, dtype=torch.float32))
        top_p = None
        if temperature is not None and any(p < 1.0 for p in top_ps):
            top_p = self.runner._to_device(torch.tensor(top_ps, dtype=torch.float32))
        return temperature, top_p

    def _uniforms(self, seqs: list[Sequence], n: int) -> Tensor:
        """``[R, n]`` uniforms: the engine's generator, except seeded requests, which read their own stream.

        The seeded rows come from one vectorised counter-based pass (seeded.py) and one host-to-device copy,
        whatever the number of seeded requests: a generator per request cost two launches per request here.
        """
        u = torch.rand(len(seqs), n, device=self.device, generator=self.generator)
        rows = [i for i, seq in enumerate(seqs) if seq.params.seed is not None]
        if rows:
            packed = np.array([rows, [seqs[i].params.seed for i in rows], [seqs[i].rng_offset for i in rows]],
                              dtype=np.int64)
            idx, seeds, offsets = self.runner._to_device(torch.from_numpy(packed.reshape(-1))).view(3, -1)
            u.index_copy_(0, idx, counter_uniforms(seeds, offsets, n))
            for i in rows:
                seqs[i].rng_offset += n
        return u

    def _emit(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        """Append tokens until a stop condition; the stop token itself is emitted (as vLLM's token ids)."""
        params = seq.params
        emitted: list[int] = []
        reason: str | None = None
        for tok in new_tokens:
            seq.token_ids.append(tok)
            emitted.append(tok)
            if (not params.ignore_eos and tok in self.eos_token_ids) or tok in params.stop_token_ids:
                reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                reason = "length"
            if reason is not None:
                break
        self.stats.generation_tokens += len(emitted)
        if reason is not None:
            self._finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, emitted, reason is not None, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._release_slot(seq)
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1

    def _release_slot(self, seq: Sequence) -> None:
        slot = self._slot_of.pop(seq.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _refresh_counts(self) -> None:
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        self.stats.kv_blocks_free = self.block_manager.num_free_blocks
        self.stats.num_kv_wait_steps = self.scheduler.kv_wait_steps

    # ------------------------------------------------------------------------------------------ helpers for tests

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run prompts to completion; returns each prompt's generated token ids (in prompt order)."""
        if params is None:
            params = SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        base = self._arrivals
        ids = [f"gen-{base + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]

    def close(self) -> None:
        if self.traces is not None:
            self.traces.close()
            self.traces = None
        self.stalls.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pad_layout(layout: VerifyLayout, size: int) -> VerifyLayout:
    """Append tail padding rows (owned by "request R", like the varlen layout's tail) up to ``size``."""
    extra = size - layout.num_rows
    if extra <= 0:
        return layout
    dev = layout.input_ids.device
    zeros = torch.zeros(extra, dtype=torch.int64, device=dev)
    layout.input_ids = torch.cat([layout.input_ids, zeros])
    layout.positions = torch.cat([layout.positions, zeros])
    layout.req_index = torch.cat([layout.req_index, zeros + layout.num_reqs])
    layout.pos_in_req = torch.cat([layout.pos_in_req, zeros])
    layout.is_padding = torch.cat([layout.is_padding, torch.ones(extra, dtype=torch.bool, device=dev)])
    return layout


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise DsparkError(f"{path}: cannot load the tokenizer ({str(exc).splitlines()[0]})") from None


def _eos_ids(tokenizer: Any, config_eos: tuple[int, ...]) -> frozenset[int]:
    ids = set(config_eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return frozenset(ids)

