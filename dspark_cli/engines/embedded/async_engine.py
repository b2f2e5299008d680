"""Asyncio fronts for the synchronous :class:`LLMEngine`: the engine runs on a thread or in a process of its own.

The engine is not thread-safe and ``step()`` blocks for a whole forward pass, so it cannot run on the event
loop. Every engine call -- construction, ``add_request``, ``abort_request``, ``step`` -- happens in one
place that owns the engine: a dedicated thread (:class:`AsyncEngine`) or a child process
(``engine_process.ProcessEngine``, ``dspark serve --engine-process``). The loop sends it commands and gets
back each step's outputs in one batch per step (one loop wake-up per step, not per token), delivered to
per-request asyncio queues.

Both fronts share everything but that transport. :class:`EngineFront` is the loop side (request streams,
merging the outputs of a consumer that fell behind, failure fan-out, state); :class:`EngineDriver` is the
engine side (applying commands, stepping, publishing counters). A front only says how commands reach the
driver and how its reports come back.

When nothing is running the engine side blocks on its commands (no busy-spin, no polling timeout on the
hot path). If the engine raises, every pending request fails with :class:`EngineDeadError` and the engine
stays dead (``healthy`` is False): continuing after an exception inside a step would run on a KV cache and
scheduler state of unknown consistency, and an orchestrator restarting the process is the safe recovery.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dspark_cli.engines.embedded.metrics import MetricsSnapshot
from dspark_cli.errors import DsparkError

log = logging.getLogger("dspark.serve")


class EngineDeadError(RuntimeError):
    """The engine failed (or was shut down); the request cannot complete. Maps to HTTP 500/503."""


class EngineStoppingError(EngineDeadError):
    """The server is shutting down: the request was cut off, not failed (HTTP 503, which clients retry)."""


class RequestRejectedError(ValueError):
    """The engine refused one request (``add_request`` raised); other requests are unaffected. HTTP 400."""


def error_type(exc: BaseException) -> str:
    """The type name to report for ``exc``; an error relayed from the engine process keeps the name it had
    there (its ``type_name``), so messages read the same whichever front runs."""
    name = getattr(exc, "type_name", None)
    return name if isinstance(name, str) and name else type(exc).__name__


def engine_max_model_len(engine: Any) -> int | None:
    """The context length an engine reports (``config.max_model_len``, ``cfg.max_model_len`` or its own)."""
    for obj in (getattr(engine, "config", None), getattr(engine, "cfg", None), engine):
        value = getattr(obj, "max_model_len", None) if obj is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: Any


@dataclass
class _Abort:
    request_id: str
    reason: str


class _Stop:
    pass


Command = _Add | _Abort | _Stop


def _merged(first: Any, then: Any) -> Any:
    """One output with the tokens of two consecutive ones of a request (``then``'s finish state)."""
    return dataclasses.replace(then, new_token_ids=[*first.new_token_ids, *then.new_token_ids])


# ---------------------------------------------------------------------------------------- engine side


class EngineSink(Protocol):
    """Where the engine side reports to its front (called where the engine runs: its thread or process)."""

    def counters(self, snapshot: MetricsSnapshot) -> None:
        """Commands changed the counters (a request added or aborted)."""

    def rejected(self, request_id: str, message: str) -> None:
        """``add_request`` refused a request; it fails alone."""

    def stepped(self, outputs: list[Any], snapshot: MetricsSnapshot) -> None:
        """One step's outputs and the counters as of its end."""


class EngineDriver:
    """The engine side both fronts share: applies commands, steps while work is in flight, publishes counters.

    The counters go out with every step's outputs (and after commands that change them), so ``/metrics``
    read after a request's last token already counts it.
    """

    def __init__(self, engine: Any, sink: EngineSink) -> None:
        self.engine = engine
        self._sink = sink
        # Aborts that were really stop-string finishes: not client aborts (dspark:requests_aborted_total). How a
        # request finished is counted by the server, by what its response said (metrics.RequestMetrics).
        self._stop_aborts = 0

    def run(self, next_command: Callable[[bool], Command | None]) -> None:
        """Serve commands and step until a stop command; raise whatever the engine raises.

        ``next_command(True)`` blocks until a command arrives; ``next_command(False)`` returns None when
        none is waiting.
        """
        engine = self.engine
        while True:
            # Block only when idle: with work in flight we drain whatever commands arrived and step.
            cmd = None if engine.has_unfinished_requests() else next_command(True)
            changed = False
            while True:
                if cmd is None:
                    cmd = next_command(False)
                    if cmd is None:
                        break
                if isinstance(cmd, _Stop):
                    return
                changed = self._apply(cmd) or changed
                cmd = None
            if changed:
                self._sink.counters(self.snapshot())
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            self._sink.stepped(list(outputs), self.snapshot())

    def _apply(self, cmd: _Add | _Abort) -> bool:
        """Run one command on the engine; True when it may have changed the counters."""
        engine = self.engine
        if isinstance(cmd, _Abort):
            before = engine.stats.requests_finished.get("abort", 0)
            try:
                engine.abort_request(cmd.request_id)
                aborted = engine.stats.requests_finished.get("abort", 0) - before
            except (KeyError, ValueError):
                aborted = 0  # already finished: its last output raced with the abort
            if cmd.reason == "stop":
                self._stop_aborts += aborted
            return aborted > 0
        try:
            engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params)
        except (DsparkError, ValueError, TypeError) as exc:
            # A request the engine refuses (too long, bad parameters) fails alone; the engine is fine.
            self._sink.rejected(cmd.request_id, str(exc))
        return True

    def snapshot(self) -> MetricsSnapshot:
        """The engine's counters, with aborts the server made for stop strings moved to ``stop``."""
        snap = MetricsSnapshot.from_stats(self.engine.stats)
        if self._stop_aborts:
            finished = dict(snap.requests_finished)
            moved = min(self._stop_aborts, finished.get("abort", 0))
            finished["abort"] = finished.get("abort", 0) - moved
            finished["stop"] = finished.get("stop", 0) + moved
            snap = dataclasses.replace(snap, requests_finished=finished)
        return snap

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            try:
                close()  # flush trace files and the like; the process may be about to exit
            except Exception:  # noqa: BLE001 -- a failing close must not mask a clean shutdown
                log.exception("engine close failed")


