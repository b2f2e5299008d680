"""The dspark manager class on CPU, over a stand-in of vLLM's base manager.

vLLM cannot be imported here, so ``build_manager_class`` gets a stand-in base that sets exactly the state
the contract table says upstream's ``AdaptiveVerificationManager.__init__`` sets (checked against the wheel
by the contract tests), and stand-ins for the three vLLM helpers it imports. The decisions themselves --
budget from the core's choose_budget, allocation by the core's allocate, varlen/mask layouts, saturation,
online STS -- are the real code on real CPU tensors.
"""

from __future__ import annotations

import contextlib
import logging
import runpy
import sys
import types
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from dspark_cli.core.saturation import PLAIN_SAMPLE_EVERY
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.vllm import contract
from dspark_cli.engines.vllm.config import DsparkVllmSettings

K = 4


class StaleSlot:
    def __init__(self, r: int) -> None:
        self.np = np.ones((r, K), dtype=np.float32)


class Base:
    """Stand-in for upstream's manager: the attributes of the contract's self_attr row, on CPU."""

    def __init__(self, req_states, query_start_loc, num_bonus_tokens, max_total_logits,
                 copy_admitted_drafts_to_host=False) -> None:
        self.req_states = req_states
        self.num_speculative_steps = req_states.num_speculative_steps
        self.num_bonus_tokens = num_bonus_tokens
        self._max_total_logits = max_total_logits
        self.query_start_loc = query_start_loc
        self.cost_tables = None
        self._cudagraph_limit = 0
        self._batch_budget = None
        r = req_states.max_num_reqs
        self._confidence_probs = torch.ones(r, K)
        self._batch_draft_capacity = torch.zeros(r, dtype=torch.int32)
        self._num_non_draft_tokens = torch.zeros(r, dtype=torch.int32)
        self._cu_num_logits = torch.zeros(r + 1, dtype=torch.int32)
        self._stale_confidences = [StaleSlot(r), StaleSlot(r)]
        self._stale_idx = 0
        self._copy_stream = None
        self._copy_admitted_drafts_to_host = copy_admitted_drafts_to_host

    def add_request(self, req_idx: int) -> None:
        self._confidence_probs[req_idx] = 1.0

    def record_confidences(self, confidence_probs, input_batch) -> None:
        n = input_batch.num_reqs
        self._confidence_probs[input_batch.idx_mapping] = confidence_probs[:n]
        self._stale_confidences[self._stale_idx].np[:] = self._confidence_probs.numpy()

    def batches_to_profile(self, capture_sizes):
        return iter([{"num_tokens": s} for s in capture_sizes])

    def compact_batch(self, num_draft_tokens_per_req, num_scheduled_tokens, cu_num_logits_np):
        """Upstream's, for the budgets the tests reach: every draft (nothing moves) or none (exact counts)."""
        _, _, budget = self._batch_budget
        if budget == int(num_draft_tokens_per_req.sum()):
            return num_scheduled_tokens, cu_num_logits_np
        assert budget == 0, "the stand-in compacts only a budget of 0"
        n = num_scheduled_tokens.shape[0]
        return (num_scheduled_tokens - num_draft_tokens_per_req,
                np.arange(n + 1, dtype=cu_num_logits_np.dtype) * self.num_bonus_tokens)


def _assert_base_matches_contract() -> None:
    row = contract.lookup(contract.AV, "AdaptiveVerificationManager.__init__", "self_attr")
    rs = types.SimpleNamespace(num_speculative_steps=K, max_num_reqs=2, device="cpu")
    base = Base(rs, torch.zeros(3, dtype=torch.int32), 1, 100)
    assert all(hasattr(base, a) for a in row.params)


@pytest.fixture
def manager_cls(monkeypatch: pytest.MonkeyPatch):
    _assert_base_matches_contract()
    tp = types.SimpleNamespace(world_size=1, rank_in_group=0)
    stand = {
        "vllm": types.ModuleType("vllm"),
        "vllm.envs": types.SimpleNamespace(VLLM_MOE_SKIP_PADDING=True),
        "vllm.distributed.parallel_state": types.SimpleNamespace(get_tp_group=lambda: tp),
        "vllm.utils.torch_utils": types.SimpleNamespace(
            async_tensor_h2d=lambda data, out: out.copy_(torch.as_tensor(data, dtype=out.dtype))),
        "vllm.v1.worker.gpu.spec_decode.adaptive_verification": types.SimpleNamespace(AdmittedDraftCounts=object),
    }
    stand["vllm"].envs = stand["vllm.envs"]
    for name, mod in stand.items():
        monkeypatch.setitem(sys.modules, name, mod)
    from dspark_cli.engines.vllm import manager

    manager.build_manager_class.cache_clear()
    yield manager.build_manager_class(Base)
    manager.build_manager_class.cache_clear()


def _make(manager_cls, mode: str, r: int = 3, moe: bool = True, curve: SpsCurve | None = None, slots: int = 8,
          **settings_kw):
    """A manager over ``slots`` request slots. ``moe``: the model skips padding rows (MoE under the stand-in's
    VLLM_MOE_SKIP_PADDING), so mask mode may trim; a dense model's mask mode verifies whole batches. ``curve``:
    the SPS curve (default: flat until 8 tokens, steep after)."""
    rs = types.SimpleNamespace(
        num_speculative_steps=K, max_num_reqs=slots, max_num_batched_tokens=256, device=torch.device("cpu"),
        req_id_to_index={f"r{i}": i for i in range(r)},
        num_computed_tokens_np=np.full(slots, 100), prefill_len=types.SimpleNamespace(np=np.full(slots, 10)),
    )
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
                                model_config=types.SimpleNamespace(is_moe=moe))
    # Flat until 8 tokens, steep after: verifying more than a handful of drafts does not pay.
    if curve is None:
        curve = SpsCurve.from_points([(4, 10.0), (8, 10.0), (16, 40.0), (32, 80.0)], [(1, 5.0), (8, 5.0)],
                                     capture_sizes=[4, 8, 16, 32])
    settings = DsparkVllmSettings(mode=mode, sps_curve=curve.to_dict(), **settings_kw)
    m = manager_cls(settings=settings, mode=mode, vllm_config=cfg, req_states=rs,
                    query_start_loc=torch.zeros(slots + 1, dtype=torch.int32), num_bonus_tokens=1,
                    max_total_logits=10_000)
    list(m.batches_to_profile([4, 8, 16, 32]))
    m.set_initial_cost_curves([])
    return m


def _fake_clock(m, now: list[float]) -> None:
    """Time the manager's steps and its log period by ``now[0]`` seconds (a host clock the test advances)."""
    from dspark_cli.engines.vllm.step_clock import HostClock, StepIntervals

    m._clock = lambda: now[0]
    m._intervals = StepIntervals(HostClock(lambda: now[0]))


def _record(m, conf: list[list[float]]) -> None:
    n = len(conf)
    batch = types.SimpleNamespace(num_reqs=n, idx_mapping=torch.arange(n))
    m.record_confidences(torch.tensor(conf), batch)


def test_varlen_budget_allocation_and_layout(manager_cls) -> None:
    m = _make(manager_cls, "varlen")
    _record(m, [[0.9, 0.9, 0.9, 0.9], [0.9, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]])
    per_req = {"r0": 1 + K, "r1": 1 + K, "r2": 1 + K}
    drafts = {x: [0] * K for x in per_req}
    tokens = m.get_num_tokens(per_req, drafts)
    budget = m._batch_budget[2]
    assert tokens == 3 + budget and 0 < budget < 3 * K
    cu, qsl, got_budget, admitted = m.reallocate_drafts(["r0", "r1", "r2"], torch.arange(3))
    caps = m._batch_draft_capacity[:3].tolist()
    assert got_budget == budget and sum(caps) == budget and admitted is None
    assert caps[0] >= caps[1] >= caps[2]  # best survival first
    assert cu.tolist() == [0, *np.cumsum(np.asarray(caps) + 1).tolist()]
    assert qsl[:4].tolist() == cu.tolist() and int(qsl[-1]) == tokens


def test_varlen_admits_exactly_the_budget_the_runner_is_told(manager_cls) -> None:
    """The runner sizes the verify batch by the host budget, with no sync: the device allocation must admit
    exactly that many drafts. The budget comes from a step-old copy of the confidences, the allocation from
    this step's, and the allocation never admits a zero-survival slot: when this step's confidences are 0
    (vLLM's acceptance estimator passed through without STS, whose sigmoid keeps them above 0), it admitted
    none of a budget of 5 and the query_start_loc fell short of the batch: the likely cause of the
    device-side index assert that ended a server on the H200 (docs/PERFORMANCE.md section 14)."""
    m = _make(manager_cls, "varlen")
    _record(m, [[0.9] * K] * 3)
    per_req = {f"r{i}": 1 + K for i in range(3)}
    m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
    budget = m._batch_budget[2]
    assert budget == 5  # the flat part of the curve: 3 + 5 tokens cost what 3 do
    m._confidence_probs[:3] = 0.0  # this step's confidences, after the budget was chosen
    _, qsl, told, _ = m.reallocate_drafts(list(per_req), torch.arange(3))
    caps = m._batch_draft_capacity[:3]
    assert told == budget and int(caps.sum()) == budget
    assert int(qsl[3]) == 3 + budget


