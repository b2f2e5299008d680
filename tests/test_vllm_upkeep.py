"""Deferred draft K/V upkeep (engines.vllm.upkeep): the draft never drafts from an incomplete context.

A stand-in of vLLM 0.33's StandaloneAR speculator keeps a draft "K/V cache" of token ids per request slot and
writes it exactly as the speculator's prefill kernel lays out a row (accepted tokens, the correction token,
rejected slots) and its decode passes do. A stand-in runner drives it through prompts, drafting steps with
random acceptance, pauses, resumes and finishing requests, and every drafting propose asserts that the draft's
context up to the position it drafts from holds the committed tokens -- what a real draft attends to.
"""

from __future__ import annotations

import dataclasses
import random
import types
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_cli.engines.vllm.manager import SPECULATOR_MANAGER_ATTR, install_speculator_hooks
from dspark_cli.engines.vllm.upkeep import CatchupBuffers, DraftUpkeep, catchup_budget, catchup_rows

K = 3
MAX_REQS = 6
MAX_LEN = 400


@dataclasses.dataclass
class Batch:  # the InputBatch fields the StandaloneAR prefill and the upkeep read
    num_reqs: int
    idx_mapping: torch.Tensor
    idx_mapping_np: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_np: np.ndarray
    num_tokens: int
    seq_lens: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor
    num_draft_tokens: int
    has_prefill: bool
    num_scheduled_tokens: np.ndarray  # uncompacted: what seq_lens_cpu_upper_bound adds to the computed tokens


