"""End to end on CPU: `dspark bench --serve` and `dspark eval gsm8k` against real `dspark serve --model tiny`.

Kept small (a few prompts, short outputs) -- these check plumbing (servers start/stop, cells resume, files and
tables appear), not speed. Skipped until the packaged tiny model pair exists.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

import dspark_cli
from dspark_cli.bench.matrix import ServerProcess, _free_port
from dspark_cli.fileio import read_json

TINY = Path(dspark_cli.__file__).parent / "engines" / "embedded" / "assets" / "tiny"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TINY.is_dir() and any(TINY.iterdir())), reason="packaged tiny model not built"),
]
SERVE_ARGS = "--model tiny --device cpu --seed 0 --max-num-seqs 4"
DSPARK = [sys.executable, "-m", "dspark_cli.cli"]


def _bench(results: Path, configs: str, *extra: str) -> list[str]:
    return [*DSPARK, "bench", "--serve", "--configs", configs, "--serve-args", SERVE_ARGS, "-c", "1,2",
            "-n", "3", "--max-tokens", "8", "--warmup-prompts", "1", "--results-dir", str(results),
            "--server-timeout", "300", *extra]


def _server_alive(port: str) -> bool:
    """Any process of ours still serving on ``port`` (scans /proc: the bench must leave none behind)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and port.encode() in args and b"--port" in args:
            return True
    return False


