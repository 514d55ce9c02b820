"""The learner's figures per environment, for a run on a mixture: over each environment's last
``window`` groups, the mean reward, the solved and no-signal rates (the kinds
``learner.outcomes`` gave them), the mean staleness and the samples per second the learner
took in. Written as one JSON field (``per_env``) of the learner's progress hash, read by
``streamrl status``, ``watch`` and the metrics exporter, and logged with each step.

Not checkpointed, like ``Outcomes``: a restarted learner fills the windows again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrl.learner.batch import rewards_of
from streamrl.schema import Group

_SOLVED, _NO_SIGNAL = "solved", "no_signal"  # learner.outcomes' kinds (it imports this)


@dataclass
class _Env:
    window: int
    # (time, samples, mean reward, kind, staleness) of its last `window` groups
    recent: deque[tuple[float, int, float, str, int]] = field(default_factory=deque)
    groups: int = 0
    samples: int = 0

    def figures(self) -> dict[str, Any]:
        rows = list(self.recent)
        n = len(rows)
        span = rows[-1][0] - rows[0][0] if n > 1 else 0.0
        taken = sum(r[1] for r in rows[1:])  # samples after the first group's arrival
        return {
            "groups": self.groups,
            "samples": self.samples,
            "reward_mean": round(sum(r[2] for r in rows) / n, 4) if n else 0.0,
            "solved_rate": round(sum(r[3] == _SOLVED for r in rows) / n, 4) if n else 0.0,
            "no_signal_rate": round(sum(r[3] == _NO_SIGNAL for r in rows) / n, 4) if n else 0.0,
            "staleness_mean": round(sum(r[4] for r in rows) / n, 3) if n else 0.0,
            "samples_per_s": round(taken / span, 3) if span > 0 else 0.0,
        }


@dataclass
class ByEnv:
    window: int
    envs: dict[str, _Env] = field(default_factory=dict)

    def see(self, group: Group, kind: str, behind: int, now: float | None = None) -> None:
        """Note one valid group with tokens, its kind and how many versions behind it was."""
        name = group.samples[0].trajectory.env if group.samples else ""
        e = self.envs.setdefault(name, _Env(self.window))
        rewards = rewards_of(group)
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        at = time.time() if now is None else now
        e.recent.append((at, len(group.samples), mean, kind, behind))
        while len(e.recent) > self.window:
            e.recent.popleft()
        e.groups += 1
        e.samples += len(group.samples)

    def figures(self) -> dict[str, dict[str, Any]]:
        return {name: e.figures() for name, e in sorted(self.envs.items())}

    def fields(self) -> dict[str, str]:
        """For the learner's progress hash."""
        return {"per_env": msgspec.json.encode(self.figures()).decode()}

    def line(self) -> dict[str, dict[str, float]]:
        """The step log's ``per_env``: reward and rates by environment (a mixture only)."""
        if len(self.envs) < 2:
            return {}
        keep = ("reward_mean", "solved_rate", "no_signal_rate", "staleness_mean")
        return {"per_env": {n: {k: f[k] for k in keep} for n, f in self.figures().items()}}
