"""Crash points for the exactly-once tests of external sessions: the rollout worker's work
horse SIGKILLs itself at a named point of ``external`` (an open's answer received but not yet
checkpointed, a tool call's answer received but not yet checkpointed), so a test crashes it
exactly inside the windows that matter instead of wherever a kill from outside happens to land.

    STREAMRL_ENV_FAILPOINTS="after_open:1,after_tool_send:3"
        the first hits of each point die, 1 and 3 times in all
    STREAMRL_ENV_FAILPOINTS="*:6" STREAMRL_ENV_FAILPOINT_P=0.05 STREAMRL_ENV_FAILPOINT_SEED=17
        each hit of any point dies with probability 0.05, 6 times in all; whether a hit dies
        is drawn from the seed and the hit's key (task, session attempt, call), so a seed names
        the same crash sites on every run whatever the timing

The budget is shared by every process given the same ``STREAMRL_ENV_FAILPOINT_DIR``: a kill
first claims a file there (``<point>.<n>``, created exclusively, holding the point and the
key), so the test counts the kills from those files and a run drains once the budget is spent.

Why test code lives in the package: the windows are a few lines wide inside the rollout
worker's work horse, a process the test starts as a real rq worker; no test-side hook reaches
them. Unset (always, outside these tests), a fault point costs one truth test."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

ENV = "STREAMRL_ENV_FAILPOINTS"
DIR_ENV = "STREAMRL_ENV_FAILPOINT_DIR"
P_ENV = "STREAMRL_ENV_FAILPOINT_P"
SEED_ENV = "STREAMRL_ENV_FAILPOINT_SEED"

_spec = os.environ.get(ENV, "")


def _budgets(spec: str) -> dict[str, int]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, n = part.partition(":")
        out[name] = int(n or 1)
    return out


def failpoint(name: str, key: str) -> None:
    """Die here if the tests armed this point and its budget is not spent."""
    if not _spec:
        return
    budgets = _budgets(_spec)
    entry = name if name in budgets else "*" if "*" in budgets else None
    if entry is None:
        return
    p = float(os.environ.get(P_ENV, "1"))
    seed = os.environ.get(SEED_ENV, "0")
    if p < 1 and random.Random(f"{seed}|{name}|{key}").random() >= p:
        return
    where = Path(os.environ[DIR_ENV])
    label = entry.replace("*", "any")
    for n in range(budgets[entry]):
        try:
            fd = os.open(where / f"{label}.{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, f"{name} {key}\n".encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
