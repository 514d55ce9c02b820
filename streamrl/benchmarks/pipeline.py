"""``streamrl bench pipeline`` / ``streamrl bench nemo-gym``: the whole path (producer -> rq
rollout workers -> rq verifier workers -> groups) on a private Redis with the scripted policy,
timed from the first task pushed to the last group written. Prints one JSON object.

CPU is the user+system time of every process involved (this producer, the rq workers and their
work horses, redis-server) over the timed window, read from /proc; ``redis_cpu_ms_per_trajectory``
is redis-server's share alone (what sizes Redis nodes: one core each).

Redis's own account comes from ``INFO commandstats`` (reset when the timed window starts):
``redis_commands_per_trajectory`` counts every command Redis executed, those run inside Lua
scripts included (Redis counts both), and ``commands`` breaks it down by command name, calls
and usec per trajectory, largest usec first. ``redis_usec_per_trajectory`` sums usec over the
top-level commands: a script's EVALSHA line already includes the time of the commands it ran,
so no command that a streamrl script calls is added a second time (that leaves out the few GETs
and SETs the workers send themselves: under 0.1 usec per trajectory here).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable

import redis

from streamrl.bus import scripts
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, VerifyConfig
from streamrl.defaults import MAX_CONCURRENT_EPISODES, READ_BATCH
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.local.procs import self_cpu, tree_cpu
from streamrl.producer.produce import Producer


def _script_commands() -> frozenset[str]:
    """Every command streamrl's Lua scripts call (``redis.call('XADD', ...)``)."""
    text = "".join(v for v in vars(scripts).values() if isinstance(v, str))
    return frozenset(m.lower() for m in re.findall(r"redis\.p?call\('([A-Z]+)'", text))


def command_table(stats: dict, n: int) -> dict[str, dict[str, float]]:
    """``INFO commandstats`` per trajectory: command name -> calls and usec, largest usec first."""
    rows = {
        k.removeprefix("cmdstat_"): {
            "calls": round(v["calls"] / n, 3),
            "usec": round(v["usec"] / n, 2),
        }
        for k, v in stats.items()
    }
    return dict(sorted(rows.items(), key=lambda kv: (-kv[1]["usec"], kv[0])))


def _commands(r: redis.Redis, n: int) -> dict:
    stats = r.info("commandstats")
    total = sum(v["calls"] for v in stats.values())
    scripts = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    inner = _script_commands()
    usec = sum(v["usec"] for k, v in stats.items() if k.removeprefix("cmdstat_") not in inner)
    return {
        "redis_commands_per_trajectory": round(total / n, 2),
        "lua_calls_per_trajectory": round(scripts / n, 3),
        "redis_usec_per_trajectory": round(usec / n, 1),
        "commands": command_table(stats, n),
    }


def pipeline_bench(
    tasks: int = 1000,
    group_size: int = 4,
    turns: int = 1,
    rollout_workers: int = 1,
    verify_workers: int = 1,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
    max_concurrent: int = MAX_CONCURRENT_EPISODES,
) -> dict:
    cfg = RunConfig(
        run="bench",
        env="counter",
        group_size=group_size,
        env_options={"steps": turns - 1},
        policy=PolicyConfig(backend="scripted", wrong_rate=0.25),
        rollout=RolloutConfig(
            max_turns=turns + 1, lease_seconds=timeout_s, max_concurrent=max_concurrent
        ),
        verify=VerifyConfig(lease_seconds=timeout_s),
    )
    env = make_env("counter", steps=turns - 1)

    def push(p: LocalPipeline) -> None:
        Producer(p.r, cfg.run).from_env(env, tasks, group_size, seed=0)

    res = _timed(
        cfg, push, task_ids("counter", 0, tasks, group_size), rollout_workers, verify_workers,
        timeout_s, progress,
    )  # fmt: skip
    return {"tasks": tasks, "group_size": group_size, "turns": turns, **res}


def nemo_gym_bench(
    base_url: str,
    dataset: str,
    group_size: int = 4,
    concurrency: int = 64,
    rollout_workers: int = 1,
    verify_workers: int = 1,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
    max_turns: int = 16,
) -> dict:
    """The same path with the ``nemo-gym`` environment: every seed, tool call and verify is an
    HTTP request to the resources server at ``base_url`` (its own cost is in the time, and in
    ``cpu_seconds`` only if it runs under this process tree: it does not). ``dataset`` holds
    NeMo Gym rows with a ``reference_output`` for the scripted policy to replay."""
    from streamrl.responses import row_to_prompt

    with open(dataset, "rb") as f:
        ids = [row_to_prompt(line)[2] for line in f if line.strip()]
    cfg = RunConfig(
        run="bench-nemo-gym",
        env="nemo-gym",
        group_size=group_size,
        env_options={"base_url": base_url, "max_connections": concurrency},
        policy=PolicyConfig(backend="scripted", wrong_rate=0.0),
        rollout=RolloutConfig(
            max_turns=max_turns,
            lease_seconds=timeout_s,
            max_concurrent=concurrency,
            read_batch=min(READ_BATCH, concurrency),
        ),
        verify=VerifyConfig(lease_seconds=timeout_s),
    )

    def push(p: LocalPipeline) -> None:
        Producer(p.r, cfg.run).from_jsonl(dataset, "nemo-gym", group_size)

    expected = {f"{pid}:{k}" for pid in ids for k in range(group_size)}
    res = _timed(cfg, push, expected, rollout_workers, verify_workers, timeout_s, progress)
    return {"prompts": len(ids), "group_size": group_size, "concurrency": concurrency, **res}


