"""STS: offline sequential fit, online counters with in-place refits, sts.json, temperature application."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_cli.core.sts import (
    OnlineSTS,
    StsFit,
    apply_temperatures,
    default_grid,
    ece,
    fit_sts,
    load_sts,
)
from dspark_cli.errors import DsparkError

T_STAR = [2.5, 0.4, 2.0]


def synth(seed: int, n: int, t_star: list[float], mu: float = 1.5, sd: float = 2.0):
    """Rows drawn from a known miscalibration: the true conditional acceptance of position k is
    sigmoid(logit(c_k) / T*_k); verification is censored by a random verified count v."""
    rng = np.random.default_rng(seed)
    k = len(t_star)
    logit = rng.normal(mu, sd, size=(n, k))
    conf = 1.0 / (1.0 + np.exp(-logit))
    p_true = 1.0 / (1.0 + np.exp(-logit / np.array(t_star)))
    accept = rng.random((n, k)) < p_true
    lead = np.argmin(np.c_[accept, np.zeros((n, 1), dtype=bool)], axis=1)  # accepted run if all verified
    verified = rng.integers(0, k + 1, size=n)
    return conf, verified, np.minimum(lead, verified)


def test_default_grid() -> None:
    g = default_grid()
    assert len(g) == 257 and 1.0 in g
    assert g.min() == pytest.approx(0.05) and g.max() == pytest.approx(20.0)


def test_ece_definition() -> None:
    assert ece(np.array([0.25, 0.25, 0.75, 0.75]), np.array([0, 1, 1, 1]), bins=2) == pytest.approx(0.25)
    assert ece(np.array([1.0, 0.0]), np.array([1, 0]), bins=20) == 0.0


def test_fit_recovers_the_true_temperatures_and_cuts_ece() -> None:
    conf, v, a = synth(0, 30000, T_STAR)
    fit = fit_sts(conf, v, a)
    assert isinstance(fit, StsFit) and fit.num_rows == 30000
    for k, t in enumerate(T_STAR):
        assert abs(math.log(fit.temperatures[k] / t)) < 0.2, (k, fit.temperatures)
        assert fit.ece_after[k] * 3 <= fit.ece_before[k], (k, fit.ece_before, fit.ece_after)
    # The cumulative label is known exactly where position k was verified.
    assert fit.rows_per_position == [int((v >= k).sum()) for k in (1, 2, 3)]
    assert all(0.5 < x <= 1.0 for x in fit.auc)


def test_fit_keeps_calibrated_heads_and_unobserved_positions_at_one() -> None:
    conf, v, a = synth(1, 30000, [1.0, 1.0, 1.0])
    fit = fit_sts(conf, v, a)
    assert all(abs(math.log(t)) < 0.15 for t in fit.temperatures)
    # Nothing verified past position 1: positions 2 and 3 have no known rows and stay at T = 1.
    fit2 = fit_sts(conf, np.minimum(v, 1), np.minimum(a, 1))
    assert fit2.temperatures[1:] == [1.0, 1.0]
    assert math.isnan(fit2.ece_before[2]) and fit2.rows_per_position[2] == 0


def test_ece_ties_prefer_the_temperature_closest_to_one() -> None:
    # All confidences 0.5: every temperature gives the same probabilities, so every ECE ties.
    conf = np.full((100, 2), 0.5)
    v = np.full(100, 2)
    a = np.tile([0, 1, 2, 2], 25)
    assert fit_sts(conf, v, a).temperatures == [1.0, 1.0]
    assert fit_sts(conf, v, a, grid=[0.5, 3.0, 1.25, 0.9]).temperatures == [0.9, 0.9]


def test_fit_input_validation() -> None:
    with pytest.raises(DsparkError):
        fit_sts(np.ones(5), np.ones(5), np.ones(5))
    with pytest.raises(DsparkError):
        fit_sts(np.ones((5, 2)), np.ones(4), np.ones(5))
    with pytest.raises(DsparkError):
        fit_sts(np.ones((5, 2)), np.ones(5), np.ones(5), grid=[1.0, -2.0])
    with pytest.raises(DsparkError, match="1 of 20 rows hold NaN or infinity"):  # was a numpy bincount error
        fit_sts(np.array([[0.5, np.nan]] + [[0.9, 0.8]] * 19), np.full(20, 2), np.full(20, 1))
    # Counts no verify step can produce: more verified than K, more accepted than verified, negative.
    for v, a, row in (([2, 9], [1, 0], 1), ([1, 1], [3, 1], 0), ([2, 2], [0, -1], 1)):
        with pytest.raises(DsparkError, match=rf"1 of 2 rows break it \(row {row}: "):
            fit_sts(np.full((2, 2), 0.5), np.array(v), np.array(a))


def test_sts_json_round_trip_with_both_key_names(tmp_path: Path) -> None:
    conf, v, a = synth(2, 5000, [1.5, 0.7])
    fit = fit_sts(conf, v, a)
    path = fit.save(tmp_path / "sts.json")
    d = json.loads(path.read_text())
    assert d["version"] == 1 and d["num_rows"] == 5000
    assert d["temperatures"] == d["sts_temperatures"] == fit.temperatures
    assert len(d["ece_before"]) == len(d["ece_after"]) == 2
    assert load_sts(path) == tuple(fit.temperatures)
    (tmp_path / "other.json").write_text(json.dumps({"sts_temperatures": [0.5, 2.0, 1.0]}))
    assert load_sts(tmp_path / "other.json") == (0.5, 2.0, 1.0)
    assert load_sts(tmp_path / "other.json", num_positions=2) == (0.5, 2.0)


def test_nan_metrics_are_written_as_null(tmp_path: Path) -> None:
    fit = StsFit(temperatures=[1.0], ece_before=[float("nan")], ece_after=[float("nan")], auc=[float("nan")],
                 num_rows=0)
    d = json.loads(fit.save(tmp_path / "s.json").read_text())
    assert d["ece_before"] == [None] and d["auc"] == [None]


@pytest.mark.parametrize(
    "content,needle",
    [
        ('{"temperatures": [1.0, -2.0]}', "temperature 2"),
        ('{"temperatures": [1.0, 0]}', "finite and > 0"),
        ('{"temperatures": [1.0, "x"]}', "temperature 2"),
        ('{"temperatures": []}', "non-empty"),
        ('{"ece": [0.1]}', "non-empty"),
        ('{"temperatures": [1.0], "sts_temperatures": [2.0]}', "differ"),
        ('[1.0, 2.0]', "JSON object"),
        ('{"temperatures": [NaN]}', "temperature 1 is nan, which JSON does not allow; temperatures must be finite"),
        ('{"temperatures": [1.0, -Infinity]}', "temperature 2 is -inf"),
        ('{"temperatures": [1.0], "ece_before": [Infinity]}', "holds Infinity, which JSON does not allow"),
        ('{"temperatures": [1.0', "not valid JSON"),
        ('{"version": 2, "temperatures": [1.0]}', "unsupported version 2 (this build reads version 1)"),
        ('{"version": "1", "temperatures": [1.0]}', "unsupported version '1'"),
        ('{"version": true, "temperatures": [1.0]}', "unsupported version True"),
    ],
)
def test_load_sts_refusals_name_the_file(tmp_path: Path, content: str, needle: str) -> None:
    p = tmp_path / "sts.json"
    p.write_text(content)
    with pytest.raises(DsparkError) as info:
        load_sts(p)
    assert str(p) in str(info.value) and needle in str(info.value) and "\n" not in str(info.value)


def test_load_sts_missing_file_and_short_table(tmp_path: Path) -> None:
    with pytest.raises(DsparkError, match="cannot read"):
        load_sts(tmp_path / "nope.json")
    p = tmp_path / "sts.json"
    p.write_text('{"temperatures": [1.0, 2.0]}')
    with pytest.raises(DsparkError, match="4 draft positions need one each"):
        load_sts(p, num_positions=4)


def test_load_sts_accepts_version_1_or_none(tmp_path: Path) -> None:
    p = tmp_path / "sts.json"
    p.write_text('{"version": 1, "temperatures": [1.5]}')
    assert load_sts(p) == (1.5,)
    # The seed and other tools write only the list; version 1 is the only format there has been.
    p.write_text('{"temperatures": [1.5]}')
    assert load_sts(p) == (1.5,)


def test_load_sts_names_a_folder_as_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "adir"
    folder.mkdir()
    with pytest.raises(DsparkError) as info:
        load_sts(folder)
    msg = str(info.value)
    assert f"{folder}: is a folder" in msg and str(folder / "sts.json") in msg and "\n" not in msg


def test_fit_warns_on_temperatures_the_data_cannot_pin_down() -> None:
    # Plenty of well-spread rows: nothing to warn about.
    conf, v, a = synth(0, 30000, T_STAR)
    fit = fit_sts(conf, v, a)
    assert fit.warnings() == [] and fit.flat_to_edge == [False, False, False]
    # Three rows: too few to trust (and one position was never verified, so T stays 1.0).
    few = fit_sts(np.array([[0.9, 0.8], [0.7, 0.6], [0.5, 0.4]]), np.array([1, 1, 1]), np.array([1, 0, 0]))
    w = few.warnings()
    assert len(w) == 2 and w[0].startswith("position 1: ") and "only 3 verified rows (fewer than 100)" in w[0]
    assert w[1].startswith("position 2: no trace row verified this position, so T stays 1.0")
    # Saturated confidences with mixed outcomes: the fit runs to the top of the grid.
    sat = fit_sts(np.ones((300, 1)), np.ones(300), np.arange(300) % 2)
    assert sat.temperatures == [20.0]
    assert "T=20 is at the edge of the searched range [0.05, 20]" in sat.warnings()[0]
    # Every row accepted: any T small enough puts all probabilities in the top bin, so the chosen T is
    # only the plateau's end nearest 1, not an edge value -- still flagged.
    flat = fit_sts(np.full((300, 1), 0.9), np.ones(300), np.ones(300))
    assert flat.temperatures[0] > 0.05 and flat.flat_to_edge == [True]
    assert "fits no better than the edge of the searched range" in flat.warnings()[0]
    # Warnings are for the person running calibrate, not part of the stable sts.json format.
    assert "flat_to_edge" not in flat.to_dict() and "grid_bounds" not in flat.to_dict()


def test_apply_temperatures() -> None:
    conf = torch.tensor([[0.9, 0.2, 0.5], [0.0, 1.0, 0.7]])
    temps = torch.tensor([2.0, 0.5, 1.0, 3.0])
    got = apply_temperatures(conf, temps)
    logit = torch.logit(conf.clamp(1e-6, 1 - 1e-6))
    assert torch.allclose(got, torch.sigmoid(logit / temps[:3]))
    assert torch.allclose(apply_temperatures(conf, torch.ones(3)), conf.clamp(1e-6, 1 - 1e-6), atol=1e-6)
    assert got.shape == conf.shape


# ---------------------------------------------------------------------------------------------- online


def feed(sts: OnlineSTS, conf: np.ndarray, v: np.ndarray, a: np.ndarray, batch: int = 512) -> None:
    for s in range(0, len(v), batch):
        sts.record(torch.tensor(conf[s : s + batch]), torch.tensor(v[s : s + batch]), torch.tensor(a[s : s + batch]))


def test_online_converges_toward_t_star_in_place() -> None:
    conf, v, a = synth(3, 30000, T_STAR)
    sts = OnlineSTS(3, decay=1.0, refit_interval=1000)
    temps = sts.temperatures
    ptr = temps.data_ptr()
    feed(sts, conf, v, a)
    sts.refit()
    assert sts.temperatures is temps and sts.temperatures.data_ptr() == ptr
    for k, t in enumerate(T_STAR):
        assert abs(math.log(float(temps[k]) / t)) < 0.15, temps
    # Trials are censored: position k counts only rows with k <= min(a+1, v).
    expect = [int((np.minimum(a + 1, v) >= k).sum()) for k in (1, 2, 3)]
    assert sts.trials.sum(dim=1).round().tolist() == expect
    assert sts.hits.sum(dim=1).round().tolist() == [int((a >= k).sum()) for k in (1, 2, 3)]


def test_online_prior_dominates_with_little_data_and_invalid_rows_are_ignored() -> None:
    sts = OnlineSTS(2, initial_temperatures=[1.5, 0.8], prior_weight=1000.0)
    sts.refit()
    assert torch.allclose(sts.temperatures, torch.tensor([1.5, 0.8]))  # no data: prior kept
    conf, v, a = synth(4, 200, [3.0, 3.0])
    valid = torch.zeros(200, dtype=torch.bool)
    sts.record(torch.tensor(conf), torch.tensor(v), torch.tensor(a), valid=valid)
    assert float(sts.trials.sum()) == 0.0
    sts.record(torch.tensor(conf), torch.tensor(v), torch.tensor(a))
    sts.refit()
    # 200 rows against 1000 pseudo-trials: the estimate moves toward T* = 3 but stays near the prior.
    assert 1.5 < float(sts.temperatures[0]) < 3.0
    assert abs(math.log(float(sts.temperatures[0]) / 1.5)) < abs(math.log(3.0 / 1.5))


def test_online_step_refits_on_schedule_and_decays() -> None:
    conf, v, a = synth(5, 2048, [2.0])
    sts = OnlineSTS(1, decay=0.5, refit_interval=3, prior_weight=0.0)
    before = sts.temperatures.clone()
    assert [sts.step() for _ in range(3)] == [False, False, True]
    assert torch.equal(sts.temperatures, before)  # no data yet
    sts.record(torch.tensor(conf[:1]), torch.tensor(v[:1]), torch.tensor(a[:1]))
    t0 = float(sts.trials.sum())
    sts.record(torch.tensor(conf[:0]), torch.tensor(v[:0]), torch.tensor(a[:0]))
    assert float(sts.trials.sum()) == pytest.approx(0.5 * t0)
    feed(sts, conf, v, a, batch=2048)
    for _ in range(3):
        sts.step()
    assert float(sts.temperatures[0]) > 1.2


def test_online_validation() -> None:
    with pytest.raises(DsparkError):
        OnlineSTS(0)
    with pytest.raises(DsparkError):
        OnlineSTS(2, decay=1.5)
    with pytest.raises(DsparkError):
        OnlineSTS(2, initial_temperatures=[1.0])
    with pytest.raises(DsparkError):
        OnlineSTS(2, initial_temperatures=[1.0, -1.0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_online_record_and_refit_on_cuda_do_not_sync() -> None:
    conf, v, a = synth(6, 4096, T_STAR)
    sts = OnlineSTS(3, device="cuda")
    c, vv, aa = (torch.tensor(x, device="cuda") for x in (conf, v, a))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sts.record(c, vv, aa)
        sts.refit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sts.temperatures.device.type == "cuda"


COND = np.array([0.8, 0.7, 0.6, 0.5, 0.35, 0.2, 0.08])  # a V4-Flash-like conditional acceptance decay


def uninformative(seed: int, rows: int, verify: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A weightless draft against synthetic acceptance: every raw confidence ~1/vocabulary, acceptance
    drawn per position from ``COND`` whatever the confidences say."""
    rng = np.random.default_rng(seed)
    conf = (2e-5 * (1 + 0.2 * rng.standard_normal((rows, 7)))).clip(1e-6).astype(np.float32)
    passed = rng.random((rows, 7)) < COND
    a = np.minimum(np.argmin(np.concatenate([passed, np.zeros((rows, 1), bool)], 1), 1), verify)
    return conf, np.full(rows, verify), a


