"""The step-anatomy instrumentation of benchmarks/vllm_step_anatomy.py on a stand-in vLLM runner (CPU).

The benchmark runs inside vLLM's worker on the GPU host; what it reports is only as good as its wrappers:
each phase timed once under its label, paused and drafting steps told apart, and the two paused-step
ablations really skipping the work they name while leaving drafting steps alone.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_step_anatomy.py"
spec = importlib.util.spec_from_file_location("vllm_step_anatomy", PATH)
anatomy_mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = anatomy_mod  # dataclasses resolve their module by name
spec.loader.exec_module(anatomy_mod)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1e3


class StandInSpeculator:
    num_speculative_steps = 3

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.draft_tokens = torch.zeros(8, 3, dtype=torch.int64)
        self.calls: list[str] = []

    def propose(self, input_batch, num_speculative_tokens=None, dummy_run=False):
        self._prefill(input_batch)
        if num_speculative_tokens:
            self._multi_step_decode(input_batch)
        return self.draft_tokens[: input_batch.num_reqs]

    def _prefill(self, input_batch):
        self.calls.append("prefill")
        self.clock.advance(1.0)
        self.draft_tokens[: input_batch.num_reqs, 0] = self.sample_draft(torch.zeros(input_batch.num_reqs, 4))

    def sample_draft(self, hidden):
        self.calls.append("sample")
        self.clock.advance(0.5)
        return torch.full((hidden.shape[0],), 7)

    def _multi_step_decode(self, input_batch):
        self.calls.append("decode")
        self.clock.advance(3.0)


class StandInManager:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def get_num_tokens(self) -> int:
        self.clock.advance(0.25)
        return 0


class StandInRunner:
    """execute_model then sample_tokens, each step; sample_tokens proposes with the step's draft count."""

    def __init__(self, clock: Clock, num_reqs: int) -> None:
        self.clock = clock
        self.speculator = StandInSpeculator(clock)
        self.adaptive_verification = StandInManager(clock)
        self.execute_model_state = None
        self.num_reqs = num_reqs

    def execute_model(self, drafting: bool):
        self.clock.advance(2.0)
        self.prepare_inputs()
        self.adaptive_verification.get_num_tokens()
        qsl = np.arange(self.num_reqs + 1) * (4 if drafting else 1)
        batch = SimpleNamespace(num_reqs=self.num_reqs, num_tokens=int(qsl[-1]), query_start_loc_np=qsl)
        self.execute_model_state = SimpleNamespace(input_batch=batch, k=3 if drafting else 0)

    def prepare_inputs(self):
        self.clock.advance(0.5)

    def sample_tokens(self):
        state = self.execute_model_state
        self.sample()
        self.speculator.propose(state.input_batch, num_speculative_tokens=state.k)

    def sample(self):
        self.clock.advance(0.75)


def drive(runner: StandInRunner, pattern: list[bool]) -> None:
    for drafting in pattern:
        runner.execute_model(drafting)
        runner.sample_tokens()
    runner.execute_model(False)  # closes the last step's record


def test_phases_are_timed_once_each_and_steps_told_apart():
    clock = Clock()
    runner = StandInRunner(clock, num_reqs=4)
    anatomy = anatomy_mod.StepAnatomy(runner, clock=clock)
    wrapped = anatomy.install()
    assert {"runner.execute_model", "runner.prepare_inputs", "speculator.propose", "speculator._prefill",
            "speculator.sample_draft", "speculator._multi_step_decode", "manager.get_num_tokens"} <= set(wrapped)
    drive(runner, [True] * 6 + [False] * 6)
    out = anatomy.summary(steady_reqs=4, skip_first=0)
    drafting, paused = out["by_kind"]["drafting"], out["by_kind"]["paused"]
    assert (drafting["steps"], paused["steps"]) == (6, 6)
    # drafting: execute 2 + prepare 0.5 + manager 0.25, sample 0.75, prefill 1 + sample 0.5, decode 3
    assert drafting["interval_ms"] == pytest.approx(8.0)
    assert paused["interval_ms"] == pytest.approx(5.0)
    host = drafting["host_ms"]
    assert host["runner.execute_model"] == pytest.approx(2.75)
    assert host["runner.prepare_inputs"] == pytest.approx(0.5)
    assert host["manager.get_num_tokens"] == pytest.approx(0.25)
    assert host["runner.sample_tokens"] == pytest.approx(5.25)
    assert host["speculator.propose"] == pytest.approx(4.5)
    assert host["speculator._prefill"] == pytest.approx(1.5)
    assert host["speculator.sample_draft"] == pytest.approx(0.5)
    assert "speculator._multi_step_decode" not in paused["host_ms"]  # never ran while paused
    assert drafting["tokens"] == 16 and paused["tokens"] == 4


