"""Validation of the capacity manager's numeric settings, at the edge: one clear line saying what is wrong.

Shared by :class:`~dspark_cli.core.capacity.CapacityConfig` and the saturation policy's constructors, which
engines may build from settings of their own (vLLM's ``--additional-config``).
"""

from __future__ import annotations

import math
from typing import Any

from dspark_cli.errors import DsparkError


def check_float(name: str, value: Any, lo: float, hi: float) -> None:
    """A finite number in ``[lo, hi]`` (``hi`` may be ``math.inf``: then any finite number from ``lo``); bools
    refused."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not (lo <= value <= hi)):
        rng = f"[{lo}, {hi}]" if math.isfinite(hi) else f">= {lo} and finite"
        raise DsparkError(f"capacity setting {name} must be a number in {rng}, got {value!r}")


def check_probe_tax(value: Any) -> None:
    """The probe tax: a share of paused time in ``(0, 1]``."""
    check_float("probe_tax", value, 0.0, 1.0)
    if value == 0:
        raise DsparkError("capacity setting probe_tax must be > 0 (0 would never probe again after one probe)")


def check_int(name: str, value: Any, lo: int) -> None:
    """An integer from ``lo`` up; bools refused."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise DsparkError(f"capacity setting {name} must be an integer >= {lo}, got {value!r}")
