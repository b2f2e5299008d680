"""`dspark serve --engine vllm`: dspark_* keys and toolkit flags -> --additional-config; the rest untouched."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark_cli.engines.vllm.config import (
    EMBEDDED_ONLY_KEYS,
    SEED_KEYS,
    DsparkVllmSettings,
    settings_from_seed_keys,
)
from dspark_cli.engines.vllm.launcher import build_vllm_serve_command, plan_vllm_serve, run_vllm_serve
from dspark_cli.errors import DsparkError

BASE = '{"method":"dspark","model":"deepseek-ai/DeepSeek-V4-Flash-DSpark","num_speculative_tokens":7}'


def _spec(**extra: object) -> str:
    obj = json.loads(BASE)
    obj.update(extra)
    return json.dumps(obj)


def _flag(cmd: list[str], name: str) -> dict:
    return json.loads(cmd[cmd.index(name) + 1])


def test_no_dspark_setting_passes_everything_through_untouched() -> None:
    args = ["m", "--port", "8011", "--speculative-config", BASE, "--kv-cache-dtype", "fp8", "--", "--x"]
    assert build_vllm_serve_command(args) == ["vllm", "serve", *args]


def test_seed_keys_move_to_additional_config() -> None:
    args = ["m", "--tensor-parallel-size", "4", "--speculative-config",
            _spec(dspark_confidence_threshold=0.0, dspark_capacity_verification_mode="varlen",
                  dspark_sps_curve=[[8, 120.0], [16, 110.0]], dspark_online_sts=True), "--port", "8011"]
    cmd = build_vllm_serve_command(args)
    assert cmd[:5] == ["vllm", "serve", "m", "--tensor-parallel-size", "4"]
    spec = _flag(cmd, "--speculative-config")
    assert not any(k.startswith("dspark_") for k in spec)
    assert spec["enable_adaptive_verification"] is True and spec["num_speculative_tokens"] == 7
    dspark = _flag(cmd, "--additional-config")["dspark"]
    assert dspark == {"mode": "varlen", "sps_curve": [[8, 120.0], [16, 110.0]], "online_sts": True}
    assert cmd[cmd.index("--port") + 1] == "8011"
    assert DsparkVllmSettings.from_additional_config(_flag(cmd, "--additional-config")).online_sts is True


def test_compact_alias_threshold_policy_and_flag_precedence(tmp_path: Path) -> None:
    spec = _spec(dspark_capacity_verification_mode="compact", dspark_confidence_threshold=0.4, dspark_budget_frac=0.5)
    cmd = build_vllm_serve_command(["m", "-sc", spec, "--budget-frac", "0.25", "--capacity-mode=mask"])
    dspark = _flag(cmd, "--additional-config")["dspark"]
    assert dspark["mode"] == "mask" and dspark["policy"] == "threshold" and dspark["threshold"] == 0.4
    assert dspark["budget_frac"] == 0.25
    assert "-sc" in cmd  # the user's spelling of the flag is kept


def test_user_additional_config_is_merged_not_replaced() -> None:
    extra = json.dumps({"other_plugin": {"a": 1}, "dspark": {"saturation_patience": 0}})
    cmd = build_vllm_serve_command(["m", "--additional-config", extra, "--speculative-config",
                                    _spec(dspark_capacity_verification_mode="mask")])
    add = _flag(cmd, "--additional-config")
    assert add["other_plugin"] == {"a": 1}
    assert add["dspark"] == {"mode": "mask", "saturation_patience": 0}


def test_files_are_checked_and_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark_cli.core.sps import SpsCurve
    from dspark_cli.core.sts import load_sts  # noqa: F401  (the reader the launcher uses)

    SpsCurve.from_points([(8, 5.0), (16, 6.0), (32, 8.0)], capture_sizes=[8, 16, 32]).save(tmp_path / "c.json")
    (tmp_path / "sts.json").write_text(json.dumps({"version": 1, "temperatures": [1.5] * 7}))
    monkeypatch.chdir(tmp_path)
    cmd = build_vllm_serve_command(["m", "--speculative-config", BASE, "--sps-curve", "c.json", "--sts", "sts.json",
                                    "--record-traces", "t/traces.jsonl"])
    dspark = _flag(cmd, "--additional-config")["dspark"]
    assert dspark["sps_curve"] == str(tmp_path / "c.json")
    assert dspark["sts"] == str(tmp_path / "sts.json")
    assert dspark["record_traces"] == str(tmp_path / "t" / "traces.jsonl")
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(DsparkError):
        build_vllm_serve_command(["m", "--speculative-config", BASE, "--sps-curve", "bad.json"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["m", "--speculative-config", _spec(dspark_sps_curv=[[1, 2]])], "unknown key"),
        (["m", "--speculative-config", _spec(dspark_capacity_verification_mode="fast")], "mode"),
        (["m", "--speculative-config", _spec(dspark_budget_frac=0)], "budget_frac"),
        (["m", "--speculative-config", _spec(dspark_draft_catchup_tokens=-1)], "draft_catchup_tokens"),
        (["m", "--capacity-mode", "mask"], "speculative"),
        (["m", "--speculative-config", "[1]"], "JSON object"),
        (["m", "--speculative-config", "{nope"], "not valid JSON"),
        (["m", "--speculative-config", BASE, "--budget-frac"], "needs a value"),
        (["m", "--speculative-config", BASE, "--saturation-patience", "x"], "integer"),
        (["m", "--speculative-config", BASE, "--additional-config", '{"dspark": {"modes": "mask"}}'], "unknown key"),
        (["m", "--speculative-config", BASE, "--capacity-mode", "none", "--record-traces", "t.jsonl"], "capacity mode"),
    ],
)
def test_bad_input_is_one_clear_error(args: list[str], message: str) -> None:
    with pytest.raises(DsparkError, match=message) as err:
        build_vllm_serve_command(args)
    assert "\n" not in str(err.value)


def test_mode_none_strips_our_keys_and_keeps_upstream() -> None:
    spec = _spec(enable_adaptive_verification=True, dspark_capacity_verification_mode="none")
    plan = plan_vllm_serve(["m", "--speculative-config", spec])
    assert plan.settings is None
    assert plan.speculative_config == json.loads(BASE) | {"enable_adaptive_verification": True}
    assert "--additional-config" not in plan.argv


def test_dry_run_prints_the_exact_shell_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["m", "--speculative-config", _spec(dspark_capacity_verification_mode="varlen")]
    assert run_vllm_serve(args, dry_run=True) == 0
    line = capsys.readouterr().out.strip()
    assert shlex.split(line) == build_vllm_serve_command(args)


def test_seed_translation_covers_every_key_the_cli_knows() -> None:
    """serve_config (the embedded engine's reader) and the vLLM launcher must know the same dspark_* keys: each
    reads every key but the other engine's alone, which it refuses by name."""
    serve_config = pytest.importorskip("dspark_cli.serve_config")
    assert set(serve_config.DSPARK_KEYS) == set(SEED_KEYS) | set(EMBEDDED_ONLY_KEYS)
    assert {f"dspark_{name}" for name in serve_config.EMBEDDED_ONLY_FIELDS} == set(EMBEDDED_ONLY_KEYS)
    out = settings_from_seed_keys({"dspark_sps_curve": "auto", "dspark_confidence_threshold": 0.0})
    assert out["sps_curve"] is None and "policy" not in out


def test_the_draft_catch_up_budget_travels_to_the_workers() -> None:
    plan = plan_vllm_serve(["m", "--speculative-config", _spec(dspark_capacity_verification_mode="varlen",
                                                               dspark_draft_catchup_tokens=0)])
    assert plan.settings.draft_catchup_tokens == 0  # 0: the draft's K/V kept current on every paused step
    assert _flag(plan.argv, "--additional-config")["dspark"]["draft_catchup_tokens"] == 0
    assert DsparkVllmSettings().draft_catchup_tokens == 2048


def test_the_probe_tax_travels_to_the_workers_and_the_capacity_config() -> None:
    from dspark_cli.core.capacity import CapacityConfig

    plan = plan_vllm_serve(["m", "--speculative-config", _spec(dspark_capacity_verification_mode="varlen",
                                                               dspark_probe_tax=1.0)])
    assert _flag(plan.argv, "--additional-config")["dspark"]["probe_tax"] == 1.0
    assert plan.settings.capacity_config().probe_tax == 1.0
    assert DsparkVllmSettings().capacity_config().probe_tax == CapacityConfig().probe_tax  # None: the core's
    for bad in (0.0, 1.5, True):
        with pytest.raises(DsparkError, match="probe_tax"):
            DsparkVllmSettings(probe_tax=bad)


def test_mask_compacts_its_paused_steps_unless_told_not_to() -> None:
    """Compacted paused steps are mask's default (lossless with real weights on the H200); the seed key turns
    them off, and only the non-default value travels to the workers."""
    assert DsparkVllmSettings().mask_paused_compact is True
    off = plan_vllm_serve(["m", "--speculative-config", _spec(dspark_capacity_verification_mode="mask",
                                                              dspark_mask_paused_compact=False)])
    assert off.settings.mask_paused_compact is False
    assert _flag(off.argv, "--additional-config")["dspark"]["mask_paused_compact"] is False
    on = plan_vllm_serve(["m", "--speculative-config", _spec(dspark_capacity_verification_mode="mask")])
    assert on.settings.mask_paused_compact is True
    assert "mask_paused_compact" not in _flag(on.argv, "--additional-config")["dspark"]


def test_settings_round_trip_through_additional_config() -> None:
    s = DsparkVllmSettings(mode="mask", policy="paper", budget_frac=0.5, online_sts=True, overhead_ms=1.5,
                           sps_curve=[[8, 100.0]], saturation_patience=0)
    back = DsparkVllmSettings.from_additional_config({"dspark": s.to_dict(), "x": 1})
    assert back == s
    assert DsparkVllmSettings.from_additional_config({"x": 1}) is None
    assert DsparkVllmSettings(mode="varlen").to_dict() == {"mode": "varlen"}


def test_parsed_serve_settings_take_the_same_translation(capsys: pytest.CaptureFixture[str]) -> None:
    serve_config = pytest.importorskip("dspark_cli.serve_config")
    settings = serve_config.build_settings({"engine": "vllm", "model": "m", "port": 8011, "capacity_mode": "mask"},
                                           _spec(dspark_online_sts=True))
    assert run_vllm_serve(settings, ["--kv-cache-dtype", "fp8"], dry_run=True) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[:3] == ["vllm", "serve", "m"] and cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    assert _flag(cmd, "--speculative-config")["enable_adaptive_verification"] is True
    dspark = _flag(cmd, "--additional-config")["dspark"]
    assert dspark["mode"] == "mask" and dspark["online_sts"] is True


@pytest.mark.parametrize("path", ["/models/dspark-draft", "/cache/DSpark/x", "/m/my-dflash", "/m/EAGLE3-x"])
def test_draft_paths_that_would_flip_the_method_are_refused(path: str) -> None:
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 4,
            "dspark_capacity_verification_mode": "varlen"}
    with pytest.raises(DsparkError, match="picks the speculative method from the draft's path"):
        plan_vllm_serve(["M", "--speculative-config", json.dumps(spec)])
    # methods vLLM keeps as given are fine with any path
    spec["method"] = "dspark"
    assert plan_vllm_serve(["M", "--speculative-config", json.dumps(spec)]).settings is not None


def test_profiler_prices_sizes_above_the_capture_limit() -> None:
    from dspark_cli.engines.vllm.contract import profile_sizes

    assert profile_sizes([8, 16, 512], 8192) == [8, 16, 512, 768, 1024, 2048, 4096, 8192]
    assert profile_sizes([8, 16, 512], 600) == [8, 16, 512, 600]
    assert profile_sizes([8, 512], 512) == [8, 512] and profile_sizes([], 8192) == []


def test_profiler_is_called_by_name_through_a_worker_extension() -> None:
    """vLLM's engine-core bus refuses to serialise a function (the first H200 profile run died on it): the
    profiler must reach the workers as a method of the extension class vLLM mixes into them."""
    import ast
    import inspect
    from importlib import import_module

    from dspark_cli.engines.vllm import profile

    module, _, name = profile.EXTENSION.rpartition(".")
    ext = getattr(import_module(module), name)
    assert callable(getattr(ext, "dspark_profile_sps", None))
    # no name of ours may shadow a worker attribute (vLLM asserts on conflicts when it mixes the class in)
    assert [a for a in vars(ext) if not a.startswith("__")] == ["dspark_profile_sps"]
    calls = [n for n in ast.walk(ast.parse(inspect.getsource(profile._profile)))
             if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "collective_rpc"]
    assert calls and all(isinstance(c.args[0], ast.Constant) and c.args[0].value == "dspark_profile_sps"
                         for c in calls)


