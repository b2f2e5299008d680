"""SpsCurve: loading, refusals, staircase/interpolation/extrapolation lookups and the sps_curve.json format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_cli.core.sps import SpsCurve, SpsCurveError
from dspark_cli.errors import DsparkError

VERIFY = [[8, 10.0], [16, 11.0], [32, 14.0], [64, 20.0], [96, 40.0], [128, 50.0]]


def spec_obj(**over: object) -> dict:
    obj = {
        "version": 1,
        "dspark_sps_curve": [[t, 1000.0 / (ms + 1.0)] for t, ms in VERIFY],
        "verify_curve_ms": VERIFY,
        "draft_curve_ms": [[1, 2.0], [8, 3.0], [64, 6.0]],
        "overhead_ms": 1.0,
        "capture_sizes": [8, 16, 32, 64],
        "meta": {"engine": "embedded", "k": 4},
    }
    obj.update(over)
    return obj


def write(tmp_path: Path, obj: object, raw: bytes | None = None) -> Path:
    p = tmp_path / "sps_curve.json"
    p.write_bytes(raw if raw is not None else orjson.dumps(obj))
    return p


@pytest.fixture
def curve(tmp_path: Path) -> SpsCurve:
    return SpsCurve.load(write(tmp_path, spec_obj()))


# ---------------------------------------------------------------------------------------------- refusals

REFUSALS = [
    ("empty-list", [], "empty"),
    ("empty-verify", spec_obj(verify_curve_ms=[], dspark_sps_curve=None), "empty"),
    ("empty-object-verify", spec_obj(verify_curve_ms={}, dspark_sps_curve=None), "empty"),
    ("no-curve", {"version": 1, "overhead_ms": 0.0}, "neither"),
    ("not-object", "hello", "expected a JSON object"),
    ("version", spec_obj(version=2), "version"),
    ("non-pair", spec_obj(verify_curve_ms=[[8, 10.0, 3], [16, 12.0]]), "pair"),
    ("non-number", spec_obj(verify_curve_ms=[[8, "fast"], [16, 12.0]]), "numbers"),
    ("fractional-tokens", spec_obj(verify_curve_ms=[[8.5, 10.0], [16, 12.0]]), "positive integer"),
    ("zero-tokens", spec_obj(verify_curve_ms=[[0, 10.0], [16, 12.0]]), "positive integer"),
    ("zero-cost", spec_obj(verify_curve_ms=[[8, 0.0], [16, 12.0]]), "non-positive"),
    ("negative-cost", spec_obj(verify_curve_ms=[[8, -1.0], [16, 12.0]]), "non-positive"),
    ("negative-sps", [[8, 100.0], [16, -5.0]], "non-positive"),
    ("duplicate", spec_obj(verify_curve_ms=[[8, 10.0], [8, 11.0], [16, 12.0]]), "twice"),
    ("far-drop", spec_obj(verify_curve_ms=[[8, 10.0], [16, 20.0], [32, 12.0], [64, 30.0]]), "not monotone"),
    ("flat", spec_obj(verify_curve_ms=[[8, 10.0], [16, 10.05], [64, 10.1]]), "flat"),
    ("single-point", [[8, 100.0]], "holds one batch size (8 tokens); a curve needs at least two"),
    ("negative-overhead", spec_obj(overhead_ms=-1.0), "overhead_ms"),
    ("string-overhead", spec_obj(overhead_ms="x"), "overhead_ms"),
    ("bad-capture", spec_obj(capture_sizes=[8, -16]), "capture_sizes"),
    ("meta-list", spec_obj(meta=[1, 2]), "meta"),
    ("overhead-exceeds-step", {"version": 1, "dspark_sps_curve": [[8, 100.0], [16, 50.0]], "overhead_ms": 15.0},
     "faster than overhead"),
    ("draft-drop", spec_obj(draft_curve_ms=[[1, 10.0], [8, 2.0]]), "draft_curve_ms is not monotone"),
]


@pytest.mark.parametrize("name,obj,needle", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_load_refuses_with_one_line_naming_the_file(tmp_path: Path, name: str, obj: object, needle: str) -> None:
    path = write(tmp_path, obj)
    with pytest.raises(SpsCurveError) as info:
        SpsCurve.load(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert str(path) in msg
    assert needle in msg
    assert isinstance(info.value, DsparkError)


def test_load_refuses_unreadable_and_invalid_json(tmp_path: Path) -> None:
    with pytest.raises(SpsCurveError, match="cannot read"):
        SpsCurve.load(tmp_path / "missing.json")
    bad = write(tmp_path, None, raw=b'{"version": 1, "verify_curve_ms": [[8, 10.0], [16, 12.0]],}')
    with pytest.raises(SpsCurveError, match="not valid JSON") as info:
        SpsCurve.load(bad)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_or_infinity_in_a_file_is_named_as_such(tmp_path: Path, token: bytes) -> None:
    # Python's json writes these for non-finite floats; orjson refuses them as "unexpected character".
    bad = write(tmp_path, None, raw=b'{"version": 1, "verify_curve_ms": [[8, 10.0], [16, ' + token + b"]]}")
    with pytest.raises(SpsCurveError, match="holds NaN or Infinity; step costs must be finite numbers") as info:
        SpsCurve.load(bad)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)


def test_nan_inside_a_string_does_not_hide_the_real_json_error(tmp_path: Path) -> None:
    bad = write(tmp_path, None, raw=b'{"version": 1, "meta": {"note": "NaN"}, "verify_curve_ms": [[8, 10.0]],}')
    with pytest.raises(SpsCurveError, match="not valid JSON"):
        SpsCurve.load(bad)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_values_are_refused(bad: float) -> None:
    with pytest.raises(SpsCurveError, match="non-finite"):
        SpsCurve.from_dict(spec_obj(verify_curve_ms=[[8, 10.0], [16, bad]]), source="x.json")
    with pytest.raises(SpsCurveError, match="non-finite"):
        SpsCurve.from_dict([[8, 100.0], [16, bad]], source="x.json")
    with pytest.raises(SpsCurveError, match="non-finite"):
        SpsCurve.from_points([(8, 10.0), (16, bad)])


def test_flat_message_explains_the_consequence() -> None:
    with pytest.raises(SpsCurveError, match="always verify every draft"):
        SpsCurve.from_points([(8, 10.0), (4096, 10.1)], source="prof")


def test_noise_is_repaired_with_a_running_max() -> None:
    c = SpsCurve.from_points([(8, 10.0), (16, 12.0), (32, 11.5), (64, 20.0)])
    assert c.verify_ms == ((8, 10.0), (16, 12.0), (32, 12.0), (64, 20.0))
    # Exact duplicates are harmless; unsorted input is sorted.
    d = SpsCurve.from_points([(64, 20.0), (8, 10.0), (8, 10.0), (16, 12.0)])
    assert d.verify_ms == ((8, 10.0), (16, 12.0), (64, 20.0))


def test_constructor_validates_too() -> None:
    with pytest.raises(SpsCurveError):
        SpsCurve(verify_ms=((8, 10.0), (16, 10.0)))
    with pytest.raises(SpsCurveError):
        SpsCurve(verify_ms=())


# ---------------------------------------------------------------------------------------------- lookups


def test_staircase_rounds_up_to_the_next_capture_size(curve: SpsCurve) -> None:
    assert curve.capture_limit == 64
    for tokens, expect in [(1, 10.0), (8, 10.0), (9, 11.0), (16, 11.0), (17, 14.0), (33, 20.0), (64, 20.0)]:
        assert curve.verify_cost_ms(tokens) == pytest.approx(expect)


def test_staircase_prices_unprofiled_capture_sizes_from_graph_points() -> None:
    c = SpsCurve.from_points([(8, 10.0), (32, 16.0), (64, 30.0)], capture_sizes=[8, 16, 32])
    assert c.verify_cost_ms(9) == pytest.approx(12.0)  # 16 interpolated between 8 and 32
    assert c.verify_cost_ms(20) == pytest.approx(16.0)


def test_above_the_limit_interpolates_only_eager_points_and_extrapolates(curve: SpsCurve) -> None:
    # Between the limit (64) and the first eager point (96) the eager point's cost applies: no line is
    # drawn across the graph->eager discontinuity.
    assert curve.verify_cost_ms(65) == pytest.approx(40.0)
    assert curve.verify_cost_ms(96) == pytest.approx(40.0)
    assert curve.verify_cost_ms(112) == pytest.approx(45.0)
    assert curve.verify_cost_ms(128) == pytest.approx(50.0)
    # Past the last point: slope of the last two points (10 ms / 32 tokens).
    assert curve.verify_cost_ms(192) == pytest.approx(70.0)


def test_one_eager_point_extends_at_the_graph_slope_not_across_the_jump() -> None:
    """With one point profiled above the capture limit, the slope past it came from the last graph point and
    that eager point: the graph -> eager jump (28 ms over 32 tokens) priced every token past the profile."""
    c = SpsCurve.from_points([(8, 10.0), (16, 11.0), (32, 12.0), (64, 40.0)], capture_sizes=[8, 16, 32])
    assert c.verify_cost_ms(64) == pytest.approx(40.0)
    assert c.verify_cost_ms(128) == pytest.approx(40.0 + 64 / 16)  # the graph points' 1 ms per 16 tokens
    assert c.verify_cost_ms(256) == pytest.approx(40.0 + 192 / 16)


def test_without_capture_sizes_the_curve_is_piecewise_linear() -> None:
    c = SpsCurve.from_points([(10, 10.0), (20, 20.0), (40, 30.0)])
    assert c.verify_cost_ms(5) == pytest.approx(10.0)
    assert c.verify_cost_ms(15) == pytest.approx(15.0)
    assert c.verify_cost_ms(30) == pytest.approx(25.0)
    assert c.verify_cost_ms(60) == pytest.approx(40.0)


def test_step_cost_is_draft_plus_verify_plus_overhead(curve: SpsCurve) -> None:
    assert curve.draft_cost_ms(1) == pytest.approx(2.0)
    assert curve.draft_cost_ms(4) == pytest.approx(2.0 + 3 / 7)
    assert curve.draft_cost_ms(0) == 0.0
    assert curve.step_cost_ms(4, 10) == pytest.approx(curve.draft_cost_ms(4) + 11.0 + 1.0)
    assert curve.step_cost_ms(4, 10, drafting=False) == pytest.approx(12.0)
    assert curve.steps_per_sec(4, 10, drafting=False) == pytest.approx(1000.0 / 12.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(0, 300), st.booleans(), st.booleans())
def test_integer_step_prices_are_cached_and_equal_the_array_prices(num_reqs: int, tokens: int, drafting: bool,
                                                                   sampling: bool) -> None:
    """step_cost_ms looks integer arguments up after the first call (engines price every paused step so); the
    cached price is the array path's, whatever the region (graph staircase, eager line, extrapolation)."""
    c = SpsCurve.from_points(VERIFY, [(1, 2.0), (8, 3.0), (64, 6.0)], 1.0, (8, 16, 32, 64),
                             draft_sampling_ms=[(1, 2.5), (64, 7.0)])
    arrays = c.step_cost_ms(np.array([num_reqs]), np.array([tokens]), drafting, sampling)[0]
    first = c.step_cost_ms(num_reqs, tokens, drafting, sampling)
    again = c.step_cost_ms(np.int64(num_reqs), tokens, drafting, sampling)
    assert isinstance(first, float) and first == again == pytest.approx(float(arrays))


