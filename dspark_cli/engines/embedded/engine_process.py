"""The embedded engine in a process of its own: ``dspark serve --engine-process``.

Why a process: with the engine on a thread of the server process (:class:`AsyncEngine`), the HTTP loop and
the engine share one interpreter lock. Measured on an H200 host at 256 concurrent streaming requests, a
decode step took 5.2 ms in the engine alone but 11-17 ms when served, and all of the excess was host time:
the loop's per-token work (detokenizing, SSE chunks, socket writes) holds the lock while the engine thread
waits for it, and every torch call of a step releases and re-takes it. vLLM runs its engine core in a
separate process for the same reason. Here the engine gets an interpreter of its own; the server process
keeps the HTTP loop, the tokenizer and the request streams, and the two meet at two pipes.

How messages flow:

- server -> engine: the front's commands (add, abort, stop; small dataclasses), sent from the event loop.
  The engine process blocks on that pipe while it is idle; with work in flight it drains what arrived
  without blocking and steps.
- engine -> server: ONE message per step, ``("step", outputs, snapshot)`` -- the step's ``RequestOutput``
  list and the counters as of its end, so ``/metrics`` read after a request's last token counts it -- and a
  ``("stats", snapshot)`` after commands that change the counters. A reader thread in the server process
  blocks on the pipe and hands each message to the loop in one ``call_soon_threadsafe``.

Failure: a request ``add_request`` refuses fails alone (:class:`RequestRejectedError`); an exception in a
step is reported and the engine process exits, and every pending request fails with
:class:`EngineDeadError` (``healthy`` turns False, ``/health`` says why). An engine process that dies
without a word (killed, out of memory) is seen as the end of its pipe and handled the same way.

Shutdown: the server sends stop; the engine process finishes its step, closes the engine (flushing
traces) and exits; after a timeout it is terminated, then killed. One still loading is terminated at once.
The engine process ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and the server
process alone decides the order (stop taking requests, stop the engine, close the listeners). If the server process dies, the engine process
sees the end of its command pipe and stops as on shutdown.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import multiprocessing
import pickle
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dspark_cli.engines.embedded.async_engine import (
    Command,
    EngineDeadError,
    EngineDriver,
    EngineFront,
    EngineStoppingError,
    RequestRejectedError,
    _Stop,
    engine_max_model_len,
)
from dspark_cli.engines.embedded.metrics import MetricsSnapshot
from dspark_cli.errors import DsparkError

try:
    import fcntl
except ImportError:  # not on Windows: pipes keep their default size
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("dspark.serve")


class EngineProcessError(RuntimeError):
    """An exception raised in the engine process, relayed as its type name and message."""

    def __init__(self, message: str, type_name: str) -> None:
        super().__init__(message)
        self.type_name = type_name


@dataclass(frozen=True)
class EngineInfo:
    """The engine's read-only attributes the server uses, as the engine process reported them at load."""

    tokenizer: Any
    max_model_len: int | None
    vocab_size: int | None
    num_spec: int | None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -------------------------------------------------------------------------------------- engine process


class _ServerGone(Exception):
    """The server process closed its end of the output pipe."""


class _PipeSink:
    """EngineSink of the engine process: every report is one message on the output pipe."""

    def __init__(self, events: Connection) -> None:
        self._events = events

    def send(self, message: tuple[Any, ...]) -> None:
        try:
            self._events.send(message)
        except OSError as exc:  # BrokenPipeError and the like: nobody is reading any more
            raise _ServerGone() from exc

    def counters(self, snapshot: MetricsSnapshot) -> None:
        self.send(("stats", snapshot))

    def rejected(self, request_id: str, message: str) -> None:
        self.send(("rejected", request_id, message))

    def stepped(self, outputs: list[Any], snapshot: MetricsSnapshot) -> None:
        self.send(("step", outputs, snapshot))


def _next_command(commands: Connection, block: bool) -> Command | None:
    try:
        if not block and not commands.poll():
            return None
        return commands.recv()
    except (EOFError, OSError):
        return _Stop()  # the server process is gone: stop as on shutdown (close the engine, exit)


