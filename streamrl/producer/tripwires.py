"""Reward-hacking tripwires, per environment: signs that a policy games its reward rather than
solving the task, read from the groups the verifiers assembled.

Each environment's scored samples are kept as two windows of ``window`` samples, the first
ones seen and the latest ones (canary prompts apart), and every check compares them:

- **collapse**: the mean reward rose by ``reward_rise`` or more while the completion length
  (tokens; words of the answer when the backend gives no tokens) or the tool calls per sample
  fell to ``collapse`` of what they were or less: the policy found a short cut;
- **restate**: ``restate`` of the latest samples or more are rewarded answers that restate the
  prompt (80% of its word pairs, in a prompt of at least a few words): the verifier rewards an
  echo;
- **canary**: the mean reward of the canary prompts (fixed prompts the producer mixes in,
  ``canary_every``) moved by more than ``canary_shift`` from ``canary_reward`` (a known answer,
  or 0 for a known unsolvable prompt) or from their first window's: the scoring drifted (the
  judge asks afresh for every canary sample, never from its cache, so a judge that changed
  behind the same version shows here too);
- **disagree**: where an LLM judge is combined with programmatic checks (the Score's
  ``components``: ``judge`` and the reward functions beside it, or those named in
  ``disagree_with``), ``disagree`` of the latest such samples or more have the judge further
  than ``disagree_by`` from a check: one of the two is being gamed, or is wrong.

A tripwire that fires is written to ``srl:{run}:tripped`` (``streamrl status`` shows it) and,
when the environment's ``pause`` is set, to ``srl:{run}:mix_paused`` with its one-line reason
(the mixture producer draws from it no more until ``streamrl mix --resume``); it is logged
either way. A check is a plain function of an environment's windows (``CHECKS``). The mixture
producer (``streamrl produce`` with ``[[envs]]``) runs them before every batch, on the groups
the verifiers assembled since the last.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import redis
import structlog

from streamrl import defaults as d
from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.shards import run_shards
from streamrl.bus.values import as_str
from streamrl.config import JUDGE, Mixture, TripwireConfig
from streamrl.envs.base import last_assistant_text
from streamrl.producer.mixture import CANARY, pause, paused

log = structlog.get_logger("streamrl.tripwires")
_WORD = re.compile(r"\w+")


class Seen(msgspec.Struct, frozen=True):
    """What a tripwire knows of one scored sample."""

    reward: float
    length: int  # completion tokens, else words of the answer
    tool_calls: int
    restated: bool  # the answer restates the prompt
    components: dict[str, float] = {}  # the verifier's parts (a judge's, a check's)


def _pairs(words: list[str]) -> set[tuple[str, str]]:
    return set(itertools.pairwise(words))


def restates(prompt: str, answer: str) -> bool:
    """``answer`` holds 80% of ``prompt``'s word pairs, in a prompt of a few words at least."""
    p = _WORD.findall(prompt.lower())
    if len(p) < d.TRIPWIRE_RESTATE_MIN_WORDS:
        return False
    want = _pairs(p)
    return len(want & _pairs(_WORD.findall(answer.lower()))) >= 0.8 * len(want)


def seen(sample: schema.Sample) -> Seen | None:
    """A scored sample as the tripwires see it; None for a failure (no reward)."""
    score, traj = sample.score, sample.trajectory
    if score.reward is None:
        return None
    episode = traj.items[traj.n_input :]
    answer = last_assistant_text(traj.items)
    tokens = sum(len(t.token_ids) for t in traj.turns)
    asked = traj.items[: traj.n_input]
    prompt = " ".join(i.content for i in asked if isinstance(i, schema.Message))
    return Seen(
        reward=score.reward,
        length=tokens or len(_WORD.findall(answer)),
        tool_calls=sum(isinstance(i, schema.FunctionCall) for i in episode),
        restated=restates(prompt, answer),
        components=dict(score.components),
    )


@dataclass
class EnvWindows:
    """One environment's first and latest samples, canaries apart."""

    size: int
    first: list[Seen] = field(default_factory=list)
    latest: deque[Seen] = field(default_factory=deque)
    canary_first: list[Seen] = field(default_factory=list)
    canary_latest: deque[Seen] = field(default_factory=deque)

    def add(self, s: Seen, canary: bool) -> None:
        first, latest = self.first, self.latest
        if canary:
            first, latest = self.canary_first, self.canary_latest
        if len(first) < self.size:
            first.append(s)
            return
        latest.append(s)
        while len(latest) > self.size:
            latest.popleft()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def collapse(w: EnvWindows, cfg: TripwireConfig) -> str | None:
    if len(w.latest) < cfg.window:
        return None
    before, now = w.first, list(w.latest)
    rise = _mean([s.reward for s in now]) - _mean([s.reward for s in before])
    if rise < cfg.reward_rise:
        return None
    for what, get in (("completion length", "length"), ("tool calls", "tool_calls")):
        was, is_ = _mean([getattr(s, get) for s in before]), _mean([getattr(s, get) for s in now])
        if was > 0 and is_ <= cfg.collapse * was:
            return (
                f"reward rose {rise:+.2f} while {what} fell from {was:.1f} to {is_:.1f} per "
                f"sample (first {cfg.window} samples vs the latest)"
            )
    return None


