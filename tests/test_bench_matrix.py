"""Matrix bookkeeping: config names -> serve flags, resumable cells, server process lifecycle."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import orjson
import pytest

from dspark_cli.bench.client import LoadConfig
from dspark_cli.bench.datasets import Prompt
from dspark_cli.bench.matrix import (
    CELL_FORMAT,
    BenchConfig,
    MatrixSpec,
    ServerProcess,
    ServerStartError,
    _free_port,
    cell_path,
    check_rounds,
    check_shared_device,
    interleaved_order,
    interleaved_rounds,
    load_cell,
    parse_concurrencies,
    parse_configs,
    pending_cells,
    round_slices,
)
from dspark_cli.errors import DsparkError
from dspark_cli.fileio import atomic_write_json


def test_config_names_map_to_serve_flags() -> None:
    cfgs = {c.name: c for c in parse_configs("nospec,none,mask,varlen+sts", "curve.json")}
    assert cfgs["nospec"].serve_args == ("-k", "0")
    assert cfgs["none"].serve_args == ("--capacity-mode", "none")
    assert cfgs["mask"].serve_args == ("--capacity-mode", "mask", "--sps-curve", "curve.json")
    assert cfgs["varlen+sts"].serve_args == ("--capacity-mode", "varlen", "--sps-curve", "curve.json", "--online-sts")
    assert cfgs["varlen+sts"].sts and not cfgs["mask"].sts
    # "+mixed", last, on any config: the same server with mixed prefills, for an A/B within one run.
    mixed = {c.name: c for c in parse_configs("nospec+mixed,varlen+sts+mixed", "curve.json")}
    assert mixed["nospec+mixed"].serve_args == ("-k", "0", "--mixed-prefill")
    assert mixed["varlen+sts+mixed"].serve_args == ("--capacity-mode", "varlen", "--sps-curve", "curve.json",
                                                    "--online-sts", "--mixed-prefill")
    assert mixed["varlen+sts+mixed"].sts
    from dspark_cli.bench.report import header

    assert header("nospec+mixed") == "No spec + mixed prefill"
    assert header("varlen+sts+mixed") == "Varlen + SPS + STS + mixed prefill"
    procs = {c.name: c for c in parse_configs("nospec+proc,varlen+sts+mixed+proc,mask+proc+mixed", "curve.json")}
    assert procs["nospec+proc"].serve_args == ("-k", "0", "--engine-process")
    assert procs["varlen+sts+mixed+proc"].serve_args == (*mixed["varlen+sts+mixed"].serve_args, "--engine-process")
    assert procs["mask+proc+mixed"].serve_args == ("--capacity-mode", "mask", "--sps-curve", "curve.json",
                                                   "--engine-process", "--mixed-prefill")
    assert header("nospec+proc") == "No spec + engine process"
    (thread,) = parse_configs("nospec+mixed+thread")
    assert thread.serve_args == ("-k", "0", "--mixed-prefill", "--no-engine-process")
    assert header("nospec+thread") == "No spec + engine thread"
    # "+unmixed": every prefill a step of its own, since mixing became the embedded engine's default
    (unmixed,) = parse_configs("varlen+sts+unmixed", "curve.json")
    assert unmixed.serve_args == (*mixed["varlen+sts+mixed"].serve_args[:-1], "--no-mixed-prefill")
    assert header("nospec+unmixed") == "No spec + prefill steps"
    with pytest.raises(DsparkError, match="contradict"):
        parse_configs("nospec+mixed+unmixed")
    # "+taxP", last before any "#N": a drafting config's probe tax in percent, through --speculative-config
    taxed = {c.name: c for c in parse_configs("varlen+sts+tax0.5,mask+proc+tax1,varlen+sts+tax0.5#2", "curve.json")}
    assert taxed["varlen+sts+tax0.5"].serve_args == (*mixed["varlen+sts+mixed"].serve_args[:-1], "--speculative-config",
                                                    '{"dspark_probe_tax":0.005}')
    assert taxed["varlen+sts+tax0.5"].sts and taxed["varlen+sts+tax0.5#2"].serve_args == taxed["varlen+sts+tax0.5"].serve_args
    assert taxed["mask+proc+tax1"].serve_args[-3:] == ("--engine-process", "--speculative-config",
                                                      '{"dspark_probe_tax":0.01}')
    assert header("varlen+sts+tax0.5") == "Varlen + SPS + STS + probe tax 0.5%"
    assert header("mask+proc+tax1#2") == "Mask + SPS + engine process + probe tax 1% #2"
    for bad, says in (("nospec+tax1", "pause drafting"), ("none+sts+tax1", "pause drafting"), ("varlen+tax0", "percent"),
                      ("varlen+tax100", "percent"), ("varlen+tax0.5+proc", "unknown config")):
        with pytest.raises(DsparkError, match=says):
            parse_configs(bad, "curve.json")
    with pytest.raises(DsparkError, match="already sets"):
        parse_configs("varlen+tax1", "curve.json", ["--speculative-config", '{"dspark_probe_scout": true}'])
    # "+sustainP" the same way, 0 allowed (the short window's verdict alone), and beside "+taxP" in one JSON
    sustained = {c.name: c for c in parse_configs("varlen+sts+sustain0,mask+sustain5+tax1", "curve.json")}
    assert sustained["varlen+sts+sustain0"].serve_args[-2:] == ("--speculative-config", '{"dspark_sustain_margin":0.0}')
    assert orjson.loads(sustained["mask+sustain5+tax1"].serve_args[-1]) == {"dspark_sustain_margin": 0.05,
                                                                          "dspark_probe_tax": 0.01}
    assert header("varlen+sts+sustain0") == "Varlen + SPS + STS + sustain margin 0%"
    assert header("mask+sustain5+tax1#2") == "Mask + SPS + sustain margin 5% + probe tax 1% #2"
    for bad, says in (("varlen+sustain100", "percent"), ("varlen+tax1+tax2", "twice"), ("none+sustain3", "pause")):
        with pytest.raises(DsparkError, match=says):
            parse_configs(bad, "curve.json")
    # "#N", very last: a replica on a server of its own (an A/A column), named apart in files and tables.
    replicas = {c.name: c for c in parse_configs("nospec,nospec#2,varlen+sts+mixed#3", "curve.json")}
    assert replicas["nospec#2"].serve_args == replicas["nospec"].serve_args
    assert replicas["varlen+sts+mixed#3"].serve_args == mixed["varlen+sts+mixed"].serve_args
    assert replicas["varlen+sts+mixed#3"].sts
    assert cell_path(Path("r"), "nospec#2", 16) != cell_path(Path("r"), "nospec", 16)
    assert header("nospec#2") == "No spec #2" and header("varlen+sts+mixed#3") == "Varlen + SPS + STS + mixed prefill #3"


@pytest.mark.parametrize("spec", ["", "mask+foo", "fast", "none,none", "nospec+sts", "mixed", "nospec+mixed+sts",
                                  "varlen+mixed+mixed", "nospec#1", "nospec#x", "#2", "nospec#2#3",
                                  "nospec#2,nospec#2", "nospec+proc+proc", "proc", "nospec+proc+thread"])
def test_bad_config_lists(spec: str) -> None:
    with pytest.raises(DsparkError):
        parse_configs(spec, "auto")


def test_capacity_modes_need_a_curve_unless_common_args_carry_one() -> None:
    with pytest.raises(DsparkError, match="--sps-curve"):
        parse_configs("none,mask")
    (cfg,) = parse_configs("varlen", None, ["--model", "tiny", "--sps-curve", "auto"])
    assert cfg.serve_args == ("--capacity-mode", "varlen")


def test_concurrency_list() -> None:
    assert parse_concurrencies("16, 1,4,4") == [1, 4, 16]
    for bad in ("", "0", "a,b", "-1"):
        with pytest.raises(DsparkError):
            parse_concurrencies(bad)


def _spec(tmp_path: Path, workload: dict | None = None, force: bool = False) -> MatrixSpec:
    return MatrixSpec(configs=[BenchConfig("none"), BenchConfig("mask")], concurrencies=[1, 4],
                      prompts=[Prompt(text="x")], load=LoadConfig(base_url=""), results_dir=tmp_path,
                      workload=workload or {"num_prompts": 1, "max_tokens": 8}, force=force)


def _write(tmp_path: Path, config: str, c: int, workload: dict) -> Path:
    return atomic_write_json(cell_path(tmp_path, config, c), {
        "dspark_bench_cell": CELL_FORMAT, "config": config, "concurrency": c, "metrics": {}, "workload": workload})


def test_finished_cells_are_skipped_and_force_redoes_them(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert len(pending_cells(spec)) == 4
    _write(tmp_path, "mask", 4, spec.workload)
    assert [(k.name, c) for k, c in pending_cells(spec)] == [("none", 1), ("none", 4), ("mask", 1)]
    assert len(pending_cells(_spec(tmp_path, force=True))) == 4


def test_unreadable_or_partial_cell_is_measured_again(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    p = cell_path(tmp_path, "none", 1)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text('{"dspark_bench_cell": 1, "config"')
    assert load_cell(p) is None
    assert ("none", 1) in [(k.name, c) for k, c in pending_cells(spec)]


def test_cells_of_another_workload_are_refused(tmp_path: Path) -> None:
    _write(tmp_path, "none", 1, {"num_prompts": 99, "max_tokens": 8})
    with pytest.raises(DsparkError, match="different workload"):
        pending_cells(_spec(tmp_path))
    assert len(pending_cells(_spec(tmp_path, force=True))) == 4


def test_cell_file_names_are_safe() -> None:
    assert cell_path(Path("r"), "varlen+sts", 16) == Path("r/cells/varlen+sts__c16.json")
    assert cell_path(Path("r"), "my server/1", 2).name == "my_server_1__c2.json"
    # a server with its own API server count and a replica server are two files
    assert cell_path(Path("r"), "nospec@2", 256).name == "nospec@2__c256.json"
    assert cell_path(Path("r"), "nospec#2", 256).name == "nospec_2__c256.json"


def test_a_cell_file_holding_another_configs_cell_is_refused_not_resumed(tmp_path: Path) -> None:
    """Names that differ only where a file name cannot (``a b`` and ``a_b``) share a cell file: resuming it would
    report one server's numbers under the other's name."""
    spec = MatrixSpec(configs=[BenchConfig("my server")], concurrencies=[1], prompts=[Prompt(text="x")],
                      load=LoadConfig(base_url=""), results_dir=tmp_path, workload={"num_prompts": 1, "max_tokens": 8})
    _write(tmp_path, "my_server", 1, spec.workload)
    with pytest.raises(DsparkError, match="holds config 'my_server'.s cell, not 'my server'"):
        pending_cells(spec)


def test_server_that_dies_reports_its_log_tail(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; print('loading weights'); print('boom: no such model'); sys.exit(3)"]
    server = ServerProcess(cmd, tmp_path / "s.log", "http://127.0.0.1:9", timeout_s=30)
    with pytest.raises(ServerStartError) as info:
        server.__enter__()
    assert "status 3" in str(info.value) and "\n" not in str(info.value)
    assert "boom: no such model" in info.value.log_tail


def test_stop_escalates_to_sigkill_and_leaves_no_process(tmp_path: Path) -> None:
    # A server that ignores SIGINT and has a child of its own: both must be gone after stop().
    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(c.pid, flush=True); time.sleep(60)")
    log = tmp_path / "s.log"
    server = ServerProcess([sys.executable, "-c", script], log, "http://127.0.0.1:9", timeout_s=5)
    server.start()
    deadline = time.monotonic() + 20
    child = None
    while time.monotonic() < deadline and child is None:
        lines = [ln for ln in log.read_text().splitlines() if ln.strip().isdigit()]
        child = int(lines[0]) if lines else None
        time.sleep(0.05)
    assert child is not None
    server.stop(grace_s=0.5)
    assert server.proc is not None and server.proc.returncode == -signal.SIGKILL
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the server's child survived stop()")


def test_server_health_timeout(tmp_path: Path) -> None:
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "s.log",
                           "http://127.0.0.1:9", timeout_s=1)
    with pytest.raises(ServerStartError, match="not healthy after 1 s"):
        server.__enter__()
    assert server.proc is not None and server.proc.poll() is not None


def test_cell_where_every_request_failed_is_not_saved(tmp_path: Path) -> None:
    from dspark_cli.bench.matrix import run_matrix

    port = _free_port("127.0.0.1")  # nothing listens there
    spec = _spec(tmp_path)
    spec.concurrencies = [1]
    spec.load = LoadConfig(base_url="", model="m", request_timeout_s=5)
    # the warm-up before the first cell finds the server down first, and says so
    with pytest.raises(DsparkError, match="srv: every warm-up request failed"):
        run_matrix(spec, base_url=f"http://127.0.0.1:{port}", label="srv")
    spec.warmup_prompts = 0
    with pytest.raises(DsparkError, match="every request of cell srv c=1 failed"):
        run_matrix(spec, base_url=f"http://127.0.0.1:{port}", label="srv")
    assert not (tmp_path / "cells").exists() or not any((tmp_path / "cells").iterdir())


def test_waves_take_the_same_leading_prompts_for_every_config(tmp_path: Path) -> None:
    prompts = [Prompt(text=str(i)) for i in range(8)]
    spec = MatrixSpec(configs=[BenchConfig("none")], concurrencies=[1, 4], prompts=prompts,
                      load=LoadConfig(base_url=""), results_dir=tmp_path, workload={}, waves=2)
    assert [p.text for p in spec.cell_prompts(1)] == ["0", "1"]
    assert [p.text for p in spec.cell_prompts(4)] == [str(i) for i in range(8)]
    assert len(_spec(tmp_path).cell_prompts(4)) == 1  # without waves: every prompt, at any concurrency


def test_servers_benched_one_by_one_into_one_folder_make_one_table(tmp_path: Path) -> None:
    """``dspark bench --base-url`` per server (vLLM configs each need their own server): the summary joins
    every config of the folder measured with the same workload, in the order the servers were benched; another
    workload's cells stay out, and a re-run at one concurrency keeps the label's other cells."""
    from dspark_cli.bench.matrix import load_cells, same_workload_cells

    work = {"num_prompts": 8, "max_tokens": 16}

    def cell(config: str, c: int, at: str, workload: dict = work) -> dict:
        path = atomic_write_json(cell_path(tmp_path, config, c), {
            "dspark_bench_cell": CELL_FORMAT, "config": config, "concurrency": c, "metrics": {},
            "workload": workload, "started_at": at})
        return load_cell(path)

    cell("zeta", 16, "2026-01-01T00:00:01")  # benched first, sorts last by name
    cell("all", 16, "2026-01-01T00:00:02")
    cell("all", 64, "2026-01-01T00:00:03")
    cell("upstream", 16, "2026-01-01T00:00:04", {"num_prompts": 8, "max_tokens": 32})  # other lengths
    cell("varlen", 64, "2026-01-01T00:00:05")
    mine = cell("varlen", 16, "2026-01-01T00:00:06")  # this run: varlen again, at 16 only
    cells, names, concs, left_out = same_workload_cells(tmp_path, work, ["varlen"], [16], [mine])
    assert names == ["zeta", "all", "varlen"] and concs == [16, 64] and left_out == 1
    assert sorted((c["config"], c["concurrency"]) for c in cells) == [
        ("all", 16), ("all", 64), ("varlen", 16), ("varlen", 64), ("zeta", 16)]
    assert len(load_cells(tmp_path)) == 6


def test_a_serve_matrix_extended_with_other_configs_keeps_one_table_of_its_model(tmp_path: Path) -> None:
    """``dspark bench --serve --configs nospec,none`` then ``--configs varlen+sts`` into one folder: the second
    run's summary holds all three, in the order they were measured; cells another model served stay out."""
    from dspark_cli.bench.matrix import same_workload_cells

    work = {"num_prompts": 8, "max_tokens": 16}

    def cell(config: str, c: int, at: str, model: str = "tiny") -> dict:
        path = atomic_write_json(cell_path(tmp_path, config, c), {
            "dspark_bench_cell": CELL_FORMAT, "config": config, "concurrency": c, "metrics": {},
            "workload": work, "started_at": at, "server": {"mode": "serve", "model": model}})
        return load_cell(path)

    cell("nospec", 16, "2026-01-01T00:00:01")
    cell("none", 16, "2026-01-01T00:00:02")
    cell("mask", 16, "2026-01-01T00:00:03", model="smollm2-135m")  # another --serve-args model
    mine = [cell("varlen+sts", 16, "2026-01-01T00:00:04"), cell("varlen+sts", 64, "2026-01-01T00:00:05")]
    cells, names, concs, left_out = same_workload_cells(tmp_path, work, ["varlen+sts"], [16, 64], mine, model="tiny")
    assert names == ["nospec", "none", "varlen+sts"] and concs == [16, 64] and left_out == 1
    assert len(cells) == 4
    _, names, _, _ = same_workload_cells(tmp_path, work, ["varlen+sts"], [16, 64], mine)  # no model given: all join
    assert names == ["nospec", "none", "mask", "varlen+sts"]
    # --serve --configs varlen+sts,nospec: this run's configs in its order, after the folder's others
    again = cell("nospec", 64, "2026-01-01T00:00:06")
    _, names, _, _ = same_workload_cells(tmp_path, work, ["varlen+sts", "nospec"], [64], [*mine, again],
                                         model="tiny", keep_label_order=True)
    assert names == ["none", "varlen+sts", "nospec"]


