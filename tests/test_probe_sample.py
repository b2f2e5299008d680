"""Sampled probes (``probe_sample``): a probe drafts for a few requests, those its draft is least behind, and is
judged as the whole batch drafting as they did (core.capacity.CapacityManager.probe_sample_size)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_embedded_engine import TinyPair, make_engine, prompts

from dspark_cli.core.capacity import CapacityConfig, CapacityManager, choose_budget
from dspark_cli.core.saturation import PROBE_MARGIN, StepCharge
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.engines.vllm.config import settings_from_seed_keys
from dspark_cli.errors import DsparkError
from dspark_cli.serve_config import build_settings, ineffective_settings, prepare_embedded

# Verification that grows with the tokens, more slowly past 256; a draft pass that grows with the requests.
CURVE = SpsCurve.from_points([(16, 10.0), (64, 16.0), (256, 40.0), (2048, 60.0)], [(1, 1.0), (256, 3.0)], 0.5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@settings(max_examples=60, deadline=None)
@given(
    sample=st.integers(1, 6), copies=st.integers(2, 4), k=st.integers(1, 4), mode=st.sampled_from(["varlen", "mask"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_sample_is_priced_and_valued_as_the_whole_batch_drafting_alike(
    sample: int, copies: int, k: int, mode: str, seed: int
) -> None:
    # A batch of copies x sample requests whose first `sample` draft, each standing for `copies` requests: every Θ
    # and price equals that of the batch where every request drafts, as copies of the sample.
    rng = np.random.default_rng(seed)
    surv = np.cumprod(rng.uniform(0.05, 1.0, (sample, k)), axis=1)
    r = sample * copies
    sampled = np.ones((r, k))
    sampled[:sample] = surv
    drafts = np.zeros(r, dtype=np.int64)
    drafts[:sample] = k
    cfg = CapacityConfig(mode=mode, min_predicted_gain=0.0)
    got = choose_budget(sampled, drafts, r, r, CURVE, cfg, stands_for=float(copies))
    whole = np.tile(surv, (copies, 1))
    ref = choose_budget(whole, np.full(r, k), r, r, CURVE, CapacityConfig(mode="none"), max_budget=copies * got.budget)
    assert got.stands_for == copies and got.total_drafts == sample * k
    assert got.theta_all == pytest.approx(choose_budget(whole, np.full(r, k), r, r, CURVE, cfg).theta_all)
    assert got.theta_no_draft == pytest.approx(ref.theta_no_draft)
    if mode == "varlen":
        assert got.theta_best == pytest.approx(ref.theta_best) and got.step_ms == pytest.approx(ref.step_ms)
    else:  # the uniform batch computes every draft row of the whole batch, verified or not
        assert got.step_ms == pytest.approx(CURVE.step_cost_ms(r, r + r * k))


def test_stands_for_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="stands_for"):
        choose_budget(np.ones((2, 2)), np.full(2, 2), 2, 2, CURVE, CapacityConfig(mode="varlen"), stands_for=0.5)


def _manager(sample: int, mode: str = "varlen") -> CapacityManager:
    cfg = CapacityConfig(mode=mode, saturation_patience=1, resume_every=2, probe_sample=sample)
    return CapacityManager(cfg, CURVE, 4, 256, "cpu")


def _to_probe(mgr: CapacityManager, running: int) -> None:
    mgr.saturation.observe(False, num_running=running)  # one losing step pauses at patience 1
    for _ in range(64):
        if mgr.begin_step(running):
            assert mgr.probe_step
            return
    raise AssertionError("no probe came")


def test_only_a_probe_step_is_sampled_and_only_above_the_sample_size() -> None:
    mgr = _manager(32)
    assert mgr.begin_step(256) and not mgr.probe_step and mgr.probe_sample_size(256) == 256
    _to_probe(mgr, 256)
    assert mgr.probe_sample_size(256) == 32 and mgr.probe_sample_size(32) == 32 and mgr.probe_sample_size(20) == 20
    assert _manager(0).probe_sample_size(256) == 256


def test_a_sampled_probe_is_judged_as_the_whole_batch() -> None:
    # 32 of 256 requests draft 4 each and accept 3: the verdict counts 256 requests accepting 3 each, at the price
    # the decision put on the whole batch verifying 8x the sample's budget.
    r, n, k = 256, 32, 4
    mgr = _manager(n)
    _to_probe(mgr, r)
    slots = np.arange(r)
    sample = torch.arange(n)
    mgr.record_confidences(sample, torch.full((n, k), 0.9))
    drafts = np.zeros(r, dtype=np.int64)
    drafts[:n] = k
    decision = mgr.plan(slots, drafts, r, r, defer_saturation=True, stands_for=r / n)
    assert decision.budget == n * k and decision.stands_for == r / n
    assert decision.step_ms == pytest.approx(CURVE.step_cost_ms(r, r + r * k))
    mgr.record_outcome(r + n * 3)
    verdict = mgr.saturation.counters.last_probe
    assert verdict is not None and verdict.num_running == r and verdict.drafted == n
    line = verdict.describe()
    assert line.startswith("timer probe at 256 requests (32 drafting) paid: realized")
    # benchmarks/saturation_log.py reads these lines from served logs
    reader = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "saturation_log.py"))
    m = reader["PROBE"].search(f"saturation: {line}")
    assert m is not None and (m[2], m[3], m[4]) == ("256", "32", "paid")
    expected = (r + r * 3) / decision.step_ms / decision.theta_no_draft / PROBE_MARGIN
    assert verdict.realized == pytest.approx(expected)
    assert mgr.drafting_enabled  # 4x the tokens for ~1.4x the price: drafting resumes


def test_probe_sample_is_checked() -> None:
    with pytest.raises(DsparkError, match="probe_sample"):
        CapacityConfig(mode="varlen", probe_sample=-1)


# ------------------------------------------------------------------------------------- the embedded engine


@pytest.fixture(scope="module")
def reference(pair: TinyPair) -> list[list[int]]:
    return make_engine(pair, num_speculative_tokens=0).generate(prompts(6), GREEDY)


@pytest.mark.parametrize("mode", ["varlen", "mask"])
def test_greedy_identical_with_sampled_probes(pair: TinyPair, reference: list[list[int]], tmp_path: Path,
                                              mode: str) -> None:
    # A draft pass priced far above any gain: every probe fails, each drafting for 2 of the 6 requests.
    curve = SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 500.0), (8, 500.0)], 0.1).save(
        tmp_path / "curve.json")
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(curve),
                         capacity=CapacityConfig(mode=mode, saturation_patience=1, resume_every=2, probe_sample=2))
    assert engine.generate(prompts(6), GREEDY) == reference
    c = engine.capacity.saturation.counters
    assert c.pauses >= 1 and c.probe_steps >= 2


def test_a_sampled_probe_drafts_for_the_least_behind_and_the_resume_catches_the_rest_up(
    pair: TinyPair, tmp_path: Path
) -> None:
    # Synthetic acceptance near 1, verification nearly free and a cheap draft: the probe pays and drafting resumes.
    curve = SpsCurve.from_points([(1, 1.0), (256, 1.1)], [(1, 0.01), (8, 0.01)], 0.1).save(tmp_path / "curve.json")
    engine = make_engine(pair, draft=f"synthetic:probs=0.99/0.99/0.99,spread=0,draft={pair.draft}",
                         sps_curve=str(curve),
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=2, probe_sample=2))
    for i, prompt in enumerate(prompts(5)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()  # prefill
    calibrated: list[bool] = []
    record = engine.capacity.record_step_time

    def spy(drafting: bool, num_reqs: int, measured_ms: float, priced_ms: float | None = None,
            calibrate: bool = True, charge: StepCharge | None = None) -> None:
        if drafting:
            calibrated.append(calibrate)
        record(drafting, num_reqs, measured_ms, priced_ms, calibrate, charge)

    engine.capacity.record_step_time = spy  # type: ignore[method-assign]
    engine.capacity.saturation.observe(False, num_running=5)  # pause now
    running = list(engine.scheduler.running)
    while not engine.capacity.probe_step:
        before = {s.request_id: s.num_tokens - s.num_draft_computed for s in running}
        drafts_before = engine.stats.num_drafts
        engine.step()
    assert engine.stats.num_paused_steps > 0 and engine.stats.num_drafts - drafts_before == 2
    after = {s.request_id: s.num_tokens - s.num_draft_computed for s in running}
    # The probe drafted for 2 of the 5: the two its draft was least behind (ties: batch order) caught up ...
    order = [s.request_id for s in running]
    fed = sorted(before, key=lambda rid: (before[rid], order.index(rid)))[:2]
    assert all(after[rid] <= 2 for rid in fed)
    # ... and the other three fed nothing: one more token behind than before the probe.
    assert all(after[rid] == before[rid] + 1 for rid in before if rid not in fed)
    while engine.capacity.saturation.counters.last_probe is None:  # a light load's probe drafts a few steps
        engine.step()
    assert engine.capacity.drafting_enabled  # the sample paid
    drafts_before = engine.stats.num_drafts
    engine.step()  # the resume's first step drafts for all five and catches the other three up
    assert engine.stats.num_drafts - drafts_before == 5
    assert all(s.num_tokens - s.num_draft_computed <= 2 for s in running)
    # Both the probe and the catch-up step stay out of the step-time calibration; the next step counts. Each step's
    # time is reported by the step after it (LLMEngine._report_step_time).
    engine.step()
    assert calibrated[-1] is False
    engine.step()
    assert calibrated[-1] is True


def test_probe_sample_reaches_the_embedded_engine_and_is_refused_by_vllm() -> None:
    spec = {"dspark_capacity_verification_mode": "varlen", "dspark_sps_curve": [[1, 100.0], [64, 50.0]],
            "dspark_probe_sample": 32}
    s = build_settings({}, json.dumps(spec))
    assert s.probe_sample == 32 and s.dspark_keys()["dspark_probe_sample"] == 32
    launch = prepare_embedded(s)
    launch.cleanup()
    assert launch.engine_config.capacity.probe_sample == 32
    with pytest.raises(DsparkError, match="dspark_probe_sample: a setting of the embedded engine"):
        build_settings({"engine": "vllm"}, json.dumps(spec))
    with pytest.raises(DsparkError, match="dspark_probe_sample: a setting of dspark's embedded engine"):
        settings_from_seed_keys(spec)
    with pytest.raises(DsparkError, match="must be >= 0"):
        build_settings({}, json.dumps({**spec, "dspark_probe_sample": -2}))
    none = build_settings({}, json.dumps({"dspark_capacity_verification_mode": "none", "dspark_probe_sample": 8}))
    assert any("dspark_probe_sample" in w for w in ineffective_settings(none))
