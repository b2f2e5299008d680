"""vLLM ``general_plugins`` entry point: put dspark's verification manager into Model Runner V2.

vLLM calls :func:`register` in every process (frontend, engine core, each worker -- in workers before the
model runner is imported), possibly several times. It cannot see the engine config at that point, so it
installs exactly one thing: a *gate* in place of ``maybe_create_adaptive_verification_manager``, rebound
both in the defining module and, if already imported, in ``model_runner`` (which imports it by name). The
gate is a pure pass-through to upstream unless ``VllmConfig.additional_config`` carries our ``"dspark"``
object. Only then, from inside the runner's ``initialize_kv_cache``, does it install the rest:

* ``model_runner.ModelCudaGraphManager``: a subclass that turns ``varlen_decode`` off where no paused step
  compacts (mask with ``mask_paused_compact: false``: uniform decode graphs only);
* ``GPUModelRunner.capture_model``: attach the speculator hooks (STS inside the draft graph, outcomes,
  saturation) before any graph is captured;
* ``GPUModelRunner.sample_tokens``: the saturation policy decides, after the step's budget, whether the
  step drafts (a paused step schedules 0 drafts, as vLLM does for a step that needs none);
* ``GPUModelRunner.prepare_inputs``: mask mode pads pruned rows once the drafts are in ``input_ids``;
* ``RejectionSampler.__call__``: OR mask mode's ``invalid_drafts`` into the runner's (grammar) mask;
* ``AsyncScheduler._update_after_schedule``, only for a manager with ``plain_paused_steps``: publish the
  placeholder drafts the step's requests hold, so that a paused step can empty them and the step after it is
  scheduled as plain decoding (:func:`publish_placeholders`).

Every name is checked against ``contract.CONTRACT`` first; a drifted vLLM refuses to start with one message.
Nothing here sets environment variables. vLLM absent: :func:`register` logs at debug level and returns.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from dspark_cli.engines.vllm import contract
from dspark_cli.engines.vllm.config import DsparkVllmSettings

logger = logging.getLogger("vllm.dspark")

MARK = "__dspark_original__"  # set on every object we install; holds what it replaced
FACTORY = "maybe_create_adaptive_verification_manager"
INVALID_DRAFTS_ATTR = contract.INVALID_DRAFTS_ATTR


def is_patched(obj: Any) -> bool:
    return getattr(obj, MARK, None) is not None


class PatchState:
    """What the installed wrappers share (one per process, reachable from the gate).

    ``modules`` resolves a dotted module name (``sys.modules`` in vLLM; stand-in modules in tests);
    ``create`` builds our manager (``manager.create_manager`` in vLLM). ``varlen_override`` carries the
    gate's decision (no varlen graphs where no paused step compacts) to the ModelCudaGraphManager built right after it in the
    same ``initialize_kv_cache``, keyed by the ``VllmConfig`` object both calls receive.
    """

    def __init__(self, modules: Mapping[str, ModuleType] | None = None,
                 create: Callable[[DsparkVllmSettings, ModuleType, dict[str, Any]], Any] | None = None) -> None:
        self._modules = modules
        self.create = create or _default_create
        self.varlen_override: dict[int, bool] = {}
        self.runtime_installed = False
        # The placeholder-draft list vLLM's asynchronous scheduler handed every request of the step it scheduled
        # last (published by the _update_after_schedule hook; None where no scheduler runs in this process).
        self.placeholders: list[int] | None = None

    def module(self, name: str) -> ModuleType | None:
        if self._modules is not None:
            return self._modules.get(name)
        return sys.modules.get(name)

    def load(self, name: str) -> ModuleType | None:
        """``module``, importing it first in vLLM (the scheduler's module is imported after the runner's)."""
        if self._modules is not None:
            return self._modules.get(name)
        try:
            return importlib.import_module(name)
        except ImportError:
            return None

    def drop_placeholders(self) -> bool:
        """Empty the step's placeholder drafts in place: vLLM then schedules the next step of those requests
        with none, as plain decoding. Returns whether there were any to drop.

        Safe only between this step's scheduling and the next's, which is when the runner's
        ``sample_tokens`` runs in vLLM 0.33's engine core (schedule, execute, sample, then the next schedule;
        with the uniprocess executor the worker runs in the scheduler's thread). Until the next ``schedule``
        only the requests hold the list; that call copies it into the step's ``scheduled_spec_decode_tokens``,
        which the scheduler later reads back to count rejections, so a list emptied after it would unbalance
        that count. Each list is dropped at most once, and a new step's publication replaces it.
        """
        placeholders, self.placeholders = self.placeholders, None
        if not placeholders:
            return False
        placeholders.clear()
        return True


def _default_create(settings: DsparkVllmSettings, av_module: ModuleType, kwargs: dict[str, Any]) -> Any:
    from dspark_cli.engines.vllm.manager import create_manager

    return create_manager(settings, av_module, kwargs)


def _drift(checks: list[tuple[contract.Assumption, ModuleType | None]]) -> list[str]:
    problems = []
    for row, module in checks:
        if module is None:
            problems.append(f"{row.module}: not imported")
            continue
        problem = contract.check_runtime(row, module)
        if problem:
            problems.append(problem)
    return problems


# ---------------------------------------------------------------------------------------------- the gate


def make_gate(original: Callable[..., Any], state: PatchState) -> Callable[..., Any]:
    def maybe_create_adaptive_verification_manager(**kwargs: Any) -> Any:
        settings = DsparkVllmSettings.from_vllm_config(kwargs.get("vllm_config"))
        if settings is None or not settings.active or not kwargs.get("enable_adaptive_verification"):
            return original(**kwargs)
        install_runtime_patches(state)
        av = state.module(contract.AV)
        assert av is not None
        manager = state.create(settings, av, kwargs)
        if (settings.plain_paused_steps and hasattr(manager, "set_placeholder_dropper")
                and publish_placeholders(state)):
            manager.set_placeholder_dropper(state.drop_placeholders)
        # Varlen decode graphs wherever a paused step compacts (varlen; mask with mask_paused_compact).
        state.varlen_override[id(kwargs["vllm_config"])] = bool(
            getattr(manager, "compact_paused", getattr(manager, "mode", settings.mode) == "varlen"))
        return manager

    setattr(maybe_create_adaptive_verification_manager, MARK, original)
    maybe_create_adaptive_verification_manager.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    maybe_create_adaptive_verification_manager.__doc__ = original.__doc__
    maybe_create_adaptive_verification_manager.dspark_state = state  # type: ignore[attr-defined]
    return maybe_create_adaptive_verification_manager


def install_gate(state: PatchState) -> bool:
    """Rebind the factory in the defining module and in ``model_runner`` if imported. Idempotent.

    Returns whether anything was (re)bound. Refuses (logs an error, binds nothing) if the factory drifted.
    """
    av = state.module(contract.AV)
    if av is None:
        return False
    current = getattr(av, FACTORY, None)
    if current is None:
        logger.error("dspark: %s.%s is missing; the plugin stays inactive", contract.AV, FACTORY)
        return False
    original = getattr(current, MARK, current)
    problems = _drift([(contract.lookup(contract.AV, FACTORY, "function"), av)]) if not is_patched(current) else []
    if problems:
        logger.error("dspark: vLLM's adaptive verification moved (%s); the plugin stays inactive",
                     "; ".join(problems))
        return False
    gate = current if is_patched(current) else make_gate(original, state)
    changed = False
    if getattr(av, FACTORY) is not gate:
        setattr(av, FACTORY, gate)
        changed = True
    runner = state.module(contract.RUNNER)
    if runner is not None and getattr(runner, FACTORY, None) is not gate:
        setattr(runner, FACTORY, gate)
        changed = True
    return changed


# ---------------------------------------------------------------------------------------------- runtime patches


def _is_ours(manager: Any) -> bool:
    return bool(getattr(manager, "dspark_manager", False))


def install_runtime_patches(state: PatchState) -> None:
    """Install the runner/sampler hooks (once per process); loud if vLLM drifted from the contract."""
    if state.runtime_installed:
        return
    runner = state.module(contract.RUNNER)
    rejection = state.module(contract.REJECTION)
    cudagraph = state.module(contract.CUDAGRAPH)
    checks = [(row, state.module(row.module)) for row in contract.patched()
              if row.kind in ("method", "function") and row.module in (contract.RUNNER, contract.REJECTION,
                                                                        contract.SPECULATOR, contract.CUDAGRAPH)]
    checks.append((contract.lookup(contract.CUDAGRAPH, "ModelCudaGraphManager.__init__", "method"), cudagraph))
    problems = _drift(checks)
    if runner is None or not hasattr(runner, "ModelCudaGraphManager") or not hasattr(runner, "GPUModelRunner"):
        problems.append(f"{contract.RUNNER}: GPUModelRunner/ModelCudaGraphManager not bound")
    if problems:
        raise RuntimeError("dspark plugin: vLLM internals differ from what it was built for (vllm=="
                           f"{contract.VLLM_VERSION}): " + "; ".join(problems))
    assert runner is not None and rejection is not None

    # ModelCudaGraphManager: varlen decode graphs only for a manager whose steps compact (varlen, or mask whose
    # paused steps compact: mask_paused_compact).
    cg_current = runner.ModelCudaGraphManager
    if not is_patched(cg_current):
        base = cg_current

        class ModelCudaGraphManager(base):  # type: ignore[misc, valid-type]
            def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
                override = state.varlen_override.pop(id(vllm_config), None)
                if override is not None and kwargs.get("varlen_decode"):
                    kwargs["varlen_decode"] = override
                super().__init__(vllm_config, *args, **kwargs)

        setattr(ModelCudaGraphManager, MARK, base)
        ModelCudaGraphManager.__qualname__ = base.__qualname__
        runner.ModelCudaGraphManager = ModelCudaGraphManager

    cls = runner.GPUModelRunner
    # Before capture: speculator hooks (STS inside the draft graph, outcomes, saturation) exist before any
    # graph is captured. Before sample_tokens: the saturation policy decides whether this step drafts.
    _run_before(cls, "capture_model", lambda manager, runner_self: manager.attach(runner_self))
    _run_before(cls, "sample_tokens", lambda manager, runner_self: manager.begin_drafting_step(runner_self))

    if not is_patched(cls.prepare_inputs):
        prepare_original = cls.prepare_inputs

        @functools.wraps(prepare_original)
        def prepare_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
            batch = prepare_original(self, *args, **kwargs)
            manager = getattr(self, "adaptive_verification", None)
            if _is_ours(manager):
                desc = args[2] if len(args) > 2 else kwargs.get("batch_desc")
                bound_query_len(batch, desc)
                if manager.mode == "mask":
                    manager.apply_mask(batch)
            return batch

        setattr(prepare_inputs, MARK, prepare_original)
        cls.prepare_inputs = prepare_inputs

    sampler_cls = rejection.RejectionSampler
    if not is_patched(sampler_cls.__call__):
        call_original = sampler_cls.__call__

        @functools.wraps(call_original)
        def __call__(self: Any, logits: Any, input_batch: Any, draft_logits: Any = None,
                     invalid_drafts: Any = None) -> Any:
            ours = getattr(input_batch, INVALID_DRAFTS_ATTR, None)
            if ours is not None:
                if ours.shape[0] != logits.shape[0]:
                    raise RuntimeError(f"dspark mask mode: invalid-draft mask has {ours.shape[0]} rows for "
                                       f"{logits.shape[0]} logit rows")
                invalid_drafts = ours if invalid_drafts is None else (invalid_drafts | ours)
            return call_original(self, logits, input_batch, draft_logits, invalid_drafts)

        setattr(__call__, MARK, call_original)
        sampler_cls.__call__ = __call__
    state.runtime_installed = True


def publish_placeholders(state: PatchState) -> bool:
    """``plain_paused_steps``: wrap ``AsyncScheduler._update_after_schedule`` to publish the placeholder list it
    handed the step's requests (:meth:`PatchState.drop_placeholders`); returns whether the hook is in place
    (idempotent). It is called in every worker process, but only one that runs in the engine core's process (vLLM's
    uniprocess executor) has a scheduler stepping beside it: where the worker runs elsewhere, nothing is
    published there and a paused step keeps its placeholders. A drifted scheduler leaves the hook out with one
    warning -- paused steps then compact the placeholders away, as by default -- rather than refusing to
    serve."""
    module = state.load(contract.ASYNC_SCHEDULER)
    cls = getattr(module, "AsyncScheduler", None)
    problems = _drift([(row, module) for row in contract.CONTRACT
                       if row.module == contract.ASYNC_SCHEDULER and row.kind in ("method", "contains")])
    if cls is None or problems:
        logger.warning("dspark: vLLM's asynchronous scheduler differs from what the plugin expects (%s): paused "
                       "steps keep their placeholder drafts", "; ".join(problems) or "no AsyncScheduler")
        return False
    original = cls._update_after_schedule
    if is_patched(original):
        return True

    @functools.wraps(original)
    def _update_after_schedule(self: Any, scheduler_output: Any) -> None:
        original(self, scheduler_output)
        state.placeholders = self._spec_token_placeholders

    setattr(_update_after_schedule, MARK, original)
    cls._update_after_schedule = _update_after_schedule
    return True


def bound_query_len(batch: Any, desc: Any) -> None:
    """Give a batch the query-length bound of the CUDA graph it replays.

    A varlen decode graph is captured with attention metadata for queries of up to ``1 + K`` tokens per
    request (``BatchExecutionDescriptor.max_query_len``), and a replay must build its metadata with the
    same bound (``InputBatch.max_query_len`` says so). vLLM's runner sets it only for batches that carry
    drafts, and then to the batch's own longest query. A batch scheduled with none builds its metadata for
    one-token queries. Upstream never replays a varlen graph with such a batch (it pads new decode rows to
    ``1 + K``), but the step after a paused one does (``plain_paused_steps``), and with the bound unset its
    greedy outputs with real weights on the H200 were garbage after a few tokens (docs/PERFORMANCE.md
    section 33). A batch whose every request was scheduled fewer than K drafts (near ``max_model_len``) has
    the same mismatch in a smaller way, so the descriptor's bound wins wherever it is the larger: with it,
    the metadata is what the compacted paused step always built, whose outputs matched no speculation's. A
    larger bound than a batch's queries is still a valid one, and a descriptor with none (piecewise, eager)
    leaves the batch as it is."""
    bound = getattr(desc, "max_query_len", None)
    if bound is not None and (batch.max_query_len is None or batch.max_query_len < bound):
        batch.max_query_len = int(bound)


def _run_before(cls: type, name: str, hook: Callable[[Any, Any], None]) -> None:
    """Wrap ``cls.name`` so that ``hook(our_manager, runner)`` runs first when the runner holds our manager."""
    original = getattr(cls, name)
    if is_patched(original):
        return

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager = getattr(self, "adaptive_verification", None)
        if _is_ours(manager):
            hook(manager, self)
        return original(self, *args, **kwargs)

    setattr(wrapper, MARK, original)
    setattr(cls, name, wrapper)


# ---------------------------------------------------------------------------------------------- entry point


def _gate_state(av: ModuleType | None) -> PatchState | None:
    gate = getattr(av, FACTORY, None) if av is not None else None
    return getattr(gate, "dspark_state", None) if is_patched(gate) else None


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent; inert without vLLM or without our settings."""
    if importlib.util.find_spec("vllm") is None:
        logger.debug("dspark: vLLM is not installed; the vLLM plugin does nothing")
        return
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version != contract.VLLM_VERSION:
        logger.warning("dspark: vLLM %s is not %s; the dspark plugin stays inactive", version, contract.VLLM_VERSION)
        return
    av = importlib.import_module(contract.AV)
    state = _gate_state(av) or PatchState()
    install_gate(state)


__all__ = ["register", "install_gate", "install_runtime_patches", "publish_placeholders", "bound_query_len",
           "PatchState", "make_gate", "MARK"]