def test_the_allocation_follows_the_runners_request_order(manager_cls) -> None:
    """get_num_tokens sees the scheduler's order; reallocate_drafts gets the runner's, which may differ."""
    per_req = {"r0": 1 + K, "r1": 1 + K, "r2": 3 + K}  # r2 carries a prompt chunk of 3 tokens
    drafts = {"r0": [0] * K, "r1": [0] * 2, "r2": [0] * K}
    caps = []
    for order in (["r0", "r1", "r2"], ["r2", "r0", "r1"]):
        m = _make(manager_cls, "varlen")
        _record(m, [[0.95] * K, [0.6] * K, [0.3] * K])  # by slot: r0 > r1 > r2
        m.get_num_tokens(per_req, drafts)
        _, qsl, _, _ = m.reallocate_drafts(order, torch.tensor([int(x[1]) for x in order]))
        got = dict(zip(order, m._batch_draft_capacity[:3].tolist(), strict=True))
        assert [int(m._sched_gpu[i]) for i in range(3)] == [len(drafts[x]) for x in order]
        lens = np.diff(qsl[:4].numpy()).tolist()
        assert lens == [got[x] + per_req[x] - len(drafts[x]) for x in order]
        caps.append(got)
    assert caps[0] == caps[1]


def test_a_paused_varlen_step_gets_the_layout_the_allocation_would_build(manager_cls) -> None:
    """A paused step's placeholder drafts are verified by none: it keeps the query starts the runner copied
    from the host (upstream's compact_batch: the non-draft counts for a budget of 0) and sets one logit row
    per request, which must equal what the device allocation builds for a budget of 0 (prompt chunks
    included)."""
    per_req = {"r0": 1 + K, "r1": 9 + K, "r2": 1 + K}  # r1 carries a prompt chunk of 9 tokens
    drafts = {x: [0] * K for x in per_req}
    layouts = []
    for real in (True, False):
        m = _make(manager_cls, "varlen")
        _record(m, [[0.0] * K] * 3)  # no survival: the allocation's budget is 0 too
        m._drafts_real = real
        assert m.get_num_tokens(per_req, drafts) == 11 and m._batch_budget[2] == 0
        m.query_start_loc.fill_(11)  # what prepare_inputs copies from the host before the allocation
        m.query_start_loc[:4] = torch.tensor([0, 1, 10, 11], dtype=torch.int32)
        m._cu_num_logits.fill_(-1)
        cu, qsl, told, admitted = m.reallocate_drafts(list(per_req), torch.arange(3))
        layouts.append((cu.tolist(), qsl.tolist(), told, admitted))
        assert m._verify_pending[3] is real
    assert layouts[0] == layouts[1]
    assert layouts[1][0] == [0, 1, 2, 3] and layouts[1][1][:4] == [0, 1, 10, 11] and set(layouts[1][1][4:]) == {11}


def test_mask_keeps_the_uniform_layout_and_pads_pruned_rows(manager_cls) -> None:
    m = _make(manager_cls, "mask")
    _record(m, [[0.9, 0.9, 0.9, 0.9], [0.9, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]])
    per_req = {"r0": 1 + K, "r1": 1 + K, "r2": 1 + K}
    assert m.get_num_tokens(per_req, {x: [0] * K for x in per_req}) == 3 * (K + 1)
    m.query_start_loc[:4] = torch.tensor([0, 5, 10, 15], dtype=torch.int32)
    cu, qsl, total, _ = m.reallocate_drafts(["r0", "r1", "r2"], torch.arange(3))
    assert total == 3 * K and cu.tolist() == [0, 5, 10, 15]
    caps = m._batch_draft_capacity[:3].clone()
    batch = types.SimpleNamespace(
        query_start_loc=qsl[:4], num_tokens=15, input_ids=torch.arange(1, 16), is_padding=torch.zeros(15, dtype=torch.bool),
        expanded_local_pos=torch.arange(5).repeat(3), cu_num_logits=cu)
    m.apply_mask(batch)
    pruned = [j >= int(caps[r]) for r in range(3) for j in [-1, 0, 1, 2, 3]]
    assert batch.is_padding.tolist() == pruned
    assert [int(x) == 0 for x in batch.input_ids] == pruned
    invalid = getattr(batch, contract.INVALID_DRAFTS_ATTR)
    assert invalid.tolist() == [p > int(caps[r]) for r in range(3) for p in range(5)]


def test_mask_mode_of_a_dense_model_verifies_whole_batches(manager_cls) -> None:
    """Pruning a dense model's uniform batch saves nothing; the same confidences that trim an MoE's do not."""
    conf = [[0.9, 0.9, 0.9, 0.9], [0.9, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]]
    per_req = {"r0": 1 + K, "r1": 1 + K, "r2": 1 + K}
    caps = {}
    for moe in (True, False):
        m = _make(manager_cls, "mask", moe=moe)
        assert m.cfg.mask_pruning_saves is moe
        _record(m, conf)
        m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
        m.reallocate_drafts(["r0", "r1", "r2"], torch.arange(3))
        caps[moe] = m._batch_draft_capacity[:3].tolist()
    assert min(caps[True]) < K and caps[False] == [K, K, K]


def test_mask_mode_hands_the_estimator_rejections_censored_by_what_was_verified(manager_cls) -> None:
    m = _make(manager_cls, "mask")
    _record(m, [[0.9, 0.9, 0.9, 0.9], [0.9, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]])
    per_req = {"r0": 1 + K, "r1": 1 + K, "r2": 1 + K}
    m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
    m.reallocate_drafts(["r0", "r1", "r2"], torch.arange(3))
    caps = m._batch_draft_capacity[:3].long()
    assert int(caps.min()) < K  # something was pruned
    # every admitted draft accepted: the runner's uniform layout reports the pruned tail as rejected
    num_sampled = caps + 1
    num_rejected = K - caps
    seen = m.verified_rejections(num_sampled, num_rejected)
    assert seen.tolist() == [0, 0, 0]  # nothing verified was rejected; the pruned tail is censored
    # a real rejection inside the admitted prefix stays one
    num_sampled = torch.ones(3, dtype=torch.long)  # first draft rejected everywhere
    seen = m.verified_rejections(num_sampled, torch.full((3,), K))
    assert seen.tolist() == [min(K, int(c)) for c in caps]
    # varlen counts over compacted logits already: passed through untouched
    v = _make(manager_cls, "varlen")
    x = torch.tensor([3, 1, 0])
    assert v.verified_rejections(torch.ones(3, dtype=torch.long), x) is x


def test_a_flat_startup_profile_verifies_every_draft_instead_of_refusing(manager_cls) -> None:
    m = _make(manager_cls, "varlen")
    m._user_curve = None  # no --sps-curve: vLLM's start-up profile prices the steps
    S = types.SimpleNamespace
    flat = [S(num_target_tokens=t, forward_ms=10.0, drafter_ms=1.0, num_reqs=min(t, 8), full_cudagraph=True)
            for t in (4, 8, 16, 32)]
    m.set_initial_cost_curves(flat)
    assert m._verify_all
    _record(m, [[0.01] * K] * 3)  # hopeless confidences would trim everything with a rising curve
    per_req = {f"r{i}": 1 + K for i in range(3)}
    assert m.get_num_tokens(per_req, {x: [0] * K for x in per_req}) == 3 * (1 + K)


class ExecuteModelState(NamedTuple):
    """The two fields of vLLM's ExecuteModelState the saturation hook reads (a NamedTuple there too)."""

    input_batch: Any
    num_spec_tokens_to_schedule: int


def _step_state(r: int, scheduled: int = K) -> Any:
    batch = types.SimpleNamespace(num_reqs=r, idx_mapping_np=np.arange(r), num_tokens=r * (1 + scheduled), num_draft_tokens=r * scheduled)
    return types.SimpleNamespace(execute_model_state=ExecuteModelState(batch, scheduled))


def test_saturation_pauses_drafting_by_scheduling_zero_drafts_and_probes_back(manager_cls) -> None:
    m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
    m._pause_supported = True  # what attach() sets for a DFlash-family or draft_model speculator
    per_req = {f"r{i}": 1 + K for i in range(3)}
    drafts = {x: [0] * K for x in per_req}

    def step(conf: float, accepted: int) -> int:
        """One runner step: budget (execute_model), verification outcome, then the drafting decision
        (sample_tokens). The outcome is judged by the saturation policy one step later."""
        if m._drafts_real:
            _record(m, [[conf] * K] * 3)
        m.get_num_tokens(per_req, drafts)
        verified = m._batch_budget is not None and m._drafts_real
        if verified:
            m.reallocate_drafts(list(per_req), torch.arange(3))
        runner = _step_state(3)
        m.begin_drafting_step(runner)  # vLLM: before sample_tokens, which observes the outcome
        if verified:
            m.observe(torch.full((3,), 1 + accepted, dtype=torch.int32))
        return runner.execute_model_state.num_spec_tokens_to_schedule

    # confidences so low the budget is 0: no step pays; the verdicts arrive one step late
    scheduled = [step(0.01, 0) for _ in range(4)]
    assert scheduled[:2] == [K, K] and 0 in scheduled  # paused after `patience` judged steps
    assert not m._drafts_real
    # placeholder drafts (async scheduling) are never verified while paused
    assert m.get_num_tokens(per_req, drafts) == 3 and m._batch_budget[2] == 0
    # paused steps, then a probe drafts (it continues until its outcome is judged)
    while (n := step(0.01, 0)) == 0:
        pass
    assert n == K and m.saturation.probing and m._drafts_real
    # the probe's drafts are confident and all accepted: it pays, drafting resumes for good
    while m.saturation.probing:
        step(0.99, K)
    assert m.saturation.drafting_enabled
    assert [step(0.99, K) for _ in range(3)] == [K, K, K]