def test_the_step_price_cache_stays_bounded() -> None:
    from dspark_cli.core.sps import STEP_COST_CACHE

    c = SpsCurve.from_points(VERIFY)
    for t in range(STEP_COST_CACHE + 10):
        c.step_cost_ms(1, t, drafting=False)
    assert len(c._step_costs) <= STEP_COST_CACHE
    assert c.step_cost_ms(1, 3, drafting=False) == pytest.approx(float(c.step_cost_ms(np.array([1]), np.array([3]),
                                                                                        drafting=False)[0]))


def test_sampling_steps_are_priced_by_the_sampling_draft_curve(tmp_path: Path, curve: SpsCurve) -> None:
    # Without a sampling curve a sampling step costs what a greedy one does (files written before it existed).
    assert curve.draft_sampling_ms == ()
    assert curve.draft_cost_ms(4, sampling=True) == curve.draft_cost_ms(4)
    sampled = SpsCurve.from_points(curve.verify_ms, curve.draft_ms, curve.overhead_ms, curve.capture_sizes,
                                   draft_sampling_ms=[(1, 5.0), (8, 12.0)])
    assert sampled.draft_cost_ms(1, sampling=True) == pytest.approx(5.0)
    assert sampled.draft_cost_ms(8, sampling=True) == pytest.approx(12.0)
    assert sampled.draft_cost_ms(8) == curve.draft_cost_ms(8)  # greedy pricing unchanged
    assert sampled.draft_cost_ms(0, sampling=True) == 0.0
    assert sampled.step_cost_ms(8, 40, sampling=True) == pytest.approx(12.0 + curve.verify_cost_ms(40) + 1.0)
    assert sampled.step_cost_ms(8, 40, drafting=False, sampling=True) == curve.step_cost_ms(8, 40, drafting=False)
    # The optional key round-trips, and the overhead override keeps it.
    path = sampled.save(tmp_path / "c.json")
    assert json.loads(path.read_text())["draft_sampling_curve_ms"] == [[1, 5.0], [8, 12.0]]
    assert "draft_sampling_curve_ms" not in json.loads(curve.save(tmp_path / "g.json").read_text())
    loaded = SpsCurve.load(path)
    assert loaded.draft_sampling_ms == ((1, 5.0), (8, 12.0))
    assert loaded.with_overhead(3.0).draft_sampling_ms == loaded.draft_sampling_ms
    assert loaded.with_overhead(3.0).overhead_ms == 3.0


