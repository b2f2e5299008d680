"""Contract tests: every vLLM 0.33.0 internal the plugin relies on, checked against the real wheel's source.

The wheel is a CUDA build (torch 2.14 pin) and cannot be imported on CPU, so the rows of
``engines/vllm/contract.py`` are checked with ``ast`` on the sources ``.ci/vllm_wheel.sh`` unpacks. An
upgrade that renames, moves or re-signs a patched name fails here instead of silently disabling the plugin.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dspark_cli.engines.vllm import contract

SRC = contract.default_source_dir()
needs_src = pytest.mark.skipif(
    not (SRC / ".complete").exists() and not (SRC / "vllm").is_dir(),
    reason=f"vLLM {contract.VLLM_VERSION} sources not unpacked at {SRC}: run .ci/vllm_wheel.sh "
    "(or set DSPARK_VLLM_SRC)",
)
ROOT = Path(__file__).resolve().parents[1]


def _call_row(callee: str) -> contract.Assumption:
    return next(a for a in contract.CONTRACT if a.kind == "call_kwargs" and a.source == callee)


def _read(module: str) -> str:
    return (SRC / contract.module_path(module)).read_text(encoding="utf-8")


@needs_src
@pytest.mark.parametrize("row", contract.CONTRACT, ids=lambda a: f"{a.kind}:{a.module.rsplit('.', 1)[-1]}:{a.name}")
def test_contract_row_holds_in_the_wheel(row: contract.Assumption) -> None:
    assert contract.check_source(row, _read(row.module)) is None


@needs_src
def test_entry_point_group_and_wheel_version() -> None:
    dist = next(SRC.glob("vllm-*.dist-info"))
    assert dist.name == f"vllm-{contract.VLLM_VERSION}.dist-info"
    assert f"[{contract.PLUGIN_GROUP}]" in (dist / "entry_points.txt").read_text()


@needs_src
def test_the_checker_detects_drift() -> None:
    """A checker that cannot fail proves nothing: mutate real sources and expect each kind to complain."""
    av = _read(contract.AV)
    row = contract.lookup(contract.AV, "AdaptiveVerificationManager.reallocate_drafts", "method")
    assert contract.check_source(row, av.replace("self, req_ids: list[str], idx_mapping",
                                                 "self, request_ids: list[str], idx_mapping")) is not None
    runner = _read(contract.RUNNER)
    imported = contract.lookup(contract.RUNNER, "maybe_create_adaptive_verification_manager", "imported")
    moved = runner.replace("    maybe_create_adaptive_verification_manager,\n", "")
    assert contract.check_source(imported, moved) is not None
    kw = _call_row("ModelCudaGraphManager")
    assert contract.check_source(kw, runner.replace("varlen_decode=self.adaptive", "varlen=self.adaptive")) is not None
    field = contract.lookup(contract.SPEC_CONFIG, "SpeculativeConfig.enable_adaptive_verification", "field")
    spec = _read(contract.SPEC_CONFIG)
    assert contract.check_source(field, spec.replace("enable_adaptive_verification: bool", "adaptive: bool")) is not None
    const = contract.lookup(contract.PLUGINS, "DEFAULT_PLUGINS_GROUP", "constant")
    plugins = _read(contract.PLUGINS)
    assert contract.check_source(const, plugins.replace('"vllm.general_plugins"', '"vllm.plugins"')) is not None
    attrs = contract.lookup(contract.AV, "AdaptiveVerificationManager.__init__", "self_attr")
    assert contract.check_source(attrs, av.replace("self._stale_idx = 0", "self._stale = 0")) is not None
    metric = contract.lookup(contract.LOGGERS, "PrometheusStatLogger.__init__", "contains")
    loggers = _read(contract.LOGGERS)
    assert contract.check_source(metric, loggers.replace('"vllm:prefix_cache_hits"', '"vllm:prefix_hits"')) is not None


def test_ci_script_unpacks_every_contract_file() -> None:
    script = (ROOT / ".ci" / "vllm_wheel.sh").read_text()
    listed = set(re.findall(r"^\s+(vllm/\S+\.py)\s*$", script, flags=re.M))
    assert set(contract.source_files()) <= listed


def test_pyproject_declares_the_entry_point() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'[project.entry-points."{contract.PLUGIN_GROUP}"]' in text
    assert f'{contract.PLUGIN_NAME} = "{contract.PLUGIN_TARGET}"' in text


def test_every_patched_row_is_a_runtime_checkable_kind() -> None:
    kinds = {row.kind for row in contract.patched()}
    assert kinds <= {"function", "method", "imported", "contains"}
    # the factory we gate must be declared with the exact keywords the runner passes
    factory = contract.lookup(contract.AV, "maybe_create_adaptive_verification_manager", "function")
    call = _call_row("maybe_create_adaptive_verification_manager")
    assert factory.params == call.params


@needs_src
def test_vllms_own_dspark_fields_are_all_listed() -> None:
    """The launcher passes vLLM's own dspark_* SpeculativeConfig fields through and reads every other dspark_* key
    as ours: a field vLLM adds must be listed, or `dspark serve` would refuse it as a typo."""
    import ast

    tree = ast.parse(_read(contract.SPEC_CONFIG))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {f for f in fields if f.startswith("dspark_")} == set(contract.VLLM_DSPARK_FIELDS)


def _vllm_long_flags() -> set[str]:
    """vLLM 0.33's long serve flags as its sources spell them: the literal ones of ``EngineArgs.add_cli_args`` and
    the frontend's dataclass fields, with the ``--no-`` forms of boolean ones."""
    import ast

    flags = set(re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', _read("vllm.engine.arg_utils")))
    tree = ast.parse((SRC / "vllm/entrypoints/common/cli_args.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith("FrontendArgs"):
            flags |= {"--" + item.target.id.replace("_", "-") for item in node.body
                      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return flags | {"--no-" + f[2:] for f in flags}


@needs_src
def test_no_vllm_flag_is_refused_as_an_abbreviation() -> None:
    """The launcher refuses a strict prefix of a flag it reads (vLLM would take it for that flag): that refusal
    must never hit one of vLLM's own whole flags, and the vLLM flags it reads must be vLLM's."""
    from dspark_cli.engines.vllm.launcher import READ_FLAGS, VLLM_READ_FLAGS

    flags = _vllm_long_flags()
    assert {"--max-num-seqs", "--host", "--port", "--no-enforce-eager"} <= flags  # the reading works
    assert set(VLLM_READ_FLAGS) <= flags
    assert not [(f, r) for f in flags for r in READ_FLAGS if f != r and r.startswith(f)]
