"""PNG plots of a bench matrix: throughput vs concurrency, and the Pareto front of aggregate vs per-user speed.

The Pareto plot is the one that answers "does pruning pay": a config is only better if it moves the front
(more aggregate tok/s at the same per-user tok/s, or the reverse), not if it wins one axis by losing the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_cli.bench.report import header
from dspark_cli.fileio import atomic_write_figure


def _pyplot():  # type: ignore[no-untyped-def]
    # Agg: no display on servers/CI; imported lazily so `dspark --help` stays fast.
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated on (x, y), both maximised, sorted by x ascending."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return sorted(front)


def _series(cells: Sequence[dict[str, Any]], configs: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    for c in cells:
        if c["config"] in out:
            out[c["config"]].append(c)
    for k in out:
        out[k].sort(key=lambda c: c["concurrency"])
    return out


PLOT_FILES = ("throughput.png", "pareto.png")  # what plot_matrix draws into a results folder


def plot_matrix(cells: Sequence[dict[str, Any]], configs: Sequence[str], out_dir: Path,
                title: str = "dspark bench") -> list[Path]:
    """Write throughput.png and pareto.png into ``out_dir``; returns the paths written."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    series = _series(cells, configs)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, cs in series.items():
        if cs:
            ax.plot([c["concurrency"] for c in cs], [c["metrics"]["output_tok_s"] for c in cs],
                    marker="o", label=header(k))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{title}: throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / PLOT_FILES[0])
    atomic_write_figure(fig, paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    all_points: list[tuple[float, float]] = []
    for k, cs in series.items():
        pts = [(c["metrics"].get("per_user_tok_s"), c["metrics"]["output_tok_s"], c["concurrency"]) for c in cs]
        pts = [p for p in pts if p[0] is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=header(k))
        for x, y, conc in pts:
            ax.annotate(f"c{conc}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        all_points += [(p[0], p[1]) for p in pts]
    front = pareto_front(all_points)
    if len(front) > 1:  # one point is no front: a step through it draws nothing, so leave it out of the legend
        ax.step([p[0] for p in front], [p[1] for p in front], where="pre", color="black", alpha=0.4,
                linestyle="--", label="Pareto front")
    ax.set_xlabel("per-user tok/s (1000 / median TPOT)")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title(f"{title}: aggregate vs per-user speed")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / PLOT_FILES[1])
    atomic_write_figure(fig, paths[-1])
    plt.close(fig)
    return paths
