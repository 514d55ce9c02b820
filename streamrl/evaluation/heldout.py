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
(the conversation the model sees, compared as msgpack bytes; an environment may add what else
makes a task, as ``lookup`` adds the codes its tool answers with) differs from that of every
training prompt ``0 .. T-1`` under *s* (``T = --train-prompts``, default 10,000) and from every
held-out prompt already kept. Environments with entities (``lookup``'s names) also take a
``split`` option, so that held-out prompts name entities no training prompt names. Held-out
prompt ids are ``<env>-heldout-s<s>-<j>``. The split is a pure function of (environment,
options, *s*, *T*), and a smaller ``--prompts`` takes a prefix of a larger one. The guarantee
covers training prompts ``0 .. T-1`` of seed *s*: for a run whose producer went further
(``streamrl produce`` pushes prompts ``0 .. --count-1``; Redis key
``srl:{run}:producer:env:<env>:seed=<s>`` holds its position), raise ``--train-prompts``. When
the prompt space has fewer unseen prompts than asked for, the command says so and stops.

The numbers are in ``estimators``; what the command is asked and answers, in ``spec``.
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
from streamrl.envs.base import Environment, Prompt, SampleMasked, Verdict
from streamrl.envs.registry import make_env
from streamrl.evaluation.estimators import CI_METHOD, summarize
from streamrl.evaluation.spec import DEFAULT_TRAIN_PROMPTS, EvalReport, EvalSpec
from streamrl.models.local import require_model_dir
from streamrl.producer.produce import training_seed

_INPUT_KEY = msgspec.msgpack.Encoder()


class EvalError(ValueError):
    """The evaluation cannot run as asked (too few held-out prompts, unusable weights)."""


class WeightsError(EvalError):
    """``weights`` is not a policy version this model can load."""


# ---------------------------------------------------------------- held-out prompts


def _heldout_seed(seed: int, index: int) -> str:
    return f"heldout:{seed}:{index}"


def _prompt_key(env: Environment, prompt: Prompt) -> bytes:
    """What makes two prompts the same prompt: by default the conversation the model is shown
    (see ``Environment.same_prompt_key``)."""
    return _INPUT_KEY.encode(env.same_prompt_key(prompt))


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
        seen.add(_prompt_key(env, prompt))
    budget = max_candidates if max_candidates is not None else 20 * count + 10_000
    kept: set[bytes] = set()
    tasks: list[schema.Task] = []
    excluded_seen = excluded_duplicate = errors = 0
    j = 0
    while len(tasks) < count and j < budget:
        try:
            prompt = env.generate(random.Random(_heldout_seed(seed, j)), j)
        except Exception:
            errors += 1
            j += 1
            continue
        key = _prompt_key(env, prompt)
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
    progress: Progress | None,
    on_sample: OnSample | None,
) -> list[tuple[schema.Trajectory, Verdict | SampleMasked]]:
    """Every episode at once, at most ``2 x max_batch`` in flight so batches fill."""
    from streamrl.policy.endpoint import Endpoints
    from streamrl.workers.episode import new_session, run_episode

    gate = asyncio.Semaphore(2 * policy.max_batch)
    endpoints = Endpoints(policy)  # an environment server's agent calls it (nemo-gym mode=run)
    results: list[Any] = [None] * len(tasks)
    done = 0

    async def one(i: int, task: schema.Task) -> None:
        nonlocal done
        async with gate:
            endpoint = await endpoints.for_env(env)
            trajectory = await run_episode(
                env, policy, task, new_session(env, task), None, rollout, endpoint=endpoint
            )
        try:
            verdict: Verdict | SampleMasked = await asyncio.to_thread(
                _verify, env, task, trajectory
            )
        except SampleMasked as e:  # not a measurement: its prompt is left out (_rewards_by_prompt)
            verdict = e
        results[i] = (trajectory, verdict)
        if on_sample is not None and isinstance(verdict, Verdict):
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
        await endpoints.stop()
        await policy.close()
    return results


def _episode_stats(env: Environment, trajectories: list[schema.Trajectory]) -> dict[str, float]:
    """How the episodes went, beyond their reward: turns, the model's tool calls (never the
    prompt's few-shot examples), and the share of those calls the environment refused before
    running them."""
    calls = [
        item
        for t in trajectories
        for item in t.items[t.n_input :]
        if isinstance(item, schema.FunctionCall)
    ]
    n = max(len(trajectories), 1)
    return {
        "turns_per_episode": round(sum(len(t.turns) for t in trajectories) / n, 3),
        "tool_calls_per_episode": round(len(calls) / n, 3),
        "malformed_call_rate": round(
            sum(env.malformed(c) is not None for c in calls) / max(len(calls), 1), 4
        ),
    }


