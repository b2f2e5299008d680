"""`dspark calibrate` end to end (traces JSONL -> sts.json + reliability PNG) and its refusal paths."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from dspark_cli.calibrate import plotted_positions, reliability_curve, run_calibration
from dspark_cli.cli import main
from dspark_cli.errors import DsparkError

T_STAR = [2.5, 0.5, 2.0]


def synth_traces(seed: int, n: int, t_star: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows from a known miscalibration: position k survives (given its prefix) with probability
    sigmoid(logit(c_k) / T*_k); the recording engine verified a random number of drafts."""
    rng = np.random.default_rng(seed)
    k = len(t_star)
    logit = rng.normal(1.5, 2.0, size=(n, k))
    conf = 1.0 / (1.0 + np.exp(-logit))
    accept = rng.random((n, k)) < 1.0 / (1.0 + np.exp(-logit / np.array(t_star)))
    run = np.argmin(np.c_[accept, np.zeros((n, 1), dtype=bool)], axis=1)
    verified = rng.integers(1, k + 1, size=n)
    return conf, verified, np.minimum(run, verified)


def write_traces(path: Path, conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> Path:
    with path.open("wb") as fh:
        for i in range(len(conf)):
            fh.write(orjson.dumps({"request": f"r{i // 16}", "step": i % 16, "conf": conf[i].round(6).tolist(),
                                   "verified": int(verified[i]), "accepted": int(accepted[i])},
                                  option=orjson.OPT_APPEND_NEWLINE))
    return path


def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run the real console entry point in-process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["dspark", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_calibrate_cli_recovers_t_star_and_cuts_ece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    conf, v, a = synth_traces(0, 30000, T_STAR)
    half = len(conf) // 2  # two files: calibrate reads several, like traces from two engines
    f1 = write_traces(tmp_path / "a.jsonl", conf[:half], v[:half], a[:half])
    f2 = write_traces(tmp_path / "b.jsonl", conf[half:], v[half:], a[half:])
    out, png = tmp_path / "out" / "sts.json", tmp_path / "rel.png"
    code, stdout, err = run_cli(monkeypatch, capsys, "calibrate", str(f1), str(f2), "-o", str(out),
                                "--plot", str(png))
    assert code == 0, err
    assert "ECE before" in stdout and "AUC" in stdout
    sts = json.loads(out.read_text())
    assert sts["version"] == 1 and sts["temperatures"] == sts["sts_temperatures"]
    assert sts["num_rows"] == 30000 and len(sts["temperatures"]) == 3
    for k, t in enumerate(T_STAR):
        assert abs(math.log(sts["temperatures"][k] / t)) < 0.2, sts["temperatures"]
        assert sts["ece_after"][k] * 3 <= sts["ece_before"][k], (sts["ece_before"], sts["ece_after"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        ([b'{"conf": [0.5, 0.5], "verified": 2, "accepted": 1}', b'{"conf": [0.5, 0.5], "verified": 3'],
         "bad.jsonl:2: not valid JSON"),
        ([b'{"conf": [0.5, 0.5], "verified": 2, "accepted": 1}', b'{"conf": [0.5], "verified": 1, "accepted": 1}'],
         "bad.jsonl:2: 'conf' has 1 positions but earlier rows have 2"),
        ([b'{"conf": [0.5, 0.5], "verified": 1, "accepted": 2}'], "bad.jsonl:1: needs 0 <= accepted <= verified"),
    ],
    ids=["malformed-json", "inconsistent-k", "counts-out-of-range"],
)
def test_malformed_input_fails_with_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str], lines: list[bytes],
                                                  needle: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "sts.json"
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(bad), "-o", str(out))
    assert code == 1
    assert needle in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and not out.exists()


def test_inconsistent_k_across_files_names_the_second_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text('{"conf": [0.5, 0.5], "verified": 2, "accepted": 1}\n')
    b.write_text('\n{"conf": [0.5, 0.5, 0.5], "verified": 2, "accepted": 1}\n')
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(a), str(b), "-o", str(tmp_path / "s.json"))
    assert code == 1 and f"{b}:2:" in err and "earlier rows have 2" in err


def test_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(missing), "-o", str(tmp_path / "s.json"))
    assert code == 1 and f"{missing}: cannot read traces" in err and err.count("\n") == 1


def test_empty_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(empty), "-o", str(tmp_path / "s.json"))
    assert code == 1 and "no trace records" in err and str(empty) in err


def test_nothing_verified_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"conf": [0.9, 0.8], "verified": 0, "accepted": 0}\n' * 3)
    with pytest.raises(DsparkError, match="verified any draft"):
        run_calibration([f], tmp_path / "s.json")


