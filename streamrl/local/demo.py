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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import tomli_w
from rich.console import Console
from rich.console import Group as RichGroup
from rich.live import Live
from rich.table import Table

from streamrl.bus import health
from streamrl.config import RunConfig, load_toml
from streamrl.defaults import DEMO_WORKER_NICE, ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.envs import make_env
from streamrl.local import prefork
from streamrl.local.pipeline import LocalPipeline, memory_scratch
from streamrl.local.prefork import Prefork
from streamrl.local.procs import lower_priority, own_cpu, self_cpu, tree_cpu
from streamrl.local.progress import TIMELINE_COLUMNS, Progress
from streamrl.ops.status import collect
from streamrl.ops.views import RewardFeed, status_table
from streamrl.producer.admission import LearnerAdmission, admission_limit
from streamrl.producer.produce import Producer
from streamrl.workers import leases
from streamrl.workers.context import write_config

RUN = "demo"
# how often the live loop reads new rewards and checks the target: the moment the target is
# noticed is the demo's time to it (`bench vs-trl`), late by half of this on average
_POLL_S = 0.05
# What the demo runs: the shipped config the README's Training section runs by hand, so the
# two cannot drift apart. Only the model directory, the run name and the output dir differ.
DEMO_CONFIG = Path(__file__).parent.parent / "configs" / "copy-tiny.toml"


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """One demo run: `streamrl demo`'s flags and the knobs the benchmarks turn
    (`bench offpolicy`, the NeMo Gym check) and the tests use."""

    seconds: float = 300.0  # stop after this long, start-up included
    target: float | None = 0.9  # mean reward over `window` to reach; None: train on
    stop_at_target: bool = True  # False: note when the target is reached and train on
    max_steps: int | None = None  # stop once the learner has taken this many steps
    live: bool = True  # keep the live view on screen (else it is drawn only while running)
    window: int = 512  # rewards averaged for reward_first, reward_last and the target
    # Redis, logs, model, checkpoints (default: a temp dir, in memory where it can be)
    directory: str | Path | None = None
    config: str | Path | None = None  # run config (default: DEMO_CONFIG)
    rollout_workers: int = 2
    seed: int = 0  # the learner's, the policy's and the prompt generator's
    learner_overrides: Mapping[str, Any] = field(default_factory=dict)  # over [learner]
    policy_options: Mapping[str, Any] = field(default_factory=dict)  # over [policy] options
    # the in-flight window in learner batches, instead of the learner's max_staleness + 1
    admission_batches: int | None = None
    # The workers' and the producer's nice value (0: the learner's). Mid-run the learner is
    # the critical path: on two cores it was runnable ~95 % of the time yet, sharing them
    # evenly with workers that run ahead to the admission window and then wait, it ran only
    # ~75 % of it. At the lowest priority the workers take what the learner leaves, and both
    # cores while it waits for data (docs/benchmarks.md, "The learner first"). Redis, the
    # fork server and the learner stay at 0.
    worker_nice: int = DEMO_WORKER_NICE


def learner_toml(cfg: RunConfig) -> str:
    """The file `streamrl learn --config` reads: the run, its policy and its [learner] table."""
    p = cfg.policy
    policy = {
        "backend": p.backend,
        "model": p.model,
        "temperature": p.temperature,
        "max_new_tokens": p.max_new_tokens,
    }
    doc = {"run": cfg.run, "env": cfg.env, "group_size": cfg.group_size}
    return tomli_w.dumps({**doc, "policy": policy, "learner": cfg.learner})


class _Stopped(Exception):
    """The demo is over: the producer thread, held by admission, ends."""


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


