"""Synthetic drafter (speed-study mode): spec grammar, latent draws, the synthetic sampler, and the engine.

The engine runs the tiny random pair of test_embedded_engine on CPU with ``--draft synthetic:...`` around its
draft: acceptance must follow the configured decay (analytic expectation with ``spread=0``, Monte Carlo
otherwise), capacity pruning must cost exactly what the decay predicts, confidences must be miscalibrated but
informative, and STS fitted on the recorded traces must cut their calibration error.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import spearmanr
from test_embedded_engine import VOCAB, TinyPair, make_engine, prompts
from typer.testing import CliRunner

from dspark_cli.calibrate import run_calibration
from dspark_cli.cli import app
from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.core.layout import build_mask_layout, build_varlen_layout
from dspark_cli.core.rejection import sample
from dspark_cli.core.sps import SpsCurve
from dspark_cli.core.sts import ece
from dspark_cli.core.traces import read_traces
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.engines.embedded.shapes import SMALL_DRAFT_LAYERS
from dspark_cli.engines.embedded.synthetic import (
    SyntheticDrafter,
    SyntheticSpec,
    draw_synthetic,
    expected_accepted,
    is_synthetic,
    parse_synthetic,
    synthetic_rejection_sample,
)
from dspark_cli.errors import DsparkError

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)



def _survival(probs: list[float]) -> np.ndarray:
    return np.cumprod(np.asarray(probs, dtype=np.float64))


def _moments(survival: np.ndarray) -> tuple[float, float]:
    """Mean and variance of the accepted count A, from P(A >= k) = survival[k - 1]."""
    k = np.arange(1, len(survival) + 1)
    mean = float(survival.sum())
    return mean, float(((2 * k - 1) * survival).sum() - mean**2)


# -------------------------------------------------------------------------------------------- spec


def test_default_spec_has_the_v4_flash_shape() -> None:
    spec = parse_synthetic("synthetic")
    assert spec == SyntheticSpec()
    probs = spec.base_probs(7)
    assert probs[0] > 0.7 and probs[-1] < 0.1
    assert all(a > b for a, b in zip(probs, probs[1:], strict=False))
    assert spec.draft == "random:small" and spec.seed is None


def test_every_key_parses_and_draft_takes_the_rest() -> None:
    spec = parse_synthetic("Synthetic:first=0.9,decay=0.5,spread=0,temp=2,noise=0.1,seed=3,"
                           "draft=random:small:layers=2")
    assert (spec.first, spec.decay, spec.spread, spec.temp, spec.noise, spec.seed) == (0.9, 0.5, 0.0, 2.0, 0.1, 3)
    assert spec.draft == "random:small:layers=2"
    assert spec.base_probs(3) == pytest.approx([0.9, 0.45, 0.225])
    assert parse_synthetic("synthetic:draft=/models/a,b=c").draft == "/models/a,b=c"
    last = parse_synthetic("synthetic:first=0.8,last=0.05").base_probs(5)
    assert last[0] == pytest.approx(0.8) and last[-1] == pytest.approx(0.05)
    assert parse_synthetic("synthetic:probs=0.9/0.5/0.2").base_probs(2) == [0.9, 0.5]
    assert is_synthetic("synthetic:first=0.8") and is_synthetic(" SYNTHETIC ")
    assert not is_synthetic("synthetics") and not is_synthetic("random:small") and not is_synthetic(None)


@pytest.mark.parametrize("text, fragment", [
    ("synthetic:first=1.5", "first must be in (0, 1]"),
    ("synthetic:first=0", "first must be in (0, 1]"),
    ("synthetic:decay=-1", "decay must be in (0, 1]"),
    ("synthetic:decay=abc", "not a number"),
    ("synthetic:temp=0", "temp must be > 0"),
    ("synthetic:noise=-0.1", "noise must be >= 0"),
    ("synthetic:spread=nan", "spread must be >= 0"),
    ("synthetic:foo=1", "unknown key 'foo'"),
    ("synthetic:first", "is not KEY=VALUE"),
    ("synthetic:first=0.8,first=0.7", "first is given twice"),
    ("synthetic:decay=0.5,last=0.1", "decay= or last="),
    ("synthetic:first=0.5,last=0.9", "exceeds first"),
    ("synthetic:probs=0.5/1.2", "probs must be in (0, 1]"),
    ("synthetic:probs=0.5,first=0.9", "drop first"),
    ("synthetic:seed=-1", "seed must be a non-negative integer"),
    ("synthetic:seed=1.5", "seed must be a non-negative integer"),
    ("synthetic:draft=", "draft= needs a model name"),
    ("synthetic:draft=synthetic", "must name a real draft model"),
    ("synthetic:draft=none", "must name a real draft model"),
    ("random:small", "not a synthetic draft spec"),
])
def test_malformed_specs_are_one_line_errors(text: str, fragment: str) -> None:
    with pytest.raises(DsparkError) as info:
        parse_synthetic(text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_engine_config_refuses_a_probs_list_shorter_than_k() -> None:
    with pytest.raises(DsparkError, match="probs= gives 2 positions but K=3"):
        EngineConfig(model="tiny", draft="synthetic:probs=0.9/0.5", num_speculative_tokens=3).validate()
    with pytest.raises(DsparkError, match="unknown key"):
        EngineConfig(model="tiny", draft="synthetic:bogus=1").validate()
    EngineConfig(model="tiny", draft="synthetic:probs=0.9/0.5", num_speculative_tokens=2).validate()


def test_cli_refuses_a_bad_spec_before_loading_anything() -> None:
    result = CliRunner().invoke(app, ["serve", "--draft", "synthetic:temp=-1"])
    assert isinstance(result.exception, DsparkError), result.output
    assert "temp must be > 0" in str(result.exception)
    result = CliRunner().invoke(app, ["serve", "--draft", "synthetic:draft=/no/such/draft"])
    assert isinstance(result.exception, DsparkError) and "/no/such/draft" in str(result.exception)
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--draft", "synthetic", "--dry-run"])
    assert isinstance(result.exception, DsparkError) and "embedded engine's speed-study" in str(result.exception)


# -------------------------------------------------------------------------------------------- draws


def test_confidences_are_miscalibrated_but_rank_the_latent_acceptance() -> None:
    spec = SyntheticSpec()  # temp 0.5 (overconfident), noise 0.3, spread 1
    k = 7
    base = torch.logit(torch.tensor(spec.base_probs(k)))
    gen = torch.Generator().manual_seed(0)
    draw = draw_synthetic(base, 40_000, spec, gen)
    latent, conf, accept = draw.latent.numpy(), draw.confidence.numpy(), draw.accept.numpy()
    for j in range(k):
        assert spearmanr(latent[:, j], conf[:, j]).statistic > 0.9
        assert spearmanr(conf[:, j], accept[:, j]).statistic > 0.1  # informative about the outcome itself
        assert accept[:, j].mean() == pytest.approx(latent[:, j].mean(), abs=0.015)
    eces = [ece(conf[:, j], accept[:, j]) for j in range(k)]
    assert min(eces) > 0.04
    # Undoing the temperature (what STS fits) leaves only the noise's miscalibration.
    fixed = torch.sigmoid(torch.logit(draw.confidence) * spec.temp).numpy()
    assert max(ece(fixed[:, j], accept[:, j]) for j in range(k)) < 0.02
    # Survival of the drawn latents matches the Monte Carlo expectation the engine logs.
    assert np.cumprod(latent, axis=1).mean(axis=0).sum() == pytest.approx(expected_accepted(spec, k)[-1], abs=0.02)


def test_without_spread_or_noise_everything_is_deterministic() -> None:
    spec = parse_synthetic("synthetic:first=0.8,decay=0.7,spread=0,noise=0,temp=2")
    base = torch.logit(torch.tensor(spec.base_probs(4)))
    draw = draw_synthetic(base, 5, spec, torch.Generator().manual_seed(1))
    assert torch.allclose(draw.latent, torch.tensor(spec.base_probs(4)).expand(5, 4))
    assert torch.allclose(draw.confidence, torch.sigmoid(base / 2).expand(5, 4))
    assert expected_accepted(spec, 4).tolist() == pytest.approx(np.r_[0, np.cumsum(_survival(spec.base_probs(4)))])


# -------------------------------------------------------------------------------------------- sampler


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_synthetic_sampler_accepts_the_admitted_prefix_of_draws(data: st.DataObject) -> None:
    num_reqs = data.draw(st.integers(1, 4))
    k = data.draw(st.integers(1, 4))
    mode = data.draw(st.sampled_from(["varlen", "mask"]))
    sampled = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    admitted = torch.randint(0, k + 1, (num_reqs,), generator=g)
    accept = torch.rand(num_reqs, k, generator=g) < 0.7
    drafts = torch.randint(0, 16, (num_reqs, k), generator=g)
    last = torch.randint(0, 16, (num_reqs,), generator=g)
    start = torch.randint(0, 8, (num_reqs,), generator=g)
    if mode == "varlen":
        layout = build_varlen_layout(last, drafts, admitted, start, num_reqs + int(admitted.sum()) + 2)
    else:
        layout = build_mask_layout(last, drafts, admitted, start)
    logits = torch.randn(layout.num_rows, 16, generator=g)
    temperature = torch.tensor([0.0] + [1.0] * (num_reqs - 1)) if sampled else None
    uniforms = torch.rand(layout.num_rows, 2, generator=g)
    out = synthetic_rejection_sample(logits, layout, drafts, admitted, accept, temperature, None, uniforms)
    for r in range(num_reqs):
        n = 0
        while n < int(admitted[r]) and bool(accept[r, n]):
            n += 1
        assert int(out.num_accepted[r]) == n and int(out.num_emitted[r]) == n + 1  # pruned: never accepted
        row = [t for t in range(layout.num_rows)
               if not layout.is_padding[t] and layout.req_index[t] == r and layout.pos_in_req[t] == n]
        assert len(row) == 1
        want = sample(logits[row], None if temperature is None else temperature[r:r + 1], None, uniforms[row, 1])
        assert out.tokens[r, :n].tolist() == drafts[r, :n].tolist()
        assert int(out.tokens[r, n]) == int(want[0])
        assert (out.tokens[r, n + 1:] == -1).all()


# -------------------------------------------------------------------------------------------- engine


def _spec(pair: TinyPair, **keys: object) -> str:
    body = ",".join(f"{k}={v}" for k, v in keys.items())
    return f"synthetic:{body + ',' if body else ''}draft={pair.draft}"


def _capacity(mode: str, **kw: object) -> CapacityConfig:
    # Mask mode prunes a dense model's uniform batch only under a budget cap (pruning saves nothing there).
    if mode == "mask":
        kw.setdefault("budget_frac", 0.5)
    return CapacityConfig(mode=mode, saturation_patience=0, **kw)  # type: ignore[arg-type]


def test_mean_acceptance_matches_the_analytic_expectation(pair: TinyPair) -> None:
    k = 7
    engine = make_engine(pair, draft=_spec(pair, spread=0), num_speculative_tokens=k, max_model_len=256)
    assert isinstance(engine.runner.drafter, SyntheticDrafter)
    engine.generate(prompts(64), GREEDY)
    s = engine.stats
    n = s.num_drafts
    survival = _survival(SyntheticSpec().base_probs(k))  # E[accepted] = sum_k prod_{j<=k} a_j
    mean, var = _moments(survival)
    assert n > 1000
    assert s.num_verified_draft_tokens == s.num_draft_tokens == n * k
    assert abs(s.num_accepted_tokens / n - mean) < 4.5 * math.sqrt(var / n)
    for i in range(k):
        p = survival[i]
        assert abs(s.accepted_per_pos[i] / n - p) < 4.5 * math.sqrt(p * (1 - p) / n) + 1e-3


@pytest.mark.parametrize("mode", ["none", "mask", "varlen"])
def test_graph_replay_path_draws_the_same_acceptance_as_eager(pair: TinyPair, mode: str) -> None:
    """The CUDA-graph plumbing (static buffers, padded sizes, the captured draft loop), run eagerly on CPU:
    same drafts, same draws, same outputs as the eager path, in every capacity mode."""
    runs = []
    for emulate in (False, True):
        engine = make_engine(pair, draft=_spec(pair), num_speculative_tokens=4, capacity=_capacity(mode),
                             sps_curve=str(pair.curve), max_model_len=256)
        if emulate:
            engine.runner.emulate_graphs()
            assert isinstance(engine.runner.drafter, SyntheticDrafter)
        runs.append((engine.generate(prompts(8), GREEDY), engine.stats.num_accepted_tokens,
                     engine.stats.num_verified_draft_tokens, engine.stats.num_draft_tokens))
    assert runs[0] == runs[1]
    _, accepted, verified, drafted = runs[0]
    assert 0 < accepted < verified
    assert (verified < drafted) == (mode != "none")


def test_acceptance_with_spread_matches_the_monte_carlo_expectation(pair: TinyPair) -> None:
    k = 5
    spec = parse_synthetic(_spec(pair, first=0.9, decay=0.75, spread=1.5))
    engine = make_engine(pair, draft=_spec(pair, first=0.9, decay=0.75, spread=1.5), num_speculative_tokens=k,
                         max_model_len=256)
    engine.runner.emulate_graphs()
    engine.generate(prompts(48), GREEDY)
    s = engine.stats
    expect = expected_accepted(spec, k)[-1]
    # Variance of A is at most that of a run with the mean survival; 5 sigmas of that bound.
    _, var = _moments(np.diff(expected_accepted(spec, k)))
    assert abs(s.num_accepted_tokens / s.num_drafts - expect) < 5 * math.sqrt(var / s.num_drafts)


@pytest.mark.parametrize("mode", ["mask", "varlen"])
def test_pruning_costs_acceptance_exactly_as_the_decay_predicts(pair: TinyPair, mode: str, tmp_path: Path) -> None:
    """Deterministic confidences (no spread, no noise) and a survival threshold: settled requests verify
    two of four drafts. Each step's expected acceptance given v verified drafts is sum_{k<=v} prod a_j."""
    k = 4
    traces = tmp_path / "traces.jsonl"
    engine = make_engine(
        pair, draft=_spec(pair, spread=0, noise=0), num_speculative_tokens=k, max_model_len=256,
        capacity=_capacity(mode, policy="threshold", threshold=0.5), sps_curve=str(pair.curve),
        record_traces=str(traces),
    )
    engine.generate(prompts(48), GREEDY)
    engine.close()
    _, verified, accepted = read_traces([traces]).arrays()
    expect_by_v = expected_accepted(SyntheticSpec(spread=0), k)
    survival = _survival(SyntheticSpec().base_probs(k))
    assert np.all(accepted <= verified)  # pruned drafts are never accepted
    assert np.mean(verified == 2) > 0.8 and verified.mean() < 0.75 * k
    predicted = expect_by_v[verified].mean()
    # Per-row variance given v, from the same survival curve.
    var = np.mean([_moments(survival[:v])[1] if v else 0.0 for v in verified])
    assert abs(accepted.mean() - predicted) < 4.5 * math.sqrt(var / len(verified))
    assert accepted.mean() < expect_by_v[k] - 0.1  # and that is clearly less than verifying everything
    s = engine.stats
    assert s.num_verified_draft_tokens == int(verified.sum()) and s.num_accepted_tokens == int(accepted.sum())


