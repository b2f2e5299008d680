"""Server building blocks without a model: Prometheus rendering, stop-string buffering, detokenisation."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dspark_cli.engines.embedded.detokenizer import IncrementalDetokenizer, StopTextBuffer, fast_decoder
from dspark_cli.engines.embedded.metrics import (
    MetricsSnapshot,
    RequestMetrics,
    parse_metrics,
    render_metrics,
    request_token_buckets,
)

# ----------------------------------------------------------------------------------------- /metrics


def _snap() -> MetricsSnapshot:
    return MetricsSnapshot(num_drafts=10, num_draft_tokens=40, num_accepted_tokens=17, accepted_per_pos=(9, 5, 3),
                           prompt_tokens=123, generation_tokens=456, requests_finished={"stop": 3, "length": 2},
                           num_running=2, num_waiting=1, num_steps=99)


def test_render_uses_vllm_names_and_labels() -> None:
    text = render_metrics(_snap(), 'my"model', num_speculative_tokens=4)
    m = parse_metrics(text)
    lab = (("engine", "0"), ("model_name", 'my"model'))  # vLLM 0.33's labelnames on every series
    assert m[("vllm:spec_decode_num_drafts_total", lab)] == 10
    assert m[("vllm:spec_decode_num_draft_tokens_total", lab)] == 40
    assert m[("vllm:spec_decode_num_accepted_tokens_total", lab)] == 17
    for pos, want in enumerate([9, 5, 3, 0]):  # padded to k positions, 0-based like vLLM
        key = ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
               (("engine", "0"), ("model_name", 'my"model'), ("position", str(pos))))
        assert m[key] == want
    assert m[("vllm:prompt_tokens_total", lab)] == 123
    assert m[("vllm:generation_tokens_total", lab)] == 456
    assert m[("vllm:num_requests_running", lab)] == 2
    assert m[("vllm:num_requests_waiting", lab)] == 1
    reasons = {dict(k[1])["finished_reason"]: v for k, v in m.items() if k[0] == "vllm:request_success_total"}
    assert reasons == {"stop": 3, "length": 2, "abort": 0, "error": 0}


def test_a_server_that_does_not_speculate_exports_no_spec_decode_series() -> None:
    # As vLLM 0.33 (SpecDecodingProm registers nothing without a speculative config): a -k 0 server's dashboard
    # showed spec-decoding counters standing at 0, and a per-position family with no series.
    text = render_metrics(MetricsSnapshot(), "m", num_speculative_tokens=0)
    assert "vllm:spec_decode" not in text and "vllm:generation_tokens_total" in text
    drafting = parse_metrics(render_metrics(MetricsSnapshot(), "m", num_speculative_tokens=2))
    lab = (("engine", "0"), ("model_name", "m"))
    assert drafting[("vllm:spec_decode_num_drafts_total", lab)] == 0
    assert sum(1 for name, _ in drafting if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total") == 2


def test_every_family_has_help_and_type_before_its_samples() -> None:
    text = render_metrics(_snap(), "m", num_speculative_tokens=3)
    lines = text.splitlines()
    seen_type: dict[str, str] = {}
    for i, line in enumerate(lines):
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert lines[i - 1].startswith(f"# HELP {name} ")
            seen_type[name] = kind
        elif line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            assert name in seen_type, name
    assert seen_type["vllm:spec_decode_num_drafts_total"] == "counter"
    assert seen_type["vllm:num_requests_running"] == "gauge"
    assert text.endswith("\n")


def test_parse_metrics_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse_metrics("# ok\nvllm:x{a=b} 1\n")
    with pytest.raises(ValueError, match="bad value"):
        parse_metrics("vllm:x 1,5\n")


def test_from_stats_copies_an_engine_stats_like_object() -> None:
    class Stats:
        num_drafts = 3
        num_draft_tokens = 12
        num_accepted_tokens = 5
        accepted_per_pos = [3, 2]
        prompt_tokens = 7
        generation_tokens = 8
        requests_finished = {"stop": 1}
        num_running = 0
        num_waiting = 0
        num_steps = 4

    snap = MetricsSnapshot.from_stats(Stats())
    Stats.requests_finished["stop"] = 99  # the snapshot must not alias the engine's live dict
    assert snap.accepted_per_pos == (3, 2) and snap.requests_finished == {"stop": 1}


# ------------------------------------------------------------------------------------ stop strings


def _run_buffer(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    buf = StopTextBuffer(stops)
    out = []
    for p in pieces:
        out.append(buf.add(p))
        if buf.stopped:
            break
    if not buf.stopped:
        out.append(buf.flush())
    return "".join(out), buf.stopped


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10))
# A complete match ("a" at 1) waits while a longer stop starting earlier ("\naa" at 0) may complete.
@example(text="\naa", stops=["a", "\naa"], cuts=[2])
@example(text="xab", stops=["b", "xaby"], cuts=[3])
def test_stop_buffer_equals_cutting_the_whole_text(text: str, stops: list[str], cuts: list[int]) -> None:
    """However the text arrives, the client sees it cut before the earliest stop string, and no more."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    want = text[:min(hits)] if hits else text
    got, stopped = _run_buffer(stops, pieces)
    assert got == want
    assert stopped == bool(hits)


