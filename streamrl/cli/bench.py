"""`streamrl bench …`: benchmarks that print JSON (and exit 1 when the run lost work)."""

from __future__ import annotations

import os

import click

from streamrl.cli._common import report
from streamrl.cli.bench_vs_trl import bench_vs_trl


def _progress(as_json: bool):
    """Progress lines for a person, on stderr; none with --json."""
    return None if as_json else lambda m: click.echo(m, err=True)


@click.group()
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmarks that print JSON."""
    from streamrl.local.demo import sigterm_as_interrupt

    # ``kill <pid>`` stops a benchmark as Ctrl-C does: the workers, servers and private Redis
    # it started go with it (a SIGTERMed soak used to leave its rq workers and Redis running)
    ctx.with_resource(sigterm_as_interrupt())


@bench.command("pipeline")
@click.option(
    "--tasks", type=click.IntRange(min=1), default=1000, show_default=True, help="Prompts."
)
@click.option("--group-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--turns", default=1, show_default=True, help="Model turns (T-1 tool calls).")
@click.option("--rollout-workers", default=1, show_default=True)
@click.option("--verify-workers", default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_pipeline(tasks, group_size, turns, rollout_workers, verify_workers, as_json) -> None:
    """The whole path on a private Redis with the scripted policy and real rq workers."""
    from streamrl.benchmarks.pipeline import pipeline_bench

    res = pipeline_bench(
        tasks=tasks,
        group_size=group_size,
        turns=turns,
        rollout_workers=rollout_workers,
        verify_workers=verify_workers,
        progress=_progress(as_json),
    )
    report(res, as_json, failed=bool(res["lost"] or res["duplicated"]))


@bench.command("sessions")
@click.option(
    "--sessions",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Episodes, all started at once.",
)
@click.option("--turns", type=click.IntRange(min=2), default=4, show_default=True)
@click.option(
    "--latency",
    "latency_s",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Seconds the scripted policy takes per turn: how long episodes stay open.",
)
@click.option("--rollout-workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--verify-workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_sessions(sessions, turns, latency_s, rollout_workers, verify_workers, as_json) -> None:
    """Hold thousands of multi-turn episodes open at once; report Redis bytes per open session,
    worker memory per episode and trajectories/s. Exits 1 if anything was lost or doubled."""
    from streamrl.benchmarks.sessions import sessions_bench

    res = sessions_bench(
        sessions=sessions,
        turns=turns,
        latency_s=latency_s,
        rollout_workers=rollout_workers,
        verify_workers=verify_workers,
        progress=_progress(as_json),
    )
    report(res, as_json, failed=bool(res["lost"] or res["duplicated"] or res["dead_letters"]))


@bench.command("session-size")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False),
    default="models/smollm2-135m",
    show_default=True,
    help="A model directory with tokenizer.json (its tokenizer counts the tokens).",
)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--turns", type=click.IntRange(min=2), default=4, show_default=True)
@click.option(
    "--generated-tokens",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="Tokens the model writes per turn.",
)
@click.option(
    "--tool-tokens",
    type=click.IntRange(min=1),
    default=200,
    show_default=True,
    help="Tokens of each tool output.",
)
@click.option("--json", "as_json", is_flag=True)
def bench_session_size(
    model_dir, prompt_tokens, turns, generated_tokens, tool_tokens, as_json
) -> None:
    """Redis bytes of one realistic episode's session at each checkpoint, plain msgpack
    against the packed form rollout workers write, without and with the model's tokenizer."""
    from streamrl.benchmarks.sessions import session_size_bench

    res = session_size_bench(model_dir, prompt_tokens, turns, generated_tokens, tool_tokens)
    report(res, as_json)


