"""Prometheus text exposition of the embedded engine's counters, under vLLM's metric names.

`vllm bench serve`, Grafana dashboards built for vLLM and our own ``dspark bench`` scrape ``/metrics`` and
look for vLLM's names (``vllm:spec_decode_num_drafts_total`` ...). Emitting exactly those names, label
keys (``model_name``, ``position``, ``finished_reason``) and sample suffixes lets every one of them read the
embedded engine as if it were a vLLM server, so a benchmark can compare the two engines without a second
parser. The format is the classic text format 0.0.4 as ``prometheus_client`` writes it (counters carry the
``_total`` suffix in ``# HELP``/``# TYPE`` too); writing it by hand avoids a dependency for a few dozen series.

The per-request histograms (time to first token, inter-token latency, end-to-end latency, tokens per request)
are measured by the HTTP server, not the engine: :class:`RequestMetrics` holds them as fixed bucket counters
with vLLM 0.33's names, labels and default bucket boundaries, so ``histogram_quantile`` panels built for vLLM
read them unchanged.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dspark_cli.core.saturation import StepTimeCalibration

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM always exports these finish reasons (zero until they happen) so that rate() works from the start.
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM 0.33's default bucket boundaries (vllm/v1/metrics/buckets.py): quantiles interpolated within the same
# buckets are what make a dashboard's numbers for the two engines comparable.
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0)

# vLLM labels its engine-level series with the data-parallel engine's index as well; this server runs one.
ENGINE_INDEX = "0"


def request_token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: the 1-2-5 series (1, 2, 5, 10, 20, 50, ...) up to ``max_model_len``."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            bound = mantissa * scale
            if bound > max_model_len:
                return tuple(bounds)
            bounds.append(float(bound))
        scale *= 10


@dataclass
class Histogram:
    """One Prometheus histogram's state: a count per bucket (not cumulative; the last is above every bound)
    and the sum of the observations. Fixed size, so observing never allocates."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (Prometheus' ``le`` is <=).
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(slots=True)
class RequestTimes:
    """What the server remembers of one request in flight (monotonic seconds)."""

    arrival: float
    prompt_tokens: int
    first_output: float | None = None
    last_output: float = 0.0


