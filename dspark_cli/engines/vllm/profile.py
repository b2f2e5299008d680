"""``dspark profile-sps --engine vllm``: measure vLLM's step cost per CUDA-graph capture size.

The engine is built with the *same* flags as ``dspark serve --engine vllm`` (so the captured graphs are the ones
serving will replay: varlen decode graphs for varlen, uniform ones for mask). Then, in every worker
(``LLM.collective_rpc``, by name: :class:`SpsProfileExtension` is vLLM's worker extension), whole dummy steps
run at every captured size (where they replay the FULL graphs) and at sizes above the capture limit, timed by
vLLM's own step timing (forward and drafter parts, CUDA events; medians of ``--replays``); the fixed per-step
overhead is a dummy step's wall time minus both. Rank 0's numbers become ``sps_curve.json`` (``core.sps.SpsCurve``).

Command line: ``python -m dspark_cli.engines.vllm.profile MODEL [vllm serve flags] [--output F]
[--replays N] [--warmup N]`` -- :func:`build_profile_command` writes it from ``dspark profile-sps`` args.
Runs only where vLLM runs (CUDA); the translation is CPU-tested.
"""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any

from dspark_cli.engines.vllm.contract import compiled_padding, dummy_draft_overflow, profile_sizes
from dspark_cli.engines.vllm.launcher import check_profile_graphs, plan_vllm_serve
from dspark_cli.errors import DsparkError

MODULE = "dspark_cli.engines.vllm.profile"
EXTENSION = f"{MODULE}.SpsProfileExtension"
PROFILE_FLAGS = {"--output": "sps_curve.json", "--replays": "20", "--warmup": "3"}
# How verify batches at captured sizes are laid out: vLLM's plain dummy step of n tokens, except at uniform
# graphs' sizes (below). On varlen graphs vLLM 0.33's _dummy_run builds its batch from the captured graph's
# descriptor, min(n, max_num_seqs) requests with the tokens spread evenly, whatever layout it was asked for: below
# max_num_seqs every request is one token reading its whole context, which prices verification per token up to
# ~4x above a served verify batch of n / (1 + K) requests (docs/PERFORMANCE.md section 8). Timing that shape
# needs a dummy batch built by hand, not done without a GPU to check it on.


