"""The streaming load generator against a scripted SSE server: timing, token counting, closed-loop load."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from dspark_cli.bench.client import LoadConfig, RequestResult, aggregate, run_load
from dspark_cli.bench.datasets import Prompt


class ScriptedServer:
    """Streams a fixed chunk plan per request: each chunk is a number of tokens ("tok " x n); events may be
    split across writes. Records request bodies and the peak number of requests in flight."""

    def __init__(self, plan: list[int], continuous_usage: bool = False, split_events: bool = True,
                 status: int = 200, text: str = "tok ", crlf: bool = False, role: bool = False,
                 held_text: str = "", usage: bool = True, finish_usage: bool = False) -> None:
        self.plan = plan
        # usage on a last choice of no text with its finish_reason (llama.cpp's server), not on a chunk of its own
        self.finish_usage = finish_usage
        self.usage = usage  # False: no usage at all, as a server that ignores stream_options
        self.crlf = crlf  # SSE lines ending in CRLF, as sse-starlette writes them
        self.role = role  # chat: an opening role event, usage 0 tokens, as vLLM sends it
        self.held_text = held_text  # after the last chunk: text with no new token (a stop string's look-ahead)
        self.text = text
        self.continuous_usage = continuous_usage
        self.split_events = split_events
        self.status = status
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "nope"}}, status=self.status)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        chat = request.path.endswith("chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0

        async def write(data: bytes) -> None:
            await resp.write(data.replace(b"\n", b"\r\n") if self.crlf else data)

        try:
            await write(b": ping\n\n")
            if self.role and chat:
                await write(b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"role": "assistant",
                            "content": ""}}], "usage": {"prompt_tokens": 7, "completion_tokens": 0}}) + b"\n\n")
            for n in self.plan:
                await asyncio.sleep(0.01)
                sent += n
                text = self.text * n
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                msg: dict[str, Any] = {"choices": [choice]}
                if self.continuous_usage:
                    msg["usage"] = {"prompt_tokens": 7, "completion_tokens": sent}
                data = b"data: " + orjson.dumps(msg) + b"\n\n"
                if self.split_events:
                    await write(data[:9])
                    await asyncio.sleep(0.001)
                    await write(data[9:])
                else:
                    await write(data)
            if self.held_text:
                await asyncio.sleep(0.01)
                choice = ({"index": 0, "delta": {"content": self.held_text}} if chat
                          else {"index": 0, "text": self.held_text})
                await write(b"data: " + orjson.dumps({"choices": [choice], "usage": {
                    "prompt_tokens": 7, "completion_tokens": sent}}) + b"\n\n")
            usage = {"prompt_tokens": 7, "completion_tokens": sent, "total_tokens": sent + 7}
            if self.usage and self.finish_usage:
                await asyncio.sleep(0.01)
                choice = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                          else {"index": 0, "text": "", "finish_reason": "length"})
                await write(b"data: " + orjson.dumps({"choices": [choice], "usage": usage}) + b"\n\n")
            elif self.usage:
                await write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
            await write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m1"}]})


async def _serve(server: ScriptedServer) -> tuple[web.AppRunner, str]:
    return await _serve_routes(server.handle, server.models)


async def _serve_routes(handle: Any, models: Any = None) -> tuple[web.AppRunner, str]:
    """A local app answering both completion endpoints with ``handle`` (and ``/v1/models`` with ``models``)."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    if models is not None:
        app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _run(server: ScriptedServer, prompts: list[Prompt], **cfg: Any) -> tuple[list[RequestResult], float, str]:
    async def go() -> tuple[list[RequestResult], float, str]:
        runner, url = await _serve(server)
        try:
            return await run_load(prompts, LoadConfig(base_url=url, **cfg))
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_multi_token_chunks_count_tokens_from_usage() -> None:
    server = ScriptedServer([1, 3, 2, 4])
    results, wall, model = _run(server, [Prompt(text="hi")], max_tokens=10)
    (r,) = results
    assert model == "m1" and r.success, r.error
    assert r.output_tokens == 10  # from usage, not the 4 chunks
    assert len(r.itl) == 3 and r.ttft is not None and r.ttft > 0
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert r.prompt_tokens == 7
    # Without per-chunk usage the per-token ITL spreads the 9 decode tokens evenly over the gaps, 3 each.
    per_tok = r.per_token_itl()
    assert len(per_tok) == 9 and sum(per_tok) == pytest.approx(sum(r.itl))
    assert per_tok[:3] == pytest.approx([r.itl[0] / 3] * 3)
    assert r.text == "tok " * 10


def test_per_chunk_usage_splits_each_gap_over_its_tokens() -> None:
    server = ScriptedServer([1, 3, 2], continuous_usage=True)
    (r,), _, _ = _run(server, [Prompt(text="hi")], max_tokens=6)
    assert r.chunk_tokens == [1, 3, 2]
    per_tok = r.per_token_itl()
    assert len(per_tok) == 5
    assert per_tok[:3] == pytest.approx([r.itl[0] / 3] * 3)
    assert per_tok[3:] == pytest.approx([r.itl[1] / 2] * 2)


def test_the_spread_per_token_itl_weighs_every_token_alike() -> None:
    # one 40 ms gap carrying 4 tokens and four 1 ms gaps of one: per token, (40 + 4) / 8 = 5.5 ms on average
    a = RequestResult(0, success=True, ttft=0.01, itl=[0.040], output_tokens=5)
    b = RequestResult(1, success=True, ttft=0.01, itl=[0.001] * 4, output_tokens=5)
    pooled = a.per_token_itl() + b.per_token_itl()
    assert len(pooled) == 8 and sum(pooled) / 8 == pytest.approx(0.0055)
    # gaps that do not divide the tokens evenly: whole tokens per gap, every token counted once
    c = RequestResult(2, success=True, ttft=0.01, itl=[0.003, 0.006, 0.009], output_tokens=8)
    assert len(c.per_token_itl()) == 7 and sum(c.per_token_itl()) == pytest.approx(0.018)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_role_events_held_text_and_crlf_lines_are_not_steps(endpoint: str) -> None:
    """vLLM's chat stream opens with a role event of 0 tokens; text released with no new token belongs to the
    step before; sse-starlette ends lines in CRLF. None of them is a step of its own."""
    server = ScriptedServer([1, 3, 2], continuous_usage=True, role=True, held_text="!", crlf=True)
    (r,), _, _ = _run(server, [Prompt(text="hi")], max_tokens=6, endpoint=endpoint)
    assert r.success, r.error
    assert r.chunk_tokens == [1, 3, 2] and len(r.itl) == 2 and r.output_tokens == 6
    assert r.text == "tok " * 6 + "!"
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))


def test_a_stream_without_usage_counts_chunks_and_the_cell_says_so(tmp_path: Any) -> None:
    from dspark_cli.bench.matrix import measurement_notes

    (r,), wall, _ = _run(ScriptedServer([1, 3, 2], usage=False), [Prompt(text="hi")], max_tokens=6)
    assert r.success and r.output_tokens == 3 and not r.usage_counted
    metrics = aggregate([r], wall)
    assert metrics["chunk_counted_requests"] == 1
    (note,) = measurement_notes({"metrics": metrics})
    assert note.startswith("1 of 1 requests streamed no usage, so their tokens were counted as stream chunks")
    (r,), wall, _ = _run(ScriptedServer([1, 3, 2]), [Prompt(text="hi")], max_tokens=6)
    assert r.usage_counted and aggregate([r], wall)["chunk_counted_requests"] == 0


def test_steps_that_spell_no_text_still_count_through_per_chunk_usage() -> None:
    # A random model's ids that a small tokenizer cannot spell: every chunk is empty text.
    server = ScriptedServer([1, 3, 2], continuous_usage=True, text="")
    (r,), _, _ = _run(server, [Prompt(text="hi")], max_tokens=6)
    assert r.success, r.error
    assert r.output_tokens == 6 and r.chunk_tokens == [1, 3, 2] and len(r.itl) == 2
    assert server.bodies[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    # without per-chunk usage an empty stream carries nothing measurable: a failure, not a fake number
    (r,), _, _ = _run(ScriptedServer([1, 3], text=""), [Prompt(text="hi")], max_tokens=4)
    assert not r.success and "no output tokens" in r.error


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_usage_on_the_finishing_choice_is_not_a_step(endpoint: str) -> None:
    """A server that streams no usage per chunk but puts the total on its last choice (empty, with its
    finish_reason) gave every request one more ~0 ms gap: mean ITL 25% low on 4-token outputs."""
    (r,), _, _ = _run(ScriptedServer([1, 1, 1, 1], finish_usage=True), [Prompt(text="hi")], max_tokens=4,
                      endpoint=endpoint)
    assert r.success, r.error
    assert r.output_tokens == 4 and r.usage_counted and len(r.itl) == 3 and min(r.itl) > 0.005
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))