class RequestMetrics:
    """vLLM's per-request histograms, observed where the server sees a request, on its event loop only.

    Semantics follow vLLM 0.33's ``IterationStats`` / ``FinishedRequestStats``:

    * time to first token: from arrival (the request parsed and tokenized, as vLLM's ``arrival_time``) to the
      arrival of its first engine output;
    * inter-token latency: one observation per later engine output -- per step, however many tokens a
      speculative step carried -- the time since the request's previous output;
    * at a finish with a reason (stop, length, a stop string): end-to-end latency, prompt and generation tokens,
      and time per output token, ``(last output - first output) / (generation tokens - 1)`` (0 for one token).
      A request the client abandons or that an engine failure ends gets none of these, as in vLLM (whose
      ``abort_requests`` records no finished-request stats); its first-token and inter-token observations
      stay, as vLLM's do.

    The token-count buckets depend on ``max_model_len``, known once the engine has loaded (``bind``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.time_to_first_token = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens: Histogram | None = None
        self.generation_tokens: Histogram | None = None
        self._live: dict[str, RequestTimes] = {}
        # vllm:request_success_total, by the reason the client was told, counted once a request finishes with
        # one. Counted from the engine's finishes, a stop string that completed in the output that also hit
        # max_tokens was first exported as "length", then moved to "stop" once the server's abort reached the
        # engine: a counter that went down (a reset to rate()), and client disconnects were counted as "abort",
        # which vLLM 0.33 does not count there.
        self.finished: dict[str, int] = {}

    def bind(self, max_model_len: int) -> None:
        """Size the token-count histograms (once; later calls are no-ops)."""
        if self.prompt_tokens is None:
            bounds = request_token_buckets(max_model_len)
            self.prompt_tokens = Histogram(bounds)
            self.generation_tokens = Histogram(bounds)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def start(self, request_id: str, prompt_tokens: int, max_model_len: int) -> None:
        """A request arrives (before it is handed to the engine)."""
        self.bind(max_model_len)
        self._live[request_id] = RequestTimes(self._clock(), prompt_tokens)

    @contextlib.asynccontextmanager
    async def track(self, request_id: str, prompt_tokens: int, max_model_len: int) -> AsyncIterator[None]:
        """``start`` on entry; on exit, ``discard`` (a no-op after ``finish``). Async only so that it shares
        one ``async with`` with the engine stream it times: no wrapper around the per-output loop."""
        self.start(request_id, prompt_tokens, max_model_len)
        try:
            yield
        finally:
            self.discard(request_id)

    def on_outputs(self, outputs: Iterable[Any]) -> None:
        """One engine step's outputs as they reach the loop: before a consumer that fell behind merges them,
        so every step keeps its own arrival time."""
        now = self._clock()
        live = self._live
        for out in outputs:
            times = live.get(out.request_id)
            if times is None:
                continue
            if times.first_output is None:
                times.first_output = now
                self.time_to_first_token.observe(now - times.arrival)
            else:
                self.inter_token_latency.observe(now - times.last_output)
            times.last_output = now

    def finish(self, request_id: str, generation_tokens: int, reason: str | None = None) -> None:
        """The request finished with ``reason`` (what its response says); ``generation_tokens`` is what its usage
        reports."""
        times = self._live.pop(request_id, None)
        if times is None:
            return
        if reason is not None:
            self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e_latency.observe(self._clock() - times.arrival)
        if self.prompt_tokens is not None and self.generation_tokens is not None:
            self.prompt_tokens.observe(times.prompt_tokens)
            self.generation_tokens.observe(generation_tokens)
        first = times.first_output
        decode_s = times.last_output - first if first is not None else 0.0
        self.time_per_output_token.observe(decode_s / (generation_tokens - 1) if generation_tokens > 1 else 0.0)

    def discard(self, request_id: str) -> None:
        """Forget a request that ends without a finish (client gone, engine failure); no-op after ``finish``."""
        self._live.pop(request_id, None)


@dataclass(frozen=True)
class MetricsSnapshot:
    """The engine counters the server exports (a copy taken on the engine thread, read on the loop)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: Mapping[str, int] = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_kv_wait_steps: int = 0
    num_verified_draft_tokens: int = 0
    num_paused_steps: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    step_memory_peak_bytes: int = 0
    kernel_compiles: Mapping[str, int] = field(default_factory=dict)  # phase (startup / serving) -> count
    kernel_compile_s: Mapping[str, float] = field(default_factory=dict)
    full_gcs: int = 0
    full_gc_s: float = 0.0
    drafting_cost_scale: Mapping[int, float] = field(default_factory=dict)  # load bucket -> quotient
    realized_gain: float | None = None
    sustained_gain: float | None = None  # the same over the saturation policy's longer window
    # Saturation policy (capacity modes only): pauses, resumes, probe steps, due probes the tax held back,
    # and probes by (trigger, verdict).
    saturation: Mapping[str, int] = field(default_factory=dict)
    saturation_probes: Mapping[tuple[str, str], int] = field(default_factory=dict)
    step_s: Mapping[str, float] = field(default_factory=dict)  # step kind -> cumulative wall time (s)
    steps_by_kind: Mapping[str, int] = field(default_factory=dict)
    # With phase timing on (EngineConfig.phase_timing): (step kind, phase) -> cumulative seconds; the
    # scheduler's share of every step is kind "any", phase "schedule".
    phase_s: Mapping[tuple[str, str], float] = field(default_factory=dict)

    @classmethod
    def from_stats(cls, stats: object) -> MetricsSnapshot:
        """Copy an engine ``EngineStats`` (duck-typed: any object with the same attribute names)."""
        return cls(
            num_drafts=int(getattr(stats, "num_drafts", 0)),
            num_draft_tokens=int(getattr(stats, "num_draft_tokens", 0)),
            num_accepted_tokens=int(getattr(stats, "num_accepted_tokens", 0)),
            accepted_per_pos=tuple(int(x) for x in getattr(stats, "accepted_per_pos", ()) or ()),
            prompt_tokens=int(getattr(stats, "prompt_tokens", 0)),
            generation_tokens=int(getattr(stats, "generation_tokens", 0)),
            requests_finished=dict(getattr(stats, "requests_finished", {}) or {}),
            num_running=int(getattr(stats, "num_running", 0)),
            num_waiting=int(getattr(stats, "num_waiting", 0)),
            num_steps=int(getattr(stats, "num_steps", 0)),
            num_preemptions=int(getattr(stats, "num_preemptions", 0)),
            num_kv_wait_steps=int(getattr(stats, "num_kv_wait_steps", 0)),
            num_verified_draft_tokens=int(getattr(stats, "num_verified_draft_tokens", 0)),
            num_paused_steps=int(getattr(stats, "num_paused_steps", 0)),
            kv_blocks_total=int(getattr(stats, "kv_blocks_total", 0)),
            kv_blocks_free=int(getattr(stats, "kv_blocks_free", 0)),
            step_memory_peak_bytes=int(getattr(stats, "step_memory_peak_bytes", 0)),
            **_stall_fields(getattr(stats, "stalls", None)),
            drafting_cost_scale={int(b): float(v) for b, v in (getattr(stats, "drafting_cost_scale", {}) or {}).items()},
            realized_gain=_optional_float(getattr(stats, "realized_gain", None)),
            sustained_gain=_optional_float(getattr(stats, "sustained_gain", None)),
            step_s={str(k): float(v) / 1e3 for k, v in dict(getattr(stats, "step_ms", {}) or {}).items()},
            steps_by_kind={str(k): int(v) for k, v in dict(getattr(stats, "steps", {}) or {}).items()},
            phase_s=_phase_fields(getattr(stats, "phase_ms", None)),
            **_saturation_fields(getattr(stats, "saturation", None)),
        )


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _stall_fields(stalls: object) -> dict[str, object]:
    if stalls is None:
        return {}
    return {
        "kernel_compiles": {k: int(v) for k, v in getattr(stalls, "compiles", {}).items()},
        "kernel_compile_s": {k: float(v) / 1e3 for k, v in getattr(stalls, "compile_ms", {}).items()},
        "full_gcs": int(getattr(stalls, "full_gcs", 0)),
        "full_gc_s": float(getattr(stalls, "full_gc_ms", 0.0)) / 1e3,
    }


