"""Random-initialised Llama models of real shapes: the step cost of a big model without its weights.

Step cost depends on a model's shape (layers, widths, heads, vocabulary), its dtype and the device, never on
the values of its weights, so a profile of ``random:llama-3-8b`` prices Llama-3-8B serving on that device
without a 16 GB download (no hub is reachable at run time anyway). Acceptance, of course, means nothing
with random weights: use these models for step-cost curves and scaled performance studies, not quality.

Names (anywhere a model or draft name is accepted):

- ``random:llama-3-8b``, ``random:smollm2-135m``: the built-in shapes in :data:`SHAPES`;
- ``random:<path to a config.json>`` (or to a folder holding one): that checkpoint's shape;
- ``random:<shape>:layers=N``: the same shape cut to ``N`` decoder layers (a quick target, or a draft);
- ``random:small`` (drafts only; also what ``draft="auto"`` means for a random target): a
  :data:`SMALL_DRAFT_LAYERS`-layer model of the *target's* shape (same hidden size, heads and vocabulary),
  ``random:small:layers=N`` to choose the depth.

Resolution writes a small checkpoint folder in the model cache (``assets.cache_dir()/random``): the shape's
``config.json`` marked with ``dspark_random_init`` (seed, std) and the tokenizer files, but no weights. The
loader (``model.load_llama``) sees the marker and builds the weights directly on the target device in the
engine dtype, tensor by tensor (normal, std 0.02, from a generator seeded per model; RMSNorm weights 1):
an 8B model in bf16 never exists in float32, nor on the host.

Tokenizer: always the packaged tiny pair's (``assets/tiny/target``, 1024 tokens, ChatML template), which
every shape's vocabulary contains; ids above 1024 never appear in tokenized prompts and decode to nothing.
The config's bos/eos ids are the tokenizer's (1 and 2) so stop handling agrees with the tokenizer.
Profiling feeds random token ids over the whole vocabulary, so the embedding/LM-head cost is the real one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_cli.errors import DsparkError

if TYPE_CHECKING:
    import torch

    from dspark_cli.engines.embedded.assets import ModelPaths
    from dspark_cli.engines.embedded.attention import AttentionBackend
    from dspark_cli.engines.embedded.model import LlamaArgs, LlamaForCausalLM

__all__ = [
    "PREFIX",
    "RANDOM_INIT_KEY",
    "SHAPES",
    "SMALL_DRAFT_LAYERS",
    "build_random_llama",
    "is_random_name",
    "random_init_spec",
    "resolve_random",
    "shape_config",
]

PREFIX = "random:"
RANDOM_INIT_KEY = "dspark_random_init"
INIT_STD = 0.02
TARGET_SEED = 0
DRAFT_SEED = 1
# A draft a few layers deep: the per-step draft cost of a small same-width drafter (embeddings and LM head
# included, which dominate at this depth, as they do for real small drafts sharing a big vocabulary).
SMALL_DRAFT_LAYERS = 2
TOKENIZER_BOS, TOKENIZER_EOS = 1, 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

_LLAMA_BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
}

# Shapes as published in each model's config.json (only what changes step cost, plus rope settings).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        **_LLAMA_BASE,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        **_LLAMA_BASE,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


def is_random_name(name: object) -> bool:
    return isinstance(name, (str, os.PathLike)) and str(name).strip().lower().startswith(PREFIX)


def _split_name(name: str) -> tuple[str, int | None]:
    """``random:<shape>[:layers=N]`` -> (shape, N). A shape may be a path containing ':' only before the
    ``:layers=`` suffix, which is matched from the right."""
    body = str(name).strip()[len(PREFIX):]
    layers = None
    head, sep, tail = body.rpartition(":")
    if sep and tail.startswith("layers="):
        value = tail[len("layers="):]
        if not value.isdigit() or int(value) < 1:
            raise DsparkError(f"{name}: layers=N needs a positive integer, got {value!r}")
        body, layers = head, int(value)
    if not body:
        raise DsparkError(f"{name}: name a shape after 'random:' ({', '.join(sorted(SHAPES))}, or a config.json path)")
    return body, layers


def shape_config(shape: str, layers: int | None = None) -> dict[str, Any]:
    """The Llama config of a built-in shape or of a config.json (path to the file or to its folder)."""
    key = shape.strip().lower()
    if key in SHAPES:
        cfg = dict(SHAPES[key])
    else:
        path = Path(shape).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise DsparkError(
                f"random:{shape}: unknown shape; use one of {', '.join(sorted(SHAPES))} or a path to a config.json"
            )
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DsparkError(f"random:{shape}: cannot read {path} ({exc})") from None
        if not isinstance(cfg, dict):
            raise DsparkError(f"random:{shape}: {path} is not a JSON object")
        # A checkpoint's own bookkeeping keys would be wrong for a weightless copy.
        for drop in ("dspark_packaged_draft", "dspark_confidence_head", "dspark_draft", RANDOM_INIT_KEY,
                     "quantization_config", "_name_or_path", "auto_map"):
            cfg.pop(drop, None)
    for required in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if required not in cfg:
            raise DsparkError(f"random:{shape}: the config has no {required!r}; is it a Llama config?")
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if int(cfg["vocab_size"]) < _tokenizer_vocab():
        raise DsparkError(
            f"random:{shape}: vocab_size {cfg['vocab_size']} is smaller than the packaged tokenizer's "
            f"{_tokenizer_vocab()}; random models need vocab_size >= {_tokenizer_vocab()}"
        )
    return cfg


def _tokenizer_dir() -> Path:
    from dspark_cli.engines.embedded.assets import TINY_DIR

    path = TINY_DIR / "target"
    if not (path / "tokenizer.json").is_file():
        raise DsparkError(f"random models borrow the packaged tiny tokenizer, but {path} has none (reinstall dspark-cli)")
    return path


def _tokenizer_vocab() -> int:
    """Token ids the packaged tokenizer can produce (its vocabulary plus added tokens)."""
    data = json.loads((_tokenizer_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    ids = [int(i) for i in (data.get("model") or {}).get("vocab", {}).values()]
    ids += [int(t["id"]) for t in data.get("added_tokens") or []]
    return max(ids) + 1 if ids else 0


def _write_checkpoint(cfg: dict[str, Any], seed: int, label: str) -> Path:
    """A weightless checkpoint folder for ``cfg`` in the cache; same config -> same folder (atomic build)."""
    from dspark_cli.engines.embedded.assets import cache_dir

    out_cfg = dict(cfg)
    out_cfg["bos_token_id"] = TOKENIZER_BOS
    out_cfg["eos_token_id"] = TOKENIZER_EOS
    out_cfg["pad_token_id"] = TOKENIZER_EOS
    out_cfg[RANDOM_INIT_KEY] = {"seed": seed, "std": INIT_STD, "shape": label}
    text = json.dumps(out_cfg, indent=2, sort_keys=True) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in label)[-48:].strip("-") or "model"
    out = cache_dir() / "random" / f"{slug}-{digest}"
    if (out / "config.json").is_file():
        return out
    tok = _tokenizer_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for name in TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copy2(tok / name, tmp / name)
        (tmp / "config.json").write_text(text, encoding="utf-8")
        try:
            os.rename(tmp, out)
        except OSError as exc:
            # Another process built the same folder first: its copy is identical, keep it.
            if not (out / "config.json").is_file():
                raise DsparkError(f"cannot create {out} ({exc.strerror}); remove that folder and retry") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _draft_config(spec: str, target_cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    shape, layers = _split_name(spec)
    if shape.strip().lower() == "small":
        cfg = dict(target_cfg)
        cfg["num_hidden_layers"] = layers or SMALL_DRAFT_LAYERS
        return cfg, f"small-{cfg['num_hidden_layers']}l"
    return shape_config(shape, layers), shape


def resolve_random(name: str, draft: str | os.PathLike[str] | None = "auto") -> ModelPaths:
    """``assets.resolve_model`` for names or drafts starting with ``random:`` (see the module docstring).

    A real target with a random draft works too (``--draft random:small`` sizes the draft from the target's
    config); a random target with a real draft is refused unless the vocabularies agree.
    """
    from dspark_cli.engines.embedded.assets import ModelPaths, resolve_model

    if is_random_name(name):
        shape, layers = _split_name(str(name))
        if shape.strip().lower() == "small":
            raise DsparkError("random:small is a draft size; name a target shape, e.g. random:llama-3-8b")
        target_cfg = shape_config(shape, layers)
        target = _write_checkpoint(target_cfg, TARGET_SEED, f"{shape}-{target_cfg['num_hidden_layers']}l")
        tokenizer = target
        label = str(name).strip()
    else:
        real = resolve_model(str(name), draft=None)
        target, tokenizer, label = real.target, real.tokenizer, real.name
        target_cfg = json.loads((target / "config.json").read_text(encoding="utf-8"))

    draft_dir: Path | None
    if draft is None or str(draft).strip().lower() in ("none", ""):
        draft_dir = None
    elif is_random_name(draft) or (str(draft) == "auto" and is_random_name(name)):
        spec = str(draft) if is_random_name(draft) else PREFIX + "small"
        cfg, draft_label = _draft_config(spec, target_cfg)
        draft_dir = _write_checkpoint(cfg, DRAFT_SEED, draft_label)
    else:
        # A real draft (path or "auto") for a real target goes the usual way; for a random target it must be a path.
        if not is_random_name(name):
            draft_dir = resolve_model(str(name), draft=draft).draft
        else:
            draft_dir = resolve_model(str(draft), draft=None).target
    if draft_dir is not None:
        d_vocab = json.loads((draft_dir / "config.json").read_text(encoding="utf-8")).get("vocab_size")
        if d_vocab != target_cfg.get("vocab_size"):
            raise DsparkError(
                f"draft {draft} has vocab_size {d_vocab} but target {name} has {target_cfg.get('vocab_size')}: "
                "a draft must share the target's vocabulary (random:small always does)"
            )
    return ModelPaths(target=target, draft=draft_dir, tokenizer=tokenizer, name=label)


def random_init_spec(checkpoint: Path) -> dict[str, Any] | None:
    """The ``dspark_random_init`` object of a checkpoint's config.json, or None for a real checkpoint."""
    path = Path(checkpoint) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    spec = cfg.get(RANDOM_INIT_KEY) if isinstance(cfg, dict) else None
    return spec if isinstance(spec, dict) else None