def test_online_shift_calibrates_confidences_that_no_temperature_can() -> None:
    """Raw confidences near 0 while most drafts pass: a temperature keeps the logit's sign (so at most 0.5,
    below 0.37 on the grid); the shift brings each position's calibrated rate to its acceptance."""
    conf, v, a = uninformative(1, 4000)
    probe = torch.full((1, 7), 2e-5)
    only_t = OnlineSTS(7, decay=1.0, fit_offsets=False)
    feed(only_t, conf, v, a)
    only_t.refit()
    assert float(only_t.apply(probe).max()) < 0.5
    sts = OnlineSTS(7, decay=1.0)
    offsets = sts.offsets
    feed(sts, conf, v, a)
    sts.refit()
    assert sts.offsets is offsets  # in place, like the temperatures: captured graphs read both
    got = sts.apply(probe)[0].numpy()
    assert np.all(np.abs(got[:5] - COND[:5]) < 0.06), got
    assert float(sts.last_ece[:3].max()) < float(only_t.last_ece[:3].min())


def test_online_shift_stays_off_for_a_head_temperature_scaling_already_calibrates() -> None:
    conf, v, a = synth(7, 30000, T_STAR)
    sts = OnlineSTS(3, decay=1.0)
    feed(sts, conf, v, a)
    sts.refit()
    for k, t in enumerate(T_STAR):
        assert abs(math.log(float(sts.temperatures[k]) / t)) < 0.15
    assert torch.all(sts.offsets == 0), sts.offsets
    # Nor on smaller samples of a calibrated head, where a free shift would chase noise (and detune it).
    shifted = 0
    for seed in range(10):
        conf, v, a = synth(100 + seed, 1500, [1.0] * 4)
        small = OnlineSTS(4, decay=1.0)
        feed(small, conf, v, a)
        small.refit()
        shifted += int((small.offsets != 0).sum())
    assert shifted <= 2, shifted  # of 40 positions: three-sigma false alarms only