class Speculator:
    """StandaloneAR's prefill/decode K/V writes, over token ids instead of K/V vectors."""

    def __init__(self, committed: torch.Tensor, max_num_tokens: int) -> None:
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, MAX_REQS
        self.committed = committed
        self.kv = torch.full((MAX_REQS, MAX_LEN + K + 2), -1, dtype=torch.int64)
        self.draft_tokens = torch.zeros(MAX_REQS, K, dtype=torch.int64)
        self.prefill_tokens = 0  # tokens run through the draft (prefill rows, catch-ups included)
        # torch.compile's range for the draft's passes ends at the token budget (vLLM's _set_compile_ranges): a
        # test that schedules no step past it sets this, and a pass over more tokens stops vLLM (section 38)
        self.compile_range_end: int | None = None
        self.drafting_reads = 0
        self._last: list[tuple[int, int]] = []

    def _prefill(self, batch: Batch, num_rejected: torch.Tensor, last_sampled: torch.Tensor, num_reqs: int,
                 skip_attn: bool, num_tokens_across_dp: Any) -> None:
        qsl = batch.query_start_loc.tolist()
        assert list(batch.query_start_loc_np[: num_reqs + 1]) == qsl[: num_reqs + 1]  # host and device agree
        if self.compile_range_end is not None:  # prepare_prefill_inputs: the batch's tokens plus one per request
            assert int(batch.num_tokens) + num_reqs <= self.compile_range_end, (
                f"Shape: {int(batch.num_tokens) + num_reqs} out of considered ranges: [(1, {self.compile_range_end})]")
        self._last = []
        for i in range(num_reqs):
            slot = int(batch.idx_mapping[i])
            n = qsl[i + 1] - qsl[i]
            start = int(batch.positions[qsl[i]])
            assert batch.positions[qsl[i]: qsl[i + 1]].tolist() == list(range(start, start + n))
            # seq_lens: K/V length after this row's tokens, which the kernel extends by the correction slot
            assert int(batch.seq_lens[i]) == start + n
            assert int(batch.seq_lens_cpu_upper_bound[i]) >= start + n
            valid = n - int(num_rejected[i])
            row = batch.input_ids[qsl[i]: qsl[i] + valid].tolist() + [int(last_sampled[slot, 0])]
            row += [0] * (n - valid)  # rejected slots: temporary entries, rewritten later
            self.kv[slot, start: start + n + 1] = torch.tensor(row)
            self._last.append((slot, start + valid))  # the correction token's position: drafting starts there
            self.prefill_tokens += n + 1
        self.draft_tokens[:num_reqs, 0] = self.sample_draft(torch.zeros(num_reqs, 2))

    def sample_draft(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.randint(0, 50, (hidden_states.shape[0],))

    def _multi_step_decode(self, batch: Batch, num_rejected: torch.Tensor, num_reqs: int, skip_attn: bool,
                           num_tokens_across_dp: Any) -> None:
        for i, (slot, pos) in enumerate(self._last):
            # The first draft reads the context up to its correction token: it must be the committed one.
            assert self.kv[slot, : pos + 1].tolist() == self.committed[slot, : pos + 1].tolist(), (
                f"slot {slot}: the draft drafts from an incomplete context")
            self.drafting_reads += 1
            for step in range(1, K):
                self.kv[slot, pos + step] = self.draft_tokens[i, step - 1]  # speculative entries
                self.draft_tokens[i, step] = random.randrange(50)

    def propose(self, batch: Batch, attn_metadata: Any, slot_mappings: Any, hidden: Any, aux: Any,
                num_sampled: torch.Tensor, num_rejected: torch.Tensor, last_sampled: torch.Tensor,
                next_prefill_tokens: Any, temperature: Any, seeds: Any, *, num_speculative_tokens: int,
                dp_sync_state: Any = None, dummy_run: bool = False) -> torch.Tensor:
        self._prefill(batch, num_rejected, last_sampled, batch.num_reqs, False, None)
        self._multi_step_decode(batch, num_rejected, batch.num_reqs, False, None)
        return self.draft_tokens[: batch.num_reqs]


@dataclasses.dataclass
class Request:
    slot: int
    prompt: list[int]
    budget: int  # tokens to generate before it ends
    computed: int = 0  # positions with target K/V
    drafts: list[int] = dataclasses.field(default_factory=list)


class Runner:
    """vLLM's step order: target over the batch, commit, ``propose`` (drafts for the next step or none)."""

    def __init__(self, upkeep_budget: int | None, max_num_tokens: int, rng: random.Random,
                 defer_prompts: bool = False) -> None:
        self.rng = rng
        self.committed = torch.full((MAX_REQS, MAX_LEN + K + 2), -7, dtype=torch.int32)
        self.lengths = [0] * MAX_REQS
        self.last_sampled = torch.zeros(MAX_REQS, 1, dtype=torch.int64)
        self.spec = Speculator(self.committed, max_num_tokens)
        upkeep = DraftUpkeep(MAX_REQS, upkeep_budget, defer_prompts) if upkeep_budget else None
        self.manager = types.SimpleNamespace(
            _pause_supported=True, _skip_decode=False, _upkeep=upkeep,
            _catchup_buffers=CatchupBuffers.allocate((upkeep_budget or 0) + max_num_tokens, MAX_REQS,
                                                     torch.device("cpu")),
            _no_rejections=torch.zeros(MAX_REQS, dtype=torch.int32),
            req_states=types.SimpleNamespace(all_token_ids=types.SimpleNamespace(gpu=self.committed)),
            calibrate_in_graph=lambda c: c, verified_rejections=lambda s, r: r, observe=lambda s: None)
        setattr(self.spec, SPECULATOR_MANAGER_ATTR, self.manager)
        install_speculator_hooks(self.spec, calibrate=False, skip_decode=True)
        self.running: list[Request] = []
        self.free = list(range(MAX_REQS))

    def commit(self, slot: int, tokens: list[int]) -> None:
        n = self.lengths[slot]
        self.committed[slot, n: n + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        self.lengths[slot] = n + len(tokens)

    def add(self) -> None:
        slot = self.free.pop(self.rng.randrange(len(self.free)))
        self.lengths[slot] = 0
        self.spec.kv[slot] = -1 if self.rng.random() < 0.5 else 3  # a reused slot: stale entries either way
        prompt = [self.rng.randrange(50) for _ in range(self.rng.randint(1, 12))]
        self.commit(slot, prompt)
        if self.manager._upkeep is not None:
            self.manager._upkeep.reset(slot)  # what the manager's add_request does
        self.running.append(Request(slot, prompt, self.rng.randint(3, 40)))

    def step(self, draft_next: bool) -> None:
        ids, pos, qlens, drafts_in = [], [], [], 0
        prefill = False
        for req in self.running:
            if req.computed < len(req.prompt):
                toks = req.prompt[req.computed:]
                prefill = True
            else:
                toks = [int(self.committed[req.slot, req.computed])] + req.drafts
                drafts_in += len(req.drafts)
            ids += toks
            pos += list(range(req.computed, req.computed + len(toks)))
            qlens.append(len(toks))
        r = len(self.running)
        qsl = np.zeros(MAX_REQS + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1: r + 1])
        qsl[r + 1:] = qsl[r]
        slots = np.array([q.slot for q in self.running], dtype=np.int64)
        seq = torch.tensor([q.computed + n for q, n in zip(self.running, qlens, strict=True)], dtype=torch.int32)
        slack = self.rng.randint(0, 2)  # a host bound above the lengths, as async scheduling's is
        batch = Batch(r, torch.from_numpy(slots), slots, torch.tensor(ids, dtype=torch.int32),
                      torch.tensor(pos, dtype=torch.int64), torch.from_numpy(qsl.copy()), qsl, len(ids), seq,
                      seq + slack, drafts_in, prefill, np.array(qlens, dtype=np.int32) + slack)
        # the target: accept a prefix of each request's drafts, commit it and one token more
        rejected = torch.zeros(r, dtype=torch.int32)
        for i, req in enumerate(self.running):
            accepted = req.drafts[: self.rng.randint(0, len(req.drafts))]
            rejected[i] = len(req.drafts) - len(accepted)
            bonus = self.rng.randrange(50)
            req.computed += qlens[i] - int(rejected[i])
            self.commit(req.slot, [*accepted, bonus])
            self.last_sampled[req.slot, 0] = bonus
            req.budget -= len(accepted) + 1
        drafts = self.spec.propose(batch, None, None, None, None, None, rejected, self.last_sampled, None,
                                   None, None, num_speculative_tokens=K if draft_next else 0)
        for i, req in enumerate(self.running):
            req.drafts = drafts[i].tolist() if draft_next else []
        for req in [q for q in self.running if q.budget <= 0]:
            self.running.remove(req)
            self.free.append(req.slot)


def drive(runner: Runner, rng: random.Random, steps: int) -> None:
    drafting = True
    for _ in range(steps):
        if runner.free and (not runner.running or rng.random() < 0.15):
            runner.add()
        if rng.random() < 0.2:
            drafting = not drafting  # pauses and resumes in runs
        runner.step(drafting)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.sampled_from([6, 9, 16, 64]), defer_prompts=st.booleans())
