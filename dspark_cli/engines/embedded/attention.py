"""Attention of a flattened ragged token batch against a paged KV cache, behind a small backend interface.

Every forward of the engine (prefill, verify, draft step) is a flat batch of ``T`` tokens that belong to
requests ("rows"). The model runner describes it once per forward with :class:`AttentionInputs` -- all
device tensors derived on the device from block tables and per-token positions, so a verify layout
built by the core (whose request boundaries never reach the host) can be attended without a sync.

Backends turn those inputs into attention outputs. :class:`TorchPagedAttention` is the reference and
the CPU path: it gathers each row's KV blocks into a dense ``[rows, L]`` key grid, scatters the queries
into a ``[rows, Q]`` grid and runs one batched SDPA with a causal-by-position mask. All shapes depend
only on ``(T, rows, Q, L)``, which the host chooses (for CUDA graphs: the padded size, the row capacity,
``K + 1`` and the maximum model length), so it is capturable. It spends attention compute on the grid
rather than on the ragged tokens; the Triton kernel (``triton_attention``) and FlashInfer
(``flashinfer_attention``) replace it on CUDA by implementing :class:`AttentionBackend` with the same inputs.

Padding tokens write their K/V to the scratch slot (slot 0 of the reserved block 0) and are placed on
the scratch row, the last row of the grid; their outputs are garbage and never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_cli.engines.embedded.block_manager import SCRATCH_BLOCK
from dspark_cli.errors import DsparkError

__all__ = ["BACKENDS", "AttentionBackend", "AttentionInputs", "TorchPagedAttention", "build_attention_inputs",
           "get_backend"]

SCRATCH_SLOT = SCRATCH_BLOCK  # slot 0 lies in the scratch block (block_size * 0 + 0)


@dataclass
class AttentionInputs:
    """Per-forward attention metadata (device tensors unless noted); shared by all layers."""

    slot_mapping: Tensor  # [T] int64: flat KV slot each token writes (padding -> SCRATCH_SLOT)
    positions: Tensor  # [T] int64: absolute position (the causal limit of each query)
    row_index: Tensor  # [T] int64: grid row of each token (padding -> num_rows - 1, the scratch row)
    col_index: Tensor  # [T] int64: grid column of each token within its row
    block_tables: Tensor  # [num_rows, max_blocks] int64 (scratch row and unused entries -> SCRATCH_BLOCK)
    query_start_loc: Tensor  # [R + 1] int32: request r owns rows [qsl[r], qsl[r + 1]) (kernel backends)
    seq_lens: Tensor  # [R] int32: KV length of each request after this forward's writes
    max_query_len: int  # host: grid columns Q
    max_kv_len: int  # host: keys gathered per row L (a multiple of block_size)
    block_size: int
    # host: a forward of a captured graph family -- its shapes are fixed per graph and at most max_query_len
    # rows per request, so a backend may plan its work once per shape (FlashInfer) rather than per call.
    captured: bool = False


def build_attention_inputs(
    positions: Tensor,
    req_index: Tensor,
    is_padding: Tensor,
    query_start_pos: Tensor,
    block_tables: Tensor,
    block_size: int,
    max_query_len: int,
    max_kv_len: int,
    captured: bool = False,
) -> AttentionInputs:
    """Derive slots and grid coordinates on the device; no host sync, fixed shapes.

    ``req_index[T]`` may point one past the last request for padding (the varlen layout's convention);
    ``block_tables`` must then have a row for it -- we always append the scratch row, so a table of
    ``R`` requests becomes ``R + 1`` rows and padding is routed to row ``R`` whatever its index said.
    ``query_start_pos[R]`` is the position of each request's first query token (its column 0).
    Rows of a request must be contiguous and in position order (every layout we build is), which is
    what lets ``query_start_loc``/``seq_lens`` for kernel backends be counted rather than sorted.
    """
    num_reqs = query_start_pos.shape[0]
    device = positions.device
    scratch_row = torch.full((1, block_tables.shape[1]), SCRATCH_BLOCK, dtype=torch.int64, device=device)
    tables = torch.cat([block_tables.to(torch.int64), scratch_row], dim=0)
    req = torch.where(is_padding, num_reqs, req_index.to(torch.int64).clamp(0, num_reqs))
    req_c = req.clamp(max=max(num_reqs - 1, 0))
    pos = positions.to(torch.int64)
    block_col = (pos // block_size).clamp(0, block_tables.shape[1] - 1)
    slot = tables[req, block_col] * block_size + pos % block_size
    slot = torch.where(is_padding, SCRATCH_SLOT, slot)
    col = torch.where(is_padding, 0, (pos - query_start_pos.to(torch.int64)[req_c]).clamp(0, max_query_len - 1))
    # Rows per request counted with the layout's own ownership (mask-layout pruned rows stay inside their
    # request's segment); tail padding lands in bucket R. scatter_add keeps the shape fixed.
    owner = req_index.to(torch.int64).clamp(0, num_reqs)
    counts = torch.zeros(num_reqs + 1, dtype=torch.int64, device=device).scatter_add_(
        0, owner, torch.ones_like(owner)
    )[:num_reqs]
    qsl = torch.cat([counts.new_zeros(1), torch.cumsum(counts, dim=0)]).to(torch.int32)
    seq_lens = (query_start_pos.to(torch.int64) + counts).to(torch.int32)
    return AttentionInputs(
        slot_mapping=slot,
        positions=pos,
        row_index=req,
        col_index=col,
        block_tables=tables,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        max_query_len=max_query_len,
        max_kv_len=max_kv_len,
        block_size=block_size,
        captured=captured,
    )


class AttentionBackend(Protocol):
    """What a layer needs: write this step's K/V into the paged cache, attend, return ``[T, H, D]``."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: AttentionInputs,
        scale: float,
    ) -> Tensor: ...

    def warm_up(self, num_heads: int, head_dim: int, k_cache: Tensor, v_cache: Tensor, max_blocks: int) -> int:
        """Compile whatever kernels serving could otherwise compile on first use; returns how many."""
        ...


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter this step's K/V (``[T, KVH, D]``) into ``[num_blocks, block_size, KVH, D]`` caches in place."""
    kvh, hd = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class TorchPagedAttention:
    """Reference backend: dense gather of each row's blocks + one SDPA over the [rows, Q] query grid."""

    name = "torch"

    def warm_up(self, num_heads: int, head_dim: int, k_cache: Tensor, v_cache: Tensor, max_blocks: int) -> int:
        return 0  # plain torch ops: nothing is compiled

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: AttentionInputs,
        scale: float,
    ) -> Tensor:
        write_kv(k, v, k_cache, v_cache, inputs.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        kvh = k_cache.shape[-2]
        rows = inputs.block_tables.shape[0]
        qlen = inputs.max_query_len
        nblk = inputs.max_kv_len // inputs.block_size
        tables = inputs.block_tables[:, :nblk]
        # [rows, nblk, bs, KVH, D] -> [rows, KVH, L, D]
        keys = k_cache[tables].reshape(rows, nblk * inputs.block_size, kvh, head_dim).transpose(1, 2)
        values = v_cache[tables].reshape(rows, nblk * inputs.block_size, kvh, head_dim).transpose(1, 2)
        grid = q.new_zeros(rows, qlen, num_heads, head_dim)
        grid.index_put_((inputs.row_index, inputs.col_index), q)
        # Unfilled grid cells keep position 0: they see key 0 only, so no row of the mask is all False
        # (which would make SDPA return NaN); their outputs are never gathered.
        qpos = torch.zeros(rows, qlen, dtype=torch.int64, device=q.device)
        qpos.index_put_((inputs.row_index, inputs.col_index), inputs.positions)
        key_pos = torch.arange(nblk * inputs.block_size, device=q.device)
        mask = key_pos.view(1, 1, 1, -1) <= qpos.view(rows, 1, qlen, 1)
        out = F.scaled_dot_product_attention(
            grid.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale,
            enable_gqa=kvh != num_heads,
        )
        return out.transpose(1, 2)[inputs.row_index, inputs.col_index]


class TritonPagedAttention:
    """The ragged paged-attention Triton kernel (``triton_attention``): work scales with real rows and keys.

    It reads ``query_start_loc``/``seq_lens`` instead of the dense grid, so varlen compaction saves
    attention compute too, and it replays under CUDA graphs for any per-request split.
    """

    name = "triton"

    def __init__(self) -> None:
        from dspark_cli.engines.embedded import triton_attention

        self._kernel = triton_attention.paged_attention_varlen
        self._warm_up = triton_attention.warm_up_paged_attention

    def warm_up(self, num_heads: int, head_dim: int, k_cache: Tensor, v_cache: Tensor, max_blocks: int) -> int:
        return self._warm_up(num_heads, head_dim, k_cache, v_cache, max_blocks)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: AttentionInputs,
        scale: float,
    ) -> Tensor:
        write_kv(k, v, k_cache, v_cache, inputs.slot_mapping)
        tables = inputs.block_tables[:-1].to(torch.int32)  # drop the scratch row: padding is past qsl[R]
        return self._kernel(q, k_cache, v_cache, tables, inputs.seq_lens, inputs.query_start_loc, scale)


