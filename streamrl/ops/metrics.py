"""``streamrl metrics``: a Prometheus exporter that reads Redis when it is scraped.

Every figure comes from Redis at scrape time (streams, consumer groups, the run's counters,
the learner's progress hash, rq's worker registry), so one exporter covers a whole
deployment however many workers it has, and it holds no state a restart would lose except
the two histograms it folds from the ``scored`` and ``dead`` streams as it tails them
(counters that restart from the entries still in the streams, as Prometheus counters may).

Names follow Prometheus's conventions: ``_total`` counters, base units (``_seconds``,
``_bytes``), and only bounded label sets: ``run``, ``stream``/``group`` (the stage names),
``queue`` (two rq queues), ``env`` (registered environment names), ``reason`` (the fixed
classes of ``dead_letter_class`` and the learner's drop reasons) and ``staleness`` (at most
``max_staleness + 1`` values).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis
import structlog
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import stage_groups
from streamrl.bus.values import as_str, id_order
from streamrl.defaults import (
    METRICS_REWARD_BUCKETS,
    METRICS_TAIL_MAX_ENTRIES,
    ROLLOUT_QUEUE,
    RUNS_KEY,
    VERIFY_QUEUE,
)
from streamrl.log import Repeats

log = structlog.get_logger("streamrl.ops.metrics")
LEARNER_DROP_REASONS = ("stale", "zero_variance", "no_tokens", "invalid")
LEARNER_STATUSES = ("running", "stopped", "faulted")

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
DEAD_LETTER_CLASSES = (*(name for name, _ in _DEAD_CLASSES), "other")


def dead_letter_class(reason: str) -> str:
    """The bounded label for a dead letter's free-text reason."""
    for name, pattern in _DEAD_CLASSES:
        if pattern.search(reason):
            return name
    return "other"


def _num(v: Any) -> float | None:
    try:
        return float(as_str(v))
    except (TypeError, ValueError):
        return None


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
        if newest and id_order(as_str(newest[0][0])) < id_order(self.last):
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
class _RunFeeds:
    """What the exporter folded from one run's ``scored`` and ``dead`` streams."""

    scored: _Tail = field(default_factory=_Tail)
    dead: _Tail = field(default_factory=_Tail)
    rewards: dict[str, _Histogram] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    dead_letters: dict[tuple[str, str], int] = field(default_factory=dict)


