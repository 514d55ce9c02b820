"""The ``streamrl`` command."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import click

from streamrl import defaults as d
from streamrl.bus.health import RunFaulted
from streamrl.bus.values import id_order
from streamrl.cli.options import env_option


class Ctx:
    def __init__(
        self, redis_url: str | None, run: str, run_dir: str, control_redis: str | None = None
    ):
        self.redis_url = redis_url
        self.control_redis = control_redis
        self.run = run
        self.run_dir = run_dir

    def url(self) -> str:
        """A Redis that outlives this command: --redis, STREAMRL_REDIS_URL or `streamrl up`."""
        from streamrl.connection import resolve_url

        url = resolve_url(self.redis_url, self.run_dir)
        if url is None:
            raise click.ClickException(
                "no Redis to talk to: pass --redis URL, set STREAMRL_REDIS_URL, or start a "
                "private one in another terminal with `streamrl up`"
            )
        return _checked(url)

    def client(self, resilient: bool = False):
        """A client for this command's data Redis (a ``RedisCluster`` for a
        ``redis+cluster://`` URL). Long-lived roles (``produce``) pass ``resilient`` to
        ride out a Redis restart; the first ping still fails fast on a wrong URL."""
        import redis

        from streamrl.connection import connect, make_resilient, redact

        url = self.url()
        r = connect(url)
        try:
            r.ping()
        except redis.RedisError as e:
            raise click.ClickException(redact(f"cannot reach Redis at {url}: {e}")) from None
        return make_resilient(r) if resilient else r

    def control_url(self) -> str:
        """rq's Redis: --control-redis, STREAMRL_CONTROL_URL, else the data Redis when it is
        not a Redis Cluster (rq cannot use one)."""
        from streamrl.connection import control_url

        try:
            return control_url(self.url(), self.control_redis)
        except ValueError as e:
            raise click.ClickException(str(e)) from None

    def control(self, data=None):
        """A client for rq's Redis; ``data`` itself when that is the same server."""
        import redis

        from streamrl.connection import connect, redact

        url = self.control_url()
        if data is not None and url == self.url():
            return data
        r = connect(url)
        try:
            r.ping()
        except redis.RedisError as e:
            raise click.ClickException(redact(f"cannot reach Redis at {url}: {e}")) from None
        return r


pass_ctx = click.make_pass_decorator(Ctx)


def _validated(cfg):
    """``cfg`` decoded again, so that values set from flags meet the same checks as a file's."""
    import msgspec

    from streamrl.config import RunConfig

    try:
        return msgspec.convert(msgspec.to_builtins(cfg), RunConfig)
    except msgspec.ValidationError as e:
        raise click.ClickException(f"invalid run config: {e}") from None


def _checked(url: str) -> str:
    from streamrl.connection import check_url

    try:
        return check_url(url)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


class StreamId(click.ParamType):
    """A stream entry ID, ``<ms>`` or ``<ms>-<seq>``, or one of the given special IDs."""

    name = "stream-id"

    def __init__(self, *specials: str):
        self.specials = specials

    def convert(self, value, param, ctx):  # type: ignore[override]
        text = str(value).strip()
        if text in self.specials:
            return text
        with contextlib.suppress(ValueError):
            id_order(text)
            return text
        allowed = ", ".join(["<ms>", "<ms>-<seq>", *self.specials])
        self.fail(f"{value!r} is not a stream entry ID ({allowed})", param, ctx)


