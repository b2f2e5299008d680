"""Step stalls: the StallWatch's counts, their /metrics series and bench cells, and -- on CUDA -- that nothing
compiles once an engine serves, however long the saturation pauses that its probes catch up on."""

from __future__ import annotations

import gc
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_embedded_engine import TinyPair, make_engine, prompts

from dspark_cli.bench.metrics import dspark_counter_delta, dspark_counters, parse_prometheus
from dspark_cli.bench.report import build_table, to_markdown
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.embedded.metrics import MetricsSnapshot, parse_metrics, render_metrics
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.engines.embedded.stalls import StallWatch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _knobs():  # type: ignore[no-untyped-def]
    knobs = pytest.importorskip("triton").knobs
    if not hasattr(knobs, "runtime") or not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this triton has no compile hooks")
    return knobs.runtime


def _compile_hooks(runtime, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """Call the installed hooks the way Triton's JIT does around one compile (a CPU has no backend to compile)."""
    assert not runtime.jit_cache_hook(**kwargs)
    runtime.jit_post_compile_hook(**kwargs)


def test_watch_counts_compiles_by_phase_and_step_and_warns_only_while_serving(caplog: pytest.LogCaptureFixture) -> None:
    runtime = _knobs()
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    watch = StallWatch().install()
    try:
        _compile_hooks(runtime, repr="_k[num_warps=4](x: *fp32)", fn=None)
        watch.start_serving()
        watch.step_kind = "probe"
        with caplog.at_level(logging.WARNING, logger="dspark.embedded"):
            _compile_hooks(runtime, repr="_attn[num_warps=4](q: *bf16)", fn=None)
        c = watch.counters
        assert c.compiles == {"startup": 1, "serving": 1} and c.compiles_by_step == {"probe": 1}
        assert c.compile_ms["serving"] >= 0.0
        assert len(caplog.records) == 1 and "_attn while serving (a probe step" in caplog.text
    finally:
        watch.close()
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == before


def test_watch_chains_the_hook_it_found_and_keeps_a_later_one_working() -> None:
    runtime = _knobs()
    saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    seen: list[str] = []

    def earlier(**kwargs: object) -> bool:
        seen.append("earlier")
        return True  # "skip this compile": Triton must still hear it through our hook

    try:
        runtime.jit_cache_hook = earlier
        first = StallWatch().install()
        second = StallWatch().install()
        assert runtime.jit_cache_hook(repr="k", fn=None) is True and seen == ["earlier"]
        first.close()  # not on top: its slot stays, forwarding
        assert runtime.jit_cache_hook(repr="k", fn=None) is True and seen == ["earlier"] * 2
        runtime.jit_post_compile_hook(repr="k", fn=None)
        assert first.counters.compiles["startup"] == 0 and second.counters.compiles["startup"] == 1
        second.close()
        assert runtime.jit_cache_hook == second._prev_pre  # back to what second found: first's forwarder
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_watch_times_full_collections_only() -> None:
    watch = StallWatch().install()
    try:
        gc.collect(0)
        assert watch.counters.full_gcs == 0
        gc.collect()
        assert watch.counters.full_gcs == 1 and watch.counters.full_gc_ms > 0.0
    finally:
        watch.close()
    gc.collect()
    assert watch.counters.full_gcs == 1


def test_a_ctrl_c_that_lands_in_a_gc_callback_is_not_lost() -> None:
    """Python reports an exception raised in a GC callback as unraisable and goes on: a Ctrl-C landing in the
    watch's callback was dropped, and `dspark profile-sps` ran to its end. The watch delivers it again."""

    def interrupted(phase: str, info: dict) -> None:
        if phase == "stop":
            raise KeyboardInterrupt  # as the signal handler raises it at the callback's first instruction

    before = sys.unraisablehook
    # The re-sent Ctrl-C (_thread.interrupt_main) runs the main thread's SIGINT handler: Python's default raises
    # KeyboardInterrupt. One left behind by other code in this process would take it instead.
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    watch = StallWatch().install()
    hook = sys.unraisablehook
    gc.callbacks.append(interrupted)
    try:
        try:
            gc.collect()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the interrupt comes again a moment later (REINTERRUPT_S)
                pass
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail(f"no KeyboardInterrupt within 10 s (SIGINT handler found: {found!r}; unraisable hook at "
                        f"install {hook!r}, now {sys.unraisablehook!r})")
    finally:
        gc.callbacks.remove(interrupted)
        watch.close()
        signal.signal(signal.SIGINT, found)
    assert sys.unraisablehook is before  # closed: the hook it found is back


def test_engine_counts_its_compiles_and_exports_them(pair: TinyPair) -> None:
    engine = make_engine(pair, draft=str(pair.draft_head))
    assert engine.stalls.serving and engine.stats.stalls is engine.stalls.counters
    engine.generate(prompts(2), SamplingParams(temperature=0.0, max_tokens=4))
    gc.collect()
    text = render_metrics(MetricsSnapshot.from_stats(engine.stats), "tiny", engine.num_spec)
    m = parse_metrics(text)
    for phase in ("startup", "serving"):
        assert (("dspark:kernel_compiles_total", (("engine", "0"), ("model_name", "tiny"), ("phase", phase)))) in m
    assert m[("dspark:gc_full_collections_total", (("engine", "0"), ("model_name", "tiny")))] >= 1
    assert m[("dspark:gc_full_collection_seconds_total", (("engine", "0"), ("model_name", "tiny")))] > 0.0
    # the bench's view of the same text: prefix and source labels dropped, phases kept
    counters = dspark_counters(parse_prometheus(text))
    assert counters["kernel_compiles{phase=serving}"] == 0.0 and counters["gc_full_collections"] >= 1
    assert "kv_blocks_free" not in counters  # a gauge: no delta
    engine.close()
    assert engine.stalls._on_gc not in gc.callbacks  # close() unhooked it


def test_dspark_counter_delta_and_the_bench_table_report_compiles_per_cell() -> None:
    before = {"kernel_compiles{phase=serving}": 2.0, "gc_full_collection_seconds": 0.5}
    after = {"kernel_compiles{phase=serving}": 5.0, "kernel_compile_seconds{phase=serving}": 0.75,
             "gc_full_collection_seconds": 0.5}
    delta = dspark_counter_delta(before, after)
    assert delta == {"gc_full_collection_seconds": 0.0, "kernel_compile_seconds{phase=serving}": 0.75,
                     "kernel_compiles{phase=serving}": 3.0}

    def cell(config: str, counters: dict[str, float]) -> dict:
        return {"config": config, "concurrency": 16, "metrics": {"output_tok_s": 100.0}, "server_counters": counters}

    md = to_markdown(build_table([cell("none", {}), cell("varlen", delta)]))
    assert "Varlen + SPS at c=16: 3 compiles, 0.75 s" in md
    assert "Kernel compiles" not in to_markdown(build_table([cell("none", {}), cell("varlen", {})]))


def test_attention_warm_up_is_a_noop_where_the_torch_path_runs() -> None:
    from dspark_cli.engines.embedded.triton_attention import warm_up_paged_attention

    cache = torch.zeros(4, 16, 2, 64)
    assert warm_up_paged_attention(8, 64, cache, cache, 8) == 0


@pytest.mark.parametrize("heads, kv_heads, dim, max_blocks, fp32", [
    (9, 3, 64, 129, False),    # SmolLM2-135M, max_model_len 2048
    (32, 8, 128, 257, False),  # Llama-3-8B, 4096
    (4, 2, 16, 33, False),     # the tiny test pair
    (9, 3, 64, 129, True),
])
@pytest.mark.parametrize("sms", [132, 80, 8])
def test_attention_warm_up_variants_cover_every_plan_the_planner_picks(
    heads: int, kv_heads: int, dim: int, max_blocks: int, fp32: bool, sms: int
) -> None:
    """The warm-up compiles exactly the set of variants that any batch shape can ask for: a sweep of request
    counts and rows per request (decode, verify, catch-up, prefill) never plans outside it."""
    pytest.importorskip("triton")
    from dspark_cli.engines.embedded import triton_attention as ta

    variants = ta.attention_variants(heads, dim, kv_heads, 16, max_blocks, sms, fp32)
    warmed = {ta._compiled_key(ta._plan(1, heads, dim, kv_heads, 16, 1, max_blocks, sms, fp32, block_m=bm,
                                        num_splits=sp)) for bm, sp in variants}
    assert len(warmed) == len(variants)
    seen = set()
    for reqs in (1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 256):
        for per_req in (1, 2, 4, 8, 16, 31, 32, 33, 65, 129, 300, 1000):
            seen.add(ta._compiled_key(ta._plan(reqs * per_req, heads, dim, kv_heads, 16, reqs, max_blocks, sms,
                                               fp32)))
    assert seen <= warmed
    assert len(seen) >= len(warmed) // 2  # the sweep reaches most of them: the set is not padded


@pytest.mark.gpu
@CUDA
def test_attention_warm_up_covers_every_shape_serving_can_launch() -> None:
    """Prefill-like and catch-up-like batches (many rows per request, every split count the planner picks)
    compile nothing after the warm-up."""
    from dspark_cli.engines.embedded import triton_attention as ta

    heads, kv_heads, dim, page, max_blocks = 9, 3, 64, 16, 129
    k = torch.randn(512, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    assert ta.warm_up_paged_attention(heads, dim, k, v, max_blocks) == 8

    def compiled() -> int:
        return sum(len(c[0]) for kern in (ta._paged_attn_kernel, ta._merge_splits_kernel)
                   for c in kern.device_caches.values())

    before = compiled()
    g = torch.Generator().manual_seed(0)
    for reqs, rows_per_req in ((1, 1), (1, 150), (3, 40), (16, 65), (16, 8), (64, 1), (256, 8), (7, 129)):
        lens = torch.randint(rows_per_req, 2000, (reqs,), generator=g).clamp(max=max_blocks * page)
        tables = torch.randint(0, 512, (reqs, max_blocks), generator=g, dtype=torch.int32).cuda()
        qsl = torch.arange(0, reqs + 1, dtype=torch.int32, device="cuda") * rows_per_req
        q = torch.randn(reqs * rows_per_req, heads, dim, device="cuda", dtype=torch.bfloat16)
        ta.paged_attention_varlen(q, k, v, tables, lens.to(torch.int32).cuda(), qsl, dim ** -0.5)
    torch.cuda.synchronize()
    assert compiled() == before


_SERVE_SCRIPT = """
import json, sys
from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.sequence import SamplingParams
import torch

target, draft, curve = sys.argv[1:4]
engine = LLMEngine(EngineConfig(model=target, draft=draft, num_speculative_tokens=3, device="cuda",
                                dtype="bfloat16", max_num_seqs=8, max_model_len=512, block_size=16, seed=0,
                                sps_curve=curve, capacity=CapacityConfig(mode="varlen", saturation_patience=1,
                                                                         resume_every=2)))
g = torch.Generator().manual_seed(0)
for i in range(8):
    prompt = torch.randint(3, engine.vocab_size, (6 + 25 * i,), generator=g).tolist()
    engine.add_request(f"r{i}", prompt, SamplingParams(temperature=float(i % 2), max_tokens=300, ignore_eos=True,
                                                        seed=i if i % 4 == 1 else None))
lag = 0
while engine.has_unfinished_requests():
    lag = max([lag] + [s.num_tokens - s.num_draft_computed for s in engine.scheduler.running])
    engine.step()
c = engine.stats.stalls
print(json.dumps({"compiles": c.compiles, "by_step": c.compiles_by_step, "lag": lag,
                  "probes": engine.stats.num_drafts, "paused": engine.stats.num_paused_steps}))
"""


@pytest.mark.gpu
@CUDA
def test_nothing_compiles_while_serving_across_saturation_pauses(pair: TinyPair, tmp_path: Path) -> None:
    """A fresh process (an empty in-process kernel cache, as a server starts): prefills of many lengths,
    greedy, sampled and seeded requests, and probes whose catch-up spans pauses of up to 64 steps -- the
    watch sees compiles at start-up and none while serving."""
    curve = tmp_path / "expensive_draft.json"
    SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 500.0), (8, 500.0)], 0.1).save(curve)
    out = subprocess.run([sys.executable, "-c", _SERVE_SCRIPT, str(pair.target), str(pair.draft_head), str(curve)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["paused"] > 0 and res["probes"] > 0 and res["lag"] > 32, res  # long catch-ups did run
    assert res["compiles"]["startup"] > 0, res  # the hook sees real compiles
    serving = "\n".join(line for line in out.stderr.splitlines() if "while serving" in line)
    assert res["compiles"]["serving"] == 0, f"{res}\n{serving}"  # a string: pytest prints it whole


def test_saturation_evidence_is_exported_as_gauges_and_kept_per_cell(pair: TinyPair, tmp_path: Path) -> None:
    """The policy's evidence -- drafting over plain cost relative to the curve per load, and the realized
    gain -- reaches /metrics as gauges, which the bench keeps as end-of-cell values (never deltas)."""
    from dspark_cli.bench.metrics import dspark_gauges
    from dspark_cli.core.capacity import CapacityConfig

    curve = tmp_path / "expensive_draft.json"  # drafting never pays: it pauses at once, then probes
    SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 500.0), (8, 500.0)], 0.1).save(curve)
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(curve),
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=2))
    engine.generate(prompts(4), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stats = engine.stats
    assert stats.num_paused_steps > 0 and stats.num_drafts > 0  # timed drafting and plain steps at one load
    assert stats.drafting_cost_scale and stats.realized_gain is not None
    text = render_metrics(MetricsSnapshot.from_stats(stats), "tiny", engine.num_spec)
    m = parse_metrics(text)
    for bucket, value in stats.drafting_cost_scale.items():
        lo, hi = 1 << (bucket - 1), (1 << bucket) - 1
        label = str(lo) if lo == hi else f"{lo}-{hi}"
        assert m[("dspark:drafting_cost_scale", (("engine", "0"), ("load", label), ("model_name", "tiny")))] == pytest.approx(value)
    assert m[("dspark:saturation_realized_gain", (("engine", "0"), ("model_name", "tiny")))] == pytest.approx(stats.realized_gain)
    assert stats.sustained_gain is not None  # the saturation policy's long window, beside it
    assert m[("dspark:saturation_sustained_gain", (("engine", "0"), ("model_name", "tiny")))] == pytest.approx(
        stats.sustained_gain)
    gauges = dspark_gauges(parse_prometheus(text))
    assert {"saturation_realized_gain", "saturation_sustained_gain", "kv_blocks_free"} <= set(gauges)
    assert not any(k.startswith("kernel_compiles") for k in gauges)  # counters are deltas, not gauges
    engine.close()


def test_what_the_saturation_policy_did_reaches_metrics_as_counters(pair: TinyPair, tmp_path: Path) -> None:
    """Pauses, resumes, probe steps, probes held back by the probe tax and probes by (trigger, verdict), and
    steps by kind: /metrics counts them as the policy and the engine did, and a bench cell's counters see them."""
    from dspark_cli.bench.metrics import dspark_counters
    from dspark_cli.core.capacity import CapacityConfig
    from dspark_cli.core.saturation import PROBE_TRIGGERS, PROBE_VERDICTS

    curve = tmp_path / "expensive_draft.json"
    SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 500.0), (8, 500.0)], 0.1).save(curve)
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(curve),
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=2))
    engine.generate(prompts(4), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    sat = engine.capacity.saturation.counters
    assert sat.pauses >= 1 and sat.probe_steps > 0 and sum(sat.probes.values()) > 0
    text = render_metrics(MetricsSnapshot.from_stats(engine.stats), "tiny", engine.num_spec)
    m = parse_metrics(text)
    base = (("engine", "0"), ("model_name", "tiny"))
    prefills = m[("dspark:steps_total", (("engine", "0"), ("kind", "prefill"), ("model_name", "tiny")))]
    assert prefills == engine.stats.num_prefill_steps >= 1
    assert m[("dspark:saturation_pauses_total", base)] == sat.pauses
    assert m[("dspark:saturation_resumes_total", base)] == sat.resumes
    assert m[("dspark:saturation_probe_steps_total", base)] == sat.probe_steps
    assert m[("dspark:saturation_scout_steps_total", base)] == sat.scout_steps
    assert m[("dspark:saturation_unsustained_steps_total", base)] == sat.unsustained_steps
    assert m[("dspark:saturation_deferred_probe_steps_total", base)] == sat.deferred_probe_steps
    assert m[("dspark:saturation_unmeasured_probe_steps_total", base)] == sat.unmeasured_probe_steps
    assert m[("dspark:saturation_rising_probe_steps_total", base)] == sat.rising_probe_steps
    for t in PROBE_TRIGGERS:
        for v in PROBE_VERDICTS:
            key = ("dspark:saturation_probes_total", (("engine", "0"), ("model_name", "tiny"), ("trigger", t), ("verdict", v)))
            assert m[key] == sat.probes[t, v]
    # Steps by kind, and their wall time: every step is counted once, under the kind it ran as.
    stats = engine.stats
    assert sum(stats.steps.values()) == stats.num_prefill_steps + stats.num_decode_steps
    assert stats.steps["prefill"] == stats.num_prefill_steps and stats.steps["paused"] == stats.num_paused_steps
    assert stats.steps["probe"] == sat.probe_steps and stats.steps["nospec"] == 0
    for kind, n in stats.steps.items():
        assert m[("dspark:steps_total", (("engine", "0"), ("kind", kind), ("model_name", "tiny")))] == n
        seconds = m[("dspark:step_seconds_total", (("engine", "0"), ("kind", kind), ("model_name", "tiny")))]
        assert seconds == pytest.approx(stats.step_ms[kind] / 1e3) and (seconds > 0) == (n > 0)
    counters = dspark_counters(parse_prometheus(text))
    assert counters["saturation_probe_steps"] == sat.probe_steps
    assert counters["steps{kind=paused}"] == stats.num_paused_steps
    assert counters["saturation_probes{trigger=timer,verdict=failed}"] == sat.probes["timer", "failed"]
    engine.close()
    assert "dspark:step_phase_seconds_total" not in text  # phase timing is off by default
    # An engine without a capacity manager has no policy to report: no saturation series at all.
    assert "dspark:saturation_" not in render_metrics(MetricsSnapshot(), "tiny", 0)


def test_phase_timing_from_the_config_is_exported_by_step_kind_and_phase(pair: TinyPair, tmp_path: Path) -> None:
    """``dspark serve --phase-timing host``: the engine splits every step into its phases and the metrics
    carry them per (kind, phase), so a served benchmark can tell host work from waiting on the device."""
    from dspark_cli.core.capacity import CapacityConfig

    curve = tmp_path / "expensive_draft.json"
    SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 500.0), (8, 500.0)], 0.1).save(curve)
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(curve), phase_timing="host",
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=2))
    engine.generate(prompts(4), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    stats = engine.stats
    assert stats.steps["paused"] > 0 and stats.steps["prefill"] > 0
    text = render_metrics(MetricsSnapshot.from_stats(stats), "tiny", engine.num_spec)
    counters = dspark_counters(parse_prometheus(text))
    engine.close()
    paused = {key: v for key, v in counters.items() if key.startswith("step_phase_seconds{kind=paused,")}
    assert set(paused) == {f"step_phase_seconds{{kind=paused,phase={ph}}}"
                           for ph in ("prepare", "layout", "verify", "reject", "sync", "emit")}
    # The phases of a kind add up to (a little less than) its steps' wall time: one clock, nothing twice.
    assert 0.5 * stats.step_ms["paused"] / 1e3 < sum(paused.values()) <= stats.step_ms["paused"] / 1e3
    assert counters["step_phase_seconds{kind=prefill,phase=forward}"] > 0
    assert counters["step_phase_seconds{kind=any,phase=schedule}"] > 0
    from dspark_cli.bench.report import step_phases

    means = step_phases(counters)
    assert list(means["paused"]) == ["prepare", "layout", "verify", "reject", "sync", "emit"]
