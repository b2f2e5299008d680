"""Random-initialised models of real shapes: names, configs, weightless checkpoints, on-device weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark_cli.engines.embedded.assets import TINY_DIR, resolve_model
from dspark_cli.engines.embedded.attention import get_backend
from dspark_cli.engines.embedded.config import EngineConfig
from dspark_cli.engines.embedded.engine import LLMEngine
from dspark_cli.engines.embedded.model import load_llama, read_llama_args
from dspark_cli.engines.embedded.sequence import SamplingParams
from dspark_cli.engines.embedded.shapes import (
    INIT_STD,
    SMALL_DRAFT_LAYERS,
    random_init_spec,
    shape_config,
)
from dspark_cli.errors import DsparkError

TINY_CONFIG = TINY_DIR / "target" / "config.json"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))


def test_llama_3_8b_shape_resolves_to_a_weightless_checkpoint_with_the_published_config() -> None:
    paths = resolve_model("random:llama-3-8b")
    args = read_llama_args(paths.target)
    assert (args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads) == (4096, 32, 32, 8)
    assert (args.intermediate_size, args.vocab_size, args.head_dim) == (14336, 128256, 128)
    assert args.rope_theta == 500000.0 and args.max_position_embeddings == 8192
    assert not args.tie_word_embeddings
    assert not list(paths.target.glob("*.safetensors"))  # weights are made at load time, never stored
    assert (paths.tokenizer / "tokenizer.json").is_file()
    assert random_init_spec(paths.target) == {"seed": 0, "std": INIT_STD, "shape": "llama-3-8b-32l"}
    # draft="auto" for a random target: a few-layer model of the target's width and vocabulary
    d = read_llama_args(paths.draft)
    assert (d.num_layers, d.hidden_size, d.vocab_size) == (SMALL_DRAFT_LAYERS, 4096, 128256)
    assert random_init_spec(paths.draft)["seed"] != random_init_spec(paths.target)["seed"]
    assert paths.name == "random:llama-3-8b"


def test_smollm2_shape_and_the_layers_suffix() -> None:
    cfg = shape_config("smollm2-135m")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (576, 30, 9)
    assert (cfg["num_key_value_heads"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (3, 49152, True)
    paths = resolve_model("random:smollm2-135m:layers=3", draft="random:smollm2-135m:layers=1")
    assert read_llama_args(paths.target).num_layers == 3
    assert read_llama_args(paths.draft).num_layers == 1
    # the same name resolves to the same folder (content-addressed), so repeated runs reuse it
    assert resolve_model("random:smollm2-135m:layers=3", draft=None).target == paths.target


def test_config_path_shape_and_a_random_draft_for_a_real_target() -> None:
    paths = resolve_model(f"random:{TINY_CONFIG}", draft="random:small:layers=1")
    assert read_llama_args(paths.target).hidden_size == 192
    assert read_llama_args(paths.draft).num_layers == 1
    real = resolve_model("tiny", draft="random:small")
    assert real.target == (TINY_DIR / "target").resolve()
    d = read_llama_args(real.draft)
    assert (d.hidden_size, d.vocab_size, d.num_layers) == (192, 1024, SMALL_DRAFT_LAYERS)


@pytest.mark.parametrize(
    ("model", "draft", "match"),
    [
        ("random:gpt-17", None, "unknown shape"),
        ("random:", None, "name a shape"),
        ("random:llama-3-8b:layers=0", None, "positive integer"),
        ("random:small", None, "draft size"),
        ("random:llama-3-8b", "random:smollm2-135m", "vocab"),
    ],
)
def test_bad_random_names_are_one_line_errors(model: str, draft: str | None, match: str) -> None:
    with pytest.raises(DsparkError, match=match):
        resolve_model(model, draft=draft)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    cfg = json.loads(TINY_CONFIG.read_text())
    cfg["vocab_size"] = 512
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DsparkError, match="vocab_size 512"):
        resolve_model(f"random:{tmp_path}", draft=None)


def test_weights_are_made_in_the_engine_dtype_deterministically() -> None:
    paths = resolve_model("random:smollm2-135m:layers=1", draft=None)
    backend = get_backend("torch", torch.device("cpu"))
    a = load_llama(paths.target, backend, 64, torch.bfloat16, torch.device("cpu"))
    b = load_llama(paths.target, backend, 64, torch.bfloat16, torch.device("cpu"))
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.dtype == torch.bfloat16, name  # built in the engine dtype: no float32 copy ever existed
        assert torch.equal(p, q), name
    w = a.layers[0].mlp.gate_up_proj.weight.float()
    assert abs(w.std().item() - INIT_STD) < 0.002 and abs(w.mean().item()) < 0.001
    assert torch.equal(a.norm.weight.float(), torch.ones(576))
    assert a.lm_head.weight is a.embed_tokens.weight  # SmolLM2 ties its embeddings


def test_engine_generates_with_a_random_target_and_draft() -> None:
    cfg = EngineConfig(model=f"random:{TINY_CONFIG}:layers=2", draft="random:small:layers=1",
                       num_speculative_tokens=2, max_num_seqs=2, max_model_len=128, device="cpu")
    with LLMEngine(cfg) as engine:
        out = engine.generate([engine.tokenizer.encode("12 + 7 ="), [5, 6, 7]],
                              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert [len(o) for o in out] == [6, 6]
        assert all(0 <= t < engine.vocab_size for o in out for t in o)
        assert engine.stats.num_drafts > 0


def test_end_of_turn_ids_named_only_in_generation_config_stop_the_output(tmp_path: Path) -> None:
    """Llama-3-Instruct checkpoints name <|eot_id|> in generation_config.json only: the engine read config.json's
    eos_token_id alone, so a chat reply ran on to max_tokens where vLLM stops."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(TINY_CONFIG.read_text())
    assert read_llama_args(ckpt).eos_token_ids == (2,)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert read_llama_args(ckpt).eos_token_ids == (2, 7, 9)
    (ckpt / "generation_config.json").write_text("{nope")
    with pytest.raises(DsparkError, match="generation_config.json: not readable JSON"):
        read_llama_args(ckpt)
