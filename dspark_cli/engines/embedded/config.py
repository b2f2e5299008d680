"""Engine configuration: one dataclass the CLI, the server and the tests all build the engine from.

The keys mirror vLLM's (``num_speculative_tokens``, ``max_num_seqs``, ``max_model_len``, ``block_size``)
so a command line written for one engine reads the same for the other. Resolution of the "auto" values
(device, dtype, KV pool size) lives here too, so every component sees the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dspark_cli.core.capacity import CapacityConfig
from dspark_cli.engines.embedded.attention import BACKENDS
from dspark_cli.errors import DsparkError

if TYPE_CHECKING:
    from dspark_cli.engines.embedded.synthetic import SyntheticSpec

__all__ = ["PHASE_TIMINGS", "EngineConfig", "resolve_device", "resolve_dtype"]

PHASE_TIMINGS = ("host", "gpu", "device")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # checkpoint dir or an alias resolved by assets.resolve_model(...)
    # checkpoint dir | "auto" (the model's default draft) | "random:small" | None (no draft) |
    # "synthetic[:k=v,...]" (speed studies: drawn acceptance, a real draft run for its cost; see synthetic.py)
    draft: str | None = "auto"
    num_speculative_tokens: int = 4  # 0 = no speculation
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    sps_curve: str | None = None  # path to sps_curve.json | "auto" (profile at start-up) | None
    # The per-step overhead an "auto" curve prices (None: as profiled); a file's override is written into the
    # file the engine reads (serve_config).
    sps_overhead_ms: float | None = None
    sts: str | None = None  # sts.json (offline temperatures)
    online_sts: bool = False
    record_traces: str | None = None  # traces JSONL path
    max_num_seqs: int = 64
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    cuda_graphs: bool = True  # ignored on CPU
    # Prefill admission limit per step (tokens); None = max(max_model_len, 2048). Prefills are not
    # chunked, so a prompt may exceed it when it is the only one admitted in a step.
    max_num_batched_tokens: int | None = None
    # Fraction of free accelerator memory the KV pool may take when num_kv_blocks is None (CUDA only).
    gpu_memory_utilization: float = 0.5
    # Largest captured verify size; None = (K + 1) * max_num_seqs.
    max_capture_size: int | None = None
    # Captured verify sizes (CUDA graphs); None = powers of two up to the largest, plus the largest.
    capture_sizes: tuple[int, ...] | None = None
    # "auto" = on CUDA, FlashInfer (the pinned flashinfer-python, 16-bit models) or else the Triton kernel;
    # the torch path on CPU. "torch", "triton" or "flashinfer" force one (attention.get_backend).
    attention_backend: str = "auto"
    # While requests decode, newcomers wait up to this many times the recent prefill steps' time to share
    # one prefill step (scheduler.py); 0 (the default) prefills each arrival at once.
    scheduler_delay_factor: float = 0.0
    # Each step's time split into its phases (EngineStats.phase_ms, exported as step_phase_seconds): None
    # (off), "host" (host clock, no added sync: device time shows where the host waits for it, phase "sync"),
    # "gpu" (a CUDA event per phase, no sync: each phase's span of the device timeline) or "device" (a sync
    # per phase: every phase owns its device time, and the step is slower than a real one).
    phase_timing: str | None = None
    # A prefill also decodes one token for every running request in its forward, so newcomers stall nobody
    # (scheduler.py, LLMEngine._mixed_step); that step does not draft, and the draft catches up on the next
    # drafting step. On by default since docs/PERFORMANCE.md section 44: no speculation gained 2.4-2.6% from it
    # at 64 and 256 requests of an 8B-shaped target on an H100 (section 43: +1.0 / -0.3 / +2.1 / +3.6% at 16-256),
    # and a drafting server's split refills no longer stall every running request.
    mixed_prefill: bool = True

    def validate(self) -> None:
        """Reject impossible settings with one-line messages before anything is loaded."""
        if self.num_speculative_tokens < 0:
            raise DsparkError(f"num_speculative_tokens (-k) must be >= 0, got {self.num_speculative_tokens}")
        if self.max_num_seqs < 1:
            raise DsparkError(f"max_num_seqs (--max-num-seqs) must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise DsparkError(f"max_model_len (--max-model-len) must be >= 2, got {self.max_model_len}")
        if self.block_size < 1:
            raise DsparkError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise DsparkError(f"num_kv_blocks must be >= 2 (one is a reserved scratch block), got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise DsparkError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.capture_sizes is not None and (not self.capture_sizes or min(self.capture_sizes) < 1):
            raise DsparkError(f"capture_sizes must be positive token counts, got {list(self.capture_sizes)}")
        if not self.scheduler_delay_factor >= 0.0:
            raise DsparkError(f"scheduler_delay_factor (--scheduler-delay-factor) must be >= 0, got {self.scheduler_delay_factor}")
        if self.dtype not in ("auto", *_DTYPES):
            raise DsparkError(f"unknown dtype {self.dtype!r}; use auto, float32, bfloat16 or float16")
        if self.attention_backend not in BACKENDS:
            raise DsparkError(f"unknown attention backend {self.attention_backend!r}; use {', '.join(BACKENDS)}")
        if self.phase_timing is not None and self.phase_timing not in PHASE_TIMINGS:
            raise DsparkError(f"unknown phase timing {self.phase_timing!r}; use {', '.join(PHASE_TIMINGS)}")
        if self.capacity.mode not in ("none", "mask", "varlen"):
            raise DsparkError(f"unknown capacity mode {self.capacity.mode!r}; use none, mask or varlen")
        synthetic = self.synthetic
        if synthetic is not None:
            synthetic.base_probs(self.num_speculative_tokens)  # probs= must cover K

    @property
    def synthetic(self) -> SyntheticSpec | None:
        """The parsed ``synthetic:...`` draft spec, or None for a real draft; DsparkError when malformed.
        Imported here, not at module load: synthetic.py pulls in the model code."""
        from dspark_cli.engines.embedded.synthetic import is_synthetic, parse_synthetic

        return parse_synthetic(self.draft) if is_synthetic(self.draft) else None

    @property
    def batched_token_limit(self) -> int:
        return self.max_num_batched_tokens or max(self.max_model_len, 2048)


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA when present; an explicit "cuda" without a GPU is a user error, not a crash."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DsparkError(f"unknown device {name!r}; use auto, cpu or cuda") from exc
    if device.type not in ("cpu", "cuda"):
        raise DsparkError(f"device {name!r} is not supported by the embedded engine; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DsparkError(f"device {name!r} asked for but no CUDA device is available; use --device cpu")
    if device.index not in (None, 0):
        # Graph capture, CUDA events and Triton launches use the current device, which is GPU 0 of every thread
        # the engine runs on: another index would split one step's work across two GPUs.
        raise DsparkError(f"device {name!r}: the embedded engine runs on the first visible GPU; pick GPU "
                          f"{device.index} with CUDA_VISIBLE_DEVICES={device.index} and --device cuda")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """float32 on CPU (bit-stable greedy comparisons, fast enough for small models), bf16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]
