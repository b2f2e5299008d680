"""Sequential Temperature Scaling (STS) of the confidence head: offline fit, online refit, ``sts.json``.

The scheduler needs absolute survival magnitudes (Θ adds them up), and raw heads are over-confident.
A per-position temperature ``T_k`` maps a raw probability to ``sigmoid(logit(c_k) / T_k)``; it preserves
order (AUC is unchanged) and only fixes magnitude.

Two fits, deliberately different:

* **Offline** (:func:`fit_sts`, the paper's STS): for k = 1..K left to right, pick ``T_k`` minimising the
  ECE of the *cumulative* survival ``prod_{i<=k} sigmoid(logit(c_i)/T_i)`` against "token k is inside
  the accepted prefix", earlier temperatures frozen. Fitting the product is what the scheduler consumes,
  and per-position errors compound geometrically along it. The cumulative label of position k is used
  exactly on rows where position k was verified (``k <= v``, :func:`cumulative_labels`): then it is
  ``k <= a`` -- a rejection before k makes it a known 0. Which rows qualify depends only on ``v``, which
  the engine fixed from confidences *before* verifying, so the selection cannot bias the label given the
  confidences, however the traces were pruned. Two tempting alternatives are biased:
  the SPEC's ``k <= min(a+1, v)`` (when the *conditional* label is known) keeps only rows whose prefix
  survived, fitting the product against a conditional rate; and adding rows with ``k > v`` whose
  rejection was observed (``a < v``, label surely 0) while rows with ``a == v`` stay unknown selects on
  the outcome itself -- every added label is 0, so survival past ``v`` is under-estimated (classic
  right-censoring; on uniformly pruned traces it drives T_3 from 2 to the top of the grid).
* **Online** (:class:`OnlineSTS`): decayed per-position counters of the *conditional* outcome -- position
  k is a trial iff ``k <= min(a+1, v)`` (it was tested with its prefix accepted), a hit iff ``k <= a`` --
  which is exactly what the head predicts. Calibrating each conditional factor calibrates the product
  without keeping per-row history on the device, so counters stay fixed-size, updates need no host
  sync, and a refit is a fixed-shape reduction. Censoring by what was verified keeps pruned slots
  (never tested) out of the counts.

Why online STS may also shift the logit (``sigmoid(logit(c_k) / T_k + b_k)``, ``b_k`` = 0 unless it pays):
a temperature keeps the logit's sign, so a head whose confidences all sit below 0.5 can never be
calibrated above 0.5 by any ``T``. That happens for real: a plain draft model's "confidence" is the
probability it gave its own token, which is small for flat distributions even when most drafts are
accepted, and a weightless draft against vLLM's synthetic acceptance gives ~1/vocabulary for every token
while 80% of first drafts pass. With ``T`` alone (grid top 20) the calibrated first position then stays
below 0.37 against a true 0.8, and the manager verified a fifth of what paid (a replay of such traces
under the Llama-3-8B H200 curve: 34% below verify-all at 16 requests). So a refit checks calibration in
the large: where a temperature's mean calibrated probability misses the position's hit rate by more than
noise (three binomial standard deviations, at least 0.02), it adds the shift that closes the gap (by
bisection). Each grid ``T`` is judged by ECE with the shift it would get, not alone: alone, a head whose
confidences say little while nearly every draft passes picks the smallest ``T``, which sends its negative
logits beyond any bounded shift. A head that temperature scaling already calibrates keeps ``b = 0`` -- a
free shift chosen by the same counts' ECE would chase noise and detune it -- and the order of confidences
(their AUC) never changes. The offline fit stays the paper's temperature-only STS.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from dspark_cli.errors import DsparkError
from dspark_cli.fileio import atomic_write_json, parse_non_finite_json

STS_VERSION = 1
PROB_EPS = 1e-6
GRID_MIN, GRID_MAX = 0.05, 20.0
# Fewer verified rows than this at a position and its fitted T is mostly noise: ECE compares per-bin
# sums over 20 bins, so 100 rows is ~5 a bin, and the observed rate of a bin's handful of rows still
# swings by 0.2 or more -- larger than the miscalibration the temperature is meant to correct.
MIN_TRUSTED_ROWS = 100


def default_grid() -> np.ndarray:
    """256 log-spaced temperatures in [0.05, 20] plus exactly 1.0 (so calibration can be a no-op)."""
    return np.unique(np.concatenate([np.geomspace(GRID_MIN, GRID_MAX, 256), [1.0]]))


def _grid_by_closeness_to_one(grid: np.ndarray | Sequence[float] | None) -> np.ndarray:
    g = default_grid() if grid is None else np.asarray(grid, dtype=np.float64).reshape(-1)
    if len(g) == 0 or not np.all(np.isfinite(g)) or np.any(g <= 0):
        raise DsparkError("STS temperature grid must be a non-empty list of finite positive numbers")
    # argmin returns the first minimum, so ordering by |log T| makes exact ECE ties prefer T nearest 1.
    return g[np.argsort(np.abs(np.log(g)), kind="stable")]


def _logit_np(c: np.ndarray) -> np.ndarray:
    c = np.clip(np.asarray(c, dtype=np.float64), PROB_EPS, 1.0 - PROB_EPS)
    return np.log(c) - np.log1p(-c)


def _sigmoid_np(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def ece(prob: np.ndarray, label: np.ndarray, bins: int = 20) -> float:
    """Expected calibration error with equal-width bins: sum_b |sum p - sum y| / n."""
    prob = np.asarray(prob, dtype=np.float64)
    if prob.size == 0:
        return float("nan")
    return float(_ece_grid(prob[None, :], np.asarray(label, dtype=np.float64), bins)[0])


def _ece_grid(prob: np.ndarray, label: np.ndarray, bins: int) -> np.ndarray:
    """ECE of each row of ``prob[G, n]`` against the shared ``label[n]`` (one bincount for all rows)."""
    g, n = prob.shape
    idx = np.minimum((prob * bins).astype(np.int64), bins - 1) + bins * np.arange(g)[:, None]
    diff = prob - label[None, :]
    sums = np.bincount(idx.reshape(-1), weights=diff.reshape(-1), minlength=g * bins).reshape(g, bins)
    return np.abs(sums).sum(axis=1) / n


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    """Mann-Whitney AUC with average ranks for ties; NaN when only one class is present."""
    pos = label.astype(bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    sorted_s = score[order]
    ranks = np.empty(len(score), dtype=np.float64)
    # Average rank per run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], len(score)]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _nan_to_none(values: Sequence[float]) -> list[float | None]:
    return [None if (v is None or not math.isfinite(v)) else float(v) for v in values]


@dataclass
class StsFit:
    """Result of :func:`fit_sts`: per-position temperatures and calibration metrics (NaN = no data)."""

    temperatures: list[float]
    ece_before: list[float]
    ece_after: list[float]
    auc: list[float]
    num_rows: int
    rows_per_position: list[int] = field(default_factory=list)
    bins: int = 20
    grid_bounds: tuple[float, float] = (GRID_MIN, GRID_MAX)  # the searched range; not written to sts.json
    # Per position: the ECE is as low at an end of the searched range as at the chosen T (not in sts.json).
    flat_to_edge: list[bool] = field(default_factory=list)

    def warnings(self, min_rows: int = MIN_TRUSTED_ROWS) -> list[str]:
        """One line per position whose temperature should not be trusted (too few rows, or at the grid's edge).

        An edge value -- or an ECE that is just as low all the way to an edge, as when every probability
        already saturates into the top bin -- means the data cannot pin T down (labels all alike, confidences
        all near 0 or 1, or a handful of rows): the real optimum may lie beyond the range, and the value is an
        artefact of the grid.
        """
        lo, hi = self.grid_bounds
        out: list[str] = []
        for j, t in enumerate(self.temperatures):
            n = self.rows_per_position[j] if j < len(self.rows_per_position) else 0
            if n == 0:
                out.append(f"position {j + 1}: no trace row verified this position, so T stays 1.0 (uncalibrated); "
                           "record traces in which the engine verifies this many drafts")
                continue
            why = []
            if math.isclose(t, lo) or math.isclose(t, hi):
                why.append(f"T={t:g} is at the edge of the searched range [{lo:g}, {hi:g}] (the best fit may lie "
                           "beyond it)")
            elif j < len(self.flat_to_edge) and self.flat_to_edge[j]:
                why.append(f"T={t:g} fits no better than the edge of the searched range [{lo:g}, {hi:g}] (the data "
                           "does not pin T down)")
            if n < min_rows:
                why.append(f"only {n} verified rows (fewer than {min_rows})")
            if why:
                out.append(f"position {j + 1}: " + "; ".join(why) + " -- do not trust this temperature: record more "
                           "traces with varied outcomes and re-run `dspark calibrate`")
        return out

    def to_dict(self) -> dict[str, Any]:
        temps = [float(t) for t in self.temperatures]
        return {
            "version": STS_VERSION,
            "temperatures": temps,
            "sts_temperatures": list(temps),
            "ece_before": _nan_to_none(self.ece_before),
            "ece_after": _nan_to_none(self.ece_after),
            "auc": _nan_to_none(self.auc),
            "num_rows": int(self.num_rows),
            "rows_per_position": [int(x) for x in self.rows_per_position],
            "bins": int(self.bins),
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        return atomic_write_json(path, self.to_dict())


def cumulative_labels(
    verified: np.ndarray, accepted: np.ndarray, num_positions: int
) -> tuple[np.ndarray, np.ndarray]:
    """``known[N, K]`` (position k verified: ``k <= v``) and ``label[N, K]`` (``k <= a``) of the cumulative
    event "token k is inside the accepted prefix"; see the module docstring for why only ``k <= v``."""
    v = np.asarray(verified, dtype=np.int64).reshape(-1, 1)
    a = np.asarray(accepted, dtype=np.int64).reshape(-1, 1)
    pos = np.arange(1, num_positions + 1)[None, :]
    return pos <= v, (pos <= a).astype(np.float64)


def cumulative_survival(conf: np.ndarray, temperatures: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """``prod_{i<=k} sigmoid(logit(c_i) / T_i)`` per row (raw probabilities, clamped, when no temperatures)."""
    conf = np.asarray(conf, dtype=np.float64)
    if temperatures is None:
        return np.cumprod(np.clip(conf, PROB_EPS, 1.0 - PROB_EPS), axis=-1)
    t = np.asarray(temperatures, dtype=np.float64)[: conf.shape[-1]]
    return np.cumprod(_sigmoid_np(_logit_np(conf) / t), axis=-1)


def fit_sts(
    conf: np.ndarray,
    verified: np.ndarray,
    accepted: np.ndarray,
    bins: int = 20,
    grid: np.ndarray | Sequence[float] | None = None,
) -> StsFit:
    """Offline sequential temperature scaling; see the module docstring for the labels used.

    ``conf[N, K]`` are raw head probabilities, ``verified[N]``/``accepted[N]`` the outcome counts
    (0 <= a <= v <= K). Positions with no observed rows keep T = 1.
    """
    conf = np.asarray(conf, dtype=np.float64)
    if conf.ndim != 2:
        raise DsparkError(f"STS fit needs confidences shaped [rows, positions], got {conf.shape}")
    n_rows, k_pos = conf.shape
    v = np.asarray(verified, dtype=np.int64).reshape(-1)
    a = np.asarray(accepted, dtype=np.int64).reshape(-1)
    if len(v) != n_rows or len(a) != n_rows:
        raise DsparkError("STS fit needs one verified and one accepted count per confidence row")
    if bins < 1:
        raise DsparkError(f"STS fit needs bins >= 1, got {bins}")
    impossible = (a < 0) | (a > v) | (v > k_pos)
    if impossible.any():  # labels no verify step can produce: the fit would calibrate against fiction
        i = int(np.flatnonzero(impossible)[0])
        raise DsparkError(f"STS fit needs 0 <= accepted <= verified <= K={k_pos} per row; {int(impossible.sum())} "
                          f"of {n_rows} rows break it (row {i}: verified={int(v[i])}, accepted={int(a[i])})")
    bad = ~np.isfinite(conf).all(axis=1)
    if bad.any():  # the trace reader refuses these; a direct caller gets the same one line, not a numpy error
        raise DsparkError(f"STS fit needs finite confidences; {int(bad.sum())} of {n_rows} rows hold NaN or "
                          "infinity (a draft head that overflowed): drop those rows")
    grid_sorted = _grid_by_closeness_to_one(grid)
    logits = _logit_np(conf)
    raw = np.clip(conf, PROB_EPS, 1.0 - PROB_EPS)
    pos = np.arange(1, k_pos + 1)
    known_cum, label_cum = cumulative_labels(v, a, k_pos)
    known_cond = pos[None, :] <= np.minimum(a + 1, v)[:, None]

    temps = np.ones(k_pos)
    ece_before = np.full(k_pos, np.nan)
    ece_after = np.full(k_pos, np.nan)
    auc = np.full(k_pos, np.nan)
    rows = np.zeros(k_pos, dtype=np.int64)
    flat = np.zeros(k_pos, dtype=bool)
    edges = np.flatnonzero((grid_sorted == grid_sorted.min()) | (grid_sorted == grid_sorted.max()))
    raw_cum = np.ones(n_rows)
    cal_cum = np.ones(n_rows)
    # Bound the [G, n] working set so a million-row fit stays within a few hundred MB.
    chunk = max(1, int(4_000_000 // max(1, n_rows)))
    for k in range(k_pos):
        raw_cum = raw_cum * raw[:, k]
        m = known_cum[:, k]
        rows[k] = int(m.sum())
        mc = known_cond[:, k]
        if mc.any():
            auc[k] = _auc(conf[mc, k], label_cum[mc, k])
        if rows[k] > 0:
            y = label_cum[m, k]
            prev = cal_cum[m]
            lk = logits[m, k]
            ece_before[k] = ece(raw_cum[m], y, bins)
            scores = np.empty(len(grid_sorted))
            for s in range(0, len(grid_sorted), chunk):
                t = grid_sorted[s : s + chunk]
                p = prev[None, :] * _sigmoid_np(lk[None, :] / t[:, None])
                scores[s : s + chunk] = _ece_grid(p, y, bins)
            temps[k] = grid_sorted[int(np.argmin(scores))]
            # ECE gaps below 1e-9 are float noise (saturated probabilities), not a better fit.
            flat[k] = bool(np.any(scores[edges] <= scores.min() + 1e-9))
        cal_cum = cal_cum * _sigmoid_np(logits[:, k] / temps[k])
        if rows[k] > 0:
            ece_after[k] = ece(cal_cum[m], label_cum[m, k], bins)
    return StsFit(
        temperatures=temps.tolist(),
        ece_before=ece_before.tolist(),
        ece_after=ece_after.tolist(),
        auc=auc.tolist(),
        num_rows=n_rows,
        rows_per_position=rows.tolist(),
        bins=bins,
        grid_bounds=(float(grid_sorted.min()), float(grid_sorted.max())),
        flat_to_edge=flat.tolist(),
    )


def load_sts(path: str | os.PathLike[str], num_positions: int | None = None) -> tuple[float, ...]:
    """Read per-position temperatures from ``sts.json`` (``temperatures`` or ``sts_temperatures``).

    With ``num_positions`` the table must cover that many positions; a longer table is cut to the first
    ``num_positions`` (positions mean the same thing whatever K the engine runs).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise DsparkError(f"{p}: is a folder, not an sts.json file; pass the file `dspark calibrate -o` wrote "
                          f"(e.g. {p / 'sts.json'})")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise DsparkError(f"{p}: cannot read STS temperatures ({exc.strerror or exc})") from None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise DsparkError(_non_finite_reason(p, data) or f"{p}: not valid JSON ({exc}); re-run `dspark calibrate`") \
            from None
    if not isinstance(obj, dict):
        raise DsparkError(f"{p}: expected a JSON object with a 'temperatures' list; re-run `dspark calibrate`")
    # A missing version is accepted: the seed and other tools write only the temperatures list, and version
    # 1 is the only format there has been. A different version is a format this build cannot know.
    version = obj.get("version", STS_VERSION)
    if isinstance(version, bool) or version != STS_VERSION:
        raise DsparkError(f"{p}: unsupported version {version!r} (this build reads version {STS_VERSION}); "
                          "re-run `dspark calibrate` with this build")
    a, b = obj.get("temperatures"), obj.get("sts_temperatures")
    if a is not None and b is not None and a != b:
        raise DsparkError(f"{p}: 'temperatures' and 'sts_temperatures' differ; keep one of them")
    temps = a if a is not None else b
    if not isinstance(temps, list) or len(temps) == 0:
        raise DsparkError(f"{p}: needs a non-empty 'temperatures' (or 'sts_temperatures') list")
    out = []
    for i, t in enumerate(temps):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise DsparkError(f"{p}: temperature {i + 1} is {t!r}; temperatures must be finite and > 0")
        out.append(float(t))
    if num_positions is not None:
        if len(out) < num_positions:
            raise DsparkError(
                f"{p}: has {len(out)} temperatures but {num_positions} draft positions need one each; "
                "re-run `dspark calibrate` with traces from this draft length"
            )
        out = out[:num_positions]
    return tuple(out)


def _non_finite_reason(p: Path, data: bytes) -> str | None:
    """The message for JSON that fails only because it holds NaN/Infinity (Python's json.dump writes them).

    orjson reports those as a bare "unexpected character"; the stdlib parser accepts them, so it tells
    this case apart from truly broken JSON and which entry is affected.
    """
    parsed = parse_non_finite_json(data)
    if parsed is None:  # really broken, or no non-finite number: the caller's message stands
        return None
    obj, found = parsed
    temps = obj.get("temperatures", obj.get("sts_temperatures")) if isinstance(obj, dict) else None
    bad = [i + 1 for i, t in enumerate(temps)
           if isinstance(t, float) and not math.isfinite(t)] if isinstance(temps, list) else []
    where = f"temperature {bad[0]} is {temps[bad[0] - 1]}" if bad else f"it holds {found[0]}"
    return (f"{p}: {where}, which JSON does not allow; temperatures must be finite numbers > 0 (and missing "
            "metrics null), re-run `dspark calibrate`")


def _logit_t(conf: torch.Tensor) -> torch.Tensor:
    c = conf.float().clamp(PROB_EPS, 1.0 - PROB_EPS)
    return torch.log(c) - torch.log1p(-c)


MAX_SHIFT = 12.0  # |b| bound: the logit range the counters bin; a hit rate of 0 or 1 has no finite shift
MIN_SHIFT_GAP = 0.02  # a calibration-in-the-large miss smaller than this is never worth a shift
BISECTION_STEPS = 16  # 24 / 2**16 of a logit: far below what an ECE bin can tell apart


def _mean_matching_shift(z: torch.Tensor, trials: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per candidate and position, the shift ``b`` with ``sum(trials * sigmoid(z + b)) = target``.

    ``z[C, K, bins]`` are scaled bin-mean logits. The left side rises monotonically in ``b``, so bisection
    over ``[-MAX_SHIFT, MAX_SHIFT]`` finds it in a fixed number of steps (no data-dependent loop, no host
    sync). Newton's method is faster but jumps between the bounds when the logits sit far out on the
    sigmoid's flat tails -- exactly the case the shift exists for. Returns ``[C, K, 1]``.
    """
    n = trials.unsqueeze(0)
    lo = torch.full_like(z[:, :, :1], -MAX_SHIFT)
    hi = torch.full_like(lo, MAX_SHIFT)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        below = (n * torch.sigmoid(z + mid)).sum(dim=2, keepdim=True) < target
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return 0.5 * (lo + hi)


def apply_temperatures(
    conf: torch.Tensor, temperatures: torch.Tensor, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """``sigmoid(logit(c) / T + b)`` per position (last dim; ``b`` = 0 without ``offsets``).

    Device-agnostic and capture-safe: a captured graph that calls it reads both buffers by address.
    """
    k = conf.shape[-1]
    t = temperatures[:k].to(device=conf.device, dtype=torch.float32)
    z = _logit_t(conf) / t
    if offsets is not None:
        z = z + offsets[:k].to(device=conf.device, dtype=torch.float32)
    return torch.sigmoid(z)


class OnlineSTS:
    """Per-position temperatures refitted online from the rejection sampler's own outcomes.

    Counters ``trials/hits/logit_sum[K, num_logit_bins]`` over fine bins of the raw logit are decayed by
    ``decay`` per :meth:`record` and filled with one-hot sums (no atomics: bitwise reproducible, so TP
    ranks fed the same outcomes agree). :meth:`refit` evaluates every grid temperature on the bin means
    at once (fixed shapes, no host sync), picks the one minimising trial-weighted ECE of the conditional
    calibrated probability (with the shift it would need, below), blends it toward the prior in log space
    with ``prior_weight`` pseudo-trials (``log T = (n log T_fit + w log T_prior) / (n + w)``, so a position
    with little data stays at its prior; without ``initial_temperatures`` a position's prior is its
    predecessor's fit, and a position with no data at all copies the last one with some), and writes
    ``temperatures`` in place -- captured graphs hold its address. ``offsets`` (the logit shift ``b_k``: 0 unless ``T`` alone misses the hit
    rate blended with the same pseudo-trials) is refitted and written the same way; why it exists, and the
    conditional per-position objective (vs the offline cumulative one), are explained in the module
    docstring.
    """

    def __init__(
        self,
        num_positions: int,
        device: torch.device | str = "cpu",
        decay: float = 0.999,
        refit_interval: int = 64,
        num_logit_bins: int = 64,
        ece_bins: int = 20,
        prior_weight: float = 64.0,
        initial_temperatures: Sequence[float] | torch.Tensor | None = None,
        logit_range: float = 12.0,
        grid: np.ndarray | Sequence[float] | None = None,
        fit_offsets: bool = True,
    ) -> None:
        if num_positions < 1:
            raise DsparkError("online STS needs num_positions >= 1")
        if not (0.0 < decay <= 1.0):
            raise DsparkError(f"online STS decay must be in (0, 1], got {decay}")
        if refit_interval < 1 or num_logit_bins < 2 or ece_bins < 1 or prior_weight < 0 or logit_range <= 0:
            raise DsparkError("online STS needs refit_interval >= 1, num_logit_bins >= 2, ece_bins >= 1, "
                              "prior_weight >= 0 and logit_range > 0")
        self.k = num_positions
        self.device = torch.device(device)
        self.decay = float(decay)
        self.refit_interval = refit_interval
        self.num_logit_bins = num_logit_bins
        self.ece_bins = ece_bins
        self.prior_weight = float(prior_weight)
        self.logit_range = float(logit_range)
        # Without given temperatures, a position's prior is its predecessor's fit (see refit).
        self.inherit_prior = initial_temperatures is None
        if initial_temperatures is None:
            prior = torch.ones(num_positions)
        else:
            prior = torch.as_tensor(initial_temperatures, dtype=torch.float32).reshape(-1).cpu()
            if len(prior) < num_positions or not torch.all(torch.isfinite(prior)) or torch.any(prior <= 0):
                raise DsparkError(f"online STS needs {num_positions} finite positive initial temperatures")
            prior = prior[:num_positions]
        self.prior = prior.to(self.device, torch.float32)
        self.temperatures = self.prior.clone()  # persistent: only ever updated with .copy_
        self.offsets = torch.zeros(num_positions, dtype=torch.float32, device=self.device)  # persistent too
        self.fit_offsets = bool(fit_offsets)
        self.grid = torch.as_tensor(_grid_by_closeness_to_one(grid), dtype=torch.float32, device=self.device)
        shape = (num_positions, num_logit_bins)
        self.trials = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.hits = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.logit_sum = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.last_ece = torch.zeros(num_positions, dtype=torch.float32, device=self.device)
        self._positions = torch.arange(1, num_positions + 1, device=self.device)
        edges = torch.linspace(-self.logit_range, self.logit_range, num_logit_bins + 1, device=self.device)
        self._centres = 0.5 * (edges[1:] + edges[:-1])
        self.steps = 0

    def record(
        self,
        conf_raw: torch.Tensor,
        verified: torch.Tensor,
        accepted: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Fold one step's outcomes into the counters (device only, no host sync).

        ``conf_raw[R, K]`` are the head's raw probabilities (before STS); position k (1-based) is a trial
        iff ``k <= min(a+1, v)`` and a hit iff ``k <= a``; rows with ``valid`` False are ignored, and so is a
        NaN confidence (a head that overflowed: it says nothing about calibration, and its bin index would be
        garbage -- on CUDA an out-of-range one-hot class, a device-side assert).
        """
        k = min(self.k, conf_raw.shape[-1])
        conf = conf_raw[:, :k].to(self.device)
        finite = ~torch.isnan(conf)
        logit = _logit_t(torch.nan_to_num(conf, nan=0.5))
        v = verified.to(self.device).long().unsqueeze(1)
        a = accepted.to(self.device).long().unsqueeze(1)
        pos = self._positions[:k].unsqueeze(0)
        trial = (pos <= torch.minimum(a + 1, v)) & finite
        hit = (pos <= a) & finite
        if valid is not None:
            ok = valid.to(self.device).bool().unsqueeze(1)
            trial = trial & ok
            hit = hit & ok
        scaled = (logit + self.logit_range) * (self.num_logit_bins / (2.0 * self.logit_range))
        idx = scaled.floor().clamp(0, self.num_logit_bins - 1).long()
        onehot = torch.nn.functional.one_hot(idx, self.num_logit_bins).float()  # [R, k, bins]
        tw = trial.float().unsqueeze(-1) * onehot
        self.trials.mul_(self.decay)
        self.hits.mul_(self.decay)
        self.logit_sum.mul_(self.decay)
        self.trials[:k].add_(tw.sum(0))
        self.hits[:k].add_((hit.float().unsqueeze(-1) * onehot).sum(0))
        self.logit_sum[:k].add_((tw * logit.unsqueeze(-1)).sum(0))

    def refit(self) -> torch.Tensor:
        """Refit every position's temperature (and shift) from the counters; write both in place."""
        trials, hits = self.trials, self.hits
        total = trials.sum(dim=1)  # [K]
        hit_sum = hits.sum(dim=1)
        mean_logit = torch.where(trials > 0, self.logit_sum / trials.clamp_min(1e-12), self._centres.unsqueeze(0))
        w = self.prior_weight
        # Prior of each position: the given temperature or -- without one -- the predecessor's current fit
        # (temperature and shift). Inheriting matters because verification is censored: a position the
        # manager never verifies gets no trials, so it would keep a prior that says "never verify me" (a
        # head with tiny raw confidences) and never be tested. Starting from its predecessor's calibration,
        # it is verified when that predicts it pays, and then learns its own. The current buffers (not this
        # refit's results) keep the refit one fixed-shape pass over all positions.
        zero = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.inherit_prior:
            t0 = torch.cat([self.prior[:1], self.temperatures[:-1]])
            b0 = torch.cat([zero, self.offsets[:-1]])
        else:
            t0, b0 = self.prior, torch.zeros_like(self.prior)
        # The hit rate the calibration must reproduce: the hits plus w pseudo-trials at the prior's own rate on
        # these logits. A shift is used only where a temperature alone misses it by more than noise (calibration
        # in the large): one more free parameter fitted to the same counts would otherwise chase noise and
        # detune heads that temperature scaling already calibrates.
        prior_hits = (trials * torch.sigmoid(mean_logit / t0.unsqueeze(1) + b0.unsqueeze(1))).sum(dim=1)
        rate = (hit_sum + w * prior_hits / total.clamp_min(1e-12)) / (total + w).clamp_min(1e-12)
        noise = torch.clamp(3.0 * torch.sqrt(rate * (1.0 - rate) / (total + w).clamp_min(1.0)), min=MIN_SHIFT_GAP)
        # Each grid temperature is judged with the shift it would get: judged alone, a head whose confidences say
        # little while nearly every draft passes picks the smallest T (it sends the positive logits to 1), and
        # no bounded shift then lifts the negative ones -- a sixth of the drafts calibrated below 0.01, all of
        # them accepted. A large T with its shift calibrates them all.
        z_g = mean_logit.unsqueeze(0) / self.grid.view(-1, 1, 1)  # [G, K, bins]
        if self.fit_offsets:
            z_g = z_g + self._shift_where_needed(z_g, rate, noise).unsqueeze(-1)
        ece_g = self._ece(z_g)  # [G, K]
        t_fit = self.grid[torch.argmin(ece_g, dim=0)]  # first minimum: the grid is ordered by closeness to T = 1
        log_t = (total * torch.log(t_fit) + w * torch.log(t0)) / (total + w).clamp_min(1e-12)
        new_t = torch.where(total > 0, torch.exp(log_t), t0)
        new_b = torch.where(total > 0, torch.zeros_like(b0), b0)
        if self.fit_offsets:
            # the blended temperature's own shift (the fit's where the data outweigh the prior)
            shift = self._shift_where_needed((mean_logit / new_t.unsqueeze(1)).unsqueeze(0), rate, noise)[0]
            new_b = torch.where(total > 0, shift, new_b)
        # A position with no outcomes at all takes the calibration (temperature and shift together) of the
        # last position before it that has some, in this same refit -- when there is no per-position prior.
        if self.inherit_prior:
            pos = torch.arange(self.k, device=self.device)
            last = torch.cummax(torch.where(total > 0, pos, torch.full_like(pos, -1)), dim=0).values
            fill = (total <= 0) & (last >= 0)
            src = last.clamp_min(0)
            new_t = torch.where(fill, new_t[src], new_t)
            new_b = torch.where(fill, new_b[src], new_b)
        final = self._ece((mean_logit / new_t.unsqueeze(1) + new_b.unsqueeze(1)).unsqueeze(0))[0]
        self.last_ece.copy_(final)
        self.temperatures.copy_(new_t)
        self.offsets.copy_(new_b)
        return self.temperatures

    def _shift_where_needed(self, z: torch.Tensor, rate: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Per candidate and position, the shift that brings the mean of ``sigmoid(z + b)`` to ``rate`` where
        ``b = 0`` misses it by more than ``noise``, else 0 (``z[C, K, bins]`` -> ``[C, K]``)."""
        total = self.trials.sum(dim=1)
        unshifted = (self.trials.unsqueeze(0) * torch.sigmoid(z)).sum(dim=2) / total.clamp_min(1e-12)
        needed = (total > 0) & ((unshifted - rate).abs() > noise)
        shift = _mean_matching_shift(z, self.trials, (rate * total).view(1, -1, 1))[..., 0]
        return torch.where(needed, shift, torch.zeros_like(shift))

    def _ece(self, z: torch.Tensor) -> torch.Tensor:
        """Trial-weighted ECE of ``sigmoid(z)`` per candidate and position (``z[C, K, bins]`` -> ``[C, K]``)."""
        p = torch.sigmoid(z)
        ebin = (p * self.ece_bins).long().clamp(0, self.ece_bins - 1)
        onehot = torch.nn.functional.one_hot(ebin, self.ece_bins).float()  # [C, K, bins, E]
        diff = (self.trials.unsqueeze(0) * p - self.hits.unsqueeze(0)).unsqueeze(-1) * onehot
        total = self.trials.sum(dim=1)
        return diff.sum(dim=2).abs().sum(dim=-1) / total.clamp_min(1e-12).unsqueeze(0)

    def step(self) -> bool:
        """Count a step; refit every ``refit_interval`` steps. Returns whether it refitted.

        Before the first regular refit it also refits at steps 8, 16, 32, ... : a head that starts far off
        (or a pause that depends on its calibration) should not wait a whole interval for its first fit;
        the prior's pseudo-trials keep those early fits from trusting a handful of outcomes.
        """
        self.steps += 1
        early = 8 <= self.steps < self.refit_interval and self.steps & (self.steps - 1) == 0
        if early or self.steps % self.refit_interval == 0:
            self.refit()
            return True
        return False

    def apply(self, conf: torch.Tensor) -> torch.Tensor:
        return apply_temperatures(conf, self.temperatures, self.offsets)