def test_stop_buffer_holds_back_a_possible_stop_prefix() -> None:
    buf = StopTextBuffer(["END"])
    assert buf.add("hello E") == "hello"  # the last len("END") - 1 characters could start END
    assert buf.add("N") == " "
    assert buf.add("D and more") == ""
    assert buf.stopped and buf.text == "hello "


def test_stop_buffer_waits_for_an_earlier_longer_stop_then_takes_the_shorter_one() -> None:
    buf = StopTextBuffer(["b", "xaby"])
    assert buf.add("xab") == ""  # "b" matched, but "xaby" (starting at 0) may still complete
    assert not buf.stopped
    assert buf.add("z") == "xa"  # it did not: cut before "b"
    assert buf.stopped and buf.text == "xa"
    late = StopTextBuffer(["b", "xaby"])
    assert late.add("xab") == "" and late.flush() == "xa" and late.stopped  # the output ended instead


# -------------------------------------------------------------------------------- detokenisation


@pytest.fixture(scope="module")
def byte_tokenizer():  # type: ignore[no-untyped-def]
    """A small byte-level BPE trained in memory: multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog. " * 3, "naïve café — 日本語 テキスト 🙂 emoji", "x = 1 + 2\n"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab é日本🙂.\n", min_size=1, max_size=30), prompt=st.text(alphabet="ab ", max_size=5),
       chunk=st.integers(1, 4))
def test_incremental_detokenizer_matches_full_decode(byte_tokenizer, text: str, prompt: str, chunk: int) -> None:  # type: ignore[no-untyped-def]
    tok = byte_tokenizer
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt_ids)
    parts = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(detok.flush())
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in parts)  # never emits half a character


@settings(max_examples=80, deadline=None)
@given(ids=st.lists(st.integers(0, 299), max_size=12))
def test_the_fast_decoder_is_the_tokenizers_own_decode(byte_tokenizer, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    """The Rust decode the detokenizer uses gives exactly what ``decode(..., skip_special_tokens=True)`` does,
    special tokens and partial characters included."""
    tok = byte_tokenizer
    ids = [i % len(tok) for i in ids] + [tok.eos_token_id]
    assert fast_decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=True)


def test_the_fast_decoder_keeps_the_wrapper_where_it_cleans_up_spaces(byte_tokenizer) -> None:  # type: ignore[no-untyped-def]
    calls: list[list[int]] = []

    class Cleaning:  # a tokenizer whose decode post-processes the Rust output: the wrapper must be used
        backend_tokenizer = byte_tokenizer.backend_tokenizer
        clean_up_tokenization_spaces = True

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            calls.append(ids)
            return "cleaned"

    assert fast_decoder(Cleaning())([1, 2]) == "cleaned" and calls == [[1, 2]]


# ------------------------------------------------------------------------------- request histograms


class _Clock:
    """A settable clock, so the request histograms see exact times."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Out:
    request_id: str
    new_token_ids: list[int]


def _hist(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          model: str = "m") -> tuple[dict[str, float], float, float]:
    """(cumulative bucket counts by ``le``, ``_count``, ``_sum``) of one rendered request histogram."""
    labels = (("engine", "0"), ("model_name", model))
    buckets = {dict(k[1])["le"]: v for k, v in m.items()
               if k[0] == name + "_bucket" and dict(k[1]).get("model_name") == model}
    return buckets, m[(name + "_count", labels)], m[(name + "_sum", labels)]


def test_request_token_buckets_are_vllms_1_2_5_series_up_to_max_model_len() -> None:
    assert request_token_buckets(192) == (1, 2, 5, 10, 20, 50, 100)
    assert request_token_buckets(200) == (1, 2, 5, 10, 20, 50, 100, 200)
    assert request_token_buckets(2_000_000)[-3:] == (500_000, 1_000_000, 2_000_000)


def test_a_histogram_renders_cumulative_buckets_inf_count_and_sum() -> None:
    req = RequestMetrics()
    req.bind(60)  # token buckets 1, 2, 5, 10, 20, 50
    assert req.prompt_tokens is not None
    for value in (1, 2, 2, 3, 10, 11, 50, 51, 1000):
        req.prompt_tokens.observe(value)
    text = render_metrics(MetricsSnapshot(), "m", requests=req)
    buckets, count, total = _hist(parse_metrics(text), "vllm:request_prompt_tokens")
    # le is inclusive: 2 counts in le="2.0", 10 in le="10.0"
    assert buckets == {"1.0": 1, "2.0": 3, "5.0": 4, "10.0": 5, "20.0": 6, "50.0": 7, "+Inf": 9}
    assert count == buckets["+Inf"] == 9 and total == 1130
    assert list(buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]  # rendered in order
    assert "# HELP vllm:request_prompt_tokens Number of prefill tokens processed.\n" in text
    assert "# TYPE vllm:request_prompt_tokens histogram\n" in text


