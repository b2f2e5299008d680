"""Continuous batching: admit waiting requests as prefill steps, then decode (verify) all running ones.

A step is either a **prefill** of newly admitted requests (their whole prompt, or prompt + generated
tokens after a preemption) or a **decode** step of every running request. Prefill wins when something is
waiting and fits, like nano-vllm: it adds requests to the batch as early as possible. A prefill may be
**mixed** (``schedule(mixed=True)``): the running requests ride along and decode one token each in the same
forward, so newcomers stall nobody (EngineConfig.mixed_prefill; that step does not draft). Optionally, while
requests are decoding, newcomers wait up to ``prefill_delay_ms`` (the engine sets it to
``scheduler_delay_factor`` x the median of recent prefill steps' times, like vLLM's V0 scheduler delay)
unless a full batch of them is waiting. Why: prefills are not chunked into decode steps, so every prefill
step stalls every decoding request, and an eager prefill costs about the same for one prompt as for
sixteen (some 20 ms on an H200 for SmolLM2-135M, four decode steps); arrivals a few milliseconds apart
each paid that stall. Why it is off by default: where arrivals already come in bursts, holding a burst's
late members behind its first ones splits it into two cohorts that stay apart, and the decode steps run
partly empty while they wait (docs/PERFORMANCE.md section 13: on the H200 it merged the spec configs'
prefill steps at 32 requests, 43-53 down to 23-26, and gave no speculation ~100 partly empty steps at 16).

Decode reserves KV for ``K + 1`` lookahead positions per request (the verify pass writes the last token
and K drafts; the draft writes K - 1 more of its own), so a step never runs out of slots halfway. When
the pool cannot cover every running request, the newest running request is preempted (recompute: its
blocks are freed and it goes back to the front of the queue) until the rest fit -- a full pool slows the
engine down, it never crashes it. ``max_num_seqs`` caps the running set; the rest queues.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dspark_cli.engines.embedded.block_manager import BlockManager
from dspark_cli.engines.embedded.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler"]


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)
    # A prefill batch scheduled with ``schedule(mixed=True)``: the running requests that decode one token in
    # the same forward (empty when there are none, or the pool could not give every one its lookahead).
    decode: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, lookahead: int
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead  # extra KV positions a decode step may write beyond the sequence
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefill_delay_ms = 0.0  # newcomers wait this long while others decode (0 = prefill at once)
        # Steps on which the first waiting request had a free slot but the pool lacked its blocks: a server
        # whose KV pool cannot hold its load runs partly empty steps, and a benchmark cell then measures memory
        # (bench.matrix.measurement_notes; docs/PERFORMANCE.md section 43).
        self.kv_wait_steps = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _prefill_tokens(self, seq: Sequence) -> int:
        return seq.num_tokens

    def schedule(self, mixed: bool = False) -> ScheduledBatch | None:
        """The next step's batch. ``mixed``: a prefill batch also carries the requests already running, to
        decode one token each in the prefill's forward (a plain step: it does not draft)."""
        # Mixed, the running requests' tokens share the step's token limit (and the ragged graphs' sizes).
        budget = self.max_num_batched_tokens - (len(self.running) if mixed else 0)
        batch = self._schedule_prefill(max(1, budget))
        if batch is not None:
            # The first prompt is admitted whatever its length: where it leaves no room for the running
            # requests' tokens, it runs alone (they decode next step), not past the limit, outside every graph.
            if mixed and sum(map(self._prefill_tokens, batch.seqs)) <= budget:
                batch.decode = self._decode_alongside(batch.seqs)
            return batch
        return self._schedule_decode()

    def _decode_alongside(self, admitted: list[Sequence]) -> list[Sequence]:
        """The running requests other than ``admitted``, oldest first, each with its decode lookahead in the
        pool -- or none at all where the pool is short: then the prefill runs alone and the decode step after
        it preempts as usual (a mixed step never preempts)."""
        new = {id(seq) for seq in admitted}
        decoding = sorted((seq for seq in self.running if id(seq) not in new), key=lambda s: s.arrival)
        for seq in decoding:
            if not self.blocks.ensure(seq, seq.num_tokens + self.lookahead):
                return []
        return decoding

    def holds_prefill(self, now: float | None = None) -> bool:
        """Whether the waiting requests wait one more step: requests are decoding, fewer newcomers wait than
        there are free slots, and the oldest has waited less than ``prefill_delay_ms``. A preempted request
        keeps its first arrival time, so it is never held."""
        if self.prefill_delay_ms <= 0 or not self.running or not self.waiting:
            return False
        if len(self.waiting) >= self.max_num_seqs - len(self.running):
            return False
        now = time.perf_counter() if now is None else now
        return (now - self.waiting[0].arrival_time) * 1e3 < self.prefill_delay_ms

    def _schedule_prefill(self, max_tokens: int) -> ScheduledBatch | None:
        if self.holds_prefill():
            return None
        scheduled: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._prefill_tokens(seq)
            if scheduled and tokens + n > max_tokens:
                break
            # Admit only with room for the first decode step too, else it would be preempted at once.
            need = self.blocks.blocks_needed(seq, n + self.lookahead)
            if not self.blocks.can_allocate(need):
                self.kv_wait_steps += 1
                break
            self.blocks.ensure(seq, n + self.lookahead)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            scheduled.append(seq)
            tokens += n
        if not scheduled:
            return None
        self.running.extend(scheduled)
        return ScheduledBatch(seqs=scheduled, is_prefill=True)

    def _schedule_decode(self) -> ScheduledBatch | None:
        preempted: list[Sequence] = []
        # Oldest first: they keep their blocks; the newest give theirs up when the pool is short.
        self.running.sort(key=lambda s: s.arrival)
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            while not self.blocks.ensure(seq, seq.num_tokens + self.lookahead):
                victim = self.running.pop() if self.running else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(seq)
        self.running = scheduled
        if not scheduled:
            return ScheduledBatch(seqs=[], is_prefill=False, preempted=preempted) if preempted else None
        return ScheduledBatch(seqs=list(scheduled), is_prefill=False, preempted=preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release a request's blocks at once (finish or abort); it leaves both queues."""
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
