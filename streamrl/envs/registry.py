"""Environments by name: the built-ins, third-party packages that declare an entry point in
the ``streamrl.envs`` group, and ``module:Class`` paths for one-file environments."""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points
from typing import Any

from streamrl.envs.base import Environment

_ENTRY_POINT_GROUP = "streamrl.envs"

BUILTIN: dict[str, str] = {
    "copy": "streamrl.envs.copy:CopyEnv",
    "counter": "streamrl.envs.counter:CounterEnv",
    "math": "streamrl.envs.math:MathEnv",
    "countdown": "streamrl.envs.countdown:CountdownEnv",
    "workplace": "streamrl.envs.workplace:WorkplaceEnv",
    "code": "streamrl.envs.code:CodeEnv",
    "sudoku": "streamrl.envs.sudoku:SudokuEnv",
    "nim": "streamrl.envs.nim:NimEnv",
    "kayles": "streamrl.envs.kayles:KaylesEnv",
    "lookup": "streamrl.envs.lookup:LookupEnv",
}


# Adapters: environments whose prompts and scoring come from elsewhere (a dataset and the run's
# reward functions, another package's environments), so they have no generator or verifier of
# their own to audit.
ADAPTERS: dict[str, str] = {
    "chat": "streamrl.envs.chat:ChatEnv",
    "openenv": "streamrl.envs.openenv:OpenEnvEnv",
    "verifiers": "streamrl.envs.prime_verifiers:VerifiersEnv",
}


class UnknownEnvironment(LookupError):
    pass


def _load(path: str) -> type[Environment]:
    module, _, attr = path.partition(":")
    if os.getcwd() not in sys.path:  # one-file environments next to where you run, as rq does
        sys.path.append(os.getcwd())
    if not module or not attr:
        raise UnknownEnvironment(f"environment {path!r}: expected module:Class")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise UnknownEnvironment(f"environment {path!r}: cannot import {module}: {e}") from e
    obj = getattr(mod, attr, None)
    if obj is None:
        raise UnknownEnvironment(f"environment {path!r}: module {module} has no {attr!r}")
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise UnknownEnvironment(f"environment {path!r} is not an Environment subclass")
    return obj


def available() -> dict[str, str]:
    found = {**BUILTIN, **ADAPTERS}
    for ep in entry_points(group=_ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def env_class(name: str) -> type[Environment]:
    if ":" in name:
        return _load(name)
    known = available()
    if name not in known:
        raise UnknownEnvironment(
            f"unknown environment {name!r}; available: {', '.join(sorted(known))} "
            f"(or give module:Class)"
        )
    return _load(known[name])


def make_env(name: str, **options: Any) -> Environment:
    return env_class(name)(**options)
