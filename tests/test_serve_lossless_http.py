"""Lossless over HTTP: greedy outputs of `dspark serve` are token-identical across no speculation and the
capacity modes none, mask and varlen, with the packaged tiny pair (acceptance strictly between 0 and 1).

Each configuration is a real server process spoken to over HTTP, as a user would. The SPS curve is steep
(verifying a few more tokens costs a lot), so varlen really trims drafts, and mask (which prunes a dense
model's uniform batch only under a budget cap) gets one -- checked through /metrics -- so the equality is
not vacuous.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dspark_cli.bench.matrix import ServerProcess, _free_port
from dspark_cli.core.sps import SpsCurve
from dspark_cli.engines.embedded.metrics import parse_metrics

TINY = Path(__file__).resolve().parents[1] / "dspark_cli/engines/embedded/assets/tiny/target/config.json"
K = 4
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. How much more money does Betty need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
]

pytestmark = pytest.mark.skipif(not TINY.is_file(), reason="the packaged tiny pair is missing")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _complete(url: str, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == 48
    return out["choices"][0]["text"]


def _complete_until(url: str, prompt: str, stop: str) -> tuple[str, int, str | None]:
    """Text, completion tokens and stop_reason of a greedy request ended by a stop string."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stop": stop}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    return choice["text"], out["usage"]["completion_tokens"], choice["stop_reason"]


def _counter(metrics: dict, name: str) -> float:
    return sum(v for (n, _labels), v in metrics.items() if n == name)


def _server(args: list[str], log: Path) -> ServerProcess:
    """The same process handling `dspark bench --serve` uses: start, wait for /health, stop the group."""
    port = _free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "dspark_cli.cli", "serve", "--model", "tiny", "--device", "cpu", "--port", str(port),
           "--max-num-seqs", "4", "--max-model-len", "256", "--seed", "0", "--served-model-name", "tiny", *args]
    return ServerProcess(cmd, log, f"http://127.0.0.1:{port}", timeout_s=180)


def test_greedy_outputs_identical_across_capacity_modes_over_http(tmp_path: Path) -> None:
    curve = tmp_path / "steep_sps_curve.json"
    # Each extra verified token is expensive: only drafts with a high survival are worth verifying.
    SpsCurve.from_points([(1, 1.0), (2, 1.6), (3, 2.2), (4, 2.8), (5, 3.4), (8, 5.0)], [(1, 0.3), (4, 0.4)],
                         0.1).save(curve)
    # The saturation policy judges measured step times, so on a loaded host it may pause drafting for the
    # whole run and leave the pruned paths unexercised; never pausing keeps this test about pruning.
    never_pause = ["--speculative-config", '{"dspark_saturation_patience": 0}']
    configs = {
        "nospec": ["-k", "0"],
        "none": ["-k", str(K), "--capacity-mode", "none"],
        # a dense model's uniform batch saves nothing by pruning, so mask alone verifies whole batches; the
        # budget cap makes it prune, which is the layout path whose losslessness this checks
        "mask": ["-k", str(K), "--capacity-mode", "mask", "--sps-curve", str(curve), "--budget-frac", "0.5", *never_pause],
        # any predicted gain trims (the default margin keeps whole drafts for gains under 3%)
        "varlen": ["-k", str(K), "--capacity-mode", "varlen", "--sps-curve", str(curve), "--min-predicted-gain", "0",
                   *never_pause],
    }
    texts: dict[str, list[str]] = {}
    stopped: dict[str, list[tuple[str, int, str | None]]] = {}
    counters: dict[str, tuple[float, float, float]] = {}
    stops: list[str] = []
    for name, args in configs.items():
        with _server(args, tmp_path / f"{name}.log") as server:
            url = server.base_url
            texts[name] = [_complete(url, p) for p in PROMPTS]
            if not stops:  # a piece of each greedy output, from the middle: where a stop string cuts it
                stops = [t[len(t) // 2: len(t) // 2 + 3] for t in texts[name]]
            # A speculative step may accept tokens past the one that completes a stop string: usage counts
            # only the output's tokens, as decoding without speculation does.
            stopped[name] = [_complete_until(url, p, stop) for p, stop in zip(PROMPTS, stops, strict=True)]
            status, body = _get(url + "/metrics")
            assert status == 200
            m = parse_metrics(body.decode())
            counters[name] = (_counter(m, "vllm:spec_decode_num_draft_tokens_total"),
                              _counter(m, "dspark:verified_draft_tokens_total"),
                              _counter(m, "vllm:spec_decode_num_accepted_tokens_total"))

    for name in ("none", "mask", "varlen"):
        assert texts[name] == texts["nospec"], f"{name} differs from no speculation"
        assert stopped[name] == stopped["nospec"], f"{name}: a stop string's text, usage or stop_reason differs"
    assert all(reason == stop for (_, _, reason), stop in zip(stopped["nospec"], stops, strict=True))
    drafted, verified, accepted = counters["none"]
    assert drafted > 0 and verified == drafted
    assert 0 < accepted < drafted, "the tiny pair's acceptance must lie strictly between 0 and 1"
    for name in ("mask", "varlen"):
        drafted, verified, _ = counters[name]
        assert verified < drafted, f"{name} verified every draft: the equality above would be vacuous"
