"""``streamrl metrics``: a Prometheus exporter that reads Redis when it is scraped.

Every figure comes from Redis at scrape time (streams, consumer groups, the run's counters,
the learner's progress hash, rq's worker registry), so one exporter covers a whole
deployment however many workers it has, and it holds no state a restart would lose except
the two histograms it folds from the ``scored`` and ``dead`` streams as it tails them
(counters that restart from the entries still in the streams, as Prometheus counters may).

Names follow Prometheus's conventions: ``_total`` counters, base units (``_seconds``,
``_bytes``), and only bounded label sets: ``run``, ``stream``/``group`` (the stage names),
``queue`` (two rq queues), ``env`` (registered environment names), ``reason`` (the fixed
classes of ``metric_feeds.dead_letter_class`` and the learner's drop reasons) and
``staleness`` (at most ``max_staleness + 1`` values).

The families and their help text are in ``metric_families``, what is folded from the
streams in ``metric_feeds``; here, the scrape and the HTTP server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec
import redis
import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisClusterException

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import stage_groups
from streamrl.bus.values import as_str
from streamrl.defaults import (
    METRICS_REWARD_BUCKETS,
    METRICS_TAIL_MAX_ENTRIES,
    ROLLOUT_QUEUE,
    RUNS_KEY,
    VERIFY_QUEUE,
)
from streamrl.log import Repeats
from streamrl.ops.metric_families import Families
from streamrl.ops.metric_feeds import RunFeeds

log = structlog.get_logger("streamrl.ops.metrics")
_LEARNER_DROP_REASONS = ("stale", "zero_variance", "no_tokens", "invalid")
_LEARNER_STATUSES = ("running", "stopped", "faulted", "solved")


def _num(v: Any) -> float | None:
    try:
        return float(as_str(v))
    except (TypeError, ValueError):
        return None


class _Collector(Collector):
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
        self._feeds: dict[str, RunFeeds] = {}
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
            except (redis.RedisError, RedisClusterException) as e:  # down, or failing over
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
        f = Families()
        now = time.time()
        for run in runs:
            self._run(f, run, now)
        self._rq(f)
        self._redis(f)
        yield from f.all()

    def _run(self, f: Families, run: str, now: float) -> None:
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
        judge = {as_str(k): _num(v) or 0.0 for k, v in r.hgetall(keys.judge_stats).items()}
        if judge:  # a run with an LLM judge
            f.judge_samples.add_metric([run], judge.get("samples", 0.0))
            f.judge_calls.add_metric([run], judge.get("calls", 0.0))
            f.judge_cached.add_metric([run], judge.get("cached", 0.0))
            f.judge_failures.add_metric([run], judge.get("failures", 0.0))
            f.judge_throttled.add_metric([run], judge.get("throttled", 0.0))

        last = r.xrevrange(keys.policy, count=1)
        if last:
            pv = schema.POLICY_VERSION.decode(last[0][1][b"p"])
            f.policy_version.add_metric([run], pv.version)
            if pv.created_at:
                f.policy_age.add_metric([run], max(0.0, now - pv.created_at))

        self._learner(f, run, keys, now)
        self._producer(f, run, keys)
        self._mixture(f, run, keys)
        health = policy_health(r, keys, now)
        workers = health["workers"].values()
        f.faulted.add_metric([run], 1 if health["fault"] else 0)
        f.behind.add_metric([run], sum(1 for w in workers if w["behind_s"] is not None))
        f.reload_failing.add_metric([run], sum(1 for w in workers if w["error"]))
        servers: dict[str, list[int]] = {}
        for w in workers:
            if w.get("server"):
                load = servers.setdefault(w["server"], [0, 0])
                load[0] += w["in_flight"]
                load[1] += w["waiting"]
        for server, (in_flight, waiting) in sorted(servers.items()):
            f.policy_in_flight.add_metric([run, server], in_flight)
            f.policy_waiting.add_metric([run, server], waiting)
        self._feeds_of(f, run, keys)

    def _learner(self, f: Families, run: str, keys: Keys, now: float) -> None:
        raw = {as_str(k): as_str(v) for k, v in self.r.hgetall(keys.learner).items()}
        if not raw:
            return
        num = {k: _num(v) for k, v in raw.items()}
        status = raw.get("status", "")
        for s in _LEARNER_STATUSES:
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
            (f.learner_solved_rate, "solved_rate"),
            (f.learner_no_signal_rate, "no_signal_rate"),
            (f.learner_mismatch_abs, "mismatch_abs"),
            (f.learner_mismatch_kl, "mismatch_kl"),
            (f.learner_mismatch_tokens, "mismatch_tokens"),
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
            (f.learner_solved, "groups_solved"),
            (f.learner_no_signal_groups, "groups_no_signal"),
        )
        for family, key in counters:
            family.add_metric([run], num.get(key) or 0.0)
        if "no_signal" in raw:
            f.learner_no_signal.add_metric([run], 1 if raw["no_signal"] else 0)
        for reason in _LEARNER_DROP_REASONS:
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

    def _producer(self, f: Families, run: str, keys: Keys) -> None:
        raw = {as_str(k): as_str(v) for k, v in self.r.hgetall(keys.producer_state).items()}
        if not raw:
            return
        f.producer_waiting.add_metric([run], 1 if raw.get("state") == "waiting" else 0)
        in_flight = _num(raw.get("in_flight"))
        if in_flight is not None:
            f.producer_in_flight.add_metric([run], in_flight)

    def _mixture(self, f: Families, run: str, keys: Keys) -> None:
        """Per environment of a mixture: its weight, paused or tripped, the learner's figures."""
        from streamrl.ops.status import mixture_status

        learner = {as_str(k): as_str(v) for k, v in self.r.hgetall(keys.learner).items()}
        mix = mixture_status(self.r, run, [], learner)  # dead letters: from the feeds
        for row in (mix or {}).get("envs", []):
            labels = [run, row["name"]]
            f.env_weight.add_metric(labels, row["weight"])
            f.env_paused.add_metric(labels, 1 if row["paused"] else 0)
            f.env_tripped.add_metric(labels, 1 if row["tripped"] else 0)
            for family, key in (
                (f.env_reward, "reward_mean"),
                (f.env_solved, "solved_rate"),
                (f.env_no_signal, "no_signal_rate"),
                (f.env_rate, "samples_per_s"),
                (f.env_staleness, "staleness_mean"),
            ):
                if key in row:
                    family.add_metric(labels, row[key])

    def _feeds_of(self, f: Families, run: str, keys: Keys) -> None:
        feeds = self._feeds.get(run)
        if feeds is None:
            feeds = self._feeds[run] = RunFeeds(self.buckets)
        feeds.fold(self.r, keys, self._run_env(keys), self.tail_max)
        feeds.report(f, run)

    def _run_env(self, keys: Keys) -> str:
        """The run config's environment: the label of scores that do not name theirs."""
        from streamrl.workers.context import read_config

        try:
            cfg = read_config(self.r.get(keys.config))
        except Exception:  # a config this version cannot read still has rewards worth counting
            cfg = None
        return cfg.env if cfg is not None else "unknown"

    def _rq(self, f: Families) -> None:
        from streamrl.workers import leases

        for queue in (ROLLOUT_QUEUE, VERIFY_QUEUE):
            h = leases.queue_health(self.r, queue)
            f.rq_workers.add_metric([queue], h["workers"])
            f.rq_busy.add_metric([queue], h["busy"])
            f.rq_registered.add_metric([queue], h["registered"])
            f.rq_queued.add_metric([queue], h["queued_leases"])
            f.rq_failed.add_metric([queue], h["failed_leases"])

    def _redis(self, f: Families) -> None:
        info = self.r.info("memory")
        f.redis_used.add_metric([], info.get("used_memory", 0))
        f.redis_max.add_metric([], info.get("maxmemory", 0))


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
    registry.register(_Collector(r, runs))
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