@pytest.mark.parametrize("rate", [1.0, 0.99])
def test_online_fit_of_a_head_that_says_little_while_nearly_every_draft_passes(rate: float) -> None:
    """Raw logits N(1, 2^2) with no relation to the outcome, and (nearly) every draft accepted: chosen alone, T
    went to the grid's bottom (it sends the positive logits to 1), and the bounded shift could not lift the
    negative ones -- 15-18% of drafts calibrated below 0.01, all of them accepted, never verified again."""
    gen = torch.Generator().manual_seed(0)
    sts = OnlineSTS(1)
    for _ in range(640):
        z = torch.randn(64, 1, generator=gen) * 2 + 1
        accepted = (torch.rand(64, 1, generator=gen) < rate).long()[:, 0]
        sts.record(torch.sigmoid(z), torch.ones(64, dtype=torch.long), accepted)
        sts.step()
    cal = sts.apply(torch.sigmoid(torch.randn(100_000, 1, generator=gen) * 2 + 1))
    assert float((cal < 0.5).float().mean()) < 0.01
    assert abs(float(cal.mean()) - rate) < 0.02 and float(sts.last_ece[0]) < 0.02


def test_given_temperatures_are_not_paired_with_another_positions_shift() -> None:
    """With per-position offline temperatures, a shift fitted at one position's T means nothing at another's:
    untested positions keep their own prior (T_k, b = 0)."""
    conf, v, a = uninformative(3, 2000, verify=1)
    sts = OnlineSTS(3, decay=1.0, initial_temperatures=[1.0, 3.0, 0.3])
    feed(sts, conf[:, :3], v, a)
    sts.refit()
    assert float(sts.offsets[0]) != 0.0  # position 1 needed its shift
    assert torch.allclose(sts.temperatures[1:], torch.tensor([3.0, 0.3])) and torch.all(sts.offsets[1:] == 0)


