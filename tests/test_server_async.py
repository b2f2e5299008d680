"""The async fronts and the HTTP app around a scripted engine, for behaviour a real model cannot be made to
show on demand: engine exceptions, load failures, refused requests, idleness. Tests taking the ``front``
fixture run against both fronts: the engine on a thread (AsyncEngine) and in a process of its own
(ProcessEngine; the scripted engine is built there from a picklable factory). The end-to-end tests with the
real engine live in test_server_e2e.py and test_engine_process.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from dspark_cli.engines.embedded.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineFront,
    RequestRejectedError,
    error_type,
)
from dspark_cli.engines.embedded.server import ServerContext, create_app, engine_front


@dataclass
class Out:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


@dataclass
class Stats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0


class ScriptedEngine:
    """Emits token (prompt[-1] + i) % 50 + 10 per step for each request; records which threads called it."""

    def __init__(self, fail_at_step: int | None = None, max_num_seqs: int = 2, tokenizer: Any = None,
                 step_s: float = 0.0) -> None:
        self.reqs: dict[str, tuple[list[int], Any, list[int]]] = {}
        self.order: list[str] = []
        self.stats = Stats()
        self.fail_at_step = fail_at_step
        self.max_num_seqs = max_num_seqs
        self.threads: set[int] = set()
        self.aborted: list[str] = []
        self.idle_checks = 0
        self.tokenizer = tokenizer
        self.step_s = step_s

        class Cfg:
            max_model_len = 64

        self.config = Cfg()

    def _t(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, rid: str, prompt: list[int], params: Any) -> None:
        self._t()
        if not prompt:
            raise ValueError("empty prompt")
        self.reqs[rid] = (prompt, params, [])
        self.order.append(rid)
        self.stats.prompt_tokens += len(prompt)

    def abort_request(self, rid: str) -> None:
        self._t()
        if rid in self.reqs:
            del self.reqs[rid]
            self.order.remove(rid)
            self.aborted.append(rid)
            self.stats.requests_finished["abort"] = self.stats.requests_finished.get("abort", 0) + 1

    def has_unfinished_requests(self) -> bool:
        self._t()
        self.idle_checks += 1
        return bool(self.reqs)

    def step(self) -> list[Out]:
        self._t()
        self.stats.num_steps += 1
        if self.fail_at_step is not None and self.stats.num_steps >= self.fail_at_step:
            raise RuntimeError("simulated device fault")
        if self.step_s:
            time.sleep(self.step_s)
        running = self.order[: self.max_num_seqs]  # the rest wait, like a scheduler beyond max_num_seqs
        self.stats.num_running, self.stats.num_waiting = len(running), len(self.order) - len(running)
        outs = []
        for rid in running:
            prompt, params, gen = self.reqs[rid]
            tok = (prompt[-1] + len(gen)) % 50 + 10
            gen.append(tok)
            self.stats.generation_tokens += 1
            done = len(gen) >= params.max_tokens
            if done:
                del self.reqs[rid]
                self.order.remove(rid)
                self.stats.requests_finished["length"] = self.stats.requests_finished.get("length", 0) + 1
            outs.append(Out(rid, [tok], done, "length" if done else None))
        if not self.reqs:
            self.stats.num_running = self.stats.num_waiting = 0
        return outs


@dataclass
class P:
    max_tokens: int = 3


@pytest.fixture(params=["thread", "process"])
def front(request: pytest.FixtureRequest) -> str:
    return request.param


def make_front(front: str, factory: Callable[[], Any]) -> EngineFront:
    return engine_front(factory, engine_process=front == "process")


def scripted(**kwargs: Any) -> Callable[[], ScriptedEngine]:
    """A factory that pickles, so the engine process can build the scripted engine itself."""
    return functools.partial(ScriptedEngine, **kwargs)


def assert_engine_process_gone(ae: EngineFront) -> None:
    pid = getattr(ae, "pid", None)
    if pid is not None:
        assert not os.path.exists(f"/proc/{pid}"), f"engine process {pid} is still there"


async def _collect(ae: EngineFront, rid: str, prompt: list[int], n: int) -> list[int]:
    toks: list[int] = []
    async for out in ae.generate(rid, prompt, P(n)):
        toks.extend(out.new_token_ids)
    return toks


def test_generate_streams_and_every_engine_call_is_on_one_background_thread(front: str) -> None:
    async def main() -> EngineFront:
        ae = make_front(front, scripted(max_num_seqs=2))
        await ae.start()
        assert ae.healthy
        results = await asyncio.gather(*(_collect(ae, f"r{i}", [i], 4) for i in range(7)))
        for i, toks in enumerate(results):
            assert toks == [(i + j) % 50 + 10 for j in range(4)]
        assert ae.num_pending == 0
        assert ae.metrics().requests_finished == {"length": 7}
        await ae.shutdown()
        assert ae.state == "stopped"
        assert_engine_process_gone(ae)
        return ae

    ae = asyncio.run(main())
    if isinstance(ae, AsyncEngine):
        eng = ae.engine
        assert len(eng.threads) == 1 and threading.get_ident() not in eng.threads


def test_idle_engine_thread_blocks_instead_of_spinning() -> None:
    eng = ScriptedEngine()

    async def main() -> None:
        ae = AsyncEngine(lambda: eng)
        await ae.start()
        await _collect(ae, "a", [1], 2)
        before = eng.idle_checks
        await asyncio.sleep(0.3)
        assert eng.idle_checks - before <= 2
        await ae.shutdown()

    asyncio.run(main())


def test_cancelled_consumer_aborts_its_request(front: str) -> None:
    async def main() -> None:
        ae = make_front(front, scripted(step_s=0.01))
        await ae.start()
        task = asyncio.ensure_future(_collect(ae, "long", [1], 10_000))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if ae.metrics().requests_finished.get("abort"):
                break
            await asyncio.sleep(0.01)
        assert ae.metrics().requests_finished == {"abort": 1}  # the engine dropped it (counted there)
        if isinstance(ae, AsyncEngine):
            assert ae.engine.aborted == ["long"] and not ae.engine.reqs
        assert ae.num_pending == 0
        # the engine keeps serving others
        assert await _collect(ae, "next", [2], 2) == [12, 13]
        await ae.shutdown()

    asyncio.run(main())


def test_engine_exception_fails_pending_requests_and_marks_unhealthy(front: str) -> None:
    async def main() -> None:
        ae = make_front(front, scripted(fail_at_step=3, step_s=0.005))
        await ae.start()
        results = await asyncio.wait_for(
            asyncio.gather(*(_collect(ae, f"r{i}", [i], 100) for i in range(3)), return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "simulated device fault" in str(results[0])
        assert not ae.healthy and ae.state == "failed"
        assert ae.error is not None and error_type(ae.error) == "RuntimeError"
        with pytest.raises(EngineDeadError):
            await _collect(ae, "late", [1], 1)
        await ae.shutdown()
        assert ae.state == "failed"
        assert_engine_process_gone(ae)

    asyncio.run(main())


def test_a_finished_request_whose_consumer_has_not_read_it_is_not_also_counted_as_an_error(front: str) -> None:
    # the finished output is delivered; its consumer holds it (say, awaiting the socket write) when the engine
    # fails: that request ended "length", and only the one still running ends "error"
    async def main() -> None:
        ae = make_front(front, scripted(fail_at_step=4, step_s=0.01))
        await ae.start()
        done = ae.generate("done", [1], P(1))
        first = await done.__anext__()  # the generator now sits at its yield, as a consumer mid-write does
        assert first.finished and ae.num_pending == 0
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(ae, "long", [2], 100), 10)
        assert ae.metrics().requests_finished == {"length": 1, "error": 1}
        await done.aclose()
        await ae.shutdown()

    asyncio.run(main())


def _boom() -> Any:
    raise FileNotFoundError("no such checkpoint")


def test_load_failure_propagates_from_start(front: str) -> None:
    async def main() -> None:
        ae = make_front(front, _boom)
        # The process front relays the error as its type name and message (the server reports either alike).
        with pytest.raises(Exception, match="no such checkpoint") as info:
            await ae.start()
        assert error_type(info.value) == "FileNotFoundError"
        assert ae.state == "failed" and not ae.healthy
        await ae.shutdown()
        assert_engine_process_gone(ae)

    asyncio.run(main())


def test_refused_request_fails_alone(front: str) -> None:
    async def main() -> None:
        ae = make_front(front, scripted())
        await ae.start()
        bad = asyncio.ensure_future(_collect(ae, "bad", [], 2))
        good = asyncio.ensure_future(_collect(ae, "good", [3], 2))
        with pytest.raises(RequestRejectedError, match="empty prompt"):
            await bad
        assert await good == [13, 14]
        assert ae.healthy
        await ae.shutdown()

    asyncio.run(main())


def test_shutdown_fails_requests_still_running(front: str) -> None:
    async def main() -> None:
        ae = make_front(front, scripted(step_s=0.01))
        await ae.start()
        task = asyncio.ensure_future(_collect(ae, "long", [1], 10_000))
        await asyncio.sleep(0.05)
        await ae.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await asyncio.wait_for(task, 5)
        assert ae.state == "stopped"
        assert_engine_process_gone(ae)

    asyncio.run(main())


# ------------------------------------------------------------------------------------- HTTP layer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, "<eos>": 27}
    vocab |= {f"t{i}": i for i in range(28, 64)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


async def _app_client(front: str, factory: Callable[[], Any]) -> tuple[EngineFront, TestClient]:
    ae = make_front(front, factory)
    await ae.start()
    client = TestClient(TestServer(create_app(ServerContext(ae, "fake", ("fake-path",), 0))))
    await client.start_server()
    return ae, client


def test_engine_fault_becomes_500_and_unhealthy(tokenizer, front: str) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        ae, client = await _app_client(front, scripted(fail_at_step=2, tokenizer=tokenizer))
        try:
            assert (await client.get("/health")).status == 200
            r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
            assert r.status == 500
            body = await r.json()
            assert "simulated device fault" in body["error"]["message"]
            h = await client.get("/health")
            health = await h.json()
            assert h.status == 503 and health["status"] == "failed"
            assert health["error"] == "RuntimeError: simulated device fault"
            r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
            assert r.status == 503
        finally:
            await client.close()
            await ae.shutdown()

    asyncio.run(main())


def test_engine_fault_mid_stream_sends_an_error_event(tokenizer, front: str) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        ae, client = await _app_client(front, scripted(fail_at_step=4, tokenizer=tokenizer))
        try:
            r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 20, "stream": True})
            assert r.status == 200
            text = await r.text()
            assert '"error"' in text and text.rstrip().endswith("data: [DONE]")
        finally:
            await client.close()
            await ae.shutdown()

    asyncio.run(main())


def test_model_alias_and_error_shapes(tokenizer, front: str) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        ae, client = await _app_client(front, scripted(tokenizer=tokenizer))
        try:
            r = await client.post("/v1/completions", json={"model": "fake-path", "prompt": "ab", "max_tokens": 2})
            assert r.status == 200 and (await r.json())["model"] == "fake-path"
            r = await client.get("/v1/nope")
            assert r.status == 404 and "error" in await r.json()
            r = await client.post("/v1/completions", data=b"{oops")
            body = await r.json()
            assert r.status == 400 and body["error"]["type"] == "invalid_request_error"
            assert "not valid JSON" in body["error"]["message"]
            r = await client.post("/v1/completions", json={"prompt": "a" * 70, "max_tokens": 2})
            assert r.status == 400 and "maximum context length is 64" in (await r.json())["error"]["message"]
        finally:
            await client.close()
            await ae.shutdown()

    asyncio.run(main())


def test_a_completion_without_max_tokens_stops_at_vllms_16(tokenizer, front: str) -> None:  # type: ignore[no-untyped-def]
    # It ran to the end of the context (2,000+ tokens at the default length), 100x what vLLM returns.
    async def main() -> None:
        ae, client = await _app_client(front, scripted(tokenizer=tokenizer))
        try:
            for extra in ({}, {"max_tokens": None}):
                r = await client.post("/v1/completions", json={"prompt": "abc", "ignore_eos": True, **extra})
                body = await r.json()
                assert r.status == 200 and body["usage"]["completion_tokens"] == 16, body
            # capped by what the context leaves, as vLLM caps it
            r = await client.post("/v1/completions", json={"prompt": "a" * 60, "ignore_eos": True})
            body = await r.json()
            room = 64 - body["usage"]["prompt_tokens"]
            assert r.status == 200 and 0 < room < 16 and body["usage"]["completion_tokens"] == room, body
        finally:
            await client.close()
            await ae.shutdown()

    asyncio.run(main())


def test_a_large_chunked_body_is_parsed_off_the_event_loop(tokenizer, front: str,  # type: ignore[no-untyped-def]
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # A chunked upload names no Content-Length: its size used to read as 0, so it was parsed on the loop.
    from dspark_cli.engines.embedded import server

    on_thread: list[str] = []
    to_thread = asyncio.to_thread

    async def spy(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        on_thread.append(fn.__name__)
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(server.asyncio, "to_thread", spy)
    body = b'{"prompt": "abc", "max_tokens": 2' + b" " * (server.PARSE_ON_LOOP_BYTES + 1) + b"}"

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    async def main() -> None:
        ae, client = await _app_client(front, scripted(tokenizer=tokenizer))
        try:
            r = await client.post("/v1/completions", data=b'{"prompt": "abc", "max_tokens": 2}')
            assert r.status == 200 and on_thread == []
            r = await client.post("/v1/completions", data=chunks())
            assert r.status == 200 and r.request_info.headers.get("Transfer-Encoding") == "chunked"
            assert on_thread == ["parse_completion"]
        finally:
            await client.close()
            await ae.shutdown()

    asyncio.run(main())


def test_a_consumer_that_falls_behind_gets_the_waiting_steps_merged(front: str) -> None:
    """While a consumer is busy the engine keeps stepping; what waits in its queue arrives as one output
    carrying every waiting token, in order, the last one's finish state included. A consumer that keeps
    up gets one output per step."""
    async def main() -> None:
        ae = make_front(front, scripted(max_num_seqs=1, step_s=0.002))
        await ae.start()
        prompt, n = [7], 40
        expected = [(7 + j) % 50 + 10 for j in range(n)]
        sizes: list[int] = []
        toks: list[int] = []
        last = None
        async for out in ae.generate("slow", prompt, P(n)):
            sizes.append(len(out.new_token_ids))
            toks.extend(out.new_token_ids)
            last = out
            await asyncio.sleep(0.02)  # ten engine steps per item
        assert toks == expected and last is not None and last.finished and last.finish_reason == "length"
        assert max(sizes) > 1 and len(sizes) < n
        assert await _collect(ae, "quick", prompt, 5) == expected[:5]
        await ae.shutdown()

    asyncio.run(main())


def test_an_error_behind_waiting_tokens_comes_after_them(front: str) -> None:
    async def main() -> None:
        ae = make_front(front, scripted(max_num_seqs=1, fail_at_step=4))
        await ae.start()
        toks: list[int] = []
        with pytest.raises(EngineDeadError):
            async for out in ae.generate("r", [3], P(100)):
                await asyncio.sleep(0.05)  # the engine steps on and then fails meanwhile
                toks.extend(out.new_token_ids)
        assert toks == [(3 + j) % 50 + 10 for j in range(3)]  # the three steps before the failure
        await ae.shutdown()

    asyncio.run(main())


def test_a_server_stopped_while_its_engine_thread_loads_does_not_wait_for_the_load() -> None:
    """Ctrl-C during a long load (a start-up profile): serve_async returns with the load still running on its
    thread, and says so, so the CLI can end the process instead of waiting minutes for it."""
    import threading

    from dspark_cli.engines.embedded.server import ServerOptions, serve_async

    started, release = threading.Event(), threading.Event()

    def slow_factory() -> Any:
        started.set()
        release.wait(60)
        return scripted()()

    async def main() -> bool:
        stop = asyncio.Event()
        serving = asyncio.ensure_future(serve_async(slow_factory, ServerOptions("127.0.0.1", 0, "m"),
                                                    stop_event=stop))
        while not started.is_set():
            await asyncio.sleep(0.01)
        stop.set()
        return await serving

    try:
        assert asyncio.run(main()) is True
        assert not release.is_set()  # returned while the factory was still inside the load
    finally:
        release.set()


@contextlib.asynccontextmanager
async def _serving(front: str, factory: Callable[[], Any]) -> AsyncIterator[TestClient]:
    """An app over a started front, closed and shut down however the test ends."""
    ae, client = await _app_client(front, factory)
    try:
        yield client
    finally:
        await client.close()
        await ae.shutdown()


def _finished(text: str, reason: str) -> float:
    return next(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in ln)


def test_a_stop_string_in_the_output_that_ends_the_request_counts_as_stop(tokenizer, front: str) -> None:  # type: ignore[no-untyped-def]
    """The scripted engine writes "mnopq" for "abc" and ends it at max_tokens 5 ("length"); the stop string "q"
    matches in that same last output, so the client is told "stop", and so must /metrics be (as vLLM counts).
    The server's abort for the stop found the request finished and used to count nothing."""
    async def main() -> None:
        async with _serving(front, scripted(tokenizer=tokenizer)) as client:
            before = await (await client.get("/metrics")).text()
            for stream in (False, True):
                body = {"prompt": "abc", "max_tokens": 5, "stop": ["q"], "stream": stream}
                r = await client.post("/v1/completions", json=body)
                assert r.status == 200
                text = await r.text()
                assert '"finish_reason":"stop"' in text.replace(" ", ""), text
            await asyncio.sleep(0.2)  # the aborts reach the engine's side after the responses
            after = await (await client.get("/metrics")).text()
            assert _finished(after, "stop") - _finished(before, "stop") == 2
            assert _finished(after, "length") == _finished(before, "length")

    asyncio.run(main())


