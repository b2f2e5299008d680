"""The decode step's host path: the graphed greedy draft loop, the draft kept in sync while drafting is
paused, the packed host transfers and the per-phase timing breakdown (all on CPU, graphs emulated)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from test_embedded_engine import TinyPair, make_engine, prompts

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.embedded.sequence import SamplingParams, Sequence

SATURATION_LOG = Path(__file__).resolve().parents[1] / "benchmarks" / "saturation_log.py"

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)



@pytest.fixture(scope="module")
def reference(pair: TinyPair) -> list[list[int]]:
    return make_engine(pair, num_speculative_tokens=0).generate(prompts(5), GREEDY)


@pytest.fixture(scope="module")
def never_pays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A curve whose draft pass costs far more than any verify gain: every drafting step fails to pay."""
    path = tmp_path_factory.mktemp("curve") / "expensive_draft.json"
    SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 500.0), (8, 500.0)], 0.1).save(path)
    return path


def _running_seqs(engine) -> list[Sequence]:  # type: ignore[no-untyped-def]
    return list(engine.scheduler.running)


@pytest.mark.parametrize("emulate", [False, True])
def test_paused_steps_leave_the_draft_alone_and_probes_catch_it_up(
    pair: TinyPair, reference: list[list[int]], never_pays: Path, emulate: bool
) -> None:
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(never_pays),
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=3))
    if emulate:
        engine.runner.emulate_graphs()
    ids = [f"r{i}" for i in range(5)]
    for rid, prompt in zip(ids, prompts(5), strict=True):
        engine.add_request(rid, prompt, GREEDY)
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    lags_after_paused: list[int] = []
    lags_after_drafting: list[int] = []
    while engine.has_unfinished_requests():
        paused_before, drafts_before = engine.stats.num_paused_steps, engine.stats.num_drafts
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        lags = [s.num_tokens - s.num_draft_computed for s in _running_seqs(engine)]
        if engine.stats.num_paused_steps > paused_before:
            lags_after_paused += lags
        elif engine.stats.num_drafts > drafts_before:
            lags_after_drafting += lags
    assert engine.stats.num_paused_steps > 0 and lags_after_paused
    # Paused steps do not run the draft: it falls behind by one token per paused step ...
    assert max(lags_after_paused) > 2
    # ... and a drafting step (a probe) catches it up in its catch-up pass: only the bonus token, and the
    # last draft when every draft was accepted, are unseen after it.
    assert lags_after_drafting and max(lags_after_drafting) <= 2
    # Greedy output is unchanged: the draft's KV after the catch-up was valid for the probes' drafts.
    assert [results[rid] for rid in ids] == reference
    assert engine.stats.num_drafts > 0


