"""Paged ragged attention: the torch reference against naive dense attention, and the Triton kernel (run by
the Triton interpreter on CPU, compiled on CUDA) against the reference.

Triton decides at import time whether its own library and our kernels run compiled or in the numpy
interpreter, and a pytest process that imported triton for CUDA cannot switch. So the interpreter tests
(``test_interp_*``) exist only in a process started with ``TRITON_INTERPRET=1``; in an ordinary run,
``test_kernel_under_interpreter`` starts such a process on this file and reports its outcome.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from dspark_cli.engines.embedded import triton_attention as ta

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETER = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or INTERPRETER,
                              reason="needs CUDA and compiled triton")

# (H, KVH): plain multi-head, SmolLM2-135M's 9/3 (a group of 3 padded to 4), Llama-3's 4:1, multi-query.
HEAD_CONFIGS = [(4, 4), (9, 3), (8, 2), (4, 1)]


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    dense_k: list[torch.Tensor]  # per request [seq_len, KVH, D], the same values the cache holds
    dense_v: list[torch.Tensor]
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                self.scale)


def make_batch(q_lens: list[int], ctx_lens: list[int], pad_rows: int, num_heads: int, kv_heads: int,
               head_dim: int, page: int, dtype: torch.dtype = torch.float32, seed: int = 0,
               device: str = "cpu") -> Batch:
    """A ragged batch whose pages are scattered over a shuffled cache, with garbage in every unused slot."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    pages = [-(-s // page) for s in seq_lens]
    max_blocks = max(pages, default=0) + 2  # trailing table entries are never read
    num_blocks = sum(pages) + 3
    shape = (num_blocks, page, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(q_lens), max_blocks), generator=gen, dtype=torch.int32)
    dense_k, dense_v, cursor = [], [], 0
    for r, (count, length) in enumerate(zip(pages, seq_lens, strict=True)):
        ids = order[cursor:cursor + count]
        cursor += count
        tables[r, :count] = ids.int()
        dense_k.append(k_cache[ids].reshape(-1, kv_heads, head_dim)[:length])
        dense_v.append(v_cache[ids].reshape(-1, kv_heads, head_dim)[:length])
    num_rows = sum(q_lens) + pad_rows
    q = torch.randn((num_rows, num_heads, head_dim), generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                 torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device),
                 dense_k, dense_v, head_dim ** -0.5)


