"""The ``dspark`` command: a thin Typer layer that parses flags, calls the toolkit and renders results.

Each command validates its inputs at the edge; any :class:`~dspark_cli.errors.DsparkError` raised below
becomes one line on stderr and exit status 1 -- never a traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from dspark_cli import __version__
from dspark_cli.errors import DsparkError

app = typer.Typer(
    name="dspark",
    help="Confidence-scheduled speculative decoding that pays off at every load.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
eval_app = typer.Typer(help="Score a server's accuracy (capacity modes must not move it).", no_args_is_help=True)
app.add_typer(eval_app, name="eval")

console = Console()
err_console = Console(stderr=True)


def _not_built(command: str) -> None:
    err_console.print(f"dspark {command}: not built yet.")
    raise typer.Exit(2)


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"dspark {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Confidence-scheduled speculative decoding that pays off at every load."""


@app.command("profile-sps")
def profile_sps() -> None:
    """Measure the engine's step cost vs batch tokens and requests; write sps_curve.json."""
    _not_built("profile-sps")


@app.command("calibrate")
def calibrate() -> None:
    """Fit Sequential Temperature Scaling from recorded traces; write sts.json."""
    _not_built("calibrate")


@app.command("serve")
def serve() -> None:
    """Start an OpenAI-compatible server with confidence-scheduled verification."""
    _not_built("serve")


@app.command("bench")
def bench() -> None:
    """Run the config x concurrency matrix and print the comparison table."""
    _not_built("bench")


@eval_app.command("gsm8k")
def eval_gsm8k() -> None:
    """Few-shot GSM8K accuracy against a running server."""
    _not_built("eval gsm8k")


def main() -> None:
    """Console-script entry point: run the app, turning DsparkError into one clean line."""
    try:
        app()
    except DsparkError as exc:
        err_console.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
