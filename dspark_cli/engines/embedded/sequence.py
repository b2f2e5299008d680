"""A request's life inside the engine: its tokens, its KV bookkeeping and its sampling parameters.

Two KV frontiers are tracked separately because the target and the draft fall behind in different ways:

* ``num_computed_tokens`` -- target KV is valid for tokens ``[0, num_computed_tokens)``. After a verify
  step it is ``old_len + num_accepted``: the last token and the accepted drafts were written, rejected
  drafts' KV lies beyond the frontier and is overwritten later.
* ``num_draft_computed`` -- the same for the draft's KV. The draft never sees its own last proposal nor
  the bonus token, and it falls behind entirely while drafting is paused, so the next proposal first
  feeds the catch-up tokens ``token_ids[num_draft_computed:]``.

The last token (the one most recently sampled) never has KV: it is what the next step feeds.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from dspark_cli.errors import DsparkError

__all__ = ["SamplingParams", "Sequence", "SequenceStatus"]

# core.rejection.SAMPLING_EPS, spelled out so the HTTP front, which builds SamplingParams, imports no torch
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < SAMPLING_EPS:
            self.temperature = 0.0  # greedy, as vLLM reads it; the samplers would overflow dividing by it

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise DsparkError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise DsparkError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise DsparkError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 63:
            raise DsparkError(f"seed must fit in 64 bits (signed), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Mutable per-request state; owned by the scheduler, read by the model runner."""

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival  # admission order; preemption evicts the newest (largest) first
        self.arrival_time = time.perf_counter()  # when it was queued (the scheduler's prefill delay)
        # Seeded requests read their own counter-based stream (seeded.py): draws taken so far.
        self.rng_offset = 0
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_draft_computed = 0
        self.num_verify_steps = 0  # trace step index
        self.num_preemptions = 0
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: all KV is dropped; prompt + generated tokens are prefilled again."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_draft_computed = 0
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
