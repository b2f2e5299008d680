"""`dspark bench` at the command line: flags given where they do nothing are said, and the ones that would be
overridden or misread are refused, before any server starts or any request is sent."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError

runner = CliRunner()


def _bench(*args: str) -> object:
    return runner.invoke(app, ["bench", *args])


def test_serve_args_that_bench_sets_itself_are_refused(tmp_path: Path) -> None:
    for flag in ("--port", "--host"):
        result = _bench("--serve", "--serve-args", f"--model tiny {flag} 9000", "-o", str(tmp_path / "r"))
        assert isinstance(result.exception, DsparkError)
        assert str(result.exception).startswith(f"--serve-args {flag}: bench picks each server's")
    assert not (tmp_path / "r").exists()


def test_a_request_model_name_is_not_taken_for_the_model_to_serve(tmp_path: Path) -> None:
    # --model names the model in requests: the default server then answered 404 to every request of every cell
    result = _bench("--serve", "--model", "tiny", "-o", str(tmp_path / "r"))
    assert isinstance(result.exception, DsparkError)
    assert str(result.exception) == "--model names the model in requests; to serve tiny, pass --serve-args '--model tiny'"


def test_simulate_only_flags_with_a_server_are_said(tmp_path: Path) -> None:
    # nothing listens on this port: the warning comes first, then the one-line failure to reach it
    result = _bench("--base-url", "http://127.0.0.1:9", "-k", "7", "--policies", "manager", "-c", "1", "-n", "1",
                    "-o", str(tmp_path / "r"))
    said = " ".join(result.stderr.split())
    assert "warning: -k, --policies: only used with --simulate; a server's settings go in --serve-args" in said


def test_a_curve_a_running_server_never_reads_is_said(tmp_path: Path) -> None:
    result = _bench("--base-url", "http://127.0.0.1:9", "--sps-curve", str(tmp_path / "none.json"), "-c", "1",
                    "-n", "1", "-o", str(tmp_path / "r"))
    said = " ".join(result.stderr.split())
    assert "warning: --sps-curve: for the servers --serve starts; ignored with --base-url" in said


def test_interleave_with_a_port_is_refused_before_any_folder_is_made(tmp_path: Path) -> None:
    result = _bench("--serve", "--interleave", "--port", "8123", "--configs", "none", "-c", "1", "-n", "4",
                    "-o", str(tmp_path / "r"))
    assert isinstance(result.exception, DsparkError)
    assert str(result.exception).startswith("--interleave runs every config's server at once")
    assert not (tmp_path / "r").exists()


def test_a_port_out_of_range_is_one_clear_line(tmp_path: Path) -> None:
    # 70000 was served on port 4464 (70000 - 65536), and -1 was blamed on --host 127.0.0.1
    for port in ("70000", "-1", "0"):
        result = _bench("--serve", "--serve-args", "--model tiny", "--port", port, "-o", str(tmp_path / "r"))
        assert isinstance(result.exception, DsparkError), result.output
        assert str(result.exception) == f"--port must be in 1..65535, got {port}"
    assert not (tmp_path / "r").exists()


def test_a_dataset_flag_another_dataset_does_not_use_is_said_and_kept_out_of_the_workload(
        tmp_path: Path, monkeypatch: object) -> None:
    # --speed-bench-category with gsm8k did nothing, was not said, and was recorded in the workload: the same
    # command without it was then refused the folder ("different workload")
    from dspark_cli.bench import matrix as mx

    seen = []

    def stop(spec: mx.MatrixSpec, *args: object, **kwargs: object) -> None:
        seen.append(spec.workload)
        raise DsparkError("stopped here")

    monkeypatch.setattr(mx, "run_matrix", stop)  # type: ignore[attr-defined]
    result = _bench("--base-url", "http://127.0.0.1:9", "--speed-bench-category", "coding", "--input-len", "64",
                    "-c", "1", "-n", "1", "-o", str(tmp_path / "r"))
    said = " ".join(result.stderr.split())
    assert "warning: --speed-bench-category, --input-len: not used by --dataset gsm8k" in said
    assert seen and seen[0]["speed_bench_category"] is None and seen[0]["input_len"] is None


def test_a_config_whose_server_would_refuse_its_settings_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    # --draft none in the shared flags: the mask server refuses to start ("needs speculation"), which was found only
    # after the whole none column had been measured
    import subprocess
    import sys

    res = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "bench", "--serve", "--configs", "none,mask",
                           "--sps-curve", "auto", "--serve-args", "--model tiny --device cpu --draft none", "-c", "1",
                           "-n", "1", "--max-tokens", "4", "-o", str(res)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    said = " ".join(proc.stderr.split())
    assert "config mask: its server would refuse its settings (error: --capacity-mode mask needs speculation" in said
    assert not (res / "logs").exists() or not any((res / "logs").iterdir())
    assert "cells" not in proc.stdout + proc.stderr  # no progress bar above the error: no run began


def test_a_run_stopped_by_an_error_titles_its_summary_so_not_interrupted(
        tmp_path: Path, monkeypatch: object) -> None:
    # a server that failed to start after a column was measured left a summary titled "interrupted"
    from dspark_cli.bench import matrix as mx
    from dspark_cli.fileio import atomic_write_json

    def one_cell_then_an_error(spec: mx.MatrixSpec, *args: object, hooks: mx.Hooks, **kwargs: object) -> None:
        c = spec.concurrencies[0]
        cell = {"dspark_bench_cell": mx.CELL_FORMAT, "config": spec.configs[0].name, "concurrency": c,
                "metrics": {"output_tok_s": 10.0, "itl_ms": {"mean": 5.0}, "per_user_tok_s": 10.0, "failed": 0,
                            "completed": 1},
                "spec_decode": None, "workload": spec.workload, "prompts_sha256": spec.cell_prompts_sha256(c)}
        atomic_write_json(mx.cell_path(spec.results_dir, spec.configs[0].name, c), cell)
        hooks.cell_done(cell)
        raise DsparkError("the next server would not start")

    monkeypatch.setattr(mx, "run_matrix", one_cell_then_an_error)  # type: ignore[attr-defined]
    result = _bench("--base-url", "http://127.0.0.1:9", "-c", "1", "-n", "1", "--no-plots", "-o", str(tmp_path / "r"))
    assert str(result.exception) == "the next server would not start"
    md = (tmp_path / "r" / "summary.md").read_text()
    assert "stopped by an error: finished cells only" in md and "interrupted" not in md


def test_a_label_and_a_curve_that_no_served_config_reads_are_said(tmp_path: Path, monkeypatch: object) -> None:
    from dspark_cli.bench import matrix as mx

    def stop(*args: object, **kwargs: object) -> None:
        raise DsparkError("stopped here")

    monkeypatch.setattr(mx, "run_matrix", stop)  # type: ignore[attr-defined]
    result = _bench("--serve", "--configs", "nospec,none", "--sps-curve", str(tmp_path / "missing.json"), "--label",
                    "mine", "--serve-args", "--model tiny", "-c", "1", "-n", "1", "-o", str(tmp_path / "r"))
    said = " ".join(result.stderr.split())
    assert "warning: --label: names the --base-url server's column" in said
    assert "warning: --sps-curve: no config of --configs nospec,none reads it (only mask and varlen ones do)" in said