class Group(click.Group):
    """No traceback reaches a user: an error that no command turned into a message becomes
    one line, ``Error: <kind>: <what>`` with passwords masked, and exit status 1.
    ``streamrl --debug`` (or ``STREAMRL_DEBUG=1``) lets the traceback through instead."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except RunFaulted as e:
            raise click.ClickException(str(e)) from None
        except Exception as e:
            if ctx.params.get("debug") or os.environ.get("STREAMRL_DEBUG", "") not in ("", "0"):
                raise
            from streamrl.connection import redact

            text = " ".join(str(e).split()) or "(no message)"
            raise click.ClickException(redact(f"{type(e).__name__}: {text}")) from None


@click.group(cls=Group)
@click.option(
    "--redis",
    "redis_url",
    envvar="STREAMRL_REDIS_URL",
    help="The run's data Redis: redis://, rediss://, unix:// or redis+cluster://HOST:PORT "
    "(a Redis Cluster, any node).",
)
@click.option(
    "--control-redis",
    "control_redis",
    envvar="STREAMRL_CONTROL_URL",
    help="A plain Redis for rq's queues and workers (default: --redis; required when --redis "
    "is a Redis Cluster).",
)
@click.option("--run", default=d.DEFAULT_RUN, envvar="STREAMRL_RUN", show_default=True)
@click.option("--run-dir", default=d.RUN_DIR, show_default=True, help="Private Redis lives here.")
@click.option("--debug", is_flag=True, help="Show the traceback of an unexpected error.")
@click.option(
    "--log-format",
    type=click.Choice(["auto", "json", "console"]),
    default="auto",
    show_default=True,
    envvar="STREAMRL_LOG_FORMAT",
    help="Log lines as JSON objects or key=value for a terminal (auto: console on a tty).",
)
@click.version_option(package_name="streamrl")
@click.pass_context
def main(
    ctx: click.Context,
    redis_url: str | None,
    control_redis: str | None,
    run: str,
    run_dir: str,
    debug: bool,
    log_format: str,
) -> None:
    """streamrl: RL from verifiable rewards as a streaming pipeline on Redis."""
    from streamrl.log import configure

    configure(fmt=log_format)
    ctx.obj = Ctx(redis_url, run, run_dir, control_redis)


@main.command()
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


@main.command()
@click.option("--env", "env_name", default=None, help="Environment (its generator).")
@click.option("--dataset", type=click.Path(exists=True, dir_okay=False), help="JSONL rows.")
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="Prompts to push from the generator (with --dataset: read the first N lines).",
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
    group_size,
    seed,
    config_path,
    env_options,
    backend,
    skip_policy_check,
    shards,
) -> None:
    """Push tasks: prompts from an environment's generator, or rows of a JSONL file.

    Also stores the run's config, which the workers read. A restarted producer continues where
    the last one stopped: prompts are never pushed twice.
    """
    from streamrl.bus.keys import Keys, shard_keys
    from streamrl.bus.streams import ensure_groups
    from streamrl.config import RunConfig, load_toml
    from streamrl.envs import make_env
    from streamrl.envs.registry import UnknownEnvironment
    from streamrl.policy import check_policy
    from streamrl.producer.admission import LearnerAdmission, admission_batch, admission_limit
    from streamrl.producer.produce import BATCH, Producer
    from streamrl.workers import leases
    from streamrl.workers.context import read_config, write_config

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
    cfg.env = env_name or cfg.env
    cfg.group_size = group_size or cfg.group_size
    cfg.env_options = {**cfg.env_options, **env_options}
    if backend:
        cfg.policy.backend = backend
    if shards:
        cfg.streams.shards = shards
    cfg = _validated(cfg)  # the flags above are config fields too
    if dataset is None and count is None:
        raise click.UsageError("give --count N (prompts from --env's generator) or --dataset")
    # refuse what cannot run before anything is pushed: the leases would only fail on it
    try:
        env = make_env(cfg.env, **cfg.env_options)
    except (UnknownEnvironment, ValueError, TypeError) as e:
        raise click.ClickException(str(e)) from None
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
    from streamrl.log import bind
    from streamrl.workers.context import consumer_name

    bind(run=c.run, role="producer", worker=consumer_name())
    r = c.client(resilient=True)
    control = c.control(r)
    stored = read_config(r.get(Keys(c.run).config))
    if stored is not None and shards is None and config_path is None:
        cfg.streams.shards = stored.streams.shards  # more prompts for a run: keep its shards
    if stored is not None and stored.streams.shards != cfg.streams.shards:
        raise click.ClickException(
            f"run {c.run!r} has {stored.streams.shards} shards; this producer asks for "
            f"{cfg.streams.shards}: a run's shard count cannot change (start a new --run)"
        )
    write_config(r, cfg)
    for k in shard_keys(c.run, cfg.streams.shards):
        ensure_groups(r, k)
    r.delete(Keys(c.run).halt)
    for q in (d.ROLLOUT_QUEUE, d.VERIFY_QUEUE):
        leases.top_up_shards(control, q, c.run, data=None if control is r else r)
    # admission control: never more than (max_staleness + 1) learner batches in flight, drops
    # settle only as fast as training pays for them, and Redis stays under its memory budget
    limit = admission_limit(cfg.learner, cfg.group_size)

    def waiting(hold) -> None:
        held = time.time() - hold.since
        click.echo(f"producer waiting ({held:.0f} s, {hold.reason}): {hold.message}", err=True)

    admission = LearnerAdmission.from_config(r, cfg, limit, on_wait=waiting)
    batch = min(BATCH, admission_batch(cfg.learner, cfg.group_size) or BATCH)
    producer = Producer(r, c.run, admission=admission, batch_samples=batch)
    if dataset:
        res = producer.from_jsonl(dataset, cfg.env, cfg.group_size, limit=count)
    else:
        res = producer.from_env(env, count, cfg.group_size, seed=seed, env_spec=cfg.env)
    admission.finish()
    click.echo(
        f"pushed {res.prompts} prompts ({res.samples} samples) from {res.source}; "
        f"{res.skipped} were already pushed; {len(res.rejected)} rows rejected"
    )
    for reason in res.rejected[:20]:
        click.echo(f"  rejected {reason}", err=True)


@main.command()
@click.argument("role", type=click.Choice(["rollout", "verify"]))
@click.option("--name", default=None)
@pass_ctx
def worker(c: Ctx, role: str, name: str | None) -> None:
    """Run one rq worker for ROLE (same as
    `rq worker -u URL -w streamrl.workers.LeaseWorker -S json srl-ROLE`; with a separate
    control Redis, rq gets that URL and the worker the data URL as STREAMRL_DATA_URL)."""
    from streamrl.bus.shards import run_shards
    from streamrl.bus.streams import ensure_groups
    from streamrl.connection import ENV_DATA_URL
    from streamrl.local.procs import rq_worker_cmd
    from streamrl.workers import leases

    url = c.url()
    queue = d.ROLLOUT_QUEUE if role == "rollout" else d.VERIFY_QUEUE
    r = c.client()
    control = c.control(r)
    for k in run_shards(r, c.run):
        ensure_groups(r, k)
    leases.top_up_shards(control, queue, c.run, data=None if control is r else r)
    control_url = c.control_url()
    if control_url != url:
        os.environ[ENV_DATA_URL] = url
    cmd = rq_worker_cmd(control_url, queue, name, quiet=False)
    os.execv(cmd[0], cmd)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def status(c: Ctx, as_json: bool) -> None:
    """Stream lengths, lag and pending per stage, dead letters, workers, groups, policy."""
    from streamrl.ops.status import collect
    from streamrl.ops.views import status_table

    r = c.client()
    info = collect(r, c.run, control=c.control(r))
    if as_json:
        click.echo(json.dumps(info))
    else:
        from rich.console import Console

        Console().print(status_table(info))


@main.command()
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=d.METRICS_PORT,
    show_default=True,
    envvar="STREAMRL_METRICS_PORT",
    help="Port of /metrics (0: any free port).",
)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--all-runs",
    is_flag=True,
    envvar="STREAMRL_METRICS_ALL_RUNS",
    help="Export every run that has a config, not only --run.",
)
@pass_ctx
def metrics(c: Ctx, port: int, addr: str, all_runs: bool) -> None:
    """Serve Prometheus metrics at /metrics, read from Redis at each scrape: one exporter
    covers every worker of the run (Ctrl-C or SIGTERM stops it)."""
    import threading

    import structlog

    from streamrl.log import bind
    from streamrl.ops.metrics import run_names, serve
    from streamrl.workers.context import consumer_name

    bind(run=c.run, role="metrics", worker=consumer_name())
    r = c.client()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    what = "every run" if all_runs else f"run {c.run!r}"

    def ready(bound: int) -> None:
        structlog.get_logger("streamrl.ops.metrics").info(
            "serving metrics", url=f"http://{addr}:{bound}/metrics", runs=what
        )

    try:
        serve(r, run_names(r, c.run, all_runs), port, addr, ready=ready, stop=stop)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {addr}:{port}: {e}") from None
    except KeyboardInterrupt:
        pass


@main.command()
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True)
@pass_ctx
def watch(c: Ctx, interval: float) -> None:
    """Live view: rewards as they are scored, throughput, lag (Ctrl-C to stop)."""
    from streamrl.ops.views import watch_live

    r = c.client()
    watch_live(r, c.run, interval, control=c.control(r))


@main.command()
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def dead(c: Ctx, limit: int, as_json: bool) -> None:
    """The newest dead letters, with the reason each entry left its stage."""
    from streamrl import schema
    from streamrl.bus.shards import run_shards
    from streamrl.bus.values import id_order

    r = c.client()
    rows = [row for k in run_shards(r, c.run) for row in r.xrevrange(k.dead, count=limit)]
    rows = sorted(rows, key=lambda row: id_order(row[0]), reverse=True)[:limit]
    for eid, fields in rows:
        dl = schema.DEAD_LETTER.decode(fields[b"p"])
        rec = {"id": eid.decode(), "stage": dl.stage, "task_id": dl.task_id, "reason": dl.reason}
        rec["deliveries"] = dl.deliveries
        if as_json:
            click.echo(json.dumps(rec))
        else:
            click.echo(f"{rec['id']}  {dl.stage:<8} {dl.task_id:<28} {dl.reason}")


@main.command()
@pass_ctx
def trim(c: Ctx) -> None:
    """Trim every stream of the run behind its slowest consumer group and retention window."""
    from streamrl.bus.trim import trim_run

    for stream, n in trim_run(c.client(), c.run).items():
        click.echo(f"{stream}: {n} entries trimmed")


@main.command()
@click.argument("stage", type=click.Choice(["rollout", "verify", "learner"]))
@click.option(
    "--from",
    "offset",
    type=StreamId("0", "$"),
    default="0",
    show_default=True,
    help="Stream offset: an entry ID (1700000000000-0), 0 (the start) or $ (the end).",
)
@click.option(
    "--shard",
    type=click.IntRange(min=0),
    default=None,
    help="A sharded run: replay this shard only (an entry ID names a place in one shard's "
    "stream; 0 and $ may be given to every shard at once).",
)
@pass_ctx
def replay(c: Ctx, stage: str, offset: str, shard: int | None) -> None:
    """Re-deliver a stage's input stream from an offset (moves its consumer group there)."""
    from streamrl.bus.shards import run_shards

    r = c.client()
    shards = run_shards(r, c.run)
    if shard is not None:
        if len(shards) == 1:
            raise click.UsageError(f"run {c.run!r} is not sharded: leave out --shard")
        if shard >= len(shards):
            raise click.UsageError(f"run {c.run!r} has shards 0..{len(shards) - 1}, not {shard}")
        shards = [shards[shard]]
    elif len(shards) > 1 and offset not in ("0", "$"):
        raise click.UsageError(
            f"run {c.run!r} has {len(shards)} shards and {offset} is an entry of one of them: "
            "pick it with --shard N (or replay every shard from 0 or $)"
        )
    for k in shards:
        stream, group = {
            "rollout": (k.tasks, d.ROLLOUT_GROUP),
            "verify": (k.rollouts, d.VERIFY_GROUP),
            "learner": (k.groups, d.LEARNER_GROUP),
        }[stage]
        r.xgroup_setid(stream, group, offset)
        click.echo(f"{group} will re-read {stream} after {offset}")


