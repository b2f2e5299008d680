"""engines/vllm/models.py: the toolkit's model names as checkpoints vLLM 0.33 loads.

What vLLM gets must be plain Llama folders (no confidence head, no dspark_* keys, every other tensor
bit-identical), under a path from which vLLM reads no speculative method, served under the name the user gave;
paths and hub ids are the user's and pass through. The end-to-end test runs `dspark serve --engine vllm`
through a stand-in `vllm` CLI that checks what it was handed and serves it with the embedded engine over HTTP.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.engines.embedded import assets
from dspark_cli.engines.vllm import models
from dspark_cli.engines.vllm.contract import METHOD_PATH_MARKERS
from dspark_cli.errors import DsparkError


def test_plain_copy_drops_only_the_confidence_head_and_dspark_keys(tmp_path: Path) -> None:
    draft = assets.resolve_model("tiny").draft
    assert draft is not None
    src = assets._load_safetensors(draft)
    assert set(assets.CONFIDENCE_HEAD_KEYS) <= set(src)  # the tiny draft has a head to drop
    out = models.plain_llama_copy(draft, tmp_path / "draft")
    got = assets._load_safetensors(out)
    assert set(got) == set(src) - set(assets.CONFIDENCE_HEAD_KEYS)
    assert all(torch.equal(got[k], src[k]) for k in got)
    cfg = json.loads((out / "config.json").read_text())
    assert not [k for k in cfg if k.startswith("dspark_")]
    assert cfg["num_hidden_layers"] == json.loads((draft / "config.json").read_text())["num_hidden_layers"]
    assert models.plain_llama_copy(draft, tmp_path / "draft") == out  # kept, not rebuilt

    transformers = pytest.importorskip("transformers")
    _, info = transformers.LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info


def test_weights_with_nothing_to_drop_are_linked_not_rewritten(tmp_path: Path) -> None:
    target = assets.resolve_model("tiny", draft=None).target
    out = models.plain_llama_copy(target, tmp_path / "target")
    src_file, out_file = target / "model.safetensors", out / "model.safetensors"
    assert out_file.read_bytes() == src_file.read_bytes()
    if src_file.stat().st_dev == out_file.stat().st_dev:
        assert out_file.stat().st_ino == src_file.stat().st_ino


def test_a_toolkit_name_becomes_copies_served_under_that_name(tmp_path: Path) -> None:
    got = models.vllm_models("tiny", "auto", speculative=True, root=tmp_path / "vm")
    assert got.served_name == "tiny" and got.load_format is None and got.draft is not None
    for path in (got.model, got.draft):
        assert Path(path).parent == tmp_path / "vm" and models.method_marker(path) is None
        assert not [k for k in json.loads((Path(path) / "config.json").read_text()) if k.startswith("dspark_")]
        assert (Path(path) / "tokenizer.json").is_file()
    assert not set(assets.CONFIDENCE_HEAD_KEYS) & set(assets._load_safetensors(Path(got.draft)))
    stamp = (Path(got.draft) / "model.safetensors").stat().st_mtime_ns
    again = models.vllm_models("tiny", "auto", speculative=True, root=tmp_path / "vm")
    assert again == got and (Path(got.draft) / "model.safetensors").stat().st_mtime_ns == stamp  # kept
    # no draft count, no draft: vLLM serves the target alone
    plain = models.vllm_models("tiny", "auto", speculative=False, root=tmp_path / "vm")
    assert plain.draft is None and plain.model == got.model


def test_a_random_shape_is_weightless_and_loads_as_dummy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    got = models.vllm_models("random:llama-3-8b", "random:small:layers=1", speculative=True, root=tmp_path / "vm")
    assert got.load_format == "dummy" and got.served_name == "random:llama-3-8b"
    target, draft = (json.loads((Path(p) / "config.json").read_text()) for p in (got.model, got.draft))
    assert target["num_hidden_layers"] == 32 and draft["num_hidden_layers"] == 1
    assert target["vocab_size"] == draft["vocab_size"]
    assert not [k for k in {**target, **draft} if k.startswith("dspark_")]
    assert not list(Path(got.model).glob("*.safetensors")) and (Path(got.model) / "tokenizer.json").is_file()


def test_paths_and_hub_ids_pass_through_and_a_random_draft_needs_a_random_target(tmp_path: Path) -> None:
    assert models.vllm_models("org/model", "auto", speculative=True, root=tmp_path) == models.VllmModels("org/model", None)
    assert models.vllm_models("/ckpt/t", "/ckpt/d", speculative=True, root=tmp_path) == models.VllmModels("/ckpt/t", "/ckpt/d")
    with pytest.raises(DsparkError, match="needs a random target"):
        models.vllm_models("tiny", "random:small", speculative=True, root=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing copied for any of them


def test_a_copy_is_named_by_its_source_and_never_under_a_method_marker(tmp_path: Path) -> None:
    src = tmp_path / "src"
    models.plain_llama_copy(assets.resolve_model("tiny", draft=None).target, src)
    first = models._copy_dir(tmp_path / "vm", "target", "tiny", src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    second = models._copy_dir(tmp_path / "vm", "target", "tiny", src)
    assert second != first  # a rebuilt source, a new copy
    # so is a source whose chat template or stop ids changed: the copy carries both (vLLM reads them)
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    third = models._copy_dir(tmp_path / "vm", "target", "tiny", src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert len({second, third, models._copy_dir(tmp_path / "vm", "target", "tiny", src)}) == 3
    copied = models.plain_llama_copy(src, tmp_path / "copy")
    assert json.loads((copied / "generation_config.json").read_text()) == {"eos_token_id": [2, 5]}
    # a name holding a marker (a shape named by its config's path) is left out of the folder's name
    assert models.method_marker(models._copy_dir(tmp_path / "vm", "draft", "random:/x/dspark-shape.json", src)) is None
    for marker in METHOD_PATH_MARKERS:
        with pytest.raises(DsparkError, match="DSPARK_VLLM_MODELS"):
            models.vllm_models("tiny", "auto", speculative=True, root=tmp_path / f"x{marker}y")


def test_serve_dry_run_resolves_the_name_and_refuses_a_draft_count_without_a_draft(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_VLLM_MODELS", str(tmp_path / "vm"))
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "tiny", "-k", "4",
                                 "--capacity-mode", "varlen"])
    assert result.exit_code == 0, result.output
    cmd = shlex.split(result.stdout.strip().splitlines()[-1])
    assert cmd[:2] == ["vllm", "serve"] and Path(cmd[2]).parent == tmp_path / "vm"
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny" and "--load-format" not in cmd
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert Path(spec["model"]).parent == tmp_path / "vm" and spec["num_speculative_tokens"] == 4
    assert spec["enable_adaptive_verification"] is True
    assert not (tmp_path / "vm").exists()  # a dry run names the copies, and makes none
    # a checkpoint path with a draft count and no draft: vLLM 0.33 would stop "without speculative model"
    refused = runner.invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t", "-k", "4"])
    assert isinstance(refused.exception, DsparkError) and "--draft PATH" in str(refused.exception)
    ngram = runner.invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "/ckpt/t", "-k", "4",
                                "--speculative-config", '{"method": "ngram"}'])
    assert ngram.exit_code == 0, ngram.output
    # -k 0 (the bench's nospec column, after --serve-args' -k 7): no speculative config at all, which vLLM
    # takes for no speculation (it refuses one of 0 tokens), and no draft copied
    nospec = runner.invoke(app, ["serve", "--engine", "vllm", "--dry-run", "--model", "tiny", "-k", "7", "-k", "0"])
    assert nospec.exit_code == 0, nospec.output
    cmd = shlex.split(nospec.stdout.strip().splitlines()[-1])
    assert "--speculative-config" not in cmd and cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert "dspark: tiny: target " in nospec.stderr and ", draft " not in nospec.stderr


def test_serve_without_vllm_says_so_before_copying_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import shutil

    if shutil.which("vllm") is not None or importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    monkeypatch.setenv("DSPARK_VLLM_MODELS", str(tmp_path / "vm"))
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--model", "tiny", "-k", "3"])
    assert isinstance(result.exception, DsparkError) and "vLLM is not installed" in str(result.exception)
    assert not (tmp_path / "vm").exists()


def test_profile_dry_run_resolves_a_random_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_VLLM_MODELS", str(tmp_path / "vm"))
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["profile-sps", "--engine", "vllm", "random:llama-3-8b", "-k", "7", "--dry-run"])
    assert result.exit_code == 0, result.output
    cmd = shlex.split(result.stdout.strip().splitlines()[-1])
    assert Path(cmd[3]).parent == tmp_path / "vm" and cmd[cmd.index("--load-format") + 1] == "dummy"
    assert Path(json.loads(cmd[cmd.index("--speculative-config") + 1])["model"]).parent == tmp_path / "vm"


# A `vllm` CLI that checks what `dspark serve --engine vllm` handed it as vLLM 0.33 would read it, then serves
# those very folders with the embedded engine (no vLLM on a CPU).
_STAND_IN_VLLM = '''
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
assert argv[0] == "serve", argv
model, port, served = argv[1], argv[argv.index("--port") + 1], argv[argv.index("--served-model-name") + 1]
spec = json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else {}
assert spec.get("num_speculative_tokens", 1) > 0, spec  # vLLM refuses a speculative config of 0 tokens
draft = spec.get("model")
for path in filter(None, (model, draft)):
    assert not any(m in path.lower() for m in ("eagle-", "eagle3", "dflash", "dspark")), path
    assert not [k for k in json.loads((Path(path) / "config.json").read_text()) if k.startswith("dspark_")], path
print(f"stand-in vllm: serving {served} with {spec.get('num_speculative_tokens', 0)} speculative tokens", flush=True)
os.execvp(sys.executable, [sys.executable, "-m", "dspark_cli.cli", "serve", "--model", model, "--draft", draft or "none",
                           "-k", str(spec.get("num_speculative_tokens", 0)), "--device", "cpu", "--max-num-seqs", "2",
                           "--host", "127.0.0.1", "--port", port, "--served-model-name", served])
'''


def _stand_in_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process whose `vllm` is the stand-in CLI above, copies under tmp_path/vm."""
    pkg = tmp_path / "standin" / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (pkg.parents[1], pkg.parent, pkg):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(_STAND_IN_VLLM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "standin"), os.environ.get("PYTHONPATH", "")]),
           "DSPARK_VLLM_MODELS": str(tmp_path / "vm")}
    env.pop("VLLM_PLUGINS", None)
    return env


