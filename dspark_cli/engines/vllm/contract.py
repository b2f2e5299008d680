"""Everything the vLLM plugin assumes about vLLM 0.33.0's internals, in ONE table.

The plugin patches Model Runner V2 by rebinding names, so a vLLM release that renames a function, drops a
keyword or stops importing a name *by name* into ``model_runner`` would silently leave the plugin inert or,
worse, half-applied. Every such assumption is a row of :data:`CONTRACT`:

* the CPU contract tests (``tests/test_vllm_contract.py``) check each row against the real wheel's source
  with ``ast`` (the CUDA wheel cannot be imported on a CPU machine), so an upgrade fails in CI;
* the plugin checks the rows it patches against the live modules (``inspect``) before touching anything,
  and refuses to start with one clear message if they drifted.

A few rows are what ``dspark bench`` reads of a vLLM server (its /metrics names) and what the benchmark
harness passes it: not patched, but a rename there would leave a cell's numbers silently empty.

Nothing here imports vLLM. Module names are dotted; :func:`source_path` maps them into an unpacked wheel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

VLLM_VERSION = "0.33.0"
VLLM_COMPILE = 3  # vLLM's CompilationMode.VLLM_COMPILE: torch.compile, whose ranges end at the token budget
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "dspark"
PLUGIN_TARGET = "dspark_cli.engines.vllm.plugin:register"
ADDITIONAL_CONFIG_KEY = "dspark"  # --additional-config '{"dspark": {...}}'
INVALID_DRAFTS_ATTR = "dspark_invalid_drafts"  # mask mode sets it on InputBatch; the sampler hook reads it
# SpeculativeConfig.__post_init__ re-derives the method of a speculator other than these from the draft's *path*
# (lower-cased, anywhere in it): a "draft_model" draft whose path holds a marker runs as that method instead.
EXPLICIT_METHODS = ("eagle", "eagle3", "dflash", "dspark")
METHOD_PATH_MARKERS = ("eagle-", "eagle3", "dflash", "dspark")
# vLLM's own SpeculativeConfig fields whose names start with "dspark_" (options of its DSpark speculator): not the
# seed's keys, so they pass through to vLLM untouched; tests/test_vllm_contract.py checks this is all of them.
VLLM_DSPARK_FIELDS = ("dspark_draft_topk",)
# Speculative methods with no adaptive verification on vLLM 0.33, so a capacity mode would do nothing: the n-gram
# speculators of Model Runner V2 carry no enable_adaptive_verification (only DraftModelSpeculator's family does,
# and the runner reads it with a False default), and suffix / custom_class run on Model Runner V1.
NON_ADAPTIVE_METHODS = ("ngram", "ngram_gpu", "suffix", "custom_class")
# The methods whose V2 speculator is a DraftModelSpeculator (the MTP aliases become "mtp").
ADAPTIVE_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark")

RUNNER = "vllm.v1.worker.gpu.model_runner"
AV = "vllm.v1.worker.gpu.spec_decode.adaptive_verification"
SPECULATOR = "vllm.v1.worker.gpu.spec_decode.speculator"
DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
DSPARK = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"
STANDALONE_AR = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator"
SPEC_INIT = "vllm.v1.worker.gpu.spec_decode"
REJECTION = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
CUDAGRAPH = "vllm.v1.worker.gpu.cudagraph_utils"
INPUT_BATCH = "vllm.v1.worker.gpu.input_batch"
STATES = "vllm.v1.worker.gpu.states"
ASYNC_UTILS = "vllm.v1.worker.gpu.async_utils"
STRUCTURED = "vllm.v1.worker.gpu.structured_outputs"
ATTN_UTILS = "vllm.v1.worker.gpu.attn_utils"
SPEC_CONFIG = "vllm.config.speculative"
VLLM_CONFIG = "vllm.config.vllm"
MODEL_CONFIG = "vllm.config.model"
PLUGINS = "vllm.plugins"
PARALLEL = "vllm.distributed.parallel_state"
ENVS = "vllm.envs"
ARG_UTILS = "vllm.engine.arg_utils"
LLM = "vllm.entrypoints.llm"
WORKER_BASE = "vllm.v1.worker.worker_base"
# What `dspark bench` reads of a vLLM server's /metrics, and what benchmarks/vllm_adaptive.py passes it.
LOGGERS = "vllm.v1.metrics.loggers"
SPEC_METRICS = "vllm.v1.spec_decode.metrics"
CLI_ARGS = "vllm.entrypoints.common.cli_args"
# A paused step's placeholder drafts, dropped where vLLM's scheduler hands them out (plain_paused_steps).
ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler"
SCHEDULER = "vllm.v1.core.sched.scheduler"
REQUEST = "vllm.v1.request"
MODEL_STATE = "vllm.v1.worker.gpu.model_states.default"
ENGINE_CORE = "vllm.v1.engine.core"
# The kernel warm-up before graph capture, whose draft pass can exceed what torch.compile covers (warmup_overflow).
WARMUP = "vllm.v1.worker.gpu.warmup"
KERNEL_CONFIG = "vllm.config.kernel"
COMPILATION = "vllm.config.compilation"

Kind = Literal[
    "function",  # module-level def; params must appear (in this order) among its parameters
    "method",  # Class.method; same parameter rule (self excluded)
    "class",  # module-level class
    "imported",  # module binds `name` by `from <source> import name` (rebinding must happen there too)
    "field",  # class-level annotated attribute (dataclass / pydantic / NamedTuple field)
    "self_attr",  # Class.__init__ assigns self.<attr> (private state the manager subclass reuses)
    "constant",  # module-level NAME = value
    "call_kwargs",  # inside Class.method (or function) there is a call to `callee` passing these keywords
    "contains",  # the source of Class.method (or the module) contains this exact snippet
]


@dataclass(frozen=True)
class Assumption:
    module: str
    name: str  # "func", "Class", "Class.method", "Class.attr"
    kind: Kind
    params: tuple[str, ...] = ()  # parameter / keyword / attribute names, or (value,) for constants
    source: str = ""  # for "imported": the module the name comes from; for "call_kwargs": the callee
    why: str = ""
    patched: bool = False  # the plugin rebinds or wraps this name (checked at runtime too)


_FACTORY_KW = (
    "enable_adaptive_verification",
    "attn_groups",
    "req_states",
    "query_start_loc",
    "num_bonus_tokens",
    "max_total_logits",
    "vllm_config",
    "target_layer_names",
    "additional_attn_cg_support",
    "copy_admitted_drafts_to_host",
)

CONTRACT: tuple[Assumption, ...] = (
    # --- plugin loading and configuration
    Assumption(PLUGINS, "DEFAULT_PLUGINS_GROUP", "constant", (PLUGIN_GROUP,),
               why="our entry point group; loaded in every process, workers before the runner import"),
    Assumption(PLUGINS, "load_general_plugins", "function", why="what calls register()"),
    Assumption(SPEC_CONFIG, "SpeculativeConfig.enable_adaptive_verification", "field",
               why="the launcher switches upstream adaptive verification on; our manager replaces it"),
    Assumption(SPEC_CONFIG, "SpeculativeConfig.__post_init__", "contains",
               tuple(f'"{m}" in self.draft_model_config.model.lower()' for m in METHOD_PATH_MARKERS),
               why="vLLM re-derives the method from the draft's path; the launcher refuses paths that would flip it, "
                   "and engines.vllm.models keeps its copies out of them"),
    Assumption(SPEC_CONFIG, "SpeculativeConfig", "contains", ("num_speculative_tokens: int = Field(default=None, gt=0)",),
               why="a speculative config of 0 tokens is refused: the launcher serves -k 0 with none at all"),
    Assumption(SPEC_CONFIG, "SpeculativeConfig.__post_init__", "contains",
               ('"num_speculative_tokens was provided but without speculative model."',),
               why="a draft count with no draft and no method that needs none fails; the launcher says so first"),
    Assumption(SPEC_CONFIG, "SpeculativeConfig.draft_sample_method", "field",
               why="example/benchmark flags (probabilistic draft sampling)"),
    *(Assumption(SPEC_CONFIG, f"SpeculativeConfig.{name}", "field",
                 why="vLLM's own dspark_* option: the launcher passes it through instead of reading it as ours")
      for name in VLLM_DSPARK_FIELDS),
    Assumption(SPEC_CONFIG, "SpeculativeConfig.__post_init__", "contains", ('if self.model in ("ngram", "[ngram]"):',),
               why="a spec naming the model ngram and no method runs the n-gram speculator (NON_ADAPTIVE_METHODS)"),
    Assumption(RUNNER, "GPUModelRunner.initialize_kv_cache", "contains",
               ('self.speculator, "enable_adaptive_verification", False',),
               why="a speculator without the flag gets no manager: capacity modes refuse NON_ADAPTIVE_METHODS"),
    Assumption(VLLM_CONFIG, "VllmConfig._get_v2_model_runner_unsupported_features", "contains",
               ('speculative_config.method in ("suffix", "custom_class")',),
               why="these methods run on Model Runner V1, which the plugin does not patch (NON_ADAPTIVE_METHODS)"),
    Assumption(VLLM_CONFIG, "VllmConfig._validate_adaptive_verification", "contains",
               ("if not self.compilation_config.cudagraph_mode.has_full_cudagraphs():",),
               why="adaptive verification needs full CUDA graphs: the launcher refuses --enforce-eager with a mode"),
    Assumption(VLLM_CONFIG, "VllmConfig.additional_config", "field",
               why="our settings travel to every process in --additional-config (hashed into the compile cache)"),
    Assumption(ARG_UTILS, "EngineArgs.add_cli_args", "contains", ('"--additional-config"',),
               why="the flag the launcher writes"),
    Assumption(ARG_UTILS, "EngineArgs.add_cli_args", "contains", ('"--speculative-config", "-sc"',),
               why="the launcher recognises both spellings of the speculative config flag"),
    Assumption(MODEL_CONFIG, "ModelConfig.is_moe", "method",
               why="mask mode prices pruned rows as saved only for MoE models that skip padding rows"),
    Assumption(MODEL_CONFIG, "ModelConfig.get_sliding_window", "method",
               why="a draft with a sliding window keeps its K/V current while paused (no catch-ups)"),
    Assumption(SPEC_CONFIG, "SpeculativeConfig.draft_model_config", "field",
               why="where the draft's sliding window is read"),
    Assumption(REJECTION, "RejectionSampler._verify_in_chunks", "contains", ("assert not self.enable_adaptive_verification",),
               why="one chunk of logit rows with adaptive verification on: mask mode's full batch must fit"),
    Assumption(ENVS, "VLLM_MOE_SKIP_PADDING", "contains", ('"VLLM_MOE_SKIP_PADDING"',),
               why="mask mode marks pruned rows in is_padding only when MoE honours it (read, never set)"),
    Assumption(PARALLEL, "get_tp_group", "function", why="rank-0 broadcast of curves and temperatures"),
    Assumption(PARALLEL, "GroupCoordinator.broadcast", "method", ("input_", "src"),
               why="in-place device broadcast of the STS temperature buffer"),
    Assumption(PARALLEL, "GroupCoordinator.broadcast_object", "method", ("obj", "src"),
               why="broadcast of the SPS curve from TP rank 0"),
    Assumption(PARALLEL, "GroupCoordinator.world_size", "field", why="skip broadcasts at world size 1"),
    Assumption(PARALLEL, "GroupCoordinator.rank_in_group", "field", why="only TP rank 0 writes traces"),
    Assumption(PARALLEL, "GroupCoordinator.broadcast", "contains", ("torch.distributed.broadcast(",),
               why="the temperature broadcast is in place (captured draft graphs hold the buffer's address)"),
    # --- names model_runner imports by name: rebinding in the defining module is not enough
    Assumption(RUNNER, "maybe_create_adaptive_verification_manager", "imported", source=AV, patched=True,
               why="the gate: our factory replaces upstream's when settings are present"),
    Assumption(RUNNER, "AdaptiveVerificationManager", "imported", source=AV,
               why="base class of our manager (type annotations and isinstance checks keep working)"),
    Assumption(RUNNER, "ModelCudaGraphManager", "imported", source=CUDAGRAPH, patched=True,
               why="mask mode replays uniform decode graphs: varlen_decode must be off"),
    Assumption(RUNNER, "RejectionSampler", "imported", source=REJECTION,
               why="mask mode passes invalid_drafts through RejectionSampler.__call__"),
    Assumption(RUNNER, "DraftModelSpeculator", "imported", source=SPECULATOR,
               why="observe_verification is called only for DraftModelSpeculator instances"),
    # --- the factory and how the runner calls it
    Assumption(AV, "maybe_create_adaptive_verification_manager", "function", _FACTORY_KW, patched=True,
               why="our gate forwards these keywords unchanged to upstream when our settings are absent"),
    Assumption(RUNNER, "GPUModelRunner.initialize_kv_cache", "call_kwargs", _FACTORY_KW,
               source="maybe_create_adaptive_verification_manager",
               why="the runner passes everything by keyword"),
    Assumption(RUNNER, "GPUModelRunner.initialize_kv_cache", "call_kwargs", ("varlen_decode",),
               source="ModelCudaGraphManager", why="our ModelCudaGraphManager overrides varlen_decode in mask mode"),
    Assumption(CUDAGRAPH, "ModelCudaGraphManager.__init__", "method",
               ("vllm_config", "device", "cudagraph_mode", "decode_query_len", "lora_capture_cases",
                "varlen_decode", "ubatch_runner"),
               why="constructor we wrap"),
    Assumption(CUDAGRAPH, "CudaGraphManager.captured_token_counts", "method",
               why="capture sizes for the staircase of the SPS curve"),
    Assumption(AV, "get_query_lens_mismatch_unsupported_backend", "imported", source=ATTN_UTILS,
               why="varlen needs device/CPU query-length mismatch support, else we fall back to mask"),
    Assumption(AV, "get_varlen_cudagraph_unsupported_backend", "imported", source=ATTN_UTILS,
               why="varlen needs varlen FULL graphs, else we fall back to mask"),
    Assumption(ATTN_UTILS, "get_query_lens_mismatch_unsupported_backend", "function",
               ("attn_groups", "checked_layer_names")),
    Assumption(ATTN_UTILS, "get_varlen_cudagraph_unsupported_backend", "function",
               ("attn_groups", "vllm_config", "max_query_len", "checked_layer_names")),
    # --- AdaptiveVerificationManager: what we subclass and override
    Assumption(AV, "AdaptiveVerificationManager", "class"),
    Assumption(AV, "AdaptiveVerificationManager.__init__", "method",
               ("req_states", "query_start_loc", "num_bonus_tokens", "max_total_logits",
                "copy_admitted_drafts_to_host")),
    Assumption(AV, "AdaptiveVerificationManager.get_num_tokens", "method", ("num_tokens_per_req", "draft_tokens"),
               why="budget on the host (core.capacity.choose_budget on stale confidences)"),
    Assumption(AV, "AdaptiveVerificationManager.compact_batch", "method",
               ("num_draft_tokens_per_req", "num_scheduled_tokens", "cu_num_logits_np")),
    Assumption(AV, "AdaptiveVerificationManager.reallocate_drafts", "method", ("req_ids", "idx_mapping"),
               why="allocation on the device (core.capacity.allocate)"),
    Assumption(AV, "AdaptiveVerificationManager.record_confidences", "method", ("confidence_probs", "input_batch")),
    Assumption(AV, "AdaptiveVerificationManager.add_request", "method", ("req_idx",)),
    Assumption(AV, "AdaptiveVerificationManager.batches_to_profile", "method", ("capture_sizes",)),
    Assumption(AV, "AdaptiveVerificationManager.set_initial_cost_curves", "method", ("samples",)),
    Assumption(AV, "AdaptiveVerificationManager.set_cost_curves", "method", ("draft_curve", "verify_curve")),
    Assumption(AV, "AdaptiveVerificationManager.__init__", "self_attr",
               ("req_states", "num_speculative_steps", "num_bonus_tokens", "_max_total_logits", "query_start_loc",
                "cost_tables", "_cudagraph_limit", "_batch_budget", "_confidence_probs", "_batch_draft_capacity",
                "_num_non_draft_tokens", "_cu_num_logits", "_stale_confidences", "_stale_idx", "_copy_stream",
                "_copy_admitted_drafts_to_host"),
               why="state our subclass reads (stale host confidences, live device confidences, layout buffers)"),
    Assumption(AV, "AdaptiveVerificationManager.compact_batch", "contains", ("_, _, draft_budget = batch_budget",),
               why="_batch_budget is the (drafts per req, non-draft per req, budget) triple get_num_tokens stashes; "
                   "our varlen mode reuses upstream's compact_batch on it"),
    Assumption(AV, "AdmittedDraftCounts.__init__", "method", ("cpu", "event")),
    Assumption(AV, "AdaptiveVerificationManager.__init__", "contains",
               ("self._admitted_drafts_cpu = ", "self._admitted_drafts_event = "),
               why="batch-sharded sampling: our varlen path hands the admitted split to the host like upstream"),
    Assumption(AV, "async_tensor_h2d", "imported", source="vllm.utils.torch_utils"),
    Assumption(AV, "AttentionCGSupport", "imported", source="vllm.v1.attention.backend",
               why="only ALWAYS replays varlen batches for groups built outside init_attn_backend"),
    Assumption(AV, "AdaptiveVerificationManager.record_confidences", "contains",
               ("self._confidence_probs[input_batch.idx_mapping] = confidence_probs[:num_reqs]",),
               why="we pass STS-calibrated confidences; upstream stores them for allocation and the stale copy"),
    # --- the runner's step: where our hooks sit
    Assumption(RUNNER, "GPUModelRunner.prepare_inputs", "method",
               ("scheduler_output", "batch_req_state", "batch_desc", "num_active_loras"), patched=True,
               why="mask mode pads pruned rows after combine_sampled_and_draft_tokens wrote the drafts; a batch "
                   "with no drafts gets the bound of its graph, the descriptor (third argument)"),
    Assumption(RUNNER, "GPUModelRunner.prepare_inputs", "contains",
               ("adaptive_verification.reallocate_drafts(req_ids, idx_mapping)",)),
    Assumption(RUNNER, "GPUModelRunner.capture_model", "method", ("profile_only",), patched=True,
               why="speculator hooks (STS temperatures inside the draft graph) are installed before capture"),
    Assumption(RUNNER, "GPUModelRunner.capture_model", "contains",
               ("self.adaptive_verification.set_initial_cost_curves(timings)",),
               why="upstream's start-up profile feeds our curve when no --sps-curve is given"),
    Assumption(RUNNER, "GPUModelRunner.gather_batch_req_state", "contains",
               ("self.adaptive_verification.get_num_tokens(",)),
    Assumption(RUNNER, "GPUModelRunner.sample", "contains", ("invalid_drafts,",),
               why="the runner hands (grammar) invalid_drafts to the rejection sampler; we OR ours in"),
    Assumption(RUNNER, "GPUModelRunner.sample_tokens", "contains",
               ("self.speculator.observe_verification(", "self.adaptive_verification.record_confidences("),
               why="outcomes reach observe_verification before propose; confidences are recorded after it"),
    Assumption(RUNNER, "ExecuteModelState.num_spec_tokens_to_schedule", "field",
               why="a paused step rewrites it to 0 (NamedTuple._replace) before sample_tokens reads it"),
    Assumption(RUNNER, "GPUModelRunner.sample_tokens", "method", ("grammar_output",), patched=True,
               why="the saturation policy decides, after this step's budget, whether this step drafts"),
    Assumption(RUNNER, "GPUModelRunner.sample_tokens", "contains",
               ("num_spec_tokens = self.execute_model_state.num_spec_tokens_to_schedule",
                "num_speculative_tokens=num_spec_tokens,", "draft_tokens[:, num_spec_tokens:] = -1",
                "draft_tokens[:, :num_spec_tokens]"),
               why="0 scheduled drafts: propose is told 0, the drafts handed to the scheduler are empty"),
    # --- the scheduler's placeholder drafts (plain_paused_steps)
    Assumption(ASYNC_SCHEDULER, "AsyncScheduler._update_after_schedule", "method", ("scheduler_output",),
               patched=True, why="publishes the placeholder list the step's requests were handed"),
    Assumption(ASYNC_SCHEDULER, "AsyncScheduler._update_after_schedule", "contains",
               ("self._spec_token_placeholders = [", "request.spec_token_ids = self._spec_token_placeholders"),
               why="one fresh list per step, shared by every request it schedules: emptied in place by a paused "
                   "step, it leaves those requests no drafts to schedule next"),
    Assumption(REQUEST, "Request.num_tokens_with_spec", "contains", ("len(self.spec_token_ids)",),
               why="an emptied placeholder list schedules one token per request"),
    Assumption(SCHEDULER, "Scheduler.schedule", "contains",
               ("scheduled_spec_decode_tokens[request.request_id] = spec_token_ids",),
               why="the next schedule copies the requests' lists into its output; rejections are counted from "
                   "that copy, so a list is only ever emptied before it"),
    Assumption(ENGINE_CORE, "EngineCore.step_with_batch_queue", "contains",
               ("scheduler_output = self.scheduler.schedule(", "future = self.model_executor.sample_tokens("),
               why="the runner's sample_tokens (our pause decision) runs after its step's schedule and before "
                   "the next"),
    Assumption(RUNNER, "GPUModelRunner.prepare_inputs", "contains",
               ("if not draft_tokens and self.model_state.num_new_sampled_tokens_per_step == 1:",),
               why="a batch with no drafts scheduled takes the runner's plain path (no verification layout)"),
    Assumption(INPUT_BATCH, "InputBatch.max_query_len", "field",
               why="a batch gets the bound of the varlen decode graph it replays (bound_query_len)"),
    Assumption(CUDAGRAPH, "BatchExecutionDescriptor.max_query_len", "field"),
    Assumption(MODEL_STATE, "DefaultModelState.prepare_attn", "contains",
               ("max_query_len = input_batch.max_query_len",),
               why="attention metadata is built from the batch's bound when it has one"),
    Assumption(INPUT_BATCH, "InputBatch.is_padding", "field", why="MoE skip mask; a view of InputBuffers.is_padding"),
    Assumption(INPUT_BATCH, "InputBatch.input_ids", "field"),
    Assumption(INPUT_BATCH, "InputBatch.query_start_loc", "field"),
    Assumption(INPUT_BATCH, "InputBatch.cu_num_logits", "field"),
    Assumption(INPUT_BATCH, "InputBatch.expanded_local_pos", "field"),
    Assumption(INPUT_BATCH, "InputBatch.num_tokens", "field"),
    Assumption(INPUT_BATCH, "InputBatch.num_reqs", "field"),
    Assumption(INPUT_BATCH, "InputBatch.req_ids", "field"),
    Assumption(INPUT_BATCH, "InputBatch.idx_mapping", "field"),
    Assumption(INPUT_BATCH, "InputBatch.num_draft_tokens_per_req", "field"),
    Assumption(INPUT_BATCH, "InputBatch.num_draft_tokens", "field",
               why="step timing: a paused step is priced as plain decoding of the batch's non-draft tokens"),
    Assumption(ASYNC_UTILS, "StepTimingSample.forward_ms", "field"),
    Assumption(ASYNC_UTILS, "StepTimingSample.drafter_ms", "field"),
    Assumption(ASYNC_UTILS, "StepTimingSample.num_target_tokens", "field"),
    Assumption(ASYNC_UTILS, "StepTimingSample.num_reqs", "field"),
    Assumption(ASYNC_UTILS, "StepTimingSample.full_cudagraph", "field"),
    # --- rejection sampler
    Assumption(REJECTION, "RejectionSampler.__call__", "method",
               ("logits", "input_batch", "draft_logits", "invalid_drafts"), patched=True,
               why="mask mode: pruned drafts are invalid, so they reject and the target samples the correction"),
    Assumption(REJECTION, "RejectionSampler.__call__", "contains", ("draft_sampled.masked_fill(invalid_drafts, -1)",)),
    Assumption(STRUCTURED, "grammar_invalid_drafts", "contains", ("return local_pos > row_limit",),
               why="invalid_drafts is a bool mask over logit rows: local position p marks draft p-1"),
    # --- speculators
    Assumption(SPECULATOR, "DraftModelSpeculator.observe_verification", "method",
               ("idx_mapping", "num_sampled", "num_rejected"), patched=True,
               why="online STS and traces learn from the rejection sampler's outcomes here"),
    Assumption(SPECULATOR, "DraftModelSpeculator.__init__", "self_attr",
               ("draft_tokens", "draft_token_confidence_probs", "enable_adaptive_verification")),
    Assumption(SPECULATOR, "BaseSpeculator.propose", "method", ("input_batch", "num_speculative_tokens")),
    Assumption(DFLASH, "DFlashSpeculator.propose", "contains", ("if num_speculative_tokens == 0:",),
               why="saturation: the DFlash family skips its query pass (keeping context K/V) for 0 drafts"),
    Assumption(DFLASH, "DFlashSpeculator", "class", why="isinstance check: which speculators can skip the draft pass"),
    Assumption(DSPARK, "DSparkSpeculator", "class"),
    Assumption(STANDALONE_AR, "StandaloneARSpeculator", "class",
               why="isinstance check: the draft_model speculator, which pauses by skipping its decode loop"),
    Assumption(STANDALONE_AR, "StandaloneARSpeculator._multi_step_decode", "method",
               ("input_batch", "num_rejected", "num_reqs", "skip_attn", "num_tokens_across_dp"),
               why="saturation: a paused draft_model step keeps the prefill pass (the draft's K/V stays "
                   "complete) and skips the K - 1 decode passes, wrapped per instance"),
    Assumption(STANDALONE_AR, "StandaloneARSpeculator.propose", "contains",
               ("self._prefill(", "self._multi_step_decode("),
               why="propose = one prefill pass over the step's tokens, then the decode loop"),
    Assumption(SPECULATOR, "DraftModelSpeculator.sample_draft", "method", ("hidden_states",),
               why="saturation: a paused draft_model step skips the prefill's first-token sample, wrapped per "
                   "instance (its first argument sizes the rows)"),
    Assumption(STANDALONE_AR, "StandaloneARSpeculator._prefill", "contains",
               ("self.draft_tokens[:num_reqs, 0] = self.sample_draft(",),
               why="the skipped sample's result lands in draft_tokens[:, 0], which the paused hook hands back"),
    # --- deferred draft K/V upkeep while paused (engines.vllm.upkeep)
    Assumption(STANDALONE_AR, "StandaloneARSpeculator._prefill", "method",
               ("input_batch", "num_rejected", "last_sampled", "num_reqs", "skip_attn", "num_tokens_across_dp"),
               why="a catch-up calls the prefill pass positionally over a synthetic batch of owed positions"),
    Assumption(STANDALONE_AR, "_prepare_prefill_inputs_kernel", "contains",
               ("is_correction = j == num_valid", "start_pos = tl.load(target_positions_ptr + q_start)",
                "new_seq_len = tl.minimum(seq_len + 1, max_model_len)"),
               why="catch-up rows are laid out as the kernel reads a row: contiguous positions from the row's "
                   "first, accepted tokens, then the correction; K/V lengths end at the row's last token"),
    Assumption(STANDALONE_AR, "prepare_prefill_inputs", "contains", ("return src_tokens + num_reqs",),
               why="the upkeep budget leaves one correction slot per request in the expanded buffers"),
    Assumption(SPECULATOR, "DraftModelSpeculator.__init__", "self_attr", ("max_num_tokens", "max_num_reqs", "dcp_size"),
               why="the upkeep budget is bounded by the speculator's expanded prefill buffers"),
    Assumption(SPECULATOR, "BaseSpeculator.propose", "method",
               ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
                "num_sampled", "num_rejected", "last_sampled"),
               why="the catch-up reads last_sampled as the runner passes it, positionally (index 7)"),
    Assumption(STATES, "RequestState.__init__", "self_attr", ("all_token_ids",),
               why="a catch-up gathers the committed token ids of the owed positions from it (.gpu)"),
    Assumption(RUNNER, "GPUModelRunner.prepare_inputs", "contains",
               ("async_tensor_h2d(query_start_loc_np, out=query_start_loc)",
                "adaptive_verification.reallocate_drafts(req_ids, idx_mapping)"),
               why="a paused varlen step keeps the query starts the runner copied from the host before the "
                   "allocation (the manager's query_start_loc buffer is the runner's)"),
    Assumption(RUNNER, "GPUModelRunner.initialize_kv_cache", "contains",
               ("query_start_loc=self.input_buffers.query_start_loc",),
               why="the manager's query_start_loc is the runner's input buffer, which prepare_inputs fills"),
    Assumption(RUNNER, "GPUModelRunner.sample_tokens", "contains",
               ("self.postprocess_sampled(", "self.req_states.last_sampled_tokens,"),
               why="this step's tokens are committed into all_token_ids before propose reads them"),
    *(Assumption(INPUT_BATCH, f"InputBatch.{name}", "field",
                 why="what the upkeep reads of a batch, and replaces in its catch-up copy (dataclasses.replace)")
      for name in ("idx_mapping_np", "query_start_loc_np", "seq_lens_cpu_upper_bound", "has_prefill",
                   "num_draft_tokens", "num_tokens", "input_ids", "positions", "query_start_loc", "seq_lens")),
    *(Assumption(INPUT_BATCH, f"InputBatch.{name}", "field",
                 why="saturation timing: a step's prompt-chunk tokens decide whether it times a decode step "
                     "(manager.prompt_heavy)")
      for name in ("is_prefilling_np", "num_scheduled_tokens")),
    Assumption(RUNNER, "GPUModelRunner.prepare_inputs", "contains",
               ("num_scheduled_tokens_upper_bound = num_scheduled_tokens_np", "num_scheduled_tokens_upper_bound,\n",
                "num_scheduled_tokens=num_scheduled_tokens_upper_bound,"),
               why="a batch's num_scheduled_tokens are the uncompacted counts its seq_lens_cpu_upper_bound adds to the "
                   "computed ones; a catch-up row's bound subtracts them (upkeep.catchup_batch), not the host "
                   "query lengths a partial varlen budget spreads evenly"),
    Assumption(RUNNER, "GPUModelRunner.sample_tokens", "contains",
               ("draft_tokens[:, num_spec_tokens:] = -1",),
               why="a 0-draft step discards every proposed token, so a paused prefill need not sample one"),
    Assumption(DSPARK, "DSparkSpeculator._sample_sequential", "contains", ("self.model.compute_confidence(",),
               patched=True, why="STS: we wrap the model's compute_confidence, which runs inside the draft graph"),
    Assumption(SPEC_INIT, "init_speculator", "contains", ('speculative_config.method == "dspark"',)),
    # --- profiler
    Assumption(LLM, "LLM.collective_rpc", "method", ("method", "timeout", "args", "kwargs"),
               why="profile-sps runs its timing in every worker"),
    Assumption(ARG_UTILS, "EngineArgs.worker_extension_cls", "field",
               why="profile-sps mixes its profiler into the workers and calls it by name (functions do not "
                   "cross the engine-core message bus without process-wide pickling)"),
    Assumption(WORKER_BASE, "WorkerWrapperBase.init_worker", "contains",
               ("parallel_config.worker_extension_cls", "worker_class.__bases__ = worker_class.__bases__ + ("),
               why="the extension's methods become the worker's: collective_rpc('dspark_profile_sps') finds them"),
    Assumption(RUNNER, "GPUModelRunner._dummy_run", "method", ("num_tokens", "uniform_decode", "context_len"),
               why="profile-sps times whole dummy steps; uniform_decode makes them replay mask mode's "
                   "FULL_DECODE_ONLY graphs"),
    Assumption(RUNNER, "GPUModelRunner.load_model", "self_attr", ("decode_query_len",),
               why="a uniform decode dummy step has a multiple of 1 + k tokens"),
    Assumption(RUNNER, "GPUModelRunner.initialize_kv_cache", "self_attr", ("cudagraph_manager",),
               why="profile-sps reads the captured sizes from the runner's graph manager"),
    Assumption(CUDAGRAPH, "CudaGraphManager.__init__", "self_attr", ("varlen_decode", "graphs"),
               why="varlen graphs take dummy steps as they come; uniform ones need uniform_decode dummy steps"),
    Assumption(ASYNC_UTILS, "StepTimingSample.full_cudagraph", "field",
               why="profile-sps prices the draft from steps whose target ran as a FULL graph"),
    Assumption(RUNNER, "GPUModelRunner.__init__", "self_attr",
               ("step_timing", "max_num_tokens", "max_num_reqs", "speculator"),
               why="profile-sps reads vLLM's own step timing and the batch limits"),
    Assumption(ASYNC_UTILS, "StepTimingCollector.collect", "method", (),
               why="forward / drafter split of each timed dummy step"),
    # --- what the bench reads of a vLLM server and how the benchmark harness serves one
    Assumption(SPEC_METRICS, "SpecDecodingProm.__init__", "contains",
               ('"vllm:spec_decode_num_drafts"', '"vllm:spec_decode_num_draft_tokens"',
                '"vllm:spec_decode_num_accepted_tokens"', '"vllm:spec_decode_num_accepted_tokens_per_pos"'),
               why="dspark bench's acceptance length per cell (bench.metrics)"),
    Assumption(LOGGERS, "PrometheusStatLogger.__init__", "contains",
               ('"vllm:prefix_cache_queries"', '"vllm:prefix_cache_hits"'),
               why="dspark bench's prefix_cache per cell: whether a cell found its prompts cached (unequal work)"),
    Assumption(ARG_UTILS, "EngineArgs.add_cli_args", "contains", ('"--enable-prefix-caching"',),
               why="benchmarks/vllm_adaptive.py serves its speed cells with --no-enable-prefix-caching"),
    Assumption(CLI_ARGS, "make_arg_parser", "contains", ('"--api-server-count"',),
               why="benchmarks/vllm_adaptive.py --api-servers: more API processes, should one limit a cell"),
    Assumption(ENVS, "VLLM_DISABLE_COMPILE_CACHE", "contains", ('"VLLM_DISABLE_COMPILE_CACHE"',),
               why="benchmarks/vllm_adaptive.py starts torch.compile servers that share a cache key without it"),
    # --- the start-up warm-up that a draft_model server's token budget must cover (warmup_overflow)
    Assumption(WARMUP, "_warmup_kernels", "contains",
               ("prompt_len = decode_query_len + 1", "// max(prompt_len, decode_query_len),",
                "model_runner.scheduler_config.max_num_seqs,", "num_decode_steps = 5 if num_spec_steps > 0 else 3",
                "decode_len = prompt_len + num_decode_steps * decode_query_len",
                "(model_runner.kv_cache_config.num_blocks - 1) // max_blocks_per_req"),
               why="the warm-up prefills min(max_num_seqs, budget // (K + 2), what the KV cache holds) requests of "
                   "K + 2 tokens"),
    Assumption(WARMUP, "_reserved_block_count", "contains",
               ("num_tokens = min(num_tokens + num_lookahead_tokens, max_model_len)",),
               why="a warm-up request holds blocks for its tokens plus the lookahead (warmup_kv_cap)"),
    Assumption(VLLM_CONFIG, "VllmConfig._set_compile_ranges", "contains",
               ("compile_range_end = self.scheduler_config.max_num_batched_tokens",),
               why="torch.compile covers batches up to the token budget, the draft model's included"),
    Assumption(KERNEL_CONFIG, "KernelConfig.enable_jit_warmup", "field",
               why="the warm-up runs only with it on (the default); off is the refusal's third way out"),
    # --- the start-up profile's dummy runs, whose draft pass can exceed the budget too (dummy_draft_overflow)
    Assumption(AV, "AdaptiveVerificationManager.batches_to_profile", "contains",
               ("for num_tokens in capture_sizes + sorted(tail_sizes):", '"num_tokens": num_tokens,'),
               why="the start-up profile dummy-runs every captured token count, and sizes past the largest"),
    Assumption(RUNNER, "GPUModelRunner._dummy_run", "contains",
               ("num_reqs = min(num_tokens, self.max_num_reqs)",
                "- num_reqs * self.speculator.num_extra_query_per_req,"),
               why="a dummy run takes min(tokens, max_num_seqs) requests and trims its tokens to budget - requests x "
                   "the speculator's extra slots"),
    Assumption(RUNNER, "GPUModelRunner.execute_model", "contains",
               ("input_batch = InputBatch.make_dummy(", "batch_desc.num_tokens,"),
               why="the dummy batch is built at the graph's padded token count, not the trimmed one"),
    Assumption(STANDALONE_AR, "StandaloneARSpeculator", "contains", ("num_extra_query_per_req = 1",),
               why="a draft_model speculator's prefill pass adds one correction slot per request"),
    Assumption(AV, "AdaptiveVerificationManager.batches_to_profile", "contains",
               ("tail_sizes.add(min(size + size // 2, max_num_tokens))", "size = min(size * 2, max_num_tokens)"),
               why="past the largest captured count the profile runs half as much again, then doublings to the "
                   "budget (profile_sizes)"),
    Assumption(COMPILATION, "CompilationMode", "contains", ("VLLM_COMPILE = 3",),
               why="VLLM_COMPILE: the mode whose compile ranges end at the budget"),
    Assumption(CUDAGRAPH, "CudaGraphManager._init_candidates", "contains",
               ("capture_sizes = self.compilation_config.cudagraph_capture_sizes", "cg_mode=mixed_mode,"),
               why="a mixed batch replays a graph of the compilation's capture sizes (the dummy batch's padding)"),
    Assumption(VLLM_CONFIG, "VllmConfig._set_cudagraph_sizes", "contains",
               ("1024 if current_platform.is_device_capability_family(100) else 512",
                "max_num_seqs * decode_query_len * 2, default_max_graph_size",
                "max_cudagraph_capture_size = min(max_num_tokens, max_cudagraph_capture_size)",
                "range(8, min(max_cudagraph_capture_size + 1, 256), 8)",
                "range(256, max_cudagraph_capture_size + 1, 16)",
                "counts += list(range(8, min(max_reqs + 1, 256), 8))",
                "cudagraph_capture_sizes.append(max_num_tokens)"),
               why="the token counts vLLM captures by default (default_capture_sizes)"),
)


def warmup_overflow(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int,
                    max_warmup_reqs: int | None = None) -> str | None:
    """Why a ``draft_model`` server compiled by torch.compile would stop in vLLM's start-up warm-up (None: it
    would not).

    The warm-up (``warmup.py``'s ``_warmup_kernels``, run with ``enable_jit_warmup``, the default) prefills
    ``min(max_num_seqs, budget // (K + 2))`` requests of ``K + 2`` tokens, filling the token budget; the draft's
    prefill pass then runs over those tokens plus one per request (``prepare_prefill_inputs``), while
    torch.compile covers batches up to the budget only (``_set_compile_ranges``). Past it vLLM stops with
    "Shape: N out of considered ranges" after loading the weights. The scheduler leaves that one slot per request
    when it serves, the warm-up does not: a budget below ``max_num_seqs x (K + 3)`` trips it but where it holds
    only a few warm-up requests (256 tokens with 128 requests at K=7: 280; found on the H200, 2026-12-05).
    ``max_warmup_reqs`` is the KV cache's cap on the warm-up's requests, where known. The ways out the message
    names each serve (tests/test_vllm_warmup_budget.py); fewer requests only where one still fits.
    """
    k = num_speculative_tokens
    prompt_len = k + 2  # decode_query_len (1 + K) + 1
    reqs = min(max_num_seqs, max_num_batched_tokens // prompt_len)
    if max_warmup_reqs is not None:
        reqs = min(reqs, max(1, max_warmup_reqs))
    tokens = reqs * (prompt_len + 1)
    if tokens <= max_num_batched_tokens:
        return None
    fewer = max_num_batched_tokens // (k + 3)
    return (f"vLLM {VLLM_VERSION}'s start-up warm-up would run the draft model over {tokens} tokens ({reqs} requests "
            f"of {prompt_len}, plus one each), more than the {max_num_batched_tokens} torch.compile covers "
            f"(--max-num-batched-tokens), and stop there; use "
            + (f"--max-num-seqs {fewer} or fewer, " if fewer else "")
            + f"--max-num-batched-tokens {max_num_seqs * (k + 3)} or more, or --kernel-config "
            "'{\"enable_jit_warmup\": false}'")


def dummy_draft_overflow(num_tokens: int, captured: list[int], max_num_reqs: int, max_num_batched_tokens: int,
                         extra_per_req: int) -> int | None:
    """The tokens a speculator's prefill pass would run in vLLM's dummy run of ``num_tokens`` (a batch of the
    start-up profile, ``batches_to_profile``) where they exceed the token budget torch.compile covers; None where
    they fit.

    ``_dummy_run`` takes ``min(num_tokens, max_num_seqs)`` requests and, for a speculator with extra query slots
    per request (a ``draft_model`` one has one), trims the tokens to ``budget - requests x extra``, which would
    fit. But ``execute_model`` then builds the dummy batch at its graph's padded size, the smallest captured
    count at or above the trimmed one, and the draft's prefill runs over that plus the extra slots: past the
    budget wherever the trim lands between two captured counts. 256 tokens with 25 requests at K=7 on the H200
    (2026-12-05): trimmed to 231, padded to 232, and the draft's pass stopped vLLM's start-up at 257 with "Shape:
    257 out of considered ranges". Real steps are not padded so (the scheduler leaves the slots), and counts past
    the largest captured one run unpadded.
    """
    if extra_per_req <= 0:
        return None
    reqs = min(num_tokens, max_num_reqs, max_num_batched_tokens)
    tokens = min(num_tokens, max_num_batched_tokens - reqs * extra_per_req)
    padded = min((c for c in captured if c >= tokens), default=tokens)
    draft = padded + reqs * extra_per_req
    return draft if draft > max_num_batched_tokens else None


def compiled_padding(compilation_config: object, captured: list[int]) -> list[int] | None:
    """The token counts a mixed dummy batch is padded to (the compilation's piecewise capture sizes, not the
    uniform decode sizes vLLM adds to the captured counts, which such a batch never replays; ``captured`` where
    the config names none), or None where no compile range ends at the budget (not ``VLLM_COMPILE``): what
    :func:`dummy_draft_overflow` is given by the start-up profile's and ``profile-sps``'s callers."""
    mode = getattr(compilation_config, "mode", VLLM_COMPILE)
    if getattr(mode, "value", mode) != VLLM_COMPILE:
        return None
    return sorted(getattr(compilation_config, "cudagraph_capture_sizes", None) or captured)


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int,
                          platform_max: int = 512) -> list[int]:
    """The token counts vLLM 0.33 captures graphs for when the user names none (``_set_cudagraph_sizes``, without
    dynamic speculative decoding or the interactivity mode); ``platform_max`` is 1024 on Blackwell, else 512."""
    q = num_speculative_tokens + 1
    ceiling = min(min(max_num_seqs * q * 2, platform_max), max_num_batched_tokens)
    sizes = {n for n in (1, 2, 4) if n <= ceiling}
    sizes.update(range(8, min(ceiling + 1, 256), 8))
    sizes.update(range(256, ceiling + 1, 16))
    if max_num_batched_tokens <= ceiling:
        sizes.add(max_num_batched_tokens)
    reqs = min(max_num_seqs, platform_max)
    counts = {n for n in (1, 2, 4) if n <= reqs} | set(range(8, min(reqs + 1, 256), 8))
    counts |= set(range(256, reqs + 1, 16)) | {reqs}
    uncapped = min(max_num_seqs * q * 2, platform_max)  # the decode sizes' ceiling, before the budget's
    sizes.update(n * q for n in counts if n * q <= uncapped and n * q <= max_num_batched_tokens)
    return sorted(sizes)


def profile_sizes(captured: list[int], max_num_batched_tokens: int) -> list[int]:
    """The token counts of vLLM's start-up profile (``batches_to_profile``), and of ``dspark profile-sps``:
    every captured count, then half as much again past the largest and doublings up to the budget. Real steps
    run past the capture limit (piecewise or eagerly), and a line through the graph points badly underprices
    them."""
    if not captured:
        return []
    size = captured[-1]
    tails = {min(size + size // 2, max_num_batched_tokens)}
    while size < max_num_batched_tokens:
        size = min(size * 2, max_num_batched_tokens)
        tails.add(size)
    return list(captured) + sorted(tails - set(captured))


def profile_overflow(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int,
                     platform_max: int = 512) -> str | None:
    """Why vLLM 0.33's own adaptive verification would stop a ``draft_model`` server under torch.compile in its
    start-up profile (None: it would not): some profile batch runs the draft past the budget
    (:func:`dummy_draft_overflow`) on the default capture sizes. dspark's manager leaves such batches out of its
    profile; upstream's runs them all."""
    captured = default_capture_sizes(max_num_seqs, max_num_batched_tokens, num_speculative_tokens, platform_max)
    over = [d for n in profile_sizes(captured, max_num_batched_tokens)
            if (d := dummy_draft_overflow(n, captured, max_num_seqs, max_num_batched_tokens, 1)) is not None]
    if not over:
        return None
    enough = min(max_num_seqs * (num_speculative_tokens + 1) * 2, platform_max) + max_num_seqs
    return (f"vLLM {VLLM_VERSION}'s start-up profile of its adaptive verification would run the draft model over "
            f"{max(over)} tokens, more than the {max_num_batched_tokens} torch.compile covers "
            f"(--max-num-batched-tokens), and stop there; use --max-num-batched-tokens {enough} or more")


def warmup_kv_cap(num_blocks: int, block_size: int, num_speculative_tokens: int, num_lookahead_tokens: int,
                  max_model_len: int, groups: int = 1) -> int:
    """How many requests vLLM's warm-up fits into a KV cache of ``num_blocks`` whose ``groups`` full-attention
    groups each hold a request's prompt, five decode steps of ``1 + K`` tokens and the lookahead; block 0 is the
    null block. With ``groups`` an upper bound on the cache's groups, this is a lower bound on the warm-up's."""
    k = num_speculative_tokens
    decode_len = (k + 2) + 5 * (k + 1)
    per_req = -(-min(decode_len + num_lookahead_tokens, max_model_len) // block_size) * groups
    return max(1, (num_blocks - 1) // per_req)


def source_files() -> tuple[str, ...]:
    """Relative paths (inside an unpacked wheel) of every module the contract names."""
    return tuple(sorted({module_path(a.module) for a in CONTRACT}))


def module_path(module: str) -> str:
    """``vllm.a.b`` -> ``vllm/a/b.py`` (or ``vllm/a/b/__init__.py`` for packages we name)."""
    if module in (PLUGINS, SPEC_INIT):
        return module.replace(".", "/") + "/__init__.py"
    return module.replace(".", "/") + ".py"


def default_source_dir() -> Path:
    """Where ``.ci/vllm_wheel.sh`` unpacks the wheel's sources (``DSPARK_VLLM_SRC`` overrides)."""
    env = os.environ.get("DSPARK_VLLM_SRC")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "dspark" / f"vllm-{VLLM_VERSION}-src"


def patched() -> tuple[Assumption, ...]:
    return tuple(a for a in CONTRACT if a.patched)


def lookup(module: str, name: str, kind: Kind | None = None) -> Assumption:
    for a in CONTRACT:
        if a.module == module and a.name == name and (kind is None or a.kind == kind):
            return a
    raise KeyError(f"{module}:{name} is not in the vLLM contract table")


# ---------------------------------------------------------------------------------------------- checking


def _params_in_order(have: list[str], want: tuple[str, ...]) -> bool:
    """``want`` appears as a subsequence of ``have`` (extra parameters in between are allowed)."""
    it = iter(have)
    return all(any(h == w for h in it) for w in want)


def _find_def(tree: object, name: str) -> object | None:
    import ast

    parts = name.split(".")
    body = tree.body  # type: ignore[attr-defined]
    node = None
    for part in parts:
        node = next(
            (n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part),
            None,
        )
        if node is None:
            return None
        body = node.body
    return node


def check_source(a: Assumption, text: str) -> str | None:
    """Check one row against a module's source text; ``None`` if it holds, else what is wrong."""
    import ast

    tree = ast.parse(text)
    where = f"{a.module}:{a.name}"
    if a.kind == "imported":
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == a.source:
                if any(alias.name == a.name and alias.asname in (None, a.name) for alias in node.names):
                    return None
        return f"{where}: not imported by name from {a.source}"
    if a.kind == "constant":
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == a.name for t in node.targets):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    return f"{where}: not a literal"
                return None if value == a.params[0] else f"{where}: is {value!r}, expected {a.params[0]!r}"
        return f"{where}: no module-level assignment"
    if a.kind == "field":
        cls_name, attr = a.name.rsplit(".", 1)
        cls = _find_def(tree, cls_name)
        if not isinstance(cls, ast.ClassDef):
            return f"{where}: class {cls_name} not found"
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
                return None
        return f"{where}: no annotated class attribute {attr}"
    if a.kind == "contains" and "." not in a.name and _find_def(tree, a.name) is None:
        return None if all(s in text for s in a.params) else f"{where}: module lacks {a.params}"
    node = _find_def(tree, a.name)
    if node is None:
        return f"{where}: not found"
    if a.kind == "class":
        return None if isinstance(node, ast.ClassDef) else f"{where}: not a class"
    if a.kind in ("function", "method"):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{where}: not a function"
        args = node.args
        names = [x.arg for x in args.posonlyargs + args.args + args.kwonlyargs]
        if a.kind == "method" and names and names[0] == "self":
            names = names[1:]
        if not _params_in_order(names, a.params):
            return f"{where}: parameters {names} do not include {list(a.params)} in that order"
        return None
    if a.kind == "self_attr":
        assigned = {
            t.attr
            for n in ast.walk(node)
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }
        missing = [p for p in a.params if p not in assigned]
        return None if not missing else f"{where}: does not assign self.{', self.'.join(missing)}"
    if a.kind == "call_kwargs":
        for n in ast.walk(node):
            if isinstance(n, ast.Call):
                f = n.func
                fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if fname == a.source:
                    kws = {k.arg for k in n.keywords}
                    missing = [p for p in a.params if p not in kws]
                    return None if not missing else f"{where}: call to {a.source} lacks keywords {missing}"
        return f"{where}: no call to {a.source}"
    if a.kind == "contains":
        segment = ast.get_source_segment(text, node) or ""
        missing = [s for s in a.params if s not in segment]
        return None if not missing else f"{where}: source lacks {missing}"
    return f"{where}: unknown kind {a.kind}"


def check_runtime(a: Assumption, module: object) -> str | None:
    """Check a patched row against a live (imported) module with ``inspect``; ``None`` if it holds."""
    import inspect

    where = f"{a.module}:{a.name}"
    obj: object = module
    for part in a.name.split("."):
        if not hasattr(obj, part):
            return f"{where}: missing"
        obj = getattr(obj, part)
    obj = getattr(obj, "__dspark_original__", None) or obj  # check what an installed wrapper replaced
    if a.kind in ("function", "method") and a.params:
        try:
            sig = inspect.signature(obj)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return f"{where}: no signature"
        names = [p for p in sig.parameters if p != "self"]
        if not _params_in_order(names, a.params):
            return f"{where}: parameters {names} do not include {list(a.params)} in that order"
    return None
