"""FlashInfer attention planned once per captured shape (``engines/embedded/flashinfer_attention.py``).

On CPU: the FlashInfer internals the backend relies on hold in the pinned wheel's sources (``.ci/vllm_wheel.sh``
unpacks them), the planner's schedule -- transcribed from its source -- stays valid for every batch of a
captured shape, and the CSR page table equals a plain construction. On CUDA (``-m gpu``, FlashInfer installed):
the backend against the torch reference, eagerly and under CUDA-graph replays of changing ragged batches, and
an engine's captured verify forward against the same forward through the reference backend.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_cli.engines.embedded import flashinfer_attention as fa
from dspark_cli.engines.embedded.attention import TorchPagedAttention, build_attention_inputs, get_backend
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.errors import DsparkError

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(os.environ.get("DSPARK_FLASHINFER_SRC",
                          Path.home() / ".cache" / "dspark" / f"flashinfer-{fa.FLASHINFER_VERSION}-src"))
needs_src = pytest.mark.skipif(not (SRC / ".complete").exists(),
                               reason=f"FlashInfer {fa.FLASHINFER_VERSION} sources not unpacked at {SRC}: "
                                      "run .ci/vllm_wheel.sh (or set DSPARK_FLASHINFER_SRC)")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or fa.flashinfer_status() is not None,
                              reason="needs CUDA and the pinned flashinfer-python")


# -- the contract ----------------------------------------------------------------------------------------

@needs_src
@pytest.mark.parametrize("row", fa.CONTRACT, ids=lambda r: f"{Path(r.path).name}:{r.why[:40]}")
def test_contract_row_holds_in_the_pinned_wheel(row: fa.ContractRow) -> None:
    assert row.snippet in (SRC / row.path).read_text(encoding="utf-8"), row.why


@needs_src
def test_the_pinned_wheel_is_the_version_vllm_pins() -> None:
    dist = next(SRC.glob("flashinfer_python-*.dist-info"))
    assert dist.name == f"flashinfer_python-{fa.FLASHINFER_VERSION}.dist-info"
    vllm_meta = next((Path.home() / ".cache" / "dspark" / "vllm-0.33.0-src").glob("vllm-*.dist-info"), None)
    if vllm_meta is not None:  # the vLLM sources of the same script
        assert f"flashinfer-python=={fa.FLASHINFER_VERSION}" in (vllm_meta / "METADATA").read_text()


def test_ci_script_unpacks_every_contract_file() -> None:
    script = (ROOT / ".ci" / "vllm_wheel.sh").read_text()
    listed = set(re.findall(r"^\s+(flashinfer/\S+)\s*$", script, flags=re.M))
    assert {row.path for row in fa.CONTRACT} <= listed
    assert f'FLASHINFER_VERSION={fa.FLASHINFER_VERSION}' in script


def test_pyproject_extra_pins_the_same_flashinfer() -> None:
    assert f'flashinfer = ["flashinfer-python=={fa.FLASHINFER_VERSION}"]' in (ROOT / "pyproject.toml").read_text()


# -- the planner, transcribed ----------------------------------------------------------------------------

def planner_tiles(qo_indptr: list[int], row_bound: int, group: int, head_dim: int) -> tuple[int, list[int]]:
    """PrefillSplitQOKVIndptr under CUDA graphs with disable_split_kv (scheduler.cuh): the tile height and
    the request of each planned tile (``request_indices``). The contract rows pin the lines this follows."""
    batch = len(qo_indptr) - 1
    tile = fa.cta_tile_q((row_bound - batch + 1) * group, head_dim)
    requests = []
    for r in range(batch):
        packed = (qo_indptr[r + 1] - qo_indptr[r]) * group
        requests += [r] * math.ceil(packed / tile)
    return tile, requests


@st.composite
def captured_shapes(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([64, 128, 256]))
    largest = fa.MAX_TILE_ROWS if head_dim < 256 else 64
    max_query_len = draw(st.integers(1, max(1, largest // group)))
    rows = draw(st.integers(1, 300))
    tokens = draw(st.integers(rows, rows * max_query_len))
    return tokens, rows, max_query_len, group, head_dim


@settings(max_examples=300, deadline=None)
@given(shape=captured_shapes())
def test_one_plan_holds_for_every_batch_of_the_shape(shape: tuple[int, int, int, int, int]) -> None:
    tokens, rows, max_query_len, group, head_dim = shape
    plan = fa.fixed_plan(tokens, rows, max_query_len, group, head_dim)
    assert plan.qo_indptr[0] == 0 and plan.qo_indptr[-1] == tokens and len(plan.qo_indptr) == rows + 1
    assert plan.row_bound >= tokens  # the wrapper refuses a plan of more rows than its bound
    tile, requests = planner_tiles(list(plan.qo_indptr), plan.row_bound, group, head_dim)
    assert tile == plan.tile
    assert requests == list(range(rows))  # one tile per request, in order: the map no batch can change
    # Any batch of the shape has at most max_query_len rows per request (some requests empty): each request's
    # rows fit its one tile, so the planned schedule covers them whatever the split.
    assert max_query_len * group <= tile


def test_the_plan_bound_lifts_the_tile_where_the_default_would_be_too_small() -> None:
    # 16 tokens over 16 rows: FlashInfer's own bound gives a 16-row tile (one row per request, 3 heads); a
    # request of K + 1 = 8 rows x 3 heads needs 24, so the bound is raised to get a 64-row tile.
    assert fa.cta_tile_q((16 - 16 + 1) * 3, 64) == 16
    plan = fa.fixed_plan(16, 16, 8, 3, 64)
    assert plan.tile == 64 and plan.row_bound == 21
    # Draft steps (one row per request) keep the decode-shaped 16-row tile.
    assert fa.fixed_plan(16, 16, 1, 3, 64).tile == 16
    # Large verify graphs already get a tall tile from their own token count.
    assert fa.fixed_plan(2048, 256, 8, 3, 64) == fa.FixedPlan(fa.fixed_plan(2048, 256, 8, 3, 64).qo_indptr, 2048, 128)


@pytest.mark.parametrize("args, match", [
    ((64, 4, 40, 4, 128), "tallest tile"),      # 160 packed rows
    ((64, 4, 16, 8, 256), "tallest tile"),      # head_dim 256 stops at 64-row tiles
    ((4096, 8, 8, 4, 128), "more than one"),    # a captured size far above (K + 1) x rows
    ((3, 4, 1, 1, 64), "bad shape"),            # fewer tokens than rows
])
def test_shapes_one_plan_cannot_hold_are_refused(args: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fa.fixed_plan(*args)


# -- the page table --------------------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(page=st.sampled_from([1, 4, 16]), data=st.data())
def test_csr_page_table_equals_a_plain_construction(page: int, data: st.DataObject) -> None:
    width = data.draw(st.integers(1, 6))
    lens = data.draw(st.lists(st.integers(0, width * page), min_size=1, max_size=7))
    tables = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 99), min_size=width, max_size=width),
                                             min_size=len(lens), max_size=len(lens))))
    indptr = torch.full((len(lens) + 1,), -7, dtype=torch.int32)
    indices = torch.full((len(lens) * width + 1,), -7, dtype=torch.int32)
    last = torch.full((len(lens),), -7, dtype=torch.int32)
    fa.paged_kv_csr(torch.tensor(lens, dtype=torch.int32), tables, page, indptr, indices, last)
    expected_indices, expected_ptr, expected_last = [], [0], []
    for r, n in enumerate(lens):
        pages = max(1, -(-n // page))  # an empty request keeps one page holding nothing
        expected_indices += tables[r, :pages].tolist()
        expected_ptr.append(expected_ptr[-1] + pages)
        expected_last.append(n - (pages - 1) * page)
    assert indptr.tolist() == expected_ptr
    assert indices[: expected_ptr[-1]].tolist() == expected_indices
    assert last.tolist() == expected_last
    # FlashInfer's length formula gives back every request's KV length.
    assert [(int(indptr[r + 1] - indptr[r]) - 1) * page + int(last[r]) for r in range(len(lens))] == lens


# -- choosing the backend --------------------------------------------------------------------------------

def test_auto_is_the_torch_path_on_cpu_and_flashinfer_refuses_cpu() -> None:
    assert get_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(DsparkError, match="flashinfer' needs a CUDA device"):
        get_backend("flashinfer", torch.device("cpu"), torch.float32)  # the device is named first
    with pytest.raises(DsparkError, match="float16/bfloat16"):
        get_backend("flashinfer", torch.device("cuda"), torch.float32)  # refused before any CUDA call


def test_flashinfer_refuses_head_dims_its_kernels_lack() -> None:
    # FlashInfer's dispatch fails at the first forward for head dim 16 (the tiny test models'): refuse up front.
    with pytest.raises(DsparkError, match=r"head dims \(64, 128, 256\), not \[16\]; use the triton"):
        get_backend("flashinfer", torch.device("cuda"), torch.bfloat16, (64, 16))


@pytest.mark.gpu
@gpu_only
def test_auto_takes_triton_for_a_head_dim_flashinfer_lacks() -> None:
    assert get_backend("auto", torch.device("cuda"), torch.bfloat16, (16,)).name == "triton"
    assert get_backend("auto", torch.device("cuda"), torch.bfloat16, (64,)).name == "flashinfer"


def test_unknown_backend_is_one_clear_error() -> None:
    with pytest.raises(DsparkError, match="unknown attention backend 'flash'"):
        EngineConfig(attention_backend="flash").validate()


def test_flashinfer_is_neither_chosen_nor_allowed_before_compute_capability_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its query-tile rule is mirrored for SM80 and newer: an older GPU (a T4, say) takes 16-row tiles where a
    verify request needs more, and the rows past the first tile would never be written. Checked on a CPU by
    telling the selection what the device is."""
    from dspark_cli.engines.embedded import attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(fa, "flashinfer_status", lambda: None)  # as if the pinned version were installed
    monkeypatch.setattr(attention, "_triton_usable", lambda device: True)
    assert get_backend("auto", torch.device("cuda"), torch.bfloat16, (64,)).name == "triton"
    with pytest.raises(DsparkError, match="compute capability 8.0 or newer"):
        get_backend("flashinfer", torch.device("cuda"), torch.bfloat16, (64,))