def _upstream_record_confidences(self, confidence_probs, input_batch) -> None:
    """Upstream's double buffer: budgets read the snapshot before the latest (its copy has landed)."""
    ready = self._stale_idx ^ 1
    self._stale_idx, write = ready, self._stale_idx
    n = input_batch.num_reqs
    self._confidence_probs[input_batch.idx_mapping] = confidence_probs[:n]
    self._stale_confidences[write].np[:] = self._confidence_probs.numpy()


def _probe_run(manager_cls, monkeypatch, probe_conf: float, accepted: int, **settings_kw) -> tuple[list, Any]:
    """Pause on confidences of 0.01 (upstream's double buffer), then run a probe whose drafts have ``probe_conf``
    and accept ``accepted`` each: every verified batch's (probing, scout, budget, pays) until it is judged."""
    monkeypatch.setattr(Base, "record_confidences", _upstream_record_confidences)
    m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3, **settings_kw)
    m._pause_supported = True
    per_req = {f"r{i}": 1 + K for i in range(3)}
    drafts = {x: [0] * K for x in per_req}
    batches = []

    def step(conf: float, accepted: int) -> int:
        if m._drafts_real:
            _record(m, [[conf] * K] * 3)
        m.get_num_tokens(per_req, drafts)
        verified = m._batch_budget is not None and m._drafts_real
        if verified:
            d = m._step_decision
            batches.append((m.saturation.probing, d.scout, m._batch_budget.budget, d.pays))
            m.reallocate_drafts(list(per_req), torch.arange(3))
        runner = _step_state(3)
        m.begin_drafting_step(runner)
        if verified:
            m.observe(torch.full((3,), 1 + accepted, dtype=torch.int32))
        return runner.execute_model_state.num_spec_tokens_to_schedule

    while m.saturation.drafting_enabled:
        step(0.01, 0)
    while step(0.01, 0) == 0:  # paused until a probe drafts
        pass
    batches.clear()
    while m.saturation.probing:
        step(probe_conf, accepted)
    return batches, m


def test_a_probe_is_not_planned_on_the_confidences_that_paused_drafting(manager_cls, monkeypatch) -> None:
    # The budget reads the snapshot before the latest: on a probe's verification that is the last one before
    # the pause. Confidences of 0.01 paused drafting; the probe's own are 0.99, and its first verification
    # planned on 0.01: priced as not paying, where a probe of one step is then judged failed.
    batches, m = _probe_run(manager_cls, monkeypatch, 0.99, K)
    assert batches and batches[0][0] and batches[0][3], batches  # planned as paying, as the probe's drafts do
    assert m.saturation.drafting_enabled


def _scout_run(manager_cls, monkeypatch, probe_conf: float, accepted: int) -> tuple[list, Any]:
    """:func:`_probe_run` with ``probe_scout`` on, verification priced by the token as at a heavy load: a probe's
    plan on unknown confidences verifies all 12 drafts, at ~3x a batch that verifies none
    (core.capacity.SCOUT_PRICE)."""
    curve = SpsCurve.from_points([(1, 3.0), (32, 34.0)], [(1, 0.5), (8, 0.5)])
    return _probe_run(manager_cls, monkeypatch, probe_conf, accepted, probe_scout=True, curve=curve)


def test_a_scout_verifies_nothing_and_the_probe_plans_on_its_confidences(manager_cls, monkeypatch) -> None:
    # probe_scout: the batch that verifies the scout's drafts verifies none and is not judged; the next plans on
    # the scout's 0.99s (the stale snapshot by then), pays, and drafting resumes.
    batches, m = _scout_run(manager_cls, monkeypatch, 0.99, K)
    assert batches[0] == (True, True, 0, False), batches
    assert batches[1][1:] == (False, batches[1][2], True) and batches[1][2] > 0, batches
    assert m.saturation.drafting_enabled and m.saturation.counters.scout_steps == 1


def test_a_scouted_probe_where_drafting_still_loses_verifies_no_draft(manager_cls, monkeypatch) -> None:
    # Still 0.01: without a scout the probe planned on unknown confidences and verified all 12 drafts; with one,
    # the judged batches plan on the scout's 0.01s, verify none, and the probe fails.
    batches, m = _scout_run(manager_cls, monkeypatch, 0.01, 0)
    assert [scout for _, scout, _, _ in batches][:2] == [True, False], batches
    assert all(budget == 0 and not pays for _, _, budget, pays in batches), batches
    assert not m.saturation.drafting_enabled and m.saturation.counters.probes["timer", "failed"] == 1


def test_probe_scout_acts_in_varlen_only_and_a_fallback_to_mask_still_starts(manager_cls) -> None:
    # A bench matrix's columns share one speculative config, and a varlen server whose attention backend cannot
    # replay varlen graphs falls back to mask: refused there, the setting stopped the worker at start-up.
    from dspark_cli.engines.vllm import manager

    assert not DsparkVllmSettings(mode="mask", probe_scout=True).capacity_config().probe_scout
    assert DsparkVllmSettings(mode="varlen", probe_scout=True).capacity_config().probe_scout
    curve = SpsCurve.from_points([(4, 10.0), (8, 12.0), (16, 40.0)], [(1, 5.0)], capture_sizes=[4, 8, 16])
    settings = DsparkVllmSettings(mode="varlen", sps_curve=curve.to_dict(), probe_scout=True)
    m = manager.create_manager(settings, _av_module("graphs"), _create_kwargs())
    assert m.mode == "mask" and not m.cfg.probe_scout and not m.saturation.probe_scout


def test_an_outcome_planned_before_a_probe_began_is_no_evidence_for_it(manager_cls, monkeypatch) -> None:
    # vLLM judges a batch's outcome steps after planning it. A probe begun by the decision right after a drafting
    # batch (no paused step between: patience 1, a timer probe due at once) was judged on that batch -- at 16
    # requests one batch is a verdict -- and the scout planned after the verdict, outside any probe.
    monkeypatch.setattr(Base, "record_confidences", _upstream_record_confidences)
    r = 16
    m = _make(manager_cls, "varlen", r=r, slots=r, curve=SpsCurve.from_points([(1, 3.0), (128, 130.0)],
                                                                          [(1, 0.5), (16, 0.5)]),
              saturation_patience=1, resume_every=1, probe_scout=True)
    m._pause_supported = True
    per_req = {f"r{i}": 1 + K for i in range(r)}
    drafts = {x: [0] * K for x in per_req}
    sat = m.saturation
    plans = []
    for _ in range(12):
        if m._drafts_real:
            m.record_confidences(torch.full((r, K), 0.99), types.SimpleNamespace(num_reqs=r, idx_mapping=torch.arange(r)))
        m.get_num_tokens(per_req, drafts)
        verified = m._batch_budget is not None and m._drafts_real
        if verified:
            plans.append((sat.probing, m._step_decision.scout, sat.probe_serial))
            m.reallocate_drafts(list(per_req), torch.arange(r))
        m.begin_drafting_step(_step_state(r))
        if verified:
            m.observe(torch.full((r,), 1, dtype=torch.int32))  # nothing accepted: every probe fails
    scouts = [p for p in plans if p[1]]
    assert scouts and all(probing for probing, _, _ in scouts), plans
    assert sat.counters.scout_steps == len(scouts)
    # each probe judged on a batch of its own: as many verdicts as probes that planned a judged batch
    judged = {serial for probing, scout, serial in plans if probing and not scout}
    assert sum(sat.counters.probes.values()) <= len(judged) + 1


class _Scheduler:
    """vLLM 0.33's asynchronous scheduler, as far as placeholder drafts go: each step hands every request it
    schedules one fresh list of K placeholders (drafts the step's propose will fill), published through the
    plugin's PatchState; the next step schedules ``len`` of each request's list as drafts."""

    def __init__(self, state: Any, requests: list[str]) -> None:
        self.state = state
        self.spec_token_ids = {x: [] for x in requests}

    def schedule(self) -> dict[str, list[int]]:
        drafts = {x: ids for x, ids in self.spec_token_ids.items() if ids}
        placeholders = [-1] * K
        self.spec_token_ids = dict.fromkeys(self.spec_token_ids, placeholders)
        self.state.placeholders = placeholders  # the plugin's _update_after_schedule hook
        return drafts


