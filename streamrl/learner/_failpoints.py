"""Crash points for restart tests: ``STREAMRL_LEARNER_FAILPOINT=<name>@<step>`` makes the
learner SIGKILL itself when it reaches ``name`` at optimizer step ``step``, so a test can crash
it exactly inside the windows that matter (a half-written checkpoint, a checkpoint not yet
acked, weights written but not announced). Unset, it costs one string comparison.

Why test code lives in the package: those windows are a few lines wide inside the learner's
own steps (``loop``, ``checkpoint``, ``publish``), in a learner process the test starts from the
outside (``streamrl learn`` or torchrun), so no test-side hook can reach them; a kill from the
outside lands at a random point instead. The module is private and does nothing unless the
variable is set."""

from __future__ import annotations

import os
import signal

ENV = "STREAMRL_LEARNER_FAILPOINT"
_armed = os.environ.get(ENV, "")


def failpoint(name: str, step: int) -> None:
    if _armed and _armed == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