def test_sampling_draft_curve_is_validated_like_the_others(tmp_path: Path, curve: SpsCurve) -> None:
    obj = curve.to_dict()
    obj["draft_sampling_curve_ms"] = [[1, 5.0], [8, -1.0]]
    path = tmp_path / "bad.json"
    path.write_bytes(orjson.dumps(obj))
    with pytest.raises(SpsCurveError, match="draft_sampling_curve_ms"):
        SpsCurve.load(path)


def test_vectorised_lookups_match_scalars(curve: SpsCurve) -> None:
    tokens = np.arange(1, 300)
    vec = curve.step_cost_ms(8, tokens)
    assert isinstance(vec, np.ndarray) and vec.shape == tokens.shape
    assert np.allclose(vec, [curve.step_cost_ms(8, int(t)) for t in tokens])
    assert isinstance(curve.verify_cost_ms(5), float)


@settings(max_examples=60, deadline=None)
@given(
    xs=st.lists(st.integers(1, 4096), min_size=2, max_size=12, unique=True),
    incs=st.lists(st.floats(0.0, 5.0), min_size=12, max_size=12),
    ncap=st.integers(0, 12),
)
def test_verify_cost_is_monotone_and_hits_profiled_capture_points(xs: list[int], incs: list[float], ncap: int) -> None:
    xs = sorted(xs)
    ys = list(np.cumsum([1.0] + incs[: len(xs) - 1]))
    if ys[-1] / ys[0] < 1.05:
        ys[-1] = ys[0] * 1.1
    caps = xs[: min(ncap, len(xs))]
    c = SpsCurve.from_points(list(zip(xs, ys, strict=True)), capture_sizes=caps)
    grid = np.arange(1, xs[-1] * 2 + 2)
    cost = c.verify_cost_ms(grid)
    assert np.all(np.diff(cost) >= -1e-9)
    assert np.all(cost > 0)
    for x, y in c.verify_ms:
        if x in caps:
            assert c.verify_cost_ms(x) == pytest.approx(y)