def restate(w: EnvWindows, cfg: TripwireConfig) -> str | None:
    now = list(w.latest) if len(w.latest) >= cfg.window else w.first
    if not cfg.restate or len(now) < cfg.window:
        return None
    echoes = sum(1 for s in now if s.restated and s.reward > 0)
    if echoes < cfg.restate * len(now):
        return None
    return f"{echoes} of the latest {len(now)} samples were rewarded for restating the prompt"


def canary(w: EnvWindows, cfg: TripwireConfig) -> str | None:
    if not cfg.canary_every:
        return None
    if cfg.canary_reward is not None:
        base, now = cfg.canary_reward, list(w.canary_latest) or w.canary_first
        if len(now) < cfg.window:
            return None
    else:
        if len(w.canary_latest) < cfg.window:
            return None
        base, now = _mean([s.reward for s in w.canary_first]), list(w.canary_latest)
    moved = _mean([s.reward for s in now]) - base
    if abs(moved) <= cfg.canary_shift:
        return None
    return f"canary prompts' reward moved {moved:+.2f} from {base:.2f} (the latest {len(now)})"


def disagree(w: EnvWindows, cfg: TripwireConfig) -> str | None:
    now = list(w.latest) if len(w.latest) >= cfg.window else w.first
    if not cfg.disagree or len(now) < cfg.window:
        return None
    judged = [s for s in now if JUDGE in s.components]
    checks = sorted(
        {n for s in judged for n in s.components if n != JUDGE}
        & (set(cfg.disagree_with) or {n for s in judged for n in s.components})
    )
    if not checks or len(judged) < cfg.window:
        return None
    apart: dict[str, int] = {}
    for s in judged:
        for n in checks:
            if n in s.components and abs(s.components[JUDGE] - s.components[n]) > cfg.disagree_by:
                apart[n] = apart.get(n, 0) + 1
    if not apart:
        return None
    name, n = max(apart.items(), key=lambda kv: kv[1])
    if n < cfg.disagree * len(judged):
        return None
    judge_mean = _mean([s.components[JUDGE] for s in judged])
    check_mean = _mean([s.components[name] for s in judged if name in s.components])
    return (
        f"the judge and {name} disagree (by more than {cfg.disagree_by:g}) on {n} of the latest "
        f"{len(judged)} samples (judge mean {judge_mean:.2f}, {name} mean {check_mean:.2f})"
    )


Check = Callable[[EnvWindows, TripwireConfig], str | None]
# The checks, in order; the first that fires is the environment's reason.
CHECKS: list[tuple[str, Check]] = [
    ("collapse", collapse),
    ("restate", restate),
    ("canary", canary),
    ("disagree", disagree),
]


@dataclass
class Tripwires:
    """Tails a run's ``groups`` streams (every shard's) and checks each environment of the
    stored mixture after every fold; ``check`` returns the newly fired reasons by env."""

    r: redis.Redis
    run: str
    windows: dict[str, EnvWindows] = field(default_factory=dict)
    fired: dict[str, str] = field(default_factory=dict)
    cursors: dict[str, str] = field(default_factory=dict)

    def fold(self, mix: Mixture) -> None:
        sizes = {e.name: e.tripwires.window for e in mix.envs if e.tripwires.enabled}
        for keys in run_shards(self.r, self.run):
            stream = keys.groups
            while True:
                last = self.cursors.get(stream, "0-0")
                rows = self.r.xrange(stream, min=f"({last}", count=500)
                if not rows:
                    break
                for eid, fields in rows:
                    self.cursors[stream] = as_str(eid)
                    self._take(fields, sizes)

    def _take(self, fields: dict, sizes: dict[str, int]) -> None:
        try:
            group = schema.GROUP.decode(fields[b"p"])
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
            return
        for sample in group.samples:
            name = sample.trajectory.env
            if name not in sizes or (s := seen(sample)) is None:
                continue
            w = self.windows.setdefault(name, EnvWindows(sizes[name]))
            w.add(s, group.prompt_id.startswith(CANARY))

    def check(self) -> dict[str, str]:
        """Fold what is new, run the checks, pause what fired; the new reasons by env."""
        from streamrl.producer.mixture import load

        mix = load(self.r, self.run)
        if mix is None:
            return {}
        held = paused(self.r, self.run)
        for name in [n for n in self.fired if n not in held]:  # resumed: watch afresh
            self.fired.pop(name)
            self.windows.pop(name, None)
        self.fold(mix)
        new: dict[str, str] = {}
        for e in mix.envs:
            w = self.windows.get(e.name)
            if w is None or not e.tripwires.enabled or e.name in self.fired:
                continue
            for label, chk in CHECKS:
                reason = chk(w, e.tripwires)
                if reason:
                    line = f"tripwire {label}: {reason}"
                    self.fired[e.name] = new[e.name] = line
                    self.r.hset(Keys(self.run).tripped, e.name, line)
                    if e.tripwires.pause:
                        pause(self.r, self.run, e.name, line)
                    log.warning("tripwire fired", env=e.name, reason=line, paused=e.tripwires.pause)
                    break
        return new
