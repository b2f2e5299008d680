#!/usr/bin/env bash
# The embedded-engine measurements of issues 7 and 8 on a two-GPU H200 host, as two background queues, one
# per GPU, so that each device command returns at once and later commands can bring files in (the SmolLM2
# parts, the vLLM wheels) while the GPUs work. Every queue runs on its own GPU; the matrices compare configs
# within one queue, so the other queue's load is common to all of its cells.
#
#   bash benchmarks/h200_two_gpus.sh start ROOT       # copy the repo to ROOT/repo, start both queues
#   GPUS=1 bash benchmarks/h200_two_gpus.sh start ROOT  # a one-GPU host: one queue, the work below in turn
#   QUEUE=stalls bash benchmarks/h200_two_gpus.sh start ROOT  # one GPU: the compile-stall check (queue_stalls)
#   QUEUE=vllm bash benchmarks/h200_two_gpus.sh start ROOT    # one GPU: issue 6 on vLLM 0.33 (queue_vllm)
#   QUEUE=vllm-anatomy bash benchmarks/h200_two_gpus.sh start ROOT  # one GPU: issue 6's step anatomy + re-run
#   QUEUE=vllm-lossless bash benchmarks/h200_two_gpus.sh start ROOT # one GPU: greedy lossless, dummy and real
#   QUEUE=embedded bash benchmarks/h200_two_gpus.sh start ROOT      # one GPU: issue 8, both matrices after the prefill graphs
#   QUEUE=paused bash benchmarks/h200_two_gpus.sh start ROOT        # one GPU: issue 8, paused steps against plain ones
#   QUEUE=interleaved bash benchmarks/h200_two_gpus.sh start ROOT   # one GPU: issue 8's real matrix, servers interleaved
#   QUEUE=mixed bash benchmarks/h200_two_gpus.sh start ROOT         # one GPU: mixed prefills, GPU test + interleaved A/B
#   QUEUE=rounds bash benchmarks/h200_two_gpus.sh start ROOT        # one GPU: issue 8's real matrix in paired rounds (+ mixed twins)
#   QUEUE=floor bash benchmarks/h200_two_gpus.sh start ROOT         # one GPU: the two-server floor (A/A) and the engine process
#   QUEUE=issue8 bash benchmarks/h200_two_gpus.sh start ROOT        # one GPU: issue 8's two matrices on the current code
#                                         (SCALED_FIRST=1: the scaled matrix while the SmolLM2 parts come in)
#   QUEUE=vllm bash benchmarks/h200_two_gpus.sh gpu ROOT  # exit 3 if the GPU cannot hold the queue: the first call
#   bash benchmarks/h200_two_gpus.sh status ROOT      # what each queue is doing, and the tail of its log
#   bash benchmarks/h200_two_gpus.sh collect ROOT DEST  # every result so far as DEST/results.tgz
#
# GPU 0: the scaled matrix (h200_matrix.sh scaled), the long pole (~18 min at 4 waves x 256 tokens).
# GPU 1: the core re-check (h200_suite.sh core), the scheduling-overhead breakdown of the scaled setup
#        (embedded_engine.py --shape llama-3-8b at max_model_len 4096, greedy and at T=1), then -- once /tmp/smol/ready exists
#        (the four SmolLM2 parts copied in, see h200_matrix.sh) -- the real matrix at c=1 (issue 7's proof)
#        and 16..256, then GSM8K.
# GPUS=1: GPU tests, the prepare-phase timing, the real matrix (16..256) once /tmp/smol/ready exists, the
#        scaled matrix, the T=1 overhead breakdown, then GSM8K (23 min in all on the H200, 2026-12-01).
# ROOT should live under /tmp on the host: it stays while the host is held -- and the host is given back,
# queues and files with it, once no device command has run for 30 s: poll `status` (or carry files in)
# at least that often until `collect` has run. The queues run in their own
# process sessions (setsid), so they outlive the command that started them. Env: the matrices' (CONC, WAVES,
# TOK, DEVICE, SCALED_MODEL, GSM8K_LIMIT: see h200_matrix.sh), SCALED_WAVES/SCALED_TOK (3/256),
# REAL_WAVES/REAL_TOK (4/128), REAL_CONC (1,16,32,64,128,256) and OVERHEAD_ARGS (--shape llama-3-8b --max-model-len 4096).
set -uo pipefail
ACTION=${1:?usage: h200_two_gpus.sh gpu|start|status|collect ROOT [DEST]}
ROOT=${2:?usage: h200_two_gpus.sh gpu|start|status|collect ROOT [DEST]}

stage() {  # LABEL COMMAND...: a timestamped line `status` shows, then the command
  echo "[$(date +%T)] $1"
  shift
  "$@"
}

# Cell lengths fit one 30-minute sitting: 3 waves x 256 tokens on the scaled setup (~16 min, 3x the
# decode work of section 9's cells) and 4 x 128 on the real one (~10 min with GSM8K).
queue0() {
  WAVES=${SCALED_WAVES:-3} TOK=${SCALED_TOK:-256} stage "scaled matrix" bash benchmarks/h200_matrix.sh "$ROOT" scaled
}

queue1() {
  stage "core re-check" bash benchmarks/h200_suite.sh "$ROOT/core" core
  # shellcheck disable=SC2086
  stage "scheduling overhead (llama-3-8b)" env PYTHONPATH="/tmp/dspark-site:$PWD" \
    python3 benchmarks/embedded_engine.py ${OVERHEAD_ARGS:---shape llama-3-8b --max-model-len 4096} \
    --out "$ROOT/overhead"
  # The same at temperature 1 with seeded requests, as the matrices serve them (sampling draft pass).
  # shellcheck disable=SC2086
  stage "scheduling overhead at T=1 (llama-3-8b)" env PYTHONPATH="/tmp/dspark-site:$PWD" \
    python3 benchmarks/embedded_engine.py ${OVERHEAD_ARGS:---shape llama-3-8b --max-model-len 4096} \
    --temperature 1 --out "$ROOT/overhead_t1"
  stage "waiting for /tmp/smol/ready" bash -c 'while [[ ! -f /tmp/smol/ready ]]; do sleep 2; done'
  CONC=${REAL_CONC:-1,16,32,64,128,256} WAVES=${REAL_WAVES:-4} TOK=${REAL_TOK:-128} \
    stage "real matrix" bash benchmarks/h200_matrix.sh "$ROOT" real
  stage "gsm8k" bash benchmarks/h200_matrix.sh "$ROOT" gsm8k
}