def test_request_histograms_have_vllms_names_help_buckets_and_labels() -> None:
    text = render_metrics(MetricsSnapshot(), "m", requests=RequestMetrics())
    m = parse_metrics(text)
    helps = {
        "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
        "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
        "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
        "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    }
    for name, help_text in helps.items():
        assert f"# HELP {name} {help_text}\n# TYPE {name} histogram\n" in text
        buckets, count, total = _hist(m, name)
        assert count == total == 0 and set(buckets.values()) == {0}
    assert list(_hist(m, "vllm:time_to_first_token_seconds")[0])[:3] == ["0.001", "0.005", "0.01"]
    assert list(_hist(m, "vllm:time_to_first_token_seconds")[0])[-3:] == ["640.0", "2560.0", "+Inf"]
    assert list(_hist(m, "vllm:inter_token_latency_seconds")[0])[-2:] == ["80.0", "+Inf"]
    assert list(_hist(m, "vllm:e2e_request_latency_seconds")[0])[-3:] == ["1920.0", "7680.0", "+Inf"]
    # the token-count histograms wait for max_model_len
    assert not any(k[0].startswith("vllm:request_prompt_tokens") for k in m)
    # every sample of a histogram carries exactly vLLM's labels (model_name, engine; le on buckets)
    for (name, labels) in m:
        if name.startswith(tuple(helps)):
            keys = {k for k, _ in labels}
            assert keys == ({"engine", "model_name", "le"} if name.endswith("_bucket") else {"engine", "model_name"})


def test_bucket_bounds_of_a_million_token_context_are_written_as_prometheus_client_writes_them() -> None:
    req = RequestMetrics()
    req.bind(2_000_000)
    text = render_metrics(MetricsSnapshot(), "m", requests=req)
    assert 'le="500000.0"' in text and 'le="1e+06"' in text and 'le="2e+06"' in text


def test_request_timings_follow_vllms_per_output_and_per_finished_request_semantics() -> None:
    clock = _Clock()
    req = RequestMetrics(clock)
    req.start("a", prompt_tokens=7, max_model_len=100)
    clock.now = 0.2
    req.on_outputs([_Out("a", [1]), _Out("nobody", [9])])  # first output: TTFT 0.2; unknown ids ignored
    clock.now = 0.25
    req.on_outputs([_Out("a", [2])])  # ITL 0.05
    clock.now = 0.45
    req.on_outputs([_Out("a", [3, 4, 5])])  # a speculative step: one ITL (0.2), not one per token
    clock.now = 0.5
    req.finish("a", generation_tokens=5)
    assert req.time_to_first_token.count == 1 and req.time_to_first_token.sum == pytest.approx(0.2)
    assert req.inter_token_latency.count == 2 and req.inter_token_latency.sum == pytest.approx(0.25)
    assert req.e2e_latency.count == 1 and req.e2e_latency.sum == pytest.approx(0.5)
    # (last output - first output) / (generation tokens - 1)
    assert req.time_per_output_token.sum == pytest.approx((0.45 - 0.2) / 4)
    assert req.prompt_tokens is not None and req.prompt_tokens.sum == 7
    assert req.generation_tokens is not None and req.generation_tokens.sum == 5

    # One token: time per output token is 0, as vLLM observes it.
    req.start("one", 3, 100)
    clock.now = 0.6
    req.on_outputs([_Out("one", [1])])
    req.finish("one", 1)
    assert req.time_per_output_token.count == 2 and req.time_per_output_token.sum == pytest.approx(0.0625)

    # A request that ends without a finish (client gone): its TTFT stays, no finished-request observation.
    req.start("gone", 3, 100)
    clock.now = 0.7
    req.on_outputs([_Out("gone", [1])])
    req.discard("gone")
    req.finish("gone", 1)  # too late: ignored
    assert req.time_to_first_token.count == 3 and req.e2e_latency.count == 2
    assert req.generation_tokens.count == 2 and req.num_live == 0


def test_track_forgets_a_request_however_its_stream_ends() -> None:
    req = RequestMetrics()

    async def main() -> None:
        with pytest.raises(RuntimeError):
            async with req.track("x", 1, 10):
                assert req.num_live == 1
                raise RuntimeError("client gone")
        async with req.track("y", 1, 10):
            req.finish("y", 0)

    asyncio.run(main())
    assert req.num_live == 0 and req.e2e_latency.count == 1