def test_a_paused_step_leaves_the_next_one_plain_and_probes_still_resume(manager_cls) -> None:
    """plain_paused_steps: a paused decision empties the placeholders the scheduler reserved for the next
    step, so that step carries no drafts at all -- vLLM runs it as plain decoding and never asks for a budget.
    The saturation policy still pauses, probes and resumes as with placeholders; the verdict on the last
    verification before a pause is judged by the next decision, not left for the probe to inherit."""
    from dspark_cli.engines.vllm.plugin import PatchState

    state = PatchState(modules={})
    m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
    m._pause_supported = True
    m.set_placeholder_dropper(state.drop_placeholders)
    requests = [f"r{i}" for i in range(3)]
    sched = _Scheduler(state, requests)
    budgets = []

    def step(conf: float, accepted: int) -> int:
        drafts = sched.schedule()
        if drafts:  # the runner asks for a budget only when drafts were scheduled
            if m._drafts_real:
                _record(m, [[conf] * K] * 3)
            per_req = {x: 1 + len(drafts[x]) for x in requests}
            m.get_num_tokens(per_req, drafts)
            budgets.append(m._batch_budget[2])
            m.reallocate_drafts(requests, torch.arange(3))
        scheduled = sum(map(len, drafts.values()))
        batch = types.SimpleNamespace(num_reqs=3, idx_mapping_np=np.arange(3), num_tokens=3 + scheduled, num_draft_tokens=scheduled)
        runner = types.SimpleNamespace(execute_model_state=ExecuteModelState(batch, K))
        m.begin_drafting_step(runner)  # vLLM: before sample_tokens, which observes the outcome
        if drafts:
            m.observe(torch.full((3,), 1 + accepted, dtype=torch.int32))
        return scheduled

    first = [step(0.01, 0) for _ in range(5)]  # no step pays: paused after `patience` judged steps
    assert first == [0, 3 * K, 3 * K, 3 * K, 0]
    assert m._plain_after_pause >= 1 and not m._drafts_real
    assert all(len(ids) == 0 for ids in sched.spec_token_ids.values())  # the next step is plain decoding
    assert m._outcome_pending is None  # the last verification's verdict was judged without a budget call
    paused_budgets = len(budgets)
    plain = 0
    while step(0.01, 0) == 0:  # paused steps until a probe drafts: no budget asked for any of them
        plain += 1
    assert plain > 0 and len(budgets) == paused_budgets + 1  # only the probe's verification step asks
    assert m.saturation.probing or m.saturation.drafting_enabled
    while m.saturation.probing or not m.saturation.drafting_enabled:  # confident drafts, all accepted: it pays
        step(0.99, K)
    assert [step(0.99, K) for _ in range(3)] == [3 * K] * 3
    assert m.saturation.counters.resumes >= 1


def test_without_a_scheduler_in_the_process_a_paused_step_keeps_its_placeholders(manager_cls) -> None:
    """Where vLLM's scheduler runs in another process (the worker of a multiprocess executor), nothing is
    published here: a paused step drops nothing, and its placeholders are compacted away as before."""
    from dspark_cli.engines.vllm.plugin import PatchState

    state = PatchState(modules={})
    m = _make(manager_cls, "varlen", saturation_patience=1, resume_every=50)
    m._pause_supported = True
    m.set_placeholder_dropper(state.drop_placeholders)
    for _ in range(6):
        _bonus_only_step(m, m._drafts_real)
    assert not m.saturation.drafting_enabled and m._plain_after_pause == 0


def _bonus_only_step(m, drafted: bool) -> int:
    """One runner step over three requests whose drafts are all rejected (the bonus token only); returns
    the drafts the next decision schedules. Async scheduling: a paused decision's batch carries placeholder
    drafts, verified by none."""
    per_req = {f"r{i}": 1 + K for i in range(3)}
    if drafted:
        _record(m, [[0.6] * K] * 3)
    m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
    m.reallocate_drafts(list(per_req), torch.arange(3))
    batch = types.SimpleNamespace(num_reqs=3, idx_mapping_np=np.arange(3), num_tokens=3 + 3 * K, num_draft_tokens=3 * K)
    runner = types.SimpleNamespace(execute_model_state=ExecuteModelState(batch, K))
    m.begin_drafting_step(runner)
    m.observe(torch.full((3,), 1, dtype=torch.int32))
    return runner.execute_model_state.num_spec_tokens_to_schedule


def test_drafting_is_judged_against_what_a_paused_step_really_costs(manager_cls, caplog) -> None:
    """vLLM's paused draft_model step still runs the draft's prefill pass: here it takes 30 ms where the
    curve prices plain decoding at 10. Drafting steps take what they are priced at (15 ms) and emit only
    the bonus token, so on the curve alone drafting loses (3 tokens / 15 ms against 3 / 10) and stays
    paused; measured, it beats pausing 2x (3 / 15 against 3 / 30), so a probe resumes it for good."""

    def run(timed: bool) -> list[int]:
        m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
        m._pause_supported = m._timed = True  # attach(): a draft_model speculator on a single rank
        now = [0.0]
        _fake_clock(m, now)
        m._report_every = 0.6  # s of the fake clock
        scheduled = []
        for _ in range(60):
            real = m._drafts_real
            if timed:  # the interval since the last decision: its propose and the batch it shaped
                now[0] += (0.015 if real else 0.030)
            scheduled.append(_bonus_only_step(m, real))
        return scheduled

    untimed = run(False)
    with caplog.at_level(logging.INFO, logger="vllm.dspark"):
        timed = run(True)
    # priced by the curve alone: paused, with failed probes only (a few steps each, none resumed drafting)
    runs = [len(run) for run in "".join("d" if n == K else "." for n in untimed[1:]).split(".") if run]
    assert runs and max(runs) <= 5 and untimed[-20:].count(K) <= 5
    assert timed[-20:] == [K] * 20  # measured: drafting resumed and stays on
    # the server log says so (every 10 s of serving; here 0.6 s, and 60 steps of 15-30 ms make one line) ...
    lines = [r.getMessage() for r in caplog.records if "dspark: saturation:" in r.getMessage()]
    summary = [x for x in lines if "decisions" in x]
    assert len(summary) == 1 and "pauses 1, resumes 1" in summary[0] and "2-3: 0.33" in summary[0]
    assert "due probes held 0 steps by the probe tax, 0 to time their load, 0 while the load climbed" in summary[0]
    assert "], 0 scouts; sustained gain " in summary[0] and "(0 steps short of the sustain margin); due probes" in summary[0]
    assert "paused step time over priced, by load [2-3: 3.00]; " in summary[0]  # 30 ms priced at 10
    assert summary[0].endswith("prefill steps, time over priced, by load: none timed; outcome waits 0, 0.0 ms")
    # ... and every probe's verdict as it is judged, in the words benchmarks/saturation_log.py reads
    verdicts = [x for x in lines if "decisions" not in x]
    assert verdicts and all(" probe at 3 requests " in x and "probe allowance" in x for x in verdicts)
    assert "paid: realized" in verdicts[-1]
    reader = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "saturation_log.py"))
    assert all(reader["PROBE"].search(x) for x in verdicts)
    assert not any(reader["PROBE"].search(x) for x in summary)  # its "last probe" is not a new verdict


class _GpuBehind:
    """A step clock whose marks are final only once ``lag`` later marks were taken, as CUDA events are while
    the GPU runs behind the host; each mark holds the fake time the test had reached."""

    def __init__(self, now: list[float], lag: int) -> None:
        self.now, self.lag, self.at = now, lag, []

    def mark(self) -> int:
        self.at.append(self.now[0])
        return len(self.at) - 1

    def ready(self, mark: int) -> bool:
        return mark < len(self.at) - self.lag

    def elapsed_ms(self, start: int, end: int) -> float:
        return (self.at[end] - self.at[start]) * 1e3


def test_step_times_that_come_back_steps_late_judge_drafting_as_timely_ones_do(manager_cls) -> None:
    """On CUDA a step's time is known only once the GPU has passed the next decision's event, a step or two
    after the host took it (engines/vllm/step_clock.py). The scene above, timed that way: each step is still
    charged to its own decision, drafting still resumes for good (a step or two later), and its plain
    samples stay one step each."""
    from dspark_cli.engines.vllm.step_clock import StepIntervals

    def run(lag: int | None) -> tuple[list[int], Any]:
        m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
        m._pause_supported = m._timed = True
        now = [0.0]
        _fake_clock(m, now)
        if lag is not None:
            m._intervals = StepIntervals(_GpuBehind(now, lag))
        scheduled = []
        for _ in range(150):
            real = m._drafts_real
            now[0] += 0.015 if real else 0.030
            scheduled.append(_bonus_only_step(m, real))
        return scheduled, m

    timely_steps, timely = run(None)
    for lag in (1, 3):
        scheduled, late = run(lag)
        plain = [i for i, x in enumerate(scheduled) if x == 0 and i >= 20]  # samples while drafting runs
        assert len(plain) == 2 and plain[1] - plain[0] == PLAIN_SAMPLE_EVERY + 1  # one step each, as timely
        assert timely_steps[20:].count(0) == 2
        assert late._intervals.pending == lag  # the last steps' times are still on their way
        times = late.timer.step_times
        assert times.ratio(False, 3) == pytest.approx(3.0)  # 30 ms priced at 10, as timely
        assert times.ratio(True, 3) == pytest.approx(timely.timer.step_times.ratio(True, 3))


