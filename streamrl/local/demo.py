"""``streamrl demo``: one command, nothing running beforehand.

It trains the tiny model (``streamrl.models.tiny``) on the ``copy`` task through the whole
pipeline: a private Redis, a producer held back by admission control, two rollout workers on
the ``hf`` backend and a verifier as real ``rq worker`` processes, and the learner as its own
process, publishing a new policy version after every step while generation goes on. The live
view shows reward by policy version, throughput and lag; it stops at ``--seconds`` or when the
reward target is reached, and shuts everything down (Ctrl-C included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.console import Group as RichGroup
from rich.live import Live
from rich.table import Table

from streamrl.bus import health
from streamrl.config import RunConfig, load_toml
from streamrl.envs import make_env
from streamrl.local import prefork
from streamrl.local.pipeline import LocalPipeline
from streamrl.local.prefork import Prefork
from streamrl.local.procs import own_cpu, self_cpu, tree_cpu
from streamrl.ops.status import collect
from streamrl.ops.views import RewardFeed, status_table
from streamrl.producer.admission import LearnerAdmission, admission_limit
from streamrl.producer.produce import Producer

RUN = "demo"
# What the demo runs: the shipped config the README's Training section runs by hand, so the
# two cannot drift apart. Only the model directory, the run name and the output dir differ.
DEMO_CONFIG = Path(__file__).parents[1] / "configs" / "copy-tiny.toml"


def demo_config(path: str | Path | None = None) -> RunConfig:
    return load_toml(path or DEMO_CONFIG)


def _toml(run: RunConfig, learner: dict) -> str:
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        return repr(v)

    lines = [f'run = "{run.run}"', f'env = "{run.env}"', f"group_size = {run.group_size}", ""]
    lines.append("[policy]")
    p = run.policy
    lines += [f'backend = "{p.backend}"', f'model = "{p.model}"']
    lines += [f"temperature = {p.temperature}", f"max_new_tokens = {p.max_new_tokens}", ""]
    lines.append("[learner]")
    lines += [f"{k} = {val(v)}" for k, v in learner.items()]
    return "\n".join(lines) + "\n"


class Stopped(Exception):
    pass


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """``kill <pid>`` stops the demo as Ctrl-C does: the learner checkpoints, the workers,
    the fork server and the private Redis go with it, instead of running on as orphans."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train_demo(
    seconds: float = 300.0,
    target: float | None = 0.9,
    live: bool = True,
    directory: str | Path | None = None,
    window: int = 512,
    learner_overrides: dict | None = None,
    policy_options: dict | None = None,
    max_steps: int | None = None,
    admission_batches: int | None = None,
    seed: int = 0,
    stop_at_target: bool = True,
    config: str | Path | None = None,
    rollout_workers: int = 2,
) -> dict:
    """Returns the JSON summary. ``target=None`` trains until ``seconds`` or ``max_steps``
    learner steps; ``admission_batches`` fixes the in-flight window (in learner batches)
    instead of the learner's ``max_staleness + 1``."""
    from streamrl.models.tiny import save_tiny

    console = Console(stderr=True)
    started = time.monotonic()
    cfg = demo_config(config)
    cfg.run = RUN
    group_size = cfg.group_size
    pipeline = LocalPipeline(cfg, directory=directory)
    model_dir = pipeline.dir / "model"
    cfg.policy.model = str(model_dir)
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = {**os.environ, **threads}
    # torch and transformers imported once, by a fork server, while Redis starts; the
    # learner and the rollout workers are forked from it (see streamrl.local.prefork)
    forks = Prefork(env=threads) if prefork.enabled() else None
    with pipeline as p:
        procs = p.procs
        assert procs is not None
        procs.env = env
        if forks is not None:
            p.start_workers(rollout=0, verify=1, top_up=False)  # the verifier needs no torch
            forks.call(save_tiny, model_dir)  # waits for the server's imports
            procs.launcher = lambda argv, log, env_: forks.popen(argv, log, env_, True)
            p.start_workers(rollout=rollout_workers, verify=0, top_up=False)
        else:
            # start-up in parallel: the workers import torch and transformers
            # (STREAMRL_PRELOAD) while this process builds the model; no lease until tasks
            procs.env = {**env, "STREAMRL_PRELOAD": "torch,transformers"}
            p.start_workers(rollout=rollout_workers, verify=0, top_up=False)
            procs.env = env
            p.start_workers(rollout=0, verify=1, top_up=False)
            save_tiny(model_dir)
        cfg.policy.options.update({"seed": seed, **(policy_options or {})})
        learner = {**cfg.learner, "model": str(model_dir), "output_dir": str(p.dir / "learner")}
        learner["seed"] = seed
        learner.update(learner_overrides or {})
        from streamrl.workers.context import write_config

        cfg.learner = learner
        write_config(p.r, cfg)
        config_path = p.dir / "demo.toml"
        config_path.write_text(_toml(cfg, learner))
        console.print(
            f"[bold]streamrl demo[/]: tiny Llama learning `{cfg.env}` - Redis {p.url}, "
            f"config {config_path}, logs {p.dir}/logs"
        )
        learn = [sys.executable, "-m", "streamrl.cli", "learn", "--config", str(config_path)]
        learn += ["--redis", p.url, "--run", RUN]
        learner_log = p.dir / "logs" / "learner.log"
        if forks is not None:
            learner_proc: Any = forks.popen(learn, learner_log, env)
        else:
            out = open(learner_log, "ab")  # noqa: SIM115 - lives with the learner
            learner_proc = subprocess.Popen(learn, stdout=out, stderr=subprocess.STDOUT, env=env)
        # the model exists now: one lease per worker, without waiting for their idle poll
        from streamrl.defaults import ROLLOUT_QUEUE, VERIFY_QUEUE
        from streamrl.workers import leases

        leases.top_up(p.r, ROLLOUT_QUEUE, RUN, waiting=rollout_workers)
        leases.top_up(p.r, VERIFY_QUEUE, RUN, waiting=1)
        stop = threading.Event()
        batch = learner["batch_groups"] * group_size
        if admission_batches is not None:
            limit = admission_batches * batch
        else:
            limit = admission_limit(learner, group_size)
        admission = LearnerAdmission(
            p.r, RUN, group_size, limit=limit, override=admission_batches is not None
        )

        def admit(n: int) -> None:
            if stop.is_set():
                raise Stopped
            admission(n)

        def produce() -> None:
            try:
                # one learner batch per push, so admission can keep the pipe full
                Producer(p.r, RUN, admission=admit, batch_samples=batch).from_env(
                    make_env(cfg.env, **cfg.env_options), 10**7, group_size, seed=seed
                )
            except Stopped:
                pass
            except redis.RedisError:
                # the demo is over and its Redis is going away under a producer held by
                # admission: nothing to report (it used to print a traceback at every exit)
                if not stop.is_set():
                    raise

        threading.Thread(target=produce, daemon=True).start()
        feed = RewardFeed(p.r, RUN, start="0-0")
        recent: deque[float] = deque(maxlen=window)
        first: list[float] = []
        reached = reached_at = None
        first_step_at = None  # training time is measured from the learner's first step
        reached_step = None
        drawn = 0.0
        try:
            with Live(console=console, refresh_per_second=4, transient=not live) as view:
                while time.monotonic() - started < seconds:
                    for r_ in feed.poll():
                        recent.append(r_)
                        if len(first) < window:
                            first.append(r_)
                    step = int(p.r.hget(p.keys.learner, "step") or 0)
                    if first_step_at is None and step >= 1:
                        first_step_at = time.monotonic() - started
                    if max_steps is not None and step >= max_steps:
                        break
                    health.check_fault(p.r, p.keys)  # a stuck rollout worker: one line, exit 1
                    if learner_proc.poll() is not None:
                        raise RuntimeError(f"the learner exited; see {p.dir}/logs/learner.log")
                    if live and time.monotonic() - drawn >= 1.0:
                        # the full status (rq workers, stream info) costs Redis round trips
                        # and CPU that training needs: once a second is plenty for a person
                        drawn = time.monotonic()
                        view.update(_frame(feed, collect(p.r, RUN), started, recent))
                    full = len(recent) == window
                    at_target = target is not None and full and sum(recent) / window >= target
                    if at_target and reached is None:
                        reached = time.monotonic() - started
                        reached_at = time.time()
                        reached_step = step
                    if at_target and stop_at_target:
                        break
                    time.sleep(0.25)
        except KeyboardInterrupt:
            console.print("interrupted: shutting down")
        finally:
            stop.set()
            cpu = _cpu_by_role(p, learner_proc, forks)
            learner_proc.send_signal(signal.SIGTERM)  # it finishes its step and checkpoints
            with contextlib.suppress(subprocess.TimeoutExpired):
                learner_proc.wait(timeout=30)
            if learner_proc.poll() is None:
                learner_proc.kill()
            p.stop()
        info = collect(p.r, RUN)["learner"]
        return {
            "reward_first": _mean(first),
            "reward_last": _mean(list(recent)),
            "groups_trained": info.get("groups_applied", 0),
            "policy_version": info.get("policy_version", 0),
            "learner_steps": info.get("step", 0),
            "samples_scored": feed_count(feed),
            "newest_rollout_version": max(feed.by_version, default=0),
            "seconds": round(time.monotonic() - started, 2),
            "seconds_to_target": round(reached, 2) if reached is not None else None,
            "reached_at": reached_at,  # epoch seconds: `bench vs-trl` times from the launch
            "steps_to_target": reached_step,
            "startup_seconds": round(first_step_at, 2) if first_step_at is not None else None,
            "training_seconds_to_target": (
                round(reached - first_step_at, 2)
                if reached is not None and first_step_at is not None
                else None
            ),
            "target": target,
            "cpu_seconds": cpu,
            # off-policy evidence (bench offpolicy): versions behind at training time, the
            # share of importance weights clipped, groups dropped as too stale
            "applied_staleness": _staleness(info.get("applied_staleness")),
            "is_clipped_fraction": info.get("is_clipped_fraction"),
            "groups_dropped_stale": info.get("dropped_stale", 0),
            "entropy": info.get("entropy"),
        }


