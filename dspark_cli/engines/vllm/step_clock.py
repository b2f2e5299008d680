"""Where the manager reads how long a step took: in the GPU's stream order on CUDA, on the host clock elsewhere.

Why not the host clock on a GPU. vLLM 0.33 schedules asynchronously: the engine core launches step d+1's
target pass while step d still runs, and waits for a step's sampled tokens one step later (the batch queue;
the saturation policy's own outcome copy waits on the step before as well). So the host's interval between
two drafting decisions (``begin_drafting_step``) does not hold the GPU work the later decision shaped -- its
propose and the target pass over the batch it laid out -- but, roughly, the work of the decision before it.
In a run of equal decisions that is the same cost; at every switch it is the other kind's. On the H200
(Llama-3-8B shape, docs/PERFORMANCE.md section 31) the one plain sample among each 64 drafting steps read
2.69x its price at 64 requests -- the curve's price of a drafting step there is 2.72x a plain one -- and
drafting steps read 0.25x what plain ones did, which no step can cost. The warm-up's paused steps at 64-127
requests read 2.69x their price too, and a probe due at a new load fires on its first timed step there: rise
probes at 64 requests were judged at a cost scale of 0.50-0.56 and resumed drafting where it lost. Timed in
stream order (section 32), those paused steps read 0.61x, as the cells' did, every load read drafting at
1.2-2.8x a paused step, and the first probe at 64 requests failed on each server.

A CUDA event recorded on the compute stream at each decision is reached by the GPU after the target pass
launched before it and before anything the decision launches, so two consecutive events bound exactly that
decision's propose and the target pass over the batch it shaped (and any time the GPU waited for the host to
launch them, which is that step's cost too). Events are read only once the GPU has passed them
(``torch.cuda.Event.query``, no sync), so intervals come back a step or two late, in order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

T = TypeVar("T")


class StepClock(Protocol):
    """Takes marks at step boundaries and says when a mark is final and how far apart two are."""

    def mark(self) -> Any: ...

    def ready(self, mark: Any) -> bool: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...


class HostClock:
    """Marks are host timestamps (seconds from ``now``); every mark is final at once."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now

    def mark(self) -> float:
        return self.now()

    def ready(self, mark: float) -> bool:
        return True

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


class CudaEventClock:
    """Marks are CUDA timing events on the device's current stream, final once the GPU has passed them.

    No mark is taken while the stream is being captured into a graph (``mark`` returns None): an event recorded
    in a capture would be replayed with the graph, not read here."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event | None:
        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return bool(mark.query())

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))


def clock_for(device: torch.device) -> StepClock:
    """The clock that times steps on ``device``: stream-ordered events on CUDA, the host clock elsewhere."""
    return CudaEventClock(device) if device.type == "cuda" else HostClock()


@dataclass
class _Pending(Generic[T]):
    start: Any
    end: Any
    payload: T


class StepIntervals(Generic[T]):
    """Intervals between marks, each with what the caller knew when it closed, handed back in the order they
    closed once their end mark is final (``finished``). An interval with a missing mark (taken during a graph
    capture) is dropped."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self._pending: deque[_Pending[T]] = deque()

    def close(self, start: Any, end: Any, payload: T) -> None:
        if start is not None and end is not None:
            self._pending.append(_Pending(start, end, payload))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def finished(self) -> list[tuple[float, T]]:
        """(milliseconds, payload) of every interval whose end the clock has passed, oldest first; a later
        interval never comes back before an earlier one, so the step-time windows see steps in their order."""
        out: list[tuple[float, T]] = []
        while self._pending and self.clock.ready(self._pending[0].end):
            p = self._pending.popleft()
            out.append((self.clock.elapsed_ms(p.start, p.end), p.payload))
        return out
