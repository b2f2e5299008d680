"""Few-shot GSM8K accuracy against an OpenAI-compatible server, lm-eval ``gsm8k_cot`` style.

The point is a regression check: capacity modes are lossless, so accuracy must not move between them beyond
sampling noise. Hence greedy decoding (temperature 0), a fixed prompt, per-question results on disk (so two
runs can be compared question by question) and a binomial standard error next to every accuracy. ``--compare``
reads two runs as the paired samples they are: identical completions, outcomes changed each way, and an exact
McNemar test on the changed ones.

Prompt: k of the 8 standard chain-of-thought exemplars as "Q: ...\\nA: ..." blocks separated by a blank line,
then "Q: <question>\\nA:", sent to /v1/completions; generation stops where a next question would start.

Scoring (both reported, as lm-eval does):
- strict: the answer the model declared -- "#### n" or "The answer is n" (first declaration);
- flexible: the last number anywhere in the completion.
A completion with no number at all is "invalid" (reported as a rate: formatting failures, not wrong maths).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from dspark_cli.data.gsm8k import COT_EXEMPLARS, GsmRow, load_gsm8k, normalize_number
from dspark_cli.errors import DsparkError
from dspark_cli.fileio import check_output_file, drop_cut_last_line

STOP = ["Q:", "Question:", "</s>", "<|im_end|>", "\n\n\n"]
ROW_FORMAT = 1

# Space only between "$" and the digits: "23 - 15" ends in 15, not -15 (lm-eval's and data.gsm8k's reading).
_NUM = r"-?(?:[$]\s*)?\d[\d,]*(?:\.\d+)?"
_STRICT_RES = (
    re.compile(r"####\s*(" + _NUM + ")"),
    re.compile(r"[Tt]he (?:final )?answer is\s*:?\s*(" + _NUM + ")"),
)
_FLEX_RE = re.compile(_NUM)


def build_prompt(question: str, num_shots: int) -> str:
    if not 0 <= num_shots <= len(COT_EXEMPLARS):
        raise DsparkError(f"--num-shots must be in 0..{len(COT_EXEMPLARS)}, got {num_shots}")
    shots = "".join(f"Q: {ex.question}\nA: {ex.answer}\n\n" for ex in COT_EXEMPLARS[:num_shots])
    return f"{shots}Q: {question.strip()}\nA:"


def extract_strict(text: str) -> str | None:
    """The first declared answer ("#### n" or "The answer is n"), normalised; None if none declared."""
    best: tuple[int, str] | None = None
    for pattern in _STRICT_RES:
        m = pattern.search(text)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), m.group(1))
    return normalize_number(best[1]) if best else None


def extract_flexible(text: str) -> str | None:
    """The last number in the completion, normalised; None if there is none."""
    found = _FLEX_RE.findall(text)
    return normalize_number(found[-1]) if found else None


def answers_match(predicted: str | None, gold: str) -> bool:
    if predicted is None:
        return False
    if predicted == gold:
        return True
    try:
        return math.isclose(float(predicted), float(gold), rel_tol=0.0, abs_tol=1e-6)
    except ValueError:
        return False


@dataclass(frozen=True)
class EvalRow:
    """One scored question, one JSONL line. ``settings`` pins what makes rows of one file comparable."""

    id: int
    question: str
    gold: str
    completion: str
    strict: str | None
    flexible: str | None
    strict_correct: bool
    flexible_correct: bool
    invalid: bool
    settings: dict[str, Any]
    format: int = ROW_FORMAT

    @classmethod
    def score(cls, row: GsmRow, completion: str, settings: dict[str, Any]) -> EvalRow:
        strict = extract_strict(completion)
        flexible = extract_flexible(completion)
        return cls(row.id, row.question, row.final, completion, strict, flexible,
                   answers_match(strict, row.final), answers_match(flexible, row.final),
                   flexible is None, settings)


@dataclass(frozen=True)
class Summary:
    n: int
    strict: float
    flexible: float
    invalid: float

    @staticmethod
    def stderr(p: float, n: int) -> float:
        return math.sqrt(p * (1 - p) / n) if n else 0.0

    def line(self, label: str = "gsm8k") -> str:
        se = self.stderr(self.strict, self.n)
        return (f"{label}: strict {self.strict:.3f} ± {se:.3f}, flexible {self.flexible:.3f}, "
                f"invalid {self.invalid:.3f} (n={self.n})")


def summarize(rows: Sequence[EvalRow]) -> Summary:
    n = len(rows)
    if n == 0:
        return Summary(0, 0.0, 0.0, 0.0)
    return Summary(n, sum(r.strict_correct for r in rows) / n, sum(r.flexible_correct for r in rows) / n,
                   sum(r.invalid for r in rows) / n)


ROW_START = b'{"id":'  # how append_row's every line begins (EvalRow's first field)


def read_results(path: Path, repair: bool = False, hint: str = "use another --output") -> list[EvalRow]:
    """Rows of a result file. A last line cut by a crash is dropped (and, with ``repair``, truncated away so
    appends continue on a clean line); any other bad line is an error naming file:line, ending in ``hint``."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    rows = []
    for lineno, line in enumerate(whole.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
            rows.append(EvalRow(**obj))
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise DsparkError(f"{path}:{lineno}: not a gsm8k result row ({exc}); {hint}") from exc
    cut = data[len(whole):]
    if cut and not cut.startswith(ROW_START):
        # Not a row a crash cut short (every row starts so): someone else's file, which a repair would cut.
        raise DsparkError(f"{path}:{len(whole.splitlines()) + 1}: not a gsm8k result row; {hint}")
    if repair and cut:
        drop_cut_last_line(path)  # only once every whole line is known to be a row
    return rows


def append_row(path: Path, row: EvalRow) -> None:
    """One ``write`` of a whole line with O_APPEND, then fsync: a crash leaves at most a cut last line."""
    line = orjson.dumps(asdict(row)) + b"\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class EvalConfig:
    base_url: str
    num_shots: int = 5
    limit: int | None = None
    concurrency: int = 8
    max_tokens: int = 512
    model: str | None = None
    request_timeout_s: float = 600.0
    data: Path | None = None  # GSM8K rows (package file, or a JSONL written by data.gsm8k.export_jsonl)

    def settings(self) -> dict[str, Any]:
        """What each row records of how it was scored: the setup (``SETUP_KEYS``) and, once resolved, the model
        the server served (another model's answers must not join a file on resume)."""
        out: dict[str, Any] = {"num_shots": self.num_shots, "max_tokens": self.max_tokens, "stop": STOP}
        if self.model is not None:
            out["model"] = self.model
        return out


# The settings that change a row's score by themselves (rows written before the model was recorded have only these).
SETUP_KEYS = ("num_shots", "max_tokens", "stop")


async def _served_model(cfg: EvalConfig) -> str:
    from dspark_cli.bench.client import fetch_model_name

    timeout = aiohttp.ClientTimeout(total=60, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await fetch_model_name(session, cfg.base_url)


async def _complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> str:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stop": STOP}
    async with session.post(url, data=orjson.dumps(payload), headers={"Content-Type": "application/json"}) as r:
        body = await r.read()
        if r.status != 200:
            raise DsparkError(f"{url} answered HTTP {r.status}: {body[:200].decode(errors='replace')}")
    obj = orjson.loads(body)
    return str(obj["choices"][0].get("text") or "")


async def _run(cfg: EvalConfig, rows: Sequence[GsmRow], output: Path | None,
               on_done: Callable[[EvalRow], None]) -> list[EvalRow]:
    from dspark_cli.bench.client import fetch_model_name

    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = cfg.model or await fetch_model_name(session, cfg.base_url)
        url = f"{cfg.base_url}/v1/completions"
        queue = iter(rows)
        done: list[EvalRow] = []

        async def worker() -> None:
            for row in queue:
                try:
                    text = await _complete(session, url, model, build_prompt(row.question, cfg.num_shots),
                                           cfg.max_tokens)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    raise DsparkError(f"request to {url} failed: {exc}; finished rows are kept") from exc
                scored = EvalRow.score(row, text, cfg.settings())
                if output is not None:
                    append_row(output, scored)
                done.append(scored)
                on_done(scored)

        await asyncio.gather(*(worker() for _ in range(max(1, cfg.concurrency))))
    return done


def check_eval(cfg: EvalConfig, output: str | os.PathLike[str] | None = None) -> None:
    """Refuse, in one line, settings that cannot run, before any network traffic or progress display."""
    if cfg.concurrency < 1:
        raise DsparkError(f"--concurrency must be >= 1, got {cfg.concurrency}")
    if cfg.max_tokens < 1:
        raise DsparkError(f"--max-tokens must be >= 1, got {cfg.max_tokens}")
    if cfg.limit is not None and cfg.limit < 1:
        raise DsparkError(f"--limit must be >= 1, got {cfg.limit}")
    build_prompt("", cfg.num_shots)  # validates --num-shots
    if cfg.data is not None and Path(cfg.data).is_dir():
        raise DsparkError(f"--data {cfg.data} is a folder; pass the GSM8K rows JSONL file")
    if output is not None:
        check_output_file(output, "--output")  # before any question: a bad path found after one loses its answer


def run_eval(cfg: EvalConfig, output: Path | None = None, on_start: Callable[[int, int], None] | None = None,
             on_done: Callable[[EvalRow], None] | None = None) -> list[EvalRow]:
    """Score the first ``limit`` test questions; with ``output``, questions already in it are skipped.

    Returns every row of this run's question set (earlier and new), in question order.
    """
    check_eval(cfg, output)
    rows = load_gsm8k(limit=cfg.limit, path=cfg.data)
    if not rows:
        raise DsparkError(f"no GSM8K question to score: {cfg.data or 'the GSM8K file'} holds none"
                          + (" (--limit 0)" if cfg.limit == 0 else ""))
    if cfg.model is None:
        cfg = replace(cfg, model=asyncio.run(_served_model(cfg)))
    questions = {r.id: r.question for r in rows}
    previous: dict[int, EvalRow] = {}
    if output is not None:
        mine = cfg.settings()
        for r in read_results(output, repair=True):
            if any(r.settings.get(k) != mine[k] for k in SETUP_KEYS):
                theirs = ", ".join(f"{k}={r.settings.get(k)}" for k in ("num_shots", "max_tokens"))
                raise DsparkError(f"{output} holds results of another setup ({theirs}, or other stop strings); "
                                  "use another --output or the same flags")
            if "model" in r.settings and r.settings["model"] != cfg.model:
                raise DsparkError(f"{output} holds answers of model {r.settings['model']!r}, and this server serves "
                                  f"{cfg.model!r}; use another --output for it")
            if r.id in questions and r.question != questions[r.id]:
                raise DsparkError(f"{output} holds an answer to another question {r.id} than this question set's "
                                  "(another --data?); use another --output or the same --data")
            previous[r.id] = r
    todo = [r for r in rows if r.id not in previous]
    if on_start is not None:
        on_start(len(rows) - len(todo), len(rows))
    new = asyncio.run(_run(cfg, todo, output, on_done or (lambda r: None))) if todo else []
    by_id = {**previous, **{r.id: r for r in new}}
    return [by_id[r.id] for r in rows if r.id in by_id]


@dataclass(frozen=True)
class CompareRow:
    label: str
    summary: Summary


def mcnemar_p(worse: int, better: int) -> float:
    """Exact two-sided McNemar p-value for two scorings of the same questions.

    Only the questions whose outcome changed carry evidence: with equal accuracy, each is as likely to have gone
    right -> wrong (``worse``) as wrong -> right (``better``), so ``worse`` is Binomial(worse + better, 1/2).
    """
    n = worse + better
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(worse, better) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


PAIRED_ALPHA = 0.05  # --compare calls a difference real below this McNemar p-value


def compare(paths: Sequence[Path]) -> tuple[list[CompareRow], int, str]:
    """Accuracy of several result files on the questions they all share; returns rows, shared n, and a note.

    The note compares each file with the first, question by question (the runs are greedy on one question set):
    how many completions are identical, how many strict outcomes changed each way, and an exact McNemar test on
    those. Two independent accuracies' noise band is far too wide for paired runs: 40 questions that all went
    right -> wrong in 1,319 sit inside it, and a lossless mode should change almost none.
    """
    if len(paths) < 1:
        raise DsparkError("--compare needs at least one result file")
    loaded = []
    setups: dict[str, list[str]] = {}
    for p in paths:
        if not p.exists():
            raise DsparkError(f"--compare: no such file {p}")
        if not p.is_file():
            raise DsparkError(f"--compare: {p} is not a file; pass the result files (JSONL) `eval gsm8k -o` wrote")
        rows = read_results(p, hint="pass files that `dspark eval gsm8k -o` wrote")
        if not rows:
            raise DsparkError(f"--compare: {p} holds no results")
        loaded.append((p, {r.id: r for r in rows}))
        for setup in {_setup_label(r.settings) for r in rows}:
            setups.setdefault(setup, []).append(p.name)
    shared = sorted(set.intersection(*(set(d) for _, d in loaded)))
    if not shared:
        raise DsparkError("--compare: the files share no question; run them over the same --limit")
    ref_path, ref = loaded[0]
    for p, d in loaded[1:]:
        other = next((i for i in shared if d[i].question != ref[i].question), None)
        if other is not None:
            raise DsparkError(f"--compare: {ref_path.name} and {p.name} hold different questions under id {other} "
                              "(another --data?); compare files of the same question set")
    stems = [p.stem for p, _ in loaded]
    out = []
    for p, d in loaded:
        label = p.stem if stems.count(p.stem) == 1 else str(p)
        out.append(CompareRow(label, summarize([d[i] for i in shared])))
    n = len(shared)
    if len(out) == 1:
        return out, n, f"n={n} questions in one file; pass two or more to compare them"
    lines = [f"n={n} shared questions, each file against {out[0].label}, question by question:"]
    for (_, d), row in zip(loaded[1:], out[1:], strict=True):
        same_text = sum(d[i].completion == ref[i].completion for i in shared)
        worse = sum(ref[i].strict_correct and not d[i].strict_correct for i in shared)
        better = sum(d[i].strict_correct and not ref[i].strict_correct for i in shared)
        pval = mcnemar_p(worse, better)
        verdict = "a real difference" if pval < PAIRED_ALPHA else "within noise"
        lines.append(f"  {row.label}: {same_text} of {n} completions identical; strict outcome changed on "
                     f"{worse + better} ({worse} right->wrong, {better} wrong->right), McNemar p={pval:.2g}: {verdict}")
    note = "\n".join(lines)
    if len(setups) > 1:
        # Shots and output length move accuracy by themselves: a difference here is not the servers' alone.
        note += "\nwarning: the files were scored with different settings: " + "; ".join(
            f"{setup} ({', '.join(names)})" for setup, names in setups.items())
    return out, n, note


def _setup_label(settings: dict[str, Any]) -> str:
    extra = "" if settings.get("stop") == STOP else ", other stop strings"
    return f"num_shots={settings.get('num_shots')}, max_tokens={settings.get('max_tokens')}{extra}"
