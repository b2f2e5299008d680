#!/usr/bin/env bash
# vLLM 0.33 on the H200 with the dspark plugin: one sitting, after vLLM was staged and installed there
# (docs: the GPU host notes; /tmp/site holds vLLM and its torch). Usage, from the project root:
#
#   bash benchmarks/vllm_h200.sh OUT proof     # SmolLM2-135M shape: nospec, all, upstream, varlen, mask at c=8,64
#   bash benchmarks/vllm_h200.sh OUT scaled    # Llama-3-8B shape, k=7: the same configs at c=16,64,256
#   bash benchmarks/vllm_h200.sh OUT lossless  # greedy token ids of upstream/varlen/mask against nospec
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
case "$STAGE" in
  proof)
    read -r TARGET DRAFT < <(models random:smollm2-135m random:small:layers=2)
    python3 benchmarks/vllm_adaptive.py --model "$TARGET" --draft "$DRAFT" --out "$OUT/proof" --load-format dummy \
      --k 7 --synthetic-rates "$RATES" --configs "${CONFIGS:-nospec,all,upstream,varlen,mask}" \
      --concurrency 8,64 --num-prompts 128 --input-len 128 --output-len 128 --dspark '{"online_sts": true}' ;;
  lossless)  # greedy outputs of every config against no speculation (real verification, no synthetic)
    read -r TARGET DRAFT < <(models random:smollm2-135m random:small:layers=2)
    python3 benchmarks/vllm_adaptive.py --model "$TARGET" --draft "$DRAFT" --out "$OUT/lossless" --load-format dummy \
      --k 7 --configs "${CONFIGS:-nospec,upstream,varlen,mask}" --lossless 8 --dspark '{"online_sts": true}' ;;
  scaled)
    read -r TARGET DRAFT < <(models random:llama-3-8b random:small:layers=1)
    python3 benchmarks/vllm_adaptive.py --model "$TARGET" --draft "$DRAFT" --out "$OUT/scaled" --load-format dummy \
      --k 7 --synthetic-rates "$RATES" --configs "${CONFIGS:-nospec,all,upstream,varlen,mask}" --max-num-seqs 256 \
      --concurrency 16,64,256 --num-prompts 512 --input-len 128 --output-len 128 --dspark '{"online_sts": true}' ;;
  *) echo "unknown stage $STAGE (proof|scaled|lossless)" >&2; exit 2 ;;
esac
