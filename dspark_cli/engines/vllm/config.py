"""The plugin's settings: the ``"dspark"`` object inside vLLM's ``--additional-config``, and the translation
from the seed's ``dspark_*`` keys (which vLLM 0.33's ``SpeculativeConfig`` rejects: ``extra="forbid"``).

``--additional-config`` is the one channel that reaches every vLLM process (frontend, engine core, each
worker) unchanged and is hashed into the compile cache, so graph-relevant choices (mask vs varlen) cannot
reuse a cache built for the other. This module is pure (no torch, no vLLM): a typo fails in milliseconds in
the launcher, and the worker-side plugin parses the same object with the same code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dspark_cli.engines.vllm.contract import ADDITIONAL_CONFIG_KEY, VLLM_DSPARK_FIELDS
from dspark_cli.errors import DsparkError

MODES = ("none", "mask", "varlen")
POLICIES = ("argmax", "paper", "threshold")

# The seed's keys (the prototype branch's SpeculativeConfig fields) plus the toolkit's additions, each mapped
# to the settings field it sets. dspark_confidence_threshold is special-cased (it also picks the policy).
SEED_KEYS: dict[str, str] = {
    "dspark_capacity_verification_mode": "mode",
    "dspark_sps_curve": "sps_curve",
    "dspark_sps_overhead_ms": "overhead_ms",
    "dspark_budget_frac": "budget_frac",
    "dspark_confidence_threshold": "threshold",
    "dspark_confidence_temperature": "confidence_temperature",
    "dspark_online_sts": "online_sts",
    "dspark_min_predicted_gain": "min_predicted_gain",
    "dspark_sts": "sts",
    "dspark_record_traces": "record_traces",
    "dspark_policy": "policy",
    "dspark_saturation_patience": "saturation_patience",
    "dspark_resume_every": "resume_every",
    "dspark_probe_tax": "probe_tax",
    "dspark_sustain_margin": "sustain_margin",
    "dspark_probe_scout": "probe_scout",
    "dspark_sts_refit_interval": "sts_refit_interval",
    "dspark_draft_catchup_tokens": "draft_catchup_tokens",
    "dspark_mask_paused_compact": "mask_paused_compact",
    "dspark_plain_paused_steps": "plain_paused_steps",
    "dspark_draft_defer_prompts": "draft_defer_prompts",
}


# dspark keys of the embedded engine alone (serve_config.EMBEDDED_ONLY_FIELDS), refused here by name.
EMBEDDED_ONLY_KEYS = ("dspark_probe_sample",)


@dataclass(frozen=True)
class DsparkVllmSettings:
    """What the plugin does inside vLLM. ``sps_curve`` is a file path, an inline seed list
    ``[[tokens, steps_per_sec], ...]``, an inline ``sps_curve.json`` object, or ``None`` (use vLLM's start-up profile).
    """

    mode: str = "varlen"
    policy: str = "argmax"
    budget_frac: float = 1.0
    threshold: float = 0.0
    min_predicted_gain: float | None = None  # None: the core's default (CapacityConfig.trim_margin)
    saturation_patience: int = 8
    resume_every: int = 16
    # The share of paused time that probes may spend (core.saturation); None keeps the core's default.
    probe_tax: float | None = None
    # How far drafting must clear plain decoding over a longer window to go on (core.saturation, "Break-even
    # drafting"); None keeps the core's default, 0 judges by the short window alone.
    sustain_margin: float | None = None
    # Varlen (no effect in mask mode): a dear probe's first step drafts and verifies nothing, and the probe is
    # judged from the step planned on the confidences it recorded, not on a plan that verifies every draft
    # (core.saturation, "Scouts").
    probe_scout: bool = False
    sps_curve: str | list[Any] | dict[str, Any] | None = None
    overhead_ms: float | None = None
    sts: str | None = None
    online_sts: bool = False
    sts_refit_interval: int = 64
    confidence_temperature: float | None = None
    record_traces: str | None = None
    # While paused, a draft_model draft stops writing its K/V each step and catches up over the skipped
    # positions in one pass once this many are pending in the batch (or drafting resumes); 0 keeps the draft's
    # K/V current on every paused step (engines.vllm.upkeep says why this pays).
    draft_catchup_tokens: int = 2048
    # Mask mode: a paused step (no drafts to verify) runs the compacted one-token-per-request batch that varlen
    # runs, on varlen decode graphs, instead of the uniform 1 + K batch with every placeholder masked (1.5-1.7x a
    # no-speculation step on the H200, docs/PERFORMANCE.md section 25). Drafting steps keep the uniform masked
    # layout. Needs an attention backend that replays varlen decode graphs; mask stays uniform otherwise. On by
    # default since its greedy outputs with real weights matched no speculation's on the H200 (section 28);
    # false keeps every paused step uniform.
    mask_paused_compact: bool = True
    # A paused step tells vLLM's scheduler that it drafted nothing, so the step after it is scheduled as plain
    # decoding: one token per request, no placeholder drafts. Without it the asynchronous scheduler reserves K
    # placeholders per request on every step, and a paused server pays for them in the scheduler (token budget,
    # rejection accounting), in the runner (verification layout, rejection sampler) and in our hooks, though no
    # draft is verified (docs/PERFORMANCE.md section 33). Works where the scheduler runs in the worker's process
    # (one GPU: vLLM's uniprocess executor); elsewhere the placeholders stay, verified by none: the step compacts
    # them away (varlen, compacted mask) or masks them (uniform mask).
    # On by default since the greedy lossless check with real weights matched no speculation with it (8 of 8
    # prompts for varlen pausing every other step and for mask, docs/PERFORMANCE.md section 34). Its first H200
    # run had served garbage: the plain step built attention metadata for one-token queries under a graph
    # captured for 1 + K (section 33), which plugin.bound_query_len fixed.
    plain_paused_steps: bool = True
    # While paused, a step that carries a prompt chunk defers the draft's pass over it as well, so the draft runs
    # only at budgeted catch-ups and on resume (engines.vllm.upkeep). Only without prefix caching, where a
    # deferred prompt's blocks cannot be reused before they are written. Off until it is served on the H200:
    # section 34 of docs/PERFORMANCE.md put a paused server's 16-request loss in the steps that run the draft.
    draft_defer_prompts: bool = False

    def __post_init__(self) -> None:
        w = f"--additional-config {ADDITIONAL_CONFIG_KEY}"
        _choice(f"{w}.mode", self.mode, MODES)
        _choice(f"{w}.policy", self.policy, POLICIES)
        _number(f"{w}.budget_frac", self.budget_frac, 0.0, 1.0, lo_open=True)
        _number(f"{w}.threshold", self.threshold, 0.0, 1.0)
        if self.min_predicted_gain is not None:
            _number(f"{w}.min_predicted_gain", self.min_predicted_gain, 0.0, math.inf)
        _integer(f"{w}.saturation_patience", self.saturation_patience, 0)
        _integer(f"{w}.resume_every", self.resume_every, 1)
        if self.probe_tax is not None:
            _number(f"{w}.probe_tax", self.probe_tax, 0.0, 1.0, lo_open=True)
        if self.sustain_margin is not None:
            _number(f"{w}.sustain_margin", self.sustain_margin, 0.0, 1.0)
        _integer(f"{w}.sts_refit_interval", self.sts_refit_interval, 1)
        _integer(f"{w}.draft_catchup_tokens", self.draft_catchup_tokens, 0)
        if self.overhead_ms is not None:
            _number(f"{w}.overhead_ms", self.overhead_ms, 0.0, math.inf)
        if self.confidence_temperature is not None:
            _number(f"{w}.confidence_temperature", self.confidence_temperature, 0.0, math.inf, lo_open=True)
        for name in ("online_sts", "probe_scout", "mask_paused_compact", "plain_paused_steps",
                     "draft_defer_prompts"):
            if not isinstance(getattr(self, name), bool):
                raise DsparkError(f"{w}.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.policy == "threshold" and self.threshold <= 0:
            raise DsparkError(f"{w}: policy threshold needs threshold in (0, 1] (dspark_confidence_threshold)")
        if self.sps_curve is not None and not isinstance(self.sps_curve, (str, list, dict)):
            raise DsparkError(f"{w}.sps_curve: expected a file path, a [[tokens, steps_per_sec], ...] list or "
                              f"an sps_curve.json object, got {type(self.sps_curve).__name__}")
        if self.sts is not None and self.confidence_temperature is not None:
            raise DsparkError(f"{w}: sts (per-position temperatures) and confidence_temperature (one scalar) "
                              "are exclusive; keep one")
        for name in ("sts", "record_traces"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise DsparkError(f"{w}.{name}: expected a non-empty path, got {value!r}")

    @property
    def active(self) -> bool:
        """Whether the plugin replaces vLLM's manager (mode ``none`` leaves vLLM untouched)."""
        return self.mode != "none"

    def to_dict(self) -> dict[str, Any]:
        """The ``"dspark"`` object: only non-default values, so the hashed config stays short and stable."""
        default = DsparkVllmSettings()
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "mode" or value != getattr(default, f.name):
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, obj: Any, where: str = f"--additional-config {ADDITIONAL_CONFIG_KEY}") -> DsparkVllmSettings:
        if not isinstance(obj, dict):
            raise DsparkError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise DsparkError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**obj)

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> DsparkVllmSettings | None:
        """Our settings from ``VllmConfig.additional_config``; ``None`` when the key is absent."""
        if not isinstance(additional_config, dict) or ADDITIONAL_CONFIG_KEY not in additional_config:
            return None
        return cls.from_dict(additional_config[ADDITIONAL_CONFIG_KEY])

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> DsparkVllmSettings | None:
        return cls.from_additional_config(getattr(vllm_config, "additional_config", None))

    def capacity_config(self) -> Any:
        """The core's :class:`~dspark_cli.core.capacity.CapacityConfig` for these settings."""
        from dspark_cli.core.capacity import CapacityConfig

        return CapacityConfig(
            mode=self.mode,  # type: ignore[arg-type]
            policy=self.policy,  # type: ignore[arg-type]
            budget_frac=self.budget_frac,
            threshold=self.threshold,
            **({} if self.min_predicted_gain is None else {"min_predicted_gain": self.min_predicted_gain}),
            saturation_patience=self.saturation_patience,
            resume_every=self.resume_every,
            **({} if self.probe_tax is None else {"probe_tax": self.probe_tax}),
            **({} if self.sustain_margin is None else {"sustain_margin": self.sustain_margin}),
            # varlen only: mask's uniform batch computes every draft row whatever is verified (a mask server,
            # or a varlen one fallen back to mask for its attention backend, runs without scouts)
            probe_scout=self.probe_scout and self.mode == "varlen",
        )

    def replace(self, **changes: Any) -> DsparkVllmSettings:
        return DsparkVllmSettings(**{**asdict(self), **changes})