def test_a_plain_sample_leaves_the_next_budget_its_confidences(manager_cls) -> None:
    """A plain sample while drafting pays skips one draft pass; the confidences from before it are a step older,
    not a pause's. Marked as predating a pause, the drafting step after every sample verified on all-ones
    confidences (an untrimmed budget), where the embedded engine keeps them."""
    m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
    m._pause_supported = m._timed = True
    now = [0.0]
    _fake_clock(m, now)
    scheduled, predated = [], []
    for _ in range(150):
        real = m._drafts_real
        now[0] += 0.015 if real else 0.030
        scheduled.append(_bonus_only_step(m, real))
        predated.append(m._stale_predates_pause)
    assert m.saturation.drafting_enabled and scheduled[20:].count(0) == 2  # two plain samples, drafting on
    assert not any(predated[20:])


def test_a_held_resume_leaves_no_probe_debt_when_its_times_come_back_late(manager_cls) -> None:
    """The resume's last probation step is timed two decisions after the outcome that confirmed the resume (and
    forgave its probation). Charged then, it was a debt at the load that had just shown drafting pays: when
    drafting later lost there and paused, the first timer probe waited out that debt at 2% of each paused step
    (24 deferred steps with one step of lag, 50 with two), where timely times deferred none."""
    from dspark_cli.engines.vllm.step_clock import StepIntervals

    def run(lag: int | None) -> tuple[float, int]:
        m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
        m._pause_supported = m._timed = True
        sat = m.saturation
        now = [0.0]
        _fake_clock(m, now)
        if lag is not None:
            m._intervals = StepIntervals(_GpuBehind(now, lag))
        drafting_ms = 15.0  # against 30 ms paused: drafting pays, the probe resumes it and the resume holds
        for _ in range(60):
            real = m._drafts_real
            now[0] += (drafting_ms if real else 30.0) / 1e3
            _bonus_only_step(m, real)
        assert sat.counters.resumes >= 1 and sat.drafting_enabled and not sat.on_probation
        held, pauses = sat.probe_allowance_at(3), sat.counters.pauses
        drafting_ms = 45.0  # now drafting loses: it pauses again, and the timer's first probe is due after 3
        while not (sat.counters.pauses > pauses and sat.probing):
            real = m._drafts_real
            now[0] += (drafting_ms if real else 30.0) / 1e3
            _bonus_only_step(m, real)
        return held, sat.counters.deferred_probe_steps

    for lag in (None, 1, 2):
        held, deferred = run(lag)
        assert held >= 0.0 and deferred == 0, (lag, held, deferred)


def _charged_probe_steps(manager_cls, probe_ms: float, idle_after_probe_s: float = 0.0) -> tuple[list, Any]:
    """Drafting loses (45 ms against 30 paused) and pauses; every probe step takes ``probe_ms``, and the first is
    followed by ``idle_after_probe_s`` of idling (the batch emptied, its interval still open). Returns what each
    probe step was charged to the probe tax (measured ms) and the manager."""
    m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
    m._pause_supported = m._timed = True
    sat = m.saturation
    charged: list[float] = []
    record = sat.record_step_ms

    def spy(drafting: bool, ms: float, kind: str | None = None, num_running: int | None = None,
            trigger: str | None = None, probe_bucket: int | None = None) -> None:
        if kind == "probe":
            charged.append(ms)
        record(drafting, ms, kind, num_running, trigger, probe_bucket)

    sat.record_step_ms = spy  # type: ignore[method-assign]
    now = [0.0]
    _fake_clock(m, now)
    idle = idle_after_probe_s
    for _ in range(40):
        real = m._drafts_real
        probing = real and sat.probing
        now[0] += (probe_ms if probing else 45.0 if real else 30.0) / 1e3
        if probing:
            now[0], idle = now[0] + idle, 0.0
        _bonus_only_step(m, real)
    assert sat.counters.probe_steps >= 1
    return charged, m


def test_a_probe_step_far_over_its_price_still_pays_the_probe_tax(manager_cls) -> None:
    """A step over STEP_TIME_CLAMP x its price is no measure of drafting against paused steps, and was dropped
    whole; but a probe that catches the draft up over a long pause runs that long (~4.4x at 256 requests on the
    H100, section 36), and dropped it cost the probe tax nothing. It is charged up to PROBE_TAX_CLAMP x its price."""
    timely, _ = _charged_probe_steps(manager_cls, 45.0)
    slow, _ = _charged_probe_steps(manager_cls, 2000.0)
    assert timely and all(ms == pytest.approx(45.0) for ms in timely)
    # charged (not dropped), at the clamp: PROBE_TAX_CLAMP x the same price each time, well over a timely probe
    assert slow and all(ms == pytest.approx(slow[0]) for ms in slow) and 45.0 < slow[0] < 2000.0, slow


def test_an_idle_gap_after_a_probe_step_is_no_probe_tax_debt(manager_cls) -> None:
    """The last step's interval stays open while the server idles: a minute after a timer probe step, as the
    batch emptied, was charged as a minute's probe, a debt paused steps repay at 2% each (~100k steps of that
    load's timer probes held back). The tax counts an interval at most PROBE_TAX_CLAMP x its price."""
    from dspark_cli.core.saturation import PROBE_TAX_CLAMP

    charged, m = _charged_probe_steps(manager_cls, 45.0, idle_after_probe_s=60.0)
    assert max(charged) < 1000.0, charged
    assert m.saturation.probe_allowance_at(3) > -PROBE_TAX_CLAMP * 45.0 * 4


def test_a_draft_catch_up_is_not_charged_to_drafting(manager_cls) -> None:
    """The scene above, with a paused draft_model draft that defers its K/V (engines/vllm/upkeep.py): the
    step that resumes drafting (a probe) also writes the K/V of the whole pause, 45 ms more here. Measured
    like any drafting step, that probe step would count as drafting's cost; it is left out of the
    calibration (and still counts for the probe tax), so drafting is still judged at what it costs."""
    from dspark_cli.engines.vllm.upkeep import DraftUpkeep

    def run(catch_up_ms: float) -> tuple[list[int], dict[int, float], int]:
        m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
        m._pause_supported = m._timed = True
        m._upkeep = upkeep = DraftUpkeep(8, 2048)
        slots = np.arange(3)
        now = [0.0]
        _fake_clock(m, now)
        scheduled, was_real = [], True
        for _ in range(60):
            real = m._drafts_real
            now[0] += 0.015 if real else 0.030
            if real and not was_real and upkeep.owed(slots).any():  # the propose that resumes: a catch-up
                now[0] += catch_up_ms / 1e3
                upkeep.paid(slots)
            elif not real:
                upkeep.skip(slots)
            was_real = real
            scheduled.append(_bonus_only_step(m, real))
        return scheduled, m.timer.step_times.quotients(), upkeep.catchups

    plain, plain_quotients, _ = run(0.0)
    scheduled, quotients, catchups = run(45.0)
    assert catchups >= 1  # the resuming probe caught the draft up
    assert scheduled == plain and scheduled[-20:] == [K] * 20  # drafting resumed and stays on, as without
    assert quotients == pytest.approx(plain_quotients)  # the catch-up's 45 ms went into no drafting measurement


def test_a_step_that_carries_a_prompt_chunk_times_no_decode_step(manager_cls) -> None:
    """A wave's first step prefills its prompts (eagerly, under decode-only graphs) and, paused, still runs the
    draft's prefill over them: 3x its price here. It counts for the probe tax but feeds no plain-step window --
    neither that interval nor the next, whose draft pass covered the chunk. A load's window (and so whether a
    due probe there may fire, ``times_load``) is then set by decode steps only, not restarted on a prefill."""
    from dspark_cli.engines.vllm.upkeep import DraftUpkeep

    m = _make(manager_cls, "varlen", saturation_patience=2, resume_every=3)
    m._pause_supported = m._timed = True
    m._upkeep = DraftUpkeep(8, 2048)
    now = [0.0]
    _fake_clock(m, now)
    per_req = {f"r{i}": 1 + K for i in range(3)}

    def step(ms: float, prefill: bool) -> None:
        m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
        m.reallocate_drafts(list(per_req), torch.arange(3))
        now[0] += ms / 1e3
        if prefill:  # a paused step that admits a prompt catches the draft up in the same pass
            m._upkeep.paid(np.arange(3))
        batch = types.SimpleNamespace(num_reqs=3, idx_mapping_np=np.arange(3), num_tokens=3 + 3 * K, num_draft_tokens=3 * K, has_prefill=prefill)
        m.begin_drafting_step(types.SimpleNamespace(execute_model_state=ExecuteModelState(batch, K)))
        m.observe(torch.full((3,), 1, dtype=torch.int32))

    for _ in range(12):  # drafting loses (nothing accepted): paused
        step(10.0, False)
    assert not m.saturation.drafting_enabled
    times = m.timer.step_times
    before = (times.num_samples[False], times.ratio(False, 3))
    tax = m.saturation.probe_allowance_ms
    step(30.0, True)  # the interval whose batch carried the chunk
    step(30.0, False)  # the next one ran the draft's pass over it
    assert (times.num_samples[False], times.ratio(False, 3)) == before  # no plain-step sample from either
    assert m.saturation.probe_allowance_ms > tax  # both still paid into the probe tax
    # timed apart, for the log, catch-up included: what such steps cost where they are most steps
    chunk = m._prefill_times
    assert chunk.num_samples == {True: 0, False: 2}
    assert chunk.ratio(False, 3) == pytest.approx(3.0 * times.ratio(False, 3))
    step(10.0, False)
    assert times.num_samples[False] == before[0] + 1  # a decode step calibrates
    assert chunk.num_samples[False] == 2


