"""What the groups say about the task: solved, no signal, or something to learn from.

A zero-variance group (every sample scored alike) gives GRPO nothing to learn, but it is not
a fault: it is the normal cost of sampling, and a run that is doing well has more of them
every step. Two kinds are told apart:

- **solved**: every sample reached the task's top reward. The top reward is the learner's
  ``solved_reward`` when set, else the environment's ``max_reward`` (the class attribute of
  the environment the group's trajectories name), else, for an environment the learner
  cannot load, the highest reward seen in this run so far.
- **no signal**: every sample scored the same reward below the top (all wrong, or all
  equally partial).

Faults (stale, no tokens, invalid) are counted apart by the learner and never enter here.
``Outcomes`` keeps the kinds of the last ``window`` groups the learner read (valid, with
tokens, whether trained, dropped as zero-variance or dropped as stale): the solved and
no-signal rates that the step log and ``streamrl status`` show, the verdict that stops a
learner with ``stop_when_solved``, and the one line a run with no signal for
``no_signal_warn_groups`` groups in a row logs instead of waiting silently.

The window is not checkpointed: a restarted learner fills it again from the groups it reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from streamrl.envs.registry import env_class
from streamrl.learner.batch import rewards_of
from streamrl.learner.by_env import ByEnv
from streamrl.learner.checkpoint import Counters
from streamrl.schema import Group

SOLVED = "solved"
NO_SIGNAL = "no_signal"
SIGNAL = "signal"  # rewards vary within the group: something to learn from
_EPS = 1e-9  # float noise in a reward that is meant to be the top one


def env_specs(r: Any, run: str) -> Callable[[], dict[str, str]]:
    """What a mixture's names stand for (name -> environment), read from the stored mixture
    when asked: a name added mid-run is found on its first group."""
    from streamrl.producer.mixture import load

    def specs() -> dict[str, str]:
        mix = load(r, run)
        return {e.name: e.env for e in mix.envs} if mix is not None else {}

    return specs


def _env_top(name: str) -> float | None:
    """The environment's ``max_reward``; None when it cannot be loaded here."""
    try:
        return float(env_class(name).max_reward)
    except Exception:  # any import error of a third-party environment: fall back, say nothing
        return None


@dataclass
class Outcomes:
    """The kinds of the last ``window`` groups, and the stretch of no-signal ones."""

    window: int
    solved_reward: float | None = None  # the learner's setting (None: the environment's)
    specs: Callable[[], dict[str, str]] | None = None  # a mixture's names (``env_specs``)
    recent: deque[str] = field(default_factory=deque)
    no_signal_run: int = 0  # no-signal groups in a row, up to now
    no_signal_reward: float = 0.0  # the sum of their (common) rewards
    no_signal_line: str = ""  # what was said about the current stretch ("" while none)
    by_env: ByEnv = field(init=False)  # the same, and rewards, per environment (a mixture)
    _tops: dict[str, float | None] = field(default_factory=dict)
    _best: float | None = None  # the highest reward seen (the fallback top)

    def __post_init__(self) -> None:
        self.by_env = ByEnv(self.window)

    @classmethod
    def for_run(cls, cfg: Any, r: Any, run: str) -> Outcomes:
        """The learner's: ``cfg`` its ``LearnerConfig``; a mixture's names resolved in Redis."""
        return cls(cfg.solved_window, cfg.solved_reward, env_specs(r, run))

    def top(self, group: Group) -> float | None:
        """The reward every sample must reach for ``group`` to count as solved."""
        if self.solved_reward is not None:
            return self.solved_reward
        name = group.samples[0].trajectory.env if group.samples else ""
        if name not in self._tops:
            spec = (self.specs() if self.specs is not None else {}).get(name, name)
            self._tops[name] = _env_top(spec) if spec else None
        found = self._tops[name]
        return self._best if found is None else found

    def see(self, group: Group, zero_variance: bool) -> str:
        """Note one valid group with tokens; its kind (SOLVED, NO_SIGNAL or SIGNAL)."""
        rewards = rewards_of(group)
        if rewards:
            self._best = max(rewards) if self._best is None else max(self._best, *rewards)
        kind = SIGNAL
        if zero_variance:
            top = self.top(group)
            solved = bool(rewards) and top is not None and min(rewards) >= top - _EPS
            kind = SOLVED if solved else NO_SIGNAL
        self.recent.append(kind)
        while len(self.recent) > self.window:
            self.recent.popleft()
        if kind == NO_SIGNAL:
            self.no_signal_run += 1
            self.no_signal_reward += rewards[0] if rewards else 0.0
        else:
            self.no_signal_run, self.no_signal_reward, self.no_signal_line = 0, 0.0, ""
        return kind

    def count(self, group: Group, zero_variance: bool, counters: Counters, behind: int = 0) -> None:
        """``see`` the group, and count a zero-variance one as solved or no signal; note it
        for its environment with its staleness (``behind``, in versions)."""
        kind = self.see(group, zero_variance)
        self.by_env.see(group, kind, behind)
        if kind == SOLVED:
            counters.groups_solved += 1
        elif kind == NO_SIGNAL:
            counters.groups_no_signal += 1

    def rate(self, kind: str) -> float:
        """The share of ``kind`` in the window (0 while it is empty)."""
        return round(self.recent.count(kind) / len(self.recent), 4) if self.recent else 0.0

    def solved(self, target: float | None, step: int) -> str:
        """The one-line verdict once the window is full and its solved rate reaches
        ``target``; "" otherwise (and always without a target)."""
        if target is None or len(self.recent) < self.window:
            return ""
        rate = self.rate(SOLVED)
        if rate < target:
            return ""
        return (
            f"solved: {100 * rate:.0f}% of the last {self.window} groups were solved by every "
            f"sample at step {step} (stop_when_solved {target})"
        )

    def no_signal(self, warn_groups: int, step: int) -> str:
        """The one line to log when the no-signal stretch reaches ``warn_groups`` groups
        (once per stretch; 0: never); "" otherwise."""
        if not warn_groups or self.no_signal_run < warn_groups or self.no_signal_line:
            return ""
        mean = self.no_signal_reward / self.no_signal_run
        self.no_signal_line = (
            f"no signal: the last {self.no_signal_run} groups each scored alike below the top "
            f"reward (mean reward {mean:.3g}) at step {step}, nothing to learn from: is the "
            "task too hard for the policy, or the reward broken?"
        )
        return self.no_signal_line

    def fields(self) -> dict[str, str | int | float]:
        """For the learner's progress hash (``streamrl status``)."""
        return {
            "solved_rate": self.rate(SOLVED),
            "no_signal_rate": self.rate(NO_SIGNAL),
            "outcome_window": len(self.recent),
            "no_signal": self.no_signal_line,
            **self.by_env.fields(),
        }