def _tokenizer_source(engine: Any) -> Any:
    """A directory the server process loads the engine's tokenizer from (as ``engine._load_tokenizer`` did),
    or the tokenizer object itself when it was not loaded from one (built in memory: tools, tests)."""
    tokenizer = getattr(engine, "tokenizer", None)
    path = getattr(tokenizer, "name_or_path", None)
    if isinstance(path, str) and path and Path(path).is_dir():
        return Path(path)
    return tokenizer


def _configure_logging(level: int, fmt: str | None) -> None:
    logging.basicConfig(level=level, format=fmt or logging.BASIC_FORMAT)


def _engine_main(factory: Callable[[], Any], commands: Connection, events: Connection,
                 log_level: int, log_format: str | None) -> None:
    """The engine process: load, report, then serve commands and step until stop."""
    # Ctrl-C in a terminal signals the whole process group; the server process orders the shutdown. Usually
    # SIGINT is ignored already (inherited, see _born_ignoring_sigint); not when started off the main thread.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _configure_logging(log_level, log_format)
    sink = _PipeSink(events)
    try:
        engine = factory()
        driver = EngineDriver(engine, sink)
        info = EngineInfo(None, engine_max_model_len(engine), _int_or_none(getattr(engine, "vocab_size", None)),
                          _int_or_none(getattr(engine, "num_spec", None)))
        ready = ("ready", info, _tokenizer_source(engine), driver.snapshot())
    except BaseException as exc:  # noqa: BLE001 -- reported to the server, which raises it from start()
        log.debug("engine load failed", exc_info=True)
        with contextlib.suppress(OSError):
            events.send(("load_failed", type(exc).__name__, str(exc), isinstance(exc, DsparkError)))
        return
    try:
        try:
            sink.send(ready)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            sink.send(("load_failed", type(exc).__name__,
                       f"the engine's tokenizer cannot be sent to the server process ({exc})", False))
            return
        driver.run(lambda block: _next_command(commands, block))
    except _ServerGone:
        log.warning("the server process went away; stopping the engine")
    except BaseException as exc:  # noqa: BLE001 -- any step failure makes the engine unusable
        log.exception("engine step failed; the server is now unhealthy")
        with contextlib.suppress(OSError):
            events.send(("failed", type(exc).__name__, str(exc)))
    finally:
        driver.close()


# -------------------------------------------------------------------------------------- server process


@contextlib.contextmanager
def _born_ignoring_sigint() -> Iterator[None]:
    """Start the engine process with SIGINT ignored from its first instruction: an ignored signal stays
    ignored across exec, and Python keeps it so, so a Ctrl-C during the engine process's interpreter
    start-up and imports (a second or more, before ``_engine_main`` runs) cannot interrupt it there.

    This process ignores SIGINT only for the few milliseconds of the fork and exec, with SIGINT blocked
    meanwhile: on Linux a blocked signal is never discarded as ignored, so one that arrives stays pending
    and reaches the restored handler. Only the main thread can change handlers; elsewhere the engine
    process ignores SIGINT from ``_engine_main`` on."""
    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or old is None \
            or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# A step's message at 256 requests is some 20-30 KB, and the default 64 KiB pipe holds only two or three:
# were the server's reader late for a moment, the engine would block on its write and lose steps (and the
# loop would block sending a burst of new requests with long prompts). 1 MiB is Linux's default ceiling
# for an unprivileged process.
_PIPE_BYTES = 1 << 20


def _widen_pipe(conn: Connection) -> None:
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if set_size is not None:
        with contextlib.suppress(OSError):  # over /proc/sys/fs/pipe-max-size: keep the default
            fcntl.fcntl(conn.fileno(), set_size, _PIPE_BYTES)


def _logging_setup() -> tuple[int, str | None]:
    """This process's root log level and format, for the engine process (spawn does not inherit them)."""
    root = logging.getLogger()
    fmt = next((getattr(h.formatter, "_fmt", None) for h in root.handlers if h.formatter is not None), None)
    return root.level, fmt