def test_untested_positions_start_from_their_predecessor_and_get_verified() -> None:
    """Censoring trap: only position 1 is ever verified. Without inheritance positions 2..7 would keep the
    identity calibration of ~1/vocabulary -- 'never verify me' -- forever; they take position 1's instead."""
    conf, v, a = uninformative(2, 3000, verify=1)
    sts = OnlineSTS(7, decay=1.0)
    feed(sts, conf, v, a)
    assert float(sts.trials[1:].sum()) == 0.0
    sts.refit()  # one refit reaches every position: no-data positions copy the last one with data
    got = sts.apply(torch.full((1, 7), 2e-5))[0].numpy()
    assert abs(got[0] - COND[0]) < 0.05 and np.all(np.abs(got[1:] - got[0]) < 0.02), got
    # Given temperatures are per-position priors: kept where there is no data, the shift still inherited.
    seeded = OnlineSTS(7, decay=1.0, initial_temperatures=[1.0] * 7)
    feed(seeded, conf, v, a)
    seeded.refit()
    assert torch.allclose(seeded.temperatures[1:], torch.ones(6))


def test_online_first_refits_come_early() -> None:
    sts = OnlineSTS(1, refit_interval=64)
    refits = [n for n in range(1, 200) if sts.step()]
    assert refits == [8, 16, 32, 64, 128, 192]