queue_one() {  # one GPU: what both queues do, one after the other (the GPU tests first, GSM8K last)
  stage "GPU tests" bash benchmarks/h200_suite.sh "$ROOT/core" gputests
  stage "prepare phase" env PYTHONPATH="/tmp/dspark-site:$PWD" python3 benchmarks/prepare_step.py --out "$ROOT/prepare"
  stage "waiting for /tmp/smol/ready" bash -c 'while [[ ! -f /tmp/smol/ready ]]; do sleep 2; done'
  CONC=${REAL_CONC:-16,32,64,128,256} WAVES=${REAL_WAVES:-4} TOK=${REAL_TOK:-128} \
    stage "real matrix" bash benchmarks/h200_matrix.sh "$ROOT" real
  WAVES=${SCALED_WAVES:-3} TOK=${SCALED_TOK:-256} stage "scaled matrix" bash benchmarks/h200_matrix.sh "$ROOT" scaled
  # shellcheck disable=SC2086
  stage "scheduling overhead at T=1 (llama-3-8b)" env PYTHONPATH="/tmp/dspark-site:$PWD" \
    python3 benchmarks/embedded_engine.py ${OVERHEAD_ARGS:---shape llama-3-8b --max-model-len 4096} \
    --temperature 1 --out "$ROOT/overhead_t1"
  stage "gsm8k" bash benchmarks/h200_matrix.sh "$ROOT" gsm8k
}

# One GPU, the check of PERFORMANCE section 11 item 5 (attention variants compiled inside probes): the GPU
# tests (nothing compiles while serving), the real matrix with 8 waves (summary.md lists any cell whose server
# compiled while serving), a torch.profiler breakdown of the real pair's slowest probes at c=16, then the
# SmolLM2-shape step breakdown at T=1 with its "stalls" column (~22 min).
queue_stalls() {
  stage "GPU tests" bash benchmarks/h200_suite.sh "$ROOT/core" gputests
  stage "waiting for /tmp/smol/ready" bash -c 'while [[ ! -f /tmp/smol/ready ]]; do sleep 2; done'
  CONC=${REAL_CONC:-16,32,64,128,256} WAVES=${REAL_WAVES:-8} TOK=${REAL_TOK:-128} \
    stage "real matrix" bash benchmarks/h200_matrix.sh "$ROOT" real
  stage "probe profile (real pair, c=16)" env PYTHONPATH="/tmp/dspark-site:$PWD" \
    python3 benchmarks/probe_profile.py --model smollm2-135m --draft auto --out "$ROOT/probe_profile"
  stage "step breakdown at T=1 (smollm2)" env PYTHONPATH="/tmp/dspark-site:$PWD" \
    python3 benchmarks/embedded_engine.py --temperature 1 --out "$ROOT/steps_t1"
}

