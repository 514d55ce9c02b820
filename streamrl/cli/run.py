"""The commands that make a run go: `up` (a private Redis), `produce` (tasks in) and `worker`
(one rq worker per role)."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from streamrl import defaults as d
from streamrl.cli._common import Ctx, pass_ctx, validated
from streamrl.cli.options import env_option

if TYPE_CHECKING:
    from streamrl.config import RunConfig
    from streamrl.producer.admission import LearnerAdmission
    from streamrl.producer.produce import Producer, ProduceResult


@click.command()
@click.option(
    "--durable",
    is_flag=True,
    help="Turn on Redis's append-only file; a crashed server is restarted on the same port.",
)
@pass_ctx
def up(c: Ctx, durable: bool) -> None:
    """Start a private redis-server for this directory and keep it running (Ctrl-C stops it).

    Other streamrl commands in this directory find it on their own; rq workers need its URL:
    `rq worker -u URL -w streamrl.workers.LeaseWorker srl-rollout`. With --durable the server
    keeps the same port across restarts (of it, or of `streamrl up`), so URLs stay valid, and
    if it dies it is started again from its append-only file.
    """
    from streamrl.local.embedded import EmbeddedRedis, RedisNotInstalled

    # Installed before the server starts: a `kill` (SIGTERM) at any moment must stop it too.
    # It runs in its own session, so nothing else would, and Python's default SIGTERM skips
    # `finally` and atexit; SystemExit runs both.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server = EmbeddedRedis(c.run_dir, durable=durable).start()
    except RedisNotInstalled as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"redis-server on {server.url} (dir {c.run_dir}, durable={durable})")
    click.echo(f"  export STREAMRL_REDIS_URL={server.url} RQ_REDIS_URL={server.url}")
    try:
        while True:
            while server.proc and server.proc.poll() is None:
                time.sleep(0.5)
            code = server.proc.returncode if server.proc else None
            if not durable:
                raise click.ClickException(f"redis-server exited (status {code})")
            click.echo(f"redis-server exited (status {code}); restarting it from its AOF", err=True)
            time.sleep(0.5)
            server.start()
            click.echo(f"redis-server back on {server.url}", err=True)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


@click.command()
@click.option("--env", "env_name", default=None, help="Environment (its generator).")
@click.option(
    "--dataset",
    type=click.Path(exists=True),
    help="Rows: JSONL, a `datasets` save_to_disk directory, .parquet or .arrow.",
)
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="Prompts to push from the generator (with --dataset: read the first N rows).",
)
@click.option("--split", default=None, help="The split of a saved DatasetDict.")
@click.option(
    "--prompt-column",
    default=None,
    help="The dataset column holding the prompt (TRL's `prompt`: a string or chat messages).",
)
@click.option(
    "--column",
    "columns",
    multiple=True,
    metavar="NAME=COLUMN",
    help="Read field NAME from dataset column COLUMN (repeatable; e.g. id=uid).",
)
@click.option(
    "--verifier",
    "verifiers",
    multiple=True,
    metavar="MODULE:FUNCTION",
    help="A TRL-style reward function that scores the run (repeatable; weights in the "
    "config's reward_weights).",
)
@click.option("--group-size", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Run config TOML.",
)
@env_option
@click.option("--policy", "backend", default=None, help="Policy backend for the workers.")
@click.option(
    "--shards",
    type=click.IntRange(min=1, max=d.MAX_SHARDS),
    default=None,
    help="Split the run's streams into N shards ([streams] shards), so a Redis Cluster "
    "spreads the run over its nodes.",
)
@click.option(
    "--skip-policy-check",
    is_flag=True,
    help="Do not check the policy here (its model lives only on the worker machines).",
)
@pass_ctx
def produce(
    c,
    env_name,
    dataset,
    count,
    split,
    prompt_column,
    columns,
    verifiers,
    group_size,
    seed,
    config_path,
    env_options,
    backend,
    skip_policy_check,
    shards,
) -> None:
    """Push tasks: prompts from an environment's generator, or the rows of a dataset (JSONL,
    a `datasets` directory, Parquet, Arrow; bad rows are dead-lettered with where they are).

    Also stores the run's config, which the workers read. A restarted producer continues where
    the last one stopped: prompts are never pushed twice.
    """
    from streamrl.bus import eviction
    from streamrl.log import bind
    from streamrl.workers.context import consumer_name

    flags = _ConfigFlags(env_name, group_size, env_options, backend, shards, list(verifiers))
    cfg = _run_config(c, config_path, flags)
    if dataset is None and count is None:
        raise click.UsageError("give --count N (prompts from --env's generator) or --dataset")
    env = _runnable_env(cfg, skip_policy_check)
    rows = _dataset_rows(dataset, split, prompt_column, columns, count) if dataset else None
    bind(run=c.run, role="producer", worker=consumer_name())
    r = c.client(resilient=True)
    eviction.check(r, "producer")
    _open_run(r, c.control(r), cfg, keep_stored_shards=shards is None and config_path is None)
    admission, producer = _admitted_producer(r, cfg)
    if cfg.envs:  # a weighted mixture, re-read from Redis before every batch
        from streamrl.cli.mix import produce_mixture

        res = produce_mixture(r, cfg, producer, count, seed)
    elif rows is not None:
        standard = bool(cfg.verifier)  # reward functions get string prompts as strings
        res = producer.from_rows(rows, cfg.env, cfg.group_size, standard_prompts=standard)
    else:
        res = producer.from_env(env, count, cfg.group_size, seed=seed, env_spec=cfg.env)
    admission.finish()
    _say_pushed(res)


@dataclass(frozen=True)
class _ConfigFlags:
    """The produce flags that are run-config fields: each one given wins over the file."""

    env: str | None
    group_size: int | None
    env_options: dict[str, Any]
    backend: str | None
    shards: int | None
    verifiers: list[str]

    def apply(self, cfg: RunConfig) -> RunConfig:
        cfg.env = self.env or cfg.env
        cfg.group_size = self.group_size or cfg.group_size
        cfg.env_options = {**cfg.env_options, **self.env_options}
        if self.backend:
            cfg.policy.backend = self.backend
        if self.shards:
            cfg.streams.shards = self.shards
        if self.verifiers:
            cfg.verifier = self.verifiers
        return validated(cfg)  # the flags are config fields too: the same checks as a file's


def _run_config(c: Ctx, config_path: str | None, flags: _ConfigFlags) -> RunConfig:
    """The config file (or the defaults) with the flags laid over it. An explicit --run names
    the run even over the file's `run`; ``c.run`` follows the result."""
    from streamrl.config import RunConfig, load_toml

    try:
        cfg: RunConfig = load_toml(config_path) if config_path else RunConfig()
    except (ValueError, OSError) as e:  # the message names the file and the field
        raise click.ClickException(str(e)) from None
    ctx = click.get_current_context()
    explicit = ctx.parent is not None and ctx.parent.get_parameter_source("run") not in (
        click.core.ParameterSource.DEFAULT,
        None,
    )
    if explicit or not config_path:
        cfg.run = c.run
    c.run = cfg.run
    return flags.apply(cfg)