CPU_AND_CUDA = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_paused_steps_replay_graphs_of_one_query_row_and_drafting_steps_the_verify_graphs(
    pair: TinyPair, reference: list[list[int]], never_pays: Path, device: str
) -> None:
    """A drafting server's paused steps feed one token a request: they replay the target's family captured for
    one query row, as a server without a draft does, not the verify family's K + 1 rows a request (K of them
    empty: a slower attention launch). Drafting steps still replay the verify family. Greedy outputs are plain
    decoding's."""
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(never_pays), device=device,
                         dtype="float32", capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=3))
    runner = engine.runner
    if device == "cpu":
        runner.emulate_graphs()  # CUDA captures real graphs
    plain, verify = runner._plain_graphs, runner._verify_graphs
    assert plain is not None and verify is not None and plain.qlen == 1 and verify.qlen == runner.num_spec + 1
    picks: list[tuple[str, bool]] = []
    for name, family in (("plain", plain), ("verify", verify)):
        def pick(n: int, q: int, real=family.pick, name=name) -> int | None:  # type: ignore[no-untyped-def]
            size = real(n, q)
            picks.append((name, size is not None))
            return size
        family.pick = pick  # type: ignore[method-assign]
    ids = [f"r{i}" for i in range(5)]
    for rid, prompt in zip(ids, prompts(5), strict=True):
        engine.add_request(rid, prompt, GREEDY)
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    by_kind: dict[str, set[tuple[tuple[str, bool], ...]]] = {}
    while engine.has_unfinished_requests():
        picks.clear()
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        by_kind.setdefault(engine.stalls.step_kind, set()).add(tuple(picks))
    assert by_kind["paused"] == {(("plain", True),)}
    drafting = by_kind.get("spec", set()) | by_kind.get("probe", set())
    assert drafting == {(("plain", False), ("verify", True))}
    assert [results[rid] for rid in ids] == reference


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("sampling", [False, True])
def test_graphed_draft_loop_matches_the_eager_loop(pair: TinyPair, sampling: bool, device: str) -> None:
    engine = make_engine(pair, draft=str(pair.draft_head), max_num_seqs=8, device=device, dtype="float32")
    runner = engine.runner
    if device == "cpu":
        runner.emulate_graphs()  # CUDA captures real graphs
    drafter = runner.drafter
    assert drafter is not None and drafter.loop_fn is not None and drafter.sampling_loop_fn is not None
    for rid, prompt in zip("abc", prompts(3), strict=True):
        engine.add_request(rid, prompt, GREEDY)
    engine.step()  # prefill
    seqs = _running_seqs(engine)
    tables = runner.block_tables(seqs)
    temperature = uniforms = None
    if sampling:  # one greedy row beside two sampling ones, as a mixed batch is
        temperature = torch.tensor([1.0, 0.0, 0.7], device=device)
        uniforms = torch.rand(3, runner.num_spec, generator=torch.Generator().manual_seed(3)).to(device)
    # 3 requests replay the size-4 bucket: one padding request rides along in the static buffers.
    looped = runner.propose(seqs, tables, temperature, uniforms)
    looped = type(looped)(looped.tokens.clone(), looped.confidence.clone(),
                          None if looped.draft_probs is None else looped.draft_probs.clone())
    saved = drafter.loop_fn, drafter.sampling_loop_fn
    drafter.loop_fn = drafter.sampling_loop_fn = None
    try:
        for seq in seqs:  # the catch-up feeds the same tokens again
            seq.num_draft_computed = seq.num_tokens - 1
        eager = runner.propose(seqs, tables, temperature, uniforms)
    finally:
        drafter.loop_fn, drafter.sampling_loop_fn = saved
    assert torch.equal(looped.tokens, eager.tokens)
    torch.testing.assert_close(looped.confidence, eager.confidence)
    if sampling:
        assert looped.draft_probs is not None and eager.draft_probs is not None
        assert looped.draft_probs.shape == (3, runner.num_spec, runner.vocab_size)
        torch.testing.assert_close(looped.draft_probs, eager.draft_probs)
        # the greedy row's drafts are its argmax path, the sampling rows drew from their distributions
        assert bool((looped.draft_probs[0].gather(1, looped.tokens[0].unsqueeze(1)) > 0).all())
    else:
        assert looped.draft_probs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_outputs_survive_replays_of_every_other_graph(pair: TinyPair) -> None:
    """The graph families share one pool and replay out of capture order (catch-up, draft loop, verify), so
    a family's output must not live in memory another family uses: replaying all the others leaves it."""
    engine = make_engine(pair, draft=str(pair.draft_head), max_num_seqs=8, device="cuda", dtype="float32")
    runner = engine.runner
    assert runner.drafter is not None and runner.drafter.loop_fn is not None
    for rid, prompt in zip("abc", prompts(3), strict=True):
        engine.add_request(rid, prompt, GREEDY)
    engine.step()  # prefill
    seqs = _running_seqs(engine)
    runner.propose(seqs, runner.block_tables(seqs), None, None)  # fills the static buffers with a real batch
    loop = runner._loop_graphs
    forwards = {"verify": runner._verify_graphs, "plain": runner._plain_graphs, "catch-up": runner._catchup_graphs,
                "step": runner._step_graphs}
    families: dict[str, tuple[list[torch.cuda.CUDAGraph], list[torch.Tensor]]] = {
        name: (list(fam._captured.values()), [fam.out]) for name, fam in forwards.items()
    }
    families["draft loop"] = ([g for g in loop.graphs.values() if g is not None], [loop.tokens_out, loop.conf_out])
    sloop = runner._sampling_loop_graphs
    families["sampling draft loop"] = ([g for g in sloop.graphs.values() if g is not None],
                                       [sloop.tokens_out, sloop.conf_out, sloop.probs_out])
    assert all(graphs for graphs, _ in families.values())
    for name, (graphs, outputs) in families.items():
        graphs[0].replay()
        snapshot = [t.clone() for t in outputs]
        for other, (other_graphs, _) in families.items():
            if other != name:
                for graph in other_graphs:
                    graph.replay()
        torch.cuda.synchronize()
        for out, snap in zip(outputs, snapshot, strict=True):
            assert torch.equal(out, snap), f"{name} output overwritten by another family's replay"


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_long_catch_up_gaps_are_fed_in_graph_rounds_and_draft_like_one_pass(pair: TinyPair, device: str) -> None:
    """After paused steps a request can be many tokens ahead of its draft: the gap is fed as one replay of the
    draft's ragged family, or -- without it -- in rounds the catch-up graphs hold (never an eager pass of a
    shape no graph has), and the drafts come out as from the single eager pass."""
    k = 3
    results = []
    for way in ("ragged", "rounds", "eager"):
        rounds = way != "eager"
        engine = make_engine(pair, draft=str(pair.draft_head), num_speculative_tokens=k, max_model_len=128,
                             device=device, dtype="float32")
        runner = engine.runner
        if device == "cpu":
            runner.emulate_graphs()  # CUDA captures real graphs
        ragged = runner._draft_ragged_graphs
        assert ragged is not None and runner._catchup_graphs is not None
        if way != "ragged":  # as with the torch backend: no ragged family behind the catch-up graphs
            runner._draft_ragged_graphs = None
        for rid, prompt in zip("ab", prompts(2), strict=True):
            engine.add_request(rid, prompt, GREEDY)
        engine.step()  # prefill: the draft has fed every prompt token
        seqs = _running_seqs(engine)
        g = torch.Generator().manual_seed(5)
        for seq, gap in zip(seqs, (23, 6), strict=True):  # tokens emitted while drafting was paused
            seq.token_ids.extend(torch.randint(3, 100, (gap,), generator=g).tolist())
            assert engine.block_manager.ensure(seq, seq.num_tokens + k + 1)
        tables = runner.block_tables(seqs)
        eager_rows: list[int] = []
        inner = runner.draft_fwd.run

        def spy(ids, positions, req, pad, qstart, bt, max_query_len, max_kv_len,  # type: ignore[no-untyped-def]
                captured=False, seen=eager_rows, inner=inner):
            if max_query_len > k + 1 and not captured:  # an eager pass (emulated graph bodies are captured)
                seen.append(max_query_len)
            return inner(ids, positions, req, pad, qstart, bt, max_query_len, max_kv_len, captured)

        runner.draft_fwd.run = spy  # type: ignore[method-assign]
        if way != "ragged":
            runner._catchup_graphs.fallback = spy
        graphs = runner._catchup_graphs
        if way == "eager":
            runner._catchup_graphs = None  # the single catch-up pass (eager for this shape)
        fed: list[int] = []
        if way == "ragged":  # count the ragged family's runs (a CUDA replay runs no Python of the model)
            run = ragged.run
            runner._catchup_graphs.fallback = lambda *a, run=run, fed=fed: (fed.append(a[0].shape[0]), run(*a))[1]
        out = runner.propose(seqs, tables, None, None)
        runner._catchup_graphs = graphs
        results.append((out.tokens.clone(), out.confidence.clone()))
        assert bool(eager_rows) is not rounds  # neither the ragged replay nor the rounds fall back to eager
        assert bool(fed) is (way == "ragged")
        if way == "rounds":  # the rounds left the last K + 1 tokens of each request to the proposal's own catch-up
            assert [s.num_tokens - s.num_draft_computed for s in seqs] == [k + 1, k + 1]
    (tok_g, conf_g), (tok_r, conf_r), (tok_1, conf_1) = results
    assert torch.equal(tok_r, tok_1) and torch.equal(tok_g, tok_1)
    torch.testing.assert_close(conf_r, conf_1)
    torch.testing.assert_close(conf_g, conf_1)


