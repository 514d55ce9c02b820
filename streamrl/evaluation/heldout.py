"""``streamrl eval``: pass@1 and pass@k of a policy on an environment's held-out prompts.

The episodes run in this process, with no Redis: the ``hf`` backend (``HFPolicy`` with no
Redis URL never looks for new weights) answers the rollout workers' own episode loop
(``workers.episode.run_episode``), and the environment's ``verify`` scores each trajectory from
its encoded state, as the verifier workers do. Every episode is submitted at once (at most
``2 x max_batch`` in flight) so the backend's micro-batching fills its ``generate`` calls.

**Held-out prompts.** Training prompt *i* under seed *s* is
``env.generate(random.Random(f"{s}:{i}"), i)`` (``Producer.from_env``). Held-out candidate *j*
is ``env.generate(random.Random(f"heldout:{s}:{j}"), j)``: its seed string can never be a
training one (those are digits and ``:`` only). A separate derivation alone does not keep the
*prompts* apart, though: a generator with a small prompt space (``copy`` has 16^3 = 4096
prompts, ``kayles`` a few dozen) or one that reads the index (``math`` over a dataset takes row
``index % rows``) makes the same prompt under both. So a candidate is kept only if its input
(the conversation the model sees, compared as msgpack bytes) differs from that of every training
prompt ``0 .. T-1`` under *s* (``T = --train-prompts``, default 10,000) and from every held-out
prompt already kept. Held-out prompt ids are ``<env>-heldout-s<s>-<j>``. The split is a pure
function of (environment, options, *s*, *T*), and a smaller ``--prompts`` takes a prefix of a
larger one. The guarantee covers training prompts ``0 .. T-1`` of seed *s*: for a run whose
producer went further (``streamrl produce`` pushes prompts ``0 .. --count-1``; Redis key
``srl:{run}:producer:env:<env>:seed=<s>`` holds its position), raise ``--train-prompts``. When
the prompt space has fewer unseen prompts than asked for, the command says so and stops.

**Numbers.** A sample *passes* when its reward is at least ``pass_reward`` (default the
environment's ``max_reward``; 1e-9 of slack for float noise). With *n = k* samples per prompt of
which *c* pass, pass@k of one prompt is the unbiased estimator of Chen et al. 2021,
``1 - C(n-c, k) / C(n, k)``, and the reported pass@k is its mean over prompts, for k = 1, 2, 4,
... up to K (and K itself). pass@1 is the mean over prompts of c / n, all samples drawn at the
sampling temperature (at temperature 0 every sample of a prompt is the same, so
pass@k = pass@1). The 95% confidence intervals are percentile bootstrap
intervals over prompts: prompts are resampled with replacement (10,000 times, seeded) and the
mean of their per-prompt estimates recomputed, so the interval reflects both which prompts were
drawn and the sampling noise within each prompt (which the per-prompt estimates carry). They
are exact to the resampling, not to an assumption of normality; with one prompt, or when every
prompt has the same estimate, the interval has width 0.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from streamrl import schema
from streamrl.config import PolicyConfig, RolloutConfig
from streamrl.envs.base import Environment, Verdict
from streamrl.envs.registry import make_env
from streamrl.models.local import require_model_dir
from streamrl.producer.produce import training_seed

DEFAULT_PROMPTS = 200
DEFAULT_K = 8
DEFAULT_TRAIN_PROMPTS = 10_000
BOOTSTRAP_RESAMPLES = 10_000
CI_METHOD = "95% percentile bootstrap over prompts (10000 resamples)"
EPS = 1e-9
_INPUT_KEY = msgspec.msgpack.Encoder()


class EvalError(ValueError):
    """The evaluation cannot run as asked (too few held-out prompts, unusable weights)."""


class WeightsError(EvalError):
    """``weights`` is not a policy version this model can load."""


# ---------------------------------------------------------------- held-out prompts


def heldout_seed(seed: int, index: int) -> str:
    return f"heldout:{seed}:{index}"


def prompt_key(prompt_input: list[schema.Item]) -> bytes:
    """What makes two prompts the same prompt: the conversation the model is shown."""
    return _INPUT_KEY.encode(prompt_input)


class HeldOut(msgspec.Struct, kw_only=True):
    """The held-out prompts, and how they were found."""

    tasks: list[schema.Task]  # one per prompt, k = 0 (``samples`` makes the others)
    train_prompts: int  # training prompts 0 .. train_prompts-1 were excluded
    candidates: int  # held-out candidates generated
    excluded_seen: int  # candidates equal to a training prompt
    excluded_duplicate: int  # candidates equal to a held-out prompt already kept
    generate_errors: int  # candidates whose generate raised (skipped)


def heldout_prompts(
    env: Environment,
    count: int,
    seed: int = 0,
    train_prompts: int = DEFAULT_TRAIN_PROMPTS,
    env_spec: str | None = None,
    max_candidates: int | None = None,
) -> HeldOut:
    """``count`` distinct held-out prompts of ``env``; see the module docstring for the rule.
    EvalError when ``max_candidates`` (default ``20 x count + 10,000``) candidates do not
    yield that many."""
    seen: set[bytes] = set()
    for i in range(train_prompts):
        try:
            prompt = env.generate(random.Random(training_seed(seed, i)), i)
        except Exception:
            continue  # the producer could not have pushed it either
        seen.add(prompt_key(prompt.input))
    budget = max_candidates if max_candidates is not None else 20 * count + 10_000
    kept: set[bytes] = set()
    tasks: list[schema.Task] = []
    excluded_seen = excluded_duplicate = errors = 0
    j = 0
    while len(tasks) < count and j < budget:
        try:
            prompt = env.generate(random.Random(heldout_seed(seed, j)), j)
        except Exception:
            errors += 1
            j += 1
            continue
        key = prompt_key(prompt.input)
        if key in seen:
            excluded_seen += 1
        elif key in kept:
            excluded_duplicate += 1
        else:
            kept.add(key)
            prompt_id = f"{env.name}-heldout-s{seed}-{j:07d}"
            task = schema.Task(
                task_id=f"{prompt_id}:0",
                prompt_id=prompt_id,
                k=0,
                group_size=1,
                env=env_spec or env.name,
                input=list(prompt.input),
                data=dict(prompt.data),
                seed=seed,
            )
            tasks.append(schema.TASK.decode(schema.encode(task)))  # as a worker would see it
        j += 1
    if len(tasks) < count:
        raise EvalError(
            f"environment {env.name!r} gave only {len(tasks)} held-out prompts in {j} "
            f"candidates (seed {seed}): {excluded_seen} equal one of training prompts "
            f"0..{train_prompts - 1}, {excluded_duplicate} repeat a held-out prompt, "
            f"{errors} failed to generate. Its prompt space has too few unseen prompts for "
            f"{count}: ask for fewer --prompts (or a smaller --train-prompts, if training "
            "pushed fewer prompts)"
        )
    return HeldOut(
        tasks=tasks,
        train_prompts=train_prompts,
        candidates=j,
        excluded_seen=excluded_seen,
        excluded_duplicate=excluded_duplicate,
        generate_errors=errors,
    )


# ---------------------------------------------------------------- the estimators


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: the probability that at least one of ``k`` samples drawn without
    replacement from ``n`` samples, ``c`` of them correct, is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(samples: int) -> list[int]:
    """1, 2, 4, ... up to ``samples``, and ``samples`` itself."""
    ks = [1 << i for i in range(samples.bit_length()) if 1 << i <= samples]
    return ks if ks[-1] == samples else [*ks, samples]


def bootstrap_ci(
    values: list[float], seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES
) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``values`` (one value per prompt)."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // v.size)  # bound the index matrix to ~16 MB
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        idx = rng.integers(0, v.size, size=(stop - start, v.size))
        means[start:stop] = v[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return (float(lo), float(hi))


# ---------------------------------------------------------------- the report


class PromptResult(msgspec.Struct, kw_only=True):
    prompt_id: str
    samples: int
    passed: int
    mean_reward: float


class EvalReport(msgspec.Struct, kw_only=True):
    env: str
    env_version: str
    options: dict[str, Any]
    model: str
    weights: str | None  # a published policy version loaded over the model
    policy_version: int | None  # its number, when the path says it (v<N>)
    seed: int
    prompts: int
    k: int  # samples per prompt
    samples: int
    temperature: float
    max_new_tokens: int
    max_turns: int
    pass_reward: float
    mean_reward: float
    pass_at_1: float
    pass_at_1_ci: tuple[float, float]
    pass_at_k: dict[int, float]
    pass_at_k_ci: dict[int, tuple[float, float]]
    ci_method: str
    truncated: int  # episodes stopped by max_turns or the token budget
    train_prompts: int  # held out from training prompts 0 .. train_prompts-1 (by content)
    candidates: int  # held-out candidates generated to find `prompts` unseen ones
    excluded_seen: int
    excluded_duplicate: int
    generate_errors: int
    seconds: float  # all of it: held-out prompts, model load, episodes, verification
    rollout_seconds: float  # episodes and verification only
    samples_per_s: float  # samples / rollout_seconds
    per_prompt: list[PromptResult]


def summarize(
    results: list[tuple[str, list[float]]], pass_reward: float, seed: int = 0
) -> dict[str, Any]:
    """The report's numbers from each prompt's rewards (every prompt with the same count)."""
    k_max = len(results[0][1])
    ks = ks_for(k_max)
    passes = [sum(r >= pass_reward - EPS for r in rewards) for _, rewards in results]
    per_k = {k: [pass_at_k(k_max, c, k) for c in passes] for k in ks}
    value = {k: sum(v) / len(v) for k, v in per_k.items()}
    ci = {k: bootstrap_ci(v, seed) for k, v in per_k.items()}
    rewards = [r for _, rs in results for r in rs]
    return {
        "mean_reward": sum(rewards) / len(rewards),
        "pass_at_1": value[1],
        "pass_at_1_ci": ci[1],
        "pass_at_k": value,
        "pass_at_k_ci": ci,
        "per_prompt": [
            PromptResult(prompt_id=pid, samples=len(rs), passed=c, mean_reward=sum(rs) / len(rs))
            for (pid, rs), c in zip(results, passes, strict=True)
        ],
    }


# ---------------------------------------------------------------- running it


def _weights_version(path: Path) -> schema.PolicyVersion:
    """A published policy version (``learner/publish.py``): a directory with
    ``model.safetensors``, a LoRA adapter directory, or a ``.safetensors`` file."""
    if path.is_file() and path.suffix == ".safetensors":
        directory, fmt = path.parent, "safetensors"
        if path.name != "model.safetensors":
            raise WeightsError(f"{str(path)!r}: expected model.safetensors or its directory")
    elif (path / "model.safetensors").is_file():
        directory, fmt = path, "safetensors"
    elif (path / "adapter_model.safetensors").is_file() and (
        path / "adapter_config.json"
    ).is_file():
        directory, fmt = path, "lora"
    else:
        raise WeightsError(
            f"{str(path)!r} is not a policy version (a directory with model.safetensors, or a "
            "LoRA adapter: adapter_model.safetensors and adapter_config.json)"
        )
    m = re.fullmatch(r"v(\d+)", directory.name)
    return schema.PolicyVersion(
        version=int(m.group(1)) if m else 0, step=0, path=str(directory.resolve()), format=fmt
    )


def _verify(env: Environment, task: schema.Task, trajectory: schema.Trajectory) -> Verdict:
    """As the verifier worker scores: from the trajectory's encoded state only."""
    verdict = env.verify(task, trajectory, env.decode_state(trajectory.state))
    if not (isinstance(verdict.reward, (int, float)) and math.isfinite(verdict.reward)):
        raise EvalError(f"{task.task_id}: verifier gave reward {verdict.reward!r}")
    return verdict


