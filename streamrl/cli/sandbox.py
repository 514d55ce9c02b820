"""`streamrl sandbox run FILE.py`: untrusted Python run the way verifiers run it."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import msgspec

from streamrl import defaults
from streamrl.verifiers.sandbox import run_python

# ---------------------------------------------------------------- command line


@click.group("sandbox")
def sandbox_group() -> None:
    """Run untrusted Python the way verifiers do."""


@sandbox_group.command("run")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=defaults.SANDBOX_TIMEOUT_S,
)
@click.option("--memory-mb", type=click.IntRange(min=1), default=defaults.SANDBOX_MEMORY_MB)
@click.option("--json", "as_json", is_flag=True, help="Print the SandboxResult as JSON.")
def run_command(file: Path, timeout_s: float, memory_mb: int, as_json: bool) -> None:
    """Run FILE.py in the sandbox; exit with its exit code (125 if a limit was hit)."""
    stdin = None if sys.stdin.isatty() else sys.stdin.buffer.read()
    result = run_python(file, timeout_s=timeout_s, memory_mb=memory_mb, stdin=stdin)
    if as_json:
        click.echo(msgspec.json.encode(result).decode())
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.limit_hit:
            click.echo(f"sandbox: limit hit: {result.limit_hit}", err=True)
    code = result.exit_code if result.limit_hit is None else 125
    sys.exit(code if 0 <= code < 256 else 125)
