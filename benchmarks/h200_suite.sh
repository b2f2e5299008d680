#!/usr/bin/env bash
# One sitting on the GPU host: the checks and timings that need CUDA, each stage's output under OUT_DIR.
#
#   benchmarks/h200_suite.sh OUT_DIR STAGE...
#
# Stages: core (core_step.py + GPU tests of the core), gputests (those GPU tests alone), attention (Triton paged attention check + tests),
#         engine (embedded_engine.py: lossless with graphs, host syncs, step costs),
#         profile (profile-sps curves: SmolLM2-135M shape and Llama-3-8B shape, K=7, 256 requests),
#         fiwarm (build FlashInfer's kernel modules for the SmolLM2 and Llama-3-8B head shapes: JIT, minutes),
#         backends (attention_backends.py: FlashInfer against the Triton kernel, checked, per layer),
#         prefill (prefill_graphs.py: prefills through the ragged graph families against eager ones; SHAPES=...),
#         serve (issue 7's serving proof: SmolLM2-135M + its draft, nospec / none / varlen at c=1,16,64,256,
#                GSM8K prompts, greedy; BACKEND=auto|triton|flashinfer, CONFIGS=..., C1=0 skips c=1; needs the
#                SmolLM2 parts in /tmp/smol).
# The host has torch + triton but no orjson: bring its wheel (.whl/) and it is installed into /tmp/dspark-site (apart from the vLLM set in /tmp/site).
# FlashInfer (62 MB) travels in pieces: `split -b 20m` its wheel into .carry/fi/partN/, carry each, `cat` them into
# /tmp/fistage/<wheel name> on the host; every stage installs what lies there (with .whl's apache-tvm-ffi).
# FlashInfer JIT-builds its kernel module per head dim on first use (~37 s each on the host, cached for its life).
set -uo pipefail
OUT=${1:?usage: h200_suite.sh OUT_DIR STAGE...}
shift
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl >/dev/null 2>&1
fi
if compgen -G "/tmp/fistage/*.whl" >/dev/null && [[ ! -d /tmp/dspark-site/flashinfer ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site /tmp/fistage/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/dspark-site:$PWD PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export DSPARK_CACHE_DIR=${DSPARK_CACHE_DIR:-/tmp/dcache}
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m dspark_cli.cli "$@"\n' >/tmp/bin/dspark && chmod +x /tmp/bin/dspark
export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/machine.txt"
python3 -c 'from dspark_cli.engines.embedded.flashinfer_attention import flashinfer_status as s; print("flashinfer:", s() or "ok")' \
  | tee -a "$OUT/machine.txt"
status=0
for stage in "$@"; do
  t0=$SECONDS
  case $stage in
    core | gputests)
      if [[ $stage == core ]]; then
        python3 benchmarks/core_step.py --out "$OUT/core_step" 2>&1 | tee "$OUT/core_step.log" || status=1
      fi
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_core_rejection.py tests/test_core_capacity.py \
        tests/test_core_sts.py tests/test_core_layout.py tests/test_core_triton_rejection.py tests/test_vllm_manager.py \
        tests/test_embedded_engine_step.py tests/test_embedded_synthetic.py tests/test_embedded_seeded.py \
        tests/test_triton_attention.py tests/test_embedded_stalls.py tests/test_flashinfer_attention.py 2>&1 | tee "$OUT/core_gpu_tests.full.log" \
        | tail -15 | tee "$OUT/core_gpu_tests.log" || status=1 ;;  # the full log keeps the tracebacks
    attention)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_attention.py 2>&1 | tail -15 \
        | tee "$OUT/attention_gpu_tests.log" || status=1
      python3 benchmarks/attention_check.py --out "$OUT/attention" 2>&1 | tee "$OUT/attention.log" || status=1 ;;
    engine)
      python3 benchmarks/embedded_engine.py --out "$OUT/embedded_engine" 2>&1 | tee "$OUT/embedded_engine.log" || status=1 ;;
    fiwarm)
      python3 - <<'PY' 2>&1 | tee "$OUT/fiwarm.log" || status=1
import time, torch
from dspark_cli.engines.embedded.flashinfer_attention import FlashInferPagedAttention
backend = FlashInferPagedAttention(torch.device("cuda"))
for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):
    t0 = time.perf_counter()
    cache = torch.zeros(4, 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    backend.warm_up(heads, dim, cache, cache, 8)
    print(f"flashinfer kernels for H={heads} KVH={kv_heads} D={dim}: {time.perf_counter() - t0:.1f} s", flush=True)
PY
      ;;
    prefill)  # prefill_graphs.py: ragged CUDA-graph prefills against eager ones (SHAPES="smollm2-135m llama-3-8b")
      # shellcheck disable=SC2046
      python3 benchmarks/prefill_graphs.py --out "$OUT/prefill_graphs" $(printf -- '--shape %s ' ${SHAPES:-smollm2-135m}) \
        2>&1 | tee "$OUT/prefill_graphs.log" || status=1 ;;
    backends)
      python3 benchmarks/attention_backends.py --out "$OUT/attention_backends" 2>&1 | tee "$OUT/attention_backends.log" \
        || status=1 ;;
    serve)
      python3 benchmarks/smollm2_parts.py --parts /tmp/smol >/dev/null || { status=1; continue; }
      SERVE_OUT=$OUT/serve_${BACKEND:-auto}
      mkdir -p "$SERVE_OUT"
      SA="--model smollm2-135m --draft auto -k 7 --max-num-seqs 256 --device cuda --attention-backend ${BACKEND:-auto}"
      CURVE=$SERVE_OUT/sps_curve.json
      dspark profile-sps smollm2-135m --draft auto -k 7 --max-num-seqs 256 --device cuda -o "$CURVE" \
        --engine-args "{\"attention_backend\": \"${BACKEND:-auto}\"}" --plot "${CURVE%.json}.png" 2>&1 \
        | tee "$SERVE_OUT/profile.log" || status=1
      # Equal work per cell: 4 waves at 16-256 requests, 16 requests one at a time (section 6's c=1 cell).
      dspark bench --serve --configs "${CONFIGS:-nospec,none,varlen}" --sps-curve "$CURVE" --serve-args "$SA" \
        -c 16,64,256 --waves 4 --max-tokens 128 --dataset /tmp/smol/gsm8k.jsonl -o "$SERVE_OUT/bench" 2>&1 \
        | tee "$SERVE_OUT/bench.log" || status=1
      if [[ ${C1:-1} != 0 ]]; then  # C1=0: a repeat of the c=16-256 cells alone
        dspark bench --serve --configs "${CONFIGS:-nospec,none,varlen}" --sps-curve "$CURVE" --serve-args "$SA" \
          -c 1 -n 16 --max-tokens 128 --dataset /tmp/smol/gsm8k.jsonl -o "$SERVE_OUT/bench_c1" 2>&1 \
          | tee "$SERVE_OUT/bench_c1.log" || status=1
      fi ;;
    profile)
      K=${K:-7} MAX_NUM_SEQS=${MAX_NUM_SEQS:-256} SMOLLM2=${SMOLLM2:-random:smollm2-135m} \
        bash benchmarks/profile_sps_gpu.sh "$OUT/profile_sps" 2>&1 | tee "$OUT/profile_sps.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
  echo "stage $stage: $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
done
exit $status
