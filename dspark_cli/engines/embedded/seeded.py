"""Per-request seeded uniforms for a whole batch in one pass: a counter-based generator.

A request with ``seed`` draws its random numbers from its own stream, so the requests beside it never move
its draws. (Its tokens repeat whenever the engine takes the same drafting decisions for it -- always without
speculation. Speculative sampling is lossless in distribution, not draw for draw: a step that drafts uses a
request's draws differently from a plain step, and whether a step drafts depends on the load and on the
capacity manager's state.) A ``torch.Generator`` per request gives such streams, but drawing from R
generators is R small kernel launches (plus R copies into the batch tensor) per draw site, twice per
speculative step -- at 256 seeded requests that was milliseconds of host time per step, more than the
capacity manager's whole plan.

Counter-based generation needs no state on the device: the stream of request ``r`` is
``u(seed_r, i) = mix(seed_r, i)`` for draw index ``i``, so a batch of draws is one vectorised expression of
``(seed, offset + column)``. ``mix`` is SplitMix64's finaliser over a Weyl-sequence key (Steele, Lea and
Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014): every output bit depends on every
input bit, and distinct (seed, index) pairs give independent-looking draws. The top 24 bits become a float32
in [0, 1) exactly (24 bits is float32's mantissa), as ``torch.rand`` does.

torch's int64 arithmetic wraps on overflow on CPU and CUDA alike, which is what the mixing relies on; right
shifts are arithmetic there, so logical shifts mask the sign-extended bits off.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["counter_uniforms"]


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
# A second Weyl step separates seeds: key = seed * _SEED_MUL + index, so neighbouring seeds do not share
# shifted streams (seed s, index i+1 vs seed s+1, index i).
_SEED_MUL = _signed(0xD1B54A32D192ED03)


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: Tensor) -> Tensor:
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def counter_uniforms(seeds: Tensor, offsets: Tensor, n: int) -> Tensor:
    """``[S, n]`` float32 uniforms in [0, 1): row ``s`` holds draws ``offsets[s] .. offsets[s] + n - 1`` of the
    stream of ``seeds[s]`` (int64 tensors of shape ``[S]``, on the device the draws are wanted on)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    seeds = seeds.to(torch.int64)
    index = offsets.to(torch.int64).unsqueeze(1) + torch.arange(n, dtype=torch.int64, device=seeds.device)
    key = _mix(seeds.unsqueeze(1) * _SEED_MUL + index)
    return _shr(key, 40).to(torch.float32) * (1.0 / (1 << 24))
