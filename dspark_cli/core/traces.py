"""Verification traces: one JSONL object per verified request-step (docs/ARCHITECTURE.md, File formats).

``{"request": id, "step": i, "conf": [c_1..c_K], "verified": v, "accepted": a}`` with raw head
probabilities (before STS) and 0 <= a <= v <= K. Both engines write them, ``dspark calibrate`` fits STS
on them and the simulator replays them. Readers tolerate missing ``request``/``step`` and extra fields,
and point at ``file:line`` for anything else, so a truncated or hand-edited file is easy to fix.
"""

from __future__ import annotations

import glob
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import orjson
import torch

from dspark_cli.errors import DsparkError
from dspark_cli.fileio import drop_cut_last_line

_log = logging.getLogger("dspark.traces")

_SHAPE_HINT = 'expected {"conf": [c_1..c_K], "verified": v, "accepted": a} with 0 <= a <= v <= K'


class TraceFormatError(DsparkError):
    """A malformed trace file; the message names ``file:line``."""


@dataclass
class TraceRecord:
    request: Any  # str | int | None
    step: int | None
    conf: list[float]
    verified: int
    accepted: int

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.request is not None:
            out["request"] = self.request
        if self.step is not None:
            out["step"] = self.step
        out["conf"] = self.conf
        out["verified"] = self.verified
        out["accepted"] = self.accepted
        return out


