"""Capacity manager: Algorithm 1, budget argmax, device allocation, saturation and the engine-facing manager."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dspark_cli.core.capacity import (
    MIN_PREDICTED_GAIN,
    BudgetDecision,
    CapacityConfig,
    CapacityManager,
    _np_survival,
    allocate,
    choose_budget,
    prefix_survival,
    schedule_paper,
)
from dspark_cli.core.saturation import (
    LOAD_RISE,
    LOAD_SETTLE_RISE,
    LOAD_SETTLE_STEPS,
    PLAIN_SAMPLE_EVERY,
    PROBE_BANK,
    PROBE_MARGIN,
    PROBE_MEASURE_WAIT,
    PROBE_TAX,
    PROBE_TAX_CLAMP,
    STEP_TIME_MEMORY,
    STEP_TIME_STALE,
    RequestWeightedMean,
    SaturationPolicy,
    StepCharge,
    StepTimeCalibration,
    StepTimer,
)
from dspark_cli.core.sps import SpsCurve
from dspark_cli.errors import DsparkError

# The paper's appendix curve: SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45 (seed list: one breakpoint per size).
APPENDIX = SpsCurve.from_dict([[1, 1.0], [2, 0.5], [3, 0.45]])
# A staircase with a drafting price and overhead: Θ is not unimodal over the budget.
STAIR = SpsCurve.from_points(
    [(8, 10.0), (16, 10.5), (24, 14.0), (32, 14.5), (48, 22.0), (64, 23.0), (96, 40.0)],
    draft_ms=[(1, 1.0), (16, 3.0)],
    overhead_ms=1.0,
    capture_sizes=[8, 16, 24, 32, 48, 64],
)
# The budget rule itself: no minimum predicted gain (the default margin is tested on its own)
ARGMAX = CapacityConfig(mode="varlen", policy="argmax", min_predicted_gain=0.0)
PAPER = CapacityConfig(mode="varlen", policy="paper", min_predicted_gain=0.0)

TIE_VALUES = [0.0, 0.3, 0.5, 0.5, 0.9, 1.0]
conf_matrix = st.integers(1, 6).flatmap(
    lambda r: st.integers(1, 5).flatmap(
        lambda k: st.tuples(
            st.lists(st.lists(st.sampled_from(TIE_VALUES), min_size=k, max_size=k), min_size=r, max_size=r),
            st.lists(st.integers(0, k), min_size=r, max_size=r),
        )
    )
)


def reference_allocation(surv: np.ndarray, nd: np.ndarray, budget: int) -> np.ndarray:
    """Plain-Python definition: top-`budget` valid slots by (-value, position, request)."""
    r, k = surv.shape
    slots = [(-surv[i, j], j, i) for i in range(r) for j in range(k) if j < nd[i] and surv[i, j] > 0]
    out = np.zeros(r, dtype=np.int64)
    for _, _, i in sorted(slots)[:budget]:
        out[i] += 1
    return out


def brute_force_budget(surv: np.ndarray, nd: np.ndarray, nondraft: int, sampling: int, curve: SpsCurve,
                       cap_frac: float = 1.0) -> int:
    r, k = surv.shape
    vals = sorted((surv[i, j] for i in range(r) for j in range(k) if j < nd[i]), reverse=True)
    cap = int(np.floor(cap_frac * len(vals) + 1e-9))
    best_n, best = 0, -1.0
    for n in range(cap + 1):
        theta = (sampling + sum(vals[:n])) / curve.step_cost_ms(r, nondraft + n)
        if theta > best + 1e-15:
            best_n, best = n, theta
    return best_n


# ---------------------------------------------------------------------------------------------- survival


def test_prefix_survival_is_a_clamped_cumprod() -> None:
    conf = torch.tensor([[0.9, 0.5, 1.2], [-0.1, 0.8, 0.8]])
    out = prefix_survival(conf)
    assert torch.allclose(out, torch.tensor([[0.9, 0.45, 0.45], [0.0, 0.0, 0.0]]))
    assert out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- Algorithm 1


def test_paper_appendix_example_early_stop_vs_retrospective_argmax() -> None:
    # Θ0 = 1.0, Θ1 = 1.8 * 0.5 = 0.9 <= Θ0: the walk stops before looking at c_2.
    for c2 in (0.9, 0.0):
        assert schedule_paper(np.array([[0.8, c2]]), APPENDIX).tolist() == [0]
    # A retrospective global argmax over the FRESH values admits token 2 when c_2 = 0.9
    # (Θ2 = (1 + 0.8 + 0.72) * 0.45 = 1.134) and refuses it when c_2 = 0 (Θ2 = 0.81): the decision on
    # token 2 would depend on x_1 through c_2 -- the leak the paper's early stop prevents.
    fresh_hi = prefix_survival(torch.tensor([[0.8, 0.9]])).numpy()
    fresh_lo = prefix_survival(torch.tensor([[0.8, 0.0]])).numpy()
    nd = np.array([2])
    hi = choose_budget(fresh_hi, nd, 1, 1, APPENDIX, ARGMAX)
    lo = choose_budget(fresh_lo, nd, 1, 1, APPENDIX, ARGMAX)
    assert hi.budget == 2 and hi.theta_best * 1000 == pytest.approx(1.134)
    assert lo.budget == 0 and lo.theta_best * 1000 == pytest.approx(1.0)
    # The "paper" policy applies the same early stop to the (stale) survivals.
    assert choose_budget(fresh_hi, nd, 1, 1, APPENDIX, PAPER).budget == 0


def test_paper_ties_stop_the_walk() -> None:
    # Θ(1) == Θ(0) exactly: strict '>' keeps the shorter verification.
    curve = SpsCurve.from_dict([[1, 1.0], [2, 0.5], [3, 0.2]])
    assert schedule_paper(np.array([[1.0, 1.0]]), curve).tolist() == [0]
    assert schedule_paper(np.array([[1.0, 1.0]]), SpsCurve.from_dict([[1, 1.0], [2, 0.9], [3, 0.8]])).tolist() == [2]


@settings(max_examples=80, deadline=None)
@given(conf_matrix)
# An exact tie of Θ at the last admission (6.2 / 12.4 == 6.45 / 12.9 on STAIR): float64 confidences rounded
# through float32 used to break it the other way.
@example(([[0.3, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.9, 0.0, 0.0, 0.0]], [1, 1, 2, 1]))
def test_paper_walk_matches_a_literal_transcription(data: tuple[list[list[float]], list[int]]) -> None:
    conf, nd = np.array(data[0]), np.array(data[1])
    r, k = conf.shape
    surv = np.cumprod(conf, axis=1)
    got = schedule_paper(torch.tensor(conf), STAIR, num_drafts=torch.tensor(nd))
    # Literal Algorithm 1 from the reference pseudocode.
    cand = sorted((-surv[i, j], j, i) for i in range(r) for j in range(k) if j < nd[i] and surv[i, j] > 0)
    ell, best_ell = [0] * r, [0] * r
    b, tau = r, float(r)
    best = tau / STAIR.step_cost_ms(r, b)
    for neg, j, i in cand:
        ell[i] = j + 1
        b += 1
        tau += -neg
        theta = tau / STAIR.step_cost_ms(r, b)
        if theta > best:
            best, best_ell = theta, list(ell)
        else:
            break
    assert got.tolist() == best_ell
    assert np.all(got <= nd)


# ---------------------------------------------------------------------------------------------- budget


@settings(max_examples=120, deadline=None)
@given(conf_matrix, st.integers(0, 40), st.sampled_from([1.0, 0.5, 0.25]))
def test_choose_budget_matches_brute_force(data: tuple[list[list[float]], list[int]], extra: int, frac: float) -> None:
    conf, nd = np.array(data[0]), np.array(data[1])
    surv = np.cumprod(conf, axis=1)
    r = surv.shape[0]
    cfg = CapacityConfig(mode="varlen", budget_frac=frac, min_predicted_gain=0.0)
    d = choose_budget(surv, nd, r + extra, r, STAIR, cfg)
    assert d.budget == brute_force_budget(surv, nd, r + extra, r, STAIR, frac)
    assert d.budget <= int(np.floor(frac * nd.sum() + 1e-9))
    assert d.total_drafts == int(nd.sum())
    assert d.step_ms == pytest.approx(STAIR.step_cost_ms(r, r + extra + d.budget))
    assert d.theta_no_draft == pytest.approx(r / STAIR.step_cost_ms(r, r + extra, drafting=False))


def test_choose_budget_finds_the_global_max_past_a_shelf() -> None:
    # 16 requests at survival 0.9 then 0.6: 16 + 8 tokens sits on a shelf; early stop parks before it.
    surv = np.cumprod(np.full((16, 3), 0.9), axis=1)
    nd = np.full(16, 3)
    d = choose_budget(surv, nd, 16, 16, STAIR, ARGMAX)
    assert d.budget == brute_force_budget(surv, nd, 16, 16, STAIR)
    assert d.budget == 48
    paper = choose_budget(surv, nd, 16, 16, STAIR, PAPER)
    assert paper.budget == 0 and paper.theta_best < d.theta_best


def test_first_maximum_wins_ties() -> None:
    # Survival 0 adds nothing: Θ is flat or falling after n=1, so the smallest maximiser is taken.
    flat = SpsCurve.from_points([(1, 1.0), (2, 1.0), (3, 1.0), (64, 10.0)], capture_sizes=[1, 2, 3])
    d = choose_budget(np.array([[1.0, 0.0, 0.0]]), np.array([3]), 1, 1, flat, ARGMAX)
    assert d.budget == 1


def test_threshold_policy_counts_slots_and_respects_the_cap() -> None:
    surv = np.array([[0.9, 0.7, 0.2], [0.95, 0.5, 0.1]])
    nd = np.array([3, 3])
    cfg = CapacityConfig(mode="varlen", policy="threshold", threshold=0.5)
    assert choose_budget(surv, nd, 2, 2, STAIR, cfg).budget == 4
    capped = CapacityConfig(mode="varlen", policy="threshold", threshold=0.5, budget_frac=0.5)
    assert choose_budget(surv, nd, 2, 2, STAIR, capped).budget == 3


def test_mask_mode_prices_the_uniform_batch_so_it_never_trims_for_nothing() -> None:
    """A pruned slot of the uniform batch is a padding row the model still computes: trimming saves nothing
    and loses the draft's chance -- unless the engine skips padding rows (MoE with skip-padding)."""
    surv = np.cumprod(np.full((16, 3), 0.9), axis=1)
    nd = np.full(16, 3)
    varlen = choose_budget(surv, nd, 16, 16, STAIR, CapacityConfig(mode="varlen"))
    mask = choose_budget(surv, nd, 16, 16, STAIR, CapacityConfig(mode="mask"))
    skipping = choose_budget(surv, nd, 16, 16, STAIR, CapacityConfig(mode="mask", mask_pruning_saves=True))
    low = np.cumprod(np.full((16, 3), 0.05), axis=1)
    mask_low = choose_budget(low, nd, 16, 16, STAIR, CapacityConfig(mode="mask"))
    varlen_low = choose_budget(low, nd, 16, 16, STAIR, CapacityConfig(mode="varlen"))
    assert varlen_low.budget < 48 and mask_low.budget == 48  # varlen trims poor drafts; mask keeps them
    assert mask.step_ms == pytest.approx(STAIR.step_cost_ms(16, 16 + 48))  # whatever it admits
    assert mask_low.step_ms == mask.step_ms
    assert skipping.budget == varlen.budget and skipping.step_ms == varlen.step_ms
    # survival that adds (almost) nothing leaves Θ flat: a first maximum would still prune for nothing
    tiny = np.concatenate([np.full((4, 4), 0.6), np.full((4, 4), 1e-18)])
    for policy in ("argmax", "paper"):
        d = choose_budget(tiny, np.full(8, 4), 8, 8, STAIR, CapacityConfig(mode="mask", policy=policy))
        assert d.budget == 32, policy
    capped = choose_budget(tiny, np.full(8, 4), 8, 8, STAIR, CapacityConfig(mode="mask", budget_frac=0.5))
    assert capped.budget == 16  # the user's cap is what prunes a mask batch
    # drafting that does not pay is reported as such, so saturation can stop the draft pass in mask mode
    hopeless = choose_budget(np.full((16, 3), 1e-6), nd, 16, 16, STAIR, CapacityConfig(mode="mask"))
    assert not hopeless.pays and hopeless.theta_best < hopeless.theta_no_draft


def test_mask_mode_prices_the_placeholder_drafts_its_uniform_batch_computes() -> None:
    """vLLM admits no placeholder draft (a slot the paused draft skipped), but mask mode's uniform batch still
    computes its rows: priced at the admitted drafts alone, such a step looked cheaper than it runs."""
    surv = np.cumprod(np.full((16, 3), 0.9), axis=1)
    admitted = np.array([3] * 8 + [0] * 8)
    surv[8:] = 0.0
    mask = choose_budget(surv, admitted, 16, 16, STAIR, CapacityConfig(mode="mask"), batch_drafts=48)
    assert mask.budget == 24 and mask.step_ms == pytest.approx(STAIR.step_cost_ms(16, 16 + 48))
    # varlen computes only what it verifies: the placeholders cost nothing there
    varlen = choose_budget(surv, admitted, 16, 16, STAIR, CapacityConfig(mode="varlen"), batch_drafts=48)
    assert varlen.step_ms == pytest.approx(STAIR.step_cost_ms(16, 16 + varlen.budget))


def test_mode_none_verifies_every_draft() -> None:
    surv = np.full((4, 3), 0.01)
    d = choose_budget(surv, np.array([3, 3, 2, 0]), 4, 4, STAIR, CapacityConfig(mode="none", budget_frac=0.1))
    assert d.budget == 8 and d.theta_best == d.theta_all


def test_min_predicted_gain_keeps_the_full_draft_unless_trimming_wins_enough() -> None:
    curve = SpsCurve.from_points([(1, 10.0), (2, 10.6), (64, 80.0)], capture_sizes=[1, 2])
    nd = np.array([1])
    surv = np.array([[0.05]])
    # Θ(0) = 1/10 = 0.1 beats Θ(1) = 1.05/10.6 ≈ 0.0991: trimming predicts a gain of only ≈ 0.95 %.
    plain = choose_budget(surv, nd, 1, 1, curve, ARGMAX)
    assert plain.budget == 0
    gain = (0.1 / (1.05 / 10.6)) - 1
    keep = choose_budget(surv, nd, 1, 1, curve, CapacityConfig(mode="varlen", min_predicted_gain=0.02))
    assert keep.budget == 1 and keep.theta_best == pytest.approx(keep.theta_all)
    trim = choose_budget(surv, nd, 1, 1, curve, CapacityConfig(mode="varlen", min_predicted_gain=gain / 2))
    assert trim.budget == 0


