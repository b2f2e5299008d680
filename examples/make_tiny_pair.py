"""Build the tiny target/draft pair that tests and CPU demos run on (a few minutes on 2 CPU cores).

What it makes, under ``dspark_cli/engines/embedded/assets/tiny/`` by default:

- a 1024-token byte-level BPE tokenizer trained on GSM8K questions and answers (any text encodes: unknown
  characters fall back to bytes), with ChatML special tokens and a simple chat template; ``<|im_end|>`` is EOS
  and the training text ends every chat answer with it, so generation stops on its own;
- ``target/``: a ~2M-parameter Llama (4 layers, hidden 192, grouped-query attention) trained on GSM8K text;
- ``draft/``: a ~0.2M-parameter Llama (1 layer, hidden 64) with the same tokenizer, distilled toward the
  target (KL(target || draft)), plus a DSpark confidence head (``confidence_head.weight``/``.bias``, see
  ``dspark_cli/engines/embedded/assets.py``) fitted to c* = 1 - TV(p_draft, p_target).

Both are plain Hugging Face Llama checkpoint dirs (config.json + model.safetensors + tokenizer files). The
pair is deliberately weak: the draft agrees with the target's greedy choice about 40% of the time, so
speculative decoding accepts some drafts and rejects others, and every code path is exercised.

Training runs a fixed number of steps (the result does not depend on how busy the machine is) with a
wall-clock cap per phase (``--max-minutes``) so that a very busy machine still finishes. The script
finishes by printing greedy agreement and the mean acceptance length at k=4 on held-out GSM8K questions, and
writes them to ``tiny/metrics.json``.

    python examples/make_tiny_pair.py                 # writes the packaged pair
    python examples/make_tiny_pair.py --out /tmp/tiny --target-steps 30 --draft-steps 20   # a quick throwaway pair
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dspark_cli.data.gsm8k import COT_EXEMPLARS, GsmRow, load_gsm8k

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "dspark_cli" / "engines" / "embedded" / "assets" / "tiny"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOCAB_SIZE = 1024
HELD_OUT = 100  # the last rows of the test split: never trained on, used for the printed metrics


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int


TARGET = Sizes(hidden=192, layers=4, intermediate=512, heads=4, kv_heads=2)
DRAFT = Sizes(hidden=64, layers=1, intermediate=192, heads=2, kv_heads=1)


def chat_text(question: str, answer: str) -> str:
    return f"{BOS}user\n{question}{EOS}\n{BOS}assistant\n{answer}{EOS}\n"


def plain_text(question: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {answer}\n\n"


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Byte-level: every string maps to tokens (no <unk>), which the engine relies on for arbitrary prompts.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token="<|endoftext|>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(sizes: Sizes, tok: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.convert_tokens_to_ids(BOS),
        eos_token_id=tok.convert_tokens_to_ids(EOS),
        pad_token_id=tok.convert_tokens_to_ids(EOS),
    )


def token_stream(rows: list[GsmRow], tok: PreTrainedTokenizerFast, rng: random.Random) -> torch.Tensor:
    """One shuffled stream of chat- and plain-formatted examples; windows are cut from it at random."""
    # Mostly chat-formatted (what the server sends), so that "<|im_end|>" reliably follows a finished answer;
    # the clean chain-of-thought answers (no <<calc>> annotations) are easier for a model this small.
    pieces: list[str] = []
    for row in rows:
        pieces.append(chat_text(row.question, row.cot_answer) if rng.random() < 0.85 else plain_text(row.question, row.cot_answer))
    for ex in COT_EXEMPLARS:
        pieces.append(plain_text(ex.question, ex.answer))
        pieces.append(chat_text(ex.question, ex.answer))
    rng.shuffle(pieces)
    ids: list[int] = []
    for piece in pieces:
        ids.extend(tok.encode(piece, add_special_tokens=False))
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq] for s in starts.tolist()])


def lr_at(step_frac: float, peak: float, warmup: float = 0.04) -> float:
    """Linear warm-up then cosine decay to 5% of the peak."""
    if step_frac < warmup:
        return peak * step_frac / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step_frac - warmup) / (1 - warmup)))))


def _out_of_time(start: float, cap_minutes: float, what: str, step: int) -> bool:
    """The wall-clock cap. The learning-rate schedule follows whichever of steps or time runs out first, so a
    capped run still anneals."""
    if time.monotonic() - start < cap_minutes * 60:
        return False
    print(f"  {what}: wall-clock cap of {cap_minutes:g} min reached at step {step} (machine busy?)", flush=True)
    return True


def train_target(model: LlamaForCausalLM, data, steps: int, lr: float, cap_minutes: float) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    start, step, loss_ema = time.monotonic(), 0, None
    while step < steps and not _out_of_time(start, cap_minutes, "target", step):
        elapsed = time.monotonic() - start
        for group in opt.param_groups:
            group["lr"] = lr_at(max(step / steps, elapsed / (cap_minutes * 60)), lr)
        x = next(data)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        if step % 10 == 0:
            print(f"  target step {step:4d}  {elapsed:5.0f}s  loss {loss_ema:.3f}", flush=True)
    model.eval()
    return {"steps": step, "loss": loss_ema, "seconds": round(time.monotonic() - start, 1)}


def distill_draft(draft: LlamaForCausalLM, target: LlamaForCausalLM, data, steps: int, lr: float,
                  cap_minutes: float) -> dict:
    """KL(target || draft) on the target's next-token distributions, plus a little CE on the data."""
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    draft.train()
    start, step, loss_ema = time.monotonic(), 0, None
    while step < steps and not _out_of_time(start, cap_minutes, "draft", step):
        elapsed = time.monotonic() - start
        for group in opt.param_groups:
            group["lr"] = lr_at(max(step / steps, elapsed / (cap_minutes * 60)), lr)
        x = next(data)
        with torch.no_grad():
            p_log = F.log_softmax(target(input_ids=x).logits.float(), dim=-1)
        out = draft(input_ids=x, labels=x)
        q_log = F.log_softmax(out.logits.float(), dim=-1)
        kl = F.kl_div(q_log, p_log, log_target=True, reduction="none").sum(-1).mean()
        loss = 0.9 * kl + 0.1 * out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        loss_ema = kl.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * kl.item()
        if step % 20 == 0:
            print(f"  draft step {step:4d}  {elapsed:5.0f}s  KL {loss_ema:.3f}", flush=True)
    draft.eval()
    return {"steps": step, "kl": loss_ema, "seconds": round(time.monotonic() - start, 1)}