@pytest.mark.slow
def test_serve_engine_vllm_serves_the_copies_under_the_toolkit_name(tmp_path: Path) -> None:
    """`dspark serve --engine vllm --model tiny -k 3`, through a stand-in vLLM CLI: the copies serve over HTTP
    under "tiny", and greedy decoding from them matches the embedded engine's tiny pair token for token."""
    from test_server_e2e import Server, _free_port, stop_server, wait_healthy

    from dspark_cli.engines.embedded.config import EngineConfig
    from dspark_cli.engines.embedded.engine import LLMEngine
    from dspark_cli.engines.embedded.sequence import SamplingParams

    env = _stand_in_env(tmp_path)
    port = _free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dspark_cli.cli", "serve", "--engine", "vllm", "--model", "tiny",
                                 "-k", "3", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", "tiny", proc, log, "tiny")
    prompt = [1, 40, 41, 42, 43, 44]
    try:
        wait_healthy(srv)
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                    "temperature": 0, "ignore_eos": True})
    finally:
        stop_server(srv)
    assert status == 200, body
    served = body["choices"][0]["text"]
    text = log.read_text()
    assert "dspark: tiny: target " in text and "stand-in vllm: serving tiny with 3 speculative tokens" in text
    with LLMEngine(EngineConfig(model="tiny", num_speculative_tokens=0, device="cpu", max_num_seqs=2)) as engine:
        ids = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        expected = engine.tokenizer.decode(ids)
    assert served == expected


