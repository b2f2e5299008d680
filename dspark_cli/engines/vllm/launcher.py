"""``dspark serve --engine vllm``: turn the seed's command line into a ``vllm serve`` command line and exec it.

The user keeps writing the seed's flags. What changes on the way to vLLM 0.33:

* ``dspark_*`` keys inside ``--speculative-config`` (which vLLM would reject: ``extra="forbid"``) and the
  toolkit's own flags (``--sps-curve``, ``--capacity-mode``, ...) move into ``--additional-config``
  under ``"dspark"``, merged with anything the user already put there; vLLM's own ``dspark_*`` fields
  (``contract.VLLM_DSPARK_FIELDS``) stay in the speculative config;
* ``enable_adaptive_verification: true`` is set, so the runner creates a manager -- ours, via the plugin;
* every other argument is passed through untouched, in order.

The capacity mode is decided as ``dspark serve`` decides it: the mode given, else ``varlen`` when a setting
that only a capacity mode reads is given (a curve, a budget, a policy or threshold, a minimum gain), else
``none``. In mode ``none`` the plugin stays inert, so settings given for a mode are named in a warning,
and ``--record-traces`` is refused (under vLLM the dspark manager records them).

With no dspark setting at all the command is ``vllm serve`` with the arguments unchanged (the seed's
"no capacity" column). ``--dry-run`` prints the exact shell-quoted command instead of running it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from dspark_cli.engines.vllm.config import (
    DsparkVllmSettings,
    is_seed_key,
    resolve_paths,
    settings_from_seed_keys,
)
from dspark_cli.engines.vllm.contract import (
    ADAPTIVE_METHODS,
    ADDITIONAL_CONFIG_KEY,
    EXPLICIT_METHODS,
    NON_ADAPTIVE_METHODS,
    PLUGIN_GROUP,
    PLUGIN_NAME,
    VLLM_VERSION,
)
from dspark_cli.engines.vllm.models import VllmModels, describe, method_marker, vllm_models
from dspark_cli.errors import DsparkError
from dspark_cli.serve_config import (
    CAPACITY_FLAGS,
    DEFAULT_K,
    capacity_mode_none_warning,
    curve_k_warning,
    flag_value,
    speculative_keys,
)

SPEC_FLAGS = ("--speculative-config", "-sc")
# vLLM 0.33's shorthands, which its parser merges into the speculative config (EngineArgs.create_speculative_config):
# folded into the one the launcher writes, so that its checks see them and vLLM finds no key given twice.
SPEC_SHORTHANDS = {"--spec-method": "method", "--spec-model": "model", "--spec-tokens": "num_speculative_tokens"}
ADDITIONAL_FLAG = "--additional-config"

# The toolkit's own serve flags (same names as the embedded engine's) -> settings field and value type.
# "bool" flags take no value (--online-sts / --no-online-sts).
DSPARK_FLAGS: dict[str, tuple[str, str]] = {
    "--capacity-mode": ("mode", "str"),
    "--capacity-policy": ("policy", "str"),
    "--sps-curve": ("sps_curve", "str"),
    "--sps-overhead-ms": ("overhead_ms", "float"),
    "--budget-frac": ("budget_frac", "float"),
    "--confidence-threshold": ("threshold", "float"),
    "--min-predicted-gain": ("min_predicted_gain", "float"),
    "--saturation-patience": ("saturation_patience", "int"),
    "--resume-every": ("resume_every", "int"),
    "--sts": ("sts", "str"),
    "--online-sts": ("online_sts", "bool"),
    "--no-online-sts": ("online_sts", "nobool"),
    "--sts-refit-interval": ("sts_refit_interval", "int"),
    "--confidence-temperature": ("confidence_temperature", "float"),
    "--record-traces": ("record_traces", "str"),
}
# The settings fields whose presence picks varlen when no mode is given: serve_config.CAPACITY_FLAGS, by the
# field each of those flags sets here.
IMPLY_VARLEN = tuple(DSPARK_FLAGS["--" + name.replace("_", "-")][0] for name in CAPACITY_FLAGS)
# How a settings field is named in a warning: its flag, or the seed's key for the fields without one.
_FIELD_FLAGS = {field_name: flag for flag, (field_name, kind) in DSPARK_FLAGS.items() if kind != "nobool"}


@dataclass
class VllmServePlan:
    """The translated command line and what it carries (for tests and for the dry-run printout)."""

    argv: list[str]  # arguments after `vllm serve`
    settings: DsparkVllmSettings | None  # None: plain vLLM, the plugin stays inert
    speculative_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # settings that will not act, said before vLLM starts

    def command(self, executable: list[str] | None = None) -> list[str]:
        return [*(executable or ["vllm"]), "serve", *self.argv]


def _json_arg(flag: str, text: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise DsparkError(f"{flag}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise DsparkError(f"{flag}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _convert(flag: str, value: str, kind: str) -> Any:
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
    except ValueError:
        raise DsparkError(f"{flag}: expected {'an integer' if kind == 'int' else 'a number'}, got {value!r}") from None
    return value


def _long_flag(name: str) -> str:
    """A long flag as vLLM's parser spells it (``--speculative_config`` is ``--speculative-config``)."""
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _check_no_dotted_override(args: list[str]) -> None:
    """vLLM's parser (``vllm/utils/argparse_utils.py``, FlexibleArgumentParser.parse_args) gathers dotted flags such
    as ``--speculative-config.X V`` into a whole ``--speculative-config`` JSON appended after every other argument,
    where it replaces the object written here (the last one wins) -- even after ``--``."""
    for tok in args:
        head = tok.partition("=")[0]
        if not tok.startswith("-") or "." not in head:
            continue
        base = _long_flag(head.split(".", 1)[0])
        if base == ADDITIONAL_FLAG or base in SPEC_FLAGS:
            whole = ADDITIONAL_FLAG if base == ADDITIONAL_FLAG else SPEC_FLAGS[0]
            ours = " (or use dspark's own flags, such as --capacity-mode)" if whole == ADDITIONAL_FLAG else ""
            raise DsparkError(f"{head}: vLLM would turn this into a whole {whole} that replaces the one dspark "
                              f"writes; put the value inside the {whole} JSON instead{ours}")


