"""`streamrl acl`: least-privilege Redis users for a run's roles, printed or applied."""

from __future__ import annotations

import click

from streamrl.cli._common import Ctx


@click.command("acl")
@click.option(
    "--apply", "do_apply", is_flag=True,
    help="Create the users on --redis (and on --control-redis when that is another server).",
)  # fmt: skip
@click.option(
    "--password", "passwords", multiple=True, metavar="ROLE=PASSWORD",
    help="A role's password (repeatable); roles not given get a generated one, printed once.",
)  # fmt: skip
@click.option("--user-prefix", default="srl", show_default=True, help="Users are PREFIX-RUN-ROLE.")
@click.pass_obj
def acl_command(obj: Ctx, do_apply: bool, passwords: tuple[str, ...], user_prefix: str) -> None:
    """Print Redis 7 ACL rules (ACL SETUSER lines) for the run's producer, rollout, verify,
    learner and observer users, each limited to the run's keys and the commands it needs."""
    from streamrl.bus import acl

    given: dict[str, str] = {}
    for item in passwords:
        role, sep, pw = item.partition("=")
        if not sep or role not in acl.ROLES or not pw:
            raise click.BadParameter(
                f"{item!r}: expected ROLE=PASSWORD, ROLE one of {', '.join(acl.ROLES)}",
                param_hint="--password",
            )
        given[role] = pw
    users = acl.users(obj.run, given, prefix=user_prefix)
    if do_apply:
        if obj.url().startswith("redis+cluster://"):
            raise click.ClickException(
                "--apply on a Redis Cluster: ACLs are per node; pipe the printed lines to "
                "every node (redis-cli -h NODE), or use ACL files"
            )
        r = obj.client(resilient=False)
        acl.apply(r, users)
        if obj.control_url() != obj.url():
            acl.apply(obj.control(), users)
    for u in users:
        click.echo(u.line())
    if do_apply:
        click.echo(f"# applied {len(users)} users for run {obj.run!r}", err=True)
