"""The plugin's rebinding logic, on stand-in modules built from the contract table.

vLLM cannot be imported on a CPU machine, so these modules are stand-ins: each patched function/method is
generated with exactly the parameters ``contract.CONTRACT`` says vLLM 0.33.0 has (the contract tests prove
that against the real wheel), and the plugin is exercised on them -- gate pass-through, activation by
``additional_config``, idempotency, refusal on drift. Tensors are real torch tensors.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import types
from typing import Any

import pytest
import torch

from dspark_cli.engines.vllm import contract, plugin

FACTORY_ROW = contract.lookup(contract.AV, "maybe_create_adaptive_verification_manager", "function")


def _signature(params: tuple[str, ...], *, method: bool, kwonly: bool = False, defaults: dict | None = None):
    kind = inspect.Parameter.KEYWORD_ONLY if kwonly else inspect.Parameter.POSITIONAL_OR_KEYWORD
    ps = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if method else []
    for p in params:
        default = (defaults or {}).get(p, inspect.Parameter.empty)
        ps.append(inspect.Parameter(p, kind, default=default))
    return inspect.Signature(ps)


def _with_signature(fn: Any, row: contract.Assumption, **kw: Any) -> Any:
    fn.__signature__ = _signature(row.params, method=row.kind == "method", **kw)
    return fn


class FakeConfig:
    def __init__(self, additional: dict | None = None) -> None:
        self.additional_config = additional or {}


def make_standins(*, rejection_params: tuple[str, ...] | None = None) -> dict[str, types.ModuleType]:
    av = types.ModuleType(contract.AV)
    runner = types.ModuleType(contract.RUNNER)
    rejection = types.ModuleType(contract.REJECTION)
    cudagraph = types.ModuleType(contract.CUDAGRAPH)
    speculator = types.ModuleType(contract.SPECULATOR)
    calls: list[dict] = []

    def factory(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return "upstream-manager"

    _with_signature(factory, FACTORY_ROW, kwonly=True)
    av.maybe_create_adaptive_verification_manager = factory
    av.upstream_calls = calls
    av.AdaptiveVerificationManager = type("AdaptiveVerificationManager", (), {})

    class ModelCudaGraphManager:
        def __init__(self, vllm_config: Any, device: Any, cudagraph_mode: Any, decode_query_len: int,
                     lora_capture_cases: Any = None, varlen_decode: bool = False, ubatch_runner: Any = None) -> None:
            self.varlen_decode = varlen_decode

    cudagraph.ModelCudaGraphManager = ModelCudaGraphManager

    class GPUModelRunner:
        def __init__(self) -> None:
            self.adaptive_verification: Any = None
            self.events: list[str] = []

        def prepare_inputs(self, scheduler_output: Any, batch_req_state: Any, batch_desc: Any,
                           num_active_loras: int) -> Any:
            return types.SimpleNamespace(name="batch", max_query_len=None)

        def capture_model(self, *, profile_only: bool = False) -> int:
            self.events.append("capture")
            return 0

        def sample_tokens(self, grammar_output: Any) -> Any:
            self.events.append("sample_tokens")
            return grammar_output

    def sampler_call(self: Any, logits: Any, input_batch: Any, draft_logits: Any = None, invalid_drafts: Any = None):
        return invalid_drafts

    row = contract.lookup(contract.REJECTION, "RejectionSampler.__call__", "method")
    if rejection_params is not None:
        row = contract.Assumption(row.module, row.name, row.kind, rejection_params)
    _with_signature(sampler_call, row, defaults={"draft_logits": None, "invalid_drafts": None})
    rejection.RejectionSampler = type("RejectionSampler", (), {"__call__": sampler_call})

    def observe(self: Any, idx_mapping: Any, num_sampled: Any, num_rejected: Any) -> None:
        return None

    speculator.DraftModelSpeculator = type("DraftModelSpeculator", (), {"observe_verification": observe})
    runner.maybe_create_adaptive_verification_manager = factory  # imported by name
    runner.ModelCudaGraphManager = ModelCudaGraphManager
    runner.GPUModelRunner = GPUModelRunner
    runner.RejectionSampler = rejection.RejectionSampler
    scheduler = types.ModuleType(contract.ASYNC_SCHEDULER)

    class AsyncScheduler:
        """vLLM 0.33's: every step hands each request it schedules one fresh list of placeholder drafts."""

        def __init__(self, num_spec_tokens: int = 3) -> None:
            self.num_spec_tokens = num_spec_tokens
            self.requests: dict[str, types.SimpleNamespace] = {}
            self._spec_token_placeholders: list[int] = [-1] * num_spec_tokens

        def _update_after_schedule(self, scheduler_output: Any) -> None:
            self._spec_token_placeholders = [-1] * scheduler_output.num_spec_tokens_to_schedule
            for req_id in scheduler_output.num_scheduled_tokens:
                self.requests[req_id].spec_token_ids = self._spec_token_placeholders

    scheduler.AsyncScheduler = AsyncScheduler
    return {m.__name__: m for m in (av, runner, rejection, cudagraph, speculator, scheduler)}


