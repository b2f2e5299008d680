"""Paged ragged-query attention through FlashInfer, planned once per captured shape: no host sync per step.

FlashInfer (``flashinfer-python``, the attention library of vLLM and SGLang) runs batch attention in two calls.
``plan()`` reads every request's query and KV lengths *on the host* and writes a work schedule into a device
workspace: which thread block takes which request's query tile and KV chunk, and where each request's output
rows start. ``run()`` launches the kernel over that schedule and reads the lengths themselves from device
buffers. vLLM and SGLang call ``plan()`` before every step -- and before every CUDA-graph replay -- with host
lengths they already hold. Our varlen verify batch gets its per-request split on the device (the capacity
manager's allocation runs there so that a step needs no host sync), so a plan per step would put one
device-to-host sync back into every verify step.

The schedule stops depending on the lengths when three things hold, and every decode-time forward the model
runner captures (verify and draft catch-up: at most ``K + 1`` query rows per request; draft steps: one) meets
them:

1. **No KV split** (``disable_split_kv``): one thread block covers a request's whole KV range, so KV lengths
   reach the kernel only through the device page table (``paged_kv_indptr``/``last_page_len``).
2. **One query tile per request.** The tile height (``cta_tile_q``: 16, 64 or 128 packed rows, a packed row
   being one query row times one head of a GQA group) is chosen at plan time to hold the most rows a request
   can have in that forward, ``max_query_len x group``, and the plan gives each request exactly one tile, so
   the tile -> request map is ``0..R-1`` whatever the lengths. Under CUDA graphs the planner sizes the tile from
   ``total_num_rows - batch_size + 1`` rows (the ragged worst case), which for ``T`` tokens over ``R`` rows can
   be smaller than what a request of ``K + 1`` rows needs (``T = R``: one row); the plan is then made with a
   larger row bound (:func:`fixed_plan`; the wrapper's ``_max_total_num_rows``, the bound FlashInfer itself
   keeps from the first plan of a graph).
3. **Output offsets on the device.** ``o_indptr`` (where each request's output rows start) is written by
   ``plan()`` as the prefix sum of the *planned* query lengths. Without a KV split it is the same array as
   ``qo_indptr``, so each forward overwrites it in the workspace with this batch's ``query_start_loc``.

So each captured shape (tokens, rows, most rows per request, heads, dtypes, page size, scale) gets one wrapper,
planned once with a dummy layout, and every forward -- captured or not -- writes this batch's ``qo_indptr``,
the CSR page table and ``o_indptr`` into that wrapper's fixed buffers with a few device kernels
(:func:`paged_kv_csr`). Eager forwards that break (2) -- a prefill too long for the ragged graphs, whose rows
per request are whole prompts -- plan per call from host copies of the lengths (one sync, which an eager
prefill has anyway). Captured forwards that break (2) -- the model runner's ragged (prefill) graphs, whose
requests may hold any number of rows -- run the Triton kernel (``triton_attention``), which needs no plan and
holds any split of a captured shape's rows.

This leans on FlashInfer internals (the planner's tile rule, the plan-info vector's order, two wrapper
attributes), so the backend is pinned to the FlashInfer that vLLM 0.33 pins (:data:`FLASHINFER_VERSION`) and
refuses any other; every assumption is a row of :data:`CONTRACT`, checked against that wheel's sources by the
CPU tests (``tests/test_flashinfer_attention.py``), and the GPU tests compare the backend with the reference
under graph replays of changing ragged batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dspark_cli.engines.embedded.attention import AttentionInputs, write_kv
from dspark_cli.errors import DsparkError

__all__ = [
    "CONTRACT",
    "FLASHINFER_VERSION",
    "FixedPlan",
    "FlashInferPagedAttention",
    "cta_tile_q",
    "fixed_plan",
    "flashinfer_status",
    "paged_kv_csr",
    "tallest_tile",
]

FLASHINFER_VERSION = "0.7.2.post1"  # the flashinfer-python vLLM 0.33.0 pins
FLOAT_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-KV scratch; only per-call (eager) plans use it
PLAN_WORKSPACE_BYTES = 1 << 20  # a one-tile-per-request schedule of 2,048 rows takes a few KiB of the 8 MiB default
MAX_TILE_ROWS = 128  # FlashInfer's tallest query tile, in packed rows (query rows x GQA group)
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # head dims its FA2 prefill dispatch has warp layouts for
_O_INDPTR_OFFSET = 8  # PrefillPlanInfo::ToVector(): index of o_indptr's byte offset in the int workspace


@dataclass(frozen=True)
class ContractRow:
    """One FlashInfer internal this module relies on: ``snippet`` must occur in ``path`` of the pinned wheel."""

    path: str
    snippet: str
    why: str


_SCHED = "flashinfer/data/include/flashinfer/attention/scheduler.cuh"
_UTILS = "flashinfer/data/include/flashinfer/utils.cuh"
_KERNEL = "flashinfer/data/include/flashinfer/attention/prefill.cuh"
_PAGED_RUN = "flashinfer/data/csrc/batch_prefill_paged.cuh"
_PY = "flashinfer/prefill.py"

CONTRACT: tuple[ContractRow, ...] = (
    ContractRow(_SCHED, "const uint64_t max_seq_len = total_num_rows - batch_size + 1;",
                "under CUDA graphs the tile is sized from the row bound, not the planned lengths"),
    ContractRow(_SCHED, "cta_tile_q = FA2DetermineCtaTileQ(max_qo_len, head_dim, head_dim_qk, kv_dtype_bytes);",
                "the tile height follows from that bound alone (fixed_plan picks the bound)"),
    ContractRow(_UTILS, "if (avg_packed_qo_len > 64 && head_dim < 256) {\n    return 128;",
                "cta_tile_q() mirrors the rule: 128 above 64 packed rows"),
    ContractRow(_UTILS, "if (avg_packed_qo_len > 16) {\n        // avg_packed_qo_len <= 64\n        return 64;",
                "cta_tile_q() mirrors the rule: 64 above 16 packed rows (SM80 and newer)"),
    ContractRow(_SCHED, "if (disable_split_kv) {\n    kv_chunk_size = std::numeric_limits<int64_t>::max();",
                "disable_split_kv: one KV chunk per request whatever its length"),
    ContractRow(_SCHED, "const int64_t num_chunks_kv = disable_split_kv ? 1 : ceil_div(kv_len, kv_chunk_size);",
                "no KV split: the schedule does not read the KV lengths"),
    ContractRow(_SCHED, "const int64_t num_tiles_q = ceil_div(packed_qo_len, cta_tile_q);",
                "a request whose packed rows fit one tile gets one tile (request_indices = 0..R-1)"),
    ContractRow(_SCHED, "o_indptr.push_back(o_indptr.back() + qo_len * num_chunks_kv);",
                "without a split, o_indptr is the planned qo_indptr: overwriting it with this batch's is exact"),
    ContractRow(_SCHED, "return {padded_batch_size,\n            total_num_rows,\n            total_num_rows_offset,\n"
                "            cta_tile_q,\n            request_indices_offset,\n            qo_tile_indices_offset,\n"
                "            kv_tile_indices_offset,\n            merge_indptr_offset,\n            o_indptr_offset,",
                "plan info index 8 is o_indptr's byte offset in the int workspace"),
    ContractRow(_SCHED, "block_valid_mask_h[i] = i < new_batch_size;",
                "thread blocks past the planned tiles exit at once"),
    ContractRow(_SCHED, "  if (enable_cuda_graph) {\n    plan_info.block_valid_mask_offset = int_allocator.aligned_alloc_offset(",
                "that mask exists under CUDA graphs whether or not the KV is split: with disable_split_kv the padded "
                "grid's extra blocks would otherwise read indices the plan never wrote (older FlashInfer built it "
                "for split KV only)"),
    ContractRow(_KERNEL, "const uint32_t qo_len = variant.qo_len, kv_len = variant.kv_len,",
                "the kernel reads each request's query and KV lengths from the device buffers"),
    ContractRow(_KERNEL, ": o + o_indptr[request_idx] * o_stride_n +",
                "unsplit output rows start at o_indptr[request]"),
    ContractRow(_PAGED_RUN, "params.o_indptr = GetPtrFromBaseOffset<IdType>(int_buffer_ptr, plan_info.o_indptr_offset);",
                "run() reads o_indptr from the int workspace, where forward() rewrites it"),
    ContractRow(_PY, "self._max_total_num_rows or total_num_rows,",
                "plan() hands the wrapper's row bound to the planner (fixed_plan sets it first)"),
    ContractRow(_PY, "if self._max_total_num_rows is None:\n                self._max_total_num_rows = total_num_rows",
                "a bound set before the first plan is kept"),
    ContractRow(_PY, "self._plan_info = self._cached_module.plan(", "the plan-info vector the o_indptr offset is read from"),
    ContractRow(_PY, "self._int_workspace_buffer,\n                self._plan_info,",
                "run() passes the wrapper's int workspace (where o_indptr is rewritten)"),
    ContractRow(_PY, "if q.size(0) != self._qo_indptr_last:",
                "run() checks q's rows against the planned total: plans use the forward's padded token count"),
)


def flashinfer_status() -> str | None:
    """None when the pinned FlashInfer is importable, else why not (one line)."""
    try:
        import flashinfer
    except ImportError as exc:  # not installed, or a dependency missing
        return f"flashinfer is not importable ({exc}); pip install 'dspark-cli[flashinfer]'"
    version = getattr(flashinfer, "__version__", "?")
    if version != FLASHINFER_VERSION:
        return (f"flashinfer {version} is installed, but this backend is pinned to {FLASHINFER_VERSION} "
                "(the version vLLM 0.33 pins; it relies on that planner)")
    return None


def tallest_tile(head_dim: int) -> int:
    """The most packed rows one FlashInfer query tile holds for ``head_dim`` (FA2DetermineCtaTileQ)."""
    return MAX_TILE_ROWS if head_dim < 256 else 64


def cta_tile_q(packed_rows: int, head_dim: int) -> int:
    """FlashInfer's query-tile height for ``packed_rows`` (FA2DetermineCtaTileQ: 2-byte KV, SM80+, head_dim < 512)."""
    if packed_rows > 64 and head_dim < 256:
        return 128
    if packed_rows > 16:
        return 64
    return 16


