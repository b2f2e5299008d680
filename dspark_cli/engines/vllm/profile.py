"""``dspark profile-sps --engine vllm``: measure vLLM's step cost per CUDA-graph capture size.

The engine is built with the *same* flags as ``dspark serve --engine vllm`` (so the captured graphs are the
ones serving will replay: varlen decode graphs for varlen, uniform ones for mask). Then, in every worker
(``LLM.collective_rpc``), each captured FULL target graph and each draft graph is replayed and timed with
CUDA events (median of ``--replays``); the fixed per-step overhead is a full dummy step's wall time minus
the replays it contains. Rank 0's numbers become ``sps_curve.json`` (``core.sps.SpsCurve``).

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


def profile_worker(worker: Any, replays: int, warmup: int) -> dict[str, Any]:
    """Runs inside each vLLM worker: time every captured FULL graph (target and draft) and the overhead."""
    import numpy as np
    import torch

    runner = worker.model_runner
    verify: dict[int, list[float]] = {}
    for desc, graph in list(runner.cudagraph_manager.graphs.items()):
        if getattr(desc, "num_active_loras", 0) or getattr(desc, "num_ubatches", 1) != 1:
            continue
        verify.setdefault(int(desc.num_tokens), []).append(_time_replays(graph.replay, replays, warmup))
    draft: dict[int, list[float]] = {}
    spec = runner.speculator
    manager = getattr(spec, "query_cudagraph_manager", None) or getattr(spec, "cudagraph_manager", None)
    for desc, graph in list(getattr(manager, "graphs", {}).items()):
        draft.setdefault(int(desc.num_reqs or desc.num_tokens), []).append(_time_replays(graph.replay, replays, warmup))
    verify_ms = sorted((k, float(np.median(v))) for k, v in verify.items())
    draft_ms = sorted((k, float(np.median(v))) for k, v in draft.items())
    # Overhead: a whole dummy step (host prepare + launches + sync) minus the graph time it replays.
    overheads = []
    draft_by_reqs = dict(draft_ms)
    for tokens, ms in verify_ms[: min(3, len(verify_ms))]:
        walls = []
        for _ in range(max(3, replays // 4)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner._dummy_run(tokens)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1000.0)
        reqs = min(tokens, runner.max_num_reqs)
        overheads.append(float(np.median(walls)) - ms - draft_by_reqs.get(reqs, 0.0))
    return {
        "verify_ms": verify_ms,
        "draft_ms": draft_ms,
        "overhead_ms": max(0.0, float(np.median(overheads))) if overheads else 0.0,
        "capture_sizes": sorted(verify),
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
    llm = LLM(**{k: v for k, v in vars(args).items() if not k.startswith("_")})
    results = llm.collective_rpc(profile_worker, kwargs={"replays": int(ours.get("--replays", 20)),
                                                         "warmup": int(ours.get("--warmup", 3))})
    r0 = results[0]
    spec = llm.llm_engine.vllm_config.speculative_config
    curve = SpsCurve.from_points(
        r0["verify_ms"], r0["draft_ms"], r0["overhead_ms"], r0["capture_sizes"],
        meta={"engine": "vllm", "model": args.model, "device": r0["device"],
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