def test_sampling_batches_bypass_the_greedy_loop_and_stay_seeded(pair: TinyPair) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=7)
    outs = []
    for emulate in (False, True):
        engine = make_engine(pair)
        if emulate:
            engine.runner.emulate_graphs()
        outs.append(engine.generate(prompts(2), params))
    assert outs[0] == outs[1]


def test_sampling_batches_plan_with_the_sampling_draft_cost(pair: TinyPair, tmp_path: Path) -> None:
    """The engine tells the capacity manager whether the batch samples, so a T > 0 batch is priced with the
    curve's sampling draft pass (another program than the greedy loop) and a greedy batch is not."""
    curve = tmp_path / "sampling_curve.json"
    SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 0.01), (8, 0.01)], 0.1,
                         draft_sampling_ms=[(1, 500.0), (8, 500.0)]).save(curve)
    for temperature, priced_as_sampling in ((0.0, False), (1.0, True)):
        engine = make_engine(pair, sps_curve=str(curve), capacity=CapacityConfig(mode="varlen"))
        engine.add_request("r", prompts(1)[0], SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True,
                                                              seed=3))
        while engine.capacity.last_decision is None:
            engine.step()
        assert (engine.capacity.last_decision.step_ms > 500.0) is priced_as_sampling


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("mode", ["host", "device", "gpu"])
def test_phase_timing_breaks_steps_down(pair: TinyPair, never_pays: Path, mode: str, device: str) -> None:
    """On a CPU "gpu" timing is host timing; on CUDA it reads event spans of the device timeline."""
    engine = make_engine(pair, sps_curve=str(never_pays), device=device, dtype="float32",
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=2))
    engine.phase_timing = mode
    engine.generate(prompts(3), GREEDY)
    s = engine.stats
    assert s.phase_steps["prefill"] == s.num_prefill_steps
    probes = s.phase_steps.get("probe", 0)
    assert probes > 0  # resume_every=2: the pauses are probed
    assert s.phase_steps["spec"] + probes + s.phase_steps["paused"] == s.num_decode_steps
    assert s.phase_steps["paused"] == s.num_paused_steps > 0
    for phase in ("prepare", "draft", "plan", "layout", "verify", "reject", "sync", "emit"):
        assert s.phase_ms[f"spec.{phase}"] >= 0.0
    assert s.phase_ms["spec.verify"] > 0.0 and s.phase_ms["paused.verify"] > 0.0
    # a paused step is a plain decoding step: no draft pass, no planning
    assert "paused.draft" not in s.phase_ms and "paused.plan" not in s.phase_ms


