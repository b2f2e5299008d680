"""`dspark bench --simulate`: closed-form answers, the oracle bound, the schedule, and the CLI end to end."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_cli.bench import simulate as sim
from dspark_cli.core.sps import SpsCurve
from dspark_cli.errors import DsparkError

ALPHA, BETA, DRAFT = 4.0, 0.05, 1.5  # linear verify cost ALPHA + BETA * tokens ms, constant draft pass


def linear_curve() -> SpsCurve:
    return SpsCurve.from_points([(1, ALPHA + BETA), (4096, ALPHA + BETA * 4096)], [(1, DRAFT), (4096, DRAFT)])


def trace_data(conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray, steps_per_request: int) -> sim.TraceData:
    n = len(conf)
    requests = [np.arange(i, min(i + steps_per_request, n)) for i in range(0, n, steps_per_request)]
    return sim.TraceData(np.asarray(conf, dtype=np.float64), np.asarray(verified), np.asarray(accepted), requests)


def write_trace_file(path: Path, seed: int, num_requests: int, k: int) -> Path:
    rng = np.random.default_rng(seed)
    with path.open("wb") as fh:
        for req in range(num_requests):
            q = rng.uniform(0.4, 0.95)
            for step in range(int(rng.integers(3, 12))):
                conf = np.clip(q + rng.normal(0, 0.1, size=k), 0.01, 0.99)
                run = int(np.argmin(np.r_[rng.random(k) < conf, False]))
                fh.write(orjson.dumps({"request": f"r{req}", "step": step, "conf": conf.round(4).tolist(),
                                       "verified": k, "accepted": run}, option=orjson.OPT_APPEND_NEWLINE))
    return path


# ---------------------------------------------------------------------------------------------- closed form


def test_exact_confidences_on_a_linear_curve_match_hand_computed_tok_s() -> None:
    k, r, steps = 4, 8, 40
    n = 64
    data = trace_data(np.ones((n, k)), np.full(n, k), np.full(n, k), steps_per_request=8)
    cell = sim.simulate_concurrency(data, linear_curve(), r, sim.SimOptions(num_steps=steps))
    res = cell.results
    no_spec = 1000.0 * r / (ALPHA + BETA * r)
    assert res["nospec"].tok_s == pytest.approx(no_spec)
    for j in range(1, k + 1):
        fixed = 1000.0 * r * (j + 1) / (DRAFT + ALPHA + BETA * r * (j + 1))
        assert res[f"fixed-{j}"].tok_s == pytest.approx(fixed)
        assert res[f"fixed-{j}"].mean_verify == pytest.approx(j)
        assert res[f"fixed-{j}"].acceptance_length == pytest.approx(j + 1)
    # Every draft is accepted and tokens are cheap: the best any policy can do is verify everything.
    full = res[f"fixed-{k}"].tok_s
    assert cell.oracle_tok_s == pytest.approx(max(full, no_spec))
    assert cell.oracle_tok_s == pytest.approx(full)
    # Survival is 1 everywhere, so every confidence-driven policy verifies every draft too.
    for name in ("threshold-0.5", "paper", "argmax"):
        assert res[name].tok_s == pytest.approx(full), name
        assert res[name].mean_verify == pytest.approx(k), name
    # The manager times its steps, as the engines do: right after its first drafting step at a load it runs one
    # plain step, to measure what drafting there is judged against.
    drafting_ms, plain_ms = DRAFT + ALPHA + BETA * r * (k + 1), ALPHA + BETA * r
    one_plain = 1000.0 * ((steps - 1) * r * (k + 1) + r) / ((steps - 1) * drafting_ms + plain_ms)
    for name in ("manager", "manager+sts"):
        assert res[name].tok_s == pytest.approx(one_plain), name
        assert res[name].drafting_steps == steps - 1, name
        assert res[name].mean_verify == pytest.approx(k * (steps - 1) / steps), name


def test_oracle_skips_drafting_when_the_draft_pass_is_too_expensive() -> None:
    k, r = 2, 4
    data = trace_data(np.full((16, k), 0.9), np.full(16, k), np.zeros(16, dtype=np.int64), steps_per_request=4)
    curve = SpsCurve.from_points([(1, 1.0), (64, 2.0)], [(1, 50.0), (64, 50.0)])
    cell = sim.simulate_concurrency(data, curve, r, sim.SimOptions(num_steps=10))
    # Nothing is ever accepted: the oracle is plain decoding, and every speculative policy loses to it.
    assert cell.oracle_tok_s == pytest.approx(cell.results["nospec"].tok_s)
    assert cell.results[sim.ORACLE].drafting_steps == 0
    for name, res in cell.results.items():
        assert res.tok_s <= cell.oracle_tok_s * (1 + 1e-12), name


def test_censoring_credits_at_most_the_recorded_accepted_count() -> None:
    # Recorded by a pruning engine: verified 2 of 4, both accepted (beyond 2 unknown) -> taken as 2.
    # A rejection (a < v) is exact whatever the policy verifies.
    conf = np.full((2, 4), 0.99)
    data = trace_data(conf, np.array([2, 3]), np.array([2, 1]), steps_per_request=1)
    cell = sim.simulate_concurrency(data, linear_curve(), 2, sim.SimOptions(families=("fixed",), num_steps=1))
    assert cell.results["fixed-4"].tokens == (2 + 1) + (1 + 1)
    assert cell.results["fixed-1"].tokens == (1 + 1) + (1 + 1)


def test_oracle_matches_brute_force_on_small_instances() -> None:
    rng = np.random.default_rng(3)
    curve = SpsCurve.from_points([(2, 3.0), (4, 3.2), (6, 6.0), (12, 6.5), (20, 14.0)], [(2, 0.7)],
                                 capture_sizes=[2, 4, 6, 12])
    for _ in range(5):
        accepted = rng.integers(0, 4, size=(3, 2))
        r = accepted.shape[1]
        options = []
        for a_sum in accepted.sum(axis=1):
            opts = [(r, float(curve.step_cost_ms(r, r, drafting=False)))]
            opts += [(r + n, float(curve.step_cost_ms(r, r + n))) for n in range(a_sum + 1)]
            options.append(opts)
        best = max(sum(t for t, _ in c) / sum(m for _, m in c) for c in itertools.product(*options))
        res, iters = sim.oracle(accepted, curve)
        assert 1000.0 * best == pytest.approx(res.tok_s) and iters >= 1


# ---------------------------------------------------------------------------------------------- property


@st.composite
def instances(draw: st.DrawFn) -> tuple[sim.TraceData, SpsCurve, int]:
    k = draw(st.integers(1, 4))
    n = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.0, 1.0, size=(n, k)) ** draw(st.sampled_from([0.3, 1.0, 3.0]))
    verified = rng.integers(0, k + 1, size=n)
    accepted = (rng.random(n) * (verified + 1)).astype(np.int64)
    xs = np.unique(np.r_[1, rng.integers(2, 200, size=draw(st.integers(1, 6)))])
    xs = np.r_[xs, xs[-1] + 50]
    costs = np.cumsum(rng.uniform(0.0, 3.0, size=len(xs))) + rng.uniform(0.1, 5.0)
    costs[-1] = max(costs[-1], costs[0] * 1.05 + 0.1)  # never flat (the curve loader refuses that)
    caps = [int(x) for x in xs[: draw(st.integers(0, len(xs)))]]
    draft = [(1, float(rng.uniform(0, 3))), (64, float(rng.uniform(3, 6)))] if draw(st.booleans()) else []
    curve = SpsCurve.from_points(list(zip(xs.tolist(), costs.tolist(), strict=True)), draft,
                                 overhead_ms=float(rng.uniform(0, 1)), capture_sizes=caps)
    data = trace_data(conf, verified, accepted, steps_per_request=draw(st.integers(1, 5)))
    return data, curve, draw(st.integers(1, 6))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.floats(0.0, 0.2), st.integers(0, 3))
def test_the_oracle_bounds_every_policy(inst: tuple[sim.TraceData, SpsCurve, int], gain: float,
                                       patience: int) -> None:
    data, curve, r = inst
    opts = sim.SimOptions(families=sim.FAMILIES[:-1], min_predicted_gain=gain, saturation_patience=patience,
                          resume_every=2, num_steps=12)
    cell = sim.simulate_concurrency(data, curve, r, opts)
    assert cell.oracle_tok_s > 0
    for name, res in cell.results.items():
        assert res.tok_s <= cell.oracle_tok_s * (1 + 1e-9), (name, res.tok_s, cell.oracle_tok_s)
        assert res.steps == 12 and res.request_steps == 12 * r


# ---------------------------------------------------------------------------------------------- schedule


def test_schedule_keeps_requests_consecutive_and_refills_slots() -> None:
    reqs = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5])]
    record, new = sim.build_schedule(reqs, num_slots=2, num_steps=4)
    assert record.tolist() == [[0, 3], [1, 4], [2, 5], [0, 3]]
    assert new.tolist() == [[True, True], [False, True], [False, False], [True, True]]
    # More slots than requests: the queue cycles so the batch stays full.
    record, new = sim.build_schedule(reqs, num_slots=4, num_steps=1)
    assert record.tolist() == [[0, 3, 4, 0]] and new.all()


def test_load_groups_by_request_in_step_order_and_clips_k(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"request": "a", "step": 1, "conf": [0.5, 0.6, 0.7], "verified": 3, "accepted": 3}\n'
        '{"request": "b", "step": 0, "conf": [0.5, 0.6, 0.7], "verified": 3, "accepted": 1}\n'
        '{"request": "a", "step": 0, "conf": [0.5, 0.6, 0.7], "verified": 2, "accepted": 0}\n'
        '{"conf": [0.5, 0.6, 0.7], "verified": 3, "accepted": 2}\n'
    )
    data = sim.load_trace_data([f], num_spec_tokens=2)
    assert [r.tolist() for r in data.requests] == [[2, 0], [1], [3]]
    assert data.conf.shape == (4, 2) and data.verified.tolist() == [2, 2, 2, 2]
    assert data.accepted.tolist() == [2, 1, 0, 2]
    with pytest.raises(DsparkError, match="-k must be in 1..3"):
        sim.load_trace_data([f], num_spec_tokens=4)


def test_option_parsing() -> None:
    assert sim.parse_families("paper, argmax,oracle", have_sts=False) == ("paper", "argmax")
    assert "manager+offline-sts" in sim.parse_families(None, have_sts=True)
    with pytest.raises(DsparkError, match="unknown policy"):
        sim.parse_families("magic", have_sts=False)
    with pytest.raises(DsparkError, match="needs --sts"):
        sim.parse_families("manager+offline-sts", have_sts=False)
    assert sim.parse_thresholds("0.5,0.2") == (0.2, 0.5)
    with pytest.raises(DsparkError, match="--threshold"):
        sim.parse_thresholds("1.5")
    assert sim.policy_names(("nospec", "fixed", "threshold"), 2, (0.5,)) == [
        "nospec", "fixed-1", "fixed-2", "threshold-0.5", "oracle"]


def test_offline_sts_policy_reads_sts_json(tmp_path: Path) -> None:
    traces = write_trace_file(tmp_path / "t.jsonl", 2, 10, 3)
    curve = tmp_path / "c.json"
    linear_curve().save(curve)
    sts = tmp_path / "sts.json"
    sts.write_text('{"version": 1, "temperatures": [2.0, 1.0, 0.5, 3.0]}')
    run = sim.run_simulation([traces], curve, [2], tmp_path / "out", policies="manager,manager+offline-sts",
                             sts=sts, num_steps=20, plots=False)
    assert set(run.cells[0].results) == {"manager", "manager+offline-sts", "oracle"}
    with pytest.raises(DsparkError, match="profiled curve"):
        sim.run_simulation([traces], "auto", [2], tmp_path / "out")


def test_sampling_draft_pricing_makes_drafting_cost_the_sampling_pass(tmp_path: Path) -> None:
    traces = write_trace_file(tmp_path / "t.jsonl", 2, 10, 3)
    base = linear_curve()
    greedy_only = tmp_path / "greedy.json"
    base.save(greedy_only)
    with pytest.raises(DsparkError, match="draft_sampling_curve_ms"):
        sim.run_simulation([traces], greedy_only, [2], tmp_path / "out", sampling=True)
    # A sampling draft pass so expensive that no drafting step can pay: the oracle stops drafting.
    pricey = tmp_path / "sampling.json"
    SpsCurve.from_points(base.verify_ms, base.draft_ms, base.overhead_ms, base.capture_sizes,
                         draft_sampling_ms=[(1, 1e4), (64, 1e4)]).save(pricey)
    kw = dict(policies="nospec,manager", num_steps=20, plots=False)
    greedy = sim.run_simulation([traces], pricey, [2], tmp_path / "g", **kw)
    sampled = sim.run_simulation([traces], pricey, [2], tmp_path / "s", sampling=True, **kw)
    assert greedy.cells[0].results["oracle"].mean_verify > 0
    oracle = sampled.cells[0].results["oracle"]
    assert oracle.mean_verify == 0 and oracle.tok_s == pytest.approx(sampled.cells[0].results["nospec"].tok_s)
    assert json.loads((tmp_path / "s" / "simulate.json").read_text())["draft_pricing"] == "sampling"


def test_a_mispriced_manager_recovers_through_measured_step_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager prices drafting at a fifth of what it costs (``manager_curve``); the steps take what the
    true curve says and the manager is told so, as the embedded engine tells it. Measured against plain
    steps, drafting stops paying and the manager ends near no speculation, where trusting its curve it
    would draft through and lose."""
    k, r = 4, 8
    rng = np.random.default_rng(0)
    conf = np.full((2000, k), 0.9)
    acc = rng.integers(0, 2, 2000)  # ~0.5 accepted drafts per step: drafting at its true price does not pay
    data = trace_data(conf, np.full(2000, k), acc, 50)
    true = SpsCurve.from_points([(1, 10.0), (64, 10.5), (512, 14.0)], [(1, 10.0), (64, 10.0)], 0.5)
    cheap = SpsCurve.from_points(true.verify_ms, [(1, 2.0), (64, 2.0)], 0.5)
    opts = sim.SimOptions(families=("nospec", "manager"), num_steps=1500, manager_curve=cheap)
    calibrated = sim.simulate_concurrency(data, true, r, opts).results
    from dspark_cli.core.saturation import StepTimeCalibration

    monkeypatch.setattr(StepTimeCalibration, "relative_draft_cost", lambda self, *args: 1.0)
    trusting = sim.simulate_concurrency(data, true, r, opts).results
    nospec = calibrated["nospec"].tok_s
    assert trusting["manager"].tok_s < 0.9 * nospec  # believing its curve, it keeps drafting at a loss
    assert calibrated["manager"].tok_s > 0.95 * nospec
    assert calibrated["manager"].drafting_steps < trusting["manager"].drafting_steps / 2