def test_a_cuda_device_index_other_than_the_first_is_refused_with_the_way_to_pick_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark_cli.engines.embedded.config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(DsparkError, match="CUDA_VISIBLE_DEVICES=1 and --device cuda"):
        resolve_device("cuda:1")
    assert resolve_device("cuda:0") == torch.device("cuda:0") and resolve_device("cuda").type == "cuda"


def test_status_names_the_pinned_version_when_another_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.6.0"))
    assert fa.FLASHINFER_VERSION in (fa.flashinfer_status() or "")
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__=fa.FLASHINFER_VERSION))
    assert fa.flashinfer_status() is None


# -- on the GPU ------------------------------------------------------------------------------------------

def ragged(q_lens: list[int], ctx_lens: list[int], tokens: int, rows: int, heads: tuple[int, int, int],
           cache: tuple[torch.Tensor, torch.Tensor], width: int, seed: int) -> dict[str, torch.Tensor]:
    """One forward's tensors: ``q_lens[r]`` new rows after ``ctx_lens[r]`` cached tokens for the first
    requests of ``rows``, pages drawn at random from the cache (block 0 is scratch), tail rows padding."""
    num_heads, kv_heads, dim = heads
    k_cache, _ = cache
    page = k_cache.shape[1]
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(k_cache.shape[0] - 1, generator=g) + 1
    positions = torch.zeros(tokens, dtype=torch.int64)
    req = torch.full((tokens,), rows, dtype=torch.int64)
    pad = torch.ones(tokens, dtype=torch.bool)
    start = torch.zeros(rows, dtype=torch.int64)
    tables = torch.zeros((rows, width), dtype=torch.int64)
    t = cursor = 0
    for r, (n, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        used = -(-(c + n) // page)
        tables[r, :used] = pages[cursor:cursor + used]
        cursor += used
        positions[t:t + n] = torch.arange(c, c + n)
        req[t:t + n] = r
        pad[t:t + n] = False
        start[r] = c
        t += n
    dev = k_cache.device
    return {
        "q": torch.randn(tokens, num_heads, dim, generator=g).to(k_cache.dtype).to(dev),
        "k": torch.randn(tokens, kv_heads, dim, generator=g).to(k_cache.dtype).to(dev),
        "v": torch.randn(tokens, kv_heads, dim, generator=g).to(k_cache.dtype).to(dev),
        "positions": positions.to(dev), "req": req.to(dev), "pad": pad.to(dev), "start": start.to(dev),
        "tables": tables.to(dev),
    }


def _inputs(b: dict[str, torch.Tensor], page: int, max_query_len: int, width: int, captured: bool):  # type: ignore[no-untyped-def]
    return build_attention_inputs(b["positions"], b["req"], b["pad"], b["start"], b["tables"], page, max_query_len,
                                  width * page, captured)


def _reference(b: dict[str, torch.Tensor], cache: tuple[torch.Tensor, torch.Tensor], page: int, width: int,
               max_query_len: int) -> torch.Tensor:
    return TorchPagedAttention().forward(b["q"], b["k"], b["v"], *cache, _inputs(b, page, max_query_len, width, False),
                                         b["q"].shape[-1] ** -0.5)


SHAPES = {"smollm2": (9, 3, 64), "llama3": (32, 8, 128)}


def _replay_against_the_reference(backend: fa.FlashInferPagedAttention, batches: list[dict[str, torch.Tensor]],
                                  cache: tuple[torch.Tensor, torch.Tensor], heads: tuple[int, int, int], page: int,
                                  width: int, max_query_len: int, reference_query_len: int) -> None:
    """Capture one forward of ``batches[0]``'s shape (``max_query_len`` rows per request at most), replay it
    with every batch's tensors in turn, and compare each replay's live rows with the torch reference."""
    static = {name: t.clone() for name, t in batches[0].items()}
    out = torch.empty_like(static["q"])

    def body() -> None:
        inputs = _inputs(static, page, max_query_len, width, captured=True)
        out.copy_(backend.forward(static["q"], static["k"], static["v"], *cache, inputs, heads[2] ** -0.5))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        body()  # plans once, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        body()
    for b in batches[1:] + batches[:1]:
        for name, t in b.items():
            static[name].copy_(t)
        graph.replay()
        ref = _reference(b, cache, page, width, reference_query_len)
        live = ~b["pad"]
        torch.testing.assert_close(out[live].float(), ref[live].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_eager_forwards_match_the_reference(shape: str) -> None:
    heads = SHAPES[shape]
    page, width = 16, 80
    cache = tuple(torch.randn(600, page, heads[1], heads[2], dtype=torch.bfloat16, device="cuda") for _ in range(2))
    backend = fa.FlashInferPagedAttention(torch.device("cuda"))
    for q_lens, ctx, pad in (([1, 8, 0, 3, 5], [900, 20, 7, 1200, 0], 5), ([300, 1, 77], [0, 640, 13], 0)):
        b = ragged(q_lens, ctx, sum(q_lens) + pad, len(q_lens), heads, cache, width, seed=len(q_lens))
        out = backend.forward(b["q"], b["k"], b["v"], *cache, _inputs(b, page, max(q_lens), width, False),
                              heads[2] ** -0.5)
        ref = _reference(b, cache, page, width, max(q_lens))
        live = ~b["pad"]
        torch.testing.assert_close(out[live].float(), ref[live].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tokens, rows", [(16, 16), (64, 16)])
def test_one_plan_replays_changing_ragged_batches(shape: str, tokens: int, rows: int) -> None:
    """A captured forward (planned once) replayed with other per-request splits, lengths, pages and request
    counts: every replay equals the reference. (16, 16) is the shape where FlashInfer's own row bound would
    give one-row tiles to requests of up to 8 rows."""
    heads = SHAPES[shape]
    page, width, k1 = 16, 40, 8
    cache = tuple(torch.randn(rows * width + 1, page, heads[1], heads[2], dtype=torch.bfloat16, device="cuda")
                  for _ in range(2))
    backend = fa.FlashInferPagedAttention(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    layouts = [[1] * rows, [8, 8], [5, 1, 8], [8], [3] * (tokens // 3 if tokens // 3 <= rows else rows)]
    if tokens >= rows * 4:
        layouts.append([4] * rows)
    layouts = [q[:rows] for q in layouts if sum(q[:rows]) <= tokens]
    batches = []
    for i, q_lens in enumerate(layouts):
        ctx = torch.randint(0, (width - 1) * page - k1, (len(q_lens),), generator=gen).tolist()
        batches.append(ragged(q_lens, ctx, tokens, rows, heads, cache, width, seed=10 + i))
    _replay_against_the_reference(backend, batches, cache, heads, page, width, k1, k1)


@pytest.mark.gpu
@gpu_only
def test_engine_verify_graph_matches_the_reference_backend() -> None:
    """The runner's captured verify forward through FlashInfer against the same ragged batch run eagerly
    through the torch reference backend (SmolLM2's attention shape, random weights, two layers)."""
    from dspark_cli.engines.embedded.engine import LLMEngine
    from dspark_cli.engines.embedded.sequence import SamplingParams

    engine = LLMEngine(EngineConfig(model="random:smollm2-135m:layers=2", draft="random:small", num_speculative_tokens=7,
                                    device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=512,
                                    attention_backend="flashinfer"))
    runner = engine.runner
    assert runner.backend.name == "flashinfer" and runner._verify_graphs is not None
    for i, n in enumerate((40, 200, 9)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # prefill (FlashInfer's per-call plan)
    seqs = [s for s in engine.scheduler.running]
    tables = runner.block_tables(seqs)
    q_lens = [8, 1, 5]
    ids, pos, req, start = [], [], [], []
    for r, (seq, n) in enumerate(zip(seqs, q_lens, strict=True)):
        s0 = seq.num_tokens - n  # rewrite the last n positions' K/V (within allocated blocks)
        ids += [7 + r] * n
        pos += list(range(s0, s0 + n))
        req += [r] * n
        start.append(s0)
    dev = torch.device("cuda")
    args = [torch.tensor(x, dtype=torch.int64, device=dev) for x in (ids, pos, req)]
    no_pad = torch.zeros(len(ids), dtype=torch.bool, device=dev)
    qstart = torch.tensor(start, dtype=torch.int64, device=dev)
    kv_len = runner.max_blocks_per_seq * runner.block_size
    with torch.inference_mode():
        graphed = runner._verify_graphs.run(*args, no_pad, qstart, tables, 8, kv_len).clone()
        layers = [layer.self_attn for layer in runner.target.layers]
        saved = layers[0].backend
        try:
            for attn in layers:
                attn.backend = TorchPagedAttention()
            eager = runner.target_fwd.run(*args, no_pad, qstart, tables, 8, kv_len)
        finally:
            for attn in layers:
                attn.backend = saved
    torch.testing.assert_close(graphed.float(), eager.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_captured_forward_of_whole_prompts_replays_any_split(shape: str) -> None:
    """The model runner's ragged (prefill) graphs: a captured shape whose requests may hold more rows than one
    FlashInfer tile runs the Triton kernel, so one graph replays prompts of any lengths, as the reference."""
    heads = SHAPES[shape]
    page, width, tokens, rows = 16, 40, 320, 16
    max_rows = width * page
    assert max_rows * (heads[0] // heads[1]) > fa.tallest_tile(heads[2])
    cache = tuple(torch.randn(rows * width + 1, page, heads[1], heads[2], dtype=torch.bfloat16, device="cuda")
                  for _ in range(2))
    backend = fa.FlashInferPagedAttention(torch.device("cuda"))
    gen = torch.Generator().manual_seed(1)
    layouts = [[300, 1, 19], [128, 128, 64], [1] * rows, [317], [40] * 8]
    batches = []
    for i, q_lens in enumerate(layouts):
        ctx = torch.randint(0, 2 * page, (len(q_lens),), generator=gen).tolist()
        batches.append(ragged(q_lens, ctx, tokens, rows, heads, cache, width, seed=20 + i))
    _replay_against_the_reference(backend, batches, cache, heads, page, width, max_rows, tokens)


@pytest.mark.gpu
@gpu_only
def test_engine_prefill_graphs_match_the_eager_prefill() -> None:
    """The runner's captured ragged family against FlashInfer's eager per-call plan, on the same prompts of
    unequal lengths (SmolLM2's attention shape, random weights, two layers)."""
    from dspark_cli.engines.embedded.engine import LLMEngine
    from dspark_cli.engines.embedded.sequence import SamplingParams

    engine = LLMEngine(EngineConfig(model="random:smollm2-135m:layers=2", draft="random:small", num_speculative_tokens=7,
                                    device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=512,
                                    attention_backend="flashinfer"))
    runner = engine.runner
    assert runner._prefill_graphs is not None and runner._draft_ragged_graphs is not None
    for i, n in enumerate((40, 300, 9, 77)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # the prefill, through the graphs
    seqs = list(engine.scheduler.running)
    assert runner._prefill_graphs.pick(sum(s.num_tokens for s in seqs), max(s.num_tokens for s in seqs)) is not None

    def prefill_again() -> torch.Tensor:
        for seq in seqs:
            seq.num_computed_tokens = 0  # rewrites the same K/V
        with torch.inference_mode():
            return runner.prefill(seqs, draft=True).float().clone()

    graphed = prefill_again()
    runner._prefill_fn = runner.target_fwd.run
    eager = prefill_again()
    torch.testing.assert_close(graphed, eager, atol=5e-2, rtol=5e-2)