@main.command()
@click.option(
    "--from", "start", type=StreamId("-"), default="-", help="First groups-stream ID to re-verify."
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="At most this many samples."
)
@click.option(
    "--nemo-gym-rows",
    "rows",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Re-score NeMo Gym rollout rows (JSONL with response and reward) instead of the run.",
)
@click.option(
    "--env",
    "env_name",
    default="nemo-gym",
    show_default=True,
    help="With --nemo-gym-rows: the environment whose verifier re-scores them.",
)
@env_option
@pass_ctx
def reverify(
    c: Ctx, start: str, limit: int | None, rows: str | None, env_name: str, env_options: dict
) -> None:
    """Re-score stored trajectories (or NeMo Gym rollout rows) with today's verifiers and print
    the drift as JSON."""
    from streamrl.ops.drift import drift_report, rows_drift_report

    if rows is not None:
        from streamrl.envs.registry import UnknownEnvironment

        try:
            report = rows_drift_report(rows, env_name, env_options, limit)
        except (UnknownEnvironment, ValueError) as e:
            raise click.ClickException(str(e)) from None
    else:
        report = drift_report(c.client(), c.run, start, limit, env_options=env_options)
    click.echo(json.dumps(report, indent=2))


@main.command()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["nemo-gym", "sft", "dpo"]),
    required=True,
    help="nemo-gym: NeMo Gym rollout rows; sft: best sample per prompt as chat messages; "
    "dpo: best/worst pair per prompt.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True),
    default="-",
    show_default=True,
    help="JSONL file to write (- for stdout).",
)
@click.option(
    "--from", "start", type=StreamId("-"), default="-", help="First groups-stream ID to export."
)
@click.option(
    "--to", "end", type=StreamId("+"), default="+", help="Last groups-stream ID to export."
)
@click.option("--min-reward", type=float, default=None, help="Leave out samples below this.")
@click.option(
    "--min-policy-version", type=click.IntRange(min=0), default=None, help="Oldest version kept."
)
@click.option(
    "--max-policy-version", type=click.IntRange(min=0), default=None, help="Newest version kept."
)
@click.option(
    "--min-margin",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="dpo: chosen must out-score rejected by more than this.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many rows.")
