#!/usr/bin/env bash
# Trace-driven policy study: every verification policy vs the oracle, per concurrency, under one SPS curve.
#
#   benchmarks/simulate_study.sh TRACES CURVE [STS]
#
# TRACES: a trace JSONL file or folder (record with `dspark serve --record-traces FILE`; traces recorded with
#         --capacity-mode none replay exactly, pruned ones are credited conservatively).
# CURVE:  sps_curve.json of the engine/GPU the study is about (`dspark profile-sps`).
# STS:    optional sts.json; adds the "Manager + offline STS" row (and seeds online STS).
# Env:    CONCURRENCY (default 1,4,16,32,64,128,256), K (default: the traces' K), OUT
#         (default benchmarks/results/simulate), GAINS (extra --min-predicted-gain runs, default "0 0.01 0.05";
#         the first run has the default, 0.03 since docs/PERFORMANCE.md section 36, and the committed results 0).
#
# Writes $OUT/simulate.{json,md}, $OUT/simulate_throughput.png, $OUT/simulate_cells/ for the default manager
# settings, and the same under $OUT/gain-<g>/ for each extra gain. Every run is deterministic.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '2,15p' "$0"
  exit 2
fi
TRACES=$1
CURVE=$2
STS=${3:-}
OUT=${OUT:-benchmarks/results/simulate}
CONCURRENCY=${CONCURRENCY:-1,4,16,32,64,128,256}
GAINS=${GAINS:-0 0.01 0.05}

args=(--traces "$TRACES" --sps-curve "$CURVE" --concurrency "$CONCURRENCY")
[[ -n "${K:-}" ]] && args+=(-k "$K")
[[ -n "$STS" ]] && args+=(--sts "$STS")

export COLUMNS=${COLUMNS:-220}  # wide enough that the saved tables do not wrap
mkdir -p "$OUT"
dspark bench --simulate "${args[@]}" --results-dir "$OUT" | tee "$OUT/table.txt"
for g in $GAINS; do
  mkdir -p "$OUT/gain-$g"
  dspark bench --simulate "${args[@]}" --policies manager,manager+sts --min-predicted-gain "$g" \
    --results-dir "$OUT/gain-$g" | tee "$OUT/gain-$g/table.txt"
done
echo "results in $OUT"
