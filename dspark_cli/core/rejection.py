"""Lossless rejection sampling over ragged drafts (greedy and probabilistic), free of host syncs.

The verify batch is ragged: request ``r`` has ``admitted[r] <= K`` drafts verified this step (the
capacity manager pruned the rest), laid out either compacted (varlen) or uniform with padding (mask).
The sampler therefore works row by row on the ``[T, V]`` logits it was given and only then scatters a few
per-row scalars into the small ``[R, K + 1]`` matrix where the first rejection of every request is found:

1. **Row pass** (the only full read of the logits): per row, the target argmax and, for probabilistic
   requests, ``p(x)`` of the row's draft ``x`` under the *sampling* distribution (temperature, top-p --
   exactly what non-speculative decoding samples from). A draft is accepted with probability
   ``min(1, p(x) / q(x))`` (``u * q(x) < p(x)``), greedy drafts iff they equal the argmax.
2. **First rejection**: scatter the accept bits into ``[R, K + 1]``; pruned or missing slots are
   "rejected", so ``cumprod`` along the request yields ``num_accepted`` without any data-dependent shape.
3. **Emit pass** on ``R`` gathered rows only: the row at ``num_accepted`` emits the correction token
   (residual ``norm(max(p - q, 0))``) if it verified a rejected draft, or the bonus token (``p``) if
   every admitted draft was accepted. Sampling is an inverse CDF with one uniform per row, so no
   ``[T, V]`` noise is generated.

Exactly one bonus/correction token is emitted per request, so ``num_emitted = num_accepted + 1``.
With ``draft_probs=None`` the draft distribution is taken as one-hot on the draft token: accept with
probability ``p(x)``, resample from ``p`` with ``x`` removed. That is lossless for any draft, whatever
distribution it came from.

Everything is fixed-shape tensor code (no ``.item()``, boolean indexing or data-dependent shapes), so a
CUDA graph replays it for any admitted counts. Whether every request is greedy, and whether top-p is used
at all, are host-known sampling parameters (like vLLM's ``all_greedy``): ``temperature=None`` selects the
argmax-only program. On CUDA with Triton (and no top-p) the whole sampler runs as a few launches
(``_triton_rejection``: the row kernel, per-tile emit masses, a per-request final kernel),
because a chain of ~50 tiny torch ops would cost more than reading the logits; the torch code below is
the reference, the CPU path and the top-p path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from dspark_cli.core.layout import VerifyLayout

__all__ = [
    "RejectionOutput",
    "apply_sampling_params",
    "inverse_cdf_sample",
    "rejection_sample",
    "sample",
    "warm_up_rejection_sample",
]


@dataclass
class RejectionOutput:
    tokens: Tensor  # [R, K + 1] int64: accepted drafts, then the bonus/correction token, then -1
    num_accepted: Tensor  # [R] int64: accepted drafts (0..admitted[r])
    num_emitted: Tensor  # [R] int64: num_accepted + 1


RowMap = VerifyLayout | tuple[Tensor, Tensor, Tensor]

# Temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS). The engines map them to 0 where a request
# enters: the samplers divide logits by the temperature, and below ~1e-37 a logit of 30 over it overflows
# float32, so the softmax turns NaN and the lowest-index token comes out instead of the argmax.
SAMPLING_EPS = 1e-5


def apply_sampling_params(logits: Tensor, temperature: Tensor | None, top_p: Tensor | None) -> Tensor:
    """[N, V] float32 scores whose softmax is the distribution a request samples from.

    ``temperature[N]`` <= 0 marks greedy rows; they get temperature 1 here (callers take the argmax for
    them). A positive temperature must be at least ``SAMPLING_EPS`` (the engines make smaller ones 0).
    ``top_p[N]`` keeps the smallest set of tokens whose mass reaches ``top_p`` (at least one).
    Both the speculative and the non-speculative samplers must use this function: losslessness is
    defined against exactly this distribution.
    """
    z = logits.to(torch.float32, copy=True)
    if temperature is not None:
        t = torch.where(temperature > 0, temperature.to(torch.float32), 1.0)
        z.div_(t.unsqueeze(1))
    if top_p is not None:
        z = _apply_top_p(z, top_p.to(torch.float32))
    return z


def _apply_top_p(z: Tensor, top_p: Tensor) -> Tensor:
    # Same rule as vLLM's apply_top_p: ascending sort, drop the prefix whose mass is <= 1 - top_p, and
    # always keep the largest token. A full sort is needed; only used when some request sets top_p.
    sorted_z, order = z.sort(dim=-1, descending=False)
    cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1.0 - top_p).unsqueeze(1)
    drop_sorted[:, -1] = False
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    drop &= (top_p < 1.0).unsqueeze(1)
    return z.masked_fill(drop, float("-inf"))


def inverse_cdf_sample(weights: Tensor, u: Tensor) -> Tensor:
    """Sample one index per row from unnormalised non-negative ``weights[N, V]`` with ``u[N]`` in [0, 1).

    ``searchsorted(right=True)`` skips zero-weight tokens; the clamp to the last positive token guards
    against ``u * total`` rounding up to ``total``. A row of all zeros returns 0. The CDF is accumulated in
    float64: over a large vocabulary a float32 running sum drifts by more than a typical token's mass, so
    the sampled token would depend on the summation order (the fused kernel and this reference differ).
    """
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    target = u.to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    cols = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, cols, 0).amax(dim=-1)
    return torch.minimum(idx, last_positive)


def sample(
    logits: Tensor, temperature: Tensor | None, top_p: Tensor | None = None, u: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Non-speculative sampling from the same distribution the rejection sampler targets: [N] int64."""
    argmax = logits.argmax(dim=-1)
    if temperature is None:
        return argmax
    if u is None:
        u = torch.rand(logits.shape[0], device=logits.device, generator=generator)
    probs = apply_sampling_params(logits, temperature, top_p).softmax(dim=-1)
    return torch.where(temperature > 0, inverse_cdf_sample(probs, u), argmax)


