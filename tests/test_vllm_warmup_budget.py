"""vLLM 0.33's start-up warm-up against a draft_model server's token budget (contract.warmup_overflow).

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

from dspark_cli.engines.vllm.contract import warmup_kv_cap, warmup_overflow
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
