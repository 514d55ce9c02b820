"""The PyPI ``nemo-gym`` releases that streamrl is checked against, each in a virtualenv of its
own (they pin Ray, openai, mlflow... that the project's venv must not take), created on first use
and cached at the repository's root:

- ``0.4.0`` in ``.venv-nemo-gym`` (it requires Python >= 3.12): the legacy seed protocol, no
  ``/close_session``;
- ``0.7.0`` in ``.venv-nemo-gym-0.7`` (it declares Python >= 3.13.14): typed seeds,
  ``/close_session``, masked samples, environment servers. No 3.13.14 is at hand here (pyenv
  has 3.13.0): it installs and runs under 3.13.0 with ``pip install --ignore-requires-python``,
  which is what this does when the Python found is older than the declared one.

``python tests/support/nemo_gym_venv.py 0.7.0`` makes one and prints its Python. A failed
install leaves no venv behind (the next call starts again); a complete one is marked with
``.streamrl-nemo-gym-<version>``. Creations are serialised by a lock file, so parallel tests
wait for one install. Cost, measured on this shared 2-core machine: about 3 minutes for 0.7.0
from an empty pip cache, under a minute from a warm one; nothing once made.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# version -> (venv directory, minimum Python, the Python the release declares)
RELEASES: dict[str, tuple[str, tuple[int, int], tuple[int, int, int]]] = {
    "0.4.0": (".venv-nemo-gym", (3, 12), (3, 12, 0)),
    "0.7.0": (".venv-nemo-gym-0.7", (3, 13), (3, 13, 14)),
}
ENV_PYTHON = "STREAMRL_NEMO_GYM_PYTHON"  # an override for 0.4.0 (the older opt-in switch)


class NoPython(RuntimeError):
    pass


def _version_of(python: str) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:3])"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    major, minor, micro = (int(x) for x in out.stdout.split())
    return major, minor, micro


def find_python(minimum: tuple[int, int]) -> tuple[str, tuple[int, int, int]] | None:
    """The newest Python of the same minor version as ``minimum``, then any newer one, on PATH
    or under pyenv."""
    found: list[tuple[tuple[int, int, int], str]] = []
    candidates = [shutil.which(f"python{minimum[0]}.{m}") for m in range(minimum[1], 16)]
    pyenv = os.path.expanduser("~/.pyenv/versions")
    candidates += [f"{d}/bin/python" for d in glob.glob(os.path.join(pyenv, "3.*"))]
    for path in candidates:
        if path and os.path.exists(path):
            v = _version_of(path)
            if v is not None and v[:2] >= minimum:
                found.append((v, path))
    if not found:
        return None
    same = [f for f in found if f[0][:2] == minimum] or found
    version, path = max(same)
    return path, version


def venv_python(version: str) -> Path:
    return ROOT / RELEASES[version][0] / "bin" / "python"


def _marker(version: str) -> Path:
    return ROOT / RELEASES[version][0] / f".streamrl-nemo-gym-{version}"


def nemo_gym_python(version: str, say=print) -> str:
    """The Python of a venv with ``nemo-gym==version``, made if it is missing."""
    if version == "0.4.0" and os.environ.get(ENV_PYTHON):
        return os.environ[ENV_PYTHON]
    directory, minimum, declared = RELEASES[version]
    venv = ROOT / directory
    if _marker(version).exists():
        return str(venv_python(version))
    with open(ROOT / f".{directory.lstrip('.')}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _marker(version).exists():
            return str(venv_python(version))
        found = find_python(minimum)
        if found is None:
            raise NoPython(
                f"nemo-gym {version} needs Python >= {minimum[0]}.{minimum[1]} and none was "
                "found on PATH or under ~/.pyenv/versions"
            )
        base, base_version = found
        flags = ["--ignore-requires-python"] if base_version < declared else []
        say(f"creating {venv} with {base} ({'.'.join(map(str, base_version))}) and installing "
            f"nemo-gym=={version} {' '.join(flags)} (takes minutes)")  # fmt: skip
        shutil.rmtree(venv, ignore_errors=True)
        try:
            subprocess.run([base, "-m", "venv", str(venv)], check=True)
            subprocess.run(
                [str(venv_python(version)), "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", *flags, f"nemo-gym=={version}"],
                check=True,
            )  # fmt: skip
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        _marker(version).write_text(" ".join([base, *flags]) + "\n")
    return str(venv_python(version))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Make (once) a venv with a nemo-gym release.")
    ap.add_argument("version", nargs="?", default="0.7.0", choices=sorted(RELEASES))
    print(nemo_gym_python(ap.parse_args().version, say=lambda m: None))


if __name__ == "__main__":
    main()
