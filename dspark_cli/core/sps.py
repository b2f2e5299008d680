"""The profiled step-cost curve the capacity manager prices batches with (``sps_curve.json``).

The budget argmax compares expected accepted tokens per millisecond across budgets, so the curve must
price a batch the way the engine actually runs it:

* At or below the largest captured CUDA-graph size a batch of ``t`` tokens replays the graph of the next
  captured size, so it pays that size's cost (a staircase that rounds UP: 121 tokens run the 128 graph).
  Pricing the real token count instead would make tokens look free right before a riser.
* Above the capture limit the engine runs eagerly; cost is interpolated linearly only between points
  profiled above the limit, because the graph -> eager jump is a real discontinuity that a line through
  the last graph point would smear out.
* Past the last profiled point the last two points are extrapolated linearly (costs keep rising), never
  across the graph -> eager jump: a single eager point extends at the graph points' slope.

A step costs ``draft(num_reqs) + verify(tokens) + overhead_ms``: drafting depends on how many requests
draft, not on how many drafts get verified, and the fixed per-step overhead matters because the objective
is a ratio (leaving it out makes every token look expensive and over-prunes below the contention knee).

Curves are validated when loaded or built from measurements. A flat ("inert") verify curve is refused: it
would pin the argmax to verify-all and the scheduler would silently do nothing.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from dspark_cli.errors import DsparkError
from dspark_cli.fileio import atomic_write_json, parse_non_finite_json

SPS_CURVE_VERSION = 1
# A point this far below the running maximum is a measurement error, not timing noise to smooth away.
MAX_DROP_FRACTION = 0.25
# max/min verify cost below this ratio means the curve carries no load signal (argmax pinned to verify-all).
MIN_COST_RATIO = 1.02
# Floor on a verify cost so extrapolation can never produce zero or negative prices.
MIN_VERIFY_MS = 1e-6
# Integer step prices kept by a curve (SpsCurve.step_cost_ms): a batch's (requests, tokens) pairs recur, and
# a bound keeps a long-lived server's cache small.
STEP_COST_CACHE = 1 << 14
# SpsCurve.budget_costs_ms: cached cost tables (one float per budget, at most ~2,000 each), bounded in entries.
BUDGET_COST_CACHE = 512

# dspark_sps_curve must equal 1000 / (verify_curve_ms + overhead_ms) point by point when a file has both. Loose
# enough for a writer that rounds steps/s to four significant digits, tight enough that any edit that moves a
# decision (0.1% of a step's cost) does not slip through as "the same".
SPS_AGREE_REL_TOL = 1e-3


class SpsCurveError(DsparkError):
    """A step-cost curve that cannot be used; the message names the source and the problem on one line."""


def _fix_hint(source: str) -> str:
    """How to fix a bad curve, worded for where it came from: a flag has no file to fix, a measurement no text."""
    if source.startswith("--") or "inline" in source:
        return "fix the inline curve, or pass an sps_curve.json written by `dspark profile-sps`"
    if "/" in source or os.sep in source or Path(source).suffix:
        return "re-profile with `dspark profile-sps` or fix the file"
    return "re-profile with `dspark profile-sps`"


def _fail(source: str, problem: str) -> SpsCurveError:
    return SpsCurveError(f"{source}: {problem}; {_fix_hint(source)}")


def _clean_points(
    points: Any, what: str, source: str, *, require_rise: bool, allow_empty: bool,
    sps: dict[int, float] | None = None,
) -> tuple[tuple[int, float], ...]:
    """Validate ``[[x, ms], ...]``, sort by x, drop exact duplicates and repair noise with a running max.

    Refuses (with :class:`SpsCurveError`) anything the repair would have to invent rather than smooth:
    non-integer or non-positive x, non-finite or non-positive costs, conflicting duplicates, a point far
    below its predecessor, and -- for the verify curve -- a curve that barely rises at all.

    ``sps``: the steps/s the user wrote, by x, when ``points`` were converted from ``dspark_sps_curve``; the
    shape refusals then quote those, since milliseconds derived from them are numbers the user never saw.
    """
    if points is None or (isinstance(points, Sequence) and len(points) == 0):
        if allow_empty:
            return ()
        raise _fail(source, f"{what} is empty")
    if isinstance(points, (str, bytes)) or not isinstance(points, Iterable):
        raise _fail(source, f"{what} must be a list of [x, value] pairs")
    by_x: dict[int, float] = {}
    for i, item in enumerate(points):
        if isinstance(item, np.ndarray):
            item = item.tolist()
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise _fail(source, f"{what}[{i}] must be an [x, value] pair, got {item!r}")
        x_raw, y_raw = item
        if isinstance(x_raw, bool) or isinstance(y_raw, bool):
            raise _fail(source, f"{what}[{i}] holds a boolean, expected numbers")
        if isinstance(x_raw, (str, bytes)) or isinstance(y_raw, (str, bytes)):  # float("8") would take them
            raise _fail(source, f"{what}[{i}] must hold numbers, not text: {item!r}")
        try:
            x_f, y = float(x_raw), float(y_raw)
        except (TypeError, ValueError):
            raise _fail(source, f"{what}[{i}] must hold numbers, got {item!r}") from None
        if not math.isfinite(x_f) or x_f != int(x_f) or x_f <= 0:
            raise _fail(source, f"{what}[{i}] has x={x_raw!r}; x must be a positive integer")
        if not math.isfinite(y):
            raise _fail(source, f"{what}[{i}] has a non-finite value {y_raw!r}")
        if y <= 0:
            raise _fail(source, f"{what}[{i}] has a non-positive value {y!r}")
        x = int(x_f)
        if x in by_x and by_x[x] != y:
            raise _fail(source, f"{what} lists x={x} twice with different values ({by_x[x]!r} and {y!r})")
        by_x[x] = y
    if not by_x:  # an empty dict, array or generator: nothing the Sequence check above could see
        if allow_empty:
            return ()
        raise _fail(source, f"{what} is empty")
    xs = sorted(by_x)
    repaired: list[tuple[int, float]] = []
    running = 0.0
    prev_x = 0
    for x in xs:
        y = by_x[x]
        if running > 0 and y < (1.0 - MAX_DROP_FRACTION) * running:
            if sps is not None:
                raise _fail(
                    source,
                    f"{what} is not monotone: {sps[x]:g} steps/s at x={x} is {100 * (sps[x] / sps[prev_x] - 1):.0f}% "
                    f"above {sps[prev_x]:g} steps/s at x={prev_x} (more than noise; steps/s must not rise with "
                    "batch size)",
                )
            raise _fail(
                source,
                f"{what} is not monotone: {y:.4g} ms at x={x} is {100 * (1 - y / running):.0f}% below "
                f"{running:.4g} ms at x={prev_x} (more than noise)",
            )
        if y >= running:
            running, prev_x = y, x
        repaired.append((x, running))
    if require_rise:
        if len(repaired) < 2:
            raise _fail(source, f"{what} holds one batch size ({xs[0]} tokens); a curve needs at least two, so the "
                                "cost of verifying more can be read off it")
        costs = [y for _, y in repaired]
        ratio = max(costs) / min(costs)
        if ratio < MIN_COST_RATIO:
            if sps is not None:
                fastest, slowest = max(sps.values()), min(sps.values())
                raise _fail(
                    source,
                    f"{what} is flat (steps/s falls only {100 * (1 - slowest / fastest):.2f}% from {xs[0]} to "
                    f"{xs[-1]} tokens), so the budget argmax would always verify every draft",
                )
            raise _fail(
                source,
                f"{what} is flat (cost rises only {100 * (ratio - 1):.2f}% from {xs[0]} to {xs[-1]} tokens), "
                "so the budget argmax would always verify every draft",
            )
    return tuple(repaired)


def monotone_fit(points: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """Least-squares non-decreasing fit of ``(x, ms)`` points (pool-adjacent-violators), sorted by x.

    For measured timings (``dspark profile-sps``, and vLLM's start-up profile: a few replays per size, some
    eager): a running maximum lets one slow outlier price every larger batch, while the isotonic fit averages
    a violating run, so a spike moves the curve only by its share of the run. A curve file the user hands us
    is not repaired this way -- it is refused when it is not monotone (beyond noise).
    """
    pts = sorted((int(x), float(y)) for x, y in points)
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for _, y in pts:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted: list[float] = []
    for total, count in blocks:
        fitted.extend([total / count] * int(count))
    return [(x, y) for (x, _), y in zip(pts, fitted, strict=True)]


def _clean_capture_sizes(sizes: Any, source: str) -> tuple[int, ...]:
    if sizes is None:
        return ()
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise _fail(source, "capture_sizes must be a list of positive integers")
    out: set[int] = set()
    for s in sizes:
        if isinstance(s, bool):
            raise _fail(source, f"capture_sizes holds a boolean {s!r}")
        if isinstance(s, (str, bytes)):
            raise _fail(source, f"capture_sizes holds text {s!r}; expected positive integers")
        try:
            f = float(s)
        except (TypeError, ValueError):
            raise _fail(source, f"capture_sizes holds {s!r}; expected positive integers") from None
        if not math.isfinite(f) or f != int(f) or f <= 0:
            raise _fail(source, f"capture_sizes holds {s!r}; expected positive integers")
        out.add(int(f))
    return tuple(sorted(out))


def _clean_overhead(value: Any, source: str) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise _fail(source, f"overhead_ms must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise _fail(source, f"overhead_ms must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise _fail(source, f"overhead_ms must be finite and >= 0, got {value!r}")
    return v


def _linear(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xs, ys): clamped below xs[0], extrapolated from the last two points above."""
    out = np.interp(x, xs, ys)
    if len(xs) >= 2:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        beyond = x > xs[-1]
        out = np.where(beyond, ys[-1] + slope * (x - xs[-1]), out)
    return out


