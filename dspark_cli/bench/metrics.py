"""Speculative-decoding counters from a server's Prometheus ``/metrics`` text, with vLLM's metric names.

Acceptance length cannot be measured from the client side (a stream chunk may carry several tokens, and
servers differ in how they chunk), so we read the server's own counters before and after a measurement and
take deltas. We use exactly vLLM's names so the same bench command measures a real vLLM server and the
embedded engine alike:

    vllm:spec_decode_num_drafts_total                          verify steps that carried drafts (per request)
    vllm:spec_decode_num_draft_tokens_total                    draft tokens proposed
    vllm:spec_decode_num_accepted_tokens_total                 draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}

    acceptance length = 1 + accepted / drafts   (tokens emitted per request-step, the bonus token included)

vLLM's prefix-cache counters (``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``, in prompt
tokens) are read the same way: they say whether a cell did its whole prefill or found part of it cached.

The parser is deliberately tolerant: prometheus_client writes counters with a ``_total`` suffix (and a
``_created`` sibling) while some exporters drop the suffix; vLLM labels every sample with ``model_name`` and
``engine`` (several engines = several samples to sum); values may be ``NaN``/``+Inf`` or carry a timestamp.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

PREFIX = "vllm:spec_decode_"
NUM_DRAFTS = PREFIX + "num_drafts"
NUM_DRAFT_TOKENS = PREFIX + "num_draft_tokens"
NUM_ACCEPTED = PREFIX + "num_accepted_tokens"
ACCEPTED_PER_POS = PREFIX + "num_accepted_tokens_per_pos"
# vLLM's prefix cache, in prompt tokens looked up and found: a cell whose prompts were prefilled before (an
# earlier cell, a warm-up) did less work than one whose were not.
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"


@dataclass(frozen=True)
class Sample:
    """One exposition line: ``name{labels} value [timestamp]``."""

    name: str
    labels: dict[str, str]
    value: float


_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME_RE = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*\"")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _parse_labels(text: str, start: int) -> tuple[dict[str, str], int]:
    """Parse ``{a="x",b="y"}`` starting just after ``{``; returns labels and the index after ``}``.

    Written by hand rather than with one regex because label values may contain escaped quotes, commas and
    braces (e.g. a model path), which a simple pattern splits in the wrong place.
    """
    labels: dict[str, str] = {}
    i = start
    while True:
        while i < len(text) and text[i] in " \t,":
            i += 1
        if i >= len(text):
            raise ValueError("unterminated label set")
        if text[i] == "}":
            return labels, i + 1
        m = _LABEL_NAME_RE.match(text, i)
        if not m:
            raise ValueError(f"bad label at column {i}")
        key = m.group(1)
        i = m.end()
        value: list[str] = []
        while True:
            if i >= len(text):
                raise ValueError("unterminated label value")
            ch = text[i]
            if ch == "\\" and i + 1 < len(text):
                value.append(_ESCAPES.get(text[i + 1], "\\" + text[i + 1]))
                i += 2
            elif ch == '"':
                i += 1
                break
            else:
                value.append(ch)
                i += 1
        labels[key] = "".join(value)


def _parse_value(token: str) -> float:
    low = token.lower()
    if low in ("nan", "+nan", "-nan"):
        return math.nan
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    return float(token)


def parse_prometheus(text: str) -> list[Sample]:
    """All samples in a Prometheus text exposition; malformed lines are skipped, never fatal.

    A bench must not die because an unrelated metric of some server version is odd, so a line we cannot
    read is ignored -- the counters we need are checked for presence separately.
    """
    samples: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME_RE.match(line)
        if not m:
            continue
        name = m.group(0)
        rest_at = m.end()
        labels: dict[str, str] = {}
        try:
            if rest_at < len(line) and line[rest_at] == "{":
                labels, rest_at = _parse_labels(line, rest_at + 1)
            parts = line[rest_at:].split()
            if not parts:
                continue
            value = _parse_value(parts[0])
        except ValueError:
            continue
        samples.append(Sample(name, labels, value))
    return samples


def _base_name(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative speculative-decoding counters at one instant (summed over engines/models)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    present: bool = False  # False: the server exposes no spec-decode counters (no speculation, or not vLLM)

    @classmethod
    def from_samples(cls, samples: Iterable[Sample]) -> SpecDecodeCounters:
        totals = {NUM_DRAFTS: 0.0, NUM_DRAFT_TOKENS: 0.0, NUM_ACCEPTED: 0.0}
        per_pos: dict[int, float] = {}
        present = False
        for s in samples:
            if not s.name.startswith(PREFIX) or s.name.endswith("_created") or not math.isfinite(s.value):
                continue
            base = _base_name(s.name)
            if base in totals:
                totals[base] += s.value
                present = True
            elif base == ACCEPTED_PER_POS:
                try:
                    pos = int(s.labels.get("position", ""))
                except ValueError:
                    continue
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
                present = True
        return cls(totals[NUM_DRAFTS], totals[NUM_DRAFT_TOKENS], totals[NUM_ACCEPTED], per_pos, present)

    @classmethod
    def from_text(cls, text: str) -> SpecDecodeCounters:
        return cls.from_samples(parse_prometheus(text))


DSPARK_PREFIX = "dspark:"
# Labels that say which engine or model a sample is from, not what it counts: summed over, like vLLM's engines.
_SOURCE_LABELS = frozenset({"model_name", "engine"})


def _dspark_series(samples: Iterable[Sample], counters: bool) -> Iterator[tuple[str, float]]:
    """``(key, value)`` of the toolkit's counters (``counters``: ``dspark:*_total``) or gauges (the rest), keyed
    ``name`` or ``name{label=value,...}`` without the prefix (and a counter's suffix), source labels dropped."""
    for s in samples:
        if not s.name.startswith(DSPARK_PREFIX) or s.name.endswith("_total") != counters or not math.isfinite(s.value):
            continue
        key = (_base_name(s.name) if counters else s.name)[len(DSPARK_PREFIX):]
        labels = sorted((k, v) for k, v in s.labels.items() if k not in _SOURCE_LABELS)
        if labels:
            key += "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"
        yield key, s.value


def dspark_counters(samples: Iterable[Sample]) -> dict[str, float]:
    """The toolkit's own counters (``dspark:*_total``), keyed ``name`` or ``name{label=value,...}`` without
    the prefix and suffix: ``kernel_compiles{phase=serving}``, ``drafting_paused_steps``. Gauges are left out
    (a delta of a gauge means nothing)."""
    out: dict[str, float] = {}
    for key, value in _dspark_series(samples, counters=True):
        out[key] = out.get(key, 0.0) + value
    return out


def dspark_gauges(samples: Iterable[Sample]) -> dict[str, float]:
    """The toolkit's own gauges (``dspark:*`` not ending in ``_total``), keyed like :func:`dspark_counters`:
    ``drafting_cost_scale{load=16-31}``, ``saturation_realized_gain``. A cell keeps their values at its end."""
    return dict(_dspark_series(samples, counters=False))


def dspark_counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each of the toolkit's counters did between two scrapes (a counter absent before counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}


@dataclass(frozen=True)
class SpecDecodeStats:
    """What happened between two counter snapshots: the numbers the bench table reports."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    acceptance_length: float | None  # 1 + accepted/drafts; None when no draft step happened
    acceptance_rate: float | None  # accepted / draft tokens
    per_position_acceptance: list[float]  # accepted at position i / drafts, i = 0..K-1

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
        }


def counter_delta(before: SpecDecodeCounters, after: SpecDecodeCounters) -> SpecDecodeStats | None:
    """Stats between two snapshots; None when the server has no spec-decode counters at all.

    Counters only grow, so a negative delta means the server restarted between the snapshots; we report
    that as "unknown" (None fields) rather than a nonsense acceptance length.
    """
    if not after.present:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if drafts < 0 or draft_tokens < 0 or accepted < 0:
        return SpecDecodeStats(drafts, draft_tokens, accepted, None, None, [])
    per_pos: list[float] = []
    if drafts > 0 and after.accepted_per_pos:
        for pos in range(max(after.accepted_per_pos) + 1):
            d = after.accepted_per_pos.get(pos, 0.0) - before.accepted_per_pos.get(pos, 0.0)
            per_pos.append(d / drafts)
    return SpecDecodeStats(
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted,
        acceptance_length=(1.0 + accepted / drafts) if drafts > 0 else None,
        acceptance_rate=(accepted / draft_tokens) if draft_tokens > 0 else None,
        per_position_acceptance=per_pos,
    )


@dataclass(frozen=True)
class PrefixCacheCounters:
    """Prompt tokens a server looked up in its prefix cache and found there (vLLM's counters; ``present`` is
    False for a server without them, such as the embedded engine, which has no prefix cache)."""

    queries: float = 0.0
    hits: float = 0.0
    present: bool = False

    @classmethod
    def from_samples(cls, samples: Iterable[Sample]) -> PrefixCacheCounters:
        totals = {PREFIX_CACHE_QUERIES: 0.0, PREFIX_CACHE_HITS: 0.0}
        present = False
        for s in samples:
            base = _base_name(s.name)
            if base in totals and math.isfinite(s.value):
                totals[base] += s.value
                present = True
        return cls(totals[PREFIX_CACHE_QUERIES], totals[PREFIX_CACHE_HITS], present)


def counters_went_down(before: SpecDecodeCounters, after: SpecDecodeCounters, dspark_before: dict[str, float],
                       dspark_after: dict[str, float]) -> bool:
    """Whether any counter of either scrape went backwards: the server restarted between them, so no delta of the
    cell means anything -- not even one that came out positive (a restarted server that then did more work than
    before read as a real acceptance length beside toolkit counters that went negative)."""
    pairs = [(before.num_drafts, after.num_drafts), (before.num_draft_tokens, after.num_draft_tokens),
             (before.num_accepted_tokens, after.num_accepted_tokens),
             *((v, after.accepted_per_pos.get(k, 0.0)) for k, v in before.accepted_per_pos.items()),
             *((v, dspark_after.get(k, 0.0)) for k, v in dspark_before.items())]
    return any(now < was for was, now in pairs)


def prefix_cache_delta(before: PrefixCacheCounters, after: PrefixCacheCounters) -> dict[str, float] | None:
    """Prompt tokens looked up and found in the prefix cache between two scrapes, and their ratio; None when
    the server keeps no such counters, or they went backwards (a restart)."""
    if not after.present:
        return None
    queried, hit = after.queries - before.queries, after.hits - before.hits
    if queried < 0 or hit < 0:
        return None
    return {"queried_tokens": queried, "hit_tokens": hit, "hit_rate": hit / queried if queried > 0 else 0.0}