def _exit_description(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessEngine(EngineFront):
    """Owns one engine in a child process; the same interface as :class:`AsyncEngine` for the server.

    ``engine_factory`` must pickle (a module-level function, a ``functools.partial`` of one, or a bound
    method of a picklable object such as ``serve_config.EmbeddedLaunch.engine_factory``): it is sent to
    the engine process, started with the ``spawn`` method (safe with CUDA), and called there. ``engine``
    is an :class:`EngineInfo`: the engine's read-only attributes, with the tokenizer loaded in this
    process.
    """

    def __init__(self, engine_factory: Callable[[], Any]) -> None:
        super().__init__()
        self._factory = engine_factory
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._commands: Connection | None = None
        self._events: Connection | None = None
        self._reader: threading.Thread | None = None
        self._info: EngineInfo | None = None

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before ``start``)."""
        return self._proc.pid if self._proc is not None else None

    def runs_in(self) -> str:
        return f"its own process (pid {self.pid})"

    @property
    def engine(self) -> EngineInfo:
        if self._info is None:
            raise EngineDeadError("the engine is not loaded")
        return self._info

    # ----------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the engine process; return when its engine is loaded and the tokenizer is loaded here."""
        ready = self._begin_start()
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        evt_recv, evt_send = ctx.Pipe(duplex=False)
        for conn in (cmd_send, evt_send):
            _widen_pipe(conn)
        # Not a daemon, so that the engine may start processes of its own; the exit hook registered below
        # stands in for a daemon's terminate-at-exit.
        proc = ctx.Process(target=_engine_main, name="dspark-engine",
                           args=(self._factory, cmd_recv, evt_send, *_logging_setup()))
        try:
            with _born_ignoring_sigint():
                proc.start()  # pickles the factory: an unpicklable one fails here
        except BaseException as exc:
            for conn in (cmd_send, evt_recv):
                conn.close()
            self._error = exc
            self.state = "failed"
            raise
        finally:
            # This process keeps only its own ends, so the engine process's exit reads as end-of-file.
            cmd_recv.close()
            evt_send.close()
        self._proc, self._commands, self._events = proc, cmd_send, evt_recv
        atexit.register(self._terminate_at_exit)
        self._reader = threading.Thread(target=self._read, name="dspark-engine-reader", daemon=True)
        self._reader.start()
        await ready

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine process after its current step (terminate it after ``timeout_s``); pending
        requests fail with EngineDeadError. The process is gone when this returns."""
        if self._proc is None:
            return
        self._stopping = True
        # A loading engine has nothing to flush and would only read its stop once loaded: end it now.
        graceful = self.state != "loading"
        if graceful:
            self._submit(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._stop_process,
                                                         timeout_s if graceful else 0.0)
        # Closed here, on the loop, where the commands are sent from (never under a send in progress).
        for conn in (self._commands, self._events):
            if conn is not None:
                conn.close()
        atexit.unregister(self._terminate_at_exit)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineDeadError("the server shut down while the engine was loading"))
        self._fail_all(EngineStoppingError("the server is shutting down"))
        if self.state != "failed":
            self.state = "stopped"

    def _stop_process(self, timeout_s: float) -> None:
        """Wait for the engine process to exit, escalating to SIGTERM and SIGKILL.

        The reader thread is what reaps the process (one waiter, so its exit status is never lost to a
        race); the process has exited once the reader has ended."""
        proc, reader = self._proc, self._reader
        assert proc is not None and reader is not None
        reader.join(timeout_s)
        if reader.is_alive():
            if timeout_s > 0:
                log.warning("the engine process did not stop within %.0f s; terminating it", timeout_s)
            proc.terminate()
            reader.join(5.0)
        if reader.is_alive():
            proc.kill()
            reader.join()
        if proc.exitcode is None:  # the reader died early (a bug): never leave the process behind
            proc.kill()
            proc.join()

    def _terminate_at_exit(self) -> None:
        """Interpreter exit without ``shutdown`` (a crash, a forgotten front): no engine process survives it.
        Registered after multiprocessing's own exit hook, so it runs first (that one joins the child)."""
        proc = self._proc
        if proc is not None and proc.exitcode is None:
            proc.terminate()
            proc.join(5.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join()

    def _submit(self, cmd: Command) -> None:
        assert self._commands is not None
        try:
            self._commands.send(cmd)
        except OSError:
            pass  # the engine process is gone; the reader sees its pipe end and fails every request

    # ------------------------------------------------------------------------------------- reader thread

    def _read(self) -> None:
        """Block on the engine process's pipe; hand each message to the loop in one call."""
        events = self._events
        assert events is not None
        handlers: dict[str, Callable[..., None]] = {
            "step": self._on_step, "stats": self._on_counters, "rejected": self._on_rejected,
            "failed": self._on_failed, "load_failed": self._on_load_failed,
        }
        lost = False
        while True:
            try:
                kind, *args = events.recv()
            except (EOFError, OSError):
                break  # the engine process exited (or is exiting: its pipe closes on the way out)
            except Exception:  # noqa: BLE001 -- a message this process cannot read: the stream is lost
                log.exception("unreadable message from the engine process")
                lost = True
                break
            if kind == "ready":
                self._loaded(*args)
            elif kind in handlers:
                self._call(handlers[kind], *args)
            else:
                log.error("unknown message %r from the engine process", kind)
                lost = True
                break
        proc = self._proc
        assert proc is not None
        if lost:
            proc.kill()  # out of step with this process: nothing it sends can be trusted any more
        proc.join()
        self._call(self._on_engine_gone)

    def _loaded(self, info: EngineInfo, tokenizer_source: Any, snapshot: MetricsSnapshot) -> None:
        """Load the tokenizer here (on the reader thread: the loop keeps answering /health), then go ready."""
        if isinstance(tokenizer_source, Path):
            from dspark_cli.engines.embedded.engine import _load_tokenizer

            try:
                tokenizer = _load_tokenizer(tokenizer_source)
            except BaseException as exc:  # noqa: BLE001 -- reported to the awaiting start()
                self._call(self._on_load_failure, exc)
                return
        else:
            tokenizer = tokenizer_source
        self._call(self._on_loaded, dataclasses.replace(info, tokenizer=tokenizer), snapshot)

    # ------------------------------------------------------------------------------- on the event loop

    def _on_loaded(self, info: EngineInfo, snapshot: MetricsSnapshot) -> None:
        if self._stopping or self.state != "loading":
            return  # shut down (or failed) while the tokenizer loaded
        self._info = info
        self._stats = snapshot
        self._on_ready()

    def _on_step(self, outputs: list[Any], snapshot: MetricsSnapshot) -> None:
        self._stats = snapshot
        if outputs:
            self._deliver(outputs)

    def _on_counters(self, snapshot: MetricsSnapshot) -> None:
        self._stats = snapshot

    def _on_rejected(self, request_id: str, message: str) -> None:
        self._deliver_error(request_id, RequestRejectedError(message))

    def _on_failed(self, type_name: str, message: str) -> None:
        self._on_engine_failure(EngineProcessError(message, type_name))

    def _on_load_failed(self, type_name: str, message: str, user_error: bool) -> None:
        # A DsparkError is the user's to fix and reads as one line, exactly as on the thread front.
        self._on_load_failure(DsparkError(message) if user_error else EngineProcessError(message, type_name))

    def _on_engine_gone(self) -> None:
        if self._stopping or self.state in ("failed", "stopped"):
            return
        code = self._proc.exitcode if self._proc is not None else None
        exc = EngineDeadError(f"the engine process exited unexpectedly ({_exit_description(code)})")
        log.error("%s; the server is now unhealthy", exc)  # as the thread front logs a failed step
        if self.state == "loading":
            self._on_load_failure(exc)
        else:
            self._on_engine_failure(exc)
