"""Model assets: the packaged tiny pair, name/path resolution, derived and packaged drafts."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaForCausalLM

from dspark_cli.engines.embedded import assets
from dspark_cli.errors import DsparkError


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    """Every test gets its own cache dir, so nothing depends on (or writes to) the user's cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="module")
def tiny() -> assets.ModelPaths:
    return assets.resolve_model("tiny")


@pytest.fixture(scope="module")
def tiny_models(tiny):
    target = LlamaForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(tiny.draft, dtype=torch.float32).eval()
    return target, draft


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny.tokenizer)


def test_tiny_resolves_to_the_packaged_pair(tiny) -> None:
    assert tiny.name == "tiny"
    assert tiny.target == (assets.TINY_DIR / "target").resolve()
    assert tiny.draft == (assets.TINY_DIR / "draft").resolve()
    assert tiny.tokenizer == tiny.target
    for d in (tiny.target, tiny.draft):
        assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
        assert (d / "tokenizer.json").is_file() and (d / "tokenizer_config.json").is_file()
    size = sum(f.stat().st_size for d in (tiny.target, tiny.draft) for f in d.iterdir())
    assert size < 8 * 2**20


def test_tiny_sizes_and_shared_vocabulary(tiny, tiny_models) -> None:
    target, draft = tiny_models
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 1.5e6 < n_target < 3e6
    assert 0.1e6 < n_draft < 0.4e6
    assert target.config.vocab_size == draft.config.vocab_size == 1024
    assert target.config.eos_token_id == draft.config.eos_token_id
    assert target.config.num_key_value_heads < target.config.num_attention_heads  # GQA is exercised


def test_tiny_draft_carries_a_confidence_head(tiny, tiny_models) -> None:
    _, draft = tiny_models
    tensors = load_file(tiny.draft / "model.safetensors")
    weight, bias = tensors["confidence_head.weight"], tensors["confidence_head.bias"]
    assert weight.shape == (1, draft.config.hidden_size + 2) and bias.shape == (1,)
    assert weight.dtype == torch.float32 and torch.isfinite(weight).all()
    assert weight.abs().sum() > 0  # fitted, not the zero initialisation
    cfg = json.loads((tiny.draft / "config.json").read_text())
    assert cfg["dspark_confidence_head"]["features"] == ["final_hidden_normed", "log_q_token", "entropy_q"]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=200))
def test_tiny_tokenizer_round_trips_any_text(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < 1024 for i in ids)
    assert tokenizer.decode(ids) == text


def test_tiny_chat_template_and_eos(tokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How many?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.eos_token_id) == 1  # special tokens are single tokens


@torch.no_grad()
def test_tiny_target_learned_to_end_answers(tiny_models, tokenizer) -> None:
    """EOS is trained: after a finished chat answer the target puts real mass on <|im_end|>."""
    target, _ = tiny_models
    prompt = (
        "<|im_start|>user\nTom has 3 apples and buys 2 more. How many apples does he have?<|im_end|>\n"
        "<|im_start|>assistant\nTom has 3 + 2 = 5 apples. So the answer is 5."
    )
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    probs = target(input_ids=ids).logits[0, -1].softmax(-1)
    eos = tokenizer.eos_token_id
    assert probs[eos] > 0.2
    assert probs[eos] > probs.median() * 100


@torch.no_grad()
def test_tiny_draft_agrees_with_target_sometimes(tiny_models, tokenizer) -> None:
    """Acceptance strictly between 0 and 1 is what makes the pair useful for speculative-decoding tests."""
    target, draft = tiny_models
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "A farmer has 12 cows and sells 5. How many cows are left?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    seq = target.generate(input_ids=ids, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    n = ids.shape[1]
    t_arg = target(input_ids=seq).logits[0, n - 1 : -1].argmax(-1)
    d_arg = draft(input_ids=seq).logits[0, n - 1 : -1].argmax(-1)
    agreement = (t_arg == d_arg).float().mean().item()
    assert 0.1 < agreement < 0.95
    metrics = json.loads((assets.TINY_DIR / "metrics.json").read_text())
    assert 0.2 < metrics["greedy_agreement"] < 0.9
    assert 1.0 < metrics["mean_acceptance_length_k4"] < 5.0


# ---------------------------------------------------------------- resolution of paths and errors