def _phase_fields(phase_ms: object) -> dict[tuple[str, str], float]:
    out = {}
    for key, ms in dict(phase_ms or {}).items():  # type: ignore[call-overload]
        kind, _, phase = str(key).rpartition(".")
        out[kind or "any", phase] = float(ms) / 1e3
    return out


def _saturation_fields(counters: object) -> dict[str, object]:
    if counters is None:
        return {}
    return {
        "saturation": {name: int(getattr(counters, name, 0))
                       for name in ("pauses", "resumes", "probe_steps", "scout_steps", "deferred_probe_steps",
                                    "unmeasured_probe_steps", "rising_probe_steps", "unsustained_steps")},
        "saturation_probes": {(str(t), str(v)): int(n) for (t, v), n in dict(getattr(counters, "probes", {})).items()},
    }


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _format_le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it (Go's float format): ``1e+06`` where Python says
    ``1000000.0``, so series keys match vLLM's for any max_model_len."""
    if math.isinf(bound):
        return "+Inf"
    text = repr(float(bound))
    whole, _, frac = text.partition(".")
    if bound > 0 and "e" not in text and len(whole) > 6:
        mantissa = f"{whole[0]}.{whole[1:]}{frac}".rstrip("0").rstrip(".")
        return f"{mantissa}e+{len(whole) - 1:02d}"
    return text


def _format_value(value: float) -> str:
    # prometheus_client writes floats with repr(); vLLM's scrapers accept any float literal.
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items()) + "}"


def _family(lines: list[str], name: str, kind: str, help_text: str,
            samples: Iterable[tuple[Mapping[str, str], float]]) -> None:
    lines.append(f"# HELP {name} {_escape_help(help_text)}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{_labels(labels)} {_format_value(value)}")


