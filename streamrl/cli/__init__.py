"""The ``streamrl`` command: the ``main`` group and its options, one-line errors, and the
commands of each family registered from the modules beside this one."""

from __future__ import annotations

import os
import sys

from streamrl.local import prefork

# `streamrl demo`: its fork server's imports, the demo's start-up critical path, begin before
# this module's own
prefork.start_early(sys.argv)

import click

from streamrl import defaults as d
from streamrl.bus.eviction import ENV_ALLOW, EvictingRedis
from streamrl.bus.health import RunFaulted
from streamrl.cli._common import Ctx
from streamrl.cli.acl import acl_command
from streamrl.cli.bench import bench
from streamrl.cli.demo import demo
from streamrl.cli.evaluate import audit_command, eval_command
from streamrl.cli.mix import mix
from streamrl.cli.observe import dead, metrics, status, view, watch
from streamrl.cli.run import produce, up, worker
from streamrl.cli.sandbox import sandbox_group
from streamrl.cli.streams import export, replay, reverify, trim

_EXIT_SIGPIPE = 141


class Group(click.Group):
    """No traceback reaches a user: an error that no command turned into a message becomes
    one line, ``Error: <kind>: <what>`` with passwords masked, and exit status 1.
    ``streamrl --debug`` (or ``STREAMRL_DEBUG=1``) lets the traceback through instead."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (RunFaulted, EvictingRedis) as e:
            raise click.ClickException(str(e)) from None
        except BrokenPipeError:
            # the reader of our output is gone (`streamrl watch | head`, or a Ctrl-C or
            # `kill` that reached the whole pipeline): end as `yes | head` does, quietly,
            # with 128 + SIGPIPE; stdout on /dev/null so that the exit's flush is quiet too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(_EXIT_SIGPIPE)
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
@click.option(
    "--allow-eviction",
    is_flag=True,
    envvar=ENV_ALLOW,
    help="Run even on a Redis whose maxmemory-policy may delete keys (not noeviction); "
    "every role warns at its start.",
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
    allow_eviction: bool,
) -> None:
    """streamrl: RL from verifiable rewards as a streaming pipeline on Redis."""
    from streamrl.log import configure

    configure(fmt=log_format)
    if allow_eviction:  # in the environment, so rq workers and learner ranks see it too
        os.environ[ENV_ALLOW] = "1"
    ctx.obj = Ctx(redis_url, run, run_dir, control_redis)


_LEARN_HELP = "Train: read scored groups, take GRPO steps, publish policy versions."


class _LazyCommand(click.Command):
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


# One family of commands per module beside this one. learn stands in as a lazy command: its
# module imports torch, which `streamrl --help` and every other command do without.
for command in (
    *(up, produce, worker, mix),  # run: a private Redis, tasks in, rq workers, the mixture
    *(status, metrics, watch, view, dead),  # observe: read a run without changing it
    *(trim, replay, reverify, export),  # streams: act on a run's streams
    *(eval_command, audit_command, sandbox_group),  # evaluate, sandbox
    *(bench, demo, acl_command),
    _LazyCommand("streamrl.cli.learn:learn_command", "learn", _LEARN_HELP),
):
    main.add_command(command)
