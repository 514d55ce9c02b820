"""``streamrl bench chaos``: SIGKILL workers at random (and Redis itself), and check that the
run still drains with nothing lost, nothing doubled and nothing dead-lettered.

The workload is the multi-turn ``counter`` environment with a scripted policy that never
answers wrong, so every sample must score 1.0: an episode resumed after a kill that repeated or
skipped a tool call would end on the wrong value and score 0. Faults, drawn from one seeded RNG:

- ``tree``: the rq worker and its work horse (what a node loss does);
- ``main``: the rq main process alone; its horse carries on as an orphan to the lease's end;
- ``horse``: the work horse alone; rq marks the lease failed and the worker takes another;
- each of those at a random moment, at a lease's start (between dequeue and top-up) or at its
  end (between the lease and the next dequeue), and once every worker of a role at once;
- one SIGKILL of ``redis-server`` and a restart on the same port from its AOF.

A killed rq main process is replaced by a new ``rq worker``, as a supervisor would. Every
fault lands while work is in flight: when the backlog runs low before the last fault, more
prompts are pushed (``prompts`` is the first push; the report counts all of them).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from streamrl import schema
from streamrl.bus.streams import xrange_all
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.connection import make_resilient
from streamrl.defaults import ROLLOUT_GROUP, ROLLOUT_QUEUE, VERIFY_GROUP, VERIFY_QUEUE
from streamrl.envs import make_env
from streamrl.local.embedded import EmbeddedRedis
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.local.procs import descendants
from streamrl.ops.status import collect
from streamrl.producer.produce import Producer

_KINDS = ("tree", "main", "horse")
_MOMENTS = ("random", "lease-start", "lease-end")
_ROLE_QUEUE = {"rollout": ROLLOUT_QUEUE, "verify": VERIFY_QUEUE}


@dataclass
class ChaosConfig:
    prompts: int = 400
    group_size: int = 4
    steps: int = 3  # tool calls per episode (steps + 1 model turns)
    latency_s: float = 0.25  # scripted policy latency per model turn
    rollout_workers: int = 3
    verify_workers: int = 2
    max_concurrent: int = 16  # episodes per rollout lease: keeps the run long enough to hit
    kills: int = 20
    kill_every_s: float | None = None  # mean gap between faults; None: spread over the run
    redis_restart: bool = True
    redis_down_s: float = 1.0
    lease_seconds: float = 4.0  # short leases: many lease boundaries to hit
    claim_idle_ms: int = 3000
    heartbeat_s: float = 0.5
    max_deliveries: int = 60
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class _Fault:
    at_s: float
    kind: str  # tree | main | horse | all | redis
    role: str  # rollout | verify | redis
    moment: str = "random"
    pids: list[int] = field(default_factory=list)


@dataclass
class _Progress:
    """The longest time with work waiting and nothing moving."""

    last: tuple = ()
    since: float = 0.0
    stalled_s: float = 0.0

    def see(self, mark: tuple, now: float) -> None:
        if mark != self.last:
            self.last, self.since = mark, now
        else:
            self.stalled_s = max(self.stalled_s, now - self.since)


class _Chaos:
    def __init__(self, cfg: ChaosConfig, directory: Path, env: dict | None, say: Callable):
        self.cfg = cfg
        self.dir = directory
        self.env = env
        self.say = say
        self.rng = random.Random(cfg.seed)
        self.faults: list[_Fault] = []
        self.orphans: set[int] = set()  # horses whose rq main we killed
        self.progress = _Progress()
        self.drained_at: float | None = None
        self.pushed = 0  # prompts pushed so far

    # ---------------------------------------------------------------- processes
    def _alive(self, role: str) -> list[subprocess.Popen]:
        queue = _ROLE_QUEUE[role]
        return [p for name, p in self.p.procs.procs if name.startswith(queue) and p.poll() is None]

    @staticmethod
    def _horses(proc: subprocess.Popen) -> list[int]:
        return descendants(proc.pid)

    def _wait_moment(self, proc: subprocess.Popen, moment: str, limit_s: float) -> None:
        """Return at a lease boundary of ``proc``: the instant a new work horse appears
        (lease start) or the one it had disappears (lease end); at the latest after
        ``limit_s``."""
        if moment == "random":
            return
        before = set(self._horses(proc))
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and proc.poll() is None:
            now = set(self._horses(proc))
            if moment == "lease-start" and now - before:
                return
            if moment == "lease-end" and before and not (before & now):
                return
            if moment == "lease-end" and not before:
                before = now
            time.sleep(0.002)

    def _kill(self, proc: subprocess.Popen, kind: str) -> list[int]:
        horses = self._horses(proc)
        if kind == "horse":
            pids = horses
        elif kind == "main":
            pids = [proc.pid]
            self.orphans.update(horses)
        else:
            pids = [proc.pid, *horses]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if kind != "horse":
            proc.wait()
        return pids

    def _worker_fault(self, t0: float) -> _Fault:
        role = self.rng.choice(("rollout", "verify"))
        kind = self.rng.choice(_KINDS)
        moment = self.rng.choice(_MOMENTS)
        victims = self._alive(role)
        if not victims:  # the harness restarts every worker it kills: these died on their own
            raise RuntimeError(
                f"every {role} worker exited without being killed; their logs: {self.dir}/logs"
            )
        victim = self.rng.choice(victims)
        self._wait_moment(victim, moment, self.cfg.lease_seconds + 2)
        if kind == "horse" and not self._horses(victim):
            kind = "tree"  # between leases there is no horse: take the whole worker
        pids = self._kill(victim, kind)
        if kind != "horse":
            self.p.procs.start(_ROLE_QUEUE[role], 1)
        return _Fault(time.monotonic() - t0, kind, role, moment, pids)

    def _all_fault(self, t0: float) -> _Fault:
        role = self.rng.choice(("rollout", "verify"))
        pids: list[int] = []
        victims = self._alive(role)
        for victim in victims:
            pids += self._kill(victim, "tree")
        self.p.procs.start(_ROLE_QUEUE[role], len(victims))
        return _Fault(time.monotonic() - t0, "all", role, "random", pids)

    def _redis_fault(self, t0: float) -> _Fault:
        assert self.server.proc is not None
        pid = self.server.proc.pid
        self.server.kill()
        time.sleep(self.cfg.redis_down_s)
        self.server.start()
        return _Fault(time.monotonic() - t0, "redis", "redis", "random", [pid])

    # ---------------------------------------------------------------- the run
    def _push(self, total: int) -> None:
        env = make_env("counter", steps=self.cfg.steps)
        Producer(self.p.r, "chaos").from_env(env, total, self.cfg.group_size, seed=self.cfg.seed)
        self.pushed = total

    def _keep_busy(self) -> None:
        """Push more prompts when fewer than a few leases' worth are left to do."""
        c = self.cfg
        low = max(c.prompts // 4, 2 * c.rollout_workers * c.max_concurrent // c.group_size)
        if self.pushed - self._done()[0] < low:
            self._push(self.pushed + max(low, c.prompts // 2))

    def _done(self) -> tuple[int, tuple]:
        stats = self.p.r.hgetall(self.p.keys.stats)
        groups = int(stats.get(b"groups_completed", 0)) + int(stats.get(b"groups_dropped", 0))
        mark = (
            int(stats.get(b"trajectories", 0)),
            int(stats.get(b"scored", 0) or 0),
            self.p.r.xlen(self.p.keys.scored),
            groups,
        )
        return groups, mark

    def _watch_until(self, deadline: float, stop: Callable[[], bool]) -> None:
        while time.monotonic() < deadline and not stop():
            with contextlib.suppress(Exception):  # Redis may be down for a moment
                groups, mark = self._done()
                self.progress.see(mark, time.monotonic())
                if groups >= self.pushed:
                    self.drained_at = self.drained_at or time.monotonic()
                    return
            time.sleep(0.05)

    def run(self) -> dict:
        cfg = self.cfg
        run_cfg = RunConfig(
            run="chaos",
            env="counter",
            env_options={"steps": cfg.steps},
            group_size=cfg.group_size,
            policy=PolicyConfig(latency_s=cfg.latency_s, wrong_rate=0.0, malformed_rate=0.0),
            rollout=RolloutConfig(
                lease_seconds=cfg.lease_seconds, max_concurrent=cfg.max_concurrent
            ),
            verify=VerifyConfig(lease_seconds=cfg.lease_seconds),
            streams=StreamConfig(
                claim_idle_ms=cfg.claim_idle_ms,
                heartbeat_s=cfg.heartbeat_s,
                max_deliveries=cfg.max_deliveries,
            ),
        )
        self.server = EmbeddedRedis(self.dir / "redis", durable=True).start()
        try:
            with LocalPipeline(
                run_cfg, url=self.server.url, directory=self.dir, worker_env=self.env
            ) as p:
                self.p = p
                make_resilient(p.r)
                return self._run(p)
        finally:
            for pid in self.orphans:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.server.stop()

    def _run(self, p: LocalPipeline) -> dict:
        cfg = self.cfg
        p.start_workers(rollout=cfg.rollout_workers, verify=cfg.verify_workers)
        p.wait_ready(cfg.rollout_workers, cfg.verify_workers)
        self._push(cfg.prompts)
        t0 = time.monotonic()
        deadline = t0 + cfg.timeout_s
        self.progress.since = t0
        # the plan: which fault is the Redis restart and which ones kill a whole role
        n = cfg.kills
        plan = ["worker"] * n
        if n >= 2:
            plan[self.rng.randrange(n)] = "all"
        if cfg.redis_restart:
            plan.insert(self.rng.randrange(n // 3, max(n // 3 + 1, 2 * n // 3)), "redis")
        drained = lambda: self._done()[0] >= self.pushed  # noqa: E731
        every = cfg.kill_every_s or 0.7 * self._undisturbed_s() / max(1, len(plan))
        for what in plan:
            gap = self.rng.expovariate(1.0 / every)
            self._watch_until(min(deadline, time.monotonic() + gap), lambda: False)
            if time.monotonic() > deadline:
                break
            self._keep_busy()
            if what == "redis":
                fault = self._redis_fault(t0)
            elif what == "all":
                fault = self._all_fault(t0)
            else:
                fault = self._worker_fault(t0)
            self.faults.append(fault)
            self.say(
                f"t={fault.at_s:6.1f}s  {fault.kind:5s} {fault.role:7s} ({fault.moment}); "
                f"{self._done()[0]}/{self.pushed} groups"
            )
        self._watch_until(deadline, drained)
        last_fault = t0 + max((f.at_s for f in self.faults), default=0.0)
        end = self.drained_at or time.monotonic()
        return self._report(p, t0, last_fault, end, drained())

    def _undisturbed_s(self) -> float:
        """How long the workload takes with no faults (rollouts are the slow stage)."""
        c = self.cfg
        turns = (c.prompts * c.group_size) * (c.steps + 1)
        return turns * c.latency_s / (c.rollout_workers * c.max_concurrent)

    def _report(self, p: LocalPipeline, t0: float, last_fault: float, end: float, ok: bool):
        cfg = self.cfg
        expected = task_ids("counter", cfg.seed, self.pushed, cfg.group_size)
        acc = p.account(expected)
        per_prompt: Counter[str] = Counter()
        for _, f in xrange_all(p.r, p.keys.groups):
            per_prompt[schema.GROUP.decode(f[b"p"]).prompt_id] += 1
        rewards: Counter[float | None] = Counter()
        for _, f in xrange_all(p.r, p.keys.scored):
            rewards[schema.SCORE.decode(f[b"p"]).reward] += 1
        kinds = Counter(f.kind for f in self.faults)
        moments = Counter(f.moment for f in self.faults if f.role != "redis")
        report = {
            "seed": cfg.seed,
            "prompts": self.pushed,
            "samples": len(expected),
            "kills": sum(1 for f in self.faults if f.kind != "redis"),
            "killed_processes": sum(len(f.pids) for f in self.faults if f.kind != "redis"),
            "kill_kinds": dict(kinds),
            "kill_moments": dict(moments),
            "redis_restarts": kinds.get("redis", 0),
            "drained": ok,
            "lost": acc.lost,
            "duplicated": acc.duplicated,
            "groups": acc.groups,
            "prompts_with_one_group": sum(1 for c in per_prompt.values() if c == 1),
            "prompts_with_several_groups": sum(1 for c in per_prompt.values() if c > 1),
            "malformed_groups": acc.malformed_groups,
            "failures": acc.failures,
            "rewards_not_1": sum(n for r, n in rewards.items() if r != 1.0),
            "dead_letters": p.r.xlen(p.keys.dead),
            "stalled_s": round(self.progress.stalled_s, 2),
            # from the last fault to the last group (0 if the run drained before it)
            "seconds_to_drain": round(max(0.0, end - last_fault), 2),
            "seconds": round(end - t0, 2),
            "faults": [asdict(f) for f in self.faults],
        }
        if not ok:
            report["at_end"] = self._snapshot(p)
        return report

    def _snapshot(self, p: LocalPipeline) -> dict:
        """Where the work waits when a run did not drain, and who holds it: the first thing to
        look at (worker logs are under the run directory's ``logs/``)."""
        view = collect(p.r, p.keys.run)
        holding = {}
        for stream, group in ((p.keys.tasks, ROLLOUT_GROUP), (p.keys.rollouts, VERIFY_GROUP)):
            holding[group] = [
                {"consumer": c["name"].decode(), "pending": c["pending"], "idle_ms": c["idle"]}
                for c in p.r.xinfo_consumers(stream, group)
                if c["pending"]
            ]
        return {
            "stages": view["stages"],
            "rq": view["rq"],
            "consumers_holding": holding,
            "orphan_horses_alive": [pid for pid in self.orphans if _alive_pid(pid)],
            "directory": str(self.dir),
        }


def _alive_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def chaos_bench(
    cfg: ChaosConfig,
    directory: str | Path | None = None,
    worker_env: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run one chaos experiment on a private, durable Redis; returns the report."""
    say = progress or (lambda m: None)
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="streamrl-chaos-"))
        return _Chaos(cfg, Path(directory), worker_env, say).run()


def clean(report: dict) -> bool:
    """Whether a chaos run kept every promise."""
    return (
        report["drained"]
        and report["lost"] == 0
        and report["duplicated"] == 0
        and report["prompts_with_several_groups"] == 0
        and report["prompts_with_one_group"] == report["prompts"]
        and report["malformed_groups"] == 0
        and report["rewards_not_1"] == 0
        and report["dead_letters"] == 0
    )