# One GPU, issue 6 (vLLM 0.33 on the Llama-3-8B shape): waits for the staged wheels (/tmp/stage/ready, once
# every group of ../shared/tools/vllm-h200/stage.py is copied in), installs them, profiles the scaled curve,
# then issue 6's configs in three groups of servers started together (vllm_group), each with a no-speculation
# server to pair with, in 2 paired rounds (VLLM_ANATOMY: one pass with the served step anatomy): install 1,
# groups ~6-9 min (section 28: 457, 315 and 290 s for groups 1-3 at two waves, the lossless check 330 s;
# section 29: four piecewise servers up in 150 s, their group in 411 s).
# REUSE_CURVE=1: the curve `dspark profile-sps` measured in section 14's sitting (same machine kind) instead of
# profiling again (saves 3 min). REAL_SMOKE=1: first the greedy lossless check with real weights (issue 6 item
# 4; SmolLM2 parts carried to /tmp/smol as for QUEUE=vllm-lossless) over nospec and forced-verification configs
# (varlen-verify; varlen-cycle-plain, pausing and probing often, each paused step's successor plain; mask-plain,
# pruning to half the drafts, likewise), with a concurrent smoke per config; should a config fail while it
# serves, the matrix keeps the draft's K/V current (one that did not start says nothing of that: section 37).
# Section 16's sitting ran nospec, varlen, varlen-current: both of ours accepted no draft (so outputs matched
# trivially), which varlen-verify now rules in or out.
# PLAIN_IF_LOSSLESS=1 (with REAL_SMOKE=1): if the check passes, every config of ours then serves
# plain_paused_steps (ROOT/vllm/plain-paused-steps; varlen-placeholders names the default path beside it).
# REAL_SMOKE=after: the same check after groups 1 and 2, where a sitting short of device time loses it, not
# the matrix; REAL_SMOKE=mid: after group 1 and VLLM_HIGH, before the anatomy and group 2.
# VLLM_HIGH (e.g. nospec@2,all@2,varlen@2,nospec@1#1): after group 1, a group at HIGH_CONC requests only (default
# 256), in paired rounds against its first no-speculation server; `@N` serves a config with N API processes.
queue_vllm() {
  stage "waiting for /tmp/stage/ready" bash -c 'while [[ ! -f /tmp/stage/ready ]]; do sleep 2; done'
  stage "install vLLM" bash /tmp/stage/install.sh || { echo "FATAL: the vLLM install failed (a wheel group missing?)"; return 1; }
  # The manager times steps between CUDA events (engines/vllm/step_clock.py), refits online STS on the device
  # with no host sync (core/sts.py) and stages traces through pinned memory on a side stream: their GPU tests
  # first.
  # Every timing of the sitting reads the step clock: its failure stops the queue (a pipe's tail kept its status
  # from the queue before). The others are said, and the groups go on: none of them serves traces, and a host
  # sync in the STS refit slows a server, which the groups' numbers would show.
  stage "GPU test: step clock" env PYTHONPATH="/tmp/site:$PWD" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_vllm_step_clock.py >"$ROOT/gpu_tests_clock.log" 2>&1
  local clock=$?
  tail -3 "$ROOT/gpu_tests_clock.log"
  [[ $clock == 0 ]] || { echo "FATAL: the step clock's GPU test failed (exit $clock): no timing can be read"; return 1; }
  stage "GPU test: online STS, traces" env PYTHONPATH="/tmp/site:$PWD" python3 -m pytest -q -m gpu \
    -p no:cacheprovider tests/test_core_sts.py tests/test_vllm_manager.py >"$ROOT/gpu_tests.log" 2>&1 ||
    echo "WARNING: a GPU test of online STS or the trace stager failed (gpu_tests.log)"
  tail -3 "$ROOT/gpu_tests.log"
  mkdir -p "$ROOT/vllm/profile-scaled"
  # Without a curve every config of ours would run on vLLM's start-up curve under its own name (vllm_h200.sh
  # refuses that): a curve that is not there stops the queue here. A staged tree has it only if the last
  # staging call put .carry/curve back (docs/PERFORMANCE.md section 8, "How a sitting is run").
  if [[ ${REUSE_CURVE:-0} == 1 ]]; then
    cp benchmarks/results/vllm_h200/scaled-2026-12-01/profile-scaled/sps_curve.json "$ROOT/vllm/profile-scaled/" ||
      { echo "FATAL: REUSE_CURVE=1 but the committed curve is not in the tree (put .carry/curve back)"; return 1; }
  else
    # A failed profile would leave varlen on vLLM's start-up curve unnoticed: the last committed curve instead.
    stage "profile-scaled" bash benchmarks/vllm_h200.sh "$ROOT/vllm" profile-scaled || {
      echo "profile-scaled failed: using benchmarks/results/vllm_h200/profile-scaled/sps_curve.json"
      cp benchmarks/results/vllm_h200/profile-scaled/sps_curve.json "$ROOT/vllm/profile-scaled/" ||
        { echo "FATAL: no profiled curve and no committed one in the tree"; return 1; }; }
  fi
  if [[ ${REAL_SMOKE:-0} == 1 ]]; then
    real_smoke
    local smoke=$?
    [[ $smoke == 1 ]] && { echo "a config failed to serve: the matrix keeps the draft current"; touch "$ROOT/vllm/keep-draft-current"; }
    # 7: the check could not be set up (the real pair not converted: parts or gguf missing): says nothing of any
    # served path, so the matrix serves the default one
    [[ $smoke == 7 ]] && echo "the check could not be set up: the matrix serves the default path"
    # 5 or 6: a config did not start (sections 37-38: vLLM's warm-up, its start-up profile), which says nothing
    # about the served path
    [[ $smoke == 5 || $smoke == 6 ]] && echo "a config did not start: the matrix serves the default path"
    # Outputs that differ from no speculation make the matrix's speeds meaningless: the rest of the sitting is
    # better spent reading the check's diff (MATRIX_IF_DIFFERS=1 measures anyway).
    [[ $smoke == 3 && ${MATRIX_IF_DIFFERS:-0} != 1 ]] && { echo "outputs differ from no speculation: no matrix"; return 3; }
    # PLAIN_IF_LOSSLESS=1: every config of ours serves plain_paused_steps once the check (varlen-cycle-plain and
    # mask-plain among its configs) matched no speculation everywhere; otherwise they serve the default path.
    if [[ ${PLAIN_IF_LOSSLESS:-0} == 1 ]]; then
      if [[ $smoke == 0 ]]; then
        echo "lossless: every config of ours serves plain_paused_steps"; touch "$ROOT/vllm/plain-paused-steps"
      else
        echo "lossless failed (exit $smoke): ours serve the default path"
      fi
    fi
  fi
  # Every group is served with vLLM's own compilation (torch.compile, piecewise graphs for steps that carry a
  # prompt chunk: vllm_adaptive.py's default since section 29, where it took our paused servers' 1-2% loss at 16
  # requests away); COMPILATION=decode-graphs serves them as sections 14-28 did. Mask's paused steps run
  # compacted by default (mask-compact before section 28); uniform mask, paused at 1.5-1.7x a plain step
  # (section 25), and the curve-source ablation last: what a short sitting loses first. An empty VLLM_GROUPn
  # (VLLM_GROUP2=) skips that group, for a budget too short for all of them.
  # ANATOMY_FIRST=1: the anatomy below before group 1 (sections 37 and 38 lost it to the device time, last in line)
  [[ ${ANATOMY_FIRST:-0} == 1 ]] && vllm_anatomy
  vllm_group "scaled, group 1" "${VLLM_GROUP1-nospec,all,upstream,varlen}"
  # Is section 29's slow regime at 256 requests vLLM's API process? The same configs with more of them.
  [[ -n ${VLLM_HIGH-} ]] && VLLM_CONC=${HIGH_CONC:-256} vllm_group "scaled, at ${HIGH_CONC:-256}" "$VLLM_HIGH"
  [[ ${REAL_SMOKE:-0} == mid ]] && real_smoke
  [[ ${ANATOMY_FIRST:-0} == 1 ]] || vllm_anatomy
  vllm_group "scaled, group 2" "${VLLM_GROUP2-nospec#2,mask,varlen-nosat,varlen-nosts}"
  [[ ${REAL_SMOKE:-0} == after ]] && real_smoke
  vllm_group "scaled, group 3" "${VLLM_GROUP3-nospec#3,mask-uniform,varlen-startup}"
}

