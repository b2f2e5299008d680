"""Fused Triton kernels for the per-step core: the varlen verify layout and the rejection sampler.

Why kernels: inside a CUDA graph every tiny torch op is still a graph node costing on the order of a
microsecond or more, and the torch reference of the sampler is ~50 of them around a few passes over the
logits (upcast, scale, exp materialise ``[T, V]`` float32 temporaries). The sampler is memory-bound, so
here it is a handful of launches:

1. the **row kernel**: reads every logits row exactly once -- argmax and an online log-sum-exp under the
   request's temperature -- then ``p`` of the row's draft, the accept decision, and a scatter of
   ``row index * 2 + accept bit`` into the request's ``[R, K + 1]`` slot. With ``row_split > 1`` a row is
   cut into vocabulary chunks, one program each, that leave (max, first argmax, sum of exps) partials; a
   small **combine** kernel then makes the decisions (more programs in flight when there are few rows);
2. for sampled batches, the **tile-mass kernel** (one program per request and vocabulary chunk): float64
   masses of the bonus weights ``e`` per vocabulary tile of the request's emit row. With one-hot ``q``
   the residual is ``e`` without the rejected draft, so only the tile holding that draft gets a second
   (residual) mass. A real ``q`` needs the normaliser ``sum(e)`` before the residual exists, so a second
   launch (**tile_res**) writes the residual masses;
3. the **final kernel** (one program per request): first rejection from the slots, the tile holding the
   inverse-CDF target from the cumulative tile masses, the inverse CDF inside that one tile, the
   ``[K + 1]`` output row -- and it zeroes the request's slots, so the next run needs no memset.

Why the row kernel folds groups: a program streams its row with 16-byte loads, and each thread keeps
one running (max, argmax tile, sum) per load *group* of 4 fp32 / 8 bf16 tokens instead of per token:
a group costs one in-register max, one exp per token and one rescale exp, and the state is a few
registers, so many programs fit on an SM and enough loads are in flight to stream at the copy
bandwidth. The per-token state (3 registers per token, masked loads) made the compiler issue a thread's
loads one at a time: the sampled row kernel ran at 1.75x the greedy one on an H200 for the same bytes.
The exact first argmax inside the winning group is re-read at the end (one 16-byte load of data just
streamed).

Why the emit work is split over ``R x chunks`` programs: it is one ``[V]`` row per request, and one
program per request (``R`` programs on ~130 SMs) sweeping its row with the accurate ``expf`` and float64
sums is latency-bound (1.05x to 2.6x slower than the split on an H200). Spread out, the pass is bound
by instructions per token (division, accurate exp, float64 sum), hence one float64 plane per launch, no
masks on whole chunks and the division below.

The emit weights repeat the torch reference operation for operation (the correctly rounded division by
the temperature -- from a reciprocal and two fma corrections, which round the same as the general
division --, the accurate ``expf``, a float64 normaliser) and the inverse CDF runs in float64 in both
paths: over a ~50k vocabulary a float32 running sum drifts by more than a typical token's mass, which made
the sampled token depend on the summation order (about 1% of requests differed from torch on an H200). The
tile masses only locate the tile; the cumulative mass before it and the scan inside it are float64 sums
of the same float32 weights, so a different grouping moves the result only when the target lies within
float64 round-off (~1e-13 of the mass) of a token boundary. What can still differ is the accept test
``u * q < p`` at about one row in a million (``p`` from a faster exp and another reduction order) -- each
path is lossless on its own; they are just not bitwise twins there.

The varlen layout is one single-program launch (the cumulative sum over requests carries across chunks).
Padding rows (and greedy requests in the emit kernels) read no logits; no launch shape depends on tensor
values, so all of it is CUDA-graph capturable. Loop trip counts are compile-time constants (the vocabulary
size, and power-of-two bucket counts for R and T), which keeps recompilation rare and the CPU interpreter
(``TRITON_INTERPRET=1``) usable. The torch code in ``layout.py`` / ``rejection.py`` is the reference:
tests check these kernels against it. Top-p batches stay on torch because the nucleus needs a sort.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # triton is optional: the torch path is the reference and the CPU path
    triton = None
    tl = None
    libdevice = None

# A finite "minus infinity": online-softmax rescaling of never-touched lanes stays exp(0) * 0 = 0
# instead of exp(-inf + inf) = nan.
_NEG = -1.0e30
_LOG2E = 1.4426950408889634


def supported(device: torch.device) -> bool:
    """Kernels can run here (CUDA, or the CPU interpreter when TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return device.type == "cuda" or _interpreting()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Kernels are the default here: CUDA with triton installed."""
    return triton is not None and device.type == "cuda"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _layout_requests(
        r0, carry, j, last_ptr, drafts_ptr, stride_dr, adm_ptr, start_ptr,
        ids_ptr, pos_ptr, req_ptr, pir_ptr, pad_ptr, qsl_ptr, seq_ptr, nlog_ptr, num_reqs, num_rows,
        K: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        # Requests r0 .. r0 + BLOCK_R - 1: their rows, counts and per-request outputs; returns the row carry.
        r = r0 + tl.arange(0, BLOCK_R)
        rmask = r < num_reqs
        adm = tl.load(adm_ptr + r, mask=rmask, other=0).to(tl.int32)
        adm = tl.minimum(tl.maximum(adm, 0), K)
        cnt = tl.where(rmask, adm + 1, 0)
        ends = tl.cumsum(cnt, 0) + carry
        starts = ends - cnt
        sp = tl.load(start_ptr + r, mask=rmask, other=0).to(tl.int64)
        tl.store(qsl_ptr + 1 + r, ends.to(tl.int32), mask=rmask)
        tl.store(seq_ptr + r, (sp + cnt).to(tl.int32), mask=rmask)
        tl.store(nlog_ptr + r, cnt.to(tl.int32), mask=rmask)
        row = starts[:, None] + j[None, :]
        m2 = rmask[:, None] & (j[None, :] <= adm[:, None]) & (row < num_rows)
        last = tl.load(last_ptr + r, mask=rmask, other=0).to(tl.int64)
        dcol = tl.maximum(j - 1, 0)
        dr = tl.load(drafts_ptr + r[:, None].to(tl.int64) * stride_dr + dcol[None, :],
                     mask=m2 & (j[None, :] >= 1), other=0).to(tl.int64)
        tok = tl.where(j[None, :] == 0, last[:, None], dr)
        tl.store(ids_ptr + row, tok, mask=m2)
        tl.store(pos_ptr + row, sp[:, None] + j[None, :].to(tl.int64), mask=m2)
        tl.store(req_ptr + row, r[:, None].to(tl.int64) + j[None, :] * 0, mask=m2)
        tl.store(pir_ptr + row, (j[None, :] + r[:, None] * 0).to(tl.int64), mask=m2)
        tl.store(pad_ptr + row, (j[None, :] * 0 + r[:, None] * 0).to(tl.uint8), mask=m2)
        return carry + tl.sum(cnt, 0)

    @triton.jit
    def _layout_padding(t0, carry, ids_ptr, pos_ptr, req_ptr, pir_ptr, pad_ptr, num_reqs, num_rows,
                        BLOCK_T: tl.constexpr):
        # Rows t0 .. t0 + BLOCK_T - 1 at or past the last request's rows: padding.
        t = t0 + tl.arange(0, BLOCK_T)
        tm = (t < num_rows) & (t >= carry)
        zero = (t * 0).to(tl.int64)  # int64 zeros shaped like t
        tl.store(ids_ptr + t, zero, mask=tm)
        tl.store(pos_ptr + t, zero, mask=tm)
        tl.store(req_ptr + t, zero + num_reqs, mask=tm)
        tl.store(pir_ptr + t, zero, mask=tm)
        tl.store(pad_ptr + t, (zero + 1).to(tl.uint8), mask=tm)

    # One compiled variant per K. The request count and the padded row count change from step to step
    # (the budget decides the rows), so they are runtime loop bounds and never specialised on: a variant per
    # shape was a JIT compile -- tens of milliseconds up to a second -- inside serving each time a new
    # (requests, budget) shape came up (measured on an H200: the layout phase averaged 19 ms per step).
    # LOOP_WHILE: the interpreter (CPU tests) cannot take tensor bounds in range() with numpy >= 2.4; while
    # loops give the same iterations there, and compiled kernels keep the for loops.
    @triton.jit(do_not_specialize=["num_reqs", "num_rows"])
    def _varlen_layout_kernel(
        last_ptr, drafts_ptr, stride_dr, adm_ptr, start_ptr,
        ids_ptr, pos_ptr, req_ptr, pir_ptr, pad_ptr, qsl_ptr, seq_ptr, nlog_ptr, ntok_ptr,
        num_reqs, num_rows,
        K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_T: tl.constexpr,
        LOOP_WHILE: tl.constexpr,
    ):
        # Row counts fit int32 (T is a capture size); values stored as int64 where the layout says so.
        carry = tl.sum(tl.zeros([BLOCK_R], tl.int32), 0)
        tl.store(qsl_ptr, carry)
        j = tl.arange(0, BLOCK_J)
        if LOOP_WHILE:
            r0 = 0
            while r0 < num_reqs:
                carry = _layout_requests(r0, carry, j, last_ptr, drafts_ptr, stride_dr, adm_ptr, start_ptr,
                                         ids_ptr, pos_ptr, req_ptr, pir_ptr, pad_ptr, qsl_ptr, seq_ptr, nlog_ptr,
                                         num_reqs, num_rows, K, BLOCK_R)
                r0 += BLOCK_R
        else:
            for r0 in range(0, num_reqs, BLOCK_R):
                carry = _layout_requests(r0, carry, j, last_ptr, drafts_ptr, stride_dr, adm_ptr, start_ptr,
                                         ids_ptr, pos_ptr, req_ptr, pir_ptr, pad_ptr, qsl_ptr, seq_ptr, nlog_ptr,
                                         num_reqs, num_rows, K, BLOCK_R)
        tl.store(ntok_ptr, carry.to(tl.int64))
        if LOOP_WHILE:
            t0 = 0
            while t0 < num_rows:
                _layout_padding(t0, carry, ids_ptr, pos_ptr, req_ptr, pir_ptr, pad_ptr, num_reqs, num_rows,
                                BLOCK_T)
                t0 += BLOCK_T
        else:
            for t0 in range(0, num_rows, BLOCK_T):
                _layout_padding(t0, carry, ids_ptr, pos_ptr, req_ptr, pir_ptr, pad_ptr, num_reqs, num_rows,
                                BLOCK_T)


    @triton.jit
    def _group_step(x, it, m, it_l, s, c, HAS_TEMP: tl.constexpr):
        # Per-group state: x is [lanes, GROUP], one 16-byte load per lane, reduced in registers. The group
        # max joins the lane's running max; the sum is rescaled once per group (exp2(0) = 1 when the max
        # did not move, 0 on the first real group since m starts at the finite NEG) and gains one exp per
        # token. Only the tile index of the lane's first maximum is kept (strict '>'): the position inside
        # the group is re-read at the end.
        gmax = tl.max(x, 1)
        m_new = tl.maximum(m, gmax)
        if HAS_TEMP:
            s = s * tl.exp2((m - m_new) * c) + tl.sum(tl.exp2((x - m_new[:, None]) * c), 1)
        it_l = tl.where(gmax > m, it, it_l)
        return m_new, it_l, s

    @triton.jit
    def _row_load(base, it, offs, lim, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        idx = it * BLOCK + offs
        if MASKED:
            return tl.load(base + idx, mask=idx < lim, other=float("-inf")).to(tl.float32)
        else:
            return tl.load(base + idx).to(tl.float32)

    @triton.jit
    def _row_ids(t, tm, req_ptr, pos_ptr, valid_ptr, adm_ptr, drafts_ptr, stride_dr, num_reqs, K: tl.constexpr):
        # Loads only; the caller consumes adm / x after its streaming loop, so their latency is hidden.
        req_raw = tl.load(req_ptr + t, mask=tm, other=-1).to(tl.int64)
        pos = tl.load(pos_ptr + t, mask=tm, other=0).to(tl.int64)
        flag = tl.load(valid_ptr + t, mask=tm, other=0) != 0
        r = tl.minimum(tl.maximum(req_raw, 0), num_reqs - 1)
        p_c = tl.minimum(tl.maximum(pos, 0), K)
        d_col = tl.minimum(p_c, K - 1)
        adm = tl.load(adm_ptr + r).to(tl.int64)
        x = tl.load(drafts_ptr + r * stride_dr + d_col).to(tl.int64)
        return req_raw, pos, flag, r, p_c, d_col, adm, x

    @triton.jit
    def _row_scale(r, temp_ptr, HAS_TEMP: tl.constexpr):
        # c = log2(e) / temperature: exp(z) = exp2(logit * c). Greedy requests get temperature 1.
        if HAS_TEMP:
            temp = tl.load(temp_ptr + r).to(tl.float32)
            greedy = temp <= 0
            c = 1.4426950408889634 / tl.where(greedy, 1.0, temp)
        else:
            greedy = r >= 0  # all greedy
            c = (r * 0 + 1).to(tl.float32)
        return greedy, c

    @triton.jit
    def _row_decide(t, tm, req_raw, pos, flag, r, p_c, d_col, adm, x, greedy, c, top, arg, ssum, row_base,
                    q_ptr, stride_qr, stride_qk, u_ptr, num_reqs, argmax_ptr, max_ptr, slots_ptr,
                    K: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr):
        # Works on one row (scalars) or a block of rows (vectors): the fused row kernel and the combine kernel.
        adm = tl.minimum(tl.maximum(adm, 0), K)
        valid = flag & (req_raw >= 0) & (req_raw < num_reqs) & (pos >= 0) & (pos <= adm)
        has_draft = valid & (pos < adm)
        tl.store(argmax_ptr + t, arg.to(tl.int64), mask=tm)
        accept = x == arg
        if HAS_TEMP:
            v_x = tl.load(row_base + x, mask=valid, other=float("-inf")).to(tl.float32)
            if HAS_Q:
                q_x = tl.load(q_ptr + r * stride_qr + d_col * stride_qk + x, mask=valid, other=1.0).to(tl.float32)
            else:
                q_x = 1.0
            u0 = tl.load(u_ptr + t * 2, mask=tm, other=1.0).to(tl.float32)
            p_x = tl.where(ssum > 0, tl.exp2((v_x - top) * c) / tl.where(ssum > 0, ssum, 1.0), 0.0)
            accept = tl.where(greedy, accept, u0 * q_x < p_x)
            tl.store(max_ptr + t, top, mask=tm)  # raw row max: the emit pass rebuilds max(z) = top / t exactly
        accept = accept & has_draft
        # One word per slot: the row holding it and its accept bit (unwritten = 0 = rejected, row 0).
        tl.store(slots_ptr + r * (K + 1) + p_c, t * 2 + accept.to(tl.int64), mask=valid)

    @triton.jit(do_not_specialize=["num_reqs", "part_plane"])
    def _row_kernel(
        logits_ptr, stride_row, req_ptr, pos_ptr, valid_ptr, drafts_ptr, stride_dr, adm_ptr,
        temp_ptr, q_ptr, stride_qr, stride_qk, u_ptr, num_reqs,
        argmax_ptr, max_ptr, slots_ptr, part_ptr, part_arg_ptr, part_plane,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr,
        BLOCK: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr, UNROLL: tl.constexpr,
        STAGES: tl.constexpr, NEG: tl.constexpr,
    ):
        # Program (t, chunk): row t, full tiles [chunk * TPC, (chunk + 1) * TPC), plus one leftover full tile
        # for the first REM chunks, plus the partial tail tile for the last chunk. Full tiles load without
        # masks (padding rows skip the loops instead): a masked load needs its registers preset to the fill
        # value, and with those the compiler issued a thread's loads one after the other.
        t = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        tm = t >= 0
        req_raw, pos, flag, r, p_c, d_col, adm, x = _row_ids(
            t, tm, req_ptr, pos_ptr, valid_ptr, adm_ptr, drafts_ptr, stride_dr, num_reqs, K)
        greedy, c = _row_scale(r, temp_ptr, HAS_TEMP)
        base = logits_ptr + t * stride_row
        lanes = tl.arange(0, BLOCK // GROUP)
        cols = tl.arange(0, GROUP)
        offs = lanes[:, None] * GROUP + cols[None, :]
        m = tl.full([BLOCK // GROUP], NEG, tl.float32)
        it_l = tl.zeros([BLOCK // GROUP], tl.int32)
        s = tl.zeros([BLOCK // GROUP], tl.float32)
        TPC: tl.constexpr = (VOCAB // BLOCK) // SPLIT
        REM: tl.constexpr = VOCAB // BLOCK - TPC * SPLIT
        first = chunk * TPC
        if flag:
            # The pointers walk the row (one add per load) instead of being rebuilt from the tile index.
            ptrs = base + first * BLOCK + offs
            if UNROLL == 2:
                # Both loads of a pair issue before either tile is folded; tiles still fold in order.
                for i2 in range(0, TPC // 2):
                    it = first + 2 * i2
                    v = tl.load(ptrs).to(tl.float32)
                    w = tl.load(ptrs + BLOCK).to(tl.float32)
                    m, it_l, s = _group_step(v, it, m, it_l, s, c, HAS_TEMP)
                    m, it_l, s = _group_step(w, it + 1, m, it_l, s, c, HAS_TEMP)
                    ptrs += 2 * BLOCK
                if TPC % 2 == 1:
                    v = tl.load(ptrs).to(tl.float32)
                    m, it_l, s = _group_step(v, first + TPC - 1, m, it_l, s, c, HAS_TEMP)
            elif STAGES > 0:
                # The compiler's software pipeline (asynchronous copies through shared memory).
                for i in tl.range(0, TPC, num_stages=STAGES):
                    v = tl.load(ptrs).to(tl.float32)
                    m, it_l, s = _group_step(v, first + i, m, it_l, s, c, HAS_TEMP)
                    ptrs += BLOCK
            else:
                for i in range(0, TPC):
                    v = tl.load(ptrs).to(tl.float32)
                    m, it_l, s = _group_step(v, first + i, m, it_l, s, c, HAS_TEMP)
                    ptrs += BLOCK
            if REM > 0:
                if chunk < REM:
                    it = SPLIT * TPC + chunk
                    v = _row_load(base, it, offs, VOCAB, BLOCK, False)
                    m, it_l, s = _group_step(v, it, m, it_l, s, c, HAS_TEMP)
        if VOCAB % BLOCK != 0:
            it = VOCAB // BLOCK + chunk * 0
            lim = tl.where(flag & (chunk == SPLIT - 1), VOCAB, 0)  # 0: every lane masked, no traffic
            v = _row_load(base, it, offs, lim, BLOCK, True)
            m, it_l, s = _group_step(v, it, m, it_l, s, c, HAS_TEMP)
        top = tl.max(m, 0)
        # First maximum: the earliest group holding top among the lanes whose max is top, then the first
        # position inside it (a 16-byte re-read of data this program just streamed).
        gstart = it_l * BLOCK + lanes * GROUP
        gidx = gstart[:, None] + cols[None, :]
        cand = (m == top) & (m > NEG)
        xg = tl.load(base + gidx, mask=cand[:, None] & (gidx < VOCAB), other=float("-inf")).to(tl.float32)
        arg = tl.min(tl.min(tl.where(xg == top, gidx, VOCAB), 1), 0)
        arg = tl.where(arg >= VOCAB, 0, arg)  # nothing above NEG: torch.argmax of such a row is 0 here too
        if HAS_TEMP:
            ssum = tl.sum(s * tl.exp2((m - top) * c), 0)
        else:
            ssum = top
        if SPLIT == 1:
            _row_decide(t, tm, req_raw, pos, flag, r, p_c, d_col, adm, x, greedy, c, top, arg, ssum, base,
                        q_ptr, stride_qr, stride_qk, u_ptr, num_reqs, argmax_ptr, max_ptr, slots_ptr,
                        K, HAS_TEMP, HAS_Q)
        else:
            out = t * SPLIT + chunk
            tl.store(part_ptr + out, top)
            tl.store(part_ptr + part_plane + out, ssum)
            tl.store(part_arg_ptr + out, arg)

    @triton.jit(do_not_specialize=["num_reqs", "num_rows", "part_plane"])
    def _combine_kernel(
        logits_ptr, stride_row, req_ptr, pos_ptr, valid_ptr, drafts_ptr, stride_dr, adm_ptr,
        temp_ptr, q_ptr, stride_qr, stride_qk, u_ptr, num_reqs, num_rows,
        argmax_ptr, max_ptr, slots_ptr, part_ptr, part_arg_ptr, part_plane,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr,
        SPLIT: tl.constexpr, SP: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        # Chunk partials -> row results. Chunks cover disjoint vocabulary ranges and each partial argmax is
        # the first maximum of its chunk, so the smallest argmax among the chunks holding the row max is the
        # row's first maximum.
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        tm = t < num_rows
        req_raw, pos, flag, r, p_c, d_col, adm, x = _row_ids(
            t, tm, req_ptr, pos_ptr, valid_ptr, adm_ptr, drafts_ptr, stride_dr, num_reqs, K)
        greedy, c = _row_scale(r, temp_ptr, HAS_TEMP)
        j = tl.arange(0, SP)
        pm = tm[:, None] & (j[None, :] < SPLIT)
        pidx = t[:, None] * SPLIT + j[None, :]
        pmax = tl.load(part_ptr + pidx, mask=pm, other=float("-inf"))
        parg = tl.load(part_arg_ptr + pidx, mask=pm, other=VOCAB)
        top = tl.where(tm, tl.max(pmax, 1), 0.0)  # rows past the end: no -inf - -inf below
        arg = tl.min(tl.where(pmax == top[:, None], parg, VOCAB), 1)
        arg = tl.where(arg >= VOCAB, 0, arg)
        if HAS_TEMP:
            psum = tl.load(part_ptr + part_plane + pidx, mask=pm, other=0.0)
            ssum = tl.sum(tl.where(pm, psum * tl.exp2((pmax - top[:, None]) * c[:, None]), 0.0), 1)
        else:
            ssum = top
        _row_decide(t, tm, req_raw, pos, flag, r, p_c, d_col, adm, x, greedy, c, top, arg, ssum,
                    logits_ptr + t * stride_row, q_ptr, stride_qr, stride_qk, u_ptr, num_reqs,
                    argmax_ptr, max_ptr, slots_ptr, K, HAS_TEMP, HAS_Q)

    @triton.jit
    def _first_rejection(r, adm_ptr, slots_ptr, num_rows, K: tl.constexpr, BLOCK_K: tl.constexpr):
        # One load gives the accept bits and the rows of all slots. Slots past admitted[r] are never written
        # (zero: rejected), so the first zero bit is the first rejection and its word holds the emit row.
        adm = tl.minimum(tl.maximum(tl.load(adm_ptr + r).to(tl.int64), 0), K)
        j = tl.arange(0, BLOCK_K)
        packed = tl.load(slots_ptr + r * (K + 1) + j, mask=j < K + 1, other=0)  # BLOCK_K >= K + 1
        na = tl.min(tl.where(((packed & 1) == 0) & (j < K), j, K), 0).to(tl.int64)
        emit_row = tl.sum(tl.where(j == na, packed >> 1, 0), 0)
        emit_row = tl.minimum(tl.maximum(emit_row, 0), num_rows - 1)
        return adm, na, emit_row

    @triton.jit
    def _clear_slots(r, slots_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr):
        # The last reader leaves the request's slots zeroed: the next run's scatter starts from "all
        # rejected" (what a missing row must read as) without a memset launch.
        j = tl.arange(0, BLOCK_K)
        tl.store(slots_ptr + r * (K + 1) + j, tl.zeros([BLOCK_K], tl.int64), mask=j < K + 1)

    @triton.jit
    def _emit_params(r, adm, na, emit_row, temp_ptr, max_ptr, drafts_ptr, stride_dr, K: tl.constexpr):
        temp_raw = tl.load(temp_ptr + r).to(tl.float32)
        # Re-derived through an integer compare: the CPU interpreter gives a float comparison the float
        # operand's type, and a mask broadcast from it then fails there.
        sampled_req = (temp_raw > 0).to(tl.int32) != 0
        temp = tl.where(sampled_req, temp_raw, 1.0)
        m = tl.math.div_rn(tl.load(max_ptr + emit_row), temp)  # = max of z: rounding is monotone
        rejected = na < adm
        q_col = tl.minimum(na, K - 1)
        bad = tl.load(drafts_ptr + r * stride_dr + q_col).to(tl.int64)
        return sampled_req, temp, m, rejected, q_col, bad

    @triton.jit
    def _fma(x, y, z, PRECISE: tl.constexpr):
        if PRECISE:
            return tl.fma(x, y, z)
        else:  # the CPU interpreter's fma rounds twice; float64 holds the float32 product exactly
            return (x.to(tl.float64) * y + z).to(tl.float32)

    @triton.jit
    def _div(a, b, rb, FAST: tl.constexpr, PRECISE: tl.constexpr):
        # IEEE a / b (what torch computes) for a scalar b > 0. FAST: rb = RN(1 / b), q0 = RN(a * rb) lies
        # within 1.5 ulp of a / b; one residual correction (the fma's a - b * q is exact or nearly so) brings
        # it within 1 ulp, and a second one rounds correctly (Markstein's theorem: y = RN(1 / b), q faithful,
        # r = a - b * q exact => RN(q + r * y) = RN(a / b)). Three fmas and a multiply per token instead of
        # the general division's range check and slow-path branch. Exact while no intermediate overflows or
        # turns subnormal (|a| in [2**-96, 2**64] for b in [2**-30, 2**30]); below that a / b is far under
        # half an ulp of the row max it is offset by, so exp(z - max z) is the same; infinite a gives a * rb.
        if FAST:
            inf = tl.abs(a) == float("inf")
            a_f = tl.where(inf, 0.0, a)  # keeps inf - inf (nan) out of the corrections
            q = a_f * rb
            q = _fma(_fma(-b, q, a_f, PRECISE), rb, q, PRECISE)
            q = _fma(_fma(-b, q, a_f, PRECISE), rb, q, PRECISE)
            return tl.where(inf, a * rb, q)
        else:
            return tl.math.div_rn(a, b)

    @triton.jit
    def _div_probe_kernel(a_ptr, out_ptr, b, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        a = tl.load(a_ptr + i, mask=i < n, other=0.0)
        tl.store(out_ptr + i, _div(a, b, tl.math.div_rn(1.0, b), True, True), mask=i < n)

    @triton.jit
    def _emit_weights(base, qbase, idx, mask, temp, m, norm, bad, use_q_res, HAS_Q: tl.constexpr,
                      PRECISE: tl.constexpr, MASKED: tl.constexpr, FAST_DIV: tl.constexpr):
        # Operation for operation the torch reference (rejection._emit_pass_torch): z = logit / t
        # (IEEE division), e = exp(z - max z) with the accurate expf, p = e / float32(sum_f64 e).
        # MASKED=False: every index is inside the vocabulary and wanted (no select per token).
        if MASKED:
            v = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
        else:
            v = tl.load(base + idx).to(tl.float32)
        z = _div(v, temp, tl.math.div_rn(1.0, temp), FAST_DIV, PRECISE) - m
        if PRECISE:
            e = libdevice.exp(z)
        else:  # the CPU interpreter has no libdevice; numpy's exp stands in
            e = tl.exp(z)
        if MASKED:
            e = tl.where(mask, e, 0.0)
        if HAS_Q:
            if MASKED:
                q = tl.load(qbase + idx, mask=mask & use_q_res, other=0.0).to(tl.float32)
            else:
                q = tl.load(qbase + idx).to(tl.float32)
            res = tl.maximum(_div(e, norm, tl.math.div_rn(1.0, norm), FAST_DIV, PRECISE) - q, 0.0)
        else:
            res = tl.where(idx == bad, 0.0, e)
        if MASKED:
            res = tl.where(mask, res, 0.0)
        return e, res

    @triton.jit(do_not_specialize=["num_rows", "plane"])
    def _tile_mass_kernel(
        logits_ptr, stride_row, drafts_ptr, stride_dr, adm_ptr, temp_ptr, q_ptr, stride_qr, stride_qk,
        max_ptr, slots_ptr, num_rows, mass_ptr, bad_ptr, norm_ptr, plane,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_Q: tl.constexpr, RES: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_S: tl.constexpr, SUBS: tl.constexpr, NTS: tl.constexpr, NB: tl.constexpr, PRECISE: tl.constexpr,
        FAST_DIV: tl.constexpr,
    ):
        # Program (r, c) covers SUBS consecutive tiles of BLOCK_S tokens of request r's emit row. mass plane
        # 0: bonus weights e; plane 1 (RES, a real q): the residual weights. One plane per launch: one
        # float64 reduction per tile. Requests that will not read a plane (greedy ones; not rejected for the
        # residual) skip the program: the final kernel never reads their stale values.
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        adm, na, emit_row = _first_rejection(r, adm_ptr, slots_ptr, num_rows, K, BLOCK_K)
        sampled_req, temp, m, rejected, q_col, bad = _emit_params(
            r, adm, na, emit_row, temp_ptr, max_ptr, drafts_ptr, stride_dr, K)
        use_q_res = rejected & sampled_req
        base = logits_ptr + emit_row * stride_row
        qbase = q_ptr + r * stride_qr + q_col * stride_qk
        tile = c * SUBS + tl.arange(0, SUBS)
        idx = tile[:, None] * BLOCK_S + tl.arange(0, BLOCK_S)[None, :]
        out = r * NTS + tile
        CH: tl.constexpr = BLOCK_S * SUBS
        # Chunks wholly inside the vocabulary load without masks (no select per token).
        inside = (c + 1) * CH <= VOCAB
        if RES:
            if use_q_res:
                # p = e / sum(e) against q: the normaliser is the float64 sum of the e tile masses.
                nb = tl.arange(0, NB)
                e_tiles = tl.load(mass_ptr + r * NTS + nb, mask=nb < NTS, other=0.0)
                norm = tl.sum(e_tiles, 0).to(tl.float32)
                norm = tl.where(norm > 0, norm, 1.0)
                tl.store(norm_ptr + r, norm, mask=c == 0)  # the final kernel must use this exact value
                if inside:
                    _, res = _emit_weights(base, qbase, idx, idx < VOCAB, temp, m, norm, bad, use_q_res, True,
                                           PRECISE, False, FAST_DIV)
                else:
                    _, res = _emit_weights(base, qbase, idx, idx < VOCAB, temp, m, norm, bad, use_q_res, True,
                                           PRECISE, True, FAST_DIV)
                tl.store(mass_ptr + plane + out, tl.sum(res.to(tl.float64), 1))
        else:
            if sampled_req:
                if inside:
                    e, res = _emit_weights(base, qbase, idx, idx < VOCAB, temp, m, 1.0, bad, False, False,
                                           PRECISE, False, FAST_DIV)
                else:
                    e, res = _emit_weights(base, qbase, idx, idx < VOCAB, temp, m, 1.0, bad, False, False,
                                           PRECISE, True, FAST_DIV)
                tl.store(mass_ptr + out, tl.sum(e.to(tl.float64), 1))
                if not HAS_Q:
                    # One-hot q: the residual is e without the rejected draft, so it differs from e in one
                    # tile only; the program holding that tile also stores its SUBS residual masses.
                    if use_q_res & (tl.minimum(tl.maximum(bad // CH, 0), NTS // SUBS - 1) == c):
                        tl.store(bad_ptr + r * SUBS + tl.arange(0, SUBS), tl.sum(res.to(tl.float64), 1))

    @triton.jit(do_not_specialize=["num_rows", "plane"])
    def _final_kernel(
        logits_ptr, stride_row, drafts_ptr, stride_dr, adm_ptr, temp_ptr, q_ptr, stride_qr, stride_qk,
        u_ptr, argmax_ptr, max_ptr, slots_ptr, num_rows, mass_ptr, bad_ptr, norm_ptr, plane,
        tokens_ptr, nacc_ptr,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_S: tl.constexpr, SUBS: tl.constexpr, NTS: tl.constexpr, NB: tl.constexpr, PRECISE: tl.constexpr,
        FAST_DIV: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        adm, na, emit_row = _first_rejection(r, adm_ptr, slots_ptr, num_rows, K, BLOCK_K)
        token = tl.load(argmax_ptr + emit_row)
        if HAS_TEMP:
            sampled_req, temp, m, rejected, q_col, bad = _emit_params(
                r, adm, na, emit_row, temp_ptr, max_ptr, drafts_ptr, stride_dr, K)
            live = tl.where(sampled_req, VOCAB, 0)
            use_q_res = rejected & sampled_req
            base = logits_ptr + emit_row * stride_row
            qbase = q_ptr + r * stride_qr + q_col * stride_qk
            # The tile-mass launches skipped what this request does not read (greedy: everything; no
            # rejection: the residual), so those loads are masked off here too.
            nb = tl.arange(0, NB)
            nmask = nb < NTS
            tiles_e = tl.load(mass_ptr + r * NTS + nb, mask=nmask & sampled_req, other=0.0)
            if HAS_Q:
                tiles_r = tl.load(mass_ptr + plane + r * NTS + nb, mask=nmask & use_q_res, other=0.0)
                norm = tl.load(norm_ptr + r, mask=use_q_res, other=1.0)
            else:
                in_bad = (nb // SUBS) == tl.minimum(tl.maximum(bad // (BLOCK_S * SUBS), 0), NTS // SUBS - 1)
                bad_tiles = tl.load(bad_ptr + r * SUBS + nb % SUBS, mask=in_bad & nmask & use_q_res, other=0.0)
                tiles_r = tl.where(in_bad, bad_tiles, tiles_e)
                norm = 1.0
            # From here on the decisions of inverse_cdf_sample, over tiles then inside one tile.
            use_res = rejected & (tl.sum(tiles_r, 0) > 0)
            tiles = tl.where(use_res, tiles_r, tiles_e)
            target = tl.load(u_ptr + emit_row * 2 + 1).to(tl.float64) * tl.sum(tiles, 0)
            cum = tl.cumsum(tiles, 0)
            tile = tl.min(tl.where(cum > target, nb, NB), 0)
            # The mass before the tile is the running sum that was compared (<= target), so the first crossing
            # inside the tile is a positive weight (searchsorted(right=True) skips zero weights).
            before = tl.sum(tl.where(nb == tile - 1, cum, 0.0), 0)
            offs = tl.arange(0, BLOCK_S)
            idx = tile * BLOCK_S + offs
            mask = (idx < live) & (tile < NTS)
            e, res = _emit_weights(base, qbase, idx, mask, temp, m, norm, bad, use_q_res, HAS_Q, PRECISE, True,
                                   FAST_DIV)
            w = tl.where(use_res, res, e).to(tl.float64)
            cdf = tl.cumsum(w, 0) + before
            found = tl.min(tl.where((cdf > target) & mask, idx, VOCAB), 0)
            if sampled_req & (found >= VOCAB):
                # Round-off left the target at or past the total: the clamp to the last positive weight,
                # which lies in the last tile of positive mass.
                idx = tl.max(tl.where(tiles > 0, nb, 0), 0) * BLOCK_S + offs
                e, res = _emit_weights(base, qbase, idx, idx < live, temp, m, norm, bad, use_q_res, HAS_Q,
                                       PRECISE, True, FAST_DIV)
                found = tl.max(tl.where(tl.where(use_res, res, e) > 0, idx, 0), 0)
            token = tl.where(sampled_req, found.to(tl.int64), token)
        jj = tl.arange(0, BLOCK_K)
        drafted = tl.load(drafts_ptr + r * stride_dr + jj, mask=jj < na, other=0).to(tl.int64)
        out = tl.where(jj < na, drafted, tl.where(jj == na, token, -1))
        tl.store(tokens_ptr + r * (K + 1) + jj, out, mask=jj < K + 1)
        tl.store(nacc_ptr + r, na)
        _clear_slots(r, slots_ptr, K, BLOCK_K)


def _kernel_input(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as ``dtype``, rows dense (unit last stride) and 16-byte aligned: no-ops when it already is.

    Callers hand in column views of packed batch tensors and counts of either integer width.
    """
    t = t.to(dtype)
    if t.dim() and t.stride(-1) != 1:
        t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


LAYOUT_BLOCK_R = 128  # requests per iteration of the layout kernel's request loop
LAYOUT_BLOCK_T = 1024  # rows per iteration of its padding loop


def build_varlen_layout_fused(
    last_tokens: Tensor, drafts: Tensor, admitted: Tensor, start_pos: Tensor, padded_tokens: int
) -> tuple[Tensor, ...]:
    """One launch computing the tensors of ``layout.build_varlen_layout`` (same semantics)."""
    num_reqs, num_spec = drafts.shape
    device = drafts.device
    rows = padded_tokens
    i64 = torch.int64
    ids = torch.empty(rows, dtype=i64, device=device)
    positions = torch.empty(rows, dtype=i64, device=device)
    req_index = torch.empty(rows, dtype=i64, device=device)
    pos_in_req = torch.empty(rows, dtype=i64, device=device)
    pad = torch.empty(rows, dtype=torch.uint8, device=device)
    qsl = torch.empty(num_reqs + 1, dtype=torch.int32, device=device)
    seq_lens = torch.empty(num_reqs, dtype=torch.int32, device=device)
    nlog = torch.empty(num_reqs, dtype=torch.int32, device=device)
    ntok = torch.empty((), dtype=i64, device=device)
    # Triton compiles a variant per argument dtype and per pointer alignment: canonical inputs keep it at one
    # variant per K, which the engines compile at start-up (warm_up_varlen_layout). On the H200 the first
    # drafting step (int32 admitted counts) and the first paused step (K = 0) each compiled one inside serving.
    last_tokens, drafts = _kernel_input(last_tokens, i64), _kernel_input(drafts, i64)
    admitted, start_pos = _kernel_input(admitted, torch.int32), _kernel_input(start_pos, i64)
    # Fixed tiles (see the kernel): one variant per K serves every batch; a step is one program either way.
    _varlen_layout_kernel[(1,)](
        last_tokens, drafts, drafts.stride(0), admitted, start_pos,
        ids, positions, req_index, pos_in_req, pad, qsl, seq_lens, nlog, ntok,
        num_reqs, rows,
        K=num_spec, BLOCK_R=LAYOUT_BLOCK_R, BLOCK_J=_pow2(num_spec + 1), BLOCK_T=LAYOUT_BLOCK_T,
        LOOP_WHILE=_interpreting(), num_warps=4,
    )
    return ids, positions, req_index, pos_in_req, pad.view(torch.bool), qsl, seq_lens, nlog, ntok



EMIT_DIVISIONS = ("fast", "rn")  # logit / temperature in the emit kernels: see _div

# Kernel shapes the benchmark times side by side (plan knobs; {} = the defaults). Every one must keep the
# sampler's contract: the tests run each of them against the torch reference.
# The H200 sweep of 2026-11-29 (benchmarks/results/h200/core_step_sweep) chose the defaults: the pipelined
# row loop from 512 rows up (-1% fp32, -5% bf16 at 2048 rows; noise below) and 1024-token tiles, two per
# tile-mass program at 4 warps. It dropped the per-token row fold (up to 1.4x slower from 512 rows), the
# one-program-per-request finalize (1.05x to 2.6x slower at every size), 16-warp and 128-byte-per-thread
# row tiles (slower everywhere).
SWEEP_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # row kernel (and the combine launch when a row is split)
    "row:split1": {"row_split": 1},
    "row:split2": {"row_split": 2},
    "row:split4": {"row_split": 4},
    "row:w4": {"row_warps": 4, "row_bytes": 8192},
    "row:unroll2": {"row_unroll": 2, "row_stages": 0},
    "row:plain": {"row_stages": 0},  # the plain loop at every size (the default pipelines from 512 rows)
    "row:stages3": {"row_stages": 3},  # the pipelined loop at every size
    # emit side: inverse-CDF tile x tiles per tile-mass program x its warps
    "tile:1024x4": {"tile_block": 1024, "tile_subs": 4, "tile_warps": 8},  # the default before the sweep
    "tile:2048x2": {"tile_block": 2048, "tile_subs": 2, "tile_warps": 8},
    "tile:4096x1": {"tile_block": 4096, "tile_subs": 1, "tile_warps": 8},
    "emit:rn": {"emit_div": "rn"},  # the general IEEE division per token in the emit kernels
}
PIPELINE_MIN_ROWS = 512  # the row kernel's pipelined loop pays from here (H200 sweep)


