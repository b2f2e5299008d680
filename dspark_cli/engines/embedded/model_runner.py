"""Runs the models: weights, KV pools, batch tensors, and (on CUDA) captured graphs.

The runner owns everything that touches the device except the core's decisions: it loads target and
draft, sizes and allocates both KV pools, turns scheduled sequences into batch tensors, and runs three
kinds of forward:

* **prefill** -- whole prompts, target and draft (the draft's KV must cover the prompt too);
* **verify** -- the target over a core :class:`~dspark_cli.core.layout.VerifyLayout`, returning logits
  for every row (rows are padding or verified; the rejection sampler picks);
* **draft** -- the drafter's catch-up pass and its K - 1 one-token steps.

On CUDA (``cuda_graphs=True``) each of the decode-time forwards is captured per padded size: the verify
forward per token count (powers of two up to ``(K + 1) * max_num_seqs``), the target once more per request
count for steps of one token a request (a drafting server's paused steps, which on the verify family would
launch attention over K + 1 rows a request), the draft catch-up pass the same way as verify, the draft step per
request count, and -- for all-greedy batches -- the *whole* K-token draft loop
(K LM heads, argmaxes and confidences, K - 1 draft steps) as one graph per request count, so a proposal is
two replays instead of ~25 launches per draft token. Replays copy the step's tensors into static buffers
with ``copy_``; nothing reads device values on the host, so the only host knowledge a replay needs is
the padded size -- the budget the capacity manager chose. CPU runs everything eagerly.

Prefills and long draft catch-ups (a probe's, over a whole saturation pause) are ragged too, with any number
of rows per request: with a kernel attention backend (Triton, FlashInfer) each model also gets a *ragged*
family per padded token count (:func:`ragged_capture_sizes`, up to the prefill token limit or
``RAGGED_MAX_TOKENS``) that holds any split of its tokens into requests; the K + 1 families hand it what they
cannot hold, and what it cannot hold runs eagerly. Why: an eager forward is launch-bound on a small model --
on an H200 an eager SmolLM2-135M prefill of 16 prompts took 32 ms, 6.5 ms as a replay (docs/PERFORMANCE.md
section 19) -- and every prefill step stalls every decoding request; with speculation, staggered finishes
bring 4-5x as many prefill steps as plain decoding does (section 17). Not with the torch backend: its dense
``[rows, max_model_len]`` grid per captured size would not fit.

All graph families share one memory pool, and they replay in a different order than they were captured
(catch-up, draft loop, verify each step; captured verify first). A graph captured later may be handed, for
its own output, memory that an earlier graph still uses for intermediates on every replay; replaying the
earlier graph then overwrites that output. So no graph returns memory of the pool: every family writes its
outputs into static buffers allocated before capture, as it reads its inputs from them. (Measured on an H200:
with the draft loop's tokens left in the pool, the verify replay overwrote them before the rejection step
read them, and garbage token ids reached the next step's embedding gather.)

Host-built batch tensors of the decode-path steps (block tables, catch-up tokens, positions) are packed into one
int64 array and moved with one host-to-device copy, not one small copy per field. A prefill (one step per
admission, not per token) still copies its five index tensors apart.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dspark_cli.core.layout import VerifyLayout
from dspark_cli.engines.embedded.attention import AttentionBackend, build_attention_inputs, get_backend
from dspark_cli.engines.embedded.block_manager import SCRATCH_BLOCK
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.drafter import (
    Drafter,
    DraftInputs,
    DraftOutput,
    ForwardFn,
    load_confidence_head,
)
from dspark_cli.engines.embedded.model import LlamaForCausalLM, load_llama, read_llama_args, read_safetensors
from dspark_cli.engines.embedded.sequence import Sequence
from dspark_cli.engines.embedded.shapes import random_init_spec
from dspark_cli.engines.embedded.synthetic import SyntheticDrafter
from dspark_cli.errors import DsparkError

__all__ = ["ModelRunner", "capture_sizes_for", "kv_pool_budget", "step_reserve_bytes"]

log = logging.getLogger("dspark.embedded")

CPU_KV_BUDGET_BYTES = 1 << 30  # KV pools on CPU default to at most 1 GiB (both models together)
# Bytes the sampler holds per vocabulary entry of a row it samples from, at its peak: float32 scaled logits and
# probabilities, a float64 CDF and the int64 column scan beside it (core/rejection.py: sample, inverse_cdf_sample).
SAMPLER_BYTES_PER_LOGIT = 30
# Over the estimate: the caching allocator's fragmentation and whatever it leaves out. The served peaks on an H100
# were 3% above the estimate without it (docs/PERFORMANCE.md section 44).
STEP_RESERVE_MARGIN = 1.5
GIB = 1 << 30


@contextmanager
def no_collection_during_capture() -> Iterator[None]:
    """Free cyclic garbage first, then keep the cyclic collector off while graphs are captured.

    A garbage cycle that holds CUDA graphs (an engine dropped earlier, a profiling runner) may be collected
    at any allocation; if that happens during a capture, the graphs' destructors call into CUDA, which is not
    permitted while a stream captures, and the capture in progress is invalidated (seen on the H200 as
    "operation not permitted when stream is capturing (function reset)" and a failed engine). torch's
    ``torch.cuda.graph`` no longer collects before capturing by default.
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_graph(body: Callable[[], object], pool: object) -> torch.cuda.CUDAGraph:
    """``body`` captured into a CUDA graph sharing memory ``pool`` (None: a new one), after two warm-up runs
    on a side stream (lazy initialisations, allocator growth and autotuning happen outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


def capture_sizes_for(max_size: int) -> list[int]:
    """Powers of two up to ``max_size``, plus ``max_size`` itself: the padded sizes graphs exist for."""
    sizes = [1]
    while sizes[-1] * 2 < max_size:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


RAGGED_MIN_TOKENS = 16
# The largest ragged graph: past a few thousand tokens a prefill's compute outweighs its launches, and every
# size adds a capture (and its activations to the shared pool) at start-up.
RAGGED_MAX_TOKENS = 8192


def ragged_capture_sizes(max_size: int) -> list[int]:
    """Token counts of the ragged (prefill) families: powers of two from ``RAGGED_MIN_TOKENS`` and 1.5x each,
    up to ``max_size``, plus ``max_size`` itself. Finer than powers of two because a prefill's compute grows
    with its padded size: the padding stays under a third of the batch."""
    sizes: list[int] = []
    size = RAGGED_MIN_TOKENS
    while size < max_size:
        sizes.append(size)
        if size * 3 // 2 < max_size:
            sizes.append(size * 3 // 2)
        size *= 2
    sizes.append(max_size)
    return sizes


@dataclass
class _Forward:
    """One model plus its KV pool: ``run`` is an eager forward returning final-normed hidden states."""

    model: LlamaForCausalLM
    kv: list[tuple[Tensor, Tensor]]
    block_size: int

    def run(
        self, ids: Tensor, positions: Tensor, req_index: Tensor, is_padding: Tensor, query_start_pos: Tensor,
        block_tables: Tensor, max_query_len: int, max_kv_len: int, captured: bool = False,
    ) -> Tensor:
        inputs = build_attention_inputs(
            positions, req_index, is_padding, query_start_pos, block_tables, self.block_size, max_query_len,
            max_kv_len, captured,
        )
        return self.model(ids, positions, self.kv, inputs)


class _GraphedForward:
    """CUDA graphs of one forward for a family of padded token counts with fixed grid shapes.

    Static buffers are allocated once at the largest size; each graph reads a prefix of them, so a replay
    is a handful of ``copy_``/``fill_`` into fixed addresses followed by ``replay()``. A batch the family
    cannot hold (too many tokens, or a request with more query rows than captured) runs eagerly.
    """

    def __init__(
        self, fwd: _Forward, sizes: list[int], max_rows: int, max_query_len: int, max_blocks: int,
        device: torch.device, pool: object | None,
    ) -> None:
        self.fwd = fwd
        # What runs a batch no captured size holds: the model's eager forward, or another family.
        self.fallback: ForwardFn = fwd.run
        self.sizes = sorted(sizes)
        self.max_rows = max_rows
        self.qlen = max_query_len
        self.max_blocks = max_blocks
        self.kv_len = max_blocks * fwd.block_size
        top = self.sizes[-1]
        rows = min(top, max_rows)
        i64 = dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.req_index = torch.zeros(top, **i64)
        self.is_padding = torch.ones(top, dtype=torch.bool, device=device)
        self.query_start_pos = torch.zeros(rows, **i64)
        self.block_tables = torch.full((rows, max_blocks), SCRATCH_BLOCK, **i64)
        # Outside the graph pool (see the module docstring): a replay of another family cannot overwrite it.
        model = fwd.model
        self.out = torch.zeros(top, model.args.hidden_size, dtype=model.norm.weight.dtype, device=device)
        self.graphs: dict[int, bool] = {}
        self._captured: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool

    def _rows(self, size: int) -> int:
        return min(size, self.max_rows)

    def _body(self, size: int) -> Tensor:
        rows = self._rows(size)
        hidden = self.fwd.run(
            self.ids[:size], self.positions[:size], self.req_index[:size], self.is_padding[:size],
            self.query_start_pos[:rows], self.block_tables[:rows], self.qlen, self.kv_len, captured=True,
        )
        return self.out[:size].copy_(hidden)

    @torch.inference_mode()
    def capture(self, emulate: bool = False) -> None:
        """Capture every size. ``emulate`` records no graph: replays run ``_body`` eagerly on the same
        static buffers, which lets the CPU test suite exercise all the padding/copy logic of replays."""
        self.graphs = {size: True for size in self.sizes}
        if emulate:
            return
        # Largest first, sharing one memory pool: smaller graphs reuse the big one's blocks.
        with no_collection_during_capture():
            for size in reversed(self.sizes):
                rows = self._rows(size)
                self.is_padding[:size].fill_(True)
                self.req_index[:size].fill_(rows)
                graph = capture_graph(lambda size=size: self._body(size), self.pool)
                self.pool = graph.pool()
                self._captured[size] = graph

    def pick(self, num_tokens: int, max_query_len: int) -> int | None:
        if max_query_len > self.qlen:
            return None
        for size in self.sizes:
            if size >= num_tokens and size in self.graphs:
                return size
        return None

    def run(
        self, ids: Tensor, positions: Tensor, req_index: Tensor, is_padding: Tensor, query_start_pos: Tensor,
        block_tables: Tensor, max_query_len: int, max_kv_len: int,
    ) -> Tensor:
        num_tokens = ids.shape[0]
        num_reqs = query_start_pos.shape[0]
        size = self.pick(num_tokens, max_query_len)
        if size is None:
            return self.fallback(
                ids, positions, req_index, is_padding, query_start_pos, block_tables, max_query_len, max_kv_len
            )
        rows = self._rows(size)
        self.ids[:num_tokens].copy_(ids)
        self.positions[:num_tokens].copy_(positions)
        # Rows owned by "request R" (varlen tail padding) move to the graph's scratch bucket ``rows``.
        self.req_index[:num_tokens].copy_(torch.where(req_index >= num_reqs, rows, req_index))
        self.is_padding[:num_tokens].copy_(is_padding)
        self.ids[num_tokens:size].zero_()
        self.positions[num_tokens:size].zero_()
        self.req_index[num_tokens:size].fill_(rows)
        self.is_padding[num_tokens:size].fill_(True)
        self.query_start_pos[:num_reqs].copy_(query_start_pos)
        self.query_start_pos[num_reqs:rows].zero_()
        width = block_tables.shape[1]
        self.block_tables[:num_reqs, :width].copy_(block_tables)
        self.block_tables[num_reqs:rows].fill_(SCRATCH_BLOCK)
        graph = self._captured.get(size)
        if graph is None:  # emulated (CPU tests)
            return self._body(size)[:num_tokens]
        graph.replay()
        return self.out[:num_tokens]


class _DraftLoopGraphs:
    """The K-token draft loop (after the catch-up pass) as one CUDA graph per padded request count.

    Input: the final-normed hidden state that yields draft 1 per request, the position of draft 1 and the
    block tables. The body runs K times LM head -> draw -> confidence and K - 1 one-token draft forwards,
    so a replay replaces ~25 eager launches per draft token with a few ``copy_`` and one ``replay()``.
    Padding requests (rows ``>= R`` of a bucket) are marked from one device scalar (``num_real``): their
    tokens write to the scratch slot and own no query rows, exactly like the step graphs' padding.

    Two families: greedy (argmax) and ``sampling`` (a batch where some request samples). The sampling body
    also takes per-request temperatures and the K uniforms of each request, and keeps every draft's
    distribution ``[R, K, V]`` for the rejection sampler -- the same ``Drafter.draw`` the eager loop runs,
    so a replay draws exactly the eager loop's tokens. Measured on the H200 before it existed: the eager
    sampling loop cost 1.6-1.9x the greedy replay (a T=1 draft pass of 11.6 ms against 7.2 at 64 requests).
    """

    def __init__(
        self, drafter: Drafter, fwd: _Forward, sizes: list[int], num_spec: int, max_blocks: int,
        device: torch.device, dtype: torch.dtype, pool: object | None, sampling: bool = False,
        vocab_size: int = 0,
    ) -> None:
        self.drafter = drafter
        self.fwd = fwd
        self.sizes = sorted(sizes)
        self.k = num_spec
        self.kv_len = max_blocks * fwd.block_size
        top = self.sizes[-1]
        hidden = drafter.model.args.hidden_size
        self.h = torch.zeros(top, hidden, dtype=dtype, device=device)
        self.next_pos = torch.zeros(top, dtype=torch.int64, device=device)
        self.block_tables = torch.full((top, max_blocks), SCRATCH_BLOCK, dtype=torch.int64, device=device)
        self.num_real = torch.zeros((), dtype=torch.int64, device=device)
        self.arange = torch.arange(top, dtype=torch.int64, device=device)
        # Outputs outside the graph pool: the verify replay that follows must not overwrite the drafts.
        self.tokens_out = torch.zeros(top, num_spec, dtype=torch.int64, device=device)
        self.conf_out = torch.zeros(top, num_spec, dtype=torch.float32, device=device)
        self.temperature = self.uniforms = self.probs_out = None
        if sampling:
            self.temperature = torch.zeros(top, dtype=torch.float32, device=device)  # padding rows: greedy
            self.uniforms = torch.zeros(top, num_spec, dtype=torch.float32, device=device)
            self.probs_out = torch.zeros(top, num_spec, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.pool = pool

    def _body(self, size: int) -> None:
        ar = self.arange[:size]
        pad = ar >= self.num_real
        req = torch.where(pad, size, ar)
        pos0 = torch.where(pad, 0, self.next_pos[:size])
        tables = self.block_tables[:size]
        h = self.h[:size]
        model = self.drafter.model
        temperature = self.temperature[:size] if self.temperature is not None else None
        tokens, confs, probs = [], [], []
        for j in range(self.k):
            logits = model.compute_logits(h)
            if temperature is None:
                tok = logits.argmax(dim=-1)
            else:
                assert self.uniforms is not None
                tok, p = self.drafter.draw(logits, temperature, self.uniforms[:size, j])
                probs.append(p)
            tokens.append(tok)
            confs.append(self.drafter._confidence(h, logits, tok))
            if j + 1 == self.k:
                break
            pos = pos0 + j
            qstart = torch.where(pad, 0, pos)
            h = self.fwd.run(tok, pos, req, pad, qstart, tables, 1, self.kv_len, captured=True)
        self.tokens_out[:size].copy_(torch.stack(tokens, dim=1))
        self.conf_out[:size].copy_(torch.stack(confs, dim=1))
        if self.probs_out is not None:
            self.probs_out[:size].copy_(torch.stack(probs, dim=1))

    @torch.inference_mode()
    def capture(self, emulate: bool = False) -> None:
        if emulate:
            self.graphs = {size: None for size in self.sizes}
            return
        with no_collection_during_capture():
            for size in reversed(self.sizes):
                self.num_real.fill_(0)  # capture with every row padding: warm-up writes only the scratch slot
                graph = capture_graph(lambda size=size: self._body(size), self.pool)
                self.pool = graph.pool()
                self.graphs[size] = graph

    def run(
        self, h: Tensor, next_pos: Tensor, block_tables: Tensor, temperature: Tensor | None = None,
        uniforms: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Drafts and raw confidences ``[R, K]`` (and, sampling, the draft distributions ``[R, K, V]``); None
        when no captured size holds ``R`` (the caller runs the eager loop)."""
        num_reqs = h.shape[0]
        size = next((s for s in self.sizes if s >= num_reqs and s in self.graphs), None)
        if size is None:
            return None
        self.h[:num_reqs].copy_(h)
        self.next_pos[:num_reqs].copy_(next_pos)
        width = block_tables.shape[1]
        self.block_tables[:num_reqs, :width].copy_(block_tables)
        self.block_tables[num_reqs:size].fill_(SCRATCH_BLOCK)
        self.num_real.fill_(num_reqs)
        if self.temperature is not None:
            assert self.uniforms is not None and temperature is not None and uniforms is not None
            self.temperature[:num_reqs].copy_(temperature)
            self.temperature[num_reqs:size].zero_()
            self.uniforms[:num_reqs].copy_(uniforms)
        graph = self.graphs[size]
        if graph is None:  # emulated (CPU tests)
            self._body(size)
        else:
            graph.replay()
        probs = self.probs_out[:num_reqs] if self.probs_out is not None else None
        return self.tokens_out[:num_reqs], self.conf_out[:num_reqs], probs


