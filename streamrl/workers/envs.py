"""Which environment (and which reward functions) a task's ``env`` name stands for.

A task names its environment. In a mixture that name is an ``[[envs]]`` entry's (its
``env``, ``env_options`` and ``verifier``), looked up in the run's stored mixture; a name the
worker has not met is looked up again in Redis first, so an environment added with
``streamrl mix`` is built on its first task, with no restart. Any other name is an
environment's own (the run's ``env`` with its options, or one a dataset row names).
An environment is built once per lease and kept: an entry whose options change mid-run needs
a new name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from streamrl.config import JUDGE, MIXTURE, EnvEntry, Mixture, RunConfig
from streamrl.envs import Environment, make_env
from streamrl.verifiers.judge import Judge
from streamrl.verifiers.reward_functions import RewardFunctions

_UNSET: Any = object()  # the run's reward functions, not built yet (None: it has none)


@dataclass
class EnvTable:
    config: RunConfig
    r: Any = None  # a sync Redis client: a judge's shared call pool and cache (verify side)
    entries: dict[str, EnvEntry] = field(default_factory=dict)
    envs: dict[str, Environment] = field(default_factory=dict)
    rewards: dict[str, RewardFunctions | None] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _judge: Judge | None = None
    _run_rewards: Any = _UNSET

    def __post_init__(self) -> None:
        if self.config.envs:
            self.learn(self.config.mixture())

    def knows(self, name: str) -> bool:
        """Built already, or an entry of the mixture read so far."""
        return name in self.envs or name in self.entries

    def learn(self, mix: Mixture | bytes | None) -> None:
        """Take in the stored mixture (``srl:{run}:mix``, raw or decoded)."""
        if isinstance(mix, bytes):
            mix = MIXTURE.decode(mix)
        for e in mix.envs if mix is not None else []:
            self.entries[e.name] = e

    async def look_up(self, name: str, get: Callable[[], Awaitable[bytes | None]]) -> None:
        """``learn`` the stored mixture (``get``) for a name not known yet, one lookup at a
        time: the many episodes of a new environment that start at once cost one read of
        Redis (and one connection of the pool), not one each."""
        if self.knows(name):  # every episode asks: the known names take no lock
            return
        async with self._lock:
            if not self.knows(name):
                self.learn(await get())

    def env(self, name: str) -> Environment:
        env = self.envs.get(name)
        if env is None:
            entry = self.entries.get(name)
            if entry is not None:
                env = make_env(entry.env, **entry.env_options)
            else:
                opts = self.config.env_options if name == self.config.env else {}
                env = make_env(name, **opts)
            self.envs[name] = env
        return env

    def reward_functions(self, name: str) -> RewardFunctions | None:
        """The reward functions that score ``name``'s samples: its entry's, else the run's
        (one instance for every name that uses them); None: the environment verifies its
        own. Every instance shares the run's one judge."""
        if name not in self.rewards:
            entry = self.entries.get(name)
            if entry is not None and entry.verifier:
                self.rewards[name] = self._build(list(entry.verifier), entry.reward_weights)
            else:
                if self._run_rewards is _UNSET:
                    cfg = self.config
                    self._run_rewards = self._build(cfg.reward_functions, cfg.reward_weights)
                self.rewards[name] = self._run_rewards
        return self.rewards[name]

    def _build(self, names: list[str], weights: list[float] | None) -> RewardFunctions | None:
        if not names:
            return None
        if JUDGE in names and self._judge is None and self.config.judge is not None:
            self._judge = Judge(self.config.judge, self.r, self.config.run)
        return RewardFunctions(names, weights, self._judge if JUDGE in names else None)
