"""Verify-batch layouts built on the device from the allocator's per-request admitted draft counts.

A verification step feeds, for every request ``r``, its last sampled (bonus) token followed by the drafts
the capacity manager admitted for it. Row ``j`` of a request carries the token at position
``start_pos[r] + j`` and its logits verify draft ``j + 1``; the row ``j == admitted[r]`` yields the
bonus token. Two layouts exist because attention backends differ in what they can replay:

* **varlen** physically compacts the batch: request ``r`` owns ``1 + admitted[r]`` consecutive rows and
  the tail up to a captured CUDA-graph size is padding. The attention backend must accept device-side
  ``query_start_loc`` that differs from the host's upper bound (vLLM's
  ``supports_device_cpu_query_lens_mismatch``).
* **mask** keeps the uniform ``[R, K + 1]`` batch any backend can replay and flags pruned rows as padding;
  it saves only the non-attention compute (MoE/MLP skip padding rows) but needs no backend support.

Both builders are pure tensor programs of fixed shape: no ``.item()``, no boolean indexing, no
data-dependent shapes. The allocator's output never travels to the host, so one captured graph replays
any mix of admitted counts; the host only chooses ``padded_tokens`` from the budget it already knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "PlainLayouts",
    "VerifyLayout",
    "build_mask_layout",
    "build_varlen_layout",
    "pick_padded_tokens",
    "warm_up_varlen_layout",
]


@dataclass
class VerifyLayout:
    """Device tensors describing one verify batch; shapes depend only on ``(R, K, num_rows)``.

    Padding rows (``is_padding``) have ``input_ids == 0`` and are never verified. Their ``req_index``:

    * varlen: the tail rows after the last request get ``req_index == R`` (one past the last request).
      An engine routes them to a scratch KV slot by giving its per-request tables (block table, slot
      mapping) one extra row ``R`` that points at a dummy block; they have ``positions == 0`` and
      ``pos_in_req == 0`` and fall outside every ``query_start_loc`` segment.
    * mask: pruned rows stay inside their own request's uniform segment (attention still computes them
      against that request's KV), so ``req_index`` is the owning request and ``positions`` are the
      positions they would have had. Their KV writes land beyond the request's accepted prefix and are
      overwritten by later steps, exactly like the KV of rejected drafts.
    """

    input_ids: Tensor  # [T] int64: the token fed on each row
    positions: Tensor  # [T] int64: absolute position of that token
    req_index: Tensor  # [T] int64: owning request (see padding rules above)
    pos_in_req: Tensor  # [T] int64: 0 = the last token's row (verifies draft 1), j verifies draft j + 1
    is_padding: Tensor  # [T] bool: row carries no token to verify (tail padding or pruned slot)
    query_start_loc: Tensor  # [R + 1] int32: request r's rows are [qsl[r], qsl[r + 1])
    seq_lens: Tensor  # [R] int32: KV length after this step's writes
    num_tokens: Tensor  # [] int64: number of non-padding rows (R + sum(admitted))
    num_logits_per_req: Tensor  # [R] int32: 1 + admitted, rows per request that are verified
    invalid_drafts: Tensor | None  # [R, K] bool (mask layout): drafts pruned by the allocator
    num_reqs: int  # R (host, static)
    num_spec: int  # K (host, static)

    @property
    def num_rows(self) -> int:
        """T: the padded row count the graph was captured for (host, static)."""
        return int(self.input_ids.shape[0])

    @property
    def valid(self) -> Tensor:
        """[T] bool: rows whose logits the rejection sampler reads."""
        return ~self.is_padding


class PlainLayouts:
    """Layouts of steps that verify no draft (no speculation, or drafting paused): one row per request.

    Such a layout is the varlen one with every admitted count 0, and all of it but the tokens and positions
    depends on ``R`` alone: request ``r`` owns row ``r``. So those tensors are built once per ``R`` and kept,
    and a step's layout is two views of what the host already copied (``last_tokens``, ``start_pos``) and one
    small add, where the varlen builder launched a kernel. No padding rows: a graphed forward pads its own
    static buffers up to the captured size (zero tokens, a scratch request), as the varlen tail would have been.
    Why bother: on an H100 (SmolLM2-135M, 16 requests, docs/PERFORMANCE.md section 46) the layout took 0.23 ms
    of host time in a 3.5 ms plain step, while the device had nothing queued; built so, 0.04 ms (section 47).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._fixed: dict[int, tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]] = {}

    def _constants(self, num_reqs: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        fixed = self._fixed.get(num_reqs)
        if fixed is None:
            i64 = dict(dtype=torch.int64, device=self.device)
            fixed = (
                torch.arange(num_reqs, **i64),  # req_index
                torch.zeros(num_reqs, **i64),  # pos_in_req
                torch.zeros(num_reqs, dtype=torch.bool, device=self.device),  # is_padding
                torch.arange(num_reqs + 1, dtype=torch.int32, device=self.device),  # query_start_loc
                torch.tensor(num_reqs, **i64),  # num_tokens
                torch.ones(num_reqs, dtype=torch.int32, device=self.device),  # num_logits_per_req
            )
            self._fixed[num_reqs] = fixed
        return fixed

    def build(self, last_tokens: Tensor, start_pos: Tensor) -> VerifyLayout:
        """The layout of one token per request: ``last_tokens[r]`` at position ``start_pos[r]`` (both ``[R]``
        int64 on this device)."""
        num_reqs = int(last_tokens.shape[0])
        if num_reqs < 1 or tuple(start_pos.shape) != (num_reqs,) or last_tokens.dim() != 1:
            raise ValueError(f"last_tokens and start_pos must both be [R] with R >= 1, got shapes "
                             f"{tuple(last_tokens.shape)} and {tuple(start_pos.shape)}")
        req_index, pos_in_req, is_padding, qsl, num_tokens, num_logits = self._constants(num_reqs)
        return VerifyLayout(
            input_ids=last_tokens, positions=start_pos, req_index=req_index, pos_in_req=pos_in_req,
            is_padding=is_padding, query_start_loc=qsl, seq_lens=(start_pos + 1).to(torch.int32),
            num_tokens=num_tokens, num_logits_per_req=num_logits, invalid_drafts=None, num_reqs=num_reqs,
            num_spec=0,
        )


def pick_padded_tokens(needed_tokens: int, capture_sizes: Sequence[int]) -> int:
    """Smallest captured size >= ``needed_tokens`` (host side), else ``needed_tokens`` itself (eager run).

    ``needed_tokens`` is what the host knows without a sync: ``R + budget``. The varlen builder is exact
    for any admitted counts whose sum is <= budget, which the allocator guarantees.
    """
    if needed_tokens < 0:
        raise ValueError(f"needed_tokens must be >= 0, got {needed_tokens}")
    fitting = [s for s in capture_sizes if s >= needed_tokens]
    return min(fitting) if fitting else needed_tokens


def _check_inputs(last_tokens: Tensor, drafts: Tensor, admitted: Tensor, start_pos: Tensor) -> tuple[int, int]:
    # Shape checks only: they read metadata, never tensor values, so they are free under capture.
    if drafts.dim() != 2:
        raise ValueError(f"drafts must be [R, K], got shape {tuple(drafts.shape)}")
    num_reqs, num_spec = drafts.shape
    for name, t in (("last_tokens", last_tokens), ("admitted", admitted), ("start_pos", start_pos)):
        if tuple(t.shape) != (num_reqs,):
            raise ValueError(f"{name} must be [R]={num_reqs}, got shape {tuple(t.shape)}")
    if num_reqs < 1:
        raise ValueError("a verify layout needs at least one request")
    return num_reqs, num_spec


def _use_triton(device: torch.device, use_triton: bool | None) -> bool:
    if use_triton is False:
        return False
    from dspark_cli.core import _triton_rejection

    if use_triton is None:
        return _triton_rejection.available(device)
    if not _triton_rejection.supported(device):
        raise RuntimeError("use_triton=True needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    return True


def _token_table(last_tokens: Tensor, drafts: Tensor) -> Tensor:
    """[R, K + 1] int64: what each request would feed if every draft were admitted."""
    return torch.cat([last_tokens.to(torch.int64).unsqueeze(1), drafts.to(torch.int64)], dim=1)


def build_varlen_layout(
    last_tokens: Tensor, drafts: Tensor, admitted: Tensor, start_pos: Tensor, padded_tokens: int,
    use_triton: bool | None = None,
) -> VerifyLayout:
    """Compacted layout: request r owns rows ``[qsl[r], qsl[r] + 1 + admitted[r])``; the tail is padding.

    ``padded_tokens`` must be >= ``R + sum(admitted)`` (pass ``pick_padded_tokens(R + budget, ...)``);
    a smaller value silently truncates the last requests because the check would need a host sync.
    Row -> request is a ``searchsorted`` of the row index into the cumulative counts, so every op has a
    fixed output shape and the whole builder is CUDA-graph capturable. On CUDA with Triton
    (``use_triton=None``) the same tensors come from one fused launch instead of ~25 small ops, which
    matters because the layout sits on every step's critical path.
    """
    num_reqs, num_spec = _check_inputs(last_tokens, drafts, admitted, start_pos)
    if padded_tokens < num_reqs:
        raise ValueError(f"padded_tokens={padded_tokens} < R={num_reqs}: every request verifies >= 1 row")
    if _use_triton(drafts.device, use_triton):
        from dspark_cli.core import _triton_rejection

        ids, positions, req_index, pos_in_req, is_padding, qsl, seq_lens, nlog, ntok = (
            _triton_rejection.build_varlen_layout_fused(last_tokens, drafts, admitted, start_pos, padded_tokens))
        return VerifyLayout(
            input_ids=ids, positions=positions, req_index=req_index, pos_in_req=pos_in_req,
            is_padding=is_padding, query_start_loc=qsl, seq_lens=seq_lens, num_tokens=ntok,
            num_logits_per_req=nlog, invalid_drafts=None, num_reqs=num_reqs, num_spec=num_spec,
        )
    device = drafts.device
    adm = admitted.to(torch.int64).clamp(0, num_spec)
    counts = adm + 1
    ends = torch.cumsum(counts, dim=0)  # [R] exclusive end of each request's rows
    starts = ends - counts
    rows = torch.arange(padded_tokens, device=device, dtype=torch.int64)
    # right=True: row t belongs to the first request whose end is > t; rows past the last end get R.
    req_index = torch.searchsorted(ends, rows, right=True)
    is_padding = req_index >= num_reqs
    req_c = req_index.clamp(max=num_reqs - 1)
    pos_in_req = torch.where(is_padding, 0, rows - starts[req_c])
    table = _token_table(last_tokens, drafts)
    input_ids = torch.where(is_padding, 0, table[req_c, pos_in_req.clamp(max=num_spec)])
    positions = torch.where(is_padding, 0, start_pos.to(torch.int64)[req_c] + pos_in_req)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), ends]).to(torch.int32)
    seq_lens = (start_pos.to(torch.int64) + counts).to(torch.int32)
    return VerifyLayout(
        input_ids=input_ids,
        positions=positions,
        req_index=req_index,
        pos_in_req=pos_in_req,
        is_padding=is_padding,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        num_tokens=ends[-1].clone(),
        num_logits_per_req=counts.to(torch.int32),
        invalid_drafts=None,
        num_reqs=num_reqs,
        num_spec=num_spec,
    )


