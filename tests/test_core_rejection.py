"""Rejection sampling over ragged drafts: greedy decoding is reproduced token for token, and the emitted
token sequence has exactly the target's autoregressive distribution (chi-square), with and without
pruning, with temperature / top-p, with real or one-hot draft probabilities, on both layouts."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

from dspark_cli.core.layout import build_mask_layout, build_varlen_layout
from dspark_cli.core.rejection import apply_sampling_params, inverse_cdf_sample, rejection_sample, sample

V = 6
K = 3
GEN = 3  # tokens generated per sequence: the test compares distributions over V**GEN sequences
P = GEN * (K + 1) + K + 2  # absolute positions a run can reach


@dataclass
class World:
    """A Markov 'model': the target's logits for the token after position a depend on (a, token at a)."""

    target: torch.Tensor  # [P, V, V]
    draft: torch.Tensor  # [P, V, V] draft logits (what the drafter samples from)

    @classmethod
    def make(cls, seed: int) -> World:
        gen = torch.Generator().manual_seed(seed)
        return cls(torch.randn(P, V, V, generator=gen) * 1.5, torch.randn(P, V, V, generator=gen) * 1.5)


def _step_inputs(world: World, last: torch.Tensor, count: torch.Tensor, greedy_drafts: bool, gen: torch.Generator):
    """Drafts sampled from the draft table (or the target's argmax chain), and the q rows they came from."""
    n = last.shape[0]
    drafts = torch.empty(n, K, dtype=torch.int64)
    qs = torch.empty(n, K, V)
    prev = last
    for j in range(K):
        q = world.draft[count + j, prev].softmax(-1)
        d = torch.multinomial(q, 1, generator=gen).squeeze(1)
        if greedy_drafts:
            # Mostly the target's greedy continuation so that long accepted runs are exercised.
            good = world.target[count + j, prev].argmax(-1)
            keep = torch.rand(n, generator=gen) < 0.75
            d = torch.where(keep, good, d)
        drafts[:, j] = d
        qs[:, j] = q
        prev = d
    return drafts, qs


def _generate(world: World, n: int, *, seed: int, temperature: torch.Tensor | None,
              top_p: torch.Tensor | None = None, prune: bool = True, layout: str = "varlen",
              use_q: bool = True, wrong_q: bool = False, device: str = "cpu",
              use_triton: bool | None = None) -> torch.Tensor:
    """Run speculative steps until every row has GEN tokens; returns [n, GEN] generated after token 0.

    Everything random is drawn on the CPU from one generator (the uniforms too), so the sampler itself
    can run on another ``device``.
    """
    dev = torch.device(device)
    moved = {k: None if v is None else v.to(dev) for k, v in (("temperature", temperature), ("top_p", top_p))}
    gen = torch.Generator().manual_seed(seed)
    seq = torch.zeros(n, P + K + 2, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)  # index of the last token in seq = its absolute position
    rows_ar = torch.arange(n)
    for _ in range(GEN):
        last = seq[rows_ar, count]
        drafts, qs = _step_inputs(world, last, count, greedy_drafts=temperature is None, gen=gen)
        admitted = torch.randint(0, K + 1, (n,), generator=gen) if prune else torch.full((n,), K)
        if layout == "varlen":
            extra = int(torch.randint(0, 5, (1,), generator=gen))
            lay = build_varlen_layout(last, drafts, admitted, count, n + int(admitted.sum()) + extra)
        else:
            lay = build_mask_layout(last, drafts, admitted, count)
        pos_c = lay.positions.clamp(max=P - 1)
        logits = world.target[pos_c, lay.input_ids]
        draft_probs = qs if use_q else None
        if wrong_q:
            draft_probs = torch.full_like(qs, 1.0 / V)  # claims uniform drafts: must break losslessness
        u = None if temperature is None else torch.rand(lay.num_rows, 2, generator=gen)
        rows = lay if dev.type == "cpu" else (lay.req_index.to(dev), lay.pos_in_req.to(dev), (~lay.is_padding).to(dev))
        out = rejection_sample(logits.to(dev), rows, drafts.to(dev), admitted.to(dev),
                               draft_probs=None if draft_probs is None else draft_probs.to(dev),
                               uniforms=None if u is None else u.to(dev), use_triton=use_triton, **moved)
        out = type(out)(**{f: getattr(out, f).cpu() for f in out.__dataclass_fields__})
        assert (out.num_emitted == out.num_accepted + 1).all()
        assert (out.num_accepted <= admitted).all()
        cols = torch.arange(K + 1)
        emitted = cols.unsqueeze(0) < out.num_emitted.unsqueeze(1)
        assert (out.tokens[emitted] >= 0).all() and (out.tokens[~emitted] == -1).all()
        dest = torch.where(emitted, count.unsqueeze(1) + 1 + cols, seq.shape[1] - 1)
        seq.scatter_(1, dest, torch.where(emitted, out.tokens, 0))
        count = count + out.num_emitted
    assert (count >= GEN).all()
    return seq[:, 1 : GEN + 1]


