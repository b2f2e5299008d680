"""The seed-shaped comparison table: cell text, Δ% against the no-capacity column, Markdown/summary files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dspark_cli.bench.plots import pareto_front, plot_matrix
from dspark_cli.bench.report import (
    build_table,
    format_cell,
    format_delta,
    numbers,
    paired_delta,
    paired_references,
    paired_rows,
    to_markdown,
    write_summary,
)
from dspark_cli.fileio import read_json


def cell(config: str, c: int, tok_s: float, itl: float | None = 10.0, acc: float | None = 1.3,
         failed: int = 0) -> dict[str, Any]:
    return {
        "config": config, "concurrency": c,
        "metrics": {"output_tok_s": tok_s, "itl_ms": {"mean": itl}, "per_user_tok_s": tok_s / c,
                    "failed": failed},
        "spec_decode": None if acc is None else {"acceptance_length": acc},
        "workload": {"num_prompts": 4},
    }


def test_seed_row_formatting() -> None:
    base = cell("none", 16, 1397.0, 14.69, 1.324)
    mask = cell("mask", 16, 1136.0, 15.63, 1.132)
    assert format_cell(numbers(base, base)) == "1,397 / 14.69 / 1.324"
    assert format_cell(numbers(mask, base)) == "1,136 / 15.63 / 1.132 (-18.7%)"
    faster = cell("varlen+sts", 256, 9089.0, 27.52, 1.0)
    assert format_cell(numbers(faster, cell("none", 256, 6211.0))) == "9,089 / 27.52 / 1.000 (+46.3%)"


def test_small_numbers_missing_acceptance_and_failures() -> None:
    base = cell("none", 1, 35.25)
    nospec = cell("nospec", 1, 35.25, itl=None, acc=None, failed=2)
    assert format_cell(numbers(nospec, base)) == "35.2 / — / - (+0.0%) [2 failed]"


@pytest.mark.parametrize(("pct", "text"), [(0.04, "+0.0%"), (-0.04, "+0.0%"), (-18.66, "-18.7%"), (3.35, "+3.4%")])
def test_delta_format(pct: float, text: str) -> None:
    assert format_delta(pct) == text


def test_baseline_is_none_column_else_first() -> None:
    cells = [cell("mask", 1, 50), cell("none", 1, 100), cell("varlen", 1, 150)]
    t = build_table(cells, ["mask", "none", "varlen"], [1])
    assert t.baseline == "none"
    assert t.rows() == [["1", "50.0 / 10.00 / 1.300 (-50.0%)", "100 / 10.00 / 1.300", "150 / 10.00 / 1.300 (+50.0%)"]]
    t2 = build_table(cells, ["varlen", "mask"], [1])
    assert t2.baseline == "varlen"
    assert t2.rows()[0][1] == "150 / 10.00 / 1.300"
    assert t2.rows()[0][2].endswith("(-66.7%)")


def test_missing_cells_and_missing_baseline_cell() -> None:
    cells = [cell("none", 1, 100), cell("mask", 1, 90), cell("mask", 4, 300)]
    t = build_table(cells, ["none", "mask"], [1, 4])
    assert t.rows()[1] == ["4", "—", "300 / 10.00 / 1.300"]  # no baseline at c=4: no Δ rather than a wrong one


def test_markdown_and_summary_files(tmp_path: Path) -> None:
    cells = [cell("none", 1, 100), cell("mask", 1, 90), cell("none", 4, 300), cell("mask", 4, 330)]
    md = to_markdown(build_table(cells, ["none", "mask"], [1, 4]), "title")
    lines = md.splitlines()
    assert lines[0] == "title"
    assert "| c | No capacity | Mask + SPS |" in lines
    assert "| 4 | 300 / 10.00 / 1.300 | 330 / 10.00 / 1.300 (+10.0%) |" in lines
    js, mdp = write_summary(tmp_path, cells, ["none", "mask"], [1, 4])
    summary = read_json(js)
    assert summary["baseline"] == "none"
    assert summary["rows"][1]["cells"]["mask"]["delta_pct"] == pytest.approx(10.0)
    assert summary["rows"][0]["cells"]["none"]["delta_pct"] is None
    assert mdp.read_text() == summary["markdown"]


def test_pareto_front() -> None:
    pts = [(10, 100), (20, 90), (15, 80), (5, 120), (20, 50), (30, 10)]
    assert pareto_front(pts) == [(5, 120), (10, 100), (20, 90), (30, 10)]
    assert pareto_front([]) == []


def test_plots_are_written(tmp_path: Path) -> None:
    cells = [cell("none", 1, 100), cell("none", 4, 300), cell("mask", 1, 90), cell("mask", 4, 330)]
    paths = plot_matrix(cells, ["none", "mask"], tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "pareto.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vllm_verify_all_column_is_the_baseline() -> None:
    from dspark_cli.bench.report import baseline_of, header

    assert baseline_of(["nospec", "upstream", "all", "varlen"]) == "all"
    assert baseline_of(["all", "none"]) == "none"
    assert header("all") == "Verify all" and header("upstream") == "vLLM adaptive"


def test_server_steps_by_kind_get_their_own_table() -> None:
    """A cell's server counted its steps by kind: the summary says each kind's mean ms and count, so a reader
    can tell a slow paused step from a slow client; cells without such counters leave the table out."""
    paused = cell("mask", 16, 2500)
    paused["server_counters"] = {"steps{kind=paused}": 1000.0, "step_seconds{kind=paused}": 5.4,
                                 "steps{kind=prefill}": 16.0, "step_seconds{kind=prefill}": 0.4,
                                 "steps{kind=probe}": 0.0, "step_seconds{kind=probe}": 0.0}
    plain = cell("nospec", 16, 2600)
    plain["server_counters"] = {"steps{kind=nospec}": 1016.0, "step_seconds{kind=nospec}": 5.08}
    t = build_table([plain, paused], ["nospec", "mask"], [16])
    assert numbers(paused, None).steps == {"paused": (1000, pytest.approx(5.4)), "prefill": (16, pytest.approx(25.0))}
    md = to_markdown(t)
    assert "| 16 | nospec 5.00 x 1016 | paused 5.40 x 1000, prefill 25.00 x 16 |" in md.splitlines()
    assert "Server steps" not in to_markdown(build_table([cell("none", 1, 100)], ["none"], [1]))


def test_server_step_phases_compare_each_cells_main_decode_kind() -> None:
    paused = cell("mask", 16, 2400)
    paused["server_counters"] = {
        "steps{kind=paused}": 1000.0, "step_seconds{kind=paused}": 6.0,
        "steps{kind=probe}": 2.0, "step_seconds{kind=probe}": 0.05,
        # Alphabetical, as a scrape returns them; the table puts them in the order the step runs them.
        "step_phase_seconds{kind=paused,phase=emit}": 1.5, "step_phase_seconds{kind=paused,phase=prepare}": 0.5,
        "step_phase_seconds{kind=paused,phase=sync}": 4.0,
        "step_phase_seconds{kind=probe,phase=draft}": 0.02, "step_phase_seconds{kind=any,phase=schedule}": 0.3,
    }
    plain = cell("nospec", 16, 2600)
    plain["server_counters"] = {"steps{kind=nospec}": 500.0, "step_seconds{kind=nospec}": 2.5,
                                "step_phase_seconds{kind=nospec,phase=sync}": 1.0,
                                "step_phase_seconds{kind=nospec,phase=prepare}": 0.25}
    got = numbers(paused, None).phases
    assert list(got["paused"]) == ["prepare", "sync", "emit"]
    assert got["paused"]["sync"] == pytest.approx(4.0) and got["probe"]["draft"] == pytest.approx(10.0)
    assert "any" not in got  # the scheduler's share has no steps of its own to divide by
    md = to_markdown(build_table([plain, paused], ["nospec", "mask"], [16]))
    assert "| 16 | nospec: prepare 0.50 / sync 2.00 | paused: prepare 0.50 / sync 4.00 / emit 1.50 |" in md.splitlines()
    assert "Decode-step phases" not in to_markdown(build_table([cell("none", 1, 100)], ["none"], [1]))


def _rounds(config: str, c: int, per_round: list[float], group: str | None = "g1") -> dict[str, Any]:
    out = cell(config, c, sum(per_round) / len(per_round))
    out["rounds"] = [{"round": r, "output_tok_s": v} for r, v in reversed(list(enumerate(per_round)))]
    out["round_group"] = group
    return out


def test_paired_rounds_compare_each_round_with_the_references_same_round(tmp_path: Path) -> None:
    """A drifting host moves both configs' rounds alike: the per-round ratio sees through it where the cells'
    totals do not (here the host halves its speed after two rounds, and ours ran more of the fast ones)."""
    cells = [_rounds("nospec", 16, [100.0, 100.0, 50.0, 50.0]), _rounds("varlen", 16, [98.0, 99.0, 49.0, 50.0]),
             _rounds("none", 16, [80.0, 80.0, 40.0, 40.0]),
             # another run's cell: its rounds ran apart from the references', so they do not pair
             _rounds("mask", 16, [200.0, 200.0, 200.0, 200.0], group="other"),
             cell("nospec", 64, 500.0), cell("varlen", 64, 490.0)]
    table = build_table(cells, ["nospec", "none", "varlen", "mask"], [16, 64])
    assert table.baseline == "none"
    assert paired_references(table) == ["nospec", "none"]
    d = paired_delta(table.cells[("varlen", 16)], table.cells[("nospec", 16)])
    assert d is not None and d.rounds == 4
    assert d.median_pct == pytest.approx(-1.5) and d.min_pct == pytest.approx(-2.0) and d.max_pct == pytest.approx(0.0)
    assert paired_delta(table.cells[("mask", 16)], table.cells[("nospec", 16)]) is None
    rows = paired_rows(table, "nospec")
    assert rows == [["16", "—", "-20.0% (-20.0..-20.0)", "-1.5% (-2.0..+0.0)", "—"], ["64", "—", "—", "—", "—"]]
    md = to_markdown(table)
    assert "Paired rounds against No spec: median Δ% of each round's output tok/s against its same round " \
           "(min..max over 4 rounds)" in md
    assert "| 16 | — | -20.0% (-20.0..-20.0) | -1.5% (-2.0..+0.0) | — |" in md
    json_path, _ = write_summary(tmp_path, cells, ["nospec", "none", "varlen", "mask"], [16, 64])
    paired = read_json(json_path)["paired"]
    assert set(paired) == {"nospec", "none"}
    assert paired["nospec"][0]["cells"]["varlen"]["median_pct"] == pytest.approx(-1.5)
    assert paired["none"][0]["cells"]["nospec"]["median_pct"] == pytest.approx(25.0)
    assert "(Δ% output tok/s vs No capacity, cell totals)" in md  # not the paired medians
    # without rounds there is no paired table
    plain = build_table([cell("nospec", 16, 1.0), cell("none", 16, 1.0)])
    assert paired_references(plain) == [] and "Paired rounds" not in to_markdown(plain)
    assert "(Δ% output tok/s vs No capacity)" in to_markdown(plain)
    # no no-capacity column, and the first one an earlier run's: nothing pairs with it, so no table of dashes
    stale = build_table([_rounds("varlen+sts", 16, [10.0, 11.0], group="old"), _rounds("mask", 16, [9.0, 9.0]),
                         _rounds("varlen", 16, [10.0, 10.0])], ["varlen+sts", "mask", "varlen"], [16])
    assert stale.baseline == "varlen+sts" and paired_references(stale) == []
    assert "over 0 rounds" not in to_markdown(stale)


def test_cells_skewed_by_the_prefix_cache_or_merged_chunks_are_listed_under_the_table(tmp_path: Path) -> None:
    """The summary is what is read later: a cell that found its prompts cached, or whose server merged steps'
    outputs into one chunk, says so under the table (and in summary.json), not only in the run's log."""
    cached = cell("nospec", 256, 11590, acc=None)
    cached["prefix_cache"] = {"queried_tokens": 80000.0, "hit_tokens": 60800.0, "hit_rate": 0.76}
    merged = cell("nospec", 64, 8793, acc=None)
    merged["metrics"]["tokens_per_chunk"] = 1.27
    clean = cell("all", 64, 6938, acc=2.92)
    clean["metrics"]["tokens_per_chunk"] = 2.90  # speculative chunks: as many tokens as each step emitted
    clean["prefix_cache"] = {"queried_tokens": 40000.0, "hit_tokens": 0.0, "hit_rate": 0.0}
    cells = [cached, merged, clean, cell("all", 256, 9461, acc=2.93)]
    md = to_markdown(build_table(cells, ["nospec", "all"], [64, 256]))
    notes = md.split("Cells not measured as they seem:\n\n", 1)[1].splitlines()
    assert notes == [
        "- No spec at c=64: 1.27 tokens per stream chunk against 1.00 per request-step: the server merged steps' "
        "outputs (its frontend fell behind the engine), so this cell may measure the frontend",
        "- No spec at c=256: 76% of its prompt tokens were prefix-cache hits, so cells are not equal work: serve "
        "with prefix caching off (vLLM: --no-enable-prefix-caching) to compare configs"]
    js, _ = write_summary(tmp_path, cells, ["nospec", "all"], [64, 256])
    rows = read_json(js)["rows"]
    assert rows[1]["cells"]["nospec"]["notes"][0].startswith("76% of its prompt tokens")
    assert rows[0]["cells"]["all"]["notes"] == []
    assert "Cells not measured" not in to_markdown(build_table([clean], ["all"], [64]))