class FakeManager:
    dspark_manager = True

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.masked: list[Any] = []
        self.attached: list[Any] = []

    def apply_mask(self, batch: Any) -> None:
        self.masked.append(batch)
        setattr(batch, contract.INVALID_DRAFTS_ATTR, torch.tensor([False, True, True]))

    def attach(self, runner: Any) -> None:
        self.attached.append(runner)

    def begin_drafting_step(self, runner: Any) -> None:
        runner.events.append("begin_drafting_step")

    def set_placeholder_dropper(self, drop: Any) -> None:
        self.drop_placeholders = drop


def _state(modules: dict, mode: str = "mask") -> tuple[plugin.PatchState, list]:
    created: list = []

    def create(settings: Any, av: Any, kwargs: dict) -> FakeManager:
        created.append((settings, kwargs))
        return FakeManager(mode)

    return plugin.PatchState(modules, create=create), created


def _factory_kwargs(config: FakeConfig, enable: bool = True) -> dict:
    kw = {p: None for p in FACTORY_ROW.params}
    kw.update(enable_adaptive_verification=enable, vllm_config=config)
    return kw


def test_register_without_vllm_is_a_debug_logged_noop(caplog: pytest.LogCaptureFixture) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    before = set(sys.modules)
    with caplog.at_level(logging.DEBUG, logger="vllm.dspark"):
        plugin.register()
        plugin.register()
    assert not any(m == "vllm" or m.startswith("vllm.") for m in set(sys.modules) - before)
    msgs = [r for r in caplog.records if r.name == "vllm.dspark"]
    assert msgs and all(r.levelno == logging.DEBUG for r in msgs)


def test_gate_is_installed_in_both_modules_once() -> None:
    modules = make_standins()
    original = modules[contract.AV].maybe_create_adaptive_verification_manager
    state, _ = _state(modules)
    assert plugin.install_gate(state) is True
    gate = modules[contract.AV].maybe_create_adaptive_verification_manager
    assert modules[contract.RUNNER].maybe_create_adaptive_verification_manager is gate
    assert getattr(gate, plugin.MARK) is original
    assert inspect.signature(gate) == inspect.signature(original)
    # loading the plugin again (a new state, as a second register() would build) changes nothing
    assert plugin.install_gate(plugin.PatchState(modules)) is False
    assert plugin.install_gate(state) is False
    assert modules[contract.AV].maybe_create_adaptive_verification_manager is gate