@settings(max_examples=80, deadline=None)
@given(
    xs=st.lists(st.integers(1, 512), min_size=2, max_size=8, unique=True),
    incs=st.lists(st.floats(0.0, 5.0), min_size=8, max_size=8),
    caps=st.lists(st.integers(1, 600), min_size=1, max_size=8, unique=True),
)
def test_verify_cost_is_monotone_with_capture_sizes_the_profile_skipped(
    xs: list[int], incs: list[float], caps: list[int]
) -> None:
    # an unprofiled capture size above the last in-graph point is priced by extending the graph points; that
    # must never price it above an eager batch measured larger (a false price drop past the capture limit)
    xs = sorted(xs)
    ys = list(np.cumsum([1.0] + incs[: len(xs) - 1]))
    if ys[-1] / ys[0] < 1.05:
        ys[-1] = ys[0] * 1.1
    c = SpsCurve.from_points(list(zip(xs, ys, strict=True)), capture_sizes=caps)
    cost = c.verify_cost_ms(np.arange(1, max(xs[-1], max(caps)) * 2 + 2))
    assert np.all(np.diff(cost) >= -1e-9) and np.all(cost > 0)


def test_an_unprofiled_capture_size_is_not_priced_above_a_larger_eager_batch() -> None:
    c = SpsCurve.from_points([(16, 10.0), (32, 14.0), (96, 18.0), (128, 20.0)], capture_sizes=[16, 32, 48, 64])
    assert [c.verify_cost_ms(t) for t in (32, 48, 64, 65, 96)] == pytest.approx([14.0, 18.0, 18.0, 18.0, 18.0])