def test_ablations_skip_only_paused_work():
    clock = Clock()
    runner = StandInRunner(clock, num_reqs=4)
    anatomy = anatomy_mod.StepAnatomy(runner, clock=clock)
    anatomy.install()
    spec = runner.speculator
    anatomy.skip_paused_sample = True
    drive(runner, [False, True])
    assert spec.calls == ["prefill", "prefill", "sample", "decode"]  # the paused prefill kept, its sample not
    anatomy.skip_paused_sample, anatomy.skip_paused_draft = False, True
    spec.calls.clear()
    anatomy.reset()
    drive(runner, [False, False, True])
    assert spec.calls == ["prefill", "sample", "decode"]  # paused steps do no draft work, drafting steps all
    paused = anatomy.summary(steady_reqs=4, skip_first=0)["by_kind"]["paused"]
    assert paused["host_ms"]["speculator.propose"] == pytest.approx(0.0)
    assert paused["interval_ms"] == pytest.approx(3.5)


def test_the_interval_tail_counts_long_steps_and_their_time():
    """A mean ITL pays for the few long steps a median hides: their count, time and the p99 are kept."""
    clock = Clock()
    runner = StandInRunner(clock, num_reqs=4)
    anatomy = anatomy_mod.StepAnatomy(runner, clock=clock)
    anatomy.install()
    pattern = [False] * 9
    for i, drafting in enumerate(pattern):
        runner.execute_model(drafting)
        runner.sample_tokens()
        if i == 4:
            clock.advance(45.0)  # a stall after the fifth step: its interval is 50 ms, the others 5
    runner.execute_model(False)
    paused = anatomy.summary(steady_reqs=4, skip_first=0)["by_kind"]["paused"]
    assert paused["interval_ms"] == pytest.approx(5.0)
    assert (paused["long_steps"], paused["long_total_s"]) == (1, pytest.approx(0.05))
    assert paused["interval_total_s"] == pytest.approx(0.09)
    assert paused["interval_p99_ms"] > 45.0
    row = anatomy_mod.table([{"config": "varlen", "variants": [{"variant": "served", "tok_s": 100.0,
                                                                "by_kind": {"paused": paused}}]}]).splitlines()[2]
    assert "| 5.00 | " in row and "| 0.09 | 1 / 0.05 s |" in row


def test_steps_are_counted_by_load_with_their_time_drafting_and_prompt_chunks():
    """A 256-request cell need not run 256 requests a step: the load table says where a cell's time went."""
    clock = Clock()
    runner = StandInRunner(clock, num_reqs=4)
    anatomy = anatomy_mod.StepAnatomy(runner, clock=clock)
    anatomy.install()
    drive(runner, [False, False, True])  # three steps at 4 requests (one drafting)
    runner.num_reqs = 2
    drive(runner, [False, False])  # two at 2
    anatomy.records[0].max_query_len = 50  # the first carried a prompt chunk
    rows = anatomy.summary(steady_reqs=4, skip_first=0)["by_load"]
    assert [(r["load"], r["steps"], r["drafting"], r["prefill"]) for r in rows] == [
        ("2-3", 2, 0, 0), ("4-7", 3, 1, 1)]
    assert rows[1]["time_s"] == pytest.approx(sum(x.interval_ms for x in anatomy.records if x.num_reqs == 4) / 1e3)
    text = anatomy_mod.load_table([{"config": "varlen c=4", "variants": [{"by_load": rows}]}])
    assert text.splitlines()[3].startswith("| varlen c=4 | 4-7 | 3 | ")
    assert anatomy_mod.load_table([{"config": "old", "variants": [{}]}]).count("\n") == 2  # older results


def test_steady_steps_exclude_other_loads_and_prefill_chunks():
    clock = Clock()
    runner = StandInRunner(clock, num_reqs=4)
    anatomy = anatomy_mod.StepAnatomy(runner, clock=clock)
    anatomy.install()
    drive(runner, [False] * 3)
    runner.num_reqs = 3  # a request finished: not the steady batch
    drive(runner, [False] * 2)
    out = anatomy.summary(steady_reqs=4, skip_first=0)
    assert out["by_kind"]["paused"]["steps"] == 3
    anatomy.records[0].max_query_len = 50  # a prefill chunk rides in the batch
    assert anatomy.summary(steady_reqs=4, skip_first=0)["by_kind"]["paused"]["steps"] == 2


