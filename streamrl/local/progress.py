"""What ``streamrl demo``'s live loop has seen of a run: the first and latest rewards, when
training started and the target was reached, and a row a second of how it went (the
``timeline`` of the demo's JSON, which ``bench/demo_phases.py`` cuts into phases)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

TIMELINE_COLUMNS = ["seconds", "step", "samples_scored", "reward", "entropy", "entropy_coef"]


@dataclass
class Progress:
    """What the live loop has seen: the rewards of the first and of the latest `window`
    samples, and when training started and the target was reached."""

    window: int
    started: float = field(default_factory=time.monotonic)
    first: list[float] = field(default_factory=list)
    recent: deque[float] = field(init=False)
    first_step_at: float | None = None  # training time is measured from the first step
    reached: float | None = None  # seconds from the start to the target
    reached_at: float | None = None  # the same moment, epoch seconds
    reached_step: int | None = None
    # once a second, TIMELINE_COLUMNS: to see which phase of a run takes the time
    # (bench/demo_phases.py); the reward is the mean of `recent`
    timeline: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.window)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def add(self, rewards: Iterable[float]) -> None:
        for r in rewards:
            self.recent.append(r)
            if len(self.first) < self.window:
                self.first.append(r)

    def saw_step(self, step: int) -> None:
        if self.first_step_at is None and step >= 1:
            self.first_step_at = self.elapsed()

    def note(self, step: int, scored: int, entropy: float, coef: float) -> None:
        """One timeline row (see ``timeline``); ``scored``: samples scored so far."""
        reward = sum(self.recent) / len(self.recent) if self.recent else 0.0
        row = [self.elapsed(), step, scored, reward, entropy, coef]
        self.timeline.append([round(x, 4) if isinstance(x, float) else x for x in row])

    def at_target(self, target: float | None, step: int) -> bool:
        """Whether the mean of a full window is at the target (the first time is noted)."""
        full = len(self.recent) == self.window
        at = target is not None and full and sum(self.recent) / self.window >= target
        if at and self.reached is None:
            self.reached = self.elapsed()
            self.reached_at = time.time()
            self.reached_step = step
        return at