def _histogram(lines: list[str], name: str, help_text: str, labels: Mapping[str, str], hist: Histogram) -> None:
    lines.append(f"# HELP {name} {_escape_help(help_text)}")
    lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, n in zip((*hist.bounds, math.inf), hist.counts, strict=True):
        cumulative += n
        lines.append(f"{name}_bucket{_labels({**labels, 'le': _format_le(bound)})} {_format_value(cumulative)}")
    lines.append(f"{name}_count{_labels(labels)} {_format_value(cumulative)}")
    lines.append(f"{name}_sum{_labels(labels)} {_format_value(hist.sum)}")


def _request_histograms(lines: list[str], req: RequestMetrics, model_name: str) -> None:
    labels = {"model_name": model_name, "engine": ENGINE_INDEX}
    if req.prompt_tokens is not None and req.generation_tokens is not None:
        _histogram(lines, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
                   req.prompt_tokens)
        _histogram(lines, "vllm:request_generation_tokens", "Number of generation tokens processed.", labels,
                   req.generation_tokens)
    _histogram(lines, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
               req.time_to_first_token)
    _histogram(lines, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels,
               req.inter_token_latency)
    _histogram(lines, "vllm:request_time_per_output_token_seconds",
               "Histogram of time_per_output_token_seconds per request.", labels, req.time_per_output_token)
    _histogram(lines, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels,
               req.e2e_latency)


