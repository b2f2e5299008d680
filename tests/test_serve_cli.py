"""`dspark serve` at the command line: one-line errors, the vLLM hand-off, port conflicts."""

from __future__ import annotations

import importlib.machinery
import json
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError

runner = CliRunner()


def _invoke(args: list[str]) -> Any:
    return runner.invoke(app, ["serve", *args])


def test_bad_flag_is_one_line_error_and_exit_1() -> None:
    proc = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "serve", "--capacity-mode", "fast"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: --capacity-mode: expected one of none, mask, varlen")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--speculative-config", '{"dspark_foo": 1}'], "unknown key"),
        (["--tensor-parallel-size", "4"], "unknown option"),
        (["--model", "/definitely/not/a/model"], "neither a known model"),
        (["--draft", "/no/draft"], "--draft"),
        (["--sps-curve", "/no/curve.json"], "--sps-curve"),
        (["--capacity-mode", "varlen"], "needs an SPS curve"),
        (["-k", "-1"], "--num-speculative-tokens"),
        (["--scheduler-delay-factor", "-1"], "--scheduler-delay-factor"),
        (["--engine", "vllm", "--scheduler-delay-factor", "2"], "embedded-engine setting"),
        (["--attention-backend", "flash"], "--attention-backend"),
        (["--engine", "vllm", "--attention-backend", "triton"], "embedded-engine setting"),
        (["--phase-timing", "wall"], "--phase-timing"),
        (["--engine", "vllm", "--phase-timing", "host"], "embedded-engine setting"),
        (["--engine", "vllm", "--mixed-prefill"], "embedded-engine setting"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be <= 1"),
        (["--engine", "vllm", "--device", "cuda"], "embedded-engine setting"),
        # checked before any weights load (a file where a folder should be)
        (["--record-traces", "/proc/version/t.jsonl"], "--record-traces /proc/version/t.jsonl: cannot write there"),
        # traces are appended: rows after a curve would leave both unreadable
        (["--record-traces", "{curve}"], "holds something other than traces (line 1: not valid JSON"),
        # and rows of another K would leave the file unreadable as one fit
        (["--record-traces", "{k4}", "-k", "8"], "holds traces of K=4 and this server drafts K=8"),
        (["--record-traces", "{k4}"], None),  # the default K (4) appends
    ],
)
def test_errors_raise_dspark_error(args: list[str], match: str | None, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    curve = tmp_path / "sps_curve.json"
    curve.write_text('{\n  "version": 1\n}\n')
    (tmp_path / "k4.jsonl").write_text('{"conf": [0.9, 0.8, 0.7, 0.6], "verified": 4, "accepted": 2}\n')
    if "{k4}" in args:  # checked before the engine starts, which this test never lets happen
        from dspark_cli import serve_config

        def stop(*_: Any) -> None:
            raise DsparkError("checks passed")

        monkeypatch.setattr(serve_config, "prepare_embedded", stop)
        match = match or "checks passed"
    args = [a.replace("{curve}", str(curve)).replace("{k4}", str(tmp_path / "k4.jsonl")) for a in args]
    result = _invoke(args)
    assert isinstance(result.exception, DsparkError), result.output
    assert match in str(result.exception)


def test_vllm_engine_hands_settings_and_unknown_options_to_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, list[str]]] = []
    mod = types.ModuleType("dspark_cli.engines.vllm.launcher")
    mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, loader=None)

    def run_vllm_serve(settings: Any, extra: list[str]) -> int:
        calls.append((settings, extra))
        return 0

    mod.run_vllm_serve = run_vllm_serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    spec = {"method": "dspark", "model": "org/draft", "num_speculative_tokens": 7,
            "dspark_capacity_verification_mode": "varlen", "dspark_sps_curve": [[8, 100.0], [64, 50.0]]}
    result = _invoke(["--engine", "vllm", "--model", "org/target", "--speculative-config", json.dumps(spec),
                      "--tensor-parallel-size", "4", "--", "--enforce-eager"])
    assert result.exit_code == 0, result.output
    (settings, extra), = calls
    assert extra == ["--tensor-parallel-size", "4", "--enforce-eager"]
    assert settings.engine == "vllm" and settings.model == "org/target" and settings.draft == "org/draft"
    assert settings.capacity_mode == "varlen" and settings.num_speculative_tokens == 7
    assert "dspark_sps_curve" not in settings.vllm_speculative_config
    assert settings.dspark_keys()["dspark_sps_curve"] == [[8, 100.0], [64, 50.0]]


