"""Closed-loop streaming load generator for OpenAI-compatible servers (ours, vLLM, anything that streams SSE).

``concurrency`` workers each keep exactly one request in flight, so the server always sees that many users;
a cell's work is fixed by its prompt list and ``max_tokens`` (``ignore_eos`` keeps outputs full length), which
makes cells of different configs comparable token for token.

Timing follows ``vllm bench serve`` so numbers line up with vLLM's own tool:

- TTFT: request start to the first chunk that carries output: text, or (with vLLM's
  ``continuous_usage_stats``, which we ask for) a rise in ``usage.completion_tokens`` -- a step can emit
  tokens that spell no text yet (partial UTF-8, a random model's ids a small tokenizer cannot spell).
- ITL: gaps between consecutive token-carrying chunks. With speculative decoding one chunk may carry several
  tokens (everything one verify step emitted), so a per-chunk ITL is a per-*step* latency -- the number the
  seed table reports. We also keep a per-token ITL (each gap split over the tokens it delivered, counted
  from ``usage`` when the server streams it per chunk, else spread evenly from the final usage count).
- Token counts come from ``usage.completion_tokens`` (we ask for ``stream_options.include_usage``); text
  chunks are only a fallback, because one chunk is not one token.
- TPOT: (E2E - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import numpy as np
import orjson

from dspark_cli.bench.datasets import Prompt
from dspark_cli.bench.metrics import (
    PrefixCacheCounters,
    SpecDecodeCounters,
    dspark_counters,
    dspark_gauges,
    parse_prometheus,
)
from dspark_cli.errors import DsparkError

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class LoadConfig:
    """What every request of a cell looks like; equal across configs so cells are comparable."""

    base_url: str
    endpoint: Endpoint = "chat"
    model: str | None = None  # None: ask the server's /v1/models
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = 0  # request i gets seed + i: reproducible, yet requests differ from each other
    ignore_eos: bool = True
    concurrency: int = 1
    request_timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestResult:
    index: int
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter seconds
    ttft: float | None = None  # seconds
    latency: float = 0.0  # seconds, start to last token-carrying chunk
    itl: list[float] = field(default_factory=list)  # seconds between token-carrying chunks
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per token chunk, when the server says
    output_tokens: int = 0
    prompt_tokens: int | None = None
    text: str = ""
    # False: the stream carried no usage (a server that ignores stream_options), so output_tokens counts chunks,
    # and a speculative server's chunks carry several tokens each
    usage_counted: bool = True

    @property
    def num_token_chunks(self) -> int:
        return len(self.itl) + (1 if self.ttft is not None else 0)

    def per_token_itl(self) -> list[float]:
        """Each chunk gap split over the tokens that chunk delivered (see module docstring)."""
        if not self.itl:
            return []
        if len(self.chunk_tokens) == len(self.itl) + 1 and all(n > 0 for n in self.chunk_tokens):
            out: list[float] = []
            for gap, n in zip(self.itl, self.chunk_tokens[1:], strict=True):
                out.extend([gap / n] * n)
            return out
        # Counts per chunk unknown: the decode tokens spread evenly over the gaps, each gap split over its share
        # (whole tokens, largest remainder), so that pooled over requests every token weighs alike, not every chunk.
        decode_tokens = max(self.output_tokens - 1, len(self.itl))
        g = len(self.itl)
        out = []
        for i, gap in enumerate(self.itl):
            n = (i + 1) * decode_tokens // g - i * decode_tokens // g
            out.extend([gap / n] * n)
        return out


def server_root(url: str) -> str:
    """A server's base URL as the clients join paths to it: ``http://host:port``. The OpenAI clients' form,
    ending in ``/v1`` (what ``dspark serve`` prints), is accepted too."""
    root = url.strip().rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise DsparkError(f"--base-url must start with http:// or https://, got {url!r}")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def _has_output(choice: dict[str, Any]) -> bool:
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"))
    return bool(choice.get("text"))


def _choice_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def build_payload(prompt: Prompt, cfg: LoadConfig, model: str, index: int) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if cfg.endpoint == "chat":
        payload["messages"] = prompt.as_messages()
    else:
        payload["prompt"] = prompt.as_text()
    if cfg.seed is not None:
        payload["seed"] = cfg.seed + index
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(cfg.extra_body)
    return payload


async def stream_request(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], index: int
) -> RequestResult:
    """Send one streaming request and time its token-carrying chunks."""
    res = RequestResult(index=index)
    st = time.perf_counter()
    res.start = st
    last = st
    buf = b""
    prev_usage_tokens = 0
    usage_tokens: int | None = None
    per_chunk_known = True
    texts: list[str] = []
    try:
        async with session.post(url, data=orjson.dumps(payload),
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300].replace("\n", " ")
                res.error = f"HTTP {resp.status}: {body}"
                return res
            async for data in resp.content.iter_any():
                # SSE lines may end in CRLF (sse-starlette's servers): one line ending for the split below
                buf = (buf + data).replace(b"\r\n", b"\n")
                # SSE events end with a blank line; a network read may end mid-event, so keep the tail.
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.splitlines():
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue  # comments (":ping"), event names
                        payload_bytes = line[5:].strip()
                        if payload_bytes == b"[DONE]":
                            continue
                        now = time.perf_counter()
                        msg = orjson.loads(payload_bytes)
                        if not isinstance(msg, dict) or not isinstance(msg.get("usage") or {}, dict) or \
                                not isinstance(msg.get("choices") or [], list):
                            # one request fails, not the whole cell with a traceback
                            res.error = f"malformed stream event: {payload_bytes[:200].decode(errors='replace')}"
                            return res
                        if "error" in msg and not msg.get("choices"):
                            err = msg["error"]
                            res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                            return res
                        usage = msg.get("usage") or None
                        choices = msg.get("choices") or []
                        tokens_now = int(usage["completion_tokens"]) if usage and usage.get(
                            "completion_tokens") is not None else None
                        # A step of no text counts where usage streams with every chunk (continuous usage); a
                        # server that sends usage only with its last, empty choice (llama.cpp's) made it one more
                        # ~0 ms step per request.
                        advanced = (tokens_now is not None and bool(choices) and tokens_now > prev_usage_tokens
                                    and per_chunk_known)
                        if res.ttft is not None and tokens_now is not None and not advanced and choices:
                            # text the server held back (a stop string's look-ahead) and no new token: it belongs
                            # to the step before, not a step of its own
                            texts.append(_choice_text(choices[0]))
                        elif choices and (_has_output(choices[0]) or advanced):
                            if res.ttft is None:
                                res.ttft = now - st
                            else:
                                res.itl.append(now - last)
                            last = now
                            texts.append(_choice_text(choices[0]))
                            if usage and usage.get("completion_tokens") is not None:
                                n = int(usage["completion_tokens"])
                                res.chunk_tokens.append(n - prev_usage_tokens)
                                prev_usage_tokens = n
                            else:
                                per_chunk_known = False
                        if usage:
                            if usage.get("completion_tokens") is not None:
                                usage_tokens = int(usage["completion_tokens"])
                            if usage.get("prompt_tokens") is not None:
                                res.prompt_tokens = int(usage["prompt_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    res.text = "".join(texts)
    if not per_chunk_known:
        res.chunk_tokens = []
    if res.ttft is None:
        res.error = "the stream carried no output tokens"
        return res
    res.output_tokens = usage_tokens if usage_tokens is not None else res.num_token_chunks
    res.usage_counted = usage_tokens is not None
    res.latency = last - st
    res.success = True
    return res


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists (what vLLM and our server expect in ``model``)."""
    try:
        async with session.get(f"{base_url}/v1/models") as resp:
            if resp.status != 200:
                raise DsparkError(f"{base_url}/v1/models answered HTTP {resp.status}; pass --model NAME")
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise DsparkError(f"cannot reach {base_url}: {exc}; is the server running?") from exc
    models = body.get("data") or []
    if not models:
        raise DsparkError(f"{base_url}/v1/models lists no model; pass --model NAME")
    return str(models[0]["id"])


