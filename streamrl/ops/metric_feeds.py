"""What ``streamrl metrics`` folds as it tails a run's ``scored`` and ``dead`` streams: the
reward histogram per environment, the score failures, and the dead letters by stage and
reason class. The only state the exporter holds; a restarted exporter folds again from the
entries still in the streams, as Prometheus counters may restart."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import msgspec
import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.values import as_str, id_order
from streamrl.defaults import MASKED
from streamrl.ops.metric_families import Families
from streamrl.ops.status import env_of_dead_letter

# Dead-letter reasons are free text (they carry the error); the label is the class.
_DEAD_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("max_deliveries", r"^delivered \d+ times"),
        ("undecodable", r"^undecodable "),
        ("rollout_failed", r"^rollout failed"),
        ("impossible_sample", r"^impossible sample"),
        ("verifier_timeout", r"did not finish within|timed out"),
        ("verifier_error", r"^verifier .* raised "),
        ("bad_row", r"^[^\s:]+:\d+: "),  # the producer's `<file>:<line>: why`
    )
)
DEAD_LETTER_CLASSES = (*(name for name, _ in _DEAD_CLASSES), "masked", "other")


def dead_letter_class(reason: str) -> str:
    """The bounded label for a dead letter's free-text reason."""
    for name, pattern in _DEAD_CLASSES:
        if pattern.search(reason):
            return name
    return "other"


@dataclass
class _Histogram:
    """Cumulative bucket counts of one label set, Prometheus-style."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    def buckets(self) -> list[tuple[str, int]]:
        out = [(_le(b), c) for b, c in zip(self.bounds, self.counts, strict=True)]
        return [*out, ("+Inf", self.n)]


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass
class _Tail:
    """A cursor over one stream: what has been read so far."""

    last: str = "0-0"

    def read(self, r: redis.Redis, stream: str, limit: int) -> list[tuple[str, dict]]:
        """Entries after the cursor, at most ``limit``. A stream that was deleted and made
        again (its newest ID behind the cursor) is read again from its start."""
        newest = r.xrevrange(stream, count=1)
        if newest and id_order(newest[0][0]) < id_order(self.last):
            self.last = "0-0"
        out: list[tuple[str, dict]] = []
        while len(out) < limit:
            rows = r.xrange(stream, min=f"({self.last}", count=min(2000, limit - len(out)))
            if not rows:
                break
            for eid, fields in rows:
                self.last = as_str(eid)
                out.append((self.last, fields))
        return out


@dataclass
class RunFeeds:
    """What the exporter folded from one run's ``scored`` and ``dead`` streams."""

    buckets: tuple[float, ...]  # the reward histogram's upper bounds
    scored: _Tail = field(default_factory=_Tail)
    dead: _Tail = field(default_factory=_Tail)
    rewards: dict[str, _Histogram] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    dead_letters: dict[tuple[str, str], int] = field(default_factory=dict)
    masked: dict[tuple[str, str], int] = field(default_factory=dict)  # (env, failure_kind)
    dead_by_env: dict[str, int] = field(default_factory=dict)

    def fold(self, r: redis.Redis, keys: Keys, default_env: str, tail_max: int) -> None:
        """Fold the entries added since the last scrape, at most ``tail_max`` per stream;
        ``default_env`` labels the scores that do not name their environment."""
        for _eid, fields in self.scored.read(r, keys.scored, tail_max):
            try:
                score = schema.SCORE.decode(fields[b"p"])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                continue
            env = score.env or default_env
            if score.reward is None:
                self.failures[env] = self.failures.get(env, 0) + 1
                if score.failure_kind.startswith(MASKED):
                    key = (env, score.failure_kind[len(MASKED) :])
                    self.masked[key] = self.masked.get(key, 0) + 1
            else:
                self.rewards.setdefault(env, _Histogram(self.buckets)).observe(score.reward)
        for _eid, fields in self.dead.read(r, keys.dead, tail_max):
            try:
                dl = schema.DEAD_LETTER.decode(fields[b"p"])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                key = ("unknown", "undecodable")
                self.dead_by_env["unknown"] = self.dead_by_env.get("unknown", 0) + 1
            else:
                env = env_of_dead_letter(dl)
                self.dead_by_env[env] = self.dead_by_env.get(env, 0) + 1
                masked = dl.kind.startswith(MASKED)
                key = (dl.stage, "masked" if masked else dead_letter_class(dl.reason))
            self.dead_letters[key] = self.dead_letters.get(key, 0) + 1

    def report(self, f: Families, run: str) -> None:
        """Add what has been folded so far to this scrape's families."""
        for env, hist in sorted(self.rewards.items()):
            f.reward.add_metric([run, env], hist.buckets(), hist.total)
        for env in sorted(set(self.rewards) | set(self.failures)):
            f.score_failures.add_metric([run, env], self.failures.get(env, 0))
        for (stage, reason), n in sorted(self.dead_letters.items()):
            f.dead_letters.add_metric([run, stage, reason], n)
        for (env, kind), n in sorted(self.masked.items()):
            f.masked_samples.add_metric([run, env, kind], n)
        for env, n in sorted(self.dead_by_env.items()):
            f.env_dead_letters.add_metric([run, env], n)
