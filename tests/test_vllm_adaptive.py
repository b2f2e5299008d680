"""benchmarks/vllm_adaptive.py's paired rounds: the bench commands each round sends, and the paired table.

The H200 sitting of docs/PERFORMANCE.md section 25 read two servers with the same paused steps 10 points apart at
16 requests, one cell each: issue 6's 3% bar needs each group measured in rounds, paired with a reference server
of the same group and round. vLLM itself is not needed for any of this.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_adaptive.py"
_spec = importlib.util.spec_from_file_location("vllm_adaptive_rounds", SCRIPT)
adaptive = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = adaptive  # its dataclasses resolve their module by name
_spec.loader.exec_module(adaptive)


def _args(tmp_path: Path, rounds: int, min_waves: int = 1) -> SimpleNamespace:
    return SimpleNamespace(out=tmp_path, rounds=rounds, num_prompts=512, concurrency="16,64,256", input_len=128,
                           model="/models/target", output_len=128, temperature=0.0, min_waves=min_waves)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_each_round_benches_its_share_of_fresh_prompts_into_its_own_folder(tmp_path: Path) -> None:
    (cmd,), out = adaptive.bench_commands(_args(tmp_path, 1, min_waves=2), "varlen", 8000)
    assert out == tmp_path / "bench" and _flag(cmd, "-n") == "512" and _flag(cmd, "--seed") == "0"
    assert _flag(cmd, "--base-url") == "http://127.0.0.1:8000" and _flag(cmd, "--label") == "varlen"
    assert _flag(cmd, "-c") == "16,64,256"  # one pass: --min-waves only shapes rounds
    seen = set()
    for r in range(2):
        (cmd,), out = adaptive.bench_commands(_args(tmp_path, 2), "nospec#2", 8001, round_=r)
        assert out == tmp_path / "bench" / f"round{r + 1}" and _flag(cmd, "-n") == "256"
        assert _flag(cmd, "--results-dir") == str(out) and _flag(cmd, "--label") == "nospec#2"
        seen.add(_flag(cmd, "--seed"))
        # the first round warms each server up before its first cell; later rounds find it warm
        assert ("--warmup-prompts" in cmd) == (r > 0) and (r == 0 or _flag(cmd, "--warmup-prompts") == "0")
        assert r > 0 or _flag(cmd, "--warmup-max-tokens") == "128"  # as long as the cells' requests
    assert len(seen) == 2  # fresh random prompts each round: no prefix-cache hits on a round's repeat


def test_a_round_keeps_at_least_min_waves_per_cell(tmp_path: Path) -> None:
    """Half of 512 prompts is one wave at 256 requests (~3 s of admission ramp and drain on the H200): with
    --min-waves 2 that cell gets 512 prompts of its own, the lighter loads keep their share."""
    cmds, out = adaptive.bench_commands(_args(tmp_path, 2, min_waves=2), "varlen", 8000, round_=1)
    assert [(_flag(c, "-c"), _flag(c, "-n")) for c in cmds] == [("16,64", "256"), ("256", "512")]
    assert {_flag(c, "--results-dir") for c in cmds} == {str(out)} and len({_flag(c, "--seed") for c in cmds}) == 1


def _row(group: int, config: str, r: int, c: int, tok_s: float) -> dict:
    return {"group": group, "config": config, "round": r, "concurrency": c, "output_tok_s": tok_s}


def test_configs_are_paired_with_their_own_groups_reference_round_by_round() -> None:
    rows = [
        # group 0: the reference by its own name, a config 10% / 20% / 0% over it in three rounds
        _row(0, "nospec", 0, 16, 100.0), _row(0, "varlen", 0, 16, 110.0),
        _row(0, "nospec", 1, 16, 50.0), _row(0, "varlen", 1, 16, 60.0),  # the whole round ran slower: still +20%
        _row(0, "nospec", 2, 16, 100.0), _row(0, "varlen", 2, 16, 100.0),
        # group 4: a second reference server by its tag, and an A/A pair inside the group
        _row(4, "nospec#2", 0, 16, 200.0), _row(4, "mask", 0, 16, 150.0), _row(4, "nospec#3", 0, 16, 204.0),
        {"group": 4, "config": "mask", "round": 1, "error": "server died"},
        # group 8 has no reference: left out
        _row(8, "varlen-startup", 0, 16, 90.0),
    ]
    paired = {(x["group"], x["config"]): x for x in adaptive.paired_rounds(rows, "nospec")}
    assert set(paired) == {(0, "varlen"), (4, "mask"), (4, "nospec#3")}
    v = paired[0, "varlen"]
    assert v["reference"] == "nospec" and v["rounds"] == 3
    assert v["median"] == pytest.approx(0.10) and v["min"] == pytest.approx(0.0) and v["max"] == pytest.approx(0.20)
    assert paired[4, "mask"]["reference"] == "nospec#2" and paired[4, "mask"]["median"] == pytest.approx(-0.25)
    assert paired[4, "nospec#3"]["median"] == pytest.approx(0.02)
    table = adaptive.paired_table(list(paired.values()), "nospec")
    assert "| 16 | +10.0% (+0.0..+20.0) | -25.0% (-25.0..-25.0) | +2.0% (+2.0..+2.0) |" in table
    # the heading names the servers each group was paired with, not only the name asked for
    assert table.startswith("Median Δ of output tok/s against nospec, nospec#2, same group and round")
    group4 = adaptive.paired_table([x for x in paired.values() if x["group"] == 4], "nospec")
    assert group4.startswith("Median Δ of output tok/s against nospec#2, same group")


def test_a_config_names_its_spec_its_api_servers_and_its_tag_and_pairs_by_spec() -> None:
    assert adaptive.config_parts("varlen") == ("varlen", None)
    assert adaptive.config_parts("nospec#2") == ("nospec", None)
    assert adaptive.config_parts("varlen@2#b") == ("varlen", 2)
    with pytest.raises(ValueError, match="positive integer"):
        adaptive.config_parts("varlen@0")
    # a group served by two API processes per server pairs with its own no-speculation server
    rows = [_row(1, "nospec@2", 0, 256, 100.0), _row(1, "all@2", 0, 256, 130.0),
            _row(1, "nospec@2", 1, 256, 90.0), _row(1, "all@2", 1, 256, 99.0)]
    (x,) = adaptive.paired_rounds(rows, "nospec")
    assert (x["config"], x["reference"]) == ("all@2", "nospec@2")
    assert x["median"] == pytest.approx(0.20)


def test_bad_rounds_and_configs_are_refused_before_anything_starts(tmp_path: Path) -> None:
    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(SCRIPT), "--model", "m", "--draft", "d", "--out", str(tmp_path),
                               *extra], capture_output=True, text=True, timeout=120)

    bad = run("--configs", "nospec,varlen", "--num-prompts", "512", "--rounds", "3")
    assert bad.returncode == 2 and "--rounds must be >= 1 and divide --num-prompts (512)" in bad.stderr
    bad = run("--configs", "nospec,varlen", "--rounds", "2", "--lossless", "4")
    assert bad.returncode == 2 and "--rounds pairs dspark bench cells" in bad.stderr
    bad = run("--configs", "nospec#2,bogus#2")
    assert bad.returncode == 2 and "unknown configs ['bogus#2']" in bad.stderr
    bad = run("--configs", "nospec", "--api-servers", "0")
    assert bad.returncode == 2 and "--api-servers must be >= 1" in bad.stderr
    bad = run("--configs", "nospec,varlen@0")
    assert bad.returncode == 2 and "config 'varlen@0': the API server count after '@' must be a positive" in bad.stderr
    bad = run("--configs", "nospec,varlen@x#2")
    assert bad.returncode == 2 and "config 'varlen@x#2'" in bad.stderr
    # every drafting server would load its weights and then stop in vLLM's warm-up (section 37)
    bad = run("--configs", "nospec,varlen", "--k", "7", "--max-num-batched-tokens", "256")
    assert bad.returncode == 2 and "--max-num-seqs 25 or fewer" in bad.stderr
    # the warm-up fits 25 requests, but vLLM's own manager would then stop in its start-up profile (section 38);
    # ours leaves the overflowing sizes out of it
    bad = run("--configs", "nospec,upstream", "--k", "7", "--max-num-batched-tokens", "256", "--max-num-seqs", "25")
    assert bad.returncode == 2 and "config upstream: " in bad.stderr and "--max-num-batched-tokens 425" in bad.stderr
    for fine in (("--configs", "nospec,varlen", "--compilation", "decode-graphs"),  # no torch.compile ranges
                 ("--configs", "nospec,varlen", "--max-num-seqs", "25"),
                 ("--configs", "nospec#2,nospec")):  # no draft to warm up
        run_ = run(*fine, "--k", "7", "--max-num-batched-tokens", "256", "--lossless", "1", "--startup-timeout", "5")
        assert "warm-up" not in run_.stderr and "start-up profile" not in run_.stderr


# A stand-in for `python -m vllm.entrypoints.cli.main serve ...`: the log lines vllm_adaptive.py waits for, then a
# real OpenAI-compatible server -- the embedded engine's tiny pair on the CPU -- on the port it was given.
_FAKE_VLLM_MAIN = '''
import json, os, sys
argv = sys.argv[1:]
assert argv[0] == "serve" and "--kv-cache-memory-bytes" in argv, argv
want = os.environ.get("EXPECT_COMPILATION")  # a test's --compilation, as the server must receive it
assert not want or json.loads(argv[argv.index("--compilation-config") + 1]) == json.loads(want), argv
# servers started together under torch.compile compile for themselves, not into one shared cache directory
piecewise = json.loads(argv[argv.index("--compilation-config") + 1])["mode"] == 3
assert (os.environ.get("VLLM_DISABLE_COMPILE_CACHE") == "1") == piecewise, argv
# benchmark servers run without prefix caching (equal work per cell); the lossless check keeps it
assert ("--no-enable-prefix-caching" in argv) == (os.environ.get("EXPECT_PREFIX_CACHING") == "off"), argv
# a server that stops before it is up, as section 37's stopped in vLLM's warm-up: the one whose argv holds this
stop_at = os.environ.get("STANDIN_EXIT_AT_START")
if stop_at and any(stop_at in a for a in argv):
    sys.exit(os.environ.get("STANDIN_EXIT_CAUSE", "AssertionError: Shape: 280 out of considered ranges: [(1, 256)]"))
# --max-num-batched-tokens reaches every server where a test asks for it
want_bt = os.environ.get("EXPECT_BATCHED_TOKENS")
assert not want_bt or argv[argv.index("--max-num-batched-tokens") + 1] == want_bt, argv
# --api-servers N (or a config's @N) becomes vLLM's --api-server-count N (absent for one): the test reads the log
api = argv[argv.index("--api-server-count") + 1] if "--api-server-count" in argv else "1"
print(f"stand-in API servers: {api}", flush=True)
port = argv[argv.index("--port") + 1]
print("INFO [kv_cache_utils.py] GPU KV cache size: 1,024 tokens (stand-in)", flush=True)
if any(a.startswith("{") and "dspark" in a for a in argv):  # the plugin's settings, in a JSON argument
    print("INFO dspark: adaptive verification by dspark (stand-in)", flush=True)
os.execvp(sys.executable, [sys.executable, "-m", "dspark_cli.cli", "serve", "--model", "tiny", "--device", "cpu",
                           "--seed", "0", "--max-num-seqs", "4", "--host", "127.0.0.1", "--port", port,
                           "--served-model-name", argv[1]])
'''


def _stand_in_vllm(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A ``vllm`` package whose CLI serves the embedded tiny model (``_FAKE_VLLM_MAIN``), first on PYTHONPATH,
    and the draft under a path without 'dspark' in it (vLLM picks the speculative method from the path)."""
    import os

    from dspark_cli.engines.embedded.assets import TINY_DIR

    fake = tmp_path / "fake"
    pkg = fake / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (fake / "vllm", fake / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(_FAKE_VLLM_MAIN)
    draft = tmp_path / "draft"
    draft.symlink_to(TINY_DIR / "draft")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}, draft


