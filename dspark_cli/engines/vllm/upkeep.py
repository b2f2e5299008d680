"""Deferred K/V upkeep of a ``draft_model`` draft while the saturation policy pauses drafting.

Why. vLLM's StandaloneAR speculator (``method: "draft_model"``) runs the draft over every token the target
processed, each step, so that its K/V cache stays complete: its prefill pass. A paused step proposes no
drafts but still paid that pass -- on the H200 (Llama-3-8B shape, 64 requests, docs/PERFORMANCE.md section
15) 0.34 ms of device time behind 1.8 ms of eager launches, which the shorter steps of low load cannot hide;
the "no draft work" ablation ran as fast as plain decoding. So while paused, a pure decode step (one token
per request, no drafts, no prompt chunk) skips the pass and the tokens it would have written are counted as
*pending* per request. One pass over a synthetic batch writes them all once ``budget`` tokens are pending
in the batch, at a step that carries a prompt chunk, or when drafting resumes -- before any draft forward
reads that K/V. At 64 requests and a budget of 2048 that is one pass every 32 paused steps instead of 32
(served on the H200, section 16: 54 catch-ups for 5,186 skipped paused steps over cells of 16, 64 and 256
requests).

Why it is exact. At a step whose batch verifies no drafts every scheduled token is committed: its K/V
entries are the draft's inputs at known positions, and the committed ids are in ``req_states.all_token_ids``.
A request's pending tokens are always the ones right before its current query, so the catch-up row of
request ``i`` is positions ``[start_i - pending_i, start_i]`` (``start_i``: its first query position this
step) -- the same layout the prefill kernel already consumes (accepted tokens, then the correction token),
so the speculator's own ``_prefill`` writes it. At a step that verifies no drafts the rows run on through
each request's query, so the one pass is also the step's own prefill pass (a prompt chunk's row is the
chunk, a decode row ends at its token, and the correction token is what the normal pass would write). Where
drafts are verified, or the rows would not fit the speculator's expanded buffers, the rows end at each
first query position (their correction slot holds a placeholder that the step's own pass, run right after,
overwrites).

What is not caught up: a request that ends before its next catch-up leaves its last pending positions
unwritten in the draft's cache, and so does one that vLLM preempts (it is removed, and its count starts again
when it is re-added: with prefix caching it may then reuse its own blocks, holes included; a KV connector saves
the blocks as they are). Outputs are unaffected (the target verifies every draft); a later request
that reuses those blocks through the prefix cache (a follow-up turn over a paused answer) drafts from an
incomplete draft context until its own tokens overwrite them. By default prompt chunks are never deferred,
so shared prompts are complete.

``defer_prompts`` (``draft_defer_prompts``, off by default, and only without prefix caching): a paused step
that carries a prompt chunk defers it too, so while paused the draft runs only at budgeted catch-ups and on
resume. At 16 requests on the H200 (docs/PERFORMANCE.md section 34) the paused server's loss against no
speculation sat in the steps that ran the draft while paused: ~63 steps with a prompt chunk and 19 catch-ups
per cell. A prompt chunk's row is contiguous with what its request owes, so the same catch-up row writes it;
a request that ends before the next catch-up never pays for its prompt at all. With prefix caching a deferred
prompt's blocks could be reused by a later request before they were written, hence the restriction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


def catchup_budget(wanted: int, max_num_tokens: int, max_num_reqs: int) -> int:
    """The most tokens a batch may owe before a paused step catches up (``draft_catchup_tokens``, capped).

    A catch-up pass of its own runs one row per request, the owed positions and the request's first query
    token, and the speculator's prefill adds a correction slot to each: owed + 2 x requests tokens, which must
    stay within the token budget, where torch.compile's range for the draft ends (a pass past it stops vLLM:
    "Shape: N out of considered ranges", docs/PERFORMANCE.md section 38). Leaving one slot per request, as
    before, let 25 requests owing 225 tokens at a budget of 256 run the draft over 275."""
    return min(wanted, max_num_tokens - 2 * max_num_reqs)


class DraftUpkeep:
    """How many K/V positions the draft owes each request slot, and when to pay them (host only).

    ``budget``: the most tokens pending in one batch before a paused step catches up (and the size bound of
    a catch-up batch, which must fit the speculator's expanded prefill buffers). Slot counters are reset by
    :meth:`reset` when vLLM puts a new request into the slot.
    """

    def __init__(self, max_num_reqs: int, budget: int, defer_prompts: bool = False) -> None:
        if budget <= 0:
            raise ValueError(f"draft upkeep budget must be positive, got {budget}")
        self.budget = budget
        self.defer_prompts = defer_prompts
        self.pending = np.zeros(max_num_reqs, dtype=np.int64)
        self.skipped_steps = 0
        self.catchups = 0
        self.caught_up_tokens = 0
        self.truncated = 0
        self.separate_catchups = 0
        self.deferred_prompt_tokens = 0

    def reset(self, slot: int) -> None:
        self.pending[slot] = 0

    @staticmethod
    def pure_decode(batch: Any) -> bool:
        """One committed token per request: no drafts verified, no prompt chunk (host fields only)."""
        if int(batch.num_draft_tokens or 0) != 0 or bool(batch.has_prefill):
            return False
        return int(batch.num_tokens) == int(batch.num_reqs)

    def owed(self, slots: np.ndarray) -> np.ndarray:
        return self.pending[slots]

    def may_skip(self, slots: np.ndarray) -> bool:
        """Whether a paused pure-decode step over ``slots`` can defer its tokens within the budget."""
        return int(self.pending[slots].sum()) + len(slots) <= self.budget

    def skip(self, slots: np.ndarray, tokens: np.ndarray | int = 1) -> None:
        """The step's draft pass is skipped: each request owes its ``tokens`` (one each: a decode step) more."""
        self.pending[slots] += tokens
        if not isinstance(tokens, int):
            self.deferred_prompt_tokens += int(tokens.sum()) - len(slots)
        self.skipped_steps += 1

    def deferrable(self, batch: Any, slots: np.ndarray) -> np.ndarray | int | None:
        """The tokens each request of a paused step may defer (None: the step runs the draft's pass).

        A pure decode step defers one token per request (``1``); with ``defer_prompts`` a step that carries a
        prompt chunk and verifies no drafts defers each row's whole query. Either within the budget."""
        if self.pure_decode(batch):
            return 1 if self.may_skip(slots) else None
        if not self.defer_prompts or int(batch.num_draft_tokens or 0) != 0:
            return None
        if int(self.pending[slots].sum()) + int(batch.num_tokens) > self.budget:
            return None
        r = len(slots)
        return np.diff(np.asarray(batch.query_start_loc_np[: r + 1], dtype=np.int64))

    def fit(self, owed: np.ndarray) -> np.ndarray:
        """``owed`` scaled down to the budget when it exceeds it (a request absent from the steps that counted
        the others' tokens can, in principle, add its own on return): the oldest positions stay unwritten --
        holes in the draft's context, never in the output -- rather than a batch past its buffers."""
        total = int(owed.sum())
        if total <= self.budget:
            return owed
        self.truncated += 1
        return owed * self.budget // total

    def paid(self, slots: np.ndarray, merged: bool = True) -> None:
        """The owed positions of ``slots`` were written; ``merged``: in the step's own prefill pass (else in
        a pass of their own before it)."""
        self.catchups += 1
        self.separate_catchups += not merged
        self.caught_up_tokens += int(self.pending[slots].sum())
        self.pending[slots] = 0


@dataclasses.dataclass
class CatchupBuffers:
    """Persistent device buffers of the synthetic catch-up batch (allocated once, sliced per use)."""

    input_ids: torch.Tensor  # [max_tokens] int32
    positions: torch.Tensor  # [max_tokens] int64
    query_start_loc: torch.Tensor  # [max_reqs + 1] int32

    @classmethod
    def allocate(cls, max_tokens: int, max_reqs: int, device: torch.device) -> CatchupBuffers:
        return cls(torch.zeros(max_tokens, dtype=torch.int32, device=device),
                   torch.zeros(max_tokens, dtype=torch.int64, device=device),
                   torch.zeros(max_reqs + 1, dtype=torch.int32, device=device))


def catchup_rows(all_token_ids: torch.Tensor, idx_mapping: torch.Tensor, starts: torch.Tensor,
                 owed: np.ndarray, buffers: CatchupBuffers, through: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Fill ``buffers`` with row ``i`` = committed tokens at positions ``[starts[i] - owed[i], starts[i] +
    through[i])`` (``through`` defaults to 1: up to and including the row's first query position).

    ``all_token_ids`` [max_reqs, max_len] (committed ids by slot), ``idx_mapping`` [R] batch row -> slot,
    ``starts`` [R] each row's first query position this step (device), ``owed`` and ``through`` [R] host
    counts. Returns the host ``query_start_loc`` [R + 1] of the rows and their total. No host sync: every size
    comes from the host counts.
    """
    r = len(owed)
    rows = owed.astype(np.int64) + (1 if through is None else through.astype(np.int64))
    qsl_np = np.zeros(r + 1, dtype=np.int32)
    np.cumsum(rows, out=qsl_np[1:])
    total = int(qsl_np[-1])
    if total > buffers.input_ids.shape[0]:
        raise ValueError(f"catch-up batch of {total} tokens exceeds its {buffers.input_ids.shape[0]}-token buffer")
    # Every index but the rows' start positions is known here: one host-to-device copy carries the token ->
    # row map, each token's offset from its row's first query position, and the rows' query starts.
    row_of = np.repeat(np.arange(r, dtype=np.int64), rows)
    back = np.arange(total, dtype=np.int64) - qsl_np[:-1][row_of] - owed.astype(np.int64)[row_of]
    host = torch.from_numpy(np.concatenate([row_of, back, qsl_np.astype(np.int64)]))
    device = starts.device
    both = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    row_of_d = both[:total]
    buffers.query_start_loc[: r + 1].copy_(both[2 * total:])
    pos = buffers.positions[:total]
    torch.add(starts.to(torch.int64)[row_of_d], both[total: 2 * total], out=pos)
    buffers.input_ids[:total].copy_(all_token_ids[idx_mapping.to(torch.int64)[row_of_d], pos])
    return qsl_np, total


def catchup_batch(batch: Any, all_token_ids: torch.Tensor, owed: np.ndarray, buffers: CatchupBuffers,
                  whole_query: bool = False) -> Any:
    """A copy of vLLM's ``InputBatch`` whose queries are the catch-up rows (same requests, same row order).

    ``whole_query`` (a batch that verifies no drafts: every query token is committed): each row runs on
    through the request's query, so one pass is both the catch-up and the step's own prefill pass; else each
    row ends at the request's first query position, and the step's own pass follows. Only what the
    StandaloneAR prefill reads changes: ids, positions, query starts (device and host), the token count, and
    the K/V lengths, which end at each row's last position plus one (unchanged for a whole-query row or a
    pure-decode one). Block tables, slots and sampling state stay the batch's own.
    """
    r = int(batch.num_reqs)
    qsl_np = np.asarray(batch.query_start_loc_np[: r + 1])
    qsl = batch.query_start_loc[: r + 1].to(torch.int64)
    starts = batch.positions[qsl[:-1]]
    query_lens_np = np.diff(qsl_np).astype(np.int64)
    through = query_lens_np if whole_query else np.ones(r, dtype=np.int64)
    rows_qsl_np, total = catchup_rows(all_token_ids, batch.idx_mapping[:r], starts, owed, buffers, through)
    # K/V lengths lose the query tokens past each row's end (none for a whole-query row), computed where each
    # length lives: a host count copied to the device unpinned would wait for the stream.
    seq_lens = batch.seq_lens[:r]
    if not whole_query:
        seq_lens = (seq_lens - (qsl[1:] - qsl[:-1]) + 1).to(batch.seq_lens.dtype)
    # The host's bound is computed tokens plus the scheduled ones (vLLM's upper bound): the row leaves out the
    # scheduled tokens past its end. Not the host query lengths, which under a partial varlen budget spread the
    # drafts evenly over the requests: a request scheduled fewer than its share got a bound below its length.
    upper = batch.seq_lens_cpu_upper_bound
    scheduled = np.asarray(batch.num_scheduled_tokens[:r], dtype=np.int64)
    upper_rows = (upper[:r].to(torch.int64) - torch.from_numpy(scheduled - through)).to(upper.dtype)
    padded_qsl_np = np.full(len(batch.query_start_loc_np), total, dtype=np.int32)
    padded_qsl_np[: r + 1] = rows_qsl_np
    return dataclasses.replace(
        batch,
        input_ids=buffers.input_ids[:total],
        positions=buffers.positions[:total],
        query_start_loc=buffers.query_start_loc[: r + 1],
        query_start_loc_np=padded_qsl_np,
        num_tokens=total,
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=torch.cat([upper_rows, upper[r:]]),
    )


__all__ = ["DraftUpkeep", "CatchupBuffers", "catchup_rows", "catchup_batch"]
