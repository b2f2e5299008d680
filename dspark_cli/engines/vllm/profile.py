"""``dspark profile-sps --engine vllm``: measure vLLM's step cost per CUDA-graph capture size.

The engine is built with the *same* flags as ``dspark serve --engine vllm`` (so the captured graphs are the ones
serving will replay: varlen decode graphs for varlen, uniform ones for mask). Then, in every worker
(``LLM.collective_rpc``, by name: :class:`SpsProfileExtension` is vLLM's worker extension), each captured FULL
target graph and each draft graph is replayed and timed with CUDA events (median of ``--replays``); sizes above
the capture limit, and drafters that run eagerly (vLLM 0.33's ``draft_model``), are timed from whole dummy steps
with vLLM's own step timing (forward and drafter parts); the fixed per-step overhead is a dummy step's wall time
minus both. Rank 0's numbers become ``sps_curve.json`` (``core.sps.SpsCurve``).

Command line: ``python -m dspark_cli.engines.vllm.profile MODEL [vllm serve flags] [--output F]
[--replays N] [--warmup N]`` -- :func:`build_profile_command` writes it from ``dspark profile-sps`` args.
Runs only where vLLM runs (CUDA); the translation is CPU-tested.
"""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any

from dspark_cli.engines.vllm.launcher import plan_vllm_serve
from dspark_cli.errors import DsparkError

MODULE = "dspark_cli.engines.vllm.profile"
EXTENSION = f"{MODULE}.SpsProfileExtension"
PROFILE_FLAGS = {"--output": "sps_curve.json", "--replays": "20", "--warmup": "3"}


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
    ours, rest = _split(list(argv))
    if not rest or rest[0].startswith("-"):
        raise DsparkError("profile-sps --engine vllm needs the model first, as vllm serve does: "
                          "dspark profile-sps --engine vllm MODEL [vllm flags] --output sps_curve.json")
    plan = plan_vllm_serve(rest)
    out = ["python3", "-m", MODULE, *plan.argv]
    for flag, default in PROFILE_FLAGS.items():
        out += [flag, ours.get(flag, default)]
    return out


def run_vllm_profile(argv: list[str], *, dry_run: bool) -> int:
    cmd = build_profile_command(argv)
    if dry_run:
        sys.stdout.write(shlex.join(cmd) + "\n")
        return 0
    import os

    cmd[0] = sys.executable
    os.execv(cmd[0], cmd)
    return 0  # not reached


# ---------------------------------------------------------------------------------------------- in the workers