def _row_map(rows: RowMap) -> tuple[Tensor, Tensor, Tensor]:
    if isinstance(rows, VerifyLayout):
        return rows.req_index, rows.pos_in_req, ~rows.is_padding
    req_index, pos_in_req, valid = rows
    return req_index, pos_in_req, valid


def _use_triton(logits: Tensor, top_p: Tensor | None, use_triton: bool | None) -> bool:
    if use_triton is False or top_p is not None:
        return False
    from dspark_cli.core import _triton_rejection

    if use_triton is None:
        return _triton_rejection.available(logits.device)
    if not _triton_rejection.supported(logits.device):
        raise RuntimeError("use_triton=True needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    return True


def rejection_sample(
    logits: Tensor,
    rows: RowMap,
    drafts: Tensor,
    admitted: Tensor,
    temperature: Tensor | None = None,
    top_p: Tensor | None = None,
    draft_probs: Tensor | None = None,
    uniforms: Tensor | None = None,
    generator: torch.Generator | None = None,
    use_triton: bool | None = None,
) -> RejectionOutput:
    """Verify ragged drafts against target ``logits[T, V]``; see the module docstring for the algorithm.

    ``rows``: a :class:`VerifyLayout`, or ``(req_index[T], pos_in_req[T], valid[T])``: row ``t`` holds the
    target logits at draft slot ``pos_in_req[t]`` of request ``req_index[t]`` (slot ``j`` verifies draft
    ``j + 1``; slot ``admitted[r]`` is the bonus row). Every slot ``0..admitted[r]`` must appear once.
    ``drafts[R, K]``: token ids in every slot, those past ``admitted[r]`` included: they are never verified,
    but the fused kernels read the slot at ``admitted[r]`` as the bonus row's draft (the torch path reads a
    placeholder such as -1 there as token 0).
    ``temperature[R]``: None = all greedy (host-known); values <= 0 mark greedy requests.
    ``top_p[R]``: optional nucleus. ``draft_probs[R, K, V]``: the distribution each draft was sampled
    from (None = one-hot on the draft). ``uniforms[T, 2]`` in [0, 1): column 0 decides acceptance at the
    row, column 1 samples the correction/bonus token when the row emits; default ``torch.rand`` with
    ``generator`` (under CUDA-graph capture a non-default generator must be registered with the graph).
    ``use_triton``: None = fused kernels when available (CUDA, no top-p), False = torch only.
    """
    num_reqs, num_spec = drafts.shape
    num_rows, vocab = logits.shape
    if num_spec < 1:
        raise ValueError("rejection_sample needs K >= 1 draft slots")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_reqs, num_spec, vocab):
        raise ValueError(f"draft_probs must be [R, K, V]={num_reqs, num_spec, vocab}, got {tuple(draft_probs.shape)}")
    device = logits.device
    width = num_spec + 1
    req_index, pos_in_req, valid = _row_map(rows)
    greedy_only = temperature is None
    if not greedy_only and uniforms is None:
        uniforms = torch.rand(num_rows, 2, device=device, generator=generator)
    if _use_triton(logits, top_p, use_triton):
        from dspark_cli.core import _triton_rejection

        tokens, num_accepted = _triton_rejection.rejection_sample_fused(
            logits, req_index, pos_in_req, valid, drafts, admitted, temperature, draft_probs, uniforms)
        return RejectionOutput(tokens=tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)

    req_raw = req_index.to(torch.int64)
    pos = pos_in_req.to(torch.int64)
    adm = admitted.to(torch.int64).clamp(0, num_spec)
    req = req_raw.clamp(0, num_reqs - 1)
    in_range = (req_raw >= 0) & (req_raw < num_reqs) & (pos >= 0) & (pos <= adm[req])
    valid = valid.to(torch.bool) & in_range
    pos_c = pos.clamp(0, num_spec)
    # a placeholder id (-1) in a slot no row verifies is still a gather index below: read as token 0
    drafts_ext = torch.cat([drafts.to(torch.int64).clamp_min(0), torch.zeros_like(drafts[:, :1], dtype=torch.int64)],
                           dim=1)
    row_draft = drafts_ext[req, pos_c]
    has_draft = valid & (pos < adm[req])
    row_temp = None if greedy_only else temperature.to(torch.float32)[req]
    row_top_p = None if top_p is None else top_p.to(torch.float32)[req]
    argmax, p_x = _row_pass_torch(logits, row_draft, row_temp, row_top_p)
    if greedy_only:
        accept = has_draft & (row_draft == argmax)
    else:
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        else:
            q_x = draft_probs[req, pos.clamp(0, num_spec - 1), row_draft].to(torch.float32)
        prob_accept = uniforms[:, 0].to(torch.float32) * q_x < p_x
        accept = has_draft & torch.where(row_temp <= 0, row_draft == argmax, prob_accept)

    # Scatter per-row results into the [R, K + 1] slot matrix; invalid rows go to a dump slot at the end.
    dump = num_reqs * width
    slot = torch.where(valid, req * width + pos_c, dump)
    rows_idx = torch.arange(num_rows, device=device, dtype=torch.int64)
    acc_slots = torch.zeros(dump + 1, dtype=torch.int64, device=device).scatter_(0, slot, accept.to(torch.int64))
    row_of_slot = torch.zeros(dump + 1, dtype=torch.int64, device=device).scatter_(0, slot, rows_idx)
    acc = acc_slots[:dump].view(num_reqs, width)[:, :num_spec]
    num_accepted = torch.cumprod(acc, dim=1).sum(dim=1)
    req_ar = torch.arange(num_reqs, device=device, dtype=torch.int64)
    emit_row = row_of_slot[req_ar * width + num_accepted]

    emitted = argmax[emit_row]
    if not greedy_only:
        rejected = num_accepted < adm
        bad_draft = drafts_ext[req_ar, num_accepted]
        sampled = _emit_pass_torch(logits, emit_row, temperature, top_p, rejected, bad_draft, num_accepted,
                                   draft_probs, uniforms[emit_row, 1])
        emitted = torch.where(temperature <= 0, emitted, sampled)

    cols = torch.arange(width, device=device, dtype=torch.int64).unsqueeze(0)
    na = num_accepted.unsqueeze(1)
    tokens = torch.where(cols < na, drafts_ext, torch.where(cols == na, emitted.unsqueeze(1), -1))
    return RejectionOutput(tokens=tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)


