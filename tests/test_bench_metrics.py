"""Parsing vLLM's Prometheus /metrics text into spec-decode counters and acceptance length."""

from __future__ import annotations

import math

import pytest

from dspark_cli.bench.metrics import SpecDecodeCounters, counter_delta, parse_prometheus

# The shape vLLM 0.x's prometheus_client exposition has: HELP/TYPE lines, counters with `_total` and a
# `_created` sibling, engine/model_name labels, per-position counters, histograms and gauges around them.
VLLM_SAMPLE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} 3.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} 1200.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} 8400.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} 600.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4",position="0"} 400.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4",position="1"} 150.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4",position="2"} 50.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} 256.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} 12.5
vllm:gpu_cache_usage_perc{engine="0",model_name="nvidia/DeepSeek-V4-Flash-NVFP4"} NaN
"""


def test_parse_vllm_sample_reads_labels_and_values() -> None:
    samples = parse_prometheus(VLLM_SAMPLE)
    by = {(s.name, s.labels.get("position"), s.labels.get("le")): s for s in samples}
    assert by[("vllm:spec_decode_num_drafts_total", None, None)].value == 1200.0
    assert by[("vllm:spec_decode_num_drafts_total", None, None)].labels["model_name"] == \
        "nvidia/DeepSeek-V4-Flash-NVFP4"
    assert by[("vllm:time_to_first_token_seconds_bucket", None, "+Inf")].value == 256.0
    assert math.isnan(by[("vllm:gpu_cache_usage_perc", None, None)].value)
    assert by[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "2", None)].value == 50.0


def test_counters_ignore_created_and_read_per_position() -> None:
    c = SpecDecodeCounters.from_text(VLLM_SAMPLE)
    assert c.present
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (1200.0, 8400.0, 600.0)
    assert c.accepted_per_pos == {0: 400.0, 1: 150.0, 2: 50.0}


def test_counters_without_total_suffix_and_summed_over_engines() -> None:
    text = """
vllm:spec_decode_num_drafts{engine="0"} 10
vllm:spec_decode_num_drafts{engine="1"} 30
vllm:spec_decode_num_draft_tokens{engine="0"} 40 1712345678000
vllm:spec_decode_num_draft_tokens{engine="1"} 120
vllm:spec_decode_num_accepted_tokens_total{engine="0"} 5
vllm:spec_decode_num_accepted_tokens_total{engine="1"} 15
vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",position="0"} 5
vllm:spec_decode_num_accepted_tokens_per_pos{engine="1",position="0"} 15
"""
    c = SpecDecodeCounters.from_text(text)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (40.0, 160.0, 20.0)
    assert c.accepted_per_pos == {0: 20.0}


def test_label_values_with_escapes_commas_and_braces() -> None:
    text = 'm{a="x\\"y,z}",b="back\\\\slash",c="new\\nline"} 2.5e1\n'
    (s,) = parse_prometheus(text)
    assert s.labels == {"a": 'x"y,z}', "b": "back\\slash", "c": "new\nline"}
    assert s.value == 25.0


def test_malformed_lines_are_skipped_not_fatal() -> None:
    text = 'garbage line here\nm{a="unterminated 1\n{} 3\nok_metric 7\nbad_value abc\n'
    samples = parse_prometheus(text)
    assert [(s.name, s.value) for s in samples] == [("ok_metric", 7.0)]


def test_no_spec_decode_counters_means_absent() -> None:
    c = SpecDecodeCounters.from_text("vllm:num_requests_running 1\n")
    assert not c.present
    assert counter_delta(c, c) is None


def test_delta_gives_acceptance_length_and_per_position_rates() -> None:
    before = SpecDecodeCounters(100, 400, 50, {0: 40, 1: 10, 2: 0, 3: 0}, True)
    after = SpecDecodeCounters(300, 1200, 250, {0: 190, 1: 80, 2: 30, 3: 0}, True)
    d = counter_delta(before, after)
    assert d is not None
    assert d.num_drafts == 200
    assert d.acceptance_length == pytest.approx(1 + 200 / 200)
    assert d.acceptance_rate == pytest.approx(200 / 800)
    assert d.per_position_acceptance == pytest.approx([0.75, 0.35, 0.15, 0.0])


def test_delta_without_draft_steps_and_after_restart() -> None:
    same = SpecDecodeCounters(10, 40, 5, {}, True)
    d = counter_delta(same, same)
    assert d is not None and d.acceptance_length is None and d.acceptance_rate is None
    restarted = counter_delta(SpecDecodeCounters(100, 400, 50, {}, True), SpecDecodeCounters(3, 12, 1, {}, True))
    assert restarted is not None and restarted.acceptance_length is None


def test_prefix_cache_counters_give_each_cells_hit_rate_over_engines() -> None:
    """vLLM counts prompt tokens looked up in its prefix cache and found there; a cell whose prompts an earlier
    cell prefilled did less work, and its delta says how much less."""
    from dspark_cli.bench.metrics import PrefixCacheCounters, prefix_cache_delta

    def scrape(queries: float, hits: float) -> PrefixCacheCounters:
        half = '{engine="0",model_name="m"}'
        other = '{engine="1",model_name="m"}'
        return PrefixCacheCounters.from_samples(parse_prometheus(
            f"vllm:prefix_cache_queries_total{half} {queries / 2}\nvllm:prefix_cache_queries_total{other} {queries / 2}\n"
            f"vllm:prefix_cache_hits_total{half} {hits}\nvllm:prefix_cache_queries_created{half} 1.7e9\n"))

    before, after = scrape(1000.0, 100.0), scrape(5000.0, 2100.0)
    assert before.present and after.queries == 5000.0
    assert prefix_cache_delta(before, after) == {"queried_tokens": 4000.0, "hit_tokens": 2000.0, "hit_rate": 0.5}
    assert prefix_cache_delta(after, after) == {"queried_tokens": 0.0, "hit_tokens": 0.0, "hit_rate": 0.0}
    assert prefix_cache_delta(after, before) is None  # went backwards: a restart, not a negative hit rate
    none = PrefixCacheCounters.from_samples(parse_prometheus("vllm:spec_decode_num_drafts_total 3\n"))
    assert not none.present and prefix_cache_delta(none, none) is None  # the embedded engine keeps no such cache
