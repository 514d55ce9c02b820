"""`streamrl demo`: the whole pipeline training a tiny model, on a private Redis, live."""

from __future__ import annotations

import click

from streamrl.cli._common import report
from streamrl.defaults import DEMO_WORKER_NICE


@click.command()
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
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="The learner's, the policy's and the prompt generator's seed.",
)
@click.option(
    "--worker-nice",
    type=click.IntRange(0, 19),
    default=DEMO_WORKER_NICE,
    show_default=True,
    help="Nice value of the workers and the producer; the learner keeps 0 (it is the "
    "critical path on one machine).",
)
def demo(
    seconds: float,
    target: float,
    as_json: bool,
    config_path: str | None,
    rollout_workers: int,
    seed: int,
    worker_nice: int,
) -> None:
    """Train a tiny model on `copy` through the whole pipeline, on a private Redis, live."""
    from streamrl.local.demo import DemoOptions, sigterm_as_interrupt, train_demo

    opts = DemoOptions(
        seconds=seconds,
        target=target,
        live=not as_json,
        config=config_path,
        rollout_workers=rollout_workers,
        seed=seed,
        worker_nice=worker_nice,
    )
    try:
        with sigterm_as_interrupt():
            res = train_demo(opts)
    except KeyboardInterrupt:  # before the live loop (mid-run, train_demo returns a summary)
        click.echo(
            "streamrl demo: interrupted during start-up, before training began; everything it "
            "had started has stopped",
            err=True,
        )
        raise SystemExit(130) from None
    if not as_json:  # a row a second is for bench/demo_phases.py, not for reading
        rows = len(res.pop("timeline", []))
        res.pop("timeline_columns", None)
        res["timeline"] = f"{rows} rows, in --json"
    report(res, as_json)