@pytest.mark.parametrize("event", [b"[]", b'{"choices": 3}', b'{"choices": [], "usage": [1]}'])
def test_a_malformed_stream_event_fails_its_request_not_the_cell(event: bytes) -> None:
    """Such an event raised AttributeError or TypeError in the load's worker, which stopped the whole cell."""
    from dspark_cli.bench.client import stream_request

    async def handle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + event + b"\n\n")
        return resp

    async def go() -> RequestResult:
        runner, url = await _serve_routes(handle)
        try:
            async with aiohttp.ClientSession() as session:
                return await stream_request(session, f"{url}/v1/completions", {}, 0)
        finally:
            await runner.cleanup()

    r = asyncio.run(go())
    assert not r.success and r.error is not None and r.error.startswith("malformed stream event")


def test_request_payload_carries_equal_work_fields() -> None:
    server = ScriptedServer([2])
    _run(server, [Prompt(text="a"), Prompt(messages=({"role": "user", "content": "b"},))],
         max_tokens=5, temperature=1.0, seed=10, concurrency=1)
    first, second = server.bodies
    assert first["messages"] == [{"role": "user", "content": "a"}]
    assert second["messages"] == [{"role": "user", "content": "b"}]
    for i, body in enumerate(server.bodies):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 5 and body["temperature"] == 1.0
        assert body["seed"] == 10 + i and body["model"] == "m1"


def test_completions_endpoint_sends_prompt_text() -> None:
    server = ScriptedServer([1, 1], split_events=False)
    (r,), _, _ = _run(server, [Prompt(messages=({"role": "user", "content": "q"},))], endpoint="completions")
    assert r.success and r.output_tokens == 2
    assert server.bodies[0]["prompt"] == "q" and "messages" not in server.bodies[0]


def test_closed_loop_keeps_exactly_concurrency_in_flight() -> None:
    server = ScriptedServer([1, 1, 1])
    results, _, _ = _run(server, [Prompt(text=str(i)) for i in range(12)], concurrency=3)
    assert len(results) == 12 and all(r.success for r in results)
    assert server.peak == 3
    assert [r.index for r in results] == list(range(12))


def test_a_cell_sent_in_parts_sends_the_requests_it_would_send_whole() -> None:
    """``first_index``: the later part of a cell keeps its requests' seeds and indices."""
    server = ScriptedServer([1])

    async def go() -> list[RequestResult]:
        runner, url = await _serve(server)
        try:
            results, _, _ = await run_load([Prompt(text="a"), Prompt(text="b")],
                                           LoadConfig(base_url=url, seed=10), first_index=4)
            return results
        finally:
            await runner.cleanup()

    results = asyncio.run(go())
    assert [r.index for r in results] == [4, 5]
    assert [b["seed"] for b in server.bodies] == [14, 15]


def test_http_errors_are_recorded_as_failures() -> None:
    server = ScriptedServer([1], status=400)
    results, wall, _ = _run(server, [Prompt(text="x")] * 2, concurrency=2)
    assert not any(r.success for r in results)
    assert results[0].error.startswith("HTTP 400")
    m = aggregate(results, wall)
    assert m["failed"] == 2 and m["completed"] == 0 and m["output_tok_s"] == 0.0
    assert m["errors"] and m["per_user_tok_s"] is None


def test_aggregate_math() -> None:
    a = RequestResult(0, True, ttft=0.1, latency=1.1, itl=[0.5, 0.5], output_tokens=11)
    b = RequestResult(1, True, ttft=0.3, latency=2.3, itl=[1.0, 1.0], output_tokens=21)
    m = aggregate([a, b], wall_s=4.0)
    assert m["output_tok_s"] == pytest.approx(32 / 4)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["itl_ms"]["mean"] == pytest.approx(750.0)
    assert m["tpot_ms"]["median"] == pytest.approx(100.0)  # both requests: 1.0 s / 10 and 2.0 s / 20
    assert m["per_user_tok_s"] == pytest.approx(10.0)
    assert m["tokens_per_chunk"] == pytest.approx(32 / 6)


def test_a_base_url_may_end_in_v1_as_the_openai_clients_write_it() -> None:
    from dspark_cli.bench.client import server_root
    from dspark_cli.errors import DsparkError

    for url in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1",
                "http://127.0.0.1:8000/v1/", " http://127.0.0.1:8000/v1 "):
        assert server_root(url) == "http://127.0.0.1:8000"
    assert server_root("https://host/prefix/v1") == "https://host/prefix"
    with pytest.raises(DsparkError, match="must start with http"):
        server_root("127.0.0.1:8000")