def kv_pool_budget(free: int, share: float, step_reserve: int) -> int:
    """Bytes the KV pool may take: ``share`` of the ``free`` device memory, but never what the largest step
    needs beside it (``step_reserve``); negative where even that does not fit."""
    return min(int(free * share), free - step_reserve)


def step_reserve_bytes(
    *, max_num_seqs: int, num_spec: int, vocab_size: int, batched_tokens: int, hidden_size: int,
    intermediate_size: int, dtype_bytes: int, cuda_graphs: bool, drafts: bool,
) -> int:
    """Device memory the largest step may hold beside the weights and the KV pool, in bytes.

    Vocabulary-wide buffers dominate: a verify step's logits over ``max_num_seqs * (K + 1)`` rows (the lm_head's
    16-bit output and its float32 copy), the sampler's buffers over one row per request (the rejection kernels
    keep theirs per tile), a drafting step's float32 draft distributions ``[R, K, V]`` and one draft step's
    log-softmax beside them; then a prefill's activations over ``batched_tokens`` (the residual, attention and MLP
    projections), once more for the CUDA graphs' pool. Times ``STEP_RESERVE_MARGIN``. Served on an H100 with an
    8B-shaped target at 256 requests (docs/PERFORMANCE.md section 44): 4.07 GiB at K=7 against 3.95 before the
    margin, 1.60 GiB without drafting against 1.56.
    """
    rows = max_num_seqs * (num_spec + 1)
    reserve = rows * vocab_size * (dtype_bytes + 4) + max_num_seqs * vocab_size * SAMPLER_BYTES_PER_LOGIT
    if drafts and num_spec > 0:
        reserve += max_num_seqs * vocab_size * 4 * num_spec + max_num_seqs * vocab_size * 8
    activations = batched_tokens * (4 * hidden_size + 3 * intermediate_size) * dtype_bytes
    reserve += activations * (2 if cuda_graphs else 1)
    return int(reserve * STEP_RESERVE_MARGIN)


