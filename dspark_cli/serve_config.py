"""`dspark serve` settings: command-line flags and the seed's ``--speculative-config`` JSON, merged once.

The seed (a vLLM prototype) configured DSpark through ``dspark_*`` keys inside ``--speculative-config``.
vLLM 0.33's ``SpeculativeConfig`` forbids unknown keys, and the embedded engine has no such object at all,
so this module is the single place that reads those keys and maps them onto the toolkit's settings; both
engines (embedded, and the vLLM launcher that moves them into ``--additional-config``) consume the
resulting :class:`ServeSettings`. It is pure (no torch, no engine imports at module load) so that the
translation is unit-testable and a typo in the JSON fails in milliseconds, before any model loads.

Precedence: an explicit command-line flag wins over the JSON, which wins over the defaults. A flag is
"explicit" when its value is not ``None`` -- the CLI declares every flag with a ``None`` default for that.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from dspark_cli.engines.vllm.contract import VLLM_DSPARK_FIELDS
from dspark_cli.errors import DsparkError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
ENGINES = ("embedded", "vllm")
CAPACITY_MODES = ("none", "mask", "varlen")
POLICIES = ("argmax", "paper", "threshold")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")  # embedded engine (attention.BACKENDS)
PHASE_TIMINGS = ("host", "gpu", "device")  # embedded engine (EngineConfig.phase_timing)


def default_engine_process(settings: Any) -> bool:
    """The embedded engine's front when ``--engine-process`` is not given: a process of its own on CUDA, a
    thread of the server on a CPU.

    On a GPU a served step is host-bound: on an H200 (SmolLM2-135M, docs/PERFORMANCE.md section 23) the
    engine in its own process served 21-38% more tokens per second than on a thread at 16-256 requests,
    because the HTTP loop's per-token work no longer holds the engine's interpreter lock. On a CPU the forward
    itself takes the cores, and an engine process competes with the server and its clients for them (a
    2-core machine served about even, or slower).
    """
    if settings.engine_process is not None:
        return bool(settings.engine_process)
    from dspark_cli.engines.embedded.config import resolve_device

    return resolve_device(settings.device).type == "cuda"

# Every dspark_* key the seed's prototype (and this toolkit) understands. Anything else that starts with
# "dspark_" is almost certainly a typo, and silently ignoring it would run a different experiment than the
# one the user asked for -- so it is an error.
DSPARK_KEYS = (
    "dspark_capacity_verification_mode",
    "dspark_sps_curve",
    "dspark_sps_overhead_ms",
    "dspark_budget_frac",
    "dspark_confidence_threshold",
    "dspark_confidence_temperature",
    "dspark_online_sts",
    "dspark_min_predicted_gain",
    "dspark_sts",
    "dspark_record_traces",
    "dspark_policy",
    "dspark_saturation_patience",
    "dspark_resume_every",
    "dspark_probe_tax",
    "dspark_sustain_margin",
    "dspark_probe_scout",
    "dspark_probe_sample",
    "dspark_sts_refit_interval",
    *(f"dspark_{name}" for name in ("draft_catchup_tokens", "mask_paused_compact", "plain_paused_steps",
                                    "draft_defer_prompts")),
)
# Settings of the vLLM plugin alone: how a paused vLLM server keeps its draft and schedules its steps
# (engines.vllm.config says what each does). The embedded engine's paused step is a plain step already.
VLLM_ONLY_FIELDS = ("draft_catchup_tokens", "mask_paused_compact", "plain_paused_steps", "draft_defer_prompts")
# Settings of the embedded engine's saturation probes alone: its paused draft feeds nothing, so a probe catches it
# up over the whole pause (core.capacity.CapacityManager.probe_sample_size); vLLM's paused draft is kept current.
EMBEDDED_ONLY_FIELDS = ("probe_sample",)
# Keys of vLLM's own SpeculativeConfig that this module reads; the rest are vLLM engine details that the
# embedded engine has no use for (attention_backend, draft_sample_method, ...).
_SPEC_KEYS_READ = ("model", "num_speculative_tokens", "method")
# Methods the embedded engine can honour: it runs a separate draft model with a confidence head.
_EMBEDDED_METHODS = ("dspark", "draft_model")


@dataclass
class ServeSettings:
    """Everything `dspark serve` needs, after flags and JSON are merged and validated.

    ``draft`` is ``None`` for "no draft model"; ``num_speculative_tokens`` ``None`` means the engine's
    default. ``sps_curve`` is a path, ``"auto"`` (profile at start-up) or ``None``; an inline curve from
    the JSON lives in ``sps_curve_points`` as ``((batch_tokens, steps_per_sec), ...)``.
    """

    engine: str = "embedded"
    model: str = DEFAULT_MODEL
    draft: str | None = "auto"
    num_speculative_tokens: int | None = None
    capacity_mode: str = "none"
    capacity_policy: str = "argmax"
    confidence_threshold: float = 0.0
    sps_curve: str | None = None
    sps_curve_points: tuple[tuple[int, float], ...] | None = None
    sps_overhead_ms: float | None = None
    sts: str | None = None
    online_sts: bool = False
    confidence_temperature: float | None = None
    budget_frac: float = 1.0
    min_predicted_gain: float | None = None  # None: the core's default (CapacityConfig.trim_margin)
    record_traces: str | None = None
    saturation_patience: int | None = None
    resume_every: int | None = None
    probe_tax: float | None = None  # None: the core's default (CapacityConfig.probe_tax)
    sustain_margin: float | None = None  # None: the core's default (CapacityConfig.sustain_margin)
    probe_scout: bool | None = None  # None: the core's default (CapacityConfig.probe_scout, off)
    probe_sample: int | None = None  # embedded engine only (EMBEDDED_ONLY_FIELDS); None: the core's default
    sts_refit_interval: int | None = None
    draft_catchup_tokens: int | None = None  # vLLM engine only (VLLM_ONLY_FIELDS)
    mask_paused_compact: bool | None = None  # vLLM engine only
    plain_paused_steps: bool | None = None  # vLLM engine only
    draft_defer_prompts: bool | None = None  # vLLM engine only
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    scheduler_delay_factor: float | None = None  # embedded engine only (EngineConfig)
    gpu_memory_utilization: float | None = None  # embedded engine only (EngineConfig: the KV pool's share)
    attention_backend: str | None = None  # embedded engine only (EngineConfig)
    phase_timing: str | None = None  # embedded engine only (EngineConfig)
    mixed_prefill: bool | None = None  # embedded engine only (EngineConfig; None: its default, on)
    engine_process: bool | None = None  # embedded engine only (ServerOptions; None: default_engine_process)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    device: str = "auto"
    seed: int | None = None
    served_model_name: str | None = None
    method: str | None = None
    # vLLM SpeculativeConfig keys we do not interpret, kept verbatim for the vLLM launcher.
    vllm_speculative_config: dict[str, Any] = field(default_factory=dict)
    # Settings a flag gave one value and --speculative-config another: (field, the flag's, the JSON's). Flags win.
    overridden: tuple[tuple[str, Any, Any], ...] = ()

    @property
    def speculative(self) -> bool:
        return self.draft is not None and self.num_speculative_tokens != 0

    def dspark_keys(self) -> dict[str, Any]:
        """The settings as canonical ``dspark_*`` keys (what the vLLM launcher puts in --additional-config): those
        set away from their defaults only, so that a default never overrides what the user's own
        ``--additional-config`` object sets (a policy, online STS and a budget there were dropped so)."""
        out: dict[str, Any] = {"dspark_capacity_verification_mode": self.capacity_mode}
        if self.sps_curve_points is not None:
            out["dspark_sps_curve"] = [list(p) for p in self.sps_curve_points]
        elif self.sps_curve is not None:
            out["dspark_sps_curve"] = self.sps_curve
        if self.sps_overhead_ms is not None:
            out["dspark_sps_overhead_ms"] = self.sps_overhead_ms
        if self.budget_frac != 1.0:
            out["dspark_budget_frac"] = self.budget_frac
        if self.capacity_policy == "threshold":
            out["dspark_confidence_threshold"] = self.confidence_threshold
        elif self.capacity_policy != "argmax":
            out["dspark_policy"] = self.capacity_policy
        if self.online_sts:
            out["dspark_online_sts"] = True
        if self.min_predicted_gain is not None:
            out["dspark_min_predicted_gain"] = self.min_predicted_gain
        if self.sts is not None:
            out["dspark_sts"] = self.sts
        if self.confidence_temperature is not None:
            out["dspark_confidence_temperature"] = self.confidence_temperature
        if self.record_traces is not None:
            out["dspark_record_traces"] = self.record_traces
        for key in ("saturation_patience", "resume_every", "probe_tax", "sustain_margin", "probe_scout", "sts_refit_interval",
                    *EMBEDDED_ONLY_FIELDS, *VLLM_ONLY_FIELDS):
            if getattr(self, key) is not None:
                out[f"dspark_{key}"] = getattr(self, key)
        return out


# --------------------------------------------------------------------------------------------- validators


def _err(where: str, msg: str) -> DsparkError:
    return DsparkError(f"{where}: {msg}")


def as_bool(where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _err(where, f"expected true or false, got {value!r}")


def as_int(where: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _err(where, f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise _err(where, f"must be >= {minimum}, got {value}")
    return value


def as_float(where: str, value: Any, *, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(where, f"expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise _err(where, f"must be finite, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise _err(where, f"must be {'>' if lo_open else '>='} {lo:g}, got {value:g}")
    if hi is not None and value > hi:
        raise _err(where, f"must be <= {hi:g}, got {value:g}")
    return value


def _as_choice(where: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise _err(where, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def as_str(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _err(where, f"expected a non-empty string, got {value!r}")
    return value


def _existing_file(where: str, value: str) -> str:
    path = Path(value).expanduser()
    if path.is_dir():
        raise _err(where, f"{value!r} is a folder; name the file")
    if not path.is_file():
        raise _err(where, f"file {value!r} does not exist")
    return str(path)


def _curve_points(where: str, value: Any) -> tuple[tuple[int, float], ...]:
    """The seed's inline curve: a non-empty list of [batch_tokens, steps_per_sec] pairs."""
    if not isinstance(value, list) or not value:
        raise _err(where, "expected a non-empty list of [batch_tokens, steps_per_sec] pairs, a file path or \"auto\"")
    points: list[tuple[int, float]] = []
    for i, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _err(where, f"entry {i} must be a [batch_tokens, steps_per_sec] pair, got {pair!r}")
        tokens = as_int(f"{where}[{i}][0]", pair[0], minimum=1)
        sps = as_float(f"{where}[{i}][1]", pair[1], lo=0.0, lo_open=True)
        points.append((tokens, sps))
    return tuple(points)