def naive_dense(batch: Batch) -> torch.Tensor:
    """Row by row, head by head, in float64: the semantics spelled out with no paging and no batching."""
    num_rows, num_heads, head_dim = batch.q.shape
    group = num_heads // batch.k_cache.shape[2]
    out = torch.zeros((num_rows, num_heads, head_dim), dtype=torch.float64)
    qsl = batch.query_start_loc.tolist()
    for r, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v, strict=True)):
        n = qsl[r + 1] - qsl[r]
        for i in range(n):
            t, p = qsl[r] + i, k.shape[0] - n + i
            for h in range(num_heads):
                scores = (k[: p + 1, h // group].double().cpu() @ batch.q[t, h].double().cpu()) * batch.scale
                weights = torch.softmax(scores, dim=0)
                out[t, h] = weights @ v[: p + 1, h // group].double().cpu()
    return out


@st.composite
def batches(draw: st.DrawFn, max_reqs: int = 5, max_q: int = 6, max_ctx: int = 40) -> Batch:
    num_reqs = draw(st.integers(0, max_reqs))
    q_lens = draw(st.lists(st.integers(0, max_q), min_size=num_reqs, max_size=num_reqs))
    ctx_lens = draw(st.lists(st.integers(0, max_ctx), min_size=num_reqs, max_size=num_reqs))
    num_heads, kv_heads = draw(st.sampled_from(HEAD_CONFIGS))
    return make_batch(q_lens, ctx_lens, pad_rows=draw(st.integers(0, 4)), num_heads=num_heads,
                      kv_heads=kv_heads, head_dim=draw(st.sampled_from([16, 24, 32])),
                      page=draw(st.sampled_from([1, 4, 5, 16])), seed=draw(st.integers(0, 2**16)))


# -- the reference ---------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_reference_matches_naive_dense(batch: Batch) -> None:
    got = ta.torch_reference(*batch.args())
    torch.testing.assert_close(got.double(), naive_dense(batch), atol=1e-5, rtol=1e-5)


def test_reference_writes_out_and_zeroes_padding() -> None:
    batch = make_batch([2, 0, 3], [5, 3, 0], pad_rows=3, num_heads=4, kv_heads=2, head_dim=16, page=4)
    out = torch.full_like(batch.q, float("nan"))
    got = ta.torch_reference(*batch.args(), out=out)
    assert got is out
    assert torch.all(out[5:] == 0)
    torch.testing.assert_close(out.double(), naive_dense(batch), atol=1e-5, rtol=1e-5)


def test_cpu_call_without_interpreter_uses_reference() -> None:
    batch = make_batch([1, 4], [9, 2], pad_rows=1, num_heads=9, kv_heads=3, head_dim=16, page=4)
    got = ta.paged_attention_varlen(*batch.args())
    torch.testing.assert_close(got.double(), naive_dense(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: setattr(b, "seq_lens", b.seq_lens.long()), "seq_lens must be int32"),
        (lambda b: setattr(b, "query_start_loc", b.query_start_loc[:-1]), "query_start_loc"),
        (lambda b: setattr(b, "q", b.q[:, :3]), "multiple of KVH"),
    ],
)
def test_bad_inputs_are_rejected(mutate, match: str) -> None:
    batch = make_batch([1, 2], [3, 4], pad_rows=0, num_heads=4, kv_heads=2, head_dim=16, page=4)
    mutate(batch)
    with pytest.raises(ValueError, match=match):
        ta.torch_reference(*batch.args())


def test_split_count_depends_on_shapes_only() -> None:
    # Enough (tile, KV head) programs fill the GPU on their own: no split.
    assert ta._choose_num_splits(num_tiles=80, kv_heads=8, max_kv_len=8192, block_n=32, num_sms=132) == 1
    assert ta._choose_num_splits(num_tiles=60, kv_heads=8, max_kv_len=8192, block_n=32, num_sms=132) == 2
    # Few programs over a long context: split, but never past the length bound or the cap.
    assert ta._choose_num_splits(num_tiles=4, kv_heads=2, max_kv_len=8192, block_n=64, num_sms=132) == 32
    assert ta._choose_num_splits(num_tiles=4, kv_heads=2, max_kv_len=512, block_n=64, num_sms=132) == 2
    assert ta._choose_num_splits(num_tiles=1, kv_heads=1, max_kv_len=64, block_n=64, num_sms=132) == 1


# -- the kernel under the interpreter ---------------------------------------------------------------------

@pytest.mark.skipif(not HAS_TRITON or INTERPRETER, reason="needs triton; runs the interpreter tests in a child")
def test_kernel_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-x", "-p", "no:cacheprovider",
           "-k", "test_interp_"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


if INTERPRETER:
    # No shrinking: each interpreted example takes about a second and the drawn batches are small already.
    @settings(max_examples=25, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
    @given(batch=batches(), num_splits=st.sampled_from([None, 1, 2, 3]), block_m=st.sampled_from([16, 32]))
    def test_interp_matches_reference(batch: Batch, num_splits: int | None,
                                      block_m: int) -> None:
        expected = ta.torch_reference(*batch.args())
        # Stale values in the output buffer must never survive: padding rows come back as zeros.
        out = torch.full_like(batch.q, 123.0)
        ta._launch(*batch.args(), out, num_splits=num_splits, block_m=block_m, block_n=16)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)

    def test_interp_public_entry_point() -> None:
        batch = make_batch([3, 0, 1, 8, 2], [10, 4, 70, 0, 17], pad_rows=3, num_heads=9, kv_heads=3, head_dim=64,
                           page=16)
        out = torch.full_like(batch.q, float("nan"))
        got = ta.paged_attention_varlen(*batch.args(), out=out)
        assert got is out
        assert torch.all(out[sum([3, 0, 1, 8, 2]):] == 0)
        torch.testing.assert_close(out.double(), naive_dense(batch), atol=2e-5, rtol=2e-5)

    @pytest.mark.parametrize("num_splits", [1, 4])
    def test_interp_fp16_with_strided_q_and_out(num_splits: int) -> None:
        # The engine slices q out of a fused qkv projection and may write into a slice of a larger buffer.
        # (bf16 is checked on CUDA only: the interpreter's bf16 tl.dot is not faithful.)
        batch = make_batch([4, 1, 0, 6], [33, 0, 5, 50], pad_rows=2, num_heads=8, kv_heads=2, head_dim=32,
                           page=8, dtype=torch.float16, seed=3)
        num_rows, num_heads, head_dim = batch.q.shape
        qkv = torch.randn(num_rows, 3 * num_heads, head_dim).half()
        qkv[:, num_heads:2 * num_heads] = batch.q
        batch.q = qkv[:, num_heads:2 * num_heads]
        wide = torch.full((num_rows, num_heads, 2 * head_dim), 9.0, dtype=torch.float16)
        out = wide[:, :, head_dim:]
        ta._launch(*batch.args(), out, num_splits=num_splits)
        expected = ta.torch_reference(*batch.args())
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)
        assert torch.all(wide[:, :, :head_dim] == 9.0)

    def test_interp_replays_one_shape_with_changing_contents() -> None:
        # What a CUDA graph does: same buffers and shapes, different per-request lengths and tables each step.
        out = torch.empty(12, 4, 16)
        for step, (q_lens, ctx_lens) in enumerate([([3, 3, 3, 3], [1, 2, 3, 4]), ([0, 9, 0, 1], [40, 7, 0, 60]),
                                                   ([1, 1, 0, 0], [5, 0, 0, 0]), ([0, 0, 0, 0], [0, 0, 0, 0])]):
            batch = make_batch(q_lens, ctx_lens, pad_rows=12 - sum(q_lens), num_heads=4, kv_heads=1, head_dim=16,
                               page=4, seed=step)
            ta._launch(*batch.args(), out, num_splits=1 if step % 2 else 3)
            torch.testing.assert_close(out.double(), naive_dense(batch), atol=2e-5, rtol=2e-5)

    def test_interp_without_requests_or_rows() -> None:
        empty = make_batch([], [], pad_rows=5, num_heads=4, kv_heads=2, head_dim=16, page=4)
        out = torch.full_like(empty.q, 1.0)
        ta.paged_attention_varlen(*empty.args(), out=out)
        assert torch.all(out == 0)
        none = make_batch([0, 0], [3, 0], pad_rows=0, num_heads=4, kv_heads=2, head_dim=16, page=4)
        assert ta.paged_attention_varlen(*none.args()).shape == (0, 4, 16)


# -- the compiled kernel for Hopper, without a GPU ------------------------------------------------------------

def _hopper_ptx(dtype: str, heads: int, kv_heads: int, head_dim: int, num_rows: int, num_reqs: int,
                num_splits: int) -> str:
    """Compile the kernel ahead of time for sm_90 as the launcher would specialise it (16-aligned pointers
    and strides; unit strides folded), with the tile plan the heuristics pick for this shape."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fp32 = dtype == "fp32"
    plan = ta._plan(num_rows, heads, head_dim, kv_heads, 16, num_reqs, 256, 132, fp32, num_splits=num_splits)
    fn = ta._paged_attn_kernel
    ptr, part = f"*{dtype}", "*fp32" if num_splits > 1 else f"*{dtype}"
    sig = dict(q_ptr=ptr, k_ptr=ptr, v_ptr=ptr, bt_ptr="*i32", sl_ptr="*i32", qsl_ptr="*i32", out_ptr=ptr,
               m_part_ptr=part, l_part_ptr=part, o_part_ptr=part, scale_log2="fp32", num_reqs="i32",
               num_rows="i32", num_tile_progs="i32")
    strides = ["stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
               "stride_vh", "stride_bt", "stride_ot", "stride_oh"]
    sig.update({name: "i32" for name in strides})
    consts = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, NUM_HEADS=heads, HEAD_DIM=head_dim,
                  GROUP=heads // kv_heads, GROUP_PAD=plan.group_pad, PAGE=16, BLOCK_Q=plan.block_q,
                  BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, NUM_SPLITS=num_splits,
                  PRECISION="ieee" if fp32 else "tf32", LOOP_WHILE=False)
    sig.update({name: "constexpr" for name in consts})
    aligned = [n for n, t in sig.items() if t.startswith("*")] + [n for n in strides if n != "stride_bt"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    return kernel.asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON or INTERPRETER, reason="needs compiled-mode triton")
@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim, num_rows, num_reqs, num_splits", [
    ("bf16", 9, 3, 64, 8, 8, 1),        # SmolLM2 decode
    ("bf16", 32, 8, 128, 64, 8, 4),     # Llama-3-8B verify, split-K
    ("bf16", 32, 8, 128, 512, 4, 1),    # prefill-like tile (BLOCK_M 64)
    ("fp32", 32, 8, 128, 16, 4, 1),
])
def test_compiles_for_hopper_without_spills(tmp_path: Path, dtype: str, heads: int, kv_heads: int,
                                            head_dim: int, num_rows: int, num_reqs: int, num_splits: int) -> None:
    # The interpreter cannot see register pressure or whether K/V loads vectorise; ptxas can, with no GPU.
    pytest.importorskip("triton.compiler")
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build ships no ptxas")
    ptx = _hopper_ptx(dtype, heads, kv_heads, head_dim, num_rows, num_reqs, num_splits)
    assert "cp.async" in ptx  # pipelined, vectorised K/V loads
    if dtype != "fp32":
        assert "mma.sync" in ptx or "wgmma" in ptx  # tensor cores for both dots
    (tmp_path / "k.ptx").write_text(ptx)
    log = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", str(tmp_path / "k.ptx"), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True).stderr
    assert " 0 bytes spill stores" in log, log


# -- the compiled kernel on CUDA ---------------------------------------------------------------------------

@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_cuda_kernel_matches_reference(dtype: torch.dtype, num_splits: int | None) -> None:
    batch = make_batch([1, 8, 0, 3, 5], [900, 20, 7, 3000, 0], pad_rows=5, num_heads=32, kv_heads=8,
                       head_dim=128, page=16, dtype=dtype, device="cuda")
    out = torch.full_like(batch.q, float("nan"))
    ta._launch(*batch.args(), out, num_splits=num_splits)
    expected = ta.torch_reference(*batch.args())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@gpu_only
def test_cuda_graph_replay_with_new_contents() -> None:
    first = make_batch([2, 2, 2], [10, 100, 1000], pad_rows=2, num_heads=9, kv_heads=3, head_dim=64, page=16,
                       dtype=torch.bfloat16, device="cuda")
    second = make_batch([5, 0, 1], [300, 4, 17], pad_rows=2, num_heads=9, kv_heads=3, head_dim=64, page=16,
                        dtype=torch.bfloat16, device="cuda", seed=1)
    # One set of static buffers big enough for both batches' caches and tables.
    blocks = max(first.k_cache.shape[0], second.k_cache.shape[0])
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    static = make_batch([2, 2, 2], [10, 100, 1000], pad_rows=2, num_heads=9, kv_heads=3, head_dim=64, page=16,
                        dtype=torch.bfloat16, device="cuda")
    static.k_cache = torch.zeros((blocks, *first.k_cache.shape[1:]), dtype=torch.bfloat16, device="cuda")
    static.v_cache = torch.zeros_like(static.k_cache)
    static.block_tables = torch.zeros((3, width), dtype=torch.int32, device="cuda")

    def load(src: Batch) -> None:
        static.q.copy_(src.q)
        static.k_cache[: src.k_cache.shape[0]].copy_(src.k_cache)
        static.v_cache[: src.v_cache.shape[0]].copy_(src.v_cache)
        static.block_tables[:, : src.block_tables.shape[1]].copy_(src.block_tables)
        static.seq_lens.copy_(src.seq_lens)
        static.query_start_loc.copy_(src.query_start_loc)

    load(first)
    out = torch.empty_like(static.q)
    ta.paged_attention_varlen(*static.args(), out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.paged_attention_varlen(*static.args(), out=out)
    for src in (second, first):
        load(src)
        graph.replay()
        expected = ta.torch_reference(*static.args())
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert math.isfinite(out.float().abs().sum().item())