def _target_dist(world: World, temperature: float, top_p: float | None) -> np.ndarray:
    """Exact probability of every GEN-token continuation of token 0 under non-speculative sampling."""
    probs = np.zeros(V**GEN)
    step = []
    for a in range(GEN):
        t = torch.full((V,), temperature)
        tp = None if top_p is None else torch.full((V,), top_p)
        step.append(apply_sampling_params(world.target[a], t, tp).softmax(-1).double().numpy())
    for code, toks in enumerate(itertools.product(range(V), repeat=GEN)):
        p, prev = 1.0, 0
        for a, tok in enumerate(toks):
            p *= step[a][prev, tok]
            prev = tok
        probs[code] = p
    return probs


def _chi_square_pvalue(samples: torch.Tensor, probs: np.ndarray) -> float:
    codes = (samples * torch.tensor([V ** (GEN - 1 - i) for i in range(GEN)])).sum(1).numpy()
    observed = np.bincount(codes, minlength=V**GEN).astype(float)
    expected = probs * len(codes)
    # A sequence the target cannot produce must never appear (top-p zeroes whole branches).
    assert observed[probs == 0].sum() == 0
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * (obs.sum() / exp.sum())  # float rounding of the exact probabilities; scipy checks the sums
    return float(stats.chisquare(obs, exp).pvalue)


N_DRAWS = 40_000


@pytest.mark.parametrize(
    "case",
    [
        dict(temperature=1.0, top_p=None, prune=False, layout="varlen", use_q=True),
        dict(temperature=1.0, top_p=None, prune=True, layout="varlen", use_q=True),
        dict(temperature=0.7, top_p=0.8, prune=True, layout="mask", use_q=True),
        dict(temperature=1.3, top_p=None, prune=True, layout="varlen", use_q=False),
        dict(temperature=1.0, top_p=0.6, prune=False, layout="mask", use_q=False),
    ],
    ids=["full-q", "pruned-q", "temp-topp-mask", "onehot-pruned", "onehot-topp"],
)
def test_emitted_sequence_matches_target_distribution(case: dict) -> None:
    world = World.make(seed=11)
    temp = torch.full((N_DRAWS,), case["temperature"])
    top_p = None if case["top_p"] is None else torch.full((N_DRAWS,), case["top_p"])
    samples = _generate(world, N_DRAWS, seed=7, temperature=temp, top_p=top_p, prune=case["prune"],
                        layout=case["layout"], use_q=case["use_q"])
    pvalue = _chi_square_pvalue(samples, _target_dist(world, case["temperature"], case["top_p"]))
    assert pvalue > 1e-3, f"emitted distribution differs from the target's (p={pvalue:.2e})"


def test_chi_square_detects_a_lossy_sampler() -> None:
    # Negative control: lying about q (uniform instead of the draft's real distribution) biases the
    # output; the same statistic must reject it, otherwise the lossless tests above prove nothing.
    world = World.make(seed=11)
    temp = torch.ones(N_DRAWS)
    samples = _generate(world, N_DRAWS, seed=7, temperature=temp, prune=False, wrong_q=True)
    assert _chi_square_pvalue(samples, _target_dist(world, 1.0, None)) < 1e-3


def _greedy_chain(world: World) -> list[int]:
    prev, out = 0, []
    for a in range(GEN):
        prev = int(world.target[a, prev].argmax())
        out.append(prev)
    return out


@pytest.mark.parametrize("layout", ["varlen", "mask"])
@pytest.mark.parametrize("prune", [False, True])
def test_greedy_matches_argmax_decoding(layout: str, prune: bool) -> None:
    world = World.make(seed=3)
    samples = _generate(world, 2000, seed=5, temperature=None, prune=prune, layout=layout)
    expected = torch.tensor(_greedy_chain(world))
    assert (samples == expected).all()