# ------------------------------------------------------------------------------------------------- parse


def speculative_keys(obj: dict[str, Any]) -> dict[str, Any]:
    """A speculative config's keys as vLLM 0.33 reads them (``EngineArgs.create_speculative_config``): dashes become
    underscores, the later of two spellings winning. Read with its dashes, ``{"num-speculative-tokens": 7}`` gave no
    draft length here, the default K was added beside it, and vLLM ran K=4."""
    return {k.replace("-", "_"): v for k, v in obj.items()}


def parse_speculative_config(text: str) -> dict[str, Any]:
    """Parse ``--speculative-config`` JSON into a dict; a one-line error for anything that is not an object."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise DsparkError(f"--speculative-config: not valid JSON ({exc}); pass an object such as "
                          "'{\"num_speculative_tokens\": 4}'") from None
    if not isinstance(obj, dict):
        raise DsparkError(f"--speculative-config: expected a JSON object, got {type(obj).__name__}")
    obj = speculative_keys(obj)
    unknown = sorted(k for k in obj if k.startswith("dspark_") and k not in DSPARK_KEYS + VLLM_DSPARK_FIELDS)
    if unknown:
        raise DsparkError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                          f"known dspark keys: {', '.join(DSPARK_KEYS)} (and vLLM's own "
                          f"{', '.join(VLLM_DSPARK_FIELDS)})")
    return obj


def _settings_from_json(obj: dict[str, Any]) -> dict[str, Any]:
    """Translate a parsed speculative config into ServeSettings field values (only keys that are present)."""
    w = "--speculative-config"
    out: dict[str, Any] = {}
    if "model" in obj:
        out["draft"] = None if obj["model"] in (None, "none") else as_str(f"{w} model", obj["model"])
    if "num_speculative_tokens" in obj:
        out["num_speculative_tokens"] = as_int(f"{w} num_speculative_tokens", obj["num_speculative_tokens"], minimum=0)
    if "method" in obj and obj["method"] is not None:
        out["method"] = as_str(f"{w} method", obj["method"])
    if "dspark_capacity_verification_mode" in obj:
        mode = obj["dspark_capacity_verification_mode"]
        mode = "varlen" if mode == "compact" else mode  # the prototype's alias
        out["capacity_mode"] = _as_choice(f"{w} dspark_capacity_verification_mode", mode,
                                          CAPACITY_MODES + ("compact",))
    if "dspark_sps_curve" in obj:
        value = obj["dspark_sps_curve"]
        if isinstance(value, str):
            out["sps_curve"] = value if value == "auto" else _existing_file(f"{w} dspark_sps_curve", value)
        else:
            out["sps_curve_points"] = _curve_points(f"{w} dspark_sps_curve", value)
    if "dspark_sps_overhead_ms" in obj:
        out["sps_overhead_ms"] = as_float(f"{w} dspark_sps_overhead_ms", obj["dspark_sps_overhead_ms"], lo=0.0)
    if "dspark_budget_frac" in obj:
        out["budget_frac"] = as_float(f"{w} dspark_budget_frac", obj["dspark_budget_frac"],
                                       lo=0.0, hi=1.0, lo_open=True)
    if "dspark_confidence_threshold" in obj:
        thr = as_float(f"{w} dspark_confidence_threshold", obj["dspark_confidence_threshold"], lo=0.0, hi=1.0)
        # The prototype's convention: 0 means "budget from the SPS curve", > 0 a static survival threshold.
        if thr > 0:
            out["capacity_policy"] = "threshold"
            out["confidence_threshold"] = thr
    if "dspark_confidence_temperature" in obj:
        out["confidence_temperature"] = as_float(f"{w} dspark_confidence_temperature",
                                                  obj["dspark_confidence_temperature"], lo=0.0, lo_open=True)
    if "dspark_online_sts" in obj:
        out["online_sts"] = as_bool(f"{w} dspark_online_sts", obj["dspark_online_sts"])
    if obj.get("dspark_min_predicted_gain") is not None:  # null: the core's default, as the vLLM plugin reads it
        out["min_predicted_gain"] = as_float(f"{w} dspark_min_predicted_gain", obj["dspark_min_predicted_gain"],
                                              lo=0.0)
    if "dspark_sts" in obj:
        out["sts"] = _existing_file(f"{w} dspark_sts", as_str(f"{w} dspark_sts", obj["dspark_sts"]))
    if "dspark_record_traces" in obj:
        out["record_traces"] = as_str(f"{w} dspark_record_traces", obj["dspark_record_traces"])
    if "dspark_policy" in obj:
        out["capacity_policy"] = _as_choice(f"{w} dspark_policy", obj["dspark_policy"], POLICIES)
    if "dspark_saturation_patience" in obj:
        out["saturation_patience"] = as_int(f"{w} dspark_saturation_patience", obj["dspark_saturation_patience"],
                                             minimum=0)
    if "dspark_resume_every" in obj:
        out["resume_every"] = as_int(f"{w} dspark_resume_every", obj["dspark_resume_every"], minimum=1)
    if "dspark_probe_tax" in obj:
        out["probe_tax"] = as_float(f"{w} dspark_probe_tax", obj["dspark_probe_tax"], lo=0.0, lo_open=True, hi=1.0)
    if "dspark_sustain_margin" in obj:
        out["sustain_margin"] = as_float(f"{w} dspark_sustain_margin", obj["dspark_sustain_margin"], lo=0.0, hi=1.0)
    if "dspark_sts_refit_interval" in obj:
        out["sts_refit_interval"] = as_int(f"{w} dspark_sts_refit_interval", obj["dspark_sts_refit_interval"],
                                            minimum=1)
    if "dspark_probe_sample" in obj:
        out["probe_sample"] = as_int(f"{w} dspark_probe_sample", obj["dspark_probe_sample"], minimum=0)
    if "dspark_draft_catchup_tokens" in obj:
        out["draft_catchup_tokens"] = as_int(f"{w} dspark_draft_catchup_tokens", obj["dspark_draft_catchup_tokens"],
                                              minimum=0)
    for name in ("probe_scout", "mask_paused_compact", "plain_paused_steps", "draft_defer_prompts"):
        if f"dspark_{name}" in obj:
            out[name] = as_bool(f"{w} dspark_{name}", obj[f"dspark_{name}"])
    return out


# Settings that only matter when verification is capacity-managed: giving one of them without a mode
# means the user wants capacity management, and the prototype's default mode was varlen. The vLLM launcher's
# command-line path applies the same rule (engines.vllm.launcher.IMPLY_VARLEN).
CAPACITY_FLAGS = ("sps_curve", "sps_overhead_ms", "budget_frac", "capacity_policy", "confidence_threshold",
                  "min_predicted_gain")
_CAPACITY_JSON_KEYS = ("dspark_sps_curve", "dspark_sps_overhead_ms", "dspark_budget_frac",
                       "dspark_confidence_threshold", "dspark_min_predicted_gain", "dspark_policy")


def _validate_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """Check explicit flag values (those that are not None) and rename them to ServeSettings fields."""
    out: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None:
            continue
        where = "--" + name.replace("_", "-")
        if name == "engine":
            out[name] = _as_choice(where, value, ENGINES)
        elif name == "model":
            out[name] = as_str(where, value)
        elif name == "draft":
            out[name] = None if value == "none" else as_str(where, value)
        elif name == "num_speculative_tokens":
            out[name] = as_int(where, value, minimum=0)
        elif name == "capacity_mode":
            out[name] = _as_choice(where, "varlen" if value == "compact" else value, CAPACITY_MODES)
        elif name == "capacity_policy":
            out[name] = _as_choice(where, value, POLICIES)
        elif name == "confidence_threshold":
            out[name] = as_float(where, value, lo=0.0, hi=1.0)
        elif name == "sps_curve":
            out[name] = value if value == "auto" else _existing_file(where, as_str(where, value))
            out["sps_curve_points"] = None  # an explicit file replaces an inline JSON curve
        elif name == "sps_overhead_ms":
            out[name] = as_float(where, value, lo=0.0)
        elif name == "sts":
            out[name] = _existing_file(where, as_str(where, value))
        elif name == "online_sts":
            out[name] = as_bool(where, value)
        elif name == "budget_frac":
            out[name] = as_float(where, value, lo=0.0, hi=1.0, lo_open=True)
        elif name == "min_predicted_gain":
            out[name] = as_float(where, value, lo=0.0)
        elif name == "record_traces":
            out[name] = as_str(where, value)
        elif name in ("max_num_seqs", "max_model_len"):
            out[name] = as_int(where, value, minimum=2 if name == "max_model_len" else 1)
        elif name == "scheduler_delay_factor":
            out[name] = as_float(where, value, lo=0.0)
        elif name == "gpu_memory_utilization":
            out[name] = as_float(where, value, lo=0.0, lo_open=True, hi=1.0)
        elif name == "attention_backend":
            out[name] = _as_choice(where, value, ATTENTION_BACKENDS)
        elif name == "phase_timing":
            out[name] = _as_choice(where, value, PHASE_TIMINGS)
        elif name in ("mixed_prefill", "engine_process"):
            out[name] = as_bool(where, value)
        elif name == "host":
            out[name] = as_str(where, value)
        elif name == "port":
            port = as_int(where, value, minimum=0)
            if port > 65535:
                raise _err(where, f"must be <= 65535, got {port}")
            out[name] = port
        elif name == "device":
            out[name] = _as_choice(where, value, DEVICES)
        elif name == "seed":
            out[name] = as_int(where, value, minimum=0)
        elif name == "served_model_name":
            out[name] = as_str(where, value)
        else:
            raise DsparkError(f"internal: unknown serve flag {name!r}")
    return out


def build_settings(flags: dict[str, Any], speculative_config: str | None = None) -> ServeSettings:
    """Merge explicit flags (non-None values, keyed by ServeSettings field) over the JSON over defaults."""
    obj: dict[str, Any] = {}
    if speculative_config is not None:
        obj = parse_speculative_config(speculative_config)
    from_json = _settings_from_json(obj)
    from_flags = _validate_flags(flags)
    merged = {**from_json, **from_flags}
    if "confidence_threshold" in from_flags and "capacity_policy" not in from_flags:
        # --confidence-threshold alone selects the threshold policy (or, at 0, the SPS-driven default).
        merged["capacity_policy"] = "threshold" if from_flags["confidence_threshold"] > 0 else "argmax"
    wants_capacity = any(k in from_flags for k in CAPACITY_FLAGS) or any(k in obj for k in _CAPACITY_JSON_KEYS)
    speculative = merged.get("draft", "auto") is not None and merged.get("num_speculative_tokens") != 0
    if "capacity_mode" not in merged and wants_capacity and speculative:
        # Without speculation (-k 0: bench's nospec column, whose server shares the other columns' flags) the
        # capacity settings are moot, not a request for capacity management: ineffective_settings names them.
        merged["capacity_mode"] = "varlen"
    # "model": "none" (or null) is read as no draft above; handed on, vLLM would look for a model called none
    merged["vllm_speculative_config"] = {k: v for k, v in obj.items()
                                         if (not k.startswith("dspark_") or k in VLLM_DSPARK_FIELDS)
                                         and not (k == "model" and v in (None, "none"))}
    merged["overridden"] = tuple((k, from_flags[k], from_json[k]) for k in from_flags
                                 if k in from_json and from_flags[k] != from_json[k])
    settings = ServeSettings(**merged)
    _check_consistency(settings)
    return settings


def ineffective_settings(s: ServeSettings) -> list[str]:
    """Settings given that cannot act on this server, each a sentence to warn with (not an error: a bench
    matrix hands every column's server the same common flags, its no-speculation column included)."""
    out = [f"--{name.replace('_', '-')} {flag!r} overrides {given!r} from --speculative-config (flags win)"
           for name, flag, given in s.overridden]
    if not s.speculative:
        # Traces and the capacity manager's settings alike: with nothing drafted there is nothing to record or judge.
        moot = [flag for flag, on in (*_capacity_settings(s), ("--record-traces", s.record_traces is not None)) if on]
        if moot:
            out.append(f"{', '.join(moot)}: no effect without speculation (-k 0 or --draft none)")
        if s.draft is None and s.num_speculative_tokens:
            out.append(f"-k {s.num_speculative_tokens}: no effect with --draft none, which serves without speculation "
                       "(pass a draft model for it to act)")
    elif s.capacity_mode == "none":
        # Traces are left out: the embedded engine records them in mode none (the vLLM launcher refuses them).
        moot = [flag for flag, on in _capacity_settings(s) if on]
        if moot:
            out.append(capacity_mode_none_warning(moot))
    elif s.capacity_policy != "threshold" and s.confidence_threshold > 0:
        out.append(f"--confidence-threshold {s.confidence_threshold:g}: no effect with --capacity-policy "
                   f"{s.capacity_policy}, which budgets from the SPS curve; pass --capacity-policy threshold for it "
                   "to act")
    if s.speculative and s.capacity_mode == "mask" and s.probe_scout:
        # a warning, as for the other settings a mode cannot use: a bench matrix's columns share one --speculative-config
        out.append("dspark_probe_scout: no effect with --capacity-mode mask, whose uniform batch computes every draft "
                   "row whatever is verified (a scout would cost a whole probe step); it acts in varlen")
    if (s.speculative and s.capacity_mode != "none" and s.sps_overhead_ms is not None and s.sps_curve is None
            and s.sps_curve_points is None):
        # the threshold policy needs no curve, and without one there is no overhead to override
        out.append("--sps-overhead-ms: no effect without an SPS curve (the threshold policy prices nothing); "
                   "pass --sps-curve FILE or auto for it to act")
    return out


def _capacity_settings(s: ServeSettings) -> list[tuple[str, bool]]:
    """Each setting only the capacity manager reads (STS included), and whether it was given: what neither a
    server without speculation nor one verifying every draft can use."""
    default = ServeSettings()
    return [
        ("--sts", s.sts is not None), ("--online-sts", s.online_sts),
        ("--sps-curve", s.sps_curve is not None or s.sps_curve_points is not None),
        ("--sps-overhead-ms", s.sps_overhead_ms is not None),
        ("--capacity-policy", s.capacity_policy != default.capacity_policy),
        ("--budget-frac", s.budget_frac != default.budget_frac),
        ("--min-predicted-gain", s.min_predicted_gain is not None),
        ("dspark_confidence_temperature", s.confidence_temperature is not None),
        *((f"dspark_{name}", getattr(s, name) is not None)
          for name in ("saturation_patience", "resume_every", "probe_tax", "sustain_margin", "probe_scout", "sts_refit_interval",
                       *EMBEDDED_ONLY_FIELDS, *VLLM_ONLY_FIELDS)),
    ]


def capacity_mode_none_warning(names: Sequence[str]) -> str:
    """The warning for capacity settings given with no capacity mode (both engines say it alike)."""
    return (f"{', '.join(names)}: no effect with --capacity-mode none, which verifies every draft whatever its "
            "confidence; pass --capacity-mode mask or varlen for it to act")


def curve_k_warning(profiled_k: Any, k: int) -> str | None:
    """The warning for an SPS curve profiled at another draft length than the server drafts (``None``: same K,
    or the curve does not say)."""
    if isinstance(profiled_k, int) and not isinstance(profiled_k, bool) and profiled_k != k:
        # The draft pass's cost grows with K: a curve of another K prices drafting wrongly.
        return (f"the SPS curve was profiled at k={profiled_k} and this server drafts k={k}; "
                f"profile it again with `dspark profile-sps ... -k {k}`")
    return None


def _check_consistency(s: ServeSettings) -> None:
    if s.capacity_policy == "threshold" and s.confidence_threshold <= 0:
        raise DsparkError("--capacity-policy threshold needs --confidence-threshold in (0, 1]")
    if s.capacity_mode != "none" and not s.speculative:
        raise DsparkError(f"--capacity-mode {s.capacity_mode} needs speculation: pass a draft model and "
                          "--num-speculative-tokens > 0, or --capacity-mode none")
    vllm_only = [f"dspark_{name}" for name in VLLM_ONLY_FIELDS if getattr(s, name) is not None]
    if s.engine == "embedded" and vllm_only:
        raise DsparkError(f"--speculative-config {', '.join(vllm_only)}: a setting of the vLLM plugin (how a paused "
                          "vLLM server drafts and schedules); the embedded engine's paused steps are plain steps "
                          "already: drop it, or serve with --engine vllm")
    embedded_only = [f"dspark_{name}" for name in EMBEDDED_ONLY_FIELDS if getattr(s, name) is not None]
    if s.engine == "vllm" and embedded_only:
        raise DsparkError(f"--speculative-config {', '.join(embedded_only)}: a setting of the embedded engine's probes "
                          "(whose paused draft catches up only when a probe drafts); a paused vLLM server keeps its "
                          "draft current (dspark_draft_catchup_tokens): drop it, or serve with --engine embedded")
    vllm_own = [k for k in VLLM_DSPARK_FIELDS if k in s.vllm_speculative_config]
    if s.engine == "embedded" and vllm_own:
        raise DsparkError(f"--speculative-config {', '.join(vllm_own)}: an option of vLLM's own DSpark speculator, "
                          "which the embedded engine does not run: drop it, or serve with --engine vllm")
    if s.engine == "embedded" and s.sts_refit_interval is not None:
        raise DsparkError("--speculative-config dspark_sts_refit_interval is only supported by --engine vllm "
                          "(the embedded engine refits online STS on its own schedule)")
    if s.engine == "vllm" and s.draft is not None and s.draft.strip().lower().split(":")[0] == "synthetic":
        raise DsparkError("--draft synthetic is the embedded engine's speed-study drafter; with --engine vllm use "
                          "vLLM's own synthetic rejection sampler (rejection_sample_method) and a real draft")
    if s.engine == "embedded" and s.method is not None and s.method not in _EMBEDDED_METHODS:
        raise DsparkError(f"--speculative-config method {s.method!r} is not supported by the embedded engine "
                          f"(use {' or '.join(_EMBEDDED_METHODS)}, or --engine vllm)")


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value raw command line ``args`` give ``flag`` (``--flag V`` or ``--flag=V``), as a parser reads it:
    for the options ``dspark serve`` passes through to vLLM unparsed (``--load-format``, memory shares)."""
    value = None
    for i, a in enumerate(args):
        name, eq, inline = a.partition("=")
        if name == flag:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def replace(settings: ServeSettings, **changes: Any) -> ServeSettings:
    return dataclasses.replace(settings, **changes)


# ---------------------------------------------------------------------------------------- embedded launch

# The embedded engine's default draft length when neither a flag nor the JSON sets it (EngineConfig's).
DEFAULT_K = 4


def drafted_k(s: ServeSettings) -> int | None:
    """The draft length the server will run (its traces' K): the default where unset, 0 with no draft. Under vLLM
    the speculative config's own count where the flag is not given, and the default the launcher adds where a
    draft is there to draft with (``launcher.run_vllm_serve``); None where it drafts with none."""
    if s.engine == "vllm":
        if s.num_speculative_tokens is not None:
            return s.num_speculative_tokens
        given = s.vllm_speculative_config.get("num_speculative_tokens")
        if isinstance(given, int) and not isinstance(given, bool):
            return given
        return DEFAULT_K if s.draft is not None or s.vllm_speculative_config.get("model") is not None else None
    if s.draft is None:
        return 0
    return DEFAULT_K if s.num_speculative_tokens is None else s.num_speculative_tokens


@dataclass
class EmbeddedLaunch:
    """What `dspark serve` needs to start the embedded engine: a factory, server options, a banner."""

    engine_config: Any  # engines.embedded.config.EngineConfig
    options: Any  # engines.embedded.server.ServerOptions
    banner: list[tuple[str, str]]
    tmpdir: Path | None = None
    warnings: list[str] = field(default_factory=list)  # what the user should know before trusting the run

    def engine_factory(self) -> Any:
        # A bound method of plain data, so it pickles: --engine-process calls it in the engine process.
        from dspark_cli.engines.embedded.engine import LLMEngine

        return LLMEngine(self.engine_config)

    def cleanup(self) -> None:
        if self.tmpdir is not None:
            import shutil

            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


def _materialise_curve(s: ServeSettings, tmp: Path) -> tuple[str | None, str]:
    """Return (path or "auto" or None for EngineConfig.sps_curve, banner text).

    An inline curve (JSON list) or an overhead override becomes a temporary ``sps_curve.json`` so the engine
    only ever reads files; loading here also validates the curve before any weights are read.
    """
    from dspark_cli.core.sps import SpsCurve

    if s.sps_curve == "auto":
        # the override is applied to the curve the engine profiles (EngineConfig.sps_overhead_ms)
        overhead = "" if s.sps_overhead_ms is None else f", overhead {s.sps_overhead_ms:g} ms"
        return "auto", f"auto (profiled at start-up){overhead}"
    if s.sps_curve_points is None and s.sps_curve is None:
        return None, "none"
    if s.sps_curve_points is not None:
        curve = SpsCurve.from_dict([list(p) for p in s.sps_curve_points], source="--speculative-config dspark_sps_curve")
        label = f"inline ({len(s.sps_curve_points)} points)"
    else:
        assert s.sps_curve is not None
        curve = SpsCurve.load(s.sps_curve)
        label = s.sps_curve
    if s.sps_overhead_ms is not None:
        curve = curve.with_overhead(s.sps_overhead_ms)
    if s.sps_curve_points is None and s.sps_overhead_ms is None:
        return s.sps_curve, label
    path = tmp / "sps_curve.json"
    curve.save(path)
    return str(path), f"{label}, overhead {curve.overhead_ms:g} ms"


def _check_model_ref(flag: str, name: str) -> None:
    """A cheap check before binding a port: an alias the assets know, or a checkpoint dir."""
    from dspark_cli.engines.embedded import assets

    aliases = sorted(set(getattr(assets, "ALIASES", {})))
    if flag == "--draft" and name.strip().lower().startswith("synthetic"):  # speed-study drafts (synthetic.py)
        from dspark_cli.engines.embedded.synthetic import is_synthetic, parse_synthetic

        if is_synthetic(name):
            inner = parse_synthetic(name).draft
            if inner != "auto":
                _check_model_ref("--draft synthetic:...,draft=", inner)
            return
    if name.strip().lower() in aliases or (Path(name).expanduser() / "config.json").is_file():
        return
    if name.strip().lower().startswith("random:"):  # random-initialised shapes (engines/embedded/shapes.py)
        return
    raise DsparkError(f"{flag} {name!r}: neither a known model ({', '.join(aliases)}) nor a checkpoint "
                      "directory with config.json")


def prepare_embedded(s: ServeSettings) -> EmbeddedLaunch:
    """Validate everything that can be checked without loading weights, and build the EngineConfig."""
    import tempfile

    from dspark_cli.core.capacity import CapacityConfig
    from dspark_cli.core.sts import load_sts
    from dspark_cli.engines.embedded.config import EngineConfig
    from dspark_cli.engines.embedded.server import ServerOptions
    from dspark_cli.fileio import atomic_write_json

    _check_model_ref("--model", s.model)
    if s.draft not in (None, "auto"):
        _check_model_ref("--draft", s.draft)
    k = drafted_k(s) or 0
    draft = s.draft if k > 0 else None
    tmp = Path(tempfile.mkdtemp(prefix="dspark-serve-"))
    launch: EmbeddedLaunch | None = None
    try:
        curve_path, curve_label = _materialise_curve(s, tmp)
        warnings = []
        if curve_path not in (None, "auto") and k:
            from dspark_cli.core.sps import SpsCurve

            mismatch = curve_k_warning(SpsCurve.load(curve_path).meta.get("k"), k)
            if mismatch is not None:
                warnings.append(mismatch)
        sts_path = s.sts
        sts_label = "online" if s.online_sts else "none"
        if s.sts is not None:
            load_sts(s.sts, num_positions=k or None)
            # with --online-sts, the offline temperatures are where the online fit starts (its prior)
            sts_label = f"online, from {s.sts}" if s.online_sts else s.sts
        if s.confidence_temperature is not None:
            if s.sts is not None or s.online_sts:
                raise DsparkError("dspark_confidence_temperature conflicts with --sts/--online-sts; keep one")
            # A static temperature is STS with the same temperature at every position.
            sts_path = str(tmp / "sts.json")
            temps = [s.confidence_temperature] * max(k, 1)
            atomic_write_json(sts_path, {"version": 1, "temperatures": temps, "sts_temperatures": temps,
                                         "num_rows": 0})
            sts_label = f"static temperature {s.confidence_temperature:g}"
        extra: dict[str, Any] = {k: v for k, v in (("saturation_patience", s.saturation_patience),
                                                   ("resume_every", s.resume_every),
                                                   ("probe_tax", s.probe_tax),
                                                   ("sustain_margin", s.sustain_margin),
                                                   ("probe_scout", s.probe_scout if s.capacity_mode == "varlen"
                                                    else None),
                                                   ("probe_sample", s.probe_sample),
                                                   ("min_predicted_gain", s.min_predicted_gain)) if v is not None}
        capacity = CapacityConfig(mode=s.capacity_mode, policy=s.capacity_policy, budget_frac=s.budget_frac,
                                  threshold=s.confidence_threshold if s.capacity_policy == "threshold" else 0.0,
                                  **extra)
        if capacity.mode != "none" and capacity.policy != "threshold" and curve_path is None:
            raise DsparkError(f"--capacity-mode {capacity.mode} with the {capacity.policy} policy needs an SPS "
                              "curve: pass --sps-curve FILE (from `dspark profile-sps`) or --sps-curve auto")
        kwargs: dict[str, Any] = {
            "model": s.model, "draft": draft, "num_speculative_tokens": k, "capacity": capacity,
            "sps_curve": curve_path, "sts": sts_path, "online_sts": s.online_sts,
            "record_traces": s.record_traces, "device": s.device,
            "sps_overhead_ms": s.sps_overhead_ms if curve_path == "auto" else None,
        }
        for name in ("max_num_seqs", "max_model_len", "seed", "scheduler_delay_factor", "attention_backend",
                     "phase_timing", "mixed_prefill", "gpu_memory_utilization"):
            if getattr(s, name) is not None:
                kwargs[name] = getattr(s, name)
        cfg = EngineConfig(**kwargs)
        cfg.validate()
        served = s.served_model_name or s.model
        aliases = tuple(n for n in (s.model,) if n != served)
        options = ServerOptions(s.host, s.port, served, aliases, k, engine_process=default_engine_process(s))
        if capacity.mode == "none":
            mode_label = "none (verify every draft)"
        elif capacity.policy == "threshold":
            mode_label = f"{capacity.mode}, threshold {capacity.threshold:g}"
        else:
            mode_label = f"{capacity.mode}, {capacity.policy} policy"
        if capacity.budget_frac < 1.0:
            mode_label += f", budget <= {capacity.budget_frac:g} of drafts"
        if s.min_predicted_gain is not None:
            mode_label += f", min gain {capacity.trim_margin:g}"
        banner = [
            ("model", s.model + (f" (served as {served})" if served != s.model else "")),
            ("draft", draft if draft is not None else "none"),
            ("k", str(k) if k else "0 (no speculation)"),
            ("capacity", mode_label),
            ("sps curve", curve_label),
            ("sts", sts_label),
            ("device", s.device),
            ("url", f"http://{s.host}:{s.port}/v1" if s.port else "a free port, said once listening"),
        ]
        if s.record_traces:
            banner.insert(6, ("traces", s.record_traces))
        if s.mixed_prefill is False:
            banner.append(("prefills", "steps of their own (--no-mixed-prefill)"))
        banner.append(("engine front", "its own process" if options.engine_process else "a thread of the server"))
        if s.phase_timing:
            banner.append(("phase timing", f"{s.phase_timing} (dspark:step_phase_seconds_total)"))
        launch = EmbeddedLaunch(cfg, options, banner, tmp, warnings)
        return launch
    finally:
        if launch is None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