def test_the_default_margin_keeps_the_full_draft_where_trimming_predicts_a_percent() -> None:
    """docs/PERFORMANCE.md section 36 (H100, issue 8's scaled setup: Llama-3-8B shape, k=7, the synthetic drafter's
    survivals): at 16 requests argmax trimmed to 3 drafts a request for a predicted gain of about 1%, and two runs
    realized -0.2% and -5.3%; at 32 requests a predicted 6-7% realized 3-4%. By default a trim must predict
    MIN_PREDICTED_GAIN; the threshold policy still prunes as its threshold says."""
    curve = SpsCurve.from_points(  # the H100's profile, rounded
        [(1, 8.56), (16, 9.57), (32, 9.73), (64, 9.99), (128, 10.76), (256, 12.83), (512, 18.42), (1024, 33.12)],
        [(1, 7.85), (16, 8.17), (32, 8.26), (64, 8.67), (128, 9.94), (256, 12.56)], 2.33,
        [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    surv = np.cumprod([0.8, 0.56, 0.392, 0.274, 0.192, 0.134, 0.0941])
    default = CapacityConfig(mode="varlen")
    assert default.trim_margin == MIN_PREDICTED_GAIN > 0
    for r, kept in ((16, 112), (32, 96), (64, 192)):
        batch = np.tile(surv, (r, 1))
        argmax = choose_budget(batch, np.full(r, 7), r, r, curve, ARGMAX)
        d = choose_budget(batch, np.full(r, 7), r, r, curve, default)
        assert d.budget == kept, r
        gain = argmax.theta_best / argmax.theta_all - 1
        assert (d.budget == d.total_drafts) == (gain < MIN_PREDICTED_GAIN) and argmax.budget < argmax.total_drafts
    threshold = CapacityConfig(mode="varlen", policy="threshold", threshold=0.1)
    assert threshold.trim_margin == 0.0
    assert choose_budget(np.tile(surv, (16, 1)), np.full(16, 7), 16, 16, curve, threshold).budget == 48


def test_the_margin_keeps_a_trim_that_pays_where_the_full_draft_does_not() -> None:
    """A trim predicted to beat plain decoding where the full draft is predicted to lose to it is no marginal win:
    kept full, the step would count as losing and push the saturation policy toward a pause."""
    # one request: verifying t tokens costs 5 + t ms, the draft pass 8 ms; plain decoding 6 ms
    curve = SpsCurve.from_points([(1, 6.0), (2, 7.0), (3, 8.0), (4, 9.0), (5, 10.0)], [(1, 8.0)], 0.0,
                                 [1, 2, 3, 4, 5])
    surv = np.cumprod([[0.9, 0.7, 0.5, 0.45]], axis=1)
    plain = choose_budget(surv, np.array([4]), 1, 1, curve, ARGMAX)
    d = choose_budget(surv, np.array([4]), 1, 1, curve, CapacityConfig(mode="varlen"))
    assert plain.budget < 4 and plain.pays and d.theta_all <= d.theta_no_draft  # the trim pays, the full draft not
    assert d.theta_best / d.theta_all - 1 < MIN_PREDICTED_GAIN  # ... by less than the margin
    assert d.budget == plain.budget and d.pays


def test_budget_decision_reports_predictions() -> None:
    surv = np.cumprod(np.full((4, 3), 0.8), axis=1)
    d = choose_budget(surv, np.full(4, 3), 4, 4, STAIR, ARGMAX)
    assert isinstance(d, BudgetDecision)
    n = np.arange(13)
    vals = np.sort(surv.ravel())[::-1]
    theta = (4 + np.r_[0, np.cumsum(vals)]) / STAIR.step_cost_ms(4, 4 + n)
    assert d.theta_best == pytest.approx(theta.max())
    assert d.theta_all == pytest.approx(theta[-1])


def test_sampling_batches_are_priced_with_the_sampling_draft_pass() -> None:
    """A greedy batch whose drafts pay can stop paying when the batch samples: the sampling draft pass is
    another program (sampled drafts and their distributions), priced by the curve's sampling draft cost."""
    curve = SpsCurve.from_points([(1, 10.0), (64, 10.5), (512, 14.0)], [(1, 2.0), (64, 2.0)], 0.5,
                                 draft_sampling_ms=[(1, 20.0), (64, 20.0)])
    surv = np.cumprod(np.full((8, 4), 0.6), axis=1)
    greedy = choose_budget(surv, np.full(8, 4), 8, 8, curve, ARGMAX)
    sampled = choose_budget(surv, np.full(8, 4), 8, 8, curve, ARGMAX, sampling=True)
    assert greedy.pays and greedy.budget > 0
    assert not sampled.pays
    assert sampled.theta_no_draft == pytest.approx(greedy.theta_no_draft)  # plain decoding runs no draft
    assert sampled.step_ms == pytest.approx(float(curve.step_cost_ms(8, 8 + sampled.budget, sampling=True)))


def test_empty_batch() -> None:
    d = choose_budget(np.zeros((0, 4)), np.zeros(0, dtype=int), 0, 0, STAIR, ARGMAX)
    assert d.budget == 0 and d.total_drafts == 0
    assert allocate(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), 3).shape == (0,)


# ---------------------------------------------------------------------------------------------- allocation


@settings(max_examples=150, deadline=None)
@given(conf_matrix, st.integers(0, 40))
def test_allocation_is_prefix_shaped_and_sums_to_the_budget(data: tuple[list[list[float]], list[int]],
                                                            budget: int) -> None:
    conf, nd = torch.tensor(data[0]), torch.tensor(data[1])
    surv = prefix_survival(conf)
    got = allocate(surv, nd, budget)
    assert got.dtype == torch.int32
    s, n = surv.numpy(), nd.numpy()
    valid_pos = sum(int(((np.arange(s.shape[1]) < n[i]) & (s[i] > 0)).sum()) for i in range(len(n)))
    assert int(got.sum()) == min(budget, valid_pos)
    # Prefix-shaped: the admitted count per row covers only valid, positive slots from position 1.
    for i in range(len(n)):
        assert 0 <= int(got[i]) <= n[i]
        assert np.all(s[i, : int(got[i])] > 0)
    assert got.numpy().tolist() == reference_allocation(s, n, budget).tolist()
    # A 0-d tensor budget (as replayed by a captured graph) gives the same answer.
    assert torch.equal(allocate(surv, nd, torch.tensor(budget)), got)


@settings(max_examples=100, deadline=None)
@given(conf_matrix, st.integers(0, 40), st.randoms(use_true_random=False))
def test_decisions_do_not_depend_on_request_order(data: tuple[list[list[float]], list[int]], budget: int,
                                                 rnd) -> None:
    conf, nd = np.array(data[0]), np.array(data[1])
    perm = list(range(len(nd)))
    rnd.shuffle(perm)
    surv = np.cumprod(conf, axis=1)
    a = allocate(torch.tensor(surv), torch.tensor(nd), budget).numpy()
    b = allocate(torch.tensor(surv[perm]), torch.tensor(nd[perm]), budget).numpy()
    # Ties break by (position, request), never by value noise: how many slots win at each position and
    # the survival mass admitted are independent of request order.
    def per_position(alloc: np.ndarray) -> np.ndarray:
        return np.array([(alloc > j).sum() for j in range(conf.shape[1])])

    def mass(s: np.ndarray, alloc: np.ndarray) -> float:
        return float(sum(s[i, : alloc[i]].sum() for i in range(len(alloc))))

    assert per_position(a).tolist() == per_position(b).tolist()
    assert mass(surv, a) == pytest.approx(mass(surv[perm], b))
    # Rows whose values are all distinct from every other row's follow their request exactly.
    for new_i, old_i in enumerate(perm):
        if len({*surv[old_i]} & {*np.delete(surv, old_i, axis=0).ravel()}) == 0:
            assert b[new_i] == a[old_i]
    # And the budget itself is order-free.
    assert choose_budget(surv, nd, 8, len(nd), STAIR, ARGMAX) == choose_budget(surv[perm], nd[perm], 8, len(nd),
                                                                                STAIR, ARGMAX)


def test_ties_prefer_earlier_positions_then_lower_requests() -> None:
    surv = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    nd = torch.tensor([3, 3])
    assert allocate(surv, nd, 1).tolist() == [1, 0]
    assert allocate(surv, nd, 2).tolist() == [1, 1]
    assert allocate(surv, nd, 3).tolist() == [2, 1]


def test_allocation_ignores_invalid_and_zero_slots() -> None:
    surv = torch.tensor([[0.9, 0.8, 0.7], [0.95, 0.0, 0.0], [0.99, 0.98, 0.97]])
    nd = torch.tensor([3, 3, 1])
    assert allocate(surv, nd, 100).tolist() == [3, 1, 1]
    assert allocate(surv, nd, 3).tolist() == [1, 1, 1]
    # A non-monotone hand-made row is still admitted as a prefix.
    assert allocate(torch.tensor([[0.2, 0.9]]), torch.tensor([2]), 1).tolist() == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocation_on_cuda_is_sync_free_and_matches_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(64, 7, generator=g)
    nd = torch.randint(0, 8, (64,), generator=g)
    surv = prefix_survival(conf)
    budget = torch.tensor(100, device="cuda")
    surv_c, nd_c = surv.cuda(), nd.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = allocate(surv_c, nd_c, budget)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), allocate(surv, nd, 100))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocation_captured_in_a_cuda_graph_replays_any_budget() -> None:
    g = torch.Generator().manual_seed(1)
    surv = prefix_survival(torch.rand(32, 5, generator=g)).cuda()
    nd = torch.randint(0, 6, (32,), generator=g).cuda()
    budget = torch.zeros((), dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        allocate(surv, nd, budget)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = allocate(surv, nd, budget)
    for b in (0, 7, 40, 1000):
        budget.fill_(b)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), allocate(surv.cpu(), nd.cpu(), b))


_ALLOC_CASES = """
import torch
from dspark_cli.core.capacity import allocate

def cases(gen, trials):
    # (survival, num_drafts, budgets): plain, heavy ties with zeros, NaN/negative/-0/inf/subnormal, bf16 ties.
    for trial in range(trials):
        r = int(torch.randint(1, 300, (1,), generator=gen))
        k = int(torch.randint(1, 9, (1,), generator=gen))
        mode = trial % 4
        if mode == 0:
            s = torch.rand(r, k, generator=gen)
        elif mode == 1:
            s = torch.tensor([0.0, 0.25, 0.5, 0.5, 1.0])[torch.randint(0, 5, (r, k), generator=gen)]
        elif mode == 2:
            s = torch.tensor([float("nan"), -0.5, -0.0, 0.0, 1e-40, 0.3, float("inf"), 0.3])[
                torch.randint(0, 8, (r, k), generator=gen)]
        else:
            s = torch.cumprod(torch.rand(r, k, generator=gen).pow(0.3), 1).to(torch.bfloat16).float()
        nd = torch.randint(-1, k + 2, (r,), generator=gen)
        valid = int(((torch.arange(k) < nd.unsqueeze(1)) & (s.nan_to_num(0.0).cummin(1).values > 0)).sum())
        budgets = {0, -3, 1, max(valid - 1, 0), valid, r * k + 5, int(torch.randint(0, r * k + 1, (1,), generator=gen))}
        yield s, nd, sorted(budgets)

def check(device, trials):
    gen = torch.Generator().manual_seed(0)
    n = 0
    for s, nd, budgets in cases(gen, trials):
        s, nd = s.to(device), nd.to(device)
        for budget in budgets:
            for b in (budget, torch.tensor(budget, device=device)):
                ref = allocate(s, nd, b, use_triton=False)
                got = allocate(s, nd, b, use_triton=True)
                assert got.dtype == torch.int32 and torch.equal(ref, got), (s.shape, budget, ref, got)
                n += 1
    return n
"""


def test_triton_allocation_matches_torch_in_interpreter() -> None:
    # The single-launch kernel must equal the sort-based reference bit for bit (ties, NaN, zeros, budgets
    # 0 / negative / >= #valid). TRITON_INTERPRET must be set before triton is imported: subprocess.
    pytest.importorskip("triton")
    code = _ALLOC_CASES + "\nprint('alloc-ok', check('cpu', 8))\n"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "alloc-ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_allocation_matches_torch_on_cuda() -> None:
    pytest.importorskip("triton")
    scope: dict = {}
    exec(_ALLOC_CASES, scope)
    assert scope["check"]("cuda", 40) > 0


# ---------------------------------------------------------------------------------------------- saturation


def _decision(budget: int, best: float, nodraft: float) -> BudgetDecision:
    return BudgetDecision(budget=budget, theta_best=best, theta_all=best, theta_no_draft=nodraft, step_ms=1.0,
                          total_drafts=10)


def test_saturation_pauses_after_patience_and_probes() -> None:
    pol = SaturationPolicy(patience=3, resume_every=4)
    losing = _decision(0, 0.9, 1.0)
    paying = _decision(5, 1.2, 1.0)
    for _ in range(2):
        assert pol.begin_step(100)
        pol.observe(losing, num_running=100)
    pol.begin_step(100)
    pol.observe(paying, 100)  # a paying step resets the streak
    for _ in range(3):
        assert pol.begin_step(100)
        pol.observe(_decision(3, 0.95, 1.0), 100)  # budget > 0 but no better than plain decoding
    assert not pol.drafting_enabled
    # Paused: steps 1..3 skip drafting, step 4 is a probe; a losing probe keeps the pause and doubles
    # the wait before the next one (8 steps), and so on up to MAX_PROBE_BACKOFF x resume_every.
    assert [pol.begin_step(100) for _ in range(3)] == [False, False, False]
    assert pol.begin_step(100) and pol.probing
    pol.observe(losing, 100)
    assert not pol.drafting_enabled and not pol.probing and pol.probe_wait == 8
    assert [pol.begin_step(100) for _ in range(7)] == [False] * 7
    assert pol.begin_step(100) and pol.probing
    pol.observe(losing, 100)
    assert pol.probe_wait == 16
    for _ in range(10):  # keeps losing: the wait saturates
        while not pol.begin_step(100):
            pass
        pol.observe(losing, 100)
    assert pol.probe_wait == SaturationPolicy.MAX_PROBE_BACKOFF * 4
    while not pol.begin_step(100):
        pass
    pol.observe(paying, 100)
    assert pol.drafting_enabled
    # The resume lost again within 2 x patience steps: a probe's false positive, so the backoff goes on.
    for _ in range(3):
        pol.begin_step(100)
        pol.observe(losing, 100)
    assert not pol.drafting_enabled and pol.probe_wait == SaturationPolicy.MAX_PROBE_BACKOFF * 4
    while not pol.begin_step(100):
        pass
    pol.observe(paying, 100)
    # Drafting that paid for a while before losing again: the next pause starts probing at resume_every.
    for _ in range(7):
        pol.begin_step(100)
        pol.observe(paying, 100)
    for _ in range(3):
        pol.begin_step(100)
        pol.observe(losing, 100)
    assert not pol.drafting_enabled and pol.probe_wait == 4


def test_step_time_calibration_compares_drafting_with_plain_steps() -> None:
    cal = StepTimeCalibration(memory=8)
    assert cal.relative_draft_cost(4) == 1.0  # nothing measured: trust the curve
    cal.record(True, 4, measured_ms=30.0, priced_ms=20.0)
    assert cal.ratio(True, 4) == pytest.approx(1.5) and cal.ratio(False, 4) is None
    assert cal.relative_draft_cost(4) == 1.0  # plain decoding not measured yet
    cal.record(False, 4, measured_ms=12.0, priced_ms=10.0)
    assert cal.relative_draft_cost(4) == pytest.approx(1.5 / 1.2)
    cal.record(True, 4, measured_ms=1e6, priced_ms=1.0)  # a compile stall pulls by the clamp at most
    assert cal.ratio(True, 4) < 4.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        cal.record(False, 4, measured_ms=bad, priced_ms=10.0)
    assert cal.num_samples == {True: 2, False: 1}


def test_step_time_calibration_judges_each_load_by_its_own_bucket() -> None:
    """Host work the curve does not price weighs more at 256 requests than at 16 (say plain steps 4x / 1.36x
    their price, drafting 1.9x / 1.45x): each load gets its own quotient, a load never measured borrows the
    nearest one's (the lower one on a tie) where that errs on its own side -- a heavier load's quotient below 1
    would understate drafting at a lighter one, a lighter load's above 1 overstate it at a heavier one: the
    curve's own 1 instead."""
    cal = StepTimeCalibration()
    assert [cal.load_bucket(r) for r in (1, 2, 3, 4, 15, 16, 31, 256, 511)] == [1, 2, 2, 3, 4, 5, 5, 9, 9]
    for _ in range(50):
        cal.record(True, 256, measured_ms=1.9 * 16.0, priced_ms=16.0)
        cal.record(False, 256, measured_ms=4.0 * 4.4, priced_ms=4.4)
    assert cal.relative_draft_cost(16) == 1.0  # only 256 measured: its 0.475 would understate a light load
    assert cal.relative_draft_cost(1024) == pytest.approx(1.9 / 4.0)  # heavier still: borrowed
    for _ in range(50):
        cal.record(True, 16, measured_ms=1.45 * 9.2, priced_ms=9.2)
        cal.record(False, 16, measured_ms=1.36 * 4.0, priced_ms=4.0)
    assert cal.relative_draft_cost(16) == pytest.approx(1.45 / 1.36)
    assert cal.relative_draft_cost(20) == pytest.approx(1.45 / 1.36)  # same bucket
    assert cal.relative_draft_cost(256) == pytest.approx(1.9 / 4.0)
    assert cal.relative_draft_cost(8) == pytest.approx(1.45 / 1.36)  # a heavier load's quotient above 1: borrowed
    assert cal.relative_draft_cost(64) == 1.0  # 2 buckets from 16, 2 from 256: 16's 1.07 would overstate it
    assert cal.relative_draft_cost(128) == 1.0  # 256's 0.475 would understate it
    assert cal.ratios(False) == {5: pytest.approx(1.36), 9: pytest.approx(4.0)}  # what each load's plain steps read
    assert cal.ratios(True) == {5: pytest.approx(1.45), 9: pytest.approx(1.9)}


def test_a_load_never_drafted_at_is_judged_by_its_plain_steps_excess() -> None:
    """vLLM on the H200 (Llama-3-8B shape, docs/PERFORMANCE.md section 18): served plain steps at 256 requests
    took 36.0 ms against a 22.99 ms price, so ~13 ms per step is work the curve does not see, and a drafting
    step (priced 62.42 ms) carries it too. Drafting was measured only at 16 requests, host-bound at 2.6x its
    price relative to plain steps; borrowed at 256, every rise probe failed where drafting paid by 21%."""
    cal = StepTimeCalibration()
    for _ in range(50):
        cal.record(True, 16, measured_ms=2.6 * 18.52, priced_ms=18.52)
        cal.record(False, 16, measured_ms=6.71, priced_ms=6.71)
        cal.record(False, 256, measured_ms=36.0, priced_ms=22.99)
    q_plain = 36.0 / 22.99
    prior = (62.42 + (q_plain - 1.0) * 22.99) / 62.42 / q_plain
    assert cal.relative_draft_cost(256, 62.42, 22.99) == pytest.approx(prior)
    assert prior == pytest.approx(0.772, abs=1e-3)
    # without prices: the nearest bucket's 2.6 would overstate drafting at a heavier load; the curve's own 1
    assert cal.relative_draft_cost(256) == 1.0
    # Verify-all's acceptance (2.933 per request) at that price beats plain decoding at the prior, not borrowed.
    policy = SaturationPolicy(patience=1, resume_every=4)
    decision = BudgetDecision(budget=7 * 256, theta_best=2.0, theta_all=2.0, theta_no_draft=256 / 22.99,
                              step_ms=62.42, total_drafts=7 * 256, plain_ms=22.99)
    realized = (256 * 2.933 / (62.42 * prior)) / decision.theta_no_draft
    assert realized > 1.3 and (256 * 2.933 / (62.42 * 2.6)) / decision.theta_no_draft < 0.6
    timer = StepTimer(policy)
    timer.step_times = cal
    assert timer.cost_scale(256, decision) == pytest.approx(prior)
    # Once drafting at 256 is measured, its own quotient decides; a plain-only excess below the price works too.
    for _ in range(50):
        cal.record(True, 256, measured_ms=87.2, priced_ms=62.42)
    assert cal.relative_draft_cost(256, 62.42, 22.99) == pytest.approx((87.2 / 62.42) / q_plain)
    fast = StepTimeCalibration()
    fast.record(False, 64, measured_ms=8.96, priced_ms=9.8)
    assert fast.relative_draft_cost(64, 32.24, 9.8) == pytest.approx((32.24 - 0.84) / 32.24 / (8.96 / 9.8))


def test_probe_steps_never_enter_the_calibration() -> None:
    """A probe's step is not what drafting costs once it runs (the catch-up over the pause, first use at a
    load): on vLLM probes measured about twice the steady quotient at 16, 64 and 256 requests."""
    policy = SaturationPolicy(patience=1, resume_every=2)
    timer = StepTimer(policy)
    decision = _decision(budget=4, best=0.5, nodraft=1.0)  # drafting loses: pause after one step
    assert timer.begin_step(8)
    policy.observe(decision, num_running=8)
    timer.record(True, 8, 20.0, 10.0)
    assert not policy.drafting_enabled
    probes = 0
    for _ in range(64):
        if timer.begin_step(8):
            probes += 1
            assert timer.probe_step
            timer.record(True, 8, 80.0, 10.0)  # judged below; its time must not calibrate
            policy.observe(decision, num_running=8)
        else:
            timer.record(False, 8, 10.0, 10.0)
    assert probes > 0
    assert timer.step_times.ratio(True, 8) == pytest.approx(2.0)  # the one non-probe drafting step only


# docs/PERFORMANCE.md section 22, mask + SPS (no STS) at 128 requests on an H200, temperature 1, k = 7: the curve
# prices a drafting step at 11.88 ms (full batch, sampling draft) and a plain one at 4.07 ms; the cell's drafting
# steps took 14.53 ms and its paused steps 5.57 ms for 1.644 tokens per request and step (~0.6x plain decoding).
H200_128_DRAFT_MS, H200_128_PLAIN_MS = 11.88, 4.07


def _h200_decision(num_reqs: int) -> BudgetDecision:
    # Confidently wrong (no STS): every step is predicted to pay, so only the realized gain can pause drafting.
    return BudgetDecision(budget=7 * num_reqs, theta_best=8 * num_reqs / H200_128_DRAFT_MS,
                          theta_all=8 * num_reqs / H200_128_DRAFT_MS, theta_no_draft=num_reqs / H200_128_PLAIN_MS,
                          step_ms=H200_128_DRAFT_MS, total_drafts=7 * num_reqs, plain_ms=H200_128_PLAIN_MS)


def _h200_step(timer: StepTimer, num_reqs: int, tokens_per_req: float, draft_ratio: float, plain_ratio: float) -> bool:
    """One engine step as the embedded engine runs it (begin, judge the outcome, report the time); whether it drafted."""
    if not timer.begin_step(num_reqs):
        timer.record(False, num_reqs, plain_ratio * H200_128_PLAIN_MS, H200_128_PLAIN_MS)
        return False
    decision = _h200_decision(num_reqs)
    timer.saturation.observe_outcome(decision, round(num_reqs * tokens_per_req), num_reqs,
                                     timer.cost_scale(num_reqs, decision))
    timer.record(True, num_reqs, draft_ratio * H200_128_DRAFT_MS, H200_128_DRAFT_MS)
    return True


