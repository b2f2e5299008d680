"""GSM8K scoring: prompt format, strict/flexible extraction, resumable result files, comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_cli.data.gsm8k import COT_EXEMPLARS, GsmRow
from dspark_cli.errors import DsparkError
from dspark_cli.evals.gsm8k import (
    EvalConfig,
    EvalRow,
    answers_match,
    append_row,
    build_prompt,
    compare,
    extract_flexible,
    extract_strict,
    mcnemar_p,
    read_results,
    summarize,
)


def test_prompt_is_q_a_fewshot() -> None:
    p = build_prompt("  How many? ", 2)
    blocks = p.split("\n\n")
    assert blocks[0] == f"Q: {COT_EXEMPLARS[0].question}\nA: {COT_EXEMPLARS[0].answer}"
    assert blocks[1] == f"Q: {COT_EXEMPLARS[1].question}\nA: {COT_EXEMPLARS[1].answer}"
    assert blocks[2] == "Q: How many?\nA:"
    assert build_prompt("x", 0) == "Q: x\nA:"
    with pytest.raises(DsparkError):
        build_prompt("x", 9)


@pytest.mark.parametrize(("text", "strict", "flexible"), [
    (" She has 3 + 4 = 7 apples. The answer is 7.", "7", "7"),
    (" 2 * 3 = 6.\n#### 6", "6", "6"),
    (" The answer is $1,250.00. Then 5 more", "1250", "5"),  # strict takes the declaration, flexible the last
    (" So the answer is -3.", "-3", "-3"),
    (" The final answer is: 42", "42", "42"),
    (" The cost is 12 dollars and 40 cents: 12.40", None, "12.4"),
    (" I do not know.", None, None),
    (" #### 10\nThe answer is 11.", "10", "11"),  # the first declaration wins
    (" She had 23 - 15", None, "15"),  # the right-hand side of a subtraction, not -15
    (" The answer is $ 30.", "30", "30"),
    ("", None, None),
])
def test_extraction(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_strict(text) == strict
    assert extract_flexible(text) == flexible


def test_answers_match_numerically() -> None:
    assert answers_match("18", "18")
    assert answers_match("18.0", "18")
    assert not answers_match("17", "18")
    assert not answers_match(None, "18")


def _row(i: int, final: str = "5") -> GsmRow:
    return GsmRow(id=i, question=f"q{i}", answer=f"x #### {final}", cot_answer="", final=final)


SETTINGS = EvalConfig(base_url="http://x").settings()


def test_score_and_summary() -> None:
    rows = [EvalRow.score(_row(0), "The answer is 5.", SETTINGS),
            EvalRow.score(_row(1), "I think 5 apples", SETTINGS),
            EvalRow.score(_row(2), "no idea", SETTINGS),
            EvalRow.score(_row(3), "The answer is 4.", SETTINGS)]
    assert [(r.strict_correct, r.flexible_correct, r.invalid) for r in rows] == [
        (True, True, False), (False, True, False), (False, False, True), (False, False, False)]
    s = summarize(rows)
    assert (s.n, s.strict, s.flexible, s.invalid) == (4, 0.25, 0.5, 0.25)
    assert "strict 0.250 ± 0.217" in s.line()


def test_result_file_survives_a_cut_last_line(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    for i in range(3):
        append_row(out, EvalRow.score(_row(i), "The answer is 5.", SETTINGS))
    with open(out, "ab") as fh:
        fh.write(b'{"id": 3, "question": "q3", "go')  # a crash mid-write
    assert [r.id for r in read_results(out)] == [0, 1, 2]
    assert [r.id for r in read_results(out, repair=True)] == [0, 1, 2]
    append_row(out, EvalRow.score(_row(3), "The answer is 5.", SETTINGS))
    assert [r.id for r in read_results(out)] == [0, 1, 2, 3]


@pytest.mark.parametrize("text", [b"# my notes\nimportant last line without newline", b"one line of notes",
                                  b'{"request": "a", "conf": [0.5], "verified": 1, "accepted": 1}'])
def test_a_file_that_is_not_results_is_refused_untouched(tmp_path: Path, text: bytes) -> None:
    """The repair for a crash's cut last line ran before the file was known to hold results: `-o notes.md` cut
    the notes' last line, then refused the file; a traces file lost its last row."""
    out = tmp_path / "notes.md"
    out.write_bytes(text)
    with pytest.raises(DsparkError, match="not a gsm8k result row"):
        read_results(out, repair=True)
    assert out.read_bytes() == text


