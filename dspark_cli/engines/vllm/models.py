"""The toolkit's model names as checkpoints vLLM 0.33 loads (``dspark serve`` / ``profile-sps --engine vllm``).

Why. ``smollm2-135m`` (the default), ``tiny`` and ``random:<shape>`` are the embedded engine's names
(``engines/embedded/assets.py``, ``shapes.py``). Passed on to ``vllm serve`` unchanged, a name sends vLLM to the
model hub, which has no such model (and is out of reach where these run). The embedded engine's folders
themselves do not load as they are either:

* a draft's confidence head (``confidence_head.*``) is a tensor vLLM's Llama has no parameter for, and the
  ``dspark_*`` config keys mean nothing there;
* vLLM 0.33 picks the speculative method from the draft's *path* (``contract.METHOD_PATH_MARKERS``): a
  ``draft_model`` draft under the embedded engine's cache (``~/.cache/dspark``) would run as a DSpark
  speculator, which a Llama draft is not.

So a name is resolved as the embedded engine resolves it (converting SmolLM2 on first use), then copied without
the confidence head and the ``dspark_*`` keys into :func:`models_dir` (``$DSPARK_VLLM_MODELS``, else
``$XDG_CACHE_HOME/vllm-ready-models`` or ``~/.cache/vllm-ready-models``), whose path must hold no method marker.
Weights with nothing to drop are hard-linked, not rewritten. Random shapes are weightless (config and
tokenizer), served with ``--load-format dummy``: real step costs, no weights. These are the copies
``benchmarks/vllm_real_pair.py`` made for the H200's lossless checks with real weights
(docs/PERFORMANCE.md sections 28-33) and ``benchmarks/vllm_h200.sh`` served for the Llama-3-8B shape.

A copy's folder is named by what it was made from (the source's config and its weight files' sizes and
modification times), so a rebuilt source gets a new copy, and it is built in a temporary folder renamed into
place, so concurrent or interrupted runs never leave half a checkpoint. A checkpoint path or hub id the user
names is theirs and passes through untouched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dspark_cli.engines.vllm.contract import METHOD_PATH_MARKERS
from dspark_cli.errors import DsparkError

MODELS_DIR_ENV = "DSPARK_VLLM_MODELS"
DUMMY_LOAD_FORMAT = "dummy"


@dataclass(frozen=True)
class VllmModels:
    """What ``vllm serve`` gets for a target and draft as the user named them."""

    model: str  # vLLM's model argument
    draft: str | None  # the speculative config's "model"; None: the user's own --speculative-config decides
    load_format: str | None = None  # "dummy" for random shapes
    served_name: str | None = None  # the name clients address (the toolkit's name as given); None for a path


def models_dir() -> Path:
    """Where vLLM-ready copies of the toolkit's models live (module docstring)."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vllm-ready-models"


def method_marker(path: str | os.PathLike[str]) -> str | None:
    """The first marker in ``path`` from which vLLM 0.33 would re-derive a draft's speculative method."""
    lowered = str(path).lower()
    return next((m for m in METHOD_PATH_MARKERS if m in lowered), None)


def is_toolkit_name(name: str | None) -> bool:
    """A model name of the embedded engine's (an alias or ``random:<shape>``), not a path or hub id."""
    from dspark_cli.engines.embedded import assets, shapes

    return name is not None and (str(name).strip().lower() in assets.ALIASES or shapes.is_random_name(name))


