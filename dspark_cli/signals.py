"""SIGTERM read as Ctrl-C, for commands that must not die without a word.

A job scheduler's cancel, ``kill`` or a container stop sends SIGTERM, whose default action ends the process
at once: a profile or a calibration then stopped with no message (exit 143), and a benchmark left its servers
running. Inside :func:`sigterm_as_interrupt` SIGTERM raises ``KeyboardInterrupt`` instead, so it takes the
same path as Ctrl-C: finished results kept, one line saying what happened, a non-zero exit.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["sigterm_as_interrupt"]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises ``KeyboardInterrupt`` (main thread only: Python delivers signals there, and
    only the main thread may install handlers); the previous handler comes back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