def test_online_sts_ignores_a_nan_confidence_instead_of_failing() -> None:
    """A NaN confidence's bin index was garbage: on the CPU a one-hot error, on CUDA a device-side assert that
    stops the server. It says nothing about calibration, so it is no trial; the row's other positions count."""
    sts = OnlineSTS(2, decay=1.0, refit_interval=1000)
    sts.record(torch.tensor([[float("nan"), 0.5], [0.8, 0.6]]), torch.tensor([2, 2]), torch.tensor([1, 2]))
    assert torch.isfinite(sts.trials).all()
    assert sts.trials[0].sum().item() == 1.0 and sts.trials[1].sum().item() == 2.0
    assert torch.isfinite(sts.refit()).all()


def test_fit_reports_the_mann_whitney_auc() -> None:
    """The reported AUC is exact."""
    conf = np.array([[0.1], [0.4], [0.35], [0.8]])
    fit = fit_sts(conf, np.ones(4), np.array([0, 0, 1, 1]))
    assert fit.auc[0] == pytest.approx(0.75)
    ties = fit_sts(np.array([[0.5], [0.5], [0.9], [0.2]]), np.ones(4), np.array([1, 0, 1, 0]))
    assert ties.auc[0] == pytest.approx(0.875)  # pairs (0.5 vs 0.5) count half


