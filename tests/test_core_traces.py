"""Trace JSONL: writer/reader round trip, tolerance, and file:line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_cli.core.traces import (
    TraceFormatError,
    TraceRecord,
    TraceSet,
    TraceWriter,
    read_traces,
    records_to_arrays,
)
from dspark_cli.errors import DsparkError


def test_write_batch_round_trip_numpy_and_torch(tmp_path: Path) -> None:
    path = tmp_path / "t" / "traces.jsonl"
    conf = np.array([[0.9, 0.5, 0.25], [0.1, 0.2, 0.3], [1.0, 1.0, 0.0]])
    with TraceWriter(path) as w:
        assert w.write_batch(conf, np.array([3, 1, 2]), np.array([1, 0, 2]), requests=["a", "b", "c"], step=7) == 3
        n = w.write_batch(torch.tensor(conf, dtype=torch.float32), torch.tensor([2, 2, 0]), torch.tensor([2, 1, 0]),
                          requests=torch.tensor([4, 5, 6]), step=torch.tensor([1, 2, 3]),
                          valid=torch.tensor([True, False, True]))
        assert n == 2 and w.records_written == 5
    recs, skipped = read_traces(path)
    assert skipped == 0 and len(recs) == 5
    assert recs[0] == TraceRecord(request="a", step=7, conf=[0.9, 0.5, 0.25], verified=3, accepted=1)
    assert recs[3].request == 4 and recs[3].step == 1 and recs[4].request == 6 and recs[4].step == 3
    assert recs[3].conf == pytest.approx([0.9, 0.5, 0.25], abs=1e-6)  # float32 rounded to 6 decimals
    c, v, a = records_to_arrays(recs)
    assert c.shape == (5, 3) and v.tolist() == [3, 1, 2, 2, 0] and a.tolist() == [1, 0, 2, 2, 0]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6).flatmap(lambda k: st.lists(
    st.tuples(st.lists(st.floats(0, 1), min_size=k, max_size=k), st.integers(0, k), st.integers(0, k)),
    min_size=1, max_size=20)))
def test_round_trip_property(tmp_path_factory: pytest.TempPathFactory, rows: list) -> None:
    path = tmp_path_factory.mktemp("rt") / "x.jsonl"
    recs = [TraceRecord(request=i, step=i // 3, conf=[round(x, 6) for x in c], verified=max(v, a),
                        accepted=min(v, a)) for i, (c, v, a) in enumerate(rows)]
    with TraceWriter(path) as w:
        for r in recs:
            w.write(r)
    assert read_traces([path]).records == recs


def test_writer_appends_and_flushes_each_write(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    w = TraceWriter(path)
    w.write({"conf": [0.5], "verified": 1, "accepted": 1})
    assert len(read_traces(path).records) == 1  # visible before close
    w.close()
    with pytest.raises(DsparkError, match="closed"):
        w.write({"conf": [0.5], "verified": 1, "accepted": 0})
    with TraceWriter(path) as w2:
        w2.write_batch(np.array([[0.4]]), np.array([1]), np.array([0]))
    assert [r.accepted for r in read_traces(path).records] == [1, 0]


def test_appending_after_a_cut_last_line_drops_the_fragment(tmp_path: Path) -> None:
    # A crash mid-write left half a row; the first appended row was joined onto it, losing both and leaving a bad
    # line mid-file that dspark calibrate refused.
    path = tmp_path / "traces.jsonl"
    whole = b'{"conf": [0.5], "verified": 1, "accepted": 1}\n'
    path.write_bytes(whole + whole[:20])
    with TraceWriter(path) as w:
        w.write({"conf": [0.4], "verified": 1, "accepted": 0})
    assert [r.accepted for r in read_traces(path).records] == [1, 0]
    path.write_bytes(whole[:20])  # the only row cut
    with TraceWriter(path) as w:
        w.write({"conf": [0.4], "verified": 1, "accepted": 0})
    assert [r.accepted for r in read_traces(path).records] == [0]


def test_reader_tolerates_missing_ids_extra_fields_blank_lines_and_folders(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(
        '{"conf": [0.5, 0.4], "verified": 2, "accepted": 1, "engine": "vllm", "latency_ms": 3.2}\n'
        "\n"
        '{"request": "r1", "step": 0, "conf": [1, 0], "verified": 0, "accepted": 0}\n'
    )
    (tmp_path / "b.jsonl").write_text('{"conf": [0.1, 0.2], "verified": 2, "accepted": 2}\n')
    (tmp_path / "notes.txt").write_text("not a trace")
    ts = read_traces(tmp_path)
    assert isinstance(ts, TraceSet) and ts.num_positions == 2 and ts.skipped == 0
    assert [r.request for r in ts.records] == [None, "r1", None]
    assert ts.records[0].step is None and ts.records[1].conf == [1.0, 0.0]
    conf, v, a = ts.arrays()
    assert conf.shape == (3, 2) and v.tolist() == [2, 0, 2]


BAD_LINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"verified": 1, "accepted": 0}', "'conf'"),
    ('{"conf": [], "verified": 0, "accepted": 0}', "'conf'"),
    ('{"conf": [0.5, 1.5], "verified": 1, "accepted": 0}', "[0, 1]"),
    ('{"conf": [0.5, "x"], "verified": 1, "accepted": 0}', "[0, 1]"),
    ('{"conf": [0.5, 0.5], "verified": 1, "accepted": 2}', "accepted <= verified"),
    ('{"conf": [0.5, 0.5], "verified": 3, "accepted": 0}', "verified <= K"),
    ('{"conf": [0.5, 0.5], "verified": 1, "accepted": -1}', "0 <= accepted"),
    ('{"conf": [0.5, 0.5], "verified": 1.5, "accepted": 0}', "integers"),
    ('{"conf": [0.5, 0.5], "verified": true, "accepted": 0}', "integers"),
    ('{"conf": [0.5, 0.5, 0.5], "verified": 1, "accepted": 0}', "earlier rows have 2"),
    ('{"conf": [0.5, 0.5], "verified": 1, "accepted": 0, "step": "one"}', "'step'"),
    ('{"conf": [0.5, 0.5], "verified": 1, "accepted": 0, "request": [1]}', "'request'"),
]


@pytest.mark.parametrize("line,needle", BAD_LINES)
def test_malformed_lines_name_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_text('{"conf": [0.9, 0.8], "verified": 2, "accepted": 1}\n\n' + line + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_traces(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: ") and needle in msg and "\n" not in msg
    recs, skipped = read_traces(path, skip_invalid=True)
    assert len(recs) == 1 and skipped == 1


def test_skip_invalid_counts_every_bad_line_and_keeps_order(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    good = [json.dumps({"conf": [0.5, 0.5], "verified": 2, "accepted": i % 3}) for i in range(5)]
    lines = [good[0], "garbage", good[1], '{"conf": [0.5], "verified": 1, "accepted": 0}', good[2], good[3],
             good[4][:-3]]
    path.write_text("\n".join(lines) + "\n")
    ts = read_traces(path, skip_invalid=True)
    assert ts.skipped == 3 and [r.accepted for r in ts.records] == [0, 1, 2, 0]


def test_missing_file_is_an_error_even_when_skipping(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_traces([tmp_path / "nope.jsonl"], skip_invalid=True)


def test_empty_inputs() -> None:
    conf, v, a = records_to_arrays([])
    assert conf.shape == (0, 0) and len(v) == 0 and len(a) == 0
    assert TraceSet([], 0).num_positions == 0


def test_write_batch_skips_rows_its_reader_would_refuse(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A NaN confidence (a head that overflowed) or counts outside 0 <= accepted <= verified <= K used to be
    written, and one such line made the whole file unreadable to `dspark calibrate`. Skipped rows are said, at
    the first and at every tenfold count."""
    caplog.set_level("WARNING", logger="dspark.traces")
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path)
    n = writer.write_batch(np.array([[0.9, 0.5], [np.nan, 0.2], [0.9, 0.5], [0.4, np.inf]]),
                           np.array([2, 2, 1, 1]), np.array([1, 0, 2, 0]))
    writer.write_batch(np.array([[0.9, 0.5]]), np.array([3]), np.array([0]))  # verified > K
    writer.close()
    assert n == 1 and writer.records_written == 1 and writer.rows_skipped == 4
    assert len(read_traces(path).records) == 1
    said = [r.getMessage() for r in caplog.records if r.name == "dspark.traces"]
    assert len(said) == 1 and "3 trace rows skipped so far" in said[0]