def test_a_group_in_rounds_against_real_servers_writes_every_rounds_cells_and_the_paired_table(
        tmp_path: Path) -> None:
    """The whole --rounds path: a group of three servers started together (a fixed KV cache, no memory
    profile), two rounds of half the prompts each, every config's cells per round, and paired.md with the
    tagged second reference server as an A/A row. Every server gets the --compilation asked for (under
    torch.compile, with vLLM's compile cache off), no prefix cache, and --api-servers' API server count unless its
    name asks for its own (``@1``)."""
    import json

    from dspark_cli.engines.embedded.assets import TINY_DIR

    env, draft = _stand_in_vllm(tmp_path)
    env["EXPECT_COMPILATION"] = json.dumps({"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"})
    env["EXPECT_PREFIX_CACHING"] = "off"
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(TINY_DIR / "target"), "--draft", str(draft),
         "--out", str(out), "--k", "4", "--configs", "nospec,varlen,nospec@1#2", "--overlap-starts", "3",
         "--gpu-memory-utilization", "0.2", "--kv-cache-gib", "1", "--rounds", "2", "--num-prompts", "8",
         "--concurrency", "1,2", "--input-len", "8", "--output-len", "8", "--compilation", "piecewise",
         "--api-servers", "2"],
        capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())["results"]
    assert not [r for r in rows if "error" in r]
    assert sorted((r["config"], r["round"], r["concurrency"]) for r in rows) == sorted(
        (cfg, r, c) for cfg in ("nospec", "varlen", "nospec@1#2") for r in (0, 1) for c in (1, 2))
    apis = {n: (out / f"serve-{n}.log").read_text().count(f"stand-in API servers: {a}")
            for n, a in (("nospec", 2), ("varlen", 2), ("nospec@1#2", 1))}
    assert apis == {"nospec": 1, "varlen": 1, "nospec@1#2": 1}, apis
    for r in (1, 2):
        cells = {p.name for p in (out / "bench" / f"round{r}" / "cells").glob("*.json")}
        assert len(cells) == 6, cells
        # each cell records the CPU its server's API process used (the process vllm_adaptive.py started)
        for path in (out / "bench" / f"round{r}" / "cells").glob("*.json"):
            use = json.loads(path.read_text())["cpu"]
            assert use["server_pid"] > 0 and use["server_share"] is not None and use["client_share"] > 0
    paired = (out / "paired.md").read_text()
    assert "nospec, varlen, nospec@1#2, 2 rounds" in paired
    assert "| c | varlen | nospec@1#2 |" in paired and paired.count("\n| 1 | ") == 1 and paired.count("\n| 2 | ") == 1


