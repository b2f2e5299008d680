"""Losslessness end to end: the capacity manager may change how many drafts are verified, never the output.

Greedy: the same prompts give token-identical outputs with no speculation, capacity ``none``, ``mask`` and
``varlen`` (with a curve that really trims), with and without a confidence head, with offline and online
STS, and with mixed batches. Temperature 1: the marginal distribution of the second generated token
matches the target's exact distribution (chi-square goodness of fit) with pruning switched on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_embedded_engine import VOCAB, TinyPair, make_engine, prompts

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.fileio import atomic_write_json

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)



@pytest.fixture(scope="module")
def reference(pair: TinyPair) -> list[list[int]]:
    """Plain decoding: no draft at all."""
    return make_engine(pair, num_speculative_tokens=0).generate(prompts(6), GREEDY)


def _capacity(mode: str) -> CapacityConfig:
    # patience 0: never pause drafting, so every step exercises the capacity path. Mask mode prices a dense
    # model's uniform batch whole (pruning saves nothing there), so it prunes only under a budget cap: the
    # cap is what sends its pruned-padding rows through these checks.
    return CapacityConfig(mode=mode, saturation_patience=0, budget_frac=0.5 if mode == "mask" else 1.0)


@pytest.mark.parametrize("draft_kind", ["plain", "head"])
@pytest.mark.parametrize("mode", ["none", "mask", "varlen"])
def test_greedy_identical_across_capacity_modes(
    pair: TinyPair, reference: list[list[int]], mode: str, draft_kind: str
) -> None:
    draft = pair.draft if draft_kind == "plain" else pair.draft_head
    engine = make_engine(pair, draft=str(draft), capacity=_capacity(mode), sps_curve=str(pair.curve))
    got = engine.generate(prompts(6), GREEDY)
    assert got == reference
    s = engine.stats
    assert s.num_drafts > 0 and s.num_accepted_tokens > 0
    if mode == "none":
        assert s.num_verified_draft_tokens == s.num_draft_tokens
    else:
        # The curve's riser past 16 tokens must make the manager trim, or this test proves nothing.
        assert s.num_verified_draft_tokens < s.num_draft_tokens


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_identical_for_other_draft_lengths(pair: TinyPair, reference: list[list[int]], k: int) -> None:
    engine = make_engine(
        pair, num_speculative_tokens=k, capacity=_capacity("varlen"), sps_curve=str(pair.curve)
    )
    assert engine.generate(prompts(6), GREEDY) == reference


CPU_AND_CUDA = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("mode", ["mask", "varlen"])
def test_a_budget_of_every_draft_admits_them_all_without_the_allocation(
    pair: TinyPair, reference: list[list[int]], mode: str, device: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Verification priced as nearly free: every plan verifies every draft, which the engine admits as capacity "none"
    # does, without the allocation's launches; the staircase curve trims, and there the allocation runs. On CUDA
    # the steps replay captured graphs, where the admitted counts come from the cached tensor instead.
    flat = SpsCurve.from_points([(1, 1.0), (256, 1.1)], [(1, 0.1), (64, 0.1)]).save(tmp_path / "flat.json")
    calls = {"allocate": 0}
    for curve, trims in ((flat, False), (pair.curve, mode == "varlen")):
        engine = make_engine(pair, capacity=CapacityConfig(mode=mode, saturation_patience=0), sps_curve=str(curve),
                             device=device, dtype="float32")
        real = engine.capacity.allocate

        def counted(*args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            calls["allocate"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(engine.capacity, "allocate", counted)
        calls["allocate"] = 0
        assert engine.generate(prompts(6), GREEDY) == reference
        s = engine.stats
        assert s.num_drafts > 0
        if trims:
            assert calls["allocate"] > 0 and s.num_verified_draft_tokens < s.num_draft_tokens
        else:
            assert calls["allocate"] == 0 and s.num_verified_draft_tokens == s.num_draft_tokens


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_planning_ahead_decides_every_budget_as_planning_in_the_step(
    pair: TinyPair, reference: list[list[int]], device: str, temperature: float
) -> None:
    """The next step's plan made while the device verifies (CapacityManager.plan_ahead) decides what the step's own
    plan would: the same budgets, step by step, and the same outputs (greedy: plain decoding's; seeded sampling: the
    same tokens), with most plans of a steady batch taken from the lookahead. On by default on CUDA only."""
    runs = []
    for ahead in (False, True):
        engine = make_engine(pair, draft=str(pair.draft_head), capacity=_capacity("varlen"), sps_curve=str(pair.curve),
                             online_sts=True, device=device, dtype="float32")
        assert engine.plan_ahead is (device == "cuda")
        engine.plan_ahead = ahead
        capacity = engine.capacity
        budgets: list[int] = []
        real = capacity.plan

        def spy(*args, _real=real, _budgets=budgets, **kwargs):  # type: ignore[no-untyped-def]
            decision = _real(*args, **kwargs)
            _budgets.append(decision.budget)
            return decision

        capacity.plan = spy  # type: ignore[method-assign]
        params = [SamplingParams(temperature=temperature, max_tokens=GREEDY.max_tokens, ignore_eos=True, seed=i)
                  for i in range(6)]
        runs.append((engine.generate(prompts(6), params), budgets, capacity.lookahead_plans, capacity.lookahead_hits,
                     engine.stats))
    (out_in_step, budgets_in_step, plans_in_step, _, _), (out_ahead, budgets_ahead, plans, hits, stats) = runs
    assert out_ahead == out_in_step and budgets_ahead == budgets_in_step
    if temperature == 0.0:
        assert out_ahead == reference
    assert plans_in_step == 0 and plans == len(budgets_ahead)
    assert hits >= len(budgets_ahead) // 2, (hits, len(budgets_ahead))
    assert stats.num_verified_draft_tokens < stats.num_draft_tokens  # the curve trims: the budgets mattered


def test_greedy_identical_with_sts_and_saturation(pair: TinyPair, reference: list[list[int]], tmp_path: Path) -> None:
    sts_path = tmp_path / "sts.json"
    atomic_write_json(sts_path, {"version": 1, "temperatures": [0.5, 2.0, 3.0], "sts_temperatures": [0.5, 2.0, 3.0]})
    for online in (False, True):
        engine = make_engine(
            pair, draft=str(pair.draft_head), capacity=CapacityConfig(mode="varlen", saturation_patience=2,
                                                                       resume_every=3),
            sps_curve=str(pair.curve), sts=str(sts_path), online_sts=online,
        )
        assert engine.generate(prompts(6), GREEDY) == reference


def test_greedy_identical_with_probe_scouts(pair: TinyPair, reference: list[list[int]], tmp_path: Path) -> None:
    # A scout drafts (catching the draft up over the pause) and verifies nothing; the probe's next step verifies
    # what its plan admits: neither may change an output. Verification priced by the token, as at a heavy load,
    # so drafting never pays and a probe's plan costs several steps that verify none: every probe scouts.
    curve = SpsCurve.from_points([(1, 1.0), (256, 256.0)], [(1, 0.5), (64, 0.5)]).save(tmp_path / "curve.json")
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(curve),
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=2,
                                                 probe_scout=True))
    assert engine.generate(prompts(6), GREEDY) == reference
    sat = engine.capacity.saturation.counters
    assert sat.pauses >= 1 and sat.scout_steps >= 1 and sat.probe_steps > sat.scout_steps


def test_greedy_identical_in_mixed_batches(pair: TinyPair, reference: list[list[int]]) -> None:
    """Greedy requests stay exact while sampled requests with other settings share their batches."""
    engine = make_engine(pair, capacity=_capacity("mask"), sps_curve=str(pair.curve))
    ps = prompts(6)
    params = []
    for i in range(6):
        params.append(GREEDY)
        params.append(SamplingParams(temperature=0.7 + 0.2 * i, top_p=0.9, max_tokens=20, seed=i, ignore_eos=True))
    mixed = [p for p in ps for _ in range(2)]
    got = engine.generate(mixed, params)
    assert got[0::2] == reference


def _exact_second_token_marginal(target: Path, prompt: list[int]) -> np.ndarray:
    """p(x2) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1), from transformers at temperature 1."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        batch = torch.tensor([prompt + [x] for x in range(VOCAB)])
        p2 = hf(batch).logits[:, -1].softmax(-1)
    return (p1.unsqueeze(1) * p2).sum(0).numpy()


