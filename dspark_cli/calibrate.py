"""``dspark calibrate``: fit Sequential Temperature Scaling from recorded traces, write ``sts.json`` and
(with ``--plot``) a reliability diagram.

The fit itself is :func:`dspark_cli.core.sts.fit_sts` (the same code the engines' offline STS reads back);
this module reads traces from either engine, refuses input it cannot trust with ``file:line``, and draws
what a person checks before deploying temperatures: predicted cumulative survival against the observed
rate of "token k inside the accepted prefix", before and after, on the rows where that label is known.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_cli.core.sts import StsFit, cumulative_labels, cumulative_survival, fit_sts
from dspark_cli.core.traces import read_traces
from dspark_cli.errors import DsparkError
from dspark_cli.fileio import atomic_write_figure, check_figure_file, check_output_file

MAX_PLOTTED_POSITIONS = 4

# ECE bins a calibration may ask for: 20 is the usual; thousands already leave most bins empty.
MAX_BINS = 1000


@dataclass
class CalibrationResult:
    fit: StsFit
    output: Path
    plot: Path | None
    num_records: int
    skipped: int
    num_positions: int
    warnings: list[str] = field(default_factory=list)  # positions whose temperature is not to be trusted


def check_trace_folders(traces: Sequence[str | os.PathLike[str]]) -> None:
    """A folder argument is read for its own ``*.jsonl`` only (core/traces.py); say so when that finds none."""
    for item in traces:
        folder = Path(item)
        if not folder.is_dir() or any(folder.glob("*.jsonl")):
            continue
        nested = next(folder.rglob("*.jsonl"), None)
        if nested is not None:
            raise DsparkError(f"no *.jsonl files in {folder} (sub-folders are not searched); pass the files or "
                              f"their folder instead, e.g. {nested.parent}")
        raise DsparkError(f"no *.jsonl files in {folder}; record traces with `dspark serve --record-traces FILE`")


def _distinct_inputs(traces: Sequence[str | os.PathLike[str]], output: Path,
                     plot: Path | None) -> list[str | os.PathLike[str]]:
    """The trace inputs, each once; refuses an output that would overwrite one, or that a folder input would
    read as traces next time (a ``.jsonl`` written into it)."""
    dests = [(dest.resolve(), flag) for dest, flag in ((output, "-o/--output"), (plot, "--plot")) if dest is not None]
    seen: set[Path] = set()
    out: list[str | os.PathLike[str]] = []
    for item in traces:
        resolved = Path(item).resolve()
        for dest, flag in dests:
            if dest == resolved:
                raise DsparkError(f"{flag} {dest} is also a trace input; writing it would replace the traces: "
                                  "pass another path")
            if resolved.is_dir() and dest.parent == resolved and dest.suffix == ".jsonl":
                raise DsparkError(f"{flag} {dest} lies in the trace folder {item} with a .jsonl suffix, so the "
                                  "next calibration would read it as traces; write it elsewhere or as .json")
        if resolved not in seen:
            seen.add(resolved)
            out.append(item)
    return out


def plotted_positions(num_positions: int, limit: int = MAX_PLOTTED_POSITIONS) -> list[int]:
    """1-based positions to draw: all of them when few, else the first, the last and evenly between."""
    if num_positions <= limit:
        return list(range(1, num_positions + 1))
    picks = np.unique(np.round(np.linspace(1, num_positions, limit)).astype(int))
    return [int(p) for p in picks]


def reliability_curve(
    prob: np.ndarray, label: np.ndarray, bins: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width bin: mean predicted, observed rate and count (empty bins dropped)."""
    idx = np.minimum((prob * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins)
    psum = np.bincount(idx, weights=prob, minlength=bins)
    ysum = np.bincount(idx, weights=label, minlength=bins)
    keep = count > 0
    return psum[keep] / count[keep], ysum[keep] / count[keep], count[keep]


def plot_reliability(
    conf: np.ndarray,
    verified: np.ndarray,
    accepted: np.ndarray,
    fit: StsFit,
    path: str | os.PathLike[str],
    bins: int = 20,
) -> Path:
    """Reliability diagram of the cumulative survival per position, raw vs calibrated (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    k = conf.shape[1]
    known, label = cumulative_labels(verified, accepted, k)
    before = cumulative_survival(conf)
    after = cumulative_survival(conf, fit.temperatures)
    positions = plotted_positions(k)
    fig, axes = plt.subplots(1, len(positions), figsize=(3.6 * len(positions), 3.8), squeeze=False)
    for ax, pos in zip(axes[0], positions, strict=True):
        j = pos - 1
        m = known[:, j]
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
        if m.any():
            for probs, name, color, ece in ((before, "raw", "tab:red", fit.ece_before[j]),
                                            (after, f"STS T={fit.temperatures[j]:.2f}", "tab:blue",
                                             fit.ece_after[j])):
                x, y, n = reliability_curve(probs[m, j], label[m, j], bins)
                ax.plot(x, y, marker="o", markersize=3, color=color, label=f"{name} (ECE {ece:.3f})")
        else:
            ax.text(0.5, 0.5, "no verified rows", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"position {pos} ({int(m.sum())} rows)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted survival  prod c_i")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("observed: token k inside the accepted prefix")
    fig.suptitle("Reliability of the cumulative survival, before and after STS")
    fig.tight_layout()
    try:
        out = atomic_write_figure(fig, path)
    except OSError as exc:
        raise DsparkError(f"cannot write the reliability diagram {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out


def run_calibration(
    traces: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    plot: str | os.PathLike[str] | None = None,
    bins: int = 20,
    skip_invalid: bool = False,
) -> CalibrationResult:
    """Read traces, fit STS, write ``sts.json`` (atomic) and optionally the reliability diagram.

    An output that is one of the inputs, or a ``.jsonl`` inside an input folder (read as traces next time), is
    refused; an input given twice is read once.

    Both output paths are checked before the traces are read, so a bad ``-o``/``--plot`` costs no fit and
    never leaves one file written without the other. ``warnings`` lists the positions whose temperature
    the data could not pin down; the file is written all the same.
    """
    if not traces:
        raise DsparkError("no trace files given; pass TRACES.jsonl (recorded with `dspark serve --record-traces`)")
    if not 2 <= bins <= MAX_BINS:  # past it the fit's [grid, bins] table alone outgrows any memory
        raise DsparkError(f"--bins must be in 2..{MAX_BINS}, got {bins}")
    output = check_output_file(output, "-o/--output")  # as given: a trailing separator names a folder
    if plot is not None:
        plot = check_figure_file(plot, "--plot")
        if plot.resolve() == output.resolve():
            raise DsparkError(f"--plot and -o/--output are both {output}; give the diagram its own path")
    traces = [Path(t).expanduser() for t in traces]
    check_trace_folders(traces)
    traces = _distinct_inputs(traces, output, plot)
    ts = read_traces(list(traces), skip_invalid=skip_invalid)
    names = ", ".join(str(t) for t in traces)
    if not ts.records:
        extra = f" ({ts.skipped} invalid lines skipped)" if ts.skipped else ""
        raise DsparkError(f"no trace records in {names}{extra}; record some with `dspark serve --record-traces FILE`")
    conf, verified, accepted = ts.arrays()
    if not verified.any():
        raise DsparkError(f"no trace record in {names} verified any draft, so nothing can be calibrated; record "
                          "traces with drafts verified (e.g. --capacity-mode none)")
    fit = fit_sts(conf, verified, accepted, bins=bins)
    try:
        out = fit.save(output)
    except OSError as exc:
        raise DsparkError(f"cannot write {output}: {exc.strerror or exc}") from None
    try:
        plot_path = plot_reliability(conf, verified, accepted, fit, plot, bins) if plot is not None else None
    except KeyboardInterrupt:
        raise DsparkError(f"interrupted; {out} was written, the diagram {plot} was not") from None
    except DsparkError as exc:  # the diagram could not be written: the temperatures were
        raise DsparkError(f"{exc}; {out} was written") from None
    return CalibrationResult(fit, out, plot_path, len(ts.records), ts.skipped, conf.shape[1], fit.warnings())
