"""End to end: a real `dspark serve` subprocess on a free port, spoken to over HTTP like any OpenAI client.

One server per module (startup dominates the cost). It runs the packaged tiny pair when present; otherwise a
random-weight Llama pair built here in a second (the server does not care what the weights say; the tests
only compare the server with itself: stream vs non-stream, with and without stop strings).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dspark_cli.bench.matrix import exit_with_parent
from dspark_cli.engines.embedded.metrics import parse_metrics

MAX_NUM_SEQS = 3
MAX_MODEL_LEN = 192
K = 3
TINY_TARGET = Path(__file__).resolve().parents[1] / "dspark_cli/engines/embedded/assets/tiny/target/config.json"


def _random_pair(out: Path) -> tuple[str, str]:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. 12 + 30 = 42."] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    torch.manual_seed(0)
    for name, layers in (("target", 2), ("draft", 1)):
        cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id, tie_word_embeddings=True)
        LlamaForCausalLM(cfg).save_pretrained(out / name)
        fast.save_pretrained(out / name)
    return str(out / "target"), str(out / "draft")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    model: str

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST with stream=true; return the decoded ``data:`` events ("[DONE]" kept as the string)."""
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        events: list[Any] = []
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            for raw in r.read().decode().split("\n\n"):
                if raw.strip():
                    assert raw.startswith("data: "), raw
                    payload = raw[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, body = self.get("/metrics")
        assert status == 200
        return parse_metrics(body.decode())

    def metric(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": self.name, "engine": "0", **labels}.items())))
        return self.metrics()[key]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc), to check that none outlives the server."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_server(tmp_path_factory: pytest.TempPathFactory, *extra: str) -> Server:
    """`dspark serve` on the tiny pair (or a random one) with this module's limits, plus ``extra`` flags.

    The server leads a session of its own, so ``stop_server`` can signal its whole process group as a
    terminal's Ctrl-C does."""
    if TINY_TARGET.is_file():
        model, draft = "tiny", "auto"
    else:
        model, draft = _random_pair(tmp_path_factory.mktemp("pair"))
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "dspark_cli.cli", "serve", "--model", model, "--draft", draft, "-k", str(K),
           "--port", str(port), "--device", "cpu", "--max-num-seqs", str(MAX_NUM_SEQS),
           "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--served-model-name", "test-model", *extra]
    with log.open("wb") as fh:
        # exit_with_parent: a killed test run leaves no server holding its port
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"},
                                start_new_session=True, preexec_fn=exit_with_parent())
    return Server(f"http://127.0.0.1:{port}", "test-model", proc, log, model)


def wait_healthy(srv: Server, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if srv.proc.poll() is not None:
            pytest.fail(f"dspark serve exited with {srv.proc.returncode}:\n{srv.log.read_text()}")
        try:
            if srv.get("/health")[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"dspark serve did not become healthy:\n{srv.log.read_text()}")
        time.sleep(0.3)


def stop_server(srv: Server) -> set[int]:
    """Ctrl-C to the server's process group; wait for it. Returns the processes it had started (all gone)."""
    children = descendants(srv.proc.pid) if srv.proc.poll() is None else set()
    if srv.proc.poll() is None:
        os.killpg(srv.proc.pid, signal.SIGINT)
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in children if process_alive(pid)]
    assert not left, f"processes left behind by dspark serve: {left}"
    return children


