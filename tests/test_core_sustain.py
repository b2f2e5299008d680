"""The saturation policy's sustained window: drafting that only breaks even pauses, drafting that pays goes on.

A step's verdict judges it by a short window against 1.0; beside it the sustained window must clear plain decoding
by ``sustain_margin`` once it has seen ``SUSTAIN_MEMORY`` request-steps (``SaturationPolicy``, "Break-even
drafting"). These tests feed ``observe_outcome`` realized ratios directly: a decision priced at 1 ms whose plain
decoding makes ``num_running`` tokens per ms, so ``emitted_tokens / num_running`` is the step's realized Θ over
plain decoding's.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_cli.core.capacity import BudgetDecision, CapacityConfig
from dspark_cli.core.saturation import PROBE_MARGIN, SUSTAIN_MARGIN, SUSTAIN_MEMORY, SaturationPolicy
from dspark_cli.engines.vllm.config import DsparkVllmSettings, settings_from_seed_keys
from dspark_cli.errors import DsparkError
from dspark_cli.serve_config import build_settings


def _drafting(num_running: int) -> BudgetDecision:
    """A step the curve says pays (so only the outcome decides), priced at 1 ms, plain decoding at R tokens/ms."""
    return BudgetDecision(budget=7 * num_running, theta_best=2.0 * num_running, theta_all=2.0 * num_running,
                          theta_no_draft=float(num_running), step_ms=1.0, total_drafts=7 * num_running)


def _run(pol: SaturationPolicy, ratios: np.ndarray, num_running: int) -> int | None:
    """Feed drafting steps realizing ``ratios``; the index of the step that paused drafting, or None."""
    decision = _drafting(num_running)
    for i, ratio in enumerate(ratios):
        assert pol.begin_step(num_running)
        pol.observe_outcome(decision, float(ratio) * num_running, num_running)
        if not pol.drafting_enabled:
            return i
    return None


def test_drafting_at_break_even_pauses_once_the_sustained_window_has_seen_enough() -> None:
    """Steps alternating 0.97x and 1.05x of plain decoding (1.01 on average) never lose ``patience`` steps in a
    row on the short window; the sustained window reads 1.01 < 1 + margin and pauses drafting, after it has seen
    ``SUSTAIN_MEMORY`` request-steps and ``patience`` more steps."""
    ratios = np.tile([0.97, 1.05], 500)
    short_only = SaturationPolicy(patience=8, resume_every=16, sustain_margin=0.0)
    assert _run(short_only, ratios, 64) is None and short_only.counters.unsustained_steps == 0
    pol = SaturationPolicy(patience=8, resume_every=16)
    assert pol.sustain_margin == SUSTAIN_MARGIN
    paused_at = _run(pol, ratios, 64)
    warm = SUSTAIN_MEMORY // 64
    assert paused_at is not None and warm - 1 <= paused_at <= warm + 8 + 2
    assert pol.counters.pauses == 1 and pol.counters.unsustained_steps >= 4
    assert pol.sustained_gain == pytest.approx(1.01, abs=0.01)


@pytest.mark.parametrize("seed", range(10))
def test_noisy_drafting_that_pays_is_judged_by_the_short_window_alone(seed: int) -> None:
    """At 16 requests a step's mean acceptance is noisy (~15% of the ratio, as on the scaled setup at temperature 1).
    Drafting that pays 1.08x reads 1.08 +- ~0.013 on the sustained window, so the margin never judges a step: the
    policy pauses (or not) exactly where the short window alone would, over 3,000 steps."""
    ratios = np.random.default_rng(seed).normal(1.08, 0.15, 3000).clip(0.2)
    pol = SaturationPolicy(patience=8, resume_every=16)
    paused_at = _run(pol, ratios, 16)
    assert pol.counters.unsustained_steps == 0
    assert paused_at == _run(SaturationPolicy(patience=8, resume_every=16, sustain_margin=0.0), ratios, 16)
    if paused_at is None:
        assert pol.sustained_gain is not None and pol.sustained_gain > 1 + SUSTAIN_MARGIN


def test_a_resume_starts_the_sustained_window_from_its_probe() -> None:
    """After a pause the window the pause came from is history: a probe that pays starts the sustained window from
    its own outcome, and the resumed drafting is not judged by it until it has seen ``SUSTAIN_MEMORY`` request-steps
    of its own."""
    pol = SaturationPolicy(patience=8, resume_every=4)
    assert _run(pol, np.full(200, 0.99), 64) is not None  # break-even: paused
    steps = 0
    while not pol.begin_step(64):
        steps += 1
    assert pol.probing and steps == 4 - 1
    pol.observe_outcome(_drafting(64), 1.2 * PROBE_MARGIN * 64, 64)  # the probe pays well
    assert pol.drafting_enabled and pol.sustained_gain == pytest.approx(1.2 * PROBE_MARGIN)
    # acceptance rose: drafting at 1.10 goes on, with the window warming up from the probe
    assert _run(pol, np.full(400, 1.10), 64) is None
    assert pol.sustained_gain == pytest.approx(1.10, abs=0.005)


def test_the_sustain_margin_is_validated_and_reaches_the_policy_from_every_config() -> None:
    for bad in (-0.01, 1.5, float("nan"), True, "0.03"):
        with pytest.raises(DsparkError, match="sustain_margin"):
            SaturationPolicy(patience=8, resume_every=16, sustain_margin=bad)  # type: ignore[arg-type]
        with pytest.raises(DsparkError, match="sustain_margin"):
            CapacityConfig(mode="varlen", sustain_margin=bad)  # type: ignore[arg-type]
    assert SaturationPolicy.from_config(CapacityConfig(mode="varlen", sustain_margin=0.05)).sustain_margin == 0.05
    # dspark serve's --speculative-config and the vLLM plugin's both take dspark_sustain_margin
    assert build_settings({}, '{"dspark_sustain_margin": 0}').sustain_margin == 0.0
    with pytest.raises(DsparkError, match="dspark_sustain_margin"):
        build_settings({}, '{"dspark_sustain_margin": 2}')
    spec = {"dspark_capacity_verification_mode": "varlen", "dspark_sustain_margin": 0.05}
    vllm = DsparkVllmSettings(**settings_from_seed_keys(spec, {"sps_curve": "c.json"}))
    assert vllm.capacity_config().sustain_margin == 0.05
    assert DsparkVllmSettings(mode="varlen").capacity_config().sustain_margin == SUSTAIN_MARGIN
    with pytest.raises(DsparkError, match="sustain_margin"):
        DsparkVllmSettings(mode="varlen", sustain_margin=-1.0)
