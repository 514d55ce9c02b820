"""Least-privilege Redis 7 ACL users, one per role of a run: the keys each role may read
(``%R~``) or read and write (``~``), the commands it may run, and rq's keys and channels for
the roles that run rq workers.

Key patterns follow ``keys.py``: a run's own keys are ``srl:{run}:...``; a sharded run's
shard keys carry the tag ``{run:s}`` or ``{run:s:j}``, matched by ``srl:{run:[0-9]*}:...``.
Redis 7 checks every key a command (a Lua script's declared KEYS included) names against
these patterns. ACLs cannot say *which* script a user may run: a user allowed EVALSHA may run
any script, but only on keys its patterns allow. Setting a run up (its config, streams and
consumer groups, ``srl:runs``) is the operator's job, with an admin user.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from streamrl.bus.keys import Keys
from streamrl.defaults import KEY_PREFIX, RUNS_KEY

ROLES = ("producer", "rollout", "verify", "learner", "observer")

# Data commands, scripts and connection handling; nothing of @admin or @dangerous (CONFIG,
# FLUSHALL, KEYS, DEBUG, CLIENT KILL, ...) except INFO, which the maxmemory-policy check reads,
# and TIME (only @fast), the clock the judge's call pool keeps in Redis (bus/limiter.py).
_SCRIPTS = "+eval +evalsha +script|load +script|exists"
_WORKER_COMMANDS = (
    "-@all +@read +@write +@stream +@hash +@string +@set +@list +@sortedset +@keyspace "
    f"+@transaction +@pubsub +@blocking +@connection {_SCRIPTS} -@admin -@dangerous +info +time"
)
_OBSERVER_COMMANDS = "-@all +@read +@connection -@admin -@dangerous -@write +info"

# What each role writes, as key suffixes of the run (``srl:{run}:...``) and of its shards
# (the same names under a shard's tag); everything else of the run it may only read. ``none``
# is the placeholder a verify worker's dead-letter call declares, ``topup:*`` the rate gate of
# the leases that rq workers queue themselves, ``served:*`` the openai backend's served versions,
# server slots and server picks.
_SHARD = ("tasks", "rollouts", "scored", "groups", "dead", "stats", "session:*", "group:*",
          "producer:*", "none", "served:*")  # fmt: skip
_WRITES = {
    # the mixture's keys too: the producer seeds the mixture, pauses what trips a tripwire
    # and counts dataset rows; `streamrl mix` runs as the producer (or an admin)
    "producer": (
        "tasks",
        "producer:*",
        "producer_state",
        "stats",
        "mix",
        "mix_paused",
        "mix_rows",
        "tripped",
    ),
    "rollout": (
        "tasks",
        "rollouts",
        "stats",
        "session:*",
        "dead",
        "group:*",
        "policy_health",
        "fault",
        "served:*",
        "topup:*",
    ),
    "verify": (
        "tasks",  # verify leases trim every stream of the run (bus/trim.py) as they end
        "rollouts",
        "scored",
        "groups",
        "group:*",
        "session:*",
        "none",
        "stats",
        "dead",
        "topup:*",
        "judge:*",  # the judge's call pool and answer cache (verifiers/judge.py)
    ),
    "learner": ("*",),
    "observer": (),
}
RQ_ROLES = ("rollout", "verify")  # these run rq workers: rq's keys and pub/sub channels


def _glob_escape(s: str) -> str:
    """A run name as a literal in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def run_patterns(run: str) -> tuple[str, str]:
    """Glob prefixes of the run's own keys and of its shards' keys (any shard count)."""
    tag = Keys(run).tag
    assert tag == run
    r = _glob_escape(run)
    return f"{KEY_PREFIX}:{{{r}}}:", f"{KEY_PREFIX}:{{{r}:[0-9]*}}:"


@dataclass(frozen=True)
class AclUser:
    role: str
    name: str
    password: str
    rules: tuple[str, ...]

    def setuser(self) -> list[str]:
        """The ``ACL SETUSER`` arguments."""
        return [self.name, "reset", "on", f">{self.password}", *self.rules]

    def line(self) -> str:
        return "ACL SETUSER " + " ".join(self.setuser())


def role_rules(role: str, run: str) -> tuple[str, ...]:
    """Key patterns, channels and commands of one role on one run."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    prefixes = run_patterns(run)
    keys = [f"%R~{p}*" for p in prefixes]
    for w in _WRITES[role]:  # a run-wide key under the run's tag only
        keys += [f"~{p}{w}" for p in (prefixes if w in (*_SHARD, "*") else prefixes[:1])]
    keys.append(f"%R~{RUNS_KEY}")
    channels = ["resetchannels"]
    if role in RQ_ROLES:
        keys.append("~rq:*")
        channels.append("&rq:*")
    elif role == "observer":
        keys.append("%R~rq:*")
    commands = _OBSERVER_COMMANDS if role == "observer" else _WORKER_COMMANDS
    return (*keys, *channels, *commands.split())


def users(run: str, passwords: dict[str, str] | None = None, prefix: str = "srl") -> list[AclUser]:
    """One user per role, named ``<prefix>-<run>-<role>``; missing passwords are generated."""
    passwords = passwords or {}
    return [
        AclUser(
            role,
            f"{prefix}-{run}-{role}",
            passwords.get(role) or secrets.token_urlsafe(24),
            role_rules(role, run),
        )
        for role in ROLES
    ]


def apply(r: object, acl_users: list[AclUser]) -> None:
    """Create or replace each user on the Redis ``r`` (a redis-py client with ACL rights)."""
    for u in acl_users:
        r.execute_command("ACL", "SETUSER", *u.setuser())  # type: ignore[attr-defined]