@dataclass
class SamplerPlan:
    """The sampler's launches bound to their buffers: ``run`` them in order, or time them one by one.

    Every stage is a fixed-shape launch that reads only device memory, so a stage, a prefix or the whole
    list can be captured in a CUDA graph; ``tokens`` / ``num_accepted`` are written by the last. The final
    stage leaves the slot scratch zeroed for the next run, so a stage timed on its own may see slots of an
    earlier replay: only values change, not the work. ``config`` holds the resolved kernel shapes;
    ``precompile`` compiles every launch without running it (under triton's asynchronous compile mode the
    compiles of many plans overlap).
    """

    stages: list[tuple[str, Callable[[], None]]]
    tokens: Tensor
    num_accepted: Tensor
    config: dict[str, Any] = field(default_factory=dict)
    warmups: list[Callable[[], None]] = field(default_factory=list)

    def run(self) -> tuple[Tensor, Tensor]:
        for _, launch in self.stages:
            launch()
        return self.tokens, self.num_accepted

    def precompile(self) -> None:
        for warm in self.warmups:
            warm()


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def auto_row_split(num_rows: int, full_tiles: int, sms: int) -> int:
    """Chunks per row so that ~4 row programs per SM stream at once; 1 (no combine launch) for big batches.

    A row program streams its whole row serially: with fewer rows than ~4 per SM most of the device
    waits on a few long programs, and more, shorter ones fill it at the cost of the small combine launch.
    The split divides the full tiles evenly (a chunk with one more tile than the others sets the pace).
    """
    want = (4 * sms) // max(num_rows, 1)
    if num_rows < 1 or want < 2:
        return 1
    return max(d for d in range(1, min(want, full_tiles) + 1) if full_tiles % d == 0) if full_tiles else 1


