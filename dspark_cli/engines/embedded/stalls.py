"""What stalls a step beyond its own work: kernel compiles and full garbage collections, counted and timed.

A decode step of a small model takes a few milliseconds, so anything that takes a tenth of a second once in a
while shows up as a tail of inter-token latency and, in a short benchmark cell, as lost throughput -- while
the step's own phases (``EngineStats.phase_ms``) look normal. Two such things happen in a Python serving
process without anyone asking for them:

* **a Triton compile**: a Triton kernel is compiled per *specialisation* (its constexpr arguments, the
  divisibility of integer arguments by 16, the 16-byte alignment of pointers), on first use in the process --
  0.1-1 s from scratch, tens of milliseconds from Triton's disk cache. Start-up warm-ups compile what the
  engine will launch; a compile once serving has begun means a shape or alignment slipped past them, and the
  watch names the kernel, the step kind it stalled and its cost, so the gap is found from one server log.
* **a full (generation 2) garbage collection**: it holds the interpreter lock for its whole run, on
  whichever thread triggered it, so the engine thread waits too.

Triton reports compiles through ``triton.knobs.runtime.jit_cache_hook`` (before) and
``jit_post_compile_hook`` (after): process-wide slots, so the watch keeps whatever hook was installed
before it, calls it, and puts it back on ``close``. Only an in-process cache miss calls them, so a warm
kernel costs nothing.
"""

from __future__ import annotations

import _thread
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dspark.embedded")

__all__ = ["StallCounters", "StallWatch"]

STARTUP = "startup"
SERVING = "serving"


@dataclass
class StallCounters:
    """Cumulative counts and milliseconds, keyed by phase (``startup`` or ``serving``) for compiles."""

    compiles: dict[str, int] = field(default_factory=lambda: {STARTUP: 0, SERVING: 0})
    compile_ms: dict[str, float] = field(default_factory=lambda: {STARTUP: 0.0, SERVING: 0.0})
    compiles_by_step: dict[str, int] = field(default_factory=dict)  # serving compiles per step kind
    full_gcs: int = 0
    full_gc_ms: float = 0.0

    def copy(self) -> StallCounters:
        return StallCounters(dict(self.compiles), dict(self.compile_ms), dict(self.compiles_by_step),
                             self.full_gcs, self.full_gc_ms)


def _triton_runtime_knobs() -> Any | None:
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one older than its knobs (3.4): compiles go uncounted
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_cache_hook") else None


REINTERRUPT_S = 0.05  # how long after a Ctrl-C lost in a GC callback it is delivered again (StallWatch)


class StallWatch:
    """Counts Triton compiles and full collections into :class:`StallCounters` while installed.

    The engine calls :meth:`install` before it compiles or captures anything, :meth:`start_serving` once its
    warm-ups are done, sets :attr:`step_kind` as steps run, and :meth:`close` when it shuts down.
    """

    def __init__(self) -> None:
        self.counters = StallCounters()
        self.step_kind = STARTUP
        self._serving = False
        self._knobs: Any | None = None
        self._prev_pre: Callable[..., Any] | None = None
        self._prev_post: Callable[..., Any] | None = None
        self._compile_start: dict[int, float] = {}  # thread id -> perf_counter at the pre-compile hook
        self._gc_start: float | None = None
        self._prev_unraisable: Callable[[Any], Any] | None = None
        self._installed = False

    @property
    def serving(self) -> bool:
        return self._serving

    def install(self) -> StallWatch:
        if self._installed:
            return self
        self._installed = True
        self._knobs = _triton_runtime_knobs()
        if self._knobs is not None:
            self._prev_pre = self._knobs.jit_cache_hook
            self._prev_post = self._knobs.jit_post_compile_hook
            self._knobs.jit_cache_hook = self._before_compile
            self._knobs.jit_post_compile_hook = self._after_compile
        gc.callbacks.append(self._on_gc)
        self._prev_unraisable = sys.unraisablehook
        sys.unraisablehook = self._on_unraisable
        return self

    def start_serving(self) -> None:
        self._serving = True
        self.step_kind = "idle"

    def close(self) -> None:
        if not self._installed:
            return
        self._installed = False
        if self._knobs is not None:
            # Restore only our own slot: a hook installed after ours keeps working (it chains to ours, which
            # now just forwards to the one before it). A bound method is a new object at every access, so
            # "is ours" is ==, not is.
            if self._knobs.jit_cache_hook == self._before_compile:
                self._knobs.jit_cache_hook = self._prev_pre
            if self._knobs.jit_post_compile_hook == self._after_compile:
                self._knobs.jit_post_compile_hook = self._prev_post
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if sys.unraisablehook == self._on_unraisable and self._prev_unraisable is not None:
            sys.unraisablehook = self._prev_unraisable

    # ------------------------------------------------------------------------------------------ hooks

    def _before_compile(self, **kwargs: Any) -> Any:
        # Triton skips the compile when this hook returns True: only an earlier hook may decide that.
        if self._installed:
            self._compile_start[threading.get_ident()] = time.perf_counter()
        return self._prev_pre(**kwargs) if self._prev_pre is not None else None

    def _after_compile(self, **kwargs: Any) -> Any:
        start = self._compile_start.pop(threading.get_ident(), None)
        if self._installed and start is not None:
            ms = (time.perf_counter() - start) * 1e3
            self._record_compile(_kernel_name(kwargs), ms, str(kwargs.get("repr", "")))
        return self._prev_post(**kwargs) if self._prev_post is not None else None

    def _record_compile(self, kernel: str, ms: float, detail: str) -> None:
        phase = SERVING if self._serving else STARTUP
        c = self.counters
        c.compiles[phase] += 1
        c.compile_ms[phase] += ms
        if self._serving:
            c.compiles_by_step[self.step_kind] = c.compiles_by_step.get(self.step_kind, 0) + 1
            log.warning("Triton compiled %s while serving (a %s step waited %.0f ms); a start-up warm-up missed "
                        "this specialisation: %s", kernel, self.step_kind, ms, detail[:400])

    def _on_unraisable(self, unraisable: Any) -> None:
        # A Ctrl-C that lands while a GC callback runs (ours runs on every collection) is raised inside the
        # callback, where Python can only report it as unraisable and go on: the interrupt would be lost and a
        # profile would run to its end. Delivered again, it interrupts the code that triggered the collection:
        # a moment later, from another thread, since the main thread would take it at once, here, where it is
        # unraisable again (should it land in a callback again, this hook sends it once more).
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            timer = threading.Timer(REINTERRUPT_S, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
            return
        prev = self._prev_unraisable or sys.__unraisablehook__
        prev(unraisable)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif phase == "stop" and self._gc_start is not None:
            self.counters.full_gcs += 1
            self.counters.full_gc_ms += (time.perf_counter() - self._gc_start) * 1e3
            self._gc_start = None


def _kernel_name(kwargs: dict[str, Any]) -> str:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None)
    module = getattr(fn, "module", None)
    if name:
        return f"{module}.{name}" if module else str(name)
    return str(kwargs.get("repr", "a kernel")).split("[", 1)[0]
