"""The scripts under ``bench/`` are files, not a package: tests load them by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

_BENCH = Path(__file__).parent.parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
