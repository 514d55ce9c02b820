"""Commands that look at a running run without changing it: `status`, `metrics` (Prometheus),
`watch` (live view), `view` (a local web page of the run and its trajectories) and `dead`
(dead letters)."""

from __future__ import annotations

import json
import signal

import click

from streamrl import defaults as d
from streamrl.cli._common import Ctx, pass_ctx


@click.command()
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


@click.command()
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
    r = c.client(resilient=False)  # a scrape that cannot read Redis says so (redis_up 0) at once
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


@click.command()
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True)
@pass_ctx
def watch(c: Ctx, interval: float) -> None:
    """Live view: rewards as they are scored, throughput, lag (Ctrl-C to stop)."""
    from streamrl.ops.views import watch_live

    r = c.client()
    watch_live(r, c.run, interval, control=c.control(r))


@click.command()
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


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.command()
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=d.VIEW_PORT,
    show_default=True,
    envvar="STREAMRL_VIEW_PORT",
    help="Port of the page (0: any free port).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Anything but loopback shows the run, model text included, "
    "to whoever can reach it: there is no login.",
)
@pass_ctx
def view(c: Ctx, port: int, host: str) -> None:
    """A local web page of the run: reward by policy version as it is scored, stages,
    workers, learner, dead letters, and a browser of the scored trajectories (Ctrl-C stops)."""
    try:
        from streamrl.ops.web.app import listen, make_app, serve
    except ImportError as e:
        raise click.ClickException(
            f"streamrl view needs its web libraries ({e.name} is missing): "
            "pip install 'streamrl[view]'"
        ) from None
    from streamrl.connection import redact

    r = c.client(resilient=False)  # a page says at once that Redis is down, then recovers
    control = c.control(r)
    loopback = host in _LOOPBACK
    hosts = ["127.0.0.1", "localhost", "[::1]"] if loopback else ["*"]
    try:
        sock = listen(host, port)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e}") from None
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    app = make_app(r, c.run, control, where=redact(c.url()), hosts=hosts)
    click.echo(f"streamrl view of run {c.run!r}: http://{shown}:{bound}/  (Ctrl-C stops)", err=True)
    if not loopback:
        click.echo(f"warning: listening on {host}, not loopback: no login protects it", err=True)
    serve(app, sock)