def test_port_in_use_is_a_clean_error(tmp_path: Path) -> None:
    # Binding happens before any weights load, so a stub checkpoint dir is enough to reach it.
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        result = _invoke(["--model", str(tmp_path), "--draft", "none", "--port", str(port), "--device", "cpu"])
    assert isinstance(result.exception, DsparkError), result.output
    assert f"cannot listen on 127.0.0.1:{port}" in str(result.exception)


def test_engine_load_failure_is_a_clean_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # passes the early check, fails to load
    result = _invoke(["--model", str(tmp_path), "--draft", "none", "--port", "0", "--device", "cpu"])
    assert isinstance(result.exception, DsparkError), result.output
    assert "\n" not in str(result.exception)
    assert "dspark serve" in result.output  # the banner was shown before loading


def test_settings_reach_the_real_vllm_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    """The hand-off contract with the vLLM launcher: dspark_* keys move into --additional-config."""
    launcher = pytest.importorskip("dspark_cli.engines.vllm.launcher")
    from dspark_cli.serve_config import build_settings

    spec = {"method": "dspark", "model": "org/draft", "num_speculative_tokens": 7, "attention_backend": "FLASH_ATTN",
            "dspark_capacity_verification_mode": "mask", "dspark_sps_curve": [[8, 100.0], [64, 50.0]],
            "dspark_online_sts": True}
    settings = build_settings({"engine": "vllm", "model": "org/target", "port": 8011}, json.dumps(spec))
    assert launcher.run_vllm_serve(settings, ["--tensor-parallel-size", "4"], dry_run=True) == 0
    cmd = capsys.readouterr().out
    assert cmd.startswith("vllm serve org/target") and "--port 8011" in cmd and "--tensor-parallel-size 4" in cmd
    spec_json = cmd.split("--speculative-config ")[1].split("'")[1]
    assert not any(k.startswith("dspark_") for k in json.loads(spec_json))
    assert '"mode":"mask"' in cmd


@pytest.mark.parametrize("args", [["--engine", "vllm", "--dry-run", "org/target", "--port", "8011"],
                                  ["--engine", "vllm", "--dry-run", "--tokenizer", "org/t", "--port", "1", "org/target"],
                                  ["-k", "3", "org/target", "--", "--kv-cache-dtype", "fp8"],
                                  ["org/target"]])
def test_a_model_given_as_a_bare_word_is_refused(args: list[str]) -> None:
    """`dspark serve MODEL` would serve the default model (the word dropped, or handed to vLLM as a second model)."""
    result = _invoke(args)
    assert isinstance(result.exception, DsparkError), result.output
    message = str(result.exception)
    assert "got 'org/target'" in message and "--model org/target" in message and "\n" not in message


def test_gpu_memory_utilization_reaches_vllm_as_its_own_flag() -> None:
    """A `vllm serve` command line copied over keeps --gpu-memory-utilization's meaning: vLLM's flag."""
    result = _invoke(["--engine", "vllm", "--dry-run", "--model", "org/target", "--gpu-memory-utilization", "0.5",
                      "-k", "0", "--", "--enforce-eager"])
    assert result.exit_code == 0, result.output
    cmd = result.stdout.strip().splitlines()[-1].split()
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.5" and cmd.count("--gpu-memory-utilization") == 1
    assert cmd[-1] == "--enforce-eager"


def test_words_after_the_double_dash_still_reach_vllm() -> None:
    result = _invoke(["--engine", "vllm", "--dry-run", "--model", "org/target", "--tensor-parallel-size", "4",
                      "-k", "0", "--", "--enforce-eager", "extra-word"])
    assert result.exit_code == 0, result.output
    cmd = result.stdout.strip().splitlines()[-1].split()
    assert cmd[:3] == ["vllm", "serve", "org/target"] and cmd[-3:] == ["4", "--enforce-eager", "extra-word"]


def test_check_says_whether_a_server_would_start_and_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import dspark_cli.engines.embedded.server as server

    def no_serve(*args: object, **kwargs: object) -> None:
        raise AssertionError("--check started the server")

    monkeypatch.setattr(server, "run_server", no_serve)
    assert _invoke(["--model", "tiny", "--check"]).exit_code == 0
    assert _invoke(["--engine", "vllm", "--model", "m", "--check"]).exit_code == 0
    refused = _invoke(["--model", "tiny", "--draft", "none", "--capacity-mode", "mask", "--check"])
    assert "needs speculation" in str(refused.exception)
    # what only the launch's own checks find (a draft that names no model), before any weight loads
    missing = _invoke(["--model", "tiny", "--draft", "/nonexistent/d", "--check"])
    assert "neither a known model" in str(missing.exception)