def test_sts_fitted_on_recorded_traces_cuts_the_calibration_error(pair: TinyPair, tmp_path: Path) -> None:
    traces = tmp_path / "traces.jsonl"
    engine = make_engine(pair, draft=_spec(pair), num_speculative_tokens=4, max_model_len=256,
                         record_traces=str(traces))
    engine.generate(prompts(64), GREEDY)
    engine.close()
    res = run_calibration([traces], tmp_path / "sts.json", bins=10)
    fit = res.fit
    before = np.nanmean(fit.ece_before[:3])
    after = np.nanmean(fit.ece_after[:3])
    assert fit.ece_before[0] > 0.04 and after < 0.6 * before
    assert 1.4 < fit.temperatures[0] < 3.0  # near 1 / temp = 2
    assert fit.auc[0] > 0.6  # informative: better than the position average
    assert json.loads((tmp_path / "sts.json").read_text())["temperatures"][0] == pytest.approx(fit.temperatures[0])


def test_online_sts_and_sampling_requests_run_in_synthetic_mode(pair: TinyPair) -> None:
    engine = make_engine(pair, draft=_spec(pair), num_speculative_tokens=4, max_model_len=256, online_sts=True,
                         capacity=_capacity("varlen"), sps_curve=str(pair.curve))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=48, ignore_eos=True)
    out = engine.generate(prompts(64), params)
    assert all(len(o) == 48 for o in out)
    assert all(0 <= t < VOCAB for o in out for t in o)
    temps = engine.online_sts.temperatures.tolist()
    assert temps[0] > 1.3  # the online fit moves toward 1 / temp = 2 from its prior of 1
    assert 0 < engine.stats.num_accepted_tokens <= engine.stats.num_verified_draft_tokens