def test_a_resume_is_judged_against_plain_steps_of_now_not_of_the_warm_up() -> None:
    """Section 22's 128-request cell replayed: the shape warm-up had timed the 128-255 bucket's plain steps at
    2.74x their price (the 256-request cell's plain steps: 11.38 ms at a 4.16 ms price) and its drafting at its
    price, a quotient of 0.37, as the cells' gauges showed until the 128-request cell. A rise probe paid there on
    that quotient, and drafting at 128 (14.53 ms, 1.22x its price, against paused steps 1.37x theirs) was
    compared with that plain window for one plain sample per 64 steps: 128-132 drafting steps at ~0.6x plain
    decoding, where patience 8 should have paused within about 10. Now the stale window does not judge: the rise
    probe waits for the load to settle, and those paused steps time plain decoding at 128 afresh; it fails on
    them."""
    pol = SaturationPolicy(patience=8, resume_every=16)
    timer = StepTimer(pol)
    for _ in range(10):  # the warm-up wave, in the 128-255 bucket
        timer.record(True, 200, H200_128_DRAFT_MS, H200_128_DRAFT_MS)
        timer.record(False, 200, 2.74 * H200_128_PLAIN_MS, H200_128_PLAIN_MS)
    bucket = StepTimeCalibration.load_bucket(128)
    assert timer.step_times.quotients()[bucket] == pytest.approx(1 / 2.74)
    for _ in range(3000):  # cells at 16-64 requests: drafting pauses at 64 and stays paused
        _h200_step(timer, 64, 1.6, 1.23, 1.57)
    assert not pol.drafting_enabled and pol.top == 64
    assert not timer.step_times.times_load(128)  # the warm-up's plain window there is stale
    draft_ratio, plain_ratio = 14.53 / H200_128_DRAFT_MS, 5.57 / H200_128_PLAIN_MS
    steps = [_h200_step(timer, 128, 1.644, draft_ratio, plain_ratio) for _ in range(300)]
    # paused steps while the load settles (they time it), then the rise probe
    assert steps[:LOAD_SETTLE_STEPS + 1] == [False] * LOAD_SETTLE_STEPS + [True]
    assert pol.counters.rising_probe_steps == LOAD_SETTLE_STEPS and pol.counters.unmeasured_probe_steps == 0
    assert pol.counters.probes["rise", "failed"] == 1 and pol.counters.probes["rise", "paid"] == 0
    assert pol.counters.pauses == 1 and sum(steps) <= 3  # the rise probe and the backed-off timer's
    assert timer.step_times.ratio(False, 128) == pytest.approx(plain_ratio)  # the warm-up's window was dropped


def _drive_timer(timer: StepTimer, load: int, steps: int, measured_ms, timed=lambda d: True) -> list[bool]:
    """One timed plain step at ``load`` (priced 10 ms), then ``steps`` steps as ``timer`` decides them, each
    recorded at ``measured_ms(i, drafted)`` against a 10 ms price, calibrated where ``timed(drafted)``; returns
    which steps drafted."""
    timer.record(False, load, 10.0, 10.0)
    drafted = []
    for i in range(steps):
        d = timer.begin_step(load)
        drafted.append(d)
        timer.record(d, load, measured_ms(i, d), 10.0, calibrate=timed(d))
    return drafted


def test_steady_drafting_keeps_one_plain_sample_per_interval() -> None:
    """At one load the plain window is fed every PLAIN_SAMPLE_EVERY + 1 steps, inside STEP_TIME_STALE: no extra
    plain steps, and the plain samples keep averaging (a noisy one does not replace the window)."""
    assert STEP_TIME_STALE > PLAIN_SAMPLE_EVERY + 1
    timer = StepTimer(SaturationPolicy(patience=8, resume_every=16))
    drafted = _drive_timer(timer, 16, 4 * (PLAIN_SAMPLE_EVERY + 1),
                           lambda i, d: 10.0 if d else (20.0 if i == PLAIN_SAMPLE_EVERY else 10.0))
    assert drafted.count(False) == 4
    assert 1.0 < timer.step_times.ratio(False, 16) < 2.0  # the 2x sample was blended, not taken alone


def test_a_plain_sample_that_cannot_be_timed_still_ends_the_drafting_run() -> None:
    """A plain sample whose step carried other work (a prompt chunk, a catch-up) is recorded uncalibrated. It
    used to leave the count of drafting steps since the last plain one as it was, so every later step was
    another plain sample until a timed one came: where no step at a load is timed, drafting never ran there
    again (a replay of section 27's 256-request cell drafted 65 of 300 steps after its probe paid)."""
    timer = StepTimer(SaturationPolicy(patience=8, resume_every=16))
    drafted = _drive_timer(timer, 256, 3 * (PLAIN_SAMPLE_EVERY + 1), lambda i, d: 10.0,
                           timed=lambda d: d)  # no plain step is timed
    # one plain sample per interval, as while its steps were timed: the stale window (past STEP_TIME_STALE timed
    # drafting steps) does not turn every other step into one
    assert [i for i, d in enumerate(drafted) if not d] == [PLAIN_SAMPLE_EVERY + i * (PLAIN_SAMPLE_EVERY + 1)
                                                           for i in range(3)]


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_a_plain_sample_whose_time_comes_back_late_is_taken_once(lag: int) -> None:
    """vLLM on CUDA reports a step's time a step or two after the next one began (engines/vllm/step_clock.py).
    Drafting that starts at a load never measured takes one plain sample after one drafting step, then drafts
    on while that sample's time is on its way; counted at its record, each of those steps was another plain
    sample (plain and drafting alternating for ``lag`` steps). Late records leave the samples where prompt
    records put them."""
    timer = StepTimer(SaturationPolicy(patience=8, resume_every=16))
    timer.record(False, 4, 10.0, 10.0)  # the engine times its steps
    in_flight: list[bool] = []
    drafted = []
    for _ in range(2 * (PLAIN_SAMPLE_EVERY + 1)):
        d = timer.begin_step(64)
        drafted.append(d)
        in_flight.append(d)
        while len(in_flight) > lag:
            timer.record(in_flight.pop(0), 64, 10.0, 10.0)
    assert [i for i, d in enumerate(drafted) if not d] == [1, PLAIN_SAMPLE_EVERY + 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.3, 3.5), min_size=1, max_size=30), st.integers(0, 3 * STEP_TIME_STALE),
       st.floats(0.3, 3.5), st.integers(1, 256))
def test_a_stale_window_restarts_and_a_fresh_one_blends(history: list[float], gap: int, now: float,
                                                         num_reqs: int) -> None:
    """Whatever a bucket measured before, a sample after more than STEP_TIME_STALE timed steps elsewhere is the
    window's whole value; within it, the sample is blended as before (request-weighted)."""
    cal = StepTimeCalibration()
    for ratio in history:
        cal.record(False, num_reqs, ratio * 4.0, 4.0)
    before = cal.ratio(False, num_reqs)
    other = 512 if num_reqs < 256 else 1  # another bucket keeps the clock going
    for _ in range(gap):
        cal.record(True, other, 8.0, 8.0)
    assert cal.plain_is_stale(num_reqs) == (gap > STEP_TIME_STALE)
    assert not cal.plain_is_stale(3 * other)  # never measured: not stale
    cal.record(False, num_reqs, now * 4.0, 4.0)
    after = cal.ratio(False, num_reqs)
    assert after is not None and before is not None
    if gap > STEP_TIME_STALE:
        assert after == pytest.approx(now)
    else:
        expected = RequestWeightedMean(STEP_TIME_MEMORY)
        for ratio in [*history, now]:
            expected.add(ratio, num_reqs)
        assert after == pytest.approx(expected.value)
    assert not cal.plain_is_stale(num_reqs)


def test_heavy_load_calibration_does_not_make_drafting_at_light_load_look_cheap() -> None:
    """After a heavy phase had filled one all-loads window, the H200 real-setup cells at 16 requests drafted
    every step at a loss (PERFORMANCE section 12): with windows per load the light load pauses within
    patience."""
    curve = SpsCurve.from_points([(16, 3.0), (128, 3.3), (2048, 6.1)], [(16, 4.9), (256, 9.2)], 0.9)  # H200 real
    cfg = CapacityConfig(mode="mask", policy="argmax", saturation_patience=8, resume_every=4)
    mgr = CapacityManager(cfg, curve, 7, 256, "cpu")
    for _ in range(40):  # the heavy load: drafting 1.9x its price, plain steps 4x theirs
        priced = float(curve.step_cost_ms(256, 256 * 8, drafting=True, sampling=True))
        mgr.record_step_time(True, 256, 1.9 * priced, priced)
        mgr.record_step_time(False, 256, 4.0 * float(curve.step_cost_ms(256, 256, drafting=False)))
    for _ in range(8):  # a few plain steps at the light load
        mgr.record_step_time(False, 16, 1.36 * float(curve.step_cost_ms(16, 16, drafting=False)))
    slots = np.arange(16)
    drafted, first_pause = 0, None
    for _ in range(40):
        if not mgr.begin_step(16):
            first_pause = drafted if first_pause is None else first_pause
            mgr.record_step_time(False, 16, 1.36 * float(curve.step_cost_ms(16, 16, drafting=False)))
            continue
        drafted += 1
        mgr.record_confidences(torch.from_numpy(slots), torch.full((16, 7), 0.9))  # confidently wrong
        decision = mgr.plan(slots, np.full(16, 7), 16, 16, defer_saturation=True, sampling=True)
        mgr.record_outcome(16 + 10)  # acceptance length 1.63, as measured
        mgr.record_step_time(True, 16, 1.45 * decision.step_ms)
    assert not mgr.drafting_enabled
    # patience losing steps, then paused; the first drafting step at this load borrows the heavy load's
    # quotient until its own is measured, and the realized window remembers it for a step or two
    assert first_pause is not None and first_pause <= 8 + 2
    assert drafted <= first_pause + 3  # and only probes after that, backing off
    assert mgr.step_times.relative_draft_cost(16) > 1.0 > mgr.step_times.relative_draft_cost(256)


def _timed_manager(patience: int) -> CapacityManager:
    curve = SpsCurve.from_points([(1, 10.0), (64, 10.5), (512, 14.0)], [(1, 2.0), (64, 2.0)], 0.5)
    cfg = CapacityConfig(mode="varlen", policy="argmax", saturation_patience=patience, resume_every=4)
    return CapacityManager(cfg, curve, 4, 8, "cpu")


def _timed_step(mgr: CapacityManager, drafted_ms_scale: float, emitted: int) -> bool:
    """One engine step: begin, plan and judge a drafting step, report its time; returns whether it drafted."""
    slots = np.arange(8)
    if not mgr.begin_step(8):
        mgr.record_step_time(False, 8, float(mgr.curve.step_cost_ms(8, 8, drafting=False)))
        return False
    mgr.record_confidences(torch.from_numpy(slots), torch.full((8, 4), 0.9))
    decision = mgr.plan(slots, np.full(8, 4), 8, 8, defer_saturation=True)
    mgr.record_outcome(emitted)
    mgr.record_step_time(True, 8, decision.step_ms * drafted_ms_scale)
    return True


def test_a_probe_is_not_planned_on_the_confidences_that_paused_drafting() -> None:
    # Drafting paused on confidences of 0.05 (the budget verified nothing); by the time the timer probes they are
    # 0.95. A probe plans on the snapshot before its own, which was taken before the pause: it verified nothing,
    # was judged failed and doubled the wait. A snapshot older than the pause now reads as unknown (1).
    cfg = CapacityConfig(mode="varlen", policy="argmax", saturation_patience=2, resume_every=4)
    curve = SpsCurve.from_points([(1, 10.0), (64, 10.5), (512, 14.0)], [(1, 2.0), (64, 2.0)], 0.5)
    mgr = CapacityManager(cfg, curve, 4, 16, "cpu")
    slots = np.arange(16)  # a probe of 16 requests is judged on its first step (PROBE_REQUEST_STEPS)
    budgets = []
    for conf, emitted in ((0.05, 16), (0.95, 16 + 48)):
        for _ in range(12):
            if not mgr.begin_step(16):
                continue
            mgr.record_confidences(torch.from_numpy(slots), torch.full((16, 4), conf))
            decision = mgr.plan(slots, np.full(16, 4), 16, 16, defer_saturation=True)
            budgets.append((conf, mgr.saturation.probing, decision.budget))
            mgr.record_outcome(emitted)
        if conf == 0.05:
            assert not mgr.drafting_enabled
    probes = [b for c, probing, b in budgets if probing]
    assert probes and probes[0] > 0, budgets
    assert mgr.saturation.counters.probes["timer", "paid"] == 1 and mgr.drafting_enabled


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.floats(0.25, 4.0))
def test_a_plain_step_is_priced_as_the_curve_prices_it_at_any_load(num_reqs: int, scale: float) -> None:
    """record_step_time prices plain steps from a table built once (within the manager's slots) and from the
    curve beyond them: either way the calibration sees measured over the curve's plain price."""
    mgr = _timed_manager(patience=8)  # 8 slots: loads past 8 take the curve's own path
    priced = float(mgr.curve.step_cost_ms(num_reqs, num_reqs, drafting=False))
    mgr.record_step_time(False, num_reqs, scale * priced)
    assert mgr.step_times.ratio(False, num_reqs) == pytest.approx(min(max(scale, 0.25), 4.0))


def test_timed_engines_get_a_plain_measuring_step_and_its_price_judges_drafting() -> None:
    # Drafting steps take what the curve says, so they keep paying; the first drafting step at a load is
    # followed by a plain one (nothing measured plain decoding there yet), then every PLAIN_SAMPLE_EVERY timed
    # drafting steps one step is plain, to keep measuring it.
    mgr = _timed_manager(patience=4)
    drafted = [_timed_step(mgr, 1.0, emitted=8 + 8) for _ in range(2 * PLAIN_SAMPLE_EVERY + 2)]
    assert [i for i, d in enumerate(drafted) if not d] == [1, PLAIN_SAMPLE_EVERY + 2]
    assert mgr.drafting_enabled
    # The same outcomes when drafting steps really cost 3x their price relative to plain decoding: the
    # measured windows catch up and the saturation policy pauses drafting -- within patience of the first plain
    # sample, not after PLAIN_SAMPLE_EVERY steps on the curve's word (section 30: a fresh vLLM server drafted
    # ~90 steps at 256 requests at about half plain decoding's pace before it paused).
    mgr = _timed_manager(patience=4)
    drafted = [_timed_step(mgr, 3.0, emitted=8 + 8) for _ in range(20)]
    assert mgr.step_times.relative_draft_cost(8) > 2.0
    assert not mgr.drafting_enabled
    assert drafted.index(False) == 1 and drafted[2:].index(False) <= 4 + 1
    # A long pause forgets what drafting cost (its window goes stale: section 35), so a probe now and then is
    # judged as at a load drafting never ran at, may resume on the curve's word, and pauses again once drafting
    # is measured: the backoff keeps that to a sliver of the steps.
    drafted += [_timed_step(mgr, 3.0, emitted=8 + 8) for _ in range(4000)]
    assert sum(drafted) <= 0.02 * len(drafted), sum(drafted)
    # Patience 0 never pauses, so it never measures plain decoding either.
    mgr = _timed_manager(patience=0)
    assert all(_timed_step(mgr, 1.0, emitted=8 + 8) for _ in range(2 * PLAIN_SAMPLE_EVERY))


def test_saturation_probes_when_load_falls_and_resumes_only_if_the_probe_pays() -> None:
    pol = SaturationPolicy(patience=1, resume_every=1000)
    pol.begin_step(64)
    pol.observe(_decision(0, 0.5, 1.0), num_running=64)
    assert not pol.drafting_enabled
    assert not pol.begin_step(60)
    assert pol.begin_step(48) and pol.probing  # 48 <= 0.75 * 64: a probe at once, not a resume
    pol.observe(_decision(5, 1.3, 1.0), num_running=48)
    assert pol.drafting_enabled


def test_a_failed_load_probe_lowers_the_floor_and_keeps_the_timer() -> None:
    pol = SaturationPolicy(patience=1, resume_every=8)
    losing = _decision(0, 0.5, 1.0)
    pol.begin_step(64)
    pol.observe(losing, num_running=64)
    assert not pol.begin_step(60)
    assert pol.begin_step(40) and pol.probing
    pol.observe(losing, num_running=40)
    assert not pol.drafting_enabled and pol.probe_wait == 8  # a load probe does not back the timer off
    assert not pol.begin_step(32)  # above 0.75 * 40: nothing new to learn at this load
    assert not pol.begin_step(64)  # back to full load: stays paused
    assert pol.begin_step(30) and pol.probing  # 30 <= 0.75 * 40
    pol.observe(losing, num_running=30)
    # The timer counts on: due from the 8th paused step since the pause, it probes once the climb back from 30 has
    # left the window, and backs off when it fails.
    steps = [pol.begin_step(64) for _ in range(5)]
    assert steps == [False, False, False, False, True]
    pol.observe(losing, num_running=64)
    assert pol.probe_wait == 16


def _steps_to_probe(pol: SaturationPolicy, load: int) -> int | None:
    """Paused steps at ``load`` until one begins a probe (that step counted), at most LOAD_SETTLE_STEPS + 1."""
    for i in range(1, LOAD_SETTLE_STEPS + 2):
        if pol.begin_step(load):
            return i
    return None


def test_no_probe_begins_while_the_load_climbs_and_a_due_one_waits_for_it_to_stop() -> None:
    """A closed loop's round: drafting paused at 256 requests, the batch drains to idle, then refills 14
    requests a step. A load-fall probe is due from the drain's light loads and a timer probe comes due on the
    way back up; on the ramp neither begins -- its light loads are ones the batch is leaving, and a resume
    there drafts the ramp with requests advancing unevenly (docs/PERFORMANCE.md section 43). Once the load
    stops climbing the due timer probe runs at the load the batch is at. A drain itself is no climb: its
    light loads are probed as before."""
    losing = _decision(0, 0.5, 1.0)
    pol = SaturationPolicy(patience=1, resume_every=16, probe_tax=1.0)
    pol.begin_step(256)
    pol.observe(losing, num_running=256)
    assert not pol.drafting_enabled and pol.floor == 256
    assert not any(pol.begin_step(256) for _ in range(8))
    # the drain: load-fall probes as before, each failing and lowering the floor to its load ...
    probed = []
    for n in (180, 120, 60, 30, 12, 4, 1):
        if pol.begin_step(n):
            probed.append(n)
            pol.observe(losing, num_running=n)
    assert probed[:2] == [180, 120] and not pol.drafting_enabled
    # ... then idle (no decode steps), and the ramp: its light loads under 3/4 of the floor at first, the timer
    # due on the way up
    held = pol.counters.rising_probe_steps
    ramp = list(range(14, 257, 14)) + [256]
    assert not any(pol.begin_step(n) for n in ramp)
    assert pol.counters.rising_probe_steps - held >= len(ramp) - ramp.index(next(n for n in ramp if n > 90))
    steps = _steps_to_probe(pol, 256)  # settled at 256: the due timer probe, judged where the batch is
    assert steps is not None and steps <= LOAD_SETTLE_STEPS and pol.probing and pol.probe_trigger == "timer"
    # A light load that holds is probed once the climb to it has left the window: a ramp from idle to 12.
    pol = SaturationPolicy(patience=1, resume_every=4, probe_tax=1.0)
    pol.begin_step(256)
    pol.observe(losing, num_running=256)
    assert not any(pol.begin_step(256) for _ in range(3))
    assert pol.begin_step(1)  # the drain's last load: a load-fall probe, which fails
    pol.observe(losing, num_running=1)
    assert not any(pol.begin_step(n) for n in (4, 8))  # the timer is due, the load climbing
    steps = _steps_to_probe(pol, 12)
    assert steps == LOAD_SETTLE_STEPS + 1 and pol.probing and pol.probe_trigger == "timer"