def feed_count(feed: RewardFeed) -> int:
    return sum(len(v) for v in feed.by_version.values())


def _staleness(text: object) -> dict[int, int]:
    import json

    raw = json.loads(text) if isinstance(text, str) and text else {}
    return {int(k): v for k, v in sorted(raw.items(), key=lambda kv: int(kv[0]))}


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def _frame(feed: RewardFeed, info: dict, started: float, recent: deque) -> RichGroup:
    elapsed = time.monotonic() - started
    ln = info.get("learner", {})
    t = Table.grid(padding=(0, 2))
    t.add_row("elapsed", f"{elapsed:.1f} s", "samples/s", f"{feed_count(feed) / elapsed:.0f}")
    t.add_row(
        "learner step",
        str(ln.get("step", 0)),
        f"reward (last {len(recent)})",
        f"{(sum(recent) / len(recent)) if recent else 0:.3f}",
    )
    return RichGroup(t, feed.table(), status_table(info))


def _cpu_by_role(p: LocalPipeline, learner: Any, forks: Prefork | None) -> dict[str, float]:
    """CPU seconds each part of the demo used so far (from /proc), to see what limits it."""

    out: dict[str, float] = {"learner": tree_cpu([learner.pid]), "driver": self_cpu()}
    if forks is not None and forks.server_pid:
        out["prefork"] = own_cpu(forks.server_pid)  # the shared imports
    for name, proc in p.procs.procs if p.procs else []:
        role = "rollout" if "rollout" in name else "verify"
        out[role] = out.get(role, 0.0) + tree_cpu([proc.pid])
    if p.server is not None and p.server.proc is not None:
        out["redis"] = tree_cpu([p.server.proc.pid])
    return {k: round(v, 2) for k, v in out.items()}