def test_skip_invalid_reports_the_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    conf, v, a = synth_traces(1, 400, [1.0, 1.0])
    f = write_traces(tmp_path / "t.jsonl", conf, v, a)
    with f.open("ab") as fh:
        fh.write(b"garbage\n")
        fh.write(b'{"conf": [0.5, 0.5, 0.5], "verified": 1, "accepted": 0}\n')  # wrong K
        fh.write(b'{"conf": [0.5, 1.5], "verified": 1, "accepted": 0}\n')  # not a probability
    out = tmp_path / "sts.json"
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(f), "-o", str(out))
    assert code == 1 and f"{f}:401:" in err
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(f), "-o", str(out), "--skip-invalid")
    assert code == 0 and "skipped 3 invalid trace lines" in err
    assert json.loads(out.read_text())["num_rows"] == 400
    # Everything invalid: still refused, and the skipped count is in the message.
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text("x\ny\n")
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(only_bad), "--skip-invalid",
                           "-o", str(tmp_path / "s2.json"))
    assert code == 1 and "2 invalid lines skipped" in err


def test_bad_bins_and_no_files(tmp_path: Path) -> None:
    with pytest.raises(DsparkError, match="--bins"):
        run_calibration([tmp_path / "x.jsonl"], tmp_path / "s.json", bins=1)
    with pytest.raises(DsparkError, match=r"--bins must be in 2\.\.1000, got 100000000"):  # a 191 GiB table
        run_calibration([tmp_path / "x.jsonl"], tmp_path / "s.json", bins=100_000_000)
    with pytest.raises(DsparkError, match="no trace files"):
        run_calibration([], tmp_path / "s.json")


def test_reliability_helpers() -> None:
    assert plotted_positions(3) == [1, 2, 3]
    assert plotted_positions(8) == [1, 3, 6, 8]
    x, y, n = reliability_curve(np.array([0.1, 0.12, 0.9]), np.array([0.0, 1.0, 1.0]), bins=10)
    assert np.allclose(x, [0.11, 0.9]) and np.allclose(y, [0.5, 1.0]) and n.tolist() == [2, 1]


def three_records(path: Path) -> Path:
    path.write_text('{"conf": [0.9, 0.8], "verified": 2, "accepted": 2}\n'
                    '{"conf": [0.7, 0.6], "verified": 2, "accepted": 1}\n'
                    '{"conf": [0.5, 0.4], "verified": 1, "accepted": 0}\n')
    return path


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-o", "cdir"], "-o/--output cdir is a folder; name the file to write"),
        (["-o", "afile/s.json"], "-o/--output afile/s.json: cannot write there"),
        (["-o", "afile/deeper/s.json"], "-o/--output afile/deeper/s.json: cannot write there"),
        (["--plot", "cdir"], "--plot cdir is a folder; name the file to write"),
        (["--plot", "afile/r.png"], "--plot afile/r.png: cannot write there"),
        (["--plot", "rel.xyz"], "--plot rel.xyz: matplotlib cannot write .xyz; use one of"),
        (["-o", "same.png", "--plot", "same.png"], "--plot and -o/--output are both same.png"),
    ],
    ids=["output-folder", "output-under-file", "output-deep-under-file", "plot-folder", "plot-under-file",
         "plot-bad-suffix", "same-path"],
)
def test_bad_output_paths_are_refused_before_reading_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cdir").mkdir()
    (tmp_path / "afile").write_text("x")
    traces = three_records(tmp_path / "t.jsonl")

    def no_reading(*_: object, **__: object) -> None:
        raise AssertionError("traces were read before the output paths were checked")

    monkeypatch.setattr("dspark_cli.calibrate.read_traces", no_reading)
    if "-o" not in args:
        args = [*args, "-o", "s.json"]
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(traces), *args)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err and not (tmp_path / "s.json").exists()
    assert sorted(p.name for p in (tmp_path / "cdir").iterdir()) == []


@pytest.mark.parametrize(("name", "magic"), [("relnoext", b"\x89PNG"), ("rel.pdf", b"%PDF"), ("rel.svg", b"<?xml")])
def test_plot_path_printed_is_the_file_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str], name: str, magic: bytes) -> None:
    conf, v, a = synth_traces(2, 400, [1.0, 1.0])
    traces = write_traces(tmp_path / "t.jsonl", conf, v, a)
    out = tmp_path / "s.json"
    code, stdout, err = run_cli(monkeypatch, capsys, "calibrate", str(traces), "-o", str(out),
                                "--plot", str(tmp_path / name))
    assert code == 0, err
    wrote = next(line for line in stdout.splitlines() if line.startswith("wrote "))
    printed = [Path(p) for p in wrote.removeprefix("wrote ").split(", ")]
    assert printed[0] == out and len(printed) == 2
    assert printed[1].is_file() and printed[1].read_bytes().startswith(magic)
    # Nothing else was written next to it (no silently added suffix).
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "s.json", "t.jsonl"])


