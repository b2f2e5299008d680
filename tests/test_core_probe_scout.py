"""Probe scouts (``probe_scout``): a probe's first step drafts and verifies nothing, and the probe is judged from
the step planned on the confidences the scout recorded (core.saturation.SaturationPolicy, "Scouts")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_cli.core.capacity import SCOUT_PRICE, BudgetDecision, CapacityConfig, CapacityManager
from dspark_cli.core.saturation import SaturationPolicy
from dspark_cli.core.sps import SpsCurve
from dspark_cli.errors import DsparkError

R, K = 16, 4
# Verification costs by the token: 16 requests with every draft verified (80 tokens) cost ~3.6x a plain step.
CURVE = SpsCurve.from_points([(16, 10.0), (32, 16.0), (64, 28.0), (128, 52.0)], [(1, 1.0), (64, 1.0)], 0.5)


def _manager(scout: bool, patience: int = 2, curve: SpsCurve = CURVE) -> CapacityManager:
    cfg = CapacityConfig(mode="varlen", policy="argmax", saturation_patience=patience, resume_every=4,
                         probe_scout=scout)
    return CapacityManager(cfg, curve, K, R, "cpu")


def _run(mgr: CapacityManager, conf: float, accepted: int, steps: int) -> list[tuple[str, BudgetDecision | None]]:
    """Engine steps as the embedded engine takes them (begin, record, plan, outcome); every request accepts
    ``accepted`` of what it verifies. Returns each step's kind and decision (None: paused)."""
    slots = np.arange(R)
    out: list[tuple[str, BudgetDecision | None]] = []
    for _ in range(steps):
        if not mgr.begin_step(R):
            out.append(("paused", None))
            continue
        kind = "scout" if mgr.saturation.scouting else mgr.saturation.step_kind
        mgr.record_confidences(torch.from_numpy(slots), torch.full((R, K), conf))
        decision = mgr.plan(slots, np.full(R, K), R, R, defer_saturation=True)
        admitted = mgr.allocate(torch.from_numpy(slots), torch.full((R,), K), decision.budget).numpy()
        mgr.record_outcome(R + int(np.minimum(admitted, accepted).sum()))
        out.append((kind, decision))
    return out


def _pause(mgr: CapacityManager) -> None:
    """Confidences of 0.05: the budget verifies nothing, and drafting pauses after ``patience`` steps."""
    _run(mgr, 0.05, 0, 4)
    assert not mgr.drafting_enabled


def test_a_scout_verifies_nothing_and_the_probe_plans_on_what_it_recorded() -> None:
    # The pause came from confidences since recovered (0.95, and drafts are accepted): the scout verifies nothing
    # and is not judged; the next step plans on the scout's 0.95s, verifies drafts, pays, and drafting resumes.
    mgr = _manager(scout=True)
    _pause(mgr)
    steps = [s for s in _run(mgr, 0.95, K, 8) if s[0] != "paused"]
    (k0, scout), (k1, judged) = steps[:2]
    assert k0 == "scout" and scout is not None and scout.scout and scout.budget == 0 and not scout.pays
    assert k1 == "probe" and judged is not None and not judged.scout and judged.budget > 0
    assert mgr.drafting_enabled
    c = mgr.saturation.counters
    assert c.probes["timer", "paid"] == 1 and c.scout_steps == 1 and c.probe_steps == 2