@pytest.mark.slow
def test_bench_serve_with_engine_vllm_runs_no_speculation_and_verify_all(tmp_path: Path) -> None:
    """`dspark bench --serve --serve-args "--engine vllm --model tiny -k 3"`: the nospec column's -k 0 reaches vLLM
    as no speculative config, verify-all's as the copied draft, and every cell is measured."""
    env = _stand_in_env(tmp_path)
    out = tmp_path / "bench"
    run = subprocess.run(
        [sys.executable, "-m", "dspark_cli.cli", "bench", "--serve", "--serve-args", "--engine vllm --model tiny -k 3",
         "--configs", "nospec,none", "-c", "1,2", "-n", "4", "--max-tokens", "8", "--warmup-prompts", "0",
         "-o", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logs = {name: (out / "logs" / f"{name}.log").read_text() for name in ("nospec", "none")}
    assert "stand-in vllm: serving tiny with 0 speculative tokens" in logs["nospec"], logs["nospec"]
    assert "stand-in vllm: serving tiny with 3 speculative tokens" in logs["none"], logs["none"]
    cells = [json.loads(p.read_text()) for p in (out / "cells").glob("*.json")]
    assert sorted((c["config"], c["concurrency"]) for c in cells) == [("none", 1), ("none", 2), ("nospec", 1),
                                                                        ("nospec", 2)]
    assert all(c["metrics"]["completed"] == 4 and c["metrics"]["failed"] == 0 for c in cells), cells
    # verify-all's server drafted (its speculative counters moved), no speculation's did not
    drafted = {c["config"]: (c["spec_decode"] or {}).get("num_draft_tokens", 0) for c in cells}
    assert drafted["none"] > 0 and drafted["nospec"] == 0, drafted
