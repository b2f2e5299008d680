"""`dspark serve` settings: flags and the seed's --speculative-config JSON merge into ServeSettings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_cli.engines.vllm.config import DsparkVllmSettings, settings_from_seed_keys
from dspark_cli.errors import DsparkError
from dspark_cli.serve_config import (
    DSPARK_KEYS,
    ServeSettings,
    build_settings,
    ineffective_settings,
    prepare_embedded,
)

SEED_CURVE = [[8, 120.0], [16, 110.0], [32, 90.0], [64, 60.0], [128, 35.0]]


def _flags(**kw: object) -> dict[str, object]:
    return kw


def test_defaults_without_flags_or_json() -> None:
    s = build_settings({})
    assert s == ServeSettings()
    assert s.model == "smollm2-135m" and s.draft == "auto" and s.capacity_mode == "none"
    assert (s.host, s.port, s.engine) == ("127.0.0.1", 8000, "embedded")


def test_seed_varlen_sps_config_maps_onto_settings() -> None:
    spec = {"method": "dspark", "model": "my/draft", "attention_backend": "FLASH_ATTN", "num_speculative_tokens": 7,
            "draft_sample_method": "probabilistic", "dspark_confidence_threshold": 0.0,
            "dspark_capacity_verification_mode": "varlen", "dspark_sps_curve": SEED_CURVE, "dspark_online_sts": True}
    s = build_settings({}, json.dumps(spec))
    assert s.draft == "my/draft" and s.num_speculative_tokens == 7
    assert s.capacity_mode == "varlen" and s.capacity_policy == "argmax"
    assert s.sps_curve_points == tuple((t, v) for t, v in SEED_CURVE) and s.sps_curve is None
    assert s.online_sts is True and s.method == "dspark"
    # vLLM's own keys survive for the vLLM launcher; dspark_* keys do not go back into SpeculativeConfig.
    assert s.vllm_speculative_config == {"method": "dspark", "model": "my/draft", "attention_backend": "FLASH_ATTN",
                                         "num_speculative_tokens": 7, "draft_sample_method": "probabilistic"}


def test_compact_is_an_alias_of_varlen_and_threshold_selects_policy() -> None:
    s = build_settings({}, json.dumps({"dspark_capacity_verification_mode": "compact",
                                       "dspark_confidence_threshold": 0.4, "num_speculative_tokens": 3}))
    assert s.capacity_mode == "varlen"
    assert s.capacity_policy == "threshold" and s.confidence_threshold == pytest.approx(0.4)


def test_dspark_keys_without_mode_imply_varlen_but_seed_baseline_stays_off() -> None:
    assert build_settings({}, json.dumps({"dspark_budget_frac": 0.5})).capacity_mode == "varlen"
    baseline = {"method": "dspark", "model": "d", "num_speculative_tokens": 7}
    assert build_settings({}, json.dumps(baseline)).capacity_mode == "none"


def test_explicit_flags_win_over_json() -> None:
    spec = json.dumps({"dspark_capacity_verification_mode": "varlen", "num_speculative_tokens": 7,
                       "dspark_budget_frac": 0.5, "model": "json-draft", "dspark_sps_curve": SEED_CURVE})
    # --draft none wins over the JSON's draft model, which makes a capacity mode inconsistent:
    with pytest.raises(DsparkError, match="needs speculation"):
        build_settings(_flags(capacity_mode="mask", draft="none"), spec)
    s = build_settings(_flags(capacity_mode="mask", num_speculative_tokens=2, budget_frac=0.9), spec)
    assert (s.capacity_mode, s.num_speculative_tokens, s.budget_frac, s.draft) == ("mask", 2, 0.9, "json-draft")


def test_explicit_curve_file_replaces_inline_curve(tmp_path: Path) -> None:
    curve = tmp_path / "c.json"
    curve.write_text(json.dumps(SEED_CURVE))
    s = build_settings(_flags(sps_curve=str(curve)), json.dumps({"dspark_sps_curve": SEED_CURVE}))
    assert s.sps_curve == str(curve) and s.sps_curve_points is None


def test_curve_path_and_auto_in_json(tmp_path: Path) -> None:
    curve = tmp_path / "sps_curve.json"
    curve.write_text(json.dumps(SEED_CURVE))
    assert build_settings({}, json.dumps({"dspark_sps_curve": str(curve)})).sps_curve == str(curve)
    assert build_settings({}, json.dumps({"dspark_sps_curve": "auto"})).sps_curve == "auto"
    with pytest.raises(DsparkError, match="does not exist"):
        build_settings({}, json.dumps({"dspark_sps_curve": str(tmp_path / "missing.json")}))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"dspark_capacity_mode": "varlen"}', "unknown key"),
        ('{"dspark_budget_frac": 0}', "dspark_budget_frac: must be > 0"),
        ('{"dspark_budget_frac": 1.5}', "must be <= 1"),
        ('{"dspark_capacity_verification_mode": "fast"}', "expected one of"),
        ('{"dspark_online_sts": "yes"}', "expected true or false"),
        ('{"dspark_sps_curve": []}', "non-empty list"),
        ('{"dspark_sps_curve": [[8, 0]]}', "must be > 0"),
        ('{"dspark_sps_curve": [[8]]}', "pair"),
        ('{"num_speculative_tokens": -1}', "must be >= 0"),
        ('{"num_speculative_tokens": 2.5}', "expected an integer"),
        ('{"dspark_confidence_threshold": 2}', "must be <= 1"),
        ('{"dspark_sps_overhead_ms": -1}', "must be >= 0"),
        ('{"method": "ngram"}', "not supported by the embedded engine"),
    ],
)
def test_bad_speculative_config_is_one_line_error(spec: str, match: str) -> None:
    with pytest.raises(DsparkError, match=match) as info:
        build_settings({}, spec)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("--speculative-config")


def test_unknown_key_error_lists_known_keys() -> None:
    with pytest.raises(DsparkError) as info:
        build_settings({}, '{"dspark_sps_curv": "auto"}')
    assert "dspark_sps_curv" in str(info.value) and DSPARK_KEYS[0] in str(info.value)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"engine": "tgi"}, "--engine"),
        ({"capacity_mode": "full"}, "--capacity-mode"),
        ({"port": 70000}, "--port"),
        ({"budget_frac": 0.0}, "--budget-frac"),
        ({"min_predicted_gain": -0.1}, "--min-predicted-gain"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"scheduler_delay_factor": -0.5}, "--scheduler-delay-factor"),
        ({"gpu_memory_utilization": 0.0}, "--gpu-memory-utilization"),
        ({"attention_backend": "flash"}, "--attention-backend"),
        ({"phase_timing": "cpu"}, "--phase-timing"),
        ({"device": "tpu"}, "--device"),
        ({"sts": "/nonexistent/sts.json"}, "--sts"),
        ({"capacity_policy": "threshold", "capacity_mode": "varlen"}, "needs --confidence-threshold"),
    ],
)
def test_bad_flags_are_one_line_errors(flags: dict[str, object], match: str) -> None:
    with pytest.raises(DsparkError, match=match):
        build_settings(flags)


def test_offline_temperatures_start_the_online_fit(tmp_path: Path) -> None:
    """Both engines seed online STS with offline temperatures (its prior); the command line refused the pair."""
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"version": 1, "temperatures": [1.0, 1.2, 1.4, 1.6]}))
    assert build_settings(_flags(sts=str(sts))).sts == str(sts)
    launch = prepare_embedded(build_settings(_flags(sts=str(sts), online_sts=True, capacity_mode="varlen",
                                                    sps_curve="auto")))
    launch.cleanup()
    assert launch.engine_config.sts == str(sts) and launch.engine_config.online_sts


def test_confidence_threshold_flag_selects_threshold_policy() -> None:
    s = build_settings(_flags(confidence_threshold=0.3))
    assert (s.capacity_mode, s.capacity_policy, s.confidence_threshold) == ("varlen", "threshold", 0.3)


def test_dspark_keys_round_trip_for_the_vllm_launcher() -> None:
    spec = {"dspark_capacity_verification_mode": "mask", "dspark_sps_curve": SEED_CURVE,
            "dspark_sps_overhead_ms": 1.5, "dspark_budget_frac": 0.75, "dspark_online_sts": True,
            "dspark_min_predicted_gain": 0.05, "dspark_saturation_patience": 0, "dspark_resume_every": 4,
            "dspark_probe_tax": 0.25, "dspark_sts_refit_interval": 32, "dspark_policy": "paper"}
    s = build_settings(_flags(engine="vllm"), json.dumps(spec))
    keys = s.dspark_keys()
    again = build_settings(_flags(engine="vllm"), json.dumps({k: v for k, v in keys.items() if k in DSPARK_KEYS}))
    assert again.dspark_keys() == keys
    assert keys["dspark_capacity_verification_mode"] == "mask" and keys["dspark_sps_overhead_ms"] == 1.5
    assert keys["dspark_policy"] == "paper" and keys["dspark_sts_refit_interval"] == 32
    assert set(keys) <= set(DSPARK_KEYS)


def test_a_null_min_predicted_gain_is_the_cores_default_on_both_engines() -> None:
    """``"dspark_min_predicted_gain": null`` means the core's default (CapacityConfig.trim_margin), as the vLLM
    plugin reads it; the embedded path refused it as "expected a number"."""
    spec = {"dspark_capacity_verification_mode": "varlen", "dspark_sps_curve": SEED_CURVE,
            "dspark_min_predicted_gain": None}
    s = build_settings({}, json.dumps(spec))
    assert s.min_predicted_gain is None and "dspark_min_predicted_gain" not in s.dspark_keys()
    launch = prepare_embedded(s)
    launch.cleanup()
    assert launch.engine_config.capacity.min_predicted_gain is None
    launch = prepare_embedded(build_settings({}, json.dumps({**spec, "dspark_min_predicted_gain": 0.1})))
    launch.cleanup()
    assert launch.engine_config.capacity.trim_margin == 0.1


def test_saturation_settings_reach_the_capacity_config() -> None:
    spec = {"dspark_capacity_verification_mode": "varlen", "dspark_sps_curve": SEED_CURVE,
            "dspark_saturation_patience": 0, "dspark_resume_every": 5, "dspark_policy": "paper"}
    launch = prepare_embedded(build_settings({}, json.dumps(spec)))
    launch.cleanup()
    cap = launch.engine_config.capacity
    assert (cap.saturation_patience, cap.resume_every, cap.policy) == (0, 5, "paper")
    launch = prepare_embedded(build_settings({}, json.dumps({**spec, "dspark_probe_tax": 0.5})))
    launch.cleanup()
    assert launch.engine_config.capacity.probe_tax == 0.5
    with pytest.raises(DsparkError, match="dspark_probe_tax: must be <= 1"):
        build_settings({}, json.dumps({**spec, "dspark_probe_tax": 2}))
    with pytest.raises(DsparkError, match="only supported by --engine vllm"):
        build_settings({}, json.dumps({"dspark_sts_refit_interval": 8}))


def test_probe_scout_reaches_both_engines_and_is_moot_in_mask_mode() -> None:
    spec = {"dspark_capacity_verification_mode": "varlen", "dspark_sps_curve": SEED_CURVE, "dspark_probe_scout": True}
    launch = prepare_embedded(build_settings({}, json.dumps(spec)))
    launch.cleanup()
    assert launch.engine_config.capacity.probe_scout is True
    s = build_settings(_flags(engine="vllm"), json.dumps(spec))
    assert s.dspark_keys()["dspark_probe_scout"] is True
    assert DsparkVllmSettings.from_dict(settings_from_seed_keys(s.dspark_keys())).capacity_config().probe_scout
    # a bench matrix's mask column shares the speculative config: a warning, and a mask server without scouts
    mask = build_settings({}, json.dumps({**spec, "dspark_capacity_verification_mode": "mask"}))
    assert any(w.startswith("dspark_probe_scout: no effect with --capacity-mode mask") for w in ineffective_settings(mask))
    launch = prepare_embedded(mask)
    launch.cleanup()
    assert launch.engine_config.capacity.mode == "mask" and not launch.engine_config.capacity.probe_scout
    assert not ineffective_settings(build_settings({}, json.dumps(spec)))
    with pytest.raises(DsparkError, match="dspark_probe_scout: expected true or false"):
        build_settings({}, json.dumps({**spec, "dspark_probe_scout": 1}))


@pytest.mark.parametrize(("name", "given", "default"), [
    ("scheduler_delay_factor", 1.5, 0.0),  # the engine's default: no hold
    ("gpu_memory_utilization", 0.85, 0.5),  # the engine's default share of free memory
])
def test_an_embedded_setting_reaches_the_engine_config(name: str, given: float, default: float) -> None:
    launch = prepare_embedded(build_settings(_flags(**{name: given})))
    launch.cleanup()
    assert getattr(launch.engine_config, name) == given
    launch = prepare_embedded(build_settings({}))
    launch.cleanup()
    assert getattr(launch.engine_config, name) == default


def test_attention_backend_reaches_the_engine_config() -> None:
    from dspark_cli.engines.embedded.attention import BACKENDS
    from dspark_cli.serve_config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS  # the CLI's list (kept free of torch imports) is the engine's
    launch = prepare_embedded(build_settings(_flags(attention_backend="triton")))
    launch.cleanup()
    assert launch.engine_config.attention_backend == "triton"
    launch = prepare_embedded(build_settings({}))
    launch.cleanup()
    assert launch.engine_config.attention_backend == "auto"


def test_phase_timing_reaches_the_engine_config_and_the_banner() -> None:
    from dspark_cli.engines.embedded.config import PHASE_TIMINGS, EngineConfig
    from dspark_cli.serve_config import PHASE_TIMINGS as SERVE_PHASE_TIMINGS

    assert SERVE_PHASE_TIMINGS == PHASE_TIMINGS  # the CLI's list (kept free of torch imports) is the engine's
    launch = prepare_embedded(build_settings(_flags(phase_timing="gpu")))
    launch.cleanup()
    assert launch.engine_config.phase_timing == "gpu"
    assert ("phase timing", "gpu (dspark:step_phase_seconds_total)") in launch.banner
    launch = prepare_embedded(build_settings({}))
    launch.cleanup()
    assert launch.engine_config.phase_timing is None
    assert all(key != "phase timing" for key, _ in launch.banner)
    with pytest.raises(DsparkError, match="unknown phase timing 'wall'"):
        EngineConfig(phase_timing="wall").validate()


def test_mixed_prefill_reaches_the_engine_config_and_the_banner() -> None:
    launch = prepare_embedded(build_settings(_flags(mixed_prefill=False)))
    launch.cleanup()
    assert launch.engine_config.mixed_prefill is False
    assert ("prefills", "steps of their own (--no-mixed-prefill)") in launch.banner
    for flags in ({}, _flags(mixed_prefill=True)):
        launch = prepare_embedded(build_settings(flags))
        launch.cleanup()
        assert launch.engine_config.mixed_prefill is True  # the engine's default
        assert all(key != "prefills" for key, _ in launch.banner)


def test_prepare_embedded_writes_inline_curve_with_overhead(tmp_path: Path) -> None:
    from dspark_cli.core.sps import SpsCurve

    spec = {"dspark_capacity_verification_mode": "varlen", "dspark_sps_curve": SEED_CURVE,
            "dspark_sps_overhead_ms": 2.0, "num_speculative_tokens": 3}
    launch = prepare_embedded(build_settings(_flags(port=1234), json.dumps(spec)))
    try:
        cfg = launch.engine_config
        assert cfg.capacity.mode == "varlen" and cfg.num_speculative_tokens == 3
        curve = SpsCurve.load(cfg.sps_curve)
        assert curve.overhead_ms == pytest.approx(2.0)
        assert [x for x, _ in curve.verify_ms] == [t for t, _ in SEED_CURVE]
        assert launch.options.port == 1234 and launch.options.num_speculative_tokens == 3
        assert dict(launch.banner)["url"] == "http://127.0.0.1:1234/v1"
        tmpdir = launch.tmpdir
    finally:
        launch.cleanup()
    assert tmpdir is not None and not tmpdir.exists()


def test_prepare_embedded_refuses_an_inert_curve_before_loading_anything() -> None:
    flat = [[8, 100.0], [16, 100.0], [32, 100.0]]
    with pytest.raises(DsparkError, match="dspark_sps_curve"):
        prepare_embedded(build_settings({}, json.dumps({"dspark_sps_curve": flat})))


def test_prepare_embedded_needs_a_curve_for_sps_policies() -> None:
    with pytest.raises(DsparkError, match="needs an SPS curve"):
        prepare_embedded(build_settings(_flags(capacity_mode="mask")))
    launch = prepare_embedded(build_settings(_flags(capacity_mode="mask", confidence_threshold=0.5)))
    launch.cleanup()
    assert launch.engine_config.capacity.policy == "threshold"


def test_prepare_embedded_no_draft_means_no_speculation() -> None:
    launch = prepare_embedded(build_settings(_flags(draft="none")))
    launch.cleanup()
    assert launch.engine_config.draft is None and launch.engine_config.num_speculative_tokens == 0
    launch = prepare_embedded(build_settings(_flags(num_speculative_tokens=0)))
    launch.cleanup()
    assert launch.engine_config.draft is None


def test_static_confidence_temperature_becomes_uniform_sts(tmp_path: Path) -> None:
    from dspark_cli.core.sts import load_sts

    launch = prepare_embedded(build_settings(_flags(num_speculative_tokens=3),
                                             json.dumps({"dspark_confidence_temperature": 2.0})))
    try:
        assert load_sts(launch.engine_config.sts, num_positions=3) == (2.0, 2.0, 2.0)
    finally:
        launch.cleanup()


def test_without_speculation_capacity_settings_are_moot_not_an_error(tmp_path: Path) -> None:
    """bench's nospec column shares the other columns' --serve-args (a curve, traces): -k 0 must still serve,
    saying what will not act; an explicit capacity mode without speculation stays an error."""
    from dspark_cli.serve_config import ineffective_settings

    curve = tmp_path / "c.json"
    curve.write_text(json.dumps({"dspark_sps_curve": SEED_CURVE}))
    s = build_settings(_flags(num_speculative_tokens=0, sps_curve=str(curve), record_traces="t.jsonl"))
    assert s.capacity_mode == "none"
    assert ineffective_settings(s) == ["--sps-curve, --record-traces: no effect without speculation "
                                       "(-k 0 or --draft none)"]
    # the saturation policy's keys too: with -k 0 they were dropped without a word
    keys = {"dspark_saturation_patience": 3, "dspark_probe_sample": 8}
    assert ineffective_settings(build_settings(_flags(num_speculative_tokens=0), json.dumps(keys))) == [
        "dspark_saturation_patience, dspark_probe_sample: no effect without speculation (-k 0 or --draft none)"]
    with pytest.raises(DsparkError, match="--capacity-mode varlen needs speculation"):
        build_settings(_flags(num_speculative_tokens=0, capacity_mode="varlen"))
    sts = tmp_path / "sts.json"
    sts.write_text('{"version": 1, "temperatures": [1, 1, 1, 1]}')
    assert "--sts: no effect with --capacity-mode none" in ineffective_settings(build_settings(_flags(sts=str(sts))))[0]
    assert ineffective_settings(build_settings(_flags(sts=str(sts), capacity_mode="varlen"))) == []


def test_the_overhead_override_reaches_an_auto_curve_and_is_said_moot_without_a_curve() -> None:
    """--sps-overhead-ms was dropped without a word with --sps-curve auto (the engine profiles the curve later)
    and with the threshold policy, which needs no curve."""
    from dspark_cli.serve_config import ineffective_settings

    s = build_settings(_flags(sps_curve="auto", sps_overhead_ms=5.0))
    launch = prepare_embedded(s)
    launch.cleanup()
    assert launch.engine_config.sps_curve == "auto" and launch.engine_config.sps_overhead_ms == 5.0
    assert ineffective_settings(s) == []
    threshold = build_settings(_flags(confidence_threshold=0.5, sps_overhead_ms=5.0))
    assert threshold.capacity_mode != "none"
    assert ineffective_settings(threshold) == ["--sps-overhead-ms: no effect without an SPS curve (the threshold "
                                               "policy prices nothing); pass --sps-curve FILE or auto for it to act"]


def test_a_folder_given_for_a_file_is_named_as_one(tmp_path: Path) -> None:
    with pytest.raises(DsparkError, match="--sps-curve: .* is a folder; name the file"):
        build_settings(_flags(sps_curve=str(tmp_path)))
    with pytest.raises(DsparkError, match="dspark_sts: .* is a folder"):
        build_settings({}, json.dumps({"dspark_sts": str(tmp_path)}))


def test_a_curve_profiled_at_another_k_is_flagged(tmp_path: Path) -> None:
    from dspark_cli.core.sps import SpsCurve

    curve = SpsCurve.from_dict(SEED_CURVE)
    path = tmp_path / "c.json"
    SpsCurve(curve.verify_ms, overhead_ms=curve.overhead_ms, meta={"k": 4}).save(path)
    launch = prepare_embedded(build_settings(_flags(num_speculative_tokens=7, sps_curve=str(path))))
    launch.cleanup()
    assert launch.warnings == ["the SPS curve was profiled at k=4 and this server drafts k=7; profile it again "
                               "with `dspark profile-sps ... -k 7`"]
    launch = prepare_embedded(build_settings(_flags(num_speculative_tokens=4, sps_curve=str(path))))
    launch.cleanup()
    assert launch.warnings == []


def test_a_flag_that_overrides_the_json_is_said() -> None:
    s = build_settings(_flags(num_speculative_tokens=3), json.dumps({"num_speculative_tokens": 5}))
    assert s.num_speculative_tokens == 3
    assert "--num-speculative-tokens 3 overrides 5 from --speculative-config (flags win)" in ineffective_settings(s)
    same = build_settings(_flags(num_speculative_tokens=5), json.dumps({"num_speculative_tokens": 5}))
    assert not any("overrides" in w for w in ineffective_settings(same))


def test_a_draft_length_without_a_draft_and_a_threshold_under_another_policy_are_said() -> None:
    # `--draft none -k 4` served k=0, and `--capacity-policy paper --confidence-threshold 0.5` dropped the threshold,
    # both without a word
    s = build_settings(_flags(draft="none", num_speculative_tokens=4))
    assert "-k 4: no effect with --draft none, which serves without speculation (pass a draft model for it to act)" \
        in ineffective_settings(s)
    assert not ineffective_settings(build_settings(_flags(draft="none", num_speculative_tokens=0)))
    s = build_settings(_flags(capacity_mode="varlen", sps_curve="auto", capacity_policy="paper",
                              confidence_threshold=0.5))
    assert any(w.startswith("--confidence-threshold 0.5: no effect with --capacity-policy paper")
               for w in ineffective_settings(s))
    alone = build_settings(_flags(capacity_mode="varlen", confidence_threshold=0.5))
    assert alone.capacity_policy == "threshold" and not ineffective_settings(alone)