def _row_pass_torch(
    logits: Tensor, row_draft: Tensor, row_temp: Tensor | None, row_top_p: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Per row: target argmax and p(draft) under the sampling distribution (None when all greedy)."""
    row_max, argmax = logits.max(dim=-1)
    if row_temp is None:
        return argmax, None
    if row_top_p is None:
        # Subtract the row max before scaling so exp never overflows; the max scaled by 1/t is the max of z.
        z = logits.to(torch.float32, copy=True).sub_(row_max.to(torch.float32).unsqueeze(1))
        z.div_(torch.where(row_temp > 0, row_temp, 1.0).unsqueeze(1))
    else:
        z = apply_sampling_params(logits, row_temp, row_top_p)
    lse = torch.logsumexp(z, dim=-1)
    p_x = torch.exp(z.gather(1, row_draft.unsqueeze(1)).squeeze(1) - lse)
    return argmax, p_x


def _emit_pass_torch(
    logits: Tensor, emit_row: Tensor, temperature: Tensor, top_p: Tensor | None, rejected: Tensor,
    bad_draft: Tensor, num_accepted: Tensor, draft_probs: Tensor | None, u_emit: Tensor,
) -> Tensor:
    """Sample each request's correction (residual) or bonus (target) token from its emit row: [R].

    The arithmetic is spelled out (not ``softmax``) so the fused kernel can repeat it operation for
    operation: ``e = exp(z - max z)`` is p up to its normaliser; the bonus and the one-hot residual (p with
    the rejected draft removed) sample from ``e`` directly, and only a real ``q`` needs ``p = e / sum(e)``,
    with the sum taken in float64 so its float32 rounding does not depend on the summation order.
    """
    z = apply_sampling_params(logits[emit_row], temperature, top_p)
    e = torch.exp(z - z.amax(dim=-1, keepdim=True))
    if draft_probs is None:
        residual = e.scatter(1, bad_draft.unsqueeze(1), 0.0)
    else:
        num_spec = draft_probs.shape[1]
        req_ar = torch.arange(e.shape[0], device=e.device)
        q = draft_probs[req_ar, num_accepted.clamp(max=num_spec - 1)].to(torch.float32)
        probs = e / e.sum(dim=-1, keepdim=True, dtype=torch.float64).to(torch.float32)
        residual = (probs - q).clamp_min_(0.0)
    # p == q makes the residual empty, but then every draft is accepted; fall back to p for rounding.
    use_residual = rejected & (residual.sum(dim=-1, dtype=torch.float64) > 0)
    weights = torch.where(use_residual.unsqueeze(1), residual, e)
    return inverse_cdf_sample(weights, u_emit)


def warm_up_rejection_sample(
    num_spec: int, vocab_size: int, row_counts: Iterable[int], max_reqs: int, device: torch.device | str,
    admitted_dtype: torch.dtype = torch.int32, sampling: bool = True,
) -> int:
    """Compile the fused sampler now for every verify-batch row count ``row_counts`` (the sizes the engine
    pads verify batches to), greedy and -- ``sampling`` -- with temperatures and draft distributions (what a
    draft model's sampling batch passes).

    The kernels take request and row counts as runtime values, but their tile split, combine width and
    pipelining follow the row count, and a kernel is compiled per argument dtype. A compile costs tens of
    milliseconds to a second, which the first drafting step at each new shape would otherwise pay inside
    serving (a GPU test checks that nothing compiles after this). ``admitted_dtype``: what the engine passes
    as admitted counts (the capacity manager's allocation is int32; verify-all engines pass int64). Returns
    how many plans were compiled (0 where the torch path runs: CPU, no Triton).
    """
    device = torch.device(device)
    probe = torch.empty(1, vocab_size, device=device)
    if not _use_triton(probe, None, None):
        return 0
    from dspark_cli.core import _triton_rejection

    width = num_spec + 1
    compiled = 0
    for rows in sorted(set(row_counts)):
        reqs = min(max_reqs, max(1, rows // width))
        logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
        index = torch.zeros(rows, dtype=torch.int64, device=device)
        valid = torch.ones(rows, dtype=torch.bool, device=device)
        drafts = torch.zeros(reqs, num_spec, dtype=torch.int64, device=device)
        admitted = torch.zeros(reqs, dtype=admitted_dtype, device=device)
        modes: list[tuple[Tensor | None, Tensor | None, Tensor | None]] = [(None, None, None)]
        if sampling:
            temperature = torch.ones(reqs, dtype=torch.float32, device=device)
            probs = torch.empty(reqs, num_spec, vocab_size, dtype=torch.float32, device=device)
            uniforms = torch.empty(rows, 2, dtype=torch.float32, device=device)
            modes.append((temperature, probs, uniforms))
        for temperature, draft_probs, uniforms in modes:
            _triton_rejection.plan_rejection_sample(
                logits, index, index, valid, drafts, admitted, temperature, draft_probs, uniforms).precompile()
            compiled += 1
        del logits
    return compiled