@pass_ctx
def export(
    c: Ctx,
    fmt: str,
    output: str,
    start: str,
    end: str,
    min_reward: float | None,
    min_policy_version: int | None,
    max_policy_version: int | None,
    min_margin: float,
    limit: int | None,
) -> None:
    """Write the run's scored groups as JSON lines for NeMo Gym, TRL's SFTTrainer or DPOTrainer
    (a summary goes to stderr)."""
    from streamrl.ops.export import ExportFilter, export_rows

    flt = ExportFilter(
        start=start,
        end=end,
        min_reward=min_reward,
        min_version=min_policy_version,
        max_version=max_policy_version,
        min_margin=min_margin,
    )
    rows, res = export_rows(c.client(), c.run, fmt, flt, limit)
    out = click.open_file(output, "w", encoding="utf-8", atomic=output != "-")
    with out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {"format": res.format, "groups": res.groups, "rows": res.rows, "output": output}
    click.echo(json.dumps({**summary, "skipped": res.skipped}), err=True)


def _report(res: dict, as_json: bool, failed: bool = False) -> None:
    """Print a run's result (one JSON line for machines, indented for people) and
    exit 1 when the run lost, doubled or dead-lettered work: a fast figure means nothing then."""
    click.echo(json.dumps(res) if as_json else json.dumps(res, indent=2))
    if failed:
        sys.exit(1)