def train_demo(opts: DemoOptions = DemoOptions()) -> dict:
    """Returns the JSON summary (``_result``). ``target=None`` trains until ``seconds`` or
    ``max_steps`` learner steps."""
    console = Console(stderr=True)
    progress = Progress(opts.window)  # the clock starts here: `seconds` counts start-up
    cfg = load_toml(opts.config or DEMO_CONFIG)
    cfg.run = RUN
    pipeline = LocalPipeline(cfg, directory=opts.directory, scratch=memory_scratch())
    model_dir = pipeline.dir / "model"
    cfg.policy.model = str(model_dir)
    env = {**os.environ, **prefork.THREADS}
    # torch and transformers imported once, by a fork server, while Redis starts; the
    # learner and the rollout workers are forked from it (see streamrl.local.prefork)
    # (already started when the command line began: prefork.start_early)
    forks = (prefork.take_early() or Prefork(env=prefork.THREADS)) if prefork.enabled() else None
    stop = threading.Event()  # the producer thread's
    with pipeline as p:
        try:
            config_path = _write_config(p, cfg, opts)
            _start_producer(p, cfg, opts, stop)  # prompts wait in Redis while the imports run
            _start_workers(p, forks, env, model_dir, opts.rollout_workers, opts.worker_nice)
            console.print(
                f"[bold]streamrl demo[/]: tiny Llama learning `{cfg.env}` - Redis {p.url}, "
                f"config {config_path}, logs {p.dir}/logs"
            )
            console.print(
                f"in a browser: streamrl --redis {p.url} --run {RUN} view", soft_wrap=True
            )
            # the model exists now: one lease per worker, without waiting for their idle
            # poll, and rollouts under way while the learner loads
            leases.top_up(p.r, ROLLOUT_QUEUE, RUN, waiting=opts.rollout_workers)
            leases.top_up(p.r, VERIFY_QUEUE, RUN, waiting=1)
            learner = _start_learner(p, forks, env, config_path)
        except BaseException:
            stop.set()
            if forks is not None:
                forks.stop()  # before the run's directory goes: nothing forked into it later
            raise
        feed = RewardFeed(p.r, RUN, start="0-0")
        try:
            _watch(p, learner, feed, progress, opts, console)
        except KeyboardInterrupt:
            console.print("interrupted: shutting down")
        finally:
            stop.set()
            cpu = _shut_down(p, learner, forks)
            if forks is not None:
                forks.stop()
        return _result(collect(p.r, RUN)["learner"], feed, progress, opts.target, cpu)


def _start_workers(
    p: LocalPipeline, forks: Prefork | None, env: dict, model_dir: Path, rollout: int, nice: int
) -> None:
    """The verifier and the rollout workers at nice value ``nice``, and the tiny model they
    (and the learner) load; no lease yet, so the workers idle until the run has work."""
    from streamrl.models.tiny import save_tiny

    procs = p.procs
    assert procs is not None
    procs.env = env
    procs.nice = nice  # born at it: threads started before a later lowering would escape it
    started = []
    if forks is not None:
        started += p.start_workers(rollout=0, verify=1, top_up=False)  # no torch needed
        forks.call(save_tiny, model_dir)  # waits for the server's imports
        procs.launcher = lambda argv, log, env_: forks.popen(argv, log, env_, True, nice)
        started += p.start_workers(rollout=rollout, verify=0, top_up=False)
    else:
        # start-up in parallel: the workers import torch and transformers
        # (STREAMRL_PRELOAD) while this process builds the model
        procs.env = {**env, "STREAMRL_PRELOAD": "torch,transformers"}
        started += p.start_workers(rollout=rollout, verify=0, top_up=False)
        procs.env = env
        started += p.start_workers(rollout=0, verify=1, top_up=False)
        save_tiny(model_dir)
    for proc in started:  # where the system set it otherwise (nice was not above ours)
        lower_priority(proc.pid, nice)


def _write_config(p: LocalPipeline, cfg: RunConfig, opts: DemoOptions) -> Path:
    """The run's config with the demo's model, seed, output dir and overrides: in Redis for
    the workers, and as a TOML file for the learner's command line (its path returned)."""
    cfg.policy.options.update({"seed": opts.seed, **opts.policy_options})
    learner = {**cfg.learner, "model": cfg.policy.model, "output_dir": str(p.dir / "learner")}
    learner["seed"] = opts.seed
    learner.update(opts.learner_overrides)
    cfg.learner = learner
    write_config(p.r, cfg)
    path = p.dir / "demo.toml"
    path.write_text(learner_toml(cfg))
    return path


