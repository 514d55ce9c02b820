"""Terminal views (rich): the status table and the live reward feed."""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from typing import Any

import redis
from rich.console import Group as RichGroup
from rich.live import Live
from rich.table import Table
from rich.text import Text

from streamrl import schema
from streamrl.bus.shards import run_shards


def status_table(info: dict[str, Any]) -> Table:
    t = Table(title=f"streamrl run {info['run']!r}")
    for col in ("stage", "stream length", "group", "lag", "pending", "consumers"):
        t.add_column(col)
    rows = [(stage, s) for stage, s in info["stages"].items()]
    for label, part in (info.get("shards") or {}).items():  # a sharded run: totals, then each
        rows += [(f"{stage} (shard {label})", s) for stage, s in part["stages"].items()]
    for stage, s in rows:
        for gname, g in s["groups"].items() or {"-": {}}.items():
            t.add_row(
                stage,
                str(s["length"]),
                gname,
                str(g.get("lag")),
                str(g.get("pending")),
                str(g.get("consumers")),
            )
    foot = Table.grid(padding=(0, 2))
    foot.add_row("trajectories", str(info["trajectories"]), "scored", str(info["scored"]))
    foot.add_row(
        "groups completed",
        str(info["groups_completed"]),
        "groups dropped",
        str(info["groups_dropped"]),
    )
    foot.add_row("dead letters", str(info["dead_letters"]), "policy", str(info["policy_version"]))
    if info.get("masked"):  # samples the environment masked: dead letters, never rewards
        kinds = ", ".join(f"{k} {n}" for k, n in info["masked"].items())
        foot.add_row("masked samples", str(sum(info["masked"].values())), "by kind", kinds)
    for q, w in info["rq"].items():
        dead = w.get("registered", w["workers"]) - w["workers"]
        live = f"{w['workers']} live ({w['busy']} busy)" + (f", {dead} dead" if dead else "")
        foot.add_row(q, live, "queued leases", str(w["queued_leases"]))
        if w.get("failed_leases"):
            last = str(w.get("last_failure") or "")
            foot.add_row("", f"{w['failed_leases']} failed leases", "last", last[:160])
    if info.get("learner"):
        ln = info["learner"]
        foot.add_row(
            "learner step", str(ln.get("step")), "groups applied", str(ln.get("groups_applied"))
        )
        drops = [
            f"{reason.replace('_', ' ')} {100 * float(ln[key]):.0f}%"
            for reason in ("zero_variance", "stale", "no_tokens", "invalid")
            if float(ln.get(key := f"dropped_fraction_{reason}", 0) or 0) > 0
        ]
        foot.add_row(
            "policy entropy",
            str(ln.get("entropy", "-")),
            "learner dropped",
            ", ".join(drops) or "none",
        )
        if ln.get("mismatch_tokens"):  # sampler vs learner log-probs (learner.mismatch)
            mismatch = (
                f"|Δlogp| {float(ln['mismatch_abs']):.2e}, KL {float(ln['mismatch_kl']):.2e} "
                f"over {ln['mismatch_tokens']} tokens at step {ln.get('mismatch_step')}"
            )
            foot.add_row("train/infer mismatch", mismatch, "", "")
        if ln.get("outcome_window"):  # zero-variance groups: solved, or no signal
            window = f" of the last {ln['outcome_window']} groups"
            solved = f"{100 * float(ln.get('solved_rate') or 0):.0f}%{window}"
            no_signal = f"{100 * float(ln.get('no_signal_rate') or 0):.0f}%{window}"
            foot.add_row("solved", solved, "no signal", no_signal)
        for key in ("verdict", "no_signal"):  # one line each, when there is one
            if ln.get(key):
                foot.add_row("learner", "", "", str(ln[key]))
    if info.get("judge"):  # the LLM judge: what it cost, and what it could not answer
        j = info["judge"]
        calls = f"{j.get('calls', 0)} for {j.get('samples', 0)} samples"
        foot.add_row("judge calls", calls, "from its cache", str(j.get("cached", 0)))
        if j.get("failures") or j.get("throttled"):
            given_up, throttled = str(j.get("failures", 0)), str(j.get("throttled", 0))
            foot.add_row("judge gave up", given_up, "told to back off", throttled)
    rd = info.get("redis") or {}
    if rd.get("cluster"):
        nodes = f"run keys on {rd.get('node')}"
        nodes += "".join(
            f", shard {label} on {part.get('node')}"
            for label, part in (info.get("shards") or {}).items()
        )
        foot.add_row("redis cluster", nodes, "", "")
    pr = info.get("producer") or {}
    if pr.get("state") == "waiting":
        foot.add_row("producer", f"waiting {pr.get('waiting_s', 0)} s", "", str(pr.get("message")))
    elif pr:
        foot.add_row("producer", str(pr.get("state")), "in flight", str(pr.get("in_flight")))
    parts: list[Any] = [t, foot]
    if rd.get("eviction"):
        parts.append(Text(f"REDIS: {rd['eviction']}", style="bold red"))
    if rd.get("full"):
        parts.append(Text(f"REDIS: {rd['full']}", style="bold red"))
    mix = info.get("mixture")
    if mix:
        parts.append(mixture_table(mix))
        for row in mix["envs"]:
            if row.get("paused"):
                parts.append(Text(f"PAUSED {row['name']}: {row['paused']}", style="bold red"))
    health = info.get("policy_health") or {}
    if health.get("fault"):
        parts.append(Text(f"FAULT: {health['fault']}", style="bold red"))
    if health.get("workers"):
        parts.append(_policy_health_table(health["workers"]))
    return RichGroup(*parts)  # type: ignore[return-value]