def _split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    ours: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in PROFILE_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise DsparkError(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            ours[name] = value
        else:
            rest.append(argv[i])
        i += 1
    for flag in ("--replays", "--warmup"):
        if flag in ours and (not ours[flag].isdigit() or int(ours[flag]) < (1 if flag == "--replays" else 0)):
            raise DsparkError(f"{flag}: expected a {'positive' if flag == '--replays' else 'non-negative'} integer")
    return ours, rest


def build_profile_command(argv: list[str]) -> list[str]:
    """The exact profiler command for ``dspark profile-sps --engine vllm ARGV`` (dry run, tests).

    Engine flags are translated exactly as ``dspark serve --engine vllm`` translates them.
    """
    return profile_plan(argv)[0]


def profile_plan(argv: list[str]) -> tuple[list[str], list[str]]:
    """The profiler command and the launcher's warnings about its settings (those that will not act). Refused
    here, before vLLM loads a weight: flags that leave no FULL CUDA graphs to time, or pipeline stages."""
    ours, rest = _split(list(argv))
    if not rest or rest[0].startswith("-"):
        raise DsparkError("profile-sps --engine vllm needs the model first, as vllm serve does: "
                          "dspark profile-sps --engine vllm MODEL [vllm flags] --output sps_curve.json")
    plan = plan_vllm_serve(rest)
    check_profile_graphs(plan.argv)
    out = [sys.executable, "-m", MODULE, *plan.argv]  # what runs: the dry run prints the same interpreter
    for flag, default in PROFILE_FLAGS.items():
        out += [flag, ours.get(flag, default)]
    warnings = list(plan.warnings)
    if plan.settings is None:
        # Without adaptive verification vLLM captures plain speculative decoding's uniform 1 + K graphs, not the
        # varlen ones a capacity mode replays: the staircase would step at other sizes than serving's.
        warnings.append("no capacity mode: the profile times the CUDA graphs of plain speculative decoding; pass "
                        "--capacity-mode varlen (or mask) as the server will run, so the curve prices its graphs")
    return out, warnings


def check_profile_plugin(argv: list[str]) -> None:
    """With a capacity mode the profile runs our manager, which vLLM must load (as ``dspark serve`` checks)."""
    if plan_vllm_serve(list(_split(list(argv))[1])).settings is not None:
        from dspark_cli.engines.vllm.launcher import check_plugin_visible

        check_plugin_visible()


def run_vllm_profile(argv: list[str], *, dry_run: bool) -> int:
    cmd, warnings = profile_plan(argv)
    for warning in warnings:  # as dspark serve --engine vllm says them, before vLLM starts
        sys.stderr.write(f"warning: {warning}\n")
    if dry_run:
        sys.stdout.write(shlex.join(cmd) + "\n")
        return 0
    import os

    check_profile_plugin(argv)
    os.execv(cmd[0], cmd)
    return 0  # not reached


# ---------------------------------------------------------------------------------------------- in the workers


class SpsProfileExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``) so the profiler is called by name.

    vLLM's engine-core message bus serialises RPC arguments with msgpack and refuses a function unless
    pickling is switched on for the whole process (``VLLM_ALLOW_INSECURE_SERIALIZATION``); a method name
    travels as a string, and the worker already has the code.
    """

    def dspark_profile_sps(self, replays: int, warmup: int) -> dict[str, Any]:
        return profile_worker(self, replays, warmup)


def summarize_steps(
    samples: list[Any], walls: dict[int, list[float]], captured: list[int], max_num_reqs: int
) -> dict[str, Any]:
    """The curve's three parts from timed dummy steps (vLLM ``StepTimingSample`` records and wall times).

    * verify: the median forward time per target-token count (graph replays at captured sizes, piecewise or
      eager steps above them);
    * draft: the median drafter time per request count, from FULL-graph steps when there are any (the
      serving manager's split, :func:`~dspark_cli.engines.vllm.manager.step_sample_points`);
    * overhead: a step's wall time minus its forward and drafter parts, at the smallest captured sizes
      (where the forward is cheapest and the fixed cost shows most).
    """
    import numpy as np

    from dspark_cli.engines.vllm.manager import median_points, step_sample_points

    verify_points, draft_points, from_full_graphs = step_sample_points(samples)
    fwd_med, drf_med = dict(median_points(verify_points)), dict(median_points(draft_points))
    # The draft pass each timed step ran is the one at that step's own request count: min(n, max_num_reqs) for
    # a plain dummy step of n tokens, n / (1 + k) for mask mode's uniform ones. Looked up as min(n, ...) alone,
    # a uniform step's draft was missing and its whole pass landed in the overhead, charged to every step.
    reqs_at: dict[int, int] = {}
    for sample in samples:
        reqs_at.setdefault(int(sample.num_target_tokens), int(sample.num_reqs))
    keys = sorted(drf_med)

    def draft_at(reqs: int) -> float:
        return float(np.interp(reqs, keys, [drf_med[x] for x in keys])) if keys else 0.0

    overheads = []
    for n in captured[: min(3, len(captured))]:
        if n in walls and n in fwd_med:
            overheads.append(float(np.median(walls[n])) - fwd_med[n] - draft_at(reqs_at.get(n, min(n, max_num_reqs))))
    return {
        "verify_ms": sorted(fwd_med.items()),
        "draft_ms": sorted(drf_med.items()),
        "overhead_ms": max(0.0, float(np.median(overheads))) if overheads else 0.0,
        "capture_sizes": captured,
        "draft_source": "dummy steps, FULL-graph target" if from_full_graphs else "dummy steps (eager target)",
    }


def profile_worker(worker: Any, replays: int, warmup: int, context_len: int = 4096) -> dict[str, Any]:
    """Runs inside each vLLM worker: whole dummy steps at every captured size and above, timed by vLLM.

    A captured FULL graph is never replayed on its own: it reads the attention metadata staged for the last
    batch that ran, and a replay over another batch's buffers reads out of bounds (an illegal memory access
    on the H200). ``_dummy_run`` stages each size's metadata the way vLLM's own start-up profile does and
    then replays the graph, so the forward time of a dummy step at a captured size is the graph replay.
    """
    import torch

    runner = worker.model_runner
    captured = sorted({
        int(desc.num_tokens)
        for desc in runner.cudagraph_manager.graphs
        if not getattr(desc, "num_active_loras", 0) and getattr(desc, "num_ubatches", 1) == 1
    })
    budget = int(runner.max_num_tokens)
    # Varlen graphs take a dummy step of n tokens as it comes (min(n, max_num_reqs) requests); mask mode's
    # FULL_DECODE_ONLY graphs are keyed by a uniform 1 + k tokens per request, so a plain dummy step would
    # run eagerly beside them: ask for a uniform decode batch at their sizes.
    uniform = not getattr(runner.cudagraph_manager, "varlen_decode", True)
    query_len = int(getattr(runner, "decode_query_len", 1) or 1)
    max_reqs = int(runner.max_num_reqs)
    # A draft_model speculator's prefill adds a slot per request, which a padded dummy step can push past the
    # budget where torch.compile's range for the draft ends: vLLM stops on it ("Shape: 257 out of considered
    # ranges", docs/PERFORMANCE.md section 38). Such sizes are left out, and said so.
    speculator = getattr(runner, "speculator", None)
    extra = int(getattr(speculator, "num_extra_query_per_req", 0) or 0) if speculator is not None else 0
    padded_to = compiled_padding(getattr(runner, "compilation_config", None), captured)
    if padded_to is None:
        extra = 0  # only torch.compile's ranges end at the budget

    def is_uniform(n: int) -> bool:
        # n / (1 + k) requests must fit the batch: FULL mixed graphs (no capacity mode, cudagraph_mode FULL) are
        # captured above max_num_seqs * (1 + k), where a uniform step would ask for more requests than vLLM holds
        return uniform and n in captured and n % query_len == 0 and n // query_len <= max_reqs

    def overflows(n: int) -> bool:
        if is_uniform(n):  # a uniform decode batch is not trimmed: n tokens and n / (1 + k) requests
            return extra > 0 and n + (n // query_len) * extra > budget
        return dummy_draft_overflow(n, padded_to or [], max_reqs, budget, extra) is not None

    sizes = profile_sizes(captured, budget)
    skipped = [n for n in sizes if overflows(n)]
    sizes = [n for n in sizes if n not in skipped]

    def step(n: int) -> None:
        if is_uniform(n):
            runner._dummy_run(n, uniform_decode=True, context_len=context_len)
        else:
            runner._dummy_run(n, context_len=context_len)

    for n in sizes:  # warm-up (and the tail's first compiles) outside the timed block
        for _ in range(warmup):
            step(n)
    cuda = torch.cuda.is_available()  # always in a vLLM worker; the CPU tests drive a stand-in runner
    walls: dict[int, list[float]] = {}
    with runner.step_timing.collect() as samples:
        for n in sizes:
            for _ in range(replays):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(n)
                if cuda:
                    torch.cuda.synchronize()
                walls.setdefault(n, []).append((time.perf_counter() - t0) * 1000.0)
    out = summarize_steps(list(samples), walls, captured, int(runner.max_num_reqs))
    out["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    out["context_len"] = context_len
    out["skipped_sizes"] = skipped
    return out


def main(argv: list[str] | None = None) -> int:
    """The profiler process: one clear line for what the user can fix (a flat curve, the extension slot)."""
    try:
        return _profile(argv)
    except DsparkError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1


def _profile(argv: list[str] | None) -> int:
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dspark_cli.core.sps import SpsCurve, monotone_fit

    ours, rest = _split(list(sys.argv[1:] if argv is None else argv))
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.add_argument("model_tag", nargs="?")
    ns = parser.parse_args(rest)
    if ns.model_tag:
        ns.model = ns.model_tag
    args = EngineArgs.from_cli_args(ns)
    if args.worker_extension_cls and args.worker_extension_cls != EXTENSION:
        raise DsparkError(f"profile-sps --engine vllm puts its profiler into vLLM's worker extension slot; "
                          f"drop --worker-extension-cls {args.worker_extension_cls} for the profile run")
    args.worker_extension_cls = EXTENSION
    llm = LLM(**{k: v for k, v in vars(args).items() if not k.startswith("_")})
    results = llm.collective_rpc("dspark_profile_sps", kwargs={
        "replays": int(ours.get("--replays", 20)), "warmup": int(ours.get("--warmup", 3))})
    r0 = results[0]
    spec = llm.llm_engine.vllm_config.speculative_config
    # Medians of a few replays per size still wobble (an 8B-shaped profile on the H200 measured the draft at
    # 6.8 ms for 2 requests and 5.0 ms for 24): fit them non-decreasing as the embedded profiler does, and
    # keep the raw medians in the file's meta.
    curve = SpsCurve.from_points(
        monotone_fit(r0["verify_ms"]), monotone_fit(r0["draft_ms"]), r0["overhead_ms"], r0["capture_sizes"],
        meta={"engine": "vllm", "model": args.model, "device": r0["device"], "draft_source": r0["draft_source"],
              "measured_verify_ms": r0["verify_ms"], "measured_draft_ms": r0["draft_ms"],
              "k": getattr(spec, "num_speculative_tokens", None), "context_len": r0.get("context_len"),
              "tensor_parallel_size": args.tensor_parallel_size, "command": shlex.join(sys.argv)},
        source="vLLM dummy steps (FULL graphs at captured sizes)",
    )
    out = ours.get("--output", PROFILE_FLAGS["--output"])
    curve.save(out)
    skipped = r0.get("skipped_sizes") or []
    print(f"wrote {out}: {len(curve.verify_ms)} verify points, {len(curve.draft_ms)} draft points, "
          f"overhead {curve.overhead_ms:.3f} ms"
          + (f"; left out {len(skipped)} sizes ({', '.join(map(str, skipped))}) whose dummy step would run the "
             f"draft past --max-num-batched-tokens" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