# ------------------------------------------------------------------------------------------- loop side


class EngineFront:
    """The loop side both fronts share: request streams, output merging, failure fan-out and state.

    A subclass implements ``start``, ``shutdown``, ``engine`` and ``_submit`` (how a command reaches the
    engine), and hands the engine's reports to ``_deliver`` / ``_deliver_error`` / ``_on_*`` on the loop.
    """

    def __init__(self) -> None:
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stats = MetricsSnapshot()
        self._error: BaseException | None = None
        self._stopping = False
        self.state = "new"  # new -> loading -> ready -> (failed | stopped)
        # Sees every step's outputs on the loop as they arrive, before ``generate`` merges the ones a slow
        # consumer left waiting: per-step latencies (the server's inter-token histogram) need each step's time.
        self.on_outputs: Callable[[list[Any]], None] | None = None

    async def start(self) -> None:
        """Load the engine; return when it is ready to take requests (or raise what loading raised)."""
        raise NotImplementedError

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine after its current step; pending requests fail with EngineDeadError."""
        raise NotImplementedError

    @property
    def engine(self) -> Any:
        """Read-only attributes of the loaded engine that never change (tokenizer, config, vocab_size)."""
        raise NotImplementedError

    def _submit(self, cmd: Command) -> None:
        """Send one command to the engine (called on the loop)."""
        raise NotImplementedError

    def runs_in(self) -> str:
        """Where the engine runs, for the start-up log."""
        raise NotImplementedError

    def _begin_start(self) -> asyncio.Future[None]:
        """Start-up bookkeeping of ``start`` (on the loop); returns the future that loading resolves."""
        if self.state != "new":
            raise RuntimeError(f"{type(self).__name__}.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.state = "loading"
        return self._ready

    @property
    def healthy(self) -> bool:
        return self.state == "ready"

    @property
    def error(self) -> BaseException | None:
        return self._error

    def metrics(self) -> MetricsSnapshot:
        """The counters as of the last finished step (a snapshot the engine side publishes)."""
        return self._stats

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------------------------------ requests

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """Add a request and yield its ``RequestOutput`` objects until one has ``finished``.

        Leaving the iteration early (the consumer breaks, or its task is cancelled because the client went
        away) aborts the request in the engine, which frees its KV blocks.

        When the consumer falls behind (the event loop is busy with other streams), the outputs waiting in the
        request's queue are merged into one, as vLLM's output collector does: one SSE chunk, one socket write,
        carries the tokens of several steps. Why: at 256 streams the server's per-chunk work (the write
        syscall above all) is what bounds throughput (``benchmarks/server_overhead.py``), and a chunk per step
        that the client would receive late anyway buys it nothing. While the loop keeps up, every step is
        its own chunk.
        """
        if self.state != "ready":
            raise EngineDeadError(self._dead_reason())
        if request_id in self._streams:
            raise RequestRejectedError(f"duplicate request id {request_id!r}")
        stream: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = stream
        self._submit(_Add(request_id, list(prompt_ids), params))
        finished = False
        held: Any = None  # an error found while merging: raised after the tokens before it are out
        try:
            while True:
                item = held if held is not None else await stream.get()
                held = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while not item.finished and not stream.empty():
                    nxt = stream.get_nowait()
                    if isinstance(nxt, BaseException):
                        held = nxt
                        break
                    item = _merged(item, nxt)
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            # Delivery unregisters a finished request (see _deliver); whatever is registered under this id
            # now is either this stream (not finished: the consumer went away) or a newer request's.
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                if not finished:
                    self.abort(request_id)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Ask the engine to drop a request (idempotent; unknown ids are ignored by the engine side).

        ``reason="stop"`` is for a request the server finished itself (a stop string matched): the engine
        counts it as aborted, and the exported ``request_success_total`` moves it to ``stop`` as vLLM does.
        """
        if self.state == "ready":
            self._submit(_Abort(request_id, reason))

    # ----------------------------------------------------------------------------- loop-side delivery

    def _deliver(self, outputs: list[Any]) -> None:
        if self.on_outputs is not None:
            self.on_outputs(outputs)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
                if out.finished:
                    # The engine is done with it, whenever its consumer gets to read this: an engine failure
                    # from now on must not count it in flight (a second outcome, "error", for one request).
                    del self._streams[out.request_id]

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put_nowait(exc)

    def _on_engine_failure(self, exc: BaseException) -> None:
        self._error = exc
        self.state = "failed"
        in_flight = len(self._streams)
        self._fail_all(EngineDeadError(f"engine failed: {error_type(exc)}: {exc}"))
        # The engine's last counters still show the requests it ran; they ended in error, and nothing runs now.
        finished = dict(self._stats.requests_finished)
        finished["error"] = finished.get("error", 0) + in_flight
        self._stats = dataclasses.replace(self._stats, num_running=0, num_waiting=0, requests_finished=finished,
                                          kv_blocks_free=self._stats.kv_blocks_total)

    def _on_ready(self) -> None:
        if self.state != "loading":  # shut down while it loaded: it stays stopped
            return
        self.state = "ready"
        assert self._ready is not None
        if not self._ready.done():
            self._ready.set_result(None)

    def _on_load_failure(self, exc: BaseException) -> None:
        self._error = exc
        self.state = "failed"
        assert self._ready is not None
        if not self._ready.done():
            self._ready.set_exception(exc)

    def _dead_reason(self) -> str:
        if self.state == "failed" and self._error is not None:
            return f"engine failed: {error_type(self._error)}: {self._error}"
        if self.state == "loading":
            return "the engine is still loading"
        return f"the engine is {self.state}"

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, from another thread (the engine thread, a pipe reader)."""
        loop = self._loop
        assert loop is not None
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call (shutdown race)
                pass


class AsyncEngine(EngineFront):
    """Owns one engine on a background thread of the server process; ``generate`` streams its outputs.

    ``engine_factory`` is called on the engine thread (model loading, CUDA context creation and CUDA graph
    capture all belong to the thread that will later run the steps). ``start()`` returns once the engine is
    loaded, or raises what the factory raised.

    The thread shares the server's interpreter lock with the HTTP loop: at 256 streaming requests on an
    H200 host a 5.2 ms decode step took 11-17 ms served. ``engine_process.ProcessEngine`` (``dspark serve
    --engine-process``) runs the engine in a process of its own instead.
    """

    def __init__(self, engine_factory: Callable[[], Any]) -> None:
        super().__init__()
        self._factory = engine_factory
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self.abandoned_load = False  # shut down while loading: the thread may still be inside the load

    async def start(self) -> None:
        """Load the engine on its thread; return when it is ready to take requests."""
        ready = self._begin_start()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()
        await ready

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after its current step; pending requests fail with EngineDeadError.

        A load in progress (weights, graph capture, a start-up profile: up to minutes) cannot be interrupted
        from here, and waiting for it would keep Ctrl-C from acting: the thread is left to read its stop once
        loaded, and ``abandoned_load`` tells the process it may exit without it (``exit_now``)."""
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(_Stop())
        if self.state == "loading":
            self.abandoned_load = True
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(EngineDeadError("the server shut down while the engine was loading"))
            self.state = "stopped"
            return
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)
        self._fail_all(EngineStoppingError("the server is shutting down"))
        if self.state != "failed":
            self.state = "stopped"

    @property
    def engine(self) -> Any:
        """The engine object, for read-only attributes that never change after load (tokenizer, config)."""
        if self._engine is None:
            raise EngineDeadError("the engine is not loaded")
        return self._engine

    def _submit(self, cmd: Command) -> None:
        self._commands.put(cmd)

    def runs_in(self) -> str:
        return "a thread of the server process"

    # --------------------------------------------------------------------------------- engine thread

    def _next_command(self, block: bool) -> Command | None:
        if block:
            return self._commands.get()
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        try:
            engine = self._factory()
            driver = EngineDriver(engine, self)
            self._stats = driver.snapshot()
        except BaseException as exc:  # noqa: BLE001 -- reported to the awaiting start()
            self._call(self._on_load_failure, exc)
            return
        self._engine = engine
        self._call(self._on_ready)
        try:
            driver.run(self._next_command)
        except BaseException as exc:  # noqa: BLE001 -- any step failure makes the engine unusable
            log.exception("engine step failed; the server is now unhealthy")
            self._call(self._on_engine_failure, exc)
            return
        driver.close()

    # EngineSink, called on the engine thread: counters are one attribute store (read on the loop as a
    # whole snapshot), outputs and refusals go through the loop.

    def counters(self, snapshot: MetricsSnapshot) -> None:
        self._stats = snapshot

    def rejected(self, request_id: str, message: str) -> None:
        self._call(self._deliver_error, request_id, RequestRejectedError(message))

    def stepped(self, outputs: list[Any], snapshot: MetricsSnapshot) -> None:
        self._stats = snapshot
        if outputs:
            self._call(self._deliver, outputs)