def _as_float_array(x: Any) -> tuple[np.ndarray, bool]:
    arr = np.asarray(x, dtype=np.float64)
    return arr, arr.ndim == 0


@dataclass(frozen=True)
class SpsCurve:
    """Step cost of the engine as a function of batch tokens (verify) and drafting requests (draft).

    Build it with :meth:`load`, :meth:`from_dict` or :meth:`from_points`; the constructor validates too,
    so an ``SpsCurve`` in hand is always usable. Cost lookups accept scalars or numpy arrays (the budget
    argmax prices every candidate budget in one call).
    """

    verify_ms: tuple[tuple[int, float], ...]
    draft_ms: tuple[tuple[int, float], ...] = ()
    overhead_ms: float = 0.0
    capture_sizes: tuple[int, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # The draft pass when some request samples (temperature > 0): another program than the greedy one -- each
    # draft token is sampled and its whole distribution kept for the rejection sampler -- and on an H200 with a
    # 128k vocabulary it cost several ms more per step. Empty: sampling steps are priced like greedy ones.
    draft_sampling_ms: tuple[tuple[int, float], ...] = ()
    # Lookup tables derived in __post_init__ (kept out of equality/repr).
    _vx: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _vy: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _stair_x: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _stair_y: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _eager_x: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _eager_y: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _eager_slope: float = field(init=False, repr=False, compare=False, hash=False)
    _dx: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _dy: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _sx: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _sy: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    # step_cost_ms of integer arguments, by (num_reqs, tokens, drafting, sampling): see step_cost_ms.
    _step_costs: dict[tuple[int, int, bool, bool], float] = field(init=False, repr=False, compare=False, hash=False)
    # budget_costs_ms's tables, by (num_reqs, base_tokens, num_slots, per_slot, sampling).
    _budget_costs: dict[tuple[int, int, int, float, bool], np.ndarray] = field(
        init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        source = "SpsCurve"
        verify = _clean_points(self.verify_ms, "verify_curve_ms", source, require_rise=True, allow_empty=False)
        draft = _clean_points(self.draft_ms, "draft_curve_ms", source, require_rise=False, allow_empty=True)
        draft_sampling = _clean_points(self.draft_sampling_ms, "draft_sampling_curve_ms", source,
                                       require_rise=False, allow_empty=True)
        set_ = object.__setattr__
        set_(self, "verify_ms", verify)
        set_(self, "draft_ms", draft)
        set_(self, "draft_sampling_ms", draft_sampling)
        set_(self, "overhead_ms", _clean_overhead(self.overhead_ms, source))
        set_(self, "capture_sizes", _clean_capture_sizes(self.capture_sizes, source))
        set_(self, "meta", dict(self.meta) if isinstance(self.meta, dict) else {})

        vx = np.array([x for x, _ in verify], dtype=np.float64)
        vy = np.array([y for _, y in verify], dtype=np.float64)
        set_(self, "_vx", vx)
        set_(self, "_vy", vy)
        caps = np.array(self.capture_sizes, dtype=np.float64)
        if len(caps):
            limit = caps[-1]
            in_graph = vx <= limit
            # Price each captured size from the points profiled inside the graph regime (exact when the
            # profiler measured every size, as it does); fall back to all points if none were.
            gx, gy = (vx[in_graph], vy[in_graph]) if in_graph.any() else (vx, vy)
            stair = np.maximum.accumulate(np.maximum(_linear(caps, gx, gy), MIN_VERIFY_MS))
            above = vx > limit
            # Eager region: only points above the limit are joined (no line across the graph->eager jump);
            # with none, the staircase's own last two points extend it.
            ex, ey = (vx[above], vy[above]) if above.any() else (vx, vy)
            if above.any():
                # A captured size the profile skipped is priced by extending the graph points, which can
                # overshoot an eager point measured above it; a forward is never dearer than a larger batch's,
                # so each step is held to the first eager cost at or beyond its size.
                nxt = np.searchsorted(ex, caps, side="left")
                ceiling = np.where(nxt < len(ex), ey[np.minimum(nxt, len(ex) - 1)], np.inf)
                stair = np.maximum(np.minimum(stair, ceiling), MIN_VERIFY_MS)
        else:
            stair = np.zeros(0)
            ex, ey = vx, vy
        # Slope past the last point: from the last two eager points, else the last two points overall -- but
        # never across the graph -> eager jump: one eager point extends at the graph points' own slope (a line
        # through the jump priced every token past the profile at the jump's rise, ~15x the graph's).
        sx, sy = (ex, ey) if len(ex) >= 2 else (vx, vy)
        if len(caps) and len(ex) == 1 and ex[0] > caps[-1] and len(gx) >= 2:
            sx, sy = gx, gy
        slope = (sy[-1] - sy[-2]) / (sx[-1] - sx[-2])
        set_(self, "_eager_slope", float(slope))
        set_(self, "_stair_x", caps)
        set_(self, "_stair_y", stair)
        set_(self, "_eager_x", ex)
        set_(self, "_eager_y", ey)
        set_(self, "_step_costs", {})
        set_(self, "_budget_costs", {})
        set_(self, "_dx", np.array([x for x, _ in draft], dtype=np.float64))
        set_(self, "_dy", np.array([y for _, y in draft], dtype=np.float64))
        set_(self, "_sx", np.array([x for x, _ in draft_sampling], dtype=np.float64))
        set_(self, "_sy", np.array([y for _, y in draft_sampling], dtype=np.float64))

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_points(
        cls,
        verify_ms: Iterable[tuple[int, float]] | np.ndarray,
        draft_ms: Iterable[tuple[int, float]] | np.ndarray = (),
        overhead_ms: float = 0.0,
        capture_sizes: Iterable[int] = (),
        meta: dict[str, Any] | None = None,
        source: str = "measured SPS curve",
        draft_sampling_ms: Iterable[tuple[int, float]] | np.ndarray = (),
    ) -> SpsCurve:
        """Build a curve from measured (medians of) step timings; validates and repairs like :meth:`load`."""
        meta = dict(meta or {})
        verify = _clean_points(
            list(verify_ms), "verify_curve_ms", source, require_rise=True, allow_empty=False
        )
        draft = _clean_points(list(draft_ms), "draft_curve_ms", source, require_rise=False, allow_empty=True)
        draft_sampling = _clean_points(list(draft_sampling_ms), "draft_sampling_curve_ms", source,
                                       require_rise=False, allow_empty=True)
        return cls(
            verify_ms=verify,
            draft_ms=draft,
            overhead_ms=_clean_overhead(overhead_ms, source),
            capture_sizes=_clean_capture_sizes(list(capture_sizes), source),
            meta=meta,
            draft_sampling_ms=draft_sampling,
        )

    def for_sampling(self) -> SpsCurve:
        """The curve a sampling workload sees: the sampling draft pass as its draft cost (unchanged when the
        curve has no sampling draft points). For tools that price every step alike (the simulator)."""
        if not self.draft_sampling_ms:
            return self
        return replace(self, draft_ms=self.draft_sampling_ms, meta={**self.meta, "draft_pricing": "sampling"})

    def with_overhead(self, overhead_ms: float, meta: dict[str, Any] | None = None) -> SpsCurve:
        """The same curve with another per-step overhead (and optionally new meta); validated again."""
        return replace(self, overhead_ms=_clean_overhead(overhead_ms, "SpsCurve"),
                       meta=dict(self.meta if meta is None else meta))

    @classmethod
    def from_dict(cls, obj: Any, source: str = "<dict>") -> SpsCurve:
        """Parse the ``sps_curve.json`` object (docs/ARCHITECTURE.md, File formats), or the seed's plain ``[[tokens, steps_per_sec], ...]`` list.

        The seed's list profiled one breakpoint per captured size, so its token counts become the capture
        sizes, its verify cost is ``1000 / sps`` ms, and it prices neither drafting nor overhead.
        """
        if isinstance(obj, list):
            verify = _sps_to_ms(obj, "dspark_sps_curve", source, overhead_ms=0.0)
            caps = [x for x, _ in verify]
            return cls.from_points(verify, (), 0.0, caps, {"format": "seed-list"}, source)
        if not isinstance(obj, dict):
            raise _fail(source, "expected a JSON object or a [[tokens, steps_per_sec], ...] list")
        version = obj.get("version", SPS_CURVE_VERSION)
        if version != SPS_CURVE_VERSION:
            raise _fail(source, f"unsupported version {version!r} (this build reads version {SPS_CURVE_VERSION})")
        overhead = _clean_overhead(obj.get("overhead_ms", 0.0), source)
        if obj.get("verify_curve_ms") is not None:
            verify = _clean_points(obj["verify_curve_ms"], "verify_curve_ms", source, require_rise=True,
                                   allow_empty=False)
            if obj.get("dspark_sps_curve") is not None:
                _check_sps_agrees(obj, overhead, source)
        elif obj.get("dspark_sps_curve") is not None:
            verify = _sps_to_ms(obj["dspark_sps_curve"], "dspark_sps_curve", source, overhead_ms=overhead)
        else:
            raise _fail(source, "has neither verify_curve_ms nor dspark_sps_curve")
        meta = obj.get("meta") or {}
        if not isinstance(meta, dict):
            raise _fail(source, "meta must be an object")
        caps = obj.get("capture_sizes")
        if caps is None and obj.get("verify_curve_ms") is None:
            caps = [x for x, _ in verify]
        return cls.from_points(verify, obj.get("draft_curve_ms") or (), overhead, caps or (), meta, source,
                               draft_sampling_ms=obj.get("draft_sampling_curve_ms") or ())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SpsCurve:
        """Read ``sps_curve.json`` (our object or the seed's plain list); one-line error on any problem."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise SpsCurveError(f"{p}: cannot read the SPS curve ({exc.strerror or exc})") from None
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if parse_non_finite_json(raw) is not None:
                raise _fail(str(p), "holds NaN or Infinity; step costs must be finite numbers") from None
            raise _fail(str(p), f"not valid JSON ({exc})") from None
        return cls.from_dict(obj, source=str(p))

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """The ``sps_curve.json`` object; ``dspark_sps_curve`` keeps the seed's ``[[tokens, steps_per_sec]]`` readers working."""
        out: dict[str, Any] = {
            "version": SPS_CURVE_VERSION,
            "dspark_sps_curve": [[x, 1000.0 / (y + self.overhead_ms)] for x, y in self.verify_ms],
            "verify_curve_ms": [[x, y] for x, y in self.verify_ms],
            "draft_curve_ms": [[x, y] for x, y in self.draft_ms],
            "overhead_ms": self.overhead_ms,
            "capture_sizes": list(self.capture_sizes),
            "meta": dict(self.meta),
        }
        if self.draft_sampling_ms:  # optional: files without it read as before
            out["draft_sampling_curve_ms"] = [[x, y] for x, y in self.draft_sampling_ms]
        return out

    def save(self, path: str | os.PathLike[str]) -> Path:
        return atomic_write_json(path, self.to_dict())

    # ------------------------------------------------------------------ lookups

    @property
    def capture_limit(self) -> int:
        """Largest captured size (0 when the curve has no staircase region)."""
        return self.capture_sizes[-1] if self.capture_sizes else 0

    def verify_cost_ms(self, tokens: Any) -> Any:
        """Cost of a target forward over ``tokens`` batch tokens (scalar in, float out; array in, array out)."""
        t, scalar = _as_float_array(tokens)
        beyond = np.maximum(t - self._eager_x[-1], 0.0) * self._eager_slope
        eager = np.maximum(np.interp(t, self._eager_x, self._eager_y) + beyond, MIN_VERIFY_MS)
        if len(self._stair_x):
            idx = np.clip(np.searchsorted(self._stair_x, t, side="left"), 0, len(self._stair_x) - 1)
            out = np.where(t <= self._stair_x[-1], self._stair_y[idx], eager)
        else:
            out = eager
        return float(out) if scalar else out

    def draft_cost_ms(self, num_reqs: Any, sampling: bool = False) -> Any:
        """Cost of the draft pass for ``num_reqs`` drafting requests; 0 when drafting is not priced.

        ``sampling``: some request of the batch samples, so the pass is the sampling one -- priced from
        ``draft_sampling_ms`` when the curve has it, else like the greedy pass.
        """
        n, scalar = _as_float_array(num_reqs)
        dx, dy = (self._sx, self._sy) if sampling and len(self._sx) else (self._dx, self._dy)
        if len(dx) == 0:
            out = np.zeros_like(n)
        else:
            out = np.maximum(_linear(n, dx, dy), 0.0)
            out = np.where(n <= 0, 0.0, out)
        return float(out) if scalar else out

    def step_cost_ms(self, num_reqs: Any, tokens: Any, drafting: bool = True, sampling: bool = False) -> Any:
        """Whole-step cost: ``draft(num_reqs)`` (if drafting) + ``verify(tokens)`` + ``overhead_ms``.

        Integer arguments are priced once and then looked up: engines price every paused step this way, and the
        numpy evaluation took ~0.25 ms of host time per step inside an engine's loop on a CPU (its code runs cold
        between forward passes), where a no-speculation step pays nothing (docs/PERFORMANCE.md section 24).
        """
        if isinstance(num_reqs, (int, np.integer)) and isinstance(tokens, (int, np.integer)):
            key = (int(num_reqs), int(tokens), bool(drafting), bool(sampling))
            cost = self._step_costs.get(key)
            if cost is None:
                if len(self._step_costs) >= STEP_COST_CACHE:
                    self._step_costs.clear()
                cost = self._step_costs[key] = float(self._step_cost_ms(num_reqs, tokens, drafting, sampling))
            return cost
        return self._step_cost_ms(num_reqs, tokens, drafting, sampling)

    def budget_costs_ms(self, num_reqs: int, base_tokens: int, num_slots: int, per_slot: float = 1.0,
                        sampling: bool = False) -> np.ndarray:
        """Cost of a drafting step verifying 0, 1, ..., ``num_slots`` draft slots beside ``base_tokens`` other
        batch tokens, each slot ``per_slot`` tokens (a sampled probe's stand for several): ``step_cost_ms(num_reqs,
        base_tokens + per_slot * arange(num_slots + 1), sampling=sampling)``, read-only, cached per argument set.

        :func:`~dspark_cli.core.capacity.choose_budget` prices every budget of every drafting step, and at a steady
        load its arguments repeat: evaluated afresh, the table was the larger share of the plan's host time.
        """
        key = (int(num_reqs), int(base_tokens), int(num_slots), float(per_slot), bool(sampling))
        table = self._budget_costs.get(key)
        if table is None:
            if len(self._budget_costs) >= BUDGET_COST_CACHE:
                self._budget_costs.clear()
            tokens = key[1] + key[3] * np.arange(key[2] + 1)
            table = np.asarray(self._step_cost_ms(key[0], tokens, True, key[4]), dtype=np.float64)
            table.setflags(write=False)
            self._budget_costs[key] = table
        return table

    def _step_cost_ms(self, num_reqs: Any, tokens: Any, drafting: bool, sampling: bool) -> Any:
        cost = self.verify_cost_ms(tokens) + self.overhead_ms
        if drafting:
            cost = cost + self.draft_cost_ms(num_reqs, sampling)
        return cost

    def steps_per_sec(self, num_reqs: Any, tokens: Any, drafting: bool = True, sampling: bool = False) -> Any:
        return 1000.0 / self.step_cost_ms(num_reqs, tokens, drafting, sampling)


def _sps_to_ms(points: Any, what: str, source: str, overhead_ms: float) -> tuple[tuple[int, float], ...]:
    """Turn ``[[tokens, steps_per_sec]]`` into a validated verify ``((tokens, ms), ...)`` (minus the step overhead).

    Every refusal quotes the steps/s the user wrote, not the milliseconds derived from them.
    """
    clean = _clean_sps_values(points, what, source)
    out = []
    for x, sps in clean:
        ms = 1000.0 / sps - overhead_ms
        if ms <= 0:
            raise _fail(source, f"{what} says {sps:g} steps/s at x={x}, a step of {1000.0 / sps:.4g} ms: faster than "
                                f"overhead_ms={overhead_ms:g} alone")
        out.append((x, ms))
    return _clean_points(out, what, source, require_rise=True, allow_empty=False, sps=dict(clean))


def _clean_sps_values(points: Any, what: str, source: str) -> list[tuple[int, float]]:
    """Check ``[[tokens, steps_per_sec], ...]`` point by point, in the user's own terms, before any conversion."""
    if not isinstance(points, list) or len(points) == 0:
        raise _fail(source, f"{what} is empty" if isinstance(points, list) else f"{what} must be a list")
    out: list[tuple[int, float]] = []
    by_x: dict[int, float] = {}
    for i, item in enumerate(points):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise _fail(source, f"{what}[{i}] must be a [tokens, steps_per_sec] pair, got {item!r}")
        x_raw, s = item
        if isinstance(x_raw, bool) or isinstance(s, bool):
            raise _fail(source, f"{what}[{i}] holds a boolean, expected numbers: {item!r}")
        if not isinstance(x_raw, numbers.Real) or not isinstance(s, numbers.Real):
            raise _fail(source, f"{what}[{i}] must hold numbers, got {item!r}")
        if not math.isfinite(x_raw) or x_raw != int(x_raw) or x_raw <= 0:
            raise _fail(source, f"{what}[{i}] has x={x_raw!r}; x must be a positive integer")
        if not math.isfinite(s):
            raise _fail(source, f"{what}[{i}] has a non-finite value {s!r}")
        if s <= 0:
            raise _fail(source, f"{what}[{i}] has a non-positive value {s!r}")
        x = int(x_raw)
        if x in by_x and by_x[x] != float(s):
            raise _fail(source, f"{what} lists x={x} twice with different values ({by_x[x]:g} and {s:g} steps/s)")
        s = float(s)
        by_x[x] = s
        out.append((x, s))
    return out


def _check_sps_agrees(obj: dict[str, Any], overhead_ms: float, source: str) -> None:
    """Refuse a file whose ``dspark_sps_curve`` is not ``1000 / (verify_curve_ms + overhead_ms)``.

    The full format prices from ``verify_curve_ms``, yet the seed's recipe presents ``dspark_sps_curve`` as the
    interface: a user who edits only that key would otherwise see the edit silently ignored. Called after
    ``verify_curve_ms`` validated, so its pairs are numbers with integer x and no conflicting duplicates.
    """
    what = "dspark_sps_curve and verify_curve_ms disagree"
    fix = ("edit verify_curve_ms to match (steps/s = 1000 / (verify ms + overhead_ms)), "
           "or delete verify_curve_ms so dspark_sps_curve is used")
    sps = dict(_clean_sps_values(obj["dspark_sps_curve"], "dspark_sps_curve", source))
    verify = {int(float(x)): float(y) for x, y in obj["verify_curve_ms"]}
    if set(sps) != set(verify):
        only_sps, only_verify = sorted(set(sps) - set(verify)), sorted(set(verify) - set(sps))
        where = "; ".join(
            f"x={', '.join(map(str, xs))} only in {key}"
            for xs, key in ((only_sps, "dspark_sps_curve"), (only_verify, "verify_curve_ms")) if xs
        )
        raise SpsCurveError(f"{source}: {what} on batch sizes ({where}); {fix}")
    for x in sorted(sps):
        implied = 1000.0 / (verify[x] + overhead_ms)
        if not math.isclose(sps[x], implied, rel_tol=SPS_AGREE_REL_TOL):
            # Enough digits that the two quoted numbers differ on screen (a small edit must not read "x vs x").
            digits = 6
            while digits < 17 and f"{sps[x]:.{digits}g}" == f"{implied:.{digits}g}":
                digits += 1
            raise SpsCurveError(
                f"{source}: {what}: dspark_sps_curve says {sps[x]:.{digits}g} steps/s at x={x} but verify_curve_ms "
                f"{verify[x]:g} ms + overhead_ms {overhead_ms:g} give {implied:.{digits}g} steps/s; {fix}"
            )