def test_mask_policies_pay_the_uniform_batch_and_never_trim_for_nothing() -> None:
    """A dense model computes a mask step's padding rows: every drafting step costs R + R*K tokens. Poor
    drafts (survival 0.05) make varlen trim; mask then keeps verifying everything or stops drafting."""
    k, r = 4, 8
    conf = np.full((400, k), 0.05)
    acc = np.zeros(400, dtype=np.int64)
    data = trace_data(conf, np.full(400, k), acc, 40)
    opts = sim.SimOptions(families=("fixed", "manager", "mask"), num_steps=200, saturation_patience=0)
    res = sim.simulate_concurrency(data, linear_curve(), r, opts).results
    full_step = ALPHA + BETA * (r + r * k) + DRAFT
    assert res["mask"].time_ms == pytest.approx(res["mask"].steps * full_step)
    assert res["mask"].mean_verify == pytest.approx(k)  # nothing saved by pruning: it does not prune
    assert res["manager"].mean_verify < 1.0 and res["manager"].time_ms < res["mask"].time_ms


def test_probe_scouts_replay_as_served_and_verify_nothing_where_drafting_loses() -> None:
    """``probe_scout`` (the served ``dspark_probe_scout``): at 64 requests a probe's plan verifies every draft at
    ~2.5x a step that verifies none, so each probe scouts; where drafting loses the judged step verifies nothing
    either: past its first step (planned before any confidence came back) the manager verifies no draft, where
    without scouts each probe verified all 256."""
    k, r = 4, 64
    conf = np.full((3000, k), 0.05)
    # Requests that outlast the run: a whole batch renewed between a scout and its judged step (50-step requests
    # renew all 64 slots at once) has no confidences to plan on, and that step verifies every draft by design.
    data = trace_data(conf, np.full(3000, k), np.zeros(3000, dtype=np.int64), 3000)
    res = {}
    for scout in (False, True):
        opts = sim.SimOptions(families=("nospec", "manager"), num_steps=600, resume_every=4, probe_scout=scout)
        assert opts.capacity_config().probe_scout is scout
        res[scout] = sim.simulate_concurrency(data, linear_curve(), r, opts).results
    off, on = res[False]["manager"], res[True]["manager"]
    assert on.verified == r * k and off.verified >= 5 * r * k
    # mask's uniform batch computes every draft row: its families replay without scouts, as a mask server runs
    opts = sim.SimOptions(families=("mask", "mask+sts"), num_steps=600, resume_every=4, probe_scout=True)
    masked = sim.simulate_concurrency(data, linear_curve(), r, opts).results
    assert masked["mask"].drafting_steps == res[False]["manager"].drafting_steps
    assert on.drafting_steps > off.drafting_steps  # a scout and its judged step per probe
    assert on.tok_s > off.tok_s


