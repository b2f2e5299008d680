"""The fused Triton sampler, in every kernel shape the benchmark times, against the torch reference.

The emit side (tile-mass kernel over requests x vocabulary chunks, then one final program per request), the
row kernel with groups of one to eight tokens, rows split into chunks (with the combine launch), unrolled,
plain and pipelined row loops must emit exactly the tokens of
``rejection.rejection_sample``'s torch path given the same uniforms: greedy, sampled with one-hot and real
draft probabilities, greedy requests mixed into sampled batches, pruned drafts, vocabularies that are not a
multiple of any block, one request, and small tiles so that a small vocabulary spans many tiles and
tile-mass programs (the inverse-CDF target then has to be located across tiles, which is the split path's
own logic). Every entry of ``SWEEP_VARIANTS`` runs with its blocks scaled down 16x (same code paths: full
tiles, a leftover tile per chunk, a partial tail) on a vocabulary of 12 full row tiles plus a tail.

Without a GPU the kernels run in Triton's CPU interpreter, which must be switched on before triton is
imported: the tests then re-run this file in a subprocess with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from dspark_cli.core._triton_rejection import SWEEP_VARIANTS
from dspark_cli.core.layout import build_mask_layout, build_varlen_layout
from dspark_cli.core.rejection import rejection_sample


@dataclass(frozen=True)
class Case:
    num_reqs: int
    k: int
    vocab: int
    seed: int = 0
    tile_block: int | None = None  # None: the sampler's defaults
    tile_subs: int | None = None
    row_block: int | None = None
    row_unroll: int = 1
    row_group: int | None = None
    row_split: int | None = None
    row_stages: int | None = None  # None: the sampler's default (pipelined from PIPELINE_MIN_ROWS rows)
    layout: str = "varlen"
    dtype: str = "fp32"
    prune: bool = True

    def knobs(self) -> dict:
        return dict(tile_block=self.tile_block, tile_subs=self.tile_subs, row_block=self.row_block,
                    row_unroll=self.row_unroll, row_group=self.row_group, row_split=self.row_split,
                    row_stages=self.row_stages)


CASES = {
    # default tiles; vocab not a multiple of the block (single partial tile)
    "defaults-odd-vocab": Case(5, 3, 37),
    # many small tiles, 2 per tile-mass program; 300 = 9 * 32 + 12: a partial tile and a padding tile; the
    # row kernel loads its 4 full tiles in pairs
    "many-tiles": Case(9, 7, 300, seed=1, tile_block=32, tile_subs=2, row_block=64, row_unroll=2),
    # one request, one tile per program, mask layout, bf16 logits
    "one-request": Case(1, 4, 200, seed=2, tile_block=16, tile_subs=1, layout="mask", dtype="bf16"),
    # no pruning (every request verifies K drafts), 4 tiles per program, the last program half past the
    # vocab; 7 full row tiles: 3 pairs, a single one and a partial one
    "unpruned": Case(6, 2, 1000, seed=3, tile_block=64, tile_subs=4, row_block=128, row_unroll=2, prune=False),
    # a real vocabulary-sized block: 5000 tokens over default 1024-token tiles (5 real of 8 planned)
    "default-tiles": Case(3, 2, 5000, seed=4),
    # rows split in 5 chunks over 12 full tiles: 2 tiles each, the first 2 chunks take one leftover tile,
    # the last one the partial tail; bf16 groups of 8 tokens
    "split-leftover": Case(4, 3, 12 * 32 + 5, seed=6, row_block=32, row_split=5, tile_block=32, dtype="bf16"),
    # one-token groups, rows split in 3 chunks, unrolled pairs (4 full tiles per chunk)
    "token-groups-split": Case(5, 2, 12 * 16 + 3, seed=7, row_block=16, row_group=1, row_split=3, row_unroll=2),
    # the pipelined loop, groups of 2 tokens, mask layout
    "stages": Case(3, 4, 700, seed=8, row_block=64, row_group=2, row_stages=3, layout="mask"),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(case: Case) -> dict:
    gen = torch.Generator().manual_seed(case.seed)
    r, k, v = case.num_reqs, case.k, case.vocab
    last = torch.randint(0, v, (r,), generator=gen)
    adm = torch.randint(0, k + 1, (r,), generator=gen) if case.prune else torch.full((r,), k)
    slot_logits = torch.randn(r, k + 1, v, generator=gen) * 2
    # Drafts mostly equal the target argmax and q is close to p, so long accepted runs (bonus tokens) occur
    # next to early rejections (residual tokens).
    drafts = slot_logits[:, :k].argmax(-1)
    drafts = torch.where(torch.rand(r, k, generator=gen) < 0.8, drafts, torch.randint(0, v, (r, k), generator=gen))
    q = (slot_logits[:, :k] * 0.8).softmax(-1)
    slot_u = torch.rand(r, k + 1, 2, generator=gen)
    # Edge uniforms: u = 0 takes the first positive weight, u just below 1 the end of the CDF.
    slot_u[::4, :, 1] = 0.0
    slot_u[1::4, :, 1] = 1.0 - 2.0**-24
    temp = torch.rand(r, generator=gen) + 0.3
    temp[::3] = 0.0  # greedy requests inside a sampled batch
    if case.layout == "varlen":
        lay = build_varlen_layout(last, drafts, adm, torch.zeros_like(last), r * (k + 1) + 2, use_triton=False)
    else:
        lay = build_mask_layout(last, drafts, adm, torch.zeros_like(last))
    req = lay.req_index.clamp(max=r - 1)
    logits = slot_logits[req, lay.pos_in_req].to(DTYPES[case.dtype])
    return dict(logits=logits, lay=lay, drafts=drafts, adm=adm, q=q, u=slot_u[req, lay.pos_in_req], temp=temp)


def _kinds(x: dict) -> dict[str, dict]:
    all_sampled = torch.where(x["temp"] > 0, x["temp"], 0.9)
    return {
        "greedy": {},
        "sampled": {"temperature": x["temp"], "uniforms": x["u"]},
        "sampled-q": {"temperature": x["temp"], "uniforms": x["u"], "draft_probs": x["q"]},
        "all-sampled-q": {"temperature": all_sampled, "uniforms": x["u"], "draft_probs": x["q"]},
    }


def check_case(case: Case) -> int:
    """Every kind equals the torch path; returns the accepted drafts seen."""
    return _check(case, [case.knobs()])


def _check(case: Case, knob_sets: list[dict], kinds: tuple[str, ...] | None = None) -> int:
    from dspark_cli.core import _triton_rejection

    x = _inputs(case)
    lay = x["lay"]
    accepted = 0
    for name, kw in _kinds(x).items():
        if kinds is not None and name not in kinds:
            continue
        ref = rejection_sample(x["logits"], lay, x["drafts"], x["adm"], use_triton=False, **kw)
        accepted += int(ref.num_accepted.sum())
        for knobs in knob_sets:
            tokens, num_acc = _triton_rejection.rejection_sample_fused(
                x["logits"], lay.req_index, lay.pos_in_req, ~lay.is_padding, x["drafts"], x["adm"],
                kw.get("temperature"), kw.get("draft_probs"), kw.get("uniforms"), **knobs)
            assert torch.equal(num_acc, ref.num_accepted), (case, name, knobs, num_acc, ref.num_accepted)
            assert torch.equal(tokens, ref.tokens), (case, name, knobs, tokens, ref.tokens)
    return accepted


SCALE = 32  # the sweep's blocks scaled down for the interpreter


def scaled(knobs: dict) -> dict:
    return {k: v // SCALE if k in ("row_block", "row_bytes", "tile_block") else v for k, v in knobs.items()}


def check_sweep_variants(dtype: str) -> None:
    """Every benchmark variant, blocks / 32, on 6 full row tiles plus a tail (V=49152 has 12, no tail)."""
    from dspark_cli.core import _triton_rejection

    elem = DTYPES[dtype].itemsize
    vocab = 6 * (16384 // SCALE // elem) + 37
    knob_sets = []
    for name, knobs in _triton_rejection.SWEEP_VARIANTS.items():
        knobs = scaled(knobs)
        knobs.setdefault("row_bytes", 16384 // SCALE)
        knobs.setdefault("tile_block", 1024 // SCALE)
        knob_sets.append(knobs)
        assert set(knobs) <= set(inspect.signature(_triton_rejection.plan_rejection_sample).parameters), name
    case = Case(3, 2, vocab, seed=9, dtype=dtype)
    kinds = ("greedy", "sampled", "all-sampled-q")
    # The inputs must reach every emit path: a residual after a rejection with one-hot and with real q, and
    # a bonus token of a sampled request.
    x = _inputs(case)
    bonus = False
    for name in kinds[1:]:
        kw = _kinds(x)[name]
        ref = rejection_sample(x["logits"], x["lay"], x["drafts"], x["adm"], use_triton=False, **kw)
        sampled = kw["temperature"] > 0
        assert bool(((ref.num_accepted < x["adm"]) & sampled).any()), name
        bonus |= bool(((ref.num_accepted == x["adm"]) & sampled & (x["adm"] > 0)).any())
    assert bonus
    _check(case, knob_sets, kinds)


def check_plan_reuse() -> None:
    """A plan replayed on inputs changed in place (what a CUDA graph does) leaves no stale scratch behind.

    One replay drops a real row (``valid`` False): its slot must read as rejected, as in the torch path,
    although the replay before accepted it -- the final kernel re-zeroes the slots it read.
    """
    from dspark_cli.core import _triton_rejection

    case = Case(4, 3, 100, seed=5, tile_block=16, tile_subs=2, prune=False)
    x = _inputs(case)
    lay, logits, u, temp = x["lay"], x["logits"].clone(), x["u"].clone(), x["temp"].clone()
    valid = ~lay.is_padding
    for split in (1, 3):
        plan = _triton_rejection.plan_rejection_sample(
            logits, lay.req_index, lay.pos_in_req, valid, x["drafts"], x["adm"], temp, x["q"], u, row_block=16,
            row_split=split)
        names = ["row", "tile_e", "tile_res", "final"] if split == 1 else ["row", "combine", "tile_e", "tile_res",
                                                                         "final"]
        assert [name for name, _ in plan.stages] == names
        assert plan.config["row_split"] == split
        gen = torch.Generator().manual_seed(6)
        for step in range(5):
            if step:
                logits.copy_(torch.randn(logits.shape, generator=gen) * 2)
                logits[:, 0] += 6.0  # drafts of token 0 get accepted: slots with accept bits set
                u.copy_(torch.rand(u.shape, generator=gen))
                temp.copy_(torch.where(torch.rand(temp.shape, generator=gen) < 0.3, 0.0, 1.0))
            x["drafts"].fill_(0)
            valid.copy_(~lay.is_padding)
            if step == 3:
                valid[1] = False  # request 0's first draft row goes missing
            tokens, num_acc = plan.run()
            ref = rejection_sample(logits, (lay.req_index, lay.pos_in_req, valid), x["drafts"], x["adm"],
                                   temperature=temp, draft_probs=x["q"], uniforms=u, use_triton=False)
            assert torch.equal(tokens, ref.tokens) and torch.equal(num_acc, ref.num_accepted), (split, step)
            if step == 2:
                assert int(ref.num_accepted[0]) >= 1, "the missing-row replay must follow an accepted slot"
    args = (logits, lay.req_index, lay.pos_in_req, valid, x["drafts"], x["adm"])
    greedy = _triton_rejection.plan_rejection_sample(*args, None, None, None)
    assert [name for name, _ in greedy.stages] == ["row", "final"]
    prob = _triton_rejection.plan_rejection_sample(*args, temp, None, u)
    assert [name for name, _ in prob.stages] == ["row", "tile_e", "final"]
    for bad, match in (({"row_unroll": 4}, "row_unroll"),
                       ({"row_stages": 2, "row_unroll": 2}, "row_stages"), ({"row_block": 48}, "powers of two"),
                       ({"row_group": 32, "row_block": 16}, "powers of two"), ({"row_split": -1}, "row_split")):
        with pytest.raises(ValueError, match=match):
            _triton_rejection.plan_rejection_sample(*args, None, None, None, **bad)
    # The loop shape follows the batch: pipelined from PIPELINE_MIN_ROWS rows (where the H200 sweep measured
    # it ahead), plain below, and never combined with unrolled pairs.
    assert prob.config["row_stages"] == 0
    rows = _triton_rejection.PIPELINE_MIN_ROWS
    big = torch.zeros(rows, 4096)
    idx = torch.zeros(rows, dtype=torch.int64)
    big_args = (big, idx, idx, torch.ones(rows, dtype=torch.bool), torch.zeros(1, 3, dtype=torch.int64),
                torch.zeros(1, dtype=torch.int64), None, None, None)
    big_plan = _triton_rejection.plan_rejection_sample(*big_args[:6], torch.ones(1), None, torch.rand(rows, 2))
    assert big_plan.config["row_stages"] == 3
    # and the emit tiles the sweep chose: 1024 tokens, two per tile-mass program, 4 warps
    assert (big_plan.config["tile_block"], big_plan.config["tile_subs"], big_plan.config["tile_warps"]) == (1024, 2, 4)
    assert _triton_rejection.plan_rejection_sample(*big_args, row_unroll=2).config["row_stages"] == 0


# No shrinking: every example is a slow interpreter run; the failing example is printed as drawn.
@settings(max_examples=6, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(
    num_reqs=st.integers(1, 6), k=st.integers(1, 4), vocab=st.integers(2, 160), seed=st.integers(0, 10**6),
    tile_block=st.sampled_from([8, 16, 64]), tile_subs=st.sampled_from([1, 2, 4]), row_unroll=st.sampled_from([1, 2]),
    row_group=st.sampled_from([1, 2, 8]), row_split=st.sampled_from([1, 2, 3]),
    layout=st.sampled_from(["varlen", "mask"]), dtype=st.sampled_from(["fp32", "bf16"]),
)
def check_random_cases(num_reqs: int, k: int, vocab: int, seed: int, tile_block: int, tile_subs: int,
                       row_unroll: int, row_group: int, row_split: int, layout: str, dtype: str) -> None:
    check_case(Case(num_reqs, k, vocab, seed=seed, tile_block=tile_block, tile_subs=tile_subs,
                    row_block=tile_block, row_unroll=row_unroll, row_group=min(row_group, tile_block),
                    row_split=row_split, layout=layout, dtype=dtype))


def check_named_case(name: str) -> None:
    assert check_case(CASES[name]) > 0, "no draft was ever accepted: the bonus path went untested"


CHECKS = {**{f"case:{name}": (lambda name=name: check_named_case(name)) for name in CASES},
          **{f"sweep:{d}": (lambda d=d: check_sweep_variants(d)) for d in DTYPES},
          "plan-reuse": check_plan_reuse, "random": check_random_cases}


def _rn32(x: Fraction) -> np.float32:
    """The float32 nearest to a rational (ties to even): what an fma rounds its exact result to."""
    f = np.float32(float(x))  # within an ulp of the answer (float64 then float32 may round twice)
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint32)) & 1))


def _fast_div(a: np.float32, b: np.float32) -> np.float32:
    """The emit kernels' division (``_triton_rejection._div`` with FAST) in exact rational arithmetic."""
    rb = np.float32(1) / b  # numpy's float32 division is IEEE round-to-nearest
    q = a * rb
    for _ in range(2):
        r = _rn32(-Fraction(float(b)) * Fraction(float(q)) + Fraction(float(a)))
        q = _rn32(Fraction(float(r)) * Fraction(float(rb)) + Fraction(float(q)))
    return q