def _timed(
    cfg: RunConfig,
    push: Callable[[LocalPipeline], None],
    expected: set[str],
    rollout_workers: int,
    verify_workers: int,
    timeout_s: float,
    progress: Callable[[str], None] | None,
) -> dict:
    say = progress or (lambda m: None)
    with LocalPipeline(cfg) as p:
        p.start_workers(rollout_workers, verify_workers, seconds=timeout_s)
        say(f"waiting for {rollout_workers} rollout + {verify_workers} verifier workers")
        p.wait_ready(rollout_workers, verify_workers)
        assert p.server is not None and p.server.proc is not None and p.procs is not None
        roots = [p.server.proc.pid] + [proc.pid for _, proc in p.procs.procs]
        p.r.config_resetstat()
        cpu0 = tree_cpu(roots) + self_cpu()
        redis0 = tree_cpu(roots[:1])
        t0 = time.perf_counter()
        push(p)
        n = len(expected)
        say(f"pushed {n} samples")
        p.wait_groups(n // cfg.group_size, timeout=timeout_s)
        elapsed = time.perf_counter() - t0
        cpu = tree_cpu(roots) + self_cpu() - cpu0
        redis_cpu = tree_cpu(roots[:1]) - redis0
        commands = _commands(p.r, n)
        p.stop()
        acc = p.account(expected)
        return {
            "max_concurrent": cfg.rollout.max_concurrent,
            "rollout_workers": rollout_workers,
            "verify_workers": verify_workers,
            "trajectories": acc.scored,
            "seconds": round(elapsed, 3),
            "trajectories_per_s": round(n / elapsed, 1),
            "groups": acc.groups,
            "malformed_groups": acc.malformed_groups,
            "lost": acc.lost,
            "duplicated": acc.duplicated,
            "dead_letters": p.r.xlen(p.keys.dead),
            "cpu_seconds": round(cpu, 3),
            "cpu_ms_per_trajectory": round(1000 * cpu / n, 3),
            "redis_cpu_ms_per_trajectory": round(1000 * redis_cpu / n, 3),
            **commands,
            "cpus": os.cpu_count(),
        }


def offpolicy_bench(
    lag: int = 4,
    steps: int = 500,
    seconds: float = 150.0,
    target: float = 0.9,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Off-policy tolerance on ``copy``: the same training three times, with rollouts from the
    newest policy, from a policy ``lag`` versions behind with the importance correction on,
    and the same without it. Every run keeps the same in-flight window (3 learner batches)
    and accepts staleness up to ``lag + 3``, so no group is dropped for staleness."""
    from streamrl.local.demo import DemoOptions, train_demo

    say = progress or (lambda m: None)
    runs = {
        "on_policy": (0, "token_truncate"),
        f"lag{lag}_corrected": (lag, "token_truncate"),
        f"lag{lag}_uncorrected": (lag, "off"),
    }
    out: dict = {"lag": lag, "steps": steps, "target": target, "seed": seed, "runs": {}}
    for name, (run_lag, correction) in runs.items():
        say(f"{name}: lag {run_lag}, importance sampling {correction}")
        opts = DemoOptions(
            seconds=seconds,
            target=target,
            live=False,
            learner_overrides={
                "importance_sampling": correction,
                "max_staleness": lag + 3,
                "sync_every": 1,  # one version per step: the lag is in optimizer steps
                # the backend loads the version `lag` behind the newest: keep it on disk
                "keep_policy_versions": lag + 4,
            },
            policy_options={"lag_versions": run_lag},
            max_steps=steps,
            admission_batches=3,
            seed=seed,
            stop_at_target=False,
        )
        res = train_demo(opts)
        out["runs"][name] = {
            k: res[k]
            for k in (
                "reward_first",
                "reward_last",
                "steps_to_target",
                "training_seconds_to_target",
                "learner_steps",
                "groups_trained",
                "applied_staleness",
                "is_clipped_fraction",
                "groups_dropped_stale",
            )
        }
        say(f"  {out['runs'][name]}")
    return out