def test_gate_passes_through_without_our_settings() -> None:
    modules = make_standins()
    state, created = _state(modules)
    plugin.install_gate(state)
    gate = modules[contract.RUNNER].maybe_create_adaptive_verification_manager
    kw = _factory_kwargs(FakeConfig({"someone_else": 1}))
    assert gate(**kw) == "upstream-manager"
    assert modules[contract.AV].upstream_calls == [kw]
    assert gate(**_factory_kwargs(FakeConfig({"dspark": {"mode": "none"}}))) == "upstream-manager"
    assert gate(**_factory_kwargs(FakeConfig({"dspark": {"mode": "mask"}}), enable=False)) == "upstream-manager"
    assert created == [] and not state.runtime_installed
    assert not plugin.is_patched(modules[contract.RUNNER].GPUModelRunner.prepare_inputs)


def test_our_settings_install_the_runtime_patches_once() -> None:
    modules = make_standins()
    runner_mod = modules[contract.RUNNER]
    state, created = _state(modules, mode="mask")
    plugin.install_gate(state)
    config = FakeConfig({"dspark": {"mode": "varlen", "online_sts": True}})
    manager = runner_mod.maybe_create_adaptive_verification_manager(**_factory_kwargs(config))
    assert isinstance(manager, FakeManager) and created[0][0].online_sts is True
    assert state.runtime_installed
    # mask (e.g. after a varlen fallback): the graph manager built next in initialize_kv_cache is uniform
    cg = runner_mod.ModelCudaGraphManager(config, "cuda", "FULL", 8, lora_capture_cases=None, varlen_decode=True)
    assert cg.varlen_decode is False
    assert isinstance(cg, modules[contract.CUDAGRAPH].ModelCudaGraphManager)
    other = runner_mod.ModelCudaGraphManager(FakeConfig(), "cuda", "FULL", 8, varlen_decode=True)
    assert other.varlen_decode is True  # no decision pending for that config: untouched
    # the runner's hooks reach our manager
    runner = runner_mod.GPUModelRunner()
    runner.adaptive_verification = manager
    runner.capture_model(profile_only=False)
    assert manager.attached == [runner] and runner.events == ["capture"]
    batch = runner.prepare_inputs(None, None, None, 0)
    assert manager.masked == [batch]
    # the saturation decision runs before the runner's own sample_tokens, which still gets its argument
    assert runner.sample_tokens("grammar") == "grammar"
    assert runner.events == ["capture", "begin_drafting_step", "sample_tokens"]
    # installing again (a second plugin load) wraps nothing twice
    def current() -> tuple:
        cls = runner_mod.GPUModelRunner
        return (cls.prepare_inputs, cls.capture_model, cls.sample_tokens,
                modules[contract.REJECTION].RejectionSampler.__call__, runner_mod.ModelCudaGraphManager)

    patched = current()
    plugin.install_runtime_patches(plugin.PatchState(modules))
    assert patched == current()


def _gated_manager(dspark: dict) -> tuple[dict, FakeManager]:
    """Stand-in modules with the gate installed, and the manager it builds for these dspark settings."""
    modules = make_standins()
    state, _ = _state(modules, mode=dspark["mode"])
    plugin.install_gate(state)
    config = FakeConfig({"dspark": dspark})
    return modules, modules[contract.RUNNER].maybe_create_adaptive_verification_manager(**_factory_kwargs(config))


def _scheduled(sched: Any, requests: list[str], k: int = 3) -> Any:
    for x in requests:
        sched.requests.setdefault(x, types.SimpleNamespace(spec_token_ids=[]))
    out = types.SimpleNamespace(num_spec_tokens_to_schedule=k, num_scheduled_tokens=dict.fromkeys(requests, 1))
    sched._update_after_schedule(out)
    return out


