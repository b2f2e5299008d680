"""Fused Triton kernels for the per-step core: the varlen verify layout and the rejection sampler.

Why kernels: inside a CUDA graph every tiny torch op is still a graph node costing on the order of a
microsecond or more, and the torch reference of the sampler is ~50 of them around a few passes over the
logits (upcast, scale, exp materialise ``[T, V]`` float32 temporaries). The sampler is memory-bound, so
here it is three launches:

1. a memset of the ``[R, K + 1]`` slot scratch;
2. the **row kernel** (one program per logits row): reads its row exactly once -- argmax, online
   log-sum-exp under the request's temperature, ``p`` of the row's draft -- decides acceptance, and
   scatters the accept bit and its row index into the request's slot;
3. the **finalize kernel** (one program per request): first rejection from the slot bits, then for
   sampled requests two sweeps over the single emit row (residual mass, inverse-CDF scan with one
   uniform) and the ``[K + 1]`` output row.

The varlen layout is one single-program launch (the cumulative sum over requests carries across chunks).
Padding rows are fully masked (no memory traffic); no launch shape depends on tensor values, so all of
it is CUDA-graph capturable. Loop trip counts are compile-time constants (the vocabulary size, and
power-of-two bucket counts for R and T), which keeps recompilation rare and the CPU interpreter
(``TRITON_INTERPRET=1``) usable. The torch code in ``layout.py`` / ``rejection.py`` is the reference:
tests check these kernels against it. Top-p batches stay on torch because the nucleus needs a sort.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the torch path is the reference and the CPU path
    triton = None
    tl = None

# A finite "minus infinity": online-softmax rescaling of never-touched lanes stays exp(0) * 0 = 0
# instead of exp(-inf + inf) = nan.
_NEG = -1.0e30


def supported(device: torch.device) -> bool:
    """Kernels can run here (CUDA, or the CPU interpreter when TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Kernels are the default here: CUDA with triton installed."""
    return triton is not None and device.type == "cuda"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _varlen_layout_kernel(
        last_ptr, drafts_ptr, stride_dr, adm_ptr, start_ptr,
        ids_ptr, pos_ptr, req_ptr, pir_ptr, pad_ptr, qsl_ptr, seq_ptr, nlog_ptr, ntok_ptr,
        num_reqs, num_rows,
        K: tl.constexpr, R_ITERS: tl.constexpr, T_ITERS: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        # Row counts fit int32 (T is a capture size); values stored as int64 where the layout says so.
        carry = tl.sum(tl.zeros([BLOCK_R], tl.int32), 0)
        tl.store(qsl_ptr, carry)
        j = tl.arange(0, BLOCK_J)
        for it in range(R_ITERS):
            r = it * BLOCK_R + tl.arange(0, BLOCK_R)
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
            carry += tl.sum(cnt, 0)
        tl.store(ntok_ptr, carry.to(tl.int64))
        for it in range(T_ITERS):
            t = it * BLOCK_T + tl.arange(0, BLOCK_T)
            tm = (t < num_rows) & (t >= carry)
            zero = (t * 0).to(tl.int64)  # int64 zeros shaped like t
            tl.store(ids_ptr + t, zero, mask=tm)
            tl.store(pos_ptr + t, zero, mask=tm)
            tl.store(req_ptr + t, zero + num_reqs, mask=tm)
            tl.store(pir_ptr + t, zero, mask=tm)
            tl.store(pad_ptr + t, (zero + 1).to(tl.uint8), mask=tm)

    @triton.jit
    def _row_kernel(
        logits_ptr, stride_row, req_ptr, pos_ptr, valid_ptr, drafts_ptr, stride_dr, adm_ptr,
        temp_ptr, q_ptr, stride_qr, stride_qk, u_ptr, num_reqs,
        argmax_ptr, max_ptr, sum_ptr, slots_ptr, num_slots,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr,
        BLOCK: tl.constexpr, NEG: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        req_raw = tl.load(req_ptr + t).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        r = tl.minimum(tl.maximum(req_raw, 0), num_reqs - 1)
        p_c = tl.minimum(tl.maximum(pos, 0), K)
        adm = tl.minimum(tl.maximum(tl.load(adm_ptr + r).to(tl.int64), 0), K)
        valid = (tl.load(valid_ptr + t) != 0) & (req_raw >= 0) & (req_raw < num_reqs) & (pos >= 0)
        valid = valid & (pos <= adm)
        has_draft = valid & (pos < adm)
        d_col = tl.minimum(p_c, K - 1)
        x = tl.load(drafts_ptr + r * stride_dr + d_col).to(tl.int64)
        if HAS_TEMP:
            temp = tl.load(temp_ptr + r).to(tl.float32)
            greedy = temp <= 0
            inv_t = 1.0 / tl.where(greedy, 1.0, temp)
        else:
            greedy = True
            inv_t = 1.0
        base = logits_ptr + t * stride_row
        offs = tl.arange(0, BLOCK)
        best_val = tl.full([BLOCK], NEG, tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        m_vec = tl.full([BLOCK], NEG, tl.float32)
        s_vec = tl.zeros([BLOCK], tl.float32)
        for start in range(0, VOCAB, BLOCK):
            idx = start + offs
            mask = (idx < VOCAB) & valid  # padding rows: fully masked loads touch no memory
            v = tl.load(base + idx, mask=mask, other=NEG).to(tl.float32)
            # Strict '>' keeps the earliest index per lane, matching torch.argmax's first-maximum rule.
            take = v > best_val
            best_idx = tl.where(take, idx, best_idx)
            best_val = tl.where(take, v, best_val)
            if HAS_TEMP:
                z = v * inv_t
                m_new = tl.maximum(m_vec, z)
                s_vec = s_vec * tl.exp(m_vec - m_new) + tl.where(mask, tl.exp(z - m_new), 0.0)
                m_vec = m_new
        top = tl.max(best_val, 0)
        arg = tl.min(tl.where(best_val == top, best_idx, VOCAB), 0).to(tl.int64)
        tl.store(argmax_ptr + t, arg)
        accept = x == arg
        if HAS_TEMP:
            m = tl.max(m_vec, 0)
            s = tl.sum(s_vec * tl.exp(m_vec - m), 0)
            z_x = tl.load(base + x, mask=valid, other=NEG).to(tl.float32) * inv_t
            p_x = tl.where(s > 0, tl.exp(z_x - m) / s, 0.0)
            if HAS_Q:
                q_x = tl.load(q_ptr + r * stride_qr + d_col * stride_qk + x).to(tl.float32)
            else:
                q_x = 1.0
            u0 = tl.load(u_ptr + t * 2).to(tl.float32)
            accept = tl.where(greedy, accept, u0 * q_x < p_x)
            tl.store(max_ptr + t, m)
            tl.store(sum_ptr + t, s)
        accept = accept & has_draft
        slot = r * (K + 1) + p_c
        tl.store(slots_ptr + slot, accept.to(tl.int64), mask=valid)
        tl.store(slots_ptr + num_slots + slot, t, mask=valid)

    @triton.jit
    def _finalize_kernel(
        logits_ptr, stride_row, drafts_ptr, stride_dr, adm_ptr, temp_ptr, q_ptr, stride_qr, stride_qk,
        u_ptr, argmax_ptr, max_ptr, sum_ptr, slots_ptr, num_slots, num_rows, tokens_ptr, nacc_ptr,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        adm = tl.minimum(tl.maximum(tl.load(adm_ptr + r).to(tl.int64), 0), K)
        j = tl.arange(0, BLOCK_K)
        # Slots past admitted[r] were never written (memset 0), so the first zero is the first rejection.
        acc = tl.load(slots_ptr + r * (K + 1) + j, mask=j < K, other=0)  # BLOCK_K >= K + 1
        na = tl.min(tl.where((acc == 0) & (j < K), j, K), 0).to(tl.int64)
        emit_row = tl.load(slots_ptr + num_slots + r * (K + 1) + na)
        emit_row = tl.minimum(tl.maximum(emit_row, 0), num_rows - 1)
        token = tl.load(argmax_ptr + emit_row)
        if HAS_TEMP:
            temp = tl.load(temp_ptr + r).to(tl.float32)
            sampled_req = temp > 0
            live = tl.where(sampled_req, VOCAB, 0)
            inv_t = 1.0 / tl.where(sampled_req, temp, 1.0)
            m = tl.load(max_ptr + emit_row)
            s = tl.load(sum_ptr + emit_row)
            inv_s = tl.where(s > 0, 1.0 / s, 0.0)
            rejected = na < adm
            q_col = tl.minimum(na, K - 1)
            bad = tl.load(drafts_ptr + r * stride_dr + q_col).to(tl.int64)
            base = logits_ptr + emit_row * stride_row
            qbase = q_ptr + r * stride_qr + q_col * stride_qk
            offs = tl.arange(0, BLOCK)
            # Sweep 1: mass of the residual max(p - q, 0) and of p (fallback when the residual is empty).
            res_acc = tl.zeros([BLOCK], tl.float32)
            p_acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, VOCAB, BLOCK):
                idx = start + offs
                mask = idx < live  # greedy requests read nothing here
                v = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
                p = tl.where(mask, tl.exp(v * inv_t - m) * inv_s, 0.0)
                if HAS_Q:
                    q = tl.load(qbase + idx, mask=mask, other=0.0).to(tl.float32)
                else:
                    q = tl.where(idx == bad, 1.0, 0.0)
                res_acc += tl.maximum(p - q, 0.0)
                p_acc += p
            res_total = tl.sum(res_acc, 0)
            use_res = rejected & (res_total > 0)
            target = tl.load(u_ptr + emit_row * 2 + 1).to(tl.float32) * tl.where(use_res, res_total,
                                                                                 tl.sum(p_acc, 0))
            # Sweep 2: inverse CDF. First index whose running mass exceeds the target, clamped to the
            # last positive weight in case rounding leaves the target above the final running sum.
            running = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
            found = tl.max(tl.zeros([BLOCK], tl.int32), 0) + VOCAB
            last_pos = tl.max(tl.zeros([BLOCK], tl.int32), 0)
            for start in range(0, VOCAB, BLOCK):
                idx = start + offs
                mask = idx < live
                v = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
                p = tl.where(mask, tl.exp(v * inv_t - m) * inv_s, 0.0)
                if HAS_Q:
                    q = tl.load(qbase + idx, mask=mask, other=0.0).to(tl.float32)
                else:
                    q = tl.where(idx == bad, 1.0, 0.0)
                w = tl.where(use_res, tl.maximum(p - q, 0.0), p)
                cdf = tl.cumsum(w, 0) + running
                found = tl.minimum(found, tl.min(tl.where((cdf > target) & mask, idx, VOCAB), 0))
                last_pos = tl.maximum(last_pos, tl.max(tl.where((w > 0) & mask, idx, 0), 0))
                running += tl.sum(w, 0)
            token = tl.where(sampled_req, tl.minimum(found, last_pos).to(tl.int64), token)
        jj = tl.arange(0, BLOCK_K)
        drafted = tl.load(drafts_ptr + r * stride_dr + jj, mask=jj < na, other=0).to(tl.int64)
        out = tl.where(jj < na, drafted, tl.where(jj == na, token, -1))
        tl.store(tokens_ptr + r * (K + 1) + jj, out, mask=jj < K + 1)
        tl.store(nacc_ptr + r, na)


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
    if drafts.stride(1) != 1:
        drafts = drafts.contiguous()
    block_r = min(128, _pow2(num_reqs))
    block_t = min(1024, _pow2(rows))
    _varlen_layout_kernel[(1,)](
        last_tokens, drafts, drafts.stride(0), admitted, start_pos,
        ids, positions, req_index, pos_in_req, pad, qsl, seq_lens, nlog, ntok,
        num_reqs, rows,
        K=num_spec, R_ITERS=_pow2(-(-num_reqs // block_r)), T_ITERS=_pow2(-(-rows // block_t)),
        BLOCK_R=block_r, BLOCK_J=_pow2(num_spec + 1), BLOCK_T=block_t, num_warps=4,
    )
    return ids, positions, req_index, pos_in_req, pad.view(torch.bool), qsl, seq_lens, nlog, ntok


def rejection_sample_fused(
    logits: Tensor, req_index: Tensor, pos_in_req: Tensor, valid: Tensor, drafts: Tensor, admitted: Tensor,
    temperature: Tensor | None, draft_probs: Tensor | None, uniforms: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Same contract as ``rejection.rejection_sample`` without top-p: returns (tokens[R, K+1], num_accepted[R])."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    num_reqs, num_spec = drafts.shape
    device = logits.device
    if drafts.stride(1) != 1:
        drafts = drafts.contiguous()
    has_temp = temperature is not None
    has_q = has_temp and draft_probs is not None
    num_slots = num_reqs * (num_spec + 1)
    # Row 0: accept bits per slot; row 1: which logits row holds the slot. Zeroed: unwritten = rejected.
    slots = torch.zeros(2, num_slots, dtype=torch.int64, device=device)
    argmax = torch.empty(num_rows, dtype=torch.int64, device=device)
    row_max = torch.empty(num_rows, dtype=torch.float32, device=device)
    row_sum = torch.empty(num_rows, dtype=torch.float32, device=device)
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
    block = min(4096, _pow2(vocab))
    if num_rows > 0:
        _row_kernel[(num_rows,)](
            logits, logits.stride(0), req_index.contiguous(), pos_in_req.contiguous(), valid_u8,
            drafts, drafts.stride(0), admitted, temp, q, sq_r, sq_k, u, num_reqs,
            argmax, row_max, row_sum, slots, num_slots,
            K=num_spec, VOCAB=vocab, HAS_TEMP=has_temp, HAS_Q=has_q, BLOCK=block, NEG=_NEG, num_warps=8,
        )
    _finalize_kernel[(num_reqs,)](
        logits, logits.stride(0), drafts, drafts.stride(0), admitted, temp, q, sq_r, sq_k,
        u, argmax, row_max, row_sum, slots, num_slots, max(num_rows, 1), tokens, num_accepted,
        K=num_spec, VOCAB=vocab, HAS_TEMP=has_temp, HAS_Q=has_q, BLOCK=block, BLOCK_K=_pow2(num_spec + 1),
        num_warps=8,
    )
    return tokens, num_accepted