def test_corrupt_middle_line_is_an_error(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    append_row(out, EvalRow.score(_row(0), "5", SETTINGS))
    with open(out, "ab") as fh:
        fh.write(b"not json\n")
    with pytest.raises(DsparkError, match=r"r\.jsonl:2"):
        read_results(out)


def test_compare_uses_shared_questions(tmp_path: Path) -> None:
    a, b = tmp_path / "mask.jsonl", tmp_path / "varlen.jsonl"
    for i in range(10):
        append_row(a, EvalRow.score(_row(i), "The answer is 5.", SETTINGS))
    for i in range(5, 20):
        append_row(b, EvalRow.score(_row(i), "The answer is 5." if i % 2 else "The answer is 6.", SETTINGS))
    rows, n, note = compare([a, b])
    assert n == 5
    assert [r.label for r in rows] == ["mask", "varlen"]
    assert rows[0].summary.strict == 1.0 and rows[1].summary.strict == pytest.approx(3 / 5)
    assert "n=5 shared questions, each file against mask" in note
    # the two varlen questions answered 6 went right -> wrong: two changed outcomes cannot tell noise apart
    assert "varlen: 3 of 5 completions identical; strict outcome changed on 2 (2 right->wrong, 0 wrong->right), " \
           "McNemar p=0.5: within noise" in note
    with pytest.raises(DsparkError, match="no such file"):
        compare([a, tmp_path / "missing.jsonl"])


def test_compare_pairs_questions_where_independent_bands_would_see_noise(tmp_path: Path) -> None:
    """40 of 1,319 questions all going right -> wrong (0.300 against 0.270) sat inside the old band for two
    independent accuracies (±0.035); paired, it is plainly not noise."""
    a, b = tmp_path / "none.jsonl", tmp_path / "varlen.jsonl"
    for i in range(1319):
        right_a = i < 396
        right_b = i < 356
        append_row(a, EvalRow.score(_row(i), "The answer is 5." if right_a else "The answer is 4.", SETTINGS))
        append_row(b, EvalRow.score(_row(i), "The answer is 5." if right_b else "The answer is 4.", SETTINGS))
    rows, n, note = compare([a, b])
    assert n == 1319 and rows[0].summary.strict == pytest.approx(396 / 1319)
    assert "strict outcome changed on 40 (40 right->wrong, 0 wrong->right), McNemar p=1.8e-12: a real difference" \
        in note
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(3, 3) == 1.0 and mcnemar_p(1, 0) == 1.0


def test_compare_refuses_files_of_different_question_sets(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    append_row(a, EvalRow.score(_row(0), "The answer is 5.", SETTINGS))
    other = GsmRow(id=0, question="another question", answer="x #### 5", cot_answer="", final="5")
    append_row(b, EvalRow.score(other, "The answer is 5.", SETTINGS))
    with pytest.raises(DsparkError, match="different questions under id 0"):
        compare([a, b])


def test_compare_says_when_files_were_scored_differently(tmp_path: Path) -> None:
    """Shots and output length move accuracy by themselves: a comparison across them is flagged."""
    a, b = tmp_path / "five.jsonl", tmp_path / "one.jsonl"
    one_shot = EvalConfig(base_url="http://x", num_shots=1, max_tokens=8).settings()
    for i in range(4):
        append_row(a, EvalRow.score(_row(i), "The answer is 5.", SETTINGS))
        append_row(b, EvalRow.score(_row(i), "The answer is 5.", one_shot))
    _, _, note = compare([a, b])
    assert "warning: the files were scored with different settings" in note
    assert "num_shots=5, max_tokens=512 (five.jsonl)" in note and "num_shots=1, max_tokens=8 (one.jsonl)" in note
    _, _, same = compare([a])
    assert "one file" in same and "McNemar" not in same
    with pytest.raises(DsparkError, match="is not a file"):
        compare([a, tmp_path])
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    with pytest.raises(DsparkError, match="pass files that `dspark eval gsm8k -o` wrote"):
        compare([a, bad])


def test_an_unwritable_output_is_refused_before_any_question(tmp_path: Path) -> None:
    from dspark_cli.evals.gsm8k import run_eval

    afile = tmp_path / "afile"
    afile.write_text("x")
    # nothing listens at this URL: the output is checked first, so the error is about it, not the server
    cfg = EvalConfig(base_url="http://127.0.0.1:9", limit=1)
    for bad in (afile / "r.jsonl", tmp_path):
        with pytest.raises(DsparkError, match="--output .*(cannot write there|is a folder)"):
            run_eval(cfg, bad)


def test_the_cli_checks_its_settings_before_anything_is_drawn_or_sent(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dspark_cli.cli import app

    runner = CliRunner()
    for args, said in ((["--num-shots", "9"], "--num-shots must be in 0..8"), (["-c", "0"], "--concurrency must be"),
                       (["--port", "70000"], "--port must be in 1..65535, got 70000"),
                       (["--data", str(tmp_path)], "is a folder; pass the GSM8K rows JSONL file"),
                       (["-o", f"{tmp_path}/new/"], f"--output {tmp_path}/new/ is a folder; name the file to write"),
                       (["--limit", "0"], "--limit must be >= 1")):
        result = runner.invoke(app, ["eval", "gsm8k", *args])
        assert isinstance(result.exception, DsparkError) and said in str(result.exception), (args, result.output)
        assert result.stdout == ""  # no progress bar drawn before the error
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n')
    result = runner.invoke(app, ["eval", "gsm8k", "--data", str(bad)])
    assert "(line 1): no field 'id'; each line is an object with id, question" in str(result.exception)
    a = tmp_path / "a.jsonl"
    append_row(a, EvalRow.score(_row(0), "The answer is 5.", SETTINGS))
    result = runner.invoke(app, ["eval", "gsm8k", "--compare", str(a), str(a), "-o", str(tmp_path / "x.jsonl")])
    assert result.exit_code == 0
    assert "warning: --output: not used by --compare" in " ".join(result.stderr.split())
    result = runner.invoke(app, ["eval", "gsm8k", "--compare", str(a), "--num-shots", "0", "--max-tokens", "5",
                                 "-c", "3"])
    assert "warning: --num-shots, --max-tokens, --concurrency: not used by --compare" in " ".join(
        result.stderr.split())


def test_the_cli_writes_results_under_the_home_folder_for_a_tilde(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The check expanded "~" and the run did not: answers went to a folder named "~" under the working one.
    from typer.testing import CliRunner

    from dspark_cli.cli import app
    from dspark_cli.evals import gsm8k

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    seen = []
    monkeypatch.setattr(gsm8k, "run_eval", lambda cfg, output, **kw: seen.append(output) or [])
    result = CliRunner().invoke(app, ["eval", "gsm8k", "-o", "~/r.jsonl"])
    assert seen == [tmp_path / "home" / "r.jsonl"], result.output
    assert not (tmp_path / "~").exists()