def test_a_paused_step_can_empty_the_placeholders_its_scheduler_step_handed_out() -> None:
    """plain_paused_steps: the manager gets a dropper that empties, in place, the one list of placeholder
    drafts vLLM's scheduler handed every request of the step it scheduled last -- so the next step schedules
    those requests no drafts. One drop per step; a new step's list replaces it."""
    modules, manager = _gated_manager({"mode": "varlen", "plain_paused_steps": True})
    sched_cls = modules[contract.ASYNC_SCHEDULER].AsyncScheduler
    assert plugin.is_patched(sched_cls._update_after_schedule)
    sched = sched_cls()
    assert manager.drop_placeholders() is False  # nothing scheduled yet
    _scheduled(sched, ["a", "b"])
    assert [sched.requests[x].spec_token_ids for x in "ab"] == [[-1] * 3] * 2
    assert manager.drop_placeholders() is True
    assert [sched.requests[x].spec_token_ids for x in "ab"] == [[], []]
    assert manager.drop_placeholders() is False  # at most once per step
    _scheduled(sched, ["a", "b"])  # the next step hands out a fresh list, untouched by the last drop
    assert sched.requests["a"].spec_token_ids == [-1] * 3
    # installing again wraps the scheduler once
    wrapped = sched_cls._update_after_schedule
    assert plugin.publish_placeholders(plugin.PatchState(modules)) is True
    assert sched_cls._update_after_schedule is wrapped


def test_plain_paused_steps_off_leaves_the_placeholders_alone() -> None:
    """Turned off, the scheduler is not even wrapped: paused steps compact their placeholders away."""
    modules, manager = _gated_manager({"mode": "varlen", "plain_paused_steps": False})
    assert not hasattr(manager, "drop_placeholders")
    assert not plugin.is_patched(modules[contract.ASYNC_SCHEDULER].AsyncScheduler._update_after_schedule)


def test_plain_paused_steps_is_the_default() -> None:
    """On by default since the H200's greedy lossless check with real weights passed with it
    (docs/PERFORMANCE.md section 34): a manager without the key gets the dropper and the scheduler hook."""
    modules, manager = _gated_manager({"mode": "varlen"})
    assert hasattr(manager, "drop_placeholders")
    assert plugin.is_patched(modules[contract.ASYNC_SCHEDULER].AsyncScheduler._update_after_schedule)