@pytest.mark.parametrize(("mode", "graphs"), [("none", False), ("varlen", False), ("varlen", True)])
def test_sampled_distribution_is_the_targets(pair: TinyPair, mode: str, graphs: bool) -> None:
    """``graphs``: the CUDA-graph replay path (the sampling draft loop's static buffers), run eagerly."""
    from scipy.stats import chisquare

    prompt = prompts(1, seed=5)[0]
    expected = _exact_second_token_marginal(pair.target, prompt)
    n = 1500
    engine = make_engine(
        pair, max_num_seqs=64, max_model_len=64, num_speculative_tokens=3, capacity=_capacity(mode),
        sps_curve=str(pair.curve), seed=11,
    )
    if graphs:
        engine.runner.emulate_graphs()
    outs = engine.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True))
    assert engine.stats.num_accepted_tokens > 0
    counts = np.bincount([o[1] for o in outs], minlength=VOCAB).astype(np.float64)
    exp = expected * n
    # Merge tokens with small expected counts into one bin so the chi-square approximation holds.
    big = exp >= 5
    obs_b = np.append(counts[big], counts[~big].sum())
    exp_b = np.append(exp[big], exp[~big].sum())
    exp_b *= obs_b.sum() / exp_b.sum()
    stat, p_value = chisquare(obs_b, exp_b)
    assert p_value > 1e-3, f"chi-square {stat:.1f} over {len(obs_b)} bins, p={p_value:.2e}"


