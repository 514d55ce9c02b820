"""A virtualenv with PyPI ``verifiers==0.4.0`` (PrimeIntellect's, ``import verifiers.v1``) and
``uv`` on top of the project's own packages, at the repository's root as ``.venv-verifiers``.

Why a venv of its own: verifiers 0.4.0 pins ``openai < 3`` (the project's venv has openai 3) and
``mcp == 2.0.0``. The venv is made with the project venv's base interpreter and a ``.pth`` file
that appends the project venv's site-packages, so streamrl's dependencies come from there and
only what verifiers adds (openai 2, mcp, aiohttp, prime-*...) lives in the new venv, in front:
nothing in the project's venv moves. ``uv`` is there because verifiers' harnesses run their
agent program as a ``uv`` script (``uv sync --script``: the script's dependencies are resolved
from PyPI the first time, then from uv's cache).

``python tests/support/verifiers_venv.py`` makes it (about a minute, once) and prints its
Python; a complete one is marked with ``.streamrl-verifiers``; a failed install leaves none.
"""

from __future__ import annotations

import fcntl
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-verifiers"
VERSION = "0.4.0"
MARKER = VENV / ".streamrl-verifiers"


def venv_python() -> Path:
    return VENV / "bin" / "python"


def verifiers_python(say=print) -> str:
    if MARKER.exists():
        return str(venv_python())
    with open(ROOT / ".venv-verifiers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if MARKER.exists():
            return str(venv_python())
        base = getattr(sys, "_base_executable", sys.executable)
        shared = [p for p in site.getsitepackages() if p.endswith("site-packages")]
        say(f"creating {VENV} with {base} and installing verifiers=={VERSION} and uv")
        shutil.rmtree(VENV, ignore_errors=True)
        try:
            subprocess.run([base, "-m", "venv", str(VENV)], check=True)
            (own,) = VENV.glob("lib/python*/site-packages")
            lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in shared)
            (own / "zz_streamrl_shared.pth").write_text(lines)
            subprocess.run(
                [str(venv_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                 f"verifiers=={VERSION}", "uv"],
                check=True,
            )  # fmt: skip
        except BaseException:
            shutil.rmtree(VENV, ignore_errors=True)
            raise
        MARKER.write_text(f"verifiers=={VERSION} over {' '.join(shared)}\n")
    return str(venv_python())


if __name__ == "__main__":
    print(verifiers_python(say=lambda m: None))