@dataclass
class _Sample:  # the fields of vLLM 0.33's StepTimingSample that the profiler reads
    forward_ms: float
    drafter_ms: float
    num_target_tokens: int
    num_reqs: int
    full_cudagraph: bool


def test_profiler_summary_takes_medians_and_prices_the_draft_from_full_graph_steps() -> None:
    from dspark_cli.engines.vllm.profile import summarize_steps

    # a dummy step of n tokens runs min(n, max_num_reqs) requests
    samples = [_Sample(1.0, 0.5, 8, 8, True), _Sample(1.2, 0.5, 8, 8, True), _Sample(1.1, 0.6, 8, 8, True),
               _Sample(2.0, 0.8, 64, 64, True), _Sample(2.2, 0.8, 64, 64, True),
               # an eager target step at 64 requests: its drafter time is inflated and must not count
               _Sample(9.0, 5.0, 1024, 64, False)]
    walls = {8: [2.0, 2.1, 1.9], 64: [3.5, 3.6], 1024: [12.0]}
    out = summarize_steps(samples, walls, captured=[8, 64], max_num_reqs=64)
    assert out["verify_ms"] == [(8, 1.1), (64, 2.1), (1024, 9.0)]
    assert out["draft_ms"] == [(8, 0.5), (64, 0.8)]
    # overhead at the captured sizes: wall - forward - draft = 2.0 - 1.1 - 0.5 and 3.55 - 2.1 - 0.8
    assert out["overhead_ms"] == pytest.approx((0.4 + 0.65) / 2)
    assert out["capture_sizes"] == [8, 64] and "FULL-graph" in out["draft_source"]
    eager_only = summarize_steps([_Sample(9.0, 5.0, 1024, 64, False)], {1024: [12.0]}, [], 64)
    assert eager_only["draft_ms"] == [(64, 5.0)] and eager_only["overhead_ms"] == 0.0
    # mask mode, k=7: uniform dummy steps of 8 and 16 tokens hold 1 and 2 requests, so a step's draft pass is
    # the one at 1 or 2 requests (it used to be looked up at 8 and 16, found missing, and left in the overhead)
    uniform = [_Sample(1.0, 5.0, 8, 1, True), _Sample(1.5, 5.2, 16, 2, True)]
    out = summarize_steps(uniform, {8: [6.5], 16: [7.2]}, captured=[8, 16], max_num_reqs=64)
    assert out["draft_ms"] == [(1, 5.0), (2, 5.2)]
    assert out["overhead_ms"] == pytest.approx(0.5)  # 6.5 - 1.0 - 5.0 and 7.2 - 1.5 - 5.2


def test_profiler_times_dummy_steps_and_never_replays_a_captured_graph_by_hand() -> None:
    """A FULL graph replayed on its own reads the metadata of whatever batch ran last: on the H200 the
    profiler's hand replays died with an illegal memory access. Every timing must come from a dummy step,
    which stages its own metadata first."""
    from collections import namedtuple
    from contextlib import contextmanager
    from types import SimpleNamespace

    from dspark_cli.engines.vllm.profile import profile_worker

    class _Graph:
        def replay(self) -> None:
            raise AssertionError("a captured graph was replayed by hand")

    collected: list[_Sample] = []

    @contextmanager
    def collect():  # type: ignore[no-untyped-def]
        collected.clear()
        yield collected

    runs: list[tuple[int, bool]] = []

    def dummy_run(n: int, uniform_decode: bool = False, context_len: int = 0) -> None:
        runs.append((n, uniform_decode))
        reqs = n // 8 if uniform_decode else min(n, 4)
        collected.append(_Sample(0.01 * n, 0.2, n, reqs, n <= 16))

    def runner(varlen: bool, sizes: tuple[int, ...] = (16, 8)) -> SimpleNamespace:
        graphs = {namedtuple("Desc", "num_tokens")(n): _Graph() for n in sizes}
        return SimpleNamespace(
            cudagraph_manager=SimpleNamespace(graphs=graphs, varlen_decode=varlen), decode_query_len=8,
            max_num_tokens=64, max_num_reqs=4, step_timing=SimpleNamespace(collect=collect), _dummy_run=dummy_run)

    out = profile_worker(SimpleNamespace(model_runner=runner(varlen=True)), replays=3, warmup=1)
    assert sorted({n for n, _ in runs}) == [8, 16, 24, 32, 64]  # captured, then 1.5x and doublings to the cap
    assert runs.count((8, False)) == 1 + 3 and not any(u for _, u in runs)
    assert [n for n, _ in out["verify_ms"]] == [8, 16, 24, 32, 64]
    assert out["draft_ms"] == [(4, 0.2)] and out["capture_sizes"] == [8, 16]
    assert out["context_len"] == 4096  # the KV every dummy request reads, recorded in the curve's meta
    # mask mode: uniform decode graphs are reached only by uniform decode dummy steps
    runs.clear()
    out = profile_worker(SimpleNamespace(model_runner=runner(varlen=False)), replays=2, warmup=0)
    assert {n for n, u in runs if u} == {8, 16} and {n for n, u in runs if not u} == {24, 32, 64}
    assert out["draft_ms"] == [(1, 0.2), (2, 0.2)]
    # FULL mixed graphs (no capacity mode) are captured past max_num_seqs * (1 + k): a uniform step there would ask
    # for 64 / 8 = 8 requests of a batch that holds 4, so that size runs as a plain dummy step
    runs.clear()
    profile_worker(SimpleNamespace(model_runner=runner(varlen=False, sizes=(8, 16, 64))), replays=1, warmup=0)
    assert {n for n, u in runs if u} == {8, 16} and (64, False) in runs