def test_a_resumed_draft_always_drafts_from_its_committed_context(seed: int, budget: int,
                                                                  defer_prompts: bool) -> None:
    rng = random.Random(seed)
    runner = Runner(budget, max_num_tokens=budget + 2 * MAX_REQS, rng=rng, defer_prompts=defer_prompts)
    drive(runner, rng, 120)
    assert runner.spec.drafting_reads > 0


def test_deferred_prompts_are_written_by_the_catch_up_and_never_for_requests_that_end_paused() -> None:
    """draft_defer_prompts: a paused step with a prompt chunk runs no draft pass; the prompt is owed like
    decoded tokens, written by the catch-up before the request drafts, and never written for a request that
    ends while paused. Without it the same steps run the draft over every prompt."""
    passes = {}
    for defer in (False, True):
        rng = random.Random(21)
        runner = Runner(200, 200 + 2 * MAX_REQS, rng, defer_prompts=defer)
        for _ in range(2):
            runner.add()
        runner.step(True)
        runner.step(False)  # paused from here
        for req in runner.running:
            req.budget = 10_000
        before = runner.spec.prefill_tokens
        for _ in range(3):  # newcomers while paused; two of them end before drafting resumes
            runner.add()
        runner.step(False)
        for req in runner.running[2:4]:
            req.budget = 0
        runner.step(False)
        upkeep = runner.manager._upkeep
        if defer:
            assert runner.spec.prefill_tokens == before  # no draft pass while paused
            assert upkeep.deferred_prompt_tokens > 0
        for _ in range(2):
            runner.step(True)  # resume: the catch-up writes the owed prompts, then the draft drafts from them
        assert runner.spec.drafting_reads > 0
        passes[defer] = runner.spec.prefill_tokens - before
    assert passes[True] < passes[False]


