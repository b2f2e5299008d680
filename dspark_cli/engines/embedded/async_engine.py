"""An asyncio front for the synchronous :class:`LLMEngine`: one background thread owns the engine.

The engine is not thread-safe and ``step()`` blocks for a whole forward pass, so it cannot run on the event
loop. Every engine call -- construction, ``add_request``, ``abort_request``, ``step`` -- happens on one
dedicated thread. The loop talks to it through a command queue (loop -> thread) and
``loop.call_soon_threadsafe`` (thread -> loop), delivering each step's outputs to per-request asyncio
queues in one batch per step (one loop wake-up per step, not per token).

When nothing is running the thread blocks on the command queue (no busy-spin, no polling timeout on the
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
from typing import Any

from dspark_cli.engines.embedded.metrics import MetricsSnapshot
from dspark_cli.errors import DsparkError

log = logging.getLogger("dspark.serve")


class EngineDeadError(RuntimeError):
    """The engine failed (or was shut down); the request cannot complete. Maps to HTTP 500/503."""


class RequestRejectedError(ValueError):
    """The engine refused one request (``add_request`` raised); other requests are unaffected. HTTP 400."""


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


def _merged(first: Any, then: Any) -> Any:
    """One output with the tokens of two consecutive ones of a request (``then``'s finish state)."""
    return dataclasses.replace(then, new_token_ids=[*first.new_token_ids, *then.new_token_ids])


class AsyncEngine:
    """Owns one engine on a background thread; ``generate`` streams its outputs to coroutines.

    ``engine_factory`` is called on the engine thread (model loading, CUDA context creation and CUDA graph
    capture all belong to the thread that will later run the steps). ``start()`` returns once the engine is
    loaded, or raises what the factory raised.
    """

    def __init__(self, engine_factory: Callable[[], Any]) -> None:
        self._factory = engine_factory
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready: asyncio.Future[None] | None = None
        self._engine: Any = None
        self._stats = MetricsSnapshot()
        self._error: BaseException | None = None
        self._stopping = False
        self._stop_aborts = 0  # engine-thread only: aborts that were really stop-string finishes
        self.state = "new"  # new -> loading -> ready -> (failed | stopped)

    # ----------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Load the engine on its thread; return when it is ready to take requests."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.state = "loading"
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()
        await self._ready

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after its current step; pending requests fail with EngineDeadError."""
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self.state != "failed":
            self.state = "stopped"

    @property
    def healthy(self) -> bool:
        return self.state == "ready"

    @property
    def engine(self) -> Any:
        """The engine object, for read-only attributes that never change after load (tokenizer, config)."""
        if self._engine is None:
            raise EngineDeadError("the engine is not loaded")
        return self._engine

    @property
    def error(self) -> BaseException | None:
        return self._error

    def metrics(self) -> MetricsSnapshot:
        """The counters as of the last finished step (a snapshot the engine thread publishes)."""
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
        self._commands.put(_Add(request_id, list(prompt_ids), params))
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
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Ask the engine to drop a request (idempotent; unknown ids are ignored by the engine thread).

        ``reason="stop"`` is for a request the server finished itself (a stop string matched): the engine
        counts it as aborted, and the exported ``request_success_total`` moves it to ``stop`` as vLLM does.
        """
        if self._thread is not None and self.state == "ready":
            self._commands.put(_Abort(request_id, reason))

    # ----------------------------------------------------------------------------- loop-side delivery

    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put_nowait(exc)

    def _on_engine_failure(self, exc: BaseException) -> None:
        self.state = "failed"
        self._fail_all(EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}"))

    def _on_ready(self) -> None:
        self.state = "ready"
        assert self._ready is not None
        if not self._ready.done():
            self._ready.set_result(None)

    def _on_load_failure(self, exc: BaseException) -> None:
        self.state = "failed"
        assert self._ready is not None
        if not self._ready.done():
            self._ready.set_exception(exc)

    def _dead_reason(self) -> str:
        if self.state == "failed" and self._error is not None:
            return f"engine failed: {type(self._error).__name__}: {self._error}"
        if self.state == "loading":
            return "the engine is still loading"
        return f"the engine is {self.state}"

    # --------------------------------------------------------------------------------- engine thread

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        assert loop is not None
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call (shutdown race)
                pass

    def _run(self) -> None:
        try:
            self._engine = self._factory()
            self._publish_stats()
        except BaseException as exc:  # noqa: BLE001 -- reported to the awaiting start()
            self._error = exc
            self._call(self._on_load_failure, exc)
            return
        self._call(self._on_ready)
        engine = self._engine
        try:
            while True:
                # Block only when idle: with work in flight we drain whatever commands arrived and step.
                if not engine.has_unfinished_requests():
                    if not self._apply(self._commands.get()):
                        break
                stop = False
                while not stop:
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    stop = not self._apply(cmd)
                if stop:
                    break
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                self._publish_stats()
                if outputs:
                    self._call(self._deliver, list(outputs))
        except BaseException as exc:  # noqa: BLE001 -- any step failure makes the engine unusable
            self._error = exc
            log.exception("engine step failed; the server is now unhealthy")
            self._call(self._on_engine_failure, exc)
            return
        close = getattr(engine, "close", None)
        if close is not None:
            try:
                close()  # flush trace files and the like; the process may be about to exit
            except Exception:  # noqa: BLE001 -- a failing close must not mask a clean shutdown
                log.exception("engine close failed")

    def _apply(self, cmd: _Add | _Abort | _Stop) -> bool:
        """Run one command on the engine thread; False means stop the thread."""
        if isinstance(cmd, _Stop):
            return False
        if isinstance(cmd, _Abort):
            before = self._engine.stats.requests_finished.get("abort", 0)
            try:
                self._engine.abort_request(cmd.request_id)
            except (KeyError, ValueError):
                return True  # already finished: its last output raced with the abort
            if cmd.reason == "stop":
                self._stop_aborts += self._engine.stats.requests_finished.get("abort", 0) - before
            self._publish_stats()
            return True
        try:
            self._engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params)
        except (DsparkError, ValueError, TypeError) as exc:
            # A request the engine refuses (too long, bad parameters) fails alone; the engine is fine.
            self._call(self._deliver_error, cmd.request_id, RequestRejectedError(str(exc)))
        self._publish_stats()
        return True

    def _publish_stats(self) -> None:
        snap = MetricsSnapshot.from_stats(self._engine.stats)
        if self._stop_aborts:
            finished = dict(snap.requests_finished)
            moved = min(self._stop_aborts, finished.get("abort", 0))
            finished["abort"] = finished.get("abort", 0) - moved
            finished["stop"] = finished.get("stop", 0) + moved
            snap = dataclasses.replace(snap, requests_finished=finished)
        self._stats = snap