def _batch(num_reqs: int, prompt_chunks: list[int], drafts: int = K) -> types.SimpleNamespace:
    """A vLLM input batch as the runner lays it out: ``num_reqs - len(prompt_chunks)`` decode rows of
    1 + ``drafts`` tokens, then one prefilling row per prompt chunk (no placeholder drafts)."""
    decode = num_reqs - len(prompt_chunks)
    scheduled = np.array([1 + drafts] * decode + prompt_chunks, dtype=np.int32)
    per_req = np.array([drafts] * decode + [0] * len(prompt_chunks), dtype=np.int32)
    prefilling = np.array([False] * decode + [True] * len(prompt_chunks))
    return types.SimpleNamespace(num_reqs=num_reqs, idx_mapping_np=np.arange(num_reqs), num_tokens=int(scheduled.sum()), num_draft_tokens=int(per_req.sum()),
                                 num_scheduled_tokens=scheduled, num_draft_tokens_per_req=per_req,
                                 is_prefilling_np=prefilling, has_prefill=bool(prefilling.any()))


def test_a_prefill_step_is_one_whose_prompt_tokens_outnumber_its_requests() -> None:
    """Continuous refill at 256 requests admits a prompt or two on nearly every step: such steps still time
    the load (on the H200 every probe at 256 requests otherwise borrowed a light load's quotient, section 27);
    a wave's first step, every prompt at once, does not."""
    from dspark_cli.engines.vllm.manager import prompt_heavy

    assert not prompt_heavy(_batch(256, []))
    assert not prompt_heavy(_batch(256, [128, 128]))  # 256 prompt tokens among 256 requests
    assert prompt_heavy(_batch(256, [128, 128, 2]))
    assert prompt_heavy(_batch(16, [128]))  # one prompt among 16 requests
    assert prompt_heavy(_batch(16, [128] * 16))  # a wave's first step
    padded = _batch(8, [3])
    padded.num_draft_tokens_per_req[-1] = K  # a prefilling row padded with placeholder drafts
    padded.num_scheduled_tokens[-1] = 3 + K
    assert not prompt_heavy(padded)
    # a layout that says it carries a chunk but not where: a prefill step, as before
    assert prompt_heavy(types.SimpleNamespace(num_reqs=256, has_prefill=True))
    assert not prompt_heavy(types.SimpleNamespace(num_reqs=256, has_prefill=False))


def test_a_step_that_admits_a_prompt_among_many_decode_rows_times_the_load(manager_cls) -> None:
    """The manager's side of the rule: paused steps at a load that admit one short prompt each (refill) feed
    its plain window, so a due probe there finds the load timed; a prompt-heavy step still feeds nothing."""
    n = 8
    m = _make(manager_cls, "varlen", r=n, saturation_patience=2, resume_every=1000)  # no timer probe here
    m._pause_supported = m._timed = True
    now = [0.0]
    _fake_clock(m, now)
    per_req = {f"r{i}": 1 + K for i in range(n)}

    def step(ms: float, batch: types.SimpleNamespace) -> None:
        m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
        m.reallocate_drafts(list(per_req), torch.arange(n))
        now[0] += ms / 1e3
        m.begin_drafting_step(types.SimpleNamespace(execute_model_state=ExecuteModelState(batch, K)))
        m.observe(torch.full((n,), 1, dtype=torch.int32))

    for _ in range(12):  # drafting loses (nothing accepted): paused
        step(10.0, _batch(n, []))
    assert not m.saturation.drafting_enabled
    times = m.timer.step_times
    seen = times.num_samples[False]
    for _ in range(3):
        step(10.0, _batch(n, [6]))  # a short prompt among the decode rows
    assert times.num_samples[False] == seen + 3 and times.times_load(n)
    step(10.0, _batch(n, [64]))  # a prompt-heavy step, and the one after it (its draft pass covered the chunk)
    step(10.0, _batch(n, []))
    assert times.num_samples[False] == seen + 3


def test_steps_scheduled_without_drafts_are_never_verified(manager_cls) -> None:
    m = _make(manager_cls, "varlen")  # pausing unsupported: vLLM itself scheduled 0 drafts this step
    runner = _step_state(3, scheduled=0)
    m.begin_drafting_step(runner)
    assert runner.execute_model_state.num_spec_tokens_to_schedule == 0 and not m._drafts_real
    per_req = {f"r{i}": 1 + K for i in range(3)}
    assert m.get_num_tokens(per_req, {x: [0] * K for x in per_req}) == 3


def test_online_sts_learns_from_observed_outcomes(manager_cls) -> None:
    m = _make(manager_cls, "varlen", online_sts=True, sts_refit_interval=5)
    per_req = {f"r{i}": 1 + K for i in range(3)}
    for _ in range(10):
        _record(m, [[0.99] * K] * 3)  # a wildly overconfident head ...
        m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
        m.reallocate_drafts(list(per_req), torch.arange(3))
        m.observe(torch.ones(3, dtype=torch.int32))  # ... whose drafts are all rejected
    # Position 1 was verified and always rejected: its 0.99 now calibrates far below 0.5. Later positions were
    # never reached (censored): they start from position 1's calibration, not from "0.99 means 0.99".
    got = m.online_sts.apply(torch.full((1, K), 0.99))[0]
    assert float(got[0]) < 0.8 and torch.allclose(got[1:], got[0].expand(K - 1), atol=0.02)
    assert float(m.online_sts.trials[1:].sum()) == 0.0
    t = m.temperatures
    m.online_sts.refit()
    assert m.temperatures is t


def test_online_sts_without_offline_temperatures_reaches_past_what_was_verified(manager_cls) -> None:
    """A weightless draft against synthetic acceptance: raw confidences ~1/vocabulary while the first three
    drafts always pass. The curve here verifies at most two drafts per request (flat up to 8 tokens), so
    position 3 and on are never tested; they must still not be left at "2e-5 means 2e-5"."""
    m = _make(manager_cls, "varlen", r=3, online_sts=True, sts_refit_interval=4)
    assert m.online_sts.inherit_prior  # no sts.json, no scalar temperature: no per-position prior
    per_req = {f"r{i}": 1 + K for i in range(3)}
    for _ in range(40):
        _record(m, [[2e-5] * K] * 3)
        m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
        m.reallocate_drafts(list(per_req), torch.arange(3))
        caps = m._batch_draft_capacity[:3].clone()
        assert int(caps.max()) <= 2
        m.observe(1 + torch.clamp(caps, max=3).to(torch.int32))  # every verified draft up to the 3rd passes
    assert float(m.online_sts.trials[2:].sum()) == 0.0
    got = m.online_sts.apply(torch.full((1, K), 2e-5))[0]
    assert float(got[0]) > 0.5 and torch.allclose(got[2:], got[1].expand(K - 2)), got


def _av_module(blocker: str | None) -> types.SimpleNamespace:
    """Stand-in for upstream's adaptive_verification module: its backend checks, blocked as asked."""
    return types.SimpleNamespace(
        AdaptiveVerificationManager=Base,
        AttentionCGSupport=types.SimpleNamespace(ALWAYS="ALWAYS"),
        get_query_lens_mismatch_unsupported_backend=lambda groups, checked_layer_names=None: (
            "FLASHINFER" if blocker == "mismatch" else None),
        get_varlen_cudagraph_unsupported_backend=lambda groups, cfg, max_query_len, checked_layer_names=None: (
            ("TRITON_ATTN", None) if blocker == "graphs" else None),
    )


def _create_kwargs() -> dict:
    rs = types.SimpleNamespace(num_speculative_steps=K, max_num_reqs=8, max_num_batched_tokens=256,
                               device=torch.device("cpu"), req_id_to_index={})
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=1, data_parallel_rank=0))
    return dict(req_states=rs, num_bonus_tokens=1, attn_groups=[], vllm_config=cfg, max_total_logits=10_000,
                query_start_loc=torch.zeros(9, dtype=torch.int32))


@pytest.mark.parametrize(("mode", "compact", "blocker", "expected"), [
    ("varlen", False, None, True), ("varlen", False, "graphs", False),  # the fallback to mask stays uniform
    ("mask", False, None, False), ("mask", True, None, True), ("mask", True, "mismatch", False)])