def _runnable_env(cfg: RunConfig, skip_policy_check: bool) -> Any:
    """The run's environment, after refusing what cannot run before anything is pushed: the
    leases would only fail on it."""
    from streamrl.envs import make_env
    from streamrl.envs.registry import UnknownEnvironment
    from streamrl.policy import check_policy
    from streamrl.verifiers.reward_functions import RewardFunctionError, RewardFunctions

    if cfg.envs:
        from streamrl.cli.mix import checked_entry

        envs = [checked_entry(e) for e in cfg.envs]
        env = envs[0]
    else:
        try:
            env = make_env(cfg.env, **cfg.env_options)
        except (UnknownEnvironment, ValueError, TypeError) as e:
            raise click.ClickException(str(e)) from None
    if cfg.verifier:
        try:
            RewardFunctions.of_run(cfg)
        except RewardFunctionError as e:
            raise click.ClickException(str(e)) from None
    elif cfg.env == "chat":
        raise click.ClickException(
            "environment 'chat' is scored by reward functions: give --verifier MODULE:FUNCTION "
            "(or verifier = ... in the config)"
        )
    if not skip_policy_check:
        try:
            check_policy(cfg.policy)
        except (ValueError, OSError) as e:
            hint = (
                " (if the model is only on the worker machines, pass --skip-policy-check)"
                if cfg.policy.backend == "hf"
                else ""
            )
            raise click.ClickException(f"{e}{hint}") from None
    return env


def _dataset_rows(
    path: str, split: str | None, prompt: str | None, pairs: tuple[str, ...], limit: int | None
) -> Any:
    """The dataset's rows with its columns mapped (``--prompt-column``, ``--column``)."""
    from streamrl.producer.datasets import DatasetError, open_rows

    columns = {"prompt": prompt} if prompt and prompt != "prompt" else {}
    for pair in pairs:
        name, sep, column = pair.partition("=")
        if not sep or not name or not column:
            raise click.BadParameter(f"expected NAME=COLUMN, got {pair!r}", param_hint="--column")
        columns[name] = column
    try:
        return open_rows(path, columns, split=split, limit=limit)
    except (DatasetError, OSError) as e:
        raise click.ClickException(str(e)) from None


