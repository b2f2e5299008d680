"""benchmarks/vllm_real_pair.py: the embedded engine's checkpoints as plain Llama dirs for vLLM's draft_model.

What vLLM's Llama loader gets must have exactly a Llama's parameters: the confidence head and the dspark_*
config keys go, every other tensor stays bit-identical, and transformers' loader reports nothing missing or
unexpected.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from dspark_cli.engines.embedded import assets

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_real_pair.py"
spec = importlib.util.spec_from_file_location("vllm_real_pair", PATH)
real_pair = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = real_pair
spec.loader.exec_module(real_pair)


def test_plain_copy_drops_only_the_confidence_head_and_dspark_keys(tmp_path: Path) -> None:
    draft = assets.resolve_model("tiny").draft
    assert draft is not None
    src = assets._load_safetensors(draft)
    assert set(assets.CONFIDENCE_HEAD_KEYS) <= set(src)  # the tiny draft has a head to drop
    out = real_pair.plain_llama_copy(draft, tmp_path / "draft")
    got = assets._load_safetensors(out)
    assert set(got) == set(src) - set(assets.CONFIDENCE_HEAD_KEYS)
    assert all(torch.equal(got[k], src[k]) for k in got)
    cfg = json.loads((out / "config.json").read_text())
    assert not [k for k in cfg if k.startswith("dspark_")]
    assert cfg["num_hidden_layers"] == json.loads((draft / "config.json").read_text())["num_hidden_layers"]
    assert real_pair.plain_llama_copy(draft, tmp_path / "draft") == out  # kept, not rebuilt

    transformers = pytest.importorskip("transformers")
    _, info = transformers.LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info