def test_paused_steps_compact_where_asked_and_the_backends_allow(
        manager_cls, mode: str, compact: bool, blocker: str | None, expected: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    from dspark_cli.engines.vllm import manager

    curve = SpsCurve.from_points([(4, 10.0), (8, 12.0), (16, 40.0)], [(1, 5.0)], capture_sizes=[4, 8, 16])
    settings = DsparkVllmSettings(mode=mode, sps_curve=curve.to_dict(), mask_paused_compact=compact)
    with caplog.at_level("WARNING", logger="vllm.dspark"):
        m = manager.create_manager(settings, _av_module(blocker), _create_kwargs())
    assert m.compact_paused is expected
    stays = [r.getMessage() for r in caplog.records if "paused steps stay uniform" in r.getMessage()]
    assert len(stays) == (1 if mode == "mask" and blocker else 0)


@pytest.mark.parametrize("asked", ["mask", "varlen"])
def test_mask_mode_whose_full_batch_vllm_cannot_verify_at_once_is_refused_at_start_up(
        manager_cls, asked: str) -> None:
    """vLLM 0.33 verifies a batch with adaptive verification on in one chunk of logit rows and asserts beyond it;
    mask mode's uniform batch has 1 + K rows per request whatever it admits, so a full batch must fit (varlen
    caps its budget to fit instead). Varlen that falls back to mask is checked alike."""
    from dspark_cli.engines.vllm import manager

    curve = SpsCurve.from_points([(4, 10.0), (8, 12.0), (16, 40.0)], [(1, 5.0)], capture_sizes=[4, 8, 16])
    settings = DsparkVllmSettings(mode=asked, sps_curve=curve.to_dict())
    av = _av_module("graphs" if asked == "varlen" else None)
    fits = {**_create_kwargs(), "max_total_logits": 8 * (1 + K)}
    assert manager.create_manager(settings, av, fits).mode == "mask"
    with pytest.raises(ValueError, match=rf"a full batch of 8 requests verifies {8 * (1 + K)} logit rows .* "
                                         rf"use --max-num-seqs 7 or fewer"):
        manager.create_manager(settings, av, {**fits, "max_total_logits": 8 * (1 + K) - 1})
    varlen = DsparkVllmSettings(mode="varlen", sps_curve=curve.to_dict())
    small = {**fits, "max_total_logits": 3}  # varlen's budget cap keeps any batch within it
    assert manager.create_manager(varlen, _av_module(None), small).mode == "varlen"


def test_a_paused_mask_step_compacts_to_one_token_per_request_and_a_drafting_one_stays_uniform(
        manager_cls) -> None:
    """mask_paused_compact: a paused step's placeholder drafts are verified by none, so it runs varlen's
    one-token-per-request batch (no masking to apply); a drafting step keeps the uniform masked batch. Without
    the setting the paused step is the uniform 1 + K batch, every placeholder masked."""
    per_req = {f"r{i}": 1 + K for i in range(3)}
    drafts = {x: [0] * K for x in per_req}
    scheduled = np.full(3, 1 + K, dtype=np.int32)
    cu = np.arange(4, dtype=np.int32) * (1 + K)
    for compact in (False, True):
        m = _make(manager_cls, "mask", moe=False, mask_paused_compact=compact)
        m.compact_paused = compact  # create_manager's verdict for a backend that replays varlen graphs
        _record(m, [[0.9] * K] * 3)
        assert m.get_num_tokens(per_req, drafts) == 3 * (1 + K)  # drafting: uniform
        assert m.compact_batch(np.full(3, K), scheduled, cu)[0].tolist() == scheduled.tolist()
        m.reallocate_drafts(list(per_req), torch.arange(3))
        assert m._mask_pending == 3
        m._mask_pending = None
        m._drafts_real = False  # the saturation policy paused: this step's drafts are placeholders
        tokens = m.get_num_tokens(per_req, drafts)
        sched, cu_np = m.compact_batch(np.full(3, K), scheduled, cu)
        cu_logits, _, draft_logits, _ = m.reallocate_drafts(list(per_req), torch.arange(3))
        if compact:
            assert tokens == 3 and sched.tolist() == [1, 1, 1] and cu_np.tolist() == [0, 1, 2, 3]
            assert draft_logits == 0 and cu_logits.tolist() == [0, 1, 2, 3] and m._mask_pending is None
        else:  # every placeholder computed, given a logit row and masked
            assert tokens == 3 * (1 + K) and sched.tolist() == scheduled.tolist()
            assert draft_logits == 3 * K and cu_logits.tolist() == cu.tolist() and m._mask_pending == 3


@pytest.mark.parametrize("blocker", [None, "mismatch", "graphs", "extra"])
def test_varlen_falls_back_to_mask_with_one_line_instead_of_refusing(
        manager_cls, blocker: str | None, caplog: pytest.LogCaptureFixture) -> None:
    """Upstream raises when a target attention backend cannot replay varlen batches; ours serves in mask."""
    from dspark_cli.engines.vllm import manager

    always = "ALWAYS"
    av = types.SimpleNamespace(
        AdaptiveVerificationManager=Base,
        AttentionCGSupport=types.SimpleNamespace(ALWAYS=always),
        get_query_lens_mismatch_unsupported_backend=lambda groups, checked_layer_names=None: (
            "FLASHINFER" if blocker == "mismatch" else None),
        get_varlen_cudagraph_unsupported_backend=lambda groups, cfg, max_query_len, checked_layer_names=None: (
            ("TRITON_ATTN", None) if blocker == "graphs" else None),
    )
    rs = types.SimpleNamespace(num_speculative_steps=K, max_num_reqs=8, max_num_batched_tokens=256,
                               device=torch.device("cpu"), req_id_to_index={})
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=1, data_parallel_rank=0))
    kwargs = dict(req_states=rs, num_bonus_tokens=1, attn_groups=[], vllm_config=cfg, max_total_logits=10_000,
                  query_start_loc=torch.zeros(9, dtype=torch.int32))
    if blocker == "extra":
        kwargs["additional_attn_cg_support"] = ("UNIFORM_BATCH", "MAMBA")
    curve = SpsCurve.from_points([(4, 10.0), (8, 12.0), (16, 40.0)], [(1, 5.0)], capture_sizes=[4, 8, 16])
    settings = DsparkVllmSettings(mode="varlen", sps_curve=curve.to_dict())
    with caplog.at_level("WARNING", logger="vllm.dspark"):
        m = manager.create_manager(settings, av, kwargs)
    falls = [r.getMessage() for r in caplog.records if "falls back to mask" in r.getMessage()]
    assert m.mode == ("varlen" if blocker is None else "mask")
    assert len(falls) == (0 if blocker is None else 1)
    if blocker == "mismatch":
        assert "FLASHINFER" in falls[0]
    if blocker in ("graphs", "extra"):
        assert "cannot replay varlen decode graphs of up to 5 tokens" in falls[0]


def test_prompts_are_deferred_only_where_asked_and_without_prefix_caching(manager_cls, caplog) -> None:
    """draft_defer_prompts: a paused step's prompt chunks wait for the catch-up too, but only where vLLM's prefix
    cache is off -- with it, another request could reuse a deferred prompt's blocks before they are written."""
    spec = types.SimpleNamespace(max_num_tokens=256, max_num_reqs=8, dcp_size=1)
    cases = ((False, False, False), (True, False, True), (True, True, False))
    for asked, prefix_caching, deferred in cases:
        m = _make(manager_cls, "varlen", draft_defer_prompts=asked)
        m._pause_supported = True
        m.vllm_config.cache_config = types.SimpleNamespace(enable_prefix_caching=prefix_caching)
        with caplog.at_level(logging.INFO, logger="vllm.dspark"):
            caplog.clear()
            m._set_up_upkeep(spec, standalone=True)
        assert m._upkeep is not None and m._upkeep.defer_prompts is deferred, (asked, prefix_caching)
        said = " ".join(r.getMessage() for r in caplog.records)
        assert ("draft_defer_prompts needs --no-enable-prefix-caching" in said) is (asked and prefix_caching)
        assert ("(prompt chunks too)" in said) is deferred


def test_a_draft_with_a_sliding_window_is_kept_current_while_paused(manager_cls, caplog) -> None:
    """A catch-up writes positions behind each query through the block table; under a sliding window the blocks
    below it may already serve another request, so such a draft keeps its K/V current instead."""
    spec = types.SimpleNamespace(max_num_tokens=256, max_num_reqs=8, dcp_size=1)
    for window, deferred in ((None, True), (4096, False)):
        m = _make(manager_cls, "varlen")
        m._pause_supported = True
        m.vllm_config.cache_config = types.SimpleNamespace(enable_prefix_caching=False)
        draft = types.SimpleNamespace(get_sliding_window=lambda w=window: w)
        m.vllm_config.speculative_config = types.SimpleNamespace(draft_model_config=draft)
        with caplog.at_level(logging.INFO, logger="vllm.dspark"):
            caplog.clear()
            m._set_up_upkeep(spec, standalone=True)
        assert (m._upkeep is not None) is deferred
        said = " ".join(r.getMessage() for r in caplog.records)
        assert ("sliding window of 4096 tokens: its K/V is kept current" in said) is not deferred