def test_serve_matrix_table_json_plots_and_resume(tmp_path: Path) -> None:
    results = tmp_path / "res"
    first = subprocess.run(_bench(results, "none"), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(p.name for p in (results / "cells").iterdir()) == ["none__c1.json", "none__c2.json"]

    # Rerun with one more config: the finished `none` cells are kept, only `nospec` is measured.
    second = subprocess.run(_bench(results, "nospec,none"), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming: 2 of 4 cells" in second.stdout
    assert (results / "logs" / "none.log").read_text().count("$ ") == 1  # its server was not started again

    cells = {p.stem: read_json(p) for p in (results / "cells").iterdir()}
    assert set(cells) == {"none__c1", "none__c2", "nospec__c1", "nospec__c2"}
    for cell in cells.values():
        m = cell["metrics"]
        assert m["completed"] == 3 and m["failed"] == 0
        assert m["total_output_tokens"] == 3 * 8  # --ignore-eos: equal work per cell
        assert m["output_tok_s"] > 0 and m["ttft_ms"]["mean"] > 0
        assert cell["dspark_version"] == dspark_cli.__version__ and cell["started_at"]
        assert "--model" in cell["server"]["serve_args"]
        # the embedded server's own counters over the cell: its steps, and no kernel compiled while serving
        counters = cell["server_counters"]
        assert counters["engine_steps"] > 0 and counters["kernel_compiles{phase=serving}"] == 0
        assert cell["server_gauges"]["kv_blocks_free"] > 0  # gauges: end-of-cell values, not deltas
        # the CPU the client and the started server (its own pid) used over the cell
        use = cell["cpu"]
        assert use["server_pid"] == cell["server"]["pid"] and use["wall_s"] > 0
        assert use["client_share"] > 0 and use["server_share"] > 0
        # a short cell's HTTP loop may use under one clock tick (10 ms): read, not necessarily above 0
        assert use["server_tree_share"] >= use["server_share"] >= use["server_main_share"] >= 0
        assert 0 < use["client_loop_share"] <= use["client_share"]
    assert cells["nospec__c1"]["server"]["serve_args"][-6:-4] == ["-k", "0"]
    spec = cells["none__c2"]["spec_decode"]
    assert spec is not None and spec["num_drafts"] > 0 and 1.0 <= spec["acceptance_length"]
    nospec = cells["nospec__c1"]["spec_decode"]
    assert nospec is None or nospec["acceptance_length"] is None

    summary = read_json(results / "summary.json")
    assert summary["baseline"] == "none" and summary["configs"] == ["nospec", "none"]
    md = (results / "summary.md").read_text()
    assert "| c | No spec | No capacity |" in md
    row = next(line for line in md.splitlines() if line.startswith("| 2 |"))
    nospec_cell, none_cell = row.strip("| ").split(" | ")[1:]
    assert nospec_cell.endswith("%)") and " / - (" in nospec_cell  # Δ vs no capacity, no acceptance length
    assert not none_cell.endswith("%)")
    for png in ("throughput.png", "pareto.png"):
        assert (results / png).read_bytes()[:4] == b"\x89PNG"
    assert "No capacity" in second.stdout
    # --no-plots leaves no plots drawn from an older table beside the new summary
    third = subprocess.run(_bench(results, "nospec,none", "--no-plots"), capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-2000:]
    assert "removed throughput.png, pareto.png" in third.stderr
    assert not (results / "throughput.png").exists() and not (results / "pareto.png").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_matrix_keeps_cells_and_stops_its_server(tmp_path: Path, sig: signal.Signals) -> None:
    results = tmp_path / "res"
    cmd = _bench(results, "none")
    cmd[cmd.index("-n") + 1] = "4"
    cmd[cmd.index("--max-tokens") + 1] = "48"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first_cell = results / "cells" / "none__c1.json"
    deadline = time.monotonic() + 300
    while not first_cell.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first_cell.exists(), proc.communicate()[1][-2000:] if proc.poll() is not None else "no cell in time"
    port = read_json(first_cell)["server"]["base_url"].rsplit(":", 1)[1]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the matrix finished before the interrupt landed")
    assert proc.returncode == 1
    assert "interrupted: 1 of 2 cells finished and kept" in err
    assert first_cell.exists() and not (results / "cells" / "none__c2.json").exists()
    assert not _server_alive(port)
    # the summary is the finished cells' (it said a folder's older state, or nothing, after a stop)
    summary = read_json(results / "summary.json")
    assert [(r["concurrency"], r["cells"]["none"] is not None) for r in summary["rows"]] == [(1, True), (2, False)]
    assert "interrupted: finished cells only" in (results / "summary.md").read_text()



def test_eval_gsm8k_resumes_and_compares(tmp_path: Path) -> None:
    port = _free_port("127.0.0.1")
    cmd = [*DSPARK, "serve", *SERVE_ARGS.split(), "--host", "127.0.0.1", "--port", str(port)]
    out = tmp_path / "tiny.jsonl"
    base = [*DSPARK, "eval", "gsm8k", "--port", str(port), "--num-shots", "2", "--max-tokens", "24",
            "--concurrency", "2", "--output", str(out)]
    with ServerProcess(cmd, tmp_path / "serve.log", f"http://127.0.0.1:{port}", timeout_s=300):
        first = subprocess.run([*base, "--limit", "3"], capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr[-2000:]
        assert "gsm8k 2-shot: strict" in first.stdout and "(n=3)" in first.stdout
        assert len(out.read_text().splitlines()) == 3
        second = subprocess.run([*base, "--limit", "4"], capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "resuming: 3 questions" in second.stdout and "(n=4)" in second.stdout
    assert len(out.read_text().splitlines()) == 4
    # --data: rows from an exported file (a machine without the dataset package), not the package's
    from dspark_cli.data.gsm8k import export_jsonl, load_gsm8k

    rows = load_gsm8k(limit=6)[4:6]
    data = export_jsonl(tmp_path / "rows.jsonl", rows)
    other = tmp_path / "from-file.jsonl"
    # a server under another name: its answers must not join the first server's file on resume
    with ServerProcess([*cmd, "--served-model-name", "other-model"], tmp_path / "serve2.log",
                       f"http://127.0.0.1:{port}", timeout_s=300):
        run = subprocess.run([*base[:-1], str(other), "--data", str(data)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        mixed = subprocess.run([*base, "--limit", "5"], capture_output=True, text=True, timeout=300)
        assert mixed.returncode == 1 and "holds answers of model 'tiny', and this server serves 'other-model'" in (
            " ".join(mixed.stderr.split())), mixed.stderr[-2000:]
        # the same file resumed over other questions (another --data) is refused, and an empty --data too
        import dataclasses

        swapped = [dataclasses.replace(load_gsm8k(limit=1)[0], id=rows[0].id)]  # id 4, another question
        elsewhere = subprocess.run([*base[:-1], str(other), "--data",
                                    str(export_jsonl(tmp_path / "more.jsonl", swapped))],
                                   capture_output=True, text=True, timeout=300)
        assert elsewhere.returncode == 1 and "another question" in elsewhere.stderr, elsewhere.stderr[-2000:]
        (tmp_path / "empty.jsonl").write_text("")
        empty = subprocess.run([*base[:-1], str(tmp_path / "e.jsonl"), "--data", str(tmp_path / "empty.jsonl")],
                               capture_output=True, text=True, timeout=300)
        assert empty.returncode == 1 and "no GSM8K question to score" in empty.stderr, empty.stderr[-2000:]
    asked = [orjson.loads(line)["question"] for line in other.read_text().splitlines()]
    assert sorted(asked) == sorted(r.question for r in rows)
    cmp = subprocess.run([*DSPARK, "eval", "gsm8k", "--compare", str(out), str(out)], capture_output=True,
                         text=True, timeout=60)
    assert cmp.returncode == 0, cmp.stderr
    assert "n=4 shared questions" in cmp.stdout and "within" in cmp.stdout


def test_waves_send_waves_times_concurrency_requests_per_cell(tmp_path: Path) -> None:
    results = tmp_path / "res"
    run = subprocess.run(_bench(results, "none", "--waves", "2", "--no-plots"), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    completed = {c: read_json(results / "cells" / f"none__c{c}.json")["metrics"]["completed"] for c in (1, 2)}
    assert completed == {1: 2, 2: 4}
    assert read_json(results / "cells" / "none__c2.json")["workload"]["waves"] == 2
    assert "2 x concurrency prompts" in " ".join(run.stdout.split())  # the table title (rich wraps it)


def test_base_url_runs_into_one_folder_share_one_table(tmp_path: Path) -> None:
    """One server per config, benched one after the other (how vLLM configs are compared): the second run's
    table holds both labels. A running server is warmed up before its first cell as a started one is (the
    first label); ``--warmup-prompts 0`` skips that for a server already warm (the second)."""
    port = _free_port("127.0.0.1")
    cmd = [*DSPARK, "serve", *SERVE_ARGS.split(), "--host", "127.0.0.1", "--port", str(port)]
    results = tmp_path / "res"
    bench = [*DSPARK, "bench", "--base-url", f"http://127.0.0.1:{port}", "-c", "1", "-n", "2", "--max-tokens", "4",
             "--results-dir", str(results), "--no-plots"]
    with ServerProcess(cmd, tmp_path / "serve.log", f"http://127.0.0.1:{port}", timeout_s=300) as server:
        # the second names the server's process: its cells record the CPU it used
        for label, extra in (("first", ["--warmup-max-tokens", "2"]),
                             ("second", ["--warmup-prompts", "0", "--server-pid", str(server.pid)])):
            run = subprocess.run([*bench, "--label", label, *extra], capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-2000:]
            out = " ".join(run.stdout.split())  # rich wraps long lines
            assert (f"{label}: shape warm-up, one wave of 2-token requests at c=1" in out) == (label == "first")
        # resumed with a new concurrency: the server's model must be the one its cells recorded; asked for
        # another, it is refused before anything is measured
        resumed = subprocess.run([*bench, "-c", "1,2", "--label", "second", "--warmup-prompts", "0",
                                  "--model", "another-model"], capture_output=True, text=True, timeout=300)
        assert resumed.returncode != 0 and "the server now serves 'another-model'" in " ".join(resumed.stderr.split())
        resumed = subprocess.run([*bench, "-c", "1,2", "--label", "second", "--warmup-prompts", "0"],
                                 capture_output=True, text=True, timeout=300)  # its own model: resumed
        assert resumed.returncode == 0 and (results / "cells" / "second__c2.json").is_file(), resumed.stderr[-2000:]
    first, second = (read_json(results / "cells" / f"{name}__c1.json")["cpu"] for name in ("first", "second"))
    assert "server_pid" not in first and first["client_share"] > 0
    assert second["server_pid"] == server.pid and second["server_share"] > 0
    summary = read_json(results / "summary.json")
    assert summary["configs"] == ["first", "second"] and summary["baseline"] == "first"
    assert all(v is not None for v in summary["rows"][0]["cells"].values())
    assert "| c | first | second |" in (results / "summary.md").read_text()


def test_interleaved_matrix_keeps_every_server_up_and_rotates_each_concurrencys_configs(tmp_path: Path) -> None:
    """``--interleave``: both servers start first and stay up; cells go concurrency by concurrency, the second
    concurrency's configs rotated (varlen first), and each cell records its slot in that order."""
    results = tmp_path / "res"
    run = subprocess.run(_bench(results, "nospec,varlen", "--sps-curve", "auto", "--interleave"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    cells = {p.stem: read_json(p) for p in (results / "cells").iterdir()}
    assert set(cells) == {"nospec__c1", "nospec__c2", "varlen__c1", "varlen__c2"}
    slots = {name: cell["server"]["slot"] for name, cell in cells.items()}
    assert slots == {"nospec__c1": 0, "varlen__c1": 1, "varlen__c2": 2, "nospec__c2": 3}
    # Both servers were up for every cell: each cell started after both had warmed up, and neither
    # server stopped before the last cell finished.
    out = " ".join(run.stdout.split())  # rich wraps long lines
    assert out.index("varlen: starting server") < out.index("interleaved: 2 servers up") < out.index(
        "nospec: server stopped")
    assert all(cell["server"]["interleaved"] == ["nospec", "varlen"] for cell in cells.values())
    for cell in cells.values():
        assert cell["metrics"]["completed"] == 3 and cell["server_counters"]["engine_steps"] > 0
    ports = {cell["server"]["base_url"] for cell in cells.values()}
    assert len(ports) == 2 and not any(_server_alive(url.rsplit(":", 1)[1]) for url in ports)
    md = (results / "summary.md").read_text()
    assert "| c | No spec | Varlen + SPS |" in md
    refused = subprocess.run(_bench(tmp_path / "other", "nospec", "--interleave", "--port", "8123"),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "drop --port" in refused.stderr


def test_rounds_pair_the_configs_round_by_round_and_report_the_median_ratio(tmp_path: Path) -> None:
    """``--interleave --rounds 2``: each cell goes in two rounds, every config's first round before any second
    round; a cell holds both rounds' numbers and its concurrency's group, and the summary pairs the rounds."""
    results = tmp_path / "res"
    cmd = [*DSPARK, "bench", "--serve", "--configs", "nospec,none", "--serve-args", SERVE_ARGS, "-c", "1,2",
           "--waves", "2", "--max-tokens", "6", "--warmup-prompts", "1", "--results-dir", str(results),
           "--server-timeout", "300", "--no-plots", "--interleave", "--rounds", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    cells = {p.stem: read_json(p) for p in (results / "cells").iterdir()}
    assert set(cells) == {"nospec__c1", "none__c1", "nospec__c2", "none__c2"}
    slots = {name: [r["slot"] for r in cell["rounds"]] for name, cell in cells.items()}
    assert slots == {"nospec__c1": [0, 3], "none__c1": [1, 2], "nospec__c2": [4, 7], "none__c2": [5, 6]}
    for cell in cells.values():
        c = cell["concurrency"]
        assert [r["requests"] for r in cell["rounds"]] == [c, c]
        assert cell["metrics"]["completed"] == 2 * c and cell["metrics"]["total_output_tokens"] == 12 * c
        assert cell["metrics"]["duration_s"] == pytest.approx(sum(r["duration_s"] for r in cell["rounds"]))
        assert cell["round_group"] == cells[f"nospec__c{c}"]["round_group"] != cells[
            f"nospec__c{3 - c}"]["round_group"]
        assert cell["workload"]["rounds"] == 2
        # the server counters span both rounds: every output token was stepped
        assert cell["server_counters"]["engine_steps"] > 0
    summary = read_json(results / "summary.json")
    assert set(summary["paired"]) == {"nospec", "none"}
    assert summary["paired"]["none"][1]["cells"]["nospec"]["rounds"] == 2
    assert "Paired rounds against No spec" in (results / "summary.md").read_text()
    assert "Paired rounds against" in " ".join(run.stdout.split())
    refused = subprocess.run([*cmd[:-1], "3"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "fewer than 3 rounds of 1; use --waves 3" in refused.stderr


def test_a_bad_or_mismatched_curve_is_said_before_any_server_starts(tmp_path: Path) -> None:
    """A corrupt --sps-curve used to be found by the first mask/varlen server, after every earlier config's cells;
    a curve profiled at another K than --serve-args' -k is warned about where the user looks, not only in each
    server's log."""
    from dspark_cli.core.sps import SpsCurve

    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"verify_curve_ms": [[1, ')
    results = tmp_path / "res"
    run = subprocess.run(_bench(results, "none,varlen", "--sps-curve", str(corrupt)), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "corrupt.json: not valid JSON" in run.stderr
    assert not (results / "logs").exists()  # no server was started
    curve = tmp_path / "k2.json"
    SpsCurve.from_points([(1, 1.0), (8, 2.0)], [(1, 0.5)], meta={"k": 2}).save(curve)
    cmd = [*DSPARK, "bench", "--serve", "--configs", "varlen", "--sps-curve", str(curve), "--serve-args",
           "--model tiny --device cpu -k 3", "-c", "1", "-n", "1", "--results-dir", str(results),
           "--server-timeout", "0.01"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    said = " ".join(run.stderr.split())
    assert "warning: --sps-curve" in said and "profiled at k=2 and this server drafts k=3" in said