class PipelineCollector(Collector):
    """Reads the runs ``runs()`` names from Redis on every ``collect()``."""

    def __init__(
        self,
        r: redis.Redis,
        runs: Callable[[], Iterable[str]],
        buckets: tuple[float, ...] = METRICS_REWARD_BUCKETS,
        tail_max: int = METRICS_TAIL_MAX_ENTRIES,
    ):
        self.r = r
        self.runs = runs
        self.buckets = tuple(sorted(buckets))
        self.tail_max = tail_max
        self._feeds: dict[str, _RunFeeds] = {}
        self._lock = threading.Lock()  # two scrapes at once must not fold an entry twice
        self._repeats = Repeats()  # Redis down: one line, not one per scrape

    def describe(self) -> list[Metric]:
        return []  # names depend on what Redis holds; nothing is collected at registration

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        up = GaugeMetricFamily("streamrl_redis_up", "1 if the exporter could read Redis.")
        with self._lock:
            try:
                families = list(self._collect())
            except redis.RedisError as e:
                families = []
                up.add_metric([], 0)
                skipped = self._repeats.check("redis", str(e))
                if skipped is not None:
                    log.warning("cannot read Redis", error=str(e), repeats_not_logged=skipped)
            else:
                up.add_metric([], 1)
                self._repeats.clear("redis")
        yield up
        yield from families
        took = GaugeMetricFamily(
            "streamrl_scrape_duration_seconds", "How long reading Redis took for this scrape."
        )
        took.add_metric([], time.perf_counter() - started)
        yield took

    # ------------------------------------------------------------------ per scrape
    def _collect(self) -> Iterator[Metric]:
        runs = sorted(set(self.runs()))
        f = _Families()
        now = time.time()
        for run in runs:
            self._run(f, run, now)
        self._rq(f)
        self._redis(f)
        yield from f.all()

    def _run(self, f: _Families, run: str, now: float) -> None:
        from streamrl.bus.health import policy_health
        from streamrl.ops.status import stream_info

        r, keys = self.r, Keys(run)
        for stream in keys.data_streams:
            name = stream.rsplit(":", 1)[1]
            f.stream_length.add_metric([run, name], r.xlen(stream))
        for stream, _group in stage_groups(keys):
            name = stream.rsplit(":", 1)[1]
            for group, g in stream_info(r, stream)["groups"].items():
                labels = [run, name, group]
                if g.get("lag") is not None:
                    f.lag.add_metric(labels, g["lag"])
                f.pending.add_metric(labels, g.get("pending") or 0)
                f.consumers.add_metric(labels, g.get("consumers") or 0)

        stats = {as_str(k): _num(v) or 0.0 for k, v in r.hgetall(keys.stats).items()}
        f.trajectories.add_metric([run], stats.get("trajectories", 0.0))
        f.scored.add_metric([run], stats.get("scored", 0.0))
        f.groups_completed.add_metric([run], stats.get("groups_completed", 0.0))
        f.duplicates.add_metric([run], stats.get("duplicates_ignored", 0.0))
        f.groups_dropped.add_metric([run, "failed_sample"], stats.get("groups_dropped", 0.0))

        last = r.xrevrange(keys.policy, count=1)
        if last:
            pv = schema.POLICY_VERSION.decode(last[0][1][b"p"])
            f.policy_version.add_metric([run], pv.version)
            if pv.created_at:
                f.policy_age.add_metric([run], max(0.0, now - pv.created_at))

        self._learner(f, run, keys, now)
        self._producer(f, run, keys)
        health = policy_health(r, keys, now)
        workers = health["workers"].values()
        f.faulted.add_metric([run], 1 if health["fault"] else 0)
        f.behind.add_metric([run], sum(1 for w in workers if w["behind_s"] is not None))
        f.reload_failing.add_metric([run], sum(1 for w in workers if w["error"]))
        self._feeds_of(f, run, keys)

    def _learner(self, f: _Families, run: str, keys: Keys, now: float) -> None:
        raw = {as_str(k): as_str(v) for k, v in self.r.hgetall(keys.learner).items()}
        if not raw:
            return
        num = {k: _num(v) for k, v in raw.items()}
        status = raw.get("status", "")
        for s in LEARNER_STATUSES:
            f.learner_status.add_metric([run, s], 1 if status == s else 0)
        gauges = (
            (f.learner_step, "step"),
            (f.learner_policy_version, "policy_version"),
            (f.learner_loss, "loss"),
            (f.learner_reward_mean, "reward_mean"),
            (f.learner_entropy, "entropy"),
            (f.learner_grad_norm, "grad_norm"),
            (f.learner_lr, "lr"),
            (f.learner_waiting, "waiting_groups"),
            (f.learner_max_in_flight, "max_in_flight"),
        )
        for family, key in gauges:
            if num.get(key) is not None:
                family.add_metric([run], num[key])
        counters = (
            (f.learner_consumed, "groups_consumed"),
            (f.learner_samples, "samples_consumed"),
            (f.learner_tokens, "tokens_trained"),
            (f.learner_is_tokens, "is_tokens"),
            (f.learner_is_clipped, "is_clipped"),
        )
        for family, key in counters:
            family.add_metric([run], num.get(key) or 0.0)
        for reason in LEARNER_DROP_REASONS:
            f.groups_dropped.add_metric([run, reason], num.get(f"dropped_{reason}") or 0.0)
        try:
            by_staleness = msgspec.json.decode(raw.get("applied_staleness") or "{}", type=dict)
        except msgspec.DecodeError:
            by_staleness = {}
        for behind, n in sorted(by_staleness.items(), key=lambda kv: int(kv[0])):
            f.learner_applied.add_metric([run, str(behind)], n)
        if not by_staleness and num.get("groups_applied"):  # a learner that does not say
            f.learner_applied.add_metric([run, "unknown"], num["groups_applied"] or 0.0)
        ckpt = num.get("last_checkpoint_time") or 0.0
        if ckpt > 0:
            f.checkpoint_time.add_metric([run], ckpt)
            f.checkpoint_age.add_metric([run], max(0.0, now - ckpt))
        if num.get("updated_at"):
            f.learner_updated_age.add_metric([run], max(0.0, now - (num["updated_at"] or 0.0)))

    def _producer(self, f: _Families, run: str, keys: Keys) -> None:
        raw = {as_str(k): as_str(v) for k, v in self.r.hgetall(keys.producer_state).items()}
        if not raw:
            return
        f.producer_waiting.add_metric([run], 1 if raw.get("state") == "waiting" else 0)
        in_flight = _num(raw.get("in_flight"))
        if in_flight is not None:
            f.producer_in_flight.add_metric([run], in_flight)

    def _feeds_of(self, f: _Families, run: str, keys: Keys) -> None:
        feeds = self._feeds.setdefault(run, _RunFeeds())
        default_env = self._run_env(keys)
        for _eid, fields in feeds.scored.read(self.r, keys.scored, self.tail_max):
            try:
                score = schema.SCORE.decode(fields[b"p"])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                continue
            env = score.env or default_env
            if score.reward is None:
                feeds.failures[env] = feeds.failures.get(env, 0) + 1
            else:
                hist = feeds.rewards.setdefault(env, _Histogram(self.buckets))
                hist.observe(score.reward)
        for _eid, fields in feeds.dead.read(self.r, keys.dead, self.tail_max):
            try:
                dl = schema.DEAD_LETTER.decode(fields[b"p"])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                key = ("unknown", "undecodable")
            else:
                key = (dl.stage, dead_letter_class(dl.reason))
            feeds.dead_letters[key] = feeds.dead_letters.get(key, 0) + 1
        for env, hist in sorted(feeds.rewards.items()):
            f.reward.add_metric([run, env], hist.buckets(), hist.total)
        for env in sorted(set(feeds.rewards) | set(feeds.failures)):
            f.score_failures.add_metric([run, env], feeds.failures.get(env, 0))
        for (stage, reason), n in sorted(feeds.dead_letters.items()):
            f.dead_letters.add_metric([run, stage, reason], n)

    def _run_env(self, keys: Keys) -> str:
        """The run config's environment: the label of scores that do not name theirs."""
        from streamrl.workers.context import read_config

        try:
            cfg = read_config(self.r.get(keys.config))
        except Exception:  # a config this version cannot read still has rewards worth counting
            cfg = None
        return cfg.env if cfg is not None else "unknown"

    def _rq(self, f: _Families) -> None:
        from streamrl.workers import leases

        for queue in (ROLLOUT_QUEUE, VERIFY_QUEUE):
            h = leases.queue_health(self.r, queue)
            f.rq_workers.add_metric([queue], h["workers"])
            f.rq_busy.add_metric([queue], h["busy"])
            f.rq_registered.add_metric([queue], h["registered"])
            f.rq_queued.add_metric([queue], h["queued_leases"])
            f.rq_failed.add_metric([queue], h["failed_leases"])

    def _redis(self, f: _Families) -> None:
        info = self.r.info("memory")
        f.redis_used.add_metric([], info.get("used_memory", 0))
        f.redis_max.add_metric([], info.get("maxmemory", 0))