def test_greedy_rows_inside_a_sampled_batch_are_exact() -> None:
    world = World.make(seed=4)
    n = 3000
    temp = torch.where(torch.arange(n) % 3 == 0, torch.tensor(0.0), torch.tensor(1.0))
    temp[1::6] = -1.0  # any value <= 0 means greedy
    samples = _generate(world, n, seed=9, temperature=temp, prune=True)
    greedy = temp <= 0
    assert (samples[greedy] == torch.tensor(_greedy_chain(world))).all()
    # The sampled rows are not all greedy (sanity: the batch really mixes both kinds).
    assert (samples[~greedy] != torch.tensor(_greedy_chain(world))).any()


def test_pruned_slots_are_never_accepted() -> None:
    gen = torch.Generator().manual_seed(0)
    num_reqs, vocab = 64, 50
    last = torch.randint(0, vocab, (num_reqs,), generator=gen)
    admitted = torch.randint(0, K + 1, (num_reqs,), generator=gen)
    lay = build_mask_layout(last, torch.zeros(num_reqs, K, dtype=torch.int64), admitted, torch.zeros_like(last))
    logits = torch.randn(lay.num_rows, vocab, generator=gen)
    # Every draft equals the target argmax of its row, so only pruning can stop acceptance.
    drafts = logits.argmax(-1).view(num_reqs, K + 1)[:, :K].contiguous()
    out = rejection_sample(logits, lay, drafts, admitted)
    assert out.num_accepted.tolist() == admitted.tolist()
    bonus = logits.argmax(-1).view(num_reqs, K + 1)[torch.arange(num_reqs), admitted]
    assert out.tokens[torch.arange(num_reqs), admitted].tolist() == bonus.tolist()
    # Same for sampling with p == q on every draft (acceptance probability 1) and one-hot q = certain drafts.
    probs = logits.softmax(-1).view(num_reqs, K + 1, vocab)[:, :K]
    samp = rejection_sample(logits, lay, drafts, admitted, temperature=torch.ones(num_reqs),
                            draft_probs=probs.contiguous(), generator=gen)
    assert samp.num_accepted.tolist() == admitted.tolist()


def test_layouts_and_row_maps_give_identical_results() -> None:
    gen = torch.Generator().manual_seed(1)
    num_reqs, vocab = 40, 30
    last = torch.randint(0, vocab, (num_reqs,), generator=gen)
    drafts = torch.randint(0, vocab, (num_reqs, K), generator=gen)
    admitted = torch.randint(0, K + 1, (num_reqs,), generator=gen)
    start = torch.randint(0, 100, (num_reqs,), generator=gen)
    slot_logits = torch.randn(num_reqs, K + 1, vocab, generator=gen)
    slot_logits[:, :, 0] += 2.0  # make some drafts of token 0 likely to be accepted
    drafts[::2] = 0
    slot_u = torch.rand(num_reqs, K + 1, 2, generator=gen)
    q = torch.rand(num_reqs, K, vocab, generator=gen).softmax(-1)
    temp = torch.rand(num_reqs, generator=gen) + 0.3
    temp[::5] = 0.0
    outs = []
    for lay in (build_varlen_layout(last, drafts, admitted, start, num_reqs * (K + 1) + 3),
                build_mask_layout(last, drafts, admitted, start)):
        req = lay.req_index.clamp(max=num_reqs - 1)
        logits, u = slot_logits[req, lay.pos_in_req], slot_u[req, lay.pos_in_req]
        for rows in (lay, (lay.req_index, lay.pos_in_req, ~lay.is_padding)):
            for kwargs in ({}, {"temperature": temp, "draft_probs": q, "uniforms": u},
                           {"temperature": temp, "top_p": torch.full((num_reqs,), 0.9), "uniforms": u}):
                outs.append((str(sorted(kwargs)), rejection_sample(logits, rows, drafts, admitted, **kwargs)))
    for key, out in outs:
        ref = next(o for k, o in outs if k == key)
        assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_accepted, ref.num_accepted)


