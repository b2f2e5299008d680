"""Atomic, orjson-backed file writes: a finished result is never half-written or lost."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Protocol

import orjson

from dspark_cli.errors import DsparkError


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same folder and an atomic rename.

    A link is written through (its target is replaced, the link stays); a path that is not a regular file (a
    device, a FIFO) is refused: the rename would put a file where it was, and as root even over ``/dev/null``.
    """
    target = Path(path)
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    if target.exists() and not target.is_file():
        raise DsparkError(f"{path} is not a regular file (a device, FIFO or socket); name a file to write")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
    # os.open with 0o666 lets the umask set the mode, as for any file the user creates (mkstemp's 0600
    # would leave results unreadable to the group that shares them).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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


def _check_writable_folder(folder: Path) -> None:
    """Create ``folder`` and write a file there (and remove it): raises OSError when either fails."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".write-check-{secrets.token_hex(6)}.tmp"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    probe.unlink()


def check_output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """Refuse, in one line, a results folder that cannot be created or written, before any work. Creates it."""
    target = Path(path).expanduser()
    try:
        _check_writable_folder(target)
    except OSError as exc:
        raise DsparkError(f"{flag} {path}: cannot write there ({exc.strerror or exc}); pass another folder") from None
    return target


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """Refuse, in one line, an output path that cannot be written, before the work that fills it: a bad path
    found after a long profile or eval would lose the result. Creates the missing parent folders."""
    target = Path(path).expanduser()
    if target.is_dir() or str(path).endswith(("/", os.sep)):  # Path drops the separator: "new/" would be a file
        raise DsparkError(f"{flag} {path} is a folder; name the file to write")
    if target.exists() and not target.is_file():
        raise DsparkError(f"{flag} {path} is not a regular file (a device, FIFO or socket); name a file to write")
    try:
        _check_writable_folder(target.parent)
        if target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise DsparkError(f"{flag} {path}: cannot write there ({exc.strerror or exc}); pass another path") from None
    return target


def check_figure_file(path: str | os.PathLike[str], flag: str) -> Path:
    """:func:`check_output_file` for a plot, whose suffix must name a format matplotlib writes (none: PNG)."""
    target = check_output_file(path, flag)
    fmt = target.suffix.lstrip(".").lower()
    if fmt:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if fmt not in formats:
            raise DsparkError(f"{flag} {path}: matplotlib cannot write .{fmt}; use one of "
                              f"{', '.join('.' + f for f in sorted(formats))}")
    return target


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Serialise ``obj`` with orjson (indented, numpy-aware) and write it atomically."""
    data = orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)
    return atomic_write_bytes(path, data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


class Figure(Protocol):
    def savefig(self, fname: Any, **kwargs: Any) -> None: ...


def atomic_write_figure(fig: Figure, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """Render a matplotlib figure as the format ``path``'s suffix names and write it atomically."""
    import io

    target = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=target.suffix.lstrip(".") or "png", dpi=dpi)
    return atomic_write_bytes(target, buf.getvalue())


def parse_non_finite_json(data: bytes) -> tuple[Any, list[str]] | None:
    """``data`` parsed, with the NaN / Infinity constants it holds, when those are why a strict parser
    (orjson) refuses it; None when it holds none or is broken JSON anyway.

    Python's json writes non-finite floats as bare ``NaN`` / ``Infinity``, and orjson's "unexpected character"
    would hide that the real problem is a non-finite number; the stdlib parser reads them, which tells the
    two cases apart."""
    import json

    found: list[str] = []

    def constant(name: str) -> float:
        found.append(name)
        return float(name.replace("Infinity", "inf"))

    try:
        obj = json.loads(data, parse_constant=constant)
    except ValueError:  # JSONDecodeError and bad UTF-8 alike
        return None
    return (obj, found) if found else None


def read_json(path: str | os.PathLike[str]) -> Any:
    return orjson.loads(Path(path).read_bytes())


def drop_cut_last_line(path: str | os.PathLike[str]) -> int:
    """Truncate a JSONL file's last line where a crash cut it (no newline at the end), so that appends start on
    a line of their own instead of joining the fragment (two rows lost, and a bad line mid-file). Returns the
    bytes dropped; a missing or empty file, or one that ends in a newline, is left alone."""
    p = Path(path)
    if not p.is_file():
        return 0
    with p.open("r+b") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return 0
        end = size - 1
        while end > 0:  # back to the last newline, a block at a time (trace files grow large)
            start = max(0, end - 65536)
            fh.seek(start)
            at = fh.read(end - start).rfind(b"\n")
            if at >= 0:
                cut = start + at + 1
                break
            end = start
        else:
            cut = 0
        fh.truncate(cut)
        return size - cut
