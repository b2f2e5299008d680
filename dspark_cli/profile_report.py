"""What ``dspark profile-sps`` shows of a curve: rich tables and a PNG of the verify staircase and draft cost.

The tables show the curve as the capacity manager will price it (after smoothing), next to the raw medians
when the profile recorded them in ``meta``, so a user can see how much the smoothing moved and whether the
curve actually rises -- the property everything downstream depends on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from dspark_cli.core.sps import SpsCurve
from dspark_cli.fileio import atomic_write_figure

__all__ = ["curve_tables", "plot_curve"]


def _measured(curve: SpsCurve, key: str) -> dict[int, float]:
    raw = curve.meta.get(key) or []
    try:
        return {int(x): float(y) for x, y in raw}
    except (TypeError, ValueError):
        return {}


def _regime(curve: SpsCurve, tokens: int) -> str:
    if not curve.capture_sizes:
        return "eager"
    return "graph" if tokens <= curve.capture_limit else "eager"


def curve_tables(curve: SpsCurve) -> list[Table]:
    """Verify table (tokens, regime, verify ms, measured ms, steps/s) and draft table (requests, draft ms,
    full-K step ms and steps/s)."""
    meta = curve.meta
    k = meta.get("k")
    title = " ".join(str(p) for p in (meta.get("engine"), meta.get("model"), meta.get("device"),
                                      f"K={k}" if k is not None else None) if p)
    raw_v = _measured(curve, "measured_verify_ms")
    verify = Table(title=f"verify cost ({title})" if title else "verify cost",
                   caption=f"steps/s = 1000 / (verify + overhead {curve.overhead_ms:.3f} ms), the seed's dspark_sps_curve")
    for col in ("tokens", "regime", "verify ms", "measured ms", "steps/s"):
        verify.add_column(col, justify="right")
    for tokens, ms in curve.verify_ms:
        raw = raw_v.get(tokens)
        verify.add_row(str(tokens), _regime(curve, tokens), f"{ms:.3f}", "-" if raw is None else f"{raw:.3f}",
                       f"{1000.0 / (ms + curve.overhead_ms):.1f}")
    tables = [verify]
    if curve.draft_ms:
        raw_d = _measured(curve, "measured_draft_ms")
        source = meta.get("overhead_source", "")
        caption = f"overhead {curve.overhead_ms:.3f} ms per step" + (f" ({source})" if source else "")
        by_reqs = meta.get("overhead_by_reqs_ms") or []
        if by_reqs:
            caption += "; measured at " + ", ".join(f"{int(r)} req: {float(v):.3f}" for r, v in by_reqs)
        draft = Table(title="draft cost", caption=caption)
        cols = ["requests", "draft ms", "measured ms"]
        sampling = dict(curve.draft_sampling_ms)
        if sampling:
            cols += ["sampling draft ms"]
        if isinstance(k, int) and k > 0:
            cols += [f"step ms (K={k})", "steps/s"]
        for col in cols:
            draft.add_column(col, justify="right")
        for reqs, ms in curve.draft_ms:
            raw = raw_d.get(reqs)
            row = [str(reqs), f"{ms:.3f}", "-" if raw is None else f"{raw:.3f}"]
            if sampling:
                row.append(f"{float(curve.draft_cost_ms(reqs, sampling=True)):.3f}")
            if isinstance(k, int) and k > 0:
                step = float(curve.step_cost_ms(reqs, reqs * (k + 1)))
                row += [f"{step:.3f}", f"{1000.0 / step:.1f}"]
            draft.add_row(*row)
        tables.append(draft)
    return tables


def _pyplot() -> Any:
    # Agg: no display on servers/CI; imported lazily so `dspark --help` stays fast.
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_curve(curve: SpsCurve, path: str | Path) -> Path:
    """PNG: verify cost as priced (staircase to the capture limit, interpolation beyond) with the measured
    points, and the draft cost vs requests. Written atomically."""
    import numpy as np

    plt = _pyplot()
    xs = [x for x, _ in curve.verify_ms]
    top = int(max(xs) * 1.1) + 1
    grid = np.arange(1, top + 1)
    fig, axes = plt.subplots(1, 2 if curve.draft_ms else 1, figsize=(11 if curve.draft_ms else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    ax.plot(grid, curve.verify_cost_ms(grid), drawstyle="steps-post" if curve.capture_sizes else "default",
            color="tab:blue", label="verify (as priced)")
    raw = _measured(curve, "measured_verify_ms")
    if raw:
        ax.plot(list(raw), list(raw.values()), "o", color="tab:orange", ms=4, label="measured median")
    else:
        ax.plot(xs, [y for _, y in curve.verify_ms], "o", color="tab:orange", ms=4, label="profiled point")
    if curve.capture_limit:
        ax.axvline(curve.capture_limit, color="grey", ls=":", label=f"capture limit {curve.capture_limit}")
    if curve.overhead_ms > 0:
        ax.axhline(curve.overhead_ms, color="tab:red", ls="--", lw=1, label=f"overhead {curve.overhead_ms:.2f} ms")
    ax.set_xlabel("verify batch tokens")
    ax.set_ylabel("ms")
    ax.set_title("target verify forward")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if curve.draft_ms:
        ax2 = axes[0][1]
        rx = [x for x, _ in curve.draft_ms]
        rgrid = np.arange(1, max(rx) + 1)
        ax2.plot(rgrid, curve.draft_cost_ms(rgrid), color="tab:green", label="draft, greedy (as priced)")
        if curve.draft_sampling_ms:
            ax2.plot(rgrid, curve.draft_cost_ms(rgrid, sampling=True), color="tab:purple",
                     label="draft, sampling (as priced)")
        raw_d = _measured(curve, "measured_draft_ms")
        pts = raw_d or dict(curve.draft_ms)
        ax2.plot(list(pts), list(pts.values()), "o", color="tab:orange", ms=4, label="measured median")
        ax2.set_xlabel("drafting requests")
        ax2.set_ylabel("ms")
        ax2.set_title("draft pass (K tokens)")
        ax2.set_ylim(bottom=0)
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    meta = curve.meta
    fig.suptitle(" / ".join(str(meta[key]) for key in ("engine", "model", "device", "dtype") if meta.get(key)) or "SPS curve",
                 fontsize=10)
    fig.tight_layout()
    out = atomic_write_figure(fig, path)
    plt.close(fig)
    return out