def test_phase_timing_is_off_by_default_and_checked(pair: TinyPair) -> None:
    engine = make_engine(pair)
    engine.generate(prompts(1), SamplingParams(temperature=0.0, max_tokens=4))
    assert engine.stats.phase_ms == {} and engine.stats.phase_steps == {}
    engine.phase_timing = "events"
    engine.add_request("x", prompts(1)[0], GREEDY)
    from dspark_cli.errors import DsparkError

    with pytest.raises(DsparkError, match="phase_timing"):
        engine.step()


@pytest.mark.parametrize("num_reqs", [1, 2, 3, 5])
def test_decode_inputs_are_correct_and_16_byte_aligned_at_any_batch_size(pair: TinyPair, num_reqs: int) -> None:
    """One packed copy, then views: each starts on a 16-byte boundary (Triton compiles a kernel variant per
    pointer alignment, so an odd batch size would compile the layout kernel again while serving)."""
    engine = make_engine(pair, draft=str(pair.draft_head))
    for i, prompt in enumerate(prompts(num_reqs)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()  # prefill
    seqs = _running_seqs(engine)
    extra = torch.arange(100, 100 + num_reqs).numpy()
    tables, (start_pos, last_tokens, col) = engine.runner.decode_inputs(seqs, [extra])
    assert tables.tolist() == engine.runner.block_tables(seqs).tolist()
    assert start_pos.tolist() == [s.num_tokens - 1 for s in seqs]
    assert last_tokens.tolist() == [s.token_ids[-1] for s in seqs]
    assert col.tolist() == extra.tolist()
    for view in (tables, start_pos, last_tokens, col):
        assert view.storage_offset() * view.element_size() % 16 == 0


def test_graph_capture_runs_with_garbage_freed_first_and_the_collector_off() -> None:
    """A garbage cycle holding CUDA graphs must not be collected in the middle of a capture (its destructors
    would call CUDA while a stream captures): it is freed before, and the collector stays off during."""
    import gc
    import weakref

    from dspark_cli.engines.embedded.model_runner import no_collection_during_capture

    class Holder:
        pass

    a, b = Holder(), Holder()
    a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
    dead = weakref.ref(a)
    del a, b
    assert gc.isenabled()
    with no_collection_during_capture():
        assert dead() is None
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection_during_capture():
        raise RuntimeError("capture failed")
    assert gc.isenabled()


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_mixed_prefills_decode_the_running_requests_in_the_prefill_forward(
    pair: TinyPair, never_pays: Path, device: str
) -> None:
    """A mixed step runs the prefill forward over newcomers and one-token decode rows (on CUDA: the ragged
    prefill graphs, with decode rows reading their cached KV); with no speculation, with drafting paused and
    with drafting on, greedy outputs are those of prefill steps of their own (float32)."""
    from test_embedded_engine import _staggered

    ps = prompts(5)
    params = [GREEDY] * 5

    def run(**overrides: object) -> tuple[dict[str, list[int]], dict[str, int]]:
        engine = make_engine(pair, max_num_seqs=8, device=device, dtype="float32", **overrides)
        outs = _staggered(engine, ps, params)
        return outs, engine.stats.steps

    want, alone = run(num_speculative_tokens=0, mixed_prefill=False)  # prefills alone
    got, mixed = run(num_speculative_tokens=0, mixed_prefill=True)
    assert alone["mixed"] == 0 and mixed["mixed"] == 4
    assert got == want
    # Drafting paused (a draft pass that never pays): newcomers that arrive once it has paused ride along in
    # paused steps too.
    engine = make_engine(pair, max_num_seqs=8, device=device, dtype="float32", draft=str(pair.draft_head),
                         sps_curve=str(never_pays), mixed_prefill=True,
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=50))
    outs: dict[str, list[int]] = {}

    def step() -> None:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)

    engine.add_request("r0", ps[0], GREEDY)
    while engine.capacity.drafting_enabled:
        step()
    for i in range(1, 5):
        engine.add_request(f"r{i}", ps[i], GREEDY)
        step()
    while engine.has_unfinished_requests():
        step()
    assert engine.stats.steps["mixed"] == 4 and engine.stats.steps["paused"] > 0
    reference = make_engine(pair, num_speculative_tokens=0, device=device, dtype="float32").generate(ps, GREEDY)
    assert outs == {f"r{i}": toks for i, toks in enumerate(reference)}
    # Drafting on (verify-all): newcomers ride along all the same, and the drafting step after each mixed one
    # feeds the draft the newcomer's prompt (on CUDA: the catch-up graphs, or their rounds).
    drafting = make_engine(pair, max_num_seqs=8, device=device, dtype="float32", draft=str(pair.draft_head),
                           mixed_prefill=True)
    got = _staggered(drafting, ps, params)
    assert drafting.stats.steps["mixed"] == 4 and drafting.stats.steps["spec"] > 0
    assert got == {f"r{i}": toks for i, toks in enumerate(reference)}


