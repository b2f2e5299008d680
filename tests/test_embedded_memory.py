"""The KV pool leaves the largest step its working memory (model_runner.step_reserve_bytes, kv_pool_budget).

A pool not capped by ``--max-num-seqs`` x ``--max-model-len`` took its whole share of the free memory, and with
a share near 1 (``--gpu-memory-utilization 0.9`` and up, as vLLM users pass) the first full step had nothing
left for its vocabulary-wide buffers. The estimate is checked against the allocator on a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_cli.engines.embedded.model_runner import kv_pool_budget, step_reserve_bytes

GIB = 1 << 30
LLAMA_3_8B = dict(vocab_size=128256, batched_tokens=2048, hidden_size=4096, intermediate_size=14336, dtype_bytes=2)


def test_the_reserve_for_an_8b_target_at_256_requests_is_what_its_vocabulary_wide_buffers_take() -> None:
    # served on an H100 (docs/PERFORMANCE.md section 44): 4.07 GiB drafting, 1.60 GiB not; the margin is 1.5x
    full = step_reserve_bytes(max_num_seqs=256, num_spec=7, cuda_graphs=True, drafts=True, **LLAMA_3_8B)
    assert 4.07 * GIB * 1.4 < full < 4.07 * GIB * 1.6
    plain = step_reserve_bytes(max_num_seqs=256, num_spec=0, cuda_graphs=True, drafts=False, **LLAMA_3_8B)
    assert 1.60 * GIB * 1.4 < plain < 1.60 * GIB * 1.6
    synthetic = step_reserve_bytes(max_num_seqs=256, num_spec=7, cuda_graphs=True, drafts=False, **LLAMA_3_8B)
    assert synthetic < full


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 512), st.integers(0, 8), st.booleans(), st.booleans())
def test_the_reserve_grows_with_requests_and_draft_length(seqs: int, k: int, graphs: bool, drafts: bool) -> None:
    def reserve(n: int, kk: int) -> int:
        return step_reserve_bytes(max_num_seqs=n, num_spec=kk, cuda_graphs=graphs, drafts=drafts, **LLAMA_3_8B)

    assert 0 < reserve(seqs, k) < reserve(seqs + 1, k)
    assert reserve(seqs, k) < reserve(seqs, k + 1)


def test_the_pool_takes_its_share_unless_the_largest_step_would_not_fit_beside_it() -> None:
    free, reserve = 63 * GIB, int(10.4 * GIB)
    assert kv_pool_budget(free, 0.5, reserve) == int(free * 0.5)  # the default share leaves room
    assert kv_pool_budget(free, 0.9, reserve) == free - reserve  # 0.9 would leave 6.3 GiB: the reserve wins
    assert kv_pool_budget(free, 1.0, reserve) == free - reserve
    assert kv_pool_budget(8 * GIB, 0.9, reserve) < 0  # nothing fits beside the step: the caller refuses


def test_the_peak_reservation_is_exported_as_a_gauge() -> None:
    from dspark_cli.engines.embedded.metrics import MetricsSnapshot, render_metrics

    text = render_metrics(MetricsSnapshot(step_memory_peak_bytes=42 * GIB), "m")
    assert f'dspark:step_memory_peak_bytes{{model_name="m",engine="0"}} {42 * GIB}' in text
    assert "# TYPE dspark:step_memory_peak_bytes gauge" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("seqs", "k"), [(128, 7), (256, 0)])
def test_the_steps_working_memory_stays_within_the_reserve_on_the_device(seqs: int, k: int) -> None:
    """Full batches of the heaviest path (a real draft at T=1: rejection sampling with the draft's
    distributions), and of plain decoding, under CUDA graphs, on a two-layer target of Llama-3-8B's width and
    vocabulary: what the allocator reached beyond the weights and the pool stays under the estimate kept for it."""
    from dspark_cli.engines.embedded.config import EngineConfig
    from dspark_cli.engines.embedded.engine import LLMEngine
    from dspark_cli.engines.embedded.sequence import SamplingParams

    # The runner measures the pool against everything allocated: an engine of an earlier case still held by a
    # reference cycle (its graphs) would count as this one's weights.
    gc.collect()
    torch.cuda.empty_cache()
    engine = LLMEngine(EngineConfig(
        model="random:llama-3-8b:layers=2", draft="random:small:layers=1" if k else None, num_speculative_tokens=k,
        device="cuda", max_num_seqs=seqs, max_model_len=128, seed=0,
    ))
    runner = engine.runner
    assert runner.step_reserve > 0 and runner.use_graphs
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, 1000, (32,), generator=g).tolist() for _ in range(seqs)]
    engine.generate(ps, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    assert (engine.stats.num_drafts > 0) == (k > 0)
    used = torch.cuda.max_memory_allocated() - runner.memory_with_pool
    print(f"working memory {used / GIB:.2f} GiB of {runner.step_reserve / GIB:.2f} GiB reserved")
    assert 0 < used <= runner.step_reserve
    assert 0 < engine.stats.step_memory_peak_bytes <= used  # the gauge, read every 64 steps
