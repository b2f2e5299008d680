"""Pinned staging of a step's host inputs: values survive buffer reuse, and the engine decodes the same tokens
through it (the arena runs over ordinary host memory here; the CUDA suite runs it pinned)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_embedded_engine import TinyPair, make_engine, prompts

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.engines.embedded.staging import PinnedStaging

CPU = torch.device("cpu")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 90), st.sampled_from([np.int64, np.float32, np.int32, np.bool_])),
                min_size=1, max_size=40))
def test_every_staged_array_keeps_its_values_across_buffer_reuse(arrays: list[tuple[int, type]]) -> None:
    staging = PinnedStaging(CPU, buffer_bytes=256, pin=False)
    rng = np.random.default_rng(len(arrays))
    sent, got = [], []
    for n, dtype in arrays:
        a = (rng.integers(0, 1000, size=n) % (2 if dtype is np.bool_ else 1000)).astype(dtype)
        sent.append(a.copy())
        got.append(staging.to_device(a))
        a[...] = 0  # the caller may reuse its array at once
    for a, t in zip(sent, got, strict=True):
        assert t.shape == a.shape and t.numpy().dtype == a.dtype
        np.testing.assert_array_equal(t.numpy(), a)
    # 256-byte buffers: anything over 32 int64 takes the fallback; each falls back exactly once
    assert staging.num_fallbacks == sum(n * np.dtype(d).itemsize > 256 for n, d in arrays)


def test_shapes_tensors_and_empty_arrays() -> None:
    staging = PinnedStaging(CPU, buffer_bytes=1024, pin=False)
    assert staging.to_device(np.array(5)).shape == ()
    table = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # not contiguous
    np.testing.assert_array_equal(staging.to_device(table).numpy(), table)
    t = torch.tensor([0.5, 1.5])
    out = staging.to_device(t)
    t[0] = 9.0
    assert out.tolist() == [0.5, 1.5]
    assert staging.to_device(np.zeros((0, 3), dtype=np.int64)).shape == (0, 3)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_buffers"):
        PinnedStaging(CPU, buffer_bytes=1024, num_buffers=1, pin=False)


@pytest.mark.parametrize("mode", ["none", "varlen"])
def test_engine_decodes_the_same_tokens_through_small_staging_buffers(pair: TinyPair, mode: str) -> None:
    """Buffers of 2 KB wrap every step or two: a stale or overwritten input would change the tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = make_engine(pair, num_speculative_tokens=0).generate(prompts(6), greedy)
    engine = make_engine(pair, draft=str(pair.draft_head), sps_curve=str(pair.curve),
                         capacity=CapacityConfig(mode=mode))
    engine.runner._staging = PinnedStaging(CPU, buffer_bytes=2048, pin=False)
    assert engine.generate(prompts(6), greedy) == reference
    assert engine.stats.num_drafts > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_buffers_are_not_reused_before_their_copies_ran() -> None:
    """The device is kept busy, so the copies queue behind its work while the host wraps around 1 KB
    buffers many times: a buffer reused before its copies ran would hand a later array's bytes to them."""
    device = torch.device("cuda")
    staging = PinnedStaging(device, buffer_bytes=1024)
    a = torch.randn(2048, 2048, device=device)
    for _ in range(20):  # ~tens of ms of queued work ahead of every copy below
        a = a @ a
        a = a / a.norm()
    sent = [np.full(100, i, dtype=np.int64) for i in range(200)]  # 800 B each: a buffer switch per array
    got = [staging.to_device(x) for x in sent]
    torch.cuda.synchronize()
    for x, t in zip(sent, got, strict=True):
        assert t.device.type == "cuda"
        np.testing.assert_array_equal(t.cpu().numpy(), x)
    assert staging.num_fallbacks == 0