def test_write_skips_a_row_its_reader_would_refuse(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        assert w.write(TraceRecord("x", 1, [float("nan"), 0.5], 1, 0)) is False  # orjson would write null
        assert w.write({"conf": [0.5], "verified": 2, "accepted": 0}) is False  # verified > K
        assert w.write(TraceRecord("x", 2, [0.9, 0.5], 1, 1)) is True
    assert (w.records_written, w.rows_skipped) == (1, 2)
    assert [r.step for r in read_traces(path).records] == [2]


def test_write_batch_keeps_request_ids_as_given_and_reads_a_0d_step(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    conf = np.array([[0.5, 0.2], [0.9, 0.1], [0.3, 0.3]])
    with TraceWriter(path) as w:
        w.write_batch(conf, [2, 1, 0], [1, 0, 0], requests=["a", 7, np.int64(8)], step=torch.tensor(5))
        w.write_batch(conf[:1], [1], [1], requests=np.array([9]), step=np.array(6))
    records = read_traces(path).records
    assert [r.request for r in records] == ["a", 7, 8, 9]
    assert [r.step for r in records] == [5, 5, 5, 6]


def test_a_home_relative_trace_path_is_written_where_it_is_checked(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--record-traces ~/t.jsonl` was checked as $HOME/t.jsonl but appended to a literal `~` folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with TraceWriter("~/t.jsonl") as w:
        w.write({"conf": [0.5, 0.5], "verified": 1, "accepted": 1})
    assert (tmp_path / "home" / "t.jsonl").is_file() and not (tmp_path / "~").exists()


def test_skipping_does_not_let_the_first_file_pick_k_for_a_larger_other_k(tmp_path: Path) -> None:
    """--skip-invalid over a folder of two setups' traces: the file read first fixed K and the other's rows were
    "invalid lines", so which K was fitted depended on the files' names."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"conf": [0.5] * 3, "verified": 3, "accepted": 1}) + "\n")
    (tmp_path / "b.jsonl").write_text((json.dumps({"conf": [0.5] * 4, "verified": 4, "accepted": 2}) + "\n") * 5)
    with pytest.raises(TraceFormatError, match=r"a\.jsonl|b\.jsonl") as info:
        read_traces(tmp_path, skip_invalid=True)
    assert "mix K values (1 rows of K=3 read first, 5 of K=4 skipped)" in str(info.value)


def test_appending_refuses_another_k_in_the_data_parallel_ranks_files(tmp_path: Path) -> None:
    """vLLM's data-parallel ranks write traces.dpN.jsonl beside the path given: a restart with another K must be
    refused there too, or the rank files mix two K values."""
    from dspark_cli.core.traces import check_appendable

    base = tmp_path / "traces.jsonl"
    (tmp_path / "traces.dp1.jsonl").write_text(json.dumps({"conf": [0.5] * 4, "verified": 4, "accepted": 2}) + "\n")
    check_appendable(base, "--record-traces", k=4)
    with pytest.raises(DsparkError, match=r"traces\.dp1\.jsonl holds traces of K=4 and this server drafts K=5"):
        check_appendable(base, "--record-traces", k=5)