@pytest.mark.parametrize("mode", ["varlen", "mask"])
def test_a_request_the_resuming_step_left_out_never_has_its_stale_drafts_admitted(manager_cls, mode: str) -> None:
    """Where vLLM keeps a paused step's placeholders (plain_paused_steps off, or a worker in another process),
    a request that the step resuming drafting did not schedule (its token budget ran out) still holds the paused
    step's -1 ids when it comes back, whatever the batch's other requests hold. None of them may be admitted:
    a -1 id verified is an embedding lookup out of range on the GPU."""
    m = _make(manager_cls, mode, r=3)
    m._pause_supported = True
    per_req = {f"r{i}": 1 + K for i in range(3)}
    drafts = {x: [0] * K for x in per_req}
    _record(m, [[0.99] * K] * 3)  # confident drafts before the pause: stale ones must not count for r2
    verdicts = iter([False, True, True])
    m.timer.begin_step = lambda num_reqs: next(verdicts)
    m.get_num_tokens(per_req, drafts)
    m.reallocate_drafts(list(per_req), torch.arange(3))
    m.begin_drafting_step(_step_state(3))  # paused: r0..r2 get -1 ids
    two = {x: per_req[x] for x in ("r0", "r1")}
    m.get_num_tokens(two, {x: drafts[x] for x in two})  # the resuming step schedules r0 and r1 only
    m.reallocate_drafts(list(two), torch.arange(2))
    m.begin_drafting_step(_step_state(2))  # drafting again: r0 and r1 get real drafts, r2 keeps its -1s
    _record(m, [[0.99] * K] * 2)
    assert m._drafts_real and list(m._slot_real[:3]) == [True, True, False]
    m.get_num_tokens(per_req, drafts)  # r2 is back, with K placeholders for its -1 ids
    budget = m._batch_budget.budget
    assert list(m._batch_budget.counts[2]) == [K, K, 0] and 0 < budget <= 2 * K
    cu, _, num_drafts, _ = m.reallocate_drafts(list(per_req), torch.arange(3))
    caps = m._batch_draft_capacity[:3].tolist()
    assert caps[2] == 0 and sum(caps) == budget
    # vLLM sizes the logit rows by the count returned (num_reqs * bonus + it) and its kernels store at cu_num_logits'
    # offsets unchecked: mask's uniform rows once came to 3 + 3K against 3 + 2K counted, writes past the buffers
    assert int(cu[-1]) == 3 * m.num_bonus_tokens + num_drafts
    m.begin_drafting_step(_step_state(3))  # drafting: every slot holds real drafts again
    assert m._slot_real[:3].all()


def test_a_split_other_than_the_scheduled_one_reaches_the_host_when_it_samples_in_shards(
    manager_cls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch-sharded sampling (tensor parallelism, where placeholders always stay) plans its shards from the host's
    split of the budget, exact only for none or every scheduled draft. A stale request admitting none while the
    budget takes every admissible draft is neither: the device's split must be handed over."""
    handed: list[tuple] = []
    monkeypatch.setattr(sys.modules["vllm.v1.worker.gpu.spec_decode.adaptive_verification"], "AdmittedDraftCounts",
                        lambda counts, event: handed.append((counts.tolist(), event)) or "admitted")
    from dspark_cli.engines.vllm import manager

    manager.build_manager_class.cache_clear()  # built again, importing the stand-in above
    m = _make(manager.build_manager_class(Base), "varlen", r=3)
    m._copy_admitted_drafts_to_host = True
    m._admitted_drafts_cpu = torch.zeros(8, dtype=torch.int32)
    m._admitted_drafts_event = types.SimpleNamespace(record=lambda: None)
    m._copy_stream = types.SimpleNamespace(wait_stream=lambda stream: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    per_req = {f"r{i}": 1 + K for i in range(3)}
    _record(m, [[0.99] * K] * 3)
    m._slot_real[2] = False  # r2 was left out of the step that resumed drafting: its slot holds -1 ids
    m._verify_all = True  # every admissible draft: 2K of the 3K scheduled
    m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
    _, _, num_drafts, admitted = m.reallocate_drafts(list(per_req), torch.arange(3))
    assert num_drafts == 2 * K and admitted == "admitted" and handed[0][0][:3] == [K, K, 0]


def test_the_logit_cap_bounds_the_budget_search_so_the_decision_is_priced_as_run(manager_cls) -> None:
    """vLLM verifies at most one chunk of logit rows. The budget was chosen over every draft and clamped after,
    so the saturation policy judged a step priced for drafts that were never verified."""
    m = _make(manager_cls, "varlen", r=3)
    m._max_total_logits = 3 * m.num_bonus_tokens + 4  # room for 4 of the 12 drafts
    m.curve = SpsCurve.from_points([(4, 10.0), (8, 10.5), (16, 11.0), (32, 12.0)], [(1, 5.0), (8, 5.0)],
                                   capture_sizes=[4, 8, 16, 32])
    m._pause_supported = True
    _record(m, [[0.99] * K] * 3)
    per_req = {f"r{i}": 1 + K for i in range(3)}
    m.get_num_tokens(per_req, {x: [0] * K for x in per_req})
    decision, run = m._step_decision, m._batch_budget.budget
    assert run == decision.budget == 4
    assert decision.step_ms == pytest.approx(m.curve.step_cost_ms(3, 3 + 4))


class _SlowEvent:
    """A CUDA event stand-in whose work completes only when waited for (the GPU behind the host)."""

    def __init__(self) -> None:
        self.done, self.waited = True, 0

    def record(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_a_verification_outcome_still_on_its_way_is_judged_after_the_next_launch_not_before(manager_cls) -> None:
    """Preparing the next batch must not hold back its launch for the last step's outcome: the budget does not
    need it. The drafting decision, which runs once that batch's forward is launched, judges it (waiting if it
    must), so the policy still sees every outcome before it decides."""
    m = _make(manager_cls, "varlen")
    m._pause_supported = True
    m._outcome_event = event = _SlowEvent()
    per_req = {f"r{i}": 1 + K for i in range(3)}
    drafts = {x: [0] * K for x in per_req}
    _record(m, [[0.9] * K] * 3)
    m.get_num_tokens(per_req, drafts)
    m.reallocate_drafts(list(per_req), torch.arange(3))
    m.begin_drafting_step(_step_state(3))
    m.observe(torch.full((3,), 1 + K, dtype=torch.int32))
    assert m._outcome_pending is not None and not event.done  # copied, not landed
    m.get_num_tokens(per_req, drafts)
    assert m._outcome_pending is not None and event.waited == 0  # the next batch was prepared without waiting
    m.reallocate_drafts(list(per_req), torch.arange(3))
    m.begin_drafting_step(_step_state(3))
    assert m._outcome_pending is None and event.waited == 1 and m._outcome_waits == 1


def test_the_start_up_profile_skips_the_batches_whose_draft_pass_vllm_would_overflow(manager_cls, caplog) -> None:
    """docs/PERFORMANCE.md section 38: a draft_model server of 256 tokens and 25 requests stopped in vLLM's
    start-up profile, whose dummy run of 256 tokens ran the draft over 257 (``contract.dummy_draft_overflow``).
    The profile keeps every other size; a user's curve skips the profile whole."""
    rs = types.SimpleNamespace(num_speculative_steps=K, max_num_reqs=25, max_num_batched_tokens=256,
                               device=torch.device("cpu"), req_id_to_index={})
    captured = [1, 2, 4, *range(8, 257, 8)]

    def profiled(method: str, sizes: list[int] = captured, mode: int = 3) -> list[int]:
        cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
                                    model_config=types.SimpleNamespace(is_moe=False),
                                    speculative_config=types.SimpleNamespace(method=method),
                                    compilation_config=types.SimpleNamespace(mode=mode,
                                                                             cudagraph_capture_sizes=captured))
        m = manager_cls(settings=DsparkVllmSettings(mode="varlen"), mode="varlen", vllm_config=cfg, req_states=rs,
                        query_start_loc=torch.zeros(26, dtype=torch.int32), num_bonus_tokens=1,
                        max_total_logits=10_000)
        return [b["num_tokens"] for b in m.batches_to_profile(sizes)]

    with caplog.at_level(logging.INFO, logger="vllm.dspark"):
        kept = profiled("draft_model")
    assert kept == [n for n in captured if n not in (232, 240, 248, 256)]
    assert "skips 4 batch sizes (232, 240, 248, 256)" in caplog.text and "up to 257 tokens" in caplog.text
    assert profiled("eagle3") == captured  # no correction slot, no trim
    assert profiled("draft_model", mode=0) == captured  # no torch.compile: no range ends at the budget
    # Uniform mask graphs at K=9 (1 + K = 10) add decode sizes such as 230 (224 rounded up) to the captured
    # counts; a mixed dummy batch of 230 tokens and 25 requests cannot replay them and pads to the piecewise 232
    uniform = sorted({*captured, *range(10, 251, 10)})
    assert 230 not in profiled("draft_model", uniform)