def test_the_lossless_check_with_text_questions_compares_every_config_against_no_speculation(
        tmp_path: Path) -> None:
    """--lossless --lossless-text (the real-weight check's prompts: questions in the draft's domain) against
    real servers: every config's greedy outputs are compared with no speculation's, and the concurrent smoke
    is served."""
    import json

    from dspark_cli.engines.embedded.assets import TINY_DIR

    env, draft = _stand_in_vllm(tmp_path)
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(TINY_DIR / "target"), "--draft", str(draft),
         "--out", str(out), "--k", "4", "--configs", "nospec,varlen", "--overlap-starts", "2",
         "--gpu-memory-utilization", "0.2", "--kv-cache-gib", "1", "--lossless", "3", "--lossless-text",
         "--smoke", "2"],
        capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((out / "lossless.json").read_text())
    outputs = report["outputs"]
    assert set(outputs) == {"nospec", "varlen"} and len(outputs["nospec"]) == 3
    # the stand-in returns text, not token ids: the script compares its characters then
    assert all(len(o) > 0 for o in outputs["nospec"]) and len(set(map(tuple, outputs["nospec"]))) == 3
    assert outputs["varlen"] == outputs["nospec"]
    assert "identical to nospec: 3/3" in run.stdout
    # the tail request (up to max_model_len) is served by every config and reported beside the verdict
    assert set(report["tails"]) == {"nospec", "varlen"} and all(report["tails"].values())
    assert report["summary"]["varlen"]["tail"].startswith(("identical", "differs"))
    assert "tail request (up to max_model_len, not in the verdict)" in run.stdout