# ---------------------------------------------------------------------------------------------- formats


def test_seed_plain_list_is_read_as_verify_only_staircase(tmp_path: Path) -> None:
    path = write(tmp_path, [[16, 50.0], [8, 100.0], [32, 25.0]])
    c = SpsCurve.load(path)
    assert c.capture_sizes == (8, 16, 32)
    assert c.verify_ms == ((8, 10.0), (16, 20.0), (32, 40.0))
    assert c.draft_ms == () and c.overhead_ms == 0.0
    assert c.step_cost_ms(64, 9) == pytest.approx(20.0)  # no draft price, rounds up to 16
    assert c.verify_cost_ms(48) == pytest.approx(60.0)  # extrapolated from the last two points


def test_object_with_only_the_seed_key_subtracts_overhead() -> None:
    c = SpsCurve.from_dict({"version": 1, "dspark_sps_curve": [[8, 100.0], [16, 50.0]], "overhead_ms": 2.0})
    assert c.verify_ms == ((8, 8.0), (16, 18.0))
    assert c.step_cost_ms(1, 16, drafting=False) == pytest.approx(20.0)


def test_save_load_round_trip_and_seed_recipe(tmp_path: Path, curve: SpsCurve) -> None:
    out = tmp_path / "out" / "sps_curve.json"
    curve.save(out)
    again = SpsCurve.load(out)
    assert again == curve
    assert again.meta == {"engine": "embedded", "k": 4}
    with open(out) as f:
        sps = json.load(f)["dspark_sps_curve"]
    assert sps == [[t, pytest.approx(1000.0 / (ms + 1.0))] for t, ms in VERIFY]
    d = json.loads(out.read_text())
    assert set(d) >= {"version", "verify_curve_ms", "draft_curve_ms", "overhead_ms", "capture_sizes", "meta"}
    assert d["version"] == 1 and d["capture_sizes"] == [8, 16, 32, 64]
    assert not list(out.parent.glob("*.tmp"))


def test_seed_list_round_trips_through_the_spec_format(tmp_path: Path) -> None:
    seed = SpsCurve.from_dict([[8, 100.0], [16, 50.0], [32, 25.0]])
    seed.save(tmp_path / "c.json")
    again = SpsCurve.load(tmp_path / "c.json")
    assert again == seed
    assert again.to_dict()["dspark_sps_curve"] == [[8, 100.0], [16, 50.0], [32, 25.0]]


