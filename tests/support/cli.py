"""The real ``streamrl`` command, run in its own process from the repository root, as a user
would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


def run_cli(
    argv: list[str], env: dict[str, str], timeout: float = 120, **kw: Any
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl.cli", *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )
