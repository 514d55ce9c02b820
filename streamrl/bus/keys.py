"""Key names of one run. Every key carries a hash tag so that all keys a Lua script touches
live in one Redis Cluster slot.

Shards. A run's streams may be split into N shards (``[streams] shards``) so that it spreads
over several Redis Cluster nodes. Shard ``s`` of N carries its own tag (``shard_tag``): its
streams (tasks, rollouts, scored, groups, dead), its stats, sessions, group-assembly hashes
and producer positions. A prompt's samples all go to one shard, so every script still touches
one slot. What belongs to the whole run (config, halt, fault, policy stream, learner progress,
producer state, policy health) keeps the tag ``{r}``. An unsharded run (N = 1) has no shard
index and its keys are exactly ``srl:{r}:...``, as they always were.

Where the shards land. A cluster made by ``redis-cli --cluster create`` (or any balanced one)
gives each of M masters one contiguous Mth of the 16384 slots. Shard ``s`` of N is tagged so
that its slot lies in the middle half of the sth Nth of the slot space: ``{r:s}`` when CRC16
puts it there, else ``{r:s:j}`` for the first ``j`` that does. So N shards on N balanced
masters land one on each, whatever the run is called (plain ``{r:s}`` tags did for about 2
runs in 9 with 3 shards on 3 masters).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from streamrl.defaults import KEY_PREFIX


@lru_cache(maxsize=4096)
def shard_tag(run: str, shard: int, shards: int) -> str:
    """The hash tag of shard ``shard`` of ``shards``: one whose slot lies in the middle half
    of the shard's own ``1/shards`` of the slot space (see the module's docstring)."""
    width = REDIS_CLUSTER_HASH_SLOTS / shards
    low, high = (shard + 0.25) * width, (shard + 0.75) * width
    j = 0
    while True:
        tag = f"{run}:{shard}" if j == 0 else f"{run}:{shard}:{j}"
        if low <= key_slot(tag.encode()) < high:
            return tag
        j += 1


@dataclass(frozen=True)
class Keys:
    run: str
    shard: int | None = None  # None: the run's own keys (and those of an unsharded run)
    shards: int = 1  # how many shards the run has: a shard's tag depends on it

    def __post_init__(self) -> None:
        if self.shard is not None and not 0 <= self.shard < self.shards:
            raise ValueError(f"shard {self.shard} of a run with {self.shards} shard(s)")

    @property
    def tag(self) -> str:
        return self.run if self.shard is None else shard_tag(self.run, self.shard, self.shards)

    def key(self, *parts: str) -> str:
        """A key of this shard (of the run itself when unsharded)."""
        return ":".join((KEY_PREFIX, "{" + self.tag + "}", *parts))

    def run_key(self, *parts: str) -> str:
        """A key of the whole run, whichever shard asks."""
        return ":".join((KEY_PREFIX, "{" + self.run + "}", *parts))

    @property
    def label(self) -> str:
        """How status and replay name this shard: ``"0"``, ``"1"``, ...; ``""`` unsharded."""
        return "" if self.shard is None else str(self.shard)

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
        return self.run_key("policy")

    @property
    def dead(self) -> str:
        return self.key("dead")

    # keys
    @property
    def config(self) -> str:
        return self.run_key("config")

    @property
    def halt(self) -> str:
        """Set to ask every lease of the run to end now (a clean shutdown)."""
        return self.run_key("halt")

    @property
    def stats(self) -> str:
        return self.key("stats")

    @property
    def learner(self) -> str:
        """Hash with the learner's progress: step, policy version, groups consumed and dropped."""
        return self.run_key("learner")

    @property
    def policy_health(self) -> str:
        """Hash: rollout worker name -> ``WorkerPolicy`` (the version it serves, its last
        reload error), rewritten on every heartbeat of the worker's lease."""
        return self.run_key("policy_health")

    @property
    def fault(self) -> str:
        """A one-line reason why the run cannot make progress (a rollout worker stuck on an old
        policy); the learner and ``streamrl demo`` stop with it."""
        return self.run_key("fault")

    def session(self, task_id: str) -> str:
        return self.key("session", task_id)

    def group(self, prompt_id: str) -> str:
        return self.key("group", prompt_id)

    def producer(self, source: str) -> str:
        return self.key("producer", source)

    @property
    def producer_state(self) -> str:
        """Hash with the producer's gate: running or waiting, why, since when, its figures."""
        return self.run_key("producer_state")

    def judge_pool(self, endpoint: str) -> tuple[str, str, str]:
        """The call pool of one judge endpoint (a digest of its URL), shared by every verifier
        worker of the run: a sorted set of calls in flight (member: call id, score: when its
        lease ends), one of recent call starts (score: when), and the endpoint's hold (a
        string whose TTL is the back-off it asked for), all under the run's tag."""
        pool = ("judge", "pool", endpoint)
        return (
            self.run_key(*pool, "busy"),
            self.run_key(*pool, "starts"),
            self.run_key(*pool, "hold"),
        )

    def served(self, server: str) -> str:
        """Hash: the policy version one policy server (``server``: a digest of its root URL)
        serves and the model name requests use, written by the worker that updated it."""
        return self.run_key("served", server)

    def server_slots(self, server: str) -> str:
        """Sorted set: the requests on one policy server now, across every rollout worker of
        the run (member: request id, score: when its lease ends, Redis ms), bounded by the
        ``openai`` backend's ``max_inflight_per_server`` (``streamrl.policy.server_slots``)."""
        return self.run_key("served", server, "slots")

    def server_slot_queue(self, server: str) -> tuple[str, str]:
        """The requests waiting for a slot of one policy server, first come first served
        across workers: a sorted set request id -> when it first asked (Redis µs, strictly
        increasing), and one request id -> when it stops counting unless it asks again (Redis
        ms; a waiter that was killed)."""
        queue = self.run_key("served", server, "queue")
        return queue, queue + "_until"

    @property
    def server_picks(self) -> tuple[str, str]:
        """Which policy server each rollout worker was given (``[policy] base_url`` as a list):
        a hash worker -> server URL and a sorted set worker -> when that ends (Redis ms)."""
        return self.run_key("served", "picks"), self.run_key("served", "picks_until")

    def judge_cache(self, version: str, digest: str) -> str:
        """A judge's answer to one trajectory, kept so that it is paid for once."""
        return self.run_key("judge", "cache", version, digest)

    @property
    def judge_stats(self) -> str:
        """Hash: the run's judge figures (samples judged, calls made, cache hits, failures)."""
        return self.run_key("judge", "stats")

    @property
    def mix(self) -> str:
        """The run's weighted mixture of environments (``config.Mixture``, msgpack)."""
        return self.run_key("mix")

    @property
    def mix_paused(self) -> str:
        """Hash: environment name -> the one-line reason its prompts are paused (a tripwire)."""
        return self.run_key("mix_paused")

    @property
    def tripped(self) -> str:
        """Hash: environment name -> the last reward-hacking tripwire that fired on it."""
        return self.run_key("tripped")

    @property
    def mix_rows(self) -> str:
        """Hash: environment name -> rows of its dataset pushed so far (a mixture's datasets)."""
        return self.run_key("mix_rows")

    @property
    def data_streams(self) -> tuple[str, ...]:
        return (self.tasks, self.rollouts, self.scored, self.groups, self.policy, self.dead)


def shard_keys(run: str, shards: int = 1) -> list[Keys]:
    """The keys of each shard of a run: ``[Keys(run)]`` when unsharded."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if shards == 1:
        return [Keys(run)]
    return [Keys(run, s, shards) for s in range(shards)]


def shard_of(index: int, shards: int) -> int:
    """The shard of a run's ``index``-th prompt: round robin, so shards fill evenly and a
    restarted producer sends every prompt where it sent it before."""
    return index % shards