def test_from_points_accepts_numpy_measurements() -> None:
    pts = np.array([[8, 10.0], [16, 12.0], [32, 15.0]])
    c = SpsCurve.from_points(pts, draft_ms=np.array([[1, 1.0], [4, 1.5]]), overhead_ms=0.5,
                             capture_sizes=np.array([8, 16, 32]), meta={"device": "cpu"})
    assert c.verify_ms[1] == (16, 12.0)
    assert c.to_dict()["meta"] == {"device": "cpu"}


@given(st.lists(st.tuples(st.integers(1, 10_000), st.floats(0.01, 100.0)), min_size=1, max_size=30,
                unique_by=lambda p: p[0]))
@settings(max_examples=200, deadline=None)
def test_monotone_fit_is_a_nondecreasing_mean_preserving_projection(points: list[tuple[int, float]]) -> None:
    from dspark_cli.core.sps import monotone_fit

    fit = monotone_fit(points)
    ys = [y for _, y in fit]
    assert [x for x, _ in fit] == sorted(x for x, _ in points)
    assert all(a <= b + 1e-9 for a, b in zip(ys, ys[1:], strict=False))
    assert sum(ys) == pytest.approx(sum(y for _, y in points))  # pooled runs keep their mean
    assert monotone_fit(fit) == pytest.approx(fit)  # a projection: fitting again changes nothing
    ordered = sorted(points)
    if all(a[1] <= b[1] for a, b in zip(ordered, ordered[1:], strict=False)):
        assert fit == ordered


def test_monotone_fit_averages_a_spike_where_a_running_max_would_keep_it() -> None:
    from dspark_cli.core.sps import monotone_fit

    # vLLM's start-up profile on an H200: one slow replay at 288 tokens, then faster larger batches
    assert monotone_fit([(8, 2.0), (288, 24.9), (496, 18.5), (1024, 30.0)]) == [
        (8, 2.0), (288, 21.7), (496, 21.7), (1024, 30.0)]


# ---------------------------------------------------------------------------------------------- both curve keys