def test_table_lists_every_variant_and_kind():
    res = {"config": "paused", "variants": [{"variant": "as served", "tok_s": 4900.0, "by_kind": {
        "paused": {"steps": 300, "interval_ms": 13.0, "tokens": 64.0, "full_graph_share": 1.0,
                   "host_ms": {"runner.execute_model": 3.0, "manager.observe": 0.1, "manager.get_num_tokens": 0.2},
                   "device_ms": {"execute": 8.0, "forward": 7.5, "sample_tokens": 2.0, "propose": 1.5}}}}]}
    text = anatomy_mod.table([res])
    row = text.splitlines()[2]
    assert row.startswith("| paused | as served | paused | 300 | 4900 | 13.00 | - | - | - | 8.00 | 7.50 | 2.00 | "
                          "1.50 | 3.00 |")  # a result recorded before the tail columns
    assert "| 0.30 | 1.00 |" in row  # our hooks summed; every step replayed a FULL graph


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _reply(handler: BaseHTTPRequestHandler, payload: bytes, content_type: str) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", content_type)
    handler.end_headers()
    handler.wfile.write(payload)


def _serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_served_anatomy_is_driven_over_the_dev_endpoint_with_string_arguments(tmp_path: Path):
    """vllm_adaptive.py --anatomy drives the worker extension through vLLM's POST /collective_rpc, which passes
    every argument as a string; a stand-in of that endpoint calls a real AnatomyExtension on a stand-in runner."""
    adaptive = _load("vllm_adaptive_under_test", PATH.parent / "vllm_adaptive.py")
    clock = Clock()
    ext = anatomy_mod.AnatomyExtension()
    ext.model_runner = StandInRunner(clock, num_reqs=4)
    seen: list[dict] = []

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            assert all(isinstance(v, str) for v in body.get("kwargs", {}).values())
            result = getattr(ext, body["method"])(*body.get("args", []), **body.get("kwargs", {}))
            _reply(self, json.dumps({"results": [result]}).encode(), "application/json")

        def log_message(self, *args):
            pass

    server = _serve(Endpoint)
    try:
        port = server.server_address[1]
        assert "speculator.propose" in adaptive._rpc(port, "anatomy_install")[0]
        adaptive._rpc(port, "anatomy_begin", skip_paused_draft=True)
        assert ext._dspark_anatomy.skip_paused_draft and not ext._dspark_anatomy.skip_paused_sample
        for _ in range(8):  # paused steps of 4, then 3 requests (a closed loop refilling)
            drive(ext.model_runner, [False])
            ext.model_runner.num_reqs = 7 - ext.model_runner.num_reqs
        summary = adaptive._rpc(port, "anatomy_end", steady_reqs=4, min_reqs=3)[0]
    finally:
        server.shutdown()
    assert [b["method"] for b in seen] == ["anatomy_install", "anatomy_begin", "anatomy_end"]
    assert seen[2]["kwargs"] == {"steady_reqs": "4", "min_reqs": "3"}
    paused = summary["by_kind"]["paused"]
    assert ext.model_runner.speculator.calls == []  # no draft work, as switched
    assert summary["prefill_share"] == 0.0 and summary["all_steps"]["paused"]["steps"] >= paused["steps"]
    # the tables vllm_adaptive writes from such cells
    out = tmp_path / "anatomy"
    out.mkdir()
    cell = {"config": "paused c=4", "concurrency": 4, "variants": [{"variant": "served", "tok_s": 100.0, **summary}]}
    (out / "paused-c4.json").write_text(json.dumps(cell))
    adaptive._write_anatomy_tables(out)
    text = (out / "anatomy.md").read_text()
    assert text.count("| paused c=4 | served | paused |") == 2 and "paused c=4 0.0" in text
    assert "| paused c=4 | 2-3 | " in text and "| paused c=4 | 4-7 | " in text  # the steps by load, through the RPC


def test_device_spans_pair_up_per_step():
    """Each span's two events belong to the step they timed (events read the stand-in clock here)."""
    clock = Clock()

    class Event:
        def record(self):
            self.t = clock.t

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    runner = StandInRunner(clock, num_reqs=4)
    anatomy = anatomy_mod.StepAnatomy(runner, clock=clock, event_factory=Event)
    anatomy.install()
    drive(runner, [True] * 3)
    device = anatomy.summary(steady_reqs=4, skip_first=0)["by_kind"]["drafting"]["device_ms"]
    # execute: 2 + prepare 0.5 + manager 0.25; sample_tokens: 0.75 + propose (prefill 1, sample 0.5, decode 3)
    assert device["execute"] == pytest.approx(2.75)
    assert device["propose"] == pytest.approx(4.5)
    assert device["sample_tokens"] == pytest.approx(5.25)
    assert device["forward"] is None  # the stand-in has no model to hook