def test_saturation_state_changes_are_logged_once_each_with_their_evidence(
    pair: TinyPair, never_pays: Path, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A served matrix's server log must say when drafting paused and resumed and why each probe was judged
    as it was: one line per change, none on the steps in between."""
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(never_pays),
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=3))
    for i, prompt in enumerate(prompts(4)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    with caplog.at_level("INFO", logger="dspark.embedded"):
        while engine.has_unfinished_requests():
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saturation:")]
    c = engine.capacity.saturation.counters
    judged = sum(n for (_, verdict), n in c.probes.items() if verdict != "unjudged")
    assert c.pauses >= 1 and judged >= 1  # the curve never pays: a pause, then failing timer probes
    assert sum("drafting paused at" in line for line in lines) == c.pauses
    assert sum("drafting resumed" in line for line in lines) == c.resumes
    probe_lines = [line for line in lines if " probe at " in line]
    assert len(probe_lines) == judged and all("failed: realized" in line for line in probe_lines)
    assert "drafting paused at 4 requests" in lines[0] and "realized gain" in lines[0]
    # benchmarks/saturation_log.py reads these lines from served logs: it must parse every one of them
    spec = importlib.util.spec_from_file_location("saturation_log", SATURATION_LOG)
    reader = importlib.util.module_from_spec(spec)
    sys.modules["saturation_log"] = reader  # its dataclass looks its module up there
    spec.loader.exec_module(reader)
    log_file = tmp_path / "varlen.log"
    log_file.write_text("".join(f"INFO dspark.embedded: {line}\n" for line in lines))
    parsed = reader.parse(log_file)
    assert len(parsed) == judged and all(p.verdict == "failed" and p.cost_scale > 0 for p in parsed)
    assert sum(bool(reader.STATE.search(line)) for line in lines) == c.pauses + c.resumes


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_a_decode_steps_time_is_reported_by_the_next_step_with_its_charge_and_price(
    pair: TinyPair, never_pays: Path, reference: list[list[int]], device: str
) -> None:
    """The capacity manager's bookkeeping of a decode step -- paused, probing or drafting -- runs in the next step,
    after its forward is launched and before it waits for the device (on CUDA the device works meanwhile): each
    step's time arrives one step late, with the probe-tax charge it began with and, for a drafting step, the price
    its own plan put on it, and none is lost while steps follow."""
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(never_pays), dtype="float32", device=device,
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=3))
    capacity = engine.capacity
    assert capacity is not None
    reports: list[tuple[bool, float | None, object]] = []
    real = capacity.record_step_time

    def spy(drafting, num_reqs, measured_ms, priced_ms=None, calibrate=True, charge=None):  # type: ignore[no-untyped-def]
        reports.append((drafting, priced_ms, charge))
        return real(drafting, num_reqs, measured_ms, priced_ms, calibrate, charge)

    capacity.record_step_time = spy  # type: ignore[method-assign]
    ids = [f"r{i}" for i in range(5)]
    for rid, prompt in zip(ids, prompts(5), strict=True):
        engine.add_request(rid, prompt, GREEDY)
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    kinds_of = {"paused": {"paused"}, "probe": {"probe"}, "spec": {"drafting", "probation"}}
    seen = {kind: 0 for kind in kinds_of}
    while engine.has_unfinished_requests():
        pending_before = engine._pending_step_time
        decode_before = engine.stats.num_decode_steps
        reported_before = len(reports)
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        if pending_before is not None:
            # the previous decode step's time went out during this step, as it was left
            assert (pending_before.drafting, pending_before.priced_ms, pending_before.charge) in reports[reported_before:]
        if engine.stats.num_decode_steps > decode_before:
            kind = engine.stalls.step_kind
            seen[kind] += 1
            pending = engine._pending_step_time
            # reported by a later step, not by itself: what is pending now is this step's own time
            assert pending is not None and pending.charge.kind in kinds_of[kind]
            assert pending.drafting is (kind != "paused")
            if pending.drafting:
                assert pending.priced_ms == capacity.last_decision.step_ms
            else:
                assert pending.priced_ms is None
            assert len(reports) == reported_before + (pending_before is not None)
    assert all(seen.values()), seen  # every kind of decode step was exercised
    assert len(reports) == sum(seen.values()) - 1  # the last is still pending at the end
    assert [results[rid] for rid in ids] == reference