def render_metrics(snap: MetricsSnapshot, model_name: str, num_speculative_tokens: int = 0,
                   requests: RequestMetrics | None = None) -> str:
    """The full ``/metrics`` body. Per-position acceptance has ``max(k, len(accepted_per_pos))`` series, and no
    spec-decoding family is exported at ``k = 0``; ``requests`` adds the per-request histograms and counts the
    finished requests. Every series carries vLLM
    0.33's labels, ``model_name`` and ``engine`` (its loggers' ``labelnames``): a dashboard that filters on
    ``engine`` found none of the counters and gauges, which carried ``model_name`` alone."""
    base = {"model_name": model_name, "engine": ENGINE_INDEX}
    lines: list[str] = []
    _family(lines, "vllm:num_requests_running", "gauge",
            "Number of requests in model execution batches.", [(base, snap.num_running)])
    _family(lines, "vllm:num_requests_waiting", "gauge",
            "Number of requests waiting to be processed.", [(base, snap.num_waiting)])
    _family(lines, "vllm:prompt_tokens_total", "counter",
            "Number of prefill tokens processed.", [(base, snap.prompt_tokens)])
    _family(lines, "vllm:generation_tokens_total", "counter",
            "Number of generation tokens processed.", [(base, snap.generation_tokens)])
    finished = dict(snap.requests_finished)
    if requests is not None:
        # what responses said, plus the requests an engine that died failed (the front counts those: no
        # response finished them)
        finished = {**requests.finished, "error": requests.finished.get("error", 0) + finished.get("error", 0)}
    reasons = list(FINISH_REASONS) + sorted(r for r in finished if r not in FINISH_REASONS)
    _family(lines, "vllm:request_success_total", "counter",
            "Count of successfully processed requests.",
            [({**base, "finished_reason": r}, finished.get(r, 0)) for r in reasons])
    if num_speculative_tokens > 0:  # as vLLM, which registers no spec-decoding series without a speculative config
        for name, doc, value in (("num_drafts", "Number of spec decoding drafts.", snap.num_drafts),
                                 ("num_draft_tokens", "Number of draft tokens.", snap.num_draft_tokens),
                                 ("num_accepted_tokens", "Number of accepted tokens.", snap.num_accepted_tokens)):
            _family(lines, f"vllm:spec_decode_{name}_total", "counter", doc, [(base, value)])
        per_pos = list(snap.accepted_per_pos)
        per_pos += [0] * max(0, num_speculative_tokens - len(per_pos))
        _family(lines, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                "Accepted tokens per draft position.",
                [({**base, "position": str(i)}, v) for i, v in enumerate(per_pos)])
    if snap.kv_blocks_total > 0:
        used = (snap.kv_blocks_total - snap.kv_blocks_free) / snap.kv_blocks_total
        _family(lines, "vllm:kv_cache_usage_perc", "gauge",
                "KV-cache usage. 1 means 100 percent usage.", [(base, used)])
    _family(lines, "vllm:num_preemptions_total", "counter",
            "Cumulative number of preemption from the engine.", [(base, snap.num_preemptions)])
    if requests is not None:
        _request_histograms(lines, requests, model_name)
    # Toolkit-specific series (no vLLM equivalent): what the capacity manager actually verified.
    _family(lines, "dspark:requests_aborted_total", "counter",
            "Requests aborted before they finished (a client gone; vLLM counts them nowhere).",
            [(base, snap.requests_finished.get("abort", 0))])
    _family(lines, "dspark:engine_steps_total", "counter",
            "Number of engine steps (one prefill or draft+verify iteration each).", [(base, snap.num_steps)])
    _family(lines, "dspark:verified_draft_tokens_total", "counter",
            "Draft tokens the capacity manager admitted to verification.",
            [(base, snap.num_verified_draft_tokens)])
    _family(lines, "dspark:drafting_paused_steps_total", "counter",
            "Decode steps that skipped drafting (saturation policy).", [(base, snap.num_paused_steps)])
    if snap.steps_by_kind:
        kinds = sorted(snap.steps_by_kind)
        _family(lines, "dspark:steps_total", "counter",
                "Engine steps by kind (prefill, spec, probe, paused, nospec).",
                [({**base, "kind": k}, snap.steps_by_kind[k]) for k in kinds])
        _family(lines, "dspark:step_seconds_total", "counter",
                "Engine step wall time by kind; over dspark:steps_total, a kind's mean step.",
                [({**base, "kind": k}, snap.step_s.get(k, 0.0)) for k in kinds])
    if snap.phase_s:
        _family(lines, "dspark:step_phase_seconds_total", "counter",
                "Engine step wall time by kind and phase (dspark serve --phase-timing); over dspark:steps_total, "
                "a phase's mean share of a step.",
                [({**base, "kind": k, "phase": p}, v) for (k, p), v in sorted(snap.phase_s.items())])
    if snap.saturation:
        _family(lines, "dspark:saturation_pauses_total", "counter",
                "Times the saturation policy paused drafting.", [(base, snap.saturation.get("pauses", 0))])
        _family(lines, "dspark:saturation_resumes_total", "counter",
                "Times a paying probe resumed drafting.", [(base, snap.saturation.get("resumes", 0))])
        _family(lines, "dspark:saturation_probe_steps_total", "counter",
                "Drafting steps that probed a pause (each pays the draft's catch-up over it).",
                [(base, snap.saturation.get("probe_steps", 0))])
        _family(lines, "dspark:saturation_scout_steps_total", "counter",
                "Probe steps that were scouts (dspark_probe_scout): drafted, verified nothing, judged no probe.",
                [(base, snap.saturation.get("scout_steps", 0))])
        _family(lines, "dspark:saturation_unsustained_steps_total", "counter",
                "Drafting steps that paid on the short window but fell short of the sustain margin on the long one.",
                [(base, snap.saturation.get("unsustained_steps", 0))])
        _family(lines, "dspark:saturation_deferred_probe_steps_total", "counter",
                "Paused steps on which a probe was due but the probe tax held it back.",
                [(base, snap.saturation.get("deferred_probe_steps", 0))])
        _family(lines, "dspark:saturation_unmeasured_probe_steps_total", "counter",
                "Paused steps on which a probe was due but waited for a paused step at its load to be timed.",
                [(base, snap.saturation.get("unmeasured_probe_steps", 0))])
        _family(lines, "dspark:saturation_rising_probe_steps_total", "counter",
                "Paused steps on which a probe would have been due but the load was still climbing.",
                [(base, snap.saturation.get("rising_probe_steps", 0))])
        _family(lines, "dspark:saturation_probes_total", "counter",
                "Saturation probes by what started them (timer, load fall, load rise) and their verdict.",
                [({**base, "trigger": t, "verdict": v}, n) for (t, v), n in sorted(snap.saturation_probes.items())])
    _family(lines, "dspark:kv_blocks_free", "gauge", "Free KV-cache blocks.", [(base, snap.kv_blocks_free)])
    _family(lines, "dspark:step_memory_peak_bytes", "gauge",
            "Peak device memory the steps held beyond the weights and the KV pool, graph pools included (CUDA; 0 "
            "elsewhere): the start-up log says how much the pool left free for it.", [(base, snap.step_memory_peak_bytes)])
    _family(lines, "dspark:kv_wait_steps_total", "counter",
            "Steps on which a waiting request had a free slot but the KV pool lacked the blocks to start it.",
            [(base, snap.num_kv_wait_steps)])
    # What stalls steps beyond their own work (stalls.py): any compile in phase "serving" is a gap in the
    # start-up warm-ups, and a benchmark cell that saw one lost that much time.
    phases = sorted(set(snap.kernel_compiles) | {"startup", "serving"})
    _family(lines, "dspark:kernel_compiles_total", "counter",
            "Triton kernel compiles, at start-up and while serving.",
            [({**base, "phase": ph}, snap.kernel_compiles.get(ph, 0)) for ph in phases])
    _family(lines, "dspark:kernel_compile_seconds_total", "counter",
            "Time spent compiling Triton kernels, at start-up and while serving.",
            [({**base, "phase": ph}, snap.kernel_compile_s.get(ph, 0.0)) for ph in phases])
    _family(lines, "dspark:gc_full_collections_total", "counter",
            "Full (generation 2) Python garbage collections; each holds the interpreter lock.",
            [(base, snap.full_gcs)])
    _family(lines, "dspark:gc_full_collection_seconds_total", "counter",
            "Time spent in full Python garbage collections.", [(base, snap.full_gc_s)])
    # The saturation policy's evidence: > 1 means a drafting step costs more, relative to a plain step, than
    # the curve says (host work it does not price); the realized gain is drafting's Θ over plain decoding's.
    if snap.drafting_cost_scale:
        _family(lines, "dspark:drafting_cost_scale", "gauge",
                "Measured drafting over plain step cost, relative to the SPS curve, per load (requests).",
                [({**base, "load": StepTimeCalibration.bucket_label(b)}, v) for b, v in snap.drafting_cost_scale.items()])
    if snap.realized_gain is not None:
        _family(lines, "dspark:saturation_realized_gain", "gauge",
                "Windowed realized throughput of drafting steps over plain decoding's (> 1: drafting pays).",
                [(base, snap.realized_gain)])
    if snap.sustained_gain is not None:
        _family(lines, "dspark:saturation_sustained_gain", "gauge",
                "Realized throughput of drafting over plain decoding's across the saturation policy's long window "
                "(drafting goes on while it clears the sustain margin).",
                [(base, snap.sustained_gain)])
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse Prometheus text into ``{(name, sorted labels): value}``; strict, for tests and self-checks.

    Raises ``ValueError`` naming the line for anything that is not a comment, blank, or a valid sample.
    """
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        labels: list[tuple[str, str]] = []
        if "{" in line:
            name, rest = line.split("{", 1)
            body, _, value_part = rest.rpartition("}")
            i = 0
            while i < len(body):
                eq = body.index("=", i)
                key = body[i:eq].strip().lstrip(",").strip()
                if body[eq + 1] != '"':
                    raise ValueError(f"line {lineno}: label value must be quoted: {raw!r}")
                j = eq + 2
                val: list[str] = []
                while body[j] != '"':
                    if body[j] == "\\":
                        j += 1
                        val.append({"n": "\n"}.get(body[j], body[j]))
                    else:
                        val.append(body[j])
                    j += 1
                labels.append((key, "".join(val)))
                i = j + 1
                while i < len(body) and body[i] in ", ":
                    i += 1
        else:
            name, _, value_part = line.partition(" ")
        fields = value_part.split()
        if not name or not fields:
            raise ValueError(f"line {lineno}: not a sample: {raw!r}")
        try:
            value = float(fields[0])
        except ValueError:
            raise ValueError(f"line {lineno}: bad value {fields[0]!r}") from None
        out[(name.strip(), tuple(sorted(labels)))] = value
    return out