Progress = Callable[[int, int], None]  # (samples done, samples in all)
OnSample = Callable[[schema.Task, schema.Trajectory, Verdict], None]


async def _run(
    env: Environment,
    policy: Any,
    tasks: list[schema.Task],
    rollout: RolloutConfig,
    concurrency: int,
    progress: Progress | None,
    on_sample: OnSample | None,
) -> list[tuple[schema.Trajectory, Verdict]]:
    from streamrl.workers.episode import new_session, run_episode

    gate = asyncio.Semaphore(concurrency)
    results: list[Any] = [None] * len(tasks)
    done = 0

    async def one(i: int, task: schema.Task) -> None:
        nonlocal done
        async with gate:
            trajectory = await run_episode(env, policy, task, new_session(env, task), None, rollout)
        verdict = await asyncio.to_thread(_verify, env, task, trajectory)
        results[i] = (trajectory, verdict)
        if on_sample is not None:
            on_sample(task, trajectory, verdict)
        done += 1
        if progress is not None:
            progress(done, len(tasks))

    try:
        async with asyncio.TaskGroup() as tg:
            for i, task in enumerate(tasks):
                tg.create_task(one(i, task))
    except BaseExceptionGroup as eg:  # one clear error, not a group of them
        raise eg.exceptions[0] from None
    finally:
        await policy.close()
    return results


