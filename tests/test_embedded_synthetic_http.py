"""`dspark serve --draft synthetic:...` end to end: a real server process over HTTP, as a speed study runs it.

The packaged tiny target with a one-layer random draft in synthetic mode, varlen capacity management with a
steep curve (so drafts really are pruned), online STS and trace recording: completions come back full length,
/metrics counts drafted > verified >= accepted > 0, the start-up log says outputs are not the target's, and
the recorded traces calibrate.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dspark_cli.bench.matrix import ServerProcess, _free_port
from dspark_cli.calibrate import run_calibration
from dspark_cli.core.sps import SpsCurve
from dspark_cli.core.traces import read_traces
from dspark_cli.engines.embedded.metrics import parse_metrics

TINY = Path(__file__).resolve().parents[1] / "dspark_cli/engines/embedded/assets/tiny/target/config.json"
K = 4
MAX_TOKENS = 40

pytestmark = pytest.mark.skipif(not TINY.is_file(), reason="the packaged tiny pair is missing")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _counter(metrics: dict, name: str) -> float:
    return sum(v for (n, _labels), v in metrics.items() if n == name)


def test_serve_in_synthetic_mode_over_http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))  # the random draft's checkpoint folder
    curve = tmp_path / "steep_sps_curve.json"
    SpsCurve.from_points([(1, 1.0), (2, 1.6), (3, 2.2), (4, 2.8), (5, 3.4), (8, 5.0)], [(1, 0.3), (4, 0.4)],
                         0.1).save(curve)
    traces = tmp_path / "traces.jsonl"
    port = _free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "dspark_cli.cli", "serve", "--model", "tiny", "--device", "cpu", "--port", str(port),
           "--max-num-seqs", "4", "--max-model-len", "256", "--seed", "0", "-k", str(K),
           "--draft", "synthetic:first=0.9,decay=0.6,draft=random:small:layers=1",
           "--capacity-mode", "varlen", "--sps-curve", str(curve), "--online-sts", "--record-traces", str(traces),
           # the saturation policy judges measured step times: on a loaded host it may pause drafting for most
           # of the run, leaving too few traces to calibrate; this test is about pruning and traces, not pausing
           "--speculative-config", '{"dspark_saturation_patience": 0}']
    log = tmp_path / "server.log"
    with ServerProcess(cmd, log, f"http://127.0.0.1:{port}", timeout_s=180) as server:
        url = server.base_url
        for i in range(6):
            body = {"model": "tiny", "prompt": f"Question {i}: how many clips did Natalia sell?",
                    "max_tokens": MAX_TOKENS, "temperature": 0 if i % 2 else 1.0, "ignore_eos": True}
            out = _post(url + "/v1/completions", body)
            assert out["usage"]["completion_tokens"] == MAX_TOKENS
        chat = _post(url + "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 8})
        assert chat["choices"][0]["message"]["role"] == "assistant"
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = parse_metrics(r.read().decode())
    drafted = _counter(metrics, "vllm:spec_decode_num_draft_tokens_total")
    verified = _counter(metrics, "dspark:verified_draft_tokens_total")
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafted > verified >= accepted > 0, (drafted, verified, accepted)
    assert "speed-study mode, never for real outputs" in log.read_text()

    conf, v, a = read_traces([traces]).arrays()
    assert conf.shape[1] == K and len(v) > 20
    assert np.all(a <= v) and int(v.sum()) <= verified
    res = run_calibration([traces], tmp_path / "sts.json", bins=10)
    assert res.num_records == len(v) and res.fit.temperatures[0] > 1.0  # overconfident head: T > 1
