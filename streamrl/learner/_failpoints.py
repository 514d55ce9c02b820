"""Crash points for restart tests: ``STREAMRL_LEARNER_FAILPOINT=<name>@<step>`` makes the
learner SIGKILL itself when it reaches ``name`` at optimizer step ``step``, so a test can crash
it exactly inside the windows that matter (a half-written checkpoint, a checkpoint not yet
acked, weights written but not announced). Unset, it costs one string comparison."""

from __future__ import annotations

import os
import signal

ENV = "STREAMRL_LEARNER_FAILPOINT"
_armed = os.environ.get(ENV, "")


def failpoint(name: str, step: int) -> None:
    if _armed and _armed == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
