"""vLLM 0.33's start-up warm-up and start-up profile against a draft_model server's token budget
(contract.warmup_overflow, contract.dummy_draft_overflow).

On the H200 (docs/PERFORMANCE.md section 37) every drafting server of the lossless check, served with
``--max-num-batched-tokens 256`` and 128 requests at K=7, loaded its weights and stopped in the warm-up with
"Shape: 280 out of considered ranges: [(1, 256)]": the warm-up prefilled 28 requests of 9 tokens, the draft's
prefill pass ran over those plus one per request, and torch.compile covers batches up to the budget only.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_cli.engines.vllm.contract import (
    default_capture_sizes,
    dummy_draft_overflow,
    profile_overflow,
    profile_sizes,
    warmup_kv_cap,
    warmup_overflow,
)
from dspark_cli.engines.vllm.manager import check_draft_warmup


def test_the_sittings_server_is_refused_with_the_shape_vllm_stopped_on() -> None:
    problem = warmup_overflow(128, 256, 7)
    assert problem is not None
    assert "over 280 tokens (28 requests of 9, plus one each), more than the 256" in problem
    assert "--max-num-seqs 25 or fewer" in problem and "--max-num-batched-tokens 1280 or more" in problem
    assert warmup_overflow(25, 256, 7) is None  # what the check serves with since
    assert warmup_overflow(256, 8192, 7) is None  # the matrices' servers: the request count bounds the warm-up


@given(seqs=st.integers(1, 2048), budget=st.integers(1, 20_000), k=st.integers(1, 15))
def test_either_way_out_the_refusal_names_is_served(seqs: int, budget: int, k: int) -> None:
    if budget <= k:
        return  # vLLM refuses a budget no larger than its lookahead (num_speculative_tokens) before any warm-up
    if seqs * (k + 3) <= budget:
        assert warmup_overflow(seqs, budget, k) is None  # room for the draft's extra token of every request
    problem = warmup_overflow(seqs, budget, k)
    if problem is None:
        return
    fewer = budget // (k + 3)
    if fewer:
        assert f"--max-num-seqs {fewer} or fewer" in problem and warmup_overflow(fewer, budget, k) is None
    else:
        assert "--max-num-seqs" not in problem  # no request count fits: only a larger budget does
    assert warmup_overflow(seqs, seqs * (k + 3), k) is None


def test_a_kv_cache_too_small_for_the_warm_up_requests_caps_them() -> None:
    # 49 tokens (9 + 5 steps of 8) and 7 of lookahead: 4 blocks of 16 per request, block 0 the null block
    assert warmup_kv_cap(41, 16, 7, 7, 2048) == 10
    assert warmup_overflow(128, 256, 7, max_warmup_reqs=10) is None
    assert warmup_overflow(128, 256, 7, max_warmup_reqs=warmup_kv_cap(100_000, 16, 7, 7, 2048)) is not None
    assert warmup_kv_cap(2, 16, 7, 7, 2048) == 1  # vLLM warms up one request at least
    assert warmup_kv_cap(81, 16, 7, 7, 2048, groups=2) == 10  # a draft's group of its own doubles the blocks


def _config(**changes: object) -> types.SimpleNamespace:
    """The fields of vLLM's VllmConfig the check reads, as the sitting's lossless check served them."""
    values = dict(method="draft_model", k=7, mode=3, jit=True, blocks=5_800, seqs=128, budget=256)
    values.update(changes)
    return types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(method=values["method"], num_speculative_tokens=values["k"]),
        compilation_config=types.SimpleNamespace(mode=values["mode"]),
        kernel_config=types.SimpleNamespace(enable_jit_warmup=values["jit"]),
        cache_config=types.SimpleNamespace(num_gpu_blocks=values["blocks"], block_size=16),
        scheduler_config=types.SimpleNamespace(max_num_seqs=values["seqs"], max_num_batched_tokens=values["budget"]),
        model_config=types.SimpleNamespace(max_model_len=2048),
        num_lookahead_tokens=values["k"])


def test_the_plugin_refuses_only_what_the_warm_up_would_stop_on() -> None:
    with pytest.raises(ValueError, match=r"dspark: vLLM 0\.33\.0's start-up warm-up would run the draft model over "
                                         r"280 tokens"):
        check_draft_warmup(_config(), kv_groups=1)
    check_draft_warmup(_config(seqs=25), kv_groups=1)
    check_draft_warmup(_config(mode=0), kv_groups=1)  # no torch.compile (decode graphs only): no ranges to leave
    check_draft_warmup(_config(jit=False), kv_groups=1)  # --kernel-config '{"enable_jit_warmup": false}'
    check_draft_warmup(_config(method="eagle3"), kv_groups=1)  # another speculator's prefill
    check_draft_warmup(_config(blocks=None), kv_groups=1)  # a KV cache not sized yet: not certain
    check_draft_warmup(_config(), kv_groups=2)  # hybrid caches: the warm-up's blocks per request not known here
    check_draft_warmup(_config(blocks=41), kv_groups=1)  # the KV cache caps the warm-up at 10 requests
    check_draft_warmup(_config(blocks=161), kv_groups=1)  # 40 requests with one group, 20 if the draft has its own
    check_draft_warmup(types.SimpleNamespace(speculative_config=None), kv_groups=1)


def test_the_manager_is_not_built_for_a_server_whose_warm_up_would_stop() -> None:
    """The refusal comes where vLLM builds our manager (the runner's KV cache set-up), before the warm-up."""
    from dspark_cli.engines.vllm.config import DsparkVllmSettings
    from dspark_cli.engines.vllm.manager import create_manager

    kwargs = {"vllm_config": _config(), "attn_groups": [[object()]]}
    with pytest.raises(ValueError, match=r"--max-num-seqs 25 or fewer"):
        create_manager(DsparkVllmSettings(mode="varlen"), types.SimpleNamespace(), kwargs)


# vLLM 0.33's default capture sizes up to 256 tokens: 1, 2, 4, then every 8
CAPTURED_256 = [1, 2, 4, *range(8, 257, 8)]


def test_the_profile_batches_that_stopped_the_sittings_servers_overflow() -> None:
    """Section 38: past the warm-up, every drafting server of the lossless check (256 tokens, 25 requests, K=7)
    stopped in the start-up profile's dummy run of 256 tokens with "Shape: 257 out of considered ranges"."""
    assert dummy_draft_overflow(256, CAPTURED_256, 25, 256, 1) == 257  # 231 tokens padded to 232, plus 25 slots
    assert [n for n in CAPTURED_256 if dummy_draft_overflow(n, CAPTURED_256, 25, 256, 1)] == [232, 240, 248, 256]
    assert dummy_draft_overflow(224, CAPTURED_256, 25, 256, 1) is None  # 224 + 25 fit untrimmed
    assert dummy_draft_overflow(256, CAPTURED_256, 25, 256, 0) is None  # no extra slot (EAGLE-like): no trim
    assert dummy_draft_overflow(512, [*CAPTURED_256, 512], 256, 8192, 1) is None  # the matrices' servers
    assert dummy_draft_overflow(384, CAPTURED_256, 25, 384, 1) is None  # past the largest graph: unpadded


def _simulated_draft_tokens(num_tokens: int, captured: list[int], max_reqs: int, budget: int) -> int:
    """vLLM 0.33's path, step by step: ``_dummy_run``'s trim, the dispatcher's candidate ranges (every count from
    one past the previous captured size up to a captured size replays that size's graph), ``make_dummy`` at the
    graph's size, and the draft's prefill over it plus one slot per request."""
    reqs = min(num_tokens, max_reqs)  # a draft_model speculator's num_query_per_req is 1
    tokens = min(num_tokens, budget - reqs)
    ranges: dict[int, int] = {}
    start = 0
    for size in sorted(captured):
        for i in range(start, size + 1):
            ranges[i] = size
        start = size + 1
    return ranges.get(tokens, tokens) + reqs


@given(budget=st.integers(16, 2048), max_reqs=st.integers(1, 512), step=st.sampled_from([8, 16]),
       data=st.data())
def test_the_profile_keeps_exactly_the_batches_whose_draft_pass_fits(budget: int, max_reqs: int, step: int,
                                                                       data: st.DataObject) -> None:
    largest = data.draw(st.integers(8, budget))
    captured = sorted({1, 2, 4, *range(8, largest + 1, step)})
    tails = sorted({min(captured[-1] * 2, budget), budget})
    for n in captured + tails:
        simulated = _simulated_draft_tokens(n, captured, max_reqs, budget)
        over = dummy_draft_overflow(n, captured, max_reqs, budget, 1)
        assert (over is not None) == (simulated > budget), (n, simulated, over)
        if over is not None:
            assert over == simulated and n + min(n, max_reqs) > budget  # only trimmed batches overflow


def test_the_default_capture_sizes_are_the_ones_the_sittings_servers_logged() -> None:
    """Both lists as vLLM 0.33 printed them in section 38's server logs (compilation config, K=7)."""
    assert default_capture_sizes(25, 256, 7) == CAPTURED_256  # the lossless check: 25 requests, 256 tokens
    assert default_capture_sizes(256, 8192, 7) == [*CAPTURED_256, *range(272, 513, 16)]  # group 1's servers
    assert profile_sizes(CAPTURED_256, 256) == CAPTURED_256  # the budget is captured: no tail
    assert profile_sizes([1, 2, 4, 8], 64) == [1, 2, 4, 8, 12, 16, 32, 64]


def test_upstreams_profile_overflow_is_named_with_a_budget_that_serves() -> None:
    problem = profile_overflow(25, 256, 7)
    assert problem is not None and "over 257 tokens" in problem and "--max-num-batched-tokens 425 or more" in problem
    assert profile_overflow(25, 425, 7) is None
    assert profile_overflow(256, 8192, 7) is None and profile_overflow(1024, 8192, 7) is None  # vLLM's defaults


@given(seqs=st.integers(1, 1024), budget=st.integers(16, 4096), k=st.integers(1, 15))
def test_the_budget_profile_overflow_names_serves(seqs: int, budget: int, k: int) -> None:
    problem = profile_overflow(seqs, budget, k)
    if problem is None:
        return
    enough = int(problem.rsplit("--max-num-batched-tokens ", 1)[1].split()[0])
    assert enough > budget and profile_overflow(seqs, enough, k) is None


def test_the_readmes_vllm_examples_start_under_vllms_default_budgets() -> None:
    """The README's `dspark serve --engine vllm -k 7 ...` and its bench line: under vLLM 0.33's default budget
    and request count per card (API server: 8,192 and 1,024 on an H100 or H200, 16,384 and 1,024 on 160 GB cards,
    2,048 and 256 below; ``EngineArgs.get_batch_defaults``), neither the warm-up nor vLLM's own start-up profile
    may stop the server. Without `--max-num-seqs` k=7 would not start on an H100: 910 warm-up requests of 10."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    examples = re.findall(r"--engine vllm -k (\d+)((?: --[\w-]+ \d+)*)", " ".join(readme.split()))
    assert len(examples) >= 2
    defaults = ((8192, 1024), (16384, 1024), (2048, 256))
    for k, flags in examples:
        seqs = re.search(r"--max-num-seqs (\d+)", flags)
        for budget, default_seqs in defaults:
            m = int(seqs.group(1)) if seqs else default_seqs
            assert warmup_overflow(m, budget, int(k)) is None, (k, flags, budget)
            assert profile_overflow(m, budget, int(k)) is None, (k, flags, budget)
    assert warmup_overflow(1024, 8192, 7) is not None  # why the examples name --max-num-seqs