def _ampere_or_newer(device: torch.device) -> bool:
    """FlashInfer's query-tile height (``flashinfer_attention.cta_tile_q``) is mirrored for SM80 and newer; older
    GPUs take 16-row tiles where a verify request needs more, and its other rows would never be written."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _triton_usable(device: torch.device) -> bool:
    try:
        from dspark_cli.engines.embedded.triton_attention import triton_available
    except ImportError:
        return False
    # On CPU the module runs its torch reference (same semantics as the kernel): usable, never chosen by
    # "auto" because the grid path is faster there.
    return device.type == "cpu" or triton_available()


BACKENDS = ("auto", "torch", "triton", "flashinfer")


def get_backend(name: str = "auto", device: torch.device | None = None,
                dtype: torch.dtype | None = None, head_dims: tuple[int, ...] = ()) -> AttentionBackend:
    """The attention implementation. "auto" on CUDA: FlashInfer when the pinned version is installed, the
    dtype is 16-bit and every model's head dim (``head_dims``) is one its kernels are built for, else the
    Triton kernel when triton is importable; else torch."""
    from dspark_cli.engines.embedded.flashinfer_attention import FLASHINFER_HEAD_DIMS, flashinfer_status

    device = device or torch.device("cpu")
    fi_dims = all(d in FLASHINFER_HEAD_DIMS for d in head_dims)
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            half = dtype in (None, torch.float16, torch.bfloat16)
            if half and fi_dims and _ampere_or_newer(device) and flashinfer_status() is None:
                name = "flashinfer"
            elif _triton_usable(device):
                name = "triton"
    if name == "torch":
        return TorchPagedAttention()
    if name == "triton":
        if not _triton_usable(device):
            raise DsparkError("attention backend 'triton' needs triton installed on a CUDA machine; use torch")
        return TritonPagedAttention()
    if name == "flashinfer":
        if device.type != "cuda":
            raise DsparkError("attention backend 'flashinfer' needs a CUDA device; use torch on CPU")
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            raise DsparkError(f"attention backend 'flashinfer' runs float16/bfloat16 models, not {dtype}; "
                              "use a 16-bit dtype or the triton backend")
        if not fi_dims:
            # FlashInfer's dispatch has no warp layout for other head dims: it fails at the first forward.
            bad = sorted(set(head_dims) - set(FLASHINFER_HEAD_DIMS))
            raise DsparkError(f"attention backend 'flashinfer' runs head dims {FLASHINFER_HEAD_DIMS}, not {bad}; "
                              "use the triton backend")
        if not _ampere_or_newer(device):  # the one check that asks the device, after those that need none
            raise DsparkError("attention backend 'flashinfer' is used here on GPUs of compute capability 8.0 or "
                              "newer (its query-tile rule is mirrored for those); use the triton backend")
        from dspark_cli.engines.embedded.flashinfer_attention import FlashInferPagedAttention

        return FlashInferPagedAttention(device)
    raise DsparkError(f"unknown attention backend {name!r}; use {', '.join(BACKENDS)}")