def _serving(tmp_path_factory: pytest.TempPathFactory, *args: str) -> Iterator[Server]:
    """A healthy server for a module's tests; it must shut down cleanly after them."""
    srv = start_server(tmp_path_factory, *args)
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop_server(srv)
    assert srv.proc.returncode == 0, srv.log.read_text()
    assert "ready" in srv.log.read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serving(tmp_path_factory)


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_models_and_health(server: Server) -> None:
    status, body = server.get("/v1/models")
    data = json.loads(body)
    assert status == 200 and data["object"] == "list"
    assert data["data"][0]["id"] == "test-model" and data["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert server.get("/health")[0] == 200


def test_completion_shape_usage_and_stream_equivalence(server: Server) -> None:
    body = {"model": "test-model", "prompt": "The quick brown", "max_tokens": 12, **GREEDY}
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == "test-model"
    assert isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12

    events = server.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_event = events[-2]
    assert usage_event["choices"] == [] and usage_event["usage"] == usage
    chunks = events[:-2]
    assert all(e["object"] == "text_completion" and e["id"] == chunks[0]["id"] for e in chunks)
    assert "".join(e["choices"][0]["text"] for e in chunks) == choice["text"]
    assert [e["choices"][0]["finish_reason"] for e in chunks][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])

    # the same prompt as token ids gives the same greedy text
    status, again = server.post("/v1/completions", {**body, "prompt": _prompt_ids(server, body["prompt"])})
    assert status == 200 and again["choices"][0]["text"] == choice["text"]


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids_as_vllm_does(server: Server) -> None:
    body = {"model": "test-model", "prompt": "The quick brown", "max_tokens": 12, **GREEDY, "return_token_ids": True}
    prompt = _prompt_ids(server, body["prompt"])
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == out["usage"]["completion_tokens"]
    # the ids are the output: sent back as a prompt after the original one, greedy continues from them
    events = server.stream("/v1/completions", body)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in e["choices"][0] for e in chunks[1:])
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
    status, chat = server.post("/v1/chat/completions", {"model": "test-model", "max_tokens": 5, **GREEDY,
                                                        "messages": [{"role": "user", "content": "hi"}],
                                                        "return_token_ids": True})
    assert status == 200 and len(chat["prompt_token_ids"]) > 0 and len(chat["choices"][0]["token_ids"]) == 5
    status, plain = server.post("/v1/completions", {**body, "return_token_ids": False})
    assert status == 200 and "token_ids" not in plain["choices"][0]