def test_a_path_is_used_as_is(tiny) -> None:
    paths = assets.resolve_model(str(tiny.target), draft=str(tiny.draft))
    assert (paths.target, paths.draft, paths.tokenizer) == (tiny.target, tiny.draft, tiny.target)
    assert assets.resolve_model(str(tiny.target), draft=None).draft is None
    assert assets.resolve_model("tiny", draft="none").draft is None
    assert assets.resolve_model("TINY").draft == tiny.draft


def test_bad_paths_are_one_line_errors(tmp_path, tiny) -> None:
    with pytest.raises(DsparkError, match="not a directory.*tiny"):
        assets.resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DsparkError, match="no config.json"):
        assets.resolve_model(str(tmp_path / "empty"))
    with pytest.raises(DsparkError, match="no default draft"):
        assets.resolve_model(str(tiny.target))
    with pytest.raises(DsparkError, match="draft .* not a directory"):
        assets.resolve_model("tiny", draft=str(tmp_path / "nope"))
    with pytest.raises(DsparkError, match="empty model name"):
        assets.resolve_model(" ")


def test_draft_with_another_vocabulary_is_refused(tmp_path, tiny) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny.draft, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 2048
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DsparkError, match="vocab_size 2048"):
        assets.resolve_model("tiny", draft=str(other))


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c" / "models"
    monkeypatch.delenv("DSPARK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "dspark" / "models"


# ---------------------------------------------------------------- derived and packaged drafts


@torch.no_grad()
def test_derived_draft_is_the_targets_first_layers(tmp_path, tiny, tiny_models) -> None:
    target, _ = tiny_models
    out = assets.derive_draft(tiny.target, tmp_path / "derived", num_layers=2)
    draft = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert draft.config.num_hidden_layers == 2
    ids = torch.randint(0, 1024, (1, 12))
    hidden = target.model.embed_tokens(ids)
    pos = torch.arange(12)[None]
    emb = target.model.rotary_emb(hidden, pos)
    for layer in target.model.layers[:2]:
        hidden = layer(hidden, position_embeddings=emb, position_ids=pos)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    expected = target.lm_head(target.model.norm(hidden))
    torch.testing.assert_close(draft(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
    tensors = load_file(out / "model.safetensors")
    assert tensors["confidence_head.weight"].shape == (1, target.config.hidden_size + 2)
    assert json.loads((out / "config.json").read_text())["dspark_confidence_head"]["fitted"] is False
    assert (out / "tokenizer.json").is_file()
    assert assets.derive_draft(tiny.target, out, num_layers=2) == out  # built once
    with pytest.raises(DsparkError, match="cannot derive"):
        assets.derive_draft(tiny.target, tmp_path / "too-deep", num_layers=9)


def make_packaged(tiny, dest: Path, num_layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A packaged draft as the distillation script writes it: int8 layers of a perturbed copy of the
    target's first layers, a float32 final norm and a confidence head; returns the float weights."""
    gen = torch.Generator().manual_seed(seed)
    full = load_file(tiny.target / "model.safetensors")
    weights = {
        k: (v.float() + 0.01 * torch.randn(v.shape, generator=gen))
        for k, v in full.items()
        if k.startswith(tuple(f"model.layers.{i}." for i in range(num_layers))) or k == "model.norm.weight"
    }
    stored: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        if v.dim() == 2:
            stored[k], stored[k + ".scale"] = assets.quantize_int8(v)
        else:
            stored[k] = v
    hidden = json.loads((tiny.target / "config.json").read_text())["hidden_size"]
    weights["confidence_head.weight"] = stored["confidence_head.weight"] = torch.randn(1, hidden + 2, generator=gen)
    weights["confidence_head.bias"] = stored["confidence_head.bias"] = torch.tensor([0.25])
    dest.mkdir(parents=True)
    save_file(stored, str(dest / "model.safetensors"))
    cfg = json.loads((tiny.target / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    cfg[assets.PACKAGED_KEY] = {"format_version": assets.PACKAGED_FORMAT_VERSION, "target": "tiny"}
    (dest / "config.json").write_text(json.dumps(cfg))
    return weights


@torch.no_grad()
def test_packaged_draft_materialises_into_a_plain_checkpoint(tmp_path, tiny, private_cache) -> None:
    packaged = tmp_path / "packaged"
    weights = make_packaged(tiny, packaged)
    paths = assets.resolve_model(str(tiny.target), draft=str(packaged))
    out = paths.draft
    assert out is not None and out.parent == private_cache / "models"
    cfg = json.loads((out / "config.json").read_text())
    assert assets.PACKAGED_KEY not in cfg and cfg["num_hidden_layers"] == 2
    tensors = load_file(out / "model.safetensors")
    target = load_file(tiny.target / "model.safetensors")
    assert torch.equal(tensors["model.embed_tokens.weight"], target["model.embed_tokens.weight"])
    assert torch.equal(tensors["lm_head.weight"], target["lm_head.weight"])
    assert not any(k.endswith(".scale") for k in tensors)
    for name, w in weights.items():
        got = tensors[name].float()
        if name.startswith("confidence_head."):
            assert tensors[name].dtype == torch.float32
            torch.testing.assert_close(got, w)
        else:
            # int8 storage plus the target's float16: well within one quantisation step
            tol = w.abs().amax(dim=-1, keepdim=True) / 127 if w.dim() == 2 else w.abs().max() * 1e-3
            assert ((got - w).abs() <= tol + 1e-3).all(), name
    draft = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    logits = draft(input_ids=torch.randint(0, 1024, (1, 8))).logits
    assert torch.isfinite(logits).all()
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"
    # cached: the same inputs resolve to the same dir; changed weights to a new one
    assert assets.resolve_model(str(tiny.target), draft=str(packaged)).draft == out
    shutil.rmtree(packaged)
    make_packaged(tiny, packaged, seed=1)
    assert assets.resolve_model(str(tiny.target), draft=str(packaged)).draft != out


def test_packaged_draft_for_another_target_is_refused(tmp_path, tiny) -> None:
    packaged = tmp_path / "packaged"
    make_packaged(tiny, packaged)
    cfg = json.loads((packaged / "config.json").read_text())
    cfg["hidden_size"] = 576
    (packaged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DsparkError, match="hidden_size=576.*another target"):
        assets.resolve_model("tiny", draft=str(packaged))
    cfg["hidden_size"], cfg[assets.PACKAGED_KEY]["format_version"] = 192, 99
    (packaged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DsparkError, match="format_version 99"):
        assets.resolve_model("tiny", draft=str(packaged))


@given(st.integers(1, 8), st.integers(1, 16), st.floats(1e-4, 1e3))
@settings(max_examples=40, deadline=None)
def test_int8_round_trip_error_is_half_a_step(rows: int, cols: int, magnitude: float) -> None:
    w = torch.randn(rows, cols, dtype=torch.float64).float() * magnitude
    q, scale = assets.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (rows,)
    back = assets.dequantize_state_dict({"w": q, "w.scale": scale}, dtype=torch.float32)["w"]
    assert ((back - w).abs() <= scale[:, None] * 0.5 + 1e-6 * magnitude).all()


def test_smollm2_default_draft_falls_back_to_a_derived_one(tmp_path, monkeypatch, caplog, tiny) -> None:
    """Without a packaged distilled draft, the default model's draft is cut from the target (with a warning).
    The conversion itself is exercised in test_assets_smollm2.py; here a stand-in target keeps it fast."""
    converted = assets.cache_dir() / assets.SMOLLM2_DIRNAME
    shutil.copytree(tiny.target, converted)
    monkeypatch.setattr(assets, "SMOLLM2_DRAFT_DIR", tmp_path / "no-packaged-draft")
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        paths = assets.resolve_model("smollm2-135m")
    assert paths.target == converted and paths.name == "smollm2-135m"
    assert paths.draft is not None and paths.draft.name.endswith(f"first{assets.DERIVED_DRAFT_LAYERS}")
    assert json.loads((paths.draft / "config.json").read_text())["num_hidden_layers"] == assets.DERIVED_DRAFT_LAYERS
    assert any("acceptance will be low" in r.getMessage() for r in caplog.records)
    packaged = tmp_path / "packaged"
    make_packaged(tiny, packaged)
    monkeypatch.setattr(assets, "SMOLLM2_DRAFT_DIR", packaged)
    assert assets.resolve_model("smollm2-135m").draft.name.startswith(f"{assets.SMOLLM2_DIRNAME}-draft-")