@dataclass(frozen=True)
class FixedPlan:
    """The dummy layout a captured shape is planned with once."""

    qo_indptr: tuple[int, ...]  # R requests over T rows, each with at least one row and one tile
    row_bound: int  # total rows the planner sizes its tile from (>= T)
    tile: int  # the resulting cta_tile_q


def fixed_plan(num_tokens: int, num_rows: int, max_query_len: int, group: int, head_dim: int) -> FixedPlan:
    """A plan for ``num_tokens`` tokens over ``num_rows`` requests whose schedule holds for every batch of that
    shape with at most ``max_query_len`` rows per request (one tile each; see the module docstring).

    Raises ValueError when no tile holds ``max_query_len`` rows of a GQA group of ``group`` heads, or when
    the tokens cannot be spread over the requests one tile each (a captured size far above ``(K + 1) x R``).
    """
    if num_rows < 1 or num_tokens < num_rows or max_query_len < 1 or group < 1:
        raise ValueError(f"bad shape: {num_tokens} tokens over {num_rows} requests, "
                         f"{max_query_len} rows per request, group {group}")
    need = max_query_len * group
    largest = tallest_tile(head_dim)
    if need > largest:
        raise ValueError(f"{max_query_len} query rows x {group} heads per KV head exceed FlashInfer's "
                         f"tallest tile ({largest} packed rows)")
    # Fewest packed rows in one request that make the planner choose a tile holding `need`.
    least = 1 if need <= 16 else (17 if need <= 64 else 65)
    rows_for_tile = math.ceil(least / group)
    bound = max(num_tokens, num_rows - 1 + rows_for_tile)
    tile = cta_tile_q((bound - num_rows + 1) * group, head_dim)
    base, extra = divmod(num_tokens, num_rows)
    per_request = [base + (i < extra) for i in range(num_rows)]
    if (base + (extra > 0)) * group > tile or need > tile:
        raise ValueError(f"{num_tokens} tokens over {num_rows} requests need more than one {tile}-row tile "
                         "per request in the dummy plan")
    qo = [0]
    for n in per_request:
        qo.append(qo[-1] + n)
    return FixedPlan(tuple(qo), bound, tile)


