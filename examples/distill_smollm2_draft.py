"""Distil a same-tokenizer DSpark draft (with confidence head) for SmolLM2-135M-Instruct on one GPU.

No draft model ships for SmolLM2 anywhere, so we grow one from the target itself:

1. data: the TARGET answers GSM8K questions (chat template, zero-shot and 5-shot prompts, as the benchmarks
   send them) greedily and at temperature 1, so the draft learns the distribution it will have to predict;
2. draft: the target's first L layers (default 4) + its final norm, with the target's embeddings and LM head
   shared and frozen (they are not stored: the packaged draft borrows them from the target at load time);
3. distillation: KL(target || draft) on the target-generated continuations, in bf16 autocast, time-boxed by
   ``--minutes``; the held-out agreement is checked every ``--eval-every`` seconds and the best state is kept;
4. confidence head: ``sigmoid(w . [h, log q(x), H(q)] + b)`` trained with BCE against
   c* = 1 - 0.5 * ||q - p_target||_1 (DSpark Eq. 8), jointly with the draft (on detached features) and then
   alone on the final draft;
5. evaluation on held-out questions: greedy agreement, and the mean acceptance length (tokens per step,
   bonus included) of simulated speculative decoding at k=4 and k=7, greedy and temperature 1 (lossless
   rejection sampling), with per-position acceptance and mean confidence;
6. output: the packaged draft format of ``dspark_cli/engines/embedded/assets.py`` (int8 per-output-channel
   layers, float32 norms and head, ``config.json``) in ``--out`` (<= 16 MB), plus ``metrics.json``. The draft is
   written as soon as training ends, before the evaluation, so a run cut short still leaves it behind.

The script needs only torch + transformers (+ the ``gguf`` package when reading a GGUF); it does not import
dspark. Inputs:

- ``--model``: a converted HF checkpoint dir, a ``.gguf`` file, or a directory holding a ``*.gguf`` or its
  ``*.gguf.part*`` pieces (concatenated in natural order). If ``gguf`` is not importable, a ``gguf*.zip`` /
  ``gguf*.whl`` found next to the model is put on ``sys.path`` (both are pure Python).
- ``--gsm8k``: a JSONL written by ``--prepare`` (rows with ready-made chat prompts).

Run ``--prepare DIR`` on a machine with dspark installed to write everything the GPU needs, in pieces small
enough to travel one per command (``DIR/part1`` holds the rows, the gguf package and the first GGUF piece).
``--smoke`` runs every stage with tiny sizes on the CPU (e.g. on the packaged tiny pair) to prove the code.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

PACKAGED_KEY = "dspark_packaged_draft"
PACKAGED_FORMAT_VERSION = 1
HEAD_FEATURES = ["final_hidden_normed", "log_q_token", "entropy_q"]
MAX_PACKAGED_BYTES = 16 * 1024 * 1024
# A GPU command carries the working tree (33 MB) and at most 64 MiB in all: a piece of 24 MiB leaves room for
# the GSM8K rows and the gguf package in the first directory (32 MiB pieces stopped fitting as the tree grew).
PART_BYTES = 24 * 1024 * 1024


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- inputs


def _natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def locate_model(src: Path, work: Path) -> tuple[str, Path]:
    """('hf', dir) or ('gguf', file); GGUF pieces are concatenated once into ``work``."""
    if src.is_file() and src.name.endswith(".gguf"):
        return "gguf", src
    if not src.is_dir():
        raise SystemExit(f"--model {src}: not a checkpoint dir, a .gguf file or a dir of GGUF pieces")
    if (src / "config.json").is_file():
        return "hf", src
    whole = sorted(src.glob("*.gguf"))
    if whole:
        return "gguf", whole[0]
    parts = sorted(src.glob("*.gguf.part*"), key=_natural_key)
    if not parts:
        raise SystemExit(f"--model {src}: no config.json, *.gguf or *.gguf.part* inside")
    name = parts[0].name.split(".gguf.part")[0] + ".gguf"
    out = work / "gguf" / name
    expected = sum(p.stat().st_size for p in parts)
    if not (out.is_file() and out.stat().st_size == expected):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as fh:
                    shutil.copyfileobj(fh, dst, 1 << 22)
        tmp.replace(out)
        log(f"joined {len(parts)} pieces -> {out} ({expected / 2**20:.1f} MiB)")
    return "gguf", out


def ensure_gguf_importable(search: list[Path], work: Path) -> None:
    """Make ``gguf`` importable *with* its distribution metadata (transformers checks the installed version).

    Must run before transformers is imported: transformers caches whether gguf is available. A ``gguf*.zip``
    written by ``--prepare`` holds the package and its dist-info; it is unpacked into ``work/site``.
    """
    import importlib.metadata
    import zipfile

    def available() -> bool:
        try:
            import gguf  # noqa: F401

            importlib.metadata.version("gguf")
            return True
        except (ImportError, importlib.metadata.PackageNotFoundError):
            return False

    if available():
        return
    site = work / "site"
    for folder in search:
        for cand in sorted(folder.glob("gguf*.zip")):
            with zipfile.ZipFile(cand) as zf:
                zf.extractall(site)
            sys.path.insert(0, str(site))
            importlib.invalidate_caches()
            sys.modules.pop("gguf", None)
            if available():
                log(f"using gguf {importlib.metadata.version('gguf')} from {cand}")
                return
    raise SystemExit("reading a GGUF needs the `gguf` package: pip install gguf, or put the gguf.zip that "
                     "--prepare writes next to the model")


def load_target(src: Path, work: Path, device: torch.device, dtype: torch.dtype):
    """The target (eval mode, frozen) and its tokenizer; a GGUF is converted once into ``work/converted``."""
    kind, path = locate_model(src, work)
    converted = work / "converted"
    if kind == "gguf" and not (converted / "config.json").is_file():
        ensure_gguf_importable([src if src.is_dir() else src.parent, path.parent], work)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if kind == "gguf":
        if not (converted / "config.json").is_file():
            # Same conversion as dspark_cli/engines/embedded/assets.py::convert_gguf: transformers' GGUF reader
            # directly (from_pretrained(gguf_file=...) needs accelerate and refuses save_pretrained).
            from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

            log(f"converting {path.name} (dequantising the GGUF, CPU)")
            cfg = LlamaConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
            for key in ("quantization_config", "_name_or_path", "transformers_version"):
                cfg.pop(key, None)
            cfg["dtype"] = "bfloat16"
            plain = LlamaForCausalLM(LlamaConfig(**cfg))
            tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=plain)["tensors"]
            missing, unexpected = plain.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()},
                                                        strict=False)
            missing = [k for k in missing if not (k == "lm_head.weight" and plain.config.tie_word_embeddings)]
            if missing or unexpected:
                raise SystemExit(f"GGUF does not map onto Llama: missing {missing}, unexpected {unexpected}")
            tmp = work / "converted.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            plain.to(torch.bfloat16).save_pretrained(tmp)
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tok.save_pretrained(tmp, save_jinja_files=False)
            del tensors, plain
            tmp.rename(converted)
        path = converted
    tok = AutoTokenizer.from_pretrained(str(path))
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok, path


def read_rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows or "chat" not in rows[0]:
        raise SystemExit(f"--gsm8k {path}: expected rows with ready-made chat prompts (write them with --prepare)")
    return rows


# ---------------------------------------------------------------- data generation


@dataclass
class Sample:
    ids: list[int]  # prompt + response (response ends at EOS or the token budget)
    prompt_len: int


def encode_prompt(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


@torch.no_grad()
def generate(model, tok, prompts: list[list[int]], new_tokens: int, temperature: float, batch: int,
             device: torch.device, seed: int, deadline: float) -> list[Sample]:
    """Target continuations (greedy or sampled), batched with left padding, longest prompts first."""
    from transformers import GenerationConfig

    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    gc = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
        top_k=0 if temperature > 0 else None, top_p=1.0 if temperature > 0 else None,
        eos_token_id=eos, pad_token_id=pad,
    )
    # Our config must win over anything in the checkpoint's generation_config.json (transformers fills unset
    # fields from the model's defaults), so it becomes the model's default too.
    model.generation_config = gc
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[Sample] = []
    torch.manual_seed(seed)
    for start in range(0, len(order), batch):
        if time.monotonic() > deadline:
            log(f"  generation time box reached after {len(out)} sequences")
            break
        chunk = [prompts[i] for i in order[start : start + batch]]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gc)
        gen = gen[:, width:].cpu().tolist()
        for p, g in zip(chunk, gen, strict=True):
            resp = g[: g.index(eos) + 1] if eos in g else g
            if resp:
                out.append(Sample(ids=p + resp, prompt_len=len(p)))
    return out


def build_data(target, tok, rows: list[dict], args, device: torch.device, work: Path) -> tuple[list[Sample], list[Sample]]:
    """(train, held_out) target-generated samples; cached in ``work`` so a second run skips generation."""
    cache = work / f"samples-{args.cache_tag}.json"
    if cache.is_file() and not args.smoke:
        obj = json.loads(cache.read_text())
        log(f"reusing {len(obj['train'])} train / {len(obj['held_out'])} held-out samples from {cache}")
        return [Sample(**s) for s in obj["train"]], [Sample(**s) for s in obj["held_out"]]
    rng = random.Random(args.seed)
    held_rows, train_rows = rows[-args.held_out :], rows[: -args.held_out][: args.train_prompts]
    shots = [s for s in args.shots.split(",") if s]

    def prompts_for(rs: list[dict], pick) -> list[list[int]]:
        return [encode_prompt(tok, r["chat"][pick(r)]) for r in rs]

    deadline = time.monotonic() + args.gen_minutes * 60
    train_prompts = prompts_for(train_rows, lambda r: rng.choice(shots))
    held_prompts = prompts_for(held_rows[: args.eval_prompts], lambda r: shots[0])
    log(f"generating: {len(train_prompts)} train prompts x (1 greedy + {args.samples} sampled), "
        f"{len(held_prompts)} held-out, {args.gen_tokens} new tokens")
    held = generate(target, tok, held_prompts, args.gen_tokens, 0.0, args.gen_batch, device, args.seed, math.inf)
    train = generate(target, tok, train_prompts, args.gen_tokens, 0.0, args.gen_batch, device, args.seed, deadline)
    for i in range(args.samples):
        train += generate(target, tok, train_prompts, args.gen_tokens, 1.0, args.gen_batch, device,
                          args.seed + 1 + i, deadline)
    resp = sum(len(s.ids) - s.prompt_len for s in train)
    log(f"  {len(train)} train sequences ({resp} response tokens), {len(held)} held-out")
    if not train or not held:
        raise SystemExit("no training data was generated (time box too small?)")
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"train": [s.__dict__ for s in train], "held_out": [s.__dict__ for s in held]}))
    tmp.replace(cache)
    return train, held


def collate(samples: list[Sample], pad: int, device: torch.device):
    """Right-padded ids and the (row, position) pairs whose next token is a response token.

    Right padding + causal attention: real positions never see the padding, so no mask is needed.
    """
    width = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    rows, cols = [], []
    for r, s in enumerate(samples):
        ids[r, : len(s.ids)] = torch.tensor(s.ids)
        span = range(s.prompt_len - 1, len(s.ids) - 1)
        rows.extend([r] * len(span))
        cols.extend(span)
    return ids.to(device), torch.tensor(rows, device=device), torch.tensor(cols, device=device)


# ---------------------------------------------------------------- draft + head


def make_draft(target, num_layers: int):
    """The target's first ``num_layers`` layers + final norm + frozen copies of its embeddings / LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    n_target = target.config.num_hidden_layers
    if not 1 <= num_layers < n_target:
        raise SystemExit(f"--layers must be in 1..{n_target - 1} for a {n_target}-layer target")
    cfg = draft_config_dict(target.config.to_dict(), num_layers, n_target)
    draft = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    state = {k: v for k, v in target.state_dict().items() if _keep_for_draft(k, num_layers)}
    missing, unexpected = draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not draft.config.tie_word_embeddings]
    if missing or unexpected:
        raise SystemExit(f"draft init: missing {missing}, unexpected {unexpected}")
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(False)
    return draft.to(next(target.parameters()).device)


