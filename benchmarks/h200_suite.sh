#!/usr/bin/env bash
# One sitting on the GPU host: the checks and timings that need CUDA, each stage's output under OUT_DIR.
#
#   benchmarks/h200_suite.sh OUT_DIR STAGE...
#
# Stages: core (core_step.py + GPU tests of the core), gputests (those GPU tests alone), attention (Triton paged attention check + tests),
#         engine (embedded_engine.py: lossless with graphs, host syncs, step costs),
#         profile (profile-sps curves: SmolLM2-135M shape and Llama-3-8B shape, K=7, 256 requests).
# The host has torch + triton but no orjson: bring its wheel (.whl/) and it is installed into /tmp/dspark-site (apart from the vLLM set in /tmp/site).
set -uo pipefail
OUT=${1:?usage: h200_suite.sh OUT_DIR STAGE...}
shift
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/dspark-site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m dspark_cli.cli "$@"\n' >/tmp/bin/dspark && chmod +x /tmp/bin/dspark
export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/machine.txt"
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
        tests/test_triton_attention.py tests/test_embedded_stalls.py 2>&1 | tee "$OUT/core_gpu_tests.full.log" \
        | tail -15 | tee "$OUT/core_gpu_tests.log" || status=1 ;;  # the full log keeps the tracebacks
    attention)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_attention.py 2>&1 | tail -15 \
        | tee "$OUT/attention_gpu_tests.log" || status=1
      python3 benchmarks/attention_check.py --out "$OUT/attention" 2>&1 | tee "$OUT/attention.log" || status=1 ;;
    engine)
      python3 benchmarks/embedded_engine.py --out "$OUT/embedded_engine" 2>&1 | tee "$OUT/embedded_engine.log" || status=1 ;;
    profile)
      K=${K:-7} MAX_NUM_SEQS=${MAX_NUM_SEQS:-256} SMOLLM2=${SMOLLM2:-random:smollm2-135m} \
        bash benchmarks/profile_sps_gpu.sh "$OUT/profile_sps" 2>&1 | tee "$OUT/profile_sps.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
  echo "stage $stage: $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
done
exit $status