def test_the_profiler_leaves_out_the_sizes_whose_draft_pass_vllm_would_overflow() -> None:
    """A draft_model speculator's prefill adds a slot per request; vLLM's dummy step trims a batch near the budget
    for it, then pads it back to its graph's size, and the draft's pass ran past torch.compile's range on the H200
    ("Shape: 257 out of considered ranges", docs/PERFORMANCE.md section 38). The stand-in runs vLLM's arithmetic
    and stops as vLLM does; the profiler must never ask it for such a step, and says which sizes it left out."""
    from collections import namedtuple
    from contextlib import contextmanager
    from types import SimpleNamespace

    from dspark_cli.engines.vllm.profile import profile_worker

    captured, budget, max_reqs = tuple(range(8, 65, 8)), 64, 12

    @contextmanager
    def collect():  # type: ignore[no-untyped-def]
        yield []

    ran: list[int] = []

    def dummy_run(n: int, uniform_decode: bool = False, context_len: int = 0) -> None:
        reqs = n // 8 if uniform_decode else min(n, max_reqs)
        tokens = n if uniform_decode else min(n, budget - reqs)  # _dummy_run's trim for the extra slot
        padded = min((c for c in captured if c >= tokens), default=tokens)  # execute_model's dummy batch
        assert padded + reqs <= budget, f"Shape: {padded + reqs} out of considered ranges: [(1, {budget})]"
        ran.append(n)

    for varlen, skipped in ((True, [56, 64]), (False, [64])):  # uniform 56: 7 requests, 63 tokens
        ran.clear()
        graphs = {namedtuple("Desc", "num_tokens")(n): None for n in captured}
        runner = SimpleNamespace(
            cudagraph_manager=SimpleNamespace(graphs=graphs, varlen_decode=varlen), decode_query_len=8,
            max_num_tokens=budget, max_num_reqs=max_reqs, step_timing=SimpleNamespace(collect=collect),
            _dummy_run=dummy_run, speculator=SimpleNamespace(num_extra_query_per_req=1))
        out = profile_worker(SimpleNamespace(model_runner=runner), replays=1, warmup=0)
        assert out["skipped_sizes"] == skipped and sorted(set(ran)) == [n for n in captured if n not in skipped]


def test_the_plugins_own_settings_travel_from_dspark_serve_too(capsys: pytest.CaptureFixture[str]) -> None:
    """The vLLM-only keys (paused-step handling) in `dspark serve --engine vllm --speculative-config` reach the
    workers as the raw vLLM path's do; the embedded engine refuses them by name."""
    serve_config = pytest.importorskip("dspark_cli.serve_config")
    spec = _spec(dspark_capacity_verification_mode="varlen", dspark_plain_paused_steps=False,
                 dspark_mask_paused_compact=False, dspark_draft_catchup_tokens=512, dspark_draft_defer_prompts=True)
    settings = serve_config.build_settings({"engine": "vllm", "model": "m"}, spec)
    assert run_vllm_serve(settings, [], dry_run=True) == 0
    dspark = _flag(shlex.split(capsys.readouterr().out), "--additional-config")["dspark"]
    assert (dspark["plain_paused_steps"], dspark["mask_paused_compact"], dspark["draft_catchup_tokens"],
            dspark["draft_defer_prompts"]) == (False, False, 512, True)
    with pytest.raises(DsparkError, match="dspark_plain_paused_steps, dspark_draft_defer_prompts: a setting of the vLLM"):
        serve_config.build_settings({"model": "m"}, spec)
    with pytest.raises(DsparkError, match="dspark_plain_paused_steps: expected true or false"):
        serve_config.build_settings({"engine": "vllm"}, _spec(dspark_plain_paused_steps="yes"))


def test_an_sts_table_shorter_than_the_draft_is_refused_before_vllm_starts(tmp_path: Path) -> None:
    sts = tmp_path / "sts.json"
    sts.write_text('{"version": 1, "temperatures": [1.0, 1.2], "sts_temperatures": [1.0, 1.2]}')
    with pytest.raises(DsparkError, match="has 2 temperatures but 7 draft positions need one each"):
        plan_vllm_serve(["m", "--speculative-config", _spec(dspark_capacity_verification_mode="varlen",
                                                            dspark_sts=str(sts))])
    plan = plan_vllm_serve(["m", "--speculative-config", _spec(num_speculative_tokens=2,
                                                               dspark_capacity_verification_mode="varlen",
                                                               dspark_sts=str(sts))])
    assert plan.settings.sts == str(sts)


def test_vllms_own_dspark_fields_pass_through_to_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    """dspark_draft_topk is vLLM 0.33's own SpeculativeConfig field (its DSpark speculator's), not a seed key:
    it stays in the speculative config on both vLLM paths, and the embedded engine refuses it by name."""
    from dspark_cli.engines.vllm.contract import VLLM_DSPARK_FIELDS
    from dspark_cli.serve_config import build_settings

    assert VLLM_DSPARK_FIELDS == ("dspark_draft_topk",) and not set(VLLM_DSPARK_FIELDS) & set(SEED_KEYS)
    for extra in ({}, {"dspark_capacity_verification_mode": "varlen"}):
        cmd = build_vllm_serve_command(["m", "--speculative-config", _spec(dspark_draft_topk=8, **extra)])
        assert _flag(cmd, "--speculative-config")["dspark_draft_topk"] == 8
        assert "draft_topk" not in json.dumps(_flag(cmd, "--additional-config")) if extra else True
    settings = build_settings({"engine": "vllm", "model": "m"}, _spec(dspark_draft_topk=8))
    assert run_vllm_serve(settings, [], dry_run=True) == 0
    assert _flag(shlex.split(capsys.readouterr().out), "--speculative-config")["dspark_draft_topk"] == 8
    with pytest.raises(DsparkError, match="dspark_draft_topk: an option of vLLM's own DSpark speculator") as err:
        build_settings({"model": "m"}, _spec(dspark_draft_topk=8))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("flag", ["--speculative-config.num_speculative_tokens", "--speculative_config.method",
                                  "-sc.model", "--additional-config.dspark.mode", "--additional_config.x"])
@pytest.mark.parametrize("inline", [False, True])
def test_dotted_forms_of_our_json_flags_are_refused(flag: str, inline: bool) -> None:
    """vLLM's parser turns a dotted flag into a whole JSON flag appended last, which would replace ours."""
    tail = [f"{flag}=5"] if inline else [flag, "5"]
    for args in (["m", "--speculative-config", _spec(dspark_capacity_verification_mode="varlen"), *tail],
                 ["m", "--speculative-config", BASE, "--", *tail]):
        with pytest.raises(DsparkError, match="put the value inside the --(speculative|additional)-config JSON") as err:
            plan_vllm_serve(args)
        assert str(err.value).startswith(flag + ":") and "\n" not in str(err.value)
    # other dotted flags (vLLM's own objects) and dotted values pass
    cmd = build_vllm_serve_command(["m", "-cc.mode", "0", "--tokenizer", "./a.b", "--speculative-config", BASE])
    assert cmd[3:5] == ["-cc.mode", "0"]