def test_a_serve_table_joins_only_cells_served_with_the_same_serve_args(tmp_path: Path) -> None:
    """``--serve --configs none,varlen --serve-args '-k 2'`` then ``--configs mask --serve-args '-k 3'`` into one
    folder: the second table is mask's alone, not a k=3 column beside k=2 ones, and says so. Cells written before
    the common arguments were recorded join when their command line starts with them."""
    from dspark_cli.bench.matrix import same_setup, same_workload_cells

    work = {"num_prompts": 8, "max_tokens": 16}

    def cell(config: str, at: str, common: list[str] | None, own: list[str]) -> dict:
        server = {"mode": "serve", "model": "tiny",
                  "serve_args": [*(common or ["--model", "tiny", "-k", "2"]), *own, "--port", "1"]}
        if common is not None:
            server["common_args"] = common
        path = atomic_write_json(cell_path(tmp_path, config, 16), {
            "dspark_bench_cell": CELL_FORMAT, "config": config, "concurrency": 16, "metrics": {},
            "workload": work, "started_at": at, "server": server})
        return load_cell(path)

    cell("none", "2026-01-01T00:00:01", ["--model", "tiny", "-k", "2"], ["--capacity-mode", "none"])
    old = cell("varlen", "2026-01-01T00:00:02", None, ["--capacity-mode", "varlen"])  # no common_args recorded
    mine = cell("mask", "2026-01-01T00:00:03", ["--model", "tiny", "-k", "3"], ["--capacity-mode", "mask"])
    _, names, _, left_out = same_workload_cells(tmp_path, work, ["mask"], [16], [mine], model="tiny",
                                                common_args=["--model", "tiny", "-k", "3"])
    assert names == ["mask"] and left_out == 2
    assert same_setup(old, ["--model", "tiny", "-k", "2"]) and not same_setup(old, ["--model", "tiny", "-k", "3"])
    _, names, _, left_out = same_workload_cells(tmp_path, work, ["mask"], [16], [mine], model="tiny",
                                                common_args=["--model", "tiny", "-k", "2"])
    assert names == ["none", "varlen", "mask"] and left_out == 0  # this run's cells are always in its table
    external = {"server": {"mode": "external", "base_url": "http://h:1"}}
    assert same_setup(external, ["-k", "3"])  # a running server's cells join on workload and model


