"""Key names of one run. Every key carries the hash tag ``{run}`` so that all keys a Lua
script touches live in one Redis Cluster slot."""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.defaults import KEY_PREFIX


@dataclass(frozen=True)
class Keys:
    run: str

    def key(self, *parts: str) -> str:
        return ":".join((KEY_PREFIX, "{" + self.run + "}", *parts))

    # streams
    @property
    def tasks(self) -> str:
        return self.key("tasks")

    @property
    def rollouts(self) -> str:
        return self.key("rollouts")

    @property
    def scored(self) -> str:
        return self.key("scored")

    @property
    def groups(self) -> str:
        return self.key("groups")

    @property
    def policy(self) -> str:
        return self.key("policy")

    @property
    def dead(self) -> str:
        return self.key("dead")

    # keys
    @property
    def config(self) -> str:
        return self.key("config")

    @property
    def halt(self) -> str:
        """Set to ask every lease of the run to end now (a clean shutdown)."""
        return self.key("halt")

    @property
    def stats(self) -> str:
        return self.key("stats")

    @property
    def learner(self) -> str:
        """Hash with the learner's progress: step, policy version, groups consumed and dropped."""
        return self.key("learner")

    @property
    def policy_health(self) -> str:
        """Hash: rollout worker name -> ``WorkerPolicy`` (the version it serves, its last
        reload error), rewritten on every heartbeat of the worker's lease."""
        return self.key("policy_health")

    @property
    def fault(self) -> str:
        """A one-line reason why the run cannot make progress (a rollout worker stuck on an old
        policy); the learner and ``streamrl demo`` stop with it."""
        return self.key("fault")

    def session(self, task_id: str) -> str:
        return self.key("session", task_id)

    def group(self, prompt_id: str) -> str:
        return self.key("group", prompt_id)

    def producer(self, source: str) -> str:
        return self.key("producer", source)

    @property
    def producer_state(self) -> str:
        """Hash with the producer's gate: running or waiting, why, since when, its figures."""
        return self.key("producer_state")

    @property
    def data_streams(self) -> tuple[str, ...]:
        return (self.tasks, self.rollouts, self.scored, self.groups, self.policy, self.dead)
