"""`dspark profile-sps`: a real CPU profile of the packaged tiny pair, the report, and every refusal path."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dspark_cli import profile_sps as ps
from dspark_cli.cli import app
from dspark_cli.core.sps import SpsCurve, SpsCurveError
from dspark_cli.engines.embedded import profile as prof
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.errors import DsparkError

runner = CliRunner()
K = 4
MAX_SEQS = 8



@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    with LLMEngine(EngineConfig(model="tiny", num_speculative_tokens=K, max_num_seqs=MAX_SEQS, max_model_len=512,
                                device="cpu")) as eng:
        yield eng


def _invoke(args: list[str]) -> Any:
    return runner.invoke(app, ["profile-sps", *args])


def _counters(engine: LLMEngine) -> str:
    # stats.stalls is left out: it records what the process waited on (a garbage collection during the
    # profile counts), not the engine's serving state
    return json.dumps({k: v for k, v in engine.stats.__dict__.items() if k != "stalls"}, sort_keys=True)


def test_cpu_profile_of_the_tiny_pair_rises_and_leaves_the_engine_untouched(engine: LLMEngine) -> None:
    free = engine.block_manager.num_free_blocks
    engine._refresh_counts()
    stats = _counters(engine)
    m = prof.measure_sps(engine, warmup=2, iters=5)
    curve = prof.curve_from_measurements(m)
    sizes = [x for x, _ in curve.verify_ms]
    max_batch = (K + 1) * MAX_SEQS
    # every power of two up to the largest batch, the batch itself, and eager points beyond it
    assert sizes[: sizes.index(max_batch) + 1] == [1, 2, 4, 8, 16, 32, 40]
    assert [s for s in sizes if s > max_batch] == prof.beyond_limit_sizes(max_batch, max_batch) == [60, 80]
    costs = [y for _, y in curve.verify_ms]
    assert costs == sorted(costs) and costs[-1] > 1.02 * costs[0]
    assert [x for x, _ in curve.draft_ms] == [1, 2, 4, 8]
    # the sampling draft pass is profiled at the same request counts (its own program: sampled drafts and
    # their distributions), and the curve prices sampling steps with it
    assert [x for x, _ in curve.draft_sampling_ms] == [1, 2, 4, 8]
    assert all(ms > 0 for _, ms in curve.draft_sampling_ms)
    assert curve.draft_cost_ms(8, sampling=True) == pytest.approx(dict(curve.draft_sampling_ms)[8])
    assert [x for x, _ in curve.meta["measured_draft_sampling_ms"]] == [1, 2, 4, 8]
    assert curve.capture_sizes == ()  # CPU never pads: no staircase
    assert [r for r, _ in m.overhead_by_reqs] == [1, 4, 8] and curve.overhead_ms >= 0
    assert curve.meta["engine"] == "embedded" and curve.meta["k"] == K and curve.meta["overhead_source"] == "measured"
    assert curve.meta["overhead_measured_ms"] == curve.overhead_ms
    # the overhead steps ran real requests, and left nothing behind
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == free
    assert _counters(engine) == stats
    assert engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]


def test_the_profile_leaves_phase_timing_counters_as_they_were() -> None:
    # phase times are dicts inside the stats; a shallow save put the same dicts back with the profile's steps
    # in them, exported as step-phase seconds of a server that had served nothing
    with LLMEngine(EngineConfig(model="tiny", num_speculative_tokens=2, max_num_seqs=2, max_model_len=256,
                                device="cpu", phase_timing="host")) as eng:
        before = _counters(eng)
        prof.measure_sps(eng, warmup=0, iters=2)
        assert eng.stats.phase_ms == {} and eng.stats.phase_steps == {}
        assert _counters(eng) == before
        eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert sum(eng.stats.phase_steps.values()) == eng.stats.num_steps > 0


def test_cli_writes_spec_format_table_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "sps_curve.json", tmp_path / "curve.png"
    result = _invoke(["tiny", "--device", "cpu", "--max-num-seqs", "4", "-k", "2", "--warmup", "1",
                      "--replays", "3", "-o", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    with open(out) as f:
        seed_view = json.load(f)["dspark_sps_curve"]  # the seed's recipe keeps working
    obj = json.loads(out.read_text())
    assert obj["version"] == 1 and set(obj) >= {"verify_curve_ms", "draft_curve_ms", "overhead_ms", "capture_sizes",
                                                "meta"}
    assert [x for x, _ in seed_view] == [x for x, _ in obj["verify_curve_ms"]]
    assert all(sps > 0 for _, sps in seed_view)
    curve = SpsCurve.load(out)
    assert curve.verify_ms[-1][1] > curve.verify_ms[0][1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "verify cost" in result.output and "draft cost" in result.output and "overhead" in result.output


def test_given_overhead_replaces_the_measured_one(tmp_path: Path) -> None:
    # One warm-up and three replays: this checks what the curve records, not timings. With no warm-up each size's
    # first (cold) run was half of a two-run median, so a later size could read 25% below an earlier one and the
    # profile be refused as a measurement error; the test failed once on a loaded CPU.
    out = tmp_path / "c.json"
    result = _invoke(["tiny", "--device", "cpu", "--max-num-seqs", "2", "-k", "2", "--warmup", "1", "--replays", "3",
                      "--capture-sizes", "1,2,6", "--overhead-ms", "0.75", "-o", str(out)])
    assert result.exit_code == 0, result.output
    curve = SpsCurve.load(out)
    assert curve.overhead_ms == 0.75 and curve.meta["overhead_source"] == "given"
    assert curve.meta["overhead_measured_ms"] is None and curve.meta["overhead_by_reqs_ms"] == []  # not a 0.0
    assert curve.meta["capture_sizes_requested"] == [1, 2, 6]
    assert [x for x, _ in curve.verify_ms] == [1, 2, 6, 9, 12]  # the requested sizes + beyond the largest
    # a context longer than the model and its KV pool allow is profiled at what fits, and said so (sizes far
    # apart: a tiny model's step costs nearly the same at 1 and 6 tokens, which the flat-curve check refuses)
    long = _invoke(["tiny", "--device", "cpu", "--max-num-seqs", "2", "-k", "2", "--warmup", "1", "--replays", "3",
                    "--capture-sizes", "1,48", "--overhead-ms", "0.5", "--context-len", "100000", "-o", str(out)])
    assert long.exit_code == 0, long.output
    held = SpsCurve.load(out).meta["context_len"]
    assert 2 <= held < 100000
    assert f"--context-len 100000: the synthetic requests held {held} tokens of KV" in " ".join(long.output.split())
    # the default context is fitted to a short model without a word, but shrunk for the KV pool it is said
    short = _invoke(["tiny", "--device", "cpu", "--max-num-seqs", "4", "-k", "2", "--warmup", "1", "--replays", "3",
                     "--capture-sizes", "1,24", "--overhead-ms", "0.5", "--max-model-len", "100", "-o", str(out)])
    assert short.exit_code == 0, short.output
    held = SpsCurve.load(out).meta["context_len"]
    assert held < 99 and f"--context-len 128: the synthetic requests held {held}" in " ".join(short.output.split())


# ---------------------------------------------------------------------------------------------- refusals


def _flat(points: int = 4) -> prof.SpsMeasurements:
    return prof.SpsMeasurements([(2**i, 5.0) for i in range(points)], [(1, 1.0), (2, 1.0)], 0.2, [(1, 0.2)], (), {})


def test_flat_curve_is_refused() -> None:
    with pytest.raises(SpsCurveError, match="flat"):
        prof.curve_from_measurements(_flat())


def test_single_size_curve_is_refused() -> None:
    with pytest.raises(SpsCurveError, match="fewer than 2"):
        prof.curve_from_measurements(_flat(points=1))


def test_cli_refuses_a_flat_profile_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[EngineConfig] = []

    def fake_profile(cfg: EngineConfig, **kwargs: Any) -> prof.SpsMeasurements:
        seen.append(cfg)
        return _flat()

    monkeypatch.setattr(prof, "profile_config", fake_profile)
    out = tmp_path / "c.json"
    result = _invoke(["tiny", "--device", "cpu", "-o", str(out)])
    assert isinstance(result.exception, SpsCurveError), result.output
    assert "\n" not in str(result.exception)
    assert not out.exists()
    assert seen[0].model == "tiny" and seen[0].capacity.mode == "none"


def test_an_interrupted_profile_says_nothing_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(ps, "run_embedded", interrupted)
    out = tmp_path / "c.json"
    result = _invoke(["tiny", "--device", "cpu", "-o", str(out)])
    assert isinstance(result.exception, DsparkError) and str(result.exception) == f"interrupted; nothing written to {out}"
    assert not out.exists()


def test_one_line_error_and_exit_1_at_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "profile-sps", "tiny", "--capture-sizes", "8",
                           "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: --capture-sizes: give at least two sizes") and proc.stderr.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["tiny", "--capture-sizes", "8"], "at least two"),
        (["tiny", "--capture-sizes", "0,4"], "positive"),
        (["tiny", "--capture-sizes", "a,b"], "comma-separated"),
        (["tiny", "--overhead-ms", "-1"], "--overhead-ms"),
        (["tiny", "--overhead-ms", "nan"], "--overhead-ms"),
        (["tiny", "--overhead-ms", "fast"], "--overhead-ms"),
        (["tiny", "--engine", "trt"], "--engine"),
        (["tiny", "-k", "0"], "K >= 1"),
        (["tiny", "--draft", "none"], "needs a draft"),
        (["tiny", "--speculative-config", '{"num_speculative_tokens": 0}'], "K >= 1"),
        (["tiny", "--speculative-config", "{nope"], "not valid JSON"),
        (["tiny", "--engine-args", '{"tensor_parallel_size": 4}'], "no equivalent for tensor_parallel_size"),
        (["tiny", "--engine-args", "[1]"], "JSON object"),
        # values of the wrong type failed deep in the engine with a traceback, or meant their opposite
        (["tiny", "--engine-args", '{"max_num_seqs": "abc"}'], "max_num_seqs: expected an integer, got 'abc'"),
        (["tiny", "--engine-args", '{"enforce_eager": "false"}'], "enforce_eager: expected true or false"),
        (["tiny", "--engine-args", '{"compilation_config": {"cudagraph_capture_sizes": "1,2"}}'],
         "cudagraph_capture_sizes: expected a list of integers"),
        (["tiny", "--engine-args", '{"dtype": 16}'], "dtype: expected a non-empty string"),
        (["tiny", "--tensor-parallel-size", "4"], "unknown option"),
        (["tiny", "--dry-run"], "needs --engine vllm"),
        (["tiny", "--warmup", "-1"], "--warmup"),
        (["tiny", "--replays", "0"], "--replays"),
        (["tiny", "--context-len", "1"], "--context-len"),
        (["tiny", "--max-num-seqs", "0"], "max_num_seqs"),
        (["/no/such/model"], "not a directory"),
        (["org/model", "--engine", "vllm", "--device", "cuda", "--dry-run"], "--device"),
        (["org/model", "--engine", "vllm", "--capture-sizes", "1,2", "--compilation-config", "{}", "--dry-run"],
         "conflicts"),
        # nothing to time: the profile used to fail only after the model loaded, with an empty curve
        (["org/model", "--engine", "vllm", "--dry-run"], "pass -k K (>= 1) and a draft"),
        (["org/model", "--engine", "vllm", "--draft", "org/d", "-k", "3", "--enforce-eager", "--dry-run"],
         "--enforce-eager: profile-sps --engine vllm times the FULL CUDA graphs"),
        (["org/model", "--engine", "vllm", "--draft", "org/d", "-k", "3", "-O1", "--dry-run"], "-O1: profile-sps"),
        (["org/model", "--engine", "vllm", "--draft", "org/d", "-k", "3", "--engine-args",
          '{"compilation_config": {"cudagraph_mode": "PIECEWISE"}}', "--dry-run"], "cudagraph_mode PIECEWISE"),
        (["org/model", "--engine", "vllm", "--draft", "org/d", "-k", "3", "-pp", "2", "--dry-run"],
         "--pipeline-parallel-size 2"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(args: list[str], match: str, tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    result = _invoke([*args, "-o", str(out)])
    assert isinstance(result.exception, DsparkError), result.output
    assert match in str(result.exception)
    assert not out.exists()


def test_output_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    result = _invoke(["tiny", "-o", str(tmp_path)])
    assert isinstance(result.exception, DsparkError) and "is a folder" in str(result.exception)


@pytest.mark.parametrize("flag", ["-o", "--plot"])
def test_a_trailing_separator_names_a_folder_not_a_file(tmp_path: Path, flag: str) -> None:
    # A Path-typed option dropped the separator: "-o new/" profiled, then wrote a file named "new".
    other = ["--plot", str(tmp_path / "c.png")] if flag == "-o" else ["-o", str(tmp_path / "c.json")]
    result = _invoke(["tiny", flag, f"{tmp_path}/new/", *other])
    assert isinstance(result.exception, DsparkError), result.output
    assert f"{flag if flag == '--plot' else '--output'} {tmp_path}/new/ is a folder" in str(result.exception)
    assert not (tmp_path / "new").exists() and not (tmp_path / "c.json").exists()


def test_vllm_without_vllm_installed_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    result = _invoke(["org/model", "--engine", "vllm", "--draft", "org/draft", "-k", "3", "--capacity-mode", "none",
                      "--budget-frac", "0.5", "-o", str(tmp_path / "c.json")])
    assert isinstance(result.exception, DsparkError) and "vLLM is not installed" in str(result.exception)
    # the launcher's warnings (a setting that will not act) come before, as in a dry run
    said = " ".join(result.output.split())
    assert "warning: " in said and "--budget-frac" in said
    assert "no capacity mode: the profile times the CUDA graphs of plain speculative decoding" in said


def test_busy_engine_and_engine_without_draft_are_refused(engine: LLMEngine) -> None:
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=2))
    try:
        with pytest.raises(DsparkError, match="idle engine"):
            prof.measure_sps(engine)
    finally:
        engine.abort_request("busy")
    with LLMEngine(EngineConfig(model="tiny", draft=None, num_speculative_tokens=0, max_num_seqs=2, device="cpu")) as e:
        with pytest.raises(DsparkError, match="needs a draft model"):
            prof.measure_sps(e)


def test_tiny_kv_pool_is_refused() -> None:
    cfg = EngineConfig(model="tiny", num_speculative_tokens=K, max_num_seqs=MAX_SEQS, max_model_len=64,
                       num_kv_blocks=6, device="cpu")
    with LLMEngine(cfg) as e, pytest.raises(DsparkError, match="KV pool"):
        prof.measure_sps(e)


# ---------------------------------------------------------------------------------------------- vLLM


SEED_SPEC = ('{"method":"dspark","model":"org/draft","num_speculative_tokens":7,'
             '"dspark_confidence_threshold":0.0,"dspark_capacity_verification_mode":"varlen"}')
SEED_ENGINE_ARGS = ('{"tokenizer":"org/target","trust_remote_code":true,"dtype":"bfloat16","max_model_len":8192,'
                    '"tensor_parallel_size":4,"max_num_seqs":256,"compilation_config":{"max_cudagraph_capture_size":2048}}')


def test_vllm_dry_run_takes_the_seed_json_shapes() -> None:
    result = _invoke(["org/target", "--engine", "vllm", "--dry-run", "--speculative-config", SEED_SPEC,
                      "--engine-args", SEED_ENGINE_ARGS, "--block-size", "256", "-o", "curve.json"])
    assert result.exit_code == 0, result.output
    cmd = shlex.split(result.output.strip())
    assert cmd[:4] == [sys.executable, "-m", "dspark_cli.engines.vllm.profile", "org/target"]
    for pair in (["--tensor-parallel-size", "4"], ["--max-num-seqs", "256"], ["--block-size", "256"],
                 ["--tokenizer", "org/target"], ["--output", "curve.json"]):
        i = cmd.index(pair[0])
        assert cmd[i: i + 2] == pair
    assert "--trust-remote-code" in cmd
    assert json.loads(cmd[cmd.index("--compilation-config") + 1]) == {"max_cudagraph_capture_size": 2048}
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["model"] == "org/draft" and spec["num_speculative_tokens"] == 7
    assert not any(k.startswith("dspark_") for k in spec)  # moved to --additional-config by the launcher
    assert json.loads(cmd[cmd.index("--additional-config") + 1])["dspark"]["mode"] == "varlen"


def test_vllm_dry_run_forwards_flags_draft_k_and_capture_sizes() -> None:
    argv = ps.vllm_argv(ps.ProfileRequest(model="org/target", engine="vllm", draft="org/draft", num_speculative_tokens=3,
                                          capture_sizes=(8, 16, 32), max_num_seqs=16, dtype="bfloat16", replays=5,
                                          extra=["--enforce-eager"]))
    assert argv[:2] == ["org/target", "--enforce-eager"]
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"cudagraph_capture_sizes": [8, 16, 32]}
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"model": "org/draft", "num_speculative_tokens": 3}
    assert argv[argv.index("--replays") + 1] == "5" and argv[argv.index("--max-num-seqs") + 1] == "16"


def test_vllm_capture_sizes_reach_vllm_beside_the_users_compilation_flags() -> None:
    """vLLM gathers dotted ``-cc.X`` flags into one whole compilation config appended after every other argument,
    which replaced the one ``--capture-sizes`` was written into: the sizes were dropped without a word. They now
    join the dotted flags; an optimization level (``-O 3``, refused as a conflict before) sets no sizes."""
    def argv(*extra: str, engine_args: str | None = None) -> list[str]:
        return ps.vllm_argv(ps.ProfileRequest(model="org/target", engine="vllm", draft="org/draft",
                                              num_speculative_tokens=3, capture_sizes=(8, 16), extra=list(extra),
                                              engine_args=engine_args), build=False)

    dotted = argv("-cc.cudagraph_mode=FULL", "--compilation_config.mode", "3")
    assert "-cc.cudagraph_capture_sizes=[8,16]" in dotted and "--compilation-config" not in dotted
    for level in (["-O", "3"], ["-O3"], ["--optimization-level=3"]):
        whole = argv(*level)
        assert json.loads(whole[whole.index("--compilation-config") + 1]) == {"cudagraph_capture_sizes": [8, 16]}
    for conflict in (["--compilation_config", '{"mode": 3}'], ["-cc={}"], ["-cc.cudagraph_capture_sizes=[4]"],
                     ["-cc.max_cudagraph_capture_size", "64"]):
        with pytest.raises(DsparkError, match="--capture-sizes conflicts with --compilation-config"):
            argv(*conflict)
    with pytest.raises(DsparkError, match="vLLM keeps only the dotted ones"):
        argv("-cc.cudagraph_mode=FULL", engine_args='{"compilation_config": {"mode": 3}}')


def test_embedded_engine_reads_the_seed_json_shapes() -> None:
    cfg = ps.embedded_config(ps.ProfileRequest(
        model="tiny", speculative_config='{"method": "dspark", "model": "auto", "num_speculative_tokens": 3}',
        engine_args='{"max_num_seqs": 16, "dtype": "float32", "trust_remote_code": true, '
                    '"compilation_config": {"max_cudagraph_capture_size": 32}}', max_model_len=256))
    assert (cfg.draft, cfg.num_speculative_tokens, cfg.max_num_seqs, cfg.max_capture_size) == ("auto", 3, 16, 32)
    assert cfg.max_model_len == 256
    explicit = ps.embedded_config(ps.ProfileRequest(model="tiny", num_speculative_tokens=2,
                                                    speculative_config='{"num_speculative_tokens": 5}'))
    assert explicit.num_speculative_tokens == 2  # flags win over the JSON


def test_serve_dry_run_prints_the_vllm_command() -> None:
    result = runner.invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "org/target",
                                 "--tensor-parallel-size", "4"])
    assert result.exit_code == 0, result.output
    cmd = shlex.split(result.output.strip())
    assert cmd[:3] == ["vllm", "serve", "org/target"] and "--tensor-parallel-size" in cmd
    refused = runner.invoke(app, ["serve", "--dry-run", "--model", "tiny"])
    assert isinstance(refused.exception, DsparkError) and "--engine vllm" in str(refused.exception)


def test_graph_replay_path_profiles_the_staircase_and_eager_points_beyond() -> None:
    # emulate_graphs routes decode forwards through the CUDA-graph families' static buffers (no capture):
    # the profiler then sees capture sizes, pads like the engine does and goes eager past the limit.
    cfg = EngineConfig(model="tiny", num_speculative_tokens=2, max_num_seqs=4, max_model_len=256, device="cpu",
                       capture_sizes=(2, 4, 12))
    with LLMEngine(cfg) as e:
        e.runner.emulate_graphs()
        assert e.runner.capture_sizes == [2, 4, 12]
        curve = prof.profile_sps(e, warmup=2, iters=7)  # medians of 7: a CPU hiccup at 2 tokens flattened a median of 3
    assert curve.capture_sizes == (2, 4, 12) and curve.capture_limit == 12
    assert [x for x, _ in curve.verify_ms] == [2, 4, 12, 18, 24]
    assert curve.meta["cuda_graphs"] is True and curve.meta["capture_limit"] == 12
    # priced as a staircase that rounds up to the next captured size
    assert curve.verify_cost_ms(3) == curve.verify_cost_ms(4)


def test_the_speculative_configs_dspark_keys_are_checked_as_serve_checks_them(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    for spec, match in (('{"num_speculative_tokens": 3, "dspark_typo": 1}', "unknown key"),
                        ('{"dspark_capacity_verification_mode": "bogus"}', "expected one of none, mask, varlen")):
        result = _invoke(["tiny", "--speculative-config", spec, "-o", str(out)])
        assert isinstance(result.exception, DsparkError) and match in str(result.exception)
    assert not out.exists()


def test_output_paths_are_checked_before_the_profile_runs(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for args, match in ((["-o", str(afile / "x.json")], "--output .*cannot write there"),
                        (["-o", str(tmp_path / "c.json"), "--plot", str(afile / "p.png")], "--plot .*cannot write"),
                        (["-o", str(tmp_path / "c.json"), "--plot", str(tmp_path / "p.xyz")], r"cannot write \.xyz"),
                        # the plot would overwrite the curve it draws (a finished profile lost)
                        (["-o", str(tmp_path / "c.png"), "--plot", str(tmp_path / "c.png")],
                         "--plot and -o/--output are both")):
        result = _invoke(["tiny", *args])
        assert isinstance(result.exception, DsparkError), result.output
        assert re.search(match, str(result.exception))
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "c.png").exists()  # refused before any measurement


def test_vllm_dry_run_makes_no_model_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Like `dspark serve --engine vllm --dry-run`, the profiler's dry run names the vLLM-ready copies of the
    toolkit's models and writes nothing."""
    monkeypatch.setenv("DSPARK_VLLM_MODELS", str(tmp_path / "vm"))
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    result = _invoke(["tiny", "--engine", "vllm", "-k", "3", "--dry-run", "-o", str(tmp_path / "c.json")])
    assert result.exit_code == 0, result.output
    cmd = shlex.split(result.stdout.strip().splitlines()[-1])
    assert Path(cmd[3]).parent == tmp_path / "vm"
    assert Path(json.loads(cmd[cmd.index("--speculative-config") + 1])["model"]).parent == tmp_path / "vm"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