def build_random_llama(
    args: LlamaArgs, backend: AttentionBackend, max_positions: int, dtype: torch.dtype, device: torch.device,
    spec: dict[str, Any],
) -> LlamaForCausalLM:
    """The model with random weights made in place on ``device`` in ``dtype``, one tensor at a time.

    The module is built on the meta device (no memory), then every parameter is allocated directly in its
    final dtype on the device and filled by ``normal_`` from a device generator: peak memory is the model
    itself, with no float32 or host copy. Same seed and device -> same weights.
    """
    import torch
    from torch import nn

    from dspark_cli.engines.embedded.model import LlamaForCausalLM, rope_inv_freq

    std = float(spec.get("std", INIT_STD))
    gen = torch.Generator(device=device)
    gen.manual_seed(int(spec.get("seed", TARGET_SEED)))
    with torch.device("meta"):
        model = LlamaForCausalLM(args, backend, max_positions)
    with torch.no_grad():
        for module in model.modules():
            if args.tie_word_embeddings and module is model.lm_head:
                continue  # tied to the embeddings below
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                data = torch.empty(param.shape, dtype=dtype, device=device)
                if pname == "bias":
                    data.zero_()
                elif param.dim() == 1:  # RMSNorm scales: identity, as a freshly initialised model has
                    data.fill_(1.0)
                else:
                    data.normal_(0.0, std, generator=gen)
                module._parameters[pname] = nn.Parameter(data, requires_grad=False)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(args))
    emb = torch.cat([freqs, freqs], dim=-1).to(device)
    model.rope_cos = emb.cos()
    model.rope_sin = emb.sin()
    return model.eval().requires_grad_(False)
