"""vLLM's per-request histograms on ``/metrics``, measured by the server around a scripted engine on both
fronts (a thread, and ``--engine-process``): what they count, which requests they leave out, and that a
consumer that falls behind does not merge inter-token latencies. The real-engine check is in
test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_server_async import P, make_front, scripted
from test_server_async import front as front  # noqa: F401 -- a fixture, used by name
from test_server_async import tokenizer as tokenizer  # noqa: F401 -- a fixture, used by name

from dspark_cli.engines.embedded.async_engine import EngineFront
from dspark_cli.engines.embedded.metrics import RequestMetrics, parse_metrics
from dspark_cli.engines.embedded.server import ServerContext, create_app

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LABELS = (("engine", "0"), ("model_name", "fake"))
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens")


def count(m: Metrics, name: str) -> float:
    return m[(name + "_count", LABELS)]


def total(m: Metrics, name: str) -> float:
    return m[(name + "_sum", LABELS)]


async def _app(front: str, factory: Callable[[], Any]) -> tuple[EngineFront, ServerContext, TestClient]:
    ae = make_front(front, factory)
    await ae.start()
    ctx = ServerContext(ae, "fake")
    client = TestClient(TestServer(create_app(ctx)))
    await client.start_server()
    return ae, ctx, client


async def _metrics(client: Any) -> Metrics:
    r = await client.get("/metrics")
    assert r.status == 200
    return parse_metrics(await r.text())


async def _stream_usage(client: Any, body: dict[str, Any]) -> dict[str, int]:
    r = await client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status == 200
    events = [line for line in (await r.text()).split("\n\n") if line.startswith("data: {")]
    return json.loads(events[-1][len("data: "):])["usage"]


def test_finished_requests_are_observed_once_each_streaming_or_not(tokenizer, front: str) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        ae, ctx, client = await _app(front, scripted(tokenizer=tokenizer, step_s=0.002))
        try:
            m = await _metrics(client)
            # Sized at the first scrape of a loaded engine: 1-2-5 buckets up to max_model_len (64).
            les = [dict(k[1])["le"] for k in m if k[0] == "vllm:request_generation_tokens_bucket"]
            assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]
            assert all(count(m, name) == 0 for name in HISTOGRAMS)
            usages = []
            for prompt, n in (("abc", 5), ("ab", 1)):
                r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n})
                assert r.status == 200
                usages.append((await r.json())["usage"])
            usages.append(await _stream_usage(client, {"prompt": "abcd", "max_tokens": 4}))
            m = await _metrics(client)
            per_request = [name for name in HISTOGRAMS if name != "vllm:inter_token_latency_seconds"]
            assert all(count(m, name) == 3 for name in per_request), {n: count(m, n) for n in HISTOGRAMS}
            assert total(m, "vllm:request_generation_tokens") == sum(u["completion_tokens"] for u in usages) == 10
            assert total(m, "vllm:request_prompt_tokens") == sum(u["prompt_tokens"] for u in usages) == 9
            # The scripted engine emits one token per step: one inter-token latency per later step.
            assert count(m, "vllm:inter_token_latency_seconds") == 4 + 0 + 3
            assert 0 < total(m, "vllm:time_to_first_token_seconds") <= total(m, "vllm:e2e_request_latency_seconds")
            assert total(m, "vllm:inter_token_latency_seconds") <= total(m, "vllm:e2e_request_latency_seconds")
            for name in HISTOGRAMS:
                buckets = [v for k, v in m.items() if k[0] == name + "_bucket"]
                assert buckets == sorted(buckets) and buckets[-1] == count(m, name)
            assert ctx.requests.num_live == 0
        finally:
            await client.close()
            await ae.shutdown()

    asyncio.run(main())


def test_abandoned_and_failed_requests_get_no_finished_request_observations(tokenizer, front: str) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        ae, ctx, client = await _app(front, scripted(tokenizer=tokenizer, step_s=0.005))
        try:
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "abc", "max_tokens": 50, "stream": True}
                resp = await session.post(str(client.make_url("/v1/completions")), json=body)
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        break
                resp.close()  # the client goes away after its first token
            for _ in range(200):
                if ctx.requests.num_live == 0:
                    break
                await asyncio.sleep(0.01)
            assert ctx.requests.num_live == 0
            m = await _metrics(client)
            # Its first token was observed as it happened; as in vLLM, an abandoned request is no finished one.
            assert count(m, "vllm:time_to_first_token_seconds") == 1
            assert count(m, "vllm:e2e_request_latency_seconds") == 0
            assert count(m, "vllm:request_generation_tokens") == 0
        finally:
            await client.close()
            await ae.shutdown()

        # An engine failure mid-request: a 500, and again no finished-request observation.
        ae, ctx, client = await _app(front, scripted(tokenizer=tokenizer, fail_at_step=3))
        try:
            r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 50})
            assert r.status == 500
            assert ctx.requests.num_live == 0
            assert ctx.requests.time_to_first_token.count == 1 and ctx.requests.e2e_latency.count == 0
        finally:
            await client.close()
            await ae.shutdown()

    asyncio.run(main())


def test_a_consumer_that_falls_behind_still_gets_one_inter_token_latency_per_step(front: str) -> None:
    """The front merges the steps a slow consumer left waiting into one output; the histograms see every
    step as it reached the loop, as vLLM's output processor does."""
    async def main() -> None:
        ae = make_front(front, scripted(max_num_seqs=1, step_s=0.002))
        req = RequestMetrics()
        ae.on_outputs = req.on_outputs
        await ae.start()
        n, items = 30, 0
        async with req.track("slow", 1, 64):
            async for out in ae.generate("slow", [7], P(n)):
                items += 1
                await asyncio.sleep(0.02)  # ten engine steps per item
                if out.finished:
                    req.finish("slow", n)
        assert items < n  # merged
        assert req.time_to_first_token.count == 1 and req.inter_token_latency.count == n - 1
        # The per-step latencies add up to the decode time, which time-per-output-token spreads over n - 1.
        assert req.time_per_output_token.sum == pytest.approx(req.inter_token_latency.sum / (n - 1))
        await ae.shutdown()

    asyncio.run(main())
