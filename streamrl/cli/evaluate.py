"""`streamrl eval` and `streamrl audit`: held-out pass@k of a model, and an environment's
verifier audit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click
import msgspec

from streamrl.cli.options import env_option
from streamrl.config import RunConfig
from streamrl.envs.base import OptionError
from streamrl.envs.registry import UnknownEnvironment
from streamrl.evaluation.audit import DEFAULT_MAX_TURNS, DEFAULT_SAMPLES, AuditReport, run_audit
from streamrl.evaluation.heldout import EvalError, WeightsError, evaluate
from streamrl.evaluation.spec import (
    DEFAULT_K,
    DEFAULT_PROMPTS,
    DEFAULT_TRAIN_PROMPTS,
    EvalReport,
    EvalSpec,
)
from streamrl.models.local import ModelNotFound


@click.command("eval")
@click.option("--env", "env_name", default=None, help="Environment name or module:Class.")
@env_option
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Run config TOML (env, env_options, [policy]).",
)
@click.option("--model", default=None, help="Local transformers model directory (policy.model).")
@click.option(
    "--weights",
    default=None,
    help="A policy version the learner published (policy/v<N>), loaded over --model.",
)
@click.option(
    "--prompts",
    type=click.IntRange(min=1),
    default=DEFAULT_PROMPTS,
    show_default=True,
    help="Held-out prompts to evaluate on.",
)
@click.option(
    "--k",
    "k",
    type=click.IntRange(min=1),
    default=DEFAULT_K,
    show_default=True,
    help="Samples per prompt.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="The producer's seed: held-out prompts are derived from it and exclude its training "
    "prompts; also seeds sampling.",
)
@click.option(
    "--train-prompts",
    type=click.IntRange(min=0),
    default=DEFAULT_TRAIN_PROMPTS,
    show_default=True,
    help="Held-out prompts differ from training prompts 0..N-1 of --seed.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=None,
    help="Sampling temperature [default: policy.temperature, 1.0].",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens per model turn [default: policy.max_new_tokens, 64].",
)
@click.option(
    "--max-turns",
    type=click.IntRange(min=1),
    default=None,
    help="Turns per episode [default: rollout.max_turns, 8].",
)
@click.option(
    "--pass-reward",
    type=float,
    default=None,
    help="A sample passes at this reward or more [default: the environment's max_reward].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def eval_command(**given: Any) -> None:
    """Measure pass@1 and pass@k of a model on an environment's held-out prompts
    (never its training prompts), running episodes in this process with the hf backend."""
    options = _EvalOptions(**given)
    cfg = _run_config(options.config_path)
    _check_eval_options(options, cfg)
    report = _run_eval(_eval_spec(options, cfg), model_from_config=options.model is None)
    _print_eval(report, options.as_json)


@dataclass(frozen=True)
class _EvalOptions:
    """The eval command's options, as click parses them (``None``: not given)."""

    env_name: str | None
    env_options: dict[str, Any]
    config_path: str | None
    model: str | None
    weights: str | None
    prompts: int
    k: int
    seed: int
    train_prompts: int
    temperature: float | None
    max_new_tokens: int | None
    max_turns: int | None
    pass_reward: float | None
    as_json: bool


def _check_eval_options(options: _EvalOptions, cfg: RunConfig) -> None:
    """An environment and a model, each from an option or the run config."""
    if options.env_name is None and options.config_path is None:
        raise click.UsageError("give --env NAME or --config C.toml")
    if options.model is None and not cfg.policy.model:
        raise click.UsageError("give --model DIR (or policy.model in --config)")


def _run_config(path: str | None) -> RunConfig:
    from streamrl.config import load_toml

    try:
        return load_toml(path) if path else RunConfig()
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None


def _eval_spec(options: _EvalOptions, cfg: RunConfig) -> EvalSpec:
    """The options, each falling back to the run config where it has one."""
    o = options
    return EvalSpec(
        env=o.env_name or cfg.env,
        model=o.model or cfg.policy.model,
        options={**cfg.env_options, **o.env_options},
        weights=o.weights,
        prompts=o.prompts,
        k=o.k,
        seed=o.seed,
        train_prompts=o.train_prompts,
        temperature=cfg.policy.temperature if o.temperature is None else o.temperature,
        max_new_tokens=o.max_new_tokens or cfg.policy.max_new_tokens,
        max_turns=o.max_turns or cfg.rollout.max_turns,
        pass_reward=o.pass_reward,
        policy_options=cfg.policy.options,
        rollout=cfg.rollout,
    )


