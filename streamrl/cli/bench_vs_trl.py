"""`streamrl bench vs-trl`: streamrl against TRL's GRPOTrainer, whole processes from a cold
start (`copy`: the demo's tiny model; `lookup`: SmolLM2 on the multi-turn tool task). Its own
module for its many options; `streamrl.cli.bench` adds it to the group."""

from __future__ import annotations

from pathlib import Path

import click

from streamrl.cli._common import report


@click.command("vs-trl")
@click.option(
    "--task",
    type=click.Choice(["copy", "lookup"]),
    default="copy",
    show_default=True,
    help="copy: the demo's tiny model to a training reward; lookup: SmolLM2-135M-Instruct on "
    "the multi-turn tool task to a held-out success (TRL's environment_factory mode).",
)
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--trl-lr",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="TRL's learning rate (default: its fastest measured: copy 5e-4, lookup 1e-4).",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=1),
    default=None,
    help="Time cap of a run [default: copy 300, lookup 480].",
)
@click.option(
    "--trl-seconds",
    type=click.FloatRange(min=1),
    default=None,
    help="lookup: TRL's time cap, if not --seconds.",
)
@click.option(
    "--target",
    type=click.FloatRange(0, 1),
    default=None,
    help="copy: mean training reward [0.9]; lookup: held-out pass@1 [0.5, base 0.235 + 25 points].",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="streamrl's run config (default: configs/copy-tiny.toml, what the demo runs; "
    "lookup: configs/smollm2-lookup.toml).",
)
@click.option(
    "--model",
    default="models/smollm2-135m",
    show_default=True,
    help="lookup: the SmolLM2 directory (python -m streamrl.models.gguf models/smollm2-135m).",
)
@click.option(
    "--eval-prompts",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="lookup: held-out prompts per snapshot evaluation.",
)
@click.option(
    "--eval-k",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="lookup: samples per held-out prompt.",
)
@click.option(
    "--stop-reward",
    type=click.FloatRange(0, 1),
    default=0.8,
    show_default=True,
    help="lookup: a side stops early once its training reward (last two steps) is this high.",
)
@click.option(
    "--snapshot-every",
    type=click.FloatRange(min=1),
    default=60.0,
    show_default=True,
    help="lookup: seconds of TRL training between weight snapshots, each evaluated afterwards "
    "until one reaches the target (1: after every step, TRL's earliest time).",
)
@click.option(
    "--together",
    is_flag=True,
    help="lookup: run the two sides of a pair at the same time (on a machine others load, "
    "both then share its load alike), and evaluate a pair while the next one trains.",
)
@click.option(
    "--rollout-workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="lookup: streamrl's rollout workers (`streamrl worker rollout` processes).",
)
@click.option(
    "--first-seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="copy: pair i runs both sides with seed first-seed + i.",
)
@click.option("--json", "as_json", is_flag=True)
def bench_vs_trl(
    task, runs, trl_lr, seconds, trl_seconds, target, config_path, model, eval_prompts, eval_k,
    stop_reward, snapshot_every, together, rollout_workers, first_seed, as_json,
) -> None:  # fmt: skip
    """streamrl vs TRL GRPOTrainer, as whole processes from a cold start, both from this one
    command, with the ratio: `copy`, seconds to the target reward; `lookup`, seconds to the
    target held-out success (TRL's multi-turn tool mode)."""
    say = lambda m: click.echo(m, err=True)  # noqa: E731  (stderr: stdout stays JSON)
    if task == "lookup":
        from streamrl.benchmarks.vs_trl_agent import vs_trl_agent

        if not (Path(model) / "model.safetensors").is_file():
            raise click.BadParameter(
                f"{model!r} has no model.safetensors: build it with "
                f"python -m streamrl.models.gguf {model}",
                param_hint="--model",
            )
        res = vs_trl_agent(
            runs=runs,
            trl_lr=trl_lr if trl_lr is not None else 1e-4,
            seconds=seconds or 480.0,
            trl_seconds=trl_seconds,
            target=target if target is not None else 0.5,
            config=config_path,
            model=model,
            stop_reward=stop_reward,
            eval_prompts=eval_prompts,
            eval_k=eval_k,
            snapshot_every=snapshot_every,
            together=together,
            rollout_workers=rollout_workers,
            progress=say,
        )
    else:
        from streamrl.benchmarks.vs_trl import vs_trl

        res = vs_trl(runs, trl_lr, seconds or 300.0, target if target is not None else 0.9,
                     config_path, progress=say, first_seed=first_seed)  # fmt: skip
    report(res, as_json)
