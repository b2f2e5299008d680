"""Fused Triton kernels for the per-step core: the varlen verify layout and the rejection sampler.

Why kernels: inside a CUDA graph every tiny torch op is still a graph node costing on the order of a
microsecond or more, and the torch reference of the sampler is ~50 of them around a few passes over the
logits (upcast, scale, exp materialise ``[T, V]`` float32 temporaries). The sampler is memory-bound, so
here it is a handful of launches:

1. a memset of the ``[R, K + 1]`` slot scratch;
2. the **row kernel** (one program per logits row): reads its row exactly once -- argmax and an online
   log-sum-exp under the request's temperature that costs one exp per element (the running lane max is
   the argmax value), ``p`` of the row's draft -- decides acceptance, and scatters the accept bit and its
   row index into the request's slot;
3. for sampled batches, the **tile-mass kernel** (one program per request and vocabulary chunk): float64
   masses of the bonus weights and of the residual weights per vocabulary tile of the request's emit row,
   and each tile's last positive index, into small ``[R, tiles]`` scratch tensors. A real ``q`` needs the
   normaliser ``sum(e)`` before the residual exists, so then a first launch of the same kernel writes the
   ``e`` masses and a second one the residual masses (the normaliser is the float64 sum of the ``e``
   tile masses);
4. the **final kernel** (one program per request): first rejection from the slot bits, the tile holding
   the inverse-CDF target from the cumulative tile masses, the inverse CDF inside that one tile, then the
   ``[K + 1]`` output row.

Why the split: the emit work is one ``[V]`` row per request, and one program per request (``R`` programs
on ~130 SMs) has to sweep its row serially with the accurate ``expf`` and float64 sums: latency-bound
(with it, the probabilistic sampler took 2.1x the greedy one on an H200 at R=256, K=7, V=49152, although
both read the logits once). Spread over ``R x chunks`` programs it is a short pass over ``R`` rows. The
one-program-per-request finalize is still here (``finalize="single"``) so a benchmark can compare both
in the same run.

The emit weights repeat the torch reference operation for operation (IEEE division by the temperature,
the accurate ``expf``, a float64 normaliser) and the inverse CDF runs in float64 in both paths: over a
~50k vocabulary a float32 running sum drifts by more than a typical token's mass, which made the sampled
token depend on the summation order (about 1% of requests differed from torch on an H200). What can
still differ is the accept test ``u * q < p`` at about one row in a million (``p`` from a faster exp and
another reduction order) -- each path is lossless on its own; they are just not bitwise twins there.

The varlen layout is one single-program launch (the cumulative sum over requests carries across chunks).
Padding rows (and greedy requests in the emit kernels) are fully masked (no memory traffic); no launch
shape depends on tensor values, so all of it is CUDA-graph capturable. Loop trip counts are compile-time
constants (the vocabulary size, and power-of-two bucket counts for R and T), which keeps recompilation
rare and the CPU interpreter (``TRITON_INTERPRET=1``) usable. The torch code in ``layout.py`` /
``rejection.py`` is the reference: tests check these kernels against it. Top-p batches stay on torch
because the nucleus needs a sort.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

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
    def _row_tile(v, it, best_val, best_it, s_vec, c, HAS_TEMP: tl.constexpr):
        # Strict '>' keeps the earliest tile per lane, matching torch.argmax's first-maximum rule.
        take = v > best_val
        if HAS_TEMP:
            # Online softmax with ONE exp per element: the running lane max is the argmax value, so a new
            # maximum rescales the old sum by exp(old - new) and adds exp(0) = 1, any other element adds
            # exp(v - max); both exponents are -|v - max| (in log2 units, c = log2(e) / temperature).
            # Masked lanes load -inf: their term is exp2(-inf) = 0 and they never take the max.
            e = tl.exp2(-tl.abs((v - best_val) * c))
            s_vec = tl.where(take, s_vec * e + 1.0, s_vec + e)
        best_it = tl.where(take, it, best_it)
        best_val = tl.where(take, v, best_val)
        return best_val, best_it, s_vec

    @triton.jit
    def _row_kernel(
        logits_ptr, stride_row, req_ptr, pos_ptr, valid_ptr, drafts_ptr, stride_dr, adm_ptr,
        temp_ptr, q_ptr, stride_qr, stride_qk, u_ptr, num_reqs,
        argmax_ptr, max_ptr, slots_ptr, num_slots,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr,
        BLOCK: tl.constexpr, NEG: tl.constexpr, PAIRS: tl.constexpr,
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
            c = 1.4426950408889634 / tl.where(greedy, 1.0, temp)
        else:
            greedy = True
            c = 1.0
        base = logits_ptr + t * stride_row
        offs = tl.arange(0, BLOCK)
        best_val = tl.full([BLOCK], NEG, tl.float32)
        best_it = tl.zeros([BLOCK], tl.int32)
        s_vec = tl.zeros([BLOCK], tl.float32)
        lane_ok = (offs < BLOCK) & valid  # padding rows: fully masked loads touch no memory
        # Full tiles: no vocabulary bound per element. The first PAIRS pairs of tiles have both loads issued
        # before either is used (more bytes in flight per thread: the loop is not software-pipelined); the
        # tiles are still folded in order, so every lane sees the same operations as without pairing.
        for it2 in range(0, PAIRS):
            it = it2 * 2
            v = tl.load(base + it * BLOCK + offs, mask=lane_ok, other=float("-inf")).to(tl.float32)
            w = tl.load(base + (it + 1) * BLOCK + offs, mask=lane_ok, other=float("-inf")).to(tl.float32)
            best_val, best_it, s_vec = _row_tile(v, it, best_val, best_it, s_vec, c, HAS_TEMP)
            best_val, best_it, s_vec = _row_tile(w, it + 1, best_val, best_it, s_vec, c, HAS_TEMP)
        for it in range(PAIRS * 2, VOCAB // BLOCK):
            v = tl.load(base + it * BLOCK + offs, mask=lane_ok, other=float("-inf")).to(tl.float32)
            best_val, best_it, s_vec = _row_tile(v, it, best_val, best_it, s_vec, c, HAS_TEMP)
        if VOCAB % BLOCK != 0:
            it = VOCAB // BLOCK
            idx = it * BLOCK + offs
            v = tl.load(base + idx, mask=lane_ok & (idx < VOCAB), other=float("-inf")).to(tl.float32)
            best_val, best_it, s_vec = _row_tile(v, it, best_val, best_it, s_vec, c, HAS_TEMP)
        top = tl.max(best_val, 0)
        arg = tl.min(tl.where(best_val == top, best_it * BLOCK + offs, VOCAB), 0).to(tl.int64)
        tl.store(argmax_ptr + t, arg)
        accept = x == arg
        if HAS_TEMP:
            s = tl.sum(s_vec * tl.exp2((best_val - top) * c), 0)
            v_x = tl.load(base + x, mask=valid, other=float("-inf")).to(tl.float32)
            p_x = tl.where(s > 0, tl.exp2((v_x - top) * c) / s, 0.0)
            if HAS_Q:
                q_x = tl.load(q_ptr + r * stride_qr + d_col * stride_qk + x).to(tl.float32)
            else:
                q_x = 1.0
            u0 = tl.load(u_ptr + t * 2).to(tl.float32)
            accept = tl.where(greedy, accept, u0 * q_x < p_x)
            tl.store(max_ptr + t, top)  # raw row max: the emit pass rebuilds max(z) = top / t exactly
        accept = accept & has_draft
        slot = r * (K + 1) + p_c
        tl.store(slots_ptr + slot, accept.to(tl.int64), mask=valid)
        tl.store(slots_ptr + num_slots + slot, t, mask=valid)

    @triton.jit
    def _emit_weights(base, qbase, idx, mask, temp, m, norm, bad, use_q_res, HAS_Q: tl.constexpr,
                      PRECISE: tl.constexpr):
        # Operation for operation the torch reference (rejection._emit_pass_torch): z = logit / t
        # (IEEE division), e = exp(z - max z) with the accurate expf, p = e / float32(sum_f64 e).
        v = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
        z = tl.math.div_rn(v, temp) - m
        if PRECISE:
            e = libdevice.exp(z)
        else:  # the CPU interpreter has no libdevice; numpy's exp stands in
            e = tl.exp(z)
        e = tl.where(mask, e, 0.0)
        if HAS_Q:
            q = tl.load(qbase + idx, mask=mask & use_q_res, other=0.0).to(tl.float32)
            res = tl.maximum(tl.math.div_rn(e, norm) - q, 0.0)
        else:
            res = tl.where(idx == bad, 0.0, e)
        return e, tl.where(mask, res, 0.0)

    @triton.jit
    def _finalize_kernel(
        logits_ptr, stride_row, drafts_ptr, stride_dr, adm_ptr, temp_ptr, q_ptr, stride_qr, stride_qk,
        u_ptr, argmax_ptr, max_ptr, slots_ptr, num_slots, num_rows, tokens_ptr, nacc_ptr,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, NT: tl.constexpr, NB: tl.constexpr, PRECISE: tl.constexpr,
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
            temp_raw = tl.load(temp_ptr + r).to(tl.float32)
            sampled_req = temp_raw > 0
            live = tl.where(sampled_req, VOCAB, 0)  # greedy requests read nothing here
            temp = tl.where(sampled_req, temp_raw, 1.0)
            m = tl.math.div_rn(tl.load(max_ptr + emit_row), temp)  # = max of z: rounding is monotone
            rejected = na < adm
            q_col = tl.minimum(na, K - 1)
            bad = tl.load(drafts_ptr + r * stride_dr + q_col).to(tl.int64)
            base = logits_ptr + emit_row * stride_row
            qbase = q_ptr + r * stride_qr + q_col * stride_qk
            offs = tl.arange(0, BLOCK)
            use_q_res = rejected & sampled_req
            norm = 1.0
            if HAS_Q:
                # p = e / sum(e) is only needed against a real q after a rejection.
                e_acc = tl.zeros([BLOCK], tl.float64)
                for start in range(0, VOCAB, BLOCK):
                    idx = start + offs
                    e, _ = _emit_weights(base, qbase, idx, (idx < live) & use_q_res, temp, m, 1.0, bad,
                                         False, False, PRECISE)
                    e_acc += e.to(tl.float64)
                norm = tl.sum(e_acc, 0).to(tl.float32)
                norm = tl.where(norm > 0, norm, 1.0)  # only 0 when unused (no rejection, greedy)
            # One sweep: per-tile masses of both candidate weightings (e for the bonus / empty residual,
            # the residual after a rejection) and their last positive index. The inverse CDF then needs
            # only the tile holding the target, not a second pass over the row.
            nb = tl.arange(0, NB)
            tiles_e = tl.zeros([NB], tl.float64)
            tiles_r = tl.zeros([NB], tl.float64)
            last_e = tl.max(tl.zeros([BLOCK], tl.int32), 0)
            last_r = tl.max(tl.zeros([BLOCK], tl.int32), 0)
            for it in range(0, NT):
                idx = it * BLOCK + offs
                mask = idx < live
                e, res = _emit_weights(base, qbase, idx, mask, temp, m, norm, bad, use_q_res, HAS_Q, PRECISE)
                tiles_e = tl.where(nb == it, tl.sum(e.to(tl.float64), 0), tiles_e)
                tiles_r = tl.where(nb == it, tl.sum(res.to(tl.float64), 0), tiles_r)
                last_e = tl.maximum(last_e, tl.max(tl.where(e > 0, idx, 0), 0))
                last_r = tl.maximum(last_r, tl.max(tl.where(res > 0, idx, 0), 0))
            use_res = rejected & (tl.sum(tiles_r, 0) > 0)
            tiles = tl.where(use_res, tiles_r, tiles_e)
            last_pos = tl.where(use_res, last_r, last_e)
            target = tl.load(u_ptr + emit_row * 2 + 1).to(tl.float64) * tl.sum(tiles, 0)
            cum = tl.cumsum(tiles, 0)
            tile = tl.min(tl.where(cum > target, nb, NB), 0)
            before = tl.sum(tl.where(nb < tile, tiles, 0.0), 0)
            # Inverse CDF inside that tile (searchsorted(right=True): first running mass above the target),
            # clamped to the last positive weight in case rounding leaves the target above the total.
            idx = tile * BLOCK + offs
            mask = (idx < live) & (tile < NB)
            e, res = _emit_weights(base, qbase, idx, mask, temp, m, norm, bad, use_q_res, HAS_Q, PRECISE)
            w = tl.where(use_res, res, e).to(tl.float64)
            cdf = tl.cumsum(w, 0) + before
            found = tl.min(tl.where((cdf > target) & mask, idx, VOCAB), 0)
            token = tl.where(sampled_req, tl.minimum(found, last_pos).to(tl.int64), token)
        jj = tl.arange(0, BLOCK_K)
        drafted = tl.load(drafts_ptr + r * stride_dr + jj, mask=jj < na, other=0).to(tl.int64)
        out = tl.where(jj < na, drafted, tl.where(jj == na, token, -1))
        tl.store(tokens_ptr + r * (K + 1) + jj, out, mask=jj < K + 1)
        tl.store(nacc_ptr + r, na)


    @triton.jit
    def _first_rejection(r, adm_ptr, slots_ptr, num_slots, num_rows, K: tl.constexpr, BLOCK_K: tl.constexpr):
        # Slots past admitted[r] were never written (memset 0), so the first zero is the first rejection.
        adm = tl.minimum(tl.maximum(tl.load(adm_ptr + r).to(tl.int64), 0), K)
        j = tl.arange(0, BLOCK_K)
        acc = tl.load(slots_ptr + r * (K + 1) + j, mask=j < K, other=0)  # BLOCK_K >= K + 1
        na = tl.min(tl.where((acc == 0) & (j < K), j, K), 0).to(tl.int64)
        emit_row = tl.load(slots_ptr + num_slots + r * (K + 1) + na)
        emit_row = tl.minimum(tl.maximum(emit_row, 0), num_rows - 1)
        return adm, na, emit_row

    @triton.jit
    def _emit_params(r, adm, na, emit_row, temp_ptr, max_ptr, drafts_ptr, stride_dr, K: tl.constexpr):
        temp_raw = tl.load(temp_ptr + r).to(tl.float32)
        sampled_req = temp_raw > 0
        temp = tl.where(sampled_req, temp_raw, 1.0)
        m = tl.math.div_rn(tl.load(max_ptr + emit_row), temp)  # = max of z: rounding is monotone
        rejected = na < adm
        q_col = tl.minimum(na, K - 1)
        bad = tl.load(drafts_ptr + r * stride_dr + q_col).to(tl.int64)
        return sampled_req, temp, m, rejected, q_col, bad

    @triton.jit
    def _tile_mass_kernel(
        logits_ptr, stride_row, drafts_ptr, stride_dr, adm_ptr, temp_ptr, q_ptr, stride_qr, stride_qk,
        max_ptr, slots_ptr, num_slots, num_rows, mass_ptr, last_ptr, norm_ptr, plane,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_Q: tl.constexpr, E_ONLY: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_S: tl.constexpr, SUBS: tl.constexpr, NTS: tl.constexpr, NB: tl.constexpr, PRECISE: tl.constexpr,
    ):
        # Program (r, c) covers SUBS consecutive tiles of BLOCK_S tokens of request r's emit row. Every
        # program stores all its tiles (zeros when masked), so the scratch never holds stale values.
        # mass/last planes: 0 = bonus weights e, 1 = residual weights.
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        adm, na, emit_row = _first_rejection(r, adm_ptr, slots_ptr, num_slots, num_rows, K, BLOCK_K)
        sampled_req, temp, m, rejected, q_col, bad = _emit_params(
            r, adm, na, emit_row, temp_ptr, max_ptr, drafts_ptr, stride_dr, K)
        live = tl.where(sampled_req, VOCAB, 0)  # greedy requests read nothing here
        use_q_res = rejected & sampled_req
        base = logits_ptr + emit_row * stride_row
        qbase = q_ptr + r * stride_qr + q_col * stride_qk
        tile = c * SUBS + tl.arange(0, SUBS)
        idx = tile[:, None] * BLOCK_S + tl.arange(0, BLOCK_S)[None, :]
        out = r * NTS + tile
        if E_ONLY:
            # First pass against a real q: e masses, which give both the bonus CDF and the normaliser.
            e, _ = _emit_weights(base, qbase, idx, idx < live, temp, m, 1.0, bad, False, False, PRECISE)
            tl.store(mass_ptr + out, tl.sum(e.to(tl.float64), 1))
            tl.store(last_ptr + out, tl.max(tl.where(e > 0, idx, 0), 1))
        elif HAS_Q:
            # p = e / sum(e) against q is only needed after a rejection: other requests read nothing.
            nb = tl.arange(0, NB)
            e_tiles = tl.load(mass_ptr + r * NTS + nb, mask=nb < NTS, other=0.0)
            norm = tl.sum(e_tiles, 0).to(tl.float32)
            norm = tl.where(norm > 0, norm, 1.0)
            tl.store(norm_ptr + r, norm, mask=c == 0)  # the final kernel must use this exact value
            _, res = _emit_weights(base, qbase, idx, (idx < live) & use_q_res, temp, m, norm, bad, use_q_res,
                                   True, PRECISE)
            tl.store(mass_ptr + plane + out, tl.sum(res.to(tl.float64), 1))
            tl.store(last_ptr + plane + out, tl.max(tl.where(res > 0, idx, 0), 1))
        else:
            e, res = _emit_weights(base, qbase, idx, idx < live, temp, m, 1.0, bad, use_q_res, False, PRECISE)
            tl.store(mass_ptr + out, tl.sum(e.to(tl.float64), 1))
            tl.store(last_ptr + out, tl.max(tl.where(e > 0, idx, 0), 1))
            tl.store(mass_ptr + plane + out, tl.sum(res.to(tl.float64), 1))
            tl.store(last_ptr + plane + out, tl.max(tl.where(res > 0, idx, 0), 1))

    @triton.jit
    def _final_kernel(
        logits_ptr, stride_row, drafts_ptr, stride_dr, adm_ptr, temp_ptr, q_ptr, stride_qr, stride_qk,
        u_ptr, argmax_ptr, max_ptr, slots_ptr, num_slots, num_rows, mass_ptr, last_ptr, norm_ptr, plane,
        tokens_ptr, nacc_ptr,
        K: tl.constexpr, VOCAB: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_S: tl.constexpr, NTS: tl.constexpr, NB: tl.constexpr, PRECISE: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        adm, na, emit_row = _first_rejection(r, adm_ptr, slots_ptr, num_slots, num_rows, K, BLOCK_K)
        token = tl.load(argmax_ptr + emit_row)
        if HAS_TEMP:
            sampled_req, temp, m, rejected, q_col, bad = _emit_params(
                r, adm, na, emit_row, temp_ptr, max_ptr, drafts_ptr, stride_dr, K)
            live = tl.where(sampled_req, VOCAB, 0)
            use_q_res = rejected & sampled_req
            base = logits_ptr + emit_row * stride_row
            qbase = q_ptr + r * stride_qr + q_col * stride_qk
            if HAS_Q:
                norm = tl.load(norm_ptr + r)
            else:
                norm = 1.0
            nb = tl.arange(0, NB)
            nmask = nb < NTS
            tiles_e = tl.load(mass_ptr + r * NTS + nb, mask=nmask, other=0.0)
            tiles_r = tl.load(mass_ptr + plane + r * NTS + nb, mask=nmask, other=0.0)
            last_e = tl.max(tl.load(last_ptr + r * NTS + nb, mask=nmask, other=0), 0)
            last_r = tl.max(tl.load(last_ptr + plane + r * NTS + nb, mask=nmask, other=0), 0)
            # From here on the same decisions as the single-program finalize, over smaller tiles.
            use_res = rejected & (tl.sum(tiles_r, 0) > 0)
            tiles = tl.where(use_res, tiles_r, tiles_e)
            last_pos = tl.where(use_res, last_r, last_e)
            target = tl.load(u_ptr + emit_row * 2 + 1).to(tl.float64) * tl.sum(tiles, 0)
            cum = tl.cumsum(tiles, 0)
            tile = tl.min(tl.where(cum > target, nb, NB), 0)
            before = tl.sum(tl.where(nb < tile, tiles, 0.0), 0)
            # Inverse CDF inside that tile (searchsorted(right=True): first running mass above the target),
            # clamped to the last positive weight in case rounding leaves the target above the total.
            offs = tl.arange(0, BLOCK_S)
            idx = tile * BLOCK_S + offs
            mask = (idx < live) & (tile < NTS)
            e, res = _emit_weights(base, qbase, idx, mask, temp, m, norm, bad, use_q_res, HAS_Q, PRECISE)
            w = tl.where(use_res, res, e).to(tl.float64)
            cdf = tl.cumsum(w, 0) + before
            found = tl.min(tl.where((cdf > target) & mask, idx, VOCAB), 0)
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
    # The kernel indexes the per-request vectors with unit stride; callers may hand in column views of a
    # packed batch tensor, so make them dense (a no-op when they already are).
    last_tokens, admitted, start_pos = last_tokens.contiguous(), admitted.contiguous(), start_pos.contiguous()
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


FINALIZE_MODES = ("split", "single")


@dataclass
class SamplerPlan:
    """The sampler's launches bound to their buffers: ``run`` them in order, or time them one by one.

    Every stage is a fixed-shape launch (or memset) that reads only device memory, so a stage, a prefix or
    the whole list can be captured in a CUDA graph; ``tokens`` / ``num_accepted`` are written by the last.
    """

    stages: list[tuple[str, Callable[[], None]]]
    tokens: Tensor
    num_accepted: Tensor

    def run(self) -> tuple[Tensor, Tensor]:
        for _, launch in self.stages:
            launch()
        return self.tokens, self.num_accepted


def plan_rejection_sample(
    logits: Tensor, req_index: Tensor, pos_in_req: Tensor, valid: Tensor, drafts: Tensor, admitted: Tensor,
    temperature: Tensor | None, draft_probs: Tensor | None, uniforms: Tensor | None, *,
    finalize: str = "split", row_block: int | None = None, row_warps: int = 8, row_unroll: int = 1,
    tile_block: int | None = None, tile_subs: int | None = None, tile_warps: int | None = None,
) -> SamplerPlan:
    """Allocate the sampler's buffers and bind its launches (see ``rejection_sample_fused``).

    ``finalize``: "split" (tile-mass kernel over requests x vocabulary chunks, then a per-request final
    kernel) or "single" (one program per request sweeps its emit row). ``row_block`` / ``row_warps`` /
    ``row_unroll`` (1 or 2 tiles loaded per step): the row kernel's shape; ``tile_block`` / ``tile_subs`` /
    ``tile_warps``: tokens per inverse-CDF tile, tiles per tile-mass program and its warps. The knobs exist
    for benchmarks and tests (small tiles exercise many of them on a small vocabulary); None picks the
    defaults. ``row_unroll`` leaves every lane's operations unchanged; other block sizes regroup the row
    kernel's float32 sums (``p(x)`` may round differently) and the float64 tile masses.
    """
    if finalize not in FINALIZE_MODES:
        raise ValueError(f"finalize must be one of {FINALIZE_MODES}, got {finalize!r}")
    if row_unroll not in (1, 2):
        raise ValueError(f"row_unroll must be 1 or 2, got {row_unroll}")
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
    # Row 0: accept bits per slot; row 1: which logits row holds the slot. Zeroed by the first stage:
    # unwritten = rejected.
    slots = torch.empty(2, num_slots, dtype=torch.int64, device=device)
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
    precise = not _interpreting()
    block_k = _pow2(num_spec + 1)
    rows_ok = max(num_rows, 1)
    block = row_block or min(4096, _pow2(vocab))
    pairs = (vocab // block) // 2 if row_unroll == 2 else 0
    stages: list[tuple[str, Callable[[], None]]] = [("memset", slots.zero_)]

    def row() -> None:
        _row_kernel[(num_rows,)](
            logits, logits.stride(0), req_c, pos_c, valid_u8,
            drafts, drafts.stride(0), admitted, temp, q, sq_r, sq_k, u, num_reqs,
            argmax, row_max, slots, num_slots,
            K=num_spec, VOCAB=vocab, HAS_TEMP=has_temp, HAS_Q=has_q, BLOCK=block, NEG=_NEG, PAIRS=pairs,
            num_warps=row_warps,
        )

    if num_rows > 0:
        stages.append(("row", row))
    if finalize == "single":
        fblock = min(4096, _pow2(vocab))

        def single() -> None:
            _finalize_kernel[(num_reqs,)](
                logits, logits.stride(0), drafts, drafts.stride(0), admitted, temp, q, sq_r, sq_k,
                u, argmax, row_max, slots, num_slots, rows_ok, tokens, num_accepted,
                K=num_spec, VOCAB=vocab, HAS_TEMP=has_temp, HAS_Q=has_q, BLOCK=fblock, BLOCK_K=block_k,
                NT=-(-vocab // fblock), NB=_pow2(-(-vocab // fblock)), PRECISE=precise, num_warps=8,
            )

        stages.append(("finalize", single))
        return SamplerPlan(stages, tokens, num_accepted)

    # Split finalize. Tiles of 1024 keep the final kernel's single-tile float64 scan short; chunks of 4
    # tiles give the tile-mass programs a 4096-token read each (fewer, longer-lived programs).
    tblock = tile_block or min(1024, _pow2(vocab))
    subs = tile_subs or min(4, _pow2(-(-vocab // tblock)))
    chunks = -(-vocab // (tblock * subs))
    nts = chunks * subs  # tiles per request, a multiple of subs: the last ones may be past the vocabulary
    nb = _pow2(nts)
    if has_temp:
        mass = torch.empty(2, num_reqs, nts, dtype=torch.float64, device=device)
        last = torch.empty(2, num_reqs, nts, dtype=torch.int32, device=device)
        norm = torch.empty(num_reqs, dtype=torch.float32, device=device)
    else:  # greedy: the final kernel reads none of these
        mass, last, norm = row_max, row_max, row_max
    plane = num_reqs * nts
    tile_warps = tile_warps or max(1, min(8, tblock * subs // 512))

    def tile_pass(e_only: bool) -> Callable[[], None]:
        def launch() -> None:
            _tile_mass_kernel[(num_reqs, chunks)](
                logits, logits.stride(0), drafts, drafts.stride(0), admitted, temp, q, sq_r, sq_k,
                row_max, slots, num_slots, rows_ok, mass, last, norm, plane,
                K=num_spec, VOCAB=vocab, HAS_Q=has_q, E_ONLY=e_only, BLOCK_K=block_k,
                BLOCK_S=tblock, SUBS=subs, NTS=nts, NB=nb, PRECISE=precise, num_warps=tile_warps,
            )

        return launch

    if has_q:
        stages.append(("tile_e", tile_pass(True)))
    if has_temp:
        stages.append(("tile_mass", tile_pass(False)))

    def final() -> None:
        _final_kernel[(num_reqs,)](
            logits, logits.stride(0), drafts, drafts.stride(0), admitted, temp, q, sq_r, sq_k,
            u, argmax, row_max, slots, num_slots, rows_ok, mass, last, norm, plane, tokens, num_accepted,
            K=num_spec, VOCAB=vocab, HAS_TEMP=has_temp, HAS_Q=has_q, BLOCK_K=block_k,
            BLOCK_S=tblock, NTS=nts, NB=nb, PRECISE=precise, num_warps=max(1, min(8, tblock // 256)),
        )

    stages.append(("final", final))
    return SamplerPlan(stages, tokens, num_accepted)


def rejection_sample_fused(
    logits: Tensor, req_index: Tensor, pos_in_req: Tensor, valid: Tensor, drafts: Tensor, admitted: Tensor,
    temperature: Tensor | None, draft_probs: Tensor | None, uniforms: Tensor | None, *,
    finalize: str = "split", **knobs: int | None,
) -> tuple[Tensor, Tensor]:
    """Same contract as ``rejection.rejection_sample`` without top-p: returns (tokens[R, K+1], num_accepted[R]).

    ``finalize`` / ``knobs``: see ``plan_rejection_sample`` (defaults are what the sampler uses).
    """
    return plan_rejection_sample(logits, req_index, pos_in_req, valid, drafts, admitted, temperature,
                                 draft_probs, uniforms, finalize=finalize, **knobs).run()
