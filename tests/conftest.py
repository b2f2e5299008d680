"""Suite-wide settings.

Every model in this suite is tiny (hidden sizes of a few hundred, a handful of tokens per step), so intra-op
threads gain nothing, and on a busy two-core machine each parallel region waits for a descheduled thread:
a forward pass of the tiny pair measured 25x slower with two threads than with one. One thread per process
-- this one and every server or CLI subprocess the tests start (they inherit ``OMP_NUM_THREADS``) -- keeps
the suite's time low and predictable. An ``OMP_NUM_THREADS`` set by the caller wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after the variable: torch sizes its thread pool from it)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