@main.group()
def bench() -> None:
    """Benchmarks that print JSON."""


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
        progress=None if as_json else lambda m: click.echo(m, err=True),
    )
    _report(res, as_json, failed=bool(res["lost"] or res["duplicated"]))


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
        progress=None if as_json else lambda m: click.echo(m, err=True),
    )
    _report(res, as_json, failed=bool(res["lost"] or res["duplicated"] or res["dead_letters"]))


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
        progress=None if as_json else lambda m: click.echo(m, err=True),
    )
    _report(res, as_json, failed=bool(res["lost"] or res["duplicated"]))


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
    say = None if as_json else lambda m: click.echo(m, err=True)
    res = chaos_bench(cfg, directory=directory, progress=say)
    if as_json:
        res = {k: v for k, v in res.items() if k != "faults"}
    _report(res, as_json, failed=not clean(res))


@bench.command("vs-trl")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--trl-lr",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="TRL's learning rate (default: its fastest measured on this task, 5e-4).",
)
@click.option("--seconds", type=click.FloatRange(min=1), default=300.0, show_default=True)
@click.option("--target", type=click.FloatRange(0, 1), default=0.9, show_default=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="streamrl's run config (default: configs/copy-tiny.toml, what the demo runs).",
)
@click.option("--json", "as_json", is_flag=True)
def bench_vs_trl(runs, trl_lr, seconds, target, config_path, as_json) -> None:
    """streamrl demo vs TRL GRPOTrainer: whole-process seconds to the target reward, cold
    start included, both from this one command, with the ratio."""
    from streamrl.benchmarks.vs_trl import vs_trl

    say = lambda m: click.echo(m, err=True)  # noqa: E731  (stderr: stdout stays JSON)
    res = vs_trl(runs, trl_lr, seconds, target, config_path, progress=say)
    _report(res, as_json)


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
        progress=None if as_json else lambda m: click.echo(m, err=True),
    )
    _report(res, as_json)