def test_a_choice_that_fails_unexpectedly_ends_its_stream_with_an_error(
        tokenizer, front: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """With several choices each is pumped by a task of its own: an exception other than the engine's own used
    to end that task without a word, and the stream stayed open forever after the other choice finished."""
    from dspark_cli.engines.embedded import server

    original = server._Generation.deltas

    async def deltas(self):  # type: ignore[no-untyped-def]
        async for delta in original(self):
            yield delta
            if self.request_id.endswith("-1"):  # after its first output: the stream's headers are out by then
                raise ValueError("injected")

    async def failing_at_once(self):  # type: ignore[no-untyped-def]
        if self.request_id.endswith("-1"):
            raise ValueError("injected")
        async for delta in original(self):
            yield delta

    monkeypatch.setattr(server._Generation, "deltas", deltas)

    async def main() -> None:
        async with _serving(front, scripted(tokenizer=tokenizer)) as client:
            body = {"prompt": "abc", "max_tokens": 4, "n": 2, "stream": True}
            r = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
            text = await asyncio.wait_for(r.text(), 10)
            assert r.status == 200 and text.startswith("data: {")
            assert "internal error: ValueError: injected" in text and text.rstrip().endswith("data: [DONE]")
            # before any output the same failure is a 500 with the message, as with one choice
            monkeypatch.setattr(server._Generation, "deltas", failing_at_once)
            r = await client.post("/v1/completions", json=body)
            assert r.status == 500 and "ValueError: injected" in (await r.json())["error"]["message"]

    asyncio.run(main())


def test_choices_streamed_to_a_slow_client_keep_their_own_state(
        tokenizer, front: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """With several choices each is pumped by a task of its own, which runs ahead while the writer waits on a
    slow client. Chunks were written from the choice's live state: every delta still queued when it finished
    went out with its finish_reason, and the ids added while a write waited were never sent."""
    original = web.StreamResponse.write

    async def slow_write(self, data):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.02)  # a congested socket
        return await original(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", slow_write)

    async def main() -> None:
        async with _serving(front, scripted(tokenizer=tokenizer)) as client:
            body = {"prompt": "abc", "max_tokens": 12, "n": 2, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            r = await asyncio.wait_for(client.post("/v1/completions", json=body), 30)
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            events = [orjson.loads(line[6:]) for line in (await asyncio.wait_for(r.text(), 30)).splitlines()
                      if line.startswith("data: {")]
        for i in (0, 1):
            mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == i]
            finishes = [e["choices"][0]["finish_reason"] for e in mine]
            assert finishes[-1] == "length" and finishes.count("length") == 1, finishes
            assert sum(len(e["choices"][0]["token_ids"]) for e in mine) == 12
            counts = [e["usage"]["completion_tokens"] for e in mine]
            assert counts == sorted(counts) and counts[-1] == 12

    asyncio.run(main())


def test_a_request_cut_off_by_shutdown_is_503_which_clients_retry(tokenizer, front: str) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        ae, client = await _app_client(front, scripted(step_s=0.01, tokenizer=tokenizer))
        try:
            task = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 60}))
            await asyncio.sleep(0.1)
            await ae.shutdown()
            r = await asyncio.wait_for(task, 10)
            assert r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
        finally:
            await client.close()
            await ae.shutdown()

    asyncio.run(main())