@bench.command("nemo-gym")
@click.option("--base-url", required=True, help="The resources server (http://host:port).")
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False),
    required=True,
    help="NeMo Gym rows with a reference_output for the scripted policy to replay.",
)
@click.option("--group-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Episodes in flight per rollout worker (and its HTTP connections).",
)
@click.option("--rollout-workers", default=1, show_default=True)
@click.option("--verify-workers", default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_nemo_gym(
    base_url, dataset, group_size, concurrency, rollout_workers, verify_workers, as_json
) -> None:
    """The whole path through a NeMo Gym resources server, scripted policy: trajectories/s."""
    from streamrl.benchmarks.pipeline import nemo_gym_bench

    res = nemo_gym_bench(
        base_url,
        dataset,
        group_size=group_size,
        concurrency=concurrency,
        rollout_workers=rollout_workers,
        verify_workers=verify_workers,
        progress=_progress(as_json),
    )
    report(res, as_json, failed=bool(res["lost"] or res["duplicated"]))


@bench.command("chaos")
@click.option(
    "--kills", type=click.IntRange(min=0), default=20, show_default=True, help="Worker SIGKILLs."
)
@click.option("--seed", default=0, show_default=True)
@click.option("--prompts", type=click.IntRange(min=1), default=400, show_default=True)
@click.option("--rollout-workers", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--verify-workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--redis-restart/--no-redis-restart",
    default=True,
    show_default=True,
    help="Also SIGKILL redis-server once and restart it from its AOF.",
)
@click.option(
    "--timeout-s",
    type=click.FloatRange(min=1),
    default=600,
    show_default=True,
    help="Give up (and report drained: false) after this long.",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep the run here (worker logs, Redis AOF); default: a temporary directory.",
)
@click.option("--json", "as_json", is_flag=True)
def bench_chaos(
    kills, seed, prompts, rollout_workers, verify_workers, redis_restart, timeout_s, directory,
    as_json,
):  # fmt: skip
    """Kill workers (whole tree, rq main, work horse; at random and at lease boundaries) and
    Redis at random, then check that every prompt ends as exactly one complete group.
    Exits 1 if anything was lost, doubled or dead-lettered."""
    from streamrl.benchmarks.chaos import ChaosConfig, chaos_bench, clean

    cfg = ChaosConfig(
        kills=kills,
        seed=seed,
        prompts=prompts,
        rollout_workers=rollout_workers,
        verify_workers=verify_workers,
        redis_restart=redis_restart,
        timeout_s=timeout_s,
    )
    if directory:
        os.makedirs(directory, exist_ok=True)
    res = chaos_bench(cfg, directory=directory, progress=_progress(as_json))
    if as_json:
        res = {k: v for k, v in res.items() if k != "faults"}
    report(res, as_json, failed=not clean(res))


@bench.command("soak")
@click.option("--minutes", type=click.FloatRange(min=0.5), default=60.0, show_default=True)
@click.option(
    "--kill-every-s",
    type=click.FloatRange(min=0.5),
    default=5.0,
    show_default=True,
    help="Mean gap between worker SIGKILLs.",
)
@click.option("--sample-s", type=click.FloatRange(min=1), default=10.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Draw the samples to this PNG (needs matplotlib: the bench extra).",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep the run here (worker and learner logs); default: a temporary directory.",
)
@click.option("--json", "as_json", is_flag=True)
def bench_soak(minutes, kill_every_s, sample_s, seed, plot_path, directory, as_json):
    """Run the scripted pipeline with a learner for MINUTES, SIGKILL a worker every few
    seconds, and sample RSS, open fds, Redis keys and used_memory, and throughput every
    SAMPLE_S. Exits 1 if a series keeps growing or a prompt is lost or doubled."""
    from streamrl.benchmarks.soak import SoakConfig, plot, soak_bench

    cfg = SoakConfig(minutes=minutes, kill_every_s=kill_every_s, sample_s=sample_s, seed=seed)
    if directory:
        os.makedirs(directory, exist_ok=True)
    res = soak_bench(cfg, directory=directory, progress=_progress(as_json))
    if plot_path:
        res["plot"] = str(plot(res, plot_path))
    report(res, as_json, failed=not res["ok"])


@bench.command("offpolicy")
@click.option("--lag", default=4, show_default=True, help="Policy versions rollouts lag by.")
@click.option("--steps", default=500, show_default=True, help="Learner steps per run.")
@click.option("--seconds", default=150.0, show_default=True, help="Time limit per run.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_offpolicy(lag: int, steps: int, seconds: float, seed: int, as_json: bool) -> None:
    """Train `copy` on-policy, `lag` versions behind with and without importance correction."""
    from streamrl.benchmarks.pipeline import offpolicy_bench

    res = offpolicy_bench(
        lag=lag,
        steps=steps,
        seconds=seconds,
        seed=seed,
        progress=_progress(as_json),
    )
    report(res, as_json)


bench.add_command(bench_vs_trl)