def test_rejection_sample_never_reads_tensor_values() -> None:
    meta = torch.device("meta")
    num_reqs, vocab, rows = 6, 100, 40
    lay = build_varlen_layout(torch.empty(num_reqs, dtype=torch.int64, device=meta),
                              torch.empty(num_reqs, K, dtype=torch.int64, device=meta),
                              torch.empty(num_reqs, dtype=torch.int32, device=meta),
                              torch.empty(num_reqs, dtype=torch.int64, device=meta), rows)
    drafts = torch.empty(num_reqs, K, dtype=torch.int64, device=meta)
    adm = torch.empty(num_reqs, dtype=torch.int32, device=meta)
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device=meta)
    for kwargs in ({}, {"temperature": torch.empty(num_reqs, device=meta)},
                   {"temperature": torch.empty(num_reqs, device=meta),
                    "draft_probs": torch.empty(num_reqs, K, vocab, device=meta),
                    "top_p": torch.empty(num_reqs, device=meta)}):
        out = rejection_sample(logits, lay, drafts, adm, **kwargs)
        assert out.tokens.shape == (num_reqs, K + 1) and out.num_accepted.shape == (num_reqs,)


def test_inverse_cdf_sampling_skips_zero_weights() -> None:
    w = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    for u, expect in ((0.0, [1, 4, 0]), (0.2499, [1, 4, 0]), (0.25, [3, 4, 0]), (1 - 2**-24, [3, 4, 0])):
        assert inverse_cdf_sample(w, torch.full((3,), u)).tolist() == expect


