#!/usr/bin/env bash
# Fetch the vllm==0.33.0 wheel and unpack only the Python sources the vLLM-engine contract tests inspect;
# then the same for the flashinfer-python wheel vLLM 0.33.0 pins (the embedded engine's FlashInfer backend
# relies on its planner: engines/embedded/flashinfer_attention.py CONTRACT).
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
  vllm/v1/metrics/loggers.py
  vllm/v1/spec_decode/metrics.py
  vllm/entrypoints/common/cli_args.py
  vllm/v1/core/sched/async_scheduler.py
  vllm/v1/core/sched/scheduler.py
  vllm/v1/request.py
  vllm/v1/engine/core.py
  vllm/v1/worker/gpu/model_states/default.py
  vllm/v1/worker/gpu/warmup.py
  vllm/config/kernel.py
  vllm/config/compilation.py
)
# Sources of the pinned FlashInfer (cache: $DSPARK_FLASHINFER_SRC, else ~/.cache/dspark/flashinfer-VERSION-src).
FLASHINFER_VERSION=0.7.2.post1
FI_DEST="${DSPARK_FLASHINFER_SRC:-$HOME/.cache/dspark/flashinfer-${FLASHINFER_VERSION}-src}"
FI_FILES=(
  flashinfer/data/include/flashinfer/attention/scheduler.cuh
  flashinfer/data/include/flashinfer/utils.cuh
  flashinfer/data/include/flashinfer/attention/prefill.cuh
  flashinfer/data/csrc/batch_prefill_paged.cuh
  flashinfer/prefill.py
)
WHEEL_DIR="${DSPARK_VLLM_WHEEL_DIR:-$HOME/.cache/dspark/wheels}"

unpack() {  # unpack WHEEL DEST FILE...: the listed files and the dist-info's METADATA/entry points, atomically
  local wheel=$1 dest=$2; shift 2
  local tmp
  mkdir -p "${dest%/*}"
  tmp="$(mktemp -d "${dest%/*}/.src.XXXXXX")"
  python3 - "$wheel" "$tmp" "$@" <<'PY' || { rm -rf "$tmp"; return 1; }
import sys, zipfile
wheel, dest, *files = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    missing = [f for f in files if f not in names]
    if missing:
        sys.exit(f"{wheel} lacks {', '.join(missing)}")
    for f in files:
        zf.extract(f, dest)
    for n in names:
        if ".dist-info/" in n and n.rsplit("/", 1)[-1] in ("entry_points.txt", "METADATA"):
            zf.extract(n, dest)
PY
  touch "$tmp/.complete"
  rm -rf "$dest"
  mv "$tmp" "$dest"
}

# fetch PACKAGE DIST VERSION DEST FILE...: FILEs of the pinned wheel unpacked into DEST, unless a complete cache
# holds them all (complete = marked, and holding every file listed now: the lists grow with the contracts).
fetch() {
  local package=$1 dist=$2 version=$3 dest=$4 cached=1 wheel
  shift 4
  [[ -f "$dest/.complete" ]] || cached=0
  for f in "$@"; do [[ -f "$dest/$f" ]] || cached=0; done
  if [[ $cached == 1 ]]; then
    echo "$package $version sources: $dest (cached)"
    return
  fi
  mkdir -p "$WHEEL_DIR"
  wheel="$(ls "$WHEEL_DIR"/"$dist-$version"-*.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "$wheel" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: "$package==$version" -d "$WHEEL_DIR"
    wheel="$(ls "$WHEEL_DIR"/"$dist-$version"-*.whl | head -n1)"
  fi
  unpack "$wheel" "$dest" "$@"
  echo "$package $version sources: $dest"
}

fetch flashinfer-python flashinfer_python "$FLASHINFER_VERSION" "$FI_DEST" "${FI_FILES[@]}"
fetch vllm vllm "$VERSION" "$DEST" "${FILES[@]}"