def _check_no_abbreviation(args: list[str]) -> None:
    """vLLM's parser takes any unambiguous prefix of a long flag for the flag (argparse's ``allow_abbrev``, which
    ``FlexibleArgumentParser`` leaves on): ``--additional '{...}'`` is ``--additional-config`` to vLLM but not to the
    translation here, which then writes a second ``--additional-config`` and one of the two is silently lost, and
    ``--enforce`` passes the full-graph check unseen. A prefix of a flag read here is refused (no vLLM 0.33 flag
    is such a prefix: ``tests/test_vllm_contract.py``); arguments after ``--`` are vLLM's positionals, never flags."""
    for tok in args:
        if tok == "--":
            return
        if not tok.startswith("--"):
            continue
        head = _long_flag(tok.partition("=")[0].partition(".")[0])
        if head in READ_FLAGS:
            continue
        meant = [flag for flag in READ_FLAGS if flag.startswith(head)]
        if meant and all(flag in DSPARK_FLAGS for flag in meant):
            raise DsparkError(f"{head}: write the whole flag ({' or '.join(meant)}); dspark serve reads its own flags "
                              "only whole, and vLLM does not know them")
        if meant:
            raise DsparkError(f"{head}: vLLM reads it as an abbreviation of {' or '.join(meant)}, which dspark serve "
                              "reads too; write the whole flag")


