"""Paged, ragged-query attention as one Triton kernel, capturable in a CUDA graph.

The embedded engine runs three kinds of steps through the same attention call: decode (one query row per
request), verify (1 + admitted drafts per request, ragged because the capacity manager admits a different
number of drafts for each request) and drafting. All of them attend from a few new query rows to a long,
paged KV history.

Beside FlashInfer. FlashInfer (what vLLM and SGLang use) plans its batch work from per-request query lengths
*on the host*, while our varlen verify batch gets its per-request split on the device; the FlashInfer backend
(``flashinfer_attention``) gets around that by planning each captured shape once with a schedule that holds for
any split. This kernel needs no plan at all and is the backend where FlashInfer is not installed, for float32
models (FlashInfer's kernels take 16-bit inputs), and the reference the FlashInfer backend is timed against
(``benchmarks/attention_backends.py``). Its interface::

    paged_attention_varlen(
        q,                 # [T, H, D] queries of the flattened ragged batch (bf16 / fp16 / fp32)
        k_cache,           # [num_blocks, block_size, KVH, D]
        v_cache,           # [num_blocks, block_size, KVH, D]
        block_tables,      # [R, max_blocks_per_req] int32 block ids (entries past a request's length unused)
        seq_lens,          # [R] int32: KV length of each request AFTER this step's tokens were written
        query_start_loc,   # [R + 1] int32: request r owns query rows [qsl[r], qsl[r + 1]);
                           #   rows >= qsl[R] are padding
        scale,             # softmax scale (usually D ** -0.5)
        out=None,          # [T, H, D]; padding rows are written as zeros
    ) -> Tensor            # out (or a new tensor of q's dtype)

Semantics. Query row ``t`` of request ``r`` (``i = t - qsl[r]``, ``n = qsl[r+1] - qsl[r]``) sits at absolute
position ``p = seq_lens[r] - n + i`` and attends causally to KV positions ``0..p`` of its request; head ``h``
reads KV head ``h // (H // KVH)`` (GQA). The new tokens' K/V must already be in the cache. Requests with zero
rows are allowed; ``seq_lens[r] >= n`` is a precondition (a row with no visible key is written as zeros by the
kernel and as NaN by the reference).

Why it is graph-safe. The launch reads shapes only -- never tensor contents -- so one captured graph replays
any mix of per-request query lengths, context lengths and block tables up to the captured shapes. The grid is
``T // BLOCK_Q + R`` query tiles (an upper bound on the tiles any ragged split of T rows into R requests
needs: request r's tiles start at ``qsl[r] // BLOCK_Q + r``) and each program finds its request with a binary
search over ``query_start_loc``; programs whose tile is past their request's rows exit at once. Padding rows
are zeroed by a few extra programs, so a graph replayed with fewer live rows never leaks stale output.

How it works. One program owns ``BLOCK_Q`` query rows of one request times all ``H // KVH`` query heads that
share one KV head, so each K/V tile is loaded once per GQA group and fed to tensor-core ``tl.dot`` (the
group is padded to a power of two and the tile to at least 16 rows). It walks the request's pages with an
online softmax in fp32 (flash-decoding style), stopping at the tile's last causal position. When the batch has
too few (tile, KV head) programs to fill the GPU -- few requests with long contexts, the regime of a lightly
loaded server -- the KV range is split into ``num_splits`` partitions that run in parallel and write partial
(max, sum, accumulator) triples, and a second small kernel merges them (split-K / flash-decoding). The split
count is chosen from shapes and the SM count only, so it is fixed for a captured graph.

``torch_reference`` has identical semantics in plain torch; it is the CPU path and the oracle in tests.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install runs torch_reference; the kernel is a GPU feature
    triton = None
    tl = None

__all__ = ["paged_attention_varlen", "torch_reference", "triton_available", "warm_up_paged_attention"]

# Decided once at import, like triton.jit itself decides at decoration time whether kernels run on the GPU
# or in the numpy interpreter; CPU tensors may only reach the kernel in the latter case.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Empty splits report this max so the merge weighs them exp2(-1e30 - M) = 0 without inf - inf = NaN.
_NEG_BIG = -1.0e30
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
_PROGRAMS_PER_SM = 4


def triton_available() -> bool:
    """True when the Triton kernel can run here (triton imported; a CUDA device or the interpreter)."""
    return triton is not None and (_INTERPRETED or torch.cuda.is_available())


if triton is not None:
    _NEG_BIG_C = tl.constexpr(_NEG_BIG)

    @triton.jit
    def _find_request(qsl_ptr, num_reqs, tile_idx, BLOCK_Q: tl.constexpr):
        # Largest r < num_reqs with qsl[r] // BLOCK_Q + r <= tile_idx. The "+ r" gives every request (even an
        # empty one) a distinct first tile, so the search is exact for zero-row requests.
        left: tl.int32 = 0
        right = num_reqs
        while left < right:
            mid = (left + right) // 2
            start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            if start <= tile_idx:
                left = mid + 1
            else:
                right = mid
        return left - 1

    @triton.jit
    def _attend_kv_tile(
        q, m_i, l_i, acc, j, kv_len, pos, bt_row, k_head, v_head, offs_d, d_mask, scale_log2,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # One online-softmax step over KV tile j (scores in the log2 domain; fp32 statistics).
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        # Per-key page lookup: works for any page size, and the table row stays in L1.
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot = offs_n % PAGE
        k_ptrs = k_head + blk[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd
        k = tl.load(k_ptrs, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        visible = (offs_n[None, :] <= pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_ptrs = v_head + blk[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    # Row and request counts are not specialised on (Triton would compile a variant per value class: 1,
    # multiple of 16, other -- for each of three counts): eager forwards (prefill, a catch-up after drafting
    # was paused) see new counts all the time, and each variant is a compile inside serving.
    @triton.jit(do_not_specialize=["num_reqs", "num_rows", "num_tile_progs"])
    def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, qsl_ptr,
        out_ptr, m_part_ptr, l_part_ptr, o_part_ptr,
        scale_log2, num_reqs, num_rows, num_tile_progs,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        stride_ot, stride_oh, stride_od,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, LOOP_WHILE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        offs_m = tl.arange(0, BLOCK_M)
        q_local = offs_m // GROUP_PAD          # query row within the tile
        g = offs_m % GROUP_PAD                 # query head within the GQA group
        head = kv_head * GROUP + g
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM

        if pid >= num_tile_progs:
            # Padding programs: a graph replayed with fewer live rows than captured must not leave stale
            # attention output in the padding rows. (With splits, the merge kernel zeroes them instead.)
            if NUM_SPLITS == 1:
                pad_t = (pid - num_tile_progs) * BLOCK_Q + q_local
                total = tl.load(qsl_ptr + num_reqs)
                pad = (pad_t >= total) & (pad_t < num_rows) & (g < GROUP)
                pad_ptrs = (out_ptr + pad_t.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
                          + offs_d[None, :] * stride_od)
                zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty)
                tl.store(pad_ptrs, zeros, mask=pad[:, None] & d_mask[None, :])
            return

        req = _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q)
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        tile = pid - (q_start // BLOCK_Q + req)
        if tile * BLOCK_Q >= q_len:
            return

        seq_len = tl.load(sl_ptr + req)
        ctx_len = seq_len - q_len              # KV tokens before this step's rows
        qi = tile * BLOCK_Q + q_local
        row_valid = (qi < q_len) & (g < GROUP)
        t = (q_start + qi).to(tl.int64)
        pos = ctx_len + qi                     # absolute position: attends to keys 0..pos

        q_ptrs = q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
        q = q.to(k_ptr.dtype.element_ty)

        # The tile's last row sees the most keys; nothing past it is read.
        kv_len = tl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_Q)
        num_kv_tiles = tl.cdiv(kv_len, BLOCK_N)
        if NUM_SPLITS == 1:
            j_begin = 0
            j_end = num_kv_tiles
        else:
            per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
            j_begin = split * per_split
            j_end = tl.minimum(j_begin + per_split, num_kv_tiles)

        m_i = tl.full([BLOCK_M], _NEG_BIG_C, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = bt_ptr + req.to(tl.int64) * stride_bt
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh

        if LOOP_WHILE:
            # The interpreter (CPU tests) cannot use tensor bounds in range() with numpy >= 2.4 (int() of its
            # 1-element arrays); a while loop gives the same iterations. Compiled kernels keep the for loop,
            # which Triton software-pipelines.
            j = j_begin
            while j < j_end:
                m_i, l_i, acc = _attend_kv_tile(
                    q, m_i, l_i, acc, j, kv_len, pos, bt_row, k_head, v_head, offs_d, d_mask, scale_log2,
                    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                    PAGE, BLOCK_N, PRECISION)
                j += 1
        else:
            for j in range(j_begin, j_end):
                m_i, l_i, acc = _attend_kv_tile(
                    q, m_i, l_i, acc, j, kv_len, pos, bt_row, k_head, v_head, offs_d, d_mask, scale_log2,
                    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                    PAGE, BLOCK_N, PRECISION)

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            o_ptrs = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])
        else:
            # Scratch is contiguous [T, H, NUM_SPLITS] (+ [HEAD_DIM] for the accumulator). Every split writes,
            # empty ones included, so the merge never reads uninitialised partials of a live row.
            part = (t * NUM_HEADS + head) * NUM_SPLITS + split
            tl.store(m_part_ptr + part, m_i, mask=row_valid)
            tl.store(l_part_ptr + part, l_i, mask=row_valid)
            o_ptrs = o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(o_ptrs, acc, mask=row_valid[:, None] & d_mask[None, :])

    @triton.jit(do_not_specialize=["num_reqs"])
    def _merge_splits_kernel(
        m_part_ptr, l_part_ptr, o_part_ptr, qsl_ptr, out_ptr,
        num_reqs, stride_ot, stride_oh, stride_od,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        o_ptrs = out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od
        total = tl.load(qsl_ptr + num_reqs)
        if t >= total:
            tl.store(o_ptrs, tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=d_mask)
            return
        offs_s = tl.arange(0, SPLITS_PAD)
        s_mask = offs_s < NUM_SPLITS
        base = (t * NUM_HEADS + h) * NUM_SPLITS
        m = tl.load(m_part_ptr + base + offs_s, mask=s_mask, other=_NEG_BIG_C)
        l_s = tl.load(l_part_ptr + base + offs_s, mask=s_mask, other=0.0)
        w = tl.exp2(m - tl.max(m, axis=0))
        w = tl.where(s_mask, w, 0.0)
        denom = tl.sum(w * l_s, axis=0)
        acc = tl.load(o_part_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        o = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter: any fixed number keeps the heuristic exercisable on CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def _choose_num_splits(num_tiles: int, kv_heads: int, max_kv_len: int, block_n: int, num_sms: int) -> int:
    """Split the KV range only when (tile, KV head) programs are too few to keep HBM busy.

    A memory-bound program needs company: we aim for about four resident programs per SM, each keeping at
    least four KV tiles of work so the merge stays cheap next to it. Inputs are shapes (max_kv_len is the
    block-table width times the page size), never contents, so a captured graph keeps its split count; the
    count is a power of two, so all shapes share at most six compiled variants.
    """
    programs = max(num_tiles * kv_heads, 1)
    target = _PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    by_length = max(max_kv_len // (4 * block_n), 1)
    splits = int(max(1, min(math.ceil(target / programs), by_length, _MAX_SPLITS)))
    # A power of two (rounded down): the split count is a compile-time constant, and eager batches of every
    # size would otherwise compile up to _MAX_SPLITS variants of both kernels.
    return 1 << (splits.bit_length() - 1)


def _validate(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
              query_start_loc: Tensor, out: Tensor | None) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged attention: expected q [T, H, D] and equal caches [blocks, page, KVH, D], "
                         f"got q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    _, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % kv_heads != 0:
        raise ValueError(f"paged attention: head_dim {head_dim} vs cache {k_cache.shape[3]}, "
                         f"H={num_heads} must be a multiple of KVH={kv_heads}")
    num_reqs = block_tables.shape[0]
    if block_tables.dim() != 2 or seq_lens.shape != (num_reqs,) or query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"paged attention: block_tables [R, M], seq_lens [R], query_start_loc [R + 1]; got "
                         f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}")
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens),
                         ("query_start_loc", query_start_loc)):
        if tensor.dtype != torch.int32:
            raise ValueError(f"paged attention: {name} must be int32, got {tensor.dtype}")
    if out is not None and out.shape != q.shape:
        raise ValueError(f"paged attention: out {tuple(out.shape)} must match q {tuple(q.shape)}")


@dataclass(frozen=True)
class _Plan:
    """Tile sizes and split count of one launch; a function of shapes and the SM count only."""

    block_m: int  # rows of a program's tile: block_q query rows x group_pad heads
    block_q: int
    group_pad: int
    block_n: int  # keys per KV tile
    block_d: int
    num_splits: int
    num_warps: int
    num_stages: int
    num_tile_progs: int


def _plan(
    num_rows: int, num_heads: int, head_dim: int, kv_heads: int, page: int, num_reqs: int, max_blocks: int,
    num_sms: int, fp32: bool = False, *, num_splits: int | None = None, block_n: int | None = None, block_m: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> _Plan:
    group_pad = triton.next_power_of_2(num_heads // kv_heads)
    if block_m is None:
        # Prefill-like batches (many rows per request) amortise K/V over a taller tile; decode and verify
        # (a handful of rows) keep the 16-row minimum of tl.dot so no K/V bandwidth is spent on empty rows.
        # fp32 dots run on FMA units (ieee precision) whose register use grows with the tile: stay small.
        block_m = 64 if num_rows >= 32 * num_reqs and not fp32 else 16
    block_m = max(block_m, group_pad, 16)
    block_q = block_m // group_pad
    block_d = max(triton.next_power_of_2(head_dim), 16)
    if block_n is None:
        # Register-bound choices (checked with ptxas for sm_90: no spills at 4 warps).
        if fp32:
            block_n = 32 if block_d <= 64 else 16
        else:
            block_n = 64 if block_d <= 64 else 32
    num_tile_progs = num_rows // block_q + num_reqs
    if num_splits is None:
        live_tiles = min(num_tile_progs, triton.cdiv(num_rows, block_q) + min(num_reqs, num_rows))
        num_splits = _choose_num_splits(live_tiles, kv_heads, max_blocks * page, block_n, num_sms)
    if num_warps is None:
        num_warps = 4 if block_m * block_d < 64 * 128 else 8
    return _Plan(block_m, block_q, group_pad, block_n, block_d, num_splits, num_warps,
                 2 if num_stages is None else num_stages, num_tile_progs)


def _launch(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor, scale: float, out: Tensor, *, warm_up: bool = False, **overrides: int | None,
) -> Tensor:
    """Launch with optional tile overrides (see :func:`_plan`); tests and benchmarks pin them, callers don't.

    ``warm_up`` compiles the kernels this call would launch and launches nothing."""
    num_rows, num_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    num_reqs, max_blocks = block_tables.shape
    if num_rows == 0:
        return out
    if num_reqs == 0:
        return out.zero_()
    fp32 = k_cache.dtype == torch.float32
    plan = _plan(num_rows, num_heads, head_dim, kv_heads, page, num_reqs, max_blocks, _num_sms(q.device), fp32,
                 **overrides)
    group = num_heads // kv_heads
    block_q, block_d, num_splits, num_tile_progs = plan.block_q, plan.block_d, plan.num_splits, plan.num_tile_progs
    precision = "ieee" if fp32 else "tf32"
    scale_log2 = float(scale) * _LOG2E

    if num_splits == 1:
        m_part = l_part = o_part = out  # unused by the single-pass kernel; any pointer of the right device
        grid = (num_tile_progs + triton.cdiv(num_rows, block_q), kv_heads, 1)
    else:
        m_part = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        o_part = torch.empty((num_rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        grid = (num_tile_progs, kv_heads, num_splits)

    _run(_paged_attn_kernel, grid, warm_up,
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, m_part, l_part, o_part,
        scale_log2, num_reqs, num_rows, num_tile_progs,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=plan.group_pad, PAGE=page,
        BLOCK_Q=block_q, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=block_d,
        NUM_SPLITS=num_splits, PRECISION=precision, LOOP_WHILE=_INTERPRETED,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if num_splits > 1:
        _run(_merge_splits_kernel, (num_rows, num_heads), warm_up,
            m_part, l_part, o_part, query_start_loc, out,
            num_reqs, out.stride(0), out.stride(1), out.stride(2),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLITS_PAD=max(triton.next_power_of_2(num_splits), 2), BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
        )
    return out


def _run(kernel: object, grid: tuple[int, ...], warm_up: bool, *args: object, **kwargs: object) -> None:
    if warm_up:
        kernel.warmup(*args, grid=grid, **kwargs)  # type: ignore[attr-defined]
    else:
        kernel[grid](*args, **kwargs)  # type: ignore[index]


def warm_up_paged_attention(num_heads: int, head_dim: int, k_cache: Tensor, v_cache: Tensor, max_blocks: int) -> int:
    """Compile now every kernel variant a launch over these caches can pick; returns how many variants.

    A launch's tile height (decode-like or prefill-like rows per request) and KV split count follow the
    batch's shape (:func:`_plan`), and each combination is its own compiled kernel. Captured graphs fix the
    shapes of decode-time steps, but eager forwards -- prefills, and the draft's catch-up after a saturation
    pause, whose rows per request grow with the pause -- pick whatever their shape asks for, so the first
    catch-up after a longer pause than any before met a compile inside serving (0.1-1 s fresh, tens of ms
    from Triton's disk cache) on the step that probes whether drafting pays. The variants are few: two tile
    heights times the power-of-two split counts up to ``_MAX_SPLITS``. ``max_blocks`` is the block-table
    width serving uses (its row stride is part of a kernel's specialisation). 0 where the kernel does not
    run: no Triton, not CUDA, or the interpreter.
    """
    if triton is None or _INTERPRETED or k_cache.device.type != "cuda":
        return 0
    device = k_cache.device
    _, page, kv_heads, _ = k_cache.shape
    q = torch.empty((1, num_heads, head_dim), dtype=k_cache.dtype, device=device)
    out = torch.empty_like(q)
    tables = torch.zeros((1, max_blocks), dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    fp32 = k_cache.dtype == torch.float32
    variants = attention_variants(num_heads, head_dim, kv_heads, page, max_blocks, _num_sms(device), fp32)
    for block_m, splits in variants:
        _launch(q, k_cache, v_cache, tables, seq_lens, qsl, 1.0, out, warm_up=True, block_m=block_m,
                num_splits=splits)
    return len(variants)


def attention_variants(num_heads: int, head_dim: int, kv_heads: int, page: int, max_blocks: int, num_sms: int,
                       fp32: bool = False) -> list[tuple[int, int]]:
    """Every (tile height, split count) the planner can pick for these shapes, as :func:`_plan` overrides.

    The tile height is decode-like (16 rows) or prefill-like (64; never in fp32); one query tile is the
    fewest programs a launch has, so its split count is the most any launch picks, and counts are powers of
    two. Everything else in a plan follows from these two and the shapes."""
    out: dict[tuple[int, ...], tuple[int, int]] = {}
    for block_m in (16,) if fp32 else (16, 64):
        most = _plan(1, num_heads, head_dim, kv_heads, page, 1, max_blocks, num_sms, fp32,
                     block_m=block_m).num_splits
        for splits in (1 << i for i in range(most.bit_length())):
            p = _plan(1, num_heads, head_dim, kv_heads, page, 1, max_blocks, num_sms, fp32, num_splits=splits,
                      block_m=block_m)
            out.setdefault(_compiled_key(p), (block_m, splits))
    return list(out.values())


def _compiled_key(p: _Plan) -> tuple[int, ...]:
    """What of a plan is compiled into the kernel (the tile-program count is a runtime argument)."""
    return p.block_m, p.block_q, p.group_pad, p.block_n, p.block_d, p.num_splits, p.num_warps, p.num_stages


def paged_attention_varlen(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """Causal attention of a ragged query batch over a paged KV cache (see the module docstring).

    CUDA tensors run the Triton kernel (host-sync free, CUDA-graph capturable); CPU tensors run
    :func:`torch_reference` unless the Triton interpreter is active.
    """
    _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    if out is None:
        out = torch.empty_like(q)
    use_kernel = triton is not None and (q.device.type == "cuda" or _INTERPRETED)
    if not use_kernel:
        if q.device.type == "cuda":
            raise RuntimeError("paged attention on CUDA needs triton; install it or use the torch backend")
        return torch_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=out)
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out)


def torch_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """Same contract as :func:`paged_attention_varlen`, in plain torch with fp32 math.

    It loops over requests and reads their lengths on the host, so it is neither graph-capturable nor fast on
    a GPU; it is the CPU path and the oracle the kernel is tested against.
    """
    _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    num_rows, num_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    result = torch.zeros((num_rows, num_heads, head_dim), dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r in range(block_tables.shape[0]):
        start, end = qsl[r], qsl[r + 1]
        n, kv_len = end - start, lens[r]
        if n == 0:
            continue
        num_pages = -(-kv_len // page)
        pages = block_tables[r, :num_pages].long()
        k = k_cache[pages].reshape(num_pages * page, kv_heads, head_dim)[:kv_len].float()
        v = v_cache[pages].reshape(num_pages * page, kv_heads, head_dim)[:kv_len].float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]: head h reads KV head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[start:end].float(), k) * scale
        positions = torch.arange(kv_len - n, kv_len, device=q.device)
        visible = torch.arange(kv_len, device=q.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        result[start:end] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)