def test_the_lossless_check_serves_the_defer_ab_without_prefix_caching_and_reports_it(tmp_path: Path) -> None:
    """--prefix-caching off and --max-num-batched-tokens reach every server of the check, and the check's
    draft_defer_prompts A/B (varlen-cycle-plain against varlen-cycle-defer) is reported beside the verdict and
    written to lossless.json. The stand-in server logs no saturation line, so its A/B can only say that nothing
    was deferred."""
    import json

    from dspark_cli.engines.embedded.assets import TINY_DIR

    env, draft = _stand_in_vllm(tmp_path)
    env["EXPECT_PREFIX_CACHING"] = "off"
    env["EXPECT_BATCHED_TOKENS"] = "256"
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(TINY_DIR / "target"), "--draft", str(draft),
         "--out", str(out), "--k", "4", "--configs", "nospec,varlen-cycle-plain,varlen-cycle-defer",
         "--overlap-starts", "3", "--gpu-memory-utilization", "0.2", "--kv-cache-gib", "1", "--lossless", "2",
         "--smoke", "3", "--prefix-caching", "off", "--max-num-batched-tokens", "256", "--max-num-seqs", "36"],
        capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((out / "lossless.json").read_text())
    ab = report["defer_ab"]
    assert ab["configs"] == ["varlen-cycle-plain", "varlen-cycle-defer"] and ab["verdict"] == "not exercised"
    # the stand-in's embedded server counts its drafts as vLLM does: both sides drafted over the check
    assert all(d > 0 for d in ab["drafts"]) and all(0 <= f <= 1 for f in ab["first_position"])
    assert "draft_defer_prompts A/B (varlen-cycle-plain vs varlen-cycle-defer)" in run.stdout
    assert "lossless greedy: OK" in run.stdout