def test_online_shift_ignores_a_miss_below_min_shift_gap_however_much_data() -> None:
    """A 1% miss in the large is never worth a shift, even when 200k trials make it many standard deviations wide."""
    n = 200_000
    conf = torch.full((n, 1), 0.5)  # logit 0: no temperature changes it; calibrated rate 0.5
    accepted = (torch.arange(n) < int(0.51 * n)).long()
    sts = OnlineSTS(1, decay=1.0)
    sts.record(conf, torch.ones(n, dtype=torch.long), accepted)
    sts.refit()
    assert float(sts.offsets[0]) == 0.0


def test_thin_position_stays_anchored_to_its_predecessor_across_refits() -> None:
    """Without given temperatures a position's prior is its predecessor's fit, so a position with few trials stays
    near it -- and refits without new outcomes do not keep moving it (its own last fit as prior would re-count its
    data every refit and drift it to its raw fit)."""
    rng = np.random.default_rng(0)
    n = 6000
    logit = rng.normal(1.5, 2.0, size=(n, 2))
    conf = 1 / (1 + np.exp(-logit))
    p_true = 1 / (1 + np.exp(-logit / np.array([3.0, 0.5])))
    acc = rng.random((n, 2)) < p_true
    lead = np.argmin(np.c_[acc, np.zeros((n, 1), dtype=bool)], axis=1)
    v = np.where(rng.random(n) < 0.05, 2, 1)  # position 2 is verified rarely
    a = np.minimum(lead, v)
    sts = OnlineSTS(2, decay=1.0, prior_weight=1000.0)
    sts.record(torch.tensor(conf), torch.tensor(v), torch.tensor(a))
    temps = []
    for _ in range(12):
        sts.refit()
        temps.append(sts.temperatures.clone())
    assert float(sts.trials[1].sum()) < 400
    assert torch.allclose(temps[-1], temps[3])  # settled: no drift with no new outcomes
    assert float(temps[-1][1]) > 1.5  # still near position 1's T (~3), far from its own thin fit (~0.5)


def test_an_sts_file_and_traces_given_with_a_home_path_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dspark bench --simulate --sts=~/sts.json --traces=~/t.jsonl`: the shell leaves `~` after `=` to us."""
    from dspark_cli.core.traces import read_traces

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "sts.json").write_text('{"version": 1, "temperatures": [1.5, 2.0]}')
    (tmp_path / "t.jsonl").write_text('{"conf": [0.5, 0.5], "verified": 2, "accepted": 1}\n')
    assert load_sts("~/sts.json") == (1.5, 2.0)
    assert len(read_traces("~/t.jsonl").records) == 1