def test_greedy_identical_with_auto_profiled_curve(pair: TinyPair, reference: list[list[int]]) -> None:
    engine = make_engine(pair, capacity=_capacity("varlen"), sps_curve="auto", sps_overhead_ms=7.5)
    assert engine.sps_curve is not None and engine.sps_curve.meta["engine"] == "embedded"
    assert engine.sps_curve.overhead_ms == 7.5  # --sps-overhead-ms overrides the profiled overhead
    assert engine.sps_curve.meta["overhead_source"] == "given"  # not measured, then thrown away
    assert engine.generate(prompts(6), GREEDY) == reference


@pytest.mark.parametrize("mode", ["none", "mask", "varlen"])
def test_greedy_identical_through_the_graph_replay_path(
    pair: TinyPair, reference: list[list[int]], mode: str
) -> None:
    """The CUDA-graph replay plumbing (static buffers, padded sizes, scratch rows), run eagerly on CPU."""
    engine = make_engine(pair, draft=str(pair.draft_head), capacity=_capacity(mode), sps_curve=str(pair.curve))
    engine.runner.emulate_graphs()
    assert engine.runner.capture_sizes == [1, 2, 4, 8, 16, 32]
    assert engine.generate(prompts(6), GREEDY) == reference
    if mode != "none":
        assert engine.stats.num_verified_draft_tokens < engine.stats.num_draft_tokens


@pytest.mark.parametrize("emulate_graphs", [False, True])
@pytest.mark.parametrize("mode", ["mask", "varlen"])
def test_greedy_identical_with_the_kernel_attention_backend(
    pair: TinyPair, reference: list[list[int]], mode: str, emulate_graphs: bool
) -> None:
    """The kernel backend reads device query_start_loc/seq_lens: mask rows, varlen tails and graph scratch
    rows must all be counted right (on CPU the kernel module runs its torch reference)."""
    engine = make_engine(
        pair, capacity=_capacity(mode), sps_curve=str(pair.curve), attention_backend="triton"
    )
    if emulate_graphs:
        engine.runner.emulate_graphs()
    assert engine.runner.backend.name == "triton"
    assert engine.generate(prompts(6), GREEDY) == reference


def test_prefills_replay_the_ragged_graph_families(pair: TinyPair, reference: list[list[int]]) -> None:
    """Prompts of several lengths prefill through the target's ragged family and the draft's (the CUDA-graph
    replay plumbing for any split of a padded token count, run eagerly on CPU); outputs stay the same."""
    from dspark_cli.engines.embedded.model_runner import ragged_capture_sizes

    assert ragged_capture_sizes(100) == [16, 24, 32, 48, 64, 96, 100]
    assert ragged_capture_sizes(2048)[-3:] == [1024, 1536, 2048]
    engine = make_engine(pair, capacity=_capacity("varlen"), sps_curve=str(pair.curve))
    runner = engine.runner
    runner.emulate_graphs()
    assert runner._prefill_graphs is not None and runner._draft_ragged_graphs is not None
    served: dict[str, list[int]] = {"target": [], "draft": []}
    for name, family in (("target", runner._prefill_graphs), ("draft", runner._draft_ragged_graphs)):
        body = family._body
        family._body = lambda size, body=body, seen=served[name]: (seen.append(size), body(size))[1]  # type: ignore[method-assign]
    assert engine.generate(prompts(6), GREEDY) == reference
    # One prefill of six prompts of 6-8 tokens (42 tokens: the 48 bucket), target and draft alike.
    assert served == {"target": [48], "draft": [48]}