def test_where_fresh_confidences_say_nothing_pays_the_probe_fails_without_verifying_a_draft() -> None:
    # Still 0.05: without a scout every probe plans on unknown confidences (1) and verifies all 64 drafts, at
    # ~3.6x a plain step; with one, the judged step plans on the scout's 0.05s and verifies none.
    verified: dict[bool, list[int]] = {}
    for scout in (False, True):
        mgr = _manager(scout)
        _pause(mgr)
        steps = _run(mgr, 0.05, 0, 40)
        verified[scout] = [d.budget for kind, d in steps if d is not None]
        c = mgr.saturation.counters
        assert c.probes["timer", "failed"] >= 2 and c.probes["timer", "paid"] == 0
        assert not mgr.drafting_enabled
        assert c.scout_steps == (c.probe_steps // 2 if scout else 0)
    assert verified[False] and all(b == R * K for b in verified[False])
    assert verified[True] and all(b == 0 for b in verified[True])
    # A failed probe backs the timer off by how far short it fell: one that verified all 64 drafts at ~3.6x a plain
    # step fell further than a scout's judged step, which verified none, so the scouts' probes are at least as many
    assert len(verified[True]) >= 2 * len(verified[False])


def test_where_verifying_every_draft_is_nearly_free_a_probe_does_not_scout() -> None:
    # A light load: verifying 80 tokens costs 1.2x verifying 16. One probe step is cheaper than two, and the probe
    # runs as it does without scouts (its plan verifies every draft and is judged).
    light = SpsCurve.from_points([(16, 10.0), (128, 12.0)], [(1, 1.0), (64, 1.0)], 0.5)
    mgr = _manager(scout=True, curve=light)
    _run(mgr, 0.05, 0, 2)
    mgr.saturation.observe(False, num_running=R)  # paused: the light curve alone would keep drafting
    assert not mgr.drafting_enabled
    steps = [s for s in _run(mgr, 0.05, 0, 8) if s[0] != "paused"]
    kind, probe = steps[0]
    assert kind == "scout" and probe is not None  # the policy allowed it; the price said no
    assert not probe.scout and probe.budget == R * K and probe.step_ms < SCOUT_PRICE * light.step_cost_ms(R, R)
    assert mgr.saturation.counters.scout_steps == 0 and mgr.saturation.counters.probes["timer", "failed"] == 1


def test_a_scout_is_no_verdict_for_the_policy() -> None:
    pol = SaturationPolicy(patience=1, resume_every=2, probe_scout=True)
    pol.observe(False, num_running=8)  # pauses
    assert not pol.begin_step(8) and pol.begin_step(8)  # the timer's probe, after 2 paused steps
    assert pol.scouting and pol.probing and pol.step_kind == "probe"
    scout = BudgetDecision(0, 1.0, 1.0, 1.0, 10.0, 32, 10.0, scout=True)
    assert not pol.observe_outcome(scout, emitted_tokens=8, num_running=8)
    pol.observe(scout, num_running=8)
    assert pol.probing and not pol.drafting_enabled and pol.counters.probes["timer", "failed"] == 0
    assert pol.realized_gain is None  # nor a sample of the window
    assert pol.begin_step(8) and not pol.scouting and pol.probing  # the probe goes on to its judged step


def test_a_probe_scouts_only_on_its_first_step_and_only_when_asked() -> None:
    for scout in (False, True):
        pol = SaturationPolicy(patience=1, resume_every=2, probe_scout=scout)
        pol.observe(False, num_running=4)
        kinds = [(pol.begin_step(4), pol.scouting) for _ in range(4)]
        assert kinds == [(False, False), (True, scout), (True, False), (True, False)]


def test_scouts_are_refused_in_mask_mode_and_never_run_without_a_capacity_manager() -> None:
    with pytest.raises(DsparkError, match="probe_scout needs capacity mode varlen"):
        CapacityConfig(mode="mask", probe_scout=True)
    mgr = CapacityManager(CapacityConfig(mode="none", saturation_patience=1, resume_every=1, probe_scout=True),
                          CURVE, K, R, "cpu")
    _run(mgr, 0.05, 0, 8)
    assert mgr.saturation.counters.scout_steps == 0 and mgr.drafting_enabled


def test_probe_scout_must_be_a_bool() -> None:
    with pytest.raises(DsparkError, match="probe_scout must be true or false"):
        CapacityConfig(mode="varlen", probe_scout="yes")  # type: ignore[arg-type]
