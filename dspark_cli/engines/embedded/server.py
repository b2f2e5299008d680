"""OpenAI-compatible HTTP server for the embedded engine (aiohttp).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (streaming SSE and not), ``/v1/models``,
``/health``, ``/metrics`` (vLLM's metric names, see ``metrics.py``) and ``/version``. The request and
response shapes follow OpenAI's API as vLLM implements it, so that ``vllm bench serve``, the ``openai``
client and ``dspark bench`` talk to this server exactly as they talk to ``vllm serve``.

Design points:
- Validation happens at the edge (``protocol.py``): anything the engine cannot honour (logprobs, penalties,
  tools, a prompt longer than the context) is a 400 with OpenAI's error JSON naming the field, never a
  silently different experiment.
- Stop strings are matched on incrementally detokenised text (``detokenizer.py``). While streaming, the last
  ``len(longest stop) - 1`` characters are held back so a stop string split across steps is never sent
  to the client; the text is cut before the earliest-starting stop string (whatever the step split) and
  the engine request aborted (its KV blocks freed).
- The engine runs behind a front (``async_engine.py``): on a thread of this process, or with
  ``--engine-process`` in a process of its own (``engine_process.py``), so that this loop's per-token work
  and the engine's steps do not share one interpreter lock.
- The handler is cancelled when its client disconnects (``handler_cancellation``), and leaving the
  ``generate`` iterator aborts the engine request, so a vanished client never keeps decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from dspark_cli import __version__
from dspark_cli.engines.embedded.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineFront,
    EngineStoppingError,
    RequestRejectedError,
    engine_max_model_len,
    error_type,
)
from dspark_cli.engines.embedded.detokenizer import IncrementalDetokenizer, StopTextBuffer
from dspark_cli.engines.embedded.metrics import CONTENT_TYPE, RequestMetrics, render_metrics
from dspark_cli.engines.embedded.protocol import (
    BadRequest,
    ParsedRequest,
    is_int,
    parse_chat,
    parse_completion,
)
from dspark_cli.errors import DsparkError

log = logging.getLogger("dspark.serve")

# The charset said: a client that takes HTTP's default for text/* (ISO-8859-1) misread every non-ASCII character.
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(error_body(message, status, param)), status=status,
                        content_type="application/json")


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


@dataclass
class ServerContext:
    """What the handlers share: the engine front, names, and limits known once the engine has loaded."""

    engine: EngineFront
    served_model_name: str
    model_aliases: tuple[str, ...] = ()
    num_speculative_tokens: int = 0
    max_model_len_override: int | None = None
    started: float = field(default_factory=time.time)
    requests: RequestMetrics = field(default_factory=RequestMetrics)  # vLLM's per-request histograms

    @property
    def names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.model_aliases)

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        value = engine_max_model_len(self.engine.engine)
        if value is not None:
            return value
        if self.max_model_len_override is not None:
            return self.max_model_len_override
        raise EngineDeadError("the engine does not report max_model_len")

    @property
    def vocab_size(self) -> int:
        value = getattr(self.engine.engine, "vocab_size", None)
        return value if is_int(value) and value > 0 else len(self.tokenizer)

    @property
    def k(self) -> int:
        """Draft length actually running (``auto`` may have found no draft), for per-position metrics."""
        if self.engine.healthy:
            value = getattr(self.engine.engine, "num_spec", None)
            if is_int(value):
                return value
        return self.num_speculative_tokens



# A request body above this many bytes is parsed (and its prompt tokenized) off the event loop; below it the
# thread hop would cost more than the parse (a 64 KiB prompt tokenizes in about a millisecond).
PARSE_ON_LOOP_BYTES = 64 * 1024



# --------------------------------------------------------------------------------------------- handlers


async def _read_json(request: web.Request) -> tuple[Any, int]:
    """The body's JSON and its size in bytes (as read: a chunked upload names no Content-Length)."""
    try:
        raw = await request.read()
        return orjson.loads(raw), len(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Generation:
    """One request's run: engine outputs -> text deltas, stop strings, finish reason, token counts."""

    def __init__(self, ctx: ServerContext, req: ParsedRequest, request_id: str) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.detok = IncrementalDetokenizer(ctx.tokenizer, req.prompt_ids)
        self.text = StopTextBuffer(req.stops)
        self.num_tokens = 0
        self.token_ids: list[int] = []  # the output's tokens (those ``num_tokens`` counts)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's)

    def _push(self, ids: list[int]) -> str:
        """Detokenize ``ids`` through the stop strings; count the tokens the output is made of.

        With stop strings, token by token: a speculative step hands over several tokens at once, and the ones
        after the token that completed a stop string are not part of the output. Counted one by one, usage is
        what decoding without speculation reports (and it no longer depends on how a lagging stream merged
        steps)."""
        if not self.req.stops:
            self.num_tokens += len(ids)
            self.token_ids += ids
            return self.text.add(self.detok.push(ids))
        delta = ""
        for token in ids:
            self.num_tokens += 1
            self.token_ids.append(token)
            delta += self.text.add(self.detok.push([token]))
            if self.text.stopped:
                break
        return delta

    async def deltas(self) -> Any:
        """Yield text deltas (possibly empty); ``finish_reason`` is set before the last one."""
        gen = self.ctx.engine.generate(self.request_id, self.req.prompt_ids, self.req.params)
        timed = self.ctx.requests.track(self.request_id, len(self.req.prompt_ids), self.ctx.max_model_len)
        async with timed, contextlib.aclosing(gen):
            async for out in gen:
                new_ids = list(out.new_token_ids)
                # The token that stopped the engine (EOS or a stop token id) is counted and listed, but not
                # spelled out: vLLM leaves it out of the text unless include_stop_str_in_output.
                stop_token = new_ids.pop() if out.finished and out.finish_reason == "stop" and new_ids else None
                delta = self._push(new_ids)
                if self.text.stopped:
                    self.finish_reason, self.stop_reason = "stop", self.text.matched
                    # Finished by us, not by the engine: free its KV blocks now, count it as "stop".
                    self.ctx.engine.abort(self.request_id, reason="stop")
                    self.ctx.requests.finish(self.request_id, self.num_tokens, "stop")
                    yield delta
                    return
                if out.finished:
                    if stop_token is not None:
                        self.num_tokens += 1
                        self.token_ids.append(stop_token)
                    delta += self.text.add(self.detok.flush())
                    if not self.text.stopped:
                        delta += self.text.flush()
                    self.finish_reason = "stop" if self.text.stopped else (out.finish_reason or "stop")
                    if self.text.stopped:
                        self.stop_reason = self.text.matched
                    elif stop_token in self.req.params.stop_token_ids:
                        self.stop_reason = stop_token
                    self.ctx.requests.finish(self.request_id, self.num_tokens, self.finish_reason)
                    yield delta
                    return
                yield delta


def _engine_error(exc: BaseException) -> web.Response:
    return error_response(str(exc), _engine_status(exc))


def _engine_status(exc: BaseException) -> int:
    """400: the engine refused this request; 503: the server is shutting down (retry elsewhere); else 500."""
    if isinstance(exc, RequestRejectedError):
        return 400
    return 503 if isinstance(exc, EngineStoppingError) else 500


def _usage_of(gens: Sequence[_Generation]) -> dict[str, int]:
    """A request's usage: each prompt's tokens once (however many samples it has), every choice's output."""
    prompts = {g.req.prompt_index: len(g.req.prompt_ids) for g in gens}
    return _usage(sum(prompts.values()), sum(g.num_tokens for g in gens))


async def _text_of(gen: _Generation) -> str:
    return "".join([delta async for delta in gen.deltas()])


async def _all_or_none(coros: Sequence[Any]) -> list[Any]:
    """Await every coroutine; the first to raise cancels the rest (their engine requests are aborted), and so
    does this request's own cancellation (a client gone)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()


async def _run(ctx: ServerContext, request: web.Request, chat: bool) -> web.StreamResponse:
    if not ctx.engine.healthy:
        return error_response(f"the server is not ready: {ctx.engine.state}", 503)
    try:
        body, size = await _read_json(request)
        parse = parse_chat if chat else parse_completion
        if size > PARSE_ON_LOOP_BYTES:
            # A long prompt's tokenization (seconds for megabytes; the tokenizer lets go of the GIL) would stall
            # every other stream on this loop: it runs on a worker thread.
            reqs = await asyncio.to_thread(parse, ctx, body)
        else:
            reqs = parse(ctx, body)
    except BadRequest as exc:
        return error_response(str(exc), exc.status, exc.param)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    # One engine request per choice (the request id alone when there is one choice, as before batches).
    gens = [_Generation(ctx, r, rid if len(reqs) == 1 else f"{rid}-{i}") for i, r in enumerate(reqs)]
    req = reqs[0]
    if req.stream:
        return await _stream(request, gens, rid, created, chat)
    try:
        texts = await _all_or_none([_text_of(g) for g in gens])
    except (EngineDeadError, RequestRejectedError) as exc:
        return _engine_error(exc)
    choices = []
    for i, (gen, text) in enumerate(zip(gens, texts, strict=True)):
        choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": gen.finish_reason,
                                  "stop_reason": gen.stop_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if req.return_token_ids:
            choice["token_ids"] = gen.token_ids
            if not chat:  # vLLM puts the prompt's ids on a completion's choice, on a chat response
                choice["prompt_token_ids"] = gen.req.prompt_ids
        choices.append(choice)
    out: dict[str, Any] = {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": req.model, "choices": choices, "usage": _usage_of(gens),
    }
    if req.return_token_ids and chat:
        out["prompt_token_ids"] = req.prompt_ids
    return json_response(out)


_END = object()  # a choice's stream is over (in _merged's queue)


@dataclasses.dataclass(frozen=True)
class _Delta:
    """A choice's text delta with its generation's state as it was when the delta was made: with several
    choices each one's task runs ahead of a writer held up by a slow client, so a chunk written from the live
    state said a choice had finished on every delta still queued, and lost the ids added meanwhile."""

    text: str
    num_tokens: int
    finish_reason: str | None
    stop_reason: str | int | None

    @classmethod
    def of(cls, gen: _Generation, text: str) -> _Delta:
        return cls(text, gen.num_tokens, gen.finish_reason, gen.stop_reason)


@contextlib.asynccontextmanager
async def _merged(gens: Sequence[_Generation]) -> Any:
    """``(choice index, _Delta)`` of every choice as they come; leaving it aborts the engine requests still
    running. One choice is read directly; several go through a queue, one task each."""
    if len(gens) == 1:
        deltas = gens[0].deltas()

        async def one() -> Any:
            async for delta in deltas:
                yield 0, _Delta.of(gens[0], delta)

        stream = one()
        async with contextlib.aclosing(deltas), contextlib.aclosing(stream):
            yield stream
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: _Generation) -> None:
        try:
            async for delta in gen.deltas():
                queue.put_nowait((i, _Delta.of(gen, delta), None))
        except Exception as exc:  # noqa: BLE001 -- any failure ends the stream; a lost one left it open forever
            queue.put_nowait((i, None, exc))
        queue.put_nowait((i, _END, None))

    async def events() -> Any:
        left = len(gens)
        while left:
            i, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is _END:
                left -= 1
            else:
                yield i, delta

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        yield events()
    finally:
        for task in tasks:
            task.cancel()


async def _stream(request: web.Request, gens: Sequence[_Generation], rid: str, created: int,
                  chat: bool) -> web.StreamResponse:
    req = gens[0].req
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(i: int, delta: str | None, state: _Delta | None, first: bool = False,
              ids: list[int] | None = None, role: bool = False) -> bytes:
        """One SSE event of choice ``i`` in ``state`` (None: before any token); ``ids``: its output tokens since
        its last event (return_token_ids).

        ``role``: chat's opening event, which carries no token. Its usage says 0 completion tokens, as vLLM's
        does, though it goes out once the first output exists: a client timing chunks by usage would otherwise
        take it for the first token's chunk, and the first token's own for a second one of no tokens.
        """
        gen = gens[i]
        finish = None if state is None else state.finish_reason
        if chat:
            d: dict[str, Any] = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice: dict[str, Any] = {"index": i, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta or "", "logprobs": None, "finish_reason": finish}
        choice["stop_reason"] = state.stop_reason if state is not None and finish is not None else None
        payload: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model,
                                   "choices": [choice]}
        if req.return_token_ids:
            choice["token_ids"] = ids or []
            if first:  # the prompt's ids ride on a choice's first event only, as vLLM sends them
                (payload if chat else choice)["prompt_token_ids"] = gen.req.prompt_ids
        if req.include_usage:
            tokens = 0 if role or state is None else state.num_tokens
            payload["usage"] = _usage(len(gen.req.prompt_ids), tokens) if req.continuous_usage else None
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    resp: web.StreamResponse | None = None
    sent_tokens = [0] * len(gens)
    try:
        async with _merged(gens) as events:
            async for i, state in events:
                gen, delta = gens[i], state.text
                if resp is None:
                    # Headers go out with the first output, so a request the engine refuses still gets
                    # a proper status code instead of a 200 stream carrying an error.
                    resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
                    await resp.prepare(request)
                    if chat:
                        for j in range(len(gens)):
                            await resp.write(chunk(j, "", None, first=True, role=True))
                first = not chat and sent_tokens[i] == 0
                # the ids list only grows: the state's count cuts it where the delta was made
                ids = gen.token_ids[sent_tokens[i]:state.num_tokens] if req.return_token_ids else None
                if state.finish_reason is not None:
                    await resp.write(chunk(i, delta if (delta or not chat) else None, state, first, ids))
                elif delta or state.num_tokens > sent_tokens[i]:
                    # One chunk per engine output (a step, or the steps merged while this stream was
                    # behind) that produced tokens, even when they produced no text yet
                    # (a partial UTF-8 sequence, text held back by a stop string, ids a random model's
                    # tokenizer cannot spell): timing clients see every output, usage counts every token.
                    await resp.write(chunk(i, delta, state, first, ids))
                sent_tokens[i] = state.num_tokens
    except (EngineDeadError, RequestRejectedError) as exc:
        if resp is None:
            return _engine_error(exc)
        body = error_body(str(exc), _engine_status(exc))
        return await _end_stream(resp, [b"data: " + orjson.dumps(body) + b"\n\n"])
    except ConnectionResetError:
        # The client went away mid-stream; leaving _merged above already aborted the requests.
        return resp if resp is not None else web.Response(status=499)
    except Exception as exc:  # noqa: BLE001 -- a bug of ours: said in the log and to the client, never a hang
        log.exception("request %s failed", rid)
        if resp is None:
            return error_response(f"internal error: {error_type(exc)}: {exc}", 500)
        body = error_body(f"internal error: {error_type(exc)}: {exc}", 500)
        return await _end_stream(resp, [b"data: " + orjson.dumps(body) + b"\n\n"])
    assert resp is not None
    tail = []
    if req.include_usage:
        payload = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
                   "usage": _usage_of(gens)}
        tail.append(b"data: " + orjson.dumps(payload) + b"\n\n")
    return await _end_stream(resp, tail)


async def _end_stream(resp: web.StreamResponse, events: Sequence[bytes]) -> web.StreamResponse:
    """The stream's last events, ``[DONE]`` and its end. A client may close once it has read the last choice's
    finish: the requests are done by then, so there is nothing to abort and nothing to log."""
    try:
        for event in events:
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


def create_app(ctx: ServerContext) -> web.Application:
    """The aiohttp application (routes and a JSON error middleware) around a started or starting engine."""
    ctx.engine.on_outputs = ctx.requests.on_outputs

    @web.middleware
    async def json_errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(f"{exc.reason}: {request.method} {request.path}", exc.status)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _run(ctx, request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _run(ctx, request, chat=True)

    async def models(request: web.Request) -> web.Response:
        data = [{"id": ctx.served_model_name, "object": "model", "created": int(ctx.started),
                 "owned_by": "dspark", "root": ctx.model_aliases[0] if ctx.model_aliases else ctx.served_model_name,
                 "parent": None}]
        if ctx.engine.healthy:
            data[0]["max_model_len"] = ctx.max_model_len
        return json_response({"object": "list", "data": data})

    async def health(request: web.Request) -> web.Response:
        if ctx.engine.healthy:
            return web.Response(status=200)
        err = ctx.engine.error
        return json_response({"status": ctx.engine.state,
                              "error": f"{error_type(err)}: {err}" if err is not None else None}, 503)

    async def metrics(request: web.Request) -> web.Response:
        if ctx.engine.healthy:
            # Sized here too, so a scrape before the first request already lists the token histograms.
            with contextlib.suppress(EngineDeadError):  # an engine that reports no max_model_len: wait for one
                ctx.requests.bind(ctx.max_model_len)
        text = render_metrics(ctx.engine.metrics(), ctx.served_model_name, ctx.k, requests=ctx.requests)
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    async def version(request: web.Request) -> web.Response:
        return json_response({"version": __version__})

    app = web.Application(middlewares=[json_errors], client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    return app


# --------------------------------------------------------------------------------------------- running


@dataclass
class ServerOptions:
    host: str
    port: int
    served_model_name: str
    model_aliases: tuple[str, ...] = ()
    num_speculative_tokens: int = 0
    # Run the engine in a process of its own (engine_process.py says why) instead of on a thread of this one.
    engine_process: bool = False


def engine_front(engine_factory: Callable[[], Any], engine_process: bool) -> EngineFront:
    """The front ``dspark serve`` runs the engine behind: a thread here, or a process of its own (the
    factory must then pickle)."""
    if engine_process:
        from dspark_cli.engines.embedded.engine_process import ProcessEngine

        return ProcessEngine(engine_factory)
    return AsyncEngine(engine_factory)


async def serve_async(engine_factory: Callable[[], Any], opts: ServerOptions,
                      on_ready: Callable[[str], None] | None = None,
                      stop_event: asyncio.Event | None = None) -> bool:
    """Bind the port, load the engine (``/health`` is 503 meanwhile), serve until SIGINT/SIGTERM or stop.

    Returns whether the engine was left loading on a thread of this process (stopped before it was ready):
    the caller should then end the process without waiting for that thread."""
    engine = engine_front(engine_factory, opts.engine_process)
    ctx = ServerContext(engine, opts.served_model_name, opts.model_aliases, opts.num_speculative_tokens)
    # shutdown_timeout: in-flight streams end as soon as the engine stops (they get an error event), so a
    # short grace period is enough and Ctrl-C never hangs for aiohttp's default minute.
    runner = web.AppRunner(create_app(ctx), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, opts.host, opts.port)
        try:
            await site.start()
        except OSError as exc:
            raise DsparkError(f"cannot listen on {opts.host}:{opts.port} ({exc.strerror or exc}); "
                              "pick another --port or --host") from None
        stop = stop_event or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        load = asyncio.ensure_future(engine.start())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if load.done():
            exc = load.exception()
            if exc is not None:
                if isinstance(exc, DsparkError):
                    raise exc
                first = (str(exc).strip().splitlines() or [""])[0]
                raise DsparkError(f"the engine failed to load: {error_type(exc)}: {first}") from exc
            port = opts.port
            sockets = [s for s in getattr(site._server, "sockets", None) or []]  # noqa: SLF001
            if sockets:
                port = sockets[0].getsockname()[1]
            log.info("engine loaded; it runs in %s", engine.runs_in())
            if on_ready is not None:
                on_ready(f"http://{opts.host}:{port}")
            await stopper
        else:
            load.cancel()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(sig)
        await engine.shutdown()  # first: pending requests fail fast instead of holding connections open
        await runner.cleanup()
    return bool(getattr(engine, "abandoned_load", False))


def run_server(engine_factory: Callable[[], Any], opts: ServerOptions,
               on_ready: Callable[[str], None] | None = None) -> bool:
    """Blocking entry point for the CLI; returns what :func:`serve_async` returns."""
    return asyncio.run(serve_async(engine_factory, opts, on_ready))