# The served step anatomy (VLLM_ANATOMY=nospec#a,all#a at ANATOMY_CONC=256, default 16; one round): which steps
# make a cell's time, long ones included -- where verify-all gains at 256 requests, or where a paused server loses
# at 16 (section 29's anatomy run).
vllm_anatomy() {
  [[ -n ${VLLM_ANATOMY-} ]] || return 0
  ANATOMY=1 VLLM_ROUNDS=1 VLLM_CONC=${ANATOMY_CONC:-16} RETRY_IN_ROW=0 \
    vllm_group "scaled, anatomy at ${ANATOMY_CONC:-16}" "$VLLM_ANATOMY"
}

# LABEL CONFIGS: one group of up to four 8B-shaped vLLM servers. KV_GIB (default 11: 87k tokens of a draft_model
# server's KV, where a cell of 256 requests needs ~68k) gives each a fixed KV cache, so the four start together,
# not in a row (section 25: the first of four ready in 106-166 s, where section 18's row took 356 s to bring four
# up). Should a config fail to come up with them started together, its servers are started again in a row
# (KV_GIB= does only that); a server that failed mid-round is not (its cells name its port). VLLM_ROUNDS (default 2) measures the group in paired rounds of
# half the prompts each (vllm_adaptive.py --rounds): every group carries a no-speculation server (nospec#N) to
# pair with, since one cell per config read two servers of the same paused steps 10 points apart (section 25).
vllm_group() {
  local kv=${KV_GIB-11}
  [[ -n $2 ]] || return 0
  # results.json is each invocation's own (results-<time>.json keeps every one): an invocation that stopped before
  # writing it left the group before's, whose failures the retry below would have read as this group's.
  rm -f "$ROOT/vllm/scaled/results.json"
  OVERLAP=4 GPU_UTIL=0.22 CONFIGS=$2 KV_GIB=$kv VLLM_ROUNDS=${VLLM_ROUNDS-2} stage "$1" \
    bash benchmarks/vllm_h200.sh "$ROOT/vllm" scaled && return
  [[ -n $kv && ${RETRY_IN_ROW:-1} == 1 ]] || return 1
  local failed
  # Only configs whose servers never served (no "round" in their error rows): a server that failed mid-round has
  # cells recorded against its port, which a server started again on another port could not resume.
  # and only where a lone start could help (retry_alone: not a cause that repeats, section 38)
  failed=$(python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['results']
print(','.join(dict.fromkeys(x['config'] for x in r if 'error' in x and 'round' not in x
                             and x.get('retry_alone', True))))" "$ROOT/vllm/scaled/results.json") || return 1
  [[ -n $failed ]] || return 1
  echo "$1: $failed failed with the servers started together; again in a row"
  OVERLAP=4 GPU_UTIL=0.22 CONFIGS=$failed KV_GIB= VLLM_ROUNDS=${VLLM_ROUNDS-2} stage "$1, in a row ($failed)" \
    bash benchmarks/vllm_h200.sh "$ROOT/vllm" scaled
}

# issue 6 item 4: greedy lossless with real weights, verification forced on (see queue_vllm). The four SmolLM2
# servers get a fixed KV cache (REAL_KV_GIB, default 2: ~90k tokens of target KV, where the check needs a few
# thousand) and start together: in a row they took 7 of a sitting's 30 minutes (2026-12-03). Should a config
# fail to serve that way (exit 1, or 5 where it did not start; 3 is an output that differs), the check runs again
# with the servers in a row; not on exit 6, where every server that did not start named a cause a lone start
# repeats (section 38: vLLM's start-up profile stopped them all, and the row cost 4 minutes to say so again).
# REAL_PREFIX_CACHING=off serves the check without vLLM's prefix cache, which draft_defer_prompts needs: with
# REAL_SMOKE_CONFIGS=nospec,varlen-cycle-plain,varlen-cycle-defer the check's defer A/B then says whether a draft
# whose prompts waited for the catch-ups drafts as well as one that wrote them (exit 4 where it clearly does not).
# REAL_BATCHED_TOKENS=256 gives the check's servers a small token budget per step, so the concurrent smoke's long
# prompt leaves decoding requests out of steps: with varlen-cycle-placeholders among the configs, a request left
# out of a resuming step comes back holding a paused step's draft ids (never admitted: manager._slot_real).
real_smoke() {
  local configs=${REAL_SMOKE_CONFIGS:-nospec,varlen-verify,varlen-cycle-plain,mask-plain} kv=${REAL_KV_GIB-2} rc=0
  local dir=$ROOT/vllm/lossless-real again
  stage "waiting for /tmp/smol/ready" bash -c 'while [[ ! -f /tmp/smol/ready ]]; do sleep 2; done'
  OVERLAP=4 GPU_UTIL=0.2 CONFIGS=$configs KV_GIB=$kv PREFIX_CACHING=${REAL_PREFIX_CACHING-} \
    BATCHED_TOKENS=${REAL_BATCHED_TOKENS-} stage "lossless, real weights" bash benchmarks/vllm_h200.sh "$ROOT/vllm" lossless-real || rc=$?
  [[ ($rc == 1 || $rc == 5) && -n $kv && -f $dir/lossless.json ]] || return $rc
  # In a row, only the configs that failed (and could pass alone) beside nospec: all six again took 8-14 minutes,
  # more than a sitting has. The first run's files are kept under *-together; an output of it that differed from
  # no speculation (exit 1 is said before that is checked) is the verdict, whatever the retry finds.
  again=$(python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
failed = [r['config'] for r in d.get('errors', []) if r.get('retry_alone', True) and r['config'] != 'nospec']
differ = [n for n, v in d.get('summary', {}).items() if v.get('identical_to_nospec') != v.get('prompts')]
print('differ' if differ else ','.join(dict.fromkeys(['nospec', *failed])) if failed else '')" "$dir/lossless.json") ||
    return $rc
  for f in "$dir"/serve-*.log "$dir/lossless.json"; do
    [[ -f $f && $f != *-together.* ]] && mv "$f" "${f%.*}-together.${f##*.}"
  done
  [[ $again == differ ]] && { echo "outputs differed from no speculation in the first run"; return 3; }
  [[ -n $again ]] || return $rc
  OVERLAP=4 GPU_UTIL=0.2 CONFIGS=$again KV_GIB= PREFIX_CACHING=${REAL_PREFIX_CACHING-} \
    BATCHED_TOKENS=${REAL_BATCHED_TOKENS-} stage "lossless, real weights, in a row ($again)" \
    bash benchmarks/vllm_h200.sh "$ROOT/vllm" lossless-real
}

# One GPU, issue 6's item 4 and the low-load anatomy: the greedy lossless check on the SmolLM2 shape (dummy
# weights), then -- once /tmp/smol/ready exists (the four SmolLM2 parts carried in, and .whl with the first
# call) -- the same with real weights, then the in-process step anatomy at 16 requests (~15 min after staging).
queue_vllm_lossless() {
  stage "waiting for /tmp/stage/ready" bash -c 'while [[ ! -f /tmp/stage/ready ]]; do sleep 2; done'
  stage "install vLLM" bash /tmp/stage/install.sh
  OVERLAP=4 GPU_UTIL=0.2 stage "lossless" bash benchmarks/vllm_h200.sh "$ROOT/vllm" lossless
  stage "waiting for /tmp/smol/ready" bash -c 'while [[ ! -f /tmp/smol/ready ]]; do sleep 2; done'
  OVERLAP=4 GPU_UTIL=0.2 stage "lossless, real weights" bash benchmarks/vllm_h200.sh "$ROOT/vllm" lossless-real
  mkdir -p "$ROOT/vllm/profile-scaled"
  cp benchmarks/results/vllm_h200/scaled-2026-12-01/profile-scaled/sps_curve.json "$ROOT/vllm/profile-scaled/"
  CONC=16 stage "anatomy at 16 requests" bash benchmarks/vllm_h200.sh "$ROOT/vllm" anatomy
}

# One GPU, issue 6 after section 14: where a paused step's 4 ms go (vllm_step_anatomy.py), the greedy lossless
# check, then the four configs the step-timing and allocation fixes change, on the curve profiled in section
# 14's sitting (same machine kind; saves the 3-minute profile): ~19 min after staging (estimate).
queue_vllm_anatomy() {
  stage "waiting for /tmp/stage/ready" bash -c 'while [[ ! -f /tmp/stage/ready ]]; do sleep 2; done'
  stage "install vLLM" bash /tmp/stage/install.sh
  mkdir -p "$ROOT/vllm/profile-scaled"
  cp benchmarks/results/vllm_h200/scaled-2026-12-01/profile-scaled/sps_curve.json "$ROOT/vllm/profile-scaled/"
  stage "anatomy" bash benchmarks/vllm_h200.sh "$ROOT/vllm" anatomy
  OVERLAP=4 GPU_UTIL=0.2 stage "lossless" bash benchmarks/vllm_h200.sh "$ROOT/vllm" lossless
  OVERLAP=4 GPU_UTIL=0.22 CONFIGS=${VLLM_GROUP1:-nospec,all,varlen,varlen-nosat} \
    stage "scaled, group 1" bash benchmarks/vllm_h200.sh "$ROOT/vllm" scaled
}

# One GPU, issue 8 after section 19 (prefill graphs): the GPU tests (the engine-step test changed after that
# sitting), then -- once /tmp/smol/ready exists -- the real matrix with 8-wave cells (its cells' server counters
# give prefill steps and their time), then the scaled matrix at section 11's cell length (3 waves x 256 tokens),
# both with the code of every policy change since section 11. PREFILL=1 adds the prefill timing first;
# SERVE_BACKENDS="triton auto" adds the serving cells per attention backend last (FlashInfer staged in
# /tmp/fistage). ~25 min (2026-12-02: GPU tests 3, real matrix 11, scaled matrix 11).
queue_embedded() {
  stage "GPU tests" bash benchmarks/h200_suite.sh "$ROOT/core" gputests
  [[ ${PREFILL:-0} == 1 ]] && stage "prefill graphs" bash benchmarks/h200_suite.sh "$ROOT/core" prefill
  stage "waiting for /tmp/smol/ready" bash -c 'while [[ ! -f /tmp/smol/ready ]]; do sleep 2; done'
  CONC=${REAL_CONC:-16,32,64,128,256} WAVES=${REAL_WAVES:-8} TOK=${REAL_TOK:-128} \
    stage "real matrix" bash benchmarks/h200_matrix.sh "$ROOT" real
  WAVES=${SCALED_WAVES:-3} TOK=${SCALED_TOK:-256} stage "scaled matrix" bash benchmarks/h200_matrix.sh "$ROOT" scaled
  for backend in ${SERVE_BACKENDS:-}; do
    BACKEND=$backend CONFIGS=nospec,varlen C1=0 stage "serve ($backend)" bash benchmarks/h200_suite.sh "$ROOT/serve" serve
  done
}

# One GPU, issue 8 after section 20: are paused steps dearer than plain ones, and why? (section 20: served on
# SmolLM2 at T=1, varlen's paused steps took 1.11-1.55x no speculation's, mask's 0.93-1.13x, on one code path.)
# First the engine alone (no server): nospec / mask / varlen at the served loads, T=1, seeded, phase by phase;
# then -- once /tmp/smol/ready exists -- the served cells twice in opposite config orders (varlen, nospec, mask
# and mask, nospec, varlen) on section 20's curve: a mode effect repeats in both, an order or server effect
# does not. ~14 min (estimate: engine alone 3, each served pass 5).
# One GPU, issue 8's real matrix with every config's server up at once (dspark bench --interleave: cells by
# concurrency, each one's configs rotated), after section 21 found a drift over sequentially served configs.
# A sampler (benchmarks/host_sampler.py) logs the load and the processes busiest in each 10 s; the engine alone runs nospec
# and varlen at 256 requests in both orders before the matrix and once more after it (is the drift the host's,
# or the processes'?; PROBES=0 skips them). The curve is section 20's (same host kind, same shapes): no profile
# in the sitting. REAL_CONFIGS and REAL_CONC pick a part of the matrix (a second pass).
queue_interleaved() {
  setsid python3 benchmarks/host_sampler.py --every 10 --top 8 >"$ROOT/host_sampler.log" 2>&1 </dev/null &
  local sampler=$!
  local order
  for order in nospec,varlen varlen,nospec; do
    [[ ${PROBES:-1} == 1 ]] || break
    stage "engine alone at 256 ($order)" env PYTHONPATH="/tmp/dspark-site:$PWD" python3 benchmarks/embedded_engine.py \
      --steps-only --temperature 1 --configs $order --concurrency 256 --out "$ROOT/engine_${order/,/_}"
  done
  stage "waiting for /tmp/smol/ready" bash -c 'while [[ ! -f /tmp/smol/ready ]]; do sleep 2; done'
  mkdir -p "$ROOT/real"
  # REUSE_CURVES=0: no copy, so h200_matrix.sh profiles the real pair on this machine first (~30 s)
  [[ ${REUSE_CURVES:-1} == 1 ]] && cp benchmarks/results/h200/embedded_matrix/2026-12-02/real/sps_curve.json "$ROOT/real/"
  # Every server's KV pool holds --max-num-seqs full-length requests: at the default --max-model-len (2048) a
  # SmolLM2 server takes 12-18 GB, and seven of them do not fit an 80 GB card (section 36: the sixth ran out of
  # memory at start-up). GSM8K prompts (at most ~250 tokens) and 128 output tokens fit 512, so a card under
  # 100 GB serves them at 512 (REAL_MAX_MODEL_LEN overrides it on any card).
  local mib len=${REAL_MAX_MODEL_LEN:-}
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  [[ -z $len && ${mib:-0} -lt 100000 ]] && len=512
  # Two waves a round (8 at the 4 rounds of the default): a cell's rounds split its waves, so fewer rounds of the
  # same waves took as long; ROUNDS=2 now halves the matrix's time, as a short sitting needs.
  CONC=${REAL_CONC:-16,32,64,128,256} WAVES=${REAL_WAVES:-$((2 * ${ROUNDS:-4}))} TOK=${REAL_TOK:-128} \
    CONFIGS=${REAL_CONFIGS:-nospec,none,mask,varlen,mask+sts,varlen+sts} \
    SERVE_EXTRA="--phase-timing host${len:+ --max-model-len $len}" BENCH_EXTRA="--interleave${ROUNDS:+ --rounds $ROUNDS}" \
    stage "real matrix, interleaved" bash benchmarks/h200_matrix.sh "$ROOT" real
  [[ ${PROBES:-1} == 1 ]] && stage "engine alone at 256 (nospec,varlen), after" env PYTHONPATH="/tmp/dspark-site:$PWD" python3 \
    benchmarks/embedded_engine.py --steps-only --temperature 1 --configs nospec,varlen --concurrency 256 \
    --out "$ROOT/engine_after"
  kill "$sampler" 2>/dev/null || true
}

# One GPU: mixed prefills (--mixed-prefill) proven and timed. The GPU test first (CUDA graphs: the ragged prefill
# family with decode rows reading their cached KV, outputs against prefills alone), then the real matrix
# interleaved with each config beside its +mixed twin, so the A/B is within one run.
queue_mixed() {
  stage "GPU test: mixed prefills" env PYTHONPATH="/tmp/dspark-site:$PWD" python3 -m pytest -q -p no:cacheprovider \
    tests/test_embedded_engine_step.py -k mixed_prefills -rs 2>&1 | tail -6 | tee "$ROOT/mixed_gpu_test.log"
  PROBES=0 REAL_CONFIGS=${REAL_CONFIGS:-nospec,nospec+mixed,mask,mask+mixed,varlen+sts,varlen+sts+mixed} queue_interleaved
}

# One GPU, issue 8's real bar after section 21 (single interleaved cells moved by up to 40% between minutes):
# the mixed-prefill GPU test, then the whole real matrix interleaved in paired rounds (dspark bench --rounds:
# every config's round r before any config's round r + 1, 4 rounds of 2 waves), the summary's paired table
# giving each config's median per-round ratio against no speculation. The mixed twins (nospec+mixed,
# varlen+sts+mixed) join only if their GPU test passed: a mixed server failing mid-run would stop the matrix.
queue_rounds() {
  gated_rounds "mixed prefills" "tests/test_embedded_engine_step.py -k mixed_prefills" "2 passed" \
    "${MIXED_CONFIGS:-nospec+mixed,varlen+sts+mixed}" "${REAL_CONFIGS:-nospec,none,mask,varlen,mask+sts,varlen+sts}"
}

# One GPU, after section 22: how much do two servers of one config differ (an A/A column, nospec#2), and what
# does the engine in a process of its own (+proc: dspark serve --engine-process) give at low and high load?
# The engine-process GPU test first; the +proc configs join only if it passed. Paired rounds as QUEUE=rounds.
queue_floor() {
  REAL_CONC=${REAL_CONC:-16,64,256} gated_rounds "engine process" "tests/test_engine_process.py -k process_front_on_cuda" "1 passed" \
    "${PROC_CONFIGS:-nospec+proc,varlen+sts+proc}" "${REAL_CONFIGS:-nospec,nospec#2,mask+sts,varlen+sts}"
}

# LABEL, TEST (pytest arguments), EXPECT (what its summary must say), TWINS, CONFIGS: run the GPU test, then the
# real matrix interleaved in paired rounds over CONFIGS, with TWINS added only if the test passed as expected
# (a server of a feature failing mid-run would stop the whole matrix).
gated_rounds() {
  local label=$1 test=$2 expect=$3 twins=$4 configs=$5 log="$ROOT/${1// /_}_gpu_test.log"
  # shellcheck disable=SC2086
  stage "GPU test: $label" env PYTHONPATH="/tmp/dspark-site:$PWD" python3 -m pytest -q -p no:cacheprovider \
    $test -rs >"$log" 2>&1
  local rc=$?
  tail -6 "$log"
  if [[ $rc == 0 ]] && grep -q "$expect" "$log"; then
    configs=$configs,$twins
  else
    echo "$label: GPU test exit $rc, or its summary lacks '$expect': $twins stay out"
  fi
  PROBES=0 ROUNDS=${ROUNDS:-4} REAL_CONFIGS=$configs queue_interleaved
}

# One GPU, issue 8 whole on the current code, the engine in a process of its own (dspark serve's default on CUDA
# since section 23; the scaled matrix last ran on a thread, in section 20, and the real one ran whole on the
# process front never: sections 23-24 served its STS configs only). While the SmolLM2 parts are carried in, the
# scheduling overhead of the scaled setup at T=1 (~1 min, item 3's 3% bar; OVERHEAD=0 skips it). Then the real
# matrix, all six configs and an A/A column (nospec#2), interleaved in paired rounds (its bar, 3%, sits on the
# two-server floor, so the summary's per-round medians and the A/A column are what it is read on); then the scaled
# matrix, served one config after another (six 8B-shaped servers do not fit the device together), varlen + SPS +
# STS third so a short sitting loses mask's configs first; then GSM8K at 256 requests, no capacity against varlen
# + SPS + STS (~1.5 min; GSM8K=0 skips it). Both curves are profiled in the sitting (~30 and ~50 s; REUSE_CURVES=1
# takes section 20's instead). GPU_TESTS=1 runs the GPU tests first (~3.6 min). ~25 min: overhead 1, real ~9 and
# scaled ~12 with their profiles (sections 20 and 22), GSM8K 1.5, plus the SmolLM2 parts' calls.
queue_issue8() {
  [[ ${GPU_TESTS:-0} == 1 ]] && stage "GPU tests" bash benchmarks/h200_suite.sh "$ROOT/core" gputests
  # GPU_TEST_FILES="tests/a.py tests/b.py": only those files' GPU tests (a change's own proof, a minute instead of
  # the whole suite's ~4); a failure is said and the matrices go on, as they measure speed, not outputs.
  # shellcheck disable=SC2086
  [[ -n ${GPU_TEST_FILES-} ]] && { stage "GPU tests ($GPU_TEST_FILES)" env PYTHONPATH="/tmp/dspark-site:$PWD" \
    python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TEST_FILES >"$ROOT/gpu_tests.log" 2>&1 ||
    echo "WARNING: a GPU test failed (gpu_tests.log)"; tail -3 "$ROOT/gpu_tests.log"; }
  # shellcheck disable=SC2086
  [[ ${OVERHEAD:-1} == 1 ]] && stage "scheduling overhead at T=1 (llama-3-8b)" env PYTHONPATH="/tmp/dspark-site:$PWD" \
    python3 benchmarks/embedded_engine.py ${OVERHEAD_ARGS:---shape llama-3-8b --max-model-len 4096} \
    --temperature 1 --out "$ROOT/overhead_t1"
  # SCALED_FIRST=1 serves the scaled matrix while the SmolLM2 parts are still being carried in: a sitting whose
  # device time is short spends none of it waiting for them.
  [[ ${SCALED_FIRST:-0} == 1 ]] && issue8_scaled
  PROBES=0 ROUNDS=${ROUNDS:-4} REUSE_CURVES=${REUSE_CURVES:-0} \
    REAL_CONFIGS=${REAL_CONFIGS:-nospec,nospec#2,none,mask,varlen,mask+sts,varlen+sts} queue_interleaved
  [[ ${SCALED_FIRST:-0} == 1 ]] || issue8_scaled
  [[ ${GSM8K:-1} == 1 ]] && stage "gsm8k" bash benchmarks/h200_matrix.sh "$ROOT" gsm8k
}

# SCALED_BENCH_EXTRA and SCALED_SERVE_EXTRA reach the scaled matrix's bench and servers only: with
# SCALED_CONFIGS=nospec,none,varlen+sts, SCALED_WAVES=4 (rounds of whole waves), SCALED_BENCH_EXTRA="--interleave
# --rounds 2" and SCALED_SERVE_EXTRA="--max-model-len 512" the three servers are up at once (~36 GB each: an H200, not an 80 GB card) and the
# issue's two ratios are read in paired rounds instead of across servers served one after another (section 36).
issue8_scaled() {
  mkdir -p "$ROOT/scaled"
  [[ ${REUSE_CURVES:-0} == 1 ]] && cp benchmarks/results/h200/embedded_matrix/2026-12-02/scaled/sps_curve.json "$ROOT/scaled/"
  CONFIGS=${SCALED_CONFIGS:-nospec,none,varlen+sts,varlen,mask+sts,mask} WAVES=${SCALED_WAVES:-3} \
    TOK=${SCALED_TOK:-256} BENCH_EXTRA=${SCALED_BENCH_EXTRA:-} SERVE_EXTRA=${SCALED_SERVE_EXTRA:-} \
    stage "scaled matrix" bash benchmarks/h200_matrix.sh "$ROOT" scaled
}

queue_paused() {
  stage "steps at T=1, engine alone" env PYTHONPATH="/tmp/dspark-site:$PWD" python3 benchmarks/embedded_engine.py \
    --steps-only --temperature 1 --configs nospec,mask,varlen --concurrency 16,64,128,256 --out "$ROOT/steps_t1"
  stage "waiting for /tmp/smol/ready" bash -c 'while [[ ! -f /tmp/smol/ready ]]; do sleep 2; done'
  local pass=1
  for order in varlen,nospec,mask mask,nospec,varlen; do
    mkdir -p "$ROOT/pass$pass/real"
    cp benchmarks/results/h200/embedded_matrix/2026-12-02/real/sps_curve.json "$ROOT/pass$pass/real/"
    # The servers time each step's phases (host clock): waiting on the device shows as phase "sync".
    CONFIGS=$order CONC=${REAL_CONC:-64,128,256} WAVES=${REAL_WAVES:-8} TOK=${REAL_TOK:-128} \
      SERVE_EXTRA="--phase-timing host" \
      stage "served pass $pass ($order)" bash benchmarks/h200_matrix.sh "$ROOT/pass$pass" real
    pass=$((pass + 1))
  done
}

QUEUES=(0 1)
[[ ${GPUS:-2} == 1 ]] && QUEUES=(_one)
case ${QUEUE:-} in
  "") ;;
  stalls | vllm | embedded | paused | interleaved | mixed | rounds | floor | issue8) QUEUES=("_$QUEUE") ;;
  vllm-anatomy | vllm-lossless) QUEUES=("_${QUEUE/-/_}") ;;
  *) echo "unknown QUEUE=$QUEUE (stalls, vllm, vllm-anatomy, vllm-lossless, embedded, paused, interleaved," \
       "mixed, rounds, floor, issue8; unset for the two-GPU queues)" >&2; exit 2 ;;