def _time_replays(replay: Any, replays: int, warmup: int) -> float:
    import numpy as np
    import torch

    for _ in range(warmup):
        replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def tail_sizes(capture_sizes: list[int], max_tokens: int) -> list[int]:
    """Verify sizes above the capture limit worth pricing: 1.5x the limit, then doubling to ``max_tokens``.

    Real steps run there (eagerly or piecewise) and a line through the graph points badly underprices them.
    """
    if not capture_sizes:
        return []
    limit = max(capture_sizes)
    sizes = {min(limit + limit // 2, max_tokens)}
    size = limit
    while size < max_tokens:
        size = min(2 * size, max_tokens)
        sizes.add(size)
    return sorted(s for s in sizes if s > limit)


class SpsProfileExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``) so the profiler is called by name.

    vLLM's engine-core message bus serialises RPC arguments with msgpack and refuses a function unless
    pickling is switched on for the whole process (``VLLM_ALLOW_INSECURE_SERIALIZATION``); a method name
    travels as a string, and the worker already has the code.
    """

    def dspark_profile_sps(self, replays: int, warmup: int) -> dict[str, Any]:
        return profile_worker(self, replays, warmup)


def profile_worker(worker: Any, replays: int, warmup: int, context_len: int = 4096) -> dict[str, Any]:
    """Runs inside each vLLM worker: the verify and draft cost per size, and the fixed per-step overhead.

    * verify: each captured FULL target graph replayed on its own (CUDA events, median); sizes above the
      capture limit from whole dummy steps (vLLM's own step timing: the forward part);
    * draft: each captured draft graph replayed, or -- for speculators that draft eagerly (``draft_model``
      in vLLM 0.33) -- the drafter part of whole dummy steps, per request count;
    * overhead: a whole dummy step's wall time minus its forward and drafter parts.
    """
    import numpy as np
    import torch

    runner = worker.model_runner
    verify: dict[int, list[float]] = {}
    for desc, graph in list(runner.cudagraph_manager.graphs.items()):
        if getattr(desc, "num_active_loras", 0) or getattr(desc, "num_ubatches", 1) != 1:
            continue
        verify.setdefault(int(desc.num_tokens), []).append(_time_replays(graph.replay, replays, warmup))
    captured = sorted(verify)
    draft: dict[int, list[float]] = {}
    spec = runner.speculator
    manager = getattr(spec, "query_cudagraph_manager", None) or getattr(spec, "cudagraph_manager", None)
    for desc, graph in list(getattr(manager, "graphs", {}).items()):
        draft.setdefault(int(desc.num_reqs or desc.num_tokens), []).append(_time_replays(graph.replay, replays, warmup))
    draft_from_graphs = bool(draft)

    # Whole dummy steps at every captured size and the tail: forward / drafter split and wall time.
    sizes = captured + tail_sizes(captured, int(runner.max_num_tokens))
    walls: dict[int, list[float]] = {}
    for n in sizes:  # warm-up (and the tail's first compiles) outside the timed block
        for _ in range(warmup):
            runner._dummy_run(n, context_len=context_len)
    with runner.step_timing.collect() as samples:
        for n in sizes:
            for _ in range(max(3, replays // 2)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner._dummy_run(n, context_len=context_len)
                torch.cuda.synchronize()
                walls.setdefault(n, []).append((time.perf_counter() - t0) * 1000.0)
    forward: dict[int, list[float]] = {}
    drafter: dict[int, list[float]] = {}
    for smp in samples:
        forward.setdefault(int(smp.num_target_tokens), []).append(float(smp.forward_ms))
        if smp.drafter_ms > 0:
            drafter.setdefault(int(smp.num_reqs), []).append(float(smp.drafter_ms))
    for n in sizes:
        if n not in verify and n in forward:
            verify[n] = [float(np.median(forward[n]))]
    if not draft_from_graphs:
        draft = {r: [float(np.median(v))] for r, v in drafter.items()}
    verify_ms = sorted((k, float(np.median(v))) for k, v in verify.items())
    draft_ms = sorted((k, float(np.median(v))) for k, v in draft.items())
    fwd_med = {n: float(np.median(v)) for n, v in forward.items()}
    drf_med = {r: float(np.median(v)) for r, v in drafter.items()}
    overheads = []
    for n in captured[: min(3, len(captured))]:
        if n in walls and n in fwd_med:
            reqs = min(n, runner.max_num_reqs)
            overheads.append(float(np.median(walls[n])) - fwd_med[n] - drf_med.get(reqs, 0.0))
    return {
        "verify_ms": verify_ms,
        "draft_ms": draft_ms,
        "overhead_ms": max(0.0, float(np.median(overheads))) if overheads else 0.0,
        "capture_sizes": captured,
        "draft_source": "graph replays" if draft_from_graphs else "dummy steps (eager drafter)",
        "device": torch.cuda.get_device_name(),
    }


def main(argv: list[str] | None = None) -> int:
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dspark_cli.core.sps import SpsCurve

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
    results = llm.collective_rpc("dspark_profile_sps", kwargs={"replays": int(ours.get("--replays", 20)),
                                                               "warmup": int(ours.get("--warmup", 3))})
    r0 = results[0]
    spec = llm.llm_engine.vllm_config.speculative_config
    curve = SpsCurve.from_points(
        r0["verify_ms"], r0["draft_ms"], r0["overhead_ms"], r0["capture_sizes"],
        meta={"engine": "vllm", "model": args.model, "device": r0["device"], "draft_source": r0["draft_source"],
              "k": getattr(spec, "num_speculative_tokens", None),
              "tensor_parallel_size": args.tensor_parallel_size, "command": shlex.join(sys.argv)},
        source="vLLM graph replays",
    )
    out = ours.get("--output", PROFILE_FLAGS["--output"])
    curve.save(out)
    print(f"wrote {out}: {len(curve.verify_ms)} verify points, {len(curve.draft_ms)} draft points, "
          f"overhead {curve.overhead_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
