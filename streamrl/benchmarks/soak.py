"""``streamrl bench soak``: the scripted pipeline for a long time, a worker SIGKILLed every few
seconds, and a sample every ``sample_s`` of what leaks show in: worker and learner RSS, open
file descriptors, Redis keys and ``used_memory``, and throughput.

The workload is ``bench chaos``'s (the multi-turn ``counter`` environment, a scripted policy,
short leases) with a ``streamrl learn`` process training the tiny model on every group: the
scripted turns carry token ids (option ``token_vocab``) and a quarter of the answers are wrong,
so groups have signal and the learner steps, publishes and checkpoints as a real one does (a
learner that takes no step acks nothing, and the groups stream would grow for ever). Prompts
are pushed whenever the backlog runs low, so the run is busy throughout; streams are trimmed
with a short retention (``retention_s``) and finished-group markers expire after
``group_done_ttl_s``, so a healthy run's Redis levels off within minutes. The groups stream is
read as it is written, so that "every prompt exactly once" is checked over the whole run even
though it is trimmed.

Verdict: for each series, the least-squares slope over the second half of the samples (the
first half is warm-up: caches, retention windows, rq registries filling), extrapolated to one
hour. A series fails when that growth exceeds both its absolute floor (``FLOORS``) and 10% of
its second-half mean: growth that does not level off. Redis keys are judged on those without a
TTL; all keys are reported, not judged: finished-group markers and the records of failed
leases (every SIGKILL mid-lease leaves one, kept 24 h for ``status``) carry TTLs and grow
with throughput and the kill rate until their TTL. Throughput is reported, not judged (the
machine is shared), except that it must not stop.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from streamrl import schema
from streamrl.benchmarks.chaos import ChaosConfig, _Chaos
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.connection import make_resilient
from streamrl.defaults import GROUP_DONE_TTL_S
from streamrl.envs import make_env
from streamrl.local.embedded import EmbeddedRedis
from streamrl.local.pipeline import LocalPipeline
from streamrl.local.procs import descendants
from streamrl.producer.produce import Producer

RUN = "soak"
_TINY_VOCAB = 24  # streamrl.models.tiny: the scripted turns' token ids stay inside it
_NEVER_STALE = 10**6  # the scripted policy serves version 0 for ever: its groups must count
# growth per hour allowed whatever the mean (second half of the run, least squares)
FLOORS = {
    "worker_rss_mib": 32.0,  # the sum over live worker processes (mains and horses)
    "learner_rss_mib": 32.0,
    "worker_fds": 20.0,
    "learner_fds": 10.0,
    "redis_keys_no_ttl": 100.0,  # keys with a TTL (markers, rq job records) cannot leak
    "redis_used_mib": 16.0,
}
RELATIVE = 0.10  # ... and 10% of the second-half mean


@dataclass
class SoakConfig:
    minutes: float = 60.0
    kill_every_s: float = 5.0
    sample_s: float = 10.0
    retention_s: float = 30.0
    group_done_ttl_s: float = 120.0  # finished-group markers (24 h by default): see the report
    rollout_workers: int = 2
    verify_workers: int = 1
    seed: int = 0


def _proc_stats(pids: list[int]) -> tuple[float, int, int]:
    """(RSS MiB summed, open fds summed, processes counted) of the living ``pids``."""
    rss, fds, n = 0, 0, 0
    for pid in pids:
        with contextlib.suppress(psutil.Error, OSError):
            p = psutil.Process(pid)
            rss += p.memory_info().rss
            fds += p.num_fds()
            n += 1
    return rss / 2**20, fds, n


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``ts`` (seconds), per hour."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return 3600.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def judge(samples: list[dict]) -> dict[str, dict]:
    """Per series: its slope per hour over the second half, the threshold, and the verdict."""
    half = samples[len(samples) // 2 :]
    ts = [s["t_s"] for s in half]
    out = {}
    for name, floor in FLOORS.items():
        ys = [float(s[name]) for s in half]
        mean = sum(ys) / len(ys) if ys else 0.0
        slope = slope_per_hour(ts, ys)
        limit = max(floor, RELATIVE * abs(mean))
        out[name] = {
            "slope_per_h": round(slope, 2),
            "mean": round(mean, 2),
            "limit_per_h": round(limit, 2),
            "flat": slope <= limit,
        }
    ys = [float(s["redis_keys"]) for s in half]  # with TTL'd ones: follows rate and kill rate
    out["redis_keys"] = {"slope_per_h": round(slope_per_hour(ts, ys), 2), "flat": True}
    ys = [s["groups_per_s"] for s in half]
    out["groups_per_s"] = {
        "slope_per_h": round(slope_per_hour(ts, ys), 3),
        "mean": round(sum(ys) / len(ys), 3) if ys else 0.0,
        "flat": bool(ys) and min(ys) > 0,  # judged only on never stopping
    }
    return out


class _Soak(_Chaos):
    def __init__(self, soak: SoakConfig, directory: Path, env: dict | None, say: Callable):
        chaos = ChaosConfig(
            prompts=64,
            rollout_workers=soak.rollout_workers,
            verify_workers=soak.verify_workers,
            seed=soak.seed,
            redis_restart=False,
        )
        super().__init__(chaos, directory, env, say)
        self.soak = soak
        self.seen: Counter[str] = Counter()  # prompt id -> groups read off the groups stream
        self._last_group_id = "0-0"

    def run(self) -> dict:  # type: ignore[override]
        c = self.cfg
        run_cfg = RunConfig(
            run=RUN,
            env="counter",
            env_options={"steps": c.steps},
            group_size=c.group_size,
            policy=PolicyConfig(
                latency_s=c.latency_s, wrong_rate=0.25, options={"token_vocab": _TINY_VOCAB}
            ),
            rollout=RolloutConfig(
                lease_seconds=c.lease_seconds, max_concurrent=c.max_concurrent, max_policy_lag_s=0
            ),
            learner={"max_staleness": _NEVER_STALE},
            verify=VerifyConfig(lease_seconds=c.lease_seconds),
            streams=StreamConfig(
                claim_idle_ms=c.claim_idle_ms,
                heartbeat_s=c.heartbeat_s,
                max_deliveries=c.max_deliveries,
                retention_ms=int(self.soak.retention_s * 1000),
                group_done_ttl_s=int(self.soak.group_done_ttl_s),
            ),
        )
        self.server = EmbeddedRedis(self.dir / "redis").start()
        learner = None
        try:
            with LocalPipeline(
                run_cfg, url=self.server.url, directory=self.dir, worker_env=self.env
            ) as p:
                self.p = p
                make_resilient(p.r)
                learner = self._start_learner()
                return self._soak(p, learner)
        finally:
            if learner is not None:
                learner.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    learner.wait(30)
                if learner.poll() is None:
                    learner.kill()
            self.server.stop()

    def _push(self, total: int) -> None:
        env = make_env("counter", steps=self.cfg.steps)
        Producer(self.p.r, RUN).from_env(env, total, self.cfg.group_size, seed=self.cfg.seed)
        self.pushed = total

    def _start_learner(self) -> subprocess.Popen:
        from streamrl.models.tiny import save_tiny

        model = save_tiny(self.dir / "tiny")
        config = self.dir / "learner.toml"
        config.write_text(
            f'[learner]\nmodel = "{model}"\noutput_dir = "{self.dir / "learner"}"\n'
            'device = "cpu"\ntorch_threads = 1\nbatch_groups = 4\nblock_ms = 200\n'
            f"max_staleness = {_NEVER_STALE}\n"
        )
        argv = [sys.executable, "-m", "streamrl.cli", "--redis", self.server.url]
        argv += ["--run", RUN, "learn", "--config", str(config)]
        (self.dir / "logs").mkdir(exist_ok=True)
        log = open(self.dir / "logs" / "learner.log", "ab")  # noqa: SIM115 - lives with it
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def _read_groups(self) -> None:
        """Count every group as it is written (the stream is trimmed behind us)."""
        while True:
            rows = self.p.r.xread({self.p.keys.groups: self._last_group_id}, count=1000)
            if not rows:
                return
            for entry_id, fields in rows[0][1]:
                self.seen[schema.GROUP.decode(fields[b"p"]).prompt_id] += 1
                self._last_group_id = entry_id

    def _sample(self, t0: float, learner: subprocess.Popen, last: dict | None) -> dict:
        workers = [proc.pid for _, proc in self.p.procs.procs if proc.poll() is None]
        workers += [pid for pid in list(workers) for pid in descendants(pid)]
        w_rss, w_fds, w_n = _proc_stats(workers)
        l_rss, l_fds, _ = _proc_stats([learner.pid])
        mem = self.p.r.info("memory")
        groups = sum(self.seen.values())
        now = time.monotonic() - t0
        rate = 0.0
        if last is not None and now > last["t_s"]:
            rate = (groups - last["groups"]) / (now - last["t_s"])
        return {
            "t_s": round(now, 1),
            "worker_rss_mib": round(w_rss, 1),
            "worker_fds": w_fds,
            "worker_processes": w_n,
            "learner_rss_mib": round(l_rss, 1),
            "learner_fds": l_fds,
            "redis_keys": self.p.r.dbsize(),
            "redis_keys_no_ttl": self._keys_without_ttl(),
            "redis_used_mib": round(mem["used_memory"] / 2**20, 2),
            "groups": groups,
            "groups_per_s": round(rate, 3),
        }

    def _soak(self, p: LocalPipeline, learner: subprocess.Popen) -> dict:
        s = self.soak
        p.start_workers(rollout=self.cfg.rollout_workers, verify=self.cfg.verify_workers)
        p.wait_ready(self.cfg.rollout_workers, self.cfg.verify_workers)
        self._push(self.cfg.prompts)
        t0 = time.monotonic()
        end = t0 + 60.0 * s.minutes
        samples: list[dict] = []
        next_kill = t0 + self.rng.expovariate(1.0 / s.kill_every_s)
        next_sample = t0 + s.sample_s
        while time.monotonic() < end:
            if learner.poll() is not None:
                raise RuntimeError(f"the learner exited ({learner.returncode}); see its log")
            with contextlib.suppress(Exception):  # one bad read is retried next second
                self._read_groups()
                self._keep_busy()
            now = time.monotonic()
            if now >= next_kill:
                self.faults.append(self._worker_fault(t0))
                next_kill = time.monotonic() + self.rng.expovariate(1.0 / s.kill_every_s)
            if now >= next_sample:
                samples.append(self._sample(t0, learner, samples[-1] if samples else None))
                last = samples[-1]
                self.say(
                    f"t={last['t_s']:7.1f}s workers {last['worker_rss_mib']:7.1f} MiB "
                    f"{last['worker_fds']:4d} fds; learner {last['learner_rss_mib']:6.1f} MiB "
                    f"{last['learner_fds']:3d} fds; redis {last['redis_keys']:5d} keys "
                    f"{last['redis_used_mib']:6.2f} MiB; {last['groups_per_s']:5.2f} groups/s; "
                    f"{len(self.faults)} kills"
                )
                next_sample += s.sample_s
            time.sleep(0.2)
        # no more faults or prompts: everything pushed must come out once
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and sum(self.seen.values()) < self.pushed:
            with contextlib.suppress(Exception):
                self._read_groups()
            time.sleep(0.2)
        return self._soak_report(samples)

    def _keys_without_ttl(self) -> int:
        """Keys that never expire: what a leak of keys is made of (a key with a TTL is bounded
        by its TTL times the rate it is made at)."""
        keys = list(self.p.r.scan_iter(count=1000))
        pipe = self.p.r.pipeline(transaction=False)
        for key in keys:
            pipe.ttl(key)
        return sum(1 for ttl in pipe.execute() if ttl == -1)

    def _key_kinds(self) -> dict[str, int]:
        """Redis keys by kind (the name with ids cut off): what a growing key count is made of."""
        kinds: Counter[str] = Counter()
        for key in self.p.r.scan_iter(count=1000):
            parts = key.decode(errors="replace").split(":")
            kinds[":".join(p for p in parts[:3] if not any(ch.isdigit() for ch in p))] += 1
        return dict(kinds.most_common(12))

    def _soak_report(self, samples: list[dict]) -> dict:
        verdicts = judge(samples)
        marker = next(self.p.r.scan_iter(match=self.p.keys.group("*"), count=1000), None)
        marker_bytes = int(self.p.r.memory_usage(marker) or 0) if marker else 0
        rate = verdicts["groups_per_s"]["mean"]
        doubled = sum(1 for n in self.seen.values() if n > 1)
        lost = self.pushed - len(self.seen)
        flat = all(v["flat"] for v in verdicts.values())
        return {
            "minutes": self.soak.minutes,
            "seed": self.soak.seed,
            "kills": len(self.faults),
            "prompts": self.pushed,
            "groups": sum(self.seen.values()),
            "lost": lost,
            "doubled": doubled,
            "dead_letters": self.p.r.xlen(self.p.keys.dead),
            "redis_keys_at_end": self._key_kinds(),
            # what the default 24 h marker TTL would hold at this rate (the soak uses a short one)
            "group_marker_bytes": marker_bytes,
            "default_ttl_markers_mib": round(rate * GROUP_DONE_TTL_S * marker_bytes / 2**20, 1),
            "slopes": verdicts,
            "flat": flat,
            "ok": flat and lost == 0 and doubled == 0,
            "threshold": f"growth per hour over the second half <= max(floor, "
            f"{RELATIVE:.0%} of its mean); floors {FLOORS}",
            "samples": samples,
        }


def plot(report: dict, path: str | Path) -> Path:
    """One panel per series against minutes (matplotlib, the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    panels = [
        ("worker_rss_mib", "worker RSS, all (MiB)"),
        ("learner_rss_mib", "learner RSS (MiB)"),
        ("worker_fds", "worker open fds, all"),
        ("learner_fds", "learner open fds"),
        ("redis_keys", "Redis keys, all"),
        ("redis_keys_no_ttl", "Redis keys without a TTL"),
        ("redis_used_mib", "Redis used_memory (MiB)"),
        ("groups_per_s", "throughput (groups/s)"),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2 * len(panels)), sharex=True)
    for ax, (key, title) in zip(axes, panels, strict=True):
        ys = [s[key] for s in samples]
        ax.plot(minutes, ys, lw=1)
        slope = report["slopes"][key]["slope_per_h"]
        ax.set_title(f"{title}: slope {slope:+g}/h over the second half", fontsize=9)
        ax.set_ylim(0, 1.15 * max(ys, default=1) or 1)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(
        f"streamrl bench soak: {report['minutes']:g} min, {report['kills']} worker SIGKILLs, "
        f"{report['prompts']} prompts, lost {report['lost']}, doubled {report['doubled']}",
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def soak_bench(
    cfg: SoakConfig,
    directory: str | Path | None = None,
    worker_env: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run one soak on a private Redis; returns the report (``ok``: flat and exactly once)."""
    say = progress or (lambda m: None)
    env = {**(worker_env or os.environ), "OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="streamrl-soak-"))
        return _Soak(cfg, Path(directory), env, say).run()