def test_batched_prompts_and_n_samples_are_choices_in_vllms_order(server: Server) -> None:
    """A list of prompts times n: one choice per (prompt, sample), indexed prompt by prompt; the j-th sample is
    seeded seed + j as vLLM seeds it; usage counts each prompt once; the stream carries the same choices."""
    prompts = ["The quick brown", "A lazy dog"]
    body = {"model": "test-model", "prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    texts = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        for j in range(2):  # each choice is the single request with its own seed
            single = server.post("/v1/completions", {**body, "prompt": prompt, "n": 1, "seed": 5 + j})[1]
            assert single["choices"][0]["text"] == texts[2 * i + j]
    prompt_tokens = sum(len(_prompt_ids(server, p)) for p in prompts)
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 32, "total_tokens": prompt_tokens + 32}
    events = server.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    streamed = ["", "", "", ""]
    for e in events[:-2]:
        (choice,) = e["choices"]
        streamed[choice["index"]] += choice["text"]
    assert streamed == texts and events[-2]["usage"] == out["usage"]
    status, chat = server.post("/v1/chat/completions", {"model": "test-model", "n": 3, "max_tokens": 4, **GREEDY,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and len({c["message"]["content"] for c in chat["choices"]}) == 1  # greedy: alike
    assert chat["usage"]["completion_tokens"] == 12
    _wait_idle(server)


def test_a_stop_token_id_is_counted_and_listed_but_not_spelled(server: Server) -> None:
    """As vLLM's detokenizer does: the token that stopped the request is in token_ids and usage, not the text."""
    body = {"model": "test-model", "prompt": "The quick brown", "max_tokens": 12, **GREEDY, "return_token_ids": True}
    full = server.post("/v1/completions", body)[1]["choices"][0]["token_ids"]
    at = next(i for i in range(1, len(full)) if full[i] not in full[:i])  # its first appearance ends the request
    status, out = server.post("/v1/completions", {**body, "stop_token_ids": [full[at]]})
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["token_ids"] == full[: at + 1] and out["usage"]["completion_tokens"] == at + 1
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == full[at]
    before = server.post("/v1/completions", {**body, "max_tokens": at})[1]["choices"][0]["text"]
    assert choice["text"] == before
    events = server.stream("/v1/completions", {**body, "stop_token_ids": [full[at]]})
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == before


def test_continuous_usage_counts_every_token_in_every_chunk(server: Server) -> None:
    body = {"model": "test-model", "prompt": "The quick brown", "max_tokens": 12, **GREEDY,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = server.stream("/v1/completions", body)
    chunks = [e for e in events[:-1] if e["choices"]]
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] >= 1
    # every chunk reports what was generated so far; no step is reported twice
    assert len(set(counts)) == len(counts)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12
    # chat opens with a role event of no token, as vLLM's: a client timing chunks by usage must not take it for
    # the first token's chunk (and the first token's own for a second chunk of none)
    chat = {"messages": [{"role": "user", "content": "The quick brown"}], "max_tokens": 12, **GREEDY,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = server.stream("/v1/chat/completions", chat)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["usage"]["completion_tokens"] == 0
    counts = [e["usage"]["completion_tokens"] for e in chunks[1:]]
    assert counts[0] >= 1 and len(set(counts)) == len(counts) and counts[-1] == 12


def _prompt_ids(server: Server, text: str) -> list[int]:
    """Tokenise like the server does for a string prompt, with the tokenizer of the model it serves."""
    from transformers import AutoTokenizer

    from dspark_cli.engines.embedded.config import EngineConfig
    from dspark_cli.engines.embedded.engine import resolve_checkpoints

    tok_dir = resolve_checkpoints(EngineConfig(model=server.model, draft=None)).tokenizer
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    return list(tok(text, add_special_tokens=True)["input_ids"])


def test_chat_non_stream_and_stream(server: Server) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]}],
            "max_completion_tokens": 10, **GREEDY}
    status, out = server.post("/v1/chat/completions", body)
    assert status == 200, out
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 10

    events = server.stream("/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert "usage" not in chunks[0]  # no include_usage -> no usage field at all
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    assert text == msg["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_text_and_finishes_with_stop(server: Server) -> None:
    body = {"prompt": "The lazy dog", "max_tokens": 40, **GREEDY}
    full = server.post("/v1/completions", body)[1]["choices"][0]["text"]
    assert len(full) >= 6, full
    stop = full[3:6]
    cut = full[: full.find(stop)]
    status, out = server.post("/v1/completions", {**body, "stop": [stop, "\x00never"]})
    assert status == 200
    assert out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["stop_reason"] == stop  # which stop fired, as vLLM says it
    assert out["usage"]["completion_tokens"] <= 40
    events = server.stream("/v1/completions", {**body, "stop": stop})
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == stop
    assert all(e["choices"][0]["stop_reason"] is None for e in chunks[:-1])
    # Finishing on a stop string frees the engine request and counts as vLLM's "stop", not "abort".
    _wait_idle(server)


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", {"max_tokens": 4}, "'prompt' is required"),
        ("/v1/completions", {"prompt": 5}, "'prompt' must be"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "'n' must be an integer in [1, 128]"),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 100}, "more than 128 choices"),
        ("/v1/completions", {"prompt": ["a", []]}, "'prompt' must be"),
        ("/v1/completions", {"prompt": ["ab", [1, 2]]}, "'prompt' must be a list of one kind"),
        # sample j of n is seeded seed + j: a seed that leaves no room for them is the seed's fault
        ("/v1/completions", {"prompt": "hi", "n": 2, "seed": 2**63 - 1}, "'seed' 9223372036854775807 leaves no room"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "'stream': true"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "tool_choice"),
        ("/v1/completions", {"prompt": "hi", "stop": [1]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 0}, "logprobs"),
        # fields vLLM honours: served without them, the output would not be what the client asked for
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "[0-9]+"}, "guided_regex"),
        ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": "hi", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ("/v1/completions", {"prompt": "hi", "skip_special_tokens": False}, "skip_special_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
         "add_generation_prompt"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": [10**9]}, "out of range"),
        ("/v1/completions", {"prompt": "hi " * 400, "max_tokens": 4}, "maximum context length"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "maximum context length"),
        ("/v1/chat/completions", {"max_tokens": 4}, "'messages' is required"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "content"),
        ("/v1/chat/completions", [1, 2], "JSON object"),
    ],
)
def test_bad_requests_get_openai_400(server: Server, path: str, body: Any, needle: str) -> None:
    status, out = server.post(path, body)
    assert status == 400, out
    err = out["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err
    assert "\n" not in err["message"]


def test_an_unknown_model_is_404_and_the_off_values_of_unsupported_fields_pass(server: Server) -> None:
    status, out = server.post("/v1/completions", {"prompt": "hi", "model": "gpt-4"})
    assert status == 404 and "does not exist" in out["error"]["message"]
    off = {"response_format": {"type": "text"}, "bad_words": [], "skip_special_tokens": True,
           "include_stop_str_in_output": False, "presence_penalty": 0, "logprobs": None}
    status, out = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, **GREEDY, **off})
    assert status == 200, out