@pytest.mark.parametrize(("tokens", "meant"), [
    (["--additional", '{"kv_transfer": 1}'], "--additional-config"),
    (["--additional-conf={}"], "--additional-config"),
    (["--enforce"], "--enforce-eager"),
    (["--no-enforce"], "--no-enforce-eager"),
    (["--speculative_conf", BASE], "--speculative-config"),
    (["--compilation.cudagraph_mode", "PIECEWISE"], "--compilation-config"),
    (["--spec", "x"], "--spec-tokens"),
    (["--optim", "0"], "--optimization-level"),
    (["--capacity-m", "varlen"], "--capacity-mode"),
])
def test_abbreviated_flags_the_launcher_reads_are_refused(tokens: list[str], meant: str) -> None:
    """vLLM's parser takes an unambiguous prefix for a whole flag: an abbreviated --additional-config reached it
    beside the one written here (one of the two silently lost), an abbreviated --enforce-eager passed the
    full-graph check."""
    args = ["m", "--speculative-config", _spec(dspark_capacity_verification_mode="varlen"), *tokens]
    with pytest.raises(DsparkError, match="write the whole flag") as err:
        plan_vllm_serve(args)
    head = tokens[0].partition("=")[0].partition(".")[0].replace("_", "-")
    assert str(err.value).startswith(head + ":") and meant in str(err.value) and "\n" not in str(err.value)


def test_whole_flags_and_arguments_after_the_separator_are_not_abbreviations() -> None:
    cmd = build_vllm_serve_command(["m", "--speculative-config", _spec(dspark_capacity_verification_mode="varlen"),
                                    "--load-format", "dummy", "--enforce-eager-not", "--seed", "1", "--",
                                    "--additional"])
    assert "--load-format" in cmd and "--enforce-eager-not" in cmd  # longer than a read flag: vLLM's to judge
    # what the translation adds are flags, so they go before the separator, after which vLLM reads positionals
    assert cmd[-4:] == ["--additional-config", '{"dspark":{"mode":"varlen"}}', "--", "--additional"]
    short = build_vllm_serve_command(["m", "--spec-model", "d", "--spec-tokens", "3", "--capacity-mode", "mask",
                                      "--", "x"])
    assert short[3] == "--speculative-config" and short[-2:] == ["--", "x"]


def test_the_underscore_spelling_of_the_speculative_config_is_ours_too() -> None:
    cmd = build_vllm_serve_command(["m", "--speculative_config", _spec(dspark_capacity_verification_mode="mask")])
    assert _flag(cmd, "--speculative-config")["enable_adaptive_verification"] is True
    assert _flag(cmd, "--additional-config")["dspark"]["mode"] == "mask"


@pytest.mark.parametrize("spec", [{"method": "ngram", "prompt_lookup_max": 4},
                                  {"model": "[ngram]"}, {"method": "ngram_gpu"}, {"method": "suffix"},
                                  {"method": "custom_class", "model": "pkg.Proposer"}])
def test_a_capacity_mode_needs_a_method_with_adaptive_verification(spec: dict) -> None:
    from dspark_cli.engines.vllm.contract import ADAPTIVE_METHODS, NON_ADAPTIVE_METHODS

    full = {"num_speculative_tokens": 4, **spec}
    with pytest.raises(DsparkError, match=r"--capacity-mode varlen with speculative method '\w+': vLLM 0.33.0 has "
                                          r"no adaptive verification .*use one of draft_model, eagle") as err:
        plan_vllm_serve(["m", "--speculative-config", json.dumps(full), "--capacity-mode", "varlen"])
    assert "\n" not in str(err.value)
    assert not set(ADAPTIVE_METHODS) & set(NON_ADAPTIVE_METHODS)
    # without a capacity mode vLLM serves them as they are
    assert plan_vllm_serve(["m", "--speculative-config", json.dumps(full)]).settings is None
    for method in ("mtp", "draft_model", "eagle3"):
        ok = plan_vllm_serve(["m", "--speculative-config", _spec(method=method, model="/m/draft"),
                              "--capacity-mode", "mask"])
        assert ok.settings is not None


def test_a_capacity_mode_with_ngram_is_refused_through_the_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dspark_cli.cli import app

    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t", "-k", "4",
                                      "--capacity-mode", "varlen", "--sps-curve", "auto",
                                      "--speculative-config", '{"method": "ngram"}'])
    assert isinstance(result.exception, DsparkError) and "method 'ngram'" in str(result.exception)


def test_the_no_draft_hint_names_methods_that_serve_the_mode() -> None:
    with pytest.raises(DsparkError, match=r"needs none in --speculative-config \(ngram, suffix, mtp, dspark\)"):
        plan_vllm_serve(["m", "--speculative-config", '{"num_speculative_tokens": 4}'])
    with pytest.raises(DsparkError, match=r"needs none in --speculative-config \(mtp, dspark\)"):
        plan_vllm_serve(["m", "--speculative-config", '{"num_speculative_tokens": 4}', "--capacity-mode", "mask"])


def test_a_draft_path_that_flips_the_method_is_refused_without_a_capacity_mode_too() -> None:
    from typer.testing import CliRunner

    from dspark_cli.cli import app

    runner = CliRunner()
    for mode in ([], ["--capacity-mode", "varlen", "--sps-curve", "auto"]):
        result = runner.invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t",
                                     "--draft", "/x/dspark_draft", "-k", "5", *mode])
        assert isinstance(result.exception, DsparkError), result.output
        assert "picks the speculative method from the draft's path" in str(result.exception)
    with pytest.raises(DsparkError, match="picks the speculative method"):
        plan_vllm_serve(["m", "-sc", '{"model": "/m/eagle3-x", "num_speculative_tokens": 3}'])


def test_enforce_eager_is_refused_with_a_capacity_mode() -> None:
    spec = _spec(dspark_capacity_verification_mode="mask")
    for tail in (["--enforce-eager"], ["--", "--enforce-eager"], ["--no-enforce-eager", "--enforce_eager"]):
        with pytest.raises(DsparkError, match="--enforce-eager: vLLM 0.33.0 runs --capacity-mode mask only with "
                                              "full CUDA graphs") as err:
            plan_vllm_serve(["m", "--speculative-config", spec, *tail])
        assert "\n" not in str(err.value)
    assert plan_vllm_serve(["m", "--speculative-config", spec, "--enforce-eager", "--no-enforce-eager"]).settings
    assert plan_vllm_serve(["m", "--speculative-config", BASE, "--enforce-eager"]).settings is None


