#!/usr/bin/env bash
# vLLM 0.33 on the H200 with the dspark plugin: one sitting, after vLLM was staged and installed there
# (docs: the GPU host notes; /tmp/site holds vLLM and its torch). Usage, from the project root:
#
#   bash benchmarks/vllm_h200.sh OUT proof           # SmolLM2-135M shape: nospec, all, upstream, varlen, mask, c=8,64
#   bash benchmarks/vllm_h200.sh OUT scaled          # Llama-3-8B shape, k=7: the same configs at c=16,64,256
#                                                    # (ANATOMY=1: each served step's anatomy too, OUT/scaled/anatomy)
#   bash benchmarks/vllm_h200.sh OUT lossless        # greedy token ids of upstream/varlen/mask against nospec
#   bash benchmarks/vllm_h200.sh OUT lossless-real   # the same with real SmolLM2 weights and its distilled draft,
#                                                    # then SMOKE (16) concurrent requests per config; exit 3:
#                                                    # all served, some output differs; 1: a config failed;
#                                                    # 5/6: one did not start (6: not for want of memory)
#                                                    # (KV_GIB=G: the servers start together, G GiB of KV each;
#                                                    # PREFIX_CACHING=off: served without it, as the defer A/B
#                                                    # needs, which exits 4 where the deferring draft drafts worse)
#   bash benchmarks/vllm_h200.sh OUT profile         # dspark profile-sps --engine vllm (proof then uses it)
#   bash benchmarks/vllm_h200.sh OUT profile-scaled  # the same for the Llama-3-8B shape (scaled then uses it)
#   bash benchmarks/vllm_h200.sh OUT anatomy         # where a step's time goes, 8B shape, 64 requests: no spec,
#                                                    # ours paused (and two ablations), verify-all, mask paused
#
# Tables come from `dspark bench --base-url` (one summary over every config in OUT/<stage>/bench; cells
# resume). An 8B-shaped server takes ~2.5 min to start, so the scaled matrix spans several commands on the
# GPU host (each limited to 10 minutes there): give every command the same OUT under /tmp on the host (it
# stays while the host is held) with a few CONFIGS each -- e.g. nospec,all / upstream,varlen /
# mask,varlen-nosat / varlen-nosts,varlen-startup -- and copy it to the command's output folder at its end.
# OVERLAP=N starts N configs' servers together (each once the previous one has sized its KV cache; graph
# capture, most of a start, overlaps) and measures them one after another, every server of the group up:
# with GPU_UTIL=0.22 (31 GB each: 16 GB of 8B weights, ~12 GB of KV) two groups of four cover issue 6's
# eight configs, e.g. OVERLAP=4 GPU_UTIL=0.22 CONFIGS=nospec,all,upstream,varlen, then
# CONFIGS=mask,varlen-nosat,varlen-nosts,varlen-startup (sections 14-18). KV_GIB=G gives every server a G GiB KV
# cache (--kv-cache-gib: no memory profile), and the group's servers start all at once instead of in a row.
# VLLM_ROUNDS=N measures each group in N paired rounds (--rounds; OUT/scaled/paired.md), each group with its own
# no-speculation server to pair with (CONFIGS=nospec#2,mask,...). Servers run vLLM's own default
# compilation (torch.compile, piecewise graphs for steps that carry a prompt chunk); COMPILATION=decode-graphs
# serves decode-only graphs with eager mixed steps instead (--compilation; docs/PERFORMANCE.md sections 28-29).
# API_SERVERS=N gives every server N API processes (--api-servers). The scaled stage refuses to run without
# OUT/profile-scaled/sps_curve.json unless STARTUP_CURVE=1 (ours then price steps by vLLM's start-up profile). VLLM_CONC sets the
# scaled stage's concurrencies (default 16,64,256), STARTUP_TIMEOUT its servers' (--startup-timeout).
#
# Models are weightless (config + tokenizer, --load-format dummy: real step costs); acceptance comes from
# vLLM's synthetic rejection sampler with a V4-Flash-like decay (conditional 0.8 ... 0.08 along the block).
set -euo pipefail
OUT="$1"; STAGE="${2:-proof}"
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD" PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
# vLLM 0.33 picks the speculative method from the draft's path ("dspark" in it -> method dspark): keep it out.
export DSPARK_CACHE_DIR="${DSPARK_CACHE_DIR:-/tmp/mcache}"
RATES="0.8,0.7,0.6,0.5,0.35,0.2,0.08"
models() {  # print "TARGET DRAFT" weightless checkpoint dirs for a target shape and a draft spec
  python3 -c "from dspark_cli.engines.embedded.shapes import resolve_random as r; p = r('$1', '$2'); print(p.target, p.draft)"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/machine.txt"
# Ours use the measured curve when the profile stage ran first, else vLLM's start-up profile.
OURS='{"online_sts": true}'
[[ -f $OUT/profile/sps_curve.json ]] && OURS="{\"online_sts\": true, \"sps_curve\": \"$OUT/profile/sps_curve.json\"}"
# OUT/keep-draft-current (the queue writes it when the smoke stage before the matrix failed to serve): ours keep
# the draft's K/V current while paused (draft_catchup_tokens 0) instead of catching it up (engines/vllm/upkeep.py).
KEEP=""
[[ -f $OUT/keep-draft-current ]] && KEEP=', "draft_catchup_tokens": 0'
# OUT/plain-paused-steps (the queue writes it once the lossless check passed with PLAIN_IF_LOSSLESS=1): ours
# schedule the step after a paused one as plain decoding (plain_paused_steps).
[[ -f $OUT/plain-paused-steps ]] && KEEP="$KEEP"', "plain_paused_steps": true'
OURS_SCALED="{\"online_sts\": true$KEEP}"
# A curve-source A/B: ALT_SPS_CURVE=FILE serves config varlen-alt, varlen priced by that curve.
ALT_CURVE=()
[[ -n ${ALT_SPS_CURVE-} ]] && ALT_CURVE=(--alt-sps-curve "$ALT_SPS_CURVE")
[[ -f $OUT/profile-scaled/sps_curve.json ]] && \
  OURS_SCALED="{\"online_sts\": true, \"sps_curve\": \"$OUT/profile-scaled/sps_curve.json\"$KEEP}"
profile() {  # TARGET DRAFT OUTDIR MAX_NUM_SEQS: dspark profile-sps --engine vllm with the serving stages' flags
  mkdir -p "$3"
  python3 -m dspark_cli.cli profile-sps --engine vllm "$1" -o "$3/sps_curve.json" \
    --speculative-config "{\"method\":\"draft_model\",\"model\":\"$2\",\"num_speculative_tokens\":7,\"dspark_capacity_verification_mode\":\"varlen\"}" \
    --engine-args "{\"load_format\":\"dummy\",\"max_model_len\":2048,\"max_num_seqs\":$4,\"gpu_memory_utilization\":0.35,\"dtype\":\"bfloat16\",\"compilation_config\":$(compilation_json),\"enable_flashinfer_autotune\":false}" \
    2>&1 | tee "$3/profile.log"
}
# The profile's compilation (PROFILE_COMPILATION, a vllm_adaptive.py --compilation name): decode-graphs, as every
# curve so far was profiled. The curve prices decode steps, FULL graphs under either compilation; a profile under
# piecewise has not run yet.
compilation_json() {
  python3 -c "import json, sys; from benchmarks.vllm_adaptive import COMPILATIONS
print(json.dumps(COMPILATIONS[sys.argv[1]]))" "${PROFILE_COMPILATION:-decode-graphs}"
}
case "$STAGE" in
  proof)
    read -r TARGET DRAFT < <(models random:smollm2-135m random:small:layers=2)
    python3 benchmarks/vllm_adaptive.py --model "$TARGET" --draft "$DRAFT" --out "$OUT/proof" --load-format dummy \
      --k 7 --synthetic-rates "$RATES" --configs "${CONFIGS:-nospec,all,upstream,varlen,mask}" \
      --concurrency 8,64 --num-prompts 128 --input-len 128 --output-len 128 --dspark "$OURS" ;;
  profile)  # `dspark profile-sps --engine vllm` with the proof stage's engine flags (issue: profile-sps on vLLM)
    read -r TARGET DRAFT < <(models random:smollm2-135m random:small:layers=2)
    profile "$TARGET" "$DRAFT" "$OUT/profile" 128 ;;
  profile-scaled)  # the same with the scaled stage's engine flags
    read -r TARGET DRAFT < <(models random:llama-3-8b random:small:layers=1)
    profile "$TARGET" "$DRAFT" "$OUT/profile-scaled" 256 ;;
  lossless)  # greedy outputs of every config against no speculation (real verification, no synthetic)
    read -r TARGET DRAFT < <(models random:smollm2-135m random:small:layers=2)
    python3 benchmarks/vllm_adaptive.py --model "$TARGET" --draft "$DRAFT" --out "$OUT/lossless" --load-format dummy \
      --k 7 --configs "${CONFIGS:-nospec,upstream,varlen,mask}" --lossless 8 --dspark '{"online_sts": true}' \
      --overlap-starts "${OVERLAP:-1}" --gpu-memory-utilization "${GPU_UTIL:-0.35}" ;;
  lossless-real)  # the same check with real weights: SmolLM2-135M and its distilled draft, as plain Llama dirs
    # Converted with the host's own torch and the gguf wheel of /tmp/dspark-site (carry .whl at the start),
    # from the GGUF parts in /tmp/smol (carry .carry/smol/part1..4, as for h200_matrix.sh's real setup).
    # BATCHED_TOKENS caps the requests (128 otherwise) at BATCHED_TOKENS / (K + 3), K=7 here: vLLM 0.33's warm-up
    # of a draft_model server under torch.compile overflows a budget smaller than max_num_seqs x (K + 3)
    # (contract.warmup_overflow; 256 tokens with 128 requests stopped every drafting server of the check in
    # section 37). vLLM's own manager (upstream) then stops in its start-up profile at such budgets (section 38,
    # contract.profile_overflow; vllm_adaptive.py refuses it), so the default configs leave it out there. The
    # smoke sends 16.
    default_configs=nospec,upstream,varlen,mask
    [[ -n ${BATCHED_TOKENS-} ]] && default_configs=nospec,varlen,mask
    # A pair that could not be built (parts or gguf missing) exits 7: no served path was tried (the queue reads 1 as
    # a config that failed while serving, and would have served the matrix another way for it).
    read -r TARGET DRAFT < <(env PYTHONPATH="/tmp/dspark-site:$PWD" python3 benchmarks/vllm_real_pair.py \
      "$OUT/real-pair" --parts /tmp/smol) || true
    [[ -n ${TARGET:-} && -n ${DRAFT:-} ]] || { echo "FATAL: the real SmolLM2 pair was not built" >&2; exit 7; }
    python3 benchmarks/vllm_adaptive.py --model "$TARGET" --draft "$DRAFT" --out "$OUT/lossless-real" \
      --k 7 --configs "${CONFIGS:-$default_configs}" --lossless 8 --lossless-text --smoke "${SMOKE:-16}" \
      --dspark '{"online_sts": true}' --overlap-starts "${OVERLAP:-1}" --gpu-memory-utilization "${GPU_UTIL:-0.35}" \
      ${COMPILATION:+--compilation "$COMPILATION"} ${KV_GIB:+--kv-cache-gib "$KV_GIB"} \
      ${PREFIX_CACHING:+--prefix-caching "$PREFIX_CACHING"} ${BATCHED_TOKENS:+--max-num-batched-tokens "$BATCHED_TOKENS"} \
      ${BATCHED_TOKENS:+--max-num-seqs $((BATCHED_TOKENS / 10 < 128 ? BATCHED_TOKENS / 10 : 128))} ;;
  scaled)
    # Ours without the profiled curve would be the varlen-startup ablation under other names: refused unless
    # asked for (STARTUP_CURVE=1); the queues profile or copy the curve first.
    if [[ ! -f $OUT/profile-scaled/sps_curve.json && ${STARTUP_CURVE:-0} != 1 ]]; then
      echo "no $OUT/profile-scaled/sps_curve.json: run the profile-scaled stage first (or STARTUP_CURVE=1)" >&2
      exit 2
    fi
    read -r TARGET DRAFT < <(models random:llama-3-8b random:small:layers=1)
    python3 benchmarks/vllm_adaptive.py --model "$TARGET" --draft "$DRAFT" --out "$OUT/scaled" --load-format dummy \
      --k 7 --synthetic-rates "$RATES" --configs "${CONFIGS:-nospec,all,upstream,varlen,mask}" --max-num-seqs 256 \
      --concurrency "${VLLM_CONC:-16,64,256}" --num-prompts 512 --input-len 128 --output-len 128 --dspark "$OURS_SCALED" \
      --overlap-starts "${OVERLAP:-1}" --gpu-memory-utilization "${GPU_UTIL:-0.35}" ${ANATOMY:+--anatomy} \
      ${KV_GIB:+--kv-cache-gib "$KV_GIB"} ${VLLM_ROUNDS:+--rounds "$VLLM_ROUNDS"} \
      ${COMPILATION:+--compilation "$COMPILATION"} ${STARTUP_TIMEOUT:+--startup-timeout "$STARTUP_TIMEOUT"} \
      ${API_SERVERS:+--api-servers "$API_SERVERS"} "${ALT_CURVE[@]}" ;;
  anatomy)
    read -r TARGET DRAFT < <(models random:llama-3-8b random:small:layers=1)
    CURVE=() && [[ -f $OUT/profile-scaled/sps_curve.json ]] && CURVE=(--sps-curve "$OUT/profile-scaled/sps_curve.json")
    python3 benchmarks/vllm_step_anatomy.py --model "$TARGET" --draft "$DRAFT" --out "$OUT/anatomy" "${CURVE[@]}" \
      --configs "${CONFIGS:-nospec,paused,all,mask-paused}" -c "${CONC:-64}" ;;
  *) echo "unknown stage $STAGE (proof|scaled|lossless|lossless-real|profile|profile-scaled|anatomy)" >&2
     exit 2 ;;
esac