def records_to_arrays(
    records: Sequence[TraceRecord],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``conf[N, K]`` (float64), ``verified[N]`` and ``accepted[N]`` (int64) for the fitters/simulator."""
    if not records:
        return np.zeros((0, 0)), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    conf = np.asarray([r.conf for r in records], dtype=np.float64)
    verified = np.asarray([r.verified for r in records], dtype=np.int64)
    accepted = np.asarray([r.accepted for r in records], dtype=np.int64)
    return conf, verified, accepted


class TraceSet(NamedTuple):
    """What :func:`read_traces` returns; unpacks as ``(records, skipped)``."""

    records: list[TraceRecord]
    skipped: int

    @property
    def num_positions(self) -> int:
        return len(self.records[0].conf) if self.records else 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return records_to_arrays(self.records)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _OtherK(ValueError):
    """A well-formed row whose K differs from the rows before it."""


def _parse_line(line: bytes, expected_k: int | None) -> TraceRecord:
    """Parse and validate one line; raises ValueError with the problem (caller adds file:line)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    conf = obj.get("conf")
    if not isinstance(conf, list) or len(conf) == 0:
        raise ValueError("'conf' must be a non-empty list of probabilities")
    for c in conf:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or not 0.0 <= c <= 1.0:
            raise ValueError(f"'conf' holds {c!r}; probabilities must be in [0, 1]")
    k = len(conf)
    if expected_k is not None and k != expected_k:
        raise _OtherK(f"'conf' has {k} positions but earlier rows have {expected_k}")
    v, a = obj.get("verified"), obj.get("accepted")
    if not _is_int(v) or not _is_int(a):
        raise ValueError("'verified' and 'accepted' must be integers")
    if not 0 <= a <= v <= k:
        raise ValueError(f"needs 0 <= accepted <= verified <= K, got accepted={a}, verified={v}, K={k}")
    step = obj.get("step")
    if step is not None and not _is_int(step):
        raise ValueError(f"'step' must be an integer, got {step!r}")
    request = obj.get("request")
    if request is not None and not isinstance(request, (str, int)):
        raise ValueError(f"'request' must be a string or integer id, got {request!r}")
    return TraceRecord(request=request, step=step, conf=[float(c) for c in conf], verified=v, accepted=a)


def _expand(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            out.extend(sorted(p.glob("*.jsonl")))
        else:
            out.append(p)
    return out


def read_traces(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], skip_invalid: bool = False,
    sources: list[int] | None = None,
) -> TraceSet:
    """Read trace JSONL files (or folders of ``*.jsonl``) in order.

    Every row must have the same K. A bad line raises :class:`TraceFormatError` naming ``file:line``,
    unless ``skip_invalid``, in which case it is counted in ``skipped`` (the first valid row fixes K; rows of
    another K outnumbering the rows kept are an error even then: which K won would depend on the files' order).
    Blank lines are ignored. A missing or unreadable file is always an error. ``sources``: where given, the
    index of the file each record came from is appended to it (request ids are a file's own: two runs' files
    may both hold ``gen-0``).
    """
    records: list[TraceRecord] = []
    skipped = 0
    other_k: dict[int, int] = {}  # K -> rows of that K skipped
    first_other: str = ""
    k: int | None = None
    for file_index, path in enumerate(_expand(paths)):
        try:
            fh = path.open("rb")
        except OSError as exc:
            raise TraceFormatError(f"{path}: cannot read traces ({exc.strerror or exc})") from None
        with fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rec = _parse_line(line, k)
                except _OtherK as exc:
                    if not skip_invalid:
                        raise TraceFormatError(f"{path}:{lineno}: {exc}; {_SHAPE_HINT}") from None
                    skipped += 1
                    row_k = len(orjson.loads(line)["conf"])
                    other_k[row_k] = other_k.get(row_k, 0) + 1
                    first_other = first_other or f"{path}:{lineno}"
                    continue
                except ValueError as exc:
                    if skip_invalid:
                        skipped += 1
                        continue
                    raise TraceFormatError(f"{path}:{lineno}: {exc}; {_SHAPE_HINT}") from None
                if k is None:
                    k = len(rec.conf)
                records.append(rec)
                if sources is not None:
                    sources.append(file_index)
    if other_k and sum(other_k.values()) > len(records):
        counts = ", ".join(f"{n} of K={kk}" for kk, n in sorted(other_k.items()))
        raise TraceFormatError(f"{first_other}: the traces mix K values ({len(records)} rows of K={k} read first, "
                               f"{counts} skipped); pass one K's files (one server setup's traces) at a time")
    return TraceSet(records, skipped)


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def check_appendable(path: str | os.PathLike[str], flag: str, k: int | None = None) -> None:
    """Refuse, in one line, a non-empty file whose first row is not a trace, or (``k`` given) holds another K:
    traces are appended, and rows after a curve or an ``sts.json`` would leave both unreadable, as rows of
    another K leave the trace file (the reader takes one K per file)."""
    target = Path(path).expanduser()
    # vLLM's data-parallel ranks write FILE.dpN.jsonl beside it (engines/vllm/manager.py): each is appended to
    ranks = sorted(target.parent.glob(f"{glob.escape(target.stem)}.dp[0-9]*{glob.escape(target.suffix or '.jsonl')}"))
    for file in [target, *ranks]:
        if not file.is_file() or file.stat().st_size == 0:
            continue
        with file.open("rb") as fh:
            first = fh.readline()
        try:
            rec = _parse_line(first, None)
        except ValueError as exc:
            raise DsparkError(f"{flag} {file} holds something other than traces (line 1: {exc}); traces are "
                              "appended to it: pass a new file or a traces JSONL") from None
        if k is not None and len(rec.conf) != k:
            raise DsparkError(f"{flag} {file} holds traces of K={len(rec.conf)} and this server drafts K={k}; one "
                              f"file holds one K (dspark calibrate reads it as one fit): pass a new file for K={k}")


class TraceWriter:
    """Append trace records to a JSONL file, flushing after every write so a crash loses nothing.

    Recording reads confidences and counts on the host: engines call it off the hot path (after the
    step's outputs are already on the host), never inside a captured graph.
    """

    def __init__(self, path: str | os.PathLike[str], decimals: int = 6) -> None:
        self.path = Path(path).expanduser()  # as check_appendable reads it: one file checked and written
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.decimals = decimals
        self.records_written = 0
        self.rows_skipped = 0  # rows write_batch refused to write (the reader would refuse them)
        drop_cut_last_line(self.path)  # a crash's cut row would swallow the first appended one
        self._fh: IO[bytes] | None = self.path.open("ab")

    def _skipped(self, n: int) -> None:
        """Count rows left out; say so at the first and at every tenfold count (a head that overflows would
        otherwise lose traces without a word)."""
        if n <= 0:
            return
        before, self.rows_skipped = self.rows_skipped, self.rows_skipped + n
        if len(str(self.rows_skipped)) > len(str(before)) or before == 0:
            _log.warning("%s: %d trace rows skipped so far (a confidence that is not a number in [0, 1], or "
                         "counts outside 0 <= accepted <= verified <= K): dspark calibrate would refuse them",
                         self.path, self.rows_skipped)

    def _emit(self, data: bytes) -> None:
        if self._fh is None:
            raise DsparkError(f"{self.path}: trace writer is closed")
        self._fh.write(data)
        self._fh.flush()

    def write(self, record: TraceRecord | dict[str, Any]) -> bool:
        """Write one row; a row the reader would refuse is skipped and counted in ``rows_skipped`` (False)."""
        obj = record.to_dict() if isinstance(record, TraceRecord) else record
        data = orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)
        try:
            _parse_line(data, None)
        except ValueError:
            self._skipped(1)
            return False
        self._emit(data)
        self.records_written += 1
        return True

    def write_batch(
        self,
        conf: np.ndarray | torch.Tensor,
        verified: np.ndarray | torch.Tensor,
        accepted: np.ndarray | torch.Tensor,
        requests: Sequence[Any] | np.ndarray | torch.Tensor | None = None,
        step: int | Sequence[int] | np.ndarray | torch.Tensor | None = None,
        valid: np.ndarray | torch.Tensor | None = None,
    ) -> int:
        """Write one step's rows (``conf[R, K]``, counts ``[R]``); ``valid[R]`` False rows are skipped.

        ``step`` is one integer for the whole batch or one per row. Returns the number of rows written. Rows
        the reader would refuse -- a confidence that is not a number in [0, 1] (a head that overflowed), or
        counts outside ``0 <= accepted <= verified <= K`` -- are skipped too and counted in ``rows_skipped``:
        one such row used to make the whole file unreadable to ``dspark calibrate``.
        """
        c = np.round(_to_numpy(conf).astype(np.float64), self.decimals)
        v = _to_numpy(verified).astype(np.int64).reshape(-1)
        a = _to_numpy(accepted).astype(np.int64).reshape(-1)
        r = c.shape[0]
        if len(v) != r or len(a) != r:
            raise ValueError(f"write_batch needs one verified/accepted per row, got {len(v)}/{len(a)} for {r} rows")
        keep = np.ones(r, dtype=bool) if valid is None else _to_numpy(valid).astype(bool).reshape(-1)
        k = c.shape[1] if c.ndim == 2 else 0
        sound = np.all(np.isfinite(c) & (c >= 0.0) & (c <= 1.0), axis=1) & (a >= 0) & (a <= v) & (v <= k)
        self._skipped(int(np.count_nonzero(keep & ~sound)))
        keep = keep & sound
        reqs: list[Any] | None
        if requests is None:
            reqs = None
        elif isinstance(requests, (list, tuple)):  # kept as given: numpy would make ["a", 7] all strings
            reqs = [x.item() if isinstance(x, np.generic) else x for x in requests]
        else:
            reqs = _to_numpy(requests).reshape(-1).tolist()
        steps: list[Any]
        step_arr = None if step is None or isinstance(step, (int, np.integer)) else _to_numpy(step)
        if step is None:
            steps = [None] * r
        elif step_arr is None or step_arr.ndim == 0:  # one integer for the batch, a 0-d tensor included
            steps = [int(step)] * r  # type: ignore[arg-type]
        else:
            steps = step_arr.astype(np.int64).reshape(-1).tolist()
        conf_rows = c.tolist()
        v_l, a_l = v.tolist(), a.tolist()
        chunks = []
        for i in range(r):
            if not keep[i]:
                continue
            obj: dict[str, Any] = {}
            if reqs is not None:
                obj["request"] = reqs[i]
            if steps[i] is not None:
                obj["step"] = steps[i]
            obj["conf"] = conf_rows[i]
            obj["verified"] = v_l[i]
            obj["accepted"] = a_l[i]
            chunks.append(orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE))
        if chunks:
            self._emit(b"".join(chunks))
        self.records_written += len(chunks)
        return len(chunks)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
