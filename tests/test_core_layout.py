"""Verify-batch layouts: varlen rows are the concatenation of each request's admitted tokens, mask marks
exactly the pruned slots, both agree on real rows, and shapes never depend on admitted values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_cli.core.layout import PlainLayouts, build_mask_layout, build_varlen_layout, pick_padded_tokens
from dspark_cli.core.rejection import rejection_sample


@st.composite
def batches(draw: st.DrawFn) -> dict:
    num_reqs = draw(st.integers(1, 9))
    num_spec = draw(st.integers(1, 6))
    admitted = draw(st.lists(st.integers(0, num_spec), min_size=num_reqs, max_size=num_reqs))
    start = draw(st.lists(st.integers(0, 1000), min_size=num_reqs, max_size=num_reqs))
    seed = draw(st.integers(0, 2**31 - 1))
    extra = draw(st.integers(0, 7))
    gen = torch.Generator().manual_seed(seed)
    return {
        "last_tokens": torch.randint(1, 50_000, (num_reqs,), generator=gen),
        "drafts": torch.randint(1, 50_000, (num_reqs, num_spec), generator=gen),
        "admitted": torch.tensor(admitted, dtype=torch.int32),
        "start_pos": torch.tensor(start, dtype=torch.int64),
        "padded": num_reqs + sum(admitted) + extra,
    }


def _expected_rows(b: dict) -> list[tuple[int, int, int, int]]:
    """(request, pos_in_req, token, position) of every verified row, in request order."""
    rows = []
    for r in range(b["drafts"].shape[0]):
        toks = [int(b["last_tokens"][r])] + [int(x) for x in b["drafts"][r, : int(b["admitted"][r])]]
        for j, tok in enumerate(toks):
            rows.append((r, j, tok, int(b["start_pos"][r]) + j))
    return rows


def _real_rows(layout) -> list[tuple[int, int, int, int]]:
    keep = (~layout.is_padding).tolist()
    cols = zip(
        layout.req_index.tolist(), layout.pos_in_req.tolist(), layout.input_ids.tolist(),
        layout.positions.tolist(), strict=True,
    )
    return [row for row, k in zip(cols, keep, strict=True) if k]


@settings(max_examples=150, deadline=None)
@given(batches())
def test_varlen_rows_are_concatenated_admitted_tokens(b: dict) -> None:
    lay = build_varlen_layout(b["last_tokens"], b["drafts"], b["admitted"], b["start_pos"], b["padded"])
    num_reqs = b["drafts"].shape[0]
    expected = _expected_rows(b)
    real = len(expected)
    assert int(lay.num_tokens) == real
    assert lay.num_rows == b["padded"]
    # Compacted: the real rows are exactly the first num_tokens rows, in request order.
    assert lay.is_padding.tolist() == [False] * real + [True] * (b["padded"] - real)
    got = list(zip(lay.req_index.tolist(), lay.pos_in_req.tolist(), lay.input_ids.tolist(),
                   lay.positions.tolist(), strict=True))[:real]
    assert got == expected
    tail = slice(real, None)
    assert (lay.req_index[tail] == num_reqs).all()
    assert (lay.input_ids[tail] == 0).all() and (lay.positions[tail] == 0).all()
    counts = 1 + b["admitted"].to(torch.int64)
    assert lay.query_start_loc.dtype == torch.int32
    assert lay.query_start_loc.tolist() == [0] + torch.cumsum(counts, 0).tolist()
    assert lay.seq_lens.tolist() == (b["start_pos"] + counts).tolist()
    assert lay.num_logits_per_req.tolist() == counts.tolist()
    # Each request's segment in query_start_loc holds exactly its rows.
    for r in range(num_reqs):
        seg = slice(int(lay.query_start_loc[r]), int(lay.query_start_loc[r + 1]))
        assert (lay.req_index[seg] == r).all()
        assert lay.pos_in_req[seg].tolist() == list(range(int(counts[r])))


@settings(max_examples=150, deadline=None)
@given(batches())
def test_mask_marks_exactly_the_pruned_slots(b: dict) -> None:
    lay = build_mask_layout(b["last_tokens"], b["drafts"], b["admitted"], b["start_pos"])
    num_reqs, num_spec = b["drafts"].shape
    width = num_spec + 1
    assert lay.num_rows == num_reqs * width
    adm = b["admitted"].tolist()
    pad = lay.is_padding.view(num_reqs, width).tolist()
    for r in range(num_reqs):
        assert pad[r] == [j > adm[r] for j in range(width)]
        assert lay.invalid_drafts[r].tolist() == [j >= adm[r] for j in range(num_spec)]
    assert (lay.input_ids[lay.is_padding] == 0).all()
    assert lay.req_index.tolist() == [r for r in range(num_reqs) for _ in range(width)]
    assert lay.pos_in_req.tolist() == list(range(width)) * num_reqs
    assert lay.positions.view(num_reqs, width).tolist() == [
        [int(b["start_pos"][r]) + j for j in range(width)] for r in range(num_reqs)
    ]
    assert lay.seq_lens.tolist() == (b["start_pos"] + width).tolist()
    assert lay.query_start_loc.tolist() == [r * width for r in range(num_reqs + 1)]
    assert int(lay.num_tokens) == num_reqs + sum(adm)
    assert _real_rows(lay) == _expected_rows(b)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_varlen_and_mask_agree_on_real_rows(b: dict) -> None:
    var = build_varlen_layout(b["last_tokens"], b["drafts"], b["admitted"], b["start_pos"], b["padded"])
    mask = build_mask_layout(b["last_tokens"], b["drafts"], b["admitted"], b["start_pos"])
    assert _real_rows(var) == _real_rows(mask)
    assert int(var.num_tokens) == int(mask.num_tokens)
    assert var.num_logits_per_req.tolist() == mask.num_logits_per_req.tolist()


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(0, 2**31 - 1))
def test_shapes_do_not_depend_on_admitted(b: dict, seed: int) -> None:
    num_reqs, num_spec = b["drafts"].shape
    padded = num_reqs * (num_spec + 1)
    other = torch.randint(0, num_spec + 1, (num_reqs,), generator=torch.Generator().manual_seed(seed))
    shapes = []
    for adm in (b["admitted"], other, torch.zeros_like(other), torch.full_like(other, num_spec)):
        var = build_varlen_layout(b["last_tokens"], b["drafts"], adm, b["start_pos"], padded)
        mask = build_mask_layout(b["last_tokens"], b["drafts"], adm, b["start_pos"])
        shapes.append(tuple(tuple(getattr(lay, f).shape) for lay in (var, mask)
                            for f in ("input_ids", "positions", "req_index", "pos_in_req", "is_padding",
                                      "query_start_loc", "seq_lens", "num_tokens")))
    assert len(set(shapes)) == 1


def test_builders_never_read_tensor_values() -> None:
    # The meta device has shapes but no values: any .item(), boolean indexing or data-dependent shape
    # would raise here, which is the CPU-side proof that the builders are CUDA-graph capturable.
    meta = torch.device("meta")
    num_reqs, num_spec = 5, 7
    args = (
        torch.empty(num_reqs, dtype=torch.int64, device=meta),
        torch.empty(num_reqs, num_spec, dtype=torch.int64, device=meta),
        torch.empty(num_reqs, dtype=torch.int32, device=meta),
        torch.empty(num_reqs, dtype=torch.int64, device=meta),
    )
    var = build_varlen_layout(*args, padded_tokens=64)
    mask = build_mask_layout(*args)
    assert var.input_ids.shape == (64,) and var.num_tokens.shape == ()
    assert mask.input_ids.shape == (num_reqs * (num_spec + 1),)
    assert mask.invalid_drafts.shape == (num_reqs, num_spec)


def test_padding_too_small_and_bad_shapes_are_rejected() -> None:
    last = torch.zeros(4, dtype=torch.int64)
    drafts = torch.zeros(4, 3, dtype=torch.int64)
    adm = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="padded_tokens"):
        build_varlen_layout(last, drafts, adm, adm, padded_tokens=3)
    with pytest.raises(ValueError, match="admitted"):
        build_mask_layout(last, drafts, adm[:3], adm)


def test_pick_padded_tokens() -> None:
    sizes = [1, 2, 4, 8, 16, 32, 64]
    assert pick_padded_tokens(1, sizes) == 1
    assert pick_padded_tokens(5, sizes) == 8
    assert pick_padded_tokens(64, sizes) == 64
    assert pick_padded_tokens(65, sizes) == 65
    assert pick_padded_tokens(9, [32, 16]) == 16
    assert pick_padded_tokens(3, []) == 3
    with pytest.raises(ValueError):
        pick_padded_tokens(-1, sizes)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_varlen_layout_accepts_column_views_of_a_packed_batch(device: str) -> None:
    """Engines pack per-request fields into one tensor and hand column views to the layout; the fused
    kernel must read them by their strides, not as dense vectors (a unit-stride read returns neighbours)."""
    g = torch.Generator().manual_seed(3)
    num_reqs, k = 9, 4
    packed = torch.randint(0, 50, (num_reqs, 5), generator=g).to(device)  # columns: last, start, admitted, 2 others
    packed[:, 2] = torch.randint(0, k + 1, (num_reqs,), generator=g).to(device)
    drafts = torch.randint(0, 50, (num_reqs, k), generator=g).to(device)
    last, start, admitted = packed[:, 0], packed[:, 1], packed[:, 2]
    assert not last.is_contiguous()
    padded = num_reqs * (k + 1)
    got = build_varlen_layout(last, drafts, admitted, start, padded)
    want = build_varlen_layout(last.contiguous(), drafts, admitted.contiguous(), start.contiguous(), padded)
    for name in ("input_ids", "positions", "req_index", "pos_in_req", "is_padding", "query_start_loc", "seq_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_fused_layout_kernel_compiles_for_hopper_with_runtime_loop_bounds() -> None:
    """The compiled kernel (not the interpreter's while loops) builds for sm_90 without a GPU: request and row
    counts are runtime values, so one variant per K serves every batch."""
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dspark_cli.core import _triton_rejection as tr

    if tr._interpreting():
        pytest.skip("compiled-mode check")
    fn = tr._varlen_layout_kernel
    sig = dict(last_ptr="*i64", drafts_ptr="*i64", stride_dr="i32", adm_ptr="*i64", start_ptr="*i64",
               ids_ptr="*i64", pos_ptr="*i64", req_ptr="*i64", pir_ptr="*i64", pad_ptr="*u8", qsl_ptr="*i32",
               seq_ptr="*i32", nlog_ptr="*i32", ntok_ptr="*i64", num_reqs="i32", num_rows="i32")
    consts = dict(K=7, BLOCK_R=tr.LAYOUT_BLOCK_R, BLOCK_J=8, BLOCK_T=tr.LAYOUT_BLOCK_T, LOOP_WHILE=False)
    sig.update({name: "constexpr" for name in consts})
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=4))
    assert ".entry" in kernel.asm["ptx"]
    assert {"num_reqs", "num_rows"} <= {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}


class _LaunchRecorder:
    """Stands in for the compiled layout kernel: records the variant key Triton would compile each launch
    under (argument dtypes, alignment and integer specialisations, constexprs), computed by Triton itself."""

    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.fn = fn
        self.keys: set[tuple] = set()

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        def launch(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            names = self.fn.arg_names
            skip = {names[i] if isinstance(i, int) else i for i in self.fn.do_not_specialize}
            key = tuple(
                (name, str(native_specialize_impl(BaseBackend, arg, False, True, True)))
                for name, arg in zip(names, args, strict=False) if name not in skip
            )
            self.keys.add(key + tuple(sorted((k, v) for k, v in kwargs.items())))

        return launch


@settings(max_examples=60, deadline=None)
@given(batches())
def test_a_plain_layout_is_the_varlen_layout_of_no_drafts_without_its_padding(b: dict) -> None:
    """Steps that verify no draft (no speculation, paused drafting) take their layout from PlainLayouts: row r is
    request r's last token at its position, every other field what the varlen builder gives with no drafts."""
    num_reqs = b["drafts"].shape[0]
    none = torch.zeros(num_reqs, 0, dtype=torch.int64)
    want = build_varlen_layout(b["last_tokens"], none, torch.zeros(num_reqs, dtype=torch.int64), b["start_pos"],
                               b["padded"])
    layouts = PlainLayouts("cpu")
    for _ in range(2):  # the second build reads the kept per-R tensors
        got = layouts.build(b["last_tokens"], b["start_pos"])
        assert got.num_rows == num_reqs and got.num_reqs == num_reqs and got.num_spec == 0
        for name in ("input_ids", "positions", "req_index", "pos_in_req", "is_padding"):
            assert torch.equal(getattr(got, name), getattr(want, name)[:num_reqs]), name
        for name in ("query_start_loc", "seq_lens", "num_tokens", "num_logits_per_req"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.invalid_drafts is None
    with pytest.raises(ValueError, match="R >= 1"):
        layouts.build(b["last_tokens"], b["start_pos"][:0])


def test_every_serving_layout_launch_is_a_variant_the_warm_up_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton compiles a kernel variant per argument dtype, pointer alignment and integer specialisation.
    Serving hands the layout int32 or int64 counts, column views at odd offsets and one-request batches; the
    warm-up must already have compiled whatever variant those launch (on the H200 the first drafting step
    and the first paused step each compiled one inside serving)."""
    pytest.importorskip("triton")
    from dspark_cli.core import _triton_rejection as tr
    from dspark_cli.core.layout import warm_up_varlen_layout

    recorder = _LaunchRecorder(tr._varlen_layout_kernel)
    monkeypatch.setattr(tr, "_varlen_layout_kernel", recorder)
    monkeypatch.setattr(tr, "available", lambda device: True)
    k = 7
    assert warm_up_varlen_layout([k, 0, k], "cpu") == 2
    warmed = set(recorder.keys)
    assert len(warmed) == 2
    recorder.keys.clear()
    g = torch.Generator().manual_seed(0)
    for num_reqs in (1, 2, 3, 9, 256):
        for width in (k, 0):
            for adm_dtype in (torch.int32, torch.int64):
                packed = torch.randint(0, 50, (3 * num_reqs + 1,), generator=g)
                last, start = packed[1 : 1 + num_reqs], packed[1 + num_reqs : 1 + 2 * num_reqs]  # odd offsets
                drafts = torch.randint(0, 50, (num_reqs, width + 1), generator=g)[:, 1:]  # a column slice
                admitted = torch.randint(0, width + 1, (num_reqs,), generator=g).to(adm_dtype)
                for lt in (last, last.to(torch.int32), last.clone()):
                    build_varlen_layout(lt, drafts, admitted, start, num_reqs * (width + 1))
    assert recorder.keys <= warmed, recorder.keys - warmed
    assert len(recorder.keys) == 2


@pytest.mark.parametrize("builder", ["varlen", "mask"])
def test_out_of_range_admitted_counts_are_clamped_like_the_sampler_does(builder: str) -> None:
    """The rejection sampler clamps admitted to [0, K]; a layout that does not would give a request more (or fewer)
    rows than the sampler verifies."""
    last, drafts, start = torch.tensor([1, 2, 3]), torch.tensor([[4, 5], [6, 7], [8, 9]]), torch.tensor([10, 20, 30])
    wild, clamped = torch.tensor([5, -3, 1]), torch.tensor([2, 0, 1])
    if builder == "varlen":
        a = build_varlen_layout(last, drafts, wild, start, 8, use_triton=False)
        b = build_varlen_layout(last, drafts, clamped, start, 8, use_triton=False)
    else:
        a, b = build_mask_layout(last, drafts, wild, start), build_mask_layout(last, drafts, clamped, start)
    for f in ("input_ids", "positions", "req_index", "pos_in_req", "is_padding", "query_start_loc", "seq_lens",
              "num_tokens", "num_logits_per_req"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    # and the sampler, fed the layout, agrees with itself on the clamped counts
    logits = torch.randn(a.num_rows, 12, generator=torch.Generator().manual_seed(0))
    ra, rb = rejection_sample(logits, a, drafts, wild), rejection_sample(logits, b, drafts, clamped)
    assert torch.equal(ra.tokens, rb.tokens)
