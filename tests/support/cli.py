"""The real ``streamrl`` command, run in its own process, as a user would run it."""

from __future__ import annotations

import subprocess
import sys


def run_cli(
    argv: list[str], env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
