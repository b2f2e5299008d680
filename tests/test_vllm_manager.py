"""The vLLM manager's pure pieces on CPU: mask-mode row selection, curve building, temperatures, paths.

The manager class itself subclasses vLLM's (CUDA-only) manager and is exercised by
``benchmarks/vllm_adaptive.sh`` on the GPU host.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_cli.engines.vllm.config import DsparkVllmSettings
from dspark_cli.engines.vllm.manager import (
    curve_from_samples,
    initial_temperatures,
    invalid_draft_rows,
    load_curve,
    pruned_token_mask,
    traces_path,
    with_overhead,
)


def _layout(nondraft: list[int], drafts: list[int]) -> tuple[torch.Tensor, int]:
    lens = np.asarray(nondraft) + np.asarray(drafts)
    qsl = np.concatenate(([0], np.cumsum(lens)))
    return torch.tensor(qsl, dtype=torch.int32), int(qsl[-1])


def test_pruned_rows_are_the_tail_of_each_requests_drafts() -> None:
    # request 0: prefill chunk of 3 tokens, no drafts; request 1: 1 + 4 drafts, 2 admitted; request 2: 1 + 4, 0
    qsl, n = _layout([3, 1, 1], [0, 4, 4])
    mask = pruned_token_mask(qsl, torch.tensor([0, 4, 4]), torch.tensor([0, 2, 0]), n)
    assert mask.tolist() == [False] * 3 + [False, False, False, True, True] + [False, True, True, True, True]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=6))
def test_mask_rows_match_a_per_request_walk(reqs: list[tuple[int, int, int]]) -> None:
    nondraft = [a for a, _, _ in reqs]
    drafts = [d for _, d, _ in reqs]
    admitted = [min(c, d) for _, d, c in reqs]
    qsl, n = _layout(nondraft, drafts)
    expected: list[bool] = []
    for nd, d, c in zip(nondraft, drafts, admitted, strict=True):
        expected += [False] * nd + [j >= c for j in range(d)]
    got = pruned_token_mask(qsl, torch.tensor(drafts), torch.tensor(admitted), n)
    assert got.tolist() == expected
    # logit rows: request r has d_r + 1 rows at local positions 0..d_r; position p checks draft p-1
    cu = torch.tensor(np.concatenate(([0], np.cumsum(np.asarray(drafts) + 1))), dtype=torch.int32)
    local = torch.cat([torch.arange(d + 1) for d in drafts])
    inv = invalid_draft_rows(local, cu, torch.tensor(admitted))
    want = [p > c for d, c in zip(drafts, admitted, strict=True) for p in range(d + 1)]
    assert inv.tolist() == want
    # the correction row (p == admitted) stays valid: the target samples there
    assert sum(inv.tolist()) == sum(d - c for d, c in zip(drafts, admitted, strict=True))


def test_curve_from_startup_samples_uses_medians_and_graph_only_draft_times() -> None:
    S = types.SimpleNamespace
    samples = [S(num_target_tokens=8, forward_ms=f, drafter_ms=1.0, num_reqs=8, full_cudagraph=True) for f in (2, 3, 9)]
    samples += [S(num_target_tokens=16, forward_ms=4.0, drafter_ms=1.5, num_reqs=16, full_cudagraph=True)]
    samples += [S(num_target_tokens=64, forward_ms=7.0, drafter_ms=50.0, num_reqs=64, full_cudagraph=False)]
    curve = curve_from_samples(samples, [8, 16], 0.25, {"engine": "vllm"})
    assert curve.verify_ms == ((8, 3.0), (16, 4.0), (64, 7.0))
    assert curve.draft_ms == ((8, 1.0), (16, 1.5))
    assert curve.capture_sizes == (8, 16) and curve.overhead_ms == 0.25
    assert with_overhead(curve, 1.0).overhead_ms == 1.0 and with_overhead(curve, None) is curve
    # no FULL-graph sample at all (mask mode on the H200): the eager drafter timings, not a free draft pass
    eager = [S(num_target_tokens=n, forward_ms=0.1 * n, drafter_ms=d, num_reqs=min(n, 32), full_cudagraph=False)
             for n, d in ((8, 2.0), (16, 2.5), (64, 4.0), (64, 0.0))]
    assert curve_from_samples(eager, [8, 16], 0.0, {}).draft_ms == ((8, 2.0), (16, 2.5), (32, 4.0))


def test_startup_profile_noise_is_fitted_and_a_flat_profile_means_verify_everything() -> None:
    S = types.SimpleNamespace

    def sample(tokens: int, ms: float) -> types.SimpleNamespace:
        return S(num_target_tokens=tokens, forward_ms=ms, drafter_ms=1.0, num_reqs=min(tokens, 64),
                 full_cudagraph=tokens <= 512)

    # one slow size (seen on an H200) no longer refuses start-up, nor prices every larger batch
    noisy = [sample(8, 2.0), sample(288, 24.9), sample(496, 18.5), sample(1024, 30.0)]
    curve = curve_from_samples(noisy, [8, 288, 496], 0.0, {})
    assert curve.verify_ms == ((8, 2.0), (288, 21.7), (496, 21.7), (1024, 30.0))
    # verification that costs the same at every size: no curve (the manager then verifies every draft)
    flat = [sample(8, 10.0), sample(288, 10.05), sample(496, 10.0), sample(8064, 10.06)]
    assert curve_from_samples(flat, [8, 288, 496], 0.0, {}) is None


def test_user_curves_inline_file_and_auto(tmp_path: Path) -> None:
    assert load_curve(DsparkVllmSettings()) is None  # start-up profile
    inline = load_curve(DsparkVllmSettings(sps_curve=[[8, 200.0], [16, 150.0]]))
    assert inline.verify_cost_ms(8) == pytest.approx(5.0)
    path = tmp_path / "c.json"
    inline.save(path)
    assert load_curve(DsparkVllmSettings(sps_curve=str(path))).verify_ms == inline.verify_ms
    assert json.loads(path.read_text())["dspark_sps_curve"][0][0] == 8


def test_initial_temperatures(tmp_path: Path) -> None:
    assert initial_temperatures(DsparkVllmSettings(), 3) == [1.0, 1.0, 1.0]
    assert initial_temperatures(DsparkVllmSettings(confidence_temperature=2.0), 2) == [2.0, 2.0]
    (tmp_path / "sts.json").write_text(json.dumps({"version": 1, "sts_temperatures": [1.5, 2.0, 3.0, 4.0]}))
    assert initial_temperatures(DsparkVllmSettings(sts=str(tmp_path / "sts.json")), 3) == [1.5, 2.0, 3.0]


def test_traces_path_per_data_parallel_rank() -> None:
    assert traces_path("/x/t.jsonl", 0, 1) == Path("/x/t.jsonl")
    assert traces_path("/x/t.jsonl", 1, 2) == Path("/x/t.dp1.jsonl")


def test_speculator_hooks_are_installed_once_and_serve_the_latest_manager() -> None:
    from dspark_cli.engines.vllm.manager import SPECULATOR_MANAGER_ATTR, install_speculator_hooks

    calls: list[str] = []

    class Spec:
        def __init__(self) -> None:
            self.model = types.SimpleNamespace(compute_confidence=lambda x: x)

        def observe_verification(self, idx_mapping, num_sampled, num_rejected) -> None:
            calls.append(f"estimator saw {num_rejected}")

        draft_tokens = torch.full((4, 3), 5)

        def _multi_step_decode(self, *args) -> None:
            calls.append("decode")

        def sample_draft(self, hidden_states, positions=None):
            calls.append("sample")
            return torch.full((hidden_states.shape[0],), 9)

        def propose(self, *args, num_speculative_tokens=None, dummy_run=False):
            calls.append("prefill")
            self.draft_tokens[:2, 0] = self.sample_draft(torch.zeros(2, 8), None)
            self._multi_step_decode()
            return "drafts"

    class Manager:
        def __init__(self, name: str, scale: float) -> None:
            self.name, self.scale = name, scale
            self._skip_decode = False
            self._pause_supported = True
            self._upkeep = None  # the draft kept current while paused (tests/test_vllm_upkeep.py: deferred)

        def calibrate_in_graph(self, conf):
            return conf * self.scale

        def verified_rejections(self, num_sampled, num_rejected):
            return num_rejected - 1

        def observe(self, num_sampled) -> None:
            calls.append(f"{self.name} observed")

    spec = Spec()
    for m in (Manager("profiling", 2.0), Manager("serving", 3.0)):
        hooked = getattr(spec, SPECULATOR_MANAGER_ATTR, None) is not None
        setattr(spec, SPECULATOR_MANAGER_ATTR, m)
        if not hooked:  # what DsparkVerificationManager.attach does
            install_speculator_hooks(spec, calibrate=True, skip_decode=True)
    # one wrapping, serving the latest manager: temperatures are applied once, by the serving manager
    assert spec.model.compute_confidence(1.0) == 3.0
    spec.observe_verification(None, 2, 5)
    assert calls == ["estimator saw 4", "serving observed"]
    calls.clear()
    assert spec.propose(num_speculative_tokens=0) == "drafts"  # paused: the prefill pass, without its sample
    assert calls == ["prefill"]
    assert spec.draft_tokens[:, 0].tolist() == [5, 5, 5, 5]  # what the skipped sample would have overwritten
    calls.clear()
    spec.propose(num_speculative_tokens=7)
    spec.propose(num_speculative_tokens=0, dummy_run=True)  # profiling runs always draft fully
    assert calls == ["prefill", "sample", "decode", "prefill", "sample", "decode"]
    assert spec.draft_tokens[:2, 0].tolist() == [9, 9]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trace_stager_writes_every_step_including_the_last(tmp_path: Path) -> None:
    """Traces leave the device through pinned buffers a step late; closing writes the newest step too."""
    from dspark_cli.core.traces import read_traces
    from dspark_cli.engines.vllm.manager import _TraceStager

    path = tmp_path / "t.jsonl"
    stager = _TraceStager(path, max_reqs=4, k=3, device=torch.device("cuda"))
    for step in range(3):
        conf = torch.full((4, 3), 0.1 * (step + 1), device="cuda")
        verified = torch.tensor([3, 2, 1, 0], dtype=torch.int32, device="cuda")
        accepted = torch.tensor([step % 4, 1, 0, 0], dtype=torch.int32, device="cuda").clamp(max=verified)
        valid = torch.tensor([True, True, True, False], device="cuda")
        stager.stage(conf, verified, accepted, valid, ["a", "b", "c", "d"], np.full(4, step))
    stager.close()
    rows = read_traces(path).records
    assert len(rows) == 9  # 3 steps x 3 valid requests; request d was never verified
    assert [r.step for r in rows if r.request == "a"] == [0, 1, 2]
    assert rows[-1].conf == pytest.approx([0.3, 0.3, 0.3])