ROOT = Path(__file__).resolve().parents[1]
LLAMA_CURVE = ROOT / "benchmarks" / "results" / "h200" / "profile_sps" / "llama3-8b.json"


def test_online_sts_rescues_a_useless_head_far_below_one_half(tmp_path: Path) -> None:
    """The 8B-shaped vLLM setup: a weightless draft (confidence ~1/vocabulary) against synthetic acceptance.
    Before online STS could shift the logit, the manager verified ~0.6 drafts per request at 16 requests
    (-34% against verify-all) and lost to no speculation at 64; now it tracks the better of the two."""
    traces = tmp_path / "u.jsonl"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "synthetic_traces.py"), "-o", str(traces),
                    "--requests", "96"], check=True, capture_output=True)
    data = sim.load_trace_data([traces])
    curve = SpsCurve.load(LLAMA_CURVE)
    opts = sim.SimOptions(families=("nospec", "fixed", "manager+sts"), num_steps=768)
    cells = {c: sim.simulate_concurrency(data, curve, c, opts).results for c in (16, 64, 256)}
    for c, res in cells.items():
        best = max(res["nospec"].tok_s, res["fixed-7"].tok_s)
        assert res["manager+sts"].tok_s >= 0.96 * best, (c, res["manager+sts"].tok_s, best)
    assert cells[64]["manager+sts"].tok_s > 1.05 * max(cells[64]["nospec"].tok_s, cells[64]["fixed-7"].tok_s)


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_bench_simulate_end_to_end(tmp_path: Path) -> None:
    traces = write_trace_file(tmp_path / "traces.jsonl", 0, 30, 3)
    curve = tmp_path / "sps_curve.json"
    SpsCurve.from_points([(x, 2.0 + 0.04 * x) for x in (4, 8, 16, 32, 64, 128)], [(1, 0.5), (64, 1.5)],
                         overhead_ms=0.3, capture_sizes=[4, 8, 16, 32]).save(curve)
    out = tmp_path / "results"
    cmd = [sys.executable, "-c", "from dspark_cli.cli import main; main()", "bench", "--simulate",
           "--traces", str(traces), "--sps-curve", str(curve), "--concurrency", "2,8", "-k", "2",
           "--results-dir", str(out), "--steps", "70", "--threshold", "0.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr
    for needle in ("Oracle", "Fixed k=2", "Manager + online STS", "100.0%", "c=8"):
        assert needle in proc.stdout
    summary = json.loads((out / "simulate.json").read_text())
    assert summary["concurrencies"] == [2, 8] and summary["num_spec_tokens"] == 2
    assert summary["policies"][-1] == "oracle" and "fixed-2" in summary["policies"]
    for cell in summary["cells"]:
        pol = cell["policies"]
        assert pol["oracle"]["pct_of_oracle"] == pytest.approx(100.0)
        assert all(p["tok_s"] <= pol["oracle"]["tok_s"] * (1 + 1e-9) for p in pol.values())
        assert cell["steps"] == 70
    assert (out / "simulate_cells" / "c8.json").exists() and "| policy |" in (out / "simulate.md").read_text()
    assert (out / "simulate_throughput.png").read_bytes()[:4] == b"\x89PNG"

    bad = subprocess.run([*cmd[:5], "--simulate", "--sps-curve", str(curve)], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: --simulate needs recorded traces")
    # the replay's K against the curve's, and more slots than the traces have requests, are said
    k2 = tmp_path / "k2.json"
    SpsCurve.from_dict({**SpsCurve.load(curve).to_dict(), "meta": {"k": 3}}).save(k2)
    warned = subprocess.run([*cmd[:5], "--simulate", "--traces", str(traces), "--sps-curve", str(k2), "-c", "2,64",
                             "-k", "2", "--results-dir", str(tmp_path / "w"), "--steps", "20", "--no-plots"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "250"})
    said = " ".join(warned.stderr.split())
    assert warned.returncode == 0, warned.stderr
    assert "profiled at k=3 and the replay drafts k=2" in said and "c=64 exceeds the traces'" in said
    # options of served matrices are said to be unused, not silently dropped
    moot = subprocess.run([*cmd, "--configs", "varlen", "-n", "8", "--no-plots"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "250"})
    assert moot.returncode == 0, moot.stderr
    assert "warning: --configs, --num-prompts: not used by --simulate" in moot.stderr
    # ... and, into the first run's folder with --no-plots, its plot (drawn from that run) is not left beside it
    assert "removed simulate_throughput.png" in " ".join(moot.stderr.split())
    assert not (out / "simulate_throughput.png").exists()
    # the saturation policy's served settings replay as served
    policy = subprocess.run([*cmd[:-6], "--results-dir", str(tmp_path / "p"), "--steps", "20", "--no-plots",
                             "--resume-every", "4", "--probe-tax", "0.5"], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "COLUMNS": "250"})
    assert policy.returncode == 0, policy.stderr
    meta = json.loads((tmp_path / "p" / "simulate.json").read_text())
    assert (meta["resume_every"], meta["probe_tax"]) == (4, 0.5), meta
    taxless = subprocess.run([*cmd[:-6], "--results-dir", str(tmp_path / "q"), "--probe-tax", "0"],
                             capture_output=True, text=True, timeout=300)
    assert taxless.returncode == 1 and "probe_tax" in taxless.stderr and len(taxless.stderr.strip().splitlines()) == 1


def test_request_ids_are_a_files_own(tmp_path: Path) -> None:
    """Two runs' trace files may both hold ``gen-0`` (LLMEngine.generate's ids): they are two requests, not one
    whose steps interleave."""
    from dspark_cli.bench.simulate import load_trace_data
    from dspark_cli.core.traces import TraceWriter

    for name, accepted in (("a.jsonl", 0), ("b.jsonl", 3)):
        writer = TraceWriter(tmp_path / name)
        writer.write_batch([[0.9] * 3] * 3, [3, 3, 3], [accepted] * 3, requests=["gen-0"] * 3, step=[0, 1, 2])
        writer.close()
    data = load_trace_data([tmp_path])
    assert len(data.requests) == 2
    assert [data.accepted[idx].tolist() for idx in data.requests] == [[0, 0, 0], [3, 3, 3]]