def confidence_features(draft: LlamaForCausalLM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[final-normed hidden, log q(x_draft), entropy(q)] per position, and q's log-probs.

    x_draft is the draft's greedy token; q is the draft's temperature-1 distribution. Same definition as the
    engine's (documented in assets.py).
    """
    out = draft(input_ids=x, output_hidden_states=True)
    hidden = out.hidden_states[-1].float()  # HF applies the final norm to the last hidden state
    q_log = F.log_softmax(out.logits.float(), dim=-1)
    top_logq = q_log.max(dim=-1).values
    entropy = -(q_log.exp() * q_log).sum(-1)
    return torch.cat([hidden, top_logq[..., None], entropy[..., None]], dim=-1), q_log


def fit_confidence_head(draft: LlamaForCausalLM, target: LlamaForCausalLM, data, steps: int) -> torch.nn.Linear:
    """Logistic head, BCE against c* = 1 - 0.5*||p_draft - p_target||_1 (DSpark Eq. 8)."""
    head = torch.nn.Linear(draft.config.hidden_size + 2, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for step in range(steps):
        x = next(data)
        with torch.no_grad():
            feats, q_log = confidence_features(draft, x)
            p = F.softmax(target(input_ids=x).logits.float(), dim=-1)
            c_star = (1 - 0.5 * (q_log.exp() - p).abs().sum(-1)).clamp(0, 1)
        loss = F.binary_cross_entropy_with_logits(head(feats).squeeze(-1), c_star)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"  confidence step {step + 1:4d}  BCE {loss.item():.4f}  mean c* {c_star.mean():.3f}", flush=True)
    return head


@torch.no_grad()
def evaluate(target, draft, tok, rows: list[GsmRow], new_tokens: int, k: int) -> dict:
    """Greedy agreement on target-greedy continuations and the mean tokens per step of greedy
    speculative decoding with k drafts (accepted prefix + the target's bonus/correction token).

    Greedy speculative decoding emits exactly the target's greedy continuation, so each step can be
    simulated against that continuation: the draft proposes k tokens from the current prefix and the
    accepted run is its longest match with the continuation.
    """
    agree = total = eos_seen = 0
    step_lengths: list[int] = []
    eos = tok.eos_token_id
    greedy = {"do_sample": False, "eos_token_id": eos, "pad_token_id": eos}
    for row in rows:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": row.question}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        seq = target.generate(input_ids=ids, max_new_tokens=new_tokens, **greedy)
        eos_seen += int(seq[0, -1].item() == eos)
        n_prompt, n_total = ids.shape[1], seq.shape[1]
        t_arg = target(input_ids=seq).logits[0].argmax(-1)
        d_arg = draft(input_ids=seq).logits[0].argmax(-1)
        agree += int((t_arg[n_prompt - 1 : n_total - 1] == d_arg[n_prompt - 1 : n_total - 1]).sum())
        total += n_total - n_prompt
        pos = n_prompt
        while pos < n_total:
            proposal = draft.generate(input_ids=seq[:, :pos], max_new_tokens=k, **greedy)[0, pos:]  # may end at EOS
            n = min(proposal.numel(), n_total - pos)
            matches = (proposal[:n] == seq[0, pos : pos + n]).int()
            accepted = int(matches.cumprod(0).sum())
            emitted = min(accepted + 1, n_total - pos)
            step_lengths.append(emitted)
            pos += emitted
    return {
        "greedy_agreement": agree / max(total, 1),
        f"mean_acceptance_length_k{k}": sum(step_lengths) / max(len(step_lengths), 1),
        "num_questions": len(rows),
        "num_tokens": total,
        "answers_ending_in_eos": eos_seen,
    }


def save_checkpoint(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path, extra: dict | None) -> None:
    model = model.to(torch.float16)
    model.config.dtype = "float16"
    model.save_pretrained(out)
    # Keep the chat template inside tokenizer_config.json: one file, readable by old and new transformers.
    tok.save_pretrained(out, save_jinja_files=False)
    # The generic class name loads with transformers 4.x and 5.x alike (5.x writes its own alias).
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    if extra:
        weights = out / "model.safetensors"
        tensors = load_file(weights)
        tensors.update({name: t.detach().to(torch.float32).contiguous() for name, t in extra.items()})
        save_file(tensors, weights, metadata={"format": "pt"})
    for path in out.iterdir():
        path.chmod(0o644)


def evaluate_saved(out: Path, rows: list[GsmRow], new_tokens: int) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(out / "target")
    target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(out / "draft", dtype=torch.float32).eval()
    metrics = evaluate(target, draft, tok, rows, new_tokens, k=4)
    path = out / "metrics.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    saved.update(metrics)
    path.write_text(json.dumps(saved, indent=2) + "\n")
    print(json.dumps({k: metrics[k] for k in ("greedy_agreement", "mean_acceptance_length_k4", "num_tokens")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--target-steps", type=int, default=250)
    parser.add_argument("--draft-steps", type=int, default=150)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--confidence-steps", type=int, default=100)
    parser.add_argument("--max-minutes", type=float, default=15.0, help="wall-clock cap per training phase")
    parser.add_argument("--target-minutes", type=float, default=None, help="wall-clock cap for the target only")
    parser.add_argument("--draft-minutes", type=float, default=None, help="wall-clock cap for the draft only")
    parser.add_argument("--eval-questions", type=int, default=24)
    parser.add_argument("--eval-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true", help="re-measure the pair in --out, update metrics.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    rows = load_gsm8k()
    train_rows, held_out = rows[:-HELD_OUT], rows[-HELD_OUT:]
    if args.eval_only:
        evaluate_saved(args.out, held_out[: args.eval_questions], args.eval_tokens)
        return
    tok = train_tokenizer(
        [r.question for r in rows] + [r.answer for r in rows] + [r.cot_answer for r in rows]
        + [chat_text(e.question, e.answer) + plain_text(e.question, e.answer) for e in COT_EXEMPLARS]
    )
    stream = token_stream(train_rows, tok, rng)
    print(f"tokenizer: {len(tok)} tokens; training stream: {stream.numel()} tokens", flush=True)

    target = LlamaForCausalLM(make_config(TARGET, tok))
    draft = LlamaForCausalLM(make_config(DRAFT, tok))
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    print(f"target {n_t / 1e6:.2f}M params, draft {n_d / 1e6:.2f}M params", flush=True)

    t_stats = train_target(target, batches(stream, 16, args.seq_len, gen), args.target_steps, args.lr,
                           args.target_minutes if args.target_minutes is not None else args.max_minutes)
    # Round-trip through the stored precision first so that the draft learns (and the metrics measure)
    # the target exactly as it is shipped.
    target = target.to(torch.float16).to(torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    d_stats = distill_draft(draft, target, batches(stream, 16, args.seq_len, gen), args.draft_steps, args.lr,
                            args.draft_minutes if args.draft_minutes is not None else args.max_minutes)
    draft = draft.to(torch.float16).to(torch.float32)
    for p in draft.parameters():
        p.requires_grad_(False)
    head = fit_confidence_head(draft, target, batches(stream, 8, args.seq_len, gen), args.confidence_steps)

    metrics = evaluate(target, draft, tok, held_out[: args.eval_questions], args.eval_tokens, k=4)
    metrics.update(
        {"target_params": n_t, "draft_params": n_d, "target_train": t_stats, "draft_train": d_stats,
         "seed": args.seed, "held_out_rows": f"last {HELD_OUT} of the GSM8K test split"}
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny.", dir=args.out.parent))
    try:
        save_checkpoint(target, tok, tmp / "target", None)
        draft.config.dspark_confidence_head = {"features": ["final_hidden_normed", "log_q_token", "entropy_q"]}
        save_checkpoint(draft, tok, tmp / "draft", {"confidence_head.weight": head.weight, "confidence_head.bias": head.bias})
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        for path in (tmp, tmp / "target", tmp / "draft"):
            path.chmod(0o755)  # mkdtemp makes 0700 folders
        if args.out.exists():
            shutil.rmtree(args.out)
        tmp.rename(args.out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(json.dumps({k: metrics[k] for k in ("greedy_agreement", "mean_acceptance_length_k4", "num_tokens")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