def test_a_waves_sweep_takes_a_new_concurrency_and_says_what_else_differs(tmp_path: Path) -> None:
    """With --waves a cell sends waves x concurrency prompts of a list that only grows at its end, so raising
    the sweep's top concurrency changes no finished cell's work; any other change is refused, naming it."""
    from dspark_cli.bench.datasets import load_prompts
    from dspark_cli.bench.matrix import same_workload, workload_difference

    assert load_prompts("gsm8k", 4) == load_prompts("gsm8k", 16)[:4]
    assert load_prompts("random", 3, input_len=8, seed=1) == load_prompts("random", 9, input_len=8, seed=1)[:3]
    a = {"num_prompts": 4, "max_tokens": 16, "waves": 2}
    assert same_workload(a, {**a, "num_prompts": 8})
    assert not same_workload(a, {**a, "num_prompts": 8, "waves": 4})
    assert not same_workload({"num_prompts": 4}, {"num_prompts": 8})  # without waves every cell sends them all
    assert not same_workload(a, {**a, "max_tokens": 20})
    assert workload_difference(a, {**a, "num_prompts": 8, "max_tokens": 20}) == "max_tokens 16 -> 20"
    spec = _spec(tmp_path)
    spec.workload = {"num_prompts": 1, "max_tokens": 16}
    atomic_write_json(cell_path(tmp_path, "none", 1), {
        "dspark_bench_cell": CELL_FORMAT, "config": "none", "concurrency": 1, "metrics": {"failed": 0},
        "workload": {"num_prompts": 1, "max_tokens": 8}, "started_at": "x"})
    with pytest.raises(DsparkError, match=r"different workload \(max_tokens 8 -> 16\)"):
        pending_cells(spec)


def test_a_cell_that_sent_other_prompts_is_refused_though_the_workload_reads_alike(tmp_path: Path) -> None:
    """The workload names a dataset, not its contents: a JSONL file rewritten with longer prompts between two
    runs resumed into one table (65 and 1,348 prompt tokens per cell under one dataset name). Each cell now
    keeps its prompts' fingerprint; a cell saved before that is resumed on its workload alone."""
    spec = _spec(tmp_path)
    cell = {"dspark_bench_cell": CELL_FORMAT, "config": "none", "concurrency": 1, "metrics": {"failed": 0},
            "workload": spec.workload, "prompts_sha256": spec.cell_prompts_sha256(1)}
    atomic_write_json(cell_path(tmp_path, "none", 1), cell)
    assert ("none", 1) not in [(k.name, c) for k, c in pending_cells(spec)]
    spec.prompts = [Prompt(text="x" * 500)]
    with pytest.raises(DsparkError, match="none__c1.json sent other prompts"):
        pending_cells(spec)
    atomic_write_json(cell_path(tmp_path, "none", 1), {k: v for k, v in cell.items() if k != "prompts_sha256"})
    assert ("none", 1) not in [(k.name, c) for k, c in pending_cells(spec)]
    # a waves sweep that raises its top concurrency keeps every finished cell's prompts
    spec.prompts, spec.waves = [Prompt(text=str(i)) for i in range(8)], 2
    assert spec.cell_prompts_sha256(1) == MatrixSpec(**{**spec.__dict__, "prompts": spec.prompts[:2]}).cell_prompts_sha256(1)


def test_a_label_resumed_against_another_server_is_refused(tmp_path: Path) -> None:
    """``--base-url A --label x`` then ``--base-url B --label x`` into one folder would table two servers'
    cells in one column."""
    spec = _spec(tmp_path)
    spec.workload = {"num_prompts": 1}
    spec.configs, spec.concurrencies = [BenchConfig("x")], [1]
    spec.load = LoadConfig(base_url="http://127.0.0.1:2")
    atomic_write_json(cell_path(tmp_path, "x", 1), {
        "dspark_bench_cell": CELL_FORMAT, "config": "x", "concurrency": 1, "metrics": {"failed": 0},
        "workload": spec.workload, "started_at": "x", "server": {"mode": "external", "base_url": "http://127.0.0.1:1"}})
    with pytest.raises(DsparkError, match="was measured against http://127.0.0.1:1, not http://127.0.0.1:2; give"):
        pending_cells(spec)
    spec.load = LoadConfig(base_url="http://127.0.0.1:1/")
    assert pending_cells(spec) == []


