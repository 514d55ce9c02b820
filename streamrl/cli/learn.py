"""`streamrl learn`: the learner's command line (also run as `python -m streamrl.cli.learn` by
torchrun and the demo's fork server)."""

from __future__ import annotations

import os
import sys
import tomllib
import traceback

import click
import msgspec
import redis
from click.core import ParameterSource

from streamrl.bus.eviction import EvictingRedis
from streamrl.bus.health import RunFaulted
from streamrl.connection import check_url, connect, redact, resolve_url
from streamrl.defaults import DEFAULT_RUN, RUN_DIR
from streamrl.learner.checkpoint import CheckpointFailed
from streamrl.learner.config import load_learner_config
from streamrl.learner.distributed import exit_rank, launch, world_size
from streamrl.learner.loop import run_learner
from streamrl.learner.report import (
    ReportUnavailable,
    check_available,
)
from streamrl.models.local import ModelNotFound, require_model_dir


@click.command("learn")
@click.option(
    "--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option("--redis", "url", envvar="STREAMRL_REDIS_URL", help="Redis URL of the run.")
@click.option(
    "--run", default=None, envvar="STREAMRL_RUN", help="Default: the config's `run`, else default."
)
@click.option("--model", default=None, help="Override [learner].model.")
@click.option("--output-dir", default=None, help="Override [learner].output_dir.")
@click.option("--device", default=None, help="Override [learner].device (auto|cpu|cuda).")
@click.option("--total-steps", type=int, default=None, help="Override [learner].total_steps.")
@click.option(
    "--exit-when-idle",
    type=float,
    default=None,
    help="Exit after this many seconds without a new group (batch jobs, tests).",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Data-parallel ranks on this machine (runs torchrun; one GPU each when on GPU).",
)
def learn_command(
    config_path: str,
    url: str | None,
    run: str | None,
    model: str | None,
    output_dir: str | None,
    device: str | None,
    total_steps: int | None,
    exit_when_idle: float | None,
    nproc: int,
) -> None:
    """Train the policy on the run's groups (GRPO family), publish weights, checkpoint."""
    cfg = load_learner_config(
        config_path, model=model, output_dir=output_dir, device=device, total_steps=total_steps
    )
    # `streamrl --redis URL --run R learn ...`: the group's options count as well as our own
    root = click.get_current_context().find_root()
    url = url or root.params.get("redis_url")
    if run is None and root.get_parameter_source("run") not in (None, ParameterSource.DEFAULT):
        run = root.params["run"]
    resolved = resolve_url(url, root.params.get("run_dir") or RUN_DIR)
    if not resolved:
        raise click.UsageError("no Redis: pass --redis URL, set STREAMRL_REDIS_URL or run `up`")
    try:
        check_url(resolved)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        require_model_dir(cfg.model, "learner.model")
        check_available(cfg.report_to)
    except (ModelNotFound, ReportUnavailable) as e:
        raise click.ClickException(str(e)) from None
    try:
        connect(resolved).ping()
    except redis.RedisError as e:
        raise click.ClickException(redact(f"cannot reach Redis at {resolved}: {e}")) from None
    with open(config_path, "rb") as f:
        raw = tomllib.load(f)
    if run is None:
        run = str(raw.get("run", DEFAULT_RUN))
    shards = raw.get("streams", {}).get("shards")
    if nproc > 1 and world_size() == 1:
        # the run travels in STREAMRL_RUN: torchrun's parser would take `--run` for its own
        # `--run-path` (so do that too when calling torchrun by hand)
        os.environ["STREAMRL_RUN"] = run
        args = ["--config", config_path, "--redis", resolved]
        for flag, value in (
            ("--model", model), ("--output-dir", output_dir), ("--device", device),
            ("--total-steps", total_steps), ("--exit-when-idle", exit_when_idle),
        ):  # fmt: skip
            if value is not None:
                args += [flag, str(value)]
        sys.exit(launch(nproc, args))
    ranked = world_size() > 1  # under torchrun: leave through exit_rank, never teardown
    try:
        state = run_learner(resolved, run, cfg, exit_when_idle=exit_when_idle, shards=shards)
    except (ValueError, RunFaulted, EvictingRedis, CheckpointFailed) as e:  # torchrun's too
        if ranked:
            click.echo(f"Error: {e}", err=True)
            exit_rank(1)
        raise click.ClickException(str(e)) from None
    except BaseException:
        if ranked:  # a failed collective (a dead rank): say where, then leave the same way
            traceback.print_exc()
            exit_rank(1)
        raise
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(msgspec.json.encode(state).decode())
    if ranked:
        exit_rank(0)


if __name__ == "__main__":
    learn_command()