def _keep_for_draft(name: str, num_layers: int) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is None or int(m.group(1)) < num_layers


def draft_config_dict(cfg: dict, num_layers: int, n_target: int) -> dict:
    cfg = {k: v for k, v in cfg.items() if k not in ("quantization_config", "_name_or_path", "transformers_version")}
    for key, value in list(cfg.items()):  # per-layer lists (e.g. layer_types) follow the cut
        if isinstance(value, list) and len(value) == n_target:
            cfg[key] = value[:num_layers]
    cfg["num_hidden_layers"] = num_layers
    cfg["architectures"] = ["LlamaForCausalLM"]
    return cfg


class ConfidenceHead(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden + 2, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    @staticmethod
    def features(h: torch.Tensor, q_log: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """[h (final-normed hidden), log q(token), entropy(q)] with q the temperature-1 draft distribution."""
        logq_tok = q_log.gather(-1, token[..., None])
        entropy = -(q_log.exp() * q_log).sum(-1, keepdim=True)
        return torch.cat([h.float(), logq_tok, entropy], dim=-1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.linear(feats).squeeze(-1)  # logits


def autocast(device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def selected_logits(model, ids, rows, cols, device, grad: bool):
    """Final-normed hidden states and fp32 logits at the selected positions only (the LM head is the
    expensive part at a 49k vocabulary, so it never runs on prompt positions)."""
    ctx = contextlib.nullcontext() if grad else torch.no_grad()
    with ctx, autocast(device):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[rows, cols]
        logits = model.lm_head(hidden)
    return hidden, logits.float()


def distill(target, draft, head, train: list[Sample], held: list[Sample], args, device, pad: int) -> dict:
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    head_opt = torch.optim.Adam(head.parameters(), lr=args.head_lr)
    rng = random.Random(args.seed)
    order: list[int] = []
    budget = args.minutes * 60.0
    start = time.monotonic()
    next_eval = start + args.eval_every
    step, best, history = 0, None, []
    draft.train()
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        frac = min(1.0, step / args.max_steps) if args.max_steps else elapsed / budget
        lr = args.lr * (frac / 0.03 if frac < 0.03 else 0.5 * (1 + math.cos(math.pi * (frac - 0.03) / 0.97)))
        for g in opt.param_groups:
            g["lr"] = max(lr, args.lr * 0.02)
        batch = []
        while len(batch) < args.batch:
            if not order:
                order = list(range(len(train)))
                rng.shuffle(order)
            batch.append(train[order.pop()])
        ids, rows, cols = collate(batch, pad, device)
        _, p_logits = selected_logits(target, ids, rows, cols, device, grad=False)
        h, q_logits = selected_logits(draft, ids, rows, cols, device, grad=True)
        p_log = F.log_softmax(p_logits, -1)
        q_log = F.log_softmax(q_logits, -1)
        kl = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        kl.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        head_loss = train_head_step(head, head_opt, h.detach(), q_log.detach(), p_log)
        step += 1
        if step % 50 == 0 or step == 1:
            log(f"  step {step:5d} {elapsed:6.0f}s lr {lr:.2e} KL {kl.item():.4f} head BCE {head_loss:.4f}")
        if time.monotonic() >= next_eval or (args.smoke and step % 10 == 0):
            draft.eval()
            m = teacher_forced_metrics(target, draft, head, held, args, device, pad)
            draft.train()
            m.update(step=step, seconds=round(time.monotonic() - start, 1))
            history.append(m)
            log(f"  held-out: agreement {m['greedy_agreement']:.4f} KL {m['kl']:.4f}")
            if best is None or m["greedy_agreement"] > best[0]:
                best = (m["greedy_agreement"], copy.deepcopy(draft.state_dict()), copy.deepcopy(head.state_dict()))
            next_eval = time.monotonic() + args.eval_every
    draft.eval()
    final = teacher_forced_metrics(target, draft, head, held, args, device, pad)
    final.update(step=step, seconds=round(time.monotonic() - start, 1))
    history.append(final)
    if best is not None and best[0] > final["greedy_agreement"]:
        log(f"  restoring the best held-out state (agreement {best[0]:.4f} > final {final['greedy_agreement']:.4f})")
        draft.load_state_dict(best[1])
        head.load_state_dict(best[2])
    return {"steps": step, "seconds": round(time.monotonic() - start, 1), "history": history}


def train_head_step(head, opt, h, q_log, p_log) -> float:
    """One BCE step of the confidence head; x = the draft's greedy token (what greedy decoding proposes)."""
    with torch.no_grad():
        c_star = (1 - 0.5 * (q_log.exp() - p_log.exp()).abs().sum(-1)).clamp(0, 1)
        feats = ConfidenceHead.features(h, q_log, q_log.argmax(-1))
    loss = F.binary_cross_entropy_with_logits(head(feats), c_star)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def fit_head_only(target, draft, head, train: list[Sample], args, device, pad: int) -> float:
    opt = torch.optim.Adam(head.parameters(), lr=args.head_lr)
    rng = random.Random(args.seed + 7)
    loss = float("nan")
    for step in range(args.head_steps):
        batch = rng.sample(train, min(args.batch, len(train)))
        ids, rows, cols = collate(batch, pad, device)
        _, p_logits = selected_logits(target, ids, rows, cols, device, grad=False)
        h, q_logits = selected_logits(draft, ids, rows, cols, device, grad=False)
        loss = train_head_step(head, opt, h, F.log_softmax(q_logits, -1), F.log_softmax(p_logits, -1))
        if (step + 1) % 50 == 0:
            log(f"  head step {step + 1} BCE {loss:.4f}")
    return loss


@torch.no_grad()
def teacher_forced_metrics(target, draft, head, held: list[Sample], args, device, pad: int) -> dict:
    """On the target's greedy held-out continuations: how often draft argmax == target argmax, the KL,
    mean c* and mean predicted confidence (a first calibration check)."""
    agree = total = 0
    kl_sum = c_star_sum = conf_sum = 0.0
    for i in range(0, len(held), args.batch):
        ids, rows, cols = collate(held[i : i + args.batch], pad, device)
        _, p_logits = selected_logits(target, ids, rows, cols, device, grad=False)
        h, q_logits = selected_logits(draft, ids, rows, cols, device, grad=False)
        p_log, q_log = F.log_softmax(p_logits, -1), F.log_softmax(q_logits, -1)
        agree += int((p_log.argmax(-1) == q_log.argmax(-1)).sum())
        total += rows.numel()
        kl_sum += float((p_log.exp() * (p_log - q_log)).sum())
        c_star_sum += float((1 - 0.5 * (q_log.exp() - p_log.exp()).abs().sum(-1)).sum())
        conf_sum += float(torch.sigmoid(head(ConfidenceHead.features(h, q_log, q_log.argmax(-1)))).sum())
    n = max(total, 1)
    return {"greedy_agreement": agree / n, "kl": kl_sum / n, "mean_c_star": c_star_sum / n,
            "mean_confidence": conf_sum / n, "positions": total}


# ---------------------------------------------------------------- simulated speculative decoding


@torch.no_grad()
def simulate(target, draft, head, prompts: list[list[int]], k: int, temperature: float, new_tokens: int,
             eos: int, pad: int, device, seed: int, batch: int) -> dict:
    """Speculative decoding with k autoregressive drafts per step and lossless verification.

    Every forward recomputes the whole (right-padded) prefix -- slow but simple and exact; causal attention
    means padding after a row's end is never seen. Greedy: a draft is accepted while it equals the target's
    argmax. Temperature 1: accept x with probability min(1, p(x)/q(x)), else resample from max(p - q, 0).
    Returns tokens per step (accepted + the bonus/correction token), per-position conditional acceptance
    and the head's mean confidence at each position.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    steps = emitted = 0
    acc_pos = torch.zeros(k, dtype=torch.float64)
    seen_pos = torch.zeros(k, dtype=torch.float64)
    conf_pos = torch.zeros(k, dtype=torch.float64)
    for b0 in range(0, len(prompts), batch):
        chunk = prompts[b0 : b0 + batch]
        n = len(chunk)
        width = max(len(p) for p in chunk) + new_tokens + 2 * k + 2
        buf = torch.full((n, width), pad, dtype=torch.long, device=device)
        lens = torch.tensor([len(p) for p in chunk], device=device)
        for r, p in enumerate(chunk):
            buf[r, : len(p)] = torch.tensor(p, device=device)
        ar = torch.arange(n, device=device)
        produced = torch.zeros(n, dtype=torch.long, device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        while not bool(done.all()):
            cur = lens.clone()
            drafts, q_probs, confs = [], [], []
            for _ in range(k):
                with autocast(device):
                    h = draft.model(input_ids=buf[:, : int(cur.max())], use_cache=False).last_hidden_state[ar, cur - 1]
                    logits = draft.lm_head(h).float()
                q_log1 = F.log_softmax(logits, -1)
                if temperature > 0:
                    q = F.softmax(logits / temperature, -1)
                    tok = torch.multinomial(q, 1, generator=gen).squeeze(-1)
                else:
                    tok = logits.argmax(-1)
                    q = F.one_hot(tok, logits.shape[-1]).float()
                confs.append(torch.sigmoid(head(ConfidenceHead.features(h.float(), q_log1, tok))))
                buf[ar, cur] = tok
                cur = cur + 1
                drafts.append(tok)
                q_probs.append(q)
            d = torch.stack(drafts, 1)  # [n, k]
            with autocast(device):
                hid = target.model(input_ids=buf[:, : int(cur.max())], use_cache=False).last_hidden_state
                idx = (lens - 1)[:, None] + torch.arange(k + 1, device=device)[None]
                p_logits = target.lm_head(hid[ar[:, None], idx]).float()  # [n, k+1, V]
            if temperature > 0:
                p = F.softmax(p_logits / temperature, -1)
                qd = torch.stack(q_probs, 1)  # [n, k, V]
                p_x = p[:, :k].gather(-1, d[..., None]).squeeze(-1)
                q_x = qd.gather(-1, d[..., None]).squeeze(-1)
                u = torch.rand(n, k, device=device, generator=gen)
                ok = u * q_x <= p_x
            else:
                ok = p_logits[:, :k].argmax(-1) == d
            n_acc = torch.cumprod(ok.int(), 1).sum(1)  # [n]
            if temperature > 0:
                p_at = p[ar, n_acc]
                resid = torch.where(
                    (n_acc < k)[:, None],
                    (p_at - torch.cat([qd, torch.zeros_like(qd[:, :1])], 1)[ar, n_acc]).clamp_min(0),
                    p_at,
                )
                resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_at)
                nxt = torch.multinomial(resid / resid.sum(-1, keepdim=True), 1, generator=gen).squeeze(-1)
            else:
                nxt = p_logits[ar, n_acc].argmax(-1)
            live = ~done
            pos = torch.arange(k, device=device)[None]
            seen = (pos <= n_acc[:, None]) & (pos < k) & live[:, None]
            acc_pos += (((pos < n_acc[:, None]) & live[:, None]).sum(0)).double().cpu()
            seen_pos += seen.sum(0).double().cpu()
            conf_pos += (torch.stack(confs, 1) * seen).sum(0).double().cpu()
            # emitted tokens of this step: accepted drafts, then the correction/bonus token
            new = torch.cat([d, torch.zeros_like(d[:, :1])], 1)
            new[ar, n_acc] = nxt
            count = n_acc + 1
            is_eos = (new == eos) & (torch.arange(k + 1, device=device)[None] < count[:, None])
            first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, count)
            count = torch.minimum(count, first_eos)
            buf[ar, lens + n_acc] = nxt
            steps += int(live.sum())
            emitted += int(count[live].sum())
            lens = torch.where(live, lens + n_acc + 1, lens)
            produced = produced + torch.where(live, count, torch.zeros_like(count))
            done = done | (live & (is_eos.any(1) | (produced >= new_tokens)))
    return {
        "k": k,
        "temperature": temperature,
        "mean_acceptance_length": emitted / max(steps, 1),
        "steps": steps,
        "accept_rate_by_position": (acc_pos / seen_pos.clamp_min(1)).tolist(),
        "mean_confidence_by_position": (conf_pos / seen_pos.clamp_min(1)).tolist(),
    }


# ---------------------------------------------------------------- export


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.detach().float().cpu()
    scale = w.abs().amax(dim=tuple(range(1, w.dim()))).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale.view(-1, *([1] * (w.dim() - 1)))).clamp(-127, 127).to(torch.int8)
    return q, scale


def packaged_size_estimate(target, num_layers: int) -> int:
    total = 0
    for name, t in target.state_dict().items():
        if _keep_for_draft(name, num_layers) and name.startswith("model.layers."):
            total += t.numel() * (1 if t.dim() >= 2 else 4) + (t.shape[0] * 4 if t.dim() >= 2 else 0)
    return total + target.config.hidden_size * 4 * 2 + 4096


def export_packaged(draft, head, out: Path, meta: dict, int8: bool) -> int:
    """Write the packaged draft format (see assets.py); returns the weight file's size in bytes."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, t in draft.state_dict().items():
        if not (name.startswith("model.layers.") or name == "model.norm.weight"):
            continue  # embeddings and LM head are the target's
        if int8 and t.dim() >= 2:
            q, scale = quantize_int8(t)
            tensors[name], tensors[name + ".scale"] = q, scale
        else:
            tensors[name] = t.detach().float().cpu().contiguous()
    tensors["confidence_head.weight"] = head.linear.weight.detach().float().cpu().contiguous()
    tensors["confidence_head.bias"] = head.linear.bias.detach().float().cpu().contiguous()
    cfg = draft.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "quantization_config"):
        cfg.pop(key, None)
    cfg["dtype"] = "bfloat16"
    cfg["dspark_confidence_head"] = {"features": HEAD_FEATURES, "fitted": True}
    cfg[PACKAGED_KEY] = {"format_version": PACKAGED_FORMAT_VERSION,
                         "quantization": "int8-per-output-channel-symmetric" if int8 else "none", **meta}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for file in tmp.iterdir():
        file.chmod(0o644)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return (out / "model.safetensors").stat().st_size


# ---------------------------------------------------------------- prepare (runs where dspark is installed)


def prepare(dest: Path) -> None:
    """Write what the GPU run needs into ``dest/part1``, ``dest/part2``...: GSM8K rows with chat prompts,
    the pure-Python ``gguf`` package as a zip, and the SmolLM2 GGUF cut into pieces of <= 24 MiB."""
    import importlib.util

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dspark_cli.data.gsm8k import chat_messages, export_jsonl, load_gsm8k
    from dspark_cli.engines.embedded.assets import smollm2_gguf_path

    rows = load_gsm8k()
    gguf_path = smollm2_gguf_path()
    size = gguf_path.stat().st_size
    n_parts = max(1, math.ceil(size / PART_BYTES))
    shutil.rmtree(dest, ignore_errors=True)
    dirs = [dest / f"part{i + 1}" for i in range(n_parts)]
    for d in dirs:
        d.mkdir(parents=True)
    export_jsonl(dirs[0] / "gsm8k.jsonl", rows, chat={"0shot": lambda q: chat_messages(q, 0),
                                                      "5shot": lambda q: chat_messages(q, 5)})
    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the gguf package is not installed here: pip install gguf")
    pkg = Path(list(spec.submodule_search_locations)[0])
    dist_infos = sorted(pkg.parent.glob("gguf-*.dist-info"))
    if not dist_infos:
        raise SystemExit(f"no gguf-*.dist-info next to {pkg}: reinstall gguf with pip")
    import zipfile

    with zipfile.ZipFile(dirs[0] / "gguf.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        for root in (pkg, dist_infos[-1]):
            for file in sorted(root.rglob("*")):
                if file.is_file() and "__pycache__" not in file.parts:
                    zf.write(file, file.relative_to(pkg.parent).as_posix())
    with open(gguf_path, "rb") as fh:
        for i, d in enumerate(dirs):
            (d / f"{gguf_path.name}.part{i + 1}").write_bytes(fh.read(math.ceil(size / n_parts)))
    for d in dirs:
        mib = sum(f.stat().st_size for f in d.iterdir()) / 2**20
        print(f"{d}: {', '.join(sorted(f.name for f in d.iterdir()))} ({mib:.1f} MiB)")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", type=Path, help="write the GPU inputs into this dir and exit")
    ap.add_argument("--model", type=Path, help="HF checkpoint dir, .gguf file, or dir of *.gguf.part* pieces")
    ap.add_argument("--gsm8k", type=Path, help="rows JSONL written by --prepare")
    ap.add_argument("--out", type=Path, help="output dir: layers{L}/ (packaged draft) + metrics.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dspark-distill"), help="scratch: converted model, samples")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=4.0, help="distillation time box")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = time box only)")
    ap.add_argument("--gen-minutes", type=float, default=2.0, help="time box for generating training data")
    ap.add_argument("--data-only", action="store_true", help="convert + generate into --work, then stop")
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=192)
    ap.add_argument("--samples", type=int, default=2, help="temperature-1 continuations per prompt (plus 1 greedy)")
    ap.add_argument("--shots", default="0shot,5shot", help="prompt styles to mix (held-out uses the first)")
    ap.add_argument("--train-prompts", type=int, default=100000)
    ap.add_argument("--held-out", type=int, default=100, help="last rows kept out of training")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--eval-every", type=float, default=45.0, help="seconds between held-out checks")
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--head-lr", type=float, default=2e-3)
    ap.add_argument("--head-steps", type=int, default=150)
    ap.add_argument("--no-int8", action="store_true", help="store float32 layers (bigger than 16 MB at L=4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: proves every stage runs")
    args = ap.parse_args(argv)
    if args.prepare is None and (args.model is None or args.gsm8k is None or args.out is None):
        ap.error("--model, --gsm8k and --out are required (or --prepare DIR)")
    if args.held_out < 1 or args.eval_prompts < 1 or args.layers < 1:
        ap.error("--held-out, --eval-prompts and --layers must be >= 1")
    if args.smoke:
        args.minutes, args.max_steps, args.gen_minutes = min(args.minutes, 2.0), args.max_steps or 20, 2.0
        args.gen_tokens, args.samples, args.train_prompts, args.held_out = 24, 1, 12, 6
        args.eval_prompts, args.eval_tokens, args.batch, args.gen_batch = 4, 16, 4, 8
        args.head_steps, args.eval_every = 10, 1e9
    args.cache_tag = f"{args.gen_tokens}-{args.samples}-{args.shots}-{args.train_prompts}-{args.held_out}-{args.seed}"
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.prepare is not None:
        prepare(args.prepare)
        return None
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    log(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else os.cpu_count()} "
        f"{'' if device.type == 'cuda' else 'CPUs'}), torch {torch.__version__}")
    rows = read_rows(args.gsm8k)
    target, tok, target_dir = load_target(args.model, args.work, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    n_t = target.config.num_hidden_layers
    est = packaged_size_estimate(target, args.layers)
    log(f"target {target_dir}: {n_t} layers, hidden {target.config.hidden_size}, vocab {target.config.vocab_size}; "
        f"packaged draft L={args.layers} ~{est / 2**20:.1f} MiB")
    if not args.no_int8 and est > MAX_PACKAGED_BYTES and not args.smoke:
        raise SystemExit(f"--layers {args.layers} would need ~{est / 2**20:.1f} MiB > 16 MiB packaged: use fewer layers")

    train, held = build_data(target, tok, rows, args, device, args.work)
    if args.data_only:
        log(f"data ready in {args.work}; rerun without --data-only to distil")
        return None
    metrics: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "target": str(target_dir),
                     "train_sequences": len(train), "held_out_sequences": len(held)}
    draft = make_draft(target, args.layers)
    head = ConfidenceHead(target.config.hidden_size).to(device)
    metrics["init"] = teacher_forced_metrics(target, draft.eval(), head, held, args, device, pad)
    log(f"cut-only draft (L={args.layers}): held-out agreement {metrics['init']['greedy_agreement']:.4f}")

    metrics["train"] = distill(target, draft, head, train, held, args, device, pad)
    metrics["head_bce"] = fit_head_only(target, draft, head, train, args, device, pad)
    metrics["final"] = teacher_forced_metrics(target, draft, head, held, args, device, pad)
    dest = args.out / f"layers{args.layers}"
    meta = {"target": "SmolLM2-135M-Instruct", "init": f"target layers 0..{args.layers - 1}",
            "held_out_greedy_agreement": round(metrics["final"]["greedy_agreement"], 4)}
    size = export_packaged(draft, head, dest, meta, int8=not args.no_int8)
    metrics["packaged_bytes"] = size
    log(f"wrote {dest} ({size / 2**20:.2f} MiB); held-out agreement {metrics['final']['greedy_agreement']:.4f}")
    write_metrics(args.out / "metrics.json", metrics)

    # Evaluate what was shipped: the int8 round trip, not the fp32 training weights.
    reload_quantized(draft, dest)
    held_prompts = [s.ids[: s.prompt_len] for s in held]
    metrics["shipped"] = teacher_forced_metrics(target, draft, head, held, args, device, pad)
    metrics["speculative"] = []
    for temperature in (0.0, 1.0):
        for k in (4, 7):
            res = simulate(target, draft, head, held_prompts, k, temperature, args.eval_tokens, eos, pad, device,
                           args.seed, batch=min(64, len(held_prompts)))
            metrics["speculative"].append(res)
            log(f"  k={k} T={temperature:g}: mean acceptance length {res['mean_acceptance_length']:.3f} "
                f"accept by pos {[round(a, 3) for a in res['accept_rate_by_position']]} "
                f"conf {[round(c, 3) for c in res['mean_confidence_by_position']]}")
            write_metrics(args.out / "metrics.json", metrics)
    metrics["total_seconds"] = round(time.monotonic() - t0, 1)
    write_metrics(args.out / "metrics.json", metrics)
    print_table(metrics, args.layers)
    return metrics


