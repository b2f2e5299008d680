"""``dspark profile-sps``: flags -> the engine that will serve -> a validated ``sps_curve.json``.

Both engines take the seed's shapes of configuration: ``--speculative-config`` JSON (the draft ``model`` and
``num_speculative_tokens``; ``dspark_*`` keys are about serving and do not change step cost) and
``--engine-args`` JSON (vLLM ``EngineArgs`` names). The embedded engine maps the engine args it has an
equivalent for and refuses the rest (a ``tensor_parallel_size`` it cannot honour would profile a different
engine than the one that serves). With ``--engine vllm`` the engine args become ``vllm serve`` flags and
the profile runs in vLLM's workers (``engines/vllm/profile.py``); afterwards both paths share the same
finish: optional overhead override, validation (flat curves are refused, nothing is written), atomic save.

Explicit flags win over the JSON objects.
"""

from __future__ import annotations

import importlib.util
import math
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from dspark_cli.core.sps import SpsCurve
from dspark_cli.errors import DsparkError

__all__ = ["ProfileRequest", "parse_capture_sizes", "parse_overhead", "run_embedded", "run_vllm", "vllm_argv"]

ENGINES = ("embedded", "vllm")
# --engine-args keys (vLLM EngineArgs names) -> EngineConfig fields of the embedded engine.
_EMBEDDED_ENGINE_ARGS = {
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
    "block_size": "block_size",
    "num_gpu_blocks_override": "num_kv_blocks",
    "num_kv_blocks": "num_kv_blocks",
    "dtype": "dtype",
    "device": "device",
    "seed": "seed",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_capture_size": "max_capture_size",
    "attention_backend": "attention_backend",
}
# The type each of those keys takes (the rest are integers): a value of another type was handed on and failed
# deep in the engine's checks with a traceback ("abc" < 1), or, for a flag, meant its opposite (bool("false")).
_EMBEDDED_ARG_TYPES = {"dtype": "str", "device": "str", "attention_backend": "str", "gpu_memory_utilization": "float"}


def _engine_arg(where: str, key: str, value: Any) -> Any:
    """``value`` checked as ``dspark serve`` checks its own flags (serve_config's helpers)."""
    from dspark_cli.serve_config import as_float, as_int, as_str

    check = {"int": as_int, "float": as_float, "str": as_str}[_EMBEDDED_ARG_TYPES.get(key, "int")]
    return check(where, value)


# Keys that only name things the embedded engine already does its own way (tokenizer files live with the
# checkpoint), so accepting them changes nothing about the profile.
_EMBEDDED_IGNORED_ARGS = ("tokenizer", "trust_remote_code", "tokenizer_mode", "model")


@dataclass
class ProfileRequest:
    """Everything ``dspark profile-sps`` was asked, after parsing (``None`` = not given on the command line)."""

    model: str
    engine: str = "embedded"
    draft: str | None = None
    num_speculative_tokens: int | None = None
    capture_sizes: tuple[int, ...] | None = None
    overhead_ms: float | None = None  # None = measure
    speculative_config: str | None = None
    engine_args: str | None = None
    output: Path = Path("sps_curve.json")
    device: str | None = None
    dtype: str | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    context_len: int = 128
    warmup: int | None = None
    replays: int | None = None
    extra: list[str] = field(default_factory=list)  # unknown options: vllm serve flags (vllm engine only)