def _before_separator(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` with ``flags`` added as flags: before a ``--``, after which vLLM's parser reads only positionals."""
    at = argv.index("--") if "--" in argv else len(argv)
    return [*argv[:at], *flags, *argv[at:]]


def _check_no_config_file(args: list[str]) -> None:
    """vLLM reads a ``--config`` YAML's arguments in right after the model (``FlexibleArgumentParser.
    _pull_args_from_config``), so every flag written here -- the host, port and served name, the whole
    speculative and additional configs -- overrides what it sets, and the checks here cannot see it (an
    `enforce-eager: true` in it passed the full-graph check; a `speculative-config` in it was replaced)."""
    for tok in args:
        if tok == "--config" or tok.startswith("--config="):
            raise DsparkError("--config FILE: vLLM reads a config file's arguments before every other, so the ones "
                              "dspark serve writes override them and its checks cannot see them; pass them as flags "
                              "(or run vllm serve yourself)")


def plan_vllm_serve(args: list[str], cwd: Path | None = None) -> VllmServePlan:
    """Split ``args`` into vLLM's arguments and our settings; see the module docstring."""
    _check_no_config_file(args)
    _check_no_abbreviation(args)
    _check_no_dotted_override(args)
    passthrough: list[str] = []
    spec_pos: int | None = None  # index in passthrough of the speculative-config value
    spec: dict[str, Any] | None = None
    additional: dict[str, Any] = {}
    flag_values: dict[str, Any] = {}
    shorthands: dict[str, tuple[str, Any]] = {}  # speculative config key -> (flag, value)
    i = 0
    while i < len(args):
        tok = args[i]
        name, eq, inline = tok.partition("=")
        if tok == "--":
            passthrough.extend(args[i:])
            break
        if _long_flag(name) in SPEC_SHORTHANDS:
            flag = _long_flag(name)
            if not eq and i + 1 >= len(args):
                raise DsparkError(f"{flag} needs a value")
            value = inline if eq else args[i + 1]
            key = SPEC_SHORTHANDS[flag]
            shorthands[key] = (flag, _convert(flag, value, "int") if key == "num_speculative_tokens" else value)
            i += 1 if eq else 2
            continue
        if name in DSPARK_FLAGS:
            field_name, kind = DSPARK_FLAGS[name]
            if kind in ("bool", "nobool"):
                if eq:
                    raise DsparkError(f"{name} takes no value")
                flag_values[field_name] = kind == "bool"
                i += 1
                continue
            if eq:
                value = inline
            elif i + 1 < len(args):
                value = args[i + 1]
                i += 1
            else:
                raise DsparkError(f"{name} needs a value")
            flag_values[field_name] = _convert(name, value, kind)
            i += 1
            continue
        if _long_flag(name) in SPEC_FLAGS or _long_flag(name) == ADDITIONAL_FLAG:
            name = _long_flag(name)
            if eq:
                value = inline
            elif i + 1 < len(args):
                value = args[i + 1]
                i += 1
            else:
                raise DsparkError(f"{name} needs a JSON value")
            if name == ADDITIONAL_FLAG:
                if additional:
                    raise DsparkError(f"{ADDITIONAL_FLAG} given twice; merge the objects into one")
                additional = _json_arg(name, value)
            else:
                if spec is not None:
                    raise DsparkError(f"{SPEC_FLAGS[0]} given twice; merge the objects into one")
                spec = speculative_keys(_json_arg(name, value))
                passthrough.append(name)
                spec_pos = len(passthrough)
                passthrough.append(value)
            i += 1
            continue
        passthrough.append(tok)
        i += 1

    if shorthands:
        if spec is None:
            spec = {}
            passthrough = _before_separator(passthrough, [SPEC_FLAGS[0], "{}"])
            spec_pos = passthrough.index(SPEC_FLAGS[0]) + 1
        for key, (flag, value) in shorthands.items():
            if key in spec:
                raise DsparkError(f"{flag} and the speculative config's {key!r} are both given: vLLM {VLLM_VERSION} "
                                  "refuses that; keep one")
            spec[key] = value
        passthrough[spec_pos] = orjson.dumps(spec).decode()
    if spec is not None:
        # Whatever else is asked: vLLM reads the method from the draft's path before any setting of ours acts.
        _check_method_detection({k: v for k, v in spec.items() if not is_seed_key(k)})
    user_dspark = additional.get(ADDITIONAL_CONFIG_KEY)
    if user_dspark is not None and not isinstance(user_dspark, dict):
        raise DsparkError(f"{ADDITIONAL_FLAG} {ADDITIONAL_CONFIG_KEY}: expected a JSON object")
    has_seed_keys = spec is not None and any(is_seed_key(k) for k in spec)
    if user_dspark is None and not has_seed_keys and not flag_values:
        # Nothing of ours: plain vLLM, arguments untouched.
        if spec is not None:
            _check_draft_named(spec, capacity=False)
        argv = list(passthrough)
        if additional:
            argv = _before_separator(argv, [ADDITIONAL_FLAG, orjson.dumps(additional).decode()])
        return VllmServePlan(argv=argv, settings=None, speculative_config=spec, additional_config=additional)

    fields_: dict[str, Any] = dict(user_dspark or {})
    if spec is not None:
        fields_ = settings_from_seed_keys(spec, fields_)
    if "threshold" in flag_values and "policy" not in flag_values:
        # --confidence-threshold alone picks the threshold policy (0 = the SPS-driven default), as in the JSON.
        flag_values["policy"] = "threshold" if flag_values["threshold"] > 0 else "argmax"
    if flag_values.get("mode") == "compact":
        flag_values["mode"] = "varlen"
    fields_.update(flag_values)
    if "mode" not in fields_:
        fields_["mode"] = "varlen" if any(name in fields_ for name in IMPLY_VARLEN) else "none"
    if "sps_curve" in fields_ and fields_["sps_curve"] == "auto":
        fields_["sps_curve"] = None
    settings = DsparkVllmSettings.from_dict(fields_, where="dspark settings")
    draft_len = None if spec is None else spec.get("num_speculative_tokens")
    draft_len = draft_len if isinstance(draft_len, int) and not isinstance(draft_len, bool) else None
    settings = resolve_paths(settings, cwd, num_positions=draft_len)
    default = DsparkVllmSettings()
    given = [name for name in fields_ if name != "mode" and getattr(settings, name) != getattr(default, name)]

    if spec is None:
        raise DsparkError("dspark settings need speculative decoding: pass --speculative-config "
                          "'{\"method\": ..., \"model\": ..., \"num_speculative_tokens\": ...}'")
    new_spec = {k: v for k, v in spec.items() if not is_seed_key(k)}
    _check_draft_named(new_spec, capacity=settings.active)
    new_additional = {k: v for k, v in additional.items() if k != ADDITIONAL_CONFIG_KEY}
    warnings: list[str] = []
    if settings.active:
        if not new_spec.get("num_speculative_tokens"):
            raise DsparkError(f"--capacity-mode {settings.mode} needs speculative decoding, and vLLM has no draft "
                              "length here: pass -k N (or num_speculative_tokens in --speculative-config) and a "
                              "draft (--draft PATH, a model with a draft of its own, or a method that needs none)")
        _check_adaptive_method(new_spec, settings.mode)
        _check_full_graphs(passthrough, settings.mode)
        mismatch = None if draft_len is None else curve_k_warning(_curve_k(settings.sps_curve), draft_len)
        warnings += [mismatch] if mismatch is not None else []
        new_spec["enable_adaptive_verification"] = True
        new_additional[ADDITIONAL_CONFIG_KEY] = settings.to_dict()
    elif settings.record_traces is not None:
        raise DsparkError("--record-traces needs a capacity mode (mask or varlen) under vLLM: the traces are "
                          "recorded by the dspark manager")
    elif given:
        warnings.append(capacity_mode_none_warning(
            [_FIELD_FLAGS.get(name, f"dspark_{name}") for name in given]))
    assert spec_pos is not None
    passthrough[spec_pos] = orjson.dumps(new_spec).decode()
    argv = list(passthrough)
    if new_additional:
        argv = _before_separator(argv, [ADDITIONAL_FLAG, orjson.dumps(new_additional).decode()])
    return VllmServePlan(argv=argv, settings=settings if settings.active else None,
                         speculative_config=new_spec, additional_config=new_additional, warnings=warnings)


def _curve_k(curve: str | list[Any] | dict[str, Any] | None) -> Any:
    """The draft length a curve was profiled at (its ``meta.k``), if it says."""
    from dspark_cli.core.sps import SpsCurve

    if isinstance(curve, str):
        return SpsCurve.load(curve).meta.get("k")
    if isinstance(curve, dict):
        return SpsCurve.from_dict(curve, source="dspark_sps_curve").meta.get("k")
    return None  # an inline seed list carries no metadata; None: vLLM's start-up profile, at the served K


def _method(spec: dict[str, Any]) -> Any:
    """The speculative method vLLM will run for ``spec`` where it names one (a model "ngram" implies it)."""
    method = spec.get("method")
    if method is None and spec.get("model") in ("ngram", "[ngram]"):
        return "ngram"
    return "ngram" if method == "[ngram]" else method


def _check_adaptive_method(spec: dict[str, Any], mode: str) -> None:
    """A capacity mode acts through vLLM's adaptive verification, which some speculators lack
    (``contract.NON_ADAPTIVE_METHODS``): there it would silently verify every draft."""
    method = _method(spec)
    if method in NON_ADAPTIVE_METHODS:
        raise DsparkError(f"--capacity-mode {mode} with speculative method {method!r}: vLLM {VLLM_VERSION} has no "
                          f"adaptive verification for it, so nothing would be trimmed; use one of "
                          f"{', '.join(ADAPTIVE_METHODS)}, or --capacity-mode none")


# vLLM 0.33's cudagraph_mode by optimization level (OPTIMIZATION_LEVEL_0N in vllm/config/vllm.py) where the
# compilation config does not set one: -O0 captures no graphs, -O1 piecewise graphs only.
_LEVEL_GRAPHS = {"0": "NONE", "1": "PIECEWISE"}
COMPILATION_FLAGS = ("--compilation-config", "-cc")
# vLLM's long flags that this translation reads (the checks below, the JSON objects it rewrites), and the
# toolkit's own: _check_no_abbreviation.
VLLM_READ_FLAGS = (SPEC_FLAGS[0], ADDITIONAL_FLAG, *SPEC_SHORTHANDS, COMPILATION_FLAGS[0], "--enforce-eager",
                   "--no-enforce-eager", "--enable-lora", "--no-enable-lora", "--optimization-level",
                   "--pipeline-parallel-size", "--load-format")
READ_FLAGS = (*VLLM_READ_FLAGS, *DSPARK_FLAGS)
_FULL_GRAPH_MODES = "FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE"


def _graph_name(value: Any) -> str | None:
    """A cudagraph_mode as vLLM 0.33 would read it (a name, any case, or CUDAGraphMode's value); None: unset."""
    if isinstance(value, str):
        return value.upper()
    if isinstance(value, int) and not isinstance(value, bool):
        return {0: "NONE", 1: "PIECEWISE"}.get(value, "FULL")
    return None


@dataclass(frozen=True)
class _GraphFlags:
    """What vLLM's parser makes of the flags that decide its CUDA graphs, each the last one given."""

    eager: bool
    lora: bool
    level: str | None  # the optimization level
    graphs: str | None  # the compilation config's cudagraph_mode, upper case
    stages: str | None  # the pipeline-parallel size

    @property
    def pipelined(self) -> str | None:
        """The pipeline-parallel size where it is above 1."""
        size = None if self.stages is None else self.stages.strip()
        return size if size not in (None, "", "1") else None

    @property
    def low_level(self) -> str | None:
        """``0`` or ``1``: an optimization level whose default cudagraph_mode has no full graphs, where the
        compilation config does not set one."""
        level = None if self.level is None else self.level.strip()
        return level if self.graphs is None and level in _LEVEL_GRAPHS else None

    @property
    def without_full_graphs(self) -> str | None:
        """The flag that leaves vLLM without full CUDA graphs, as the user spelled it (None: they are there)."""
        if self.eager:
            return "--enforce-eager"
        if self.graphs in ("NONE", "PIECEWISE"):
            return f"cudagraph_mode {self.graphs}"
        return None if self.low_level is None else f"-O{self.low_level}"


def compilation_key(arg: str) -> str | None:
    """For a compilation-config flag (``-cc``, ``--compilation-config``, ``--compilation_config``), ``""`` if it is
    the whole JSON, else its dotted key (``-cc.cudagraph_mode=FULL``: ``cudagraph_mode``); None for any other."""
    base, _, key = arg.partition("=")[0].partition(".")
    return key if _long_flag(base) in COMPILATION_FLAGS else None


def _graph_flags(passthrough: list[str]) -> _GraphFlags:
    """What vLLM's parser would make of ``passthrough`` for the checks below, each flag the last one given, as vLLM
    reads them: ``-O1``, ``-O=1``, ``-O 1`` and ``--optimization-level 1`` alike. A whole ``-cc`` JSON replaces the
    one before it, and dotted ``-cc.X`` flags are gathered into one more JSON that vLLM appends after all of them
    (``FlexibleArgumentParser.parse_args``), so where any is given, the whole JSONs count for nothing."""
    eager = lora = False
    level: str | None = None
    stages: str | None = None
    whole: str | None = None
    dotted: dict[str, Any] = {}
    toks = [t for t in passthrough if t != "--"]
    for i, tok in enumerate(toks):
        name, eq, inline = tok.partition("=")
        value = inline if eq else (toks[i + 1] if i + 1 < len(toks) else None)
        # vLLM's parser turns underscores into dashes up to the first dot only
        raw_head, dot, key = name.partition(".")
        head = _long_flag(raw_head)
        long = head if not dot else f"{head}.{key}"
        if long in ("--enforce-eager", "--no-enforce-eager"):
            eager = long == "--enforce-eager"
        elif long in ("--enable-lora", "--no-enable-lora"):
            lora = long == "--enable-lora"
        elif long == "--optimization-level":
            level = value
        elif long in ("--pipeline-parallel-size", "-pp"):
            stages = value
        elif tok.startswith("-O") and not tok.startswith("--"):
            level = tok[3:] if tok[2:3] == "=" else (tok[2:] or value)
        elif head in COMPILATION_FLAGS and value is not None:
            try:
                parsed: Any = orjson.loads(value)
            except orjson.JSONDecodeError:
                parsed = value  # a dotted value may be a bare word; a bad whole JSON is vLLM's to report
            if dot:
                dotted[key] = parsed
            elif isinstance(parsed, dict):
                whole = _graph_name(parsed.get("cudagraph_mode"))
    graphs = _graph_name(dotted.get("cudagraph_mode")) if dotted else whole
    return _GraphFlags(eager, lora, level, graphs, stages)


def _check_full_graphs(passthrough: list[str], mode: str) -> None:
    """vLLM 0.33 refuses adaptive verification, through which a capacity mode acts, without full CUDA graphs or
    with LoRA or pipeline parallelism (``VllmConfig._validate_adaptive_verification``): said here in one line,
    before any weights load, where vLLM would stop with a traceback about a setting the user never named."""
    flags = _graph_flags(passthrough)
    if flags.pipelined:
        raise DsparkError(f"--pipeline-parallel-size {flags.pipelined}: vLLM {VLLM_VERSION}'s adaptive verification, "
                          f"through which --capacity-mode {mode} acts, does not work with pipeline parallelism; "
                          "use --tensor-parallel-size instead, or serve with --capacity-mode none")
    if flags.eager:
        raise DsparkError(f"--enforce-eager: vLLM {VLLM_VERSION} runs --capacity-mode {mode} only with full CUDA "
                          "graphs; drop --enforce-eager, or serve with --capacity-mode none")
    if flags.lora:
        raise DsparkError(f"--enable-lora: vLLM {VLLM_VERSION}'s adaptive verification, through which --capacity-mode "
                          f"{mode} acts, does not work with LoRA; serve without --enable-lora, or with "
                          "--capacity-mode none")
    if flags.low_level is not None:
        raise DsparkError(f"-O{flags.low_level}: vLLM {VLLM_VERSION} then captures "
                          f"{'no' if flags.low_level == '0' else 'only piecewise'} CUDA graphs, and runs --capacity-mode "
                          f"{mode} only with full ones; use -O2 or -O3, set cudagraph_mode to {_FULL_GRAPH_MODES} in "
                          "--compilation-config, or serve with --capacity-mode none")
    if flags.without_full_graphs is not None:
        raise DsparkError(f"{flags.without_full_graphs}: vLLM {VLLM_VERSION} runs --capacity-mode {mode} only with "
                          f"full CUDA graphs; set it to {_FULL_GRAPH_MODES} in --compilation-config, or serve "
                          "with --capacity-mode none")


def check_profile_graphs(argv: list[str]) -> None:
    """``profile-sps --engine vllm`` times the FULL CUDA graphs a server replays, and vLLM times a step on the
    last pipeline stage only: without such graphs nothing is timed, and the profile failed only after the model
    loaded, with an empty curve."""
    flags = _graph_flags(argv)
    if flags.without_full_graphs is not None:
        raise DsparkError(f"{flags.without_full_graphs}: profile-sps --engine vllm times the FULL CUDA graphs a "
                          "server replays, and this captures none; profile with the graphs the server will run")
    if flags.pipelined:
        raise DsparkError(f"--pipeline-parallel-size {flags.pipelined}: vLLM {VLLM_VERSION} times a step on the last "
                          "pipeline stage only, so the profile would come back empty; profile one stage")


def _check_draft_named(spec: dict[str, Any], *, capacity: bool) -> None:
    """A draft count with neither a draft nor a method that needs none: vLLM 0.33 takes the method for
    ``draft_model`` and stops with "num_speculative_tokens was provided but without speculative model".
    ``capacity``: a capacity mode is on, which the n-gram and suffix methods cannot serve."""
    if spec.get("num_speculative_tokens") and spec.get("model") is None and spec.get("method") in (None, "draft_model"):
        # mtp and dspark draft with weights in the target's checkpoint.
        methods = "mtp, dspark" if capacity else "ngram, suffix, mtp, dspark"
        raise DsparkError("--engine vllm drafts with a draft model: pass --draft PATH (a checkpoint sharing the "
                          "target's tokenizer; --draft auto has a default for smollm2-135m, tiny and random:<shape> "
                          f"only), or name a method that needs none in --speculative-config ({methods})")


def _check_method_detection(spec: dict[str, Any]) -> None:
    """Refuse a draft path that would silently change the speculative method vLLM runs
    (``contract.METHOD_PATH_MARKERS``)."""
    method, model = spec.get("method"), spec.get("model")
    if method in EXPLICIT_METHODS or not isinstance(model, str):
        return
    marker = method_marker(model)
    if marker is not None:
        raise DsparkError(
            f"--speculative-config: vLLM {VLLM_VERSION} picks the speculative method from the draft's path, "
            f"and {model!r} contains {marker!r}, so method {method!r} would not run as asked; move or link the "
            f"draft to a path without {marker!r}")


def build_vllm_serve_command(argv: list[str]) -> list[str]:
    """The exact ``vllm serve ...`` command line for ``dspark serve --engine vllm ARGV`` (dry run, tests)."""
    return plan_vllm_serve(list(argv)).command()


def _vllm_executable() -> list[str]:
    exe = shutil.which("vllm")
    if exe is not None:
        return [exe]
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    raise DsparkError("vLLM is not installed here: pip install 'dspark-cli[vllm]' (vllm==0.33.0, CUDA), "
                      "or use the embedded engine (drop --engine vllm)")


def check_plugin_visible() -> None:
    """The plugin only acts if vLLM discovers our entry point and VLLM_PLUGINS does not filter it out. vLLM 0.33
    splits VLLM_PLUGINS on commas and strips nothing (``envs.py``): `"foo, dspark"` names " dspark", which is no
    plugin, and vLLM's own manager would then run under our settings' name."""
    names = {ep.name for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)}
    if PLUGIN_NAME not in names:
        raise DsparkError(f"the dspark vLLM plugin is not registered ({PLUGIN_GROUP} entry point {PLUGIN_NAME!r} "
                          "missing): reinstall the toolkit with pip install -e .")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        raise DsparkError(f"VLLM_PLUGINS={allowed!r} filters out the dspark plugin; add {PLUGIN_NAME!r} to it "
                          "or unset it")


def argv_from_serve_settings(settings: Any, extra: list[str], models: VllmModels) -> list[str]:
    """Raw ``vllm serve`` arguments from ``serve_config.ServeSettings`` (flags the CLI already parsed) + extras.

    Lets the CLI hand over either the raw argv or its parsed settings; both go through one translation.
    ``models``: what the settings' model and draft resolved to (``engines.vllm.models``: the toolkit's names
    become vLLM-ready copies, served under the name as given).
    """
    spec: dict[str, Any] = dict(getattr(settings, "vllm_speculative_config", {}) or {})
    if models.draft is not None:
        spec["model"] = models.draft
    if settings.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = settings.num_speculative_tokens
    if settings.method is not None:
        spec["method"] = settings.method
    if settings.capacity_mode != "none":
        spec.update(settings.dspark_keys())
    elif settings.record_traces is not None:
        # Handed on with mode none, so that the command-line path's refusal (the plugin stays inert in mode none,
        # and records no traces) is this path's too; the CLI warns about the other settings mode none ignores.
        spec.update(dspark_capacity_verification_mode="none", dspark_record_traces=settings.record_traces)
    if settings.num_speculative_tokens == 0:
        # No speculation (the bench's nospec column): vLLM takes no speculative config for it, and refuses one
        # of 0 tokens (SpeculativeConfig.num_speculative_tokens > 0).
        spec = {}
    argv = [models.model, "--host", str(settings.host), "--port", str(settings.port)]
    served = settings.served_model_name or models.served_name
    for flag, value in (("--max-num-seqs", settings.max_num_seqs), ("--max-model-len", settings.max_model_len),
                        ("--seed", settings.seed), ("--served-model-name", served)):
        if value is not None:
            argv += [flag, str(value)]
    if models.load_format is not None and flag_value(extra, "--load-format") is None:
        argv += ["--load-format", models.load_format]
    if spec:
        argv += [SPEC_FLAGS[0], orjson.dumps(spec).decode()]
    return argv + list(extra)


def run_vllm_serve(args: Any, extra: list[str] | None = None, *, dry_run: bool = False) -> int:
    """``dspark serve --engine vllm``: print the command (``dry_run``) or replace this process with it.

    ``args`` is the raw argv after ``serve`` (minus ``--engine vllm``), or the CLI's parsed ``ServeSettings``
    with the unparsed ``extra`` arguments.
    """
    # Before any model is converted or copied: a machine without vLLM is told so first.
    executable = None if dry_run else _vllm_executable()
    if not isinstance(args, (list, tuple)):
        spec_json = getattr(args, "vllm_speculative_config", None) or {}
        given = [k for k in (args.num_speculative_tokens, spec_json.get("num_speculative_tokens"),
                             flag_value([_long_flag(a) for a in extra or []], "--spec-tokens")) if k is not None]
        # No draft length given: the documented default (DEFAULT_K) wherever a draft is there to draft with (the
        # model's own, --draft, or the JSON's model); else plain vLLM. Without it, a capacity mode was handed to
        # vLLM with no draft at all, and --capacity-mode none (the bench's column) served no speculation.
        speculative = given[0] not in (0, "0") if given else args.draft is not None
        models = vllm_models(args.model, args.draft, speculative=speculative, build=not dry_run)
        if not given and (models.draft is not None or spec_json.get("model") is not None):
            args = dataclasses.replace(args, num_speculative_tokens=DEFAULT_K)
        if models.served_name is not None:
            sys.stderr.write(f"dspark: {describe(models)}\n")
        args = argv_from_serve_settings(args, extra or [], models)
    elif extra:
        args = [*args, *extra]
    plan = plan_vllm_serve(list(args))
    for warning in plan.warnings:
        sys.stderr.write(f"warning: {warning}\n")
    if dry_run:
        sys.stdout.write(shlex.join(plan.command()) + "\n")
        sys.stdout.flush()
        return 0
    if plan.settings is not None:
        check_plugin_visible()
    cmd = plan.command(executable)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)
    return 0  # not reached: execvp replaces the process