@pytest.mark.parametrize(("tail", "said"), [
    (["-O0"], "-O0: vLLM 0.33.0 then captures no CUDA graphs"),
    (["-O", "1"], "-O1: vLLM 0.33.0 then captures only piecewise CUDA graphs"),
    (["-O=1"], "-O1: vLLM"),
    (["--optimization-level", "0"], "-O0: vLLM"),
    (["--", "--optimization_level=1"], "-O1: vLLM"),
    (["-cc", '{"cudagraph_mode": "piecewise"}'], "cudagraph_mode PIECEWISE: vLLM 0.33.0 runs --capacity-mode mask"),
    (["--compilation-config={\"cudagraph_mode\": 0}"], "cudagraph_mode NONE"),
    (["-O3", "-cc.cudagraph_mode=NONE"], "cudagraph_mode NONE"),
    # dotted -cc.X flags become one JSON that vLLM appends after the whole ones, replacing them
    (["-cc", '{"cudagraph_mode": "FULL"}', "--compilation-config.cudagraph_mode", "PIECEWISE"], "cudagraph_mode PIECE"),
    (["-cc", '{"cudagraph_mode": "FULL"}', "-cc.mode=3", "-O1"], "-O1: vLLM"),
    (["--enable-lora"], "--enable-lora: vLLM 0.33.0's adaptive verification, through which --capacity-mode mask"),
    (["--no-enable-lora", "--enable_lora"], "--enable-lora"),
    (["-pp", "2"], "--pipeline-parallel-size 2: vLLM 0.33.0's adaptive verification"),
    (["--pipeline_parallel_size=4"], "--pipeline-parallel-size 4"),
])
def test_a_capacity_mode_without_full_cuda_graphs_or_with_lora_is_refused_before_vllm_starts(
        tail: list[str], said: str) -> None:
    """vLLM 0.33 stops adaptive verification (VllmConfig._validate_adaptive_verification) without full CUDA graphs
    -- -O0 and -O1 capture none or piecewise ones only, unless the compilation config says otherwise -- and with
    LoRA or pipeline parallelism. A capacity mode turns adaptive verification on for the user, so the launcher says so in one line."""
    spec = _spec(dspark_capacity_verification_mode="mask")
    with pytest.raises(DsparkError) as err:
        plan_vllm_serve(["m", "--speculative-config", spec, *tail])
    assert str(err.value).startswith(said) and "\n" not in str(err.value)


@pytest.mark.parametrize("tail", [
    ["-O2"], ["-O", "3"], ["--optimization-level=3"],
    ["-O1", "-cc", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'],
    ["-O0", "--compilation-config", '{"mode": 0, "cudagraph_mode": "full_and_piecewise"}'],
    ["-cc", '{"cudagraph_mode": "NONE"}', "-cc", '{"mode": 3}'],  # the last whole JSON wins
    ["-O1", "-cc.cudagraph_mode", "FULL"],
    ["--enable-lora", "--no-enable-lora"],
    ["-pp", "1", "--tensor-parallel-size", "2"],
    ["-cc", "not json"],  # vLLM's own parser says what is wrong with that
])
def test_full_cuda_graphs_pass_whatever_spells_them(tail: list[str]) -> None:
    spec = _spec(dspark_capacity_verification_mode="varlen")
    assert plan_vllm_serve(["m", "--speculative-config", spec, *tail]).settings is not None
    assert plan_vllm_serve(["m", "--speculative-config", BASE, "-O0", "--enable-lora"]).settings is None


def _curve(path: Path, k: int | None) -> Path:
    from dspark_cli.core.sps import SpsCurve

    curve = SpsCurve.from_points([(8, 5.0), (16, 6.0), (32, 8.0)], capture_sizes=[8, 16, 32])
    if k is not None:
        curve = SpsCurve.from_dict({**curve.to_dict(), "meta": {**curve.meta, "k": k}}, source=str(path))
    curve.save(path)
    return path


def test_a_curve_profiled_at_another_k_is_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dspark_cli.serve_config import build_settings

    curve = _curve(tmp_path / "c.json", 4)
    plan = plan_vllm_serve(["m", "--speculative-config", BASE, "--sps-curve", str(curve)])
    assert plan.warnings == ["the SPS curve was profiled at k=4 and this server drafts k=7; profile it again with "
                             "`dspark profile-sps ... -k 7`"]
    assert plan_vllm_serve(["m", "--speculative-config", _spec(num_speculative_tokens=4),
                            "--sps-curve", str(curve)]).warnings == []
    assert plan_vllm_serve(["m", "--speculative-config", BASE,
                            "--sps-curve", str(_curve(tmp_path / "n.json", None))]).warnings == []
    settings = build_settings({"engine": "vllm", "model": "m", "sps_curve": str(curve), "capacity_mode": "varlen"},
                              BASE)
    assert run_vllm_serve(settings, [], dry_run=True) == 0
    assert "warning: the SPS curve was profiled at k=4 and this server drafts k=7" in capsys.readouterr().err


def test_settings_for_a_capacity_mode_without_one_warn_alike_on_both_vllm_paths(tmp_path: Path) -> None:
    """`--online-sts` (or STS, saturation ...) with no capacity mode: the plugin stays inert on either path, which
    both say in the embedded engine's words; neither switches a mode on. Only settings that a mode alone reads
    (a curve, a budget, a policy ...) imply varlen, as `dspark serve` decides."""
    from typer.testing import CliRunner

    from dspark_cli.cli import app
    from dspark_cli.serve_config import build_settings, capacity_mode_none_warning, ineffective_settings

    warning = capacity_mode_none_warning(["--online-sts"])
    spec = {"model": "/ckpt/d", "num_speculative_tokens": 7}
    raw = [plan_vllm_serve(["/ckpt/t", "-sc", json.dumps(spec), "--online-sts"]),
           plan_vllm_serve(["/ckpt/t", "-sc", json.dumps({**spec, "dspark_online_sts": True})])]
    for plan in raw:
        assert plan.settings is None and plan.warnings == [warning]
        assert "--additional-config" not in plan.argv and _flag(plan.argv, "-sc") == spec
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t",
                                      "--draft", "/ckpt/d", "-k", "7", "--online-sts"])
    assert result.exit_code == 0, result.output
    assert f"warning: {warning}" in " ".join(result.stderr.split())
    cmd = shlex.split(result.stdout.strip().splitlines()[-1])
    assert "--additional-config" not in cmd and _flag(cmd, "--speculative-config") == spec
    # the embedded engine: the same sentence
    assert ineffective_settings(build_settings({"online_sts": True})) == [warning]
    # a curve alone still picks varlen on both paths
    assert plan_vllm_serve(["/ckpt/t", "-sc", json.dumps(spec), "--sps-curve", "auto"]).settings.mode == "varlen"
    assert build_settings({"engine": "vllm", "sps_curve": "auto"}, json.dumps(spec)).capacity_mode == "varlen"