def evaluate(
    env_name: str,
    model: str,
    *,
    options: dict[str, Any] | None = None,
    weights: str | None = None,
    prompts: int = DEFAULT_PROMPTS,
    k: int = DEFAULT_K,
    seed: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    max_turns: int | None = None,
    pass_reward: float | None = None,
    train_prompts: int = DEFAULT_TRAIN_PROMPTS,
    policy_options: dict[str, Any] | None = None,
    rollout: RolloutConfig | None = None,
    progress: Progress | None = None,
    on_sample: OnSample | None = None,
) -> EvalReport:
    """Sample ``k`` episodes on each of ``prompts`` held-out prompts of ``env_name`` with the
    transformers model in ``model`` (plus ``weights``, a published policy version), verify
    them, and report pass@1 and pass@k (see the module docstring). Raises UnknownEnvironment,
    OptionError, ModelNotFound or EvalError on input it cannot use, before loading the model.
    ``on_sample`` sees every (task, trajectory, verdict) as it is scored."""
    if prompts < 1 or k < 1:
        raise EvalError(f"need at least one prompt and one sample (prompts={prompts}, k={k})")
    start = time.perf_counter()
    options = dict(options or {})
    env = make_env(env_name, **options)
    model_dir = require_model_dir(model, "--model")
    version = _weights_version(Path(weights).expanduser()) if weights else None
    threshold = env.max_reward if pass_reward is None else pass_reward
    heldout = heldout_prompts(env, prompts, seed, train_prompts, env_spec=env_name)
    rollout = msgspec.structs.replace(
        rollout or RolloutConfig(), **({"max_turns": max_turns} if max_turns else {})
    )
    tasks = [
        msgspec.structs.replace(t, task_id=f"{t.prompt_id}:{s}", k=s, group_size=k)
        for t in heldout.tasks
        for s in range(k)
    ]

    from streamrl.policy.hf import HFPolicy

    config = PolicyConfig(
        backend="hf",
        model=str(model_dir),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        options={**(policy_options or {}), "seed": seed},
    )
    policy = HFPolicy(config, env)  # no Redis URL: serves these weights only
    if version is not None:
        try:
            policy._load(version)  # what a rollout worker does when the learner announces it
        except Exception as e:
            raise WeightsError(f"{weights!r}: {type(e).__name__}: {e}") from None
    concurrency = 2 * policy.max_batch
    rollout_start = time.perf_counter()
    scored = asyncio.run(_run(env, policy, tasks, rollout, concurrency, progress, on_sample))
    rollout_seconds = time.perf_counter() - rollout_start

    by_prompt: dict[str, list[float]] = {}
    for task, (_, verdict) in zip(tasks, scored, strict=True):
        by_prompt.setdefault(task.prompt_id, []).append(float(verdict.reward))
    numbers = summarize(list(by_prompt.items()), threshold, seed)
    seconds = time.perf_counter() - start
    return EvalReport(
        env=env.name,
        env_version=env.version,
        options=env.options,
        model=str(model),
        weights=version.path if version else None,
        policy_version=version.version if version else None,
        seed=seed,
        prompts=prompts,
        k=k,
        samples=len(tasks),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        max_turns=rollout.max_turns,
        pass_reward=threshold,
        truncated=sum(t.status == "truncated" for t, _ in scored),
        ci_method=CI_METHOD,
        train_prompts=heldout.train_prompts,
        candidates=heldout.candidates,
        excluded_seen=heldout.excluded_seen,
        excluded_duplicate=heldout.excluded_duplicate,
        generate_errors=heldout.generate_errors,
        seconds=round(seconds, 3),
        rollout_seconds=round(rollout_seconds, 3),
        samples_per_s=round(len(tasks) / rollout_seconds, 2),
        **numbers,
    )


# ---------------------------------------------------------------- the command


def format_report(report: EvalReport) -> Any:
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
