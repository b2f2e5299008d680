"""benchmarks/client_ceiling.py against its stand-in server: every request streams, paced by the step clock."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux /proc")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "client_ceiling.py"


def _load():
    spec = importlib.util.spec_from_file_location("client_ceiling", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["client_ceiling"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_a_paced_cell_completes_every_request_at_about_the_step_and_records_both_processes_cpu() -> None:
    row = _load().measure(concurrency=4, step_ms=20.0, tokens=8, waves=2)
    assert row["completed"] == 8 and row["offered_tok_s"] == pytest.approx(200.0)
    assert 0 < row["output_tok_s"] <= 200.0
    assert row["median_itl_ms"] == pytest.approx(20.0, rel=0.5)  # one chunk per step, not faster
    assert row["tokens_per_chunk"] == 1.0
    assert row["cpu"]["server_pid"] > 0 and row["cpu"]["server_share"] is not None
    assert row["cpu"]["client_share"] > 0