def warm_up_varlen_layout(num_specs: Sequence[int], device: torch.device | str) -> int:
    """Compile the fused layout kernel now for every draft width in ``num_specs``.

    Engines pass their K and 0 (paused and no-speculation steps verify one row per request). The kernel
    takes request and row counts at run time and its inputs in canonical dtypes, so one variant per K
    serves every batch. Without this, the first drafting step and the first paused step each paid a compile
    (tens of milliseconds to a second) inside serving, as a GPU test on an H200 found. Returns how many
    variants ran (0 where the torch path is used).
    """
    device = torch.device(device)
    if not _use_triton(device, None):
        return 0
    widths = sorted(set(num_specs))
    zeros = torch.zeros(1, dtype=torch.int64, device=device)
    for k in widths:
        build_varlen_layout(zeros, torch.zeros(1, k, dtype=torch.int64, device=device), zeros, zeros, 1 + k)
    return len(widths)


def build_mask_layout(last_tokens: Tensor, drafts: Tensor, admitted: Tensor, start_pos: Tensor) -> VerifyLayout:
    """Uniform layout ``[R, K + 1]`` flattened; slots ``j > admitted[r]`` are padding with input id 0.

    ``seq_lens`` stays uniform (``start_pos + K + 1``) because the attention kernel still processes the
    full uniform batch; ``invalid_drafts`` is the row mask vLLM's rejection sampler takes so the pruned
    drafts can never be accepted.
    """
    num_reqs, num_spec = _check_inputs(last_tokens, drafts, admitted, start_pos)
    device = drafts.device
    width = num_spec + 1
    adm = admitted.to(torch.int64).clamp(0, num_spec)
    rows = torch.arange(num_reqs * width, device=device, dtype=torch.int64)
    req_index = rows // width
    pos_in_req = rows % width
    is_padding = pos_in_req > adm[req_index]
    table = _token_table(last_tokens, drafts).reshape(-1)
    input_ids = torch.where(is_padding, 0, table)
    positions = start_pos.to(torch.int64)[req_index] + pos_in_req
    query_start_loc = (torch.arange(num_reqs + 1, device=device, dtype=torch.int64) * width).to(torch.int32)
    seq_lens = (start_pos.to(torch.int64) + width).to(torch.int32)
    invalid_drafts = torch.arange(num_spec, device=device, dtype=torch.int64).unsqueeze(0) >= adm.unsqueeze(1)
    counts = adm + 1
    return VerifyLayout(
        input_ids=input_ids,
        positions=positions,
        req_index=req_index,
        pos_in_req=pos_in_req,
        is_padding=is_padding,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        num_tokens=counts.sum(),
        num_logits_per_req=counts.to(torch.int32),
        invalid_drafts=invalid_drafts,
        num_reqs=num_reqs,
        num_spec=num_spec,
    )