def test_a_drifted_scheduler_keeps_its_placeholders_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler hook is an optimization: where vLLM's scheduler moved, the plugin serves without it
    (paused steps compact their placeholders away) instead of refusing to start."""
    modules = make_standins()
    del modules[contract.ASYNC_SCHEDULER].AsyncScheduler._update_after_schedule
    state, _ = _state(modules, mode="varlen")
    plugin.install_gate(state)
    config = FakeConfig({"dspark": {"mode": "varlen", "plain_paused_steps": True}})
    with caplog.at_level(logging.WARNING, logger="vllm.dspark"):
        manager = modules[contract.RUNNER].maybe_create_adaptive_verification_manager(**_factory_kwargs(config))
    assert state.runtime_installed and not hasattr(manager, "drop_placeholders")
    assert any("paused steps keep their placeholder drafts" in r.getMessage() for r in caplog.records)
    assert state.drop_placeholders() is False


def test_a_batch_without_drafts_gets_the_query_bound_of_the_graph_it_replays() -> None:
    """The step after a paused one carries no drafts, and vLLM builds its attention metadata for one-token
    queries -- but it replays a varlen decode graph captured for up to 1 + K (garbage outputs on the H200
    until the bound was passed on). The descriptor's bound reaches the batch through the runner's
    prepare_inputs, and wins over a smaller one the runner set (every request scheduled fewer than K drafts);
    a piecewise descriptor's none leaves the batch's bound as it is."""
    modules, manager = _gated_manager({"mode": "varlen"})
    runner = modules[contract.RUNNER].GPUModelRunner()
    runner.adaptive_verification = manager
    desc = types.SimpleNamespace(max_query_len=8)
    assert runner.prepare_inputs(None, None, desc, 0).max_query_len == 8
    assert runner.prepare_inputs(None, None, batch_desc=desc, num_active_loras=0).max_query_len == 8
    for runner_bound, desc_bound, want in ((None, None, None), (3, None, 3), (3, 8, 8), (8, 8, 8), (None, 8, 8)):
        batch = types.SimpleNamespace(max_query_len=runner_bound)
        plugin.bound_query_len(batch, types.SimpleNamespace(max_query_len=desc_bound))
        assert batch.max_query_len == want


def test_a_mask_manager_whose_paused_steps_compact_gets_varlen_graphs() -> None:
    """mask_paused_compact: a paused mask step runs varlen's one-token-per-request batch, which only varlen
    decode graphs replay; the uniform masked drafting batches replay them too."""
    modules = make_standins()
    runner_mod = modules[contract.RUNNER]
    managers: list[FakeManager] = []

    def create(settings: Any, av: Any, kwargs: dict) -> FakeManager:
        managers.append(FakeManager("mask"))
        managers[-1].compact_paused = settings.mask_paused_compact  # as create_manager decides it
        return managers[-1]

    plugin.install_gate(plugin.PatchState(modules, create=create))
    for compact in (True, False):
        config = FakeConfig({"dspark": {"mode": "mask", "mask_paused_compact": compact}})
        runner_mod.maybe_create_adaptive_verification_manager(**_factory_kwargs(config))
        cg = runner_mod.ModelCudaGraphManager(config, "cuda", "FULL", 8, varlen_decode=True)
        assert cg.varlen_decode is compact


def test_varlen_manager_keeps_varlen_graphs_and_upstream_runner_is_untouched() -> None:
    modules = make_standins()
    runner_mod = modules[contract.RUNNER]
    state, _ = _state(modules, mode="varlen")
    plugin.install_gate(state)
    config = FakeConfig({"dspark": {"mode": "varlen"}})
    manager = runner_mod.maybe_create_adaptive_verification_manager(**_factory_kwargs(config))
    assert runner_mod.ModelCudaGraphManager(config, "cuda", "FULL", 8, varlen_decode=True).varlen_decode is True
    runner = runner_mod.GPUModelRunner()
    runner.adaptive_verification = manager
    runner.prepare_inputs(None, None, None, 0)
    assert manager.masked == []  # varlen: nothing to pad
    upstream_runner = runner_mod.GPUModelRunner()
    upstream_runner.adaptive_verification = object()  # upstream's manager
    upstream_runner.capture_model()
    assert upstream_runner.events == ["capture"]


def test_sampler_hook_ors_our_mask_into_the_runners() -> None:
    modules = make_standins()
    state, _ = _state(modules)
    plugin.install_runtime_patches(state)
    sampler = modules[contract.REJECTION].RejectionSampler()
    logits = torch.zeros(3, 5)
    batch = types.SimpleNamespace()
    assert sampler(logits, batch, None, None) is None  # not ours: unchanged
    setattr(batch, contract.INVALID_DRAFTS_ATTR, torch.tensor([False, False, True]))
    assert sampler(logits, batch, None, None).tolist() == [False, False, True]
    grammar = torch.tensor([False, True, False])
    assert sampler(logits, batch, None, grammar).tolist() == [False, True, True]
    with pytest.raises(RuntimeError, match="logit rows"):
        sampler(torch.zeros(4, 5), batch)


def test_drifted_vllm_refuses_loudly() -> None:
    modules = make_standins(rejection_params=("logits", "input_batch", "draft_logits"))
    state, _ = _state(modules)
    with pytest.raises(RuntimeError, match="RejectionSampler.__call__"):
        plugin.install_runtime_patches(state)


def test_drifted_factory_leaves_the_gate_out(caplog: pytest.LogCaptureFixture) -> None:
    modules = make_standins()
    av = modules[contract.AV]

    def factory(*, enable_adaptive_verification: bool, vllm_config: Any) -> None:
        return None

    av.maybe_create_adaptive_verification_manager = factory
    with caplog.at_level(logging.ERROR, logger="vllm.dspark"):
        assert plugin.install_gate(plugin.PatchState(modules)) is False
    assert av.maybe_create_adaptive_verification_manager is factory
    assert "stays inactive" in caplog.text


def test_register_never_touches_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    before = dict(os.environ)
    plugin.register()
    assert dict(os.environ) == before
