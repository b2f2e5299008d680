"""SIGTERM takes the Ctrl-C path in commands that write results: one line, exit 1, no earlier file lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dspark_cli.signals import sigterm_as_interrupt


def test_sigterm_raises_keyboard_interrupt_inside_and_the_old_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 5)  # let the handler run here (it raises)
    assert signal.getsignal(signal.SIGTERM) is before


# The command's work is replaced by one that is killed half way: the process sends itself SIGTERM.
_KILLED = textwrap.dedent("""
    import os, signal, sys, time
    import {module} as target
    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    target.{name} = killed
    from dspark_cli.cli import main
    sys.argv = ["dspark", *sys.argv[1:]]
    main()
""")


@pytest.mark.parametrize(("module", "name", "args"), [
    ("dspark_cli.calibrate", "run_calibration", ["calibrate", "traces.jsonl", "-o"]),
    ("dspark_cli.profile_sps", "run_embedded", ["profile-sps", "tiny", "--device", "cpu", "-o"]),
])
def test_a_terminated_command_says_so_in_one_line_and_keeps_the_earlier_file(
        tmp_path: Path, module: str, name: str, args: list[str]) -> None:
    out = tmp_path / "out.json"
    out.write_text("earlier")
    (tmp_path / "traces.jsonl").write_text('{"conf": [0.5], "verified": 1, "accepted": 1}\n')
    proc = subprocess.run([sys.executable, "-c", _KILLED.format(module=module, name=name), *args, str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stderr.strip() == f"error: interrupted; nothing written to {out}"
    assert out.read_text() == "earlier"