def test_the_speculative_config_is_read_as_vllm_reads_it() -> None:
    """vLLM turns a key's dashes into underscores, the later spelling winning: read with its dashes, a K of 7
    was not seen, the default K joined it, and vLLM ran K=4. "model": "none" means no draft, which vLLM would
    take for a model called none."""
    from typer.testing import CliRunner

    from dspark_cli.cli import app
    from dspark_cli.serve_config import build_settings, drafted_k

    plan = plan_vllm_serve(["m", "--speculative-config", json.dumps(
        {"model": "/ckpt/d", "num-speculative-tokens": 7, "dspark_capacity_verification_mode": "varlen"})])
    assert plan.speculative_config is not None and plan.speculative_config["num_speculative_tokens"] == 7
    assert "num-speculative-tokens" not in _flag(plan.argv, "--speculative-config")
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t", "--draft",
                                      "/ckpt/d", "--speculative-config", '{"num-speculative-tokens": 7}'])
    assert result.exit_code == 0, result.output
    cmd = shlex.split(result.stdout.strip().splitlines()[-1])
    assert _flag(cmd, "--speculative-config") == {"num_speculative_tokens": 7, "model": "/ckpt/d"}
    none = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t",
                                    "--speculative-config", '{"model": "none"}'])
    assert none.exit_code == 0, none.output
    assert "--speculative-config" not in shlex.split(none.stdout.strip().splitlines()[-1])
    # the K traces are checked against is the one vLLM will run: the JSON's, else the default the launcher adds
    assert drafted_k(build_settings({"engine": "vllm"}, '{"num_speculative_tokens": 7}')) == 7
    assert drafted_k(build_settings({"engine": "vllm", "draft": "/ckpt/d"})) == 4


def test_a_vllm_config_file_is_refused(tmp_path: Path) -> None:
    """vLLM reads a --config YAML's arguments before every other: the host, port, served name and the whole JSON
    configs written here override them, and the full-graph check never saw an `enforce-eager: true` in it."""
    yaml = tmp_path / "c.yaml"
    yaml.write_text("enforce-eager: true\nport: 9100\n")
    for form in (["--config", str(yaml)], [f"--config={yaml}"]):
        with pytest.raises(DsparkError, match="--config FILE: vLLM reads a config file's arguments before every other"):
            plan_vllm_serve(["m", "--speculative-config", _spec(dspark_capacity_verification_mode="varlen"), *form])


@pytest.mark.parametrize(("value", "visible"), [("dspark", True), ("foo,dspark", True), ("foo, dspark", False),
                                                 ("dspark ", False), ("foo", False)])
def test_vllm_plugins_is_read_as_vllm_splits_it(value: str, visible: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 splits VLLM_PLUGINS on commas and strips nothing: " dspark" is no plugin, and vLLM's own manager
    would run in ours' place. The check stripped the names, and passed such a list."""
    from dspark_cli.engines.vllm.launcher import check_plugin_visible

    monkeypatch.setenv("VLLM_PLUGINS", value)
    if visible:
        check_plugin_visible()
    else:
        with pytest.raises(DsparkError, match="filters out the dspark plugin"):
            check_plugin_visible()


def test_traces_without_a_capacity_mode_are_refused_on_both_vllm_paths(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dspark_cli.cli import app

    traces = str(tmp_path / "t.jsonl")
    with pytest.raises(DsparkError, match="--record-traces needs a capacity mode"):
        plan_vllm_serve(["m", "--speculative-config", _spec(model="/ckpt/d"), "--record-traces", traces])
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t",
                                      "--draft", "/ckpt/d", "-k", "7", "--record-traces", traces])
    assert isinstance(result.exception, DsparkError) and "--record-traces needs a capacity mode" in str(result.exception)
    # no speculation (bench's nospec column): moot, said by the CLI, nothing refused
    nospec = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t",
                                      "-k", "0", "--record-traces", traces])
    assert nospec.exit_code == 0, nospec.output


def test_profile_sps_says_the_launchers_warnings_too(capsys: pytest.CaptureFixture[str]) -> None:
    """profile-sps --engine vllm plans its server as dspark serve does, warnings included: online STS with no
    capacity mode is said before vLLM starts, not dropped."""
    from dspark_cli.engines.vllm.profile import run_vllm_profile
    from dspark_cli.serve_config import capacity_mode_none_warning

    spec = {"model": "/ckpt/d", "num_speculative_tokens": 7}
    assert run_vllm_profile(["/ckpt/t", "-sc", json.dumps(spec), "--online-sts"], dry_run=True) == 0
    out = capsys.readouterr()
    assert f"warning: {capacity_mode_none_warning(['--online-sts'])}" in out.err
    assert "--additional-config" not in out.out


def test_without_a_draft_length_vllm_drafts_the_default_where_a_draft_is_there_and_a_capacity_mode_says_so(
        tmp_path: Path) -> None:
    """No -k under --engine vllm: a capacity mode went to vLLM with no draft model nor draft count, and the bench's
    `none` column (--capacity-mode none) served no speculation at all, a second nospec column. The documented
    default (4) now drafts wherever a draft is there; without one, plain vLLM, and a capacity mode says why not."""
    import json
    import shlex

    from typer.testing import CliRunner

    from dspark_cli.cli import app

    def spec_of(*argv: str) -> dict | None:
        result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", *argv],
                                    env={"DSPARK_VLLM_MODELS": str(tmp_path)})
        assert result.exception is None, result.output
        line = shlex.split(next(x for x in result.output.splitlines() if x.startswith("vllm serve")))
        return json.loads(line[line.index("--speculative-config") + 1]) if "--speculative-config" in line else None

    for mode in ("varlen", "none"):
        spec = spec_of("--capacity-mode", mode, *(["--sps-curve", "auto"] if mode != "none" else []))
        assert spec is not None and spec["num_speculative_tokens"] == 4 and spec["model"], (mode, spec)
    assert spec_of("--model", "/ckpt/t", "--draft", "/ckpt/d")["num_speculative_tokens"] == 4
    assert spec_of("--model", "/ckpt/t") is None  # a checkpoint and no draft: plain vLLM, as before
    assert spec_of("-k", "0") is None
    assert spec_of("--spec-tokens", "5")["num_speculative_tokens"] == 5  # vLLM's own shorthand counts as given
    assert spec_of("-k", "7", "--capacity-mode", "varlen", "--sps-curve", "auto")["num_speculative_tokens"] == 7
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t",
                                      "--capacity-mode", "varlen", "--sps-curve", "auto"])
    assert isinstance(result.exception, DsparkError)
    assert "--capacity-mode varlen needs speculative decoding" in str(result.exception)