def vllm_models(model: str, draft: str | None, *, speculative: bool, root: Path | None = None,
                build: bool = True) -> VllmModels:
    """The checkpoints ``vllm serve`` gets for ``model`` and ``draft`` (``"auto"``: the model's default draft;
    None: no draft). ``speculative``: whether the server drafts at all (a draft count was given); without it no
    draft is resolved. Toolkit names become vLLM-ready copies (module docstring); anything else passes through,
    ``"auto"`` then leaving the draft to the user's ``--speculative-config``. ``build=False`` (a dry run) names
    the copies without making them."""
    from dspark_cli.engines.embedded import assets, shapes

    random_target = shapes.is_random_name(model)
    if shapes.is_random_name(draft) and not random_target:
        raise DsparkError(f"--draft {draft} with --engine vllm needs a random target (--model random:<shape>): vLLM "
                          "loads target and draft alike, and --load-format dummy would give the target random weights")
    if not is_toolkit_name(model):
        return VllmModels(model=model, draft=None if draft in (None, "auto") else draft)
    name = str(model).strip()
    paths = assets.resolve_model(name, draft=draft if speculative else None)
    root = (root or models_dir()).expanduser()

    def copy(role: str, src: Path) -> Path:
        dst = _copy_dir(root, role, name, src)
        return plain_llama_copy(src, dst) if build else dst

    target = copy("target", paths.target)
    draft_dir = None if paths.draft is None else copy("draft", paths.draft)
    return VllmModels(model=str(target), draft=None if draft_dir is None else str(draft_dir),
                      load_format=DUMMY_LOAD_FORMAT if random_target else None, served_name=name)


def plain_llama_copy(src: Path, dst: Path) -> Path:
    """``src`` without its confidence head and ``dspark_*`` config keys, into ``dst`` (atomically; kept if
    already there). Weights with no confidence head are hard-linked (copied across file systems); a weightless
    folder (a random shape) stays weightless."""
    from dspark_cli.engines.embedded import assets

    def build(tmp: Path) -> None:
        files = sorted(src.glob("*.safetensors"))
        if _tensor_names(files) & set(assets.CONFIDENCE_HEAD_KEYS):
            tensors = {k: v for k, v in assets._load_safetensors(src).items() if k not in assets.CONFIDENCE_HEAD_KEYS}
            assets._save_safetensors(tensors, tmp / "model.safetensors")
        else:
            for f in [*files, *src.glob("*.safetensors.index.json")]:
                _link_or_copy(f, tmp / f.name)
        cfg = {k: v for k, v in assets._read_config(src).items() if not k.startswith("dspark_")}
        assets._write_json(tmp / "config.json", cfg)
        assets._copy_tokenizer(src, tmp)
        for name in COPIED_FILES:  # vLLM reads its defaults (stop ids, sampling) from it, as the engine does
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)

    return assets._build_dir_atomically(dst, build)


# Files a copy carries beside the weights, config and tokenizer.
COPIED_FILES = ("generation_config.json",)


def _copy_dir(root: Path, role: str, name: str, src: Path) -> Path:
    """``root/<role>-<name>-<digest of the source>``, refused where vLLM would read a method into the path."""
    from dspark_cli.engines.embedded import assets

    h = hashlib.sha256((src / "config.json").read_bytes())
    for f in sorted(src.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    # Every other file the copy carries, by content: a chat template or stop ids edited in the source left the
    # copy of the old ones in use under the same name.
    for name in (*assets.TOKENIZER_FILES, *COPIED_FILES):
        if (src / name).is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256((src / name).read_bytes()).digest())
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()).strip("-.")
    if not slug or method_marker(slug) is not None:  # a shape named by a path may hold one; the digest still tells
        slug = "model"
    out = root / f"{role}-{slug}-{h.hexdigest()[:12]}"
    marker = method_marker(out)
    if marker is not None:
        raise DsparkError(f"{out}: vLLM would read the speculative method from {marker!r} in this path; set "
                          f"{MODELS_DIR_ENV} to a folder whose path does not contain it")
    return out


def _tensor_names(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def describe(models: VllmModels) -> str:
    """One line naming the copies a toolkit name resolved to (what the launcher logs before vLLM starts)."""
    parts = [f"target {models.model}"] + ([f"draft {models.draft}"] if models.draft else [])
    weightless = " (weightless: served with --load-format dummy unless one is given)" if models.load_format else ""
    return f"{models.served_name}: {', '.join(parts)}{weightless}"

