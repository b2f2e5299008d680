#!/usr/bin/env bash
# The seed's DeepSeek-V4-Flash experiment with dspark commands: profile the SPS curve, then for each
# config serve, bench at concurrency 16..256 and score GSM8K. Runs as-is on 4xB200 (TP4, expert parallel).
#   SPEED_BENCH=/path/to/speed-bench ./run.sh            # results under ./results
#   DRY_RUN=1 ./run.sh                                   # print the vLLM command lines only
set -euo pipefail
cd "$(dirname "$0")"

TARGET=${TARGET:-nvidia/DeepSeek-V4-Flash-NVFP4}
DRAFT=${DRAFT:-deepseek-ai/DeepSeek-V4-Flash-DSpark}
PORT=${PORT:-8011}
OUT=${OUT:-results}
CONCURRENCY=${CONCURRENCY:-16,32,64,128,256}
SPEED_BENCH=${SPEED_BENCH:-}

# The seed's engine flags: same for every config (only the speculative config varies). The target goes first
# for profile-sps (MODEL, as for vllm serve) and in --model for dspark serve.
ENGINE=(
  --tokenizer "$TARGET" --tokenizer-mode deepseek_v4 --trust-remote-code
  --dtype bfloat16 --max-model-len 8192 --tensor-parallel-size 4 --enable-expert-parallel
  --block-size 256 --gpu-memory-utilization 0.5 --kv-cache-dtype fp8
  --max-num-batched-tokens 16384 --max-num-seqs 256
  --compilation-config '{"max_cudagraph_capture_size": 2048}' --moe-backend flashinfer_trtllm
)
# The DSpark draft, k=7, probabilistic draft sampling.
BASE='"method":"dspark","model":"'"$DRAFT"'","attention_backend":"FLASH_ATTN","num_speculative_tokens":7,"draft_sample_method":"probabilistic"'
CAP='"dspark_confidence_threshold":0.0,"dspark_sps_curve":"sps_curve.json"'
declare -A SPEC=(
  [nocap]="{$BASE}"
  [mask]="{$BASE,$CAP,\"dspark_capacity_verification_mode\":\"mask\"}"
  [varlen]="{$BASE,$CAP,\"dspark_capacity_verification_mode\":\"varlen\"}"
  [mask-sts]="{$BASE,$CAP,\"dspark_capacity_verification_mode\":\"mask\",\"dspark_online_sts\":true}"
  [varlen-sts]="{$BASE,$CAP,\"dspark_capacity_verification_mode\":\"varlen\",\"dspark_online_sts\":true}"
)
CONFIGS=(nocap mask varlen mask-sts varlen-sts)

PROFILE_SPEC="{$BASE,\"dspark_confidence_threshold\":0.0,\"dspark_capacity_verification_mode\":\"varlen\"}"

if [[ -n "${DRY_RUN:-}" ]]; then
  dspark profile-sps --engine vllm --dry-run "$TARGET" "${ENGINE[@]}" --speculative-config "$PROFILE_SPEC" --output sps_curve.json
  if [[ ! -f sps_curve.json ]]; then
    echo "# (serve lines need sps_curve.json: run the profile first)"
    exit 0
  fi
  for c in "${CONFIGS[@]}"; do
    dspark serve --engine vllm --dry-run --model "$TARGET" "${ENGINE[@]}" --port "$PORT" --speculative-config "${SPEC[$c]}"
  done
  exit 0
fi

mkdir -p "$OUT"
# 1. The SPS curve: one breakpoint per CUDA-graph capture size, draft cost and per-step overhead.
if [[ ! -f sps_curve.json ]]; then
  dspark profile-sps --engine vllm "$TARGET" "${ENGINE[@]}" --speculative-config "$PROFILE_SPEC" --output sps_curve.json
fi

BENCH_DATA=(--dataset gsm8k)
[[ -n "$SPEED_BENCH" ]] && BENCH_DATA=(--dataset speed-bench --dataset-path "$SPEED_BENCH" --speed-bench-subset qualitative)

for c in "${CONFIGS[@]}"; do
  # 2. Serve this config (same engine flags, SPEC varies per column).
  dspark serve --engine vllm --model "$TARGET" "${ENGINE[@]}" --port "$PORT" --speculative-config "${SPEC[$c]}" > "$OUT/serve-$c.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $SERVER 2>/dev/null || { echo "server for $c died; see $OUT/serve-$c.log"; exit 1; }
    sleep 5
  done
  # STS configs get one warm-up pass first (the seed's protocol).
  WARM=()
  [[ "$c" == *sts ]] && WARM=(--sts-warmup-prompts 128)
  # 3. Bench: 256 prompts x 1024 output tokens, temperature 1.0, equal work per cell.
  dspark bench --base-url "http://127.0.0.1:$PORT" --label "$c" --model "$TARGET" "${BENCH_DATA[@]}" \
    --concurrency "$CONCURRENCY" --num-prompts 256 --max-tokens 1024 --ignore-eos --temperature 1.0 \
    "${WARM[@]}" --results-dir "$OUT/bench"
  # 4. Accuracy: 5-shot GSM8K must not move with the capacity mode.
  dspark eval gsm8k --base-url "http://127.0.0.1:$PORT" --model "$TARGET" --num-shots 5 \
    --output "$OUT/gsm8k-$c.jsonl"
  kill $SERVER; wait $SERVER 2>/dev/null || true
  trap - EXIT
done
echo "results in $OUT/ (bench table: $OUT/bench)"