def test_a_fixed_port_another_process_listens_on_is_refused_before_a_server_starts(tmp_path: Path) -> None:
    """A server left by a killed bench answers /health on a fixed --port: the bench must not table its numbers
    as the new config's. Hosts this machine cannot listen on are refused in one line too."""
    import socket

    from dspark_cli.bench.matrix import _bind_probe, url_host

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DsparkError, match=f"--port {port}: another process listens on 127.0.0.1:{port}"):
            _bind_probe("127.0.0.1", port)
    assert _bind_probe("127.0.0.1", port) == port  # free again
    for host in ("999.1.1.1", "no-such-host.invalid"):
        with pytest.raises(DsparkError, match=f"--host {host}: "):
            _free_port(host)
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1"


def test_a_server_that_dies_while_another_process_answers_its_port_is_not_taken_for_healthy(tmp_path: Path) -> None:
    """The child fails to bind (another process has the port) and exits, while the other process answers
    /health: that is a failed start, not a healthy server."""
    import functools
    import http.server
    import threading

    (tmp_path / "health").write_text("ok")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        server = ServerProcess([sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"],
                               tmp_path / "s.log", url, 10)
        with pytest.raises(ServerStartError, match="exited with status 3, and another process answers"):
            server.__enter__()
    finally:
        httpd.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_started_server_ends_with_the_bench_however_the_bench_dies(tmp_path: Path) -> None:
    """SIGKILL runs no handler: the kernel's parent-death signal stops the server a killed bench started."""
    import subprocess

    pid_file = tmp_path / "server.pid"
    bench = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from dspark_cli.bench.matrix import ServerProcess
s = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], Path({str(tmp_path / 's.log')!r}),
                  "http://127.0.0.1:9", 1)
