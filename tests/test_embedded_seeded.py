"""Seeded requests' counter-based uniforms: a stream per seed, batch-invariant, drawn for a whole batch at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_embedded_engine import TinyPair, make_engine, prompts

from dspark_cli.engines.embedded.seeded import counter_uniforms
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.errors import DsparkError

SEEDS = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS, start=st.integers(0, 1 << 40), n=st.integers(1, 40), cut=st.integers(0, 40))
def test_a_stream_is_a_function_of_seed_and_index_only(seed: int, start: int, n: int, cut: int) -> None:
    cut = min(cut, n)
    whole = counter_uniforms(torch.tensor([seed]), torch.tensor([start]), n)[0]
    head = counter_uniforms(torch.tensor([seed]), torch.tensor([start]), cut)[0]
    tail = counter_uniforms(torch.tensor([seed]), torch.tensor([start + cut]), n - cut)[0]
    assert torch.equal(whole, torch.cat([head, tail]))  # drawing in pieces = drawing at once
    assert whole.dtype == torch.float32 and bool(((whole >= 0) & (whole < 1)).all())
    # the other rows of a batch do not change a row
    batch = counter_uniforms(torch.tensor([seed ^ 1, seed, 7]), torch.tensor([3, start, 0]), n)
    assert torch.equal(batch[1], whole)


def test_draws_look_uniform_and_independent() -> None:
    u = counter_uniforms(torch.arange(512), torch.zeros(512, dtype=torch.int64), 512).double()
    flat = u.flatten()
    assert abs(flat.mean().item() - 0.5) < 0.005 and abs(flat.var().item() - 1 / 12) < 0.002
    counts = np.histogram(flat.numpy(), bins=64, range=(0, 1))[0]
    expected = flat.numel() / 64
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 120  # 63 degrees of freedom: p ~ 1e-5 at 120
    # neighbouring seeds and neighbouring draws are uncorrelated
    assert abs(np.corrcoef(u[0].numpy(), u[1].numpy())[0, 1]) < 0.15
    lag = np.corrcoef(flat[1:].numpy(), flat[:-1].numpy())[0, 1]
    assert abs(lag) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_and_cpu_streams_agree() -> None:
    seeds = torch.tensor([0, 1, -5, (1 << 63) - 1, 123456789])
    offsets = torch.tensor([0, 10, 1 << 33, 5, 77])
    assert torch.equal(counter_uniforms(seeds, offsets, 33),
                       counter_uniforms(seeds.cuda(), offsets.cuda(), 33).cpu())


def test_engine_draws_seeded_rows_from_their_streams_and_advances_them(pair: TinyPair) -> None:
    engine = make_engine(pair, num_speculative_tokens=0)
    for i, prompt in enumerate(prompts(4)):
        seed = None if i == 2 else 100 + i
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=seed))
    seqs = sorted(engine._seqs.values(), key=lambda s: s.request_id)
    seqs[1].rng_offset = 9
    u = engine._uniforms(seqs, 5)
    for i in (0, 1, 3):
        want = counter_uniforms(torch.tensor([100 + i]), torch.tensor([9 if i == 1 else 0]), 5)[0]
        assert torch.equal(u[i], want)
    assert [s.rng_offset for s in seqs] == [5, 14, 0, 5]


def test_a_seeded_request_samples_the_same_tokens_whatever_runs_beside_it(pair: TinyPair) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=42)
    alone = make_engine(pair, num_speculative_tokens=0).generate(prompts(1), params)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s) for s in (None, 7, None)]
    outs = make_engine(pair, num_speculative_tokens=0).generate(prompts(4), [params, *others])
    assert outs[0] == alone


def test_seeds_beyond_64_bits_are_refused() -> None:
    with pytest.raises(DsparkError, match="64 bits"):
        SamplingParams(seed=1 << 63).validate()