def test_plain_sampler_uses_the_same_distribution() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 8, generator=gen).expand(200_000, 8)
    temp, top_p = torch.full((200_000,), 0.8), torch.full((200_000,), 0.7)
    toks = sample(logits, temp, top_p, generator=gen)
    probs = apply_sampling_params(logits[:1], temp[:1], top_p[:1]).softmax(-1)[0].double().numpy()
    observed = np.bincount(toks.numpy(), minlength=8)
    assert observed[probs == 0].sum() == 0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * len(toks)
    assert stats.chisquare(observed[keep], expected).pvalue > 1e-3
    assert torch.equal(sample(logits[:5], None), logits[:5].argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_matches_eager_without_syncs() -> None:
    dev = torch.device("cuda")
    num_reqs, vocab = 16, 1000
    width = K + 1
    gen = torch.Generator(device=dev).manual_seed(0)
    last = torch.randint(0, vocab, (num_reqs,), device=dev)
    drafts = torch.randint(0, vocab, (num_reqs, K), device=dev)
    admitted = torch.randint(0, K + 1, (num_reqs,), device=dev)
    start = torch.randint(0, 100, (num_reqs,), device=dev)
    logits = torch.randn(num_reqs * width, vocab, device=dev)
    temp = torch.rand(num_reqs, device=dev) + 0.2
    q = torch.rand(num_reqs, K, vocab, device=dev).softmax(-1)
    u = torch.rand(num_reqs * width, 2, device=dev)

    def step():
        lay = build_varlen_layout(last, drafts, admitted, start, num_reqs * width)
        return rejection_sample(logits, lay, drafts, admitted, temperature=temp, draft_probs=q, uniforms=u)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(5):
        admitted.copy_(torch.randint(0, K + 1, (num_reqs,), device=dev, generator=gen))
        logits.copy_(torch.randn(logits.shape, device=dev, generator=gen))
        drafts.copy_(logits.view(num_reqs, width, vocab)[:, :K].argmax(-1))
        u.copy_(torch.rand(u.shape, device=dev, generator=gen))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = step()
        assert torch.equal(static_out.tokens, ref.tokens)


_CUDA_CASES = [
    dict(temperature=1.0, prune=False, use_q=True),
    dict(temperature=1.0, prune=True, use_q=True),
    dict(temperature=1.3, prune=True, use_q=False),
    dict(temperature=0.7, prune=False, use_q=False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", _CUDA_CASES, ids=["full-q", "pruned-q", "onehot-pruned", "onehot-cold"])
def test_triton_sampler_on_cuda_matches_target_distribution(case: dict) -> None:
    # The same chi-square test as the torch path, through the fused kernels compiled for the GPU (the CPU
    # interpreter cannot show GPU-only arithmetic such as approximate exp or reduction order).
    pytest.importorskip("triton")
    world = World.make(seed=11)
    temp = torch.full((N_DRAWS,), case["temperature"])
    samples = _generate(world, N_DRAWS, seed=7, temperature=temp, prune=case["prune"], use_q=case["use_q"],
                        device="cuda", use_triton=True)
    pvalue = _chi_square_pvalue(samples, _target_dist(world, case["temperature"], None))
    assert pvalue > 1e-3, f"fused sampler's emitted distribution differs from the target's (p={pvalue:.2e})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_greedy_on_cuda_matches_argmax_decoding() -> None:
    pytest.importorskip("triton")
    world = World.make(seed=3)
    samples = _generate(world, 2000, seed=5, temperature=None, prune=True, device="cuda", use_triton=True)
    assert (samples == torch.tensor(_greedy_chain(world))).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_sampler_on_cuda_agrees_with_torch_at_a_real_vocabulary_size() -> None:
    # Near-flat distributions over ~50k tokens make every token's mass (~2e-5) comparable to float32
    # drift in a running sum, so the two paths only agree because both accumulate the inverse CDF in
    # float64 and compute the emit weights with the same operations. What may still differ is the accept
    # test u * q < p at one row in about a million (p from a different exp/reduction order).
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    num_reqs, k, vocab = 256, 7, 49152
    rows = num_reqs * (k + 1)
    mismatched, total = 0, 0
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(2):
            logits = (torch.randn(rows, vocab, device=dev, generator=gen) * 2.0)
            logits[:, :8] += 4.0
            logits = logits.to(dtype)
            drafts = torch.randint(0, 8, (num_reqs, k), device=dev, generator=gen)
            admitted = torch.randint(0, k + 1, (num_reqs,), device=dev, generator=gen)
            lay = build_varlen_layout(torch.zeros(num_reqs, dtype=torch.long, device=dev), drafts, admitted,
                                      torch.zeros(num_reqs, dtype=torch.long, device=dev), rows)
            temp = torch.rand(num_reqs, device=dev, generator=gen) + 0.5
            u = torch.rand(rows, 2, device=dev, generator=gen)
            q = torch.randn(num_reqs, k, vocab, device=dev, generator=gen)
            q[:, :, :8] += 3.0
            q = q.softmax(-1)
            for kw in ({}, {"temperature": temp, "uniforms": u},
                       {"temperature": temp, "uniforms": u, "draft_probs": q}):
                a = rejection_sample(logits, lay, drafts, admitted, use_triton=False, **kw)
                b = rejection_sample(logits, lay, drafts, admitted, use_triton=True, **kw)
                diff = int((a.tokens != b.tokens).any(dim=1).sum())
                if not kw:
                    assert diff == 0, "greedy must agree exactly"
                mismatched += diff
                total += num_reqs
    assert mismatched <= 2, f"{mismatched} of {total} requests differ between the fused and torch samplers"


_TRITON_CHECK = """
import torch
from dspark_cli.core.layout import build_mask_layout, build_varlen_layout
from dspark_cli.core.rejection import rejection_sample
FIELDS = ("input_ids", "positions", "req_index", "pos_in_req", "is_padding", "query_start_loc", "seq_lens",
          "num_tokens", "num_logits_per_req")
gen = torch.Generator().manual_seed(0)
for num_reqs, k in ((1, 1), (3, 7), (130, 3), (300, 7)):
    for extra in (0, 5):
        last = torch.randint(0, 100, (num_reqs,), generator=gen)
        drafts = torch.randint(0, 100, (num_reqs, k), generator=gen).int()
        adm = torch.randint(0, k + 1, (num_reqs,), generator=gen).int()
        start = torch.randint(0, 1000, (num_reqs,), generator=gen)
        rows = num_reqs + int(adm.sum()) + extra
        a = build_varlen_layout(last, drafts, adm, start, rows, use_triton=False)
        b = build_varlen_layout(last, drafts, adm, start, rows, use_triton=True)
        for f in FIELDS:
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and torch.equal(x, y), (num_reqs, k, extra, f, x, y)
for num_reqs, k, vocab in ((5, 3, 37), (9, 7, 300), (3, 2, 5000)):
    last = torch.randint(0, vocab, (num_reqs,), generator=gen)
    adm = torch.randint(0, k + 1, (num_reqs,), generator=gen)
    slot_logits = torch.randn(num_reqs, k + 1, vocab, generator=gen) * 2
    # Drafts mostly equal the target argmax and q is close to p, so long accepted runs occur too.
    drafts = slot_logits[:, :k].argmax(-1)
    drafts = torch.where(torch.rand(num_reqs, k, generator=gen) < 0.8, drafts,
                         torch.randint(0, vocab, (num_reqs, k), generator=gen))
    q = (slot_logits[:, :k] * 0.8).softmax(-1)
    slot_u = torch.rand(num_reqs, k + 1, 2, generator=gen)
    temp = torch.rand(num_reqs, generator=gen) + 0.3
    temp[::3] = 0.0
    accepted = 0
    for lay in (build_varlen_layout(last, drafts, adm, torch.zeros_like(last), num_reqs * (k + 1) + 2,
                                    use_triton=False),
                build_mask_layout(last, drafts, adm, torch.zeros_like(last))):
        req = lay.req_index.clamp(max=num_reqs - 1)
        for dtype in (torch.float32, torch.bfloat16):
            logits = slot_logits[req, lay.pos_in_req].to(dtype)
            u = slot_u[req, lay.pos_in_req]
            for kw in ({}, {"temperature": temp, "uniforms": u},
                       {"temperature": temp, "uniforms": u, "draft_probs": q}):
                a = rejection_sample(logits, lay, drafts, adm, use_triton=False, **kw)
                b = rejection_sample(logits, lay, drafts, adm, use_triton=True, **kw)
                assert torch.equal(a.tokens, b.tokens), (num_reqs, k, vocab, dtype, sorted(kw), a.tokens, b.tokens)
                assert torch.equal(a.num_accepted, b.num_accepted)
                accepted += int(a.num_accepted.sum())
    assert accepted > 0
print("triton-ok")
"""


def test_triton_kernels_match_torch_path_in_interpreter() -> None:
    # The fused kernels must take the same decisions as the torch reference given the same uniforms.
    # TRITON_INTERPRET must be set before triton is imported, hence the subprocess.
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "triton-ok" in res.stdout, res.stderr[-3000:]


def test_a_placeholder_in_a_slot_no_row_verifies_is_read_as_a_token_not_an_index() -> None:
    """Slots past ``admitted[r]`` are never verified; an engine may hold a placeholder (-1) there. The torch
    path used to gather at it for the bonus row when sampling (an out-of-range index); the outcome of the
    verified slots is the same as with a real token there."""
    gen = torch.Generator().manual_seed(3)
    drafts = torch.tensor([[3, 4, -1], [5, -1, -1]])
    admitted = torch.tensor([2, 1])
    last, start = torch.tensor([1, 2]), torch.tensor([10, 20])
    lay = build_varlen_layout(last, drafts, admitted, start, 5)
    logits = torch.randn(5, 10, generator=gen)
    u = torch.rand(5, 2, generator=gen)
    temp = torch.ones(2)
    out = rejection_sample(logits, lay, drafts, admitted, temperature=temp, uniforms=u, use_triton=False)
    ref = rejection_sample(logits, lay, drafts.clamp_min(0), admitted, temperature=temp, uniforms=u, use_triton=False)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_accepted, ref.num_accepted)


def test_top_p_always_keeps_the_most_likely_token() -> None:
    """A tiny top_p must leave exactly the argmax, not mask every token (an all -inf row: NaN probabilities, garbage
    samples)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0], [2.0, -1.0, 0.5, 0.0]])
    temp = torch.ones(2)
    for tp in (1e-9, 1e-12):
        z = apply_sampling_params(logits, temp, torch.full((2,), tp))
        assert torch.isfinite(z).sum(dim=-1).tolist() == [1, 1]
        assert z.argmax(-1).tolist() == logits.argmax(-1).tolist()
        assert sample(logits, temp, torch.full((2,), tp)).tolist() == logits.argmax(-1).tolist()


def test_top_p_uses_vllms_boundary_rule_on_exact_ties() -> None:
    """vLLM drops the ascending prefix whose mass is <= 1 - top_p. Four equal logits (exact 0.25 masses, common with
    bf16 logits) and top_p = 0.5 keep two."""
    z = apply_sampling_params(torch.zeros(1, 4), torch.ones(1), torch.tensor([0.5]))
    assert int(torch.isfinite(z).sum()) == 2


def test_inverse_cdf_sampling_of_an_all_zero_row_returns_token_zero() -> None:
    """The docstring promises 0 for an all-zero row; without the clamp searchsorted returns V, an out-of-range token
    id."""
    w = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.5, 1 - 2**-24):
        assert inverse_cdf_sample(w, torch.full((2,), u)).tolist() == [0, 1]