class _Families:
    """The metric families of one scrape, with their help text."""

    def __init__(self) -> None:
        g, c = GaugeMetricFamily, CounterMetricFamily
        run, stage = ["run"], ["run", "stream", "group"]
        self.stream_length = g(
            "streamrl_stream_length", "Entries in a run's stream.", labels=["run", "stream"]
        )
        self.lag = g(
            "streamrl_consumer_group_lag", "Entries not yet delivered to the group.", labels=stage
        )
        self.pending = g(
            "streamrl_consumer_group_pending", "Entries delivered, not yet acked.", labels=stage
        )
        self.consumers = g(
            "streamrl_consumer_group_consumers", "Consumers in the group.", labels=stage
        )
        self.trajectories = c(
            "streamrl_trajectories", "Trajectories finished by rollout workers.", labels=run
        )
        self.scored = c("streamrl_samples_scored", "Samples scored with a reward.", labels=run)
        self.groups_completed = c(
            "streamrl_groups_completed", "Groups assembled and written to `groups`.", labels=run
        )
        self.groups_dropped = c(
            "streamrl_groups_dropped",
            "Groups never trained on, by reason: failed_sample (a sample was dead-lettered) or "
            "the learner's stale, zero_variance, no_tokens, invalid.",
            labels=["run", "reason"],
        )
        self.duplicates = c(
            "streamrl_duplicate_samples_ignored", "Re-sent samples ignored.", labels=run
        )
        self.dead_letters = c(
            "streamrl_dead_letters",
            "Entries that left their stage for good, by stage and reason class (folded from "
            "the dead-letter stream since the exporter started).",
            labels=["run", "stage", "reason"],
        )
        self.reward = HistogramMetricFamily(
            "streamrl_reward",
            "Rewards on the scored feed, by environment (folded since the exporter started).",
            labels=["run", "env"],
        )
        self.score_failures = c(
            "streamrl_score_failures",
            "Samples on the scored feed with no reward (a failure, never a 0).",
            labels=["run", "env"],
        )
        self.policy_version = g(
            "streamrl_policy_version", "Newest policy version announced.", labels=run
        )
        self.policy_age = g(
            "streamrl_policy_version_age_seconds",
            "Seconds since the newest policy version was announced.",
            labels=run,
        )
        self.faulted = g("streamrl_run_faulted", "1 while the run's fault key is set.", labels=run)
        self.behind = g(
            "streamrl_rollout_workers_behind_policy",
            "Rollout workers serving a version beyond max_staleness behind.",
            labels=run,
        )
        self.reload_failing = g(
            "streamrl_rollout_workers_reload_failing",
            "Rollout workers whose last policy reload failed.",
            labels=run,
        )
        self.learner_status = g(
            "streamrl_learner_status",
            "1 for the learner's current status.",
            labels=["run", "status"],
        )
        self.learner_step = g("streamrl_learner_step", "Optimizer steps taken.", labels=run)
        self.learner_policy_version = g(
            "streamrl_learner_policy_version", "Policy version the learner is at.", labels=run
        )
        self.learner_loss = g("streamrl_learner_loss", "Loss of the last step.", labels=run)
        self.learner_reward_mean = g(
            "streamrl_learner_reward_mean", "Mean reward of the last step's batch.", labels=run
        )
        self.learner_entropy = g(
            "streamrl_learner_entropy_nats", "Mean token entropy of the last batch.", labels=run
        )
        self.learner_grad_norm = g(
            "streamrl_learner_grad_norm", "Gradient norm of the last step.", labels=run
        )
        self.learner_lr = g(
            "streamrl_learner_learning_rate", "Learning rate of the last step.", labels=run
        )
        self.learner_waiting = g(
            "streamrl_learner_waiting_groups", "Accepted groups waiting for a batch.", labels=run
        )
        self.learner_max_in_flight = g(
            "streamrl_learner_max_in_flight_samples",
            "Admission limit the producer obeys.",
            labels=run,
        )
        self.learner_consumed = c(
            "streamrl_learner_groups_consumed", "Groups the learner read.", labels=run
        )
        self.learner_applied = c(
            "streamrl_learner_groups_applied",
            "Groups trained on, by how many policy versions behind the learner they were.",
            labels=["run", "staleness"],
        )
        self.learner_samples = c(
            "streamrl_learner_samples_consumed", "Samples in the groups read.", labels=run
        )
        self.learner_tokens = c(
            "streamrl_learner_tokens_trained", "Completion tokens trained on.", labels=run
        )
        self.learner_is_tokens = c(
            "streamrl_learner_importance_weight_tokens",
            "Completion tokens with a behaviour log-prob (an importance weight).",
            labels=run,
        )
        self.learner_is_clipped = c(
            "streamrl_learner_importance_weight_clipped_tokens",
            "Of those, tokens whose importance weight was truncated or masked.",
            labels=run,
        )
        self.checkpoint_time = g(
            "streamrl_learner_last_checkpoint_timestamp_seconds",
            "Unix time of the learner's last checkpoint.",
            labels=run,
        )
        self.checkpoint_age = g(
            "streamrl_learner_last_checkpoint_age_seconds",
            "Seconds since the learner's last checkpoint.",
            labels=run,
        )
        self.learner_updated_age = g(
            "streamrl_learner_last_report_age_seconds",
            "Seconds since the learner last wrote its progress.",
            labels=run,
        )
        self.producer_waiting = g(
            "streamrl_producer_waiting", "1 while admission control holds the producer.", labels=run
        )
        self.producer_in_flight = g(
            "streamrl_producer_in_flight_samples", "Samples in flight past the learner.", labels=run
        )
        q = ["queue"]
        self.rq_workers = g("streamrl_rq_workers", "Live rq workers on the queue.", labels=q)
        self.rq_busy = g("streamrl_rq_workers_busy", "Of those, workers holding a lease.", labels=q)
        self.rq_registered = g(
            "streamrl_rq_workers_registered", "Workers rq lists, live or dead.", labels=q
        )
        self.rq_queued = g("streamrl_rq_queued_leases", "Lease jobs waiting.", labels=q)
        self.rq_failed = g(
            "streamrl_rq_failed_leases", "Lease jobs in rq's failed registry.", labels=q
        )
        self.redis_used = g("streamrl_redis_memory_used_bytes", "INFO used_memory.")
        self.redis_max = g("streamrl_redis_memory_max_bytes", "INFO maxmemory (0: none).")

    def all(self) -> Iterator[Metric]:
        for value in vars(self).values():
            if isinstance(value, Metric) and value.samples:
                yield value


def run_names(r: redis.Redis, run: str, all_runs: bool) -> Callable[[], list[str]]:
    """The runs to export: ``run``, and with ``all_runs`` every run with a config."""

    def names() -> list[str]:
        if not all_runs:
            return [run]
        return sorted({run, *(as_str(x) for x in r.smembers(RUNS_KEY))})

    return names


def serve(
    r: redis.Redis,
    runs: Callable[[], Iterable[str]],
    port: int,
    addr: str = "0.0.0.0",
    ready: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve ``/metrics`` on ``addr:port`` until ``stop`` is set (or forever)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PipelineCollector(r, runs))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    if ready is not None:
        ready(server.server_port)
    stop = stop or threading.Event()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
        thread.join(5)
