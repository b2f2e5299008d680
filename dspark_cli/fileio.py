"""Atomic, orjson-backed file writes: a finished result is never half-written or lost."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import orjson


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same folder and an atomic rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Serialise ``obj`` with orjson (indented, numpy-aware) and write it atomically."""
    data = orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)
    return atomic_write_bytes(path, data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_json(path: str | os.PathLike[str]) -> Any:
    return orjson.loads(Path(path).read_bytes())