def plan_rejection_sample(
    logits: Tensor, req_index: Tensor, pos_in_req: Tensor, valid: Tensor, drafts: Tensor, admitted: Tensor,
    temperature: Tensor | None, draft_probs: Tensor | None, uniforms: Tensor | None, *,
    row_block: int | None = None, row_bytes: int = 16384, row_warps: int = 8,
    row_unroll: int = 1, row_group: int | None = None, row_split: int | None = None, row_stages: int | None = None,
    tile_block: int | None = None, tile_subs: int | None = None, tile_warps: int | None = None,
    emit_div: str = "fast",
) -> SamplerPlan:
    """Allocate the sampler's buffers and bind its launches (see ``rejection_sample_fused``).

    Row kernel: ``row_block`` tokens per tile (default ``row_bytes`` of logits: 64 bytes per thread at 8 warps),
    ``row_warps``, ``row_unroll`` (1 or 2 tiles loaded per step), ``row_group`` (tokens per in-register group;
    default one 16-byte load, must divide ``row_block``), ``row_split`` (vocabulary chunks per row, each its own
    program, combined by a second launch; default ``auto_row_split``), ``row_stages`` (0 = plain loop, n >= 2 =
    the compiler's n-stage pipelined loop; default 3 from ``PIPELINE_MIN_ROWS`` rows, else 0). ``tile_block`` /
    ``tile_subs`` / ``tile_warps``: tokens per inverse-CDF tile, tiles per tile-mass program and its warps.
    ``emit_div``: "fast" (a reciprocal and two fma corrections per token, correctly rounded: ``_div``) or "rn"
    (the general IEEE division per token).
    The knobs exist for benchmarks and tests
    (small tiles exercise many of them on a small vocabulary); None picks the defaults. ``row_unroll`` /
    ``row_stages`` leave every lane's operations unchanged; other shapes regroup the row kernel's float32
    sums (``p(x)`` may round differently) and the float64 tile masses.
    """
    if emit_div not in EMIT_DIVISIONS:
        raise ValueError(f"emit_div must be one of {EMIT_DIVISIONS}, got {emit_div!r}")
    if row_unroll not in (1, 2):
        raise ValueError(f"row_unroll must be 1 or 2, got {row_unroll}")
    num_rows, vocab = logits.shape
    if row_stages is None:
        row_stages = 3 if row_unroll == 1 and num_rows >= PIPELINE_MIN_ROWS else 0
    if row_stages < 0 or (row_stages and row_unroll != 1):
        raise ValueError(f"row_stages must be >= 0 and needs row_unroll=1, got {row_stages} / {row_unroll}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_reqs, num_spec = drafts.shape
    device = logits.device
    if drafts.stride(1) != 1:
        drafts = drafts.contiguous()
    has_temp = temperature is not None
    has_q = has_temp and draft_probs is not None
    elem = logits.element_size()
    block = row_block or min(max(1, row_bytes // elem), _pow2(vocab))
    group = row_group or min(max(1, 16 // elem), block)
    if block & (block - 1) or group & (group - 1) or group > block:
        raise ValueError(f"row_block and row_group must be powers of two, group <= block; got {block}, {group}")
    split = row_split or auto_row_split(num_rows, vocab // block, _sm_count(device))
    if split < 1:
        raise ValueError(f"row_split must be >= 1, got {split}")
    num_slots = num_reqs * (num_spec + 1)
    # One word per slot (row * 2 + accept bit). Zero here; afterwards the final kernel re-zeroes what it read.
    slots = torch.zeros(num_slots, dtype=torch.int64, device=device)
    argmax = torch.empty(num_rows, dtype=torch.int64, device=device)
    row_max = torch.empty(num_rows, dtype=torch.float32, device=device)
    tokens = torch.empty(num_reqs, num_spec + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    temp = temperature.to(torch.float32).contiguous() if has_temp else row_max  # dummy pointer when unused
    if has_q:
        q = draft_probs if draft_probs.stride(2) == 1 else draft_probs.contiguous()
        sq_r, sq_k = q.stride(0), q.stride(1)
    else:
        q, sq_r, sq_k = row_max, 0, 0
    u = uniforms.to(torch.float32).contiguous() if has_temp else row_max
    valid_u8 = valid.to(torch.bool).contiguous().view(torch.uint8)
    req_c, pos_c = req_index.contiguous(), pos_in_req.contiguous()
    if split > 1:
        part = torch.empty(2, num_rows, split, dtype=torch.float32, device=device)
        part_arg = torch.empty(num_rows, split, dtype=torch.int32, device=device)
    else:
        part, part_arg = row_max, argmax  # unused
    precise = not _interpreting()
    block_k = _pow2(num_spec + 1)
    rows_ok = max(num_rows, 1)
    config: dict[str, Any] = {"row_block": block, "row_warps": row_warps,
                              "row_unroll": row_unroll, "row_group": group, "row_split": split,
                              "row_stages": row_stages, "emit_div": emit_div}
    fast_div = emit_div == "fast"
    plan = SamplerPlan([], tokens, num_accepted, config)

    def stage(name: str, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        plan.stages.append((name, lambda: kernel[grid](*args, **kwargs)))
        plan.warmups.append(lambda: kernel.warmup(*args, grid=grid, **kwargs))

    row_args = (logits, logits.stride(0), req_c, pos_c, valid_u8, drafts, drafts.stride(0), admitted, temp, q,
                sq_r, sq_k, u, num_reqs)
    if num_rows > 0:
        stage("row", _row_kernel, (num_rows, split), *row_args, argmax, row_max, slots, part, part_arg,
              num_rows * split, K=num_spec, VOCAB=vocab, HAS_TEMP=has_temp, HAS_Q=has_q, BLOCK=block,
              GROUP=group, SPLIT=split, UNROLL=row_unroll, STAGES=row_stages, NEG=_NEG, num_warps=row_warps)
        if split > 1:
            block_t = min(128, _pow2(num_rows))
            stage("combine", _combine_kernel, (-(-num_rows // block_t),), *row_args, num_rows, argmax, row_max,
                  slots, part, part_arg, num_rows * split, K=num_spec, VOCAB=vocab, HAS_TEMP=has_temp,
                  HAS_Q=has_q, SPLIT=split, SP=_pow2(split), BLOCK_T=block_t, num_warps=4)
    emit_args = (logits, logits.stride(0), drafts, drafts.stride(0), admitted, temp, q, sq_r, sq_k)
    # Tiles of 1024 keep the final kernel's single-tile float64 scan short; two tiles per tile-mass program
    # at 4 warps (a 2048-token read each) measured best on the H200 (more programs in flight than 4 x 1024).
    tblock = tile_block or min(1024, _pow2(vocab))
    subs = tile_subs or min(2, _pow2(-(-vocab // tblock)))
    chunks = -(-vocab // (tblock * subs))
    nts = chunks * subs  # tiles per request, a multiple of subs: the last ones may be past the vocabulary
    nb = _pow2(nts)
    if has_temp:
        # Plane 0: bonus-weight masses; plane 1 (real q): residual masses. bad_mass: the residual masses of
        # the chunk holding the rejected draft (one-hot q).
        mass = torch.empty(2 if has_q else 1, num_reqs, nts, dtype=torch.float64, device=device)
        bad_mass = torch.empty(num_reqs, subs, dtype=torch.float64, device=device)
        norm = torch.empty(num_reqs, dtype=torch.float32, device=device)
    else:  # greedy: the final kernel reads none of these
        mass, bad_mass, norm = row_max, row_max, row_max
    tile_warps = tile_warps or max(1, min(4, tblock * subs // 512))
    config.update(tile_block=tblock, tile_subs=subs, tile_warps=tile_warps)
    mass_args = (row_max, slots, rows_ok, mass, bad_mass, norm, num_reqs * nts)
    shape = dict(K=num_spec, VOCAB=vocab, HAS_Q=has_q, BLOCK_K=block_k, BLOCK_S=tblock, SUBS=subs, NTS=nts, NB=nb,
                 PRECISE=precise, FAST_DIV=fast_div)
    if has_temp:
        stage("tile_e", _tile_mass_kernel, (num_reqs, chunks), *emit_args, *mass_args, RES=False, **shape,
              num_warps=tile_warps)
    if has_q:
        stage("tile_res", _tile_mass_kernel, (num_reqs, chunks), *emit_args, *mass_args, RES=True, **shape,
              num_warps=tile_warps)
    stage("final", _final_kernel, (num_reqs,), *emit_args, u, argmax, row_max, slots, rows_ok, mass, bad_mass, norm,
          num_reqs * nts, tokens, num_accepted, HAS_TEMP=has_temp, **shape,
          num_warps=max(1, min(8, tblock // 256)))
    return plan


def probe_division(a: Tensor, b: float, out: Tensor) -> None:
    """``out = a / b`` through the emit kernels' fast division (CUDA): tests compare it with torch's division."""
    n = a.numel()
    _div_probe_kernel[(-(-n // 1024),)](a, out, float(b), n, BLOCK=1024)


def rejection_sample_fused(
    logits: Tensor, req_index: Tensor, pos_in_req: Tensor, valid: Tensor, drafts: Tensor, admitted: Tensor,
    temperature: Tensor | None, draft_probs: Tensor | None, uniforms: Tensor | None,
    **knobs: Any,
) -> tuple[Tensor, Tensor]:
    """Same contract as ``rejection.rejection_sample`` without top-p: returns (tokens[R, K+1], num_accepted[R]).

    ``knobs``: see ``plan_rejection_sample`` (defaults are what the sampler uses).
    """
    return plan_rejection_sample(logits, req_index, pos_in_req, valid, drafts, admitted, temperature,
                                 draft_probs, uniforms, **knobs).run()
