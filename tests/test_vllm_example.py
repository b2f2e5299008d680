"""The DeepSeek-V4-Flash example prints exactly the seed's vLLM command lines (plus our translation)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.vllm.launcher import run_vllm_serve
from dspark_cli.engines.vllm.profile import build_profile_command

RUN_SH = Path(__file__).resolve().parents[1] / "examples" / "deepseek-v4-flash" / "run.sh"
TARGET = "nvidia/DeepSeek-V4-Flash-NVFP4"
DRAFT = "deepseek-ai/DeepSeek-V4-Flash-DSpark"
# The seed's `vllm serve` engine flags, verbatim.
SEED_FLAGS = shlex.split(
    f"--port 8011 --tokenizer {TARGET} --tokenizer-mode deepseek_v4 --trust-remote-code "
    "--dtype bfloat16 --max-model-len 8192 --tensor-parallel-size 4 "
    "--enable-expert-parallel --block-size 256 --gpu-memory-utilization 0.5 "
    "--kv-cache-dtype fp8 --max-num-batched-tokens 16384 --max-num-seqs 256 "
    "--compilation-config '{\"max_cudagraph_capture_size\": 2048}' --moe-backend flashinfer_trtllm"
)


def _script_argv(expr: str) -> list[str]:
    """Evaluate the script's variable block in bash and return ``expr``'s words (NUL-separated)."""
    block = RUN_SH.read_text().split("PROFILE_SPEC=")[0].split('cd "$(dirname "$0")"')[1]
    out = subprocess.run(["bash", "-c", block + f'\nprintf "%s\\0" {expr}'], capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


def _flag_pairs(cmd: list[str]) -> list[tuple[str, str | None]]:
    pairs: list[tuple[str, str | None]] = []
    for i, tok in enumerate(cmd):
        if tok.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else None
            pairs.append((tok, nxt))
    return pairs


@pytest.mark.parametrize("config, mode, sts", [("nocap", None, False), ("varlen", "varlen", False),
                                                ("mask-sts", "mask", True)])
def test_example_serve_line_matches_the_seed(config: str, mode: str | None, sts: bool, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    SpsCurve.from_points([(8, 5.0), (16, 6.0), (2048, 60.0)], capture_sizes=[8, 16, 2048]).save(tmp_path / "sps_curve.json")
    monkeypatch.chdir(tmp_path)
    argv = _script_argv(f'"$TARGET" "${{ENGINE[@]}}" --port "$PORT" --speculative-config "${{SPEC[{config}]}}"')
    assert run_vllm_serve(argv, dry_run=True) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[:3] == ["vllm", "serve", TARGET]
    pairs = _flag_pairs(cmd)
    for pair in _flag_pairs(SEED_FLAGS):
        assert pair in pairs, pair
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert {k: spec[k] for k in ("method", "model", "attention_backend", "num_speculative_tokens",
                                 "draft_sample_method")} == {
        "method": "dspark", "model": DRAFT, "attention_backend": "FLASH_ATTN", "num_speculative_tokens": 7,
        "draft_sample_method": "probabilistic"}
    if mode is None:
        assert "--additional-config" not in cmd and "enable_adaptive_verification" not in spec
        return
    assert spec["enable_adaptive_verification"] is True
    assert not any(k.startswith("dspark_") for k in spec)
    dspark = json.loads(cmd[cmd.index("--additional-config") + 1])["dspark"]
    assert dspark["mode"] == mode and dspark["sps_curve"] == str(tmp_path / "sps_curve.json")
    assert dspark.get("online_sts", False) is sts


def test_example_profile_line_keeps_the_engine_flags() -> None:
    argv = _script_argv('"$TARGET" "${ENGINE[@]}" --speculative-config "{$BASE}" --output sps_curve.json')
    cmd = build_profile_command(argv)
    assert cmd[:4] == [sys.executable, "-m", "dspark_cli.engines.vllm.profile", TARGET]
    pairs = _flag_pairs(cmd)
    for pair in _flag_pairs(SEED_FLAGS):
        if pair[0] != "--port":
            assert pair in pairs, pair
    assert ("--output", "sps_curve.json") in pairs and ("--replays", "20") in pairs


def test_example_dry_run_serves_the_target_through_dspark_serve(tmp_path: Path) -> None:
    """The script's own `dspark serve` lines, run as written (DRY_RUN=1): the target reaches vllm serve as its
    one model, each config with its capacity mode."""
    (tmp_path / "run.sh").write_text(RUN_SH.read_text())
    SpsCurve.from_points([(8, 5.0), (16, 6.0), (2048, 60.0)], capture_sizes=[8, 16, 2048]).save(tmp_path / "sps_curve.json")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dspark").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m dspark_cli.cli "$@"\n')
    (bin_dir / "dspark").chmod(0o755)
    env = {**os.environ, "DRY_RUN": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "DSPARK_VLLM_MODELS": str(tmp_path / "vm")}
    out = subprocess.run(["bash", str(tmp_path / "run.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    serve_lines = [shlex.split(line) for line in out.stdout.splitlines() if line.startswith("vllm serve ")]
    assert len(serve_lines) == 5, out.stdout
    for cmd, mode in zip(serve_lines, (None, "mask", "varlen", "mask", "varlen"), strict=True):
        assert cmd[:3] == ["vllm", "serve", TARGET] and cmd[cmd.index("--tokenizer") + 1] == TARGET
        assert cmd[cmd.index("--port") + 1] == "8011"
        pairs = _flag_pairs(cmd)
        for pair in _flag_pairs(SEED_FLAGS):
            assert pair in pairs, pair
        # the one model is the target: every other bare word is the value of the flag before it
        for prev, tok in zip(cmd[2:], cmd[3:], strict=False):
            if not tok.startswith("-"):
                assert prev.startswith("--") and prev not in ("--trust-remote-code", "--enable-expert-parallel"), tok
        assert cmd.count("--speculative-config") == 1
        dspark = json.loads(cmd[cmd.index("--additional-config") + 1])["dspark"] if mode else None
        assert (dspark or {}).get("mode") == mode
    assert not (tmp_path / "vm").exists()
