"""`streamrl mix`: show or change a running mixture's environments (add, re-weight, remove,
pause, resume), and the mixture producer that `streamrl produce` runs for a config with
``[[envs]]``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from streamrl.cli._common import Ctx, pass_ctx
from streamrl.cli.options import env_option

if TYPE_CHECKING:
    from streamrl.config import EnvEntry, RunConfig
    from streamrl.producer.produce import Producer, ProduceResult


def checked_entry(entry: EnvEntry) -> Any:
    """The entry's environment, built here so that a bad name, option, reward function or
    dataset is one error line before anything is stored or pushed."""
    from streamrl.envs import make_env
    from streamrl.envs.registry import UnknownEnvironment
    from streamrl.producer.datasets import DatasetError, open_rows
    from streamrl.verifiers.reward_functions import RewardFunctionError, RewardFunctions

    try:
        env = make_env(entry.env, **entry.env_options)
        if entry.verifier:
            RewardFunctions(list(entry.verifier), entry.reward_weights)
        if entry.dataset:
            open_rows(entry.dataset)
    except (UnknownEnvironment, DatasetError, ValueError, TypeError, RewardFunctionError,
            OSError) as e:  # fmt: skip
        raise click.ClickException(f"envs {entry.name!r}: {e}") from None
    return env


def produce_mixture(
    r: Any, cfg: RunConfig, producer: Producer, count: int, seed: int
) -> ProduceResult:
    """Push ``count`` prompts drawn from the run's stored mixture (written from ``cfg`` when
    the run has none), with the tripwires checked before every batch; fired tripwires and
    waits while every environment is paused are said on stderr."""
    from streamrl.producer import mixture
    from streamrl.producer.tripwires import Tripwires

    mixture.ensure(r, cfg.run, cfg.mixture())
    wires = Tripwires(r, cfg.run)
    said: dict[str, str] = {}

    def check() -> None:
        for name, line in wires.check().items():
            click.echo(f"{name}: {line}", err=True)

    def waiting(held: dict[str, str]) -> None:
        if held != said:
            said.clear()
            said.update(held)
            why = "; ".join(f"{n}: {reason}" for n, reason in held.items())
            click.echo(f"producer waiting: every environment is paused ({why})", err=True)

    mp = mixture.MixedProducer(producer, cfg.run, cfg.group_size, seed, check, waiting)
    res = mp.run_until(count)
    drawn = ", ".join(f"{n} {k}" for n, k in sorted(mp.drawn.items()))
    click.echo(f"drawn by environment: {drawn or 'none'}", err=True)
    return res


@click.command("mix")
@click.option("--env", "env_spec", default=None, help="Add or change an environment.")
@click.option("--name", default=None, help="Its name in the mixture (default: --env).")
@click.option("--weight", type=click.FloatRange(min=0), default=None, help="Its weight.")
@env_option
@click.option("--verifier", "verifiers", multiple=True, metavar="MODULE:FUNCTION")
@click.option("--dataset", type=click.Path(exists=True), default=None)
@click.option("--remove", metavar="NAME", default=None, help="Draw from NAME no more.")
@click.option("--pause", metavar="NAME", default=None, help="Hold NAME's prompts back.")
@click.option("--reason", default="paused by an operator", show_default=True)
@click.option("--resume", metavar="NAME", default=None, help="Lift a pause (a tripwire's).")
@pass_ctx
def mix(
    c: Ctx, env_spec, name, weight, env_options, verifiers, dataset, remove, pause, reason, resume
) -> None:
    """Show the run's mixture, or change it while the run goes on: the producer reads it
    before every batch and the workers build an environment they have not met on its first
    task. A removed environment's queued tasks still drain."""
    from streamrl.config import EnvEntry, TripwireConfig
    from streamrl.producer import mixture

    r = c.client()
    stored = mixture.load(r, c.run)
    if stored is None:
        raise click.ClickException(
            f"run {c.run!r} has no mixture: start its producer with [[envs]] in the config"
        )
    if env_spec or (name and weight is not None):  # add, change, or re-weight by name
        key = name or env_spec
        old = stored.entry(key)
        if old is None and not env_spec:
            raise click.ClickException(f"no environment {key!r} in the mixture: give --env")
        entry = EnvEntry(
            name=key,
            env=env_spec or old.env,
            weight=weight if weight is not None else (old.weight if old else 1.0),
            env_options=env_options or (old.env_options if old else {}),
            verifier=list(verifiers) or (list(old.verifier) if old else []),
            dataset=dataset or (old.dataset if old else ""),
            tripwires=old.tripwires if old else TripwireConfig(),
        )
        checked_entry(entry)

        def put(m) -> None:
            m.envs = [e for e in m.envs if e.name != key] + [entry]

        stored = mixture.update(r, c.run, put)
    if remove:
        if stored.entry(remove) is None:
            raise click.ClickException(f"no environment {remove!r} in the mixture")

        def drop(m) -> None:
            for e in m.envs:
                if e.name == remove:
                    e.removed = True

        stored = mixture.update(r, c.run, drop)
    if pause:
        mixture.pause(r, c.run, pause, reason)
    if resume and not mixture.resume(r, c.run, resume):
        click.echo(f"{resume} was not paused", err=True)
    rows = mixture.describe(stored, mixture.paused(r, c.run))
    click.echo(json.dumps({"run": c.run, "version": stored.version, "envs": rows}, indent=2))