class ModelRunner:
    def __init__(self, config: EngineConfig, target_path: Path, draft_path: Path | None,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.num_spec = config.num_speculative_tokens if draft_path is not None else 0
        # Positions a request may touch: its max length plus the K-token lookahead of a verify step.
        self.max_positions = config.max_model_len + self.num_spec + 1
        self.max_blocks_per_seq = -(-self.max_positions // self.block_size)
        models = (target_path, draft_path) if self.num_spec > 0 else (target_path,)
        head_dims = tuple(read_llama_args(path).head_dim for path in models)
        trained = read_llama_args(target_path).max_position_embeddings
        if config.max_model_len > trained:
            # Positions past the trained range decode on silently, and worse (vLLM refuses them too).
            raise DsparkError(f"max_model_len={config.max_model_len} is more than the model's "
                              f"max_position_embeddings={trained}; pass --max-model-len {trained} or less")
        self.backend: AttentionBackend = get_backend(config.attention_backend, device, dtype, head_dims)

        self.target = load_llama(target_path, self.backend, self.max_positions, dtype, device)
        self.vocab_size = self.target.args.vocab_size
        self.drafter: Drafter | None = None
        draft_model: LlamaForCausalLM | None = None
        conf_head = None
        if draft_path is not None and self.num_spec > 0:
            # A `random:` draft has no weight files (and so no confidence head).
            draft_tensors = {} if random_init_spec(draft_path) is not None else read_safetensors(draft_path)
            draft_model = load_llama(draft_path, self.backend, self.max_positions, dtype, device, draft_tensors)
            if draft_model.args.vocab_size != self.vocab_size:
                raise DsparkError(
                    f"{draft_path}: draft vocabulary {draft_model.args.vocab_size} differs from the target's "
                    f"{self.vocab_size}; the draft must share the target's tokenizer"
                )
            conf_head = load_confidence_head(draft_tensors, draft_model.args.hidden_size, device, str(draft_path))
            del draft_tensors

        self.step_reserve = 0  # bytes kept free for the largest step (CUDA pools sized by a share only)
        self.num_blocks = self._num_kv_blocks(draft_model)
        self._log_kv_pool()
        self.target_fwd = _Forward(
            self.target, self.target.allocate_kv_cache(self.num_blocks, self.block_size, dtype, device), self.block_size
        )
        self.draft_fwd: _Forward | None = None
        if draft_model is not None:
            self.draft_fwd = _Forward(
                draft_model, draft_model.allocate_kv_cache(self.num_blocks, self.block_size, dtype, device),
                self.block_size,
            )
        # What the steps allocate beyond this is their working memory (the GPU test of step_reserve_bytes).
        self.memory_with_pool = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

        self._warm_up_attention()
        self.use_graphs = device.type == "cuda" and config.cuda_graphs
        self.capture_sizes: list[int] = []
        self._verify_graphs: _GraphedForward | None = None
        self._plain_graphs: _GraphedForward | None = None  # drafting servers: one query row a request
        self._catchup_graphs: _GraphedForward | None = None
        self._step_graphs: _GraphedForward | None = None
        self._prefill_graphs: _GraphedForward | None = None  # ragged: the target's prefills
        self._draft_ragged_graphs: _GraphedForward | None = None  # ragged: draft prefills, long catch-ups
        self._prefill_fn: ForwardFn = self.target_fwd.run
        self._loop_graphs: _DraftLoopGraphs | None = None
        self._sampling_loop_graphs: _DraftLoopGraphs | None = None
        verify_fn = self.target_fwd.run
        catchup_fn = self.draft_fwd.run if self.draft_fwd else None
        step_fn = catchup_fn
        if self.use_graphs:
            verify_fn, catchup_fn, step_fn = self._capture_graphs()
        self._verify_fn = verify_fn
        self._draft_model = draft_model
        self._conf_head = conf_head
        if self.draft_fwd is not None:
            self.drafter = self._new_drafter(catchup_fn, step_fn)
            if self.use_graphs:
                self._capture_loop_graphs()

    def _warm_up_attention(self) -> None:
        """Compile every attention variant now: eager forwards (prefills, a long catch-up after a saturation
        pause) pick their kernel variant by shape, and a first use inside serving stalls that step."""
        start = time.perf_counter()
        compiled = 0
        shapes = set()  # a draft of the target's width shares its kernels: warm them once
        for fwd in (self.target_fwd, self.draft_fwd):
            if fwd is None:
                continue
            args = fwd.model.args
            k_cache, v_cache = fwd.kv[0]
            shape = (args.num_heads, args.head_dim, tuple(k_cache.shape[1:]), k_cache.dtype)
            if shape not in shapes:
                shapes.add(shape)
                compiled += self.backend.warm_up(args.num_heads, args.head_dim, k_cache, v_cache,
                                                 self.max_blocks_per_seq)
        if compiled:
            log.info("attention kernels ready (%s): %d variants in %.1f s", self.backend.name, compiled,
                     time.perf_counter() - start)

    def emulate_graphs(self) -> None:
        """Route decode-time forwards through the graph families' static buffers without capturing
        (CPU testing of the replay path: padded sizes, scratch rows, buffer reuse)."""
        verify_fn, catchup_fn, step_fn = self._capture_graphs(emulate=True)
        self._verify_fn = verify_fn
        if self.draft_fwd is not None:
            self.drafter = self._new_drafter(catchup_fn, step_fn)
            self._capture_loop_graphs(emulate=True)

    def _new_drafter(self, catchup_fn: ForwardFn | None, step_fn: ForwardFn | None) -> Drafter:
        """The drafter over the loaded draft model; in synthetic mode (speed studies) the same draft pass with
        drawn confidences and acceptance (synthetic.py), seeded by the spec's seed or the engine's."""
        assert self._draft_model is not None and catchup_fn is not None
        spec = self.config.synthetic
        if spec is None:
            return Drafter(self._draft_model, self._conf_head, catchup_fn, step_fn)
        seed = self.config.seed if spec.seed is None else spec.seed
        return SyntheticDrafter(self._draft_model, self._conf_head, catchup_fn, step_fn, spec, self.num_spec,
                                self.device, seed)

    def _capture_loop_graphs(self, emulate: bool = False) -> None:
        assert self.drafter is not None and self.draft_fwd is not None
        pool = self._step_graphs.pool if self._step_graphs is not None else None
        sizes = capture_sizes_for(self.config.max_num_seqs)
        self._loop_graphs = _DraftLoopGraphs(
            self.drafter, self.draft_fwd, sizes, self.num_spec, self.max_blocks_per_seq, self.device, self.dtype, pool,
        )
        self._loop_graphs.capture(emulate)
        self.drafter.loop_fn = self._loop_graphs.run
        self._sampling_loop_graphs = _DraftLoopGraphs(
            self.drafter, self.draft_fwd, sizes, self.num_spec, self.max_blocks_per_seq, self.device, self.dtype,
            self._loop_graphs.pool, sampling=True, vocab_size=self.vocab_size,
        )
        try:
            self._sampling_loop_graphs.capture(emulate)
        except RuntimeError as exc:  # e.g. out of memory for [R, K, V] distributions: the eager loop still works
            log.warning("sampling draft loop not captured (%s); sampling batches draft eagerly", exc)
            self._sampling_loop_graphs = None
            return
        self.drafter.sampling_loop_fn = self._sampling_loop_graphs.run

    # ------------------------------------------------------------------------------------------ sizing

    def _num_kv_blocks(self, draft_model: LlamaForCausalLM | None) -> int:
        cfg = self.config
        per_block = self.target.kv_bytes_per_block(self.block_size, self.dtype)
        if draft_model is not None:
            per_block += draft_model.kv_bytes_per_block(self.block_size, self.dtype)
        min_blocks = self.max_blocks_per_seq + 1  # one full-length request + the scratch block
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        else:
            wanted = cfg.max_num_seqs * self.max_blocks_per_seq + 1
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                # The share never takes what the largest step needs beside the pool: where the pool is not capped
                # by --max-num-seqs x --max-model-len, a share near 1 left the first full step nothing to run in
                # (vLLM's profiling run keeps that memory back). Another process's later steps it cannot see: two
                # servers on one card must leave room for each other (PERFORMANCE.md section 43).
                self.step_reserve = self._step_reserve_bytes(draft_model)
                budget = kv_pool_budget(free, cfg.gpu_memory_utilization, self.step_reserve)
            else:
                budget = CPU_KV_BUDGET_BYTES
            blocks = max(min(wanted, budget // per_block), min(min_blocks, wanted))
        if blocks < min_blocks:
            raise DsparkError(
                f"KV pool of {blocks} blocks cannot hold one request of max_model_len={cfg.max_model_len} "
                f"(needs {min_blocks}); lower --max-model-len"
                + (" or --max-num-seqs, or free GPU memory (the pool takes a share of what is free, less "
                   f"{self.step_reserve / GIB:.1f} GiB kept for the largest step)" if self.device.type == "cuda" else "")
            )
        return blocks

    def _step_reserve_bytes(self, draft_model: LlamaForCausalLM | None) -> int:
        """What the largest step may allocate beside the pool (weights are already loaded). See
        ``step_reserve_bytes``; an estimate from the shapes, since the pool must be sized before any step can
        run (the graphs capture its tensors)."""
        cfg = self.config
        args = self.target.args
        return step_reserve_bytes(
            max_num_seqs=cfg.max_num_seqs, num_spec=self.num_spec, vocab_size=self.vocab_size,
            batched_tokens=cfg.batched_token_limit, hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size, dtype_bytes=self.dtype.itemsize,
            cuda_graphs=cfg.cuda_graphs, drafts=draft_model is not None,
        )

    def _log_kv_pool(self) -> None:
        """Say how many full-length requests the pool holds, and warn where that is fewer than
        ``max_num_seqs``: then the scheduler admits fewer requests than asked near the end of their lives, and a
        server reads slower at that load for want of memory, not of speed. Two 8B-shaped servers sharing an
        80 GB GPU gave the second 5,656 blocks where 256 requests of 512 tokens need 8,193: it ran 11-14%
        below its twin at 256 requests (docs/PERFORMANCE.md section 43)."""
        cfg = self.config
        per_request = self.max_blocks_per_seq  # a request of max_model_len tokens
        fits = (self.num_blocks - 1) // per_request  # block 0 is scratch
        held = f"{fits} request{'' if fits == 1 else 's'} of max_model_len={cfg.max_model_len}"
        kept = f"; {self.step_reserve / GIB:.1f} GiB kept free for the largest step" if self.step_reserve else ""
        log.info("KV pool: %d blocks of %d tokens, %s at once%s", self.num_blocks, self.block_size, held, kept)
        if fits < cfg.max_num_seqs:
            log.warning("the KV pool holds %s, fewer than --max-num-seqs %d: raise --gpu-memory-utilization, lower "
                        "--max-model-len, or free GPU memory", held, cfg.max_num_seqs)

    # ------------------------------------------------------------------------------------------ graphs

    def _capture_graphs(self, emulate: bool = False) -> tuple[ForwardFn, ForwardFn | None, ForwardFn | None]:
        cfg = self.config
        k = self.num_spec
        max_verify = cfg.max_capture_size or (k + 1) * cfg.max_num_seqs
        self.capture_sizes = sorted(set(cfg.capture_sizes)) if cfg.capture_sizes else capture_sizes_for(max_verify)
        pool = None
        self._verify_graphs = _GraphedForward(
            self.target_fwd, self.capture_sizes, cfg.max_num_seqs, k + 1, self.max_blocks_per_seq, self.device, pool
        )
        self._verify_graphs.capture(emulate)
        pool = self._verify_graphs.pool
        verify_fn: ForwardFn = self._verify_graphs.run
        if k > 0:
            # Paused and plain steps feed one token a request. On the verify family they would run attention over
            # K + 1 query rows a request, K of them empty: at 256 requests of an 8B-shaped target a paused step
            # waited 0.2-0.3 ms longer on the device than a no-speculation server's step (docs/PERFORMANCE.md section
            # 44). A family of one query row serves them as a server without a draft does; batches with drafts
            # fall back to the verify family (pick refuses a longer query).
            self._plain_graphs = _GraphedForward(
                self.target_fwd, capture_sizes_for(cfg.max_num_seqs), cfg.max_num_seqs, 1, self.max_blocks_per_seq,
                self.device, pool,
            )
            self._plain_graphs.capture(emulate)
            self._plain_graphs.fallback = self._verify_graphs.run
            pool = self._plain_graphs.pool
            verify_fn = self._plain_graphs.run
        catchup_fn = step_fn = None
        if self.draft_fwd is not None:
            self._catchup_graphs = _GraphedForward(
                self.draft_fwd, self.capture_sizes, cfg.max_num_seqs, k + 1, self.max_blocks_per_seq, self.device,
                pool,
            )
            self._catchup_graphs.capture(emulate)
            pool = self._catchup_graphs.pool
            self._step_graphs = _GraphedForward(
                self.draft_fwd, capture_sizes_for(cfg.max_num_seqs), cfg.max_num_seqs, 1, self.max_blocks_per_seq,
                self.device, pool,
            )
            self._step_graphs.capture(emulate)
            pool = self._step_graphs.pool
            catchup_fn = self._catchup_graphs.run
            step_fn = self._step_graphs.run
        if emulate or self.backend.name != "torch":
            self._capture_ragged_graphs(pool, emulate)
        if not emulate:
            log.info("captured CUDA graphs for verify sizes %s", self.capture_sizes)
        return verify_fn, catchup_fn, step_fn

    def _capture_ragged_graphs(self, pool: object | None, emulate: bool) -> None:
        """The ragged families (module docstring): the target's prefills, and the draft's prefills and long
        catch-ups behind its K + 1 catch-up family."""
        cfg = self.config
        sizes = ragged_capture_sizes(min(cfg.batched_token_limit, RAGGED_MAX_TOKENS))
        start = time.perf_counter()
        self._prefill_graphs = _GraphedForward(
            self.target_fwd, sizes, cfg.max_num_seqs, self.max_positions, self.max_blocks_per_seq, self.device, pool
        )
        self._prefill_graphs.capture(emulate)
        self._prefill_fn = self._prefill_graphs.run
        if self.draft_fwd is not None and self._catchup_graphs is not None:
            self._draft_ragged_graphs = _GraphedForward(
                self.draft_fwd, sizes, cfg.max_num_seqs, self.max_positions, self.max_blocks_per_seq, self.device,
                self._prefill_graphs.pool,
            )
            self._draft_ragged_graphs.capture(emulate)
            self._catchup_graphs.fallback = self._draft_ragged_graphs.run
        if not emulate:
            log.info("captured ragged (prefill) graphs for %d token counts up to %d in %.1f s", len(sizes), sizes[-1],
                     time.perf_counter() - start)

    # ------------------------------------------------------------------------------------------ batches

    def _kv_len(self, max_position: int) -> int:
        """Keys the eager torch backend gathers: up to the largest position written, in whole blocks."""
        return min(-(-(max_position + 1) // self.block_size), self.max_blocks_per_seq) * self.block_size

    def block_tables(self, seqs: list[Sequence]) -> Tensor:
        return self._to_device(torch.from_numpy(self._host_tables(seqs)))

    def _host_tables(self, seqs: list[Sequence]) -> np.ndarray:
        table = np.full((len(seqs), self.max_blocks_per_seq), SCRATCH_BLOCK, dtype=np.int64)
        for i, seq in enumerate(seqs):
            table[i, : len(seq.block_table)] = seq.block_table
        return table

    def decode_inputs(self, seqs: list[Sequence], extra: list[np.ndarray] | None = None) -> tuple[Tensor, list[Tensor]]:
        """Block tables ``[R, max_blocks]`` and per-request int64 rows (``start_pos``, ``last_tokens`` and
        any ``extra[i]`` of length R) on the device, packed into one host array and one copy."""
        n = len(seqs)
        width = self.max_blocks_per_seq
        cols = [np.fromiter((s.num_tokens - 1 for s in seqs), dtype=np.int64, count=n),
                np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=n), *(extra or [])]
        # Flat and field-major, so every device view is dense: kernels index these with unit strides. Every
        # view starts on a 16-byte boundary: Triton compiles a kernel variant per pointer alignment, so odd
        # batch sizes would otherwise compile the layout kernel again in the middle of serving.
        table_len = n * width + (n * width) % 2
        stride = n + n % 2
        packed = np.zeros(table_len + stride * len(cols), dtype=np.int64)
        packed[: n * width] = self._host_tables(seqs).reshape(-1)
        for i, col in enumerate(cols):
            packed[table_len + stride * i : table_len + stride * i + n] = col
        dev = self._to_device(torch.from_numpy(packed))
        views = [dev[table_len + stride * i : table_len + stride * i + n] for i in range(len(cols))]
        return dev[: n * width].view(n, width), views

    def _to_device(self, t: Tensor) -> Tensor:
        """A host tensor on the device: itself on a CPU, else an asynchronous copy through pinned memory.

        A pinned buffer that lived as long as the runner was tried instead of ``pin_memory()`` per copy and
        measured no faster on the H200 (``benchmarks/prepare_step.py``: 0.52 against 0.54 ms for a 256-request
        batch at max_model_len 4096, of which 0.32 ms is the host packing), so the simple path stays.
        """
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------------------------------ forwards

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], draft: bool = True) -> Tensor:
        """Target (and, with ``draft``, draft) KV for every token of each sequence; returns last-token logits
        ``[R, V]``. Without ``draft`` the draft's KV is left for its catch-up to feed."""
        ids: list[int] = []
        positions: list[int] = []
        req: list[int] = []
        starts: list[int] = []
        last: list[int] = []
        for i, seq in enumerate(seqs):
            start = seq.num_computed_tokens
            toks = seq.token_ids[start:]
            ids.extend(toks)
            positions.extend(range(start, seq.num_tokens))
            req.extend([i] * len(toks))
            starts.append(start)
            last.append(len(ids) - 1)
        max_q = max(seq.num_tokens - seq.num_computed_tokens for seq in seqs)
        kv_len = self._kv_len(max(seq.num_tokens for seq in seqs) - 1)
        t_ids = self._to_device(torch.tensor(ids, dtype=torch.int64))
        t_pos = self._to_device(torch.tensor(positions, dtype=torch.int64))
        t_req = self._to_device(torch.tensor(req, dtype=torch.int64))
        t_start = self._to_device(torch.tensor(starts, dtype=torch.int64))
        t_last = self._to_device(torch.tensor(last, dtype=torch.int64))
        tables = self.block_tables(seqs)
        no_pad = torch.zeros_like(t_ids, dtype=torch.bool)
        hidden = self._prefill_fn(t_ids, t_pos, t_req, no_pad, t_start, tables, max_q, kv_len)
        if self.drafter is not None and draft:
            self.drafter.prefill(t_ids, t_pos, t_req, t_start, tables, max_q, kv_len)
        return self.target.compute_logits(hidden[t_last])

    @staticmethod
    def _pack_feed(
        seqs: list[Sequence], starts: np.ndarray, counts: np.ndarray, tail: int, to_end: bool = False
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Tokens ``token_ids[starts[i] : starts[i] + counts[i]]`` of each sequence, request-major, as one int64
        array ``[ids | positions | owning request | tail slots]`` (the tail left for the caller) for one copy.
        ``to_end``: every slice runs to the sequence's end. Returns the array, each request's exclusive end
        row, and the token total."""
        total = int(counts.sum())
        packed = np.empty(3 * total + tail, dtype=np.int64)
        ids = packed[:total]
        if to_end and total == len(seqs):
            ids[:] = [seq.token_ids[-1] for seq in seqs]  # the common case: one token each, the last one
        else:
            ids[:] = [t for seq, s0, n in zip(seqs, starts.tolist(), counts.tolist(), strict=True)
                      for t in seq.token_ids[s0 : s0 + n]]
        ends = np.cumsum(counts)
        req = np.repeat(np.arange(len(seqs), dtype=np.int64), counts)
        packed[total : 2 * total] = starts[req] + np.arange(total) - (ends - counts)[req]
        packed[2 * total : 3 * total] = req
        return packed, ends, total

    def _catchup_inputs(
        self, seqs: list[Sequence], tables: Tensor, temperature: Tensor | None, uniforms: Tensor | None
    ) -> DraftInputs:
        """Every token the draft has not fed yet (``token_ids[num_draft_computed:]``), request-major, as one
        packed host array and one copy."""
        counts = np.fromiter((s.num_tokens - s.num_draft_computed for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.num_draft_computed for s in seqs), dtype=np.int64, count=len(seqs))
        num_reqs = len(seqs)
        packed, ends, total = self._pack_feed(seqs, starts, counts, 3 * num_reqs, to_end=True)
        tail = packed[3 * total :].reshape(3, num_reqs)
        tail[0] = ends - 1
        tail[1] = starts
        tail[2] = starts + counts
        dev = self._to_device(torch.from_numpy(packed))
        dev_tail = dev[3 * total :].view(3, num_reqs)
        max_catchup = int(counts.max())
        return DraftInputs(
            catchup_ids=dev[:total],
            catchup_positions=dev[total : 2 * total],
            catchup_req=dev[2 * total : 3 * total],
            catchup_last=dev_tail[0],
            catchup_start=dev_tail[1],
            next_pos=dev_tail[2],
            block_tables=tables,
            temperature=temperature,
            uniforms=uniforms,
            max_catchup=max_catchup,
            max_kv_len=self._kv_len(int(tail[2].max()) + self.num_spec),
        )

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], tables: Tensor, temperature: Tensor | None, uniforms: Tensor | None
    ) -> DraftOutput:
        """K drafts per sequence; the catch-up feeds ``token_ids[num_draft_computed:]`` first."""
        assert self.drafter is not None
        if self._catchup_graphs is not None:
            self._feed_long_gaps(seqs, tables)
        return self.drafter.propose(self._catchup_inputs(seqs, tables, temperature, uniforms), self.num_spec)

    def _feed_long_gaps(self, seqs: list[Sequence], tables: Tensor) -> None:
        """Bring every request within ``K + 1`` unfed tokens of its end, in rounds the catch-up graphs replay.

        After drafting was paused a request may be G tokens ahead of its draft. One catch-up pass over those
        gaps is a batch no K + 1 graph holds (up to G query rows per request), so it ran eagerly: a
        launch per kernel of the draft model, and -- a shape of its own each time -- new attention-kernel
        compiles in the middle of serving. Instead, each round feeds up to ``K + 1`` tokens of every request
        still more than ``K + 1`` behind (never its last ``K + 1``, which the proposal's own catch-up feeds
        so that its outputs give draft 1), as a replay of the catch-up graph. The draft's KV and frontier
        (``num_draft_computed``) end where the single pass would have left them.

        No rounds where the draft's ragged family holds the whole catch-up: the proposal's own catch-up is
        then one replay of it, which beats a replay per ``K + 1`` tokens of the longest gap. The rounds serve
        catch-ups past its largest size, and engines without it (the torch backend).
        """
        q = self.num_spec + 1
        pending = np.fromiter((s.num_tokens - s.num_draft_computed for s in seqs), dtype=np.int64, count=len(seqs))
        if pending.max(initial=0) <= q:
            return
        ragged = self._draft_ragged_graphs
        if ragged is not None and ragged.pick(int(pending.sum()), 1) is not None:
            return
        fwd = self._catchup_graphs
        assert fwd is not None
        while pending.max(initial=0) > q:
            rows = np.flatnonzero(pending > q)
            behind = [seqs[i] for i in rows]
            feed = np.minimum(q, pending[rows] - q)
            starts = np.fromiter((seq.num_draft_computed for seq in behind), dtype=np.int64, count=len(rows))
            packed, _, total = self._pack_feed(behind, starts, feed, 2 * len(rows))
            packed[3 * total : 3 * total + len(rows)] = starts
            packed[3 * total + len(rows) :] = rows
            dev = self._to_device(torch.from_numpy(packed))
            sub_tables = tables.index_select(0, dev[3 * total + len(rows) :])
            no_pad = torch.zeros(total, dtype=torch.bool, device=self.device)
            fwd.run(dev[:total], dev[total : 2 * total], dev[2 * total : 3 * total], no_pad,
                    dev[3 * total : 3 * total + len(rows)], sub_tables, q, self._kv_len(int((starts + feed).max())))
            for seq, n in zip(behind, feed.tolist(), strict=True):
                seq.num_draft_computed += n
            pending[rows] -= feed

    @torch.inference_mode()
    def verify(self, layout: VerifyLayout, tables: Tensor, start_pos: Tensor, max_position: int) -> Tensor:
        """Target logits ``[T, V]`` (float32) for every row of the layout."""
        hidden = self._verify_fn(
            layout.input_ids, layout.positions, layout.req_index, layout.is_padding, start_pos, tables,
            layout.num_spec + 1, self._kv_len(max_position),
        )
        return self.target.compute_logits(hidden)

    def padded_size(self, num_tokens: int) -> int:
        """Token count a verify batch is padded to: the next captured size on CUDA, exact on CPU."""
        if not self.capture_sizes:
            return num_tokens
        fitting = [s for s in self.capture_sizes if s >= num_tokens]
        return min(fitting) if fitting else num_tokens

    @property
    def kv_cache_bytes(self) -> int:
        total = 0
        for fwd in (self.target_fwd, self.draft_fwd):
            if fwd is not None:
                total += sum(k.numel() * k.element_size() * 2 for k, _ in fwd.kv)
        return total
