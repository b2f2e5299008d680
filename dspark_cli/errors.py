"""The one error type the CLI turns into a one-line message and a non-zero exit.

Every module raises a subclass of :class:`DsparkError` for bad input it can explain (a malformed file,
an impossible flag combination). The CLI prints ``str(error)`` alone -- no traceback -- so the message
must say what is wrong and how to fix it, in one line.
"""

from __future__ import annotations


class DsparkError(Exception):
    """A user-facing error: its message is printed as is and the command exits with status 1."""