def test_catch_ups_ride_the_steps_own_prefill_pass_where_they_fit() -> None:
    """A paused step that carries a prompt chunk catches up in its own prefill pass; where the rows would not
    fit the speculator's expanded buffers (a small max_num_batched_tokens), in a pass of their own first."""
    for budget, max_num_tokens, separate in ((8, 256, False), (4, 4 + MAX_REQS, True)):
        rng = random.Random(11)
        runner = Runner(budget, max_num_tokens, rng)
        drive(runner, rng, 200)
        upkeep = runner.manager._upkeep
        assert upkeep.catchups > 0 and upkeep.skipped_steps > 0
        assert (upkeep.separate_catchups > 0) is separate, (max_num_tokens, upkeep.separate_catchups)


def test_a_catch_up_never_runs_the_draft_past_the_token_budget() -> None:
    """torch.compile's range for the draft's passes ends at the token budget, and a pass past it stops vLLM
    mid-serving as its start-up profile stopped the lossless check at 257 (docs/PERFORMANCE.md section 38). With
    the check's 256 tokens and 25 requests, a catch-up budget of 256 - 25 let 25 paused requests owing 225
    tokens catch up over 225 + 25 + 25 = 275, and a catch-up rode a step's own pass wherever the speculator's
    buffers (the budget plus a slot per request) held it, a prompt chunk included. Here: 6 slots, a budget of 40
    tokens; five requests decode paused, then a sixth arrives with a prompt of 14 tokens while 20 are owed: one
    pass would run 20 + 5 + 14 + 6 = 45."""
    rng = random.Random(5)
    budget_tokens = 40
    runner = Runner(catchup_budget(2048, budget_tokens, MAX_REQS), budget_tokens, rng)
    for _ in range(5):
        runner.add()
    runner.step(True)  # the prompts' prefill (not under the range check: the scheduler would chunk it)
    for req in runner.running:
        req.budget = 10_000
    runner.spec.compile_range_end = budget_tokens
    for _ in range(5):
        runner.step(False)  # paused: pure decode steps, 5 tokens owed each
    upkeep = runner.manager._upkeep
    assert int(upkeep.pending.sum()) == 20 and upkeep.catchups == 0
    runner.add()
    newcomer = runner.running[-1]
    extra = [rng.randrange(50) for _ in range(14 - len(newcomer.prompt))]
    runner.commit(newcomer.slot, extra)
    newcomer.prompt += extra
    newcomer.budget = 10_000
    runner.step(False)  # the prompt's step: the owed 20 catch up in a pass of their own, then the step's pass
    assert upkeep.separate_catchups == 1
    for _ in range(12):
        runner.step(False)  # six requests: catch-ups at a decode step, 24 owed + 6 rows + 6 slots = 36
    assert upkeep.catchups > 1
    for _ in range(3):
        runner.step(True)  # resume: the draft drafts from its whole context
    assert runner.spec.drafting_reads > 0
    assert catchup_budget(2048, 256, 25) == 206 and catchup_budget(2048, 8192, 256) == 2048


def test_pausing_skips_most_draft_passes_and_catches_up_in_few() -> None:
    rng = random.Random(3)
    kept, deferred = Runner(None, 64, random.Random(3)), Runner(48, 64, random.Random(3))
    for runner in (kept, deferred):
        for _ in range(4):
            runner.add()
        runner.step(True)  # prompts, then a drafting step
        runner.step(True)
        for req in runner.running:
            req.budget = 10_000
        for _ in range(60):
            runner.step(False)  # paused
        runner.step(True)  # resume: drafting must see the whole context
        runner.step(True)
    upkeep = deferred.manager._upkeep
    assert upkeep.skipped_steps >= 50 and 1 <= upkeep.catchups <= 8
    assert deferred.spec.drafting_reads == kept.spec.drafting_reads > 0
    del rng