def test_a_load_rise_past_the_top_probes_once_settled_and_a_failure_raises_the_top() -> None:
    pol = SaturationPolicy(patience=1, resume_every=1000)
    losing = _decision(0, 0.5, 1.0)
    pol.begin_step(16)
    pol.observe(losing, num_running=16)
    assert not pol.drafting_enabled and pol.top == 16
    assert not pol.begin_step(21)  # below 4/3 x 16
    steps = _steps_to_probe(pol, 22)  # past it: a probe (not a resume) once the load has stopped climbing
    assert steps is not None and 1 < steps <= LOAD_SETTLE_STEPS + 1 and pol.probing
    pol.observe(losing, num_running=22)
    assert not pol.drafting_enabled and pol.top == 22 and pol.probe_wait == 1000  # the timer is left alone
    assert pol.counters.probes["rise", "failed"] == 1
    assert not pol.begin_step(29)  # below 4/3 x 22: that load was just tried
    assert _steps_to_probe(pol, 64) == LOAD_SETTLE_STEPS + 1 and pol.probing  # a jump: it holds that long
    assert pol.counters.rising_probe_steps >= LOAD_SETTLE_STEPS + 1
    pol.observe(_decision(5, 1.3, 1.0), num_running=64)
    assert pol.drafting_enabled and pol.counters.probes["rise", "paid"] == 1
    assert pol.ceiling is None  # unlike a load-fall resume: going back down pauses only after patience
    # An engine that does not say the load (num_running 0) gets the timer only, never a load probe.
    pol = SaturationPolicy(patience=1, resume_every=4)
    pol.begin_step(16)
    pol.observe(losing)
    # The timer is due on the 4th paused step; it waits one more, for the jump from 16 to leave the climbing window.
    assert [pol.begin_step(64) for _ in range(5)] == [False, False, False, False, True]


