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