s.start()
Path({str(pid_file)!r}).write_text(str(s.pid))
time.sleep(60)
"""])
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    server_pid = int(pid_file.read_text())
    bench.kill()
    bench.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(server_pid, 9)
    pytest.fail("the server outlived the bench that started it")


def _recorded_warmup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cfg: BenchConfig,
                     **spec_kw: object) -> list[tuple[int, int, int]]:
    """The (requests, concurrency, max_tokens) of every pass ``_warmup`` sends, with the HTTP client stubbed."""
    import asyncio

    from dspark_cli.bench import matrix
    from dspark_cli.bench.client import RequestResult

    sent: list[tuple[int, int, int]] = []
    measured = [Prompt(text="x"), Prompt(text="y")]

    async def fake_run_load(prompts: list[Prompt], load: LoadConfig) -> tuple[list[RequestResult], float, float]:
        sent.append((len(prompts), load.concurrency, load.max_tokens))
        # every warm-up prompt is a measured one, marked: a prefix cache then holds no measured prompt's blocks
        assert [p.text for p in prompts] == [f"Warm-up {i}. {'xy'[i % 2]}" for i in range(len(prompts))]
        return [RequestResult(index=i, success=True) for i in range(len(prompts))], 0.0, 0.0

    monkeypatch.setattr(matrix, "run_load", fake_run_load)
    spec = MatrixSpec(configs=[cfg], concurrencies=[1, 16, 64], prompts=measured,
                      load=LoadConfig(base_url="", max_tokens=128), results_dir=tmp_path, workload={},
                      **spec_kw)  # type: ignore[arg-type]
    asyncio.run(matrix._warmup(spec, cfg, "http://127.0.0.1:1", matrix.Hooks(), [16, 1, 64]))
    return sent


def test_warmup_sends_one_short_wave_at_every_concurrency_a_server_is_measured_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """JIT compilers cache per batch shape on disk: without a wave at each concurrency, the first config of a
    matrix pays every compile inside its timed cells (the H200 matrix's no-speculation column did)."""
    assert _recorded_warmup(tmp_path, monkeypatch, BenchConfig("none")) == [(4, 1, 16), (16, 16, 16), (64, 64, 16)]
    # STS configs: the long calibration pass (every prompt once) first, then the same waves
    sts = _recorded_warmup(tmp_path, monkeypatch, BenchConfig("varlen+sts", sts=True))
    assert sts[0] == (2, 32, 32) and sts[1:] == [(4, 1, 16), (16, 16, 16), (64, 64, 16)]
    # the single short pass of before, and none at all
    assert _recorded_warmup(tmp_path, monkeypatch, BenchConfig("none"), warmup_shapes=False) == [(4, 4, 16)]
    assert _recorded_warmup(tmp_path, monkeypatch, BenchConfig("none"), warmup_prompts=0) == []
    # --sts-warmup-prompts 0 skips the calibration pass (0 once read as unset, and every prompt was sent)
    assert _recorded_warmup(tmp_path, monkeypatch, BenchConfig("varlen+sts", sts=True), sts_warmup_prompts=0,
                            warmup_prompts=0) == []


def test_interleaved_order_goes_by_concurrency_and_moves_every_config_through_the_slots() -> None:
    names = ["nospec", "none", "mask"]
    order = interleaved_order(names, [16, 64, 256])
    assert order == [("nospec", 16), ("none", 16), ("mask", 16), ("none", 64), ("mask", 64), ("nospec", 64),
                     ("mask", 256), ("nospec", 256), ("none", 256)]
    # As many concurrencies as configs: each config is measured once in each position of its concurrency.
    for name in names:
        positions = [[k for k, _ in order[i * 3:(i + 1) * 3]].index(name) for i in range(3)]
        assert sorted(positions) == [0, 1, 2]
    assert sorted(order) == sorted((k, c) for k in names for c in (16, 64, 256))  # every cell once
    assert interleaved_order([], [1, 2]) == []


def test_rounds_go_concurrency_by_concurrency_and_move_every_config_through_the_slots_of_each_round() -> None:
    names = ["nospec", "none", "mask"]
    order = interleaved_rounds(names, [16, 64], 3)
    assert order[:6] == [("nospec", 16, 0), ("none", 16, 0), ("mask", 16, 0),
                         ("none", 16, 1), ("mask", 16, 1), ("nospec", 16, 1)]
    # every config's round r is measured before any config's round r + 1
    for c in (16, 64):
        seen = [r for _, cc, r in order if cc == c]
        assert seen == sorted(seen) and len(seen) == 9
    # over as many rounds as configs, each config takes each slot of its round once
    for name in names:
        assert sorted([k for k, cc, r in order if cc == 16 and r == rr].index(name) for rr in range(3)) == [0, 1, 2]
    assert all(c == 16 for _, c, _ in order[:9]) and sorted(order) == sorted(
        (k, c, r) for k in names for c in (16, 64) for r in range(3))
    # one round a cell is the plain interleaved order
    assert [(k, c) for k, c, _ in interleaved_rounds(names, [16, 64, 256], 1)] == interleaved_order(names, [16, 64, 256])


def test_round_slices_cover_every_request_once_in_near_equal_contiguous_parts() -> None:
    assert round_slices(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert round_slices(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert round_slices(5, 1) == [(0, 5)]


def test_rounds_need_interleave_and_at_least_a_wave_per_round(tmp_path: Path) -> None:
    spec = MatrixSpec(configs=[BenchConfig("nospec")], concurrencies=[2, 4], prompts=[Prompt(text="x")] * 12,
                      load=LoadConfig(base_url=""), results_dir=tmp_path, workload={}, serve=True, waves=3,
                      rounds=3)
    with pytest.raises(DsparkError, match="needs --serve --interleave"):
        check_rounds(spec)
    spec.interleave = True
    check_rounds(spec)  # 3 waves: one per round at every concurrency
    spec.rounds = 4
    with pytest.raises(DsparkError, match="c=2 sends 6 requests, fewer than 4 rounds of 2; use --waves 4"):
        check_rounds(spec)
    spec.rounds = 2  # 3 waves in 2 rounds: each round ends with half a wave, at half the load
    with pytest.raises(DsparkError, match="c=2 sends 6 requests, not whole waves of 2 per round.*--waves a multiple of 2"):
        check_rounds(spec)
    spec.waves = None  # every prompt in each cell: 12 requests are 2 rounds of 3 waves at c=2, of 1.5 at c=4
    with pytest.raises(DsparkError, match="c=4 sends 12 requests.*--num-prompts a multiple of 8"):
        check_rounds(spec)
    spec.concurrencies = [2, 3]
    check_rounds(spec)
    spec.rounds = 0
    with pytest.raises(DsparkError, match="--rounds must be >= 1"):
        check_rounds(spec)


def test_a_cell_records_its_prefix_cache_hits_and_says_when_cells_are_not_equal_work(tmp_path: Path) -> None:
    """vLLM caches prompt prefixes by default, and cells at different concurrencies send the same prompts: a
    cell whose prompts were prefilled before did less work. The cell keeps the hit counts, and the log says so."""
    from dspark_cli.bench import matrix
    from dspark_cli.bench.client import RequestResult, ServerCounters
    from dspark_cli.bench.metrics import PrefixCacheCounters, SpecDecodeCounters

    spec = _spec(tmp_path)
    done = RequestResult(index=0, success=True, ttft=0.01, latency=0.1, output_tokens=8, itl=[0.01] * 7)

    def counters(queries: float, hits: float) -> ServerCounters:
        return ServerCounters(SpecDecodeCounters(), {}, {}, PrefixCacheCounters(queries, hits, True))

    logged: list[str] = []
    hooks = matrix.Hooks(log=logged.append)
    for hits, warned in ((10.0, False), (300.0, True)):
        logged.clear()
        cell = matrix._cell_record(spec, BenchConfig("none"), 4, [done], 1.0, counters(0.0, 0.0),
                                   counters(1000.0, hits), {}, "2026-01-01T00:00:00")
        assert cell["prefix_cache"] == {"queried_tokens": 1000.0, "hit_tokens": hits, "hit_rate": hits / 1000.0}
        matrix._write_cell(spec, cell, hooks)
        assert bool(logged) is warned
    assert logged == ["none c=4: 30% of its prompt tokens were prefix-cache hits, so cells are not equal work: "
                      "serve with prefix caching off (vLLM: --no-enable-prefix-caching) to compare configs"]
    assert load_cell(cell_path(tmp_path, "none", 4))["prefix_cache"]["hit_tokens"] == 300.0


def test_a_cell_whose_first_scrape_failed_leaves_its_counters_unknown(tmp_path: Path) -> None:
    """Counters measured from nothing would hold the warm-up's and every earlier cell's: acceptance 3.8 where the
    cell's own was 2.0. A failed first scrape makes them unknown instead."""
    from dspark_cli.bench import matrix
    from dspark_cli.bench.client import RequestResult, ServerCounters
    from dspark_cli.bench.metrics import PrefixCacheCounters, SpecDecodeCounters

    spec = _spec(tmp_path)
    done = RequestResult(index=0, success=True, ttft=0.01, latency=0.1, output_tokens=8, itl=[0.01] * 7)
    after = ServerCounters(SpecDecodeCounters(present=True, num_drafts=110, num_draft_tokens=440,
                                              num_accepted_tokens=300), {"dspark:paused_steps_total": 9.0}, {},
                           PrefixCacheCounters(100.0, 0.0, True))
    before = ServerCounters(SpecDecodeCounters(present=True, num_drafts=100, num_draft_tokens=400,
                                               num_accepted_tokens=290), {"dspark:paused_steps_total": 4.0}, {},
                            PrefixCacheCounters(50.0, 0.0, True))
    cell = matrix._cell_record(spec, BenchConfig("varlen"), 4, [done], 1.0, before, after, {}, "2026-01-01T00:00:00")
    assert cell["spec_decode"]["acceptance_length"] == pytest.approx(2.0)
    assert cell["server_counters"] == {"dspark:paused_steps_total": 5.0}
    failed = ServerCounters(SpecDecodeCounters(), {}, scraped=False)
    cell = matrix._cell_record(spec, BenchConfig("varlen"), 4, [done], 1.0, failed, after, {}, "2026-01-01T00:00:00")
    assert cell["spec_decode"] is None and cell["server_counters"] == {} and cell["prefix_cache"] is None
    # A server restarted within the cell that then did more work than before: its spec-decode deltas came out
    # positive (acceptance 1.2, read as real) beside toolkit counters that went negative. Any counter going
    # backwards makes the whole cell's counters unknown.
    restarted = ServerCounters(SpecDecodeCounters(present=True, num_drafts=150, num_draft_tokens=600,
                                                  num_accepted_tokens=320), {"dspark:paused_steps_total": 1.0}, {},
                               PrefixCacheCounters(120.0, 0.0, True))
    cell = matrix._cell_record(spec, BenchConfig("varlen"), 4, [done], 1.0, before, restarted, {},
                               "2026-01-01T00:00:00")
    assert cell["spec_decode"] is None and cell["server_counters"] == {} and cell["prefix_cache"] is None


def test_a_failed_metrics_scrape_is_told_apart_from_a_server_without_counters() -> None:
    import asyncio

    from aiohttp import web

    from dspark_cli.bench.client import LoadConfig, fetch_counters, make_session

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500)

    async def go() -> tuple[bool, bool]:
        app = web.Application()
        app.router.add_get("/metrics", broken)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with make_session(LoadConfig(base_url="x")) as session:
                failed = await fetch_counters(session, f"http://127.0.0.1:{port}")
                return failed.scraped, failed.spec.present
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == (False, False)


def test_a_cell_whose_server_merged_stream_chunks_says_its_frontend_fell_behind(tmp_path: Path) -> None:
    """One chunk per request per step is what a server streams while its frontend keeps up; more tokens per chunk
    than per request-step means it sent several steps' outputs at once (vLLM's API server at 64 requests on the
    H200). Speculative steps carry several tokens per chunk by themselves: judged against acceptance length."""
    from dspark_cli.bench import matrix
    from dspark_cli.bench.client import RequestResult, ServerCounters
    from dspark_cli.bench.metrics import SpecDecodeCounters

    spec = _spec(tmp_path)
    logged: list[str] = []
    hooks = matrix.Hooks(log=logged.append)
    none = ServerCounters(SpecDecodeCounters(), {})

    def cell(chunk_tokens: list[int], config: str = "none") -> dict:
        done = RequestResult(index=0, success=True, ttft=0.01, latency=0.1, output_tokens=sum(chunk_tokens),
                             chunk_tokens=chunk_tokens, itl=[0.01] * (len(chunk_tokens) - 1))
        return matrix._cell_record(spec, BenchConfig(config), 4, [done], 1.0, none, none, {}, "2026-01-01T00:00:00")

    matrix._write_cell(spec, cell([1] * 8), hooks)
    assert logged == []  # one token per chunk, as a no-speculation step emits
    merged = cell([1, 2, 1, 2, 2])  # 8 tokens in 5 chunks
    matrix._write_cell(spec, merged, hooks)
    assert logged == ["none c=4: 1.60 tokens per stream chunk against 1.00 per request-step: the server merged "
                      "steps' outputs (its frontend fell behind the engine), so this cell may measure the frontend"]
    drafted = cell([3, 3, 2])  # a speculative cell: 2.67 tokens per chunk at an acceptance length of 2.67
    drafted["spec_decode"] = {"acceptance_length": 8 / 3}
    logged.clear()
    matrix._write_cell(spec, drafted, hooks)
    assert logged == []


def test_a_cell_records_the_cpu_its_client_and_server_used_and_says_when_either_was_near_a_core(
        tmp_path: Path) -> None:
    """A served cell measures its slowest stage: the bench client's or the server's event loop busy for most of
    the cell may be it. The cell keeps the loops' and the processes' shares, and the log says when a loop reached
    80% (vLLM's one API process limited its cells at 84-86%), not when a process computing on several threads
    did."""
    from dspark_cli.bench import matrix
    from dspark_cli.bench.client import RequestResult, ServerCounters
    from dspark_cli.bench.cpu import CpuSnapshot, CpuUse
    from dspark_cli.bench.metrics import SpecDecodeCounters

    spec = _spec(tmp_path)
    logged: list[str] = []
    hooks = matrix.Hooks(log=logged.append)
    none = ServerCounters(SpecDecodeCounters(), {})
    done = RequestResult(index=0, success=True, ttft=0.01, latency=0.1, output_tokens=8, itl=[0.01] * 7)

    def cell(client_loop_s: float, server_main_s: float) -> dict:
        # the processes' totals are high in both: torch computes on other threads than the event loops
        use = CpuUse(server_pid=1234)
        use.add(CpuSnapshot(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
                CpuSnapshot(10.0, 15.0, client_loop_s, 19.0, server_main_s, 28.0))
        return matrix._cell_record(spec, BenchConfig("none"), 4, [done], 10.0, none, none, {}, "2026-01-01T00:00:00",
                                   use)

    quiet = cell(3.0, 5.0)
    assert quiet["cpu"]["client_loop_share"] == 0.3 and quiet["cpu"]["server_share"] == 1.9
    matrix._write_cell(spec, quiet, hooks)
    assert logged == []
    matrix._write_cell(spec, cell(9.5, 9.8), hooks)
    assert logged == [
        "none c=4: the bench client's event loop was busy 95% of the cell: one loop streams every request, so it "
        "may be what limits this cell, and its ITLs include its own delays",
        "none c=4: the server's main thread (pid 1234, where its HTTP event loop runs) was busy 98% of the cell: "
        "its frontend may be what limits this cell (vLLM: more API servers, --api-server-count)"]
    logged.clear()
    matrix._write_cell(spec, cell(7.5, 8.5), hooks)  # the API loop of section 30's slow cells; the client below 80%
    assert logged == [
        "none c=4: the server's main thread (pid 1234, where its HTTP event loop runs) was busy 85% of the cell: "
        "its frontend may be what limits this cell (vLLM: more API servers, --api-server-count)"]
    # cells recorded before the CPU was kept read no note
    assert matrix.measurement_notes({**quiet, "cpu": None}) == []
    # a server that held newcomers back for want of KV blocks on 1% of its steps or more: this cell measures memory
    held = {**quiet, "cpu": None, "server_counters": {"kv_wait_steps": 20.0, "engine_steps": 1919.0}}
    (note,) = matrix.measurement_notes(held)
    assert note.startswith("on 20 of 1919 steps a waiting request had a free slot but not the KV blocks to start")
    assert "--gpu-memory-utilization" in note
    assert matrix.measurement_notes({**held, "server_counters": {"kv_wait_steps": 19.0, "engine_steps": 1919.0}}) == []


def test_interleaved_vllm_servers_must_each_be_given_a_share_of_the_gpu() -> None:
    """Kept up together, vLLM servers at their default 90% of the GPU cannot all start: refused before any does."""
    vllm = ["--engine", "vllm", "-k", "7"]
    with pytest.raises(DsparkError, match="--gpu-memory-utilization 0.30"):
        check_shared_device([[*vllm, "-k", "0"], [*vllm, "--capacity-mode", "none"], [*vllm, "--capacity-mode", "varlen"]])
    # a share for each (either flag, either spelling), one vLLM server, or the embedded engine: nothing to say
    check_shared_device([[*vllm, "--gpu-memory-utilization", "0.3"], [*vllm, "--kv-cache-memory-bytes=4G"]])
    check_shared_device([vllm, ["--model", "tiny"]])
    check_shared_device([["--model", "tiny"], ["--model", "tiny", "-k", "0"]])
    # the last --engine wins, as the command line parser reads it
    with pytest.raises(DsparkError, match="--interleave keeps 2 servers up"):
        check_shared_device([["--engine", "embedded", *vllm], vllm])


def _served_spec(tmp_path: Path, common: list[str]) -> MatrixSpec:
    return MatrixSpec(configs=[BenchConfig("none", ("--capacity-mode", "none"))], concurrencies=[1],
                      prompts=[Prompt(text="x")], load=LoadConfig(base_url=""), results_dir=tmp_path,
                      workload={"num_prompts": 1}, serve=True, serve_args=common)


def test_cells_served_with_other_settings_are_refused_not_resumed(tmp_path: Path) -> None:
    """Another model, K or batch limit under the same config name: resuming would table the old server's
    numbers as this run's (its port differs on every start, so that alone does not count)."""
    atomic_write_json(cell_path(tmp_path, "none", 1), {
        "dspark_bench_cell": CELL_FORMAT, "config": "none", "concurrency": 1, "metrics": {"failed": 0},
        "workload": {"num_prompts": 1},
        "server": {"mode": "serve", "serve_args": ["--model", "tiny", "--capacity-mode", "none", "--host",
                                                   "127.0.0.1", "--port", "40123"]}})
    assert pending_cells(_served_spec(tmp_path, ["--model", "tiny"])) == []
    with pytest.raises(DsparkError, match="served with other settings .*--model smollm2-135m -k 2"):
        pending_cells(_served_spec(tmp_path, ["--model", "smollm2-135m", "-k", "2"]))
    forced = _served_spec(tmp_path, ["--model", "smollm2-135m"])
    forced.force = True
    assert len(pending_cells(forced)) == 1


def test_a_cell_with_failed_requests_is_kept_aside_and_measured_again(tmp_path: Path) -> None:
    from dspark_cli.bench.matrix import Hooks, _write_cell, failed_cell_path

    spec = _spec(tmp_path)
    cell = {"dspark_bench_cell": CELL_FORMAT, "config": "none", "concurrency": 4, "workload": spec.workload,
            "metrics": {"completed": 1, "failed": 3, "errors": ["HTTP 500: engine died"]}}
    with pytest.raises(DsparkError, match=r"3 of 4 requests of cell none c=4 failed \(HTTP 500: engine died\)"):
        _write_cell(spec, cell, Hooks())
    assert not cell_path(tmp_path, "none", 4).exists()
    assert load_cell(failed_cell_path(tmp_path, "none", 4)) is not None  # kept for a look, not as a cell
    # a cell some of whose requests failed, saved by an older version, is measured again
    atomic_write_json(cell_path(tmp_path, "mask", 1), {**cell, "config": "mask", "concurrency": 1})
    assert ("mask", 1) in [(k.name, c) for k, c in pending_cells(spec)]


def test_a_cell_that_cannot_fill_its_concurrency_is_refused(tmp_path: Path) -> None:
    from dspark_cli.bench.matrix import check_loads

    spec = _spec(tmp_path)  # one prompt per cell, at c=1 and c=4
    with pytest.raises(DsparkError, match="a cell at c=4 sends 1 requests"):
        check_loads(spec)
    spec.waves = 1
    spec.prompts = [Prompt(text=str(i)) for i in range(4)]
    check_loads(spec)


def test_an_unusable_results_dir_is_one_line_before_any_work(tmp_path: Path) -> None:
    from dspark_cli.bench.matrix import prepare_results_dir

    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad in (afile, afile / "sub"):
        with pytest.raises(DsparkError, match="--results-dir .*cannot write there"):
            prepare_results_dir(bad)
    good = tmp_path / "new" / "dir"
    (good / "cells").mkdir(parents=True)
    (good / "cells" / ".none__c1.json.abc.tmp").write_text("{")  # a killed run's half-written cell
    prepare_results_dir(good)
    assert good.is_dir() and not list((good / "cells").glob(".*.tmp"))


def test_a_server_that_dies_mid_cell_is_named_with_its_exit_status_and_log(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed mid-cell, a server left only connection errors to read ("61 of 64 requests failed
    (ClientConnectorError ...)"): the refusal now says it exited, with what status, and shows its log's end."""
    from dspark_cli.bench import matrix as mx

    log = tmp_path / "serve.log"
    log.write_text("starting\nKilled\n")
    dead = ServerProcess([sys.executable, "-c", "raise SystemExit(9)"], log, "http://127.0.0.1:9", 5.0)

    class Exited:
        pid = 4321

        def poll(self) -> int:
            return -9

    def served(spec: MatrixSpec, cfg: BenchConfig, hooks: object) -> tuple[str, dict, ServerProcess]:
        dead.proc = Exited()  # type: ignore[assignment]
        return "http://127.0.0.1:9", {"mode": "serve"}, dead

    async def nothing(*args: object, **kwargs: object) -> None:
        return None

    async def failed_cell(spec: MatrixSpec, cfg: BenchConfig, c: int, *args: object) -> dict:
        return {"config": cfg.name, "concurrency": c,
                "metrics": {"completed": 3, "failed": 61, "errors": ["ClientConnectorError: cannot connect"]}}

    monkeypatch.setattr(mx, "_served_process", served)
    monkeypatch.setattr(mx, "_warmup", nothing)
    monkeypatch.setattr(mx, "_measure", failed_cell)
    monkeypatch.setattr(ServerProcess, "__enter__", lambda self: self)
    monkeypatch.setattr(ServerProcess, "__exit__", lambda self, *exc: None)
    with pytest.raises(ServerStartError, match=r"61 of 64 requests .* the server had exited with status -9") as info:
        mx._run_served_config(_spec(tmp_path), BenchConfig("none"), [1], mx.Hooks())
    assert info.value.log_tail.endswith("Killed")


def test_a_configs_own_flags_go_before_the_passthrough_of_the_common_ones(tmp_path: Path) -> None:
    """--serve-args "--engine vllm -k 7 -- --gpu-memory-utilization 0.4": the nospec column's -k 0 went after the
    --, straight to vllm serve (which has no -k), and its server would not start; nor would --host and --port
    have reached dspark serve."""
    from dspark_cli.bench.matrix import before_passthrough, served_args

    spec = MatrixSpec(**{**_spec(tmp_path).__dict__,
                         "serve_args": ("--engine", "vllm", "-k", "7", "--", "--gpu-memory-utilization", "0.4")})
    nospec = BenchConfig("nospec", serve_args=("-k", "0"))
    assert served_args(spec, nospec) == ["--engine", "vllm", "-k", "7", "-k", "0", "--",
                                         "--gpu-memory-utilization", "0.4"]
    assert before_passthrough(["-k", "7"], ["--port", "1"]) == ["-k", "7", "--port", "1"]


def test_a_resumed_interleaved_concurrency_is_measured_again_whole_and_its_done_cells_kept_aside(
        tmp_path: Path) -> None:
    """Interleaved cells of one concurrency are measured side by side (with --rounds, paired round by round). An
    interruption in a concurrency's last round left some of its cells written: resumed, the missing one was
    measured alone on servers started anew, and tabled against round-mates of another time (its paired table
    then read "-" everywhere, with no word why). Its whole concurrency is measured again now, the done cells set
    aside as each is measured again, not lost; concurrencies already whole stay."""
    from dspark_cli.bench.matrix import Hooks, _write_cell, superseded_cell_path

    def served(name: str, c: int) -> None:
        atomic_write_json(cell_path(tmp_path, name, c), {
            "dspark_bench_cell": CELL_FORMAT, "config": name, "concurrency": c, "metrics": {"failed": 0},
            "workload": {"num_prompts": 1}, "server": {"mode": "serve", "serve_args": ["--model", "tiny"]}})

    spec = MatrixSpec(configs=[BenchConfig("none"), BenchConfig("mask")], concurrencies=[1, 4],
                      prompts=[Prompt(text="x")] * 8, load=LoadConfig(base_url=""), results_dir=tmp_path,
                      workload={"num_prompts": 1}, serve=True, serve_args=["--model", "tiny"], interleave=True)
    for name, c in (("none", 1), ("mask", 1), ("none", 4)):
        served(name, c)
    todo = pending_cells(spec)
    assert [(k.name, c) for k, c in todo] == [("none", 4), ("mask", 4)]
    logged: list[str] = []
    again = {**load_cell(cell_path(tmp_path, "none", 4)), "metrics": {"failed": 0, "completed": 1, "errors": []},
             "started_at": "later"}
    _write_cell(spec, again, Hooks(log=logged.append))
    assert load_cell(cell_path(tmp_path, "none", 4))["started_at"] == "later"
    assert superseded_cell_path(tmp_path, "none", 4).is_file()
    assert cell_path(tmp_path, "none", 1).is_file() and cell_path(tmp_path, "mask", 1).is_file()
    assert any("none c=4: measured again with the rest of its concurrency" in line for line in logged)
    assert [(k.name, c) for k, c in pending_cells(spec)] == [("none", 4), ("mask", 4)]
    # not interleaved: the cells are independent, and only the missing one is measured
    served("none", 4)
    sequential = MatrixSpec(**{**spec.__dict__, "interleave": False})
    assert [(k.name, c) for k, c in pending_cells(sequential)] == [("mask", 4)]


def test_an_interleaved_resume_that_fails_keeps_the_finished_cells(tmp_path: Path) -> None:
    """The finished cells of a concurrency to be measured again were moved aside before any server started: a
    resume that then failed (here a server that exits at once) or was interrupted left them out of the folder, and
    the same command measured them again."""
    from dspark_cli.bench.matrix import ServerStartError, parse_configs, run_matrix, served_args

    common = ["--model", "tiny"]
    cfgs = parse_configs("none,mask", "auto", common)
    spec = MatrixSpec(configs=cfgs, concurrencies=[1], prompts=[Prompt(text="x")] * 2, load=LoadConfig(base_url=""),
                      results_dir=tmp_path, workload={"num_prompts": 2}, serve=True, serve_args=common,
                      interleave=True, server_timeout_s=10,
                      serve_command=(sys.executable, "-c", "import sys; sys.exit(3)"))
    done = cell_path(tmp_path, "none", 1)
    atomic_write_json(done, {
        "dspark_bench_cell": CELL_FORMAT, "config": "none", "concurrency": 1,
        "metrics": {"failed": 0, "completed": 2}, "workload": spec.workload,
        "prompts_sha256": spec.cell_prompts_sha256(1),
        "server": {"mode": "serve", "serve_args": served_args(spec, cfgs[0]), "common_args": common,
                   "files_sha256": {}}})
    with pytest.raises(ServerStartError):
        run_matrix(spec)
    assert done.is_file()
    assert pending_cells(MatrixSpec(**{**spec.__dict__, "configs": [cfgs[0]]})) == []


def test_a_configs_column_takes_only_cells_of_its_own_server_setup_and_prompts(tmp_path: Path) -> None:
    """A folder's cells of this run's configs at other concurrencies joined its columns on workload alone: a mask
    column showed c=1 from one --sps-curve and c=16 from another, and a baseline measured on prompts edited since
    sat beside the cells of this run (the resume checks cover only this run's own cells)."""
    from dspark_cli.bench.matrix import same_workload_cells

    work = {"num_prompts": 8, "max_tokens": 16}

    def cell(config: str, c: int, own: list[str], sha: str | None = None) -> dict:
        record = {"dspark_bench_cell": CELL_FORMAT, "config": config, "concurrency": c, "metrics": {},
                  "workload": work, "started_at": f"2026-01-01T00:00:{c:02d}",
                  "server": {"mode": "serve", "model": "tiny", "common_args": ["--model", "tiny"],
                             "serve_args": ["--model", "tiny", *own, "--port", "1"]}}
        if sha is not None:
            record["prompts_sha256"] = sha
        return load_cell(atomic_write_json(cell_path(tmp_path, config, c), record))

    cell("mask", 1, ["--capacity-mode", "mask", "--sps-curve", "a.json"])
    cell("none", 1, ["--capacity-mode", "none"], sha="old prompts")
    cell("none", 4, ["--capacity-mode", "none"], sha="same prompts")
    mine = cell("mask", 16, ["--capacity-mode", "mask", "--sps-curve", "b.json"])
    args = {"mask": ["--model", "tiny", "--capacity-mode", "mask", "--sps-curve", "b.json"]}
    cells, names, concs, left_out = same_workload_cells(
        tmp_path, work, ["mask"], [16], [mine], model="tiny", common_args=["--model", "tiny"], config_args=args,
        prompts_sha256=lambda c: "same prompts")
    assert sorted((x["config"], x["concurrency"]) for x in cells) == [("mask", 16), ("none", 4)]
    assert left_out == 2 and concs == [4, 16] and names == ["none", "mask"]
    # without the run's setup and prompts (a table of running servers' cells): workload and model alone
    cells, _, _, left_out = same_workload_cells(tmp_path, work, ["mask"], [16], [mine], model="tiny")
    assert len(cells) == 4 and left_out == 0


def test_a_curve_file_profiled_again_in_place_makes_its_cells_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cells name their --sps-curve by path: a curve profiled again into the same file left the cells served
    with the old one resumed and tabled as if served with the new one."""
    from dspark_cli.bench.matrix import Hooks, _served_process, same_workload_cells

    monkeypatch.chdir(tmp_path)
    Path("curve.json").write_text('{"old": 1}')
    results = tmp_path / "out"
    spec = MatrixSpec(configs=parse_configs("mask", "curve.json"), concurrencies=[1, 4], prompts=[Prompt(text="x")],
                      load=LoadConfig(base_url=""), results_dir=results, workload={"num_prompts": 1}, serve=True,
                      serve_args=["--model", "tiny"])
    _, server, _ = _served_process(spec, spec.configs[0], Hooks())
    assert set(server["files_sha256"]) == {"--sps-curve"}  # what a started server's cells record
    for c in (1, 4):
        atomic_write_json(cell_path(results, "mask", c), {
            "dspark_bench_cell": CELL_FORMAT, "config": "mask", "concurrency": c, "metrics": {"failed": 0},
            "workload": {"num_prompts": 1}, "started_at": f"2026-01-01T00:00:0{c}", "server": server})
    assert pending_cells(spec) == []
    mine = load_cell(cell_path(results, "mask", 4))

    def table() -> list[int]:
        cells, _, _, _ = same_workload_cells(results, {"num_prompts": 1}, ["mask"], [4], [mine], common_args=[
            "--model", "tiny"], config_args={"mask": ["--model", "tiny", "--capacity-mode", "mask", "--sps-curve",
                                                      "curve.json"]})
        return sorted(int(x["concurrency"]) for x in cells)

    assert table() == [1, 4]
    Path("curve.json").write_text('{"new": 1}')
    with pytest.raises(DsparkError, match="file of --sps-curve as it was then, and that file has changed since"):
        pending_cells(spec)
    assert table() == [4]  # the c=1 cell, served with the old curve, is not this column's
    forced = MatrixSpec(**{**spec.__dict__, "force": True})
    assert len(pending_cells(forced)) == 2


def test_a_label_resumed_against_a_server_now_serving_another_model_is_refused(tmp_path: Path) -> None:
    """The same URL restarted with another model: the label's old cells were kept, and with two models among the
    run's cells the table's model filter kept both, one column holding two models' numbers."""
    from dspark_cli.bench.matrix import check_resumed_model

    spec = MatrixSpec(configs=[BenchConfig("server")], concurrencies=[1, 4], prompts=[Prompt(text="x")] * 4,
                      load=LoadConfig(base_url="http://127.0.0.1:8000"), results_dir=tmp_path,
                      workload={"num_prompts": 4})
    atomic_write_json(cell_path(tmp_path, "server", 1), {
        "dspark_bench_cell": CELL_FORMAT, "config": "server", "concurrency": 1, "metrics": {"failed": 0},
        "workload": {"num_prompts": 4}, "server": {"mode": "external", "base_url": "http://127.0.0.1:8000",
                                                   "model": "model-a"}})
    check_resumed_model(spec, "model-a")
    with pytest.raises(DsparkError, match="measured with model 'model-a', and the server now serves 'model-b'"):
        check_resumed_model(spec, "model-b")


def test_a_cell_measured_alone_beside_interleaved_ones_is_refused(tmp_path: Path) -> None:
    """A concurrency whose finished cells shared the device (``--interleave``) cannot take one measured alone."""
    spec = MatrixSpec(configs=[BenchConfig("none", ("--capacity-mode", "none")), BenchConfig("nospec", ("-k", "0"))],
                      concurrencies=[1, 4], prompts=[Prompt(text="x")], load=LoadConfig(base_url=""),
                      results_dir=tmp_path, workload={"num_prompts": 1}, serve=True, serve_args=["--model", "tiny"])
    for c in (1, 4):
        atomic_write_json(cell_path(tmp_path, "none", c), {
            "dspark_bench_cell": CELL_FORMAT, "config": "none", "concurrency": c, "metrics": {"failed": 0},
            "workload": {"num_prompts": 1},
            "server": {"mode": "serve", "interleaved": ["none", "nospec"],
                       "serve_args": ["--model", "tiny", "--capacity-mode", "none"]}})
    atomic_write_json(cell_path(tmp_path, "nospec", 4), {
        "dspark_bench_cell": CELL_FORMAT, "config": "nospec", "concurrency": 4, "metrics": {"failed": 0},
        "workload": {"num_prompts": 1},
        "server": {"mode": "serve", "interleaved": ["none", "nospec"], "serve_args": ["--model", "tiny", "-k", "0"]}})
    with pytest.raises(DsparkError, match=r"none__c1.json was measured with --interleave, beside the cells of c=1"):
        pending_cells(spec)
    spec.interleave = True  # resumed interleaved: c=1 is measured again whole, c=4 is done
    assert [(k.name, c) for k, c in pending_cells(spec)] == [("none", 1), ("nospec", 1)]
    spec.interleave, spec.force = False, True
    assert len(pending_cells(spec)) == 4


def test_a_column_measured_again_keeps_its_place_and_the_tables_reference(tmp_path: Path) -> None:
    """Columns go by when their first cell was measured: a first label measured again with --force moved last, and
    the table's Δ% reference with it. A replacing cell keeps the time of the one it replaced."""
    from dspark_cli.bench.matrix import Hooks, _write_cell, same_workload_cells

    spec = _spec(tmp_path)
    hooks = Hooks()

    def cell(config: str, started: str) -> dict:
        return {"dspark_bench_cell": CELL_FORMAT, "config": config, "concurrency": 1, "workload": spec.workload,
                "metrics": {"completed": 1, "failed": 0, "errors": []}, "started_at": started}

    _write_cell(spec, cell("base", "2026-12-06T01:00:00"), hooks)
    _write_cell(spec, cell("other", "2026-12-06T02:00:00"), hooks)
    again = cell("base", "2026-12-06T03:00:00")  # base measured again (--force)
    _write_cell(spec, again, hooks)
    assert again["column_since"] == "2026-12-06T01:00:00"
    assert load_cell(cell_path(tmp_path, "base", 1))["started_at"] == "2026-12-06T03:00:00"
    _, names, _, _ = same_workload_cells(tmp_path, spec.workload, ["base"], [1], [again])
    assert names == ["base", "other"]
    _write_cell(spec, cell("base", "2026-12-06T04:00:00"), hooks)  # and again: still the first one's time
    assert load_cell(cell_path(tmp_path, "base", 1))["column_since"] == "2026-12-06T01:00:00"