def test_drafting_that_pays_only_at_high_load_resumes_when_the_load_rises() -> None:
    """The H200 vLLM case of docs/PERFORMANCE.md section 15: drafting loses at 16 and 64 requests (a fixed-cost
    eager draft pass on short steps) and pays at 256. Cells of 16, 64, then 256 requests, each a few hundred
    steps with a drain to idle between them. The timer backs off over the losing cells; the load rise at
    the 256 cell probes once the load has settled, and drafting resumes for (nearly) the whole cell."""
    pol = SaturationPolicy(patience=8, resume_every=16)
    drafted_at_256 = 0
    wait_before = {}
    for load, steps in ((16, 600), (64, 600), (256, 300)):
        wait_before[load] = pol.probe_wait
        for r in [load] * steps + [load // 2, load // 4, 1]:
            pays = r >= 256
            if pol.begin_step(r):
                drafted_at_256 += r == 256
                pol.observe_outcome(_decision(5 if pays else 0, 1.3 if pays else 0.7, 1.0),
                                    int((1.3 if pays else 0.7) * r), r)
    assert wait_before[256] >= 8 * 16  # the losing cells backed the timer off
    assert drafted_at_256 >= 300 - (LOAD_SETTLE_STEPS + 2)
    assert pol.counters.probes["rise", "paid"] == 1
    last = pol.counters.last_probe  # what the server log says of it
    assert last.trigger == "rise" and last.num_running == 256 and last.predicted
    assert last.realized == pytest.approx(int(1.3 * 256) / PROBE_MARGIN)  # tokens per priced ms over plain's
    assert last.describe().startswith("rise probe at 256 requests paid: realized ")


# docs/PERFORMANCE.md section 18's served vLLM cells (Llama-3-8B shape, H200): paused step times per load, and
# what a served drafting step took beyond its price (verify-all's cells: 23.24 / 37.66 / 87.17 ms against
# 18.52 / 32.24 / 62.42 priced): the eager draft pass's launches and the server's per-step work.
_SERVED_PAUSED_MS = {16: 6.79, 64: 8.96, 256: 36.02}
_SERVED_DRAFTING_EXTRA_MS = {16: 23.24 - 18.52, 64: 37.66 - 32.24, 256: 87.17 - 62.42}


def _replay_served_vllm(schedule: list[tuple[int, int, bool]]) -> tuple[CapacityManager, dict[int, int]]:
    """Replay (load, steps, calibrate) phases on the core with the H200 curve of the Llama-3-8B shape and the
    synthetic sampler's acceptance; probe steps cost twice a drafting step (the catch-up over the pause).
    ``calibrate=False`` steps are timed as vLLM times a paused step whose draft caught up before a prompt
    chunk: for the probe tax only. Returns the manager and the drafting steps per load."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    curve = SpsCurve.load(root / "benchmarks/results/vllm_h200/scaled-2026-12-01/profile-scaled/sps_curve.json")
    k = 7
    rates = torch.tensor([0.8, 0.7, 0.6, 0.5, 0.35, 0.2, 0.08])  # the synthetic sampler's conditional acceptance
    survival = np.concatenate([[0.0], np.cumsum(np.cumprod(rates.numpy()))])  # accepted drafts given n admitted
    cfg = CapacityConfig(mode="varlen", policy="argmax", saturation_patience=8, resume_every=16)
    mgr = CapacityManager(cfg, curve, k, 256, "cpu")
    drafted: dict[int, int] = {}
    for load, steps, calibrate in schedule:
        for r in [load] * steps:
            drafted.setdefault(r, 0)
            plain = _SERVED_PAUSED_MS.get(r, float(curve.step_cost_ms(r, r, drafting=False)))
            if not mgr.begin_step(r):
                if calibrate:
                    mgr.record_step_time(False, r, plain)
                else:
                    mgr.timer.record(False, r, plain, float(curve.step_cost_ms(r, r, drafting=False)),
                                     calibrate=False)
                continue
            probe = mgr.timer.probe_step
            slots = np.arange(r)
            mgr.record_confidences(torch.from_numpy(slots), rates.expand(r, k))
            decision = mgr.plan(slots, np.full(r, k), r, r, defer_saturation=True)
            # The expected tokens: each request's admitted drafts (the budget spread evenly) survive as sampled.
            admitted = np.full(r, decision.budget // r) + (np.arange(r) < decision.budget % r)
            mgr.record_outcome(r + int(round(float(survival[admitted].sum()))))
            measured = decision.step_ms + _SERVED_DRAFTING_EXTRA_MS.get(r, 5.0)
            mgr.record_step_time(True, r, measured * (2.0 if probe else 1.0))
            drafted[r] += 1
    return mgr, drafted


def _drain(load: int) -> list[tuple[int, int, bool]]:
    return [(load // 2, 1, True), (load // 4, 1, True), (1, 1, True)]


def test_served_vllm_cells_resume_drafting_at_256_and_stay_paused_at_16_and_64() -> None:
    """docs/PERFORMANCE.md section 18 replayed on the core: paused steps 6.79 / 8.96 / 36.02 ms at 16 / 64 /
    256 requests, drafting steps their price plus 4.7 / 5.4 / 24.8 ms, probe steps twice that. Drafting loses
    at 16 and 64 and pays 1.21x at 256. The rise probe at 256 finds no drafting timed there; judged by that
    load's plain-step excess it resumes, where the nearest load's quotient failed it."""
    mgr, drafted = _replay_served_vllm([(16, 400, True), *_drain(16), (64, 400, True), *_drain(64),
                                        (256, 300, True), *_drain(256)])
    # At 256 the rise probe waits for one paused step to time that load, then drafting resumes for the rest of
    # the cell; at 16 the drafting steps are the first ones (before the first pause) and the backed-off timer
    # probes, at 64 one failed rise probe.
    assert drafted[256] >= 250, drafted
    assert drafted[16] < 100 and drafted[64] < 10, drafted
    c = mgr.saturation.counters
    assert c.probes["rise", "paid"] == 1 and c.probes["rise", "failed"] == 1
    assert c.last_probe is not None and c.last_probe.num_running == 256 and c.last_probe.cost_scale < 0.8


def test_a_served_ramp_to_256_probes_once_the_load_is_timed_not_on_the_way_up() -> None:
    """How vLLM really reaches 256 requests: its scheduler admits a wave's prompts over a few steps (a step's
    token budget holds ~64 prompts of 128 tokens), and each of those steps carries a prompt chunk, before which
    the paused draft catches up -- so none of them is timed as a paused step of its load. A rise probe on the
    first step past 4/3 of the top (128 requests here) found no step timed at its load and borrowed a light
    load's quotient (the host-bound draft pass at 16 requests): failed, top 128; the same at 192, top 192; and
    at 256, the cell's steady load, it failed a third time -- drafting never resumed where it paid 1.2-1.5x
    (docs/PERFORMANCE.md section 25). A probe now waits until a paused step at its load has been timed."""
    ramp = [(128, 1, False), (192, 1, False), (256, 1, False)]
    mgr, drafted = _replay_served_vllm([(16, 400, True), *_drain(16), (64, 400, True), *_drain(64),
                                        *ramp, (256, 300, True)])
    assert drafted[256] >= 250, drafted
    assert drafted[128] == drafted[192] == 0, drafted
    c = mgr.saturation.counters
    assert c.probes["rise", "paid"] == 1 and c.probes["rise", "failed"] == 1  # the 64 cell's, then 256's
    assert c.unmeasured_probe_steps >= 3  # the ramp's steps and the first at 256 held their probe


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 64), st.integers(0, 8), st.integers(12, 40))
def test_no_rise_probe_fires_while_the_load_climbs_and_one_does_once_it_holds(top: int, extra: int,
                                                                             ramp_steps: int) -> None:
    """Whatever the top and however the load climbs past 4/3 of it, a climb of at least LOAD_SETTLE_RISE over
    every LOAD_SETTLE_STEPS steps begins no probe; once the load holds, a rise probe begins within
    LOAD_SETTLE_STEPS + 1 steps."""
    pol = SaturationPolicy(patience=1, resume_every=10**6)
    pol.begin_step(top)
    pol.observe(False, num_running=top)
    loads = [int(math.ceil(LOAD_RISE * top)) + extra]
    for i in range(1, ramp_steps):
        back = loads[i - LOAD_SETTLE_STEPS] if i >= LOAD_SETTLE_STEPS else 0
        loads.append(max(loads[-1] + 1, int(math.ceil(LOAD_SETTLE_RISE * back))))
    assert not any(pol.begin_step(r) for r in loads)
    assert pol.counters.rising_probe_steps == len(loads)
    steps = _steps_to_probe(pol, loads[-1])
    assert steps is not None and pol.probe_trigger == "rise"


def test_a_rise_probe_waits_until_a_gradual_ramp_settles() -> None:
    """docs/PERFORMANCE.md sections 31 and 32: with two API processes a cell's requests reach vLLM's scheduler a
    few per step, so the load climbs to 256 over a dozen or more timed steps. A rise probe fired on the way
    (at 88-126 requests) judged a load the batch was leaving, at a scale of about 1. It paid, and drafting ran
    into 256 requests. Here the load climbs from 64 to 256 by 12 requests a step: the probe now fires where the
    climb stops, and nothing drafts on the way."""
    ramp = [(load, 1, True) for load in range(76, 256, 12)]
    mgr, drafted = _replay_served_vllm([(16, 400, True), *_drain(16), (64, 400, True), *ramp, (256, 300, True)])
    assert all(drafted[load] == 0 for load, _, _ in ramp), drafted
    c = mgr.saturation.counters
    assert c.rising_probe_steps >= len(ramp)  # every ramp step past 4/3 of the top held its probe
    assert c.probes["rise", "paid"] == 1 and drafted[256] >= 250, drafted


def test_what_drafting_cost_before_a_long_pause_judges_no_probe() -> None:
    """docs/PERFORMANCE.md section 35: a shape warm-up's first drafting steps at 32 requests read 1.44x their
    price against plain steps, the policy paused there, and every probe at 32 requests was judged by that
    quotient for the rest of the run (drafting windows are fed only while drafting runs) -- all failed, where a
    twin server measured 1.05 and drafted at +5%. Once older than STEP_TIME_STALE timed steps, a drafting
    window judges nothing."""
    cal = StepTimeCalibration()
    for _ in range(3):
        cal.record(True, 32, 14.4, 10.0)
        cal.record(False, 32, 10.0, 10.0)
    assert cal.relative_draft_cost(32) == pytest.approx(1.44)
    for _ in range(STEP_TIME_STALE - 1):  # paused steps at 32 keep its plain window current
        cal.record(False, 32, 10.0, 10.0)
    assert cal.relative_draft_cost(32) == pytest.approx(1.44)  # not yet stale
    cal.record(False, 16, 8.0, 8.0)
    assert 6 not in cal.quotients()
    # judged as at a load drafting never ran at: its price plus what plain steps there take beyond theirs
    assert cal.relative_draft_cost(32, drafting_ms=20.0, plain_ms=10.0) == pytest.approx(1.0)
    cal.record(True, 32, 10.5, 10.0)  # drafting resumed: its first step restarts the window
    assert cal.relative_draft_cost(32) == pytest.approx(1.05)


def test_a_probe_at_a_load_no_decode_step_times_is_not_judged_by_a_lighter_loads_quotient() -> None:
    """docs/PERFORMANCE.md section 27: with steps that carry a prompt chunk kept out of the step-time windows,
    no step at 256 requests timed that load (refill admits a prompt on nearly every step), so each due probe
    there waited out ``PROBE_MEASURE_WAIT`` and borrowed 16-31 requests' quotient (1.5-1.9): failed, where
    verifying everything led no speculation by 27%. Borrowed against its bias a quotient is now the curve's 1,
    and drafting resumes at 256 as it does once that load is timed."""
    mgr, drafted = _replay_served_vllm([(16, 400, True), *_drain(16), (64, 400, True), *_drain(64),
                                        (256, 300, False)])
    assert drafted[256] >= 250, drafted
    c = mgr.saturation.counters
    assert c.unmeasured_probe_steps >= PROBE_MEASURE_WAIT  # the probe waited for a timed step that never came
    assert c.probes["rise", "paid"] == 1
    # what the probe at 256 would have borrowed: 16-31's quotient, above 1 (since gone stale, so not even offered)
    assert mgr.step_times.ratio(True, 16) / mgr.step_times.ratio(False, 16) > 1.2
    assert 5 not in mgr.step_times.quotients()


def test_the_last_probe_verdict_says_why_a_probe_failed() -> None:
    pol = SaturationPolicy(patience=1, resume_every=1)
    pol.begin_step(32)
    pol.observe_outcome(_decision(0, 0.5, 1.0), 16, 32)  # pauses
    assert not pol.drafting_enabled and pol.counters.last_probe is None
    assert pol.begin_step(32) and pol.probing
    pol.observe_outcome(_decision(4, 1.5, 1.0), 1, 32, cost_scale=2.0)  # measured: drafting costs 2x its price
    last = pol.counters.last_probe
    assert last.trigger == "timer" and last.cost_scale == 2.0 and last.predicted
    assert last.realized == pytest.approx(1 / 2.0 / PROBE_MARGIN) and last.realized < 1
    assert "failed" in last.describe() and "cost scale 2.00" in last.describe()


def test_closed_loop_refills_do_not_restart_drafting_where_it_never_pays() -> None:
    """A pool of 16 clients whose requests finish together: the batch drains to a few requests and refills
    every 128 steps. Where drafting does not pay at any load, each refill used to resume drafting (and
    reset the probe backoff): 11 drafting steps per generation. Now the drains are probed, once per new
    floor, and later generations draft only for the backed-off timer probes."""
    pol = SaturationPolicy(patience=8, resume_every=16)
    losing = _decision(0, 0.5, 1.0)
    per_generation = []
    for _ in range(8):
        drafted = 0
        for r in [16] * 124 + [9, 5, 2, 1]:
            if pol.begin_step(r):
                drafted += 1
                pol.observe_outcome(losing, r // 2, r)  # half a token per request: never pays
        per_generation.append(drafted)
    # patience, three timer probes of 3 steps (48 request-steps at 16 requests), the drain's first probe
    assert per_generation[0] <= 8 + 3 * 3 + 2
    # then the backed-off timer probes and one probe per new floor (a refill cancels a drain's probe)
    assert sum(per_generation[1:]) <= 20 and sum(per_generation[4:]) <= 5, per_generation
    assert not pol.drafting_enabled


def test_closed_loop_drafts_in_the_drains_where_low_load_pays_and_pauses_at_once_on_refill() -> None:
    """64 clients; drafting pays at <= 24 running requests and loses above. Each generation drains through
    48, 40, ..., 1 and refills to 64: the drain's load probes find where drafting pays and resume it there,
    and the refill pauses it again at once (the ceiling) instead of after ``patience`` losing steps."""
    pol = SaturationPolicy(patience=8, resume_every=16)
    drain = [48, 40, 32, 24, 16, 8, 4, 2, 1]
    losing_drafts = missed = 0
    for _ in range(8):
        for r in [64] * 240 + drain:
            pays = r <= 24
            if pol.begin_step(r):
                losing_drafts += not pays
                pol.observe_outcome(_decision(5 if pays else 0, 1.3 if pays else 0.7, 1.0),
                                    int((1.3 if pays else 0.7) * r), r)
            else:
                missed += pays
    assert missed == 0  # every low-load step of every drain drafted
    # patience + early timer probes in the first generation, then the two failed drain probes (48, 32) each
    assert losing_drafts <= 12 + 2 * 8, losing_drafts


def test_a_ceiling_re_pause_keeps_the_floor_the_pause_had_found() -> None:
    # Paused at 64 (floor 64); a load probe at 32 fails (floor 32); one at 16 pays (ceiling 64). Back at 64 the
    # pause resumes where it was: 40 requests, above 0.75 x 32, begin no load probe that the floor rules out.
    pol = SaturationPolicy(patience=1, resume_every=10**6)
    pol.begin_step(64)
    pol.observe(False, num_running=64)
    assert not pol.drafting_enabled and pol.floor == 64
    assert pol.begin_step(32) and pol.probe_trigger == "load"
    pol.observe(False, num_running=32)
    assert pol.floor == 32
    assert pol.begin_step(16) and pol.probe_trigger == "load"
    pol.observe(True, num_running=16)
    assert pol.drafting_enabled and pol.ceiling == 64
    assert not pol.begin_step(64) and pol.floor == 32
    assert not pol.begin_step(40) and not pol.probing


def _resumed_under_a_ceiling_of_64(resume_every: int, failed_timer_probes: int = 0) -> SaturationPolicy:
    """Paused at 64 requests (after ``failed_timer_probes`` failed timer probes there); a load probe at 40 paid, so
    drafting runs again under a ceiling of 64."""
    pol = SaturationPolicy(patience=1, resume_every=resume_every)
    losing, paying = _decision(0, 0.7, 1.0), _decision(5, 1.3, 1.0)
    pol.begin_step(64)
    pol.observe(losing, num_running=64)
    assert not pol.drafting_enabled and pol.top == 64
    for _ in range(failed_timer_probes):
        while not pol.begin_step(64):
            pass
        pol.observe(losing, num_running=64)
    assert pol.probe_wait == resume_every * 2**failed_timer_probes  # each failure doubles the wait
    assert pol.begin_step(40) and pol.probe_trigger == "load"
    pol.observe(paying, num_running=40)
    assert pol.drafting_enabled and pol.ceiling == 64
    return pol


def test_a_ceiling_re_pause_at_a_heavier_load_knows_only_what_the_pause_before_found() -> None:
    """A load probe paid at 40 requests under a pause at 64; the next cell jumps to 256 (docs/PERFORMANCE.md section
    39's log). The ceiling pauses drafting at once, but drafting was never judged at 256: claimed as the top, 256
    would get no rise probe (4/3 x 256 never comes) where drafting can pay again (section 15), and claimed as where
    drafting paused, the next paying load probe would set a ceiling of 256 and draft at the losing 64."""
    pol = _resumed_under_a_ceiling_of_64(resume_every=16)
    losing, paying = _decision(0, 0.7, 1.0), _decision(5, 1.3, 1.0)
    assert not pol.begin_step(256)  # the load that lost is exceeded: paused at once
    assert pol.top == 64 and pol.floor == 64
    fired = []
    for _ in range(8):  # 256 >= 4/3 x 64 and settled after a few steps: a rise probe judges it
        if pol.begin_step(256):
            fired.append(pol.probe_trigger)
            break
    assert fired == ["rise"]
    pol.observe(losing, num_running=256)  # it lost at 256 too: now known
    assert pol.top == 256 and not pol.drafting_enabled
    # the load falls to 40 again, a load probe pays, and the ceiling is the load found losing first, not 256
    assert pol.begin_step(40) and pol.probe_trigger == "load"
    pol.observe(paying, num_running=40)
    assert pol.drafting_enabled and pol.ceiling == 64


def test_a_ceiling_re_pause_keeps_its_backoff_at_the_load_that_earned_it() -> None:
    """A backoff the ceiling carries was earned at the ceiling's load: a lighter load that holds resets it, and the
    heavier load the batch jumped to is not lighter than that."""
    pol = _resumed_under_a_ceiling_of_64(resume_every=4, failed_timer_probes=3)  # the wait backs off to 32
    assert not pol.begin_step(100) and pol.probe_wait == 32
    for _ in range(40):  # 60 is not lighter than 3/4 of 64: the backoff holds
        if pol.begin_step(60):
            break
    assert pol.probe_wait == 32


def test_a_refill_to_a_backed_off_load_restores_the_wait_a_drain_reset() -> None:
    """Interleaved rounds at 256 requests (docs/PERFORMANCE.md section 40): timer probes failed at 256 and backed
    the wait off; each round's tail held a light load long enough to reset it, and the next round at 256 probed
    from the shortest wait again. Back at the load whose probes failed, the wait they earned comes back."""
    pol = SaturationPolicy(patience=1, resume_every=4)
    losing = _decision(0, 0.5, 1.0)
    pol.begin_step(256)
    pol.observe(losing, num_running=256)
    for _ in range(3):  # three failed timer probes at 256: 4 -> 32
        while not pol.begin_step(256):
            pass
        pol.observe(losing, num_running=256)
    assert pol.probe_wait == 32
    for _ in range(6):  # the round's tail holds 8 requests (<= 3/4 x 256): the backoff resets there
        if pol.begin_step(8):
            pol.observe(losing, num_running=8)  # its load probe fails, and the reset's due timer probe
    assert pol.probe_wait == 8 and pol.floor == 8
    assert not pol.begin_step(256) and pol.probe_wait == 32  # the next round: 256's backoff is back
    fired = [i for i in range(40) if pol.begin_step(256) and pol.probe_trigger == "timer"]
    assert fired and fired[0] >= 16  # the wait since the last timer probe is 32 again, not 8


def _run_loads(pol: SaturationPolicy, loads: list[int], pays: Callable[[int], bool]) -> list[tuple[int, int, str]]:
    """Run ``loads`` step by step, judging drafting steps by ``pays``; returns the failed timer probes as
    (step, load, trigger)."""
    failed = []
    for i, r in enumerate(loads):
        if pol.begin_step(r):
            probing, trigger = pol.probing, pol.probe_trigger
            pol.observe(pays(r), num_running=r)
            if probing and not pays(r):
                failed.append((i, r, trigger))
    return failed


def test_a_ceiling_re_pause_keeps_where_its_backoff_was_earned_and_a_losing_top_stays_a_ceiling() -> None:
    """Drafting loses at 64 and 256 and pays at 120-180 and at 40 or fewer. Paused at 64, the timer backs off
    at 256; a load probe pays at 40 (ceiling 64); back at 256 the ceiling re-pauses with that backoff. It was
    earned at 256, so a cell at 150 that holds resets it there (not after ~500 steps); and once a probe pays at
    150, 256 -- found losing in this pause -- is the ceiling, so drafting pauses there at once again."""
    def pays(r: int) -> bool:
        return 120 <= r <= 180 or r <= 40
    pol = SaturationPolicy(patience=2, resume_every=16)
    _run_loads(pol, [64] * 4 + [256] * 2000, pays)
    assert not pol.drafting_enabled and pol.probe_wait == 512 and pol.top == 256
    _run_loads(pol, [40] * 6, pays)
    assert pol.drafting_enabled and pol.ceiling == 64
    _run_loads(pol, [256] * 10, pays)
    assert not pol.drafting_enabled and pol.probe_wait == 512
    steps = next(i for i in range(1, 200) if pol.begin_step(150))
    assert steps <= 40 and pol.probe_trigger == "timer"  # the hold at 150 reset the backoff earned at 256
    pol.observe(True, num_running=150)
    assert pol.drafting_enabled and pol.ceiling == 256
    assert not pol.begin_step(256)


def test_closed_loop_waves_keep_the_heavy_loads_backoff_across_the_tails_that_resume() -> None:
    """Waves at 256 requests (drafting loses) whose tails drain to 4 (drafting pays): each tail's load probe
    resumes drafting under a ceiling and the next wave re-pauses at once. The backoff the timer earned at 256
    comes back with it: after the first wave, two timer probes per wave (the longest wait), not the whole
    16, 32, 64... ramp again (section 40's storm, across pauses)."""
    wave = [256] * 600 + list(range(240, 8, -16)) + [8] * 40 + [4] * 10
    pol = SaturationPolicy(patience=2, resume_every=8)
    failed = _run_loads(pol, wave * 6, lambda r: r <= 4)
    per_wave = [sum(1 for i, r, t in failed if t == "timer" and r == 256 and w * len(wave) <= i < (w + 1) * len(wave))
                for w in range(6)]
    assert per_wave[0] >= 5 and all(n <= 2 for n in per_wave[1:]), per_wave
    assert pol.counters.probes["load", "paid"] == 6  # every tail still resumes drafting where it pays


def test_the_probe_bank_holds_at_most_its_probes_worth_after_long_paused_stretches() -> None:
    # Cheap probes (1 ms) between long runs of expensive paused steps (10 ms, 0.2 ms saved each): the allowance
    # is capped at PROBE_BANK probes, so a long pause cannot buy a burst of probes later.
    pol = SaturationPolicy(patience=1, resume_every=4)
    pol.begin_step(16)
    pol.observe(False, num_running=16)
    probes = 0
    for _ in range(5000):
        if pol.begin_step(16):
            probes += 1
            pol.record_step_ms(True, 1.0)
            pol.observe(False, num_running=16)
        else:
            pol.record_step_ms(False, 10.0)
        assert pol.probe_allowance_ms <= PROBE_BANK * 1.0 + 1e-9
    assert probes >= 10


def test_a_timer_probe_that_pays_below_the_pausing_load_resumes_under_a_ceiling() -> None:
    """The H200's 16-request vLLM cell (docs/PERFORMANCE.md section 27): drafting lost at 16 requests, the timer
    probed as the cell drained and paid at 11, and the next cell's ramp to 64 requests began drafting. A timer
    probe that pays below the load that paused drafting resumes it as a load-fall probe does: back at that load,
    drafting pauses at once. One that pays at that load or above (the draft got better) sets no ceiling."""
    losing, paying = _decision(0, 0.5, 1.0), _decision(5, 1.3, 1.0)
    pol = SaturationPolicy(patience=1, resume_every=2)
    pol.begin_step(16)
    pol.observe(losing, num_running=16)
    assert not pol.drafting_enabled
    assert not pol.begin_step(13)  # 13 > 3/4 x 16: no load probe; the timer's first paused step
    assert pol.begin_step(13) and pol.probing and pol.probe_trigger == "timer"
    pol.observe(paying, num_running=13)
    assert pol.drafting_enabled and pol.ceiling == 16
    assert not pol.begin_step(64)  # the next wave: paused at once, not after a losing step
    # at the pausing load itself, a paying timer probe clears the ceiling
    pol = SaturationPolicy(patience=1, resume_every=2)
    pol.begin_step(16)
    pol.observe(losing, num_running=16)
    assert not pol.begin_step(16) and pol.begin_step(16) and pol.probing
    pol.observe(paying, num_running=16)
    assert pol.drafting_enabled and pol.ceiling is None and pol.begin_step(64)


def test_a_refill_cancels_a_low_load_probe_and_a_lucky_probe_does_not_reset_the_backoff() -> None:
    pol = SaturationPolicy(patience=2, resume_every=4)
    losing = _decision(0, 0.5, 1.0)
    for _ in range(2):
        pol.begin_step(16)
        pol.observe_outcome(losing, 8, 16)
    assert not pol.drafting_enabled
    assert pol.begin_step(4) and pol.probing  # the batch drains: a probe at 4 requests
    pol.observe_outcome(losing, 2, 4)  # 4 of its 48 request-steps
    assert pol.probing
    assert not pol.begin_step(16)  # refilled: the probe ends, unjudged at 16 requests, its load is the floor
    assert not pol.probing and not pol.drafting_enabled
    assert not pol.begin_step(4)  # above 0.75 x 4: that load was just tried
    # A timer probe that pays by luck resumes; losing again at once, the pause backs off from where it was.
    while not pol.begin_step(16):
        pass
    wait = pol.probe_wait
    for _ in range(3):  # 48 request-steps
        pol.observe_outcome(_decision(5, 1.3, 1.0), 40, 16)
        if pol.drafting_enabled:
            break
        pol.begin_step(16)
    assert pol.drafting_enabled
    for _ in range(2):
        pol.begin_step(16)
        pol.observe_outcome(losing, 8, 16)
    assert not pol.drafting_enabled and pol.probe_wait == 2 * wait


def test_a_nan_step_price_is_not_judged_and_an_empty_step_sets_no_floor() -> None:
    pol = SaturationPolicy(patience=2, resume_every=4)
    nan = BudgetDecision(budget=5, theta_best=2.0, theta_all=2.0, theta_no_draft=1.0, step_ms=float("nan"),
                         total_drafts=10)
    assert pol.begin_step(16) and not pol.observe_outcome(nan, 40, 16)
    assert pol.realized_gain is None  # one NaN in the window judged every later step by it
    for _ in range(3):
        pol.begin_step(16)
        pol.observe_outcome(_decision(5, 1.3, 1.0), 40, 16)
    assert pol.drafting_enabled and pol.realized_gain is not None and pol.realized_gain > 1.0
    for _ in range(2):
        pol.begin_step(16)
        pol.observe_outcome(_decision(0, 0.5, 1.0), 0, 16)
    assert not pol.drafting_enabled and pol.floor == 16
    assert not pol.begin_step(0)  # no load-fall probe at 0 requests, whose unjudged end set the floor to 0
    assert not pol.probing and pol.floor == 16
    assert pol.begin_step(4) and pol.probe_trigger == "load"  # and a real drain still probes


def test_a_resume_that_pays_is_judged_from_its_probe_not_from_the_steps_that_paused_drafting() -> None:
    # 16 requests lose (0.7x plain decoding), then the batch drains to 2 where drafting pays 1.25x. The realized
    # window still held the 16-request losses after the probe resumed drafting: the resume lost at once, backed
    # off, and its probation put the probe tax in debt, so drafting ran on a few dozen of 1,500 steps.
    pol = SaturationPolicy(patience=4, resume_every=16)
    losing = BudgetDecision(budget=64, theta_best=20.0, theta_all=20.0, theta_no_draft=16.0, step_ms=1.0,
                            total_drafts=112)
    paying = BudgetDecision(budget=8, theta_best=3.0, theta_all=3.0, theta_no_draft=2.0, step_ms=1.0, total_drafts=14)
    for _ in range(200):
        if pol.begin_step(16):
            pol.record_step_ms(True, 1.0)
            pol.observe_outcome(losing, 11, 16)
        else:
            pol.record_step_ms(False, 1.0)
    assert not pol.drafting_enabled
    drafted = []
    for i in range(1500):
        d = pol.begin_step(2)
        drafted.append(d)
        pol.record_step_ms(d, 1.0)
        if d:
            pol.observe_outcome(paying, 2 + i % 2, 2)  # 2.5 tokens per step: 1.25x plain decoding
    first = drafted.index(True)
    assert all(drafted[first:]), f"re-paused {pol.counters.pauses - 1} times after step {first}"
    assert pol.realized_gain is not None and pol.realized_gain > 1.0


def _drive(pol: SaturationPolicy, steps: list[tuple[int, bool]]) -> list[bool]:
    """Run the policy as an engine does (begin_step, then observe on drafting steps); which steps drafted."""
    drafted = []
    for running, paid in steps:
        d = pol.begin_step(running)
        drafted.append(d)
        if d:
            pol.observe(paid, num_running=running)
    return drafted


_loads_and_outcomes = st.lists(st.tuples(st.integers(1, 64), st.booleans()), min_size=1, max_size=400)


@settings(max_examples=150, deadline=None)
@given(_loads_and_outcomes, st.integers(0, 4), st.integers(1, 8))
def test_saturation_policy_invariants_under_any_loads_and_outcomes(
    steps: list[tuple[int, bool]], patience: int, resume_every: int
) -> None:
    """Whatever the loads and outcomes: the probe wait stays within [resume_every, MAX x resume_every], no
    pause outlasts that bound (a probe always comes), and drafting only pauses after a losing step."""
    pol = SaturationPolicy(patience, resume_every)
    bound = SaturationPolicy.MAX_PROBE_BACKOFF * resume_every
    gap = 0
    lost_before = False
    for running, paid in steps:
        was_enabled = pol.drafting_enabled
        d = pol.begin_step(running)
        if was_enabled and not d:
            assert lost_before  # a ceiling re-pause follows a pause, which followed a losing step
        gap = 0 if d else gap + 1
        assert gap <= bound
        if d:
            pol.observe(paid, num_running=running)
            lost_before = lost_before or not paid
        assert resume_every <= pol.probe_wait <= bound
        if patience == 0:
            assert d and pol.drafting_enabled
    if not lost_before:
        assert pol.drafting_enabled


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(1, 256), st.integers(200, 3000))
def test_saturation_tax_under_sustained_saturation_is_bounded_by_the_backoff(
    patience: int, resume_every: int, load: int, num_steps: int
) -> None:
    """At a constant load where drafting never pays, the drafting steps are the first `patience` ones, one
    probe per doubling of the wait, then one per MAX x resume_every paused steps."""
    pol = SaturationPolicy(patience, resume_every)
    bound = SaturationPolicy.MAX_PROBE_BACKOFF * resume_every
    drafted = _drive(pol, [(load, False)] * num_steps)
    doublings = SaturationPolicy.MAX_PROBE_BACKOFF.bit_length()
    assert sum(drafted) <= patience + doublings + num_steps // bound + 1
    # ... and probes keep coming at that rate: no gap between drafting steps exceeds the bound
    at = [i for i, d in enumerate(drafted) if d] + [num_steps]
    assert max(b - a - 1 for a, b in itertools.pairwise(at)) <= bound
    assert pol.probe_wait == min(bound, resume_every << (sum(drafted) - patience))


def _timed_closed_loop(pol: SaturationPolicy, generations: int, paused_ms: float, drafting_ms: float,
                       lag: int = 0) -> tuple[float, float, int]:
    """16 clients whose requests finish together, drafting never paying, each step's time reported (``lag``
    steps late, with the kind it began as, as vLLM on CUDA reports them): returns (paused ms, ms of drafting
    steps after the first pause, drafting steps after it)."""
    losing = _decision(0, 0.5, 1.0)
    paused = spent = 0.0
    drafted_after = 0
    late: list[tuple[bool, float, str]] = []
    for _ in range(generations):
        for r in [16] * 124 + [9, 5, 2, 1]:
            was_paused = pol.counters.pauses > 0
            drafting = pol.begin_step(r)
            late.append((drafting, drafting_ms if drafting else paused_ms, pol.step_kind))
            if drafting:
                pol.observe_outcome(losing, r // 2, r)
                if was_paused:
                    spent += drafting_ms
                    drafted_after += 1
            else:
                paused += paused_ms
            while len(late) > lag:
                pol.record_step_ms(*late.pop(0))
    return paused, spent, drafted_after


def _failing_timer_probes(tax: float, steps: int, paused_ms: float = 3.2, probe_ms: float = 15.0) -> list[int]:
    """The steps at which timer probes ran over ``steps`` steps of 16 requests where drafting never pays (~0.8x
    plain decoding; a probe costs ``probe_ms``, its catch-up included, a paused step ``paused_ms``)."""
    curve = SpsCurve.from_points([(1, 3.0), (64, 3.2), (512, 6.0)], [(1, 3.0), (64, 3.1)], 0.1)
    r, k = 16, 7
    mgr = CapacityManager(CapacityConfig(mode="varlen", probe_tax=tax), curve, k, r, "cpu")
    slots = np.arange(r)
    for slot in slots:
        mgr.add_request(int(slot))
    probes = []
    for i in range(steps):
        if not mgr.begin_step(r):
            mgr.record_step_time(False, r, paused_ms)
            continue
        probe = mgr.probe_step
        mgr.record_confidences(torch.from_numpy(slots), torch.full((r, k), 0.5))
        mgr.plan(slots, np.full(r, k), r, r, defer_saturation=True, sampling=True)
        mgr.record_outcome(r + int(0.6 * r))
        mgr.record_step_time(True, r, probe_ms if probe else 6.5)
        if probe:
            probes.append(i)
    assert mgr.saturation.counters.pauses == 1 and mgr.saturation.counters.resumes == 0
    return probes


def test_a_lower_probe_tax_spaces_failing_timer_probes_only_once_its_bank_is_spent() -> None:
    """Where drafting never pays, the backoff's cap (``MAX_PROBE_BACKOFF`` x ``resume_every`` paused steps) spaces
    the timer's probes at the default tax; a lower tax spaces them further, but only once the load's allowance,
    which starts at ``PROBE_BANK`` probes' worth, is spent. On an H100 (SmolLM2-135M at 16 requests,
    docs/PERFORMANCE.md section 47) a cell was ~1,500 steps, all of which the bank covers: a tax of 0.5% beside
    the default in such a cell cannot read. In steady state the cap costs ~0.9% of paused time here, 0.5% the tax."""
    default, low = _failing_timer_probes(PROBE_TAX, 6000), _failing_timer_probes(0.005, 6000)
    cap = SaturationPolicy.MAX_PROBE_BACKOFF * CapacityConfig().resume_every
    shared = [p for p in default if p < 2000]
    assert len(shared) == 6 and low[: len(shared)] == shared  # the bank: both ran the same probes, at the same steps
    assert [b - a for a, b in zip(default[4:], default[5:], strict=False)] == [cap] * (len(default) - 5)
    # then 15 ms a probe over 0.5% of 3.2 ms a paused step: one every ~938 paused steps (and the probe's own)
    later = [b - a for a, b in zip(low[-4:], low[-3:], strict=False)]
    assert all(abs(gap - (15.0 / (0.005 * 3.2) + 1)) <= 2 for gap in later), later
    assert len(low) < len(default)


def test_a_step_left_out_of_the_calibration_still_counts_for_the_probe_tax() -> None:
    policy = SaturationPolicy(patience=2, resume_every=4)
    seen: list[tuple[bool, float]] = []
    policy.record_step_ms = lambda drafting, ms, kind=None, num_running=None, trigger=None, probe_bucket=None: seen.append((drafting, ms))  # type: ignore[method-assign]
    timer = StepTimer(policy)
    timer.record(True, 16, 40.0, 10.0, calibrate=False)  # e.g. a step that also caught a paused draft up
    timer.record(False, 16, 30.0, 10.0, calibrate=False)
    assert seen == [(True, 40.0), (False, 30.0)] and timer.step_times.quotients() == {}
    timer.record(True, 16, 20.0, 10.0)
    timer.record(False, 16, 10.0, 10.0)
    assert timer.step_times.quotients() == {StepTimeCalibration.load_bucket(16): pytest.approx(2.0)}


def test_a_probe_that_crosses_a_load_bucket_is_charged_where_it_probed() -> None:
    """A probe of several steps below 16 requests may cross a bucket's edge (3 -> 4 requests): its later steps
    went to a bucket that had never probed (whose allowance starts full), and the load that rations the next
    timer probe paid for one step in four."""
    policy = SaturationPolicy(patience=1, resume_every=4)
    at3 = StepTimeCalibration.load_bucket(3)
    assert StepTimeCalibration.load_bucket(4) != at3
    policy.record_step_ms(True, 6.0, kind="probe", num_running=3, trigger="timer", probe_bucket=at3)
    for _ in range(3):
        policy.record_step_ms(True, 50.0, kind="probe", num_running=4, trigger="timer", probe_bucket=at3)
    assert policy.probe_allowance_at(3) == pytest.approx(PROBE_BANK * 6.0 - 156.0)
    assert policy.probe_allowance_at(4) == 0.0  # no account where no probe began


@pytest.mark.parametrize("lag", [0, 2])
def test_probe_tax_bounds_the_time_probes_take_in_closed_loop_drains(lag: int) -> None:
    """The H200 case of docs/PERFORMANCE.md section 13: a probe costs 22 ms where a paused step costs 5 ms.
    However often drains and refills come, probing spends at most its share of paused time plus the allowance
    it starts with -- also where each step's time comes back two steps late (section 32: charged to the step
    begun last, a one-step probe's time was saved as a paused step's). The drains' load probes are untaxed
    (section 35) and stay few: each lowers the floor."""
    for generations in (8, 32):
        pol = SaturationPolicy(patience=8, resume_every=16)
        paused, spent, drafted_after = _timed_closed_loop(pol, generations, paused_ms=5.0, drafting_ms=22.0,
                                                          lag=lag)
        # ... plus the one probe (<= PROBE_MAX_STEPS steps) that may start with the allowance at zero
        assert spent <= PROBE_TAX * paused + (PROBE_BANK + 4) * 22.0, (generations, spent, paused)
        c = pol.counters
        assert c.pauses == 1 and c.resumes == 0 and c.probe_steps == drafted_after
        assert sum(c.probes.values()) > 0 and c.probes["timer", "paid"] == c.probes["load", "paid"] == 0
        assert sum(n for (trigger, _), n in c.probes.items() if trigger == "load") <= 2  # floors 9, then 2


def test_probe_tax_cuts_the_drafting_that_lucky_probes_restart() -> None:
    """Outcomes at temperature 1 are noisy: when 30% of drafting steps pay by luck, probes resume drafting
    that then runs until patience losing steps come in a row. Counted in steps that cost about a quarter of
    the paused time; on the time allowance (probes and probation charged) well under half of that."""
    import random

    def run(timed: bool) -> tuple[int, float]:
        rng = random.Random(0)
        pol = SaturationPolicy(patience=8, resume_every=16)
        drafted = 0
        paused = 0.0
        for _ in range(4000):
            after_pause = pol.counters.pauses > 0
            if pol.begin_step(16):
                pol.observe(rng.random() < 0.3, num_running=16)
                if timed:
                    pol.record_step_ms(True, 22.0)
                drafted += after_pause
            else:
                if timed:
                    pol.record_step_ms(False, 5.0)
                paused += 5.0
        return drafted, drafted * 22.0 / paused

    counted, counted_share = run(timed=False)
    taxed, taxed_share = run(timed=True)
    assert counted_share > 0.15
    assert taxed < counted / 2 and taxed_share < 0.1, (counted, taxed, taxed_share)


def test_an_engine_that_reports_no_step_times_is_never_held_back_by_the_probe_tax() -> None:
    pol = SaturationPolicy(patience=1, resume_every=4)
    for _ in range(200):
        if pol.begin_step(16):
            pol.observe(False, num_running=16)
    assert pol.counters.deferred_probe_steps == 0 and pol.probe_allowance_ms == 0.0


def test_a_lucky_resume_is_charged_to_the_probe_tax_and_a_lasting_one_is_not() -> None:
    pol = SaturationPolicy(patience=2, resume_every=1)
    losing, paying = _decision(0, 0.5, 1.0), _decision(5, 1.3, 1.0)
    for _ in range(2):
        pol.begin_step(16)
        pol.observe(losing, num_running=16)
        pol.record_step_ms(True, 10.0)  # before the first pause: drafting, not charged
    assert not pol.drafting_enabled and pol.probe_allowance_ms == 0.0
    assert pol.begin_step(16) and pol.probing  # resume_every 1: the next paused step probes
    pol.observe(paying, num_running=16)
    pol.record_step_ms(True, 20.0)  # the first probe: the allowance starts full (PROBE_BANK probes of 20 ms)
    assert pol.drafting_enabled and pol.probe_allowance_ms == PROBE_BANK * 20.0 - 20.0
    for _ in range(4):  # on probation (2 x patience drafting steps): charged
        assert pol.begin_step(16) and pol.on_probation
        pol.observe(paying, num_running=16)
        pol.record_step_ms(True, 30.0)
    assert pol.probe_allowance_ms == PROBE_BANK * 20.0 - 140.0 < 0
    for _ in range(2):  # past probation: the resume held, and its debt is forgiven
        assert pol.begin_step(16) and not pol.on_probation
        pol.observe(paying, num_running=16)
        pol.record_step_ms(True, 10.0)
    assert pol.probe_allowance_ms == 0.0
    assert pol.counters.resumes == 1 and pol.counters.probes["timer", "paid"] == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.booleans(), st.floats(0.5, 40.0)), min_size=1, max_size=400),
       st.integers(1, 4), st.integers(1, 8))
