"""The engine in a process of its own (``dspark serve --engine-process``): what only that front can show.

The behaviour both fronts share (streaming, merging, aborts, refusals, engine faults) is tested against both
in test_server_async.py. Here: the engine process idles without spinning, ignores Ctrl-C, dies alone or
with the server without leaving anything behind, and a real `dspark serve --engine-process` answers
token for token like the same server with the engine on a thread, with exact counters.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_server_async import _collect, scripted
from test_server_e2e import Server, process_alive, start_server, stop_server, wait_healthy

from dspark_cli.engines.embedded.async_engine import EngineDeadError
from dspark_cli.engines.embedded.engine_process import ProcessEngine
from dspark_cli.engines.embedded.server import ServerContext, create_app
from dspark_cli.errors import DsparkError
from dspark_cli.serve_config import build_settings, prepare_embedded


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_engine_process_blocks_and_ignores_sigint() -> None:
    async def main() -> None:
        pe = ProcessEngine(scripted())
        await pe.start()
        assert pe.pid is not None
        assert await _collect(pe, "a", [1], 2) == [11, 12]
        await asyncio.sleep(0.1)
        before = _cpu_s(pe.pid)
        await asyncio.sleep(0.5)
        assert _cpu_s(pe.pid) - before < 0.05  # blocked on its command pipe, not polling
        # A terminal's Ctrl-C reaches the whole process group; the engine leaves the shutdown to the server.
        os.kill(pe.pid, signal.SIGINT)
        await asyncio.sleep(0.2)
        assert pe.healthy and await _collect(pe, "b", [2], 2) == [12, 13]
        await pe.shutdown()
        assert pe.state == "stopped" and pe._proc is not None and pe._proc.exitcode == 0
        assert not process_alive(pe.pid)

    asyncio.run(main())


def _scripted_reporting_sigint(ignored_at_unpickling: bool) -> Any:
    engine = scripted()()
    engine.vocab_size = 1 if ignored_at_unpickling else 2  # comes back to the server in EngineInfo
    return engine


class _SigintProbe:
    """A factory that notes, as the engine process unpickles it (before any of our code runs there),
    whether SIGINT is ignored already."""

    def __reduce__(self) -> Any:
        return _probe_sigint, ()


def _probe_sigint() -> Any:
    return functools.partial(_scripted_reporting_sigint, signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


def test_engine_process_ignores_sigint_from_its_start_up_on() -> None:
    async def main() -> None:
        handler = signal.getsignal(signal.SIGINT)
        pe = ProcessEngine(_SigintProbe())
        await pe.start()
        try:
            assert pe.engine.vocab_size == 1  # ignored while its interpreter started and imported
            assert signal.getsignal(signal.SIGINT) is handler  # this process got its own handler back
        finally:
            await pe.shutdown()

    asyncio.run(main())


def test_killed_engine_process_fails_pending_requests_and_health(caplog: pytest.LogCaptureFixture) -> None:
    """Requests in flight fail, /health says why, the log says so (as the thread front logs a failed step), and
    /metrics counts those requests as ended in error, with none left running."""
    async def main() -> None:
        pe = ProcessEngine(scripted(step_s=0.01))
        await pe.start()
        client = TestClient(TestServer(create_app(ServerContext(pe, "fake"))))
        await client.start_server()
        try:
            task = asyncio.ensure_future(_collect(pe, "long", [1], 10_000))
            await asyncio.sleep(0.2)
            assert pe.pid is not None
            os.kill(pe.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited unexpectedly \\(killed by SIGKILL\\)"):
                await asyncio.wait_for(task, 10)
            assert not pe.healthy and pe.state == "failed" and pe.num_pending == 0
            h = await client.get("/health")
            body = await h.json()
            assert h.status == 503 and body["status"] == "failed" and "killed by SIGKILL" in body["error"]
            with pytest.raises(EngineDeadError):
                await _collect(pe, "late", [1], 1)
            assert any("exited unexpectedly" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
            text = await (await client.get("/metrics")).text()
            running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running{")]
            errors = [ln for ln in text.splitlines()
                      if ln.startswith("vllm:request_success_total{") and 'finished_reason="error"' in ln]
            assert running and float(running[0].rsplit(" ", 1)[1]) == 0.0, running
            assert errors and float(errors[0].rsplit(" ", 1)[1]) == 1.0, errors
        finally:
            await client.close()
            await pe.shutdown()
        assert pe.state == "failed" and not process_alive(pe.pid)

    asyncio.run(main())


def test_an_unpicklable_factory_fails_start_and_starts_nothing() -> None:
    async def main() -> None:
        pe = ProcessEngine(lambda: None)
        with pytest.raises(Exception, match="pickle"):
            await pe.start()
        assert pe.state == "failed" and pe.pid is None
        await pe.shutdown()

    asyncio.run(main())


def _bad_model() -> Any:
    raise DsparkError("--model 'nowhere': neither a known model nor a checkpoint directory with config.json")


def _engine_with_a_local_tokenizer() -> Any:
    class Local:  # defined in a function: it cannot pickle
        pass

    return scripted(tokenizer=Local())()


@pytest.mark.parametrize(("factory", "error", "match"), [
    (_bad_model, DsparkError, "^--model 'nowhere': neither a known model"),  # the same one line as the thread front
    (_engine_with_a_local_tokenizer, Exception, "tokenizer cannot be sent to the server process"),
])
def test_load_errors_come_back_from_the_engine_process(factory: Any, error: type[Exception], match: str) -> None:
    async def main() -> None:
        pe = ProcessEngine(factory)
        with pytest.raises(error, match=match):
            await pe.start()
        assert pe.state == "failed" and not pe.healthy
        await pe.shutdown()
        assert pe.pid is not None and not process_alive(pe.pid)

    asyncio.run(main())


def _slow_to_load() -> Any:
    time.sleep(60)
    return scripted()()


def test_shutdown_while_loading_ends_the_engine_process_at_once() -> None:
    async def main() -> None:
        pe = ProcessEngine(_slow_to_load)
        start = asyncio.ensure_future(pe.start())
        await asyncio.sleep(1.0)
        assert pe.state == "loading" and pe.pid is not None and process_alive(pe.pid)
        t0 = time.monotonic()
        await pe.shutdown()
        assert time.monotonic() - t0 < 5  # no waiting for a load that nobody will use
        with pytest.raises(EngineDeadError, match="while the engine was loading"):
            await start
        assert pe.state == "stopped" and not process_alive(pe.pid)

    asyncio.run(main())


_ORPHAN = textwrap.dedent("""
    import asyncio, os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_server_async import scripted
    from dspark_cli.engines.embedded.engine_process import ProcessEngine

    async def main():
        pe = ProcessEngine(scripted(step_s=0.01))
        await pe.start()
        print(pe.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no exit hooks: the engine must notice alone

    if __name__ == "__main__":
        asyncio.run(main())
""")


def test_engine_process_exits_when_the_server_process_dies() -> None:
    script = _ORPHAN.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(pid), "the engine process outlived the server process"


# ------------------------------------------------------------------------------------------ settings


def test_engine_process_setting_reaches_the_server_options_and_the_banner() -> None:
    launch = prepare_embedded(build_settings({"engine_process": True}))
    launch.cleanup()
    assert launch.options.engine_process is True
    assert ("engine front", "its own process") in launch.banner
    launch = prepare_embedded(build_settings({"device": "cpu"}))
    launch.cleanup()
    assert launch.options.engine_process is False  # the default on a CPU: a thread of the server
    assert ("engine front", "a thread of the server") in launch.banner
    launch = prepare_embedded(build_settings({"device": "cpu", "engine_process": True}))
    launch.cleanup()
    assert launch.options.engine_process is True  # asked for, on any device


def test_the_default_engine_front_is_a_process_on_cuda_and_a_thread_on_a_cpu() -> None:
    from dspark_cli.serve_config import default_engine_process

    assert default_engine_process(build_settings({"device": "cpu"})) is False
    assert default_engine_process(build_settings({"device": "cpu", "engine_process": True})) is True
    assert default_engine_process(build_settings({"engine_process": False})) is False
    auto = default_engine_process(build_settings({}))
    assert auto is __import__("torch").cuda.is_available()


def test_engine_process_with_vllm_is_refused_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "serve", "--engine", "vllm", "--engine-process"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: --engine-process is an embedded-engine setting")


# ----------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """The same `dspark serve` twice: the engine on a thread, and in a process of its own."""
    thread = start_server(tmp_path_factory)
    process = start_server(tmp_path_factory, "--engine-process")
    try:
        wait_healthy(thread)
        wait_healthy(process)
        yield thread, process
    finally:
        stop_server(thread)
        stop_server(process)


GREEDY = {"temperature": 0, "ignore_eos": True}


def _stream_text(events: list[Any], chat: bool) -> str:
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    if chat:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    return "".join(e["choices"][0]["text"] for e in chunks)


def test_process_front_answers_token_for_token_like_the_thread_front(servers: tuple[Server, Server]) -> None:
    thread, process = servers
    for prompt, n in (("The quick brown", 12), ("Count: 1, 2,", 20), ("Once upon a time", 30)):
        body = {"model": "test-model", "prompt": prompt, "max_tokens": n, **GREEDY}
        outs = [srv.post("/v1/completions", body) for srv in servers]
        assert [status for status, _ in outs] == [200, 200], outs
        (_, a), (_, b) = outs
        assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"] == b["usage"]
        assert b["usage"]["completion_tokens"] == n and b["choices"][0]["finish_reason"] == "length"
        events = process.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
        assert events[-2]["usage"] == b["usage"]
        assert _stream_text(events[:-2] + ["[DONE]"], chat=False) == b["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_completion_tokens": 10, **GREEDY}
    (status_a, a), (status_b, b) = (srv.post("/v1/chat/completions", chat) for srv in (thread, process))
    assert status_a == status_b == 200
    text = b["choices"][0]["message"]["content"]
    assert text == a["choices"][0]["message"]["content"] and a["usage"] == b["usage"]
    events = process.stream("/v1/chat/completions", chat)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert _stream_text(events, chat=True) == text
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_process_front_counters_are_exact_when_the_response_ends(servers: tuple[Server, Server]) -> None:
    _, process = servers
    lab = (("engine", "0"), ("model_name", "test-model"))
    length = tuple(sorted({"model_name": "test-model", "engine": "0", "finished_reason": "length"}.items()))
    before = process.metrics()
    status, out = process.post("/v1/completions", {"prompt": "Count:", "max_tokens": 9, **GREEDY})
    assert status == 200
    after = process.metrics()  # no waiting: the step that finished the request carried its counters

    def delta(name: str, labels: tuple[tuple[str, str], ...] = lab) -> float:
        return after[(name, labels)] - before[(name, labels)]

    assert delta("vllm:generation_tokens_total") == out["usage"]["completion_tokens"] == 9
    assert delta("vllm:prompt_tokens_total") == out["usage"]["prompt_tokens"]
    assert delta("vllm:request_success_total", length) == 1
    assert delta("vllm:spec_decode_num_draft_tokens_total") == 3 * delta("vllm:spec_decode_num_drafts_total") > 0
    assert after[("vllm:num_requests_running", lab)] == 0

    # A stop string ends the request in the server; the engine counts it as vLLM's "stop", not "abort".
    stop_l, abort_l = ({"model_name": "test-model", "engine": "0", "finished_reason": r} for r in ("stop", "abort"))
    stop_key, abort_key = (tuple(sorted(d.items())) for d in (stop_l, abort_l))
    full = process.post("/v1/completions", {"prompt": "The lazy dog", "max_tokens": 40, **GREEDY})[1]
    text = full["choices"][0]["text"]
    before = process.metrics()
    status, out = process.post("/v1/completions", {"prompt": "The lazy dog", "max_tokens": 40, **GREEDY,
                                                   "stop": text[3:6]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 10
    while process.metrics()[("vllm:request_success_total", stop_key)] == before[("vllm:request_success_total", stop_key)]:
        assert time.monotonic() < deadline, "the stop-string finish was never counted"
        time.sleep(0.05)
    after = process.metrics()
    assert after[("vllm:request_success_total", stop_key)] == before[("vllm:request_success_total", stop_key)] + 1
    assert after[("vllm:request_success_total", abort_key)] == before[("vllm:request_success_total", abort_key)]


def test_ctrl_c_stops_the_server_and_its_engine_process(servers: tuple[Server, Server]) -> None:
    _, process = servers
    children = stop_server(process)  # SIGINT to the process group, as a terminal sends it; checks none is left
    log = process.log.read_text()
    assert process.proc.returncode == 0, log
    engine_pids = [int(line.rsplit("pid ", 1)[1].rstrip(")")) for line in log.splitlines()
                   if "it runs in its own process (pid" in line]
    assert len(engine_pids) == 1 and engine_pids[0] in children, (log, children)
    assert not process_alive(engine_pids[0])
    assert "engine in its own process" in log and "Traceback" not in log, log


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_process_front_on_cuda_answers_like_the_thread_front(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The engine process owns its CUDA context (spawned, never forked) and captures its graphs there: greedy
    answers on the GPU equal the thread front's, and a stop leaves no process behind."""
    thread = start_server(tmp_path_factory, "--device", "cuda")
    process = start_server(tmp_path_factory, "--device", "cuda", "--engine-process")
    try:
        wait_healthy(thread, timeout_s=600)
        wait_healthy(process, timeout_s=600)
        for prompt, n in (("The quick brown", 24), ("Count: 1, 2,", 40)):
            body = {"model": "test-model", "prompt": prompt, "max_tokens": n, **GREEDY}
            (sa, a), (sb, b) = (srv.post("/v1/completions", body) for srv in (thread, process))
            assert sa == sb == 200
            assert a["choices"][0]["text"] == b["choices"][0]["text"] and b["usage"]["completion_tokens"] == n
    finally:
        stop_server(thread)
        stop_server(process)
