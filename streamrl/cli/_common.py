"""What every command shares: the context that finds the run's Redis, the checks that turn a
bad URL or config into one line, the stream-ID parameter type, and the JSON result printer."""

from __future__ import annotations

import contextlib
import json
import sys

import click

from streamrl.bus.values import id_order


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
        return _checked_url(url)

    def client(self, resilient: bool | int | None = None, wait: bool = False):
        """A client for this command's data Redis (a ``RedisCluster`` for a
        ``redis+cluster://`` URL). The first PING fails fast on a wrong URL; after it,
        commands are retried with backoff: ``resilient=True`` for long-lived roles (about
        2.5 min: a Redis restart, a cluster failover), by default briefly (about 58 s: a
        failover with the default ``cluster-node-timeout``), ``False`` not at all. ``wait``:
        a Redis that does not answer yet is waited for (the same 2.5 min), saying so once."""
        return self._reach(self.url(), resilient, wait)

    def _reach(self, url: str, resilient: bool | int | None, wait: bool):
        import redis

        from streamrl import defaults as d
        from streamrl.connection import connect, make_resilient, reach, redact

        retries = d.BRIEF_RECONNECT_RETRIES if resilient is None else resilient
        if wait:
            said = _Waiting(url)
            client = reach(url, on_wait=said)
            said.done()
            return client
        try:
            r = connect(url)
            r.ping()
        except redis.RedisError as e:
            raise click.ClickException(redact(f"cannot reach Redis at {url}: {e}")) from None
        if retries is False:
            return r
        return make_resilient(r, d.RECONNECT_RETRIES if retries is True else int(retries))

    def control_url(self) -> str:
        """rq's Redis: --control-redis, STREAMRL_CONTROL_URL, else the data Redis when it is
        not a Redis Cluster (rq cannot use one)."""
        from streamrl.connection import control_url

        try:
            return control_url(self.url(), self.control_redis)
        except ValueError as e:
            raise click.ClickException(str(e)) from None

    def control(self, data=None, wait: bool = False):
        """A client for rq's Redis; ``data`` itself when that is the same server."""
        url = self.control_url()
        if data is not None and url == self.url():
            return data
        return self._reach(url, None, wait)


class _Waiting:
    """What a role that waits for Redis at its start says: one line when it starts waiting,
    one when Redis answers."""

    def __init__(self, url: str):
        self.url = url
        self.since: float | None = None

    def __call__(self, error: Exception, patience_s: float) -> None:
        import time

        from streamrl.connection import redact

        self.since = time.monotonic()
        why = " ".join(str(error).split())
        click.echo(
            redact(
                f"cannot reach Redis at {self.url} ({why}): waiting for it, retrying with "
                f"backoff for up to {patience_s:.0f} s"
            ),
            err=True,
        )

    def done(self) -> None:
        import time

        from streamrl.connection import redact

        if self.since is not None:
            took = time.monotonic() - self.since
            click.echo(redact(f"Redis at {self.url} answers after {took:.1f} s"), err=True)


pass_ctx = click.make_pass_decorator(Ctx)


def validated(cfg):
    """``cfg`` decoded again, so that values set from flags meet the same checks as a file's."""
    import msgspec

    from streamrl.config import RunConfig

    try:
        return msgspec.convert(msgspec.to_builtins(cfg), RunConfig)
    except msgspec.ValidationError as e:
        raise click.ClickException(f"invalid run config: {e}") from None


def _checked_url(url: str) -> str:
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


def report(res: dict, as_json: bool, failed: bool = False) -> None:
    """Print a run's result (one JSON line for machines, indented for people) and
    exit 1 when the run lost, doubled or dead-lettered work: a fast figure means nothing then."""
    click.echo(json.dumps(res) if as_json else json.dumps(res, indent=2))
    if failed:
        sys.exit(1)