def _start_learner(p: LocalPipeline, forks: Prefork | None, env: dict, config: Path) -> Any:
    """`streamrl learn` as a process of its own (forked from the fork server when there is
    one), logging to logs/learner.log."""
    argv = [sys.executable, "-m", "streamrl.cli", "learn", "--config", str(config)]
    argv += ["--redis", str(p.url), "--run", RUN]
    log = p.dir / "logs" / "learner.log"
    if forks is not None:
        return forks.popen(argv, log, env)
    out = open(log, "ab")  # noqa: SIM115 - lives with the learner
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def _start_producer(
    p: LocalPipeline, cfg: RunConfig, opts: DemoOptions, stop: threading.Event
) -> None:
    """Prompts from the environment's generator, pushed by a daemon thread under admission
    control, one learner batch per push (so admission can keep the pipe full), until `stop`."""
    group_size = cfg.group_size
    batch = cfg.learner["batch_groups"] * group_size
    if opts.admission_batches is not None:
        limit = opts.admission_batches * batch
    else:
        limit = admission_limit(cfg.learner, group_size)
    admission = LearnerAdmission(
        p.r, RUN, group_size, limit=limit, override=opts.admission_batches is not None
    )

    def admit(n: int) -> None:
        if stop.is_set():
            raise _Stopped
        admission(n)

    def produce() -> None:
        with contextlib.suppress(OSError):  # this thread only (Linux): see worker_nice
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), opts.worker_nice)
        try:
            Producer(p.r, RUN, admission=admit, batch_samples=batch).from_env(
                make_env(cfg.env, **cfg.env_options), 10**7, group_size, seed=opts.seed
            )
        except _Stopped:
            pass
        except redis.RedisError:
            # the demo is over and its Redis is going away under a producer held by
            # admission: nothing to report (it used to print a traceback at every exit)
            if not stop.is_set():
                raise

    threading.Thread(target=produce, daemon=True).start()


def _watch(
    p: LocalPipeline,
    learner: Any,
    feed: RewardFeed,
    progress: Progress,
    opts: DemoOptions,
    console: Console,
) -> None:
    """Until time is up, the step budget is spent or the target is reached: rewards in, the
    learner and the rollout workers checked, the view drawn once a second."""
    drawn = noted = 0.0
    with Live(console=console, refresh_per_second=4, transient=not opts.live) as view:
        while progress.elapsed() < opts.seconds:
            progress.add(feed.poll())
            raw = p.r.hmget(p.keys.learner, "step", "entropy", "entropy_coef")
            step, entropy, coef = int(raw[0] or 0), float(raw[1] or 0), float(raw[2] or 0)
            progress.saw_step(step)
            if time.monotonic() - noted >= 1.0:
                noted = time.monotonic()
                progress.note(step, _feed_count(feed), entropy, coef)
            if opts.max_steps is not None and step >= opts.max_steps:
                break
            health.check_fault(p.r, p.keys)  # a stuck rollout worker: one line, exit 1
            if learner.poll() is not None:
                raise RuntimeError(f"the learner exited; see {p.dir}/logs/learner.log")
            if opts.live and time.monotonic() - drawn >= 1.0:
                # the full status (rq workers, stream info) costs Redis round trips
                # and CPU that training needs: once a second is plenty for a person
                drawn = time.monotonic()
                view.update(_frame(feed, collect(p.r, RUN), progress.started, progress.recent))
            if progress.at_target(opts.target, step) and opts.stop_at_target:
                break
            time.sleep(_POLL_S)


def _shut_down(p: LocalPipeline, learner: Any, forks: Prefork | None) -> dict[str, float]:
    """Stop the learner (it finishes its step and checkpoints) and the workers; returns the
    CPU seconds each part used, read while they still run."""
    cpu = _cpu_by_role(p, learner, forks)
    learner.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        learner.wait(timeout=30)
    if learner.poll() is None:
        learner.kill()
    p.stop()
    return cpu


def _result(
    info: dict, feed: RewardFeed, progress: Progress, target: float | None, cpu: dict
) -> dict:
    """The summary: rewards at the start and the end, what the learner did, the time to the
    target (from the launch and from the first step), CPU by role, off-policy figures."""
    reached, first_step_at = progress.reached, progress.first_step_at
    return {
        "reward_first": _mean(progress.first),
        "reward_last": _mean(list(progress.recent)),
        "groups_trained": info.get("groups_applied", 0),
        "policy_version": info.get("policy_version", 0),
        "learner_steps": info.get("step", 0),
        "samples_scored": _feed_count(feed),
        "newest_rollout_version": max(feed.by_version, default=0),
        "seconds": round(progress.elapsed(), 2),
        "seconds_to_target": round(reached, 2) if reached is not None else None,
        "reached_at": progress.reached_at,  # epoch seconds: `bench vs-trl` times from launch
        "started_at": round(time.time() - progress.elapsed(), 3),  # epoch: timeline's 0
        "steps_to_target": progress.reached_step,
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
        "timeline_columns": TIMELINE_COLUMNS,
        "timeline": progress.timeline,
    }


def _feed_count(feed: RewardFeed) -> int:
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
    t.add_row("elapsed", f"{elapsed:.1f} s", "samples/s", f"{_feed_count(feed) / elapsed:.0f}")
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
