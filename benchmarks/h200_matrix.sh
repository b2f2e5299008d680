#!/usr/bin/env bash
# The seed's matrix with the embedded engine on one GPU, per setup, in one sitting:
# no speculation, no capacity, mask+SPS, varlen+SPS, mask+SPS+STS, varlen+SPS+STS at k=7, temperature 1,
# ignore-eos, equal work per cell (WAVES x concurrency requests), SPS curve profiled first on the same GPU.
#
#   bash benchmarks/h200_matrix.sh OUT scaled   # random Llama-3-8B shape + synthetic drafter (V4-Flash decay)
#   bash benchmarks/h200_matrix.sh OUT real     # SmolLM2-135M-Instruct + its distilled draft, GSM8K prompts
#   bash benchmarks/h200_matrix.sh OUT gsm8k    # real setup: GSM8K accuracy, no capacity vs varlen+SPS+STS
#
# The real setup needs the SmolLM2 GGUF on the host: here, `python3 examples/distill_smollm2_draft.py
# --prepare .carry/smol` cuts it into .carry/smol/part1..4; carry each part in its own call and copy it
# to /tmp/smol (`mkdir -p /tmp/smol && cp .carry/smol/partN/* /tmp/smol/`). Wheels the host lacks (orjson,
# gguf) travel in .whl. Env: CONC (16,32,64,128,256), WAVES (4), TOK (256), CONFIGS, MAX_NUM_SEQS (256),
# DEVICE (cuda), SERVE_EXTRA (flags every server gets besides these, e.g. "--phase-timing host"), BENCH_EXTRA
# (flags for dspark bench, e.g. "--interleave": every config's server up at once, cells by concurrency), SCALED_MODEL (random:llama-3-8b; a smaller shape checks the plumbing on a CPU),
# GSM8K_LIMIT (all 1319 questions), GSM8K_MAX_TOKENS (256).
set -uo pipefail
OUT=${1:?usage: h200_matrix.sh OUT scaled|real|gsm8k}
SETUP=${2:?usage: h200_matrix.sh OUT scaled|real|gsm8k}
mkdir -p "$OUT/$SETUP"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/dspark-site:$PWD PYTHONUNBUFFERED=1 DSPARK_CACHE_DIR=${DSPARK_CACHE_DIR:-/tmp/dcache}
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m dspark_cli.cli "$@"\n' >/tmp/bin/dspark && chmod +x /tmp/bin/dspark
export PATH=/tmp/bin:$PATH
K=7
CONC=${CONC:-16,32,64,128,256}
# 2 waves of 128 tokens made cells of 2-10 s whose tok/s moved 24% between two runs of one config (prefill
# bursts and first-use costs, docs/PERFORMANCE.md section 9): 4 waves of 256 tokens, ~4x the decode work.
WAVES=${WAVES:-4}
TOK=${TOK:-256}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
CONFIGS=${CONFIGS:-nospec,none,mask,varlen,mask+sts,varlen+sts}
DEVICE=${DEVICE:-cuda}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; } | tee "$OUT/$SETUP/machine.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$OUT/$SETUP/machine.txt"

smollm2() {  # the converted SmolLM2 checkpoint in the cache, from the GGUF parts in /tmp/smol
  python3 benchmarks/smollm2_parts.py --parts /tmp/smol
}

case $SETUP in
  scaled)
    MODEL=${SCALED_MODEL:-random:llama-3-8b}
    DRAFT=synthetic
    TOKENIZER=$(python3 -c "from dspark_cli.engines.embedded.shapes import resolve_random as r; print(r('$MODEL', None).tokenizer)")
    DATA=(--dataset random --input-len 128 --tokenizer "$TOKENIZER") ;;
  real | gsm8k)
    smollm2 >/dev/null || exit 1
    MODEL=smollm2-135m
    DRAFT=auto
    DATA=(--dataset /tmp/smol/gsm8k.jsonl) ;;
  *) echo "unknown setup $SETUP (scaled|real|gsm8k)" >&2; exit 2 ;;
esac
SERVE="--model $MODEL --draft $DRAFT -k $K --max-num-seqs $MAX_NUM_SEQS --device $DEVICE${SERVE_EXTRA:+ $SERVE_EXTRA}"
CURVE=$OUT/$SETUP/sps_curve.json
[[ $SETUP == gsm8k ]] && CURVE=$OUT/real/sps_curve.json
t0=$SECONDS
if [[ ! -f $CURVE ]]; then
  dspark profile-sps "$MODEL" --draft "$DRAFT" -k $K --max-num-seqs "$MAX_NUM_SEQS" --device "$DEVICE" -o "$CURVE" \
    --plot "${CURVE%.json}.png" 2>&1 | tee "$OUT/$SETUP/profile.log"
  echo "profile: $((SECONDS - t0)) s" | tee -a "$OUT/$SETUP/stages.txt"
fi

if [[ $SETUP == gsm8k ]]; then
  # Full test set, one concurrency: accuracy of verifying everything vs the full dspark configuration.
  for cfg in none varlen+sts; do
    port=$((8100 + RANDOM % 500))
    extra="--capacity-mode ${cfg%%+*}"
    [[ $cfg == *+sts ]] && extra="$extra --sps-curve $CURVE --online-sts"
    # shellcheck disable=SC2086
    dspark serve $SERVE $extra --port $port >"$OUT/$SETUP/serve-$cfg.log" 2>&1 &
    pid=$!
    up=0
    for _ in $(seq 300); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null && { up=1; break; }
      kill -0 $pid 2>/dev/null || break  # the server exited: its log says why
      sleep 1
    done
    if [[ $up != 1 ]]; then
      echo "gsm8k: the $cfg server never answered /health (see serve-$cfg.log)" | tee -a "$OUT/$SETUP/gsm8k.log"
      kill -INT $pid 2>/dev/null; wait $pid
      continue
    fi
    # shellcheck disable=SC2086
    dspark eval gsm8k --port $port --data /tmp/smol/gsm8k.jsonl -c 256 --max-tokens "${GSM8K_MAX_TOKENS:-256}" \
      ${GSM8K_LIMIT:+--limit $GSM8K_LIMIT} \
      -o "$OUT/$SETUP/gsm8k-$cfg.jsonl" 2>&1 | tail -3 | tee -a "$OUT/$SETUP/gsm8k.log"
    kill -INT $pid; wait $pid
  done
  [[ -f $OUT/$SETUP/gsm8k-none.jsonl && -f $OUT/$SETUP/gsm8k-varlen+sts.jsonl ]] &&
    dspark eval gsm8k --compare "$OUT/$SETUP/gsm8k-none.jsonl" "$OUT/$SETUP/gsm8k-varlen+sts.jsonl" \
      | tee -a "$OUT/$SETUP/gsm8k.log"
  echo "gsm8k: $((SECONDS - t0)) s" | tee -a "$OUT/$SETUP/stages.txt"
  exit 0
fi

dspark bench --serve --configs "$CONFIGS" --sps-curve "$CURVE" --serve-args "$SERVE" -c "$CONC" --waves "$WAVES" \
  --max-tokens "$TOK" --temperature 1 "${DATA[@]}" ${BENCH_EXTRA:+$BENCH_EXTRA} -o "$OUT/$SETUP/bench" 2>&1 \
  | tee "$OUT/$SETUP/bench.log"
echo "bench: $((SECONDS - t0)) s" | tee -a "$OUT/$SETUP/stages.txt"