def _run_eval(spec: EvalSpec, model_from_config: bool) -> EvalReport:
    """``evaluate`` with a progress bar, its errors as one line naming the option at fault."""
    bar = _Bar()
    try:
        return evaluate(spec, progress=bar.update)
    except UnknownEnvironment as e:
        raise click.BadParameter(str(e), param_hint="--env") from None
    except OptionError as e:
        raise click.BadParameter(str(e), param_hint="--env-option") from None
    except ModelNotFound as e:
        if model_from_config:
            raise click.ClickException(str(e).replace("--model", "policy.model", 1)) from None
        raise click.BadParameter(str(e), param_hint="--model") from None
    except WeightsError as e:
        raise click.BadParameter(str(e), param_hint="--weights") from None
    except EvalError as e:
        raise click.ClickException(str(e)) from None
    finally:
        bar.stop()


def _print_eval(report: EvalReport, as_json: bool) -> None:
    if as_json:
        click.echo(msgspec.json.encode(report).decode())
    else:
        from rich.console import Console

        Console().print(_eval_table(report))


def _eval_table(report: EvalReport) -> Any:
    from rich.table import Table

    weights = f" + {report.weights}" if report.weights else ""
    t = Table(
        title=f"eval {report.env} v{report.env_version}: {report.model}{weights}",
        show_header=False,
    )
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column()
    held = (
        f"{report.candidates} candidates, {report.excluded_seen} seen in training prompts "
        f"0..{report.train_prompts - 1}, {report.excluded_duplicate} repeats"
    )
    t.add_row("prompts", str(report.prompts), f"held out, seed {report.seed}: {held}")
    t.add_row(
        "samples",
        str(report.samples),
        f"{report.k} per prompt at temperature {report.temperature:g}; "
        f"{report.truncated} truncated",
    )
    t.add_row(
        "episodes",
        f"{report.turns_per_episode:.2f}",
        f"model turns each; {report.tool_calls_per_episode:.2f} tool calls, "
        f"{report.malformed_call_rate:.1%} of them malformed",
    )
    t.add_row("mean reward", f"{report.mean_reward:.4f}", "")
    lo, hi = report.pass_at_1_ci
    t.add_row("pass@1", f"{report.pass_at_1:.4f}", f"[{lo:.4f}, {hi:.4f}] {report.ci_method}")
    for k, value in report.pass_at_k.items():
        if k == 1:
            continue
        lo, hi = report.pass_at_k_ci[k]
        t.add_row(f"pass@{k}", f"{value:.4f}", f"[{lo:.4f}, {hi:.4f}]")
    t.add_row("pass reward", f"{report.pass_reward:g}", "a sample passes at this reward or more")
    t.add_row(
        "seconds",
        f"{report.seconds:.1f}",
        f"{report.rollout_seconds:.1f} s sampling and verifying: {report.samples_per_s:.1f} "
        "samples/s",
    )
    return t


class _Bar:
    """A rich progress bar on stderr (drawn on a terminal only), started by the first sample."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.task: Any = None

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            from rich.console import Console
            from rich.progress import Progress as Bar

            self.bar = Bar(console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("samples", total=total)
            self.bar.start()
        self.bar.update(self.task, completed=done)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


@click.command("audit")
@click.option("--env", "env_name", required=True, help="Environment name or module:Class.")
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=DEFAULT_SAMPLES,
    show_default=True,
    help="Tasks to audit.",
)
@click.option("--seed", default=0, show_default=True, help="Generator seed.")
@env_option
@click.option("--max-turns", default=DEFAULT_MAX_TURNS, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def audit_command(
    env_name: str,
    samples: int,
    seed: int,
    env_options: dict[str, Any],
    max_turns: int,
    as_json: bool,
) -> None:
    """Check that an environment's verifier gives the reference agent full reward and no
    cheating answer more than a wrong one; exits 1 on any failure."""
    try:
        report = run_audit(env_name, samples, seed, env_options, max_turns)
    except UnknownEnvironment as e:
        raise click.BadParameter(str(e), param_hint="--env") from e
    except OptionError as e:
        raise click.BadParameter(str(e), param_hint="--env-option") from e
    click.echo(msgspec.json.encode(report).decode() if as_json else _audit_text(report))
    if not report.passed:
        raise SystemExit(1)


def _audit_text(report: AuditReport) -> str:
    verdict = "PASS" if report.passed else "FAIL"
    lines = [
        f"audit {report.env} v{report.env_version} (verifier {report.verifier} "
        f"v{report.verifier_version}), {report.samples} samples, seed {report.seed}, "
        f"max reward {report.max_reward:g}: {verdict} in {report.seconds:.2f}s"
    ]
    for c in report.checks:
        status = "PASS" if c.passed else "FAIL"
        line = f"  {status} {c.name:<12} {c.cases:>5} cases {c.failures:>4} failed"
        if c.worst is not None:
            w = c.worst
            line += f"  worst: {w.task_id} {w.case}"
            if w.reward is not None or w.detail:
                reward = "error" if w.reward is None else f"{w.reward:g}"
                line += f" reward {reward}"
            if w.limit is not None:
                line += f" (limit {w.limit:g})"
            if w.detail:
                line += f" - {w.detail[:160]}"
        lines.append(line)
    return "\n".join(lines)