def parse_capture_sizes(text: str | None) -> tuple[int, ...] | None:
    """``"1,2,4,8"`` -> (1, 2, 4, 8); refuses anything but two or more distinct positive integers."""
    if text is None:
        return None
    parts = [p.strip() for p in text.replace(" ", ",").split(",") if p.strip()]
    try:
        sizes = sorted({int(p) for p in parts})
    except ValueError:
        raise DsparkError(f"--capture-sizes: expected comma-separated token counts like 1,2,4,8, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise DsparkError(f"--capture-sizes: token counts must be positive integers, got {text!r}")
    if len(sizes) < 2:
        raise DsparkError(f"--capture-sizes: give at least two sizes (one point cannot show a cost rising), got {text!r}")
    return tuple(sizes)


def parse_overhead(text: str | None) -> float | None:
    """``auto`` (or nothing) -> None (measure it); else a finite number of ms >= 0."""
    if text is None or text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise DsparkError(f"--overhead-ms: expected auto or a number of milliseconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise DsparkError(f"--overhead-ms: expected a finite number >= 0, got {text!r}")
    return value


def _json_object(flag: str, text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise DsparkError(f"{flag}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise DsparkError(f"{flag}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _check_common(req: ProfileRequest) -> None:
    if req.engine not in ENGINES:
        raise DsparkError(f"--engine: expected embedded or vllm, got {req.engine!r}")
    if req.num_speculative_tokens is not None and req.num_speculative_tokens < 1:
        raise DsparkError(f"-k/--num-speculative-tokens: profiling needs K >= 1, got {req.num_speculative_tokens}")
    if req.warmup is not None and req.warmup < 0:
        raise DsparkError(f"--warmup: expected >= 0, got {req.warmup}")
    if req.replays is not None and req.replays < 1:
        raise DsparkError(f"--replays: expected >= 1, got {req.replays}")
    if req.context_len < 2:
        raise DsparkError(f"--context-len: expected >= 2, got {req.context_len}")
    if req.output.exists() and req.output.is_dir():
        raise DsparkError(f"--output {req.output} is a folder; name the file to write")


# ---------------------------------------------------------------------------------------------- embedded


def embedded_config(req: ProfileRequest) -> Any:
    """The ``EngineConfig`` of the engine that will serve, from flags > JSON objects > defaults."""
    from dspark_cli.engines.embedded.config import EngineConfig

    _check_common(req)
    if req.extra:
        raise DsparkError(f"unknown option(s) for the embedded engine: {' '.join(req.extra)} "
                          "(only --engine vllm passes vllm flags through); see dspark profile-sps --help")
    spec = _json_object("--speculative-config", req.speculative_config)
    if req.speculative_config is not None:
        from dspark_cli.serve_config import build_settings

        # Its dspark_* keys are serving settings that do not change step cost, but a typo or a bad value is
        # refused here as `dspark serve` would refuse it, not carried into a curve's provenance unnoticed.
        build_settings({}, req.speculative_config)
    from dspark_cli.serve_config import as_bool, as_int

    args = _json_object("--engine-args", req.engine_args)
    kwargs: dict[str, Any] = {"model": req.model}
    unknown = []
    for key, value in args.items():
        where = f"--engine-args {key}"
        if key in _EMBEDDED_ENGINE_ARGS:
            if value is not None:  # null: the engine's default, as leaving the key out
                kwargs[_EMBEDDED_ENGINE_ARGS[key]] = _engine_arg(where, key, value)
        elif key == "enforce_eager":
            kwargs["cuda_graphs"] = not as_bool(where, value)
        elif key == "compilation_config" and isinstance(value, dict):
            if value.get("max_cudagraph_capture_size") is not None:
                kwargs["max_capture_size"] = as_int(f"{where}.max_cudagraph_capture_size",
                                                     value["max_cudagraph_capture_size"], minimum=1)
            sizes = value.get("cudagraph_capture_sizes")
            if sizes is not None:
                if not isinstance(sizes, list):
                    raise DsparkError(f"{where}.cudagraph_capture_sizes: expected a list of integers, got {sizes!r}")
                kwargs["capture_sizes"] = tuple(as_int(f"{where}.cudagraph_capture_sizes", v, minimum=1)
                                                for v in sizes)
        elif key not in _EMBEDDED_IGNORED_ARGS:
            unknown.append(key)
    if unknown:
        raise DsparkError(f"--engine-args: the embedded engine has no equivalent for {', '.join(sorted(unknown))}; "
                          "profile vLLM with --engine vllm, or drop them")
    draft = req.draft if req.draft is not None else spec.get("model", "auto")
    k = req.num_speculative_tokens if req.num_speculative_tokens is not None else spec.get("num_speculative_tokens", 4)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise DsparkError(f"num_speculative_tokens: profiling needs an integer K >= 1, got {k!r}")
    if draft is None or str(draft).strip().lower() == "none":
        raise DsparkError("profiling the step cost needs a draft model: pass --draft (a checkpoint, auto, or random:small)")
    kwargs.update(draft=str(draft), num_speculative_tokens=k)
    for name in ("device", "dtype", "max_num_seqs", "max_model_len"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    if req.capture_sizes is not None:
        kwargs["capture_sizes"] = req.capture_sizes
    try:
        cfg = EngineConfig(**kwargs)
    except TypeError as exc:
        raise DsparkError(f"--engine-args: {exc}") from None
    cfg.validate()
    return cfg


def run_embedded(req: ProfileRequest, progress: Callable[[str], None] | None = None) -> SpsCurve:
    """Profile the embedded engine, validate, save atomically; returns the saved curve."""
    from dspark_cli.engines.embedded.profile import curve_from_measurements, profile_config

    cfg = embedded_config(req)
    m = profile_config(cfg, context_len=req.context_len, token_sizes=req.capture_sizes,
                       warmup=3 if req.warmup is None else req.warmup, iters=7 if req.replays is None else req.replays,
                       progress=progress, measure_overhead=req.overhead_ms is None)
    if sys.argv[1:2] == ["profile-sps"]:  # provenance, when run from the command line
        m.meta["command"] = shlex.join(["dspark", *sys.argv[1:]])
    if req.capture_sizes is not None:
        m.meta["capture_sizes_requested"] = list(req.capture_sizes)
    curve = curve_from_measurements(m, req.overhead_ms)  # SpsCurveError: nothing is written
    curve.save(req.output)
    return curve


# ---------------------------------------------------------------------------------------------- vLLM


def _engine_args_flags(args: dict[str, Any]) -> list[str]:
    """vLLM ``EngineArgs`` JSON -> ``vllm serve`` flags (bools as --flag / --no-flag, objects as JSON)."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            out += [flag, orjson.dumps(value).decode()]
        elif isinstance(value, list):
            out += [flag, *(str(v) for v in value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


CAPTURE_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def _capture_sizes_flags(sizes: tuple[int, ...], extra: list[str], args: dict[str, Any]) -> list[str]:
    """``--capture-sizes`` as vLLM will read it beside the user's own compilation flags: inside the
    ``--engine-args`` compilation config, or -- where dotted ``-cc.X`` flags are given, which vLLM gathers into one
    whole JSON appended after every other argument (``FlexibleArgumentParser.parse_args``) and so in place of any
    whole one -- as one more dotted flag, merged into theirs (a whole JSON of ours was dropped without a word). A
    whole ``--compilation-config`` of the user's, or dotted capture sizes, already say what to capture: refused as
    a conflict. An optimization level (``-O3``) sets no capture sizes and stays as given."""
    from dspark_cli.engines.vllm.launcher import compilation_key

    keys = [k for k in map(compilation_key, extra) if k is not None]
    if "" in keys or any(k.partition(".")[0].replace("-", "_") in CAPTURE_KEYS for k in keys):
        raise DsparkError("--capture-sizes conflicts with --compilation-config; put cudagraph_capture_sizes "
                          "inside the compilation config instead")
    if keys:
        if args.get("compilation_config"):
            raise DsparkError("--engine-args compilation_config and dotted -cc.X flags: vLLM keeps only the dotted "
                              "ones; give the compilation config one way")
        return [f"-cc.cudagraph_capture_sizes={orjson.dumps(list(sizes)).decode()}"]
    comp = dict(args.get("compilation_config") or {})
    comp["cudagraph_capture_sizes"] = list(sizes)
    args["compilation_config"] = comp
    return []


def vllm_argv(req: ProfileRequest, *, build: bool = True) -> list[str]:
    """Arguments for ``engines.vllm.profile.build_profile_command``: MODEL, vllm serve flags, profile flags.
    ``build=False`` (a dry run) names the vLLM-ready copies of the toolkit's models without making them."""
    from dspark_cli.engines.vllm.models import vllm_models
    from dspark_cli.serve_config import flag_value

    _check_common(req)
    if req.device is not None:
        raise DsparkError("--device is for the embedded engine; vLLM picks its devices itself")
    if req.model.startswith("-"):
        raise DsparkError("profile-sps --engine vllm needs the model first: dspark profile-sps --engine vllm MODEL ...")
    args = _json_object("--engine-args", req.engine_args)
    extra = [a for a in req.extra if a != "--"]
    if req.capture_sizes is not None:
        extra += _capture_sizes_flags(req.capture_sizes, extra, args)
    spec = _json_object("--speculative-config", req.speculative_config)
    # The toolkit's model names become vLLM-ready copies, as for `dspark serve --engine vllm` (engines.vllm.models).
    k = req.num_speculative_tokens if req.num_speculative_tokens is not None else spec.get("num_speculative_tokens")
    draft = req.draft if req.draft is not None else spec.get("model", "auto")
    if not k:
        # vLLM times a step only where a speculator drafts: without one the profile came back empty
        raise DsparkError("profile-sps --engine vllm prices the draft pass too: pass -k K (>= 1) and a draft "
                          "(--draft, or a --speculative-config with num_speculative_tokens)")
    models = vllm_models(req.model, draft, speculative=bool(k), build=build)
    argv = [models.model, *extra, *_engine_args_flags(args)]
    if models.load_format is not None and "load_format" not in args and flag_value(extra, "--load-format") is None:
        argv += ["--load-format", models.load_format]
    for flag, value in (("--max-num-seqs", req.max_num_seqs), ("--max-model-len", req.max_model_len),
                        ("--dtype", req.dtype)):
        if value is not None:
            argv += [flag, str(value)]
    if models.draft is not None:
        spec["model"] = models.draft
    if req.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = req.num_speculative_tokens
    if spec:
        argv += ["--speculative-config", orjson.dumps(spec).decode()]
    argv += ["--output", str(req.output)]
    if req.warmup is not None:
        argv += ["--warmup", str(req.warmup)]
    if req.replays is not None:
        argv += ["--replays", str(req.replays)]
    return argv


def run_vllm(req: ProfileRequest, *, dry_run: bool) -> SpsCurve | None:
    """Dry run: print the exact profiler command (None). Else run it, then apply ``--overhead-ms`` to the
    curve it wrote and return the curve (the profiler itself already refused a flat one)."""
    from dspark_cli.engines.vllm.profile import check_profile_plugin, profile_plan, run_vllm_profile

    argv = vllm_argv(req, build=not dry_run)
    if dry_run:
        run_vllm_profile(argv, dry_run=True)
        return None
    cmd, warnings = profile_plan(argv)
    for warning in warnings:  # as the dry run and dspark serve --engine vllm say them, before vLLM starts
        sys.stderr.write(f"warning: {warning}\n")
    if importlib.util.find_spec("vllm") is None:
        raise DsparkError("vLLM is not installed here: pip install 'dspark-cli[vllm]' (vllm==0.33.0, CUDA), or "
                          "profile the embedded engine (drop --engine vllm)")
    check_profile_plugin(argv)
    sys.stdout.flush()
    rc = subprocess.call(cmd)
    if rc != 0:
        raise DsparkError(f"the vLLM profiler exited with status {rc} (its output is above); nothing was written")
    curve = SpsCurve.load(req.output)
    if req.overhead_ms is not None:
        meta = {**curve.meta, "overhead_source": "given", "overhead_measured_ms": curve.overhead_ms}
        curve = curve.with_overhead(req.overhead_ms, meta)
        curve.save(req.output)
    return curve