@dataclass(frozen=True)
class ServerCounters:
    """One scrape of ``/metrics``: vLLM's spec-decode and prefix-cache counters and the toolkit's own
    (``dspark:*``)."""

    spec: SpecDecodeCounters
    dspark: dict[str, float]
    gauges: dict[str, float] = field(default_factory=dict)
    prefix_cache: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)
    # False: the scrape failed (an error status, a timeout). A cell whose first scrape failed cannot say what
    # its counters did: measured from nothing, they would hold the warm-up's and every earlier cell's too.
    scraped: bool = True


async def fetch_counters(session: aiohttp.ClientSession, base_url: str, attempts: int = 2) -> ServerCounters:
    """Counters from ``/metrics``; an absent endpoint or a failed scrape reads as "no counters" (``scraped``
    False), not an error. A scrape that timed out or lost its connection is tried again once."""
    for attempt in range(attempts):
        try:
            async with session.get(f"{base_url}/metrics") as resp:
                if resp.status != 200:
                    return ServerCounters(SpecDecodeCounters(), {}, scraped=False)
                samples = parse_prometheus(await resp.text())
            break
        except (aiohttp.ClientError, asyncio.TimeoutError):
            if attempt == attempts - 1:
                return ServerCounters(SpecDecodeCounters(), {}, scraped=False)
            await asyncio.sleep(0.5)
    return ServerCounters(SpecDecodeCounters.from_samples(samples), dspark_counters(samples), dspark_gauges(samples),
                          PrefixCacheCounters.from_samples(samples))