def _open_run(r: Any, control: Any, cfg: RunConfig, keep_stored_shards: bool) -> None:
    """Store the run's config (its shard count may not change), make its streams and consumer
    groups, lift a halt and give the waiting workers their leases."""
    from streamrl.bus.keys import Keys, shard_keys
    from streamrl.bus.streams import ensure_groups
    from streamrl.workers import leases
    from streamrl.workers.context import read_config, write_config

    stored = read_config(r.get(Keys(cfg.run).config))
    if stored is not None and keep_stored_shards:
        cfg.streams.shards = stored.streams.shards  # more prompts for a run: keep its shards
    if stored is not None and stored.streams.shards != cfg.streams.shards:
        raise click.ClickException(
            f"run {cfg.run!r} has {stored.streams.shards} shards; this producer asks for "
            f"{cfg.streams.shards}: a run's shard count cannot change (start a new --run)"
        )
    write_config(r, cfg)
    for k in shard_keys(cfg.run, cfg.streams.shards):
        ensure_groups(r, k)
    r.delete(Keys(cfg.run).halt)
    for q in (d.ROLLOUT_QUEUE, d.VERIFY_QUEUE):
        leases.top_up_shards(control, q, cfg.run, data=None if control is r else r)


def _admitted_producer(r: Any, cfg: RunConfig) -> tuple[LearnerAdmission, Producer]:
    """A producer under admission control: never more than (max_staleness + 1) learner batches
    in flight, drops settle only as fast as training pays for them, and Redis stays under its
    memory budget. While held, it says why on stderr."""
    from streamrl.producer.admission import LearnerAdmission, admission_limit, push_samples
    from streamrl.producer.produce import BATCH, Producer

    def waiting(hold) -> None:
        held = time.time() - hold.since
        click.echo(f"producer waiting ({held:.0f} s, {hold.reason}): {hold.message}", err=True)

    limit = admission_limit(cfg.learner, cfg.group_size)
    admission = LearnerAdmission.from_config(r, cfg, limit, on_wait=waiting)
    batch = push_samples(cfg.learner, cfg.group_size, BATCH)
    return admission, Producer(r, cfg.run, admission=admission, batch_samples=batch)


def _say_pushed(res: ProduceResult) -> None:
    """The summary on stdout, the first rejected rows (with why) on stderr."""
    click.echo(
        f"pushed {res.prompts} prompts ({res.samples} samples) from {res.source}; "
        f"{res.skipped} were already pushed; {len(res.rejected)} rows rejected"
    )
    for reason in res.rejected[:20]:
        click.echo(f"  rejected {reason}", err=True)


@click.command()
@click.argument("role", type=click.Choice(["rollout", "verify"]))
@click.option("--name", default=None)
@click.option(
    "--policy-url",
    default=None,
    metavar="URL",
    help="rollout: the policy server this worker talks to, over [policy] base_url "
    "(one pool of workers per server; sets STREAMRL_POLICY_BASE_URL)",
)
@pass_ctx
def worker(c: Ctx, role: str, name: str | None, policy_url: str | None) -> None:
    """Run one rq worker for ROLE (same as
    `rq worker -u URL -w streamrl.workers.LeaseWorker -S json srl-ROLE`; with a separate
    control Redis, rq gets that URL and the worker the data URL as STREAMRL_DATA_URL).

    A Redis that does not answer yet (restarting, a cluster failing over) is waited for; a
    run with no config yet gets no lease until a producer stores it."""
    from streamrl.bus import eviction
    from streamrl.bus.keys import Keys
    from streamrl.bus.shards import run_shards
    from streamrl.bus.streams import ensure_groups
    from streamrl.connection import ENV_DATA_URL
    from streamrl.local.procs import rq_worker_cmd
    from streamrl.workers import leases

    url = c.url()
    queue = d.ROLLOUT_QUEUE if role == "rollout" else d.VERIFY_QUEUE
    r = c.client(resilient=True, wait=True)
    eviction.check(r, f"{role} worker")
    control = c.control(r, wait=True)
    if r.exists(Keys(c.run).config):
        for k in run_shards(r, c.run):
            ensure_groups(r, k)
        leases.top_up_shards(control, queue, c.run, data=None if control is r else r)
    else:
        # a lease queued now would consume the run's unsharded streams, whatever shards the
        # producer is about to store; idle workers queue the right leases once it has
        click.echo(
            f"run {c.run!r} has no config yet: the worker waits for a producer to start it",
            err=True,
        )
    control_url = c.control_url()
    if control_url != url:
        os.environ[ENV_DATA_URL] = url
    if policy_url:
        os.environ[d.POLICY_URL_ENV] = policy_url
    cmd = rq_worker_cmd(control_url, queue, name, quiet=False)
    os.execv(cmd[0], cmd)