def paged_kv_csr(seq_lens: Tensor, block_tables: Tensor, block_size: int, kv_indptr: Tensor, kv_indices: Tensor,
                 last_page_len: Tensor) -> None:
    """FlashInfer's page table for requests of ``seq_lens`` KV tokens, written in place, on the device.

    ``block_tables`` is ``[R, M]``; the int32 outputs are ``kv_indptr [R + 1]``, ``kv_indices`` (at least
    ``R x M + 1`` entries: request r's pages at ``kv_indptr[r]:kv_indptr[r + 1]``, the last entry a dump slot)
    and ``last_page_len [R]``. Fixed shapes and no host reads, so it is capturable. A request with no KV
    (an unused row of a padded batch) gets one page -- its table's first entry, the scratch block -- holding
    0 tokens: FlashInfer computes a length as ``(pages - 1) x page + last``, which must not go negative.
    """
    num_reqs, width = block_tables.shape
    lens = seq_lens.to(torch.int32)
    pages = torch.clamp((lens + (block_size - 1)) // block_size, min=1)
    last_page_len.copy_(lens - (pages - 1) * block_size)
    kv_indptr[:1].zero_()
    torch.cumsum(pages, 0, dtype=torch.int32, out=kv_indptr[1:])
    cols = torch.arange(width, dtype=torch.int32, device=block_tables.device)
    dump = num_reqs * width
    dest = torch.where(cols.unsqueeze(0) < pages.unsqueeze(1), kv_indptr[:-1].unsqueeze(1) + cols.unsqueeze(0), dump)
    kv_indices.scatter_(0, dest.reshape(-1).to(torch.int64), block_tables.reshape(-1).to(torch.int32))


@dataclass
class _Planned:
    """A wrapper planned once for one captured shape, with the device buffers its schedule reads."""

    wrapper: object
    qo_indptr: Tensor
    kv_indptr: Tensor
    kv_indices: Tensor
    last_page_len: Tensor
    o_indptr: Tensor  # a view into the wrapper's int workspace


class FlashInferPagedAttention:
    """The embedded engine's attention through FlashInfer's FA2 paged kernel (see the module docstring)."""

    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        problem = flashinfer_status()
        if problem is not None:
            raise DsparkError(f"attention backend 'flashinfer': {problem}")
        if device.type != "cuda":
            raise DsparkError("attention backend 'flashinfer' needs a CUDA device; use torch on CPU")
        import flashinfer

        self._wrapper_cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper
        self._device = device
        with torch.inference_mode(False):
            self._float_ws = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._planned: dict[tuple, _Planned] = {}
        self._eager: object | None = None
        # The plan of the forward in flight: every layer of one forward shares its AttentionInputs.
        self._current: tuple[AttentionInputs, Callable[[Tensor, Tensor, Tensor], Tensor]] | None = None

    # ------------------------------------------------------------------------------------------ layers

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: AttentionInputs,
        scale: float,
    ) -> Tensor:
        write_kv(k, v, k_cache, v_cache, inputs.slot_mapping)
        if self._current is None or self._current[0] is not inputs:
            self._current = (inputs, self._prepare(q, k_cache, inputs, scale))
        return self._current[1](q, k_cache, v_cache)

    def warm_up(self, num_heads: int, head_dim: int, k_cache: Tensor, v_cache: Tensor, max_blocks: int) -> int:
        """Build (JIT-compile on first use, then load) the kernel module for these shapes now, not mid-serving."""
        device = k_cache.device
        with torch.inference_mode():
            q = torch.zeros((1, num_heads, head_dim), dtype=k_cache.dtype, device=device)
            tables = torch.zeros((2, max_blocks), dtype=torch.int64, device=device)  # + the scratch row
            inputs = AttentionInputs(
                slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
                positions=torch.zeros(1, dtype=torch.int64, device=device),
                row_index=torch.zeros(1, dtype=torch.int64, device=device),
                col_index=torch.zeros(1, dtype=torch.int64, device=device),
                block_tables=tables,
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
                seq_lens=torch.ones(1, dtype=torch.int32, device=device),
                max_query_len=1, max_kv_len=k_cache.shape[1], block_size=k_cache.shape[1],
            )
            self._prepare(q, k_cache, inputs, head_dim**-0.5)(q, k_cache, v_cache)
            self._current = None
        return 1

    # ------------------------------------------------------------------------------------------ plans

    def _prepare(
        self, q: Tensor, k_cache: Tensor, inputs: AttentionInputs, scale: float
    ) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        group = num_heads // kv_heads
        if inputs.captured and inputs.max_query_len * group > tallest_tile(head_dim):
            return self._ragged_captured(inputs, scale)
        if inputs.captured:
            planned = self._planned_for(q, k_cache, inputs, scale)
            planned.qo_indptr.copy_(inputs.query_start_loc)
            paged_kv_csr(inputs.seq_lens, inputs.block_tables[:-1], inputs.block_size, planned.kv_indptr,
                         planned.kv_indices, planned.last_page_len)
            planned.o_indptr.copy_(inputs.query_start_loc)
            wrapper = planned.wrapper

            def run_planned(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
                # Rows past query_start_loc[R] (padding) belong to no request: left unwritten, never read.
                return wrapper.run(q, (k_cache, v_cache), out=torch.empty_like(q))

            return run_planned
        return self._plan_eager(q, k_cache, inputs, scale)

    @staticmethod
    def _ragged_captured(inputs: AttentionInputs, scale: float) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """A captured forward with more rows per request than one tile holds (the ragged prefill graphs): the
        Triton kernel, whose launch reads shapes only, so one graph replays any split of its rows."""
        from dspark_cli.engines.embedded.triton_attention import paged_attention_varlen

        tables = inputs.block_tables[:-1].to(torch.int32)  # drop the scratch row: padding is past qsl[R]

        def run_ragged(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
            return paged_attention_varlen(q, k_cache, v_cache, tables, inputs.seq_lens, inputs.query_start_loc,
                                          scale)

        return run_ragged

    def _planned_for(self, q: Tensor, k_cache: Tensor, inputs: AttentionInputs, scale: float) -> _Planned:
        num_tokens, num_heads, head_dim = q.shape
        num_rows, width = inputs.block_tables.shape[0] - 1, inputs.block_tables.shape[1]
        kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        key = (num_tokens, num_rows, width, inputs.max_query_len, num_heads, kv_heads, head_dim, page, q.dtype,
               k_cache.dtype, scale)
        planned = self._planned.get(key)
        if planned is not None:
            return planned
        try:
            plan = fixed_plan(num_tokens, num_rows, inputs.max_query_len, num_heads // kv_heads, head_dim)
        except ValueError as exc:
            raise DsparkError(f"attention backend 'flashinfer' cannot plan a captured batch once: {exc}; "
                              "lower --max-capture-size or use --attention-backend triton") from exc
        dev = self._device
        i32 = dict(dtype=torch.int32, device=dev)
        with torch.inference_mode(False):
            qo = torch.zeros(num_rows + 1, **i32)
            kv_indptr = torch.zeros(num_rows + 1, **i32)
            kv_indices = torch.zeros(num_rows * width + 1, **i32)
            last = torch.zeros(num_rows, **i32)
            wrapper = self._wrapper_cls(
                self._float_ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo, paged_kv_indptr_buf=kv_indptr,
                paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=last, backend="fa2",
            )
            wrapper.reset_workspace_buffer(self._float_ws, torch.empty(PLAN_WORKSPACE_BYTES, dtype=torch.uint8,
                                                                       device=dev))
            wrapper._max_total_num_rows = plan.row_bound
            wrapper.plan(
                torch.tensor(plan.qo_indptr, dtype=torch.int32), torch.arange(num_rows + 1, dtype=torch.int32),
                torch.zeros(num_rows, dtype=torch.int32), torch.ones(num_rows, dtype=torch.int32),
                num_heads, kv_heads, head_dim, page, causal=True, sm_scale=scale, q_data_type=q.dtype,
                kv_data_type=k_cache.dtype, disable_split_kv=True,
            )
            offset = int(wrapper._plan_info[_O_INDPTR_OFFSET])
            o_indptr = wrapper._int_workspace_buffer.view(torch.int32)[offset // 4: offset // 4 + num_rows + 1]
        planned = _Planned(wrapper, qo, kv_indptr, kv_indices, last, o_indptr)
        self._planned[key] = planned
        return planned

    def _plan_eager(
        self, q: Tensor, k_cache: Tensor, inputs: AttentionInputs, scale: float
    ) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        if torch.cuda.is_current_stream_capturing():
            raise DsparkError("internal: a captured forward reached FlashInfer's per-call plan (needs the host)")
        num_tokens, num_heads, head_dim = q.shape
        kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        num_rows, width = inputs.block_tables.shape[0] - 1, inputs.block_tables.shape[1]
        i32 = dict(dtype=torch.int32, device=q.device)
        kv_indptr = torch.empty(num_rows + 1, **i32)
        kv_indices = torch.empty(num_rows * width + 1, **i32)
        last = torch.empty(num_rows, **i32)
        paged_kv_csr(inputs.seq_lens, inputs.block_tables[:-1], inputs.block_size, kv_indptr, kv_indices, last)
        rows = int(inputs.query_start_loc[-1])  # a sync: eager forwards only
        if self._eager is None:
            with torch.inference_mode(False):  # its buffers are rewritten by every plan, in or out of inference
                self._eager = self._wrapper_cls(self._float_ws, "NHD", backend="fa2")
        wrapper = self._eager
        if num_rows > 0 and rows > 0:
            wrapper.plan(inputs.query_start_loc, kv_indptr, kv_indices, last, num_heads, kv_heads, head_dim, page,
                         causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)

        def run_eager(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
            out = torch.zeros_like(q)
            if num_rows > 0 and rows > 0:
                wrapper.run(q[:rows], (k_cache, v_cache), out=out[:rows])
            return out

        return run_eager