def test_without_the_catch_up_the_stand_in_sees_the_holes() -> None:
    """The check above can fail: skipping the draft pass and never paying it back drafts from holes."""
    rng = random.Random(5)
    runner = Runner(10_000, 10_000 + 2 * MAX_REQS, rng)
    for _ in range(3):
        runner.add()
    runner.step(True)
    for req in runner.running:
        req.budget = 10_000
    for _ in range(5):
        runner.step(False)
    runner.manager._upkeep.pending[:] = 0  # forget what is owed
    with pytest.raises(AssertionError, match="incomplete context"):
        runner.step(True)
        runner.step(True)


def test_catchup_rows_gather_committed_ids_before_each_query() -> None:
    committed = torch.arange(5 * 20, dtype=torch.int32).reshape(5, 20)
    buffers = CatchupBuffers.allocate(16, 5, torch.device("cpu"))
    qsl, total = catchup_rows(committed, torch.tensor([3, 0, 4]), torch.tensor([9, 2, 5]),
                              np.array([2, 0, 3]), buffers)
    assert qsl.tolist() == [0, 3, 4, 8] and total == 8
    assert buffers.positions[:8].tolist() == [7, 8, 9, 2, 2, 3, 4, 5]
    assert buffers.input_ids[:8].tolist() == [67, 68, 69, 2, 82, 83, 84, 85]
    with pytest.raises(ValueError, match="exceeds"):
        catchup_rows(committed, torch.tensor([0]), torch.tensor([19]), np.array([16]), buffers)


def test_a_catch_up_rows_host_bound_holds_under_a_partial_varlen_budget() -> None:
    """Under a partial varlen budget the host's query lengths spread the drafts evenly over the requests, while
    the device admits them unevenly and the host bound adds the scheduled counts: a catch-up row's bound taken
    from the spread fell below its K/V length for a request scheduled fewer drafts than its share."""
    from dspark_cli.engines.vllm.upkeep import catchup_batch

    computed, scheduled = np.array([10, 20]), np.array([2, 5])  # 1 and 4 drafts scheduled, budget 4
    admitted_qsl = torch.tensor([0, 2, 6], dtype=torch.int32)  # the device admits 1 and 3
    batch = Batch(2, torch.tensor([0, 1]), np.array([0, 1]), torch.zeros(6, dtype=torch.int32),
                  torch.tensor([10, 11, 20, 21, 22, 23]), admitted_qsl, np.array([0, 3, 6], dtype=np.int32), 6,
                  torch.tensor([12, 24], dtype=torch.int32), torch.from_numpy((computed + scheduled).astype(np.int32)),
                  4, False, scheduled.astype(np.int32))
    committed = torch.arange(2 * 40, dtype=torch.int32).reshape(2, 40)
    rows = catchup_batch(batch, committed, np.array([3, 3]), CatchupBuffers.allocate(16, 2, torch.device("cpu")))
    assert rows.seq_lens.tolist() == [11, 21]  # each row ends at its first query position
    assert (rows.seq_lens_cpu_upper_bound[:2] >= rows.seq_lens).all(), rows.seq_lens_cpu_upper_bound


def test_upkeep_budget_bounds_what_a_batch_may_owe() -> None:
    upkeep = DraftUpkeep(8, budget=10)
    slots = np.array([1, 4, 6])
    for _ in range(3):
        assert upkeep.may_skip(slots)
        upkeep.skip(slots)
    assert not upkeep.may_skip(slots)  # 9 owed + 3 more would pass 10
    assert upkeep.owed(slots).tolist() == [3, 3, 3]
    assert upkeep.fit(np.array([8, 8])).sum() <= 10 and upkeep.truncated == 1
    upkeep.paid(slots)
    assert upkeep.owed(slots).sum() == 0 and upkeep.caught_up_tokens == 9
    upkeep.skip(slots)
    upkeep.reset(4)
    assert upkeep.owed(slots).tolist() == [1, 0, 1]
    with pytest.raises(ValueError):
        DraftUpkeep(4, 0)
