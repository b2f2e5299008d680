"""Embedded engine: model parity with transformers, scheduling, KV bookkeeping, stops, stats and traces.

The checkpoints are tiny random Llamas built in a temporary directory: a target, a draft that is the
target with noise added to its weights (so drafts are accepted often but not always) and the same draft
with a confidence head. Everything runs on CPU in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.core.saturation import StepCharge
from dspark_cli.core.sps import SpsCurve
from dspark_cli.core.traces import read_traces
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.errors import DsparkError

VOCAB = 128
EOS = 2


@dataclass
class TinyPair:
    target: Path
    draft: Path
    draft_head: Path
    curve: Path


def _tokenizer(vocab: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _save(model, tokenizer, path: Path) -> Path:  # type: ignore[no-untyped-def]
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_pair(root: Path) -> TinyPair:
    """Target + noisy-copy draft (+ a variant with a confidence head) and a staircase SPS curve."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = _tokenizer(VOCAB)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, eos_token_id=EOS,
        bos_token_id=1, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    target = LlamaForCausalLM(cfg).eval()
    target_dir = _save(target, tok, root / "target")
    draft = LlamaForCausalLM(cfg).eval()
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in target.state_dict().items()}
    draft.load_state_dict(state)
    draft_dir = _save(draft, tok, root / "draft")
    head_dir = _save(draft, tok, root / "draft_head")
    weights = next(head_dir.glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors["confidence_head.weight"] = 0.05 * torch.randn(1, cfg.hidden_size + 2)
    tensors["confidence_head.bias"] = torch.tensor([1.0])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    # A staircase with a steep riser past 16 tokens: at a handful of requests the argmax trims drafts.
    curve = SpsCurve.from_points(
        [(4, 1.0), (8, 1.0), (16, 1.2), (32, 3.0), (64, 6.0)], [(1, 0.2), (8, 0.4)], 0.1, (4, 8, 16, 32, 64)
    )
    curve_path = root / "sps_curve.json"
    curve.save(curve_path)
    return TinyPair(target_dir, draft_dir, head_dir, curve_path)



def make_engine(pair: TinyPair, **overrides) -> LLMEngine:  # type: ignore[no-untyped-def]
    kwargs = dict(
        model=str(pair.target), draft=str(pair.draft), num_speculative_tokens=3, device="cpu",
        max_num_seqs=8, max_model_len=128, block_size=4, num_kv_blocks=None, seed=0,
    )
    kwargs.update(overrides)
    return LLMEngine(EngineConfig(**kwargs))


def prompts(n: int, length: int = 6, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length + i % 3,), generator=g).tolist() for i in range(n)]


# -------------------------------------------------------------------------------------------- model


def test_model_matches_transformers_logits(tiny_pair: TinyPair) -> None:
    """Prefill then ragged multi-token steps through the paged cache reproduce HF's full-sequence logits."""
    from transformers import LlamaForCausalLM as HFLlama

    from dspark_cli.engines.embedded.attention import build_attention_inputs, get_backend
    from dspark_cli.engines.embedded.model import load_llama

    hf = HFLlama.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    ours = load_llama(tiny_pair.target, get_backend("torch"), 64, torch.float32, torch.device("cpu"))
    seqs = [torch.randint(3, VOCAB, (n,)).tolist() for n in (9, 5)]
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]
    bs = 4
    kv = ours.allocate_kv_cache(16, bs, torch.float32, torch.device("cpu"))
    tables = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 0]])
    # Feed each sequence in two ragged chunks: [0, 4) / [0, 2), then the rest in one batch.
    cut = [4, 2]
    outs: list[list[torch.Tensor]] = [[], []]
    for phase in range(2):
        ids, pos, req, starts = [], [], [], []
        for r, s in enumerate(seqs):
            lo, hi = (0, cut[r]) if phase == 0 else (cut[r], len(s))
            ids += s[lo:hi]
            pos += list(range(lo, hi))
            req += [r] * (hi - lo)
            starts.append(lo)
        pos_t = torch.tensor(pos)
        inputs = build_attention_inputs(
            pos_t, torch.tensor(req), torch.zeros(len(ids), dtype=torch.bool), torch.tensor(starts), tables, bs,
            max(len(s) for s in seqs), 12,
        )
        with torch.no_grad():
            logits = ours.compute_logits(ours(torch.tensor(ids), pos_t, kv, inputs))
        off = 0
        for r, s in enumerate(seqs):
            n = (cut[r] if phase == 0 else len(s) - cut[r])
            outs[r].append(logits[off : off + n])
            off += n
    for r in range(2):
        got = torch.cat(outs[r])
        torch.testing.assert_close(got, ref[r], atol=2e-5, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark_cli.engines.embedded.attention import build_attention_inputs, get_backend
    from dspark_cli.engines.embedded.model import load_llama

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    )
    hf = LlamaForCausalLM(cfg).eval()
    _save(hf, _tokenizer(64), tmp_path / "m")
    ours = load_llama(tmp_path / "m", get_backend("torch"), 64, torch.float32, torch.device("cpu"))
    seq = torch.randint(0, 64, (40,))
    with torch.no_grad():
        ref = hf(seq[None]).logits[0]
        kv = ours.allocate_kv_cache(12, 8, torch.float32, torch.device("cpu"))
        pos = torch.arange(40)
        inputs = build_attention_inputs(
            pos, torch.zeros(40, dtype=torch.long), torch.zeros(40, dtype=torch.bool), torch.tensor([0]),
            torch.tensor([[1, 2, 3, 4, 5]]), 8, 40, 40,
        )
        got = ours.compute_logits(ours(seq, pos, kv, inputs))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