def reload_quantized(draft, dest: Path) -> None:
    from safetensors.torch import load_file

    stored = load_file(str(dest / "model.safetensors"))
    state = draft.state_dict()
    for name, value in stored.items():
        if name.endswith(".scale") or name.startswith("confidence_head."):
            continue
        if value.dtype == torch.int8:
            scale = stored[name + ".scale"]
            value = value.float() * scale.view(-1, *([1] * (value.dim() - 1)))
        state[name].copy_(value.to(state[name].dtype))


def write_metrics(path: Path, metrics: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    tmp.replace(path)


def print_table(metrics: dict, layers: int) -> None:
    print(f"\n== SmolLM2-135M draft, L={layers} ==")
    print(f"greedy agreement  cut-only {metrics['init']['greedy_agreement']:.4f}   "
          f"distilled {metrics['final']['greedy_agreement']:.4f}   shipped(int8) {metrics['shipped']['greedy_agreement']:.4f}")
    print(f"{'k':>3} {'T':>4} {'mean accept len':>16}  accept rate by position")
    for r in metrics["speculative"]:
        print(f"{r['k']:>3} {r['temperature']:>4g} {r['mean_acceptance_length']:>16.3f}  "
              f"{' '.join(f'{a:.2f}' for a in r['accept_rate_by_position'])}")
    print(f"packaged size {metrics['packaged_bytes'] / 2**20:.2f} MiB; total {metrics.get('total_seconds')} s")


if __name__ == "__main__":
    main()