def test_the_users_additional_config_keeps_what_no_flag_sets() -> None:
    """dspark serve wrote every setting's default into the speculative config, laid over the user's own
    --additional-config dspark object: its policy, online STS and budget were dropped without a word. A flag
    set away from its default still wins."""
    import json
    import shlex

    from typer.testing import CliRunner

    from dspark_cli.cli import app

    def dspark_of(*argv: str) -> dict:
        result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t", "--draft",
                                          "/ckpt/d", "-k", "7", "--capacity-mode", "varlen", "--sps-curve", "auto",
                                          *argv])
        assert result.exception is None, result.output
        line = shlex.split(next(x for x in result.output.splitlines() if x.startswith("vllm serve")))
        return json.loads(line[line.index("--additional-config") + 1])["dspark"]

    user = {"policy": "paper", "online_sts": True, "budget_frac": 0.5, "saturation_patience": 0}
    got = dspark_of("--additional-config", json.dumps({"dspark": user}))
    assert {k: got[k] for k in user} == user and got["mode"] == "varlen"
    got = dspark_of("--confidence-threshold", "0.3", "--additional-config", json.dumps({"dspark": user}))
    assert got["policy"] == "threshold" and got["threshold"] == 0.3 and got["budget_frac"] == 0.5


def test_vllms_dotted_short_flags_reach_it_whole(tmp_path: Path) -> None:
    """Click read ``-ac.backend=X`` as a cluster of short options and hit ``-k`` ("Invalid value for '-k'"), and
    profile-sps read ``-cc.cudagraph_mode=PIECEWISE`` through ``-o``: its curve went to a file named ``de=PIECEWISE``
    and the refusal of piecewise-only graphs never saw the flag."""
    import shlex

    from typer.testing import CliRunner

    from dspark_cli.cli import _dotted_short_flags_passed_through, app

    assert _dotted_short_flags_passed_through(["-k", "7", "-cc.mode", "3", "--x", "-ac.backend=F", "--", "--y"]) == \
        ["-k", "7", "--x", "--", "--y", "-cc.mode", "3", "-ac.backend=F"]
    assert _dotted_short_flags_passed_through(["-k", "7", "-O3"]) == ["-k", "7", "-O3"]
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t", "--draft", "/ckpt/d",
                                 "-k", "7", "-ac.backend=FLASHINFER"])
    assert result.exception is None, result.output
    line = shlex.split(next(x for x in result.output.splitlines() if x.startswith("vllm serve")))
    assert "-ac.backend=FLASHINFER" in line and '"num_speculative_tokens":7' in line[line.index("--speculative-config") + 1]
    out = tmp_path / "curve.json"
    for command in (["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t", "--sps-curve", "auto"],
                    ["profile-sps", "/ckpt/t", "--engine", "vllm", "--dry-run", "--output", str(out)]):
        result = runner.invoke(app, [*command, "--draft", "/ckpt/d", "-k", "7", "--capacity-mode", "varlen",
                                     "-cc.cudagraph_mode=PIECEWISE"])
        assert "full CUDA graphs" in str(result.exception) + result.output, (command[0], result.output)
    assert not out.exists() and not Path("de=PIECEWISE").exists()
    # the whole config with `=` (vLLM reads -cc={...}) was cut the same way, through -o or -k
    assert _dotted_short_flags_passed_through(["-k", "7", '-cc={"mode": 3}', "--x"]) == \
        ["-k", "7", "--x", "--", '-cc={"mode": 3}']
    for command in (["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t", "--sps-curve", "auto"],
                    ["profile-sps", "/ckpt/t", "--engine", "vllm", "--dry-run", "--output", str(out)]):
        result = runner.invoke(app, [*command, "--draft", "/ckpt/d", "-k", "7", "--capacity-mode", "varlen",
                                     '-cc={"cudagraph_mode": "PIECEWISE"}'])
        assert "full CUDA graphs" in str(result.exception) + result.output, (command[0], result.output)
    assert not out.exists()


def test_vllms_speculative_shorthands_are_folded_into_the_speculative_config() -> None:
    """vLLM 0.33 merges --spec-method/--spec-model/--spec-tokens into the speculative config; the launcher did not
    see them: a capacity mode with --spec-method ngram went unrefused (nothing would be trimmed), and -k with
    --spec-method mtp was refused for want of a draft mtp does not need."""
    with pytest.raises(DsparkError, match="speculative method 'ngram'"):
        plan_vllm_serve(["m", "--capacity-mode", "varlen", "--sps-curve", "auto", "--spec-method", "ngram",
                         "--spec-tokens", "4"])
    plan = plan_vllm_serve(["m", "--speculative-config", '{"num_speculative_tokens": 1}', "--spec-method=mtp"])
    assert plan.speculative_config == {"num_speculative_tokens": 1, "method": "mtp"}
    assert "--spec-method=mtp" not in plan.argv
    plan = plan_vllm_serve(["m", "--spec_model", "/d", "--spec-tokens", "3", "--capacity-mode", "varlen",
                            "--sps-curve", "auto"])
    assert plan.speculative_config["model"] == "/d" and plan.speculative_config["num_speculative_tokens"] == 3
    assert plan.settings is not None and plan.speculative_config["enable_adaptive_verification"] is True
    with pytest.raises(DsparkError, match="--spec-tokens and the speculative config's 'num_speculative_tokens'"):
        plan_vllm_serve(["m", "-sc", '{"model": "/d", "num_speculative_tokens": 3}', "--spec-tokens", "5"])
    with pytest.raises(DsparkError, match="--spec-tokens: expected an integer, got 'many'"):
        plan_vllm_serve(["m", "--spec-tokens", "many"])
