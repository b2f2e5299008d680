#!/usr/bin/env bash
# Fetch the vllm==0.33.0 wheel and unpack only the Python sources the vLLM-engine contract tests inspect.
#
# The wheel is a CUDA build pinned to torch 2.14, so it cannot be imported on the CPU CI machine; the
# tests read its source with `ast` instead. Idempotent: a complete cache (marked by .complete, holding every listed file) is reused.
# Cache dir: $DSPARK_VLLM_SRC, else ~/.cache/dspark/vllm-0.33.0-src.
set -euo pipefail
VERSION=0.33.0
DEST="${DSPARK_VLLM_SRC:-$HOME/.cache/dspark/vllm-${VERSION}-src}"
# Files named in dspark_cli/engines/vllm/contract.py (SOURCE_FILES); the dist-info holds entry points.
FILES=(
  vllm/v1/worker/gpu/model_runner.py
  vllm/v1/worker/gpu/spec_decode/adaptive_verification.py
  vllm/v1/worker/gpu/spec_decode/speculator.py
  vllm/v1/worker/gpu/spec_decode/rejection_sampler.py
  vllm/v1/worker/gpu/spec_decode/dflash/speculator.py
  vllm/v1/worker/gpu/spec_decode/dspark/speculator.py
  vllm/v1/worker/gpu/spec_decode/standalone_ar/speculator.py
  vllm/v1/worker/gpu/spec_decode/__init__.py
  vllm/v1/worker/gpu/cudagraph_utils.py
  vllm/v1/worker/gpu/input_batch.py
  vllm/v1/worker/gpu/states.py
  vllm/v1/worker/gpu/async_utils.py
  vllm/v1/worker/gpu/structured_outputs.py
  vllm/v1/worker/gpu/attn_utils.py
  vllm/config/speculative.py
  vllm/config/vllm.py
  vllm/config/model.py
  vllm/plugins/__init__.py
  vllm/distributed/parallel_state.py
  vllm/envs.py
  vllm/engine/arg_utils.py
  vllm/entrypoints/llm.py
  vllm/v1/worker/worker_base.py
)
# A cache is complete when it is marked and holds every file listed now (the list grows with the contract).
cached=1
[[ -f "$DEST/.complete" ]] || cached=0
for f in "${FILES[@]}"; do [[ -f "$DEST/$f" ]] || cached=0; done
if [[ $cached == 1 ]]; then
  echo "vllm ${VERSION} sources: $DEST (cached)"
  exit 0
fi
WHEEL_DIR="${DSPARK_VLLM_WHEEL_DIR:-$HOME/.cache/dspark/wheels}"
mkdir -p "$WHEEL_DIR"
WHEEL="$(ls "$WHEEL_DIR"/vllm-${VERSION}-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$WHEEL" ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: "vllm==${VERSION}" -d "$WHEEL_DIR"
  WHEEL="$(ls "$WHEEL_DIR"/vllm-${VERSION}-*.whl | head -n1)"
fi
TMP="$(mktemp -d "${DEST%/*}/.vllm-src.XXXXXX" 2>/dev/null || { mkdir -p "${DEST%/*}"; mktemp -d "${DEST%/*}/.vllm-src.XXXXXX"; })"
trap 'rm -rf "$TMP"' EXIT
python3 - "$WHEEL" "$TMP" "${FILES[@]}" <<'PY'
import sys, zipfile
wheel, dest, *files = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    missing = [f for f in files if f not in names]
    if missing:
        sys.exit(f"vllm wheel lacks {', '.join(missing)}")
    for f in files:
        zf.extract(f, dest)
    for n in names:
        if ".dist-info/" in n and n.rsplit("/", 1)[-1] in ("entry_points.txt", "METADATA"):
            zf.extract(n, dest)
PY
touch "$TMP/.complete"
rm -rf "$DEST"
mv "$TMP" "$DEST"
trap - EXIT
echo "vllm ${VERSION} sources: $DEST"