def test_a_large_request_body_is_parsed_off_the_event_loop_and_served_alike(server: Server) -> None:
    """Bodies above PARSE_ON_LOOP_BYTES are parsed on a worker thread (a long prompt's tokenization would stall
    every stream): the answer is the same, a refusal included."""
    from dspark_cli.engines.embedded.server import PARSE_ON_LOOP_BYTES

    body = {"prompt": "The quick brown", "max_tokens": 4, **GREEDY}
    padded = json.dumps(body).encode()[:-1] + b" " * (PARSE_ON_LOOP_BYTES + 1) + b"}"
    small, large = server.post("/v1/completions", body), server.post("/v1/completions", padded)
    assert small[0] == large[0] == 200
    assert small[1]["choices"][0]["text"] == large[1]["choices"][0]["text"]
    too_long = {"prompt": "hi " * (PARSE_ON_LOOP_BYTES // 3 + 1), "max_tokens": 1}
    status, out = server.post("/v1/completions", too_long)
    assert status == 400 and "maximum context length" in out["error"]["message"]


def test_malformed_json_is_400(server: Server) -> None:
    status, out = server.post("/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in out["error"]["message"]


def test_metrics_counters_increase_with_vllm_names(server: Server) -> None:
    before = server.metrics()
    status, out = server.post("/v1/completions", {"prompt": "Count:", "max_tokens": 9, **GREEDY})
    assert status == 200
    after = server.metrics()
    lab = (("engine", "0"), ("model_name", "test-model"))

    def delta(name: str, labels: tuple[tuple[str, str], ...] = lab) -> float:
        return after[(name, labels)] - before[(name, labels)]

    assert delta("vllm:generation_tokens_total") == out["usage"]["completion_tokens"] == 9
    assert delta("vllm:prompt_tokens_total") == out["usage"]["prompt_tokens"]
    length = tuple(sorted({"model_name": "test-model", "engine": "0", "finished_reason": "length"}.items()))
    assert delta("vllm:request_success_total", length) == 1
    drafts = delta("vllm:spec_decode_num_drafts_total")
    assert drafts >= 1  # a draft model is loaded (k=3), so decode steps draft
    assert delta("vllm:spec_decode_num_draft_tokens_total") == K * drafts
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [after[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                      (("engine", "0"), ("model_name", "test-model"), ("position", str(i))))] for i in range(K)]
    assert 0 <= accepted <= K * drafts and sum(per_pos) == after[("vllm:spec_decode_num_accepted_tokens_total", lab)]
    assert per_pos == sorted(per_pos, reverse=True)  # acceptance at position i implies all before it
    status, body = server.get("/metrics")
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in body.decode()


def _wait_idle(server: Server, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        lab = (("engine", "0"), ("model_name", "test-model"))
        busy = m[("vllm:num_requests_running", lab)] + m[("vllm:num_requests_waiting", lab)]
        if busy == 0 and m[("vllm:kv_cache_usage_perc", lab)] == 0:
            return
        assert time.monotonic() < deadline, f"server still busy: {busy} requests, kv usage {m}"
        time.sleep(0.1)


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server: Server, n: int) -> None:
    """Every choice's engine request is aborted when the client goes away (n > 1: one per sample)."""
    # vLLM 0.33 counts no client abort among its successes (OutputProcessor.abort_requests); ours go to a
    # dspark: counter
    labels = (("engine", "0"), ("model_name", "test-model"))
    abort = tuple(sorted({"model_name": "test-model", "engine": "0", "finished_reason": "abort"}.items()))
    aborted_before = server.metrics()[("dspark:requests_aborted_total", labels)]
    success_before = server.metrics()[("vllm:request_success_total", abort)]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN - 20, "stream": True, "n": n,
                    **GREEDY}
            resp = await session.post(server.url + "/v1/completions", json=body)
            assert resp.status == 200
            got = 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    got += 1
                    if got >= 2:
                        break
            resp.close()  # drop the connection without reading the rest

    asyncio.run(run())
    _wait_idle(server)
    assert server.metrics()[("dspark:requests_aborted_total", labels)] == aborted_before + n
    assert server.metrics()[("vllm:request_success_total", abort)] == success_before


def test_a_client_that_leaves_after_its_last_choice_leaves_no_error_in_the_log(server: Server) -> None:
    """A client may close (even reset) the connection once it has read the finish of its last choice, before
    ``[DONE]``: the requests are done, so that is no error, and the server used to log a traceback for it."""
    import struct
    from urllib.parse import urlsplit

    url = urlsplit(server.url)
    body = json.dumps({"prompt": "The quick", "max_tokens": 3, "stream": True,
                         "stream_options": {"include_usage": True}, **GREEDY}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    before = server.log.read_text(errors="replace").count("Error handling request")
    for _ in range(20):
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(head + body)
            seen = b""
            while b'"finish_reason":"length"' not in seen:
                data = sock.recv(65536)
                assert data, seen[-500:]
                seen += data
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    _wait_idle(server)
    assert server.get("/health")[0] == 200
    assert server.log.read_text(errors="replace").count("Error handling request") == before


def test_requests_beyond_max_num_seqs_queue_and_all_complete(server: Server) -> None:
    n = 4 * MAX_NUM_SEQS

    async def one(session: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        body = {"prompt": f"Item {i}:", "max_tokens": 6 + i % 3, "temperature": 1.0, "seed": i, "ignore_eos": True}
        async with session.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            return await r.json()

    async def run() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(n)))

    results = asyncio.run(run())
    assert len({r["id"] for r in results}) == n
    for i, r in enumerate(results):
        assert r["usage"]["completion_tokens"] == 6 + i % 3
        assert r["choices"][0]["finish_reason"] == "length"
    _wait_idle(server)
    assert server.get("/health")[0] == 200


@pytest.fixture(scope="module")
def process_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serving(tmp_path_factory, "--engine-process")


REQUEST_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_prompt_tokens", "vllm:request_generation_tokens")


@pytest.mark.parametrize("front", ["thread", "process"])
def test_request_histograms_count_every_finished_request(request: pytest.FixtureRequest, front: str) -> None:
    srv: Server = request.getfixturevalue("server" if front == "thread" else "process_server")
    hist_labels = {"model_name": srv.name, "engine": "0"}

    def key(name: str, **extra: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted({**hist_labels, **extra}.items()))

    before = srv.metrics()
    usages: list[dict[str, int]] = []
    status, out = srv.post("/v1/completions", {"prompt": "The quick brown", "max_tokens": 10, **GREEDY})
    assert status == 200
    usages.append(out["usage"])
    events = srv.stream("/v1/completions", {"prompt": "Once upon", "max_tokens": 7, **GREEDY,
                                            "stream_options": {"include_usage": True}})
    usages.append(events[-2]["usage"])
    chat = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 6, **GREEDY}
    status, out = srv.post("/v1/chat/completions", chat)
    assert status == 200
    usages.append(out["usage"])
    events = srv.stream("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    usages.append(events[-2]["usage"])
    # finished by a stop string (the server's own finish): counted like any other, with the usage's tokens
    body = {"prompt": "The lazy dog", "max_tokens": 40, **GREEDY}
    full = srv.post("/v1/completions", body)[1]
    usages.append(full["usage"])
    status, out = srv.post("/v1/completions", {**body, "stop": full["choices"][0]["text"][3:6]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
    usages.append(out["usage"])
    _wait_idle(srv)
    after = srv.metrics()
    n = len(usages)

    def delta(k: tuple[str, tuple[tuple[str, str], ...]]) -> float:
        return after[k] - before.get(k, 0.0)

    finished = sum(delta(k) for k in after if k[0] == "vllm:request_success_total")
    assert finished == n
    for name in REQUEST_HISTOGRAMS:
        buckets = [v for k, v in after.items() if k[0] == name + "_bucket" and dict(k[1])["model_name"] == srv.name]
        assert buckets == sorted(buckets) and buckets[-1] == after[key(name + "_count")], name
        assert after[key(name + "_bucket", le="+Inf")] == after[key(name + "_count")]
        if name != "vllm:inter_token_latency_seconds":
            assert delta(key(name + "_count")) == n, name
    assert delta(key("vllm:request_generation_tokens_sum")) == sum(u["completion_tokens"] for u in usages)
    assert delta(key("vllm:request_prompt_tokens_sum")) == sum(u["prompt_tokens"] for u in usages)
    # token buckets: vLLM's 1-2-5 series up to max_model_len
    les = [dict(k[1])["le"] for k in after if k[0] == "vllm:request_prompt_tokens_bucket"]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    ttft = delta(key("vllm:time_to_first_token_seconds_sum"))
    e2e = delta(key("vllm:e2e_request_latency_seconds_sum"))
    assert 0 < ttft <= e2e
    assert delta(key("vllm:inter_token_latency_seconds_sum")) <= e2e
    # One inter-token latency per engine output after the first: a speculative step of up to K + 1 tokens is
    # one output, and an output carries at least one token (what the engine counted, stop-string surplus too).
    itl = delta(key("vllm:inter_token_latency_seconds_count"))
    engine_tokens = delta(("vllm:generation_tokens_total", (("engine", "0"), ("model_name", srv.name))))
    assert sum(-(-(u["completion_tokens"] - 1) // (K + 1)) for u in usages) <= itl <= engine_tokens - n