@main.command()
@click.option("--seconds", default=300.0, show_default=True, help="Stop after this long.")
@click.option("--target", default=0.9, show_default=True, help="Stop at this mean reward.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary as the last line.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Run config (default: the shipped configs/copy-tiny.toml); its model is replaced by "
    "a freshly built tiny model.",
)
@click.option("--rollout-workers", type=click.IntRange(min=1), default=2, show_default=True)
def demo(
    seconds: float, target: float, as_json: bool, config_path: str | None, rollout_workers: int
) -> None:
    """Train a tiny model on `copy` through the whole pipeline, on a private Redis, live."""
    from streamrl.local.demo import sigterm_as_interrupt, train_demo

    with sigterm_as_interrupt():
        res = train_demo(
            seconds=seconds,
            target=target,
            live=not as_json,
            config=config_path,
            rollout_workers=rollout_workers,
        )
    _report(res, as_json)


_LEARN_HELP = "Train: read scored groups, take GRPO steps, publish policy versions."


class LazyCommand(click.Command):
    """A command whose module (and torch) is imported only when it runs or shows its help."""

    def __init__(self, target: str, name: str, short_help: str):
        super().__init__(name, short_help=short_help, help=short_help)
        self.target = target
        self._real: click.Command | None = None

    def real(self) -> click.Command:
        if self._real is None:
            import importlib

            module, _, attr = self.target.partition(":")
            self._real = getattr(importlib.import_module(module), attr)
        return self._real

    def main(self, *args, **kwargs):  # type: ignore[override]
        return self.real().main(*args, **kwargs)

    def make_context(self, info_name, args, parent=None, **extra):  # type: ignore[override]
        return self.real().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):  # type: ignore[override]
        return self.real().invoke(ctx)

    def get_params(self, ctx):  # type: ignore[override]
        return self.real().get_params(ctx)


def _register_optional() -> None:
    """Commands in modules of their own (learn is imported only when it runs: torch)."""
    from streamrl.cli.evaluate import audit_command, eval_command
    from streamrl.cli.sandbox import sandbox_group

    main.add_command(audit_command, "audit")
    main.add_command(eval_command, "eval")
    main.add_command(LazyCommand("streamrl.cli.learn:learn_command", "learn", _LEARN_HELP))
    main.add_command(sandbox_group, "sandbox")


_register_optional()