def _hard_divisions(n: int, seed: int) -> list[tuple[np.float32, np.float32]]:
    """Logit / temperature and weight / normaliser pairs, with all-ones and power-of-two significands."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a = np.float32(rng.choice([-1, 1]) * rng.uniform(1, 2) * 2.0 ** rng.integers(-96, 64))
        if i % 3 == 0:  # a weight in (0, 1] over a normaliser up to the vocabulary size
            a, b = np.float32(rng.uniform(0, 1)), np.float32(rng.uniform(1, 5e4))
        elif i % 3 == 1:  # a temperature
            b = np.float32(rng.uniform(0.05, 2.0))
        else:  # significands 1.0, 1.1...1 and random, exponents over [-30, 30]
            sig = rng.choice([1.0, float(np.nextafter(np.float32(2), np.float32(0))), rng.uniform(1, 2)])
            b = np.float32(sig * 2.0 ** rng.integers(-30, 31))
        if i % 7 == 0:  # a significand next to a binade edge
            a = np.nextafter(np.float32(2.0 ** rng.integers(-20, 20)), np.float32(rng.choice([-np.inf, np.inf])))
        out.append((a, b))
    return out


def test_fast_emit_division_rounds_like_ieee_division() -> None:
    # The emit kernels divide logits by the temperature (and weights by the normaliser) with a reciprocal and
    # two fma corrections; exact round-to-nearest is what keeps their tokens identical to the torch path's.
    for a, b in _hard_divisions(3000, seed=0):
        assert _fast_div(a, b) == a / b, (a, b, _fast_div(a, b), a / b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_fast_division_matches_torch_division() -> None:
    # The compiled fma path itself, over millions of logits (incl. binade edges, zeros, infinities, nan) and
    # the temperatures / normalisers the emit kernels divide by.
    pytest.importorskip("triton")
    from dspark_cli.core import _triton_rejection

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n = 1 << 22
    mant = torch.rand(n, device=dev, generator=gen) + 1.0
    expo = torch.randint(-96, 64, (n,), device=dev, generator=gen).float()
    sign = torch.where(torch.rand(n, device=dev, generator=gen) < 0.5, -1.0, 1.0)
    a = (sign * mant * torch.exp2(expo)).float()
    a[:4096] = torch.randn(4096, device=dev, generator=gen) * 8  # logit-like
    a[4096:4100] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")], device=dev)
    a[4100] = float("nan")
    edges = torch.exp2(torch.arange(-40, 40, device=dev).float())
    a[8192:8192 + edges.numel()] = torch.nextafter(edges, torch.zeros_like(edges))
    out = torch.empty_like(a)
    for b in (0.05, 0.3, 0.7, 0.9999999, 1.0, 1.3, 2.0, 1.9999999, 37.5, 12345.678, 49152.0):
        _triton_rejection.probe_division(a, b, out)
        ref = a / torch.tensor(b, dtype=torch.float32, device=dev)
        same = (out == ref) | (out.isnan() & ref.isnan())
        assert bool(same.all()), (b, a[~same][:5], out[~same][:5], ref[~same][:5])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(a=st.floats(width=32, min_value=-2.0**64, max_value=2.0**64).filter(lambda x: x == 0 or abs(x) >= 2.0**-96),
       b=st.floats(width=32, min_value=2.0**-30, max_value=2.0**30))
def test_fast_emit_division_property(a: float, b: float) -> None:
    a32, b32 = np.float32(a), np.float32(b)
    assert _fast_div(a32, b32) == a32 / b32


def _run(check: str) -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":  # set before triton was imported: run here
        CHECKS[check]()
        return
    # TRITON_INTERPRET must be set before triton is imported, hence the subprocess.
    # The script's own folder leads sys.path there; the project root must be importable too.
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    res = subprocess.run([sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and f"ok {check}" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_cases_match_torch(name: str) -> None:
    _run(f"case:{name}")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_benchmark_variant_matches_torch(dtype: str) -> None:
    _run(f"sweep:{dtype}")


def test_auto_row_split_fills_the_device_only_for_small_batches() -> None:
    from dspark_cli.core._triton_rejection import auto_row_split

    assert auto_row_split(2048, 12, 132) == 1  # R=256, K=7: 15 rows per SM already
    assert auto_row_split(512, 12, 132) == 1
    assert auto_row_split(64, 12, 132) == 6  # 8 wanted; 6 divides the 12 full tiles evenly
    assert auto_row_split(64, 6, 132) == 6
    assert auto_row_split(8, 12, 132) == 12  # capped by the full tiles: no empty chunk
    assert auto_row_split(8, 7, 132) == 7
    assert auto_row_split(8, 1, 132) == 1
    assert auto_row_split(8, 0, 132) == 1
    assert auto_row_split(0, 12, 1) == 1


def test_plan_replays_on_changed_inputs_and_names_its_stages() -> None:
    _run("plan-reuse")


def test_random_shapes_and_tilings_match_torch() -> None:
    _run("random")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(SWEEP_VARIANTS))
def test_compiled_kernel_shapes_agree_with_torch_at_a_real_vocabulary(name: str) -> None:
    # Every shape the benchmark may time must compile and keep the contract: greedy exact, sampled tokens
    # equal but for the accept test's p(x) rounding (about one row in a million).
    pytest.importorskip("triton")
    from dspark_cli.core import _triton_rejection

    knobs = SWEEP_VARIANTS[name]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    num_reqs, k, vocab = 64, 7, 49152
    rows = num_reqs * (k + 1)
    zeros = torch.zeros(num_reqs, dtype=torch.long, device=dev)
    mismatched = 0
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(rows, vocab, device=dev, generator=gen) * 2.0
        logits[:, :8] += 4.0
        logits = logits.to(dtype)
        drafts = torch.randint(0, 8, (num_reqs, k), device=dev, generator=gen)
        admitted = torch.randint(0, k + 1, (num_reqs,), device=dev, generator=gen)
        lay = build_varlen_layout(zeros, drafts, admitted, zeros, rows)
        temp = torch.rand(num_reqs, device=dev, generator=gen) + 0.5
        temp[::5] = 0.0
        u = torch.rand(rows, 2, device=dev, generator=gen)
        q = torch.randn(num_reqs, k, vocab, device=dev, generator=gen)
        q[:, :, :8] += 3.0
        q = q.softmax(-1)
        for kw in ({}, {"temperature": temp, "uniforms": u}, {"temperature": temp, "uniforms": u, "draft_probs": q}):
            ref = rejection_sample(logits, lay, drafts, admitted, use_triton=False, **kw)
            tokens, _ = _triton_rejection.rejection_sample_fused(
                logits, lay.req_index, lay.pos_in_req, ~lay.is_padding, drafts, admitted, kw.get("temperature"),
                kw.get("draft_probs"), kw.get("uniforms"), **knobs)
            diff = int((tokens != ref.tokens).any(dim=1).sum())
            if not kw:
                assert diff == 0, "greedy must agree exactly"
            mismatched += diff
    assert mismatched <= 1, f"{mismatched} requests differ from the torch sampler under {knobs}"


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    print(f"ok {sys.argv[1]}")


def test_sampler_kernels_take_batch_shapes_as_runtime_values() -> None:
    """A Triton int argument is specialised (== 1, divisible by 16) unless listed in do_not_specialize, so
    request and row counts compiled a new variant for new batch sizes inside serving. Every count that
    follows the batch must be a runtime value in every sampler kernel."""
    pytest.importorskip("triton")
    from dspark_cli.core import _triton_rejection as tr

    if not hasattr(tr, "_row_kernel"):
        pytest.skip("triton kernels unavailable")
    batch_ints = {"num_reqs", "num_rows", "part_plane", "plane"}
    for kernel in (tr._row_kernel, tr._combine_kernel, tr._tile_mass_kernel, tr._final_kernel,
                   tr._varlen_layout_kernel):
        names = set(kernel.arg_names) & batch_ints
        assert names, kernel.fn.__name__
        unspecialised = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
        assert names <= unspecialised, (kernel.fn.__name__, names - unspecialised)


def test_sampler_warm_up_is_a_noop_where_the_torch_path_runs() -> None:
    from dspark_cli.core.rejection import warm_up_rejection_sample

    assert warm_up_rejection_sample(7, 256, [1, 8, 64], 8, "cpu") == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_sampler_compile_in_serving_after_warm_up() -> None:
    """After the start-up warm-up over the padded sizes, batches of any request count at those sizes --
    greedy and sampled with draft distributions -- compile nothing."""
    from dspark_cli.core import _triton_rejection as tr
    from dspark_cli.core.rejection import warm_up_rejection_sample

    k, vocab, sizes = 7, 49152, [8, 16, 32, 64, 128]
    assert warm_up_rejection_sample(k, vocab, sizes, 16, "cuda") == 2 * len(sizes)
    kernels = (tr._row_kernel, tr._combine_kernel, tr._tile_mass_kernel, tr._final_kernel)

    def compiled() -> int:  # triton 3.x: device -> (kernel cache, key cache, target, backend, binder)
        return sum(len(c[0]) for kern in kernels for c in kern.device_caches.values())

    before = compiled()
    g = torch.Generator(device="cuda").manual_seed(0)
    for reqs, rows in ((1, 8), (3, 16), (5, 32), (9, 64), (13, 128), (16, 128)):
        logits = torch.randn(rows, vocab, device="cuda", generator=g)
        req = torch.arange(rows, device="cuda") % reqs
        pos = torch.zeros(rows, dtype=torch.int64, device="cuda")
        valid = torch.arange(rows, device="cuda") < reqs
        drafts = torch.randint(0, vocab, (reqs, k), device="cuda", generator=g)
        admitted = torch.zeros(reqs, dtype=torch.int32, device="cuda")
        rejection_sample(logits, (req, pos, valid), drafts, admitted)
        probs = torch.softmax(torch.randn(reqs, k, vocab, device="cuda", generator=g), dim=-1)
        rejection_sample(logits, (req, pos, valid), drafts, admitted, torch.ones(reqs, device="cuda"),
                         draft_probs=probs, uniforms=torch.rand(rows, 2, device="cuda", generator=g))
    torch.cuda.synchronize()
    assert compiled() == before