def test_default_draft_is_a_small_random_model_and_start_up_warns(
    pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="dspark.embedded"):
        engine = make_engine(pair, draft="synthetic", num_speculative_tokens=3)
    drafter = engine.runner.drafter
    assert isinstance(drafter, SyntheticDrafter)
    assert drafter.model.args.num_layers == SMALL_DRAFT_LAYERS
    assert drafter.model.args.hidden_size == engine.runner.target.args.hidden_size
    assert any("speed-study mode, never for real outputs" in r.getMessage() for r in caplog.records)
    assert len(engine.generate(prompts(2), GREEDY)[0]) == GREEDY.max_tokens
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dspark.embedded"):
        plain = make_engine(pair, draft="synthetic", num_speculative_tokens=0)
    assert plain.runner.drafter is None and not caplog.records


def test_profile_sps_prices_the_draft_model_the_synthetic_drafter_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "curve.json"
    result = CliRunner().invoke(app, [
        "profile-sps", "tiny", "--draft", "synthetic:draft=random:small:layers=1", "-k", "3", "--device", "cpu",
        "--max-num-seqs", "2", "--max-model-len", "128", "--context-len", "16", "--warmup", "1", "--replays", "5",
        "--overhead-ms", "0", "--output", str(out),
    ])
    assert result.exit_code == 0, result.output
    curve = SpsCurve.load(out)
    assert [n for n, _ in curve.draft_ms] == [1, 2] and all(ms > 0 for _, ms in curve.draft_ms)