esac

# Four 8B-shaped vLLM servers at once (QUEUE=vllm, vllm-anatomy: vllm_group) need ~120 GB, which an 80 GB card
# cannot hold: found by a sitting's first call (`gpu`), that costs seconds; found by the queue, the staging and a
# group's server starts. Every other queue fits either card, and measures its own baselines in the same run.
# MIN_GPU_MIB overrides the need.
check_gpu() {
  local line name mib need=${MIN_GPU_MIB:-0}
  [[ ${QUEUE:-} == vllm || ${QUEUE:-} == vllm-anatomy ]] && need=${MIN_GPU_MIB:-130000}
  # issue 8's scaled matrix in paired rounds keeps three 8B-shaped servers up together (section 8)
  [[ ${QUEUE:-} == issue8 && ${SCALED_BENCH_EXTRA:-} == *--interleave* ]] && need=${MIN_GPU_MIB:-130000}
  line=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  echo "GPU: ${line:-none}"
  [[ -n $line ]] || { echo "no GPU visible" >&2; return 3; }
  name=${line%%,*} mib=${line##*, }
  ((mib >= need)) && return 0
  echo "QUEUE=$QUEUE needs $need MiB of GPU memory (8B-shaped servers up together), the $name has $mib:" \
    "ask for an H200 (the device call's needs_h200)" >&2
  return 3
}

case $ACTION in
  gpu) check_gpu ;;  # the first call of a sitting: before anything is staged
  start)
    check_gpu || exit 3
    mkdir -p "$ROOT"
    # A queue still running reads ROOT/repo: replacing it would pull files from under it.
    for q in "${QUEUES[@]}"; do
      if [[ -f $ROOT/queue$q.pid ]] && kill -0 "$(cat "$ROOT/queue$q.pid")" 2>/dev/null; then
        echo "queue $q already runs (pid $(cat "$ROOT/queue$q.pid")): nothing started" >&2; exit 1
      fi
    done
    # A copy, so that a later command re-sending the working tree cannot change files under a running queue.
    rm -rf "$ROOT/repo" && mkdir -p "$ROOT/repo"
    tar --exclude=./.carry --exclude=./.vstage --exclude=./.git --exclude=./.whl -cf - . | tar -xf - -C "$ROOT/repo"
    # The host lacks orjson and gguf: installed once here (the queues' scripts would race installing them).
    if compgen -G ".whl/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dspark-site .whl/*.whl >/dev/null 2>&1
    fi
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$ROOT/machine.txt"
    # Where the host's CPUs sit against each other and the GPU: servers of one code path ran every host phase
    # 15-18% apart (section 46), and host_sampler.log names the CPU and node each busy process ran on, which this
    # table maps to cores (two processes on one core's hyperthreads slow each other) and nodes.
    { lscpu | grep -Ei '^(model name|cpu\(s\)|thread|core|socket|numa)'; lscpu -e=CPU,CORE,SOCKET,NODE
      nvidia-smi topo -m; } >>"$ROOT/machine.txt" 2>&1
    for q in "${QUEUES[@]}"; do
      # GPU q, its own model cache (two processes building the same cache entry would race). Every function of
      # this script goes to the queue's shell: a list of them lost vllm_anatomy, added after it (the anatomy
      # of the next sitting would have said "command not found").
      gpu=$q && [[ $q == _one || $q == _stalls || $q == _vllm* || $q == _embedded || $q == _paused || $q == _interleaved || $q == _mixed || $q == _rounds || $q == _floor || $q == _issue8 ]] && gpu=0
      ROOT=$ROOT CUDA_VISIBLE_DEVICES=$gpu DSPARK_CACHE_DIR=/tmp/dcache$gpu setsid bash -c \
        "$(declare -f); cd \"\$ROOT/repo\" && queue$q; stage 'queue $q done' true" \
        >"$ROOT/queue$q.log" 2>&1 </dev/null &
      echo $! >"$ROOT/queue$q.pid"
      echo "queue $q started (pid $!)"
    done ;;
  status)
    for q in 0 1 _one _stalls _vllm _vllm_anatomy _vllm_lossless _embedded _paused _interleaved _mixed _rounds _floor _issue8; do
      [[ -f $ROOT/queue$q.pid ]] || continue
      state=finished; kill -0 "$(cat "$ROOT/queue$q.pid" 2>/dev/null)" 2>/dev/null && state=running
      echo "== queue $q ($state): $(grep -a '^\[' "$ROOT/queue$q.log" | tail -1)"
      tail -c 1500 "$ROOT/queue$q.log" | tail -6
    done
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader ;;
  collect)
    DEST=${3:?usage: h200_two_gpus.sh collect ROOT DEST}
    mkdir -p "$DEST"
    tar -C "$ROOT" --exclude=./repo --exclude='*.pid' --exclude=real-pair -czf "$DEST/results.tgz" . && ls -la "$DEST" ;;
  *) echo "unknown action $ACTION (gpu|start|status|collect)" >&2; exit 2 ;;
esac
