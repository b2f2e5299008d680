"""Single-launch Triton kernel for ``capacity.allocate`` (the device top-``budget`` over draft slots).

Why a kernel: the torch reference is a full sort plus ~20 tiny ops; inside a CUDA graph each op is still a
node costing a microsecond or more, so allocation alone cost ~60 µs at R=256, K=7 -- more than the
sampler's floor. Here one program holds every slot of the batch in registers (``R * K`` up to a few
thousand) and replaces the sort by a selection:

1. survival is reinterpreted as its int32 bit pattern: for positive floats the patterns order exactly like
   the values, so comparisons never meet float flush-to-zero modes or NaN rules (NaN becomes 0 as in the
   torch path, negatives and zeros are invalid);
2. ``cummin`` along each request (integer min = float min on that domain) keeps the admitted set a prefix;
3. the ``budget``-th largest key is built bit by bit (31 rounds of "how many keys are >= candidate"), so
   the threshold is exact, whatever the values;
4. every key above the threshold is admitted, and ties at the threshold are admitted in (position,
   request) order through an exclusive prefix count in position-major order -- the same value-independent
   tie-break as the stable sort of the torch path.

The result equals ``capacity._allocate_torch`` bit for bit (tests check it under ``TRITON_INTERPRET=1``).
No launch shape depends on tensor values and the budget may live in a 0-d device tensor, so the launch is
CUDA-graph capturable and free of host syncs.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the torch path is the reference and the CPU path
    triton = None
    tl = None

# One program holds the padded [pow2(R), pow2(K)] tile in registers; beyond this the torch sort is used.
MAX_TILE = 8192


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def fits(num_reqs: int, num_spec: int) -> bool:
    """Whether one program can hold the batch (otherwise callers fall back to the torch sort)."""
    return num_reqs >= 1 and num_spec >= 1 and _pow2(num_reqs) * _pow2(num_spec) <= MAX_TILE


if triton is not None:

    @triton.jit
    def _min_combine(a, b):
        return tl.minimum(a, b)

    # One compiled variant per (BLOCK_R, K), not one more per request count's divisibility: the batch size
    # changes every step, and a compile inside serving is a latency spike (vLLM logs it as one).
    @triton.jit(do_not_specialize=["num_reqs", "budget_val"])
    def _allocate_kernel(
        surv_ptr, stride_r, nd_ptr, budget_ptr, budget_val, out_ptr, num_reqs,
        K: tl.constexpr, BUDGET_IS_PTR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        r = tl.arange(0, BLOCK_R)
        j = tl.arange(0, BLOCK_K)
        rmask = r < num_reqs
        inside = rmask[:, None] & (j[None, :] < K)
        x = tl.load(surv_ptr + r[:, None].to(tl.int64) * stride_r + j[None, :], mask=inside, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        # NaN (either sign) -> 0 like the torch path; padding lanes are 0 too. Negative floats (and -0.0)
        # have negative patterns, so they stay invalid and keep the rest of their row invalid after cummin.
        bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0, bits)
        bits = tl.associative_scan(bits, 1, _min_combine)
        nd = tl.load(nd_ptr + r, mask=rmask, other=0).to(tl.int32)
        valid = inside & (j[None, :] < nd[:, None]) & (bits > 0)
        key = tl.where(valid, bits, 0)  # valid keys are >= 1, invalid ones exactly 0
        if BUDGET_IS_PTR:
            budget = tl.load(budget_ptr).to(tl.int64)
        else:
            budget = tl.sum(tl.zeros([BLOCK_R], tl.int64), 0) + budget_val
        budget = tl.minimum(tl.maximum(budget, -1), BLOCK_R * BLOCK_K).to(tl.int32)
        # Largest threshold with count(key >= threshold) >= budget, built from the top bit down: the
        # budget-th largest key when 1 <= budget <= #valid; 0 when the budget covers every valid slot;
        # 0x7FFFFFFF (a NaN pattern no key has) when the budget is <= 0.
        thr = tl.sum(tl.zeros([BLOCK_R], tl.int32), 0)
        for b in tl.static_range(30, -1, -1):
            cand = thr | (1 << b)
            cnt = tl.sum(tl.sum((key >= cand).to(tl.int32), 1), 0)
            thr = tl.where(cnt >= budget, cand, thr)
        above = key > thr
        need = budget - tl.sum(tl.sum(above.to(tl.int32), 1), 0)
        tie = (key == thr) & valid
        tie_i = tie.to(tl.int32)
        # Exclusive rank of each tie in position-major order (index j * R + r): ties in earlier positions,
        # then ties at the same position in lower requests.
        col = tl.sum(tie_i, 0)
        before_col = tl.cumsum(col, 0) - col
        before_row = tl.cumsum(tie_i, 0) - tie_i
        rank = before_col[None, :] + before_row
        admit = valid & (above | (tie & (rank < need)))
        tl.store(out_ptr + r, tl.sum(admit.to(tl.int32), 1), mask=rmask)


def allocate_fused(survival: Tensor, num_drafts: Tensor, budget: Tensor | int) -> Tensor:
    """Same contract and result as ``capacity.allocate``; the caller checks :func:`fits` first."""
    num_reqs, num_spec = survival.shape
    device = survival.device
    surv = survival if survival.dtype == torch.float32 else survival.float()
    if surv.stride(1) != 1:
        surv = surv.contiguous()
    nd = num_drafts.to(device)
    if nd.stride(0) != 1:
        nd = nd.contiguous()
    out = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if isinstance(budget, Tensor):
        budget_t = budget.to(device).reshape(())
        budget_ptr, budget_val, is_ptr = budget_t, 0, True
    else:
        budget_ptr, budget_val, is_ptr = out, max(-1, min(int(budget), num_reqs * num_spec)), False
    _allocate_kernel[(1,)](
        surv, surv.stride(0), nd, budget_ptr, budget_val, out, num_reqs,
        K=num_spec, BUDGET_IS_PTR=is_ptr, BLOCK_R=_pow2(num_reqs), BLOCK_K=_pow2(num_spec),
        num_warps=4 if _pow2(num_reqs) * _pow2(num_spec) <= 1024 else 8,
    )
    return out