def mixture_table(mix: dict[str, Any]) -> Table:
    """Per environment of a mixture: its weight and share of what is drawn now, and the
    learner's figures for it over its last groups."""
    t = Table(title=f"environments (mixture version {mix['version']})")
    cols = ("env", "weight", "share", "reward", "solved", "no signal", "samples/s",
            "dead letters", "staleness", "state")  # fmt: skip
    for col in cols:
        t.add_column(col)
    for row in mix["envs"]:
        state = "removed" if row.get("removed") else "paused" if row.get("paused") else "drawn"
        if row.get("tripped") and not row.get("paused"):
            state += f" ({row['tripped']})"
        t.add_row(
            row["name"],
            f"{row['weight']:g}",
            f"{100 * row['share']:.0f}%",
            f"{row.get('reward_mean', 0.0):.3f}",
            f"{100 * row.get('solved_rate', 0.0):.0f}%",
            f"{100 * row.get('no_signal_rate', 0.0):.0f}%",
            f"{row.get('samples_per_s', 0.0):.2f}",
            str(row.get("dead_letters", 0)),
            f"{row.get('staleness_mean', 0.0):.2f}",
            state,
            style="red" if row.get("paused") else None,
        )
    return t


def _policy_health_table(workers: dict[str, dict[str, Any]]) -> Table:
    """Per rollout worker: the policy version it serves, how far behind the newest announced
    one, for how long beyond ``max_staleness``, why its last reload failed, and (a policy
    server's workers) which server, its requests on it and those waiting for a slot."""
    t = Table(title="policy by rollout worker")
    servers = any(w.get("server") for w in workers.values())
    cols = ("worker", "version", "newest", "lag", "behind for", "last reload error")
    for col in cols + (("server", "in flight", "waiting") if servers else ()):
        t.add_column(col)
    for name, w in workers.items():
        behind = w.get("behind_s")
        load = (w.get("server") or "-", str(w.get("in_flight", 0)), str(w.get("waiting", 0)))
        t.add_row(
            name,
            str(w.get("version")),
            str(w.get("newest")),
            str(w.get("lag")),
            "-" if behind is None else f"{behind:.0f} s",
            w.get("error") or "-",
            *(load if servers else ()),
            style="red" if behind is not None or w.get("error") else None,
        )
    return t


class RewardFeed:
    """Reads the ``scored`` stream (every shard's, for a sharded run) from where it was, and
    keeps per-policy-version means."""

    def __init__(self, r: redis.Redis, run: str, start: str = "$"):
        self.r = r
        self.keys = [k.scored for k in run_shards(r, run)]
        self.last = {
            key: start if start != "$" else (self._last_id(key) or "0-0") for key in self.keys
        }
        self.by_version: dict[int, list[float]] = {}
        self.failures = 0
        self.recent: deque[tuple[float, float]] = deque(maxlen=4096)  # (time, reward)

    def _last_id(self, key: str) -> str | None:
        row = self.r.xrevrange(key, count=1)
        return row[0][0].decode() if row else None

    def poll(self) -> list[float]:
        """Read what was scored since the last poll; returns the new rewards in order (of
        each shard in turn)."""
        new: list[float] = []
        for key in self.keys:
            self._poll(key, new)
        return new

    def _poll(self, key: str, new: list[float]) -> None:
        while True:
            rows = self.r.xrange(key, min=f"({self.last[key]}", count=2000)
            if not rows:
                return
            for eid, fields in rows:
                self.last[key] = eid.decode()
                score = schema.SCORE.decode(fields[b"p"])
                if score.reward is None:
                    self.failures += 1
                    continue
                new.append(score.reward)
                v = max(score.policy_versions) if score.policy_versions else 0
                self.by_version.setdefault(v, []).append(score.reward)
                self.recent.append((time.time(), score.reward))

    def table(self, last: int = 8) -> Table:
        t = Table(title="reward by policy version")
        t.add_column("version")
        t.add_column("samples")
        t.add_column("mean reward")
        for v in sorted(self.by_version)[-last:]:
            rs = self.by_version[v]
            t.add_row(str(v), str(len(rs)), f"{sum(rs) / len(rs):.3f}")
        return t


def watch_live(
    r: redis.Redis, run: str, interval: float = 1.0, control: redis.Redis | None = None
) -> None:
    from streamrl.ops.status import collect

    feed = RewardFeed(r, run, start="0-0")
    # Ctrl-C sets a flag the loop checks, rather than raising KeyboardInterrupt wherever the
    # main thread is: raised inside rich's `with lock:` it can leave the lock held, and Live's
    # stop then waits forever on its refresh thread (a watch that never exited on SIGINT)
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        with Live(refresh_per_second=4) as live:
            while not stop.is_set():
                feed.poll()
                live.update(RichGroup(feed.table(), status_table(collect(r, run, control))))
                stop.wait(interval)
    finally:
        signal.signal(signal.SIGINT, previous)