# -------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_and_no_host_sync_in_the_synthetic_step(pair: TinyPair) -> None:
    k = 7
    engine = make_engine(pair, draft=_spec(pair, spread=0), num_speculative_tokens=k, device="cuda",
                         dtype="float32", max_model_len=256, capacity=_capacity("varlen"), sps_curve=str(pair.curve))
    assert engine.runner.capture_sizes  # graphs captured
    engine.generate(prompts(32), GREEDY)
    assert 0 < engine.stats.num_accepted_tokens <= engine.stats.num_verified_draft_tokens
    # The draws and the sampler themselves never synchronise with the host.
    spec = SyntheticSpec()
    base = torch.logit(torch.tensor(spec.base_probs(k), device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    drafts = torch.randint(0, 16, (4, k), device="cuda")
    admitted = torch.tensor([0, 3, 7, 5], device="cuda")
    layout = build_varlen_layout(torch.zeros(4, dtype=torch.int64, device="cuda"), drafts, admitted,
                                 torch.zeros(4, dtype=torch.int64, device="cuda"), 32)
    logits = torch.randn(layout.num_rows, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        draw = draw_synthetic(base, 4, spec, gen)
        synthetic_rejection_sample(logits, layout, drafts, admitted, draw.accept)
        synthetic_rejection_sample(logits, layout, drafts, admitted, draw.accept,
                                   torch.ones(4, device="cuda"), None, torch.rand(layout.num_rows, 2, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