def make_session(cfg: LoadConfig) -> aiohttp.ClientSession:
    # No connection cap below the concurrency: aiohttp's default limit of 100 would silently queue requests.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=30)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def run_load(
    prompts: Sequence[Prompt],
    cfg: LoadConfig,
    on_done: Callable[[RequestResult], None] | None = None,
    session: aiohttp.ClientSession | None = None,
    first_index: int = 0,
) -> tuple[list[RequestResult], float, str]:
    """Run every prompt once with ``cfg.concurrency`` requests in flight; returns (results, wall s, model).

    Prompt ``i`` is request ``first_index + i`` (its seed and result index), so a cell sent in parts sends
    exactly the requests it would send whole."""
    if cfg.concurrency < 1:
        raise DsparkError(f"concurrency must be >= 1, got {cfg.concurrency}")
    own = session is None
    sess = session or make_session(cfg)
    try:
        model = cfg.model or await fetch_model_name(sess, cfg.base_url)
        url = cfg.base_url + ENDPOINT_PATHS[cfg.endpoint]
        results: list[RequestResult | None] = [None] * len(prompts)
        next_index = iter(range(len(prompts)))

        async def worker() -> None:
            # Closed loop: a worker sends its next request only when the previous one has finished.
            for i in next_index:
                index = first_index + i
                r = await stream_request(sess, url, build_payload(prompts[i], cfg, model, index), index)
                results[i] = r
                if on_done is not None:
                    on_done(r)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, max(len(prompts), 1)))))
        wall = time.perf_counter() - t0
    finally:
        if own:
            await sess.close()
    return [r for r in results if r is not None], wall, model


def _stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def aggregate(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Cell metrics (times in ms). ``per_user_tok_s`` is 1000 / median TPOT: the decode speed a typical user
    sees; ``per_request_tok_s_mean`` (mean of output tokens / E2E per request) is kept alongside."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - (r.ttft or 0.0)) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [g for r in ok for g in r.itl]
    itl_tok = [g for r in ok for g in r.per_token_itl()]
    chunks = sum(r.num_token_chunks for r in ok)
    tpot = _stats(tpots)
    errors = sorted({r.error for r in results if not r.success})
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": wall_s,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats(itl),
        "itl_per_token_ms": _stats(itl_tok),
        "tpot_ms": tpot,
        "e2e_ms": _stats([r.latency for r in ok]),
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        # requests whose tokens were counted as stream chunks, the server having sent no usage (see RequestResult)
        "chunk_counted_requests": sum(not r.usage_counted for r in ok),
        "per_user_tok_s": (1000.0 / tpot["median"]) if tpot["median"] else None,
        "per_user_definition": "1000 / median TPOT ms",
        "per_request_tok_s_mean": float(np.mean([r.output_tokens / r.latency for r in ok if r.latency > 0]))
        if ok else None,
    }