def test_editing_only_dspark_sps_curve_in_a_full_file_is_refused_not_ignored(tmp_path: Path) -> None:
    obj = spec_obj()
    obj["dspark_sps_curve"] = [[t, 2 * s] for t, s in obj["dspark_sps_curve"]]  # the user's edit
    path = write(tmp_path, obj)
    with pytest.raises(SpsCurveError) as info:
        SpsCurve.load(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    assert "dspark_sps_curve and verify_curve_ms disagree" in msg
    assert f"{2 * 1000.0 / 11.0:g} steps/s at x=8" in msg  # the user's own number, in the user's units
    assert "edit verify_curve_ms" in msg and "delete verify_curve_ms so dspark_sps_curve is used" in msg


def test_dspark_sps_curve_with_other_batch_sizes_than_verify_curve_ms_is_refused() -> None:
    obj = spec_obj()
    obj["dspark_sps_curve"] = obj["dspark_sps_curve"][:-1] + [[256, 10.0]]
    with pytest.raises(SpsCurveError, match=r"disagree on batch sizes \(x=256 only in dspark_sps_curve; "
                                            r"x=128 only in verify_curve_ms\)"):
        SpsCurve.from_dict(obj, source="c.json")


def test_deleting_verify_curve_ms_makes_the_edited_dspark_sps_curve_count() -> None:
    obj = spec_obj()
    obj["dspark_sps_curve"] = [[t, 2 * s] for t, s in obj["dspark_sps_curve"]]
    del obj["verify_curve_ms"]
    c = SpsCurve.from_dict(obj, source="c.json")
    assert c.step_cost_ms(1, 8, drafting=False) == pytest.approx(11.0 / 2)


def test_agreeing_keys_load_within_float_round_trip_tolerance(tmp_path: Path, curve: SpsCurve) -> None:
    obj = curve.to_dict()
    # A writer that prints floats with 12 significant digits (not the shortest round-trip form).
    obj["dspark_sps_curve"] = [[x, float(f"{s:.12g}")] for x, s in obj["dspark_sps_curve"]]
    assert SpsCurve.from_dict(obj, source="c.json") == curve
    # json (not orjson) round trip of a saved file, with overhead, draft and sampling keys.
    sampled = SpsCurve.from_points([(8, 0.7), (16, 0.9), (64, 3.3)], [(1, 0.1)], 0.37, (8, 16),
                                   draft_sampling_ms=[(1, 0.2)])
    path = tmp_path / "s.json"
    path.write_text(json.dumps(json.loads(orjson.dumps(sampled.to_dict()))))
    assert SpsCurve.load(path) == sampled


def _committed_curve_files() -> list[Path]:
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    out = []
    for path in sorted(results.rglob("*.json")) if results.is_dir() else []:
        raw = path.read_bytes()
        if b"dspark_sps_curve" not in raw:
            continue
        obj = orjson.loads(raw)
        # Only whole curve files: other results (e.g. an engine report) may quote a curve inside them.
        if isinstance(obj, list) or (isinstance(obj, dict) and ("dspark_sps_curve" in obj or "verify_curve_ms" in obj)):
            out.append(path)
    return out


def test_every_committed_curve_file_still_loads() -> None:
    files = _committed_curve_files()
    if not files:
        pytest.skip("no committed sps curves under benchmarks/results")
    for path in files:
        SpsCurve.load(path)


# ---------------------------------------------------------------------------------------------- user's units


def test_dspark_sps_curve_refusals_quote_the_point_the_user_wrote() -> None:
    with pytest.raises(SpsCurveError, match=r"dspark_sps_curve\[0\] must hold numbers, got \['a', 1\]"):
        SpsCurve.from_dict({"dspark_sps_curve": [["a", 1], [8, 100]]}, source="c.json")
    with pytest.raises(SpsCurveError, match=r"dspark_sps_curve\[0\] has x=8.5; x must be a positive integer"):
        SpsCurve.from_dict([[8.5, 100.0], [16, 50.0]], source="c.json")
    with pytest.raises(SpsCurveError, match=r"x=8 twice with different values \(100 and 90 steps/s\)"):
        SpsCurve.from_dict([[8, 100.0], [8, 90.0], [16, 50.0]], source="c.json")


def test_numbers_written_as_text_are_refused_in_every_field_as_in_steps_per_sec() -> None:
    # float() took "8" in the ms fields, so one file loaded where its steps/s twin was refused.
    ok = {"verify_curve_ms": [[8, 1.0], [64, 3.0]], "overhead_ms": 0.5, "capture_sizes": [8, 64]}
    SpsCurve.from_dict(ok, source="c.json")
    for key, bad, match in (("verify_curve_ms", [["8", "1.0"], [64, 3.0]], r"verify_curve_ms\[0\] must hold numbers"),
                            ("overhead_ms", "0.5", "overhead_ms must be a number, got '0.5'"),
                            ("capture_sizes", [8, "64"], "capture_sizes holds text '64'")):
        with pytest.raises(SpsCurveError, match=match):
            SpsCurve.from_dict({**ok, key: bad}, source="c.json")


def test_a_rising_steps_per_sec_curve_is_refused_in_steps_per_sec() -> None:
    with pytest.raises(SpsCurveError) as info:
        SpsCurve.from_dict({"dspark_sps_curve": [[1, 10], [8, 100]]}, source="c.json")
    msg = str(info.value)
    assert "100 steps/s at x=8 is 900% above 10 steps/s at x=1" in msg
    assert " ms" not in msg
    with pytest.raises(SpsCurveError) as info:
        SpsCurve.from_dict([[8, 100.0], [16, 99.9], [64, 99.8]], source="c.json")
    assert "steps/s falls only 0.20% from 8 to 64 tokens" in str(info.value) and " ms" not in str(info.value)


def test_a_steps_per_sec_point_faster_than_the_overhead_is_quoted_as_written() -> None:
    with pytest.raises(SpsCurveError, match=r"says 100 steps/s at x=8, a step of 10 ms: faster than "
                                            r"overhead_ms=15 alone"):
        SpsCurve.from_dict({"dspark_sps_curve": [[8, 100.0], [16, 50.0]], "overhead_ms": 15.0}, source="c.json")


# ---------------------------------------------------------------------------------------------- fix hints


def test_the_fix_hint_fits_where_the_curve_came_from(tmp_path: Path) -> None:
    flat = [[8, 100.0], [16, 100.0]]
    with pytest.raises(SpsCurveError) as info:
        SpsCurve.from_dict(flat, source="--speculative-config dspark_sps_curve")
    assert "fix the file" not in str(info.value) and "fix the inline curve" in str(info.value)
    with pytest.raises(SpsCurveError, match="or fix the file"):
        SpsCurve.load(write(tmp_path, flat))
    with pytest.raises(SpsCurveError, match="or fix the file"):
        SpsCurve.from_dict(flat, source="sps_curve.json")
    with pytest.raises(SpsCurveError) as info:
        SpsCurve.from_points([(8, 10.0), (16, 10.0)], source="profiled SPS curve")
    assert str(info.value).endswith("re-profile with `dspark profile-sps`")


def test_step_cost_cache_separates_sampling_from_greedy() -> None:
    """A greedy lookup must not answer a later sampling one."""
    curve = SpsCurve.from_points([(8, 10.0), (64, 20.0)], draft_ms=[(1, 1.0), (16, 3.0)],
                                 draft_sampling_ms=[(1, 2.0), (16, 6.0)])
    greedy = curve.step_cost_ms(4, 12)
    sampled = curve.step_cost_ms(4, 12, sampling=True)
    assert sampled == pytest.approx(float(curve.step_cost_ms(np.array(4), np.array(12), sampling=True)))
    assert sampled > greedy
    assert curve.step_cost_ms(4, 12, drafting=False) < greedy


def test_an_sps_edit_of_half_a_percent_is_refused() -> None:
    """An edit to dspark_sps_curve that moves a step's price by 0.5% must not pass as 'the same' as verify_curve_ms;
    four-digit rounding still does."""
    verify = [[8, 10.0], [16, 12.0]]
    ok = {"verify_curve_ms": verify, "dspark_sps_curve": [[8, 100.0], [16, 83.33]]}
    SpsCurve.from_dict(ok)
    edited = {"verify_curve_ms": verify, "dspark_sps_curve": [[8, 100.5], [16, 83.33]]}
    with pytest.raises(SpsCurveError, match="disagree"):
        SpsCurve.from_dict(edited)


def test_budget_cost_tables_are_the_step_costs_cached_and_read_only() -> None:
    """choose_budget's price of every budget: step_cost_ms over base + per_slot x arange(n + 1), computed once per
    argument set (a steady load repeats them every drafting step) and never writable by a caller."""
    curve = SpsCurve.from_points([(8, 10.0), (64, 20.0), (256, 60.0)], draft_ms=[(1, 1.0), (16, 3.0)],
                                 draft_sampling_ms=[(1, 2.0), (16, 6.0)], capture_sizes=[8, 16, 32, 64])
    for per_slot, sampling in ((1.0, False), (2.5, True)):
        table = curve.budget_costs_ms(16, 16, 112, per_slot, sampling)
        expected = curve.step_cost_ms(16, 16 + per_slot * np.arange(113), sampling=sampling)
        assert table.shape == (113,) and np.array_equal(table, expected)
        assert curve.budget_costs_ms(16, 16, 112, per_slot, sampling) is table  # cached
        with pytest.raises(ValueError):
            table[0] = 0.0
    assert not np.array_equal(curve.budget_costs_ms(16, 16, 112, 1.0, True), curve.budget_costs_ms(16, 16, 112))