def _samples(heldout: HeldOut, k: int) -> list[schema.Task]:
    """``k`` sample tasks of each held-out prompt, one group per prompt."""
    return [
        msgspec.structs.replace(t, task_id=f"{t.prompt_id}:{s}", k=s, group_size=k)
        for t in heldout.tasks
        for s in range(k)
    ]


def _rewards_by_prompt(
    tasks: list[schema.Task], scored: list[tuple[schema.Trajectory, Any]]
) -> tuple[list[tuple[str, list[float]]], dict[str, int]]:
    """Each prompt's rewards, and the samples the environment masked, by kind: a prompt with a
    masked sample is left out whole, as its group would be in training (pass@k needs every
    prompt's k samples), never counted as a 0."""
    by_prompt: dict[str, list[float]] = {}
    masked: dict[str, int] = {}
    left_out: set[str] = set()
    for task, (_, verdict) in zip(tasks, scored, strict=True):
        if isinstance(verdict, SampleMasked):
            masked[verdict.kind] = masked.get(verdict.kind, 0) + 1
            left_out.add(task.prompt_id)
        else:
            by_prompt.setdefault(task.prompt_id, []).append(float(verdict.reward))
    kept = [(p, rs) for p, rs in by_prompt.items() if p not in left_out]
    if not kept:
        raise EvalError(f"every prompt had a sample the environment masked ({masked})")
    return kept, masked


def _load_policy(
    spec: EvalSpec, env: Environment, model_dir: Path, version: schema.PolicyVersion | None
) -> Any:
    """The hf backend with no Redis URL, so it serves these weights only."""
    from streamrl.policy.hf import HFPolicy

    config = PolicyConfig(
        backend="hf",
        model=str(model_dir),
        temperature=spec.temperature,
        max_new_tokens=spec.max_new_tokens,
        options={**spec.policy_options, "seed": spec.seed},
    )
    policy = HFPolicy(config, env)
    if version is not None:
        try:
            policy.load(version)  # what a rollout worker does when the learner announces it
        except Exception as e:
            raise WeightsError(f"{spec.weights!r}: {type(e).__name__}: {e}") from None
    return policy


def evaluate(
    spec: EvalSpec, *, progress: Progress | None = None, on_sample: OnSample | None = None
) -> EvalReport:
    """Sample ``spec.k`` episodes on each of ``spec.prompts`` held-out prompts of ``spec.env``
    with the transformers model in ``spec.model`` (plus ``spec.weights``, a published policy
    version), verify them, and report pass@1 and pass@k (see ``estimators``). Raises
    UnknownEnvironment, OptionError, ModelNotFound or EvalError on input it cannot use, before
    loading the model. ``on_sample`` sees every (task, trajectory, verdict) as it is scored."""
    if spec.prompts < 1 or spec.k < 1:
        raise EvalError(
            f"need at least one prompt and one sample (prompts={spec.prompts}, k={spec.k})"
        )
    start = time.perf_counter()
    env = make_env(spec.env, **spec.options)
    model_dir = require_model_dir(spec.model, "--model")
    version = _weights_version(Path(spec.weights).expanduser()) if spec.weights else None
    threshold = env.max_reward if spec.pass_reward is None else spec.pass_reward
    heldout = heldout_prompts(env, spec.prompts, spec.seed, spec.train_prompts, env_spec=spec.env)
    rollout = msgspec.structs.replace(
        spec.rollout, **({"max_turns": spec.max_turns} if spec.max_turns else {})
    )
    tasks = _samples(heldout, spec.k)
    policy = _load_policy(spec, env, model_dir, version)

    rollout_start = time.perf_counter()
    scored = asyncio.run(_run(env, policy, tasks, rollout, progress, on_sample))
    rollout_seconds = time.perf_counter() - rollout_start
    by_prompt, masked = _rewards_by_prompt(tasks, scored)
    numbers = summarize(by_prompt, threshold, spec.seed)
    return EvalReport(
        env=env.name,
        env_version=env.version,
        options=env.options,
        model=str(spec.model),
        weights=version.path if version else None,
        policy_version=version.version if version else None,
        seed=spec.seed,
        prompts=spec.prompts,
        k=spec.k,
        samples=len(tasks),
        temperature=spec.temperature,
        max_new_tokens=spec.max_new_tokens,
        max_turns=rollout.max_turns,
        pass_reward=threshold,
        truncated=sum(t.status == "truncated" for t, _ in scored),
        masked=masked,
        **_episode_stats(env, [t for t, _ in scored]),
        ci_method=CI_METHOD,
        train_prompts=heldout.train_prompts,
        candidates=heldout.candidates,
        excluded_seen=heldout.excluded_seen,
        excluded_duplicate=heldout.excluded_duplicate,
        generate_errors=heldout.generate_errors,
        seconds=round(time.perf_counter() - start, 3),
        rollout_seconds=round(rollout_seconds, 3),
        samples_per_s=round(len(tasks) / rollout_seconds, 2),
        **msgspec.structs.asdict(numbers),
    )
