"""A whole pipeline on one machine: a Redis (private unless given), a run config, real rq
worker processes, and the accounting that says whether every task came out exactly once.
``streamrl bench``, ``streamrl demo`` and the end-to-end tests are built on it."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis

from streamrl import schema
from streamrl.bus.keys import Keys, shard_keys
from streamrl.bus.streams import ensure_groups, xrange_all
from streamrl.config import RunConfig
from streamrl.connection import connect
from streamrl.defaults import ROLLOUT_GROUP, ROLLOUT_QUEUE, VERIFY_GROUP, VERIFY_QUEUE
from streamrl.local.embedded import EmbeddedRedis
from streamrl.local.procs import WorkerProcs
from streamrl.workers import leases
from streamrl.workers.context import write_config


@dataclass
class Accounting:
    expected: int
    scored: int  # distinct samples with a reward
    lost: int  # expected samples with no reward
    duplicated: int  # samples with more than one reward
    failures: int  # failure scores (reward None) on the live feed
    groups: int
    malformed_groups: int


_MEMORY_FS = "/dev/shm"


def memory_scratch(min_free: int = 256 << 20) -> str | None:
    """A memory-backed parent for a throwaway run's directory (``streamrl demo``'s: deleted at
    exit, so nothing in it needs a disk): policy versions, checkpoints and logs written every
    step then cost no disk writes or fsyncs. None (tempfile's default) when TMPDIR is set, as
    the user chose, or when /dev/shm is missing, read-only or short of ``min_free`` bytes."""
    if os.environ.get("TMPDIR"):
        return None
    try:
        st = os.statvfs(_MEMORY_FS)
    except OSError:
        return None
    if not os.access(_MEMORY_FS, os.W_OK | os.X_OK) or st.f_bavail * st.f_frsize < min_free:
        return None
    return _MEMORY_FS


class LocalPipeline:
    def __init__(
        self,
        config: RunConfig,
        url: str | None = None,
        directory: str | Path | None = None,
        worker_env: dict | None = None,
        control_url: str | None = None,
        scratch: str | Path | None = None,
    ):
        """``url`` may name a Redis Cluster (``redis+cluster://``); rq then needs a plain
        ``control_url``. ``scratch``: where the temporary directory goes when no
        ``directory`` is given (default: tempfile's, TMPDIR or /tmp)."""
        self.config = config
        self.control_url = control_url
        self.keys = Keys(config.run)
        self.shards = shard_keys(config.run, config.streams.shards)
        self._tmp = (
            None if directory else tempfile.TemporaryDirectory(prefix="streamrl-", dir=scratch)
        )
        self.dir = Path(directory or self._tmp.name)  # type: ignore[union-attr]
        self.server = None if url else EmbeddedRedis(self.dir / "redis")
        self.url = url
        self.worker_env = worker_env
        self.procs: WorkerProcs | None = None

    def __enter__(self) -> LocalPipeline:
        if self.server is not None:
            self.url = self.server.start().url
        assert self.url is not None
        self.r = connect(self.url)
        self.control = connect(self.control_url) if self.control_url else self.r
        self.r.delete(self.keys.halt)
        write_config(self.r, self.config)
        for keys in self.shards:
            ensure_groups(self.r, keys)
        self.procs = WorkerProcs(
            self.url,
            log_dir=self.dir / "logs",
            env=self.worker_env,
            control_url=self.control_url,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.server is not None:
            self.server.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    # ---------------------------------------------------------------- workers
    def start_workers(
        self,
        rollout: int = 1,
        verify: int = 1,
        seconds: float | None = None,
        top_up: bool = True,
        env: dict[str, str] | None = None,
    ):
        """Start rq workers; ``top_up=False`` queues no lease, so they idle until the run has
        work (the demo starts them while it is still building the model). ``env``: variables
        these workers get besides the pipeline's (``STREAMRL_POLICY_BASE_URL`` for a pool)."""
        assert self.procs is not None
        started = self.procs.start(ROLLOUT_QUEUE, rollout, env=env) if rollout else []
        started += self.procs.start(VERIFY_QUEUE, verify, env=env) if verify else []
        run = self.config.run
        if not top_up:
            return started
        data = None if self.control is self.r else self.r
        if rollout:
            leases.top_up_shards(
                self.control, ROLLOUT_QUEUE, run, waiting=rollout, seconds=seconds, data=data
            )
        if verify:
            leases.top_up_shards(
                self.control, VERIFY_QUEUE, run, waiting=verify, seconds=seconds, data=data
            )
        return started

    def consumers(self, stage: str) -> int:
        """Distinct consumers of the stage, over every shard."""
        names: set[bytes] = set()
        for keys in self.shards:
            stream, group = {
                "rollout": (keys.tasks, ROLLOUT_GROUP),
                "verify": (keys.rollouts, VERIFY_GROUP),
            }[stage]
            with contextlib.suppress(redis.ResponseError):
                names |= {c["name"] for c in self.r.xinfo_consumers(stream, group)}
        return len(names)

    def wait_ready(self, rollout: int, verify: int, timeout: float = 60.0) -> None:
        """Until that many worker consumers exist: the leases have started."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.consumers("rollout") >= rollout and self.consumers("verify") >= verify:
                return
            time.sleep(0.05)
        raise TimeoutError(f"workers did not start in {timeout} s; logs in {self.dir / 'logs'}")

    def stop(self) -> None:
        if self.procs is not None and self.procs.procs:
            self.r.set(self.keys.halt, 1)
            self.procs.stop(timeout=15)

    # ---------------------------------------------------------------- progress
    def stat(self, name: str) -> int:
        """A counter of the run's stats, summed over its shards."""
        return sum(int(self.r.hget(keys.stats, name) or 0) for keys in self.shards)

    def streams(self, stage: str) -> list[str]:
        """A stage's stream in every shard (``tasks``, ``rollouts``, ``scored``, ``groups``)."""
        return [getattr(keys, stage) for keys in self.shards]

    def wait_groups(self, n: int, timeout: float = 120.0, settled: bool = True) -> int:
        """Until ``n`` groups are closed (completed + dropped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.stat("groups_completed") + (self.stat("groups_dropped") if settled else 0)
            if done >= n:
                return done
            time.sleep(0.02)
        raise TimeoutError(
            f"{self.stat('groups_completed')} groups completed and "
            f"{self.stat('groups_dropped')} dropped of {n} after {timeout} s; "
            f"logs in {self.dir / 'logs'}"
        )

    def account(self, expected_task_ids: set[str]) -> Accounting:
        seen: Counter[str] = Counter()
        failures = 0
        scored = (row for stream in self.streams("scored") for row in xrange_all(self.r, stream))
        for _, fields in scored:
            score = schema.SCORE.decode(fields[b"p"])
            if score.reward is None:
                failures += 1
            else:
                seen[score.task_id] += 1
        size = self.config.group_size
        malformed = 0
        groups = 0
        for _, f in (row for st in self.streams("groups") for row in xrange_all(self.r, st)):
            g = schema.GROUP.decode(f[b"p"])
            groups += 1
            ks = sorted(s.score.k for s in g.samples)
            if ks != list(range(size)) or any(s.score.prompt_id != g.prompt_id for s in g.samples):
                malformed += 1
        return Accounting(
            expected=len(expected_task_ids),
            scored=len(seen),
            lost=sum(1 for t in expected_task_ids if seen[t] == 0),
            duplicated=sum(1 for t in seen if seen[t] > 1),
            failures=failures,
            groups=groups,
            malformed_groups=malformed,
        )

    def trajectories(self) -> list[schema.Trajectory]:
        """Every trajectory inside the completed groups."""
        out = []
        for _, f in (row for st in self.streams("groups") for row in xrange_all(self.r, st)):
            out += [s.trajectory for s in schema.GROUP.decode(f[b"p"]).samples]
        return out


def task_ids(env: str, seed: int, prompts: int, group_size: int, start: int = 0) -> set[str]:
    """The task ids ``Producer.from_env`` gives prompts ``start..start+prompts-1``."""
    return {
        f"{env}-s{seed}-{i:07d}:{k}"
        for i in range(start, start + prompts)
        for k in range(group_size)
    }
