#!/usr/bin/env bash
# After the start-up sampler warm-up: do drafting steps at new batch sizes still stall? On the GPU host, from
# the repository root (orjson's wheel in .whl/): the sampler's GPU test (no compile in serving after the
# warm-up), then no speculation against varlen + SPS at T=1 on random SmolLM2-135M weights with a random
# 4-layer draft (acceptance ~0: drafting pauses, and the probes of a draining batch draft at odd sizes).
#   OUT=DIR bash benchmarks/h200_sampler_recheck.sh        # ~2.5 min; DEV=cpu C=2 W=1 T=8 checks the plumbing
set -o pipefail
DEV=${DEV:-cuda}; C=${C:-16}; W=${W:-8}; T=${T:-128}
export PYTHONPATH=/tmp/dspark-site:$PWD PYTHONUNBUFFERED=1 DSPARK_CACHE_DIR=/tmp/dc
compgen -G ".whl/*.whl" >/dev/null && python3 -m pip install -q --no-index --no-deps --target /tmp/dspark-site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m dspark_cli.cli "$@"\n' >/tmp/bin/dspark && chmod +x /tmp/bin/dspark; export PATH=/tmp/bin:$PATH
[ "$DEV" = cuda ] && timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_core_triton_rejection.py -k no_sampler_compile 2>&1 | tail -2
TOK=$(python3 -c "from dspark_cli.engines.embedded.shapes import resolve_random as r; print(r('random:smollm2-135m', None).tokenizer)")
timeout ${BT:-125} dspark bench --serve --configs nospec,varlen --sps-curve benchmarks/results/h200/profile_sps/smollm2.json --serve-args "--model random:smollm2-135m --draft random:small:layers=4 -k 7 --max-num-seqs 256 --device $DEV" -c $C --waves $W --max-tokens $T --temperature 1 --dataset random --input-len 128 --tokenizer "$TOK" -o ${OUT:-/tmp/rc}/recheck 2>&1 | grep -av "━" | tail -9