def test_lossless_mode_reports_acceptance_the_concurrent_smoke_and_exit_codes(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]):
    """vllm_adaptive.py --lossless --smoke against a stand-in of vLLM's completions and metrics endpoints."""
    adaptive = _load("vllm_adaptive_lossless", PATH.parent / "vllm_adaptive.py")
    short_by = {"n": 0}
    bodies: list[dict] = []

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            n = body["max_tokens"] - (short_by["n"] if body["max_tokens"] > 100 else 0)
            body = {"choices": [{"text": "x", "token_ids": list(range(n))}], "usage": {"completion_tokens": n}}
            _reply(self, json.dumps(body).encode(), "application/json")

        def do_GET(self):  # noqa: N802
            _reply(self, b"vllm:spec_decode_num_drafts_total 10\nvllm:spec_decode_num_draft_tokens_total 70\n"
                         b"vllm:spec_decode_num_accepted_tokens_total 15\n", "text/plain")

        def log_message(self, *args):
            pass

    server = _serve(Endpoint)
    try:
        port = server.server_address[1]
        # N prompts, and the tail request: it decodes up to one token short of the servers' max_model_len,
        # where vLLM schedules fewer than K drafts (the varlen graphs' query bound, plugin.bound_query_len)
        outs = adaptive._greedy_outputs(port, "m", 3, text=True)
        assert [len(o) for o in outs] == [32, 32, 32] and all(isinstance(b["prompt"], str) for b in bodies)
        assert len(adaptive._tail_output(port, "m")) == adaptive.TAIL_TOKENS
        tail = bodies[-1]
        assert len(tail["prompt"]) + tail["max_tokens"] == adaptive.MAX_MODEL_LEN - 1 and tail["temperature"] == 0.0
        assert adaptive._acceptance(port)["acceptance_length"] == pytest.approx(2.5)
        assert adaptive._concurrent_smoke(port, "m", 12) == {"requests": 12, "complete": 12}
        short_by["n"] = 3  # the longest requests come back short
        smoke = adaptive._concurrent_smoke(port, "m", 12)
    finally:
        server.shutdown()
    assert smoke["complete"] < 12
    same = {"nospec": [[1, 2]], "varlen": [[1, 2]]}
    ok = {"acceptance": {"acceptance_length": 2.5}, "smoke": {"requests": 12, "complete": 12},
          "upkeep": "skipped on 40 steps, 2 catch-ups of 600 tokens"}
    assert adaptive._report_lossless(same, [], tmp_path, {"varlen": ok}) == 0
    out = capsys.readouterr().out
    assert "acceptance length 2.500" in out and "2 catch-ups" in out and "lossless greedy: OK" in out
    # the tail request is reported beside the verdict, not in it
    tails = {"nospec": [5, 6, 7, 8], "varlen": [5, 6, 9, 8]}
    assert adaptive._report_lossless(same, [], tmp_path, {"varlen": ok}, tails) == 0
    out = capsys.readouterr().out
    assert "tail request (up to max_model_len, not in the verdict): differs from token 2 of 4" in out
    assert "identical (4 tokens)" in out and "lossless greedy: OK" in out
    assert json.loads((tmp_path / "lossless.json").read_text())["summary"]["varlen"]["tail"].startswith("differs")
    # a tail request that was not served is said so, and still leaves the verdict alone
    tails = {"nospec": [5, 6], "varlen": "not served (HTTP Error 400: Bad Request)"}
    assert adaptive._report_lossless(same, [], tmp_path, {"varlen": ok}, tails) == 0
    assert "not in the verdict): not served (HTTP Error 400" in capsys.readouterr().out
    assert adaptive._report_lossless({"nospec": [[1, 2]], "varlen": [[1, 3]]}, [], tmp_path) == 3
    assert adaptive._report_lossless(same, [], tmp_path, {"varlen": {**ok, "smoke": smoke}}) == 1
    assert adaptive._report_lossless(same, [{"config": "mask", "error": "exited"}], tmp_path) == 1
    assert json.loads((tmp_path / "lossless.json").read_text())["errors"][0]["config"] == "mask"


def test_keep_draft_current_switches_the_managers_upkeep_off_for_one_run():
    clock = Clock()
    ext = anatomy_mod.AnatomyExtension()
    ext.model_runner = StandInRunner(clock, num_reqs=4)
    upkeep = object()
    ext.model_runner.adaptive_verification = SimpleNamespace(_upkeep=upkeep)
    ext.anatomy_install()
    ext.anatomy_begin(keep_draft_current="True")  # the dev endpoint's string form
    assert ext.model_runner.adaptive_verification._upkeep is None
    ext.anatomy_end(steady_reqs=4)
    assert ext.model_runner.adaptive_verification._upkeep is upkeep