def test_probes_start_only_with_allowance_left_and_the_bank_stays_capped(
    steps: list[tuple[int, bool, float]], patience: int, resume_every: int
) -> None:
    """Whatever the loads, outcomes and step times of an engine that times its steps: a timer probe starts only
    while the allowance is not negative -- rise and load-fall probes the tax does not hold back (bounded by the
    top they raise and the floor they lower) -- and the allowance never holds more than PROBE_BANK probes'
    worth."""
    pol = SaturationPolicy(patience, resume_every)
    probe_ms: dict[int, list[float]] = {}  # per bucket of the probe tax
    for running, paid, ms in steps:
        before = pol.probe_allowance_at(running)
        was_probing = pol.probing
        d = pol.begin_step(running)
        if d and pol.probing and not was_probing:
            assert before >= 0.0 or pol.probe_trigger in ("rise", "load")
        if d:
            step_kind_probe = pol.probing
            pol.observe(paid, num_running=running)
            pol.record_step_ms(True, ms)
            if step_kind_probe:
                probe_ms.setdefault(running.bit_length(), []).append(ms)
        else:
            pol.record_step_ms(False, ms)
        for load in (1, 2, 4, 8, 16, 32, 64):
            assert pol.probe_allowance_at(load) <= PROBE_BANK * max(probe_ms.get(load.bit_length(), [0.0])) + 1e-9


def test_patience_zero_never_pauses() -> None:
    pol = SaturationPolicy(patience=0, resume_every=1)
    for _ in range(50):
        assert pol.begin_step(500)
        pol.observe(False, 500)
    assert pol.drafting_enabled


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "fast"},
        {"policy": "greedy"},
        {"budget_frac": 1.5},
        {"budget_frac": -0.1},
        {"threshold": 2.0},
        {"min_predicted_gain": -0.01},
        {"min_predicted_gain": float("nan")},
        {"saturation_patience": -1},
        {"saturation_patience": 2.5},
        {"resume_every": 0},
        {"budget_frac": True},
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(DsparkError):
        CapacityConfig(**kwargs)


def test_config_from_dict_refuses_unknown_keys() -> None:
    assert CapacityConfig.from_dict({"mode": "varlen", "budget_frac": 0.5}).budget_frac == 0.5
    with pytest.raises(DsparkError, match="budget_fraction"):
        CapacityConfig.from_dict({"budget_fraction": 0.5})


# ---------------------------------------------------------------------------------------------- manager


def test_manager_plans_on_stale_and_allocates_on_fresh_confidences() -> None:
    mgr = CapacityManager(CapacityConfig(mode="varlen"), APPENDIX, num_spec_tokens=2, max_slots=4)
    slots = torch.tensor([2])
    slots_np = np.array([2])
    mgr.add_request(2)
    # Step 1: this step's fresh values must not drive the count; the slot is new, so stale = ones.
    mgr.record_confidences(slots, torch.tensor([[0.8, 0.0]]))
    assert mgr.stale_confidences(slots_np).tolist() == [[1.0, 1.0]]
    d1 = mgr.plan(slots_np, np.array([2]), 1, 1)
    assert d1.budget == 2  # survivals 1, 1: Θ2 = 3 * 0.45 > 1
    assert mgr.allocate(slots, torch.tensor([2]), d1.budget).tolist() == [1]  # fresh survival of slot 2 is 0
    # Step 2: the plan now sees step 1's values (stale by one record), never step 2's.
    mgr.record_confidences(slots, torch.tensor([[0.9, 0.9]]))
    assert mgr.stale_confidences(slots_np).tolist() == [[pytest.approx(0.8), 0.0]]
    d2 = mgr.plan(slots_np, np.array([2]), 1, 1)
    assert d2.budget == 0
    assert mgr.allocate(slots, torch.tensor([2]), 2).tolist() == [2]


def test_manager_reused_slot_does_not_inherit_the_old_request() -> None:
    mgr = CapacityManager(CapacityConfig(mode="varlen"), STAIR, num_spec_tokens=3, max_slots=2)
    for s in (0, 1):
        mgr.add_request(s)
    both = torch.tensor([0, 1])
    mgr.record_confidences(both, torch.full((2, 3), 0.1))
    mgr.record_confidences(both, torch.full((2, 3), 0.2))
    mgr.add_request(1)  # slot 1 now holds a new request
    # On CUDA the snapshot copies are asynchronous: the previous occupant's rows may land in the host buffers after
    # add_request filled them with ones. Emulated by writing them back after the add.
    for buf, old in zip(mgr._host, (0.1, 0.2), strict=True):
        buf[1].fill_(old)
    stale = mgr.stale_confidences(np.array([0, 1]))
    assert np.allclose(stale[0], 0.1) and np.allclose(stale[1], 1.0)
    assert torch.allclose(mgr.conf[1], torch.ones(3))
    mgr.record_confidences(both, torch.full((2, 3), 0.3))
    stale = mgr.stale_confidences(np.array([0, 1]))
    assert np.allclose(stale[0], 0.2) and np.allclose(stale[1], 1.0)  # snapshot predates the add
    mgr.record_confidences(both, torch.full((2, 3), 0.4))
    assert np.allclose(mgr.stale_confidences(np.array([1])), 0.3)


# A step records its confidences and plans; a lookahead may follow it, and anything may come between.
_LOOKAHEAD_OP = st.sampled_from(["step", "step", "step", "ahead", "ahead", "add", "pause", "batch", "drafts",
                                  "sampling", "record", "nothing"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_LOOKAHEAD_OP, st.integers(0, 2**31 - 1)), min_size=1, max_size=40),
       st.sampled_from(["varlen", "mask"]))
def test_a_plan_that_takes_a_lookahead_decides_what_a_plan_without_one_does(ops: list[tuple[str, int]],
                                                                            mode: str) -> None:
    """Two managers fed the same steps, one also planning ahead: every plan decides alike, whatever came between
    the lookahead and the plan (a refilled slot, a pause, another batch or drafts or sampling, a record that no plan
    followed, as a sampled probe's)."""
    k, slots_max = 3, 6
    cfg = CapacityConfig(mode=mode, policy="argmax", min_predicted_gain=0.0)
    # Every verified token costs a tenth of a step: the budget follows how many survivals clear that.
    # A sampling draft pass costs more.
    curve = SpsCurve.from_points([(1, 1.0), (4, 1.3), (8, 1.7), (16, 2.5), (32, 4.1)], draft_ms=[(1, 0.2)],
                                 draft_sampling_ms=[(1, 0.6)])
    ahead_mgr, plain_mgr = (CapacityManager(cfg, curve, num_spec_tokens=k, max_slots=slots_max) for _ in range(2))
    for mgr in (ahead_mgr, plain_mgr):
        for slot in range(slots_max):
            mgr.add_request(slot)
    batch = (np.arange(4), np.full(4, k), 4, True)  # slots, drafts per slot, non-draft tokens, sampling
    for op, seed in ops:
        rng = np.random.default_rng(seed)
        slots, drafts, nondraft, sampling = batch
        if op == "batch":
            size = int(rng.integers(1, slots_max + 1))
            slots = np.sort(rng.choice(slots_max, size=size, replace=False))
            batch = (slots, rng.integers(0, k + 1, size=size), size + int(rng.integers(0, 3)), bool(rng.integers(2)))
        elif op == "drafts":
            batch = (slots, rng.integers(0, k + 1, size=len(slots)), nondraft, sampling)
        elif op == "sampling":
            batch = (slots, drafts, nondraft, not sampling)
        elif op == "add":
            slot = int(rng.integers(slots_max))
            for mgr in (ahead_mgr, plain_mgr):
                mgr.add_request(slot)
        elif op == "ahead":
            ahead_mgr.plan_ahead(slots, drafts, nondraft, len(slots), sampling=sampling)
        elif op == "pause":  # what begin_step notes on a paused step: snapshots from before it read as unknown
            for mgr in (ahead_mgr, plain_mgr):
                mgr._records_at_pause = mgr._num_records
        elif op in ("step", "record"):
            conf = torch.from_numpy(rng.choice([0.0, 0.1, 0.5, 0.9, 1.0], size=(len(slots), k))).float()
            decided = []
            for mgr in (ahead_mgr, plain_mgr):
                mgr.record_confidences(torch.from_numpy(slots), conf)
                if op == "step":
                        decided.append(mgr.plan(slots, drafts, nondraft, len(slots), defer_saturation=True,
                                            sampling=sampling))
            assert op == "record" or decided[0] == decided[1]


def test_a_steady_batch_plans_from_the_lookahead_and_a_changed_one_does_not() -> None:
    k, r = 3, 4
    mgr = CapacityManager(CapacityConfig(mode="varlen"), STAIR, num_spec_tokens=k, max_slots=8)
    slots_np = np.arange(r)
    for slot in slots_np:
        mgr.add_request(int(slot))
    drafts = np.full(r, k)

    def step(conf: float, batch: np.ndarray = slots_np) -> BudgetDecision:
        mgr.record_confidences(torch.from_numpy(batch), torch.full((len(batch), k), conf))
        decision = mgr.plan(batch, drafts[: len(batch)], len(batch), len(batch), defer_saturation=True)
        mgr.plan_ahead(batch, drafts[: len(batch)], len(batch), len(batch))
        return decision

    step(0.9)
    assert (mgr.lookahead_plans, mgr.lookahead_hits) == (1, 0)
    step(0.1)
    step(0.1)
    assert (mgr.lookahead_plans, mgr.lookahead_hits) == (3, 2)
    step(0.1, slots_np[:3])  # a request finished: the lookahead was for a batch of four
    assert mgr.lookahead_hits == 2
    mgr.add_request(5)  # a slot the lookahead did not read was refilled; the plan cannot know which, so it chooses
    step(0.1, slots_np[:3])
    assert (mgr.lookahead_plans, mgr.lookahead_hits) == (5, 2)
    step(0.1, slots_np[:3])
    assert mgr.lookahead_hits == 3
    # A record no plan followed (a sampled probe's): the next plan reads it, not the snapshot looked ahead from.
    mgr.record_confidences(torch.from_numpy(slots_np[:3]), torch.full((3, k), 0.9))
    step(0.1, slots_np[:3])
    assert (mgr.lookahead_plans, mgr.lookahead_hits) == (7, 3)


