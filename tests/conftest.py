"""Suite-wide settings.

Every model in this suite is tiny (hidden sizes of a few hundred, a handful of tokens per step), so intra-op
threads gain nothing, and on a busy two-core machine each parallel region waits for a descheduled thread:
a forward pass of the tiny pair measured 25x slower with two threads than with one. One thread per process
-- this one and every server or CLI subprocess the tests start (they inherit ``OMP_NUM_THREADS``) -- keeps
the suite's time low and predictable. An ``OMP_NUM_THREADS`` set by the caller wins.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after the variable: torch sizes its thread pool from it)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The tiny target/draft pair of ``test_embedded_engine.build_tiny_pair``, built once per session (read-only)."""
    from test_embedded_engine import build_tiny_pair

    return build_tiny_pair(Path(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def pair(tiny_pair):  # type: ignore[no-untyped-def]
    return tiny_pair