def test_a_config_that_did_not_start_fails_the_check_apart_and_the_others_still_serve(tmp_path: Path) -> None:
    """Exit 6, not 1: a server that stopped before it was up says nothing about a served path, so the queue does
    not switch the matrix to its fallback (section 37 served group 1 with the draft kept current for that). The
    configs after it are still served and checked. Its log's cause, an assertion of vLLM's start-up, is one a
    lone start repeats (6: the queue starts no row of them, section 38); out of memory may not be (5)."""
    import json

    from dspark_cli.engines.embedded.assets import TINY_DIR

    env, draft = _stand_in_vllm(tmp_path)
    env["STANDIN_EXIT_AT_START"] = '"draft_defer_prompts":true'
    for cause, code in (("AssertionError: Shape: 257 out of considered ranges: [(1, 256)]", 6),
                        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB", 5)):
        out = tmp_path / f"out{code}"
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "--model", str(TINY_DIR / "target"), "--draft", str(draft),
             "--out", str(out), "--k", "4", "--configs", "nospec,varlen-cycle-defer,varlen-verify",
             "--gpu-memory-utilization", "0.2", "--kv-cache-gib", "1", "--lossless", "2"],
            capture_output=True, text=True, timeout=600, env={**env, "STANDIN_EXIT_CAUSE": cause})
        assert run.returncode == code, run.stdout[-2000:] + run.stderr[-2000:]
        assert "lossless greedy: FAILED (a config did not start" in run.stdout
        report = json.loads((out / "lossless.json").read_text())
        assert [e["config"] for e in report["errors"]] == ["varlen-cycle-defer"]
        error = report["errors"][0]
        assert error["error"] == f"not started: server exited with 1 [{cause}]"
        assert error["retry_alone"] is (code == 5)
        assert report["summary"]["varlen-verify"]["identical_to_nospec"] == 2