def test_untrusted_fits_warn_but_still_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    code, stdout, err = run_cli(monkeypatch, capsys, "calibrate", str(three_records(tmp_path / "t.jsonl")),
                                "-o", str(out))
    assert code == 0 and out.is_file() and "wrote" in stdout
    assert "warning: position 1: only 3 verified rows (fewer than 100)" in err
    assert "warning: position 2: only 2 verified rows" in err
    # All-0/1 confidences with mixed outcomes drive T to the grid's top edge.
    sat = tmp_path / "sat.jsonl"
    sat.write_text("".join(f'{{"conf": [1.0], "verified": 1, "accepted": {i % 2}}}\n' for i in range(300)))
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(sat), "-o", str(out))
    assert code == 0 and json.loads(out.read_text())["temperatures"] == [20.0]
    assert "warning: position 1: T=20 is at the edge of the searched range [0.05, 20]" in err
    assert "do not trust this temperature" in err and err.count("\n") == 1
    # A healthy fit stays quiet.
    conf, v, a = synth_traces(3, 3000, [1.0, 1.0])
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(write_traces(tmp_path / "ok.jsonl", conf, v, a)),
                           "-o", str(out))
    assert code == 0 and "warning" not in err


def test_folders_without_jsonl_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    nest = tmp_path / "nest"
    (nest / "sub").mkdir(parents=True)
    three_records(nest / "sub" / "a.jsonl")
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(nest), "-o", str(tmp_path / "s.json"))
    assert code == 1 and err.count("\n") == 1
    assert f"no *.jsonl files in {nest} (sub-folders are not searched)" in err and str(nest / "sub") in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(empty), "-o", str(tmp_path / "s.json"))
    assert code == 1 and f"no *.jsonl files in {empty}; record traces" in err
    # The folder the hint names does work.
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(nest / "sub"), "-o", str(tmp_path / "s.json"))
    assert code == 0, err


def test_write_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    def full_disk(*_: object, **__: object) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("dspark_cli.core.sts.atomic_write_json", full_disk)
    out = tmp_path / "s.json"
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(three_records(tmp_path / "t.jsonl")), "-o", str(out))
    assert code == 1 and err == f"error: cannot write {out}: No space left on device\n"


def test_readme_says_the_diagram_needs_plot() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `dspark calibrate`"))
    assert "`--plot" in row and "plus a reliability diagram" not in row


def test_outputs_that_would_replace_or_join_the_traces_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    conf, v, a = synth_traces(2, 400, [1.0, 1.0])
    folder = tmp_path / "traces"
    folder.mkdir()
    traces = write_traces(folder / "t.jsonl", conf, v, a)
    before = traces.read_bytes()
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(traces), "-o", str(traces))
    assert code == 1 and "is also a trace input" in err and err.count("\n") == 1
    assert traces.read_bytes() == before  # the traces were not replaced by sts.json
    code, _, err = run_cli(monkeypatch, capsys, "calibrate", str(folder), "-o", str(folder / "sts.jsonl"))
    assert code == 1 and "would read it as traces" in err and not (folder / "sts.jsonl").exists()
    # an input given twice is read once: the fit counts each record once
    result = run_calibration([traces, traces], tmp_path / "s.json")
    assert result.num_records == 400 and result.fit.num_rows == 400


def test_inputs_and_outputs_expand_home_and_a_trailing_separator_names_a_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    conf, v, a = synth_traces(3, 3000, T_STAR)
    write_traces(tmp_path / "t.jsonl", conf, v, a)
    code, out, err = run_cli(monkeypatch, capsys, "calibrate", "~/t.jsonl", "-o", "~/sts.json")
    assert code == 0, err
    assert len(json.loads((tmp_path / "sts.json").read_text())["temperatures"]) == len(T_STAR)
    code, out, err = run_cli(monkeypatch, capsys, "calibrate", str(tmp_path / "t.jsonl"), "-o", f"{tmp_path}/new/")
    assert code == 1 and "is a folder; name the file to write" in err and not (tmp_path / "new").exists()
    code, out, err = run_cli(monkeypatch, capsys, "calibrate", str(tmp_path / "t.jsonl"), "-o", str(tmp_path / "s.json"),
                             "--plot", f"{tmp_path}/fig/")
    assert code == 1 and "--plot" in err and "is a folder; name the file to write" in err
    assert not (tmp_path / "fig").exists() and not (tmp_path / "s.json").exists()


def test_a_diagram_that_cannot_be_written_says_the_temperatures_were(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf, v, a = synth_traces(4, 3000, T_STAR)
    traces = write_traces(tmp_path / "t.jsonl", conf, v, a)

    def full_disk(fig: object, path: Path) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("dspark_cli.calibrate.atomic_write_figure", full_disk)
    with pytest.raises(DsparkError, match=r"No space left on device; .*sts\.json was written"):
        run_calibration([traces], tmp_path / "sts.json", plot=tmp_path / "r.png")
    assert (tmp_path / "sts.json").is_file()