# -------------------------------------------------------------------------------------------- engine


def test_greedy_matches_transformers_generate(tiny_pair: TinyPair) -> None:
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    ps = prompts(3)
    engine = make_engine(tiny_pair)
    got = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(ps, got, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out == ref[0, len(prompt) :].tolist()
    assert engine.stats.num_drafts > 0
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens


def test_stats_counters_follow_vllm_semantics(tiny_pair: TinyPair) -> None:
    engine = make_engine(tiny_pair)
    outs = engine.generate(prompts(4), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    s = engine.stats
    k = 3
    assert all(len(o) == 10 for o in outs)
    assert s.generation_tokens == 40
    assert s.prompt_tokens == sum(len(p) for p in prompts(4))
    assert s.requests_finished == {"length": 4}
    assert s.num_draft_tokens == k * s.num_drafts
    assert s.num_verified_draft_tokens == s.num_draft_tokens  # capacity none admits everything
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert all(s.accepted_per_pos[i] >= s.accepted_per_pos[i + 1] for i in range(k - 1))
    assert s.accepted_per_pos[0] <= s.num_drafts
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.kv_blocks_free == s.kv_blocks_total
    assert not engine.has_unfinished_requests()


def test_max_tokens_and_stop_tokens(tiny_pair: TinyPair) -> None:
    engine = make_engine(tiny_pair)
    p = prompts(1)[0]
    full = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    stop = full[7]
    first = full.index(stop)
    engine.add_request("s", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)))
    got: list[int] = []
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.new_token_ids
            if out.finished:
                reason = out.finish_reason
    assert got == full[: first + 1]
    assert reason == "stop"
    for n in (1, 2, 5):
        assert engine.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0] == full[:n]


