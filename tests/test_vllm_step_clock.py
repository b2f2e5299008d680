"""Step timing in the GPU's stream order (engines/vllm/step_clock.py): intervals come back late but whole,
in the order they closed, and on CUDA they hold the work launched between two marks, not the host's wait."""

from __future__ import annotations

import pytest
import torch

from dspark_cli.engines.vllm.step_clock import CudaEventClock, HostClock, StepIntervals, clock_for


class LaggingClock:
    """Marks are integers; a mark is final once ``lag`` later marks have been taken (a GPU a few steps behind
    the host). Elapsed time is what the test wrote down for each mark."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.taken = 0
        self.at: dict[int, float] = {}
        self.now = 0.0

    def mark(self) -> int:
        self.taken += 1
        self.at[self.taken] = self.now
        return self.taken

    def ready(self, mark: int) -> bool:
        return mark <= self.taken - self.lag

    def elapsed_ms(self, start: int, end: int) -> float:
        return (self.at[end] - self.at[start]) * 1e3


def test_intervals_come_back_in_order_once_final() -> None:
    clock = LaggingClock(lag=2)
    intervals: StepIntervals[str] = StepIntervals(clock)
    prev = clock.mark()
    got: list[tuple[float, str]] = []
    for i, ms in enumerate([5.0, 7.0, 11.0, 13.0]):
        clock.now += ms / 1e3
        mark = clock.mark()
        intervals.close(prev, mark, f"step{i}")
        prev = mark
        got += intervals.finished()
        assert intervals.pending <= 2  # never more than the clock's lag behind
    assert [p for _, p in got] == ["step0", "step1"]
    for _ in range(2):  # the GPU passes the last marks
        clock.mark()
    got += intervals.finished()
    assert [p for _, p in got] == ["step0", "step1", "step2", "step3"]
    assert [ms for ms, _ in got] == pytest.approx([5.0, 7.0, 11.0, 13.0])
    assert intervals.pending == 0


def test_an_interval_without_a_mark_is_dropped() -> None:
    """A mark is None while the stream is being captured into a graph; that interval is not timed."""
    intervals: StepIntervals[str] = StepIntervals(HostClock(lambda: 1.0))
    intervals.close(None, 1.0, "captured")
    intervals.close(1.0, None, "captured")
    assert intervals.pending == 0 and intervals.finished() == []


def test_the_host_clock_is_final_at_once_and_cuda_is_not_the_cpu_default() -> None:
    t = [0.0]
    intervals: StepIntervals[int] = StepIntervals(HostClock(lambda: t[0]))
    a = intervals.clock.mark()
    t[0] = 0.25
    intervals.close(a, intervals.clock.mark(), 1)
    assert intervals.finished() == [(pytest.approx(250.0), 1)]
    assert isinstance(clock_for(torch.device("cpu")), HostClock)


def _sleep_cycles_per_ms() -> float:
    """Cycles of ``torch.cuda._sleep`` per ms at the clock the test's kernels will see. The test failed once as the
    first GPU work of a fresh machine (section 37) and passed on the next run: a GPU that idled may run its first
    kernels at another clock than later ones, so a warm-up kernel comes before the calibration."""
    torch.cuda._sleep(50_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_intervals_hold_the_work_launched_between_marks_not_the_hosts_wait() -> None:
    """The host launches three kernels of 2, 8 and 4 ms with a mark after each and runs ahead of the GPU, as
    vLLM's asynchronous scheduling does: its own clock reads ~0 ms between the marks; the events read the
    kernels, each charged to the interval it was launched in."""
    per_ms = _sleep_cycles_per_ms()
    clock = clock_for(torch.device("cuda"))
    assert isinstance(clock, CudaEventClock)
    intervals: StepIntervals[str] = StepIntervals(clock)
    host = HostClock()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2 * per_ms))
    prev, host_prev = clock.mark(), host.mark()
    host_ms = []
    for name, ms in [("a", 8.0), ("b", 4.0)]:
        torch.cuda._sleep(int(ms * per_ms))
        mark, host_mark = clock.mark(), host.mark()
        intervals.close(prev, mark, name)
        host_ms.append(host.elapsed_ms(host_prev, host_mark))
        prev, host_prev = mark, host_mark
    assert intervals.finished() == []  # nothing final yet: the GPU is still in the first kernel
    torch.cuda.synchronize()
    got = intervals.finished()
    assert [p for _, p in got] == ["a", "b"]
    assert got[0][0] == pytest.approx(8.0, rel=0.15) and got[1][0] == pytest.approx(4.0, rel=0.15)
    assert max(host_ms) < 1.0  # the host's clock saw none of it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_cuda_mark_is_taken_inside_a_graph_capture() -> None:
    clock = CudaEventClock(torch.device("cuda"))
    x = torch.zeros(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    marks = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)  # warm up on the side stream, as captures do
        with torch.cuda.graph(graph, stream=stream):
            x.add_(1)
            marks.append(clock.mark())
    torch.cuda.current_stream().wait_stream(stream)
    assert marks == [None]