def is_seed_key(key: str) -> bool:
    """Whether a speculative-config key is ours to read (a ``dspark_*`` key that is not one of vLLM's own)."""
    return key.startswith("dspark_") and key not in VLLM_DSPARK_FIELDS


def settings_from_seed_keys(spec: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Translate the ``dspark_*`` keys of a speculative config into settings fields (over ``base``).

    Unknown ``dspark_*`` keys are an error: silently ignoring a typo would run a different experiment. vLLM's
    own ``dspark_*`` fields (``contract.VLLM_DSPARK_FIELDS``) are not ours and are left to vLLM.
    The prototype's conventions are kept: ``compact`` is an alias of ``varlen``; a confidence threshold of 0
    means "budget from the SPS curve", above 0 a static survival threshold; ``dspark_sps_curve: "auto"``
    means "profile at start-up".
    """
    out = dict(base or {})
    embedded_only = sorted(k for k in spec if k in EMBEDDED_ONLY_KEYS)
    if embedded_only:
        raise DsparkError(f"--speculative-config {', '.join(embedded_only)}: a setting of dspark's embedded engine, "
                          "whose paused draft catches up only when a probe drafts; this plugin keeps a paused draft "
                          "current (dspark_draft_catchup_tokens): drop it")
    unknown = sorted(k for k in spec if is_seed_key(k) and k not in SEED_KEYS)
    if unknown:
        raise DsparkError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                          f"known dspark keys: {', '.join(SEED_KEYS)} (and vLLM's own "
                          f"{', '.join(VLLM_DSPARK_FIELDS)})")
    for key, field_name in SEED_KEYS.items():
        if key not in spec:
            continue
        value = spec[key]
        if key == "dspark_capacity_verification_mode":
            value = "varlen" if value == "compact" else value
        elif key == "dspark_confidence_threshold":
            _number(f"--speculative-config {key}", value, 0.0, 1.0)
            if value > 0:
                out["policy"] = "threshold"
            elif out.get("policy") == "threshold":
                out["policy"] = "argmax"
        elif key == "dspark_sps_curve" and value == "auto":
            value = None
        out[field_name] = value
    return out


def resolve_paths(settings: DsparkVllmSettings, cwd: Path | None = None,
                  num_positions: int | None = None) -> DsparkVllmSettings:
    """Make file paths absolute (vLLM workers may not share the caller's working directory) and check them.

    The curve and the STS table are parsed with the core's readers, so a broken file fails here with the
    core's one-line message instead of deep inside a worker minutes later; with ``num_positions`` (the
    draft length) the table must cover it, as the plugin will require.
    """
    base = cwd or Path.cwd()
    changes: dict[str, Any] = {}
    if isinstance(settings.sps_curve, str):
        path = (base / Path(settings.sps_curve).expanduser()).resolve()
        from dspark_cli.core.sps import SpsCurve

        SpsCurve.load(path)
        changes["sps_curve"] = str(path)
    elif settings.sps_curve is not None:
        from dspark_cli.core.sps import SpsCurve

        SpsCurve.from_dict(settings.sps_curve, source="dspark_sps_curve")
    if settings.sts is not None:
        path = (base / Path(settings.sts).expanduser()).resolve()
        from dspark_cli.core.sts import load_sts

        load_sts(path, num_positions)
        changes["sts"] = str(path)
    if settings.record_traces is not None:
        changes["record_traces"] = str((base / Path(settings.record_traces).expanduser()).resolve())
    return settings.replace(**changes) if changes else settings


def _choice(where: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise DsparkError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")


def _number(where: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        lo_s = f"> {lo:g}" if lo_open else f">= {lo:g}"
        hi_s = "" if math.isinf(hi) else f" and <= {hi:g}"
        raise DsparkError(f"{where}: expected a finite number {lo_s}{hi_s}, got {value!r}")


def _integer(where: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise DsparkError(f"{where}: expected an integer >= {lo}, got {value!r}")