def test_eos_stops_unless_ignored(tiny_pair: TinyPair) -> None:
    engine = make_engine(tiny_pair)
    p = prompts(1)[0]
    full = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    # Use the tokenizer's EOS: pick a prompt/model pair where EOS shows up by remapping it to a seen token.
    engine.eos_token_ids = frozenset({full[4]})
    got = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert got == full[: full.index(full[4]) + 1]
    assert engine.generate([p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0] == full


def test_abort_frees_blocks_at_once(tiny_pair: TinyPair) -> None:
    engine = make_engine(tiny_pair)
    total = engine.block_manager.num_free_blocks
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < total
    engine.abort_request("r1")
    held = sum(len(s.block_table) for s in engine.scheduler.running)
    assert engine.block_manager.num_free_blocks == total - held
    assert all(s.request_id != "r1" for s in engine.scheduler.running)
    engine.abort_request("r0")
    engine.abort_request("r2")
    engine.abort_request("unknown")  # no-op
    assert engine.block_manager.num_free_blocks == total
    assert not engine.has_unfinished_requests()
    assert engine.stats.requests_finished == {"abort": 3}


def test_abort_of_waiting_request(tiny_pair: TinyPair) -> None:
    engine = make_engine(tiny_pair, max_num_seqs=1)
    engine.add_request("a", prompts(1)[0], SamplingParams(max_tokens=5))
    engine.add_request("b", prompts(1)[0], SamplingParams(max_tokens=5))
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["b"]
    engine.abort_request("b")
    assert not engine.scheduler.waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.requests_finished == {"length": 1, "abort": 1}


def test_preemption_under_tiny_kv_pool_completes_everything(tiny_pair: TinyPair) -> None:
    ps = prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = make_engine(tiny_pair).generate(ps, params)
    # 45 blocks of 4 slots: one request at max_model_len=128 fits, six growing ones do not.
    engine = make_engine(tiny_pair, num_kv_blocks=34, max_model_len=120)
    got = engine.generate(ps, params)
    assert got == reference
    assert engine.stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_overload_queues_beyond_max_num_seqs(tiny_pair: TinyPair) -> None:
    engine = make_engine(tiny_pair, max_num_seqs=2)
    for i, p in enumerate(prompts(5)):
        engine.add_request(f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats.num_running)
    assert peak == 2
    assert engine.stats.requests_finished == {"length": 5}


def test_newcomers_wait_to_share_a_prefill_step_while_others_decode(tiny_pair: TinyPair) -> None:
    """While requests decode, arrivals a step apart are held (up to the delay) and prefilled together; a
    full batch of them, or an idle engine, prefills at once; outputs do not depend on the grouping."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ps = prompts(4)

    def run(factor: float) -> tuple[dict[str, list[int]], int]:
        engine = make_engine(tiny_pair, scheduler_delay_factor=factor, max_num_seqs=4)
        engine.add_request("r0", ps[0], params)
        outs: dict[str, list[int]] = {}
        for i in range(1, 4):  # r0 decodes; one newcomer arrives per step
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            engine.add_request(f"r{i}", ps[i], params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return outs, engine.stats.num_prefill_steps

    at_once, steps_at_once = run(0.0)
    held, steps_held = run(1e6)  # hold until a full batch waits
    assert steps_at_once == 4 and steps_held == 2  # r0, then r1..r3 together (3 waiting = 3 free slots)
    assert held == at_once


def test_the_prefill_hold_is_bounded_and_never_holds_a_full_batch_or_an_idle_engine() -> None:
    from dspark_cli.engines.embedded.block_manager import BlockManager
    from dspark_cli.engines.embedded.scheduler import Scheduler
    from dspark_cli.engines.embedded.sequence import Sequence

    sched = Scheduler(BlockManager(64, 4), max_num_seqs=3, max_num_batched_tokens=256, lookahead=3)
    sched.prefill_delay_ms = 20.0
    first = Sequence("a", [5, 6, 7], SamplingParams(), 0)
    sched.add(first)
    assert not sched.holds_prefill()  # nothing decodes: prefill at once
    assert sched.schedule().is_prefill
    late = Sequence("b", [5, 6], SamplingParams(), 1)
    sched.add(late)
    assert sched.holds_prefill(now=late.arrival_time + 0.005)
    assert not sched.holds_prefill(now=late.arrival_time + 0.021)  # waited one delay: admitted
    batch = sched.schedule()
    if batch.is_prefill:  # this machine took more than 20 ms since the add
        assert batch.seqs == [late]
    else:
        assert batch.seqs == [first]  # decode went on while it waited
    full = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=256, lookahead=3)
    full.prefill_delay_ms = 1e9
    full.add(Sequence("x", [5], SamplingParams(), 0))
    full.schedule()
    full.add(Sequence("y", [5], SamplingParams(), 1))
    assert not full.holds_prefill()  # one newcomer fills the last free slot: no one else could share it
    with pytest.raises(DsparkError, match="scheduler_delay_factor"):
        EngineConfig(scheduler_delay_factor=-1.0).validate()


def test_a_mixed_prefill_carries_the_running_requests_within_the_token_limit_and_never_preempts() -> None:
    from dspark_cli.engines.embedded.block_manager import BlockManager
    from dspark_cli.engines.embedded.scheduler import Scheduler
    from dspark_cli.engines.embedded.sequence import Sequence

    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=7, lookahead=0)
    a, b = Sequence("a", [5] * 3, SamplingParams(), 0), Sequence("b", [6] * 3, SamplingParams(), 1)
    sched.add(a)
    sched.add(b)
    assert sched.schedule(mixed=True).decode == []  # nobody runs yet: a prefill alone
    c, d = Sequence("c", [7] * 3, SamplingParams(), 2), Sequence("d", [8] * 3, SamplingParams(), 3)
    sched.add(c)
    sched.add(d)
    batch = sched.schedule(mixed=True)
    # a and b's two tokens share the 7-token limit: c (3 tokens) fits beside them, d (3 more) waits.
    assert batch.is_prefill and batch.seqs == [c] and batch.decode == [a, b]
    assert list(sched.waiting) == [d]
    assert sched.schedule().decode == []  # not asked to mix: d's prefill runs alone
    # A prompt that fits the limit only alone runs alone: beside the running requests' tokens it went past it
    roomy = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=7, lookahead=0)
    first, second = Sequence("a", [5] * 3, SamplingParams(), 0), Sequence("b", [6] * 3, SamplingParams(), 1)
    roomy.add(first)
    roomy.add(second)
    roomy.schedule()
    big = Sequence("big", [9] * 6, SamplingParams(), 2)
    roomy.add(big)
    batch = roomy.schedule(mixed=True)
    assert batch.seqs == [big] and batch.decode == []
    # A pool too short for every running request's next token: no ride-along (the decode step preempts).
    tight = Scheduler(BlockManager(3, 4), max_num_seqs=4, max_num_batched_tokens=64, lookahead=0)
    old = Sequence("old", [5] * 4, SamplingParams(), 0)
    tight.add(old)
    tight.schedule()
    old.token_ids.append(9)  # its first output: the next token needs a second block
    old.num_computed_tokens = 4
    tight.add(Sequence("new", [6] * 4, SamplingParams(), 1))
    batch = tight.schedule(mixed=True)
    assert batch.is_prefill and batch.decode == []


def _staggered(engine: LLMEngine, ps: list[list[int]], params: list[SamplingParams],
               finished_at: dict[str, int] | None = None) -> dict[str, list[int]]:
    """r0 starts alone; one newcomer arrives after each step (closed-loop successors arriving apart).
    ``finished_at`` gets the step each request finished in."""
    engine.add_request("r0", ps[0], params[0])
    outs: dict[str, list[int]] = {}

    def step() -> None:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished and finished_at is not None:
                finished_at[o.request_id] = engine.stats.num_steps

    for i in range(1, len(ps)):
        step()
        engine.add_request(f"r{i}", ps[i], params[i])
    while engine.has_unfinished_requests():
        step()
    return outs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_newcomers_ride_along_in_the_running_requests_decode_step_and_outputs_do_not_change(
    tiny_pair: TinyPair, temperature: float
) -> None:
    """Mixed prefill (no speculation): a newcomer's prefill decodes one token for every running request in
    the same forward. Outputs are those of prefill steps of their own (greedy, and seeded sampling: each
    request's random stream advances once per token either way); every newcomer after the first rode along,
    and the running requests lost no step to it."""
    ps = prompts(4)
    params = [SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=100 + i) for i in range(4)]
    mixed = make_engine(tiny_pair, num_speculative_tokens=0, draft=None, max_num_seqs=4, mixed_prefill=True)
    alone = make_engine(tiny_pair, num_speculative_tokens=0, draft=None, max_num_seqs=4, mixed_prefill=False)
    done_mixed: dict[str, int] = {}
    done_alone: dict[str, int] = {}
    got, want = _staggered(mixed, ps, params, done_mixed), _staggered(alone, ps, params, done_alone)
    assert got == want and all(len(toks) == 12 for toks in got.values())
    assert mixed.stats.steps["mixed"] == 3 and mixed.stats.steps["prefill"] == 1  # r0's prefill had nobody to carry
    assert alone.stats.steps["mixed"] == 0 and alone.stats.steps["prefill"] == 4
    assert mixed.stats.num_prefill_steps == alone.stats.num_prefill_steps == 4
    # r0 got a token in every step instead of waiting out three prefills (r1 two, r2 one); the last arrival,
    # r3, finishes 12 steps after its own, either way.
    assert done_mixed == {"r0": 12, "r1": 13, "r2": 14, "r3": 15}
    assert done_alone == {"r0": 15, "r1": 15, "r2": 15, "r3": 15}
    assert mixed.stats.generation_tokens == alone.stats.generation_tokens == 48
    assert mixed.stats.prompt_tokens == alone.stats.prompt_tokens == sum(len(p) for p in ps)


def test_newcomers_ride_along_while_drafting_is_paused_and_the_draft_catches_up_on_resume(
    tiny_pair: TinyPair, tmp_path: Path
) -> None:
    """With drafting paused a prefill mixes too (target only); a drafting step -- a probe -- feeds the draft
    the newcomers' whole prompts in its catch-up. Greedy outputs are plain decoding's."""
    curve = tmp_path / "expensive_draft.json"  # drafting never pays: pauses after one step, probes every 2
    SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 500.0), (8, 500.0)], 0.1).save(curve)
    ps = prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)] * 6
    engine = make_engine(tiny_pair, sps_curve=str(curve), max_num_seqs=6, mixed_prefill=True,
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=2, probe_tax=1.0))
    kinds: list[tuple[str, bool]] = []  # (step kind, drafting enabled before the step)
    real_step = engine.step
    skipped: set[str] = set()  # admitted in a mixed step, the draft not fed their prompt
    caught_up: set[str] = set()  # ... and fed it, and more, by a later drafting step's catch-up

    def step():  # type: ignore[no-untyped-def]
        enabled = engine.capacity.drafting_enabled
        out = real_step()
        kind = engine.stalls.step_kind
        kinds.append((kind, enabled))
        for seq in engine.scheduler.running:
            if kind == "mixed" and seq.num_draft_computed < seq.num_prompt_tokens:
                skipped.add(seq.request_id)
            if kind in ("probe", "spec") and seq.request_id in skipped and seq.num_draft_computed > seq.num_prompt_tokens:
                caught_up.add(seq.request_id)
        return out

    engine.step = step  # type: ignore[method-assign]
    outs: dict[str, list[int]] = {}

    def run_step() -> None:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)

    engine.add_request("r0", ps[0], params[0])
    while engine.capacity.drafting_enabled:  # one drafting step that does not pay pauses drafting
        run_step()
    for i in range(1, len(ps)):  # then one newcomer per step
        engine.add_request(f"r{i}", ps[i], params[i])
        run_step()
    while engine.has_unfinished_requests():
        run_step()
    got = outs
    assert engine.stats.steps["mixed"] > 0 and engine.stats.steps["probe"] > 0
    assert any(not enabled for kind, enabled in kinds if kind == "mixed")
    assert skipped and caught_up
    # After r0's, no prefill ran as a step of its own, drafting on or not (someone was always running).
    assert [i for i, (kind, _) in enumerate(kinds) if kind == "prefill"] == [0]
    reference = make_engine(tiny_pair, num_speculative_tokens=0, draft=None, max_num_seqs=6)
    assert got == dict(zip([f"r{i}" for i in range(6)], reference.generate(ps, params[0]), strict=True))


@pytest.mark.parametrize("capacity", [None, "varlen", "mask"])
def test_newcomers_ride_along_while_drafting_and_the_next_drafting_step_catches_the_draft_up(
    tiny_pair: TinyPair, capacity: str | None
) -> None:
    """While drafting runs, a newcomer's prefill mixes as well: that step decodes one token for every running
    request and drafts nothing, and the drafting step after it feeds the draft the newcomer's prompt and the
    token each running request gained. Such a catch-up is what drafting costs (a paused server never runs the draft
    over a prompt, and a closed loop's refills bring one after every uneven finish): that step's time is
    calibrated as every other drafting step's. Greedy outputs are plain decoding's, with and without a capacity
    manager (verify-all drafts every step)."""
    ps = prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)] * 6
    overrides: dict[str, object] = {"max_num_seqs": 6, "mixed_prefill": True}
    if capacity is not None:  # drafting never pauses here: what is checked is every step's kind
        overrides |= {"sps_curve": str(tiny_pair.curve),
                      "capacity": CapacityConfig(mode=capacity, saturation_patience=0)}
    engine = make_engine(tiny_pair, **overrides)
    kinds: list[str] = []
    calibrated: list[tuple[int, bool]] = []  # (step index, calibrate) of every drafting step's time
    behind_after_mix: list[int] = []  # draft tokens the running requests missed in each mixed step
    if engine.capacity is not None:
        record = engine.capacity.record_step_time

        def spy(drafting: bool, num_reqs: int, measured_ms: float, priced_ms: float | None = None,
                calibrate: bool = True, charge: StepCharge | None = None) -> None:
            if drafting:  # reported by the step after it (LLMEngine._report_step_time)
                calibrated.append((len(kinds) - 1, calibrate))
            record(drafting, num_reqs, measured_ms, priced_ms, calibrate, charge)

        engine.capacity.record_step_time = spy  # type: ignore[method-assign]
    outs: dict[str, list[int]] = {}

    def step() -> None:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        kinds.append(engine.stalls.step_kind)
        if kinds[-1] == "mixed":
            behind_after_mix.append(max(s.num_tokens - s.num_draft_computed for s in engine.scheduler.running))

    engine.add_request("r0", ps[0], params[0])
    step()
    for i in range(1, len(ps)):  # a newcomer every other step, as a closed loop's split refills arrive
        step()
        engine.add_request(f"r{i}", ps[i], params[i])
        step()
    while engine.has_unfinished_requests():
        step()
    assert kinds[0] == "prefill" and kinds.count("prefill") == 1
    assert kinds.count("mixed") == len(ps) - 1 and "spec" in kinds and "paused" not in kinds
    # a newcomer's whole prompt (and its first token) waited for the draft's next pass
    assert min(behind_after_mix) > min(len(p) for p in ps)
    for i, kind in enumerate(kinds):
        if kind == "mixed":
            assert kinds[i + 1] == "spec"  # the draft caught up there: every request drafted
    if engine.capacity is not None:
        after_mix = {i for i, kind in enumerate(kinds) if kind == "spec" and kinds[i - 1] == "mixed"}
        assert after_mix <= {i for i, _ in calibrated} and all(c for _, c in calibrated)
    reference = make_engine(tiny_pair, num_speculative_tokens=0, draft=None, max_num_seqs=6)
    assert outs == dict(zip([f"r{i}" for i in range(6)], reference.generate(ps, params[0]), strict=True))


def test_prompts_admitted_while_drafting_is_paused_skip_the_draft_and_outputs_stay_lossless(
    tiny_pair: TinyPair, tmp_path: Path
) -> None:
    """While the saturation policy pauses drafting, a prefill step runs the target only; the next probe's
    catch-up feeds the draft the whole prompt and what was generated since. Greedy outputs are those of
    plain decoding."""
    curve = tmp_path / "expensive_draft.json"  # drafting never pays: pauses after one step, probes every 2
    SpsCurve.from_points([(4, 1.0), (8, 1.1), (64, 2.0)], [(1, 500.0), (8, 500.0)], 0.1).save(curve)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ps = prompts(4)
    # probe_tax 1: probes as often as the timer says (the default's share of paused time would wait longer)
    engine = make_engine(tiny_pair, sps_curve=str(curve), max_num_seqs=2, scheduler_delay_factor=0.0,
                         capacity=CapacityConfig(mode="varlen", saturation_patience=1, resume_every=2, probe_tax=1.0))
    drafter = engine.runner.drafter
    calls: list[int] = []
    real_prefill = drafter.prefill

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real_prefill(*args, **kwargs)

    drafter.prefill = counted
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(ps):  # two run at once; the other two are admitted as the first finish
        engine.add_request(f"r{i}", p, params)
    deferred = []
    while engine.has_unfinished_requests():
        admitted = len(engine.scheduler.waiting)
        paused = not engine.capacity.drafting_enabled
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if len(engine.scheduler.waiting) < admitted and paused:
            deferred.extend((s, engine.stats.num_drafts) for s in engine.scheduler.running
                            if s.num_draft_computed < s.num_prompt_tokens)
    assert deferred, "no request was admitted while drafting was paused"
    assert len(calls) == 1  # only the first prefill, before any pause, ran the draft
    # a probe after a deferred admission drafted, its catch-up feeding the draft the prompt and the rest
    assert engine.stats.num_drafts > deferred[0][1]
    assert any(seq.num_draft_computed > seq.num_prompt_tokens for seq, _ in deferred)
    reference = make_engine(tiny_pair, num_speculative_tokens=0, draft=None, max_num_seqs=2)
    expected = dict(zip([f"r{i}" for i in range(4)], reference.generate(ps, params), strict=True))
    assert outs == {rid: list(toks) for rid, toks in expected.items()}


def test_the_start_up_log_says_how_many_full_length_requests_the_kv_pool_holds(
    tiny_pair: TinyPair, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool too small for --max-num-seqs requests of max_model_len is said at start-up, with the fixes: such a
    server admits fewer requests than asked and reads slower for want of memory, not of speed."""
    with caplog.at_level("INFO", logger="dspark.embedded"):
        engine = make_engine(tiny_pair, max_num_seqs=4, max_model_len=64, block_size=4, num_kv_blocks=1 + 3 * 17)
    per_request = engine.runner.max_blocks_per_seq
    lines = [r.getMessage() for r in caplog.records if "KV pool" in r.getMessage()]
    fits = 51 // per_request
    assert lines and f"{fits} requests of max_model_len=64 at once" in lines[0]
    assert fits < 4 and any("fewer than --max-num-seqs 4" in line and "--gpu-memory-utilization" in line
                            for line in lines)
    caplog.clear()
    with caplog.at_level("INFO", logger="dspark.embedded"):
        make_engine(tiny_pair, max_num_seqs=2, max_model_len=64, block_size=4, num_kv_blocks=1 + 2 * per_request)
    assert not [r for r in caplog.records if "fewer than --max-num-seqs" in r.getMessage()]


def test_steps_that_held_a_newcomer_back_for_want_of_kv_blocks_are_counted_and_exported(tiny_pair: TinyPair) -> None:
    """A pool for two requests of this length under --max-num-seqs 4: the others wait with a slot free, each
    such step counted (dspark:kv_wait_steps_total, which the bench turns into a note on the cell); a pool for
    all four counts none."""
    from dspark_cli.engines.embedded.metrics import MetricsSnapshot, render_metrics

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    small = make_engine(tiny_pair, max_num_seqs=4, max_model_len=32, block_size=4, num_kv_blocks=1 + 2 * 7)
    small.generate(prompts(4), params)
    assert small.stats.num_kv_wait_steps > 0
    text = render_metrics(MetricsSnapshot.from_stats(small.stats), "tiny")
    assert f'dspark:kv_wait_steps_total{{model_name="tiny",engine="0"}} {small.stats.num_kv_wait_steps}' in text
    roomy = make_engine(tiny_pair, max_num_seqs=4, max_model_len=32, block_size=4)
    roomy.generate(prompts(4), params)
    assert roomy.stats.num_kv_wait_steps == 0


def test_traces_are_written_in_spec_format(tiny_pair: TinyPair, tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    engine = make_engine(
        tiny_pair, draft=str(tiny_pair.draft_head), record_traces=str(path),
        capacity=CapacityConfig(mode="varlen", saturation_patience=0), sps_curve=str(tiny_pair.curve),
    )
    engine.generate(prompts(3), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.close()
    records, skipped = read_traces(path)
    assert skipped == 0
    assert len(records) == engine.stats.num_drafts
    assert sum(r.accepted for r in records) == engine.stats.num_accepted_tokens
    assert sum(r.verified for r in records) == engine.stats.num_verified_draft_tokens
    by_req: dict[str, list[int]] = {}
    for r in records:
        assert len(r.conf) == 3 and all(0.0 < c < 1.0 for c in r.conf)
        assert 0 <= r.accepted <= r.verified <= 3
        by_req.setdefault(r.request, []).append(r.step)
    assert len(by_req) == 3
    assert all(steps == list(range(len(steps))) for steps in by_req.values())


def test_capacity_modes_need_a_curve(tiny_pair: TinyPair) -> None:
    with pytest.raises(DsparkError, match="--sps-curve"):
        make_engine(tiny_pair, capacity=CapacityConfig(mode="mask"))


def test_bad_requests_are_refused(tiny_pair: TinyPair) -> None:
    engine = make_engine(tiny_pair)
    with pytest.raises(DsparkError):
        engine.add_request("x", [], SamplingParams())
    with pytest.raises(DsparkError):
        engine.add_request("x", [VOCAB + 5], SamplingParams())
    with pytest.raises(DsparkError):
        engine.add_request("x", [3] * 200, SamplingParams())
    with pytest.raises(DsparkError):
        engine.add_request("x", [3], SamplingParams(top_p=0.0))
    engine.add_request("x", [3], SamplingParams())
    with pytest.raises(DsparkError):
        engine.add_request("x", [3], SamplingParams())


def test_seeded_sampling_is_reproducible(tiny_pair: TinyPair) -> None:
    ps = prompts(3)
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=100 + i, ignore_eos=True) for i in range(3)]
    a = make_engine(tiny_pair).generate(ps, params)
    b = make_engine(tiny_pair, seed=7).generate(ps, params)
    assert a == b
    # A seeded request does not depend on its batch companions.
    alone = make_engine(tiny_pair).generate([ps[1]], [params[1]])
    assert alone[0] == a[1]


@pytest.mark.parametrize("draft", ["draft", None])
def test_a_temperature_below_vllms_epsilon_is_greedy(tiny_pair: TinyPair, draft: str | None) -> None:
    # 1e-39 over a logit of ~1 overflows float32: the samplers' softmax turned NaN and emitted token 0.
    from dspark_cli.core.rejection import SAMPLING_EPS
    from dspark_cli.engines.embedded import sequence

    assert sequence.SAMPLING_EPS == SAMPLING_EPS
    engine = make_engine(tiny_pair) if draft else make_engine(tiny_pair, draft=None)
    ps = prompts(3)
    greedy = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for t in (1e-39, 1e-6):
        assert SamplingParams(temperature=t).greedy
        assert engine.generate(ps, SamplingParams(temperature=t, max_tokens=8, ignore_eos=True)) == greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


def test_no_draft_runs_plain_decoding(tiny_pair: TinyPair) -> None:
    engine = make_engine(tiny_pair, draft=None)
    out = engine.generate(prompts(2), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert all(len(o) == 6 for o in out)
    assert engine.stats.num_drafts == 0 and engine.stats.accepted_per_pos == []


# -------------------------------------------------------------------------------------------- profiling


def test_profile_sps_returns_a_usable_curve_and_the_blocks(tiny_pair: TinyPair) -> None:
    from dspark_cli.engines.embedded.profile import profile_sps

    engine = make_engine(tiny_pair)
    free = engine.block_manager.num_free_blocks
    curve = profile_sps(engine, context_len=32, warmup=1, iters=3)
    assert engine.block_manager.num_free_blocks == free
    xs = [x for x, _ in curve.verify_ms]
    assert xs == [1, 2, 4, 8, 16, 32, 48, 64]  # powers of two up to (K + 1) * max_num_seqs, then beyond it
    assert [x for x, _ in curve.draft_ms] == [1, 2, 4, 8]
    assert all(b[1] >= a[1] for a, b in zip(curve.verify_ms, curve.verify_ms[1:], strict=False))
    assert curve.overhead_ms > 0
    assert curve.meta["engine"] == "embedded" and curve.meta["k"] == 3
    # The engine still generates exactly as before after lending its KV pool.
    ref = make_engine(tiny_pair).generate(prompts(2), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert engine.generate(prompts(2), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) == ref


def test_profile_refuses_a_busy_engine(tiny_pair: TinyPair) -> None:
    from dspark_cli.engines.embedded.profile import profile_sps

    engine = make_engine(tiny_pair)
    engine.add_request("busy", [5, 6, 7], SamplingParams())
    with pytest.raises(DsparkError, match="idle"):
        profile_sps(engine)


@given(st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=1, max_size=12))
@settings(max_examples=200, deadline=None)
def test_isotonic_fit_is_monotone_and_keeps_the_mass(ys: list[float]) -> None:
    from dspark_cli.core.sps import monotone_fit as isotonic

    pts = list(enumerate(ys, start=1))
    fit = isotonic(pts)
    assert [x for x, _ in fit] == [x for x, _ in pts]
    vals = [y for _, y in fit]
    assert all(b >= a - 1e-9 for a, b in zip(vals, vals[1:], strict=False))
    assert sum(vals) == pytest.approx(sum(ys))
    if all(b >= a for a, b in zip(ys, ys[1:], strict=False)):
        assert vals == pytest.approx(ys)


# -------------------------------------------------------------------------------------------- confidences


def _first_step_confidence(pair: TinyPair, draft: Path, tmp_path: Path) -> tuple[list[int], float]:
    path = tmp_path / f"{draft.name}.jsonl"
    engine = make_engine(pair, draft=str(draft), record_traces=str(path))
    prompt = prompts(1)[0]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    engine.close()
    first = next(r for r in read_traces(path)[0] if r.step == 0)
    return prompt + out[:1], first.conf[0]


def test_confidence_is_the_draft_probability_or_the_head(tiny_pair: TinyPair, tmp_path: Path) -> None:
    """c_1 of the first decode step, recomputed with transformers from the draft's own distribution."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM as HFLlama

    context, conf_plain = _first_step_confidence(tiny_pair, tiny_pair.draft, tmp_path)
    _, conf_head = _first_step_confidence(tiny_pair, tiny_pair.draft_head, tmp_path)
    hf = HFLlama.from_pretrained(tiny_pair.draft, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf.model(torch.tensor([context])).last_hidden_state[0, -1]
        logq = torch.log_softmax(hf.lm_head(hidden), dim=-1)
    x = int(logq.argmax())
    assert conf_plain == pytest.approx(float(logq[x].exp()), abs=1e-5)
    head = load_file(str(next(tiny_pair.draft_head.glob("*.safetensors"))))
    entropy = -(logq.exp() * logq).sum()
    feats = torch.cat([hidden, logq[x].view(1), entropy.view(1)])
    expected = torch.sigmoid(head["confidence_head.weight"][0] @ feats + head["confidence_head.bias"][0])
    assert conf_head == pytest.approx(float(expected), abs=1e-5)
    assert conf_head != pytest.approx(conf_plain, abs=1e-3)


def test_sts_calibrates_what_the_manager_sees_and_traces_stay_raw(tiny_pair: TinyPair, tmp_path: Path) -> None:
    from dspark_cli.core.sts import apply_temperatures
    from dspark_cli.fileio import atomic_write_json

    sts = tmp_path / "sts.json"
    temps = [0.3, 2.5, 4.0]
    atomic_write_json(sts, {"version": 1, "temperatures": temps, "sts_temperatures": temps})
    raw_path, cal_path = tmp_path / "raw.jsonl", tmp_path / "cal.jsonl"
    cap = CapacityConfig(mode="varlen", saturation_patience=0)
    plain = make_engine(tiny_pair, record_traces=str(raw_path), capacity=cap, sps_curve=str(tiny_pair.curve))
    calibrated = make_engine(tiny_pair, record_traces=str(cal_path), capacity=cap, sps_curve=str(tiny_pair.curve),
                             sts=str(sts))
    prompt = prompts(1)[0]
    for engine in (plain, calibrated):
        engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        engine.step()  # prefill
        engine.step()  # first decode step: both engines draft the same tokens from the same state
        engine.close()
    raw = read_traces(raw_path)[0][0].conf
    assert read_traces(cal_path)[0][0].conf == raw  # traces carry the head's raw output
    slot = calibrated._slot_of["r"]
    expected = apply_temperatures(torch.tensor([raw]), torch.tensor(temps))[0]
    torch.testing.assert_close(calibrated.capacity.conf[slot], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain.capacity.conf[slot], torch.tensor(raw), atol=1e-5, rtol=1e-5)


def test_a_fresh_engine_reports_every_kv_block_free() -> None:
    """/metrics reads ``kv_blocks_free``: it was 0 until the first request, a full KV cache on an idle replica."""
    with LLMEngine(EngineConfig(model="tiny", device="cpu", max_num_seqs=2, max_model_len=64)) as engine:
        assert engine.stats.kv_blocks_total > 0 and engine.stats.kv_blocks_free == engine.stats.kv_blocks_total