def test_manager_pauses_drafting_when_verification_stops_paying() -> None:
    cfg = CapacityConfig(mode="varlen", saturation_patience=2, resume_every=3)
    mgr = CapacityManager(cfg, STAIR, num_spec_tokens=3, max_slots=64)
    slots = torch.arange(64)
    for s in range(64):
        mgr.add_request(s)
    low = torch.full((64, 3), 0.01)
    for _ in range(4):
        if not mgr.begin_step(64):
            break
        mgr.record_confidences(slots, low)
        mgr.plan(slots.numpy(), np.full(64, 3), 64, 64)
    assert not mgr.drafting_enabled
    # Load falls to a quarter: a probe drafts at once; drafting resumes only if the probe pays.
    assert mgr.begin_step(16) and mgr.saturation.probing and not mgr.drafting_enabled
    none_mgr = CapacityManager(CapacityConfig(mode="none", saturation_patience=1), STAIR, 3, 64)
    none_mgr.record_confidences(slots, low)
    none_mgr.record_confidences(slots, low)
    none_mgr.plan(slots.numpy(), np.full(64, 3), 64, 64)
    assert none_mgr.drafting_enabled and none_mgr.begin_step(64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_manager_on_cuda_hot_path_has_no_sync() -> None:
    mgr = CapacityManager(CapacityConfig(mode="varlen"), STAIR, num_spec_tokens=4, max_slots=32, device="cuda")
    slots = torch.arange(16, device="cuda")
    conf = torch.rand(16, 4, device="cuda")
    nd = torch.full((16,), 4, device="cuda")
    budget = torch.tensor(20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mgr.record_confidences(slots, conf)
        out = mgr.allocate(slots, nd, budget)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(out.sum()) == 20


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_stale_confidences_trail_the_records_by_one_over_many_steps(device: str) -> None:
    """The two host snapshots alternate, each with one event re-recorded per snapshot: the plan reads the record
    before the latest one at every step, never a half-copied or newer one."""
    mgr = CapacityManager(CapacityConfig(mode="varlen"), STAIR, num_spec_tokens=3, max_slots=8, device=device)
    slots = torch.arange(8, device=device)
    slots_np = np.arange(8)
    assert (mgr.stale_confidences(slots_np) == 1.0).all()  # nothing recorded yet: no event waited on
    for step in range(1, 12):
        # a large device tensor written just before the record, so an unfinished copy would read older values
        conf = torch.full((8, 3), step / 16, device=device) + torch.zeros(1 << 20, device=device)[:1].sum()
        mgr.record_confidences(slots, conf)
        expected = 1.0 if step == 1 else (step - 1) / 16
        assert mgr.stale_confidences(slots_np) == pytest.approx(np.full((8, 3), expected))


def test_warm_up_allocate_is_a_noop_where_the_torch_path_runs() -> None:
    from dspark_cli.core.capacity import warm_up_allocate

    assert warm_up_allocate(7, 256, "cpu") == 0  # CPU: the torch reference, nothing to compile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_allocate_compiles_every_bucket_on_cuda() -> None:
    from dspark_cli.core.capacity import warm_up_allocate

    assert warm_up_allocate(7, 100, "cuda") == 8  # 1, 2, 4, ..., 64, then 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_allocation_compile_after_warm_up_with_the_engines_dtype() -> None:
    """vLLM passes int32 scheduled-draft counts: warming up with int64 left a compile per bucket in serving."""
    from dspark_cli.core import _triton_capacity
    from dspark_cli.core.capacity import allocate, warm_up_allocate

    warm_up_allocate(5, 48, "cuda", drafts_dtype=torch.int32)

    def compiled() -> int:  # triton 3.x: device -> (kernel cache, key cache, target, backend, binder)
        return sum(len(caches[0]) for caches in _triton_capacity._allocate_kernel.device_caches.values())

    before = compiled()
    for r in (1, 3, 17, 33, 48):
        allocate(torch.rand(r, 5, device="cuda"), torch.full((r,), 5, dtype=torch.int32, device="cuda"), 2 * r)
    torch.cuda.synchronize()
    assert compiled() == before


def _flat_draft_curve() -> SpsCurve:
    # Verification nearly free, drafting not: only accepted drafts decide whether a drafting step pays.
    return SpsCurve.from_points([(1, 10.0), (64, 10.5), (512, 11.0)], [(1, 4.0), (64, 4.0)])


def _step(mgr: CapacityManager, r: int, conf: float, accepted_per_req: float) -> bool | None:
    """One engine step: begin, (draft, record, plan deferred, allocate, outcome). None when paused."""
    if not mgr.begin_step(r):
        return None
    slots = torch.arange(r)
    mgr.record_confidences(slots, torch.full((r, 3), conf))
    d = mgr.plan(np.arange(r), np.full(r, 3), r, r, defer_saturation=True)
    mgr.allocate(slots, torch.full((r,), 3), d.budget)
    return mgr.record_outcome(r + int(round(accepted_per_req * r)))


def test_outcomes_pause_a_confidently_wrong_head_that_predictions_never_would() -> None:
    cfg = CapacityConfig(mode="varlen", saturation_patience=3, resume_every=4)
    mgr = CapacityManager(cfg, _flat_draft_curve(), num_spec_tokens=3, max_slots=64)
    for s in range(64):
        mgr.add_request(s)
    # The head says 0.95 per draft (predicted ~2.7 accepted: drafting pays); really 0.2 get accepted,
    # so a step yields 1.2 tokens per request at 14.5 ms against 1 token at 10.5 ms without drafting.
    verdicts = [_step(mgr, 64, 0.95, 0.2) for _ in range(4)]
    assert mgr.last_decision is not None and mgr.last_decision.pays  # the prediction never doubts it
    assert verdicts[:3] == [False, False, False] and verdicts[3] is None  # paused after `patience` steps
    assert mgr.realized_gain is not None and mgr.realized_gain < 1.0
    # the same head with outcomes that match it keeps drafting
    honest = CapacityManager(cfg, _flat_draft_curve(), num_spec_tokens=3, max_slots=64)
    assert all(_step(honest, 64, 0.95, 2.7) for _ in range(20)) and honest.drafting_enabled


def test_a_probe_at_low_load_drafts_long_enough_to_judge_and_can_resume() -> None:
    from dspark_cli.core.saturation import PROBE_MAX_STEPS, PROBE_REQUEST_STEPS

    cfg = CapacityConfig(mode="varlen", saturation_patience=2, resume_every=3)
    mgr = CapacityManager(cfg, _flat_draft_curve(), num_spec_tokens=3, max_slots=4)
    for s in range(2):
        mgr.add_request(s)
    while _step(mgr, 2, 0.95, 0.0) is not None:  # nothing accepted: pauses (the loop ends on paused step 1)
        pass
    assert not mgr.drafting_enabled
    assert _step(mgr, 2, 0.95, 2.5) is None  # paused step 2; step 3 starts the probe
    probing = []
    # a probe covers PROBE_REQUEST_STEPS request-steps, or PROBE_MAX_STEPS steps at low load
    steps = min(-(-PROBE_REQUEST_STEPS // 2), PROBE_MAX_STEPS)
    for _ in range(steps):
        assert _step(mgr, 2, 0.95, 2.5) is not None
        probing.append(mgr.saturation.probing)
    assert probing == [True] * (steps - 1) + [False]
    # judged on its own outcome (it paid), not on the losing history: drafting resumes
    assert mgr.drafting_enabled and mgr.saturation.probe_wait == 3


@pytest.mark.parametrize("tax", [0, 0.0, -0.1, 1.5, float("nan"), True, "0.02"])
def test_a_probe_tax_outside_zero_to_one_is_refused_by_the_config_and_the_policy(tax: object) -> None:
    with pytest.raises(DsparkError, match="probe_tax"):
        CapacityConfig(mode="varlen", probe_tax=tax)  # type: ignore[arg-type]
    with pytest.raises(DsparkError, match="probe_tax"):
        SaturationPolicy(8, 16, tax)  # type: ignore[arg-type]
    assert CapacityConfig(mode="varlen", probe_tax=1.0).probe_tax == 1.0


def test_a_due_probe_waits_for_its_load_to_be_timed_but_not_forever() -> None:
    """measured=False holds a due probe, one paused step at a time, for at most PROBE_MEASURE_WAIT steps; a step
    with nothing due starts the count again."""
    from dspark_cli.core.saturation import PROBE_MEASURE_WAIT

    pol = SaturationPolicy(patience=1, resume_every=1)
    pol.begin_step(32)
    pol.observe(False, num_running=32)  # paused at 32: the top
    assert [pol.begin_step(64, measured=False) for _ in range(LOAD_SETTLE_STEPS)] == [False] * LOAD_SETTLE_STEPS
    assert pol.counters.rising_probe_steps == LOAD_SETTLE_STEPS  # the jump to 64 settles first
    held = [pol.begin_step(64, measured=False) for _ in range(PROBE_MEASURE_WAIT)]
    assert held == [False] * PROBE_MEASURE_WAIT and pol.counters.unmeasured_probe_steps == PROBE_MEASURE_WAIT
    assert pol.begin_step(64, measured=False) and pol.probe_trigger == "rise"  # waited long enough: it probes
    pol.observe(False, num_running=64)  # failed: the top is 64 now
    assert pol.top == 64
    pol2 = SaturationPolicy(patience=1, resume_every=1000)
    pol2.begin_step(32)
    pol2.observe(False, num_running=32)
    for _ in range(LOAD_SETTLE_STEPS + PROBE_MEASURE_WAIT - 1):
        assert not pol2.begin_step(64, measured=False)
    assert not pol2.begin_step(32)  # nothing due at the pausing load: the count starts over
    assert not pol2.begin_step(64, measured=False)  # so this rise probe waits again ...
    assert pol2.begin_step(64, measured=True) and pol2.probe_trigger == "rise"  # ... until its load is timed


@pytest.mark.parametrize("gain", [float("inf"), float("nan"), -0.1])
def test_a_minimum_predicted_gain_must_be_a_finite_number_from_zero(gain: float) -> None:
    """An unbounded range (``hi`` infinite) still takes finite numbers only: an infinite minimum gain would never
    trim, and say nothing about why."""
    with pytest.raises(DsparkError, match="min_predicted_gain must be a number in >= 0.0 and finite"):
        CapacityConfig(mode="varlen", min_predicted_gain=gain)
    assert CapacityConfig(mode="varlen", min_predicted_gain=1e9).min_predicted_gain == 1e9


def test_a_nan_confidence_counts_as_survival_zero_in_the_budget_as_in_the_allocation() -> None:
    """One NaN slot (a head that overflowed) sorted first and made every Θ(n) NaN: the budget fell to 1 for
    the whole batch and the step counted as not paying. It now counts as survival 0, as ``allocate`` takes it."""
    curve = SpsCurve.from_points([(1, 10.0), (64, 12.0), (256, 40.0)], [(1, 2.0), (64, 3.0)])
    cfg = CapacityConfig(mode="varlen")
    conf = np.full((32, 4), 0.9)
    clean = choose_budget(_np_survival(conf), np.full(32, 4), 32, 32, curve, cfg)
    conf[5, 2:] = np.nan
    nan = choose_budget(_np_survival(conf), np.full(32, 4), 32, 32, curve, cfg)
    assert clean.pays and nan.pays and clean.budget - 2 <= nan.budget <= clean.budget and nan.budget > 1
    survival = prefix_survival(torch.tensor(conf, dtype=torch.float32))
    assert torch.isfinite(survival).all() and survival[5, 2:].eq(0).all()


def test_paper_policy_in_choose_budget_stops_at_a_tie() -> None:
    """Θ(1) == Θ(0) exactly must end the walk, as in schedule_paper (ties favour shorter verification)."""
    curve = SpsCurve.from_dict([[1, 1.0], [2, 0.5], [3, 0.2]])
    d = choose_budget(np.array([[1.0, 1.0]]), np.array([2]), 1, 1, curve, CapacityConfig(mode="varlen", policy="paper"))
    assert d.budget == 0


def test_min_predicted_gain_compares_against_the_capped_budget() -> None:
    """With budget_frac < 1 the 'keep the full draft' fallback is the cap, and the predicted win must be measured
    against Θ(cap), not Θ(all drafts)."""
    surv = np.concatenate([np.full((8, 2), 0.9), np.full((8, 2), 0.01)], axis=1)  # 16 good slots, 16 poor ones
    nd = np.full(8, 4)
    plain = choose_budget(surv, nd, 8, 8, STAIR, CapacityConfig(mode="varlen", budget_frac=0.375, min_predicted_gain=0))
    assert plain.budget == 8  # the argmax sits below the cap of 12 ...
    d = choose_budget(surv, nd, 8, 8, STAIR,
                      CapacityConfig(mode="varlen", budget_frac=0.375, min_predicted_gain=0.05))
    assert d.budget == 12  # ... but beats Θ(12) by less than 5%: keep the capped full draft


def test_pays_needs_a_strict_gain_over_plain_decoding() -> None:
    """A step that only ties plain decoding does not pay."""
    tie = BudgetDecision(budget=1, theta_best=0.1, theta_all=0.1, theta_no_draft=0.1, step_ms=20.0, total_drafts=1)
    assert not tie.pays
    assert BudgetDecision(budget=1, theta_best=0.1000001, theta_all=0.1, theta_no_draft=0.1, step_ms=20.0,
                          total_drafts=1).pays


def test_mask_mode_prices_a_pruned_budget_at_the_full_batch() -> None:
    """In mask mode a pruned slot is still a computed row, so step_ms (and Θ) at a capped or thresholded budget is
    the full batch's price."""
    tiny = np.concatenate([np.full((4, 4), 0.6), np.full((4, 4), 1e-18)])
    nd = np.full(8, 4)
    full = STAIR.step_cost_ms(8, 8 + 32)
    capped = choose_budget(tiny, nd, 8, 8, STAIR, CapacityConfig(mode="mask", budget_frac=0.5))
    assert capped.budget == 16 and capped.step_ms == pytest.approx(full)
    thr = choose_budget(tiny, nd, 8, 8, STAIR, CapacityConfig(mode="mask", policy="threshold", threshold=0.5))
    assert thr.budget < 32 and thr.step_ms == pytest.approx(full)


def test_request_weighted_mean_forgets_by_request_steps() -> None:
    """A step of R requests decays the past by (1 - 1/memory)**R, so one full batch outweighs many single-request
    steps (hand-computed values)."""
    from dspark_cli.core.saturation import RequestWeightedMean

    m = RequestWeightedMean(4)
    m.add(1.0, 1)
    m.add(0.0, 4)
    decay = 0.75**4
    assert m.value == pytest.approx(decay * 1.0 / (decay * 1.0 + 4.0))
    m.add(2.0, 0)  # a step with no requests counts as one request
    w, x = 0.75 * (decay + 4.0) + 1.0, 0.75 * decay + 2.0
    assert m.value == pytest.approx(x / w)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 256), min_size=1, max_size=600))
def test_load_fall_probes_of_one_pause_are_bounded_by_the_floor_they_lower(loads: list[int]) -> None:
    """Untaxed, load-fall probes are still few: each one that fails or goes unjudged lowers the floor to its load,
    at most 3/4 of the last, so a pause at 256 requests holds at most log(256) / log(4/3) + 1 of them."""
    pol = SaturationPolicy(patience=1, resume_every=10**6)
    pol.begin_step(256)
    pol.observe(False, num_running=256)
    for r in loads:
        if pol.begin_step(r):
            pol.observe(False, num_running=r)
    load_probes = sum(n for (trigger, _), n in pol.counters.probes.items() if trigger == "load")
    assert pol.counters.pauses == 1 and load_probes <= math.log(256) / math.log(4 / 3) + 1


def test_rise_and_load_fall_probes_are_not_held_back_by_the_probe_tax() -> None:
    """A spent probe allowance defers timer probes, but a rise probe fires once the load has settled and a
    load-fall probe at once: each is bounded by the load it moves the top or the floor to (class docstring;
    a debt from a heavy load's drain probes held a light load's back for 1,300 steps, section 35)."""
    from dspark_cli.core.saturation import LOAD_SETTLE_STEPS, SaturationPolicy

    pol = SaturationPolicy(patience=1, resume_every=1000)
    assert pol.begin_step(16)
    pol.observe(False, num_running=16)  # paused at 16 requests
    assert not pol.drafting_enabled
    for _ in range(6):
        pol.record_step_ms(True, 10.0, kind="probe")  # earlier probes spent the allowance
    assert pol.probe_allowance_ms < 0
    got = [pol.begin_step(32) for _ in range(LOAD_SETTLE_STEPS + 1)]
    assert got == [False] * LOAD_SETTLE_STEPS + [True]
    assert pol.probing and pol.probe_trigger == "rise" and pol.counters.deferred_probe_steps == 0
    # the same spent allowance lets a load-fall probe through, and defers a timer probe (20 requests share 31's
    # bucket of the probe tax)
    low = SaturationPolicy(patience=1, resume_every=4)
    low.begin_step(31)
    low.observe(False, num_running=31)
    for _ in range(6):
        low.record_step_ms(True, 10.0, kind="probe")
    assert low.begin_step(20) and low.probe_trigger == "load" and low.counters.deferred_probe_steps == 0
    low.observe(False, num_running=20)  # failed: the floor is 20 now
    assert low.floor == 20 and low.probe_allowance_ms < 0
    assert not any(low.begin_step(20) for _ in range(10))
    assert low.counters.deferred_probe_steps > 0  # the timer probe came due and waits


_LOSING = BudgetDecision(budget=96, theta_best=4.0, theta_all=4.0, theta_no_draft=3.0, step_ms=1.0, total_drafts=224)


def _paused_by_losing_steps(load: int, step_ms: float) -> SaturationPolicy:
    """A policy (patience 8, timer every 16 paused steps) whose drafting steps at ``load``, timed at ``step_ms``,
    made 2 tokens a ms where plain decoding makes 3, until it paused."""
    pol = SaturationPolicy(patience=8, resume_every=16)
    while pol.drafting_enabled:
        pol.begin_step(load)
        pol.record_step_ms(True, step_ms)
        pol.observe_outcome(_LOSING, 2, load)
    return pol


def _sixteen_request_cell(pol: SaturationPolicy, paying: BudgetDecision) -> list[bool]:
    """Section 35's 16-request cell, timed as served (paused steps 10.9 ms, drafting 23 ms), drafting paying
    2 tokens a ms where plain decoding makes 1.5: which of its 765 steps drafted."""
    drafted = []
    for _ in range(765):
        d = pol.begin_step(16)
        drafted.append(d)
        pol.record_step_ms(d, 23.0 if d else 10.9)
        if d:
            pol.observe_outcome(paying, 2, 16)
    return drafted


def test_a_heavy_loads_probe_debt_does_not_keep_a_light_load_from_drafting() -> None:
    """docs/PERFORMANCE.md section 35 (H100, Llama-3-8B shape): drafting paused at 32 requests in the shape
    warm-up, whose drains then probed at heavy loads (100-240 ms a step) past the allowance. The 16-request cell
    that followed began with the load at half the pausing one, drafting paid there 1.1-1.2x, yet its load probe
    waited out the debt at 0.2 ms saved per paused step: 597 deferred steps, the whole cell paused, 10.7% below
    verifying everything."""
    pol = _paused_by_losing_steps(32, 25.0)
    for _ in range(6):
        pol.record_step_ms(True, 240.0, kind="probe")  # the warm-up's drain probes at 256 requests
    assert pol.probe_allowance_ms < -400
    paying = BudgetDecision(budget=48, theta_best=2.0, theta_all=2.0, theta_no_draft=1.5, step_ms=1.0,
                            total_drafts=112)
    drafted = _sixteen_request_cell(pol, paying)
    assert drafted.index(True) == 0 and sum(drafted) >= 0.95 * len(drafted), sum(drafted)
    assert pol.counters.probes["load", "paid"] == 1 and pol.ceiling == 32
    # The same run's mask server paused at 14 requests, so 16 is no load fall: its timer probes were due, and
    # waited on the debt of a rise probe at 256 requests (765 deferred steps, the whole cell). A rise probe is
    # untaxed, so it runs up no debt either.
    pol = _paused_by_losing_steps(14, 20.0)
    while not pol.begin_step(256):  # the load climbs, settles, and the rise probe fires
        pol.record_step_ms(False, 26.0)
    assert pol.probe_trigger == "rise"
    for _ in range(6):
        pol.record_step_ms(True, 240.0)
    pol.observe_outcome(BudgetDecision(budget=512, theta_best=300.0, theta_all=300.0, theta_no_draft=200.0,
                                       step_ms=1.0, total_drafts=1792), 128, 256)  # 0.64x plain decoding
    assert not pol.drafting_enabled and pol.probe_allowance_ms >= 0
    drafted = _sixteen_request_cell(pol, paying)
    assert drafted.index(True) <= 16 and sum(drafted) >= 0.95 * len(drafted), sum(drafted)


def test_a_heavy_loads_timer_probe_debt_does_not_hold_a_light_loads_timer_probe() -> None:
    """docs/PERFORMANCE.md section 36 (H100, Llama-3-8B shape): mask + SPS + STS paused at 52 requests in the shape
    warm-up, a load-fall probe at 17 requests failed (the floor: 16 requests is no load fall), and timer probes at
    124-256 requests (~250 ms a step with their catch-ups) failed into the probe tax's debt. Its 16-request cell
    deferred 735 of 765 steps waiting for paused steps of 11 ms to repay that debt at 2% each, drafted none, and
    ran 16% below verifying everything, where drafting paid 1.1-1.3x. The tax rations probing per load: a
    light load's timer probe owes nothing to a heavy load's; nor does it wait out the backoff of their failures."""
    pol = _paused_by_losing_steps(52, 30.0)
    assert pol.begin_step(17) and pol.probe_trigger == "load"  # the drain: a load-fall probe, which fails
    pol.record_step_ms(True, 25.0)
    pol.observe_outcome(_LOSING, 2, 17)
    assert not pol.drafting_enabled and pol.floor == 17
    # the warm-up's last waves: a rise probe at 256 requests (untaxed), then timer probes there that fail until
    # the allowance is in debt. 300 ms a probe: once the timer's wait is at its cap (512 paused steps of 25 ms, 256
    # ms saved at 2%), a probe of 250 ms no longer runs a debt up, since far-failing probes back off fast.
    for _ in range(64):
        while not pol.begin_step(256):
            pol.record_step_ms(False, 25.0)
        pol.record_step_ms(True, 300.0)
        pol.observe_outcome(_LOSING, 2, 256)
        assert not pol.drafting_enabled
        if pol.probe_allowance_ms < 0:  # at the load of the step begun last
            break
    assert pol.probe_allowance_ms < 0
    assert pol.counters.probes["rise", "failed"] == 1 and pol.counters.probes["timer", "failed"] >= 1
    paying = BudgetDecision(budget=48, theta_best=2.0, theta_all=2.0, theta_no_draft=1.5, step_ms=1.0,
                            total_drafts=112)
    assert pol.probe_wait >= 16 * 16  # backed off by the heavy load's failures
    drafted = _sixteen_request_cell(pol, paying)
    assert pol.counters.deferred_probe_steps == 0 and pol.counters.probes["timer", "paid"] == 1
    # once the load holds at 16, the heavy load's backoff no longer applies: the pause's own wait does
    first = drafted.index(True)
    assert first <= 16 and all(drafted[first:]), (first, sum(drafted))
    assert pol.begin_step(256) is False and pol.probe_allowance_ms < 0  # the heavy load's debt stands: its own timer probes still wait


def test_alternating_steady_loads_that_both_lose_probe_within_the_tax() -> None:
    """Drafting loses at 256 and at 16 requests, and the load alternates between long steady phases of each: every
    fall to 16 resets the timer's backoff (the failures at 256 say nothing about 16), so 16 is probed once a
    phase, but the probe tax still bounds what probing costs each load."""
    pol = SaturationPolicy(patience=8, resume_every=16)
    step_ms = {256: (25.0, 250.0), 16: (11.0, 22.0)}  # (paused, probe)
    spent = {256: 0.0, 16: 0.0}
    paused = {256: 0.0, 16: 0.0}
    for _ in range(20):
        for load in (256, 16):
            for _ in range(300):
                if pol.begin_step(load):
                    kind, ms = pol.step_kind, step_ms[load][1]
                    pol.observe_outcome(_LOSING, 2, load)
                    pol.record_step_ms(True, ms, kind=kind, num_running=load)
                    spent[load] += ms if kind == "probe" else 0.0
                else:
                    pol.record_step_ms(False, step_ms[load][0], kind="paused", num_running=load)
                    paused[load] += step_ms[load][0]
    for load in (256, 16):
        assert spent[load] <= PROBE_TAX * paused[load] + (PROBE_BANK + 1) * step_ms[load][1], (load, spent, paused)
    assert pol.counters.probes["timer", "failed"] >= 20  # 16 is probed again after each heavy phase


def _fail_timer_probes(pol: SaturationPolicy, load: int, failures: int) -> None:
    """Paused steps at ``load`` (timed at 10 ms) until ``failures`` more timer probes there have failed."""
    target = pol.counters.probes["timer", "failed"] + failures
    while pol.counters.probes["timer", "failed"] < target:
        if pol.begin_step(load):
            kind = pol.step_kind
            pol.observe_outcome(_LOSING, 2, load)
            pol.record_step_ms(True, 30.0, kind=kind, num_running=load)
        else:
            pol.record_step_ms(False, 10.0, kind="paused", num_running=load)


def test_the_backoff_reset_waits_for_a_lighter_load_that_holds() -> None:
    """The reset of the timer's backoff (section 36) needs a load at or below 3/4 of the failed probe's that holds
    for the pause's first wait: a full batch losing a request, a drain, or a straggler tail shorter than that
    keeps the backoff; and the backoff earned at the lighter load itself is kept."""
    pol = _paused_by_losing_steps(256, 30.0)
    _fail_timer_probes(pol, 256, 5)
    backed_off = pol.probe_wait
    assert backed_off >= 16 * 32
    for load in [255] * 40 + list(range(250, 0, -10)) + [3] * 10 + [256] * 4:  # no hold at a lighter load
        assert not pol.begin_step(load) or pol.probe_trigger != "timer", load
        pol.record_step_ms(False, 10.0, kind="paused", num_running=load)
    assert pol.probe_wait == backed_off
    # backoff earned at 16 requests, then a failure at 256: back at a steady 16 the wait is 16's, not the pause's
    pol = _paused_by_losing_steps(16, 30.0)
    _fail_timer_probes(pol, 16, 3)
    wait_at_16 = pol.probe_wait
    _fail_timer_probes(pol, 256, 1)
    assert pol.probe_wait > wait_at_16  # grown by the failure at 256
    for _ in range(16):
        assert not pol.begin_step(16)
    assert pol.probe_wait == wait_at_16 > 16


_PAYING = BudgetDecision(budget=48, theta_best=2.0, theta_all=2.0, theta_no_draft=1.5, step_ms=1.0, total_drafts=112)


def _policy_step(pol: SaturationPolicy, load: int, outcome: BudgetDecision) -> bool:
    """One step at ``load`` (drafting 30 ms, paused 10), judged by ``outcome`` where it drafts."""
    drafting = pol.begin_step(load)
    kind = pol.step_kind
    if drafting:
        pol.observe_outcome(outcome, 2, load)
    pol.record_step_ms(drafting, 30.0 if drafting else 10.0, kind=kind, num_running=load)
    return drafting


def test_a_light_load_that_wobbles_by_a_request_still_resets_the_backoff() -> None:
    """At 16 requests 5% is less than one request: a request finishing and the next arriving a step later moved
    the load to 15 for a step, which restarted the hold every time; with one such step in every 12 the reset
    never came, and section 36's 16-request cell waited out the heavy load's backoff (~500 paused steps)."""
    for every in (None, 12, 5):
        pol = _paused_by_losing_steps(256, 30.0)
        _fail_timer_probes(pol, 256, 5)
        assert pol.probe_wait >= 16 * 32
        assert _policy_step(pol, 16, _LOSING) and pol.probe_trigger == "load"  # the drain's load-fall probe fails there
        loads = [15 if every and i % every == every - 1 else 16 for i in range(200)]
        first = next(i for i, load in enumerate(loads) if _policy_step(pol, load, _PAYING))
        assert first <= 20, (every, first)


def test_a_backoff_carried_into_a_new_pause_resets_at_a_lighter_load_that_holds() -> None:
    """A resume that lost within its probation at 256 requests pauses again with twice its wait, and a ceiling
    the load came back to with the ceiling's: backoffs earned at the heavy load, which a lighter load that holds
    resets, as it resets a failed timer probe's. They had carried into the 16-request cell whole."""
    def drain_to_paying_16(pol: SaturationPolicy) -> int:
        assert _policy_step(pol, 16, _LOSING) and pol.probe_trigger == "load"  # the drain's load-fall probe fails
        return next(i for i in range(2000) if _policy_step(pol, 16, _PAYING))

    lucky = _paused_by_losing_steps(256, 30.0)
    _fail_timer_probes(lucky, 256, 4)
    while not _policy_step(lucky, 256, _PAYING):  # a timer probe at 256 pays by luck ...
        pass
    while lucky.drafting_enabled:  # ... and drafting loses again within its probation
        _policy_step(lucky, 256, _LOSING)
    assert lucky.probe_wait >= 16 * 32
    assert drain_to_paying_16(lucky) <= 20
    ceiling = _paused_by_losing_steps(256, 30.0)
    _fail_timer_probes(ceiling, 256, 5)
    assert _policy_step(ceiling, 100, _PAYING) and ceiling.drafting_enabled and ceiling.ceiling == 256
    for _ in range(30):
        _policy_step(ceiling, 100, _PAYING)
    assert not _policy_step(ceiling, 256, _PAYING)  # the load that did not pay is back: paused with the backoff
    assert ceiling.probe_wait >= 16 * 32
    assert drain_to_paying_16(ceiling) <= 20
    # at the heavy load itself the carried backoff stands
    again = _paused_by_losing_steps(256, 30.0)
    _fail_timer_probes(again, 256, 4)
    while not _policy_step(again, 256, _PAYING):
        pass
    while again.drafting_enabled:
        _policy_step(again, 256, _LOSING)
    wait = again.probe_wait
    for _ in range(wait - 1):
        assert not _policy_step(again, 256, _LOSING)


def test_a_probation_step_reported_late_is_charged_where_its_probe_ran() -> None:
    """vLLM reports a step's time a decision or two late: a probation step reported after a drain's load-fall
    probe began at 4 requests was charged to 4's account, which no paused step there could repay, and never to
    16's, where the resume was bought."""
    pol = SaturationPolicy(patience=2, resume_every=4)
    while pol.drafting_enabled:
        _policy_step(pol, 16, _LOSING)
    while not pol.begin_step(16):
        pol.record_step_ms(False, 10.0, num_running=16)
    pol.record_step_ms(True, 20.0, kind="probe", num_running=16)
    pol.observe_outcome(_PAYING, 2, 16)  # a timer probe at 16 pays: probation
    begun = []
    while pol.drafting_enabled:
        pol.begin_step(16)
        begun.append((pol.step_kind, pol.probe_trigger, pol.probe_bucket))
        pol.observe_outcome(_LOSING, 2, 16)
    at_16 = pol.probe_allowance_at(16)
    assert pol.begin_step(4) and pol.probe_trigger == "load"  # the drain: a load-fall probe at 4
    for kind, trigger, bucket in begun:  # the probation steps' times come in now
        assert kind == "probation"
        pol.record_step_ms(True, 50.0, kind=kind, num_running=16, trigger=trigger, probe_bucket=bucket)
    assert pol.probe_allowance_at(16) == at_16 - 50.0 * len(begun) and pol.probe_allowance_at(4) == 0.0


def test_a_step_timed_whole_is_taxed_whole_and_an_interval_up_to_the_clamp() -> None:
    """The embedded engine times the step itself: a probe's catch-up over a long pause (300 ms at a 20 ms price)
    is all probing cost. vLLM's manager times the interval between two decisions, which a server can idle
    through: there the tax counts PROBE_TAX_CLAMP x the price at most."""
    for clamp, charged in ((None, 300.0), (PROBE_TAX_CLAMP, PROBE_TAX_CLAMP * 20.0)):
        policy = SaturationPolicy(patience=2, resume_every=4)
        StepTimer(policy, tax_clamp=clamp).record(True, 16, 300.0, 20.0,
                                                  charge=StepCharge("probe", "timer", StepTimeCalibration.load_bucket(16)))
        # the bucket's first probe finds its account full (PROBE_BANK probes of this one's time), then spends it
        assert policy.probe_allowance_at(16) == pytest.approx((PROBE_BANK - 1) * charged)


def test_a_resume_that_fails_at_another_load_leaves_no_debt_the_load_cannot_repay() -> None:
    """Probation is charged to the load its probe ran at: a timer probe paid at 16 requests, the load moved to 64
    and drafting lost there within probation. Charged to 64, whose bucket had no probe, the debt was one that
    paused steps never repay (they save only where a probe ran), and every timer probe at 64 waited for good."""
    pol = SaturationPolicy(patience=2, resume_every=4)
    paying = BudgetDecision(budget=48, theta_best=2.0, theta_all=2.0, theta_no_draft=1.5, step_ms=1.0,
                            total_drafts=112)
    while pol.drafting_enabled:
        pol.begin_step(16)
        pol.observe_outcome(_LOSING, 2, 16)
    while not pol.begin_step(16):
        pol.record_step_ms(False, 10.0)
    assert pol.probing and pol.probe_trigger == "timer"
    pol.observe_outcome(paying, 2, 16)
    pol.record_step_ms(True, 20.0, kind="probe", num_running=16)
    assert pol.drafting_enabled
    while pol.drafting_enabled:  # on probation at 64 requests, losing
        assert pol.begin_step(64) and pol.on_probation
        pol.observe_outcome(_LOSING, 2, 64)
        pol.record_step_ms(True, 50.0, kind="probation", num_running=64)
    assert pol.probe_allowance_at(64) == 0.0 and pol.probe_allowance_at(16) < 0
    _fail_timer_probes(pol, 64, 3)  # the timer still probes at 64
    assert pol.counters.deferred_probe_steps == 0


def test_a_late_probe_step_is_charged_by_the_trigger_it_began_under() -> None:
    """Times reported late carry the trigger of their probe: a failed timer probe's step, reported after a
    load-fall probe began, is the timer's to pay; a load-fall probe's step, reported after a timer probe
    began, is not."""
    pol = _paused_by_losing_steps(64, 30.0)
    _fail_timer_probes(pol, 64, 1)  # the allowance at 64 is funded (a probe ran there)
    before = pol.probe_allowance_at(64)
    assert pol.begin_step(40) and pol.probe_trigger == "load"  # a load-fall probe begins ...
    pol.record_step_ms(True, 50.0, kind="probe", num_running=64, trigger="timer")  # ... the timer probe's time
    assert pol.probe_allowance_at(64) == before - 50.0
    pol.record_step_ms(True, 50.0, kind="probe", num_running=64, trigger="load")
    assert pol.probe_allowance_at(64) == before - 50.0


def test_a_step_reported_late_is_charged_to_the_probe_tax_at_its_own_load() -> None:
    """vLLM on CUDA learns a step's time after later steps began (engines/vllm/step_clock.py): the step's own load,
    not the load begun last, picks the account it spends from."""
    pol = SaturationPolicy(patience=1, resume_every=1)
    pol.begin_step(256)
    pol.observe(False, num_running=256)
    assert pol.begin_step(256) and pol.probing  # a timer probe at 256 requests
    pol.observe(False, num_running=256)
    assert not pol.begin_step(200)  # the load moved before the probe's time came back
    pol.record_step_ms(True, 240.0, kind="probe", num_running=256)
    assert pol.probe_allowance_at(256) == PROBE_BANK * 240.0 - 240.0 and pol.probe_allowance_at(200) == 0.0
    pol.record_step_ms(False, 10.0, kind="paused", num_running=200)  # no probe at 200 yet: nothing to save for
    assert pol.probe_allowance_at(200) == 0.0


def test_allocate_admits_a_prefix_even_where_a_hand_made_survival_rises() -> None:
    """Survival rising along a request (a hand-made input: prefix_survival never rises) is made non-increasing
    first, so a later slot's high value cannot buy it a place before the low slot it depends on."""
    survival = torch.tensor([[0.2, 0.9, 0.9], [0.5, 0.4, 0.1]])
    assert allocate(survival, torch.tensor([3, 3]), 2, use_triton=False).tolist() == [0, 2]
    assert allocate(survival, torch.tensor([3, 3]), 4, use_triton=False).tolist() == [2, 2]  # ties: by position


def test_an_engine_limit_bounds_the_budget_search_and_its_price() -> None:
    surv = np.full((4, 4), 0.99)
    nd = np.full(4, 4)
    free = choose_budget(surv, nd, 4, 4, STAIR, ARGMAX)
    limited = choose_budget(surv, nd, 4, 4, STAIR, ARGMAX, max_budget=5)
    assert free.budget > 5 and limited.budget <= 5
    assert limited.step_ms == pytest.approx(STAIR.step_cost_ms(4, 4 + limited.budget))
    assert limited.theta_all == free.theta_all  # every draft's Θ is still what "all" means
    assert choose_budget(surv, nd, 4, 4, STAIR, CapacityConfig(mode="none"), max_budget=5).budget == 5
    assert choose_budget(surv, nd, 4, 4, STAIR, ARGMAX, max_budget=-3).budget == 0


def test_a_timer_probe_that_falls_far_short_backs_the_timer_off_further() -> None:
    """Each failed timer probe judged on its outcome grows the wait by 2 / realized, between 2 and
    PROBE_BACKOFF_MAX_GROWTH: a probe at half of plain decoding's rate waits four times as long as the last, one
    just short of break-even about twice (SmolLM2-135M at 16 requests realized 0.40-0.66x, and doubling spent
    the load's first 500 paused steps on five probes)."""
    pol = SaturationPolicy(patience=1, resume_every=8)
    r, plain = 16, 16.0  # plain decoding: 16 tokens per ms for the batch, so a 1 ms step realizes tokens / 16
    priced = BudgetDecision(budget=5, theta_best=20.0, theta_all=20.0, theta_no_draft=plain, step_ms=1.0,
                            total_drafts=10)
    pol.begin_step(r)
    pol.observe_outcome(priced, 0.5 * plain, r)  # drafting at half of plain decoding: paused
    assert not pol.drafting_enabled and pol.probe_wait == 8

    def failed_probe(realized: float, decision: BudgetDecision = priced) -> None:
        waited = 0
        while not pol.begin_step(r):
            waited += 1
        assert pol.probing and pol.probe_trigger == "timer" and waited + 1 == pol.probe_wait  # the due step probes
        pol.observe_outcome(decision, realized * PROBE_MARGIN * plain, r)  # 16 request-steps: judged at once
        assert not pol.probing and not pol.drafting_enabled
        assert pol.counters.last_probe is not None and pol.counters.last_probe.realized == pytest.approx(realized)

    failed_probe(0.5)
    assert pol.probe_wait == 32  # four times
    failed_probe(0.25)
    assert pol.probe_wait == 128  # at most four times
    failed_probe(0.95)
    assert pol.probe_wait == SaturationPolicy.MAX_PROBE_BACKOFF * 8  # 2.1 x 128 = 269, capped at 256
    # Just short of break-even from a fresh pause: about twice, as before.
    pol = SaturationPolicy(patience=1, resume_every=8)
    pol.begin_step(r)
    pol.observe_outcome(priced, 0.5 * plain, r)
    failed_probe(0.95)
    assert pol.probe_wait == round(8 * 2 / 0.95)  # 17
    unpriced = BudgetDecision(budget=0, theta_best=plain, theta_all=20.0, theta_no_draft=plain, step_ms=1.0,
                              total_drafts=10)
    failed_probe(1.2, unpriced)  # cleared the margin, but its budget said drafting does not pay: doubled
    assert pol.probe_wait == 34
