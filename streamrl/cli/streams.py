"""Commands that act on a run's streams: `trim`, `replay` (re-deliver from an offset),
`reverify` (re-score with today's verifiers) and `export` (scored groups as JSONL)."""

from __future__ import annotations

import json

import click

from streamrl import defaults as d
from streamrl.cli._common import Ctx, StreamId, pass_ctx
from streamrl.cli.options import env_option


@click.command()
@pass_ctx
def trim(c: Ctx) -> None:
    """Trim every stream of the run behind its slowest consumer group and retention window."""
    from streamrl.bus.trim import trim_run

    for stream, n in trim_run(c.client(), c.run).items():
        click.echo(f"{stream}: {n} entries trimmed")


@click.command()
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


@click.command()
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


@click.command()
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
@click.option(
    "--nemo-gym-server",
    default=d.NG_EXPORT_SERVER,
    show_default=True,
    help="nemo-gym: the _ng_environment_server (and agent_ref) of rows that name none.",
)
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
    nemo_gym_server: str,
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
    rows, res = export_rows(c.client(), c.run, fmt, flt, limit, nemo_gym_server)
    out = click.open_file(output, "w", encoding="utf-8", atomic=output != "-")
    with out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {"format": res.format, "groups": res.groups, "rows": res.rows, "output": output}
    click.echo(json.dumps({**summary, "skipped": res.skipped}), err=True)