def test_a_stopped_servers_cause_is_the_last_exception_its_log_names() -> None:
    log = ("INFO loading\n(EngineCore pid=1) ERROR [core.py:1584] AssertionError: Shape: 257 out of considered "
           "ranges: [(1, 256)]\nTraceback (most recent call last):\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert adaptive.start_cause(log) == "AssertionError: Shape: 257 out of considered ranges: [(1, 256)]"
    assert adaptive.start_cause("INFO nothing went wrong here\n") is None
    timeout = adaptive.not_started(RuntimeError("server not ready after 900 s"), None)
    assert timeout.retry_alone and str(timeout) == "not started: server not ready after 900 s"
    unknown = adaptive.not_started(RuntimeError("server exited with -9"), "INFO killed\n")
    assert unknown.retry_alone  # no cause in its log: a lone start may tell
    memory = adaptive.not_started(RuntimeError("server exited with 1"),
                                  "ValueError: No available memory for the cache blocks. Try increasing ...\n")
    assert memory.retry_alone
    kv = adaptive.not_started(RuntimeError("server exited with 1"), "ValueError: To serve at least one request "
                              "with the models's max seq len (2048), (0.1 GiB KV cache is needed, which is larger "
                              "than the available KV cache memory (0.05 GiB)\n")
    assert kv.retry_alone  # memory the other servers held: alone it may start
    refused = adaptive.not_started(RuntimeError("server exited with 1"), "ValueError: dspark: vLLM 0.33.0's ...\n")
    assert not refused.retry_alone
    echoed = adaptive.not_started(RuntimeError("server exited with 1"), log + "ConnectionResetError: peer reset\n")
    assert not echoed.retry_alone and "Shape: 257" in str(echoed)  # the overflow, not its echo


def test_the_lossless_verdict_tells_a_config_that_did_not_start_from_one_that_failed_or_differs(
        tmp_path: Path) -> None:
    same, other = [[1, 2, 3]], [[1, 2, 4]]
    not_started = {"config": "mask", "error": "not started: server exited with 1"}
    failed = {"config": "varlen-cycle", "error": "HTTP Error 500"}
    verdict = adaptive._report_lossless
    assert verdict({"nospec": same, "varlen": same}, [], tmp_path) == 0
    assert verdict({"nospec": same, "varlen": same}, [not_started], tmp_path) == 5
    assert verdict({"nospec": same, "varlen": other}, [not_started], tmp_path) == 3  # a wrong output is never hidden
    assert verdict({"nospec": same, "varlen": same}, [not_started, failed], tmp_path) == 1
    assert verdict({"varlen": same}, [{"config": "nospec", "error": "not started: no KV line"}], tmp_path) == 5
    assert verdict({"varlen": same}, [], tmp_path) == 3  # nothing to compare with
    repeats = {**not_started, "retry_alone": False}
    assert verdict({"nospec": same, "varlen": same}, [repeats], tmp_path) == 6
    assert verdict({"nospec": same, "varlen": same}, [repeats, not_started], tmp_path) == 5  # one may start alone


def _served(first: float, drafts: int, deferred: int | None = 100) -> dict:
    return {"acceptance_all": {"num_drafts": drafts, "per_position_acceptance": [first, first / 2]},
            "deferred_prompt_tokens": deferred}


def test_the_defer_ab_fails_only_a_deferring_draft_that_drafts_clearly_worse() -> None:
    """A catch-up that missed a deferred prompt leaves the draft without its context: its first draft position is
    accepted less often. The A/B calls that ``lower`` only past DEFER_AB_Z standard errors, and says so when it
    cannot tell (too few drafted request-steps) or when nothing was deferred."""
    plain, defer = adaptive.DEFER_AB
    assert adaptive.defer_ab({plain: _served(0.5, 400)}) is None
    assert adaptive.defer_ab({plain: _served(0.5, 400), defer: _served(0.48, 400)})["verdict"] == "same"
    lower = adaptive.defer_ab({plain: _served(0.5, 400), defer: _served(0.3, 400)})
    assert lower["verdict"] == "lower" and lower["z"] < -adaptive.DEFER_AB_Z
    assert adaptive.defer_ab({plain: _served(0.5, 400), defer: _served(0.7, 400)})["verdict"] == "same"
    assert adaptive.defer_ab({plain: _served(0.5, 400), defer: _served(0.1, 10)})["verdict"] == "too few drafts"
    for deferred in (0, None):
        ab = adaptive.defer_ab({plain: _served(0.5, 400), defer: _served(0.1, 400, deferred)})
        assert ab["verdict"] == "not exercised"
    # the greedy requests' counters stand in where no smoke ran
    only_greedy = {"acceptance": {"num_drafts": 400, "per_position_acceptance": [0.2]}, "deferred_prompt_tokens": 9}
    assert adaptive.defer_ab({plain: _served(0.5, 400), defer: only_greedy})["verdict"] == "lower"


def test_config_specs_keep_each_configs_own_settings_over_the_shared_ones() -> None:
    """--dspark settings reach every config of ours, a config's own keys win (varlen-placeholders serves the
    default path even when the queue turns plain_paused_steps on for all), and the lossless check's mask
    configs -- mask-plain included -- prune to half the drafts, so their padding path is checked too."""
    base = {"method": "draft_model", "model": "d", "num_speculative_tokens": 7}
    ours = {"online_sts": True, "plain_paused_steps": True}
    specs = adaptive.config_specs(base, ours)
    assert specs["nospec"] is None and specs["all"] == base
    assert specs["varlen"]["dspark_plain_paused_steps"] is True and specs["varlen"]["dspark_online_sts"] is True
    assert specs["varlen-placeholders"]["dspark_plain_paused_steps"] is False
    assert specs["varlen-defer"]["dspark_draft_defer_prompts"] is True
    assert "dspark_online_sts" not in specs["all"] and specs["varlen-nosts"]["dspark_online_sts"] is False
    assert all("dspark_budget_frac" not in s for s in specs.values() if s)
    checked = adaptive.config_specs(base, {"online_sts": True}, lossless=True)
    masks = {n for n, s in checked.items() if s and s.get("dspark_capacity_verification_mode") == "mask"}
    assert {"mask", "mask-plain", "mask-compact", "mask-uniform"} <= masks
    assert all(checked[n]["dspark_budget_frac"] == 0.5 for n in masks)
    assert checked["mask-plain"]["dspark_plain_paused_steps"] is True
    defer = checked["varlen-cycle-defer"]
    assert defer == {**checked["varlen-cycle-plain"], "dspark_draft_defer_prompts": True}
    assert checked["varlen-cycle-placeholders"] == {**checked["varlen-cycle"], "dspark_plain_paused_steps": False}
    # the pausing configs probe unrationed, so the defer A/B sees enough drafts; the key is one the plugin reads
    from dspark_cli.engines.vllm.config import DsparkVllmSettings, settings_from_seed_keys

    cycles = [n for n in checked if n.startswith("varlen-cycle")]
    assert len(cycles) == 5 and all(checked[n]["dspark_probe_tax"] == 1.0 for n in cycles)
    assert DsparkVllmSettings(**settings_from_seed_keys(checked["varlen-cycle-defer"])).probe_tax == 1.0
    # mask's stale-row path: pausing as often, placeholders kept, pruning to half like every mask config checked
    mcp = checked["mask-cycle-placeholders"]
    assert mcp["dspark_capacity_verification_mode"] == "mask" and mcp["dspark_plain_paused_steps"] is False
    assert mcp["dspark_probe_tax"] == 1.0 and mcp["dspark_saturation_patience"] == 1 and mcp["dspark_budget_frac"] == 0.5
    assert DsparkVllmSettings(**settings_from_seed_keys(mcp)).mode == "mask"
    # the curve-source A/B: varlen-alt exists only with --alt-sps-curve, and differs from varlen by its curve
    assert "varlen-alt" not in specs
    alt = adaptive.config_specs(base, {**ours, "sps_curve": "a.json"}, alt_curve="b.json")
    assert alt["varlen-alt"] == {**alt["varlen"], "dspark_sps_curve": "b.json"}
    assert all("dspark_budget_frac" not in s for n, s in checked.items() if s and n not in masks)


def test_stopping_a_server_that_already_exited_is_no_error(tmp_path: Path) -> None:
    """A server that failed at start-up is gone with its process group by the time its group stops; on the H200
    (section 37) stopping it raised, which ended the lossless check before its other configs served."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    adaptive._Server("varlen", 0, proc, tmp_path / "serve.log").stop()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    adaptive._Server("nospec", 0, live, tmp_path / "serve.log").stop()
    assert live.returncode is not None
